"""Checkpoint tiers end to end: `swiftlm sft` with --local_save_steps and --checkpoint_mirror
(fsspec's in-memory filesystem) writes each tier, and `--resume_from_checkpoint auto` takes
the newest complete checkpoint of all of them and continues exactly."""

import shutil

import fsspec

from conftest import stopped_at, tiny_sft
from swiftlm.checkpoint.mirror import Mirror
from swiftlm.cli.main import main
from tolerance import assert_same_weights

ADAPTER = "final/adapter_model.safetensors"


def steps_in(folder) -> list[int]:
    root = folder / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "COMPLETE").is_file())


def test_local_tier_and_mirror_are_written_and_auto_resumes_the_newest(
    tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    run, shm, url = tmp_path / "run", tmp_path / "shm", f"memory://tiers/{tmp_path.name}"
    flags = dict(
        max_steps=7,
        save_steps=4,
        local_save_steps=2,
        local_save_total_limit=2,
        per_device_train_batch_size=4,
    )
    tiered = dict(flags, local_save_dir=shm, checkpoint_mirror=url)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **tiered)) == 0
    assert steps_in(run) == [4, 7]
    assert steps_in(shm) == [2, 6]  # step 4 was due for both: the run directory only
    assert Mirror(url).steps() == ([4, 7], [])  # the end of training waited for the copy

    # As if the run had been killed after step 6: the run directory has step 4, the local
    # tier step 6 (newest) and a torn step 8 that must not be taken.
    stopped = stopped_at(run, 4, tmp_path / "stopped")
    shm_copy = tmp_path / "shm-copy"
    shutil.copytree(shm, shm_copy)
    shutil.copytree(shm_copy / "checkpoints" / "step-6", shm_copy / "checkpoints" / "step-8")
    (shm_copy / "checkpoints" / "step-8" / "COMPLETE").unlink()
    capsys.readouterr()
    resumed = dict(flags, local_save_dir=shm_copy, resume_from_checkpoint="auto")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, stopped, **resumed)) == 0
    printed = capsys.readouterr().out
    assert f"skipping incomplete checkpoint {shm_copy}/checkpoints/step-8" in printed
    assert f"resumed from {shm_copy}/checkpoints/step-6 (local tier) at step 6" in printed
    assert_same_weights(run / ADAPTER, stopped / ADAPTER)
    fsspec.filesystem("memory").rm(f"/tiers/{tmp_path.name}", recursive=True)
