"""The nemesis: runs a ``schedule`` plan against the hosts and engines, on time.

How each kind is made:

- ``partition``: the host's link loses carrier (``TwoHosts.cut``): both ways, silently;
- ``partition_group``: nftables in every host of the group drops packets to
  and from the hosts outside it (the group still talks inside);
- ``asym``: nftables in the host drops one direction only (``in`` or ``out``);
- ``flap``: the link goes down and up (``down_s``/``up_s``) until the end;
- ``stop``: SIGSTOP of the engine, SIGCONT at the end;
- ``kill``: SIGKILL; at the end a restart under the same engine id (and
  side-channel port) or a new one; healed once the new process is ready;
- ``starve``: the engine's process gets ``share`` of one core (``starve``).

Every fault is written to the history when it starts (with its planned end)
and when it is healed; ``heal_all`` undoes whatever is still in force.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from . import nft, schedule, starve
from .history import History
from .schedule import Planned
from .starve import Starvation


class FaultTarget(Protocol):
    """What the nemesis does to an engine, whichever lane runs it: a harness
    engine (``nodes.Node``) or a `vllm serve` server (``serve_nodes.ServeNode``)."""

    @property
    def name(self) -> str: ...

    @property
    def engine_id(self) -> str: ...

    @property
    def state(self) -> str: ...  # up | stopped | down

    @property
    def eng(self) -> object | None: ...  # the running process's handle, if any

    def pids(self) -> list[int]: ...

    def freeze(self) -> None: ...

    def thaw(self) -> None: ...

    def kill(self) -> None: ...

    def restart(self, same_id: bool) -> None: ...


RESTART_ATTEMPTS = 10
RESTART_BACKOFF_S = 2.0


class Nemesis:
    def __init__(
        self,
        hosts: Any,
        nodes: Mapping[str, FaultTarget],
        hist: History,
        plan: list[Planned],
        say: Callable[[str], None],
    ) -> None:
        self.hosts, self.nodes, self.hist, self.plan, self.say = hosts, nodes, hist, plan, say
        self.active: dict[int, Planned] = {}
        self._undo: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarts: list[threading.Thread] = []
        self.applied: dict[str, int] = {}
        self.failed: list[str] = []
        self.token = f"{id(self) % 100000}"

    # -- running the plan ---------------------------------------------------
    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="nemesis", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        actions: list[tuple[float, int, Planned]] = []
        for f in self.plan:
            actions.append((f.start, 1, f))
            actions.append((f.end, 0, f))  # ends before starts at the same instant
        actions.sort(key=lambda a: (a[0], a[1], a[2].fid))
        for at, is_start, f in actions:
            if self._stop.wait(max(0.0, self.t0 + at - time.monotonic())):
                return
            try:
                if is_start:
                    self._begin(f)
                else:
                    self._end(f)
            except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
                self.failed.append(f"{f.describe()}: {type(exc).__name__}: {exc}")
                self.hist.add("error", engine="nemesis", text=self.failed[-1][-800:])

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        for t in self._restarts:
            t.join(240)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def running(self) -> list[Planned]:
        with self._lock:
            return list(self.active.values())

    def running_line(self) -> str:
        """The faults in force now, for a progress line."""
        return (
            ", ".join(f"#{f.fid} {f.kind} {','.join(f.engines or f.hosts)}" for f in self.running())
            or "no fault"
        )

    # -- one fault --------------------------------------------------------------
    def _ips_outside(self, group: set[str]) -> list[str]:
        return [self.hosts.ip(h) for h in self.hosts.hosts if h not in group]

    def _begin(self, f: Planned) -> None:
        # The fault acts from here: a kill's join of the dead process can take seconds
        # under load, and the checker must not count that time as fault-free.
        began = self.hist.now()
        undo: Callable[[], None] | None = None
        table = f"chaos_{self.token}_{f.fid}"
        if f.kind == "partition":
            (h,) = f.hosts
            self.hosts.cut(h)
            undo = lambda: self.hosts.heal(h)  # noqa: E731
        elif f.kind == "partition_group":
            group = set(f.hosts)
            outside = self._ips_outside(group)
            for h in f.hosts:
                nft.block(self.hosts.netns(h), table, "both", outside)

            def undo() -> None:
                for h in f.hosts:
                    nft.unblock(self.hosts.netns(h), table)

        elif f.kind == "asym":
            (h,) = f.hosts
            nft.block(self.hosts.netns(h), table, f.detail["direction"], self._ips_outside({h}))
            undo = lambda: nft.unblock(self.hosts.netns(h), table)  # noqa: E731
        elif f.kind == "flap":
            (h,) = f.hosts
            flapper = self.hosts.flapping(h, f.detail["down_s"], f.detail["up_s"])
            undo = flapper.stop
        elif f.kind in ("stop", "kill", "starve"):
            (name,) = f.engines
            node = self.nodes[name]
            if node.state != "up" or node.eng is None:
                self.hist.add("skipped", fid=f.fid, kind=f.kind, why=f"{name} is {node.state}")
                return
            if f.kind == "stop":
                node.freeze()
                undo = node.thaw
            elif f.kind == "starve":
                starving = Starvation(f"chaos-{self.token}-{f.fid}", node.pids(), f.detail["share"])
                starving.start()
                undo = starving.stop
            else:
                node.kill()
                undo = lambda: self._restart(f, node)  # noqa: E731
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}")
        assert undo is not None
        with self._lock:
            self.active[f.fid] = f
            self._undo[f.fid] = undo
        self.applied[f.kind] = self.applied.get(f.kind, 0) + 1
        self.hist.add(
            "fault",
            t=began,
            fid=f.fid,
            kind=f.kind,
            hosts=list(f.hosts),
            engines=list(f.engines),
            until=round(self.hist.rel(self.t0 + f.end), 3),
            detail=f.detail,
        )
        self.say(f"fault {f.describe()}")

    def _end(self, f: Planned) -> None:
        with self._lock:
            undo = self._undo.pop(f.fid, None)
        if undo is None:
            return
        undo()
        if f.kind != "kill":  # a kill is healed when its restart is ready
            self._healed(f)

    def _healed(self, f: Planned) -> None:
        with self._lock:
            self.active.pop(f.fid, None)
        self.hist.add("heal", fid=f.fid)

    def _restart(self, f: Planned, node: FaultTarget) -> None:
        def restart() -> None:
            # As an orchestrator restarts a crashed pod: again until it starts (UCX
            # cannot open a device whose link is down: a start during a cut fails).
            try:
                for attempt in range(1, RESTART_ATTEMPTS + 1):
                    try:
                        node.restart(same_id=bool(f.detail.get("same_id")))
                        self.say(f"restarted {node.name} as {node.engine_id} (attempt {attempt})")
                        return
                    except Exception as exc:  # noqa: BLE001
                        self.hist.add("error", engine=node.name, text=f"restart failed: {str(exc)[-300:]}")
                        time.sleep(RESTART_BACKOFF_S)
                self.failed.append(f"restart {node.name}: {RESTART_ATTEMPTS} attempts failed")
            finally:
                self._healed(f)

        t = threading.Thread(target=restart, name=f"restart-{node.name}", daemon=True)
        self._restarts.append(t)
        t.start()

    def heal_all(self) -> None:
        """Undo every fault still in force, wait for restarts, and say so (``heal_all``)."""
        self.stop()
        with self._lock:
            pending = sorted(self._undo.items())
            self._undo.clear()
        for fid, undo in pending:
            try:
                undo()
            except Exception as exc:  # noqa: BLE001
                self.failed.append(f"heal #{fid}: {exc}")
            f = self.active.get(fid)
            if f is not None and f.kind != "kill":
                self._healed(f)
        for t in self._restarts:
            t.join(240)
        for h in self.hosts.hosts:  # nothing of ours may survive in any host
            self.hosts.heal(h)
            for table in nft.tables(self.hosts.netns(h)):
                if table.startswith(f"chaos_{self.token}_"):
                    nft.unblock(self.hosts.netns(h), table)
        for node in self.nodes.values():
            node.thaw()
        self.hist.add("heal_all")


def available_kinds() -> tuple[tuple[str, ...], list[str]]:
    """The fault kinds this machine can make, and why any are left out."""
    kinds = list(schedule.KINDS)
    why = []
    for reason, needs in (
        (nft.unavailable_reason(), ("asym", "partition_group")),
        (starve.unavailable_reason(), ("starve",)),
    ):
        if reason:
            kinds = [k for k in kinds if k not in needs]
            why.append(f"{', '.join(needs)} left out: {reason}")
    return tuple(kinds), why
