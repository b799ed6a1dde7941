"""Perplexity tasks: the model's negative log-likelihood of each text (column `text`).

Each sample scores `nll_per_token`; the task's `perplexity` is a ratio over the whole task (exp
of the summed NLL over the summed tokens), so its interval comes from resampling samples and
recomputing the ratio, not from averaging per-sample perplexities (which would weigh a short
text as much as a long one). The log-likelihoods need the model's own forward pass
(`loglik.text_nll`), which only the local backend has.
"""

import math

import numpy as np

from swiftlm.data.formats import RowError
from swiftlm.evaluation.backends import Backend
from swiftlm.evaluation.tasks import EvalSettings, Sample, Task, sample_record


def read_row(record: dict, placeholders: dict[str, str]) -> dict:
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        raise RowError("empty text", "'text' must be a non-empty string")
    return {"sample": Sample("", text)}


def run(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    scored = backend.text_nll([s.prompt for s in task.samples])
    records = []
    for sample, result in zip(task.samples, scored, strict=True):
        per_token = result.nll / max(result.tokens, 1)
        records.append(
            sample_record(
                task,
                sample,
                None,
                {"nll_per_token": per_token},
                nll=result.nll,
                tokens=result.tokens,
            )
        )
    return records


def perplexity_interval(records: list[dict], confidence: float, resamples: int, seed: int) -> dict:
    nll = np.array([r["nll"] for r in records], dtype=float)
    tokens = np.array([r["tokens"] for r in records], dtype=float)
    value = math.exp(nll.sum() / max(tokens.sum(), 1.0))
    if len(records) < 2:
        return {
            "mean": value,
            "low": value,
            "high": value,
            "confidence": confidence,
            "n": len(records),
        }
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(records), size=(resamples, len(records)))
    ratios = np.exp(nll[picks].sum(axis=1) / np.maximum(tokens[picks].sum(axis=1), 1.0))
    tail = (1 - confidence) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return {
        "mean": value,
        "low": float(low),
        "high": float(high),
        "confidence": confidence,
        "n": len(records),
    }
