"""The demo's figure, drawn from saved data only (the summary and the series read back from the demo's
Prometheus), so `python -m tools.demo --replot` can redraw it without the servers.

On top, the one comparison that matters: wrong answers served with HTTP 200 when D reads blocks P
has reused (chapter 3), stock against ours. Below, one row per chapter: stock and ours side by side,
every series as Prometheus scraped it (what an operator would see), and the chapter's numbers and
verdicts in a column of their own, beside the axes, never over the data. Chapter 5 (fleet scale)
comes last when the fleet benchmark's rows exist.

Every series that a summary number describes must end at that number (`disagreements`): the demo
turns a mismatch into a failed claim.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.demo_story import CHAPTERS

SCRAPE_S = 1.0  # the demo's Prometheus scrape interval
# Consecutive samples further apart than this: the scrapes in between failed (target frozen or dead).
GAP_S = 2.5 * SCRAPE_S


@dataclass(frozen=True)
class Series:
    label: str
    role: str  # "P" or "D": the side's job it is scraped from ("<side>-P")
    metric: str  # the name as exposed (counters end in _total)
    counter: bool  # drawn as the increase since the chapter started
    number: str | None = None  # the chapter's summary number its last drawn value must equal
    rug: bool = False  # drawn as a tick each time it grows, in a band below zero


_QUEUED = Series("queued on D", "D", "vllm:num_requests_waiting", False)
_HEARTBEATS = Series("heartbeats received on P", "P", "vllm:nixl_lease_heartbeat_ids_received_total", True,
                     rug=True)  # fmt: skip


def _expired(number: str) -> Series:
    return Series("expired on P", "P", "vllm:nixl_num_kv_expired_reqs_total", True, number)


def _leased(number: str | None = None) -> Series:
    return Series("leased on P", "P", "vllm:nixl_lease_active", False, number)


SERIES: dict[int, list[Series]] = {
    1: [Series("NIXL reads on D", "D", "vllm:nixl_xfer_time_seconds_count", True, "nixl_reads_on_d")],
    2: [_QUEUED, _leased(), _expired("expired"), _HEARTBEATS],
    3: [_QUEUED, _expired("expired"),
        Series("fenced on D", "D", "vllm:nixl_lease_reads_fenced_total", True, "fenced_on_d"),
        Series("read after expiry on P", "P", "vllm:nixl_num_notifications_after_expiry_total", True,
               "reads_after_expiry_on_p")],
    4: [_QUEUED, _leased("leases_held_after"), _expired("reclaimed"), _HEARTBEATS],
}  # fmt: skip
COLORS = {"queued on D": "tab:orange", "leased on P": "tab:blue", "expired on P": "tab:red",
          "fenced on D": "tab:green", "read after expiry on P": "black", "NIXL reads on D": "tab:purple",
          "heartbeats received on P": "tab:gray"}  # fmt: skip
# A thick pale line under thin ones: "leased" often sits exactly on "queued".
WIDTHS = {"leased on P": 5.0}

# The numbers column: (label, format(numbers) -> str) per chapter.
_ROWS: dict[int, list[tuple[str, Any]]] = {
    1: [("routed answers equal P alone", lambda n: f"{_f(n.get('equal_p_alone'))}/{_f(n.get('routed'))}"),
        ("NIXL reads on D", lambda n: _f(n.get("nixl_reads_on_d")))],
    2: [("queued past the lease, served", lambda n: f"{_f(n.get('served'))}/{_f(n.get('queued'))}"),
        ("time in D's queue", lambda n: f"{_f(n.get('held_s'))} s"),
        ("leases expired on P", lambda n: _f(n.get("expired")))],
    3: [("wrong answers, HTTP 200", lambda n: f"{_f(n.get('wrong_with_http_200'))}/{_f(n.get('requests'))}"),
        ("stale reads fenced on D", lambda n: _f(n.get("fenced_on_d"))),
        ("reads after expiry on P", lambda n: _f(n.get("reads_after_expiry_on_p"))),
        ("leases expired on P", lambda n: _f(n.get("expired"))),
        ("D frozen", lambda n: f"{_f(n.get('frozen_s'))} s")],
    4: [("leases reclaimed by P", lambda n: f"{_f(n.get('reclaimed'))}/{_f(n.get('queued'))}"),
        ("leases held on P after", lambda n: _f(n.get("leases_held_after"))),
        ("reclaim after last heartbeat", lambda n: f"{_f(n.get('reclaim_after_last_heartbeat_s'))} s"),
        ("in-flight requests failed in", lambda n: f"{_f(n.get('inflight_failed_within_s'))} s")],
}  # fmt: skip


def _f(v: object) -> str:
    """A summary number as the table shows it: 4.0 -> "4", None -> "-" (not exported / not measured)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}" if v == int(v) else f"{v:.3g}"
    return str(v)


