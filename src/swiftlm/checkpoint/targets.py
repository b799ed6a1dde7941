"""Which checkpoint a run resumes from, and what a folder given as one is when it is not.

A run directory, as swiftlm writes it:

    <run>/config.yaml           the run's resolved configuration
    <run>/metrics.jsonl, tb/    its logs
    <run>/checkpoints/step-N/   a checkpoint: weights, optimizer, RNG, trainer_state.json, and
                                COMPLETE written last
    <run>/final/                the final weights: a Hugging Face model or a peft adapter

A path given to --resume_from_checkpoint, --ckpt_dir or --adapters that is something else
(a run, its checkpoints/ or final/ folder, an empty folder, a file) is named as what it is,
with the flag value that would work. All of this is read before anything loads.
"""

from pathlib import Path

from swiftlm.checkpoint.folders import is_complete, list_checkpoints, step_of
from swiftlm.checkpoint.save import STATE_FILE
from swiftlm.checkpoint.tensors import RNG_TENSORS
from swiftlm.errors import CheckpointError, ConfigError

RUN_CONFIG = "config.yaml"
RUN_MARKERS = (RUN_CONFIG, "checkpoints", "metrics.jsonl")  # any of them: a swiftlm run
ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
RESUME = "--resume_from_checkpoint"
RESUME_HINT = (
    f"pass a checkpoint folder (<run>/checkpoints/step-N), or {RESUME} auto with the run's "
    "--output_dir"
)


def is_run_dir(folder: Path) -> bool:
    return any((folder / name).exists() for name in RUN_MARKERS)


