"""Pipeline parallel with `torch.distributed.pipelining`: each process holds a contiguous run
of decoder blocks (the first also the embeddings, the last the final norm and LM head), and a
1F1B schedule streams the step's micro-batches through the stages.

The schedule owns forward and backward, so this strategy also runs the step
(`forward_backward`); the loop's token normalization still applies: each micro-batch's loss
sum is divided by the label tokens of the whole step. Every step is padded to --max_length,
because a pipeline stage exchanges fixed-shape activations. Full fine-tuning of plain decoder
stacks (Llama/Qwen2/Mistral-style) with untied embeddings.
"""

import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.distributed.env import DistContext
from swiftlm.errors import ConfigError
from swiftlm.losses.causal_lm import count_label_tokens, token_cross_entropy_sum
from swiftlm.train import checkpoint as ckpt


class DecoderStage(nn.Module):
    """Blocks [start, end) of a causal LM, plus the embeddings (first) or head (last)."""

    def __init__(self, model, start: int, end: int, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[start:end])
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        # No attention mask: batches are right-padded, so causal attention never lets a real
        # token see padding, and the padding itself carries no labels.
        for layer in self.layers:
            hidden = layer(hidden, position_ids=positions, position_embeddings=rotary)
        if self.lm_head is None:
            return hidden
        return self.lm_head(self.norm(hidden))


