"""`swiftlm export --to_gguf` / `--to_ollama`: a GGUF file that llama.cpp's layout and
transformers' GGUF reader agree on, checked against the source model."""

import gguf
import pytest
import torch
from tests.conftest import (
    CHATML,
    CORPUS,
    build_tiny_llama,
    build_tokenizer,
)

from swiftlm.cli.main import main
from tolerance import assert_close, eps, forward_terms


def f16_bound(reference: torch.Tensor) -> float:
    """How far f16 weights may move the logits: f16 rounds each weight by at most half its eps
    (2**-11) of itself, and about ten matmuls stand between the embeddings and a logit (2 layers
    of q/k/v/o and gate/up/down, the head), so a logit moves by up to 10 x eps/2 of the logits'
    size (measured: 0.8 eps x max|logit|, 2.5e-3 for the tiny Llama). A wrong tensor layout or
    a missing permutation moves them by their own size."""
    return 5 * eps(torch.float16) * float(reference.abs().max())


def export_gguf(model_or_run: list[str], out, gguf_type: str = "f16", *flags: str) -> int:
    argv = ["export", *model_or_run, "--to_gguf", "true", "--gguf_type", gguf_type]
    return main([*argv, "--output_dir", str(out), *flags])


def tensor_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@torch.no_grad()
def logits(folder, tokenizer_dir, gguf_file=None, adapter=None) -> torch.Tensor:
    """Float32 logits of one prompt, the model loaded from a folder or from a GGUF file."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = tokenizer("Question number 3? The capital of France", return_tensors="pt")["input_ids"]
    return model(ids).logits


def test_f16_file_reproduces_the_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "gguf"
    assert export_gguf(["--model", str(tiny_model_dir)], out, "f16") == 0
    printed = capsys.readouterr().out
    path = out / f"{tiny_model_dir.name}-f16.gguf"
    assert f"wrote {path}" in printed
    assert "read back 21 tensors: names, shapes and types as written" in printed
    assert "encode to the same ids" in printed and "greedy answers 5/5 equal" in printed
    types = tensor_types(path)
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" in types  # not tied
    # read independently of the export's own check: f16 rounding only
    reference = logits(tiny_model_dir, tiny_model_dir)
    diff = (logits(out, tiny_model_dir, path.name) - reference).abs()
    assert 0 < diff.max() < f16_bound(reference)


def test_q8_0_with_ollama_modelfile(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "gguf"
    flags = ("--to_ollama", "true", "--system", "You are terse.")
    assert export_gguf(["--model", str(tiny_model_dir)], out, "q8_0", *flags) == 0
    printed = capsys.readouterr().out
    name = f"{tiny_model_dir.name}-q8_0.gguf"
    types = tensor_types(out / name)
    assert types["blk.1.ffn_down.weight"] == "Q8_0" and types["output.weight"] == "Q8_0"
    assert types["output_norm.weight"] == "F32"
    ppl = [line for line in printed.splitlines() if "held-out perplexity" in line][0]
    assert "limit ±1.5% for q8_0" in ppl
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.splitlines()[2] == f"FROM ./{name}"
    template = (
        'TEMPLATE """{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
        '{{ range .Messages }}{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
        '<|im_start|>assistant\n{{ else if eq .Role "assistant" }}{{ .Content }}<|im_end|>\n'
        '{{ end }}{{ end }}"""'
    )
    assert template in modelfile
    assert 'PARAMETER stop "<|im_end|>"\nPARAMETER stop "<|im_start|>"\n' in modelfile
    assert 'SYSTEM """You are terse."""' in modelfile
    reference = logits(tiny_model_dir, tiny_model_dir)
    diff = (logits(out, tiny_model_dir, name) - reference).abs()
    # Quantized, but close: Q8_0 rounds a weight to half a step of its block's largest |w| / 127,
    # at most 1/254 of that largest weight, itself about 3x a typical one in a block of 32
    # Gaussian weights; ten matmuls deep (see f16_bound), a logit moves by up to 10 x 3/254 of
    # the logits' size (0.38 here; measured 0.1). More than f16's rounding, so it was quantized.
    assert f16_bound(reference) < diff.max() < 10 * 3 / 254 * float(reference.abs().max())


