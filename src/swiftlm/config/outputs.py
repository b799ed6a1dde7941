"""Nothing a command writes replaces what the user has: every output flag is checked against
the run's inputs and the files already there, once, before anything loads (`check_outputs`).

Each command declares what it writes in `OUTPUTS` (the output flag, a file or a folder, the
names it writes in a folder); its inputs are the local paths of the `INPUT_FLAGS` it has.
An output is refused, naming the flag, the path and the way out, when:

- it is an input (a dataset, the model, a run directory, a file of one such as its
  config.yaml), or a folder that holds one: the run would write over what it reads;
- it lies inside a dataset folder, which the next run reads whole, results included;
- it exists already, unless --overwrite_output_dir true says to replace it.

Two kinds of folders are reused on purpose and keep their own semantics: a training run's
--output_dir (continued with --resume_from_checkpoint, cleared with --overwrite_output_dir,
versioned with --add_version: `train/rundir.py`) and the folders that later runs share
(--local_save_dir, web's --runs_dir). For them only the files the run writes there are
checked against its inputs. Flags left unset (each command's default output, a new timestamped
name) are not checked: they name nothing that exists.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swiftlm.config.checks import flag_values
from swiftlm.config.commands import (
    EvalConfig,
    ExportConfig,
    InferConfig,
    PlanConfig,
    ReportConfig,
    TrainConfig,
    WebConfig,
)
from swiftlm.config.paths import check_writable_file, check_writable_folder
from swiftlm.errors import ConfigError

# What a training run writes at the top of its folder (checkpoints/ is read on resume and
# written beside, never over the checkpoint it resumes).
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "anomalies.jsonl",
    "data_health.json",
    "best_checkpoint.json",
    "report.html",
    "final",
    "tb",
)
EVAL_FILES = (
    "config.yaml",
    "predictions.jsonl",
    "summary.json",
    "manifest.json",
    "contamination.json",
    "lm_eval_results.json",
)
# Where swiftlm's own outputs go inside a run directory given as an input (the defaults of
# report, eval and infer): what is there was written, not read, by swiftlm.
OUTPUT_AREAS = ("report.html", "eval", "infer_result")
# A folder given to these flags is read whole, so a file written inside is read next time.
READ_WHOLE = ("dataset", "val_dataset", "eval_dataset")


@dataclass(frozen=True)
class Output:
    """An output flag. `files`: the names a folder gets (a function of the config; None: any,
    so the folder must be empty). `reused`: a folder that runs continue or share. `in_folder`:
    a file flag given an existing folder writes this name in it. `stdout`: the value that
    prints instead of writing."""

    flag: str
    folder: bool
    files: Callable[[Any], tuple[str, ...]] | None = None
    reused: bool = False
    in_folder: str | None = None
    stdout: str | None = None


def _always(*names: str) -> Callable[[Any], tuple[str, ...]]:
    return lambda cfg: names


def _run_files(cfg: Any) -> tuple[str, ...]:
    # --add_version writes the run into a new subfolder: nothing at the top is written.
    return () if cfg.output.add_version else RUN_FILES


def _eval_files(cfg: Any) -> tuple[str, ...]:
    return ("compare.json",) if cfg.eval.compare else EVAL_FILES


OUTPUTS: dict[type, tuple[Output, ...]] = {
    TrainConfig: (
        Output("output_dir", folder=True, files=_run_files, reused=True),
        Output("local_save_dir", folder=True, files=_always(), reused=True),
    ),
    InferConfig: (Output("result_path", folder=False),),
    EvalConfig: (Output("eval_output_dir", folder=True, files=_eval_files),),
    ExportConfig: (Output("output_dir", folder=True),),
    ReportConfig: (Output("output", folder=False, in_folder="report.html"),),
    PlanConfig: (Output("output_json", folder=False, stdout="-"),),
    WebConfig: (Output("runs_dir", folder=True, files=_always(), reused=True),),
}


# ---- the run's inputs -------------------------------------------------------------------------


def _as_is(value: str) -> list[str]:
    return [value]


def _dataset(spec: str) -> list[str]:
    """`path#N` takes N samples of path (data/sources.py's spelling)."""
    path, sep, count = spec.rpartition("#")
    return [spec, path] if sep and count.isdigit() else [spec]


def _adapter(value: str) -> list[str]:
    """deploy's `name=path`."""
    return [value, value.partition("=")[2]] if "=" in value else [value]


def _reward(value: str) -> list[str]:
    """grpo's `file.py:function`."""
    return [value, value.rpartition(":")[0]] if ":" in value else [value]


# Input flag -> the paths a value may name (only the ones that exist count).
INPUT_FLAGS: dict[str, Callable[[str], list[str]]] = {
    "model": _as_is,
    "ref_model": _as_is,
    "teacher_model": _as_is,
    "ckpt_dir": _as_is,
    "adapters": _adapter,
    "resume_from_checkpoint": _as_is,
    "deepspeed": _as_is,
    "dataset": _dataset,
    "val_dataset": _dataset,
    "eval_dataset": _dataset,
    "compare": _as_is,
    "run_dirs": _as_is,
    "images": _as_is,
    "reward_funcs": _reward,
    "external_plugins": _as_is,
}


@dataclass(frozen=True)
class Input:
    flag: str
    value: str
    path: Path  # resolved: symlinks followed, relative to the working directory


def input_paths(cfg: Any) -> list[Input]:
    """Every local file or folder that `cfg`'s flags read."""
    values = flag_values(cfg)
    found = []
    for name, paths_of in INPUT_FLAGS.items():
        value = values.get(name)
        for item in value if isinstance(value, list) else [value]:
            path = _existing(paths_of(str(item))) if item else None
            if path is not None:
                found.append(Input(f"--{name}", str(item), path))
    return found


def _existing(candidates: list[str]) -> Path | None:
    for candidate in candidates:
        path = Path(candidate).expanduser()
        if candidate and path.exists():
            return path.resolve()
    return None


# ---- the check ----------------------------------------------------------------------------------


def check_outputs(cfg: Any) -> None:
    """Raise a ConfigError for the first output flag of `cfg` that would write over an input
    or, without --overwrite_output_dir true, over something that exists."""
    outputs = next((OUTPUTS[cls] for cls in type(cfg).__mro__ if cls in OUTPUTS), ())
    values = flag_values(cfg)
    inputs = input_paths(cfg)
    overwrite = bool(values.get("overwrite_output_dir"))
    for output in outputs:
        value = values.get(output.flag)
        if value and value != output.stdout:
            _check_output(output, str(value), cfg, inputs, overwrite)


def _check_output(output: Output, value: str, cfg: Any, inputs: list[Input], overwrite: bool):
    flag = f"--{output.flag}"
    given = Path(value).expanduser()
    if output.folder:
        check_writable_folder(value, flag)
        _refuse_input_folder(flag, value, given.resolve(), inputs, output.reused)
        names = output.files(cfg) if output.files is not None else _entries(given)
        written = [given / name for name in names]
    else:
        if output.in_folder and given.is_dir():
            given = given / output.in_folder
        check_writable_file(str(given), flag)
        written = [given]
    for path in written:
        _refuse_input_file(flag, value, path, inputs)
    if not output.reused and not overwrite:
        _refuse_existing(output, flag, value, given, written)


def _refuse_input_folder(flag: str, value: str, folder: Path, inputs, reused: bool) -> None:
    """An output folder must not be an input, nor (unless reused) hold one."""
    for item in inputs:
        if _same(folder, item.path):
            raise ConfigError(
                f"{flag} {value} is {_named(item)}, an input of this run: swiftlm does not "
                f"write over what it reads; pass a folder of its own, e.g. {flag} "
                f"{_beside(value)}"
            )
        if not reused and item.path.is_relative_to(folder):
            raise ConfigError(
                f"{flag} {value} holds {_named(item)}, an input of this run: what is written "
                f"there would mix with it; pass a folder of its own, e.g. {flag} "
                f"{_free(Path(value) / 'output')}"
            )


def _refuse_input_file(flag: str, value: str, path: Path, inputs: list[Input]) -> None:
    """A path an output writes must not be an input, an input's file, nor inside a folder
    that a dataset flag reads whole."""
    target = path.resolve()
    for item in inputs:
        inside = target != item.path and target.is_relative_to(item.path)
        if _same(target, item.path) or (
            inside and path.exists() and not _output_area(target, item.path)
        ):
            what = f"a file of {_named(item)}" if inside else _named(item)
            raise ConfigError(
                f"{_subject(flag, value, path)} is {what}, an input of this run: swiftlm does "
                f"not write over what it reads; pass a path of its own, e.g. {flag} "
                f"{_beside(value)}"
            )
        if inside and item.flag.lstrip("-") in READ_WHOLE:
            raise ConfigError(
                f"{_subject(flag, value, path)} is inside {_named(item)}, a folder read whole: "
                "the next run on it would read this output as data; pass a path outside it, "
                f"e.g. {flag} {_free(item.path.parent / Path(value).name)}"
            )


def _subject(flag: str, value: str, path: Path) -> str:
    """How a message names what an output writes: the flag's own path, or a file in it."""
    if Path(value).expanduser() == path:
        return f"{flag} {value}"
    return f"{flag} {value} writes {path}, which"


def _refuse_existing(output: Output, flag: str, value: str, given: Path, written) -> None:
    there = [path for path in written if path.exists()]
    if not there:
        return
    new = "folder" if output.folder else "path"
    fix = f"pass a new {new}, or add --overwrite_output_dir true to replace"
    if not output.folder:
        raise ConfigError(
            f"{flag} {value}: {given} exists already ({_size(given)}); swiftlm does not write "
            f"over a file: {fix} it"
        )
    what = "is not empty" if output.files is None else "holds an earlier output"
    raise ConfigError(
        f"{flag} {value} {what} ({_listing(there)}); swiftlm does not write over it: {fix} "
        "what it holds"
    )


# ---- small helpers ------------------------------------------------------------------------------


def _same(a: Path, b: Path) -> bool:
    """The same file or folder: one path once resolved, or one inode (a hard link)."""
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _output_area(target: Path, folder: Path) -> bool:
    first = target.relative_to(folder).parts[0]
    return first in OUTPUT_AREAS


def _named(item: Input) -> str:
    return f"{item.flag} {item.value}"


def _beside(value: str) -> str:
    """A free name next to `value`: `rows.jsonl` -> `rows-out.jsonl`, `out` -> `out-2`."""
    path = Path(value)
    if not path.name:  # `.` or `/`: name the folder itself
        path = path.expanduser().resolve()
    stem, suffix = path.stem, path.suffix
    for n in range(2, 100):
        tag = "-out" if suffix and n == 2 else f"-{n}"
        candidate = path.with_name(f"{stem}{tag}{suffix}")
        if not candidate.expanduser().exists():
            return str(candidate)
    return str(path.with_name(f"{stem}-new{suffix}"))


def _free(path: Path) -> str:
    return str(path) if not path.exists() else _beside(str(path))


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _listing(paths: list[Path], most: int = 4) -> str:
    names = [p.name + ("/" if p.is_dir() else "") for p in paths]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _size(path: Path) -> str:
    size = path.stat().st_size
    return f"{size} bytes" if size < 10_000 else f"{size / 1e6:.1f} MB"
