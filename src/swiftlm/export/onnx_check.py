"""The ONNX export's self-check: the graph read back from disk with onnxruntime
(CPUExecutionProvider), compared in float32 on the CPU with the torch model it was traced from
(`export/onnx.py` writes it).

With an empty past, on the chat-templated check prompts as one right-padded batch (a shape
other than the traced one), its logits must equal the torch model's on every real (non-pad)
token within TOLERANCE; and greedy answers from an onnxruntime loop that feeds the cache back,
one token per step, must equal `model.generate`'s. The comparisons are `export/checks.py`'s.
"""

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from swiftlm.errors import ExportCheckError
from swiftlm.export.checks import (
    CHECK_PROMPTS,
    AnswerComparison,
    Tolerance,
    chat_inputs,
    chat_texts,
    compare_logits,
    forward_logits,
    greedy_answers,
)
from swiftlm.export.onnx_graph import (
    FALLBACK_HINT,
    exporter_summary,
    position_ids_for,
    takes_position_ids,
)

# onnxruntime's kernels sum in another order than torch's and fuse ops torch runs apart, so
# float32 logits differ by rounding that grows through the layers, most at the first token
# (whose hidden states are the largest). Measured max |diff| on the check prompts: 2e-6 on
# the 2-layer test model, 1.1e-4 on SmolLM2-135M-Instruct (30 layers, |logits| up to 40),
# where torch's own eager and sdpa attention differ by 5.8e-5. The tolerance is ~4.5x the
# 135M difference, and ~80x below the smallest real fault measured on the same prompts:
# rounding the weights to float16 moves the logits by up to 4.1e-2.
TOLERANCE = Tolerance(atol=5e-4, rtol=1e-5)
# New tokens per greedy answer: enough to compare real continuations, few enough that the
# check stays seconds on 135M.
ANSWER_TOKENS = 16


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


def check_inputs(tokenizer, with_positions: bool) -> dict[str, torch.Tensor]:
    """The chat-templated check prompts as one right-padded batch."""
    inputs = dict(chat_inputs(tokenizer))
    if with_positions:
        inputs["position_ids"] = position_ids_for(inputs["attention_mask"])
    return inputs


def check_export(model, tokenizer, onnx_path: Path) -> dict:
    """Compare the ONNX file, read back with onnxruntime, against the torch model; raise
    ExportCheckError on any difference beyond rounding."""
    started = time.perf_counter()
    inputs = check_inputs(tokenizer, takes_position_ids(model))
    reference = forward_logits(model, inputs)
    expected = greedy_answers(model, tokenizer, max_new_tokens=ANSWER_TOKENS)
    try:
        onnx_model = OnnxCausalLM(onnx_path)
        got = forward_logits(onnx_model, inputs)
        answers = onnx_greedy_answers(onnx_model, tokenizer, stop_token_ids(model))
    except onnxruntime_errors() as exc:
        raise ExportCheckError(
            f"{onnx_path}: onnxruntime could not load or run the exported graph on the check prompts "
            f"({exporter_summary(exc)}). {FALLBACK_HINT}"
        ) from exc
    logits = compare_logits(got, reference, inputs["attention_mask"], TOLERANCE)
    compared = AnswerComparison(answers, expected)
    check_seconds = time.perf_counter() - started
    batch, length = inputs["input_ids"].shape
    print(
        f"checked with onnxruntime on {batch} chat prompts: float32 logits (batch {batch} x "
        f"{length} tokens, right-padded, empty cache) vs torch max |diff| "
        f"{logits.max_abs_diff:.2e} (tolerance {TOLERANCE}), greedy answers ({ANSWER_TOKENS} "
        f"tokens, cache fed back) match {compared.matching}/{len(expected)}; session loaded in "
        f"{onnx_model.load_seconds:.1f} s, check took {check_seconds:.1f} s",
        flush=True,
    )
    logits.require(
        f"{onnx_path} run by onnxruntime", "the torch model's", "the ONNX file", FALLBACK_HINT
    )
    compared.require(f"{onnx_path} run by onnxruntime", "the ONNX file", FALLBACK_HINT)
    return {
        "max_abs_diff": logits.max_abs_diff,
        "answers_match": True,
        "load_seconds": round(onnx_model.load_seconds, 2),
        "check_seconds": round(check_seconds, 2),
    }
