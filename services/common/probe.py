"""A gRPC health probe that speaks the stack's TLS: `python -m services.common.probe HOST:PORT`.

Kubelet's native gRPC probes speak plaintext only. With TLS on, the manifests can run this as an
`exec` probe instead: it connects the way the services' own clients do (`TIERCACHE_TLS_CA` and
the client certificate for mutual TLS, the system's roots with only `TIERCACHE_TLS_CERT`,
plaintext with neither), calls `grpc.health.v1.Health/Check` and exits 0 when the answer is
SERVING, 1 when it is anything else or the call fails, 2 on a usage error (a timeout outside
(0, 3600] s, an address that is not HOST:PORT with a port 1..65535). Health is open to
calls without the internal credential, so none is sent. `--ca` verifies the server against
another CA file, or with `--ca system` the system's trusted roots: a public orchestrator's
publicly trusted certificate, which `TIERCACHE_TLS_CA` (the stack's own CA) does not sign.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import is_host_port
from services.common.grpc_client import ca_problem, channel_credentials_from_env

SYSTEM_ROOTS = "system"


def check(address: str, service: str = "", timeout: float = 2.0, server_name: str = "",
          env: Mapping[str, str] | None = None, ca: str = "") -> tuple[bool, str]:
    """(serving, what the probe saw) for one Health/Check call. `ca`: "" verifies the server
    as the services' clients do (from `env`); a CA file's path, or SYSTEM_ROOTS, verifies it
    over TLS against that instead."""
    roots = None if not ca else "" if ca == SYSTEM_ROOTS else ca
    try:
        creds = channel_credentials_from_env(env, roots)
    except OSError as e:
        return False, f"cannot read a TLS file: {e}"
    except ValueError as e:  # half a client key pair: a one-line answer, not a traceback
        return False, str(e)
    if roots and (problem := ca_problem(roots)):
        # Said here: gRPC fails the handshake as "failed to connect to all addresses", which
        # named neither the file nor the flag, and read as the server's fault.
        return False, f"{roots}: {problem}"
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (grpc.secure_channel(address, creds, options=options) if creds is not None
               else grpc.insecure_channel(address, options=options))
    try:
        r = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        return False, f"{e.code().name}: {e.details()}"
    finally:
        channel.close()
    try:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except ValueError:  # a value this enum does not name (open enums): a line, no traceback
        status = f"unknown status {r.status}"
    return r.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m services.common.probe",
        description="Exit 0 when the gRPC server at ADDRESS reports SERVING (TLS from "
                    "TIERCACHE_TLS_* as the services use it), else 1.")
    ap.add_argument("address", help="HOST:PORT of the server")
    ap.add_argument("--service", default="",
                    help="health service name (default: the whole server)")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    ap.add_argument("--server-name", default="",
                    help="the name the server's certificate is checked against, when it differs "
                         "from ADDRESS's host (e.g. probing 127.0.0.1 inside the pod)")
    ap.add_argument("--ca", default="",
                    help="verify the server against this CA file instead of TIERCACHE_TLS_CA, "
                         f"or '{SYSTEM_ROOTS}' for the system's trusted roots (a publicly "
                         "trusted orchestrator certificate)")
    a = ap.parse_args(argv)
    if not 0 < a.timeout <= 3600:  # gRPC turns larger (or infinite) deadlines into none at all
        ap.error("--timeout must be in (0, 3600] seconds")
    address = a.address.strip()
    if not is_host_port(address, dialed=True):
        # gRPC dials 127.0.0.1:99999 as port 34463 (modulo 65536), a missing port as 443:
        # another server's health, which could pass the probe.
        ap.error(f"{a.address!r} is not HOST:PORT (port 1..65535)")
    ok, seen = check(address, a.service, a.timeout, a.server_name, ca=a.ca.strip())
    print(f"{address}: {seen}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
