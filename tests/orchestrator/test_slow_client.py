"""A client slower than its replica (pure logic with the fakes of test_pipeline_paths; the same
with real processes: tests/e2e/test_failover.py). The replica's stream is read at the
replica's pace: its load is released when the stream ends, not when the client has read the
answer; what was read ahead is still the answer, and a resume after a lost replica sends it
all. A cache tier's call under way (the lookup, the index Match, the Store after the answer)
is cancelled with the request."""

from __future__ import annotations

import threading
import time
from functools import partial
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import prefix_pb2, semantic_pb2

from services.common import errors
from services.orchestrator.pipeline import Finished, Policy, Sampling, TextDelta
from services.orchestrator.render import RenderedPrompt
from tests import waits
from tests.orchestrator.test_contracts import tokens
from tests.orchestrator.test_pipeline_paths import (
    PROMPT,
    TENANT,
    Call,
    RpcError,
    Stub,
    Unary,
    final,
    in_order,
    make,
)
from tests.orchestrator.test_request_path import backend_with

wait_until = partial(waits.wait_until, timeout=10.0, every=0.005)


def start(orch, on_cancel=lambda fn: None, max_tokens: int = 16):
    return orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(max_tokens, 0.0, 1.0, 0, (), False), policy=Policy(), session_id="s",
        return_token_ids=True, request_id="rid", deadline=time.monotonic() + 30,
        on_cancel=on_cancel)


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("replica-stream-")]


def test_the_replica_is_released_when_its_stream_ends_not_when_the_client_has_read_it():
    stub = Stub("A", [Call([tokens("a"), tokens("b"), tokens("c"), final("A", 2)])])
    orch = make({"A": stub})
    a = orch.replicas.replicas[0]
    events = start(orch)
    first = next(events)  # the client has read one message and reads no more for now
    wait_until(lambda: a.inflight == 0, what="the replica's load stayed while the client slept")
    rest = list(events)
    got = [first, *rest]
    assert "".join(e.text for e in got if isinstance(e, TextDelta)) == "abcok"
    fin = got[-1]
    assert isinstance(fin, Finished) and fin.completion_tokens == 5
    assert not readers()


class LostAfter(Call):
    """Streams its messages, then is lost (UNAVAILABLE)."""

    def __init__(self, msgs) -> None:
        super().__init__(msgs, RpcError(grpc.StatusCode.UNAVAILABLE))


def test_a_resume_sends_every_token_read_ahead_of_the_client():
    a_stub = Stub("A", [LostAfter([tokens("ab"), tokens("cd")])])
    b_stub = Stub("B", [Call([final("B", 2)])])
    orch = make({"A": a_stub, "B": b_stub})
    a = next(r for r in orch.replicas.replicas if r.address == "A")
    orch.routing = in_order("A", "B")
    events = start(orch, max_tokens=6)
    assert next(events).text == "ab"
    # A's stream has ended (lost) with "cd" read ahead of the client: A is released at once.
    wait_until(lambda: a.inflight == 0, what="the lost replica's load stayed")
    got = list(events)
    assert "".join(e.text for e in got if isinstance(e, TextDelta)) == "cdok"
    resumed = b_stub.requests[0]
    assert list(resumed.token_ids) == PROMPT + list(b"abcd")  # the buffered tokens too
    assert resumed.sampling.max_tokens == 2 and resumed.seed_offset == 4
    assert isinstance(got[-1], Finished) and got[-1].report.route == "resume"


def storing_tier(ids: list[str]):
    """A semantic tier whose Store records each request and answers the next id of `ids`."""
    stored: list[semantic_pb2.StoreRequest] = []

    def store(req, timeout=None, metadata=None):
        stored.append(req)
        return semantic_pb2.StoreResponse(id=ids[len(stored) - 1])

    sem = backend_with(SimpleNamespace(
        Lookup=Unary(lambda req, timeout=None, metadata=None: semantic_pb2.LookupResponse()),
        Store=Unary(store)))
    return sem, stored


