"""`swiftlm rlhf --rlhf_type gkd`: on-policy distillation (Generalized Knowledge Distillation,
Agarwal et al. 2024; TRL's GKDTrainer).

The student (the trained model) learns the teacher's (--teacher_model, frozen) next-token
distributions on completions: loss = sum over completion tokens of the generalized JSD
(losses/distill.py, --beta: 0 forward KL, 1 reverse KL), divided by the completion tokens of
the optimizer step (token mean, exact under gradient accumulation and data parallel: the
loop divides by the normalizer summed over micro-batches and ranks).

Which completions, per optimizer step:
- on-policy, with probability --lmbda: the student samples one completion per prompt with
  the serving engine on its live weights (--temperature, --top_p, --max_completion_length);
- otherwise the dataset's reference answers, or with --seq_kd the teacher's samples.
The draw is `on_policy_step(--seed, step)`: every rank and a resumed run take the same
decision. Sampling seeds follow (--seed, step, prompt) as GRPO's (rollout.rollout_seed).
Completions are made and trained within their step, so a checkpoint holds nothing pending.

Logged: loss (the JSD per completion token), on_policy (1 on a sampled step, 0 otherwise;
its window mean is the share), completions/mean_length. Evaluation scores the JSD on the
validation rows' reference answers (rows without one add nothing).
"""

import random

import torch

from swiftlm.config import RLHFConfig
from swiftlm.data.encode import IGNORE_INDEX, TruncationReport, encode_chat
from swiftlm.data.prompts import prompt_sample
from swiftlm.data.rows import RowError
from swiftlm.engine.protocol import GenerationRequest
from swiftlm.errors import ConfigError, DataError
from swiftlm.losses.causal_lm import shifted_labels
from swiftlm.losses.distill import generalized_jsd_loss
from swiftlm.methods.base import Batch, EncodeResult, LossOutput, StepContext
from swiftlm.methods.reference import load_reference, unwrapped
from swiftlm.methods.rl.online import (
    SHARDED,
    PromptBatches,
    check_online_layout,
    prompt_ids,
)
from swiftlm.methods.rl.rollout import PolicySampler, completion_rows, rollout_seed, sampling_params
from swiftlm.methods.rl.samplers import check_sampler_layout, policy_sampler
from swiftlm.methods.token import token_pads

