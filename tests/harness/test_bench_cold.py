"""``make bench-cold`` (``tools/bench_cold.py``, ``tools/instr/cold.py``): what it times and how it reports.

The figures themselves are the benchmark's (CPU time is no test's business);
these check that a paused stretch is left out, that every byte of the buffer is
rewritten, that a run over the real cases gives each side its rounds, and the
report's arithmetic."""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.bench_cold import main, summarize
from tools.instr.cases import NIXL
from tools.instr.cold import ColdProbe


def spin(ms: float) -> None:
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass


def test_a_paused_stretch_is_not_timed() -> None:
    probe = ColdProbe(repeats=3, evict_bytes=0)

    def call() -> None:
        spin(1)
        probe.pause()
        spin(20)  # a fake peer's work: not the connector's
        probe.resume()

    probe.measure("case", "cython", call, ops=1, warmup=1)
    assert len(probe.records) == 3
    for rec in probe.records:
        assert 1e6 <= rec["ns"] < 10e6, rec


def test_setup_is_not_timed_and_a_per_step_case_times_once() -> None:
    probe = ColdProbe(repeats=5, evict_bytes=0)
    probe.measure("case", "stock", lambda: None, ops=1, setup=lambda: spin(20), warmup=0, repeats=1)
    assert len(probe.records) == 1  # as cases.d_queue asks for each step of an interval: timed once
    assert probe.records[0]["ns"] < 10e6


def test_every_byte_of_the_buffer_is_rewritten_each_time() -> None:
    probe = ColdProbe(repeats=1, evict_bytes=1 << 16)
    assert probe._buffer is not None
    for _ in range(2):
        probe.evict()
        assert probe._buffer.raw == bytes([probe._fill]) * (1 << 16)


def test_bad_repeats_are_refused() -> None:
    with pytest.raises(ValueError, match="repeats"):
        ColdProbe(repeats=0)


def test_the_summary_gives_medians_spread_and_rounds_at_or_below_stock() -> None:
    rows = summarize({"P idle step, 0 leases": {"cython": [10.0, 30.0, 20.0], "stock": [15.0, 25.0, 40.0]}})
    row = rows["P idle step, 0 leases"]
    assert row["cython"] == 20.0 and row["stock"] == 25.0
    assert row["ratio"] == pytest.approx(1.25)
    assert row["cython_spread"] == [10.0, 30.0]
    assert row["rounds_at_or_below_stock"] == 2  # 10 <= 15, 30 > 25, 20 <= 40


@pytest.fixture
def loggers_restored() -> Iterator[None]:
    """The bench sends the connector's loggers into memory; other tests in this worker read them."""
    names = [f"{NIXL}.base_worker", f"{NIXL}.pull_worker", "vllm_nixl_lease", "instr.core"]
    saved = [(lg, lg.handlers[:], lg.propagate, lg.level) for lg in map(logging.getLogger, names)]
    yield
    for lg, handlers, propagate, level in saved:
        lg.handlers[:], lg.propagate = handlers, propagate
        lg.setLevel(level)


@pytest.mark.usefixtures("loggers_restored")
def test_a_run_over_the_real_cases_times_both_sides_in_every_round(tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    assert main(["--cases", "P idle step, 0 ", "--rounds", "2", "--repeats", "3", "--evict-mib", "1",
                 "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["handovers"]) == {"pickled", "in-process"}
    for rows in result["handovers"].values():
        row = rows["P idle step, 0 leases"]
        for side in ("cython", "stock"):
            assert len(row["rounds"][side]) == 2
            assert all(us > 0 for us in row["rounds"][side])
    assert time.perf_counter() != 1000.0 and gc.isenabled()  # the held clock and the GC given back


def test_an_unknown_case_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--cases", "no such case", "--json", str(tmp_path / "x.json")])


def test_by_default_every_gate_case_of_an_engine_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make bench-cold`` follows the gate: a case added to it is timed with no other change."""
    import tools.bench_cold as bench_cold
    from tools.instr.cases import CASES, Case

    default = bench_cold.selected(None)
    assert default == [c.name for c in CASES if c.gate and not c.core and c.group != "parts"]
    assert any(n.startswith("D idle step") for n in default) and any(n.startswith("ack:") for n in default)
    assert not any(n.startswith(("core:", "parts:")) for n in default)
    new = Case("D churn step, a new gate case", "d_churn", "step", 1, lambda probe, env: None, gate=True)
    monkeypatch.setattr(bench_cold, "CASES", [*CASES, new])
    assert bench_cold.selected(None)[-1] == new.name
    assert new.name not in bench_cold.selected(["P idle"])  # a pattern picks by name, gate or not
