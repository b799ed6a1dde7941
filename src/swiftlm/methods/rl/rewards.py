"""GRPO's reward functions: the built-in ones and the user's, scored together per rollout.

Every function is called once per rollout batch as `fn(prompts=, completions=,
completion_ids=, **columns)`: one entry per completion, `columns` the row's other columns
(e.g. `solution`), each a list aligned with the completions, as TRL calls them. The total
reward is the weighted sum over functions (--reward_weights). A function that fails (raises,
times out, returns garbage) on a completion gives it no reward (0 in the sum, left out of
that function's mean), is reported with the sample, and counted: `rewards/<name>/failures`.

Built in:
- accuracy: 1 if the completion's final answer equals the `solution` column, else 0. The
  answer is the content of the last \\boxed{...}, else the text after the last "answer:"/
  "answer is", else the last number; numbers compare as numbers ("1,000" = "1000.0").
- format: 1 if the completion fully matches --format_pattern (dot matches newline), else 0.
- length: DAPO's soft over-long penalty: 0 up to --max_completion_length minus
  --soft_cache_length tokens, then falling linearly to -1 at --max_completion_length.
- repetition: minus the share of repeated word n-grams (--repetition_n_grams), in [-1, 0].
"""

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swiftlm.errors import DataError
from swiftlm.methods.rl.reward_calls import CallResult, UserReward

_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_ANSWER = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_answer(text: str) -> str:
    """The final answer of a solution or completion text (see the module docstring)."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    if "####" in text:  # GSM8K's solutions
        return text.rsplit("####", 1)[1].strip()
    stated = _ANSWER.findall(text)
    if stated:
        return stated[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def _as_number(text: str) -> float | None:
    numbers = _NUMBER.findall(text)
    if len(numbers) != 1:
        return None
    try:
        return float(numbers[0].replace(",", ""))
    except ValueError:
        return None


def answers_match(completion: str, solution: str) -> bool:
    got, want = final_answer(completion), final_answer(str(solution))
    got_number, want_number = _as_number(got), _as_number(want)
    if got_number is not None and want_number is not None:
        return math.isclose(got_number, want_number, rel_tol=1e-6, abs_tol=1e-9)
    normalize = lambda s: re.sub(r"\s+", " ", s.strip().rstrip(".").lower())  # noqa: E731
    return normalize(got) == normalize(want)


def accuracy(completions: list[str], solution: list | None = None, **_) -> list[float]:
    if solution is None:
        raise DataError(
            "--reward_funcs accuracy needs a `solution` column in every row (the expected "
            "final answer); add it, or choose other --reward_funcs"
        )
    return [float(answers_match(c, s)) for c, s in zip(completions, solution, strict=True)]


def format_reward(pattern: str) -> Callable[..., list[float]]:
    regex = re.compile(pattern, re.DOTALL)

    def format_(completions: list[str], **_) -> list[float]:
        return [float(regex.fullmatch(c.strip()) is not None) for c in completions]

    return format_


def length_reward(max_length: int, cache: int) -> Callable[..., list[float]]:
    expected = max_length - cache

    def length(completion_ids: list[list[int]], **_) -> list[float]:
        return [min(0.0, (expected - len(ids)) / cache) for ids in completion_ids]

    return length


def repetition_reward(n: int) -> Callable[..., list[float]]:
    def repetition(completions: list[str], **_) -> list[float]:
        rewards = []
        for text in completions:
            words = text.split()
            grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
            rewards.append(-(1 - len(set(grams)) / len(grams)) if grams else 0.0)
        return rewards

    return repetition


def _length(g) -> Callable[..., list[float]]:
    return length_reward(
        g.max_completion_length, g.soft_cache_length or max(1, g.max_completion_length // 4)
    )


# --reward_funcs NAME -> the reward's builder: called once per run with the grpo section (the
# built-ins read their settings from it), it gives the function scored on every batch.
# The built-ins are here; a plugin's reward is added by swiftlm.plugins.register_reward.
# --reward_funcs is checked against these names when the flags are parsed.
REWARD_FUNCS: dict[str, Callable[[Any], Callable[..., list[float]]]] = {
    "accuracy": lambda g: accuracy,
    "format": lambda g: format_reward(g.format_pattern),
    "length": _length,
    "repetition": lambda g: repetition_reward(g.repetition_n_grams),
}


@dataclass
class Scored:
    """Rewards of a rollout batch: per function (None: failed or no reward), the total."""

    per_function: dict[str, list[float | None]]
    total: list[float]
    failures: dict[str, int] = field(default_factory=dict)


class RewardSet:
    """The run's reward functions, weights and failure counts."""

    def __init__(self, grpo_args, log):
        g = grpo_args
        self.log = log
        self.weights = list(g.reward_weights or [1.0] * len(g.reward_funcs))
        self.functions = {
            name: REWARD_FUNCS[name](g)
            if name in REWARD_FUNCS
            else UserReward(name, g.reward_timeout)
            for name in g.reward_funcs
        }
        self.failures_total = dict.fromkeys(self.functions, 0)

    @property
    def names(self) -> list[str]:
        return list(self.functions)

    def score(self, prompts: list, completions: list[str], completion_ids, columns) -> Scored:
        """Score one batch; failures are reported (first one per function and call) and
        counted, never raised."""
        kwargs = dict(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
        )
        per_function, failures = {}, {}
        for name, function in self.functions.items():
            rewards, failed = self._call(name, function, kwargs)
            per_function[name], failures[name] = rewards, failed
            self.failures_total[name] += failed
        total = [
            sum(w * (v[i] or 0.0) for w, v in zip(self.weights, per_function.values(), strict=True))
            for i in range(len(completions))
        ]
        return Scored(per_function, total, failures)

    def _call(self, name, function, kwargs) -> tuple[list[float | None], int]:
        count = len(kwargs["completions"])
        if not isinstance(function, UserReward):  # ours: a bug or bad data must stop the run
            return list(function(**kwargs)), 0
        result = function(**kwargs)
        if result.rewards is not None:
            return result.rewards, 0
        if "timed out" in (result.error or ""):  # one at a time would hang once per sample
            self._report(name, kwargs, 0, result, count)
            return [None] * count, count
        return self._one_by_one(name, function, kwargs, count)

    def _one_by_one(self, name, function, kwargs, count) -> tuple[list[float | None], int]:
        """After a failed batch call: each completion alone, so the good ones keep their
        rewards and each failure is reported with its own sample."""
        rewards: list[float | None] = []
        failed = 0
        for i in range(count):
            single = {k: v[i : i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
            result: CallResult = function(**single)
            if result.rewards is None:
                failed += 1
                if failed == 1:
                    self._report(name, kwargs, i, result, count)
                rewards.append(None)
            else:
                rewards.append(result.rewards[0])
        return rewards, failed

    def _report(self, name, kwargs, index, result: CallResult, count) -> None:
        prompt = _short(kwargs["prompts"][index])
        completion = _short(kwargs["completions"][index])
        self.log(
            f"reward {name} failed: {result.error} (on prompt {prompt!r}, completion "
            f"{completion!r}; {self.failures_total[name] + 1} failure(s) in this run, counted "
            f"in rewards/{name}/failures; those completions get no reward from it)"
        )

    def close(self) -> None:
        for function in self.functions.values():
            if isinstance(function, UserReward):
                function.close()


def _short(value, limit: int = 80) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
