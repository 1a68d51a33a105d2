"""The CLI's choice between plaintext and (mutual) TLS from --ca/--cert/--key and their env."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from clients.python.cli import credentials


def ns(ca, cert=None, key=None, tls=False) -> argparse.Namespace:
    return argparse.Namespace(ca=ca, cert=cert, key=key, tls=tls)


def test_empty_ca_forces_plaintext_even_with_client_cert_variables_exported():
    assert credentials(ns("", "/x/client.pem", "/x/client.key")) is None


def test_no_ca_at_all_is_plaintext():
    assert credentials(ns(None)) is None


def test_cert_without_any_ca_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        credentials(ns(None, "/x/client.pem", "/x/client.key"))
    assert e.value.code == 2 and "need --ca" in capsys.readouterr().err  # a usage error


def test_cert_without_key_is_an_error(tmp_path, capsys):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(SystemExit) as e:
        credentials(ns(str(ca), "/x/client.pem", None))
    assert e.value.code == 2 and "together" in capsys.readouterr().err


def test_tls_without_a_ca_verifies_against_the_system_roots():
    # What `make run` prints for servers with only TIERCACHE_TLS_CERT (no private CA).
    assert isinstance(credentials(ns(None, tls=True)), grpc.ChannelCredentials)
    assert isinstance(credentials(ns("", tls=True)), grpc.ChannelCredentials)


# A walk of the CLI against real servers: a TLS handshake that failed wrote gRPC core's own
# plain-text INFO line ("I1208 ... ssl_transport_security.cc:2563] Handshake failed ...")
# before the CLI's error, which ended "(retry later)" (the same handshake fails again) and
# named no flag to check; a plaintext call to a TLS server said only "Socket closed".

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Certs of two CAs, and Orchestrator servers without an RPC (UNIMPLEMENTED answers any
    call once connected): plaintext, TLS, and TLS requiring a client certificate."""
    from tiercache.v1 import orchestrator_pb2_grpc

    root = tmp_path_factory.mktemp("certs")
    for name in ("a", "b"):
        subprocess.run([str(ROOT / "scripts" / "gen-certs.sh"), str(root / name)], check=True,
                       capture_output=True, timeout=60)
    a = root / "a"
    started, ports = [], {}
    for kind in ("plain", "tls", "mtls"):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(
            orchestrator_pb2_grpc.OrchestratorServicer(), server)
        if kind == "plain":
            ports[kind] = server.add_insecure_port("127.0.0.1:0")
        else:
            creds = grpc.ssl_server_credentials(
                [((a / "server.key").read_bytes(), (a / "server.pem").read_bytes())],
                root_certificates=(a / "ca.pem").read_bytes(),
                require_client_auth=kind == "mtls")
            ports[kind] = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        started.append(server)
    yield root, ports
    for server in started:
        server.stop(None)


