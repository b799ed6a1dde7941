"""Failures of one rank in a 2-rank gloo job on CPU, launched through the real CLI.

- A rank killed with SIGKILL under `--max_restarts 1`: torchrun restarts both workers, they
  resume from the newest complete checkpoint, and the final weights equal an uninterrupted run.
- A rank that hangs before a collective under `--heartbeat_timeout 8`: every rank exits
  non-zero soon after the timeout, with a message naming the stuck rank, step and phase.

Faults are injected without touching production code: the test writes a `sitecustomize.py`
into a folder on PYTHONPATH, which Python imports at start-up in every process of the launch
(the CLI, torchrun, each worker). In a worker of rank 1 on torchrun's first attempt, and only
when SWIFTLM_TEST_FAULT is set, it wraps the SFT method's loss (see `install_fault` below) so the N-th micro-batch kills or hangs the process.
Every launch has a hard timeout (then SIGTERM, SIGKILL): a bug can fail the suite, never hang it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from swiftlm.distributed.heartbeat import HEARTBEAT_EXIT_CODE

FAULT_ENV = "SWIFTLM_TEST_FAULT"  # "kill:N" or "hang:N": at rank 1's N-th micro-batch
HANG_S = 120
HEARTBEAT_TIMEOUT = 8
LAUNCH_TIMEOUT_S = 180  # a 2-rank run takes ~10 s here; a restarted one twice that

COMMON = [
    "--torch_dtype", "float32",
    "--report_to", "none",
    "--lora_dropout", "0",
    "--learning_rate", "1e-2",
    "--per_device_train_batch_size", "2",
    "--gradient_accumulation_steps", "2",
    "--max_steps", "5",
    "--save_steps", "2",
    "--nproc_per_node", "2",
]  # fmt: skip

SITECUSTOMIZE = f"""\
import os
if os.environ.get("{FAULT_ENV}") and "LOCAL_RANK" in os.environ:
    import test_elastic
    test_elastic.install_fault()
"""


def install_fault() -> None:
    """In rank 1's first attempt, make its N-th loss call die (SIGKILL) or hang."""
    if os.environ.get("RANK") != "1" or os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0":
        return
    kind, at = os.environ[FAULT_ENV].split(":")
    from swiftlm.methods.sft import SFT

    original, calls = SFT.loss, [0]

    def faulty_loss(self, model, batch):
        calls[0] += 1
        if calls[0] == int(at):
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"fault: rank 1 hangs at {time.time():.3f}", file=sys.stderr, flush=True)
            time.sleep(HANG_S)
        return original(self, model, batch)

    SFT.loss = faulty_loss


class Launch:
    """`python -m swiftlm sft ... --nproc_per_node 2` running in the background."""

    def __init__(self, tmp_path: Path, name: str, port: int, *flags: str, fault: str = ""):
        hooks = tmp_path / "hooks"
        hooks.mkdir(exist_ok=True)
        (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path = os.pathsep.join([str(hooks), str(Path(__file__).parent)])
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", FAULT_ENV: fault}
        self.run_dir = tmp_path / name
        cmd = [sys.executable, "-m", "swiftlm", "sft", *flags, *COMMON]
        cmd += ["--output_dir", str(self.run_dir), "--master_port", str(port)]
        self.log = tmp_path / f"{name}.log"  # a file, not a pipe that could fill up and block
        self.started = time.time()
        with self.log.open("w") as log:
            # Its own session, so that a timeout can signal the CLI and torchrun together.
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self) -> tuple[int, str]:
        """(exit code, stdout + stderr); a launch past LAUNCH_TIMEOUT_S is stopped and fails."""
        try:
            self.proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"still running after {LAUNCH_TIMEOUT_S} s:\n{self.output()[-3000:]}")
        self.ended = time.time()
        return self.proc.returncode, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def adapter(run_dir: Path) -> dict:
    return load_file(run_dir / "final" / "adapter_model.safetensors")


def test_a_killed_rank_restarts_and_resumes_to_the_same_weights(
    tiny_model_dir, chat_jsonl, tmp_path
):
    data = ["--model", str(tiny_model_dir), "--dataset", str(chat_jsonl)]
    # Both launches run at once to save time. Micro-batch 7 is the first of step 4 on rank 1:
    # step-2 is complete, step-4 not yet written.
    reference = Launch(tmp_path, "reference", 29551, *data)
    killed = Launch(tmp_path, "killed", 29552, *data, "--max_restarts", "1", fault="kill:7")
    code, output = reference.wait()
    assert code == 0, output[-3000:]
    code, output = killed.wait()
    assert code == 0, output[-3000:]
    assert "resumed from" in output and "step-2 at step 2" in output, output[-3000:]
    restart = "local rank 1 failed (killed by SIGKILL, exit code 137); restarting the workers"
    assert restart in output and "Sending process" not in output, output[-3000:]
    from tolerance import assert_same_weights

    # The resumed run replays steps 3-5 from the same weights, optimizer state, schedule and
    # data position, with the same arithmetic: bit for bit.
    assert_same_weights(adapter(reference.run_dir), adapter(killed.run_dir))
    assert not (killed.run_dir / ".heartbeat").exists()  # removed by the restarted workers


def test_a_hung_rank_stops_every_rank_after_the_heartbeat_timeout(
    tiny_model_dir, chat_jsonl, tmp_path
):
    data = ["--model", str(tiny_model_dir), "--dataset", str(chat_jsonl)]
    timeout = ["--heartbeat_timeout", str(HEARTBEAT_TIMEOUT)]
    # Micro-batch 5 is the first of step 3; rank 0 goes on and waits in the gradient all-reduce.
    hung = Launch(tmp_path, "hung", 29553, *data, *timeout, fault="hang:5")
    code, output = hung.wait()
    hang_at = float(re.search(r"fault: rank 1 hangs at ([\d.]+)", output).group(1))
    stopped_after = hung.ended - hang_at
    assert stopped_after < HEARTBEAT_TIMEOUT + 30, output[-3000:]
    assert hung.ended - hung.started < HANG_S  # the launch did not simply wait the hang out
    assert "swiftlm: rank 1 made no progress" in output, output[-3000:]
    assert "step 3, phase forward" in output
    assert "swiftlm: rank 0 made no progress" not in output  # the waiting rank is not blamed
    # The first worker to fail ended itself with the watchdog's code; torchrun then stops the
    # other one, if its own watchdog has not already. The launcher exits with the first code
    # and says which rank it was, without torchrun's ChildFailedError stack.
    assert code == HEARTBEAT_EXIT_CODE, output[-3000:]
    assert f"failed first (exit code {HEARTBEAT_EXIT_CODE}); its output is above" in output
    assert "ChildFailedError" not in output
    print(f"the whole job stopped {stopped_after:.1f} s after the hang began")
