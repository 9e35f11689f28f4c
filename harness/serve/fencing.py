"""Read fencing with real servers: D's forward loop freezes (SIGSTOP) with routed requests queued
until P's leases lapse and P reuses the blocks; then D resumes.

A D that reads now serves other requests' KV with HTTP 200; ours fences the reads (failed loads),
recomputes the prompts (kv_load_failure_policy=recompute) and answers exactly as P alone does.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from harness.procs import signal_tree
from harness.serve import client
from harness.serve.launcher import PDCluster
from harness.serve.scenarios import (
    EXPIRED,
    NOTIF_AFTER_EXPIRY,
    block_and_queue,
    burst_prompts,
    lease_interval,
    p_alone_references,
)

FENCED = "vllm:nixl_lease_reads_fenced"
# Long prompts that cycle P's few KV blocks, so the freed ones are overwritten before D resumes.
CHURN_PROMPT = "Every request that P prefills takes blocks from the front of its free queue. " * 12


@dataclass
class Frozen:
    references: list[str]  # P alone, greedy
    results: list[client.Result]  # routed, queued on D across the freeze
    frozen_s: float
    expired: float  # P's lease expiries during the freeze (the reads' blocks were freed)
    churned: int  # P-alone requests that reused P's blocks while D was frozen
    fenced: float  # D's fenced reads
    notifs_after_expiry: float  # P: completion notifications for leases it had dropped
    t_freeze: float = 0.0  # wall time of the SIGSTOP (D resumes frozen_s later)

    @property
    def mismatches(self) -> int:
        return sum(r.text != ref for r, ref in zip(self.results, self.references, strict=True))


def frozen_decode(pd: PDCluster, n: int = 4, max_tokens: int = 16, timeout: float = 240.0) -> Frozen:
    assert pd.decode is not None
    prompts = burst_prompts(n, "frozen")
    references = p_alone_references(pd, prompts, max_tokens)
    exp0 = client.metric(pd.p_url, EXPIRED)
    nae0 = client.metric(pd.p_url, NOTIF_AFTER_EXPIRY)
    fenced0 = client.metric(pd.d_url, FENCED)
    blocker, burst = block_and_queue(pd, n, "frozen", max_tokens, timeout, max_s=timeout)
    # A couple of heartbeats first, so the leases on P are heartbeat-driven when D stops.
    time.sleep(2 * max(1, lease_interval(pd.cfg.lease_s)) + 1)
    d_pid = pd.decode.pid
    signal_tree(d_pid, signal.SIGSTOP)
    t_freeze = time.time()
    churned = 0
    try:
        deadline = t_freeze + pd.cfg.lease_s + 30
        while client.metric(pd.p_url, EXPIRED) - exp0 < n:
            if time.time() > deadline:
                raise AssertionError("P did not let the frozen D's leases lapse")
            time.sleep(0.5)
        expired = client.metric(pd.p_url, EXPIRED) - exp0
        for i in range(3 * pd.cfg.num_blocks // 10):  # each ~10 blocks: cycles P's whole cache 3x
            r = client.complete(pd.p_url, f"{i} {CHURN_PROMPT}", max_tokens=1, timeout=60)
            if not r.ok:
                raise AssertionError(f"P-alone churn request failed: {r.error}")
            churned += 1
        blocker.release()  # D aborts it on resume and takes the queued requests
    finally:
        signal_tree(d_pid, signal.SIGCONT)
    frozen_s = time.time() - t_freeze
    results = burst.results()
    # An idle P engine does not step, so D's late completion notifications (if any) would wait
    # unread in its NIXL agent: one request makes P step and count them.
    client.complete(pd.p_url, CHURN_PROMPT, max_tokens=2, timeout=60)
    time.sleep(1.5)  # metrics settle
    return Frozen(
        references=references,
        results=results,
        frozen_s=frozen_s,
        expired=expired,
        churned=churned,
        fenced=client.metric(pd.d_url, FENCED) - fenced0,
        notifs_after_expiry=client.metric(pd.p_url, NOTIF_AFTER_EXPIRY) - nae0,
        t_freeze=t_freeze,
    )


def main(argv: list[str] | None = None) -> int:
    """python -m harness.serve.fencing [--no-fence]: run the scenario once and print what D served."""
    import argparse

    from harness.procs import install_signal_handlers
    from harness.serve.launcher import BUILD, PDConfig

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--no-fence", action="store_true", help="lease_fencing=false on D: show the hazard")
    ap.add_argument("--lease", type=int, default=15)
    args = ap.parse_args(argv)
    install_signal_handlers()
    cfg = PDConfig(
        connector="lease", lease_s=args.lease, num_blocks=80, d_max_num_seqs=1,
        kv_transfer={"kv_load_failure_policy": "recompute"},
        kv_extra={"lease_fencing": False} if args.no_fence else {},
        log_dir=BUILD / "fencing" / ("off" if args.no_fence else "on"),
    )  # fmt: skip
    with PDCluster(cfg) as pd:
        pd.progress = print
        out = frozen_decode(pd)
    mode = "off" if args.no_fence else "on"
    print(
        f"fencing {mode}: D frozen {out.frozen_s:.1f}s, P expired {out.expired:.0f}, churned {out.churned}, "
        f"fenced {out.fenced:.0f}, P notifications after expiry {out.notifs_after_expiry:.0f}, "
        f"completions differing from P alone {out.mismatches}/{len(out.results)}"
    )
    for r, ref in zip(out.results, out.references, strict=True):
        print(f"  {'OK  ' if r.text == ref else 'DIFF'} {r.status} {r.text!r} vs P alone {ref!r}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
