"""Pure loss math shared by the training methods: token cross-entropy (summed, or per token
for per-sequence sums), and the fused chunked LM-head loss in both forms. No state, no
distributed code: every function is tested on its own."""
