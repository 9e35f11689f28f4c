"""The demo's figure: one panel per chapter, stock and ours side by side, every series read back
from the demo's Prometheus (what an operator would see), plus chapter 5 from the fleet benchmark."""

from __future__ import annotations

from pathlib import Path

from harness.serve.prom import Prometheus
from tools.demo_story import CHAPTERS, Chapter

# (label, PromQL with {job} = the side's job prefix, cumulative since the chapter start?, axis)
_WAITING = ("queued on D", 'sum(vllm:num_requests_waiting{{job="{job}-D"}})', False, "left")
_EXPIRED = ("expired on P", 'sum(vllm:nixl_num_kv_expired_reqs_total{{job="{job}-P"}})', True, "left")
_LEASED = ("leased on P", 'sum(vllm:nixl_lease_active{{job="{job}-P"}})', False, "left")
_HB = ("heartbeat ids on P (right)", 'sum(vllm:nixl_lease_heartbeat_ids_received_total{{job="{job}-P"}})',
       True, "right")  # fmt: skip
SERIES: dict[int, list[tuple[str, str, bool, str]]] = {
    1: [("NIXL reads on D", 'sum(vllm:nixl_xfer_time_seconds_count{{job="{job}-D"}})', True, "left")],
    2: [_WAITING, _LEASED, _EXPIRED, _HB],
    3: [_WAITING, _EXPIRED,
        ("fenced on D", 'sum(vllm:nixl_lease_reads_fenced_total{{job="{job}-D"}})', True, "left"),
        ("read after expiry on P", 'sum(vllm:nixl_num_notifications_after_expiry_total{{job="{job}-P"}})',
         True, "left")],
    4: [_WAITING, _LEASED, _EXPIRED, _HB],
}  # fmt: skip
_COLORS = {"queued on D": "tab:orange", "leased on P": "tab:blue", "expired on P": "tab:red",
           "fenced on D": "tab:green", "read after expiry on P": "black", "NIXL reads on D": "tab:purple",
           "heartbeat ids on P (right)": "tab:gray"}  # fmt: skip


def _summary_text(ch: Chapter, keys: list[str]) -> str:
    lines = [f"{k.replace('_', ' ')}: {ch.numbers[k]}" for k in keys if ch.numbers.get(k) is not None]
    lines += [f"{'held' if v else 'FAILED'}: {c}" for c, v in ch.claims.items()]
    return "\n".join(lines)


_KEYS = {1: ["equal_p_alone", "routed"], 2: ["served", "held_s", "expired"],
         3: ["wrong_with_http_200", "http_200", "fenced_on_d", "reads_after_expiry_on_p"],
         4: ["reclaim_after_last_heartbeat_s", "inflight_failed_within_s"]}  # fmt: skip


def plot(
    sides: dict[str, list[Chapter]], prom: Prometheus | None, out: Path, fleet: list[dict] | None = None
) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no figure (pip install matplotlib)")
        return None
    names = list(sides)
    rows = len(CHAPTERS) + (1 if fleet else 0)
    fig, axes = plt.subplots(rows, len(names), figsize=(6.5 * len(names), 3.0 * rows), squeeze=False)
    for col, side in enumerate(names):
        for row, ch in enumerate(sides[side]):
            ax = axes[row][col]
            ax.set_title(f"{side} · {ch.n}. {CHAPTERS[ch.n]}", fontsize=9)
            twin = None
            if prom is not None:
                for label, expr, cumulative, axis in SERIES[ch.n]:
                    res = prom.series(expr.format(job=side), ch.t0 - 1, ch.t1 + 1, step=0.5)
                    if not res:
                        continue  # stock exports no lease series
                    pts = res[0][1]
                    base = pts[0][1] if cumulative else 0.0
                    xs, ys = [t - ch.t0 for t, _ in pts], [v - base for _, v in pts]
                    if axis == "right":
                        twin = twin or ax.twinx()
                        twin.plot(xs, ys, color=_COLORS[label], linestyle=":", label=label)
                        twin.tick_params(labelsize=7)
                    else:
                        ax.step(xs, ys, where="post", color=_COLORS[label], label=label)
            for t, label in ch.events:
                color = "tab:red" if ("kill" in label or "frozen" in label) else "tab:green"
                ax.axvline(t - ch.t0, color=color, linestyle="--")
                ax.annotate(label, (t - ch.t0, 0.95), xycoords=("data", "axes fraction"), fontsize=7,
                            rotation=90, va="top", ha="right")  # fmt: skip
            ax.text(0.99, 0.5, _summary_text(ch, _KEYS[ch.n]), transform=ax.transAxes, fontsize=7,
                    ha="right", va="center", bbox={"facecolor": "white", "alpha": 0.8,
                    "edgecolor": "tab:green" if ch.held else "tab:red"})  # fmt: skip
            handles, labels = ax.get_legend_handles_labels()
            if twin is not None:
                h2, l2 = twin.get_legend_handles_labels()
                handles, labels = handles + h2, labels + l2
            if handles:
                ax.legend(handles, labels, loc="upper left", fontsize=7)
            ax.set_xlabel("seconds into the chapter", fontsize=7)
            ax.tick_params(labelsize=7)
    if fleet:
        _plot_fleet(axes[rows - 1], fleet)
    if prom is None:
        fig.suptitle("(no Prometheus: series not shown; apt-get install -y prometheus)", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _plot_fleet(row_axes: list, fleet: list[dict]) -> None:
    """Chapter 5: P's connector time per step at fleet scale, stock and ours (from bench-fleet.json)."""
    xs = [r["leases"] for r in fleet]
    for ax, key, side in zip(row_axes, ("stock_us", "ours_us"), ("stock", "ours"), strict=False):
        ax.plot(xs, [r[key] for r in fleet], marker="o", label=f"{side}: connector time per P step, p99")
        ax.set_xscale("log")
        ax.set_xlabel("leases held on P", fontsize=7)
        ax.set_ylabel("µs per step", fontsize=7)
        ax.set_title(f"{side} · 5. P's connector time per step at scale", fontsize=9)
        ax.legend(fontsize=7)
