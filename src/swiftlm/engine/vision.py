"""Generation with vision-language models (Qwen2-VL, LLaVA, SmolVLM/Idefics3 ...): the
vision generator behind `swiftlm infer` and `swiftlm deploy` when the model takes images.

Continuous batching is text-only: the continuous-batching engine (`continuous.py`) keeps its
own KV cache of token ids and knows nothing of pixel features. A vision-language model therefore runs
through `VisionEngine`, a small generator with the same `Engine` interface (submit / abort /
generate / stats / shutdown) that the infer front end and the server call: the model's own
processor turns a conversation and its images into ids and pixel features
(`VisionEngine.encode`), and transformers' `model.generate` decodes one request at a time on
one worker thread (greedy at temperature 0, else sampled with the request's temperature,
top-p, top-k, min-p and repetition penalty, seeded per sample). It stops at the model's
end-of-turn / EOS tokens, the request's stop token ids and stop strings, the token budget, or
an abort. Tokens are streamed as they are decoded (a stopping-criteria hook sees each new
token), so streaming and aborts work as with the text engine. Text-only conversations go
through the same path. Not supported here (refused with a ValueError the server turns into a
400): log-probabilities, grammars (response_format), presence/frequency penalties and named
adapters; --max_num_seqs / --max_batch_size do not apply (one sequence at a time).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swiftlm.data.images import load_image
from swiftlm.data.parts import content_images, flatten_text_parts
from swiftlm.engine.continuous import default_max_model_len, generate_all, stop_token_ids
from swiftlm.engine.detokenize import IncrementalText, StopText
from swiftlm.engine.protocol import (
    EngineStats,
    GenerationRequest,
    SampleDelta,
    SampleResult,
    SamplingParams,
    new_error_id,
)
from swiftlm.errors import ConfigError
from swiftlm.models import vision as vision_models
from swiftlm.models.loader import load_model, pick_device, pick_dtype

log = logging.getLogger(__name__)

# Processor outputs that are the prompt itself; every other output is an image feature.
TEXT_OUTPUTS = ("input_ids", "attention_mask")
# Files a folder holds when it has its own processor (else the base model's is used).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "image_processor.json")
BACKEND_NOTE = (
    "vision-language model: generation runs one request at a time through transformers' "
    "generate with the model's processor (continuous batching is text-only)"
)


@dataclass
class VisionRequest(GenerationRequest):
    """A `GenerationRequest` whose prompt came from the processor: `prompt_ids` are the
    expanded ids (image tokens included) and `features` the other processor outputs
    (pixel_values, image_grid_thw ...), as tensors with a batch dimension of 1."""

    features: dict = field(default_factory=dict)


@dataclass(frozen=True)
class VisionPrompt:
    ids: list[int]
    features: dict
    images: int  # how many images the prompt holds


def is_vision_model(path: str) -> bool:
    """Whether `path` (a folder or hub id) is a vision-language model."""
    return vision_models.vision_language_type(path) is not None


def processor_path(base_path: str, tokenizer_path: str) -> str:
    """The folder of the processor: the adapter/final folder when it saved one, else the base."""
    folder = Path(tokenizer_path)
    if tokenizer_path != base_path and any((folder / f).is_file() for f in PROCESSOR_FILES):
        return tokenizer_path
    return base_path


class VisionEngine:
    """The `Engine` protocol over a vision-language model: one request at a time on one
    worker thread, with `model.generate` (see the module docstring)."""

    vision = True  # the server and the chat front end check this to take images

    def __init__(
        self,
        model,
        processor,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        max_pixels: int = 0,
    ):
        self.model = model.eval()
        self.max_pixels = max_pixels  # --max_pixels: larger images are scaled down first
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.stop_token_ids = stop_token_ids(self.tokenizer, model)
        self.max_model_len = max_model_len or default_max_model_len(model)
        self.max_num_seqs = 1
        # Samples of requests without a seed draw theirs from this stream (worker thread only).
        self._seeds = random.Random(seed)
        self.generated_tokens = 0
        self._device = next(model.parameters()).device
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._waiting: dict[str, tuple] = {}  # request id -> (request, on_delta), queued
        self._running: VisionRequest | None = None
        self._aborted: set[str] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="swiftlm-vision", daemon=True)
        self._thread.start()

    # -- prompts -------------------------------------------------------------------------------

    def encode(self, conversation: list[dict], tools: list | None = None) -> VisionPrompt:
        """Render `conversation` (canonical messages: image parts are `{"type": "image",
        "image": reference}` made by data.images.resolve_image) with the chat template, ready
        for the answer, and let the processor expand its images into tokens and features.
        Raises RowError (data.images) when an image cannot be decoded."""
        messages = flatten_text_parts(conversation)
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
        references = [ref for m in conversation for ref in content_images(m["content"])]
        images = [load_image(ref, self.max_pixels) for ref in references]
        # As training encodes (data.vision_encode): the processor tokenizes the rendered text.
        outputs = self.processor(text=[text], images=images or None, return_tensors="pt")
        ids = [int(i) for i in outputs["input_ids"][0]]
        features = {k: v for k, v in outputs.items() if k not in TEXT_OUTPUTS}
        return VisionPrompt(ids, features, len(images))

    def request(self, prompt: VisionPrompt, params: SamplingParams, **options) -> VisionRequest:
        return VisionRequest(prompt.ids, params, features=prompt.features, **options)

    # -- the Engine protocol -------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError naming the first problem that stops `request` from running here."""
        params = request.params
        problem = params.check(max_n=16)
        if problem:
            raise ValueError(problem)
        unsupported = (
            (params.logprobs, "logprobs"),
            (request.constraint is not None, "response_format (grammar-constrained output)"),
            (params.presence_penalty != 0, "presence_penalty"),
            (params.frequency_penalty != 0, "frequency_penalty"),
        )
        for used, what in unsupported:
            if used:
                raise ValueError(
                    f"{what} is not supported with a vision-language model (it generates "
                    "through transformers' generate, not the text engine); leave it out"
                )
        if request.adapter is not None:
            raise ValueError(f"adapter {request.adapter!r}: not served (adapters: none)")
        if not request.prompt_ids:
            raise ValueError("prompt: it has no tokens")
        if len(request.prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens {params.max_tokens}: the prompt's {len(request.prompt_ids)} tokens "
                f"plus max_tokens exceed the context length max_model_len {self.max_model_len}"
            )

    def submit(self, request: GenerationRequest, on_delta: Callable[[SampleDelta], None]) -> None:
        self.validate(request)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            self._waiting[request.request_id] = (request, on_delta)
        self._queue.put(request.request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            waiting = self._waiting.pop(request_id, None)
            running = self._running is not None and self._running.request_id == request_id
            if waiting is not None or running:  # unknown or finished ids are ignored
                self._aborted.add(request_id)
        if waiting is not None:
            request, on_delta = waiting
            for index in range(request.params.n):
                on_delta(SampleDelta(request_id, index, (), "", (), "abort"))

    def generate(self, requests: list[GenerationRequest]) -> list[list[SampleResult]]:
        """Run `requests` (one after another) and wait: per request, its samples in order."""
        return generate_all(self, requests)

    def warmup(self) -> None:
        """Nothing to warm: the first request pays for its own first forward."""

    def stats(self) -> EngineStats:
        with self._lock:
            running = self._running.params.n if self._running is not None else 0
            return EngineStats(running, len(self._waiting), self.max_num_seqs, self.max_model_len)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            waiting = list(self._waiting)
            if self._running is not None:
                self._aborted.add(self._running.request_id)
        for request_id in waiting:
            self.abort(request_id)
        self._queue.put(None)
        self._thread.join()

    # -- the worker thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while (request_id := self._queue.get()) is not None:
            with self._lock:
                entry = self._waiting.pop(request_id, None)
                if entry is None:  # aborted while it waited (its deltas are sent)
                    self._aborted.discard(request_id)
                    continue
                self._running = entry[0]
            request, on_delta = entry
            try:
                for index in range(request.params.n):
                    self._sample(request, index, on_delta)
            finally:
                with self._lock:
                    self._running = None
                    self._aborted.discard(request_id)

    def _sample(self, request: GenerationRequest, index: int, on_delta) -> None:
        sample = _Sample(self, request, index, on_delta)
        if request.request_id in self._aborted:
            sample.finish("abort")
            return
        try:
            with torch.inference_mode():
                self._generate(request, index, sample)
        except Exception as exc:
            # One request at a time: its failure is its own ("error"), the next one runs.
            error_id = new_error_id()
            log.exception(
                "vision generation failed for request %s (error id %s)",
                request.request_id,
                error_id,
            )
            if sample.finish_reason is None:
                sample.finish("error", error=f"{type(exc).__name__}: {exc}", error_id=error_id)
            return
        if sample.finish_reason is None:  # generate ended on its own (it should not)
            sample.finish("length")

    def _generate(self, request: GenerationRequest, index: int, sample: _Sample) -> None:
        from transformers import StoppingCriteria, StoppingCriteriaList

        params = request.params
        ids = torch.tensor([request.prompt_ids], device=self._device)
        features = {
            k: v.to(self._device) if isinstance(v, torch.Tensor) else v
            for k, v in getattr(request, "features", {}).items()
        }
        if "pixel_values" in features and features["pixel_values"].is_floating_point():
            features["pixel_values"] = features["pixel_values"].to(self.model.dtype)

        class Hook(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                done = sample.accept(int(input_ids[0, -1]))
                return torch.full((input_ids.shape[0],), done, device=input_ids.device)

        stops = sorted(set(params.stop_token_ids) | set(self.stop_token_ids))
        sampled = params.temperature > 0
        options = dict(
            max_new_tokens=params.max_tokens,
            do_sample=sampled,
            eos_token_id=stops,
            pad_token_id=self.tokenizer.pad_token_id,
            repetition_penalty=params.repetition_penalty,
            stopping_criteria=StoppingCriteriaList([Hook()]),
        )
        if params.ignore_eos:  # the stop tokens are masked until max_tokens are out
            options["min_new_tokens"] = params.max_tokens
        if sampled:
            options.update(temperature=params.temperature, top_p=params.top_p)
            options.update(top_k=params.top_k or None, min_p=params.min_p or None)
        # A request's seed makes sample i reproducible (seed + i), as with the text engine.
        seed = self._seeds.getrandbits(63) if params.seed is None else params.seed + index
        devices = [self._device] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **features, **options
            )


class _Sample:
    """One sample's tokens, text and stop rules, fed one token at a time by the stopping hook
    (as engine.sequence.Sequence is by the scheduler)."""

    def __init__(self, engine: VisionEngine, request: GenerationRequest, index: int, on_delta):
        self.engine = engine
        self.request = request
        self.index = index
        self.on_delta = on_delta
        self.detokenizer = IncrementalText(engine.tokenizer)
        self.stop_text = StopText(request.params.stop)
        stops = set(request.params.stop_token_ids)
        self.stop_ids = stops if request.params.ignore_eos else stops | set(engine.stop_token_ids)
        self.count = 0
        self.finish_reason: str | None = None

    def accept(self, token: int) -> bool:
        """Take a generated token, send its delta; True when the sample is done."""
        if self.finish_reason is not None:
            return True
        if self.request.request_id in self.engine._aborted:
            self.finish("abort")
            return True
        self.count += 1
        self.engine.generated_tokens += 1
        text = ""
        if token in self.stop_ids:
            self.finish_reason = "stop"
        else:
            text = self.stop_text.push(self.detokenizer.add(token))
            if self.stop_text.stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and self.count >= self.request.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            text += self.stop_text.flush()
        self._send(
            SampleDelta(self.request.request_id, self.index, (token,), text, (), self.finish_reason)
        )
        return self.finish_reason is not None

    def finish(self, reason: str, error: str | None = None, error_id: str | None = None) -> None:
        self.finish_reason = reason
        text = self.stop_text.flush() if reason != "error" else ""
        request_id = self.request.request_id
        self._send(SampleDelta(request_id, self.index, (), text, (), reason, error, error_id))

    def _send(self, delta: SampleDelta) -> None:
        try:
            self.on_delta(delta)
        except Exception:  # a consumer's failure must not kill the worker
            log.exception("a delta callback failed; aborting request %s", delta.request_id)
            self.engine._aborted.add(delta.request_id)


def build_vision_engine(
    model_path: str,
    *,
    tokenizer_path: str | None = None,
    merge_adapters: tuple[str, ...] = (),
    adapters: dict[str, str] | None = None,
    torch_dtype: str = "auto",
    device: str = "auto",
    attn_impl: str = "sdpa",
    max_model_len: int | None = None,
    seed: int = 0,
    max_pixels: int = 0,
) -> VisionEngine:
    """Load a vision-language model, its processor and its (merged) adapters."""
    from swiftlm.engine.build import apply_adapters  # build.py builds this module's engine

    if adapters:
        raise ConfigError(
            "--adapters name=path serves adapters unmerged through the continuous-batching "
            "engine, which is text-only; a vision-language model's adapters must be merged: "
            "load one with --ckpt_dir (or --adapters path without a name in swiftlm infer), or "
            "merge it first with `swiftlm export --merge_lora`"
        )
    # Looked up on the module, so that tests can substitute a processor builder.
    processor = vision_models.load_processor(
        processor_path(model_path, tokenizer_path or model_path)
    )
    torch_device = pick_device(device)
    dtype = pick_dtype(torch_dtype, torch_device)
    model = load_model(model_path, dtype, torch_device, attn_impl)
    model = apply_adapters(model, merge_adapters)
    print(f"Generation backend: {BACKEND_NOTE}", flush=True)
    return VisionEngine(
        model, processor, max_model_len=max_model_len, seed=seed, max_pixels=max_pixels
    )
