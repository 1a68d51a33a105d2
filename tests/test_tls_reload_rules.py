"""A server takes its TLS files again when they are replaced in place (a Secret's `..data` link
swapped, as the kubelet does; the files rewritten), for new connections: it kept those read at
start, and served a renewed certificate only after a restart. A replacement that cannot serve
(not PEM, a key that is not the certificate's) keeps the old files, with a WARNING naming the
file. Real servers on loopback, real handshakes (two certificate sets of separate CAs, from
scripts/gen-certs.sh via test_common_edges' fixture)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.bootstrap import create_server
from tests import test_common_edges as edges
from tests.log_lines import lines_with_ids
from tests.metric_sample import sample_value

two_cert_sets = edges.two_cert_sets  # the fixture of test_common_edges

FILES = {"tls.crt": "server.pem", "tls.key": "server.key", "ca.crt": "ca.pem"}


def answers(port: int, certs: Path, *, client_cert: bool = False) -> bool:
    """Whether a Health/Check on `port` over TLS trusting only `certs`' CA (presenting its
    client certificate if asked) is answered, on a connection of its own."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(certs / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(certs / "client.pem").read_bytes() if client_cert else None)
    with grpc.secure_channel(f"127.0.0.1:{port}", creds,
                             options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            return False
    return True


def mount(root: Path, certs: Path, version: str) -> None:
    """`certs` put in `root` as the kubelet updates a mounted Secret: the files in a new
    folder, a `..data` link to it swapped in by rename, the old folder removed."""
    folder = root / f"..{version}"
    folder.mkdir()
    for name, src in FILES.items():
        shutil.copy(certs / src, folder / name)
    old = os.readlink(root / "..data") if (root / "..data").is_symlink() else None
    os.symlink(folder.name, root / "..data_tmp")
    os.replace(root / "..data_tmp", root / "..data")
    for name in FILES:
        if not (root / name).is_symlink():
            os.symlink(f"..data/{name}", root / name)
    if old:
        shutil.rmtree(root / old)


def serve(monkeypatch, root: Path, *, mutual: bool):
    monkeypatch.setenv("TIERCACHE_TLS_CERT", str(root / "tls.crt"))
    monkeypatch.setenv("TIERCACHE_TLS_KEY", str(root / "tls.key"))
    if mutual:
        monkeypatch.setenv("TIERCACHE_TLS_CA", str(root / "ca.crt"))
    else:
        monkeypatch.delenv("TIERCACHE_TLS_CA", raising=False)
    return create_server(service="prefix", address="127.0.0.1:0", services=[])


def stale() -> float | None:
    return sample_value("tiercache_tls_files_stale", {"service": "prefix"})


def test_a_swapped_secret_mount_is_served_to_new_connections(two_cert_sets, monkeypatch,
                                                             tmp_path):
    """Mutual TLS from a Secret-like mount; its `..data` link swapped to set B (certificate,
    key and client CA): a new connection gets B's certificate and B's client CA checks it."""
    a, b = two_cert_sets
    mount(tmp_path, a, "1")
    server = serve(monkeypatch, tmp_path, mutual=True)
    try:
        assert answers(server.port, a, client_cert=True)
        assert not answers(server.port, b, client_cert=True)
        mount(tmp_path, b, "2")
        assert answers(server.port, b, client_cert=True)
        assert not answers(server.port, a, client_cert=True)
    finally:
        server.stop(0)


def test_files_overwritten_in_place_are_served_to_new_connections(two_cert_sets,
                                                                  monkeypatch, tmp_path):
    """Plain files rewritten in place, the key after the certificate: B once both are."""
    a, b = two_cert_sets
    for name, src in FILES.items():
        shutil.copy(a / src, tmp_path / name)
    server = serve(monkeypatch, tmp_path, mutual=False)
    try:
        assert answers(server.port, a) and not answers(server.port, b)
        (tmp_path / "tls.crt").write_bytes((b / "server.pem").read_bytes())
        # Half the pair rewritten: B's certificate with A's key cannot serve; A stays.
        assert answers(server.port, a) and not answers(server.port, b)
        (tmp_path / "tls.key").write_bytes((b / "server.key").read_bytes())
        assert answers(server.port, b) and not answers(server.port, a)
    finally:
        server.stop(0)


@pytest.mark.parametrize("bad", ["not pem", "truncated", "another key"])
def test_a_bad_replacement_keeps_the_old_files_with_a_warning(two_cert_sets, monkeypatch,
                                                             tmp_path, bad):
    """A replacement that cannot serve: A stays, one WARNING names the file, the stale metric
    says 1; the good one after it is taken (INFO) and the metric says 0 again."""
    a, b = two_cert_sets
    mount(tmp_path, a, "1")
    server = serve(monkeypatch, tmp_path, mutual=False)
    try:
        (tmp_path / "..1" / "tls.crt").unlink()  # rewritten below, not through the link
        cert = (b / "server.pem").read_bytes()
        (tmp_path / "..1" / "tls.crt").write_bytes(
            {"not pem": b"garbage\n", "truncated": cert[:len(cert) // 2],
             "another key": cert}[bad])
        with lines_with_ids("services.common.server_tls", logging.INFO) as lines:
            assert answers(server.port, a) and answers(server.port, a)
            assert not answers(server.port, b)
        warned = [m for m, _ in lines if "not taken" in m]
        assert len(warned) == 1 and str(tmp_path / "tls.crt") in warned[0], lines
        assert stale() == 1
        mount(tmp_path, b, "2")
        with lines_with_ids("services.common.server_tls", logging.INFO) as lines:
            assert answers(server.port, b) and not answers(server.port, a)
        assert [m for m, _ in lines if "read again" in m], lines
        assert stale() == 0
    finally:
        server.stop(0)
