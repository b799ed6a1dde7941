"""The continuous-batching engine against plain transformers on a tiny float32 Llama:
greedy tokens equal `model.generate`, whatever shares the batch and whenever a request joins."""

import threading
import time
from dataclasses import replace

import pytest
import torch

from conftest import build_tokenizer, make_tiny_llama
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.protocol import EngineStats, GenerationRequest, SamplingParams
from tolerance import assert_close, forward_terms

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 40)), [100, 101, 102, 103, 104, 105, 106], [42] * 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("engine-tokenizer"))
    model = make_tiny_llama(len(tokenizer)).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(tiny):
    model, tokenizer = tiny
    engine = ContinuousEngine(model, tokenizer, stop_token_ids=[2], max_num_seqs=8)
    yield engine
    engine.shutdown()


def reference(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return output[0, len(prompt) :].tolist()


def run_one(engine, prompt, params=GREEDY, **fields):
    return engine.generate([GenerationRequest(prompt, params, **fields)])[0]


def test_greedy_equals_generate_for_mixed_lengths(engine, tiny):
    results = engine.generate([GenerationRequest(p, GREEDY) for p in PROMPTS])
    for prompt, samples in zip(PROMPTS, results, strict=True):
        assert samples[0].token_ids == reference(tiny[0], prompt, 24)
        assert samples[0].finish_reason == "length"


def test_repetition_penalty_equals_generate(engine, tiny):
    params = replace(GREEDY, repetition_penalty=1.5)
    sample = engine.generate([GenerationRequest(PROMPTS[3], params)])[0][0]
    with torch.inference_mode():
        expected = tiny[0].generate(
            torch.tensor([PROMPTS[3]]),
            max_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.5,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPTS[3]) :]
    assert sample.token_ids == expected.tolist()
    assert sample.token_ids != reference(tiny[0], PROMPTS[3], 24)


def test_requests_joining_mid_generation_get_the_same_tokens(engine, tiny):
    started = threading.Event()
    long_deltas, collected = [], {}

    def on_long(delta):
        long_deltas.append(delta)
        if len(long_deltas) == 5:
            started.set()

    long_params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine.submit(GenerationRequest(PROMPTS[1], long_params, request_id="long"), on_long)
    assert started.wait(30)
    joined = engine.generate([GenerationRequest(p, GREEDY) for p in (PROMPTS[0], PROMPTS[2])])
    while not long_deltas[-1].finish_reason:
        time.sleep(0.01)
    collected["long"] = [t for d in long_deltas for t in d.token_ids]
    assert len(long_deltas) > 5  # the others joined while it ran
    assert collected["long"] == reference(tiny[0], PROMPTS[1], 60)
    assert joined[0][0].token_ids == reference(tiny[0], PROMPTS[0], 24)
    assert joined[1][0].token_ids == reference(tiny[0], PROMPTS[2], 24)


def test_a_short_request_answers_before_a_long_one_ends(engine):
    events = []
    long_params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    engine.submit(
        GenerationRequest(PROMPTS[0], long_params),
        lambda d: d.finish_reason and events.append("long done"),
    )
    while engine.stats().running == 0:
        time.sleep(0.001)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    run_one(engine, PROMPTS[2], short)
    events.append("short done")
    while "long done" not in events:
        time.sleep(0.01)
    assert events == ["short done", "long done"]


def test_seeded_samples_do_not_depend_on_the_batch(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=2)
    alone = run_one(engine, PROMPTS[0], params)
    crowd = engine.generate(
        [GenerationRequest(p, SamplingParams(max_tokens=16, temperature=0.7)) for p in PROMPTS]
        + [GenerationRequest(PROMPTS[0], params)]
    )[-1]
    assert [s.token_ids for s in alone] == [s.token_ids for s in crowd]
    assert alone[0].token_ids != alone[1].token_ids
    # Sample i uses seed + i.
    next_seed = run_one(engine, PROMPTS[0], SamplingParams(max_tokens=16, seed=6))
    assert next_seed[0].token_ids == alone[1].token_ids


def test_n_greedy_samples_share_the_prompt(engine, tiny):
    samples = run_one(engine, PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, n=3))
    assert [s.index for s in samples] == [0, 1, 2]
    assert all(s.token_ids == reference(tiny[0], PROMPTS[1], 8) for s in samples)


@pytest.mark.numerics
def test_logprobs_are_log_softmax_of_the_raw_logits(engine, tiny):
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    sample = run_one(engine, PROMPTS[2], params)[0]
    with torch.inference_mode():
        ids = torch.tensor([PROMPTS[2] + sample.token_ids])
        logits = tiny[0](ids).logits[0]
    logprobs = logits.log_softmax(-1)
    size = logits.abs().max().item()  # a log-softmax rounds as its logits do
    start = len(PROMPTS[2]) - 1
    for step, entry in enumerate(sample.logprobs):
        expected = logprobs[start + step]
        assert entry.token_id == sample.token_ids[step]
        # the engine's cached, incremental forward against one forward over the whole text
        want = float(expected[entry.token_id])
        assert_close(entry.logprob, want, terms=forward_terms(tokens=ids.shape[1]), magnitude=size)
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True) and len(values) == 3
        assert entry.top[0][0] == entry.token_id  # greedy: the chosen token is the argmax