# -- reading the series back from Prometheus ------------------------------------------------------


def _summed(results: Iterable[dict]) -> list[list[float]]:
    """The raw samples of one target's series, summed per scrape (one target: shared timestamps)."""
    total: dict[float, float] = {}
    for r in results:
        for t, v in r["values"]:
            total[float(t)] = total.get(float(t), 0.0) + float(v)
    return [[t, total[t]] for t in sorted(total)]


def window(samples: Sequence[Sequence[float]], t0: float, t1: float) -> list[list[float]]:
    """The samples a chapter [t0, t1] shows: from the last scrape at or before t0 (the state the
    chapter starts from) to the last scrape at or before t1."""
    inside = [list(s) for s in samples if s[0] <= t1]
    before = [i for i, s in enumerate(inside) if s[0] <= t0]
    return inside[before[-1] if before else 0 :]


def collect(prom: Any, chapters: dict[str, list[Any]]) -> dict[str, dict[str, dict[str, list]]]:
    """side -> chapter number (str) -> label -> [[wall time, value], ...]: every raw scrape of each
    chapter's series (summed over the target's label sets), from the scrape the chapter starts from."""
    out: dict[str, dict[str, dict[str, list]]] = {}
    for side, chs in chapters.items():
        for ch in chs:
            span_ms = round((ch.t1 - ch.t0 + 5 * SCRAPE_S) * 1000)
            got = {}
            for s in SERIES[ch.n]:
                res = prom.query(f'{s.metric}{{job="{side}-{s.role}"}}[{span_ms}ms]', at=ch.t1)
                pts = window(_summed(res), ch.t0, ch.t1)
                if pts:  # stock exports no lease series
                    got[s.label] = pts
            out.setdefault(side, {})[str(ch.n)] = got
    return out


# -- the consistency rule --------------------------------------------------------------------------


def drawn(points: Sequence[Sequence[float]], counter: bool) -> list[tuple[float, float]]:
    """The values as drawn: a counter as its increase since the chapter's first sample."""
    base = points[0][1] if counter and points else 0.0
    return [(t, v - base) for t, v in points]


def disagreements(n: int, numbers: dict, chapter_series: dict[str, list]) -> list[str]:
    """Where a series the chapter's summary number describes does not end at that number.

    A counter the target never exported counted nothing (ends at 0, as the summary's readings of
    /metrics take it); a gauge with a number must have been scraped."""
    out = []
    for s in SERIES[n]:
        want = numbers.get(s.number) if s.number else None
        if want is None:
            continue
        pts = chapter_series.get(s.label)
        if not pts:
            if s.counter and float(want) == 0:
                continue
            out.append(f"{s.label}: no samples in the window, the summary says {s.number} = {_f(want)}")
            continue
        last = drawn(pts, s.counter)[-1][1]
        if abs(last - float(want)) > 1e-6:
            out.append(f"{s.label} ends at {_f(last)}, the summary says {s.number} = {_f(want)}")
    return out


# -- drawing ---------------------------------------------------------------------------------------


