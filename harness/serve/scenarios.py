"""The P/D stories shared by the e2e tests and the demo. Timings come from P's log and metrics.

"D is slow" is made deterministic instead of depending on the machine's speed: D runs with
`--max-num-seqs 1` and a `client.Blocker` (one long streamed request sent straight to D) occupies
its only slot. Requests routed meanwhile are prefilled on P, whose KV then waits under a lease
while they queue on D; D heartbeats them. Releasing the blocker (the client disconnects, D aborts
it) lets D read and serve them; killing D instead leaves P to reclaim them.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from harness.procs import busiest
from harness.serve import client, plog
from harness.serve.launcher import PDCluster
from vllm_nixl_lease._wire import default_heartbeat_interval, default_lease_extension

EXPIRED = "vllm:nixl_num_kv_expired_reqs"
TAGGED_HEARTBEATS = "vllm:nixl_lease_tagged_heartbeats_received"  # P (ours)
NOTIF_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry"
XFER_TIME_COUNT = "vllm:nixl_xfer_time_seconds_count"  # one sample per finished NIXL read on D
LEASE_ACTIVE = "vllm:nixl_lease_active"  # ours only

# One, two and four KV blocks of 32 tokens (a one-token prompt gives D nothing to read and leaves
# an unread lease on P).
PROMPTS = [
    "Hello, how are you today? I am fine, thank you very much. "
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text too.",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Heartbeats renew the lease while the request waits in the decode queue. " * 8,
]
BLOCKER_PROMPT = "Once upon a time there was a small model with random weights."


def burst_prompts(n: int, tag: str) -> list[str]:
    # Distinct (no prefix sharing: each request its own lease) and longer than one block.
    return [
        f"{tag} {i}: " + "The router sends each request to prefill first and then to decode. " * 2
        for i in range(n)
    ]


def p_alone_references(pd: PDCluster, prompts: list[str], max_tokens: int) -> list[str]:
    """What P alone answers (greedy) to each prompt: the text a routed request must match."""
    references = []
    for prompt in prompts:
        alone = client.complete(pd.p_url, prompt, max_tokens, timeout=60)
        if not alone.ok:
            raise AssertionError(f"P alone failed: {alone.error}")
        references.append(alone.text)
    return references


def lease_extension(lease_s: int) -> int:
    return int(default_lease_extension(lease_s))


def lease_interval(lease_s: int) -> int:
    return int(default_heartbeat_interval(lease_s))  # D's heartbeat period


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
    # D counts a read when its step reports it; give the metric a moment.
    deadline = time.time() + 5
    while (n := client.metric(pd.d_url, XFER_TIME_COUNT) - before) < len(pairs) and time.time() < deadline:
        time.sleep(0.3)
    return Equality(pairs, n)


class Burst:
    """`n` concurrent routed requests in background threads, each with its own hard timeout."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, timeout: float) -> None:
        self.t_start = time.time()
        self._ex = ThreadPoolExecutor(max_workers=len(prompts))
        self.futures: list[Future[client.Result]] = [
            self._ex.submit(client.complete, url, p, max_tokens, timeout) for p in prompts
        ]
        self._timeout = timeout
        self.t_queued = self.t_start  # set by queue_behind()

    def results(self) -> list[client.Result]:
        out = [f.result(timeout=self._timeout + 10) for f in self.futures]
        self._ex.shutdown(wait=False)
        return out

    def settle(self, timeout: float) -> int:
        """Wait at most `timeout` for every request to end (served or failed); how many still run."""
        _, running = wait(self.futures, timeout=timeout)
        self._ex.shutdown(wait=False)
        return len(running)


