"""Build a command's config from an optional YAML file plus flags (flags win).

The flag parser is transformers' `HfArgumentParser` (argparse over dataclasses, help from
field metadata). What we add: a YAML file as the first positional argument, flat or nested
by section; unknown keys and flags rejected with the nearest valid name; ms-swift aliases;
list flags that take several values and repetitions (`--dataset a b` = `--dataset a
--dataset b`); a scalar flag given twice with different values, or a YAML key given twice,
rejected; and per command, the flags it does not use left out of its parser (and `--help`).
"""

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from swiftlm.config.argv import ALIASES, auto_to_number, merge_repeated_flags, normalize_flag
from swiftlm.config.ms_swift import print_notes, translate_argv, translate_mapping, unsupported_hint
from swiftlm.config.sections import flag_type
from swiftlm.errors import ConfigError
from swiftlm.train.config import AUTO_BATCH_SIZE

C = TypeVar("C")


def section_types(config_cls: type) -> dict[str, type]:
    """Section name -> section dataclass of a command config such as `SFTConfig`."""
    return {f.name: f.type for f in dataclasses.fields(config_cls)}


def flag_owners(config_cls: type) -> dict[str, str]:
    """Flag name -> section name. Flag names are unique within a command."""
    owners: dict[str, str] = {}
    for section, cls in section_types(config_cls).items():
        for f in dataclasses.fields(cls):
            if f.name in owners:
                raise RuntimeError(f"flag --{f.name} is defined twice in {config_cls.__name__}")
            owners[f.name] = section
    return owners