def _with_gaps(points: list[tuple[float, float]], t_end: float) -> tuple[list[float], list[float]]:
    """x, y for a post-step line that breaks where scrapes failed: each sample holds for at most
    one scrape interval past the next missing scrape, and the last one reaches the window's end
    only if the target was still being scraped then."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (t, v) in enumerate(points):
        if i and t - points[i - 1][0] > GAP_S:
            xs.append(points[i - 1][0] + SCRAPE_S)
            ys.append(float("nan"))
        xs.append(t)
        ys.append(v)
    if points:
        last = points[-1][0]
        xs.append(t_end if t_end - last <= GAP_S else last + SCRAPE_S)
        ys.append(ys[-1])
    return xs, ys


def _chapter_axes(ax: Any, side: str, ch: dict, pts_by_label: dict[str, list] | None, ymax: float) -> None:
    t0, t1 = ch["t0"], ch["t1"]
    ax.set_title(f"{side} · {ch['n']}. {CHAPTERS.get(ch['n'], ch.get('title', ''))}", fontsize=9, loc="left")
    # Bands kept free of data: below zero for the heartbeat ticks, above ymax for the event labels.
    lo, hi = -0.24 * ymax, 1.4 * ymax
    ax.set_ylim(lo, hi)
    step = max(1, round(ymax / 4))
    ax.set_yticks(range(0, int(ymax) + 1, step))
    ax.axhline(0, color="0.85", linewidth=0.8, zorder=0)
    xmin = -0.5
    if pts_by_label is None:
        ax.text(0.5, 0.5, "no Prometheus: no series\n(apt-get install -y prometheus)", transform=ax.transAxes,
                ha="center", va="center", fontsize=8, color="0.4")  # fmt: skip
    else:
        for s in SERIES[ch["n"]]:
            pts = pts_by_label.get(s.label)
            if not pts:
                continue
            shown = [(t - t0, v) for t, v in drawn(pts, s.counter)]
            xmin = min(xmin, shown[0][0])
            if s.rug:
                grew = [t for (t, v), (_, prev) in zip(shown[1:], shown, strict=False) if v > prev]
                ax.vlines(grew, lo * 0.85, lo * 0.3, color=COLORS[s.label], linewidth=1.0)
                continue
            xs, ys = _with_gaps(shown, t1 - t0)
            wide = WIDTHS.get(s.label)
            ax.step(xs, ys, where="post", color=COLORS[s.label], linewidth=wide or 1.6,
                    alpha=0.35 if wide else 1.0, zorder=1 if wide else 2)  # fmt: skip
    for t, label in ch.get("events", []):
        x = t - t0
        fault = "kill" in label or "frozen" in label
        ax.axvline(x, color="tab:red" if fault else "tab:green", linestyle="--", linewidth=1.0, zorder=0)
        right = x > 0.75 * (t1 - t0)
        ax.annotate(label, (x, 0.97), xycoords=("data", "axes fraction"), xytext=(-3 if right else 3, 0),
                    textcoords="offset points", ha="right" if right else "left", va="top", fontsize=7.5,
                    color="tab:red" if fault else "tab:green")  # fmt: skip
    ax.set_xlim(xmin, t1 - t0 + 1.0)
    ax.set_xlabel("seconds into the chapter", fontsize=7)
    ax.tick_params(labelsize=7)


def _lines(ax: Any, lines: list[tuple[str, dict]], fontsize: float = 8.5) -> None:
    """Text lines from the top of a bare axes, each with its own style (monospace for alignment),
    long ones wrapped to the axes' width."""
    fig = ax.figure
    height_in = ax.get_position().height * fig.get_figheight()
    width_chars = int(ax.get_position().width * fig.get_figwidth() * 72 / (0.6 * fontsize) * 0.85)
    dy = fontsize * 1.45 / 72 / height_in
    wrapped = [(part, style) for text, style in lines
               for part in (textwrap.wrap(text, width_chars, subsequent_indent="  ") or [""])]  # fmt: skip
    for i, (text, style) in enumerate(wrapped):
        ax.text(0.0, 1.0 - i * dy, text, transform=ax.transAxes, va="top", ha="left", family="monospace",
                fontsize=fontsize, **style)  # fmt: skip


def _verdicts(ax: Any, n: int, per_side: dict[str, dict], notes: list[str]) -> None:
    ax.axis("off")
    sides = list(per_side)
    rows = [(label, [fmt(per_side[s].get("numbers", {})) for s in sides]) for label, fmt in _ROWS.get(n, [])]
    w0 = max([len(r[0]) for r in rows] + [10])
    ws = [max([len(s)] + [len(r[1][i]) for r in rows]) + 2 for i, s in enumerate(sides)]
    lines: list[tuple[str, dict]] = [(f"{n}. {CHAPTERS.get(n, '')}", {"weight": "bold"})]
    header = "".ljust(w0) + "".join(s.rjust(w) for s, w in zip(sides, ws, strict=True))
    lines.append((header, {"color": "0.35"}))
    lines += [(label.ljust(w0) + "".join(v.rjust(w) for v, w in zip(vals, ws, strict=True)), {})
              for label, vals in rows]  # fmt: skip
    lines.append(("", {}))
    for s in sides:
        claims = per_side[s].get("claims", {})
        failed = [c for c, ok in claims.items() if not ok]
        held = f"{s}: {len(claims) - len(failed)}/{len(claims)} claims held"
        lines.append((held, {"color": "tab:red" if failed else "tab:green", "weight": "bold"}))
        lines += [(f"  FAILED: {c}", {"color": "tab:red"}) for c in failed]
    for s in sides:
        names = [a.split(" (")[0] for a in per_side[s].get("alerts") or []]
        lines.append((f"{s}: alerts fired: {', '.join(names) or 'none'}", {"color": "0.25"}))
    lines += [(note, {"color": "0.35"}) for note in notes]
    _lines(ax, lines)


