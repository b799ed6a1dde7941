"""What a checkpoint stores besides tensors, and the resume/save steps of the loop.

What a resumed run may change is checked before anything loads (`resume_match`); here the
checkpoint is loaded, and the learning rate set from this run's schedule."""

import os
from dataclasses import dataclass, field

from swiftlm import checkpoint as ckpt
from swiftlm.checkpoint.mirror import is_url, pause_for_tests
from swiftlm.checkpoint.tiers import LOCAL_TIER, MIRROR_TIER, RUN_TIER, Tiers, fetch_url, tier_due
from swiftlm.data.streaming import StreamPosition
from swiftlm.train.batching import DataPosition
from swiftlm.train.elastic import batch_record, resumed_position


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
    state when there is nothing to resume. Opens the checkpoint tiers first (a mirror that
    cannot be written is a ConfigError here, before anything trains)."""
    ctx = job.strategy.ctx
    tiers = Tiers.of(job.output, job.run_dir, ctx.rank, job.log)
    job.checkpoint_tiers = tiers
    folder, tier = _resume_folder(job, tiers, job.output.resume_from_checkpoint)
    if folder is None:
        if tiers is not None and ctx.is_main:
            tiers.start_fresh(0)
        return LoopState()
    saved = ckpt.load_checkpoint(folder, job.strategy, job.model, optimizer, job.log)
    if job.method.has_step_state:  # e.g. GRPO's completions not yet trained on
        job.method.load_state_dict(ckpt.load_method_state(folder, ctx.rank))
    if saved["num_train_samples"] != len(job.train_data):
        # A stream's samples are the chunks it trains on: --max_steps x the global batch.
        same = "--max_steps and batch size" if hasattr(job.train_data, "seek") else "data"
        raise ckpt.CheckpointError(
            f"{folder} was saved with {saved['num_train_samples']} training samples, this run has "
            f"{len(job.train_data)}: resume needs the same {same} and --max_length"
        )
    scheduler.load_state_dict(saved["scheduler"])
    follow_this_schedule(optimizer, scheduler, saved["step"], job.log)
    if scaler and saved["grad_scaler"]:
        scaler.load_state_dict(saved["grad_scaler"])
    where = f" ({tier})" if tier in (LOCAL_TIER, MIRROR_TIER) else ""  # not the usual place
    job.log(f"resumed from {folder}{where} at step {saved['step']}")
    if tiers is not None and ctx.is_main:
        tiers.start_fresh(saved["step"])
    restored = LoopState.from_json(saved)
    # Saved on another number of data-parallel ranks (an elastic job): the same rows consumed.
    restored.position = resumed_position(saved, job.batch_plan, folder, job.log)
    _seek_stream(job, saved, restored.position, folder)
    return restored


def _stream_index(job, position) -> int:
    """The chunk a --streaming run reads first at `position` (its plan is sequential)."""
    plan = job.batch_plan
    return (
        position.epoch * len(job.train_data) + position.micro_batch * plan.batch_size * plan.dp_size
    )


def _seek_stream(job, saved: dict, position, folder) -> None:
    """A --streaming run starts reading where the checkpoint's next step starts: the saved
    file, byte offset and token (data.streaming), read in constant time."""
    if not hasattr(job.train_data, "seek"):
        return
    stream = saved.get("stream")
    if stream is None:
        raise ckpt.CheckpointError(
            f"{folder} has no stream position (it was not saved by a --streaming run): "
            "resume it without --streaming"
        )
    window, seed = stream.get("shuffle_buffer_size", 0), stream.get("shuffle_seed")
    data = job.train_data
    if (window, seed) != (data.shuffle_buffer_size, data.seed if window else None):
        raise ckpt.CheckpointError(  # its position is of another order of chunks
            f"{folder} was saved with --shuffle_buffer_size {window}"
            + (f" --data_seed {seed}" if window else "")
            + f", this run has {data.shuffle_buffer_size} (--data_seed {data.seed}): resume "
            "with the checkpoint's"
        )
    job.train_data.seek(_stream_index(job, position), StreamPosition.from_json(stream))


def _resume_folder(job, tiers, spec: str | None):
    """(checkpoint folder on this machine, the tier it came from), or (None, None): nothing
    to resume. A mirrored checkpoint is downloaded into the run directory by rank 0."""
    if not spec:
        return None, None
    ctx = job.strategy.ctx
    if is_url(spec):  # a mirrored checkpoint named by its URL
        if ctx.is_main:
            fetch_url(spec, job.output.checkpoint_mirror_options, job.run_dir)
        ctx.barrier()
        step = int(spec.rstrip("/").rsplit("-", 1)[1])  # fetch_url checked the name
        return ckpt.checkpoint_dir(job.run_dir, step), MIRROR_TIER
    if spec != "auto" or tiers is None:
        folder, skipped = ckpt.find_resume_checkpoint(job.run_dir, spec)
        tier = RUN_TIER if spec == "auto" else "given folder"
    else:
        found, skipped = tiers.newest()
        if found is not None and found.folder is None and ctx.is_main:
            job.log(f"downloading step-{found.step} from the mirror {tiers.mirror.url}")
            tiers.fetch(found)
        if tiers.mirror is not None:  # every rank: the download is on the run directory
            ctx.barrier()
        folder = None if found is None else tiers.folder(found.tier, found.step)
        tier = None if found is None else found.tier
        if found is not None and found.tier == MIRROR_TIER:
            folder = ckpt.checkpoint_dir(job.run_dir, found.step)
    for bad in skipped:
        job.log(
            f"skipping incomplete checkpoint {bad} (no COMPLETE marker: interrupted while saving)"
        )
    if folder is None:
        places = "the checkpoint tiers" if tiers else str(job.run_dir / "checkpoints")
        job.log(f"no complete checkpoint in {places}; starting from scratch")
    return folder, tier


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


def checkpoint_due(job, step: int, last: bool) -> str | None:
    """Where the loop saves after `step`: RUN_TIER, LOCAL_TIER, or None (no checkpoint)."""
    return tier_due(job.output, step, last)


def save(job, optimizer, scheduler, scaler, state: LoopState, last=False, tier=RUN_TIER) -> None:
    """A complete checkpoint of this step in `tier` (`checkpoint.tiers`: the run directory
    unless the loop says the local tier is due); the run directory's old ones pruned to
    --save_total_limit, except the best one (--metric_for_best_model), named in
    best_checkpoint.json. `last`: the end of training, which waits for the mirror's copy."""
    tiers = job.checkpoint_tiers
    in_run_dir = tier == RUN_TIER or tiers is None
    folder = (
        ckpt.checkpoint_dir(job.run_dir, state.step)
        if in_run_dir
        else tiers.folder(tier, state.step)
    )
    payload = state.to_json(len(job.train_data), scheduler, scaler)
    payload.update(batch_record(job.batch_plan, job.args, job.strategy.dp_size))
    if hasattr(job.train_data, "position_at"):  # --streaming: where the next step reads
        stream = job.train_data.position_at(_stream_index(job, state.position)).as_json()
        order = {"shuffle_buffer_size": job.train_data.shuffle_buffer_size}
        order["shuffle_seed"] = job.train_data.seed if order["shuffle_buffer_size"] else None
        payload["stream"] = {**stream, **order}
    method_state = job.method.state_dict() if job.method.has_step_state else None
    strategy = PausedSave.around(job.strategy, state.step)
    ckpt.save_checkpoint(
        folder, strategy, job.model, optimizer, payload, job.tokenizer, method_state
    )
    if not job.strategy.ctx.is_main:
        return
    best = job.best.folder(job.run_dir, state) if job.best and in_run_dir else None
    if in_run_dir:
        if last:  # the last save counts towards --save_total_limit once it is complete
            wait_for_background_saves(job.strategy)
        for removed in ckpt.prune_checkpoints(job.run_dir, job.output.save_total_limit, best):
            job.log(f"removed old checkpoint {removed.name}")
        if job.best:
            job.best.write(job.run_dir, state)
    if tiers is not None:
        tiers.saved(tier, folder, best_step(best))
        if last:
            tiers.finish(folder)


