"""Replica load as routing sees it: our in-flight count now plus other callers' share of the
last Stats poll (a poll is up to a second old; our own finished requests must not linger)."""

from tiercache.v1 import kvpool_pb2

from services.orchestrator.backends import Health, Replica, ReplicaSet
from services.orchestrator.routing import PrefixAwarePolicy
from tests.waits import holds_within


class StatsStub:
    """Answers Stats with a fixed running count; `during` runs inside the call."""

    def __init__(self, name: str, running: int, during=None) -> None:
        self.name, self.running, self.during = name, running, during

    def Stats(self, req, timeout=None, metadata=None):  # noqa: N802 (gRPC method name)
        if self.during:
            self.during()
        return kvpool_pb2.KvStatsResponse(replica_id=self.name, running=self.running)


def replica_set(*replicas: Replica) -> ReplicaSet:
    rs = ReplicaSet(addresses=(), internal_token="")
    rs.replicas.extend(replicas)
    return rs


def replica(name: str, running: int, inflight: int, during=None) -> Replica:
    return Replica(name, StatsStub(name, running, during), Health("kvpool", name), replica_id=name,
                   inflight=inflight)


def test_a_finished_request_of_ours_stops_counting_before_the_next_poll():
    r = replica("r0", running=2, inflight=2)
    rs = replica_set(r)
    rs.poll_once()
    assert r.load == 2
    rs.end(r)  # one of our two requests finished; the replica's figure still says 2
    assert r.load == 1


def test_other_callers_load_is_kept():
    r = replica("r0", running=5, inflight=1)
    rs = replica_set(r)
    rs.poll_once()
    assert r.load == 5
    rs.end(r)
    assert r.load == 4  # the 4 sequences that are not ours stay until the next poll
    rs.begin(r)
    rs.begin(r)
    assert r.load == 6


def test_requests_that_start_during_the_poll_are_not_counted_as_others():
    holder: list[Replica] = []
    r = replica("r0", running=2, inflight=1, during=lambda: setattr(holder[0], "inflight", 2))
    holder.append(r)
    rs = replica_set(r)
    rs.poll_once()
    assert r.inflight_at_poll == 2 and r.load == 2


def test_a_conversation_keeps_its_replica_after_its_turn_ends():
    """Turn 1 and another request ran on r0 at the last poll; turn 1 has finished and turn 2
    arrives while the other still runs. Counting the stale 2 put r0 over the bounded-load cap
    and sent turn 2 to r1, which holds nothing of the conversation."""
    r0, r1 = replica("r0", running=2, inflight=2), replica("r1", running=0, inflight=0)
    rs = replica_set(r0, r1)
    rs.poll_once()
    rs.end(r0)
    policy = PrefixAwarePolicy(epsilon=0.25, min_prefix_tokens=32)
    d = policy.choose(rs.views(), {"r0": 1040}, "session-1")
    assert (d.replica_id, d.route) == ("r0", "prefix")


class FailingStats:
    """Stats fails with `code` (a draining replica refuses calls; a hung one times out)."""

    def __init__(self, code) -> None:
        import grpc

        class Err(grpc.RpcError):
            def code(self_inner):
                return code

            def details(self_inner):
                return code.name

        self.err = Err()

    def Stats(self, req, timeout=None, metadata=None):  # noqa: N802 (gRPC method name)
        raise self.err


def test_a_draining_replica_is_avoided_but_its_streams_finish():
    import grpc

    r = Replica("r0", FailingStats(grpc.StatusCode.UNAVAILABLE), Health("kvpool", "r0"),
                replica_id="r0")
    rs = replica_set(r)
    r.health.ok()
    cancelled = []
    rs.watch(r, lambda: cancelled.append(1))
    rs.poll_once()
    assert not r.health.healthy  # no new requests are routed there
    assert cancelled == []  # the streams it is finishing are not cut off


