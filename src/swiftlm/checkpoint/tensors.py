"""Weights, optimizer and RNG state as safetensors + JSON: nothing on a load path unpickles.

The model or adapter is written exactly as `save_pretrained` writes it, so a checkpoint
folder loads with transformers/peft as is. torch's index-keyed optimizer state is split into
flat tensors (`optimizer.safetensors`) and JSON (`optimizer.json`: param groups, scalars).
A folder in block format (--incremental_checkpoints, `blocks.py`) holds both kinds of
tensors in its manifest's blocks instead; the readers here take either.
"""

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from swiftlm.checkpoint import blocks
from swiftlm.errors import CheckpointError

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
RNG_TENSORS = "rng.safetensors"


# ---- optimizer ------------------------------------------------------------------------------


def optimizer_to_files(optimizer: torch.optim.Optimizer, to_cpu=None) -> tuple[dict, dict]:
    """Split `optimizer.state_dict()` into flat tensors and JSON-able metadata. `to_cpu`:
    how the tensors are brought to CPU (default: `.cpu()`, which does not copy CPU tensors;
    a background save passes a copier, `async_write.Staging.copy`)."""
    state_dict = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, param_state in state_dict["state"].items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value
            else:
                scalars[f"{index}.{key}"] = value
    if to_cpu is None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    else:
        tensors = to_cpu(tensors)
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_from_files(tensors: dict, meta: dict) -> dict:
    state: dict[int, dict] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        index, key = flat.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_optimizer(folder: Path, optimizer) -> None:
    tensors, meta = optimizer_to_files(optimizer)
    save_file(tensors, str(folder / OPTIMIZER_TENSORS))
    (folder / OPTIMIZER_META).write_text(json.dumps(meta))


def read_optimizer(folder: Path) -> dict:
    """The optimizer state dict saved in `folder` (index-keyed, as torch's)."""
    if not (folder / OPTIMIZER_META).is_file():
        raise CheckpointError(
            f"{folder} has no {OPTIMIZER_META}: it holds weights only, or was written by "
            "another engine (pipeline stages, DeepSpeed); resume it with the settings that saved it"
        )
    meta = json.loads((folder / OPTIMIZER_META).read_text())
    if blocks.is_block_checkpoint(folder):
        return optimizer_from_files(blocks.read_group(folder, blocks.OPTIMIZER_GROUP), meta)
    return optimizer_from_files(load_file(str(folder / OPTIMIZER_TENSORS)), meta)


# ---- RNG ------------------------------------------------------------------------------------


def capture_rng() -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    return tensors, meta


def restore_rng(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def rng_file(rank: int) -> str:
    """Each rank has its own random streams (dropout masks differ per rank)."""
    return RNG_TENSORS if rank == 0 else f"rng-rank{rank}.safetensors"


def save_rng(folder: Path, rank: int) -> None:
    tensors, meta = capture_rng()
    save_file(tensors, str(folder / rng_file(rank)))
    (folder / f"{rng_file(rank)}.json").write_text(json.dumps(meta))


def load_rng(folder: Path, rank: int) -> bool:
    """Restore this rank's random streams; False when the folder has none for it."""
    path = folder / rng_file(rank)
    if not path.is_file():
        return False
    restore_rng(load_file(str(path)), json.loads(path.with_name(path.name + ".json").read_text()))
    return True


# ---- weights --------------------------------------------------------------------------------


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All weights of a model/adapter folder: its safetensors files (sharded or not), or
    the blocks of a block-format checkpoint."""
    if blocks.is_block_checkpoint(folder):
        return blocks.read_group(folder, blocks.MODEL_GROUP)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        if file.name != OPTIMIZER_TENSORS and not file.name.startswith("rng"):
            weights.update(load_file(str(file)))
    return weights


def load_model_weights(folder: Path, model) -> None:
    """Load saved weights into the live model (peft adapter or full model), strictly."""
    weights = read_weights(folder)
    if (folder / "adapter_config.json").is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise CheckpointError(f"{folder}: adapter has unexpected weights {unexpected[:5]}")
        return
    expected = model.state_dict().keys()
    if any(name not in expected for name in weights):  # saved under converted names
        from swiftlm.checkpoint.converted import to_model_names

        weights = to_model_names(model, weights, [k for k in expected if k not in weights])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = tied_parameter_names(model)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: weights do not match the model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}); was it saved from a different model?"
        )


def tied_parameter_names(model) -> set[str]:
    """Names that share storage with an earlier parameter (save_pretrained drops them)."""
    first_name: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            tied.add(name)
        else:
            first_name[id(param)] = name
    return tied
