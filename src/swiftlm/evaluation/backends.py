"""Where answers come from: a local model on swiftlm's engine, or a served one over HTTP.

Tasks talk to a `Backend`, so a local evaluation and one against `--eval_url` run the same
prompts, sampling settings and scoring; only the transport differs. Generation on the local
backend submits every prompt of a task to the continuous-batching engine at once.
Log-likelihood tasks (perplexity, multiple choice) need the model's own forward pass, which
only the local backend has.
"""

from dataclasses import dataclass
from typing import Protocol

from swiftlm.config.sections_infer import GenerationArguments
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams, user_sampling
from swiftlm.errors import DataError
from swiftlm.eval.loglik import ContinuationScore, TextNll, continuation_logprobs, text_nll


@dataclass(frozen=True)
class Sampling:
    """How answers are sampled: `--temperature` etc. (greedy at temperature 0)."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 42

    @classmethod
    def from_flags(cls, gen: GenerationArguments, seed: int) -> "Sampling":
        """The generation flags of `infer` and `eval` (--max_new_tokens ...) and --seed."""
        return cls(
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            repetition_penalty=gen.repetition_penalty,
            seed=seed,
        )

    def engine_params(self, max_tokens: int) -> SamplingParams:
        return user_sampling(
            max_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.repetition_penalty,
            self.seed,
        )


class PromptTooLong(DataError):
    """A prompt that fills the model's context: no room for an answer."""

    def __init__(self, index: int, tokens: int, limit: int):
        self.index = index
        super().__init__(
            f"a prompt of {tokens} tokens leaves no room to answer within the model's context "
            f"of {limit} tokens; shorten it or leave it out of the task"
        )


class Backend(Protocol):
    description: str
    supports_loglikelihood: bool

    def generate(
        self, prompts: list[list[dict] | str], sampling: Sampling, max_new_tokens: int
    ) -> list[str]:
        """An answer per prompt, in order: a conversation (chat template) or raw text."""
        ...

    def text_nll(self, texts: list[str]) -> list[TextNll]: ...

    def continuation_logprobs(self, pairs: list[tuple[str, str]]) -> list[ContinuationScore]: ...

    def close(self) -> None: ...


class LocalBackend:
    """A model on swiftlm's continuous-batching engine (the one `infer` and `deploy` use)."""

    supports_loglikelihood = True

    def __init__(self, engine: ContinuousEngine, description: str, batch_size: int = 8):
        self.engine = engine
        self.description = description
        self.batch_size = batch_size

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, prompt: list[dict] | str) -> list[int]:
        """A conversation through the chat template (which writes any BOS token itself), or
        raw text tokenized as is."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        text = self.tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int) -> list[str]:
        requests = []
        for index, prompt in enumerate(prompts):
            ids = self.encode(prompt)
            room = self.engine.max_model_len - len(ids)
            if room < 1:
                raise PromptTooLong(index, len(ids), self.engine.max_model_len)
            params = sampling.engine_params(min(max_new_tokens, room))
            requests.append(GenerationRequest(ids, params))
        return [samples[0].text for samples in self.engine.generate(requests)]

    def text_nll(self, texts: list[str]) -> list[TextNll]:
        with _eval_mode(self.engine.model):
            return text_nll(
                self.engine.model, self.tokenizer, texts, self.engine.max_model_len, self.batch_size
            )

    def continuation_logprobs(self, pairs: list[tuple[str, str]]) -> list[ContinuationScore]:
        with _eval_mode(self.engine.model):
            return continuation_logprobs(
                self.engine.model, self.tokenizer, pairs, self.engine.max_model_len, self.batch_size
            )

    def close(self) -> None:
        self.engine.shutdown()


class _eval_mode:
    """Dropout off while scoring; a model being trained goes back to training mode after."""

    def __init__(self, model):
        self.model = model
        self.was_training = model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)
        return False
