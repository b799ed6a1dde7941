"""What every export checks its output with, defined once for all formats.

Each exporter reads what it wrote back from disk, compares it with the model it was made from
on the same inputs, prints what it compared, and raises `swiftlm.errors.ExportCheckError` when
the copy is not faithful:

- logits on the chat-templated check prompts: `compare_logits` (max |diff| over real tokens,
  judged by torch.allclose's rule where a format promises equality);
- greedy answers to the same prompts: `compare_answers`;
- perplexity on a held-out text: `perplexity`, judged by `PerplexityComparison`;
- a quantized Hugging Face folder, read back by transformers from the folder alone:
  `check_folder_read_back` (answers and perplexity).
"""

import gc
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from swiftlm.errors import ExportCheckError
from swiftlm.models.loader import load_model

if TYPE_CHECKING:
    from swiftlm.export.source import ExportSource

CHECK_PROMPTS = [
    "Who are you?",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying healthy.",
    "What is 12 times 7?",
]

# How far a quantized folder's held-out perplexity may rise above the float32 source's, by
# bits (quantize.py: bnb, torchao; calibrated.py: GPTQ, AWQ). Measured on
# SmolLM2-135M-Instruct (source 17.93): 8 bits +0.5% (int8) to +1.5% (GPTQ); 4 bits +47%
# (bnb NF4) to +67% (torchao int4, group 64). A 135M model loses far more at 4 bits than 7B+
# ones (a few %), and this one is de-quantized from a Q4_1 GGUF, so 4 bits round it twice.
# A broken folder is far outside either margin: bnb 4-bit scales saved in the CPU-kernel
# layout read back at perplexity 3.7 million.
MAX_PPL_INCREASE = {8: 0.10, 4: 1.50}


# ---- inputs ---------------------------------------------------------------------------------


def heldout_text() -> str:
    """A few public-domain paragraphs no built-in dataset contains (perplexity checks)."""
    return resources.files("swiftlm").joinpath("assets/heldout.txt").read_text(encoding="utf-8")


def chat_texts(tokenizer, prompts: list[str]) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def chat_inputs(tokenizer, prompts: list[str] = CHECK_PROMPTS) -> dict:
    """The prompts in the chat template, right-padded into one batch."""
    tokenizer.padding_side = "right"
    texts = chat_texts(tokenizer, prompts)
    return tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")


# ---- logits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """torch.allclose's rule: |got - reference| <= atol + rtol * |reference|, elementwise."""

    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"{self.atol} + {self.rtol} x |logit|"


@dataclass(frozen=True)
class LogitComparison:
    max_abs_diff: float
    tolerance: Tolerance | None  # None: the difference is reported, not judged
    within: bool  # every real token's logits within the tolerance (True without one)

    def require(self, subject: str, reference: str, artifact: str, hint: str = "") -> None:
        """Raise ExportCheckError unless every logit was within the tolerance."""
        if self.within:
            return
        message = (
            f"{subject}: logits differ from {reference} by up to {self.max_abs_diff:.2e}, "
            f"beyond {self.tolerance}; {artifact} is not faithful"
        )
        raise ExportCheckError(f"{message}. {hint}" if hint else message)


@torch.no_grad()
def forward_logits(model, inputs: dict) -> torch.Tensor:
    """float32 logits of one forward pass over `inputs`, without a cache."""
    return model(**inputs, use_cache=False).logits.float()


def compare_logits(
    got: torch.Tensor,
    reference: torch.Tensor,
    mask: torch.Tensor,
    tolerance: Tolerance | None = None,
) -> LogitComparison:
    """`got` against `reference` over real (mask 1) tokens only: max |diff|, and whether every
    logit is within `tolerance` (a NaN never is)."""
    keep = mask.bool()
    got, reference = got[keep], reference[keep]
    diff = (got - reference).abs()
    within = tolerance is None or bool(
        (diff <= tolerance.atol + tolerance.rtol * reference.abs()).all()
    )
    return LogitComparison(float(diff.max()), tolerance, within)


