"""Tools on top of vllm_nixl_lease: benchmarks and the demo (``python -m tools.<name>``).

They build on ``harness`` (importing it sets ``VLLM_TARGET_DEVICE=cpu`` before
any tool imports vLLM).
"""

import harness  # noqa: F401
