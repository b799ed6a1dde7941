"""Shared helpers of the fused LM-head cross-entropy tests (test_fused_ce*.py): random
head problems and their plain references, a recorder of materialized tensor shapes, and a
tiny Llama with padded and packed batches."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import make_tiny_llama
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses.causal_lm import causal_lm_loss
from tolerance import assert_close

N, H, V = 50, 16, 37  # V != H so that logits and weight shapes cannot be confused

# bf16 against float32 is a precision comparison, not one of summation order: autocast rounds
# each input (hidden, weight, bias) and each logit to bf16's 8 bits (relative 2**-8 = 0.4%,
# round to nearest: the same on every machine), so a logit moves by up to 3 such roundings of
# its magnitude and a token's loss by sum_v |p_v - onehot_v| times that: at worst 6 * 2**-8 *
# max|logit|, about 3% of the largest token loss of random_problem; what random signs give is
# far less: measured 0.34% of the largest token loss (0.03% of their sum) and 0.6% of a
# gradient's largest entry. The bounds sit between the two, 3x and 5x above what is measured,
# and below what a float32 head would not show or a wrong target would (tens of percent).
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


# ---- rounding bounds (tests/tolerance.py) ---------------------------------------------------

# A head problem's longest chain: the logits' matmul (H), the log-sum-exp (V), the gradients'
# matmuls (V for a hidden row, N for the weight) and the sum over the rows (N).
HEAD_TERMS = H + 2 * V + N


def head_magnitudes(hidden, weight, bias, targets, scales=None) -> dict[str, float]:
    """What the rounding of each result of a head problem is relative to (the sum of the
    magnitudes of what is added, tests/tolerance.py), given `scales` [N], each token's
    grad_output (1 for a plain sum):

    - a logit z_v sums |h| |w_v| + |b_v|: A_v;
    - a token's loss lse - z_t rounds relative to |lse| + |z_t|, and carries its logits'
      roundings through its slope p - onehot: + sum_v |p_v - y_v| A_v ("token"; "loss" sums
      them over the rows);
    - d loss / d z_v = s (p_v - y_v) rounds relative to |s| |p_v - y_v| (1 + E), where
      E = |lse| + 2 max A (a logit's rounding moves p by that, relatively): D;
    - the gradients sum D |W| ("hidden"), D^T |H| ("weight"), D over the rows ("bias").
    Each value is the largest of its entries."""
    h, w = hidden.detach().double().reshape(-1, H), weight.detach().double()
    b = bias.detach().double() if bias is not None else torch.zeros(w.shape[0], dtype=h.dtype)
    t = targets.reshape(-1)
    kept = t != IGNORE_INDEX
    logits = h @ w.T + b
    sizes = h.abs() @ w.abs().T + b.abs()
    lse = logits.logsumexp(-1)
    slope = logits.softmax(-1)
    slope[kept, t[kept]] -= 1
    slope = slope.abs() * kept.unsqueeze(1)
    z_t = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
    token = (lse.abs() + z_t.abs() + (slope * sizes).sum(-1)) * kept
    s = torch.ones(t.shape, dtype=h.dtype) if scales is None else scales.reshape(-1).double()
    d = slope * (1 + lse.abs() + 2 * sizes.amax(-1)).unsqueeze(1) * s.abs().unsqueeze(1)
    return {
        "loss": float(token.sum()),
        "token": float(token.max()),
        "hidden": float((d @ w.abs()).max()),
        "weight": float((d.T @ h.abs()).max()),
        "bias": float(d.sum(0).max()),
    }


def assert_head_close(got, expected, magnitudes, key="loss", grads=(), expected_grads=()):
    """The loss (or token losses, key "token") and the gradients of the hidden rows, the weight
    and the bias (in that order, as many as given) of a head problem equal to the reference up
    to their rounding (HEAD_TERMS, head_magnitudes)."""
    assert_close(got, expected, terms=HEAD_TERMS, magnitude=magnitudes[key], what=key)
    names = ("hidden", "weight", "bias")
    for name, grad, want in zip(names, grads, expected_grads, strict=False):
        assert_close(grad, want, terms=HEAD_TERMS, magnitude=magnitudes[name], what=name)


def assert_grads_close(grads: dict, expected: dict, terms: int) -> None:
    """Gradients through the tiny Llama equal up to the rounding of `terms` (backward_terms):
    each entry sums terms of either sign over the tokens and the backward chain, whose size is
    that of the tensor's largest entry."""
    assert grads.keys() == expected.keys() and grads
    for name, grad in grads.items():
        want = expected[name]
        size = float(want.abs().max())
        assert_close(grad, want, terms=terms, magnitude=size, what=f"{name} gradient")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the scale (largest entry) of `expected`."""
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


def loss_and_grads(loss_fn, tensors):
    loss = loss_fn()
    return loss.detach(), torch.autograd.grad(loss, tensors)


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


def backward_loss(loss_fn, model, batch, reduction):
    """What backward starts from: the loss sum, or a weighted sum of the token losses."""
    loss = loss_fn(model, batch, reduction=reduction)[0]
    return loss if reduction == "sum" else (loss * token_weights(loss.shape)).sum()


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
