"""A training command top to bottom: config -> paths and run directory -> model -> data (the
method's) -> loop -> final/.

`swiftlm sft` and `swiftlm pt` are `run(cfg, "sft")` and `run(cfg, "pt")`: the methods
registered in `methods.METHODS`. Any class that satisfies `methods.base.Method` runs the same
way through `run_method(cfg, cls)`.
"""

from pathlib import Path

from swiftlm.config import TrainConfig, save_config
from swiftlm.config.rules import check
from swiftlm.data.cache import sample_lengths
from swiftlm.distributed.env import init_distributed, shutdown_distributed
from swiftlm.distributed.heartbeat import Heartbeat
from swiftlm.distributed.parallelize import apply_activation_checkpointing
from swiftlm.distributed.strategy import build_strategy
from swiftlm.errors import SwiftLMError
from swiftlm.methods.base import complete_method
from swiftlm.methods.registry import METHODS
from swiftlm.models.loader import pick_device, pick_dtype, resolve_model
from swiftlm.models.moe import build_router_recorder, describe_moe, is_moe
from swiftlm.models.quant import describe_bnb
from swiftlm.monitor.loggers import check_loggers_installed
from swiftlm.monitor.metrics import format_summary, write_summary
from swiftlm.monitor.mfu import flops_per_token, peak_flops
from swiftlm.monitor.oom import oom_guard
from swiftlm.report.dashboard import Dashboard
from swiftlm.report.run import write_report
from swiftlm.train.batching import describe_plan
from swiftlm.train.config import AUTO_BATCH_SIZE
from swiftlm.train.evaluation import BestCheckpoint, build_generation_evaluator
from swiftlm.train.loop import TrainingJob, run_training
from swiftlm.train.preflight import prepare_run
from swiftlm.train.prepare import (
    build_method,
    make_batch_plan,
    prepare_data,
    prepare_model,
    report_data_health,
)
from swiftlm.train.resolve import resolve_auto_batch, resolve_config, run_facts
from swiftlm.tuners.hooks import TunerHooks
from swiftlm.tuners.setup import count_parameters


def _silent(_: str) -> None:
    """Logging on ranks other than 0."""


def run(cfg: TrainConfig, method: str) -> dict:
    """Train with the registered method `method` (e.g. "sft"); return the run summary."""
    return run_method(cfg, METHODS[method])


def run_method(cfg: TrainConfig, method_cls, log=print) -> dict:
    """Train with `method_cls` (built as `method_cls(cfg, tokenizer)`); return the summary."""
    from transformers import set_seed

    method_cls = complete_method(method_cls)  # checked; the capabilities it lacks: defaults
    check(cfg, run_facts(method_cls))  # every rule between flags, before anything loads
    check_loggers_installed(cfg.output.report_to)
    ctx = init_distributed(cfg.dist.dist_timeout)
    log = log if ctx.is_main else _silent
    device = pick_device(cfg.model.device, ctx.local_rank)
    compute_dtype = pick_dtype(cfg.model.torch_dtype, device)
    cfg, resolved = _settled_config(cfg, method_cls, ctx, device, log)
    run_dir = Path(cfg.output.output_dir)
    strategy = build_strategy(cfg.dist, ctx, device, compute_dtype, cfg.train, cfg.data.max_length)
    log(
        f"model {resolved.requested} on {device} x {ctx.world_size} ({strategy}, "
        f"{str(compute_dtype).replace('torch.', '')} compute)"
    )
    method, tokenizer, saved_with_weights = build_method(cfg, method_cls, resolved.path)
    train_data, val_data, truncation = prepare_data(cfg, method, tokenizer, ctx, log)
    evaluator = build_generation_evaluator(cfg, tokenizer, strategy, method)
    set_seed(cfg.train.seed)  # the same initial weights on every rank
    model = prepare_model(
        cfg, resolved.path, device, compute_dtype, method.model_kind, tokenizer.pad_token_id, log
    )
    _describe_model(cfg, model, log)
    tuner_hooks = TunerHooks(model, cfg.tuner, cfg.train.seed, log)  # before any step/resume
    routers = build_router_recorder(
        model, cfg.train.router_aux_loss_coef, strategy.pipeline_parallel, resolved.requested
    )
    method.prepare_model(model, log)
    train_data, val_data = method.prepare_samples(model, train_data, val_data, log)
    if cfg.train.per_device_train_batch_size == AUTO_BATCH_SIZE:  # needs the model
        if cfg.train.gradient_checkpointing:  # measure as it will train (wrap applies it too)
            apply_activation_checkpointing(model)
        placement = (device, compute_dtype)
        cfg = resolve_auto_batch(cfg, model, method.loss, placement, ctx, log)
    lengths = sample_lengths(train_data, method.length)
    flops = flops_per_token(
        model, int(sum(lengths) / len(lengths)), cfg.train.gradient_checkpointing
    )
    if ctx.is_main:
        save_config(cfg, run_dir / "config.yaml")
    batch_plan = make_batch_plan(cfg, lengths, strategy.dp_size, method.completions_per_sample)
    log(describe_plan(batch_plan, cfg.data.max_length))
    report_data_health(
        cfg, method, (train_data, val_data, truncation), batch_plan, run_dir, ctx, log
    )
    job = TrainingJob(
        model=strategy.wrap(model),
        tokenizer=saved_with_weights,
        method=method,
        train_data=train_data,
        val_data=val_data,
        device=device,
        compute_dtype=compute_dtype,
        args=cfg.train,
        output=cfg.output,
        run_dir=run_dir,
        strategy=strategy,
        batch_plan=batch_plan,
        monitor=cfg.monitor,
        flops_per_token=flops,
        peak_flops=peak_flops(device, compute_dtype) * ctx.world_size,
        # One process too: a hang dumps every thread's stack and stops the run.
        heartbeat=Heartbeat(ctx, cfg.dist.heartbeat_timeout, run_dir),
        log=log,
        evaluator=evaluator,
        best=BestCheckpoint(cfg.evaluation) if cfg.evaluation.metric_for_best_model else None,
        routers=routers,
        tuner_hooks=tuner_hooks,
    )
    summary = _train_and_save(job)
    log(format_summary(summary))
    return summary