# ---- greedy answers -------------------------------------------------------------------------


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str] = CHECK_PROMPTS, max_new_tokens=32):
    """Greedy answers, one prompt at a time (no padding, so nothing but the model varies)."""
    answers = []
    for text in chat_texts(tokenizer, prompts):
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ids = ids.to(model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


@dataclass(frozen=True)
class AnswerComparison:
    """Greedy answers of the export (`got`) and of the source (`expected`) to CHECK_PROMPTS."""

    got: list[str]
    expected: list[str]

    @property
    def differing(self) -> list[int]:
        pairs = zip(self.got, self.expected, strict=True)
        return [i for i, (got, expected) in enumerate(pairs) if got != expected]

    @property
    def matching(self) -> int:
        return len(self.got) - len(self.differing)

    def require(self, subject: str, artifact: str, hint: str = "") -> None:
        """Raise ExportCheckError, naming the first prompt answered differently, unless all
        answers are equal."""
        if not self.differing:
            return
        first = self.differing[0]
        message = (
            f"{subject} answers check prompt {first + 1} ({CHECK_PROMPTS[first]!r}) differently "
            f"from the source: {self.got[first]!r} vs {self.expected[first]!r} "
            f"({len(self.differing)} of {len(self.got)} answers differ); {artifact} is not "
            "faithful"
        )
        raise ExportCheckError(f"{message}. {hint}" if hint else message)


def compare_answers(model, source_model, tokenizer, max_new_tokens: int = 32) -> AnswerComparison:
    """Greedy answers of `model` and of `source_model` to the check prompts."""
    return AnswerComparison(
        greedy_answers(model, tokenizer, max_new_tokens=max_new_tokens),
        greedy_answers(source_model, tokenizer, max_new_tokens=max_new_tokens),
    )


# ---- perplexity -----------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model, tokenizer, text: str | None = None, window: int = 512) -> float:
    """exp(mean next-token NLL) of `text` (default: the held-out text), in windows."""
    ids = tokenizer(text or heldout_text(), add_special_tokens=False, return_tensors="pt")
    ids = ids["input_ids"][0].to(model.device)
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1].unsqueeze(0)
        logits = model(chunk[:, :-1], use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += float(nll)
        total_tokens += chunk.shape[1] - 1
    return math.exp(total_nll / total_tokens)


def source_perplexity(source: "ExportSource", tokenizer) -> float:
    """Held-out perplexity of the source, loaded in float32 on the CPU and freed afterwards."""
    print(f"Measuring the perplexity of {source.description} (float32, CPU)", flush=True)
    model = load_model(source.model_path, torch.float32, torch.device("cpu")).eval()
    try:
        return perplexity(model, tokenizer)
    finally:
        del model
        gc.collect()


@dataclass(frozen=True)
class PerplexityComparison:
    """Held-out perplexity of an export against its source's, and the relative margin allowed."""

    source: float
    exported: float
    margin: float
    allowed_for: str  # what the margin is for, e.g. "for q8_0", "at 4 bits"
    either_way: bool = False  # a faithful copy: a fall beyond the margin fails too

    @property
    def change(self) -> float:
        return self.exported / self.source - 1

    @property
    def within(self) -> bool:
        # `<=`, never `not >`: a NaN perplexity is outside every margin
        if self.either_way:
            return abs(self.change) <= self.margin
        return self.exported <= self.source * (1 + self.margin)

    def _bound(self) -> str:
        return f"{'±' if self.either_way else '+'}{self.margin * 100:g}%"

    def describe(self) -> str:
        return (
            f"held-out perplexity {self.source:.3f} -> {self.exported:.3f} "
            f"({self.change:+.2%}, limit {self._bound()} {self.allowed_for})"
        )

    def require(self, artifact: str, fix: str) -> None:
        """Raise ExportCheckError, saying what to try (`fix`), unless within the margin."""
        if not self.within:
            raise ExportCheckError(
                f"{artifact}: held-out perplexity {self.source:.3f} -> {self.exported:.3f} "
                f"({self.change:+.2%}), beyond the {self._bound()} allowed {self.allowed_for}; "
                f"{fix}"
            )


# ---- a quantized folder read back -----------------------------------------------------------


def check_folder_read_back(out: Path, device, ppl_source: float, bits: int, fix: str) -> dict:
    """Read the quantized folder `out` back with transformers from the folder alone (its
    config.json says how), require a non-empty greedy answer to every check prompt and a
    held-out perplexity at most MAX_PPL_INCREASE[bits] above the source's (`fix`: what to try
    when it is not); return the perplexity, the load time and the answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, device_map={"": device}).eval()
    load_seconds = time.perf_counter() - started
    try:
        answers = greedy_answers(model, tokenizer)
        ppl = perplexity(model, tokenizer)
        dtype = str(model.dtype).removeprefix("torch.")
    finally:
        del model
        gc.collect()
    compared = PerplexityComparison(ppl_source, ppl, MAX_PPL_INCREASE[bits], f"at {bits} bits")
    answered = sum(bool(a.strip()) for a in answers)
    print(
        f"checked {out} read back by transformers alone ({dtype}, {device}, loaded in "
        f"{load_seconds:.1f} s): {answered}/{len(answers)} check prompts answered; against "
        f"the float32 source, {compared.describe()}"
    )
    print(f"  {CHECK_PROMPTS[1]!r} -> {answers[1].strip()[:80]!r}")
    empty = [p for p, a in zip(CHECK_PROMPTS, answers, strict=True) if not a.strip()]
    if empty:
        raise ExportCheckError(
            f"the quantized model in {out} gave an empty greedy answer to {empty!r}; "
            "it is not usable"
        )
    compared.require(f"the quantized model in {out}", fix)
    return {"ppl_quantized": ppl, "load_seconds": load_seconds, "answers": answers}


# ---- sizes ----------------------------------------------------------------------------------


def folder_bytes(folder: Path) -> int:
    """Size on disk of everything in `folder` (weights, tokenizer, config)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def quantized_input_widths(model_path: str) -> set[int]:
    """in_features of the Linear layers weight quantization touches (all but the output
    head), read from an empty (meta) model, before any weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    return {
        m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
    }
