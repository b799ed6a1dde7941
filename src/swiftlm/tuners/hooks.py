"""What a tuner needs from the training loop besides its parameters: a call when the optimizer
is built (LoRA+'s learning-rate groups are checked there), at the start of training and after
each optimizer step (LISA samples its layers), and after final/ is written (PiSSA/OLoRA convert
their adapter to a plain LoRA). Built once per run by `train.run`, from the unwrapped model
right after the tuner is applied, before any step or resume.
"""

from pathlib import Path

import torch

from swiftlm.errors import ConfigError
from swiftlm.tuners.config import TunerArguments
from swiftlm.tuners.init_weights import convert_to_plain_lora, initial_adapter, mutates_base
from swiftlm.tuners.lisa import LayerSampler
from swiftlm.tuners.lora_plus import B_MATRICES, split_b_groups


class TunerHooks:
    """The tuner's calls from the loop; each does nothing for a tuner that needs none."""

    def __init__(self, model: torch.nn.Module, args: TunerArguments, seed: int, log=print):
        self.model, self.args, self.log = model, args, log
        self.initial = initial_adapter(model) if mutates_base(args) else None
        self.lisa = None
        if args.lisa_activated_layers:
            self.lisa = LayerSampler(
                model, args.lisa_activated_layers, args.lisa_step_interval, seed
            )

    def optimizer_built(self, optimizer) -> None:
        """--lorap_lr_ratio: the B matrices get groups of their own at the ratio
        (`lora_plus.split_b_groups`), checked afterwards, so a run never silently trains
        plain LoRA."""
        ratio = self.args.lorap_lr_ratio
        if ratio is None:
            return
        if learning_rate_ratios(self.model, optimizer) != {ratio}:  # not grouped yet
            split_b_groups(self.model, optimizer, ratio)
        ratios = learning_rate_ratios(self.model, optimizer)
        if ratios != {ratio}:
            raise ConfigError(
                f"--lorap_lr_ratio {ratio}: this --optim keeps its parameter groups in inner "
                f"optimizers, which train the LoRA B matrices at {sorted(ratios)} x the A "
                "matrices' learning rate; use --optim adamw_torch (or another single "
                "optimizer), or drop --lorap_lr_ratio"
            )

    def start(self, step: int) -> None:
        """Before the first step (`step` completed steps: > 0 on resume)."""
        if self.lisa is not None:
            self.lisa.apply(step, force=True)
            self.log(self.lisa.describe())

    def step_end(self, step: int) -> None:
        """After optimizer step `step` (its gradients already zeroed)."""
        if self.lisa is not None:
            self.lisa.apply(step)

    def final_saved(self, folder: Path) -> None:
        """After final/ is written (rank 0)."""
        if self.initial is not None:
            convert_to_plain_lora(folder, self.initial)
            self.log(
                f"{folder}: --init_weights {self.args.init_weights} adapter converted to a "
                f"plain LoRA of the original model (rank {2 * self.args.lora_rank})"
            )


def learning_rate_ratios(model: torch.nn.Module, optimizer) -> set[float]:
    """The learning rate of each LoRA B matrix's group over that of the A matrices' group,
    as the schedule started them (`initial_lr`, else `lr`)."""
    group_of = {
        id(p): g.get("initial_lr", g["lr"]) for g in optimizer.param_groups for p in g["params"]
    }
    named = [(n, p) for n, p in model.named_parameters() if id(p) in group_of]
    a_rates = {group_of[id(p)] for n, p in named if ".lora_A." in n or ".lora_embedding_A" in n}
    if not a_rates:
        return set()
    a_rate = min(a_rates)
    return {
        round(group_of[id(p)] / a_rate, 6)
        for n, p in named
        if any(f".{b}." in f".{n}." for b in B_MATRICES)
    }
