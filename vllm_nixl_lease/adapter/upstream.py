"""The parts of vLLM's NIXL worker and scheduler the lease components use.

Components never subclass or reach into vLLM classes directly: they take the
upstream object typed as one of these protocols.  This file is the whole
contract with vLLM's internals (checked against 0.32 and 0.33, ``compat.py``);
the unit tests build components against one small fake of it
(``harness/upstream_fake.py``).
"""

from __future__ import annotations

import queue
from collections.abc import Collection, Mapping, MutableMapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeAlias

from .stats import LeaseKVConnectorStats

# A remote agent's name as ``add_remote_agent`` returned it: NIXL annotates str,
# its binding returns bytes, and upstream keeps and sends to whatever it got.
AgentName: TypeAlias = str | bytes


class NixlWrapper(Protocol):
    """The slice of ``nixl._api.nixl_agent`` the lease path calls."""

    def get_new_notifs(self) -> Mapping[str, list[bytes]]: ...

    def send_notif(self, agent_name: AgentName, notif_msg: bytes) -> None: ...

    # Heartbeat acknowledgements (ack_answerer.py / ack_requester.py).
    def add_remote_agent(self, metadata: bytes) -> AgentName: ...

    def remove_remote_agent(self, agent: str) -> None: ...

    def get_partial_agent_metadata(
        self, descs: Any, inc_conn_info: bool = False, backends: Any = ()
    ) -> bytes: ...


class UpstreamWorker(Protocol):
    """vLLM's ``NixlBaseConnectorWorker`` as the lease components see it."""

    nixl_wrapper: NixlWrapper
    # Replaced by a LeaseKVConnectorStats at set-up; upstream swaps in a fresh
    # one each time stats are shipped, so components read it on every use.
    xfer_stats: LeaseKVConnectorStats
    tp_rank: int
    # engine id -> {(P pp rank, P tp rank) -> NIXL agent name}
    _remote_agents: Mapping[str, Mapping[tuple[int, int], AgentName]]
    # engine id -> P's clock minus ours, measured during the handshake (under
    # the handshake lock), refreshed from P's answers (ack_requester.py)
    _engine_clock_offset: dict[str, float]
    # engine id -> last perf_counter() it was used (upstream's idle-engine eviction)
    _engine_last_active: dict[str, float]
    # request id -> NIXL handles of reads in flight
    _recving_transfers: MutableMapping[str, Any]
    # request id -> upstream's ReqMeta of a read not yet done (``.remote.engine_id``)
    _recving_metadata: Mapping[str, Any]
    # engine id -> handshake in progress, under the lock
    _handshake_futures: Mapping[str, Any]
    _handshake_lock: Any
    _recv_failures: Any
    _hb_handshake_notif_only: bool
    # engines whose connection is gone, released after their reads drain
    _invalid_remote_engines: set[str]
    # engine id -> (backoff s, when it is released): upstream forgets an entry only
    # when it marks another engine invalid
    _invalid_engine_backoff: dict[str, tuple[float, float]]

    def _mark_remote_engine_invalid(self, engine_id: str, now: float) -> None: ...

    # Releases engines idle past ``engine_ttl`` (upstream calls it only on a new handshake).
    def _evict_stale_engines(self) -> None: ...

    def _ensure_handshake(
        self,
        engine_id: str,
        host: str,
        port: int,
        tp_size: int,
        dcp_size: int = 1,
        pp_size: int = 1,
        notif_agents_only: bool = False,
    ) -> Future[Any] | None: ...

    def _handle_failed_transfer(
        self, req_id: str, handle: Any, failures: Any, record_failed_transfer: bool = True
    ) -> Any: ...


class UpstreamPushWorker(UpstreamWorker, Protocol):
    """The push worker adds the queue its writer thread fills with non-PUSH_REG notifications."""

    _pending_completion_notifs: queue.Queue[bytes]


class HeartbeatTarget(Protocol):
    """Upstream's ``HeartbeatInfo``: where a P engine listens for handshakes."""

    host: str
    port: int
    tp_size: int
    dcp_size: int
    pp_size: int


# The objects below are only read, so their members are properties: vLLM's own
# classes (dataclasses with narrower types) satisfy them.


class StockHeartbeatInfo(HeartbeatTarget, Protocol):
    """Upstream's ``HeartbeatInfo`` in full, as a stock scheduler's metadata
    carries it: the target and the request ids to heartbeat there."""

    @property
    def req_ids(self) -> Collection[str]: ...


class RemoteReadMeta(Protocol):
    """Upstream's ``RemoteMeta``: the P side of one read."""

    @property
    def engine_id(self) -> str: ...


class ReadMeta(Protocol):
    """Upstream's ``ReqMeta``: one request's read, as the read fence sees it."""

    # one list of block ids per KV cache group
    @property
    def local_block_ids(self) -> Sequence[Sequence[int]]: ...

    @property
    def remote(self) -> RemoteReadMeta | None: ...


class TransferResults(Protocol):
    """Upstream's ``KVConnectorTransferResults``: what one worker step finished."""

    @property
    def finished_sending(self) -> Collection[str]: ...

    @property
    def finished_recving(self) -> Collection[str]: ...


class UpstreamScheduler(Protocol):
    """vLLM's ``NixlBaseConnectorScheduler`` as the lease components see it."""

    _TRANSFER_MODE: str
    # local request id -> (P engine id, P's request id), filled by upstream's on_new_request
    _heartbeat_req_engine: Mapping[str, tuple[str, str]]
    _heartbeat_by_engine: Mapping[str, HeartbeatTarget]
    # request id -> lease deadline on this scheduler's clock (P)
    _reqs_need_send: Mapping[str, float]
