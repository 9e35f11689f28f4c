"""Views of a P instance whose connection is not proven yet:
nothing is converted to D's clock with that connection's offset, which may be
another process's (``docs/PROTOCOL.md`` 4.1: "never converted before that")."""

from __future__ import annotations

import pytest

INSTANCE = "0123456789abcdef"


def test_may_wait_judges_without_converting(core) -> None:
    views = core.LeaseViews(margin=2.0)
    views.add("d1", "P", "p1", grantor_deadline=1030.0, extension=20.0, instance=INSTANCE)
    # An unproven connection (another process's clock: offset 1025) says 5 s left: wait.
    assert views.may_wait("d1", now=0.0, offset=1025.0) is True
    # ... and 1 s left later on: fence (either answer is safe; nothing was stored).
    assert views.may_wait("d1", now=4.0, offset=1025.0) is False
    # The proven connection's offset (1000) is the one the view takes: 30 s left at 0.
    assert views.remaining("d1", now=0.0, offset=1000.0) == pytest.approx(30.0)
    assert views.may_wait("d1", now=0.0, offset=0.0) is True  # converted now: offsets no longer matter
    assert views.may_wait("unknown", now=0.0, offset=0.0) is None


def test_may_wait_takes_an_ended_or_converted_view_as_it_is(core) -> None:
    views = core.LeaseViews(margin=2.0)
    views.add("d1", "P", "p1", 1030.0, 20.0, INSTANCE)
    views.add("d2", "P", "p2", 1030.0, 20.0, INSTANCE)
    assert views.end("P", INSTANCE, ["p1"]) == 1
    assert views.may_wait("d1", now=0.0, offset=0.0) is False  # ended: fenced whatever the offset
    assert views.may_read("d2", now=0.0, offset=1000.0) is True  # converted with 1000
    assert views.may_wait("d2", now=27.0, offset=-5000.0) is True  # 3 s left on the stored deadline
    assert views.may_wait("d2", now=28.0, offset=-5000.0) is False


def test_move_to_chunk_does_not_convert_a_view_never_converted(core) -> None:
    views = core.LeaseViews(margin=2.0)
    views.add("d1", "P", "p1", 1030.0, 20.0, INSTANCE, chunk=(1, 1))
    # A repack while the connection is unproven (its offset 1025 is another process's).
    assert views.move_to_chunk("d1", (2, 1), offset=1025.0) is True
    assert views.remaining("d1", now=0.0, offset=1000.0) == pytest.approx(30.0)


def test_move_to_chunk_still_takes_up_the_old_chunks_proof(core) -> None:
    views = core.LeaseViews(margin=2.0)
    views.add("d1", "P", "p1", 1030.0, 20.0, INSTANCE, chunk=(1, 1))
    views.chunk_acked("P", INSTANCE, 1, 1, started=25.0, offset=1000.0, now=26.0)  # first answer: 45
    views.chunk_acked("P", INSTANCE, 1, 1, started=35.0, offset=1000.0, now=36.0)  # kept per chunk: 55
    assert views.move_to_chunk("d1", (2, 1), offset=1000.0) is True
    assert views.remaining("d1", now=40.0, offset=1000.0) == pytest.approx(15.0)
