"""The harness engine's client cancel (``Engine.abort``, what the chaos lanes' cancelling
clients use) over real NIXL, ours and stock: a request cancelled while queued on D ends at once
and P frees its lease on the completion D sends with no blocks; one cancelled while its READ is
in flight (P stopped, UCX over TCP: no READ completes meanwhile) keeps D's blocks until the
worker reports its load, then D holds nothing more than before (free KV blocks, admitted loads,
``_recving_metadata``): the state the chaos lanes' D-side leak check compares."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet, kill
from harness.nixl import scenarios as sc
from harness.nixl.fleet import wait_for


@pytest.mark.parametrize("stock", [False, True], ids=["ours", "stock"])
def test_cancel_while_queued_and_while_reading_leaves_d_as_it_was(tmp_path, stock: bool) -> None:
    with Fleet(str(tmp_path), lease=sc.LEASE) as fleet:
        p = fleet.start("P", "p", stock=stock, env=dict(kill.TCP))
        d = fleet.start("D", "d", stock=stock, env=dict(kill.TCP))
        ids, params = sc.prefill(p, "warm", 1)
        sc.hand_to_d(d, params, hold=False)
        sc.wait_loaded(d, ids, 30)
        base = d.call("drain")["d_held"]
        ids, params = sc.prefill(p, "cancel", 4)
        queued, reading = ids[:2], ids[2:]
        sc.hand_to_d(d, params, hold=True)
        assert d.abort([sc.d_id(r) for r in queued]) == {sc.d_id(r): "queued" for r in queued}
        sc.wait_freed(p, queued, timeout=10)  # the completion with no blocks
        assert {p.report()["reqs"][r]["freed_reason"] for r in queued} == {"read"}
        p.freeze()
        try:
            d.release([sc.d_id(r) for r in reading])
            wait_for(
                lambda: all("admitted_t" in d.report()["reqs"][sc.d_id(r)] for r in reading),
                10,
                poll=0.05,
                what="D admitting the requests",
            )
            time.sleep(0.3)  # the admitting step posts the READs
            assert d.abort([sc.d_id(r) for r in reading]) == {sc.d_id(r): "admitted" for r in reading}
            held = d.call("drain")["d_held"]
            assert held["free_blocks"] == base["free_blocks"] - 2 * len(reading), held  # kept until reported
            assert held["unread_aborted"] == len(reading)
        finally:
            p.thaw()
        wait_for(lambda: d.summary()["unread"] == 0 or None, 30, what="D reporting the cancelled loads")
        end = d.call("drain")["d_held"]
        assert end == base, (base, end)
        assert d.abort([sc.d_id(r) for r in ids]) == {sc.d_id(r): "gone" for r in ids}
