"""The training loop. It only steps: every method (SFT, pre-training, DPO ...) brings its own
batches and loss (`methods/`), every engine its own wrapping (`distributed/`).

One optimizer step = `gradient_accumulation_steps` micro-batches. Before any forward pass the
method's normalizer (label tokens, pairs, weights ...) is summed over the step's micro-batches
and the data-parallel ranks; each micro-batch's loss SUM is divided by that total before
backward, so the accumulated gradient is the gradient of the step's mean loss, whatever the
split into micro-batches and ranks.
"""

import itertools
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.data.prefetch import Prepared, prefetch_steps
from swiftlm.distributed.heartbeat import Heartbeat
from swiftlm.distributed.sequence_parallel import shard_sequence
from swiftlm.distributed.strategy import Strategy
from swiftlm.losses.causal_lm import shifted_labels
from swiftlm.methods.base import Layout, LossOutput, Method, StepContext
from swiftlm.models.moe import RouterRecorder
from swiftlm.monitor.config import MonitorArguments
from swiftlm.monitor.metrics import MetricsLogger, Progress, peak_memory_gib
from swiftlm.train import batching
from swiftlm.train import state as loop_state
from swiftlm.train.batching import BatchPlan, GlobalBatch, iterate_steps
from swiftlm.train.callbacks import TrainCallbacks
from swiftlm.train.config import OutputArguments, TrainArguments
from swiftlm.train.evaluation import BestCheckpoint, GenerationEvaluator
from swiftlm.train.nonfinite import NonFiniteLossError, describe_nonfinite, first_nonfinite_output
from swiftlm.train.observe import Observer
from swiftlm.train.optim import build_optimizer, build_scheduler
from swiftlm.train.preemption import PreemptionWatch
from swiftlm.train.schedule_free import averaged_weights, final_weights, training_weights
from swiftlm.train.window import LogWindow, StepResult, mfu_metric
from swiftlm.tuners.hooks import TunerHooks

__all__ = ["NonFiniteLossError", "TrainingJob", "run_training"]


@dataclass
class TrainingJob:
    """Everything the loop needs; built by `train.run`."""

    model: torch.nn.Module
    tokenizer: object
    method: Method
    train_data: list[dict]
    val_data: list[dict]
    device: torch.device
    compute_dtype: torch.dtype
    args: TrainArguments
    output: OutputArguments
    run_dir: Path
    strategy: Strategy
    batch_plan: BatchPlan
    heartbeat: Heartbeat | None = None  # hang detection across ranks
    flops_per_token: float = 0.0  # training FLOPs per token, for MFU (0: not reported)
    peak_flops: float = 0.0  # of all devices of the job together
    monitor: MonitorArguments = field(default_factory=MonitorArguments)
    log: Callable[[str], None] = field(default=print)
    observer: Observer | None = None  # set by run_training: step timing, gradient health
    evaluator: GenerationEvaluator | None = None  # --eval_dataset's tasks
    best: BestCheckpoint | None = None  # --metric_for_best_model
    checkpoint_tiers: object | None = None  # checkpoint.tiers.Tiers, set on resume
    callbacks: TrainCallbacks | None = None  # plugins' callbacks, set by run_training
    routers: RouterRecorder | None = None  # a mixture-of-experts model's routers
    tuner_hooks: TunerHooks | None = None  # LoRA+'s check, LISA's sampling, PiSSA's final


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
    """Tensors to the device; other values (an online method's prompt lists) as they are."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def rank_batches(job: TrainingJob, step_batches: list[GlobalBatch]) -> list[dict]:
    """This rank's share of each global micro-batch, collated by the method.

    A rank whose share of a short last micro-batch is empty still runs a fully masked sample:
    it adds nothing to the loss but keeps the collectives of every rank in step.
    """
    plan, rank = job.batch_plan, job.strategy.dp_rank
    batches = []
    for global_batch in step_batches:
        rows = global_batch[rank] if rank < len(global_batch) else []
        samples = [[job.train_data[i] for i in row] for row in rows]
        if not samples:
            samples = [[job.method.masked(job.train_data[global_batch[0][0][0]])]]
        if plan.padding_free:  # every sample of the micro-batch in one row
            samples = [[s for row in samples for s in row]]
        packed = plan.packs is not None or plan.padding_free
        batches.append(
            _sequence_shard(job, job.method.collate(Layout(rows=samples, packed=packed)))
        )
    return batches


def _sequence_shard(job: TrainingJob, batch: dict) -> dict:
    """Sequence parallel: this rank's shard of the micro-batch its group shares."""
    strategy = job.strategy
    if strategy.sp_size == 1:
        return batch
    method = job.method
    return shard_sequence(
        batch, strategy.sp_rank, strategy.sp_size, method.token_pads,
        method.sequence_row_sets, method.sequence_owned,
    )  # fmt: skip


