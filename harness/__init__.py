"""Test and benchmark harness shared by ``tests/`` and ``tools/`` (not shipped):

- ``harness.nixl``: real NIXL P and D engine processes, stepped like vLLM's;
- ``harness.serve``: real ``vllm serve`` P/D pairs behind ``vllm-router``, a
  real Prometheus, and the scenarios the e2e tests and the demo share;
- ``harness.chaos``: ``make chaos``, seeded faults over both harnesses and a checker;
- ``harness.procs``: the processes both harnesses start (a leaf: imports nothing of ours);
- ``harness.netns``: hosts on one machine (network namespaces on a bridge);
- ``harness.upstream_fake``: the one fake of vLLM's NIXL worker;
- ``harness.fake_clock``, ``harness.tiny_model``: a hand-driven clock, a
  vLLM model config with nothing to load;
- ``harness.import_graph``, ``harness.fresh_imports``: the import checks
  (``tests/harness/test_import_cycles.py``).

Importing it sets ``VLLM_TARGET_DEVICE=cpu`` unless set: vLLM's CUDA wheel
must see it before it is imported, and this package is what tests and tools
import first.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
