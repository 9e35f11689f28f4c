"""Make vLLM's stock NIXL connector names resolve to the lease connectors.

``install()`` points the factory registry entries ``NixlConnector``,
``NixlPullConnector`` and ``NixlPushConnector`` at our classes and, when
vLLM's nixl modules are already imported, rebinds those names there too, so
it works whatever was imported first.  The config keeps saying
``"NixlConnector"``, which keeps vLLM's name-based checks (DCP interleave,
Mamba conv layout, ...) active.  ``uninstall()`` restores everything.
Both are idempotent.  Importing this module does not import vLLM.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Any

ENV_VAR = "VLLM_NIXL_LEASE"
ADAPTER_MODULE = "vllm_nixl_lease.vllm.connector"
# stock name -> our class name in ADAPTER_MODULE
STOCK_TO_LEASE: dict[str, str] = {
    "NixlConnector": "LeaseNixlConnector",
    "NixlPullConnector": "LeaseNixlPullConnector",
    "NixlPushConnector": "LeaseNixlPushConnector",
}
_NIXL_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
)
_FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"

_lock = threading.Lock()
# What install() replaced: ("registry", name) or (module, name) -> original
_saved: dict[tuple[str, str], Any] = {}


def env_requests_hook(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def is_installed() -> bool:
    return bool(_saved)


def _lease_loader(class_name: str) -> Any:
    def loader() -> type:
        return getattr(importlib.import_module(ADAPTER_MODULE), class_name)

    loader.__qualname__ = f"vllm_nixl_lease_loader[{class_name}]"
    return loader


def install() -> None:
    """Route the stock connector names to the lease connectors."""
    with _lock:
        if _saved:
            return
        factory = importlib.import_module(_FACTORY_MODULE).KVConnectorFactory
        registry = factory._registry
        for stock, ours in STOCK_TO_LEASE.items():
            _saved[("registry", stock)] = registry.get(stock)
            registry[stock] = _lease_loader(ours)
        # Modules already imported keep their old bindings; rebind them so
        # code that reads e.g. ``nixl.NixlConnector`` sees ours.  Modules not
        # yet imported only matter through the registry, handled above.
        adapters = None
        for mod_name in _NIXL_MODULES:
            module = sys.modules.get(mod_name)
            if module is None:
                continue
            if adapters is None:
                adapters = importlib.import_module(ADAPTER_MODULE)
            for stock, ours in STOCK_TO_LEASE.items():
                if hasattr(module, stock):
                    _saved[(mod_name, stock)] = getattr(module, stock)
                    setattr(module, stock, getattr(adapters, ours))


def uninstall() -> None:
    """Undo ``install()``."""
    with _lock:
        if not _saved:
            return
        registry = importlib.import_module(_FACTORY_MODULE).KVConnectorFactory._registry
        for (where, name), original in _saved.items():
            if where == "registry":
                if original is None:
                    registry.pop(name, None)
                else:
                    registry[name] = original
            elif (module := sys.modules.get(where)) is not None:
                setattr(module, name, original)
        _saved.clear()


def resolved_class(name: str = "NixlConnector") -> type:
    """The class vLLM's factory gives for a registered connector name."""
    factory = importlib.import_module(_FACTORY_MODULE).KVConnectorFactory
    return factory.get_connector_class_by_name(name)
