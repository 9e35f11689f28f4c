"""The P/D harness's own helpers (harness.serve): log parsing and process priority."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import procs
from harness.serve import plog

ROOT = Path(__file__).resolve().parents[2]
T = 1796000000.0  # log lines carry epoch seconds


def _log(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "prefill.log"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_heartbeat_in_flight_at_the_kill_counts_as_the_last(tmp_path: Path) -> None:
    # D sent a heartbeat just before the kill at T + 100; P logged it 3 ms after.
    path = _log(tmp_path, [
        "1796000096.000 DEBUG 1 vllm_nixl_lease: Heartbeat extended 4 of 4 lease(s)",
        "1796000098.000 DEBUG 1 vllm_nixl_lease: Heartbeat extended 4 of 4 lease(s)",
        "1796000100.003 DEBUG 1 vllm_nixl_lease: Heartbeat extended 4 of 4 lease(s)",
        "1796000110.004 DEBUG 1 vllm_nixl_lease: Releasing expired KV blocks for request r1 which ...",
        "1796000120.000 DEBUG 1 vllm_nixl_lease: Heartbeat extended 1 of 1 lease(s)",  # a new D's
    ])  # fmt: skip
    ev = plog.parse(path)
    assert ev.last_heartbeat_before(T + 100.0) == pytest.approx(T + 98.0)
    assert ev.last_heartbeat_of_killed(T + 100.0) == pytest.approx(T + 100.003)
    assert ev.expiries_after(T + 99.0) == [(pytest.approx(T + 110.004), "r1")]


def test_no_reclaim_yet_takes_heartbeats_up_to_a_second_after_the_kill(tmp_path: Path) -> None:
    path = _log(tmp_path, [
        "1796000099.500 DEBUG 1 x: Heartbeat extended lease for request r1",
        "1796000100.400 DEBUG 1 x: Heartbeat extended lease for request r1",
        "1796000105.000 DEBUG 1 x: Heartbeat extended lease for request r2",
    ])  # fmt: skip
    assert plog.parse(path).last_heartbeat_of_killed(T + 100.0) == pytest.approx(T + 100.4)


_PRIORITY_PROBE = """
import os, subprocess, sys, threading
from harness.procs import raise_own_priority
start, want = int(sys.argv[1]), int(sys.argv[2])
try:  # absolute, whatever nice the test run itself has (the threads below inherit it)
    os.setpriority(os.PRIO_PROCESS, 0, start)
except OSError:
    print("SKIP")
    sys.exit(0)
