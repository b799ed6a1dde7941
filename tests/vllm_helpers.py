"""What the `--infer_backend vllm` tests share: the skip reason where vLLM is absent, and a
tiny model vLLM's CPU build can run (its attention has kernels for heads of 32, 64 ... only,
so the conftest model's heads of 16 will not do) with a LoRA adapter that moves its answers."""

from pathlib import Path

import torch

from conftest import build_tokenizer, make_tiny_llama

VLLM_MISSING = (
    "vLLM is not installed here: `bash scripts/setup_vllm.sh` builds .venv-vllm, then "
    "`.venv-vllm/bin/python -m pytest -m vllm`"
)
# vLLM's CPU build takes its KV cache size from here (GiB); its default, 4, is more than a
# tiny model needs on a shared CI machine.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def build_vllm_model(folder: Path, adapter: Path):
    """A seeded 2-layer Llama with heads of 64 in `folder`, a LoRA adapter of it in `adapter`
    (B drawn large, not peft's zeros, so the adapter changes greedy answers); the tokenizer."""
    from peft import LoraConfig, get_peft_model

    tokenizer = build_tokenizer(folder)
    model = make_tiny_llama(len(tokenizer), hidden_size=256)
    model.save_pretrained(folder)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    for name, weight in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(weight, std=0.5, generator=generator)
    peft_model.save_pretrained(adapter)
    return tokenizer
