"""One READ per lease on D (decode/read_claims.py, through LeaseViews.claim_read)."""

from __future__ import annotations

import math

INSTANCE = "0123456789abcdef"


def test_second_local_reader_of_a_lease_is_refused_while_any_view_of_it_remains(core) -> None:
    views = core.LeaseViews(margin=1.0)
    views.add("d1", "P", "p1", 100.0, 8.0, INSTANCE)
    views.add("d2", "P", "p1", 100.0, 8.0, INSTANCE)  # n > 1 / a duplicate: the same lease
    views.add("d3", "P", "p2", 100.0, 8.0, INSTANCE)  # another lease
    assert views.claim_read("d1", now=0.0, offset=0.0) is True
    assert views.claim_read("d1", now=0.0, offset=0.0) is True  # the same reader, again
    assert views.claim_read("d2", now=0.0, offset=0.0) is False
    assert views.claim_read("d3", now=0.0, offset=0.0) is True
    views.drop("d1")  # the first reader's request ended; d2 still views the lease
    assert views.claim_read("d2", now=0.0, offset=0.0) is False
    assert views.claim_read("unviewed", now=0.0, offset=0.0) is True


def test_plain_views_and_instances_key_their_own_claims(core) -> None:
    views = core.LeaseViews(margin=1.0)
    views.add("d1", "P", "p1", 100.0, 8.0)  # a plain P's lease p1
    views.add("d2", "P", "p1", 100.0, 8.0, INSTANCE)  # P's instance's lease of that name
    views.add("d3", "Q", "p1", 100.0, 8.0)  # another engine
    assert [views.claim_read(d, 0.0, 0.0) for d in ("d1", "d2", "d3")] == [True, True, True]


def test_a_duplicate_arriving_after_the_reader_ended_is_refused_until_the_grant_lapses(core) -> None:
    views = core.LeaseViews(margin=1.0)
    views.add("d1", "P", "p1", 1030.0, 8.0, INSTANCE)
    assert views.claim_read("d1", now=1.0, offset=1000.0) is True  # a fresh view ends at 30 (D)
    views.drop("d1")
    assert len(views.claims) == 1  # kept: a retry may still come with the same params
    views.add("d2", "P", "p1", 1030.0, 8.0, INSTANCE)
    assert views.claim_read("d2", now=29.0, offset=1000.0) is False
    # Past the grant a fresh view of those params has ended anyway; the claim
    # lives on while d2 still views the lease (it may have been renewed).
    assert views.claim_read("d2", now=31.0, offset=1000.0) is False
    views.drop("d2")
    assert len(views.claims) == 0  # d2 never read: nothing to keep
    views.add("d3", "P", "p1", 1030.0, 8.0, INSTANCE)
    assert views.claim_read("d3", now=40.0, offset=1000.0) is True


def test_claims_are_forgotten_when_unviewed_and_past_expiry(core) -> None:
    claims = core.ReadClaims()
    viewed: set[tuple[str, str, str]] = set()
    for i in range(1000):
        key = ("P", "", f"p{i}")
        assert claims.claim(key, f"d{i}", expiry=float(i), now=float(i), viewed=viewed)
        claims.release(key)
    assert len(claims) <= 2  # each claim pruned once the clock passed its expiry
    claims.claim(("P", "", "x"), "dx", expiry=-math.inf, now=2000.0, viewed=viewed)
    claims.release(("P", "", "x"))  # expiry unknown (never connected): forgotten at once
    assert len(claims) == 0


def test_leases_of_a_p_without_views_are_claimed_too_and_capped(core, monkeypatch) -> None:
    from vllm_nixl_lease.decode import read_claims

    monkeypatch.setattr(read_claims, "MAX_UNVIEWED", 4)
    views = core.LeaseViews(margin=1.0)
    assert views.claim_read("d1", 0.0, 0.0, unviewed=("P", "p1")) is True  # a stock P: no view
    assert views.claim_read("d1", 0.0, 0.0, unviewed=("P", "p1")) is True
    assert views.claim_read("d2", 0.0, 0.0, unviewed=("P", "p1")) is False
    assert views.claim_read("d3", 0.0, 0.0, unviewed=("Q", "p1")) is True
    for i in range(4):
        views.claim_read(f"e{i}", 0.0, 0.0, unviewed=("P", f"x{i}"))
    assert len(views.claims) == 4  # the oldest forgotten first
    assert views.claim_read("d2", 0.0, 0.0, unviewed=("P", "p1")) is True


def test_ended_claims_are_forgotten_by_the_sweep_without_another_read(core) -> None:
    """An idle D makes no claim, so the engine reaper's sweep prunes (``prune_claims``)."""
    views = core.LeaseViews(margin=1.0)
    views.add("d1", "P", "p1", 1030.0, 8.0, INSTANCE)
    assert views.claim_read("d1", now=1.0, offset=1000.0) is True  # a fresh view ends at 30 (D)
    views.drop("d1")
    assert views.prune_claims(29.0) == 0 and len(views.claims) == 1  # a retry may still come
    assert views.prune_claims(30.0) == 1 and len(views.claims) == 0
