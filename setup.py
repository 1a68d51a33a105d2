"""The optional C extension and the generated gRPC code; everything else is in pyproject.toml.

`services.common._blockhash` computes the block-hash chain in one call. It is optional: without a
compiler the build skips it and services/common/hashing.py uses hashlib (same values, slower).

The gRPC code (`tiercache.v1`) is generated, never committed. `make setup` installs the project
editable and puts `gen/` (written by `make protos`) on the path; a plain wheel has no `gen/`,
so its build compiles `protos/` into the wheel itself.
"""

import runpy
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info


class BuildPyWithProtos(build_py):
    """build_py that also compiles protos/tiercache/v1/*.proto into the build (not editable)."""

    def run(self) -> None:
        if not getattr(self, "editable_mode", False):
            # pip builds in the tree: what an earlier build left in build/lib (a module since
            # deleted, a file since excluded) went into every later wheel. build_ext runs after.
            shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable installs import gen/ (see the Makefile)
        # The script `make protos` and the image run (scripts/gen_protos.py, in the sdist).
        script = Path(__file__).resolve().parent / "scripts" / "gen_protos.py"
        gen = runpy.run_path(str(script))
        gen["compile_protos"](self.build_lib, descriptors=True)
        # Beside the generated package, where services/common/reflection.py looks in a wheel
        # install (with the .proto comments that grpcurl describe shows).
        name = gen["DESCRIPTOR_SET_NAME"]
        Path(self.build_lib, name).replace(Path(self.build_lib, "tiercache", name))


class EggInfoWithProtos(egg_info):
    """egg_info whose top_level.txt names `tiercache` too: no package list holds it (build_py
    generates it), so importlib.metadata.packages_distributions() said no distribution
    provides `tiercache`. (An editable install lists it as well: gen/ holds it there.)"""

    def run(self) -> None:
        super().run()
        top_level = Path(self.egg_info, "top_level.txt")
        names = set(top_level.read_text().split()) | {"tiercache"}
        top_level.write_text("".join(f"{name}\n" for name in sorted(names)))


setup(
    cmdclass={"build_py": BuildPyWithProtos, "egg_info": EggInfoWithProtos},
    ext_modules=[
        Extension(
            "services.common._blockhash",
            ["services/common/_blockhash.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ],
)
