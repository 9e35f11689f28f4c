"""Pure-Python twin of the D-side heartbeat tracker and message encoder.

Each P engine's tracked ids live in chunks, each chunk encoding to exactly one
``HB:`` message of at most ``max_message_bytes``.  New ids go to the engine's
last chunk; a removal only dirties its own chunk.  A chunk's bytes are cached
and rebuilt only when it changed, so a tick where a few requests came and
went (D's queue is roughly FIFO, so removals cluster in the oldest chunks)
re-encodes a few chunks, not every id.  When removals leave an engine with
more than twice the chunks its bytes need, the engine is repacked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ._wire import HEARTBEAT_PREFIX

DEFAULT_MAX_MESSAGE_BYTES = 8192


def check_remote_id(remote_req_id: object, max_message_bytes: int) -> bytes:
    """Encode a P-side request id for a heartbeat, or raise ValueError."""
    if isinstance(remote_req_id, str):
        raw = remote_req_id.encode("utf-8")
    elif isinstance(remote_req_id, bytes):
        raw = remote_req_id
    else:
        raise TypeError(f"request id must be str or bytes, got {type(remote_req_id).__name__}")
    if not raw:
        raise ValueError("empty request id cannot be heartbeated")
    if b"," in raw:
        raise ValueError(f"request id {remote_req_id!r} contains ',' (the heartbeat separator)")
    if len(HEARTBEAT_PREFIX) + len(raw) > max_message_bytes:
        raise ValueError(
            f"request id of {len(raw)} bytes does not fit a heartbeat message "
            f"of at most {max_message_bytes} bytes"
        )
    return raw


def check_max_message_bytes(max_message_bytes: int) -> int:
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
        raise TypeError("max_message_bytes must be an int")
    if max_message_bytes <= len(HEARTBEAT_PREFIX):
        raise ValueError(f"max_message_bytes must exceed {len(HEARTBEAT_PREFIX)}, got {max_message_bytes}")
    return max_message_bytes


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


class _Chunk:
    __slots__ = ("ids", "size", "message")

    def __init__(self) -> None:
        self.ids: dict[bytes, None] = {}  # ordered set
        self.size = len(HEARTBEAT_PREFIX)  # encoded length
        self.message: bytes | None = None  # cache; None when dirty


class _Engine:
    __slots__ = ("chunks", "where", "refs", "size")

    def __init__(self) -> None:
        self.chunks: list[_Chunk] = []
        self.where: dict[bytes, _Chunk] = {}
        self.refs: dict[bytes, int] = {}  # local requests per remote id
        self.size = 0  # sum of id lengths


class HeartbeatTracker:
    """Which P-side request ids D must keep alive, grouped per P engine.

    ``track`` when a request with a remote prefill enters D's scheduler,
    ``untrack`` when its transfer completes or it ends.  ``poll(now)`` returns
    every engine's messages once per ``interval``.
    """

    __slots__ = ("_interval", "_max", "_engines", "_local", "_last_sent")

    def __init__(self, interval: float, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        interval = float(interval)
        if not (math.isfinite(interval) and interval >= 0):
            raise ValueError(f"heartbeat interval must be a finite number >= 0, got {interval!r}")
        self._interval = interval
        self._max = check_max_message_bytes(max_message_bytes)
        self._engines: dict[str, _Engine] = {}
        self._local: dict[str, tuple[str, bytes]] = {}  # local id -> (engine, remote id)
        self._last_sent: float | None = None

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def max_message_bytes(self) -> int:
        return self._max

    def track(self, local_req_id: str, engine_id: str, remote_req_id: str) -> None:
        if not local_req_id:
            raise ValueError("empty local request id")
        if not engine_id:
            raise ValueError("empty engine id")
        raw = check_remote_id(remote_req_id, self._max)
        old = self._local.get(local_req_id)
        if old is not None:
            if old == (engine_id, raw):
                return
            self.untrack(local_req_id)
        self._local[local_req_id] = (engine_id, raw)
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = self._engines[engine_id] = _Engine()
        refs = engine.refs.get(raw, 0)
        engine.refs[raw] = refs + 1
        if refs:
            return  # already in a message of this engine
        self._append(engine, raw)
        engine.size += len(raw)

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
        chunk.message = None
        engine.size -= len(raw)
        if not chunk.ids:
            engine.chunks.remove(chunk)
            if not engine.chunks:
                del self._engines[engine_id]
        return True

    def engine_of(self, local_req_id: str) -> str | None:
        entry = self._local.get(local_req_id)
        return None if entry is None else entry[0]

    def engines(self) -> list[str]:
        return list(self._engines)

    def ids_for(self, engine_id: str) -> list[bytes]:
        engine = self._engines.get(engine_id)
        return [] if engine is None else list(engine.refs)

    def __len__(self) -> int:
        return len(self._local)

    def __contains__(self, local_req_id: object) -> bool:
        return local_req_id in self._local

    def due(self, now: float) -> bool:
        return self._last_sent is None or now - self._last_sent >= self._interval

    def mark_sent(self, now: float) -> None:
        self._last_sent = float(now)

    def messages_for(self, engine_id: str) -> list[bytes]:
        """The engine's current messages (cached; rebuilt only where changed)."""
        engine = self._engines.get(engine_id)
        if engine is None:
            return []
        if len(engine.chunks) > 1 and len(engine.chunks) > 2 * self._chunks_needed(engine):
            self._repack(engine)
        out = []
        for chunk in engine.chunks:
            if chunk.message is None:
                chunk.message = HEARTBEAT_PREFIX + b",".join(chunk.ids)
            out.append(chunk.message)
        return out

    def messages(self) -> dict[str, list[bytes]]:
        return {engine_id: self.messages_for(engine_id) for engine_id in self._engines}

    def poll(self, now: float) -> dict[str, list[bytes]]:
        """All engines' messages if a heartbeat is due (and mark it sent).
        Nothing tracked means nothing sent, so the throttle is not reset."""
        if not self._engines or not self.due(now):
            return {}
        self.mark_sent(now)
        return self.messages()

    def _chunks_needed(self, engine: _Engine) -> int:
        payload = engine.size + len(engine.refs)  # ids plus separators
        return -(-payload // (self._max - len(HEARTBEAT_PREFIX)))

    def _repack(self, engine: _Engine) -> None:
        ids = [raw for chunk in engine.chunks for raw in chunk.ids]
        engine.chunks = []
        engine.where = {}
        for raw in ids:
            self._append(engine, raw)

    def _append(self, engine: _Engine, raw: bytes) -> None:
        """Put ``raw`` in the engine's last chunk, or a new one if it is full."""
        chunk = engine.chunks[-1] if engine.chunks else None
        need = len(raw) + (1 if chunk is not None and chunk.ids else 0)
        if chunk is None or chunk.size + need > self._max:
            chunk = _Chunk()
            engine.chunks.append(chunk)
            need = len(raw)
        chunk.size += need
        chunk.ids[raw] = None
        chunk.message = None
        engine.where[raw] = chunk
