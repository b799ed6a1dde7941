"""`swiftlm rlhf --rlhf_type grpo`: Group Relative Policy Optimization (and DAPO, Dr. GRPO,
GSPO, RLOO through its flags).

A step: the loop hands over the prompts of the step's micro-batches (`step_batches`); the
policy samples --num_generations completions per prompt with the serving engine on its live
weights (methods/rl/rollout.py); the reward functions score them (methods/rl/rewards.py); each
completion's advantage is its reward against its group's (losses/rl.py); the micro-batches
of completions then go through the loop's usual forward/backward, where `loss` computes the
clipped surrogate (+ beta x KL to the reference) from the trainer's own log-probs.

--per_device_train_batch_size counts completions (as TRL and ms-swift): a micro-batch holds
per_device_train_batch_size / num_generations prompts and their groups. With
--steps_per_generation a multiple k of --gradient_accumulation_steps, one generation samples
the prompts of k/GA optimizer steps and trains on them over those steps (the old policy's
log-probs are computed once, at generation time, for the importance ratio); the steps not
yet trained are `pending` and go into every checkpoint, so a resumed run continues exactly.
With --async_generate the next generation is sampled in the background while one trains
(methods/rl/async_rollouts.py: one generation off-policy, importance ratio logged).

Seeds come from the run seed, the generation's number and the prompt (rollout.rollout_seed):
2 ranks sample what one process samples, a resumed run what the straight one sampled.
Evaluation (--val_dataset / --split_dataset_ratio) samples one greedy completion per prompt
and reports the mean reward as -eval_loss and per function as eval_rewards/<name>.
"""

import contextlib
import dataclasses
import json
from pathlib import Path

import torch

from swiftlm.config import RLHFConfig
from swiftlm.data.encode import IGNORE_INDEX, TruncationReport
from swiftlm.data.prompts import prompt_sample
from swiftlm.errors import ConfigError, DataError
from swiftlm.losses.causal_lm import shifted_labels, token_cross_entropy
from swiftlm.losses.rl import clipped_surrogate, k3_kl, normalizer, reduce_tokens
from swiftlm.methods.base import Batch, EncodeResult, LossOutput, StepContext
from swiftlm.methods.reference import Reference, attention_of
from swiftlm.methods.rl.async_rollouts import AsyncGenerations
from swiftlm.methods.rl.grpo_rollouts import Generation, GenerationBuffer, RolloutParts, Rollouts
from swiftlm.methods.rl.online import (
    SHARDED,
    PromptBatches,
    check_online_layout,
    prompt_ids,
    sharded_by_fsdp2,
)
from swiftlm.methods.rl.packed_completions import packed_token_logps
from swiftlm.methods.rl.rewards import RewardSet
from swiftlm.methods.rl.samplers import (
    check_sampler_layout,
    one_process_layout,
    policy_sampler,
    refuse_given,
)
from swiftlm.methods.token import token_pads
from swiftlm.models.attention import VARLEN


