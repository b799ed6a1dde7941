"""Fused chunked LM head + cross-entropy: equal to the plain loss (value and gradients) on
random tensors and on a tiny Llama (full, tied, LoRA), logits never materialized, the
generation path unchanged, and fallbacks where the head cannot be fused."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import make_tiny_llama
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from swiftlm.data.collate import collate, collate_packed
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses import fused_ce
from swiftlm.losses.causal_lm import (
    causal_lm_loss,
    count_sequences,
    sequence_ids_from_batch,
    sequence_sums,
    shifted_labels,
)
from swiftlm.losses.fused_ce import (
    ChunkedLinearCrossEntropy,
    default_chunk_size,
    find_fused_lm_head,
    fused_causal_lm_loss,
    install_fused_lm_head,
    linear_cross_entropy_sum,
    uninstall_fused_lm_head,
)
from swiftlm.losses.fused_ce_token import linear_cross_entropy_per_token

N, H, V = 50, 16, 37  # V != H so that logits and weight shapes cannot be confused

# bf16 keeps 8 bits of mantissa (relative rounding 2**-8 = 0.4%): against the float32
# reference the loss may move by 1% and each gradient by 3% of its largest entry.
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_RTOL = 3e-2


def random_problem(seed=0, bias=False, ignored=0.3):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator).requires_grad_()
    weight = (torch.randn(V, H, generator=generator) * 0.5).requires_grad_()
    b = torch.randn(V, generator=generator).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[torch.rand(N, generator=generator) < ignored] = IGNORE_INDEX
    return hidden, weight, b, targets


def reference_loss(hidden, weight, bias, targets):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the scale (largest entry) of `expected`."""
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


def loss_and_grads(loss_fn, tensors):
    loss = loss_fn()
    return loss.detach(), torch.autograd.grad(loss, tensors)


# ---- the function ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [7, 10_000])
@pytest.mark.parametrize("bias", [False, True])
def test_function_matches_cross_entropy_fp32(chunk_size, bias):
    hidden, weight, b, targets = random_problem(bias=bias)
    tensors = [hidden, weight] + ([b] if bias else [])
    expected, expected_grads = loss_and_grads(
        lambda: reference_loss(hidden, weight, b, targets), tensors
    )
    got, grads = loss_and_grads(
        lambda: linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size), tensors
    )
    assert got.dtype == torch.float32 and got.ndim == 0
    assert math.isclose(float(got), float(expected), rel_tol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == expected_grad.dtype
        assert relative_error(grad, expected_grad) < 1e-5


def test_ignored_rows_get_zero_hidden_gradient_and_backward_scales():
    hidden, weight, _, targets = random_problem(seed=1)
    loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_size=7)
    (grad,) = torch.autograd.grad(loss * 0.25, [hidden])
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and (~ignored).any()
    assert grad[ignored].abs().max() == 0
    (expected,) = torch.autograd.grad(reference_loss(hidden, weight, None, targets), [hidden])
    assert relative_error(grad, 0.25 * expected) < 1e-5


def test_all_targets_ignored_gives_zero_loss_and_zero_grads():
    hidden, weight, b, targets = random_problem(bias=True, ignored=1.0)
    assert (targets == IGNORE_INDEX).all()
    loss = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size=7)
    assert loss.requires_grad and float(loss.detach()) == 0.0
    grads = torch.autograd.grad(loss, [hidden, weight, b])
    assert [g.shape for g in grads] == [hidden.shape, weight.shape, b.shape]
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, _, targets = random_problem()
    weight.requires_grad_(False)
    loss = linear_cross_entropy_sum(hidden, weight, targets)
    loss.backward()
    assert weight.grad is None and hidden.grad is not None


def test_no_grad_computes_only_the_loss():
    hidden, weight, _, targets = random_problem()
    with torch.no_grad():
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_size=7)
    assert not loss.requires_grad
    expected = reference_loss(hidden, weight, None, targets).detach()
    assert math.isclose(float(loss), float(expected), rel_tol=1e-5)


def test_second_backward_raises_instead_of_scaling_twice():
    hidden, weight, _, targets = random_problem()
    loss = ChunkedLinearCrossEntropy.apply(hidden, weight, None, targets, 7)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("block_rows", [None, 5])
