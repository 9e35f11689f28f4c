"""The demo's bookkeeping without servers: alerts go to the chapter they fired in, the series are read
back per chapter window, every series ends at the summary's number, and the table and the figure
come out of a recorded summary and series (with and without Prometheus)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tools import demo
from tools import demo_timeline as timeline
from tools.demo_story import N_QUEUED, Chapter


def _side(t0: float, ours: bool) -> list[Chapter]:
    numbers = {
        1: {"routed": 3, "equal_p_alone": 3, "nixl_reads_on_d": 3.0},
        2: {"queued": 4, "served": 4, "held_s": 18.0, "expired": 0.0},
        3: {"requests": 4, "wrong_with_http_200": 0 if ours else 4, "http_200": 4, "expired": 4.0,
            "fenced_on_d": 4.0 if ours else 0.0, "reads_after_expiry_on_p": 0.0 if ours else 4.0,
            "frozen_s": 21.0},
        4: {"queued": 4, "reclaimed": 4.0, "leases_at_kill": 4.0 if ours else None,
            "leases_held_after": 0.0 if ours else None, "reclaim_after_last_heartbeat_s": 10.0,
            "extension_s": 10, "inflight_failed_within_s": 0.6},
    }  # fmt: skip
    events = {3: [(t0 + 68.0, "D frozen"), (t0 + 80.0, "D resumes")],
              4: [(t0 + 100.0, "D killed"), (t0 + 110.0, "P reclaimed")]}  # fmt: skip
    return [Chapter(n, t0 + 30 * (n - 1), t0 + 30 * n - 5, {"held": True}, numbers[n], events.get(n, []))
            for n in range(1, 5)]  # fmt: skip


def _steps(t0: float, t1: float, changes: list[tuple[float, float]], start: float = 0.0) -> list[list[float]]:
    """One sample per 1 s scrape from t0 - 0.4 to t1, the value set at each (seconds in, value)."""
    out, t, v = [], t0 - 0.4, start
    while t <= t1:
        for at, value in changes:
            if at <= t - t0:
                v = value
        out.append([t, v])
        t += 1.0
    return out


def _series(sides: dict[str, list[Chapter]]) -> dict:
    """What Prometheus would have scraped, consistent with `_side`'s numbers (counters from a
    non-zero base, D unscraped while frozen and after the kill)."""
    out: dict = {}
    for side, chs in sides.items():
        ours = side == "ours"
        by_n: dict = {}
        for ch in chs:
            a, b = ch.t0, ch.t1
            got: dict = {}
            if ch.n == 1:
                got["NIXL reads on D"] = _steps(a, b, [(2, 11), (4, 12), (6, 13)], start=10)
            elif ch.n == 2:
                got["queued on D"] = _steps(a, b, [(2, 4), (20, 0)])
                got["expired on P"] = _steps(a, b, [], start=3)
                if ours:
                    got["leased on P"] = _steps(a, b, [(1.5, 4), (20, 0)])
                    got["heartbeats received on P"] = _steps(a, b, [(4 + 2 * i, 4 * i) for i in range(9)])
            elif ch.n == 3:
                queued = _steps(a, b, [(3, 4), (20, 0)])
                got["queued on D"] = [p for p in queued if not 8 <= p[0] - a < 20]
                got["expired on P"] = _steps(a, b, [(18, 7)], start=3)
                if ours:
                    fenced = _steps(a, b, [(21, 4)])
                    got["fenced on D"] = [p for p in fenced if not 8 <= p[0] - a < 20]
                got["read after expiry on P"] = _steps(a, b, [] if ours else [(22, 4)])
            else:
                got["queued on D"] = [p for p in _steps(a, b, [(1, 4)]) if p[0] - a < 10]
                got["expired on P"] = _steps(a, b, [(20, 11)], start=7)
                if ours:
                    got["leased on P"] = _steps(a, b, [(1, 4), (20, 0)])
                    got["heartbeats received on P"] = _steps(a, b, [(2 + 2 * i, 4 * i) for i in range(5)])
            by_n[str(ch.n)] = got
        out[side] = by_n
    return out


def _summary(sides: dict[str, list[Chapter]], prometheus: bool = True) -> dict:
    alerts = demo._alerts(None, sides)
    return {"wall_s": 263.0, "lease_s": 15, "chapters": demo._summary_chapters(sides, alerts),
            "fleet": None, "fleet_skipped": "skipped: .build/bench-fleet.json not found",
            "prometheus": prometheus}  # fmt: skip


class _FakeProm:
    def __init__(self, onsets: list[tuple[float, dict]] | None = None, raw: dict | None = None) -> None:
        self.onsets = onsets or []
        self.raw = raw or {}
        self.queries: list[tuple[str, float | None]] = []

    def alert_onsets(self, start: float, end: float) -> list[tuple[float, dict]]:
        return [o for o in self.onsets if start <= o[0] <= end]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        self.queries.append((expr, at))
        return self.raw.get(expr.split("[")[0], [])


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


def test_collect_sums_a_targets_label_sets_and_keeps_the_chapter_window() -> None:
    ch = Chapter(4, t0=1000.0, t1=1020.0)
    sel = 'vllm:nixl_lease_active{job="ours-P"}'
    raw = {sel: [
        {"metric": {"engine": "0"}, "values": [[998.5, "1"], [999.5, "2"], [1000.5, "2"], [1019.5, "0"],
                                               [1020.5, "7"]]},
        {"metric": {"engine": "1"}, "values": [[999.5, "2"], [1000.5, "2"], [1019.5, "0"]]},
    ]}  # fmt: skip
    server = _FakeProm(raw=raw)
    got = timeline.collect(server, {"ours": [ch]})
    # From the scrape the chapter starts from (999.5) to the last one in it; 1020.5 is after t1.
    assert got["ours"]["4"]["leased on P"] == [[999.5, 4.0], [1000.5, 4.0], [1019.5, 0.0]]
    # Each series read over the whole window, as of the chapter's end.
    assert all(at == ch.t1 for _, at in server.queries)
    assert "expired on P" not in got["ours"]["4"]  # no samples: nothing to draw


def test_a_chapter_ends_after_prometheus_scraped_every_target_of_its_pair() -> None:
    class Scrapes:
        """`up` of each job: scraped before the wait began until the third look."""

        def __init__(self) -> None:
            self.looks = 0

        def query(self, expr: str, at: float | None = None) -> list[dict]:
            assert expr == 'timestamp(up{job=~"ours-.*"})'
            self.looks += 1
            stamp = time.time() - (5.0 if self.looks < 3 else 0.0)
            jobs = ["ours-P", "ours-D", "ours-router"] if self.looks != 3 else ["ours-P", "ours-D"]
            return [{"metric": {"job": j}, "value": [time.time(), str(stamp)]} for j in jobs]

    server = Scrapes()
    demo._await_scrape(server, "ours")  # type: ignore[arg-type]
    assert server.looks == 4  # not before every job had a scrape that began after the call


def test_series_must_end_at_the_summarys_numbers() -> None:
    sides = {"stock": _side(5000.0, False), "ours": _side(5200.0, True)}
    series = _series(sides)
    assert demo._check_series(sides, series) == {}
    assert all(ch.claims["the figure's series end at these numbers"] for chs in sides.values() for ch in chs)
    # The window as it was read before each chapter waited for a scrape after its last reading: P's
    # last scrape predates the reclaim, so "leased" stays at 4 and "expired" at 0 while the summary
    # says P reclaimed all 4 and holds none.
    ours4 = series["ours"]["4"]
    before_reclaim = {label: [p for p in pts if p[0] - 5200.0 - 90 < 20] for label, pts in ours4.items()}
    found = timeline.disagreements(4, sides["ours"][3].numbers, before_reclaim)
    assert found == ["leased on P ends at 4, the summary says leases_held_after = 0",
                     "expired on P ends at 0, the summary says reclaimed = 4"]  # fmt: skip
    series["ours"]["4"] = before_reclaim
    assert demo._check_series(sides, series) == {"ours": {4: found}}
    assert not sides["ours"][3].claims["the figure's series end at these numbers"]
    # A gauge the summary has a number for must be there; a counter never exported counted nothing.
    assert timeline.disagreements(4, {"leases_held_after": 0.0}, {}) == [
        "leased on P: no samples in the window, the summary says leases_held_after = 0"
    ]
    assert timeline.disagreements(3, {"fenced_on_d": 0.0}, {}) == []
    assert timeline.disagreements(3, {"fenced_on_d": 2.0}, {})


def test_window_starts_at_the_scrape_before_the_chapter() -> None:
    pts = [[9.5, 1.0], [10.5, 2.0], [11.5, 3.0], [12.5, 4.0]]
    assert timeline.window(pts, 10.0, 12.0) == [[9.5, 1.0], [10.5, 2.0], [11.5, 3.0]]
    assert timeline.window(pts, 9.0, 12.0) == [[9.5, 1.0], [10.5, 2.0], [11.5, 3.0]]
    assert timeline.drawn([[9.5, 10.0], [10.5, 13.0]], counter=True) == [(9.5, 0.0), (10.5, 3.0)]
    assert timeline.drawn([[9.5, 10.0], [10.5, 13.0]], counter=False) == [(9.5, 10.0), (10.5, 13.0)]


def test_table_and_figure_without_prometheus(tmp_path: Path) -> None:
    sides = {"stock": _side(demo.T0, False), "ours": _side(demo.T0 + 200, True)}
    alerts = demo._alerts(None, sides)
    table = demo._table(sides, alerts, {"stock": 60.0, "ours": 61.0})
    cells = [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()]
    rows = {c[0]: c[1:] for c in cells}
    assert rows["3. wrong answers, HTTP 200"] == ["4/4", "0/4"]
    assert rows["4. leases reclaimed, held after"] == ["4/4, -", "4/4, 0"]
    pytest.importorskip("matplotlib", reason="the demo's figure needs matplotlib (make demo installs it)")
    png = timeline.plot(_summary(sides, prometheus=False), None, tmp_path / "t.png")
    assert png is not None and png.stat().st_size > 10_000


def test_figure_from_a_saved_summary_and_series(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the demo's figure needs matplotlib (make demo installs it)")
    from matplotlib import image

    sides = {"stock": _side(7000.0, False), "ours": _side(7200.0, True)}
    summary = _summary(sides)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "series.json").write_text(json.dumps(_series(sides)))
    assert demo.main(["--replot", "--out", str(tmp_path)]) == 0
    png = tmp_path / "timeline.png"
    pixels = image.imread(png)
    assert pixels.shape[0] > 1000 and pixels.shape[1] > 1000
    # The headline's numbers come from the summary: change them and the figure changes.
    summary["chapters"]["stock"][2]["numbers"]["wrong_with_http_200"] = N_QUEUED - 1
    other = timeline.plot(summary, _series(sides), tmp_path / "other.png")
    assert other is not None and png.read_bytes() != other.read_bytes()
