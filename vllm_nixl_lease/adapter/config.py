"""Lease settings from ``kv_connector_extra_config``, and every time derived from them.

Defaults derive from ``kv_lease_duration`` exactly like upstream (integer
arithmetic: interval ``d // 6``, extension ``d * 2 // 3``) so a fleet mixing
stock and lease-core engines agrees on timing.

``CONFIG_KEYS`` is the table of keys: each one's type, default and bounds;
``LeaseConfig.from_extra_config`` reads them through one validator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._wire import default_heartbeat_interval, default_lease_extension

DEFAULT_LEASE_DURATION = 30
# Heartbeat message size: 8 KiB fits every NIXL backend (some cap a notification there).
# UCX takes larger ones (upstream sends each P all its ids in one message), and larger
# messages cut D's heartbeat CPU with many requests queued (see docs/BENCHMARKS.md).
DEFAULT_MAX_HEARTBEAT_BYTES = 8192
UCX_MAX_HEARTBEAT_BYTES = 32768
# Off: with vLLM's multiprocess executor a pause in the worker is spent spinning in the
# engine core (its shared-memory queue readers busy-wait after each read; see docs/BENCHMARKS.md).
DEFAULT_IDLE_STEP_SLEEP_MS = 0.0
MAX_IDLE_STEP_SLEEP_MS = 100.0
# Leases one P step may expire; the rest wait for the next steps, so a D that dies
# with a deep queue cannot stall one P step (see docs/BENCHMARKS.md for the per-lease cost).
DEFAULT_MAX_EXPIRIES_PER_STEP = 2000
# Time one D step may spend posting READs before it carries the rest to the next step
# (read_pacer.py): short next to any lease, so a burst cannot delay heartbeats by much
# (see docs/BENCHMARKS.md).
DEFAULT_READ_POST_BUDGET_MS = 100.0
# A heartbeat round this small goes out whole in one step (one sending step per
# interval instead of one per chunk); a larger one is paced over the interval.
DEFAULT_HEARTBEAT_STEP_BYTES = 65536
# Smallest heartbeat message accepted: the HB prefix plus room for one long request id
# (vLLM ids with router prefixes and random suffixes run to ~100 bytes).
MIN_HEARTBEAT_BYTES = 256
# A view's margin never falls below this share of lease_safety_margin (read_fence.py).
MARGIN_FLOOR_SHARE = 0.25


class LeaseConfigError(ValueError):
    """A lease setting in ``kv_connector_extra_config`` is invalid."""


def default_max_heartbeat_bytes(backends: object) -> int:
    """32 KiB when every NIXL backend is UCX (vLLM's default ``backends``), else 8 KiB."""
    if backends is None:
        backends = ["UCX"]  # what upstream's worker uses when the key is absent
    if isinstance(backends, (list, tuple)) and backends and all(b == "UCX" for b in backends):
        return UCX_MAX_HEARTBEAT_BYTES
    return DEFAULT_MAX_HEARTBEAT_BYTES


# -- the table of keys ---------------------------------------------------------
# A default may be a function of (extra config, values read so far, by key name).
Values = dict[str, Any]
Default = Callable[[Mapping[str, Any], Values], Any]


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """One ``kv_connector_extra_config`` key.

    ``kind``: ``bool``; ``int`` (not a bool); or ``float``, meaning any finite
    int or float (not a bool).  Bounds apply to a value the user set; a
    default is valid by construction.  ``check`` relates the value (set or
    default) to the keys read before it.
    """

    name: str
    kind: type
    default: Any  # a value, or a Default
    hint: str  # what a valid value is: "<key> must be <hint>"
    low: float | None = None
    low_open: bool = False  # the low bound itself is rejected
    high: float | Callable[[Values], float] | None = None  # a function of the values read before
    high_open: bool = False
    # Out-of-bounds text when the hint alone would not say why: "<key>=<value> <too_far>",
    # formatted with the key's ``high`` bound.
    too_far: str | None = None
    check: Callable[[Any, Values], None] | None = None
    field: str | None = None  # LeaseConfig's field, when not the key's name
    convert: Callable[[Any], Any] | None = None  # key's unit -> field's

    def where(self) -> str:
        return f"kv_connector_extra_config[{self.name!r}]"

    def high_bound(self, values: Values) -> float | None:
        return self.high(values) if callable(self.high) else self.high

    def read(self, extra: Mapping[str, Any], values: Values) -> Any:
        """The key's value (validated) or its default."""
        if self.name not in extra:
            value = self.default(extra, values) if callable(self.default) else self.default
        else:
            value = extra[self.name]
            if not _is_kind(value, self.kind):
                raise LeaseConfigError(
                    f"{self.where()} must be {self.hint}, got {value!r} ({type(value).__name__})"
                )
            high = self.high_bound(values)
            if not _within(value, self.low, self.low_open, high, self.high_open):
                if self.too_far is not None:
                    raise LeaseConfigError(f"{self.where()}={value!r} {self.too_far.format(high=high)}")
                raise LeaseConfigError(f"{self.where()} must be {self.hint}, got {value!r}")
        if self.check is not None:
            self.check(value, values)
        return value


def _is_kind(value: Any, kind: type) -> bool:
    # bool is an int subclass; "true" as a duration is a typo, not a number.
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is int:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)


