"""Rules of the KvPool servicer that its gRPC tests leave unchecked, driven through a fake
engine (an answer queued ahead) and a fake call context: how queued output is sent, what a
stream ended early cancels, the deadline handed to the engine, and limits at their boundary."""

from __future__ import annotations

import queue
import time
from dataclasses import replace

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2

from services.common import errors
from services.kvpool.engine import Failed, Finished, FinishReason, TokenDelta, model_info
from services.kvpool.server import KvPoolServicer
from tests.kvpool.conftest import TINY_ID
from tests.kvpool.test_kvpool_server import CFG, PROMPT, Served, gen


class QueuedEngine:
    """Answers every submit with `outputs`, queued before the servicer reads any."""

    running = True
    prefix_caching = True

    def __init__(self, *outputs) -> None:
        self.outputs = outputs
        self.requests: list = []
        self.cancelled: list[str] = []

    def submit(self, req):
        self.requests.append(req)
        out: queue.Queue = queue.Queue()
        for o in self.outputs:
            out.put(o)
        return "seq-1", out

    def cancel(self, seq_id) -> None:
        self.cancelled.append(seq_id)


class Ctx:
    def __init__(self, left: float | None = None) -> None:
        self.left = left
        self.callbacks: list = []

    def time_remaining(self):
        return self.left

    def add_callback(self, fn):
        self.callbacks.append(fn)
        return True

    def is_active(self):
        return True


def servicer(engine, tiny_model) -> KvPoolServicer:
    s = KvPoolServicer(CFG)
    s.attach(engine, model_info(tiny_model, TINY_ID))
    return s


def done(n: int) -> Finished:
    return Finished(FinishReason.LENGTH, len(PROMPT), n, 0, 1.0, n, len(PROMPT), 0, 1.0)


