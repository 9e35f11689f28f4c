"""The lease table's keyed hash and the heartbeat parser that feeds it.

The Cython table hashes ids with its own SipHash-1-3 (random key per table),
four heartbeat ids at a time, and finds commas with a 64-byte bit mask.  These
tests check the hash against the published algorithm (and against CPython's
own SipHash-1-3 where it can be read), and that heartbeats of every shape find
exactly the ids they name, in both implementations.
"""

from __future__ import annotations

import ctypes
import random
import sys

import pytest

MASK = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & MASK


def _round(v: list[int]) -> None:
    v0, v1, v2, v3 = v
    v0 = (v0 + v1) & MASK
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & MASK
    v3 = _rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & MASK
    v3 = _rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & MASK
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    v[:] = [v0, v1, v2, v3]


def siphash13(key: bytes, data: bytes) -> int:
    """SipHash-1-3 as in Aumasson & Bernstein's paper (c=1, d=3), in Python."""
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]
    n8 = len(data) // 8 * 8
    last = int.from_bytes(data[n8:], "little") | (len(data) & 0xFF) << 56
    for w in [int.from_bytes(data[i : i + 8], "little") for i in range(0, n8, 8)] + [last]:
        v[3] ^= w
        _round(v)
        v[0] ^= w
    v[2] ^= 0xFF
    for _ in range(3):
        _round(v)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


@pytest.fixture
def cyhash():
    try:
        from vllm_nixl_lease.prefill._lease_table_c import _siphash13
    except ImportError as exc:
        pytest.skip(f"Cython extension not built: {exc}")
    return _siphash13


def test_siphash13_matches_reference(cyhash):
    rng = random.Random(9)
    for n in list(range(70)) + [255, 256, 1000]:
        key = rng.randbytes(16)
        data = rng.randbytes(n)
        assert cyhash(key, data) == siphash13(key, data), n


def test_siphash13_matches_cpython(cyhash):
    """CPython's bytes hash is SipHash-1-3 under its own secret: same values."""
    if sys.hash_info.algorithm != "siphash13":
        pytest.skip(f"CPython hashes with {sys.hash_info.algorithm}")
    try:
        secret = (ctypes.c_uint8 * 16).in_dll(ctypes.pythonapi, "_Py_HashSecret")
    except ValueError:
        pytest.skip("_Py_HashSecret is not exported by this interpreter")
    key = bytes(secret)
    rng = random.Random(3)
    for n in range(1, 70):
        data = rng.randbytes(n)
        ours = cyhash(key, data)
        theirs = hash(data) & MASK
        # CPython maps -1 (an error marker) to -2
        assert ours == theirs or (ours == MASK and theirs == MASK - 1), n


@pytest.fixture(params=["simd", "portable"])
def lanes(request, core):
    """The Cython table hashes heartbeat ids with AVX2 lanes where the CPU has
    them: run with them and without (a no-op for the twin)."""
    if core.name != "cython":
        yield request.param
        return
    from vllm_nixl_lease.prefill import _lease_table_c

    if request.param == "simd" and not _lease_table_c._set_simd(True):
        pytest.skip("no AVX2 on this CPU")
    _lease_table_c._set_simd(request.param == "simd")
    yield request.param
    _lease_table_c._set_simd(True)


def test_heartbeats_of_every_shape(core, lanes):
    """Ids of 1..80 bytes (ASCII and not), empty ids, commas on both sides of
    every 64-byte boundary, unknown ids and prefixes of known ones: each
    payload form extends exactly the granted ids it names."""
    rng = random.Random(5)
    alphabet = "abcxyz0123456789-é€"
    ids = sorted({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(400)})
    # and ids of 16..23 bytes: four of them share a word count (the SIMD lanes' case)
    same = sorted({f"s-{rng.randrange(10**12)}" + "x" * rng.randint(0, 7) for _ in range(100)} - set(ids))
    ids += same
    granted = set(ids[::2])
    t = core.LeaseTable(10.0)
    for rid in granted:
        t.grant(rid, 1.0)
    now = 1.0
    for trial in range(60):
        pool = same if trial % 2 else ids
        names = rng.sample(pool, rng.randint(0, min(60, len(pool))))
        names += [n[:-1] for n in names[:3] if len(n) > 1]  # prefixes: almost the same bytes
        parts = []
        for name in names:
            parts.append(name)
            parts += [""] * rng.choice([0, 0, 0, 1, 2])
        rng.shuffle(parts)
        text = ",".join(parts)
        want_ext = sum(1 for p in parts if p in granted)
        want_seen = sum(1 for p in parts if p)
        raw = text.encode()
        # a buffer with bytes after the payload: they must not leak into the last id
        tail = memoryview(raw + b"x" * 9)[: len(raw)]
        for payload in (text, raw, bytearray(raw), tail):
            now += 1.0
            assert t.extend_counted(payload, now) == (want_ext, want_seen), (trial, type(payload))
            for p in parts:
                if p in granted:
                    assert t.deadline(p) == now + 10.0


def test_heartbeat_with_forced_collisions(core, lanes):
    """One hash bit: every lookup walks a long probe chain, in groups."""
    t = core.LeaseTable(5.0, _hash_bits=1)
    ids = [f"c-{i}" * (1 + i % 7) for i in range(200)]
    for rid in ids[::2]:
        t.grant(rid, 1.0)
    assert t.extend_counted(",".join(ids), 2.0) == (100, 200)
    assert all(t.deadline(r) == 7.0 for r in ids[::2])