class GRPO(PromptBatches):
    name = "grpo"
    columns = ("prompt_ids", "row", "weight")
    # --padding_free: a micro-batch's completions are trained in one packed row, each
    # prompt computed once (methods/rl/packed_completions.py); prompts batch as ever.
    supports_packing = True
    default_datasets = ("swiftlm/arithmetic",)
    eval_batch_size = 64  # prompts per greedy evaluation call (the engine batches them)

    def __init__(self, cfg: RLHFConfig, tokenizer):
        self.tokenizer = tokenizer
        self.token_pads = token_pads(tokenizer.pad_token_id)
        self.cfg, self.data, self.rlhf, self.args = cfg, cfg.data, cfg.rlhf, cfg.grpo
        _check_layout(cfg)
        # The batch plan counts prompts: a micro-batch is per_device / num_generations of them.
        self.completions_per_sample = self.args.num_generations
        # beta 0: no KL term, so no reference model is loaded or kept.
        self.reference = Reference(cfg, "grpo") if self.rlhf.beta > 0 else None
        self.sampler = policy_sampler(cfg, tokenizer)
        self.rewards: RewardSet | None = None  # built in prepare_model (it logs)
        self.buffer = GenerationBuffer()
        self.rollouts: Rollouts | None = None
        self.metrics: dict[str, float] = {}  # the generation being trained on
        # --async_generate: the next generation, sampled in the background on its own engine.
        self.prefetch: AsyncGenerations | None = None

    # -- data ----------------------------------------------------------------------------------

    def to_sample(self, record: dict) -> dict:
        return prompt_sample(
            record, method="swiftlm rlhf --rlhf_type grpo", system=self.data.system
        )

    def encode(self, samples: list[dict]) -> EncodeResult:
        """Prompt ids (chat template + generation prompt) and the row as JSON for the reward
        functions. A prompt must leave --max_completion_length tokens of --max_length: a
        longer one is dropped and counted, or with --truncation_strategy left keeps its end."""
        budget = self.data.max_length - self.args.max_completion_length
        report = TruncationReport(self.data.truncation_strategy, budget)
        encoded = []
        for sample in samples:
            strategy = self.data.truncation_strategy
            ids = prompt_ids(self.tokenizer, sample["prompt"], budget, strategy, report)
            if ids is None:
                continue
            row = {"prompt": sample["prompt"], "columns": sample["columns"]}
            encoded.append({"prompt_ids": ids, "row": json.dumps(row), "weight": 1.0})
        if not encoded:
            raise DataError(
                f"no prompt fits --max_length {self.data.max_length} minus "
                f"--max_completion_length {self.args.max_completion_length} ({report}); raise "
                "--max_length or lower --max_completion_length"
            )
        return EncodeResult(
            encoded, [report.summary()] if report.summary() else [], report.as_dict()
        )

    def cache_options(self) -> dict:
        d = self.data
        return {
            "method": self.name,
            "max_length": d.max_length,
            "max_completion_length": self.args.max_completion_length,
            "truncation_strategy": d.truncation_strategy,
            "system": d.system,
        }

    def normalizer(self, batch: Batch) -> float | torch.Tensor:
        mask = self.completion_mask(batch)
        return normalizer(
            mask, batch["weight"], self.rlhf.loss_type, self.args.max_completion_length
        )

    def eval_normalizer(self, batch: Batch) -> float:
        """Validation batches are prompts, each answered once: their weight."""
        return float(sum(p["weight"] for p in batch["prompts"]))

    # -- model and steps -------------------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module, log) -> None:
        g, r = self.args, self.rlhf
        epsilon_high = g.epsilon_high if g.epsilon_high is not None else g.epsilon
        log(
            f"grpo: loss_type {r.loss_type}, beta {r.beta}, num_generations {g.num_generations}, "
            f"max_completion_length {g.max_completion_length}, temperature {g.temperature}, "
            f"top_p {g.top_p}, epsilon {g.epsilon}/{epsilon_high}, importance_sampling_level "
            f"{g.importance_sampling_level}, scale_rewards {g.scale_rewards}, "
            f"advantage_estimator {g.advantage_estimator}, steps_per_generation "
            f"{self.steps_per_generation}, reward_funcs {' '.join(g.reward_funcs)}"
        )
        if self.reference is not None:
            self.reference.prepare(model, log)
        else:
            log("grpo: beta 0: no KL term, no reference model")
        self.rewards = RewardSet(g, log)
        parts = RolloutParts(
            args=g,
            loss_type=r.loss_type,
            seed=self.cfg.train.seed,
            run_dir=Path(self.cfg.output.output_dir or "."),
            sampler=self.sampler,
            rewards=self.rewards,
            pad_token_id=self.tokenizer.pad_token_id,
            packing=completion_packing(model, self.cfg.train.padding_free),
            token_logps=self.token_logps,
            completion_mask=self.completion_mask,
            normalizer=self.normalizer,
        )
        self.rollouts = Rollouts(parts, log)
        if g.async_generate:
            self.prefetch = AsyncGenerations(
                self.rollouts, policy_sampler(self.cfg, self.tokenizer)
            )
            log("grpo: --async_generate: each generation samples the next in the background")

    @property
    def steps_per_generation(self) -> int:
        return self.args.steps_per_generation or self.cfg.train.gradient_accumulation_steps

    def step_batches(self, model, context: StepContext) -> list[Batch]:
        """The next optimizer step's micro-batches of completions: pending ones, or a new
        generation over the prompts of the next steps_per_generation / GA optimizer steps
        (with --async_generate: the one sampled in the background, and the next launched)."""
        if not self.buffer.pending:
            generation = self._next_generation(model, context)
            self.buffer.fill(generation.steps)
            self.metrics = generation.metrics
            later = context.steps_left - len(generation.steps)
            if self.prefetch is not None and later > 0:
                ahead = dataclasses.replace(
                    context, step=context.step + len(generation.steps), steps_left=later
                )
                self.prefetch.launch(model, self._draw_generation(ahead), ahead)
        return self.buffer.pop()

    def _next_generation(self, model, context: StepContext) -> Generation:
        if self.prefetch is not None:
            with context.phase("generation"):  # what is left of the background sampling
                prefetched = self.prefetch.take()
            if prefetched is not None:
                return prefetched
        return self.rollouts.generate(model, self._draw_generation(context), context)

    def _draw_generation(self, context: StepContext) -> list[list[Batch]]:
        """The prompt micro-batches of the optimizer steps one generation covers."""
        per_generation = self.steps_per_generation // self.cfg.train.gradient_accumulation_steps
        return [context.draw() for _ in range(min(per_generation, context.steps_left))]

    def step_metrics(self) -> dict[str, float]:
        return self.metrics

    def state_dict(self) -> dict:
        """What was sampled and not yet trained on: the pending steps, and with
        --async_generate the generation in flight (waited for)."""
        prefetched = None
        if self.prefetch is not None:  # first: its end counts the generation in rollouts
            prefetched = self.prefetch.take()
            self.prefetch.keep(prefetched)
        state = {
            "buffer": self.buffer.state_dict(),
            "rollouts": self.rollouts.state_dict(),
            "metrics": self.metrics,
        }
        if prefetched is not None:
            state["prefetched"] = {"steps": prefetched.steps, "metrics": prefetched.metrics}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.rollouts.load_state_dict(state["rollouts"])
        # Checkpoints before the metrics moved here kept them with the rollouts.
        self.metrics = state.get("metrics", state["rollouts"].get("metrics", {}))
        if self.prefetch is not None and "prefetched" in state:
            self.prefetch.keep(Generation(**state["prefetched"]))

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        self.sampler.close()
        if self.rewards:
            self.rewards.close()

    # -- loss ----------------------------------------------------------------------------------

    def evaluate(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        """A prompt micro-batch's greedy completions, scored: -reward sum, reward sums."""
        if self.prefetch is not None:  # the reward workers serve one caller at a time
            self.prefetch.wait()
        return self.rollouts.evaluate(model, batch["prompts"])

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        g, r = self.args, self.rlhf
        logps = self.token_logps(model, batch)
        mask = self.completion_mask(batch).to(logps.device)
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        losses, clipped = clipped_surrogate(
            logps, old, batch["advantages"], mask,
            epsilon_low=g.epsilon,
            epsilon_high=g.epsilon_high if g.epsilon_high is not None else g.epsilon,
            level=g.importance_sampling_level,
        )  # fmt: skip
        metrics = {"clip_ratio": reduce_tokens(clipped, mask, r.loss_type)}
        if "old_logps" in batch:  # the policy trained has moved on from the one that sampled
            ratio = torch.exp(logps.detach() - old)
            metrics["importance_ratio"] = reduce_tokens(ratio, mask, r.loss_type)
        if self.reference is not None:
            with torch.no_grad():
                reference, context = self.reference.module(model)
                ref_logps = self.token_logps(reference, batch, context)
            kl = k3_kl(logps, ref_logps)
            metrics["kl"] = reduce_tokens(kl.detach(), mask, r.loss_type)
        if "old_logps" not in batch:  # the policy that sampled: compare with the engine
            gap = (logps.detach() - batch["engine_logps"]).abs()
            metrics["logprob_mismatch"] = reduce_tokens(gap, mask, r.loss_type)
        if self._corrects_engine:
            weight = truncated_importance_weight(old, batch["engine_logps"], g)
            losses = losses * weight
            metrics["tis_weight"] = reduce_tokens(weight, mask, r.loss_type)
        if self.reference is not None:
            losses = losses + r.beta * kl
        return reduce_tokens(losses, mask, r.loss_type), metrics

    @property
    def _corrects_engine(self) -> bool:
        return self.args.infer_backend == "vllm" and self.args.vllm_importance_sampling_correction

    @staticmethod
    def completion_mask(batch: Batch) -> torch.Tensor:
        """1.0 on the completion tokens of real rows, at the shifted label positions."""
        mask = (shifted_labels(batch["labels"]) != IGNORE_INDEX).float()
        return mask * (batch["weight"] > 0).float().unsqueeze(1)

    def token_logps(self, model, batch: Batch, context=None) -> torch.Tensor:
        """Per position, the log-prob of the next label token under logits / temperature
        (float32, [rows, width], 0 off the labels): what the engine sampled from."""
        if "score_positions" in batch:
            return packed_token_logps(model, batch, self.args.temperature, context)
        with context or contextlib.nullcontext():
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            ).logits
        return -token_cross_entropy(logits.float() / self.args.temperature, batch["labels"])

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, batch: Batch) -> LossOutput:
        raise ConfigError(f"--pipeline_parallel_size: swiftlm rlhf (GRPO): {SHARDED}")


