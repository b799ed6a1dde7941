"""A seeded Llama of a given shape with the packaged SmolLM2 tokenizer (its 49,152-token
vocabulary, tied embeddings), saved once into a folder: the model of benchmarks that need
sizes the packaged model does not have (heads that divide, fewer layers)."""

from pathlib import Path

import torch


def save_seeded_llama(folder: Path, **shape) -> Path:
    """`shape`: LlamaConfig sizes (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, max_position_embeddings). Kept if saved."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from swiftlm.models.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **shape,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
