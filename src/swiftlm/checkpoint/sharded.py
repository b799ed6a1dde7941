"""Sharded checkpoint state with torch.distributed.checkpoint (DCP), in `dcp/`.

Every rank writes the shards it holds (FSDP2, tensor parallel); DCP reshards on load, so a
run saved on N ranks resumes on M ranks or on one process. Only tensors go through DCP (the
optimizer's param groups are JSON beside them), and DCP's pickled `.metadata` is read through
an allow-list first: loading a checkpoint runs no code of the file's choosing.

With a background process group (--async_save) the shards are copied to memory and written
by a thread while training goes on; `PendingSave` waits for the write.
"""

import json
import pickle  # only through an allow-list, see _MetadataUnpickler
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

from swiftlm.checkpoint.tensors import read_optimizer, read_weights
from swiftlm.errors import CheckpointError

SHARDED_DIR = "dcp"
GROUPS_FILE = "param_groups.json"  # the optimizer's hyper-parameters, beside the tensor shards

# What DCP's pickled `.metadata` may name: its own records, torch.Size/dtype/layout, a path.
METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


def _state_options(model, **kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # An adapter run saves only what trains; the frozen base comes from the base model.
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, **kwargs)


def sharded_state(model, optimizer) -> tuple[dict, list]:
    """(model + optimizer tensors as this rank holds them, the optimizer's param groups).

    Both are keyed by parameter names. Only tensors go through DCP: it pickles anything
    else, and loading pickle can run code; the param groups are plain JSON.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = _state_options(model)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    model_state = get_model_state_dict(model, options=options)
    return {"model": model_state, "optimizer": optim["state"]}, optim["param_groups"]


def _leads(group) -> bool:
    """Whether this process writes the files of its group (or works alone)."""
    return not dist.is_initialized() or dist.get_rank(group) == 0


def save_sharded_state(
    folder: Path, model, optimizer, background_group=None, group=None
) -> Future | None:
    """Write this rank's shards to `folder/dcp`; every rank of `group` (default: all) calls it.

    With a `background_group` the tensors are copied to memory and written by a thread; the
    returned Future ends, on rank 0, once every rank's shards and the metadata are on disk.
    """
    import torch.distributed.checkpoint as dcp

    tensors, groups = sharded_state(model, optimizer)
    target = folder / SHARDED_DIR
    if _leads(group):
        target.mkdir(parents=True, exist_ok=True)
        (target / GROUPS_FILE).write_text(json.dumps(groups))
    if background_group is not None:
        return dcp.async_save(tensors, checkpoint_id=target, process_group=background_group)
    dcp.save(tensors, checkpoint_id=target, process_group=group)
    return None


def load_sharded_state(folder: Path, model, optimizer, group=None) -> None:
    """Load `folder/dcp` into the model and optimizer, resharded to this process's share.

    Works sharded (FSDP2, tensor parallel) and on a plain model in one process.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    target = folder / SHARDED_DIR
    saved = check_tensors_only(target)
    tensors, _ = sharded_state(model, optimizer)
    # A parameter that had no gradient yet when the checkpoint was saved (a vision encoder's
    # layer on steps without images) has no optimizer state there, and gets none here.
    tensors["optimizer"] = {
        name: state
        for name, state in tensors["optimizer"].items()
        if any(f"optimizer.{name}.{key}" in saved for key in state)
    }
    try:
        with warnings.catch_warnings():  # one process reading a sharded run is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=target, process_group=group)
    except CheckpointException as exc:
        raise CheckpointError(
            f"{target} does not match this model and optimizer (was it saved with another "
            f"model, --train_type or LoRA settings?): {exc}"
        ) from None
    groups = json.loads((target / GROUPS_FILE).read_text())
    # The keys came from this model; only the frozen ones it left out are "missing".
    set_model_state_dict(model, tensors["model"], options=_state_options(model, strict=False))
    optim = {"state": tensors["optimizer"], "param_groups": groups}
    # Not strict: the parameters left without state above stay so.
    options = _state_options(model, strict=False)
    set_optimizer_state_dict(model, optimizer, optim, options=options)


