"""The demo's bookkeeping without servers: alerts go to the chapter they fired in, the table and
the figure come out of recorded chapters (with and without Prometheus series)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import demo
from tools.demo_story import Chapter


def _side(t0: float, ours: bool) -> list[Chapter]:
    numbers = {
        1: {"routed": 3, "equal_p_alone": 3},
        2: {"served": 4, "held_s": 18.0, "expired": 0.0},
        3: {"wrong_with_http_200": 0 if ours else 4, "http_200": 4, "fenced_on_d": 4.0 if ours else 0.0,
            "reads_after_expiry_on_p": 0.0 if ours else 4.0},
        4: {"reclaim_after_last_heartbeat_s": 10.0, "extension_s": 10, "inflight_failed_within_s": 0.6},
    }  # fmt: skip
    return [Chapter(n, t0 + 30 * (n - 1), t0 + 30 * n - 5, {"held": True}, numbers[n]) for n in range(1, 5)]


class _FakeProm:
    def __init__(self, onsets: list[tuple[float, dict]]) -> None:
        self.onsets = onsets

    def alert_onsets(self, start: float, end: float) -> list[tuple[float, dict]]:
        return [o for o in self.onsets if start <= o[0] <= end]


def test_alerts_are_attributed_to_side_and_chapter() -> None:
    t0 = demo.T0 + 1
    sides = {"stock": _side(t0, False), "ours": _side(t0 + 200, True)}
    server = _FakeProm([
        (t0 + 70, {"alertname": "NixlKVReadAfterLeaseExpiry", "job": "stock-P"}),
        (t0 + 200 + 88, {"alertname": "NixlLeaseReadsFenced", "job": "ours-D"}),  # 3 s after ch. 3 ends
        (t0 + 200 + 124, {"alertname": "NixlMalformedNotifications", "job": "ours-P"}),  # after the last
    ])  # fmt: skip
    got = demo._alerts(server, sides)  # type: ignore[arg-type]
    assert got["stock"] == {1: [], 2: [], 3: ["NixlKVReadAfterLeaseExpiry (stock-P)"], 4: []}
    assert got["ours"] == {1: [], 2: [], 3: ["NixlLeaseReadsFenced (ours-D)"],
                           4: ["NixlMalformedNotifications (ours-P)"]}  # fmt: skip


def test_table_and_figure_without_prometheus(tmp_path: Path) -> None:
    sides = {"stock": _side(demo.T0, False), "ours": _side(demo.T0 + 200, True)}
    alerts = demo._alerts(None, sides)
    table = demo._table(sides, alerts, {"stock": 60.0, "ours": 61.0})
    assert "3. wrong answers, HTTP 200    4/4" in table and "0/4" in table
    pytest.importorskip("matplotlib", reason="the demo's figure needs matplotlib (make demo installs it)")
    png = demo.timeline.plot(sides, None, tmp_path / "t.png")
    assert png is not None and png.stat().st_size > 10_000
