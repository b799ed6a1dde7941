"""Config sections of evaluation: `swiftlm eval` (`EvalArguments`) and evaluation during
training (`TrainEvalArguments`, part of `swiftlm sft/pt/rlhf`). Same conventions as
`config/sections.py`: field names are the flag names, each field's `help` is its `--help` text, each
section checks its own fields when built.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, custom, within
from swiftlm.config.sections import doc

EVAL_DATASET_HELP = (
    "What to evaluate on, several at once: built-in tasks (swiftlm/quick, the offline suite; "
    "swiftlm/humaneval, swiftlm/general-qa-eval, swiftlm/self-cognition-probes, "
    "swiftlm/heldout-text), task YAML files, or data files whose columns say the task: "
    "`text` (perplexity), `messages`/`query`+`response` (generation against the reference), "
    "`question`+`choices`+`answer` (multiple choice by log-likelihood), `prompt`+`test`+"
    "`entry_point` (code, run in a sandbox). With --eval_backend lm_eval: lm-eval task names "
    "or task YAML files."
)


@dataclass
class EvalArguments:
    eval_dataset: list[str] = doc(EVAL_DATASET_HELP, default_factory=list)
    eval_limit: int | None = doc(
        "Evaluate at most the first N samples of each task (the same N samples every time).",
        default=None,
    )
    eval_backend: Literal["native", "lm_eval"] = doc(
        "native: swiftlm's tasks and metrics. lm_eval: lm-evaluation-harness tasks run "
        "through swiftlm's engine (the eval extra: pip install 'swiftlm[eval]').",
        default="native",
    )
    eval_url: str | None = doc(
        "Evaluate a served model instead of a local one: the base URL of an OpenAI-compatible "
        "server (e.g. http://127.0.0.1:8000/v1, `swiftlm deploy` included). --model then names "
        "the served model (default: the first one the server lists).",
        default=None,
    )
    api_key: str | None = doc(
        "Bearer token for --eval_url (default: the OPENAI_API_KEY environment variable).",
        default=None,
    )
    eval_output_dir: str | None = doc(
        "Where to write predictions.jsonl, summary.json and manifest.json. Default: "
        "<run dir>/eval/<timestamp> for --ckpt_dir, else eval_output/<model>-<timestamp>.",
        default=None,
    )
    compare: list[str] = doc(
        "Compare two finished evaluations (their output folders, or run directories holding "
        "eval/ results) on the samples they share: the paired difference of every metric, "
        "its interval and p-value. Loads no model.",
        default_factory=list,
    )
    eval_num_fewshot: int | None = doc(
        "lm_eval backend: few-shot examples per prompt (default: each task's own).", default=None
    )
    judge_url: str | None = doc(
        "Judge tasks: the OpenAI-compatible server of the judge model (its key: "
        "SWIFTLM_JUDGE_API_KEY or OPENAI_API_KEY).",
        default=None,
    )
    judge_model: str | None = doc(
        "Judge tasks: the judge's model name (default: the first one its server lists).",
        default=None,
    )
    sandbox_timeout: float = doc(
        "Code tasks: wall-clock seconds each generated program may run.", default=10.0
    )
    sandbox_memory_mb: int = doc(
        "Code tasks: memory (address space) each generated program may use, in MiB.",
        default=1024,
    )
    confidence: float = doc("Confidence level of the bootstrap intervals.", default=0.95)
    bootstrap_resamples: int = doc("Bootstrap resamples per interval.", default=10_000)
    contamination_ngram: int = doc(
        "Contamination check: word n-gram length shared between training and evaluation "
        "samples that marks an evaluation sample as seen (13, as GPT-3 and lm-eval); 0 skips "
        "the check.",
        default=13,
    )

    def __post_init__(self):
        check_fields(
            self,
            eval_limit=at_least(1),
            compare=custom(
                lambda v: len(v) in (0, 2),
                "--{flag} takes two evaluation folders (A then B); got {value}",
            ),
            eval_num_fewshot=at_least(0),
            sandbox_timeout=above(0),
            sandbox_memory_mb=at_least(64),
            confidence=within(0, 1, open_low=True, open_high=True),
            bootstrap_resamples=at_least(100),
            contamination_ngram=custom(
                lambda v: v == 0 or v >= 4, "--{flag} {value} must be 0 (no check) or at least 4"
            ),
        )


@dataclass
class TrainEvalArguments:
    eval_dataset: list[str] = doc(
        "Generation-based evaluation every --eval_steps (and at the end), besides the "
        "validation loss: the tasks of `swiftlm eval --eval_dataset` (native ones), logged "
        "as eval/<task>/<metric> to metrics.jsonl and the report.",
        default_factory=list,
    )
    eval_limit: int | None = doc(
        "Evaluate at most the first N samples of each --eval_dataset task.", default=None
    )
    eval_max_new_tokens: int = doc(
        "Most tokens generated per answer during evaluation (greedy).", default=256
    )
    metric_for_best_model: str | None = doc(
        "Keep the checkpoint with the best value of this logged metric (e.g. eval_loss or "
        "eval/general_qa_eval/rouge_l): --save_total_limit never deletes it, and "
        "best_checkpoint.json names it.",
        default=None,
    )
    greater_is_better: bool | None = doc(
        "Whether a larger --metric_for_best_model is better. Default: false for names ending "
        "in loss or perplexity, true otherwise.",
        default=None,
    )

    def __post_init__(self):
        check_fields(self, eval_limit=at_least(1), eval_max_new_tokens=at_least(1))

    @property
    def higher_is_better(self) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        name = (self.metric_for_best_model or "").lower()
        return not name.endswith(("loss", "perplexity", "nll_per_token"))
