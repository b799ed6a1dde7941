"""Pipeline parallel with `torch.distributed.pipelining`: each rank of a pipeline holds one
stage (pp_stage.py), and a 1F1B schedule streams the step's micro-batches through them.

On the mesh ("pp", "dp", "sp", "tp"; sp is 1 under pipeline parallel) a pipeline is one column of the "pp" dimension; with more
ranks than stages, each data-parallel replica runs its own pipeline on its own slice of the
data, and a stage's gradients are reduced over its replicas (the "dp" dimension) by DDP or
FSDP2, which the schedule drives itself (`parallelize` wraps the stage like a whole model).

The schedule owns forward and backward, so the loop hands it the whole step
(`pipeline_step`); the last stage computes each micro-batch's loss with the method's
`pipeline_loss` and scales it by the loop's normalization. Stages exchange fixed shapes,
which the schedule infers once, at its first step: every step is padded
(`fixed_shape_batches`) to gradient_accumulation_steps micro-batches of
per_device_train_batch_size rows of --max_length tokens. Plain decoder stacks
(Llama/Qwen2/Mistral-style) with untied embeddings; full fine-tuning or LoRA.
"""

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from swiftlm.checkpoint import stages
from swiftlm.checkpoint.async_write import BackgroundWriter, Staging
from swiftlm.checkpoint.folders import save_pretrained_atomically
from swiftlm.checkpoint.sharded import PendingSave
from swiftlm.distributed import gradients
from swiftlm.distributed.env import DistContext, collective_device
from swiftlm.distributed.fsdp2 import reshard
from swiftlm.distributed.mesh import ParallelDims
from swiftlm.distributed.parallelize import ParallelizeOptions, parallelize
from swiftlm.distributed.pp_stage import build_stage
from swiftlm.errors import CheckpointError

# ---- the step's micro-batches ---------------------------------------------------------------


def fixed_shape_batches(
    batches: list[dict], pads: dict, rows: int, width: int, count: int
) -> list[dict]:
    """`count` micro-batches of `rows` x `width` tokens: the shapes every stage expects.

    Every token tensor (named in `pads`) is padded with its pad value to `width` columns and
    `rows` rows; a short step gets fully padded micro-batches, which carry no labels.
    """
    if len(batches) > count or any(b["input_ids"].shape[0] > rows for b in batches):
        raise ValueError(f"a pipeline step holds at most {count} micro-batches of {rows} rows")
    template = batches[0]
    filler = {key: value[:0] for key, value in template.items()}  # no rows: all padding
    out = []
    for batch in [*batches, *[filler] * (count - len(batches))]:
        padded = dict(batch)
        for key, value in pads.items():
            if key in batch:
                padded[key] = _pad_to(batch[key], rows, width, value)
        out.append(padded)
    return out


def _pad_to(tensor: torch.Tensor, rows: int, width: int, value) -> torch.Tensor:
    if tensor.shape[1] > width:
        raise ValueError(f"a micro-batch of {tensor.shape[1]} tokens exceeds --max_length {width}")
    return F.pad(tensor, (0, width - tensor.shape[1], 0, rows - tensor.shape[0]), value=value)


# ---- the schedule's loss --------------------------------------------------------------------


