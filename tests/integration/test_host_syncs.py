"""No host sync per micro-batch: a training step reads device values back to the host a
fixed number of times, whatever --gradient_accumulation_steps is.

On a GPU every read of a tensor's value (`.item()`, `float()`, `int()`, `bool()`,
`.tolist()`) waits for the device to finish all queued work. Counted here on CPU, where the
same calls are made: every read that swiftlm's own code makes while the loop runs a step's
forward/backward (`loop.forward_backward`) and optimizer step (`loop.clip_and_step`),
outside the model's forward (the model's own code: transformers' masks, the CPU varlen
attention) and the optimizer's (torch keeps AdamW's step counters on the host).

Expected per step: one read of the step's figures (loss, normalizer, token counts, metrics:
`loop._read_step`) and one of the gradient norm (it decides whether the step is taken and
is logged). A logging step adds the gradient-health figures it logs (monitor/grad_health).
"""

import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_sft, write_jsonl
from swiftlm.cli.main import main
from swiftlm.train import loop

READS = ("item", "tolist", "__float__", "__int__", "__bool__")
SWIFTLM = str(Path(loop.__file__).parents[1])
STEPS, LOGGING_STEPS = 4, 3  # steps 1, 3 and 4 log; step 2 does not
PAIRS = [
    {"prompt": f"Question {i}?", "chosen": f"Answer {i} is {i * 7}.", "rejected": f"No {i}."}
    for i in range(16)
]


class SyncCounter:
    """The host reads by swiftlm's code of each step (file:line of each)."""

    def __init__(self):
        self.in_step = False
        self.in_library = 0  # inside a module's forward or the optimizer's step
        self.steps: list[list[str]] = []

    def read(self, name: str, original):
        def wrapped(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            if (
                self.in_step
                and not self.in_library
                and caller.f_code.co_filename.startswith(SWIFTLM)
            ):
                where = Path(caller.f_code.co_filename).relative_to(SWIFTLM)
                self.steps[-1].append(f"{name} at {where}:{caller.f_lineno}")
            return original(tensor, *args, **kwargs)

        return wrapped

    def step(self, function, starts_a_step: bool):
        def wrapped(*args, **kwargs):
            if starts_a_step:
                self.steps.append([])
            self.in_step = True
            try:
                return function(*args, **kwargs)
            finally:
                self.in_step = False

        return wrapped

    def library(self, function):
        def wrapped(*args, **kwargs):
            self.in_library += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.in_library -= 1

        return wrapped


def reads_per_step(monkeypatch, argv: list[str]) -> list[list[str]]:
    counter = SyncCounter()
    with monkeypatch.context() as patch:
        for name in READS:
            patch.setattr(torch.Tensor, name, counter.read(name, getattr(torch.Tensor, name)))
        patch.setattr(loop, "forward_backward", counter.step(loop.forward_backward, True))
        patch.setattr(loop, "clip_and_step", counter.step(loop.clip_and_step, False))
        patch.setattr(torch.nn.Module, "__call__", counter.library(torch.nn.Module.__call__))
        patch.setattr(torch.optim.AdamW, "step", counter.library(torch.optim.AdamW.step))
        assert main(argv) == 0
    assert len(counter.steps) == STEPS
    return counter.steps


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_a_step_reads_the_device_twice_whatever_the_accumulation(
    method, tiny_model_dir, chat_jsonl, tmp_path, monkeypatch
):
    data = chat_jsonl if method == "sft" else write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    for accumulation in (1, 4):
        argv = tiny_sft(
            tiny_model_dir,
            data,
            tmp_path / f"{method}-{accumulation}",
            max_steps=STEPS,
            logging_steps=LOGGING_STEPS,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=accumulation,
            save_steps=100,
        )
        if method == "dpo":
            argv = ["rlhf", "--rlhf_type", "dpo", *argv[1:]]
        steps = reads_per_step(monkeypatch, argv)
        # Before: float() of every micro-batch's loss and of each of its metrics, a scalar
        # all-reduce read back per figure, and the clipping coefficient read per step.
        for number, reads in enumerate(steps, start=1):
            step_reads = [r for r in reads if "grad_health.py" not in r]
            assert [r.split(":")[0] for r in step_reads] == [
                "tolist at train/loop.py",
                "__float__ at distributed/gradients.py",
            ], (accumulation, number, reads)
            logged = number in (1, LOGGING_STEPS, STEPS)
            assert (len(reads) > len(step_reads)) == logged, (number, reads)
