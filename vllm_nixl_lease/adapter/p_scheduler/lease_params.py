"""P scheduler: the lease terms a finished prefill's ``kv_transfer_params``
carry to D (``_wire.py`` names the keys; stock D ignores them), and the P
instance they name, which the scheduler ships to its workers.

One ``PInstance`` per scheduler process: a fresh random instance id and a
secret tag key at every start (``docs/PROTOCOL.md`` section 1).  D keys
everything it keeps per engine by (engine id, instance), so a P restarted
under the same engine id is a different P to it; the tag key never leaves P
(D takes each lease's tag from its params), so nobody can aim two tags at
each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._wire import (
    CLAIM_HELLO_VERSION,
    LEASE_PROTOCOL_BASE,
    LEASE_PROTOCOL_VERSION,
    PARAM_LEASE_DEADLINE,
    PARAM_LEASE_EXTENSION,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_INTERVAL,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_PROTOCOL_MAX,
    PARAM_LEASE_TAG,
    new_instance,
)
from ...lease_tags import lease_tag, new_tag_key
from ..config import LeaseConfig
from ..metadata import LEASE_INSTANCE_ATTR


@dataclass(frozen=True, slots=True)
class PInstance:
    """This P process as D sees it: ``instance`` (public) and ``tag_key`` (secret)."""

    instance: str
    tag_key: bytes

    @classmethod
    def new(cls) -> PInstance:
        return cls(new_instance(), new_tag_key())


class LeaseParams:
    """Adds the lease terms to the params of finished prefills (pull mode)."""

    def __init__(self, lease_config: LeaseConfig) -> None:
        self.instance = PInstance.new()
        self._extension = lease_config.lease_extension
        self._interval = lease_config.heartbeat_interval
        # kv_lease_claim_reads: version 4, claims (ack_answerer.py and claim_gate.py honour them)
        self._newest = CLAIM_HELLO_VERSION if lease_config.claim_reads else LEASE_PROTOCOL_VERSION
        self._shipped = False  # the instance went out on some step's metadata

    def add(self, params: dict[str, Any], req_id: str, deadline: float | None) -> None:
        """The lease deadline (this scheduler's ``perf_counter``, the clock the
        handshake listener echoes for D's offset estimate), how far and how often
        heartbeats move it, the protocol versions, this instance and the lease's tag."""
        if deadline is None:
            return
        params[PARAM_LEASE_DEADLINE] = deadline
        params[PARAM_LEASE_EXTENSION] = self._extension
        params[PARAM_LEASE_INTERVAL] = self._interval
        # 2, which a version-2 D takes as it is; a newer D reads the newest hello we accept.
        params[PARAM_LEASE_PROTOCOL] = LEASE_PROTOCOL_BASE
        params[PARAM_LEASE_PROTOCOL_MAX] = self._newest
        params[PARAM_LEASE_INSTANCE] = self.instance.instance
        try:
            params[PARAM_LEASE_TAG] = lease_tag(req_id, self.instance.tag_key)
        except (TypeError, ValueError):
            pass  # an id no tag can name (not UTF-8): D heartbeats it by id

    def attach(self, meta: object) -> None:
        """Ship the instance to the workers: on the first step (a worker answers
        D's hellos with it) and on every step that grants leases (a worker keys
        their tags with it), not on the idle steps between."""
        if self._shipped and not getattr(meta, "reqs_to_send", None):
            return
        self._shipped = True
        setattr(meta, LEASE_INSTANCE_ATTR, (self.instance.instance, self.instance.tag_key))
