"""Rules of the orchestrator's backends (replica health and load, the semantic tier's shards)
that no other test pinned down; each over fakes of the replicas or shards."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import kvpool_pb2, semantic_pb2

from services.orchestrator.backends import Health, Replica, ReplicaSet, SemanticBackend
from tests.metric_sample import sample_value
from tests.orchestrator.test_pipeline_paths import RpcError
from tests.orchestrator.test_replica_load import FailingStats, replica, replica_set
from tests.orchestrator.test_request_path import TimesOut, backend_with
from tests.orchestrator.test_semantic_errors import Refusal


class Answering:
    """A replica whose Stats answer is `answer` (replaced by the test as it goes)."""

    def __init__(self, **answer) -> None:
        self.answer = kvpool_pb2.KvStatsResponse(**answer)

    def Stats(self, req, timeout=None, metadata=None):  # noqa: N802 (gRPC method name)
        return self.answer


def test_a_call_failing_on_a_replica_the_poller_holds_down_does_not_lift_the_hold():
    """Only the poller brings back a replica it holds down (draining): a request failing
    there and another finishing there after it leave it out of routing."""
    h = Health("kvpool", "r0")
    h.ok()
    h.fail("refused Stats: draining", hold=True)
    h.fail("stream lost")  # a request's failure there: no hold of its own
    h.traffic_ok()  # a stream still finishing there
    assert not h.healthy and h.held_down
    h.ok()  # the poller's next answer
    assert h.healthy and not h.held_down


def test_our_calls_the_replica_has_not_counted_yet_still_count_in_full():
    """The replica's figure below our own in-flight count (our calls not there yet when it
    answered) takes nothing off ours: the other callers' share is never below zero."""
    r = replica("r0", running=1, inflight=3)
    replica_set(r).poll_once()
    assert r.load == 3


def test_replica_stall_s_zero_turns_the_stall_check_off():
    """replica_stall_s 0 = off: a replica however long its engine has been idle stays in
    routing."""
    r = Replica("r0", Answering(replica_id="r0", stalled_for_s=500.0), Health("kvpool", "r0"),
                replica_id="r0")
    rs = replica_set(r)
    rs.stall_s = 0.0
    rs.poll_once()
    assert r.health.healthy and rs.healthy() == [r]


def test_an_address_sharing_a_replica_id_comes_in_once_the_holder_leaves_routing():
    """The first address to answer under a replica id keeps it; the other comes into routing
    once that one is down, not only once it is gone."""
    a, b = (Replica(addr, Answering(replica_id="kvpool-0"), Health("kvpool", addr))
            for addr in ("10.0.0.1:50054", "10.0.0.2:50054"))
    rs = replica_set(a, b)
    rs.poll_once()
    (first,) = rs.healthy()
    other = b if first is a else a
    first.stub = FailingStats(grpc.StatusCode.UNAVAILABLE)
    rs.poll_once()
    rs.poll_once()  # whichever order the two answers were applied in
    assert rs.healthy() == [other] and other.replica_id == "kvpool-0"


def _polled_replica_r0() -> tuple[Answering, ReplicaSet, list[str]]:
    """A set of one replica "r0" serving model "m", polled once; `lost` collects the ids
    the set reports lost."""
    stub = Answering(replica_id="r0", incarnation="a", model_id="m")
    rs = ReplicaSet(addresses=(), internal_token="", model_id="m")
    rs.replicas.append(Replica("r0", stub, Health("kvpool", "r0"), replica_id="r0"))
    lost: list[str] = []
    rs.on_lost.append(lost.append)
    rs.poll_once()
    return stub, rs, lost


def test_a_replica_restarted_with_another_model_is_reported_lost():
    """A replica that comes back from a restart serving another model is out of routing and
    reported lost: routing forgets what it sent there (its cache is gone)."""
    stub, rs, lost = _polled_replica_r0()
    assert lost == [] and rs.replicas[0].health.healthy
    stub.answer = kvpool_pb2.KvStatsResponse(replica_id="r0", incarnation="b", model_id="m2")
    rs.poll_once()
    assert lost == ["r0"] and not rs.replicas[0].health.healthy


