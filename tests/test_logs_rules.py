"""Rules of the JSON logs and of `Thinned` (services/common/logs.py) that the mutation audit
found unguarded: what a thinned key's count line says and when, credentials masked by the
name of any field that holds one, tracebacks kept, and an unknown log level named."""

from __future__ import annotations

import json
import logging
import sys
import time

import pytest

from services.common import logs
from services.common.logs import JsonFormatter, Thinned


def thinned(name: str, **kw) -> Thinned:
    """A Thinned that only the test's own calls sweep (not the background sweeper)."""
    t = Thinned(logging.getLogger(name), **kw)
    Thinned._all.discard(t)
    t.SWEEP_S = 3600.0
    return t


def left_out_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]


def test_a_window_with_nothing_left_out_says_nothing(caplog, logs_clock):
    """The count line says how many lines were left out: a window that left none out (the
    usual case) writes no "0 more lines" line, at its end or at a stop."""
    t = thinned("tests.logs.none-left", per_window=2, window_s=10.0)
    with caplog.at_level(logging.INFO, logger="tests.logs.none-left"):
        assert t.allow(("svc", "Lookup", "NOT_FOUND"))
        logs_clock.advance(11)
        assert t.allow(("svc", "Lookup", "NOT_FOUND"))  # a new window: the old one is over
        t.sweep()
        t.flush()
    assert left_out_lines(caplog) == []


def test_the_count_line_says_when_the_first_and_the_last_were_left_out(caplog, logs_clock):
    """"between <first> and <last>": the time of the first line left out is kept, not moved
    to each later one."""
    t = thinned("tests.logs.between", per_window=1, window_s=60.0)
    key = ("svc", "Store", "UNAVAILABLE")
    first = time.strftime("%H:%M:%S", time.gmtime(logs_clock.wall + 2))
    last = time.strftime("%H:%M:%S", time.gmtime(logs_clock.wall + 32))
    with caplog.at_level(logging.INFO, logger="tests.logs.between"):
        assert t.allow(key)
        logs_clock.advance(2)
        assert not t.allow(key)
        for _ in range(3):
            logs_clock.advance(10)
            assert not t.allow(key)
        t.flush()
    assert left_out_lines(caplog) == [
        f"svc/Store/UNAVAILABLE: 4 more lines left out between {first} and {last}Z"]


def test_a_keys_next_line_after_its_window_says_the_count_first(caplog, logs_clock):
    """The key's next line, once its window is over, says how many were left out before it
    is written (no sweep needed)."""
    t = thinned("tests.logs.next-line", per_window=1, window_s=0.5)
    key = ("replica r1", "UNAVAILABLE")
    with caplog.at_level(logging.INFO, logger="tests.logs.next-line"):
        assert t.allow(key)
        assert not t.allow(key)
        assert not t.allow(key)
        logs_clock.advance(0.6)
        assert t.allow(key)
    assert [m.split(" between")[0] for m in left_out_lines(caplog)] == [
        "replica r1/UNAVAILABLE: 2 more lines left out"]


def _format(fields: dict | None = None, exc_info=None) -> dict:
    record = logging.LogRecord("tests.logs", logging.ERROR, __file__, 1, "boom %s", ("x",),
                               exc_info)
    if fields is not None:
        record.fields = fields
    return json.loads(JsonFormatter("svc").format(record))


def test_a_field_whose_name_says_credential_is_masked():
    """"Never log credentials": any field whose name contains authorization, token, secret
    or password (internal_token, api_password...), not only a field named exactly so."""
    out = _format({"internal_token": "t0k", "db_password": "pw", "Authorization": "Bearer x",
                   "client_secret": "s", "model": "smollm2"})
    assert out["internal_token"] == out["db_password"] == "***"
    assert out["Authorization"] == out["client_secret"] == "***"
    assert out["model"] == "smollm2" and out["msg"] == "boom x" and out["service"] == "svc"


def test_a_logged_exception_keeps_its_traceback():
    """`log.exception(...)` in a JSON line carries the traceback (field `exc`)."""
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        out = _format(exc_info=sys.exc_info())
    assert "ZeroDivisionError" in out["exc"] and "Traceback" in out["exc"]


