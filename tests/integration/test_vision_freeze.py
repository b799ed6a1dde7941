"""--freeze_vit / --freeze_aligner / --freeze_llm on tiny vision-language models: which weights
a full fine-tuning changes, where LoRA puts its adapters and what it saves in full, the flag
combination and methods that are refused, and that final/ reloads with transformers and peft.
(Packed batches of vision-language models: test_vision_packing.py.)

LLaVA keeps its aligner (multi_modal_projector) beside the vision tower; Qwen2-VL keeps it
(model.visual.merger) inside the vision tower, so freezing one and not the other splits that
module. Qwen2-VL's processor needs `patched_qwen2_vl_loading` here (no torchvision).
"""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import tiny_sft, write_jsonl
from swiftlm.cli.main import main
from vlm_helpers import build_llava, build_qwen2_vl, colour_rows, patched_qwen2_vl_loading

FULL, ADAPTER = "model.safetensors", "adapter_model.safetensors"
STEPS = dict(max_steps=3, per_device_train_batch_size=2, save_steps=100)
# Tensor names by part, as saved (transformers 5 writes these checkpoints' names without the
# "model." that the loaded modules and peft's adapter keys have).
LLAVA_PARTS = {"vit": ("vision_tower.",), "aligner": ("multi_modal_projector.",)}
QWEN2_VL_PARTS = {"vit": ("visual.",), "aligner": ("visual.merger.",)}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pictures")
    return write_jsonl(folder / "rows.jsonl", colour_rows(folder, 6))


def part_of(name: str, parts: dict) -> str:
    """'aligner', 'vit' or 'llm' for a saved tensor name (peft's prefix taken off)."""
    name = name.removeprefix("base_model.model.")
    for part in ("aligner", "vit"):  # the aligner first: Qwen2-VL's lies inside the vit
        if any(name.startswith(p) or name.startswith("model." + p) for p in parts[part]):
            return part
    return "llm"


def changed_parts(final, base, parts: dict) -> dict[str, tuple[int, int]]:
    """{part: (tensors changed, tensors)} between a trained and the base weights file."""
    trained, initial = load_file(final / FULL), load_file(base / FULL)
    assert trained.keys() == initial.keys()
    counts: dict[str, list[int]] = {}
    for name, value in trained.items():
        count = counts.setdefault(part_of(name, parts), [0, 0])
        count[0] += int(not torch.equal(value, initial[name]))
        count[1] += 1
    return {part: tuple(count) for part, count in counts.items()}


def adapter_keys(final) -> list[str]:
    with safe_open(final / ADAPTER, "pt") as f:
        return list(f.keys())


def test_llava_freeze_llm_trains_only_the_vision_encoder_and_aligner(llava, pictures, tmp_path):
    out = tmp_path / "run"
    flags = dict(train_type="full", freeze_llm="true", freeze_vit="false", freeze_aligner="false")
    assert main(tiny_sft(llava, pictures, out, learning_rate="1e-3", **flags, **STEPS)) == 0
    changed = changed_parts(out / "final", llava, LLAVA_PARTS)
    assert changed["llm"][0] == 0, changed
    # Every aligner tensor moves, and every vision tensor but the post-layernorm's weight and
    # bias, which get no gradient (LLaVA reads the last layer's features before it).
    assert changed["aligner"][0] == changed["aligner"][1] > 0, changed
    assert changed["vit"][0] == changed["vit"][1] - 2 > 0, changed

    # final/ is a transformers VLM folder with its processor: it loads and answers an image.
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(out / "final")
    model = AutoModelForImageTextToText.from_pretrained(out / "final", dtype=torch.float32)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    image = Image.open(pictures.parent / "picture0.png").convert("RGB")
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3


def test_llava_default_lora_adapts_only_the_language_model(llava, pictures, tmp_path):
    out = tmp_path / "run"
    assert main(tiny_sft(llava, pictures, out, learning_rate="1e-2", **STEPS)) == 0
    keys = adapter_keys(out / "final")
    assert keys and all("lora_" in k for k in keys)
    assert {part_of(k, LLAVA_PARTS) for k in keys} == {"llm"}
    assert not any("lm_head" in k for k in keys)  # all-linear leaves the output head out

    # The adapter loads with peft onto the base model, with the saved values.
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out / "final")
    saved, state = load_file(out / "final" / ADAPTER), model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key.replace(".weight", ".default.weight")], value), key


