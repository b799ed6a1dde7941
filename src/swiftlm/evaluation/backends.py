"""Where answers come from: a local model on swiftlm's engine, or a served one over HTTP.

Tasks talk to a `Backend`, so a local evaluation and one against `--eval_url` run the same
prompts, sampling settings and scoring; only the transport differs. Generation on the local
backend submits every prompt of a task to the continuous-batching engine at once.
Log-likelihood tasks (perplexity, multiple choice) need the model's own forward pass, which
only the local backend has.

`EndpointBackend` is any OpenAI-compatible server (`--eval_url`, and the judge's
`--judge_url`). Conversations go to `/chat/completions` (the server applies its chat template)
and raw-text prompts to `/completions`, several requests in flight at once so that a batching
server (swiftlm deploy, vLLM) batches them. The standard library's HTTP client is enough here,
and keeps this path free of optional dependencies. A client-side problem (bad URL, refused
connection, unknown model, rejected request) stops the evaluation with the server's own
message; a server error is retried twice before it does.
"""

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from swiftlm.engine.config import GenerationArguments
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams, user_sampling
from swiftlm.errors import DataError, SwiftLMError
from swiftlm.evaluation.loglik import ContinuationScore, TextNll, continuation_logprobs, text_nll


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
        # vLLM's engine (--infer_backend vllm) keeps the weights in its own process.
        self.supports_loglikelihood = engine.model is not None

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
        self._need_model("perplexity")
        with _eval_mode(self.engine.model):
            return text_nll(
                self.engine.model, self.tokenizer, texts, self.engine.max_model_len, self.batch_size
            )

    def continuation_logprobs(self, pairs: list[tuple[str, str]]) -> list[ContinuationScore]:
        self._need_model("multiple-choice")
        with _eval_mode(self.engine.model):
            return continuation_logprobs(
                self.engine.model, self.tokenizer, pairs, self.engine.max_model_len, self.batch_size
            )

    def close(self) -> None:
        self.engine.shutdown()

    def _need_model(self, kind: str) -> None:
        if not self.supports_loglikelihood:
            raise SwiftLMError(
                f"--infer_backend vllm: {kind} tasks score given text with the transformers "
                "model, which swiftlm does not hold when vLLM serves it; run them with "
                "--infer_backend pt"
            )


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


RETRIES = 2


class EndpointError(SwiftLMError):
    """The evaluation server cannot be used: unreachable, or it refused a request."""


class EndpointBackend:
    supports_loglikelihood = False

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        concurrency: int = 16,
        timeout_s: float = 600.0,
        flag: str = "--eval_url",
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.flag = flag
        self.model = model or self.first_model()
        self.description = f"{self.model} at {self.base_url}"

    def first_model(self) -> str:
        listed = self._request("GET", "/models", None).get("data") or []
        if not listed:
            raise EndpointError(f"{self.flag} {self.base_url}: the server lists no model")
        return listed[0]["id"]

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int) -> list[str]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda p: self._answer(p, sampling, max_new_tokens), prompts))

    def _answer(self, prompt, sampling: Sampling, max_new_tokens: int) -> str:
        body = {
            "model": self.model,
            "max_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
        }
        # vLLM's extra sampling fields, sent only when set: plain OpenAI servers lack them.
        if sampling.temperature > 0 and sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.repetition_penalty != 1.0:
            body["repetition_penalty"] = sampling.repetition_penalty
        if isinstance(prompt, str):
            reply = self._request("POST", "/completions", {**body, "prompt": prompt})
            return reply["choices"][0]["text"]
        reply = self._request("POST", "/chat/completions", {**body, "messages": prompt})
        return reply["choices"][0]["message"]["content"] or ""

    def chat(self, messages: list[dict], max_tokens: int, temperature: float = 0.0) -> str:
        """One chat answer (the judge's verdict)."""
        sampling = Sampling(max_new_tokens=max_tokens, temperature=temperature, seed=0)
        return self._answer(messages, sampling, max_tokens)

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        url = self.base_url + path
        for attempt in range(RETRIES + 1):
            try:
                return self._send(method, url, body)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode("utf-8", "replace")[:500]
                if exc.code < 500 or attempt == RETRIES:
                    raise EndpointError(
                        f"{self.flag} {self.base_url}: {method} {path} answered {exc.code}: "
                        f"{detail}{_hint(exc.code)}"
                    ) from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise EndpointError(
                    f"{self.flag} {self.base_url}: cannot reach the server ({reason}); is it "
                    "running, and does the URL end with /v1?"
                ) from None
            time.sleep(1.0 + attempt)
        raise AssertionError("unreachable")

    def _send(self, method: str, url: str, body: dict | None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read())

    def text_nll(self, texts):
        raise _no_loglikelihood("perplexity")

    def continuation_logprobs(self, pairs):
        raise _no_loglikelihood("multiple-choice")

    def close(self) -> None:
        pass


def _hint(code: int) -> str:
    if code == 401:
        return " (set --api_key or OPENAI_API_KEY)"
    if code == 404:
        return " (check the URL: it usually ends with /v1, and --model names a served model)"
    return ""


def _no_loglikelihood(kind: str) -> SwiftLMError:
    return EndpointError(
        f"--eval_url: {kind} tasks need the model's log-likelihood of given text, which an "
        "OpenAI-compatible chat server does not return; evaluate them on the local model "
        "(--model/--ckpt_dir) instead"
    )
