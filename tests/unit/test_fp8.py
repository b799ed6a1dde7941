"""FP8 training (`--fp8_recipe`): which layers torchao converts, and how far float8's rounding
moves the first loss and its gradients from the high-precision model's (emulated on CPU)."""

import pytest
import torch

from conftest import make_tiny_llama
from swiftlm.errors import ConfigError
from swiftlm.models.fp8 import apply_fp8_training

VOCAB = 96
CPU = torch.device("cpu")
# float8 e4m3 keeps 3 mantissa bits: unit roundoff 2^-4 on every cast of an input or weight.
E4M3_ROUNDOFF = 2.0**-4


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_converts_the_decoder_linears_and_stays_within_float8_rounding(recipe):
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = make_tiny_llama(VOCAB)
    model = make_tiny_llama(VOCAB)
    message = apply_fp8_training(model, recipe, CPU)
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    # 7 projections per layer x 2 layers; the LM head (96 x 64) stays.
    assert len(converted) == 14 and not any("lm_head" in n for n in converted)
    assert f"fp8 training ({recipe} scaling, emulated on cpu" in message
    assert "14 of 15 linear layers" in message
    loss_hp, grads_hp = _loss_and_grads(reference, ids)
    loss_fp8, grads_fp8 = _loss_and_grads(model, ids)
    # Every product's inputs are rounded to e4m3, each by at most one roundoff; the errors of a
    # product's K terms have random signs and average out, and the loss is a mean over tokens:
    # it moves by less than one roundoff of itself (measured: 0.1-0.3%). The casts must have run.
    assert 0 < abs(loss_fp8 - loss_hp).item() < E4M3_ROUNDOFF * loss_hp.item()
    # Gradients go through e5m2 casts (2 mantissa bits, roundoff 2^-3) and e4m3 ones: their
    # direction holds within one e5m2 roundoff (measured: cosine >= 0.977); a wrong scale
    # destroys it.
    for name, grad in grads_hp.items():
        cosine = torch.nn.functional.cosine_similarity(
            grads_fp8[name].flatten(), grad.flatten(), dim=0
        )
        assert cosine > 1 - 2.0**-3, f"{name}: cosine {cosine:.4f}"


def test_a_model_without_eligible_layers_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(10, 6))
    with pytest.raises(ConfigError, match="no linear layer of this model can run in float8"):
        apply_fp8_training(model, "tensorwise", CPU)
