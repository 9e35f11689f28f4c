"""Imported once by the fork server so that engines start as cheap forks.

Building the first ``VllmConfig`` and resolving the attention backend import
most of vLLM lazily (over a minute of CPU on a busy 2-core box); doing it
here once means every engine fork finds it done.  Nothing here may start a
thread, a NIXL agent or a socket, nor run a torch op (OpenMP's pool does not
survive a fork: the child hangs in its first parallel op).
"""

import tempfile

import torch  # noqa: F401
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector  # noqa: F401
import vllm.v1.worker.utils  # noqa: F401
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

import vllm_nixl_lease.adapter.connector  # noqa: F401

from . import engine, kv_cache  # noqa: F401


def _warm() -> None:
    from vllm.distributed.nixl_utils import check_nixl_version

    # functools.cache'd, and it scans every installed distribution (~12 s here).
    check_nixl_version("1.5.0")
    with tempfile.TemporaryDirectory() as tmp:
        spec = kv_cache.EngineSpec(role="P", stock=True, workdir=tmp, side_channel_port=0)
        vc = kv_cache.vllm_config(spec, "warmup")
        with set_current_vllm_config(vc):
            get_current_attn_backends(vc)


_warm()
