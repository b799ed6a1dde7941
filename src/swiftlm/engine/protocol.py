"""What callers and the continuous-batching engine exchange: requests in, token deltas out.

One interface for every caller: `swiftlm infer` (chat and batch), the OpenAI-compatible server
(`swiftlm deploy`), GRPO's and GKD's rollouts (`methods/rl/rollout.py`) and generation-based
evaluation. Hence `n` samples per prompt, a per-request seed, and the log-probability of every
generated token.

- `SamplingParams`: how one request samples; `check()` names the first bad value.
- `GenerationRequest`: token ids of a prompt (rendered by the caller with the chat template),
  its sampling, and optionally the name of a served adapter.
- `SampleDelta`: what one decoding step added to one of a request's `n` samples, delivered to
  the request's callback from the engine's thread; the last delta of a sample has a
  `finish_reason`.
- `SampleResult`: a whole sample, as `Engine.generate` returns it.

Failures stay with the sample they happen in: an exception while preparing, sampling or
detokenizing one sample ends that sample with finish_reason "error" (its `error` says why) and
the rest of the batch decodes on. `InvalidRequest` marks the ones the request's own values
caused (a caller's mistake); any other is the engine's, logged under the delta's `error_id`.
Only a failed forward pass, which leaves the whole batch unusable, aborts every running sample.
`Engine.generate` raises `GenerationFailed`, which still holds the samples that succeeded.
"""

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

# Why a sample ended: a stop token or string, the token budget (or the context), aborted (by
# the caller, or by the engine for the whole batch), or it failed alone ("error").
FINISH_REASONS = ("stop", "length", "abort", "error")
SEED_RANGE = (-(2**63), 2**63)  # a 64-bit integer, as OpenAI takes it; seed + i stays < 2**64


def new_error_id() -> str:
    """A short id that names one failure both in the server log and in the caller's error."""
    return uuid.uuid4().hex[:12]


class InvalidRequest(ValueError):
    """Raised inside the engine when a request's own values make one of its samples fail: the
    caller's mistake (an HTTP 400), where any other exception is the engine's (a 500)."""


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI's sampling fields plus vLLM's top_k/min_p/repetition_penalty."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    stop: tuple[str, ...] = ()  # the text stops before the first of these strings
    stop_token_ids: tuple[int, ...] = ()  # besides the model's own end-of-turn tokens
    ignore_eos: bool = False
    seed: int | None = None  # sample i of n uses seed + i: reproducible per sample (64-bit)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives reported per token (needs logprobs)
    # "raw": log-probs of the model's logits (what OpenAI and vLLM report); "scaled": of the
    # logits divided by the temperature, before penalties and truncation: the distribution a
    # trainer recomputes for RL (GRPO's importance ratio, the engine/trainer mismatch).
    logprobs_mode: str = "raw"

    def check(self, max_n: int = 16, max_top_logprobs: int = 20) -> str | None:
        """The first bad value as `field value: what it must be`, or None when all are good."""
        rules = (
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0 <= self.temperature <= 100, "must be in [0, 100]"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 (off) or more"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 100, "must be in (0, 100]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("n", 1 <= self.n <= max_n, f"must be in [1, {max_n}]"),
            (
                "top_logprobs",
                0 <= self.top_logprobs <= max_top_logprobs,
                f"must be in [0, {max_top_logprobs}]",
            ),
        )
        for name, ok, must in rules:
            if not ok:
                return f"{name} {getattr(self, name)}: {must}"
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            return f"seed {self.seed}: must be a 64-bit integer, in [-2**63, 2**63)"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs true"
        if self.logprobs_mode not in ("raw", "scaled"):
            return f"logprobs_mode {self.logprobs_mode}: must be raw or scaled"
        return None


def user_sampling(
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    repetition_penalty: float,
    seed: int | None = None,
) -> SamplingParams:
    """The sampling of `--temperature`, `--top_p` ...: greedy at temperature 0, where top-p and
    top-k would change nothing but are kept off so the request reads as greedy."""
    sampled = temperature > 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p if sampled else 1.0,
        top_k=top_k if sampled else 0,
        repetition_penalty=repetition_penalty,
        seed=seed,
    )


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # a served adapter's name; None: the base model
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # A grammar the output must follow (`Constraint`, e.g. engine.grammar's JSON schema);
    # None: unconstrained, and no cost.
    constraint: Any = None


