"""`swiftlm export --to_gguf`: one GGUF file for llama.cpp and Ollama, checked before returning.

How a Hugging Face Llama-family model maps onto GGUF (what llama.cpp's `convert_hf_to_gguf.py`
does, written compactly for the architectures below):

- metadata `general.*` (name, file type, quantization version) and `<arch>.*`: context length
  (max_position_embeddings), embedding length (hidden_size), block count, feed-forward length,
  head counts (query heads, and key/value heads for grouped-query attention), rope dimension
  and frequency base, rope scaling when the config has one, rms norm epsilon, vocab size;
- tensors renamed by gguf's own name table (`model.layers.3.self_attn.q_proj.weight` ->
  `blk.3.attn_q.weight`), each stored with its dimensions reversed (GGUF lists the row length
  first; the bytes are the same row-major array);
- for the `llama` architecture the rows of Q and K are permuted within each head: Hugging Face
  rotates the two halves of a head (`rotate_half`), llama.cpp's rope rotates adjacent pairs.
  transformers' GGUF loader undoes the same permutation. Qwen2 uses the halves convention in
  llama.cpp too, so its Q/K (and their biases) are written as they are;
- tied embeddings: no `output.weight`, llama.cpp reuses `token_embd.weight`;
- tensor types: 1-D tensors (norms, biases) stay F32 in every file type; 2-D weights take the
  requested type. For the 4/5-bit types the output projection is kept at Q8_0, as
  llama-quantize keeps it at a higher precision (its Q6_K is not in gguf-py); a weight whose
  rows are not a whole number of 32-value blocks is written F16 instead (both are reported);
- the tokenizer and chat template as `tokenizer.ggml.*` metadata (`export/gguf_tokenizer.py`).

The export then reads its own file back: every tensor with the planned name, shape and type
(gguf.GGUFReader); the tokenizer transformers rebuilds from the file encodes the chat prompts
and the held-out text to the same ids as the source tokenizer; and the model transformers
rebuilds (de-quantized, float32) is compared with the source model in float32: max |logit|
difference, greedy answers to the fixed prompts (required equal for f32 and f16) and
held-out perplexity (required within a per-type margin); see `export/gguf_check.py`.
"""

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from swiftlm.config import ExportConfig
from swiftlm.errors import ConfigError
from swiftlm.export.gguf_check import compare_models, verify_tensors, verify_tokenizer
from swiftlm.export.gguf_tokenizer import TokenizerSummary, add_tokenizer
from swiftlm.export.source import ExportSource
from swiftlm.models.loader import load_model, load_tokenizer, resolve_model


@dataclass(frozen=True)
class Architecture:
    gguf_arch: str  # general.architecture, the llama.cpp graph that runs the model
    permute_qk: bool  # whether llama.cpp's graph expects Q/K rows in pair-interleaved order


# Hugging Face class -> how it is written. SmolLM and SmolLM2 are LlamaForCausalLM; llama.cpp
# runs Mistral (v0.1-v0.3, Nemo) on its llama graph.
ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama", permute_qk=True),
    "MistralForCausalLM": Architecture("llama", permute_qk=True),
    "Qwen2ForCausalLM": Architecture("qwen2", permute_qk=False),
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

# --gguf_type -> (tensor type of the 2-D weights, general.file_type)
GGUF_TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
FLOAT_TYPES = ("f32", "f16", "bf16")
# rope scalings with a GGUF form: metadata (linear, yarn) or a rope_freqs tensor (llama3)
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
LOW_BIT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1")


# ---------------------------------------------------------------------------------------------
# What is supported


def architecture_name(config) -> str:
    names = getattr(config, "architectures", None) or []
    if names:
        return names[0]
    return MODEL_TYPES.get(
        getattr(config, "model_type", ""), str(getattr(config, "model_type", "?"))
    )


