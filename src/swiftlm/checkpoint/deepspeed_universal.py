"""Resuming a DeepSpeed ZeRO checkpoint on another number of data-parallel ranks (an elastic
job's membership change), through DeepSpeed's universal checkpoint format.

ZeRO saves each rank's partition of the optimizer state (`zero_pp_rank_<r>_..._optim_
states.pt`; ZeRO-3 the weights too); a world of another size partitions differently, and
DeepSpeed's own loader needs the same size. Its universal format holds every parameter's
fp32 weight and optimizer state whole (`zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`), and any
world can load it:

1. rank 0 converts `<checkpoint>/deepspeed/state` into `<checkpoint>/deepspeed/state_universal`
   (`deepspeed.checkpoint.ds_to_universal`, in this process; a `.done` file written last
   marks a whole conversion, which later resumes reuse);
2. every rank loads it with the engine's `load_universal_checkpoint` switched on.

Both run inside `checkpoint.deepspeed.weights_only_torch_load`: DeepSpeed's files are read
weights-only, as for an unchanged world.
"""

import argparse
import shutil
from pathlib import Path

from swiftlm.errors import CheckpointError

UNIVERSAL_TAG = "state_universal"
DONE = ".done"
OPTIMIZER_FILES = "*zero_pp_rank_*_optim_states.pt"


def saved_ranks(state_dir: Path) -> int:
    """The data-parallel ranks that wrote a ZeRO checkpoint (one optimizer file each)."""
    return len(list(state_dir.glob(OPTIMIZER_FILES)))


def needs_universal(state_dir: Path, engine) -> bool:
    """Whether this engine cannot read `state_dir` itself: ZeRO saved on another
    data-parallel size (without ZeRO the state is whole: read as it is)."""
    stage = engine.zero_optimization_stage()
    ranks = saved_ranks(state_dir)
    return stage in (1, 2, 3) and ranks > 0 and ranks != engine.dp_world_size


def convert(state_dir: Path, log) -> Path:
    """`state_dir` in the universal format, beside it (made once; rank 0 only)."""
    target = state_dir.parent / UNIVERSAL_TAG
    if (target / DONE).is_file():
        return target
    if target.exists():  # an interrupted conversion
        shutil.rmtree(target)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = argparse.Namespace(
        input_folder=str(state_dir),
        output_folder=str(target),
        num_extract_workers=1,  # in this process: no pool of workers that re-import torch
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # swiftlm's engine state has no Megatron-style `universal_checkpoint_info` (no tensor
        # parallel layout to describe): DeepSpeed then assumes plain, unsplit parameters.
        inject_missing_state=True,
    )
    log(
        f"{state_dir.parent.parent.name}: ZeRO state of {saved_ranks(state_dir)} ranks; "
        f"converting it to DeepSpeed's universal checkpoint format in {target}"
    )
    try:
        ds_to_universal(args)
    except Exception as exc:  # DeepSpeed's own assertions and errors, named here
        raise CheckpointError(
            f"{state_dir}: DeepSpeed's universal checkpoint conversion failed ({exc}); resume "
            f"on {saved_ranks(state_dir)} data-parallel ranks, which read it as it is"
        ) from exc
    (target / DONE).write_text("")
    return target


def load_resized(state_dir: Path, engine) -> bool:
    """Load the ZeRO checkpoint in `state_dir` into `engine` if it was saved on another
    data-parallel size (converted to the universal format by rank 0 first; every rank calls
    it); False: nothing done, the engine reads it as it is."""
    import torch.distributed as dist

    if not needs_universal(state_dir, engine):
        return False
    if dist.get_rank() == 0:
        convert(state_dir, lambda line: print(line, flush=True))
    dist.barrier()
    engine._config.load_universal_checkpoint = True  # read by engine.load_checkpoint
    try:
        engine.load_checkpoint(
            str(state_dir.parent),
            tag=UNIVERSAL_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
    finally:
        engine._config.load_universal_checkpoint = False  # later saves are ordinary ZeRO
    return True
