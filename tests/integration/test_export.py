"""`swiftlm export --merge_lora`: a full model folder whose logits equal base + adapter."""

import pytest
import torch

from swiftlm.cli.main import main
from tolerance import assert_close, forward_terms


@pytest.fixture
def lora_run(tiny_lora_run):
    return tiny_lora_run


def _logits(folder, tokenizer_dir, adapter=None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = tokenizer("Question number 3?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.numerics
def test_merged_model_reproduces_base_plus_adapter(lora_run, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "merged"
    argv = ["export", "--ckpt_dir", str(lora_run), "--merge_lora", "true"]
    assert main([*argv, "--output_dir", str(out), "--max_shard_size", "200KB"]) == 0
    printed = capsys.readouterr().out
    assert "merged max |diff|" in printed and "saved folder read back" in printed
    # Sharded as asked, with the tokenizer and its chat template, and no adapter files.
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert (out / "tokenizer.json").is_file() and not (out / "adapter_config.json").exists()
    merged = _logits(out, out)
    expected = _logits(tiny_model_dir, tiny_model_dir, adapter=lora_run / "final")
    base = _logits(tiny_model_dir, tiny_model_dir)
    # float32 either way: merged (W + BA) against peft's unmerged adapter, up to the rounding
    # of the forward (over the prompt's tokens) and the merge's sum; a logit's terms are the
    # size of the largest logit.
    size, terms = float(expected.abs().max()), forward_terms(tokens=merged.shape[1]) + 1
    assert_close(merged, expected, terms=terms, magnitude=size, what="merged logits")
    assert (expected - base).abs().max() > 1e-2  # the adapter changed something to check


def test_export_errors_name_the_fix(lora_run, tiny_model_dir, tmp_path, capsys):
    assert main(["export", "--ckpt_dir", str(lora_run), "--output_dir", str(tmp_path / "a")]) == 2
    assert "pass --merge_lora" in capsys.readouterr().err
    argv = ["export", "--model", str(tiny_model_dir), "--merge_lora", "true"]
    assert main([*argv, "--output_dir", str(tmp_path / "b")]) == 2
    assert "--merge_lora needs adapters" in capsys.readouterr().err
    both = ["--ckpt_dir", str(lora_run), "--adapters", str(lora_run / "final")]
    assert main(["export", *both, "--merge_lora", "true", "--output_dir", str(tmp_path / "c")]) == 2
    assert "--ckpt_dir and --adapters both given" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
