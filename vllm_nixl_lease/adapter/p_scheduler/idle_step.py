"""P scheduler: mark a step idle (nothing to compute, nothing to read), so the
worker may pause it while only unread leases keep the engine busy
(``p_worker/idle_pause.py``)."""

from __future__ import annotations


def step_is_idle(scheduler_output: object, meta: object) -> bool:
    """Scheduler side: nothing to compute and nothing to read this step."""
    tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    return tokens == 0 and not getattr(meta, "reqs_to_recv", None) and not getattr(meta, "reqs_to_save", None)