def _within(value: float, low: float | None, low_open: bool, high: float | None, high_open: bool) -> bool:
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


def _default_interval(extra: Mapping[str, Any], values: Values) -> float:
    return default_heartbeat_interval(values["kv_lease_duration"])  # 0 (every step) for d < 6, as upstream


def _default_extension(extra: Mapping[str, Any], values: Values) -> float:
    duration = values["kv_lease_duration"]
    extension = default_lease_extension(duration)
    if extension <= 0:
        raise LeaseConfigError(
            f"kv_connector_extra_config['kv_lease_duration']={duration!r} gives a lease extension "
            "of 0 s (d * 2 // 3), so heartbeats could never renew a lease; use >= 2 or set "
            "'lease_extension'"
        )
    return extension


def _extension_outlasts_interval(extension: float, values: Values) -> None:
    interval = values["heartbeat_interval"]
    if extension <= interval:
        raise LeaseConfigError(
            f"lease_extension ({extension!r}) must be greater than heartbeat_interval ({interval!r}): "
            "otherwise a lease can lapse between two heartbeats"
        )


def _default_heartbeat_bytes(extra: Mapping[str, Any], values: Values) -> int:
    return default_max_heartbeat_bytes(extra.get("backends"))


def _margin_room(values: Values) -> float:
    # Steady heartbeats keep a view at least this far ahead of its lease end.
    extension: float = values["lease_extension"]
    interval: float = values["heartbeat_interval"]
    return extension - interval


def _default_margin(extra: Mapping[str, Any], values: Values) -> float:
    # A quarter of the extension (upstream's margin for its turn-2 readback at the
    # default lease), and below half the room so steady heartbeats never break a view.
    extension: float = values["lease_extension"]
    return min(extension / 4, _margin_room(values) / 2)


def _ms_to_s(ms: float) -> float:
    return ms / 1000


POSITIVE = "a finite number > 0"
TRUE_OR_FALSE = "true or false"

