"""Deterministic data order: which samples form each micro-batch and optimizer step.

The order is a pure function of (seed, epoch), so a position (epoch, micro-batch index) is
all that resume needs: no sampler state, no replaying of skipped batches.
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DataPosition:
    """Where the next optimizer step starts reading."""

    epoch: int = 0
    micro_batch: int = 0


def epoch_micro_batches(
    num_samples: int, batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Shuffled sample indices of one epoch cut into micro-batches (the last may be short)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(num_samples, generator=generator).tolist()
    return [order[i : i + batch_size] for i in range(0, num_samples, batch_size)]


def steps_per_epoch(num_samples: int, batch_size: int, accumulation: int) -> int:
    return math.ceil(math.ceil(num_samples / batch_size) / accumulation)


def total_steps(
    num_samples: int, batch_size: int, accumulation: int, epochs: float, max_steps: int
) -> int:
    if max_steps > 0:
        return max_steps
    # Round first: 0.07 * 100 is 7.000000000000001 in floating point, not a reason for step 8.
    exact = round(epochs * steps_per_epoch(num_samples, batch_size, accumulation), 6)
    return max(1, math.ceil(exact))


def iterate_steps(
    num_samples: int, batch_size: int, accumulation: int, seed: int, start: DataPosition
) -> Iterator[tuple[list[list[int]], DataPosition]]:
    """Yield (micro-batches of one optimizer step, position after it), forever.

    A step never crosses an epoch boundary; the last step of an epoch may have fewer
    micro-batches (the loss normalization by label tokens keeps it unbiased).
    """
    epoch, index = start.epoch, start.micro_batch
    while True:
        batches = epoch_micro_batches(num_samples, batch_size, seed, epoch)
        while index < len(batches):
            step_batches = batches[index : index + accumulation]
            index += len(step_batches)
            position = (
                DataPosition(epoch, index) if index < len(batches) else DataPosition(epoch + 1, 0)
            )
            yield step_batches, position
        epoch, index = epoch + 1, 0