def _headline(ax: Any, summary: dict) -> None:
    """Chapter 3's answers per side, stacked: wrong with HTTP 200, right, failed (of `requests`)."""
    sides = [s for s, chs in summary["chapters"].items() if any(c["n"] == 3 for c in chs)]
    total = 1.0
    for i, side in enumerate(sides):
        nums = next(c for c in summary["chapters"][side] if c["n"] == 3)["numbers"]
        wrong, ok = float(nums["wrong_with_http_200"]), float(nums["http_200"])
        total = float(nums["requests"])
        y = len(sides) - 1 - i
        ax.barh(y, wrong, color="tab:red", height=0.6)
        ax.barh(y, ok - wrong, left=wrong, color="tab:green", height=0.6)
        ax.barh(y, total - ok, left=ok, color="0.75", height=0.6)
        says = f"{_f(wrong)} of {_f(total)} wrong"
        if nums.get("fenced_on_d"):
            says += f" · D fenced {_f(nums['fenced_on_d'])} stale reads and recomputed"
        if nums.get("reads_after_expiry_on_p"):
            says += f" · P counted {_f(nums['reads_after_expiry_on_p'])} reads of blocks it had freed"
        ax.text(total * 1.03, y, says, va="center", ha="left", fontsize=11,
                color="tab:red" if wrong else "tab:green", weight="bold")  # fmt: skip
    ax.set_yticks(range(len(sides)), list(reversed(sides)), fontsize=11)
    ax.set_xlim(0, total * 2.6)
    ax.set_xticks(range(int(total) + 1))
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel("answers to the requests queued on D (red: wrong, HTTP 200; green: right; grey: failed)",
                  fontsize=8, loc="left")  # fmt: skip
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    ax.set_title("Wrong answers served with HTTP 200 when D reads KV blocks P already reused "
                 "(chapter 3: D frozen past the lease)", fontsize=12, weight="bold", loc="left")  # fmt: skip


