"""Elastic membership on one machine: two torchrun agents (`swiftlm sft --nnodes 1:2
--nproc_per_node 1`, gloo, one c10d rendezvous on 127.0.0.1) train one run. The second agent
is killed with its worker (a node lost), training goes on at world size 1 with the gradient
accumulation doubled; a new agent joins and training goes back to world size 2. The final
weights equal an uninterrupted one-process run with the same global batch (4 rows per step),
for DDP, FSDP2 (DCP reshards) and DeepSpeed ZeRO-2/3 (through DeepSpeed's universal
checkpoint format). Then a plain resume on another --nproc_per_node with the same global batch.

Pacing: the test makes every micro-batch sleep (a `sitecustomize.py` on PYTHONPATH wraps the
SFT loss in the workers, as in test_elastic.py) so that each phase lasts long enough for the
next event; the checks are on what happened (logs, checkpoints), not on timing. Every process
has a hard deadline: a bug fails the test, never hangs it. Ports 30040-30059.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

PACE_ENV = "SWIFTLM_TEST_PACE"  # seconds per micro-batch: "<at world size 1>:<at 2>"
DEADLINE_S = 420

COMMON = [
    "--torch_dtype", "float32",
    "--report_to", "none",
    "--lora_dropout", "0",
    "--learning_rate", "1e-2",
    "--per_device_train_batch_size", "1",
    "--logging_steps", "1",
]  # fmt: skip
RUN = ["--max_steps", "14", "--save_steps", "1"]

SITECUSTOMIZE = f"""\
import os
if os.environ.get("{PACE_ENV}") and "LOCAL_RANK" in os.environ:
    import test_elastic_membership
    test_elastic_membership.install_pace()
"""


def install_pace() -> None:
    """Each micro-batch of a worker sleeps for its world size's pace."""
    import time as clock

    from swiftlm.methods.sft import SFT

    one, two = os.environ[PACE_ENV].split(":")
    pace = float(one if os.environ.get("WORLD_SIZE") == "1" else two)
    original = SFT.loss

    def paced_loss(self, model, batch):
        clock.sleep(pace)
        return original(self, model, batch)

    SFT.loss = paced_loss


