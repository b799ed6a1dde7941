"""The config section of how an engine samples (`GenerationArguments`: new tokens,
temperature, top-k/top-p, repetition penalty), read by infer, eval and deploy. Same
conventions as `config/sections.py`: field names are the flag names, each field's `help` is
its `--help` text, the section checks its own fields when built.
"""

from dataclasses import dataclass

from swiftlm.config.checks import above, at_least, check_fields, custom, within
from swiftlm.config.sections import doc


@dataclass
class GenerationArguments:
    max_new_tokens: int = doc("Most tokens generated per answer.", default=512)
    temperature: float = doc("Sampling temperature; 0 means greedy.", default=0.0)
    top_p: float = doc(
        "Nucleus sampling: smallest token set with this total probability.", default=1.0
    )
    top_k: int = doc("Sample among the k most likely tokens (0 disables).", default=0)
    repetition_penalty: float = doc("Penalty > 1 discourages repeating tokens.", default=1.0)

    def __post_init__(self):
        check_fields(
            self,
            max_new_tokens=at_least(1),
            temperature=custom(lambda v: v >= 0, "--{flag} {value} must be 0 (greedy) or more"),
            top_p=within(0, 1, open_low=True),
            top_k=custom(lambda v: v >= 0, "--{flag} {value} must be 0 (off) or more"),
            repetition_penalty=above(0),
        )
