"""Callgrind, driven from inside the measured Python process.

The process runs under ``valgrind --tool=callgrind --instr-atstart=no
--collect-atstart=no``: Python, torch and vLLM import uninstrumented (about 7x
slower than native rather than 50x), each case builds its state, and only then
is instrumentation switched on.  Collection is toggled on around the measured
call alone and every measurement is dumped under its own label
(``CALLGRIND_DUMP_STATS_AT``), which also zeroes the counters.

Why client requests rather than ``--toggle-collect=<function>``: Python
functions are invisible to valgrind (they all run inside the interpreter's
eval loop), so a marker function would have to be a C function that calls back
into Python; the requests do the same with no callback and let one case
exclude parts of its own loop (``pause``, ``resume``), such as a fake peer's answers.
What the toggles themselves cost (a ctypes call each way) is measured once,
``overhead``, and subtracted per collected stretch.

The requests are the macros of ``valgrind/callgrind.h`` compiled into a tiny
shared library (``marker.c``); outside valgrind they are no-ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

HERE = Path(__file__).resolve().parent
MARKER_SOURCE = HERE / "marker.c"


def build_marker(out_dir: Path) -> Path:
    """Compile ``marker.c`` into ``out_dir`` (once per source change)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libinstr_marker.so"
    if lib.exists() and lib.stat().st_mtime >= MARKER_SOURCE.stat().st_mtime:
        return lib
    cc = os.environ.get("CC", "cc")
    try:
        subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(MARKER_SOURCE)],
            check=True,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise SystemExit(
            f"cannot build the callgrind marker ({cc}; needs valgrind's headers, Debian package "
            f"valgrind): {detail.strip()}"
        ) from exc
    return lib


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection lands inside a measurement (one walks vLLM's whole heap)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Measurer(Protocol):
    """What a case measures through: ``Probe`` counts instructions, ``cold.ColdProbe`` times
    each call with cold caches; a case runs the same calls under either."""

    def instrumented(self) -> contextlib.AbstractContextManager[None]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def measure(
        self,
        case: str,
        side: str,
        fn: Callable[[], object],
        *,
        ops: int,
        setup: Callable[[], object] | None = None,
        warmup: int = 10,
        repeats: int = 3,
    ) -> None: ...


class Probe:
    """Switches callgrind's collection around measured calls; records what each dump was."""

    def __init__(self, lib_path: Path, impl: str) -> None:
        self._lib = ctypes.CDLL(str(lib_path))
        self._lib.instr_dump.argtypes = [ctypes.c_char_p]
        self.on_valgrind = bool(self._lib.instr_running_on_valgrind())
        self.impl = impl  # the process's core: cython or twin
        self.records: list[dict[str, Any]] = []
        self._stretches = 0
        self._serial = 0
        self.overhead = 0  # filled in by the calibration case's first dumps, in the parent

    # -- instrumentation (whole phases) ---------------------------------------
    @contextlib.contextmanager
    def instrumented(self) -> Iterator[None]:
        """Instrument the code inside (collection still off): a case's measurements, not its set-up."""
        with gc_paused():
            self._lib.instr_start_instrumentation()
            try:
                yield
            finally:
                self._lib.instr_stop_instrumentation()

    # -- collection (one measurement) -------------------------------------------
    def resume(self) -> None:
        """Collect again (after ``pause``, inside a measured call)."""
        self._stretches += 1
        self._lib.instr_toggle()

    def pause(self) -> None:
        """Stop collecting: a part of the measured call that is not the connector's
        (a fake peer's answers, the case's own bookkeeping)."""
        self._lib.instr_toggle()

    def measure(
        self,
        case: str,
        side: str,
        fn: Callable[[], object],
        *,
        ops: int,
        setup: Callable[[], object] | None = None,
        warmup: int = 10,
        repeats: int = 3,
    ) -> None:
        """Count ``fn()``'s instructions ``repeats`` times (after ``warmup`` uncounted
        calls: CPython quickens a function's code after 8 calls and then
        specialises its instructions, so earlier calls run more), ``setup()``
        uncollected before each call.  ``ops``: operations one call performs.
        ``fn`` may leave parts out: ``pause()`` ... ``resume()``."""
        for i in range(warmup + repeats):
            if setup is not None:
                setup()
            if i < warmup:
                fn()
                continue
            self._serial += 1
            label = f"{self._serial}"
            self._stretches = 0
            self._lib.instr_zero()
            self.resume()
            fn()
            self.pause()
            self._lib.instr_dump(label.encode())
            self.records.append(
                {"label": label, "case": case, "side": side, "ops": ops, "stretches": self._stretches}
            )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"impl": self.impl, "records": self.records}, indent=1))


class PerfCounter:
    """``time.perf_counter`` held at a chosen value for the code under test.

    The stand-in is ``float(now).__float__``: a C method with no arguments, so
    a call costs about what the real clock costs (a Python-level fake would
    charge every caller a frame), and ours and stock read the same value."""

    def __init__(self, now: float = 1000.0) -> None:
        self._real = time.perf_counter
        self.now = now

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        self._now = float(value)
        time.perf_counter = self._now.__float__

    def restore(self) -> None:
        time.perf_counter = self._real