def test_under_bf16_autocast_within_bf16_tolerance(monkeypatch, block_rows):
    if block_rows:  # the weight gradient is accumulated in several blocks of vocab rows
        monkeypatch.setattr(fused_ce, "_ACCUMULATE_BLOCK_ELEMENTS", block_rows * H)
    hidden, weight, b, targets = random_problem(bias=True)
    tensors = [hidden, weight, b]
    expected, expected_grads = loss_and_grads(
        lambda: reference_loss(hidden, weight, b, targets), tensors
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, grads = loss_and_grads(
            lambda: linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size=7), tensors
        )
        plain = reference_loss(hidden, weight, b, targets)
    assert got.dtype == torch.float32
    # The logits really were computed in bf16: the fp32 result is not reproduced exactly...
    assert float(got) != float(expected)
    # ...but the plain head under the same autocast is (same bf16 logits, float32 softmax).
    assert math.isclose(float(got), float(plain), rel_tol=1e-5)
    assert math.isclose(float(got), float(expected), rel_tol=BF16_LOSS_RTOL)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == torch.float32  # the dtype of each input
        assert relative_error(grad, expected_grad) < BF16_GRAD_RTOL


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.shapes += [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]
        return out


def test_never_materializes_more_than_one_chunk_of_logits():
    hidden, weight, _, targets = random_problem(ignored=0.0)
    with ShapeRecorder() as recorder:
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_size=7)
        loss.backward()
    # [H, V] is the transposed weight (a view), every other [rows, V] is logits.
    vocab_rows = [s[0] for s in recorder.shapes if len(s) == 2 and s[-1] == V and s != (H, V)]
    assert vocab_rows and max(vocab_rows) == 7
    # The recorder does see full logits when they exist.
    with ShapeRecorder() as recorder:
        reference_loss(hidden, weight, None, targets).backward()
    assert (N, V) in recorder.shapes


def test_default_chunk_keeps_float32_logits_near_64_mib():
    assert default_chunk_size(49152) == 341  # SmolLM2: 341 x 49152 x 4 B = 64 MiB
    assert default_chunk_size(400) == 41943
    assert default_chunk_size(2**22) == 64  # a floor, so huge vocabularies still batch rows


# ---- the per-token function -----------------------------------------------------------------


def reference_token_losses(hidden, weight, bias, targets):
    logits = F.linear(hidden, weight, bias).float()
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return losses.reshape(targets.shape)


