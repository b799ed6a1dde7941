"""The GGUF export's self-check: the file read back by the `gguf` reader and by transformers,
compared with the source model it was written from (`export/gguf.py` writes it).

- every tensor is present with the planned name, shape and type (gguf.GGUFReader);
- the tokenizer transformers rebuilds from the file encodes the chat prompts and the held-out
  text to the same ids as the source tokenizer;
- the model transformers rebuilds (de-quantized, float32) against the source in float32:
  max |logit| difference, greedy answers to the fixed prompts (required equal for
  ANSWERS_MUST_MATCH) and held-out perplexity (required within PERPLEXITY_MARGINS).
"""

from typing import TYPE_CHECKING

import gguf
import torch

from swiftlm.errors import ExportCheckError
from swiftlm.export.checks import (
    CHECK_PROMPTS,
    PerplexityComparison,
    chat_inputs,
    chat_texts,
    compare_answers,
    compare_logits,
    forward_logits,
    heldout_text,
    perplexity,
)
from swiftlm.models.loader import quiet_gguf_reading

if TYPE_CHECKING:
    from swiftlm.export.gguf import WrittenFile

# Greedy answers must equal the source's for these types. f16 moves a weight by at most 2^-11 of
# itself, which left all 5 x 32 greedy tokens unchanged on SmolLM2-135M and on the test models.
# bf16 keeps only 2^-8: it changed one of the five SmolLM2 answers (a late near-tie token), so
# there the answers are reported, not required.
ANSWERS_MUST_MATCH = ("f32", "f16")

# Largest relative change of held-out perplexity, |ppl_gguf / ppl_source - 1|, per type.
# Measured on SmolLM2-135M-Instruct (source ppl 17.93) / on the tiny test Llama:
#   f32 0.00% / 0.00%   f16 +0.02% / +0.01%   bf16 -0.04% / 0.00%   q8_0 +0.57% / -0.11%
#   q5_1 +18.2% / +0.7%  q5_0 +18.3% / +0.1%   q4_1 0.00% / +2.2%    q4_0 +23.2% / +0.5%
# The packaged SmolLM2 is itself a Q4_1 file: its weights sit on Q4_1's grid, so q4_1 rewrites
# them exactly (the tensors come out byte-identical to the llama.cpp-made file) while the
# 5-bit grids do not line up with it and lose almost as much as q4_0; a model trained in
# bf16 loses far less at 5 bits. Each margin is about twice the worst measured change, and a
# broken file is far outside it: written without the Q/K permutation, SmolLM2's perplexity
# goes from 17.9 to 516.
PERPLEXITY_MARGINS = {
    "f32": 0.0001,
    "f16": 0.002,
    "bf16": 0.01,
    "q8_0": 0.015,
    "q5_1": 0.35,
    "q5_0": 0.35,
    "q4_1": 0.5,
    "q4_0": 0.5,
}


def verify_tensors(written: "WrittenFile") -> None:
    """Every planned tensor is in the file with its name, shape and type, and nothing else."""
    reader = gguf.GGUFReader(written.path)
    found = {
        t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name)
        for t in reader.tensors
    }
    planned = {t.name: (t.shape, t.qtype) for t in written.tensors}
    wrong = [
        f"{name}: planned {want}, found {found.get(name, 'nothing')}"
        for name, want in planned.items()
        if found.get(name) != want
    ]
    wrong += [f"{name}: not planned" for name in found.keys() - planned.keys()]
    if wrong:
        raise ExportCheckError(
            f"{written.path} read back with gguf.GGUFReader differs from what was written: "
            + "; ".join(wrong[:5])
        )
    print(f"  read back {len(found)} tensors: names, shapes and types as written")


def _pre_rebuilt_by_transformers(pre: str) -> bool:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    # pre-tokenizers transformers has no regex for are rebuilt with GPT-2's
    return pre in GGUF_PRE_TOKENIZER_SPLITS or pre in ("gpt-2", "default")


