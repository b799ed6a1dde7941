"""Pure loss math shared by the training methods: token cross-entropy sums and the fused
chunked LM-head loss. No state, no distributed code: every function is tested on its own."""
