"""A plain (non-editable) wheel carries what the services import at run time."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_packaging_rules import _wheel

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    (built,) = _wheel(ROOT, tmp_path_factory.mktemp("dist"), timeout=570)
    return built


@pytest.mark.timeout(600)
def test_a_plain_wheel_has_the_generated_grpc_code_and_the_verifier_weights(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for proto in sorted((ROOT / "protos" / "tiercache" / "v1").glob("*.proto")):
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            assert f"tiercache/v1/{proto.stem}{suffix}" in names
    assert "services/semantic/verifier.json" in names
    assert "tiercache/tiercache_descriptors.pb" in names  # reflection with the proto comments
    # Installed from the wheel alone (no gen/ on the path), reflection finds that set.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import sys; sys.path[:] = [sys.argv[1]] + [p for p in sys.path if p and "
             "not p.endswith('/gen') and p != sys.argv[2]]; "
             "from services.common.reflection import descriptor_set_path, source_info_pool; "
             "p = descriptor_set_path(); assert str(p).startswith(sys.argv[1]), p; "
             "assert source_info_pool() is not None; print(p)")
    out = subprocess.run([sys.executable, "-c", probe, str(site), str(ROOT)], check=True,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("tiercache/tiercache_descriptors.pb")
    assert "clients/python/cli.py" in names


@pytest.mark.timeout(600)
def test_the_wheels_top_level_names_say_it_provides_the_grpc_package(wheel, tmp_path):
    """top_level.txt listed services, clients and benchmarks, not the generated `tiercache`,
    so packages_distributions() (which reads that file) gave no distribution for it."""
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    (top_level,) = (tmp_path / "site").glob("tiercache-*.dist-info/top_level.txt")
    assert top_level.read_text().split() == ["benchmarks", "clients", "services", "tiercache"]
    # Python without site-packages (the venv's editable install): the wheel's files alone.
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import importlib.metadata as md; "
             "print(md.packages_distributions().get('tiercache'))")
    out = subprocess.run([sys.executable, "-S", "-c", probe, str(tmp_path / "site")],
                         check=True, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["['tiercache']"]
