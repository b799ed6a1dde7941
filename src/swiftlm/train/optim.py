"""Optimizer and learning-rate schedule."""

import torch

from swiftlm.train.config import TrainArguments

SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def build_optimizer(model, args: TrainArguments) -> torch.optim.AdamW:
    """AdamW; biases, norms and other 1-D parameters get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        # The for-each kernel is faster than a per-parameter loop and numerically identical,
        # but cannot mix tensor-parallel (DTensor) and plain parameters in one call.
        foreach=_uniform_kind(decay + no_decay),
    )


def _uniform_kind(params: list) -> bool:
    return len({type(p) for p in params}) <= 1


def build_scheduler(optimizer, args: TrainArguments, num_steps: int):
    """Linear warmup over warmup_ratio of the steps, then cosine/linear decay or constant."""
    from transformers import get_scheduler

    warmup = int(round(args.warmup_ratio * num_steps))
    return get_scheduler(
        SCHEDULES[args.lr_scheduler_type],
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=num_steps,
    )
