"""--model folders that are not text-only causal LMs are refused from config.json alone."""

import json

import pytest

from swiftlm.errors import ModelLoadError
from swiftlm.models.loader import check_text_model, resolve_model

PLANNED = (
    "swiftlm loads text-only causal language models for now; multimodal support is planned. "
    "Use a text-only model, e.g. Qwen2.5-0.5B-Instruct"
)


def config_folder(tmp_path, config_class: str, **fields):
    """A model folder holding only the config.json of `config_class` (no weights)."""
    import transformers

    folder = tmp_path / config_class
    getattr(transformers, config_class)(**fields).save_pretrained(folder)
    return folder


@pytest.mark.bad_input(
    input="--model pointing at a vision-language model folder (Llava, Qwen2-VL)",
    outcome="Refused before loading, naming the folder and model type: multimodal support "
    "is planned",
)
@pytest.mark.parametrize(
    "config_class, model_type, architecture",
    [
        ("LlavaConfig", "llava", "LlavaForConditionalGeneration"),
        ("Qwen2VLConfig", "qwen2_vl", "Qwen2VLForConditionalGeneration"),
    ],
)
def test_vision_language_folder_is_refused_by_name(
    tmp_path, config_class, model_type, architecture
):
    folder = config_folder(tmp_path, config_class, architectures=[architecture])
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(folder))
    assert str(info.value) == (
        f"--model {folder}: model type {model_type!r} ({architecture}) is a multimodal model "
        f"(it reads images, video or audio); {PLANNED}"
    )


def test_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    folder = config_folder(tmp_path, "T5Config")
    with pytest.raises(ModelLoadError) as info:
        check_text_model(folder, "--model t5")
    assert str(info.value) == (
        "--model t5: model type 't5' is not a causal language model (transformers has no "
        "AutoModelForCausalLM class for it); swiftlm trains and serves decoder-only LMs such "
        "as Llama, Qwen2 or SmolLM2"
    )


def test_causal_lms_custom_code_and_unknown_types_pass(tmp_path, tiny_model_dir):
    check_text_model(tiny_model_dir, "--model tiny")
    # Gemma 3 takes images, yet AutoModelForCausalLM loads it: text-only training works.
    check_text_model(config_folder(tmp_path, "Gemma3Config"), "--model gemma3")
    for name, config in {
        "custom": {"model_type": "my_lm", "auto_map": {"AutoModelForCausalLM": "m.MyLM"}},
        "unknown": {"model_type": "not_in_transformers"},
        "broken": None,
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text("{" if config is None else json.dumps(config))
        check_text_model(folder, f"--model {name}")  # loading reports these in its own words
