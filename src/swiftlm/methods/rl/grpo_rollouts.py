"""One GRPO generation: sample groups, score them, compute advantages, lay out micro-batches;
the buffer of steps not yet trained; greedy evaluation; what a generation logs.

Logged per generation (as `step_metrics`, over every rank): reward and reward_std (mean of
the groups' stds), rewards/<name>/mean and /std per function, rewards/<name>/failures,
frac_reward_zero_std (groups whose rewards all agree: their advantages are 0),
completions/mean_length, /min_length, /max_length, /clipped_ratio (stopped by
--max_completion_length). The loss adds kl, clip_ratio and logprob_mismatch (the mean
absolute gap between the engine's and the trainer's log-probs of the sampled tokens).
`completions.jsonl` in the run directory holds every completion with its rewards.
"""

import json
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from swiftlm.engine.protocol import GenerationRequest
from swiftlm.losses.rl import group_advantages, reduce_tokens
from swiftlm.methods.rl.packed_completions import packed_completion_row
from swiftlm.methods.rl.rollout import completion_rows, rollout_seed, sampling_params


@dataclass
class Generation:
    """One generation's completion micro-batches, per optimizer step, and what it logs."""

    steps: list[list[dict]]
    metrics: dict[str, float]


class GenerationBuffer:
    """Optimizer steps of completion micro-batches sampled but not yet trained on."""

    def __init__(self):
        self.steps: list[list[dict]] = []

    @property
    def pending(self) -> bool:
        return bool(self.steps)

    def fill(self, steps: list[list[dict]]) -> None:
        self.steps = list(steps)

    def pop(self) -> list[dict]:
        return self.steps.pop(0)

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


@dataclass
class RolloutParts:
    """What a generation is made with, given by its method (Rollouts reads nothing else).

    args: the grpo section; loss_type: --loss_type (how tokens are averaged); seed: the
    run's seed; run_dir: where completions.jsonl goes. sampler: the engine over the live
    policy (`rollout.PolicySampler`); rewards: the run's `RewardSet`; pad_token_id: the
    tokenizer's; packing: the trainer's forward layout (`grpo.completion_packing`: None,
    "shared" or "separate"). token_logps(model, batch): the trainer's log-prob of each
    sampled token; completion_mask(batch): 1.0 on those tokens; normalizer(batch): the
    batch's share of the step's units (tokens or sequences, as the loss type counts them).
    """

    args: object
    loss_type: str
    seed: int
    run_dir: Path
    sampler: object
    rewards: object
    pad_token_id: int
    packing: str | None
    token_logps: Callable
    completion_mask: Callable
    normalizer: Callable


