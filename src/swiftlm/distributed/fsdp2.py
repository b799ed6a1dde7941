"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

Every transformer block is one FSDP unit, all-gathered just before it runs and freed after;
the root unit holds the rest (embeddings, final norm, head). Gradients are reduce-scattered
and averaged over ranks, like DDP, so the loop's loss scaling applies unchanged.

A checkpoint keeps the optimizer and trainable weights sharded with torch.distributed.checkpoint
(DCP) in `dcp/`; DCP reshards on load, so a run saved on N ranks resumes on M ranks or on one
process (train/checkpoint.py reads `dcp/` too). Rank 0 also writes the consolidated
model/adapter beside it, so the folder loads with transformers/peft as is. Only tensors go
through DCP (the optimizer's param groups are JSON), and its pickled metadata is read through
an allow-list: loading a checkpoint runs no code of the file's choosing.

With --async_save the shards are copied to memory and written by a background thread while
training goes on; `COMPLETE` is written only once they are all on disk (train/checkpoint.py).

Weights: frozen and trainable parameters of a unit may differ in dtype (bf16 base + fp32
LoRA), trainable ones are float32. On CUDA, weights are gathered in the compute dtype.
"""

import json
import pickle  # only through an allow-list, see _MetadataUnpickler
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from swiftlm.config.sections import DistArguments
from swiftlm.distributed.common import clip_then_step
from swiftlm.distributed.env import DistContext
from swiftlm.errors import CheckpointError, ConfigError
from swiftlm.train import checkpoint as ckpt


class FSDP2Strategy:
    def __init__(
        self,
        ctx: DistContext,
        device: torch.device,
        args: DistArguments | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ):
        self.ctx, self.device, self.compute_dtype = ctx, device, compute_dtype
        self.args = args or DistArguments()
        self._pending: tuple[Future, Path] | None = None  # a background save still writing
        self._save_group = None  # gloo group of background saves, created on first use

    dp_rank = property(lambda self: self.ctx.rank)
    dp_size = property(lambda self: self.ctx.world_size)

    def wrap(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        train_in_float32(model)
        mesh = init_device_mesh(self.device.type, (self.ctx.world_size,))
        policy = mixed_precision_policy(self.device, self.compute_dtype)
        offload = offload_policy(self.device, self.args.fsdp_offload)
        for blocks in find_block_lists(model):
            for i, block in enumerate(blocks):
                # The last block runs first in backward: keeping it gathered saves a gather.
                fully_shard(
                    block,
                    mesh=mesh,
                    mp_policy=policy,
                    offload_policy=offload,
                    reshard_after_forward=i < len(blocks) - 1,
                )
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
        return model

    def attach_optimizer(self, model, optimizer):
        return model, optimizer  # the optimizer steps the local shards of the DTensor params

    def unwrap(self, model):
        return model  # fully_shard works in place: the module is still the model

    @contextmanager
    def no_sync(self, model, sync: bool):
        # Without sync, gradients accumulate unsharded on each rank; the last micro-batch
        # reduce-scatters the sum.
        model.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, model, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # The norm of sharded gradients is a DTensor; its full value is the global norm.
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def backward(self, loss, last_micro_batch: bool) -> None:
        loss.backward()

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        return clip_then_step(self, model, optimizer, max_norm, scaler)

    def save_state(self, folder: Path, model, optimizer) -> Future | None:
        """All ranks write their shards to `dcp/`; rank 0 also writes the full model/adapter."""
        self.wait_for_saves()  # one background save at a time: its data is still staged
        reshard(model)
        group = self._background_group() if self.args.async_save else None
        pending = save_sharded_state(folder, model, optimizer, group)
        self._pending = (pending, folder) if pending is not None else None
        full = gather_full_weights(model)  # a collective: every rank takes part
        if self.ctx.is_main:
            model.save_pretrained(folder, safe_serialization=True, state_dict=full)
        return pending

    def load_state(self, folder: Path, model, optimizer) -> None:
        reshard(model)
        if (folder / ckpt.SHARDED_DIR).is_dir():
            load_sharded_state(folder, model, optimizer)
        else:  # saved by one process or DDP: full tensors, sharded here
            load_full_state(folder, model, optimizer)

    def save_final(self, model, tokenizer, folder: Path) -> None:
        self.wait_for_saves()
        reshard(model)
        full = gather_full_weights(model)  # a collective: every rank takes part
        if self.ctx.is_main:
            ckpt.save_pretrained_atomically(model, tokenizer, folder, state_dict=full)
        self.ctx.barrier()

    def wait_for_saves(self) -> None:
        """Block until the background checkpoint write (if any) is on disk."""
        from torch.distributed.checkpoint.api import CheckpointException

        if self._pending is None:
            return
        (pending, folder), self._pending = self._pending, None
        try:
            pending.result()
        except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
            raise CheckpointError(
                f"writing {folder} in the background failed (it stays incomplete): {exc}"
            ) from exc

    def _background_group(self):
        # Background saves run collectives from their own thread; a separate group keeps
        # them from interleaving with the training loop's collectives.
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        return self._save_group


# ---- sharding -------------------------------------------------------------------------------


def offload_policy(device: torch.device, offload: bool):
    """CPUOffloadPolicy for --fsdp_offload on GPUs. On a CPU the weights are already in CPU
    memory, so there is nothing to move: the default (no offload) policy is used."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy() if offload and device.type == "cuda" else OffloadPolicy()


def mixed_precision_policy(device: torch.device, compute_dtype: torch.dtype):
    """Gather weights in the compute dtype on CUDA; reduce gradients in float32 always.

    On CPU the weights stay as they are and the loop's autocast does the low-precision math.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = device.type == "cuda" and compute_dtype in (torch.bfloat16, torch.float16)
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype if low else None, reduce_dtype=torch.float32
    )


def reshard(model: nn.Module) -> None:
    """Register the sharded parameters everywhere again (local, no communication).

    The root and the last block keep their gathered weights after forward, for backward; a
    forward without backward (evaluation) leaves them gathered, and state dicts would then
    see plain tensors the optimizer does not know.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def train_in_float32(model: nn.Module) -> None:
    """Keep trainable weights in float32, as swiftlm does everywhere.

    FSDP2 reduce-scatters the gradients of a unit together, so its trainable parameters need
    one dtype; frozen ones may differ (bf16 base weights + fp32 LoRA share a unit fine). A
    trainable copy made in the base dtype (peft modules_to_save) would break that.
    """
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def find_block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The lists of transformer blocks: the outermost ModuleLists of same-class modules.

    Models keep them at different paths (model.layers, transformer.h, a vision tower's own
    list ...), and peft adds a prefix; their shape finds them all. Lists nested inside a
    block (such as MoE experts, which ranks run unevenly) stay part of that block's unit.
    """
    found: list[nn.ModuleList] = []
    inside: set[int] = set()
    for module in model.modules():  # parents come before their children
        if id(module) in inside:
            continue
        if _is_block_list(module):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if not found:
        raise ConfigError(
            f"--strategy fsdp2 found no list of transformer blocks in {type(model).__name__} "
            "to shard; use --strategy ddp for this model"
        )
    return found


def _is_block_list(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and len({type(block) for block in module}) == 1
        and any(True for _ in module.parameters())
    )


# ---- checkpoint state -----------------------------------------------------------------------

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


def save_sharded_state(folder: Path, model, optimizer, background_group=None) -> Future | None:
    """Write this rank's shards to `folder/dcp`; every rank calls it (or one process alone).

    With a `background_group` the tensors are copied to memory and written by a thread; the
    returned Future ends, on rank 0, once every rank's shards and the metadata are on disk.
    """
    import torch.distributed.checkpoint as dcp

    tensors, groups = sharded_state(model, optimizer)
    target = folder / ckpt.SHARDED_DIR
    if not dist.is_initialized() or dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
        (target / GROUPS_FILE).write_text(json.dumps(groups))
    if background_group is not None:
        return dcp.async_save(tensors, checkpoint_id=target, process_group=background_group)
    dcp.save(tensors, checkpoint_id=target)
    return None


def load_sharded_state(folder: Path, model, optimizer) -> None:
    """Load `folder/dcp` into the model and optimizer, resharded to this process's share.

    Works sharded under FSDP2 and on a plain model in one process (no process group).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    target = folder / ckpt.SHARDED_DIR
    check_tensors_only(target)
    tensors, _ = sharded_state(model, optimizer)
    try:
        with warnings.catch_warnings():  # one process reading a sharded run is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=target)
    except CheckpointException as exc:
        raise CheckpointError(
            f"{target} does not match this model and optimizer (was it saved with another "
            f"model, --train_type or LoRA settings?): {exc}"
        ) from None
    groups = json.loads((target / GROUPS_FILE).read_text())
    # The keys came from this model; only the frozen ones it left out are "missing".
    set_model_state_dict(model, tensors["model"], options=_state_options(model, strict=False))
    optim = {"state": tensors["optimizer"], "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, optim, options=_state_options(model))


def check_tensors_only(target: Path) -> None:
    """Refuse a `dcp/` folder whose loading could run code.

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

    weights = _by_parameter_name(model, ckpt.read_weights(folder), folder)
    # Frozen weights are not in an adapter checkpoint; trained ones must all be there.
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in weights]
    options = StateDictOptions(full_state_dict=True, strict=False)
    unexpected = set_model_state_dict(model, weights, options=options).unexpected_keys
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: weights do not match the model (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}); was it saved from a different model?"
        )
    meta = json.loads((folder / ckpt.OPTIMIZER_META).read_text())
    saved = ckpt.optimizer_from_files(load_file(str(folder / ckpt.OPTIMIZER_TENSORS)), meta)
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
