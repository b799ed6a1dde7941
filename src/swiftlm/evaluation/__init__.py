"""Evaluation: the `swiftlm eval` command and everything it runs, also used during training.

- `run.py`: the command (a model, a run or a served endpoint on tasks; `--compare A B`);
  `lm_eval_run.py`: its `--eval_backend lm_eval` path, on `lm_eval_bridge.py` (the
  lm-evaluation-harness model interface over swiftlm's engine);
- `tasks.py`: what a task, a sample and a sample's record are; `task_file.py`: where tasks come
  from (data files, task YAMLs, the built-in tasks and their registry, `BUILTIN_TASKS`);
- one module per task kind, each reading its rows and running its samples (`runner.KINDS`):
  `generation.py` (with its extraction rules and metrics), `perplexity.py`,
  `multiple_choice.py`, `code.py` (HumanEval, run in `sandbox.py`), `judge.py`;
- `backends.py`: where answers come from (the local engine, an OpenAI-compatible server);
  `loglik.py`: log-likelihoods under a local model;
- `summary.py`, `stats.py` (bootstrap intervals, McNemar), `compare.py` (`--compare`);
- `manifest.py`, `output.py`: what an evaluation writes, where, and how it is reproduced;
- `contamination.py`: which evaluation samples the training data saw;
- `live.py`: the tasks on the model being trained (`train/evaluation.py` calls it).
"""
