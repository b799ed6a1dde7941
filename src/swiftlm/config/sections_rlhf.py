"""The config section of `swiftlm rlhf`: which preference method and its loss settings. Same
conventions as `sections.py`: field names are the flag names (ms-swift's), each field's `help`
is its `--help` text, the section checks its own fields when built.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, within
from swiftlm.config.sections import doc
from swiftlm.errors import ConfigError

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")  # losses.preference.CPO_LOSS_TYPES (tested)

# The DPO loss types of losses.preference.DPO_LOSS_TYPES (a test keeps the two equal).
DpoLossType = Literal[
    "sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "sppo_hard", "aot",
    "aot_pair", "apo_zero", "apo_down", "discopop",
]  # fmt: skip


@dataclass
class RLHFArguments:
    rlhf_type: Literal["dpo", "simpo", "orpo", "cpo"] = doc(
        "Preference method. dpo: against a reference model (the base with the LoRA adapter "
        "disabled, or a frozen copy with full fine-tuning); simpo, orpo, cpo: without one.",
        default="dpo",
    )
    beta: float | None = doc(
        "Strength of the preference term (DPO's beta). Default: 2.0 for simpo, 0.1 otherwise "
        "(ms-swift's).",
        default=None,
    )
    loss_type: DpoLossType = doc(
        "dpo: sigmoid (DPO), hinge (SLiC), ipo, robust (rDPO), exo_pair, nca_pair, sppo_hard, "
        "aot, aot_pair, apo_zero, apo_down, discopop (aot and aot_pair sort over the "
        "micro-batch, so they depend on how a step is split); cpo: sigmoid, hinge, ipo; "
        "simpo and orpo: sigmoid only.",
        default="sigmoid",
    )
    label_smoothing: float = doc(
        "Assumed share of flipped preference labels (cDPO, robust, exo_pair, aot, simpo, cpo).",
        default=0.0,
    )
    rpo_alpha: float | None = doc(
        "dpo: weight of the chosen answers' token-mean NLL added to the loss (RPO). None: not "
        "added.",
        default=None,
    )
    simpo_gamma: float = doc("simpo: the target reward margin gamma.", default=1.0)
    cpo_alpha: float = doc(
        "simpo and cpo: weight of the chosen answers' token-mean NLL (0: the paper's pure SimPO).",
        default=1.0,
    )

    def __post_init__(self):
        if self.beta is None:  # the effective value is what config.yaml records
            self.beta = 2.0 if self.rlhf_type == "simpo" else 0.1
        check_fields(
            self,
            beta=above(0),
            label_smoothing=within(0, 0.5, open_high=True),
            rpo_alpha=at_least(0),
            simpo_gamma=at_least(0),
            cpo_alpha=at_least(0),
        )
        self._check_method_flags()

    def _check_method_flags(self) -> None:
        """A flag the chosen --rlhf_type does not read is an error, not silently ignored."""
        kind = self.rlhf_type
        accepted = {"dpo": None, "cpo": CPO_LOSS_TYPES, "simpo": ("sigmoid",), "orpo": ("sigmoid",)}
        if accepted[kind] is not None and self.loss_type not in accepted[kind]:
            raise ConfigError(
                f"--loss_type {self.loss_type}: --rlhf_type {kind} accepts "
                f"{', '.join(accepted[kind])}; the other loss types are DPO's (--rlhf_type dpo)"
            )
        unread = {
            "rpo_alpha": kind != "dpo" and self.rpo_alpha is not None,
            "label_smoothing": kind == "orpo" and self.label_smoothing != 0,
            "simpo_gamma": kind != "simpo" and self.simpo_gamma != 1.0,
            "cpo_alpha": kind in ("dpo", "orpo") and self.cpo_alpha != 1.0,
        }
        for flag, given in unread.items():
            if given:
                raise ConfigError(
                    f"--{flag} is not used by --rlhf_type {kind}: drop it, or pick the method "
                    "that reads it (see `swiftlm rlhf --help`)"
                )
