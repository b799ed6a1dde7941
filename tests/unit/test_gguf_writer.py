"""The GGUF writer: tensor layout, types, metadata and tokenizer, read back with gguf's reader."""

import gguf
import numpy as np
import pytest
from tests.conftest import build_tokenizer, make_tiny_llama

from swiftlm.errors import ConfigError, ExportCheckError
from swiftlm.export import gguf as gguf_export
from swiftlm.export.gguf_tokenizer import byte_level_pre
from swiftlm.export.ollama import modelfile_text, recognise

LAYER_TENSORS = [
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
]


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_qk_permutation_pairs_rotary_halves_and_transformers_undoes_it():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    # one head of dimension 4: HF rotates rows (0, 2) and (1, 3); llama.cpp adjacent pairs
    head = np.arange(4, dtype=np.float32)[:, None]
    assert gguf_export.permute_qk(head, 1)[:, 0].tolist() == [0, 2, 1, 3]
    weight = np.random.default_rng(0).standard_normal((2 * 16, 64)).astype(np.float32)
    permuted = gguf_export.permute_qk(weight, 2)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(gguf_export.unpermute_qk(permuted, 2), weight)
    # transformers' GGUF loader reverses K with the key/value head count
    processor = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 2})
    undone = processor.process(permuted, "blk.0.attn_k.weight").weights
    assert np.array_equal(undone, weight)


@pytest.mark.parametrize(
    ("name", "shape", "gguf_type", "expected"),
    [
        ("blk.0.attn_norm.weight", (64,), "q4_0", "F32"),
        ("blk.0.attn_q.bias", (64,), "f16", "F32"),
        ("blk.0.attn_q.weight", (64, 64), "f16", "F16"),
        ("blk.0.attn_q.weight", (64, 64), "bf16", "BF16"),
        ("blk.0.attn_q.weight", (64, 64), "q5_1", "Q5_1"),
        ("output.weight", (400, 64), "q4_0", "Q8_0"),  # output projection kept precise
        ("output.weight", (400, 64), "q8_0", "Q8_0"),
        ("blk.0.ffn_up.weight", (96, 48), "q4_1", "F16"),  # 48 is not a multiple of 32
    ],
)
def test_tensor_type_choice(name, shape, gguf_type, expected):
    qtype, note = gguf_export.choose_type(name, shape, gguf_type, "output.weight")
    assert qtype == expected
    if gguf_type == "q4_1":
        assert "not a multiple of the Q4_1 block (32)" in note


def test_written_file_reads_back_with_names_shapes_types_and_metadata(tmp_path, tokenizer):
    model = make_tiny_llama(len(tokenizer)).eval()
    written = gguf_export.write_gguf(tmp_path / "m.gguf", model, tokenizer, "q8_0", "tiny")
    reader = gguf.GGUFReader(written.path)
    tensors = {t.name: t for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}" for i in range(2) for n in LAYER_TENSORS}
    assert set(tensors) == expected
    q = tensors["blk.1.attn_k.weight"]  # GGUF lists the row length first
    assert [int(d) for d in q.shape] == [64, 32] and q.tensor_type.name == "Q8_0"
    assert tensors["blk.0.ffn_norm.weight"].tensor_type.name == "F32"
    # the stored K is the permuted weight, to Q8_0 precision
    stored = gguf.quants.dequantize(q.data, q.tensor_type)
    want = gguf_export.permute_qk(model.model.layers[1].self_attn.k_proj.weight.detach().numpy(), 2)
    assert np.abs(stored - want).max() < 0.01 * np.abs(want).max()

    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "general.name") == "tiny"
    assert _field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    shape = {
        "block_count": 2,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "context_length": 512,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "rope.dimension_count": 16,
        "vocab_size": len(tokenizer),
    }
    assert {k: _field(reader, f"llama.{k}") for k in shape} == shape
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(10000.0)
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)

    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert len(tokens) == len(tokenizer) and tokens[tokenizer.eos_token_id] == "<|im_end|>"
    assert types[tokenizer.eos_token_id] == gguf.TokenType.CONTROL
    assert types[300] == gguf.TokenType.NORMAL
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert _field(reader, "tokenizer.ggml.padding_token_id") == tokenizer.pad_token_id
    assert "tokenizer.ggml.bos_token_id" not in reader.fields  # the tokenizer has none
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert _field(reader, "tokenizer.chat_template") == tokenizer.chat_template
    assert len(_field(reader, "tokenizer.ggml.merges")) > 0

    gguf_export.verify_tensors(written)  # passes on what was written
    tampered = gguf_export.PlannedTensor("blk.0.attn_q.weight", (64, 64), "F16")
    written.tensors[1] = tampered
    with pytest.raises(ExportCheckError, match="blk.0.attn_q.weight"):
        gguf_export.verify_tensors(written)


