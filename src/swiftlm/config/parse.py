"""Build a command's config from an optional YAML file plus flags (flags win).

The flag parser is transformers' `HfArgumentParser` (argparse over dataclasses, help from
field metadata). What we add: a YAML file as the first positional argument, flat or nested
by section; unknown keys and flags rejected with the nearest valid name; ms-swift aliases.
"""

import dataclasses
import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml

from swiftlm.config.sections import AUTO_BATCH_SIZE
from swiftlm.errors import ConfigError

C = TypeVar("C")

# Names that ms-swift users type for the same knob (ms-swift renamed several between versions).
ALIASES = {"tuner_type": "train_type", "sft_type": "train_type", "model_id_or_path": "model"}


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


def flatten_yaml(data: dict, config_cls: type, source: str) -> dict[str, Any]:
    """Accept `key: value` at the top level or grouped by section (`train: {...}`)."""
    owners = flag_owners(config_cls)
    sections = section_types(config_cls)
    flat: dict[str, Any] = {}
    for key, value in data.items():
        key = ALIASES.get(key, key)
        if key in sections and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                sub_key = ALIASES.get(sub_key, sub_key)
                if owners.get(sub_key) != key:
                    raise ConfigError(f"{source}: {_misplaced_key_hint(key, sub_key, owners)}")
                flat[sub_key] = sub_value
        elif key in owners:
            flat[key] = value
        else:
            hint = _nearest(key, sorted(owners) + sorted(sections))
            raise ConfigError(f"{source}: unknown key '{key}'{hint}")
    return flat


def load_yaml(path: str, config_cls: type) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values")
    return flatten_yaml(data, config_cls, path)


# Integer flags that also accept the word `auto`: stored as this number, resolved at run time.
AUTO_INT_FLAGS = {"per_device_train_batch_size": AUTO_BATCH_SIZE}


def _auto_to_number(argv: list[str]) -> list[str]:
    """`--per_device_train_batch_size auto` (or `=auto`) -> 0, before argparse's int()."""
    out = list(argv)
    for i, arg in enumerate(out):
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in AUTO_INT_FLAGS:
            continue
        if eq and value == "auto":
            out[i] = f"--{name}={AUTO_INT_FLAGS[name]}"
        elif not eq and i + 1 < len(out) and out[i + 1] == "auto":
            out[i + 1] = str(AUTO_INT_FLAGS[name])
    return out


def _normalize_flag(arg: str) -> str:
    """`--tuner-type=x` -> `--train_type=x`: accept dashes and ms-swift aliases."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg[2:].partition("=")
    name = name.replace("-", "_")
    return f"--{ALIASES.get(name, name)}{eq}{value}"


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


def build_parser(config_cls: type, prog: str, description: str):
    from transformers import HfArgumentParser

    return HfArgumentParser(
        list(section_types(config_cls).values()),
        prog=prog,
        usage=f"{prog} [config.yaml] [--flag value ...]",
        description=description,
        allow_abbrev=False,
    )


def parse_config(config_cls: type[C], argv: list[str], prog: str, description: str = "") -> C:
    """Parse `[config.yaml] [--flag value ...]` into a command config.

    A value of the wrong type or choice exits through argparse (code 2); a value that its
    section rejects (`__post_init__`), an unknown flag or key raise ConfigError, which the CLI
    prints as `swiftlm <cmd>: error: ...` with exit code 2 too. Rules between flags are
    checked later, by the command (`rules.check`)."""
    argv = [_normalize_flag(a) for a in argv]
    parser = build_parser(config_cls, prog, description)
    if argv and argv[0].endswith((".yaml", ".yml")):
        yaml_flags, yaml_lists = _split_yaml_values(load_yaml(argv[0], config_cls))
        parser.set_defaults(**yaml_lists)
        argv = yaml_flags + argv[1:]
    argv = _auto_to_number(argv)
    *sections, remaining = parser.parse_args_into_dataclasses(
        argv, return_remaining_strings=True, look_for_args_file=False
    )
    if remaining:
        _raise_for_leftover(remaining[0], config_cls, prog)
    return config_cls(**dict(zip(section_types(config_cls), sections, strict=True)))


def _raise_for_leftover(arg: str, config_cls: type, prog: str) -> None:
    if arg.startswith("-"):
        name = arg.lstrip("-").split("=")[0]
        hint = _nearest(name, sorted(flag_owners(config_cls)))
        raise ConfigError(f"unknown flag --{name}{hint} (see `{prog} --help`)")
    raise ConfigError(
        f"unexpected argument '{arg}': a config file must end in .yaml and come first; "
        "every other value needs a --flag"
    )


def config_to_dict(config: Any) -> dict[str, dict[str, Any]]:
    """Nested plain dict, section by section (what `config.yaml` holds)."""
    return dataclasses.asdict(config)


def save_config(config: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False, allow_unicode=True)
    path.write_text(text, encoding="utf-8")


def load_saved_config(config_cls: type[C], path: Path) -> C:
    """Read a run's `config.yaml` back into a config (unknown keys and values that their
    section rejects are errors)."""
    flat = load_yaml(str(path), config_cls)
    return from_flat_dict(config_cls, flat)


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
