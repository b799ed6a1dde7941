"""Evaluation: run benchmarks on a model, compare two evaluations, check for contamination."""
