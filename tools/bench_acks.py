"""What acknowledged heartbeats cost on the normal path, against upstream's
real heartbeat code and our renew-on-send path, in one process.

One heartbeat round for ``L`` leases (vLLM-like ids, ``max_heartbeat_bytes``
8192): P routes D's messages (``_get_new_notifs``: ``HB:`` for upstream and
for ours, ``LHB:`` plus building the ``LACK:`` answer for ours with acks); D
sends them (upstream's ``_send_heartbeats``; ours through ``HeartbeatSender``)
and, with acks, takes P's answers and renews its views.  NIXL is a fake that
only counts sends: add ~20-70 us per real ``send_notif`` (measured here), of
which acks add one per D agent per P step.

    python -m tools.bench_acks [--leases 10000 100000]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from harness.upstream_fake import FakeNixlWrapper, make_upstream_worker, stock_worker_class
from tools.bench_core import median_ns, req_ids
from vllm_nixl_lease import encode_heartbeats
from vllm_nixl_lease._wire import (
    ACKED_HEARTBEAT_OVERHEAD,
    acked_heartbeat_message,
    default_lease_extension,
    heartbeat_ack_message,
    hello_message,
)

LEASE = 30
EXTENSION = default_lease_extension(LEASE)
MAX_BYTES = 8192
INSTANCE = "0123456789abcdef"  # the P process answers name


def our_worker(name: str):
    from vllm_nixl_lease.adapter.config import LeaseConfig
    from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

    w = make_upstream_worker(
        LeaseNixlPullConnectorWorker, EXTENSION, FakeNixlWrapper(keep_sent=False, name=name)
    )
    w._setup_lease(LeaseConfig.from_extra_config({"kv_lease_duration": LEASE}))
    w.shutdown = lambda: None  # a stub: nothing of upstream's to tear down
    return w


def p_round(leases: int) -> dict[str, float]:
    ids = req_ids(leases)
    hb = encode_heartbeats(ids, MAX_BYTES - ACKED_HEARTBEAT_OVERHEAD)
    lhb = [acked_heartbeat_message(seq, m) for seq, m in enumerate(hb, 1)]
    stock = make_upstream_worker(stock_worker_class(), EXTENSION, FakeNixlWrapper(keep_sent=False))
    ours = our_worker("P")
    ours.lease_keeper.adopt_instance(SimpleNamespace(lease_instance=(INSTANCE, b"k" * 16)))
    for rid in ids:
        stock._reqs_to_send[rid] = 1e12
        ours._reqs_to_process.add(rid)
        ours._reqs_to_send[rid] = 1e12
    # D's hello, loaded once (as in a running fleet)
    d_metadata = FakeNixlWrapper(name="D").get_partial_agent_metadata(None)
    ours.nixl_wrapper.deliver("D", hello_message(5.0, d_metadata, ids[0]))
    ours._get_new_notifs()
    ours.ack_answerer._loading["D"][0].result()
    ours._get_new_notifs()

    def routed(worker, msgs):
        def run():
            worker.nixl_wrapper.deliver("D", *msgs)
            worker._get_new_notifs()

        return run

    return {
        "upstream HB": median_ns(routed(stock, hb), 15) / 1e3,
        "ours HB": median_ns(routed(ours, hb), 15) / 1e3,
        "ours LHB + answer": median_ns(routed(ours, lhb), 15) / 1e3,
        "messages": len(hb),
    }


def d_round(leases: int) -> dict[str, float]:
    from vllm_nixl_lease.adapter.metadata import LEASE_HEARTBEATS_ATTR, EngineHeartbeats

    ids = req_ids(leases)
    hb = encode_heartbeats(ids, MAX_BYTES - ACKED_HEARTBEAT_OVERHEAD)
    out = {}
    for label, acked in (("ours HB, renew on send", False), ("ours LHB + answers", True)):
        d = our_worker("D")
        d._remote_agents["P"] = {(0, 0): b"P"}
        d._engine_clock_offset["P"] = 0.0
        instance = INSTANCE if acked else ""
        for i, rid in enumerate(ids):
            d.read_fence.views.add(f"d{i}", "P", rid, 1e12, 20.0, instance)
        if acked:  # the connection proven: P's welcome arrived
            d.nixl_wrapper.deliver("P", heartbeat_ack_message(INSTANCE, []))
            d._get_new_notifs()

        def send(d=d, acked=acked, instance=instance):
            hbs = EngineHeartbeats("P", hb, "h", 1, 1, instance=instance)
            d._send_heartbeats(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {"P": hbs}}))
            if acked:  # P's answer to every message of the round, as P sends it
                seqs = list(d.ack_requester.ledger._sent)
                d.nixl_wrapper.deliver("P", heartbeat_ack_message(INSTANCE, seqs))
                d._get_new_notifs()

        out[label] = median_ns(send, 9) / 1e3
    stock = make_upstream_worker(stock_worker_class(), EXTENSION, FakeNixlWrapper(keep_sent=False))
    stock._remote_agents["P"] = {(0, 0): "P"}
    stock._ensure_handshake = lambda *a, **k: None
    info = SimpleNamespace(req_ids=set(ids), host="h", port=1, tp_size=1, dcp_size=1, pp_size=1)
    meta = SimpleNamespace(heartbeat_by_engine={"P": info})
    out["upstream _send_heartbeats"] = median_ns(lambda: stock._send_heartbeats(meta), 9) / 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, nargs="+", default=[10_000, 100_000])
    args = ap.parse_args(argv)
    for n in args.leases:
        p = p_round(n)
        print(f"\n{n} leases, {p['messages']} heartbeat messages per round")
        print(
            f"  P, route one round: upstream HB {p['upstream HB']:.0f} us | ours HB {p['ours HB']:.0f} us | "
            f"ours LHB + answer {p['ours LHB + answer']:.0f} us "
            f"(acks add {p['ours LHB + answer'] - p['ours HB']:+.0f} us, "
            f"{p['ours LHB + answer'] / p['upstream HB']:.2f}x upstream's HB)"
        )
        d = d_round(n)
        print(
            f"  D, send one round: upstream {d['upstream _send_heartbeats']:.0f} us | ours renew-on-send "
            f"{d['ours HB, renew on send']:.0f} us | ours LHB + take answers {d['ours LHB + answers']:.0f} us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