def _data_sum(job: TrainingJob, values: torch.Tensor) -> torch.Tensor:
    """Sum per-rank figures (float64) over the data: ranks that share a batch (tensor or
    pipeline parallel) hold the same values, so the world sum counts them once per replica
    (sequence-parallel ranks hold shards of it, each counted). One collective, and the result
    stays where the collective left it (no host read)."""
    strategy = job.strategy
    if not strategy.ctx.distributed:
        return values
    replicas = strategy.ctx.world_size // (strategy.dp_size * strategy.sp_size)
    with job.observer.phase("collective"):
        return strategy.ctx.all_reduce_tensor(values) / replicas


def _step_counts(job: TrainingJob, batches: list[dict]) -> torch.Tensor:
    """[normalizer, label tokens, input tokens] of the step's micro-batches over the data.
    Read from the host copies of the batches, before any forward: nothing waits on the
    device, and the normalizer is known before the first backward."""
    counts = [
        torch.stack([
            torch.as_tensor(job.method.normalizer(b), dtype=torch.float64),
            _label_tokens(b),
            _input_tokens(b),
        ])
        for b in batches
    ]  # fmt: skip
    return _data_sum(job, torch.stack(counts).sum(dim=0))


def _label_tokens(batch: dict) -> torch.Tensor:
    if "labels" not in batch:
        return torch.zeros((), dtype=torch.float64)
    return (shifted_labels(batch["labels"]) != IGNORE_INDEX).sum().double()


def _input_tokens(batch: dict) -> torch.Tensor:
    """Real (non-padding) tokens of a batch in either layout."""
    return batch.get("attention_mask", batch.get("token_mask")).sum().double()


def forward_backward(job: TrainingJob, precision: Precision, batches: list[dict]) -> StepResult:
    """Accumulate the gradients of one optimizer step.

    Data-parallel wrappers average gradients over ranks (the replicas and, under sequence
    parallel, their shards), so each loss is also multiplied by their number: the result is
    the gradient of the global mean loss.

    Loss and metric sums accumulate as tensors on the device; the step reads them back to
    the host once, after its last backward (`_read_step`): no micro-batch waits for the
    device, and the step has two collectives (counts before, sums after), not one per figure.
    """
    strategy, method, observer = job.strategy, job.method, job.observer
    counts = _step_counts(job, batches)
    divisor = torch.where(counts[0] > 0, counts[0], 1.0)
    scale = strategy.dp_size * strategy.sp_size / divisor
    if strategy.pipeline_parallel:  # the schedule owns forward and backward
        with observer.phase("forward"):
            # Pipeline schedules run stage by stage on the host: a Python scale costs nothing.
            pipeline_loss = strategy.pipeline_step(
                method, batches, float(scale), precision.autocast
            )
        return _read_step(job, counts, torch.tensor([pipeline_loss], dtype=torch.float64), [])
    local_loss = torch.zeros((), dtype=torch.float64)
    metric_sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        with strategy.no_sync(job.model, sync=last):
            with observer.phase("forward"), precision.autocast(), _recording(job.routers):
                loss_sum, metrics = method.loss(job.model, _to_device(batch, job.device))
            if job.routers is not None:
                loss_sum, metrics = _with_routers(job, batch, loss_sum, metrics)
            step_scale = scale.to(device=loss_sum.device, dtype=loss_sum.dtype)
            with observer.backward(last_micro_batch=last):
                strategy.backward(precision.scale(loss_sum * step_scale), last_micro_batch=last)
        local_loss = local_loss.to(loss_sum.device) + loss_sum.detach().double()
        for name, value in metrics.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + value.detach().double()
    names = sorted(metric_sums)
    sums = torch.stack([local_loss, *(metric_sums[name].to(local_loss.device) for name in names)])
    return _read_step(job, counts, sums, names)


