"""D's acknowledged heartbeats still waiting for P's answer, and what an answer proves.

Why acknowledgements: a heartbeat whose ``send_notif`` returned has not
reached P.  Under a partition UCX queues it and delivers it after the heal,
when P may long have freed the blocks; a D that renewed its view on the send
then reads someone else's KV.  So D renews a view only when P says it
applied the heartbeat:

- D sends ``HB:,LHB:<seq>,<ids>`` to every P rank of an engine at local time
  ``started`` and records ``seq`` here, with the P process whose leases it names;
- each P rank extends the leases it holds (to at least its arrival time plus
  the extension) and answers ``LACK:<instance>:<seq>`` naming the ids it did
  not hold (or held ambiguously: a reused id, a colliding tag);
- once every rank has answered, each id no rank disowned was leased on every
  rank when the heartbeat arrived, which was after ``started``: its lease ends
  no earlier than ``started + extension``, whatever the delays were.

Late, duplicated, reordered or lost answers cannot break this: an answer only
ever proves something about the send it names, a second answer from the same
rank is ignored, and a lost one only leaves the view where it was (D may then
fence a read it could have made: safe, and counted).

No vLLM imports: ``adapter/d_worker/ack_requester.py`` feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Sent:
    engine_id: str
    payload: bytes  # the heartbeat's comma-joined ids
    started: float  # D's clock, before the first send
    waiting: set[str]  # P agents that have not answered yet
    not_extended: set[str] = field(default_factory=set)
    none_extended: bool = False
    chunk: tuple[int, int] | None = None  # (key, version) of the tracker chunk it encodes
    count: int = 0  # ids a chunk heartbeat named
    instance: str = ""  # the P process its leases belong to


@dataclass(slots=True, frozen=True)
class Proven:
    """What a complete set of answers proves: each of ``remote_ids`` is leased
    on P until at least ``started`` plus P's extension (D's clock)."""

    engine_id: str
    remote_ids: list[str]
    started: float
    # For a heartbeat built from a tracker chunk: ``(key, version)``; then
    # ``remote_ids`` is empty (the chunk stands for its ids, see
    # ``lease_views.py``).
    chunk: tuple[int, int] | None = None
    # The ids some rank said it did not hold (their views end).
    not_extended: frozenset[str] = frozenset()
    count: int = 0  # ids the chunk heartbeat named
    instance: str = ""  # the P process that proved it


class AckLedger:
    """Acknowledged heartbeats in flight, by sequence number."""

    def __init__(self, first_seq: int = 1) -> None:
        self._next = first_seq
        self._sent: dict[int, _Sent] = {}  # insertion order == seq order == send order

    def __len__(self) -> int:
        return len(self._sent)

    def open(
        self,
        engine_id: str,
        agents: Iterable[str],
        payload: bytes,
        started: float,
        chunk: tuple[int, int] | None = None,
        count: int | None = None,
        *,
        instance: str = "",
    ) -> int:
        """Record a heartbeat about to be sent to ``agents``; return its sequence
        number.  ``chunk``: the tracker chunk ``(key, version)`` it encodes;
        then only the payload's id count is kept (the answer proves the chunk,
        not a list).  ``count``: that id count, if the caller has it already.
        ``instance``: the P process whose leases it names."""
        seq = self._next
        self._next += 1
        waiting = set(agents)
        if waiting:
            if chunk is None:
                self._sent[seq] = _Sent(engine_id, bytes(payload), started, waiting, instance=instance)
            else:
                if count is None:
                    count = payload.count(b",") + 1 if payload else 0
                self._sent[seq] = _Sent(
                    engine_id, b"", started, waiting, chunk=chunk, count=count, instance=instance
                )
        return seq

    def answered(
        self, agent: str, seq: int, not_extended: frozenset[str] | None, instance: str | None = None
    ) -> Proven | None:
        """Take ``agent``'s answer to ``seq`` (``not_extended`` None: count none
        as extended).  ``instance``: the P process that answered; an answer from
        another process than the one whose leases the heartbeat named proves
        nothing about them.  Returns what is proven once the last agent has
        answered; None while answers are missing, and for an unknown, pruned or
        repeated answer."""
        sent = self._sent.get(seq)
        if sent is None or agent not in sent.waiting:
            return None
        sent.waiting.discard(agent)
        if not_extended is None or (instance is not None and instance != sent.instance):
            sent.none_extended = True
        else:
            sent.not_extended.update(not_extended)
        if sent.waiting:
            return None
        del self._sent[seq]
        if sent.chunk is not None:
            if sent.none_extended:
                return Proven(sent.engine_id, [], sent.started, instance=sent.instance)
            return Proven(
                sent.engine_id,
                [],
                sent.started,
                sent.chunk,
                frozenset(sent.not_extended),
                sent.count,
                sent.instance,
            )
        if sent.none_extended or not sent.payload:
            return Proven(sent.engine_id, [], sent.started, instance=sent.instance)
        try:
            ids = sent.payload.decode("utf-8").split(",")
        except UnicodeDecodeError:
            ids = []
        skip = sent.not_extended
        kept = [i for i in ids if i not in skip] if skip else ids
        return Proven(
            sent.engine_id, kept, sent.started, not_extended=frozenset(skip), instance=sent.instance
        )

    def forget_engines(self, keep: set[str]) -> int:
        """Forget heartbeats to engines not in ``keep`` (released: their answers
        would come from agents of no connection, and be ignored)."""
        gone = [seq for seq, sent in self._sent.items() if sent.engine_id not in keep]
        for seq in gone:
            del self._sent[seq]
        return len(gone)

    def prune(self, sent_before: float) -> int:
        """Forget heartbeats sent before ``sent_before`` (an answer to them
        could no longer move a view); return how many were forgotten."""
        dropped = 0
        sent_by_seq = self._sent
        while sent_by_seq:
            seq = next(iter(sent_by_seq))  # the oldest: seqs are opened in time order
            if sent_by_seq[seq].started >= sent_before:
                break
            del sent_by_seq[seq]
            dropped += 1
        return dropped
