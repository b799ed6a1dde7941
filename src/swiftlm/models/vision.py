"""Vision-language models: how swiftlm tells one from a text LM, loads its processor, and
finds its three parts (vision encoder, aligner, language model) for the freeze flags.

A vision-language model is any model type transformers loads with
`AutoModelForImageTextToText` (Qwen2-VL, LLaVA, Idefics3/SmolVLM, InternVL, Gemma 3 ...).
Its images are turned into tokens by the model's own `AutoProcessor`; swiftlm never expands
image tokens itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from swiftlm.errors import ModelLoadError

# Submodule paths (relative to the loaded model) of each part, per model type, as transformers
# 5 lays them out. A model type not listed falls back to GENERIC_PARTS by name.
PARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen2_vl": {"vit": ("model.visual",), "aligner": ("model.visual.merger",)},
    "qwen2_5_vl": {"vit": ("model.visual",), "aligner": ("model.visual.merger",)},
    "llava": {"vit": ("model.vision_tower",), "aligner": ("model.multi_modal_projector",)},
    "idefics3": {"vit": ("model.vision_model",), "aligner": ("model.connector",)},
    "smolvlm": {"vit": ("model.vision_model",), "aligner": ("model.connector",)},
}
GENERIC_PARTS = {
    "vit": ("model.vision_tower", "model.vision_model", "model.visual"),
    "aligner": ("model.multi_modal_projector", "model.connector", "model.visual.merger"),
}

# Processor outputs with a leading batch dimension whose second dimension counts a sample's
# images (Idefics3/SmolVLM pad every sample to the same number of image crops); every other
# image feature is concatenated along its first dimension (images or patches).
PER_SAMPLE_IMAGE_AXIS = {"idefics3": ("pixel_values", "pixel_attention_mask")}
PER_SAMPLE_IMAGE_AXIS["smolvlm"] = PER_SAMPLE_IMAGE_AXIS["idefics3"]


def read_model_type(path: str) -> str | None:
    """config.json's model_type of a local folder (None for hub ids and unreadable files)."""
    config = Path(path) / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def is_vision_language(model_type: str | None) -> bool:
    """Whether transformers loads this model type with AutoModelForImageTextToText."""
    if not model_type:
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def vision_language_type(path: str) -> str | None:
    """The model type of a vision-language model at `path`, None for a text LM.

    A hub id is asked from its config (cached or downloaded), a folder from config.json."""
    model_type = read_model_type(path)
    if model_type is None and not Path(path).exists():
        from transformers import AutoConfig

        try:
            model_type = AutoConfig.from_pretrained(path).model_type
        except Exception:  # noqa: BLE001 - loading the model reports an unreachable hub
            return None
    return model_type if is_vision_language(model_type) else None


def load_processor(path: str):
    """The model's own AutoProcessor (tokenizer, image processor, chat template)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
    except ImportError as exc:
        raise ModelLoadError(
            f"could not load the processor of {path}: {exc}. transformers builds this model's "
            "processor from packages that are not installed: install them (for Qwen2-VL and "
            "InternVL that is torchvision, matching your torch)"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"could not load the processor of {path}: {exc}") from exc
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or not hasattr(processor, "image_processor"):
        raise ModelLoadError(
            f"{path}: its processor ({type(processor).__name__}) has no tokenizer and image "
            "processor; swiftlm trains vision-language models whose processor takes images"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The processor's template renders image parts; text paths (infer, eval) use the tokenizer's.
    if getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template
    return processor


# Tokens that open or close an image without a processor attribute naming them: Qwen2-VL and
# Qwen2.5-VL wrap each image's pads in these (and find the image by its start token).
IMAGE_WRAPPER_TOKENS = ("<|vision_start|>", "<|vision_end|>")


def image_token_ids(processor) -> set[int]:
    """The ids of the tokens that stand for image content or delimit it (never trained, and
    never removed by truncation while the image stays)."""
    tokenizer = processor.tokenizer
    names = ("image_token_id", "fake_image_token_id", "global_image_token_id")
    ids = {getattr(processor, name, None) for name in names}
    for name in ("image_token", "boi_token", "eoi_token", "fake_image_token", "global_image_token"):
        token = getattr(processor, name, None) or getattr(tokenizer, name, None)
        if isinstance(token, str):
            ids.add(tokenizer.convert_tokens_to_ids(token))
    added = tokenizer.get_added_vocab()
    ids |= {added[token] for token in IMAGE_WRAPPER_TOKENS if token in added}
    return {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}


def part_prefixes(model_type: str) -> dict[str, tuple[str, ...]]:
    """Module paths of the vision encoder ("vit") and the aligner, for the freeze flags."""
    return PARTS.get(model_type, GENERIC_PARTS)


def find_parts(model, model_type: str) -> dict[str, list[str]]:
    """{"vit": [...], "aligner": [...], "llm": [...]}: the model's parameter names by part.

    The aligner is taken out of the vision encoder when it lives inside it (Qwen2-VL's merger);
    everything that is neither is the language model (with its head)."""
    names = [name for name, _ in model.named_parameters()]
    prefixes = part_prefixes(model_type)

    def under(name: str, paths: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in paths)

    aligner = [n for n in names if under(_strip_wrappers(n), prefixes["aligner"])]
    vit = [n for n in names if under(_strip_wrappers(n), prefixes["vit"]) and n not in aligner]
    if not vit:
        raise ModelLoadError(
            f"cannot find the vision encoder of this {model_type} model (looked for "
            f"{', '.join(prefixes['vit'])}); swiftlm knows the layouts of "
            f"{', '.join(sorted(PARTS))}"
        )
    taken = set(vit) | set(aligner)
    return {"vit": vit, "aligner": aligner, "llm": [n for n in names if n not in taken]}


def _strip_wrappers(name: str) -> str:
    """A parameter name without peft's prefixes, as transformers names it."""
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.replace(".base_layer.", ".")
