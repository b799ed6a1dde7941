"""`swiftlm eval`: evaluate a local model, a training run or a served endpoint on tasks
(`swiftlm.eval`), write reproducible results, and compare two evaluations."""
