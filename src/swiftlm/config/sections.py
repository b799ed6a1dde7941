"""How a config section is written, and the one section every writing command shares.

A section is a dataclass beside the feature that reads it (`train/config.py`,
`data/config.py`, `methods/config.py`, ...), a leaf module importing only `swiftlm.config`
and `swiftlm.errors` (an import contract holds it to that); `commands.py` composes sections
into each command's config.

Field names are the flag names (flat, ms-swift style): a field `learning_rate` is the flag
`--learning_rate`. Names are unique across all sections so a flat YAML file or flat flags
map onto sections without ambiguity. Each field is declared with `doc`, whose text is its
`--help`.

Each section checks its own fields, one at a time, in `__post_init__` (`checks.py`), so a bad
value fails as soon as the config is built: from flags, a YAML file or a saved config.yaml.
Rules between flags live in `rules.py`.
"""

from dataclasses import dataclass, field
from typing import Literal


def doc(text: str, choices_from=None, **kwargs):
    """A dataclass field whose `help` documents the flag. `choices_from`: a function giving
    the flag's choices when a parser or form is built (a registry that plugins add to),
    for a `str` field whose choices are not fixed in its type (see `flag_type`)."""
    metadata = {"help": text, **({"choices_from": choices_from} if choices_from else {})}
    return field(metadata=metadata, **kwargs)


def flag_type(f) -> object:
    """A section field's type as its flag takes it: `Literal[choices]` for a field whose
    choices come from a registry (`doc(choices_from=...)`), read now; else the field's own."""
    choices_from = f.metadata.get("choices_from")
    return Literal[tuple(choices_from())] if choices_from else f.type


@dataclass
class OverwriteArguments:
    """The overwrite flag of the commands that write one file or folder (infer, eval, export,
    report, plan); training's own, which deletes an earlier run, is in OutputArguments."""

    overwrite_output_dir: bool = doc(
        "Replace what the output flag (--result_path, --eval_output_dir, --output_dir, "
        "--output, --output_json) names when it exists already. Without it an existing file "
        "is refused. An input of the run (dataset, model, run directory) is refused always.",
        default=False,
    )
