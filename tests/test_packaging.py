"""A plain (non-editable) wheel carries what the services import at run time."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_a_plain_wheel_has_the_generated_grpc_code_and_the_verifier_weights(tmp_path):
    # No build isolation: the venv already holds setuptools and grpcio-tools (no download).
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, cwd=tmp_path, timeout=570)
    (wheel,) = tmp_path.glob("tiercache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for proto in sorted((ROOT / "protos" / "tiercache" / "v1").glob("*.proto")):
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            assert f"tiercache/v1/{proto.stem}{suffix}" in names
    assert "services/semantic/verifier.json" in names
    assert "clients/python/cli.py" in names
