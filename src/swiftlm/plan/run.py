"""`swiftlm plan`: print each layout's memory per device and step time, and the recommendation.

    swiftlm plan --model M --train_type full --max_length 4096 \
        --per_device_train_batch_size 4 --devices 8xH100 [--nnodes 2]
"""

import json
from pathlib import Path

from swiftlm.config.commands import PlanConfig
from swiftlm.errors import ConfigError
from swiftlm.plan.devices import GIB, Cluster, parse_devices
from swiftlm.plan.memory import Job
from swiftlm.plan.planner import TIE_TOLERANCE, Candidate, Plan, make_plan
from swiftlm.plan.shape import (
    checkpoint_bytes,
    count_parameters,
    load_model_config,
    model_shape,
)
from swiftlm.plan.timing import CPU_EFFICIENCY, GPU_EFFICIENCY
from swiftlm.tuners.config import TunerArguments

COLUMNS = ("weights", "grads", "optim", "activ", "logits", "buffers", "peak", "step s")


def compute_bytes(torch_dtype: str, kind: str) -> int:
    """Bytes of the compute dtype `--torch_dtype` resolves to on this kind of device."""
    if torch_dtype == "float32":
        return 4
    if torch_dtype == "auto" and kind == "cpu":
        from swiftlm.models.loader import cpu_has_fast_bf16

        return 2 if cpu_has_fast_bf16() else 4
    return 2


def job_from_config(cfg, kind: str) -> Job:
    batch = cfg.train.per_device_train_batch_size
    if batch < 1:
        raise ConfigError(
            "--per_device_train_batch_size auto: `swiftlm plan` needs a number (e.g. 4); it "
            "tells which batch fits instead"
        )
    return Job(
        batch_size=batch,
        max_length=cfg.data.max_length,
        grad_accum=cfg.train.gradient_accumulation_steps,
        checkpointing=cfg.train.gradient_checkpointing,
        full=cfg.tuner.train_type == "full",
        lora_rank=cfg.tuner.lora_rank,
        compute_bytes=compute_bytes(cfg.model.torch_dtype, kind),
        fused_ce=cfg.train.fused_cross_entropy,
    )


def plan_for(cfg, cluster: Cluster | None = None, only: list[str] | None = None) -> Plan:
    """The plan of a PlanConfig or TrainConfig (for `--strategy auto`) on `cluster`."""
    if cluster is None:
        nnodes = int(str(cfg.nodes.nnodes).split(":")[-1])
        cluster = parse_devices(cfg.plan.devices, nnodes, cfg.plan.memory_per_device)
    config, name = load_model_config(cfg.model.model)
    params = count_parameters(config, TunerArguments(train_type="full"))[0]
    stored = checkpoint_bytes(cfg.model.model, config, params)
    shape = model_shape(config, cfg.tuner, name or str(cfg.model.model), stored)
    return make_plan(shape, job_from_config(cfg, cluster.device.kind), cluster, only)


def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def format_row(candidate: Candidate, mark: str) -> str:
    m, t = candidate.memory, candidate.time
    cells = [m.weights, m.gradients, m.optimizer, m.activations, m.logits, m.buffers, m.peak]
    text = " ".join(f"{gib(v):>8}" for v in cells) + f" {t.total_s:>8.3g}"
    note = "" if candidate.fits else "  does not fit"
    if m.loading > m.training:
        note += "  (peak while loading the model)"
    return f"{mark}{candidate.layout.name:<22}{text}{note}"


def format_plan(plan: Plan) -> str:
    """The table a user reads, with the recommendation and the reasons under it."""
    shape, job, cluster = plan.shape, plan.job, plan.cluster
    kind = "full" if job.full else f"LoRA r={job.lora_rank}"
    active = shape.total_params - shape.idle_expert_params
    experts = ""
    if shape.num_experts:
        experts = (
            f", {shape.num_experts} experts top {shape.experts_per_token} in "
            f"{shape.moe_layers} layers, {active / 1e6:.1f}M used per token"
        )
    lines = [
        f"Plan for {shape.name} ({shape.total_params / 1e6:.1f}M parameters{experts}, "
        f"{shape.trainable_params / 1e6:.2f}M trained, {kind}), micro-batch {job.batch_size} x "
        f"{job.max_length} tokens, accumulation {job.grad_accum}, checkpointing "
        f"{'on' if job.checkpointing else 'off'}",
        f"on {cluster.label()}: {gib(plan.budget_bytes)} GiB usable per device, "
        f"links {cluster.device.intra_link}"
        + (f" / {cluster.device.inter_link}" if cluster.nnodes > 1 else ""),
        "",
        f"  {'layout':<22}" + " ".join(f"{c:>8}" for c in COLUMNS) + "   (GiB per device)",
    ]
    best = plan.best
    unfit = sorted((c for c in plan.candidates if not c.fits), key=lambda c: c.time.total_s)
    order = plan.fitting + unfit
    lines += [format_row(c, "* " if c is best else "  ") for c in order]
    lines += [f"  {name:<22} left out: {reason}" for name, reason in plan.skipped]
    lines.append("")
    lines += recommendation_lines(plan)
    return "\n".join(lines)


