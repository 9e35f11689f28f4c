"""Floods of our protocol's messages over real NIXL, from rogue agents.

Against our P, while a real D heartbeats requests queued on it:
- ``hellos``: hellos from ``agents`` NIXL agents, ``count`` in all, naming a
  lease P holds (the worst case: a fleet member that saw real params) or a
  key P never issued;
- ``big_hellos``: hellos of about 1 MB (far over ``MAX_HELLO_BYTES``);
- ``malformed_hellos``: every way a hello can be malformed;
- ``missing_tags``: an agent whose hello P admitted sends ``LHBT:`` heartbeats
  naming ``count`` tags P never issued, in messages of D's size, paced over
  ``pace_s`` as a D with that many queued requests would.
Against our D: ``lacks``, a rogue P agent answering ``LACK:`` with a forged
instance and with the real one, for sequence numbers it guesses.

Each rogue runs in its own process (a fork of the harness fork server); the
messages are built there, so nothing large crosses the pipe.  The scenario
measures P's resident memory, its per-step times (the harness's step log)
and D's fences.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from typing import Any

from harness.procs import redirect_output
from vllm_nixl_lease._wire import (
    ESCAPE_PREFIX,
    HELLO_KIND,
    LEASE_PROTOCOL_VERSION,
    acked_heartbeat_message,
    heartbeat_ack_message,
    heartbeat_message,
    hello_message,
    new_instance,
    parse_heartbeat_ack,
)

from .fleet import Fleet, context, wait_for
from .progress import PROGRESS_DELAY_US, sleep_between_events
from .rogue import agent_result
from .scenarios import LEASE, d_id, data_mismatches, hand_to_d, over_ranks, prefill, wait_freed, wait_loaded

HELLO = ESCAPE_PREFIX + HELLO_KIND
TAG_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def malformed_hellos(metadata: bytes, key: str) -> list[bytes]:
    good = hello_message(1.0, metadata, key)
    return [
        HELLO,
        HELLO + b"2",
        HELLO + b"2:1000",
        HELLO + b"2:1000:",
        HELLO + b"2:1000::" + key.encode(),
        HELLO + b"x:1000:AAAA:" + key.encode(),
        HELLO + b"2:-5:AAAA:" + key.encode(),
        HELLO + b"2:1000:!!not-base64!!:" + key.encode(),
        HELLO + b"2:1000:AAAA:\xff\xfe",
        HELLO + b"2:1000:AAAA:a,b",
        HELLO + b"99999999999999999999999:1000:AAAA:" + key.encode(),
        HELLO + b"2:1000:QUFBQUFBQUFB:" + key.encode(),  # metadata that is not NIXL's
        hello_message(1.0, metadata, key, version=LEASE_PROTOCOL_VERSION + 1),  # a newer version
        hello_message(1.0, metadata, "not-a-lease-here"),
        good[:-1] + b"\x00",
        good + b"," + b"x" * 8,
        HELLO + b"\xff" * 64,
    ]


def _agents(n: int, name: str) -> list[Any]:
    from nixl._api import nixl_agent, nixl_agent_config

    return [nixl_agent(f"{name}-{os.getpid()}-{i}", nixl_agent_config(backends=["UCX"])) for i in range(n)]


def _metadata(agent: Any) -> bytes:
    from nixl._bindings import DRAM_SEG, nixlRegDList

    return agent.get_partial_agent_metadata(nixlRegDList(DRAM_SEG), True, ["UCX"])


def _send_all(agent: Any, peer: str, msgs: list[bytes], counts: dict[str, int]) -> None:
    for msg in msgs:
        try:
            agent.send_notif(peer, msg)
            counts["sent"] += 1
            counts["bytes"] += len(msg)
        except Exception:
            counts["failed"] += 1


def _answers(agent: Any) -> list[bytes]:
    return [m for msgs in agent.get_new_notifs().values() for m in msgs]


def flood_main(workdir: str, peer_metadata: bytes, plan: dict[str, Any], conn: Any) -> None:
    """Run one ``plan`` (``kind`` and its fields) against the peer; report counts."""
    redirect_output(os.path.join(workdir, "flood-agent.log"))
    sleep_between_events(PROGRESS_DELAY_US)
    counts = {"sent": 0, "failed": 0, "bytes": 0, "answers": 0, "welcomes": 0}
    try:
        kind = plan["kind"]
        agents = _agents(plan.get("agents", 1), f"flood-{kind}")
        peers = []
        for agent in agents:
            peer = agent.add_remote_agent(peer_metadata)
            peers.append(peer.decode() if isinstance(peer, bytes) else peer)
        rnd = random.Random(plan.get("seed", 23))
        t0 = time.monotonic()
        if kind == "hellos":
            keys = plan["keys"]
            mds = [_metadata(a) for a in agents]
            for i in range(plan["count"]):
                j = i % len(agents)
                _send_all(agents[j], peers[j], [hello_message(1.0, mds[j], keys[i % len(keys)])], counts)
        elif kind == "big_hellos":
            big = hello_message(1.0, rnd.randbytes(plan.get("size", 1 << 20) * 3 // 4), plan["keys"][0])
            for _ in range(plan["count"]):
                _send_all(agents[0], peers[0], [big], counts)
        elif kind == "malformed_hellos":
            msgs = malformed_hellos(_metadata(agents[0]), plan["keys"][0])
            for _ in range(plan["count"]):
                _send_all(agents[0], peers[0], msgs, counts)
        elif kind == "missing_tags":
            _missing_tags(agents[0], peers[0], plan, rnd, counts)
        elif kind == "lacks":
            instances = [plan["instance"], new_instance()]
            per = plan.get("seqs_per_message", 256)
            for i in range(plan["count"]):
                first = 1 + (i * per) % plan.get("max_seq", 100_000)
                msg = heartbeat_ack_message(instances[i % 2], range(first, first + per))
                _send_all(agents[0], peers[0], [msg], counts)
                if plan.get("pace_s"):
                    time.sleep(plan["pace_s"] / plan["count"])
        else:
            raise ValueError(kind)
        send_s = time.monotonic() - t0
        for a in agents:
            for m in _answers(a):
                counts["answers"] += 1
                ack = parse_heartbeat_ack(m)
                counts["welcomes"] += bool(ack is not None and not ack.seqs)
        conn.send(("ok", {**counts, "send_s": send_s}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    conn.recv()  # keep the agents alive until the test has looked


def _missing_tags(
    agent: Any, peer: str, plan: dict[str, Any], rnd: random.Random, counts: dict[str, int]
) -> None:
    """Say hello with a live key, wait for P's welcome, then name ``count`` tags P never issued."""
    md = _metadata(agent)
    deadline = time.monotonic() + 20
    welcomed = False
    while not welcomed and time.monotonic() < deadline:
        _send_all(agent, peer, [hello_message(1.0, md, plan["keys"][0])], counts)
        end = time.monotonic() + 1.0
        while time.monotonic() < end and not welcomed:
            welcomed = any(m.startswith(b"LACK:") for m in _answers(agent))
            time.sleep(0.02)
    if not welcomed:
        raise RuntimeError("P never welcomed the flooding agent")
    counts["welcomes"] += 1
    per_msg = max(1, (plan.get("max_bytes", 32768) - 40) // 12)
    tags = ["".join(rnd.choices(TAG_CHARS, k=11)) for _ in range(plan["count"])]
    chunks = [tags[i : i + per_msg] for i in range(0, len(tags), per_msg)]
    pause = plan.get("pace_s", 0.0) / max(1, len(chunks))
    for seq, chunk in enumerate(chunks, start=1):
        _send_all(agent, peer, [acked_heartbeat_message(seq, heartbeat_message(chunk), tagged=True)], counts)
        if pause:
            time.sleep(pause)
    counts["messages"] = len(chunks)
    # P answers within about one D interval: gather the answers.
    end = time.monotonic() + plan.get("answer_wait_s", 3.0)
    longest = 0
    while time.monotonic() < end:
        for m in _answers(agent):
            counts["answers"] += 1
            longest = max(longest, len(m))
        time.sleep(0.05)
    counts["longest_answer"] = longest


def run_flood(workdir: str, peer_metadata: bytes, plan: dict[str, Any]) -> tuple[Any, Any]:
    """Start one flood; ``collect_flood`` and ``end_flood`` finish it."""
    ctx = context()
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=flood_main, args=(workdir, peer_metadata, plan, theirs), daemon=True)
    proc.start()
    theirs.close()
    return proc, mine


