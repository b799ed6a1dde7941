"""The training loop. Every method (SFT, pre-training, later DPO ...) runs through here and
differs only by its data and its `loss_fn(model, batch) -> (loss_sum, metrics)`.

One optimizer step = `gradient_accumulation_steps` micro-batches. Each micro-batch's loss SUM
is divided by the label tokens of the whole step before backward, so the accumulated gradient
is the gradient of the mean token loss over the step, whatever the split into micro-batches.
"""

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swiftlm.config.sections import OutputArguments, TrainArguments
from swiftlm.data.collate import collate, collate_packed, count_input_tokens
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.distributed.heartbeat import Heartbeat
from swiftlm.distributed.strategy import Strategy
from swiftlm.errors import SwiftLMError
from swiftlm.losses.causal_lm import count_label_tokens
from swiftlm.monitor.metrics import MetricsLogger, Progress, Throughput, peak_memory_gib
from swiftlm.train import checkpoint as ckpt
from swiftlm.train.batching import (
    BatchPlan,
    DataPosition,
    GlobalBatch,
    iterate_steps,
    steps_in_epoch,
    total_steps,
)
from swiftlm.train.optim import build_optimizer, build_scheduler

LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]


class NonFiniteLossError(SwiftLMError):
    """The loss became NaN/inf and --nonfinite_loss is `error`."""


@dataclass
class TrainingJob:
    """Everything the loop needs; built by a command such as `swiftlm sft`."""

    model: torch.nn.Module
    tokenizer: object
    loss_fn: LossFn
    train_data: list[dict]
    val_data: list[dict]
    device: torch.device
    compute_dtype: torch.dtype
    args: TrainArguments
    output: OutputArguments
    run_dir: Path
    strategy: Strategy = None  # type: ignore[assignment]  # set by the command
    heartbeat: Heartbeat | None = None  # hang detection across ranks
    batch_plan: BatchPlan | None = None  # default: fixed-size batches of unpacked samples
    flops_per_token: float = 0.0  # training FLOPs per token, for MFU (0: not reported)
    peak_flops: float = 0.0  # of all devices of the job together
    log: Callable[[str], None] = print


@dataclass
class LoopState:
    """What a checkpoint stores besides tensors."""

    step: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    tokens_seen: int = 0
    label_tokens_seen: int = 0
    train_seconds: float = 0.0
    last_loss: float | None = None
    last_eval_loss: float | None = None
    skipped_steps: int = 0

    def to_json(self, num_samples: int, scheduler, scaler) -> dict:
        return {
            "step": self.step,
            "epoch": self.position.epoch,
            "micro_batch": self.position.micro_batch,
            "tokens_seen": self.tokens_seen,
            "label_tokens_seen": self.label_tokens_seen,
            "train_seconds": self.train_seconds,
            "last_loss": self.last_loss,
            "last_eval_loss": self.last_eval_loss,
            "skipped_steps": self.skipped_steps,
            "num_train_samples": num_samples,
            "scheduler": scheduler.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
        }


