"""--precompute_ref_log_probs (DPO and KTO): the reference's log-prob of every answer is
computed once, before the first step, while the policy is still the initial model (also for
a resumed run: the checkpoint loads after), and travels with its sample; the steps then read
it instead of running the reference.

`precompute_splits(model, train, val, ...)` runs a method's scoring function over the samples in
micro-batches of the eval batch size, in eval mode and under the training's autocast, and
returns them as `PrecomputedSamples`: each sample with its values attached under the names
the method's `collate` reads. Every rank scores every sample, so no collective is needed.
"""

from collections.abc import Callable, Sequence

import torch

from swiftlm.methods.reference import unwrapped


class PrecomputedSamples(Sequence):
    """Encoded samples (a list or the Arrow cache's rows) with per-sample values attached:
    `values[name][i]` is added to sample i as `name`."""

    def __init__(self, samples, values: dict[str, list[float]]):
        self.samples, self.values = samples, values

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        attached = {name: values[index] for name, values in self.values.items()}
        return {**self.samples[index], **attached}


@torch.no_grad()
def precompute(
    model: torch.nn.Module,
    samples,
    batch_size: int,
    torch_dtype: str,
    score: Callable[[list[dict], torch.device], dict[str, list[float]]],
) -> PrecomputedSamples:
    """`samples` with the values `score(chunk, device)` gives each chunk of `batch_size`
    samples (a list per name, one value per sample of the chunk), in eval mode and under
    the autocast the training runs with."""
    from swiftlm.models.loader import pick_dtype

    device = next(unwrapped(model).parameters()).device
    dtype = pick_dtype(torch_dtype, device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    values: dict[str, list[float]] = {}
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(samples), batch_size):
            chunk = [samples[i] for i in range(start, min(start + batch_size, len(samples)))]
            with autocast:
                scored = score(chunk, device)
            for name, column in scored.items():
                values.setdefault(name, []).extend(column)
    finally:
        model.train(was_training)
    return PrecomputedSamples(samples, values)


def precompute_splits(model, train, val, batch_size: int, torch_dtype: str, score) -> tuple:
    """(train, val), each precomputed with `score(model, chunk, device)`; val as a list."""
    splits = [
        precompute(model, samples, batch_size, torch_dtype, lambda c, d: score(model, c, d))
        for samples in (train, val)
    ]
    return splits[0], list(splits[1])
