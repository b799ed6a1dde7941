"""The parallel layouts the planner compares, and the `swiftlm sft` flags that run each.

A layout is data parallel (DDP, DeepSpeed ZeRO-1/2/3 with or without CPU offload, FSDP2)
over `dp` replicas, optionally with tensor parallel (`tp`), pipeline parallel (`pp`) or
sequence parallel (`sp`: Ulysses or ring attention) inside each replica, or with expert
parallel (`ep`) splitting each MoE layer's experts over groups of the replicas: the
combinations `swiftlm sft` runs (see config/rules.py: DeepSpeed combines with neither TP nor
PP, TP and PP do not combine, TP's data-parallel groups use FSDP2, sequence parallel runs
beside DDP, FSDP2 or tensor parallel, expert parallel beside DDP or FSDP2).
"""

from dataclasses import dataclass

from swiftlm.plan.shape import ModelShape

# How the data-parallel replicas hold the model state.
DDP, ZERO1, ZERO2, ZERO3, FSDP2 = "ddp", "zero1", "zero2", "zero3", "fsdp2"
SHARDINGS = (DDP, ZERO1, ZERO2, ZERO3, FSDP2)
# How a sequence-parallel group runs attention over its shards.
ULYSSES, RING = "ulysses", "ring"


@dataclass(frozen=True)
class Layout:
    """One way to spread the job over `dp * tp * pp * sp` devices (`ep` splits the `dp`
    replicas into groups that share out the experts; it adds no devices)."""

    sharding: str  # one of SHARDINGS
    dp: int
    tp: int = 1
    pp: int = 1
    offload: bool = False  # optimizer states (and ZeRO-3/FSDP2 weights) in CPU memory
    sp: int = 1  # sequence-parallel ranks per replica, each holding a shard of every row
    sp_impl: str = ULYSSES  # ULYSSES or RING
    ep: int = 1  # expert-parallel ranks: each holds 1/ep of every MoE layer's experts

    @property
    def name(self) -> str:
        base = {DDP: "DDP", ZERO1: "ZeRO-1", ZERO2: "ZeRO-2", ZERO3: "ZeRO-3", FSDP2: "FSDP2"}
        text = base[self.sharding] + (" + offload" if self.offload else "")
        replicas = f" dp{self.dp}" if self.dp > 1 else ""
        if self.tp > 1:
            text = f"TP{self.tp}" + (f" x {text}{replicas}" if self.dp > 1 else "")
        elif self.pp > 1:
            text = f"PP{self.pp}" + (f" x {text}{replicas}" if self.dp > 1 else "")
        elif self.sp > 1:  # DDP or FSDP2 still spans the group's ranks: always named
            ring = " ring" if self.sp_impl == RING else ""
            text = f"SP{self.sp}{ring} x {text}{replicas}"
        elif self.ep > 1:
            text += f" + EP{self.ep}"
        elif self.dp == 1:
            text = "single"
        return text

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def gradient_ranks(self) -> int:
        """Ranks whose gradients are reduced together (and over which ZeRO and FSDP2 shard):
        the replicas and, within each, the sequence shards (distributed/mesh.py)."""
        return self.dp * self.sp

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
        if self.world == 1:
            return ["--strategy", "single"]
        return self.split_flags() + self.sharding_flags()

    def sharding_flags(self) -> list[str]:
        """The flags of how the replicas hold the model state (what `--strategy auto` picks)."""
        if self.deepspeed:
            return ["--deepspeed", self.sharding + ("_offload" if self.offload else "")]
        if self.sharding == FSDP2:
            return ["--fsdp", "fsdp2"] + (["--fsdp_offload", "true"] if self.offload else [])
        return [] if self.tp * self.pp > 1 else ["--strategy", "ddp"]

    def split_flags(self) -> list[str]:
        """The flags of the model-parallel sizes (TP, PP, SP and its attention, EP)."""
        flags = []
        if self.tp > 1:
            flags += ["--tensor_parallel_size", str(self.tp)]
        if self.pp > 1:
            flags += ["--pipeline_parallel_size", str(self.pp)]
        if self.sp > 1:
            flags += ["--sequence_parallel_size", str(self.sp)]
            flags += ["--sequence_parallel_impl", RING] if self.sp_impl == RING else []
        if self.ep > 1:
            flags += ["--expert_parallel_size", str(self.ep)]
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
    layouts += _sequence_parallel_layouts(world, shape)
    experts, left_out = _expert_parallel_layouts(world, shape)
    return layouts + experts, skipped + left_out


def _sequence_parallel_layouts(world: int, shape: ModelShape) -> list[Layout]:
    """SP layouts beside DDP or FSDP2 (config/rules.py refuses SP with TP, PP and DeepSpeed):
    Ulysses where it gives each rank 1/sp of the heads and of the key/value heads, ring
    attention (whole key/value shards round the group) at any size."""
    layouts = []
    for sp in divisors(world):
        impls = ([ULYSSES] if ulysses_applies(shape, sp) else []) + [RING]
        layouts += [Layout(s, world // sp, sp=sp, sp_impl=i) for i in impls for s in (DDP, FSDP2)]
    return layouts


def ulysses_applies(shape: ModelShape, sp: int) -> bool:
    """Ulysses gives each of the sp ranks 1/sp of the heads and of the key/value heads."""
    return shape.num_heads % sp == 0 and shape.num_kv_heads % sp == 0


def _expert_parallel_layouts(world: int, shape: ModelShape) -> tuple[list, list]:
    """EP layouts of an MoE model beside DDP and FSDP2 (the engine
    distributed/expert_strategy.py runs), and (name, reason) for sizes that do not apply;
    nothing for a dense model.
    Expert-parallel ranks are a sub-split of the replicas: `ep` divides `dp`, here the world."""
    if not shape.num_experts:
        return [], []
    if shape.adapted_experts:
        reason = (
            "LoRA adapters on the stacked experts span every expert and cannot be split with "
            "them (--train_type full, or --target_modules q_proj k_proj v_proj o_proj)"
        )
        return [], [("EP", reason)]
    layouts, skipped = [], []
    for ep in divisors(world):
        if shape.num_experts % ep:
            reason = f"the model's {shape.num_experts} experts are not divisible by {ep}"
            skipped.append((f"EP{ep}", reason))
        else:
            layouts += [Layout(DDP, world, ep=ep), Layout(FSDP2, world, ep=ep)]
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
