"""Worker classes: vLLM's pull/push workers, each upstream hook overridden
once, calling the lease components in plain order.  Reading a class tells you
everything we change in that role.

Components (one set per worker; a worker is P, D or both with ``kv_both``):
- ``lease_keeper``: ``LeaseKeeper`` (P) -- grants, extensions, releases, expiry;
- ``heartbeat_sender``: ``HeartbeatSender`` (D) -- sends, handshake wait, retry;
- ``read_pacer``: ``ReadPacer`` (D, pull) -- bounds a step's READ posting, carries the rest;
- ``read_fence``: ``ReadFence`` (D, pull) -- skips a READ whose lease may be gone;
- ``ack_requester``: ``AckRequester`` (D, pull) -- hellos, proof of which P
  process a connection reaches, acknowledged heartbeats; only answers renew
  the fence's views;
- ``engine_reaper``: ``EngineReaper`` (D, pull) -- releases upstream's state of
  P engines gone idle past ``engine_ttl``, which upstream checks only on a new handshake;
- ``ack_answerer``: ``AckAnswerer`` (P, pull) -- admits hellos, answers them;
- ``idle_pause``: ``IdlePause`` (P) -- pauses an empty step while leases are held;
- ``write_hold``: ``PushWriteHold`` (P, push) -- an expired lease's free waits for P's WRITE of it.
They reach upstream only through ``upstream.UpstreamWorker``.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.logger import init_logger

from .._wire import heartbeat_payload, is_heartbeat
from ..decode.lease_views import LeaseViews
from .config import LeaseConfig
from .d_worker.ack_requester import AckRequester
from .d_worker.claim_requester import ClaimRequester
from .d_worker.engine_reaper import EngineReaper
from .d_worker.heartbeat_sender import HeartbeatSender
from .d_worker.read_fence import ReadFence
from .d_worker.read_pacer import ReadPacer
from .metadata import LEASE_HEARTBEATS_ATTR, LEASE_INSTANCE_ATTR, LEASE_VIEWS_ATTR
from .p_worker.ack_answerer import AckAnswerer
from .p_worker.idle_pause import IdlePause
from .p_worker.lease_keeper import HeartbeatForm, LeaseKeeper
from .p_worker.push_write_hold import PushWriteHold
from .ratelimit import RateLimitedLog
from .stats import LeaseKVConnectorStats

_logger = init_logger(__name__)


class LeaseNixlPullConnectorWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        lease_config = LeaseConfig.from_vllm_config(vllm_config)  # fail before NIXL setup
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._setup_lease(lease_config)

    def _setup_lease(self, lease_config: LeaseConfig) -> None:
        """Build the components (apart from ``__init__`` so tests can build the
        upstream part the way vLLM's own tests do)."""
        self.lease_config = lease_config
        self._lease_extension = lease_config.lease_extension  # upstream reads it; keep ours
        self.xfer_stats = LeaseKVConnectorStats()
        self.lease_keeper = LeaseKeeper(self, lease_config)
        self._reqs_to_send = self.lease_keeper.deadlines  # upstream grants leases through these
        self._reqs_to_process = self.lease_keeper.in_batch
        self.ack_answerer = AckAnswerer(self, self.lease_keeper, lease_config)
        # After its own stall, P waits the longest heartbeat interval a D said it keeps.
        self.lease_keeper.peer_interval = self.ack_answerer.longest_interval
        views = LeaseViews(lease_config.lease_safety_margin, lease_config.max_view_extension)
        self.ack_requester = AckRequester(self, views, lease_config)
        requester = self.ack_requester
        self.read_fence = ReadFence(
            self,
            views,
            lease_config,
            requester.proof,
            requester.other_instance,
            requester.reached,
            requester.proven_agents,
        )
        fence = self.read_fence

        def reads_waiting(engine_id: str) -> bool:  # D3b: D always asks while one waits
            parked = fence.parked.values()
            return any(m.remote is not None and m.remote.engine_id == engine_id for m in parked)

        requester.reads_waiting = reads_waiting
        # kv_lease_claim_reads: claim each lease of a P that takes claims before reading it
        self.claim_requester = ClaimRequester(self, views, requester, lease_config)
        if self.claim_requester.enabled:
            requester.on_proven = self.claim_requester.proven
            fence.claim_wait = self.claim_requester.waiting
        self.heartbeat_sender = HeartbeatSender(
            self, lease_config.max_heartbeat_bytes, self.read_fence.heartbeat_delivered, self.ack_requester
        )
        self.read_pacer = ReadPacer(lease_config.read_post_budget_s)
        # Each eviction also prunes our own per-engine state (engine ids are fresh per P start).
        self.engine_reaper = EngineReaper(
            self,
            lease_config.forget_sweep_s,
            (views.forget_engines, self.ack_requester.forget_engines, self.heartbeat_sender.forget_engines),
            (views.prune_claims,),
        )
        self.idle_pause = IdlePause(lease_config.idle_step_sleep_s, self.lease_keeper.table)

    # -- one step, in the order upstream calls these --------------------------
    def start_load_kv(self, metadata: Any) -> None:
        if self._nothing_to_start(metadata):
            return
        self.idle_pause.begin_step(metadata)
        self.lease_keeper.adopt_instance(metadata)  # P: this P process, before any grant
        # P: its scheduler's clock, before upstream rebases this step's leases with it
        self.ack_answerer.observe_scheduler_clock(getattr(metadata, "scheduler_clock", None))
        self.read_fence.add_views(metadata)
        self.ack_requester.note_views(metadata)  # D: which hello version each P takes
        self.claim_requester.note_views(metadata)  # D: claims of the new views (kv_lease_claim_reads)
        # Heartbeats before the reads (upstream sends them after): a step that
        # posts thousands of READs must not delay P's renewals or D's answers.
        self.heartbeat_sender.send(metadata)
        # Then READs that waited for the proof of their P process, and those an
        # earlier step ran out of time for, oldest first.
        self.read_pacer.begin_step()
        for req_id, meta in self.read_fence.take_parked():
            self._post_read(req_id, meta)
        for req_id, meta in self.read_pacer.carried_over():
            self._post_read(req_id, meta)
        super().start_load_kv(metadata)  # reads, grants leases, then _send_heartbeats (done above)
        if self.read_pacer.newly_carried:
            self.xfer_stats.add("num_reads_carried", self.read_pacer.newly_carried)
        self.read_fence.drop_views(metadata)

    def _nothing_to_start(self, metadata: Any) -> bool:
        """Most steps: the metadata carries nothing and nothing waits from an
        earlier step, so upstream's ``start_load_kv`` and every component
        would find nothing to do (one check instead of a dozen calls)."""
        return not (
            metadata.reqs_to_recv
            or metadata.reqs_to_send
            or metadata.reqs_in_batch
            or metadata.reqs_not_processed
            or metadata.heartbeat_by_engine
            or getattr(metadata, LEASE_HEARTBEATS_ATTR, None)
            or getattr(metadata, LEASE_VIEWS_ATTR, None)
            or getattr(metadata, LEASE_INSTANCE_ATTR, None)
            or self._ready_requests.queue  # a peek: a handshake finishing now is read next step
            or self.heartbeat_sender.has_pending()
            or self.claim_requester.has_pending()  # claims to age out or send again
            or self.read_fence.parked
            or self.read_pacer.carried
            or self.idle_pause.enabled
        )

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        # Past this step's read_post_budget_ms the READ waits for the next step.
        if self.read_pacer.defer(req_id, meta):
            return
        # _post_read inlined (this runs once per READ); upstream's method by name, as in
        # the schedulers' build_connector_meta.
        with self._handshake_lock:
            if not self.read_fence.fenced(req_id, meta):
                NixlPullConnectorWorker._read_blocks_for_req(self, req_id, meta)

    def _post_read(self, req_id: str, meta: Any) -> None:
        # Under the handshake lock: upstream's done-callback (executor thread)
        # must not connect the engine between the fence's verdict and
        # upstream's own look at the connection (read_fence.py).
        with self._handshake_lock:
            if not self.read_fence.fenced(req_id, meta):
                super()._read_blocks_for_req(req_id, meta)

    def _send_heartbeats(self, metadata: Any) -> None:
        self.heartbeat_sender.send(metadata)

    def get_transfer_results(self) -> Any:
        if not (
            self._recving_transfers
            or self._recv_failures
            or self._replicated_pcp_done_sending
            or self._failed_recv_reqs.queue  # a peek, as in _nothing_to_start
            or self.idle_pause.enabled
        ):
            # No READ in flight or failed: upstream's method comes down to these
            # three calls (the rest of it walks what was received).
            done_sending = self._get_new_notifs()
            self._reap_expired_send_leases(done_sending)
            self._cleanup_remote_engines()
            self.engine_reaper.step()  # an idle D is where gone engines' state is left
            return KVConnectorTransferResults(
                finished_sending=done_sending, finished_recving=set(), failed_recving=set()
            )
        # _get_new_notifs, _pop_done_transfers, then _reap_expired_send_leases
        results = super().get_transfer_results()
        self.engine_reaper.step()  # D: P engines gone idle past engine_ttl
        if self.idle_pause.enabled:
            waiting = len(self._recving_transfers) + len(self.read_pacer) + len(self.read_fence.parked)
            self.idle_pause.end_step(results, waiting)
        return results

    def _get_new_notifs(self) -> set[str]:
        notifs = self.nixl_wrapper.get_new_notifs()
        if not notifs:  # nothing to route; the ack components may still have answers due, state to age
            self.ack_answerer.handle(notifs)
            self.ack_requester.received(notifs)
            return set()
        self.idle_pause.saw_notifications(notifs)
        done, ack_messages = self.lease_keeper.route(notifs)  # HB: extended, completions released
        self.ack_answerer.handle(ack_messages)  # P: LHB:/LHBT: extended and answered (before the sweep)
        self.ack_requester.received(ack_messages)  # D: LACK: answers renew views
        return done

    def _handle_heartbeat(self, payload: str) -> None:
        # Upstream's _get_new_notifs calls this; ours above routes HB: itself.
        self.lease_keeper.extend(HeartbeatForm.IDS, (payload.encode(),))

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        done, failed = super()._pop_done_transfers(transfers)
        if done and transfers is self._recving_transfers:
            self.read_fence.discard_late(done, failed)  # READs that outlived the lease view
        return done, failed

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        self.lease_keeper.expire(done_sending)

    def shutdown(self) -> None:
        self.ack_answerer.shutdown()
        super().shutdown()


class LeaseNixlPushConnectorWorker(NixlPushConnectorWorker):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        lease_config = LeaseConfig.from_vllm_config(vllm_config)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._setup_lease(lease_config)

    def _setup_lease(self, lease_config: LeaseConfig) -> None:
        self.lease_config = lease_config
        self._lease_extension = lease_config.lease_extension  # upstream reads it; keep ours
        self.xfer_stats = LeaseKVConnectorStats()
        self.lease_keeper = LeaseKeeper(self, lease_config, push=True)
        self._reqs_to_send = self.lease_keeper.deadlines
        self._reqs_to_process = self.lease_keeper.in_batch
        self.heartbeat_sender = HeartbeatSender(self, lease_config.max_heartbeat_bytes)
        self.idle_pause = IdlePause(lease_config.idle_step_sleep_s, self.lease_keeper.table)
        # A WRITE still running a whole lease after its lease expired is cancelled.
        self.write_hold = PushWriteHold(lease_config.lease_duration)
        self._write_hold_log = RateLimitedLog(_logger)
        self._write_refused_log = RateLimitedLog(_logger)  # the writer thread's own

    # -- one step, in the order upstream calls these --------------------------
    def start_load_kv(self, metadata: Any) -> None:
        self.idle_pause.begin_step(metadata)
        super().start_load_kv(metadata)

    def _send_heartbeats(self, metadata: Any) -> None:
        self.heartbeat_sender.send(metadata)

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> None:
        # Writer thread: never post a WRITE of blocks whose lease was already freed.
        if not self.write_hold.begin(req_id):
            self._write_refused_log.warning(
                1, "Push WRITE of %s not started: its lease expired, its blocks are freed", req_id
            )
            return
        try:
            super()._xfer_blocks_for_req(req_id, meta)
        finally:
            self.write_hold.end(req_id)

    def get_transfer_results(self) -> Any:
        # _get_new_notifs, _reap_expired_send_leases (holds frees), then the WRITEs that ended
        results = super().get_transfer_results()
        hold = self.write_hold
        if hold.held:
            freed, cancelled = hold.settle(self._write_in_flight, self._cancel_writes, time.perf_counter())
            if freed:
                results.finished_sending.update(freed)
                for req_id in freed:
                    self._evict_finished_inbox.put(req_id)
            self.xfer_stats.add("num_push_writes_cancelled", cancelled)
        self.xfer_stats.add("num_push_writes_refused", hold.take_refused())
        if self.idle_pause.enabled:
            self.idle_pause.end_step(results, len(self._recving_transfers))
        return results

    def _get_new_notifs(self) -> set[str]:
        # The push writer thread forwards every non-PUSH_REG notification to
        # this queue; take the heartbeats, hand the rest back to upstream's
        # method, which handles completions through our views.
        pending: queue.Queue[bytes] = self._pending_completion_notifs
        heartbeats: list[bytes] = []
        others: list[bytes] = []
        while True:
            try:
                notif = pending.get_nowait()
            except queue.Empty:
                break
            (heartbeats if is_heartbeat(notif) else others).append(notif)
        for notif in others:
            pending.put(notif)
        self.idle_pause.saw_notifications(heartbeats or others)
        if heartbeats:
            self.lease_keeper.extend(HeartbeatForm.PUSH, map(heartbeat_payload, heartbeats))
        done: set[str] = super()._get_new_notifs()
        return done

    def _handle_heartbeat(self, payload: str) -> None:
        # Upstream's _get_new_notifs calls this; ours above takes every HB: first.
        self.lease_keeper.extend(HeartbeatForm.IDS, (payload.encode(),))

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        before = set(done_sending)
        self.lease_keeper.expire(done_sending)
        if len(done_sending) == len(before):
            return
        held = self.write_hold.hold_expired(done_sending - before, self._write_in_flight, time.perf_counter())
        if held:  # counted as expired by the sweep; freed once their WRITE ends
            done_sending -= held
            self.xfer_stats.add("num_push_frees_held", len(held))
            self._write_hold_log.warning(
                len(held), "%d expired lease(s) keep their blocks until P's WRITE of them ends", len(held)
            )

    def _write_in_flight(self, req_id: str) -> bool:
        with self._sending_transfers_lock:
            return bool(self._sending_transfers.get(req_id))

    def _cancel_writes(self, req_id: str) -> bool:
        """A held WRITE past the bound: NIXL cancels each handle or refuses
        (a transfer it cannot stop); True once none is left."""
        with self._sending_transfers_lock:
            handles = self._sending_transfers.get(req_id, [])
            kept = []
            for handle in handles:
                try:
                    self.nixl_wrapper.release_xfer_handle(handle)
                except Exception as exc:
                    kept.append(handle)
                    self._write_hold_log.warning(
                        1,
                        "Push WRITE of %s outlived its lease; NIXL refused to cancel it (%s): blocks held",
                        req_id,
                        exc,
                    )
            if kept:
                self._sending_transfers[req_id] = kept
                return False
            self._sending_transfers.pop(req_id, None)
            self._send_failures.discard(req_id)
        self._write_hold_log.warning(
            1,
            "Push WRITE of %s ran %.0f s past its lease: cancelled, blocks freed",
            req_id,
            self.write_hold.bound_s,
        )
        return True
