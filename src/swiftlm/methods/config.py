"""The config section of `swiftlm rlhf` (which method, and the preference losses' settings)
and the registry of its methods' flag facts. Field names are the flag names (ms-swift's),
each field's `help` is its `--help` text, the section checks its own fields when built.

Each method declares what it reads (`methods.flags.MethodFlags`, in its package's
`config.py`); `RLHF_METHODS` maps `--rlhf_type` to it, the built-ins here and a plugin's
through `plugins.register_method`. A leaf module: parsing imports no torch.
"""

from dataclasses import dataclass

from swiftlm.config.checks import above, at_least, check_fields, within
from swiftlm.config.sections import doc
from swiftlm.errors import ConfigError
from swiftlm.methods.flags import MethodFlags, settle_online_sections, settle_rlhf_section
from swiftlm.methods.preference.config import PREFERENCE_METHODS
from swiftlm.methods.rl.config import ONLINE_METHODS

# --rlhf_type -> what the method reads: the built-ins, then the plugins' in registration order.
RLHF_METHODS: dict[str, MethodFlags] = {**PREFERENCE_METHODS, **ONLINE_METHODS}


def rlhf_types() -> tuple[str, ...]:
    """The methods `--rlhf_type` takes."""
    return tuple(RLHF_METHODS)


def method_flags(kind: str) -> MethodFlags:
    if kind not in RLHF_METHODS:  # a saved or YAML config is not checked by argparse
        raise ConfigError(f"--rlhf_type {kind}: choose one of {', '.join(rlhf_types())}")
    return RLHF_METHODS[kind]


def settle_online(rlhf, grpo, gkd) -> None:
    """The grpo and gkd sections as the chosen method reads them (called by RLHFConfig)."""
    settle_online_sections(rlhf, grpo, gkd, method_flags(rlhf.rlhf_type), RLHF_METHODS)


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
        "dpo, kto: score every answer with the reference once before training and keep the "
        "log-probs with the samples; the reference model is then freed (full fine-tuning, "
        "--ref_model) and no step runs it (kto's mismatched KL rows, drawn per micro-batch, "
        "still run it with --loss_type kto). The losses are the same.",
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
        flags = method_flags(self.rlhf_type)
        self.loss_type = _one_or_several(self.loss_type)
        if self.loss_weights is not None:
            self.loss_weights = [float(w) for w in self.loss_weights]
        check_fields(
            self,
            label_smoothing=within(0, 0.5, open_high=True),
            rpo_alpha=at_least(0),
            simpo_gamma=at_least(0),
            cpo_alpha=at_least(0),
            desirable_weight=above(0),
            undesirable_weight=above(0),
        )
        settle_rlhf_section(self, flags, RLHF_METHODS)
        self._check_loss_weights()

    def loss_types(self) -> list[str]:
        """--loss_type as a list (one entry for every method but dpo)."""
        if self.loss_type is None:
            return []
        return list(self.loss_type) if isinstance(self.loss_type, list) else [self.loss_type]

    def _check_loss_weights(self) -> None:
        types = self.loss_types()
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


def _one_or_several(value):
    """A one-entry list (how the flag parses) -> its string; several stay a list."""
    if isinstance(value, (list, tuple)):
        values = [str(v) for v in value]
        if not values:
            return None
        return values[0] if len(values) == 1 else values
    return value
