"""Only the optional C extension lives here; everything else is in pyproject.toml.

`services.common._blockhash` computes the block-hash chain in one call. It is optional: without a
compiler the build skips it and services/common/hashing.py uses hashlib (same values, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "services.common._blockhash",
            ["services/common/_blockhash.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
