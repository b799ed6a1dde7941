"""Run tasks on a backend: one record per sample with its prediction and its scores.

Each task kind has one function here; all of them return records of the same shape, written
one per line to predictions.jsonl:

    {"task", "id", "prompt", "prediction", "extracted", "reference", "scores": {metric: float},
     ...kind-specific fields (the choices' log-probs, the program's sandbox status...)}

so that `--compare` can pair any two evaluations sample by sample, whatever the kind.
"""

import time
from dataclasses import dataclass
from typing import Any

from swiftlm.errors import DataError
from swiftlm.eval.backend import Backend, PromptTooLong, Sampling
from swiftlm.eval.extract import extractor
from swiftlm.eval.metrics import GENERATION_METRICS
from swiftlm.eval.tasks import Task

MC_TEMPLATE = "Question: {question}\nAnswer:"
# Chat models are asked for the whole function (as EvalPlus's instruct prompt does); a model
# without a chat template continues the prompt (HumanEval's original protocol).
CODE_INSTRUCTION = (
    "Complete the following Python function. Answer with the complete function, including "
    "its signature, in one ```python code block.\n\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class EvalSettings:
    sampling: Sampling
    sandbox_timeout: float = 10.0
    sandbox_memory_mb: int = 1024
    judge: Any = None  # an EndpointBackend for judge tasks


@dataclass
class TaskRun:
    task: Task
    records: list[dict]
    seconds: float


def run_task(task: Task, backend: Backend, settings: EvalSettings, chat: bool = True) -> TaskRun:
    start = time.perf_counter()
    try:
        records = RUNNERS[task.kind](task, backend, settings, chat)
    except PromptTooLong as exc:
        sample = task.samples[exc.index]
        raise DataError(f"task {task.name}, sample {sample.id}: {exc}") from None
    return TaskRun(task, records, time.perf_counter() - start)


def _record(task: Task, sample, prediction: str | None, scores: dict, **extra) -> dict:
    prompt = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    return {
        "task": task.name,
        "id": sample.id,
        "prompt": prompt,
        "prediction": prediction,
        "reference": sample.reference,
        "scores": scores,
        **extra,
    }


def _conversation(task: Task, prompt: list[dict]) -> list[dict]:
    if task.system and prompt[0]["role"] != "system":
        return [{"role": "system", "content": task.system}, *prompt]
    return prompt


def _max_tokens(task: Task, settings: EvalSettings) -> int:
    return task.max_new_tokens or settings.sampling.max_new_tokens


def _answers(task: Task, backend: Backend, settings: EvalSettings) -> list[str]:
    """Every sample's conversation answered, the task's system prompt first."""
    prompts = [_conversation(task, s.prompt) for s in task.samples]
    return backend.generate(prompts, settings.sampling, _max_tokens(task, settings))


def run_generation(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    answers = _answers(task, backend, settings)
    extract = extractor(task.extraction, f"task {task.name}")
    records = []
    for sample, answer in zip(task.samples, answers, strict=True):
        extracted = extract(answer)
        scores = {m: GENERATION_METRICS[m](extracted, sample) for m in task.metrics}
        records.append(_record(task, sample, answer, scores, extracted=extracted))
    return records


def run_perplexity(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    scored = backend.text_nll([s.prompt for s in task.samples])
    records = []
    for sample, result in zip(task.samples, scored, strict=True):
        per_token = result.nll / max(result.tokens, 1)
        records.append(
            _record(
                task,
                sample,
                None,
                {"nll_per_token": per_token},
                nll=result.nll,
                tokens=result.tokens,
            )
        )
    return records


def run_multiple_choice(
    task: Task, backend: Backend, settings: EvalSettings, chat: bool
) -> list[dict]:
    template = task.options.get("template", MC_TEMPLATE)
    pairs = []
    for sample in task.samples:
        context = template.format(question=sample.prompt)
        pairs += [(context, " " + choice) for choice in sample.choices]
    scores = iter(backend.continuation_logprobs(pairs))  # in the order of `pairs`
    records = []
    for sample in task.samples:
        logprobs = [next(scores).logprob for _ in sample.choices]
        # acc_norm as lm-eval: the log-prob per byte of the choice, so long choices are fair
        normed = [
            lp / len((" " + c).encode()) for lp, c in zip(logprobs, sample.choices, strict=True)
        ]
        picked = max(range(len(logprobs)), key=logprobs.__getitem__)
        picked_norm = max(range(len(normed)), key=normed.__getitem__)
        scores_of = {
            "acc": float(picked == sample.label),
            "acc_norm": float(picked_norm == sample.label),
        }
        records.append(
            _record(
                task,
                sample,
                sample.choices[picked],
                scores_of,
                reference=sample.choices[sample.label],
                choice_logprobs=logprobs,
            )
        )
    return records


def run_code(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    from swiftlm.eval.code import check_completions, extract_code

    problems = [s.extra for s in task.samples]
    if chat:
        prompts = [
            [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=p["prompt"])}]
            for p in problems
        ]
        prompts = [_conversation(task, p) for p in prompts]
    else:
        prompts = [p["prompt"] for p in problems]
    answers = backend.generate(prompts, settings.sampling, _max_tokens(task, settings))
    programs = [extract_code(p, a) for p, a in zip(problems, answers, strict=True)]
    results = check_completions(
        problems,
        programs,
        timeout_s=settings.sandbox_timeout,
        memory_mb=settings.sandbox_memory_mb,
    )
    records = []
    for sample, answer, program, result in zip(
        task.samples, answers, programs, results, strict=True
    ):
        scores = {"pass@1": float(result.status == "passed")}
        records.append(
            _record(
                task,
                sample,
                answer,
                scores,
                extracted=program,
                sandbox={
                    "status": result.status,
                    "detail": result.detail[-500:],
                    "seconds": round(result.seconds, 3),
                },
            )
        )
    return records


def run_judge(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    from swiftlm.eval.judge import judge_pairs

    records = run_generation_only(task, backend, settings)
    verdicts = judge_pairs(settings.judge, task, records, task.options.get("judge_prompt"))
    for record, verdict in zip(records, verdicts, strict=True):
        record["scores"] = verdict.scores()
        record["judge"] = verdict.as_json()
    return records


def run_generation_only(task: Task, backend: Backend, settings: EvalSettings) -> list[dict]:
    answers = _answers(task, backend, settings)
    return [
        _record(
            task,
            sample,
            answer,
            {},
            extracted=answer.strip(),
            baseline=sample.extra.get("baseline"),
        )
        for sample, answer in zip(task.samples, answers, strict=True)
    ]


RUNNERS = {
    "generation": run_generation,
    "perplexity": run_perplexity,
    "multiple_choice": run_multiple_choice,
    "code": run_code,
    "judge": run_judge,
}
