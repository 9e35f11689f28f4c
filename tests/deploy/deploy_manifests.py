"""Rendering the Kubernetes recipe (deploy/kubernetes) and reading what its vLLM containers run.

Shared by the deploy tests: `render` runs `kubectl kustomize` on a kustomization directory (the
committed one, or a patched copy); `kv_transfer_problems` lists, for rendered objects, every
reason a vLLM container's `--kv-transfer-config` would not run our connector as configured.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_nixl_lease.adapter.config import CONFIG_KEYS, LeaseConfig, LeaseConfigError
from vllm_nixl_lease.hook import STOCK_TO_LEASE, env_requests_hook
from vllm_nixl_lease.plugin import LEASE_CONNECTOR_NAMES

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
# Every kustomization an operator applies, relative to deploy/kubernetes.
KUSTOMIZATIONS = ("base", "overlays/llm-d", "monitoring")
# Those that run vLLM, with how many vLLM containers each renders.
VLLM_KUSTOMIZATIONS = {"base": 2, "overlays/llm-d": 2}
KUBECTL = shutil.which("kubectl")
KV_TRANSFER_FLAG = "--kv-transfer-config"


def require_kubectl() -> str:
    if KUBECTL is None:
        pytest.skip("kubectl not found: the Kubernetes recipe is not rendered (install kubectl >= 1.27)")
    return KUBECTL


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` renders; fails the test with kubectl's error."""
    done = subprocess.run(
        [require_kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


@functools.cache
def rendered(name: str) -> tuple[dict[str, Any], ...]:
    """The committed kustomization `name` (a key of KUSTOMIZATIONS), rendered once per process."""
    return tuple(render(KUBERNETES / name))


@dataclass(frozen=True)
class VllmContainer:
    where: str  # "Deployment/name container"
    container: dict[str, Any]

    @property
    def env(self) -> dict[str, str]:
        """Plain-valued environment variables (those from fieldRefs map to '')."""
        return {e["name"]: str(e.get("value", "")) for e in self.container.get("env", [])}

    def kv_transfer_config(self) -> dict[str, Any]:
        """The JSON after `--kv-transfer-config` (one argument, or `--kv-transfer-config=...`)."""
        args = [str(a) for a in self.container.get("args", [])]
        for i, arg in enumerate(args):
            if arg == KV_TRANSFER_FLAG and i + 1 < len(args):
                text = args[i + 1]
            elif arg.startswith(KV_TRANSFER_FLAG + "="):
                text = arg.split("=", 1)[1]
            else:
                continue
            loaded = json.loads(text)
            if not isinstance(loaded, dict):
                raise ValueError(f"{KV_TRANSFER_FLAG} is not a JSON object: {text}")
            return loaded
        raise ValueError(f"no {KV_TRANSFER_FLAG} argument")


def _is_vllm(container: dict[str, Any]) -> bool:
    words = [str(w) for w in [*container.get("command", []), *container.get("args", [])]]
    return container.get("name") == "vllm" or "serve" in words[:2] or KV_TRANSFER_FLAG in " ".join(words)


def vllm_containers(objects: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> Iterator[VllmContainer]:
    """Every container of a pod template that runs `vllm serve` (named `vllm`, or serving)."""
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            if _is_vllm(container):
                yield VllmContainer(f"{obj['kind']}/{obj['metadata']['name']} {container['name']}", container)


@functools.cache
def upstream_extra_keys() -> frozenset[str]:
    """The `kv_connector_extra_config` keys the installed vLLM's NIXL connector reads."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    nixl = Path(spec.origin).parent / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl"
    source = "".join(p.read_text() for p in sorted(nixl.glob("*.py")))
    keys = frozenset(re.findall(r'get_from_extra_config\(\s*"(\w+)"', source))
    assert {"backends", "kv_lease_duration"} <= keys, f"vLLM's NIXL sources moved: found {sorted(keys)}"
    return keys


LEASE_KEYS = frozenset(key.name for key in CONFIG_KEYS)


def _connector_problem(vc: VllmContainer, ktc: dict[str, Any]) -> str | None:
    """Why this container would not load our connector, or None."""
    name = ktc.get("kv_connector")
    module_path = ktc.get("kv_connector_module_path")
    if module_path is not None:
        if module_path != "vllm_nixl_lease":
            return f"kv_connector_module_path is {module_path!r}, not 'vllm_nixl_lease'"
        cls = getattr(importlib.import_module(module_path), str(name), None)
        if cls is None or not cls.__module__.startswith("vllm_nixl_lease."):
            return f"vllm_nixl_lease has no connector named {name!r}"
        return None
    if name in LEASE_CONNECTOR_NAMES:
        return None
    if name in STOCK_TO_LEASE and env_requests_hook(vc.env):
        return None
    return f"kv_connector {name!r} without our module path, our name or VLLM_NIXL_LEASE=1: stock vLLM serves"


def kv_transfer_problems(objects: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[str]:
    """For each vLLM container: its --kv-transfer-config must parse, be a valid KVTransferConfig,
    load our connector, and hold only keys that ours or upstream's NIXL connector read, with
    values LeaseConfig accepts."""
    from vllm.config.kv_transfer import KVTransferConfig

    problems = []
    for vc in vllm_containers(objects):
        try:
            ktc = vc.kv_transfer_config()
        except ValueError as exc:  # json.JSONDecodeError is one
            problems.append(f"{vc.where}: {exc}")
            continue
        try:
            KVTransferConfig(**ktc)
        except Exception as exc:  # pydantic's ValidationError, TypeError: whatever vLLM would refuse
            problems.append(f"{vc.where}: vLLM refuses the kv-transfer-config: {exc}")
        if (problem := _connector_problem(vc, ktc)) is not None:
            problems.append(f"{vc.where}: {problem}")
        extra = ktc.get("kv_connector_extra_config", {})
        # LeaseConfig skips keys it does not know (upstream's share the dict), so a misspelt
        # lease key would silently fall back to its default: only known keys pass here.
        unknown = sorted(set(extra) - LEASE_KEYS - upstream_extra_keys())
        if unknown:
            problems.append(f"{vc.where}: kv_connector_extra_config has unknown keys {unknown}")
        try:
            LeaseConfig.from_extra_config(extra)
        except LeaseConfigError as exc:
            problems.append(f"{vc.where}: {exc}")
    return problems
