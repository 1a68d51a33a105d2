"""The orchestrator's semantic backend over 2 real in-process shards: namespaces stay whole."""

import grpc
import pytest
from tiercache.v1 import semantic_pb2, semantic_pb2_grpc

from services.common.bootstrap import create_server
from services.launcher import free_port
from services.orchestrator.backends import SemanticBackend


class Shard(semantic_pb2_grpc.SemanticCacheServicer):
    """A dictionary standing in for one shard (pure routing test, no embeddings)."""

    def __init__(self, name):
        self.name = name
        self.entries = {}
        self.hold = None  # called with the context before an Invalidate answers

    def Store(self, req, ctx):  # noqa: N802
        eid = f"{self.name}-{len(self.entries)}"
        self.entries[eid] = req
        return semantic_pb2.StoreResponse(id=eid)

    def Lookup(self, req, ctx):  # noqa: N802
        for eid, e in self.entries.items():
            if e.namespace == req.namespace and e.prompt == req.text:
                return semantic_pb2.LookupResponse(hit=True, similarity=1.0, entry=semantic_pb2
                                                   .SemanticEntry(id=eid, answer=e.answer))
        return semantic_pb2.LookupResponse()

    def Invalidate(self, req, ctx):  # noqa: N802
        if self.hold is not None:
            self.hold(ctx)
        return semantic_pb2.InvalidateResponse(removed=int(self.entries.pop(req.id, None)
                                                           is not None))

    def Verify(self, req, ctx):  # noqa: N802
        if req.id not in self.entries:
            ctx.abort(grpc.StatusCode.NOT_FOUND, f"id: {req.id} unknown")
        return semantic_pb2.SemanticEntry(id=req.id, verified=req.verified)

    def Stats(self, req, ctx):  # noqa: N802
        return semantic_pb2.SemanticStatsResponse(entries=len(self.entries), lookup_p99_ms=1.0)


@pytest.fixture
def shards():
    svcs = [Shard("s0"), Shard("s1")]
    handles = [create_server(service="semantic", address="127.0.0.1:0", services=[
        (semantic_pb2_grpc.add_SemanticCacheServicer_to_server, s, "tiercache.v1.SemanticCache")])
        for s in svcs]
    yield svcs, handles
    for h in handles:
        h.stop(0)


def test_namespaces_are_routed_whole_and_ids_found_on_any_shard(shards):
    svcs, handles = shards
    be = SemanticBackend(",".join(h.address for h in handles), "", 5.0)
    namespaces = [semantic_pb2.Namespace(tenant=f"t{i}", model_id="m", context_hash="c")
                  for i in range(16)]
    ids = {}
    for ns in namespaces:
        for q in ("q1", "q2"):
            ids[(ns.tenant, q)] = be.store(semantic_pb2.StoreRequest(namespace=ns, prompt=q,
                                                                     answer=f"a-{q}")).id
    # Both shards are used, and each namespace lives on exactly one of them.
    assert all(s.entries for s in svcs)
    for ns in namespaces:
        owners = {s.name for s in svcs for e in s.entries.values() if e.namespace == ns}
        assert len(owners) == 1
        hit = be.lookup(semantic_pb2.LookupRequest(namespace=ns, text="q2"))
        assert hit.hit and hit.entry.answer == "a-q2"
    assert be.stats().entries == 32
    some = ids[("t3", "q1")]
    assert be.verify(some, True).verified
    assert be.invalidate(some).removed == 1
    assert be.invalidate(some).removed == 0
    with pytest.raises(grpc.RpcError) as e:
        be.verify(some, True)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_orchestrator_spelling_the_shards_differently_finds_every_namespace(shards):
    """Two orchestrators, one listing the shards plainly, the other through gRPC target
    schemes in another order: the ring was keyed by the text, so the second looked up half the
    namespaces on the shard the first never stored them on."""
    svcs, handles = shards
    a, b = (h.address for h in handles)
    one = SemanticBackend(f"{a},{b}", "", 5.0)
    other = SemanticBackend(f" ipv4:{b}, dns:///{a} ", "", 5.0)
    namespaces = [semantic_pb2.Namespace(tenant=f"t{i}", model_id="m", context_hash="c")
                  for i in range(16)]
    for ns in namespaces:
        one.store(semantic_pb2.StoreRequest(namespace=ns, prompt="q", answer="a"))
    assert all(s.entries for s in svcs)
    assert all(other.lookup(semantic_pb2.LookupRequest(namespace=ns, text="q")).hit
               for ns in namespaces)


