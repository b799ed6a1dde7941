"""Packed and padding-free batches of a vision-language model: LLaVA trains exactly as with
padded batches; architectures whose image positions are not 1-D restarting positions are
refused by name."""

import json

import pytest

from conftest import max_weight_difference, write_jsonl
from swiftlm.cli.main import main
from vlm_helpers import build_idefics3, build_llava, colour_rows


def sft(model_dir, data, out, *extra) -> int:
    flags = ["--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    flags += ["--max_steps", "3", "--torch_dtype", "float32", "--per_device_train_batch_size", "4"]
    flags += ["--train_type", "full", "--freeze_vit", "false", "--freeze_aligner", "false"]
    return main(["sft", *flags, "--learning_rate", "1e-3", *extra])


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_padding_free_llava_trains_like_padded(tmp_path):
    model_dir = build_llava(tmp_path / "llava")
    data = write_jsonl(tmp_path / "rows.jsonl", colour_rows(tmp_path))
    padded, packed = tmp_path / "padded", tmp_path / "packed"
    assert sft(model_dir, data, padded, "--padding_free", "false") == 0
    assert sft(model_dir, data, packed, "--padding_free", "true") == 0
    assert losses(packed) == pytest.approx(losses(padded), abs=1e-5)
    weights = "final/model.safetensors"
    assert max_weight_difference(padded / weights, packed / weights) < 1e-5


@pytest.mark.bad_input(
    input="--padding_free or --packing with a vision-language model whose image positions "
    "are not plain 1-D positions (Idefics3, Qwen2-VL)",
    outcome="Refused before the data is read, naming the flag, the model type and that "
    "padded batches are the fallback",
)
def test_packing_is_refused_where_image_positions_are_not_plain(tmp_path, capsys):
    model_dir = build_idefics3(tmp_path / "idefics3")
    data = write_jsonl(tmp_path / "rows.jsonl", colour_rows(tmp_path))
    assert sft(model_dir, data, tmp_path / "run", "--padding_free", "true") == 2
    err = capsys.readouterr().err
    assert (
        "--padding_free: packed batches of idefics3 models need per-sample image positions"
    ) in err
    assert "drop the flag (batches are padded per sample)" in err
