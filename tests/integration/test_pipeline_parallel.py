"""Pipeline parallel (torch.distributed.pipelining, 1F1B, gloo ranks on CPU) equals one
process on the same batches: full fine-tuning with resume from per-stage checkpoints, LoRA
(its final/ loads with peft), `swiftlm pt`, and pipeline x DDP on 4 ranks (2 stages x 2
replicas). Each launch costs ~10 s at 2 ranks and ~30 s at 4 on a 2-core machine, so the
launches are few and short.
"""

import shutil

import pytest
import torch

from conftest import logged, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from swiftlm.distributed.pp import fixed_shape_batches
from swiftlm.distributed.pp_stage import stage_bounds
from tolerance import assert_same_training, assert_same_weights

FULL, ADAPTER = "model.safetensors", "adapter_model.safetensors"
STEPS = dict(
    train_type="full",
    learning_rate="1e-3",
    max_steps=6,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    save_steps=3,
    max_length=64,
)
PIPELINE = dict(nproc_per_node=2, pipeline_parallel_size=2, dist_timeout=120)
DOCS = [{"text": f"The quick brown fox {i} jumps over the lazy dog. " * 5} for i in range(12)]


def assert_same_as_one_process(single, parallel, weights, flags: dict, ranks: int = 2):
    """The pipeline's losses, grad norms and weights against one process's, within rounding."""
    assert_same_training(
        single,
        parallel,
        weights,
        learning_rate=float(flags["learning_rate"]),
        steps=flags["max_steps"],
        tokens=flags["max_length"],
        ranks=ranks,
    )


@pytest.mark.numerics
def test_pp_matches_a_single_process_and_resumes(tiny_model_dir, chat_jsonl, tmp_path):
    single, pp, resumed = tmp_path / "single", tmp_path / "pp", tmp_path / "resumed"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **STEPS)) == 0
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, pp, **STEPS, **PIPELINE, master_port=29692)) == 0
    )
    assert_same_as_one_process(single, pp, FULL, STEPS)
    step = pp / "checkpoints" / "step-3"
    assert (step / "stage-0").is_dir() and (step / "stage-1").is_dir() and (step / FULL).is_file()

    # Lose everything after step 3, then resume: the same final weights.
    shutil.copytree(pp, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    again = dict(resume_from_checkpoint="auto", master_port=29693)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **STEPS, **PIPELINE, **again)) == 0
    assert_same_weights(pp / "final" / FULL, resumed / "final" / FULL)  # the same arithmetic


