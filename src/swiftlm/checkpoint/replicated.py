"""One full copy of the weights and optimizer: what one process or DDP writes (replicas are
identical, so rank 0 writes it) and what they read back.

Two formats: the standard one (weights as `save_pretrained` writes them, loadable as is, and
the optimizer files), or blocks (--incremental_checkpoints, `blocks.py`): the same tensors,
under the same names, in content-addressed blocks shared by the run's checkpoints, beside the
model's or adapter's config files. Either is written now or, with a Staging copy of the
tensors, by a background thread (`async_write.py`): `prepare_write` returns the write.

A folder saved sharded (`dcp/`, FSDP2 or tensor parallel) loads here too: DCP reshards it to
the full tensors of this process.
"""

import copy
import json
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save_file

from swiftlm.checkpoint import blocks
from swiftlm.checkpoint.async_write import Staging
from swiftlm.checkpoint.sharded import SHARDED_DIR, load_sharded_state
from swiftlm.checkpoint.tensors import (
    OPTIMIZER_META,
    OPTIMIZER_TENSORS,
    load_model_weights,
    optimizer_to_files,
    read_optimizer,
    save_optimizer,
    tied_parameter_names,
)


def save_weights_and_optimizer(folder: Path, model, optimizer) -> None:
    """Weights as `save_pretrained` writes them (loadable as is) + the optimizer state."""
    model.save_pretrained(folder, safe_serialization=True)
    save_optimizer(folder, optimizer)


def prepare_write(
    folder: Path, model, optimizer, incremental: bool, staging: Staging | None = None
) -> Callable[[], object]:
    """The write of this checkpoint's weights and optimizer, to call now or in a background
    thread. With `staging` the tensors are copied first (now), so training may go on while
    the write runs; without, the write reads the live tensors and must run before training
    continues. Small files (configs, optimizer.json) are written now."""
    if not incremental and staging is None:
        return lambda: save_weights_and_optimizer(folder, model, optimizer)
    copier = staging.copy if staging is not None else None
    opt_tensors, opt_meta = optimizer_to_files(optimizer, copier)
    (folder / OPTIMIZER_META).write_text(json.dumps(opt_meta))
    if incremental:
        weights = saved_weights(model)
        if staging is not None:
            weights = staging.copy(weights, prefix="model.")
        write_model_configs(folder, model)
        groups = {blocks.MODEL_GROUP: weights, blocks.OPTIMIZER_GROUP: opt_tensors}
        return lambda: blocks.write_block_checkpoint(folder, groups)
    state = staging.copy(_state_to_save(model), prefix="model.")

    def write_standard() -> None:
        model.save_pretrained(folder, safe_serialization=True, state_dict=state)
        save_file(opt_tensors, str(folder / OPTIMIZER_TENSORS))

    return write_standard


def _state_to_save(model) -> dict:
    """The state dict `save_pretrained` picks its weights from; for an adapter, only what
    the adapter file can hold (its weights, fully trained modules), not the frozen base."""
    state = model.state_dict()
    if not hasattr(model, "peft_config"):
        return state
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    return {
        k: v for k, v in state.items() if k in trained or "lora_" in k or "modules_to_save" in k
    }


def saved_weights(model) -> dict:
    """The weights under the names `save_pretrained` gives them: an adapter's as peft saves
    it; a full model's state dict without the tied copies (safetensors stores one)."""
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    tied = tied_parameter_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in tied}


def write_model_configs(folder: Path, model) -> None:
    """The config files `save_pretrained` writes next to the weights (the adapter's, or the
    model's and its generation config)."""
    if hasattr(model, "peft_config"):
        for name, config in model.peft_config.items():
            saved = copy.deepcopy(config)
            saved.inference_mode = True  # as peft writes it
            saved.save_pretrained(str(folder if name == "default" else folder / name))
        return
    model.config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(folder)


def load_weights_and_optimizer(folder: Path, model, optimizer) -> None:
    """Load a checkpoint into an unsharded model, in place."""
    if (folder / SHARDED_DIR).is_dir():
        load_sharded_state(folder, model, optimizer)
        return
    saved = read_optimizer(folder)  # first: a folder without one fails before any change
    load_model_weights(folder, model)
    optimizer.load_state_dict(saved)
