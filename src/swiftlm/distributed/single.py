"""One process: the model as it is."""

from contextlib import nullcontext
from pathlib import Path

import torch

from swiftlm.distributed.common import clip_then_step
from swiftlm.distributed.env import DistContext
from swiftlm.train import checkpoint as ckpt


class SingleStrategy:
    def __init__(self, ctx: DistContext):
        self.ctx = ctx

    dp_rank = property(lambda self: 0)
    dp_size = property(lambda self: 1)

    def wrap(self, model):
        return model

    def attach_optimizer(self, model, optimizer):
        return model, optimizer

    def unwrap(self, model):
        return model

    def no_sync(self, model, sync: bool):
        return nullcontext()

    def clip_grad_norm(self, model, max_norm: float) -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def backward(self, loss, last_micro_batch: bool) -> None:
        loss.backward()

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        return clip_then_step(self, model, optimizer, max_norm, scaler)

    def save_state(self, folder: Path, model, optimizer) -> None:
        ckpt.save_weights_and_optimizer(folder, model, optimizer)

    def load_state(self, folder: Path, model, optimizer) -> None:
        ckpt.load_weights_and_optimizer(folder, model, optimizer)

    def save_final(self, model, tokenizer, folder: Path) -> None:
        ckpt.save_pretrained_atomically(model, tokenizer, folder)
