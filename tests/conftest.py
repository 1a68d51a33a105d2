"""Shared test set-up: the repo root and generated code on sys.path."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "gen"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

try:  # one reproducible run: the same examples every time, nothing written to the repo
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, database=None)
    settings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


@pytest.fixture
def logs_clock(monkeypatch):
    """services/common/logs.py's `time`, moved only by the test (tests/clock.py LogsTime)."""
    from services.common import logs
    from tests.clock import LogsTime

    t = LogsTime()
    monkeypatch.setattr(logs, "time", types.SimpleNamespace(
        monotonic=t.monotonic, time=t.time, strftime=t.strftime, gmtime=t.gmtime,
        sleep=t.sleep))
    return t


def pytest_sessionfinish(session, exitstatus) -> None:
    """The e2e services' log folder is kept for reading a failure; after a run that passed,
    it goes (unless TIERCACHE_TEST_LOGS named it)."""
    import os
    import shutil

    e2e = sys.modules.get("tests.e2e.conftest")
    if e2e is not None and exitstatus == 0 and not os.environ.get("TIERCACHE_TEST_LOGS"):
        shutil.rmtree(e2e.LOG_DIR, ignore_errors=True)
