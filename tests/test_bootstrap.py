"""The common bootstrap over a real channel: health, reflection, error mapping, UTF-8, auth."""

import contextlib
import queue
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiercache.v1 import orchestrator_pb2, prefix_pb2, prefix_pb2_grpc

from services.common import errors
from services.common.bootstrap import create_server
from services.common.wire import find_invalid_utf8
from tests.waits import holds_within, wait_until


class Index(prefix_pb2_grpc.PrefixIndexServicer):
    def Match(self, request, context):
        if not request.token_ids and not request.block_hashes:
            raise errors.InvalidArgument("token_ids", "give token_ids or block_hashes")
        if request.model_id == "busy":
            raise errors.Overloaded("replica busy: too many waiting requests")
        if request.model_id == "full":
            raise errors.ResourceExhausted("token_ids: never fits")
        if request.model_id == "boom":
            raise RuntimeError("secret internal detail")
        if request.model_id == "coded":
            # A code set without abort, then an exception: the code stands, the text stays.
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            raise RuntimeError("secret internal detail")
        if request.model_id == "coded-details":
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            context.set_details("model_id: not loaded")
            raise RuntimeError("secret internal detail")
        if request.model_id == "peer":  # which client connection carried the call
            return prefix_pb2.MatchResponse(matches=[prefix_pb2.ReplicaMatch(
                address=context.peer())])
        return prefix_pb2.MatchResponse(request_blocks=len(request.token_ids) // 16)


@pytest.fixture
def server():
    h = create_server(service="test", address="127.0.0.1:0", internal_token="s3cret",
                      services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, Index(),
                                 "tiercache.v1.PrefixIndex")])
    yield h
    h.stop(0)


def _stub(h):
    return prefix_pb2_grpc.PrefixIndexStub(grpc.insecure_channel(h.address))


AUTH = [("authorization", "Bearer s3cret")]


