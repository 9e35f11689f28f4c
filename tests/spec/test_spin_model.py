"""The lease protocol's model (``spec/protocol.pml``, ``docs/PROTOCOL.md``
section 7) under spin: every check exhaustive, and every mutation caught.

- Safety S (no READ completes over blocks P freed or another process holds) and
  stock-safety (a stock P never gets ``LHB:``/``LHBT:``): assertions, checked
  over the full state space of each scope (the fault classes in groups: one
  check of all of them together does not fit a minute).
- Liveness L (every queued request is read): the LTL claim ``L`` with no faults;
  and it fails when D never says hello (so the claim is not vacuous).
- Each mutation named in section 7 reintroduces one hole; spin must find a
  counterexample trail, and replaying it must end at the violated assertion.

Skips only when ``spin`` or a C compiler is missing (``make system-deps`` installs both).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[2] / "spec" / "protocol.pml"
SCOPES = ("SCOPE_NET", "SCOPE_RANKS", "SCOPE_RESTART", "SCOPE_ABORT", "SCOPE_TICK")
# mutation -> the scope whose faults expose it
MUTATIONS = {
    "MUT_RENEW_ON_SEND": "SCOPE_NET",
    "MUT_NO_EPOCH": "SCOPE_RESTART",
    "MUT_REMEMBERED_CAPS": "SCOPE_RESTART",
    "MUT_NO_TOMBSTONES": "SCOPE_RESTART",
    "MUT_NO_COMPLETION_MARGIN": "SCOPE_NET",
    "MUT_COMP_ANY_CONN": "SCOPE_ABORT",
    "MUT_DROP_PARKED": "SCOPE_ABORT",
    "MUT_FREE_ON_FIRST_COMPLETION": "SCOPE_READERS",
    "MUT_READ_BEFORE_CLAIM": "SCOPE_READERS",
    "MUT_RENEW_FROM_ARRIVAL": "SCOPE_TICK",
}
# The mutation's counterexample must end at this assertion.
MUTATION_ASSERTS = {
    "MUT_RENEW_ON_SEND": "rd_ok",
    "MUT_NO_EPOCH": "rd_ok",
    "MUT_REMEMBERED_CAPS": "m_kind",
    "MUT_NO_TOMBSTONES": "rd_ok",
    "MUT_NO_COMPLETION_MARGIN": "rd_ok",
    "MUT_COMP_ANY_CONN": "comp_ok",
    "MUT_DROP_PARKED": "dblk_back",
    "MUT_FREE_ON_FIRST_COMPLETION": "rd_ok",
    "MUT_READ_BEFORE_CLAIM": "rd_ok",
    "MUT_RENEW_FROM_ARRIVAL": "rd_ok",
}
# Breadth-first where the space up to the counterexample is small: the shortest trail.
BREADTH_FIRST = {
    "MUT_NO_EPOCH",
    "MUT_REMEMBERED_CAPS",
    "MUT_NO_COMPLETION_MARGIN",
    "MUT_COMP_ANY_CONN",
    "MUT_DROP_PARKED",
    "MUT_FREE_ON_FIRST_COMPLETION",
    "MUT_READ_BEFORE_CLAIM",
    "MUT_RENEW_FROM_ARRIVAL",
}
# SCOPE_READERS's whole space and MUT_TWO_READS take minutes: spec/README.md runs them by hand.
# A search of the whole space must never stop at these bounds.
DEPTH = 200_000
MEMLIM_MB = 2048
# Only a guard against a hung search: `make test` runs these beside other jobs at nice 19, where a
# 25 s search can take minutes.
PAN_TIMEOUT_S = 600


def _tools() -> tuple[str, str]:
    spin, cc = shutil.which("spin"), shutil.which("gcc") or shutil.which("cc")
    if spin is None:
        pytest.skip("spin is not installed: `make system-deps` as root, or `sudo apt-get install -y spin`")
    if cc is None:
        pytest.skip("no C compiler (gcc) to build spin's verifier: `make system-deps` as root installs it")
    return spin, cc


def _pan(
    tmp_path: Path, defines: list[str], cflags: list[str], args: list[str], optimize: str = "-O1"
) -> str:
    """Generate, compile and run spin's verifier for the model with ``defines``; its report.
    ``optimize``: the C compiler's level (-O1: the long searches; -O0 compiles in a
    fifth of the time, for the short ones)."""
    spin, cc = _tools()
    shutil.copy(MODEL, tmp_path / "protocol.pml")
    spin_flags = [f"-D{d}" for d in defines]
    subprocess.run([spin, "-a", *spin_flags, "protocol.pml"], cwd=tmp_path, check=True, capture_output=True)
    subprocess.run(
        [cc, optimize, "-w", f"-DMEMLIM={MEMLIM_MB}", *cflags, "-o", "pan", "pan.c"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    run = subprocess.run(
        ["./pan", f"-m{DEPTH}", "-w24", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=PAN_TIMEOUT_S,
    )
    return run.stdout + run.stderr


def _errors(report: str) -> int:
    found = re.search(r"errors: (\d+)", report)
    assert found, report
    return int(found.group(1))


def _assert_complete(report: str) -> None:
    """The search covered the whole space: no bound cut it short."""
    assert "max search depth too small" not in report, report
    assert "-DMEMLIM bound" not in report and "out of memory" not in report, report
    assert "Search not completed" not in report, report
    assert re.search(r"\d+ states, stored", report), report


@pytest.mark.parametrize("scope", SCOPES)
def test_safety_holds_over_the_whole_space(tmp_path: Path, scope: str) -> None:
    report = _pan(tmp_path, [scope], ["-DSAFETY", "-DNOCLAIM"], [])
    _assert_complete(report)
    assert _errors(report) == 0, report


def test_liveness_without_faults(tmp_path: Path) -> None:
    report = _pan(tmp_path, ["NOFAULT"], [], ["-a", "-N", "L"], optimize="-O0")
    _assert_complete(report)
    assert "never claim         \t+" in report or "never claim" in report, report
    assert _errors(report) == 0, report


def test_liveness_claim_can_fail(tmp_path: Path) -> None:
    """L is not vacuous: a D that never says hello never reads (an acceptance cycle)."""
    report = _pan(tmp_path, ["NOFAULT", "MUT_NO_HELLO"], [], ["-a"], optimize="-O0")
    assert _errors(report) >= 1 and "acceptance cycle" in report, report
    assert (tmp_path / "protocol.pml.trail").is_file(), report


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_mutation_yields_a_counterexample(tmp_path: Path, mutation: str) -> None:
    defines = [MUTATIONS[mutation], mutation]
    search = ["-DBFS"] if mutation in BREADTH_FIRST else []
    report = _pan(tmp_path, defines, ["-DSAFETY", "-DNOCLAIM", *search], [], optimize="-O0")
    assert _errors(report) >= 1, report
    trail = tmp_path / "protocol.pml.trail"
    assert trail.is_file(), report
    spin, _ = _tools()
    replay = subprocess.run(
        [spin, "-t", *[f"-D{d}" for d in defines], "protocol.pml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=PAN_TIMEOUT_S,
    )
    violated = re.search(r"text of failed assertion: assert\(\(?(\w+)", replay.stdout)
    assert violated and violated.group(1) == MUTATION_ASSERTS[mutation], replay.stdout[-2000:]
