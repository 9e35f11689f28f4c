"""Tools on top of vllm_nixl_lease: benchmark, demo, P/D harness (``python -m tools.<name>``)."""
