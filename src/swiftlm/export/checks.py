"""What every export checks its output with: fixed chat prompts, greedy answers, perplexity.

Each exporter compares the model it wrote, read back from disk, against the model it was
made from on the same inputs, and prints what it compared.
"""

import math
from importlib import resources
from pathlib import Path

import torch

CHECK_PROMPTS = [
    "Who are you?",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying healthy.",
    "What is 12 times 7?",
]


def heldout_text() -> str:
    """A few public-domain paragraphs no built-in dataset contains (perplexity checks)."""
    return resources.files("swiftlm").joinpath("assets/heldout.txt").read_text(encoding="utf-8")


def chat_texts(tokenizer, prompts: list[str]) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def chat_inputs(tokenizer, prompts: list[str] = CHECK_PROMPTS) -> dict:
    """The prompts in the chat template, right-padded into one batch."""
    tokenizer.padding_side = "right"
    texts = chat_texts(tokenizer, prompts)
    return tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str] = CHECK_PROMPTS, max_new_tokens=32):
    """Greedy answers, one prompt at a time (no padding, so nothing but the model varies)."""
    answers = []
    for text in chat_texts(tokenizer, prompts):
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ids = ids.to(model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


@torch.no_grad()
def perplexity(model, tokenizer, text: str | None = None, window: int = 512) -> float:
    """exp(mean next-token NLL) of `text` (default: the held-out text), in windows."""
    ids = tokenizer(text or heldout_text(), add_special_tokens=False, return_tensors="pt")
    ids = ids["input_ids"][0].to(model.device)
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1].unsqueeze(0)
        logits = model(chunk[:, :-1], use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += float(nll)
        total_tokens += chunk.shape[1] - 1
    return math.exp(total_nll / total_tokens)


def folder_bytes(folder: Path) -> int:
    """Size on disk of everything in `folder` (weights, tokenizer, config)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def quantized_input_widths(model_path: str) -> set[int]:
    """in_features of the Linear layers weight quantization touches (all but the output
    head), read from an empty (meta) model, before any weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    return {
        m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
    }
