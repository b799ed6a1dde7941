"""`swiftlm export --to_onnx`: a causal LM as an ONNX graph for onnxruntime, checked on the way out.

The output folder is self-contained and laid out like Hugging Face Optimum's:

- `model.onnx` (the graph) and `model.onnx.data` (the float32 weights, always as external
  data: one layout for every model size, and no cliff at protobuf's 2 GB limit, which a
  ~500M-parameter model reaches in float32);
- `config.json`, `generation_config.json` and the tokenizer files with their chat template.

The graph's inputs and outputs are named as in Optimum's exports, KV cache included:

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

The export checks itself before it returns, in float32 on the CPU: the graph is read back from
disk with onnxruntime (CPUExecutionProvider). With an empty past, on the chat-templated check
prompts as one right-padded batch (a shape other than the traced one), its logits must equal
the torch model's on every real (non-pad) token to ATOL + RTOL * |logit|; and greedy answers
from an onnxruntime loop that feeds the cache back, one token per step, must equal
`model.generate`'s.
"""

import importlib
import inspect
import logging
import re
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from swiftlm.config import ExportConfig
from swiftlm.errors import ConfigError, SwiftLMError
from swiftlm.export.checks import (
    CHECK_PROMPTS,
    chat_inputs,
    chat_texts,
    greedy_answers,
    logits_within,
)
from swiftlm.export.merge import ExportCheckError
from swiftlm.export.source import ExportSource
from swiftlm.models.loader import load_model, load_tokenizer

ONNX_FILE = "model.onnx"
REQUIRED_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
INSTALL_HINT = "pip install 'swiftlm[onnx]'"
FALLBACK_HINT = (
    "Export it with --merge_lora (a Hugging Face folder, for optimum-cli or vLLM) or --to_gguf "
    "(llama.cpp) instead"
)

# onnxruntime's kernels sum in another order than torch's and fuse ops torch runs apart, so
# float32 logits differ by rounding that grows through the layers, most at the first token
# (whose hidden states are the largest). Measured max |diff| on the check prompts: 2e-6 on
# the 2-layer test model, 1.1e-4 on SmolLM2-135M-Instruct (30 layers, |logits| up to 40),
# where torch's own eager and sdpa attention differ by 5.8e-5. The tolerance is ~4.5x the
# 135M difference, and ~80x below the smallest real fault measured on the same prompts:
# rounding the weights to float16 moves the logits by up to 4.1e-2.
ATOL, RTOL = 5e-4, 1e-5
# New tokens per greedy answer: enough to compare real continuations, few enough that the
# check stays seconds on 135M.
ANSWER_TOKENS = 16
# The traced example: a cache of 6 tokens, then 4 new ones, in 2 rows. Sizes 0 and 1 would
# be specialised by torch.export, and equal sizes could be taken for one axis.
TRACE_BATCH, TRACE_PAST, TRACE_NEW = 2, 6, 4


class OnnxExportError(SwiftLMError):
    """torch's exporter could not turn the model into an ONNX graph."""


def validate(cfg: ExportConfig) -> None:
    """Fail fast, before any model loads, on what --to_onnx cannot do."""
    missing = [name for name in REQUIRED_PACKAGES if not _importable(name)]
    if missing:
        raise ConfigError(
            f"--to_onnx needs {', '.join(missing)}, which could not be imported; install the "
            f"onnx extra with `{INSTALL_HINT}`"
        )
    if "dynamo" not in inspect.signature(torch.onnx.export).parameters:
        raise ConfigError(
            f"--to_onnx needs torch's dynamo exporter, which torch {torch.__version__} lacks; "
            "upgrade torch (2.6 or newer)"
        )
    if cfg.model.torch_dtype not in ("auto", "float32"):
        raise ConfigError(
            f"--torch_dtype {cfg.model.torch_dtype}: --to_onnx writes and checks float32 "
            "weights; drop --torch_dtype (or pass float32)"
        )


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def export(source: ExportSource, out: Path, cfg: ExportConfig) -> dict:
    """Export `source` to `out/model.onnx`, copy its config and tokenizer next to it, check the
    file with onnxruntime against the torch model, and return a report."""
    print(f"Loading {source.description} (float32, CPU)", flush=True)
    tokenizer = load_tokenizer(source.tokenizer_path)
    model = load_model(source.model_path, torch.float32, torch.device("cpu"), cfg.model.attn_impl)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = out / ONNX_FILE
    started = time.perf_counter()
    export_graph(model, onnx_path, source.description)
    export_seconds = time.perf_counter() - started
    _write_companions(model, tokenizer, out)
    size = onnx_bytes(onnx_path)
    print(
        f"ONNX model written to {onnx_path} ({len(onnx_files(onnx_path))} files, "
        f"{size / 1e6:.1f} MB, KV cache in/out) in {export_seconds:.1f} s",
        flush=True,
    )
    report = check_export(model, tokenizer, onnx_path)
    report.update(output=str(onnx_path), bytes=size, export_seconds=round(export_seconds, 2))
    return report


