"""A nested state (dicts, lists, tensors, numbers, strings) as one safetensors file and one JSON
file: how a rank's own state (an online method's pending completions, gradient compression's
residuals) is kept in a checkpoint without pickle.

Tensors go to `<name>.safetensors` under keys `t0`, `t1` ...; the JSON holds the structure
with `{"__tensor__": "t0"}` where each tensor was (tuples as `{"__tuple__": [...]}`, so they
come back as tuples). Anything else (an arbitrary object) is refused at save time: it could
only be stored by pickling it, and loading a pickle can run code.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from swiftlm.errors import CheckpointError

TENSOR, TUPLE = "__tensor__", "__tuple__"
FORMAT = "swiftlm-tree-1"


def save_tree(folder: Path, name: str, tree) -> None:
    """Write `<name>.safetensors` (possibly empty) and `<name>.json` in `folder`."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(tree, tensors, path=name)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    document = {"format": FORMAT, "tree": structure}
    (folder / f"{name}.json").write_text(json.dumps(document))


def load_tree(folder: Path, name: str):
    """The tree `save_tree(folder, name, ...)` wrote (tensors on the CPU)."""
    meta, data = folder / f"{name}.json", folder / f"{name}.safetensors"
    if not meta.is_file() or not data.is_file():
        raise CheckpointError(f"{folder} has no {meta.name} and {data.name}")
    document = json.loads(meta.read_text())
    if document.get("format") != FORMAT:
        raise CheckpointError(f"{meta} is not a swiftlm state file (format {FORMAT} expected)")
    return _unflatten(document["tree"], load_file(str(data)))


def _flatten(value, tensors: dict, path: str):
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        # safetensors stores dense, contiguous, unshared tensors only
        tensors[key] = value.detach().cpu().contiguous().clone()
        return {TENSOR: key}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise CheckpointError(f"{path}: a dict with non-string keys cannot be saved as JSON")
        if TENSOR in value or TUPLE in value:
            raise CheckpointError(f"{path}: the keys {TENSOR}/{TUPLE} are reserved")
        return {k: _flatten(v, tensors, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TUPLE: [_flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(
        f"{path}: a {type(value).__name__} cannot be saved without pickle; a state to "
        "checkpoint may hold tensors, numbers, strings, lists and dicts only"
    )


def _unflatten(value, tensors: dict):
    if isinstance(value, dict):
        if TENSOR in value:
            return tensors[value[TENSOR]]
        if TUPLE in value:
            return tuple(_unflatten(v, tensors) for v in value[TUPLE])
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value
