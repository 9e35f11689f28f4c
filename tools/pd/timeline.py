"""Samples P's lease metrics over time (a background thread) and draws the demo's PNG timeline."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.pd import client

ACTIVE = "vllm:nixl_lease_active"
HB_IDS = "vllm:nixl_lease_heartbeat_ids_received"
HB_UNKNOWN = "vllm:nixl_lease_heartbeat_ids_unknown"
GRANTED = "vllm:nixl_lease_granted"
EXPIRED = "vllm:nixl_num_kv_expired_reqs"


@dataclass
class Sample:
    t: float
    active: float
    renewed: float  # heartbeat ids that extended a lease (cumulative)
    granted: float
    expired: float


@dataclass
class Sampler:
    url: str
    every_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def mark(self, label: str) -> None:
        self.events.append((time.time(), label))

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def _run(self) -> None:
        while not self._stop.is_set():
            text = client.metrics_text(self.url, timeout=3.0)
            if text:
                m = client.metric_sum
                self.samples.append(
                    Sample(
                        t=time.time(),
                        active=m(text, ACTIVE),
                        renewed=m(text, HB_IDS) - m(text, HB_UNKNOWN),
                        granted=m(text, GRANTED),
                        expired=m(text, EXPIRED),
                    )
                )
            self._stop.wait(self.every_s)


def plot(
    sampler: Sampler, heartbeats: list[float], t0: float, out: Path, title: str, lease_s: int
) -> Path | None:
    """Leased requests on P, heartbeats that renewed leases, the D crash and P's reclaim."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG (pip install matplotlib)")
        return None
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, height_ratios=[3, 1])
    xs = [s.t - t0 for s in sampler.samples]
    active = [s.active for s in sampler.samples]
    expired = [s.expired for s in sampler.samples]
    ax.step(xs, active, where="post", color="tab:blue", label="leased requests on P")
    ax.step(xs, expired, where="post", color="tab:red", label="expired on P (cumulative)")
    colors = {"D killed": "tab:red", "P reclaimed": "tab:green", "new D ready": "tab:purple"}
    ax.set_ylim(0, max([*active, *expired, 1.0]) * 1.25)
    busy_since, shaded = None, False
    for t, label in sorted(sampler.events):  # D busy: requests queue on D, their leases wait on P
        if label == "D slow":
            busy_since = t
        elif busy_since is not None and label in ("D free", "D killed"):
            ax.axvspan(busy_since - t0, t - t0, color="tab:orange", alpha=0.12,
                       label=None if shaded else "D busy: requests queue on D, heartbeats renew")  # fmt: skip
            busy_since, shaded = None, True
    for t, label in sorted(sampler.events):
        if label in ("D slow", "D free"):
            continue
        ax.axvline(t - t0, color=colors.get(label, "grey"), linestyle="--", linewidth=1)
        ax.annotate(label, (t - t0, ax.get_ylim()[1] * 0.97), rotation=90, fontsize=8, va="top", ha="right")
    ax.set_ylabel("requests")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax2.eventplot([[h - t0 for h in heartbeats]], colors="tab:orange", lineoffsets=0.5, linelengths=0.8)
    ax2.set_yticks([])
    ax2.set_ylabel(f"heartbeats\n(lease {lease_s}s)", fontsize=8)
    ax2.set_xlabel("seconds since start of traffic")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
