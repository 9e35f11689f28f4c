"""What both docs tests read: the user docs, and the inline code written in them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "spec" / "README.md"]

INLINE_CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def rel(path: Path) -> str:
    """``path`` as written from the repository root."""
    return path.relative_to(ROOT).as_posix()
