"""TIERCACHE_<SERVICE>_TLS_CLIENT_AUTH's rules: `none` lets one service (the public
orchestrator, whose tenants bring bearer tokens) take TLS clients without a certificate while
every other service under the same shared TIERCACHE_TLS_CA still requires one; a value that is
neither `require` nor `none`, or `require` without the CA, is named at start; the variable is a
setting of every service, not a typo (helpers and fixtures from test_common_edges)."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.bootstrap import create_server
from services.common.config import load_config
from services.common.grpc_client import channel_credentials_from_env, tls_env_problem
from services.orchestrator.config import OrchestratorConfig
from tests import test_common_edges as edges
from tests.certs import set_tls_env

two_cert_sets = edges.two_cert_sets  # the fixture of test_common_edges


def _check(port: int, creds: grpc.ChannelCredentials) -> bool:
    """Whether a TLS Health/Check on `port` with `creds` is answered."""
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            return False
    return True


def test_none_lets_only_its_service_take_clients_without_a_certificate(two_cert_sets,
                                                                      monkeypatch):
    """Shared CA set, TIERCACHE_ORCHESTRATOR_TLS_CLIENT_AUTH=none: the orchestrator answers a
    TLS client that trusts the CA but has no certificate; prefix, same variables, refuses it and
    answers the one with the client certificate. The shared CA alone made every server, the
    public one too, demand client certificates from tenants."""
    certs = two_cert_sets[0]
    set_tls_env(monkeypatch, certs)
    monkeypatch.setenv("TIERCACHE_ORCHESTRATOR_TLS_CLIENT_AUTH", "none")
    ca = (certs / "ca.pem").read_bytes()
    bare = grpc.ssl_channel_credentials(root_certificates=ca)
    mutual = channel_credentials_from_env()
    orch = create_server(service="orchestrator", address="127.0.0.1:0", services=[])
    pre = create_server(service="prefix", address="127.0.0.1:0", services=[])
    try:
        assert _check(orch.port, bare)
        assert _check(orch.port, mutual)
        assert not _check(pre.port, bare)
        assert _check(pre.port, mutual)
    finally:
        orch.stop(0)
        pre.stop(0)


@pytest.mark.parametrize(("value", "with_ca", "problem"), [
    ("none", True, ""),
    ("require", True, ""),
    ("none", False, ""),
    ("require", False, "needs TIERCACHE_TLS_CA"),
    ("off", True, "must be one of require, none"),
    ("", True, ""),  # empty: unset, the default (require with the CA)
    (" None\n", True, ""),  # stripped and any case, as every setting's value
    ("REQUIRE", False, "needs TIERCACHE_TLS_CA"),
])
def test_client_auth_values_are_checked_at_start(value, with_ca, problem):
    env = {"TIERCACHE_TLS_CERT": "s.pem", "TIERCACHE_TLS_KEY": "s.key",
           "TIERCACHE_ORCHESTRATOR_TLS_CLIENT_AUTH": value}
    if with_ca:
        env["TIERCACHE_TLS_CA"] = "ca.pem"
    got = tls_env_problem(env, service="orchestrator")
    assert (problem in got and "TIERCACHE_ORCHESTRATOR_TLS_CLIENT_AUTH" in got) if problem \
        else got == ""
    # Another service's own variable is not this one's concern.
    assert tls_env_problem(env, service="prefix") == ""


def test_client_auth_is_a_setting_not_a_typo():
    load_config(OrchestratorConfig, "orchestrator", [],
                {"TIERCACHE_ORCHESTRATOR_TLS_CLIENT_AUTH": "none"})


def test_the_server_reads_the_value_as_the_start_check_does():
    """Stripped and any case: " None " lets clients in without a certificate (the start check
    takes it), an empty value is the default (certificates required with the CA)."""
    from services.common.bootstrap import requires_client_certs

    var = "TIERCACHE_ORCHESTRATOR_TLS_CLIENT_AUTH"
    assert not requires_client_certs("orchestrator", {"TIERCACHE_TLS_CA": "ca", var: " None "})
    assert requires_client_certs("orchestrator", {"TIERCACHE_TLS_CA": "ca", var: ""})
    assert requires_client_certs("orchestrator", {"TIERCACHE_TLS_CA": "ca", var: "require"})
    assert not requires_client_certs("orchestrator", {var: "require"})  # no CA: no mutual TLS
    assert requires_client_certs("prefix", {"TIERCACHE_TLS_CA": "ca", var: "none"})


def _json_line(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def test_refused_handshakes_leave_the_services_log_json_lines(two_cert_sets, monkeypatch,
                                                              tmp_path):
    """A prefix process under mutual TLS, called by plaintext clients and by TLS clients
    without a certificate, then by one with it: its log holds JSON lines only. gRPC's core
    wrote one plain-text line per refused handshake ("Handshake failed with error
    SSL_ERROR_SSL ..."), not JSON and never thinned: a port scan or a misconfigured client
    grew every service's log by a line a connection (915 lines for 915 refused calls)."""
    from services.launcher import ServiceProcess, free_port

    certs = two_cert_sets[0]
    set_tls_env(monkeypatch, certs)
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)  # the service's default, not ours
    log = tmp_path / "prefix.log"
    p = ServiceProcess("prefix", free_port(), env={"TIERCACHE_PREFIX_METRICS_PORT": "-1"},
                       log_path=log)
    bare = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    try:
        p.start().wait(120)
        for _ in range(4):
            assert not _check(p.port, bare)
            with grpc.insecure_channel(p.address) as ch, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert _check(p.port, channel_credentials_from_env())
    finally:
        p.stop()
    lines = log.read_text().splitlines()
    assert lines and [ln for ln in lines if not _json_line(ln)] == []
