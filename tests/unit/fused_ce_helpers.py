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
