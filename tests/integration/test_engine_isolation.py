"""One sample's failure stays with it: whatever raises while a sample is prepared, sampled or
detokenized ends that sample (finish_reason "error"), and every other request of the batch
decodes on to the tokens it gets without the failing one."""

import logging
import time

import pytest

from conftest import build_tokenizer, make_tiny_llama
from swiftlm.engine import scheduler as scheduler_module
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.protocol import GenerationFailed, GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=11, n=2, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 30)), [100, 101, 102, 103], [42] * 9]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("isolation-tokenizer"))
    engine = ContinuousEngine(
        make_tiny_llama(len(tokenizer)).eval(), tokenizer, stop_token_ids=[2], max_num_seqs=8
    )
    yield engine
    engine.shutdown()


def healthy_requests() -> list[GenerationRequest]:
    """Greedy and seeded samples: both must come out as they would without a failing one."""
    return [
        GenerationRequest(PROMPTS[0], GREEDY),
        GenerationRequest(PROMPTS[1], SEEDED),
        GenerationRequest(PROMPTS[2], GREEDY),
    ]


def tokens(results) -> list[list[tuple[int, ...]]]:
    return [[tuple(sample.token_ids) for sample in samples] for samples in results]


@pytest.fixture(scope="module")
def alone(engine):
    """The healthy requests' tokens in a batch of their own."""
    return tokens(engine.generate(healthy_requests()))


def run_with(engine, bad: GenerationRequest, position: int = 1):
    """The healthy requests with `bad` among them: (the others' results, bad's samples,
    the GenerationFailed raised)."""
    requests = healthy_requests()
    requests.insert(position, bad)
    with pytest.raises(GenerationFailed) as info:
        engine.generate(requests)
    results = info.value.results
    others = results[:position] + results[position + 1 :]
    return others, results[position], info.value


class Breaks:
    """A constraint whose matcher fails in `mask` from its `after`-th call on, or already in
    `matcher()` when `after` is None: a request whose grammar breaks."""

    def __init__(self, after: int | None):
        self.after = after

    def matcher(self):
        if self.after is None:
            raise RuntimeError("the grammar could not start")
        return BreakingMatcher(self.after)


class BreakingMatcher:
    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def mask(self, logits):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("the grammar broke")

    def accept(self, token: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


def test_a_seed_no_generator_takes_fails_only_its_request_as_the_callers_mistake(
    engine, alone, monkeypatch
):
    # The engine refuses such a seed at submit; a caller that skips the check (as the server
    # did before its schema checked seeds) must still only fail its own request.
    monkeypatch.setattr(engine, "validate", lambda request: None)
    bad = GenerationRequest(PROMPTS[3], SamplingParams(seed=2**80, n=2, max_tokens=16))
    others, failed, error = run_with(engine, bad)
    assert tokens(others) == alone
    assert [s.finish_reason for s in failed] == ["error", "error"]
    assert error.failures == {1: failed[0].error} and "seed 1208925819614629174706176" in str(error)
    assert "64-bit integer" in failed[0].error


def test_the_delta_of_a_failed_sample_says_whose_mistake_it_was(engine, monkeypatch):
    deltas = []
    monkeypatch.setattr(engine, "validate", lambda request: None)
    engine.submit(GenerationRequest(PROMPTS[0], SamplingParams(seed=2**64)), deltas.append)
    engine.submit(GenerationRequest(PROMPTS[0], GREEDY, constraint=Breaks(2)), deltas.append)
    while sum(d.finish_reason is not None for d in deltas) < 2:
        time.sleep(0.01)
    seed, grammar = [d for d in deltas if d.finish_reason is not None]
    assert (seed.finish_reason, seed.error_id) == ("error", None)  # the request's values
    assert grammar.finish_reason == "error" and grammar.error_id  # the engine's: logged
    assert grammar.error == "RuntimeError: the grammar broke"


@pytest.mark.parametrize("after", [None, 0, 5], ids=["at-start", "first-token", "mid-answer"])
def test_a_sample_whose_grammar_breaks_fails_alone_and_is_logged_with_its_error_id(
    engine, alone, after, caplog
):
    bad = GenerationRequest(PROMPTS[3], GREEDY, constraint=Breaks(after))
    with caplog.at_level(logging.ERROR, logger=scheduler_module.__name__):
        others, failed, error = run_with(engine, bad, position=0)
    assert tokens(others) == alone
    assert len(failed[0].token_ids) == (after or 0)  # the tokens before it broke
    assert failed[0].finish_reason == "error" and "the grammar" in failed[0].error
    logged = [r for r in caplog.records if r.exc_info and bad.request_id in r.getMessage()]
    assert len(logged) == 1 and "error id" in logged[0].getMessage()


def test_a_sample_whose_detokenizing_raises_fails_alone(engine, alone, monkeypatch):
    original = scheduler_module.Sequence.accept

    def accept(seq, token, logprob):
        if seq.request_id == "bad" and len(seq.row.output_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return original(seq, token, logprob)

    monkeypatch.setattr(scheduler_module.Sequence, "accept", accept)
    bad = GenerationRequest(PROMPTS[3], GREEDY, request_id="bad")
    others, failed, error = run_with(engine, bad, position=2)
    assert tokens(others) == alone
    assert len(failed[0].token_ids) == 3 and failed[0].error.startswith("UnicodeDecodeError")
    monkeypatch.undo()
    assert tokens(engine.generate(healthy_requests())) == alone  # the engine serves on
