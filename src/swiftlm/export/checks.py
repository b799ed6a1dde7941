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


def logits_within(
    got: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, atol: float, rtol: float
) -> tuple[float, bool]:
    """(max |diff|, whether every logit is within atol + rtol * |reference|: torch.allclose's
    rule), over real (mask 1) tokens only."""
    keep = mask.bool()
    got, reference = got[keep], reference[keep]
    diff = (got - reference).abs()
    return float(diff.max()), bool((diff <= atol + rtol * reference.abs()).all())


# How far a quantized folder's held-out perplexity may rise above the float32 source's, by
# bits (quantize.py: bnb, torchao; calibrated.py: GPTQ, AWQ). Measured on
# SmolLM2-135M-Instruct (source 17.93): 8 bits +0.5% (int8) to +1.5% (GPTQ); 4 bits +47%
# (bnb NF4) to +67% (torchao int4, group 64). A 135M model loses far more at 4 bits than 7B+
# ones (a few %), and this one is de-quantized from a Q4_1 GGUF, so 4 bits round it twice.
# A broken folder is far outside either margin: bnb 4-bit scales saved in the CPU-kernel
# layout read back at perplexity 3.7 million.
MAX_PPL_INCREASE = {8: 0.10, 4: 1.50}