def test_a_replica_out_of_routing_for_its_model_is_named_by_its_id_in_stats():
    """A replica that never served this orchestrator's model read "kvpool" in Stats'
    dependencies (and its log lines), not "kvpool/<its id>" as every other replica: which
    replica served the other model was said only by its address."""
    rs = ReplicaSet(addresses=(), internal_token="", model_id="m")
    rs.replicas.append(Replica("10.0.0.1:50054", Answering(replica_id="kvpool-3", model_id="m2"),
                               Health("kvpool", "10.0.0.1:50054"), replica_id="10.0.0.1:50054"))
    rs.poll_once()
    (line,) = [r.health.proto() for r in rs.replicas]
    assert (line.name, line.healthy) == ("kvpool/kvpool-3", False)
    assert line.last_error == "it serves model 'm2', this orchestrator 'm'"


def test_a_replica_restarted_under_another_id_is_reported_lost_by_the_id_it_had():
    """Routing recorded what it sent to a replica under its id; a restart that brings another
    id must forget the old one's records. The report named the new id, which had none, and
    the old id's records stayed until they aged out."""
    stub, rs, lost = _polled_replica_r0()
    stub.answer = kvpool_pb2.KvStatsResponse(replica_id="r1", incarnation="b", model_id="m")
    rs.poll_once()
    assert lost == ["r0"]
    assert rs.replicas[0].replica_id == "r1" and rs.replicas[0].health.healthy


def test_a_probe_the_hung_shard_answers_with_an_error_ends_the_skipping():
    """A shard that answers the probe, even with an error, is not hung: the calls after it
    reach the shard again instead of being skipped."""
    now = [100.0]
    stub = TimesOut()
    sb = backend_with(stub, now)
    req = semantic_pb2.LookupRequest()
    with pytest.raises(grpc.RpcError):
        sb.lookup(req)  # its whole timeout: hung
    now[0] += 0.6  # past the back-off: the next call probes

    def refuses(req, timeout=None, metadata=None):
        stub.calls.append(timeout)
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT)

    stub.Lookup = refuses
    with pytest.raises(grpc.RpcError) as probe:
        sb.lookup(req)
    assert probe.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as after:
        sb.lookup(req)
    assert after.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # asked, not skipped
    assert len(stub.calls) == 3


def test_an_unknown_entry_id_does_not_mark_the_semantic_tier_unhealthy():
    """NOT_FOUND for an id (a rating of an entry gone) is the request's answer, not a fault
    of the tier: its health line stays healthy."""
    class Unknown:
        def Verify(self, req, **kw):  # noqa: N802 - the gRPC method's name
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"id: {req.id} unknown")

    sb = backend_with(Unknown())
    sb.health.ok()
    sb.shard_health["s:1"].ok()
    with pytest.raises(grpc.RpcError) as e:
        sb.verify("e-1", True)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert sb.health.healthy and sb.shard_health["s:1"].healthy


def test_sharded_stats_add_counts_and_take_the_highest_percentile_and_floor():
    """Across shards the counts (hits by tier too) add up; a percentile, and the threshold
    floor requests are checked against, are the highest any shard says (not a sum, nor the
    last shard's)."""
    class Figures:
        def __init__(self, **f) -> None:
            self.f = f

        def Stats(self, req, **kw):  # noqa: N802 - the gRPC method's name
            return semantic_pb2.SemanticStatsResponse(**self.f)

    sb = SemanticBackend("127.0.0.1:1,127.0.0.1:2", "", 1.0)
    high, low = sb.addresses
    sb.stubs[high] = Figures(entries=2, hits_by_tier={"standard": 1}, lookup_p50_ms=5.0,
                             lookup_p99_ms=30.0, threshold_floor=0.9)
    sb.stubs[low] = Figures(entries=3, hits_by_tier={"standard": 4}, lookup_p50_ms=2.0,
                            lookup_p99_ms=10.0, threshold_floor=0.8)
    out = sb.stats()
    assert (out.entries, out.shards_answered, dict(out.hits_by_tier)) == (5, 2, {"standard": 5})
    assert (out.lookup_p50_ms, out.lookup_p99_ms) == pytest.approx((5.0, 30.0))
    assert out.threshold_floor == pytest.approx(0.9)
    assert sb.threshold_floor() == pytest.approx(0.9)


