"""Online methods, which sample their own training data each step on the engine from the
live policy: GRPO (and its DAPO, Dr. GRPO, GSPO, RLOO variants) and on-policy distillation
(GKD), with what they share: prompt batches (`online`), rollouts on the engine
(`rollout`), GRPO's generations (`grpo_rollouts`), reward functions and their calls."""
