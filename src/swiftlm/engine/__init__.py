"""The generation engines and how they are built: requests in, token deltas (or scores) out.

The core, the continuous-batching engine (`protocol.py`, `continuous.py` and what it runs:
`inbox.py` (what callers' threads hand its loop thread), `scheduler.py`, `kvcache.py`, `prefix_cache.py`, `windows.py`, `speculation.py`,
`sampling.py`, `detokenize.py`, `sequence.py`, and the structured-output grammars of
`grammar.py`), runs over any transformers causal LM (peft
adapters included) and knows nothing of files, configs or servers (a contract in
pyproject.toml holds it to that), so every layer that generates builds on it: the online
training methods (GRPO, GKD) sample from the live policy being trained with it.

Beside the core, what reads files: `build.py` builds an engine for a model folder, a run or
adapters (`swiftlm infer`, `deploy` and `eval` start there), `vision.py` is the
vision-language engine (transformers' generate behind the same interface), `score.py` the
reward-model scorer (one forward pass, no generation), `vllm_backend.py` vLLM's engine
behind the same interface (`--infer_backend vllm`), `vllm_weight_sync.py` a trainer's weights
pushed into a running vLLM over a collective (`swiftlm rollout`, `--vllm_mode server`).
"""