class Rollouts:
    """Sampling, scoring and batching of GRPO's generations."""

    def __init__(self, parts: RolloutParts, log):
        self.parts, self.log = parts, log
        self.args = parts.args
        self.generations = 0  # generations so far (seeds, resume)
        self.zero_spread_notes = 0
        self.phase = lambda name: nullcontext()  # the loop's step timer, set per generation
        self.completions_file = parts.run_dir / "completions.jsonl"

    # -- a generation --------------------------------------------------------------------------

    def generate(
        self,
        model,
        prompt_steps: list[list[dict]],
        context,
        sampler=None,
        off_policy: bool = False,
    ) -> Generation:
        """Completion micro-batches for the prompt micro-batches of each optimizer step,
        sampled from `model` on `sampler` (default: the run's, over the live policy).
        `off_policy`: the steps train a later policy than `model` (--async_generate), so every
        step keeps `model`'s log-probs for the importance ratio."""
        sampler = sampler or self.parts.sampler
        prompts = [p for step in prompt_steps for batch in step for p in batch["prompts"]]
        rows = [json.loads(p["row"]) for p in prompts]
        self.phase = context.phase
        results = self._sample(sampler, model, prompts, attempt=0)
        scored = self._score(prompts, rows, results)
        if self.args.dynamic_sample:
            results, scored = self._resample_flat_groups(
                sampler, model, prompts, rows, results, scored
            )
        rewards = torch.tensor(scored.total, dtype=torch.float64).view(len(prompts), -1)
        weights = torch.tensor([p["weight"] for p in prompts], dtype=torch.float64)
        advantages = self._advantages(rewards, weights, context.strategy)
        metrics = self._log_generation(
            context, prompts, rows, results, scored, rewards, advantages, weights
        )
        steps, start = [], 0
        for step in prompt_steps:
            batches = []
            for batch in step:
                count = len(batch["prompts"])
                span = slice(start, start + count)
                batches.append(self._micro_batch(prompts[span], results[span], advantages[span]))
                start += count
            steps.append(batches)
        if len(steps) > 1 or off_policy:  # a changed policy trains: keep the sampler's log-probs
            metrics["logprob_mismatch"] = self._add_old_logps(model, steps, context)
        self.generations += 1
        return Generation(steps, metrics)

    def _sample(self, sampler, model, prompts: list[dict], attempt: int, only=None):
        seed = self.parts.seed
        chosen = range(len(prompts)) if only is None else only
        requests = [
            GenerationRequest(
                prompts[i]["prompt_ids"],
                sampling_params(
                    self.args,
                    self.args.num_generations,
                    rollout_seed(seed, self.generations, prompts[i]["prompt_ids"], attempt),
                ),
            )
            for i in chosen
        ]
        with self.phase("generation"):
            return sampler.generate(model, requests)

    def _score(self, prompts, rows, results):
        group = self.args.num_generations
        completions = [s for samples in results for s in samples]
        columns = _columns([row["columns"] for row in rows for _ in range(group)])
        with self.phase("reward"):
            return self.parts.rewards.score(
                [row["prompt"] for row in rows for _ in range(group)],
                [s.text for s in completions],
                [list(s.token_ids) for s in completions],
                columns,
            )

    def _resample_flat_groups(self, sampler, model, prompts, rows, results, scored):
        """--dynamic_sample: sample the groups whose rewards all agree again, new seeds."""
        group = self.args.num_generations
        for attempt in range(1, self.args.max_resample_times + 1):
            totals = torch.tensor(scored.total).view(len(prompts), group)
            flat = [i for i in range(len(prompts)) if bool((totals[i] == totals[i, 0]).all())]
            if not flat:
                break
            again = self._sample(sampler, model, prompts, attempt, only=flat)
            rescored = self._score([prompts[i] for i in flat], [rows[i] for i in flat], again)
            for slot, i in enumerate(flat):
                results[i] = again[slot]
                for name, values in scored.per_function.items():
                    new = rescored.per_function[name][slot * group : (slot + 1) * group]
                    values[i * group : (i + 1) * group] = new
                scored.total[i * group : (i + 1) * group] = rescored.total[
                    slot * group : (slot + 1) * group
                ]
        return results, scored

    def _advantages(self, rewards, weights, strategy) -> torch.Tensor:
        """[prompts, G] advantages; scale_rewards batch uses the std over every rank's real
        completions (padding prompts of an idle rank excluded)."""
        a = self.args
        batch_std = None
        if a.scale_rewards == "batch":
            real = rewards[weights > 0]
            ctx = strategy.ctx
            n = ctx.all_reduce_sum(float(real.numel()))
            total = ctx.all_reduce_sum(float(real.sum()))
            squares = ctx.all_reduce_sum(float((real**2).sum()))
            batch_std = math.sqrt(max(squares - total * total / n, 0.0) / max(n - 1, 1))
        return group_advantages(
            rewards, estimator=a.advantage_estimator, scale=a.scale_rewards, batch_std=batch_std
        ).float()

    def _micro_batch(self, prompts, results, advantages) -> dict:
        prompt_ids = [p["prompt_ids"] for p in prompts for _ in range(self.args.num_generations)]
        samples = [s for group in results for s in group]
        completions = [list(s.token_ids) for s in samples]
        batch = completion_rows(
            prompt_ids,
            completions,
            [[lp.logprob for lp in s.logprobs] for s in samples],
            self.parts.pad_token_id,
        )
        if self.parts.packing:  # the forward reads one packed row; the loss the padded layout
            width = batch.pop("input_ids").shape[1]
            del batch["attention_mask"]
            share = self.parts.packing == "shared"
            batch.update(packed_completion_row(prompt_ids, completions, width, share))
        batch["advantages"] = advantages.reshape(-1)
        weights = [p["weight"] for p in prompts for _ in range(self.args.num_generations)]
        batch["weight"] = torch.tensor(weights, dtype=torch.float32)
        return batch

    @torch.no_grad()
    def _add_old_logps(self, model, steps, context) -> float:
        """The sampling policy's log-probs (the trainer's forward, before any update of this
        generation), for the importance ratio of every step; returns the engine mismatch."""
        loss_type = self.parts.loss_type
        gap, units = 0.0, 0.0
        device = next(model.parameters()).device
        for batches in steps:
            for batch in batches:
                moved = {k: v.to(device) for k, v in batch.items()}
                with context.phase("forward"), context.autocast():
                    logps = self.parts.token_logps(model, moved).cpu()
                batch["old_logps"] = logps
                mask = self.parts.completion_mask(batch)
                gap += float(reduce_tokens((logps - batch["engine_logps"]).abs(), mask, loss_type))
                units += float(self.parts.normalizer(batch))
        ctx = context.strategy.ctx
        units = ctx.all_reduce_sum(units)
        return ctx.all_reduce_sum(gap) / max(units, 1.0)

    # -- evaluation ------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model, prompts: list[dict]):
        """(-sum of rewards, per-function reward sums) of one greedy completion per prompt."""
        rows = [json.loads(p["row"]) for p in prompts]
        requests = [
            GenerationRequest(p["prompt_ids"], sampling_params(self.args, 1, 0, greedy=True))
            for p in prompts
        ]
        results = self.parts.sampler.generate(model, requests)
        completions = [group[0] for group in results]
        scored = self.parts.rewards.score(
            [row["prompt"] for row in rows],
            [s.text for s in completions],
            [list(s.token_ids) for s in completions],
            _columns([row["columns"] for row in rows]),
        )
        weights = torch.tensor([p["weight"] for p in prompts], dtype=torch.float64)
        total = torch.tensor(scored.total, dtype=torch.float64)
        metrics = {
            f"rewards/{name}": (torch.tensor([v or 0.0 for v in values]) * weights).sum()
            for name, values in scored.per_function.items()
        }
        return -(total * weights).sum(), metrics

    # -- what a generation reports ---------------------------------------------------------------

    def _log_generation(
        self, context, prompts, rows, results, scored, rewards, adv, weights
    ) -> dict[str, float]:
        group = self.args.num_generations
        real = weights > 0
        sums: dict[str, float] = {"groups": float(real.sum()), "completions": 0.0}
        stds = rewards.std(dim=1)
        sums["reward"] = float(rewards[real].sum())
        sums["reward_std"] = float(stds[real].sum())
        sums["frac_reward_zero_std"] = float((stds[real] == 0).sum())
        lengths = torch.tensor([len(s.token_ids) for g in results for s in g]).view(-1, group)
        clipped = torch.tensor([s.finish_reason == "length" for g in results for s in g])
        sums["completions"] = float(real.sum()) * group
        sums["length"] = float(lengths[real].sum())
        sums["clipped"] = float(clipped.view(-1, group)[real].sum())
        for name, values in scored.per_function.items():
            matrix = torch.tensor([math.nan if v is None else v for v in values]).view(-1, group)
            ok = matrix[real]
            ok = ok[~ok.isnan()]
            sums[f"{name}/sum"] = float(ok.sum())
            sums[f"{name}/squares"] = float((ok**2).sum())
            sums[f"{name}/count"] = float(ok.numel())
            sums[f"{name}/failures"] = float(scored.failures.get(name, 0))
        ctx = context.strategy.ctx
        totals = {k: ctx.all_reduce_sum(v) for k, v in sums.items()}
        metrics = _generation_metrics(totals, self.parts.rewards.names)
        if bool(real.any()):  # this rank's (the context offers sums only)
            metrics["completions/min_length"] = float(lengths[real].min())
            metrics["completions/max_length"] = float(lengths[real].max())
        if metrics["frac_reward_zero_std"] == 1.0:
            self._explain_zero_loss(context.step)
        self._write_completions(context, rows, results, scored, adv, weights)
        return metrics

    def _explain_zero_loss(self, step: int) -> None:
        self.zero_spread_notes += 1
        if self.zero_spread_notes in (1, 10, 100):
            self.log(
                f"step {step}: every group's completions got the same reward, so every advantage "
                "is 0: the policy-gradient loss is 0 and only the KL term (--beta) moves the "
                "weights. Raise --temperature or --num_generations, use --dynamic_sample, or "
                "make the rewards finer-grained (this note repeats at the 10th and 100th time)"
            )

    def _write_completions(self, context, rows, results, scored, advantages, weights) -> None:
        rank = context.strategy.ctx.rank
        file = self.completions_file
        if rank:
            file = file.with_name(f"completions-rank{rank}.jsonl")
        group = self.args.num_generations
        file.parent.mkdir(parents=True, exist_ok=True)
        with file.open("a", encoding="utf-8") as out:
            for i, (row, samples) in enumerate(zip(rows, results, strict=True)):
                if weights[i] <= 0:
                    continue
                for j, sample in enumerate(samples):
                    k = i * group + j
                    record = {
                        "step": context.step,
                        "generation": self.generations,
                        "prompt": row["prompt"],
                        "completion": sample.text,
                        "finish_reason": sample.finish_reason,
                        "rewards": {n: v[k] for n, v in scored.per_function.items()},
                        "reward": scored.total[k],
                        "advantage": round(float(advantages[i, j]), 6),
                    }
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")

    # -- resume --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"generations": self.generations}

    def load_state_dict(self, state: dict) -> None:
        self.generations = state["generations"]
        for file in self.completions_file.parent.glob("completions*.jsonl"):
            _keep_generations(file, self.generations)


