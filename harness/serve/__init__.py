"""Real `vllm serve` prefill/decode harness: local model assets, P/D launcher,
router, Prometheus, teardown, and the scenarios the e2e tests and the demo share."""
