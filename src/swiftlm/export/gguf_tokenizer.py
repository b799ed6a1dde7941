"""A Hugging Face tokenizer as GGUF metadata (`tokenizer.ggml.*`), the way llama.cpp's
`convert_hf_to_gguf.py` writes it.

A GGUF file carries no `tokenizer.json`: llama.cpp rebuilds the tokenizer from

- `tokenizer.ggml.model`: the algorithm: "gpt2" (byte-level BPE: GPT-2, Llama 3, Qwen2,
  SmolLM) or "llama" (sentencepiece-style BPE with byte fallback: Llama 2, Mistral);
- `tokenizer.ggml.pre`: which regex splits text before BPE; llama.cpp knows a fixed list of
  names ("gpt-2", "llama-bpe", "qwen2", "smollm", ...) and implements each one itself;
- `tokens`, `token_type` (normal, control = special, user-defined = added but not special,
  byte, unused = padding rows), `merges` (BPE) or `scores` (sentencepiece: higher merges
  first), the bos/eos/unk/pad ids, `add_bos_token`/`add_eos_token`, and the chat template.

The pre-tokenizer is recognised from the tokenizer's own `pre_tokenizer` settings rather than
from llama.cpp's hash of a sample encoding, so that a retrained vocabulary with a known
splitting rule (the test models) converts too. Anything not recognised is refused: llama.cpp
would otherwise split text differently from the model's training.
"""

import json
from dataclasses import dataclass

import gguf

from swiftlm.errors import ConfigError
from swiftlm.models.templates import end_of_turn_token

# Split regexes of byte-level tokenizers, as their tokenizer.json spells them, and the
# llama.cpp `tokenizer.ggml.pre` name that implements each.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX_PRE = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}

SENTENCEPIECE_SPACE = "\u2581"


@dataclass(frozen=True)
class TokenizerSummary:
    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre
    tokens: int  # entries written (the model's vocab_size, padding rows included)
    added_special: int  # control tokens
    add_bos: bool
    add_eos: bool


def _backend_json(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(
            f"--to_gguf needs a fast (tokenizers) tokenizer; {type(tokenizer).__name__} has none"
        )
    return json.loads(backend.to_str())


def _steps(component: dict | None) -> list[dict]:
    """A pre-tokenizer or normalizer as a flat list of steps (a Sequence unrolled)."""
    if component is None:
        return []
    if component["type"] == "Sequence":
        key = "pretokenizers" if "pretokenizers" in component else "normalizers"
        return [s for step in component[key] for s in _steps(step)]
    return [component]


def _split_regex(step: dict) -> str | None:
    pattern = step.get("pattern", {})
    return pattern.get("Regex") or pattern.get("String")


def byte_level_pre(pre_tokenizer: dict | None) -> str:
    """The llama.cpp pre-tokenizer name for a byte-level BPE's `pre_tokenizer` settings."""
    steps = [(s["type"], s) for s in _steps(pre_tokenizer)]
    kinds = [kind for kind, _ in steps]
    if kinds == ["ByteLevel"] and steps[0][1].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0][1].get("individual_digits"):
        return "smollm"  # GPT-2's regex after splitting every digit apart
    if kinds == ["Split", "ByteLevel"] and not steps[1][1].get("use_regex", True):
        name = SPLIT_REGEX_PRE.get(_split_regex(steps[0][1]))
        if name:
            return name
    raise ConfigError(
        f"--to_gguf: the tokenizer's pre-tokenizer ({json.dumps(pre_tokenizer)[:300]}) is none "
        f"that llama.cpp implements under a name this exporter knows (GPT-2, SmolLM, Llama 3, "
        "Qwen2 splitting); convert the model with llama.cpp's convert_hf_to_gguf.py instead"
    )


def tokenizer_kind(spec: dict) -> str:
    """ "gpt2" for byte-level BPE, "llama" for sentencepiece-style BPE with byte fallback."""
    model = spec["model"]
    if model["type"] == "BPE" and model.get("byte_fallback"):
        uses_metaspace = any(
            s["type"] == "Metaspace" for s in _steps(spec.get("pre_tokenizer"))
        ) or any(
            s["type"] == "Replace" and s.get("content") == SENTENCEPIECE_SPACE
            for s in _steps(spec.get("normalizer"))
        )
        if uses_metaspace:
            return "llama"
    if model["type"] == "BPE" and any(
        s["type"] == "ByteLevel" for s in _steps(spec.get("pre_tokenizer"))
    ):
        return "gpt2"
    raise ConfigError(
        f"--to_gguf supports byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM) and sentencepiece-"
        f"style BPE (Llama 2, Mistral) tokenizers; this one is a {model['type']} tokenizer"
    )