def test_a_hung_replica_has_its_streams_failed_over_after_three_slow_polls():
    import grpc

    r = Replica("r0", FailingStats(grpc.StatusCode.DEADLINE_EXCEEDED), Health("kvpool", "r0"),
                replica_id="r0")
    rs = replica_set(r)
    r.health.ok()  # it answered before
    cancelled = []
    rs.watch(r, lambda: cancelled.append(1))
    rs.poll_once()
    rs.poll_once()
    assert r.health.healthy and cancelled == []  # slow is load, not death
    rs.poll_once()
    assert not r.health.healthy and cancelled == [1]


def test_stats_polls_wait_the_configured_timeout_and_hung_polls_sets_the_count():
    """A hung replica was found only after three polls of 5 s each (15-20 s), though Stats
    answers in milliseconds on a busy replica: the timeout and the count are now settings
    (2 s and 3 by default)."""
    import grpc

    asked: list[float] = []

    class Hung(FailingStats):
        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802 (gRPC method name)
            asked.append(timeout)
            raise self.err

    assert ReplicaSet(addresses=(), internal_token="").stats_timeout_s == 2.0
    r = Replica("r0", Hung(grpc.StatusCode.DEADLINE_EXCEEDED), Health("kvpool", "r0"),
                replica_id="r0")
    rs = ReplicaSet(addresses=(), internal_token="", stats_timeout_s=0.75, hung_polls=2)
    rs.replicas.append(r)
    r.health.ok()
    cancelled = []
    rs.watch(r, lambda: cancelled.append(1))
    rs.poll_once()
    assert r.health.healthy and cancelled == []
    rs.poll_once()
    assert not r.health.healthy and cancelled == [1]
    assert asked == [0.75, 0.75]


def test_refusals_between_timeouts_do_not_count_as_slow_polls():
    import grpc

    codes = iter([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE,
                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED])

    class Stub:
        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802 (gRPC method name)
            raise FailingStats(next(codes)).err

    r = Replica("r0", Stub(), Health("kvpool", "r0"), replica_id="r0")
    rs = replica_set(r)
    cancelled = []
    rs.watch(r, lambda: cancelled.append(1))
    for _ in range(6):
        rs.poll_once()
    assert cancelled == []  # never 3 timed-out polls in a row


def test_the_poller_reports_a_replica_lost_when_it_fails_or_restarts():
    import grpc

    class Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "connection refused"

    class Stub:
        def __init__(self) -> None:
            self.answer: object = kvpool_pb2.KvStatsResponse(replica_id="r0", incarnation="a")

        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    stub = Stub()
    rs = replica_set(Replica("r0", stub, Health("kvpool", "r0"), replica_id="r0"))
    lost: list[str] = []
    rs.on_lost.append(lost.append)
    rs.poll_once()
    rs.poll_once()
    assert lost == []  # healthy, same process
    stub.answer = kvpool_pb2.KvStatsResponse(replica_id="r0", incarnation="b")
    rs.poll_once()
    assert lost == ["r0"]  # restarted: its cache is gone
    stub.answer = Err()
    rs.poll_once()
    assert lost == ["r0", "r0"] and not rs.replicas[0].health.healthy


def test_routing_never_reads_a_load_from_two_polls():
    """The poller replaces the replica's figure and our share of it together; `load` read
    them one after the other without the lock, and could pair a new figure with an old share:
    a load of 10 where 5 was true, putting the replica that holds a prefix over the cap."""
    import sys
    import threading
    import time

    stub = StatsStub("r0", running=0)
    r = Replica("r0", stub, Health("kvpool", "r0"), replica_id="r0")
    rs = replica_set(r)
    stop = time.monotonic() + 2
    seen: set[float] = set()

    def traffic() -> None:
        while time.monotonic() < stop:
            stub.running = 0
            rs.poll_once()  # idle
            for _ in range(5):
                rs.begin(r)
            stub.running = 5
            rs.poll_once()  # the replica's 5 are ours
            for _ in range(5):
                rs.end(r)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # widen the window between the two reads
    try:
        t = threading.Thread(target=traffic)
        t.start()
        while t.is_alive():
            seen.add(r.load)  # what views() hands routing
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert max(seen) <= 5, sorted(seen)


