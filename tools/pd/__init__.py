"""Real `vllm serve` prefill/decode harness: local model assets, P/D launcher, router, teardown."""
