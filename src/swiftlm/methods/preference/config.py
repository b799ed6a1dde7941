"""The flag facts of the preference methods (`methods.flags.MethodFlags`): the loss types each
accepts, its default `--beta` (ms-swift's), and which other rlhf flags it reads. Their
settings are the rlhf section's (`methods/config.py`)."""

from swiftlm.losses.loss_types import CPO_LOSS_TYPES, DPO_LOSS_TYPES, KTO_LOSS_TYPES
from swiftlm.methods.flags import MethodFlags

DPO_FLAGS = MethodFlags(
    loss_types=DPO_LOSS_TYPES,
    several_loss_types=True,
    beta=0.1,
    reads=frozenset(
        {"rpo_alpha", "label_smoothing", "loss_weights", "ref_model", "precompute_ref_log_probs"}
    ),
)
# SimPO's beta is larger: its rewards are length-normalized (mean, not sum, of log-probs).
SIMPO_FLAGS = MethodFlags(
    loss_types=("sigmoid",),
    beta=2.0,
    reads=frozenset({"label_smoothing", "simpo_gamma", "cpo_alpha"}),
)
ORPO_FLAGS = MethodFlags(loss_types=("sigmoid",), beta=0.1)
CPO_FLAGS = MethodFlags(
    loss_types=CPO_LOSS_TYPES, beta=0.1, reads=frozenset({"label_smoothing", "cpo_alpha"})
)
KTO_FLAGS = MethodFlags(
    loss_types=KTO_LOSS_TYPES,
    beta=0.1,
    reads=frozenset(
        {"ref_model", "desirable_weight", "undesirable_weight", "precompute_ref_log_probs"}
    ),
)
# A reward model's Bradley-Terry loss has neither a loss type nor a beta.
REWARD_MODEL_FLAGS = MethodFlags()

PREFERENCE_METHODS = {
    "dpo": DPO_FLAGS,
    "simpo": SIMPO_FLAGS,
    "orpo": ORPO_FLAGS,
    "cpo": CPO_FLAGS,
    "kto": KTO_FLAGS,
    "rm": REWARD_MODEL_FLAGS,
}