def stage_bounds(num_layers: int, stages: int, index: int) -> tuple[int, int]:
    """Blocks of stage `index`: as even as possible, earlier stages taking the extra ones."""
    base, extra = divmod(num_layers, stages)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class PipelineParallelStrategy:
    def __init__(
        self, ctx: DistContext, device: torch.device, size: int, max_length: int, accumulation: int
    ):
        if size != ctx.world_size:
            raise ConfigError(
                f"--pipeline_parallel_size {size} must equal the number of processes "
                f"({ctx.world_size}); pipeline x data parallel is not available yet"
            )
        self.ctx, self.device, self.size, self.max_length = ctx, device, size, max_length
        self.accumulation = accumulation  # the schedule's micro-batches per step
        self.stage = self.schedule = None
        self._scale = 1.0  # 1 / label tokens of the current step
        self.full_model = None  # kept for its config and save_pretrained
        self.names: dict[str, str] = {}  # stage parameter name -> name in the full model

    dp_rank = property(lambda self: 0)  # every stage reads the same batch
    dp_size = property(lambda self: 1)

    @property
    def is_last(self) -> bool:
        return self.ctx.rank == self.size - 1

    def wrap(self, model):
        if hasattr(model, "peft_config"):
            raise ConfigError(
                "--pipeline_parallel_size needs --train_type full (adapters are not supported "
                "with pipeline parallel yet)"
            )
        if getattr(model.config, "tie_word_embeddings", False):
            raise ConfigError(
                "--pipeline_parallel_size: this model ties its input embeddings to its LM head, "
                "which would sit on different stages; use fsdp2 or deepspeed for it"
            )
        layers = len(model.model.layers)
        if layers < self.size:
            raise ConfigError(f"--pipeline_parallel_size {self.size} exceeds the {layers} blocks")
        start, end = stage_bounds(layers, self.size, self.ctx.rank)
        first, last = self.ctx.rank == 0, self.is_last
        self.full_model = model
        stage = DecoderStage(model, start, end, first, last).to(self.device)
        full_names = {id(p): n for n, p in model.named_parameters()}
        self.names = {n: full_names[id(p)] for n, p in stage.named_parameters()}
        self.stage = stage
        return stage

    def attach_optimizer(self, model, optimizer):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        pipe = PipelineStage(model, self.ctx.rank, self.size, self.device)
        self.schedule = Schedule1F1B(
            pipe, n_microbatches=self.accumulation, loss_fn=self._loss, scale_grads=False
        )
        return model, optimizer

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy_sum(logits, labels) * self._scale

    def forward_backward(self, job, precision, batches: list[dict]) -> tuple[float, int, int]:
        """Run the step's micro-batches through the 1F1B schedule; every rank returns the
        step's mean token loss."""
        batch = self._fixed_shape(batches, job.args.per_device_train_batch_size)
        label_tokens = count_label_tokens(batch["labels"])
        self._scale = 1.0 / max(label_tokens, 1)
        losses: list[torch.Tensor] = []
        with precision.autocast():
            if self.ctx.rank == 0:
                self.schedule.step(batch["input_ids"].to(self.device))
            elif self.is_last:
                self.schedule.step(target=batch["labels"].to(self.device), losses=losses)
            else:
                self.schedule.step()
        local = float(sum(loss.detach() for loss in losses)) if self.is_last else 0.0
        loss = self.ctx.all_reduce_sum(local)  # only the last stage has it
        return loss, label_tokens, int(batch["attention_mask"].sum())

    def _fixed_shape(self, batches: list[dict], rows_per_batch: int) -> dict:
        """accumulation x rows_per_batch rows of --max_length tokens: the shape every stage
        expects. Missing rows (a short last step) are padding without labels."""
        rows = self.accumulation * rows_per_batch
        fill = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
        out = {}
        for key, value in fill.items():
            parts = [
                F.pad(b[key], (0, self.max_length - b[key].shape[1]), value=value) for b in batches
            ]
            joined = torch.cat(parts)
            missing = rows - joined.shape[0]
            out[key] = F.pad(joined, (0, 0, 0, missing), value=value) if missing else joined
        return out

    def unwrap(self, model):
        return model

    def no_sync(self, model, sync: bool):
        return nullcontext()

    def backward(self, loss, last_micro_batch: bool) -> None:
        raise RuntimeError("pipeline parallel runs backward inside its schedule")

    def clip_grad_norm(self, model, max_norm: float) -> float:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = float(sum(g.detach().double().pow(2).sum() for g in grads)) if grads else 0.0
        total = self.ctx.all_reduce_sum(local) ** 0.5  # each stage holds different parameters
        coef = max_norm / (total + 1e-6)
        if coef < 1:
            for grad in grads:
                grad.mul_(coef)
        return total

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        from swiftlm.distributed.common import clip_then_step

        return clip_then_step(self, model, optimizer, max_norm, scaler)

    def save_state(self, folder: Path, model, optimizer) -> None:
        """Each stage writes its own weights and optimizer; rank 0 also the full model."""
        stage_dir = folder / f"stage-{self.ctx.rank}"
        stage_dir.mkdir(parents=True, exist_ok=True)
        save_file(
            {n: p.detach().cpu().contiguous() for n, p in model.state_dict().items()},
            str(stage_dir / "model.safetensors"),
        )
        tensors, meta = ckpt.optimizer_to_files(optimizer)
        save_file(tensors, str(stage_dir / ckpt.OPTIMIZER_TENSORS))
        (stage_dir / ckpt.OPTIMIZER_META).write_text(json.dumps(meta))
        self._save_full(folder, tokenizer=None, model=model)

    def load_state(self, folder: Path, model, optimizer) -> None:
        stage_dir = folder / f"stage-{self.ctx.rank}"
        if not stage_dir.is_dir():
            raise ckpt.CheckpointError(
                f"{folder} has no {stage_dir.name}/: resume a pipeline run with the same "
                "--pipeline_parallel_size"
            )
        model.load_state_dict(load_file(str(stage_dir / "model.safetensors")))
        meta = json.loads((stage_dir / ckpt.OPTIMIZER_META).read_text())
        tensors = load_file(str(stage_dir / ckpt.OPTIMIZER_TENSORS))
        optimizer.load_state_dict(ckpt.optimizer_from_files(tensors, meta))

    def save_final(self, model, tokenizer, folder: Path) -> None:
        self._save_full(folder, tokenizer, model)
        self.ctx.barrier()

    def _save_full(self, folder: Path, tokenizer, model) -> None:
        """Gather every stage's weights on rank 0 and write one Hugging Face folder."""
        mine = {self.names[n]: p.detach().cpu() for n, p in model.named_parameters()}
        parts = [None] * self.size if self.ctx.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if self.ctx.rank != 0:
            return
        full = {name: tensor for part in parts for name, tensor in part.items()}
        if tokenizer is None:
            self.full_model.save_pretrained(folder, state_dict=full, safe_serialization=True)
        else:
            ckpt.save_pretrained_atomically(self.full_model, tokenizer, folder, state_dict=full)
