"""The D lifecycle instruction cases (``tools/instr/d_lifecycle.py``): every
request they count goes through vLLM's real hooks and ends, on both sides, with
its READ posted and none fenced; the replaced READ posting is given back."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness.upstream_fake import stock_worker_class
from tools.instr.cases import NOW, STEP_S, DEngine, Engines
from tools.instr.d_lifecycle import make_lifecycle, reads_posted_in_memory
from tools.instr.probe import PerfCounter


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Engines:
    return Engines(Path(tmp_path_factory.mktemp("instr-d")))


def run(engines: Engines, ours: bool, plain: bool, queued: int, steps: int) -> tuple[Any, list[str]]:
    env = SimpleNamespace(engines=engines, pickled=True)
    clock = PerfCounter(NOW)
    finished: list[str] = []
    try:
        with reads_posted_in_memory():
            d = make_lifecycle(DEngine, STEP_S)(env, ours, clock, plain)
            d.fill(queued)
            sched = d.d.sched
            real = sched.request_finished

            def request_finished(request: Any, block_ids: Any) -> Any:
                finished.append(request.request_id)
                return real(request, block_ids)

            sched.request_finished = request_finished
            d.churn(steps, 10, None)
    finally:
        clock.restore()
    return d, finished


@pytest.mark.parametrize("plain", [False, True], ids=["acknowledging P", "plain P"])
@pytest.mark.parametrize("queued", [0, 100])
def test_every_request_reads_and_ends_through_the_hooks(engines: Engines, plain: bool, queued: int) -> None:
    steps = 30
    for ours in (True, False):
        d, finished = run(engines, ours, plain, queued, steps)
        # Each step's 10 READs end the next step: all but the last step's.
        assert len(finished) == 10 * (steps - 1)
        assert sorted(finished) == sorted(f"d-{i}" for i in range(len(finished)))  # oldest first
        worker = d.d.worker
        assert set(worker._recving_transfers) == set(d.queue[d.head - 10 : d.head])  # the last step's
        if ours:
            stats = worker.xfer_stats.data
            assert not stats.get("num_reads_fenced") and not stats.get("num_reads_discarded")
            # Views of the queue and of the READs still in flight, none leaked.
            assert len(worker.read_fence.views) <= queued + 20
            d.d.sched.heartbeats.intake.apply()  # the last step's departures, queued for the next
            assert len(d.d.sched.heartbeats.tracker) == queued + 10  # and the READs in flight
            if plain:
                assert sum(stats.get("num_heartbeat_views_renewed", [])) > 0
    assert stock_worker_class()._read_blocks_for_req.__name__ == "_read_blocks_for_req"
