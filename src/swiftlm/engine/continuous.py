"""`ContinuousEngine`: the `Engine` protocol over a transformers model, one loop thread.

Callers on any thread `submit` requests and `abort` them; the loop thread owns the model and
the `Scheduler` and runs one step (a prefill chunk and/or one decode step for every running
row) after another while there is work, sleeping otherwise. Only the hand-over queues are
shared, under one lock.
"""

import logging
import threading
from collections.abc import Callable

import torch

from swiftlm.engine.inbox import Inbox
from swiftlm.engine.prefix_cache import PrefixCache
from swiftlm.engine.protocol import (
    EngineStats,
    GenerationFailed,
    GenerationRequest,
    SampleDelta,
    SampleResult,
    SamplingParams,
    check_request,
    new_error_id,
)
from swiftlm.engine.scheduler import Scheduler, Submitted
from swiftlm.engine.speculation import Speculation, SpeculationCounters
from swiftlm.models.templates import end_of_turn_token

log = logging.getLogger(__name__)
MAX_N = 16  # samples per request at most (the server caps `n` with this too)
DEFAULT_MAX_MODEL_LEN = 4096  # the default context cap: KV memory grows with it


class ContinuousEngine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        stop_token_ids: list[int],
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        prefill_chunk_tokens: int = 1024,
        adapters: tuple[str, ...] = (),
        seed: int = 0,
        inference_mode: bool = True,
        prefix_cache_bytes: int = 0,
        speculation: Speculation | None = None,
    ):
        """`prefix_cache_bytes`: the budget of the prefix cache (`prefix_cache.py`), 0 for
        none. Only for fixed weights: an engine over a model that trains must keep none.
        `speculation`: prompt-lookup speculative decoding for small batches
        (`speculation.py`), None for none."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.vocab_size = model.get_output_embeddings().out_features
        self.adapters = tuple(adapters)
        max_model_len = max_model_len or default_max_model_len(model)
        self.scheduler = Scheduler(
            model,
            tokenizer,
            stop_token_ids=stop_token_ids,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            prefill_chunk_tokens=prefill_chunk_tokens,
            adapters=adapters,
            seed=seed,
            prefix_cache=PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None,
            speculation=speculation,
        )
        self.stop_token_ids = sorted(stop_token_ids)
        # False: plain no_grad. Sampling from a model that trains right after (FSDP2 keeps
        # buffers across forwards) must not leave inference tensors behind.
        self.inference_mode = inference_mode
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.generated_tokens = 0  # all samples, for throughput reports
        self._inbox = Inbox()  # Submitted requests, aborts, the stop
        self._thread = threading.Thread(target=self._loop, name="swiftlm-engine", daemon=True)
        self._thread.start()

    # -- the Engine protocol ----------------------------------------------------------------

    def submit(self, request: GenerationRequest, on_delta: Callable[[SampleDelta], None]) -> None:
        self.validate(request)
        self._inbox.put(Submitted(request, self._counting(on_delta)))

    def abort(self, request_id: str) -> None:
        self._inbox.abort(request_id)

    def generate(self, requests: list[GenerationRequest]) -> list[list[SampleResult]]:
        return generate_all(self, requests)

    def warmup(self) -> None:
        """Run a full batch for a few tokens: the first forwards of a shape are slow on a
        CPU (oneDNN builds its kernels), and that should not land on the first client."""
        prompt = [self.tokenizer.eos_token_id or 0] * max(1, min(16, self.max_model_len - 2))
        # A seed of its own: the warm-up leaves the engine's seed stream as it was.
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, seed=0)
        self.generate([GenerationRequest(prompt, params) for _ in range(self.max_num_seqs)])
        self.generated_tokens = 0
        self.scheduler.prefill_tokens = 0
        self.scheduler.speculated = SpeculationCounters()
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.clear()

    def stats(self) -> EngineStats:
        waiting = self._inbox.waiting() + len(self.scheduler.waiting)
        running = self.scheduler.running_count()
        cache = self.scheduler.prefix_cache
        speculated = self.scheduler.speculated
        return EngineStats(
            running,
            waiting,
            self.max_num_seqs,
            self.max_model_len,
            prefill_tokens=self.scheduler.prefill_tokens,
            prefix_hit_tokens=cache.hit_tokens if cache else 0,
            draft_tokens=speculated.draft_tokens,
            accepted_draft_tokens=speculated.accepted_tokens,
        )

    def shutdown(self) -> None:
        self._inbox.stop()
        self._thread.join()

    # -- validation -----------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError naming the first problem that stops `request` from running."""
        check_request(
            request,
            max_n=min(MAX_N, self.max_num_seqs),
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            adapters=self.adapters,
        )

    # -- the loop thread ------------------------------------------------------------------------

    def _counting(self, on_delta: Callable[[SampleDelta], None]) -> Callable[[SampleDelta], None]:
        def counted(delta: SampleDelta) -> None:
            self.generated_tokens += len(delta.token_ids)
            on_delta(delta)

        return counted

    def _loop(self) -> None:
        scheduler = self.scheduler
        with torch.inference_mode() if self.inference_mode else torch.no_grad():
            while True:
                incoming, aborted, stopping = self._inbox.take(busy=scheduler.has_work)
                scheduler.waiting.extend(incoming)
                if stopping:
                    scheduler.abort_all()
                    return
                if aborted:
                    scheduler.abort(aborted)
                self._step(scheduler)

    def _step(self, scheduler: Scheduler) -> None:
        try:
            scheduler.step()
        except Exception as exc:
            # Only a failed forward gets here (a sample's own failures stay with the sample):
            # it leaves the batch unusable, so end what runs and keep serving.
            error_id = new_error_id()
            log.exception("the engine step failed (error id %s); aborting the batch", error_id)
            scheduler.abort_all(error=f"{type(exc).__name__}: {exc}", error_id=error_id)