def request(max_tokens: int = 8) -> kvpool_pb2.KvGenerateRequest:
    return kvpool_pb2.KvGenerateRequest(
        token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


def test_queued_deltas_and_the_end_go_out_as_one_message(tiny_model) -> None:
    """Deltas that queued while the client was slow are sent together, and the last of them
    travels with the final message (a reader never holds a finished answer unknowingly)."""
    eng = QueuedEngine(TokenDelta([1]), TokenDelta([2]), TokenDelta([3], last=True), done(3))
    msgs = list(servicer(eng, tiny_model).Generate(request(), Ctx()))
    assert len(msgs) == 1
    assert list(msgs[0].token_ids) == [1, 2, 3] and msgs[0].final.usage.completion_tokens == 3
    assert eng.cancelled == []  # it finished: nothing to cancel


@pytest.mark.parametrize("outputs", [
    (TokenDelta([1]), TokenDelta([2]), Failed(errors.Unavailable("engine died"))),
    (TokenDelta([1]), TokenDelta([2], last=True), Failed(errors.Unavailable("engine died"))),
], ids=["mid-answer", "after-the-last-token"])
def test_tokens_generated_before_a_failure_are_sent_before_its_error(tiny_model, outputs):
    """A failure after some tokens: the client gets every token generated, then the error
    (a resumed answer continues after what it was sent)."""
    gen_ = servicer(QueuedEngine(*outputs), tiny_model).Generate(request(), Ctx())
    got: list[int] = []
    with pytest.raises(errors.Unavailable):
        for msg in gen_:
            got.extend(msg.token_ids)
    assert got == [1, 2]


def test_a_stream_closed_early_cancels_its_sequence_and_the_rpc_end_does_too(tiny_model):
    """A client gone mid-answer (the stream closed) cancels its engine sequence at once; the
    RPC-end callback cancels it too (a handler blocked in a send never reaches its finally)."""
    eng = QueuedEngine(TokenDelta([1]))
    ctx = Ctx()
    g = servicer(eng, tiny_model).Generate(request(), ctx)
    assert list(next(g).token_ids) == [1]
    g.close()
    assert eng.cancelled == ["seq-1"]
    for fn in ctx.callbacks:
        fn()
    assert eng.cancelled == ["seq-1", "seq-1"]


class EndedCtx(Ctx):
    """A call its client had cancelled before the handler began: gRPC refuses callbacks."""

    def add_callback(self, fn):
        return False


@pytest.mark.parametrize("rpc", ["Generate", "Prefill"])
def test_a_call_ended_before_its_handler_began_cancels_its_sequence_at_once(tiny_model, rpc):
    """With the call already ended, gRPC refuses the RPC-end callback: the sequence is
    cancelled as it is submitted, not after a prefill computed for nobody."""
    eng = QueuedEngine(*([TokenDelta([1], last=True)] if rpc == "Generate" else []), done(1))
    s = servicer(eng, tiny_model)
    if rpc == "Generate":
        list(s.Generate(request(), EndedCtx()))
    else:
        s.Prefill(kvpool_pb2.PrefillRequest(token_ids=PROMPT), EndedCtx())
    assert eng.cancelled == ["seq-1"]


@pytest.mark.parametrize("left", [None, 1e9])
def test_no_client_deadline_gives_the_engine_none(tiny_model, left) -> None:
    """No deadline (gRPC reports none, or a huge time left) is no deadline for the engine."""
    eng = QueuedEngine(TokenDelta([1], last=True), done(1))
    list(servicer(eng, tiny_model).Generate(request(), Ctx(left)))
    assert eng.requests[0].deadline is None


def test_the_clients_deadline_reaches_the_engine(tiny_model) -> None:
    """The engine ends a sequence at the client's deadline: it gets that instant."""
    eng = QueuedEngine(TokenDelta([1], last=True), done(1))
    t0 = time.monotonic()
    list(servicer(eng, tiny_model).Generate(request(), Ctx(5.0)))
    assert t0 + 4.5 <= eng.requests[0].deadline <= time.monotonic() + 5.0


def test_prompt_and_answer_may_fill_the_context_exactly_and_not_one_token_more(tiny_model):
    """max_context bounds prompt + max_tokens (Generate) and the prompt (Prefill): equal to it
    is served, one more is INVALID_ARGUMENT naming token_ids."""
    s = Served(replace(CFG, max_context=40, drafts=False), tiny_model)
    try:
        toks, final = gen(s.stub, list(range(1, 33)), max_tokens=8, ignore_eos=True)
        assert final.usage.prompt_tokens + len(toks) == 40
        assert s.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=list(range(1, 41))),
                              timeout=10).prompt_tokens == 40
        with pytest.raises(grpc.RpcError) as ei:
            gen(s.stub, list(range(1, 34)), max_tokens=8)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith("token_ids:")
        with pytest.raises(grpc.RpcError) as ei:
            s.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=list(range(1, 42))), timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith("token_ids:")
    finally:
        s.close()


@pytest.mark.parametrize(("reason", "wire"), [
    (FinishReason.EOS, common_pb2.FINISH_REASON_EOS),
    (FinishReason.LENGTH, common_pb2.FINISH_REASON_LENGTH),
    (FinishReason.STOP, common_pb2.FINISH_REASON_STOP),
])
def test_each_finish_reason_reaches_the_wire_as_itself(tiny_model, reason, wire) -> None:
    """The final message says why the answer ended: EOS, LENGTH or a stop token (STOP),
    never UNSPECIFIED."""
    eng = QueuedEngine(TokenDelta([1], last=True), done(1)._replace(finish_reason=reason))
    (msg,) = servicer(eng, tiny_model).Generate(request(), Ctx())
    assert msg.final.finish_reason == wire


def test_a_pin_asked_for_longer_than_the_replicas_limit_is_cut_to_it(tiny_model) -> None:
    """Prefill pins for at most pin_ttl_max_seconds, whatever ttl_seconds asks; a shorter
    one is kept as asked."""
    from types import SimpleNamespace

    eng = QueuedEngine(done(0))
    eng.pool = SimpleNamespace(block_size=CFG.block_size)
    s = servicer(eng, tiny_model)
    for asked in (CFG.pin_ttl_max_seconds * 100, 5):
        s.Prefill(kvpool_pb2.PrefillRequest(token_ids=PROMPT, pin=True, ttl_seconds=asked),
                  Ctx())
    assert [r.pin_ttl_seconds for r in eng.requests] == [CFG.pin_ttl_max_seconds, 5]


