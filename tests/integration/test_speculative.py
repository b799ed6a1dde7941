"""Prompt-lookup speculative decoding in the continuous-batching engine (issue 31, item 3):
what an engine that speculates generates is what one that does not generates, token for
token (greedy, seeded sampling with penalties, log-probs, stop strings, grammars), in fewer
forwards, with its draft tokens counted."""

from dataclasses import replace

import pytest
import torch

from conftest import build_tokenizer, make_tiny_llama
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.engine.speculation import Speculation
from swiftlm.serve.metrics import GenerationMetrics
from tolerance import assert_close, forward_terms

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
# Prompts that repeat themselves (drafts find matches) and one that does not.
PROMPTS = [[5, 6, 7, 8] * 6, list(range(10, 40)), [42] * 12, [7, 9, 11, 7, 9, 11, 7, 9]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("speculative-tokenizer"))
    return make_tiny_llama(len(tokenizer)).eval(), tokenizer


def start(tiny, speculation: Speculation | None) -> ContinuousEngine:
    model, tokenizer = tiny
    return ContinuousEngine(
        model, tokenizer, stop_token_ids=[2], max_num_seqs=8, speculation=speculation
    )


def run_both(tiny, requests, speculation=Speculation(tokens=5)):
    """(plain results, speculative results, the speculative engine's stats)."""
    plain, speculative = start(tiny, None), start(tiny, speculation)
    try:
        expected = plain.generate(requests)
        got = speculative.generate(requests)
        return expected, got, speculative.stats()
    finally:
        plain.shutdown()
        speculative.shutdown()


def tokens(results) -> list[list[int]]:
    return [sample.token_ids for samples in results for sample in samples]


def test_greedy_output_equals_plain_decoding_and_drafts_are_accepted(tiny):
    requests = [GenerationRequest(p, GREEDY) for p in PROMPTS]
    expected, got, stats = run_both(tiny, requests)
    assert tokens(got) == tokens(expected)
    assert all(len(t) == 40 for t in tokens(got))
    assert [s.finish_reason for r in got for s in r] == ["length"] * len(PROMPTS)
    # The tiny model repeats itself, so drafts hit: without acceptance this test proves nothing.
    assert stats.draft_tokens > 0
    assert 0 < stats.accepted_draft_tokens <= stats.draft_tokens


def test_one_stream_takes_fewer_forwards_than_tokens(tiny):
    engine = start(tiny, Speculation(tokens=5))
    try:
        engine.generate([GenerationRequest(PROMPTS[0], GREEDY)])
        counters = engine.scheduler.speculated
    finally:
        engine.shutdown()
    accepted = engine.stats().accepted_draft_tokens
    # Every token after the first (sampled at prefill) came from a speculative step or a
    # plain one; accepted draft tokens needed no forward of their own.
    assert counters.steps > 0 and accepted > 0
    assert counters.steps + accepted <= 39


@pytest.mark.numerics
def test_seeded_sampling_with_penalties_and_logprobs_equals_plain_decoding(tiny):
    params = SamplingParams(
        max_tokens=32,
        temperature=0.25,
        top_k=20,
        repetition_penalty=1.05,
        frequency_penalty=0.05,
        seed=11,
        n=2,
        logprobs=True,
        top_logprobs=3,
        ignore_eos=True,
    )
    requests = [GenerationRequest(p, params) for p in PROMPTS[:2]]
    expected, got, stats = run_both(tiny, requests)
    assert tokens(got) == tokens(expected)
    assert stats.accepted_draft_tokens > 0
    prompts = [r.prompt_ids for r in requests for _ in range(params.n)]
    plain_samples = [s for r in expected for s in r]
    speculative_samples = [s for r in got for s in r]
    for prompt, plain, speculative in zip(prompts, plain_samples, speculative_samples, strict=True):
        assert [lp.token_id for lp in speculative.logprobs] == plain.token_ids
        with torch.inference_mode():
            logits = tiny[0](torch.tensor([prompt + plain.token_ids])).logits
        # A log-prob from a forward over 1 column or over 6: equal up to the rounding of that
        # forward's sums, which a log-softmax carries at its logits' size.
        assert_close(
            [lp.logprob for lp in speculative.logprobs],
            [lp.logprob for lp in plain.logprobs],
            terms=forward_terms(tokens=len(prompt) + params.max_tokens),
            magnitude=logits.abs().max().item(),
        )


def test_stop_strings_and_end_tokens_end_answers_where_plain_decoding_does(tiny):
    tokenizer = tiny[1]
    plain = [GenerationRequest(p, replace(GREEDY, max_tokens=30)) for p in PROMPTS]
    expected = tokens(run_both(tiny, plain)[0])
    # Stop on the text of a token each answer writes midway, and on a token id of another.
    stop_text = tokenizer.decode(expected[0][10:12])
    requests = [
        GenerationRequest(PROMPTS[0], replace(GREEDY, max_tokens=30, stop=(stop_text,))),
        GenerationRequest(PROMPTS[2], replace(GREEDY, max_tokens=30, stop_token_ids=(expected[2][7],))),
        GenerationRequest(PROMPTS[3], replace(GREEDY, max_tokens=3)),
    ]  # fmt: skip
    expected, got, _ = run_both(tiny, requests)
    assert [(s.token_ids, s.text, s.finish_reason) for r in got for s in r] == [
        (s.token_ids, s.text, s.finish_reason) for r in expected for s in r
    ]
    assert [s.finish_reason for r in got for s in r] == ["stop", "stop", "length"]
    assert len(got[2][0].token_ids) == 3


