"""What the step-time breakdown, per-layer gradient norms, histograms and spike checks cost.

The same `swiftlm sft` run twice per round, with the bookkeeping on (as shipped) and off (the
loop's observer replaced by one that does nothing, as before this existed), alternating
on/off/on/off so that machine drift hits both alike. Every step is logged (--logging_steps 1:
per-layer norms every step, the worst case) and histograms are drawn every 5 steps.

    python benchmarks/observability.py                  # the default model and data
    python benchmarks/observability.py --steps 20 --rounds 4 --model DIR --dataset FILE

Reported: the median seconds per step (after the first) of each variant and the overhead
(on / off - 1), and the direct cost: the time the observer spends in its own work, summed
inside the "on" runs (the paired difference cannot resolve much below the machine's noise).
The issue's bar is under 2%.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


class NullObserver:
    """The loop's observer doing nothing but the heartbeat the loop had before."""

    def __init__(self, job, num_steps: int, resume: bool):
        self.job, self.step = job, 0

    @contextmanager
    def phase(self, name: str):
        if self.job.heartbeat is not None:
            self.job.heartbeat.beat(self.step, name)
        yield

    def backward(self, last_micro_batch: bool):
        return self.phase("backward")

    def step_begin(self, step: int) -> None:
        self.step = step

    def logs(self, step: int) -> bool:
        every = self.job.output.logging_steps
        return step == 1 or step % every == 0

    def gradients_ready(self, step: int) -> None:
        pass

    def step_end(self, step: int, loss: float, grad_norm: float) -> None:
        pass

    def log_row(self, strategy_metrics: dict) -> dict:
        return {}

    def take_histogram(self):
        return None

    def close(self) -> None:
        pass


def timed_observer():
    """The shipped observer, with the time spent in its own work summed: the direct cost,
    which the paired runs cannot resolve below the machine's noise."""
    import time

    from swiftlm.train.observe import Observer

    class TimedObserver(Observer):
        spent = 0.0

        def _timed(self, method, *args):
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                TimedObserver.spent += time.perf_counter() - started

        def gradients_ready(self, step):
            return self._timed(super().gradients_ready, step)

        def step_end(self, step, loss, grad_norm):
            return self._timed(super().step_end, step, loss, grad_norm)

        def log_row(self, strategy_metrics):
            return self._timed(super().log_row, strategy_metrics)

        def close(self):
            super().close()
            path = self.job.run_dir / "bookkeeping.json"
            path.write_text(json.dumps({"seconds": TimedObserver.spent, "steps": self.step}))

    return TimedObserver


def child(mode: str, argv: list[str]) -> int:
    """Run `swiftlm sft argv` in this process, the observer swapped out when mode is off."""
    from swiftlm.cli.main import main
    from swiftlm.train import loop

    loop.Observer = NullObserver if mode == "off" else timed_observer()
    return main(["sft", *argv])


def seconds_per_step(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    return (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / (steps[-1]["step"] - steps[0]["step"])


def direct_seconds(run_dir: Path) -> float:
    """Seconds per step the observer spent in its own work (gradient norms, histograms,
    spike checks, the log row's reductions)."""
    spent = json.loads((run_dir / "bookkeeping.json").read_text())
    return spent["seconds"] / spent["steps"]


def run(mode: str, common: list[str], out: Path) -> float:
    command = [sys.executable, __file__, "--child", mode, "--", *common, "--output_dir", str(out)]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds_per_step(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the built-in default model)")
    parser.add_argument("--dataset", nargs="*", help="dataset(s) (default: the built-in data)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        raise SystemExit(child(args.child, [a for a in rest if a != "--"]))
    common = ["--max_steps", str(args.steps), "--logging_steps", "1", "--histogram_steps", "5"]
    common += ["--save_steps", "100000", "--report_to", "tensorboard", "--split_dataset_ratio", "0"]
    if args.model:
        common += ["--model", args.model]
    if args.dataset:
        common += ["--dataset", *args.dataset]
    times: dict[str, list[float]] = {"on": [], "off": []}
    direct: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                seconds = run(mode, common, Path(tmp) / f"{mode}-{round_}")
                times[mode].append(seconds)
                if mode == "on":
                    direct.append(direct_seconds(Path(tmp) / f"{mode}-{round_}"))
                print(f"round {round_ + 1} {mode:>3}: {seconds:.4f} s/step", flush=True)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"\nbookkeeping on : {on:.4f} s/step (median of {args.rounds})")
    print(f"bookkeeping off: {off:.4f} s/step")
    print(f"overhead       : {100 * (on / off - 1):+.2f}%")
    paired = [a / b - 1 for a, b in zip(times["on"], times["off"], strict=True)]
    print(f"per round      : {', '.join(f'{100 * p:+.2f}%' for p in paired)}")
    own = statistics.median(direct)
    print(
        f"direct         : {1000 * own:.2f} ms/step in the observer's own work = "
        f"{100 * own / on:.2f}% of a step (the step-time phases themselves add two clock "
        "reads each)"
    )


if __name__ == "__main__":
    main()