def supported_architecture(config, where: str) -> Architecture:
    """The GGUF mapping of `config`'s model; a ConfigError naming the alternatives if none."""
    name = architecture_name(config)
    if name not in ARCHITECTURES:
        raise ConfigError(
            f"--to_gguf: {where} is a {name}; the GGUF export supports "
            f"{', '.join(ARCHITECTURES)} (SmolLM included). For vLLM or transformers export a "
            "LoRA run with --merge_lora (a plain Hugging Face folder), or serve the model "
            "folder as it is; llama.cpp's convert_hf_to_gguf.py covers more architectures"
        )
    rope = _rope(config)["rope_type"]
    if rope not in ROPE_TYPES:
        raise ConfigError(
            f"--to_gguf: {where} uses rope scaling {rope!r}, which this export cannot write "
            f"(it writes {', '.join(ROPE_TYPES)}); convert it with llama.cpp's "
            "convert_hf_to_gguf.py"
        )
    return ARCHITECTURES[name]


def validate(cfg: ExportConfig) -> None:
    """Flag checks and, when the model folder is already known, its architecture, before
    anything loads or merges."""
    e = cfg.export
    if e.gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf_type {e.gguf_type}: choose one of {', '.join(GGUF_TYPES)}")
    from transformers import AutoConfig

    from swiftlm.checkpoint.resolve import resolve_inference_model

    base = Path(resolve_inference_model(cfg).base_path)
    if (base / "config.json").is_file():
        supported_architecture(AutoConfig.from_pretrained(base), str(base))


