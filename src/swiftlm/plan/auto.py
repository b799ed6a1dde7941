"""`--strategy auto` for a multi-process `swiftlm sft` / `pt`: the planner's recommendation.

Resolved once, in the launcher before torchrun starts the workers, into the concrete flags
of the chosen layout (`--deepspeed zero2`, `--fsdp fsdp2`, `--strategy ddp` ...) that every
worker then parses alike. One process stays `single`; explicit --deepspeed, --fsdp,
--tensor_parallel_size or --pipeline_parallel_size (or any --strategy but auto) are kept.

Only how the replicas hold the state is chosen (DDP, ZeRO-1/2/3, FSDP2, offload): tensor,
pipeline and sequence parallel would change the job itself (fewer replicas, so a smaller
global batch, or more accumulation to keep it), which the user asks for with their own flags.
With --sequence_parallel_size or --expert_parallel_size given, the plan compares the layouts of
those sizes (and of the attention --sequence_parallel_impl resolves to): DDP or FSDP2, which
is what config/rules.py lets them run beside. Expert parallel is not chosen on its own either:
its sizes are the user's, like the other parallel sizes. The choice depends only on the flags,
the model's config and the devices, so a resumed run gets the same layout.
"""

import importlib.util

from swiftlm.distributed.config import node_range
from swiftlm.errors import SwiftLMError
from swiftlm.plan.devices import GIB, GPUS, Cluster, parse_devices
from swiftlm.plan.layouts import RING, ULYSSES, ulysses_applies

PLANNED_COMMANDS = ("sft", "pt")


def wants_plan(cfg, command: str) -> bool:
    """True when `--strategy auto` is left to the planner: several processes, no engine named."""
    d = cfg.dist
    return (
        command in PLANNED_COMMANDS
        and d.strategy == "auto"
        and d.deepspeed is None
        and d.fsdp is None
        and d.tensor_parallel_size == 1
        and d.pipeline_parallel_size == 1
        and d.nproc_per_node * node_range(d.nnodes)[1] > 1
        and node_range(d.nnodes)[0] == node_range(d.nnodes)[1]  # elastic jobs stay DDP
        and cfg.train.per_device_train_batch_size >= 1
    )


def local_cluster(cfg) -> Cluster:
    """This job's devices: the local GPUs when CUDA is used (table entry by name, memory as
    reported), else CPU processes (the probe)."""
    import torch

    nnodes = node_range(cfg.dist.nnodes)[1]
    per_node = cfg.dist.nproc_per_node
    if cfg.model.device in ("auto", "cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).upper().replace(" ", "")
        key = next((k for k in sorted(GPUS, key=len, reverse=True) if k in name), None)
        if key is None:
            raise SwiftLMError(f"GPU {name} is not in the planner's table")
        memory = torch.cuda.get_device_properties(0).total_memory / GIB
        return parse_devices(f"{per_node}x{key}", nnodes, memory)
    return parse_devices(f"{per_node}xcpu", nnodes)


def resolve_auto_strategy(cfg, command: str, argv: list[str]) -> list[str]:
    """`argv` with the planned layout's flags in place of `--strategy auto`, and one line
    saying what was chosen; unchanged when the planner is not asked or cannot plan."""
    if not wants_plan(cfg, command):
        return argv
    from swiftlm.plan.run import plan_for

    no_deepspeed = importlib.util.find_spec("deepspeed") is None
    try:
        cluster = local_cluster(cfg)
        plan = plan_for(cfg, cluster)
    except SwiftLMError as exc:
        print(f"--strategy auto: could not plan ({exc}); using DDP", flush=True)
        return [*_without_strategy(argv), "--strategy", "ddp"]
    wanted = _asked_sizes(cfg, plan.shape)
    usable = [c for c in plan.candidates if _applicable(c.layout, no_deepspeed, wanted)]
    fitting = [c for c in plan.fitting if _applicable(c.layout, no_deepspeed, wanted)]
    if not usable:
        print("--strategy auto: no planned layout of these sizes to compare; using DDP", flush=True)
        return [*_without_strategy(argv), "--strategy", "ddp"]
    chosen = fitting[0] if fitting else min(usable, key=lambda c: c.memory.peak)
    runner_up = fitting[1] if len(fitting) > 1 else None
    print(auto_line(chosen, runner_up, fits=bool(fitting), change=plan.change), flush=True)
    return [*_without_strategy(argv), *chosen.layout.sharding_flags()]


def _asked_sizes(cfg, shape) -> tuple[int, str, int]:
    """(sequence-parallel size, its attention, expert-parallel size) the flags ask for, the
    attention resolved as distributed/sequence_parallel.py's `resolve_impl` does: `auto` is
    Ulysses where the heads divide, else the ring."""
    d = cfg.dist
    impl = d.sequence_parallel_impl
    if impl == "auto":
        impl = ULYSSES if ulysses_applies(shape, d.sequence_parallel_size) else RING
    return d.sequence_parallel_size, impl, d.expert_parallel_size


def _applicable(layout, no_deepspeed: bool, wanted: tuple[int, str, int]) -> bool:
    """A layout of the asked sizes, without tensor or pipeline parallel, that this
    environment can run (DeepSpeed only when installed)."""
    sp, impl, ep = wanted
    sizes = (layout.sp, layout.sp_impl if layout.sp > 1 else impl, layout.ep) == (sp, impl, ep)
    return sizes and layout.tp == 1 and layout.pp == 1 and not (no_deepspeed and layout.deepspeed)


def auto_line(chosen, runner_up, fits: bool, change: str) -> str:
    flags = " ".join(chosen.layout.sft_flags())
    text = (
        f"--strategy auto: {chosen.layout.name} ({flags}), estimated "
        f"{chosen.memory.peak / GIB:.2f} GiB per process, ~{chosen.time.total_s:.3g} s per step"
    )
    if runner_up is not None:
        text += (
            f"; runner-up {runner_up.layout.name} ({runner_up.memory.peak / GIB:.2f} GiB, "
            f"~{runner_up.time.total_s:.3g} s)"
        )
    if not fits:
        text += f"; nothing is estimated to fit, this needs the least memory ({change or 'no change found'})"
    return text


def _without_strategy(argv: list[str]) -> list[str]:
    """`argv` less any `--strategy X` / `--strategy=X` (the chosen flags replace it)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--strategy":
            skip = True
            continue
        if arg.startswith("--strategy="):
            continue
        out.append(arg)
    return out