@pytest.mark.numerics
def test_lora_under_pp_matches_a_single_process_and_loads_with_peft(
    tiny_model_dir, chat_jsonl, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = {**STEPS, "train_type": "lora", "learning_rate": "1e-2", "lora_dropout": 0}
    single, pp = tmp_path / "single", tmp_path / "pp"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **lora)) == 0
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, pp, **lora, **PIPELINE, master_port=29694)) == 0
    )
    assert_same_as_one_process(single, pp, ADAPTER, lora)
    # Stages save their adapter weights only; the checkpoint and final/ are peft adapters.
    stage = pp / "checkpoints" / "step-3" / "stage-1" / FULL
    from safetensors.torch import load_file

    assert load_file(stage) and all("lora_" in k for k in load_file(stage))
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), pp / "final"
    )
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), single / "final"
    )
    with torch.no_grad():
        logits, expected = model(ids).logits, reference(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits
    # The adapters agree within Adam's rounding bound (above), 1e-3 of their training moves: the
    # logits do too, far inside 1% of how far training moved them. An adapter peft failed to
    # load (a missing or misnamed tensor leaves lora_B at its zero start) misses by 100%.
    moved = (expected - base).abs().max().item()
    assert moved > 0 and (logits - expected).abs().max().item() <= 1e-2 * moved


@pytest.mark.numerics
def test_pt_with_two_stages_matches_a_single_process(tiny_model_dir, tmp_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    flags = {**STEPS, "max_steps": 4, "save_steps": 100, "max_length": 32}
    single, pp = tmp_path / "single", tmp_path / "pp"
    assert main(["pt", *tiny_sft(tiny_model_dir, docs, single, **flags)[1:]]) == 0
    pipeline = [
        "pt",
        *tiny_sft(tiny_model_dir, docs, pp, **flags, **PIPELINE, master_port=29695)[1:],
    ]
    assert main(pipeline) == 0
    assert len(logged(pp)) == 4
    assert_same_as_one_process(single, pp, FULL, flags)


@pytest.mark.numerics
def test_pp_x_ddp_on_four_ranks_matches_a_single_process_and_resumes(
    tiny_model_dir, chat_jsonl, tmp_path
):
    # 2 stages x 2 data-parallel replicas; each replica reads 2 of the 4 rows of a micro-batch.
    flags = {**STEPS, "max_steps": 4, "save_steps": 2}
    single, mesh, resumed = tmp_path / "single", tmp_path / "pp-ddp", tmp_path / "resumed"
    whole = {**flags, "per_device_train_batch_size": 4}
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **whole)) == 0
    four = {**PIPELINE, "nproc_per_node": 4}
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, mesh, **flags, **four, master_port=29696)) == 0
    assert_same_as_one_process(single, mesh, FULL, flags, ranks=4)
    # One copy per stage (replica 0 writes it), and a random state per rank.
    step = mesh / "checkpoints" / "step-2"
    assert sorted(p.name for p in step.glob("stage-*")) == ["stage-0", "stage-1"]
    assert (step / "rng-rank3.safetensors").is_file()

    shutil.copytree(mesh, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    again = dict(resume_from_checkpoint="auto", master_port=29697)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **flags, **four, **again)) == 0
    assert_same_weights(mesh / "final" / FULL, resumed / "final" / FULL)


@pytest.mark.slow
@pytest.mark.numerics
def test_pp_x_fsdp2_on_four_ranks_matches_a_single_process_and_resumes(
    tiny_model_dir, chat_jsonl, tmp_path
):
    # 2 stages, each sharded over its 2 replicas; stage state in DCP shards per stage.
    flags = {**STEPS, "max_steps": 4, "save_steps": 2}
    single, mesh, resumed = tmp_path / "single", tmp_path / "pp-fsdp", tmp_path / "resumed"
    whole = {**flags, "per_device_train_batch_size": 4}
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **whole)) == 0
    four = {**PIPELINE, "nproc_per_node": 4, "fsdp": "fsdp2"}
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, mesh, **flags, **four, master_port=29698)) == 0
    assert_same_as_one_process(single, mesh, FULL, flags, ranks=4)
    assert (mesh / "checkpoints" / "step-2" / "stage-1" / "dcp" / ".metadata").is_file()

    shutil.copytree(mesh, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    again = dict(resume_from_checkpoint="auto", master_port=29699)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **flags, **four, **again)) == 0
    assert_same_weights(mesh / "final" / FULL, resumed / "final" / FULL)


def test_stage_bounds_split_blocks_evenly():
    assert [stage_bounds(30, 4, i) for i in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_bounds(2, 2, i) for i in range(2)] == [(0, 1), (1, 2)]


def test_a_short_step_is_padded_to_the_fixed_shape_with_each_columns_pad():
    batch = {
        "input_ids": torch.tensor([[4, 5, 6]]),
        "labels": torch.tensor([[-100, 5, 6]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
    }
    pads = {"input_ids": 0, "labels": -100, "attention_mask": 0}
    fixed = fixed_shape_batches([batch], pads, rows=2, width=5, count=3)
    assert len(fixed) == 3
    assert all(b[k].shape == (2, 5) for b in fixed for k in pads)
    assert fixed[0]["input_ids"].tolist() == [[4, 5, 6, 0, 0], [0, 0, 0, 0, 0]]
    assert fixed[0]["labels"].tolist()[1] == [-100] * 5
    assert (fixed[2]["labels"] == -100).all() and (fixed[2]["attention_mask"] == 0).all()
    with pytest.raises(ValueError, match="exceeds --max_length"):
        fixed_shape_batches([batch], pads, rows=2, width=2, count=1)