class Precision:
    """Autocast to the compute dtype; fp16 adds dynamic loss scaling."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def default_batch_plan(job: TrainingJob) -> BatchPlan:
    return BatchPlan(
        lengths=tuple(len(s["input_ids"]) for s in job.train_data),
        batch_size=job.args.per_device_train_batch_size,
        dp_size=job.strategy.dp_size,
        seed=job.args.seed,
    )


def _masked_copy(sample: dict) -> dict:
    return {**sample, "labels": [IGNORE_INDEX] * len(sample["labels"])}


def rank_batches(job: TrainingJob, step_batches: list[GlobalBatch]) -> list[dict]:
    """This rank's share of each global micro-batch, as tensors.

    A rank whose share of a short last micro-batch is empty still runs a fully masked sample:
    it adds nothing to the loss but keeps the collectives of every rank in step.
    """
    plan, rank, pad = job.batch_plan, job.strategy.dp_rank, job.tokenizer.pad_token_id
    packed = plan.packs is not None or plan.padding_free
    batches = []
    for global_batch in step_batches:
        rows = global_batch[rank] if rank < len(global_batch) else []
        samples = [[job.train_data[i] for i in row] for row in rows]
        if not samples:
            samples = [[_masked_copy(job.train_data[global_batch[0][0][0]])]]
        if plan.padding_free:
            batches.append(collate_packed([[s for row in samples for s in row]], pad))
        elif packed:
            batches.append(collate_packed(samples, pad))
        else:
            batches.append(collate([row[0] for row in samples], pad))
    return batches


def _data_sum(strategy, value: float) -> float:
    """Sum a per-rank figure over the data: ranks that share a batch (tensor parallel) hold
    the same value, so the world sum counts it once per replica."""
    replicas = strategy.ctx.world_size // strategy.dp_size
    return strategy.ctx.all_reduce_sum(value) / replicas


def forward_backward(
    job: TrainingJob, precision: Precision, batches: list[dict]
) -> tuple[float, int, int]:
    """Accumulate gradients of one optimizer step; return (mean loss, label tokens, tokens).

    Every micro-batch's loss sum is divided by the label tokens of the whole step on all
    ranks. Data-parallel wrappers average gradients over ranks, so the loss is also multiplied
    by their number: the result is the gradient of the global mean token loss.
    """
    strategy = job.strategy
    label_tokens = _data_sum(strategy, sum(count_label_tokens(b["labels"]) for b in batches))
    scale = strategy.dp_size / max(label_tokens, 1)
    local_loss = 0.0
    for i, batch in enumerate(batches):
        with strategy.no_sync(job.model, sync=i == len(batches) - 1):
            with precision.autocast():
                loss_sum, _ = job.loss_fn(job.model, _to_device(batch, job.device))
            strategy.backward(
                precision.scale(loss_sum * scale), last_micro_batch=i == len(batches) - 1
            )
        local_loss += float(loss_sum.detach())
    input_tokens = _data_sum(strategy, sum(count_input_tokens(b) for b in batches))
    loss = _data_sum(strategy, local_loss) / max(label_tokens, 1)
    return loss, int(label_tokens), int(input_tokens)


def clip_and_step(
    job: TrainingJob, optimizer, scheduler, precision: Precision, loss: float, state: LoopState
) -> float:
    """Clip and step (the strategy logs the pre-clip norm); follow --nonfinite_loss.

    The loss is already summed over ranks, so every rank takes the same decision.
    """
    max_norm = job.args.max_grad_norm if job.args.max_grad_norm > 0 else float("inf")
    if not math.isfinite(loss) and precision.scaler is None:
        if job.args.nonfinite_loss == "error":
            raise NonFiniteLossError(
                f"step {state.step + 1}: loss {loss}. Lower --learning_rate, use "
                "--torch_dtype bfloat16/float32, or pass --nonfinite_loss skip"
            )
        grad_norm = float("nan")
    else:
        grad_norm = job.strategy.clip_and_step(job.model, optimizer, max_norm, precision.scaler)
    if not math.isfinite(grad_norm) and precision.scaler is None:
        state.skipped_steps += 1
        job.log(f"step {state.step + 1}: non-finite loss/gradient, step skipped")
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@torch.no_grad()
def evaluate(job: TrainingJob, precision: Precision) -> float | None:
    """Mean token loss over the validation data."""
    if not job.val_data:
        return None
    was_training = job.model.training
    job.model.eval()
    size = job.args.per_device_eval_batch_size
    pad = job.tokenizer.pad_token_id
    # Each data-parallel rank evaluates every dp_size-th sample; the sums are combined.
    mine = job.val_data[job.strategy.dp_rank :: job.strategy.dp_size]
    # Sharded models (FSDP2) gather weights inside forward, so every rank runs as many batches
    # as rank 0; a rank out of samples runs a fully masked one that adds nothing.
    most = len(job.val_data[:: job.strategy.dp_size])
    masked = _masked_copy(job.val_data[0])
    loss_sum, tokens = 0.0, 0
    for i in range(0, most, size):
        batch = collate(mine[i : i + size] or [masked], pad)
        with precision.autocast():
            batch_loss, _ = job.loss_fn(job.model, _to_device(batch, job.device))
        loss_sum += float(batch_loss)
        tokens += count_label_tokens(batch["labels"])
    job.model.train(was_training)
    return _data_sum(job.strategy, loss_sum) / max(_data_sum(job.strategy, tokens), 1)


def _resume(job: TrainingJob, optimizer, scheduler, precision: Precision) -> LoopState:
    spec = job.output.resume_from_checkpoint
    if not spec:
        return LoopState()
    folder, skipped = ckpt.find_resume_checkpoint(job.run_dir, spec)
    for bad in skipped:
        job.log(
            f"skipping incomplete checkpoint {bad} (no COMPLETE marker: interrupted while saving)"
        )
    if folder is None:
        job.log(f"no complete checkpoint in {job.run_dir / 'checkpoints'}; starting from scratch")
        return LoopState()
    saved = ckpt.load_checkpoint(folder, job.strategy, job.model, optimizer, job.log)
    if saved["num_train_samples"] != len(job.train_data):
        raise ckpt.CheckpointError(
            f"{folder} was saved with {saved['num_train_samples']} training samples, this run has "
            f"{len(job.train_data)}: resume needs the same data and --max_length"
        )
    scheduler.load_state_dict(saved["scheduler"])
    if precision.scaler and saved["grad_scaler"]:
        precision.scaler.load_state_dict(saved["grad_scaler"])
    job.log(f"resumed from {folder} at step {saved['step']}")
    return LoopState(
        step=saved["step"],
        position=DataPosition(saved["epoch"], saved["micro_batch"]),
        tokens_seen=saved["tokens_seen"],
        label_tokens_seen=saved.get("label_tokens_seen", 0),
        train_seconds=saved["train_seconds"],
        last_loss=saved["last_loss"],
        last_eval_loss=saved["last_eval_loss"],
        skipped_steps=saved["skipped_steps"],
    )


def _save(job: TrainingJob, optimizer, scheduler, precision: Precision, state: LoopState) -> None:
    folder = ckpt.checkpoint_dir(job.run_dir, state.step)
    payload = state.to_json(len(job.train_data), scheduler, precision.scaler)
    ckpt.save_checkpoint(folder, job.strategy, job.model, optimizer, payload, job.tokenizer)
    if job.strategy.ctx.is_main:
        for removed in ckpt.prune_checkpoints(job.run_dir, job.output.save_total_limit):
            job.log(f"removed old checkpoint {removed.name}")


class LogWindow:
    """Token-weighted loss and throughput over the steps since the last log line."""

    def __init__(self):
        self.throughput = Throughput()
        self.loss_sum, self.label_tokens = 0.0, 0

    def add(self, loss: float, label_tokens: int, input_tokens: int) -> None:
        self.throughput.add(input_tokens)
        if math.isfinite(loss):  # a skipped non-finite step must not poison the average
            self.loss_sum += loss * label_tokens
            self.label_tokens += label_tokens

    def flush(self) -> dict:
        row = {
            "loss": self.loss_sum / max(self.label_tokens, 1),
            "tokens_per_second": self.throughput.rate(),
            "label_tokens": self.label_tokens,
        }
        self.throughput.reset()
        self.loss_sum, self.label_tokens = 0.0, 0
        return row


def mfu_metric(job: TrainingJob, tokens_per_second: float) -> dict:
    """Model FLOPs utilization of the logged window (useful tokens only, not padding)."""
    if not job.flops_per_token or not job.peak_flops:
        return {}
    return {"mfu": round(tokens_per_second * job.flops_per_token / job.peak_flops, 4)}


def strategy_metrics(strategy) -> dict:
    """Figures a strategy reports for the log (e.g. DDP's gradient bytes sent); optional."""
    report = getattr(strategy, "step_metrics", None)
    return report() if report else {}


def _beat(job: TrainingJob, step: int, phase: str) -> None:
    if job.heartbeat is not None:
        job.heartbeat.beat(step, phase)


def plan_steps(job: TrainingJob) -> tuple[int, int]:
    """(total optimizer steps, steps of the first epoch)."""
    a = job.args
    accumulation = a.gradient_accumulation_steps
    return (
        total_steps(job.batch_plan, accumulation, a.num_train_epochs, a.max_steps),
        steps_in_epoch(job.batch_plan, accumulation, 0),
    )


def run_training(job: TrainingJob) -> dict:
    """Train to the planned number of steps; return the run summary."""
    args, out = job.args, job.output
    job.batch_plan = job.batch_plan or default_batch_plan(job)
    num_steps, per_epoch = plan_steps(job)
    optimizer = build_optimizer(job.model, args)
    # The schedule drives the plain optimizer's learning rate; an engine that wraps the
    # optimizer (DeepSpeed) reads it from the same param groups.
    scheduler = build_scheduler(optimizer, args, num_steps)
    job.model, optimizer = job.strategy.attach_optimizer(job.model, optimizer)
    precision = Precision(job.device, job.compute_dtype)
    state = _resume(job, optimizer, scheduler, precision)
    main = job.strategy.ctx.is_main
    metrics = MetricsLogger(job.run_dir, out.report_to, resume=state.step > 0, enabled=main)
    progress, window = Progress(num_steps, state.step, enabled=main), LogWindow()
    eval_every = out.eval_steps or out.save_steps
    steps = iterate_steps(job.batch_plan, args.gradient_accumulation_steps, state.position)
    started = time.perf_counter() - state.train_seconds
    job.model.train()
    try:
        while state.step < num_steps:
            indices, next_position = next(steps)
            batches = rank_batches(job, indices)
            lr = optimizer.param_groups[0]["lr"]
            _beat(job, state.step + 1, "forward/backward")
            # A pipeline schedule owns forward and backward; other strategies use ours.
            step_fn = getattr(job.strategy, "forward_backward", None) or forward_backward
            loss, label_tokens, input_tokens = step_fn(job, precision, batches)
            _beat(job, state.step + 1, "optimizer step")
            grad_norm = clip_and_step(job, optimizer, scheduler, precision, loss, state)
            state.step, state.position = state.step + 1, next_position
            state.tokens_seen += input_tokens
            state.label_tokens_seen += label_tokens
            state.last_loss = loss
            window.add(loss, label_tokens, input_tokens)
            progress.update(loss, lr, window.throughput.rate())
            last = state.step == num_steps
            if state.step == 1 or state.step % out.logging_steps == 0 or last:
                window_row = window.flush()
                metrics.log(
                    {
                        "step": state.step,
                        "epoch": round(state.step / per_epoch, 4),
                        **window_row,
                        **mfu_metric(job, window_row["tokens_per_second"]),
                        "learning_rate": lr,
                        "grad_norm": grad_norm,
                        "memory_gib": round(peak_memory_gib(job.device), 3),
                        "elapsed_s": round(time.perf_counter() - started, 2),
                        **strategy_metrics(job.strategy),
                    }
                )
            if job.val_data and (state.step % eval_every == 0 or last):
                _beat(job, state.step, "evaluation")
                state.last_eval_loss = evaluate(job, precision)
                metrics.log({"step": state.step, "eval_loss": state.last_eval_loss})
                progress.write(f"step {state.step}: eval_loss {state.last_eval_loss:.4f}")
            state.train_seconds = time.perf_counter() - started
            if state.step % out.save_steps == 0 or last:
                _beat(job, state.step, "checkpoint save")
                _save(job, optimizer, scheduler, precision, state)
    finally:
        progress.close()
        metrics.close()
    seconds = max(state.train_seconds, 1e-9)
    return {
        "steps": state.step,
        "train_time_s": state.train_seconds,
        "tokens_per_second": state.tokens_seen / seconds,
        "label_tokens_per_second": state.label_tokens_seen / seconds,
        **mfu_metric(job, state.tokens_seen / seconds),
        "peak_memory_gib": peak_memory_gib(job.device),
        "final_train_loss": state.last_loss,
        "final_eval_loss": state.last_eval_loss,
        "skipped_steps": state.skipped_steps,
    }
