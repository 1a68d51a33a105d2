"""A differential review of `services.common.grpc_client` (TLS mode and variables, channels,
one unary call, `cut_short`, call metadata) and `services.common.reflection`, against a model
written from their docstrings and docs/reliability.md §4 / docs/deploy.md ("Debug with grpcurl").

Model. `tls_mode`: "ca" with `TIERCACHE_TLS_CA`, else "roots" with the shared
`TIERCACHE_TLS_CERT`, else "". `tls_env_problem`: half a client pair, else half the server's
pair (each of cert and key the service's own variable where set, else the shared one), else a
CA without a whole server pair. `channel_credentials_from_env`: None in plaintext; half a client
pair a ValueError; otherwise the CA's bytes as roots ("ca" only) and the client pair's bytes;
an unreadable file an OSError. `cut_short`: DEADLINE_EXCEEDED with a timeout under both the
tier's full timeout and STALL_EVIDENCE_S. `call_metadata`: the given request id, else the bound
one, else a fresh one; the credential as a Bearer header. A call made by `unary_call` over
`make_channel` to a real loopback server (`create_server`) whose handler is scripted per call
(answer, abort with a code, sleep past the deadline), or to a port nothing listens on, or
cancelled by `on_call` at once or while under way: the answer, else the status code, else
grpc.FutureCancelledError (within 0.5 s of the cancel); the server's handler runs exactly once
for a call that reaches it (no retries: the module makes one attempt) and never for a refused
one; it sees the metadata the model says; messages up to the shared 16 MiB pass both ways and
one byte more is RESOURCE_EXHAUSTED. A channel to a server restarted on its port answers again
within the reconnect backoff's cap (5 s, +20% jitter) - the long form of that runs only with
GRPC_CLIENT_DIFFERENTIAL_LONG=1 (10 s down). There is no retry or sleep in the module, so no
fake clock: waits are the real server's, a few tenths of a second.

Reflection: a server with all four TierCache services answers `list_services` with exactly the
registered names plus health and reflection, and `file_containing_symbol` for every symbol
the descriptor set declares (messages, nested ones, fields, oneofs, enums, their values,
services and methods) with the declaring file first and its transitive imports, each the set's
bytes (with the .proto comments), equal to the compiled descriptor but for source info and
json_name; unknown names, files and extensions are NOT_FOUND.

Run offline: 200 seeds (GRPC_CLIENT_DIFFERENTIAL_SEEDS=200: 10,000 variable sets, 2,400 real
calls, 100 reflection sessions) and the 10 s reconnect once; the default 4 here (~5 s).
Found and fixed (reflection.py, guarded in tests/test_reflection_rules.py): a method's name
(`tiercache.v1.PrefixIndex.Match`, what `grpcurl describe` of a method asks for) was NOT_FOUND:
protobuf's upb pool finds no method symbols. Nothing diverged in grpc_client.py (a first run
counted a cancelled call's late handler against the next call: the harness's, fixed by
counting per call id).
Left as is: with only `TIERCACHE_TLS_CERT` ("roots") a client pair that is set is still
presented (harmless; "without client certificates" is the servers' side); a descriptor set
older than the compiled protos would be served as is (`make protos` writes both together).
Injected bugs caught: 17 of 18 across grpc_client, probe and reflection (tls_mode's order,
cut_short's `<` as `<=` and min() as max(), the request id's order, the Bearer prefix,
make_channel without options, unary_call ignoring on_call, key and chain swapped, no half-pair
check; source info dropped, no dependencies, any method name accepted; the probe's five in
tests/test_probe_differential.py). Missed: `not (cert and key)` as `not (cert or key)` in
tls_env_problem's CA rule, an equivalent mutant (half a pair is refused first).
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from services.common import grpc_client
from services.common.bootstrap import DEFAULT_MAX_MESSAGE_BYTES, channel_options, create_server
from services.common.grpc_client import (
    STALL_EVIDENCE_S,
    call_metadata,
    channel_credentials_from_env,
    cut_short,
    make_channel,
    tls_env_problem,
    tls_mode,
    unary_call,
)
from services.common.logs import bound_request_id
from services.launcher import free_port
from tests import descriptors
from tests.waits import holds_within

SEEDS = int(os.environ.get("GRPC_CLIENT_DIFFERENTIAL_SEEDS", "4"))
LONG = os.environ.get("GRPC_CLIENT_DIFFERENTIAL_LONG") == "1"
TLS_VARS = ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY",
            "TIERCACHE_TLS_CLIENT_CERT", "TIERCACHE_TLS_CLIENT_KEY")
CODES = [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK]


# ---------------------------------------------------------------- the model, from the docs

def model_mode(env: dict[str, str]) -> str:
    if env.get("TIERCACHE_TLS_CA"):
        return "ca"
    return "roots" if env.get("TIERCACHE_TLS_CERT") else ""


def model_env_problem(env: dict[str, str], service: str) -> str:
    if bool(env.get("TIERCACHE_TLS_CLIENT_CERT")) != bool(env.get("TIERCACHE_TLS_CLIENT_KEY")):
        return "TIERCACHE_TLS_CLIENT_CERT and TIERCACHE_TLS_CLIENT_KEY must be set together"
    picked = {}
    for part in ("CERT", "KEY"):
        own = f"TIERCACHE_{service.upper()}_TLS_{part}"
        var = own if service and env.get(own) else f"TIERCACHE_TLS_{part}"
        picked[part] = (var, env.get(var, ""))
    (cv, c), (kv, k) = picked["CERT"], picked["KEY"]
    if bool(c) != bool(k):
        return f"{cv} and {kv} must be set together"
    if env.get("TIERCACHE_TLS_CA") and not (c and k):
        return "TIERCACHE_TLS_CA needs"  # a prefix: the rest is prose
    return ""


def model_credentials(env: dict[str, str], files: dict[str, bytes]):
    """None, ("ValueError",), ("OSError",) or the (roots, key, chain) bytes handed to gRPC."""
    mode = model_mode(env)
    if not mode:
        return None
    if bool(env.get("TIERCACHE_TLS_CLIENT_CERT")) != bool(env.get("TIERCACHE_TLS_CLIENT_KEY")):
        return ("ValueError",)
    wanted = [env.get("TIERCACHE_TLS_CA") if mode == "ca" else None,
              env.get("TIERCACHE_TLS_CLIENT_KEY"), env.get("TIERCACHE_TLS_CLIENT_CERT")]
    out = []
    for p in wanted:
        if not p:
            out.append(None)
        elif p not in files:
            return ("OSError",)
        else:
            out.append(files[p])
    return tuple(out)


def model_cut_short(code, timeout, full_s) -> bool:
    if code != grpc.StatusCode.DEADLINE_EXCEEDED or timeout is None:
        return False
    return timeout < full_s and timeout < STALL_EVIDENCE_S


class _Err(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


# ---------------------------------------------------------------- pure functions

def _random_env(rng: random.Random, files: dict[str, bytes], service: str) -> dict[str, str]:
    names = list(TLS_VARS)
    if service:
        names += [f"TIERCACHE_{service.upper()}_TLS_CERT", f"TIERCACHE_{service.upper()}_TLS_KEY"]
    names += ["TIERCACHE_OTHER_TLS_CERT", "TIERCACHE_OTHER_TLS_KEY"]  # another service's own
    env = {}
    for var in names:
        r = rng.random()
        if r < 0.45:
            continue
        env[var] = ("" if r < 0.55 else rng.choice(sorted(files)) if r < 0.9
                    else f"/nonexistent/{rng.randrange(9)}-\u00fc.pem")
    return env


def test_tls_decisions_and_cut_short_follow_the_model(tmp_path, monkeypatch):
    files = {}
    for i in range(4):
        p = tmp_path / f"f{i}-\u00e9.pem"
        p.write_bytes(f"-----BEGIN X-----\n{i}\n".encode())
        files[str(p)] = p.read_bytes()
    handed = []
    monkeypatch.setattr(grpc_client.grpc, "ssl_channel_credentials",
                        lambda **kw: handed.append(kw) or "creds")
    for seed in range(SEEDS * 50):
        rng = random.Random(seed)
        service = rng.choice(["", "prefix", "semantic", "Prefix", "kv-pool", "\u00fc"])
        env = _random_env(rng, files, service)
        assert tls_mode(env) == model_mode(env), (seed, env)
        want = model_env_problem(env, service)
        got = tls_env_problem(env, service)
        assert (got.startswith(want) and bool(got) == bool(want)), (seed, env, got, want)
        want_c = model_credentials(env, files)
        handed.clear()
        try:
            got_c = channel_credentials_from_env(env)
            got_c = None if got_c is None else (
                handed[-1]["root_certificates"], handed[-1]["private_key"],
                handed[-1]["certificate_chain"])
        except ValueError:
            got_c = ("ValueError",)
        except OSError:
            got_c = ("OSError",)
        assert got_c == want_c, (seed, env)
        # cut_short, with boundaries drawn often
        full = rng.choice([0.1, 0.25, STALL_EVIDENCE_S, 0.7, 2.0, 30.0, float("inf")])
        timeout = rng.choice([None, 0.0, -1.0, 1e-9, full, STALL_EVIDENCE_S,
                              STALL_EVIDENCE_S - 1e-9, full - 1e-9, rng.uniform(0, 1),
                              float("inf"), 5.0])
        code = rng.choice([grpc.StatusCode.DEADLINE_EXCEEDED] * 3 + CODES)
        assert cut_short(_Err(code), timeout, full) == model_cut_short(code, timeout, full), (
            seed, code, timeout, full)
        # call_metadata
        token = rng.choice([None, "", "tok", "s3cret-" + str(seed)])
        given = rng.choice(["", "given-1", "g" * 64])
        bound = rng.choice([None, "bound-2"])
        if bound:
            with bound_request_id(bound):
                md = call_metadata(token, given)
        else:
            md = call_metadata(token, given)
        want_id = given or bound
        d = dict(md)
        assert len(md) == 1 + bool(token) and d["x-request-id"]
        assert d["x-request-id"] == want_id if want_id else len(d["x-request-id"]) == 16
        assert d.get("authorization") == (f"Bearer {token}" if token else None)


def test_channels_take_the_shared_options_over_plaintext_and_tls(monkeypatch, tmp_path):
    """make_channel: secure exactly when the model's credentials say so, and both kinds with
    `channel_options()` (the message limit and the reconnect backoff's cap)."""
    seen = []
    monkeypatch.setattr(grpc_client.grpc, "insecure_channel",
                        lambda a, options=None: seen.append(("plain", a, options)))
    monkeypatch.setattr(grpc_client.grpc, "secure_channel",
                        lambda a, c, options=None: seen.append(("tls", a, options)))
    monkeypatch.setattr(grpc_client.grpc, "ssl_channel_credentials", lambda **kw: "creds")
    for var in TLS_VARS:
        monkeypatch.delenv(var, raising=False)
    make_channel("h:1")
    monkeypatch.setenv("TIERCACHE_TLS_CERT", "/any.pem")
    make_channel("h:2")
    assert seen == [("plain", "h:1", channel_options()), ("tls", "h:2", channel_options())]


# ---------------------------------------------------------------- a real server, scripted

class Script:
    """The handler of x.Diff/Call: what to do comes in metadata (`x-op`), so that the request
    is the payload only and its size exact."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        self.expected: dict[str, int | None] = {}  # call id: handler runs (None: 0 or 1)

    def of(self, call_id: str) -> list[dict]:
        with self.lock:
            return [md for _op, md in self.calls if md.get("x-call") == call_id]

    def check_counts(self) -> None:
        """Once every handler has had time to start: each call's ran as often as said."""
        for call_id, want in self.expected.items():
            n = len(self.of(call_id))
            assert n <= 1 if want is None else n == want, (call_id, n, want)

    def handle(self, request: bytes, context):
        md = dict(context.invocation_metadata())
        op = md.get("x-op", "ok")
        with self.lock:
            self.calls.append((op, md))
        kind, _, arg = op.partition(":")
        if kind == "abort":
            context.abort(grpc.StatusCode[arg], f"scripted {arg}")
        if kind == "sleep":
            holds_within(lambda: not context.is_active(), float(arg), 0.01)
            return b"late"
        if kind == "size":
            return b"r" * int(arg)
        return request

    def add(self, _servicer, server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "x.Diff", {"Call": grpc.unary_unary_rpc_method_handler(self.handle)}),))