class ConstraintMatcher(Protocol):
    """One sample's state in a grammar (see grammar.py)."""

    def mask(self, logits: Any) -> None:
        """Set forbidden tokens' logits (one row, [vocab]) to -inf, in place."""
        ...

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): the sample is done."""
        ...


class Constraint(Protocol):
    def matcher(self) -> ConstraintMatcher:
        """A fresh parse for one of the request's samples."""
        ...


def check_request(
    request: GenerationRequest,
    *,
    max_n: int,
    vocab_size: int,
    max_model_len: int,
    adapters: tuple[str, ...],
) -> None:
    """Raise ValueError naming the first problem that stops `request` from running on an
    engine with these limits: bad sampling values, an empty or out-of-vocabulary prompt, a
    prompt plus max_tokens beyond the context, an adapter the engine does not serve."""
    problem = request.params.check(max_n=max_n)
    if problem:
        raise ValueError(problem)
    prompt = request.prompt_ids
    if not prompt:
        raise ValueError("prompt: it has no tokens")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    if len(prompt) + request.params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens {request.params.max_tokens}: the prompt's {len(prompt)} tokens "
            f"plus max_tokens exceed the context length max_model_len {max_model_len}"
        )
    if request.adapter is not None and request.adapter not in adapters:
        served = ", ".join(adapters) or "none"
        raise ValueError(f"adapter {request.adapter!r}: not served (adapters: {served})")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token, its log-probability (under the raw logits, what OpenAI and vLLM
    report, or the temperature-scaled ones: `SamplingParams.logprobs_mode`), and the top
    alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampleDelta:
    request_id: str
    index: int  # which of the request's n samples
    token_ids: tuple[int, ...]  # generated by this step (may be empty on the final delta)
    text: str  # new text; text that may start a stop string is held back until resolved
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked
    finish_reason: str | None = None  # set on the sample's last delta
    # Why the sample failed ("error") or the engine aborted it ("abort"); None otherwise.
    error: str | None = None
    # Set when the failure was the engine's, not the request's: the id the server log holds
    # it under. None with finish_reason "error": the request's values (`InvalidRequest`).
    error_id: str | None = None


@dataclass
class SampleResult:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str
    error: str | None = None  # why it failed ("error") or was aborted by the engine


class GenerationFailed(RuntimeError):
    """Some requests of `Engine.generate` had a sample that failed. `results` holds every
    request's samples all the same (the failed ones with their `error`), so a caller can keep
    the answers that succeeded; `failures` maps a request's index to its first error."""

    def __init__(self, results: list[list[SampleResult]], failures: dict[int, str]):
        first = next(iter(failures))
        super().__init__(
            f"generation failed for {len(failures)} of {len(results)} requests; request "
            f"{first}: {failures[first]}"
        )
        self.results = results
        self.failures = failures


@dataclass(frozen=True)
class EngineStats:
    running: int  # sequences decoding now (a request with n samples counts n)
    waiting: int  # requests queued, not yet prefilled
    max_num_seqs: int
    max_model_len: int  # prompt + generated tokens of one sequence, at most
    prefill_tokens: int = 0  # prompt tokens run through the model so far
    prefix_hit_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache
    draft_tokens: int = 0  # speculative draft tokens checked
    accepted_draft_tokens: int = 0  # of those, the ones sampling agreed with (kept)


class Engine(Protocol):
    """A continuous-batching engine: thread-safe `submit`, a loop on its own thread."""

    def submit(self, request: GenerationRequest, on_delta: Callable[[SampleDelta], None]) -> None:
        """Queue `request`; `on_delta` is called from the engine thread for every delta of every
        sample, ending with one that has a finish_reason per sample. Raises ValueError naming
        the problem when the request cannot run (bad params, prompt too long, unknown adapter)."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request's samples (finish_reason "abort") and free their slots at the next
        step; unknown or finished ids are ignored."""
        ...

    def generate(self, requests: list[GenerationRequest]) -> list[list[SampleResult]]:
        """Run `requests` together and wait: per request, its n samples in index order.
        Raises `GenerationFailed` (with every result) when a sample failed."""
        ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None:
        """Abort what runs, stop the loop thread."""
        ...
