"""Mixture-of-experts models: the experts implementation swiftlm runs by default against the
modeling file's loop, and the router figures and load-balancing loss against transformers'."""

from dataclasses import replace

import pytest
import torch

from conftest import make_tiny_moe
from swiftlm.errors import ConfigError
from swiftlm.models.moe import (
    RouterRecorder,
    build_router_recorder,
    expert_parameters,
    router_statistics,
    routers,
)
from swiftlm.monitor.mfu import linear_parameters
from tolerance import assert_close, forward_terms

VOCAB = 97


def _batch(seed: int = 1):
    """Two rows of 12 tokens, the second padded after 7 (right padding)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _moe_terms(tokens: int) -> int:
    # The tiny MoE's chain: the Llama count with the experts' width (32) as the MLP's, plus the
    # router's product over hidden and its softmax over 8 experts per layer.
    return forward_terms(tokens, intermediate=32, vocab=VOCAB) + 2 * (64 + 8)


@pytest.mark.numerics
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_grouped_experts_equal_the_modeling_files_loop(model_type):
    """--experts_impl grouped_mm (the default) computes what the per-expert loop does: the
    loss and every gradient, fp32."""
    ids, mask, labels = _batch()
    results = {}
    for implementation in ("eager", "grouped_mm"):
        model = make_tiny_moe(model_type, VOCAB)
        model.set_experts_implementation(implementation)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[implementation] = (loss.detach(), grads)
    (loss_loop, grads_loop), (loss_grouped, grads_grouped) = results["eager"], results["grouped_mm"]
    assert_close(loss_grouped, loss_loop, terms=_moe_terms(24), what="loss")
    assert grads_loop.keys() == grads_grouped.keys()
    assert any("experts" in name for name in grads_loop)
    for name, grad in grads_loop.items():
        scale = grad.abs().max().item()  # a gradient sums signed terms: bound by its scale
        assert_close(
            grads_grouped[name], grad, terms=2 * _moe_terms(24), magnitude=scale, what=name
        )


@pytest.mark.numerics
def test_load_balancing_loss_equals_transformers_with_padding():
    """router_statistics' aux is transformers' load_balancing_loss_func over the real tokens."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    generator = torch.Generator().manual_seed(0)
    layers = tuple(
        torch.randn(2 * 5, 8, generator=generator, dtype=torch.float64) for _ in range(3)
    )
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 3:] = 0
    expected = load_balancing_loss_func(layers, 8, 2, mask)
    stats = router_statistics(torch.stack(layers)[:, mask.reshape(-1).bool()], top_k=2)
    # float32 statistics of float64 logits: a mean over 24 tokens and a sum over 8 experts.
    assert_close(stats.aux, expected, terms=32, what="aux loss")
    assert stats.counts.sum().item() == 3 * 8 * 2  # layers x real tokens x top_k slots
    assert 0 < stats.entropy.item() < torch.log(torch.tensor(8.0)).item()


@pytest.mark.numerics
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_recorded_router_loss_equals_the_models_own(model_type):
    """Cross-entropy + coefficient x the recorder's aux loss is the loss transformers computes
    with output_router_logits (padding masked as it masks it); forwards without gradients or
    outside recording() leave nothing behind."""
    ids, mask, labels = _batch(seed=3)
    model = make_tiny_moe(model_type, VOCAB)
    model.router_aux_loss_coef = 0.3  # read by the model's forward (set from its config)
    recorder = RouterRecorder(model, top_k=2)
    assert recorder.layer_names == ["layer 0", "layer 1"]
    with recorder.recording():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)  # a reference forward: not recorded
        cross_entropy = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    stats = recorder.take()
    expected = model(
        input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True
    ).loss
    assert_close(cross_entropy + 0.3 * stats.aux, expected, terms=_moe_terms(19), what="loss")
    assert stats.counts.sum().item() == 2 * 19 * 2  # layers x real tokens x top_k
    model(input_ids=ids, attention_mask=mask)  # outside recording()
    assert recorder.take() is None
    recorder.remove()


def test_flops_count_only_the_experts_a_token_uses():
    model = make_tiny_moe("qwen3_moe", VOCAB)
    total, active, trained = expert_parameters(model)
    assert total == 2 * 8 * (2 * 32 * 64 + 64 * 32)  # layers x experts x (gate_up + down)
    assert active == total * 2 // 8 and trained == active  # all weights train here
    model.requires_grad_(False)
    assert expert_parameters(model) == (total, active, 0)
    dense, _ = linear_parameters(model)
    attention_and_head = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    assert dense == attention_and_head + active
    assert len(routers(model)) == 2


def test_router_loss_refused_where_it_cannot_apply():
    from conftest import make_tiny_llama

    with pytest.raises(ConfigError, match="has no mixture-of-experts routers; drop it"):
        build_router_recorder(make_tiny_llama(VOCAB), 0.01, False, "tiny-llama")
    assert build_router_recorder(make_tiny_llama(VOCAB), 0.0, False, "tiny-llama") is None
    moe = make_tiny_moe("qwen3_moe", VOCAB)
    with pytest.raises(ConfigError, match="pipeline schedule runs the forwards"):
        build_router_recorder(moe, 0.01, True, "tiny-moe")
    assert isinstance(build_router_recorder(moe, 0.01, False, "tiny-moe"), RouterRecorder)


def test_the_planner_holds_every_expert_and_times_only_the_routed_ones():
    """`swiftlm plan` on an MoE config: memory counts all experts, FLOPs top_k of them, the
    activations the routed experts' width; LoRA's count does not trip over peft's
    no-dropout rule for stacked experts."""
    from swiftlm.monitor.mfu import flops_per_token as measured_flops
    from swiftlm.plan.memory import Job
    from swiftlm.plan.shape import model_shape
    from swiftlm.plan.timing import flops_per_token
    from swiftlm.tuners.config import TunerArguments

    model = make_tiny_moe("qwen3_moe", VOCAB)
    stacked, active, _ = expert_parameters(model)
    full = model_shape(model.config, TunerArguments(train_type="full"), "tiny-moe")
    assert full.total_params == sum(p.numel() for p in model.parameters())
    assert full.idle_expert_params == stacked - active
    assert full.intermediate_size == 32 * 2  # two routed experts of width 32 per token
    # The planner's FLOPs are those monitor/mfu.py measures MFU with, up to what the planner
    # also counts as products (the norms' and routers' weights: 1,344 of ~60,000 here); with
    # the idle experts counted they would be 2.1x.
    job = Job(1, 64, full=True)
    planned, measured = flops_per_token(full, job), measured_flops(model, 64)
    assert abs(planned - measured) / measured < 0.03
    everything = flops_per_token(replace(full, idle_expert_params=0), job)
    assert everything > 2 * planned
    lora = model_shape(model.config, TunerArguments(lora_dropout=0.05), "tiny-moe")
    assert 0 < lora.trainable_params < lora.total_params
