"""The three adoption paths: import hook, explicit module path, by name."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import vllm_support  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM loads)

import vllm_nixl_lease
from vllm_nixl_lease import hook, plugin

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def _factory():
    return importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory


def _lease_classes():
    from vllm_nixl_lease.adapter import connector

    return connector


@pytest.fixture
def clean_hook():
    hook.uninstall()
    yield
    hook.uninstall()


def test_install_after_nixl_import_and_uninstall_restores(clean_hook) -> None:
    nixl = importlib.import_module(NIXL)  # imported *before* the hook
    nixl_connector = importlib.import_module(NIXL + ".connector")
    stock = {name: getattr(nixl, name) for name in hook.STOCK_TO_LEASE}
    stock_loaders = {name: _factory()._registry[name] for name in hook.STOCK_TO_LEASE}
    ours = _lease_classes()
    hook.install()
    hook.install()  # idempotent
    for stock_name, lease_name in hook.STOCK_TO_LEASE.items():
        expected = getattr(ours, lease_name)
        assert hook.resolved_class(stock_name) is expected
        assert getattr(nixl, stock_name) is expected
        assert getattr(nixl_connector, stock_name) is expected
    from vllm.config import KVTransferConfig

    cfg = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    assert _factory().get_connector_class(cfg) is ours.LeaseNixlPullConnector
    assert cfg.has_connector("NixlConnector")  # vLLM's name checks still apply
    hook.uninstall()
    hook.uninstall()
    for name, cls in stock.items():
        assert getattr(nixl, name) is cls
        assert getattr(nixl_connector, name) is cls
        assert _factory()._registry[name] is stock_loaders[name]  # never touched
        assert hook.resolved_class(name) is cls
    assert not hook.is_installed()
    assert not any(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path)


def test_module_path_adoption() -> None:
    from vllm.config import KVTransferConfig

    ours = _lease_classes()
    cfg = KVTransferConfig(
        kv_connector="NixlConnector", kv_connector_module_path="vllm_nixl_lease", kv_role="kv_both"
    )
    assert _factory().get_connector_class(cfg) is ours.LeaseNixlPullConnector
    cfg = KVTransferConfig(
        kv_connector="NixlPushConnector", kv_connector_module_path="vllm_nixl_lease", kv_role="kv_both"
    )
    assert _factory().get_connector_class(cfg) is ours.LeaseNixlPushConnector
    assert _factory().supports_hma_config(cfg)
    with pytest.raises(AttributeError):
        vllm_nixl_lease.NoSuchConnector  # noqa: B018


def test_by_name_registration_is_idempotent() -> None:
    plugin.register_connectors()
    plugin.register_connectors()  # the factory would raise on a second real registration
    assert plugin.is_registered()
    from vllm.config import KVTransferConfig

    ours = _lease_classes()
    for name in plugin.LEASE_CONNECTOR_NAMES:
        cfg = KVTransferConfig(kv_connector=name, kv_role="kv_both")
        assert _factory().get_connector_class(cfg) is getattr(ours, name)


def test_plugin_without_env_leaves_stock_names(clean_hook, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hook.ENV_VAR, raising=False)
    plugin.register()
    assert not hook.is_installed()
    monkeypatch.setenv(hook.ENV_VAR, "1")
    plugin.register()
    plugin.register()
    assert hook.is_installed()
    assert hook.resolved_class("NixlConnector") is _lease_classes().LeaseNixlPullConnector


def _entry_point_installed() -> bool:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.value == "vllm_nixl_lease.plugin:register" for ep in eps)


_CHILD = textwrap.dedent(
    """
    import json, sys
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl  # imported before plugins run
    from vllm.plugins import load_general_plugins
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    load_general_plugins()
    out = {}
    for name in ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "LeaseNixlConnector"):
        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both"))
        out[name] = cls.__module__ + "." + cls.__qualname__
    print("RESULT" + json.dumps(out))
    """
)


def _run_child(code_and_args: list[str], env: dict[str, str], cwd: Any) -> dict[str, Any]:
    """Run ``python -c CODE ARGS...`` in a fresh interpreter; return the JSON it
    printed after ``RESULT``."""
    proc = subprocess.run(
        [sys.executable, "-c", *code_and_args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.mark.skipif(not _entry_point_installed(), reason="package not installed with its entry point")
@pytest.mark.parametrize("env_value", ["1", None])
def test_hook_in_fresh_process_with_only_the_env_var(env_value: str | None, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "VLLM_TARGET_DEVICE")}
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if env_value is not None:
        env[hook.ENV_VAR] = env_value
    # cwd not the repo: the installed package must be found
    out = _run_child([_CHILD], env, tmp_path)
    ours = "vllm_nixl_lease.adapter.connector."
    assert out["LeaseNixlConnector"] == ours + "LeaseNixlPullConnector"
    if env_value:
        assert out["NixlConnector"] == ours + "LeaseNixlPullConnector"
        assert out["NixlPullConnector"] == ours + "LeaseNixlPullConnector"
        assert out["NixlPushConnector"] == ours + "LeaseNixlPushConnector"
    else:
        assert not out["NixlConnector"].startswith("vllm_nixl_lease")


# Every order in which a user can combine the hook with vLLM's nixl imports;
# each runs in a fresh interpreter (module state is the point) from the repo root.
_ORDERS = {
    "hook, then vLLM's nixl": "vllm_nixl_lease.install()",
    "vLLM's nixl, then hook": f"import {NIXL}\nvllm_nixl_lease.install()",
    "vLLM's nixl.connector, then hook": f"import {NIXL}.connector\nvllm_nixl_lease.install()",
    "our adapter, then hook": "import vllm_nixl_lease.adapter.connector\nvllm_nixl_lease.install()",
    "hook, then our adapter": "vllm_nixl_lease.install()\nimport vllm_nixl_lease.adapter.connector",
    "hook, then our lazy name": "vllm_nixl_lease.install()\nvllm_nixl_lease.NixlConnector",
    "plugin with the env var": "import os\nos.environ['VLLM_NIXL_LEASE'] = '1'\nplugin.register()",
    "vLLM's nixl, then plugin with the env var": (
        f"import {NIXL}\nimport os\nos.environ['VLLM_NIXL_LEASE'] = '1'\nplugin.register()"
    ),
}

_ORDER_CHILD = """
import json, sys
import vllm_nixl_lease
from vllm_nixl_lease import hook, plugin
NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