def test_a_batch_larger_than_max_rows_decodes_plainly_and_equally(tiny):
    requests = [GenerationRequest(p, GREEDY) for p in PROMPTS * 2]  # 8 rows, max_rows 2
    expected, got, stats = run_both(tiny, requests, Speculation(tokens=4, max_rows=2))
    assert tokens(got) == tokens(expected)
    # Rows finish together, so no step ever had 2 rows or fewer: nothing was speculated.
    assert stats.draft_tokens == 0


def test_rows_accepting_different_draft_lengths_share_steps(tiny):
    """Two rows, one whose drafts keep hitting and one whose prompt has no repeats: masked
    columns after the shorter row's tokens must not leak into its attention."""
    requests = [
        GenerationRequest(PROMPTS[2], GREEDY),
        GenerationRequest(PROMPTS[1], replace(GREEDY, max_tokens=25)),
    ]
    expected, got, stats = run_both(tiny, requests, Speculation(tokens=6, max_rows=2))
    assert tokens(got) == tokens(expected)
    assert stats.accepted_draft_tokens > 0


def test_metrics_expose_draft_and_accepted_tokens(tiny):
    engine = start(tiny, Speculation(tokens=5))
    try:
        engine.generate([GenerationRequest(PROMPTS[0], GREEDY)])
        text = GenerationMetrics(engine).render().decode()
    finally:
        engine.shutdown()
    stats = engine.stats()
    assert f"swiftlm_spec_draft_tokens_total {float(stats.draft_tokens)}" in text
    assert f"swiftlm_spec_accepted_tokens_total {float(stats.accepted_draft_tokens)}" in text


@pytest.mark.parametrize(
    ("history", "limit", "draft"),
    [
        ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 5, [8, 1, 2, 3, 8]),  # the most recent occurrence
        ([1, 2, 3, 4, 5, 6, 2, 3], 2, [4, 5]),  # at most `limit` tokens
        ([5, 1, 7, 7, 1], 5, [7, 7, 1, 7, 7]),  # the last token alone; the copy runs on
        ([1, 2, 3, 4], 5, []),  # nothing repeats
        ([4, 4, 4, 4], 3, [4, 4, 4]),  # a run continues as the run
        ([8, 1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),  # a loop continues as the loop
    ],
)
def test_prompt_lookup_proposes_what_followed_the_last_ngram(history, limit, draft):
    assert Speculation(tokens=5, max_ngram=3).propose(history, limit) == draft


def test_speculation_refuses_settings_below_one():
    with pytest.raises(ValueError, match="positive"):
        Speculation(tokens=0)


def test_grammar_constrained_rows_equal_plain_decoding(tiny):
    """The grammar's mask at each checked position is the one after the tokens accepted
    before it; a draft token the grammar forbids is simply never sampled."""
    pytest.importorskip("xgrammar")
    from swiftlm.engine.grammar import Grammars

    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}}, "required": ["tags"]}  # fmt: skip
    constraint = Grammars(tiny[1], [2]).json_schema(schema)
    params = SamplingParams(max_tokens=60, temperature=0.3, seed=5, n=2)
    requests = [GenerationRequest(p, params, constraint=constraint) for p in PROMPTS[:2]]
    expected, got, stats = run_both(tiny, requests)
    assert [(s.token_ids, s.finish_reason) for r in got for s in r] == [
        (s.token_ids, s.finish_reason) for r in expected for s in r
    ]
    assert stats.accepted_draft_tokens > 0


def test_learned_positions_stay_in_range_at_the_context_end(tiny):
    """GPT-2 embeds positions from a table of n_positions rows. A row's masked padding columns
    in a speculative step keep to its last real position, so a row one token before the end
    of the context (no room for a draft) shares a step with a row drafting 6 tokens without
    leaving the table."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tiny[1]), n_positions=48, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # every answer is token 9 after token 9: every draft is accepted
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(model.transformer.wte.weight[9] * 10)
    # Both rows have 1 token after prefill, 2 after a plain step (a lone 9 has no earlier
    # occurrence), then 9 and 16 after two steps of 6 accepted tokens and one sampled. There
    # row 0 is at position 46 with room for no draft, row 1 drafts 6.
    requests = [
        GenerationRequest(list(range(10, 41)), replace(GREEDY, max_tokens=17)),
        GenerationRequest([5, 6] * 4, replace(GREEDY, max_tokens=40)),
    ]
    engine = ContinuousEngine(model, tiny[1], stop_token_ids=[2], speculation=Speculation(6))
    try:
        got = tokens(engine.generate(requests))
    finally:
        engine.shutdown()
    assert got == [[9] * 17, [9] * 40]