def _legend(ax: Any, labels: list[str]) -> None:
    from matplotlib.lines import Line2D

    ax.axis("off")
    handles = []
    for label in labels:
        if label == _HEARTBEATS.label:
            handles.append(Line2D([], [], color=COLORS[label], marker="|", linestyle="none", markersize=9,
                                  label=f"{label} (tick per scrape that saw one)"))  # fmt: skip
        else:
            handles.append(Line2D([], [], color=COLORS[label], linewidth=WIDTHS.get(label, 1.6),
                                  alpha=0.35 if label in WIDTHS else 1.0, label=label))  # fmt: skip
    handles += [Line2D([], [], color="tab:red", linestyle="--", label="fault (D frozen / killed)"),
                Line2D([], [], color="tab:green", linestyle="--", label="recovery")]  # fmt: skip
    ax.legend(handles=handles, loc="center", ncol=(len(handles) + 1) // 2, fontsize=8.5, frameon=False)


def _fleet(ax: Any, text_ax: Any, fleet: list[dict]) -> None:
    xs = [r["leases"] for r in fleet]
    for key, side, color in (("stock_us", "stock", "tab:gray"), ("ours_us", "ours", "tab:blue")):
        ax.plot(xs, [r[key] for r in fleet], marker="o", color=color, label=side)
    ax.set_xscale("log")
    ax.set_xlabel("leases held on P", fontsize=7)
    ax.set_ylabel("µs per P step, p99", fontsize=7)
    ax.set_title("5. P's connector time per step at scale (make bench-fleet)", fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="upper left")
    ax.tick_params(labelsize=7)
    text_ax.axis("off")
    top = max(fleet, key=lambda r: r["leases"])
    _lines(text_ax, [("5. P's connector time per step at scale", {"weight": "bold"}),
                     (f"at {top['leases']:,.0f} leases, p99 per P step:", {}),
                     (f"  stock {top['stock_us']:,.1f} µs", {}),
                     (f"  ours  {top['ours_us']:,.1f} µs", {})])  # fmt: skip


def plot(summary: dict, series: dict | None, out: Path) -> Path | None:
    """Draw summary.json's chapters (and series.json's series, when Prometheus ran) into `out`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no figure (pip install matplotlib)")
        return None
    chapters: dict[str, list[dict]] = summary["chapters"]
    sides = list(chapters)
    numbers = sorted({c["n"] for chs in chapters.values() for c in chs})
    fleet = summary.get("fleet")
    heights = [0.7 + 0.4 * len(sides), 0.3] + [2.0] * len(numbers) + ([2.0] if fleet else [])
    widths = [5.6] * len(sides) + [4.6]
    gap_in = 0.7  # between rows: room for an x label and the next row's title
    fig = plt.figure(figsize=(sum(widths) + 0.8, sum(heights) + gap_in * (len(heights) - 1) + 0.6))
    grid = fig.add_gridspec(len(heights), len(widths), height_ratios=heights, width_ratios=widths,
                            hspace=gap_in / (sum(heights) / len(heights)), wspace=0.1, left=0.045,
                            right=0.995, top=0.975, bottom=0.035)  # fmt: skip
    if 3 in numbers:
        _headline(fig.add_subplot(grid[0, : len(sides)]), summary)
    top_text = fig.add_subplot(grid[0, len(sides)])
    top_text.axis("off")
    held = {s: all(ok for c in chs for ok in c.get("claims", {}).values()) for s, chs in chapters.items()}
    _lines(top_text, [
        ("every claim held: " + ", ".join(f"{s} {'yes' if held[s] else 'NO'}" for s in sides),
         {"weight": "bold", "color": "tab:green" if all(held.values()) else "tab:red"}),
        (f"lease {_f(summary.get('lease_s'))} s · demo wall time {_f(summary.get('wall_s'))} s", {}),
        ("series: the demo's Prometheus, scraped every 1 s" if series is not None
         else "no Prometheus: no series (apt-get install -y prometheus)", {"color": "0.35"}),
        *([(f"5. {summary['fleet_skipped']}", {"color": "0.35"})] if summary.get("fleet_skipped") else []),
    ], fontsize=8)  # fmt: skip
    labels = []
    for n in numbers:
        for x in SERIES[n]:
            present = series is None or any(x.label in series.get(side, {}).get(str(n), {}) for side in sides)
            if x.label not in labels and present:
                labels.append(x.label)
    _legend(fig.add_subplot(grid[1, :]), labels)
    for row, n in enumerate(numbers, start=2):
        per_side = {s: next((c for c in chapters[s] if c["n"] == n), None) for s in sides}
        ymax = 4.0
        for s, ch in per_side.items():
            if ch is None:
                continue
            for label, nums in (series or {}).get(s, {}).get(str(n), {}).items():
                if label != _HEARTBEATS.label:
                    counter = next(x.counter for x in SERIES[n] if x.label == label)
                    ymax = max(ymax, *(v for _, v in drawn(nums, counter)))
            ymax = max(ymax, float(ch["numbers"].get("requests") or ch["numbers"].get("queued") or 0))
        notes = []
        for s, ch in per_side.items():
            if ch is None:
                continue
            ax = fig.add_subplot(grid[row, sides.index(s)])
            got = None if series is None else series.get(s, {}).get(str(n), {})
            _chapter_axes(ax, s, ch, got, ymax)
            missing = [x.label for x in SERIES[n] if got is not None and x.label not in got]
            if missing:
                notes.append(f"{s} exports no {', '.join(missing)}")
        _verdicts(fig.add_subplot(grid[row, len(sides)]), n,
                  {s: c for s, c in per_side.items() if c is not None}, notes)  # fmt: skip
    if fleet:
        _fleet(fig.add_subplot(grid[-1, : len(sides)]), fig.add_subplot(grid[-1, len(sides)]), fleet)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
