"""swiftlm vs TRL on alignment: DPO numerics on one batch, then DPO, KTO and GRPO step times.

    .venv/bin/python benchmarks/alignment.py [--only dpo|kto|grpo|all] [--steps 8] [--repeats 2]
        [--dtype fp32|bf16] [--model DIR] [--skip-check | --check-only] [--compiled]
        [--async_generate]

1. Environment. TRL runs in its own venv, the frameworks benchmark's `.venvs/trl` (TRL 1.16,
   transformers and peft as swiftlm's, torch 2.13.0 CPU build), made on first use by
   `benchmarks/frameworks/setup_envs.sh trl` from its pinned lock file. Every process here
   runs offline (HF_HUB_OFFLINE=1): models and tokenizers are built or converted locally.
2. Equality (fp32, always first unless --skip-check). A seeded 2-layer Llama (hidden 64, a
   ChatML BPE tokenizer trained in-process) and 4 preference pairs; a LoRA adapter (r 4 on
   q/v) with random A and B, so the policy differs from its reference (the base with the
   adapter disabled, in both tools). One forward + backward of DPO (sigmoid, beta 0.1) on the
   4 pairs as one batch: swiftlm's `DPO.loss` here, TRL's `DPOTrainer.compute_loss` in
   alignment_trl.py. Compared: the token ids and the positions scored, the loss and the mean
   rewards (max abs difference) and every adapter gradient (max abs difference over the
   tensor's max abs value); all must be <= 1e-5, else the exit status is 1.
   Tokenization: TRL scores everything after the rendered prompt, so under plain ChatML it
   would also score the newline after the answer's <|im_end|>, which swiftlm leaves out (it
   trains up to the end-of-turn token). The check's template therefore puts the newline
   before each turn instead of after it: the answer then ends the text at <|im_end|> and
   both score exactly the same tokens (checked).
3. Timing. DPO (and GRPO) runs of both tools alternate, swiftlm, TRL, swiftlm, TRL, ... each in
   a fresh process on the same model (default: swiftlm's default SmolLM2-135M-Instruct,
   converted from the packaged GGUF), data, batch, LoRA (r 8, alpha 32, all linear layers),
   optimizer and precision (fp32: no autocast in either; bf16: swiftlm's bf16 base weights +
   autocast, TRL's fp32 weights + the Trainer's bf16 autocast). Per-step wall times, taken
   after each optimizer step: swiftlm through the frameworks benchmark's hook
   (hooks/sitecustomize.py), TRL through the same JSON lines written by a TrainerCallback
   (alignment_trl.py; the hook cannot read GRPOTrainer's inputs). Steps 1-2 are warm-up, the time of
   steps 3..N is reported as the median step time, and the ratio TRL / swiftlm (> 1: swiftlm
   faster) is the median of the per-round ratios.
   DPO data: swiftlm/concise-preference in TRL's conversational layout, one file for both.
   DPO, KTO and GRPO also run swiftlm with `--padding_free false` (`swiftlm_padded`): the speed-up
   of padding-free answers. KTO reads the same pairs, each a desirable then an undesirable
   answer (TRL's rows unpaired by alignment_trl.py), loss `kto`, 8 answers per step.
   `--compiled` adds DPO and KTO runs with `--torch_compile true` (`swiftlm_compiled`: each
   decoder layer compiled by inductor); the table's wall column is the whole process, so the
   compilation in the first steps is counted there (the median step leaves it out).
   `--async_generate` adds a GRPO run with `--async_generate true` (`swiftlm_async`: the next
   generation sampled in the background while one trains).
   GRPO data: arithmetic questions with a `solution`; reward: the completion's last number
   equals it (swiftlm's built-in `accuracy`, the same rule in alignment_trl.py); loss `grpo`
   (swiftlm's default; TRL's is `dapo`), the same KL beta, no vLLM. The table also shows each
   tool's mean completion length (from its logged completions/mean_length), since sampled
   lengths drive the step time.

Runs, logs and results go to ~/.cache/swiftlm/bench-alignment/ ($SWIFTLM_CACHE).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FRAMEWORKS = HERE / "frameworks"
sys.path.insert(0, str(FRAMEWORKS))
from launch import OFFLINE_ENV, failure_reason, launch, read_steps  # noqa: E402

os.environ.update(OFFLINE_ENV)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TRL_VENV = FRAMEWORKS / ".venvs" / "trl"
TRL_PYTHON = TRL_VENV / "bin" / "python"
TRL_SCRIPT = HERE / "alignment_trl.py"
SWIFTLM = REPO / ".venv" / "bin" / "swiftlm"
WORK = Path(os.environ.get("SWIFTLM_CACHE", Path.home() / ".cache" / "swiftlm")) / "bench-alignment"
TOLERANCE = 1e-5
WARMUP_STEPS = 2
BETA, SEED = 0.1, 42

# -- environment ---------------------------------------------------------------------------------


def ensure_trl_venv() -> None:
    if (TRL_VENV / ".ok").exists():
        return
    print("TRL venv missing: running benchmarks/frameworks/setup_envs.sh trl", flush=True)
    subprocess.run(["bash", str(FRAMEWORKS / "setup_envs.sh"), "trl"], check=True)


def trl_version() -> str:
    installed = (TRL_VENV / "installed.txt").read_text().splitlines()
    keep = ("trl==", "transformers==", "peft==", "torch==")
    return ", ".join(line for line in installed if line.startswith(keep))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


# -- equality: assets ----------------------------------------------------------------------------

# ChatML with the newline before each turn rather than after it (see the module docstring).
CHECK_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n<|im_start|>assistant\\n' }}{% endif %}"
)
CHECK_CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 0",
    "Hello! How can I help you today? I do not know. Tell me a story about a cat.",
    "system user assistant question answer number is",
]
CHECK_PAIRS = [
    {
        "prompt": [{"role": "user", "content": f"Question number {i}?"}],
        "chosen": [{"role": "assistant", "content": f"Answer number {i} is {i * 7}."}],
        "rejected": [{"role": "assistant", "content": f"I do not know {i}" + " really" * i}],
    }
    for i in range(1, 5)
]
CHECK_LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def chatml_tokenizer(corpus: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `corpus`, with CHECK_TEMPLATE's ChatML
    (eos <|im_end|>, pad <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHECK_TEMPLATE
    return tokenizer


def build_check_model(out: Path) -> None:
    """A ChatML byte-level BPE tokenizer and a seeded 2-layer Llama, saved to `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = chatml_tokenizer(CHECK_CORPUS * 20, vocab_size=400)
    tokenizer.save_pretrained(out)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=None,
        initializer_range=0.1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)


def lora_model(model_dir: Path):
    """The fp32 base with a LoRA adapter whose A and B are both random (seeded)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(SEED)
    config = LoraConfig(**CHECK_LORA, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(base, config)


# -- equality: swiftlm side ------------------------------------------------------------------------


def swiftlm_dpo_batch(model_dir: Path, pairs: list[dict]):
    """(method, encoded samples, collated batch) of `pairs` under `swiftlm rlhf` defaults."""
    from transformers import AutoTokenizer

    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.methods.base import Layout
    from swiftlm.methods.registry import METHODS

    flags = {"beta": BETA, "loss_type": "sigmoid", "max_length": 512}
    cfg = from_flat_dict(RLHFConfig, flags)
    method = METHODS["dpo"](cfg, AutoTokenizer.from_pretrained(model_dir))
    samples = method.encode([method.to_sample(row) for row in pairs]).samples
    return method, samples, method.collate(Layout([[s] for s in samples], False))


def swiftlm_check(model_dir: Path, pairs: list[dict], adapter: Path) -> dict:
    """swiftlm's DPO loss (mean over pairs, as the loop normalizes), rewards and gradients."""
    from safetensors.torch import save_file

    method, samples, batch = swiftlm_dpo_batch(model_dir, pairs)
    model = lora_model(model_dir)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    save_file({n: p.detach().contiguous() for n, p in trainable.items()}, adapter)
    model.train()
    loss_sum, metrics = method.loss(model, batch)
    pairs_n = method.normalizer(batch)
    (loss_sum / pairs_n).backward()
    return {
        "loss": loss_sum.item() / pairs_n,
        "metrics": {k: v.item() / pairs_n for k, v in metrics.items()},
        "samples": samples,
        "grads": {n: p.grad.detach().clone() for n, p in trainable.items()},
    }


# -- equality: comparison ------------------------------------------------------------------------


def trl_sequences(trl: dict) -> list[tuple[list[int], list[int]]]:
    """(ids, scored positions) of each row of TRL's batch, padding removed."""
    rows = []
    for ids, attention, completion in zip(
        trl["input_ids"], trl["attention_mask"], trl["completion_mask"], strict=True
    ):
        keep = attention.bool()
        ids, completion = ids[keep].tolist(), completion[keep].tolist()
        rows.append((ids, [k for k, flag in enumerate(completion) if flag]))
    return rows


def swiftlm_sequences(samples: list[dict]) -> list[tuple[list[int], list[int]]]:
    """The same for swiftlm: chosen rows first, as TRL's batch; a label marks a scored token."""
    rows = []
    for side in ("chosen", "rejected"):
        for s in samples:
            labels = s[f"{side}_labels"]
            rows.append((s[f"{side}_input_ids"], [k for k, t in enumerate(labels) if t != -100]))
    return rows


def grad_difference(ours: dict, theirs: dict) -> tuple[float, str]:
    """Largest max|g_swiftlm - g_trl| / max|g_trl| over the adapter tensors, and which."""
    if ours.keys() != theirs.keys():
        raise SystemExit(f"different trainable tensors: {sorted(ours.keys() ^ theirs.keys())[:4]}")
    worst = max(
        ours,
        key=lambda n: ((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max()).item(),
    )
    rel = (ours[worst] - theirs[worst]).abs().max() / theirs[worst].abs().max()
    return rel.item(), worst


def run_check(work: Path) -> bool:
    import torch

    folder = work / "check"
    folder.mkdir(parents=True, exist_ok=True)
    build_check_model(folder / "model")
    pairs_file = write_jsonl(folder / "pairs.jsonl", CHECK_PAIRS)
    adapter, trl_out = folder / "adapter.safetensors", folder / "trl.pt"
    ours = swiftlm_check(folder / "model", CHECK_PAIRS, adapter)
    command = [
        str(TRL_PYTHON), str(TRL_SCRIPT), "check", "--model", str(folder / "model"),
        "--pairs", str(pairs_file), "--adapter", str(adapter), "--out", str(trl_out),
        "--beta", str(BETA), "--output_dir", str(folder / "trl-run"),
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=folder, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    theirs = torch.load(trl_out)
    same_tokens = swiftlm_sequences(ours["samples"]) == trl_sequences(theirs)
    grad_rel, grad_name = grad_difference(ours["grads"], theirs["grads"])
    rows = [("loss", ours["loss"], theirs["loss"])] + [
        (key, ours["metrics"][key], theirs["metrics"][key])
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins")
    ]
    print("\n## DPO on one batch, swiftlm vs TRL (fp32, 4 pairs, LoRA r 4 with random A and B)\n")
    print("| quantity | swiftlm | TRL | abs diff |\n|---|---|---|---|")
    worst = 0.0
    for name, a, b in rows:
        worst = max(worst, abs(a - b))
        print(f"| {name} | {a:.9f} | {b:.9f} | {abs(a - b):.2e} |")
    scored = sum(len(pos) for _, pos in swiftlm_sequences(ours["samples"]))
    grads = f"{grad_rel:.2e} (max rel, {grad_name})"
    print(f"| gradients ({len(ours['grads'])} adapter tensors) | | | {grads} |")
    tokens = "identical" if same_tokens else "DIFFERENT"
    print(f"| token ids and scored positions (8 rows, {scored} scored tokens) | | | {tokens} |")
    ok = same_tokens and worst <= TOLERANCE and grad_rel <= TOLERANCE
    print(f"\nequality within {TOLERANCE:g}: {'PASS' if ok else 'FAIL'}")
    return ok


# -- timing: data and commands -------------------------------------------------------------------

LORA_FLAGS = ["--train_type", "lora", "--lora_rank", "8", "--lora_alpha", "32",
              "--lora_dropout", "0", "--target_modules", "all-linear"]  # fmt: skip
DPO_BATCH, DPO_MAX_LENGTH, LEARNING_RATE = 4, 512, 1e-4
# GRPO: the batch counts completions (TRL's and swiftlm's meaning): 2 prompts x 4 samples.
GRPO_BATCH, GRPO_GENERATIONS, GRPO_COMPLETION, GRPO_TEMPERATURE, GRPO_BETA = 8, 4, 64, 1.0, 0.04


def dpo_data(folder: Path) -> Path:
    """swiftlm/concise-preference (126 pairs) in TRL's conversational layout: both read it."""
    rows = []
    source = REPO / "src" / "swiftlm" / "assets" / "concise_preference.jsonl"
    for line in source.read_text().splitlines():
        row = json.loads(line)
        *prompt, chosen = row["messages"]
        rejected = {"role": "assistant", "content": row["rejected_response"]}
        rows.append({"prompt": prompt, "chosen": [chosen], "rejected": [rejected]})
    return write_jsonl(folder / "dpo_pairs.jsonl", rows)


def grpo_data(folder: Path) -> dict[str, Path]:
    """64 sums to answer; swiftlm reads `messages`, TRL `prompt`; `solution` for the reward."""
    rows = []
    for i in range(64):
        a, b = 3 + 7 * i % 41, 5 + 11 * i % 37
        question = [{"role": "user", "content": f"What is {a} + {b}? Reply with the number."}]
        rows.append((question, str(a + b)))
    return {
        "swiftlm": write_jsonl(
            folder / "grpo_swiftlm.jsonl", [{"messages": q, "solution": s} for q, s in rows]
        ),
        "trl": write_jsonl(
            folder / "grpo_trl.jsonl", [{"prompt": q, "solution": s} for q, s in rows]
        ),
    }


def swiftlm_common(model: str, steps: int, dtype: str, out: Path) -> list[str]:
    precision = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    return [
        str(SWIFTLM), "rlhf", "--model", model, *LORA_FLAGS,
        "--gradient_accumulation_steps", "1", "--max_steps", str(steps),
        "--learning_rate", str(LEARNING_RATE), "--lr_scheduler_type", "constant",
        "--warmup_ratio", "0", "--weight_decay", "0", "--adam_beta2", "0.95",
        "--max_grad_norm", "1", "--gradient_checkpointing", "false", "--torch_dtype", precision,
        "--logging_steps", "1", "--save_steps", "100000", "--report_to", "none",
        "--seed", str(SEED), "--data_seed", str(SEED), "--output_dir", str(out),
    ]  # fmt: skip


def trl_common(part: str, model: str, steps: int, dtype: str, out: Path) -> list[str]:
    return [
        str(TRL_PYTHON), str(TRL_SCRIPT), part, "--model", model, "--steps", str(steps),
        "--learning_rate", str(LEARNING_RATE), "--dtype", dtype, "--output_dir", str(out),
        "--lora_rank", "8", "--lora_alpha", "32", "--seed", str(SEED),
    ]  # fmt: skip


def with_variant(commands: dict, name: str, flags: list[str], wanted: bool) -> dict:
    """`commands`, plus (when `wanted`) swiftlm's default with `flags` as `name`."""
    if wanted:
        default = commands["swiftlm"]
        commands[name] = lambda out: default(out) + flags
    return commands


def dpo_commands(model: str, data: Path, steps: int, dtype: str) -> dict:
    swiftlm = ["--rlhf_type", "dpo", "--dataset", str(data), "--beta", str(BETA),
               "--loss_type", "sigmoid", "--max_length", str(DPO_MAX_LENGTH),
               "--truncation_strategy", "right", "--per_device_train_batch_size", str(DPO_BATCH)]  # fmt: skip
    trl = ["--dataset", str(data), "--beta", str(BETA), "--max_length", str(DPO_MAX_LENGTH),
           "--batch_size", str(DPO_BATCH)]  # fmt: skip
    return {
        "swiftlm": lambda out: swiftlm_common(model, steps, dtype, out) + swiftlm,
        # swiftlm's DPO before padding-free pairs, for the speed-up they bring
        "swiftlm_padded": lambda out: (
            swiftlm_common(model, steps, dtype, out) + swiftlm + ["--padding_free", "false"]
        ),
        "trl": lambda out: trl_common("dpo", model, steps, dtype, out) + trl,
    }


def kto_commands(model: str, data: Path, steps: int, dtype: str) -> dict:
    """KTO on the DPO pairs (each pair: a desirable and an undesirable answer, in that
    order, for both tools); swiftlm padding-free (the default) and padded."""
    swiftlm = ["--rlhf_type", "kto", "--dataset", str(data), "--beta", str(BETA),
               "--max_length", str(DPO_MAX_LENGTH), "--truncation_strategy", "right",
               "--per_device_train_batch_size", str(2 * DPO_BATCH)]  # fmt: skip
    trl = ["--dataset", str(data), "--beta", str(BETA), "--max_length", str(DPO_MAX_LENGTH),
           "--batch_size", str(2 * DPO_BATCH)]  # fmt: skip
    return {
        "swiftlm": lambda out: swiftlm_common(model, steps, dtype, out) + swiftlm,
        "swiftlm_padded": lambda out: (
            swiftlm_common(model, steps, dtype, out) + swiftlm + ["--padding_free", "false"]
        ),
        "trl": lambda out: trl_common("kto", model, steps, dtype, out) + trl,
    }


def grpo_commands(
    model: str, data: dict[str, Path], steps: int, dtype: str, batch: int, generations: int
) -> dict:
    sampling = ["--num_generations", str(generations),
                "--max_completion_length", str(GRPO_COMPLETION),
                "--temperature", str(GRPO_TEMPERATURE), "--beta", str(GRPO_BETA)]  # fmt: skip
    swiftlm = ["--rlhf_type", "grpo", "--dataset", str(data["swiftlm"]), "--reward_funcs",
               "accuracy", "--loss_type", "grpo", "--per_device_train_batch_size",
               str(batch), *sampling]  # fmt: skip
    trl = ["--dataset", str(data["trl"]), "--batch_size", str(batch), *sampling]
    return {
        "swiftlm": lambda out: swiftlm_common(model, steps, dtype, out) + swiftlm,
        # padded completion rows, as every GRPO step ran before padding-free ones
        "swiftlm_padded": lambda out: (
            swiftlm_common(model, steps, dtype, out) + swiftlm + ["--padding_free", "false"]
        ),
        "trl": lambda out: trl_common("grpo", model, steps, dtype, out) + trl,
    }


def swiftlm_has_grpo() -> str | None:
    """None when `swiftlm rlhf --rlhf_type grpo` can run, else why not."""
    probe = "from swiftlm.methods.registry import METHODS; print('grpo' in METHODS)"
    done = subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), "-c", probe], capture_output=True, text=True
    )
    if done.returncode or done.stdout.strip() != "True":
        return "swiftlm has no GRPO method yet (swiftlm.methods.registry.METHODS has no 'grpo')"
    return None


# -- timing: runs --------------------------------------------------------------------------------


def timed_run(command: list[str], log_dir: Path, timeout_s: float) -> dict:
    """One run in a fresh process with the step hook; its step times after warm-up."""
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "command.txt").write_text(" ".join(command) + "\n")
    _, code, peak, wall = launch(command, log_dir, timeout_s)
    steps, _ = read_steps(log_dir / "steps.jsonl")
    times = [row["time"] for row in steps]
    durations = [b - a for a, b in zip(times[:-1], times[1:], strict=True)][WARMUP_STEPS - 1 :]
    result = {"log_dir": str(log_dir), "exit_code": code, "wall_s": wall,
              "peak_rss_gib": peak / 2**30, "steps": len(steps), "step_s": durations,
              "load_avg_end": os.getloadavg()[0]}  # fmt: skip
    if code != 0 or not durations:
        result["error"] = failure_reason(log_dir, code, timeout_s)
    else:
        result["median_step_s"] = statistics.median(durations)
    return result


def run_part(part: str, commands: dict, args: argparse.Namespace, root: Path) -> dict:
    """Alternate the tools for --repeats rounds; the median step time of each run."""
    commands = {tool: make for tool, make in commands.items() if tool not in args.skip_tools}
    runs = {tool: [] for tool in commands}
    for round_ in range(1, args.repeats + 1):
        for tool, command in commands.items():
            log_dir = root / f"{part}-{tool}-{round_}"
            print(f"[{part}] round {round_}: {tool} ...", flush=True)
            result = timed_run(command(log_dir / "out"), log_dir, args.timeout)
            result.update(completion_length(log_dir / "out" / "metrics.jsonl"))
            if (log_dir / "out" / "metrics.jsonl").exists():
                shutil.copy(log_dir / "out" / "metrics.jsonl", log_dir / "metrics.jsonl")
            shutil.rmtree(log_dir / "out", ignore_errors=True)
            runs[tool].append(result)
            print(f"[{part}] round {round_}: {tool}: {describe(result)}", flush=True)
    return runs


def completion_length(metrics: Path) -> dict:
    """GRPO: the mean of completions/mean_length over the timed steps (both tools log it)."""
    if not metrics.exists():
        return {}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    lengths = [
        row["completions/mean_length"]
        for row in rows
        if "completions/mean_length" in row and row.get("step", 0) > WARMUP_STEPS
    ]
    return {"completion_length": statistics.mean(lengths)} if lengths else {}


def describe(result: dict) -> str:
    if "error" in result:
        return f"FAILED ({result['error']})"
    return (f"median step {result['median_step_s']:.2f} s over {len(result['step_s'])} steps, "
            f"peak RSS {result['peak_rss_gib']:.2f} GiB, load {result['load_avg_end']:.1f}")  # fmt: skip


def speed_table(part: str, runs: dict, note: str) -> str:
    """Markdown: per tool the median over rounds; the median of the per-round TRL/swiftlm ratios."""
    lines = [f"### {part}: {note}", "",
             "| | median step (s) | process wall (s) | runs ok | peak RSS (GiB) | mean completion tokens |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for tool, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            errors = "; ".join(r["error"] for r in results)
            lines.append(f"| {tool} | failed: {errors[:200]} | | 0/{len(results)} | | |")
            continue
        step = statistics.median(r["median_step_s"] for r in ok)
        wall = statistics.median(r["wall_s"] for r in ok)
        rss = statistics.median(r["peak_rss_gib"] for r in ok)
        lengths = [r["completion_length"] for r in ok if "completion_length" in r]
        length = f"{statistics.mean(lengths):.1f}" if lengths else "-"
        lines.append(
            f"| {tool} | {step:.2f} | {wall:.0f} | {len(ok)}/{len(results)} | {rss:.2f} | {length} |"
        )
    for tool in (name for name in runs if name != "trl"):
        ratios = [
            t["median_step_s"] / s["median_step_s"]
            for s, t in zip(runs[tool], runs.get("trl", []), strict=False)
            if "error" not in s and "error" not in t
        ]
        if ratios:
            per_round = ", ".join(f"{r:.2f}" for r in ratios)
            lines.append(
                f"| TRL / {tool} step time (speed-up) | {statistics.median(ratios):.2f}x "
                f"(rounds: {per_round}) | | | | |"
            )
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------


def default_model() -> str:
    """swiftlm's default model (SmolLM2-135M-Instruct), converted once from its GGUF."""
    from swiftlm.models.loader import resolve_model

    return resolve_model(None).path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["dpo", "kto", "grpo", "all"], default="all",
                        help="which timing to run (the equality check runs unless --skip-check)")  # fmt: skip
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--check-only", action="store_true", help="only the equality check")
    parser.add_argument("--model", help="a local HF folder (default: swiftlm's default model)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (>= 4)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds (swiftlm, TRL) per part")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    parser.add_argument("--grpo_batch", type=int, default=GRPO_BATCH, help="completions per step")
    parser.add_argument("--grpo_generations", type=int, default=GRPO_GENERATIONS)
    parser.add_argument("--skip_tools", nargs="*", default=[],
                        help="runs to leave out, e.g. swiftlm_padded")  # fmt: skip
    parser.add_argument("--async_generate", action="store_true",
                        help="GRPO: also run swiftlm with --async_generate true")  # fmt: skip
    parser.add_argument("--compiled", action="store_true",
                        help="DPO and KTO: also run swiftlm with --torch_compile true")  # fmt: skip
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.steps < WARMUP_STEPS + 2:
        raise SystemExit(f"--steps must be at least {WARMUP_STEPS + 2}")
    WORK.mkdir(parents=True, exist_ok=True)
    ensure_trl_venv()
    print(f"TRL venv: {trl_version()}", flush=True)
    ok = True
    if not args.skip_check:
        ok = run_check(WORK)
    if args.check_only:
        return 0 if ok else 1
    model = args.model or default_model()
    root = WORK / "runs" / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True)
    note = (f"{Path(model).name}, LoRA r 8 all-linear, {args.dtype}, {args.steps} steps "
            f"(first {WARMUP_STEPS} warm-up), {args.repeats} rounds, {os.cpu_count()} CPUs")  # fmt: skip
    tables, raw = [], {}
    if args.only in ("dpo", "all"):
        commands = dpo_commands(model, dpo_data(root), args.steps, args.dtype)
        commands = with_variant(
            commands, "swiftlm_compiled", ["--torch_compile", "true"], args.compiled
        )
        raw["dpo"] = run_part("dpo", commands, args, root)
        setting = f"batch {DPO_BATCH} pairs, max_length {DPO_MAX_LENGTH}, beta {BETA}, sigmoid"
        tables.append(speed_table("DPO", raw["dpo"], f"{note}; {setting}"))
    if args.only in ("kto", "all"):
        commands = kto_commands(model, dpo_data(root), args.steps, args.dtype)
        commands = with_variant(
            commands, "swiftlm_compiled", ["--torch_compile", "true"], args.compiled
        )
        raw["kto"] = run_part("kto", commands, args, root)
        setting = f"batch {2 * DPO_BATCH} answers, max_length {DPO_MAX_LENGTH}, beta {BETA}"
        tables.append(speed_table("KTO", raw["kto"], f"{note}; {setting}"))
    if args.only in ("grpo", "all"):
        commands = grpo_commands(
            model, grpo_data(root), args.steps, args.dtype, args.grpo_batch, args.grpo_generations
        )
        commands = with_variant(
            commands, "swiftlm_async", ["--async_generate", "true"], args.async_generate
        )
        missing = swiftlm_has_grpo()
        if missing:
            print(f"[grpo] swiftlm: NOT RUN: {missing}; timing TRL alone", flush=True)
            commands.pop("swiftlm")
        raw["grpo"] = run_part("grpo", commands, args, root)
        batch, generations = args.grpo_batch, args.grpo_generations
        setting = (f"batch {batch} completions = {batch // generations} prompts x "
                   f"{generations}, max_completion_length {GRPO_COMPLETION}, temperature "
                   f"{GRPO_TEMPERATURE}, beta {GRPO_BETA}, no vLLM")  # fmt: skip
        table = speed_table("GRPO", raw["grpo"], f"{note}; {setting}")
        if missing:
            table += f"\n\nswiftlm GRPO: not measured: {missing}."
        tables.append(table)
    report = "\n\n".join(tables)
    print("\n" + report)
    (root / "results.json").write_text(json.dumps({"args": vars(args), "runs": raw}, indent=1))
    (root / "results.md").write_text(report + "\n")
    print(f"\nraw runs and logs: {root}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
