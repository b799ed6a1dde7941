"""Pipeline parallel (torch.distributed.pipelining, 1F1B, 2 gloo ranks on CPU) equals one
process on the same batches, and resumes from its per-stage checkpoints."""

import shutil

import pytest

from conftest import logged, max_weight_difference, tiny_sft
from swiftlm.cli.main import main
from swiftlm.distributed.pp import stage_bounds

FULL = "model.safetensors"
STEPS = dict(
    train_type="full",
    learning_rate="1e-3",
    max_steps=6,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    save_steps=3,
    max_length=64,
)


def test_pp_matches_a_single_process_and_resumes(tiny_model_dir, chat_jsonl, tmp_path, capfd):
    single, pp, resumed = tmp_path / "single", tmp_path / "pp", tmp_path / "resumed"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **STEPS)) == 0
    pipeline = dict(nproc_per_node=2, pipeline_parallel_size=2)
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, pp, **STEPS, **pipeline, master_port=29692)) == 0
    )
    assert "x 2 (PipelineParallelStrategy" in capfd.readouterr().out
    assert logged(pp) == pytest.approx(logged(single), abs=1e-5)
    assert logged(pp, "grad_norm") == pytest.approx(logged(single, "grad_norm"), rel=1e-4)
    assert max_weight_difference(single / "final" / FULL, pp / "final" / FULL) < 1e-5
    step = pp / "checkpoints" / "step-3"
    assert (step / "stage-0").is_dir() and (step / "stage-1").is_dir() and (step / FULL).is_file()

    # Lose everything after step 3, then resume: the same final weights.
    shutil.copytree(pp, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    assert (
        main(
            tiny_sft(
                tiny_model_dir,
                chat_jsonl,
                resumed,
                **STEPS,
                **pipeline,
                resume_from_checkpoint="auto",
                master_port=29693,
            )
        )
        == 0
    )
    assert max_weight_difference(pp / "final" / FULL, resumed / "final" / FULL) <= 1e-6


def test_stage_bounds_split_blocks_evenly():
    assert [stage_bounds(30, 4, i) for i in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_bounds(2, 2, i) for i in range(2)] == [(0, 1), (1, 2)]
