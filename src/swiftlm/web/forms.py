"""The UI's forms, generated from the command configs: one input per flag, with the flag's own
`--help` text, choices and default; and back from the form's values to the command line.

A command line holds only the flags whose value differs from the default, so what the UI
runs is what a person would type. It is checked the way the command checks it before running
(`parse_config`, then the rules between flags, then that local datasets exist), and any
error is swiftlm's own message.
"""

import contextlib
import dataclasses
import io
import os
import shlex
import types
import typing
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

import swiftlm.config as config_module
from swiftlm.config import rules
from swiftlm.config.parse import parse_config, section_types
from swiftlm.config.sections import flag_type
from swiftlm.data.sources import (
    BUILTIN_DATASETS,
    SUPPORTED_EXTENSIONS,
    parse_dataset_spec,
    read_rows,
)
from swiftlm.errors import ConfigError
from swiftlm.plugins import load_plugins
from swiftlm.plugins.loading import plugin_files

# command -> config class name; the commands the UI configures.
COMMAND_CONFIGS = {
    "sft": "TrainConfig",
    "pt": "TrainConfig",
    "rlhf": "RLHFConfig",
    "export": "ExportConfig",
    "eval": "EvalConfig",
}
TRAINING_COMMANDS = ("sft", "pt", "rlhf")
# The tabs of a training run, each a list of config sections, in the order a person decides.
TRAINING_TABS = {
    "Model": ("model", "quant"),
    "Data": ("data",),
    "Method": ("rlhf", "grpo", "gkd", "plugins"),
    "Tuner": ("tuner",),
    "Training": ("train", "output", "monitor", "evaluation"),
    "Distributed": ("dist",),
}
# Set by the UI itself: the run directory is RUNS_DIR/<run name>; the run or checkpoint of an
# export or evaluation is chosen from the runs.
UI_FLAGS = frozenset({"output_dir", "ckpt_dir", "eval_output_dir"})
DEFAULT_RECIPE = "default_sft.yaml"


def command_config(command: str) -> type:
    if command not in COMMAND_CONFIGS:
        raise ConfigError(f"the UI runs {', '.join(COMMAND_CONFIGS)}; not '{command}'")
    return getattr(config_module, COMMAND_CONFIGS[command])


def visible_fields(command: str) -> dict[str, list[dataclasses.Field]]:
    """Section name -> the fields of `command`'s flags (those it uses, less the UI's own)."""
    unused = config_module.UNUSED_FLAGS[command] | UI_FLAGS
    return {
        name: [f for f in dataclasses.fields(cls) if f.name not in unused]
        for name, cls in section_types(command_config(command)).items()
    }


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return annotation, False


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def as_text(value: Any) -> str:
    """A value as a person types it in the form (and on the command line)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def field_spec(f: dataclasses.Field) -> dict:
    """What the page needs to draw one flag's input."""
    annotation, optional = _unwrap_optional(flag_type(f))
    origin = typing.get_origin(annotation)
    spec = {
        "name": f.name,
        "help": f.metadata.get("help", ""),
        "default": as_text(_default(f)),
        "optional": optional,
        "kind": "text",
    }
    if annotation is bool:
        spec.update(kind="choice", choices=["true", "false"])
    elif origin is Literal:
        spec.update(kind="choice", choices=[as_text(c) for c in typing.get_args(annotation)])
    elif origin is list:
        spec["kind"] = "list"
    elif annotation in (int, float):
        spec["kind"] = annotation.__name__
    return spec


def form_schema(command: str) -> dict:
    """The form of `command`: tabs of sections of fields (training commands), or one tab."""
    fields = visible_fields(command)
    # A tool's own section (export, eval) first: the model is chosen from the runs.
    own = sorted(fields, key=lambda section: section != command)
    layout = dict(TRAINING_TABS) if command in TRAINING_COMMANDS else {command: tuple(own)}
    placed = {s for sections in layout.values() for s in sections}
    if set(fields) - placed:  # a section added since: still in the form
        layout["Other"] = tuple(s for s in fields if s not in placed)
    tabs = []
    for tab, sections in layout.items():
        present = [s for s in sections if fields.get(s)]
        tabs.append(
            {
                "name": tab,
                "sections": [
                    {"name": s, "fields": [field_spec(f) for f in fields[s]]} for s in present
                ],
            }
        )
    return {"command": command, "tabs": tabs}


