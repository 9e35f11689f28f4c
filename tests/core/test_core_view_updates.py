"""Packing D's lease view updates for the scheduler-to-worker trip (``decode/view_updates.py``):
every update comes back as it went, in order; the Cython module and its twin write the same
bytes and read each other's; a malformed pack is refused with ValueError."""

from __future__ import annotations

import math
import pickle
import random
import types
from typing import Any

import pytest
from core_implementations import ViewFields, load_core


def _updates(
    rng: random.Random, n_new: int, n_dropped: int, n_repacked: int
) -> tuple[dict[str, ViewFields], list[str], dict[str, tuple[int, int]]]:
    new: dict[str, ViewFields] = {}
    chunks: dict[str, tuple[int, int]] = {}
    for i in range(n_new):
        local_id = rng.choice((f"d-{i}", f"cmpl-ß{i}-\u2603", f"r{i}" * rng.randrange(1, 40)))
        new[local_id] = ViewFields(
            rng.choice(("P0", "P1", "engine-\u00e9")),
            rng.choice(("", "0123456789abcdef")),
            rng.choice((f"name{i}", "KLiN7RSYDHA", "")),
            rng.choice((0.0, 1035.04 + i, -3.5, 1e12, math.inf)),
            rng.choice((20.0, 0.5, 1e-9)),
            rng.choice((None, 5.0, 0.0, 2.5)),
            rng.choice((1, 2, 3, 4)),
        )
        if rng.random() < 0.8:
            chunks[local_id] = (rng.randrange(0, 1 << 40), rng.randrange(0, 1 << 40))
    dropped = [f"gone-{i}" for i in range(n_dropped)]
    for i in range(n_repacked):
        chunks[f"old-{i}"] = (rng.randrange(0, 100), rng.randrange(0, 1 << 62))
    return new, dropped, chunks


def _same(x: Any, y: Any) -> bool:
    return x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))


def _same_views(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return list(a) == list(b) and all(
        type(a[k]) is type(b[k]) and all(map(_same, a[k], b[k])) and len(a[k]) == len(b[k]) for k in a
    )


@pytest.mark.parametrize("seed", range(30))
def test_updates_come_back_as_they_went(core: types.SimpleNamespace, seed: int) -> None:
    rng = random.Random(seed)
    new, dropped, chunks = _updates(rng, rng.randrange(0, 30), rng.randrange(0, 30), rng.randrange(0, 5))
    packed = pickle.loads(pickle.dumps(core.pack_views(new, dropped, chunks), protocol=5))
    got_new, got_dropped, got_chunks = core.unpack_views(packed, ViewFields)
    assert _same_views(got_new, new)
    assert all(type(v[3]) is float and type(v[6]) is int for v in got_new.values())
    assert got_dropped == dropped
    assert got_chunks == chunks
    # New views' chunks first, in order, then the repacked views'
    assert list(got_chunks) == [k for k in new if k in chunks] + [k for k in chunks if k not in new]


def test_nothing_packs_to_a_header() -> None:
    for name in ("cython", "python"):
        core = load_core(name)
        strings, numbers = core.pack_views({}, [], {})
        assert strings == [] and numbers == bytes(24)
        assert core.unpack_views((strings, numbers), ViewFields) == ({}, [], {})


@pytest.mark.parametrize("seed", range(30))
def test_cython_and_twin_pack_alike_and_read_each_other(seed: int) -> None:
    c, py = load_core("cython"), load_core("python")
    rng = random.Random(seed)
    new, dropped, chunks = _updates(rng, rng.randrange(0, 20), rng.randrange(0, 20), rng.randrange(0, 5))
    from_c, from_py = c.pack_views(new, dropped, chunks), py.pack_views(new, dropped, chunks)
    assert from_c == from_py
    for reader in (c, py):
        got_new, got_dropped, got_chunks = reader.unpack_views(from_c, ViewFields)
        assert _same_views(got_new, new) and got_dropped == dropped and got_chunks == chunks


def _malformed(strings: list[str], numbers: bytes) -> list[Any]:
    header = numbers[:24]
    return [
        ("not", "a pack"),
        (tuple(strings), numbers),  # strings not a list
        (strings, bytearray(numbers)),  # numbers not bytes
        (strings, numbers[:23]),  # no whole header
        (strings, numbers[:-1]),  # a view cut short
        (strings, numbers + b"\0"),  # trailing bytes
        (strings[:-1], numbers),  # a string missing
        (strings + ["x"], numbers),  # a string too many
        (strings, (2**62).to_bytes(8, "little") + header[8:] + numbers[24:]),  # a count past the size
        (strings, (2**64 - 1).to_bytes(8, "little") + header[8:] + numbers[24:]),  # a negative count
        (strings, header[:8] + (2**63 - 1).to_bytes(8, "little") + numbers[16:]),  # dropped past strings
    ]


def test_malformed_packs_are_refused(core: types.SimpleNamespace) -> None:
    new, dropped, chunks = _updates(random.Random(7), 3, 2, 1)
    strings, numbers = core.pack_views(new, dropped, chunks)
    for bad in _malformed(strings, numbers):
        with pytest.raises((ValueError, TypeError)):
            core.unpack_views(bad, ViewFields)


def test_a_view_that_is_not_a_newview_is_refused(core: types.SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="not a NewView"):
        core.pack_views({"d1": ("P0", "", "n")}, [], {})
    with pytest.raises(ValueError, match="not a NewView"):
        core.pack_views({"d1": ["P0", "", "n", 1.0, 2.0, None, 1]}, [], {})


def test_arguments_of_the_wrong_type_are_refused_alike(core: types.SimpleNamespace) -> None:
    """The twin refuses what the Cython module's declared types refuse, even with nothing to pack."""
    packed = core.pack_views({}, [], {})

    class Subclassed(list):  # the Cython module's declared types are exact
        pass

    for bad in ((("P0",), [], {}), ({}, ("d1",), {}), ({}, Subclassed(), {}), ({}, [], [("d1", (1, 1))])):
        with pytest.raises(TypeError):
            core.pack_views(*bad)
    with pytest.raises(TypeError):
        core.unpack_views(list(packed), ViewFields)  # a list, not the pair pickle gives back
    for view_type in (dict, "NewView", None):
        with pytest.raises(TypeError, match="view_type must be a tuple type"):
            core.unpack_views(packed, view_type)


def test_cython_and_twin_refuse_each_malformed_pack_with_the_same_error() -> None:
    c, py = load_core("cython"), load_core("python")
    new, dropped, chunks = _updates(random.Random(7), 3, 2, 1)
    for bad in [*_malformed(*c.pack_views(new, dropped, chunks)), list(c.pack_views(new, dropped, chunks))]:
        errors = []
        for core in (c, py):
            with pytest.raises((ValueError, TypeError)) as raised:
                core.unpack_views(bad, ViewFields)
            errors.append(raised.type)
        assert errors[0] is errors[1], (bad, errors)
