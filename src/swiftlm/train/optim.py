"""The optimizer `--optim` names and the learning-rate schedule.

Each builder takes the model and the train config and returns one `torch.optim.Optimizer`
that the loop steps, the scheduler drives and every checkpoint format saves (its state dict
holds tensors and JSON-able numbers only). Settings follow transformers' for the same name;
biases, norms and other 1-D parameters get no weight decay under every optimizer.
"""

import torch

from swiftlm.errors import ConfigError
from swiftlm.train.config import DTENSOR_CAPABLE, TrainArguments, parse_optim_args

SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}
# A schedule-free optimizer warms up and averages by itself: the schedule stays at 1.
SCHEDULE_FREE = ("schedule_free_adamw",)


def build_optimizer(model, args: TrainArguments, num_steps: int = 0) -> torch.optim.Optimizer:
    """The optimizer `args.optim` names over the model's trainable parameters. `num_steps`:
    the run's length (schedule-free AdamW's warmup is --warmup_ratio of it)."""
    settings = parse_optim_args(args.optim, args.optim_args)
    refuse_dtensor_parameters(model, args.optim)
    return BUILDERS[args.optim](model, args, settings, num_steps)


def refuse_dtensor_parameters(model, optim: str) -> None:
    """FSDP2 and tensor parallel hand the optimizer DTensors; an optimizer whose kernels take
    plain tensors only would fail inside its first step (the config rules refuse the flags
    earlier; this holds for any strategy that shards)."""
    from torch.distributed.tensor import DTensor

    if optim in DTENSOR_CAPABLE:
        return
    if any(isinstance(p, DTensor) for p in trainable(model)):
        raise ConfigError(
            f"--optim {optim} updates plain tensors only, and this run shards its parameters "
            f"(FSDP2 or tensor parallel: DTensors); use one of {', '.join(DTENSOR_CAPABLE)}, "
            "or train with DDP / one process"
        )


def decay_groups(params: list, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (ndim >= 2) only; empty groups left out."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def adam_settings(args: TrainArguments) -> dict:
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2)}


def _adamw_torch(model, args, settings, num_steps, fused=False):
    params = trainable(model)
    return torch.optim.AdamW(
        decay_groups(params, args.weight_decay),
        **adam_settings(args),
        eps=args.adam_epsilon,
        # The for-each kernel is faster than a per-parameter loop and numerically identical,
        # but cannot mix tensor-parallel (DTensor) and plain parameters in one call.
        **({"fused": True} if fused else {"foreach": _uniform_kind(params)}),
    )


def _uniform_kind(params: list) -> bool:
    return len({type(p) for p in params}) <= 1


def _adamw_torch_fused(model, args, settings, num_steps):
    return _adamw_torch(model, args, settings, num_steps, fused=True)


def _bitsandbytes_adamw(model, args, settings, num_steps, paged=False):
    """bitsandbytes' 8-bit AdamW (blockwise-quantized moments; its CPU backend since 0.48).
    Tensors under 4096 elements keep 32-bit moments, as bitsandbytes decides."""
    try:
        from bitsandbytes.optim import AdamW8bit, PagedAdamW8bit
    except ImportError:
        raise ConfigError(
            f"--optim {args.optim} needs bitsandbytes: pip install 'swiftlm[quant]'"
        ) from None
    cls = _flat_quant_state(PagedAdamW8bit if paged else AdamW8bit)
    return cls(
        decay_groups(trainable(model), args.weight_decay),
        **adam_settings(args),
        eps=args.adam_epsilon,
    )


def _flat_quant_state(optimizer_class):
    """bitsandbytes nests its quantization tensors in one dict per parameter (hidden from
    FSDP1's gather); a checkpoint stores flat tensors, which its load_state_dict also takes.
    The quantization maps (256 values) are one tensor shared by all parameters: each entry gets
    its own copy, as safetensors stores no shared tensors."""

    class FlatQuantState(optimizer_class):
        def state_dict(self):
            saved = super().state_dict()
            key = self._FSDP_WRAPPED_QUANT_STATE_KEY
            saved["state"] = {
                index: {**{k: v for k, v in entry.items() if k != key}, **_own(entry.get(key, {}))}
                for index, entry in saved["state"].items()
            }
            return saved

    FlatQuantState.__name__ = FlatQuantState.__qualname__ = optimizer_class.__name__
    return FlatQuantState


