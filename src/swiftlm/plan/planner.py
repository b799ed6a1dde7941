"""Compare every layout of a job on a cluster, recommend the fastest that fits, and when
none does, find the smallest change of the job that would."""

from dataclasses import dataclass, field, replace

from swiftlm.plan.devices import Cluster
from swiftlm.plan.layouts import DDP, FSDP2, ZERO1, ZERO2, ZERO3, Layout, candidate_layouts
from swiftlm.plan.memory import Job, Memory, estimate_memory
from swiftlm.plan.shape import ModelShape
from swiftlm.plan.timing import StepTime, estimate_step_time

# Share of a GPU's memory the allocator's peak may reach: the CUDA context, the caching
# allocator's fragmentation and NCCL's buffers take the rest.
GPU_USABLE = 0.9
MAX_SUGGESTED_DEVICES = 1024
# Step times closer than this are within the estimate's error: the simpler layout is chosen.
TIE_TOLERANCE = 0.05
SIMPLICITY = (DDP, ZERO1, ZERO2, FSDP2, ZERO3)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool

    @property
    def why_not(self) -> str:
        return "" if self.fits else "needs more memory than the device has"


@dataclass
class Plan:
    shape: ModelShape
    job: Job
    cluster: Cluster
    budget_bytes: float
    candidates: list[Candidate]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    change: str = ""  # when nothing fits: the smallest change that would

    @property
    def fitting(self) -> list[Candidate]:
        """The layouts that fit, best first: by step time, except that layouts within
        TIE_TOLERANCE of the fastest (closer than the estimate can tell apart) go simplest
        first: fewer model-parallel ranks, no offload, experts whole, then less state
        sharded, fewer collectives, fewer engines (SIMPLICITY)."""
        fits = sorted((c for c in self.candidates if c.fits), key=lambda c: c.time.total_s)
        if not fits:
            return []
        near = fits[0].time.total_s * (1 + TIE_TOLERANCE)
        return sorted(fits, key=lambda c: (c.time.total_s > near, _simplicity(c), c.time.total_s))

    @property
    def best(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None

    @property
    def runner_up(self) -> Candidate | None:
        return self.fitting[1] if len(self.fitting) > 1 else None


def _simplicity(candidate: Candidate) -> tuple:
    layout = candidate.layout
    split = layout.tp * layout.pp * layout.sp  # model-parallel ranks
    return (split, layout.offload, layout.ep, SIMPLICITY.index(layout.sharding))


def memory_budget(cluster: Cluster) -> float:
    device = cluster.device
    return device.memory_bytes * (GPU_USABLE if device.kind == "gpu" else 1.0)


def make_plan(shape: ModelShape, job: Job, cluster: Cluster, only: list[str] | None = None) -> Plan:
    """Every layout's memory and step time; `only`: layout names to keep (e.g. the measured
    ones), None for all."""
    layouts, skipped = candidate_layouts(
        cluster.world_size, cluster.per_node, shape, job.grad_accum, cluster.device.kind == "gpu"
    )
    if only is not None:
        layouts = [layout for layout in layouts if layout.name in only]
    budget = memory_budget(cluster)
    candidates = []
    for layout in layouts:
        memory = estimate_memory(shape, layout, job, cluster.device)
        time = estimate_step_time(shape, layout, job, cluster)
        candidates.append(Candidate(layout, memory, time, memory.peak <= budget))
    plan = Plan(shape, job, cluster, budget, candidates, skipped)
    if plan.best is None:
        plan.change = smallest_change(shape, job, cluster, only)
    return plan


def smallest_change(shape: ModelShape, job: Job, cluster: Cluster, only=None) -> str:
    """The least disruptive change that makes some layout fit: gradient checkpointing, then a
    smaller micro-batch (same global batch through accumulation), then LoRA, then more
    devices. Empty when none of these is enough."""
    options = []
    if not job.checkpointing:
        options.append(("--gradient_checkpointing true", replace(job, checkpointing=True)))
    ckpt = replace(job, checkpointing=True)
    batch = job.batch_size
    while batch > 1:
        batch //= 2
        accum = job.grad_accum * job.batch_size // batch
        flags = f"--per_device_train_batch_size {batch} --gradient_accumulation_steps {accum}"
        options.append((f"--gradient_checkpointing true {flags}", replace(ckpt, batch_size=batch)))
    small = replace(ckpt, batch_size=1, grad_accum=job.grad_accum * job.batch_size)
    for option, changed in options:
        best = make_plan(shape, changed, cluster, only).best
        if best is not None:
            return f"{option}: {best.layout.name} fits at {best.memory.peak / 2**30:.2f} GiB"
    while cluster.world_size < MAX_SUGGESTED_DEVICES:
        # more devices per node up to 8, then more nodes
        per_node, nodes = cluster.per_node, cluster.nnodes
        grow_nodes = per_node >= 8
        cluster = Cluster(
            cluster.device,
            per_node if grow_nodes else per_node * 2,
            nodes * 2 if grow_nodes else nodes,
        )
        best = make_plan(shape, small, cluster, only).best
        if best is not None:
            return (
                f"{cluster.label()} with checkpointing and micro-batch 1: {best.layout.name} "
                f"fits at {best.memory.peak / 2**30:.2f} GiB"
            )
    return ""
