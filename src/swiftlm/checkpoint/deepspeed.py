"""DeepSpeed's own checkpoint state inside a swiftlm checkpoint folder: `deepspeed/state/`.

DeepSpeed's engine owns the partitioned weights and optimizer, so it writes and reads them
itself (its files, its format); swiftlm keeps the folder layout, the consolidated model or
adapter beside it, and the COMPLETE marker.
"""

from pathlib import Path

from swiftlm.errors import CheckpointError

ENGINE_STATE_DIR = "deepspeed"
ENGINE_TAG = "state"


def save_engine_state(folder: Path, engine) -> None:
    """Every rank calls it: each writes its partitions."""
    engine.save_checkpoint(str(folder / ENGINE_STATE_DIR), tag=ENGINE_TAG)


def load_engine_state(folder: Path, engine) -> None:
    state_dir = folder / ENGINE_STATE_DIR
    if not state_dir.is_dir():
        raise CheckpointError(
            f"{folder} was not written by DeepSpeed (no {ENGINE_STATE_DIR}/); resume it with "
            "the strategy that saved it"
        )
    # The learning-rate schedule is swiftlm's, restored from trainer_state.json.
    engine.load_checkpoint(
        str(state_dir), tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
    )
