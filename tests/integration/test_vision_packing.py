"""Packed and padding-free batches of a vision-language model: LLaVA trains exactly as with
padded batches; architectures whose image positions are not 1-D restarting positions are
refused by name."""

import json

import pytest

from conftest import write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, assert_trained_weights_close, forward_terms
from vlm_helpers import ARCHITECTURES, BUILDERS, colour_rows, patched_qwen2_vl_loading


def sft(model_dir, data, out, *extra) -> int:
    flags = ["--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    flags += ["--max_steps", "3", "--torch_dtype", "float32", "--per_device_train_batch_size", "4"]
    flags += ["--train_type", "full", "--freeze_vit", "false", "--freeze_aligner", "false"]
    return main(["sft", *flags, "--learning_rate", "1e-3", *extra])


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.numerics
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_padding_free_trains_like_padded(tmp_path, architecture):
    """Several samples with images (and one without) per packed row: the same losses and
    weights as one sample per padded row, so positions, masks and image features line up."""
    model_dir = BUILDERS[architecture](tmp_path / architecture)
    data = write_jsonl(tmp_path / "rows.jsonl", colour_rows(tmp_path))
    padded, packed = tmp_path / "padded", tmp_path / "packed"
    with patched_qwen2_vl_loading():
        assert sft(model_dir, data, padded, "--padding_free", "false") == 0
        assert sft(model_dir, data, packed, "--padding_free", "true") == 0
    layout = json.loads((packed / "data_health.json").read_text())["layout"]
    assert (layout["kind"], layout["padding_share"]) == ("padding-free", 0.0)
    # The text model's chain over a row of at most every training token, twice over for the
    # image tower before it (2 layers, at most 64 wide: a shorter chain).
    tokens = json.loads((packed / "data_health.json").read_text())["train"]["tokens"]
    terms = 2 * forward_terms(tokens)
    assert_close(losses(packed), losses(padded), terms=terms, what="losses")
    weights = "final/model.safetensors"
    assert_trained_weights_close(padded / weights, packed / weights, learning_rate=1e-3, steps=3)


@pytest.mark.bad_input(
    input="--padding_free or --packing with a vision-language model whose packed rows swiftlm "
    "does not build (e.g. LLaVA-NeXT)",
    outcome="Refused before the data is read, naming the flag, the model type and that "
    "padded batches are the fallback",
)
def test_packing_is_refused_where_rows_are_not_built(tmp_path, capsys):
    from transformers import LlavaNextConfig

    folder = tmp_path / "llava-next"  # the refusal comes before the processor loads
    LlavaNextConfig(architectures=["LlavaNextForConditionalGeneration"]).save_pretrained(folder)
    data = write_jsonl(tmp_path / "rows.jsonl", colour_rows(tmp_path))
    assert sft(folder, data, tmp_path / "run", "--packing", "true") == 2
    err = capsys.readouterr().err
    assert "--packing: packed batches of llava_next models need per-sample image" in err
    assert "drop the flag (batches are padded per sample)" in err
