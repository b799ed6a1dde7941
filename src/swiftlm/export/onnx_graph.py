"""The ONNX graph's signature, and the model wrapper torch.export traces into it
(`export/onnx.py` exports, `export/onnx_check.py` runs it back).

The graph's inputs and outputs are named as in Hugging Face Optimum's exports, KV cache
included:

- inputs `input_ids`, `position_ids` (`[batch, sequence]`), `attention_mask`
  (`[batch, total_sequence]`: past_sequence + sequence, all int64), and per layer i
  `past_key_values.{i}.key` / `.value` (float32, `[batch, kv_heads, past_sequence, head_dim]`);
- outputs `logits` (`[batch, sequence, vocab]`) and `present.{i}.key` / `.value`, the cache
  with this step's tokens appended, to feed back as the next step's past.

Every axis named above is dynamic. The first step (or a plain forward pass, e.g. for
perplexity) passes an empty past: past_sequence 0 (`OnnxCausalLM.empty_past`).
`position_ids` is an input, as in Optimum, so the caller sets the positions; transformers'
generate uses `attention_mask.cumsum(-1) - 1`, clamped at 0 (`position_ids_for`), which skips
left padding. Models whose forward takes no position_ids (ALiBi ones such as BLOOM) get a
graph without it.
"""

import inspect
import re

import torch

from swiftlm.errors import SwiftLMError

FALLBACK_HINT = (
    "Export it with --merge_lora (a Hugging Face folder, for optimum-cli or vLLM) or --to_gguf "
    "(llama.cpp) instead"
)

# The traced example: a cache of 6 tokens, then 4 new ones, in 2 rows. Sizes 0 and 1 would
# be specialised by torch.export, and equal sizes could be taken for one axis.
TRACE_BATCH, TRACE_PAST, TRACE_NEW = 2, 6, 4


class OnnxExportError(SwiftLMError):
    """torch's exporter could not turn the model into an ONNX graph."""


class CausalLMWithCache(torch.nn.Module):
    """The model behind the graph's signature: tensors in, tensors out, the cache as a flat
    list (key, value per layer) rather than transformers' Cache object."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.cache_keyword = cache_keyword(model)

    def forward(self, input_ids, attention_mask, position_ids=None, past_key_values=()):
        from transformers import DynamicCache

        pairs = list(zip(past_key_values[0::2], past_key_values[1::2], strict=True))
        cache = DynamicCache(ddp_cache_data=pairs, config=self.model.config)
        extra = {self.cache_keyword: cache}
        # position_ids is left out (not passed as None) for models whose forward lacks it.
        if position_ids is not None:
            extra["position_ids"] = position_ids
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **extra
        )
        return out.logits, *flat_cache(getattr(out, self.cache_keyword))


def cache_keyword(model) -> str:
    """What the model calls its KV cache, as forward argument and output field: `cache` in
    transformers 5 (which still takes `past_key_values`, with a deprecation warning),
    `past_key_values` in 4.x."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def flat_cache(cache) -> list[torch.Tensor]:
    """[key 0, value 0, key 1, value 1, ...] of a transformers DynamicCache."""
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


def takes_position_ids(model) -> bool:
    """Llama, Qwen, Mistral, Gemma, GPT-2, ... do; ALiBi models such as BLOOM do not."""
    return "position_ids" in inspect.signature(model.forward).parameters


def input_names(model, layers: int) -> list[str]:
    positions = ["position_ids"] if takes_position_ids(model) else []
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", *positions, *past]


def output_names(layers: int) -> list[str]:
    present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["logits", *present]


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as transformers' generate computes them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def trace_example(model, model_name: str) -> dict:
    """Example inputs for torch.export: a real cache of TRACE_PAST tokens (so its shapes are
    the model's own), then TRACE_NEW new tokens, the last one of row 1 padding."""
    generator = torch.Generator().manual_seed(0)
    shape = (TRACE_BATCH, TRACE_PAST + TRACE_NEW)
    tokens = torch.randint(0, model.config.vocab_size, shape, generator=generator)
    out = model(input_ids=tokens[:, :TRACE_PAST], use_cache=True)
    cache = getattr(out, cache_keyword(model), None)
    if not all(hasattr(layer, "keys") for layer in getattr(cache, "layers", [None])):
        raise OnnxExportError(
            f"could not export {model_name} to ONNX: its cache is a {type(cache).__name__}, "
            f"not transformers' DynamicCache of keys and values per layer. {FALLBACK_HINT}"
        )
    attention_mask = torch.ones_like(tokens)
    attention_mask[1, -1] = 0  # a zero, so no all-ones shortcut of the mask code is traced
    example = {"input_ids": tokens[:, TRACE_PAST:], "attention_mask": attention_mask}
    if takes_position_ids(model):
        example["position_ids"] = position_ids_for(attention_mask)[:, TRACE_PAST:]
    example["past_key_values"] = flat_cache(cache)
    return example


def dynamic_axes(example: dict) -> dict:
    """torch.export's dynamic_shapes for `example`, the axes named as in the ONNX graph."""
    dim = torch.export.Dim
    batch, sequence, total = dim("batch"), dim("sequence"), dim("total_sequence")
    past = dim("past_sequence", min=0)  # 0: the first step has no cache yet
    axes = {
        "input_ids": {0: batch, 1: sequence},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: sequence},
        "past_key_values": [{0: batch, 2: past} for _ in example["past_key_values"]],
    }
    return {name: axes[name] for name in example}


def exporter_summary(exc: BaseException) -> str:
    """One readable line out of the exporter's multi-page error: the root cause's first line."""
    cause = exc.__cause__ or exc
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(cause))  # the exporter colours its messages
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(cause).__name__}: {first_line}" if first_line else type(cause).__name__