def test_sharded_stats_sum_every_count_field_of_the_message():
    """The sum is a list of field names: a uint64 field added to SemanticStatsResponse and
    left off it showed with one shard (its answer is copied) and read 0 with two, and no test
    failed. Every uint64 field is a count and is summed."""
    from google.protobuf.descriptor import FieldDescriptor

    counts = [f.name for f in semantic_pb2.SemanticStatsResponse.DESCRIPTOR.fields
              if f.type == FieldDescriptor.TYPE_UINT64 and not f.is_repeated]

    class Figures:
        def __init__(self, base: int) -> None:
            self.f = {n: base + i for i, n in enumerate(counts)}

        def Stats(self, req, **kw):  # noqa: N802 - the gRPC method's name
            return semantic_pb2.SemanticStatsResponse(**self.f)

    sb = SemanticBackend("127.0.0.1:1,127.0.0.1:2", "", 1.0)
    a, b = sb.addresses
    sb.stubs[a], sb.stubs[b] = Figures(1), Figures(100)
    out = sb.stats()
    assert counts and {n: getattr(out, n) for n in counts} == {
        n: 101 + 2 * i for i, n in enumerate(counts)}


def test_one_tenants_namespaces_spread_over_the_shards():
    """A namespace is tenant, model and context: one tenant's contexts are placed each on
    its own, so a busy tenant's traffic is not all on one shard."""
    sb = SemanticBackend("127.0.0.1:1,127.0.0.1:2", "", 1.0)
    placed = {sb.shard_for(semantic_pb2.Namespace(tenant="t", model_id="m",
                                                  context_hash=f"ctx-{i}"))
              for i in range(32)}
    assert placed == set(sb.addresses)


def test_an_entry_removed_by_a_later_shard_is_reported_removed():
    """Invalidate asks every shard and adds up what they removed: the entry lives on one of
    them, whichever it is, and the shards before it answering 0 do not make it "unknown"."""
    class Holds:
        def __init__(self, removed: int) -> None:
            self.removed = removed

        def Invalidate(self, req, **kw):  # noqa: N802 - the gRPC method's name
            return semantic_pb2.InvalidateResponse(removed=self.removed)

    sb = SemanticBackend("127.0.0.1:1,127.0.0.1:2", "", 1.0)
    first, second = sb.addresses
    sb.stubs[first], sb.stubs[second] = Holds(0), Holds(1)
    assert sb.invalidate("e-1").removed == 1


def test_the_in_flight_gauge_follows_each_call_begun_and_ended():
    """tiercache_orchestrator_replica_requests_in_flight counts our calls under way on each
    replica as they begin, not only once one ends."""

    def value():
        return sample_value("tiercache_orchestrator_replica_requests_in_flight",
                                         {"replica": "gauge-r0:1"})

    r = replica("gauge-r0:1", running=0, inflight=0)
    rs = replica_set(r)
    rs.begin(r)
    rs.begin(r)
    assert value() == 2.0
    rs.end(r)
    assert value() == 1.0


def test_a_replicas_health_line_is_named_by_the_id_its_stats_give():
    """Stats' dependency line for a replica says which one it is ("kvpool/<replica id>")
    once it has answered, not only its kind."""
    r = Replica("10.0.0.9:50054", Answering(replica_id="kvpool-3"),
                Health("kvpool", "10.0.0.9:50054"), replica_id="10.0.0.9:50054")
    replica_set(r).poll_once()
    line = r.health.proto()
    assert (line.name, line.address, line.healthy) == ("kvpool/kvpool-3", "10.0.0.9:50054",
                                                      True)


def test_only_timed_out_polls_in_a_row_mark_a_replica_hung():
    """An answered poll between timed-out ones starts the count again: two slow polls, an
    answer, then one more slow poll is not three in a row."""
    stub = Answering(replica_id="r0")
    slow = FailingStats(grpc.StatusCode.DEADLINE_EXCEEDED)
    r = Replica("r0", slow, Health("kvpool", "r0"), replica_id="r0")
    rs = replica_set(r)
    cancelled: list[int] = []
    rs.watch(r, lambda: cancelled.append(1))
    for s in (slow, slow, stub, slow):
        r.stub = s
        rs.poll_once()
    assert r.health.healthy and cancelled == []


