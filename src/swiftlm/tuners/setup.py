"""Make the right parameters trainable: full fine-tuning, or LoRA / DoRA / rsLoRA via peft."""

from swiftlm.config.sections import TunerArguments
from swiftlm.errors import ConfigError
from swiftlm.models.quant import logical_numel


def build_lora_config(args: TunerArguments):
    from peft import LoraConfig

    targets = args.target_modules
    target_modules = "all-linear" if targets in (["all-linear"], ["all"]) else list(targets)
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=target_modules,
        use_dora=args.train_type == "dora",
        use_rslora=args.use_rslora,
        modules_to_save=list(args.modules_to_save) or None,
    )


def apply_tuner(model, args: TunerArguments):
    """Return the model to train, with exactly the tuner's parameters requiring grad."""
    if args.train_type == "full":
        for param in model.parameters():
            param.requires_grad_(True)
        return model
    from peft import get_peft_model

    try:
        return get_peft_model(model, build_lora_config(args))
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
