"""The TLS variables of a cert set that scripts/gen-certs.sh wrote (ca.pem, server.pem and
server.key, client.pem and client.key), shared by the TLS tests."""

from __future__ import annotations

from pathlib import Path


def tls_env(certs: Path) -> dict[str, str]:
    """The shared TLS variables set to the files of the cert set `certs`: mutual TLS for every
    service, and the client pair each one's clients present."""
    return {"TIERCACHE_TLS_CERT": str(certs / "server.pem"),
            "TIERCACHE_TLS_KEY": str(certs / "server.key"),
            "TIERCACHE_TLS_CA": str(certs / "ca.pem"),
            "TIERCACHE_TLS_CLIENT_CERT": str(certs / "client.pem"),
            "TIERCACHE_TLS_CLIENT_KEY": str(certs / "client.key")}


def set_tls_env(monkeypatch, certs: Path) -> None:
    """`tls_env(certs)` set in this process's environment, until the test ends."""
    for k, v in tls_env(certs).items():
        monkeypatch.setenv(k, v)
