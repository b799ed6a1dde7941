"""The config section of what a training run trains: full fine-tuning or LoRA (rank, alpha,
target modules, DoRA, rsLoRA) and which parameters are frozen. Same conventions as
`config/sections.py`: field names are the flag names, each field's `help` is its `--help`
text, the section checks its own fields when built.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, within
from swiftlm.config.sections import doc


@dataclass
class TunerArguments:
    train_type: Literal["lora", "dora", "full"] = doc(
        "What to train: LoRA adapters, DoRA adapters, or all weights.", default="lora"
    )
    lora_rank: int = doc("LoRA rank r.", default=8)
    lora_alpha: int = doc(
        "LoRA alpha (scale = alpha / r, or alpha / sqrt(r) with rsLoRA).", default=32
    )
    lora_dropout: float = doc("Dropout on the LoRA input.", default=0.05)
    target_modules: list[str] = doc(
        "Modules that get adapters: `all-linear` or module names such as q_proj v_proj.",
        default_factory=lambda: ["all-linear"],
    )
    use_rslora: bool = doc("Rank-stabilized LoRA scaling (alpha / sqrt(r)).", default=False)
    modules_to_save: list[str] = doc(
        "Modules trained in full next to the adapters (e.g. lm_head).", default_factory=list
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
        )
