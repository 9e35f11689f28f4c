"""A harness engine process: a P or D "vLLM engine" without the model.

It owns the scheduler-role connector, its TP ranks (rank 0 in this process,
others forked at start) and a toy block allocator, and steps like vLLM's
EngineCore: schedule -> ``build_connector_meta`` -> ranks run the step ->
``update_connector_output`` -> finish/free.  The parent talks to it over a
pipe (``fleet.EngineProcess``); between two steps it serves pending commands.

Per request it records what the tests check: lease granted, heartbeats that
named it (P), read done, freed and why, and per-head digests of the KV data.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import zlib
from collections import deque
from types import SimpleNamespace
from typing import Any

from harness.netns import enter_netns
from harness.procs import PORT_TAKEN, log, redirect_output
from vllm_nixl_lease._wire import (
    ESCAPE_PREFIX,
    HEARTBEAT_ACK_PREFIX,
    HELLO_KIND,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_PROTOCOL_MAX,
    PARAM_LEASE_TAG,
    parse_acked_heartbeat,
)

from . import kv_cache
from .progress import sleep_between_events
from .ranks import Rank, connector_class, heartbeat_ids_of, is_any_heartbeat, preemptions, rank_main
from .spec import EngineSpec, written_log_path

EXIT_DUMP_S = 1.5  # dump every thread's stack if the process has not exited this long after "stop"
# A loop that makes no progress this long leaves every thread's stack in the log (a D went silent for
# 100 s right after its first handshakes once, in the chaos test, with nothing in its log to say
# where). faulthandler's timer runs in C, so it dumps even while a call holds the GIL; it is re-armed
# every STALL_REARM_S, not every step (an arm costs ~40 us and wakes a thread).
STALL_DUMP_S = 20.0
STALL_REARM_S = 5.0
SLOW_S = 0.1  # steps (and gaps between step starts) longer than this are logged
SLOW_KEEP = 2000
# Per-step timings and heartbeat message records kept until drained
# (``timings``): a few minutes of steps at 50 per second.
TIMING_KEEP = 100_000
HELLO = ESCAPE_PREFIX + HELLO_KIND
# What a version-1 P's params lack (``EngineSpec.plain_params``).
V2_PARAM_KEYS = (PARAM_LEASE_PROTOCOL, PARAM_LEASE_PROTOCOL_MAX, PARAM_LEASE_INSTANCE, PARAM_LEASE_TAG)
HB_UNMATCHED_MAX = 4096  # heartbeat messages held for ``report`` (up to 32 KiB each)


def _keep(log: list[tuple[float, float]], item: tuple[float, float]) -> None:
    log.append(item)
    if len(log) > SLOW_KEEP:
        del log[: len(log) - SLOW_KEEP]


class FakeBlocks:
    """The two things the pull scheduler reads from vLLM's ``KVCacheBlocks``."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.blocks = ([SimpleNamespace(block_id=i, block_hash=None, is_null=False) for i in ids],)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [list(self.ids)]


