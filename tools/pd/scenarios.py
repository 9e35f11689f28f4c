"""The P/D stories shared by the e2e tests and the demo. Timings come from P's log and metrics."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tools.pd import client, plog
from tools.pd.launcher import PDCluster

EXPIRED = "vllm:nixl_num_kv_expired_reqs"
NOTIF_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry"
XFER_TIME_COUNT = "vllm:nixl_xfer_time_seconds_count"  # one sample per finished NIXL read on D

PROMPTS = [
    "Hello",  # well under one block
    "The quick brown fox jumps over the lazy dog. " * 4,  # ~2 blocks of 32
    "Heartbeats renew the lease while the request waits in the decode queue. " * 8,  # several blocks
]


def burst_prompts(n: int, tag: str) -> list[str]:
    # Distinct prompts: no prefix sharing, each request its own lease.
    return [f"{tag} {i}: the router sends each request to prefill first." for i in range(n)]


def lease_extension(lease_s: int) -> int:
    return lease_s * 2 // 3  # upstream's integer arithmetic


@dataclass
class Equality:
    pairs: list[tuple[str, str]]  # (P alone, router -> P -> D)
    transfers: float  # NIXL reads counted on D during the run

    @property
    def equal(self) -> bool:
        return all(a == b for a, b in self.pairs)


def equality(pd: PDCluster, max_tokens: int = 24, timeout: float = 60.0) -> Equality:
    before = client.metric(pd.d_url, XFER_TIME_COUNT)
    pairs = []
    for prompt in PROMPTS:
        alone = client.complete(pd.p_url, prompt, max_tokens, timeout=timeout)
        routed = client.complete(pd.r_url, prompt, max_tokens, timeout=timeout)
        if not (alone.ok and routed.ok):
            raise AssertionError(f"request failed: P alone {alone.error!r}, routed {routed.error!r}")
        pairs.append((alone.text, routed.text))
    return Equality(pairs, client.metric(pd.d_url, XFER_TIME_COUNT) - before)


class Burst:
    """`n` concurrent routed requests in background threads, each with its own hard timeout."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, timeout: float) -> None:
        self.t_start = time.time()
        self._ex = ThreadPoolExecutor(max_workers=len(prompts))
        self.futures: list[Future[client.Result]] = [
            self._ex.submit(client.complete, url, p, max_tokens, timeout) for p in prompts
        ]
        self._timeout = timeout

    def results(self) -> list[client.Result]:
        out = [f.result(timeout=self._timeout + 10) for f in self.futures]
        self._ex.shutdown(wait=False)
        return out


@dataclass
class Overload:
    results: list[client.Result]
    wall_s: float
    expired: float  # lease expiries counted on P during the run (must be 0)
    notifs_after_expiry: float
    heartbeats: int  # P log lines where a heartbeat extended >= 1 lease
    max_latency_s: float


def overload(pd: PDCluster, n: int, max_tokens: int, timeout: float = 120.0) -> Overload:
    """Queue `n` long requests on a capped D for longer than the lease; all must complete."""
    exp0 = client.metric(pd.p_url, EXPIRED)
    burst = Burst(pd.r_url, burst_prompts(n, "overload"), max_tokens, timeout)
    results = burst.results()
    t_end = time.time()
    ev = plog.parse(pd.prefill.log_path)  # type: ignore[union-attr]
    return Overload(
        results=results,
        wall_s=t_end - burst.t_start,
        expired=client.metric(pd.p_url, EXPIRED) - exp0,
        notifs_after_expiry=client.metric(pd.p_url, NOTIF_AFTER_EXPIRY),
        heartbeats=len(ev.heartbeats_between(burst.t_start, t_end)),
        max_latency_s=max((r.elapsed for r in results), default=0.0),
    )


@dataclass
class Reclaim:
    kill_ts: float
    last_hb_ts: float | None
    expiries: list[tuple[float, str]]
    expired_metric: float  # P's expiry counter delta (metrics, not logs)
    notifs_after_expiry_before_kill: float
    results: list[client.Result]
    p_healthy_after: bool
    served_after_restart: bool
    restart_s: float
    extension_s: int
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (wall, P active leases)

    @property
    def reclaim_after_last_hb_s(self) -> float | None:
        if not self.expiries or self.last_hb_ts is None:
            return None
        return max(t for t, _ in self.expiries) - self.last_hb_ts

    @property
    def reclaim_after_kill_s(self) -> float | None:
        return max(t for t, _ in self.expiries) - self.kill_ts if self.expiries else None


def _poll_active(url: str, out: list[tuple[float, float]], stop: threading.Event, every: float) -> None:
    while not stop.is_set():
        text = client.metrics_text(url, timeout=3.0)
        if text:
            out.append((time.time(), client.metric_sum(text, "vllm:nixl_lease_active")))
        stop.wait(every)


