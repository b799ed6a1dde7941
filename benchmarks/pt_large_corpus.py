"""`swiftlm pt` on a generated pre-training corpus far larger than the samples it trains on:
the tokenization throughput, the main process's peak memory, and a resume deep in an epoch.

    python benchmarks/pt_large_corpus.py --size_mb 2048 --work /tmp/pt-bench

1. A deterministic JSON Lines corpus of `--size_mb` MB (`{"text": ...}` documents of 200 to
   40,000 characters, words from a Zipf-distributed vocabulary in sentences) is written once.
2. `swiftlm pt` (a tiny Llama with SmolLM2's tokenizer, `--dataset_num_proc 2`) tokenizes it
   into token shards and trains a few steps, in its own process: peak RSS of that main process
   (`getrusage` at exit; the workers are other processes) and its tokenization throughput.
3. The same text and tokenizer through `datasets.Dataset.from_json(...).map(tokenize,
   batched=True, num_proc=2)`, in its own process: throughput and the ratio.
4. A resume at 60% of the epoch: a checkpoint of the run above with its data position moved
   to 60% of the epoch's micro-batches (the state a run that trained that far saves: training
   that many steps for real would take days on a CPU), resumed with
   `--resume_from_checkpoint`; the time from process start to the first resumed step's
   metrics line, the content hash of the corpus included.

Times are wall clock on this machine (shared cores: compare the ratios).
"""

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "be",
    "da",
    "fe",
    "gi",
    "hu",
    "ja",
    "ke",
    "la",
    "mo",
    "nu",
    "pe",
    "ri",
    "se",
    "to",
    "u",
    "ve",
    "wa",
]


def _vocabulary(rng: random.Random, size: int = 20_000) -> list[str]:
    words = set()
    while len(words) < size:
        words.add("".join(rng.choices(SYLLABLES, k=rng.choice((1, 2, 2, 3, 3, 4)))))
    return sorted(words)


def _sentences(rng: random.Random, count: int = 50_000) -> list[str]:
    words = _vocabulary(rng)
    weights = [1 / (rank + 1) for rank in range(len(words))]  # Zipf: a few words most often
    sentences = []
    for _ in range(count):
        picked = rng.choices(words, weights, k=rng.randint(4, 24))
        if rng.random() < 0.3:
            picked.insert(rng.randrange(len(picked)), str(rng.randint(1, 2026)))
        sentence = " ".join(picked)
        sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".....?!"))
    return sentences


def generate_corpus(path: Path, size_mb: int, seed: int = 0) -> Path:
    """Write the corpus once (a `.done` marker names its size and seed)."""
    marker = path.with_suffix(".done")
    if marker.is_file() and marker.read_text() == f"{size_mb} {seed}":
        return path
    rng = random.Random(seed)
    sentences = _sentences(rng)
    target, written = size_mb * 1_000_000, 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            length = int(min(40_000, max(200, rng.lognormvariate(7.5, 1.0))))
            parts, size = [], 0
            while size < length:
                parts.append(rng.choice(sentences))
                size += len(parts[-1]) + 1
                if rng.random() < 0.08:
                    parts.append("\n\n")
            line = json.dumps({"text": " ".join(parts).replace(" \n\n ", "\n\n")}) + "\n"
            f.write(line)
            written += len(line)
    marker.write_text(f"{size_mb} {seed}")
    return path


