"""`--infer_backend vllm`: vLLM's engine behind swiftlm's `Engine` protocol.

`VllmEngine` takes the same `GenerationRequest`s as the continuous-batching engine and
delivers the same `SampleDelta`s, so `swiftlm infer`, `deploy` (its API layer: auth, limits,
429, drain, /metrics, the bad-input contract) and `eval` run on it unchanged. What vLLM
brings: paged attention, its kernels and CUDA graphs, tensor parallel, its own prefix cache.

How swiftlm's requests map onto vLLM's:
- Each of a request's n samples is its own vLLM request (`{request_id}/{i}`) with seed
  `seed + i`, as swiftlm's engine seeds them; vLLM's prefix cache shares their prompt.
- Stop tokens: the model's end-of-turn ids (the same list swiftlm's engine stops on) plus the
  request's own; `ignore_eos` drops the model's, as in swiftlm's engine.
- Structured output: the request's compiled grammar goes to vLLM as EBNF
  (`GrammarConstraint.ebnf`), which vLLM enforces with its own xgrammar.
- Named adapters are vLLM LoRA requests; adapters merged into the model (a LoRA run) are
  merged once into a temporary folder that vLLM loads.
- Log-probs: "raw" is vLLM's `raw_logprobs`. "scaled" (temperature-scaled, what a trainer
  recomputes) is its `processed_logprobs`, which also applies penalties and top-k/top-p: a
  "scaled" request that sets those is refused rather than answered with other numbers.

vLLM is imported lazily: it is an optional dependency with its own pins (`swiftlm[vllm]` on
CUDA; on CPU `scripts/setup_vllm.sh` builds `.venv-vllm`, see constraints-vllm.txt).
"""

import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from swiftlm.engine.continuous import (
    MAX_N,
    default_max_model_len,
    generate_all,
    stop_token_ids,
)
from swiftlm.engine.inbox import Inbox
from swiftlm.engine.protocol import (
    EngineStats,
    GenerationRequest,
    InvalidRequest,
    SampleDelta,
    SampleResult,
    TokenLogprob,
    check_request,
    new_error_id,
)
from swiftlm.errors import ConfigError
from swiftlm.models.loader import load_model, load_tokenizer, pick_device, pick_dtype

log = logging.getLogger(__name__)
INSTALL_HINT = (
    "on a CUDA machine `pip install 'swiftlm[vllm]'`; on a CPU `bash scripts/setup_vllm.sh`, "
    "which builds .venv-vllm with vLLM's CPU build (it pins transformers < 5.20, so it lives "
    "beside .venv)"
)
# vLLM's `max_lora_rank` must be one of these.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def import_vllm(flag: str | None = "--infer_backend vllm"):
    """vLLM, or an error that says how to install it (after `flag`, the flag that asked)."""
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(
            f"{flag + ': ' if flag else ''}vLLM cannot be imported here ({exc}); install it: "
            + INSTALL_HINT
        ) from None
    return vllm


@dataclass(frozen=True)
class VllmOptions:
    """The engine settings only vLLM has (`--vllm_*` flags)."""

    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # no torch.compile / CUDA graphs: starts in seconds
    logprobs_mode: str = "raw"  # "raw" or "scaled": `SamplingParams.logprobs_mode`
    # A class mixed into vLLM's workers (its qualified name), whose methods `call_workers`
    # calls: vllm_weight_sync.WORKER_EXTENSION for `swiftlm rollout`'s weight pushes.
    worker_extension: str = ""


@dataclass
class _Sample:
    """One live vLLM request: which swiftlm sample it is, and where its deltas go."""

    request_id: str
    index: int
    prompt_tokens: int
    top_logprobs: int
    on_delta: Callable[[SampleDelta], None]
    counted_prompt: bool = False


