"""Config keys from kv_connector_extra_config, and construction-time errors."""

from __future__ import annotations

import pytest
import vllm_support  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM loads)
from vllm_support import make_kv_cache_config, shared_vllm_config

from vllm_nixl_lease.adapter import compat
from vllm_nixl_lease.adapter.config import LeaseConfig, LeaseConfigError


def test_defaults_match_upstream() -> None:
    cfg = LeaseConfig.from_extra_config({})
    assert (cfg.lease_duration, cfg.heartbeat_interval, cfg.lease_extension) == (30, 5, 20)
    assert cfg.max_heartbeat_bytes == 32768  # UCX, vLLM's default backend
    cfg = LeaseConfig.from_extra_config({"kv_lease_duration": 5})
    assert (cfg.heartbeat_interval, cfg.lease_extension) == (0, 3)  # every step, as upstream


@pytest.mark.parametrize(
    ("backends", "size"),
    [(["UCX"], 32768), (("UCX",), 32768), (["UCX", "GDS"], 8192), (["GPUNETIO"], 8192), ([], 8192),
     ("UCX", 8192)],
)  # fmt: skip
def test_heartbeat_size_follows_the_backends(backends: object, size: int) -> None:
    # Only UCX takes notifications larger than 8 KiB; an explicit size always wins.
    assert LeaseConfig.from_extra_config({"backends": backends}).max_heartbeat_bytes == size
    explicit = {"backends": backends, "max_heartbeat_bytes": 4096}
    assert LeaseConfig.from_extra_config(explicit).max_heartbeat_bytes == 4096


def test_fencing_defaults() -> None:
    cfg = LeaseConfig.from_extra_config({})
    assert cfg.lease_fencing is True
    assert cfg.heartbeat_tags is True
    assert cfg.lease_safety_margin == 5.0  # extension / 4, upstream's turn-2 margin
    # A tight custom interval: the margin stays below half of extension - interval.
    cfg = LeaseConfig.from_extra_config({"kv_lease_duration": 30, "heartbeat_interval": 18})
    assert cfg.lease_safety_margin == 1.0
    cfg = LeaseConfig.from_extra_config({"lease_safety_margin": 0, "lease_fencing": False})
    assert (cfg.lease_safety_margin, cfg.lease_fencing) == (0.0, False)
    assert LeaseConfig.from_extra_config({"heartbeat_tags": False}).heartbeat_tags is False
    assert LeaseConfig.from_extra_config({}).idle_step_sleep_s == 0.0  # opt-in
    assert LeaseConfig.from_extra_config({"idle_step_sleep_ms": 1}).idle_step_sleep_s == 0.001
    assert LeaseConfig.from_extra_config({}).max_expiries_per_step == 2000
    assert LeaseConfig.from_extra_config({"max_expiries_per_step": 5}).max_expiries_per_step == 5
    assert LeaseConfig.from_extra_config({}).read_post_budget_s == 0.1
    assert LeaseConfig.from_extra_config({"read_post_budget_ms": 0}).read_post_budget_s == 0  # no bound
    assert LeaseConfig.from_extra_config({"read_post_budget_ms": 2.5}).read_post_budget_s == 0.0025


def test_overrides() -> None:
    cfg = LeaseConfig.from_extra_config(
        {"kv_lease_duration": 60, "heartbeat_interval": 2.5, "lease_extension": 7, "max_heartbeat_bytes": 999}
    )
    assert (cfg.heartbeat_interval, cfg.lease_extension, cfg.max_heartbeat_bytes) == (2.5, 7, 999)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"kv_lease_duration": "30"}, "'kv_lease_duration'"),
        ({"kv_lease_duration": 0}, "'kv_lease_duration'"),
        ({"kv_lease_duration": -3}, "-3"),
        ({"kv_lease_duration": True}, "True"),
        ({"kv_lease_duration": float("nan")}, "nan"),
        ({"kv_lease_duration": 1}, "kv_lease_duration']=1"),
        ({"heartbeat_interval": 0}, "'heartbeat_interval'"),
        ({"lease_extension": "x"}, "'lease_extension'"),
        ({"heartbeat_interval": 10, "lease_extension": 10}, "must be greater than heartbeat_interval"),
        ({"max_heartbeat_bytes": 64}, "max_heartbeat_bytes']=64"),
        ({"max_heartbeat_bytes": 4096.0}, "'max_heartbeat_bytes'"),
        ({"lease_safety_margin": 15}, "below lease_extension - heartbeat_interval (15)"),
        ({"lease_safety_margin": -1}, "lease_safety_margin']=-1"),
        ({"lease_safety_margin": "2"}, "['lease_safety_margin'] must be a number"),
        ({"lease_safety_margin": float("inf")}, "['lease_safety_margin'] must be a number"),
        ({"lease_fencing": "yes"}, "['lease_fencing'] must be true or false"),
        ({"heartbeat_tags": 1}, "['heartbeat_tags'] must be true or false"),
        ({"idle_step_sleep_ms": -1}, "['idle_step_sleep_ms'] must be a number from 0 (off) to 100, got -1"),
        ({"idle_step_sleep_ms": 500}, "got 500"),
        ({"idle_step_sleep_ms": "1"}, "got '1'"),
        ({"max_expiries_per_step": 0}, "['max_expiries_per_step'] must be an int >= 1, got 0"),
        ({"max_expiries_per_step": 1.5}, "got 1.5"),
        ({"max_expiries_per_step": True}, "got True"),
        ({"read_post_budget_ms": -1}, "['read_post_budget_ms'] must be a number >= 0 (0: no bound), got -1"),
        ({"read_post_budget_ms": float("nan")}, "got nan"),
        ({"read_post_budget_ms": "100"}, "got '100'"),
        ({"read_post_budget_ms": False}, "got False"),
    ],
)
def test_bad_values_name_key_and_value(extra: dict, needle: str) -> None:
    with pytest.raises(LeaseConfigError) as info:
        LeaseConfig.from_extra_config(extra)
    assert needle in str(info.value)


@pytest.mark.parametrize("role_name", ["SCHEDULER", "WORKER"])
def test_connector_construction_fails_on_bad_config(role_name: str, tmp_path_factory) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_nixl_lease.adapter.connector import LeaseNixlPullConnector, LeaseNixlPushConnector

    vc = shared_vllm_config(tmp_path_factory.mktemp("cfg"), {"kv_lease_duration": "soon"})
    for cls in (LeaseNixlPullConnector, LeaseNixlPushConnector):
        with set_current_vllm_config(vc), pytest.raises(LeaseConfigError, match="kv_lease_duration.*'soon'"):
            cls(vc, getattr(KVConnectorRole, role_name), make_kv_cache_config())


def test_unsupported_vllm_version_fails_at_construction(monkeypatch, tmp_path_factory) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_nixl_lease.adapter.connector import LeaseNixlPullConnector

    monkeypatch.setattr(compat, "vllm_version", lambda: "0.34.1")
    vc = shared_vllm_config(tmp_path_factory.mktemp("cfg"), {})
    with set_current_vllm_config(vc), pytest.raises(compat.UnsupportedVllmError, match="vLLM 0.34.1"):
        LeaseNixlPullConnector(vc, KVConnectorRole.SCHEDULER, make_kv_cache_config())


def test_supported_versions() -> None:
    assert compat.is_supported("0.33.0") and compat.is_supported("0.32.0+cpu")
    assert not compat.is_supported("0.31.9") and not compat.is_supported(None)
    assert compat.is_supported(compat.vllm_version())
