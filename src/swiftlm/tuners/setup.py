"""Make the right parameters trainable: full fine-tuning, or LoRA / DoRA / rsLoRA (any
--init_weights) or another peft tuner (VeRA, LoHa, LoKr, OFT, BOFT, IA3) via peft."""

from swiftlm.errors import ConfigError
from swiftlm.models.loader import CAUSAL_LM, SEQUENCE_CLASSIFICATION
from swiftlm.models.quant import logical_numel
from swiftlm.tuners.config import TunerArguments
from swiftlm.tuners.init_weights import peft_init_lora_weights
from swiftlm.tuners.peft_configs import build_tuner_config

# peft's task type per model kind. SEQ_CLS also trains the new `score` head in full (peft adds
# it to modules_to_save) and saves it with the adapter, so the adapter alone is the reward model.
PEFT_TASK_TYPES = {CAUSAL_LM: "CAUSAL_LM", SEQUENCE_CLASSIFICATION: "SEQ_CLS"}


def _targets(args: TunerArguments, parts: dict | None):
    """(target_modules, modules_to_save) as peft takes them."""
    targets = args.target_modules
    target_modules = "all-linear" if targets in (["all-linear"], ["all"]) else list(targets)
    modules_to_save = list(args.modules_to_save) or None
    if parts is not None:
        target_modules, modules_to_save = parts["lora"], parts["full"] + list(args.modules_to_save)
    return target_modules, modules_to_save or None


def build_lora_config(args: TunerArguments, kind: str = CAUSAL_LM, parts: dict | None = None):
    """The peft config of the run's adapter tuner (LoRA/DoRA, or the one --train_type names).
    `parts`: a vision-language model's trainable module names (vision_parts), which the
    adapters and fully trained modules are limited to."""
    from peft import LoraConfig

    target_modules, modules_to_save = _targets(args, parts)
    if args.train_type not in ("lora", "dora"):
        return build_tuner_config(args, PEFT_TASK_TYPES[kind], target_modules, modules_to_save)
    return LoraConfig(
        task_type=PEFT_TASK_TYPES[kind],
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=target_modules,
        use_dora=args.train_type == "dora",
        use_rslora=args.use_rslora,
        modules_to_save=modules_to_save,
        init_lora_weights=peft_init_lora_weights(args.init_weights),
    )


def apply_tuner(model, args: TunerArguments, kind: str = CAUSAL_LM, vision_type: str = ""):
    """Return the model to train, with exactly the tuner's parameters requiring grad (`kind`:
    what the model was loaded as, see models.loader; `vision_type`: the model type of a
    vision-language model, whose --freeze_vit/--freeze_aligner/--freeze_llm apply)."""
    parts = vision_parts(model, vision_type, args) if vision_type else None
    if args.train_type == "full":
        for name, param in model.named_parameters():
            param.requires_grad_(parts is None or name in parts["trained"])
        freeze_parameters(model, args.freeze_parameters)
        return model
    from peft import get_peft_model

    try:
        return get_peft_model(model, build_lora_config(args, kind, parts))
    except ValueError as exc:  # peft says which target modules it could not find
        targets = " ".join(args.target_modules)
        if args.train_type in ("oft", "boft") and "block" in str(exc).lower():
            raise ConfigError(
                f"--lora_rank {args.lora_rank}: --train_type {args.train_type} uses it as the "
                "size of its orthogonal blocks, which must divide the input width of every "
                f"targeted layer ({exc}); give a divisor of those widths (e.g. 8, 16 or 32)"
            ) from None
        if "lora_dropout" in str(exc):  # peft's LoRA on stacked MoE expert weights
            raise ConfigError(
                f"--lora_dropout {args.lora_dropout}: --target_modules {targets} reaches the "
                "stacked expert (or router) weights of this mixture-of-experts model, whose "
                "LoRA in peft takes no dropout; pass --lora_dropout 0, or name only attention "
                "modules (--target_modules q_proj k_proj v_proj o_proj)"
            ) from None
        raise ConfigError(f"--target_modules {targets}: {exc}") from None