def token_weights(shape, seed=5):
    """A per-token grad_output of both signs, as a per-sample weighting or DPO produces."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def token_losses_and_grads(per_token_fn, tensors):
    """Token losses, and the gradients of sum(weights * token losses)."""
    losses = per_token_fn()
    weighted_sum = (losses * token_weights(losses.shape)).sum()
    return losses.detach(), torch.autograd.grad(weighted_sum, tensors)


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
@pytest.mark.parametrize("bias", [False, True])
def test_per_token_matches_cross_entropy_none_fp32(chunk_size, bias):
    hidden, weight, b, targets = random_problem(bias=bias)
    # [5, 10] tokens: the result has the targets' shape, whatever it is.
    hidden, targets = hidden.detach().reshape(5, 10, H).requires_grad_(), targets.reshape(5, 10)
    tensors = [hidden, weight] + ([b] if bias else [])
    expected, expected_grads = token_losses_and_grads(
        lambda: reference_token_losses(hidden, weight, b, targets), tensors
    )
    got, grads = token_losses_and_grads(
        lambda: linear_cross_entropy_per_token(hidden, weight, targets, b, chunk_size), tensors
    )
    assert got.shape == targets.shape and got.dtype == torch.float32
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and torch.equal(got[ignored], torch.zeros(int(ignored.sum())))
    assert relative_error(got, expected) < 1e-6
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == expected_grad.dtype
        assert relative_error(grad, expected_grad) < 1e-5
    assert grads[0][ignored].abs().max() == 0  # ignored rows get no hidden gradient


def test_per_token_sums_to_the_fused_sum():
    hidden, weight, b, targets = random_problem(bias=True)
    token = linear_cross_entropy_per_token(hidden, weight, targets, b, chunk_size=7)
    total = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size=7)
    assert math.isclose(float(token.detach().sum()), float(total.detach()), rel_tol=1e-6)


def test_per_token_all_targets_ignored_gives_zeros_and_zero_grads():
    hidden, weight, b, targets = random_problem(bias=True, ignored=1.0)
    losses = linear_cross_entropy_per_token(hidden, weight, targets, b, chunk_size=7)
    assert losses.requires_grad and torch.equal(losses.detach(), torch.zeros(N))
    grads = torch.autograd.grad(losses.sum(), [hidden, weight, b])
    assert [g.shape for g in grads] == [hidden.shape, weight.shape, b.shape]
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_per_token_frozen_weight_no_grad_and_retain_graph():
    hidden, weight, _, targets = random_problem()
    weight.requires_grad_(False)
    losses = linear_cross_entropy_per_token(hidden, weight, targets, chunk_size=7)
    # Nothing is precomputed in forward, so a second backward (retain_graph) is correct.
    losses.sum().backward(retain_graph=True)
    once = hidden.grad.clone()
    losses.sum().backward()
    assert weight.grad is None and torch.allclose(hidden.grad, 2 * once, rtol=0, atol=0)
    with torch.no_grad():
        no_grad = linear_cross_entropy_per_token(hidden, weight, targets, chunk_size=7)
    assert not no_grad.requires_grad and torch.equal(no_grad, losses.detach())


def test_per_token_mismatched_shapes_raise():
    hidden, weight, _, targets = random_problem()
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy_per_token(hidden, weight, targets[:-1])


@pytest.mark.parametrize("block_rows", [None, 5])
def test_per_token_under_bf16_autocast(monkeypatch, block_rows):
    """Forward under autocast, backward outside it (as a training loop does): backward must
    still run the head in bf16, as the summed loss (gradients made in forward) does."""
    if block_rows:
        monkeypatch.setattr(fused_ce, "_ACCUMULATE_BLOCK_ELEMENTS", block_rows * H)
    hidden, weight, b, targets = random_problem(bias=True)
    tensors = [hidden, weight, b]
    expected = reference_token_losses(hidden, weight, b, targets).detach()
    expected_grads = torch.autograd.grad(reference_loss(hidden, weight, b, targets), tensors)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = linear_cross_entropy_per_token(hidden, weight, targets, b, chunk_size=7)
        plain = reference_token_losses(hidden, weight, b, targets).detach()
        fused_sum = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size=7)
    grads = torch.autograd.grad(losses.sum(), tensors)
    sum_grads = torch.autograd.grad(fused_sum, tensors)
    assert losses.dtype == torch.float32 and not torch.equal(losses.detach(), expected)
    assert relative_error(losses.detach(), plain) < 1e-6  # the same bf16 logits
    assert relative_error(losses.detach(), expected) < BF16_LOSS_RTOL
    for grad, sum_grad, expected_grad in zip(grads, sum_grads, expected_grads, strict=True):
        assert grad.dtype == torch.float32
        assert relative_error(grad, sum_grad) < 1e-5  # bf16 matmuls in backward too
        assert relative_error(grad, expected_grad) < BF16_GRAD_RTOL


def test_per_token_with_bf16_parameters():
    hidden, weight, b, targets = random_problem(bias=True)
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in (hidden, weight, b)]
    losses = linear_cross_entropy_per_token(low[0], low[1], targets, low[2], chunk_size=7)
    plain = reference_token_losses(*low, targets)
    expected = reference_token_losses(hidden, weight, b, targets)
    assert losses.dtype == torch.float32
    assert relative_error(losses.detach(), plain.detach()) < 1e-6
    assert relative_error(losses.detach(), expected.detach()) < BF16_LOSS_RTOL
    weights = token_weights((N,))
    grads = torch.autograd.grad((losses * weights).sum(), low)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [hidden, weight, b])
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == torch.bfloat16  # the dtype of each input
        assert relative_error(grad, expected_grad) < BF16_GRAD_RTOL


def test_per_token_never_materializes_more_than_one_chunk_of_logits():
    hidden, weight, _, targets = random_problem(ignored=0.0)
    with ShapeRecorder() as recorder:
        losses = linear_cross_entropy_per_token(hidden, weight, targets, chunk_size=7)
        (losses * token_weights((N,))).sum().backward()
    vocab_rows = [s[0] for s in recorder.shapes if len(s) == 2 and s[-1] == V and s != (H, V)]
    assert vocab_rows and max(vocab_rows) == 7


# ---- a tiny Llama ---------------------------------------------------------------------------

VOCAB, SEQ = 400, 12


def tiny_llama(tie=False, seed=0):
    return make_tiny_llama(VOCAB, seed, tie)


def lora(model, target_modules=("q_proj", "v_proj")):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules), lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    # Nonzero B so that the LoRA gradients depend on the whole path, not only on A's zeros.
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return peft_model


def padded_batch(seed=0):
    """3 rows: full, prompt-masked, right-padded (mask 0, labels -100 on the padding)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (3, SEQ), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    labels[1, :5] = IGNORE_INDEX
    attention_mask[2, 8:] = 0
    input_ids[2, 8:] = 0
    labels[2, 8:] = IGNORE_INDEX
    labels[2, :2] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_batch(seed=0):
    """One packed row of two sequences: position_ids restart, no attention_mask."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (1, SEQ), generator=generator)
    labels = input_ids.clone()
    labels[0, 0] = labels[0, 7] = IGNORE_INDEX
    position_ids = torch.cat([torch.arange(7), torch.arange(SEQ - 7)]).unsqueeze(0)
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def plain_loss(model, batch):
    """causal_lm_loss (position_ids in place of attention_mask for packed rows)."""
    return causal_lm_loss(model, batch)[0]


def loss_and_trainable_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    # Not 1: the loop divides by the token count, and backward must scale by it.
    (loss / 7).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_fused_equals_plain(model, batch):
    expected, expected_grads = loss_and_trainable_grads(model, plain_loss, batch)
    assert install_fused_lm_head(model)
    head_outputs = []
    find_fused_lm_head(model).register_forward_hook(lambda m, a, out: head_outputs.append(out))
    got, grads = loss_and_trainable_grads(model, lambda m, b: fused_causal_lm_loss(m, b)[0], batch)
    assert [out.ndim for out in head_outputs] == [0]  # the head returned the loss, not logits
    assert got.ndim == 0 and got.dtype == torch.float32
    assert math.isclose(float(got), float(expected), rel_tol=1e-5)
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) < 1e-5, name
    return grads


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch])
def test_full_fine_tuning_matches_plain_loss(tie, make_batch):
    model = tiny_llama(tie=tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    grads = assert_fused_equals_plain(model, make_batch())
    assert "lm_head.weight" in grads or tie  # the head is trained (tied: via embed_tokens)


def test_lora_with_frozen_head_matches_plain_loss():
    model = lora(tiny_llama())
    grads = assert_fused_equals_plain(model, padded_batch())
    assert grads and all("lora_" in name for name in grads)
    assert model.get_output_embeddings().weight.grad is None


def test_gradient_checkpointing_of_the_layers_matches_plain_loss():
    # Checkpointing recomputes the decoder layers in backward, never the head: the pending
    # targets are gone by then, so a recomputed head would return logits, not the loss.
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert_fused_equals_plain(model, padded_batch())


def test_install_keeps_names_and_generation_path():
    model = tiny_llama()
    batch = padded_batch()
    names = list(model.state_dict())
    with torch.no_grad():
        before = model(input_ids=batch["input_ids"]).logits
    assert install_fused_lm_head(model)
    assert install_fused_lm_head(model)  # idempotent
    fused_causal_lm_loss(model, batch)[0].backward()
    assert list(model.state_dict()) == names
    with torch.no_grad():
        after = model(input_ids=batch["input_ids"]).logits
    assert after.shape == (3, SEQ, VOCAB)
    assert torch.equal(after, before)


def test_targets_are_cleared_when_the_forward_fails():
    model = tiny_llama()
    install_fused_lm_head(model)
    batch = padded_batch()
    bad = dict(batch, input_ids=batch["input_ids"] + VOCAB)  # the embedding raises
    with pytest.raises(IndexError):
        fused_causal_lm_loss(model, bad)
    with torch.no_grad():
        assert model(input_ids=batch["input_ids"]).logits.shape == (3, SEQ, VOCAB)


def test_found_through_a_wrapper_and_uninstalled():
    class Wrapper(nn.Module):  # what DDP and DeepSpeed do: the model is a submodule
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    model = lora(tiny_llama())
    assert install_fused_lm_head(model)
    wrapped = Wrapper(model)
    head = find_fused_lm_head(wrapped)
    assert head is model.get_output_embeddings()
    batch = padded_batch()
    calls = []
    head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    loss, metrics = fused_causal_lm_loss(wrapped, batch)
    assert metrics == {} and calls == [(3, SEQ, 64)]  # module hooks (FSDP2, ZeRO-3) still run
    assert math.isclose(float(loss), float(plain_loss(model, batch)), rel_tol=1e-5)
    assert uninstall_fused_lm_head(wrapped)
    assert find_fused_lm_head(wrapped) is None and "forward" not in vars(head)


# ---- per-token and per-sequence losses through a tiny Llama -------------------------------


def token_losses_and_trainable_grads(model, loss_fn, batch):
    """Token losses of loss_fn(..., reduction="token"), and the trainable parameters'
    gradients of a weighted sum of them (per-token weights of both signs)."""
    model.zero_grad(set_to_none=True)
    losses, metrics = loss_fn(model, batch, reduction="token")
    assert metrics == {}
    (losses * token_weights(losses.shape)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses.detach(), grads


def backward_loss(loss_fn, model, batch, reduction):
    """What backward starts from: the loss sum, or a weighted sum of the token losses."""
    loss = loss_fn(model, batch, reduction=reduction)[0]
    return loss if reduction == "sum" else (loss * token_weights(loss.shape)).sum()


MODELS = {
    "full": tiny_llama,
    "tied": lambda: tiny_llama(tie=True),
    "lora": lambda: lora(tiny_llama()),
}


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch])
def test_fused_token_losses_match_plain_token_losses(model_name, make_batch):
    model, batch = MODELS[model_name](), make_batch()
    expected, expected_grads = token_losses_and_trainable_grads(model, causal_lm_loss, batch)
    assert install_fused_lm_head(model)
    head_outputs = []
    find_fused_lm_head(model).register_forward_hook(lambda m, a, out: head_outputs.append(out))
    got, grads = token_losses_and_trainable_grads(model, fused_causal_lm_loss, batch)
    labels = batch["labels"]
    assert [out.shape for out in head_outputs] == [labels.shape]  # losses, not logits
    # Not a view: FSDP2 warns that an in-place op on a module's view output skips its hooks.
    assert head_outputs[0]._base is None
    assert got.shape == labels.shape and got.dtype == torch.float32
    no_label = shifted_labels(labels) == IGNORE_INDEX
    assert (got[no_label] == 0).all() and (got[~no_label] > 0).all()
    assert relative_error(got, expected) < 1e-5
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) < 1e-5, name
    summed = fused_causal_lm_loss(model, batch)[0].detach()
    assert math.isclose(float(got.sum()), float(summed), rel_tol=1e-6)


def test_unknown_reduction_raises():
    model = tiny_llama()
    for loss_fn in (causal_lm_loss, fused_causal_lm_loss):
        with pytest.raises(ValueError, match="reduction must be one of"):
            loss_fn(model, padded_batch(), reduction="mean")


def test_token_losses_through_a_casting_wrapper_and_a_transforming_model():
    model = tiny_llama()
    batch = padded_batch()
    expected = causal_lm_loss(model, batch, reduction="token")[0].detach()
    install_fused_lm_head(model)
    model.lm_head.register_forward_hook(lambda m, a, out: out.to(torch.bfloat16))
    got = fused_causal_lm_loss(model, batch, reduction="token")[0]
    assert got.dtype == torch.float32  # the float32 values, not the wrapper's bf16 copy
    assert relative_error(got.detach(), expected) < 1e-5
    assert not torch.equal(got.detach(), got.detach().to(torch.bfloat16).float())
    scaled = ScaledLogits()
    install_fused_lm_head(scaled)
    with pytest.raises(RuntimeError, match="changed the output of its lm_head"):
        fused_causal_lm_loss(scaled, padded_batch(), reduction="token")


def encoded_samples(lengths=(5, 9, 4, 7), seed=3):
    """Samples as the encoder makes them, the first two tokens of each a masked prompt."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=generator).tolist()
        samples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 2 + ids[2:]})
    return samples


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_sequence_sums_equal_sample_by_sample_losses(fused, packed):
    """What a DPO-style loss needs: each sample's summed log-likelihood from one padded or
    packed micro-batch, equal (value and gradient) to running the samples one by one."""
    model, samples = tiny_llama(), encoded_samples()
    loss_fn = fused_causal_lm_loss if fused else causal_lm_loss
    if fused:
        install_fused_lm_head(model)
    scales = token_weights((len(samples),))  # a weight per sample, of both signs
    expected = []
    for sample in samples:  # each alone, in a batch of one
        expected.append(loss_fn(model, collate([sample], pad_token_id=0))[0])
    expected_grads = torch.autograd.grad((torch.stack(expected) * scales).sum(), model.parameters())

    rows = [samples[:2], samples[2:]]  # two samples per row, the second row padded
    batch = collate_packed(rows, pad_token_id=0) if packed else collate(samples, pad_token_id=0)
    token_losses = loss_fn(model, batch, reduction="token")[0]
    ids = sequence_ids_from_batch(batch)
    sums = sequence_sums(token_losses, ids, count_sequences(ids))
    grads = torch.autograd.grad((sums * scales).sum(), model.parameters())
    assert sums.shape == (len(samples),)
    assert relative_error(sums.detach(), torch.stack(expected).detach()) < 1e-5
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert relative_error(grad, expected_grad) < 1e-4


