"""Rules of the exec health probe (services/common/probe.py) that the mutation audit found
unguarded: the health service named is the one asked about, and a TLS file that cannot be
read is a one-line failure, not a traceback. A differential review
(tests/test_probe_differential.py) added: a status the enum does not name, and an address that
is not HOST:PORT."""

from __future__ import annotations

import pytest

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


def test_a_status_the_enum_does_not_name_is_a_line_not_a_traceback(monkeypatch):
    """An answer with a status value the client's enum has no name for (a newer server's: the
    enum is open) raised ValueError out of check(), a traceback from the exec probe."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health_pb2

    for var in ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT"):
        monkeypatch.delenv(var, raising=False)
    server = grpc.server(futures.ThreadPoolExecutor(1))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(
            lambda _req, _ctx: health_pb2.HealthCheckResponse(status=7),
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert probe.check(f"127.0.0.1:{port}", timeout=5) == (False, "unknown status 7")
    finally:
        server.stop(0)


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1", "127.0.0.1:0", ":50054",
                                     ""])
def test_an_address_that_is_not_host_port_is_a_usage_error(address, capsys):
    """gRPC dials a port past 65535 modulo 65536 (127.0.0.1:99999 is port 34463) and a missing
    port as 443: the probe asked another server and could pass on its health. Exit 2, as the
    CLI and the services' own start-up checks refuse such an address."""
    with pytest.raises(SystemExit) as e:
        probe.main([address, "--timeout", "0.2"])
    assert e.value.code == 2 and "HOST:PORT" in capsys.readouterr().err


def test_a_ca_flag_file_that_holds_no_ca_is_said_so(tmp_path):
    """`--ca FILE` of a file that is no CA (a key, a typo'd path to another file) failed as
    "UNAVAILABLE: failed to connect to all addresses", naming neither the flag nor the file:
    read as the server's fault, at every probe."""
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    ok, seen = probe.check("127.0.0.1:1", timeout=0.5, env={}, ca=str(bad))
    assert not ok and seen.startswith(f"{bad}: holds no CA certificate"), seen
