"""The config section of `swiftlm rlhf`: which preference method and its loss settings. Same
conventions as `sections.py`: field names are the flag names (ms-swift's), each field's `help`
is its `--help` text, the section checks its own fields when built.
"""

from dataclasses import dataclass

from swiftlm.config.checks import above, at_least, check_fields, within
from swiftlm.config.sections import doc
from swiftlm.errors import ConfigError

# The loss types each method implements (losses.preference, losses.rl import them from here).
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "sppo_hard", "aot",
    "aot_pair", "apo_zero", "apo_down", "discopop", "bco_pair",
)  # fmt: skip
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")

# Per method (a registry: a plugin's method adds its row, plugins.register_method): the loss
# types it accepts (the first is its default; empty: --loss_type is not read) and its
# default beta (None: --beta is not read).
LOSS_TYPES: dict[str, tuple[str, ...]] = {
    "dpo": DPO_LOSS_TYPES,
    "simpo": ("sigmoid",),
    "orpo": ("sigmoid",),
    "cpo": CPO_LOSS_TYPES,
    "kto": KTO_LOSS_TYPES,
    "rm": (),
    "grpo": GRPO_LOSS_TYPES,
    "gkd": (),
}
# ms-swift's defaults (TRL's differ for grpo: beta 0.0; see docs/alignment.md's table).
DEFAULT_BETA: dict[str, float | None] = {
    "dpo": 0.1, "simpo": 2.0, "orpo": 0.1, "cpo": 0.1, "kto": 0.1, "rm": None, "grpo": 0.04,
    "gkd": 0.5,
}  # fmt: skip


def rlhf_types() -> tuple[str, ...]:
    """The methods `--rlhf_type` takes: the built-ins, then the plugins' in registration order."""
    return tuple(LOSS_TYPES)