def recommendation_lines(plan: Plan) -> list[str]:
    best, second = plan.best, plan.runner_up
    efficiency = GPU_EFFICIENCY if plan.cluster.device.kind == "gpu" else CPU_EFFICIENCY
    notes = [
        f"Step time: the same global batch for every layout (TP/PP/SP accumulate more "
        f"micro-batches), at {efficiency:.0%} of the device's matmul FLOP/s, ring collectives "
        "at the link bandwidth. Peak = weights + optimizer + buffers + the larger of "
        "forward/backward (activations, logits) and the optimizer step (gradients). Layouts "
        f"within {TIE_TOLERANCE:.0%} of the fastest count as ties: the simplest is recommended.",
        *split_notes(plan),
    ]
    if best is None:
        change = plan.change or "no smaller job found; use bigger devices"
        return [
            f"Nothing fits in {gib(plan.budget_bytes)} GiB per device. Smallest change: {change}.",
            *notes,
        ]
    flags = " ".join(best.layout.sft_flags())
    lines = [
        f"Recommended: {best.layout.name} ({flags}): {gib(best.memory.peak)} GiB per device, "
        f"~{best.time.total_s:.3g} s per step."
    ]
    if second is not None:
        lines.append(
            f"Runner-up: {second.layout.name}: {gib(second.memory.peak)} GiB, "
            f"~{second.time.total_s:.3g} s per step."
        )
    unfit = [c.layout.name for c in plan.candidates if not c.fits]
    if unfit:
        lines.append(f"Do not fit (peak above {gib(plan.budget_bytes)} GiB): {', '.join(unfit)}.")
    return lines + notes


def split_notes(plan: Plan) -> list[str]:
    """What the SP and EP rows mean, when the table has some."""
    layouts = [c.layout for c in plan.candidates]
    notes = []
    if any(layout.sp > 1 for layout in layouts):
        notes.append(
            "SPn: n ranks share each row, ceil(max_length / n) + 1 tokens each (a look-ahead "
            "token lends the next shard's first label); weights and optimizer as under DDP or "
            "FSDP2 over all ranks. Ulysses: 4 all-to-alls of q, k, v and the output per layer "
            "forward, 4 backward; ring: n - 1 hops of the keys and values per layer forward, "
            "with their gradients backward, and the last rank attends every key."
        )
    if any(layout.ep > 1 for layout in layouts):
        notes.append(
            "EPn: n data-parallel ranks share out each MoE layer's experts (1/n of their "
            "weights, gradients and optimizer states each), 4 all-to-alls of the routed tokens "
            "per MoE layer (forward and backward); expert gradients reduced over dp/n replicas."
        )
    return notes


def plan_json(plan: Plan) -> dict:
    """The plan for machines and the web UI: every layout's terms in bytes and seconds."""

    def entry(c: Candidate) -> dict:
        m, t = c.memory, c.time
        return {
            "layout": c.layout.name,
            "flags": c.layout.sft_flags(),
            "sizes": {
                "dp": c.layout.dp,
                "tp": c.layout.tp,
                "pp": c.layout.pp,
                "sp": c.layout.sp,
                "ep": c.layout.ep,
            },
            "sequence_parallel_impl": c.layout.sp_impl if c.layout.sp > 1 else None,
            "fits": c.fits,
            "memory_bytes": {
                "weights": m.weights,
                "gradients": m.gradients,
                "optimizer": m.optimizer,
                "activations": m.activations,
                "logits": m.logits,
                "buffers": m.buffers,
                "offloaded": m.offloaded,
                "loading": m.loading,
                "peak": m.peak,
            },
            "step_seconds": {
                "compute": t.compute_s,
                "optimizer": t.optimizer_s,
                "communication": t.communication_s,
                "total": t.total_s,
            },
        }

    return {
        "model": plan.shape.name,
        "total_params": plan.shape.total_params,
        "trainable_params": plan.shape.trainable_params,
        "devices": plan.cluster.label(),
        "world_size": plan.cluster.world_size,
        "budget_bytes": plan.budget_bytes,
        "candidates": [entry(c) for c in plan.candidates],
        "left_out": [{"layout": n, "reason": r} for n, r in plan.skipped],
        "recommended": plan.best.layout.name if plan.best else None,
        "runner_up": plan.runner_up.layout.name if plan.runner_up else None,
        "change_to_fit": plan.change or None,
    }


def run(cfg: PlanConfig) -> Plan:
    plan = plan_for(cfg)
    target = cfg.plan.output_json
    if target == "-":
        print(json.dumps(plan_json(plan), indent=1))
        return plan
    print(format_plan(plan))
    if target:
        Path(target).write_text(json.dumps(plan_json(plan), indent=1))
        print(f"\nPlan written to {target}")
    return plan
