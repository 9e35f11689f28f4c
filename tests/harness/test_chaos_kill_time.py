"""A kill is in the history at the signal, not when the dead process was reaped.

Under load the join of a killed engine took 6.4 s in a fresh-clone `make test`
(the kill planned at 58.9 s was recorded at 65.3 s); the checker took the
recorded time as the fault's start and reported the dead D's leases, expiring
meanwhile, as premature expiries with no fault on the pair.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness.chaos.history import History
from harness.chaos.nemesis import Nemesis
from harness.chaos.nodes import Node
from harness.chaos.schedule import Planned

REAP_S = 0.4


class _SlowToReap:
    """An engine process whose join after SIGKILL takes ``REAP_S``."""

    def __init__(self, workdir: Path) -> None:
        self.pid = 424242
        self.signals: list[int] = []
        self.spec = SimpleNamespace(workdir=str(workdir), name="d2", role="D")
        self.proc = SimpleNamespace(join=lambda timeout: time.sleep(REAP_S))

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_kill_is_recorded_when_the_signal_goes(tmp_path: Path) -> None:
    hist = History(tmp_path / "history.jsonl")
    node = Node(fleet=None, hist=hist, name="d2", role="D", host="f", stock=False, spec={})  # type: ignore[arg-type]
    node.eng = _SlowToReap(tmp_path)  # type: ignore[assignment]
    node.state = "up"
    nemesis = Nemesis(hosts=None, nodes={"d2": node}, hist=hist, plan=[], say=lambda line: None)
    nemesis.t0 = hist.t0
    before = hist.now()
    nemesis._begin(Planned(1, "kill", 0.0, 5.0, engines=("d2",)))
    after = hist.now()
    hist.flush()
    assert after - before >= REAP_S
    down = [e for e in _events(tmp_path / "history.jsonl") if e["ev"] in ("engine", "fault")]
    assert [e["ev"] for e in down] == ["engine", "fault"]
    for e in down:  # both at the signal, not at the join's end
        assert before <= e["t"] < before + REAP_S / 2, (e, before, after)