METHOD = "swiftlm rlhf --rlhf_type gkd"


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` trains on the student's samples: a uniform draw u in
    [0, 1) from (seed, step) alone, on-policy when u < lmbda (lmbda 0: never, 1: always)."""
    return random.Random(f"gkd:{seed}:{step}").random() < lmbda


class GKD(PromptBatches):
    name = "gkd"
    columns = ("prompt_ids", "response_ids", "weight")
    supports_packing = False
    default_datasets = ()

    def __init__(self, cfg: RLHFConfig, tokenizer):
        self.tokenizer = tokenizer
        self.token_pads = token_pads(tokenizer.pad_token_id)
        self.cfg, self.data, self.rlhf = cfg, cfg.data, cfg.rlhf
        self.args, self.gkd = cfg.grpo, cfg.gkd  # sampling flags, teacher flags
        check_online_layout(cfg, METHOD)
        check_sampler_layout(cfg)
        self.sampler = policy_sampler(cfg, tokenizer)  # the student's on-policy samples
        # The frozen teacher's samples (--seq_kd) on swiftlm's engine: its weights never change.
        self.teacher_sampler = PolicySampler(tokenizer, cfg.data.max_length)
        self.teacher: torch.nn.Module | None = None  # loaded in prepare_model
        self.metrics: dict[str, float] = {}

    # -- data ----------------------------------------------------------------------------------

    @property
    def needs_answers(self) -> bool:
        """Some steps train on the dataset's answers: lmbda < 1 without --seq_kd."""
        return self.gkd.lmbda < 1.0 and not self.gkd.seq_kd

    def to_sample(self, record: dict) -> dict:
        sample = prompt_sample(record, method=METHOD, system=self.data.system)
        if sample["response"] is None and self.needs_answers:
            raise RowError(
                "no answer",
                f"no reference answer: with --lmbda {self.gkd.lmbda} the off-policy steps train "
                "on the dataset's answers; end `messages` with an assistant turn (or give "
                "`completion`/`response`/`output`), or pass --lmbda 1 (always on-policy) or "
                "--seq_kd (the teacher answers)",
            )
        return sample

    def encode(self, samples: list[dict]) -> EncodeResult:
        """Prompt ids (chat template + generation prompt) and the reference answer's tokens
        (its end-of-turn token included, as a sampled completion ends; [] without one), cut
        to --max_completion_length. A prompt must leave --max_completion_length tokens of
        --max_length: a longer one is dropped and counted, or with --truncation_strategy
        left keeps its end."""
        budget = self.data.max_length - self.args.max_completion_length
        report = TruncationReport(self.data.truncation_strategy, budget)
        encoded, cut = [], 0
        for sample in samples:
            strategy = self.data.truncation_strategy
            ids = prompt_ids(self.tokenizer, sample["prompt"], budget, strategy, report)
            if ids is None:
                continue
            answer = self._answer_ids(sample["prompt"], sample["response"])
            cut += len(answer) > self.args.max_completion_length
            answer = answer[: self.args.max_completion_length]
            encoded.append({"prompt_ids": ids, "response_ids": answer, "weight": 1.0})
        if not encoded:
            raise DataError(
                f"no prompt fits --max_length {self.data.max_length} minus "
                f"--max_completion_length {self.args.max_completion_length} ({report}); raise "
                "--max_length or lower --max_completion_length"
            )
        log = [report.summary()] if report.summary() else []
        if cut:
            log.append(
                f"gkd: {cut} reference answers cut to --max_completion_length "
                f"{self.args.max_completion_length} tokens (raise it to train on whole answers)"
            )
        return EncodeResult(encoded, log, {**report.as_dict(), "answers_cut": cut})

    def _answer_ids(self, prompt: list[dict], response: str | None) -> list[int]:
        """The label tokens of the answer turn, as SFT trains them (encode_chat, last turn)."""
        if response is None:
            return []
        turn = [*prompt, {"role": "assistant", "content": response}]
        labels = encode_chat(self.tokenizer, turn, scope="last_turn")["labels"]
        return [t for t in labels if t != IGNORE_INDEX]

    def cache_options(self) -> dict:
        d = self.data
        return {
            "method": self.name,
            "max_length": d.max_length,
            "max_completion_length": self.args.max_completion_length,
            "truncation_strategy": d.truncation_strategy,
            "system": d.system,
            "needs_answers": self.needs_answers,  # to_sample refuses rows without one
        }

    def normalizer(self, batch: Batch) -> float | torch.Tensor:
        """Completion tokens of the real rows."""
        return self.completion_mask(batch).sum()

    def eval_normalizer(self, batch: Batch) -> float:
        """Validation batches are prompts: the tokens of their reference answers."""
        return float(sum(len(p["response_ids"]) for p in batch["prompts"] if p["weight"] > 0))

    # -- model and steps -----------------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module, log) -> None:
        g, k = self.args, self.gkd
        log(
            f"gkd: beta {self.rlhf.beta}, lmbda {k.lmbda}, seq_kd {k.seq_kd}, gkd_logits_topk "
            f"{k.gkd_logits_topk}, max_completion_length {g.max_completion_length}, "
            f"temperature {g.temperature}, top_p {g.top_p}"
        )
        self.teacher = load_teacher(k.teacher_model, model, self.cfg.model.attn_impl)
        log(f"gkd: teacher = --teacher_model {k.teacher_model} (frozen)")

    def step_batches(self, model, context: StepContext) -> list[Batch]:
        """The next optimizer step's completion micro-batches: the student's samples (on-policy
        step), the teacher's (--seq_kd) or the dataset's answers."""
        prompt_batches = context.draw()
        on_policy = on_policy_step(self.cfg.train.seed, context.step, self.gkd.lmbda)
        prompts = [p for batch in prompt_batches for p in batch["prompts"]]
        if on_policy:
            with context.phase("generation"):
                completions = self._sample(self.sampler, model, prompts, context.step)
        elif self.gkd.seq_kd:
            with context.phase("generation"):
                completions = self._sample(
                    self.teacher_sampler, self.teacher, prompts, context.step
                )
        else:
            completions = [list(p["response_ids"]) for p in prompts]
        self._log_step(context, on_policy, prompts, completions)
        batches, start = [], 0
        for batch in prompt_batches:
            count = len(batch["prompts"])
            span = slice(start, start + count)
            batches.append(self._micro_batch(prompts[span], completions[span]))
            start += count
        return batches

    def _sample(self, sampler, model, prompts: list[dict], step: int) -> list[list[int]]:
        """One completion per prompt; the seed follows (--seed, step, prompt)."""
        seed = self.cfg.train.seed
        requests = [
            GenerationRequest(
                p["prompt_ids"],
                sampling_params(self.args, 1, rollout_seed(seed, step, p["prompt_ids"])),
            )
            for p in prompts
        ]
        return [list(group[0].token_ids) for group in sampler.generate(model, requests)]

    def _micro_batch(self, prompts: list[dict], completions: list[list[int]]) -> Batch:
        batch = completion_rows(
            [p["prompt_ids"] for p in prompts],
            completions,
            [[0.0] * len(c) for c in completions],
            self.tokenizer.pad_token_id,
        )
        del batch["engine_logps"]  # the loss compares distributions, not sampled log-probs
        batch["weight"] = torch.tensor([p["weight"] for p in prompts], dtype=torch.float32)
        return batch

    def _log_step(self, context, on_policy: bool, prompts, completions) -> None:
        real = [len(c) for p, c in zip(prompts, completions, strict=True) if p["weight"] > 0]
        ctx = context.strategy.ctx
        count = ctx.all_reduce_sum(float(len(real)))
        length = ctx.all_reduce_sum(float(sum(real)))
        self.metrics = {
            "on_policy": 1.0 if on_policy else 0.0,
            "completions/mean_length": length / max(count, 1.0),
        }

    def step_metrics(self) -> dict[str, float]:
        return dict(self.metrics)

    def state_dict(self) -> dict:
        """Nothing is pending between steps; the last step's figures only."""
        return {"metrics": self.metrics}

    def load_state_dict(self, state: dict) -> None:
        self.metrics = dict(state.get("metrics", {}))

    def close(self) -> None:
        self.sampler.close()
        self.teacher_sampler.close()

    # -- loss ----------------------------------------------------------------------------------

    def evaluate(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        """The loss on a prompt micro-batch's reference answers."""
        prompts = batch["prompts"]
        answers = self._micro_batch(prompts, [list(p["response_ids"]) for p in prompts])
        device = next(unwrapped(model).parameters()).device
        return self.loss(model, {k: v.to(device) for k, v in answers.items()})

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        """(sum over completion tokens of the generalized JSD(teacher, student), {})."""
        mask = self.completion_mask(batch)
        student = _logits(model, batch)
        with torch.no_grad():
            teacher = _logits(self.teacher, batch)
        losses = generalized_jsd_loss(
            student, teacher, mask, self.rlhf.beta, self.args.temperature, self.gkd.gkd_logits_topk
        )
        return losses.sum(), {}

    @staticmethod
    def completion_mask(batch: Batch) -> torch.Tensor:
        """1.0 at the positions whose next token is a completion token of a real row."""
        mask = (shifted_labels(batch["labels"]) != IGNORE_INDEX).float()
        return mask * (batch["weight"] > 0).float().unsqueeze(1).to(mask.device)

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, batch: Batch) -> LossOutput:
        raise ConfigError(f"--pipeline_parallel_size: {METHOD}: {SHARDED}")


def _logits(model, batch: Batch) -> torch.Tensor:
    return model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits


def load_teacher(path: str, policy: torch.nn.Module, attn_impl: str) -> torch.nn.Module:
    """--teacher_model, frozen, in the student's weight dtype on its device. The loss compares
    the two next-token distributions entry by entry, so the vocabularies must be the same:
    another size is refused before any teacher weight loads."""
    from transformers import AutoConfig

    from swiftlm.models.loader import resolve_model

    teacher_vocab = AutoConfig.from_pretrained(resolve_model(path).path).vocab_size
    vocab = unwrapped(policy).config.vocab_size
    if teacher_vocab != vocab:
        raise ConfigError(
            f"--teacher_model {path}: its vocabulary has {teacher_vocab} tokens, the student's "
            f"(--model) {vocab}; GKD compares the two next-token distributions token by token, "
            "so the teacher needs the student's tokenizer: pick a teacher of the same model "
            "family"
        )
    return load_reference(path, policy, attn_impl)
