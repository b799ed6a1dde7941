"""Sampling from the policy being trained, and turning samples into training micro-batches.

`PolicySampler` runs the serving engine (`swiftlm.engine`) over the live policy module: no
copy of the weights, no reload per step. Between optimizer steps the loop thread hands the
engine its requests and waits; the engine's thread runs the forward passes under
inference mode (no autograd) with the KV cache, and the trainer then trains on the result.
With LoRA the engine samples the current policy on merged weights (merged_sampling.py).

`completion_rows` lays out prompt + completion per row, right-padded, with labels on the
completion tokens only (the stop token included, so the policy learns to stop), and puts
per-token values sampled by the engine (its log-probs) at the positions the trainer's
shifted next-token log-probs have.

A sample that fails inside the engine (the others of the batch still finish) stops the run
with `RolloutFailed`, naming the prompt and the sample: a group with a missing completion
has no advantages to train on, and silently dropping it would bias the step.
"""

import dataclasses
import zlib
from contextlib import nullcontext

import torch

from swiftlm.data.collate import collate
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.engine.continuous import ContinuousEngine, stop_token_ids
from swiftlm.engine.protocol import (
    GenerationFailed,
    GenerationRequest,
    SampleResult,
    SamplingParams,
)
from swiftlm.errors import SwiftLMError
from swiftlm.methods.reference import unwrapped
from swiftlm.methods.rl.merged_sampling import merged_adapter_weights

MAX_ENGINE_SEQUENCES = 64  # rows decoded together at most
LOCKSTEP_SEQUENCES = 4096  # lockstep: every request of a call in one group


PROMPT_SHOWN = 200  # characters of a failed prompt quoted in the error


class RolloutFailed(SwiftLMError):
    """A rollout sample failed inside the engine; the message names its prompt."""


def _ignoring_eos(request: GenerationRequest) -> GenerationRequest:
    return dataclasses.replace(request, params=dataclasses.replace(request.params, ignore_eos=True))


class PolicySampler:
    """The continuous-batching engine over the policy, built at the first call.

    `lockstep` (a policy sharded with FSDP2): every forward gathers weights from all ranks,
    so every rank must run the same number of forwards. Then all requests are prefilled as
    one group in one chunk, and every sample decodes all its max_tokens (end-of-turn tokens
    ignored); each sample is cut after its first stop token afterwards. The tokens up to
    there are those of a normal run (same seeds); the rest is compute spent for the lockstep.
    """

    def __init__(self, tokenizer, max_model_len: int, lockstep: bool = False):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.lockstep = lockstep
        self.engine: ContinuousEngine | None = None

    def generate(self, model, requests: list[GenerationRequest]) -> list[list[SampleResult]]:
        policy = unwrapped(model)
        was_training = policy.training
        engine = self._engine(policy)
        if self.lockstep:
            requests = [_ignoring_eos(request) for request in requests]
        # FSDP2's sharded weights cannot be merged per rank: lockstep samples through the adapter.
        merged = nullcontext() if self.lockstep else merged_adapter_weights(policy)
        try:
            policy.eval()
            with merged:
                results = engine.generate(requests)
        except GenerationFailed as exc:
            raise rollout_failed(self.tokenizer, requests, exc) from exc
        finally:
            policy.train(was_training)
        if self.lockstep:
            stops = set(engine.stop_token_ids)
            results = [[self._cut(sample, stops) for sample in group] for group in results]
        return results

    def _cut(self, sample: SampleResult, stops: set[int]) -> SampleResult:
        """The sample up to and with its first stop token (as the engine would have ended it)."""
        ends = [i for i, token in enumerate(sample.token_ids) if token in stops]
        if not ends:
            return sample
        end = ends[0]
        return SampleResult(
            sample.index,
            sample.token_ids[: end + 1],
            self.tokenizer.decode(sample.token_ids[:end]),
            sample.logprobs[: end + 1],
            "stop",
        )

    def _engine(self, policy) -> ContinuousEngine:
        if self.engine is None or self.engine.model is not policy:
            self.close()
            lockstep = self.lockstep
            self.engine = ContinuousEngine(
                policy,
                self.tokenizer,
                stop_token_ids=stop_token_ids(self.tokenizer, policy),
                # The KV cache grows only as rows run; lockstep admits everything at once.
                max_num_seqs=LOCKSTEP_SEQUENCES if lockstep else MAX_ENGINE_SEQUENCES,
                max_model_len=self.max_model_len,
                prefill_chunk_tokens=LOCKSTEP_SEQUENCES * self.max_model_len if lockstep else 4096,
                inference_mode=not lockstep,
            )
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def rollout_failed(tokenizer, requests: list[GenerationRequest], exc: GenerationFailed):
    """The run-stopping error for a generation with failed samples, naming the first."""
    index = min(exc.failures)
    samples = exc.results[index]
    sample = next((s.index for s in samples if s.error), 0)
    prompt = tokenizer.decode(requests[index].prompt_ids, skip_special_tokens=True)
    if len(prompt) > PROMPT_SHOWN:
        prompt = prompt[:PROMPT_SHOWN] + "..."
    return RolloutFailed(
        f"sampling completions failed for {len(exc.failures)} of {len(requests)} prompts; "
        "a group missing a completion has no advantages to train on, so the run stops. "
        f"The first: sample {sample} of the prompt {prompt!r} failed with "
        f"{exc.failures[index]} (the engine's log has its traceback); the last saved "
        "checkpoint is intact"
    )


def sampling_params(grpo_args, n: int, seed: int, greedy: bool = False) -> SamplingParams:
    """The rollout's sampling; log-probs of the temperature-scaled logits (what the trainer
    recomputes), so the two can be compared."""
    g = grpo_args
    return SamplingParams(
        max_tokens=g.max_completion_length,
        temperature=0.0 if greedy else g.temperature,
        top_p=1.0 if greedy else g.top_p,
        n=n,
        seed=seed,
        logprobs=True,
        logprobs_mode="scaled",
    )


def rollout_seed(run_seed: int, generation: int, prompt_ids: list[int], attempt: int = 0) -> int:
    """A request's seed from the run seed, the generation's number and the prompt itself: the
    same prompt samples the same completions whatever rank or micro-batch it lands in, so a
    run on 2 ranks samples what one process samples, and a resumed run what it would have."""
    digest = zlib.crc32(torch.tensor(prompt_ids, dtype=torch.int64).numpy().tobytes())
    return (run_seed * 1_000_003 + generation * 7_919 + attempt * 104_729 + digest) % (2**62)


def completion_rows(
    prompts: list[list[int]],
    completions: list[list[int]],
    engine_logps: list[list[float]],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, labels (completion tokens only) and engine_logps, the
    engine's log-prob of each completion token at its label's shifted position [rows, W]."""
    rows = [
        {"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + c}
        for p, c in zip(prompts, completions, strict=True)
    ]
    batch = collate(rows, pad_token_id)
    width = batch["input_ids"].shape[1]
    placed = torch.zeros((len(rows), width), dtype=torch.float32)
    for row, (prompt, logps) in enumerate(zip(prompts, engine_logps, strict=True)):
        # Position t holds the log-prob of token t + 1 (losses.causal_lm.shifted_labels).
        start = len(prompt) - 1
        placed[row, start : start + len(logps)] = torch.tensor(logps, dtype=torch.float32)
    batch["engine_logps"] = placed
    return batch
