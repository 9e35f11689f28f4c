"""Benchmark the lease core against upstream vLLM's real code, in one process.

Each scenario times ours (Cython), ours (pure-Python twin) and upstream
vLLM 0.33.0's own methods on identical state, takes the median of repeated
runs and prints times, speed-ups and the targets the core is held to.  Not a test: the
targets are checked by reading the table (or ``--json``).

    python -m tools.bench_core [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import logging
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any
from unittest import mock

from harness.upstream_fake import NIXL, FakeNixlWrapper, make_upstream_worker, stock_worker_class
from vllm_nixl_lease._wire import heartbeat_message, heartbeat_payload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `tools` is importable from here
EXTENSION = 20


def load_impl(name: str):
    if name == "cython":
        lease = importlib.import_module("vllm_nixl_lease.prefill._lease_table_c")
        router = importlib.import_module("vllm_nixl_lease.prefill._notification_router_c")
        hb = importlib.import_module("vllm_nixl_lease.decode._heartbeat_tracker_c")
        return lease.LeaseTable, router.NotificationRouter, hb.HeartbeatTracker
    lease = importlib.import_module("vllm_nixl_lease.prefill._lease_table_py")
    router = importlib.import_module("vllm_nixl_lease.prefill._notification_router_py")
    hb = importlib.import_module("vllm_nixl_lease.decode._heartbeat_tracker_py")
    return lease.LeaseTable, router.NotificationRouter, hb.HeartbeatTracker


def upstream_p_worker():
    return make_upstream_worker(stock_worker_class(), EXTENSION, FakeNixlWrapper(keep_sent=False))


def req_ids(n: int, prefix: str = "cmpl") -> list[str]:
    # vLLM request ids look like "cmpl-<uuid hex>-0"
    return [f"{prefix}-{i:032x}-0" for i in range(n)]


def median_ns(fn, repeats: int, setup=None) -> float:
    """Median wall time of ``fn()`` in ns; ``setup()`` (untimed) runs before each.
    The cyclic GC is paused while timing (as timeit does) so that a collection
    of vLLM's large heap does not land on whichever side happens to allocate."""
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        gc.disable()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
        gc.enable()
    return statistics.median(samples)


def per_call_ns(fn, calls: int, repeats: int) -> float:
    """Median over repeats of the mean time of ``calls`` back-to-back calls."""

    def batch():
        for _ in range(calls):
            fn()

    return median_ns(batch, repeats) / calls


# -- P-side state builders -------------------------------------------------
def fill_ours(impl: str, ids: list[str], deadlines: list[float]):
    LeaseTable, NotificationRouter, _ = load_impl(impl)
    router = NotificationRouter(LeaseTable(EXTENSION))
    for rid, d in zip(ids, deadlines, strict=True):
        router.add_in_batch(rid)
        router.grant(rid, d)
    return router


def fill_upstream(ids: list[str], deadlines: list[float]):
    w = upstream_p_worker()
    w._reqs_to_process.update(ids)
    w._reqs_to_send.update(zip(ids, deadlines, strict=True))
    return w


def run_upstream(w, now: float, fn):
    with mock.patch("time.perf_counter", return_value=now):
        return fn()


# -- scenarios: each returns {impl: ns} -------------------------------------
def sweep_idle(n: int, quick: bool) -> dict[str, float]:
    ids = req_ids(n)
    deadlines = [1e6 + i for i in range(n)]
    out = {}
    for impl in ("cython", "python"):
        router = fill_ours(impl, ids, deadlines)
        out[impl] = per_call_ns(lambda r=router: r.expire(100.0), 2000, 7)
    w = fill_upstream(ids, deadlines)
    with mock.patch("time.perf_counter", return_value=100.0):
        out["upstream"] = median_ns(lambda: w._reap_expired_send_leases(set()), 3 if n >= 10**6 else 7)
    return out


