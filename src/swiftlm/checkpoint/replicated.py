"""One full copy of the weights and optimizer: what one process or DDP writes (replicas are
identical, so rank 0 writes it) and what they read back.

A folder saved sharded (`dcp/`, FSDP2 or tensor parallel) loads here too: DCP reshards it to
the full tensors of this process.
"""

from pathlib import Path

from swiftlm.checkpoint.sharded import SHARDED_DIR, load_sharded_state
from swiftlm.checkpoint.tensors import load_model_weights, read_optimizer, save_optimizer


def save_weights_and_optimizer(folder: Path, model, optimizer) -> None:
    """Weights as `save_pretrained` writes them (loadable as is) + the optimizer state."""
    model.save_pretrained(folder, safe_serialization=True)
    save_optimizer(folder, optimizer)


def load_weights_and_optimizer(folder: Path, model, optimizer) -> None:
    """Load a checkpoint into an unsharded model, in place."""
    if (folder / SHARDED_DIR).is_dir():
        load_sharded_state(folder, model, optimizer)
        return
    saved = read_optimizer(folder)  # first: a folder without one fails before any change
    load_model_weights(folder, model)
    optimizer.load_state_dict(saved)
