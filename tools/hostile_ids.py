"""Request ids crafted to collide under MurmurHash64A, the lease core's old hash.

Two families, both sharing one full 64-bit hash:

- ``fixed_seed_ids``: printable-ASCII ids aimed at the old core's fixed seed.
  MurmurHash64A is invertible block by block: after a random middle block
  the state is known, so the last block that lands on a chosen hash can be
  solved for; about one solution in 3,300 is printable ASCII (numpy search).
- ``seed_free_ids``: ids that collide under *every* seed, so a random seed per
  process would not help either.  Flipping the top bit of ``mix(k)`` flips only
  the top bit of the state whatever the state was (xor 2**63 is addition of
  2**63, and m is odd), and a second flip cancels it.  With one pair of blocks
  ``k``, ``k'`` (``mix(k') == mix(k) ^ 2**63``) every string of n blocks from
  {k, k'} with an even number of ``k'`` collides: 2**(n-1) ids.  No printable
  ASCII pair exists for this difference, but UTF-8 pairs do (request ids are
  JSON strings, so non-ASCII is allowed); a non-ASCII prefix is put in front.

Against the current core (SipHash-1-3 under a random key per table) these are ordinary ids;
``tools/bench_core.py`` shows that by timing them against look-alike random
ids of the same shape.
"""

from __future__ import annotations

import random

M = 0xC6A4A7935BD1E995
R = 47
MASK = (1 << 64) - 1
M_INV = pow(M, -1, 1 << 64)
TOP = 1 << 63
PRINTABLE = bytes(c for c in range(0x21, 0x7F) if c not in b',"\\')  # no separator, no JSON escape
OLD_SEED = 0x9E3779B97F4A7C15  # the old core's fixed seed, the one these ids are aimed at

ASCII_PREFIX = "cmpl-hx-"  # 8 bytes: blocks stay aligned
NON_ASCII_PREFIX = "réq-ü-"  # 8 UTF-8 bytes (6 characters)


def _mix(k: int) -> int:
    k = k * M & MASK
    k ^= k >> R
    return k * M & MASK


def _unmix(x: int) -> int:
    k = x * M_INV & MASK
    k ^= k >> R  # R >= 32: the xorshift is its own inverse
    return k * M_INV & MASK


def murmur64a(data: bytes, seed: int) -> int:
    """Reference MurmurHash64A (Austin Appleby), as the old core used it."""
    h = (seed ^ (len(data) * M)) & MASK
    n8 = len(data) // 8 * 8
    for i in range(0, n8, 8):
        h = ((h ^ _mix(int.from_bytes(data[i : i + 8], "little"))) * M) & MASK
    tail = data[n8:]
    if tail:
        h = ((h ^ int.from_bytes(tail, "little")) * M) & MASK
    h ^= h >> R
    h = h * M & MASK
    return h ^ (h >> R)


def _block_pair(rng: random.Random) -> tuple[bytes, bytes]:
    while True:
        k = bytes(rng.choice(PRINTABLE) for _ in range(8))
        k2 = _unmix(_mix(int.from_bytes(k, "little")) ^ TOP).to_bytes(8, "little")
        try:
            k2.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if b"," not in k2 and min(k2) >= 0x20 and 0x7F not in k2:
            return k, k2


def seed_free_ids(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct ids with one MurmurHash64A value under any seed."""
    rng = random.Random(seed)
    k, k2 = _block_pair(rng)
    blocks = 1
    while 1 << (blocks - 1) < count:
        blocks += 1
    out = []
    for i in range(count):
        bits = [(i >> b) & 1 for b in range(blocks - 1)]
        bits.append(sum(bits) & 1)  # even number of k' blocks
        out.append(NON_ASCII_PREFIX + b"".join(k2 if bit else k for bit in bits).decode())
    return out


def _step(h: int, block: bytes) -> int:
    return ((h ^ _mix(int.from_bytes(block, "little"))) * M) & MASK


def fixed_seed_ids(count: int, seed: int = 0) -> list[str]:
    """``count`` printable-ASCII ids with one MurmurHash64A value under the
    old core's seed.  The state is known block by block, so from each unit's
    start state four 16-byte units reaching one end state are built (a random
    first block, then the second block solved for; about one solution in
    4,000 is printable).  Units chain: 4**units colliding ids."""
    rng = random.Random(seed)
    units = 1
    while 4**units < count:
        units += 1
    length = len(ASCII_PREFIX) + 16 * units
    h = _step((OLD_SEED ^ (length * M)) & MASK, ASCII_PREFIX.encode())
    options = []
    for _ in range(units):
        first = bytes(rng.choice(PRINTABLE) for _ in range(8))
        second = bytes(rng.choice(PRINTABLE) for _ in range(8))
        end = _step(_step(h, first), second)
        unit = [first + second]
        while len(unit) < 4:
            first = bytes(rng.choice(PRINTABLE) for _ in range(8))
            need = _unmix(((end * M_INV) & MASK) ^ _step(h, first)).to_bytes(8, "little")
            if all(c in PRINTABLE for c in need):
                unit.append(first + need)
        options.append(unit)
        h = end
    out = []
    for i in range(count):
        out.append(ASCII_PREFIX + b"".join(options[u][(i >> (2 * u)) & 3] for u in range(units)).decode())
    return out


def lookalike_ids(ids: list[str], seed: int = 1) -> list[str]:
    """Random ids of the same shape: each character after the prefix replaced
    by a random one of the same UTF-8 length."""
    rng = random.Random(seed)
    one = "".join(chr(c) for c in PRINTABLE)
    two = "".join(chr(c) for c in range(0xA1, 0x7FF))
    three = "".join(chr(c) for c in range(0x800, 0xD7FF, 7))
    pools = {1: one, 2: two, 3: three}
    out = []
    for rid in ids:
        cut = len(NON_ASCII_PREFIX) if rid.startswith(NON_ASCII_PREFIX) else len(ASCII_PREFIX)
        prefix, body = rid[:cut], rid[cut:]
        shape = [len(c.encode()) for c in body]
        out.append(prefix + "".join(rng.choice(pools[n]) for n in shape))
    return out
