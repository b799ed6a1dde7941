"""Steps shared by the strategies that hold plain (or DTensor) gradients."""

import math


def clip_then_step(strategy, model, optimizer, max_norm: float, scaler) -> float:
    """Unscale (fp16), clip, and step unless the gradient is non-finite; return the pre-clip norm."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = strategy.clip_grad_norm(model, max_norm)
    if scaler is not None:
        scaler.step(optimizer)  # GradScaler skips the update itself on inf/nan and lowers its scale
        scaler.update()
    elif math.isfinite(norm):
        optimizer.step()
    return norm