threading.Thread(target=threading.Event().wait, args=(5,), daemon=True).start()  # an existing thread
ok = raise_own_priority(want)
tids = os.listdir("/proc/self/task")
nices = sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in tids})
child = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(ok, len(tids), nices, child)
"""


def _probe(start: int, want: int) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PRIORITY_PROBE, str(start), str(want)],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,  # `tools` imports from cwd
    ).stdout  # fmt: skip
    if out.strip() == "SKIP":
        pytest.skip(f"cannot set nice {start} here (this run's nice is higher, no privilege)")
    ok, threads, rest = out.split(maxsplit=2)
    nices, child = rest.rsplit(maxsplit=1)
    return [ok, threads, nices, child]


def test_raised_priority_reaches_every_thread_and_every_child() -> None:
    ok, threads, nices, child = _probe(12, 9)
    assert int(threads) >= 2
    if os.geteuid() == 0 or ok == "True":  # raising needs CAP_SYS_NICE
        assert (ok, nices, child) == ("True", "[9]", "9")
    else:
        assert (nices, child) == ("[12]", "12")


def test_priority_is_never_lowered() -> None:
    ok, _threads, nices, child = _probe(12, 16)
    assert (ok, nices, child) == ("True", "[12]", "12")


def test_busiest_names_a_process_that_spins() -> None:
    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time() + 20\nwhile time.time() < t: pass"]
    )
    try:
        time.sleep(0.3)
        report = procs.busiest(window_s=1.0, top=50)
    finally:
        spin.kill()
        spin.wait()
    line = next(x for x in report.splitlines() if f"pid {spin.pid:>7} " in x)
    assert float(line.split("%")[0].split()[-1]) > 5  # at least some of a core, under any load


def test_snapshot_tells_a_spinning_main_thread_from_a_sleeping_one() -> None:
    """What the partition report shows of P's and D's processes: main-thread CPU and wait channel."""
    code = (
        "import sys, time\nt = time.time() + 20\n"
        "while sys.argv[1] == 'spin' and time.time() < t: pass\ntime.sleep(20)"
    )
    spin = subprocess.Popen([sys.executable, "-c", code, "spin"])
    idle = subprocess.Popen([sys.executable, "-c", code, "idle"])
    try:
        time.sleep(0.3)
        lines = {
            int(x.split()[0]): x
            for x in (procs.snapshot(spin.pid) + "\n" + procs.snapshot(idle.pid)).splitlines()
        }
    finally:
        for p in (spin, idle):
            p.kill()
            p.wait()
    cpu = {pid: float(line.split(": ")[1].split()[0]) for pid, line in lines.items()}
    assert cpu[spin.pid] > 0.05, lines[spin.pid]  # some of a core, under any load
    assert cpu[idle.pid] < 0.05, lines[idle.pid]
    assert "state S" in lines[idle.pid] and "wchan -" not in lines[idle.pid]


def test_partition_report_never_raises_when_p_is_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The not-expired report is read on a failure: P's /metrics gone or logs missing must not
    replace the failure with another error."""
    from types import SimpleNamespace

    from harness.serve import client, partition

    def gone(*_: object, **__: object) -> str:
        return ""

    pid = os.getpid()
    pd = SimpleNamespace(
        p_url="http://127.0.0.1:9", d_url="http://127.0.0.1:9", r_prom_url="http://127.0.0.1:9",
        prefill=SimpleNamespace(log_path=tmp_path / "missing.log", pid=pid, log_tail=lambda n: ""),
        decode=SimpleNamespace(pid=pid),
    )  # fmt: skip
    blocker = SimpleNamespace(finished_early=False, error="")
    monkeypatch.setattr(client, "metrics_text", gone)
    burst = SimpleNamespace(futures=[])
    report = partition._not_expired_report(pd, 0.0, {}, 0.0, 0.0, blocker, burst)  # type: ignore[arg-type]
    assert "P expired ? (no /metrics)" in report
    assert f"{pid} " in report.split("P's processes:")[1]


class _FakeBlocker:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


class _StalledBurst:
    def __init__(self) -> None:
        self.settled_for: float | None = None

    def settle(self, timeout: float) -> int:
        self.settled_for = timeout
        return 0


@pytest.mark.parametrize("stalls", [1, 2])
def test_a_stalled_set_up_is_tried_once_more_and_then_raised(
    monkeypatch: pytest.MonkeyPatch, stalls: int
) -> None:
    from harness.serve import scenarios

    blockers: list[_FakeBlocker] = []
    stalled = [_StalledBurst() for _ in range(stalls)]
    queued = object()

    def block(pd: object, max_s: float) -> _FakeBlocker:
        blockers.append(_FakeBlocker())
        return blockers[-1]

    def queue(pd: object, n: int, tag: str, max_tokens: int, timeout: float, blocker: object) -> object:
        if len(blockers) <= stalls:
            raise scenarios.QueueStalled("not on D yet", stalled[len(blockers) - 1])  # type: ignore[arg-type]
        return queued

    monkeypatch.setattr(scenarios, "block_decode", block)
    monkeypatch.setattr(scenarios, "queue_behind", queue)
    if stalls == 1:
        with pytest.warns(UserWarning, match="set-up try 1 stalled.*not on D yet"):
            blocker, burst = scenarios.block_and_queue(None, 4, "t", 16, 60.0, max_s=90.0)  # type: ignore[arg-type]
        assert burst is queued and blocker is blockers[1] and not blocker.released
    else:
        with pytest.warns(UserWarning), pytest.raises(scenarios.QueueStalled, match="not on D yet"):
            scenarios.block_and_queue(None, 4, "t", 16, 60.0, max_s=90.0)  # type: ignore[arg-type]
        assert blockers[1].released
    assert blockers[0].released and stalled[0].settled_for == 60.0  # the first try's requests ended
    assert len(blockers) == 2
