"""What heartbeat bookkeeping costs D per engine step, with many requests
waiting on many P engines: ours against upstream, in one run.

D tracks ``--waiting`` requests (default 100k) spread over ``--engines`` P
engines (default 8).  Steps advance a virtual clock by ``--step-ms`` (20 ms);
each step ``--churn`` requests arrive and as many depart (their transfer
finished), so the queue stays full.  One step's heartbeat bookkeeping, timed
as a whole with the real vLLM 0.33 classes:

- scheduler: ``on_new_request`` for the arrivals, ``_stop_heartbeat`` for the
  departures, ``build_connector_meta``;
- handoff: the metadata pickled and unpickled (what the multiprocess executor
  does to ship it to the workers);
- worker: our ``ReadFence.add_views``/``HeartbeatSender.send``/``drop_views``
  (what our ``start_load_kv`` runs before and after upstream's reads) or
  upstream's ``_send_heartbeats``, then ``_get_new_notifs`` (which for ours
  takes P's acknowledgements and renews the read fence's views).

NIXL is a fake wrapper that records sends (``harness.upstream_fake``); against
an acknowledging P, the bench answers every ``LHB:`` the way our P does
(``LACK:<seqs>``) at the start of D's next step.  Add ~20-70 us per real
``send_notif`` (bench_acks measured it); the number of sends per step is
printed.

Cases: ours against a P that acknowledges heartbeats (``LHB``/``LACK``), ours
against a stock P (``HB``, no lease views), upstream against a stock P.  The
first ``--warmup`` intervals after the queue filled at once are not counted
(they hold the one-off burst of every new chunk's first heartbeat, for ours
and upstream alike); their max is printed apart.  The cyclic GC is off while
timing (a collection walks the whole heap, whichever step triggers it).
Times are this thread's CPU time (what the bookkeeping costs; other processes
on a shared machine still slow it through caches, not through preemption)
and, apart, wall time; reading the thread clock costs ~1.5 us here, 4 reads
a step.

It also checks what went out: the longest any tracked id waited for its next
heartbeat (its arrival counting as the first), and against an acknowledging
P that every view ends exactly where P's answers put it (its grant, or its
id's last heartbeat plus the extension).

    python -m tools.bench_d_bookkeeping [--waiting 100000] [--engines 8] [--intervals 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

from harness.tiny_model import tiny_model_dir
from harness.upstream_fake import FakeNixlWrapper, make_upstream_worker, stock_worker_class
from tools.bench_core import req_ids
from vllm_nixl_lease._wire import (
    PARAM_LEASE_TAG,
    default_heartbeat_interval,
    default_lease_extension,
    heartbeat_payload,
)

LEASE = 30  # s: upstream's default
EXTENSION = default_lease_extension(LEASE)
INTERVAL = default_heartbeat_interval(LEASE)
HOST = "10.0.0.1"
CASES = ("ours, acknowledging P (LHB/LACK)", "ours, stock P (HB)", "upstream, stock P (HB)")


class HeldClock(Protocol):
    """A clock the bench holds and moves itself: ``VirtualClock`` here, the
    instruction cases' ``PerfCounter``."""

    @property
    def now(self) -> float: ...