def test_stop_strings_cut_the_text_across_tokens(engine):
    full = run_one(engine, PROMPTS[1])[0].text
    stop = full[5:9]
    assert len(stop) == 4
    sample = run_one(
        engine, PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, stop=(stop,))
    )[0]
    assert sample.finish_reason == "stop"
    assert sample.text == full[: full.index(stop)]


def test_stop_token_ids_end_the_sample_without_text(engine):
    full = run_one(engine, PROMPTS[0])[0]
    stop_id = full.token_ids[3]
    params = replace(GREEDY, stop_token_ids=(stop_id,))  # ignore_eos keeps these
    sample = run_one(engine, PROMPTS[0], params)[0]
    first = full.token_ids.index(stop_id)
    assert sample.finish_reason == "stop"
    assert sample.token_ids == full.token_ids[: first + 1]


def test_abort_frees_the_slot(engine):
    deltas = []
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    engine.submit(GenerationRequest(PROMPTS[0], params, request_id="gone"), deltas.append)
    while not deltas:
        time.sleep(0.001)
    engine.abort("gone")
    deadline = time.monotonic() + 10
    while not deltas[-1].finish_reason and time.monotonic() < deadline:
        time.sleep(0.001)
    assert deltas[-1].finish_reason == "abort"
    assert len(deltas) < 400
    assert engine.stats().running == 0
    engine.abort("gone")  # unknown or finished ids are ignored


def test_context_limit_and_bad_requests(tiny):
    model, tokenizer = tiny
    engine = ContinuousEngine(model, tokenizer, stop_token_ids=[2], max_model_len=40)
    try:
        fits = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        sample = run_one(engine, PROMPTS[1], fits)[0]  # 30 + 10 tokens: exactly the context
        assert (len(sample.token_ids), sample.finish_reason) == (10, "length")
        with pytest.raises(ValueError, match="max_tokens 11.*max_model_len 40"):
            engine.submit(GenerationRequest(PROMPTS[1], SamplingParams(max_tokens=11)), print)
        with pytest.raises(ValueError, match="top_p"):
            engine.submit(GenerationRequest(PROMPTS[0], SamplingParams(top_p=0)), print)
        with pytest.raises(ValueError, match="adapter 'nope'"):
            engine.submit(GenerationRequest(PROMPTS[0], fits, adapter="nope"), print)
        with pytest.raises(ValueError, match="prompt"):
            engine.submit(GenerationRequest([10**9], fits), print)
        assert engine.stats().waiting == 0
    finally:
        engine.shutdown()


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny):
    model, tokenizer = tiny
    engine = ContinuousEngine(model, tokenizer, stop_token_ids=[2], prefill_chunk_tokens=32)
    try:
        running, seen_at_first_token = [], []
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        engine.submit(GenerationRequest(PROMPTS[0], params, request_id="stream"), running.append)
        while not running:
            time.sleep(0.001)
        submitted_at = len(running)
        long_prompt = list(range(3, 300))  # 297 tokens: 10 chunks of 32
        engine.generate(
            [GenerationRequest(long_prompt, SamplingParams(max_tokens=1, temperature=0))]
        )
        seen_at_first_token.append(len(running))
        engine.abort("stream")
        # One chunk per step, each step also decoding the stream: it got ~10 tokens meanwhile.
        assert seen_at_first_token[0] - submitted_at >= 9
    finally:
        engine.shutdown()


def test_aborting_a_waiting_request_ends_it_without_running(tiny):
    model, tokenizer = tiny
    engine = ContinuousEngine(model, tokenizer, stop_token_ids=[2], max_num_seqs=1)
    try:
        first, second = [], []
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        engine.submit(GenerationRequest(PROMPTS[0], params, request_id="first"), first.append)
        engine.submit(GenerationRequest(PROMPTS[1], params, request_id="second"), second.append)
        while not first:
            time.sleep(0.001)
        assert engine.stats() == EngineStats(
            running=1, waiting=1, max_num_seqs=1, max_model_len=512,
            prefill_tokens=len(PROMPTS[0]),  # the second one has not been prefilled
        )  # fmt: skip
        engine.abort("second")
        while not second:
            time.sleep(0.001)
        assert [(d.token_ids, d.finish_reason) for d in second] == [((), "abort")]
        assert engine.stats().waiting == 0
        engine.abort("first")
    finally:
        engine.shutdown()


def test_churn_of_joins_and_finishes_keeps_every_row_exact(tiny):
    """Requests of random lengths arrive over time into 4 slots: rows join, wait, finish and
    leave in every order; each still gets exactly its own greedy tokens."""
    model, tokenizer = tiny
    engine = ContinuousEngine(
        model, tokenizer, stop_token_ids=[2], max_num_seqs=4, prefill_chunk_tokens=16
    )
    generator = torch.Generator().manual_seed(3)
    cases = []
    for _ in range(10):
        length = int(torch.randint(1, 40, (1,), generator=generator))
        prompt = torch.randint(3, len(tokenizer), (length,), generator=generator).tolist()
        new = int(torch.randint(1, 20, (1,), generator=generator))
        cases.append((prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)))
    results = [[] for _ in cases]
    try:
        for i, (prompt, params) in enumerate(cases):
            engine.submit(GenerationRequest(prompt, params), results[i].append)
            time.sleep(0.003 * (i % 3))
        deadline = time.monotonic() + 30
        while not all(r and r[-1].finish_reason for r in results) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    for (prompt, params), deltas in zip(cases, results, strict=True):
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == reference(model, prompt, params.max_tokens)
