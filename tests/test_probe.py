"""`python -m services.common.probe`: the exec health probe for TLS deployments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import probe
from services.common.bootstrap import create_server
from services.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]


def run_probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.common.probe", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


def test_exit_status_follows_health_over_plaintext(monkeypatch) -> None:
    for var in ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT"):
        monkeypatch.delenv(var, raising=False)
    handle = create_server(service="probe-test", address="127.0.0.1:0", services=[])
    try:
        addr = f"127.0.0.1:{handle.port}"
        ok, seen = probe.check(addr)
        assert not ok and seen == "NOT_SERVING"
        handle.set_serving()
        ok, seen = probe.check(addr)
        assert ok and seen == "SERVING"
        r = run_probe(addr)
        assert r.returncode == 0 and "SERVING" in r.stdout
    finally:
        handle.stop(0)
    r = run_probe(f"127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr
    assert run_probe("127.0.0.1:1", "--timeout", "0").returncode == 2


def test_half_a_client_key_pair_is_one_line_not_a_traceback(tmp_path) -> None:
    import os

    env = {**os.environ, "TIERCACHE_TLS_CA": "/etc/hostname",
           "TIERCACHE_TLS_CLIENT_CERT": "/etc/hostname"}
    env.pop("TIERCACHE_TLS_CLIENT_KEY", None)
    r = run_probe("127.0.0.1:1", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "TIERCACHE_TLS_CLIENT_KEY" in r.stderr


def _certs(d: Path) -> None:
    """A CA and a server certificate for the name tiercache.test only (not 127.0.0.1)."""
    def ossl(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "2", "-subj", "/CN=probe-test-ca")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
         "-subj", "/CN=tiercache.test")
    (d / "ext.cnf").write_text("subjectAltName=DNS:tiercache.test\n")
    ossl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "srv.crt", "-days", "2", "-extfile", "ext.cnf")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_probe_verifies_the_certificate_under_its_server_name(tmp_path, monkeypatch) -> None:
    _certs(tmp_path)
    monkeypatch.setenv("TIERCACHE_TLS_CERT", str(tmp_path / "srv.crt"))
    monkeypatch.setenv("TIERCACHE_TLS_KEY", str(tmp_path / "srv.key"))
    monkeypatch.delenv("TIERCACHE_TLS_CA", raising=False)  # TLS without client certificates
    handle = create_server(service="probe-tls", address="127.0.0.1:0", services=[])
    try:
        handle.set_serving()
        addr = f"127.0.0.1:{handle.port}"
        ca_env = {"TIERCACHE_TLS_CA": str(tmp_path / "ca.crt")}
        # The certificate names tiercache.test, not 127.0.0.1: refused unless told the name.
        ok, seen = probe.check(addr, env=ca_env)
        assert not ok and seen.startswith("UNAVAILABLE"), seen
        ok, seen = probe.check(addr, server_name="tiercache.test", env=ca_env)
        assert ok and seen == "SERVING"
        # A plaintext probe does not pass against a TLS server.
        ok, _ = probe.check(addr, server_name="tiercache.test", env={})
        assert not ok
    finally:
        handle.stop(0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_ca_flag_verifies_a_server_the_stacks_own_ca_did_not_sign(tmp_path, monkeypatch) -> None:
    """A public orchestrator's certificate is not signed by TIERCACHE_TLS_CA (the stack's own
    CA), and the probe verified every server against that CA only: its startup probe never
    passed. `--ca FILE` (or `--ca system`, the system's roots) verifies against another."""
    _certs(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _certs(other)  # the stack's own CA: did not sign the server's certificate
    monkeypatch.setenv("TIERCACHE_TLS_CERT", str(tmp_path / "srv.crt"))
    monkeypatch.setenv("TIERCACHE_TLS_KEY", str(tmp_path / "srv.key"))
    monkeypatch.delenv("TIERCACHE_TLS_CA", raising=False)
    handle = create_server(service="probe-public", address="127.0.0.1:0", services=[])
    try:
        handle.set_serving()
        addr = f"127.0.0.1:{handle.port}"
        env = {"TIERCACHE_TLS_CA": str(other / "ca.crt")}
        ok, seen = probe.check(addr, server_name="tiercache.test", env=env)
        assert not ok and seen.startswith("UNAVAILABLE"), seen
        ok, seen = probe.check(addr, server_name="tiercache.test", env=env,
                               ca=str(tmp_path / "ca.crt"))
        assert ok and seen == "SERVING"
        # Over TLS even where the environment is plaintext, and verified: the system's
        # roots do not trust this test CA.
        ok, seen = probe.check(addr, server_name="tiercache.test", env={}, ca=probe.SYSTEM_ROOTS)
        assert not ok and seen.startswith("UNAVAILABLE"), seen
        r = run_probe(addr, "--server-name", "tiercache.test", "--ca", str(tmp_path / "ca.crt"),
                      env={**os.environ, **env})
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stderr
    finally:
        handle.stop(0)