def freeze_parameters(model, prefixes: list[str]) -> None:
    """--freeze_parameters: keep every parameter whose name starts with one of `prefixes`
    frozen (ms-swift's meaning). A prefix that names no parameter is an error: a typo would
    otherwise train what was meant to stay frozen. Tied weights share one parameter, so
    freezing the input embeddings freezes a tied output head too."""
    if not prefixes:
        return
    names = [name for name, _ in model.named_parameters()]
    unmatched = [p for p in prefixes if not any(_under(name, p) for name in names)]
    if unmatched:
        tops = sorted({name.rsplit(".", 2)[0] for name in names})[:6]
        raise ConfigError(
            f"--freeze_parameters {' '.join(unmatched)}: no parameter name starts with it; "
            f"names look like {', '.join(tops)}, ... (e.g. model.embed_tokens)"
        )
    for name, param in model.named_parameters():
        if any(_under(name, p) for p in prefixes):
            param.requires_grad_(False)
    if not any(param.requires_grad for param in model.parameters()):
        raise ConfigError(
            f"--freeze_parameters {' '.join(prefixes)} freezes every parameter: nothing would "
            "train; name fewer prefixes"
        )


def _under(name: str, prefix: str) -> bool:
    """`prefix` is the name itself or one of its leading dotted parts (`model.layers.1`
    does not freeze model.layers.10)."""
    prefix = prefix.rstrip(".")
    return name == prefix or name.startswith(prefix + ".")


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


FREEZE_FLAGS = {"vit": "--freeze_vit", "aligner": "--freeze_aligner", "llm": "--freeze_llm"}


def vision_parts(model, vision_type: str, args: TunerArguments) -> dict[str, list[str]]:
    """What trains in a vision-language model under the freeze flags.

    Returns {"trained": parameter names (full fine-tuning), "lora": Linear module names that
    get adapters (the vision encoder's and the language model's, when not frozen; the output
    head excluded as `all-linear` does, and limited to --target_modules names when given),
    "full": module names trained in full next to LoRA (the aligner, when not frozen)}."""
    import torch

    from swiftlm.models.vision import find_parts

    groups = find_parts(model, vision_type)
    frozen = {"vit": args.freeze_vit, "aligner": args.freeze_aligner, "llm": args.freeze_llm}
    if all(frozen.values()):
        raise ConfigError(
            "--freeze_vit, --freeze_aligner and --freeze_llm are all true: nothing would train; "
            "set one of them to false"
        )
    trained = {name for part, names in groups.items() if not frozen[part] for name in names}
    modules = dict(model.named_modules())
    owners = {name.rsplit(".", 1)[0] for name in trained}
    named = args.target_modules not in (["all-linear"], ["all"])
    aligner = {name.rsplit(".", 1)[0] for name in groups["aligner"]}
    lora = sorted(
        name
        for name in owners
        if isinstance(modules.get(name), torch.nn.Linear)
        and name not in aligner
        and not name.endswith("lm_head")
        and (not named or name.rsplit(".", 1)[-1] in args.target_modules)
    )
    if args.train_type != "full" and not lora and frozen["aligner"]:
        unfrozen = " ".join(FREEZE_FLAGS[p] for p, f in frozen.items() if not f)
        raise ConfigError(
            f"--target_modules {' '.join(args.target_modules)} names no Linear layer of the "
            f"unfrozen parts ({unfrozen} false); use all-linear or names of those parts' layers"
        )
    full = sorted(_common_roots(aligner)) if not frozen["aligner"] else []
    return {"trained": sorted(trained), "lora": lora, "full": full}


def _common_roots(modules: set[str]) -> set[str]:
    """The outermost modules of a set of module names (the aligner itself, not its layers)."""
    return {m for m in modules if not any(m.startswith(o + ".") for o in modules if o != m)}
