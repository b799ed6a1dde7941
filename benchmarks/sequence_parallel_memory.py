"""How long a sequence trains at a fixed memory per rank: one process against sequence parallel
over 2 processes (`--sequence_parallel_size 2`, Ulysses and ring), side by side in one run.

    python benchmarks/sequence_parallel_memory.py [--lengths 2048 4096 8192 16384]

The model: a seeded Llama built in-process (4 layers, hidden 512, 8 heads, 4 key/value heads,
MLP 1,536, SmolLM2's tokenizer and 49,152-token vocabulary, tied embeddings: ~45M
parameters). `swiftlm pt` with LoRA, one row of `--max_length` tokens per step, 2 steps, on the
packaged held-out text repeated; each run in its own processes. The figure is the peak
resident memory of rank 0 (`memory_gib`, the largest over the logged steps; the ranks of a
sequence-parallel group hold the same amounts).

The budget is the one-process peak at the length given by `--budget_length`; the table then
says the longest length each layout trains within it, measured on the grid and interpolated
linearly between grid points (activation memory grows linearly with the length: attention
never holds a [T, T] matrix, the loss never holds [T, vocab] logits).
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from seeded_llama import save_seeded_llama  # noqa: E402


def build_model(folder: Path) -> Path:
    return save_seeded_llama(
        folder, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=65536,
    )  # fmt: skip


def write_corpus(path: Path, tokens_needed: int) -> Path:
    text = (Path(__file__).parents[1] / "src/swiftlm/assets/heldout.txt").read_text()
    documents = tokens_needed // 400 + 1  # the held-out text is ~450 tokens
    path.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(documents)))
    return path


LAYOUTS = {"one process": None, "Ulysses 2": "ulysses", "ring 2": "ring"}


def peak_gib(model: Path, corpus: Path, out: Path, length: int, impl, port: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    argv = [
        sys.executable, "-m", "swiftlm", "pt", "--model", str(model), "--dataset", str(corpus),
        "--output_dir", str(out), "--max_length", str(length), "--per_device_train_batch_size",
        "1", "--max_steps", "2", "--logging_steps", "1", "--report_to", "none",
        "--save_steps", "100", "--split_dataset_ratio", "0", "--lora_dropout", "0",
    ]  # fmt: skip
    if impl is not None:
        argv += ["--nproc_per_node", "2", "--sequence_parallel_size", "2"]
        argv += ["--sequence_parallel_impl", impl, "--master_port", str(port)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"length {length}, {impl or 'one process'} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return max(row["memory_gib"] for row in rows if "memory_gib" in row)


def longest_within(lengths: list[int], peaks: list[float], budget: float) -> float:
    """The longest length whose (linearly interpolated) peak stays within `budget`."""
    best = 0.0
    for i, (length, peak) in enumerate(zip(lengths, peaks, strict=True)):
        if peak > budget:
            continue
        best = max(best, length)
        if i + 1 < len(lengths) and peaks[i + 1] > budget:
            share = (budget - peak) / (peaks[i + 1] - peak)
            best = max(best, length + share * (lengths[i + 1] - length))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--budget_length", type=int, default=8192)
    parser.add_argument("--work", type=Path, default=Path("/tmp/swiftlm-sp-memory"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work / "model")
    corpus = write_corpus(args.work / "corpus.jsonl", 4 * max(args.lengths))
    peaks: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for length in args.lengths:
        for name, impl in LAYOUTS.items():
            peak = peak_gib(model, corpus, args.work / "run", length, impl, 29571)
            peaks[name].append(peak)
            print(f"max_length {length:6d}, {name}: peak {peak:.2f} GiB per rank")
    budget = peaks["one process"][args.lengths.index(args.budget_length)]
    print("\n| --max_length | " + " | ".join(f"{name}, GiB per rank" for name in LAYOUTS) + " |")
    print("|---|" + "---|" * len(LAYOUTS))
    for index, length in enumerate(args.lengths):
        print(f"| {length} | " + " | ".join(f"{peaks[n][index]:.2f}" for n in LAYOUTS) + " |")
    longest = {name: longest_within(args.lengths, peaks[name], budget) for name in LAYOUTS}
    single = longest["one process"]
    ratios = ", ".join(f"{n} {v:.0f} ({v / single:.2f}x)" for n, v in longest.items())
    print(f"\nbudget {budget:.2f} GiB per rank (one process at {args.budget_length}): {ratios}")


if __name__ == "__main__":
    main()
