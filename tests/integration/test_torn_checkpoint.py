"""kill -9 in the middle of a checkpoint write never leaves a checkpoint that is resumed.

A `swiftlm sft` process is killed (SIGKILL) while one checkpoint is half written: in the run
directory, in the local tier, or while it is copied to the mirror (the test hooks
SWIFTLM_TEST_SAVE_PAUSE / SWIFTLM_TEST_MIRROR_PAUSE hold the write open there). The run is
then resumed with `--resume_from_checkpoint auto`: it skips the torn copy, continues from an
earlier complete one, and ends with the weights of an uninterrupted run (within 1e-6).

One schedule for all three: max_steps 6, --save_steps 3, --local_save_steps 2, so the local
tier gets steps 2 and 4, the run directory (and the mirror) steps 3 and 6; --async_save, so
the kill lands while a checkpoint is written in the background."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_same_weights

ADAPTER = "final/adapter_model.safetensors"
SCHEDULE = dict(
    max_steps=6, save_steps=3, local_save_steps=2, per_device_train_batch_size=4, async_save="true"
)


def tier_flags(root: Path) -> dict:
    return dict(SCHEDULE, local_save_dir=root / "shm", checkpoint_mirror=f"file://{root}/mirror")


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> Path:
    """The final adapter of the run that nobody kills."""
    from conftest import CHAT_ROWS, write_jsonl

    root = tmp_path_factory.mktemp("uninterrupted")
    data = write_jsonl(root / "chat.jsonl", CHAT_ROWS)
    assert main(tiny_sft(tiny_model_dir, data, root / "run", **tier_flags(root))) == 0
    return root / "run" / ADAPTER


def kill_while_writing(argv: list[str], hook: str, torn: Path, timeout: float = 120) -> None:
    """Start `swiftlm` with `hook` holding a write open; SIGKILL it once `torn` holds a file
    but no COMPLETE (the write is half done)."""
    env = {**os.environ, hook: f"{torn.name[5:]}:120", "OMP_NUM_THREADS": "1"}
    code = "import sys; from swiftlm.cli.main import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    try:
        while not (torn.is_dir() and any(p.is_file() for p in torn.rglob("*"))):
            assert process.poll() is None, f"the run ended ({process.returncode}) before {torn}"
            assert time.monotonic() < deadline, f"{torn} was not written in {timeout}s"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (torn / "COMPLETE").exists()


def resume(tiny_model_dir, data, run: Path, flags: dict, capsys) -> str:
    capsys.readouterr()
    argv = tiny_sft(tiny_model_dir, data, run, **flags, resume_from_checkpoint="auto")
    assert main(argv) == 0
    return capsys.readouterr().out


def test_kill_during_a_run_directory_save(
    uninterrupted, tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    run, flags = tmp_path / "run", tier_flags(tmp_path)
    torn = run / "checkpoints" / "step-3"
    argv = tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)
    kill_while_writing(argv, "SWIFTLM_TEST_SAVE_PAUSE", torn)
    printed = resume(tiny_model_dir, chat_jsonl, run, flags, capsys)
    assert f"skipping incomplete checkpoint {torn} " in printed
    assert f"resumed from {tmp_path}/shm/checkpoints/step-2 (local tier) at step 2" in printed
    assert_same_weights(uninterrupted, run / ADAPTER)


@pytest.mark.slow
def test_kill_during_a_local_tier_save(uninterrupted, tiny_model_dir, chat_jsonl, tmp_path, capsys):
    run, flags = tmp_path / "run", tier_flags(tmp_path)
    torn = tmp_path / "shm" / "checkpoints" / "step-4"
    argv = tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)
    kill_while_writing(argv, "SWIFTLM_TEST_SAVE_PAUSE", torn)
    printed = resume(tiny_model_dir, chat_jsonl, run, flags, capsys)
    assert f"skipping incomplete checkpoint {torn} " in printed
    assert f"resumed from {run}/checkpoints/step-3 at step 3" in printed
    assert_same_weights(uninterrupted, run / ADAPTER)


@pytest.mark.slow
def test_kill_during_a_copy_to_the_mirror(
    uninterrupted, tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    run, flags = tmp_path / "run", tier_flags(tmp_path)
    torn = tmp_path / "mirror" / "checkpoints" / "step-6"  # the end of training waits for it
    argv = tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)
    kill_while_writing(argv, "SWIFTLM_TEST_MIRROR_PAUSE", torn)
    shutil.rmtree(run)  # the machine is lost: only the mirror is left
    shutil.rmtree(tmp_path / "shm")
    printed = resume(tiny_model_dir, chat_jsonl, run, flags, capsys)
    assert f"skipping incomplete checkpoint file://{tmp_path}/mirror/checkpoints/step-6" in printed
    assert f"resumed from {run}/checkpoints/step-3 (mirror) at step 3" in printed
    assert_same_weights(uninterrupted, run / ADAPTER)


RANDOM_SCHEDULE = dict(max_steps=8, save_steps=2, per_device_train_batch_size=4, async_save="true")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_at_a_random_time(seed, tiny_model_dir, chat_jsonl, tmp_path, capsys):
    """No hook: SIGKILL at a random moment around one of the checkpoint writes (a random
    one, 0-50 ms after its folder appears); every folder with COMPLETE then holds a whole
    checkpoint, and `auto` continues exactly."""
    import random

    reference = tmp_path / "reference"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, reference, **RANDOM_SCHEDULE)) == 0
    run, chance = tmp_path / "run", random.Random(seed)
    target = run / "checkpoints" / f"step-{chance.choice([2, 4, 6])}"
    code = "import sys; from swiftlm.cli.main import main; sys.exit(main(sys.argv[1:]))"
    argv = tiny_sft(tiny_model_dir, chat_jsonl, run, **RANDOM_SCHEDULE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", code, *argv], env=env, stdout=subprocess.DEVNULL
    )
    while not target.is_dir() and process.poll() is None:
        time.sleep(0.002)
    time.sleep(chance.uniform(0.0, 0.05))
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before the kill"
    for folder in (run / "checkpoints").glob("step-*"):
        if (folder / "COMPLETE").is_file():  # whole: its state and weights are all there
            assert (folder / "trainer_state.json").is_file()
            assert (folder / "adapter_model.safetensors").is_file()
    resume(tiny_model_dir, chat_jsonl, run, RANDOM_SCHEDULE, capsys)
    assert_same_weights(reference / ADAPTER, run / ADAPTER)