@pytest.fixture()
def plaintext(monkeypatch):
    for var in TLS_VARS:
        monkeypatch.delenv(var, raising=False)


def _start(script: Script, port: int = 0):
    return create_server(service="gclient-diff", address=f"127.0.0.1:{port}",
                         services=[(script.add, None, "x.Diff")], max_workers=8)


MAX = DEFAULT_MAX_MESSAGE_BYTES


def _step(rng: random.Random, rpc, dead_rpc, script: Script, i: int):
    """One random call; returns (what the model says, what happened) as comparable tuples."""
    kind = rng.choice(["ok", "ok", "abort", "abort", "sleep", "closed", "cancel_now",
                       "cancel_later", "big"])
    token = rng.choice([None, "tok-\x7e", "t" * 40])
    rid = rng.choice(["", f"rid-{i}"])
    # Calls that must be answered get a deadline a stall of a loaded 2-core CI host cannot
    # pass; only "sleep" (below) draws short ones, past which its handler sleeps long.
    timeout = rng.choice([1.0, 2.0, 5.0])
    full_s = rng.choice([0.2, 0.5, 1.0, 5.0])
    md = call_metadata(token, rid)
    on_call = None
    cancelled: list[bool] = []
    payload = rng.choice([b"", b"\x00", "\u00e9\u6f22\U0001f600".encode(), bytes(range(256))])
    op = "ok"
    target = rpc
    want_attempts = 1
    if kind == "abort":
        code = rng.choice(CODES)
        op = f"abort:{code.name}"
        want = ("code", code)
    elif kind == "sleep":
        timeout = rng.choice([0.05, 0.15, 0.3])
        op = f"sleep:{timeout + 2.0}"
        want = ("code", grpc.StatusCode.DEADLINE_EXCEEDED)
    elif kind == "closed":
        target, want_attempts = dead_rpc, 0
        want = ("code", grpc.StatusCode.UNAVAILABLE)
    elif kind == "cancel_now":
        # Cancelled as it starts (a request already gone): FutureCancelledError, unless the
        # call had ended first (cancel() says False), when its answer stands.
        def on_call(call):
            cancelled.append(call.cancel())
        want_attempts = None  # it may or may not have reached the server
        want = ("answer", payload)
    elif kind == "cancel_later":
        timeout, op = 5.0, "sleep:2.0"

        def on_call(call):
            def cancel():
                cancelled.append(call.cancel())
            threading.Timer(0.1, cancel).start()
        want = ("cancelled",)
    elif kind == "big":
        n = rng.choice([MAX - 64, MAX, MAX + 1])  # the request, or the answer, of n bytes
        timeout = 10.0
        if rng.random() < 0.5:
            payload = b"q" * n
            if n > MAX:
                want_attempts = 0  # refused by the client before sending
        else:
            op = f"size:{n}"
        want = ("answer", payload if op == "ok" else b"r" * n) if n <= MAX else (
            "code", grpc.StatusCode.RESOURCE_EXHAUSTED)
    else:
        want = ("answer", payload)
    if op == "ok" and kind != "big" and on_call is None and rng.random() < 0.5:
        on_call = lambda call: None  # noqa: E731 - a future that is not cancelled
    if kind == "cancel_later":
        want_attempts = None  # cancelled before its handler started, on a busy machine
    call_id = f"{id(script)}-{i}"
    t0 = time.monotonic()
    try:
        got = ("answer", unary_call(target, payload, on_call, timeout=timeout,
                                    metadata=[*md, ("x-op", op), ("x-call", call_id)]))
    except grpc.FutureCancelledError:
        got = ("cancelled",)
    except grpc.RpcError as e:
        got = ("code", e.code())
        assert cut_short(e, timeout, full_s) == model_cut_short(e.code(), timeout, full_s)
    took = time.monotonic() - t0
    if kind == "cancel_now" and cancelled[0]:
        want = ("cancelled",)
    if kind == "cancel_later":
        assert cancelled == [True]
        # cancelled at 0.1 s, its handler sleeping 2 s: back well before the handler's end
        assert took < 1.5, f"a cancelled call returned after {took:.2f} s"
    if kind == "sleep":  # back at its deadline, not at the handler's end (2 s after it)
        assert took < timeout + 1.5
    # the handler runs once for a call that reaches it, never for another (counted by the
    # call's own id: a cancelled call's handler may start after the next call has begun)
    if want_attempts:  # a timed-out call's handler may start a moment late
        holds_within(lambda: script.of(call_id), 2.0, 0.01)
    attempts = script.of(call_id)
    if want_attempts is None:
        assert len(attempts) <= 1
    else:
        assert len(attempts) == want_attempts, (kind, op, attempts)
    for seen in attempts:
        assert seen["x-request-id"] == dict(md)["x-request-id"]
        assert seen.get("authorization") == (f"Bearer {token}" if token else None)
    script.expected[call_id] = want_attempts
    return (kind, want), (kind, got)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_unary_calls_over_a_real_server_follow_the_model(seed, plaintext):
    rng = random.Random(1000 + seed)
    script = Script()
    h = _start(script)
    ch = make_channel(f"127.0.0.1:{h.port}")
    dead = make_channel(f"127.0.0.1:{free_port()}")
    try:
        rpc = ch.unary_unary("/x.Diff/Call")
        dead_rpc = dead.unary_unary("/x.Diff/Call")
        for i in range(12):
            want, got = _step(rng, rpc, dead_rpc, script, i)
            assert got == want, (seed, i)
        time.sleep(0.1)
        script.check_counts()
    finally:
        ch.close()
        dead.close()
        h.stop(0)


