"""A single-process `swiftlm sft` that hangs is stopped by the heartbeat watchdog.

The run goes through the real CLI in a subprocess (the watchdog ends its process with
`os._exit`). A small script wraps the SFT method's loss so that its 2nd call (step 2, with one
micro-batch per step) sleeps far longer than `--heartbeat_timeout`, then runs `swiftlm sft`.
The process must exit with HEARTBEAT_EXIT_CODE within the timeout + 30 s of the hang, name the
step, phase and place in its message, and leave every thread's stack in
`<run>/hang/rank-0-stacks.txt`. A hard subprocess timeout keeps a bug from hanging the suite.
"""

import re
import subprocess
import sys
import time

import pytest

from conftest import tiny_sft
from swiftlm.distributed.heartbeat import HEARTBEAT_EXIT_CODE

HEARTBEAT_TIMEOUT = 5
HANG_S = 120
RUN_TIMEOUT_S = 90  # the run takes ~10 s to reach step 2 here

HANG_SCRIPT = f"""\
import sys
import time

from swiftlm.cli.main import main
from swiftlm.methods.sft import SFT

original, calls = SFT.loss, [0]


def hanging_loss(self, model, batch):
    calls[0] += 1
    if calls[0] == 2:
        print(f"fault: hangs at {{time.time():.3f}}", file=sys.stderr, flush=True)
        time.sleep({HANG_S})
    return original(self, model, batch)


SFT.loss = hanging_loss
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.bad_input(
    input="A training run of one process that hangs (no step within `--heartbeat_timeout`)",
    outcome="Exit 75 within the timeout + 30 s, naming the step, phase and the line the main "
    "thread is at; every thread's Python stack in <run>/hang/rank-0-stacks.txt",
)
def test_a_hung_single_process_run_dumps_its_stacks_and_exits(tiny_model_dir, chat_jsonl, tmp_path):
    script = tmp_path / "hang_script.py"
    script.write_text(HANG_SCRIPT)
    run_dir = tmp_path / "run"
    flags = dict(
        max_steps=4,
        save_steps=100,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )
    argv = tiny_sft(tiny_model_dir, chat_jsonl, run_dir, **flags)
    started = time.time()
    try:
        done = subprocess.run(
            [sys.executable, str(script), *argv],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:  # the child is killed by subprocess.run
        output = _text(exc.stdout) + _text(exc.stderr)
        pytest.fail(
            f"no watchdog stopped the hung run within {RUN_TIMEOUT_S} s (train/run.py must "
            f"create the Heartbeat in single-process runs too):\n{output[-3000:]}"
        )
    ended, output = time.time(), done.stdout + done.stderr
    hang_at = float(re.search(r"fault: hangs at ([\d.]+)", output).group(1))
    assert done.returncode == HEARTBEAT_EXIT_CODE, output[-3000:]
    assert ended - hang_at < HEARTBEAT_TIMEOUT + 30, output[-3000:]
    assert ended - started < HANG_S  # stopped by the watchdog, not by the end of the sleep
    stacks = run_dir / "hang" / "rank-0-stacks.txt"
    assert "swiftlm: no training progress for " in output, output[-3000:]
    assert "(last: step 2, phase forward; main thread now at " in output, output
    assert "hang_script.py:" in output and " in hanging_loss)" in output
    assert f"Python stacks of every thread: {stacks}" in output
    assert "raise --heartbeat_timeout (0 disables the watchdog)" in output
    text = stacks.read_text()
    loop = text.index(" - the training loop, most recent call last:")
    # The loop's stack runs from the CLI down to the sleeping loss, in the formatted part ...
    assert text.index("in run_training", loop) < text.index("in hanging_loss", loop)
    assert f"time.sleep({HANG_S})" in text
    # ... and again in faulthandler's part.
    faulthandler_part = text[text.index("--- faulthandler") :]
    assert "in hanging_loss" in faulthandler_part and 'Thread "swiftlm-heartbeat"' in text


def _text(captured) -> str:
    """What a timed-out subprocess.run captured: bytes on POSIX even with text=True."""
    if isinstance(captured, bytes):
        return captured.decode(errors="replace")
    return captured or ""