def test_rows_off_the_block_size_fall_back_to_f16_and_are_reported(tmp_path, tokenizer, capsys):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,  # rows of 48 values: one and a half 32-value blocks
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    written = gguf_export.write_gguf(tmp_path / "m.gguf", model, tokenizer, "q4_0", "odd")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(written.path).tensors}
    assert "output.weight" not in types  # tied: token_embd is the output projection
    assert types["blk.0.attn_q.weight"] == "F16"
    assert types["blk.0.ffn_down.weight"] == "Q4_0"  # its rows are 96 long
    assert types["token_embd.weight"] == "F16"
    gguf_export._print_written(written)
    printed = capsys.readouterr().out
    assert (
        "blk.0.attn_q.weight: row length 48 is not a multiple of the Q4_0 block (32): F16"
        in printed
    )
    assert "token_embd.weight: row length 48 is not a multiple of the Q8_0 block" in printed


def test_pre_tokenizer_names():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert byte_level_pre(byte_level) == "gpt-2"
    digits = {"type": "Digits", "individual_digits": True}
    assert byte_level_pre({"type": "Sequence", "pretokenizers": [digits, byte_level]}) == "smollm"
    from swiftlm.export.gguf_tokenizer import QWEN2_SPLIT

    split = {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated"}
    no_regex = dict(byte_level, use_regex=False)
    assert byte_level_pre({"type": "Sequence", "pretokenizers": [split, no_regex]}) == "qwen2"
    with pytest.raises(ConfigError, match="pre-tokenizer"):
        byte_level_pre({"type": "Whitespace"})


LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are SmolLM.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    " [/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)


def test_ollama_templates_are_recognised_by_rendering(tokenizer):
    chat = recognise(tokenizer)  # the test tokenizer's plain ChatML
    assert chat.family == "ChatML" and chat.default_system is None
    assert chat.stops == ["<|im_end|>", "<|im_start|>"]
    try:
        tokenizer.chat_template = SMOLLM2
        tokenizer.bos_token = "<|im_start|>"  # as SmolLM2's, which does not add it to text
        chat = recognise(tokenizer)
        assert chat.family == "ChatML" and chat.default_system == "You are SmolLM."
        text, _ = modelfile_text("m.gguf", tokenizer, None)
        assert 'SYSTEM """You are SmolLM."""' in text
        text, _ = modelfile_text("m.gguf", tokenizer, "Be terse.")
        assert 'SYSTEM """Be terse."""' in text

        tokenizer.chat_template = LLAMA3
        tokenizer.bos_token = "<|begin_of_text|>"  # not added by this tokenizer: kept literal
        chat = recognise(tokenizer)
        assert chat.family == "Llama 3"
        assert chat.template.startswith("<|begin_of_text|>{{ if .System }}")
        assert chat.stops == ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
        assert "{{ .Content }}<|eot_id|><|start_header_id|>assistant" in chat.template

        tokenizer.chat_template = MISTRAL
        assert recognise(tokenizer) is None
        text, _ = modelfile_text("m.gguf", tokenizer, None)
        assert "TEMPLATE" not in text and "FROM ./m.gguf" in text
        assert 'PARAMETER stop "<|im_end|>"' in text  # the EOS still ends a reply
    finally:
        from tests.conftest import CHATML

        tokenizer.chat_template = CHATML
        tokenizer.bos_token = None


@pytest.mark.parametrize("rope_type", ["llama3", "dynamic"])
def test_rope_scaling_without_metadata(rope_type, tmp_path, tokenizer):
    """Llama 3.1's scaling is a per-frequency tensor in GGUF; one with no GGUF form is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": rope_type, "factor": 8.0, "rope_theta": 500000.0}
    if rope_type == "llama3":
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope["original_max_position_embeddings"] = 64
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=512,
        rope_parameters=rope,
    )
    model = LlamaForCausalLM(config)
    if rope_type == "dynamic":
        with pytest.raises(ConfigError, match="rope scaling 'dynamic'"):
            gguf_export.write_gguf(tmp_path / "m.gguf", model, tokenizer, "f16", "m")
        return
    written = gguf_export.write_gguf(tmp_path / "m.gguf", model, tokenizer, "f16", "m")
    freqs = {t.name: t for t in gguf.GGUFReader(written.path).tensors}["rope_freqs.weight"]
    factors = np.asarray(freqs.data)
    # 16 frequencies: the fastest unscaled, the slowest divided by the full factor
    assert freqs.tensor_type.name == "F32" and factors.shape == (16,)
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert np.all(np.diff(factors) >= 0)