# ---------------------------------------------------------------------------------------------
# Tensors


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder each head's rows from Hugging Face's rotate-halves layout (row i pairs with
    i + d/2) to llama.cpp's adjacent pairs (row 2i pairs with 2i + 1). Biases too."""
    shape = weight.shape
    return (
        weight.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_qk` (what transformers' GGUF loader applies)."""
    shape = weight.shape
    return (
        weight.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # GGUF name
    shape: tuple[int, ...]  # row-major (PyTorch) shape; GGUF lists it reversed
    qtype: str  # GGMLQuantizationType name
    note: str = ""  # why the type differs from the requested one, if it does


def choose_type(name: str, shape: tuple[int, ...], gguf_type: str, output_name: str) -> tuple:
    """(tensor type, note) for one tensor of a `gguf_type` file."""
    if len(shape) == 1:
        return "F32", ""  # norms and biases: tiny, and sensitive to rounding
    wanted = GGUF_TYPES[gguf_type][0]
    note = ""
    if gguf_type in LOW_BIT_TYPES and name == output_name:
        wanted, note = "Q8_0", "output projection kept at Q8_0"
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[wanted]][0]
    if shape[-1] % block:
        return (
            "F16",
            f"row length {shape[-1]} is not a multiple of the {wanted} block ({block}): F16",
        )
    return wanted, note


def encode(array: np.ndarray, qtype: str) -> np.ndarray:
    """`array` (float32) in GGUF type `qtype`: float arrays, or the packed blocks as bytes."""
    if qtype == "F32":
        return array.astype(np.float32)
    if qtype == "F16":
        return array.astype(np.float16)
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[qtype])


def _head_counts(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope(config) -> dict:
    """The rope settings, from transformers 5's rope_parameters or an older rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def llama3_rope_factors(config) -> np.ndarray:
    """Llama 3.1's frequency-dependent rope scaling as the per-frequency divisors llama.cpp
    reads from `rope_freqs.weight` (the same formula as convert_hf_to_gguf.py)."""
    rope = _rope(config)
    dim = head_dim(config)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / dim)
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(model, arch: Architecture):
    """(GGUF name, float32 array) for every weight of `model`, in llama.cpp's layout."""
    config = model.config
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.gguf_arch)
    names = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    heads, kv_heads = _head_counts(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses token_embd.weight
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConfigError(f"--to_gguf: no GGUF name for tensor {hf_name} of {arch.gguf_arch}")
        array = tensor.detach().to(torch.float32).numpy()
        if arch.permute_qk and ".attn_q." in name:
            array = permute_qk(array, heads)
        elif arch.permute_qk and ".attn_k." in name:
            array = permute_qk(array, kv_heads)
        yield name, array
    if _rope(config)["rope_type"] == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(config)


# ---------------------------------------------------------------------------------------------
# Metadata


def _add_rope_scaling(writer, config) -> None:
    rope = _rope(config)
    kind = rope["rope_type"]  # llama3 travels as the rope_freqs.weight tensor (gguf_tensors)
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        original = rope.get("original_max_position_embeddings")
        if original:
            writer.add_rope_scaling_orig_ctx_len(original)


def add_model_metadata(writer, config, gguf_type: str, name: str) -> None:
    heads, kv_heads = _head_counts(config)
    writer.add_type("model")
    writer.add_name(name)
    writer.add_description("exported by swiftlm")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config.hidden_size // heads:  # e.g. Mistral Nemo
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_rope_freq_base(float(_rope(config)["rope_theta"]))
    _add_rope_scaling(writer, config)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType[GGUF_TYPES[gguf_type][1]])
    if gguf_type not in FLOAT_TYPES:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class WrittenFile:
    path: Path
    tensors: list[PlannedTensor] = field(default_factory=list)
    tokenizer: TokenizerSummary | None = None

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    @property
    def notes(self) -> list[PlannedTensor]:
        return [t for t in self.tensors if t.note]


def write_gguf(path: Path, model, tokenizer, gguf_type: str, name: str) -> WrittenFile:
    """Write `model` (float32, Llama family) and `tokenizer` to one GGUF file at `path`."""
    config = model.config
    arch = supported_architecture(config, "the model")
    writer = gguf.GGUFWriter(path, arch.gguf_arch)
    add_model_metadata(writer, config, gguf_type, name)
    written = WrittenFile(path)
    written.tokenizer = add_tokenizer(writer, tokenizer, config.vocab_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    output_name = "token_embd.weight" if tied else "output.weight"
    for tensor_name, array in gguf_tensors(model, arch):
        qtype, note = choose_type(tensor_name, array.shape, gguf_type, output_name)
        data = encode(array, qtype)
        raw = None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(tensor_name, data, raw_dtype=raw)
        written.tensors.append(PlannedTensor(tensor_name, tuple(array.shape), qtype, note))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


# ---------------------------------------------------------------------------------------------
# The command


def export_name(source: ExportSource, cfg: ExportConfig) -> str:
    """The file's base name: the run folder for a LoRA run, else the model's name."""
    checkpoint = cfg.infer.ckpt_dir or (cfg.infer.adapters[0] if cfg.infer.adapters else None)
    if checkpoint:
        path = Path(checkpoint).resolve()
        while path.name in ("final", "checkpoints") or path.name.startswith("step-"):
            path = path.parent
        name = path.name
    else:
        name = resolve_model(cfg.model.model).name
    name = re.sub(r"[.-](q\d\w*|f16|f32|bf16)$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _print_written(written: WrittenFile) -> None:
    print(
        f"wrote {written.path} ({written.size / 2**20:.1f} MiB, {len(written.tensors)} tensors, "
        f"tokenizer {written.tokenizer.model}/{written.tokenizer.pre}, "
        f"{written.tokenizer.tokens} tokens)",
        flush=True,
    )
    for tensor in written.notes:
        print(f"  {tensor.name}: {tensor.note}")


def export(source: ExportSource, out: Path, cfg: ExportConfig) -> dict:
    from transformers import AutoConfig

    started = time.perf_counter()
    gguf_type = cfg.export.gguf_type
    supported_architecture(AutoConfig.from_pretrained(source.model_path), source.description)
    print(f"Loading {source.description}", flush=True)
    tokenizer = load_tokenizer(source.tokenizer_path)
    model = load_model(source.model_path, torch.float32, torch.device("cpu")).eval()
    out.mkdir(parents=True, exist_ok=True)
    name = export_name(source, cfg)
    written = write_gguf(out / f"{name}-{gguf_type}.gguf", model, tokenizer, gguf_type, name)
    _print_written(written)
    print(f"checking {written.path.name} against the source model:", flush=True)
    verify_tensors(written)
    tokens_match = verify_tokenizer(written, tokenizer)
    rope_scaled = _rope(model.config)["rope_type"] != "default"
    measured = compare_models(written, model, tokenizer, gguf_type, rope_scaled)
    report = {
        "output": str(written.path),
        "size_bytes": written.size,
        "gguf_type": gguf_type,
        "tensors": len(written.tensors),
        "tensors_not_in_requested_type": {t.name: t.note for t in written.notes},
        "tokens_match": tokens_match,
        **measured,
    }
    if cfg.export.to_ollama:
        from swiftlm.export.ollama import write_modelfile

        report["modelfile"] = str(write_modelfile(written.path, tokenizer, source.system))
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(f"GGUF export done in {report['seconds']} s: {written.path}")
    return report
