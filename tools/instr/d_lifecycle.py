"""D's requests through vLLM's real hooks, for the instruction cases.

``DEngine`` (``cases.py``) moves requests only through ``on_new_request`` and
``_stop_heartbeat``.  Here every request lives the life vLLM gives it on D:

- it arrives (``on_new_request``) and waits in the queue, heartbeated;
- its blocks are allocated (``update_state_after_alloc``) and the step's
  metadata carries its READ (``build_connector_meta``), which the worker posts
  in ``start_load_kv`` (through our pacer and fence, or stock's directly);
- the next step's ``get_transfer_results`` sees the READ done, the scheduler
  takes it (``update_connector_output``) and the request ends
  (``request_finished``).

Posting a READ is NIXL's own work (descriptor lists, ``make_prepped_xfer``),
the same for both sides: upstream's ``_read_blocks_for_req`` is replaced, for
ours and stock alike, by what it leaves behind, the transfer handle in
``_recving_transfers``.  Everything around it (our pacer, fence, claims,
``discard_late``; upstream's bookkeeping) runs unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from harness.upstream_fake import stock_worker_class
from tools.instr.probe import Measurer, PerfCounter
from vllm_nixl_lease._wire import PARAM_LEASE_DEADLINE, PARAM_LEASE_EXTENSION, PARAM_LEASE_INTERVAL

_handles = itertools.count(1)
Counter = Callable[[Callable[[], object]], None]  # runs one step's connector calls (counted)
HookCounter = Callable[[list[tuple[str, Callable[[], None]]]], None]  # runs them hook by hook


def _posted(worker: Any, req_id: str, meta: Any) -> None:
    """What upstream's ``_read_blocks_for_req`` leaves once NIXL posted the READ
    (in progress until the driver's next step)."""
    handle = next(_handles)
    worker.nixl_wrapper.xfer_states[handle] = "PROC"
    worker._recving_transfers[req_id].append(handle)


@contextmanager
def reads_posted_in_memory() -> Iterator[None]:
    """Upstream's READ posting replaced for the cases' duration (see the module docstring)."""
    cls: Any = stock_worker_class()
    real = cls._read_blocks_for_req
    cls._read_blocks_for_req = _posted
    try:
        yield
    finally:
        cls._read_blocks_for_req = real


class _Blocks:
    """The ``KVCacheBlocks`` ``update_state_after_alloc`` reads: one group of fresh blocks."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids
        self.blocks = ([SimpleNamespace(block_hash=None, is_null=False) for _ in ids],)

    def get_unhashed_block_ids_all_groups(self) -> tuple[list[int], ...]:
        return (self._ids,)


class _Topology:
    """The transfer topology a finished READ's post-processing reads: P's blocks as D's."""

    _engine = SimpleNamespace(remote_block_size=32, remote_physical_blocks_per_logical=1)

    def get_engine_info(self, engine_id: str) -> Any:
        return self._engine

    def block_size_ratio(self, remote_block_size: int) -> int:
        return 1

    def unregister_remote_engine(self, engine_id: str) -> None:
        pass


BLOCKS = _Blocks([1, 2, 3, 4])
TOKENS = 4 * 32  # num_external_tokens of a READ of BLOCKS


def make_lifecycle(base: type, step_s: float) -> type:
    """``base`` (``cases.DEngine``) driven through the real hooks, ``step_s`` apart; ``plain``:
    P's params carry a lease deadline but no instance (a P that does not
    speak our protocol version: plain views, ``HB:``)."""

    class DLifecycle(base):
        def __init__(self, env: Any, ours: bool, clock: PerfCounter, plain: bool = False) -> None:
            super().__init__(env, ours, clock)
            self.plain = plain
            self.d.acked = self.d.acked and not plain  # no instance, no tag in P's params
            self.requests: dict[str, Any] = {}
            self.reading: list[Any] = []  # READs posted last step, done this step
            self.d.worker._physical_blocks_per_logical_kv_block = 1
            self.d.worker.transfer_topo = _Topology()

        def arrivals(self, n: int) -> list[Any]:
            out: list[Any] = super().arrivals(n)
            for req in out:
                if self.plain:
                    req.kv_transfer_params.update(
                        {
                            PARAM_LEASE_DEADLINE: self.clock.now + 30.0,
                            PARAM_LEASE_EXTENSION: 20.0,
                            PARAM_LEASE_INTERVAL: 5.0,
                        }
                    )
                req.kv_transfer_params["remote_block_ids"] = ([11, 12, 13, 14],)
                req.status = None
                self.requests[req.request_id] = req
            return out

        def lifecycle_step(self, arrivals: list[Any], allocated: list[str]) -> None:
            """One step: ``arrivals`` enter the queue, ``allocated`` get their
            blocks (READ posted this step), last step's READs end.  Written out
            (``hooks`` has the same calls): the counted rows pay no closure per hook."""
            sched, worker = self.d.sched, self.d.worker
            for req in arrivals:
                sched.on_new_request(req)
            for local in allocated:
                sched.update_state_after_alloc(self.requests[local], BLOCKS, TOKENS)
            worker.start_load_kv(sched.build_connector_meta(self.d.output))
            results = worker.get_transfer_results()
            sched.update_connector_output(SimpleNamespace(finished_recving=results.finished_recving))
            for local in results.finished_recving:
                sched.request_finished(self.requests.pop(local), ([1, 2, 3, 4],))

        def hooks(self, arrivals: list[Any], allocated: list[str]) -> list[tuple[str, Callable[[], None]]]:
            """``lifecycle_step``'s calls, hook by hook, in order (``lifecycle_parts``)."""
            sched, worker = self.d.sched, self.d.worker
            state: dict[str, Any] = {}

            def arrive() -> None:
                for req in arrivals:
                    sched.on_new_request(req)

            def allocate() -> None:
                for local in allocated:
                    sched.update_state_after_alloc(self.requests[local], BLOCKS, TOKENS)

            def build() -> None:
                state["meta"] = sched.build_connector_meta(self.d.output)

            def start() -> None:
                worker.start_load_kv(state.pop("meta"))  # the metadata dies here, as in a step

            def results() -> None:
                state["done"] = worker.get_transfer_results().finished_recving

            def output() -> None:
                sched.update_connector_output(SimpleNamespace(finished_recving=state["done"]))

            def finish() -> None:
                for local in state.pop("done"):
                    sched.request_finished(self.requests.pop(local), ([1, 2, 3, 4],))

            return [
                ("on_new_request", arrive),
                ("update_state_after_alloc", allocate),
                ("build_connector_meta", build),
                ("start_load_kv", start),
                ("get_transfer_results", results),
                ("update_connector_output", output),
                ("request_finished", finish),
            ]

        def churn(
            self, steps: int, per_step: int, count: Counter | None, by_hook: HookCounter | None = None
        ) -> None:
            """``steps`` steps of ``step_s``: ``per_step`` requests arrive and the
            ``per_step`` oldest get their blocks (their READ ends the next step).
            ``count(step)`` runs each step; ``by_hook(hooks)`` instead runs its hooks."""
            for _ in range(steps):
                arrivals = self.arrivals(per_step)
                allocated = self.queue[self.head : self.head + per_step]
                self.head += per_step

                def step(arrivals: list[Any] = arrivals, allocated: list[str] = allocated) -> None:
                    self.lifecycle_step(arrivals, allocated)

                self.d.worker.nixl_wrapper.xfer_states.clear()  # last step's READs are done
                if by_hook is not None:
                    by_hook(self.hooks(arrivals, allocated))
                elif count is None:
                    step()
                else:
                    count(step)
                self.answer()
                self.clock.now += step_s

    return DLifecycle


def d_churn(
    engine: type, now: float, interval: float, step_s: float, queued: int, per_step: int, plain: bool = False
) -> Callable[[Measurer, Any], None]:
    """D (``engine``: ``cases.DEngine``, passed in so that this module does not import the
    cases) with ``queued`` requests over 8 P engines, ``per_step`` in and out per step through
    the real hooks; each step of one heartbeat interval counted on its own, after one interval
    not counted."""
    cls = make_lifecycle(engine, step_s)
    steps = round(interval / step_s)

    def run(probe: Measurer, env: Any) -> None:
        for side, d in _warmed(cls, env, now, steps, queued, per_step, plain):

            def measure_step(step: Callable[[], object], side: str = side) -> None:
                probe.measure(env.case.name, side, step, ops=1, warmup=0, repeats=1)

            with probe.instrumented():
                d.churn(steps, per_step, measure_step)

    return run


def _warmed(
    cls: type, env: Any, now: float, steps: int, queued: int, per_step: int, plain: bool = False
) -> Iterator[tuple[str, Any]]:
    """Per side of ``env``: ``cls``'s D with ``queued`` requests after one uncounted
    interval of churn, READs posted in memory, the clock held from ``now``."""
    clock = PerfCounter(now)
    try:
        with reads_posted_in_memory():
            for side in env.worker_sides:
                d = cls(env, side != "stock", clock, plain)
                d.fill(queued)
                d.churn(steps, per_step, None)
                yield side, d
    finally:
        clock.restore()


def lifecycle_parts(
    engine: type, now: float, interval: float, step_s: float, per_step: int
) -> Callable[[Measurer, Any], None]:
    """``d_churn``'s lifecycle with no queue, each hook of each step of one interval
    counted on its own (a row per hook: the median step's count of the hook, all its
    calls together): where a request's instructions go, ours against stock."""
    cls = make_lifecycle(engine, step_s)
    steps = round(interval / step_s)

    def run(probe: Measurer, env: Any) -> None:
        for side, d in _warmed(cls, env, now, steps, 0, per_step):

            def by_hook(hooks: list[tuple[str, Callable[[], None]]], side: str = side) -> None:
                for hook, call in hooks:
                    probe.measure(f"{env.case.name}: {hook}", side, call, ops=1, warmup=0, repeats=1)

            with probe.instrumented():
                d.churn(steps, per_step, None, by_hook)

    return run
