"""Bugs `make chaos` found, each pinned by a deterministic test of its own (real
NIXL engines on loopback; no nemesis, no randomness).

1. P restarted under the same engine id (and side-channel port) while D had
   nothing queued for it: D's connection to that engine id still reached the
   dead process, proven as the old instance.  For the new instance's requests
   D then sent nothing (no heartbeat, no hello: "another P process runs
   there") and fenced every READ, so nothing ever failed on the dead
   connection and D never handshook again: the pair served no request until
   upstream evicted the idle engine.  Found by ``make chaos SEED=1``
   (``kill p0 same_id=1``): p0->d0 and p0->d1 wedged, every read fenced.
2. P killed and restarted under a new engine id (and port) while D had
   nothing queued for it: D kept the dead engine's connection, descriptors,
   clock offset and registration generation for ever.  Upstream evicts an
   engine idle past ``engine_ttl`` only when another engine handshakes, and
   in a settled fleet none does.  Found by ``make chaos SEED=7`` (d1 held
   ``p0``'s state at the end, 12 structures).
3. Leases lapsing on P, never heartbeated, for requests P granted seconds
   after every fault on the pair had healed (``make chaos SEED=30``, 30
   minutes: p1 -> d0 granted at 1,862.7 s, 2.3 s after the last heal on the
   pair, and two probes of p1 -> d1 in the recovery phase).  Not D's
   heartbeat code: D's snapshots show nothing waiting for a handshake, a
   proof or a retry, the connection proven, and acknowledged heartbeats
   going out unanswered; the READs D posted in the same span completed
   only 12.7 s (d0) and 20.7 s (d1) after the last heal, all in one step.
   D -> P packets dropped for seconds (``asym``, ``partition_group``) back
   off the retransmission timer of the TCP connection UCX sends D's
   notifications on, doubling per retransmission; nothing D queues goes out
   until that timer fires, up to about as long after the heal as the cut
   lasted.  The test heals right after the 6th retransmission (about 13 s
   to the next, twice the lease) and pins what D owes: no wrong data, and
   serving again as soon as TCP retransmits.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl")
from harness import netns
from harness.chaos import nft
from harness.nixl import Fleet, wait_for
from harness.nixl import partition as pt
from harness.nixl import scenarios as sc

pytestmark = pytest.mark.serial

RECOVERY_S = 30.0
ENGINE_TTL_S = 4.0
# Retransmissions before the heal: TCP's timeout is then about 0.2 s * 2**6, twice the lease.
BACKOFFS = 6
# What D may add to TCP's own delay: two heartbeat intervals, and a loaded machine's steps.
SERVE_SLACK_S = 2 * pt.INTERVAL + 4.0


def _served(p, d, tag: str, timeout: float) -> tuple[bool, int]:
    """Requests from ``p`` to ``d`` one after another until one is read correctly;
    (served, loads that failed first)."""
    failed = 0
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        n += 1
        ids, params = sc.prefill(p, f"{tag}{n}", 1)
        sc.hand_to_d(d, params, hold=False)
        d_rep = sc.wait_loaded(d, ids, 30)
        if not d_rep["reqs"][sc.d_id(ids[0])].get("failed"):
            p_rep = sc.wait_freed(p, ids, 30)
            assert sc.data_mismatches(p_rep, d_rep, ids) == [], "a read returned other data"
            return True, failed
        failed += 1
        time.sleep(0.5)
    return False, failed


def test_p_restarted_same_id_with_nothing_queued_on_d_is_served_again(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        p = fleet.start("P", "p", engine_id="p-fixed")
        d = fleet.start("D", "d")
        ok, _ = _served(p, d, "before", 30)
        assert ok, "the pair never worked"
        port = p.spec.side_channel_port
        p.kill()
        time.sleep(1.0)
        p2 = fleet.start("P", "p", engine_id="p-fixed", side_channel_port=port)
        ok, failed = _served(p2, d, "after", RECOVERY_S)
    assert ok, f"D served nothing from the restarted P in {RECOVERY_S:.0f}s ({failed} loads failed)"


def test_p_gone_under_a_new_id_is_released_on_d(tmp_path) -> None:
    ttl = {"extra": {"engine_ttl": ENGINE_TTL_S}}
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        p = fleet.start("P", "p", engine_id="p-old", **ttl)
        d = fleet.start("D", "d", **ttl)
        assert _served(p, d, "before", 30)[0], "the pair never worked"
        p.kill()
        p_new = fleet.start("P", "p-new", engine_id="p-new", **ttl)
        assert _served(p_new, d, "after", RECOVERY_S)[0], "the new P was never served"
        # Nothing more handshakes: only D's own sweep (every 10 s here) can release p-old.
        deadline = time.monotonic() + ENGINE_TTL_S + 10.0 + 10.0
        held: list[str] = []
        while time.monotonic() < deadline:
            keys = d.call("drain")["sizes"]["keys"]
            held = sorted(path for path, ids in keys.items() if "p-old" in ids)
            if not held:
                break
            time.sleep(1.0)
        assert not held, f"D still holds state of the dead engine p-old: {held}"


_no_hosts = netns.unavailable_reason() or nft.unavailable_reason()


@pytest.mark.skipif(_no_hosts is not None, reason=f"network namespaces or nftables unavailable: {_no_hosts}")
def test_d_serves_again_as_soon_as_tcp_retransmits_after_a_one_way_cut(tmp_path) -> None:
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        p, d = pt.start_pair(fleet, False, False)
        pt.warm_up(p, d)
        pt.queue_on_d(p, d, "held", 2)  # D heartbeats P every interval: data in flight when the cut starts
        table = f"gap_{hosts.token}"
        t_cut = time.monotonic()
        nft.block(hosts.netns("p"), table, "in", [hosts.ip("d")])  # D -> P dropped, as chaos's asym
        try:
            _, rto = wait_for(
                lambda: (b := hosts.tcp_backoff("d", "p"))[0] >= BACKOFFS and b,
                30.0,
                poll=0.02,
                what=f"TCP's {BACKOFFS}th retransmission from D to P",
            )
        finally:
            nft.unblock(hosts.netns("p"), table)
        t_heal = time.monotonic()
        d.release()  # fenced: P's leases lapsed during the cut
        ids, params = sc.prefill(p, "at-heal", 1)
        sc.hand_to_d(d, params, hold=False)
        d_rep = sc.wait_loaded(d, ids, 30 + rto)
        p_rep = sc.wait_freed(p, ids, 30)
        accepted = [r for r in ids if not d_rep["reqs"][sc.d_id(r)].get("failed")]
        assert sc.data_mismatches(p_rep, d_rep, accepted) == [], "a read returned other data"
        ok, failed = bool(accepted), 0
        if not ok:
            ok, failed = _served(p, d, "after", t_heal + rto + SERVE_SLACK_S - time.monotonic())
        served_s = time.monotonic() - t_heal
        late = pt.notifs_between(p.report(), t_heal)
    first = late[0] - t_heal if late else None
    at_heal = p_rep["reqs"][ids[0]]
    print(
        f"\n== one-way cut {t_heal - t_cut:.1f}s, TCP timeout at the heal {rto:.1f}s: P took in D's first "
        f"notification {'never' if first is None else f'+{first:.2f}s'} after the heal; the request granted "
        f"at the heal: P freed it by {at_heal.get('freed_reason')} ({at_heal.get('hb', 0)} heartbeat(s)), "
        f"D {'failed' if not accepted else 'read'} it; served again +{served_s:.2f}s "
        f"({failed} loads failed first)"
    )
    bound = rto + SERVE_SLACK_S
    assert rto > sc.LEASE, f"TCP's timeout at the heal ({rto:.1f}s) does not outlast the lease"
    assert ok, f"D served nothing from P within {bound:.1f}s of the heal ({failed} loads failed)"
    assert first is not None and first <= bound, f"D's notifications reached P {first}s after the heal"
