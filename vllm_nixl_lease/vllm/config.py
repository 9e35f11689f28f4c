"""Lease settings from ``kv_connector_extra_config``.

Defaults derive from ``kv_lease_duration`` exactly like upstream (integer
arithmetic: interval ``d // 6``, extension ``d * 2 // 3``) so a fleet mixing
stock and lease-core engines agrees on timing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._wire import default_heartbeat_interval, default_lease_extension

DEFAULT_LEASE_DURATION = 30
# Heartbeat message size: 8 KiB fits every NIXL backend (some cap a notification there).
# UCX takes larger ones (upstream sends each P all its ids in one message); with only UCX,
# 32 KiB cut D's heartbeat CPU at p99 by a third with 100k requests queued over 8 P
# (four alternating runs, README "Fleet scale"): a quarter of the NIXL calls and chunks.
DEFAULT_MAX_HEARTBEAT_BYTES = 8192
UCX_MAX_HEARTBEAT_BYTES = 32768
# Off: measured with vLLM's multiprocess executor, a pause in the worker is spent spinning in the
# engine core (shm queue readers busy-wait 1 s after each read); see README "Idle P".
DEFAULT_IDLE_STEP_SLEEP_MS = 0.0
MAX_IDLE_STEP_SLEEP_MS = 100.0
# Leases one P step may expire; the rest wait for the next steps.  A D that dies
# with 100k requests queued would otherwise cost one step ~100 ms (``make bench-fleet``
# measures the per-lease cost this bounds: 2000 keeps a step's sweep near 1 ms).
DEFAULT_MAX_EXPIRIES_PER_STEP = 2000
# Time one D step may spend posting READs before it carries the rest to the next step
# (read_pacer.py).  A 2000-request burst posted in one step took 1.6-1.8 s and
# delayed heartbeats by as much; 100 ms keeps a step short next to any lease.
DEFAULT_READ_POST_BUDGET_MS = 100.0
# Smallest heartbeat message accepted: the HB prefix plus room for one long request id
# (vLLM ids with router prefixes and random suffixes run to ~100 bytes).
MIN_HEARTBEAT_BYTES = 256


class LeaseConfigError(ValueError):
    """A lease setting in ``kv_connector_extra_config`` is invalid."""


def _number(key: str, value: Any) -> float:
    # bool is an int subclass; "true" as a duration is a typo, not a number.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LeaseConfigError(
            f"kv_connector_extra_config[{key!r}] must be a number, got {value!r} ({type(value).__name__})"
        )
    if not math.isfinite(value) or value <= 0:
        raise LeaseConfigError(
            f"kv_connector_extra_config[{key!r}] must be a finite number > 0, got {value!r}"
        )
    return value


def default_max_heartbeat_bytes(backends: object) -> int:
    """32 KiB when every NIXL backend is UCX (vLLM's default ``backends``), else 8 KiB."""
    if backends is None:
        backends = ["UCX"]  # what upstream's worker uses when the key is absent
    if isinstance(backends, (list, tuple)) and backends and all(b == "UCX" for b in backends):
        return UCX_MAX_HEARTBEAT_BYTES
    return DEFAULT_MAX_HEARTBEAT_BYTES


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    lease_duration: float
    heartbeat_interval: float
    lease_extension: float
    max_heartbeat_bytes: int
    # D fences a READ when its view of P's lease has this little left (holder_view.py).
    lease_safety_margin: float = 0.0
    # False: D reads whatever its view says (upstream behaviour).
    lease_fencing: bool = True
    # Pause of an empty P step while only unread leases keep the engine busy (idle_pause.py).
    idle_step_sleep_s: float = DEFAULT_IDLE_STEP_SLEEP_MS / 1000
    # Leases one P step may expire (lease_keeper.py).
    max_expiries_per_step: int = DEFAULT_MAX_EXPIRIES_PER_STEP
    # Time one D step may spend posting READs; 0: no bound (read_pacer.py).
    read_post_budget_s: float = DEFAULT_READ_POST_BUDGET_MS / 1000
    # D names leases by tag (lease_tags.py) to a P that takes them; False: by id.
    heartbeat_tags: bool = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LeaseConfig:
        extra = extra or {}
        duration = _number("kv_lease_duration", extra.get("kv_lease_duration", DEFAULT_LEASE_DURATION))
        if "heartbeat_interval" in extra:
            interval = _number("heartbeat_interval", extra["heartbeat_interval"])
        else:
            interval = default_heartbeat_interval(duration)  # 0 (every step) for d < 6, as upstream
        if "lease_extension" in extra:
            extension = _number("lease_extension", extra["lease_extension"])
        else:
            extension = default_lease_extension(duration)
            if extension <= 0:
                raise LeaseConfigError(
                    f"kv_connector_extra_config['kv_lease_duration']={duration!r} gives a lease extension "
                    "of 0 s (d * 2 // 3), so heartbeats could never renew a lease; use >= 2 or set "
                    "'lease_extension'"
                )
        if extension <= interval:
            raise LeaseConfigError(
                f"lease_extension ({extension!r}) must be greater than heartbeat_interval ({interval!r}): "
                "otherwise a lease can lapse between two heartbeats"
            )
        raw_max = extra.get("max_heartbeat_bytes", default_max_heartbeat_bytes(extra.get("backends")))
        if isinstance(raw_max, bool) or not isinstance(raw_max, int):
            raise LeaseConfigError(
                f"kv_connector_extra_config['max_heartbeat_bytes'] must be an int, got {raw_max!r}"
            )
        if raw_max < MIN_HEARTBEAT_BYTES:
            raise LeaseConfigError(
                f"kv_connector_extra_config['max_heartbeat_bytes']={raw_max!r} is too small for one "
                f"request id; use >= {MIN_HEARTBEAT_BYTES}"
            )
        # Default: a quarter of the extension (5 s for the default 30 s lease,
        # upstream's margin for its turn-2 readback), and always below
        # extension - interval so steady heartbeats never break the view.
        room = extension - interval
        if "lease_safety_margin" in extra:
            margin = extra["lease_safety_margin"]
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
                raise LeaseConfigError(
                    f"kv_connector_extra_config['lease_safety_margin'] must be a number, got {margin!r}"
                )
            if not 0 <= margin < room:
                raise LeaseConfigError(
                    f"kv_connector_extra_config['lease_safety_margin']={margin!r} must be >= 0 and below "
                    f"lease_extension - heartbeat_interval ({room!r}): with a larger margin a queued "
                    "request's view would lapse between two heartbeats and every such read be fenced"
                )
        else:
            margin = min(extension / 4, room / 2)
        fencing = extra.get("lease_fencing", True)
        if not isinstance(fencing, bool):
            raise LeaseConfigError(
                f"kv_connector_extra_config['lease_fencing'] must be true or false, got {fencing!r}"
            )
        idle_ms = extra.get("idle_step_sleep_ms", DEFAULT_IDLE_STEP_SLEEP_MS)
        if (
            isinstance(idle_ms, bool)
            or not isinstance(idle_ms, (int, float))
            or not 0 <= idle_ms <= MAX_IDLE_STEP_SLEEP_MS
        ):
            raise LeaseConfigError(
                f"kv_connector_extra_config['idle_step_sleep_ms'] must be a number from 0 (off) to "
                f"{MAX_IDLE_STEP_SLEEP_MS:g}, got {idle_ms!r}"
            )
        max_expiries = extra.get("max_expiries_per_step", DEFAULT_MAX_EXPIRIES_PER_STEP)
        if isinstance(max_expiries, bool) or not isinstance(max_expiries, int) or max_expiries < 1:
            raise LeaseConfigError(
                "kv_connector_extra_config['max_expiries_per_step'] must be an int >= 1, "
                f"got {max_expiries!r}"
            )
        tags = extra.get("heartbeat_tags", True)
        if not isinstance(tags, bool):
            raise LeaseConfigError(
                f"kv_connector_extra_config['heartbeat_tags'] must be true or false, got {tags!r}"
            )
        budget_ms = extra.get("read_post_budget_ms", DEFAULT_READ_POST_BUDGET_MS)
        if (
            isinstance(budget_ms, bool)
            or not isinstance(budget_ms, (int, float))
            or not math.isfinite(budget_ms)
            or budget_ms < 0
        ):
            raise LeaseConfigError(
                "kv_connector_extra_config['read_post_budget_ms'] must be a number >= 0 (0: no bound), "
                f"got {budget_ms!r}"
            )
        return cls(
            duration,
            interval,
            extension,
            raw_max,
            float(margin),
            fencing,
            idle_ms / 1000,
            max_expiries,
            budget_ms / 1000,
            tags,
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> LeaseConfig:
        kv = getattr(vllm_config, "kv_transfer_config", None)
        return cls.from_extra_config(getattr(kv, "kv_connector_extra_config", None))
