"""Fused LM head + cross-entropy wired into models (install_fused_lm_head and
fused_causal_lm_loss): equal to the plain loss on a tiny Llama (full, tied, LoRA, gradient
checkpointing), the generation path unchanged, found through wrappers (hooks, casts, ZeRO-3
style outputs), fallbacks where the head cannot be fused, and DDP, FSDP2 and DeepSpeed
ZeRO-3 in a single process."""

import copy
import math

import pytest
import torch
from fused_ce_helpers import (
    SEQ,
    VOCAB,
    ScaledLogits,
    assert_grads_close,
    backward_loss,
    lora,
    loss_and_trainable_grads,
    packed_batch,
    padded_batch,
    plain_loss,
    relative_error,
    tiny_llama,
)
from torch import nn

from swiftlm.losses.causal_lm import causal_lm_loss
from swiftlm.losses.fused_ce import (
    find_fused_lm_head,
    fused_causal_lm_loss,
    install_fused_lm_head,
    uninstall_fused_lm_head,
)
from tolerance import assert_close, backward_terms, forward_terms


def assert_fused_equals_plain(model, batch):
    expected, expected_grads = loss_and_trainable_grads(model, plain_loss, batch)
    assert install_fused_lm_head(model)
    head_outputs = []
    find_fused_lm_head(model).register_forward_hook(lambda m, a, out: head_outputs.append(out))
    got, grads = loss_and_trainable_grads(model, lambda m, b: fused_causal_lm_loss(m, b)[0], batch)
    assert [out.ndim for out in head_outputs] == [0]  # the head returned the loss, not logits
    assert got.ndim == 0 and got.dtype == torch.float32
    tokens = batch["labels"].numel()  # the batch's positions: 3 x 12 padded, 1 x 12 packed
    assert_close(got, expected, terms=forward_terms(tokens), what="loss")
    assert_grads_close(grads, expected_grads, backward_terms(tokens))
    return grads


@pytest.mark.numerics
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch])
def test_full_fine_tuning_matches_plain_loss(tie, make_batch):
    model = tiny_llama(tie=tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    grads = assert_fused_equals_plain(model, make_batch())
    assert "lm_head.weight" in grads or tie  # the head is trained (tied: via embed_tokens)


@pytest.mark.numerics
def test_lora_with_frozen_head_matches_plain_loss():
    model = lora(tiny_llama())
    grads = assert_fused_equals_plain(model, padded_batch())
    assert grads and all("lora_" in name for name in grads)
    assert model.get_output_embeddings().weight.grad is None


@pytest.mark.numerics
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


@pytest.mark.numerics
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
    terms = forward_terms(batch["labels"].numel())
    assert_close(loss, plain_loss(model, batch), terms=terms, what="loss")
    assert uninstall_fused_lm_head(wrapped)
    assert find_fused_lm_head(wrapped) is None and "forward" not in vars(head)


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


@pytest.mark.numerics
def test_a_wrapper_that_casts_outputs_keeps_the_float32_loss_value():
    model = tiny_llama()
    batch = padded_batch()
    expected, expected_grads = loss_and_trainable_grads(model, plain_loss, batch)
    install_fused_lm_head(model)
    model.lm_head.register_forward_hook(lambda m, a, out: out.to(torch.bfloat16))
    got, grads = loss_and_trainable_grads(model, lambda m, b: fused_causal_lm_loss(m, b)[0], batch)
    assert got.dtype == torch.float32
    assert float(got) != float(got.to(torch.bfloat16))  # bf16 could not hold this value
    assert_close(got, expected, terms=forward_terms(batch["labels"].numel()), what="loss")
    # The gradient goes through the wrapper's bf16 output, so backward's scale (1/7) is
    # rounded to bf16, as for plain logits cast to bf16: one relative error of <= 2**-8 (a
    # precision bound, the unit roundoff of bf16 2**-9 with a factor 2 for the float32 rest).
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


def test_a_model_that_transforms_logits_raises_instead_of_a_wrong_loss():
    model = ScaledLogits()
    assert install_fused_lm_head(model)
    with pytest.raises(RuntimeError, match="changed the output of its lm_head"):
        fused_causal_lm_loss(model, padded_batch())


@pytest.mark.numerics
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
        names = [name for name, _ in model.named_parameters()]
        grads = {name: p.grad for name, p in zip(names, model.parameters(), strict=True)}
        expected = {name: q.grad for name, q in zip(names, reference.parameters(), strict=True)}
        assert_grads_close(grads, expected, backward_terms(batch["labels"].numel()))
    finally:
        dist.destroy_process_group()


@pytest.mark.numerics
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
            pairs = zip(model.named_parameters(), reference.parameters(), strict=True)
            grads, expected = {}, {}
            for (name, p), q in pairs:
                grads[name], expected[name] = p.grad.full_tensor(), q.grad
            assert_grads_close(grads, expected, backward_terms(batch["labels"].numel()))
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