def _own(quant_state: dict) -> dict:
    return {k: v.clone() if k.startswith("qmap") else v for k, v in quant_state.items()}


def _paged_adamw_8bit(model, args, settings, num_steps):
    return _bitsandbytes_adamw(model, args, settings, num_steps, paged=True)


def _adafactor(model, args, settings, num_steps):
    """transformers' Adafactor with `--optim adafactor`'s settings: a fixed learning rate
    (no relative step, no parameter scaling), factored second moments, no first moment."""
    from transformers.optimization import Adafactor

    return Adafactor(
        decay_groups(trainable(model), args.weight_decay),
        lr=args.learning_rate,
        scale_parameter=False,
        relative_step=False,
    )


def _muon(model, args, settings, num_steps):
    """torch.optim.Muon on the hidden weight matrices, AdamW (as adamw_torch) on the
    embeddings, the LM head and every 1-D parameter (`train.muon`)."""
    from swiftlm.train.muon import MUON_LR_ADJUSTMENT, MuonWithAdamW, split_for_muon

    hidden, rest = split_for_muon(model)
    muon_groups = [{"params": hidden, "weight_decay": args.weight_decay}] if hidden else []
    muon = {"lr": args.learning_rate, "adjust_lr_fn": MUON_LR_ADJUSTMENT, **settings}
    adamw = {**adam_settings(args), "eps": args.adam_epsilon, "foreach": _uniform_kind(rest)}
    return MuonWithAdamW(muon_groups, decay_groups(rest, args.weight_decay), muon, adamw)


def _schedule_free_adamw(model, args, settings, num_steps):
    """schedulefree's AdamWScheduleFree; its warmup is --warmup_ratio of the steps (the
    schedule itself stays constant: `build_scheduler`)."""
    try:
        from schedulefree import AdamWScheduleFree
    except ImportError:
        raise ConfigError(
            "--optim schedule_free_adamw needs schedulefree: pip install 'swiftlm[optimizers]'"
        ) from None
    return AdamWScheduleFree(
        decay_groups(trainable(model), args.weight_decay),
        **adam_settings(args),
        eps=args.adam_epsilon,
        warmup_steps=warmup_steps(args, num_steps),
        **settings,
    )


def _low_rank(model, args, settings, num_steps):
    """GaLore / APOLLO on --optim_target_modules' linear weights (`train.low_rank`)."""
    from swiftlm.train import low_rank

    if settings["proj_type"] == "full":
        raise ConfigError(
            f"--optim_args proj_type=full for --optim {args.optim}: a full projection keeps "
            "two matrices, which swiftlm's checkpoints do not store; use std (the default), "
            "reverse_std, left or right"
        )
    names = low_rank.target_weights(model, args.optim_target_modules)
    groups = low_rank.projected_groups(model, names, settings, args.weight_decay, args.optim)
    cls = low_rank.galore_class() if args.optim == "galore_adamw" else low_rank.apollo_class()
    return cls(groups, **adam_settings(args), eps=args.adam_epsilon, no_deprecation_warning=True)


BUILDERS = {
    "adamw_torch": _adamw_torch,
    "adamw_torch_fused": _adamw_torch_fused,
    "adamw_8bit": _bitsandbytes_adamw,
    "paged_adamw_8bit": _paged_adamw_8bit,
    "adafactor": _adafactor,
    "muon": _muon,
    "schedule_free_adamw": _schedule_free_adamw,
    "galore_adamw": _low_rank,
    "apollo_adamw": _low_rank,
}


def warmup_steps(args: TrainArguments, num_steps: int) -> int:
    return int(round(args.warmup_ratio * num_steps))


def build_scheduler(optimizer, args: TrainArguments, num_steps: int):
    """Linear warmup over warmup_ratio of the steps, then cosine/linear decay or constant;
    a constant 1 for a schedule-free optimizer (it warms up itself)."""
    from transformers import get_scheduler

    if args.optim in SCHEDULE_FREE:
        return get_scheduler("constant", optimizer)
    return get_scheduler(
        SCHEDULES[args.lr_scheduler_type],
        optimizer,
        num_warmup_steps=warmup_steps(args, num_steps),
        num_training_steps=num_steps,
    )