def _reconnects_within_the_backoff_cap(down_s: float) -> None:
    script = Script()
    h = _start(script)
    port = h.port
    ch = make_channel(f"127.0.0.1:{port}")
    rpc = ch.unary_unary("/x.Diff/Call")
    try:
        assert rpc(b"a", timeout=5) == b"a"
        h.stop(0)
        end = time.monotonic() + down_s
        while time.monotonic() < end:  # failures while down grow the reconnect backoff
            with pytest.raises(grpc.RpcError) as e:
                rpc(b"b", timeout=1)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.05)
        h = _start(script, port)
        back = time.monotonic()
        cap = 5.0 * 1.2 + 0.5  # grpc.max_reconnect_backoff_ms, its jitter, slack
        while True:
            try:
                assert rpc(b"c", timeout=1) == b"c"
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - back < cap, "still unreachable past the backoff cap"
                time.sleep(0.05)
    finally:
        ch.close()
        h.stop(0)


def test_a_restarted_server_is_reached_again_within_the_reconnect_backoff_cap(plaintext):
    _reconnects_within_the_backoff_cap(10.0 if LONG else 0.8)


# ---------------------------------------------------------------- reflection

def _all_services():
    from tiercache.v1 import (
        kvpool_pb2_grpc,
        orchestrator_pb2_grpc,
        prefix_pb2_grpc,
        semantic_pb2_grpc,
    )

    return [
        (kvpool_pb2_grpc.add_KvPoolServicer_to_server, kvpool_pb2_grpc.KvPoolServicer(),
         "tiercache.v1.KvPool"),
        (orchestrator_pb2_grpc.add_OrchestratorServicer_to_server,
         orchestrator_pb2_grpc.OrchestratorServicer(), "tiercache.v1.Orchestrator"),
        (prefix_pb2_grpc.add_PrefixIndexServicer_to_server, prefix_pb2_grpc.PrefixIndexServicer(),
         "tiercache.v1.PrefixIndex"),
        (semantic_pb2_grpc.add_SemanticCacheServicer_to_server,
         semantic_pb2_grpc.SemanticCacheServicer(), "tiercache.v1.SemanticCache"),
    ]