def test_an_answer_refused_for_its_model_breaks_the_row_of_timed_out_polls():
    """`replica_hung_polls` counts missed polls in a row: a replica that answers between two
    timed-out polls, even with another model (held out of routing for that), missed none
    then; one more timed-out poll does not mark it hung and cancel its calls in flight."""
    slow = FailingStats(grpc.StatusCode.DEADLINE_EXCEEDED)
    r = Replica("r0", slow, Health("kvpool", "r0"), replica_id="r0")
    rs = ReplicaSet(addresses=(), internal_token="", model_id="m", hung_polls=2)
    rs.replicas.append(r)
    cancelled: list[int] = []
    rs.watch(r, lambda: cancelled.append(1))
    for stub in (slow, Answering(replica_id="r0", model_id="m2"), slow):
        r.stub = stub
        rs.poll_once()
    assert not r.health.healthy  # out of routing for its model
    assert cancelled == [] and r.downs == 0  # but not found hung


def test_two_answers_under_one_replica_id_applied_at_once_let_only_one_in(monkeypatch):
    """Answers are applied as they come, a late one on the asker's thread: two replicas left
    at one replica id, answering at the same moment, each passed the duplicate-id check
    before the other took the id, and both entered routing. Answers are applied one at a
    time."""
    from concurrent.futures import Future

    rs = ReplicaSet(addresses=(), internal_token="", model_id="m")
    reps = [Replica(f"a{i}", Answering(replica_id="kvpool-0", model_id="m"),
                    Health("kvpool", f"a{i}"), replica_id=f"a{i}") for i in range(2)]
    rs.replicas.extend(reps)
    both = threading.Barrier(2)
    real = rs._id_taken

    def checked_together(r, s):
        taken = real(r, s)
        try:
            both.wait(timeout=1.0)  # met only where two answers are applied at once
        except threading.BrokenBarrierError:
            pass
        return taken

    monkeypatch.setattr(rs, "_id_taken", checked_together)

    def answered(i: int) -> Future:
        f: Future = Future()
        f.set_result((reps[i].stub.answer, 0))
        return f

    threads = [threading.Thread(target=rs._apply, args=(i, 0, answered(i))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [r.health.healthy for r in reps].count(True) == 1
    assert len(rs.healthy()) == 1


def test_a_hung_replica_says_so_in_stats_not_how_its_cancelled_calls_ended():
    """A replica found hung keeps the poller's reason as its Stats line: the request the
    poller failed over (its call cancelled here) no longer replaced it with "Locally
    cancelled by application!", nor was the reason a bare "Deadline Exceeded"."""
    slow = FailingStats(grpc.StatusCode.DEADLINE_EXCEEDED)
    r = Replica("r0", slow, Health("kvpool", "r0"), replica_id="r0")
    rs = ReplicaSet(addresses=(), internal_token="", model_id="m", hung_polls=2)
    rs.replicas.append(r)
    r.health.ok()
    for _ in range(2):
        rs.poll_once()
    why = r.health.last_error
    assert why.startswith("hung: 2 Stats polls in a row unanswered within 2s"), why
    r.health.fail(RpcError(grpc.StatusCode.CANCELLED))  # the failed-over call
    assert r.health.proto().last_error == why and not r.health.healthy


def test_a_timed_out_semantic_tier_says_how_long_nobody_answered():
    """A SIGSTOPped semantic tier read "Deadline Exceeded" in Stats (and in the "is unhealthy"
    line): gRPC's words, naming neither whose deadline nor that the tier had not answered."""
    sb = backend_with(TimesOut(), [100.0])
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest())  # the tier's whole 2 s
    lines = {d.name: d for d in sb.dependencies()}
    assert not lines["semantic"].healthy
    assert lines["semantic"].last_error == "no answer within 2s (timed out)"


def test_a_rating_cancelled_by_its_caller_cancels_its_call_and_asks_no_further_shard():
    """Verify and Invalidate hand each shard's call to `on_call` (a Feedback cancels it when
    its client goes): the round ends there, with no later shard asked and nothing held
    against the shard."""
    class Future:
        def __init__(self) -> None:
            self.cancelled = False

        def cancel(self) -> bool:
            self.cancelled = True
            return True

        def result(self):
            assert self.cancelled
            raise grpc.FutureCancelledError()

    class Method:
        def __init__(self) -> None:
            self.sent: list[Future] = []

        def future(self, req, **kw):
            self.sent.append(Future())
            return self.sent[-1]

    for method in ("Invalidate", "Verify"):
        sb = SemanticBackend("127.0.0.1:1,127.0.0.1:2", "", 1.0)
        stubs = {a: SimpleNamespace(**{method: Method()}) for a in sb.addresses}
        sb.stubs.update(stubs)
        with pytest.raises(grpc.FutureCancelledError):
            if method == "Invalidate":
                sb.invalidate("e-1", on_call=lambda call: call.cancel())
            else:
                sb.verify("e-1", True, on_call=lambda call: call.cancel())
        first, second = sb.addresses
        assert [len(getattr(stubs[a], method).sent) for a in (first, second)] == [1, 0]
        assert (sb.health.last_error, sb.shard_health[first].last_error) == ("", "")


def test_a_tier_refusing_every_store_stays_unhealthy_while_its_lookups_answer():
    """A full disk refuses every Store (RESOURCE_EXHAUSTED) while Lookups still answer: each
    request's Lookup marked the tier healthy again, so the health gauge read 0 or 1 by the
    traffic mix (a dependency_healthy alert missed the incident) and the log had an
    "unhealthy" / "healthy again" pair per request. Only a Store that succeeds brings it back."""
    class FullDisk:
        full = True

        def Lookup(self, req, **kw):  # noqa: N802 - the gRPC method's name
            return semantic_pb2.LookupResponse()

        def Store(self, req, **kw):  # noqa: N802 - the gRPC method's name
            if self.full:
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "disk: the entry store is full")
            return semantic_pb2.StoreResponse()

    stub = FullDisk()
    sb = backend_with(stub)
    for _ in range(3):
        sb.lookup(semantic_pb2.LookupRequest())
        with pytest.raises(grpc.RpcError):
            sb.store(semantic_pb2.StoreRequest())
        sb.lookup(semantic_pb2.LookupRequest())
        line = sb.dependencies()[0]
        assert not line.healthy and "entry store is full" in line.last_error
        assert sample_value("tiercache_orchestrator_dependency_healthy",
                            {"dependency": "semantic", "address": "s:1"}) == 0.0
    stub.full = False
    sb.store(semantic_pb2.StoreRequest())
    assert sb.dependencies()[0].healthy


