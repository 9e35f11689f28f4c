"""Every vLLM container the recipe renders runs our connector with settings LeaseConfig accepts,
and a manifest broken the way people break them fails the same check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from deploy_manifests import (
    KUBERNETES,
    VLLM_KUSTOMIZATIONS,
    kv_transfer_problems,
    render,
    rendered,
    require_kubectl,
    vllm_containers,
)


@pytest.mark.parametrize("name", sorted(VLLM_KUSTOMIZATIONS))
def test_every_vllm_container_runs_our_connector_with_valid_lease_settings(name: str) -> None:
    objects = rendered(name)
    found = list(vllm_containers(objects))
    assert len(found) == VLLM_KUSTOMIZATIONS[name], [vc.where for vc in found]
    assert kv_transfer_problems(objects) == []


def test_side_channel_host_is_the_pod_ip_and_the_nixl_port_is_exposed() -> None:
    for name in VLLM_KUSTOMIZATIONS:
        for vc in vllm_containers(rendered(name)):
            env = {e["name"]: e for e in vc.container["env"]}
            host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert host == "status.podIP", vc.where
            port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
            assert port in {p["containerPort"] for p in vc.container["ports"]}, vc.where
            assert vc.container["readinessProbe"]["httpGet"]["path"] == "/health", vc.where


def test_the_overlay_sets_our_image_and_the_hook_and_leaves_llm_ds_config_alone() -> None:
    example = KUBERNETES / "overlays" / "llm-d" / "llm-d-example.yaml"
    before = {
        vc.where: vc.kv_transfer_config()
        for vc in vllm_containers(list(yaml.safe_load_all(example.read_text())))
    }
    after = list(vllm_containers(rendered("overlays/llm-d")))
    assert {vc.where for vc in after} == set(before)
    for vc in after:
        assert vc.kv_transfer_config() == before[vc.where], "the overlay must not touch llm-d's config"
        assert vc.env.get("VLLM_NIXL_LEASE") == "1", vc.where
        assert "vllm-nixl-lease" in vc.container["image"], vc.where


# (file under deploy/kubernetes, text to replace, replacement, what the failure names)
BREAKAGES = [
    pytest.param(
        "base/decode.yaml", '"lease_safety_margin": 5', '"lease_safety_margn": 5', "lease_safety_margn",
        id="misspelt-lease-key",
    ),
    pytest.param(
        "base/prefill.yaml", '"kv_lease_duration": 30', '"kv_lease_duration": "30"', "kv_lease_duration",
        id="duration-as-a-string",
    ),
    pytest.param(
        "base/decode.yaml", '"lease_safety_margin": 5', '"lease_safety_margin": 15', "lease_safety_margin",
        id="margin-past-the-room",
    ),
    pytest.param(
        "base/prefill.yaml", '"kv_role": "kv_both"', '"kv_rol": "kv_both"', "kv_rol",
        id="misspelt-top-level-key",
    ),
    pytest.param(
        "base/prefill.yaml", '"kv_connector_module_path": "vllm_nixl_lease",', "", "stock vLLM serves",
        id="module-path-dropped",
    ),
    pytest.param(
        "overlays/llm-d/lease-connector.yaml", 'value: "1"', 'value: "0"', "stock vLLM serves",
        id="hook-off-in-the-overlay",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("path", "old", "new", "named"), BREAKAGES)
def test_a_broken_manifest_fails_the_check(tmp_path: Path, path: str, old: str, new: str, named: str) -> None:
    require_kubectl()
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    target = copy / path
    text = target.read_text()
    assert text.count(old) == 1, f"{path} no longer holds {old!r}: update this test"
    target.write_text(text.replace(old, new))
    kustomization = path.rsplit("/", 1)[0]
    problems = kv_transfer_problems(render(copy / kustomization))
    assert problems, f"{path} with {new!r} passed the check"
    assert any(named in p for p in problems), problems
