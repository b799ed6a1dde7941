"""Dataset formats added by plugins (`swiftlm.plugins.register_dataset_format`).

A format converts a user's row into a row of a built-in format (`messages`, `conversations`,
Alpaca, query/response, or `text`), which `data.formats` then reads as usual. A row in no
built-in format goes to the first registered format whose `detect` accepts it;
`--dataset_format NAME` converts every row with NAME.
"""

from collections.abc import Callable
from dataclasses import dataclass

from swiftlm.data.rows import RowError, type_name
from swiftlm.errors import ConfigError


@dataclass(frozen=True)
class RowFormat:
    """convert(row) -> a row in a built-in format; detect(row) -> whether a row is in this
    format (None: the format is used only when named with --dataset_format)."""

    convert: Callable[[dict], dict]
    detect: Callable[[dict], bool] | None = None


# name -> RowFormat, in registration order (the order detection tries them).
ROW_FORMATS: dict[str, RowFormat] = {}


def registered_format(
    record: dict, name: str | None, in_builtin_format: Callable[[dict], bool]
) -> dict:
    """`record` converted by the format `name`, or (no name) by the first registered format
    that detects it when `in_builtin_format(record)` is false; else `record` itself."""
    if name is not None:
        return convert_row(name, record)
    if not ROW_FORMATS or in_builtin_format(record):
        return record
    return detect_format(record)


def convert_row(name: str, record: dict) -> dict:
    """`record` converted by the registered format `name`."""
    if name not in ROW_FORMATS:
        known = ", ".join(ROW_FORMATS) or "none is registered"
        raise ConfigError(
            f"--dataset_format {name}: not a registered dataset format ({known}); load the "
            "plugin that registers it (installed, or --external_plugins file.py)"
        )
    return _checked(ROW_FORMATS[name].convert(record), name)


def detect_format(record: dict) -> dict:
    """`record` converted by the first registered format that detects it, else unchanged."""
    for name, row_format in ROW_FORMATS.items():
        if row_format.detect is not None and row_format.detect(record):
            return _checked(row_format.convert(record), name)
    return record


def _checked(converted, name: str) -> dict:
    if not isinstance(converted, dict):
        raise RowError(
            "bad field type",
            f"dataset format {name!r} returned {type_name(converted)}, expected a row (dict)",
        )
    return converted
