"""One TP rank of a harness engine: a real connector worker with real NIXL.

The rank is driven the way vLLM's model runner drives a connector worker:
``bind_connector_metadata`` -> ``start_load_kv`` -> (forward: the prefill
writes KV) -> ``get_transfer_results`` -> ``clear_connector_metadata``.
It also observes, without changing behaviour, what crosses NIXL: every
notification P drains, every ``send_notif`` D makes, and which requests the
expiry sweep released.
"""

from __future__ import annotations

import gc
import os
import resource
import threading
import time
import traceback
import zlib
from typing import Any

from harness.procs import log, redirect_output
from vllm_nixl_lease._wire import (
    ESCAPE_PREFIX,
    HELLO_KIND,
    heartbeat_payload,
    is_escape,
    is_heartbeat,
    parse_acked_heartbeat,
)

from . import kv_cache
from .read_hold import ReadHold
from .spec import EngineSpec


def connector_class(spec: EngineSpec) -> type:
    if spec.stock:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as stock

        return stock.NixlPushConnector if spec.push else stock.NixlPullConnector
    from vllm_nixl_lease.adapter import connector as ours

    return ours.LeaseNixlPushConnector if spec.push else ours.LeaseNixlPullConnector


class Rank:
    """Worker-role connector of one TP rank plus its KV cache."""

    def __init__(self, spec: EngineSpec, rank: int, dist_init: str, vllm_config: Any, kv_config: Any) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.spec = spec
        self.rank = rank
        affinity = os.sched_getaffinity(0)
        with set_current_vllm_config(vllm_config):
            log(f"rank {rank}: init_distributed_environment")
            init_distributed_environment(
                world_size=spec.tp_size,
                rank=rank,
                local_rank=rank,
                backend="gloo",
                distributed_init_method=f"file://{dist_init}",
            )
            ensure_model_parallel_initialized(spec.tp_size, 1)
            log(f"rank {rank}: connector worker")
            self.connector = connector_class(spec)(vllm_config, KVConnectorRole.WORKER, kv_config)
            log(f"rank {rank}: connector worker built")
        # The CPU worker pins itself to the last core of each NUMA node (one
        # core here); every engine on this 2-core box would share it.
        os.sched_setaffinity(0, affinity)
        self.worker = self.connector.connector_worker
        self.kv_caches = kv_cache.allocate(kv_config)
        self.cache = self.kv_caches[kv_cache.LAYER]
        self.connector.register_kv_caches(self.kv_caches)
        log(f"rank {rank}: KV caches registered")
        self.heads = self.cache.shape[1]
        self.head_offset = rank * self.heads
        self._install_probes()
        # Push P: ``gate_writes`` makes the writer thread wait before posting a
        # WRITE (a test cuts the link meanwhile, so the WRITE queues in UCX).
        self.write_gate = threading.Event()
        self.write_gate.set()
        self.writes_waiting: list[str] = []
        if spec.push and spec.role == "P":
            self._install_write_gate()
        self.read_hold: ReadHold | None = None  # D: ``hold_reads``

    # -- observation -----------------------------------------------------
    def _install_probes(self) -> None:
        w = self.worker
        wrapper = w.nixl_wrapper
        observe_ids = self.spec.observe_ids
        self.notifs: list[tuple[float, str, bytes]] = []
        self.expired: set[str] = set()
        self.hb_sent = {"msgs": 0, "bytes": 0, "max": 0, "ids": 0, "last_t": 0.0, "failed": 0}
        self.hb_sent_ids: list[tuple[float, list[str]]] = []
        # (send time, crc32 of the message, ids in it): matched on P against
        # the receive time of the same message (heartbeat latency).
        self.hb_sent_msgs: list[tuple[float, int, int]] = []
        # Seconds the probes spent on their own bookkeeping this step: taken
        # out of the connector time, so that stock and ours are timed alike.
        self.probe_s = 0.0
        # Seconds inside NIXL's get_new_notifs / send_notif (transport, not
        # bookkeeping), and in the cyclic garbage collector (this process,
        # cumulative: a pause lands in whichever code allocates, and its
        # length follows the whole heap), to tell them apart from the rest.
        self.nixl_s = 0.0
        self.nixl_send_s = 0.0  # of nixl_s: in send_notif (D's heartbeats, P's LACK answers)
        self.nixl_send_cpu_s = 0.0  # this thread's CPU time in send_notif
        self.nixl_sends = 0
        self.nixl_send_preempted = 0  # preemptions of this thread inside send_notif
        self.nixl_send_agents: set = set()
        self.gc_s = 0.0
        self._gc_t0 = 0.0

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                self._gc_t0 = time.perf_counter()
            else:
                self.gc_s += time.perf_counter() - self._gc_t0

        gc.callbacks.append(on_gc)
        orig_get, orig_send, orig_reap = (
            wrapper.get_new_notifs,
            wrapper.send_notif,
            w._reap_expired_send_leases,
        )

        hello = ESCAPE_PREFIX + HELLO_KIND
        drop_hellos = self.spec.drop_hellos

        def get_new_notifs() -> dict[str, list[bytes]]:
            t0 = time.perf_counter()
            out = orig_get()
            self.nixl_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            now = time.monotonic()
            for agent, msgs in out.items():
                self.notifs.extend((now, agent, m) for m in msgs)
            self.probe_s += time.perf_counter() - t0
            if drop_hellos:  # recorded (the engine counts them), never handed to the connector
                out = {a: k for a, ms in out.items() if (k := [m for m in ms if not m.startswith(hello)])}
            return out

        def send_notif(agent_name: Any, notif_msg: bytes) -> None:
            sent_t = time.monotonic()  # when D hands the message to NIXL (latency starts here)
            preempted0 = preemptions()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            try:
                orig_send(agent_name, notif_msg=notif_msg)
            except Exception:
                if is_any_heartbeat(notif_msg):
                    self.hb_sent["failed"] += 1
                raise
            finally:
                took = time.perf_counter() - t0
                self.nixl_send_cpu_s += time.thread_time() - c0
                self.nixl_send_preempted += preemptions() - preempted0
                self.nixl_s += took
                self.nixl_send_s += took
                self.nixl_sends += 1
                self.nixl_send_agents.add(agent_name)
            t0 = time.perf_counter()
            if is_any_heartbeat(notif_msg):
                hb = self.hb_sent
                hb["msgs"] += 1
                hb["bytes"] += len(notif_msg)
                hb["max"] = max(hb["max"], len(notif_msg))
                hb["last_t"] = time.monotonic()
                payload = heartbeat_ids_of(notif_msg)
                n_ids = payload.count(b",") + 1 if payload else 0
                hb["ids"] += n_ids
                self.hb_sent_msgs.append((sent_t, zlib.crc32(notif_msg), n_ids))
                if observe_ids:
                    self.hb_sent_ids.append((hb["last_t"], payload.decode().split(",")))
            self.probe_s += time.perf_counter() - t0

        def reap(done_sending: set[str]) -> None:
            t0 = time.perf_counter()
            before = set(done_sending)
            self.probe_s += time.perf_counter() - t0
            orig_reap(done_sending)
            t0 = time.perf_counter()
            if len(done_sending) > len(before):
                self.expired |= done_sending - before
            self.probe_s += time.perf_counter() - t0

        # NIXL agents loaded (D: upstream's handshakes, one per P rank each)
        self.agents_added = 0
        orig_add = wrapper.add_remote_agent

        def add_remote_agent(metadata: bytes) -> Any:
            self.agents_added += 1
            return orig_add(metadata)

        wrapper.get_new_notifs = get_new_notifs
        wrapper.send_notif = send_notif
        wrapper.add_remote_agent = add_remote_agent
        w._reap_expired_send_leases = reap

    def _install_write_gate(self) -> None:
        w = self.worker
        post = w._xfer_blocks_for_req  # upstream's writer thread calls it through the instance

        def gated(req_id: str, meta: Any) -> None:
            if not self.write_gate.is_set():
                self.writes_waiting.append(req_id)
                self.write_gate.wait()
            post(req_id, meta)

        w._xfer_blocks_for_req = gated

    def gate_writes(self, closed: bool) -> list[str]:
        """Close (or open) the push writer's gate; the requests waiting at it so far."""
        waiting = list(self.writes_waiting)
        if closed:
            self.write_gate.clear()
        else:
            self.writes_waiting.clear()
            self.write_gate.set()
        return waiting

    def hold_reads(self, stalled: str, release: str, timeout_s: float = 60.0) -> None:
        """D: hold the READs the next step posts, and stall after it (``read_hold.py``)."""
        self.read_hold = ReadHold(self.worker.nixl_wrapper, stalled, release, timeout_s)

    def handshake_metadata(self) -> Any:
        return self.connector.get_handshake_metadata()

    # -- one engine step -----------------------------------------------------
    def step(self, meta: Any, fills: dict[str, list[int]], blocks_of: dict[str, list[int]]) -> dict[str, Any]:
        """One step. ``fills``: requests this step prefills (P writes their KV,
        as the forward pass would); ``blocks_of``: D's unread requests, hashed
        once the step reports them read.

        ``connector_s``: wall time inside the worker connector's
        ``start_load_kv`` and ``get_transfer_results`` (notification routing,
        heartbeats, grants, reads posted, expiry sweep), less the probes' own
        bookkeeping: the same two calls timed the same way for stock and ours.
        Of it, ``nixl_s`` in NIXL's notification calls and ``gc_s`` in
        garbage collection pauses.  ``connector_cpu_s``: this thread's CPU
        time in the same calls (wall time less the time other processes held
        the core: on a shared 2-core machine the two differ); ``preempted``: how
        many times another task took the core from this thread in those calls
        (of them ``nixl_send_preempted`` inside ``send_notif``)."""
        error = None
        res = None
        conn = self.connector
        self.probe_s = self.nixl_s = self.nixl_send_s = self.nixl_send_cpu_s = 0.0
        self.nixl_sends = self.nixl_send_preempted = 0
        self.nixl_send_agents = set()
        connector_s = 0.0
        gc_before = self.gc_s
        gc_s = cpu_s = 0.0
        preempted = 0
        t_fill = t_results = t_start = time.perf_counter()  # phases of a slow step
        try:
            conn.bind_connector_metadata(meta)
            t0, c0, v0 = time.perf_counter(), time.thread_time(), preemptions()
            try:
                conn.start_load_kv(None)
            finally:
                connector_s += time.perf_counter() - t0
                cpu_s += time.thread_time() - c0
                preempted += preemptions() - v0
                gc_s += self.gc_s - gc_before
            t_fill = time.perf_counter()
            for req_id, blocks in fills.items():
                for h in range(self.heads):
                    kv_cache.fill_blocks(self.cache[:, h], blocks, f"{req_id}/h{self.head_offset + h}")
            t0, c0, v0 = time.perf_counter(), time.thread_time(), preemptions()
            t_results = t0
            gc_before = self.gc_s
            try:
                res = conn.get_transfer_results(set())
            finally:
                connector_s += time.perf_counter() - t0
                cpu_s += time.thread_time() - c0
                preempted += preemptions() - v0
                gc_s += self.gc_s - gc_before
        except Exception:
            error = traceback.format_exc()
        finally:
            conn.clear_connector_metadata()
        if self.read_hold is not None and self.read_hold.stall_if_held():
            self.read_hold = None
        t_done = time.perf_counter()
        recving = set(res.finished_recving) if res else set()
        failed = set(res.failed_recving) if res else set()
        digests = {}
        if self.spec.observe_ids:
            to_hash = dict(fills)
            # A failed load's blocks hold nothing to check: hashing them only slows the step.
            to_hash.update((r, blocks_of[r]) for r in recving - failed if r in blocks_of)
            digests = {
                r: {
                    self.head_offset + h: d
                    for h, d in enumerate(kv_cache.digest_heads(self.cache, b, self.spec.sampled_digest))
                }
                for r, b in to_hash.items()
            }
        # Where a slow step went: the connector's two calls, and the harness's own work.
        phases = {
            "start_load_kv": t_fill - t_start,
            "fill": t_results - t_fill,
            "get_transfer_results": t_done - t_results,
            "digest": time.perf_counter() - t_done,
        }
        out = {
            "rank": self.rank,
            "sending": set(res.finished_sending) if res else set(),
            "recving": recving,
            "failed": failed,
            "expired": self.expired,
            "notifs": self.notifs,
            "hb_sent": dict(self.hb_sent),
            "hb_sent_ids": self.hb_sent_ids,
            "hb_sent_msgs": self.hb_sent_msgs,
            "connector_s": max(0.0, connector_s - self.probe_s),
            "nixl_s": self.nixl_s,
            "nixl_send_s": self.nixl_send_s,
            "nixl_send_cpu_s": self.nixl_send_cpu_s,
            "nixl_sends": self.nixl_sends,
            "nixl_send_agents": len(self.nixl_send_agents),
            "nixl_send_preempted": self.nixl_send_preempted,
            "preempted": preempted,
            "connector_cpu_s": max(0.0, cpu_s - self.probe_s),
            "gc_s": gc_s,
            "error": error,
            "digests": digests,
            "phases": phases,
        }
        self.expired, self.notifs, self.hb_sent_ids, self.hb_sent_msgs = set(), [], [], []
        return out

    def stats(self) -> dict[str, Any]:
        stats = self.worker.xfer_stats
        data = getattr(stats, "data", {})
        # Counters are lists of per-step counts; timings are lists of floats.
        out = {
            k: (sum(v) if all(isinstance(x, int) for x in v) else len(v)) if isinstance(v, list) else v
            for k, v in data.items()
        }
        out["harness_agents_added"] = self.agents_added  # the probe's, not the connector's
        return out

    def agent_metadata(self) -> tuple[str, bytes]:
        w = self.worker.nixl_wrapper
        return w.name, w.get_agent_metadata()

    def shutdown(self) -> None:
        try:
            self.connector.shutdown()
        except Exception:
            pass


