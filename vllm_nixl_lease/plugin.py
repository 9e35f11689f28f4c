"""``vllm.general_plugins`` entry point.

vLLM calls it in the API server, engine core and every worker, possibly
several times per process, so everything here is idempotent.
"""

from __future__ import annotations

import importlib
import logging

from .hook import ADAPTER_MODULE, env_requests_hook, install

logger = logging.getLogger(__name__)

# Names registered with KVConnectorFactory (by-name adoption path).
LEASE_CONNECTOR_NAMES: tuple[str, ...] = (
    "LeaseNixlConnector",
    "LeaseNixlPullConnector",
    "LeaseNixlPushConnector",
)


def register_connectors() -> list[str]:
    """Register our connector names; return the ones newly registered."""
    factory = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory
    added = []
    for name in LEASE_CONNECTOR_NAMES:
        # register_connector raises on a taken name; a repeat call is normal.
        if name not in factory._registry:
            factory.register_connector(name, ADAPTER_MODULE, name)
            added.append(name)
    return added


def is_registered() -> bool:
    try:
        factory = importlib.import_module(
            "vllm.distributed.kv_transfer.kv_connector.factory"
        ).KVConnectorFactory
    except Exception:
        return False
    return all(name in factory._registry for name in LEASE_CONNECTOR_NAMES)


def register() -> None:
    """Register the lease connectors; apply the hook when ``VLLM_NIXL_LEASE=1``."""
    register_connectors()
    if env_requests_hook():
        install()
