"""Pipeline parallel (torch.distributed.pipelining, 1F1B, 2 gloo ranks on CPU) equals one
process on the same batches, and resumes from its per-stage checkpoints."""

import shutil

import pytest

from conftest import logged, max_weight_difference
from swiftlm.cli.main import main
from swiftlm.dist.pp import stage_bounds

FULL = "model.safetensors"


def test_pp_matches_a_single_process_and_resumes(tiny_model_dir, chat_jsonl, tmp_path, capfd):
    base = [
        "sft",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(chat_jsonl),
        "--torch_dtype",
        "float32",
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        "--train_type",
        "full",
        "--learning_rate",
        "1e-3",
        "--max_steps",
        "6",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--save_steps",
        "3",
        "--max_length",
        "64",
    ]
    single, pp = tmp_path / "single", tmp_path / "pp"
    assert main([*base, "--output_dir", str(single)]) == 0
    pipeline = ["--nproc_per_node", "2", "--pipeline_parallel_size", "2", "--master_port", "29692"]
    assert main([*base, "--output_dir", str(pp), *pipeline]) == 0
    assert "x 2 (PipelineParallelStrategy" in capfd.readouterr().out
    assert logged(pp) == pytest.approx(logged(single), abs=1e-5)
    assert logged(pp, "grad_norm") == pytest.approx(logged(single, "grad_norm"), rel=1e-4)
    assert max_weight_difference(single / "final" / FULL, pp / "final" / FULL) < 1e-5
    step = pp / "checkpoints" / "step-3"
    assert (step / "stage-0").is_dir() and (step / "stage-1").is_dir() and (step / FULL).is_file()

    # Lose everything after step 3, then resume: the same final weights.
    resumed = tmp_path / "resumed"
    shutil.copytree(pp, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    argv = [*base, "--output_dir", str(resumed), "--resume_from_checkpoint", "auto", *pipeline]
    assert main(argv[:-1] + ["29693"]) == 0
    assert max_weight_difference(pp / "final" / FULL, resumed / "final" / FULL) <= 1e-6


def test_stage_bounds_split_blocks_evenly():
    assert [stage_bounds(30, 4, i) for i in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_bounds(2, 2, i) for i in range(2)] == [(0, 1), (1, 2)]
