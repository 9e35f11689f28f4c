"""Import each module as if it were the first of ours a process imports, cheaply.

A module that imports fine only after some other module of ours has been
imported (an import cycle entered from the wrong side, a name a package's
``__init__`` provides by accident) passes every test that happens to import
that other module first. The check is a fresh interpreter per module. Ours
import vLLM, whose import alone takes seconds in a fresh interpreter, so this
runs as a script: the parent imports only third-party libraries (each one a
module of ours imports at module level), then forks one child per module. A child
has every third-party library loaded and none of our modules, imports its
module and exits 0, or 1 with the traceback on stderr.

    python harness/fresh_imports.py ROOT PACKAGE... -- PRELOAD... -- MODULE...

PRELOAD is what ``harness.import_graph.third_party_imports`` lists. It prints one
JSON object: ``preloaded`` (the libraries imported first, each with its error if
it failed, which the child then meets itself), ``ours_preloaded`` (modules of
ours the preload pulled in: then the check is not fresh) and ``failures``
(module -> traceback). Stdlib only, and run by path, so running it imports
nothing of ours.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

# Children running at once: each is mostly one import, CPU bound.
PARALLEL = 2


def _import_in_child(module: str) -> int:
    """Fork; the child imports ``module`` and exits with 0, or 1 after printing its traceback."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        importlib.import_module(module)
    except BaseException:  # noqa: BLE001 - any failure of the import is the finding
        sys.stderr.write(f"--- {module}\n{traceback.format_exc()}")
        code = 1
    sys.stderr.flush()
    # No interpreter shutdown: atexit handlers and finalizers belong to the parent's libraries.
    os._exit(code)


def run(root: Path, packages: list[str], modules: list[str], preload: list[str]) -> dict[str, object]:
    """Preload ``preload`` here, then import each of ``modules`` in a fork of this process."""
    sys.path[0] = str(root)  # run by path, the first entry is this file's folder, not the root
    preloaded: dict[str, str | None] = {}
    started = time.monotonic()
    for name in preload:
        try:
            importlib.import_module(name)
            preloaded[name] = None
        except BaseException as exc:  # noqa: BLE001 - a child importing it then fails and says why
            preloaded[name] = f"{type(exc).__name__}: {exc}"
    preload_s = time.monotonic() - started
    ours = sorted(m for m in sys.modules if m.split(".")[0] in packages)
    failures: dict[str, str] = {}
    running: dict[int, str] = {}
    err_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    pending = list(modules)
    logs: dict[str, Path] = {}
    while pending or running:
        while pending and len(running) < PARALLEL:
            module = pending.pop(0)
            logs[module] = err_dir / f"fresh-import-{os.getpid()}-{module}.err"
            with open(logs[module], "w") as err:
                saved = os.dup(2)
                os.dup2(err.fileno(), 2)
                try:
                    running[_import_in_child(module)] = module
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)
        pid, status = os.wait()
        module = running.pop(pid)
        text = logs[module].read_text(errors="replace")
        logs[module].unlink()
        if os.waitstatus_to_exitcode(status) != 0:
            failures[module] = text or f"exit status {os.waitstatus_to_exitcode(status)}"
    return {
        "preloaded": preloaded,
        "preload_s": round(preload_s, 3),
        "ours_preloaded": ours,
        "failures": failures,
    }


def main(argv: list[str]) -> int:
    root = Path(argv[0]).resolve()
    first, second = argv.index("--"), argv.index("--", argv.index("--") + 1)
    packages, preload, modules = argv[1:first], argv[first + 1 : second], argv[second + 1 :]
    print(json.dumps(run(root, packages, modules, preload)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