def test_the_answer_is_stored_as_the_replica_finishes_not_when_the_client_has_read_it():
    # A slow client held the Store back until it had read every token (and, too slow for its
    # deadline, left a whole answer unstored): the reader stores it as the stream ends.
    stub = Stub("A", [Call([tokens("a"), tokens("b"), final("A", 2)])])
    sem, stored = storing_tier(["e1"])
    orch = make({"A": stub}, semantic=sem)
    events = start(orch)
    assert next(events).text == "a"  # ...and the client reads no more for now
    wait_until(lambda: stored, what="the answer was not stored while the client slept")
    req = stored[0]
    assert req.answer == "abok" and list(req.answer_token_ids) == list(b"abok")
    got = list(events)
    assert isinstance(got[-1], Finished) and got[-1].report.semantic_entry_id == "e1"
    assert len(stored) == 1  # once: the request does not store it again
    assert not readers()


def test_a_resumed_answer_is_stored_once_whole_by_the_replica_that_finished_it():
    a_stub = Stub("A", [LostAfter([tokens("ab"), tokens("cd")])])
    b_stub = Stub("B", [Call([final("B", 2)])])
    sem, stored = storing_tier(["e1"])
    orch = make({"A": a_stub, "B": b_stub}, semantic=sem)
    orch.routing = in_order("A", "B")
    got = list(start(orch, max_tokens=6))
    assert [r.answer for r in stored] == ["abcdok"]
    assert isinstance(got[-1], Finished) and got[-1].report.semantic_entry_id == "e1"


def test_an_answer_whose_stream_broke_after_its_final_message_is_stored_as_it_ends():
    # Its status was lost after the final message (the answer whole): stored as the answer
    # ends too, not once the client has read it.
    stub = Stub("A", [Call([tokens("a"), final("A", 2)], RpcError(grpc.StatusCode.UNAVAILABLE))])
    sem, stored = storing_tier(["e1"])
    orch = make({"A": stub}, semantic=sem)
    events = start(orch)
    assert next(events).text == "a"
    wait_until(lambda: stored, what="the answer was not stored while the client slept")
    got = list(events)
    assert [r.answer for r in stored] == ["aok"]
    assert isinstance(got[-1], Finished) and got[-1].report.semantic_entry_id == "e1"


def test_a_replica_lost_mid_answer_is_resumed_while_the_client_is_still_reading():
    # The resume waited until the client had read every token read before the loss: a slow
    # client then saw the answer stop for the resume's prefill once it had caught up. Now it
    # is resumed at once, and the rest of the answer waits for the client, read ahead.
    a_stub = Stub("A", [LostAfter([tokens("ab"), tokens("cd")])])
    b_stub = Stub("B", [Call([tokens("ef"), final("B", 2)])])
    sem, stored = storing_tier(["e1"])
    orch = make({"A": a_stub, "B": b_stub}, semantic=sem)
    orch.routing = in_order("A", "B")
    events = start(orch, max_tokens=8)
    assert next(events).text == "ab"  # ...and the client reads no more for now
    wait_until(lambda: stored,
               what="the answer was not resumed and finished while the client slept")
    resumed = b_stub.requests[0]
    assert list(resumed.token_ids) == PROMPT + list(b"abcd")
    assert resumed.sampling.max_tokens == 4 and resumed.seed_offset == 4
    assert all(r.inflight == 0 for r in orch.replicas.replicas)
    assert stored[0].answer == "abcdefok"
    got = list(events)
    assert "".join(e.text for e in got if isinstance(e, TextDelta)) == "cdefok"
    assert isinstance(got[-1], Finished) and got[-1].report.route == "resume"
    assert got[-1].completion_tokens == 8 and got[-1].report.semantic_entry_id == "e1"
    assert not readers()


