"""The instruction cases' P fleet (``tools/instr/cases.py``, ``PFleet``) without
callgrind: 8 D engines pace ``LHBT:`` over the interval, and P sends its answers in
at most one step per answer tick (PROTOCOL P3a); stock sends nothing.  The sending
steps are ``FakeNixlWrapper``'s count."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.upstream_fake import FakeNixlWrapper
from tools.instr.cases import NOW, Engines, PFleet, answer_ticks
from tools.instr.probe import PerfCounter


def test_the_fake_counts_steps_that_send() -> None:
    wrapper = FakeNixlWrapper(keep_sent=False)
    wrapper.get_new_notifs()
    wrapper.send_notif("a", b"x")
    wrapper.send_notif("b", b"y")
    wrapper.get_new_notifs()
    wrapper.get_new_notifs()
    wrapper.send_notif("a", b"z")
    assert (wrapper.polls, wrapper.send_steps) == (3, 2)


@pytest.mark.parametrize("leases", [10, 100])
def test_p_answers_in_at_most_one_step_per_tick(tmp_path: Path, leases: int) -> None:
    env = SimpleNamespace(engines=Engines(tmp_path), pickled=False)
    clock = PerfCounter(NOW)
    try:
        ours = PFleet(env, True, leases, clock)
        ours.interval()
        steps, sending = ours.interval()
        answered = ours.worker.xfer_stats.data.get("num_heartbeat_acks_sent", [])
        ours.worker.ack_answerer.shutdown()
        stock = PFleet(env, False, leases, clock)
        stock.interval()
        stock_steps, stock_sending = stock.interval()
    finally:
        clock.restore()
    print(f"{leases} leases: ours sent in {sending} of {steps} steps, stock in {stock_sending}")
    assert steps == stock_steps == 250
    assert 0 < sending <= answer_ticks(steps)
    assert sum(answered) > 0
    assert stock_sending == 0
