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
from swiftlm.checkpoint.tree_state import load_tree, save_tree
from swiftlm.errors import CheckpointError

STATE_FILE = "trainer_state.json"
# Each rank's own state (an online method's, gradient compression's) as safetensors + JSON,
# in a folder of its own: the model's weights are the folder's top-level *.safetensors.
RANK_STATE_DIR = "rank_state"
LEGACY_METHOD_STATE = "method_state_rank{rank}.pt"  # pickled by earlier versions: refused


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
        save_tree(folder / RANK_STATE_DIR, method_state_name(ctx.rank), method_state)
    for kept in strategy_rank_states(strategy):
        save_tree(folder / RANK_STATE_DIR, f"{kept.state_name}-rank{ctx.rank}", kept.state_dict())
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
    for kept in strategy_rank_states(strategy):
        name = f"{kept.state_name}-rank{rank}"
        found = (folder / RANK_STATE_DIR / f"{name}.json").is_file()
        note = kept.load_state_dict(load_tree(folder / RANK_STATE_DIR, name) if found else None)
        if note:
            log(f"{folder}: {note}")
    return saved


def strategy_rank_states(strategy) -> list:
    """State a strategy carries between steps outside the model and optimizer, different on
    each rank: DDP gradient compression's residuals (`distributed.compression_checkpoint`).
    Each has a `state_name`, `state_dict()` and `load_state_dict(saved or None) -> note or
    None`."""
    stats = getattr(strategy, "comm_stats", None)
    kept = getattr(stats, "checkpoint", None)
    return [kept] if kept is not None else []


def method_state_name(rank: int) -> str:
    return f"method-rank{rank}"


def load_method_state(folder: Path, rank: int) -> dict:
    """This rank's saved method state (CheckpointError if the checkpoint has none for it)."""
    name = method_state_name(rank)
    if (folder / LEGACY_METHOD_STATE.format(rank=rank)).is_file():
        raise CheckpointError(
            f"{folder} keeps the method state in {LEGACY_METHOD_STATE.format(rank=rank)}, a "
            "pickle that swiftlm no longer loads (loading a pickle can run code); resume from a "
            "checkpoint saved by this version, or start the run again"
        )
    if not (folder / RANK_STATE_DIR / f"{name}.json").is_file():
        raise CheckpointError(
            f"{folder} has no {RANK_STATE_DIR}/{name}.json: it was saved by another method or "
            "with fewer ranks; resume with the method and number of processes that saved it"
        )
    return load_tree(folder / RANK_STATE_DIR, name)
