"""Adapters merged into the base weights, saved as a plain Hugging Face folder that vLLM,
transformers or llama.cpp's converter load without peft (`swiftlm export --merge_lora`, and
the first step of every other export of a LoRA run).

The export checks itself before it returns: on a few fixed prompts, the logits of the merged
model, and of the folder read back from disk, must equal those of base + adapter (run
unmerged) elementwise within TOLERANCE (torch.allclose's rule, `checks.compare_logits`).
Everything runs in float32 on the CPU, so the check measures the merge and the files, not
bf16 rounding.
"""

from pathlib import Path

import torch

from swiftlm.engine.build import InferenceModel
from swiftlm.export.checks import (
    CHECK_PROMPTS,
    Tolerance,
    chat_inputs,
    compare_logits,
    forward_logits,
)
from swiftlm.models.loader import load_model, load_tokenizer

# float32: x @ (W + s B A) and x @ W + s (x A) B round differently, and the difference grows
# through the layers with the size of the logits (SmolLM2-135M after LoRA: 1.08e-4 measured).
TOLERANCE = Tolerance(atol=1e-4, rtol=1e-5)
# Three prompts: the check compares whole logit tensors, a few prompts cover it.
MERGE_PROMPTS = 3


def _unmerged(base, adapters: tuple[str, ...]):
    """Base + adapters as separate LoRA layers: every adapter but the last merged in, the
    last one kept apart, so the reference really runs the adapter path."""
    from peft import PeftModel

    from swiftlm.engine.build import apply_adapters

    base = apply_adapters(base, adapters[:-1])
    return PeftModel.from_pretrained(base, adapters[-1])


def merge_lora(spec: InferenceModel, out: Path, max_shard_size: str) -> dict:
    """Merge `spec`'s adapters into its base, save to `out`, and check both against the
    unmerged model; raise ExportCheckError if they differ."""
    print(f"Loading {spec.description}", flush=True)
    tokenizer = load_tokenizer(spec.tokenizer_path)
    inputs = chat_inputs(tokenizer, CHECK_PROMPTS[:MERGE_PROMPTS])
    mask = inputs["attention_mask"]
    model = _unmerged(load_model(spec.base_path, torch.float32, torch.device("cpu")), spec.adapters)
    reference = forward_logits(model, inputs)
    merged = model.merge_and_unload()
    in_memory = compare_logits(forward_logits(merged, inputs), reference, mask, TOLERANCE)
    merged.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    reloaded = load_model(str(out), torch.float32, torch.device("cpu"))
    saved = compare_logits(forward_logits(reloaded, inputs), reference, mask, TOLERANCE)
    report = {
        "output": str(out),
        "shards": len(list(out.glob("*.safetensors"))),
        "merged_max_abs_diff": in_memory.max_abs_diff,
        "saved_max_abs_diff": saved.max_abs_diff,
    }
    print(
        f"checked on {MERGE_PROMPTS} prompts (float32 logits vs base + adapter, "
        f"tolerance {TOLERANCE}): merged max |diff| {in_memory.max_abs_diff:.2e}, "
        f"saved folder read back {saved.max_abs_diff:.2e}"
    )
    in_memory.require("the merged model", "base + adapter", str(out))
    saved.require(f"{out} read back", "base + adapter", str(out))
    print(f"merged model saved to {out} ({report['shards']} safetensors file(s))")
    return report
