"""Preemption of a 2-rank top-k compressed DDP run (gloo) started by `swiftlm sft
--nproc_per_node 2`: SIGTERM to the `swiftlm` command (as Kubernetes sends it) reaches the
workers through the torchrun agent, and SIGUSR1 to one worker alone reaches the other through
the ranks' agreement at the step boundary, and SIGTERM to every process at once (SLURM)
is acted on once; each way every rank saves the same checkpoint,
with its top-k residuals, the command exits 99, and the resumed run equals the uninterrupted
one (1e-6).

Three 2-rank launches per case: ~100 s each on this (loaded, 2-core) machine, so slow."""

import random
import signal
from pathlib import Path

import pytest
from test_preemption import preempted_step, signal_at_step

from conftest import logged, tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_same_weights

STEPS = 24
RUN = dict(
    train_type="lora",
    lora_dropout=0,
    learning_rate="2e-2",
    per_device_train_batch_size=1,
    gradient_accumulation_steps=8,  # ~0.1 s a step: the signal lands long before the end
    max_steps=STEPS,
    save_steps=STEPS,
    nproc_per_node=2,
    grad_compression="topk",
)
ADAPTER = "final/adapter_model.safetensors"


def processes_of(run_dir: Path, rank: int | None = None) -> list[int]:
    """The pids of the processes whose command line names `run_dir` (the `swiftlm`
    command, the torchrun agent, the workers), or of its worker of rank `rank` only."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if str(run_dir).encode() not in cmdline:
            continue
        if rank is None or f"RANK={rank}".encode() in environ:
            pids.append(int(proc.name))
    assert pids, f"no process for {run_dir}"
    return pids


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "seed", "port", "to"),
    [
        (signal.SIGTERM, 3, 30035, "command"),  # as Kubernetes sends it
        (signal.SIGUSR1, 8, 30036, "rank 1"),  # alone: the ranks agree at the boundary
        (signal.SIGTERM, 5, 30037, "all"),  # as SLURM does: command, agent, workers at once
    ],
)
def test_signal_saves_every_rank_and_resumes_exactly(
    tiny_model_dir, chat_jsonl, tmp_path, signum, seed, port, to
):
    target = random.Random(seed).randint(2, STEPS // 2)
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    run = dict(RUN, master_port=port)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, full, **run)) == 0

    argv = tiny_sft(tiny_model_dir, chat_jsonl, preempted, **run)
    pick = {
        "command": None,
        "rank 1": lambda run_dir: processes_of(run_dir, rank=1),
        "all": processes_of,
    }[to]
    status, output = signal_at_step(argv, preempted, target, signum, pick)
    assert status == 99, output[-3000:]
    step = preempted_step(output, signum)
    assert target <= step < STEPS
    folder = preempted / "checkpoints" / f"step-{step}"
    assert (folder / "COMPLETE").is_file()
    for rank in (0, 1):  # each rank's own residuals
        assert (folder / "rank_state" / f"compression-rank{rank}.safetensors").is_file()
    assert "Traceback" not in output and "error" not in output.lower(), output[-3000:]

    assert main([*argv, "--resume_from_checkpoint", "auto"]) == 0
    assert_same_weights(full / ADAPTER, preempted / ADAPTER)
    assert logged(preempted) == logged(full)
