"""`swiftlm eval --eval_backend lm_eval`: lm-evaluation-harness tasks on swiftlm's engine.

lm-eval computes its own metrics (and stderrs); swiftlm writes them as lm-eval reports them
(`lm_eval_results.json`), and also as the native records (`predictions.jsonl`: one line per
document with its per-sample metrics) so the summary's bootstrap intervals and `--compare`
work the same for both backends.
"""

import json
import time
from datetime import datetime

from swiftlm.checkpoint.resolve import resolve_inference_model
from swiftlm.config import UNUSED_FLAGS, EvalConfig, save_config
from swiftlm.engine.build import EngineOptions, engine_for_model
from swiftlm.errors import ConfigError
from swiftlm.evaluation.backends import Sampling
from swiftlm.evaluation.lm_eval_bridge import (
    flatten_results,
    flatten_stderrs,
    prepare_tasks,
    run_lm_eval,
)
from swiftlm.evaluation.manifest import build_manifest, library_versions, local_model_entry
from swiftlm.evaluation.output import PREDICTIONS, output_dir, write_json
from swiftlm.evaluation.stats import bootstrap_interval


def run_lm_eval_backend(cfg: EvalConfig) -> dict:
    started = datetime.now().isoformat(timespec="seconds")
    prepared = prepare_tasks(cfg.eval.eval_dataset)  # bad task names fail before the model loads
    spec = resolve_inference_model(cfg)
    if cfg.infer.infer_backend != "pt":
        raise ConfigError(
            f"--eval_backend lm_eval with --infer_backend {cfg.infer.infer_backend}: the "
            "lm-eval bridge scores with the transformers model, which swiftlm holds with "
            "--infer_backend pt only; drop the flag (or run lm-eval's own vllm model)"
        )
    print(f"Loading {spec.description}", flush=True)
    engine = engine_for_model(
        spec, cfg.model, cfg.infer.seed, cfg.infer.max_batch_size,
        options=EngineOptions.of(cfg.infer),
    )  # fmt: skip
    out = output_dir(cfg, spec, None)
    save_config(cfg, out / "config.yaml", UNUSED_FLAGS["eval"])
    wall = time.perf_counter()
    try:
        results = run_lm_eval(
            engine,
            cfg.eval.eval_dataset,
            limit=cfg.eval.eval_limit,
            num_fewshot=cfg.eval.eval_num_fewshot,
            seed=cfg.infer.seed,
            prepared=prepared,
        )
    finally:
        engine.shutdown()
    seconds = time.perf_counter() - wall
    metrics, stderrs = flatten_results(results), flatten_stderrs(results)
    records = sample_records(results, metrics)
    with (out / PREDICTIONS).open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    summary = {"tasks": summarize_records(records, cfg), "wall_s": round(seconds, 1)}
    summary["lm_eval"] = {"metrics": metrics, "stderrs": stderrs}
    write_json(out / "summary.json", summary)
    write_json(
        out / "lm_eval_results.json",
        {k: results[k] for k in ("results", "configs", "versions", "n-samples") if k in results},
    )
    manifest = build_manifest(
        model=local_model_entry(spec, engine),
        sampling=Sampling.from_flags(cfg.generation, cfg.infer.seed),
        tasks={
            t: {"lm_eval_task": t, "config": results.get("configs", {}).get(t)} for t in metrics
        },
        backend=f"lm_eval {library_versions().get('lm_eval', '?')}",
        started=started,
    )
    write_json(out / "manifest.json", json.loads(json.dumps(manifest, default=str)))
    for task, values in metrics.items():
        shown = ", ".join(f"{m} {v:.4f}" for m, v in values.items() if isinstance(v, int | float))
        print(f"{task}: {shown}", flush=True)
    print(f"wall time {seconds:.1f} s; results in {out}", flush=True)
    return summary


def sample_records(results: dict, metrics: dict) -> list[dict]:
    """lm-eval's per-document logs as swiftlm records (metrics that are per-sample numbers)."""
    records = []
    for task, samples in (results.get("samples") or {}).items():
        names = [m for m in metrics.get(task, {}) if "," not in m]
        for sample in samples:
            scores = {
                m: float(sample[m]) for m in names if isinstance(sample.get(m), int | float | bool)
            }
            response = sample.get("filtered_resps") or sample.get("resps") or [None]
            records.append(
                {
                    "task": task,
                    "id": f"doc {sample.get('doc_id')}",
                    "prompt": _first_argument(sample),
                    "prediction": response[0]
                    if not isinstance(response[0], list)
                    else response[0][0],
                    "reference": sample.get("target"),
                    "scores": scores,
                }
            )
    return records


def _first_argument(sample: dict):
    arguments = sample.get("arguments") or []
    first = arguments[0] if arguments else None
    if isinstance(first, (list, tuple)) and first:
        return first[0]
    return first


def summarize_records(records: list[dict], cfg: EvalConfig) -> dict:
    out: dict = {}
    for record in records:
        task = out.setdefault(
            record["task"], {"kind": "lm_eval", "n": 0, "metrics": {}, "_values": {}}
        )
        task["n"] += 1
        for metric, value in record["scores"].items():
            task["_values"].setdefault(metric, []).append(value)
    for task in out.values():
        for metric, values in task.pop("_values").items():
            interval = bootstrap_interval(
                values,
                confidence=cfg.eval.confidence,
                resamples=cfg.eval.bootstrap_resamples,
                seed=cfg.infer.seed,
            )
            task["metrics"][metric] = {
                "mean": interval.mean,
                "low": interval.low,
                "high": interval.high,
                "confidence": cfg.eval.confidence,
                "n": len(values),
            }
    return out
