"""Sliding-window layers in the continuous-batching engine (issue 31, item 4): greedy tokens
equal `model.generate` (which keeps a sliding cache of its own) for sequences that outgrow
the window, in a batch of mixed lengths (left padding) and with prefix-cached rows (masked
columns between a row's prefix and its rest): the window counts a row's tokens, not the
batch cache's columns."""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from conftest import build_tokenizer
from swiftlm.engine.continuous import ContinuousEngine, default_max_model_len
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.engine.speculation import Speculation

WINDOW = 8
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 40)), [100 + i for i in range(13)], [42] * 9 + [7] * 9]
SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW,
)  # fmt: skip


def qwen2_mixed(vocab: int):
    """Layer 0 full attention, layers 1-2 sliding (Qwen2's max_window_layers)."""
    config = Qwen2Config(
        vocab_size=vocab, num_hidden_layers=3, use_sliding_window=True, max_window_layers=1,
        **SHAPE,
    )  # fmt: skip
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return Qwen2ForCausalLM(config)


def mistral(vocab: int):
    """Every layer sliding, one mask for all (Mistral has no layer_types)."""
    return MistralForCausalLM(MistralConfig(vocab_size=vocab, num_hidden_layers=2, **SHAPE))


def gemma2(vocab: int):
    """Sliding and full layers alternating, Gemma 2's logit soft-capping and norms."""
    config = Gemma2Config(vocab_size=vocab, num_hidden_layers=4, head_dim=16, **SHAPE)
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"]
    return Gemma2ForCausalLM(config)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("window-tokenizer"))


def reference(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return output[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "build", [qwen2_mixed, mistral, gemma2], ids=["qwen2-mixed", "mistral", "gemma2"]
)
@pytest.mark.parametrize(
    ("cache_bytes", "speculation"),
    [(0, None), (2**24, None), (0, Speculation(tokens=5, max_rows=8))],
    ids=["no-prefix-cache", "prefix-cache", "speculative"],
)
def test_greedy_equals_generate_past_the_window(tokenizer, build, cache_bytes, speculation):
    """Speculative steps leave masked columns after a row's accepted tokens when another row
    accepted more: the window must count past them too."""
    torch.manual_seed(0)
    model = build(len(tokenizer)).eval()
    assert default_max_model_len(model) == 512  # the window no longer caps the context
    engine = ContinuousEngine(
        model, tokenizer, stop_token_ids=[2], max_num_seqs=8, prefix_cache_bytes=cache_bytes,
        speculation=speculation,
    )  # fmt: skip
    try:
        prompts = PROMPTS
        if cache_bytes:
            # A row whose 16 cached tokens are followed by 2 new ones shares its prefill with a
            # 40-token prompt: 38 masked columns lie between its prefix and its rest, far
            # more than the window, so a window counted in columns would see nothing there.
            engine.generate([GenerationRequest(PROMPTS[1][:16] + [3], GREEDY)])
            prompts = [*PROMPTS, PROMPTS[1][:16] + [9, 9], list(range(50, 90))]
        results = engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
        if speculation:
            assert engine.stats().accepted_draft_tokens > 0
        if cache_bytes:
            assert engine.stats().prefix_hit_tokens == 32  # PROMPTS[1] and the new row
    finally:
        engine.shutdown()
    for prompt, samples in zip(prompts, results, strict=True):
        assert samples[0].token_ids == reference(model, prompt), prompt


def test_the_window_changes_the_answer(tokenizer):
    """The test above could not fail if the window never mattered for these shapes: the same
    weights without the window answer differently."""
    torch.manual_seed(0)
    windowed = qwen2_mixed(len(tokenizer)).eval()
    full = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), num_hidden_layers=3,
                                        **{**SHAPE, "sliding_window": None}))  # fmt: skip
    full.load_state_dict(windowed.state_dict())
    full.eval()
    assert any(reference(windowed, p) != reference(full, p) for p in PROMPTS)
