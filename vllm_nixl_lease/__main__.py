"""``python -m vllm_nixl_lease doctor``: is this setup one we support?"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from typing import TextIO


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def doctor(out: TextIO | None = None) -> int:
    """Print the setup; return 0 when supported, 1 otherwise."""
    out = sys.stdout if out is None else out
    # Import vLLM the way a CPU-only host must; never override a user choice.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from . import IMPLEMENTATION, __version__, hook
    from .adapter import compat

    problems: list[str] = []
    print(f"vllm_nixl_lease {__version__}", file=out)
    print(f"lease core implementation: {IMPLEMENTATION}", file=out)
    if IMPLEMENTATION != "cython":
        print("  note: pure-Python core (extension missing or VLLM_NIXL_LEASE_NO_EXTENSIONS set)", file=out)
    vllm_version = compat.vllm_version()
    supported = compat.is_supported(vllm_version)
    print(
        f"vLLM: {vllm_version or 'not installed'} ({'supported' if supported else 'UNSUPPORTED'})", file=out
    )
    if not supported:
        problems.append(f"vLLM {vllm_version or '(missing)'} is not 0.32.x/0.33.x")
    nixl_version = _version("nixl") or _version("nixl-cu12")
    print(f"NIXL: {nixl_version or 'not installed'}", file=out)
    if nixl_version is None:
        problems.append("NIXL is not installed")
    eps = metadata.entry_points(group="vllm.general_plugins")
    has_ep = any(ep.value == "vllm_nixl_lease.plugin:register" for ep in eps)
    print(f"vllm.general_plugins entry point: {'present' if has_ep else 'MISSING'}", file=out)
    if not has_ep:
        problems.append("entry point missing: reinstall the package (pip install -e .)")
    if supported:
        try:
            from . import plugin

            plugin.register_connectors()
            print(
                f"plugin registered: {plugin.is_registered()} ({', '.join(plugin.LEASE_CONNECTOR_NAMES)})",
                file=out,
            )
            from .adapter import connector  # noqa: F401  (the adapters import cleanly)
        except Exception as exc:  # report, don't crash: this is a diagnostic
            problems.append(f"adapters failed to load: {exc!r}")
    wants_hook = hook.env_requests_hook()
    print(
        f"import hook: {hook.ENV_VAR}={os.environ.get(hook.ENV_VAR, '')!r} -> "
        f"{'would apply' if wants_hook and has_ep and supported else 'would not apply'}",
        file=out,
    )
    if wants_hook and not has_ep:
        problems.append(f"{hook.ENV_VAR} is set but no entry point will apply it")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=out)
    print("OK" if not problems else "UNSUPPORTED SETUP", file=out)
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_nixl_lease")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check vLLM/NIXL versions, core, plugin and hook")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
