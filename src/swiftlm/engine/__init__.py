"""The continuous-batching generation engine: requests in, token deltas out.

It runs over any transformers causal LM (peft adapters included) and knows nothing of
files, configs or servers, so every layer that generates builds on it: `swiftlm infer` and
`swiftlm deploy` (through `infer.engine.build_engine`, which loads a model folder) and the
online training methods (GRPO, GKD), which sample from the live policy being trained.
"""
