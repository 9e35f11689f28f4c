"""Fast, trustworthy KV-cache lease renewal for vLLM's NIXL connector.

The lease core (``LeaseTable``, ``NotificationRouter``, ``HeartbeatTracker``,
``encode_heartbeats``) imports nothing from vLLM.
"""

from __future__ import annotations

from ._implementation import implementation
from .decode import intake, lease_views, view_updates  # noqa: F401  (chosen here, so IMPLEMENTATION counts them)
from .decode.heartbeat_tracker import HeartbeatTracker, encode_heartbeats
from .hook import install, uninstall
from .prefill.lease_table import LeaseTable
from .prefill.notification_router import NotificationRouter
from .prefill.route_result import RouteResult

# "cython" when every core concept runs its Cython module, else "python".
IMPLEMENTATION = implementation()

# The package's one version: pyproject.toml reads it from here when building.
__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATION",
    "HeartbeatTracker",
    "LeaseTable",
    "NotificationRouter",
    "RouteResult",
    "__version__",
    "encode_heartbeats",
    "install",
    "uninstall",
]

# Connector classes, resolved lazily so importing this package stays
# vLLM-free.  Both our names and the stock ones: with
# ``kv_connector_module_path: "vllm_nixl_lease"`` vLLM does
# ``getattr(vllm_nixl_lease, kv_connector)``, and keeping the stock name
# ``NixlConnector`` there keeps vLLM's name-based config checks active.
_LAZY_CONNECTORS = {
    "NixlConnector": "LeaseNixlConnector",
    "NixlPullConnector": "LeaseNixlPullConnector",
    "NixlPushConnector": "LeaseNixlPushConnector",
    "LeaseNixlConnector": "LeaseNixlConnector",
    "LeaseNixlPullConnector": "LeaseNixlPullConnector",
    "LeaseNixlPushConnector": "LeaseNixlPushConnector",
}


def __getattr__(name: str) -> object:
    target = _LAZY_CONNECTORS.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(".adapter.connector", __name__), target)