def holds_weights(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file() or (folder / MODEL_CONFIG).is_file()


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run a checkpoint folder belongs to (`<run>/checkpoints/step-N`), if any."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def newest_complete(run_dir: Path) -> Path | None:
    complete, _ = list_checkpoints(run_dir)
    return complete[-1] if complete else None


def find_resume_checkpoint(run_dir: Path, spec: str) -> tuple[Path | None, list[Path]]:
    """Resolve --resume_from_checkpoint: (folder to resume from, incomplete ones skipped).

    `auto` takes the newest complete checkpoint of `run_dir` (None: there is none); a folder
    given by path must be a complete checkpoint, or a CheckpointError says what it is. A
    mirror URL gives (None, []): it is looked at when the run resumes (`tiers.py`), and
    `auto` across the local tier and the mirror is `tiers.Tiers.newest`."""
    if "://" in spec:
        return None, []
    if spec != "auto":
        problem = not_resumable(spec)
        if problem:
            raise CheckpointError(problem)
        return Path(spec).expanduser(), []
    complete, incomplete = list_checkpoints(run_dir)
    newest = complete[-1] if complete else None
    skipped = [p for p in incomplete if newest is None or step_of(p) > step_of(newest)]
    return newest, skipped


def not_resumable(spec: str) -> str | None:
    """Why --resume_from_checkpoint `spec` cannot be resumed from, as the error message
    (None: it is a complete checkpoint, or a mirror URL: checked when the run resumes)."""
    if "://" in spec:
        return None
    folder, given = Path(spec).expanduser(), f"{RESUME} {spec}"
    if not folder.exists():
        return f"{given}: no such folder; {RESUME_HINT}"
    if not folder.is_dir():
        return f"{given} is a file, not a checkpoint folder; {RESUME_HINT}"
    if is_complete(folder):
        return None
    if _is_checkpoint(folder):
        return (
            f"{given} is incomplete (no COMPLETE marker: the run stopped while saving it); "
            f"resume from an earlier checkpoint or use {RESUME} auto"
        )
    if folder.name == "checkpoints" and is_run_dir(folder.parent):
        return _checkpoints_folder(folder, given)
    if is_run_dir(folder):
        return _run_directory(folder, given)
    if holds_weights(folder):
        return _final_weights(folder, given)
    if not any(folder.iterdir()):
        return f"{given} is an empty folder, not a checkpoint; {RESUME_HINT}"
    return f"{given} is not a checkpoint (no {STATE_FILE}, no COMPLETE marker); {RESUME_HINT}"


def _is_checkpoint(folder: Path) -> bool:
    """A checkpoint, complete or not: named like one inside a run, or holding its state."""
    named = folder.parent.name == "checkpoints" and folder.name.startswith("step-")
    return named or (folder / STATE_FILE).is_file() or (folder / RNG_TENSORS).is_file()


def _run_directory(run: Path, given: str) -> str:
    newest = newest_complete(run)
    if newest is None:
        return (
            f"{given} is a run directory with no complete checkpoint to resume from (one is "
            "written every --save_steps); start a new run instead"
        )
    return (
        f"{given} is a run directory, not a checkpoint: resume from its newest complete "
        f"checkpoint with {RESUME} {newest}, or with {RESUME} auto --output_dir {run}"
    )


def _checkpoints_folder(folder: Path, given: str) -> str:
    newest = newest_complete(folder.parent)
    which = (
        f"pass one of them, e.g. the newest complete one: {RESUME} {newest}"
        if newest
        else "it holds no complete checkpoint to resume from"
    )
    return (
        f"{given} is the checkpoints/ folder of the run {folder.parent}, not a checkpoint: {which}"
    )


def _final_weights(folder: Path, given: str) -> str:
    """A final/ folder (or any weights folder): the weights without the training state."""
    if (folder / ADAPTER_CONFIG).is_file():
        use = f"it is a LoRA adapter: load it with --adapters {folder} (swiftlm infer or export)"
    else:
        use = f"it is a full model: load it with --model {folder} (also to train further)"
    message = (
        f"{given} holds final weights only (no optimizer state, schedule or data position), so "
        f"no run can resume from it; {use}"
    )
    newest = newest_complete(folder.parent) if is_run_dir(folder.parent) else None
    if newest is not None:
        message += f". To continue its run, resume from {RESUME} {newest}"
    return message


# ---- swiftlm infer / export: --ckpt_dir and --adapters ---------------------------------------


def check_weights_folders(ckpt_dir: str | None, adapters: list[str]) -> None:
    """Check the folders `swiftlm infer` and `export` load weights from, before anything loads.

    Names what a path is when it is a file, a run's checkpoints/ folder, or (for --adapters) a
    full model; a missing or empty folder is named by `resolve.py` as it resolves it."""
    if ckpt_dir:
        _check_weights_folder(ckpt_dir, "--ckpt_dir")
    for path in adapters:
        _check_weights_folder(path, "--adapters")
        _check_is_adapter(path)


def _check_weights_folder(path: str, flag: str) -> None:
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"{flag} {path} is a file; pass a swiftlm run directory, its final/ folder or a "
            "checkpoint folder"
        )
    if folder.name == "checkpoints" and is_run_dir(folder.parent):
        run, newest = folder.parent, newest_complete(folder.parent)
        example = f", e.g. {flag} {newest}" if newest else " (it holds no complete one)"
        raise ConfigError(
            f"{flag} {path} is the checkpoints/ folder of the run {run}: pass the run itself "
            f"({flag} {run}) or one checkpoint{example}"
        )


def _check_is_adapter(path: str) -> None:
    """--adapters takes adapters: a full model there would replace --model, not apply to it."""
    folder = Path(path).expanduser()
    run = is_run_dir(folder) and not holds_weights(folder)
    weights = folder / "final" if run else folder
    if (weights / MODEL_CONFIG).is_file() and not (weights / ADAPTER_CONFIG).is_file():
        load = f"--ckpt_dir {path}" if run else f"--model {weights}"
        raise ConfigError(
            f"--adapters {path} holds a full model ({MODEL_CONFIG}), not an adapter "
            f"({ADAPTER_CONFIG}); load it with {load}"
        )
