"""Schedule-free optimizers' two sets of weights (`schedulefree`, Defazio et al. 2024).

A schedule-free optimizer trains the model at an interpolation `y` of its averaged weights `x`
and its base sequence `z` (kept in its state); `optimizer.eval()` swaps the parameters to `x`,
the weights to evaluate and to keep, and `optimizer.train()` back to `y`. So the loop
evaluates and saves checkpoints between `eval()` and `train()` (a checkpoint then holds `x`,
loadable as the trained model, with `z` and the mode in its optimizer state), and leaves the
model at `x` when training ends (final/). A resumed run loads `x` and calls `train()`, as the
run that saved it did after saving: both continue from the same bits.

Other optimizers have one set of weights: every function here leaves them alone.
"""

from contextlib import contextmanager


def swaps_weights(optimizer) -> bool:
    """A schedule-free optimizer: its param groups carry the mode it is in."""
    return "train_mode" in optimizer.param_groups[0]


def training_weights(optimizer) -> None:
    """Parameters at the training point `y` (before the first step and after a resume)."""
    if swaps_weights(optimizer):
        optimizer.train()


def final_weights(optimizer) -> None:
    """Parameters at the averaged weights `x`, for what is saved after training."""
    if swaps_weights(optimizer):
        optimizer.eval()


@contextmanager
def averaged_weights(optimizer, train_after: bool = True):
    """Evaluate or checkpoint at `x`, then continue training at `y` (`train_after`; after
    the last step's checkpoint the model stays at `x`: final/ is the checkpoint's weights,
    not those of a round trip through `y`)."""
    final_weights(optimizer)
    try:
        yield
    finally:
        if train_after:
            training_weights(optimizer)
