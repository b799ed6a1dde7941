"""The config section of what a training run trains: full fine-tuning (optionally LISA's sampled
layers), LoRA (rank, alpha, target modules, DoRA, rsLoRA, LoRA+, PiSSA/OLoRA initialisation) or
another peft tuner (VeRA, LoHa, LoKr, OFT, BOFT, IA3), and which parameters are frozen. Same conventions as
`config/sections.py`: field names are the flag names, each field's `help` is its `--help`
text, the section checks its own fields when built.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, custom, within
from swiftlm.config.sections import doc

# peft tuners besides LoRA/DoRA, by ms-swift's --train_type names (adalora is refused by a rule).
PEFT_TUNERS = ("vera", "loha", "lokr", "oft", "boft", "adalora", "ia3")
TrainType = Literal["lora", "dora", "full", "vera", "loha", "lokr", "oft", "boft", "adalora", "ia3"]
# --init_weights values (ms-swift's, peft's `init_lora_weights`); pissa_niter_N is matched apart.
INIT_WEIGHTS = ("true", "false", "gaussian", "pissa", "olora", "loftq")


def valid_init_weights(value: str) -> bool:
    """One of INIT_WEIGHTS, or pissa_niter_N (fast PiSSA: N subspace iterations, N >= 1)."""
    if value in INIT_WEIGHTS:
        return True
    niter = value.removeprefix("pissa_niter_")
    return niter != value and niter.isdigit() and int(niter) >= 1


@dataclass
class TunerArguments:
    train_type: TrainType = doc(
        "What to train: LoRA or DoRA adapters, all weights (full), or another peft tuner: "
        "vera, loha, lokr, oft, boft, ia3, which read the lora_* flags (see "
        "docs/training.md#tuners).",
        default="lora",
    )
    # The other tuners read --lora_rank too (vera/loha/lokr: rank; oft/boft: block size), as
    # --train_type's help and docs/training.md#tuners say; its own help stays LoRA's.
    lora_rank: int = doc("LoRA rank r.", default=8)
    lora_alpha: int = doc(
        "LoRA alpha (scale = alpha / r, or alpha / sqrt(r) with rsLoRA); also loha/lokr's.",
        default=32,
    )
    lora_dropout: float = doc(
        "Dropout on the LoRA input (vera: its dropout; loha/lokr: rank dropout; oft/boft: "
        "module dropout).",
        default=0.05,
    )
    target_modules: list[str] = doc(
        "Modules that get adapters: `all-linear` or module names such as q_proj v_proj.",
        default_factory=lambda: ["all-linear"],
    )
    use_rslora: bool = doc("Rank-stabilized LoRA scaling (alpha / sqrt(r)).", default=False)
    modules_to_save: list[str] = doc(
        "Modules trained in full next to the adapters (e.g. lm_head).", default_factory=list
    )
    lorap_lr_ratio: float | None = doc(
        "LoRA+: the learning rate of the B matrices is this ratio x --learning_rate (paper: "
        "16); unset: plain LoRA.",
        default=None,
    )
    init_weights: str = doc(
        "Adapter initialisation (peft's init_lora_weights): true, false, gaussian, pissa, "
        "pissa_niter_N, olora (LoRA/DoRA; others take true/false); loftq is refused.",
        default="true",
    )
    lisa_activated_layers: int = doc(
        "LISA (--train_type full): train this many randomly sampled decoder layers at a time, "
        "plus the embeddings and the head; 0: off.",
        default=0,
    )
    lisa_step_interval: int = doc(
        "LISA: sample new layers every this many optimizer steps.", default=20
    )
    freeze_vit: bool = doc(
        "Vision-language models: keep the vision encoder frozen (no adapters, no updates).",
        default=True,
    )
    freeze_aligner: bool = doc(
        "Vision-language models: keep the aligner (projector/merger between the vision encoder "
        "and the language model) frozen; otherwise it trains in full, also with LoRA.",
        default=True,
    )
    freeze_parameters: list[str] = doc(
        "--train_type full: parameter name prefixes to keep frozen (e.g. model.embed_tokens); "
        "each must match at least one parameter.",
        default_factory=list,
    )
    freeze_llm: bool = doc(
        "Vision-language models: keep the language model frozen (e.g. to train the aligner "
        "first, as LLaVA does).",
        default=False,
    )

    def __post_init__(self):
        check_fields(
            self,
            lora_rank=at_least(1),
            lora_alpha=above(0),
            lora_dropout=within(0, 1, open_high=True),
            init_weights=custom(
                valid_init_weights,
                "--{flag} {value} must be one of "
                + ", ".join(INIT_WEIGHTS)
                + " or pissa_niter_N (N >= 1)",
            ),
            lisa_activated_layers=at_least(0),
            lisa_step_interval=at_least(1),
            lorap_lr_ratio=above(0),
        )