class Process:
    """A `python -m swiftlm sft ...` in its own session, its output in a file."""

    def __init__(self, tmp_path: Path, name: str, argv: list[str], pace: str = ""):
        hooks = tmp_path / "hooks"
        hooks.mkdir(exist_ok=True)
        (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path = os.pathsep.join([str(hooks), str(Path(__file__).parent)])
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", PACE_ENV: pace}
        self.log = tmp_path / f"{name}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "swiftlm", "sft", *argv],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill_tree(self) -> None:
        """SIGKILL the CLI, torchrun's agent and its workers (which torchrun starts in
        sessions of their own): the node is gone."""
        try:
            tree = [self.proc, *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        self.proc.wait()

    def wait(self, deadline: float) -> int:
        try:
            return self.proc.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            self.kill_tree()
            pytest.fail(f"{self.log.name} still running at the deadline:\n{self.output()[-4000:]}")


def wait_for(condition, deadline: float, what: str, *running: Process) -> None:
    """Poll `condition` until it holds; fail at the deadline or when one of `running` ends."""
    while not condition():
        ended = [p for p in running if p.proc.poll() is not None]
        if time.time() > deadline or ended:
            tails = "\n".join(f"--- {p.log.name}\n{p.output()[-3000:]}" for p in running)
            why = f"{ended[0].log.name} ended" if ended else "timed out"
            pytest.fail(f"{why} waiting for {what}\n{tails}")
        time.sleep(0.2)


def checkpoints(run_dir: Path) -> list[dict]:
    """trainer_state.json of every complete checkpoint, by step."""
    states = []
    for folder in (run_dir / "checkpoints").glob("step-*"):
        if (folder / "COMPLETE").exists():
            states.append(json.loads((folder / "trainer_state.json").read_text()))
    return sorted(states, key=lambda s: s["step"])


def saved_at_world(run_dir: Path, world_size: int, after_step: int = 0) -> bool:
    return any(
        s["world_size"] == world_size and s["step"] > after_step for s in checkpoints(run_dir)
    )


def agent_argv(data: list[str], run_dir: Path, port: int, engine: list[str]) -> list[str]:
    return [
        *data,
        *COMMON,
        *RUN,
        *engine,
        "--gradient_accumulation_steps", "2",  # at 2 nodes: 1 row x 2 ranks x 2 = 4 per step
        "--output_dir", str(run_dir),
        "--nnodes", "1:2",
        "--nproc_per_node", "1",
        "--rdzv_endpoint", f"127.0.0.1:{port}",
        "--rdzv_conf", "last_call_timeout=3,join_timeout=120",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize(
    ("engine", "port"),
    [
        ([], 30040),
        (["--fsdp", "fsdp2"], 30042),
        (["--deepspeed", "zero2"], 30044),
        (["--deepspeed", "zero3"], 30048),
    ],
    ids=["ddp", "fsdp2", "zero2", "zero3"],
)
def test_a_node_leaves_and_one_joins_and_the_weights_match(
    tiny_model_dir, chat_jsonl, tmp_path, engine, port
):
    from tolerance import assert_trained_weights_close  # not at the top: workers import this module

    deadline = time.time() + DEADLINE_S
    data = ["--model", str(tiny_model_dir), "--dataset", str(chat_jsonl)]
    run_dir = tmp_path / "elastic"
    reference_dir = tmp_path / "reference"
    reference = Process(
        tmp_path,
        "reference",
        [*data, *COMMON, *RUN, *engine, "--gradient_accumulation_steps", "4"]
        + ["--output_dir", str(reference_dir)],
    )
    argv = agent_argv(data, run_dir, port, engine)
    pace = "0.6:0.3"  # a step at world size 1 (4 micro-batches) takes 2.4 s, at 2 0.6 s
    first = Process(tmp_path, "agent-a", argv, pace)
    time.sleep(1.0)  # agent A hosts the rendezvous store: it must stay
    second = Process(tmp_path, "agent-b", argv, pace)
    agents = (first, second)
    wait_for(lambda: saved_at_world(run_dir, 2, after_step=1), deadline, "steps at 2", *agents)
    second.kill_tree()
    killed_after = max(s["step"] for s in checkpoints(run_dir))
    wait_for(
        lambda: saved_at_world(run_dir, 1, after_step=killed_after),
        deadline,
        "a checkpoint at world size 1",
        first,
    )
    third = Process(tmp_path, "agent-c", argv, pace)
    joined_after = max(s["step"] for s in checkpoints(run_dir))
    wait_for(
        lambda: saved_at_world(run_dir, 2, after_step=joined_after),
        deadline,
        "world size 2 again",
        first,
        third,
    )
    assert reference.wait(deadline) == 0, reference.output()[-3000:]
    assert first.wait(deadline) == 0, first.output()[-4000:]
    assert third.wait(deadline) == 0, third.output()[-4000:]
    # Other world sizes sum the same gradients in other orders: Adam's rounding bound.
    assert_trained_weights_close(
        reference_dir / "final" / "adapter_model.safetensors",
        run_dir / "final" / "adapter_model.safetensors",
        learning_rate=1e-2,
        steps=14,
    )
    log = first.output() + third.output()
    # Agent A's worker lost its peer (one line, not a gloo traceback), then A saw C join.
    assert "a node left the job (RuntimeError: " in first.output(), first.output()[-4000:]
    assert "1 node(s) joined; restarting the workers at the new world size" in first.output()
    assert "elastic job (1 to 2 nodes) at world size 2: gradient accumulation 2" in log, log
    assert "elastic job (1 to 2 nodes) at world size 1: gradient accumulation 4" in log, log
    if "--deepspeed" in engine:  # ZeRO partitions of 2 ranks cannot be read by 1 as they are
        assert "converting it to DeepSpeed's universal checkpoint format" in log, log
    sizes = [s["world_size"] for s in checkpoints(run_dir)]
    print("world size of each checkpoint:", sizes)
    assert 1 in sizes and 2 in sizes[: sizes.index(1)] and sizes[-1] == 2
    assert all(s["global_batch"] == 4 for s in checkpoints(run_dir))


@pytest.mark.slow
@pytest.mark.numerics
def test_a_resume_on_another_number_of_processes_keeps_the_global_batch(
    tiny_model_dir, chat_jsonl, tmp_path
):
    """Without --nnodes MIN:MAX: a run of 2 processes x 1 row x accumulation 2 resumes on 1
    process with accumulation 4 (the same 4 rows per step) and ends where the run of 2 does;
    accumulation 2 on 1 process would halve the global batch, and is refused naming it."""
    from conftest import stopped_at
    from tolerance import assert_trained_weights_close

    deadline = time.time() + DEADLINE_S
    data = ["--model", str(tiny_model_dir), "--dataset", str(chat_jsonl)]
    flags = [*data, *COMMON, "--max_steps", "8", "--save_steps", "3"]
    two = tmp_path / "two"
    argv = [*flags, "--nproc_per_node", "2", "--gradient_accumulation_steps", "2"]
    whole = Process(tmp_path, "two", [*argv, "--output_dir", str(two), "--master_port", "30046"])
    assert whole.wait(deadline) == 0, whole.output()[-3000:]
    resumed_dir = stopped_at(two, 3, tmp_path / "one")
    resume = [*flags, "--output_dir", str(resumed_dir), "--resume_from_checkpoint", "auto"]
    halved = Process(tmp_path, "halved", [*resume, "--gradient_accumulation_steps", "2"])
    assert halved.wait(deadline) == 2, halved.output()[-3000:]
    assert (
        "global batch: saved 4 rows per step, now 2 rows per step (1 per device x 1 "
        "data-parallel rank x 2 accumulation); --gradient_accumulation_steps 4 keeps it"
    ) in halved.output()
    one = Process(tmp_path, "one", [*resume, "--gradient_accumulation_steps", "4"])
    assert one.wait(deadline) == 0, one.output()[-3000:]
    assert "micro-batch 6 of epoch 0 at 2 rows per global micro-batch is micro-batch 12" in (
        one.output()
    )
    assert_trained_weights_close(
        two / "final" / "adapter_model.safetensors",
        resumed_dir / "final" / "adapter_model.safetensors",
        learning_rate=1e-2,
        steps=8,
    )