def block_decode(
    pd: PDCluster, max_s: float, start_timeout: float = 60.0, hold_s: float = 120.0
) -> client.BlockerChain:
    """Occupy D's single slot with long streamed requests queued one behind the other, enough of
    them to hold D for `hold_s` at the speed D decodes the first one (a quiet core decoded one
    blocker in 17 s, another machine two in 11 s); released by the caller or by D's death."""
    max_tokens = pd.cfg.max_model_len - 64
    first = client.Blocker(pd.d_url, BLOCKER_PROMPT, max_tokens, max_s)
    blockers = client.BlockerChain([first])
    if not first.wait_started(start_timeout):
        blockers.release()
        raise AssertionError(f"D did not start the blocker request in {start_timeout}s: {first.error}")
    chain = blocker_chain_length(first, max_tokens, hold_s)
    for _ in range(chain - 1):
        blockers.blockers.append(client.Blocker(pd.d_url, BLOCKER_PROMPT, max_tokens, max_s))
    deadline = time.time() + 30
    while time.time() < deadline:  # the queued ones reach D's queue before anything is routed
        text = client.metrics_text(pd.d_url, timeout=5.0)
        if text and client.metric_sum(text, "vllm:num_requests_waiting") >= chain - 1:
            return blockers
        time.sleep(0.1)
    blockers.release()
    raise AssertionError(f"D did not queue the {chain - 1} blocker(s) behind the first in 30 s")


def blocker_chain_length(first: client.Blocker, max_tokens: int, hold_s: float, sample_s: float = 1.0) -> int:
    """Blockers needed to hold D for `hold_s`: D's decode rate, sampled on the running `first`
    over `sample_s`, times the hold, in blockers of `max_tokens` each (2 to 32: queued ones cost D
    nothing until they run, and release() drops them unrun)."""
    tokens0, t0 = first.tokens, time.time()
    time.sleep(sample_s)
    rate = (first.tokens - tokens0) / max(1e-3, time.time() - t0)
    return max(2, min(32, 1 + math.ceil(hold_s * rate / max_tokens)))


class QueueStalled(AssertionError):
    """The set-up stage stalled: the routed requests did not all reach D's queue behind the blocker."""

    def __init__(self, message: str, burst: Burst) -> None:
        super().__init__(message)
        self.burst = burst


def block_and_queue(
    pd: PDCluster, n: int, tag: str, max_tokens: int, timeout: float, max_s: float, attempts: int = 2
) -> tuple[client.BlockerChain, Burst]:
    """Block D (`block_decode`) and queue `n` routed requests behind it (`queue_behind`).

    A stalled set-up is tried again once, with a warning that carries where the requests stood. It
    stalled once in CI: the routed requests had not reached D's queue 37 s after they were sent,
    cause unknown. Callers read their counters (expiries, fenced reads) before this call, so
    whatever the first try's requests did on P or D still counts in what they assert.
    The caller releases the blocker."""
    for attempt in range(1, attempts + 1):
        blocker = block_decode(pd, max_s)
        try:
            return blocker, queue_behind(pd, n, tag, max_tokens, timeout, blocker)
        except QueueStalled as stalled:
            blocker.release()
            if attempt == attempts:
                raise
            still = stalled.burst.settle(60.0)  # served or failed before the next try
            warnings.warn(
                f"set-up try {attempt} stalled ({still} requests still running): {stalled}", stacklevel=2
            )
    raise AssertionError("unreachable: attempts < 1")


def queue_behind(
    pd: PDCluster, n: int, tag: str, max_tokens: int, timeout: float, blocker: client.BlockerChain
) -> Burst:
    """Route `n` requests while `blocker` holds D; return once D's own gauge shows them all waiting
    (`burst.t_queued`): from then on each of them waits on D while P holds its lease."""
    before = where_requests_are(pd)
    burst = Burst(pd.r_url, burst_prompts(n, tag), max_tokens, timeout)
    deadline = time.time() + 60
    waiting, failed_scrapes = 0.0, 0
    while time.time() < deadline:
        text = client.metrics_text(pd.d_url, timeout=5.0)
        if not text:
            failed_scrapes += 1  # "no answer" is not "0 waiting": counted and shown on failure
        else:
            waiting = client.metric_sum(text, "vllm:num_requests_waiting") - blocker.queued
            if waiting >= n:
                burst.t_queued = time.time()
                return burst
        if blocker.finished_early or blocker.error or any(f.done() for f in burst.futures):
            break
        time.sleep(0.2)
    done = [f.result() for f in burst.futures if f.done()]
    raise QueueStalled(
        f"{n} routed requests did not all queue on D in {time.time() - burst.t_start:.0f}s (waiting "
        f"{waiting:.0f}, {failed_scrapes} failed scrapes of D's metrics; blocker: {blocker.tokens} "
        f"tokens, finished early {blocker.finished_early}, error {blocker.error!r}; done early: {done})"
        f"\nwhere they are, before -> now: {before} -> {where_requests_are(pd)}"
        f"\nbusiest processes:\n{busiest()}\nrouter log:\n{pd.router.log_tail(8) if pd.router else '-'}",
        burst,
    )


