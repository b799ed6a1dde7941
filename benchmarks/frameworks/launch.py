"""Launching one framework run of the benchmark (run.py) in a fresh process and reading what
it left: its environment (offline, empty data caches, the timing hooks), the peak RSS of its
process tree, its per-step log and, if it failed, why. Standard library only.
"""

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

HOOKS = Path(__file__).resolve().parent / "hooks"
RSS_POLL_S = 0.2
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def process_tree_rss(root: int) -> int:
    """Bytes of RSS of `root` and all its descendants (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    total, stack, page = 0, [root], os.sysconf("SC_PAGE_SIZE")
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except OSError:
            pass
        stack.extend(children.get(pid, []))
    return total


class RssMonitor(threading.Thread):
    """Peak of the summed RSS of a process tree, polled every RSS_POLL_S."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, process_tree_rss(self.pid))
            self.done.wait(RSS_POLL_S)


def run_env(log_dir: Path) -> dict[str, str]:
    # Same thread count for all: torch would pick it per process otherwise.
    threads = str(os.cpu_count() or 1)
    # Every run starts with empty data caches: all three cache tokenized datasets (swiftlm's
    # tokenized cache, HF datasets' map cache that TRL and ms-swift use), and a warm cache in
    # some runs only would skew time to first step. The model is read from .assets either way.
    cache = log_dir / "cache"
    return {
        **os.environ,
        **OFFLINE_ENV,
        "SWIFTLM_DATA_CACHE": str(cache / "swiftlm"),
        "HF_DATASETS_CACHE": str(cache / "hf_datasets"),
        "MODELSCOPE_CACHE": str(cache / "modelscope"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")])),
        "BENCH_STEP_LOG": str(log_dir / "steps.jsonl"),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def launch(
    command: list[str], log_dir: Path, timeout_s: float
) -> tuple[float, int | None, int, float]:
    """Run to completion; return (launch unix time, exit code or None on timeout, peak RSS, wall)."""
    with open(log_dir / "stdout.log", "wb") as stdout, open(log_dir / "stderr.log", "wb") as stderr:
        started = time.time()
        process = subprocess.Popen(
            command, cwd=log_dir, env=run_env(log_dir),
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        monitor = RssMonitor(process.pid)
        monitor.start()
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # The run has its own session: ending that group ends exactly what we started.
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
        wall = time.time() - started
        monitor.done.set()
        monitor.join()
    return started, code, monitor.peak, wall


def read_steps(step_log: Path) -> tuple[list[dict], dict[int, float]]:
    """(step rows in order, {step: loss}) from the hook's JSON lines."""
    steps, losses = [], {}
    if step_log.exists():
        for line in step_log.read_text().splitlines():
            row = json.loads(line)
            if row["event"] == "step":
                steps.append(row)
            elif row["event"] == "loss":
                losses[row["step"]] = row["loss"]
    return steps, losses


def failure_reason(log_dir: Path, code: int | None, timeout_s: float) -> str:
    if code is None:
        return f"timed out after {timeout_s:.0f} s"
    text = (log_dir / "stderr.log").read_text(errors="replace").splitlines()
    text += (log_dir / "stdout.log").read_text(errors="replace").splitlines()
    errors = [line.strip() for line in text if "Error" in line or "error:" in line]
    last = errors[-1] if errors else next((t.strip() for t in reversed(text) if t.strip()), "")
    return f"exit code {code}: {last[:300]}" if code else f"no step recorded: {last[:300]}"