def completion_packing(model, padding_free: bool) -> str | None:
    """How the trainer lays out completions: None (padded rows), "shared" (one packed row,
    each prompt once: needs swiftlm's varlen attention, which reads forks) or "separate"
    (one packed row, a segment per completion: flash-attention's varlen kernel)."""
    if not padding_free:
        return None
    return "shared" if attention_of(model) == VARLEN else "separate"


def truncated_importance_weight(old_logps, engine_logps, args) -> torch.Tensor:
    """Per token, min(exp(trainer log-prob - engine log-prob), cap): the sampling policy's
    probability of the token over vLLM's, which sampled it (TRL's and verl's truncated
    importance sampling); no gradient flows through it."""
    ratio = torch.exp(old_logps.detach() - engine_logps.to(old_logps.device))
    return ratio.clamp(max=args.vllm_importance_sampling_cap)


def _check_layout(cfg: RLHFConfig) -> None:
    """Refuse what GRPO cannot run, before anything loads."""
    g, t = cfg.grpo, cfg.train
    check_online_layout(cfg, "--rlhf_type grpo", lockstep=True)
    check_sampler_layout(cfg)
    if g.dynamic_sample and sharded_by_fsdp2(cfg):
        raise ConfigError(
            "--dynamic_sample: not available with FSDP2 (each rank would resample a different "
            "number of groups, and FSDP2 needs every rank to run the same forwards); use ddp"
        )
    if t.per_device_train_batch_size % g.num_generations:
        raise ConfigError(
            f"--per_device_train_batch_size {t.per_device_train_batch_size}: GRPO counts "
            f"completions per micro-batch (as TRL and ms-swift), so it must be a multiple of "
            f"--num_generations {g.num_generations}, e.g. {g.num_generations}"
        )
    spg = g.steps_per_generation
    if spg is not None and spg % t.gradient_accumulation_steps:
        raise ConfigError(
            f"--steps_per_generation {spg} must be a multiple of --gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps} (a generation covers whole optimizer steps)"
        )
    if g.async_generate:
        _check_async_layout(cfg)


def _check_async_layout(cfg: RLHFConfig) -> None:
    """--async_generate samples from a copy of the whole policy in a background thread of
    the one trainer process, on swiftlm's engine: refuse what that cannot be."""
    refused = {
        **one_process_layout(cfg),
        "--fsdp": bool(cfg.dist.fsdp),
        "--infer_backend vllm": cfg.grpo.infer_backend == "vllm",
    }
    refuse_given(
        refused,
        lambda flag: (
            f"{flag}: not available with --async_generate yet (the next generation "
            "is sampled from a copy of the whole, unquantized policy in a background thread of "
            f"one trainer process, on swiftlm's engine); drop --async_generate or {flag.split()[0]}"
        ),
    )