def build_sentencepiece_tokenizer(out):
    """A Llama 2 / Mistral style tokenizer: BPE over "▁"-marked words, byte fallback tokens
    <0x00>..<0xFF> after <unk> <s> </s>, and ChatML tokens added as special."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, LlamaTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=300, limit_alphabet=60)
    bpe.train_from_iterator([line for line in CORPUS if line.isascii()] * 20, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab += sorted(trained["vocab"], key=trained["vocab"].get)
    merges = [tuple(m.split(" ") if isinstance(m, str) else m) for m in trained["merges"]]
    tokenizer = LlamaTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def _save_tiny(out, config_cls, sentencepiece=False, **extra):
    tokenizer = (build_sentencepiece_tokenizer if sentencepiece else build_tokenizer)(out)
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=0.1,
        **extra,
    )
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["tied-llama", "qwen2", "mistral", "rope-scaled-llama"])
def test_other_llama_family_models(family, tmp_path, capsys):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "rope-scaled-llama":
        rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        source = _save_tiny(tmp_path / "scaled", LlamaConfig, rope_parameters=rope)
    elif family == "tied-llama":
        source = tmp_path / "tied"
        build_tiny_llama(source, vocab_size=len(build_tokenizer(source)), tie=True)
    elif family == "qwen2":  # q/k/v biases, no Q/K permutation in llama.cpp's qwen2 graph
        source = _save_tiny(tmp_path / "qwen", Qwen2Config, tie_word_embeddings=False)
    else:
        source = _save_tiny(tmp_path / "tiny-mistral", MistralConfig, sentencepiece=True)
    out = tmp_path / "gguf"
    assert export_gguf(["--model", str(source)], out, "f16") == 0
    printed = capsys.readouterr().out
    assert "greedy answers 5/5 equal" in printed
    path = out / f"{source.name}-f16.gguf"
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    names = {t.name for t in reader.tensors}
    assert arch == ("qwen2" if family == "qwen2" else "llama")
    assert ("output.weight" in names) == (family != "tied-llama")
    assert ("blk.0.attn_q.bias" in names) == (family == "qwen2")
    tokenizer_model = reader.fields["tokenizer.ggml.model"].contents()
    assert tokenizer_model == ("llama" if family == "mistral" else "gpt2")
    reference = logits(source, source)
    diff = (logits(out, source, path.name) - reference).abs().max()
    if family == "rope-scaled-llama":
        assert reader.fields["llama.rope.scaling.type"].contents() == "linear"
        assert reader.fields["llama.rope.scaling.factor"].contents() == 2.0
        # transformers' GGUF reader ignores the scaling, so the check lends it the source's
        assert "rope scaling copied onto the read-back config" in printed
        assert diff > f16_bound(reference)
    else:
        assert diff < f16_bound(reference)


@pytest.fixture
def lora_run(tiny_lora_run):
    return tiny_lora_run  # its folder name, my-run, names the GGUF file


@pytest.mark.numerics
def test_lora_run_is_merged_then_written(lora_run, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "gguf"
    assert export_gguf(["--ckpt_dir", str(lora_run)], out, "f32") == 0
    printed = capsys.readouterr().out
    assert "merged max |diff|" in printed  # the adapters were merged and checked first
    path = out / "my-run-f32.gguf"
    got = logits(out, tiny_model_dir, path.name)
    expected = logits(tiny_model_dir, tiny_model_dir, adapter=lora_run / "final")
    base = logits(tiny_model_dir, tiny_model_dir)
    # float32 either way: merged (W + BA) against peft's unmerged adapter, up to the rounding
    # of the forward (over the prompt's tokens) and the merge's sum; a logit's terms are the size
    # of the largest logit.
    size, terms = float(expected.abs().max()), forward_terms(tokens=got.shape[1]) + 1
    assert_close(got, expected, terms=terms, magnitude=size, what="merged logits")
    assert (expected - base).abs().max() > 1e-2  # the adapter changed something to check


def test_unsupported_architecture_is_refused_before_loading(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    source = tmp_path / "gpt2"
    tokenizer = build_tokenizer(source)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(source)
    assert export_gguf(["--model", str(source)], tmp_path / "out", "q8_0") == 2
    err = capsys.readouterr().err
    assert "is a GPT2LMHeadModel" in err
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in err
    assert "--merge_lora" in err
    assert not (tmp_path / "out").exists()


def test_a_wrong_layout_fails_the_check(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Without llama.cpp's Q/K permutation transformers reads a different model back."""
    from swiftlm.export import gguf as gguf_export

    monkeypatch.setattr(gguf_export, "permute_qk", lambda weight, n_head: weight)
    assert export_gguf(["--model", str(tiny_model_dir)], tmp_path / "out", "f32") == 1
    err = capsys.readouterr().err
    assert "answers check prompt" in err and "differently from the source" in err


@pytest.mark.slow
def test_default_model_to_f16_and_q8_0(tmp_path, capsys):
    from swiftlm.export.gguf_check import PERPLEXITY_MARGINS

    for gguf_type in ("f16", "q8_0"):
        out = tmp_path / gguf_type
        ollama = ("--to_ollama", "true") if gguf_type == "q8_0" else ()
        assert export_gguf([], out, gguf_type, *ollama) == 0
        printed = capsys.readouterr().out
        path = out / f"SmolLM2-135M-Instruct-{gguf_type}.gguf"
        assert path.is_file()
        line = [x for x in printed.splitlines() if "held-out perplexity" in x][0]
        source, written = (
            float(x) for x in line.split("perplexity ")[1].split(" (")[0].split(" -> ")
        )
        assert abs(written / source - 1) <= PERPLEXITY_MARGINS[gguf_type]
        if gguf_type == "f16":
            assert "greedy answers 5/5 equal" in line
            assert 250 * 2**20 < path.stat().st_size < 280 * 2**20
        else:
            assert 130 * 2**20 < path.stat().st_size < 150 * 2**20
            # SmolLM2's template is ChatML with a default system prompt of its own
            modelfile = (out / "Modelfile").read_text()
            assert "{{ .Content }}<|im_end|>\n<|im_start|>assistant\n" in modelfile
            assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in modelfile


@pytest.mark.slow
def test_default_model_q4_1_tensors_equal_the_packaged_llama_cpp_file(tmp_path):
    """The packaged SmolLM2 is a llama.cpp Q4_1 file; its weights, de-quantized by
    transformers, sit exactly on Q4_1's grid, so writing them back as q4_1 must reproduce
    llama.cpp's bytes: names, shapes, types (the tied output at Q8_0), Q/K permutation."""
    import numpy as np

    from swiftlm.export.gguf import write_gguf
    from swiftlm.models.loader import default_model_file, load_model, load_tokenizer, resolve_model

    folder = resolve_model(None).path
    model = load_model(folder, torch.float32, torch.device("cpu"))
    written = write_gguf(tmp_path / "m.gguf", model, load_tokenizer(folder), "q4_1", "m")
    ours = {t.name: t for t in gguf.GGUFReader(written.path).tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(default_model_file()).tensors}
    assert ours.keys() == theirs.keys() and len(ours) == 272
    for name, tensor in theirs.items():
        assert ours[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(np.asarray(ours[name].data), np.asarray(tensor.data)), name