def _recording(routers: RouterRecorder | None):
    return routers.recording() if routers is not None else nullcontext()


def _with_routers(job: TrainingJob, batch: dict, loss_sum, metrics) -> LossOutput:
    """A mixture-of-experts model: the routers' figures of this micro-batch join its metrics,
    weighted by the method's normalizer as its loss is (so each is logged as a mean over the
    step), and --router_aux_loss_coef x the load-balancing loss joins the loss the same way."""
    stats = job.routers.take()
    if stats is None:  # the method ran no routed forward with gradients
        return loss_sum, metrics
    weight = torch.as_tensor(job.method.normalizer(batch)).to(loss_sum)
    job.observer.add_router_counts(stats.counts)
    metrics = {
        **metrics,
        "router_aux_loss": stats.aux.detach() * weight,
        "router_z_loss": stats.z_loss.detach() * weight,
        "router_entropy": stats.entropy.detach() * weight,
    }
    if job.args.router_aux_loss_coef:
        loss_sum = loss_sum + job.args.router_aux_loss_coef * stats.aux.to(loss_sum) * weight
    return loss_sum, metrics


def _read_step(job: TrainingJob, counts, sums: torch.Tensor, names: list[str]) -> StepResult:
    """The step's figures: this rank's sums [loss, metrics...] summed over the data in one
    collective, then read to the host in one transfer. That read is the step's one wait on
    the device: the loss decides what the step does next (a non-finite loss is not stepped)
    and is printed."""
    summed = _data_sum(job, sums.to(counts.device))
    values = torch.cat([counts, summed, sums[:1].to(counts.device)]).tolist()
    normalizer, label_tokens, input_tokens = values[:3]
    divisor = normalizer if normalizer > 0 else 1.0
    loss, *metrics = values[3 : 4 + len(names)]
    return StepResult(
        loss=loss / divisor,
        normalizer=normalizer,
        label_tokens=int(label_tokens),
        input_tokens=int(input_tokens),
        metrics={name: value / divisor for name, value in zip(names, metrics, strict=True)},
        local_loss=values[-1],
    )


def clip_and_step(
    job: TrainingJob, optimizer, scheduler, precision: Precision, result: StepResult, state, batches
) -> float:
    """Clip and step (the strategy logs the pre-clip norm); follow --nonfinite_loss.

    The loss is already summed over ranks, so every rank takes the same decision. A
    non-finite loss or gradient is traced to its rank and layer (`train.nonfinite`).
    """
    max_norm = job.args.max_grad_norm if job.args.max_grad_norm > 0 else float("inf")
    if not math.isfinite(result.loss) and precision.scaler is None:
        grad_norm = float("nan")  # no step: the gradients of a NaN loss are NaN
    else:
        grad_norm = job.strategy.clip_and_step(job.model, optimizer, max_norm, precision.scaler)
    if not math.isfinite(grad_norm) and precision.scaler is None:
        _nonfinite_step(job, precision, result, state, batches)
    job.observer.gradients_ready(state.step + 1)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _nonfinite_step(job: TrainingJob, precision: Precision, result, state, batches) -> None:
    """Stop naming the step, rank and layer (`error`), or count the skipped step (`skip`)."""
    step = state.step + 1

    def run_batch(batch: dict) -> None:
        with precision.autocast():
            job.method.loss(job.model, _to_device(batch, job.device))

    def rerun():
        if job.strategy.pipeline_parallel:  # the schedule owns the forward
            return None
        return first_nonfinite_output(job.model, job.method, batches, run_batch)

    what = describe_nonfinite(step, result.loss, result.local_loss, job.observer.health, rerun)
    if job.args.nonfinite_loss == "error":
        raise NonFiniteLossError(
            f"{what}. Lower --learning_rate, use --torch_dtype bfloat16/float32, or pass "
            "--nonfinite_loss skip to skip such steps"
        )
    state.skipped_steps += 1
    job.observer.anomalies.record(
        {
            "step": step,
            "kind": "nonfinite",
            "value": result.loss,
            "message": f"{what}; step skipped ({state.skipped_steps} so far)",
        }
    )


