"""GPU-side worker: pulls calls from JetStream while its KV cache has room and runs them on vLLM."""
