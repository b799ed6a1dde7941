"""Rules of `--optim` (see rules.py): which optimizers each engine can hand its parameters to,
and what the low-rank projections need."""

from swiftlm.config.checks import Rule
from swiftlm.train.config import DEEPSPEED_CAPABLE, DTENSOR_CAPABLE, LOW_RANK_PROJECTION


def _shards_parameters(d) -> bool:
    """FSDP2 or tensor parallel: the optimizer gets DTensor parameters."""
    return d.fsdp is not None or d.strategy in ("fsdp2", "tp") or d.tensor_parallel_size > 1


def _deepspeed(d) -> bool:
    return d.deepspeed is not None or d.strategy == "deepspeed"


OPTIM_RULES = (
    Rule(
        "optim_takes_dtensors",
        lambda c, f: _shards_parameters(c.dist) and c.train.optim not in DTENSOR_CAPABLE,
        "--optim {optim} updates plain tensors only (its kernels fail on the DTensor "
        "parameters of FSDP2 and tensor parallel); use one of "
        + ", ".join(DTENSOR_CAPABLE)
        + ", or train with DDP (--strategy ddp) or one process",
    ),
    Rule(
        "optim_under_deepspeed",
        lambda c, f: _deepspeed(c.dist) and c.train.optim not in DEEPSPEED_CAPABLE,
        "--optim {optim} with --deepspeed: DeepSpeed hands the optimizer flat 1-D partitions "
        "of the weights, so only an elementwise optimizer updates them as it would the "
        "weights; use " + " or ".join(DEEPSPEED_CAPABLE) + ", or train with DDP or FSDP2",
    ),
    Rule(
        "low_rank_projection_needs_full",
        lambda c, f: c.train.optim in LOW_RANK_PROJECTION and c.tuner.train_type != "full",
        "--optim {optim} projects the gradients of full weight matrices; with --train_type "
        "{train_type} only small adapters train: use --train_type full, or adamw_torch for "
        "the adapters",
    ),
    Rule(
        "optim_target_modules_need_projection",
        lambda c, f: (
            c.train.optim_target_modules is not None and c.train.optim not in LOW_RANK_PROJECTION
        ),
        "--optim_target_modules chooses the layers of --optim "
        + " / ".join(LOW_RANK_PROJECTION)
        + "; --optim {optim} does not use it: drop it",
    ),
)