class VllmEngine:
    """The `Engine` protocol over a `vllm.LLMEngine`, stepped by one loop thread (vLLM's own
    engine core runs in its process); callers on any thread submit and abort."""

    def __init__(
        self,
        llm_engine,
        tokenizer,
        *,
        stop_token_ids: list[int],
        dtype: str,
        vocab_size: int,
        max_num_seqs: int,
        max_model_len: int,
        adapters: dict[str, str] | None = None,
        logprobs_mode: str = "raw",
        workers: int = 1,
        cleanup: Callable[[], None] | None = None,
    ):
        self.llm_engine = llm_engine
        self.tokenizer = tokenizer
        self.model = None  # the weights live in vLLM's process: no torch module here
        self.dtype = dtype  # what vLLM runs them in: "bfloat16", "float32" ...
        self.stop_token_ids = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.adapters = tuple(adapters or {})
        self._lora_requests = _lora_requests(adapters or {})
        self.logprobs_mode = logprobs_mode
        self.workers = workers  # vLLM's worker processes (tensor parallel)
        from vllm.platforms import current_platform

        self.device_type = current_platform.device_type  # "cpu", "cuda" ...
        self._cleanup = cleanup
        self.generated_tokens = 0
        self.prefill_tokens = 0
        self.prefix_hit_tokens = 0
        self._live: dict[str, _Sample] = {}  # vLLM request id -> sample (loop thread only)
        self._inbox = Inbox()  # (request, on_delta) pairs, aborts, the stop
        self._thread = threading.Thread(target=self._loop, name="swiftlm-vllm", daemon=True)
        self._thread.start()

    # -- the Engine protocol ----------------------------------------------------------------

    def submit(self, request: GenerationRequest, on_delta: Callable[[SampleDelta], None]) -> None:
        self.validate(request)
        self._inbox.put((request, on_delta))

    def abort(self, request_id: str) -> None:
        self._inbox.abort(request_id)

    def generate(self, requests: list[GenerationRequest]) -> list[list[SampleResult]]:
        return generate_all(self, requests)

    def stats(self) -> EngineStats:
        waiting, running = self._inbox.waiting(), len(self._live)
        return EngineStats(
            running,
            waiting,
            self.max_num_seqs,
            self.max_model_len,
            prefill_tokens=self.prefill_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )

    def shutdown(self) -> None:
        self._inbox.stop()
        self._thread.join()
        self.llm_engine.engine_core.shutdown()
        if self._cleanup is not None:
            self._cleanup()

    def reload_weights(self, folder: str) -> None:
        """Load new weights (a safetensors folder in the model's own names) into the running
        engine, in place, and forget its cached prefixes (their keys and values came from
        the old weights). Only between generations: nothing may be running."""
        self.llm_engine.collective_rpc("reload_weights", kwargs={"weights_path": folder})
        self.llm_engine.reset_prefix_cache()

    def call_workers(self, method: str, *args) -> list:
        """Call `method` of the worker extension (`VllmOptions.worker_extension`) on every
        vLLM worker, with JSON-like `args`; their results. Only between generations."""
        return self.llm_engine.collective_rpc(method, args=args)

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError naming the first problem that stops `request` from running."""
        check_request(
            request,
            max_n=min(MAX_N, self.max_num_seqs),
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            adapters=self.adapters,
        )
        problem = self._unsupported(request)
        if problem:
            raise ValueError(problem)

    def _unsupported(self, request: GenerationRequest) -> str | None:
        """What this backend cannot answer as swiftlm's engine would, named."""
        params = request.params
        if request.constraint is not None and not hasattr(request.constraint, "ebnf"):
            return (
                f"constraint {type(request.constraint).__name__}: --infer_backend vllm takes "
                "grammars as EBNF (engine.grammar's GrammarConstraint)"
            )
        if params.logprobs and params.logprobs_mode != self.logprobs_mode:
            return (
                f"logprobs_mode {params.logprobs_mode}: this vLLM engine reports "
                f"{self.logprobs_mode} log-probs (vLLM fixes the mode per engine)"
            )
        if params.logprobs and params.logprobs_mode == "scaled" and _truncates(params):
            return (
                "logprobs_mode scaled with top_p, top_k, min_p or penalties: vLLM's processed "
                "log-probs include them, swiftlm's scaled ones do not; drop them or use "
                "--infer_backend pt"
            )
        return None

    # -- the loop thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            incoming, aborted, stopping = self._inbox.take(busy=lambda: bool(self._live))
            if stopping:
                self._abort_live(set(self._live), error=None)
                return
            for request, on_delta in incoming:
                self._add(request, on_delta)
            if aborted:
                live = {rid for rid, s in self._live.items() if s.request_id in aborted}
                self._abort_live(live, error=None)
            if self._live:
                self._step()

    def _add(self, request: GenerationRequest, on_delta: Callable[[SampleDelta], None]) -> None:
        for index in range(request.params.n):
            vllm_id = f"{request.request_id}/{index}"
            sample = _Sample(
                request.request_id,
                index,
                len(request.prompt_ids),
                request.params.top_logprobs,
                on_delta,
            )
            try:
                self.llm_engine.add_request(
                    vllm_id,
                    {"prompt_token_ids": list(request.prompt_ids)},
                    self._sampling(request, index),
                    lora_request=self._lora_requests.get(request.adapter),
                )
            except Exception as exc:  # vLLM refused this sample's values
                error_id = None if isinstance(exc, (ValueError, InvalidRequest)) else new_error_id()
                if error_id:
                    log.exception("vLLM refused request %s (error id %s)", vllm_id, error_id)
                self._deliver(
                    sample, self._failed(sample, f"{type(exc).__name__}: {exc}", error_id)
                )
                continue
            self._live[vllm_id] = sample

    def _sampling(self, request: GenerationRequest, index: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        p = request.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.stop_token_ids))
        structured = None
        if request.constraint is not None:
            structured = StructuredOutputsParams(grammar=request.constraint.ebnf)
        return SamplingParams(
            n=1,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            stop=list(p.stop),
            stop_token_ids=sorted(stops),
            ignore_eos=p.ignore_eos,
            seed=None if p.seed is None else p.seed + index,
            logprobs=p.top_logprobs if p.logprobs else None,
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=True,
        )

    def _step(self) -> None:
        try:
            outputs = self.llm_engine.step()
        except Exception as exc:
            error_id = new_error_id()
            log.exception("the vLLM engine step failed (error id %s); aborting the batch", error_id)
            self._abort_live(
                set(self._live), error=f"{type(exc).__name__}: {exc}", error_id=error_id
            )
            return
        for output in outputs:
            sample = self._live.get(output.request_id)
            if sample is None:
                continue
            if not sample.counted_prompt:
                cached = output.num_cached_tokens or 0
                self.prefix_hit_tokens += cached
                self.prefill_tokens += sample.prompt_tokens - cached
                sample.counted_prompt = True
            if output.finished:
                del self._live[output.request_id]
            self._deliver(sample, self._delta(sample, output))

    def _delta(self, sample: _Sample, output) -> SampleDelta:
        completion = output.outputs[0]
        finish = None
        if output.finished:
            finish = FINISH_REASONS.get(completion.finish_reason or "stop", "error")
        error = error_id = None
        if finish == "error":  # a reason swiftlm's protocol has no name for: vLLM's failure
            error = f"vLLM ended the sample: {completion.finish_reason}"
            error_id = new_error_id()
            log.error("request %s: %s (error id %s)", output.request_id, error, error_id)
        return SampleDelta(
            sample.request_id,
            sample.index,
            tuple(completion.token_ids),
            completion.text,
            _token_logprobs(completion.token_ids, completion.logprobs, sample.top_logprobs),
            finish,
            error,
            error_id,
        )

    def _failed(self, sample: _Sample, error: str, error_id: str | None) -> SampleDelta:
        return SampleDelta(sample.request_id, sample.index, (), "", (), "error", error, error_id)

    def _abort_live(self, vllm_ids: set[str], error: str | None, error_id: str | None = None):
        if not vllm_ids:
            return
        try:
            self.llm_engine.abort_request(sorted(vllm_ids))
        except Exception:  # the engine core is gone: its requests are too
            log.exception("vLLM could not abort %d requests", len(vllm_ids))
        for vllm_id in sorted(vllm_ids):
            sample = self._live.pop(vllm_id)
            delta = SampleDelta(
                sample.request_id, sample.index, (), "", (), "abort", error, error_id
            )
            self._deliver(sample, delta)

    def _deliver(self, sample: _Sample, delta: SampleDelta) -> None:
        self.generated_tokens += len(delta.token_ids)
        try:
            sample.on_delta(delta)
        except Exception:  # a caller's callback must not stop the loop for everyone
            log.exception("the delta callback of request %s failed", sample.request_id)