class VirtualClock:
    """``time.perf_counter`` for the code under test; the bench times with
    ``thread_time_ns`` and ``perf_counter_ns``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def vllm_config(root: Path) -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    model = tiny_model_dir(root / "tiny-llama")
    kv = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        kv_buffer_device="cpu",
        kv_connector_extra_config={"kv_lease_duration": LEASE},
    )
    return VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32"),
        kv_transfer_config=kv,
        cache_config=CacheConfig(block_size=32),
        # The multiprocess executor's: the metadata is pickled, as measured here.
        parallel_config=ParallelConfig(distributed_executor_backend="mp"),
    )


def kv_cache_config() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


class D:
    """One D engine: a real scheduler and a real worker (fake NIXL), connected to P engines."""

    def __init__(self, case: str, config: Any, engines: list[str], clock: HeldClock) -> None:
        from vllm.config import set_current_vllm_config

        self.ours = case.startswith("ours")
        self.acked = "LHB" in case
        self.clock = clock
        if self.ours:
            from vllm_nixl_lease.adapter.config import LeaseConfig
            from vllm_nixl_lease.adapter.schedulers import LeaseNixlPullConnectorScheduler
            from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

            sched_cls: type = LeaseNixlPullConnectorScheduler
            self.worker = make_upstream_worker(
                LeaseNixlPullConnectorWorker, EXTENSION, FakeNixlWrapper(name="D")
            )
            self.worker._setup_lease(LeaseConfig.from_extra_config({"kv_lease_duration": LEASE}))
        else:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
                NixlPullConnectorScheduler,
            )

            sched_cls = NixlPullConnectorScheduler
            self.worker = make_upstream_worker(stock_worker_class(), EXTENSION, FakeNixlWrapper(name="D"))
        with set_current_vllm_config(config):
            self.sched = sched_cls(config, "d-engine", kv_cache_config())
        self.worker.shutdown = lambda: None  # a stub: nothing of upstream's to tear down
        # Every P engine already handshaken (one rank each), clocks agreed.
        self.worker._ensure_handshake = lambda *a, **k: None
        for engine in engines:
            self.worker._remote_agents[engine] = {0: f"agent-{engine}"}
            self.worker._engine_clock_offset[engine] = 0.0
        self.hello_answered: set[str] = set()
        self.by_tag: dict[str, str] = {}  # what our P resolves LHBT: tags with
        # Each P engine's scheduler side (our P): its instance and tags, for the params.
        from vllm_nixl_lease.adapter.config import LeaseConfig
        from vllm_nixl_lease.adapter.p_scheduler.lease_params import LeaseParams

        p_config = LeaseConfig.from_extra_config({"kv_lease_duration": LEASE})
        self.p_params = {engine: LeaseParams(p_config) for engine in engines}
        self.instance_of = {f"agent-{e}": p.instance.instance for e, p in self.p_params.items()}
        self.output = SimpleNamespace(total_num_scheduled_tokens=1, finished_recving=set())

    def request(self, local_id: str, engine: str, remote_id: str) -> Any:
        params: dict[str, Any] = dict(
            do_remote_prefill=True,
            remote_engine_id=engine,
            remote_request_id=remote_id,
            remote_host=HOST,
            remote_port=5600,
            tp_size=1,
        )
        if self.acked:  # what our P adds in request_finished
            self.p_params[engine].add(params, remote_id, self.clock.now + LEASE)
            self.by_tag[params[PARAM_LEASE_TAG]] = remote_id
        return SimpleNamespace(request_id=local_id, kv_transfer_params=params)

    def step(self, arrivals: list[Any], departures: list[str]) -> tuple[int, int, int, int]:
        """One step's heartbeat bookkeeping; returns the CPU time (this
        thread's) of the scheduler, the handoff and the worker, and the wall
        time of all three, in ns."""
        sched, worker = self.sched, self.worker
        wall = time.perf_counter_ns()
        t0 = time.thread_time_ns()
        for req in arrivals:
            sched.on_new_request(req)
        for req_id in departures:
            sched._stop_heartbeat(req_id)
        meta = sched.build_connector_meta(self.output)
        t1 = time.thread_time_ns()
        meta = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
        t2 = time.thread_time_ns()
        if self.ours:
            worker.read_fence.add_views(meta)
            worker.heartbeat_sender.send(meta)
            worker.read_fence.drop_views(meta)
        else:
            worker._send_heartbeats(meta)
        worker._get_new_notifs()
        t3 = time.thread_time_ns()
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter_ns() - wall

    def p_answers(self, last_sent: dict[str, float], heartbeated: dict[str, float]) -> tuple[int, int]:
        """Take what D sent this step; an acknowledging P answers it (delivered
        for D's next step); ``last_sent``: P's id -> this step's time for each
        id heartbeated.  Returns (heartbeat messages, ids) sent."""
        from vllm_nixl_lease._wire import (
            ESCAPE_PREFIX,
            HELLO_KIND,
            heartbeat_ack_message,
            parse_acked_heartbeat,
        )

        wrapper = self.worker.nixl_wrapper
        sent, wrapper.sent = wrapper.sent, []
        seqs: dict[str, list[int]] = {}
        msgs = ids = 0
        for agent, msg in sent:
            if msg.startswith(ESCAPE_PREFIX + HELLO_KIND):  # our P welcomes D at once
                wrapper.deliver(agent, heartbeat_ack_message(self.instance_of[agent], []))
                continue
            msgs += 1
            tagged = False
            if msg.startswith(ESCAPE_PREFIX):
                parsed = parse_acked_heartbeat(msg)
                assert parsed is not None
                seqs.setdefault(agent, []).append(parsed[0])
                payload, tagged = parsed[1], parsed[2]
            else:
                payload = heartbeat_payload(msg)
            named = payload.decode().split(",")
            if tagged:
                named = [self.by_tag[tag] for tag in named]
            ids += len(named)
            now = self.clock.now
            for remote_id in named:
                last_sent[remote_id] = heartbeated[remote_id] = now
        for agent, agent_seqs in seqs.items():
            wrapper.deliver(agent, heartbeat_ack_message(self.instance_of[agent], agent_seqs))
        return msgs, ids


def with_clock(clock: VirtualClock, fn: Any) -> Any:
    import time as time_module

    real = time_module.perf_counter
    time_module.perf_counter = clock
    try:
        return fn()
    finally:
        time_module.perf_counter = real


def percentile(sorted_values: list[float], q: float) -> float:
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def run_case(case: str, config: Any, args: argparse.Namespace) -> dict[str, Any]:
    import time as time_module

    clock = VirtualClock()
    real_perf_counter = time_module.perf_counter
    time_module.perf_counter = clock
    try:
        engines = [f"P{k}" for k in range(args.engines)]
        d = D(case, config, engines, clock)
        remote = req_ids(args.waiting + args.churn * args.steps_total, prefix="cmpl")
        queue: list[str] = []  # local ids, oldest first (D serves roughly FIFO)
        created: dict[str, float] = {}
        made = 0

        def new_requests(n: int) -> list[Any]:
            nonlocal made
            out = []
            for _ in range(n):
                local = f"d-{made}"
                created[local] = clock.now
                out.append(d.request(local, engines[made % len(engines)], remote[made]))
                queue.append(local)
                made += 1
            return out

        # Fill the queue at once (not timed), then run.
        for req in new_requests(args.waiting):
            d.sched.on_new_request(req)
        head = 0
        step_s = args.step_ms / 1000
        warmup_steps = args.warmup_steps
        samples: list[tuple[int, int, int, int]] = []
        warm_max = 0
        sends: list[int] = []
        sent_ids = 0
        # The renewal promise, checked on what went out: P's id -> its last
        # heartbeat (its arrival before the first); the longest wait seen.
        last_sent = dict.fromkeys(remote[: args.waiting], clock.now)
        heartbeated: dict[str, float] = {}  # P's id -> its last real heartbeat
        longest_gap = 0.0
        # The cyclic GC is off while timing, as in bench_core: a collection
        # walks the whole heap and lands on whichever step allocates last.
        gc.collect()
        gc.disable()
        for step in range(args.steps_total):
            arrivals = new_requests(args.churn) if step else []
            departures = queue[head : head + (args.churn if step else 0)]
            head += len(departures)
            timed = d.step(arrivals, departures)
            for req in arrivals:
                last_sent[req.kv_transfer_params["remote_request_id"]] = clock.now
            for local in departures:
                del last_sent[remote[int(local[2:])]]
            msgs, ids = d.p_answers(last_sent, heartbeated)
            if step >= warmup_steps:
                longest_gap = max(longest_gap, clock.now - min(last_sent.values()))
            if step < warmup_steps:
                warm_max = max(warm_max, sum(timed[:3]))
            else:
                samples.append(timed)
                sends.append(msgs)
                sent_ids += ids
            clock.now += step_s
    finally:
        gc.enable()
        time_module.perf_counter = real_perf_counter
    renewed = None
    if d.acked:
        # Every view must sit exactly where P's answers put it: its grant, or
        # its id's last heartbeat plus the extension (the last answers taken first).
        with_clock(clock, d.worker._get_new_notifs)
        views = d.worker.read_fence.views
        live = queue[head:]
        exact = 0
        for local in live:
            remote_id = remote[int(local[2:])]
            expected = max(created[local] + LEASE, heartbeated.get(remote_id, -1e9) + EXTENSION)
            got = views.remaining(local, clock.now, 0.0)
            exact += got is not None and abs(got + clock.now - expected) < 1e-6
        renewed = (exact, len(live))
    totals = sorted(sum(s[:3]) / 1e3 for s in samples)
    walls = sorted(s[3] / 1e3 for s in samples)
    parts = {
        name: sorted(s[i] / 1e3 for s in samples) for i, name in enumerate(("scheduler", "handoff", "worker"))
    }
    return {
        "case": case,
        "steps": len(samples),
        "p50_us": percentile(totals, 50),
        "p99_us": percentile(totals, 99),
        "max_us": totals[-1],
        "mean_us": statistics.fmean(totals),
        "wall_p50_us": percentile(walls, 50),
        "wall_p99_us": percentile(walls, 99),
        "wall_max_us": walls[-1],
        "parts_p99_us": {name: percentile(v, 99) for name, v in parts.items()},
        "parts_max_us": {name: v[-1] for name, v in parts.items()},
        "warmup_max_us": warm_max / 1e3,
        "sends_per_step_max": max(sends),
        "sends_per_step_mean": statistics.fmean(sends),
        "ids_sent_per_interval": sent_ids / max(1, len(samples)) * args.steps_per_interval,
        "longest_heartbeat_gap_s": longest_gap,
        "views_renewed_by_answers": renewed,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waiting", type=int, default=100_000, help="requests D tracks")
    ap.add_argument("--engines", type=int, default=8, help="P engines they wait on")
    ap.add_argument("--step-ms", type=float, default=20.0, help="virtual time per step")
    ap.add_argument("--churn", type=int, default=10, help="arrivals (and departures) per step")
    ap.add_argument("--intervals", type=float, default=4, help="heartbeat intervals measured")
    ap.add_argument("--warmup", type=float, default=1, help="heartbeat intervals run first, not counted")
    ap.add_argument(
        "--cases", nargs="+", type=int, default=list(range(len(CASES))), help="indices into CASES"
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    interval = INTERVAL
    args.interval_s = interval
    args.steps_per_interval = round(interval * 1000 / args.step_ms)
    args.warmup_steps = round(args.warmup * args.steps_per_interval)
    args.steps_total = args.warmup_steps + round(args.intervals * args.steps_per_interval)

    from vllm_nixl_lease import IMPLEMENTATION

    print(
        f"D heartbeat bookkeeping per step: {args.waiting} waiting requests over {args.engines} P engines, "
        f"{args.churn} arrivals + {args.churn} departures per {args.step_ms:g} ms step, heartbeat interval "
        f"{interval} s ({args.steps_per_interval} steps); {args.intervals:g} intervals measured after "
        f"{args.warmup:g} of warm-up; core: {IMPLEMENTATION}; load: {os.getloadavg()[0]:.2f}"
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        config = vllm_config(Path(tmp))
        for index in args.cases:
            r = run_case(CASES[index], config, args)
            results.append(r)
            parts = ", ".join(f"{k} {v:.0f}" for k, v in r["parts_p99_us"].items())
            print(
                f"  {r['case']:<34} CPU  p50 {r['p50_us']:7.1f} us | p99 {r['p99_us']:7.1f} us | "
                f"max {r['max_us']:9.1f} us | mean {r['mean_us']:6.1f} us | p99 parts: {parts}\n"
                f"  {'':<34} wall p50 {r['wall_p50_us']:7.1f} us | p99 {r['wall_p99_us']:7.1f} us | "
                f"max {r['wall_max_us']:9.1f} us | sends/step mean {r['sends_per_step_mean']:.1f} "
                f"max {r['sends_per_step_max']} | warm-up max {r['warmup_max_us'] / 1e3:.1f} ms CPU",
                flush=True,
            )
            renewed = r["views_renewed_by_answers"]
            print(
                f"  {'':<34} longest wait of an id for its next heartbeat "
                f"{r['longest_heartbeat_gap_s']:.2f} s "
                f"(interval {interval} s, step {args.step_ms:g} ms)"
                + (f"; views where P's answers put them: {renewed[0]} of {renewed[1]}" if renewed else ""),
                flush=True,
            )
    by_case = {r["case"]: r for r in results}
    upstream = by_case.get(CASES[2])
    if upstream is not None:
        for r in results:
            if r is not upstream:
                print(
                    f"  {r['case']}: CPU p99 {upstream['p99_us'] / r['p99_us']:.2f}x upstream's / "
                    f"max {upstream['max_us'] / r['max_us']:.1f}x below upstream's; wall p99 "
                    f"{upstream['wall_p99_us'] / r['wall_p99_us']:.2f}x / max "
                    f"{upstream['wall_max_us'] / r['wall_max_us']:.1f}x"
                )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "load": os.getloadavg(), "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
