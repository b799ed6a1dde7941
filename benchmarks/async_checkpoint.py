"""Step time of a run that saves a checkpoint every 10 steps against one that never does, with
synchronous and asynchronous (--async_save) saving.

    python benchmarks/async_checkpoint.py                       # SmolLM2-135M-Instruct, full
    python benchmarks/async_checkpoint.py --train_type lora --steps 40
    python benchmarks/async_checkpoint.py --incremental          # the block store, async too

The same job three times (or more with --repeats), each its own `swiftlm sft` process: no
checkpoint until the end, a checkpoint every --save_steps written synchronously, and the same
written in the background. Step time is the training time up to the last step (the run's
`elapsed_s` at its last log line, which comes before the last step's save) divided by the
steps: it holds every save but the final one, which every run makes alike. Also printed: the
share of that time the loop spent in its checkpoint phase (the step timer's
`time/checkpoint_s`): what a save blocks training for, robust to a machine whose load
changes between the runs (the step times are not). A full fine-tuning
checkpoint of SmolLM2-135M is ~1.6 GB (weights and two AdamW moments in float32); on a
machine with few cores the background writer competes with training for them, which is part
of what is measured. Wall clock on this machine: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from incremental_checkpoints import chat_rows, model_flags  # noqa: E402  (benchmarks/)


def run(out: Path, model: list[str], data: Path, args, save_steps: int, extra: dict) -> dict:
    """(seconds per optimizer step, seconds the loop spent in its checkpoint phase) of one
    `swiftlm sft` run (`--measure_only`: of the run already in `out`)."""
    if not args.measure_only:
        train(out, model, data, args, save_steps, extra)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "elapsed_s" in r][-1]
    # Logged every step, a row's phase times are that step's: its save's is in the next row.
    saving = sum(r.get("time/checkpoint_s", 0.0) for r in rows if r["step"] <= last["step"])
    return {"step": last["elapsed_s"] / last["step"], "saving": saving / last["elapsed_s"]}


def train(out: Path, model: list[str], data: Path, args, save_steps: int, extra: dict) -> None:
    launcher = "import sys; from swiftlm.cli.main import main; sys.exit(main())"
    argv = [sys.executable, "-c", launcher, "sft", *model, "--dataset", str(data)]
    argv += ["--output_dir", str(out), "--report_to", "none", "--max_length", "64"]
    argv += ["--max_steps", str(args.steps), "--save_steps", str(save_steps)]
    argv += ["--train_type", args.train_type, "--logging_steps", "1", "--save_total_limit", "2"]
    if args.train_type == "full":
        argv += ["--learning_rate", "1e-5"]
    for name, value in extra.items():
        argv += [f"--{name}", str(value)]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"swiftlm sft failed ({done.returncode}):\n{done.stdout[-3000:]}")
    print(f"  {out.name}: {time.perf_counter() - started:.0f} s in all", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="default", help="default (SmolLM2-135M), tiny, or a path"
    )
    parser.add_argument("--train_type", default="full", choices=("full", "lora"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save_steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--incremental", action="store_true", help="--incremental_checkpoints")
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--measure_only", action="store_true", help="measure the runs already in --workdir"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swiftlm-async-") as temp:
        workdir = Path(args.workdir or temp)
        workdir.mkdir(parents=True, exist_ok=True)
        model = model_flags(args.model, workdir)
        data = workdir / "chat.jsonl"
        data.write_text("\n".join(json.dumps(r) for r in chat_rows(256)) + "\n")
        base = {"incremental_checkpoints": "true"} if args.incremental else {}
        cases = {
            "never saves": (args.steps + 1, {}),
            f"saves every {args.save_steps}, sync": (args.save_steps, {"async_save": "false"}),
            f"saves every {args.save_steps}, async": (args.save_steps, {"async_save": "true"}),
        }
        times: dict[str, list[dict]] = {name: [] for name in cases}
        for repeat in range(args.repeats):
            for index, (name, (every, extra)) in enumerate(cases.items()):
                out = workdir / f"run-{repeat}-{index}"
                times[name].append(run(out, model, data, args, every, {**base, **extra}))
    never = statistics.median(t["step"] for t in times["never saves"])
    fmt = "blocks" if args.incremental else "standard"
    print(f"\nmodel {args.model}, {args.train_type}, {args.steps} steps, {fmt} format")
    print("| run | s/step | vs never saving | share of the run in the loop's checkpoint phase |")
    print("|---|---|---|---|")
    for name, values in times.items():
        per_step = statistics.median(t["step"] for t in values)
        saving = statistics.median(t["saving"] for t in values)
        print(f"| {name} | {per_step:.3f} | {per_step / never:.3f}x | {saving:.2%} |")


if __name__ == "__main__":
    main()