def _merges(spec: dict) -> list[str]:
    """BPE merges as "left right" strings (tokenizers writes them as pairs or strings)."""
    return [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]


def looks_special(token: str) -> bool:
    """Added tokens some models forget to mark special (llama.cpp's rule)."""
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def vocabulary(tokenizer, vocab_size: int, kind: str) -> tuple[list[str], list[int]]:
    """Token strings and types for ids 0..vocab_size-1; rows the tokenizer never produces
    (embedding padding) become unused `[PAD<id>]` entries, as llama.cpp writes them."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise ConfigError(
            f"--to_gguf: the tokenizer has ids up to {max(by_id)} but the model embeds only "
            f"{vocab_size} tokens; resize the embeddings (train with the tokenizer) first"
        )
    added = tokenizer.added_tokens_decoder
    unk_id = tokenizer.unk_token_id
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if i in added and (added[i].special or looks_special(token)):
            types.append(gguf.TokenType.CONTROL)
        elif i in added:
            types.append(gguf.TokenType.USER_DEFINED)
            if kind == "llama":  # llama.cpp matches user-defined text with real spaces
                token = token.replace(SENTENCEPIECE_SPACE, " ")
        elif kind == "llama" and i == unk_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif kind == "llama" and len(token) == 6 and token.startswith("<0x") and token[-1] == ">":
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def merge_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """Sentencepiece scores: llama.cpp merges the best-scored pair first, so a token made by
    merge rank r scores -r (earlier merges win); other tokens score 0 as in Llama 2's model."""
    rank = {m.replace(" ", ""): r for r, m in reversed(list(enumerate(merges)))}
    return [-float(rank[t]) - 1.0 if t in rank else 0.0 for t in tokens]


def adds_special_tokens(tokenizer) -> tuple[bool, bool]:
    """(add_bos, add_eos): what encoding plain text with special tokens on adds."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = bos is not None and len(full) > len(plain) and full[0] == bos
    add_eos = eos is not None and len(full) > len(plain) and full[-1] == eos
    return add_bos, add_eos


def _add_special_ids(writer: gguf.GGUFWriter, tokenizer) -> None:
    for token_id, add in (
        (tokenizer.bos_token_id, writer.add_bos_token_id),
        (tokenizer.eos_token_id, writer.add_eos_token_id),
        (tokenizer.unk_token_id, writer.add_unk_token_id),
        (tokenizer.pad_token_id, writer.add_pad_token_id),
    ):
        if token_id is not None:
            add(token_id)
    # llama.cpp stops chat generation at the end-of-turn token; say which one it is when it
    # is not EOS (Llama 3's <|eot_id|>), so a chat never runs past its turn.
    end = end_of_turn_token(tokenizer)
    end_id = tokenizer.convert_tokens_to_ids(end) if end else None
    if end_id is not None and end_id not in (tokenizer.eos_token_id, tokenizer.unk_token_id):
        writer.add_eot_token_id(end_id)


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer, vocab_size: int) -> TokenizerSummary:
    """Write `tokenizer` (a transformers fast tokenizer) into `writer`'s metadata."""
    spec = _backend_json(tokenizer)
    kind = tokenizer_kind(spec)
    pre = byte_level_pre(spec.get("pre_tokenizer")) if kind == "gpt2" else "default"
    tokens, types = vocabulary(tokenizer, vocab_size, kind)
    merges = _merges(spec)
    writer.add_tokenizer_model(kind)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if kind == "llama":
        writer.add_token_scores(merge_scores(tokens, merges))
        writer.add_add_space_prefix(_adds_space_prefix(spec))
    writer.add_token_merges(merges)
    _add_special_ids(writer, tokenizer)
    add_bos, add_eos = adds_special_tokens(tokenizer)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    control = sum(t == gguf.TokenType.CONTROL for t in types)
    return TokenizerSummary(kind, pre, len(tokens), control, add_bos, add_eos)


def _adds_space_prefix(spec: dict) -> bool:
    """Whether a sentencepiece tokenizer puts "▁" before the first word."""
    for step in _steps(spec.get("pre_tokenizer")):
        if step["type"] == "Metaspace":
            return step.get("prepend_scheme", "always") != "never"
    return any(s["type"] == "Prepend" for s in _steps(spec.get("normalizer")))
