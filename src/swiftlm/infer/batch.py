"""Batch inference: answer every conversation of `--val_dataset` and write them as JSONL.

Each output line is
`{"messages": [...prompt...], "response": str, "labels": str | null, "source": "path:line"}`,
in input order. A conversation that ends with an assistant message has that message taken
out of the prompt and stored as `labels` (the reference answer).

A row that cannot be answered (its prompt leaves no room in the context, its generation
fails inside the engine) does not cost the others theirs: every answer is written, the failed
row's line has `"response": null` and an `"error"`, and the command then fails (exit 1) naming
each failed row by `file:line`.

With a vision-language model, rows may hold images: `<image>` tags with an `images` column
(paths relative to the data file's folder, URLs or base64) or image_url/image content parts.
Every image is checked while the rows are read, so a missing or damaged one is named
(`file:line`) before anything is generated; the prompts written to the results file hold the
checked references (absolute paths or data URLs). A text model refuses image rows.
"""

import json
import time
from datetime import datetime
from functools import partial
from pathlib import Path

from swiftlm.config import InferConfig
from swiftlm.data.loading import load_samples
from swiftlm.engine.build import InferenceModel
from swiftlm.errors import ConfigError, DataError
from swiftlm.infer.chat_images import text_prompt_sample, vision_prompt_sample
from swiftlm.infer.frontend import AnswersFailed, InferEngine

FAILED_ROWS_SHOWN = 10  # rows named in the error; the results file marks them all


def run_batch(
    engine: InferEngine, cfg: InferConfig, spec: InferenceModel, samples: list[dict] | None = None
) -> list[dict]:
    """Answer all `--val_dataset` samples (`samples`: already loaded by `load_prompts`), write
    the results file, return its records."""
    if samples is None:
        samples = load_prompts(cfg, spec.system, vision=getattr(engine, "takes_images", False))
    path = result_path(cfg, spec)
    make_parent(path)  # fail before generating, not after
    prompts, labels = zip(*(split_reference(s["messages"]) for s in samples), strict=True)
    start, tokens_before = time.perf_counter(), engine.generated_tokens
    try:
        responses, failures = generate_in_batches(engine, list(prompts), cfg), {}
    except AnswersFailed as exc:  # the other rows' answers are kept and written
        responses, failures = exc.answers, exc.failures
    seconds = time.perf_counter() - start
    records = [
        {"messages": prompt, "response": response, "labels": label, "source": sample["source"]}
        for prompt, response, label, sample in zip(prompts, responses, labels, samples, strict=True)
    ]
    for i, reason in failures.items():
        records[i]["error"] = reason
    write_results(path, records)
    tokens = engine.generated_tokens - tokens_before
    print(
        f"Answered {len(records) - len(failures)} samples in {seconds:.1f} s "
        f"({tokens} tokens, {tokens / max(seconds, 1e-9):.1f} tokens/s); results: {path}",
        flush=True,
    )
    if failures:
        raise failed_rows_error(records, failures, path)
    return records


def failed_rows_error(records: list[dict], failures: dict[int, str], path: Path) -> DataError:
    """The rows that got no answer, by file:line, once the others' answers are written."""
    shown = [f"  {records[i]['source']}: {failures[i]}" for i in sorted(failures)]
    more = len(shown) - FAILED_ROWS_SHOWN
    shown = shown[:FAILED_ROWS_SHOWN] + ([f"  ... and {more} more"] if more > 0 else [])
    return DataError(
        f"{len(failures)} of {len(records)} rows could not be answered; the other answers are "
        f'written to {path} (a failed row\'s line has "response": null and its "error"):\n'
        + "\n".join(shown)
    )


def load_prompts(cfg: InferConfig, system: str | None, vision: bool = False) -> list[dict]:
    """The `--val_dataset` conversations; they may end with a user message (no answer).
    `vision`: the model takes images, so rows may hold them (checked here)."""
    placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}
    options = dict(require_answer=False, system=system, placeholders=placeholders, method="infer")
    samples, report = load_samples(
        cfg.data.val_dataset,
        partial(vision_prompt_sample if vision else prompt_sample, **options),
        skip_bad_rows=cfg.data.skip_bad_rows,
        seed=cfg.data.data_seed,
    )
    if report.skipped:
        print(f"--val_dataset: {report.summary()}", flush=True)
    for line in report.notices("infer"):
        print(f"--val_dataset: {line}", flush=True)
    return samples


# A text model's rows: images, tools and tool calls refused (see chat_images).
prompt_sample = text_prompt_sample


def split_reference(messages: list[dict]) -> tuple[list[dict], str | None]:
    """(prompt, reference answer): a trailing assistant message becomes the reference."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[:-1], messages[-1]["content"]
    return messages, None


def generate_in_batches(
    engine: InferEngine, prompts: list[list[dict]], cfg: InferConfig
) -> list[str]:
    """Answers in input order. All prompts go to the engine at once: it decodes up to
    `--max_batch_size` sequences together and starts the next prompt as soon as one ends."""
    return engine.generate(prompts, cfg.generation)


def result_path(cfg: InferConfig, spec: InferenceModel) -> Path:
    """--result_path, else `<run or checkpoint dir, or cwd>/infer_result/<timestamp>.jsonl`."""
    if cfg.infer.result_path:
        return Path(cfg.infer.result_path).expanduser()
    root = Path(spec.ckpt_dir) if spec.ckpt_dir else Path.cwd()
    return root / "infer_result" / f"{datetime.now():%Y%m%d-%H%M%S}.jsonl"


def make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--result_path {path}: cannot create its folder ({exc})") from None


def write_results(path: Path, records: list[dict]) -> None:
    """Write the JSONL atomically, so a reader never sees half a results file."""
    staging = path.with_name(path.name + ".tmp")
    try:
        with staging.open("w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        staging.replace(path)
    except OSError as exc:
        raise ConfigError(f"--result_path {path}: cannot write the results ({exc})") from None
