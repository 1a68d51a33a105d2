"""Client-side helpers shared by services that call other services."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping

import grpc

from services.common.bootstrap import (
    CLIENT_AUTH_VALUES,
    channel_options,
    client_auth,
    client_auth_var,
    server_tls_files,
    tls_file,
)
from services.common.logs import request_id_var


def tls_mode(env: Mapping[str, str] | None = None) -> str:
    """How callers of this stack's services connect, from the same variables the servers read:
    "ca" (`TIERCACHE_TLS_CA` set: verify against it, present the client certificate if any),
    "roots" (only the servers' `TIERCACHE_TLS_CERT`: verify against the system's roots) or ""
    (plaintext). The one place this is decided: internal clients, the launcher's health wait and
    the grpcurl hints all follow it."""
    env = os.environ if env is None else env
    if env.get("TIERCACHE_TLS_CA"):
        return "ca"
    return "roots" if env.get("TIERCACHE_TLS_CERT") else ""


# A cache tier (semantic lookup/store, prefix index match) answers in milliseconds: one that
# has not answered a call within this long has stalled, even when the request's own deadline
# is what shortened that call.
STALL_EVIDENCE_S = 0.5


def cut_short(e: grpc.RpcError, timeout: float | None, full_s: float) -> bool:
    """Whether `e` is a deadline the caller's own shorter timeout ran into (the request had
    little time left): it says nothing of the dependency's health. A call given at least
    STALL_EVIDENCE_S is never cut short: otherwise a tier that hangs would never be marked so
    while every request's deadline is shorter than the tier's timeout."""
    return (e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None
            and timeout < min(full_s, STALL_EVIDENCE_S))


def timeout_or(timeout: float | None, default: float) -> float:
    """The caller's `timeout`, or `default` when it gave none. Not `timeout or default`: a
    timeout of 0 (no time left) is a deadline already passed, not a request for the full one."""
    return default if timeout is None else timeout


# A caller's own bad request or an id the dependency does not know: it answered as it should.
CALLERS_FAULT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


def tells_of_health(e: grpc.RpcError, timeout: float | None, full_s: float) -> bool:
    """Whether the failure `e` of a call to a dependency says anything of its health: not the
    caller's fault (`CALLERS_FAULT`), nor a deadline its own shorter timeout ran into
    (`cut_short`). What the tiers' health records and a prefix shard's record go by."""
    return e.code() not in CALLERS_FAULT and not cut_short(e, timeout, full_s)


def health_error(e: grpc.RpcError, timeout: float | None, full_s: float) -> grpc.RpcError | str:
    """What a cache tier's health record says of the failure `e` of a call given `timeout`
    seconds (`full_s`: the tier's own timeout, when the call was given none): a timeout says
    how long nobody answered; gRPC's bare "Deadline Exceeded" said neither whose deadline
    nor that the tier had not answered (a SIGSTOPped semantic tier read so in Stats and in
    the "is unhealthy" line). Anything else as it came."""
    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
        return e
    return f"no answer within {timeout_or(timeout, full_s):g}s (timed out)"


def unary_call(rpc, request, on_call: Callable[[grpc.Future], None] | None = None, **kw):
    """One call of a stub's unary method `rpc`. With `on_call`, the call is made as a future,
    handed to `on_call` as it starts (so that a request can cancel it when its client goes):
    cancelled, it raises grpc.FutureCancelledError (not an RpcError: nothing learnt of the
    server). `kw`: the call's timeout, metadata."""
    if on_call is None:
        return rpc(request, **kw)
    call = rpc.future(request, **kw)
    on_call(call)
    return call.result()


_HALF_CLIENT_PAIR = "TIERCACHE_TLS_CLIENT_CERT and TIERCACHE_TLS_CLIENT_KEY must be set together"


def _half_client_pair(env: Mapping[str, str]) -> bool:
    """One of the client certificate and key without the other (gRPC's C core aborts on it)."""
    return bool(env.get("TIERCACHE_TLS_CLIENT_CERT")) != bool(env.get("TIERCACHE_TLS_CLIENT_KEY"))


def tls_env_problem(env: Mapping[str, str] | None = None, service: str = "") -> str:
    """What is wrong with the TLS variables ("" = nothing): half a client key pair (gRPC's C
    core aborts the process on it), half the server's pair (a traceback at bind), or a CA
    without the server certificate (servers would speak plaintext while every client speaks
    TLS), or a TIERCACHE_<SERVICE>_TLS_CLIENT_AUTH that is not `require`/`none` (or is
    `require` without the CA). `service`'s own TIERCACHE_<SERVICE>_TLS_CERT/_KEY stand in for
    the shared ones, as the server reads them (`server_tls_files`)."""
    env = os.environ if env is None else env
    if _half_client_pair(env):
        return _HALF_CLIENT_PAIR
    (cert_var, cert), (key_var, key) = server_tls_files(service, env)
    if bool(cert) != bool(key):
        return f"{cert_var} and {key_var} must be set together"
    if env.get("TIERCACHE_TLS_CA") and not (cert and key):
        return ("TIERCACHE_TLS_CA needs TIERCACHE_TLS_CERT and TIERCACHE_TLS_KEY (or the "
                "service's own TIERCACHE_<SERVICE>_TLS_CERT/_KEY): with the CA every client "
                "speaks TLS, so the servers must too")
    auth_var = client_auth_var(service) if service else ""
    auth = client_auth(service, env) if service else ""
    if auth and auth not in CLIENT_AUTH_VALUES:
        return f"{auth_var}={env[auth_var]!r}: must be one of {', '.join(CLIENT_AUTH_VALUES)}"
    if auth == "require" and not env.get("TIERCACHE_TLS_CA"):
        return (f"{auth_var}=require needs TIERCACHE_TLS_CA (the CA client certificates "
                "are checked against)")
    return ""


def tls_files_problem(service: str = "", env: Mapping[str, str] | None = None) -> str:
    """A TLS file variable naming a file that cannot be read or holds no PEM ("" = none):
    found at start, not as gRPC's "Failed to bind to address" or a handshake error later."""
    env = os.environ if env is None else env
    names = ["TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY", "TIERCACHE_TLS_CA",
             "TIERCACHE_TLS_CLIENT_CERT", "TIERCACHE_TLS_CLIENT_KEY"]
    if service:
        names += [f"TIERCACHE_{service.upper()}_TLS_CERT", f"TIERCACHE_{service.upper()}_TLS_KEY"]
    for var in names:
        path = tls_file(env, var)
        why = pem_problem(path) if path else ""
        if why:
            return f"{var}: {why}"
    ca = tls_file(env, "TIERCACHE_TLS_CA")
    # A key given as the CA failed in gRPC's C core as "cannot listen on <address>".
    why = ca_problem(ca) if ca else ""
    if why:
        return f"TIERCACHE_TLS_CA: {ca} {why}"
    (cert_var, cert), (key_var, key) = server_tls_files(service, env)
    # A key that is not the certificate's (a service's own certificate beside the shared
    # key, say) failed in gRPC's C core as "cannot listen on <address>".
    why = key_pair_problem(cert, key, server=True) if cert and key else ""
    if why:
        return f"{cert_var} ({cert}) and {key_var} ({key}) {why}"
    return ""


def pem_problem(path: str) -> str:
    """Why the file at `path` is no PEM file ("" = it is one): it cannot be read, or holds no
    PEM block. The services check their TLS files with it at start, the CLI its flags."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if b"-----BEGIN " not in data:
        return f"{path} is not a PEM file"
    return ""


def ca_problem(path: str) -> str:
    """Why the PEM file at `path` is no CA to verify against ("" = it is one)."""
    import ssl

    try:
        ssl.create_default_context().load_verify_locations(path)
    except ssl.SSLError as exc:
        return f"holds no CA certificate: {exc.reason or exc}"
    return ""


def key_pair_problem(cert: str, key: str, *, server: bool) -> str:
    """Why the PEM files at `cert` and `key` are not a certificate and its private key as gRPC
    takes them ("" = they are): a key that is not the certificate's, or an encrypted one
    (gRPC cannot ask for its password)."""
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT
                       ).load_cert_chain(cert, key, password=lambda: b"no password")
    except (ssl.SSLError, OSError) as exc:
        return (f"are not a certificate and its unencrypted private key: "
                f"{getattr(exc, 'reason', None) or exc}")
    return ""


def channel_credentials_from_env(env: Mapping[str, str] | None = None,
                                 roots: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS for outgoing calls when the services speak TLS (None = plaintext).

    `TIERCACHE_TLS_CA` set: servers are verified against that CA and the client certificate
    (`TIERCACHE_TLS_CLIENT_CERT/_KEY`) is presented, for mutual TLS. Only
    `TIERCACHE_TLS_CERT` set (TLS without client certificates): servers are verified against
    the system's trusted roots. `env`: where to read the variables (default: this process's
    environment). `roots` given: TLS whatever the variables say, verified against that CA
    file instead ("" = the system's trusted roots), the client certificate presented if set.
    """
    env = os.environ if env is None else env
    mode = tls_mode(env)
    if not mode and roots is None:
        return None
    if _half_client_pair(env):  # refused here instead of aborting the process
        raise ValueError(_HALF_CLIENT_PAIR)
    ca = roots if roots is not None else env.get("TIERCACHE_TLS_CA") if mode == "ca" else None

    def read(p: str | None) -> bytes | None:
        if not p:
            return None
        with open(os.path.expanduser(p), "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca),
        private_key=read(env.get("TIERCACHE_TLS_CLIENT_KEY")),
        certificate_chain=read(env.get("TIERCACHE_TLS_CLIENT_CERT")),
    )


def make_channel(address: str) -> grpc.Channel:
    """A channel to another TierCache service (TLS when configured)."""
    creds = channel_credentials_from_env()
    if creds is not None:
        return grpc.secure_channel(address, creds, options=channel_options())
    return grpc.insecure_channel(address, options=channel_options())


def call_metadata(internal_token: str | None = None,
                  request_id: str = "") -> list[tuple[str, str]]:
    """Metadata for an outgoing call: the request id (`request_id`, else the current one) and
    the internal credential."""
    md = [("x-request-id", request_id or request_id_var.get() or uuid.uuid4().hex[:16])]
    if internal_token:
        md.append(("authorization", f"Bearer {internal_token}"))
    return md
