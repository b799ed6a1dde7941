"""`swiftlm sft --expert_parallel_size 2` on 2 gloo ranks equals one process accumulating the
same micro-batches (losses, router figures, weights); its checkpoints hold the full experts and
resume exactly."""

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import logged, stopped_at, tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_close, assert_same_weights, assert_trained_weights_close, forward_terms

MODEL = "model.safetensors"
# Full fine-tuning: the expert shards themselves train, and their gradients are reduced.
RUN = dict(
    train_type="full",
    router_aux_loss_coef=0.5,
    learning_rate="1e-2",
    max_steps=4,
    per_device_train_batch_size=2,
    save_steps=2,
)
# As the MoE DDP test: the tiny Qwen3-MoE's chain of sums, + the two ranks' sums.
TERMS = forward_terms(64, intermediate=32) + 2


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("engine", "port"), [({}, 29581), ({"fsdp": "fsdp2"}, 29584)], ids=["ddp", "fsdp2"]
)
def test_expert_parallel_matches_one_process_and_resumes_exactly(
    engine, port, tiny_moe_dir, chat_jsonl, tmp_path, capfd
):
    """2 ranks of 2 samples, each holding 4 of the 8 experts = one process accumulating the 2
    micro-batches with all 8 (the load-balancing loss is not linear in its micro-batch, so the
    ranks see exactly the single process's micro-batches). Under FSDP2 the other weights are
    sharded and the checkpoints are DCP's, beside the consolidated model."""
    single, split = tmp_path / "single", tmp_path / "ep"
    argv = tiny_sft(tiny_moe_dir, chat_jsonl, single, **RUN, gradient_accumulation_steps=2)
    assert main(argv) == 0
    flags = dict(RUN, **engine, nproc_per_node=2, expert_parallel_size=2, master_port=port)
    assert main(tiny_sft(tiny_moe_dir, chat_jsonl, split, **flags)) == 0
    name = "FSDP2" if engine else "DDP"
    assert f"{name} 2 with expert parallel 2" in capfd.readouterr().out
    for key in ("loss", "router_aux_loss", "router_entropy", "grad_norm"):
        assert_close(logged(split, key), logged(single, key), terms=TERMS, what=key)
    assert logged(split, "router_expert_load")[0] == logged(single, "router_expert_load")[0]
    # The saved models hold all 8 experts of every layer, gathered from the two ranks
    # (transformers writes them one by one: model.layers.L.mlp.experts.E.gate_proj.weight).
    final = load_file(split / "final" / MODEL)
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.mlp.experts."
        held = {key[len(prefix) :].split(".")[0] for key in final if key.startswith(prefix)}
        assert held == {str(expert) for expert in range(8)}
    assert_trained_weights_close(
        single / "final" / MODEL, split / "final" / MODEL, learning_rate=1e-2, steps=4
    )
    loaded = AutoModelForCausalLM.from_pretrained(split / "final")  # loads as it is
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)
    step2 = split / "checkpoints" / "step-2" / MODEL
    assert_trained_weights_close(
        single / "checkpoints" / "step-2" / MODEL, step2, learning_rate=1e-2, steps=2
    )
    # Resumed from step 2 (each rank reloads its slice of the experts and of their moments).
    resumed = stopped_at(split, 2, tmp_path / "resumed")
    again = dict(flags, master_port=port + 1, resume_from_checkpoint="auto")
    assert main(tiny_sft(tiny_moe_dir, chat_jsonl, resumed, **again)) == 0
    assert logged(resumed) == logged(split)
    assert_same_weights(split / "final" / MODEL, resumed / "final" / MODEL)


@pytest.mark.numerics
def test_expert_parallel_with_attention_adapters_and_checkpointing(
    tiny_moe_dir, chat_jsonl, tmp_path
):
    """LoRA on attention only (the experts frozen, still split) with activation checkpointing,
    which recomputes each layer's token exchange in backward: still one process's run."""
    flags = dict(
        RUN,
        train_type="lora",
        lora_dropout=0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        gradient_checkpointing="true",
        save_steps=4,
    )
    single, split = tmp_path / "single", tmp_path / "ep"
    argv = tiny_sft(tiny_moe_dir, chat_jsonl, single, **flags, gradient_accumulation_steps=2)
    assert main(argv) == 0
    ranks = dict(flags, nproc_per_node=2, expert_parallel_size=2, master_port=29583)
    assert main(tiny_sft(tiny_moe_dir, chat_jsonl, split, **ranks)) == 0
    for key in ("loss", "router_aux_loss", "grad_norm"):
        assert_close(logged(split, key), logged(single, key), terms=TERMS, what=key)
    adapter = "adapter_model.safetensors"
    assert_trained_weights_close(
        single / "final" / adapter, split / "final" / adapter, learning_rate=1e-2, steps=4
    )