class Endless(Call):
    """One message, then nothing until cancelled (a long answer under way)."""

    def __init__(self) -> None:
        super().__init__([tokens("a")])
        self._gone = threading.Event()

    def cancel(self) -> bool:
        self.cancelled = True
        self._gone.set()
        return True

    def __iter__(self):
        yield from self.msgs
        self._gone.wait(30)
        raise RpcError(grpc.StatusCode.CANCELLED)


def test_a_request_dropped_mid_answer_cancels_its_call_and_ends_its_reader():
    call = Endless()
    orch = make({"A": Stub("A", [call])})
    events = start(orch)
    assert next(events).text == "a"
    events.close()  # the gRPC server drops the response iterator of a call that ended
    assert call.cancelled and not readers()
    assert orch.replicas.replicas[0].inflight == 0


class Hung:
    """A tier shard's handler that answers nothing (a hung shard) until `released`, or for
    10 s; `Unary(hung)` is the stub's method, whose futures are cancellable meanwhile."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.released = threading.Event()

    def __call__(self, req, timeout=None, metadata=None):
        self.started.set()
        self.released.wait(10)
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)


def cancelled_while(hung: Hung, orch) -> tuple[list, list]:
    """Runs a request until `hung` has its call, then cancels it as gRPC does (the request's
    registered callbacks): (the events it gave, its Cancelled) once it has ended, which must
    be at once (within 3 s, loose for a loaded host), not when the hung call would have ended
    (10 s)."""
    callbacks: list = []
    got: list = []
    out: list = []

    def run() -> None:
        try:
            got.extend(start(orch, callbacks.append))
        except errors.Cancelled as e:
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert hung.started.wait(10)
        t0 = time.monotonic()
        for cb in callbacks:  # the client cancels: gRPC runs the registered callbacks
            cb()
        t.join(5)
        took = time.monotonic() - t0
        assert not t.is_alive() and took < 3.0, (
            f"the request waited {took:.1f} s on its hung call after its client left")
    finally:
        hung.released.set()
        t.join(15)
    return got, out


def test_a_lookup_under_way_is_cancelled_with_its_request():
    hung = Hung()
    lookup = Unary(hung)
    sem = backend_with(SimpleNamespace(Lookup=lookup))
    stub = Stub("A", [Call([final("A", 2)])])
    orch = make({"A": stub}, semantic=sem)
    got, out = cancelled_while(hung, orch)
    assert out and not got and lookup.calls[0].cancelled  # through the lookup's future
    assert stub.requests == []  # no model call
    # The tier is not blamed for a cancel of ours: not degraded, not unhealthy, not hung.
    assert "semantic_skipped" not in orch.stats.degradations
    assert "s:1" not in sem.hung.state and not sem.health.last_error
    lookup.handler = Hung()  # hung again: cancelled as it starts (a client gone already)
    try:
        with pytest.raises(grpc.FutureCancelledError):
            sem.lookup(semantic_pb2.LookupRequest(), on_call=lambda f: f.cancel())
    finally:
        lookup.handler.released.set()


def test_a_store_under_way_is_cancelled_with_its_request():
    """The answer was out and its Store hung: a client that cancelled then still held its
    worker thread, stream and tenant slots until the Store ended (half the time left, up to
    the tier's 2 s)."""
    hung = Hung()
    store = Unary(hung)
    sem = backend_with(SimpleNamespace(
        Lookup=Unary(lambda req, timeout=None, metadata=None: semantic_pb2.LookupResponse()),
        Store=store))
    stub = Stub("A", [Call([final("A", 2)]), Call([final("A", 2)])])
    orch = make({"A": stub}, semantic=sem)
    got, out = cancelled_while(hung, orch)
    assert out and store.calls[0].cancelled
    # The answer, then no final message.
    assert [e.text for e in got if isinstance(e, TextDelta)] == ["ok"] and len(got) == 1
    assert orch.replicas.replicas[0].inflight == 0
    # Not the tier's failure: not degraded, still healthy, not hung.
    assert "semantic_store_failed" not in orch.stats.degradations
    assert sem.health.healthy and sem.shard_health["s:1"].healthy
    assert "s:1" not in sem.hung.state
    # Nothing left behind: the next answer is stored, the shard asked as before.
    store.handler = lambda req, timeout=None, metadata=None: semantic_pb2.StoreResponse(id="e2")
    fin = list(start(orch))[-1]
    assert isinstance(fin, Finished) and fin.report.semantic_entry_id == "e2"


@pytest.mark.parametrize("probing", [False, True])
def test_an_index_match_under_way_is_cancelled_with_its_request(probing):
    """A client that cancelled during a hung index Match held its slots until the Match
    ended (the index's 0.5 s budget). A Match cancelled so says nothing of the shard: not
    index_down, not unhealthy, not hung; a probe of a hung shard hands the probe on."""
    from services.orchestrator.prefix_backend import PrefixBackend

    hung = Hung()
    match = Unary(hung)
    pb = PrefixBackend(("p:1",), "", 0.5, 16)
    pb.client._shards["p:1"].stub = SimpleNamespace(Match=match)
    if probing:  # hung before, its pause over: this request's Match is the probe
        pb.hung.state["p:1"] = (time.monotonic() - 1.0, 0.5)
    stub = Stub("A", [Call([final("A", 2)]), Call([final("A", 2)])])
    orch = make({"A": stub}, prefix=pb)
    got, out = cancelled_while(hung, orch)
    assert out and not got and match.calls[0].cancelled
    assert stub.requests == [] and orch.replicas.replicas[0].inflight == 0  # never routed
    assert orch.dispatched.match(orch.hasher.hashes(PROMPT, TENANT.cache_salt)) == {}
    assert "index_down" not in orch.stats.degradations
    assert not pb.health.last_error and "p:1" not in pb.client.shard_errors
    if probing:  # the next call probes (not skipped), as after any probe that learnt nothing
        assert pb.hung.state["p:1"][0] <= time.monotonic()
    else:
        assert not pb.hung.state
    asked: list = []

    def answers(req, timeout=None, metadata=None):
        asked.append(req.probe)
        return prefix_pb2.MatchResponse(matches=[prefix_pb2.ReplicaMatch(
            replica_id="A", matched_blocks=4, matched_tokens=64)])

    match.handler = answers
    # Routing probes (Warm's owners) ask as before: a plain call, no future to cancel.
    assert orch.owner(TENANT, PROMPT) == "A" and asked == [True] and len(match.calls) == 1
    # Nothing left behind: the next request is matched and served.
    fin = list(start(orch))[-1]
    assert isinstance(fin, Finished) and asked == [True, False] and len(match.calls) == 2
    assert not pb.hung.state and pb.health.healthy


class _Timeout(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "deadline"


@pytest.mark.parametrize("ending", ["cancelled", "cut short"])
def test_a_probe_that_learnt_nothing_does_not_bring_back_a_record_cleared_meanwhile(ending):
    # A call begun before the shard was marked hung answered while a probe was out: the
    # record was cleared. The probe then ended learning nothing (cancelled by its client, or
    # cut short by its request's own deadline) and wrote "probe next" back: every other
    # call was skipped (semantic_skipped) until that next probe returned.
    from services.orchestrator.backends import HungBackoff

    t = [100.0]
    hb = HungBackoff("semantic shard", (0.5, 5.0), clock=lambda: t[0])
    hb.state["s"] = (99.0, 0.5)  # hung, its pause over: the next call probes

    def probe():
        hb.answered("s")  # meanwhile: an older call got its answer
        if ending == "cancelled":
            raise grpc.FutureCancelledError()
        raise _Timeout()

    with pytest.raises((grpc.FutureCancelledError, grpc.RpcError)):
        hb.call("s", 0.2, 2.0, probe)  # 0.2 of the tier's 2.0: a cut-short deadline
    assert "s" not in hb.state
    assert hb.call("s", 2.0, 2.0, lambda: "ok") == "ok"  # not skipped


def test_what_was_read_ahead_is_not_handed_out_past_the_requests_deadline():
    # A client still reading at its request's deadline was let read on: the reader had
    # drained the replica, so nothing ended the request until the reaper, a second later,
    # counted it as a stuck send.
    from services.orchestrator.pipeline import _ReadAhead

    closed = []
    ahead = _ReadAhead(iter([1, 2, 3]), 8, "t", time.monotonic() + 0.3,
                       lambda: closed.append(1))
    wait_until(lambda: ahead._ended, what="the source was not read ahead")
    assert next(ahead) == 1
    time.sleep(0.35)
    with pytest.raises(errors.DeadlineExceeded):
        next(ahead)
    ahead.close()
    assert closed == []  # the source had ended: nothing to stop


def test_a_read_ahead_closed_early_stops_its_source_on_its_own_thread():
    from services.orchestrator.pipeline import _ReadAhead

    stopped = threading.Event()
    gave = []

    def source():
        try:
            for i in range(100):
                gave.append(i)
                yield i
        finally:
            stopped.set()

    ahead = _ReadAhead(source(), 4, "t", None, lambda: None)
    assert next(ahead) == 0
    wait_until(lambda: len(gave) >= 5, what="the source was not read ahead")
    time.sleep(0.05)
    assert len(gave) <= 6  # the buffer's limit holds it back (4 buffered, 1 waiting)
    ahead.close()
    assert stopped.is_set() and not ahead._thread.is_alive()


def test_a_request_whose_read_ahead_cannot_start_calls_no_replica(monkeypatch):
    stub = Stub("A", [Call([tokens("a"), final("A", 2)])])
    orch = make({"A": stub})

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError):
        list(start(orch))
    assert stub.requests == [] and orch.replicas.replicas[0].inflight == 0


def test_a_read_ahead_is_closed_once(monkeypatch):
    # The request's loop and its `finally` may both close it: a replica side that did not end
    # at once was cancelled twice and joined twice (2 x JOIN_S in the gRPC handler).
    from services.orchestrator.pipeline import _ReadAhead

    monkeypatch.setattr(_ReadAhead, "JOIN_S", 1.0)
    release = threading.Event()
    closes = []

    def source():
        yield 1
        release.wait(5)  # wedged: the cancel does not end it
        yield 2

    ahead = _ReadAhead(source(), 8, "replica-stream-x", None, lambda: closes.append(1))
    try:
        assert next(ahead) == 1
        t0 = time.monotonic()
        ahead.close()
        ahead.close()
        # One join (1 s), not two: 0.9 s of slack for a loaded host.
        assert closes == [1] and time.monotonic() - t0 < 1.9
    finally:
        release.set()


def test_a_client_gone_before_the_end_of_its_answer_is_not_counted_as_served():
    # The replica side finishes ahead of a slow client; the request's counts and metrics are
    # still made only once the client has taken the last token, as before the read-ahead.
    stub = Stub("A", [Call([tokens("a"), tokens("b"), final("A", 2)])])
    sem, stored = storing_tier(["e1"])
    orch = make({"A": stub}, semantic=sem)
    events = start(orch)
    assert next(events).text == "a"
    wait_until(lambda: stored and not readers(), what="the replica side did not finish")
    assert sum(orch.stats.requests.values()) == 0
    events.close()  # the client went away without reading the rest
    assert sum(orch.stats.requests.values()) == 0
    read_to_the_end = make({"A": Stub("A", [Call([tokens("a"), final("A", 2)])])})
    got = list(start(read_to_the_end))
    assert isinstance(got[-1], Finished) and sum(read_to_the_end.stats.requests.values()) == 1
