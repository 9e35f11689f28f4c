"""Which implementation of each core concept runs: the Cython module or its
pure-Python twin (the readable reference, identical behaviour).

Each concept has one chooser module (``prefill/lease_table.py``,
``prefill/notification_router.py``, ``decode/heartbeat_tracker.py``,
``decode/intake.py``, ``decode/lease_views.py``, ``decode/view_updates.py``) that
calls ``choose`` once, at import time.  ``VLLM_NIXL_LEASE_NO_EXTENSIONS=1``
forces the twins; a missing or broken extension falls back to its twin with
one warning.
"""

from __future__ import annotations

import os
import warnings
from importlib import import_module
from types import ModuleType

NO_EXTENSIONS_ENV = "VLLM_NIXL_LEASE_NO_EXTENSIONS"

# concept module -> "cython" or "python", as chosen
CHOSEN: dict[str, str] = {}


def extensions_disabled() -> bool:
    return os.environ.get(NO_EXTENSIONS_ENV, "").strip().lower() not in ("", "0", "false", "no")


def choose(
    package: str, cython_module: str, python_module: str, requires: tuple[str, ...] = ()
) -> ModuleType:
    """The Cython module ``package.cython_module`` unless extensions are off or
    it (or one of the Cython modules in ``requires``, which only work with it)
    cannot be imported; else the twin ``package.python_module``."""
    concept = f"{package}.{python_module.removeprefix('_').removesuffix('_py')}"
    if not extensions_disabled():
        try:
            module = import_module(f".{cython_module}", package)
            for other in requires:
                import_module(f".{other}", package)
        except ImportError as exc:  # pragma: no cover - depends on the build
            warnings.warn(
                f"vllm_nixl_lease: Cython extension {cython_module} unavailable ({exc}); "
                "using its pure-Python twin",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            CHOSEN[concept] = "cython"
            return module
    CHOSEN[concept] = "python"
    return import_module(f".{python_module}", package)


def implementation() -> str:
    """``"cython"`` when every concept chosen so far runs its Cython module,
    else ``"python"``."""
    return "cython" if CHOSEN and all(v == "cython" for v in CHOSEN.values()) else "python"