def test_replicas_serving_another_model_are_not_routed_to_even_as_a_last_resort():
    """With no replica healthy, routing tries every one (a network blip at start-up): but one
    that answered serving another model refuses every request, which was sent there anyway
    (an ERROR and a WARNING per request). It is left out, and `misfits` says why once every
    replica is such; a replica back on the right model is routable again."""
    rs = ReplicaSet(addresses=(), internal_token="", model_id="m")
    reps = [Replica(f"a{i}", Answering(replica_id=f"kvpool-{i}", model_id="m2"),
                    Health("kvpool", f"a{i}"), replica_id=f"a{i}") for i in range(2)]
    rs.replicas.extend(reps)
    reps[0].stub.answer = kvpool_pb2.KvStatsResponse(replica_id="kvpool-0", model_id="m",
                                                     max_context=100)
    rs.poll_once()
    assert rs.max_context() == 100
    reps[0].stub.answer = kvpool_pb2.KvStatsResponse(replica_id="kvpool-0", model_id="m2")
    rs.poll_once()  # restarted on another model: its old figures no longer count either
    assert rs.healthy() == [] and rs.views() == [] and rs.max_context() == 0
    why = rs.misfits()
    assert "kvpool-0: it serves model 'm2', this orchestrator 'm'" in why
    assert "kvpool-1: it serves model 'm2'" in why
    reps[1].stub.answer = kvpool_pb2.KvStatsResponse(replica_id="kvpool-1", model_id="m")
    rs.poll_once()
    assert [v.replica_id for v in rs.views()] == ["kvpool-1"] and rs.misfits() == ""
    # Gone (restarting): what it serves is no longer known, and it is a last resort again.
    reps[0].stub = FailingStats(grpc.StatusCode.UNAVAILABLE)
    reps[1].stub = FailingStats(grpc.StatusCode.UNAVAILABLE)
    rs.poll_once()
    assert rs.misfits() == "" and len(rs.views()) == 2