def check_tensors_only(target: Path) -> set[str]:
    """Refuse a `dcp/` folder whose loading could run code; return the names it holds.

    DCP unpickles its `.metadata` and would unpickle any non-tensor entry with
    torch.load(weights_only=False). swiftlm writes tensors only: the metadata is read here
    first with an allow-list of DCP's own records, and must list nothing but tensors.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = target / ".metadata"
    if not path.is_file():
        raise CheckpointError(f"{target} has no .metadata: its sharded save never finished")
    with path.open("rb") as file:
        metadata = _MetadataUnpickler(file).load()
    others = [
        key
        for key, entry in metadata.state_dict_metadata.items()
        if not isinstance(entry, TensorStorageMetadata)
    ]
    if others:
        raise CheckpointError(
            f"{target} holds pickled objects ({', '.join(others[:3])}), not only tensors; "
            "swiftlm does not load pickle"
        )
    return set(metadata.state_dict_metadata)


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata records only: no other class or function of the file's choosing."""

    def find_class(self, module: str, name: str):
        allowed = (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise CheckpointError(
                f"the checkpoint metadata names {module}.{name}, which is not DCP metadata; "
                "refusing to unpickle it"
            )
        return super().find_class(module, name)


class PendingSave:
    """The one background (--async_save) checkpoint write that may still be running."""

    def __init__(self):
        self._pending: tuple[Future, Path] | None = None
        self._group = None  # gloo group of background saves, created on first use

    def track(self, future: Future | None, folder: Path) -> None:
        self._pending = (future, folder) if future is not None else None

    def group(self):
        """Background saves run collectives from their own thread; a separate group keeps
        them from interleaving with the training loop's collectives. All ranks call this."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def wait(self) -> None:
        """Block until the background write (if any) is on disk."""
        from torch.distributed.checkpoint.api import CheckpointException

        if self._pending is None:
            return
        (future, folder), self._pending = self._pending, None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
            raise CheckpointError(
                f"writing {folder} in the background failed (it stays incomplete): {exc}"
            ) from exc


# ---- full tensors <-> sharded models ---------------------------------------------------------


def gather_full_weights(model) -> dict:
    """The unsharded weights to save (an adapter's, or the whole model's), on rank 0 only.

    A collective: every rank must call it. The other ranks get an empty dict.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # An adapter is saved alone; a full model needs every weight, frozen or not.
    adapter = hasattr(model, "peft_config")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter)
    return get_model_state_dict(model, options=options)


def load_full_state(folder: Path, model, optimizer) -> None:
    """Load a checkpoint of full tensors (one process, DDP) into the sharded model on each rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = read_optimizer(folder)
    weights = _by_parameter_name(model, read_weights(folder), folder)
    # Frozen weights are not in an adapter checkpoint; trained ones must all be there.
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in weights]
    options = StateDictOptions(full_state_dict=True, strict=False)
    unexpected = set_model_state_dict(model, weights, options=options).unexpected_keys
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: weights do not match the model (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}); was it saved from a different model?"
        )
    set_optimizer_state_dict(
        model,
        optimizer,
        _optimizer_by_name(model, optimizer, saved, folder),
        options=StateDictOptions(full_state_dict=True),
    )


def _by_parameter_name(model, weights: dict, folder: Path) -> dict:
    """Key saved weights by the live model's parameter names.

    A full model is saved under those names already. A peft adapter is saved under names
    without the adapter name; running peft's own save-side renaming over the model's names
    gives the inverse map.
    """
    if not (folder / "adapter_config.json").is_file():
        return weights
    from peft import get_peft_model_state_dict

    names = [name for name, _ in model.named_parameters()]
    markers = {name: torch.tensor(i) for i, name in enumerate(names)}
    saved_as = get_peft_model_state_dict(model, state_dict=markers)
    to_model = {key: names[int(marker)] for key, marker in saved_as.items()}
    unknown = sorted(set(weights) - set(to_model))
    if unknown:
        raise CheckpointError(f"{folder}: adapter has unexpected weights {unknown[:5]}")
    return {to_model[key]: value for key, value in weights.items()}


def _optimizer_by_name(model, optimizer, saved: dict, folder: Path) -> dict:
    """torch's index-keyed optimizer state, keyed by parameter names instead.

    Indices count the parameters of the optimizer's groups in order, which build_optimizer
    makes the same with and without sharding.
    """
    name_of = {id(p): name for name, p in model.named_parameters()}
    order = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved_count = sum(len(group["params"]) for group in saved["param_groups"])
    if saved_count != len(order):
        raise CheckpointError(
            f"{folder}: the optimizer state covers {saved_count} parameters, this run trains "
            f"{len(order)}; was it saved with another --train_type or LoRA settings?"
        )
    return {
        "state": {order[i]: value for i, value in saved["state"].items()},
        "param_groups": [
            {**group, "params": [order[i] for i in group["params"]]}
            for group in saved["param_groups"]
        ],
    }
