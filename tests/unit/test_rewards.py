"""GRPO's built-in rewards, and user reward functions run in a worker with a timeout: one
that raises or hangs is reported with its sample and counted, and the others keep going."""

import time
from types import SimpleNamespace

import pytest

from swiftlm.errors import ConfigError, DataError
from swiftlm.methods.rl.rewards import RewardSet, accuracy, answers_match, final_answer


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("7 + 5 = 12.", "12"),
        ("The answer is 12", "12"),
        ("so we get \\boxed{\\frac{1}{2}} here", "\\frac{1}{2}"),
        ("Natalia sold 48 clips ... #### 72", "72"),
        ("Answer: 1,000 apples", "1,000 apples"),
        ("no number here", "no number here"),
    ],
)
def test_the_final_answer_is_found(text, answer):
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("completion", "solution", "right"),
    [
        ("7 + 5 = 12", "12", True),
        ("It is 12.0", "12", True),
        ("Answer: 1,000", "1000", True),
        ("7 + 5 = 13", "12", False),
        ("12 is close to 13", "12", False),  # the LAST number is the answer
        ("\\boxed{Paris}", "paris", True),
    ],
)
def test_accuracy_compares_numbers_as_numbers(completion, solution, right):
    assert answers_match(completion, solution) is right


def test_accuracy_without_a_solution_column_is_a_clear_error():
    with pytest.raises(DataError, match="needs a `solution` column"):
        accuracy(["12"])


def args(tmp_path, funcs, **more):
    defaults = dict(
        reward_funcs=funcs,
        reward_weights=None,
        reward_timeout=2.0,
        format_pattern=r"^<answer>.*</answer>$",
        max_completion_length=8,
        soft_cache_length=4,
        repetition_n_grams=2,
    )
    return SimpleNamespace(**{**defaults, **more})


def score(rewards, completions, ids=None, **columns):
    ids = ids or [[1] * 3 for _ in completions]
    return rewards.score(["p"] * len(completions), completions, ids, columns)


def test_builtin_format_length_and_repetition(tmp_path):
    rewards = RewardSet(args(tmp_path, ["format", "length", "repetition"]), print)
    scored = score(rewards, ["<answer>4</answer>", "a a a a"], ids=[[1] * 4, [1] * 6])
    assert scored.per_function["format"] == [1.0, 0.0]
    # 8 tokens at most, ramp of 4: 4 tokens -> 0, 6 tokens -> (4 - 6) / 4.
    assert scored.per_function["length"] == [0.0, -0.5]
    # bigrams of "a a a a": 3, one distinct -> -(1 - 1/3).
    assert scored.per_function["repetition"][1] == pytest.approx(-2 / 3)
    assert scored.total == pytest.approx([1.0, -0.5 - 2 / 3])


def test_weights_combine_the_functions(tmp_path):
    rewards = RewardSet(args(tmp_path, ["format", "accuracy"], reward_weights=[0.5, 2.0]), print)
    scored = score(rewards, ["<answer>4</answer>"], solution=["4"])
    assert scored.total == [0.5 * 1 + 2.0 * 1]


USER_REWARDS = """
import time

def half(prompts, completions, **kwargs):
    return [0.5 for _ in completions]

def picky(prompts, completions, **kwargs):
    return [1 / (len(c) - 3) for c in completions]   # fails on 3-character completions

def sleepy(prompts, completions, **kwargs):
    time.sleep(3600)

def wrong_length(prompts, completions, **kwargs):
    return [1.0, 2.0, 3.0]
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_a_user_function_gets_the_columns(tmp_path, user_file):
    rewards = RewardSet(args(tmp_path, [f"{user_file}:half"]), print)
    try:
        assert score(rewards, ["x", "y"]).total == [0.5, 0.5]
    finally:
        rewards.close()


def test_a_failing_sample_is_reported_and_counted_the_others_keep_theirs(tmp_path, user_file):
    lines = []
    rewards = RewardSet(args(tmp_path, [f"{user_file}:picky"]), lines.append)
    try:
        scored = score(rewards, ["abcde", "abc", "abcd"])
    finally:
        rewards.close()
    assert scored.per_function[f"{user_file}:picky"] == [0.5, None, 1.0]
    assert scored.failures[f"{user_file}:picky"] == 1
    assert "ZeroDivisionError" in lines[0] and "'abc'" in lines[0]


def test_a_hanging_function_times_out_and_the_run_goes_on(tmp_path, user_file):
    lines = []
    rewards = RewardSet(args(tmp_path, [f"{user_file}:sleepy", "format"]), lines.append)
    try:
        # The worker imports swiftlm before it is ready (not counted in --reward_timeout).
        assert rewards.functions[f"{user_file}:sleepy"]._start() is None
        started = time.monotonic()
        scored = score(rewards, ["<answer>1</answer>", "x"])
        took = time.monotonic() - started
        assert scored.per_function[f"{user_file}:sleepy"] == [None, None]
        assert scored.failures[f"{user_file}:sleepy"] == 2
        assert scored.total == [1.0, 0.0]  # the format reward still counts
        assert "timed out after 2 s" in lines[0]
        assert took < 10  # the 2 s timeout, not the hour the function sleeps
        # The next call gets a fresh worker (the hung one was killed) and times out again.
        assert score(rewards, ["y"]).failures[f"{user_file}:sleepy"] == 1
    finally:
        rewards.close()


def test_a_wrong_result_shape_is_a_failure_not_a_crash(tmp_path, user_file):
    lines = []
    rewards = RewardSet(args(tmp_path, [f"{user_file}:wrong_length"]), lines.append)
    try:
        scored = score(rewards, ["a", "b"])
    finally:
        rewards.close()
    assert scored.failures[f"{user_file}:wrong_length"] == 2
    # Each completion alone fails too (one report: the first failing sample).
    assert "returned list of length 3; expected a list of 1 numbers" in lines[0]


@pytest.mark.bad_input(
    input="`--reward_funcs file.py:fn` naming a missing file or function",
    outcome="Error naming the flag value and what is missing, before anything loads",
)
def test_a_missing_reward_file_or_function_is_refused(tmp_path, user_file):
    with pytest.raises(ConfigError, match="does not exist"):
        RewardSet(args(tmp_path, [f"{tmp_path}/nope.py:f"]), print)
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        RewardSet(args(tmp_path, [f"{user_file}:nope"]), print)
