"""The GPU check: everything this project measures on a GPU, in one run of under 10 minutes,
written to one JSON file (issue 32). On a GPU machine, through `scripts/gpu_check.sh`:

    python scripts/gpu_check.py --out gpu_check.json [--smoke]

1. The machine: GPU, its bf16 peak, torch and transformers versions.
2. `pytest -m gpu tests/gpu`: passed, failed, skipped.
3. SFT: a 0.5B Qwen2-shaped model (Qwen2.5-0.5B's config, random weights, a BPE tokenizer
   trained here: no hub), full-parameter bf16, 30 steps, packing, the fused loss, SDPA; its
   tokens/s and MFU against the device's bf16 peak (swiftlm's own summary.json); then the same
   run with `--fp8_recipe tensorwise` (torchao float8: native on sm89+, emulated elsewhere).
4. DPO and GRPO on the same model, 10 steps each (benchmarks/alignment.py's settings: LoRA r 8
   on all linear layers), tokens/s and step time; DPO also with TRL in the same run where TRL
   imports, alternating, and the ratio of median step times (> 1: swiftlm faster).
5. `benchmarks/serving.py --servers swiftlm --clients 1 32` on the same model.

Each part runs in its own process with its own time limit; a part that fails is recorded
with its error and the log's tail, and the next part runs. `--smoke` runs every part on a
tiny model for a few steps (on a CPU too): what the test suite runs, so the script works the
day a GPU machine is lent (tests/integration/test_gpu_check.py).
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import alignment  # noqa: E402  (benchmarks/alignment.py: DPO/GRPO commands, step timing)

# Qwen2.5-0.5B's shape (tied embeddings; its vocabulary, larger than the tokenizer built here,
# so the lm-head costs what it costs in the real model).
FULL_MODEL = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
)  # fmt: skip
SMOKE_MODEL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True,
)  # fmt: skip
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "which",
    "model",
    "data",
    "train",
    "token",
    "layer",
    "loss",
    "step",
    "river",
    "ocean",
    "moon",
    "bee",
    "glacier",
    "desert",
    "owl",
    "story",
    "answer",
    "question",
    "number",
    "seven",
    "eight",
    "nine",
    "fast",
    "slow",
    "bright",
    "dark",
    "north",
    "south",
    "learn",
    "teach",
    "write",
    "read",
]


def settings(smoke: bool) -> dict:
    if smoke:
        return dict(model=SMOKE_MODEL, sft_steps=3, sft_length=256, sft_batch=2, rl_steps=4,
                    prompts=4, clients=[1, 2], new_tokens=8, tests=False, timeout=600)  # fmt: skip
    return dict(model=FULL_MODEL, sft_steps=30, sft_length=4096, sft_batch=8, rl_steps=10,
                prompts=64, clients=[1, 32], new_tokens=128, tests=True, timeout=240)  # fmt: skip


# -- the model and data ----------------------------------------------------------------------


def build_model(folder: Path, shape: dict) -> None:
    """A BPE tokenizer (ChatML) trained on WORDS, and a Qwen2 model of `shape`, random."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    alignment.chatml_tokenizer([" ".join(WORDS)] * 50, vocab_size=1024).save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2Config(
        **shape, max_position_embeddings=8192, pad_token_id=0, eos_token_id=2, bos_token_id=None
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def sft_data(path: Path, rows: int, words: int) -> Path:
    """Chat rows of seeded random words, answers of about `words` words."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    samples = [
        {"messages": [{"role": "user", "content": text(20)},
                      {"role": "assistant", "content": text(rng.randint(words // 2, words))}]}
        for _ in range(rows)
    ]  # fmt: skip
    return alignment.write_jsonl(path, samples)


# -- the parts -------------------------------------------------------------------------------


def machine() -> dict:
    import torch
    import transformers

    from swiftlm.monitor.mfu import peak_flops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "bf16_peak_tflops": peak_flops(device, torch.bfloat16) / 1e12,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
    }


def run(command: list[str], log: Path, timeout: float) -> dict:
    """One part's process; its exit code, wall time and, on failure, the log's tail."""
    start = time.monotonic()
    with log.open("w") as out:
        try:
            code = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"exit_code": code, "wall_s": round(time.monotonic() - start, 1)}
    if code != 0:
        result["log_tail"] = log.read_text(errors="replace")[-3000:]
    return result


def gpu_tests(work: Path, timeout: float) -> dict:
    log = work / "gpu_tests.log"
    result = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"], log, timeout)
    summary = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    counts = dict(
        (kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary[0])
    )
    return {**result, "summary": summary[0], **counts}


def swiftlm(*args: str) -> list[str]:
    return [sys.executable, "-m", "swiftlm", *args]


def sft(model: Path, data: Path, out: Path, s: dict, *flags: str) -> dict:
    """Full bf16 SFT with packing; `flags` add to it (the FP8 part's --fp8_recipe)."""
    command = swiftlm(
        "sft", "--model", str(model), "--dataset", str(data), "--output_dir", str(out),
        "--train_type", "full", "--torch_dtype", "bfloat16", "--packing", "true",
        "--max_length", str(s["sft_length"]), "--per_device_train_batch_size", str(s["sft_batch"]),
        "--max_steps", str(s["sft_steps"]), "--attn_impl", "sdpa", "--gradient_checkpointing",
        "false", "--logging_steps", "1", "--save_steps", "100000", "--report_to", "none", *flags,
    )  # fmt: skip
    result = run(command, out.parent / f"{out.name}.log", s["timeout"])
    return {**result, **_summary(out)}


def _summary(out: Path) -> dict:
    path = out / "summary.json"
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text())
    keep = ("steps", "train_time_s", "tokens_per_second", "label_tokens_per_second", "mfu")
    return {key: summary[key] for key in keep if key in summary}


