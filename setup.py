"""Build the Cython lease core: each ``.pyx`` sits beside its pure-Python twin
in the package and compiles to a module of the same package; the C helpers
they include are headers under ``csrc/``.

Set VLLM_NIXL_LEASE_NO_EXTENSIONS=1 at build time to skip compiling (the
package then runs on its pure-Python twins).
"""

import os

from setuptools import Extension, setup

# Dotted module names; each source is the module's path with ``.pyx``.
MODULES = [
    "vllm_nixl_lease.prefill._lease_table_c",
    "vllm_nixl_lease.prefill._notification_router_c",
    "vllm_nixl_lease.decode._heartbeat_tracker_c",
    "vllm_nixl_lease.decode._intake_c",
    "vllm_nixl_lease.decode._lease_views_c",
    "vllm_nixl_lease.decode._view_updates_c",
]


def extensions() -> list:
    if os.environ.get("VLLM_NIXL_LEASE_NO_EXTENSIONS", "").strip().lower() not in ("", "0", "false", "no"):
        return []
    from Cython.Build import cythonize

    exts = [
        Extension(
            name,
            [name.replace(".", "/") + ".pyx"],
            include_dirs=["csrc"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17"],
        )
        for name in MODULES
    ]
    return cythonize(exts, compiler_directives={"language_level": "3"}, build_dir="build/cython")


setup(ext_modules=extensions())
