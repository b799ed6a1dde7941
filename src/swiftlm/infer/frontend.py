"""`swiftlm infer`'s view of the engine: conversations in, answers (or streamed text) out.

`ChatEngine` renders conversations with the chat template and sends them to the
continuous-batching engine: `generate` submits every conversation at once (the engine
batches them step by step), `stream` yields one answer's text as it is decoded.

A vision-language model runs through `engine.vision.VisionEngine` instead (continuous batching
is text-only): `VisionChatEngine` renders conversations with image parts through the model's
processor and sends them one at a time to `model.generate`, behind the same interface.
"""

import queue
from collections.abc import Iterator
from typing import Protocol

from swiftlm.engine.build import EngineOptions, InferenceModel, engine_for_model
from swiftlm.engine.config import GenerationArguments
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.protocol import (
    GenerationFailed,
    GenerationRequest,
    SampleDelta,
    SamplingParams,
    user_sampling,
)
from swiftlm.engine.vision import VisionEngine
from swiftlm.models.config import ModelArguments


class AnswersFailed(RuntimeError):
    """Some conversations of `ChatEngine.generate` could not be answered. `answers` holds
    every answer all the same (None where it failed), `failures` maps a conversation's index
    to why, so that a batch keeps what did succeed."""

    def __init__(self, answers: list[str | None], failures: dict[int, str]):
        first = min(failures)
        super().__init__(
            f"could not answer {len(failures)} of {len(answers)} conversations; "
            f"conversation {first + 1}: {failures[first]}"
        )
        self.answers = answers
        self.failures = failures


class InferEngine(Protocol):
    """What the chat and batch front ends need from an engine."""

    generated_tokens: int  # new tokens produced so far (for throughput reports)

    def generate(self, conversations: list[list[dict]], gen: GenerationArguments) -> list[str]: ...

    def stream(self, conversation: list[dict], gen: GenerationArguments) -> Iterator[str]: ...


def build_chat_engine(
    spec: InferenceModel,
    model_args: ModelArguments,
    seed: int,
    max_num_seqs: int = 32,
    max_pixels: int = 0,
    options: EngineOptions = EngineOptions(),
) -> "ChatEngine":
    """The model of `spec` with its adapters merged in (infer serves one model);
    `max_pixels` (--max_pixels) scales down the images of a vision-language model."""
    engine = engine_for_model(
        spec, model_args, seed, max_num_seqs, max_pixels=max_pixels, options=options
    )
    if isinstance(engine, VisionEngine):
        return VisionChatEngine(engine)
    return ChatEngine(engine)


class ChatEngine:
    takes_images = False  # whether conversations may hold image parts

    def __init__(self, engine: ContinuousEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer

    @property
    def model(self):
        return self.engine.model

    @property
    def stop_token_ids(self) -> list[int]:
        return self.engine.stop_token_ids

    @property
    def generated_tokens(self) -> int:
        return self.engine.generated_tokens

    def generate(self, conversations: list[list[dict]], gen: GenerationArguments) -> list[str]:
        """Answer each conversation; greedy when `gen.temperature == 0`, else sampled.
        `AnswersFailed` (holding the other answers) when some could not be answered: their
        prompt does not fit, or their generation failed inside the engine."""
        requests: dict[int, GenerationRequest] = {}
        failures: dict[int, str] = {}
        for i, conversation in enumerate(conversations):
            try:
                requests[i] = self.request(conversation, gen)
                self.engine.validate(requests[i])
            except Exception as exc:  # this conversation's problem, named with it
                requests.pop(i, None)
                failures[i] = str(exc) if isinstance(exc, ValueError) else _described(exc)
        try:
            results = self.engine.generate(list(requests.values()))
        except GenerationFailed as exc:
            results = exc.results
            order = list(requests)  # the engine numbers only the requests it was given
            failures |= {order[k]: reason for k, reason in exc.failures.items()}
        answers: list[str | None] = [None] * len(conversations)
        for i, samples in zip(requests, results, strict=True):
            if i not in failures:
                answers[i] = samples[0].text
        if failures:
            raise AnswersFailed(answers, failures)
        return answers

    def stream(self, conversation: list[dict], gen: GenerationArguments) -> Iterator[str]:
        """Yield the answer's text piece by piece; closing the generator aborts it."""
        request = self.request(conversation, gen)
        deltas: queue.Queue[SampleDelta] = queue.Queue()
        self.engine.submit(request, deltas.put)
        finished = False
        try:
            while not finished:
                delta = deltas.get()
                finished = delta.finish_reason is not None
                if delta.error:
                    raise RuntimeError(f"generation failed: {delta.error}")
                if delta.text:
                    yield delta.text
        finally:
            if not finished:  # the consumer stopped early (Ctrl+C, closed generator)
                self.engine.abort(request.request_id)

    def request(self, conversation: list[dict], gen: GenerationArguments) -> GenerationRequest:
        ids = self.encode(conversation)
        room = self.engine.max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"a prompt of {len(ids)} tokens leaves no room to answer within the context "
                f"length of {self.engine.max_model_len} tokens"
            )
        return GenerationRequest(
            ids, sampling_params(gen, max_tokens=min(gen.max_new_tokens, room))
        )

    def encode(self, conversation: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        # The chat template already writes any BOS token; adding special tokens would double it.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def shutdown(self) -> None:
        self.engine.shutdown()


class VisionChatEngine(ChatEngine):
    """`ChatEngine` over a `VisionEngine`: conversations may hold image parts
    (`{"type": "image", "image": reference}`, checked by data.images.resolve_image), which the
    model's processor turns into image tokens and pixel features."""

    takes_images = True
    engine: VisionEngine

    def request(self, conversation: list[dict], gen: GenerationArguments) -> GenerationRequest:
        prompt = self.engine.encode(conversation)
        room = self.engine.max_model_len - len(prompt.ids)
        if room < 1:
            raise ValueError(
                f"a prompt of {len(prompt.ids)} tokens (images included) leaves no room to "
                f"answer within the context length of {self.engine.max_model_len} tokens"
            )
        params = sampling_params(gen, max_tokens=min(gen.max_new_tokens, room))
        return self.engine.request(prompt, params)


def _described(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def sampling_params(gen: GenerationArguments, max_tokens: int) -> SamplingParams:
    """`--temperature` etc. as engine sampling; top-p/top-k only apply when sampling."""
    return user_sampling(max_tokens, gen.temperature, gen.top_p, gen.top_k, gen.repetition_penalty)
