"""`swiftlm eval`: evaluate a model on tasks, or compare two evaluations (`--compare A B`).

The order is the same as training's: every flag and every task's data are checked first,
then the model loads, then each task runs and its records are written as they finish, and
last come the summary (with bootstrap intervals), the manifest and the contamination check.
"""

import dataclasses
import json
import time
from datetime import datetime
from pathlib import Path

from swiftlm.checkpoint.resolve import resolve_inference_model
from swiftlm.config import UNUSED_FLAGS, EvalConfig, save_config
from swiftlm.config.parse import load_run_config
from swiftlm.config.rules import check
from swiftlm.engine.build import EngineOptions, engine_for_model
from swiftlm.engine.score import is_reward_model
from swiftlm.errors import ConfigError
from swiftlm.evaluation.backends import EndpointBackend, LocalBackend, Sampling
from swiftlm.evaluation.compare import (
    compare_results,
    comparison_to_json,
    format_comparison,
    load_results,
)
from swiftlm.evaluation.contamination import contamination_section
from swiftlm.evaluation.lm_eval_run import run_lm_eval_backend
from swiftlm.evaluation.manifest import (
    build_manifest,
    endpoint_model_entry,
    local_model_entry,
    task_entry,
)
from swiftlm.evaluation.output import PREDICTIONS, output_dir, resolve_compare_folder, write_json
from swiftlm.evaluation.runner import run_task
from swiftlm.evaluation.summary import format_summary, summarize
from swiftlm.evaluation.task_file import check_not_empty, load_tasks
from swiftlm.evaluation.tasks import EvalSettings
from swiftlm.models.config import ModelArguments


def run(cfg: EvalConfig) -> dict:
    check(cfg)
    if cfg.eval.compare:
        return run_compare(cfg)
    if cfg.eval.eval_backend == "lm_eval":
        return run_lm_eval_backend(cfg)
    spec = None if cfg.eval.eval_url else resolve_inference_model(cfg)
    refuse_reward_model(spec)
    cfg = with_run_identity(cfg, spec)
    placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}
    tasks = load_tasks(cfg.eval.eval_dataset, cfg.eval.eval_limit, placeholders)
    check_not_empty(tasks)
    refuse_scoring_without_the_model(cfg, spec, tasks)
    # Before the model loads: bad --dataset fails now, not after the evaluation.
    contamination = contamination_section(cfg, spec, tasks, cfg.eval.contamination_ngram)
    settings = EvalSettings(
        sampling=Sampling.from_flags(cfg.generation, cfg.infer.seed),
        sandbox_timeout=cfg.eval.sandbox_timeout,
        sandbox_memory_mb=cfg.eval.sandbox_memory_mb,
        judge=_judge(cfg) if any(t.kind == "judge" for t in tasks) else None,
    )
    started = datetime.now().isoformat(timespec="seconds")
    backend, model_entry = open_backend(cfg, spec)
    out = output_dir(cfg, spec, backend)
    save_config(cfg, out / "config.yaml", UNUSED_FLAGS["eval"])
    print(f"Evaluating {backend.description} on {len(tasks)} task(s); results: {out}", flush=True)
    wall = time.perf_counter()
    try:
        summary, entries = run_tasks(cfg, tasks, backend, settings, out / PREDICTIONS)
    finally:
        backend.close()
    report = {"tasks": summary, "wall_s": round(time.perf_counter() - wall, 1)}
    if contamination:
        report["contamination"] = contamination["summary"]
        write_json(out / "contamination.json", contamination)
    write_json(out / "summary.json", report)
    manifest = build_manifest(
        model=model_entry,
        sampling=settings.sampling,
        tasks=entries,
        backend="native",
        started=started,
    )
    write_json(out / "manifest.json", manifest)
    print(format_summary(summary), flush=True)
    _warn_unread_verdicts(summary)
    _print_contamination(contamination)
    print(f"wall time {report['wall_s']} s; predictions, summary and manifest in {out}", flush=True)
    return report


def run_tasks(cfg: EvalConfig, tasks, backend, settings: EvalSettings, path: Path):
    """Each task in turn, its records written as soon as it is done; (summary, manifest
    entries) by task name."""
    chat = bool(getattr(getattr(backend, "tokenizer", None), "chat_template", True))
    summary, entries = {}, {}
    with path.open("w", encoding="utf-8") as predictions:
        for task in tasks:
            print(f"{task.name}: {len(task.samples)} {task.kind} samples ...", flush=True)
            result = run_task(task, backend, settings, chat=chat)
            for record in result.records:
                predictions.write(json.dumps(record, ensure_ascii=False) + "\n")
            predictions.flush()
            summary[task.name] = summarize(
                result, cfg.eval.confidence, cfg.eval.bootstrap_resamples, cfg.infer.seed
            )
            entries[task.name] = task_entry(task, "chat" if chat else "completion")
    return summary, entries