def _nearest(name: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _misplaced_key_hint(section: str, key: str, owners: dict[str, str]) -> str:
    if key in owners:
        return f"'{key}' belongs to section '{owners[key]}', not '{section}'"
    return f"unknown key '{section}.{key}'{_nearest(key, sorted(owners))}"


def _unused_hint(key: str, command: str) -> str:
    return f"'{key}' is not used by `{command}` (see `{command} --help` for its flags)"


def flatten_yaml(
    data: dict, config_cls: type, source: str, unused: frozenset = frozenset(), command: str = ""
) -> dict[str, Any]:
    """Accept `key: value` at the top level or grouped by section (`train: {...}`). A key
    given twice (flat and in its section) and a key the command does not use are errors."""
    owners = flag_owners(config_cls)
    sections = section_types(config_cls)
    flat: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        if key in unused:
            raise ConfigError(f"{source}: {_unused_hint(key, command)}")
        if key in flat:
            raise ConfigError(
                f"{source}: '{key}' is given twice (at the top level and in "
                f"section '{owners[key]}'); keep one"
            )
        flat[key] = value

    for key, value in data.items():
        key = ALIASES.get(key, key)
        if key in sections and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                sub_key = ALIASES.get(sub_key, sub_key)
                if owners.get(sub_key) != key:
                    raise ConfigError(f"{source}: {_misplaced_key_hint(key, sub_key, owners)}")
                put(sub_key, sub_value)
        elif key in owners:
            put(key, value)
        elif unsupported_hint(key):
            raise ConfigError(f"{source}: {unsupported_hint(key)}")
        else:
            hint = _nearest(key, sorted(owners) + sorted(sections))
            raise ConfigError(f"{source}: unknown key '{key}'{hint}")
    return flat


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key repeated in one mapping is an error (PyYAML keeps
    the last value without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{self.name}:{line}: key '{key}' is given twice (first on line {seen[key]}); "
                    "keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(
    path: str, config_cls: type, unused: frozenset = frozenset(), command: str = ""
) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loader = _UniqueKeyLoader(file.read_text(encoding="utf-8"))
        loader.name = path
        try:
            data = loader.get_single_data() or {}
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values")
    data, notes = translate_mapping({ALIASES.get(key, key): value for key, value in data.items()})
    print_notes(notes, command or path)
    return flatten_yaml(data, config_cls, path, unused, command)


# Integer flags that also accept the word `auto`: stored as this number, resolved at run time.
AUTO_INT_FLAGS = {"per_device_train_batch_size": AUTO_BATCH_SIZE}


def _split_yaml_values(values: dict[str, Any]) -> tuple[list[str], dict[str, list[str]]]:
    """Scalars become flags placed before the user's flags, so argparse converts and checks
    them like typed flags (YAML reads `1e-4` as a string) and the user's flags win. Lists (all
    list options hold strings) become parser defaults, which keeps an explicit `[]`."""
    argv: list[str] = []
    lists: dict[str, list[str]] = {}
    for key, value in values.items():
        if isinstance(value, list):
            lists[key] = [str(v) for v in value]
        elif value is not None:
            argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv, lists


def list_flags(config_cls: type) -> set[str]:
    """The flags that take several values (list fields)."""
    return {
        f.name
        for cls in section_types(config_cls).values()
        for f in dataclasses.fields(cls)
        if typing.get_origin(f.type) is list
    }


def _visible_section(cls: type, name: str, unused: frozenset) -> type:
    """`cls` without the fields a command does not use, for its parser and `--help`; the
    command's config is still built from `cls` (its checks and defaults)."""
    kept = []
    for f in dataclasses.fields(cls):
        if f.name in unused:
            continue
        default = (
            {"default_factory": f.default_factory}
            if f.default_factory is not dataclasses.MISSING
            else {"default": f.default}
        )
        # The registry's choices as of now, in this copy only (the section keeps `str`).
        metadata = {k: v for k, v in f.metadata.items() if k != "choices_from"}
        kept.append((f.name, flag_type(f), dataclasses.field(metadata=metadata, **default)))
    visible = dataclasses.make_dataclass(cls.__name__, kept)
    visible._argument_group_name = f"{name} flags"  # HfArgumentParser: one --help group each
    return visible


def build_parser(config_cls: type, prog: str, description: str, unused: frozenset = frozenset()):
    from transformers import HfArgumentParser

    return HfArgumentParser(
        [_visible_section(cls, name, unused) for name, cls in section_types(config_cls).items()],
        prog=prog,
        usage=f"{prog} [config.yaml] [--flag value ...]",
        description=description,
        allow_abbrev=False,
    )


def parse_config(
    config_cls: type[C],
    argv: list[str],
    prog: str,
    description: str = "",
    unused: frozenset = frozenset(),
) -> C:
    """Parse `[config.yaml] [--flag value ...]` into a command config.

    `unused`: flags of `config_cls` that this command does not use; given, they are errors.
    A value of the wrong type or choice exits through argparse (code 2); a value that its
    section rejects (`__post_init__`), an unknown, unused or conflicting flag or key raise
    ConfigError, which the CLI prints as `swiftlm <cmd>: error: ...` with exit code 2 too.
    Rules between flags are checked later, by the command (`rules.check`)."""
    argv, notes = translate_argv([normalize_flag(a) for a in argv])
    print_notes(notes, prog)
    parser = build_parser(config_cls, prog, description, unused)
    yaml_flags: list[str] = []
    if argv and argv[0].endswith((".yaml", ".yml")):
        yaml_flags, yaml_lists = _split_yaml_values(load_yaml(argv[0], config_cls, unused, prog))
        parser.set_defaults(**yaml_lists)
        argv = argv[1:]
    # Repetitions are resolved among the user's flags only: a flag overrides the YAML file.
    argv = yaml_flags + merge_repeated_flags(argv, list_flags(config_cls))
    *sections, remaining = parser.parse_args_into_dataclasses(
        auto_to_number(argv, AUTO_INT_FLAGS),
        return_remaining_strings=True,
        look_for_args_file=False,
    )
    if remaining:
        _raise_for_leftover(remaining[0], config_cls, prog, unused)
    return config_cls(
        **{
            name: cls(**dataclasses.asdict(parsed))
            for (name, cls), parsed in zip(section_types(config_cls).items(), sections, strict=True)
        }
    )


def _raise_for_leftover(arg: str, config_cls: type, prog: str, unused: frozenset) -> None:
    if arg.startswith("-"):
        name = arg.lstrip("-").split("=")[0]
        if name in unused:
            raise ConfigError(f"--{name} is not used by `{prog}` (see `{prog} --help`)")
        unsupported = unsupported_hint(name)
        if unsupported:
            raise ConfigError(unsupported)
        hint = _nearest(name, sorted(set(flag_owners(config_cls)) - unused))
        raise ConfigError(f"unknown flag --{name}{hint} (see `{prog} --help`)")
    raise ConfigError(
        f"unexpected argument '{arg}': a config file must end in .yaml and come first; "
        "every other value needs a --flag"
    )


def config_to_dict(config: Any) -> dict[str, dict[str, Any]]:
    """Nested plain dict, section by section (what `config.yaml` holds)."""
    return dataclasses.asdict(config)


def save_config(config: Any, path: Path, unused: frozenset = frozenset()) -> None:
    """Write `config` as YAML, leaving out the flags its command does not use (`unused`, from
    UNUSED_FLAGS: what commands.READS leaves out), so that the file can be given back to the same command."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sections = {
        name: {key: value for key, value in fields.items() if key not in unused}
        for name, fields in config_to_dict(config).items()
    }
    text = yaml.safe_dump(sections, sort_keys=False, allow_unicode=True)
    path.write_text(text, encoding="utf-8")


def load_saved_config(config_cls: type[C], path: Path) -> C:
    """Read a run's `config.yaml` back into a config (unknown keys and values that their
    section rejects are errors)."""
    flat = load_yaml(str(path), config_cls)
    return from_flat_dict(config_cls, flat)


def load_run_config(path: Path):
    """A training run's `config.yaml` as the config of the command that wrote it: RLHFConfig
    when it has an `rlhf` section, else TrainConfig (sft and pt share a `--loss_type` name
    with rlhf's own, in another section, so one class cannot read both)."""
    from swiftlm.config.commands import RLHFConfig, TrainConfig

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        data = None  # load_saved_config names the problem
    config_cls = RLHFConfig if isinstance(data, dict) and "rlhf" in data else TrainConfig
    return load_saved_config(config_cls, path)


def from_flat_dict(config_cls: type[C], flat: dict[str, Any]) -> C:
    """Build a config from flat flag values; the rest take their defaults."""
    owners = flag_owners(config_cls)
    grouped: dict[str, dict[str, Any]] = {name: {} for name in section_types(config_cls)}
    for key, value in flat.items():
        key = ALIASES.get(key, key)
        if key not in owners:
            raise ConfigError(f"unknown option '{key}'{_nearest(key, sorted(owners))}")
        grouped[owners[key]][key] = value
    return config_cls(
        **{name: cls(**grouped[name]) for name, cls in section_types(config_cls).items()}
    )
