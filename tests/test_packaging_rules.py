"""What the sdist and the wheel hold: what a build from the sdist needs, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_the_sdist_builds_wheels_holding_only_what_the_tree_has(tmp_path):
    """The sdist held tests/test_*.py alone (setuptools' default: no conftest.py, no helpers,
    no subfolders; none of it runnable) and the wheel the hasher's C source beside its build;
    a wheel built again in the same tree held whatever the last build left in build/lib."""
    build = ("import sys; from setuptools import build_meta as b; "
             "print(b.build_sdist(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", build, str(tmp_path)], check=True, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    sdist = tmp_path / out.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
        tar.extractall(tmp_path / "src", filter="data")
    assert not [n for n in names if n.startswith("tests")], names
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "/gen/" in f"/{n}"], names
    for needed in ("setup.py", "pyproject.toml", "scripts/gen_protos.py",
                   "services/common/_blockhash.c", "services/semantic/verifier.json",
                   "protos/tiercache/v1/orchestrator.proto"):
        assert needed in names
    (src,) = (tmp_path / "src").iterdir()
    (wheel,) = _wheel(src, tmp_path / "dist")
    files = set(zipfile.ZipFile(wheel).namelist())
    assert "tiercache/v1/orchestrator_pb2_grpc.py" in files
    assert "services/semantic/verifier.json" in files
    assert "services/common/_blockhash.c" not in files
    # pip builds in the tree: a file an earlier build left in build/lib is in no later wheel.
    for lib in (src / "build").glob("lib*"):
        (lib / "services" / "stale_module.py").write_text("")
    (wheel,) = _wheel(src, tmp_path / "again")
    assert "services/stale_module.py" not in zipfile.ZipFile(wheel).namelist()
    assert "services/common/_blockhash.cpython" in " ".join(zipfile.ZipFile(wheel).namelist())


def _wheel(src: Path, out: Path, timeout: float = 300) -> list[Path]:
    """The wheels pip builds of the tree `src` into `out`. No build isolation: the venv
    already holds setuptools and grpcio-tools (no download)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)],
                   check=True, cwd=out.parent, timeout=timeout)
    return list(out.glob("tiercache-*.whl"))
