"""The loss types each preference and RL loss implements, as `--loss_type` names them. A
leaf module (no torch): the methods' flag facts (`methods/*/config.py`) offer these when a
command is parsed, and the loss functions dispatch on them."""

DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "sppo_hard", "aot",
    "aot_pair", "apo_zero", "apo_down", "discopop", "bco_pair",
)  # fmt: skip
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