def sweep_churn(n: int, quick: bool) -> dict[str, float]:
    """Steady state: leases live 100 steps; each step 1% are renewed by a
    heartbeat, 1% expire and 1% new ones are granted.  Times the sweep."""
    steps = 20 if quick else 60
    per = n // 100
    ids = req_ids(n + per * steps, "sw")
    out = {}
    for impl in ("cython", "python", "upstream"):
        live = ids[:n]
        deadlines = [float(i // per) for i in range(n)]  # per leases due at each step
        # One of the two is filled, the other stays None: each impl drives its own.
        w: Any = None
        router: Any = None
        if impl == "upstream":
            w = fill_upstream(live, deadlines)
        else:
            router = fill_ours(impl, live, deadlines)
        samples = []
        fresh = n
        for step in range(steps):
            now = float(step)
            # renew 1% (leases due in ~50 steps), grant 1% new
            renew = live[(step + 50) * per % n : (step + 50) * per % n + per]
            payload = heartbeat_message(renew)
            new = ids[fresh : fresh + per]
            fresh += per
            if impl == "upstream":
                w.nixl_wrapper.inbox = {"d": [payload]}
                run_upstream(w, now, w._get_new_notifs)
                w._reqs_to_process.update(new)
                w._reqs_to_send.update((r, now + 100.0) for r in new)
                with mock.patch("time.perf_counter", return_value=now):
                    samples.append(median_ns(lambda w=w: w._reap_expired_send_leases(set()), 1))
            else:
                router.route({"d": [payload]}, now)
                for r in new:
                    router.add_in_batch(r)
                    router.grant(r, now + 100.0)
                samples.append(median_ns(lambda r=router, t=now: r.expire(t), 1))
        out[impl] = statistics.median(samples)
    return out


def heartbeat(n: int, quick: bool) -> dict[str, float]:
    ids = req_ids(n)
    deadlines = [1e6] * n
    payload = heartbeat_message(ids[:: max(1, n // 1000)][:1000])
    out = {}
    for impl in ("cython", "python"):
        router = fill_ours(impl, ids, deadlines)
        out[impl] = per_call_ns(lambda r=router: r.route({"d": [payload]}, 5.0), 200, 7)
    w = fill_upstream(ids, deadlines)

    def up():
        w.nixl_wrapper.inbox = {"d": [payload]}
        w._get_new_notifs()

    with mock.patch("time.perf_counter", return_value=5.0):
        out["upstream"] = per_call_ns(up, 50, 7)
    return out


def _heartbeat_id(n: int, pick) -> dict[str, float]:
    """ns per id of one 1k-id heartbeat message routed against n leases."""
    ids = req_ids(n)
    deadlines = [1e6] * n
    hb_ids = pick(ids)
    payload = heartbeat_message(hb_ids)
    out = {}
    for impl in ("cython", "python"):
        router = fill_ours(impl, ids, deadlines)
        assert router.route({"d": [payload]}, 5.0).extended == len(hb_ids)
        out[impl] = per_call_ns(lambda r=router: r.route({"d": [payload]}, 5.0), 200, 7) / len(hb_ids)
    w = fill_upstream(ids, deadlines)

    def up():
        w.nixl_wrapper.inbox = {"d": [payload]}
        w._get_new_notifs()

    with mock.patch("time.perf_counter", return_value=5.0):
        out["upstream"] = per_call_ns(up, 50, 7) / len(hb_ids)
    return out


def heartbeat_contig(n: int, quick: bool) -> dict[str, float]:
    """1k consecutive grants (neighbours in the slot vector) in one heartbeat."""
    return _heartbeat_id(n, lambda ids: ids[len(ids) // 2 : len(ids) // 2 + 1000])


def heartbeat_spread(n: int, quick: bool) -> dict[str, float]:
    """1k ids spread evenly over all n leases (each lookup a fresh cache line)."""
    return _heartbeat_id(n, lambda ids: ids[:: max(1, len(ids) // 1000)][:1000])


def mixed_batch(n: int, quick: bool) -> dict[str, float]:
    """1,000 read completions + 10 heartbeats of 1k ids in one batch."""
    ids = req_ids(n)
    done = ids[:1000]
    hbs = [heartbeat_message(ids[1000 + k * 1000 : 2000 + k * 1000]) for k in range(10)]
    batch = {
        "d0": [f"{r}:1".encode() for r in done[:500]] + hbs[:5],
        "d1": [f"{r}:1".encode() for r in done[500:]] + hbs[5:],
    }
    out = {}
    for impl in ("cython", "python"):
        router = fill_ours(impl, ids, [1e6] * n)

        def regrant(r=router):
            for rid in done:
                r.add_in_batch(rid)
                r.grant(rid, 1e6)

        out[impl] = median_ns(lambda r=router: r.route(batch, 5.0), 15, regrant)
    w = fill_upstream(ids, [1e6] * n)

    def regrant_up():
        w._reqs_to_process.update(done)
        w._reqs_to_send.update((r, 1e6) for r in done)
        w.nixl_wrapper.inbox = {k: list(v) for k, v in batch.items()}

    with mock.patch("time.perf_counter", return_value=5.0):
        out["upstream"] = median_ns(w._get_new_notifs, 15, regrant_up)
    return out


def mass_expiry(n: int, quick: bool) -> dict[str, float]:
    """A D died: 1,000 of n leases are due in one step.  Logging included
    (WARNING level, a stream handler writing to memory, for both)."""
    from vllm_nixl_lease.prefill.expiry_log import log_expired

    ids = req_ids(n)
    deadlines = [1.0 if i % (n // 1000) == 0 else 1e6 for i in range(n)]
    sink = logging.StreamHandler(io.StringIO())
    up_logger = logging.getLogger(f"{NIXL}.base_worker")
    our_logger = logging.getLogger("vllm_nixl_lease.bench")
    for lg in (up_logger, our_logger):
        lg.handlers[:] = [sink]
        lg.propagate = False
        lg.setLevel(logging.INFO)
    out = {}
    for impl in ("cython", "python"):
        state: dict[str, Any] = {}

        def setup(impl=impl, state=state):
            state["r"] = fill_ours(impl, ids, deadlines)

        def sweep(state=state):
            log_expired(our_logger, state["r"].expire(2.0))

        out[impl] = median_ns(sweep, 7, setup)
    state = {}

    def setup_up():
        state["w"] = fill_upstream(ids, deadlines)

    def sweep_up():
        with mock.patch("time.perf_counter", return_value=2.0):
            state["w"]._reap_expired_send_leases(set())

    out["upstream"] = median_ns(sweep_up, 7, setup_up)
    return out


def d_build(n: int, quick: bool) -> dict[str, float]:
    """D worker, one heartbeat tick: 10k ids over 8 engines to wire bytes.
    Between ticks 1% of requests leave (oldest first, as D's queue drains in
    order) and 1% arrive.  Upstream joins every id of every engine each tick."""
    base_worker = importlib.import_module(f"{NIXL}.base_worker")
    metadata = importlib.import_module(f"{NIXL}.metadata")
    engines = [f"engine-{e}" for e in range(8)]
    ticks = 30
    ids = req_ids(n + n // 100 * (ticks + 1), "d")
    out = {}
    for impl in ("cython", "python"):
        _, _, HeartbeatTracker = load_impl(impl)
        hb = HeartbeatTracker(0)
        for i, rid in enumerate(ids[:n]):
            hb.track(rid, engines[i % 8], rid)
        nixl = FakeNixlWrapper(keep_sent=False)
        samples = []
        lo, hi = 0, n
        for _ in range(ticks):
            for rid in ids[lo : lo + n // 100]:
                hb.untrack(rid)
            for j, rid in enumerate(ids[hi : hi + n // 100]):
                hb.track(rid, engines[(hi + j) % 8], rid)
            lo += n // 100
            hi += n // 100

            def tick(hb=hb, nixl=nixl):  # interval 0: every chunk at every call
                for engine, chunks in hb.poll_paced_chunks(0.0).items():
                    for _, _, m, _ in chunks:
                        nixl.send_notif(engine, m)

            samples.append(median_ns(tick, 1))
        out[impl] = statistics.median(samples)
    w = make_upstream_worker(base_worker.NixlBaseConnectorWorker, EXTENSION, FakeNixlWrapper(keep_sent=False))
    w._remote_agents = {e: {0: e} for e in engines}
    w._ensure_handshake = lambda *a, **k: None
    by_engine = {
        e: metadata.HeartbeatInfo(req_ids=set(ids[i:n:8]), host="h", port=1, tp_size=1)
        for i, e in enumerate(engines)
    }
    meta = type("Meta", (), {"heartbeat_by_engine": by_engine})()
    out["upstream"] = per_call_ns(lambda: w._send_heartbeats(meta), 20, 7)
    return out


def d_pickle(n: int, quick: bool) -> dict[str, float]:
    """Round trip of the heartbeat data the scheduler->worker metadata carries."""
    metadata = importlib.import_module(f"{NIXL}.metadata")
    from vllm_nixl_lease.adapter.metadata import EngineHeartbeats

    engines = [f"engine-{e}" for e in range(8)]
    ids = req_ids(n, "d")
    out = {}
    for impl in ("cython", "python"):
        _, _, HeartbeatTracker = load_impl(impl)
        hb = HeartbeatTracker(0)
        for i, rid in enumerate(ids):
            hb.track(rid, engines[i % 8], rid)
        sent = hb.poll_paced_chunks(0.0)  # interval 0: every chunk
        payload = {e: EngineHeartbeats(e, [m for _, _, m, _ in c], "h", 1, 1) for e, c in sent.items()}
        out[impl] = per_call_ns(lambda p=payload: pickle.loads(pickle.dumps(p)), 200, 7)
    up = {
        e: metadata.HeartbeatInfo(req_ids=set(ids[i::8]), host="h", port=1, tp_size=1)
        for i, e in enumerate(engines)
    }
    out["upstream"] = per_call_ns(lambda: pickle.loads(pickle.dumps(up)), 20, 7)
    return out


def memory(n: int, quick: bool) -> dict[str, float]:
    """Bytes beyond the id strings for n leases after 10*n heartbeat extensions."""
    ids = req_ids(n)
    payloads = [heartbeat_message(ids[k : k + 1000]) for k in range(0, n, 1000)]
    out = {}
    for impl in ("cython", "python"):
        LeaseTable, _, _ = load_impl(impl)
        t = LeaseTable(EXTENSION)
        for rid in ids:
            t.grant(rid, 1.0)
        for rnd in range(10):
            for p in payloads:
                t.extend(heartbeat_payload(p), float(rnd))
        out[impl] = float(t.nbytes())
    w = fill_upstream(ids, [1.0] * n)
    for rnd in range(10):
        for p in payloads:
            with mock.patch("time.perf_counter", return_value=float(rnd)):
                w._handle_heartbeat(heartbeat_payload(p).decode())
    floats = {id(v): v for v in w._reqs_to_send.values()}  # heartbeats share float objects
    out["upstream"] = float(
        sys.getsizeof(w._reqs_to_send)
        + sys.getsizeof(w._reqs_to_process)
        + sum(sys.getsizeof(v) for v in floats.values())
    )
    return out


# -- hostile ids and bursts: ratios against a friendly baseline ---------------
def _hostile_sets(n: int) -> list[tuple[list[str], list[str]]]:
    """(crafted, look-alike random) id lists: MurmurHash64A collisions aimed at
    the old fixed seed (ASCII) and seed-independent ones (non-ASCII UTF-8)."""
    from tools import hostile_ids

    sets = []
    for crafted in (hostile_ids.fixed_seed_ids(n), hostile_ids.seed_free_ids(n)):
        sets.append((crafted, hostile_ids.lookalike_ids(crafted)))
    return sets


def _grant_ns(impl: str, ids: list[str]) -> float:
    if impl == "upstream":
        return median_ns(lambda: fill_upstream(ids, [1e6] * len(ids)), 3) / len(ids)
    return median_ns(lambda: fill_ours(impl, ids, [1e6] * len(ids)), 3) / len(ids)


def _heartbeat_ns(impl: str, ids: list[str]) -> float:
    n = len(ids)
    payload = heartbeat_message(ids[:: max(1, n // 1000)][:1000])
    per = payload.count(b",") + 1
    if impl == "upstream":
        w = fill_upstream(ids, [1e6] * n)

        def up():
            w.nixl_wrapper.inbox = {"d": [payload]}
            w._get_new_notifs()

        with mock.patch("time.perf_counter", return_value=5.0):
            return per_call_ns(up, 20, 5) / per
    router = fill_ours(impl, ids, [1e6] * n)
    return per_call_ns(lambda: router.route({"d": [payload]}, 5.0), 100, 5) / per


def _hostile(n: int, measure) -> dict[str, float]:
    """Worst crafted-id time per op, and the worst crafted/random ratio."""
    out: dict[str, float] = {}
    for impl in ("cython", "python", "upstream"):
        worst = ratio = 0.0
        for crafted, lookalike in _hostile_sets(n):
            bad, good = measure(impl, crafted), measure(impl, lookalike)
            worst, ratio = max(worst, bad), max(ratio, bad / good)
        out[impl] = worst
        out[f"{impl}_ratio"] = ratio
    return out


def hostile_grant(n: int, quick: bool) -> dict[str, float]:
    return _hostile(n, _grant_ns)


def hostile_heartbeat(n: int, quick: bool) -> dict[str, float]:
    return _hostile(n, _heartbeat_ns)


def after_burst(n: int, quick: bool) -> dict[str, float]:
    """n leases granted, all but 100 expire in one sweep; then grant+release
    of one lease, against a fresh table holding the same 100 (ratio), and the
    table's bytes against that fresh table's."""
    keep = req_ids(100, "keep")
    burst = req_ids(n, "burst")
    out: dict[str, float] = {}
    for impl in ("cython", "python", "upstream"):
        tables = {}
        for kind in ("burst", "fresh"):
            if impl == "upstream":
                w = fill_upstream(keep, [1e9] * 100)
                if kind == "burst":
                    w._reqs_to_send.update((r, 1.0) for r in burst)
                    w._reqs_to_process.update(burst)
                    with mock.patch("time.perf_counter", return_value=2.0):
                        w._reap_expired_send_leases(set())
                    w._reqs_to_process.difference_update(burst)
                d = w._reqs_to_send

                def op(d=d):
                    d["x"] = 1e9
                    del d["x"]

                tables[kind] = (op, sys.getsizeof(d))
                continue
            router = fill_ours(impl, keep, [1e9] * 100)
            if kind == "burst":
                for rid in burst:
                    router.add_in_batch(rid)
                    router.grant(rid, 1.0)
                router.expire(2.0)
            t = router.table

            def op(t=t):
                t.grant("x", 1e9)
                t.release("x")

            tables[kind] = (op, t.nbytes())
        times = {kind: per_call_ns(op, 20000, 7) for kind, (op, _) in tables.items()}
        out[impl] = times["burst"]
        out[f"{impl}_ratio"] = times["burst"] / times["fresh"]
        out[f"{impl}_mem_ratio"] = tables["burst"][1] / tables["fresh"][1]
    return out


SCENARIOS = [
    # key, label, function, size (quick size), target speed-up of cython over upstream, min cython/twin
    ("sweep_idle_100k", "sweep, 100k leases, nothing due", sweep_idle, 100_000, 20_000, 5000, None),
    ("sweep_idle_1m", "sweep, 1M leases, nothing due", sweep_idle, 1_000_000, None, 50000, None),
    ("sweep_churn", "sweep, 100k leases, 1% renewed + 1% due/step", sweep_churn, 100_000, 20_000, 50, None),
    ("heartbeat", "heartbeat of 1k ids vs 100k leases", heartbeat, 100_000, 20_000, 8, 2),
    # per-id rows: the target is Cython's ns per heartbeat id (keyed hash included)
    ("hb_id_contig", "heartbeat id: 1k contiguous, 100k leases", heartbeat_contig, 100_000, 20_000, 30, None),
    ("hb_id_spread", "heartbeat id: 1k spread over 100k leases", heartbeat_spread, 100_000, 20_000, 40, None),
    ("mixed_batch", "1k completions + 10 HB x 1k ids, one batch", mixed_batch, 100_000, 20_000, 8, 2),
    ("d_build", "D: messages for 10k ids / 8 engines (tick)", d_build, 10_000, 10_000, 5, None),
    ("d_pickle", "D: pickle round trip of HB metadata, 10k ids", d_pickle, 10_000, 10_000, 20, None),
    ("mass_expiry", "mass expiry: 1k of 10k due, logging incl.", mass_expiry, 10_000, 10_000, 20, None),
    ("memory", "memory: 1M leases after 10M extensions (bytes)", memory, 1_000_000, 100_000, None, None),
    # ratio rows: the target is on crafted/random (hostile) or drained/fresh (burst), Cython and twin
    ("hostile_grant", "hostile ids: grant, 100k leases (vs random)", hostile_grant, 100_000, 20_000, 2, None),
    ("hostile_hb", "hostile ids: heartbeat id, 100k leases", hostile_heartbeat, 100_000, 20_000, 2, None),
    ("after_burst", "1M burst drained to 100: grant+release", after_burst, 1_000_000, 100_000, 2, None),
]
RATIO_ROWS = ("hostile_grant", "hostile_hb", "after_burst")
NS_ROWS = ("hb_id_contig", "hb_id_spread")  # target: at most this many ns (Cython)


def fmt_time(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def fmt_bytes(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def run_scenario(entry: tuple, quick: bool) -> dict:
    key, label, fn, size, quick_size, target, twin_target = entry
    n = quick_size if quick else size
    res = fn(n, quick)
    is_mem = key == "memory"
    speedup = res["upstream"] / res["cython"]
    row = {
        "scenario": key,
        "label": label if not quick else f"{label} [n={n}]",
        "cython": res["cython"],
        "python": res["python"],
        "upstream": res["upstream"],
        "unit": "bytes" if is_mem else "ns",
        "speedup_vs_upstream": speedup,
        "cython_vs_twin": res["python"] / res["cython"],
        "target": target,
        "twin_target": twin_target,
    }
    if key in RATIO_ROWS:
        ratios = [res["cython_ratio"], res["python_ratio"]]
        ratios += [res[k] for k in ("cython_mem_ratio", "python_mem_ratio") if k in res]
        row.update({k: v for k, v in res.items() if k.endswith("ratio")})
        row["ok"] = max(ratios) <= target
    elif is_mem:
        row["ok"] = res["cython"] <= res["upstream"]
    elif key in NS_ROWS:
        row["ok"] = res["cython"] <= target
    else:
        row["ok"] = (target is None or speedup >= target) and (
            twin_target is None or row["cython_vs_twin"] >= twin_target
        )
    return row


def run_isolated(entry: tuple, quick: bool) -> dict:
    """One scenario in a fresh interpreter, so that the heap left by another
    scenario (fragmented arenas, scattered ids) does not bias this one.  The
    child's output (vLLM's and torch's import warnings) is kept out of the
    table and shown only if the child fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "tools.bench_core", "--only", entry[0], "--row-json", out]
        cmd += ["--quick"] if quick else []
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        if proc.returncode:
            sys.stderr.write(proc.stdout)
            raise SystemExit(f"bench_core: scenario {entry[0]} failed (exit {proc.returncode})")
        with open(out) as fh:
            return json.load(fh)


def cache_miss_floor(loads: int = 1 << 20) -> dict[str, float]:
    """The physical floor of a heartbeat lookup: ns per random 64-byte load,
    independent loads (a numpy gather, so misses overlap as a heartbeat's ids
    can), from a working set the size of a 100k-lease table with its ids
    (16 MiB) and from DRAM (512 MiB).  Beside it, the Cython table's cost per
    heartbeat id with no cache miss at all (parse + keyed hash, empty table)."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    for name, size in (("16MiB", 16 << 20), ("512MiB", 512 << 20)):
        mem = np.ones(size // 8, dtype=np.int64)  # written: no page faults while timing
        idx = rng.integers(0, size // 64, size=loads) * 8
        out[f"load_{name}"] = median_ns(lambda mem=mem, idx=idx: mem.take(idx), 7) / loads
    LeaseTable, _, _ = load_impl("cython")
    ids = req_ids(1000, "nomatch")
    payload = ",".join(ids).encode()
    empty = LeaseTable(EXTENSION)
    out["hash_parse"] = per_call_ns(lambda: empty.extend(payload, 1.0), 200, 7) / len(ids)
    return out


HEAD = (
    f"| {'scenario':<70} | {'ours (Cython)':>13} | {'ours (twin)':>11} | {'upstream':>10} "
    f"| {'speed-up':>10} | {'Cy/twin':>7} | {'target':>9} | ok |"
)


def format_row(r: dict) -> str:
    fmt = fmt_bytes if r["unit"] == "bytes" else fmt_time
    if r["scenario"] in RATIO_ROWS:
        # speed-up column: Cython's ratio (crafted/random or drained/fresh); twin's in the label
        extra = f"twin x{r['python_ratio']:.2f}"
        if "cython_mem_ratio" in r:
            extra += f"; bytes x{r['cython_mem_ratio']:.2f}/{r['python_mem_ratio']:.2f}"
        label = f"{r['label']} [{extra}]"
        tgt = f"<= {r['target']}x"
        sp = f"x{r['cython_ratio']:.2f}"
    elif r["scenario"] in NS_ROWS:
        label, tgt = r["label"], f"<= {r['target']} ns"
        sp = f"{r['speedup_vs_upstream']:,.1f}x"
    elif r["unit"] == "bytes":
        label, tgt = r["label"], "<= upstr."
        sp = f"{r['speedup_vs_upstream']:.2f}x less" if r["speedup_vs_upstream"] >= 1 else "more"
    else:
        label = r["label"]
        tgt = f">= {r['target']:,}x" if r["target"] else "-"
        sp = f"{r['speedup_vs_upstream']:,.1f}x"
    return (
        f"| {label:<70} | {fmt(r['cython']):>13} | {fmt(r['python']):>11} | "
        f"{fmt(r['upstream']):>10} | {sp:>10} | {r['cython_vs_twin']:>6.1f}x | {tgt:>9} | "
        f"{'yes' if r['ok'] else 'NO':<2} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (demo); targets are for full size")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--only", nargs="*", help="scenario keys to run")
    ap.add_argument("--in-process", action="store_true", help="run all scenarios in this interpreter")
    ap.add_argument("--row-json", help=argparse.SUPPRESS)  # child mode of run_isolated
    args = ap.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    entries = [e for e in SCENARIOS if not args.only or e[0] in args.only]
    entries = [e for e in entries if not (args.quick and e[4] is None)]
    in_process = args.in_process or args.row_json
    if in_process:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            import vllm  # noqa: F401  (import once, outside the timings and the table)

    if args.row_json:
        with open(args.row_json, "w") as fh:
            json.dump(run_scenario(entries[0], args.quick), fh)
        return 0

    # Each row is printed once, as soon as it is measured.
    print(HEAD, flush=True)
    print("|" + "|".join("-" * (len(c)) for c in HEAD.split("|")[1:-1]) + "|", flush=True)
    rows = []
    for entry in entries:
        row = run_scenario(entry, args.quick) if in_process else run_isolated(entry, args.quick)
        rows.append(row)
        print(format_row(row), flush=True)
    if not args.only:
        floor = cache_miss_floor()
        print(
            f"\nfloor per heartbeat id: one random load {floor['load_16MiB']:.1f} ns (16 MiB set), "
            f"{floor['load_512MiB']:.1f} ns (512 MiB); parse + keyed hash alone {floor['hash_parse']:.1f} ns",
            flush=True,
        )
    if args.quick:
        print("\n(--quick: smaller sizes; the targets are defined for the full sizes of `make bench`)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"quick": args.quick, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
