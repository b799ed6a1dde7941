"""Parallelisms as ordered functions applied to one DeviceMesh (torchtitan's `parallelize`):

    tensor parallel -> activation checkpointing -> compile -> sequence parallel
        -> expert parallel -> FSDP2 or DDP

Each step changes the model in place (DDP wraps it) and leaves parameter names as they were,
so checkpoints, adapters and state dicts see the usual modules. The order matters: TP turns
block weights into DTensors that FSDP2 then shards on the 2-D (dp, tp) mesh; checkpointing
and compile work per block inside the FSDP units. The same sequence runs on a whole model and
on one pipeline stage (whose blocks are a slice of the model's).
"""

from dataclasses import dataclass

import torch
from torch import nn

from swiftlm.distributed.ddp import apply_ddp
from swiftlm.distributed.expert_parallel import apply_expert_parallel, split_expert_parameters
from swiftlm.distributed.fsdp2 import apply_fsdp2
from swiftlm.distributed.mesh import ParallelDims
from swiftlm.distributed.sequence_parallel import apply_sequence_parallel
from swiftlm.distributed.tp import apply_tensor_parallel
from swiftlm.errors import ConfigError


@dataclass(frozen=True)
class ParallelizeOptions:
    """What `parallelize` applies besides the mesh's splits (from --gradient_checkpointing,
    --torch_compile, the compute dtype and --fsdp_offload)."""

    activation_checkpointing: bool = False
    compile: bool = False
    compute_dtype: torch.dtype = torch.float32
    fsdp_offload: bool = False
    sequence_parallel_impl: str = "auto"


def parallelize(
    model: nn.Module, dims: ParallelDims, mesh, device: torch.device, options: ParallelizeOptions
) -> nn.Module:
    """Apply the parallelisms of `dims` and `options` to `model`, in order; return the model to
    train (a DDP wrapper when the data-parallel replicas use DDP, else `model` itself)."""
    if dims.tp > 1:
        apply_tensor_parallel(model, decoder_layers(model), mesh["tp"])
    if options.activation_checkpointing:
        apply_activation_checkpointing(model)
    if options.compile:
        compile_decoder_layers(model)
    if dims.sp > 1:
        apply_sequence_parallel(model, mesh["sp"], options.sequence_parallel_impl, dims.tp)
    if dims.ep > 1:
        apply_expert_parallel(model, mesh["ep"])
    vision = vision_modules(model)
    reduced = dims.gradient_mesh(mesh) if dims.gradient_ranks > 1 else None
    split = split_expert_parameters(model) if dims.ep > 1 else []  # each rank holds its own
    if reduced is not None and dims.data_parallel == "fsdp2":
        dtype, offload = options.compute_dtype, options.fsdp_offload
        apply_fsdp2(model, reduced, device, dtype, offload, vision, ignored=set(split))
    elif reduced is not None:
        trains_vision = any(p.requires_grad for m in vision for p in m.parameters())
        ignored = [name for name, p in model.named_parameters() if any(p is q for q in split)]
        model = apply_ddp(model, reduced, device, trains_vision, ignored=ignored)
    return model


def vision_modules(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision encoder and aligner (models.vision's part paths, also
    under peft's prefix); [] for a text LM.

    Ranks run them only on micro-batches with images, so one rank may skip them while another
    runs them: DDP then needs unused-parameter detection, and FSDP2 keeps them in its root
    unit (see fsdp2.apply_fsdp2)."""
    from swiftlm.models.vision import is_vision_language, part_prefixes

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not is_vision_language(model_type):
        return []
    prefixes = part_prefixes(model_type)
    paths = set(prefixes["vit"]) | set(prefixes["aligner"])
    found = []
    for name, module in model.named_modules():
        if name.removeprefix("base_model.model.") in paths:
            found.append(module)
    return found


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder blocks (`model.get_decoder().layers`; peft models and pipeline stages
    answer the same), or None."""
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    return layers if isinstance(layers, nn.ModuleList) else None


def apply_activation_checkpointing(model: nn.Module) -> None:
    """--gradient_checkpointing: every decoder block recomputes its activations in backward
    (non-reentrant torch.utils.checkpoint), through transformers' own per-block switch.

    Applied after the tuner: peft models pass it on to the model they wrap."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_decoder_layers(model: nn.Module) -> int:
    """torch.compile each decoder layer in place: parameter names and state dicts stay as
    they are (checkpoints, adapters and FSDP wrapping see the usual modules), and the one
    compiled graph is reused by every layer of the same shape."""
    import shutil

    if not torch.cuda.is_available() and not (shutil.which("g++") or shutil.which("c++")):
        raise ConfigError(
            "--torch_compile on CPU needs a C++ compiler (g++) for torch.compile's inductor; "
            "install one (e.g. apt install g++) or drop --torch_compile"
        )
    layers = decoder_layers(model)
    if layers is None:
        raise ConfigError("--torch_compile: this model has no decoder `layers` to compile")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
