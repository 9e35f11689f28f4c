"""Engine handles that outlive their processes: a ``Node`` is "p0" or "d1" on its
host for the whole run, across SIGSTOPs, kills and restarts (same engine id or
a new one).

Each node has its own thread, the only one that talks to its engine's pipe:
it runs the jobs queued for it (prefills, submits), releases held requests
when their queue wait is over and drains the engine's records into the
history.  A stopped, starved or restarting engine so delays its own node and
nobody else.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from harness.nixl.fleet import EngineProcess, Fleet
from harness.nixl.scenarios import d_id
from harness.nixl.spec import written_log_path

from .history import History

DRAIN_EVERY_S = 0.5
SIZES_EVERY_S = 5.0
JOBS_PER_TURN = 8


CRASH_FID_BASE = 10_000  # crash "faults" get ids above the nemesis's
COPY_SEP = "~"  # D's local id of a request's second submission: ``d-<id>~1``


def local_id(req: dict[str, Any]) -> str:
    """D's local id of one submission of a request (``copy`` 0: the first)."""
    copy = req.get("copy", 0)
    return d_id(req["id"]) + (f"{COPY_SEP}{copy}" if copy else "")


def of_local(local: str) -> tuple[str, int]:
    """(P's request id, copy) of a D local id."""
    rid = local[2:] if local.startswith("d-") else local
    base, sep, copy = rid.rpartition(COPY_SEP)
    return (base, int(copy)) if sep and copy.isdigit() else (rid, 0)


