"""Why an engine died, as the chaos lanes read it from its log (``nodes.last_fatal``)."""

from __future__ import annotations

from pathlib import Path

from harness.chaos.nodes import last_fatal

SEGFAULT = """\
WARNING:vllm_nixl_lease.adapter.p_worker.lease_keeper:Releasing expired KV blocks for 1 request(s)
!!!!!!! Segfault encountered !!!!!!!
  File "./signal/../sysdeps/unix/sysv/linux/x86_64/libc_sigaction.c", line 0, in 0x00007f9cdb45a04f
  File "<unknown>", line 0, in ucp_request_memory_dereg
  File "<unknown>", line 0, in uct_tcp_ep_pending_purge
  File "<unknown>", line 0, in ucp_worker_progress
  File "<unknown>", line 0, in nixlUcxWorker::progressLoop()
  File "./nptl/pthread_create.c", line 442, in start_thread
  File "<unknown>", line 0, in 0xffffffffffffffff

"""


def test_a_segfault_names_its_stack_not_the_blank_line_after_it(tmp_path: Path) -> None:
    log = tmp_path / "p0-engine.log"
    log.write_text(SEGFAULT)
    assert last_fatal(str(log)) == (
        "Segfault in ucp_request_memory_dereg < uct_tcp_ep_pending_purge < ucp_worker_progress"
        " < nixlUcxWorker::progressLoop() < start_thread"
    )


def test_a_fatal_line_wins_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    log = tmp_path / "p0-engine.log"
    log.write_text("ok\n[vm:1:0:2] ucp_request.inl:356  Fatal: unexpected error: Endpoint timeout\n\n")
    assert last_fatal(str(log)).endswith("Fatal: unexpected error: Endpoint timeout")
    log.write_text("step 1\nstep 2\n\n\n")
    assert last_fatal(str(log)) == "step 2"
    assert last_fatal(str(tmp_path / "missing.log")) == ""
