"""Tensor parallel with DTensor: each decoder block's projections are split over the ranks.

The plan is Megatron's, for Llama/Qwen/Mistral-style blocks: q/k/v and gate/up are split by
output features (column-wise), o and down by input features (row-wise), so each block needs one
all-reduce in attention and one in the MLP. Embeddings, norms and the LM head stay replicated.
Every rank of a TP group sees the same batch. With more processes than
`--tensor_parallel_size`, the groups form the second axis of a 2-D device mesh and FSDP2
shards every block over it (data parallel across groups, tensor parallel within one).
"""

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from swiftlm.distributed.common import clip_then_step
from swiftlm.distributed.env import DistContext
from swiftlm.distributed.fsdp2 import (
    gather_full_weights,
    load_sharded_state,
    mixed_precision_policy,
    reshard,
    save_sharded_state,
)
from swiftlm.errors import ConfigError
from swiftlm.train import checkpoint as ckpt

# Llama-family block: module path inside a decoder layer -> split style.
BLOCK_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def decoder_layers(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(
            f"--strategy tp: {type(model).__name__} has no model.layers list of decoder blocks; "
            "tensor parallel supports Llama/Qwen2/Mistral-style models"
        )
    return layers


def check_divisible(model, size: int) -> None:
    config = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % size:
            raise ConfigError(
                f"--tensor_parallel_size {size}: the model's {name} ({value}) is not divisible by it"
            )


class TensorParallelStrategy:
    def __init__(
        self,
        ctx: DistContext,
        device: torch.device,
        size: int,
        compute_dtype: torch.dtype = torch.float32,
    ):
        if ctx.world_size % size:
            raise ConfigError(
                f"--tensor_parallel_size {size} must divide the number of processes "
                f"({ctx.world_size}): the rest of the world forms data-parallel groups"
            )
        self.ctx, self.device, self.size = ctx, device, size
        self.compute_dtype = compute_dtype
        self.groups = ctx.world_size // size  # data-parallel replicas of the TP group

    # Mesh (data, tensor) in row-major order: ranks 0..size-1 form the first TP group.
    dp_rank = property(lambda self: self.ctx.rank // self.size)
    dp_size = property(lambda self: self.groups)

    def wrap(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        if hasattr(model, "peft_config"):
            raise ConfigError(
                "--strategy tp splits full weights; LoRA/DoRA adapters are not supported with it "
                "yet: use --train_type full, or --strategy fsdp2 / --deepspeed for adapters"
            )
        check_divisible(model, self.size)
        mesh = init_device_mesh(
            self.device.type, (self.groups, self.size), mesh_dim_names=("data", "tensor")
        )
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {path: styles[style]() for path, style in BLOCK_PLAN.items()}
        for layer in decoder_layers(model):
            parallelize_module(layer, mesh["tensor"], plan)
        if self.groups > 1:
            self._shard_over_data(model, mesh["data"])
        return model

    def _shard_over_data(self, model, data_mesh) -> None:
        from torch.distributed.fsdp import fully_shard

        policy = mixed_precision_policy(self.device, self.compute_dtype)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=data_mesh, mp_policy=policy)
        fully_shard(model, mesh=data_mesh, mp_policy=policy)

    def attach_optimizer(self, model, optimizer):
        return model, optimizer

    def unwrap(self, model):
        return model

    def no_sync(self, model, sync: bool):
        if self.groups == 1:
            return nullcontext()  # no gradient reduction across TP ranks to postpone
        return _gradient_sync(model, sync)

    def clip_grad_norm(self, model, max_norm: float) -> float:
        """Global norm over sharded (DTensor) and replicated gradients, then scale in place."""
        from torch.distributed.tensor import DTensor

        squares = torch.zeros((), dtype=torch.float64)
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        for grad in grads:
            norm = torch.linalg.vector_norm(grad)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squares += norm.double() ** 2
        total = float(squares.sqrt())
        coef = max_norm / (total + 1e-6)
        if coef < 1:
            for grad in grads:
                grad.mul_(coef)
        return total

    def backward(self, loss, last_micro_batch: bool) -> None:
        loss.backward()

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        return clip_then_step(self, model, optimizer, max_norm, scaler)

    def save_state(self, folder: Path, model, optimizer) -> None:
        self._reshard(model)
        save_sharded_state(folder, model, optimizer)  # tensors via DCP, param groups as JSON
        full = gather_full_weights(model)
        if self.ctx.is_main:
            model.save_pretrained(folder, safe_serialization=True, state_dict=full)

    def load_state(self, folder: Path, model, optimizer) -> None:
        if not (folder / ckpt.SHARDED_DIR).is_dir():
            raise ckpt.CheckpointError(
                f"{folder} has no sharded state ({ckpt.SHARDED_DIR}/); resume it with the "
                "strategy that saved it"
            )
        self._reshard(model)
        load_sharded_state(folder, model, optimizer)

    def save_final(self, model, tokenizer, folder: Path) -> None:
        self._reshard(model)
        full = gather_full_weights(model)  # a collective: every rank takes part
        if self.ctx.is_main:
            ckpt.save_pretrained_atomically(model, tokenizer, folder, state_dict=full)
        self.ctx.barrier()

    def _reshard(self, model) -> None:
        if self.groups > 1:  # FSDP2 leaves blocks gathered after a forward without backward
            reshard(model)


@contextmanager
def _gradient_sync(model, sync: bool):
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
