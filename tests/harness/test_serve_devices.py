"""The e2e lane's device parameter (harness/serve/devices.py): the GPU each pytest-xdist worker is
pinned to, and what a `vllm serve` of the launcher gets on "cpu" and on "cuda". Nothing here needs
a GPU: nvidia-smi is a stand-in script, and the server processes are recorded, not started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.serve import devices, launcher

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An nvidia-smi on PATH that lists four GPUs."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(4))
    smi.write_text("#!/bin/sh\n" + lines)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    return smi


def test_each_worker_gets_its_own_gpu_round_robin() -> None:
    gpus = ["0", "1", "2"]
    assert [devices.gpu_for_worker(f"gw{i}", gpus) for i in range(5)] == ["0", "1", "2", "0", "1"]
    with pytest.raises(ValueError):
        devices.gpu_for_worker("master", gpus)
    with pytest.raises(ValueError):
        devices.gpu_for_worker("gw0", [])


@pytest.mark.usefixtures("fake_smi")
def test_visible_gpus_are_nvidia_smis_narrowed_by_cuda_visible_devices() -> None:
    assert devices.visible_gpus({}) == ["0", "1", "2", "3"]
    assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_no_nvidia_smi_means_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert devices.visible_gpus({}) == []
    environ = {"PYTEST_XDIST_WORKER": "gw1"}
    assert devices.pin_xdist_worker(environ) is None
    assert environ == {"PYTEST_XDIST_WORKER": "gw1"}


@pytest.mark.usefixtures("fake_smi")
def test_a_worker_is_pinned_within_the_gpus_it_was_given() -> None:
    environ = {"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert devices.pin_xdist_worker(environ) == "3"
    assert environ["CUDA_VISIBLE_DEVICES"] == "3"
    outside = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert devices.pin_xdist_worker(outside) is None  # not under xdist: left alone
    assert outside["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.usefixtures("fake_smi")
def test_the_e2e_conftest_pins_the_worker_when_it_is_imported() -> None:
    """At import, before any test of the worker runs (and so before CUDA is initialised)."""
    env = dict(os.environ, PYTEST_XDIST_WORKER="gw2", CUDA_VISIBLE_DEVICES="0,1,2,3", PYTHONPATH=str(ROOT))
    code = "import os, tests.e2e.conftest as c; print(os.environ['CUDA_VISIBLE_DEVICES'], c.PINNED_GPU)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2"]


class Recorded:
    """Stands in for harness.procs.Managed: keeps what would have been started."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, cpus: Any = None) -> None:
        self.name, self.argv, self.env, self.cpus = name, argv, env, cpus


def _serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, role: str, **cfg: Any) -> Recorded:
    monkeypatch.setattr(launcher, "Managed", Recorded)
    config = launcher.PDConfig(connector="lease", log_dir=tmp_path, **cfg)
    proc = launcher.server(config, role, tmp_path, tmp_path / "log.json", "127.0.0.1", 8000, 5600, 1, [],
                           tmp_path / f"{role}.log", "lease")  # fmt: skip
    assert isinstance(proc, Recorded)
    return proc


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_cuda_servers_run_the_cuda_wheel_on_their_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for gpus, p_gpu, d_gpu in ((["0"], "0", "0"), (["4", "5"], "4", "5")):
        monkeypatch.setattr(devices, "visible_gpus", lambda gpus=gpus: gpus)
        p = _serve(monkeypatch, tmp_path, "prefill", device="cuda", gpu_memory_utilization=0.25)
        d = _serve(monkeypatch, tmp_path, "decode", device="cuda", gpu_memory_utilization=0.25)
        assert (p.env["CUDA_VISIBLE_DEVICES"], d.env["CUDA_VISIBLE_DEVICES"]) == (p_gpu, d_gpu)
        for proc in (p, d):
            assert proc.argv[0] == str(devices.VENV_CUDA / "bin" / "python")
            assert _arg(proc.argv, "--gpu-memory-utilization") == "0.25"
            assert json.loads(_arg(proc.argv, "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
            assert proc.env["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp"
            assert proc.env["VLLM_TARGET_DEVICE"] == "cuda"
            assert "VLLM_CPU_OMP_THREADS_BIND" not in proc.env
            assert proc.cpus is None


def test_cpu_servers_run_the_cpu_build_pinned_to_a_core(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    proc = _serve(monkeypatch, tmp_path, "decode")
    assert proc.argv[0] == str(devices.VENV_CPU / "bin" / "python")
    assert _arg(proc.argv, "--dtype") == "float32"
    assert "--gpu-memory-utilization" not in proc.argv
    assert json.loads(_arg(proc.argv, "--kv-transfer-config"))["kv_buffer_device"] == "cpu"
    assert proc.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert proc.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "UCX_TLS" not in proc.env or proc.env["UCX_TLS"] == os.environ.get("UCX_TLS")
    assert proc.cpus == {1}


def test_a_cuda_server_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: [])
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        _serve(monkeypatch, tmp_path, "prefill", device="cuda")
    with pytest.raises(ValueError, match="unknown device"):
        devices.venv("rocm")
