"""Inference engines: the `InferEngine` protocol and its transformers implementation.

An engine turns chat conversations into assistant answers. `generate` answers many
conversations at once (batched, left-padded); `stream` yields one answer piece by piece.
"""

import warnings
from collections.abc import Iterator
from threading import Event, Thread
from typing import Protocol

import torch

from swiftlm.config import GenerationArguments, ModelArguments
from swiftlm.errors import ModelLoadError
from swiftlm.infer.resolve import InferenceModel
from swiftlm.models.loader import load_model, load_tokenizer, pick_device, pick_dtype
from swiftlm.models.templates import end_of_turn_token


class InferEngine(Protocol):
    """What the chat and batch front ends need from an engine."""

    generated_tokens: int  # new tokens produced so far (for throughput reports)

    def generate(self, conversations: list[list[dict]], gen: GenerationArguments) -> list[str]: ...

    def stream(self, conversation: list[dict], gen: GenerationArguments) -> Iterator[str]: ...


def build_engine(
    spec: InferenceModel, model_args: ModelArguments, seed: int
) -> "TransformersEngine":
    """Load the model of `spec` (adapters merged in) and its tokenizer; seed sampling once."""
    from transformers import set_seed

    device = pick_device(model_args.device)
    dtype = pick_dtype(spec.torch_dtype, device)
    tokenizer = load_tokenizer(spec.tokenizer_path)
    model = load_model(spec.base_path, dtype, device, model_args.attn_impl)
    model = apply_adapters(model, spec.adapters)
    set_seed(seed)
    return TransformersEngine(model, tokenizer)


def apply_adapters(model, adapters: tuple[str, ...]):
    """Apply each adapter folder in order, merged into the weights.

    Merging makes generation as fast as the plain model (no extra LoRA matmuls) and lets
    several adapters stack; inference never needs them separate.
    """
    if not adapters:
        return model
    from peft import PeftModel

    for folder in adapters:
        try:
            with warnings.catch_warnings():
                # peft calls a transformers API deprecated in v5; the user can do nothing about it.
                warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
                model = PeftModel.from_pretrained(model, folder).merge_and_unload()
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelLoadError(
                f"--adapters {folder}: could not apply this adapter to the base model ({exc}); "
                "was it trained on a different base model? Pass the right one with --model"
            ) from exc
    return model


class TransformersEngine:
    """Generation with a transformers causal LM; `model` and `tokenizer` are ready to use."""

    def __init__(self, model, tokenizer):
        self.model = model.eval()
        self.tokenizer = tokenizer
        # Left padding keeps every prompt's last token at the end, where generation continues.
        self.tokenizer.padding_side = "left"
        self.stop_token_ids = stop_token_ids(tokenizer, model)
        self.generated_tokens = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, conversations: list[list[dict]], gen: GenerationArguments) -> list[str]:
        """Answer each conversation; greedy when `gen.temperature == 0`, else sampled."""
        if not conversations:
            return []
        inputs = self._encode(conversations)
        with torch.inference_mode():
            output = self.model.generate(**inputs, **self._generation_kwargs(gen))
        rows = self._new_tokens(output, inputs["input_ids"].shape[1])
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in rows]

    def stream(self, conversation: list[dict], gen: GenerationArguments) -> Iterator[str]:
        """Yield the answer to one conversation as text pieces while it is generated."""
        from transformers import TextIteratorStreamer

        inputs = self._encode([conversation])
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure: list[BaseException] = []
        cancel = Event()
        kwargs = self._generation_kwargs(gen)

        def produce() -> None:
            try:
                with torch.inference_mode():
                    output = self.model.generate(
                        **inputs, **kwargs, streamer=streamer, stopping_criteria=_until(cancel)
                    )
                self._new_tokens(output, inputs["input_ids"].shape[1])
            except BaseException as exc:  # re-raised in the caller's thread below
                failure.append(exc)
                streamer.end()  # unblock the consumer, which would otherwise wait forever

        thread = Thread(target=produce, daemon=True)
        thread.start()
        try:
            yield from streamer
        finally:
            # The consumer stopped early (Ctrl+C, closed generator): end generation quickly.
            cancel.set()
            thread.join()
        if failure:
            raise failure[0]

    def _encode(self, conversations: list[list[dict]]) -> dict[str, torch.Tensor]:
        texts = [
            self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations
        ]
        # The chat template already writes any BOS token; adding special tokens would double it.
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return {key: value.to(self.device) for key, value in batch.items()}

    def _generation_kwargs(self, gen: GenerationArguments) -> dict:
        kwargs = {
            "max_new_tokens": gen.max_new_tokens,
            "repetition_penalty": gen.repetition_penalty,
            "eos_token_id": self.stop_token_ids,
            "pad_token_id": self.tokenizer.pad_token_id,
            "do_sample": gen.temperature > 0,
        }
        if gen.temperature > 0:
            kwargs.update(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)
        return kwargs

    def _new_tokens(self, output: torch.Tensor, prompt_length: int) -> list[list[int]]:
        """Each row's generated ids up to (not including) its first stop token; counts them."""
        rows = []
        for row in output[:, prompt_length:].tolist():
            stop = next((i for i, t in enumerate(row) if t in self.stop_token_ids), None)
            self.generated_tokens += len(row) if stop is None else stop + 1
            rows.append(row if stop is None else row[:stop])
        return rows


def _until(event: Event):
    """Stopping criteria that end generation once `event` is set."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Cancelled(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = event.is_set()
            return torch.full(
                (input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device
            )

    return StoppingCriteriaList([Cancelled()])


def stop_token_ids(tokenizer, model) -> list[int]:
    """Token ids that end an answer: EOS, the chat template's end-of-turn, the model's EOS."""
    ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))]
    model_eos = getattr(model.generation_config, "eos_token_id", None)
    ids += model_eos if isinstance(model_eos, list) else [model_eos]
    return sorted({i for i in ids if i is not None and i != tokenizer.unk_token_id})
