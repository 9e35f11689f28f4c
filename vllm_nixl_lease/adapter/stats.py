"""Connector stats and Prometheus metrics: upstream's, plus the lease ones.

Counters are stored as per-step counts (one list item per step, not one per
event) because a step can carry thousands of heartbeat ids; upstream's
``observe`` already does ``counter.inc(item)`` so both shapes mix cleanly.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

# key -> (Prometheus name, help text)
LEASE_COUNTERS: dict[str, tuple[str, str]] = {
    "num_leases_granted": ("vllm:nixl_lease_granted", "KV leases granted on P."),
    "num_heartbeat_msgs_recv": (
        "vllm:nixl_lease_heartbeat_messages_received",
        "Heartbeat (HB) messages received on P.",
    ),
    "num_heartbeat_ids_recv": (
        "vllm:nixl_lease_heartbeat_ids_received",
        "Request ids in received heartbeat messages.",
    ),
    "num_heartbeat_ids_unknown": (
        "vllm:nixl_lease_heartbeat_ids_unknown",
        "Heartbeat ids that matched no lease (already read, expired, or never granted).",
    ),
    "num_heartbeat_msgs_sent": (
        "vllm:nixl_lease_heartbeat_messages_sent",
        "Heartbeat (HB) messages sent by D.",
    ),
    "num_heartbeat_ids_sent": (
        "vllm:nixl_lease_heartbeat_ids_sent",
        "Request ids in heartbeat messages sent by D.",
    ),
    "num_heartbeat_bytes_sent": (
        "vllm:nixl_lease_heartbeat_bytes_sent",
        "Bytes of heartbeat messages sent by D.",
    ),
    "num_heartbeat_send_failures": (
        "vllm:nixl_lease_heartbeat_send_failures",
        "Heartbeat sends that raised (retried on the next step).",
    ),
    "num_malformed_notifs": (
        "vllm:nixl_lease_malformed_notifications",
        "Notifications on P that were neither a heartbeat nor id:count (skipped, not raised).",
    ),
    "num_unknown_completions": (
        "vllm:nixl_lease_unknown_completions",
        "Read completions on P for requests neither leased nor in a batch (usually expired); "
        "logged as a rate-limited sample.",
    ),
    "num_reads_fenced": (
        "vllm:nixl_lease_reads_fenced",
        "READs D refused because its view of P's lease had less than lease_safety_margin left "
        "(reported as failed loads: kv_load_failure_policy applies).",
    ),
    "num_reads_discarded": (
        "vllm:nixl_lease_reads_discarded",
        "READs D issued but saw complete only with its view of P's lease ended or within its margin "
        "(a stall or partition while they ran): discarded as failed loads, since P may have reused "
        "the blocks.",
    ),
    "num_reads_parked_dropped": (
        "vllm:nixl_lease_reads_parked_dropped",
        "READs D held back for proof of their P process whose request ended meanwhile (an abort): "
        "reported as failed loads so that vLLM frees their KV blocks.",
    ),
    "num_views_margin_floored": (
        "vllm:nixl_lease_views_margin_floored",
        "Lease views whose P advertised an extension too short for D's heartbeat interval: they keep "
        "the margin floor instead (their READs may be fenced); give P and D the same kv_lease_duration.",
    ),
    "num_reads_fenced_second_reader": (
        "vllm:nixl_lease_reads_fenced_second_reader",
        "READs D refused because another request on this D reads, or has read, the same lease "
        "(n > 1, a retried or duplicate decode): the first READ's completion lets P free the "
        "blocks (reported as failed loads: kv_load_failure_policy applies).",
    ),
    "num_read_claims_sent": (
        "vllm:nixl_lease_read_claims_sent",
        "kv_lease_claim_reads: claims D sent (one acknowledged heartbeat per step and P instance, "
        "naming that step's new views).",
    ),
    "num_reads_waiting_claim": (
        "vllm:nixl_lease_reads_waiting_claim",
        "kv_lease_claim_reads: READs D held back until P answered its claim of the lease (counted "
        "once per READ).",
    ),
    "num_reads_fenced_not_claimed": (
        "vllm:nixl_lease_reads_fenced_not_claimed",
        'kv_lease_claim_reads: READs D refused because P answered its claim "not held" (another '
        "D's completion had freed the lease, or too many holders): reported as failed loads.",
    ),
    "num_claims_refused": (
        "vllm:nixl_lease_claims_refused",
        "kv_lease_claim_reads: claims P answered not held because the lease had too many holders.",
    ),
    "num_completions_ignored_held": (
        "vllm:nixl_lease_completions_ignored_held",
        "kv_lease_claim_reads: completions P ignored because they came from a D agent that does not "
        "hold the lease while another does (the lease is freed when its holders finish, or at expiry).",
    ),
    "num_claimed_leases_freed": (
        "vllm:nixl_lease_claimed_leases_freed",
        "kv_lease_claim_reads: leases of several holders P freed when the last of them finished.",
    ),
    "num_reads_carried": (
        "vllm:nixl_lease_reads_carried",
        "READs D postponed to a later step because the step had spent read_post_budget_ms posting "
        "READs (a burst); counted once per postponement.",
    ),
    "num_heartbeat_views_renewed": (
        "vllm:nixl_lease_views_renewed",
        "Lease views on D moved forward: by P's acknowledgement of a heartbeat (for an answer to a "
        "whole heartbeat chunk, the ids it proved), or (P without acknowledgements) by a heartbeat "
        "D sent in time.",
    ),
    "num_heartbeat_acks_sent": (
        "vllm:nixl_lease_heartbeat_acks_sent",
        "Acknowledgements P sent for acknowledged (LHB) heartbeats.",
    ),
    "num_answer_steps": (
        "vllm:nixl_lease_answer_steps",
        "P steps that sent heartbeat acknowledgements (at most one per answer tick, P3a).",
    ),
    "num_heartbeat_acks_dropped": (
        "vllm:nixl_lease_heartbeat_acks_dropped",
        "Acknowledgements P could not send (no hello from that D yet, or the send raised); "
        "D's views then stay where they are.",
    ),
    "num_tagged_heartbeats_recv": (
        "vllm:nixl_lease_tagged_heartbeats_received",
        "Acknowledged heartbeats on P that named leases by tag (LHBT), of those counted in "
        "heartbeat_messages_received.",
    ),
    "num_heartbeat_acks_recv": (
        "vllm:nixl_lease_heartbeat_acks_received",
        "Heartbeat acknowledgements D received from P.",
    ),
    "num_heartbeat_acks_ignored": (
        "vllm:nixl_lease_heartbeat_acks_ignored",
        "Acknowledgements D ignored: from an agent of no connection it reads over (a stale or rogue peer).",
    ),
    "num_connections_released_silent": (
        "vllm:nixl_lease_connections_released_silent",
        "Connections D released because a P rank that had answered owed answers for reconnect_after_s "
        "(a connection UCX lost on P's side only); D handshakes again.",
    ),
    "num_hellos_refused": (
        "vllm:nixl_lease_hellos_refused",
        "Hellos P refused: another protocol version, naming no lease held here, or too many loading.",
    ),
    "num_ack_agents_evicted": (
        "vllm:nixl_lease_ack_agents_evicted",
        "D agents P unloaded to admit another past its agent cap (the least recently useful first).",
    ),
    "num_views_ended": (
        "vllm:nixl_lease_views_ended",
        "Lease views D ended because P's answers proved another P process runs under that engine "
        "id (a restart): those requests are fenced, never read.",
    ),
    "num_clock_offset_refreshes": (
        "vllm:nixl_lease_clock_offset_refreshes",
        "Times D refreshed its estimate of a P engine's clock offset from the clock P's answer "
        "carried (protocol version 3).",
    ),
    "num_lease_terms_clamped": (
        "vllm:nixl_lease_terms_clamped",
        "Lease views D started with P's advertised extension clamped to max_view_extension "
        "(their renewals end sooner; bad or hostile lease terms).",
    ),
    "num_completions_withheld": (
        "vllm:nixl_lease_completions_withheld",
        "Notify-only completions (full prefix-cache hits, aborted requests' cleanup) D did not send: "
        "the connection was not proven to reach the P process that granted the lease, or the "
        "lease view had ended; the lease expires on P instead.",
    ),
    "num_reads_waiting_proof": (
        "vllm:nixl_lease_reads_waiting_proof",
        "READs D held back until P's answer proved which P process the connection reaches "
        "(a fresh or repeated handshake).",
    ),
    "num_stalls_graced": (
        "vllm:nixl_lease_p_stalls",
        "P steps that came after a gap longer than half the extension (P itself stalled): the "
        "leases due meanwhile waited one heartbeat interval before expiring.",
    ),
    "num_push_frees_held": (
        "vllm:nixl_lease_push_frees_held",
        "Push mode: expired leases whose blocks P kept until its own WRITE of them ended.",
    ),
    "num_push_writes_refused": (
        "vllm:nixl_lease_push_writes_refused",
        "Push mode: WRITEs P did not start because the request's lease had expired and freed its blocks.",
    ),
    "num_push_writes_cancelled": (
        "vllm:nixl_lease_push_writes_cancelled",
        "Push mode: WRITEs still running a whole lease after their lease expired, cancelled through NIXL.",
    ),
}
# key -> (Prometheus name, help text); values in seconds.
LEASE_HISTOGRAMS: dict[str, tuple[str, str]] = {
    "lease_route_time": (
        "vllm:nixl_lease_route_time_seconds",
        "Time P spent routing one step's notifications.",
    ),
    "lease_sweep_time": (
        "vllm:nixl_lease_sweep_time_seconds",
        "Time P spent sweeping expired leases, per step that freed some.",
    ),
}
# Counters shown in the periodic "KV Transfer metrics" log line.
_REDUCED_COUNTERS = {
    "num_leases_granted": "Num leases granted",
    "num_heartbeat_ids_recv": "Num HB ids recv",
    "num_heartbeat_ids_unknown": "Num HB ids unknown",
    "num_heartbeat_msgs_sent": "Num HB msgs sent",
    "num_heartbeat_send_failures": "Num HB send failures",
    "num_malformed_notifs": "Num malformed notifs",
    "num_reads_fenced": "Num reads fenced",
    "num_reads_discarded": "Num reads discarded",
    "num_reads_fenced_second_reader": "Num reads fenced (second reader)",
    "num_reads_carried": "Num reads carried",
}
# The connector's own time per engine step (adapter/step_time.py), one histogram with a side label.
STEP_TIME_METRIC = "vllm:nixl_lease_connector_step_seconds"
STEP_TIME_KEYS = {"scheduler": "connector_step_time_scheduler", "worker": "connector_step_time_worker"}
_STEP_BUCKETS = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5]
ACTIVE_LEASES = "active_leases"  # items: [tp_rank, leases held after the step]
ACTIVE_LEASES_METRIC = "vllm:nixl_lease_active"
_TIME_BUCKETS = [1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1]
# Timing samples alone never make stats "non-empty" (that would ship stats
# every step); they ride along with the next real event, capped meanwhile.
MAX_TIME_SAMPLES = 1024


class LeaseKVConnectorStats(NixlKVConnectorStats):
    """``NixlKVConnectorStats`` plus lease counters, gauge and timings."""

    def reset(self) -> None:
        super().reset()
        for key in LEASE_COUNTERS:
            self.data[key] = []
        for key in (*LEASE_HISTOGRAMS, *STEP_TIME_KEYS.values()):
            self.data[key] = []
        self.data[ACTIVE_LEASES] = []

    def add(self, key: str, count: int) -> None:
        if count:
            self.data[key].append(count)

    def record_notifications_after_expiry(self, count: int) -> None:
        """Upstream's counter, one item per notification as upstream records it
        (the differential tests compare the lists)."""
        self.data["num_notifications_after_expiry"].extend(repeat(1, count))

    def record_kv_expired_reqs(self, count: int) -> None:
        """Upstream's ``record_kv_expired_req``, for a whole sweep at once."""
        self.data["num_kv_expired_reqs"].extend(repeat(1, count))

    def observe_time(self, key: str, seconds: float) -> None:
        samples = self.data[key]
        if len(samples) < MAX_TIME_SAMPLES:
            samples.append(seconds)

    def set_active_leases(self, rank: int, value: int) -> None:
        self.data[ACTIVE_LEASES].append([rank, value])

    def is_empty(self) -> bool:
        if not super().is_empty():
            return False
        # Step times are put in only when they are to ship (step_time.STEP_FLUSH).
        keys = (*LEASE_COUNTERS, *STEP_TIME_KEYS.values(), ACTIVE_LEASES)
        return not any(self.data.get(k) for k in keys)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # Stats from a stock worker lack our keys; setdefault keeps mixing safe.
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = super().reduce()
        for key, label in _REDUCED_COUNTERS.items():
            out[label] = int(sum(self.data.get(key, ())))
        latest: dict[int, int] = {}
        for rank, value in self.data.get(ACTIVE_LEASES, ()):
            latest[int(rank)] = int(value)
        if latest:
            out["Active leases"] = sum(latest.values())
        for side, key in STEP_TIME_KEYS.items():
            steps = self.data.get(key, ())
            if len(steps):
                out[f"Mean connector step, {side} (us)"] = round(float(np.mean(steps)) * 1e6, 1)
        sweeps = self.data.get("lease_sweep_time", ())
        if len(sweeps):
            out["P99 lease sweep (us)"] = round(float(np.percentile(sweeps, 99)) * 1e6, 1)
        return out


