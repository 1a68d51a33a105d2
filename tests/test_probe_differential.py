"""A differential review of the exec health probe (`services.common.probe`) against a model of
its module docstring and docs/deploy.md: `check` is (True, "SERVING") exactly when Health/Check
answers SERVING; any other answer is (False, its status's name), a failed call (False, "CODE:
details"), a TLS file that cannot be read or half a client key pair one line before any call;
`main` exits 0 (the line on stdout), 1 (on stderr) or 2 on a usage error (a timeout outside
(0, 3600] s, an address that is not HOST:PORT), never with a traceback; the call carries no
internal credential and is made once (no retry).

Seeded random sequences drive `check` and `main` against (a) a real loopback server
(`create_server`) whose health flips between SERVING and NOT_SERVING under its own and unknown
service names, and (b) a scripted Health server whose Check answers any status (an unknown
enum value too), aborts with any code, or sleeps past the probe's timeout; and (c) a port
nothing listens on, and random TLS variables (missing files, half pairs).

Run offline: 200 seeds (PROBE_DIFFERENTIAL_SEEDS=200), 6 by default (~2.5 s). Injected bugs
caught 5 of 5 (SERVING read as "not NOT_SERVING", no timeout, timeout 0 allowed, the service
name dropped, the address not stripped).
Found and fixed (probe.py, guarded in tests/test_probe_rules.py): an answer with a status the
client's enum does not name (a newer server's, or any server's open enum) raised ValueError out
of `check`, a traceback instead of the one line; `main` probed `127.0.0.1:99999` (gRPC takes
the port modulo 65536: port 34463, another server's health) and an address with no port (443)
instead of refusing it as a usage error, as the CLI and the services' start-up checks do.
Left as is: an RpcError without details prints "CODE: None" (gRPC fills details in practice).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common import probe
from services.common.bootstrap import create_server
from services.launcher import free_port
from tests.waits import holds_within

SEEDS = int(os.environ.get("PROBE_DIFFERENTIAL_SEEDS", "6"))
TLS_VARS = ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY",
            "TIERCACHE_TLS_CLIENT_CERT", "TIERCACHE_TLS_CLIENT_KEY")
CODES = [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK]
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


class ScriptedHealth:
    """grpc.health.v1.Health/Check answering whatever `self.next` says."""

    def __init__(self):
        self.next: tuple = ("status", 1)
        self.calls: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def check(self, request, context):
        with self.lock:
            self.calls.append((request.service, dict(context.invocation_metadata())))
        kind, arg = self.next
        if kind == "abort":
            context.abort(arg, f"scripted {arg.name} \u00e9")
        if kind == "sleep":
            holds_within(lambda: not context.is_active(), arg, 0.01)
        if kind == "status":
            return health_pb2.HealthCheckResponse(status=arg)
        return health_pb2.HealthCheckResponse(status=1)


@pytest.fixture()
def plaintext(monkeypatch):
    for var in TLS_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture()
def scripted(plaintext):
    h = ScriptedHealth()
    server = grpc.server(futures.ThreadPoolExecutor(16))  # sleeping handlers hold theirs
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(
            h.check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield h, port
    server.stop(0)


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = probe.main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _compare_main(address: str, want: tuple[bool, str], argv_extra: list[str]) -> None:
    code, out, err = run_main([address, *argv_extra])
    ok, seen = want
    assert code == (0 if ok else 1), (address, code, out, err)
    line = f"{address}: {seen}\n"
    if ok:
        assert (out, err) == (line, "")
    else:
        assert out == "" and err.startswith(line.rstrip("\n")) and "Traceback" not in err


@pytest.mark.parametrize("seed", range(SEEDS))
def test_check_and_main_against_a_scripted_health_server(seed, scripted):
    h, port = scripted
    rng = random.Random(seed)
    address = f"127.0.0.1:{port}"
    for _ in range(10):
        kind = rng.choice(["status", "status", "status", "abort", "sleep"])
        service = rng.choice(["", "tiercache.v1.KvPool", "\u00fc" * 3, "x" * 200])
        # answered calls: a deadline no stall of a loaded CI host passes; "sleep" below
        # draws short ones, past which its handler sleeps long
        timeout = rng.choice([1.0, 2.0])
        if kind == "status":
            value = rng.choice([0, 1, 1, 2, 3, 7, 2**31 - 1])
            h.next = ("status", value)
            want = (value == 1, STATUS_NAMES.get(value, f"unknown status {value}"))
        elif kind == "abort":
            code = rng.choice(CODES)
            h.next = ("abort", code)
            want = (False, f"{code.name}: scripted {code.name} \u00e9")
        else:
            timeout = rng.choice([0.1, 0.25])
            h.next = ("sleep", timeout + 2.0)
            want = (False, "DEADLINE_EXCEEDED")
        before = len(h.calls)
        via_main = rng.random() < 0.3
        t0 = time.monotonic()
        if via_main:
            argv = ["--timeout", str(timeout)] + (["--service", service] if service else [])
            if kind == "sleep":
                code_, out, err = run_main([address, *argv])
                assert code_ == 1 and out == "" and "DEADLINE_EXCEEDED" in err
            else:
                _compare_main(address, want, argv)
        else:
            got = probe.check(address, service, timeout)
            if kind == "sleep":
                assert got[0] is False and got[1].startswith("DEADLINE_EXCEEDED"), got
            else:
                assert got == want, (seed, kind, got, want)
        assert time.monotonic() - t0 < timeout + 1.5  # a "sleep" ends at its deadline
        assert len(h.calls) - before == 1  # one call, no retry
        asked, md = h.calls[-1]
        assert asked == service and "authorization" not in md


@pytest.mark.parametrize("seed", range(SEEDS))
def test_check_follows_a_real_servers_health_as_it_flips(seed, plaintext):
    rng = random.Random(100 + seed)
    names = ["tiercache.v1.Diff"]
    handle = create_server(service="probe-diff", address="127.0.0.1:0",
                           services=[(lambda *_: None, None, names[0])])
    address = f"127.0.0.1:{handle.port}"
    serving = False
    try:
        for _ in range(8):
            if rng.random() < 0.5:
                serving = rng.random() < 0.5
                handle.set_serving(serving)
            service = rng.choice(["", names[0], "tiercache.v1.Other"])
            got = probe.check(address, service, timeout=5)
            if service == "tiercache.v1.Other":
                assert got[0] is False and got[1].startswith("NOT_FOUND"), got
            else:
                assert got == (serving, "SERVING" if serving else "NOT_SERVING")
        handle.stop(0)
        got = probe.check(address, timeout=2)
        assert got[0] is False and got[1].startswith("UNAVAILABLE"), got
    finally:
        handle.stop(0)


def _usage_ok(address: str) -> bool:
    """HOST:PORT with a port 1..65535 (docs/deploy.md), surrounding blanks aside."""
    host, sep, port = address.strip().rpartition(":")
    return bool(sep and host and port.isdigit() and 1 <= int(port) <= 65535
                and " " not in host)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_usage_errors_and_tls_files_are_one_line(seed, tmp_path, plaintext):
    rng = random.Random(200 + seed)
    dead = free_port()
    for _ in range(12):
        port = rng.choice([dead, 0, 65535, 65536, 99999, dead + 65536])
        address = rng.choice([f"127.0.0.1:{port}", f" 127.0.0.1:{port} ", "127.0.0.1",
                              f":{port}", "", f"localhost:{port}", f"[::1]:{port}",
                              f"127.0.0.1:{port}x", f"dns:///127.0.0.1:{port}"])
        timeout = rng.choice(["0.3", "0", "-1", "nan", "inf", "3600", "3600.5", "1e-3"])
        try:
            t = float(timeout)
        except ValueError:
            t = float("nan")
        usage = not (0 < t <= 3600) or not _usage_ok(address)
        code, out, err = run_main([address, "--timeout", timeout])
        assert "Traceback" not in err
        if usage:
            assert code == 2, (address, timeout, code, out, err)
            continue
        assert code == 1, (address, timeout, code, out, err)  # nothing listens there
        assert out == "" and len(err.strip().splitlines()) == 1
        assert err.startswith(address.strip() + ": "), err  # the address dialed, stripped
    # TLS variables that cannot work: (False, one line), before any call
    ca = tmp_path / "ca.pem"
    for env, want in [
        ({"TIERCACHE_TLS_CA": str(ca)}, "cannot read a TLS file:"),
        ({"TIERCACHE_TLS_CERT": "/x.pem", "TIERCACHE_TLS_CLIENT_CERT": "/c.pem"},
         "TIERCACHE_TLS_CLIENT_CERT and TIERCACHE_TLS_CLIENT_KEY must be set together"),
    ]:
        ok, seen = probe.check(f"127.0.0.1:{dead}", env=env)
        assert not ok and seen.startswith(want) and "\n" not in seen
