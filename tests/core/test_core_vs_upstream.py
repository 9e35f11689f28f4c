"""Differential tests against upstream vLLM 0.33.0's real lease methods.

Upstream's ``_handle_heartbeat``, ``_get_new_notifs`` and
``_reap_expired_send_leases`` run on a worker built without its constructor
(as vLLM's own unit tests do) with ``time.perf_counter`` patched; our router
gets the same well-formed random sequences.  Both must free the same requests
at the same step and hold the same deadlines.
"""

from __future__ import annotations

import logging
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker

from harness.upstream_fake import make_upstream_worker
from vllm_nixl_lease._wire import default_lease_extension, heartbeat_message

EXTENSION = default_lease_extension(30)  # upstream's default lease
IDS = [f"cmpl-{i}:0" for i in range(12)]
EXPECTED = {rid: 1 + i % 2 for i, rid in enumerate(IDS)}  # a fixed consumer count per request


def upstream_worker():
    return make_upstream_worker(pull_worker.NixlPullConnectorWorker, EXTENSION)


step_st = st.fixed_dictionaries(
    {
        "dt": st.sampled_from([0.0, 1.0, 5.0, 13.0, 21.0]),
        "new": st.lists(st.tuples(st.sampled_from(IDS), st.sampled_from([0.0, 3.0, 10.0, 30.0])), max_size=3),
        "notifs": st.lists(
            st.one_of(
                st.sampled_from(IDS).map(lambda r: f"{r}:{EXPECTED[r]}".encode()),
                st.lists(st.sampled_from(IDS + ["unknown"]), min_size=1, max_size=5).map(heartbeat_message),
            ),
            max_size=6,
        ),
    }
)


@pytest.mark.parametrize("impl", ["cython", "python"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step_st, min_size=1, max_size=25))
def test_same_frees_and_deadlines_as_upstream(impl, steps):
    from core_implementations import load_core

    core = load_core(impl)
    router = core.NotificationRouter(core.LeaseTable(EXTENSION))
    w = upstream_worker()
    logging.getLogger("vllm").setLevel(logging.ERROR)  # upstream warns per expiry
    now = 1000.0
    ours_after_expiry = 0
    for step in steps:
        now += step["dt"]
        for rid, ttl in step["new"]:
            # what start_load_kv does: in batch, then a lease if not read yet
            if rid in w._reqs_to_send or rid in w._reqs_to_process:
                continue
            w._reqs_to_process.add(rid)
            w._reqs_to_send[rid] = now + ttl
            router.add_in_batch(rid)
            assert router.grant(rid, now + ttl)
        w.nixl_wrapper.inbox = {"agent": list(step["notifs"])}
        with mock.patch("time.perf_counter", return_value=now):
            up_done = w._get_new_notifs()
            w._reap_expired_send_leases(up_done)
        res = router.route({"agent": list(step["notifs"])}, now)
        expired = router.expire(now)
        ours_after_expiry += res.unknown
        assert set(res.completed) | set(expired.ids) == up_done
        assert {r: router.table.deadline(r) for r in IDS if r in router.table} == w._reqs_to_send
        assert all(router.is_in_batch(r) == (r in w._reqs_to_process) for r in IDS)
    data = w.xfer_stats.data
    assert ours_after_expiry == len(data["num_notifications_after_expiry"])


def test_expired_counts_match_upstream():
    """The reads-seen count logged per expired request equals upstream's."""
    from core_implementations import load_core

    core = load_core("python")
    router = core.NotificationRouter(core.LeaseTable(EXTENSION))
    w = upstream_worker()
    for rid in ("a", "b"):
        w._reqs_to_process.add(rid)
        w._reqs_to_send[rid] = 5.0
        router.add_in_batch(rid)
        router.grant(rid, 5.0)
    w.nixl_wrapper.inbox = {"x": [b"a:2"]}
    with mock.patch("time.perf_counter", return_value=6.0):
        done = w._get_new_notifs()
        counts = dict(w.consumer_notification_counts_by_req)
        w._reap_expired_send_leases(done)
    router.route({"x": [b"a:2"]}, 6.0)
    expired = router.expire(6.0)
    assert expired.ids == ["a", "b"] and expired.reads == {"a": counts["a"]} and counts["a"] > 0
    assert done == {"a", "b"} and len(w.xfer_stats.data["num_kv_expired_reqs"]) == 2
