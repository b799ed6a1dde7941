"""Where a non-finite step went wrong: which rank's loss, the first layer whose output was not
finite, and the layer where the gradient first was not.

Runs only on a non-finite step, on every rank together (the decision to look is taken on the
loss summed over ranks, so no rank waits alone in a collective). A NaN loss makes every
gradient NaN, so the layer is found by running the step's micro-batches forward again with a
check on each layer's output (no gradients); a finite loss with a non-finite gradient is
traced to the gradient nearest the output, where backward met it first.
"""

import math
import re

import torch
import torch.distributed as dist

from swiftlm.errors import SwiftLMError
from swiftlm.methods.base import Method
from swiftlm.monitor.grad_health import GradientHealth, layer_group

# Modules whose outputs are checked on the re-run: embeddings, each decoder block, the final
# norm and the head; in the order forward calls them.
_CHECKED = re.compile(
    r"(?:^|\.)(?:(?:layers|h|blocks|block|layer)\.\d+|embed_tokens|wte|norm|ln_f|lm_head|score)$"
)


class NonFiniteLossError(SwiftLMError):
    """The loss or a gradient became NaN/inf and --nonfinite_loss is `error`."""


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    for field in ("logits", "last_hidden_state"):  # transformers' ModelOutput
        value = getattr(output, field, None)
        if isinstance(value, torch.Tensor):
            return value
    return None


@torch.no_grad()
def first_nonfinite_output(model, method: Method, batches: list[dict], run_batch) -> str | None:
    """Run `batches` forward again (`run_batch(batch)` calls the method's loss); the first
    checked module whose output is not finite."""
    found: list[str] = []
    hooks = []
    for name, module in model.named_modules():
        if not _CHECKED.search(name):
            continue

        def check(_module, _inputs, output, name=name):
            tensor = _first_tensor(output)
            checkable = tensor is not None and tensor.is_floating_point()
            if not found and checkable and not bool(torch.isfinite(tensor).all()):
                found.append(name)

        hooks.append(module.register_forward_hook(check))
    was_training = model.training
    model.eval()  # dropout off; the same weights
    try:
        for batch in batches:
            run_batch(batch)
            if found:
                break
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return found[0] if found else None


def _gather(value):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def describe_nonfinite(
    step: int, loss: float, local_loss: float, health: GradientHealth, rerun
) -> str:
    """One message: the step, the loss, the ranks, the layer. `rerun()` returns the first
    non-finite output (None: finite) and is called only for a non-finite loss."""
    bad_gradient = health.first_nonfinite_gradient()
    ranks = _gather((math.isfinite(local_loss), bad_gradient))
    parts = [f"step {step}: loss {loss}"]
    bad_loss_ranks = [r for r, (finite, _) in enumerate(ranks) if not finite]
    if bad_loss_ranks:
        parts.append(f"non-finite on rank {', '.join(map(str, bad_loss_ranks))}")
        output = rerun()
        if output:
            parts.append(
                f"the first layer whose output is not finite: {layer_group(output)} ({output})"
            )
        else:
            parts.append(
                "every layer's output was finite when the step was run again, so "
                "the loss computation itself (or a non-deterministic op) made it"
            )
    grads = [(r, name) for r, (_, name) in enumerate(ranks) if name]
    if grads and not bad_loss_ranks:
        name = grads[0][1]
        parts.append(
            f"the gradient first went non-finite at {layer_group(name)} ({name}), "
            f"on rank {', '.join(str(r) for r, _ in grads)}"
        )
    return "; ".join(parts)
