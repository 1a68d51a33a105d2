"""Fixtures of the report's tests (test_report_keys, test_report_rules)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks import report

RESULTS = Path(report.RESULTS)


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A copy of the stored results (json only), the report pointed at it."""
    root = tmp_path / "repo"
    out = root / "benchmarks" / "results"
    out.mkdir(parents=True)
    for p in RESULTS.glob("*.json"):
        shutil.copy(p, out / p.name)
    monkeypatch.setattr(report, "ROOT", root)
    monkeypatch.setattr(report, "RESULTS", out)
    return out
