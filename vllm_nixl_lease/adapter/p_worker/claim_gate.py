"""P worker: readers on several Ds (``kv_lease_claim_reads``; ``docs/PROTOCOL.md``
rule P14).  Off the hot path: a P without the setting builds none, and with it
a step's notifications are looked at here only while some lease has holders.

- Claims (``claim``, from ``ack_answerer.py``): a version-4 agent's answered
  heartbeat names leases held here; each becomes a holder
  (``prefill/lease_holders.py``).  A claim past ``MAX_HOLDERS_PER_LEASE`` is
  refused: the caller answers that name "not held" (D then does not read it).
- Completions (``gate``, before the router): ``<id>:<count>`` of a lease with
  holders is let through only from its last holder; a holder's completion
  while another remains is held back (the lease stays), one from an agent
  that is not a holder is ignored and counted
  (``num_completions_ignored_held``); when the last of several holders
  finishes the lease is freed at once, whatever count its completions said.
- Forgetting: everything about a lease goes when it is freed, by completion,
  expiry or release (``LeaseKeeper``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vllm.logger import init_logger

from ..._wire import ESCAPE_PREFIX, HEARTBEAT_ACK_PREFIX, HEARTBEAT_PREFIX, PUSH_REG_PREFIX, parse_completion
from ...lease_tags import lease_tag
from ...prefill.lease_holders import Completion, LeaseHolders
from ...prefill.notification_router import NotificationRouter
from ..ratelimit import RateLimitedLog
from ..upstream import UpstreamWorker

logger = init_logger(__name__)

_NOT_COMPLETIONS = (HEARTBEAT_PREFIX, ESCAPE_PREFIX, HEARTBEAT_ACK_PREFIX, PUSH_REG_PREFIX)


class ClaimGate:
    """Holders per lease, and the completions they let through."""

    def __init__(self, upstream: UpstreamWorker, router: NotificationRouter, holders: LeaseHolders) -> None:
        self._upstream = upstream
        self._router = router
        self.holders = holders
        self.tag_key: bytes | None = None  # P's (LeaseKeeper.adopt_instance): tags of completed ids
        self._log_refused = RateLimitedLog(logger)
        self._log_ignored = RateLimitedLog(logger)

    def claim(self, agent: str, names: Iterable[str]) -> tuple[bool, list[str]]:
        """``agent`` (version 4) named ``names`` in a heartbeat P found them held
        in.  Returns (a new holder of some: answer now, the names refused)."""
        holders = self.holders
        new = False
        refused: list[str] = []
        for name in names:
            if not name:
                continue
            claimed = holders.claim(name, agent)
            if claimed is None:
                refused.append(name)
            elif claimed:
                new = True
        if refused:
            self._upstream.xfer_stats.add("num_claims_refused", len(refused))
            self._log_refused.warning(
                len(refused),
                "Refused %d read claim(s) from %.64s: a lease has %d holders already (e.g. %s); "
                "answered not held, so that D does not read it",
                len(refused),
                agent,
                len(holders.holders(refused[0])),
                refused[0],
            )
        return new, refused

    def _keys(self, req_id: str) -> tuple[str, ...]:
        if self.tag_key is None:
            return (req_id,)
        try:
            return (req_id, lease_tag(req_id, self.tag_key))
        except (TypeError, ValueError):
            return (req_id,)

    def forget(self, req_ids: Iterable[str]) -> None:
        holders = self.holders
        if not holders:
            return
        for req_id in req_ids:
            holders.forget(self._keys(req_id))

    def gate(self, notifs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The step's notifications less the completions holders keep back, and
        the leases freed here (their last holder finished)."""
        holders = self.holders
        out: dict[str, Any] = {}  # what the router takes: malformed items stay for it to count
        freed: list[str] = []
        ignored = 0
        sample = ""
        for agent, messages in notifs.items():
            if not isinstance(messages, (list, tuple)):
                out[agent] = messages  # the router counts it as malformed
                continue
            kept: list[Any] | None = None
            for i, msg in enumerate(messages):
                verdict = Completion.PASS
                if isinstance(msg, bytes) and not msg.startswith(_NOT_COMPLETIONS):
                    parsed = parse_completion(msg)
                    if parsed is not None:
                        verdict = holders.completed(self._keys(parsed[0]), agent)
                        if verdict is Completion.IGNORED:
                            ignored += 1
                            sample = sample or parsed[0]
                        elif verdict is Completion.FREE:
                            freed.append(parsed[0])
                if verdict is Completion.PASS:
                    if kept is not None:
                        kept.append(msg)
                elif kept is None:
                    kept = list(messages[:i])
            out[agent] = messages if kept is None else kept
        router = self._router
        really: list[str] = []
        for req_id in freed:
            router.discard_in_batch(req_id)
            if router.release(req_id):
                really.append(req_id)
        stats = self._upstream.xfer_stats
        if freed:
            stats.add("num_claimed_leases_freed", len(really))
        if ignored:
            stats.add("num_completions_ignored_held", ignored)
            self._log_ignored.warning(
                ignored,
                "Kept %d lease(s) whose completion came from a D agent that does not hold them while "
                "another does (e.g. %.64s): freed when their holders finish, or at expiry",
                ignored,
                sample,
            )
        return out, really
