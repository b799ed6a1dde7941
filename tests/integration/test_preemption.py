"""Preemption: SIGTERM or SIGUSR1 at a step chosen from a seed saves a complete checkpoint at
the next step boundary, the process exits with the preemption status (99), and
`--resume_from_checkpoint auto` continues exactly (within 1e-6 of an uninterrupted run)."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CHAT_ROWS, logged, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from swiftlm.errors import Preempted
from tolerance import assert_same_weights

STEPS = 30
# LoRA on the tiny model, 6 micro-batches a step: a step takes ~40 ms on one thread, so a
# signal sent when step N (at most STEPS // 2) is logged lands long before the run's end.
RUN = dict(
    train_type="lora",
    lora_dropout=0,
    learning_rate="1e-2",
    per_device_train_batch_size=2,
    gradient_accumulation_steps=6,
    max_steps=STEPS,
    save_steps=STEPS,
)


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max((row["step"] for row in rows if "loss" in row), default=0)


def signal_at_step(argv: list[str], run_dir: Path, step: int, signum: int, pick=None):
    """Start `swiftlm <argv>` as a process, send `signum` once the log shows `step` (to the
    process, or to the pids `pick(run_dir)` names); return (exit status, its output)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "swiftlm", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < step and process.poll() is None:
        assert time.monotonic() < deadline, "the run did not reach the step"
        time.sleep(0.005)
    pids = [process.pid] if pick is None else pick(run_dir)
    for pid in pids:
        os.kill(pid, signum)
    output, _ = process.communicate(timeout=300)
    return process.returncode, output


def preempted_step(output: str, signum: int) -> int:
    """The step of the log line 'preempted by SIG... at step N: saved checkpoint ...'."""
    name = signal.Signals(signum).name
    pattern = rf"preempted by {name} at step (\d+): saved checkpoint (\S+); resume with "
    found = re.findall(pattern + "--resume_from_checkpoint auto\n", output)
    assert len(found) == 1, output[-3000:]  # said once
    return int(found[0][0])


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(the data, the run directory of the same run never interrupted)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    data = write_jsonl(root / "chat.jsonl", CHAT_ROWS)
    assert main(tiny_sft(tiny_model_dir, data, root / "full", **RUN)) == 0
    return data, root / "full"


@pytest.mark.parametrize(
    ("signum", "seed"),
    [
        (signal.SIGTERM, 17),
        # SIGUSR1's handling is the same code (tests/unit/test_preemption_watch.py); the
        # 2-rank test sends it to one worker alone
        pytest.param(signal.SIGUSR1, 5, marks=pytest.mark.slow),
    ],
)
def test_signal_saves_exits_99_and_resume_is_exact(
    tiny_model_dir, uninterrupted, tmp_path, signum, seed
):
    target = random.Random(seed).randint(3, STEPS // 2)
    chat_jsonl, full = uninterrupted
    preempted = tmp_path / "preempted"

    argv = tiny_sft(tiny_model_dir, chat_jsonl, preempted, **RUN)
    status, output = signal_at_step(argv, preempted, target, signum)
    assert status == Preempted.exit_code == 99, output[-3000:]
    step = preempted_step(output, signum)
    assert target <= step < STEPS
    folder = preempted / "checkpoints" / f"step-{step}"
    assert (folder / "COMPLETE").read_text() == f"step {step}\n"
    assert f"saved checkpoint {folder}" in output
    assert not (preempted / "final").exists()

    assert main([*argv, "--resume_from_checkpoint", "auto"]) == 0
    adapter = "final/adapter_model.safetensors"
    assert_same_weights(full / adapter, preempted / adapter)
    assert logged(preempted) == logged(full)
