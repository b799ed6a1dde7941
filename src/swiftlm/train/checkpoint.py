"""Atomic checkpoints and exact resume, without pickle.

A checkpoint folder holds the model or adapter exactly as `save_pretrained` writes it (so it
loads with transformers/peft as is), the optimizer state as safetensors + JSON, and
`trainer_state.json` (step, data position, scheduler, RNG). The `COMPLETE` marker is written
last: a folder without it is a checkpoint that was interrupted and is never resumed from.
FSDP2 keeps weights + optimizer sharded in `dcp/` (torch.distributed.checkpoint) instead of
the optimizer files, next to the consolidated model/adapter; any strategy resumes from it.
"""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from swiftlm.errors import CheckpointError

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
RNG_TENSORS = "rng.safetensors"
SHARDED_DIR = "dcp"  # torch.distributed.checkpoint shards, written by FSDP2


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).is_file()


def list_checkpoints(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete, incomplete) checkpoint folders of a run, oldest first."""
    root = run_dir / "checkpoints"
    folders = (
        sorted(
            (p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),
        )
        if root.is_dir()
        else []
    )
    return [p for p in folders if is_complete(p)], [p for p in folders if not is_complete(p)]


# ---- optimizer and RNG state as tensors + JSON -------------------------------------------


def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Split `optimizer.state_dict()` into flat tensors and JSON-able metadata."""
    state_dict = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, param_state in state_dict["state"].items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_from_files(tensors: dict, meta: dict) -> dict:
    state: dict[int, dict] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        index, key = flat.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def capture_rng() -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    return tensors, meta


def restore_rng(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---- save / load ----------------------------------------------------------------------------


def rng_file(rank: int) -> str:
    """Each rank has its own random streams (dropout masks differ per rank)."""
    return RNG_TENSORS if rank == 0 else f"rng-rank{rank}.safetensors"


def save_weights_and_optimizer(folder: Path, model, optimizer) -> None:
    """Weights as `save_pretrained` writes them (loadable as is) + the optimizer state."""
    model.save_pretrained(folder, safe_serialization=True)
    opt_tensors, opt_meta = optimizer_to_files(optimizer)
    save_file(opt_tensors, str(folder / OPTIMIZER_TENSORS))
    (folder / OPTIMIZER_META).write_text(json.dumps(opt_meta))


def load_weights_and_optimizer(folder: Path, model, optimizer) -> None:
    if (folder / SHARDED_DIR).is_dir():  # saved by FSDP2: DCP reshards it to this process
        from swiftlm.distributed.fsdp2 import load_sharded_state

        load_sharded_state(folder, model, optimizer)
        return
    load_model_weights(folder, model)
    meta = json.loads((folder / OPTIMIZER_META).read_text())
    tensors = load_file(str(folder / OPTIMIZER_TENSORS))
    optimizer.load_state_dict(optimizer_from_files(tensors, meta))


def save_pretrained_atomically(model, tokenizer, folder: Path, state_dict=None) -> None:
    """Write a loadable model/adapter + tokenizer via a staging folder, then rename.

    `state_dict`: the weights to write when the live model's own are sharded (FSDP2).
    """
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


def save_checkpoint(folder: Path, strategy, model, optimizer, state: dict, tokenizer=None) -> None:
    """Write a complete checkpoint; `COMPLETE` goes last so a crash leaves it incomplete."""
    ctx = strategy.ctx
    if ctx.is_main:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    ctx.barrier()
    pending = strategy.save_state(folder, model, optimizer)  # a Future if saving in background
    rng_tensors, rng_meta = capture_rng()
    save_file(rng_tensors, str(folder / rng_file(ctx.rank)))
    (folder / f"{rng_file(ctx.rank)}.json").write_text(json.dumps(rng_meta))
    ctx.barrier()
    if ctx.is_main:
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        (folder / STATE_FILE).write_text(
            json.dumps({**state, "world_size": ctx.world_size}, indent=1)
        )
        mark_complete_when_written(folder, state["step"], pending)
    ctx.barrier()


def mark_complete_when_written(folder: Path, step: int, pending=None) -> None:
    """Write `COMPLETE` now, or, for a background save, once its data is all on disk.

    On rank 0 the future of `dcp.async_save` ends after every rank's shards and the metadata
    are written; a failed save leaves the folder incomplete.
    """

    def mark(future=None) -> None:
        if future is None or future.exception() is None:
            (folder / COMPLETE).write_text(f"step {step}\n")

    if pending is None:
        mark()
    else:
        pending.add_done_callback(mark)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All safetensors weights of a model/adapter folder (sharded or not)."""
    files = sorted(folder.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        if file.name != OPTIMIZER_TENSORS and not file.name.startswith("rng"):
            weights.update(load_file(str(file)))
    return weights


def load_model_weights(folder: Path, model) -> None:
    """Load saved weights into the live model (peft adapter or full model), strictly."""
    weights = read_weights(folder)
    if (folder / "adapter_config.json").is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise CheckpointError(f"{folder}: adapter has unexpected weights {unexpected[:5]}")
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = _tied_parameter_names(model)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: weights do not match the model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}); was it saved from a different model?"
        )


def _tied_parameter_names(model) -> set[str]:
    """Names that share storage with an earlier parameter (save_pretrained drops them)."""
    first_name: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            tied.add(name)
        else:
            first_name[id(param)] = name
    return tied


def load_checkpoint(folder: Path, strategy, model, optimizer, log=print) -> dict:
    """Restore weights, optimizer and RNG in place; return the saved trainer state."""
    if not is_complete(folder):
        raise CheckpointError(
            f"{folder} is incomplete (no {COMPLETE} marker: the run stopped while saving it); "
            "resume from an earlier checkpoint or use --resume_from_checkpoint auto"
        )
    strategy.load_state(folder, model, optimizer)
    rank_rng = folder / rng_file(strategy.ctx.rank)
    if rank_rng.is_file():
        meta = json.loads(rank_rng.with_name(rank_rng.name + ".json").read_text())
        restore_rng(load_file(str(rank_rng)), meta)
    else:  # resumed with more ranks than saved: this rank's streams cannot be continued
        log(f"{folder} has no random state for rank {strategy.ctx.rank}; reseeding it")
        torch.manual_seed(
            1_000_003 * strategy.ctx.rank + json.loads((folder / STATE_FILE).read_text())["step"]
        )
    return json.loads((folder / STATE_FILE).read_text())


def prune_checkpoints(run_dir: Path, keep: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `keep`; never the newest complete one.

    Incomplete folders older than the newest complete checkpoint are leftovers of a crash
    and are removed too.
    """
    complete, incomplete = list_checkpoints(run_dir)
    removed = []
    if keep is not None and complete:
        for folder in complete[: -max(keep, 1)]:
            shutil.rmtree(folder)
            removed.append(folder)
    if complete:
        newest = int(complete[-1].name[5:])
        for folder in incomplete:
            if int(folder.name[5:]) < newest:
                shutil.rmtree(folder)
                removed.append(folder)
    return removed


def find_resume_checkpoint(run_dir: Path, spec: str) -> tuple[Path | None, list[Path]]:
    """Resolve --resume_from_checkpoint: (folder to resume from, incomplete ones skipped)."""
    if spec != "auto":
        folder = Path(spec)
        if not folder.is_dir():
            raise CheckpointError(f"--resume_from_checkpoint {spec}: no such folder")
        return folder, []
    complete, incomplete = list_checkpoints(run_dir)
    newest = complete[-1] if complete else None
    skipped = [p for p in incomplete if newest is None or int(p.name[5:]) > int(newest.name[5:])]
    return newest, skipped
