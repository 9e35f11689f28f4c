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

    python harness/fresh_imports.py ROOT PACKAGE... -- MODULE...

prints one JSON object: ``preloaded`` (the libraries imported first, each with
its error if it failed, which the child then meets itself), ``ours_preloaded``
(modules of ours the preload pulled in: then the check is not fresh) and
``failures`` (module -> traceback). Stdlib only, and run by path, so running
it imports nothing of ours.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

# Children running at once: each is mostly one import, CPU bound.
PARALLEL = 2


def module_level_imports(path: Path) -> set[str]:
    """The top-level modules ``path`` imports when it is imported (not inside functions or classes)."""
    names: set[str] = set()
    if path.suffix != ".py":
        return names
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
        elif isinstance(node, ast.If):
            # An "if TYPE_CHECKING:" body never runs; its else, and any other if, may.
            test = node.test
            guarded = (
                getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"
            )
            todo.extend(node.orelse if guarded else [*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            todo.extend(
                [*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)]
            )
        elif isinstance(node, ast.With):
            todo.extend(node.body)
    return names


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
    split = argv.index("--")
    packages, modules = argv[1:split], argv[split + 1 :]
    # Every library any module of the packages imports at module level: a module
    # reaches most of them through other modules of ours, which are not preloaded.
    preload: set[str] = set()
    for package in packages:
        for path in (root / package).rglob("*.py"):
            preload |= module_level_imports(path)
    # __future__ is a compiler directive, not a library; ours are what is being checked.
    third_party = sorted(name for name in preload - {"__future__"} if name.split(".")[0] not in packages)
    print(json.dumps(run(root, packages, modules, third_party)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