def collect_flood(proc: Any, conn: Any, timeout: float = 120.0) -> dict[str, Any]:
    """What the flood sent.  Its agents stay up until ``end_flood``: UCX hands a
    large message over only while its sender lives."""
    try:
        return agent_result(conn, timeout, "flooding agent")
    except BaseException:
        end_flood(proc, conn)
        raise


def end_flood(proc: Any, conn: Any) -> None:
    try:
        conn.send("bye")
    except Exception:
        pass
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


# step_log tuple (engine.py): (start, took, connector_s, notifs, expired, nixl_s, gc_s, connector_cpu_s, ...)
def _connector_cpu(steps: list[tuple]) -> list[float]:
    """The connector's CPU time per step, less GC pauses."""
    return [max(0.0, s[7] - s[6]) for s in steps]


def _outside_nixl(steps: list[tuple]) -> list[float]:
    """The same, less the time in NIXL's notification calls: what the
    connector's own code costs (NIXL copies a 1 MB notification for stock too)."""
    return [max(0.0, s[7] - s[6] - s[5]) for s in steps]


def _p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else 0.0


def floods_on_p(
    fleet: Fleet, plans: list[dict[str, Any]], n: int = 4, baseline_s: float = 3.0
) -> dict[str, Any]:
    """Our P and our D with ``n`` requests queued on D (held past one lease);
    each plan floods P in turn.  Per plan: P's RSS growth, its worst step's
    connector CPU against the quiet baseline, the flood's counts."""
    p = fleet.start("P", "p", progress_delay_us=PROGRESS_DELAY_US)
    d = fleet.start("D", "d", progress_delay_us=PROGRESS_DELAY_US)
    ids, params = prefill(p, "flooded", n)
    live_tag = next(iter(params.values()))["remote_lease_tag"]
    hand_to_d(d, params, hold=True)
    t_handed = time.monotonic()
    wait_for(lambda: all(p.report()["reqs"][r].get("hb", 0) >= 2 for r in ids), 30, what="heartbeats on P")
    _, p_metadata = p.call("agent_metadata")
    p.timings()  # drop the start-up steps
    time.sleep(baseline_s)
    base_steps = p.timings()["steps"]
    base_cpu, base_own = _connector_cpu(base_steps), _outside_nixl(base_steps)
    base_rss = rss_bytes(p.pid)
    d_stats0 = d.stats()
    results = []
    for plan in plans:
        plan = {**plan, "keys": [live_tag if k == "LIVE" else k for k in plan.get("keys", ["LIVE"])]}
        rss0 = rss_bytes(p.pid)
        t0 = time.monotonic()
        p_stats0 = p.stats()
        d_stats_before = d.stats()
        proc, conn = run_flood(fleet.workdir, p_metadata, plan)
        try:
            sent = collect_flood(proc, conn)
            time.sleep(1.0)  # P drains what is in flight
            steps = p.timings()["steps"]
            p_stats = p.stats()
            d_stats_after = d.stats()
        finally:
            end_flood(proc, conn)
        cpu, own = _connector_cpu(steps), _outside_nixl(steps)
        d_gaps = [g for t, g in d.report()["step_gaps"] if t >= t0]
        res = {
            "d": {
                key: over_ranks(d_stats_after, f"num_{key}") - over_ranks(d_stats_before, f"num_{key}")
                for key in ("heartbeat_acks_recv", "heartbeat_views_renewed", "views_ended", "reads_fenced")
            },
            "kind": plan["kind"],
            "plan": {k: v for k, v in plan.items() if k != "keys"},
            "sent": sent,
            "rss_growth": rss_bytes(p.pid) - rss0,
            "steps": len(steps),
            "max_connector_cpu_s": max(cpu, default=0.0),
            "p99_connector_cpu_s": _p99(cpu),
            "max_outside_nixl_s": max(own, default=0.0),
            "max_step_s": max((s[1] for s in steps), default=0.0),
            "d_max_step_gap_s": max(d_gaps, default=0.0),  # D starved by the flood's processes?
            "refused": over_ranks(p_stats, "num_hellos_refused") - over_ranks(p_stats0, "num_hellos_refused"),
            "malformed": over_ranks(p_stats, "num_malformed_notifs")
            - over_ranks(p_stats0, "num_malformed_notifs"),
            "acks_dropped": over_ranks(p_stats, "num_heartbeat_acks_dropped")
            - over_ranks(p_stats0, "num_heartbeat_acks_dropped"),
        }
        results.append(res)
    # The real D was heartbeating all along: past one lease, let it read.
    time.sleep(max(0.0, t_handed + LEASE + 1 - time.monotonic()))
    during = p.report()
    t_release = time.monotonic()
    d.release()
    p_rep = wait_freed(p, ids, timeout=30)
    d_rep = wait_loaded(d, ids, 30)
    d_stats = d.stats()
    out = {
        "freed_after_release_s": [round(p_rep["reqs"][r]["freed_t"] - t_release, 2) for r in ids],
        "loaded_after_release_s": [round(d_rep["reqs"][d_id(r)]["read_t"] - t_release, 2) for r in ids],
        "ids": ids,
        "baseline": {
            "steps": len(base_cpu),
            "max_connector_cpu_s": max(base_cpu, default=0.0),
            "p99_connector_cpu_s": _p99(base_cpu),
            "max_outside_nixl_s": max(base_own, default=0.0),
            "rss": base_rss,
        },
        "floods": results,
        "rss_growth_total": rss_bytes(p.pid) - base_rss,
        "expired_while_flooded": [r for r in ids if "freed_t" in during["reqs"][r]],
        "freed_by": {r: p_rep["reqs"][r].get("freed_reason") for r in ids},
        "wrong": data_mismatches(p_rep, d_rep, ids),
        "failed": sum(bool(d_rep["reqs"][d_id(r)].get("failed")) for r in ids),
        "fenced": over_ranks(d_stats, "num_reads_fenced") - over_ranks(d_stats0, "num_reads_fenced"),
        "p_errors": p_rep["errors"],
        "d_errors": d_rep["errors"],
    }
    b = out["baseline"]
    print(
        f"\n== floods against our P ({n} requests queued on a real D): baseline over {b['steps']} steps, "
        f"connector CPU per step max {b['max_connector_cpu_s'] * 1e3:.2f} ms, p99 "
        f"{b['p99_connector_cpu_s'] * 1e3:.2f} ms, outside NIXL's calls max "
        f"{b['max_outside_nixl_s'] * 1e3:.2f} ms, RSS {b['rss'] / 2**20:.0f} MiB"
    )
    for res in results:
        s = res["sent"]
        print(
            f"   {res['kind']} {res['plan']}: sent {s['sent']} ({s['bytes'] / 2**20:.1f} MiB, "
            f"{s['failed']} failed) in {s.get('send_s', 0):.1f}s; "
            f"P: RSS {res['rss_growth'] / 2**20:+.1f} MiB, "
            f"connector CPU per step max {res['max_connector_cpu_s'] * 1e3:.2f} ms p99 "
            f"{res['p99_connector_cpu_s'] * 1e3:.2f} ms, outside NIXL's calls max "
            f"{res['max_outside_nixl_s'] * 1e3:.2f} ms, over {res['steps']} steps (longest step "
            f"{res['max_step_s'] * 1e3:.0f} ms wall; D's longest gap between steps "
            f"{res['d_max_step_gap_s'] * 1e3:.0f} ms), refused {res['refused']}, malformed "
            f"{res['malformed']}, answers dropped {res['acks_dropped']}; the flood got {s['answers']} "
            f"answers ({s['welcomes']} welcomes, longest {s.get('longest_answer', 0)} B); real D "
            f"meanwhile {res['d']}"
        )
    print(
        f"   real D: fenced {out['fenced']}, failed {out['failed']}, wrong {len(out['wrong'])}; P freed "
        f"{sorted(set(out['freed_by'].values()))}; "
        f"P RSS {out['rss_growth_total'] / 2**20:+.1f} MiB over all; "
        f"expired while flooded {len(out['expired_while_flooded'])}; after the release: loads ended "
        f"{out['loaded_after_release_s']} s, P freed {out['freed_after_release_s']} s"
    )
    return out


