"""--async_save for the engines that write plain files: one process, DDP, pipeline stages, and
the block store. The files equal a synchronous save's, a resume from them equals the
uninterrupted run, and a failed background write leaves no COMPLETE and stops the run.
"""

import shutil

import pytest
from safetensors.torch import load_file

from conftest import stopped_at, tiny_sft
from swiftlm.checkpoint import replicated
from swiftlm.checkpoint.tensors import read_optimizer, read_weights
from swiftlm.cli.main import main
from tolerance import assert_same_weights

ADAPTER, FULL = "adapter_model.safetensors", "model.safetensors"
LORA = dict(lora_dropout=0, learning_rate="1e-2", max_steps=6, save_steps=2)


@pytest.mark.parametrize("incremental", ["false", "true"])
def test_async_checkpoints_equal_sync_ones_and_resume_exactly(
    incremental, tiny_model_dir, chat_jsonl, tmp_path
):
    flags = dict(LORA, incremental_checkpoints=incremental)
    sync, background = tmp_path / "sync", tmp_path / "async"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, sync, **flags)) == 0
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, background, async_save="true", **flags)) == 0
    for step in (2, 4, 6):
        a, b = (run / "checkpoints" / f"step-{step}" for run in (sync, background))
        assert (b / "COMPLETE").is_file()
        assert {k: v.tolist() for k, v in read_weights(a).items()} == {
            k: v.tolist() for k, v in read_weights(b).items()
        }
        saved_a, saved_b = read_optimizer(a), read_optimizer(b)
        assert saved_a["param_groups"] == saved_b["param_groups"]
        for index, state in saved_a["state"].items():
            assert all(state[k].equal(saved_b["state"][index][k]) for k in state)
    resumed = stopped_at(background, 2, tmp_path / "resumed")
    again = dict(flags, async_save="true", resume_from_checkpoint="auto")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **again)) == 0
    assert_same_weights(background / "final" / ADAPTER, resumed / "final" / ADAPTER)


@pytest.mark.bad_input(
    input="--async_save true, and the background write of a checkpoint fails (disk full)",
    outcome="CheckpointError at the next save naming the folder, which stays without COMPLETE; "
    "exit 1",
)
@pytest.mark.parametrize("incremental", ["false", "true"])
def test_a_failed_background_write_stops_the_run_without_complete(
    incremental, tiny_model_dir, chat_jsonl, tmp_path, monkeypatch, capsys
):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    from swiftlm.checkpoint import blocks

    monkeypatch.setattr(replicated, "save_file", disk_full)
    monkeypatch.setattr(blocks, "_write_atomically", disk_full)
    run = tmp_path / "run"
    flags = dict(LORA, async_save="true", incremental_checkpoints=incremental)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)) == 1
    err = capsys.readouterr().err
    step2 = run / "checkpoints" / "step-2"
    assert f"writing {step2} in the background failed" in err and "No space left" in err
    assert step2.is_dir() and not (step2 / "COMPLETE").exists()
    assert not (run / "checkpoints" / "step-4" / "COMPLETE").exists()  # stopped at that save
    assert not (run / "final").exists()


def test_async_ddp_checkpoints_resume_exactly(tiny_model_dir, chat_jsonl, tmp_path):
    """2 gloo ranks: rank 0 writes in the background; a resume equals the whole run."""
    flags = dict(
        LORA, max_steps=4, nproc_per_node=2, async_save="true", incremental_checkpoints="true"
    )
    run = tmp_path / "ddp"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, master_port=30010, **flags)) == 0
    assert all((run / "checkpoints" / f"step-{n}" / "COMPLETE").is_file() for n in (2, 4))
    resumed = stopped_at(run, 2, tmp_path / "resumed")
    again = dict(flags, resume_from_checkpoint="auto", master_port=30011)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **again)) == 0
    assert_same_weights(run / "final" / ADAPTER, resumed / "final" / ADAPTER)


@pytest.mark.slow
def test_async_pipeline_stages_resume_exactly(tiny_model_dir, chat_jsonl, tmp_path):
    """2 pipeline stages write their folders in the background; COMPLETE waits for both."""
    flags = dict(
        train_type="full",
        learning_rate="1e-3",
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        save_steps=2,
        max_length=64,
        nproc_per_node=2,
        pipeline_parallel_size=2,
        dist_timeout=120,
        async_save="true",
    )
    run, sync = tmp_path / "pp", tmp_path / "pp-sync"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, master_port=30012, **flags)) == 0
    step2 = run / "checkpoints" / "step-2"
    assert (step2 / "COMPLETE").is_file() and (step2 / "stage-1" / FULL).is_file()
    sync_flags = dict(flags, async_save="false")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, sync, master_port=30013, **sync_flags)) == 0
    for stage in ("stage-0", "stage-1"):
        a = load_file(sync / "checkpoints" / "step-2" / stage / FULL)
        b = load_file(step2 / stage / FULL)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    again = dict(flags, resume_from_checkpoint="auto", master_port=30014)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **again)) == 0
    assert_same_weights(run / "final" / FULL, resumed / "final" / FULL)


def test_the_last_background_save_counts_towards_the_save_total_limit(
    tiny_model_dir, chat_jsonl, tmp_path
):
    """The end of training waits for the last write before pruning: the limit holds."""
    run = tmp_path / "run"
    flags = dict(LORA, async_save="true", save_total_limit=2)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)) == 0
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert kept == ["step-4", "step-6"]
