"""grpc_client's rules a mutation audit found unguarded: which variable turns TLS to the
system's roots on, the request id and credential an outgoing call carries, and channels to our
services taking the shared options (16 MiB messages), over TLS too."""

from __future__ import annotations

import grpc
import pytest

from services.common.bootstrap import create_server
from services.common.grpc_client import (
    call_metadata,
    health_error,
    make_channel,
    timeout_or,
    tls_mode,
)
from services.common.logs import bound_request_id
from tests import test_common_edges as edges
from tests.certs import set_tls_env

two_cert_sets = edges.two_cert_sets  # the fixture of test_common_edges


def test_clients_speak_tls_to_the_systems_roots_on_the_servers_certificate_alone():
    """tls_mode: the shared server certificate without a CA is "roots"; its key alone (half a
    pair, refused elsewhere) turns nothing on."""
    assert tls_mode({"TIERCACHE_TLS_CERT": "s.pem"}) == "roots"
    assert tls_mode({"TIERCACHE_TLS_KEY": "s.key"}) == ""
    assert tls_mode({"TIERCACHE_TLS_CA": "ca.pem", "TIERCACHE_TLS_CERT": "s.pem"}) == "ca"


def test_an_outgoing_call_carries_the_given_request_id_else_the_bound_one_else_a_new_one():
    """call_metadata: the request id given wins over the one bound to this request; with
    neither, each call gets a fresh non-empty id."""
    with bound_request_id("bound-1"):
        assert call_metadata(request_id="given-2") == [("x-request-id", "given-2")]
        assert call_metadata() == [("x-request-id", "bound-1")]
    a, b = dict(call_metadata()), dict(call_metadata())
    assert a["x-request-id"] and b["x-request-id"] and a != b
    assert dict(call_metadata("tok"))["authorization"] == "Bearer tok"


def _big_server():
    """A server whose one method answers 5 MiB (past gRPC's default 4 MiB a channel takes)."""

    def big(_request, _context):
        return b"x" * (5 << 20)

    def add(_servicer, server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "x.Big", {"Get": grpc.unary_unary_rpc_method_handler(big)}),))

    return create_server(service="big", address="127.0.0.1:0", services=[(add, None, "x.Big")])


@pytest.mark.parametrize("tls", [False, True])
def test_a_channel_to_a_service_takes_messages_up_to_the_shared_limit(tls, two_cert_sets,
                                                                      monkeypatch):
    """make_channel: plaintext and TLS channels both take the shared options; without them a
    5 MiB answer (the limit is 16 MiB) was RESOURCE_EXHAUSTED at the client."""
    for var in ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY",
                "TIERCACHE_TLS_CLIENT_CERT", "TIERCACHE_TLS_CLIENT_KEY",
                "TIERCACHE_BIG_TLS_CERT", "TIERCACHE_BIG_TLS_KEY"):
        monkeypatch.delenv(var, raising=False)
    if tls:
        set_tls_env(monkeypatch, two_cert_sets[0])
    h = _big_server()
    try:
        with make_channel(f"127.0.0.1:{h.port}") as ch:
            got = ch.unary_unary("/x.Big/Get")(b"", timeout=10)
        assert len(got) == 5 << 20
    finally:
        h.stop(0)


def test_timeout_or_keeps_a_zero_timeout_and_fills_in_only_none():
    """0 is a deadline already passed (gRPC fails the call at once), not "use the default"."""
    assert timeout_or(0, 30.0) == 0
    assert timeout_or(0.0, 30.0) == 0.0
    assert timeout_or(None, 30.0) == 30.0
    assert timeout_or(1.5, 30.0) == 1.5


def test_a_tiers_timeout_is_said_as_how_long_nobody_answered():
    """health_error: a deadline reads "no answer within <the call's timeout, else the tier's>s"
    (gRPC's bare "Deadline Exceeded" named no deadline); any other failure is kept as it came."""
    from tests.orchestrator.test_pipeline_paths import RpcError

    late = RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert health_error(late, 0.25, 2.0) == "no answer within 0.25s (timed out)"
    assert health_error(late, None, 2.0) == "no answer within 2s (timed out)"
    down = RpcError(grpc.StatusCode.UNAVAILABLE)
    assert health_error(down, 0.25, 2.0) is down


def test_tls_file_variables_expand_a_leading_tilde_as_every_path_setting_does(
        two_cert_sets, monkeypatch):
    """"~/certs/server.pem" from an env file stopped the service at start ("cannot read
    ~/certs/server.pem"), though cache_dir, db_path, model and tokens_file expand `~`. The
    start's checks, the server's files and the clients' credentials all read it expanded."""
    from services.common.bootstrap import server_credentials_from_env, server_tls_files
    from services.common.grpc_client import channel_credentials_from_env, tls_files_problem

    a, _ = two_cert_sets
    monkeypatch.setenv("HOME", str(a.parent))
    env = {"TIERCACHE_TLS_CERT": "~/a/server.pem", "TIERCACHE_TLS_KEY": "~/a/server.key",
           "TIERCACHE_TLS_CA": "~/a/ca.pem", "TIERCACHE_TLS_CLIENT_CERT": "~/a/client.pem",
           "TIERCACHE_TLS_CLIENT_KEY": "~/a/client.key"}
    assert tls_files_problem("prefix", env) == ""
    assert server_tls_files("prefix", env) == (("TIERCACHE_TLS_CERT", str(a / "server.pem")),
                                               ("TIERCACHE_TLS_KEY", str(a / "server.key")))
    assert channel_credentials_from_env(env) is not None
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert server_credentials_from_env("prefix") is not None