@torch.no_grad()
def run_evaluations(job: TrainingJob, precision: Precision, state) -> dict[str, float]:
    """The validation loss and the generation tasks' scores; the best step is updated."""
    evaluated = evaluate(job, precision) if job.val_data else {}
    if job.evaluator:
        evaluated.update(job.evaluator.evaluate_on_ranks(job.model, job.strategy.ctx))
    state.last_eval_loss = evaluated.get("eval_loss", state.last_eval_loss)
    if job.best:
        job.best.update(state, evaluated)
    return evaluated


def describe_evaluation(step: int, evaluated: dict[str, float]) -> str:
    shown = ", ".join(f"{name} {value:.4f}" for name, value in evaluated.items())
    return f"step {step}: {shown}"


def evaluate(job: TrainingJob, precision: Precision) -> dict[str, float]:
    """The method's mean loss (`eval_loss`) and metrics (`eval_<name>`) over the validation
    data, each a sum over all ranks divided by the summed normalizer, as in training. The
    sums stay on the device until the end: one collective, one host read."""
    was_training = job.model.training
    job.model.eval()
    method, strategy = job.method, job.strategy
    size = method.eval_batch_size or job.args.per_device_eval_batch_size
    # Each data-parallel rank evaluates every dp_size-th sample; the sums are combined.
    mine = job.val_data[strategy.dp_rank :: strategy.dp_size]
    # Sharded models (FSDP2) gather weights inside forward, so every rank runs as many batches
    # as rank 0; a rank out of samples runs a fully masked one that adds nothing.
    most = len(job.val_data[:: strategy.dp_size])
    masked = method.masked(job.val_data[0])
    sums: dict[str, torch.Tensor] = {}
    normalizer = torch.zeros((), dtype=torch.float64)
    for i in range(0, most, size):
        rows = [[sample] for sample in mine[i : i + size]] or [[masked]]
        batch = _sequence_shard(job, method.collate(Layout(rows=rows, packed=False)))
        with precision.autocast():
            batch_loss, metrics = method.evaluate(job.model, _to_device(batch, job.device))
        for name, value in {"loss": batch_loss, **metrics}.items():
            sums[name] = sums.get(name, 0.0) + torch.as_tensor(value).detach().double()
        normalizer += torch.as_tensor(method.eval_normalizer(batch), dtype=torch.float64)
    job.model.train(was_training)
    names = list(sums)
    device = sums["loss"].device
    figures = torch.stack([normalizer.to(device), *(sums[name].to(device) for name in names)])
    summed = _data_sum(job, figures)
    total, *values = summed.tolist()  # printed and logged
    divisor = total if total > 0 else 1.0
    return {f"eval_{name}": value / divisor for name, value in zip(names, values, strict=True)}


def plan_steps(job: TrainingJob) -> tuple[int, int]:
    """(total optimizer steps, steps of the first epoch)."""
    a = job.args
    accumulation = a.gradient_accumulation_steps
    return (
        batching.total_steps(job.batch_plan, accumulation, a.num_train_epochs, a.max_steps),
        batching.steps_in_epoch(job.batch_plan, accumulation, 0),
    )