def test_an_unknown_log_level_is_refused_naming_the_variable():
    """An unknown TIERCACHE_LOG_LEVEL fails the start with a message that names the variable
    and the levels it takes (the boot logs it and exits 2), not logging's bare ValueError."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        with pytest.raises(ValueError, match=r"TIERCACHE_LOG_LEVEL: unknown level 'verbose'; "
                                             r"expected one of DEBUG, INFO"):
            logs.setup_logging("demo", "verbose")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def test_a_closed_or_replaced_stream_is_no_terminal():
    """`isatty` is False for a closed stream (its isatty raises ValueError) and for an object
    that is no stream at all, rather than an error at start."""
    import io

    closed = io.StringIO()
    closed.close()
    assert logs.isatty(closed) is False
    assert logs.isatty(object()) is False


def test_past_the_key_bound_no_count_is_lost(caplog, logs_clock):
    """Keys are few, and a bound keeps them so: past 4,096 keys in one window the table was
    cleared, and with it every key's count of lines left out, never said (a differential
    review, tests/test_logs_differential.py)."""
    t = thinned("tests.logs.bound", per_window=1, window_s=10.0)
    with caplog.at_level(logging.INFO, logger="tests.logs.bound"):
        assert t.allow(("svc", "Lookup", "NOT_FOUND"))
        assert not t.allow(("svc", "Lookup", "NOT_FOUND"))
        for i in range(4100):  # within the same second: no sweep meanwhile
            assert t.allow(("peer", i))
        t.flush()
    assert [m.split(" between")[0] for m in left_out_lines(caplog)] == [
        "svc/Lookup/NOT_FOUND: 1 more lines left out"]
    caplog.clear()
    # A key whose window is over, its count said by its next line as the table fills: once.
    t = thinned("tests.logs.bound-over", per_window=1, window_s=0.5)
    with caplog.at_level(logging.INFO, logger="tests.logs.bound-over"):
        assert t.allow(("svc", "Store", "NOT_FOUND"))
        assert not t.allow(("svc", "Store", "NOT_FOUND"))
        for i in range(4096):
            assert t.allow(("peer", i))
        logs_clock.advance(0.625)
        assert t.allow(("svc", "Store", "NOT_FOUND"))
        t.flush()
    assert [m.split(" between")[0] for m in left_out_lines(caplog)] == [
        "svc/Store/NOT_FOUND: 1 more lines left out"]


def test_a_count_of_warnings_is_a_warning(caplog, logs_clock):
    """The orchestrator's degradations and the refused callers are thinned WARNINGs: their
    count was an INFO line, unseen where TIERCACHE_LOG_LEVEL=WARNING showed the WARNINGs (an
    outage's lines stopped at 10 with no word of the rest). Each says it at its lines' level."""
    from services.common import bootstrap
    from services.orchestrator import pipeline, server

    for t in (pipeline._DEGRADED_LINES, server._WARM_FAILED_LINES, bootstrap._AUTH_LINES):
        assert t.level == logging.WARNING
    assert bootstrap._ERROR_LINES.level == logging.INFO  # "<method> ended <CODE>" lines
    t = thinned("tests.logs.warning", per_window=1, window_s=10.0)
    t.level = logging.WARNING
    with caplog.at_level(logging.WARNING, logger="tests.logs.warning"):
        assert t.allow(("replica r1", "UNAVAILABLE"))
        assert not t.allow(("replica r1", "UNAVAILABLE"))
        t.flush()
    assert [(r.levelno, r.getMessage().split(" between")[0]) for r in caplog.records] == [
        (logging.WARNING, "replica r1/UNAVAILABLE: 1 more lines left out")]


def test_responses_refused_for_size_are_counted_as_warnings(caplog, logs_clock):
    """A response over the send limit is a thinned WARNING: it shared the "<method> ended
    <CODE>" lines' INFO instance, so past 10 of them their count was an INFO line, unseen at
    TIERCACHE_LOG_LEVEL=WARNING."""
    import grpc

    from services.common import bootstrap

    class Context:
        def abort(self, code, details):
            raise grpc.RpcError(code, details)

    key = ("svc-size-test", "Get")
    bootstrap._TOO_LARGE_LINES._seen.pop(key, None)
    with caplog.at_level(logging.WARNING, logger=bootstrap.log.name):
        for _ in range(12):
            with pytest.raises(grpc.RpcError):
                bootstrap._too_large(Context(), *key, 5000, 2048)
        bootstrap._TOO_LARGE_LINES.flush()
    mine = [r for r in caplog.records if "Get" in r.getMessage()]
    assert [r.levelno for r in mine] == [logging.WARNING] * 11
    assert mine[-1].getMessage().startswith("svc-size-test/Get: 2 more lines left out")
