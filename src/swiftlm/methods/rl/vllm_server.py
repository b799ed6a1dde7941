"""Rollouts on a `swiftlm rollout` server (`--infer_backend vllm --vllm_mode server`).

`VllmServerSampler` has `rollout.PolicySampler`'s interface. Its first call waits for the
server (`GET /health`, up to --vllm_server_timeout: it may still be loading), checks the
served model has the policy's vocabulary, and joins the server's vLLM workers in a process
group of their own (`engine.vllm_weight_sync`). Before every generation it pushes the
policy's weights, LoRA merged (`vllm_rollout.merged_state_dict`), over that group, then
sends the prompts as token ids with their `SamplingParams`; the server answers with the
samples and vLLM's log-probs ("scaled": what the trainer recomputes), so GRPO's mismatch
metric and its truncated importance sampling work as in colocate mode.

HTTP is the standard library's: the calls are few and large, one trainer at a time.
"""

import dataclasses
import json
import time
import urllib.error
import urllib.request

from swiftlm.engine.protocol import GenerationFailed, GenerationRequest, SampleResult, TokenLogprob
from swiftlm.engine.vllm_weight_sync import TrainerSide, bucket_specs, buckets
from swiftlm.errors import ConfigError
from swiftlm.methods.reference import unwrapped
from swiftlm.methods.rl.rollout import rollout_failed
from swiftlm.methods.rl.vllm_rollout import merged_state_dict

HEALTH_POLL_S = 2.0


class RolloutServerError(ConfigError):
    """The rollout server could not be reached, or refused a call; the message says which."""


class VllmServerSampler:
    def __init__(self, tokenizer, args):
        self.tokenizer = tokenizer
        self.host, self.port = args.vllm_server_host, args.vllm_server_port
        self.group_port = args.vllm_group_port
        self.timeout = args.vllm_server_timeout
        self.url = f"http://{self.host}:{self.port}"
        self.group: TrainerSide | None = None
        self.syncs = 0  # weight pushes so far

    def generate(self, model, requests: list[GenerationRequest]) -> list[list[SampleResult]]:
        policy = unwrapped(model)
        if self.group is None:
            self._connect(policy)
        self._push(policy)
        body = {
            "requests": [
                {"prompt_ids": list(r.prompt_ids), "params": dataclasses.asdict(r.params)}
                for r in requests
            ]
        }
        answer = self._call("POST", "/generate/", body)
        results = [[_sample(s) for s in samples] for samples in answer["results"]]
        failures = {
            i: next(s.error for s in samples if s.error)
            for i, samples in enumerate(results)
            if any(s.error for s in samples)
        }
        if failures:
            exc = GenerationFailed(results, failures)
            raise rollout_failed(self.tokenizer, requests, exc) from exc
        return results

    def _connect(self, policy) -> None:
        self._wait_healthy()
        info = self._call("GET", "/info/")
        vocab = policy.get_input_embeddings().weight.shape[0]
        if info["vocab_size"] != vocab:
            raise RolloutServerError(
                f"--vllm_server_host {self.host} --vllm_server_port {self.port}: the server "
                f"serves {info['model']} with a vocabulary of {info['vocab_size']}, the policy "
                f"has {vocab}; start `swiftlm rollout --model` on the model this run trains"
            )
        device = next(policy.parameters()).device.type
        init = {"group_port": self.group_port, "trainer_device": device, "timeout_s": self.timeout}
        started = self._call("POST", "/weights/init/", init)
        self.group = TrainerSide(
            self.host, self.group_port, started["workers"], started["backend"], self.timeout
        )
        self._call("POST", "/weights/wait/")
        print(
            f"rollouts on {info['model']} at {self.url} ({info['device']}, "
            f"{started['workers']} vLLM worker(s), weights over {started['backend']})",
            flush=True,
        )

    def _push(self, policy) -> None:
        state = merged_state_dict(policy)
        cut = buckets(state)
        self._call("POST", "/weights/update/", {"buckets": [bucket_specs(state, b) for b in cut]})
        for names in cut:
            self.group.push(state, names)
        self._call("POST", "/weights/wait/")
        self.syncs += 1

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._call("GET", "/health")
                return
            except RolloutServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(HEALTH_POLL_S)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            raise RolloutServerError(
                f"rollout server {self.url}{path} answered {exc.code}: {message}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RolloutServerError(
                f"--vllm_server_host {self.host} --vllm_server_port {self.port}: no rollout "
                f"server answers {path} ({reason}); start one with `swiftlm rollout --model "
                f"<the model this run trains> --port {self.port}`"
            ) from None

    def close(self) -> None:
        """Leave the weight-sync group, on the server's side first (its port is then free
        for the next trainer); a server already gone is no error."""
        if self.group is None:
            return
        try:
            self._call("POST", "/weights/close/")
        except RolloutServerError as exc:
            print(f"rollouts: could not close the weight sync ({exc})", flush=True)
        self.group.close()
        self.group = None


def _sample(raw: dict) -> SampleResult:
    """A sample as the server sends it: its log-probs (when asked for) one per token."""
    logprobs = raw["logprobs"] and zip(raw["token_ids"], raw["logprobs"], strict=True)
    return SampleResult(
        index=raw["index"],
        token_ids=raw["token_ids"],
        text=raw["text"],
        logprobs=[TokenLogprob(token, logprob) for token, logprob in logprobs or ()],
        finish_reason=raw["finish_reason"],
        error=raw["error"],
    )


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return exc.reason