class RecordsBackward(torch.autograd.Function):
    """What ZeRO-3 wraps module outputs in: an identity whose backward re-gathers weights."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        RecordsBackward.calls += 1
        return grad


def test_backward_starts_from_the_output_the_wrappers_returned():
    model = tiny_llama()
    install_fused_lm_head(model)
    model.lm_head.register_forward_hook(lambda m, a, out: RecordsBackward.apply(out))
    batch = padded_batch()
    RecordsBackward.calls = 0
    loss = fused_causal_lm_loss(model, batch)[0]
    loss.backward()
    assert RecordsBackward.calls == 1
    assert model.lm_head.weight.grad is not None


def test_a_nan_loss_behind_a_wrapper_is_returned_not_mistaken_for_a_transform():
    model = tiny_llama()
    install_fused_lm_head(model)
    model.lm_head.register_forward_hook(lambda m, a, out: RecordsBackward.apply(out))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    loss = fused_causal_lm_loss(model, padded_batch())[0]
    assert torch.isnan(loss)


def test_a_wrapper_that_casts_outputs_keeps_the_float32_loss_value():
    model = tiny_llama()
    batch = padded_batch()
    expected, expected_grads = loss_and_trainable_grads(model, plain_loss, batch)
    install_fused_lm_head(model)
    model.lm_head.register_forward_hook(lambda m, a, out: out.to(torch.bfloat16))
    got, grads = loss_and_trainable_grads(model, lambda m, b: fused_causal_lm_loss(m, b)[0], batch)
    assert got.dtype == torch.float32
    assert float(got) != float(got.to(torch.bfloat16))  # bf16 could not hold this value
    assert math.isclose(float(got), float(expected), rel_tol=1e-5)
    # The gradient goes through the wrapper's bf16 output, so backward's scale (1/7) is
    # rounded to bf16, as for plain logits cast to bf16: one relative error of <= 2**-8.
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) < 2**-8, name


def test_lora_wrapped_head_is_not_fused_and_loss_falls_back():
    model = lora(tiny_llama(), target_modules=("q_proj", "lm_head"))
    assert not isinstance(model.get_output_embeddings(), nn.Linear)
    assert not install_fused_lm_head(model)
    assert find_fused_lm_head(model) is None
    batch = padded_batch()
    loss, metrics = fused_causal_lm_loss(model, batch)
    assert metrics == {}
    assert torch.equal(loss, plain_loss(model, batch))


def test_head_with_mismatched_targets_raises():
    model = tiny_llama()
    install_fused_lm_head(model)
    batch = padded_batch()
    short = dict(batch, labels=batch["labels"][:, :-1])  # one label short per row
    with pytest.raises(ValueError, match="do not match"):
        fused_causal_lm_loss(model, short)


def test_models_without_a_fusable_head_are_left_alone():
    from transformers import LlamaModel

    backbone = LlamaModel(tiny_llama().config)  # no output embeddings
    assert not install_fused_lm_head(backbone)
    capped = tiny_llama()
    capped.config.final_logit_softcapping = 30.0  # Gemma-style: logits change after the head
    assert not install_fused_lm_head(capped)
    assert "forward" not in vars(capped.lm_head)


class ScaledLogits(nn.Module):
    """A model that changes its logits after the head, without saying so in a config."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        return SimpleNamespace(logits=self.lm_head(self.embed(input_ids)) * 2)


