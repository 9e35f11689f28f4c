"""No import cycles in the package, the harness or the tools, and every module imports on its own.

A cycle works or breaks depending on which of its modules a process imports
first, so tests that pass can hide one; the static graph finds it whatever the
order, and importing each module into a process with none of ours loaded finds
the import errors a lucky order hides.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

import pytest

from harness.import_graph import find_cycles, import_graph, module_files, third_party_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vllm_nixl_lease", "harness", "tools")


def _cycles_message(cycles: list[list[str]]) -> str:
    return "import cycles (move what both sides need into a leaf module):\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles
    )


def test_no_import_cycles() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert "harness.nixl.engine" in graph and "vllm_nixl_lease.adapter.connector" in graph
    cycles = find_cycles(graph)
    assert not cycles, _cycles_message(cycles)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_is_found_and_named(tmp_path: Path) -> None:
    """Function-level and relative imports count; an import under TYPE_CHECKING does not."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from . import b, d\n",
            "pkg/d.py": "import pkg.a\n",
            "pkg/b.py": "def f():\n    from pkg.sub import c\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from ..a import name\n",
            "pkg/typed.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg import hinted\n",
            "pkg/hinted.py": "import pkg.typed\n",
            "pkg/leaf.py": "import os\nimport pkg.a\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.typed"] == set()
    cycles = find_cycles(graph)
    # One component, both cycles named: every module on it is on a listed cycle.
    assert cycles == [["pkg.a", "pkg.d", "pkg.a"], ["pkg.b", "pkg.sub.c", "pkg.a", "pkg.b"]]
    assert "pkg.b -> pkg.sub.c -> pkg.a -> pkg.b" in _cycles_message(cycles)


def test_a_cycle_through_a_cython_module_is_found(tmp_path: Path) -> None:
    """A .pyx module counts by its Python-level imports, not its cimports."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/fast.pyx": "from libc.string cimport memchr\nfrom .slow import (\n    helper,\n)\n",
            "pkg/slow.py": "from pkg.fast import thing\n",
        },
    )
    assert find_cycles(import_graph(tmp_path, ["pkg"])) == [["pkg.fast", "pkg.slow", "pkg.fast"]]


def _fresh_modules() -> list[str]:
    """Every module of PACKAGES; a Cython module only where it is built (its twin runs otherwise)."""
    out = []
    for module, path in module_files(ROOT, PACKAGES).items():
        if path.suffix == ".pyx" and not any(
            path.with_name(path.stem + suffix).exists() for suffix in EXTENSION_SUFFIXES
        ):
            continue
        out.append(module)
    return sorted(out)


def _fresh_imports(root: Path, packages: tuple[str, ...], modules: list[str]) -> dict[str, Any]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "harness" / "fresh_imports.py"),
            str(root),
            *packages,
            "--",
            *third_party_imports(root, packages),
            "--",
            *modules,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    return result


def test_a_module_that_imports_only_after_another_is_found(tmp_path: Path) -> None:
    """pkg.b imports fine; pkg.a, imported first, reaches pkg.b, which wants a name pkg.a has not yet set."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import json\nimport pkg.b\nNAME = 1\n",
            "pkg/b.py": "from pkg.a import NAME\n",
        },
    )
    result = _fresh_imports(tmp_path, ("pkg",), ["pkg", "pkg.a", "pkg.b"])
    assert result["preloaded"] == {"json": None} and result["ours_preloaded"] == []
    assert sorted(result["failures"]) == ["pkg.a"]
    assert (
        "cannot import name 'NAME' from partially initialized module 'pkg.a'" in result["failures"]["pkg.a"]
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_every_module_imports_with_none_of_ours_loaded_first() -> None:
    modules = _fresh_modules()
    wall, cpu = time.monotonic(), os.times()
    result = _fresh_imports(ROOT, PACKAGES, modules)
    after = os.times()
    print(
        f"{len(modules)} modules: {time.monotonic() - wall:.1f} s wall, "
        f"{after.children_user + after.children_system - cpu.children_user - cpu.children_system:.1f} s CPU "
        f"(preload {result['preload_s']} s)"
    )
    assert result["ours_preloaded"] == [], "the third-party preload imported our modules: not a fresh import"
    assert not result["failures"], "\n".join(result["failures"].values())