# --- the graph's signature ----------------------------------------------------------------


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


# --- the export ---------------------------------------------------------------------------


def export_graph(model, onnx_path: Path, model_name: str) -> None:
    """Trace `model` with torch's dynamo exporter into `onnx_path` (+ external data)."""
    example = trace_example(model, model_name)
    layers = len(example["past_key_values"]) // 2
    try:
        with _quiet_exporter():
            torch.onnx.export(
                CausalLMWithCache(model).eval(),
                (),
                str(onnx_path),
                kwargs=example,
                dynamo=True,
                input_names=input_names(model, layers),
                output_names=output_names(layers),
                dynamic_shapes=dynamic_axes(example),
                external_data=True,
                verbose=False,
            )
    except torch.onnx.errors.OnnxExporterError as exc:  # graph capture or conversion failed
        raise OnnxExportError(
            f"could not export {model_name} to ONNX: torch {torch.__version__}'s exporter "
            f"failed ({exporter_summary(exc)}): this model's code is not traceable by "
            f"torch.export. {FALLBACK_HINT}"
        ) from exc


def exporter_summary(exc: BaseException) -> str:
    """One readable line out of the exporter's multi-page error: the root cause's first line."""
    cause = exc.__cause__ or exc
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(cause))  # the exporter colours its messages
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(cause).__name__}: {first_line}" if first_line else type(cause).__name__


