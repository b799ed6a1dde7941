"""The contamination check of an evaluation: which evaluation samples the training data saw.

Training data is `--dataset` when given, else the datasets of the run being evaluated (its
config.yaml). Placeholders ({{NAME}}, {{AUTHOR}}) are filled as the run filled them, so the
check sees the text the model was trained on.
"""

from pathlib import Path

from swiftlm.config.parse import load_run_config
from swiftlm.data.sources import parse_dataset_spec, read_rows
from swiftlm.errors import DataError
from swiftlm.eval.contamination import build_index, check, texts_of_row
from swiftlm.eval.tasks import Task


def training_specs(cfg, spec) -> tuple[list[str], str]:
    """(dataset specs, where they came from)."""
    if cfg.data.dataset:
        return list(cfg.data.dataset), "--dataset"
    if spec is not None and spec.ckpt_dir:
        saved = Path(spec.ckpt_dir) / "config.yaml"
        if saved.is_file():
            run = load_run_config(saved)
            return list(run.data.dataset), str(saved)
    return [], ""


def training_texts(specs: list[str], placeholders: dict[str, str]):
    for spec in specs:
        path, _ = parse_dataset_spec(spec)
        for row in read_rows(path):
            if row.record is None:
                continue
            text = texts_of_row(row.record)
            for key, value in placeholders.items():
                text = text.replace(key, value)
            yield text


def sample_text(sample) -> str:
    prompt = (
        sample.prompt
        if isinstance(sample.prompt, str)
        else texts_of_row({"messages": sample.prompt})
    )
    parts = [prompt, sample.reference or "", *sample.choices]
    return "\n".join(p for p in parts if p)


def contamination_section(cfg, spec, tasks: list[Task], n: int) -> dict | None:
    """contamination.json's content, or None when no training data is known.

    Training data named by --dataset must be readable (an error otherwise); a run's own data
    that has moved since it trained only skips the check, with a line saying why, since the
    evaluation itself does not need it."""
    specs, origin = training_specs(cfg, spec)
    if not specs or n == 0:
        return None
    placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}
    try:
        index = build_index(training_texts(specs, placeholders), n, min_n=min(n, 8))
    except DataError as exc:
        if origin == "--dataset":
            raise
        print(f"contamination check skipped: the run's training data ({origin}) {exc}", flush=True)
        return None
    per_task, items = {}, {}
    for task in tasks:
        report = check(index, [(s.id, sample_text(s)) for s in task.samples])
        per_task[task.name] = report.summary()
        items[task.name] = [
            {"id": i.id, "ratio": i.ratio, "contaminated": i.contaminated, "too_short": i.too_short}
            for i in report.items
        ]
    summary = {"training_data": specs, "from": origin, "n": n, "tasks": per_task}
    return {"summary": summary, "items": items}
