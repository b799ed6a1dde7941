"""Prefix caching in the continuous-batching engine (issue 31, item 2): prompts that share a
prefix prefill it once, and what they generate is what an engine without the cache
generates, token for token (greedy), whether a cached row shares its prefill group with an
uncached one or the budget forces evictions."""

import pytest
import torch

from conftest import build_tokenizer, make_tiny_llama
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.prefix_cache import BLOCK_SIZE
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.serve.metrics import GenerationMetrics

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SHARED = [
    int(t) for t in torch.randint(10, 200, (400,), generator=torch.Generator().manual_seed(0))
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("prefix-tokenizer"))
    return make_tiny_llama(len(tokenizer)).eval(), tokenizer


def start(tiny, cache_bytes: int) -> ContinuousEngine:
    model, tokenizer = tiny
    return ContinuousEngine(
        model, tokenizer, stop_token_ids=[2], max_num_seqs=16, prefix_cache_bytes=cache_bytes
    )


def answers(engine, prompts) -> list[list[int]]:
    results = engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    return [samples[0].token_ids for samples in results]


def suffixes(count: int) -> list[list[int]]:
    return [SHARED + [200 + i] * (3 + i % 5) for i in range(count)]


def test_sixteen_requests_sharing_a_prefix_prefill_it_once(tiny):
    prompts = suffixes(16)
    plain = start(tiny, 0)
    cached = start(tiny, 64 * 2**20)
    try:
        expected = answers(plain, prompts)
        first = answers(cached, prompts[:1])
        rest = answers(cached, prompts[1:])
        stats = cached.stats()
    finally:
        plain.shutdown()
        cached.shutdown()
    assert [*first, *rest] == expected
    shared_blocks = len(SHARED) // BLOCK_SIZE * BLOCK_SIZE  # whole blocks of the prefix
    assert stats.prefix_hit_tokens == 15 * shared_blocks
    total = sum(len(p) for p in prompts)
    assert stats.prefill_tokens == total - 15 * shared_blocks
    assert plain.stats().prefix_hit_tokens == 0 and plain.stats().prefill_tokens == total


def test_requests_arriving_together_wait_for_the_first_to_cache_their_prefix(tiny):
    prompts = suffixes(16)
    cached = start(tiny, 64 * 2**20)
    try:
        together = answers(cached, prompts)
        stats = cached.stats()
    finally:
        cached.shutdown()
    shared_blocks = len(SHARED) // BLOCK_SIZE * BLOCK_SIZE
    assert stats.prefix_hit_tokens == 15 * shared_blocks
    assert stats.prefill_tokens == sum(len(p) for p in prompts) - 15 * shared_blocks
    plain = start(tiny, 0)
    try:
        assert together == answers(plain, prompts)
    finally:
        plain.shutdown()


def test_a_short_common_start_is_not_worth_waiting_for(tiny):
    """Two prompts that share only 32 tokens (a chat template's opening) are prefilled in
    one group: waiting a whole prefill would cost more than those tokens."""
    engine = start(tiny, 64 * 2**20)
    try:
        prompts = [SHARED[:32] + [5] * 40, SHARED[:32] + [6] * 40]
        answers(engine, prompts)
        assert engine.stats().prefix_hit_tokens == 0
        assert engine.stats().prefill_tokens == 144
    finally:
        engine.shutdown()


def test_the_samples_of_one_request_share_its_prefill(tiny):
    """GRPO's G completions of a prompt: one request with n samples prefills it once."""
    engine = start(tiny, 0)
    try:
        params = SamplingParams(max_tokens=4, temperature=1.0, n=8, seed=3)
        samples = engine.generate([GenerationRequest(SHARED[:50], params)])[0]
        assert len(samples) == 8 and engine.stats().prefill_tokens == 50
    finally:
        engine.shutdown()


def test_a_cached_row_and_an_uncached_row_in_one_prefill_group(tiny):
    """The cached row's rest starts after masked columns (its prefix is shorter than the
    group's width): its answer must not change."""
    long_new = [int(t) for t in torch.randint(10, 200, (90,))]
    plain, cached = start(tiny, 0), start(tiny, 64 * 2**20)
    try:
        warm = SHARED[:160] + [7, 8, 9]
        answers(cached, [warm])
        group = [SHARED[:160] + [11, 12], long_new, SHARED[:48] + [5] * 40]
        assert answers(cached, group) == answers(plain, group)
        assert cached.stats().prefix_hit_tokens == 160 + 48
    finally:
        plain.shutdown()
        cached.shutdown()


def test_a_chat_that_resends_its_history_reuses_it(tiny):
    plain, cached = start(tiny, 0), start(tiny, 64 * 2**20)
    try:
        turn1 = SHARED[:100]
        reply = answers(cached, [turn1])[0]
        turn2 = turn1 + reply + [30, 31, 32]
        assert answers(cached, [turn2]) == answers(plain, [turn2])
        assert cached.stats().prefix_hit_tokens == 96  # turn 1's whole blocks
        scraped = GenerationMetrics(cached).render().decode()
        assert "swiftlm_prefix_cache_hit_tokens_total 96.0" in scraped
        prefilled = len(turn1) + len(turn2) - 96
        assert f"swiftlm_prefill_tokens_total {float(prefilled)}" in scraped
    finally:
        plain.shutdown()
        cached.shutdown()


def test_a_small_budget_evicts_and_answers_stay_the_same(tiny):
    plain, cached = start(tiny, 0), start(tiny, 40_000)  # a few blocks of this model
    try:
        prompts = suffixes(4)
        for prompt in prompts:
            assert answers(cached, [prompt]) == answers(plain, [prompt])
        cache = cached.scheduler.prefix_cache
        assert cache.evicted_blocks > 0 and cache.used_bytes <= 40_000
    finally:
        plain.shutdown()
        cached.shutdown()