# The exporter logs graph dumps and warnings about optional packages (torchvision) and axis
# names while it works; the user's terminal gets swiftlm's summary lines instead, and a failure
# still carries the full text in the exception chain.
NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx")


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def _write_companions(model, tokenizer, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer (with its chat template), so the
    folder is all a runtime needs."""
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def onnx_files(onnx_path: Path) -> list[Path]:
    """The graph and its external data file(s), as the exporter named them."""
    return sorted(onnx_path.parent.glob(onnx_path.name + "*"))


def onnx_bytes(onnx_path: Path) -> int:
    return sum(path.stat().st_size for path in onnx_files(onnx_path))


# --- reading it back ----------------------------------------------------------------------


class OnnxCausalLM:
    """An onnxruntime session behind the part of a transformers model's interface the checks
    use: `model(input_ids, attention_mask=..., position_ids=..., past_key_values=...)` with
    `.logits` and `.past_key_values` (numpy arrays to pass back), and `model.device`; so
    `checks.perplexity(OnnxCausalLM(path), tokenizer)` measures the ONNX file."""

    device = torch.device("cpu")

    def __init__(self, onnx_path: Path):
        import onnxruntime

        started = time.perf_counter()
        self.session = onnxruntime.InferenceSession(
            str(onnx_path), providers=["CPUExecutionProvider"]
        )
        self.load_seconds = time.perf_counter() - started
        inputs = self.session.get_inputs()
        self.input_names = {node.name for node in inputs}
        self.past_inputs = [node for node in inputs if node.name.startswith("past_key_values.")]

    def empty_past(self, batch: int) -> list:
        """A cache of zero tokens: [batch, kv_heads, 0, head_dim] per past input."""
        import numpy as np

        shapes = [(batch, node.shape[1], 0, node.shape[3]) for node in self.past_inputs]
        return [np.zeros(shape, np.float32) for shape in shapes]

    def __call__(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, **_ignored
    ):
        batch, length = input_ids.shape
        past = past_key_values if past_key_values is not None else self.empty_past(batch)
        past_length = past[0].shape[2] if past else 0
        if attention_mask is None:
            attention_mask = torch.ones(batch, past_length + length, dtype=torch.long)
        if position_ids is None:
            position_ids = position_ids_for(attention_mask)[:, past_length:]
        feeds = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        feeds = {
            name: tensor.long().cpu().numpy()
            for name, tensor in feeds.items()
            if name in self.input_names
        }
        names = [node.name for node in self.past_inputs]
        feeds.update(zip(names, past, strict=True))
        logits, *present = self.session.run(None, feeds)
        return SimpleNamespace(logits=torch.from_numpy(logits), past_key_values=present)


def onnx_greedy_answers(
    onnx_model: OnnxCausalLM,
    tokenizer,
    stop_ids: set[int],
    prompts: list[str] = CHECK_PROMPTS,
    max_new_tokens: int = ANSWER_TOKENS,
) -> list[str]:
    """Greedy answers, one prompt at a time: the prompt first, then one token per step with
    the cache fed back; stops at any of `stop_ids` like `generate` does."""
    answers = []
    for text in chat_texts(tokenizer, prompts):
        step = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        past, new_ids = None, []
        for _ in range(max_new_tokens):
            out = onnx_model(step, past_key_values=past)
            new_ids.append(int(out.logits[0, -1].argmax()))
            if new_ids[-1] in stop_ids:
                break
            step, past = torch.tensor([new_ids[-1:]]), out.past_key_values
        answers.append(tokenizer.decode(new_ids, skip_special_tokens=True))
    return answers


def stop_token_ids(model) -> set[int]:
    """The ids `generate` stops at: the generation config's eos token(s)."""
    config = model.generation_config or model.config
    eos = config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def onnxruntime_errors() -> tuple[type[Exception], ...]:
    """The exception types onnxruntime raises when it cannot load or run a graph."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    found = vars(state).values()
    return tuple(t for t in found if isinstance(t, type) and issubclass(t, Exception))


# --- the check ----------------------------------------------------------------------------


def logits_difference(got: torch.Tensor, reference: torch.Tensor, attention_mask) -> tuple:
    """(max |diff|, whether every real token's logits are within ATOL + RTOL * |reference|)."""
    return logits_within(got, reference, attention_mask, ATOL, RTOL)


def check_inputs(tokenizer, with_positions: bool) -> dict[str, torch.Tensor]:
    """The chat-templated check prompts as one right-padded batch."""
    inputs = dict(chat_inputs(tokenizer))
    if with_positions:
        inputs["position_ids"] = position_ids_for(inputs["attention_mask"])
    return inputs


@torch.no_grad()
def check_export(model, tokenizer, onnx_path: Path) -> dict:
    """Compare the ONNX file, read back with onnxruntime, against the torch model; raise
    ExportCheckError on any difference beyond rounding."""
    started = time.perf_counter()
    inputs = check_inputs(tokenizer, takes_position_ids(model))
    reference = model(**inputs, use_cache=False).logits.float()
    expected = greedy_answers(model, tokenizer, max_new_tokens=ANSWER_TOKENS)
    try:
        onnx_model = OnnxCausalLM(onnx_path)
        got = onnx_model(**inputs).logits
        answers = onnx_greedy_answers(onnx_model, tokenizer, stop_token_ids(model))
    except onnxruntime_errors() as exc:
        raise ExportCheckError(
            f"{onnx_path}: onnxruntime could not load or run the exported graph on the check prompts "
            f"({exporter_summary(exc)}). {FALLBACK_HINT}"
        ) from exc
    max_diff, logits_ok = logits_difference(got, reference, inputs["attention_mask"])
    matching = sum(a == b for a, b in zip(answers, expected, strict=True))
    check_seconds = time.perf_counter() - started
    batch, length = inputs["input_ids"].shape
    print(
        f"checked with onnxruntime on {batch} chat prompts: float32 logits (batch {batch} x "
        f"{length} tokens, right-padded, empty cache) vs torch max |diff| {max_diff:.2e} "
        f"(tolerance {ATOL} + {RTOL} x |logit|), greedy answers ({ANSWER_TOKENS} tokens, "
        f"cache fed back) match {matching}/{len(expected)}; session loaded in "
        f"{onnx_model.load_seconds:.1f} s, check took {check_seconds:.1f} s",
        flush=True,
    )
    if not logits_ok:
        raise ExportCheckError(
            f"{onnx_path}: onnxruntime's logits differ from the torch model's by up to "
            f"{max_diff:.2e}, beyond {ATOL} + {RTOL} x |logit|; the ONNX file is not "
            f"faithful. {FALLBACK_HINT}"
        )
    if matching != len(expected):
        first = next(i for i, answer in enumerate(answers) if answer != expected[i])
        raise ExportCheckError(
            f"{onnx_path}: the greedy answer to {CHECK_PROMPTS[first]!r} differs: onnxruntime "
            f"{answers[first]!r}, torch {expected[first]!r}; the ONNX file is not faithful. "
            f"{FALLBACK_HINT}"
        )
    return {
        "max_abs_diff": max_diff,
        "answers_match": True,
        "load_seconds": round(onnx_model.load_seconds, 2),
        "check_seconds": round(check_seconds, 2),
    }
