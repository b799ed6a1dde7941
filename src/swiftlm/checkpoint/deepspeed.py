"""DeepSpeed's own checkpoint state inside a swiftlm checkpoint folder: `deepspeed/state/`.

DeepSpeed's engine owns the partitioned weights and optimizer, so it writes and reads them
itself (its files, its format); swiftlm keeps the folder layout, the consolidated model or
adapter beside it, and the COMPLETE marker.

Its files are torch pickles, and DeepSpeed reads them with `torch.load(weights_only=False)`,
which runs whatever a file names. While DeepSpeed loads, swiftlm makes every `torch.load`
weights-only (tensors, containers, numbers) with the few classes DeepSpeed's own ZeRO 1-3
checkpoints hold allowed by name (`DEEPSPEED_CLASSES`); anything else is refused with a
CheckpointError before any of it runs.
"""

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from swiftlm.checkpoint.deepspeed_universal import load_resized
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
    with weights_only_torch_load(state_dir):
        # Saved on another number of ranks (an elastic job): through the universal format.
        if load_resized(state_dir / ENGINE_TAG, engine):
            return
        engine.load_checkpoint(
            str(state_dir),
            tag=ENGINE_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )


def deepspeed_classes() -> list:
    """What a ZeRO 1/2/3 checkpoint of DeepSpeed pickles besides tensors and containers
    (found by listing the GLOBAL opcodes of the files the tests write): its loss scaler (a
    plain object even in fp32), the stage enum and, for ZeRO 1/2, the fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_torch_load(state_dir: Path) -> Iterator[None]:
    """Inside: `torch.load` is weights-only with DeepSpeed's classes allowed, whatever its
    caller asks. A file that names anything else raises CheckpointError."""
    original = torch.load

    def safe_load(f, map_location=None, *args, weights_only=None, **kwargs):
        kwargs.pop("pickle_module", None)  # weights-only has its own unpickler
        try:
            with torch.serialization.safe_globals(deepspeed_classes()):
                return original(f, map_location, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{f} in {state_dir} holds pickled objects that are not DeepSpeed's own "
                f"checkpoint state ({str(exc).splitlines()[-1][:200]}); swiftlm does not "
                "unpickle them (loading a pickle can run code). Resume from a checkpoint "
                "this swiftlm wrote"
            ) from None

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original