def step_batches(job: TrainingJob, steps, state, num_steps: int, precision) -> tuple:
    """(this rank's micro-batches of the next optimizer step, the data position after it).

    The method makes them (`Method.step_batches`): by default the next data position's
    micro-batches; an online method (GRPO) samples its own from the prompts it draws, as
    many steps' worth as it needs."""
    position = [state.position]

    def draw() -> list[dict]:
        indices, position[0] = next(steps)
        if isinstance(indices, Prepared):  # collated ahead by the prefetch thread
            return indices
        return rank_batches(job, indices)

    context = StepContext(
        draw=draw,
        steps_left=num_steps - state.step,
        step=state.step + 1,
        strategy=job.strategy,
        autocast=precision.autocast,
        phase=job.observer.phase,
    )
    return job.method.step_batches(job.model, context), position[0]


def run_training(job: TrainingJob) -> dict:
    """Train to the planned number of steps; return the run summary."""
    args, out = job.args, job.output
    num_steps, per_epoch = plan_steps(job)
    optimizer = build_optimizer(job.model, args, num_steps)
    if job.tuner_hooks:
        job.tuner_hooks.optimizer_built(optimizer)
    # The schedule drives the plain optimizer's learning rate; an engine that wraps the
    # optimizer (DeepSpeed) reads it from the same param groups.
    scheduler = build_scheduler(optimizer, args, num_steps)
    job.model, optimizer = job.strategy.attach_optimizer(job.model, optimizer)
    precision = Precision(job.device, job.compute_dtype)
    state = loop_state.resume(job, optimizer, scheduler, precision.scaler)
    if job.tuner_hooks:  # LISA: the layers of the resumed step's window
        job.tuner_hooks.start(state.step)
    training_weights(optimizer)  # schedule-free: saved at its averaged weights (see below)
    main = job.strategy.ctx.is_main
    metrics = MetricsLogger(job.run_dir, out.report_to, resume=state.step > 0, enabled=main)
    job.observer = observer = Observer(job, num_steps, resume=state.step > 0)
    progress, window = Progress(num_steps, state.step, enabled=main), LogWindow()
    eval_every = out.eval_steps or out.save_steps
    steps = step_source(job, state, num_steps)
    started = time.perf_counter() - state.train_seconds
    job.callbacks = callbacks = TrainCallbacks(job, state, num_steps)  # on_train_start
    job.model.train()
    preemption = PreemptionWatch(job.strategy.ctx).install()  # SIGTERM/SIGUSR1: save, stop
    try:
        while state.step < num_steps:
            observer.step_begin(state.step + 1)
            with observer.phase("data"):
                batches, next_position = step_batches(job, steps, state, num_steps, precision)
            lr = optimizer.param_groups[0]["lr"]
            # The outer phase holds the step's own bookkeeping (token counts, metric sums);
            # backward and the collectives inside are timed as themselves.
            with observer.phase("forward"):
                result = forward_backward(job, precision, batches)
                result.metrics.update(job.method.step_metrics())
            with observer.phase("optimizer"):
                grad_norm = clip_and_step(
                    job, optimizer, scheduler, precision, result, state, batches
                )
            state.step, state.position = state.step + 1, next_position
            if job.tuner_hooks:  # LISA: a new window's layers
                job.tuner_hooks.step_end(state.step)
            state.tokens_seen += result.input_tokens
            state.label_tokens_seen += result.label_tokens
            state.last_loss = result.loss
            last = state.step == num_steps
            with observer.phase("logging"):
                window.add(result)
                observer.step_end(state.step, result.loss, grad_norm)
                callbacks.step_end(state, result.loss, lr, grad_norm)
                progress.update(result.loss, lr, window.throughput.rate())
                if observer.logs(state.step):
                    state.train_seconds = time.perf_counter() - started
                    metrics.log(log_row(job, state, window, per_epoch, lr, grad_norm))
                histograms = observer.take_histogram()
                if histograms:
                    metrics.log_histograms(histograms)
            if (job.val_data or job.evaluator) and (state.step % eval_every == 0 or last):
                with observer.phase("evaluation"), averaged_weights(optimizer):
                    evaluated = run_evaluations(job, precision, state)
                metrics.log({"step": state.step, **evaluated})
                progress.write(describe_evaluation(state.step, evaluated))
            state.train_seconds = time.perf_counter() - started
            save_due_checkpoint(job, optimizer, scheduler, precision, state, last, preemption)
        final_weights(optimizer)  # final/ holds a schedule-free optimizer's averaged weights
    finally:
        preemption.restore()
        steps.close()  # the prefetch thread, if any
        observer.close()
        progress.close()
        metrics.close()
        job.method.close()  # a rollout engine's thread, reward workers
        if job.evaluator:
            job.evaluator.close()
    return callbacks.train_end(state, summarize(job, state))


