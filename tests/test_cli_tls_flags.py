"""The CLI's choice between plaintext and (mutual) TLS from --ca/--cert/--key and their env."""

from __future__ import annotations

import argparse

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
    import grpc

    assert isinstance(credentials(ns(None, tls=True)), grpc.ChannelCredentials)
    assert isinstance(credentials(ns("", tls=True)), grpc.ChannelCredentials)