class StepLoss:
    """The last stage's loss for one step. The schedule's target must be a tensor: it is the
    micro-batch's index, and the batch itself is looked up here.

    The unscaled sums are kept per micro-batch: on its first step the schedule also calls the
    loss once on placeholder activations (shape inference), and the real call replaces that.
    """

    def __init__(self, method, batches: list[dict], scale: float):
        self.method, self.batches, self.scale = method, batches, scale
        self.loss_sums: dict[int, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        i = int(index[0])
        loss_sum, _ = self.method.pipeline_loss(logits, self.batches[i])
        self.loss_sums[i] = loss_sum.detach()
        return loss_sum * self.scale

    def total(self) -> float:
        return float(sum(self.loss_sums.values()))


# ---- the strategy ---------------------------------------------------------------------------


class PipelineParallelStrategy:
    pipeline_parallel = True

    def __init__(
        self,
        ctx: DistContext,
        device: torch.device,
        dims: ParallelDims,
        options: ParallelizeOptions,
        shape: tuple[int, int, int],
        async_save: bool = False,
    ):
        self.ctx, self.device, self.dims, self.options = ctx, device, dims, options
        self.async_save = async_save  # plain stages: write checkpoints in the background
        self.saves, self.writer, self.staging = PendingSave(), BackgroundWriter(), Staging()
        # (micro-batches per step, rows per micro-batch, tokens per row): fixed for all steps
        self.micro_batches, self.rows, self.width = shape
        self.pp_rank, self.dp_rank, _ = dims.coordinates(ctx.rank)
        self.dp_size = dims.dp
        self.sp_rank, self.sp_size = 0, 1
        self.mesh = self.schedule = self.model = self.full_model = None
        self.names: dict[str, str] = {}  # stage parameter name -> name in the full model
        self.step_loss: StepLoss | None = None

    def __str__(self) -> str:
        return str(self.dims)

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def wrap(self, model):
        """This rank's stage of `model`, parallelized over its data-parallel replicas."""
        self.mesh = self.dims.build_mesh(self.device.type)
        stage, self.names = build_stage(model, self.pp_rank, self.dims.pp)
        self.full_model = model  # kept for its config and save_pretrained
        return parallelize(stage.to(self.device), self.dims, self.mesh, self.device, self.options)

    def attach_optimizer(self, model, optimizer):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.model = model
        pipe = PipelineStage(model, self.pp_rank, self.dims.pp, self.device, group=self._pp_group())
        self.schedule = Schedule1F1B(
            pipe, n_microbatches=self.micro_batches, loss_fn=self._loss, scale_grads=False
        )
        return model, optimizer

    def _pp_group(self):
        return self.mesh["pp"].get_group()

    def _loss(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.step_loss(logits, index)

    def pipeline_step(self, method, batches: list[dict], scale: float, autocast) -> float:
        """Run the step's micro-batches through the schedule (forward and backward); return the
        step's unscaled loss sum, the same on every stage of this pipeline."""
        fixed = fixed_shape_batches(
            batches, method.token_pads, self.rows, self.width, self.micro_batches
        )
        fixed = [{k: v.to(self.device) for k, v in b.items()} for b in fixed]
        self.step_loss = StepLoss(method, fixed, scale)
        inputs = [torch.cat([b["input_ids"] for b in fixed])] if self.is_first else []
        target = torch.arange(len(fixed), device=self.device) if self.is_last else None
        with autocast(), self._ddp_disarmed():
            self.schedule.step(*inputs, target=target, losses=[], return_outputs=False)
        local = self.step_loss.total() if self.is_last else 0.0
        total = torch.tensor(local, dtype=torch.float64, device=collective_device())
        dist.all_reduce(total, group=self._pp_group())  # only the last stage has it
        return float(total)

    def _ddp_disarmed(self):
        """The schedule arms DDP's reducer itself for the step's last backward; DDP's own
        forward must not (the schedule's first-step shape inference runs one outside its
        no_sync, and the reducer would then count the earlier backwards too)."""
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return nullcontext()

    def unwrap(self, model):
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model, sync: bool):
        return nullcontext()  # the schedule reduces the stage's gradients at its last backward

    def backward(self, loss, last_micro_batch: bool) -> None:
        raise RuntimeError("pipeline parallel runs backward inside its schedule (pipeline_step)")

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        params = model.parameters()
        return gradients.clip_then_step(params, optimizer, max_norm, scaler, self._pp_group())

    def step_metrics(self) -> dict:
        return {}

    def _dp_group(self):
        """Process group of a sharded stage's replicas (DCP writes over it); None if plain."""
        return self.mesh["dp"].get_group() if self.dims.sharded else None

    def save_state(self, folder: Path, model, optimizer):
        """Each stage writes its own state; rank 0 also the consolidated model or adapter.
        With --async_save plain stages write in the background (a Future on rank 0)."""
        self.saves.wait()  # one background save at a time; a failed one stops every rank
        reshard(model)
        stage = self.unwrap(model)
        group, writes = self._dp_group(), self.dp_rank == 0
        if self.async_save and group is None:
            return self._save_in_background(folder, stage, optimizer, writes, model)
        stages.save_stage_state(folder, self.pp_rank, stage, optimizer, writes, group)
        full = self._gather_full_weights(model)
        if self.ctx.is_main:
            self.full_model.save_pretrained(folder, state_dict=full, safe_serialization=True)
        return None

    def _save_in_background(self, folder: Path, stage, optimizer, writes: bool, model):
        """Copy this rank's stage (and, on rank 0, the gathered full weights) now; write them
        in a thread. The threads of all ranks then agree over their own gloo group, so rank
        0's Future (and COMPLETE) ends only when every stage is on disk, and a failed write
        on any rank fails every rank's save."""
        board = self.saves.group()  # a collective: every rank creates it on first use
        write_stage = (
            stages.prepare_stage_write(folder, self.pp_rank, stage, optimizer, self.staging)
            if writes
            else None
        )
        full = self._gather_full_weights(model)  # gathered copies: training may go on
        is_main = self.ctx.is_main

        def write() -> None:
            error = None
            try:
                if write_stage is not None:
                    write_stage()
                if is_main:
                    self.full_model.save_pretrained(
                        folder, state_dict=full, safe_serialization=True
                    )
            except Exception as exc:  # reported after the other ranks heard of it
                error = exc
            failures = torch.tensor([int(error is not None)])
            dist.all_reduce(failures, group=board)
            if error is not None:
                raise error
            if failures.item():
                raise CheckpointError(
                    f"another pipeline rank failed to write its stage of {folder}"
                )

        written, finished = self.writer.submit(write)
        self.saves.track(finished, folder)
        return written if is_main else None

    def load_state(self, folder: Path, model, optimizer) -> None:
        reshard(model)
        stage = self.unwrap(model)
        stages.load_stage_state(
            folder, self.pp_rank, self.dims.pp, stage, optimizer, self._dp_group()
        )

    def save_final(self, model, tokenizer, folder: Path) -> None:
        self.saves.wait()
        reshard(model)
        full = self._gather_full_weights(model)
        if self.ctx.is_main:
            save_pretrained_atomically(self.full_model, tokenizer, folder, state_dict=full)
        self.ctx.barrier()

    def _gather_full_weights(self, model) -> dict | None:
        """Every stage's weights (an adapter's trainable ones only), keyed by the full model's
        names, on rank 0; None elsewhere. A collective: every rank takes part."""
        from torch.distributed.tensor import DTensor

        adapter = hasattr(self.full_model, "peft_config")
        mine = {}
        for name, param in self.unwrap(model).named_parameters():
            if adapter and not param.requires_grad:
                continue  # the frozen base comes from the base model
            full = param.full_tensor() if isinstance(param, DTensor) else param
            mine[self.names[name]] = full.detach().cpu()
        parts = [None] * self.ctx.world_size if self.ctx.is_main else None
        dist.gather_object(mine if self.dp_rank == 0 else {}, parts, dst=0)
        if not self.ctx.is_main:
            return None
        return {name: tensor for part in parts for name, tensor in part.items()}
