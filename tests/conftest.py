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


@pytest.fixture(scope="module", autouse=True)
def _labelled_metrics_cleared():
    """Each test module starts with no labelled metric children, as a service's own process
    does. Every module's in-process servers label their metrics with new addresses and ids
    (free ports), and the one registry kept them all: by the prefix tier's tests a whole-
    registry read took 15 ms (5,500 samples, 4,560 of them one orchestrator histogram's), and
    the prefix server's differential review, reading it after each call, took 4.5 s a seed in
    the whole suite against 0.9 s on its own. No service keeps a child between calls (each
    call names its labels), so a server still running sees only its own series go."""
    from services.common import metrics

    for m in list(metrics._cache.values()):
        if getattr(m, "_labelnames", ()):
            m.clear()
    yield


def pytest_sessionfinish(session, exitstatus) -> None:
    """The e2e services' log folder is kept for reading a failure; after a run that passed,
    it goes (unless TIERCACHE_TEST_LOGS named it)."""
    import os
    import shutil

    e2e = sys.modules.get("tests.e2e.conftest")
    if e2e is not None and exitstatus == 0 and not os.environ.get("TIERCACHE_TEST_LOGS"):
        shutil.rmtree(e2e.LOG_DIR, ignore_errors=True)