def _typed(value: str, annotation: Any) -> Any:
    """`value` as the field's type, or the text itself when it does not convert (argparse then
    says what is wrong with it)."""
    annotation, _ = _unwrap_optional(annotation)
    try:
        if annotation is bool:
            return {"true": True, "false": False}.get(value.strip().lower(), value)
        if annotation in (int, float):
            return annotation(value)
    except ValueError:
        return value
    return value


def build_argv(command: str, values: dict[str, str]) -> list[str]:
    """The flags of `values` (flag -> text as typed) that differ from their default, in the
    form's order. Lists take whitespace-separated values; an emptied optional is its default."""
    argv: list[str] = []
    by_name = {f.name: f for fields in visible_fields(command).values() for f in fields}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise ConfigError(f"unknown flag --{unknown[0]} for `swiftlm {command}`")
    for name, f in by_name.items():
        if name not in values:
            continue
        text = str(values[name]).strip()
        default = _default(f)
        if typing.get_origin(_unwrap_optional(flag_type(f))[0]) is list:
            try:
                items = shlex.split(text)
            except ValueError as exc:  # an unclosed quote
                raise ConfigError(f"--{name} {text}: {exc}; quote a value with spaces") from None
            if items != [as_text(v) for v in default]:
                argv += [f"--{name}", *items]
        elif text == "" and default is None:
            continue
        elif _typed(text, flag_type(f)) != default:
            argv += [f"--{name}", text]
    return argv


def uses_default_recipe(command: str, argv: list[str]) -> bool:
    """`swiftlm sft` with neither --model nor --dataset runs the built-in default job (the CLI's
    `with_default_recipe`); the UI validates it the same way."""
    return command == "sft" and not {"--model", "--dataset"} & set(argv)


def recipe_path() -> str:
    return str(files("swiftlm") / "assets" / DEFAULT_RECIPE)


def parse_checked(command: str, argv: list[str]) -> Any:
    """The command's config from `argv`, checked as the command checks it before running;
    raises ConfigError (or DataError for a dataset) with swiftlm's own message."""
    full = [recipe_path(), *argv] if uses_default_recipe(command, argv) else argv
    unused = config_module.UNUSED_FLAGS[command]
    prog = f"swiftlm {command}"
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            # As the CLI does: plugins may add names that the flags are checked against. A
            # file is loaded once per process (edit a plugin: restart `swiftlm web`).
            load_plugins(plugin_files(full))
            cfg = parse_config(command_config(command), full, prog, "", unused)
    except SystemExit:  # argparse: a value of the wrong type or choice
        message = errors.getvalue().strip().splitlines()
        raise ConfigError(message[-1] if message else f"{prog}: bad flags") from None
    rules.check(cfg)
    if command in TRAINING_COMMANDS:
        check_datasets([*cfg.data.dataset, *cfg.data.val_dataset])
    return cfg


def is_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or path.lower().endswith(SUPPORTED_EXTENSIONS)


def check_datasets(specs: list[str]) -> None:
    """Read the first row of each built-in or local dataset: a missing file or a bad spec is
    an error now, not after the model has loaded. Hub datasets are left to the run."""
    for spec in specs:
        path, _ = parse_dataset_spec(spec)
        if path in BUILTIN_DATASETS or is_local(path) or os.path.exists(path):
            next(iter(read_rows(path)), None)


def command_line(argv: list[str]) -> str:
    """What a person types: `swiftlm sft --flag value ...`, quoted for a POSIX shell."""
    return shlex.join(["swiftlm", *argv])


def run_argv(command: str, values: dict[str, str], run_dir: Path) -> list[str]:
    """The full argv of a training run in `run_dir` (checked; raises SwiftLMError)."""
    argv = [*build_argv(command, values), "--output_dir", str(run_dir)]
    parse_checked(command, argv)
    return [command, *argv]