def test_llava_lora_with_an_unfrozen_aligner_saves_it_in_full(llava, pictures, tmp_path):
    out = tmp_path / "run"
    flags = dict(freeze_aligner="false", learning_rate="1e-2", **STEPS)
    assert main(tiny_sft(llava, pictures, out, **flags)) == 0
    saved = load_file(out / "final" / ADAPTER)
    by_part: dict[str, set[str]] = {}
    for key in saved:
        by_part.setdefault(part_of(key, LLAVA_PARTS), set()).add(key)
    assert set(by_part) == {"llm", "aligner"}
    assert all("lora_" in k for k in by_part["llm"])
    assert not any("lora_" in k for k in by_part["aligner"])  # the aligner's own weights
    base = load_file(llava / FULL)
    assert {k.split("multi_modal_projector.")[1] for k in by_part["aligner"]} == {
        k.split("multi_modal_projector.")[1] for k in base if "multi_modal_projector." in k
    }

    # peft restores the trained aligner over the base one.
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, out / "final").merge_and_unload()
    state = model.state_dict()
    for key in by_part["aligner"]:
        name = key.removeprefix("base_model.model.")
        name = name if name in state else "model." + name
        assert torch.equal(state[name], saved[key]), key
        assert not torch.equal(saved[key], base[name.removeprefix("model.")]), key


def test_qwen2_vl_aligner_inside_the_vision_tower_is_split_from_it(qwen2_vl, pictures, tmp_path):
    """Full fine-tuning of the vision encoder with the merger frozen changes the encoder only;
    LoRA with the merger unfrozen saves the merger in full and adapts no vision layer."""
    vit_only, lora = tmp_path / "vit-only", tmp_path / "lora"
    flags = dict(train_type="full", freeze_llm="true", freeze_vit="false", freeze_aligner="true")
    with patched_qwen2_vl_loading():
        argv = tiny_sft(qwen2_vl, pictures, vit_only, learning_rate="1e-3", **flags, **STEPS)
        assert main(argv) == 0
        assert main(tiny_sft(qwen2_vl, pictures, lora, freeze_aligner="false", **STEPS)) == 0
    changed = changed_parts(vit_only / "final", qwen2_vl, QWEN2_VL_PARTS)
    assert changed["llm"][0] == 0 and changed["aligner"][0] == 0, changed
    assert changed["vit"][0] == changed["vit"][1] > 0, changed

    keys = adapter_keys(lora / "final")
    merger = [k for k in keys if part_of(k, QWEN2_VL_PARTS) == "aligner"]
    assert merger and not any("lora_" in k for k in merger)
    assert not [k for k in keys if part_of(k, QWEN2_VL_PARTS) == "vit"]
    assert all("lora_" in k for k in keys if part_of(k, QWEN2_VL_PARTS) == "llm")


@pytest.mark.bad_input(
    input="A vision-language model with `--freeze_vit true --freeze_aligner true "
    "--freeze_llm true`",
    outcome="Error before the model trains: nothing would train, naming the three flags",
)
def test_all_three_parts_frozen_is_refused(llava, pictures, tmp_path, capsys):
    flags = dict(freeze_vit="true", freeze_aligner="true", freeze_llm="true", **STEPS)
    for train_type in ("full", "lora"):
        argv = tiny_sft(llava, pictures, tmp_path / train_type, train_type=train_type, **flags)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--freeze_vit, --freeze_aligner and --freeze_llm are all true" in err
        assert "nothing would train" in err
        assert not (tmp_path / train_type / "final").exists()


@pytest.mark.bad_input(
    input="A vision-language model with a method that does not train on images (`swiftlm "
    "rlhf --rlhf_type kto`, `swiftlm pt` ...)",
    outcome="Error naming the method and the model type, and the commands that take images",
)
def test_a_method_without_image_support_refuses_a_vision_language_model(llava, tmp_path, capsys):
    rows = [
        {"prompt": f"Question {i}?", "completion": f"Answer {i}.", "label": i % 2 == 0}
        for i in range(8)
    ]
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    argv = ["rlhf", "--rlhf_type", "kto", "--model", str(llava), "--dataset", str(data)]
    argv += ["--output_dir", str(tmp_path / "kto"), "--report_to", "none", "--max_steps", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "kto does not train vision-language models (llava)" in err
    assert "swiftlm sft or swiftlm rlhf --rlhf_type dpo" in err

    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "Plain text to continue."}] * 8)
    argv = ["pt", "--model", str(llava), "--dataset", str(text), "--report_to", "none"]
    assert main([*argv, "--output_dir", str(tmp_path / "pt"), "--max_steps", "1"]) == 2
    assert "pt does not train vision-language models (llava)" in capsys.readouterr().err
