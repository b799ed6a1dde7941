"""The global batch of a training run, kept when the number of data-parallel ranks changes:
an elastic job's membership change (`--nnodes MIN:MAX`), or a resume on another number of
processes.

global batch = rows per rank micro-batch x data-parallel ranks x gradient accumulation: the
rows of one optimizer step (with --max_tokens_per_batch, budget micro-batches: a rank's
micro-batch is one budget-filled micro-batch). The data order does not depend on the ranks
(`batching`): the same global batch is the same rows in every step, so on fewer ranks the
gradient accumulation grows and the optimization does not change.

An elastic job fixes its global batch from its flags at its largest size, --nproc_per_node x
MAX nodes: --gradient_accumulation_steps counts micro-batches at full size, whichever nodes
arrive first. Every checkpoint records it (`trainer_state.json`: `global_batch`), and a
resumed run must keep it (`resume_match`).
"""

from dataclasses import dataclass

from swiftlm.config import TrainConfig
from swiftlm.config.checks import flag_values
from swiftlm.distributed.config import node_range
from swiftlm.errors import CheckpointError, ConfigError
from swiftlm.train.batching import BatchPlan, DataPosition, convert_position, micro_batch_units

GLOBAL_BATCH = "global_batch"  # trainer_state.json: rows (or budget micro-batches) per step
MICRO_BATCH_UNITS = "micro_batch_units"  # trainer_state.json: the same per global micro-batch


@dataclass(frozen=True)
class BatchShape:
    """How a run cuts its global batch: per rank micro-batch x ranks x accumulation."""

    per_rank: int  # rows of a rank micro-batch (a token budget: 1 budget micro-batch)
    ranks: int  # data-parallel ranks
    accumulation: int
    budget: bool  # --max_tokens_per_batch: counted in budget micro-batches, not rows

    @property
    def size(self) -> int:
        return self.per_rank * self.ranks * self.accumulation

    def __str__(self) -> str:
        unit = "budget micro-batches" if self.budget else "rows"
        per_rank = "" if self.budget else f"{self.per_rank} per device x "
        ranks = f"{self.ranks} data-parallel rank{'s' if self.ranks > 1 else ''}"
        return f"{self.size} {unit} per step ({per_rank}{ranks} x {self.accumulation} accumulation)"


def data_parallel(flags, world_size: int) -> int:
    """The data-parallel ranks of a run: its processes over its tensor, sequence and pipeline
    groups (which each read one rank's rows). `flags`: a TrainConfig, or the flat flags of a
    saved one."""
    if isinstance(flags, TrainConfig):
        flags = flag_values(flags)
    names = ("tensor_parallel_size", "pipeline_parallel_size", "sequence_parallel_size")
    split = 1
    for name in names:
        split *= flags.get(name) or 1
    return max(world_size // split, 1)


def planned_world(cfg: TrainConfig, world_size: int) -> int:
    """The world the flags size the global batch for: an elastic job's largest, else this."""
    if cfg.dist.elastic:
        return cfg.dist.nproc_per_node * node_range(cfg.dist.nnodes)[1]
    return world_size


def shape_of(flags: dict, world_size: int) -> BatchShape:
    """The batch shape of flat flags (a saved config.yaml, or `flag_values(cfg)`) on
    `world_size` processes."""
    budget = (flags.get("max_tokens_per_batch") or 0) > 0
    return BatchShape(
        per_rank=1 if budget else int(flags.get("per_device_train_batch_size") or 0),
        ranks=data_parallel(flags, world_size),
        accumulation=int(flags.get("gradient_accumulation_steps") or 1),
        budget=budget,
    )


def planned_shape(cfg: TrainConfig, world_size: int) -> BatchShape:
    """The batch shape the flags ask for (an elastic job: at its largest size)."""
    return shape_of(flag_values(cfg), planned_world(cfg, world_size))


def accumulation_for(global_batch: int, cfg: TrainConfig, world_size: int) -> int:
    """The gradient accumulation that makes `global_batch` on `world_size` processes; a
    ConfigError naming the numbers when it cannot."""
    shape = shape_of(flag_values(cfg), world_size)
    per_micro_batch = shape.per_rank * shape.ranks
    if global_batch % per_micro_batch:
        unit = "budget micro-batches" if shape.budget else "rows"
        per_rank = "" if shape.budget else f"{shape.per_rank} per device x "
        raise ConfigError(
            f"global batch {global_batch} {unit} per step cannot be kept on {world_size} "
            f"processes: {per_rank}{shape.ranks} data-parallel ranks = {per_micro_batch} per "
            f"micro-batch does not divide it; run on a number of processes whose micro-batch "
            f"divides {global_batch} (with --nnodes MIN:MAX: choose MIN and MAX so that every "
            "size in between does), or start a new run"
        )
    return global_batch // per_micro_batch


def batch_record(plan: BatchPlan, args, dp_size: int) -> dict:
    """What a checkpoint records of its batches (`trainer_state.json`): the global batch
    (rows or budget micro-batches per step) and the global micro-batch the data position
    counts (`batching.micro_batch_units`)."""
    budget = plan.max_tokens > 0
    shape = BatchShape(
        per_rank=1 if budget else args.per_device_train_batch_size,
        ranks=dp_size,
        accumulation=args.gradient_accumulation_steps,
        budget=budget,
    )
    return {GLOBAL_BATCH: shape.size, MICRO_BATCH_UNITS: micro_batch_units(plan)}


def resumed_position(saved: dict, plan: BatchPlan, folder, log) -> DataPosition:
    """The checkpoint's data position as a micro-batch index of this run's plan: the same
    rows consumed, whatever the data-parallel size was when it was saved."""
    position = DataPosition(saved["epoch"], saved["micro_batch"])
    saved_units, units = saved.get(MICRO_BATCH_UNITS), micro_batch_units(plan)
    if saved_units is None or saved_units == units:  # the same layout (or an older swiftlm's)
        return position
    if position.micro_batch == 0:  # the start of an epoch is the start on any number of ranks
        return position
    try:
        converted = convert_position(position, saved_units, units)
    except ValueError as exc:
        raise CheckpointError(
            f"{folder}: its data position, {exc}: resume on the number of processes that saved it"
        ) from None
    unit = "budget micro-batches" if plan.max_tokens else "rows"
    log(
        f"data position: micro-batch {position.micro_batch} of epoch {position.epoch} at "
        f"{saved_units} {unit} per global micro-batch is micro-batch {converted.micro_batch} "
        f"at {units} (the same {position.micro_batch * saved_units} {unit} consumed)"
    )
    return converted
