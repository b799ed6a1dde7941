"""Tensor parallel (DTensor, 2 gloo ranks on CPU) equals one process on the same batch."""

import pytest

from conftest import logged, max_weight_difference, tiny_sft
from swiftlm.cli.main import main
from swiftlm.config.sections import DistArguments
from swiftlm.distributed.env import DistContext
from swiftlm.distributed.strategy import choose_strategy_name
from swiftlm.distributed.tp import TensorParallelStrategy
from swiftlm.errors import ConfigError

FULL = "model.safetensors"
STEPS = dict(
    train_type="full",
    learning_rate="1e-3",
    max_steps=5,
    gradient_accumulation_steps=2,
    save_steps=5,
)


def assert_same_training(single, parallel):
    assert logged(parallel) == pytest.approx(logged(single), abs=1e-5)
    # Ranks of a TP group share a batch: its tokens must count once (a doubled count halves
    # the gradient, which Adam hides but the clipping and this logged norm do not).
    assert logged(parallel, "grad_norm") == pytest.approx(logged(single, "grad_norm"), rel=1e-4)
    # Split matmuls sum in another order (~1e-7 relative); Adam divides by sqrt(v), which
    # magnifies that for near-zero gradient entries, hence 5e-5 on weights after 5 steps.
    assert max_weight_difference(single / "final" / FULL, parallel / "final" / FULL) < 5e-5


def test_tp_full_fine_tuning_matches_a_single_process(tiny_model_dir, chat_jsonl, tmp_path, capfd):
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
    assert "x 2 (TensorParallelStrategy" in capfd.readouterr().out
    assert_same_training(single, tp)
    assert (tp / "checkpoints" / "step-5" / "dcp").is_dir()


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
    assert_same_training(single, mesh)


def test_tp_rejects_adapters_and_indivisible_heads(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    strategy = TensorParallelStrategy(DistContext(rank=0, world_size=2), "cpu", 2)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2))
    with pytest.raises(ConfigError, match="LoRA/DoRA adapters are not supported"):
        strategy.wrap(lora)
    three = TensorParallelStrategy(DistContext(rank=0, world_size=3), "cpu", 3)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible"):
        three.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    with pytest.raises(ConfigError, match="must divide the number of processes"):
        TensorParallelStrategy(DistContext(rank=0, world_size=3), "cpu", 2)
    two_d = TensorParallelStrategy(DistContext(rank=3, world_size=4), "cpu", 2)
    assert (two_d.dp_rank, two_d.dp_size) == (1, 2)  # rank 3 = data group 1, tensor rank 1
    assert choose_strategy_name(DistArguments(tensor_parallel_size=2), 2) == "tp"
    assert choose_strategy_name(DistArguments(pipeline_parallel_size=2), 2) == "pp"
    assert choose_strategy_name(DistArguments(deepspeed="zero2"), 2) == "deepspeed"
    assert choose_strategy_name(DistArguments(), 2) == "ddp"
    assert choose_strategy_name(DistArguments(), 1) == "single"
