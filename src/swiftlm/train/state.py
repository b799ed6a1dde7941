"""What a checkpoint stores besides tensors, and the resume/save steps of the loop.

What a resumed run may change is checked before anything loads (`resume_match`); here the
checkpoint is loaded, and the learning rate set from this run's schedule."""

from dataclasses import dataclass, field

from swiftlm import checkpoint as ckpt
from swiftlm.methods.online import is_online
from swiftlm.train.batching import DataPosition


@dataclass
class LoopState:
    """The loop's counters; saved in every checkpoint and restored on resume."""

    step: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    tokens_seen: int = 0
    label_tokens_seen: int = 0
    train_seconds: float = 0.0
    last_loss: float | None = None
    last_eval_loss: float | None = None
    skipped_steps: int = 0
    best_metric: float | None = None  # of --metric_for_best_model, and the step that had it
    best_step: int | None = None

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
            "best_metric": self.best_metric,
            "best_step": self.best_step,
            "num_train_samples": num_samples,
            "scheduler": scheduler.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
        }

    @classmethod
    def from_json(cls, saved: dict) -> "LoopState":
        return cls(
            step=saved["step"],
            position=DataPosition(saved["epoch"], saved["micro_batch"]),
            tokens_seen=saved["tokens_seen"],
            label_tokens_seen=saved.get("label_tokens_seen", 0),
            train_seconds=saved["train_seconds"],
            last_loss=saved["last_loss"],
            last_eval_loss=saved["last_eval_loss"],
            skipped_steps=saved["skipped_steps"],
            best_metric=saved.get("best_metric"),
            best_step=saved.get("best_step"),
        )


def resume(job, optimizer, scheduler, scaler) -> LoopState:
    """The state of --resume_from_checkpoint, with weights and optimizer loaded; a fresh
    state when there is nothing to resume."""
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
    if is_online(job.method):  # e.g. GRPO's completions not yet trained on
        job.method.load_state_dict(ckpt.load_method_state(folder, job.strategy.ctx.rank))
    if saved["num_train_samples"] != len(job.train_data):
        raise ckpt.CheckpointError(
            f"{folder} was saved with {saved['num_train_samples']} training samples, this run has "
            f"{len(job.train_data)}: resume needs the same data and --max_length"
        )
    scheduler.load_state_dict(saved["scheduler"])
    follow_this_schedule(optimizer, scheduler, saved["step"], job.log)
    if scaler and saved["grad_scaler"]:
        scaler.load_state_dict(saved["grad_scaler"])
    job.log(f"resumed from {folder} at step {saved['step']}")
    return LoopState.from_json(saved)


def follow_this_schedule(optimizer, scheduler, step: int, log) -> None:
    """Set the learning rate this run's schedule gives at `step`.

    The optimizer state holds the rate that the saved run's schedule set last, and the next
    step would train with it. The restored scheduler keeps its base rates and step count but
    takes its shape from this run's flags; a run resumed with another length (--max_steps,
    --num_train_epochs: `resume_match`) continues on its own schedule from the first resumed
    step. With the same length the rate is the same and nothing changes (exact resume)."""
    now = [base * factor(scheduler.last_epoch) for base, factor in _factors(scheduler)]
    saved = [group["lr"] for group in optimizer.param_groups]
    if now == saved:
        return
    for group, lr in zip(optimizer.param_groups, now, strict=False):
        group["lr"] = lr
    scheduler._last_lr = now  # what get_last_lr() reports until the next step
    log(
        f"learning rate follows this run's schedule from step {step}: {now[0]:.3g} (the "
        f"checkpoint's schedule had {saved[0]:.3g})"
    )


def _factors(scheduler) -> list:
    """(base rate, factor function) per parameter group of a LambdaLR (transformers' cosine,
    linear and constant-with-warmup schedules)."""
    return list(zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True))


def save(job, optimizer, scheduler, scaler, state: LoopState) -> None:
    """A complete checkpoint of this step; old ones pruned to --save_total_limit, except the
    best one (--metric_for_best_model), named in best_checkpoint.json."""
    folder = ckpt.checkpoint_dir(job.run_dir, state.step)
    payload = state.to_json(len(job.train_data), scheduler, scaler)
    method_state = job.method.state_dict() if is_online(job.method) else None
    ckpt.save_checkpoint(
        folder, job.strategy, job.model, optimizer, payload, job.tokenizer, method_state
    )
    if job.strategy.ctx.is_main:
        best = job.best.folder(job.run_dir, state) if job.best else None
        for removed in ckpt.prune_checkpoints(job.run_dir, job.output.save_total_limit, best):
            job.log(f"removed old checkpoint {removed.name}")
        if job.best:
            job.best.write(job.run_dir, state)
