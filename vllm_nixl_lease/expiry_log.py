"""How expired leases are logged: one WARNING line per sweep, detail at DEBUG.

Upstream logs one WARNING per expired lease (~7.6 us each); when a decode
instance dies with thousands of requests queued, that alone stalls the engine
step.  The summary keeps upstream's wording so existing log alerts still match.
"""

from __future__ import annotations

import logging

SUMMARY_IDS = 5  # request ids quoted in the summary line


def log_expired(logger: logging.Logger, expired: list[tuple[str, int]]) -> int:
    """Log ``(req_id, reads_seen)`` pairs of one sweep; return how many had
    been read by at least one consumer before their lease expired."""
    if not expired:
        return 0
    read = 0
    debug = logger.isEnabledFor(logging.DEBUG)
    for req_id, count in expired:
        read += count > 0
        if debug:
            logger.debug(
                "Releasing expired KV blocks for request %s which were retrieved by %d remote "
                "worker(s) before lease expired.",
                req_id,
                count,
            )
    more = len(expired) - SUMMARY_IDS
    logger.warning(
        "Releasing expired KV blocks for %d request(s) whose lease expired (%s%s); %d had been "
        "retrieved by at least one remote worker.",
        len(expired),
        ", ".join(req_id for req_id, _ in expired[:SUMMARY_IDS]),
        f", +{more} more" if more > 0 else "",
        read,
    )
    return read