def is_any_heartbeat(msg: bytes) -> bool:
    """Upstream's ``HB:`` or our acknowledged ``LHB:`` / ``LHBT:`` (not our hello)."""
    return is_heartbeat(msg) and not msg.startswith(ESCAPE_PREFIX + HELLO_KIND)


def preemptions() -> int:
    """Times this thread has lost its core to another runnable task (involuntary context switches)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def heartbeat_ids_of(msg: bytes) -> bytes:
    """The id (or, for ``LHBT:``, tag) payload of any heartbeat form."""
    if is_escape(msg):
        parsed = parse_acked_heartbeat(msg)
        return parsed[1] if parsed else b""
    return heartbeat_payload(msg) if is_heartbeat(msg) else b""


def rank_main(spec: EngineSpec, rank: int, dist_init: str, conn: Any) -> None:
    """Entry point of a TP rank > 0 in its own process (P or D with TP > 1)."""
    redirect_output(spec.log_path(f"rank{rank}"))
    vc = kv_cache.vllm_config(spec, engine_id=conn.recv())
    rk = Rank(spec, rank, dist_init, vc, kv_cache.kv_cache_config(spec))
    conn.send(rk.handshake_metadata())
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "step":
            conn.send(rk.step(*msg[1:]))
        elif msg[0] == "stats":
            conn.send(rk.stats())
        elif msg[0] == "stop":
            rk.shutdown()
            conn.send(None)
            return
