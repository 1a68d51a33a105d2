"""The optional C extension and the generated gRPC code; everything else is in pyproject.toml.

`services.common._blockhash` computes the block-hash chain in one call. It is optional: without a
compiler the build skips it and services/common/hashing.py uses hashlib (same values, slower).

The gRPC code (`tiercache.v1`) is generated, never committed. `make setup` installs the project
editable and puts `gen/` (written by `make protos`) on the path; a plain wheel has no `gen/`,
so its build compiles `protos/` into the wheel itself.
"""

import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class BuildPyWithProtos(build_py):
    """build_py that also compiles protos/tiercache/v1/*.proto into the build (not editable)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable installs import gen/ (see the Makefile)
        protos = sorted(str(p) for p in Path("protos/tiercache/v1").glob("*.proto"))
        if not protos:
            return
        import grpc_tools
        from grpc_tools import protoc

        well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        out = self.build_lib
        rc = protoc.main(["grpc_tools.protoc", "-Iprotos", f"-I{well_known}",
                          f"--python_out={out}", f"--pyi_out={out}",
                          f"--grpc_python_out={out}", *protos])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) compiling {protos}")


setup(
    cmdclass={"build_py": BuildPyWithProtos},
    ext_modules=[
        Extension(
            "services.common._blockhash",
            ["services/common/_blockhash.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ],
)