def default_max_model_len(model) -> int:
    """The model's context length, at most `DEFAULT_MAX_MODEL_LEN`. Sliding-window layers
    do not shorten it: their window is applied by mask (`windows.py`)."""
    config = model.config.get_text_config()
    context = getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    return min(context, DEFAULT_MAX_MODEL_LEN)


class SampleCollector:
    """Gathers the deltas of one request's samples into `SampleResult`s."""

    def __init__(self, n: int):
        self.results = [SampleResult(i, [], "", [], "") for i in range(n)]
        self.open = n
        self.error: str | None = None
        self.done = threading.Event()

    def add(self, delta: SampleDelta) -> None:
        result = self.results[delta.index]
        result.token_ids += delta.token_ids
        result.text += delta.text
        result.logprobs += delta.logprobs
        if delta.error:
            result.error = delta.error
            self.error = self.error or delta.error
        if delta.finish_reason:
            result.finish_reason = delta.finish_reason
            self.open -= 1
            if self.open == 0:
                self.done.set()

    def wait(self) -> list[SampleResult]:
        """The samples, once all have finished (a failed one holds its `error`)."""
        self.done.wait()
        return self.results


def generate_all(engine, requests: list[GenerationRequest]) -> list[list[SampleResult]]:
    """`Engine.generate` over an engine's `validate` and `submit`: every request checked
    before any is queued (a bad one queues nothing), then all run together and are waited
    for."""
    for request in requests:
        engine.validate(request)
    collectors = [SampleCollector(r.params.n) for r in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector.add)
    return wait_all(collectors)


def wait_all(collectors: list[SampleCollector]) -> list[list[SampleResult]]:
    """Every request's samples; `GenerationFailed` (holding them all) if any sample failed.
    Waits for all first, so one failure neither loses the other answers nor leaves them
    running unread."""
    results = [collector.wait() for collector in collectors]
    failures = {i: c.error for i, c in enumerate(collectors) if c.error}
    if failures:
        raise GenerationFailed(results, failures)
    return results


def stop_token_ids(tokenizer, model) -> list[int]:
    """Token ids that end an answer: EOS, the chat template's end-of-turn, the model's EOS."""
    ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))]
    model_eos = getattr(model.generation_config, "eos_token_id", None)
    ids += model_eos if isinstance(model_eos, list) else [model_eos]
    return sorted({i for i in ids if i is not None and i != tokenizer.unk_token_id})