def rl_part(name: str, commands: dict, work: Path, s: dict, tools: tuple[str, ...]) -> dict:
    """`alignment.timed_run` of each tool (alternating, one round): median step times."""
    part = {}
    for tool in tools:
        log_dir = work / f"{name}-{tool}"
        command = commands[tool](log_dir / "out")
        command = _here(command)
        result = alignment.timed_run(command, log_dir, s["timeout"])
        result.update(_summary(log_dir / "out"))
        result.pop("step_s", None)
        part[tool] = result
    if all("median_step_s" in part.get(tool, {}) for tool in ("swiftlm", "trl")):
        part["trl_over_swiftlm_step_time"] = (
            part["trl"]["median_step_s"] / part["swiftlm"]["median_step_s"]
        )
    return part


def _here(command: list[str]) -> list[str]:
    """alignment.py's commands, with this interpreter in place of its venvs' programs."""
    program = command[0]
    if program == str(alignment.SWIFTLM):
        return swiftlm(*command[1:])
    if program == str(alignment.TRL_PYTHON):
        return [sys.executable, *command[1:]]
    return command


def trl_missing() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("trl") else "trl is not installed here"


def serving(model: Path, work: Path, s: dict) -> dict:
    out = work / "serving.json"
    command = [
        sys.executable,
        "benchmarks/serving.py",
        "--servers",
        "swiftlm",
        "--model",
        str(model),
    ]
    command += [
        "--prompts",
        str(s["prompts"]),
        "--single_client_prompts",
        str(s["prompts"] // 4 or 1),
    ]
    command += [
        "--new_tokens",
        str(s["new_tokens"]),
        "--json",
        str(out),
        "--logs",
        str(work / "serving-logs"),
    ]
    command += ["--clients", *map(str, s["clients"])]
    result = run(command, work / "serving.log", s["timeout"])
    if out.is_file():
        result["swiftlm"] = json.loads(out.read_text()).get("swiftlm")
    return result


def _failed(value) -> bool:
    """A part (or a tool's run inside one) that raised or exited non-zero."""
    if not isinstance(value, dict):
        return False
    if "error" in value or value.get("exit_code") not in (None, 0):
        return True
    return any(_failed(inner) for inner in value.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--work", type=Path, help="models, data and logs (default: beside --out)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few steps (CPU too)")
    args = parser.parse_args()
    s = settings(args.smoke)
    work = args.work or args.out.parent / "gpu_check_work"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(alignment.OFFLINE_ENV)
    report: dict = {
        "smoke": args.smoke,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def part(name: str, make) -> None:
        print(f"== {name}", flush=True)
        start = time.monotonic()
        try:
            report[name] = make()
        except Exception as exc:  # recorded; the next part still runs
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["part_s"] = round(time.monotonic() - start, 1)
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # what is done so far
        print(json.dumps(report[name])[:600], flush=True)

    model = work / "model"
    part("machine", machine)
    if s["tests"]:
        part("gpu_tests", lambda: gpu_tests(work, 180))
    part("model", lambda: build_model(model, s["model"]) or {"folder": str(model), **s["model"]})
    data = sft_data(work / "sft.jsonl", 400, s["sft_length"] // 8)
    part("sft", lambda: sft(model, data, work / "sft", s))
    # FP8 (torchao float8, tensorwise scales) against the bf16 run above: tokens/s and MFU.
    part("sft_fp8", lambda: sft(model, data, work / "sft_fp8", s, "--fp8_recipe", "tensorwise"))
    tools = ("swiftlm", "trl") if trl_missing() is None else ("swiftlm",)
    dpo = alignment.dpo_commands(str(model), alignment.dpo_data(work), s["rl_steps"], "bf16")
    part("dpo", lambda: {**rl_part("dpo", dpo, work, s, tools), "trl_missing": trl_missing()})
    grpo = alignment.grpo_commands(
        str(model), alignment.grpo_data(work), s["rl_steps"], "bf16", 8, 4
    )
    part("grpo", lambda: rl_part("grpo", grpo, work, s, ("swiftlm",)))
    part("serving", lambda: serving(model, work, s))
    failed = [name for name, value in report.items() if _failed(value)]
    report["failed_parts"] = failed
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}; failed parts: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