def rogue_p_answers_d(fleet: Fleet, n: int = 4, count: int = 2000) -> dict[str, Any]:
    """A rogue P agent floods our D with ``LACK:`` answers (the real instance
    and a forged one, guessed sequence numbers) while the real P is stopped
    past the extension: D must not renew from them, so it fences every read."""
    p = fleet.start("P", "p", progress_delay_us=PROGRESS_DELAY_US)
    d = fleet.start("D", "d", progress_delay_us=PROGRESS_DELAY_US)
    ids, params = prefill(p, "forged", n)
    instance = next(iter(params.values()))["remote_lease_instance"]
    hand_to_d(d, params, hold=True)
    wait_for(lambda: all(p.report()["reqs"][r].get("hb", 0) >= 2 for r in ids), 30, what="heartbeats on P")
    _, d_metadata = d.call("agent_metadata")
    d_stats0 = d.stats()
    p.freeze()
    try:
        t_frozen = time.monotonic()
        proc, conn = run_flood(
            fleet.workdir, d_metadata, {"kind": "lacks", "instance": instance, "count": count, "pace_s": 4.0}
        )
        try:
            sent = collect_flood(proc, conn)
        finally:
            end_flood(proc, conn)
        # Past the extension since P's last answer: no genuine answer renews D's views now.
        time.sleep(max(0.0, t_frozen + LEASE + 1 - time.monotonic()))
        d.release()
        d_rep = wait_loaded(d, ids, 30)
    finally:
        p.thaw()
    d_stats = d.stats()
    out = {
        "ids": ids,
        "sent": sent,
        "loaded": sum("read_t" in d_rep["reqs"][d_id(r)] for r in ids),
        "failed": sum(bool(d_rep["reqs"][d_id(r)].get("failed")) for r in ids),
        "fenced": over_ranks(d_stats, "num_reads_fenced") - over_ranks(d_stats0, "num_reads_fenced"),
        "ignored": over_ranks(d_stats, "num_heartbeat_acks_ignored")
        - over_ranks(d_stats0, "num_heartbeat_acks_ignored"),
        "renewed": over_ranks(d_stats, "num_heartbeat_views_renewed")
        - over_ranks(d_stats0, "num_heartbeat_views_renewed"),
        # D2a: the stopped P's silence releases D's connection, whose READs upstream then refuses
        "released": over_ranks(d_stats, "num_connections_released_silent")
        - over_ranks(d_stats0, "num_connections_released_silent"),
        "d_errors": d_rep["errors"],
    }
    print(
        f"\n== rogue P answers our D: {sent['sent']} LACK messages ({sent['bytes']} B) while the real P "
        f"was stopped; D ignored {out['ignored']}, views renewed {out['renewed']}, loads "
        f"{out['loaded']}/{n} of which failed {out['failed']}, fenced {out['fenced']}; connection "
        f"released as silent {out['released']} time(s)"
    )
    return out
