"""Tensor parallel (DTensor, 2 gloo ranks on CPU) equals one process on the same batch."""

import pytest

from conftest import tiny_sft
from swiftlm.cli.main import main
from swiftlm.config import TrainConfig
from swiftlm.config.checks import Facts
from swiftlm.config.rules import check
from swiftlm.distributed.config import DistArguments
from swiftlm.distributed.mesh import ParallelDims
from swiftlm.distributed.strategy import plan_parallelism
from swiftlm.distributed.tp import check_divisible, layer_plan
from swiftlm.errors import ConfigError
from tolerance import assert_same_training

FULL = "model.safetensors"
STEPS = dict(
    train_type="full",
    learning_rate="1e-3",
    max_steps=5,
    gradient_accumulation_steps=2,
    save_steps=5,
)


def assert_same_as_one_process(single, parallel, weights, flags: dict):
    # Ranks of a TP group share a batch: its tokens must count once (a doubled count halves
    # the gradient, which Adam hides but the clipping and the logged grad norm do not).
    trained = dict(learning_rate=float(flags["learning_rate"]), steps=flags["max_steps"])
    assert_same_training(single, parallel, weights, **trained, tokens=64, ranks=2)


@pytest.mark.numerics
def test_tp_full_fine_tuning_matches_a_single_process(tiny_model_dir, chat_jsonl, tmp_path):
    single, tp = tmp_path / "single", tmp_path / "tp"
    batch = dict(per_device_train_batch_size=4, **STEPS)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **batch)) == 0
    assert (
        main(
            tiny_sft(
                tiny_model_dir,
                chat_jsonl,
                tp,
                **batch,
                nproc_per_node=2,
                tensor_parallel_size=2,
                master_port=29661,
            )
        )
        == 0
    )
    assert_same_as_one_process(single, tp, FULL, STEPS)
    assert (tp / "checkpoints" / "step-5" / "dcp").is_dir()


@pytest.mark.numerics
def test_lora_under_tp_matches_a_single_process(tiny_model_dir, chat_jsonl, tmp_path):
    # Every projection adapted: q/k/v/gate/up split lora_B, o/down split lora_A.
    lora = dict(STEPS, train_type="lora", learning_rate="1e-2", lora_dropout=0)
    lora["target_modules"] = "all-linear"
    single, tp = tmp_path / "single", tmp_path / "tp"
    batch = dict(per_device_train_batch_size=4, **lora)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **batch)) == 0
    two = dict(nproc_per_node=2, tensor_parallel_size=2, master_port=29663)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tp, **batch, **two)) == 0
    assert_same_as_one_process(single, tp, "adapter_model.safetensors", lora)
    assert (tp / "checkpoints" / "step-5" / "dcp").is_dir()


@pytest.mark.numerics
def test_tp_and_fsdp2_on_a_2d_mesh_match_a_single_process(tiny_model_dir, chat_jsonl, tmp_path):
    # 4 processes: 2 data-parallel groups (FSDP2) x 2 tensor-parallel ranks; 2 samples per group.
    single, mesh = tmp_path / "single", tmp_path / "mesh"
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, single, per_device_train_batch_size=4, **STEPS))
        == 0
    )
    assert (
        main(
            tiny_sft(
                tiny_model_dir,
                chat_jsonl,
                mesh,
                per_device_train_batch_size=2,
                **STEPS,
                nproc_per_node=4,
                tensor_parallel_size=2,
                master_port=29662,
            )
        )
        == 0
    )
    assert_same_as_one_process(single, mesh, FULL, STEPS)


def test_parallel_dims_from_the_flags():
    two_d = plan_parallelism(DistArguments(tensor_parallel_size=2), 4)
    assert two_d == ParallelDims(dp=2, tp=2, data_parallel="fsdp2")  # DDP cannot hold DTensors
    assert two_d.coordinates(3) == (0, 1, 1)  # rank 3 = data group 1, tensor rank 1
    assert str(two_d) == "tensor parallel 2 x FSDP2 2"
    assert plan_parallelism(DistArguments(tensor_parallel_size=2), 2) == ParallelDims(tp=2)
    assert plan_parallelism(DistArguments(strategy="tp"), 2) == ParallelDims(tp=2)
    pp_ddp = plan_parallelism(DistArguments(pipeline_parallel_size=2), 4)
    assert pp_ddp == ParallelDims(pp=2, dp=2) and str(pp_ddp) == "pipeline parallel 2 x DDP 2"
    assert pp_ddp.coordinates(2) == (1, 0, 0)  # stages outermost: ranks 2, 3 hold stage 1
    pp_fsdp = plan_parallelism(DistArguments(pipeline_parallel_size=2, fsdp="fsdp2"), 4)
    assert pp_fsdp == ParallelDims(pp=2, dp=2, data_parallel="fsdp2")
    assert plan_parallelism(DistArguments(deepspeed="zero2"), 2).data_parallel == "deepspeed"
    assert str(plan_parallelism(DistArguments(), 2)) == "DDP 2"
    assert str(plan_parallelism(DistArguments(tensor_parallel_size=2), 1)) == "one process"


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (dict(tensor_parallel_size=2), 3, "--tensor_parallel_size 2 must divide the number"),
        (dict(pipeline_parallel_size=2), 3, "--pipeline_parallel_size 2 must divide the number"),
        (dict(pipeline_parallel_size=2, tensor_parallel_size=2), 4, "not supported yet"),
        (dict(tensor_parallel_size=2, deepspeed="zero2"), 4, "drop --deepspeed"),
        (dict(tensor_parallel_size=2, strategy="ddp"), 4, "drop --strategy ddp"),
        (dict(strategy="single"), 2, "cannot run with several processes"),
        (dict(fsdp="hybrid"), 2, "use fsdp2"),
    ],
)
def test_conflicting_parallelism_flags_are_named(flags, world, message):
    """The rules run by every training command before anything loads (config/rules.py)."""
    with pytest.raises(ConfigError, match=message):
        check(TrainConfig(dist=DistArguments(**flags)), Facts(world_size=world))


def test_tp_plan_splits_lora_like_its_base_and_refuses_dora_and_odd_sizes(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible"):
        check_divisible(base.config, 3)
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "o_proj"]))
    plan = layer_plan(lora.get_decoder().layers[0])
    assert plan["self_attn.q_proj.base_layer"] == plan["self_attn.q_proj.lora_B.default"]
    assert plan["self_attn.o_proj.base_layer"] == plan["self_attn.o_proj.lora_A.default"]
    assert "self_attn.q_proj.lora_A.default" not in plan  # whole on every rank
    assert plan["self_attn.k_proj"] == "colwise"  # no adapter: split as is
    dora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, use_dora=True)
    )
    with pytest.raises(ConfigError, match="DoRA"):
        layer_plan(dora.get_decoder().layers[0])
