"""The comparisons every export checks itself with (`swiftlm/export/checks.py`), on made-up
numbers: the tolerance rules, and what a failure says."""

import math

import pytest
import torch

from swiftlm.errors import ExportCheckError, SwiftLMError
from swiftlm.export.checks import (
    CHECK_PROMPTS,
    AnswerComparison,
    PerplexityComparison,
    Tolerance,
    compare_logits,
)

TOLERANCE = Tolerance(atol=1e-4, rtol=1e-5)


def test_export_check_error_is_a_user_facing_error():
    assert issubclass(ExportCheckError, SwiftLMError) and ExportCheckError.exit_code == 1


def test_logits_follow_allclose_over_real_tokens_only():
    reference = torch.tensor([[[10.0, -20.0], [1.0, 2.0]]], dtype=torch.float64)
    mask = torch.tensor([[1, 0]])
    edge = 1e-4 + 1e-5 * 20.0  # the largest difference allowed for the logit -20
    got = reference.clone()
    got[0, 0, 1] += edge * 0.99
    got[0, 1] += 5.0  # a padding position: not compared
    compared = compare_logits(got, reference, mask, TOLERANCE)
    assert compared.within and compared.max_abs_diff == pytest.approx(edge * 0.99, rel=1e-3)
    assert torch.allclose(got[0, 0], reference[0, 0], atol=1e-4, rtol=1e-5)
    got[0, 0, 1] = reference[0, 0, 1] + edge * 1.5
    outside = compare_logits(got, reference, mask, TOLERANCE)
    assert not outside.within
    with pytest.raises(ExportCheckError, match=r"logits differ from base \+ adapter") as raised:
        outside.require("the merged model", "base + adapter", "out/", hint="Try again")
    assert "beyond 0.0001 + 1e-05 x |logit|" in str(raised.value)
    assert str(raised.value).endswith("out/ is not faithful. Try again")


def test_nan_logits_are_never_within_and_no_tolerance_only_reports():
    reference = torch.zeros(1, 2, 3)
    got = reference.clone()
    got[0, 0, 0] = math.nan
    mask = torch.ones(1, 2, dtype=torch.long)
    assert not compare_logits(got, reference, mask, TOLERANCE).within
    reported = compare_logits(reference + 3.0, reference, mask)
    assert reported.within and reported.max_abs_diff == 3.0


def test_perplexity_margin_one_way_and_either_way():
    rise = PerplexityComparison(10.0, 12.0, 0.5, "at 4 bits")
    assert rise.within and PerplexityComparison(10.0, 2.0, 0.5, "at 4 bits").within
    assert rise.describe() == "held-out perplexity 10.000 -> 12.000 (+20.00%, limit +50% at 4 bits)"
    too_high = PerplexityComparison(10.0, 15.1, 0.5, "at 4 bits")
    with pytest.raises(ExportCheckError, match=r"beyond the \+50% allowed at 4 bits; try 8 bits"):
        too_high.require("the quantized model in out/", "try 8 bits")
    fall = PerplexityComparison(10.0, 9.0, 0.002, "for f16", either_way=True)
    assert not fall.within and "limit ±0.2% for f16" in fall.describe()


@pytest.mark.parametrize("either_way", [False, True])
def test_a_nan_perplexity_fails(either_way):
    # The GGUF check once tested `abs(change) > margin`, which a NaN perplexity passes.
    broken = PerplexityComparison(17.9, math.nan, 0.01, "for f16", either_way=either_way)
    assert not broken.within
    with pytest.raises(ExportCheckError, match="nan"):
        broken.require("the f16 GGUF", "it is not faithful")


def test_answers_name_the_first_differing_prompt():
    expected = [f"answer {i}" for i in range(len(CHECK_PROMPTS))]
    got = list(expected)
    AnswerComparison(got, expected).require("the file", "x.gguf")  # equal: no error
    got[1], got[3] = "Lyon", "other"
    compared = AnswerComparison(got, expected)
    assert compared.differing == [1, 3] and compared.matching == 3
    with pytest.raises(ExportCheckError) as raised:
        compared.require("the f16 GGUF", "x.gguf")
    message = str(raised.value)
    assert "answers check prompt 2 ('What is the capital of France?') differently" in message
    assert "'Lyon' vs 'answer 1' (2 of 5 answers differ); x.gguf is not faithful" in message
