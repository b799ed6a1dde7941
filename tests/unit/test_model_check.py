"""--model folders that are not text-only causal LMs are refused from config.json alone."""

import json

import pytest

from swiftlm.errors import ModelLoadError
from swiftlm.models.loader import check_text_model, resolve_model

UNSUPPORTED = (
    "swiftlm loads causal language models and image-text-to-text models (Qwen2-VL, LLaVA, "
    "SmolVLM/Idefics3 ...); audio and video-only models are not supported. Use one of those"
)


def config_folder(tmp_path, config_class: str, **fields):
    """A model folder holding only the config.json of `config_class` (no weights)."""
    import transformers

    folder = tmp_path / config_class
    getattr(transformers, config_class)(**fields).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "config_class, architecture",
    [
        ("LlavaConfig", "LlavaForConditionalGeneration"),
        ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
        ("Idefics3Config", "Idefics3ForConditionalGeneration"),
    ],
)
def test_vision_language_folders_pass(tmp_path, config_class, architecture):
    """Image-text-to-text models load with AutoModelForImageTextToText (models.vision)."""
    folder = config_folder(tmp_path, config_class, architectures=[architecture])
    assert resolve_model(str(folder)).path == str(folder.resolve())


@pytest.mark.bad_input(
    input="--model pointing at an audio or video-only multimodal model folder (Qwen2-Audio)",
    outcome="Refused before loading, naming the folder and model type and what swiftlm loads",
)
def test_audio_model_folder_is_refused_by_name(tmp_path):
    architecture = "Qwen2AudioForConditionalGeneration"
    folder = config_folder(tmp_path, "Qwen2AudioConfig", architectures=[architecture])
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(folder))
    assert str(info.value) == (
        f"--model {folder}: model type 'qwen2_audio' ({architecture}) is a multimodal model "
        f"that transformers does not load as image-text-to-text; {UNSUPPORTED}"
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
