"""P's holders of a lease (``prefill/lease_holders.py``; docs/PROTOCOL.md rule P14):
a completion frees a lease only when no other holder remains."""

from __future__ import annotations

import pytest

from vllm_nixl_lease.prefill import lease_holders
from vllm_nixl_lease.prefill.lease_holders import Completion, LeaseHolders


def test_no_holder_passes_every_completion() -> None:
    h = LeaseHolders()
    assert h.completed(["p1"], "A") is Completion.PASS
    assert not h


def test_one_holder_passes_its_own_completion_and_keeps_the_lease_from_others() -> None:
    h = LeaseHolders()
    assert h.claim("p1", "A") is True
    assert h.claim("p1", "A") is False  # already a holder
    assert h.completed(["p1"], "B") is Completion.IGNORED  # B never claimed: A may be reading
    assert h.holders("p1") == ["A"]
    assert h.completed(["p1"], "A") is Completion.PASS  # the router counts it, as without holders
    assert not h


def test_a_lease_of_two_holders_is_freed_when_the_last_finishes() -> None:
    h = LeaseHolders()
    h.claim("p1", "A")
    assert h.claim("p1", "B") is True
    assert h.completed(["p1"], "A") is Completion.HELD  # B still holds it
    assert h.completed(["p1"], "A") is Completion.HELD  # a duplicate: B still holds it
    assert h.claim("p1", "A") is False  # A's late heartbeat does not make it a holder again
    assert h.completed(["p1"], "C") is Completion.IGNORED
    assert h.holders("p1") == ["B"]
    assert h.completed(["p1"], "B") is Completion.FREE
    assert not h and h.holders("p1") == []


def test_a_non_holder_once_every_holder_finished_passes() -> None:
    h = LeaseHolders()
    h.claim("TAG", "A")
    h.claim("p1", "B")
    assert h.completed(["p1", "TAG"], "B") is Completion.HELD
    h.forget(["TAG"])  # (as if A's entry went with a release)
    assert h.completed(["p1", "TAG"], "C") is Completion.PASS  # no live holder: the router counts it


def test_a_completion_is_looked_up_by_id_and_by_tag() -> None:
    h = LeaseHolders()
    h.claim("TAG", "A")  # A names the lease by tag
    h.claim("p1", "B")  # B by id
    assert h.completed(["p1", "TAG"], "B") is Completion.HELD  # A holds it under its tag
    assert h.claim("p1", "B") is False  # B's late heartbeat does not make it a holder again
    assert h.completed(["p1", "TAG"], "A") is Completion.FREE  # the last of two holders
    assert not h


def test_forget_drops_every_key() -> None:
    h = LeaseHolders()
    h.claim("p1", "A")
    h.claim("p1", "B")
    h.claim("p2", "A")
    h.forget(["p1", "p2", "p3"])
    assert not h and len(h) == 0


def test_claims_past_the_cap_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease_holders, "MAX_HOLDERS_PER_LEASE", 3)
    h = LeaseHolders()
    assert [h.claim("p1", a) for a in "ABCD"] == [True, True, True, None]
    assert h.refused == 1 and h.holders("p1") == ["A", "B", "C"]
    assert h.completed(["p1"], "D") is Completion.IGNORED  # refused: never a holder
