"""The harness lane's workload without engines: which stream requests its clients cancel or
submit twice, seeded apart from the sizes and waits, and what each D is handed."""

from __future__ import annotations

from typing import Any

from harness.chaos import workload
from harness.chaos.nodes import local_id, of_local


class FakeNode:
    def __init__(self, name: str) -> None:
        self.name, self.state = name, "up"
        self.submitted: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def prefill_job(self, reqs: list[dict[str, Any]], route: Any) -> None:
        for r in reqs:
            route(r, {"remote_request_id": r["id"]})

    def submit_job(self, items: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        self.submitted += items


class NoHistory:
    def add(self, *args: Any, **kw: Any) -> None:
        pass


def stream(seed: int, n: int = 400, **fracs: float) -> tuple[workload.Workload, list[FakeNode]]:
    ds = [FakeNode(f"d{i}") for i in range(3)]
    wl = workload.Workload(NoHistory(), [FakeNode("p0")], ds, seed, 6.0, 4.0, 10, [], **fracs)  # type: ignore[arg-type]
    wl.run_tag = "run"  # a fresh one per run otherwise: ids differ, choices do not
    for _ in range(n):
        wl.one(clients=True)
    return wl, ds


def submissions(ds: list[FakeNode]) -> list[tuple[str, str, float, Any]]:
    return [(d.name, local_id(r), r["wait_s"], r.get("abort_s")) for d in ds for r, _ in d.submitted]


def test_same_seed_same_cancels_and_copies() -> None:
    assert submissions(stream(5)[1]) == submissions(stream(5)[1])
    assert submissions(stream(5)[1]) != submissions(stream(6)[1])


def test_cancels_and_copies_leave_the_seeds_sizes_and_waits_alone() -> None:
    def firsts(ds: list[FakeNode]) -> list[tuple[str, str, float, int]]:
        return sorted(
            (d.name, r["id"], r["wait_s"], r["blocks"])
            for d in ds
            for r, _ in d.submitted
            if not r.get("copy")
        )

    assert firsts(stream(5)[1]) == firsts(stream(5, abort_frac=0.0, dup_frac=0.0)[1])


def test_copies_share_p_params_and_cancels_fall_before_and_after_the_queue_wait() -> None:
    wl, ds = stream(3, n=1000, abort_frac=0.2, dup_frac=0.2, dup_other_frac=0.5)
    items = [(d.name, r, params) for d in ds for r, params in d.submitted]
    copies = [(name, r, params) for name, r, params in items if r.get("copy") == 1]
    firsts = {r["id"]: (name, r, params) for name, r, params in items if not r.get("copy")}
    assert wl.dups == len(copies) and 150 < len(copies) < 250
    assert 150 < wl.aborts < 250
    other = 0
    for name, r, params in copies:
        first_d, first, first_params = firsts[r["id"]]
        assert params == first_params and first["dup"]["d"] == name and "abort_s" not in r
        assert first["wait_s"] <= r["wait_s"] <= first["wait_s"] + workload.DUP_LAG_S
        assert of_local(local_id(r)) == (r["id"], 1) and of_local(local_id(first)) == (r["id"], 0)
        other += name != first_d
    assert 0.3 < other / len(copies) < 0.7
    cancelled = [r for _, r, _ in items if "abort_s" in r]
    queued = sum(r["abort_s"] < r["wait_s"] for r in cancelled)
    assert 0 < queued < len(cancelled)
    assert all(r["abort_s"] <= r["wait_s"] + 1.0 for r in cancelled)


def test_no_other_d_up_keeps_the_copy_on_the_same_d() -> None:
    ds = [FakeNode("d0")]
    wl = workload.Workload(NoHistory(), [FakeNode("p0")], ds, 1, 6.0, 4.0, 10, [], 0.0, 1.0, 1.0)  # type: ignore[arg-type]
    wl.one(clients=True)
    assert [local_id(r) for r, _ in ds[0].submitted] == [
        local_id(ds[0].submitted[0][0]),
        local_id(ds[0].submitted[0][0]) + "~1",
    ]
