"""Rate-limited logging for events a misbehaving peer can trigger at line rate."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """Log at most once per ``period`` seconds; report how many were skipped."""

    __slots__ = ("_logger", "_period", "_next", "_suppressed")

    def __init__(self, logger: logging.Logger, period: float = 10.0) -> None:
        self._logger = logger
        self._period = period
        self._next = 0.0
        self._suppressed = 0

    def warning(self, count: int, msg: str, *args: object) -> bool:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += count
            return False
        self._next = now + self._period
        suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            msg += " (%d more since the last report)"
            args = (*args, suppressed)
        self._logger.warning(msg, *args)
        return True
