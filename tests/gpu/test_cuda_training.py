"""GPU paths: run with `pytest -m gpu` on a machine with CUDA."""

import pytest
import torch

from conftest import logged, tiny_sft
from swiftlm.cli.main import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lora_trains_on_cuda_with_autocast(tiny_model_dir, chat_jsonl, tmp_path, dtype):
    out = tmp_path / dtype
    run = dict(device="cuda", torch_dtype=dtype, num_train_epochs=10, learning_rate="5e-3")
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, out, per_device_train_batch_size=4, **run)) == 0
    )
    losses = logged(out)
    assert losses[-1] < 0.6 * losses[0]


def test_liger_kernels_equal_the_plain_path(tiny_model_dir, monkeypatch):
    """--use_liger_kernel's model (Liger's RMSNorm, RoPE, SwiGLU) and fused head (Liger's
    linear cross-entropy) against swiftlm's plain fused loss on the same batch, float32."""
    pytest.importorskip("liger_kernel")
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from swiftlm.losses.fused_ce import fused_causal_lm_loss, install_fused_lm_head
    from swiftlm.models.liger import apply_liger_kernels

    # Liger replaces these module-level names; put them back for the tests after this one.
    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    cuda = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 48), generator=generator).to(cuda)
    labels = ids.clone()
    labels[:, :10] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def loss_and_grads(liger: bool):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(cuda)
        if liger:
            apply_liger_kernels(model, cuda)
        assert install_fused_lm_head(model, liger=liger)
        loss, _ = fused_causal_lm_loss(model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    plain_loss, plain_grads = loss_and_grads(liger=False)
    liger_loss, liger_grads = loss_and_grads(liger=True)
    # float32 (eps 1.2e-7): the kernels reorder the sums of 64-wide rows and of 76 label
    # tokens' losses; 1e-5 relative is ~100x that rounding, far below any wrong kernel.
    torch.testing.assert_close(liger_loss, plain_loss, rtol=1e-5, atol=0)
    for name, grad in plain_grads.items():
        scale = grad.abs().max().clamp_min(1e-12)
        assert (liger_grads[name] - grad).abs().max() / scale < 1e-4, name


def test_sft_trains_with_liger_kernels(tiny_model_dir, chat_jsonl, tmp_path, monkeypatch):
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    out = tmp_path / "liger"
    run = dict(device="cuda", torch_dtype="bfloat16", num_train_epochs=10, learning_rate="5e-3")
    argv = tiny_sft(tiny_model_dir, chat_jsonl, out, use_liger_kernel="true", **run)
    assert main(argv) == 0
    losses = logged(out)
    assert losses[-1] < 0.6 * losses[0]
