"""The two kinds of config checks.

- `Check`: one field alone. Each section lists its own in `__post_init__`,
  `check_fields(self, max_length=at_least(2), ...)`, so a bad value fails when the config is
  built (from flags, a YAML file or a saved config.yaml) with one ConfigError naming every
  bad flag, its value and what it accepts. An unset value (None) is never checked.
- `Rule`: two flags or more, or a flag and a `Facts` of the run; all of them are listed in
  `rules.py`, which a command runs once with `rules.check(cfg, facts)`.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from swiftlm.errors import ConfigError


@dataclass(frozen=True)
class Check:
    """`ok(value)` is True for a good value; `message` is formatted with `flag` and `value`."""

    ok: Callable[[Any], bool]
    message: str

    def failure(self, flag: str, value: Any) -> str | None:
        """The message for a bad value, None for a good or unset one."""
        if value is None or self.ok(value):
            return None
        shown = " ".join(map(str, value)) if isinstance(value, list) else value  # as typed
        return self.message.format(flag=flag, value=shown)


def _note(note: str) -> str:
    return f" ({note})" if note else ""


def at_least(low: float, note: str = "") -> Check:
    """value >= low."""
    return Check(lambda v: v >= low, f"--{{flag}} {{value}} must be at least {low}{_note(note)}")


def above(low: float, note: str = "") -> Check:
    """value > low (NaN fails)."""
    return Check(lambda v: v > low, f"--{{flag}} {{value}} must be above {low}{_note(note)}")


def within(low: float, high: float, *, open_low=False, open_high=False, note="") -> Check:
    """low <= value <= high, each end open or closed (NaN fails); the message says which."""

    def ok(v) -> bool:
        return (low < v if open_low else low <= v) and (v < high if open_high else v <= high)

    interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    return Check(ok, f"--{{flag}} {{value}} must be in {interval}{_note(note)}")


def matching(pattern: str, fix: str) -> Check:
    """The whole value (as text) matches `pattern`, case-insensitively."""
    regex = re.compile(pattern, re.IGNORECASE)
    return Check(lambda v: regex.fullmatch(str(v)) is not None, f"--{{flag}} {{value}}: {fix}")


def custom(ok: Callable[[Any], bool], message: str) -> Check:
    """Any other check; `message` may use {flag} and {value}."""
    return Check(ok, message)


def check_fields(section: Any, **checks: Check) -> None:
    """Check the fields of a section dataclass named by `checks` (field name -> Check), in
    the order given; raise one ConfigError naming every bad value, joined by "; "."""
    failures = [check.failure(name, getattr(section, name)) for name, check in checks.items()]
    failures = [failure for failure in failures if failure]
    if failures:
        raise ConfigError("; ".join(failures))


@dataclass(frozen=True)
class Facts:
    """What some rules need besides the flags: the processes in the job, and the training
    method class (`name`, `supports_packing`, `default_datasets`; None skips its rules)."""

    world_size: int = 1
    method: Any = None


@dataclass(frozen=True)
class Rule:
    """A rule, broken when `broken(cfg, facts)` is true; `message` names the flags and the fix."""

    name: str
    broken: Callable[[Any, Facts], bool]
    message: str | Callable[[Any, Facts], str]

    def failure(self, cfg: Any, facts: Facts) -> str | None:
        """The message when the rule is broken, else None."""
        if not self.broken(cfg, facts):
            return None
        if callable(self.message):
            return self.message(cfg, facts)
        return self.message.format(
            **flag_values(cfg), world_size=facts.world_size, method=facts.method
        )


def flag_values(cfg: Any) -> dict[str, Any]:
    """Flag name -> value, over every section of a command config."""
    sections = [getattr(cfg, f.name) for f in fields(cfg)]
    return {f.name: getattr(section, f.name) for section in sections for f in fields(section)}
