"""The run as a figure: faults as bands per host, reads per D (ok, failed or
fenced, stale) and leases held per P (requests written and not yet freed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checker import Result

KIND_COLORS = {
    "partition": "tab:red",
    "partition_group": "tab:orange",
    "asym": "tab:pink",
    "flap": "tab:purple",
    "stop": "tab:gray",
    "kill": "black",
    "starve": "tab:brown",
}
BIN_S = 2.0


def draw(events: list[dict[str, Any]], res: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    run = next((e for e in events if e["ev"] == "run"), {})
    engines: dict[str, dict[str, str]] = run.get("engines", {})
    hosts = sorted({v["host"] for v in engines.values()})
    host_of = {n: v["host"] for n, v in engines.items()}
    ds = sorted(n for n, v in engines.items() if v["role"] == "D")
    ps = sorted(n for n, v in engines.items() if v["role"] == "P")
    end_t = events[-1]["t"] if events else 1.0
    fig, axes = plt.subplots(3, 1, figsize=(16, 9), sharex=True, gridspec_kw={"height_ratios": [2, 3, 2]})
    ax = axes[0]
    for f in res.faults:
        rows = f.hosts if f.hosts else tuple(host_of.get(e, "?") for e in f.engines)
        for h in rows:
            if h in hosts:
                y = hosts.index(h)
                ax.barh(
                    y,
                    f.end - f.start,
                    left=f.start,
                    height=0.8,
                    color=KIND_COLORS.get(f.kind, "tab:blue"),
                    alpha=0.6,
                )
    ax.set_yticks(range(len(hosts)))
    ax.set_yticklabels([f"{h} ({','.join(n for n, v in engines.items() if v['host'] == h)})" for h in hosts])
    ax.set_title(f"chaos, seed {run.get('seed')}, {run.get('impl')}: faults per host")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()],
        ncol=7,
        fontsize=7,
        loc="upper right",
    )
    heal = next((e["t"] for e in events if e["ev"] == "heal_all"), None)
    written = {e["id"]: e["digest"] for e in events if e["ev"] == "written"}
    nbins = int(end_t // BIN_S) + 1
    xs = [i * BIN_S for i in range(nbins)]
    if run.get("lane") == "serve":
        _answers(axes[1], events, xs, nbins)
        _p_sizes(axes[2], events, ps)
    else:
        _reads(axes[1], events, ds, written, xs, nbins)
        _leases(axes[2], events, ps)
    for a in axes:
        if heal is not None:
            a.axvline(heal, color="tab:blue", linestyle="--", linewidth=1)
    axes[-1].set_xlabel("seconds since the run began (dashed: final heal)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _reads(
    ax: Any, events: list[dict[str, Any]], ds: list[str], written: dict[str, str], xs: list[float], nbins: int
) -> None:
    for j, d in enumerate(ds):
        ok = [0] * nbins
        failed = [0] * nbins
        stale = [0] * nbins
        for e in events:
            if e["ev"] != "read" or e["d"] != d:
                continue
            i = int(e["t"] // BIN_S)
            if e["failed"]:
                failed[i] += 1
            elif written.get(e["id"]) == e["digest"]:
                ok[i] += 1
            else:
                stale[i] += 1
        base = j * 3
        ax.step(
            xs,
            [base + min(1.0, v / 20.0) for v in ok],
            where="post",
            color="tab:green",
            label="ok (per 2 s, 20 = full)" if j == 0 else None,
        )
        ax.step(
            xs,
            [base + 1 + min(1.0, v / 5.0) for v in failed],
            where="post",
            color="tab:orange",
            label="failed load: fenced, discarded or failed READ (5 = full)" if j == 0 else None,
        )
        ax.bar(
            [x for x, v in zip(xs, stale, strict=True) if v],
            [0.9] * sum(1 for v in stale if v),
            bottom=base + 2,
            width=BIN_S,
            color="red",
            label="stale read" if j == 0 else None,
        )
    ax.set_yticks([j * 3 + 1.5 for j in range(len(ds))])
    ax.set_yticklabels(ds)
    ax.set_title("reads per D")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _leases(ax: Any, events: list[dict[str, Any]], ps: list[str]) -> None:
    for p in ps:
        delta: dict[float, int] = {}
        ids = {e["id"] for e in events if e["ev"] == "request" and e["p"] == p}
        for e in events:
            if e["ev"] == "written" and e["id"] in ids:
                delta[e["t"]] = delta.get(e["t"], 0) + 1
            elif e["ev"] == "freed" and e["p"] == p:
                delta[e["t"]] = delta.get(e["t"], 0) - 1
        ts, held, n = [], [], 0
        for t in sorted(delta):
            n = max(0, n + delta[t])
            ts.append(t)
            held.append(n)
        ax.step(ts, held, where="post", label=p)
        ax.set_yscale("symlog")
    ax.set_title("leases held per P (kill: the process's leases vanish with it)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _answers(ax: Any, events: list[dict[str, Any]], xs: list[float], nbins: int) -> None:
    """Serve lane: routed answers per bin, as P alone / failed or timed out / stale (HTTP 200, other text)."""
    rows = {"as P alone": [0] * nbins, "failed or timed out": [0] * nbins, "stale": [0] * nbins}
    for e in events:
        if e["ev"] == "answer":
            key = "as P alone" if e["equal"] else "stale" if e["status"] == 200 else "failed or timed out"
            rows[key][int(e["t"] // BIN_S)] += 1
    for (label, counts), color in zip(rows.items(), ("tab:green", "tab:orange", "red"), strict=True):
        ax.step(xs, counts, where="post", color=color, label=label)
    ax.set_title(f"routed answers per {BIN_S:.0f} s")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _p_sizes(ax: Any, events: list[dict[str, Any]], ps: list[str]) -> None:
    """Serve lane: P's active leases (ours) and KV blocks in use, as sampled."""
    for p in ps:
        for key in ("leases_active", "kv_blocks_used"):
            pts = [
                (e["t"], e["sizes"][key])
                for e in events
                if e["ev"] == "sizes" and e["engine"] == p and key in e["sizes"]
            ]
            if pts:
                ax.plot([t for t, _ in pts], [v for _, v in pts], marker=".", label=f"{p} {key}")
    ax.set_title("P's leases held and KV blocks in use (sampled)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