def test_a_replica_serving_another_model_or_block_size_is_kept_out_of_routing():
    """The poller never compared them: a replica with another model stayed in routing and
    failed every request sent there (FAILED_PRECONDITION to the client); one with another
    block size would never match a prefix."""
    class Serving(StatsStub):
        def __init__(self, name, model_id, block_size):
            super().__init__(name, 0)
            self.model_id, self.block_size = model_id, block_size

        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            return kvpool_pb2.KvStatsResponse(replica_id=self.name, model_id=self.model_id,
                                              block_size=self.block_size)

    rs = ReplicaSet(addresses=(), internal_token="", model_id="m", block_size=16)
    good, other_model, other_block = (
        Replica(n, Serving(n, m, b), Health("kvpool", n), replica_id=n)
        for n, m, b in (("r0", "m", 16), ("r1", "m2", 16), ("r2", "m", 32)))
    rs.replicas.extend([good, other_model, other_block])
    rs.poll_once()
    assert [r.replica_id for r in rs.healthy()] == ["r0"]
    assert "serves model 'm2'" in other_model.health.last_error
    assert "block size is 32" in other_block.health.last_error
    other_model.stub.model_id = "m"  # redeployed with the right model: back in routing
    rs.poll_once()
    assert [r.replica_id for r in rs.healthy()] == ["r0", "r1"]


def test_two_addresses_answering_under_one_replica_id_route_to_the_first_only():
    """Two replicas left at the default id (kvpool-0) both looked healthy: one got every
    request, and the index swapped their holdings every heartbeat, without a word."""
    class Named(StatsStub):
        def __init__(self, name, rid):
            super().__init__(name, 0)
            self.rid = rid

        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            return kvpool_pb2.KvStatsResponse(replica_id=self.rid, model_id="m", block_size=16)

    rs = ReplicaSet(addresses=(), internal_token="", model_id="m", block_size=16)
    a, b = (Replica(addr, Named(addr, "kvpool-0"), Health("kvpool", addr))
            for addr in ("10.0.0.1:50054", "10.0.0.2:50054"))
    rs.replicas.extend([a, b])
    rs.poll_once()  # polled at once: whichever answer is applied first keeps the id
    rs.poll_once()  # asked again: it keeps it, and the other stays out
    (first,) = rs.healthy()
    other = b if first is a else a
    assert (f"replica id 'kvpool-0' is also answered by {first.address}"
            in other.health.last_error)
    assert "TIERCACHE_KVPOOL_REPLICA_ID" in other.health.last_error
    other.stub.rid = "kvpool-1"  # given its own id: back in routing
    rs.poll_once()
    assert rs.healthy() == [a, b] and other.replica_id == "kvpool-1"


