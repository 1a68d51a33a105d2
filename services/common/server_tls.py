"""A server's TLS files (its certificate and key, and the client CA under mutual TLS), taken
again when they change: cert-manager and Secret rotations replace the mounted files in place
(the `..data` link swapped, or the files rewritten), and a server that kept the ones read at
start served a renewed certificate only after a restart, an expired one until then.

gRPC asks `ServerTlsFiles.fetch` before each new connection's handshake; connections made
before keep the certificate they were made with. A change is seen by the files' stat (device,
inode, size, times: cheap enough for every connection), and the files are checked before they
are taken (`tls_files_problem`, as at start): one unreadable, not PEM, a key that is not the
certificate's (a pair half rewritten) keeps the files in force, said once per version.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Mapping

import grpc

from services.common.bootstrap import requires_client_certs, server_tls_files, tls_file
from services.common.grpc_client import tls_files_problem
from services.common.metrics import gauge

log = logging.getLogger(__name__)

TLS_STALE = gauge("tiercache_tls_files_stale",
                  "1 while the server's TLS files (certificate, key, client CA) differ from "
                  "the ones in force (their latest version unreadable, not PEM, or a key "
                  "that is not the certificate's: the files read before stay), else 0; "
                  "absent without TLS", ("service",))

Stat = tuple[int, int, int, int, int] | None


def _stat(path: str) -> Stat:
    """What tells a file's versions apart without reading it (None: it cannot be stat'ed).
    Follows links: a swapped `..data` link changes the inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _version(cert: bytes) -> str:
    """The certificate file's version as logs name it: what `sha256sum` prints, 12 digits."""
    return hashlib.sha256(cert).hexdigest()[:12]


class ServerTlsFiles:
    """`service`'s server TLS files as `env` names them, read now (OSError: one cannot be)."""

    def __init__(self, service: str, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        (cert_var, cert), (key_var, key) = server_tls_files(service, env)
        ca = tls_file(env, "TIERCACHE_TLS_CA") if requires_client_certs(service, env) else ""
        self.service = service
        # The variables as set, for `tls_files_problem` to name the one at fault.
        self.env = {cert_var: cert, key_var: key, **({"TIERCACHE_TLS_CA": ca} if ca else {})}
        self.cert, self.key, self.ca = cert, key, ca
        self._lock = threading.Lock()
        self._seen = self._stats()
        self.initial, self._taken = self._load()
        TLS_STALE.labels(service).set(0)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=bool(self.ca))

    def _stats(self) -> tuple[Stat, ...]:
        return tuple(_stat(p) for p in (self.cert, self.key, self.ca) if p)

    def _load(self) -> tuple[grpc.ServerCertificateConfiguration, str]:
        cert = _read(self.cert)
        config = grpc.ssl_server_certificate_configuration(
            [(_read(self.key), cert)], root_certificates=_read(self.ca) if self.ca else None)
        return config, _version(cert)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The files' new configuration when they changed and hold a good one, else None (gRPC
        keeps the one in force). Never raises: gRPC calls it before each handshake."""
        with self._lock:
            try:
                return self._changed()
            except Exception:  # noqa: BLE001 - the files in force stay; the next look retries
                log.exception("server TLS files: could not look at %s", self._files())
                return None

    def _files(self) -> str:
        return ", ".join(f"{var} {path}" for var, path in self.env.items())

    def _changed(self) -> grpc.ServerCertificateConfiguration | None:
        now = self._stats()
        if now == self._seen:
            return None
        problem = tls_files_problem(self.service, self.env)
        config, version = (None, "") if problem else self._load()
        if self._stats() != now:  # written meanwhile: looked at again at the next handshake
            return None
        self._seen = now
        TLS_STALE.labels(self.service).set(1 if problem else 0)
        if problem:
            log.warning("server TLS files changed but were not taken (%s): keeping the ones "
                        "read before (certificate version %s)", problem, self._taken)
            return None
        self._taken = version
        log.info("server TLS files read again: %s (certificate version %s; new connections "
                 "get it)", self._files(), version)
        return config