def wait_queued_on_d(pd: PDCluster, burst: Burst, settle_s: float, min_waiting: int = 2) -> float:
    """Sleep until `settle_s` after the burst, then until D reports >= `min_waiting` queued requests.

    Kill timing must not depend on the machine's speed: D's own gauge says requests are queued.
    """
    time.sleep(max(0.0, burst.t_start + settle_s - time.time()))
    deadline = time.time() + 60
    waiting = 0.0
    while time.time() < deadline and not all(f.done() for f in burst.futures):
        waiting = client.metric(pd.d_url, "vllm:num_requests_waiting", timeout=3.0)
        # D may already have fetched a queued request's KV; where P exports its lease gauge
        # (ours), also require unread leases on P. Stock has no such gauge.
        p_text = client.metrics_text(pd.p_url, timeout=3.0)
        leased_ok = (
            "vllm:nixl_lease_active" not in p_text or client.metric_sum(p_text, "vllm:nixl_lease_active") >= 1
        )
        if waiting >= min_waiting and leased_ok:
            return waiting
        time.sleep(0.3)
    raise AssertionError(f"D never had {min_waiting} queued requests (last {waiting}): load too small")


def kill_and_reclaim(
    pd: PDCluster, n: int, max_tokens: int, settle_s: float, timeout: float = 120.0, restart: bool = True
) -> Reclaim:
    """Queue `n` requests on D, `kill -9` D's tree after `settle_s`, wait for P to reclaim, restart D."""
    assert pd.prefill is not None
    ext = lease_extension(pd.cfg.lease_s)
    exp0 = client.metric(pd.p_url, EXPIRED)
    timeline: list[tuple[float, float]] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll_active, args=(pd.p_url, timeline, stop, 0.5), daemon=True)
    poller.start()
    try:
        burst = Burst(pd.r_url, burst_prompts(n, "reclaim"), max_tokens, timeout)
        wait_queued_on_d(pd, burst, settle_s)
        notifs_before = client.metric(pd.p_url, NOTIF_AFTER_EXPIRY)
        kill_ts = pd.kill_decode()
        results = burst.results()  # in-flight requests must fail fast, not hang
        # P reclaims at last heartbeat + extension; wait for that plus slack, bounded.
        deadline = time.time() + ext + 20
        expired = 0.0
        while time.time() < deadline:
            expired = client.metric(pd.p_url, EXPIRED, timeout=3.0) - exp0
            ev = plog.parse(pd.prefill.log_path)
            if expired > 0 and len(ev.expiries_after(kill_ts - 1)) >= expired and time.time() > kill_ts + ext:
                break
            time.sleep(0.5)
        time.sleep(1.0)  # one more metrics/log flush
        expired = client.metric(pd.p_url, EXPIRED, timeout=3.0) - exp0
        ev = plog.parse(pd.prefill.log_path)
        p_ok = client.healthy(pd.p_url)
        served, restart_s = False, 0.0
        if restart:
            t0 = time.time()
            pd.restart_decode()
            restart_s = time.time() - t0
            pd.wait_router_sees_decode(timeout=60)
            served = client.complete(pd.r_url, PROMPTS[1], 8, timeout=60).ok
    finally:
        stop.set()
        poller.join(timeout=5)
    return Reclaim(
        kill_ts=kill_ts,
        last_hb_ts=ev.last_heartbeat_before(kill_ts),
        expiries=ev.expiries_after(kill_ts - 1),
        expired_metric=expired,
        notifs_after_expiry_before_kill=notifs_before,
        results=results,
        p_healthy_after=p_ok,
        served_after_restart=served,
        restart_s=restart_s,
        extension_s=ext,
        timeline=timeline,
    )


@dataclass
class Load:
    """Burst sizing from a measured decode speed, so D's queue outlives the lease on any machine."""

    max_tokens: int
    n: int
    s_per_token: float


# Long outputs keep D's few KV blocks busy; with short ones D fetched the KV of its queued
# requests early (freeing P's leases) and nothing was left to renew or reclaim.
def size_load(
    pd: PDCluster,
    queue_s: float,
    per_request_s: float = 4.0,
    max_tokens_cap: int = 440,
    min_tokens: int = 300,
) -> Load:
    probe = 48
    r = client.complete(pd.p_url, "calibrate", probe, timeout=120)
    if not r.ok:
        raise AssertionError(f"calibration request failed: {r.error}")
    spt = max(r.elapsed / probe, 1e-3)
    max_tokens = int(min(max_tokens_cap, max(min_tokens, per_request_s / spt)))
    n = int(min(40, max(5, queue_s / (max_tokens * spt) + 2)))
    return Load(max_tokens=max_tokens, n=n, s_per_token=spt)
