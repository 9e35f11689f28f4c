"""What the schedulers hand their workers: upstream's metadata
(``LeaseConnectorMetadata``, pickled compactly), D's heartbeats and lease
views, P's instance, the idle-step flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

from .._wire import LEASE_PROTOCOL_BASE
from ..decode.view_updates import pack_views, unpack_views

# Attribute set on upstream's NixlConnectorMetadata: engine id -> EngineHeartbeats.
LEASE_HEARTBEATS_ATTR = "lease_heartbeats"
# Attribute set on upstream's NixlConnectorMetadata: LeaseViewUpdates.
LEASE_VIEWS_ATTR = "lease_views"
# Attribute set on upstream's NixlConnectorMetadata (P): (instance, tag key)
# of this P (p_scheduler/lease_params.py).
LEASE_INSTANCE_ATTR = "lease_instance"


@dataclass(slots=True)
class EngineHeartbeats:
    """Pre-encoded ``HB:`` messages for one heartbeat group: a P engine, one of
    its instances and one way of naming leases (``d_scheduler/heartbeat_schedule.py``),
    plus the engine's handshake info.

    Messages are built and chunked once on the scheduler (``max_heartbeat_bytes``
    each), so workers only forward bytes.  ``chunks``: for each message, the
    tracker chunk ``(key, version)`` it encodes (None from other sources), so
    P's answer renews that chunk's views at once (``decode/lease_views.py``);
    ``counts``: for each message, how many names it carries (the worker need
    not scan a 32 KiB message to count them).
    ``instance``: the P instance whose leases they name; empty for a plain P,
    which gets them as upstream's ``HB:``; else they go out acknowledged
    (``LHB:``, or ``LHBT:`` when ``tagged``: they name lease tags).
    """

    engine_id: str
    messages: list[bytes]
    host: str
    port: int
    tp_size: int
    dcp_size: int = 1
    pp_size: int = 1
    # P's KV registration generation its requests' params named (0: none): a
    # handshake this group starts loads at least that registration
    registration_generation: int = 0
    chunks: list[tuple[int, int]] | None = None
    instance: str = ""
    tagged: bool = False
    counts: list[int] | None = None  # names per message, when the scheduler knows them

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        # The metadata is pickled every step (multiprocess executor): a plain
        # constructor call unpickles faster than dataclass slot state.
        return EngineHeartbeats, (
            self.engine_id,
            self.messages,
            self.host,
            self.port,
            self.tp_size,
            self.dcp_size,
            self.pp_size,
            self.registration_generation,
            self.chunks,
            self.instance,
            self.tagged,
            self.counts,
        )


class NewView(NamedTuple):
    """A lease view to start (``decode/lease_views.py``): what the request's
    params said (``_wire.LeaseTerms``) and the name its heartbeats give it."""

    engine_id: str
    instance: str  # empty: a plain P (no acknowledgements)
    name: str  # P's request id, or its tag
    deadline: float  # P's, on P's clock
    extension: float  # P's
    interval: float | None  # P's heartbeat interval, when P said
    hello_version: int = LEASE_PROTOCOL_BASE  # the version D's hellos to that P say


@dataclass(slots=True)
class LeaseViewUpdates:
    """Lease views that start and end this step (see ``decode/lease_views.py``)."""

    new: dict[str, NewView]  # by local request id
    dropped: list[str]
    # local request id -> (chunk key, version) of the heartbeat chunk naming
    # it: for the new views, and for views whose ids were repacked.
    chunks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, tuple[object, ...]]:
        # Packed (decode/view_updates.py): one str and one bytes, where dicts of
        # tuples cost a Python-level call and a tuple per view on each side.
        return _unpickle_view_updates, (pack_views(self.new, self.dropped, self.chunks),)


def _unpickle_view_updates(packed: tuple[str, bytes]) -> LeaseViewUpdates:
    return LeaseViewUpdates(*unpack_views(packed, NewView))


# Attribute set on upstream's NixlConnectorMetadata: the step is idle (idle_pause.py).
LEASE_IDLE_ATTR = "lease_idle_step"


_VALUE = itemgetter(1)


class LeaseConnectorMetadata(NixlConnectorMetadata):
    """Upstream's metadata as our schedulers hand it on (``schedulers.py``).

    Pickled every step for every worker (the multiprocess executor), and most
    steps carry nothing: only the fields that hold something are pickled, and
    unpickling builds the rest afresh through upstream's ``__init__`` (every
    field it leaves out is one of its empty defaults; ours read no attribute
    as nothing).  A step's lease views go packed inside the same reduction
    (one global for pickle to name and find, not two)."""

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(filter(_VALUE, self.__dict__.items()))
        updates = state.get(LEASE_VIEWS_ATTR)
        if type(updates) is LeaseViewUpdates:
            state[LEASE_VIEWS_ATTR] = pack_views(updates.new, updates.dropped, updates.chunks)
            return _unpickle_with_views, (state,)
        return LeaseConnectorMetadata, (), state

    @classmethod
    def adopt(cls, meta: object) -> object:
        """Upstream's freshly built metadata, as this class (the same object)."""
        if type(meta) is NixlConnectorMetadata:
            meta.__class__ = cls
        return meta


def _unpickle_with_views(state: dict[str, Any]) -> LeaseConnectorMetadata:
    meta = LeaseConnectorMetadata()
    state[LEASE_VIEWS_ATTR] = _unpickle_view_updates(state[LEASE_VIEWS_ATTR])
    meta.__dict__.update(state)
    return meta


# Executors that hand the scheduler's output to their workers in the same
# process: nothing pickles the metadata there.
_IN_PROCESS_EXECUTORS = ("uni", "external_launcher")


def executor_pickles(vllm_config: Any) -> bool:
    """Whether vLLM's executor pickles the connector metadata for its workers
    (``mp`` and ``ray``; any executor not known to run in-process), so that
    ``LeaseConnectorMetadata``'s compact pickle pays for its class swap."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return getattr(parallel, "distributed_executor_backend", None) not in _IN_PROCESS_EXECUTORS
