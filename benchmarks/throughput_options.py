"""Side-by-side throughput of swiftlm's own speed options on one model and dataset.

Each variant is a fresh `swiftlm sft` process with the same model, data, steps and seed; the
variants run in rounds (A B C ... A B C ...) so that machine drift hits all of them alike, and
the table reports medians and ratios against the first variant (the baseline).

    python benchmarks/throughput_options.py                        # the default model + data
    python benchmarks/throughput_options.py --model DIR --dataset FILE --steps 12 --rounds 3

Measured per run: label tokens per second over the steps after the first (steady state; the
first step pays one-time costs), peak RSS of the process (ru_maxrss of the child), final loss.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SWIFTLM = [sys.executable, "-m", "swiftlm", "sft"]

# name -> extra flags. The first is the baseline the ratios divide by.
VARIANTS = {
    "padded, plain CE": ["--padding_free", "false", "--fused_cross_entropy", "false"],
    "padded, fused CE": ["--padding_free", "false"],
    "padding-free, fused CE (default)": [],
    "packing, fused CE": ["--packing", "true"],
    "token budget 2048, padding-free": ["--max_tokens_per_batch", "2048"],
    "default in float32": ["--torch_dtype", "float32"],
    "default + torch_compile": ["--torch_compile", "true"],
}


def run_variant(common: list[str], extra: list[str], out: Path) -> dict:
    """One training process; returns its steady-state figures from metrics.jsonl."""
    out.mkdir(parents=True)
    log = out / "output.log"  # beside the run directory: a new run needs its folder empty
    out = out / "run"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [*SWIFTLM, *common, *extra, "--output_dir", str(out)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TQDM_DISABLE": "1"},
        )
        # wait4 returns this child's own resource usage: its peak RSS, not the largest so far.
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return {"error": log.read_text().strip().splitlines()[-1]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    later = steps[1:]
    seconds = later[-1]["elapsed_s"] - steps[0]["elapsed_s"]
    return {
        "label_tokens_per_s": sum(r["label_tokens"] for r in later) / seconds,
        "peak_rss_gib": usage.ru_maxrss / 2**20,  # KiB on Linux
        "final_loss": steps[-1]["loss"],
        "steps": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the built-in default model)")
    parser.add_argument("--dataset", nargs="*", help="dataset(s) (default: the built-in data)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--variants", help="comma-separated subset of: " + ", ".join(VARIANTS))
    args = parser.parse_args()

    common = ["--max_steps", str(args.steps), "--logging_steps", "1", "--save_steps", "100000"]
    common += [
        "--per_device_train_batch_size",
        str(args.batch),
        "--max_length",
        str(args.max_length),
    ]
    common += ["--truncation_strategy", "right", "--lora_dropout", "0", "--report_to", "none"]
    common += ["--lr_scheduler_type", "constant", "--seed", "42"]
    if args.model:
        common += ["--model", args.model]
    if args.dataset:
        common += ["--dataset", *args.dataset]
    else:
        common += ["--dataset", "swiftlm/self-cognition", "swiftlm/general-qa"]
    names = args.variants.split(",") if args.variants else list(VARIANTS)

    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for name in names:
                out = Path(tmp) / f"{round_index}-{len(results[name])}-{abs(hash(name))}"
                result = run_variant(common, VARIANTS[name], out)
                results[name].append(result)
                print(f"round {round_index + 1} {name}: {result}", flush=True)
    print_table(results, names[0])


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def print_table(results: dict[str, list[dict]], baseline: str) -> None:
    base = results[baseline]
    print("\n| variant | label tokens/s | x baseline | peak RSS (GiB) | final loss |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            print(f"| {name} | failed: {runs[0]['error']} | | | |")
            continue
        # Ratios per round, then the median: drift between rounds cancels.
        ratios = [
            r["label_tokens_per_s"] / b["label_tokens_per_s"]
            for r, b in zip(runs, base, strict=True)
            if "error" not in r and "error" not in b
        ]
        rss = _median([r["peak_rss_gib"] for r in ok])
        print(
            f"| {name} | {_median([r['label_tokens_per_s'] for r in ok]):.0f} | "
            f"{_median(ratios):.2f} | {rss:.2f} | "
            f"{_median([r['final_loss'] for r in ok]):.4f} |"
        )


if __name__ == "__main__":
    main()
