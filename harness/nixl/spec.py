"""What a harness engine is (picklable; imports nothing heavy, so the test
process never loads torch or vLLM)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineSpec:
    """Everything a child needs to build one engine (picklable)."""

    role: str  # "P" or "D"
    stock: bool  # upstream's NixlPullConnector instead of ours
    workdir: str
    side_channel_port: int
    lease: int = 6
    extra: dict[str, Any] = field(default_factory=dict)
    num_blocks: int = 256
    tp_size: int = 1
    kv_heads: int = 1
    step_s: float = 0.02
    # D admits at most this many queued requests per step, like vLLM's
    # max_num_seqs budget; reads of thousands issued in one step would
    # stall the step (and its heartbeats) for seconds on this box.
    max_admit: int = 128
    name: str = ""
    # The engine id (vLLM's kv_transfer_config.engine_id); empty: "<name>-<pid>".
    # A restart under the same id reuses it, as deployments that set it do.
    engine_id: str = ""
    # Seconds added to this engine's time.perf_counter (P and D clocks skewed).
    clock_skew: float = 0.0
    # A host of harness.netns.TwoHosts: the engine (and its TP ranks, forked
    # after it moved) runs in network namespace ``netns``, publishes its side
    # channel on ``host_ip`` and lets UCX use TCP on ``net_device`` only.
    netns: str = ""
    host_ip: str = ""
    net_device: str = ""
    # NIXL progress-thread poll timeout in us (progress.py); 0: NIXL's
    # Python default, a thread spinning one core per agent.
    progress_delay_us: int = 0
    # Digest only the first and last token row of each block (kv_cache.digest_heads):
    # for scenarios where thousands of reads complete in one step.
    sampled_digest: bool = False
    # Extra environment for the engine process (e.g. UCX_* knobs).
    env: dict[str, str] = field(default_factory=dict)
    # Per-request observation: every heartbeat id counted per request, KV
    # digests, every notification and every id D heartbeated kept.  Off at
    # fleet scale (100k leases), where that bookkeeping in Python would cost
    # more than the connector it watches; the engine then keeps counts,
    # per-step timings and one record per heartbeat message (``summary``).
    observe_ids: bool = True
    # Which free block a new request takes: "fifo" (the oldest freed, the
    # default) or "lifo" (the one freed last: a lapsed lease's blocks go to
    # the very next request, the harshest case for a late read).
    block_reuse: str = "fifo"
    # P appends each request's digest to ``written_log_path`` as the step that
    # wrote it ends (flushed), so a P killed or crashed before the harness
    # drained it still tells what it wrote: a read of it can then be judged.
    written_log: bool = False
    # P: NIXL hands the connector none of D's hellos (P's hello handling stopped,
    # as in a slow admission): our D's connections to it are never proven.
    drop_hellos: bool = False
    # Push mode: the NixlPushConnector pair (P WRITEs into the blocks D registers),
    # not the pull one; D's request ids must then match P's (upstream matches them).
    push: bool = False
    # P: False leaves ``remote_lease_protocol_max`` out of the params, as a
    # version-2 P does (D then says hello 2 and gets no clock in P's answers).
    lease_protocol_max: bool = True
    # P: params with the lease deadline and terms only (no protocol, instance or
    # tag), as a version-1 P of ours grants them: our D keeps a plain view.
    plain_params: bool = False
    # Orphan guard: the engine exits this long after it started.
    max_lifetime_s: float = 600.0

    def log_path(self, what: str) -> str:
        """The log of this engine's process ``what`` ("engine", "rank1", ...), where its output goes."""
        return os.path.join(self.workdir, f"{self.name or self.role}-{what}.log")


def written_log_path(workdir: str, name: str, pid: int) -> str:
    """Where a P process (``EngineSpec.written_log``) appends ``{"id", "digest", "t"}`` lines."""
    return os.path.join(workdir, f"{name}-written-{pid}.jsonl")
