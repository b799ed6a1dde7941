"""A model's shape for the planner, from its config alone.

The config comes from a model folder's config.json, a hub id (AutoConfig), or a GGUF file's
metadata (the packaged default, SmolLM2-135M-Instruct); no weights are read. Parameters are
counted exactly by building the model on the meta device (sizes, no storage), with the LoRA
adapters peft would add for --train_type lora.
"""

from dataclasses import dataclass, replace
from pathlib import Path

from swiftlm.errors import ConfigError, ModelLoadError
from swiftlm.models.moe import expert_modules, expert_parameters, experts_per_token
from swiftlm.tuners.config import TunerArguments


@dataclass(frozen=True)
class ModelShape:
    """What memory and time depend on: sizes of the decoder and counts of parameters."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    total_params: int  # every parameter of the model to train (adapters included)
    trainable_params: int  # what the optimizer updates: all (full) or the adapters (LoRA)
    embedding_params: int  # input embeddings (shared with the head when tied)
    head_params: int  # the LM head when it is its own weight, else 0
    layer_params: int  # one decoder block's base weights
    layer_trainable_params: int  # what trains in one decoder block
    checkpoint_bytes: float = 0.0  # the weight files a process reads when it loads the model
    # Mixture of experts: the stacked expert weights a token does not compute with (all but
    # top_k of each layer's experts). Memory holds them; a token's FLOPs do not count them.
    idle_expert_params: int = 0
    # Expert parallel splits these: each MoE layer's experts, the stacked expert weights of
    # all layers (trained or frozen), and the layers that route tokens to experts.
    num_experts: int = 0
    experts_per_token: int = 0  # top_k
    expert_params: int = 0
    moe_layers: int = 0
    adapted_experts: bool = False  # LoRA on the stacked experts (expert parallel refuses it)

    @property
    def frozen_params(self) -> int:
        return self.total_params - self.trainable_params

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_model_config(model: str | None):
    """(transformers config, display name) for `--model`, reading only metadata."""
    from transformers import AutoConfig

    from swiftlm.models.vision import is_vision_language

    if model is None or str(model).endswith(".gguf"):
        from swiftlm.models.loader import default_model_file

        gguf = default_model_file() if model is None else Path(model).expanduser()
        if not gguf.is_file():
            raise ModelLoadError(f"--model {model}: GGUF file not found")
        name = "SmolLM2-135M-Instruct" if model is None else gguf.stem
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), name
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {model}: folder has no config.json")
    if not path.exists() and str(model).startswith((".", "/", "~")):  # as models/loader.py
        raise ModelLoadError(f"--model {model}: not a model folder or .gguf file")
    try:
        config = AutoConfig.from_pretrained(str(path) if path.is_dir() else model)
    except OSError as exc:
        raise ModelLoadError(f"--model {model}: could not read its config ({exc})") from None
    if is_vision_language(config.model_type):
        raise ConfigError(
            f"--model {model}: a vision-language model ({config.model_type}); the planner "
            "models text language models only (the vision tower's memory and time are not "
            "counted). Choose the strategy with --strategy, --deepspeed or --fsdp."
        )
    return config, path.name


def checkpoint_bytes(model: str | None, config, params: int) -> float:
    """Bytes of the weight files loading reads: a folder's safetensors/bin files; a GGUF is
    converted to a float32 folder (the default model's cached conversion); a hub id is
    assumed stored in its config's dtype."""
    path = Path(model).expanduser() if model else None
    if path is not None and path.is_dir():
        files = [*path.glob("*.safetensors"), *path.glob("*.bin")]
        if files:
            return float(sum(f.stat().st_size for f in files))
    if model is None or str(model).endswith(".gguf"):
        return 4.0 * params
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "float32"))
    return (2.0 if "16" in dtype else 4.0) * params


def _meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # transformers: no causal-LM class for this config
        raise ModelLoadError(
            f"the planner cannot build a {config.model_type} model as a causal LM ({exc})"[:300]
        ) from None


def count_parameters(config, tuner: TunerArguments) -> tuple[int, int]:
    """(all, trainable) parameters of the model swiftlm would train, built on the meta
    device: exact, including what peft adds for LoRA/DoRA."""
    return _counts(_model_to_train(config, tuner))


def _model_to_train(config, tuner: TunerArguments):
    model = _meta_model(config)
    if tuner.train_type != "full":
        from peft import get_peft_model

        from swiftlm.tuners.setup import build_lora_config

        # Dropout adds no parameter (and peft refuses it on stacked MoE experts, which the
        # run itself reports): count with none.
        counted = replace(tuner, lora_dropout=0.0)
        model = get_peft_model(model, build_lora_config(counted))
    return model


def _counts(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def _adapts_experts(model) -> bool:
    """peft's LoRA reaches the stacked expert weights (its target parameters): adapters that
    span every expert, which expert parallel cannot split (distributed/expert_parallel.py)."""
    configs = getattr(model, "peft_config", {}) or {}
    return any(getattr(config, "target_parameters", None) for config in configs.values())


def model_shape(
    config, tuner: TunerArguments, name: str = "", stored_bytes: float = 0.0
) -> ModelShape:
    """The planner's view of `config` trained with `tuner` (`stored_bytes`: its weight
    files, see `checkpoint_bytes`)."""
    text = getattr(config, "text_config", None) or config
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [key for key in needed if getattr(text, key, None) is None]
    if missing:
        raise ConfigError(
            f"--model {name}: its config has no {', '.join(missing)}; `swiftlm plan` plans "
            "decoder-only language models (Llama, Qwen2, Mistral, SmolLM2 ...)"
        )
    hidden, layers = text.hidden_size, text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    tied = bool(getattr(config, "tie_word_embeddings", False))
    model = _model_to_train(config, tuner)
    total, trainable = _counts(model)
    base, stacked, idle_experts, moe_layers = _base_parameters(config)
    experts, top_k = experts_per_token(config)
    if experts:  # a token runs top_k experts: their width is its MLP's
        width = getattr(text, "moe_intermediate_size", None) or intermediate
        intermediate = width * top_k + (getattr(text, "shared_expert_intermediate_size", 0) or 0)
    embedding = text.vocab_size * hidden
    head = 0 if tied else embedding
    layer = (base - embedding - head - hidden) // layers  # the final norm: `hidden`
    adapters = total - base
    return ModelShape(
        name=name,
        model_type=getattr(config, "model_type", "?"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=text.vocab_size,
        tied_embeddings=tied,
        total_params=total,
        trainable_params=trainable,
        embedding_params=embedding,
        head_params=head,
        layer_params=layer,
        layer_trainable_params=layer if tuner.train_type == "full" else adapters // layers,
        checkpoint_bytes=stored_bytes,
        idle_expert_params=idle_experts,
        num_experts=experts,
        experts_per_token=top_k,
        expert_params=stacked,
        moe_layers=moe_layers,
        adapted_experts=_adapts_experts(model),
    )


def _base_parameters(config) -> tuple[int, int, int, int]:
    """(the base model's parameters, its stacked expert weights, the share of them a token
    leaves idle, the MoE layers), from one meta-device model."""
    model = _meta_model(config)
    stacked, active, _ = expert_parameters(model)
    total = sum(p.numel() for p in model.parameters())
    return total, stacked, stacked - active, len(expert_modules(model)) if stacked else 0