def test_replicas_are_polled_at_once_so_a_slow_one_delays_no_other():
    """The poller asked one replica at a time with a 5 s timeout: each hung replica added 5 s
    to every cycle, and every other replica's load and health went stale meanwhile. Here the
    first replica answers only once the second's answer is applied: in turn, it never would."""
    import threading
    import time

    import grpc

    second_asked = threading.Event()
    rs = ReplicaSet(addresses=("first:1", "second:1"), internal_token="")

    class Slow(StatsStub):
        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            # Answers only once the second replica's answer has been applied: asked in turn,
            # or applied in list order, the first one would hang until its timeout.
            end = time.monotonic() + timeout
            while rs.replicas[1].stats is None:
                if time.monotonic() > end:
                    raise Hung()
                time.sleep(0.01)
            assert second_asked.is_set()
            return super().Stats(req, timeout, metadata)

    class Hung(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    try:
        rs.replicas[0].stub = Slow("first", running=1)
        rs.replicas[1].stub = StatsStub("second", running=2, during=second_asked.set)
        rs.poll_once()
        assert [r.replica_id for r in rs.replicas] == ["first", "second"]
        assert [r.stats.running for r in rs.replicas] == [1, 2]
        assert all(r.health.healthy and r.slow_polls == 0 for r in rs.replicas)
    finally:
        rs.stop()


def test_an_unexpected_error_polling_one_replica_does_not_stop_the_others():
    class Broken(StatsStub):
        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            raise ValueError("channel closed")

    rs = replica_set(Replica("bad", Broken("bad", 0), Health("kvpool", "bad"), replica_id="bad"),
                     replica("ok", running=3, inflight=0))
    rs.poll_once()
    assert rs.replicas[1].stats.running == 3


def test_a_stalled_engine_takes_its_replica_out_of_routing_until_it_turns_again():
    """A replica whose gRPC server answers while its engine is stuck read healthy (Stats was
    all the poller looked at): requests routed there waited to their deadline. Its Stats now
    say how long the engine has not finished a turn."""
    class Stalling(StatsStub):
        stalled = 0.0

        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            return kvpool_pb2.KvStatsResponse(replica_id=self.name, running=self.running,
                                              stalled_for_s=self.stalled)

    stub = Stalling("r0", running=1)
    r = Replica("r0", stub, Health("kvpool", "r0"), replica_id="r0")
    rs = replica_set(r)
    rs.stall_s = 30.0
    cancelled: list[int] = []
    lost: list[str] = []
    rs.watch(r, lambda: cancelled.append(1))
    rs.on_lost.append(lost.append)
    stub.stalled = 2.0  # a long step: still working
    rs.poll_once()
    assert r.health.healthy and cancelled == []
    stub.stalled = 45.0
    rs.poll_once()
    assert not r.health.healthy and r.health.held_down and "engine stalled" in r.health.last_error
    assert cancelled == [1] and lost == ["r0"]  # in-flight calls fail over
    assert rs.views()[0].replica_id == "r0"  # (the only replica: tried when none is healthy)
    stub.stalled = 0.3  # it turns again
    rs.poll_once()
    assert r.health.healthy and not r.health.held_down


def test_a_hung_replica_does_not_hold_up_the_poll_cycle():
    """poll_once waited for every replica's Stats; a hung one took its 5 s timeout, so every
    other replica's load and health were refreshed every ~6 s instead of every poll_s."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()

    class Hung(StatsStub):
        calls = 0

        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            Hung.calls += 1
            release.wait(10)
            return super().Stats(req, timeout, metadata)

    hung = Replica("h", Hung("h", 0), Health("kvpool", "h"), replica_id="h")
    fine = replica("f", running=3, inflight=0)
    rs = replica_set(hung, fine)
    rs._asker = ThreadPoolExecutor(max_workers=2)  # one per replica, as in service
    try:
        rs.poll_s = 0.2
        t0 = time.monotonic()
        rs.poll_once()
        assert time.monotonic() - t0 < 2.5 and fine.stats is not None and hung.stats is None
        fine.stats = None
        rs.poll_once()  # the hung one is still being asked: not asked again
        assert fine.stats is not None and Hung.calls == 1
        release.set()  # its answer lands later, and is applied then
        holds_within(lambda: hung.stats is not None, 5, 0.02)
        assert hung.stats is not None and hung.health.healthy
    finally:
        release.set()
        rs._asker.shutdown(wait=True)


def test_a_replica_is_asked_again_only_once_its_last_answer_is_applied():
    """A future is done before its callbacks run: the poller, seeing the previous ask done,
    asked again while the late answer was still being applied, so an older answer could be
    applied after a newer one."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    class Slow(StatsStub):
        calls = 0

        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            Slow.calls += 1
            time.sleep(1.3)  # later than the cycle waits (1 s): applied by a callback
            return super().Stats(req, timeout, metadata)

    r = Replica("s", Slow("s", 1), Health("kvpool", "s"), replica_id="s")
    rs = replica_set(r)
    rs._asker = ThreadPoolExecutor(max_workers=2)
    applying, release = threading.Event(), threading.Event()
    real = rs._apply_answer

    def held(*a):
        applying.set()
        release.wait(10)
        real(*a)

    rs._apply_answer = held
    try:
        rs.poll_once()  # returns after 1 s; the answer lands at 1.3 s and is being applied
        assert applying.wait(5)
        rs.poll_once()  # its answer is not applied yet: not asked again
        assert Slow.calls == 1
        release.set()
        holds_within(lambda: 0 not in rs._pending, 5, 0.02)
        assert r.stats is not None and 0 not in rs._pending
    finally:
        release.set()
        rs._asker.shutdown(wait=True)
