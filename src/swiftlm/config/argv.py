"""The command line before argparse sees it: spellings normalized, repetitions resolved.

argparse keeps the last value of a repeated option, so `--dataset a --dataset b` would train
on `b` alone and `--learning_rate 1e-4 ... --learning_rate 1e-3` would use one of them without
a word. Here a list flag's repetitions are joined (as in ms-swift: both mean two datasets), a
scalar flag repeated with the same value is kept once, and with different values is an error.
"""

from swiftlm.config.ms_swift import RENAMED
from swiftlm.errors import ConfigError

# Names that ms-swift users type for the same knob (ms-swift renamed several between versions).
ALIASES = RENAMED


def normalize_flag(arg: str) -> str:
    """`--tuner-type=x` -> `--train_type=x`: accept dashes and ms-swift aliases."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg[2:].partition("=")
    name = name.replace("-", "_")
    return f"--{ALIASES.get(name, name)}{eq}{value}"


def auto_to_number(argv: list[str], auto_ints: dict[str, int]) -> list[str]:
    """`--per_device_train_batch_size auto` (or `=auto`) -> its number, before argparse's int()."""
    out = list(argv)
    for i, arg in enumerate(out):
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in auto_ints:
            continue
        if eq and value == "auto":
            out[i] = f"--{name}={auto_ints[name]}"
        elif not eq and i + 1 < len(out) and out[i + 1] == "auto":
            out[i + 1] = str(auto_ints[name])
    return out


def _occurrences(argv: list[str]) -> list[list]:
    """[flag name or None for leading positionals, its values, written as `--flag=value`] in
    order. A value is every token up to the next `--flag`."""
    groups: list[list] = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            groups.append([name, [value] if eq else [], bool(eq)])
        elif groups:
            groups[-1][1].append(arg)
            groups[-1][2] = False
        else:
            groups.append([None, [arg], False])
    return groups


def _shown(name: str, values: list[str]) -> str:
    return " ".join([f"--{name}", *values])


def merge_repeated_flags(argv: list[str], list_flags: set[str]) -> list[str]:
    """Join the values of each repeated list flag at its first place; keep a scalar flag
    repeated with identical values once; raise a ConfigError for one with different values."""
    merged: list[list] = []
    first: dict[str, list] = {}
    for group in _occurrences(argv):
        name, values, _ = group
        if name is None or name not in first:
            merged.append(group)
            if name is not None:
                first[name] = group
            continue
        earlier = first[name]
        if name in list_flags:
            earlier[1] += values
            earlier[2] = False
        elif values != earlier[1]:
            raise ConfigError(
                f"--{name} is given twice with different values ({_shown(name, earlier[1])}, "
                f"then {_shown(name, values)}); give it once"
            )
    return [token for group in merged for token in _tokens(*group)]


def _tokens(name: str | None, values: list[str], written_with_equals: bool) -> list[str]:
    if name is None:
        return values
    if written_with_equals:  # `--system=-x` must not become `--system -x`
        return [f"--{name}={values[0]}"]
    return [f"--{name}", *values]
