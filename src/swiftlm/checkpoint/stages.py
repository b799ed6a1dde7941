"""Pipeline-parallel checkpoint state: one folder per stage, `stage-<k>/`.

A stage's blocks are held in full by each of its data-parallel replicas (plain or DDP): one
of them writes the stage's weights (`model.safetensors`, keyed by the stage's own parameter
names; trainable ones only for an adapter) and optimizer files. A stage sharded over its
replicas (FSDP2) writes DCP shards in `stage-<k>/dcp/` with its replicas' process group.
With --async_save a plain stage's tensors are copied to CPU memory at the save and written by
a background thread (`prepare_stage_write`); sharded stages write synchronously.
A pipeline run resumes with the same number of stages; the consolidated model or adapter
beside the stage folders loads with transformers/peft.
"""

import json
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file

from swiftlm.checkpoint.async_write import Staging
from swiftlm.checkpoint.sharded import load_sharded_state, save_sharded_state
from swiftlm.checkpoint.tensors import (
    OPTIMIZER_META,
    OPTIMIZER_TENSORS,
    optimizer_to_files,
    read_optimizer,
)
from swiftlm.errors import CheckpointError

STAGE_WEIGHTS = "model.safetensors"


def stage_dir(folder: Path, stage: int) -> Path:
    return folder / f"stage-{stage}"


def _trained_state(model) -> dict:
    """What a stage saves: every tensor of a full fine-tune, the trainable ones of an adapter."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return {
        name: tensor.detach() for name, tensor in model.state_dict().items() if name not in frozen
    }


def save_stage_state(folder: Path, stage: int, model, optimizer, writes: bool, group=None) -> None:
    """Save one stage. Plain stage: only the replica with `writes` set writes. Sharded stage
    (`group`: its replicas' process group): every replica writes its shards."""
    target = stage_dir(folder, stage)
    if group is not None:
        save_sharded_state(target, model, optimizer, group=group)
        return
    if writes:
        prepare_stage_write(folder, stage, model, optimizer)()


def prepare_stage_write(
    folder: Path, stage: int, model, optimizer, staging: Staging | None = None
) -> Callable[[], None]:
    """A plain stage's write, to call now or (with `staging`: the tensors copied now) in a
    background thread while training goes on."""
    target = stage_dir(folder, stage)
    target.mkdir(parents=True, exist_ok=True)
    weights = _trained_state(model)
    opt_tensors, opt_meta = optimizer_to_files(optimizer, staging.copy if staging else None)
    if staging is not None:
        weights = staging.copy(weights, prefix="stage.")
    else:
        weights = {name: tensor.cpu().contiguous() for name, tensor in weights.items()}
    (target / OPTIMIZER_META).write_text(json.dumps(opt_meta))

    def write() -> None:
        save_file(weights, str(target / STAGE_WEIGHTS))
        save_file(opt_tensors, str(target / OPTIMIZER_TENSORS))

    return write


def load_stage_state(folder: Path, stage: int, stages: int, model, optimizer, group=None) -> None:
    """Load one stage's weights and optimizer in place (every replica of the stage calls it)."""
    saved = sorted(p.name for p in folder.glob("stage-*") if p.is_dir())
    target = stage_dir(folder, stage)
    if len(saved) != stages or not target.is_dir():
        raise CheckpointError(
            f"{folder} holds {len(saved)} pipeline stage folder(s), this run has {stages} "
            "stages: resume a pipeline run with the same --pipeline_parallel_size"
        )
    if group is not None:
        load_sharded_state(target, model, optimizer, group=group)
        return
    if not (target / STAGE_WEIGHTS).is_file():
        raise CheckpointError(
            f"{target} has no {STAGE_WEIGHTS}: was it saved with --fsdp (sharded stages)? "
            "Resume with the data-parallel setting that saved it"
        )
    optimizer_state = read_optimizer(target)
    weights = load_file(str(target / STAGE_WEIGHTS))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [name for name in missing if name in trained]
    if missing or unexpected:
        raise CheckpointError(
            f"{target}: weights do not match this stage (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}); was it saved from another model or --train_type?"
        )
    optimizer.load_state_dict(optimizer_state)
