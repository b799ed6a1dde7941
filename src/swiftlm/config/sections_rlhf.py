"""The config section of `swiftlm rlhf`: which preference method and its loss settings. Same
conventions as `sections.py`: field names are the flag names (ms-swift's), each field's `help`
is its `--help` text, the section checks its own fields when built.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, within
from swiftlm.config.sections import doc

# The DPO loss types of losses.preference.DPO_LOSS_TYPES (a test keeps the two equal).
DpoLossType = Literal[
    "sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "sppo_hard", "aot",
    "aot_pair", "apo_zero", "apo_down", "discopop",
]  # fmt: skip


@dataclass
class RLHFArguments:
    rlhf_type: Literal["dpo"] = doc(
        "Preference method. dpo: Direct Preference Optimization against a reference model "
        "(the base with the LoRA adapter disabled, or a frozen copy with full fine-tuning).",
        default="dpo",
    )
    beta: float = doc(
        "Strength of the tie to the reference model (DPO's beta; TRL's and ms-swift's default).",
        default=0.1,
    )
    loss_type: DpoLossType = doc(
        "DPO loss: sigmoid (DPO), hinge (SLiC), ipo, robust (rDPO), exo_pair, nca_pair, "
        "sppo_hard, aot, aot_pair, apo_zero, apo_down, discopop. aot and aot_pair sort over "
        "the micro-batch, so they depend on how a step is split into micro-batches.",
        default="sigmoid",
    )
    label_smoothing: float = doc(
        "Assumed share of flipped preference labels (cDPO, robust, exo_pair, aot).", default=0.0
    )
    rpo_alpha: float | None = doc(
        "Weight of the chosen answers' token-mean NLL added to the loss (RPO). None: not added.",
        default=None,
    )

    def __post_init__(self):
        check_fields(
            self,
            beta=above(0),
            label_smoothing=within(0, 0.5, open_high=True),
            rpo_alpha=at_least(0),
        )
