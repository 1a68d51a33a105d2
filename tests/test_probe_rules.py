"""Rules of the exec health probe (services/common/probe.py) that the mutation audit found
unguarded: the health service named is the one asked about, and a TLS file that cannot be
read is a one-line failure, not a traceback."""

from __future__ import annotations

from services.common import probe
from services.common.bootstrap import create_server


def test_the_named_health_service_is_the_one_checked(monkeypatch):
    """`--service NAME` asks about NAME: a name the server does not serve is not SERVING,
    though the whole server is."""
    for var in ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT"):
        monkeypatch.delenv(var, raising=False)
    handle = create_server(service="probe-rules", address="127.0.0.1:0", services=[])
    try:
        handle.set_serving()
        addr = f"127.0.0.1:{handle.port}"
        assert probe.check(addr, timeout=5) == (True, "SERVING")
        ok, seen = probe.check(addr, service="tiercache.v1.NoSuchService", timeout=5)
        assert not ok and seen.startswith("NOT_FOUND"), seen
    finally:
        handle.stop(0)


def test_an_unreadable_tls_file_fails_the_check_with_its_reason(tmp_path):
    """A CA file that is missing answers (False, "cannot read a TLS file: ...") (exit 1 with
    one line), before any call."""
    missing = tmp_path / "ca.pem"
    ok, seen = probe.check("127.0.0.1:1", env={"TIERCACHE_TLS_CA": str(missing)})
    assert not ok and seen.startswith("cannot read a TLS file:") and str(missing) in seen