def _settled_config(cfg: TrainConfig, method_cls, ctx, device, log):
    """(the run's final config, its resolved model), decided on rank 0 and followed by every
    rank: rank 0 checks every path and settles the run directory (new, cleared, versioned or
    resumed) before a model is even found, so a typo costs a second; it converts a GGUF model
    once; and it resolves the config (the default run directory has a timestamp)."""
    cfg = prepare_run(cfg, method_cls, ctx, device, log) if ctx.is_main else None
    cfg = ctx.broadcast_object(cfg)
    resolved = resolve_model(cfg.model.model) if ctx.is_main else None
    resolved = ctx.broadcast_object(resolved)
    cfg = resolve_config(cfg, method_cls, resolved.name, device) if ctx.is_main else None
    return ctx.broadcast_object(cfg), resolved


def _describe_model(cfg: TrainConfig, model, log) -> None:
    """What trains: the parameter counts, a QLoRA base, a mixture-of-experts model's experts."""
    trainable, total = count_parameters(model)
    log(
        f"{cfg.tuner.train_type}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.2f}%)"
    )
    if cfg.quant.quant_method:
        log(f"QLoRA: frozen base in {describe_bnb(cfg.quant)}, adapters in float32")
    if is_moe(model):
        log(describe_moe(model))


def _train_and_save(job: TrainingJob) -> dict:
    """The loop, then final/; the heartbeat and the process group always shut down, and the
    report is written even when the run fails (what led up to a NaN or a crash is there)."""
    dashboard = _start_dashboard(job)
    try:
        if job.heartbeat:
            job.heartbeat.start()
        with oom_guard(job.run_dir, job.device, job.log):
            summary = run_training(job)
        if job.heartbeat:
            job.heartbeat.beat(summary["steps"], "final save")
        job.strategy.save_final(job.model, job.tokenizer, job.run_dir / "final")
        summary["output"] = str(job.run_dir / "final")
        if job.strategy.ctx.is_main:
            if job.tuner_hooks:  # PiSSA/OLoRA: final/ as a plain LoRA of the original model
                job.tuner_hooks.final_saved(job.run_dir / "final")
            write_summary(job.run_dir, summary)
    finally:
        if job.heartbeat:
            job.heartbeat.stop()
        _finish_report(job, dashboard)
        shutdown_distributed()
    return summary


def _start_dashboard(job: TrainingJob):
    """--dashboard: the live run page, served by rank 0 while it trains."""
    if not (job.monitor.dashboard and job.strategy.ctx.is_main):
        return None
    dashboard = Dashboard(job.run_dir, job.monitor.dashboard_port)
    job.log(f"dashboard: {dashboard.start()} (live while the run trains)")
    return dashboard


def _finish_report(job: TrainingJob, dashboard) -> None:
    """Rank 0 writes report.html; a run that stopped before its first log line has none."""
    if dashboard is not None:
        dashboard.stop()
    if not job.strategy.ctx.is_main or not (job.run_dir / "metrics.jsonl").is_file():
        return
    try:
        job.log(f"report: {write_report([job.run_dir])}")
    except SwiftLMError as exc:  # never hide the run's own outcome behind the report's
        job.log(f"report.html not written: {exc}")
