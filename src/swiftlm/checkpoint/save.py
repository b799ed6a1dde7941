"""Writing and reading a whole checkpoint: the strategy's state, RNG, trainer state, marker.

The strategy writes its weights and optimizer in its engine's format (`save_state` /
`load_state`, duck-typed: any object with those methods and a `ctx` works); this module adds
what every checkpoint has: each rank's random streams, `trainer_state.json` (step, data
position, scheduler ...) and the tokenizer, then `COMPLETE` last.
"""

import json
import shutil
from pathlib import Path

import torch

from swiftlm.checkpoint.folders import COMPLETE, is_complete, mark_complete_when_written
from swiftlm.checkpoint.tensors import load_rng, save_rng
from swiftlm.errors import CheckpointError

STATE_FILE = "trainer_state.json"


def save_checkpoint(
    folder: Path, strategy, model, optimizer, state: dict, tokenizer=None, method_state=None
) -> None:
    """Write a complete checkpoint; `COMPLETE` goes last so a crash leaves it incomplete.
    `method_state`: this rank's state of an online method (e.g. GRPO's pending completions)."""
    ctx = strategy.ctx
    if ctx.is_main:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    ctx.barrier()
    pending = strategy.save_state(folder, model, optimizer)  # a Future if saving in background
    save_rng(folder, ctx.rank)
    if method_state is not None:
        torch.save(method_state, folder / method_state_file(ctx.rank))
    ctx.barrier()
    if ctx.is_main:
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        (folder / STATE_FILE).write_text(
            json.dumps({**state, "world_size": ctx.world_size}, indent=1)
        )
        mark_complete_when_written(folder, state["step"], pending)
    ctx.barrier()


def load_checkpoint(folder: Path, strategy, model, optimizer, log=print) -> dict:
    """Restore weights, optimizer and RNG in place; return the saved trainer state."""
    if not is_complete(folder):
        raise CheckpointError(
            f"{folder} is incomplete (no {COMPLETE} marker: the run stopped while saving it); "
            "resume from an earlier checkpoint or use --resume_from_checkpoint auto"
        )
    strategy.load_state(folder, model, optimizer)
    saved = json.loads((folder / STATE_FILE).read_text())
    rank = strategy.ctx.rank
    if not load_rng(folder, rank):  # resumed with more ranks than saved
        log(f"{folder} has no random state for rank {rank}; reseeding it")
        torch.manual_seed(1_000_003 * rank + saved["step"])
    return saved


def method_state_file(rank: int) -> str:
    return f"method_state_rank{rank}.pt"


def load_method_state(folder: Path, rank: int) -> dict:
    """This rank's saved method state (CheckpointError if the checkpoint has none for it)."""
    file = folder / method_state_file(rank)
    if not file.is_file():
        raise CheckpointError(
            f"{folder} has no {file.name}: it was saved by another method or with fewer ranks; "
            "resume with the method and number of processes that saved it"
        )
    return torch.load(file, weights_only=False)
