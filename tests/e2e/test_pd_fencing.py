"""End-to-end read fencing: D frozen (SIGSTOP) past its lease while P reuses the blocks.

Our connector on both servers, vLLM's kv_load_failure_policy=recompute: every routed completion
must equal P-alone greedy output (recomputed on D), none served from blocks P freed and reused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from harness.serve import fencing
from harness.serve.launcher import BUILD, PDCluster, PDConfig

from .conftest import D_MAX_SEQS, DEVICE, LEASE_S, RESULTS, _dump, skip_unless_servable

# P's cache just above one max-length sequence (2048 tokens / 32): the churn cycles it quickly.
P_BLOCKS = 80


@pytest.fixture(scope="module")
def pd_fence() -> Iterator[PDCluster]:
    skip_unless_servable()
    cfg = PDConfig(
        connector="lease",
        lease_s=LEASE_S,
        num_blocks=P_BLOCKS,
        d_max_num_seqs=D_MAX_SEQS,
        kv_transfer={"kv_load_failure_policy": "recompute"},
        log_dir=BUILD / "e2e-logs" / ("fencing" if DEVICE == "cpu" else f"{DEVICE}-fencing"),
        device=DEVICE,
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


def test_every_metric_in_rules_and_dashboard_is_exposed(pd_fence: PDCluster) -> None:
    """Each `vllm:` name a shipped alert rule or dashboard panel queries is on P's or D's live
    scrape; and, where Debian's prometheus is installed, a real Prometheus scraping both sees
    them too and evaluates every rule without error."""
    from harness.serve import client, prom

    wanted = prom.metric_names()
    scrapes = [client.metrics_text(pd_fence.p_url), client.metrics_text(pd_fence.d_url)]
    assert all(scrapes), "P or D served no /metrics"
    missing = wanted - prom.exposed_names(scrapes)
    assert not missing, f"queried by monitoring/ but not exposed by P or D: {sorted(missing)}"
    if prom.binary() is None:
        return  # the promtool unit tests skip with the install hint; nothing more to check here
    hosts = [u.removeprefix("http://") for u in (pd_fence.p_url, pd_fence.d_url)]
    with prom.Prometheus({"pd": hosts}, pd_fence.cfg.log_dir) as server:
        server.wait_ready()
        seen: set[str] = set()
        deadline = time.time() + 20
        while time.time() < deadline and not wanted <= seen:
            time.sleep(1.0)
            seen = {
                r["metric"]["__name__"] for r in server.query('group by (__name__) ({__name__=~"vllm:.*"})')
            }
        assert wanted <= seen, f"not in Prometheus after scraping P and D: {sorted(wanted - seen)}"
        health = server.rule_health()
        assert health and all(h in ("ok", "unknown") for h in health.values()), health