def refuse_reward_model(spec) -> None:
    """A reward model scores conversations and generates nothing: its tasks are not these."""
    if spec is not None and is_reward_model(spec):
        raise ConfigError(
            f"{spec.description} is a reward model (a score head, no text to generate); score "
            "conversations with `swiftlm infer --task score --val_dataset FILE` instead"
        )


def refuse_scoring_without_the_model(cfg: EvalConfig, spec, tasks) -> None:
    """Perplexity and multiple-choice tasks score given text with the transformers model,
    which only --infer_backend pt holds; refused before vLLM spends a minute starting."""
    scored = [t.name for t in tasks if t.kind in ("perplexity", "multiple_choice")]
    if spec is not None and cfg.infer.infer_backend != "pt" and scored:
        raise ConfigError(
            f"--eval_dataset: {', '.join(scored)} score given text by log-likelihood, which "
            f"--infer_backend {cfg.infer.infer_backend} does not give swiftlm; evaluate them "
            "with --infer_backend pt (generation and code tasks run on either)"
        )


def with_run_identity(cfg: EvalConfig, spec) -> EvalConfig:
    """A run's --model_name/--model_author fill the probes' {{NAME}} and {{AUTHOR}} (the name
    the run taught), unless this command sets them."""
    saved = Path(spec.ckpt_dir) / "config.yaml" if spec is not None and spec.ckpt_dir else None
    if saved is None or not saved.is_file():
        return cfg
    run_model = load_run_config(saved).model
    defaults = ModelArguments()
    model = dataclasses.replace(
        cfg.model,
        model_name=run_model.model_name
        if cfg.model.model_name == defaults.model_name
        else cfg.model.model_name,
        model_author=run_model.model_author
        if cfg.model.model_author == defaults.model_author
        else cfg.model.model_author,
    )
    return dataclasses.replace(cfg, model=model)


def open_backend(cfg: EvalConfig, spec):
    """(backend, the manifest's model entry): the served model, or `spec` loaded locally."""
    if spec is None:
        backend = EndpointBackend(
            cfg.eval.eval_url,
            cfg.model.model,
            cfg.eval.api_key,
            concurrency=cfg.infer.max_batch_size,
        )
        return backend, endpoint_model_entry(backend)
    print(f"Loading {spec.description}", flush=True)
    engine = engine_for_model(
        spec, cfg.model, cfg.infer.seed, cfg.infer.max_batch_size,
        options=EngineOptions.of(cfg.infer),
    )  # fmt: skip
    return LocalBackend(engine, spec.description), local_model_entry(spec, engine)


def _judge(cfg: EvalConfig) -> EndpointBackend:
    import os

    if not cfg.eval.judge_url:
        raise ConfigError(
            "--eval_dataset has a judge task: give the judge model's OpenAI-compatible server "
            "with --judge_url (and --judge_model)"
        )
    key = os.environ.get("SWIFTLM_JUDGE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return EndpointBackend(cfg.eval.judge_url, cfg.eval.judge_model, key, flag="--judge_url")


def run_compare(cfg: EvalConfig) -> dict:
    first, second = (resolve_compare_folder(f) for f in cfg.eval.compare)
    comparison = compare_results(
        load_results(first),
        load_results(second),
        confidence=cfg.eval.confidence,
        resamples=cfg.eval.bootstrap_resamples,
        seed=cfg.infer.seed,
    )
    print(format_comparison(comparison), flush=True)
    result = comparison_to_json(comparison)
    if cfg.eval.eval_output_dir:
        out = Path(cfg.eval.eval_output_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "compare.json", result)
        print(f"comparison written to {out / 'compare.json'}", flush=True)
    return result


def _warn_unread_verdicts(summary: dict) -> None:
    for task, result in summary.items():
        unread = result["metrics"].get("judge_unparsed", {}).get("mean", 0.0)
        if unread > 0.1:
            print(
                f"{task}: {unread:.0%} of the judge's verdicts had no [[A]]/[[B]]/[[C]] and "
                "count as ties; the judge model is too weak for this prompt, or needs more "
                "tokens (see the `judge` field of predictions.jsonl)",
                flush=True,
            )


def _print_contamination(section: dict | None) -> None:
    if not section:
        return
    for task, result in section["summary"]["tasks"].items():
        print(
            f"contamination {task}: {result['contaminated']} of {result['checked']} samples "
            f"share a {section['summary']['n']}-gram with the training data"
            + (f" ({result['too_short']} too short to check)" if result["too_short"] else ""),
            flush=True,
        )
