"""Rules of the generated docs' scripts (scripts/settings_doc.py, scripts/metrics_doc.py and
their scripts/docgen.py) that a walk through adding a setting and a metric found unguarded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["settings_doc", "metrics_doc"])
def test_an_out_of_date_file_names_the_script_to_run(name, tmp_path, monkeypatch, capsys):
    """Called from a test, the message named sys.argv[0], pytest's: "run python
    scripts/__main__.py"."""
    mod = load_script(name)
    monkeypatch.setattr(mod, "OUT", tmp_path / "old.md")
    (tmp_path / "old.md").write_text("old\n", encoding="utf-8")
    assert mod.main(["--check"]) == 1
    assert f"run python scripts/{name}.py" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["settings_doc", "metrics_doc"])
def test_a_script_documents_its_own_checkout(name, tmp_path):
    """Run as `python scripts/<name>.py`, the path held scripts/ and not the checkout: with
    another checkout's `services` importable (a venv shared with it, installed editable), that
    one's settings were written here. Stood in for by a `services` that cannot import."""
    fake = tmp_path / "services"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ImportError("another checkout")\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'gen'}"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), "--check"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_metrics_doc_imports_every_module_of_the_services():
    """The modules imported were a list kept by hand: a metric defined in a module left off it
    was missing from docs/metrics.md while its test passed (services/semantic, which has no
    __init__.py, is also skipped by pkgutil's walk)."""
    mod = load_script("metrics_doc")
    mod.collect()
    for p in (ROOT / "services").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        if parts[-1] != "__main__":
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            assert name in sys.modules, name
