"""`swiftlm infer --task score`: write each --val_dataset conversation's reward, with a reward
model (the scorer: `engine/score.py`).

`check_task` refuses --task score on a model without a reward head and --task generate on a
reward model. Each line of the results file is
`{"messages": [...], "score": float, "source": "path:line"}`.
"""

import time
from functools import partial

from swiftlm.config import InferConfig
from swiftlm.data.loading import load_samples
from swiftlm.engine.build import InferenceModel
from swiftlm.engine.score import is_reward_model, load_scorer, score_sample
from swiftlm.errors import ConfigError, DataError
from swiftlm.infer.batch import make_parent, result_path, write_results

TRAIN_ONE = (
    "train one with `swiftlm rlhf --rlhf_type rm` and pass its run directory with --ckpt_dir"
)


def check_task(task: str, spec: InferenceModel) -> None:
    """--task score needs a reward model, and a reward model cannot generate."""
    reward = is_reward_model(spec)
    if task == "score" and not reward:
        raise ConfigError(
            f"--task score: {spec.description} has no reward head (it is not a "
            f"sequence-classification model); {TRAIN_ONE}"
        )
    if task == "generate" and reward:
        raise ConfigError(
            f"{spec.description} is a reward model (a sequence-classification head): it "
            "scores conversations and cannot generate; use --task score with --val_dataset"
        )


def run_scoring(cfg: InferConfig, spec: InferenceModel) -> list[dict]:
    """Score every --val_dataset conversation, write the results file, return its records."""
    samples = load_conversations(cfg, spec.system)
    path = result_path(cfg, spec)
    make_parent(path)  # fail before loading the model, not after
    print(f"Loading {spec.description} (reward model)", flush=True)
    scorer = load_scorer(spec, cfg.model, cfg.infer.max_batch_size)
    rows = [scorer.encode(s["messages"]) for s in samples]
    for ids, sample in zip(rows, samples, strict=True):
        problem = scorer.too_long(ids)
        if problem:
            raise DataError(f"{sample['source']}: {problem}")
    start = time.perf_counter()
    scores = scorer.score_ids(rows)
    seconds = time.perf_counter() - start
    records = [
        {"messages": s["messages"], "score": score, "source": s["source"]}
        for s, score in zip(samples, scores, strict=True)
    ]
    write_results(path, records)
    tokens = sum(map(len, rows))
    print(
        f"Scored {len(records)} conversations in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):.0f} tokens/s); results: {path}",
        flush=True,
    )
    return records


def load_conversations(cfg: InferConfig, system: str | None) -> list[dict]:
    """The --val_dataset conversations to score, each ending with its answer."""
    samples, report = load_samples(
        cfg.data.val_dataset,
        partial(score_sample, system=system),
        skip_bad_rows=cfg.data.skip_bad_rows,
        seed=cfg.data.data_seed,
    )
    if report.skipped:
        print(f"--val_dataset: {report.summary()}", flush=True)
    for line in report.notices("infer --task score"):
        print(f"--val_dataset: {line}", flush=True)
    return samples