def last_fatal(log_path: str) -> str:
    """The engine log's last line that says why the process died (UCX's Fatal, a traceback's
    end), or for a segfault the functions of its stack, innermost first ("Segfault in a < b <
    ..."): the handler that prints it writes one frame per line and no reason."""
    try:
        with open(log_path, errors="replace") as fh:
            lines = fh.readlines()[-200:]
    except OSError:
        return ""
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if "Segfault encountered" in line:
            frames = re.findall(r", in (\S+)", "".join(lines[i + 1 : i + 40]))
            return ("Segfault in " + " < ".join(f for f in frames if not f.startswith("0x")))[:300]
        if "Fatal" in line or "Error" in line or "Segmentation" in line:
            return line.strip()[-300:]
    last = [line.strip() for line in lines if line.strip()]
    return last[-1][-300:] if last else ""


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Node:
    def __init__(
        self, fleet: Fleet, hist: History, name: str, role: str, host: str, stock: bool, spec: dict[str, Any]
    ) -> None:
        self.fleet, self.hist = fleet, hist
        self.name, self.role, self.host, self.stock = name, role, host, stock
        self.spec = dict(spec)
        self.eng: EngineProcess | None = None
        self.engine_id = ""
        self.gen = 0
        self.port = 0
        self.state = "down"  # up | stopped | down
        self.jobs: queue.Queue[Callable[[EngineProcess], None]] = queue.Queue()
        self.holds: dict[str, float] = {}  # D: local id -> monotonic release time
        self.aborts: dict[str, float] = {}  # D: local id -> when the client cancels it (monotonic)
        self._holds_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_drain = 0.0
        self._last_sizes = 0.0
        self._last_stats: tuple[int, int] = (-1, -1)
        self._drained_writes: set[str] = set()  # P: ids this process's drains reported written
        self.live = 0  # P: leases the harness engine still counts
        self.pending = 0  # D: requests queued or reading
        self.errors = 0
        self.calls_failed = 0
        self.crashes = 0
        self.idle = threading.Event()

    # -- lifecycle ---------------------------------------------------------
    def adopt(self, eng: EngineProcess) -> None:
        """Take over a started engine (first start or restart) and say so in the history."""
        self.eng = eng
        self.engine_id = eng.engine_id
        self.port = eng.spec.side_channel_port
        self._last_stats = (-1, -1)
        self.state = "up"
        self._record(eng.pid, up=True)

    def _record(self, pid: int, up: bool, t: float | None = None) -> None:
        """An engine event in the history: this process generation came up or went down
        (at run time ``t``; None: now)."""
        self.hist.add(
            "engine",
            t=t,
            name=self.name,
            role=self.role,
            host=self.host,
            engine_id=self.engine_id,
            pid=pid,
            gen=self.gen,
            up=up,
        )

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"node-{self.name}", daemon=True)
        self._thread.start()

    def stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(90)

    def pids(self) -> list[int]:
        """The engine's processes (one: the harness engine)."""
        return [] if self.eng is None else [self.eng.pid]

    def freeze(self) -> None:
        assert self.eng is not None
        self.state = "stopped"
        self.eng.freeze()

    def thaw(self) -> None:
        if self.eng is not None and self.state == "stopped":
            self.eng.thaw()
            self.state = "up"

    def kill(self) -> None:
        """kill -9; the queued jobs and held requests go with the process."""
        eng = self.eng
        self.state = "down"
        if eng is None:
            return
        down_at = self.hist.now()  # it runs nothing after the signal; the join can take seconds
        eng.send_signal(signal.SIGKILL)  # not os.kill: a crashed engine's pid may be another's now
        eng.proc.join(10)
        self._record(eng.pid, up=False, t=down_at)
        self._replay_written(eng)
        while not self.jobs.empty():
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                break
        with self._holds_lock:
            self.holds.clear()
            self.aborts.clear()
        self.live = self.pending = 0

    def _replay_written(self, eng: EngineProcess) -> None:
        """A dead P's writes the harness had not drained yet, from its written log."""
        path = written_log_path(eng.spec.workdir, eng.spec.name or eng.spec.role, eng.pid)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return
        h = self.hist
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the last line, cut by the kill
            if rec["id"] not in self._drained_writes:
                h.add("written", t=h.rel(rec["t"]), id=rec["id"], digest=rec["digest"])
        self._drained_writes.clear()
        os.unlink(path)

    def restart(self, same_id: bool) -> None:
        """Start the engine again on its host: under its engine id and side-channel
        port (a restarted pod with a fixed id), or under a new id and port."""
        self.gen += 1
        kw = dict(self.spec, host=self.host)
        # The dead process's torch.distributed file store: a new one must not find its keys.
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.fleet.workdir, f"dist-{self.engine_id}"))
        if same_id:
            kw.update(engine_id=self.engine_id, side_channel_port=self.port)
        else:
            kw.update(engine_id=f"{self.name}-g{self.gen}")
        (eng,) = self.fleet.start_many([(self.role, self.name, kw)], stock=self.stock, start_timeout=180.0)
        self.adopt(eng)

    # -- work ----------------------------------------------------------------
    def enqueue(self, job: Callable[[EngineProcess], None]) -> None:
        if self.state != "down":
            self.jobs.put(job)

    def hold(self, local_ids: list[str], until: float) -> None:
        with self._holds_lock:
            for i in local_ids:
                self.holds[i] = until

    def cancel_at(self, local: str, at: float) -> None:
        """D: the client cancels ``local`` at ``at`` (monotonic), wherever it is then."""
        with self._holds_lock:
            self.aborts[local] = at

    def release_all_holds(self) -> None:
        with self._holds_lock:
            for i in self.holds:
                self.holds[i] = 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            eng = self.eng
            if self.state != "up" or eng is None:
                time.sleep(0.05)
                continue
            if not eng.proc.is_alive() and self.state == "up" and self.eng is eng:
                self._crashed(eng)
                continue
            try:
                self._turn(eng)
            except Exception as exc:  # noqa: BLE001 - a killed engine's pipe breaks mid-call
                if self.state == "up" and self.eng is eng and not eng.proc.is_alive():
                    self._crashed(eng)
                elif self.state == "up" and self.eng is eng:
                    self.calls_failed += 1
                    self.hist.add("error", engine=self.name, text=f"{type(exc).__name__}: {str(exc)[-500:]}")
                    time.sleep(0.5)
            time.sleep(0.02)

    def _crashed(self, eng: EngineProcess) -> None:
        """The engine died without a fault doing it: record a crash (its last
        fatal log line), and restart it under its engine id, as an orchestrator
        restarts a crashed pod (the crash shows as a fault that heals once it runs)."""
        self.crashes += 1
        fid = CRASH_FID_BASE + self.crash_seq()
        why = last_fatal(eng.log)
        self.hist.add("crash", engine=self.name, engine_id=self.engine_id, pid=eng.pid, why=why)
        self.hist.add(
            "fault", fid=fid, kind="crash", hosts=[], engines=[self.name], until=None, detail={"why": why}
        )
        self.kill()
        for _ in range(10):
            try:
                self.restart(same_id=True)
                break
            except Exception as exc:  # noqa: BLE001 - tried again, as a restart loop would
                self.hist.add(
                    "error", engine=self.name, text=f"restart after crash failed: {str(exc)[-300:]}"
                )
                time.sleep(2.0)
        self.hist.add("heal", fid=fid)

    _crash_counter = 0
    _crash_lock = threading.Lock()

    @classmethod
    def crash_seq(cls) -> int:
        with cls._crash_lock:
            cls._crash_counter += 1
            return cls._crash_counter

    def _turn(self, eng: EngineProcess) -> None:
        for _ in range(JOBS_PER_TURN):
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            job(eng)
        now = time.monotonic()
        with self._holds_lock:
            due = [i for i, t in self.holds.items() if t <= now]
            for i in due:
                del self.holds[i]
            cancel = [i for i, t in self.aborts.items() if t <= now]
            for i in cancel:
                del self.aborts[i]
        if due:
            eng.release(due)
        if cancel:
            self._abort(eng, cancel)
        if now - self._last_drain >= DRAIN_EVERY_S:
            self._last_drain = now
            self.drain(eng)
        idle = (
            self.jobs.empty()
            and not self.holds
            and not self.aborts
            and (self.live == 0 if self.role == "P" else self.pending == 0)
        )
        if idle:
            self.idle.set()
        else:
            self.idle.clear()

    def drain(self, eng: EngineProcess, phase: str = "run") -> dict[str, Any]:
        out = eng.call("drain", timeout=120)
        h = self.hist
        for req_id, digest, t in out["written"]:
            h.add("written", t=h.rel(t), id=req_id, digest=digest)
            self._drained_writes.add(req_id)
        for req_id, reason, t, hb_last, hb in out["freed"]:
            h.add(
                "freed",
                t=h.rel(t),
                id=req_id,
                p=self.name,
                reason=reason,
                hb_last=None if hb_last is None else h.rel(hb_last),
                hb=hb,
            )
        for local, failed, digest, t, _admitted, aborted in out["loaded"]:
            rid, copy = of_local(local)
            extra = {k: v for k, v in (("copy", copy), ("aborted", aborted)) if v}
            h.add("read", t=h.rel(t), id=rid, d=self.name, failed=failed, digest=digest, **extra)
        if self.role == "P" and out["steps"]:
            h.add(
                "steps",
                engine=self.name,
                start=[h.rel(s[0]) for s in out["steps"]],
                conn=[round(s[2], 5) for s in out["steps"]],
                pre=[s[3] for s in out["steps"]],
            )
        stats = out["stats"]
        key = (stats.get("num_reads_fenced", 0), stats.get("num_reads_discarded", 0))
        if key != self._last_stats:
            self._last_stats = key
            h.add(
                "stats",
                engine=self.name,
                engine_id=self.engine_id,
                fenced=key[0],
                discarded=key[1],
                failed_transfers=stats.get("num_failed_transfers", 0),
            )
        if out["errors"] > self.errors:
            self.errors = out["errors"]
            h.add("error", engine=self.name, text=out["last_error"])
        self.live = out["live"]
        self.pending = out["waiting"] + out["unread"]
        now = time.monotonic()
        if phase != "run" or now - self._last_sizes >= SIZES_EVERY_S:
            self._last_sizes = now
            h.add(
                "sizes",
                engine=self.name,
                engine_id=self.engine_id,
                phase=phase,
                sizes=out["sizes"]["sizes"],
                keys=out["sizes"]["keys"],
                rss_kb=rss_kb(eng.pid),
                **({"held": out["d_held"]} if out.get("d_held") else {}),
            )
        return out

    def _abort(self, eng: EngineProcess, cancel: list[str]) -> None:
        """The client cancels: each abort in the history with where it found the request."""
        t = self.hist.now()
        for local, where in eng.abort(cancel).items():
            rid, copy = of_local(local)
            self.hist.add(
                "abort",
                t=t,
                id=rid,
                copy=copy,
                d=self.name,
                d_engine=self.engine_id,
                d_gen=self.gen,
                where=where,
            )

    # -- the two jobs ---------------------------------------------------------
    def prefill_job(
        self, reqs: list[dict[str, Any]], route: Callable[[dict[str, Any], dict[str, Any]], None]
    ) -> None:
        """Queue a prefill of ``reqs`` (id, d, blocks, wait_s, ...) on this P; each
        request's kv_transfer_params then go to ``route`` (its D)."""

        def job(eng: EngineProcess) -> None:
            by_blocks: dict[int, list[dict[str, Any]]] = {}
            for r in reqs:
                by_blocks.setdefault(r["blocks"], []).append(r)
            for blocks, group in by_blocks.items():
                ids = [r["id"] for r in group]
                t = self.hist.now()
                params = eng.prefill(ids, tokens=blocks * 32)
                for r in group:
                    self.hist.add("request", t=t, p=self.name, p_engine=self.engine_id, p_gen=self.gen, **r)
                    route(r, params[r["id"]])

        self.enqueue(job)

    def submit_job(self, items: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """Queue ``(request, params)`` on this D; each waits ``wait_s`` in D's queue, and
        one with ``abort_s`` is cancelled by its client that long after it was submitted.
        A request's second submission (the same params) has ``copy`` 1 (``local_id``)."""

        def job(eng: EngineProcess) -> None:
            now = time.monotonic()
            held = [(r, p) for r, p in items if r["wait_s"] > 0]
            free = [(r, p) for r, p in items if r["wait_s"] <= 0]
            for group, hold in ((held, True), (free, False)):
                if group:
                    eng.submit([(local_id(r), p, r["blocks"] * 32) for r, p in group], hold=hold)
            for r, _ in held:
                self.hold([local_id(r)], now + r["wait_s"])
            for r, _ in items:
                if r.get("abort_s") is not None:
                    self.cancel_at(local_id(r), now + r["abort_s"])
            self.pending += len(items)

        self.enqueue(job)