def test_health_starts_not_serving_then_serving(server):
    hs = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    req = health_pb2.HealthCheckRequest(service="tiercache.v1.PrefixIndex")
    assert hs.Check(req, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
    server.set_serving()
    assert hs.Check(req, timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_domain_error_maps_to_status(server):
    with pytest.raises(grpc.RpcError) as e:
        _stub(server).Match(prefix_pb2.MatchRequest(), timeout=5, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "token_ids: give token_ids or block_hashes"


def test_busy_is_told_apart_from_never_fits_by_a_trailer(server):
    """Both are RESOURCE_EXHAUSTED; only "busy now" may be tried on another replica."""
    got = {}
    for model_id in ("busy", "full"):
        with pytest.raises(grpc.RpcError) as e:
            _stub(server).Match(prefix_pb2.MatchRequest(model_id=model_id, token_ids=[1]),
                                timeout=5, metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        got[model_id] = errors.overloaded(e.value)
    assert got == {"busy": True, "full": False}


def test_unexpected_error_is_internal_without_traceback(server):
    with pytest.raises(grpc.RpcError) as e:
        _stub(server).Match(prefix_pb2.MatchRequest(model_id="boom", token_ids=[1]), timeout=5,
                            metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "secret internal detail" not in e.value.details()
    assert "Traceback" not in e.value.details()


@pytest.mark.parametrize("model_id,details", [
    ("coded", "Match failed: FAILED_PRECONDITION"),
    ("coded-details", "model_id: not loaded"),
])
def test_code_set_then_raise_keeps_code_not_exception_text(server, model_id, details):
    with pytest.raises(grpc.RpcError) as e:
        _stub(server).Match(prefix_pb2.MatchRequest(model_id=model_id, token_ids=[1]),
                            timeout=5, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.details() == details


def test_internal_credential_required(server):
    # Given twice, the right one included: refused, whichever order (a proxy reading the
    # first and this server the last would disagree on which counted).
    for md in ([], [("authorization", "Bearer wrong")],
               [("authorization", "Bearer wrong"), *AUTH], [*AUTH, ("authorization", "x")],
               [*AUTH, *AUTH]):
        with pytest.raises(grpc.RpcError) as e:
            _stub(server).Match(prefix_pb2.MatchRequest(token_ids=[1]), timeout=5, metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _stub(server).Match(prefix_pb2.MatchRequest(token_ids=[1] * 32), timeout=5,
                               metadata=AUTH).request_blocks == 2


def test_a_caller_refused_for_its_credential_is_logged_with_its_peer(server, caplog):
    """A security review: only a counter said so; guessing could not be traced to a peer. One
    line per peer and code, 3 a minute (the count of the rest said later), never the
    credential."""
    import logging

    with caplog.at_level(logging.WARNING, logger="services.common.bootstrap"):
        for _ in range(5):
            with pytest.raises(grpc.RpcError):
                _stub(server).Match(prefix_pb2.MatchRequest(token_ids=[1]), timeout=5,
                                    metadata=[("authorization", "Bearer guess-123")])
    lines = [r.getMessage() for r in caplog.records if "refused UNAUTHENTICATED" in r.getMessage()]
    assert len(lines) == 3 and "from ipv4:127.0.0.1:" in lines[0], lines
    assert "guess-123" not in caplog.text


def test_invalid_utf8_names_the_field(server):
    bad = b"\x0a\x03\xff\xfe\xfd"  # field 1 (model_id) = invalid UTF-8
    ch = grpc.insecure_channel(server.address)
    call = ch.unary_unary("/tiercache.v1.PrefixIndex/Match", request_serializer=lambda b: b,
                          response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        call(bad, timeout=5, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("model_id:")


def test_find_invalid_utf8_nested_and_repeated():
    good = orchestrator_pb2.GenerateRequest()
    good.messages.add(role="user", content="ok")
    good.messages.add(role="user", content="XX")
    raw = good.SerializeToString().replace(b"XX", b"\xff\xfe")
    assert find_invalid_utf8(orchestrator_pb2.GenerateRequest.DESCRIPTOR, raw) == \
        "messages[1].content"
    assert find_invalid_utf8(orchestrator_pb2.GenerateRequest.DESCRIPTOR,
                             good.SerializeToString()) is None


@contextlib.contextmanager
def _small(service: str = "test"):
    h = create_server(service=service, address="127.0.0.1:0", internal_token="s3cret",
                      max_workers=6,
                      services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, Index(),
                                 "tiercache.v1.PrefixIndex")])
    h.set_serving()
    try:
        yield h
    finally:
        h.stop(0)


@pytest.fixture
def small_server():
    with _small() as h:
        yield h


def test_malformed_health_requests_are_invalid_argument_watch_too(small_server):
    """Watch's handler was passed through unwrapped (it must stay non-blocking), so gRPC's
    own deserializer answered malformed bytes with INTERNAL; Check said INVALID_ARGUMENT."""
    ch = grpc.insecure_channel(small_server.address)
    try:
        for method, stream in (("Check", False), ("Watch", True)):
            call = (ch.unary_stream if stream else ch.unary_unary)(
                f"/grpc.health.v1.Health/{method}")
            with pytest.raises(grpc.RpcError) as e:
                r = call(b"\xff\xff\xff", timeout=3)
                if stream:
                    list(r)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
            assert "malformed" in e.value.details()
        w = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=3)
        assert next(w).status == health_pb2.HealthCheckResponse.SERVING  # still a Watch
        w.cancel()
    finally:
        ch.close()


def test_open_watches_hold_no_worker_thread_and_leave_nothing_behind(small_server):
    """Health.Watch needs no credential. Wrapped by the interceptor it ran as a blocking
    generator, one worker thread per open watch (32 watches stalled a 32-thread server), and
    each name watched stayed in the servicer's table after the stream ended."""
    ch = grpc.insecure_channel(small_server.address)
    hs = health_pb2_grpc.HealthStub(ch)
    watches = [hs.Watch(health_pb2.HealthCheckRequest(service=f"unknown-{i}"), timeout=20)
               for i in range(12)]  # twice the server's threads
    try:
        for w in watches:
            assert next(w).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        r = _stub(small_server).Match(prefix_pb2.MatchRequest(token_ids=[1] * 32), timeout=3,
                                      metadata=AUTH)
        assert r.request_blocks == 2
    finally:
        for w in watches:
            w.cancel()
    table = small_server.health._send_response_callbacks
    holds_within(lambda: not any(k.startswith("unknown-") for k in table), 5, 0.05)
    assert not [k for k in table if k.startswith("unknown-")]
    with pytest.raises(grpc.RpcError) as e:
        next(hs.Watch(health_pb2.HealthCheckRequest(service="x" * 100_000), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("service:")


def test_watches_cancelled_at_once_neither_freeze_the_server_nor_stay_behind(small_server):
    """Watch sent its first message holding the servicer's lock, and the close callbacks that
    take that lock run on gRPC's polling thread, which the send waits on: a Watch cancelled
    while another started deadlocked the two and the whole server stopped answering (after
    ~2,500 Watch + cancel calls). A Watch that ended before its close callback was added also
    stayed in the table for good (689 entries after 1,000 calls)."""
    ch = grpc.insecure_channel(small_server.address)
    hs = health_pb2_grpc.HealthStub(ch)
    # Up to 4,000 calls or 10 s, but at least 1,000 however slow the machine (each call is
    # bounded by its own 5 s deadline: a frozen server fails there).
    stop = time.monotonic() + 10
    n = 0
    while n < 4000 and (n < 1000 or time.monotonic() < stop):
        w = hs.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(w).status == health_pb2.HealthCheckResponse.SERVING
        w.cancel()
        n += 1
        if n % 500 == 0:  # another Set while watches come and go
            small_server.set_serving()
    assert hs.Check(health_pb2.HealthCheckRequest(), timeout=3).status == \
        health_pb2.HealthCheckResponse.SERVING
    table = small_server.health._send_response_callbacks
    holds_within(lambda: not sum(map(len, table.values())), 5, 0.05)
    assert sum(map(len, table.values())) == 0


def test_a_watch_always_ends_on_the_status_that_is_current():
    """A Watch read the status, then sent it outside any lock: with the status flipping
    SERVING then NOT_SERVING around its first message and its re-check, its last message
    was SERVING while NOT_SERVING was current (the second flip's broadcast had been dropped
    as a repeat of the Watch's first message). Every send now reads the status as it is."""
    import threading

    from services.common import bootstrap

    ns, ok = (health_pb2.HealthCheckResponse.NOT_SERVING,
              health_pb2.HealthCheckResponse.SERVING)
    hs = bootstrap._HealthServicer(experimental_non_blocking=True)
    hs.set("", ns)
    sent: list[int | None] = []
    real = bootstrap._StatusSender.__call__
    flips = iter([ok, ns])

    def call(self, response):
        # Before each of the Watch's own sends (on the Watch's thread), another thread flips
        # the status and its broadcast goes out first.
        if threading.current_thread().name == "watch":
            status = next(flips, None)
            if status is not None:
                t = threading.Thread(target=hs.set, args=("", status))
                t.start()
                t.join(5)
        real(self, response)

    class Ctx:
        def add_callback(self, cb) -> bool:
            return True

    bootstrap._StatusSender.__call__ = call
    try:
        w = threading.Thread(name="watch", target=hs.Watch, args=(
            health_pb2.HealthCheckRequest(service=""), Ctx(),
            lambda r: sent.append(None if r is None else r.status)))
        w.start()
        w.join(5)
    finally:
        bootstrap._StatusSender.__call__ = real
    assert not w.is_alive() and sent
    assert sent[-1] == hs._server_status[""]
    assert all(a != b for a, b in zip(sent, sent[1:], strict=False))  # none sent twice in a row
    hs.set("", ns if sent[-1] == ok else ok)  # and later changes still reach the stream
    assert sent[-1] == hs._server_status[""]


def test_status_changes_while_watches_come_and_go_keep_the_server_alive(small_server):
    """A Watch's first message and a status broadcast sent to the same stream at once (both
    outside the servicer's lock) crashed gRPC's polling thread (KeyError 'send_message'):
    new Watches then timed out and set_serving blocked for good, holding the drain's lock."""
    import threading

    stop = time.monotonic() + 5
    errors: list = []
    watched = [0]
    sets = [0]

    def setter() -> None:
        serving = True
        while time.monotonic() < stop:
            small_server.set_serving(serving)
            serving = not serving
            sets[0] += 1
            time.sleep(0.02)

    def watcher() -> None:
        hs = health_pb2_grpc.HealthStub(grpc.insecure_channel(small_server.address))
        while time.monotonic() < stop:
            w = hs.Watch(health_pb2.HealthCheckRequest(service=""), timeout=3)
            try:
                next(w)
                watched[0] += 1
            except grpc.RpcError as e:
                errors.append(e.code())
            w.cancel()

    threads = [threading.Thread(target=setter, daemon=True)] + [
        threading.Thread(target=watcher, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads), "set_serving or a Watch hung"
    assert errors == [] and watched[0] > 100 and sets[0] > 50, (errors[:3], watched, sets)
    small_server.set_serving()
    hs = health_pb2_grpc.HealthStub(grpc.insecure_channel(small_server.address))
    assert hs.Check(health_pb2.HealthCheckRequest(), timeout=3).status == \
        health_pb2.HealthCheckResponse.SERVING


def _held_streams(rs, ask, n: int) -> list:
    """`n` reflection streams opened, each answered once and left open, idle: (the queue that
    feeds its requests, its responses)."""
    held = []
    for _ in range(n):
        q = queue.Queue()
        q.put(ask)
        it = rs.ServerReflectionInfo(iter(q.get, None), timeout=20)
        assert next(it).list_services_response.service  # open, answered, now idle
        held.append((q, it))
    return held


def test_idle_reflection_streams_cannot_take_every_thread(small_server, monkeypatch):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.common import bootstrap
    from services.common.bootstrap import MAX_OPEN_STREAMS

    # Every stream here comes from one peer: the server-wide cap, not the peer's, is tested.
    monkeypatch.setattr(bootstrap, "MAX_OPEN_STREAMS_PER_PEER", MAX_OPEN_STREAMS)

    ch = grpc.insecure_channel(small_server.address)
    rs = reflection_pb2_grpc.ServerReflectionStub(ch)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    held = _held_streams(rs, ask, MAX_OPEN_STREAMS)
    try:
        with pytest.raises(grpc.RpcError) as e:
            next(rs.ServerReflectionInfo(iter([ask]), timeout=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        r = _stub(small_server).Match(prefix_pb2.MatchRequest(token_ids=[1] * 16), timeout=3,
                                      metadata=AUTH)
        assert r.request_blocks == 1
    finally:
        for q, it in held:
            q.put(None)  # the client ends its side
            it.cancel()
    deadline = time.monotonic() + 5
    while True:  # the slots come back once the streams have ended
        try:
            got = list(rs.ServerReflectionInfo(iter([ask]), timeout=5))
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert got and got[0].list_services_response.service


def test_one_client_holds_few_reflection_streams_and_none_for_long(small_server, monkeypatch):
    """A security review: one client with no credential held every reflection slot, idle,
    for good on the internal services, and the operator's `grpcurl list` was refused."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.common import bootstrap

    monkeypatch.setattr(bootstrap, "OPEN_STREAM_MAX_S", 1.0)
    rs = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(small_server.address))
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    held = _held_streams(rs, ask, bootstrap.MAX_OPEN_STREAMS_PER_PEER)
    with pytest.raises(grpc.RpcError) as e:
        next(rs.ServerReflectionInfo(iter([ask]), timeout=5))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "per client" in e.value.details()
    t0 = time.monotonic()
    for _q, it in held:  # ended by the server at their time limit, idle as they are
        with pytest.raises(grpc.RpcError) as e:
            next(it)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "the most a stream may be" in e.value.details()
    assert time.monotonic() - t0 < 10
    # The slots are back. A client sees its stream end before the server's handler has run
    # its cleanup (which gives the slot back): a moment's grace, not a retry loop for long.
    settle = time.monotonic() + 2.0
    while True:
        try:
            got = list(rs.ServerReflectionInfo(iter([ask]), timeout=5))
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > settle:
                raise
            time.sleep(0.05)
    assert got and got[0].list_services_response.service


def test_a_reflection_stream_over_the_cap_waits_a_moment_for_a_slot(small_server,
                                                                   monkeypatch):
    """A differential review: the stock reflection client (a stream a request) opens its next
    stream as soon as it has the last one's answer, before the server has given that slot
    back, and was refused now and then ("at most 2 open streams per client"). A stream over
    the cap now waits up to OPEN_SLOT_GRACE_S for a slot to free, and is refused after it.
    A review of that: a waiting stream holds a worker thread, so one peer waits with one
    stream at a time; any other is refused at once (unbounded, a client opening streams
    faster than the grace ran out held every worker thread in waits)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.common import bootstrap

    rs = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(small_server.address))
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    held = _held_streams(rs, ask, bootstrap.MAX_OPEN_STREAMS_PER_PEER)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:  # nothing frees: refused after the grace
        next(rs.ServerReflectionInfo(iter([ask]), timeout=5))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - t0 >= bootstrap.OPEN_SLOT_GRACE_S * 0.9
    # A grace no loaded host outlasts: the late stream surely waits until a slot frees.
    monkeypatch.setattr(bootstrap, "OPEN_SLOT_GRACE_S", 30.0)
    waiting = small_server._interceptor._open_waiting
    got: list = []
    late = threading.Thread(target=lambda: got.extend(
        rs.ServerReflectionInfo(iter([ask]), timeout=60)))
    late.start()
    holds_within(lambda: waiting, 20, 0.01)  # until the server has it waiting
    assert waiting, "the late stream never waited"
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:  # the peer waits already: refused at once
        next(rs.ServerReflectionInfo(iter([ask]), timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - t0 < 15, "a second waiter from one peer held its thread"
    q, it = held.pop()
    t0 = time.monotonic()
    q.put(None)  # one held stream ends: its slot goes to the late one
    assert [r.list_services_response.service for r in it] == []
    late.join(30)
    assert got and got[0].list_services_response.service
    # Woken by the slot freed, not by the grace running out (then it found the slot free).
    assert time.monotonic() - t0 < 15, "a freed slot woke no stream waiting for one"
    assert not waiting
    for q, it in held:
        q.put(None)
        it.cancel()


def test_a_stream_waiting_for_a_slot_lets_go_when_its_client_cancels(small_server,
                                                                     monkeypatch):
    """A stream waiting for a slot whose client cancelled it went on waiting out the grace,
    holding a worker thread and its peer's one wait (a new stream from that client was
    refused at once meanwhile): the cancellation now wakes it."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.common import bootstrap

    monkeypatch.setattr(bootstrap, "OPEN_SLOT_GRACE_S", 30.0)  # no host outlasts it
    rs = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(small_server.address))
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    held = _held_streams(rs, ask, bootstrap.MAX_OPEN_STREAMS_PER_PEER)
    waiting = small_server._interceptor._open_waiting
    try:
        late = rs.ServerReflectionInfo(iter(queue.Queue().get, None), timeout=60)
        holds_within(lambda: waiting, 20, 0.01)  # until the server has it waiting
        assert waiting, "the late stream never waited"
        late.cancel()
        holds_within(lambda: not waiting, 10, 0.01)
        assert not waiting, "a cancelled stream kept waiting for a slot"
    finally:
        for q, it in held:
            q.put(None)
            it.cancel()


def test_reflection_streams_are_counted_and_timed_however_they_end():
    """Only refused reflection streams reached tiercache_rpc_total: the method's only series
    was the refusal, and an error-ratio alert on it read 100%. Its server has a service name
    of its own: the streams earlier tests held on theirs ("test") may end, and be timed, while
    this one runs."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.common.metrics import RPC_SECONDS, RPC_TOTAL

    service = "reflection-counted"

    def ok() -> float:
        return RPC_TOTAL.labels(service, "ServerReflectionInfo", "OK")._value.get()

    def timed() -> float:
        return sum(s.value for m in RPC_SECONDS.collect() for s in m.samples
                   if s.name.endswith("_count")
                   and s.labels.get("method") == "ServerReflectionInfo"
                   and s.labels.get("service") == service)

    before_ok, before_timed = ok(), timed()
    with _small(service) as h:
        rs = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(h.address))
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        got = list(rs.ServerReflectionInfo(iter([ask]), timeout=5))
        assert got and got[0].list_services_response.service
        holds_within(lambda: ok() >= before_ok + 1, 5, 0.05)  # the handler ends after
        assert ok() == before_ok + 1 and timed() == before_timed + 1


def test_the_per_client_reflection_cap_counts_every_connection_of_one_host(small_server):
    """A mutation audit: the cap is kept per host, the port left out. Keyed by host:port,
    each new connection of one client (a new port) would get its own two streams, and one
    client opening channel after channel held every reflection slot again."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.common import bootstrap

    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    channels = [grpc.insecure_channel(small_server.address,  # a connection each: own port
                                      options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(bootstrap.MAX_OPEN_STREAMS_PER_PEER + 1)]
    held = []
    try:
        for ch in channels[:-1]:
            q = queue.Queue()
            q.put(ask)
            it = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter(q.get, None), timeout=20)
            assert next(it).list_services_response.service  # open, answered, now idle
            held.append((q, it))
        with pytest.raises(grpc.RpcError) as e:
            next(reflection_pb2_grpc.ServerReflectionStub(channels[-1]).ServerReflectionInfo(
                iter([ask]), timeout=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 2 open streams per client" in e.value.details()
    finally:
        for q, it in held:
            q.put(None)
            it.cancel()
        for ch in channels:
            ch.close()


def test_a_closed_reflection_stream_leaves_no_timer_and_no_per_client_count(small_server):
    """A mutation audit: a stream that ended must disarm its time limit (else the reaper kept
    its context for OPEN_STREAM_MAX_S, one entry a stream) and drop its client's count at
    zero (else one entry per client address ever seen, for the server's life)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.common import bootstrap

    reaper, interceptor = bootstrap._OPEN_REAPER, small_server._interceptor

    def timers() -> set:  # the reaper's armed entries, read under its lock
        with reaper._cv:
            return set(reaper._armed)

    def counts() -> dict:  # the per-client counts, read under the interceptor's lock
        with interceptor._open_freed:
            return dict(interceptor._open_by_peer)

    before = timers()
    ch = grpc.insecure_channel(small_server.address)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    q = queue.Queue()
    q.put(ask)
    it = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter(q.get, None),
                                                                           timeout=20)
    assert next(it).list_services_response.service
    assert timers() - before and sum(counts().values()) == 1  # open: timed and counted
    q.put(None)  # the client ends its side; the stream ends normally
    assert list(it) == []
    # the handler's cleanup runs after the client has seen the end
    holds_within(lambda: not (timers() - before or counts()), 5, 0.05)
    assert timers() - before == set()
    assert counts() == {}
    ch.close()


def test_servers_accept_the_keepalive_pings_our_clients_send():
    """Clients ping idle connections every 20 s; servers took such pings at most every 5
    minutes and closed connections with GOAWAY too_many_pings (seen in make run's logs).
    A 50 s run with 11 s pings (a script, too slow for the suite) drew the GOAWAY with gRPC's
    defaults and with min_recv_ping_interval_without_data_ms, not with
    min_ping_interval_without_data_ms (the name gRPC 1.85 reads)."""
    from services.common.bootstrap import channel_options, server_options

    client = dict(channel_options())["grpc.keepalive_time_ms"]
    server = dict(server_options())
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < client
    assert server["grpc.keepalive_permit_without_calls"] == 1


def test_connections_are_closed_at_their_max_age_and_clients_move_to_a_new_one():
    """Behind a Service (balanced per connection) a client kept its first connection for
    good, so orchestrator pods added by the HPA got no traffic from it."""
    h = create_server(service="test", address="127.0.0.1:0", max_connection_age_s=0.5,
                      connection_age_grace_s=5,
                      services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, Index(),
                                 "tiercache.v1.PrefixIndex")])
    try:
        with grpc.insecure_channel(h.address) as ch:
            stub = prefix_pb2_grpc.PrefixIndexStub(ch)

            def peer() -> str:
                return stub.Match(prefix_pb2.MatchRequest(model_id="peer", token_ids=[1]),
                                  timeout=10).matches[0].address

            first = peer()
            assert peer() == first  # one connection while it is young
            # a new connection (another client port) once it aged
            wait_until(lambda: peer() != first, 30, "the connection was never closed", 0.2)
    finally:
        h.stop(0)


def test_an_open_health_watch_does_not_hold_the_shutdown_for_its_grace():
    """The server counts a Watch stream as an RPC in flight: one open Watch made every stop
    (kvpool, 60 s grace) wait the whole grace. Watches now end, after NOT_SERVING."""
    h = create_server(service="test", address="127.0.0.1:0", services=[])
    h.set_serving()
    channel = grpc.insecure_channel(h.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=""), timeout=60)
    seen = [next(watch).status]
    t0 = time.monotonic()
    h.stop(30.0)
    took = time.monotonic() - t0
    seen += [m.status for m in watch]  # the stream ends: no error, nothing after NOT_SERVING
    channel.close()
    assert seen == [health_pb2.HealthCheckResponse.SERVING,
                    health_pb2.HealthCheckResponse.NOT_SERVING]
    assert took < 20.0  # not the 30 s grace (it takes well under a second)


def test_a_signal_while_starting_ends_the_process_at_once(tmp_path):
    """Handlers were installed only once serving: as PID 1 (a container) SIGTERM during a
    model load was ignored, the pod turned SERVING and was killed at the end of its grace."""
    import signal
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from services.common.bootstrap import exit_on_signal_while_starting\n"
            "with exit_on_signal_while_starting():\n"
            "    print('loading', flush=True)\n"
            "    time.sleep(60)\n"
            "sys.exit(3)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "loading"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 128 + signal.SIGTERM  # at once, as a signal's exit
    finally:
        p.kill()
        p.wait()


def test_the_starting_handlers_go_away_with_main_and_a_late_signal_drains():
    """A review found them left installed in any process that had called main (tests among
    them: a killed pytest run then exited 0). Once health is SERVING, a signal before
    run_until_signal's own handlers is kept for its drain, not a hard exit."""
    import signal

    from services.common import bootstrap

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stopped: list[float] = []
    handle = SimpleNamespace(set_serving=lambda s=True: s and bootstrap._serving_began.set(),
                             stop=stopped.append, service="test")
    try:
        with bootstrap.exit_on_signal_while_starting():
            assert signal.getsignal(signal.SIGTERM) is bootstrap._exit_while_starting
            handle.set_serving()
            signal.raise_signal(signal.SIGTERM)  # just after SERVING: no exit here
            # Drains on that signal: without it, the wait for the next signal never ends
            # (the suite's timeout fails the test).
            bootstrap.run_until_signal(handle, grace=3.0)
            assert stopped == [3.0]
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])


def test_once_a_drain_begins_nothing_turns_health_serving_again(server):
    """kvpool's stalled-engine watcher turns health back on when the engine moves again; during
    a drain that would have put a stopping pod back into its Service's endpoints."""
    hs = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    req = health_pb2.HealthCheckRequest(service="")
    server.set_serving()
    server.begin_drain()
    server.set_serving(True)
    assert hs.Check(req, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_connection_age_of_weeks_starts_the_server():
    """gRPC takes connection ages in int32 milliseconds: 30 days overflowed it, a traceback
    at start that named no setting. Anything past 24.8 days is as good as never."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.bootstrap import _int32_ms

    assert _int32_ms(30 * 86400) == 2**31 - 1 and _int32_ms(0.5) == 500
    h = create_server(service="test", address="127.0.0.1:0", max_connection_age_s=30 * 86400,
                      connection_age_grace_s=30 * 86400, services=[])
    try:
        h.set_serving()
        with grpc.insecure_channel(h.address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        h.stop(0)


def _demo_service(seen: list):
    """A service with every handler kind, none of them open (health and reflection are)."""

    def unary(req, ctx):
        seen.append("unary")
        return b"secret-data"

    def client_stream(it, ctx):
        seen.append("client_stream")
        return b"".join(it) + b"secret-data"

    def bidi(it, ctx):
        seen.append("bidi")
        for m in it:
            yield m + b"secret-data"

    handlers = {"Unary": grpc.unary_unary_rpc_method_handler(unary),
                "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
                "Bidi": grpc.stream_stream_rpc_method_handler(bidi)}
    return (lambda _servicer, srv: srv.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("demo.Demo", handlers),)), None, "demo.Demo")


def test_every_handler_kind_needs_the_internal_credential():
    # Only unary and server-streaming methods were checked: a client-streaming or two-way
    # method added later answered callers without the credential.
    seen: list = []
    h = create_server(service="test", address="127.0.0.1:0", internal_token="s3cret",
                      services=[_demo_service(seen)])
    try:
        ch = grpc.insecure_channel(h.address)
        calls = {"unary": lambda md: ch.unary_unary("/demo.Demo/Unary")(b"x", timeout=5,
                                                                         metadata=md),
                 "client_stream": lambda md: ch.stream_unary("/demo.Demo/ClientStream")(
                     iter([b"x"]), timeout=5, metadata=md),
                 "bidi": lambda md: list(ch.stream_stream("/demo.Demo/Bidi")(
                     iter([b"x"]), timeout=5, metadata=md))}
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as e:
                call([])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert name not in seen
            assert b"secret-data" in (lambda r: r if isinstance(r, bytes) else r[0])(call(AUTH))
            assert name in seen
        ch.close()
    finally:
        h.stop(0)


def test_a_callers_token_is_checked_before_its_request_is_parsed():
    # The orchestrator's tenant tokens were checked inside its handlers, after the request was
    # parsed: 16 MiB of empty messages from anyone cost 1.2 s and 420 MB before the refusal.
    def authenticate(metadata):
        if ("authorization", "Bearer tok") not in metadata:
            raise errors.Unauthenticated("authorization: unknown token")

    h = create_server(service="test", address="127.0.0.1:0", authenticate=authenticate,
                      services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, Index(),
                                 "tiercache.v1.PrefixIndex")])
    try:
        ch = grpc.insecure_channel(h.address)
        raw = ch.unary_unary("/tiercache.v1.PrefixIndex/Match")
        # Bytes that are no MatchRequest: parsed, they are INVALID_ARGUMENT.
        garbage = b"\xff\xff\xff"
        with pytest.raises(grpc.RpcError) as e:
            raw(garbage, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "unknown token" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            raw(garbage, timeout=5, metadata=[("authorization", "Bearer tok")])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = _stub(h).Match(prefix_pb2.MatchRequest(token_ids=[1] * 16), timeout=5,
                            metadata=[("authorization", "Bearer tok")])
        assert ok.request_blocks == 1
        # Health stays open (probes carry no token).
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=5).status
        ch.close()
    finally:
        h.stop(0)


def test_the_count_of_refused_callers_left_out_says_what_it_counts(server, monkeypatch, caplog):
    """On-call walk-through: after 100 calls with a wrong token, the count line read
    "ipv4:127.0.0.1/UNAUTHENTICATED: 97 more lines left out", not saying what the lines were."""
    import logging

    from services.common import bootstrap
    from services.common.logs import Thinned

    monkeypatch.setattr(bootstrap, "_AUTH_LINES", Thinned(bootstrap.log, per_window=1,
                                                          window_s=60.0, level=logging.WARNING))
    with caplog.at_level(logging.WARNING, logger="services.common.bootstrap"):
        for _ in range(3):
            with pytest.raises(grpc.RpcError):
                _stub(server).Match(prefix_pb2.MatchRequest(token_ids=[1]), timeout=5,
                                    metadata=[("authorization", "Bearer guess")])
        bootstrap._AUTH_LINES.flush()
    counts = [r.getMessage().split(" between")[0] for r in caplog.records
              if "left out" in r.getMessage()]
    assert counts == ["callers refused/ipv4:127.0.0.1/UNAUTHENTICATED: 2 more lines left out"]
