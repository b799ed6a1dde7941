"""Adapters merged into the base weights, saved as a plain Hugging Face folder that vLLM,
transformers or llama.cpp's converter load without peft (`swiftlm export --merge_lora`, and
the first step of every other export of a LoRA run).

The export checks itself before it returns: on a few fixed prompts, the logits of the merged
model, and of the folder read back from disk, must equal those of base + adapter (run
unmerged) elementwise to ATOL + RTOL * |logit| (torch.allclose's rule). Everything runs in
float32 on the CPU, so the check measures the merge and the files, not bf16 rounding.
"""

from pathlib import Path

import torch

from swiftlm.errors import SwiftLMError
from swiftlm.export.checks import chat_inputs, logits_within
from swiftlm.infer.resolve import InferenceModel
from swiftlm.models.loader import load_model, load_tokenizer

# float32: x @ (W + s B A) and x @ W + s (x A) B round differently, and the difference grows
# through the layers with the size of the logits (SmolLM2-135M after LoRA: 1.08e-4 measured).
ATOL, RTOL = 1e-4, 1e-5
# Three prompts: the check compares whole logit tensors, a few prompts cover it.
MERGE_PROMPTS = 3


class ExportCheckError(SwiftLMError):
    """The exported model does not reproduce the model it was made from."""


@torch.no_grad()
def _logits(model, inputs) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits.float()


def _unmerged(base, adapters: tuple[str, ...]):
    """Base + adapters as separate LoRA layers: every adapter but the last merged in, the
    last one kept apart, so the reference really runs the adapter path."""
    from peft import PeftModel

    from swiftlm.infer.engine import apply_adapters

    base = apply_adapters(base, adapters[:-1])
    return PeftModel.from_pretrained(base, adapters[-1])


def _difference(got: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> tuple:
    return logits_within(got, reference, mask, ATOL, RTOL)


def merge_lora(spec: InferenceModel, out: Path, max_shard_size: str) -> dict:
    """Merge `spec`'s adapters into its base, save to `out`, and check both against the
    unmerged model; raise ExportCheckError if they differ."""
    print(f"Loading {spec.description}", flush=True)
    tokenizer = load_tokenizer(spec.tokenizer_path)
    inputs = chat_inputs(tokenizer)
    inputs = {k: v[:MERGE_PROMPTS] for k, v in inputs.items()}
    model = _unmerged(load_model(spec.base_path, torch.float32, torch.device("cpu")), spec.adapters)
    reference = _logits(model, inputs)
    merged = model.merge_and_unload()
    merged_diff, merged_ok = _difference(
        _logits(merged, inputs), reference, inputs["attention_mask"]
    )
    merged.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    reloaded = load_model(str(out), torch.float32, torch.device("cpu"))
    saved_diff, saved_ok = _difference(
        _logits(reloaded, inputs), reference, inputs["attention_mask"]
    )
    report = {
        "output": str(out),
        "shards": len(list(out.glob("*.safetensors"))),
        "merged_max_abs_diff": merged_diff,
        "saved_max_abs_diff": saved_diff,
    }
    print(
        f"checked on {MERGE_PROMPTS} prompts (float32 logits vs base + adapter, "
        f"tolerance {ATOL} + {RTOL} x |logit|): merged max |diff| {merged_diff:.2e}, "
        f"saved folder read back {saved_diff:.2e}"
    )
    if not (merged_ok and saved_ok):
        raise ExportCheckError(
            f"the merged model's logits differ from base + adapter by up to "
            f"{max(merged_diff, saved_diff):.2e}, beyond {ATOL} + {RTOL} x |logit|; "
            f"{out} is not faithful"
        )
    print(f"merged model saved to {out} ({report['shards']} safetensors file(s))")
    return report
