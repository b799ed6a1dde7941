"""LISA, layerwise importance sampled AdamW (Pan et al., 2024; ms-swift's
--lisa_activated_layers / --lisa_step_interval): full fine-tuning in which only a few randomly
sampled decoder layers train at a time, resampled every K optimizer steps.

As in LMFlow's reference implementation (`DynamicLayerActivationCallback`), only the decoder
layers are sampled: the embeddings, the final norm and the output head always train (the
paper finds they carry most of the weight norm change), and the optimizer holds every
parameter from the start.

Optimizer state of layers that are frozen again is kept, as LMFlow keeps it: a frozen
parameter has no gradient (the loop zeroes gradients to None), so AdamW neither updates it nor
decays it, and its moments resume where they were when the layer is sampled again. Memory
therefore grows towards full AdamW's as more layers have been sampled once; what LISA saves is
the backward of the frozen layers and their gradients.

The layers of window w (steps w*K+1 .. (w+1)*K) are drawn from a generator seeded by
(--seed, w) alone, so a resumed run samples exactly the layers of the uninterrupted one
without any state in the checkpoint.
"""

import random

import torch

from swiftlm.errors import ConfigError


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: its longest ModuleList (model.layers in Llama,
    transformer.h in GPT-2)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ConfigError(
            "--lisa_activated_layers: this model has no list of decoder layers to sample from; "
            "drop --lisa_activated_layers"
        )
    return max(lists, key=len)


def sampled_layers(num_layers: int, activated: int, seed: int, window: int) -> list[int]:
    """The layer indices that train in sampling window `window`, sorted."""
    rng = random.Random(seed * 1_000_003 + window)
    return sorted(rng.sample(range(num_layers), activated))


class LayerSampler:
    """Freezes all decoder layers but the sampled ones; call `apply(step)` with the number of
    completed optimizer steps at the start and after each step."""

    def __init__(self, model: torch.nn.Module, activated: int, interval: int, seed: int):
        self.layers = decoder_layers(model)
        if activated > len(self.layers):
            raise ConfigError(
                f"--lisa_activated_layers {activated}: the model has {len(self.layers)} decoder "
                f"layers; give at most {len(self.layers)}"
            )
        self.activated, self.interval, self.seed = activated, interval, seed
        self.active: list[int] = []

    def apply(self, step: int, force: bool = False) -> None:
        """Resample at the start of a window (`force`: whatever the step, on train start)."""
        if not force and step % self.interval:
            return
        window = step // self.interval
        self.active = sampled_layers(len(self.layers), self.activated, self.seed, window)
        for index, layer in enumerate(self.layers):
            layer.requires_grad_(index in self.active)

    def describe(self) -> str:
        return (
            f"LISA: {self.activated} of {len(self.layers)} decoder layers train at a time "
            f"(now {self.active}), resampled every {self.interval} steps; embeddings and head "
            "always train"
        )
