"""Per-row sampling against Hugging Face's logits processors, and incremental text with stop
strings."""

import pytest
import torch

from swiftlm.engine.detokenize import IncrementalText, StopText
from swiftlm.engine.protocol import SamplingParams
from swiftlm.engine.sampling import (
    RowState,
    apply_penalties,
    make_generator,
    next_tokens,
    sample_each,
    warp,
)

VOCAB = 50


def row(output=(), prompt=(1, 2, 3), **params) -> RowState:
    return RowState(SamplingParams(**params), list(prompt), make_generator(0), list(output))


def logits(rows=1, seed=0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(rows, VOCAB) * 3


def hf_warped(scores: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    from transformers import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = TemperatureLogitsWarper(temperature)(None, scores.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores


@pytest.mark.numerics
@pytest.mark.parametrize(
    "knobs",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 0.9, "min_p": 0.2},
        {"temperature": 1.2, "top_k": 10, "top_p": 0.8, "min_p": 0.05},
    ],
)
def test_warping_matches_hf_processors(knobs):
    """Bit for bit: the kept scores are scores / temperature either way, one correctly rounded
    IEEE division, the same on every machine."""
    scores = logits()
    ours = warp(scores, [row(**knobs)])
    reference = hf_warped(scores, **knobs)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(reference))
    kept = torch.isfinite(reference)
    assert torch.equal(ours[kept], reference[kept])


def test_top_p_on_a_flat_distribution_matches_hf(monkeypatch):
    from swiftlm.engine import sampling

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 4)  # too few: the bisection decides
    scores = logits(2) / 4
    knobs = {"temperature": 1.0, "top_p": 0.7}
    ours = warp(scores, [row(**knobs), row(temperature=1.0, top_p=0.95)])
    assert torch.equal(torch.isfinite(ours[0]), torch.isfinite(hf_warped(scores[:1], **knobs)[0]))
    reference = hf_warped(scores[1:], temperature=1.0, top_p=0.95)[0]
    assert torch.equal(torch.isfinite(ours[1]), torch.isfinite(reference))
    assert 10 < int(torch.isfinite(ours[0]).sum()) < VOCAB


def test_rows_with_different_knobs_are_processed_as_if_alone():
    scores = logits(3)
    knobs = [
        {"temperature": 0.5, "top_k": 3},
        {"temperature": 1.0},
        {"temperature": 2.0, "top_p": 0.5},
    ]
    together = warp(scores, [row(**k) for k in knobs])
    for i, k in enumerate(knobs):
        assert torch.equal(together[i : i + 1], warp(scores[i : i + 1], [row(**k)]))


@pytest.mark.numerics
def test_repetition_penalty_matches_hf_over_prompt_and_output():
    from transformers import RepetitionPenaltyLogitsProcessor

    scores = logits()
    state = row(output=(7, 7, 9), prompt=(1, 2, 3), repetition_penalty=1.8)
    seen = torch.tensor([[1, 2, 3, 7, 7, 9]])
    expected = RepetitionPenaltyLogitsProcessor(1.8)(seen, scores.clone())
    # One correctly rounded product or quotient per score: the same bits on every machine.
    assert torch.equal(apply_penalties(scores, [state]), expected)


@pytest.mark.numerics
def test_presence_and_frequency_penalties_count_generated_tokens_only():
    scores = logits()
    state = row(output=(7, 7, 9), prompt=(1, 7), presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(scores, [state])
    expected = scores.clone()
    expected[0, 7] -= 0.5 + 2 * 0.25
    expected[0, 9] -= 0.5 + 0.25
    assert torch.equal(out, expected)  # elementwise IEEE sums: the same bits on every machine


def test_greedy_rows_take_the_argmax_and_top_k_1_is_greedy():
    scores = logits(2)
    chosen = next_tokens(scores, [row(temperature=0), row(temperature=1.5, top_k=1)])
    assert chosen.tolist() == scores.argmax(-1).tolist()


def test_a_row_generator_makes_sampling_reproducible():
    scores = logits(1)
    draws = [next_tokens(scores, [row(temperature=1.0)]).item() for _ in range(2)]
    assert draws[0] == draws[1]  # each row() starts a generator seeded 0
    state = row(temperature=5.0)  # flat enough that 20 draws differ
    series = {next_tokens(scores, [state]).item() for _ in range(20)}
    assert len(series) > 1  # the generator advances


def test_draw_follows_the_distribution():
    from swiftlm.engine.sampling import draw

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2]])
    generator = make_generator(1)
    picks = torch.cat([draw(probs, [generator]) for _ in range(4000)])
    frequencies = torch.bincount(picks, minlength=5).double() / len(picks)
    torch.testing.assert_close(frequencies, probs[0].double(), atol=0.03, rtol=0)


class BrokenMatcher:
    """A grammar whose mask fails: what a bug in one request's constraint looks like."""

    def mask(self, logits):
        raise RuntimeError("the grammar broke")


def break_grammar(state: RowState) -> None:
    state.matcher = BrokenMatcher()  # fails before any random number is drawn


def break_logprobs(state: RowState) -> None:
    # More alternatives than the vocabulary has: fails after the batch drew its numbers.
    state.params = SamplingParams(temperature=0.8, logprobs=True, top_logprobs=VOCAB + 1)


@pytest.mark.parametrize("breaks", [break_grammar, break_logprobs])
def test_a_row_whose_sampling_raises_fails_alone_and_the_others_draw_as_without_it(breaks):
    scores = logits(4, seed=3)

    def rows(broken: bool) -> list[RowState]:
        made = [
            row(temperature=0),
            row(temperature=1.0, logprobs=True, top_logprobs=2),
            row(temperature=0.8, top_k=5),
            row(temperature=1.5),
        ]
        for i, state in enumerate(made):
            state.generator = make_generator(i)
        if broken:
            breaks(made[2])
        return made

    healthy, mixed = rows(broken=False), rows(broken=True)
    expected = [sample_each(scores, healthy) for _ in range(3)]
    picks = [sample_each(scores, mixed) for _ in range(3)]
    for step in range(3):  # the same draws step after step: no generator ran ahead
        assert isinstance(picks[step][2], Exception)
        assert [picks[step][i] for i in (0, 1, 3)] == [expected[step][i] for i in (0, 1, 3)]


def test_stop_text_holds_back_a_possible_stop_and_cuts_before_it():
    stop = StopText(("END",))
    assert stop.push("Hello E") == "Hello "  # "E" may start "END"
    assert stop.push("x") == "Ex"
    assert stop.push(" and E") == " and "
    assert stop.push("N") == ""
    assert stop.push("D more") == ""
    assert stop.stopped and stop.text == "Hello Ex and "


def test_stop_text_flushes_what_no_stop_completed():
    stop = StopText(("###", "\n\n"))
    assert stop.push("a #") == "a "
    assert stop.push("#") == ""
    assert stop.flush() == "##"
    assert not stop.stopped


def test_earliest_of_several_stop_strings_wins():
    stop = StopText(("world", "lo"))
    stop.push("hello world")
    assert stop.stopped and stop.text == "hel"


def test_incremental_text_equals_decoding_everything(tmp_path):
    from conftest import build_tokenizer

    tokenizer = build_tokenizer(tmp_path)
    text = "你好, the capital of France is Paris! 你好"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [2]  # 2: <|im_end|> special
    detok = IncrementalText(tokenizer)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
