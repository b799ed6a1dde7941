"""Rules between the flags of `swiftlm eval` (see rules.py), and of evaluation during training."""

from swiftlm.config.checks import Rule
from swiftlm.config.rules_export import CKPT_DIR_OR_ADAPTERS_RULE

EVAL_RULES = (
    Rule(
        "eval_needs_tasks",
        lambda c, f: not c.eval.compare and not c.eval.eval_dataset,
        "give the tasks to evaluate with --eval_dataset (e.g. --eval_dataset swiftlm/quick), "
        "or two finished evaluations with --compare A B",
    ),
    Rule(
        "compare_loads_no_model",
        lambda c, f: (
            bool(c.eval.compare)
            and bool(c.eval.eval_dataset or c.eval.eval_url or c.infer.ckpt_dir or c.infer.adapters)
        ),
        "--compare reads two finished evaluations and loads no model; drop --eval_dataset, "
        "--eval_url, --ckpt_dir and --adapters (or run the evaluation first, then compare)",
    ),
    Rule(
        "eval_url_or_local_model",
        lambda c, f: bool(c.eval.eval_url) and bool(c.infer.ckpt_dir or c.infer.adapters),
        "--eval_url evaluates a served model; --ckpt_dir and --adapters load a local one: "
        "give one or the other",
    ),
    Rule(
        "lm_eval_runs_locally",
        lambda c, f: c.eval.eval_backend == "lm_eval" and bool(c.eval.eval_url),
        "--eval_backend lm_eval runs on a local model; for a served one use the native "
        "backend with --eval_url, or lm-eval's own local-chat-completions model",
    ),
    Rule(
        "num_fewshot_is_lm_eval",
        lambda c, f: c.eval.eval_num_fewshot is not None and c.eval.eval_backend != "lm_eval",
        "--eval_num_fewshot is for --eval_backend lm_eval (native tasks put their examples in "
        "the data)",
    ),
    CKPT_DIR_OR_ADAPTERS_RULE,
)

TRAIN_EVAL_RULES = (
    Rule(
        "best_model_needs_evaluation",
        lambda c, f: (
            bool(c.evaluation.metric_for_best_model)
            and not (c.data.val_dataset or c.data.split_dataset_ratio or c.evaluation.eval_dataset)
        ),
        "--metric_for_best_model {metric_for_best_model} needs evaluations to compare: give "
        "--val_dataset (eval_loss) or --eval_dataset (generation metrics)",
    ),
)