def verify_tokenizer(written: "WrittenFile", source_tokenizer) -> bool:
    """The tokenizer transformers rebuilds from the file encodes like the source; returns
    whether the ids matched (raises unless the mismatch is transformers' own limitation)."""
    from transformers import AutoTokenizer

    rebuilt = AutoTokenizer.from_pretrained(written.path.parent, gguf_file=written.path.name)
    texts = chat_texts(source_tokenizer, CHECK_PROMPTS) + [heldout_text()]
    differing = [
        text[:40]
        for text in texts
        if rebuilt(text, add_special_tokens=False)["input_ids"]
        != source_tokenizer(text, add_special_tokens=False)["input_ids"]
    ]
    plain = heldout_text()[:200]
    if rebuilt(plain)["input_ids"] != source_tokenizer(plain)["input_ids"]:
        differing.append("special tokens added to plain text (add_bos/add_eos)")
    if rebuilt.chat_template != source_tokenizer.chat_template:
        differing.append("chat template")
    pre = written.tokenizer.pre
    if differing and not _pre_rebuilt_by_transformers(pre):
        print(
            f"  tokenizer: transformers cannot rebuild llama.cpp's {pre!r} pre-tokenizer from a "
            f"GGUF, so its ids differ on {len(differing)} text(s); llama.cpp implements it"
        )
        return False
    if differing:
        raise ExportCheckError(
            f"the tokenizer read back from {written.path.name} encodes differently from the "
            f"source: {'; '.join(repr(d) for d in differing[:3])}"
        )
    print(
        f"  tokenizer ({written.tokenizer.model}, pre {pre!r}): the {len(texts) - 1} chat-templated "
        "check prompts and the held-out text encode to the same ids; chat template and "
        "add_bos/add_eos equal"
    )
    return True


def load_back(written: "WrittenFile", source_config, rope_scaled: bool):
    """The model transformers rebuilds from the file, de-quantized to float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where, filename = written.path.parent, written.path.name
    config = AutoConfig.from_pretrained(where, gguf_file=filename)
    if rope_scaled:
        # transformers' GGUF reader ignores rope scaling metadata; give it the source's so the
        # comparison measures the weights (llama.cpp reads the scaling from the file)
        config.rope_parameters = source_config.rope_parameters
        print("  (rope scaling copied onto the read-back config: transformers does not read it)")
    with quiet_gguf_reading():
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=filename, config=config, dtype=torch.float32
        )
    return model.eval()


def compare_models(
    written: "WrittenFile", source_model, tokenizer, gguf_type: str, rope_scaled: bool
) -> dict:
    """Source vs file on the same token ids: logits, greedy answers, held-out perplexity."""
    model = load_back(written, source_model.config, rope_scaled)
    inputs = chat_inputs(tokenizer)
    logits = compare_logits(
        forward_logits(model, inputs),
        forward_logits(source_model, inputs),
        inputs["attention_mask"],
    )
    answers = compare_answers(model, source_model, tokenizer)
    ppl = PerplexityComparison(
        perplexity(source_model, tokenizer),
        perplexity(model, tokenizer),
        PERPLEXITY_MARGINS[gguf_type],
        f"for {gguf_type}",
        either_way=True,
    )
    print(
        f"  model (float32, same ids): max |logit diff| {logits.max_abs_diff:.2e}; greedy answers "
        f"{answers.matching}/{len(answers.got)} equal; {ppl.describe()}"
    )
    if gguf_type in ANSWERS_MUST_MATCH:
        answers.require(f"the {gguf_type} GGUF", str(written.path))
    ppl.require(f"the {gguf_type} GGUF", f"{written.path} is not faithful")
    return {
        "max_abs_logit_diff": logits.max_abs_diff,
        "answers_match": not answers.differing,
        "answers_matching": answers.matching,
        "perplexity_source": ppl.source,
        "perplexity_gguf": ppl.exported,
    }
