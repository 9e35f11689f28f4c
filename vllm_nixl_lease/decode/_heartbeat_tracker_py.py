"""Pure-Python twin of the D-side heartbeat tracker and message encoder.

Each P engine's tracked ids live in chunks, each chunk encoding to exactly one
``HB:`` message of at most ``max_message_bytes``.  New ids go to the engine's
last chunk; a removal only dirties its own chunk.  A chunk's bytes are cached
and rebuilt only when it changed, so a tick where a few requests came and
went (D's queue is roughly FIFO, so removals cluster in the oldest chunks)
re-encodes a few chunks, not every id.  When removals leave an engine with
more than twice the chunks its bytes need, the engine is repacked.

Sending is paced: ``poll_paced_chunks(now)`` spreads a round of every chunk
over the interval, chunk by chunk, where upstream sends every id at once
each interval and nothing in between.  Each chunk carries a due time,
``interval`` after its last send; a new chunk (or a repacked one holding a
never-sent id) is due at once.  A call sends every due chunk, then early, in
due order, as many more as keep the pace at (chunks / interval) per second,
so after the first round the sends are spread evenly and no chunk waits for
its due time.  ``phase`` (in [0, 1)) is the credit a new round starts with
after sending its never-sent chunks at once: D engines that got their
requests together (a burst the router spread over them) then send at
different moments of each share of the interval instead of all at once; it
only ever makes a send earlier.  What that promises: each id goes out at most
``interval`` after its previous send; an id's first send is no later than
``interval`` after it was tracked (upstream's worst case), and at the next
call when it opened a new chunk.  With ``interval`` 0 every chunk goes out at
every call.

A small round goes whole: while every chunk's message adds up to at most
``round_bytes`` (0: never), a call that finds any chunk due sends every chunk
and none goes early, so a small queue costs one sending step per interval
instead of one per chunk (pacing exists to keep a large round's bytes out of
one step).  Sending a chunk before its due time keeps the promise above.

Chunks have a key (unique in the tracker) and a version, bumped by every
change to their ids and by every ``track`` of an id they hold.  A message
built at version ``v`` names exactly the ids the chunk held at ``v``, so an
acknowledgement of it can renew "every id of chunk ``key`` that joined at or
before ``v``" at once (``lease_views.py``), and an id tracked (again) later
is never renewed by an older message.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

from .._checks import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_interval,
    check_max_message_bytes,
    check_pace_phase,
    check_remote_id,
    check_round_bytes,
)
from .._wire import HEARTBEAT_PREFIX


def encode_heartbeats(ids: Iterable[str | bytes], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[bytes]:
    """Pack ids, in order, into as few ``HB:a,b,...`` messages of at most
    ``max_bytes`` as greedy packing gives.  Raises ValueError for an id that is
    empty, contains ',' or cannot fit one message."""
    max_bytes = check_max_message_bytes(max_bytes)
    messages: list[bytes] = []
    current: list[bytes] = []
    size = len(HEARTBEAT_PREFIX)
    for req_id in ids:
        raw = check_remote_id(req_id, max_bytes)
        need = len(raw) + (1 if current else 0)
        if size + need > max_bytes:
            messages.append(HEARTBEAT_PREFIX + b",".join(current))
            current, size, need = [], len(HEARTBEAT_PREFIX), len(raw)
        current.append(raw)
        size += need
    if current:
        messages.append(HEARTBEAT_PREFIX + b",".join(current))
    return messages


_NOW = -math.inf  # due time of a chunk that must go out at the next paced poll


class _Chunk:
    __slots__ = ("ids", "size", "message", "engine_id", "due", "alive", "key", "version")

    def __init__(self, engine_id: str, key: int, due: float = _NOW) -> None:
        self.ids: dict[bytes, None] = {}  # ordered set
        self.size = len(HEARTBEAT_PREFIX)  # encoded length
        self.message: bytes | None = None  # cache; None when dirty
        self.engine_id = engine_id
        self.due = due  # paced sending: send by then
        self.alive = True  # False once removed (its heap entries are stale)
        self.key = key
        self.version = 0  # bumped by each change to ids (and each track of one)

    def touch(self) -> None:
        self.version += 1
        self.message = None


class _Engine:
    __slots__ = ("engine_id", "chunks", "where", "refs", "size")

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.chunks: list[_Chunk] = []
        self.where: dict[bytes, _Chunk] = {}
        self.refs: dict[bytes, int] = {}  # local requests per remote id
        self.size = 0  # sum of id lengths


class HeartbeatTracker:
    """Which P-side request ids D must keep alive, grouped per P engine.

    ``track`` when a request with a remote prefill enters D's scheduler,
    ``untrack`` when its transfer completes or it ends.
    ``poll_paced_chunks(now)`` returns the chunks due or next in line, so that
    each goes out once per ``interval``.
    """

    __slots__ = (
        "_interval",
        "_max",
        "_engines",
        "_local",
        "_heap",
        "_pushes",
        "_chunks",
        "_paced_at",
        "_credit",
        "_phase",
        "next_poll_at",
        "_keys",
        "_repacks",
        "_round_bytes",
        "_payload",
    )

    def __init__(
        self,
        interval: float,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        phase: float = 0.0,
        round_bytes: int = 0,
    ) -> None:
        self._interval = check_interval(interval)
        self._round_bytes = check_round_bytes(round_bytes)
        self._payload = 0  # distinct ids' bytes plus one separator each, all engines
        self._max = check_max_message_bytes(max_message_bytes)
        self._phase = check_pace_phase(phase)
        self._engines: dict[str, _Engine] = {}
        self._local: dict[str, tuple[str, bytes]] = {}  # local id -> (engine, remote id)
        # Paced sending: (due, push count, chunk), stale entries skipped.
        self._heap: list[tuple[float, int, _Chunk]] = []
        self._pushes = 0
        self._chunks = 0  # live chunks, all engines
        self._paced_at: float | None = None  # last poll_paced_chunks
        self._credit = self._phase  # early sends earned and not yet made
        # No poll before this sends anything: callers may skip them (see poll_paced_chunks).
        self.next_poll_at = _NOW
        self._keys = 0  # chunk keys handed out
        self._repacks = 0

    def track(self, local_req_id: str, engine_id: str, remote_req_id: str) -> None:
        if not local_req_id:
            raise ValueError("empty local request id")
        if not engine_id:
            raise ValueError("empty engine id")
        raw = check_remote_id(remote_req_id, self._max)
        old = self._local.get(local_req_id)
        if old is not None:
            if old == (engine_id, raw):
                self._engines[engine_id].where[raw].touch()  # a new joiner: see chunk_of
                return
            self.untrack(local_req_id)
        self._local[local_req_id] = (engine_id, raw)
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = self._engines[engine_id] = _Engine(engine_id)
        refs = engine.refs.get(raw, 0)
        engine.refs[raw] = refs + 1
        if refs:
            engine.where[raw].touch()  # already in a message of this engine; a new joiner
            return
        small = self._small_round()
        self._append(engine, raw)
        engine.size += len(raw)
        self._payload += len(raw) + 1
        if small and not self._small_round():
            self.next_poll_at = _NOW  # the round outgrew the budget: paced from the next poll

    def untrack(self, local_req_id: str) -> bool:
        entry = self._local.pop(local_req_id, None)
        if entry is None:
            return False
        engine_id, raw = entry
        engine = self._engines[engine_id]
        refs = engine.refs[raw] - 1
        if refs:
            engine.refs[raw] = refs
            return True
        del engine.refs[raw]
        chunk = engine.where.pop(raw)
        del chunk.ids[raw]
        chunk.size -= len(raw) + (1 if chunk.ids else 0)
        chunk.touch()
        engine.size -= len(raw)
        self._payload -= len(raw) + 1
        if not chunk.ids:
            engine.chunks.remove(chunk)
            chunk.alive = False
            self._chunks -= 1
            self.next_poll_at = _NOW  # the pace changed
            if not engine.chunks:
                del self._engines[engine_id]
                return True
        if len(engine.chunks) > 1 and len(engine.chunks) > 2 * self._chunks_needed(engine):
            self._repack(engine)
        return True

    def chunk_of(self, local_req_id: str) -> tuple[int, int] | None:
        """``(key, version)`` of the chunk now naming ``local_req_id``'s remote id;
        a message of that chunk at ``version`` or later names it."""
        entry = self._local.get(local_req_id)
        if entry is None:
            return None
        chunk = self._engines[entry[0]].where[entry[1]]
        return chunk.key, chunk.version

    @property
    def repacks(self) -> int:
        """How many times an engine's ids were repacked (moved to new chunks)."""
        return self._repacks

    def engine_of(self, local_req_id: str) -> str | None:
        entry = self._local.get(local_req_id)
        return None if entry is None else entry[0]

    def engines(self) -> list[str]:
        return list(self._engines)

    def has_engine(self, engine_id: str) -> bool:
        """``engine_id in engines()``, without the list (the intake asks once per departure)."""
        return engine_id in self._engines

    def __len__(self) -> int:
        return len(self._local)

    def __contains__(self, local_req_id: object) -> bool:
        return local_req_id in self._local

    def poll_paced_chunks(self, now: float) -> dict[str, list[tuple[int, int, bytes, int]]]:
        """The messages of the chunks due by ``now``, then of as many chunks
        next in due order as keep the pace (see the module docstring), per
        engine, each with its chunk and how many names it carries: ``(key,
        version, message, names)`` (the sender need not count them).  Each sent
        chunk is due again ``interval`` later.

        Afterwards ``next_poll_at`` is the earliest time a call can send
        anything (a chunk falls due, or the pace earns a send) until the
        chunks change; a caller may skip the calls before it (each costs a
        step's cold cache): the credit a skipped call would have added, the
        next call adds."""
        now = float(now)
        elapsed = 0.0 if self._paced_at is None else max(0.0, now - self._paced_at)
        self._paced_at = now
        if self._interval > 0:
            credit = min(self._credit + self._chunks * elapsed / self._interval, float(self._chunks))
        else:
            credit = float(self._chunks)  # every chunk every call
        out: dict[str, list[tuple[int, int, bytes, int]]] = {}
        sent: list[_Chunk] = []
        heap = self._heap
        fresh = False  # a never-sent chunk among them: a new round starts
        while heap and heap[0][0] <= now:  # due: sent whatever the pace
            due, _, chunk = heapq.heappop(heap)
            if chunk.alive and chunk.due == due:
                self._emit(out, chunk)
                sent.append(chunk)
                fresh = fresh or due == _NOW
        small = self._small_round()
        if small:  # a due chunk takes the whole round with it; nothing goes early otherwise
            credit = float(self._chunks) if sent else 0.0
        else:
            # They count toward the pace; a new round's early sends start at the phase.
            credit = max(self._phase if fresh else 0.0, credit - len(sent))
        while heap and credit >= 1:  # early, to keep the pace
            due, _, chunk = heapq.heappop(heap)
            if chunk.alive and chunk.due == due:
                self._emit(out, chunk)
                sent.append(chunk)
                credit -= 1
        self._credit = credit
        next_due = now + self._interval
        for chunk in sent:  # after the loops: with interval 0, once per call
            self._schedule(chunk, next_due)
        if small:
            self._credit = 0.0  # pacing, should the round grow, starts afresh
            heap = self._heap
            self.next_poll_at = heap[0][0] if self._interval > 0 and heap else _NOW
        elif self._interval > 0 and self._chunks:
            credit_at = now + (1.0 - credit) * self._interval / self._chunks
            heap = self._heap  # _schedule may have rebuilt it
            self.next_poll_at = min(heap[0][0], credit_at) if heap else credit_at
        else:
            self.next_poll_at = _NOW
        return out

    def _small_round(self) -> bool:
        """Every chunk's message together fits ``round_bytes`` (each at most
        ``len(HEARTBEAT_PREFIX)`` plus its ids and separators)."""
        return 0 < self._payload + self._chunks * len(HEARTBEAT_PREFIX) <= self._round_bytes

    def _emit(self, out: dict[str, list[tuple[int, int, bytes, int]]], chunk: _Chunk) -> None:
        if chunk.message is None:
            chunk.message = HEARTBEAT_PREFIX + b",".join(chunk.ids)
        item = (chunk.key, chunk.version, chunk.message, len(chunk.ids))
        msgs = out.get(chunk.engine_id)
        if msgs is None:
            out[chunk.engine_id] = [item]
        else:
            msgs.append(item)

    def _schedule(self, chunk: _Chunk, due: float) -> None:
        chunk.due = due
        self.next_poll_at = _NOW
        self._pushes += 1
        heap = self._heap
        if len(heap) > 2 * self._chunks + 64:
            # Mostly stale entries (of removed or repacked chunks): rebuild from the live chunks.
            heap = self._heap = [
                (c.due, i, c) for i, c in enumerate(c for e in self._engines.values() for c in e.chunks)
            ]
            heapq.heapify(heap)
            return  # ``chunk`` is live, so in it with its new due time
        heapq.heappush(heap, (due, self._pushes, chunk))

    def _chunks_needed(self, engine: _Engine) -> int:
        payload = engine.size + len(engine.refs)  # ids plus separators
        return -(-payload // (self._max - len(HEARTBEAT_PREFIX)))

    def _repack(self, engine: _Engine) -> None:
        # The new chunks are due when the earliest old one was: no id waits
        # longer than its own chunk would have made it.
        due = min(chunk.due for chunk in engine.chunks)
        ids = [raw for chunk in engine.chunks for raw in chunk.ids]
        for chunk in engine.chunks:
            chunk.alive = False
        self._chunks -= len(engine.chunks)
        self._repacks += 1
        engine.chunks = []
        engine.where = {}
        for raw in ids:
            self._append(engine, raw, due)

    def _append(self, engine: _Engine, raw: bytes, new_due: float = _NOW) -> None:
        """Put ``raw`` in the engine's last chunk, or a new one (due at
        ``new_due``) if it is full."""
        chunk = engine.chunks[-1] if engine.chunks else None
        need = len(raw) + (1 if chunk is not None and chunk.ids else 0)
        if chunk is None or chunk.size + need > self._max:
            self._keys += 1
            chunk = _Chunk(engine.engine_id, self._keys)
            engine.chunks.append(chunk)
            self._chunks += 1
            self._schedule(chunk, new_due)
            need = len(raw)
        chunk.size += need
        chunk.ids[raw] = None
        chunk.touch()
        engine.where[raw] = chunk