def test_a_rating_on_a_live_shard_is_not_reported_failed_when_another_is_down(shards):
    svcs, handles = shards
    be = SemanticBackend(",".join(h.address for h in handles), "", 2.0)
    ns = [semantic_pb2.Namespace(tenant=f"t{i}", model_id="m", context_hash="c")
          for i in range(16)]
    ids = [be.store(semantic_pb2.StoreRequest(namespace=n, prompt="q", answer="a")).id
           for n in ns]
    on_s1 = next(i for i in ids if i.startswith("s1-"))
    on_s0 = next(i for i in ids if i.startswith("s0-"))
    handles[0].stop(0)  # shard s0 goes down
    assert be.verify(on_s1, True).verified  # applied on s1: reported as applied
    assert be.invalidate(on_s1).removed == 1
    with pytest.raises(grpc.RpcError) as e:  # s0's entry: the outage, not NOT_FOUND
        be.verify(on_s0, True)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # A bad rating of s0's entry too: s1 answers "removed 0", which must not pass for
    # "unknown" (NOT_FOUND tells the client not to retry while s0 still serves the answer).
    with pytest.raises(grpc.RpcError) as e:
        be.invalidate(on_s0)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert on_s0 in svcs[0].entries


def test_a_bad_rating_cut_short_by_the_deadline_is_not_reported_unknown(shards, monkeypatch):
    """The deadline ran out after one shard answered "removed 0": the shard never asked may
    hold the entry, so the caller gets DEADLINE_EXCEEDED, not NOT_FOUND."""
    import time
    import types

    from services.common import errors
    from services.orchestrator import backends

    svcs, handles = shards
    be = SemanticBackend(",".join(h.address for h in handles), "", 2.0)
    asked: list[str] = []
    real_call = be._call

    def call(address, method, req, timeout, on_call=None):
        asked.append(address)
        return real_call(address, method, req, timeout, on_call=on_call)

    # The round's clock jumps past the deadline once the first shard has answered.
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + 60 * len(asked),
                                  time=time.time)
    monkeypatch.setattr(be, "_call", call)
    monkeypatch.setattr(backends, "time", clock)
    with pytest.raises(errors.DeadlineExceeded):
        be.invalidate("s1-0", deadline=time.monotonic() + 30)
    assert len(asked) == 1  # the other shard was never asked
    asked.clear()
    monkeypatch.setattr(backends, "time", time)
    assert be.invalidate("s1-7").removed == 0  # every shard answered: unknown, as before
    assert len(asked) == 2


def test_a_shard_that_is_down_shows_in_the_shard_health_stats_reports(shards):
    """Partial answers summed the live shards, and the tier's one health record said healthy
    (the last call that worked), so Stats hid a shard that was down: each shard's own shows."""
    from services.orchestrator.prefix_backend import PrefixBackend

    _, handles = shards
    dead = f"127.0.0.1:{free_port()}"
    live = handles[0].address
    be = SemanticBackend(f"{dead},{live}", "", 1.0)
    st = be.stats()
    assert st.entries == 0  # the live shard answered
    assert (st.shards_total, st.shards_answered) == (2, 1)  # and the sum says it is partial
    assert be.health.healthy  # the tier's call-by-call record: the last call worked
    tier = be.dependencies()[0]  # but its line in Stats is every shard's
    assert (tier.name, tier.healthy) == ("semantic", False) and dead in tier.last_error
    by_addr = {h.address: h for h in be.shard_health.values()}
    assert by_addr[live].healthy and not by_addr[dead].healthy
    assert by_addr[dead].last_error

    pb = PrefixBackend((live, dead), "", 1.0, 16)
    calls = {"n": 0}

    class Answer:
        def future(self, req, timeout=None, metadata=None):
            calls["n"] += 1
            return SimpleFuture()

    class SimpleFuture:
        def result(self):
            from tiercache.v1 import prefix_pb2
            return prefix_pb2.PrefixStatsResponse(nodes=10, block_size=16)

    pb.client._shards[live].stub = type("S", (), {"Stats": Answer()})()
    got = pb.stats()
    assert got.nodes == 10 and (got.shards_total, got.shards_answered) == (2, 1)
    deps = {d.address: d for d in pb.dependencies() if d.name == "prefix shard"}
    assert deps[live].healthy and not deps[dead].healthy and deps[dead].last_error


