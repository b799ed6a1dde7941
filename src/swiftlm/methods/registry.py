"""`METHODS`: a method name (the subcommand, or `swiftlm rlhf --rlhf_type`) to its class. The
class is built per run as `cls(cfg, tokenizer)` and must satisfy `methods.base.Method`; the
optional capabilities (a reference model's values computed once, sampling its own training
data each step, state kept across steps, evaluation other than the loss) are the overridable
members of `methods.base.MethodDefaults`. A plugin's method is added by
`plugins.register_method`; what an rlhf method reads of the flags is in `methods.config`.
"""

from swiftlm.methods.preference.dpo import DPO
from swiftlm.methods.preference.kto import KTO
from swiftlm.methods.preference.reference_free import CPO, ORPO, SimPO
from swiftlm.methods.preference.reward_model import RewardModel
from swiftlm.methods.pt import PT
from swiftlm.methods.rl.gkd import GKD
from swiftlm.methods.rl.grpo import GRPO
from swiftlm.methods.sft import SFT

METHODS = {
    "sft": SFT,
    "pt": PT,
    "dpo": DPO,
    "simpo": SimPO,
    "orpo": ORPO,
    "cpo": CPO,
    "kto": KTO,
    "rm": RewardModel,
    "grpo": GRPO,
    "gkd": GKD,
}