def test_a_new_reason_while_down_is_said_once(caplog):
    """A dependency that stays down for another reason (restarted on another internal token:
    refused connections, then UNAUTHENTICATED) says the new reason once; the log kept the
    first ("Connection refused") for the whole outage. A few per outage, each once."""
    import logging

    h = Health("kvpool", "r0")
    h.ok()
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.backends"):
        h.fail("connection refused", hold=True)
        h.fail("connection refused", hold=True)
        h.fail("authorization: missing or wrong internal credential", hold=True)
        h.fail("authorization: missing or wrong internal credential", hold=True)
        h.fail("connection refused", hold=True)
        for word in "abcdefghij":  # distinct words (reasons differing in figures are one)
            h.fail(f"reason {word}")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:2] == ["kvpool at r0 is unhealthy: connection refused",
                         "kvpool at r0 is still unhealthy, now: authorization: missing or "
                         "wrong internal credential"]
    assert len(lines) == 4  # bounded: two more reasons, then none
    h.ok()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.backends"):
        h.fail("connection refused")  # a new outage says its reason again
    assert [r.getMessage() for r in caplog.records] == [
        "kvpool at r0 is unhealthy: connection refused"]


def test_a_reason_that_only_counts_on_is_not_said_again(caplog):
    """A replica paused (SIGSTOP) for 30 s: every poll said "still unhealthy, now: hung: 4
    Stats polls ...", then 5, 6: the same reason, its count on, which used up the few new
    reasons said, so one that was new (a restart on another internal token) went unsaid."""
    import logging

    h = Health("kvpool", "r0")
    h.ok()
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.backends"):
        for n in range(3, 12):
            h.fail(f"hung: {n} Stats polls in a row unanswered within 2s "
                   "(replica_hung_polls 3)", hold=True)
        h.fail("authorization: missing or wrong internal credential", hold=True)
        h.fail("serves model 'SmolLM2-360M', not 'SmolLM2-135M'", hold=True)
        h.fail("serves model 'SmolLM2-1.7B', not 'SmolLM2-135M'", hold=True)  # words differ
    assert [r.getMessage() for r in caplog.records] == [
        "kvpool at r0 is unhealthy: hung: 3 Stats polls in a row unanswered within 2s "
        "(replica_hung_polls 3)",
        "kvpool at r0 is still unhealthy, now: authorization: missing or wrong internal "
        "credential",
        "kvpool at r0 is still unhealthy, now: serves model 'SmolLM2-360M', not 'SmolLM2-135M'",
        "kvpool at r0 is still unhealthy, now: serves model 'SmolLM2-1.7B', not 'SmolLM2-135M'"]
    assert h.last_error.startswith("serves model 'SmolLM2-1.7B'")  # Stats: the latest, in full