def _columns(per_completion: list[dict]) -> dict[str, list]:
    """Row columns as lists aligned with the completions (None where a row lacks one)."""
    names = sorted({name for columns in per_completion for name in columns})
    return {name: [columns.get(name) for columns in per_completion] for name in names}


def _generation_metrics(totals: dict[str, float], names: list[str]) -> dict[str, float]:
    groups, completions = max(totals["groups"], 1.0), max(totals["completions"], 1.0)
    metrics = {
        "reward": totals["reward"] / completions,
        "reward_std": totals["reward_std"] / groups,
        "frac_reward_zero_std": totals["frac_reward_zero_std"] / groups,
        "completions/mean_length": totals["length"] / completions,
        "completions/clipped_ratio": totals["clipped"] / completions,
    }
    for name in names:
        count = max(totals[f"{name}/count"], 1.0)
        mean = totals[f"{name}/sum"] / count
        variance = max(totals[f"{name}/squares"] / count - mean * mean, 0.0)
        metrics[f"rewards/{name}/mean"] = mean
        metrics[f"rewards/{name}/std"] = math.sqrt(variance)
        metrics[f"rewards/{name}/failures"] = totals[f"{name}/failures"]
    return metrics


def _keep_generations(file: Path, generations: int) -> None:
    """Drop the lines a crashed run wrote after its last checkpoint (resume rewrites them)."""
    lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["generation"] < generations]
    if len(kept) != len(lines):
        file.write_text("".join(kept), encoding="utf-8")
