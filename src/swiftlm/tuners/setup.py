"""Make the right parameters trainable: full fine-tuning, or LoRA / DoRA / rsLoRA via peft."""

from swiftlm.config.sections import TunerArguments
from swiftlm.errors import ConfigError
from swiftlm.models.loader import CAUSAL_LM, SEQUENCE_CLASSIFICATION
from swiftlm.models.quant import logical_numel

# peft's task type per model kind. SEQ_CLS also trains the new `score` head in full (peft adds
# it to modules_to_save) and saves it with the adapter, so the adapter alone is the reward model.
PEFT_TASK_TYPES = {CAUSAL_LM: "CAUSAL_LM", SEQUENCE_CLASSIFICATION: "SEQ_CLS"}


def build_lora_config(args: TunerArguments, kind: str = CAUSAL_LM):
    from peft import LoraConfig

    targets = args.target_modules
    target_modules = "all-linear" if targets in (["all-linear"], ["all"]) else list(targets)
    return LoraConfig(
        task_type=PEFT_TASK_TYPES[kind],
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=target_modules,
        use_dora=args.train_type == "dora",
        use_rslora=args.use_rslora,
        modules_to_save=list(args.modules_to_save) or None,
    )


def apply_tuner(model, args: TunerArguments, kind: str = CAUSAL_LM):
    """Return the model to train, with exactly the tuner's parameters requiring grad (`kind`:
    what the model was loaded as, see models.loader)."""
    if args.train_type == "full":
        for param in model.parameters():
            param.requires_grad_(True)
        return model
    from peft import get_peft_model

    try:
        return get_peft_model(model, build_lora_config(args, kind))
    except ValueError as exc:  # peft says which target modules it could not find
        raise ConfigError(f"--target_modules {' '.join(args.target_modules)}: {exc}") from None


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights counted once, 4-bit packed weights
    as the weights they stand for."""
    seen, trainable, total = set(), 0, 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        numel = logical_numel(param)
        total += numel
        trainable += numel if param.requires_grad else 0
    return trainable, total