def names():
    import importlib
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as from_package
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector as from_module
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.config import KVTransferConfig
    package = importlib.import_module(NIXL)
    module = importlib.import_module(NIXL + ".connector")
    out = {"from package": from_package, "from module": from_module}
    for name in hook.STOCK_TO_LEASE:
        out["package." + name] = getattr(package, name)
        out["module." + name] = getattr(module, name)
        out["factory " + name] = KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector=name, kv_role="kv_both"))
    return {k: v.__module__ + "." + v.__qualname__ for k, v in out.items()}

exec(sys.argv[1])
installed = names()
hook.uninstall()
finder_left = any(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path)
print("RESULT" + json.dumps({"installed": installed, "after": names(), "finder_left": finder_left}))
"""


@pytest.mark.parametrize("order", list(_ORDERS))
def test_every_import_form_in_every_order(order: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != hook.ENV_VAR}
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = _run_child([_ORDER_CHILD, _ORDERS[order]], env, root)
    ours = "vllm_nixl_lease.adapter.connector.LeaseNixl"
    for form, cls in out["installed"].items():
        want = ours + ("PushConnector" if "Push" in form else "PullConnector")
        assert cls == want, (form, cls)
    for form, cls in out["after"].items():
        assert cls.startswith("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.Nixl"), (form, cls)
    assert not out["finder_left"]
