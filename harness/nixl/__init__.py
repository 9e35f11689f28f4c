"""Real-NIXL P/D harness: engine processes driven step by step like vLLM's.

``Fleet`` starts P and D engines (our connector or stock upstream's) as
separate processes (``EngineProcess``, the parent's handle on one); each holds
real CPU KV caches registered with NIXL/UCX.  See ``engine.py`` for what one
step does and ``fleet.py`` for the control protocol.
"""

from .fleet import EngineError, EngineProcess, Fleet, SidePortTaken, wait_for
from .spec import EngineSpec

__all__ = ["EngineError", "EngineProcess", "EngineSpec", "Fleet", "SidePortTaken", "wait_for"]
