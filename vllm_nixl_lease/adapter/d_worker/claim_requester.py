"""D worker: claim a lease before reading it, for readers on several Ds
(``kv_lease_claim_reads``; ``docs/PROTOCOL.md`` rule D11; P's side is
``p_worker/claim_gate.py``).

Upstream frees a lease on P at the first completion notification, whichever
D sent it, so a second D holding the same params (a hedged or retried decode,
n > 1 fan-out) could read blocks P already reused.  A P with the setting
advertises version 4 (``_wire.CLAIM_HELLO_VERSION``) and keeps, per lease,
every version-4 agent whose heartbeat it answered "held" as a **holder**; it
frees the lease on a completion only when no other holder remains.  So this
D reads a lease of such a P only once every P rank has answered a heartbeat
naming it "held" (R10 of the spin model):

- a new view of such a P is claimed in the step it arrives: one acknowledged
  heartbeat (``LHB:``/``LHBT:``, recorded in the ledger as any other) naming
  the step's new views of that instance, to every agent of a connection
  proven to reach it.  P answers a claim in the step it arrives, not on its
  answer tick.  Over a connection not proven yet, the first heartbeats D
  sends once it is (the scheduler's chunks, held for the proof) claim it;
- a view is **claimed** once the answer to its claim, or the first answer to
  its chunk's heartbeat (``LeaseViews.answered``), named it held on every
  rank; until then its READ waits (``waiting``; ``ReadFence.parked``, tried
  again every step; an aborted request's parked READ is reported failed), but
  only while its view has more than the margin left: then the fence's margin
  check fences it.  A claim still unanswered after a heartbeat interval (lost
  under a partition, or sent before the connection was proven) is sent again;
- an answer naming it "not held" ends the view (``ack_requester.py``), so the
  READ is fenced (a failed load: vLLM recomputes), and counted here
  (``num_reads_fenced_not_claimed``).

Costs one round trip to P plus P's step before each READ.  A P without the
setting (version 3 or older, stock) advertises no claims: its views are read
as before, never waiting for an answer that would not come.

Bounds: per viewed request (dropped with its view), claims in flight
younger than the longest view extension, and a claim sent again at most once
per heartbeat interval per waiting view.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from vllm.logger import init_logger

from ..._wire import CLAIM_HELLO_VERSION, HEARTBEAT_PREFIX, acked_heartbeat_message, is_tag
from ...decode.ack_ledger import Proven
from ...decode.lease_views import LeaseViews
from ..config import LeaseConfig
from ..metadata import LEASE_VIEWS_ATTR, LeaseViewUpdates
from ..ratelimit import RateLimitedLog
from ..upstream import ReadMeta, UpstreamWorker
from .ack_requester import PROVEN, AckRequester, agent_name

logger = init_logger(__name__)


class ClaimRequester:
    """Claims of this D worker's new views, and which of them P answered held."""

    def __init__(
        self, upstream: UpstreamWorker, views: LeaseViews, requester: AckRequester, lease_config: LeaseConfig
    ) -> None:
        self._upstream = upstream
        self._views = views
        self._requester = requester
        self._tags = lease_config.heartbeat_tags
        self.enabled = lease_config.claim_reads
        self._wanted: set[str] = set()  # local ids whose P takes claims, not claimed yet
        self._counted: set[str] = set()  # ... whose READ was counted as waiting
        # ... -> (engine id, instance, tagged, P's name, when last claimed), to claim them again
        self._claimed: dict[str, tuple[str, str, bool, str, float]] = {}
        self._retry_s = lease_config.heartbeat_interval
        self._retry_at = 0.0  # next look for unanswered claims
        # seq -> ((local id, name), send time) of claims in flight, oldest first
        self._sent: OrderedDict[int, tuple[list[tuple[str, str]], float]] = OrderedDict()
        self._log = RateLimitedLog(logger)

    def __len__(self) -> int:
        """Per-request state held (for bounds tests)."""
        return len(self._wanted) + len(self._sent)

    def has_pending(self) -> bool:
        """Claims in flight or waiting to be sent again: ``note_views`` has work in a
        step with no news (the worker's idle-step shortcut must not skip it)."""
        return bool(self._sent or self._claimed)

    # -- views of the step ---------------------------------------------------
    def note_views(self, metadata: object) -> None:
        """The step's new views of a P that takes claims: wanted, and claimed at
        once over a proven connection; dropped views forgotten."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._claimed and now >= self._retry_at:
            self._claim_again(now)
        if self._sent:  # every step: an idle D's claims in flight age out too
            self._prune(now)
        updates: LeaseViewUpdates | None = getattr(metadata, LEASE_VIEWS_ATTR, None)
        if updates is None:
            return
        self.forget(updates.dropped)
        claimed = self._claimed
        new: list[str] = []
        for local_id, view in updates.new.items():
            if not view.instance or view.hello_version < CLAIM_HELLO_VERSION:
                continue
            self._wanted.add(local_id)
            tagged = self._tags and is_tag(view.name)
            claimed[local_id] = (view.engine_id, view.instance, tagged, view.name, now)
            new.append(local_id)
        if new:
            self._send_claims(new, now)

    def _claim_again(self, now: float) -> None:
        """Claim again each waiting view whose last claim is a heartbeat interval old."""
        self._retry_at = now + self._retry_s / 4
        due = now - self._retry_s
        again = [local_id for local_id, entry in self._claimed.items() if entry[4] <= due]
        if again:
            self._send_claims(again, now)

    def _send_claims(self, local_ids: list[str], now: float) -> None:
        """Claim each of ``local_ids`` (in ``_claimed``), one message per P instance and
        naming kind, and record ``now`` as its last claim."""
        claimed = self._claimed
        groups: dict[tuple[str, str, bool], list[tuple[str, str]]] = {}
        for local_id in local_ids:
            engine_id, instance, tagged, name, _ = claimed[local_id]
            claimed[local_id] = (engine_id, instance, tagged, name, now)
            groups.setdefault((engine_id, instance, tagged), []).append((local_id, name))
        for (engine_id, instance, tagged), named in groups.items():
            self._claim(engine_id, instance, tagged, named, now)

    def _claim(
        self, engine_id: str, instance: str, tagged: bool, named: list[tuple[str, str]], now: float
    ) -> None:
        requester = self._requester
        if requester.proof(engine_id, instance) != PROVEN:
            return  # the chunks' heartbeats, held for the proof, claim these views once it comes
        agents = list((self._upstream._remote_agents.get(engine_id) or {}).values())
        if not agents:
            return
        names = sorted({name for _, name in named})
        payload = b",".join(name.encode("utf-8") for name in names)
        seq = requester.ledger.open(
            engine_id, [agent_name(a) for a in agents], payload, now, instance=instance
        )
        msg = acked_heartbeat_message(seq, HEARTBEAT_PREFIX + payload, tagged)
        self._sent[seq] = (named, now)
        wrapper = self._upstream.nixl_wrapper
        stats = self._upstream.xfer_stats
        for agent in agents:
            try:
                wrapper.send_notif(agent, notif_msg=msg)
            except Exception as exc:  # the chunk heartbeats claim it later
                stats.add("num_heartbeat_send_failures", 1)
                self._log.warning(1, "Could not send a read claim to P engine %s: %s", engine_id, exc)
        stats.add("num_read_claims_sent", 1)

    def _prune(self, now: float) -> None:
        horizon = now - self._views.max_extension
        sent = self._sent
        while sent:
            seq, (_, started) = next(iter(sent.items()))
            if started >= horizon:
                break
            del sent[seq]

    # -- answers (AckRequester.on_proven) -----------------------------------
    def proven(self, seq: int, proven: Proven) -> None:
        """Every rank answered the heartbeat ``seq``: a claim's held names are claimed."""
        entry = self._sent.pop(seq, None)
        if entry is None:
            return
        held = set(proven.remote_ids)
        refused = 0
        for local_id, name in entry[0]:
            if local_id not in self._wanted:
                continue
            if name in held:
                self._settle(local_id)
            elif name in proven.not_extended:
                # The answer ended its view: the fence's margin check refuses the READ.
                self._settle(local_id)
                refused += 1
        if refused:
            self._upstream.xfer_stats.add("num_reads_fenced_not_claimed", refused)
            self._log.warning(
                refused,
                "P answered %d read claim(s) not held (another D's completion freed the lease, or it has "
                "too many holders); those READs are fenced (failed loads: kv_load_failure_policy applies)",
                refused,
            )

    # -- READs (ReadFence.claim_wait) ----------------------------------------
    def waiting(self, req_id: str, meta: ReadMeta) -> bool:
        """Must this READ wait for P's answer to its claim?"""
        wanted = self._wanted
        if req_id not in wanted or not any(meta.local_block_ids):
            return False
        if self._views.answered(req_id):
            self._settle(req_id)  # its chunk's first answer named it held on every rank
            return False
        if req_id not in self._counted:
            self._counted.add(req_id)
            self._upstream.xfer_stats.add("num_reads_waiting_claim", 1)
        return True

    def forget(self, local_ids: Iterable[str]) -> None:
        for local_id in local_ids:
            self._settle(local_id)

    def _settle(self, local_id: str) -> None:
        """Its READ no longer waits for a claim (claimed, refused or gone)."""
        self._wanted.discard(local_id)
        self._counted.discard(local_id)
        self._claimed.pop(local_id, None)