def test_a_pin_ttl_without_pin_is_refused_naming_it_before_any_work(tiny_model) -> None:
    """ttl_seconds is a pin's lifetime: sent without pin it is INVALID_ARGUMENT naming it, and
    nothing reaches the engine (the prefix was computed, left unpinned, and the TTL ignored
    without a word). Neither field set is a plain prefill."""
    eng = QueuedEngine(done(0))
    s = servicer(eng, tiny_model)
    with pytest.raises(errors.InvalidArgument, match=r"^ttl_seconds: 60 s without pin"):
        s.Prefill(kvpool_pb2.PrefillRequest(token_ids=PROMPT, ttl_seconds=60), Ctx())
    assert eng.requests == []
    s.Prefill(kvpool_pb2.PrefillRequest(token_ids=PROMPT), Ctx())
    assert [r.pin_ttl_seconds for r in eng.requests] == [0.0]


def test_an_engine_stopped_by_a_drain_that_began_during_the_watchs_check_says_nothing():
    """The watch ends quietly when the server stops, even when the stop lands between its
    wake-up and its look at the engine (a drain stops the engine on purpose)."""
    import threading
    from types import SimpleNamespace

    from services.kvpool.server import watch_engine

    class StopsAsItWakes(threading.Event):
        def wait(self, timeout=None):
            self.set()  # the drain begins just after this wait timed out...
            return False

    calls: list[bool] = []
    engine = SimpleNamespace(running=False)  # ... and has stopped the engine
    t = watch_engine(engine, SimpleNamespace(stopped=StopsAsItWakes(),
                                             set_serving=calls.append), every=0.01)
    t.join(5)
    assert not t.is_alive() and calls == []


def test_stats_are_refused_once_the_server_drains(tiny_model) -> None:
    """From SIGTERM on (the handle's `draining`), Stats is UNAVAILABLE saying the replica is
    draining: orchestrators route by these polls, not by health, and went on sending new
    requests to a stopping replica through the whole drain delay."""
    import threading

    draining = threading.Event()
    s = servicer(QueuedEngine(), tiny_model)
    s.draining = draining
    draining.set()
    with pytest.raises(errors.Unavailable, match="draining"):
        s.Stats(kvpool_pb2.KvStatsRequest(), Ctx())


def test_flush_drops_one_tenants_blocks_and_the_next_answer_is_the_same(tiny_model) -> None:
    """KvPool.Flush (erasure on request): a tenant's blocks, its pinned warm-up too, stayed
    until evicted, with no way to drop them but a restart. Flush drops that salt's blocks
    only, the next request computes them again with the same greedy tokens, and an empty or
    bad salt is INVALID_ARGUMENT naming the field, with nothing dropped."""
    from tests.kvpool.test_kvpool_server import Served

    served = Served(CFG, tiny_model)
    try:
        ids = list(range(1, 25))
        stub = served.stub
        for salt in ("a", "b"):
            stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=ids, cache_salt=salt, pin=True,
                                                   ttl_seconds=600), timeout=10)

        def answer(salt):
            req = kvpool_pb2.KvGenerateRequest(
                token_ids=ids + [3], cache_salt=salt,
                sampling=common_pb2.SamplingParams(max_tokens=6))
            out, final = [], None
            for msg in stub.Generate(req, timeout=20):
                out.extend(msg.token_ids)
                final = msg.final if msg.HasField("final") else final
            return out, final.cached_tokens

        warm, cached = answer("a")
        assert cached == 24
        for bad, why in (("", "required"), ("x\0y", "NUL")):
            with pytest.raises(grpc.RpcError) as exc:
                stub.Flush(kvpool_pb2.KvFlushRequest(cache_salt=bad), timeout=5)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cache_salt" in exc.value.details() and why in exc.value.details()
        pinned = stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5).blocks_pinned
        r = stub.Flush(kvpool_pb2.KvFlushRequest(cache_salt="a"), timeout=5)
        assert r.blocks_dropped >= 6 and r.blocks_in_use == 0 and r.replica_id == "kv-test"
        st = stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
        assert st.blocks_pinned == pinned - 6  # a's pins went, b's stay
        cold, cached = answer("a")
        assert cached == 0 and cold == warm  # computed again, the same tokens
        assert answer("b")[1] == 24
        served.replica.engine.check_integrity()
    finally:
        served.close()