def cli_run(port: int, *flags: str, **variables: str) -> subprocess.CompletedProcess:
    """`tiercache --address 127.0.0.1:PORT FLAGS stats` in a fresh interpreter, as a user's
    shell runs it (no GRPC_VERBOSITY set; TIERCACHE_ `variables` only)."""
    env = {k: v for k, v in os.environ.items()
           if k != "GRPC_VERBOSITY" and not k.startswith("TIERCACHE_")} | variables
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{ROOT / 'gen'}"
    return subprocess.run([sys.executable, "-m", "clients.python.cli", "--address",
                           f"127.0.0.1:{port}", "--timeout", "20", *flags, "stats"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def only_line(r: subprocess.CompletedProcess, status: int = 1) -> str:
    """The one line the failed call ends with (no other line before it), and its exit status
    (75: a "(retry later)" one)."""
    assert r.returncode == status, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_tls_to_a_plaintext_server_says_so_in_one_line_not_retry_later(servers):
    _, ports = servers
    line = only_line(cli_run(ports["plain"], "--tls"))
    assert line.startswith("error: UNAVAILABLE: "), line
    assert (f"(127.0.0.1:{ports['plain']} does not speak TLS: leave out --tls and --ca) "
            "(request ") in line, line


@pytest.mark.parametrize("flags", [["--tls"], ["--ca", "b/ca.pem"]])
def test_a_server_certificate_the_ca_does_not_sign_is_named_in_one_line(servers, flags):
    root, ports = servers
    flags = [str(root / f) if f.endswith(".pem") else f for f in flags]
    line = only_line(cli_run(ports["tls"], *flags))
    assert line.startswith("error: UNAVAILABLE: "), line
    trusted = f"--ca {root / 'b/ca.pem'}" if "--ca" in flags else "the system's trusted roots"
    assert (f"(the server's certificate is not signed by {trusted}: give --ca the CA that "
            "signed it) (request ") in line, line


def test_a_ca_from_the_environment_that_does_not_sign_the_server_is_named_by_it(servers):
    root, ports = servers
    ca = root / "b/ca.pem"
    line = only_line(cli_run(ports["tls"], TIERCACHE_TLS_CA=str(ca)))
    assert (f"(the server's certificate is not signed by --ca (env TIERCACHE_TLS_CA) {ca}: give "
            "--ca the CA that signed it) (request ") in line, line
    line = only_line(cli_run(ports["plain"], TIERCACHE_TLS_CA=str(ca)))
    assert ("does not speak TLS: leave out --tls and --ca (env TIERCACHE_TLS_CA)) (request "
            in line), line


def test_plaintext_to_a_tls_server_says_tls_may_be_wanted(servers):
    _, ports = servers
    line = only_line(cli_run(ports["tls"]), 75)
    assert line.startswith("error: UNAVAILABLE (retry later): "), line
    assert "(a server that speaks TLS closes a plaintext connection: --ca or --tls)" in line


def test_tls_without_a_client_certificate_says_one_may_be_wanted(servers):
    root, ports = servers
    # gRPC says only "Socket closed", as of a server going away: retry later (75) as well.
    line = only_line(cli_run(ports["mtls"], "--ca", str(root / "a/ca.pem")), 75)
    assert line.startswith("error: UNAVAILABLE (retry later): "), line
    assert ("(a server that requires a client certificate closes a connection without one: "
            "--cert and --key)") in line, line


def test_sound_tls_reaches_the_server(servers):
    root, ports = servers
    a = root / "a"
    r = cli_run(ports["mtls"], "--ca", str(a / "ca.pem"), "--cert", str(a / "client.pem"),
                "--key", str(a / "client.key"))
    assert only_line(r).startswith("error: UNIMPLEMENTED: Method not implemented!")


def test_tls_files_set_by_the_environment_are_named_by_their_variables(monkeypatch, capsys,
                                                                       tmp_path):
    """A walk: with the client pair exported (an env file) and no CA, the CLI said "--cert/--key
    need --ca or --tls" to a user who typed no --cert; a missing TIERCACHE_TLS_CA file was
    "--ca: cannot read ..." of a --ca never given."""
    from clients.python import cli

    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TIERCACHE_TLS_CA", raising=False)
    monkeypatch.setenv("TIERCACHE_TLS_CLIENT_CERT", "/x/client.pem")
    monkeypatch.setenv("TIERCACHE_TLS_CLIENT_KEY", "/x/client.key")
    with pytest.raises(SystemExit) as e:
        cli.main(["stats"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "tiercache: error: --cert/--key need --ca or --tls (TLS) (set by "
        "TIERCACHE_TLS_CLIENT_CERT, TIERCACHE_TLS_CLIENT_KEY)\n")
    monkeypatch.delenv("TIERCACHE_TLS_CLIENT_KEY")
    with pytest.raises(SystemExit) as e:
        cli.main(["--tls", "stats"])
    assert capsys.readouterr().err == (
        "tiercache: error: give --cert and --key together (set by TIERCACHE_TLS_CLIENT_CERT)\n")
    monkeypatch.delenv("TIERCACHE_TLS_CLIENT_CERT")
    monkeypatch.setenv("TIERCACHE_TLS_CA", str(tmp_path / "missing.pem"))
    with pytest.raises(SystemExit) as e:
        cli.main(["stats"])
    assert str(e.value.code).startswith(
        f"error: --ca (env TIERCACHE_TLS_CA): cannot read {tmp_path / 'missing.pem'}")
    with pytest.raises(SystemExit) as e:  # given as a flag: the flag alone
        cli.main(["--ca", str(tmp_path / "other.pem"), "stats"])
    assert str(e.value.code).startswith(f"error: --ca: cannot read {tmp_path / 'other.pem'}")


_SLOW_SERVER = """
import time
from concurrent import futures
import grpc
from tiercache.v1 import orchestrator_pb2, orchestrator_pb2_grpc
class Slow(orchestrator_pb2_grpc.OrchestratorServicer):
    def Generate(self, request, context):
        for i in range(2000):
            yield orchestrator_pb2.GenerateResponse(text=f"w{i} ")
            time.sleep(0.05)
server = grpc.server(futures.ThreadPoolExecutor(2))
orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Slow(), server)
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


def test_a_plaintext_server_killed_mid_answer_gets_no_tls_hint():
    """A walk: an orchestrator killed mid-answer ended the CLI's stream "UNAVAILABLE: Stream
    removed (Socket closed)", and the hint for a TLS server closing a plaintext connection was
    added to it, though this connection had served part of the answer."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{ROOT / 'gen'}"
    server = subprocess.Popen([sys.executable, "-c", _SLOW_SERVER], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        cli = subprocess.Popen([sys.executable, "-m", "clients.python.cli", "--address",
                                f"127.0.0.1:{port}", "chat", "hi"], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert cli.stdout.read(6) == "w0 w1 "  # part of the answer came
        server.kill()
        _, err = cli.communicate(timeout=60)
    finally:
        server.kill()
        server.wait()
    assert cli.returncode == 1
    line = only_line(subprocess.CompletedProcess([], 1, "", err))
    assert line.startswith("error: UNAVAILABLE: Stream removed (Socket closed) (request "), line