def _truncates(params) -> bool:
    return (
        params.top_p < 1
        or params.top_k > 0
        or params.min_p > 0
        or params.repetition_penalty != 1
        or params.presence_penalty != 0
        or params.frequency_penalty != 0
    )


def _token_logprobs(token_ids, logprobs, top_count: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token dicts (the `top_count` best tokens and the sampled one, each with its
    rank) as swiftlm's `TokenLogprob`s, the alternatives in rank order."""
    if not logprobs:
        return ()
    tokens = []
    for token, ranked in zip(token_ids, logprobs, strict=True):
        top = sorted((lp.rank, i, lp.logprob) for i, lp in ranked.items() if lp.rank <= top_count)
        alternatives = tuple((i, logprob) for _, i, logprob in top)
        tokens.append(TokenLogprob(token, ranked[token].logprob, alternatives))
    return tuple(tokens)


def _lora_requests(adapters: dict[str, str]) -> dict:
    if not adapters:
        return {}
    from vllm.lora.request import LoRARequest

    return {
        name: LoRARequest(name, number, str(folder))
        for number, (name, folder) in enumerate(adapters.items(), start=1)
    }


def _lora_rank(adapters: dict[str, str]) -> int:
    """The smallest rank vLLM accepts that holds every adapter's `r`."""
    ranks = [
        json.loads((Path(f) / "adapter_config.json").read_text())["r"] for f in adapters.values()
    ]
    need = max(ranks)
    for allowed in VLLM_LORA_RANKS:
        if allowed >= need:
            return allowed
    raise ConfigError(
        f"--adapters: LoRA rank {need} is above vLLM's largest ({VLLM_LORA_RANKS[-1]}); "
        "serve it with --infer_backend pt"
    )


def build_vllm_engine(
    model_path: str,
    *,
    tokenizer_path: str,
    merge_adapters: tuple[str, ...] = (),
    adapters: dict[str, str] | None = None,
    torch_dtype: str = "auto",
    device: str = "auto",
    max_num_seqs: int = 32,
    max_model_len: int | None = None,
    seed: int = 0,
    speculative_tokens: int = 0,
    options: VllmOptions = VllmOptions(),
) -> VllmEngine:
    """Start vLLM on `model_path` (a local folder or hub id) with `merge_adapters` merged in
    and `adapters` (name -> folder) served as LoRA requests; `speculative_tokens` turns on
    vLLM's own prompt-lookup ("ngram") speculation."""
    from transformers import AutoConfig, GenerationConfig

    vllm = import_vllm()
    dtype = pick_dtype(torch_dtype, pick_device(device))
    merged_dir = _merged_model(model_path, merge_adapters, tokenizer_path, dtype)
    served_path = str(merged_dir or model_path)
    config = AutoConfig.from_pretrained(served_path)
    tokenizer = load_tokenizer(tokenizer_path)
    try:
        generation = GenerationConfig.from_pretrained(served_path)
    except OSError:  # no generation_config.json: the tokenizer's EOS is the model's
        generation = SimpleNamespace(eos_token_id=None)
    stops = stop_token_ids(tokenizer, SimpleNamespace(generation_config=generation))
    check_cpu_head_size(config, model_path)
    dtype_name = str(dtype).removeprefix("torch.")
    context = max_model_len or default_max_model_len(SimpleNamespace(config=config))
    args = vllm.EngineArgs(
        model=served_path,
        tokenizer=tokenizer_path,
        dtype=dtype_name,
        max_model_len=context,
        max_num_seqs=max_num_seqs,
        seed=seed,
        enable_prefix_caching=True,
        enforce_eager=options.enforce_eager,
        gpu_memory_utilization=options.gpu_memory_utilization,
        tensor_parallel_size=options.tensor_parallel_size,
        logprobs_mode="processed_logprobs" if options.logprobs_mode == "scaled" else "raw_logprobs",
        max_logprobs=20,
        worker_extension_cls=options.worker_extension,
        **_lora_args(adapters or {}),
        **_speculation_args(speculative_tokens),
    )
    try:
        llm_engine = vllm.LLMEngine.from_engine_args(args)
    except Exception as exc:
        if merged_dir:
            shutil.rmtree(merged_dir, ignore_errors=True)
        raise ConfigError(
            f"--infer_backend vllm: vLLM could not start on {model_path} "
            f"({type(exc).__name__}: {exc}); its log above names the cause, and "
            "--infer_backend pt runs any transformers model"
        ) from exc
    return VllmEngine(
        llm_engine,
        tokenizer,
        stop_token_ids=stops,
        dtype=dtype_name,
        vocab_size=config.get_text_config().vocab_size,
        max_num_seqs=max_num_seqs,
        max_model_len=context,
        adapters=adapters,
        logprobs_mode=options.logprobs_mode,
        workers=options.tensor_parallel_size,
        cleanup=(lambda: shutil.rmtree(merged_dir, ignore_errors=True)) if merged_dir else None,
    )


def check_cpu_head_size(config, model_path: str) -> None:
    """vLLM's CPU attention has kernels for a few head sizes only, and finds out at the first
    forward: refuse before start-up instead, naming the size."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = config.get_text_config()
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ConfigError(
            f"--infer_backend vllm: {model_path} has attention heads of size {head_size}, and "
            f"vLLM's CPU build has kernels for {supported} only; use --infer_backend pt"
        )


def _merged_model(model_path: str, adapters: tuple[str, ...], tokenizer_path: str, dtype):
    """A temporary folder holding `model_path` with `adapters` merged in (vLLM loads weights
    from a folder, and merged weights decode as fast as the base); None without adapters."""
    if not adapters:
        return None
    from swiftlm.engine.build import apply_adapters  # build.py imports this module

    folder = Path(tempfile.mkdtemp(prefix="swiftlm-vllm-merged-"))
    print(f"Merging {len(adapters)} adapter(s) into {folder} for vLLM", flush=True)
    model = apply_adapters(load_model(model_path, dtype, torch.device("cpu"), "sdpa"), adapters)
    model.save_pretrained(folder)
    load_tokenizer(tokenizer_path).save_pretrained(folder)
    return folder


def _lora_args(adapters: dict[str, str]) -> dict:
    if not adapters:
        return {}
    # One slot more than the adapters, never filled: vLLM's CPU LoRA ops (torch_ops.bgmv_*)
    # index the stacked LoRA weights with each row's slot, -1 for a base-model row, and -1
    # picks the last slot. With every slot filled, base rows batched beside adapter rows ran
    # through the last adapter (measured: tests/integration/test_vllm_backend.py); the empty
    # last slot holds zeros, so they run through nothing.
    return {
        "enable_lora": True,
        "max_loras": len(adapters) + 1,
        "max_lora_rank": _lora_rank(adapters),
    }


def _speculation_args(tokens: int) -> dict:
    if not tokens:
        return {}
    config = {
        "method": "ngram",
        "num_speculative_tokens": tokens,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    return {"speculative_config": config}