def test_readiness_waits_for_a_healthy_replica_on_the_orchestrators_model(caplog):
    """The orchestrator's /readyz (its readiness probe) is 503 naming why while no replica
    serving its model id is healthy, 200 once one is; /healthz (liveness) stays 200. It said
    ready with none, so a rolling update to a model id no replica served yet replaced every
    working orchestrator with ones that could only refuse."""
    import logging
    import urllib.error
    import urllib.request

    from services.common.bootstrap import HEALTH_PATH, READY_PATH, create_server

    stub, rs, _ = _polled_replica_r0()
    stub.answer = kvpool_pb2.KvStatsResponse(replica_id="r0", incarnation="a", model_id="m2")
    rs.poll_once()
    h = create_server(service="test", address="127.0.0.1:0", services=[], metrics_port=0)
    h.readiness = rs.unready
    h.set_serving()
    base = f"http://127.0.0.1:{h.metrics_port}"

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(base + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        with caplog.at_level(logging.INFO, logger="services.orchestrator.backends"):
            status, body = get(READY_PATH)
            assert status == 503, body
            assert body.startswith("NOT_READY: no healthy kvpool replica serves model 'm' ")
            assert "r0: it serves model 'm2', this orchestrator 'm'" in body
            assert get(HEALTH_PATH) == (200, "SERVING\n")
            stub.answer = kvpool_pb2.KvStatsResponse(replica_id="r0", incarnation="a",
                                                     model_id="m")
            rs.poll_once()
            assert get(READY_PATH) == (200, "READY\n")
        assert "not ready yet (/readyz): no healthy kvpool replica" in caplog.text
        assert "ready (/readyz): healthy kvpool replica(s) r0" in caplog.text
    finally:
        h.stop(0)


def test_readiness_probes_at_once_say_a_change_once(monkeypatch):
    """`unready` runs on each /readyz probe's thread (several at once: kubelet's, a
    port-forwarded curl). `_said_unready` was read and written without a lock: two probes
    both read "was ready" and both wrote the WARNING (or one's late write undid the
    other's, and the next change went unsaid). The second probe waits for the first."""
    from services.orchestrator import backends

    rs = ReplicaSet(addresses=(), internal_token="", model_id="m")
    rs._said_unready = False  # it was ready; now no replica is healthy
    inside, second = threading.Event(), threading.Event()
    release = threading.Event()
    said: list[str] = []

    def warning(msg, *args):
        said.append(msg % args)
        if len(said) == 1:
            inside.set()
            release.wait(10)
        else:
            second.set()

    monkeypatch.setattr(backends, "log", SimpleNamespace(warning=warning, info=warning))
    first = threading.Thread(target=rs.unready)
    first.start()
    assert inside.wait(10)
    other = threading.Thread(target=rs.unready)
    other.start()
    second.wait(1.0)  # without the lock the other probe says it again at once
    release.set()
    first.join(10)
    other.join(10)
    assert len(said) == 1 and said[0].startswith("not ready (/readyz) until a replica is back")


def test_a_dependency_never_healthy_yet_is_not_said_to_be_still_unhealthy(caplog):
    """On-call walk-through: an orchestrator started while its replicas loaded logged "kvpool
    at ... is still unhealthy, now: kvpool is loading its model" as its first word of them,
    a going-down no line had said. Its first reason is "not healthy yet"; a new one after it
    is "still unhealthy, now:"; once healthy, a failure is "unhealthy" as before."""
    import logging

    h = Health("kvpool", "r0")
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.backends"):
        h.fail("kvpool is loading its model; retry shortly")
        h.fail("kvpool is loading its model; retry shortly")
        h.fail("connection refused")
        h.ok()
        h.fail("connection refused")
    assert [r.getMessage() for r in caplog.records] == [
        "kvpool at r0 is not healthy yet: kvpool is loading its model; retry shortly",
        "kvpool at r0 is still unhealthy, now: connection refused",
        "kvpool at r0 is unhealthy: connection refused"]


def test_a_dependency_healthy_for_the_first_time_is_not_said_healthy_again(caplog):
    """After "not healthy yet", its first healthy poll said "is healthy again", a recovery
    from a health no line had said; after a going-down it is "again"."""
    import logging

    h = Health("kvpool", "r0")
    with caplog.at_level(logging.INFO, logger="services.orchestrator.backends"):
        h.fail("kvpool is loading its model; retry shortly")
        h.ok()
        h.fail("connection refused")
        h.ok()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "kvpool at r0 is healthy", "kvpool at r0 is healthy again"]


def test_a_replica_found_down_says_what_becomes_of_each_kind_of_call_on_it(caplog):
    """The down line counted a Warm's prefills among the requests "failing over", though
    they are cancelled (their results UNAVAILABLE), not sent elsewhere: each kind is said
    apart, and a replica with only requests on it says so as before."""
    import logging

    r = Replica("r0", None, Health("kvpool", "r0"), replica_id="r0")
    rs = replica_set(r)
    cut: list[str] = []
    watchers = [lambda: cut.append("g1"), lambda: cut.append("g2"), lambda: cut.append("w1")]
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.backends"):
        rs.watch(r, watchers[0])
        rs._notify_down(r)  # requests only: the line as it was
        rs.watch(r, watchers[1])
        rs.watch(r, watchers[2], kind="prefill")
        rs._notify_down(r)
        for fn in watchers[:2]:
            rs.unwatch(r, fn)
        rs._notify_down(r)  # a Warm's prefill only
        rs.unwatch(r, watchers[2])
        rs._notify_down(r)  # nothing in flight: no line
    assert [rec.getMessage() for rec in caplog.records] == [
        "replica r0 is down: failing over 1 in-flight request(s)",
        "replica r0 is down: failing over 2 in-flight request(s), cancelling 1 warm prefill(s)",
        "replica r0 is down: cancelling 1 warm prefill(s)"]
    assert sorted(cut) == ["g1", "g1", "g2", "w1", "w1"] and r.downs == 4
