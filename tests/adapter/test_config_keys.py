"""The table of kv_connector_extra_config keys, walked key by key: every key
rejects a value of the wrong type and one out of its bounds, naming itself."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from vllm_nixl_lease.adapter.config import CONFIG_KEYS, ConfigKey, LeaseConfig, LeaseConfigError

# Values of the wrong type for each kind (a bool is never a number, nor a number a bool).
WRONG_TYPE: dict[type, list[Any]] = {
    bool: [1, 0, "true", None],
    int: [1.5, 4096.0, True, "3", None],
    float: ["1", True, False, None, float("nan"), float("inf"), [1]],
}


def defaults() -> dict[str, Any]:
    """Each key's default value, by key name (what bounds that depend on other keys see)."""
    values: dict[str, Any] = {}
    for key in CONFIG_KEYS:
        values[key.name] = key.read({}, values)
    return values


def out_of_bounds(key: ConfigKey) -> list[float]:
    out = []
    if key.low is not None:
        out.append(key.low if key.low_open else key.low - 1)
    high = key.high_bound(defaults())
    if high is not None:
        out.append(high if key.high_open else high + 1)
    return out


def rejects(extra: dict[str, Any]) -> str:
    with pytest.raises(LeaseConfigError) as info:
        LeaseConfig.from_extra_config(extra)
    return str(info.value)


def test_the_table_sets_every_field_once() -> None:
    fields = [key.field or key.name for key in CONFIG_KEYS]
    assert sorted(fields) == sorted(f.name for f in dataclasses.fields(LeaseConfig))
    assert len({key.name for key in CONFIG_KEYS}) == len(CONFIG_KEYS)


@pytest.mark.parametrize("key", CONFIG_KEYS, ids=lambda key: key.name)
def test_every_key_rejects_a_wrong_type(key: ConfigKey) -> None:
    for value in WRONG_TYPE[key.kind]:
        message = rejects({key.name: value})
        assert f"[{key.name!r}]" in message and repr(value) in message, message


@pytest.mark.parametrize("key", [k for k in CONFIG_KEYS if k.kind is not bool], ids=lambda key: key.name)
def test_every_number_key_rejects_a_value_out_of_bounds(key: ConfigKey) -> None:
    values = out_of_bounds(key)
    assert values, f"{key.name} has no bounds"
    for value in values:
        message = rejects({key.name: value})
        assert f"[{key.name!r}]" in message and repr(value) in message, message


@pytest.mark.parametrize("key", [k for k in CONFIG_KEYS if k.kind is not bool], ids=lambda key: key.name)
def test_every_closed_bound_is_accepted(key: ConfigKey) -> None:
    base = defaults()
    closed = [key.low] if key.low is not None and not key.low_open else []
    high = key.high_bound(base)
    if high is not None and not key.high_open:
        closed.append(high)
    for value in closed:
        cfg = LeaseConfig.from_extra_config({key.name: value})
        got = getattr(cfg, key.field or key.name)
        assert got == (key.convert(value) if key.convert is not None else value)


@pytest.mark.parametrize("key", [k for k in CONFIG_KEYS if k.kind is bool], ids=lambda key: key.name)
def test_every_switch_takes_both_values(key: ConfigKey) -> None:
    for value in (True, False):
        assert getattr(LeaseConfig.from_extra_config({key.name: value}), key.field or key.name) is value


def test_derived_times_follow_the_settings() -> None:
    cfg = LeaseConfig.from_extra_config({})  # extension 20, interval 5
    assert (cfg.forget_after_s, cfg.forget_sweep_s) == (80, 10.0)
    assert (cfg.answer_gap_s, cfg.rehello_after_s) == (1.25, 10)
    cfg = LeaseConfig.from_extra_config({"kv_lease_duration": 5})  # extension 3, every step
    assert (cfg.forget_after_s, cfg.answer_gap_s, cfg.rehello_after_s) == (60.0, 0, 1.0)
