"""D scheduler's intake: arrivals and departures queued by the hooks, applied
in order once per step (``_intake_py.py`` is the reference; the Cython module
behaves identically)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._implementation import choose
from ._intake_py import heartbeat_target  # a pure function: the one both cores' callers share

if TYPE_CHECKING:
    from ._intake_py import Intake
else:
    Intake = choose(__package__, "_intake_c", "_intake_py").Intake

__all__ = ["Intake", "heartbeat_target"]