CONFIG_KEYS: tuple[ConfigKey, ...] = (
    ConfigKey(
        "kv_lease_duration", float, DEFAULT_LEASE_DURATION, POSITIVE, low=0, low_open=True,
        field="lease_duration",
    ),
    ConfigKey("heartbeat_interval", float, _default_interval, POSITIVE, low=0, low_open=True),
    ConfigKey(
        "lease_extension", float, _default_extension, POSITIVE, low=0, low_open=True,
        check=_extension_outlasts_interval,
    ),
    ConfigKey(
        "max_heartbeat_bytes", int, _default_heartbeat_bytes,
        f"an int >= {MIN_HEARTBEAT_BYTES}", low=MIN_HEARTBEAT_BYTES,
        too_far=f"is too small for one request id; use >= {MIN_HEARTBEAT_BYTES}",
    ),
    ConfigKey(
        "lease_safety_margin", float, _default_margin,
        "a number >= 0 and below lease_extension - heartbeat_interval",
        low=0, high=_margin_room, high_open=True,
        too_far=(
            "must be >= 0 and below lease_extension - heartbeat_interval ({high!r}): with a larger margin "
            "a queued request's view would lapse between two heartbeats and every such read be fenced"
        ),
        convert=float,
    ),
    ConfigKey("lease_fencing", bool, True, TRUE_OR_FALSE),
    ConfigKey(
        "idle_step_sleep_ms", float, DEFAULT_IDLE_STEP_SLEEP_MS,
        f"a number from 0 (off) to {MAX_IDLE_STEP_SLEEP_MS:g}", low=0, high=MAX_IDLE_STEP_SLEEP_MS,
        field="idle_step_sleep_s", convert=_ms_to_s,
    ),
    ConfigKey("max_expiries_per_step", int, DEFAULT_MAX_EXPIRIES_PER_STEP, "an int >= 1", low=1),
    ConfigKey("heartbeat_tags", bool, True, TRUE_OR_FALSE),
    ConfigKey(
        "heartbeat_step_bytes", int, DEFAULT_HEARTBEAT_STEP_BYTES, "an int >= 0 (0: always paced)", low=0,
    ),
    ConfigKey(
        "read_post_budget_ms", float, DEFAULT_READ_POST_BUDGET_MS, "a number >= 0 (0: no bound)", low=0,
        field="read_post_budget_s", convert=_ms_to_s,
    ),
    ConfigKey("kv_lease_claim_reads", bool, False, TRUE_OR_FALSE, field="claim_reads"),
    ConfigKey("step_time_metric", bool, False, TRUE_OR_FALSE),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    lease_duration: float
    heartbeat_interval: float
    lease_extension: float
    max_heartbeat_bytes: int
    # D fences a READ when its view of P's lease has this little left (lease_views.py).
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
    # A heartbeat round of at most this many bytes goes out in one step; a larger one is paced.
    heartbeat_step_bytes: int = DEFAULT_HEARTBEAT_STEP_BYTES
    # Readers on several Ds (docs/PROTOCOL.md, rules P14 and D11): P advertises and honours
    # claims, D claims a lease from such a P before it READs it (one round trip per READ).
    claim_reads: bool = False
    # vllm:nixl_lease_connector_step_seconds (step_time.py): every hook vLLM calls is timed.
    step_time_metric: bool = False

    # -- times derived from the settings -------------------------------------
    @property
    def forget_after_s(self) -> float:
        """P unloads a D agent silent this long: well past any lease it could still renew."""
        return max(60.0, 4 * self.lease_extension)

    @property
    def max_view_extension(self) -> float:
        """D renews a lease view by at most this (P's advertised extension is
        clamped to it, which only shortens views): as long as P keeps a silent
        D agent loaded, so D's ledger of unanswered sends stays bounded."""
        return self.forget_after_s

    @property
    def forget_sweep_s(self) -> float:
        """How often P looks for silent D agents: often next to ``forget_after_s``."""
        return min(self.forget_after_s, 10.0)

    @property
    def answer_gap_s(self) -> float:
        """A quarter of D's interval: P welcomes a repeated hello at most this often
        (or every ``MAX_WELCOME_GAP_S``, when shorter)."""
        return self.heartbeat_interval / 4

    @property
    def answer_tick_s(self) -> float:
        """P answers every D agent's waiting heartbeats together this often: half
        D's interval, what D's margin allows an answer to wait (0: every step, as
        D then heartbeats every step)."""
        return self.heartbeat_interval / 2

    @property
    def stall_s(self) -> float:
        """A P step gap this long is P's own stall, not D's silence: half the extension."""
        return self.lease_extension / 2

    @property
    def hello_retry_s(self) -> float:
        """D repeats a hello P has not answered this often, while it waits to read."""
        return min(1.0, self.lease_extension / 8)

    @property
    def rehello_after_s(self) -> float:
        """D repeats its hello to a P rank silent two intervals: P restarted, forgot it,
        or lost the hello."""
        return max(1.0, 2 * self.heartbeat_interval)

    @property
    def reconnect_after_s(self) -> float:
        """D releases a connection whose P rank owes an answer this long (PROTOCOL D2a): twice
        the rehello, and never before a lease D's heartbeats kept alive could have lapsed."""
        return max(2 * self.rehello_after_s, self.lease_extension)

    # -- reading kv_connector_extra_config -------------------------------------
    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LeaseConfig:
        """Read every key of ``CONFIG_KEYS``, in order; ``LeaseConfigError`` names the bad one."""
        extra = extra or {}
        values: Values = {}
        fields: dict[str, Any] = {}
        for key in CONFIG_KEYS:
            value = values[key.name] = key.read(extra, values)
            fields[key.field or key.name] = key.convert(value) if key.convert is not None else value
        return cls(**fields)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> LeaseConfig:
        kv = getattr(vllm_config, "kv_transfer_config", None)
        return cls.from_extra_config(getattr(kv, "kv_connector_extra_config", None))
