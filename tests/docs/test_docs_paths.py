"""The user docs point at things that exist: every link target and anchor, every
repository path written in inline code, every ``python -m`` module, and
ARCHITECTURE.md's file listing, which must also name every source file of the
package (a new file that is not placed on P or D fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_text import DOCS, FENCE, INLINE_CODE, ROOT, rel

# Inline-code paths may be written from the repository root, the package or its adapter.
PATH_ROOTS = [ROOT, ROOT / "vllm_nixl_lease", ROOT / "vllm_nixl_lease" / "adapter"]
# Written by the commands the docs describe, not part of a checkout.
GENERATED_PREFIXES = (".build/", "dist/", "build/", ".venv")

LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH_LIKE = re.compile(r"[\w.*-]+(/[\w.*-]*)+|[\w*-]+\.(py|pyx|pxd|h|yml|yaml|json|md|png|toml|in)")
# ``python -m`` of this repository's packages (not of build, pip, ...); not ``tools.<name>``.
MODULE_RUN = re.compile(r"python -m ((?:vllm_nixl_lease|tools|harness)(?:\.\w+)*)(?![.\w<])")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", md.read_text()).splitlines():
        if line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _exists(candidate: Path) -> bool:
    if any(ch in candidate.name for ch in "*?"):
        return any(candidate.parent.glob(candidate.name))
    return candidate.exists()


def _resolve(written: str) -> str | None:
    """The repository path ``written`` names, or None when it names nothing."""
    written = written.rstrip("/")
    for base in PATH_ROOTS:
        candidate = base / written
        if _exists(candidate):
            return rel(candidate)
    if "/" not in written and any(ROOT.rglob(written)):  # a bare file name, e.g. `_wire.py`
        return written
    return None


@pytest.mark.parametrize("md", DOCS, ids=rel)
def test_links_resolve(md: Path) -> None:
    bad = []
    for target in LINK.findall(FENCE.sub("", md.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # an external URL
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {rel(dest)}")
    assert not bad, f"{rel(md)}: {bad}"


@pytest.mark.parametrize("md", DOCS, ids=rel)
def test_code_paths_exist(md: Path) -> None:
    text = FENCE.sub("", md.read_text())
    bad = []
    for code in INLINE_CODE.findall(text):
        if not PATH_LIKE.fullmatch(code) or code.startswith(GENERATED_PREFIXES):
            continue
        if _resolve(code) is None:
            bad.append(code)
    for module in MODULE_RUN.findall(md.read_text()):
        base = ROOT / module.replace(".", "/")
        if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
            bad.append(f"python -m {module}")
    assert not bad, f"{rel(md)} names paths that do not exist: {bad}"


def _architecture_listing() -> list[str]:
    """The repository paths ARCHITECTURE.md's file listing names, from its indentation."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## Where each file runs", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    paths: list[str] = []
    stack: list[tuple[int, str]] = []  # (indent, directory)
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= 20:
            continue  # a description continued on the next line
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        previous = ""
        for name in names.split(", "):
            if name.startswith("."):  # `_x.pyx, .pxd`: a sibling with another suffix
                name = previous.rsplit(".", 1)[0] + name
            previous = name
            paths.append(parent + name)
            if name.endswith("/"):
                stack.append((indent, parent + name))
    return paths


def test_architecture_listing_exists() -> None:
    missing = [p for p in _architecture_listing() if not _exists(ROOT / p)]
    assert not missing, f"docs/ARCHITECTURE.md lists paths that do not exist: {missing}"


def test_architecture_listing_places_every_package_file() -> None:
    listed = set(_architecture_listing())
    sources = {
        rel(p)
        for p in (ROOT / "vllm_nixl_lease").rglob("*")
        if p.suffix in (".py", ".pyx", ".pxd") and "__pycache__" not in p.parts
    }
    unplaced = sorted(s for s in sources - listed if not s.endswith("/__init__.py") or s.count("/") == 1)
    assert not unplaced, f"docs/ARCHITECTURE.md's file listing does not place: {unplaced}"


def test_readme_stays_short() -> None:
    """The README is for users (what, install, adopt, configure, operate); measurements and
    history live in docs/BENCHMARKS.md and the CHANGELOG."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 300, f"README.md has {lines} lines: move detail into docs/"