def step_source(job: TrainingJob, state, num_steps: int):
    """The data position's steps; collated ahead by a prefetch thread when the data asks
    for it (token shards), never past the last step (a method draws one data step per
    optimizer step, at most: an online one draws ahead, then trains without drawing)."""
    steps = iterate_steps(job.batch_plan, job.args.gradient_accumulation_steps, state.position)
    if not getattr(job.train_data, "prefetch", False):
        return steps
    ahead = itertools.islice(steps, num_steps - state.step)
    return prefetch_steps(ahead, lambda indices: rank_batches(job, indices))


def save_due_checkpoint(job, optimizer, scheduler, precision, state, last, preemption) -> None:
    """The checkpoint this step is due for (run directory or local tier), then a stop if a
    rank was signalled (SIGTERM/SIGUSR1): that saves to the run directory unless this step
    just did. A signal during the last step lets the run end as planned."""
    tier = loop_state.checkpoint_due(job, state.step, last)  # run dir, local tier, None
    if tier:
        with job.observer.phase("checkpoint"), averaged_weights(optimizer, not last):
            loop_state.save(job, optimizer, scheduler, precision.scaler, state, last, tier)
        job.callbacks.saved(state, tier)
    if last:
        return
    saved = tier == loop_state.RUN_TIER  # a local-tier copy may not outlive preemption

    def save() -> None:
        with averaged_weights(optimizer):
            loop_state.save(job, optimizer, scheduler, precision.scaler, state)
        job.callbacks.saved(state, loop_state.RUN_TIER)

    preemption.stop_if_signalled(job, state.step, saved, save)


def log_row(job: TrainingJob, state, window: LogWindow, per_epoch: int, lr, grad_norm) -> dict:
    """One metrics.jsonl line: the window's loss and throughput, the step's learning rate
    and gradient norm, and where the time went (every rank calls it: it reduces)."""
    window_row = window.flush()
    mfu = mfu_metric(job, window_row["tokens_per_second"])
    strategy_row = job.strategy.step_metrics()
    return {
        "step": state.step,
        "epoch": round(state.step / per_epoch, 4),
        **window_row,
        **mfu,
        **({"compute_efficiency": mfu["mfu"]} if mfu else {}),
        "learning_rate": lr,
        "grad_norm": grad_norm,
        "memory_gib": round(peak_memory_gib(job.device), 3),
        "elapsed_s": round(state.train_seconds, 2),
        "skipped_steps": state.skipped_steps,
        **strategy_row,
        **job.observer.log_row(strategy_row),
    }


def summarize(job: TrainingJob, state) -> dict:
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
        **best_summary(job, state),
    }


def best_summary(job: TrainingJob, state) -> dict:
    folder = job.best.folder(job.run_dir, state) if job.best else None
    if folder is None:
        return {}
    return {"best_metric": state.best_metric, "best_checkpoint": str(folder)}