def _bare(proto_bytes: bytes) -> descriptor_pb2.FileDescriptorProto:
    p = descriptor_pb2.FileDescriptorProto.FromString(proto_bytes)
    p.ClearField("source_code_info")
    for m in _walk_messages(p.message_type):
        for fl in m.field:
            fl.ClearField("json_name")
    return p


def _walk_messages(ms):
    for m in ms:
        yield m
        yield from _walk_messages(m.nested_type)


@pytest.mark.parametrize("seed", range(max(1, SEEDS // 2)))
def test_reflection_lists_and_resolves_every_registered_symbol(seed, plaintext):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.common.reflection import descriptor_set_path

    rng = random.Random(seed)
    raw = {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(
        descriptor_set_path().read_bytes()).file}
    services = _all_services()
    chosen = rng.sample(services, rng.randint(1, len(services)))
    h = create_server(service="refl-diff", address="127.0.0.1:0", services=chosen)
    declared = {s: name for name, f in raw.items() if name.startswith("tiercache/")
                for s in descriptors.symbols(f)}
    symbols = sorted(declared)
    rng.shuffle(symbols)
    unknown = ["", "tiercache", "tiercache.v1", "tiercache.v1.Nope", "tiercache.v1.KvPool.Nope",
               "\u00fc.\u6f22", "tiercache.v1.MatchRequest.nope", "." + symbols[0]]
    asks = ([("list", "")] + [("symbol", s) for s in symbols]
            + [("symbol", s) for s in unknown]
            + [("file", n) for n in raw] + [("file", "nope.proto"), ("file", "")]
            + [("ext", "tiercache.v1.MatchRequest"), ("ext", "nope.Nope")])
    rng.shuffle(asks)
    q: queue.Queue = queue.Queue()
    for kind, arg in asks:
        q.put({"list": lambda a: reflection_pb2.ServerReflectionRequest(list_services=a),
               "symbol": lambda a: reflection_pb2.ServerReflectionRequest(
                   file_containing_symbol=a),
               "file": lambda a: reflection_pb2.ServerReflectionRequest(file_by_filename=a),
               "ext": lambda a: reflection_pb2.ServerReflectionRequest(
                   all_extension_numbers_of_type=a)}[kind](arg))
    q.put(None)
    ch = grpc.insecure_channel(f"127.0.0.1:{h.port}")
    try:
        answers = list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter(q.get, None), timeout=20))
    finally:
        ch.close()
        h.stop(0)
    assert len(answers) == len(asks)
    wrong = []
    for (kind, arg), r in zip(asks, answers, strict=True):
        which = r.WhichOneof("message_response")
        if kind == "list":
            want = sorted([n for *_, n in chosen] + ["grpc.health.v1.Health",
                                                     "grpc.reflection.v1alpha.ServerReflection"])
            assert [s.name for s in r.list_services_response.service] == want
            continue
        if kind == "ext":
            if arg.startswith("tiercache."):
                assert which == "all_extension_numbers_response"
                assert list(r.all_extension_numbers_response.extension_number) == []
            else:
                assert which == "error_response"
            continue
        file = declared.get(arg) if kind == "symbol" else (arg if arg in raw else None)
        if file is None:
            if which != "error_response" or r.error_response.error_code != 5:
                wrong.append((kind, arg, which))
            continue
        if which != "file_descriptor_response":
            wrong.append((kind, arg, which))
            continue
        got = list(r.file_descriptor_response.file_descriptor_proto)
        names = [descriptor_pb2.FileDescriptorProto.FromString(b).name for b in got]
        if (names[0] != file or set(names) != descriptors.closure(file)
                or len(names) != len(set(names))):
            wrong.append((kind, arg, names))
            continue
        for b, n in zip(got, names, strict=True):
            p = descriptor_pb2.FileDescriptorProto.FromString(b)
            if n in raw:  # served with its comments, and the schema the code was built from
                assert p == raw[n], n
            assert _bare(b) == _bare(descriptors.compiled(n).SerializeToString()), n
    assert not wrong, wrong[:10]


def test_the_descriptor_set_is_found(plaintext):
    from services.common.reflection import descriptor_set_path, source_info_pool

    assert Path(descriptor_set_path()).is_file() and source_info_pool() is not None