class LeasePromMetrics(NixlPromMetrics):
    """Upstream's NIXL Prometheus metrics plus the lease ones."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.lease_counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in LEASE_COUNTERS.items():
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self.lease_counters[key] = create_metric_per_engine(metric, self.per_engine_labelvalues)
        self.lease_histograms: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in LEASE_HISTOGRAMS.items():
            metric = self._histogram_cls(
                name=name, documentation=doc, buckets=_TIME_BUCKETS, labelnames=labelnames
            )
            self.lease_histograms[key] = create_metric_per_engine(metric, self.per_engine_labelvalues)
        step = self._histogram_cls(
            name=STEP_TIME_METRIC,
            documentation="The connector's own time per engine step: side=scheduler, the hooks vLLM's "
            "scheduler calls; side=worker, the hooks the model runner calls.",
            buckets=_STEP_BUCKETS,
            labelnames=[*labelnames, "side"],
        )
        engines = self.per_engine_labelvalues
        self.step_time: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(step, {i: [*v, side] for i, v in engines.items()})
            for side, key in STEP_TIME_KEYS.items()
        }
        gauge = self._gauge_cls(
            name=ACTIVE_LEASES_METRIC,
            documentation="KV leases currently held on P (sum over its workers).",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.active_leases = create_metric_per_engine(gauge, self.per_engine_labelvalues)
        # engine -> tp rank -> last reported lease count
        self._active_by_rank: dict[int, dict[int, int]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Upstream indexes its keys directly; fill any a stock worker lacks.
        data = dict(transfer_stats_data)
        for key in LeaseKVConnectorStats().data:
            data.setdefault(key, [])
        super().observe(data, engine_idx)
        for key, per_engine in self.lease_counters.items():
            total = sum(data[key])
            if total:
                per_engine[engine_idx].inc(total)
        for key, per_engine in self.lease_histograms.items():
            for seconds in data[key]:
                per_engine[engine_idx].observe(seconds)
        for key, per_engine in self.step_time.items():
            for seconds in data[key]:
                per_engine[engine_idx].observe(seconds)
        if data[ACTIVE_LEASES]:
            ranks = self._active_by_rank.setdefault(engine_idx, {})
            for rank, value in data[ACTIVE_LEASES]:
                ranks[int(rank)] = int(value)
            self.active_leases[engine_idx].set(sum(ranks.values()))
