"""Extraction rules: how an answer is cut down before it is scored.

A published score depends on the extraction as much as on the model, so the rule is part of
the task (its YAML `extraction:`), is applied the same way to every backend, is written next
to each prediction (`extracted`) and is recorded in the manifest.

- `strip`: the answer without surrounding whitespace (the default);
- `first_line`: its first non-empty line;
- `last_number`: the last number written in it (GSM8K style), or "" when there is none;
- `after:<marker>`: the text after the last `<marker>` (e.g. `after:Answer:`), else all;
- `regex:<pattern>`: the first group of the first match (the whole match if no group), else "".
"""

import re
from collections.abc import Callable

from swiftlm.errors import ConfigError

# A number as written in answers: optional sign, thousands separators, decimals.
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
RULES = ("strip", "first_line", "last_number", "after:<marker>", "regex:<pattern>")


def extractor(rule: str, where: str) -> Callable[[str], str]:
    """The function of an extraction rule; a bad rule is a ConfigError naming `where`."""
    name, _, argument = rule.partition(":")
    if rule == "strip":
        return str.strip
    if rule == "first_line":
        return _first_line
    if rule == "last_number":
        return last_number_text
    if name == "after" and argument:
        return lambda text: text.rsplit(argument, 1)[-1].strip()
    if name == "regex" and argument:
        try:
            pattern = re.compile(argument, re.DOTALL)
        except re.error as exc:
            raise ConfigError(
                f"{where}: extraction {rule!r} is not a valid regex ({exc})"
            ) from None
        return lambda text: _regex(pattern, text)
    raise ConfigError(f"{where}: unknown extraction {rule!r}; use one of {', '.join(RULES)}")


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def last_number_text(text: str) -> str:
    """The last number in `text`, thousands separators dropped; "" when there is none."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else ""


def _regex(pattern: re.Pattern, text: str) -> str:
    match = pattern.search(text)
    if match is None:
        return ""
    return (match.group(1) if pattern.groups else match.group(0)).strip()
