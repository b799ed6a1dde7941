"""--async_generate: GRPO's next generation is sampled while the current one trains.

When a generation starts training, the policy as it is then is copied into a sampling copy,
and a background thread samples, scores and lays out the next generation from that copy, on
an engine of its own. The trainer takes it when the current generation's steps are done
(waiting only for what is left of it): the steps of a generation train a policy one
generation newer than the one that sampled them. So every such step keeps the copy's
log-probs of its tokens as the importance ratio's old ones (computed in the background
too), and the loss logs `importance_ratio`, the mean of exp(policy - sampler) over the
tokens. The first generation is sampled as without the flag (nothing to overlap yet).

The copy shares the frozen tensors of the live policy (a LoRA run's base weights: no second
copy of them) and holds its own trainable ones, refreshed by value at each launch; the
training steps never touch it, nor it them. One trainer process, swiftlm's engine: the
background thread's reductions (reward statistics, the engine mismatch) have no other
ranks to meet.

A checkpoint waits for the generation in flight and keeps it, so a resumed run trains on
the samples the straight run would have (their seeds depend only on the generation's
number and prompts, `rollout.rollout_seed`).
"""

import copy
import dataclasses
import threading
from contextlib import nullcontext

import torch

from swiftlm.methods.reference import unwrapped
from swiftlm.methods.rl.grpo_rollouts import Generation, Rollouts


class AsyncGenerations:
    """The generation sampled in the background for the next steps, one at a time."""

    def __init__(self, rollouts: Rollouts, sampler):
        self.rollouts = rollouts
        self.sampler = sampler  # an engine of its own, over `copy`
        self.copy: torch.nn.Module | None = None  # the policy as the last launch saw it
        self._thread: threading.Thread | None = None
        self._result: Generation | None = None
        self._error: BaseException | None = None

    def launch(self, policy: torch.nn.Module, prompt_steps: list[list[dict]], context) -> None:
        """Copy `policy`'s weights and sample `prompt_steps` from the copy in the background.
        `context`: the step context of the steps that will train on them."""
        self.wait()
        self._refresh_copy(unwrapped(policy))
        background = dataclasses.replace(context, phase=lambda name: nullcontext())
        self._thread = threading.Thread(
            target=self._sample, args=(prompt_steps, background), name="swiftlm-async-rollouts"
        )
        self._thread.start()

    def take(self) -> Generation | None:
        """The generation launched last, once it is done (None: nothing was launched or
        kept). A failure in the background is raised here, in the trainer's thread."""
        self.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error
        result, self._result = self._result, None
        return result

    def wait(self) -> None:
        """Until the generation in flight is done (its result stays for `take`)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def keep(self, generation: Generation | None) -> None:
        """Hold `generation` for the next `take` (a checkpoint's, on resume)."""
        self.wait()
        self._result = generation

    def close(self) -> None:
        self.wait()
        self.sampler.close()

    def _sample(self, prompt_steps, context) -> None:
        try:
            self._result = self.rollouts.generate(
                self.copy, prompt_steps, context, sampler=self.sampler, off_policy=True
            )
        except BaseException as exc:  # handed to the trainer's thread by `take`
            self._error = exc

    @torch.no_grad()
    def _refresh_copy(self, live: torch.nn.Module) -> None:
        if self.copy is None:
            # Frozen tensors are shared (the memo maps each to itself); the rest is copied.
            shared = {id(p): p for p in live.parameters() if not p.requires_grad}
            self.copy = copy.deepcopy(live, memo=shared)
            return
        for mine, theirs in zip(self.copy.parameters(), live.parameters(), strict=True):
            if theirs.requires_grad:
                mine.copy_(theirs)
