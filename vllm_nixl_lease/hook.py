"""Make vLLM's stock NIXL connector names resolve to the lease connectors.

After ``install()``, ``NixlConnector``, ``NixlPullConnector`` and
``NixlPushConnector`` are our classes in vLLM's ``...v1.nixl`` package and its
``...v1.nixl.connector`` module, whichever was imported first:

- modules already imported are rebound at once;
- modules imported later are rebound the moment they finish executing, by a
  post-import hook: a ``sys.meta_path`` finder that wraps their loader.  The
  package's own ``from .connector import NixlConnector`` then already sees ours.

So every import form works: ``from ...nixl import NixlConnector``,
``from ...nixl.connector import NixlConnector``, ``nixl.NixlConnector``, and
vLLM's factory, whose registry loads these names from the ``nixl`` package.
The config keeps saying ``"NixlConnector"``, which keeps vLLM's name-based
checks (DCP interleave, Mamba conv layout, ...) active.

``uninstall()`` removes the finder and restores every name.  Both are
idempotent and thread-safe.  Neither this module nor ``install()`` imports vLLM
(the adapter is imported when a nixl module is).
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

ENV_VAR = "VLLM_NIXL_LEASE"
ADAPTER_MODULE = "vllm_nixl_lease.adapter.connector"
# stock name -> our class name in ADAPTER_MODULE
STOCK_TO_LEASE: dict[str, str] = {
    "NixlConnector": "LeaseNixlConnector",
    "NixlPullConnector": "LeaseNixlPullConnector",
    "NixlPushConnector": "LeaseNixlPushConnector",
}
# Where the stock names live: the defining module first, then the package re-exporting them.
NIXL_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl",
)
_FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"

_lock = threading.RLock()
_finder: _PostImportFinder | None = None
# stock name -> vLLM's own class (captured from the first module that has it)
_stock: dict[str, Any] = {}
# nixl modules loaded but not yet rebound (our adapter was still importing)
_pending: set[str] = set()
# nixl modules whose names we rebound
_rebound: set[str] = set()


def env_requests_hook(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def is_installed() -> bool:
    return _finder is not None


class _HookedLoader(importlib.abc.Loader):
    """Runs the original loader, then ``callback(module)``."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tools that ask
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds ``names`` through the other finders and wraps their loaders."""

    def __init__(self, names: Sequence[str], callback: Callable[[ModuleType], None]) -> None:
        self._names = frozenset(names)
        self._callback = callback

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in self._names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, self._callback)
                return spec
        return None


def _adapter() -> ModuleType | None:
    """Our adapter module once fully imported, else None (absent, or mid-import)."""
    module = sys.modules.get(ADAPTER_MODULE)
    return module if module is not None and hasattr(module, STOCK_TO_LEASE["NixlConnector"]) else None


def _on_loaded(module: ModuleType) -> None:
    """Post-import hook of a nixl module or of our adapter."""
    with _lock:
        if _finder is None:
            return  # uninstalled while this module was loading
        if module.__name__ != ADAPTER_MODULE:
            _pending.add(module.__name__)
            if ADAPTER_MODULE not in sys.modules:
                # Imported before any rebinding, so our classes subclass vLLM's own;
                # its own post-import hook rebinds what is pending.
                importlib.import_module(ADAPTER_MODULE)
                return
        _rebind_pending()


def _rebind_pending() -> None:
    adapters = _adapter()
    if adapters is None:
        return  # the adapter is still importing (it imports vLLM's nixl); its hook comes back here
    ours = {stock: getattr(adapters, name) for stock, name in STOCK_TO_LEASE.items()}
    for name in NIXL_MODULES:  # the defining module first: it holds vLLM's own classes
        module = sys.modules.get(name)
        if name not in _pending or module is None:
            continue
        for stock, lease_cls in ours.items():
            current = getattr(module, stock, None)
            if current is None:
                continue
            if current is not lease_cls:
                _stock.setdefault(stock, current)
            setattr(module, stock, lease_cls)
        _rebound.add(name)
    _pending.clear()


def install() -> None:
    """Route the stock connector names to the lease connectors, now and for later imports."""
    global _finder
    with _lock:
        if _finder is not None:
            return
        _finder = _PostImportFinder((*NIXL_MODULES, ADAPTER_MODULE), _on_loaded)
        sys.meta_path.insert(0, _finder)
        for name in NIXL_MODULES:
            if name in sys.modules:
                _on_loaded(sys.modules[name])


def uninstall() -> None:
    """Undo ``install()``: remove the finder and give every rebound name back to vLLM."""
    global _finder
    with _lock:
        if _finder is None:
            return
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass  # someone else already took it out
        _finder = None
        for name in _rebound:
            module = sys.modules.get(name)
            if module is None:
                continue
            for stock, original in _stock.items():
                if hasattr(module, stock):
                    setattr(module, stock, original)
        _rebound.clear()
        _pending.clear()


def resolved_class(name: str = "NixlConnector") -> type:
    """The class vLLM's factory gives for a registered connector name."""
    factory = importlib.import_module(_FACTORY_MODULE).KVConnectorFactory
    cls: type = factory.get_connector_class_by_name(name)
    return cls
