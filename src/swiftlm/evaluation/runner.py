"""Run a task on a backend: one record per sample with its prediction and its scores.

Each task kind is one module with the same two functions: `read_row(record, placeholders)`
turns a data row into a `Sample` (a `RowError` when it is bad), `run(task, backend, settings,
chat)` answers and scores every sample (records of the shape `tasks.py` describes). `KINDS`
maps a kind's name to its module; `task_file.py` reads rows through it, `run_task` runs them.
"""

import time
from dataclasses import dataclass

from swiftlm.errors import DataError
from swiftlm.evaluation import code, generation, judge, multiple_choice, perplexity
from swiftlm.evaluation.backends import Backend, PromptTooLong
from swiftlm.evaluation.tasks import EvalSettings, Task

KINDS = {
    "perplexity": perplexity,
    "generation": generation,
    "multiple_choice": multiple_choice,
    "code": code,
    "judge": judge,
}


@dataclass
class TaskRun:
    task: Task
    records: list[dict]
    seconds: float


def run_task(task: Task, backend: Backend, settings: EvalSettings, chat: bool = True) -> TaskRun:
    start = time.perf_counter()
    try:
        records = KINDS[task.kind].run(task, backend, settings, chat)
    except PromptTooLong as exc:
        sample = task.samples[exc.index]
        raise DataError(f"task {task.name}, sample {sample.id}: {exc}") from None
    return TaskRun(task, records, time.perf_counter() - start)
