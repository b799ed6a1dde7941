"""The parallel layouts the planner compares, and the `swiftlm sft` flags that run each.

A layout is data parallel (DDP, DeepSpeed ZeRO-1/2/3 with or without CPU offload, FSDP2)
over `dp` replicas, optionally with tensor parallel (`tp`) or pipeline parallel (`pp`)
inside each replica: the combinations `swiftlm sft` runs (see config/rules.py: DeepSpeed
combines with neither TP nor PP, TP and PP do not combine, TP's data-parallel groups use FSDP2).
"""

from dataclasses import dataclass

from swiftlm.plan.shape import ModelShape

# How the data-parallel replicas hold the model state.
DDP, ZERO1, ZERO2, ZERO3, FSDP2 = "ddp", "zero1", "zero2", "zero3", "fsdp2"
SHARDINGS = (DDP, ZERO1, ZERO2, ZERO3, FSDP2)


@dataclass(frozen=True)
class Layout:
    """One way to spread the job over `dp * tp * pp` devices."""

    sharding: str  # one of SHARDINGS
    dp: int
    tp: int = 1
    pp: int = 1
    offload: bool = False  # optimizer states (and ZeRO-3/FSDP2 weights) in CPU memory

    @property
    def name(self) -> str:
        base = {DDP: "DDP", ZERO1: "ZeRO-1", ZERO2: "ZeRO-2", ZERO3: "ZeRO-3", FSDP2: "FSDP2"}
        text = base[self.sharding] + (" + offload" if self.offload else "")
        if self.tp > 1:
            text = f"TP{self.tp}" + (f" x {text} dp{self.dp}" if self.dp > 1 else "")
        elif self.pp > 1:
            text = f"PP{self.pp}" + (f" x {text} dp{self.dp}" if self.dp > 1 else "")
        elif self.dp == 1:
            text = "single"
        return text

    @property
    def shards_optimizer(self) -> bool:
        return self.sharding != DDP

    @property
    def shards_gradients(self) -> bool:
        return self.sharding in (ZERO2, ZERO3, FSDP2)

    @property
    def shards_weights(self) -> bool:
        return self.sharding in (ZERO3, FSDP2)

    @property
    def deepspeed(self) -> bool:
        return self.sharding in (ZERO1, ZERO2, ZERO3)

    def sft_flags(self) -> list[str]:
        """The `swiftlm sft` flags that run this layout."""
        if self.dp * self.tp * self.pp == 1:
            return ["--strategy", "single"]
        if self.deepspeed:
            return ["--deepspeed", self.sharding + ("_offload" if self.offload else "")]
        flags = []
        if self.tp > 1:
            flags += ["--tensor_parallel_size", str(self.tp)]
        if self.pp > 1:
            flags += ["--pipeline_parallel_size", str(self.pp)]
        if self.sharding == FSDP2:
            flags += ["--fsdp", "fsdp2"] + (["--fsdp_offload", "true"] if self.offload else [])
        elif not flags:
            flags = ["--strategy", "ddp"]
        return flags


def divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def candidate_layouts(
    world: int, per_node: int, shape: ModelShape, grad_accum: int, gpu: bool
) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Every layout for `world` devices, and (layout, reason) for the families left out."""
    if world == 1:
        return [Layout(DDP, 1)], []
    layouts = [Layout(DDP, world), Layout(FSDP2, world)]
    layouts += [Layout(s, world) for s in (ZERO1, ZERO2, ZERO3)]
    if gpu:  # offloading moves state from device memory to host memory; a CPU has only one
        layouts += [Layout(ZERO2, world, offload=True), Layout(ZERO3, world, offload=True)]
        layouts += [Layout(FSDP2, world, offload=True)]
    skipped = []
    for tp in divisors(min(world, per_node)):  # TP's all-reduces stay inside a node
        reason = _tp_reason(shape, tp)
        if reason:
            skipped.append((f"TP{tp}", reason))
            continue
        layouts.append(Layout(FSDP2 if world // tp > 1 else DDP, world // tp, tp=tp))
    for pp in divisors(world):
        reason = _pp_reason(shape, pp, grad_accum)
        if reason:
            skipped.append((f"PP{pp}", reason))
            continue
        layouts.append(Layout(DDP, world // pp, pp=pp))
        if world // pp > 1:
            layouts.append(Layout(FSDP2, world // pp, pp=pp))
    return layouts, skipped


def _tp_reason(shape: ModelShape, tp: int) -> str:
    for name, value in (
        ("attention heads", shape.num_heads),
        ("key/value heads", shape.num_kv_heads),
        ("intermediate size", shape.intermediate_size),
    ):
        if value % tp:
            return f"the model's {name} ({value}) are not divisible by {tp}"
    return ""


def _pp_reason(shape: ModelShape, pp: int, grad_accum: int) -> str:
    if shape.tied_embeddings:
        return "the model ties its embeddings to its LM head, which would sit on different stages"
    if shape.num_layers < pp:
        return f"the model has {shape.num_layers} layers, fewer than {pp} stages"
    if grad_accum < pp:
        return (
            f"--gradient_accumulation_steps {grad_accum} gives fewer micro-batches than {pp} "
            "stages: the pipeline would idle most of the step"
        )
    return ""