# Counters that follow a routed request: P's prefill, the router's hand-over, D's queue.
_WHERE = {
    "P": ("p_url", ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_success"]),
    "D": ("d_url", ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_success"]),
    "router": ("r_prom_url", ["vllm_router_pd_prefill_requests", "vllm_router_pd_decode_requests",
                              "vllm_router_pd_errors", "vllm_router_worker_health"]),
}  # fmt: skip


def where_requests_are(pd: PDCluster) -> dict[str, dict[str, float] | str]:
    """One scrape of P, D and the router: where requests stand when a set-up stage stalls."""
    out: dict[str, dict[str, float] | str] = {}
    for who, (attr, names) in _WHERE.items():
        text = client.metrics_text(getattr(pd, attr), timeout=3.0)
        short = {name.rsplit(":", 1)[-1].removeprefix("vllm_router_"): name for name in names}
        out[who] = {k: client.metric_sum(text, v) for k, v in short.items()} if text else "no answer"
    return out


@dataclass
class Overload:
    results: list[client.Result]
    held_s: float  # how long D was blocked after the burst was sent
    wall_s: float
    expired: float  # lease expiries counted on P during the run (must be 0)
    notifs_after_expiry: float
    heartbeats: int  # P log lines where a heartbeat extended >= 1 lease
    max_hb_gap_s: float  # longest pause between those lines while the requests were queued
    min_latency_s: float
    tagged_heartbeats: float  # P's LHBT: messages during the run (ours on both sides; else 0)


def overload(pd: PDCluster, n: int, hold_s: float, max_tokens: int = 16, timeout: float = 120.0) -> Overload:
    """Block D until `n` routed requests have all waited `hold_s` in its queue; all must complete."""
    assert pd.prefill is not None
    exp0 = client.metric(pd.p_url, EXPIRED)
    nae0 = client.metric(pd.p_url, NOTIF_AFTER_EXPIRY)
    tagged0 = client.metric(pd.p_url, TAGGED_HEARTBEATS)
    blocker, burst = block_and_queue(pd, n, "overload", max_tokens, timeout, max_s=hold_s + 60)
    try:
        time.sleep(max(0.0, burst.t_queued + hold_s - time.time()))
    finally:
        blocker.release()
    t_release = time.time()
    if blocker.finished_early or blocker.error:
        raise AssertionError(
            f"D finished or lost the blocker before the hold ended: {blocker.error or 'done'}"
        )
    results = burst.results()
    t_end = time.time()
    ev = plog.parse(pd.prefill.log_path)
    hbs = ev.heartbeats_between(burst.t_start, t_release)
    gaps = [b - a for a, b in zip([burst.t_start, *hbs], [*hbs, t_release], strict=True)]
    return Overload(
        results=results,
        held_s=t_release - burst.t_queued,
        wall_s=t_end - burst.t_start,
        expired=client.metric(pd.p_url, EXPIRED) - exp0,
        notifs_after_expiry=client.metric(pd.p_url, NOTIF_AFTER_EXPIRY) - nae0,
        heartbeats=len(hbs),
        max_hb_gap_s=max(gaps),
        min_latency_s=min((r.elapsed for r in results), default=0.0),
        tagged_heartbeats=client.metric(pd.p_url, TAGGED_HEARTBEATS) - tagged0,
    )


@dataclass
class Reclaim:
    n_queued: int
    kill_ts: float
    last_hb_ts: float | None
    expiries: list[tuple[float, str]]
    expired_metric: float  # P's expiry counter delta (metrics, not logs)
    leases_at_kill: float | None  # P's lease gauge just before the kill (ours only)
    notifs_after_expiry_before_kill: float
    results: list[client.Result]
    p_healthy_after: bool
    restart_s: float
    extension_s: int
    after_restart: Equality | None = None
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (wall, P active leases)

    @property
    def reclaim_after_last_hb_s(self) -> float | None:
        if not self.expiries or self.last_hb_ts is None:
            return None
        return round(max(t for t, _ in self.expiries) - self.last_hb_ts, 3)

    @property
    def reclaim_after_kill_s(self) -> float | None:
        return round(max(t for t, _ in self.expiries) - self.kill_ts, 3) if self.expiries else None


def _poll_active(url: str, out: list[tuple[float, float]], stop: threading.Event, every: float) -> None:
    while not stop.is_set():
        text = client.metrics_text(url, timeout=3.0)
        if text:
            out.append((time.time(), client.metric_sum(text, LEASE_ACTIVE)))
        stop.wait(every)


def wait_reclaim(pd: PDCluster, exp0: float, n: int, kill_ts: float, window_s: float) -> float:
    """Until P's expiry counter has grown by `n` and the log shows them, or `window_s` after the kill."""
    assert pd.prefill is not None
    expired = 0.0
    while time.time() < kill_ts + window_s:
        expired = client.metric(pd.p_url, EXPIRED, timeout=3.0) - exp0
        if expired >= n and len(plog.parse(pd.prefill.log_path).expiries_after(kill_ts - 1)) >= expired:
            break
        time.sleep(0.5)
    return client.metric(pd.p_url, EXPIRED, timeout=3.0) - exp0


def kill_and_reclaim(
    pd: PDCluster,
    n: int,
    settle_s: float,
    reclaim_window_s: float,
    restart_connector: str | None = None,
    restart: bool = True,
    timeout: float = 120.0,
) -> Reclaim:
    """Queue `n` requests behind a blocked D, `kill -9` D's tree `settle_s` later, wait for P to
    reclaim (at most `reclaim_window_s` after the kill), then start a new D and serve through it."""
    assert pd.prefill is not None
    ext = lease_extension(pd.cfg.lease_s)
    exp0 = client.metric(pd.p_url, EXPIRED)
    nae0 = client.metric(pd.p_url, NOTIF_AFTER_EXPIRY)
    timeline: list[tuple[float, float]] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll_active, args=(pd.p_url, timeline, stop, 0.5), daemon=True)
    poller.start()
    blocker, burst = block_and_queue(pd, n, "reclaim", 16, timeout, max_s=settle_s + 120)
    try:
        time.sleep(max(0.0, burst.t_queued + settle_s - time.time()))
        if blocker.finished_early:
            raise AssertionError("D finished the blocker before the kill: the queued requests were served")
        p_text = client.metrics_text(pd.p_url, timeout=3.0)
        leases = client.metric_sum(p_text, LEASE_ACTIVE) if LEASE_ACTIVE in p_text else None
        nae_before = client.metric_sum(p_text, NOTIF_AFTER_EXPIRY) - nae0
        kill_ts = pd.kill_decode()
        results = burst.results()  # in-flight requests must fail fast, not hang
        t0 = time.time()
        if restart:  # start-up (a minute, on D's own core) overlaps P's reclaim wait
            pd.start_decode(restart_connector)
        expired = wait_reclaim(pd, exp0, n, kill_ts, reclaim_window_s)
        ev = plog.parse(pd.prefill.log_path)
        p_ok = client.healthy(pd.p_url)
        after, restart_s = None, 0.0
        if restart:
            pd.wait_decode()
            restart_s = time.time() - t0
            pd.wait_router_sees_decode(timeout=60)
            after = equality(pd)
    finally:
        blocker.release()
        stop.set()
        poller.join(timeout=5)
    return Reclaim(
        n_queued=n,
        kill_ts=kill_ts,
        last_hb_ts=ev.last_heartbeat_of_killed(kill_ts),
        expiries=ev.expiries_after(kill_ts - 1),
        expired_metric=expired,
        leases_at_kill=leases,
        notifs_after_expiry_before_kill=nae_before,
        results=results,
        p_healthy_after=p_ok,
        restart_s=restart_s,
        extension_s=ext,
        after_restart=after,
        timeline=timeline,
    )
