"""Build the Cython lease core (csrc/*.pyx) as extension modules of vllm_nixl_lease.

Set VLLM_NIXL_LEASE_NO_EXTENSIONS=1 at build time to skip compiling (the
package then runs on its pure-Python twins).
"""

import os

from setuptools import Extension, setup

MODULES = ["_lease_c", "_heartbeat_c"]


def extensions() -> list:
    if os.environ.get("VLLM_NIXL_LEASE_NO_EXTENSIONS", "").strip().lower() not in ("", "0", "false", "no"):
        return []
    from Cython.Build import cythonize

    exts = [
        Extension(
            f"vllm_nixl_lease.{name}",
            [f"csrc/{name}.pyx"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17"],
        )
        for name in MODULES
    ]
    return cythonize(exts, compiler_directives={"language_level": "3"}, build_dir="build/cython")


setup(ext_modules=extensions())
