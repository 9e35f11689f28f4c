"""D's lease view updates packed for the trip from the scheduler to its
workers: the reference for ``_view_updates_c.pyx`` (identical output).

A step's updates (``adapter/metadata.py``'s ``LeaseViewUpdates``) are the new
views by local request id, the local ids whose views ended, and the heartbeat
chunk ``(key, version)`` of new views and of views whose names were repacked.
vLLM's multiprocess executor pickles them every step for every worker.  As
dicts of tuples, pickling costs a Python-level call and a tuple per view on
each side; as a list of strings, a memo entry and an object per string.  Packed,
they are one ``str`` and one ``bytes``:

- ``text``: the strings one after another: for each new view its local id,
  P engine id, instance and name; then the dropped local ids; then the local
  ids of repacked views.
- ``numbers``, little-endian: a header of three int64 (new views, dropped ids,
  repacked views); for each new view its deadline, extension and interval
  (NaN: P named none) as float64 and its hello version, chunk key and chunk
  version as int64 (key and version -1: no chunk); for each repacked view its
  chunk key and version as int64; then the length of each string of ``text``
  (in code points, as ``len``) as int64.

Packing and unpacking keep the order of every mapping, so a worker sees the
same updates as the scheduler built.  A malformed pack raises ``ValueError``;
a string that is not a ``str`` is refused with ``TypeError`` when packing.
"""

from __future__ import annotations

import math
import struct
from typing import Any

_HEADER = struct.Struct("<qqq")
_NEW = struct.Struct("<dddqqq")
_CHUNK = struct.Struct("<qq")
_LENGTH = 8  # int64 per string
NO_CHUNK = (-1, -1)

Packed = tuple[str, bytes]


def _typed(**args: tuple[object, type]) -> None:
    """The argument types the Cython module declares: exactly these (it refuses
    others, subclasses included, with TypeError)."""
    for name, (value, kind) in args.items():
        if type(value) is not kind:
            raise TypeError(f"argument {name!r} must be {kind.__name__}, not {type(value).__name__}")


def pack_views(new: dict[str, Any], dropped: list[str], chunks: dict[str, tuple[int, int]]) -> Packed:
    """``(text, numbers)`` for ``new`` (local id -> a NewView-shaped tuple:
    engine id, instance, name, deadline, extension, interval, hello version),
    ``dropped`` and ``chunks`` (local id -> chunk; those of ids not in ``new``
    are the repacked views')."""
    _typed(new=(new, dict), dropped=(dropped, list), chunks=(chunks, dict))
    repacked = [local_id for local_id in chunks if local_id not in new]
    numbers = bytearray(_HEADER.size + _NEW.size * len(new) + _CHUNK.size * len(repacked))
    _HEADER.pack_into(numbers, 0, len(new), len(dropped), len(repacked))
    strings: list[str] = []
    at = _HEADER.size
    for local_id, view in new.items():
        if not isinstance(view, tuple) or len(view) < 7:
            raise ValueError(f"view of {local_id!r} is not a NewView: {view!r}")
        engine_id, instance, name, deadline, extension, interval, hello_version = view[:7]
        strings += (local_id, engine_id, instance, name)
        key, version = chunks.get(local_id, NO_CHUNK)
        interval = math.nan if interval is None else interval
        _NEW.pack_into(numbers, at, deadline, extension, interval, hello_version, key, version)
        at += _NEW.size
    strings += dropped
    for local_id in repacked:
        _CHUNK.pack_into(numbers, at, *chunks[local_id])
        at += _CHUNK.size
    strings += repacked
    text = "".join(strings)  # TypeError for a string that is not a str
    lengths = [len(string) for string in strings]
    return text, bytes(numbers) + struct.pack(f"<{len(lengths)}q", *lengths)


def unpack_views(
    packed: Packed, view_type: Any
) -> tuple[dict[str, Any], list[str], dict[str, tuple[int, int]]]:
    """``(new, dropped, chunks)`` as ``pack_views`` took them, each new view a
    ``view_type`` (a NamedTuple of the seven fields)."""
    _typed(packed=(packed, tuple))
    text, numbers = packed
    if type(text) is not str or type(numbers) is not bytes or len(numbers) < _HEADER.size:
        raise ValueError("malformed view updates: not (str, bytes)")
    n_new, n_dropped, n_repacked = _HEADER.unpack_from(numbers, 0)
    n_strings = 4 * n_new + n_dropped + n_repacked
    at_lengths = _HEADER.size + _NEW.size * n_new + _CHUNK.size * n_repacked
    if min(n_new, n_dropped, n_repacked) < 0 or len(numbers) != at_lengths + _LENGTH * n_strings:
        raise ValueError("malformed view updates: counts do not match")
    strings: list[str] = []
    start = 0
    for (length,) in struct.iter_unpack("<q", numbers[at_lengths:]):
        if length < 0 or start + length > len(text):
            raise ValueError("malformed view updates: string lengths do not match the text")
        strings.append(text[start : start + length])
        start += length
    if start != len(text):
        raise ValueError("malformed view updates: string lengths do not match the text")
    if not (isinstance(view_type, type) and issubclass(view_type, tuple)):
        raise TypeError(f"view_type must be a tuple type, not {view_type!r}")
    new: dict[str, Any] = {}
    chunks: dict[str, tuple[int, int]] = {}
    at = _HEADER.size
    for i in range(0, 4 * n_new, 4):
        local_id, engine_id, instance, name = strings[i : i + 4]
        deadline, extension, interval, hello_version, key, version = _NEW.unpack_from(numbers, at)
        at += _NEW.size
        interval = None if math.isnan(interval) else interval
        fields = (engine_id, instance, name, deadline, extension, interval, hello_version)
        new[local_id] = tuple.__new__(view_type, fields)
        if key >= 0:
            chunks[local_id] = (key, version)
    dropped = strings[4 * n_new : 4 * n_new + n_dropped]
    for local_id in strings[4 * n_new + n_dropped :]:
        chunks[local_id] = _CHUNK.unpack_from(numbers, at)
        at += _CHUNK.size
    return new, dropped, chunks