def tiny_model(folder: Path) -> Path:
    """A 2-layer Llama (hidden 64) with SmolLM2's tokenizer (49,152 tokens)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from swiftlm.models.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Run inside the measured child: swiftlm's CLI, then the process's own peak RSS.
STAGES = ("train", "compare", "resume")
BATCH = 2  # chunks per step: a step of the tiny model takes well under a second

PEAK_RSS_CHILD = """
import resource, sys
from swiftlm.cli.main import main
code = main(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""


def pt_argv(model: Path, data: Path, out: Path, **flags) -> list[str]:
    options = dict(torch_dtype="float32", report_to="none", logging_steps=1, max_length=512)
    options.update(per_device_train_batch_size=BATCH, dataset_num_proc=2, save_steps=10_000)
    options.update(flags)
    argv = ["pt", "--model", str(model), "--dataset", str(data), "--output_dir", str(out)]
    for name, value in options.items():
        argv += [f"--{name}", str(value)]
    return argv


def run_pt(argv: list[str], env: dict, metrics: Path | None = None, after_step: int = 0):
    """(output, peak RSS in MB of swiftlm's process, (wall, CPU) seconds until a metrics row
    of a step after `after_step` appeared, or None)."""
    import psutil

    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", PEAK_RSS_CHILD, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first_step, polled_peak = None, 0
    watched = psutil.Process(child.pid)
    while child.poll() is None:
        with contextlib.suppress(psutil.Error):
            polled_peak = max(polled_peak, watched.memory_info().rss)
        if first_step is None and metrics is not None and metrics.is_file():
            steps = [json.loads(r).get("step", 0) for r in metrics.read_text().splitlines()]
            if any(step > after_step for step in steps):
                cpu = watched.cpu_times()
                first_step = (time.perf_counter() - started, cpu.user + cpu.system)
        time.sleep(0.02)
    output = child.stdout.read()
    if child.returncode:
        raise SystemExit(f"swiftlm pt failed ({child.returncode}):\n{output[-4000:]}")
    peak_kb = int(next(line.split()[1] for line in output.splitlines() if "PEAK_RSS_KB" in line))
    return output, max(peak_kb * 1024, polled_peak) / 1e6, first_step


def datasets_map(data: Path, model: Path, cache: Path) -> dict:
    """In this (child) process: datasets' JSON load and 2-process batched map."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    started = time.perf_counter()
    table = datasets.Dataset.from_json(str(data), cache_dir=str(cache))
    loaded = time.perf_counter()

    def tokenize(batch):
        return tokenizer(batch["text"], add_special_tokens=False)

    mapped = table.map(tokenize, batched=True, num_proc=2, remove_columns=["text"])
    done = time.perf_counter()
    lengths = mapped.map(
        lambda b: {"n": [len(x) for x in b["input_ids"]]}, batched=True, num_proc=2
    )
    tokens = sum(lengths["n"])
    return {"load_s": loaded - started, "map_s": done - loaded, "tokens": tokens}


def _child_json(code: str, tag: str, env: dict | None = None) -> dict:
    """Run `code` in a fresh interpreter (this folder importable); the JSON after `tag`."""
    script = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); {code}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(tag + " ")), None)
    if line is None:
        raise SystemExit(f"{tag} failed:\n{done.stderr[-4000:]}")
    return json.loads(line[len(tag) + 1 :])


def swiftlm_shards(data: Path, model: Path, workers: int) -> dict:
    """In this (child) process: swiftlm's token shards of `data` with `workers` processes."""
    from transformers import AutoTokenizer

    from swiftlm.data.token_shards import build_shards

    tokenizer = AutoTokenizer.from_pretrained(model)
    folder = data.with_name(data.stem + "-shards")
    meta = build_shards([str(data)], tokenizer, folder, workers=workers)
    shutil.rmtree(folder)
    return {"tokenize_s": meta["encode_seconds"], "tokens": meta["tokens"]}


def first_megabytes(data: Path, size_mb: int) -> Path:
    """The corpus's first whole lines up to `size_mb` MB (the comparison's text)."""
    part = data.with_name(f"{data.stem}-first-{size_mb}mb.jsonl")
    if not part.is_file():
        with data.open("rb") as source, part.open("wb") as out:
            out.write(source.read(size_mb * 1_000_000))
            out.write(source.readline())
    return part


def compare(data: Path, model: Path, work: Path) -> dict:
    """Tokenization throughput of the same text and tokenizer, 2 processes each: swiftlm's
    token shards against `datasets.Dataset.from_json(...).map(num_proc=2)`."""
    size = data.stat().st_size / 1e6
    mine = _child_json(
        f"from pt_large_corpus import swiftlm_shards; from pathlib import Path; "
        f"print('SWIFTLM', json.dumps(swiftlm_shards(Path({str(data)!r}), "
        f"Path({str(model)!r}), 2)))",
        "SWIFTLM",
    )
    cache = work / "hf-cache"
    shutil.rmtree(cache, ignore_errors=True)
    hf = _child_json(
        f"from pt_large_corpus import datasets_map; from pathlib import Path; "
        f"print('HF', json.dumps(datasets_map(Path({str(data)!r}), Path({str(model)!r}), "
        f"Path({str(cache)!r}))))",
        "HF",
    )
    shutil.rmtree(cache, ignore_errors=True)
    hf_s = hf["load_s"] + hf["map_s"]
    return {
        "text_mb": round(size, 1),
        "swiftlm_s": round(mine["tokenize_s"], 1),
        "swiftlm_MB_per_s": round(size / mine["tokenize_s"], 2),
        "swiftlm_tokens_per_s": round(mine["tokens"] / mine["tokenize_s"]),
        "datasets_s": round(hf_s, 1),
        "datasets_load_s": round(hf["load_s"], 1),
        "datasets_MB_per_s": round(size / hf_s, 2),
        # swiftlm's tokens include the EOS after each document.
        "datasets_tokens_per_s": round(hf["tokens"] / hf_s),
        "speedup": round(hf_s / mine["tokenize_s"], 2),
        "load_average": os.getloadavg()[0],
    }


def train_run(work: Path, data: Path, model: Path, env: dict) -> dict:
    """`swiftlm pt` from an empty cache: tokenize (2 workers) + 6 steps, saved at step 6."""
    size = data.stat().st_size
    shutil.rmtree(work / "cache", ignore_errors=True)
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    _, peak_mb, _ = run_pt(pt_argv(model, data, run, max_steps=6, save_steps=6), env)
    meta = json.loads(next((work / "cache").glob("shards-*/meta.json")).read_text())
    return {
        "tokenize_s": round(meta["encode_seconds"], 1),
        "MB_per_s": round(size / 1e6 / meta["encode_seconds"], 2),
        "tokens": meta["tokens"],
        "tokens_per_s": round(meta["tokens"] / meta["encode_seconds"]),
        "main_process_peak_rss_mb": round(peak_mb),
        "load_average": os.getloadavg()[0],
    }


def measure(work: Path, size_mb: int, compare_mb: int = 0, stages=STAGES) -> dict:
    """The stages asked for; `compare_mb` > 0 compares throughput on the corpus's first
    `compare_mb` MB (a shorter measurement on a busy machine), else on all of it."""
    data = generate_corpus(work / f"corpus-{size_mb}mb.jsonl", size_mb)
    model = tiny_model(work / "tiny-smollm2")
    env = {**os.environ, "SWIFTLM_DATA_CACHE": str(work / "cache")}
    results: dict = {"corpus_mb": round(data.stat().st_size / 1e6, 1)}
    if "train" in stages:
        results["swiftlm_pt"] = train_run(work, data, model, env)
        print("swiftlm pt:", json.dumps(results["swiftlm_pt"]), flush=True)
    if "compare" in stages:
        text = first_megabytes(data, compare_mb) if compare_mb else data
        results["tokenization_2_workers"] = compare(text, model, work)
        print("compare:", json.dumps(results["tokenization_2_workers"]), flush=True)
    if "resume" in stages:
        results["resume_at_60pct"] = resume_at(work / "run", model, data, env, fraction=0.6)
        results["content_hash_s"] = round(_hash_seconds(data), 2)  # paid once, remembered
    return results


def resume_at(run: Path, model: Path, data: Path, env: dict, fraction: float) -> dict:
    """Move the step-6 checkpoint's data position to `fraction` of the epoch; time a resume."""
    checkpoint = run / "checkpoints" / "step-6"
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    micro_batches = -(-state["num_train_samples"] // BATCH)  # one rank
    step = int(fraction * micro_batches)
    state.update(step=step, micro_batch=step)
    state["scheduler"].update(last_epoch=step, _step_count=step + 1)
    state_file.write_text(json.dumps(state))
    (checkpoint / "COMPLETE").write_text(f"step {step}\n")
    checkpoint.rename(checkpoint.with_name(f"step-{step}"))
    shutil.rmtree(run / "final", ignore_errors=True)
    metrics = run / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    flags = dict(max_steps=step + 3, save_steps=10_000, resume_from_checkpoint="auto")
    output, peak_mb, first = run_pt(pt_argv(model, data, run, **flags), env, metrics, step)
    resumed = [line for line in output.splitlines() if "resumed from" in line]
    return {
        "epoch_micro_batches": micro_batches,
        "resumed_at_step": step,
        "first_step_after_s": round(first[0], 2) if first else None,
        "first_step_after_cpu_s": round(first[1], 2) if first else None,
        "load_average": os.getloadavg()[0],
        "peak_rss_mb": round(peak_mb),
        "log": resumed[:1],
    }


def _hash_seconds(data: Path) -> float:
    """A sha256 of the whole corpus: what a first run pays to key its entry."""
    import hashlib

    started = time.perf_counter()
    with data.open("rb") as f:
        hashlib.file_digest(f, "sha256")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size_mb", type=int, default=2048)
    parser.add_argument("--work", type=Path, default=Path("/tmp/pt-large-corpus"))
    parser.add_argument(
        "--compare_mb", type=int, default=0, help="compare throughput on the first N MB"
    )
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(measure(args.work, args.size_mb, args.compare_mb, args.stages), indent=1))


if __name__ == "__main__":
    main()