def test_a_model_that_transforms_logits_raises_instead_of_a_wrong_loss():
    model = ScaledLogits()
    assert install_fused_lm_head(model)
    with pytest.raises(RuntimeError, match="changed the output of its lm_head"):
        fused_causal_lm_loss(model, padded_batch())


@pytest.mark.parametrize("reduction", ["sum", "token"])
def test_ddp_single_process(tmp_path, reduction):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = tiny_llama()
        reference = copy.deepcopy(model)
        install_fused_lm_head(model)
        ddp = DistributedDataParallel(model)
        batch = padded_batch()
        backward_loss(fused_causal_lm_loss, ddp, batch, reduction).backward()
        backward_loss(causal_lm_loss, reference, batch, reduction).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert relative_error(p.grad, q.grad) < 1e-5, name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduction", ["sum", "token"])
@pytest.mark.parametrize("tie, shard_head", [(True, False), (False, True)])
def test_fsdp2_single_process(tmp_path, tie, shard_head, reduction):
    """The head's weight is gathered by the root unit's hooks, or, as a unit of its own, by
    the head's own pre-forward hook (then fully_shard also swaps the head's class)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = tiny_llama(tie=tie)
        reference = copy.deepcopy(model)
        assert install_fused_lm_head(model)
        for layer in model.model.layers:
            fully_shard(layer)
        if shard_head:
            fully_shard(model.lm_head)
            assert type(model.lm_head) is not nn.Linear
        fully_shard(model)
        batch = padded_batch()
        for _ in range(2):  # the second step runs on re-gathered, resharded weights
            model.zero_grad()
            reference.zero_grad()
            (backward_loss(fused_causal_lm_loss, model, batch, reduction) / 7).backward()
            (backward_loss(causal_lm_loss, reference, batch, reduction) / 7).backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert relative_error(p.grad.full_tensor(), q.grad) < 1e-5, name
        with torch.no_grad():
            assert model(input_ids=batch["input_ids"]).logits.shape == (3, SEQ, VOCAB)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_deepspeed_zero3_single_process(monkeypatch):
    """ZeRO-3 swaps module outputs for copies whose backward re-gathers the weights: the
    loss must be the one the engine returned. Three Adam steps follow the plain loss, for
    full fine-tuning and LoRA, and for weighted token losses (whose backward recomputes the
    logits from the re-gathered weight). One test for all: DeepSpeed caches process groups
    that a second init_process_group in the same process would not match."""
    pytest.importorskip("deepspeed")
    env = dict(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import deepspeed
    import torch.distributed as dist

    config = {
        "train_micro_batch_size_per_gpu": 3,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    batch = padded_batch()

    def losses(make_model, fused: bool, reduction: str) -> list[float]:
        model = make_model()
        if fused:
            assert install_fused_lm_head(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        values = []
        for _ in range(3):
            loss_fn = fused_causal_lm_loss if fused else causal_lm_loss
            loss = backward_loss(loss_fn, engine, batch, reduction)
            engine.backward(loss / 20, scale_wrt_gas=False)
            engine.step()
            values.append(float(loss.detach()))
        engine.destroy()
        return values

    try:
        cases = [(tiny_llama, "sum"), (lambda: lora(tiny_llama()), "sum"), (tiny_llama, "token")]
        for make_model, reduction in cases:
            expected = losses(make_model, False, reduction)
            got = losses(make_model, True, reduction)
            assert expected[-1] < expected[0]
            for g, e in zip(got, expected, strict=True):
                # abs_tol: a weighted sum of token losses (weights of both signs) can be ~0.
                assert math.isclose(g, e, rel_tol=1e-5, abs_tol=1e-4)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
