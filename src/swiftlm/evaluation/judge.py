"""Judge tasks, LLM-as-judge, pairwise: is the model's answer better than a baseline answer?

Rows are generation rows (`generation.read_row`) with a `baseline` answer; a task YAML makes
a task a judge task (`kind: judge`, optionally its own `judge_prompt`), and the judge is a
served model (`--judge_url`).

Judges prefer whichever answer they read first (or second) more often than chance, so each
pair is judged twice with the answers' positions swapped. A sample scores 1 when the model's
answer wins both times, 0 when it loses both, 0.5 for ties and for disagreements between the
two orders; `judge_consistency` is the share of samples where both orders agree, which tells
how far the judge can be trusted on this task. The prompt and verdict format are MT-Bench's
pairwise ones ([[A]], [[B]], [[C]] for a tie); a verdict in neither form counts as a tie and
is counted in `judge_unparsed` (the sample then has no `judge_consistency`).
"""

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from swiftlm.errors import ConfigError
from swiftlm.evaluation import generation
from swiftlm.evaluation.backends import Backend
from swiftlm.evaluation.tasks import EvalSettings, Task, answer_all, sample_record

JUDGE_SYSTEM = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by "
    "two AI assistants to the user question displayed below. Choose the assistant that "
    "follows the user's instructions and answers the user's question better: consider "
    "helpfulness, relevance, accuracy, depth and level of detail. Do not let the order of the "
    "responses, their length or the assistants' names influence you. Be as objective as "
    "possible. After a short explanation, output your final verdict in exactly this format: "
    '"[[A]]" if assistant A is better, "[[B]]" if assistant B is better, "[[C]]" for a tie.'
)
JUDGE_USER = (
    "[User Question]\n{question}\n\n"
    "[The Start of Assistant A's Answer]\n{answer_a}\n[The End of Assistant A's Answer]\n\n"
    "[The Start of Assistant B's Answer]\n{answer_b}\n[The End of Assistant B's Answer]"
)
VERDICT = re.compile(r"\[\[([ABC])\]\]")
JUDGE_MAX_TOKENS = 512
JUDGE_REPLY_KEPT = 400  # characters of each reply kept in predictions.jsonl (its end: the verdict)


@dataclass(frozen=True)
class Verdict:
    """The judge's two readings, from the model's side: "win", "loss", "tie" (or unparsed)."""

    model_first: str
    model_second: str
    unparsed: int
    replies: tuple[str, ...] = ()  # the judge's own words, model first then model second

    def scores(self) -> dict[str, float]:
        """Consistency only where both verdicts were read: a judge that never answers in the
        format would otherwise look perfectly consistent (two unread verdicts, two ties)."""
        points = {"win": 1.0, "tie": 0.5, "loss": 0.0}
        scores = {
            "judge_win_rate": (points[self.model_first] + points[self.model_second]) / 2,
            "judge_unparsed": self.unparsed / 2,
        }
        if not self.unparsed:
            scores["judge_consistency"] = float(self.model_first == self.model_second)
        return scores

    def as_json(self) -> dict:
        return {
            "model_first": self.model_first,
            "model_second": self.model_second,
            "replies": [reply[-JUDGE_REPLY_KEPT:] for reply in self.replies],
        }


def parse_verdict(text: str) -> str | None:
    """ "A", "B" or "C" from the judge's last [[X]], or None."""
    found = VERDICT.findall(text or "")
    return found[-1] if found else None


def judge_pairs(
    judge, task, records: list[dict], user_template: str | None = None
) -> list[Verdict]:
    if judge is None:
        raise ConfigError(
            f"task {task.name} is a judge task: give the judge's server with --judge_url "
            "(and --judge_model)"
        )
    missing = [r["id"] for r in records if not r.get("baseline")]
    if missing:
        raise ConfigError(
            f"task {task.name}: judge rows need a 'baseline' answer to compare with; "
            f"{len(missing)} have none, the first at {missing[0]}"
        )
    template = user_template or JUDGE_USER
    jobs = []
    for record in records:
        question, answer, baseline = record["prompt"], record["prediction"], record["baseline"]
        jobs.append((question, answer, baseline))  # the model's answer as A
        jobs.append((question, baseline, answer))  # swapped: the model's answer as B
    with ThreadPoolExecutor(judge.concurrency) as pool:
        texts = list(pool.map(lambda job: _ask(judge, template, *job), jobs))
    return [_verdict(texts[i], texts[i + 1]) for i in range(0, len(texts), 2)]


def _ask(judge, template: str, question: str, answer_a: str, answer_b: str) -> str:
    user = template.format(question=question, answer_a=answer_a, answer_b=answer_b)
    messages = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]
    return judge.chat(messages, max_tokens=JUDGE_MAX_TOKENS)


def _verdict(model_as_a: str, model_as_b: str) -> Verdict:
    first, second = parse_verdict(model_as_a), parse_verdict(model_as_b)
    as_a = {"A": "win", "B": "loss", "C": "tie", None: "tie"}
    as_b = {"A": "loss", "B": "win", "C": "tie", None: "tie"}
    unparsed = (first is None) + (second is None)
    return Verdict(as_a[first], as_b[second], unparsed, (model_as_a, model_as_b))


read_row = generation.read_row


def run(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    records = run_generation_only(task, backend, settings)
    verdicts = judge_pairs(settings.judge, task, records, task.options.get("judge_prompt"))
    for record, verdict in zip(records, verdicts, strict=True):
        record["scores"] = verdict.scores()
        record["judge"] = verdict.as_json()
    return records


def run_generation_only(task: Task, backend: Backend, settings: EvalSettings) -> list[dict]:
    answers = answer_all(task, backend, settings)
    return [
        sample_record(
            task,
            sample,
            answer,
            {},
            extracted=answer.strip(),
            baseline=sample.extra.get("baseline"),
        )
        for sample, answer in zip(task.samples, answers, strict=True)
    ]