class RemoteRank:
    """A TP rank > 0 in a forked process; same ``step`` interface as Rank."""

    def __init__(self, pid: int, conn: Any) -> None:
        self.pid, self.conn = pid, conn

    def send_step(self, *args: Any) -> None:
        self.conn.send(("step", *args))

    def recv(self, timeout: float = 60.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("TP rank did not answer")
        return self.conn.recv()


class Engine:
    def __init__(self, spec: EngineSpec) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.request import RequestStatus

        self.spec = spec
        self.status = RequestStatus
        self.engine_id = spec.engine_id or f"{spec.name or spec.role}-{os.getpid()}"
        self._written_log = None
        if spec.role == "P" and spec.written_log:
            path = written_log_path(spec.workdir, spec.name or spec.role, os.getpid())
            self._written_log = open(path, "a", encoding="utf-8")  # noqa: SIM115 - the process's life
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.host_ip or "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
        # A file store, not TCP: no port to race for on a shared machine.
        dist_file = os.path.join(spec.workdir, f"dist-{self.engine_id}")
        # Fork the other TP ranks before anything here starts a thread. A
        # bare os.fork: multiprocessing refuses children of a daemon process.
        self.remote: list[RemoteRank] = []
        for r in range(1, spec.tp_size):
            mine, theirs = mp.Pipe()
            pid = os.fork()
            if pid == 0:
                mine.close()
                try:
                    rank_main(spec, r, dist_file, theirs)
                finally:
                    os._exit(0)
            theirs.close()
            mine.send(self.engine_id)
            self.remote.append(RemoteRank(pid, mine))
        log("building config")
        self.vc = kv_cache.vllm_config(spec, self.engine_id)
        self.kv_config = kv_cache.kv_cache_config(spec)
        log("building rank 0")
        self.rank0 = Rank(spec, 0, dist_file, self.vc, self.kv_config)
        log("building scheduler")
        self.sched = connector_class(spec)(self.vc, KVConnectorRole.SCHEDULER, self.kv_config)
        handshakes = {(0, 0): self.rank0.handshake_metadata()}
        for i, rr in enumerate(self.remote, start=1):
            handshakes[(0, i)] = rr.recv(120)
        publish_handshakes(self.sched, handshakes, spec.side_channel_port)
        log("engine ready")
        # Block 0 stays the null block; first in, first out (a deque: taking
        # one block per request from a list's front was O(blocks) at 100k).
        self.free_blocks: deque[int] = deque(range(1, spec.num_blocks))
        self.reqs: dict[str, dict[str, Any]] = {}
        # D: in the queue, not held, not yet scheduled, in submission order.
        # Held requests wait in ``held`` (id -> submission number) instead,
        # so a step does not walk a queue of 100k requests it may not admit.
        self.waiting: list[str] = []
        self.held: dict[str, int] = {}  # D: kept waiting by the test ("overloaded")
        self.cached: set[str] = set()  # D: submitted as full prefix-cache hits (``submit``)
        self.cached_done: list[str] = []  # D: full prefix hits admitted, finished next step
        self._submitted = 0
        self.unread: dict[str, list[int]] = {}  # D: admitted, read not finished: their blocks
        self.fills: dict[str, list[int]] = {}
        self.to_finish: list[str] = []
        self.sent_counts: dict[str, int] = {}
        self.errors: list[str] = []
        self.notif_log: list[tuple[float, str, int]] = []  # P: (t, agent, size) of every notification
        self.hb_arrivals: list[float] = []  # P: when each heartbeat message was drained (and applied)
        self.hb_sent = {"msgs": 0, "bytes": 0, "max": 0, "ids": 0, "last_t": 0.0, "failed": 0}
        self.steps = 0
        self.max_step_s = 0.0
        # Steps that took long, and long gaps between step starts: (t, seconds).
        self.slow_steps: list[tuple[float, float]] = []
        self.step_gaps: list[tuple[float, float]] = []
        self._last_step_t = 0.0
        self.slow_phases: list[dict[str, float]] = []  # where each slow step's time went
        self._phases: dict[str, float] = {}
        # D with TP > 1: a read is done once every rank reports it
        # (vLLM's KVOutputAggregator); a failed rank fails the load.
        self.recv_counts: dict[str, int] = {}
        self.failed_pending: set[str] = set()
        self._hb_seen: dict[tuple[int, str], int] = {}
        self.hb_ids_sent: dict[str, tuple[int, float]] = {}  # D: id or tag -> (times sent, last send)
        self.by_tag: dict[str, str] = {}  # P: lease tag -> request id
        # P: heartbeats (t, rank, agent, message) not yet matched to leases.
        # Matching every id of every message in the step cost P ~1.5 us per
        # id, more than the connector itself: at a heartbeat per step for
        # thousands of leases it starved both engines on this machine's two
        # cores.  ``report`` matches them, so the cost lands outside the steps.
        self._hb_unmatched: list[tuple[float, int, str, bytes]] = []
        # Drained by ``timings``: per step (start, whole step s, connector s,
        # notifications drained, leases expired, of the connector s: in NIXL's
        # notification calls, in GC pauses; connector CPU s; GC pauses in the
        # whole step, this process; the scheduler's connector call s and CPU s;
        # of NIXL's s: in send_notif, the sends, the agents sent to; times
        # another task took the core from the stepping thread in the connector's
        # calls, of them inside send_notif); per
        # heartbeat message sent (D: time, crc32, ids) and received (P: time,
        # agent, crc32).
        self.step_log: deque[tuple] = deque(maxlen=TIMING_KEEP)
        self.hb_sent_log: deque[tuple[float, int, int]] = deque(maxlen=TIMING_KEEP)
        self.hb_recv_log: deque[tuple[float, str, int]] = deque(maxlen=TIMING_KEEP)
        self.hb_recv = {"msgs": 0, "bytes": 0}
        self.hellos_recv = 0  # P: our hellos received (a stock P must take them harmlessly)
        self.hellos_held = 0  # P: hellos dropped by ``hold_hellos``
        # D: P's answers that named keys as not extended (they end D's views): (t, agent, head)
        self.acks_not_extended: list[tuple[float, str, bytes]] = []
        self.hb_agents: set[str] = set()  # P: agents whose heartbeats arrived
        # P: requests prefilled and not yet freed, and how the others were freed.
        self.live = 0
        self.freed_by: dict[str, int] = {}
        # P: lease deadlines (monotonic clock) snapshotted by ``snapshot_deadlines``;
        # frees by expiry are then measured against them.
        self.deadlines: dict[str, float] = {}
        self.late = {"n": 0, "max_s": 0.0, "last_t": 0.0, "last_late_s": 0.0, "first_deadline": 0.0}
        self._step_notifs = 0
        self._step_expired = 0
        # ``profile``: cProfile over the next steps, written to the workdir.
        self._profiler: Any = None
        self._profile_left = 0
        self._profile_path = ""

    # -- requests ----------------------------------------------------------
    def _alloc(self, n: int) -> list[int] | None:
        if len(self.free_blocks) < n:
            return None
        take = self.free_blocks.pop if self.spec.block_reuse == "lifo" else self.free_blocks.popleft
        return [take() for _ in range(n)]

    def prefill(self, ids: list[str], tokens: int) -> dict[str, Any]:
        """P: schedule, prefill (one step) and finish ``ids``; return their
        kv_transfer_params as P's API server would hand them to the router."""
        nblocks = -(-tokens // kv_cache.BLOCK_SIZE)
        for req_id in ids:
            blocks = self._alloc(nblocks)
            if blocks is None:
                raise RuntimeError("P out of KV blocks")
            req = SimpleNamespace(
                request_id=req_id,
                kv_transfer_params={"do_remote_decode": True},
                prompt_token_ids=list(range(tokens)),
                num_prompt_tokens=tokens,
                num_computed_tokens=0,
                status=self.status.WAITING,
            )
            self.sched.on_new_request(req)
            self.sched.update_state_after_alloc(req, FakeBlocks(blocks), 0)
            self.reqs[req_id] = {"req": req, "blocks": blocks, "submitted_t": time.monotonic(), "hb": 0}
            self.fills[req_id] = blocks
            self.live += 1
        self.step()
        out = {}
        for req_id in ids:
            rec = self.reqs[req_id]
            req = rec["req"]
            req.num_computed_tokens = tokens
            req.status = self.status.FINISHED_LENGTH_CAPPED
            delay, params = self.sched.request_finished(req, rec["blocks"])
            if params and not self.spec.lease_protocol_max:
                params.pop(PARAM_LEASE_PROTOCOL_MAX, None)  # as a version-2 P
            if params and self.spec.plain_params:  # as a version-1 P: deadline and terms only
                for key in V2_PARAM_KEYS:
                    params.pop(key, None)
            if params and PARAM_LEASE_TAG in params:
                self.by_tag[params[PARAM_LEASE_TAG]] = req_id  # our D names it so in LHBT:
            rec["finished_t"] = time.monotonic()
            rec["delay_free"] = delay
            out[req_id] = params
        return out

    def submit(
        self, items: list[tuple[str, dict[str, Any], int]], hold: bool, cached: list[str] | None = None
    ) -> None:
        """D: requests enter the waiting queue (``on_new_request``).  ``cached``: local
        ids whose prompt D finds whole in its prefix cache when admitted (no READ:
        upstream only notifies P ``<id>:<count>``, its notify-only path)."""
        self.cached.update(cached or ())
        for local_id, params, tokens in items:
            req = SimpleNamespace(
                request_id=local_id,
                kv_transfer_params=dict(params),
                prompt_token_ids=list(range(tokens)),
                num_prompt_tokens=tokens,
                num_computed_tokens=0,
                status=self.status.WAITING,
            )
            self.sched.on_new_request(req)
            self.reqs[local_id] = {
                "req": req,
                "submitted_t": time.monotonic(),
                "tokens": tokens,
                "seq": self._submitted,
            }
            self._submitted += 1
            if hold:
                self.held[local_id] = self.reqs[local_id]["seq"]
            else:
                self.waiting.append(local_id)

    def release(self, ids: list[str] | None) -> None:
        moved = list(self.held) if ids is None else [i for i in ids if i in self.held]
        for local_id in moved:
            del self.held[local_id]
        if moved:
            # Released requests take their place in the queue by submission, as if never held.
            self.waiting = sorted(self.waiting + moved, key=lambda r: self.reqs[r]["seq"])

    def abort(self, ids: list[str]) -> dict[str, str]:
        """D: the client cancels ``ids``, as vLLM's ``Scheduler.finish_requests`` does
        with ``FINISHED_ABORTED``.  A request still queued (held or waiting, no blocks)
        ends at once: the connector's ``request_finished`` tells P to free (upstream
        sends the completion with no blocks).  One admitted (WAITING_FOR_REMOTE_KVS)
        is finished the same way but keeps its KV blocks until the worker reports its
        load, done or failed: vLLM frees them only then, so a load never reported
        holds them for ever.  Returns id -> "queued", "admitted" or "gone" (already
        read, already aborted, or unknown)."""
        out: dict[str, str] = {}
        now = time.monotonic()
        for local_id in ids:
            rec = self.reqs.get(local_id)
            if rec is None or "read_t" in rec or "aborted_t" in rec:
                out[local_id] = "gone"
                continue
            req = rec["req"]
            rec["aborted_t"] = now
            req.status = self.status.FINISHED_ABORTED
            if local_id in self.unread:
                rec["abort_where"] = out[local_id] = "admitted"
                self.sched.request_finished(req, rec["blocks"])
                continue
            rec["abort_where"] = out[local_id] = "queued"
            if self.held.pop(local_id, None) is None:
                self.waiting.remove(local_id)
            self.sched.request_finished(req, [])
        return out

    def _schedule_d(self) -> None:
        for local_id in self.cached_done:  # a full prefix hit ran on local KV: finish it
            rec = self.reqs[local_id]
            rec["req"].status = self.status.FINISHED_LENGTH_CAPPED
            self.sched.request_finished(rec["req"], rec["blocks"])
            self.free_blocks.extend(rec["blocks"])
        self.cached_done = []
        still = []
        admitted = 0
        for pos, local_id in enumerate(self.waiting):
            if admitted >= self.spec.max_admit:
                still.extend(self.waiting[pos:])  # the step's admission budget is spent
                break
            rec = self.reqs[local_id]
            req = rec["req"]
            count, _ = self.sched.get_num_new_matched_tokens(req, 0)
            blocks = self._alloc(-(-rec["tokens"] // kv_cache.BLOCK_SIZE))
            if blocks is None:
                still.append(local_id)  # D is full: stays in the queue
                continue
            if local_id in self.cached:
                # Nothing external to load: upstream schedules a notify-only "read".
                self.sched.update_state_after_alloc(req, FakeBlocks(blocks), 0)
                self.cached.discard(local_id)
                req.status = self.status.RUNNING
                rec.update(blocks=blocks, admitted_t=time.monotonic(), read_t=time.monotonic(), cached=True)
                self.cached_done.append(local_id)
                admitted += 1
                continue
            self.sched.update_state_after_alloc(req, FakeBlocks(blocks), count or 0)
            req.status = self.status.WAITING_FOR_REMOTE_KVS
            rec.update(blocks=blocks, admitted_t=time.monotonic())
            self.unread[local_id] = blocks
            admitted += 1
        self.waiting = still

    # -- the step ----------------------------------------------------------
    def step(self) -> None:
        self.steps += 1
        start = time.monotonic()
        if self._last_step_t and start - self._last_step_t > SLOW_S:
            _keep(self.step_gaps, (start, start - self._last_step_t))
        self._last_step_t = start
        if self._profiler is not None:
            self._profile_steps()
        self._step_connector_s = self._step_nixl_s = self._step_gc_s = self._step_cpu_s = 0.0
        self._step_nixl_send_s = self._step_nixl_send_cpu_s = 0.0
        self._step_nixl_sends = 0
        self._step_nixl_send_agents = 0
        self._step_preempted = self._step_send_preempted = self._sched_preempted = 0
        self._step_notifs = self._step_expired = 0
        self._sched_s = self._sched_cpu_s = 0.0
        gc_before = self.rank0.gc_s
        try:
            self._step()
        finally:
            took = time.monotonic() - start
            self.max_step_s = max(self.max_step_s, took)
            if took > SLOW_S:
                _keep(self.slow_steps, (start, took))
                if len(self.slow_phases) < SLOW_KEEP:
                    self.slow_phases.append({"t": start, "step": took, **self._phases})
            self.step_log.append(
                (
                    start,
                    took,
                    self._step_connector_s,
                    self._step_notifs,
                    self._step_expired,
                    self._step_nixl_s,
                    self._step_gc_s,
                    self._step_cpu_s,
                    self.rank0.gc_s - gc_before,
                    self._sched_s,
                    self._sched_cpu_s,
                    self._step_nixl_send_s,
                    self._step_nixl_sends,
                    self._step_nixl_send_agents,
                    self._step_preempted + self._sched_preempted,
                    self._step_send_preempted,
                    self._step_nixl_send_cpu_s,
                )
            )

    def _step(self) -> None:
        t0 = time.monotonic()
        if self.spec.role == "D":
            self._schedule_d()
        t1 = time.monotonic()
        c1, v1 = time.thread_time(), preemptions()
        meta = self.sched.build_connector_meta(SimpleNamespace())
        now = time.monotonic()
        # The scheduler's connector call: on D, the heartbeat tick and the lease views.
        self._sched_s, self._sched_cpu_s = now - t1, time.thread_time() - c1
        self._sched_preempted = preemptions() - v1
        self._phases = {"schedule": t1 - t0, "build_connector_meta": now - t1}
        for req_id in getattr(meta, "reqs_to_send", {}):
            if req_id in self.reqs:
                self.reqs[req_id]["granted_t"] = now
        fills, self.fills = self.fills, {}
        # D: the requests admitted and not yet read (hashed once read).
        unread = self.unread if self.spec.role == "D" else {}
        for rr in self.remote:
            rr.send_step(meta, fills, unread)
        t2 = time.monotonic()
        results = [self.rank0.step(meta, fills, unread)] + [rr.recv() for rr in self.remote]
        t3 = time.monotonic()
        self._absorb(results)
        self._phases.update(results[0].get("phases", {}), ranks=t3 - t2, absorb=time.monotonic() - t3)

    def _absorb(self, results: list[dict[str, Any]]) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        now = time.monotonic()
        world = len(results)
        wrote: set[str] = set()  # P: requests whose digests arrived this step
        sending: set[str] = set()
        recving: set[str] = set()
        for res in results:
            if res["error"]:
                self.errors.append(f"rank {res['rank']}: {res['error']}")
            self._absorb_notifs(res)
            if res.get("connector_s", 0.0) >= self._step_connector_s:  # the slowest rank's
                self._step_connector_s = res.get("connector_s", 0.0)
                self._step_nixl_s = res.get("nixl_s", 0.0)
                self._step_gc_s = res.get("gc_s", 0.0)
                self._step_cpu_s = res.get("connector_cpu_s", 0.0)
                self._step_nixl_send_s = res.get("nixl_send_s", 0.0)
                self._step_nixl_send_cpu_s = res.get("nixl_send_cpu_s", 0.0)
                self._step_nixl_sends = res.get("nixl_sends", 0)
                self._step_nixl_send_agents = res.get("nixl_send_agents", 0)
                self._step_preempted = res.get("preempted", 0)
                self._step_send_preempted = res.get("nixl_send_preempted", 0)
            self._step_expired += len(res["expired"])
            self.hb_sent_log.extend(res.get("hb_sent_msgs", ()))
            for k in ("msgs", "bytes", "ids", "failed"):
                self.hb_sent[k] += res["hb_sent"][k] - self._last_hb(res["rank"], k, res["hb_sent"][k])
            self.hb_sent["max"] = max(self.hb_sent["max"], res["hb_sent"]["max"])
            self.hb_sent["last_t"] = max(self.hb_sent["last_t"], res["hb_sent"]["last_t"])
            for t, ids in res["hb_sent_ids"]:  # empty unless observe_ids
                for i in ids:
                    self.hb_ids_sent[i] = (self.hb_ids_sent.get(i, (0, 0))[0] + 1, t)
            for req_id in res["expired"]:
                if req_id in self.reqs:
                    self.reqs[req_id].setdefault("expired_ranks", set()).add(res["rank"])
            for req_id in res["sending"]:
                if req_id in self.reqs:
                    self.reqs[req_id].setdefault("sent_ranks", []).append(res["rank"])
                self.sent_counts[req_id] = self.sent_counts.get(req_id, 0) + 1
                if self.sent_counts[req_id] == world:  # KVOutputAggregator: all ranks done
                    sending.add(req_id)
            for req_id in res["failed"]:
                self.failed_pending.add(req_id)
                if req_id in self.reqs:
                    self.reqs[req_id].setdefault("failed_ranks", set()).add(res["rank"])
            for req_id in res["recving"]:
                if req_id in self.reqs:
                    self.reqs[req_id].setdefault("recv_ranks", set()).add(res["rank"])
                self.recv_counts[req_id] = self.recv_counts.get(req_id, 0) + 1
                if self.recv_counts[req_id] == world:  # KVOutputAggregator: all ranks done
                    del self.recv_counts[req_id]
                    recving.add(req_id)
            for req_id, heads in res["digests"].items():
                if req_id in self.reqs:
                    self.reqs[req_id].setdefault("digest", {}).update(heads)
                    wrote.add(req_id)
        if wrote and self._written_log is not None:
            for req_id in wrote:
                written = self.reqs[req_id]
                line = {"id": req_id, "digest": _short(written["digest"]), "t": written["submitted_t"]}
                self._written_log.write(json.dumps(line) + "\n")
            self._written_log.flush()
        if sending or recving:
            self.sched.update_connector_output(
                KVConnectorOutput(finished_sending=sending, finished_recving=recving)
            )
        for req_id in sending:  # P: blocks freed
            rec = self.reqs.get(req_id)
            if rec is None:
                continue
            rec["freed_t"] = now
            rec["freed_reason"] = reason = "expiry" if rec.get("expired_ranks") else "read"
            self.free_blocks.extend(rec["blocks"])
            self.live -= 1
            self.freed_by[reason] = self.freed_by.get(reason, 0) + 1
            if reason == "expiry" and req_id in self.deadlines:
                self._freed_late(now, self.deadlines.pop(req_id))
        for req_id in recving:  # D: read done; decode would run; finish and free
            rec = self.reqs[req_id]
            rec["read_t"] = now
            self.unread.pop(req_id, None)
            rec["failed"] = req_id in self.failed_pending
            self.failed_pending.discard(req_id)
            if "aborted_t" not in rec:  # an aborted request was finished at its abort
                req = rec["req"]
                req.status = self.status.FINISHED_LENGTH_CAPPED
                self.sched.request_finished(req, rec["blocks"])
            self.free_blocks.extend(rec["blocks"])
            rec["freed_t"] = now

    def _last_hb(self, rank: int, key: str, value: int) -> int:
        # Ranks report cumulative heartbeat counters; turn them into deltas.
        prev = self._hb_seen.get((rank, key), 0)
        self._hb_seen[(rank, key)] = value
        return prev

    def _freed_late(self, now: float, deadline: float) -> None:
        late = self.late
        late["n"] += 1
        late["max_s"] = max(late["max_s"], now - deadline)
        late["last_t"] = now
        late["last_late_s"] = now - deadline

    def _absorb_notifs(self, res: dict[str, Any]) -> None:
        observe_ids = self.spec.observe_ids
        self._step_notifs += len(res["notifs"])
        for t, agent, msg in res["notifs"]:
            if observe_ids:
                self.notif_log.append((t, agent, len(msg)))
            if is_any_heartbeat(msg):
                self.hb_arrivals.append(t)
                self.hb_recv["msgs"] += 1
                self.hb_recv["bytes"] += len(msg)
                self.hb_agents.add(agent)
                self.hb_recv_log.append((t, agent, zlib.crc32(msg)))
                if observe_ids:
                    self._hb_unmatched.append((t, res["rank"], agent, msg))
                    if len(self._hb_unmatched) >= HB_UNMATCHED_MAX:  # bound the memory held
                        self._match_heartbeats()
            elif msg.startswith(HELLO):
                self.hellos_recv += 1
            elif msg.startswith(HEARTBEAT_ACK_PREFIX) and msg.count(b":") >= 3:
                if len(self.acks_not_extended) < HB_UNMATCHED_MAX:
                    self.acks_not_extended.append((t, agent, msg[:256]))
            else:
                req_id, _, count = msg.decode("utf-8", "replace").rpartition(":")
                rec = self.reqs.get(req_id)
                if rec is not None:
                    rec.setdefault("read_t", t)
                    rec.setdefault("read_ranks", set()).add(res["rank"])
                    # (P) each consumer's completion "<id>:<consumers>", as received
                    rec.setdefault("completions", []).append((res["rank"], agent, count))

    def _match_heartbeats(self) -> None:
        """Credit each lease a heartbeat named (by id, or by tag) while P still
        held it: ``hb`` count, first and last arrival, longest wait between two."""
        pending, self._hb_unmatched = self._hb_unmatched, []
        for t, rank, agent, msg in pending:
            acked = parse_acked_heartbeat(msg)
            names = self.by_tag if acked is not None and acked[2] else None
            for raw in heartbeat_ids_of(msg).split(b","):
                name = raw.decode("utf-8", "replace")
                rec = self.reqs.get(names.get(name, "") if names is not None else name)
                if rec is None or t > rec.get("freed_t", t):
                    continue
                rec["hb"] += 1
                last = rec.get("hb_last_t")
                if last is None:
                    rec["hb_first_t"] = t
                elif t - last > rec.get("hb_max_gap", 0.0):
                    rec["hb_max_gap"] = t - last  # this lease's longest wait for a heartbeat
                rec["hb_last_t"] = t
                rec.setdefault("hb_ranks", set()).add(rank)
                rec.setdefault("hb_agents", set()).add(agent)

    # -- reports -------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        self._match_heartbeats()
        reqs = {r: {k: v for k, v in rec.items() if k not in ("req",)} for r, rec in self.reqs.items()}
        return {
            "engine_id": self.engine_id,
            "reqs": reqs,
            "errors": list(self.errors),
            "hb_sent": dict(self.hb_sent),
            "hellos_recv": self.hellos_recv,
            "acks_not_extended": list(self.acks_not_extended),
            "hb_ids_sent": dict(self.hb_ids_sent),
            "notif_log": list(self.notif_log),
            "hb_arrivals": list(self.hb_arrivals),
            "steps": self.steps,
            "max_step_s": self.max_step_s,
            "slow_steps": list(self.slow_steps),
            "step_gaps": list(self.step_gaps),
            "slow_phases": list(self.slow_phases),
            "free_blocks": len(self.free_blocks),
            "waiting": len(self.waiting),
        }

    def summary(self) -> dict[str, Any]:
        """What ``report`` says, as counts: cheap at any number of requests."""
        return {
            "engine_id": self.engine_id,
            "live": self.live,
            "freed_by": dict(self.freed_by),
            "errors": list(self.errors),
            "hb_sent": dict(self.hb_sent),
            "hb_recv": dict(self.hb_recv),
            "hb_agents": sorted(self.hb_agents),
            "steps": self.steps,
            "max_step_s": self.max_step_s,
            "free_blocks": len(self.free_blocks),
            "waiting": len(self.waiting),
            "held": len(self.held),
            "unread": len(self.unread),
            "late": dict(self.late),
            "deadlines_left": len(self.deadlines),
        }

    def drain(self) -> dict[str, Any]:
        """Hand over what happened since the last ``drain`` and forget it (a
        long run's per-request records stay bounded): P's writes (digests),
        frees (why, last heartbeat), D's loads (failed, digest), per-step
        timings, and the connector's structure sizes now (``structure_sizes``)."""
        self._match_heartbeats()
        written, freed, loaded = [], [], []
        for req_id in list(self.reqs):
            rec = self.reqs[req_id]
            if self.spec.role == "P":
                if "digest" in rec and not rec.get("written"):
                    rec["written"] = True
                    written.append((req_id, _short(rec["digest"]), rec.get("granted_t", rec["submitted_t"])))
                if "freed_t" not in rec:
                    continue
                freed.append(
                    (req_id, rec["freed_reason"], rec["freed_t"], rec.get("hb_last_t"), rec.get("hb", 0))
                )
                self.sent_counts.pop(req_id, None)
            else:
                if "read_t" not in rec:
                    if rec.get("abort_where") == "queued":  # ended at its abort (the caller recorded it)
                        del self.reqs[req_id]
                    continue
                loaded.append(
                    (
                        req_id,
                        bool(rec.get("failed")),
                        _short(rec.get("digest", {})),
                        rec["read_t"],
                        rec.get("admitted_t"),
                        "aborted_t" in rec,
                    )
                )
            del self.reqs[req_id]
        if self.spec.role == "P":
            live_tags = {t for t, r in self.by_tag.items() if r in self.reqs}
            self.by_tag = {t: self.by_tag[t] for t in live_tags}
        steps = [(s[0], s[1], s[2], s[14]) for s in self.step_log]
        self.step_log.clear()
        self.hb_sent_log.clear()
        self.hb_recv_log.clear()
        self.notif_log.clear()
        self.hb_arrivals.clear()
        self.hb_ids_sent.clear()
        return {
            "written": written,
            "freed": freed,
            "loaded": loaded,
            "steps": steps,
            "live": self.live,
            "waiting": len(self.waiting) + len(self.held),
            "unread": len(self.unread),
            "errors": len(self.errors),
            "last_error": self.errors[-1][-2000:] if self.errors else "",
            "sizes": structure_sizes(self),
            "stats": self.rank0.stats(),
            "d_held": self.d_held() if self.spec.role == "D" else None,
        }

    def d_held(self) -> dict[str, Any]:
        """D: what the engine still holds for remote loads: its free KV blocks, and
        the ids (at most ``HELD_IDS_MAX`` each) of the requests admitted whose load
        the worker has not reported (their blocks) and of upstream's pending receives
        (rank 0's ``_recving_metadata``)."""
        recving = getattr(self.rank0.worker, "_recving_metadata", {})
        return {
            "free_blocks": len(self.free_blocks),
            "unread": len(self.unread),
            "unread_ids": sorted(self.unread)[:HELD_IDS_MAX],
            "unread_aborted": sum(1 for r in self.unread if "aborted_t" in self.reqs.get(r, {})),
            "recving": len(recving),
            "recving_ids": sorted(map(str, recving))[:HELD_IDS_MAX],
            "queued": len(self.waiting) + len(self.held),
        }

    def timings(self) -> dict[str, Any]:
        """Hand over (and forget) the per-step and per-heartbeat records so far."""
        out = {
            "steps": list(self.step_log),
            "hb_sent": list(self.hb_sent_log),
            "hb_recv": list(self.hb_recv_log),
        }
        self.step_log.clear()
        self.hb_sent_log.clear()
        self.hb_recv_log.clear()
        return out

    def profile(self, steps: int) -> str:
        """cProfile the next ``steps`` steps; the stats (by cumulative time)
        go to a text file in the workdir, whose path is returned."""
        import cProfile

        self._profiler = cProfile.Profile()
        self._profile_left = steps
        self._profile_path = os.path.join(
            self.spec.workdir, f"{self.spec.name or self.spec.role}-profile.txt"
        )
        self._profiler.enable()
        return self._profile_path

    def _profile_steps(self) -> None:
        self._profile_left -= 1
        if self._profile_left > 0:
            return
        import io
        import pstats

        self._profiler.disable()
        out = io.StringIO()
        pstats.Stats(self._profiler, stream=out).sort_stats("cumulative").print_stats(60)
        with open(self._profile_path, "w") as f:
            f.write(out.getvalue())
        self._profiler = None

    def snapshot_deadlines(self) -> dict[str, Any]:
        """P: remember every lease's deadline now (worker clock -> monotonic),
        so that frees by expiry can say how late they came."""
        to_monotonic = time.monotonic() - time.perf_counter()
        table = self.rank0.worker._reqs_to_send  # a dict (stock) or our view of the lease table
        self.deadlines = {r: d + to_monotonic for r, d in table.items()}
        self.late = {"n": 0, "max_s": 0.0, "last_t": 0.0, "last_late_s": 0.0, "first_deadline": 0.0}
        if not self.deadlines:
            return {"n": 0}
        first, last = min(self.deadlines.values()), max(self.deadlines.values())
        self.late["first_deadline"] = first
        return {"n": len(self.deadlines), "first": first, "last": last, "now": time.monotonic()}

    def stats(self) -> list[dict[str, Any]]:
        out = [self.rank0.stats()]
        for rr in self.remote:
            rr.conn.send(("stats",))
            out.append(rr.recv())
        return out

    def hold_hellos(self, seconds: float) -> int:
        """P (ours), rank 0: drop every hello D sends for the next ``seconds``, as a
        P whose admission is slow (many agents loading; a TP=8 P's eight welcomes)
        never gets to D's; D's connection stays unproven meanwhile.  Returns the
        hellos dropped by the previous hold."""
        answerer = self.rank0.worker.ack_answerer
        dropped, self.hellos_held = self.hellos_held, 0
        until = time.monotonic() + seconds
        hello = getattr(answerer, "_harness_hello", None) or answerer._hello
        answerer._harness_hello = hello

        def held(agent: str, msg: bytes, now: float) -> None:
            if time.monotonic() < until:
                self.hellos_held += 1
                return
            hello(agent, msg, now)

        answerer._hello = held
        return dropped

    def shutdown(self) -> None:
        for rr in self.remote:
            try:
                rr.conn.send(("stop",))
                rr.recv(10)
            except Exception:
                pass
            try:
                os.kill(rr.pid, signal.SIGKILL)
                os.waitpid(rr.pid, 0)
            except OSError:
                pass
        self.rank0.shutdown()
        try:
            self.sched.shutdown()
        except Exception:
            pass


def _short(digest: dict[Any, str]) -> str:
    """A request's per-head digests as one short string (equal iff the data is)."""
    return "/".join(str(digest[h])[:16] for h in sorted(digest))


HELD_IDS_MAX = 20  # ids a leak report names (the counts are whole)
PEER_KEYS_MAX = 64  # a dict this small with str keys may be keyed by engine id: its keys are reported


def rss_kib() -> int:
    """This process's resident set size (KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def structure_sizes(eng: Engine, depth: int = 1) -> dict[str, Any]:
    """Sizes of the connector's collections, scheduler and worker (rank 0),
    ``depth`` levels into the components of this package; and the keys of small
    str-keyed dicts (per-engine state: the driver knows which are engine ids)."""
    sizes: dict[str, int] = {}
    keys: dict[str, list[str]] = {}

    def visit(prefix: str, obj: Any, depth: int) -> None:
        for name, value in list(vars(obj).items()):
            path = f"{prefix}.{name}"
            if isinstance(value, (dict, set, frozenset, list, deque)):
                sizes[path] = len(value)
                if isinstance(value, dict) and 0 < len(value) <= PEER_KEYS_MAX:
                    str_keys = [k for k in value if isinstance(k, str)]
                    if str_keys:
                        keys[path] = str_keys
                continue
            module = type(value).__module__ or ""
            if not module.startswith("vllm_nixl_lease"):
                continue
            try:
                sizes[path] = len(value)
            except TypeError:
                pass
            if depth > 0 and hasattr(value, "__dict__"):
                visit(path, value, depth - 1)

    visit("worker", eng.rank0.worker, depth)
    scheduler = getattr(eng.sched, "connector_scheduler", None)
    if scheduler is not None:
        visit("scheduler", scheduler, depth)
    return {"sizes": sizes, "keys": keys}


def publish_handshakes(sched: Any, handshakes: dict[tuple[int, int], Any], port: int) -> None:
    """Start the side-channel listener; fail fast (not hang) if its port is taken.

    vLLM waits without a timeout for the listener thread to bind; a thread that
    died on EADDRINUSE would leave us waiting forever.
    """
    import threading

    done = threading.Event()
    failure: list[BaseException] = []

    def publish() -> None:
        try:
            sched.set_xfer_handshake_metadata_pp_aware(handshakes)
        except BaseException as exc:
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=publish, daemon=True, name="publish_handshakes").start()
    deadline = time.monotonic() + 60
    while not done.wait(0.1):
        listener = getattr(sched.connector_scheduler, "_nixl_handshake_listener_t", None)
        if listener is not None and not listener.is_alive():
            raise RuntimeError(f"{PORT_TAKEN}: the handshake listener died binding port {port}")
        if time.monotonic() > deadline:
            raise TimeoutError("handshake listener not ready after 60 s")
    if failure:
        raise failure[0]


def join_host(spec: EngineSpec) -> None:
    """Move this process onto its host (see ``harness.netns``) and make UCX use
    TCP over that host's interface only.

    Called first thing, while the process has one thread: setns(2) moves only
    the calling thread, and threads started later (UCX's and NIXL's progress
    threads, ZMQ's, the TP ranks forked in ``Engine``) inherit its namespace.
    Without ``UCX_TLS=tcp`` UCX would pick shared memory or CMA between two
    processes of one machine, which no network partition can cut.
    """
    if spec.netns:
        enter_netns(spec.netns)
        os.environ["UCX_TLS"] = "tcp"
        os.environ["UCX_NET_DEVICES"] = spec.net_device
    os.environ.update(spec.env)


def net_namespace(pid: int | str = "self") -> str:
    """The network namespace of a process, e.g. ``net:[4026531840]``."""
    return os.readlink(f"/proc/{pid}/ns/net")


def engine_main(spec: EngineSpec, conn: Any) -> None:
    """Child entry point: build, say ready, then step and serve commands."""
    join_host(spec)
    if spec.progress_delay_us:
        sleep_between_events(spec.progress_delay_us)
    redirect_output(spec.log_path("engine"))
    log(f"engine {spec.name} forked (vLLM preloaded: {'harness.nixl.preload' in sys.modules})")
    if spec.netns:
        log(f"on host {spec.netns} ({spec.host_ip}, {spec.net_device}): {net_namespace()}")
    # A start-up that hangs leaves every thread's Python stack in the log.
    faulthandler.dump_traceback_later(30, repeat=True, file=sys.stderr)
    if spec.clock_skew:
        # vLLM reads time.perf_counter at call time: every deadline, the
        # handshake's clock echo and the sweeps move with it (not NIXL's own).
        real = time.perf_counter
        time.perf_counter = lambda: real() + spec.clock_skew
    try:
        eng = Engine(spec)
        faulthandler.cancel_dump_traceback_later()
        agent, _ = eng.rank0.agent_metadata()
        info = {
            "engine_id": eng.engine_id,
            "agent": agent,
            "pid": os.getpid(),
            "net_ns": [net_namespace()] + [net_namespace(rr.pid) for rr in eng.remote],
        }
        conn.send(("ok", info))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    born = time.monotonic()
    next_step = time.monotonic()
    rearm_at = 0.0
    while time.monotonic() - born < spec.max_lifetime_s:
        if time.monotonic() >= rearm_at:
            # Stalled STALL_DUMP_S - STALL_REARM_S or more: the dump fires (and the log says when).
            faulthandler.dump_traceback_later(STALL_DUMP_S, file=sys.stderr)
            rearm_at = time.monotonic() + STALL_REARM_S
        while conn.poll(max(0.0, next_step - time.monotonic())):
            try:
                cmd, kwargs = conn.recv()
            except EOFError:  # the test process is gone
                eng.shutdown()
                return
            if cmd == "stop":
                faulthandler.cancel_dump_traceback_later()
                eng.shutdown()
                conn.send(("ok", None))
                # An exit that lingers (Python joins non-daemon threads, e.g. a
                # handshake waiting on a dead peer) leaves its stacks in the log.
                log("stopped; exiting")
                faulthandler.dump_traceback_later(EXIT_DUMP_S, file=sys.stderr)
                return
            try:
                conn.send(("ok", _handle(eng, cmd, kwargs)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
        next_step = time.monotonic() + spec.step_s
        try:
            eng.step()
        except Exception:
            eng.errors.append(traceback.format_exc())


def skew_clock(seconds: float) -> float:
    """Move this process's ``time.perf_counter`` by ``seconds`` from now on: a
    clock that drifted or was slewed after the handshake measured the offset
    (the engine's TP ranks are other processes: TP 1 only).  Returns the new reading."""
    before = time.perf_counter
    time.perf_counter = lambda: before() + seconds
    log(f"clock skewed by {seconds:+g}s")
    return time.perf_counter()


def _handle(eng: Engine, cmd: str, kwargs: dict[str, Any]) -> Any:
    if cmd == "prefill":
        return eng.prefill(**kwargs)
    if cmd == "submit":
        return eng.submit(**kwargs)
    if cmd == "release":
        return eng.release(**kwargs)
    if cmd == "abort":
        return eng.abort(**kwargs)
    if cmd == "report":
        return eng.report()
    if cmd == "summary":
        return eng.summary()
    if cmd == "timings":
        return eng.timings()
    if cmd == "drain":
        return eng.drain()
    if cmd == "snapshot_deadlines":
        return eng.snapshot_deadlines()
    if cmd == "profile":
        return eng.profile(**kwargs)
    if cmd == "stats":
        return eng.stats()
    if cmd == "gate_writes":
        return eng.rank0.gate_writes(**kwargs)
    if cmd == "agent_metadata":
        return eng.rank0.agent_metadata()
    if cmd == "skew_clock":
        return skew_clock(**kwargs)
    if cmd == "hold_reads":
        return eng.rank0.hold_reads(**kwargs)
    if cmd == "hold_hellos":
        return eng.hold_hellos(**kwargs)
    if cmd == "structure_sizes":
        return structure_sizes(eng, **kwargs)
    if cmd == "rss_kib":
        return rss_kib()
    raise ValueError(f"unknown command {cmd!r}")