def test_ratings_and_stats_keep_the_callers_deadline_over_every_shard(shards):
    """Feedback and Stats called each shard with the tier's own 2 s timeout, one after the
    other: a client that gave 0.3 s got DEADLINE_EXCEEDED while its rating went on to be
    applied seconds later."""
    import threading
    import time

    from services.common import errors

    svcs, handles = shards
    release = threading.Event()
    seen: list[float] = []

    def held(ctx):
        seen.append(ctx.time_remaining())
        release.wait(5)

    be = SemanticBackend(",".join(h.address for h in handles), "", 2.0)
    # Connected first: a channel's first connection within the 0.3 s below, on a loaded
    # machine, could leave the shard's handler never called.
    assert be.stats().shards_answered == 2
    for s in svcs:
        s.hold = held
    try:
        t0 = time.monotonic()
        with pytest.raises((grpc.RpcError, errors.DeadlineExceeded)) as e:
            be.invalidate("s0-0", deadline=t0 + 0.3)
        took = time.monotonic() - t0
        assert took < 1.5, took  # not 2 s per shard
        code = e.value.code() if isinstance(e.value, grpc.RpcError) else e.value.code
        assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED")
        assert seen and max(seen) <= 0.35  # the shard was told the caller's deadline
        assert len(seen) == 1  # none called once it had passed
    finally:
        release.set()
    st = be.stats(deadline=time.monotonic() + 5)
    assert st.entries == 0 and (st.shards_total, st.shards_answered) == (2, 2)  # all answer


def _line(resp, name: str):
    return next(d for d in resp.dependencies if d.name == name)


def test_the_tier_line_names_the_shard_that_is_down_though_another_answered_last(shards):
    """The tier's health line was its call-by-call record: with shard A down and B asked after
    it, the last call worked and Stats read the tier healthy (only the shard lines told). It
    is now every shard's: healthy only when all are, else which are not."""
    from clients.python.client import TierCacheClient
    from tests.orchestrator.stats_view import stats_server

    _, handles = shards
    a, b = (h.address for h in handles)
    be = SemanticBackend(f"{a},{b}", "", 1.0)  # a round over the shards asks A, then B
    with stats_server(be) as addr, TierCacheClient(addr, timeout=30) as c:
        up = c.stats()
        assert _line(up, "semantic").healthy and not _line(up, "semantic").last_error
        assert (up.semantic.shards_total, up.semantic.shards_answered) == (2, 2)
        handles[0].stop(0)  # shard A goes down
        down = c.stats()
    assert be.health.healthy  # the call-by-call record: B, asked last, answered
    tier = _line(down, "semantic")
    assert not tier.healthy and tier.address == f"{a},{b}"
    assert tier.last_error == f"1 of 2 shards unhealthy: {a}"
    assert {d.address: d.healthy for d in down.dependencies
            if d.name == "semantic shard"} == {a: False, b: True}
    assert (down.semantic.shards_total, down.semantic.shards_answered) == (2, 1)


def test_one_shard_keeps_the_tier_line_alone(shards):
    """A single-shard deployment's Stats are as before: one "semantic" line, its calls'."""
    from clients.python.client import TierCacheClient
    from tests.orchestrator.stats_view import stats_server

    _, handles = shards
    only = handles[1].address
    be = SemanticBackend(only, "", 1.0)
    with stats_server(be) as addr, TierCacheClient(addr, timeout=30) as c:
        s = c.stats()
        assert [(d.name, d.address, d.healthy) for d in s.dependencies] == [
            ("semantic", only, True)]
        handles[1].stop(0)
        s = c.stats()
    assert [(d.name, d.address, d.healthy) for d in s.dependencies] == [
        ("semantic", only, False)]
    assert _line(s, "semantic").last_error  # the failed call's own error, as before