def best_step(best) -> int | None:
    return int(best.name[5:]) if best is not None and best.name[5:].isdigit() else None


class PausedSave:
    """A test hook: with SWIFTLM_TEST_SAVE_PAUSE=STEP:SECONDS the save of STEP sleeps after
    the strategy wrote its weights and before COMPLETE, so a test can kill -9 a half-written
    checkpoint (tests/integration/test_torn_checkpoint.py). Otherwise the strategy itself."""

    def __init__(self, strategy, step: int):
        self.strategy, self.step = strategy, step

    @staticmethod
    def around(strategy, step: int):
        wanted = os.environ.get("SWIFTLM_TEST_SAVE_PAUSE", "").startswith(f"{step}:")
        return PausedSave(strategy, step) if wanted else strategy

    def __getattr__(self, name):  # ctx and the rest: the strategy's own
        return getattr(self.strategy, name)

    def save_state(self, folder, model, optimizer):
        pending = self.strategy.save_state(folder, model, optimizer)
        pause_for_tests("SWIFTLM_TEST_SAVE_PAUSE", self.step)
        return pending


def wait_for_background_saves(strategy) -> None:
    """An --async_save write still in flight (`PendingSave`) would die with the process."""
    pending = getattr(strategy, "saves", None)
    if pending is not None:
        pending.wait()