@dataclass
class RLHFArguments:
    rlhf_type: str = doc(
        "Method. dpo: preference pairs against a reference model (the base with the LoRA "
        "adapter disabled, or a frozen copy with full fine-tuning); simpo, orpo, cpo: pairs "
        "without one; kto: unpaired answers labelled good or bad; rm: a reward model (value "
        "head, Bradley-Terry); grpo: RL from reward functions on the model's own samples; gkd: "
        "on-policy distillation from --teacher_model.",
        default="dpo",
        choices_from=lambda: rlhf_types(),
    )
    beta: float | None = doc(
        "dpo/kto/cpo/orpo/simpo: strength of the preference term; grpo: weight of the KL to "
        "the reference (0: no reference model is loaded); gkd: the generalized JSD's "
        "interpolation (0: forward KL, 1: reverse KL). Default (ms-swift's): 0.1; simpo 2.0, "
        "grpo 0.04, gkd 0.5. rm does not read it.",
        default=None,
    )
    # Parsed as a list (`--loss_type sigmoid bco_pair`); one value is stored as a string, which
    # is what every method but dpo reads.
    loss_type: list[str] | None = doc(
        "dpo: sigmoid (DPO, default), hinge (SLiC), ipo, robust (rDPO), exo_pair, nca_pair, "
        "sppo_hard, aot, aot_pair, apo_zero, apo_down, discopop, bco_pair (aot, aot_pair and "
        "bco_pair depend on how a step is split into micro-batches); dpo takes several "
        "(`--loss_type sigmoid bco_pair`, weighted by --loss_weights); cpo: sigmoid, hinge, ipo; "
        "simpo and orpo: sigmoid; kto: kto, apo_zero_unpaired; grpo: grpo (default), bnpo, "
        "dr_grpo, dapo (see docs/alignment.md, GRPO); rm and gkd: none.",
        default=None,
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
    loss_weights: list[float] | None = doc(
        "dpo: one weight per --loss_type; the loss is their weighted sum (TRL's loss_weights). "
        "Default: 1 for each.",
        default=None,
    )
    ref_model: str | None = doc(
        "dpo, kto and grpo: the frozen reference model (a folder, hub id or .gguf) instead of the "
        "initial policy (a frozen copy, or the base with the LoRA adapter disabled). It must "
        "use the policy's tokenizer (same vocabulary).",
        default=None,
    )
    precompute_ref_log_probs: bool = doc(
        "dpo: score every pair with the reference once before training and keep the log-probs "
        "with the samples; the reference model is then freed (full fine-tuning, --ref_model) "
        "and no step runs it. The losses are the same.",
        default=False,
    )
    desirable_weight: float = doc(
        "kto: weight of the desirable answers' losses (TRL's; raise it when they are fewer).",
        default=1.0,
    )
    undesirable_weight: float = doc(
        "kto: weight of the undesirable answers' losses.",
        default=1.0,
    )

    def __post_init__(self):
        # The effective values are what config.yaml records and the run prints.
        kind = self.rlhf_type
        if kind not in LOSS_TYPES:  # a saved or YAML config is not checked by argparse
            raise ConfigError(f"--rlhf_type {kind}: choose one of {', '.join(rlhf_types())}")
        if self.beta is None:
            self.beta = DEFAULT_BETA[kind]
        self.loss_type = _one_or_several(self.loss_type)
        if self.loss_type is None and LOSS_TYPES[kind]:
            self.loss_type = LOSS_TYPES[kind][0]
        if self.loss_weights is not None:
            self.loss_weights = [float(w) for w in self.loss_weights]
        # grpo: beta 0 drops the KL term and the reference; gkd: 0 is forward KL, 1 reverse.
        beta_check = {"grpo": at_least(0), "gkd": within(0, 1)}.get(kind, above(0))
        check_fields(
            self,
            beta=beta_check,
            label_smoothing=within(0, 0.5, open_high=True),
            rpo_alpha=at_least(0),
            simpo_gamma=at_least(0),
            cpo_alpha=at_least(0),
            desirable_weight=above(0),
            undesirable_weight=above(0),
        )
        self._check_method_flags()
        self._check_loss_weights()

    def loss_types(self) -> list[str]:
        """--loss_type as a list (one entry for every method but dpo)."""
        if self.loss_type is None:
            return []
        return list(self.loss_type) if isinstance(self.loss_type, list) else [self.loss_type]

    def _check_loss_weights(self) -> None:
        types = self.loss_types()
        if isinstance(self.loss_type, list) and self.rlhf_type != "dpo":
            raise ConfigError(
                f"--loss_type {' '.join(types)}: only --rlhf_type dpo combines several loss "
                f"types; --rlhf_type {self.rlhf_type} takes one"
            )
        if len(types) != len(set(types)):
            raise ConfigError(f"--loss_type {' '.join(types)}: a loss type is given twice")
        weights = self.loss_weights
        if weights is None:
            return
        if len(weights) != len(types):
            raise ConfigError(
                f"--loss_weights {' '.join(map(str, weights))}: give one weight per --loss_type "
                f"({len(types)}: {' '.join(types)})"
            )
        if any(w < 0 or w != w for w in weights):
            raise ConfigError(f"--loss_weights {' '.join(map(str, weights))}: must be >= 0")

    def _check_method_flags(self) -> None:
        """A flag the chosen --rlhf_type does not read is an error, not silently ignored."""
        kind = self.rlhf_type
        accepted = LOSS_TYPES[kind]
        for loss_type in self.loss_types():
            if loss_type in accepted:
                continue
            if not accepted:
                raise ConfigError(f"--loss_type is not used by --rlhf_type {kind}: drop it")
            owners = [k for k, types in LOSS_TYPES.items() if loss_type in types]
            hint = f"; {loss_type} is a loss of --rlhf_type {'/'.join(owners)}" if owners else ""
            raise ConfigError(
                f"--loss_type {loss_type}: --rlhf_type {kind} accepts {', '.join(accepted)}{hint}"
            )
        if DEFAULT_BETA[kind] is None and self.beta is not None:
            raise ConfigError(f"--beta is not used by --rlhf_type {kind}: drop it")
        readers = {  # flag: (the methods that read it, its default)
            "rpo_alpha": (("dpo",), None),
            "label_smoothing": (("dpo", "simpo", "cpo"), 0.0),
            "simpo_gamma": (("simpo",), 1.0),
            "cpo_alpha": (("simpo", "cpo"), 1.0),
            "loss_weights": (("dpo",), None),
            "ref_model": (("dpo", "kto", "grpo"), None),
            "precompute_ref_log_probs": (("dpo",), False),
            "desirable_weight": (("kto",), 1.0),
            "undesirable_weight": (("kto",), 1.0),
        }
        unread = {
            flag: kind not in methods and getattr(self, flag) != default
            for flag, (methods, default) in readers.items()
        }
        for flag, given in unread.items():
            if given:
                raise ConfigError(
                    f"--{flag} is not used by --rlhf_type {kind}: drop it, or pick the method "
                    "that reads it (see `swiftlm rlhf --help`)"
                )


def _one_or_several(value):
    """A one-entry list (how the flag parses) -> its string; several stay a list."""
    if isinstance(value, (list, tuple)):
        values = [str(v) for v in value]
        if not values:
            return None
        return values[0] if len(values) == 1 else values
    return value
