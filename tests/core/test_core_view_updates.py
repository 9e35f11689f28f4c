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
        text, numbers = core.pack_views({}, [], {})
        assert text == "" and numbers == bytes(24)
        assert core.unpack_views((text, numbers), ViewFields) == ({}, [], {})


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


def _malformed(text: str, numbers: bytes) -> list[Any]:
    header = numbers[:24]
    at = len(numbers) - 8 * _strings(numbers)  # the first string's length

    def first_length(value: int) -> bytes:
        return numbers[:at] + value.to_bytes(8, "little") + numbers[at + 8 :]

    return [
        ("not", "a pack"),
        (list(text), numbers),  # text not a str
        (text.encode(), numbers),  # text as bytes
        (text, bytearray(numbers)),  # numbers not bytes
        (text, numbers[:23]),  # no whole header
        (text, numbers[:-1]),  # a length cut short
        (text, numbers + b"\0"),  # trailing bytes
        (text, numbers[:-8]),  # a string's length missing
        (text[:-1], numbers),  # the text a code point short
        (text + "x", numbers),  # the text a code point long
        (text, (2**62).to_bytes(8, "little") + header[8:] + numbers[24:]),  # a count past the size
        (text, (2**64 - 1).to_bytes(8, "little") + header[8:] + numbers[24:]),  # a negative count
        (text, header[:8] + (2**63 - 1).to_bytes(8, "little") + numbers[16:]),  # dropped past the size
        # a negative length, then one past the text
        (text, first_length(2**64 - 1)),
        (text, first_length(len(text) + 1)),
        ("", numbers),  # no text for the strings' lengths
    ]


def _strings(numbers: bytes) -> int:
    n_new, n_dropped, n_repacked = (int.from_bytes(numbers[i : i + 8], "little") for i in (0, 8, 16))
    return 4 * n_new + n_dropped + n_repacked


def test_malformed_packs_are_refused(core: types.SimpleNamespace) -> None:
    new, dropped, chunks = _updates(random.Random(7), 3, 2, 1)
    text, numbers = core.pack_views(new, dropped, chunks)
    for bad in _malformed(text, numbers):
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


def test_any_str_comes_back_whole(core: types.SimpleNamespace) -> None:
    """Ids are split by their lengths, not by a separator: NULs, commas, lone surrogates
    (a JSON request id may carry one), astral characters and empty strings survive."""
    odd = ["", "a\x00b", "x,y", "\ud800lone", "\U0001f600", "é" * 3, "\x00"]
    new = {f"d{i}{s}": ViewFields(s, s, s + "n", 1.0, 2.0, None, 1) for i, s in enumerate(odd)}
    dropped = [s + "gone" for s in odd] + odd
    chunks = {"\ud800old": (1, 2), "": (3, 4)}
    packed = pickle.loads(pickle.dumps(core.pack_views(new, dropped, chunks), protocol=5))
    got_new, got_dropped, got_chunks = core.unpack_views(packed, ViewFields)
    assert _same_views(got_new, new) and got_dropped == dropped and got_chunks == chunks


def test_a_string_that_is_not_a_str_is_refused_alike() -> None:
    c, py = load_core("cython"), load_core("python")
    view = ViewFields("P0", "", "n", 1.0, 2.0, None, 1)
    for bad in (
        ({"d1": view}, [7], {}),
        ({"d1": view}, [b"d2"], {}),
        ({"d1": ViewFields(None, "", "n", 1.0, 2.0, None, 1)}, [], {}),
        ({("d", 1): view}, [], {}),
        ({"d1": view}, [], {5: (1, 1)}),
    ):
        for core in (c, py):
            with pytest.raises(TypeError):
                core.pack_views(*bad)
