"""How expired leases are logged: one WARNING line per sweep, detail at DEBUG.

Upstream logs one WARNING per expired lease; when a decode instance dies
with thousands of requests queued, that alone stalls the engine step.  The
summary keeps upstream's wording so existing log alerts still match.
"""

from __future__ import annotations

import logging

from .route_result import Expiry

SUMMARY_IDS = 5  # request ids quoted in the summary line


def log_expired(logger: logging.Logger, expired: Expiry) -> int:
    """Log one sweep's expired leases; return how many had been read by at
    least one consumer before their lease expired."""
    ids, reads = expired
    if not ids:
        return 0
    if logger.isEnabledFor(logging.DEBUG):
        for req_id in ids:
            logger.debug(
                "Releasing expired KV blocks for request %s which were retrieved by %d remote "
                "worker(s) before lease expired.",
                req_id,
                reads.get(req_id, 0),
            )
    more = len(ids) - SUMMARY_IDS
    logger.warning(
        "Releasing expired KV blocks for %d request(s) whose lease expired (%s%s); %d had been "
        "retrieved by at least one remote worker.",
        len(ids),
        ", ".join(ids[:SUMMARY_IDS]),
        f", +{more} more" if more > 0 else "",
        len(reads),
    )
    return len(reads)
