"""Training callbacks added by plugins (`swiftlm.plugins.register_callback`).

A callback is an object with any of these methods, called with keyword arguments:

- `on_train_start(run_dir, step, num_steps)`: before the first step (`step` > 0 on resume);
- `on_step_end(step, loss, learning_rate, grad_norm)`: after each optimizer step;
- `on_save(step, path)`: after a complete checkpoint of `step` is written to `path`;
- `on_train_end(step, summary)`: after the last step, with the run summary.

Callbacks run on rank 0 only, unless registered with `all_ranks=True`, in registration order.
An exception in one stops the run (the plugin layer turns it into an error naming the plugin).
"""

from dataclasses import dataclass
from pathlib import Path

from swiftlm.checkpoint.folders import checkpoint_dir
from swiftlm.checkpoint.tiers import RUN_TIER
from swiftlm.errors import SwiftLMError

HOOKS = ("on_train_start", "on_step_end", "on_save", "on_train_end")


@dataclass(frozen=True)
class Callback:
    """A registered callback object and whether every rank runs it."""

    hooks: object
    all_ranks: bool = False


# name -> Callback, in registration order.
CALLBACKS: dict[str, Callback] = {}


class TrainCallbacks:
    """The registered callbacks of one run, called by the loop at its four points."""

    def __init__(self, job, state, num_steps: int):
        self.job = job
        main = job.strategy.ctx.is_main
        self.active = {
            name: callback.hooks
            for name, callback in CALLBACKS.items()
            if main or callback.all_ranks
        }
        self._call("on_train_start", run_dir=job.run_dir, step=state.step, num_steps=num_steps)

    def step_end(self, state, loss: float, learning_rate: float, grad_norm) -> None:
        grad_norm = None if grad_norm is None else float(grad_norm)
        self._call(
            "on_step_end", step=state.step, loss=loss, learning_rate=learning_rate,
            grad_norm=grad_norm,
        )  # fmt: skip

    def saved(self, state, tier) -> None:
        """After the loop saved `state.step` in `tier` (checkpoint.tiers; the run directory
        when there are no tiers)."""
        tiers = self.job.checkpoint_tiers
        if tiers is None or tier == RUN_TIER:
            path = checkpoint_dir(self.job.run_dir, state.step)
        else:
            path = Path(tiers.folder(tier, state.step))
        self._call("on_save", step=state.step, path=path)

    def train_end(self, state, summary: dict) -> dict:
        self._call("on_train_end", step=state.step, summary=summary)
        return summary

    def _call(self, hook: str, **kwargs) -> None:
        for name, callback in self.active.items():
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(**kwargs)
            except SwiftLMError:
                raise
            except Exception as exc:  # registered without the plugin layer's guard
                raise SwiftLMError(
                    f"callback {name!r} failed in {hook}: {type(exc).__name__}: {exc}"
                ) from exc
