"""The peft config of each adapter --train_type besides LoRA/DoRA (built in setup.py): VeRA,
LoHa, LoKr, OFT, BOFT and IA3, from the shared tuner flags.

The LoRA flags carry over where a tuner has the same knob: --lora_rank is VeRA's, LoHa's and
LoKr's rank and OFT's/BOFT's block size (the side of each orthogonal block, which must divide
every targeted layer's input width); --lora_alpha is LoHa's/LoKr's alpha; --lora_dropout is
each tuner's own dropout (VeRA's input dropout, LoHa/LoKr's rank dropout, OFT/BOFT's module
dropout). IA3 has none of them: it learns one scaling vector per targeted layer.
"""

from swiftlm.tuners.config import TunerArguments

# IA3 scales the input (not the output) of an MLP's output projection, as its paper does;
# peft calls these its feedforward modules.
IA3_FEEDFORWARD = ("down_proj", "fc2", "w2", "c_proj")


def _init_flag(args: TunerArguments) -> bool:
    """--init_weights for the tuners that only take true/false (a rule refuses the rest)."""
    return args.init_weights != "false"


def _vera(args, common):
    from peft import VeraConfig

    return VeraConfig(
        r=args.lora_rank, vera_dropout=args.lora_dropout, init_weights=_init_flag(args), **common
    )


def _loha(args, common):
    from peft import LoHaConfig

    return LoHaConfig(
        r=args.lora_rank, alpha=args.lora_alpha, rank_dropout=args.lora_dropout,
        init_weights=_init_flag(args), **common,
    )  # fmt: skip


def _lokr(args, common):
    from peft import LoKrConfig

    return LoKrConfig(
        r=args.lora_rank, alpha=args.lora_alpha, rank_dropout=args.lora_dropout,
        init_weights=_init_flag(args), **common,
    )  # fmt: skip


def _oft(args, common):
    from peft import OFTConfig

    # r=0: the block size is given and peft derives the number of blocks per layer.
    return OFTConfig(
        r=0, oft_block_size=args.lora_rank, module_dropout=args.lora_dropout,
        init_weights=_init_flag(args), **common,
    )  # fmt: skip


def _boft(args, common):
    from peft import BOFTConfig

    return BOFTConfig(
        boft_block_size=args.lora_rank, boft_dropout=args.lora_dropout,
        init_weights=_init_flag(args), **common,
    )  # fmt: skip


def _ia3(args, common):
    from peft import IA3Config

    targets = common.pop("target_modules")
    if targets == "all-linear":  # peft's per-architecture IA3 targets (keys, values, MLP out)
        targets, feedforward = None, None
    else:
        feedforward = [t for t in targets if t.rsplit(".", 1)[-1] in IA3_FEEDFORWARD]
    return IA3Config(
        target_modules=targets, feedforward_modules=feedforward,
        init_ia3_weights=_init_flag(args), **common,
    )  # fmt: skip


BUILDERS = {"vera": _vera, "loha": _loha, "lokr": _lokr, "oft": _oft, "boft": _boft, "ia3": _ia3}


def build_tuner_config(args: TunerArguments, task_type: str, target_modules, modules_to_save):
    """The peft config of --train_type vera/loha/lokr/oft/boft/ia3."""
    common = dict(
        task_type=task_type, target_modules=target_modules, modules_to_save=modules_to_save
    )
    return BUILDERS[args.train_type](args, common)
