"""Build the benchmark's model, tokenizer and data, deterministically, with no network.

    .venv/bin/python benchmarks/frameworks/make_assets.py [--out DIR] [--corpus DIR] [--seed 42]

Writes into DIR (default benchmarks/frameworks/.assets/):
  tokenizer + model   one Hugging Face folder (`model/`): a byte-level BPE tokenizer (16,384
                      tokens) trained here with `tokenizers` on the chatterbot-corpus text (all
                      28 languages: English alone has too few distinct words for 16k merges),
                      ChatML chat template, eos `<|im_end|>`, pad `<|endoftext|>`; and a
                      LlamaForCausalLM (hidden 768, 12 layers, 12 heads, MLP 2048, untied
                      embeddings: ~110M parameters) with seeded random weights, float32
                      safetensors.
  train.jsonl         2,000 chat samples ({"messages": [user, assistant, ...]}): 60% single
                      turn, 40% two or three turns, built from corpus question/answer pairs with
                      a target length drawn from 50 + 450 * Beta(1.5, 1.5) tokens (mean ~300 after
                      filling); a few percent run past 512 tokens, which exercises right-truncation.
  manifest.json       the settings, the length statistics and a SHA-256 of every file.

The corpus comes from the PyPI package chatterbot-corpus, which setup_envs.sh installs into
.venvs/corpus. Needs torch, transformers, tokenizers and PyYAML (swiftlm's .venv has them).
"""

import argparse
import hashlib
import json
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / ".assets"
DEFAULT_CORPUS = HERE / ".venvs" / "corpus" / "chatterbot_corpus" / "data"

VOCAB_SIZE = 16384
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
NUM_SAMPLES = 2000
MODEL_CONFIG = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    intermediate_size=2048,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
)

# ChatML. The assistant content and its <|im_end|> sit inside {% generation %} markers so that
# TRL's assistant_only_loss (return_assistant_tokens_mask) trains exactly the tokens that
# swiftlm and ms-swift train: the answer plus the closing <|im_end|>, not the newline after it.
# The markers render nothing, so every framework sees the same text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def load_corpus(corpus_dir: Path) -> dict[str, list[tuple[str, str]]]:
    """(question, answer) pairs per language, from consecutive statements of each dialog."""
    import yaml

    files = sorted(corpus_dir.glob("*/*.yml"))
    if not files:
        sys.exit(
            f"make_assets: no chatterbot-corpus data under {corpus_dir}. Install it with "
            "`bash benchmarks/frameworks/setup_envs.sh corpus` or pass --corpus DIR."
        )
    pairs: dict[str, list[tuple[str, str]]] = {}
    for path in files:
        dialogs = yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations") or []
        for dialog in dialogs:
            lines = [str(line).strip() for line in dialog if str(line).strip()]
            pairs.setdefault(path.parent.name, []).extend(zip(lines[:-1], lines[1:], strict=True))
    return pairs


def train_tokenizer(texts: list[str]):
    """Byte-level BPE (the GPT-2 / Llama 3 / Qwen2 kind) wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def target_lengths(rng: random.Random) -> list[int]:
    """Token budget per sample: 50..500, mean 275; filling overshoots it by ~25 tokens."""
    return [int(50 + 450 * rng.betavariate(1.5, 1.5)) for _ in range(NUM_SAMPLES)]


def build_samples(tokenizer, pairs: dict, seed: int) -> list[dict]:
    """Conversations whose rendered length approaches each sample's token budget.

    A turn's answer is its pair's answer followed by more answers of the same language until
    the turn's share of the budget is used, so lengths vary smoothly.
    """
    rng = random.Random(seed)
    languages = sorted(pairs)
    weights = [len(pairs[lang]) for lang in languages]
    cost_cache: dict[str, int] = {}

    def cost(text: str) -> int:
        if text not in cost_cache:
            cost_cache[text] = len(tokenizer(" " + text, add_special_tokens=False)["input_ids"])
        return cost_cache[text]

    samples = []
    for budget in target_lengths(rng):
        language = rng.choices(languages, weights)[0]
        pool = pairs[language]
        turns = 1 if rng.random() < 0.6 else rng.choice((2, 3))
        per_turn = budget // turns
        messages = []
        for _ in range(turns):
            question, answer = rng.choice(pool)
            used = 6 + cost(question) + cost(answer)  # 6: the ChatML markers of a turn pair
            parts = [answer]
            while used < per_turn:
                extra = rng.choice(pool)[1]
                parts.append(extra)
                used += cost(extra)
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": " ".join(parts)},
            ]
        samples.append({"messages": messages})
    return samples


def length_stats(tokenizer, samples: list[dict]) -> dict:
    """Tokens per sample and assistant (label) tokens per sample under the ChatML template."""
    totals, labels = [], []
    for sample in samples:
        encoded = tokenizer.apply_chat_template(
            sample["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        totals.append(len(encoded["input_ids"]))
        labels.append(sum(encoded["assistant_masks"]))
    clipped = [min(t, 512) for t in totals]
    return {
        "samples": len(samples),
        "single_turn": sum(len(s["messages"]) == 2 for s in samples),
        "tokens_mean": round(statistics.mean(totals), 1),
        "tokens_median": statistics.median(totals),
        "tokens_min": min(totals),
        "tokens_max": max(totals),
        "over_512": sum(t > 512 for t in totals),
        "tokens_mean_at_max_length_512": round(statistics.mean(clipped), 1),
        "label_tokens_mean": round(statistics.mean(labels), 1),
    }


def build_model(vocab_size: int, tokenizer, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **MODEL_CONFIG,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def put_template_in_config(folder: Path) -> None:
    """Newer transformers save the template as chat_template.jinja; older ones (and some
    frameworks' own loaders) read it from tokenizer_config.json, so it goes in both."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def file_hashes(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    pairs = load_corpus(args.corpus)
    texts = [text for lang in sorted(pairs) for pair in pairs[lang] for text in pair]
    tokenizer = train_tokenizer(texts)
    model_dir = args.out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(model_dir)
    put_template_in_config(model_dir)

    model = build_model(len(tokenizer), tokenizer, args.seed)
    model.save_pretrained(model_dir, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())

    samples = build_samples(tokenizer, pairs, args.seed)
    with open(args.out / "train.jsonl", "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")

    stats = length_stats(tokenizer, samples)
    manifest = {
        "seed": args.seed,
        "vocab_size": len(tokenizer),
        "parameters": n_params,
        "model_config": MODEL_CONFIG,
        "data": stats,
        "files": file_hashes(args.out),
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"assets in {args.out}: vocab {len(tokenizer)}, {n_params / 1e6:.1f}M parameters")
    print("data: " + ", ".join(f"{k} {v}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
