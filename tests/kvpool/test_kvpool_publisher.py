"""The replica's publisher against an in-process fake PrefixIndex over real gRPC."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
from tiercache.v1 import common_pb2, prefix_pb2, prefix_pb2_grpc

from services.common.bootstrap import create_server
from services.kvpool.publisher import Publisher
from tests.kvpool.conftest import StatsEngine, generate
from tests.waits import wait_until


class FakeIndex(prefix_pb2_grpc.PrefixIndexServicer):
    """Just enough of the index: leases by incarnation, seq checking, holdings per replica."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.registers: list[prefix_pb2.RegisterRequest] = []
        self.heartbeats: list[prefix_pb2.HeartbeatRequest] = []
        self.batches: list[prefix_pb2.PublishEventsRequest] = []
        self.known: set[tuple[str, str]] = set()
        self.expected: dict[str, int] = {}
        self.holdings: set[bytes] = set()
        self.resync_answers = 0

    def Register(self, request, context):
        with self.lock:
            self.registers.append(request)
            self.known.add((request.replica_id, request.incarnation))
            self.expected[request.replica_id] = 1
            self.holdings = set()
        return prefix_pb2.RegisterResponse(lease_seconds=5, next_seq=1)

    def Heartbeat(self, request, context):
        with self.lock:
            self.heartbeats.append(request)
            known = (request.replica_id, request.incarnation) in self.known
        return prefix_pb2.HeartbeatResponse(known=known, lease_seconds=5)

    def PublishEvents(self, request, context):
        with self.lock:
            if (request.replica_id, request.incarnation) not in self.known:
                context.abort(grpc.StatusCode.NOT_FOUND, "replica_id: unknown; Register first")
            self.batches.append(request)
            exp = self.expected.get(request.replica_id, 1)
            if not request.resync and request.seq != exp:
                self.resync_answers += 1
                return prefix_pb2.PublishEventsResponse(
                    status=prefix_pb2.PUBLISH_STATUS_RESYNC, next_seq=exp)
            if request.resync:
                self.holdings = set()
            for ev in request.events:
                kind = ev.WhichOneof("event")
                if kind == "stored":
                    self.holdings.update(ev.stored.block_hashes)
                elif kind == "removed":
                    self.holdings.difference_update(ev.removed.block_hashes)
                else:
                    self.holdings.clear()
            self.expected[request.replica_id] = request.seq + 1
            return prefix_pb2.PublishEventsResponse(status=prefix_pb2.PUBLISH_STATUS_OK,
                                                    next_seq=request.seq + 1)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0,
             state: Callable[[], object] = lambda: "") -> None:
    """Poll `cond`; on timeout, fail with `state()` (what the thing waited on was doing)."""
    wait_until(cond, timeout, lambda: f"condition not reached in {timeout:.0f} s {state()}")


def publisher_state(pub: Publisher) -> str:
    return (f"(registered={pub.registered}, connected={pub.connected}, "
            f"last_seq={pub.last_seq}, thread alive={pub._thread.is_alive()})")


def fake_index_and_publisher(make_engine):
    """A FakeIndex behind a real gRPC server, and a started publisher of a 32-block engine."""
    index = FakeIndex()
    handle = create_server(service="prefix-fake", address="127.0.0.1:0",
                           services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, index,
                                      "tiercache.v1.PrefixIndex")])
    eng = make_engine(num_blocks=32)
    pub = Publisher(eng, address=f"127.0.0.1:{handle.port}", replica_id="kv-0",
                    incarnation="inc-1", public_address="10.0.0.7:50054", model_id="tiny-llama",
                    heartbeat_seconds=0.1, publish_interval_seconds=0.02,
                    channel_factory=grpc.insecure_channel).start()
    return index, handle, eng, pub


def test_register_publish_resync_and_reregister(make_engine, monkeypatch) -> None:
    from services.kvpool import publisher

    monkeypatch.setattr(publisher, "MAX_BATCH", 2)  # snapshots span several batches
    index, handle, eng, pub = fake_index_and_publisher(make_engine)

    def pool_hashes() -> set[bytes]:
        return eng.call(lambda: {eng.pool.block_hash(b) for b in range(eng.pool.num_blocks)
                                 if eng.pool.block_hash(b) is not None}).result(5)

    try:
        wait_for(lambda: index.registers and index.batches)
        reg = index.registers[0]
        assert (reg.replica_id, reg.incarnation, reg.address, reg.model_id, reg.block_size,
                reg.capacity_blocks) == ("kv-0", "inc-1", "10.0.0.7:50054", "tiny-llama", 4, 32)
        assert index.batches[0].resync and index.batches[0].seq == 1

        generate(eng, list(range(1, 18)), max_tokens=4)
        wait_for(lambda: index.holdings == pool_hashes() and len(index.holdings) == 5)
        seqs = [b.seq for b in index.batches]
        assert seqs == list(range(1, len(seqs) + 1)), "batches are numbered 1, 2, 3..."
        first = next(b for b in index.batches if not b.resync).events[0].stored
        assert first.parent_hash == b"" and first.start_block == 0
        assert first.first_block_hash == first.block_hashes[0]

        # The index lost track (a gap): it answers RESYNC and gets the full holdings.
        with index.lock:
            index.expected["kv-0"] += 3
        generate(eng, list(range(40, 52)), max_tokens=2)
        wait_for(lambda: index.resync_answers >= 1 and index.holdings == pool_hashes())
        assert pub.resyncs >= 2

        # The index restarted and forgot the replica: heartbeat says unknown -> register again.
        with index.lock:
            index.known.clear()
        wait_for(lambda: len(index.registers) >= 2 and index.holdings == pool_hashes())
        assert index.heartbeats[-1].load.total_blocks == 32

        # Evictions are published as removals.
        eng.call(eng.pool.clear).result(5)
        wait_for(lambda: index.holdings == set())
        # The publisher counts a batch as published once the index's answer is back, a moment
        # after the index applied it.
        wait_for(lambda: pub.last_seq == index.batches[-1].seq)
    finally:
        pub.stop()
        handle.stop(0)


def test_the_published_batch_number_reads_0_while_the_index_is_unreachable(make_engine,
                                                                           tiny_model):
    """Stats' events_published_seq is documented 0 while not connected; it kept the last
    number for good after the index went away (registered stayed True, retries logged)."""
    from services.kvpool.config import KvPoolConfig
    from services.kvpool.engine import model_info
    from services.kvpool.server import KvPoolServicer

    index, handle, eng, pub = fake_index_and_publisher(make_engine)
    servicer = KvPoolServicer(KvPoolConfig())
    servicer.attach(eng, model_info(tiny_model, "tiny-llama"), pub)
    try:
        # Registered and its first batch (the snapshot) sent before the request: on a loaded
        # host the publisher once registered after the request had run, its snapshot held
        # every block and no batch 2 ever came (CI: connected, last_seq=1 for 10 s).
        wait_for(lambda: index.registers and index.batches, state=lambda: publisher_state(pub))
        generate(eng, list(range(1, 18)), max_tokens=4)
        wait_for(lambda: pub.last_seq >= 2, state=lambda: publisher_state(pub))
        assert servicer.Stats(None, None).events_published_seq == pub.last_seq
        handle.stop(0)
        wait_for(lambda: servicer.Stats(None, None).events_published_seq == 0,
                 state=lambda: publisher_state(pub))
        assert pub.last_seq >= 2  # kept, for when the index is back
    finally:
        pub.stop(timeout=0.5)
        handle.stop(0)


def test_index_down_does_not_stop_serving(make_engine) -> None:
    eng = make_engine()
    pub = Publisher(eng, address="127.0.0.1:1", replica_id="kv-0", incarnation="i",
                    public_address="x:1", model_id="tiny-llama", heartbeat_seconds=0.1,
                    channel_factory=grpc.insecure_channel).start()
    try:
        toks, fin = generate(eng, [1, 2, 3, 4, 5, 6], max_tokens=3)
        assert len(toks) == 3 and not pub.registered
    finally:
        pub.stop()


def test_real_prefix_index_learns_what_the_replica_holds(make_engine) -> None:
    """Against the real PrefixIndex servicer: after a request, Match names this replica."""
    from services.prefix.config import PrefixConfig
    from services.prefix.server import PrefixServicer, build_index

    index = build_index(PrefixConfig(block_size=4, lease_seconds=5))
    handle = create_server(service="prefix-real", address="127.0.0.1:0",
                           services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server,
                                      PrefixServicer(index), "tiercache.v1.PrefixIndex")])
    eng = make_engine(num_blocks=32, hash_key=None)  # the cluster key, as the index uses
    pub = Publisher(eng, address=f"127.0.0.1:{handle.port}", replica_id="kv-0",
                    incarnation="inc-1", public_address="10.0.0.7:50054", model_id="tiny-llama",
                    heartbeat_seconds=0.1, publish_interval_seconds=0.02,
                    channel_factory=grpc.insecure_channel).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    stub = prefix_pb2_grpc.PrefixIndexStub(channel)

    def matched(tokens: list[int], salt: str = "") -> int:
        r = stub.Match(prefix_pb2.MatchRequest(model_id="tiny-llama", token_ids=tokens,
                                               cache_salt=salt), timeout=5)
        return max((m.matched_blocks for m in r.matches if m.replica_id == "kv-0"), default=0)

    try:
        prompt = list(range(1, 23))  # 5 full blocks of 4
        toks, _ = generate(eng, prompt, max_tokens=6, salt="tenant-a")
        # Prompt + fed-back generated tokens: 27 tokens of KV -> 6 full blocks.
        wait_for(lambda: matched(prompt + toks, "tenant-a") == 6)
        assert matched(prompt, "tenant-b") == 0  # another tenant's salt shares nothing
        eng.call(eng.pool.clear).result(5)
        wait_for(lambda: matched(prompt, "tenant-a") == 0)
    finally:
        channel.close()
        pub.stop()
        handle.stop(0)


def _real_index(**cfg):
    from services.prefix.config import PrefixConfig
    from services.prefix.server import PrefixServicer, build_index

    index = build_index(PrefixConfig(block_size=4, **cfg))
    handle = create_server(service="prefix-real", address="127.0.0.1:0",
                           services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server,
                                      PrefixServicer(index), "tiercache.v1.PrefixIndex")])
    return index, handle


def test_heartbeats_follow_an_index_lease_shorter_than_the_replicas_interval(make_engine):
    """Index lease 3 s, replica heartbeat 6 s: the replica must beat within the lease it was
    given, or the index drops it between beats and it re-registers and resyncs forever.
    (A lease of seconds: a stall of the loaded test machine must not pass for a lapse.)"""
    index, handle = _real_index(lease_seconds=3.0)
    eng = make_engine(num_blocks=32, hash_key=None)
    pub = Publisher(eng, address=f"127.0.0.1:{handle.port}", replica_id="kv-0",
                    incarnation="inc-1", public_address="10.0.0.7:50054", model_id="tiny-llama",
                    heartbeat_seconds=6.0, channel_factory=grpc.insecure_channel).start()
    try:
        # The first resync follows registration: wait for it to be counted.
        wait_for(lambda: pub.registered and index.replica_count == 1 and pub.resyncs >= 1)
        resyncs, missing = pub.resyncs, 0
        end = time.monotonic() + 7  # past two leases, short of one 6 s heartbeat
        while time.monotonic() < end:
            missing += index.stats().replicas == []
            time.sleep(0.1)
        assert missing == 0 and pub.resyncs == resyncs
    finally:
        pub.stop()
        handle.stop(0)


def test_a_shard_refusing_registration_is_an_error_not_a_partial_success(make_engine):
    """A shard that refuses Register (here: another block size) used to count as 'down for
    now': the publisher registered with the other shard, resynced it, was told NOT_FOUND by the
    refusing one, and started over every 0.2 s."""
    good_index, good = _real_index(lease_seconds=5.0)
    from services.prefix.config import PrefixConfig
    from services.prefix.server import PrefixServicer, build_index

    other = create_server(service="prefix-other", address="127.0.0.1:0", services=[(
        prefix_pb2_grpc.add_PrefixIndexServicer_to_server,
        PrefixServicer(build_index(PrefixConfig(block_size=8, lease_seconds=5.0))),
        "tiercache.v1.PrefixIndex")])
    eng = make_engine(num_blocks=32, hash_key=None)
    pub = Publisher(eng, address=f"127.0.0.1:{good.port},127.0.0.1:{other.port}",
                    replica_id="kv-0", incarnation="inc-1", public_address="10.0.0.7:50054",
                    model_id="tiny-llama", heartbeat_seconds=0.5,
                    channel_factory=grpc.insecure_channel).start()
    try:
        time.sleep(2.0)
        assert not pub.registered
        # Nothing was sent to the healthy shard (before: a full resync every 0.2 s).
        assert all(r.next_seq <= 1 for r in good_index._replicas.values())
    finally:
        pub.stop()
        good.stop(0)
        other.stop(0)


def test_the_publisher_survives_a_snapshot_the_engine_did_not_take_in_time(make_engine,
                                                                          monkeypatch) -> None:
    # engine.call(snapshot).result(timeout=60) raising TimeoutError (a step longer than a
    # minute) used to end the publisher thread: the index stayed stale for good.
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout

    index = FakeIndex()
    handle = create_server(service="prefix-fake", address="127.0.0.1:0",
                           services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, index,
                                      "tiercache.v1.PrefixIndex")])
    eng = make_engine(num_blocks=32)
    real_call = eng.call
    stalls = [1]

    def call(fn):
        if stalls and getattr(fn, "__name__", "") == "snapshot":
            stalls.pop()
            f: Future = Future()
            f.set_exception(FutureTimeout())
            return f
        return real_call(fn)

    monkeypatch.setattr(eng, "call", call)
    generate(eng, list(range(1, 18)), max_tokens=4)
    pub = Publisher(eng, address=f"127.0.0.1:{handle.port}", replica_id="kv-0",
                    incarnation="inc-1", public_address="10.0.0.7:50054", model_id="tiny-llama",
                    heartbeat_seconds=0.1, publish_interval_seconds=0.02,
                    channel_factory=grpc.insecure_channel).start()
    try:
        # resyncs counts once the batch is sent: the index may hold it a moment before.
        wait_for(lambda: not stalls and index.batches and len(index.holdings) == 5
                 and pub.resyncs >= 1)
        assert pub._thread.is_alive()
    finally:
        pub.stop()
        handle.stop(0)


def test_a_batch_a_shard_answered_resync_for_is_not_counted_as_accepted(make_engine) -> None:
    from services.common.prefix_client import PublishOutcome

    eng = make_engine()
    pub = Publisher(eng, address="127.0.0.1:1", replica_id="kv-0", incarnation="i",
                    public_address="x:1", model_id="tiny-llama",
                    channel_factory=grpc.insecure_channel)
    outcomes = [PublishOutcome(False, [], {"a": 4}, {}),
                PublishOutcome(True, ["a"], {"a": 5}, {})]
    pub._client.publish_events = lambda *a, **kw: outcomes.pop(0)
    pub._send([], resync=False)
    assert pub.last_seq == 4
    pub._send([], resync=False)
    assert pub.last_seq == 4  # batch 5 was not applied: the shard asked for a resync
    # Shards number their batches apart: the newest any of them accepted is shown.
    pub._client.publish_events = lambda *a, **kw: PublishOutcome(False, [], {"a": 9, "b": 2})
    pub._send([], resync=False)
    assert pub.last_seq == 9


def _recording_publisher(eng) -> tuple[Publisher, list[tuple[bool, int]]]:
    """A publisher whose index accepts every batch; records (resync, events) per batch."""
    from services.common.prefix_client import PublishOutcome

    pub = Publisher(eng, address="127.0.0.1:1", replica_id="kv-0", incarnation="i",
                    public_address="x:1", model_id="tiny-llama",
                    channel_factory=grpc.insecure_channel)
    sent: list[tuple[bool, int]] = []

    def publish_events(rid, inc, events, resync=False, only=None):
        sent.append((resync, len(events)))
        return PublishOutcome(False, [], {"a": len(sent)}, {})

    pub._client.publish_events = publish_events
    return pub, sent


def _stored(events) -> set[bytes]:
    from services.kvpool.block_pool import BlocksStored

    return {h for e in events if isinstance(e, BlocksStored) for h in e.block_hashes}


def test_a_snapshot_whose_caller_timed_out_takes_no_events(make_engine, monkeypatch) -> None:
    # The publisher gave up waiting for its snapshot (engine busy); the engine used to run the
    # abandoned snapshot later anyway, taking the pending events and handing them to nobody
    # (a healthy shard never heard of those blocks, with no gap to make it ask for a resync).
    import pytest

    from services.kvpool import publisher

    monkeypatch.setattr(publisher, "SNAPSHOT_TIMEOUT", 0.2)
    eng = make_engine(num_blocks=32)
    pub, _ = _recording_publisher(eng)
    generate(eng, list(range(1, 18)), max_tokens=1)
    eng.call(lambda: None).result(5)  # the step's events are in the engine's queue
    release = threading.Event()
    busy = eng.call(release.wait)  # a long engine step
    with pytest.raises(TimeoutError):
        pub._resync(only={"a"})
    release.set()
    busy.result(5)
    eng.call(lambda: None).result(5)  # the inbox is drained: the abandoned call had its turn
    pub._collect()
    assert len(_stored(pub._backlog)) == 4  # the next collect still delivers them


def test_a_snapshot_already_running_at_the_timeout_is_waited_for(make_engine,
                                                                 monkeypatch) -> None:
    from services.kvpool import publisher

    # The engine thread must start the snapshot within the timeout (or the call is cancelled
    # unstarted, another case): 0.5 s, not 0.1, for a loaded machine's thread wake-ups.
    monkeypatch.setattr(publisher, "SNAPSHOT_TIMEOUT", 0.5)
    eng = make_engine(num_blocks=32)
    pub, sent = _recording_publisher(eng)
    generate(eng, list(range(1, 18)), max_tokens=1)
    eng.call(lambda: None).result(5)
    real_holdings = eng.pool.holdings

    def slow_holdings():
        time.sleep(2.0)  # the snapshot is running when the caller's timeout passes
        return real_holdings()

    monkeypatch.setattr(eng.pool, "holdings", slow_holdings)
    pub._resync(only={"a"})  # before: TimeoutError, and the snapshot's events were lost
    assert pub.resyncs == 1 and sent == [(True, 4)]
    assert len(_stored(pub._backlog)) == 4  # replayed to the other shards


def test_take_events_hands_each_event_to_exactly_one_concurrent_taker(make_engine,
                                                                      monkeypatch) -> None:
    # The publisher thread and a snapshot on the engine thread both take events; a non-atomic
    # `while events: popleft()` raised IndexError in one of them, dropping what it had taken.
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    eng = make_engine()
    n, done = 100_000, threading.Event()
    got: list[list] = [[], []]
    errors: list[BaseException] = []

    def take(i: int) -> None:
        try:
            while not done.is_set():
                got[i].extend(eng.take_events())
            got[i].extend(eng.take_events())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    takers = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    try:
        for t in takers:
            t.start()
        for k in range(n):
            with eng._events_cv:
                eng._events.append(k)
        done.set()
        for t in takers:
            t.join(10)
    finally:
        sys.setswitchinterval(old)
    assert not errors
    assert sorted(got[0] + got[1]) == list(range(n))


def test_a_snapshot_larger_than_the_backlog_limit_is_delivered_once(monkeypatch) -> None:
    # A replica holding more blocks than MAX_BACKLOG (a GPU-sized pool): the snapshot's rest,
    # queued behind its first batch, counted as a backlog overflow, so every loop dropped it
    # and snapshotted the whole pool again, forever, and the index never learnt it all.
    from concurrent.futures import Future
    from types import SimpleNamespace

    from services.common.prefix_client import PublishOutcome, RegisterOutcome
    from services.kvpool import publisher
    from services.kvpool.block_pool import BlocksStored

    n = 60_000
    assert n > publisher.MAX_BACKLOG + publisher.MAX_BATCH
    holdings = [BlocksStored(None, [i.to_bytes(16, "big")], [0] * 4, "", i.to_bytes(16, "big"),
                             0) for i in range(n)]
    incoming: list = []

    class Pool:
        block_size = 4
        num_blocks = n
        hasher = SimpleNamespace(key=b"k", probe=lambda: b"")

        def holdings(self):
            return holdings

        def take_events(self):
            return []

    class FakeEngine:
        pool = Pool()

        def stats(self):
            return SimpleNamespace(blocks_total=n, running=0, waiting=0, blocks_free=0,
                                   blocks_cached=n)

        def take_events(self):
            out = list(incoming)
            incoming.clear()
            return out

        def call(self, fn):
            f: Future = Future()
            f.set_result(fn())
            return f

    got: list[bytes] = []
    resync_batches = []

    class Client:
        sharded = False
        shard_list = common_pb2.ShardList(shards=1, fingerprint="f")  # the one it sends

        def register(self, *a, **k):
            return RegisterOutcome(10.0, {"a": 1})

        def publish_events(self, rid, inc, events, resync=False, only=None):
            resync_batches.append(resync)
            got.extend(h for e in events for h in e.stored.block_hashes)
            return PublishOutcome(False, [], {"a": len(resync_batches)}, {})

        def close(self):
            pass

    pub = Publisher(FakeEngine(), address="127.0.0.1:1", replica_id="r", incarnation="i",
                    public_address="x", model_id="m", channel_factory=grpc.insecure_channel)
    pub._client = Client()

    def loop(times: int) -> None:  # Publisher._run's body, without the waits
        for _ in range(times):
            if not pub.registered:
                pub._register()
            if pub._need_resync:
                pub._resync()
            pub._collect()
            if pub._backlog:
                pub._publish()

    loop(5)
    assert pub.resyncs == 1 and not pub._need_resync and not pub._backlog
    assert pub._snapshot_left == 0  # the rest delivered counts down to nothing
    assert resync_batches.count(True) == 1
    assert len(got) == n and set(got) == {h.block_hashes[0] for h in holdings}
    # Incremental events past the limit still give up on the backlog and resync.
    pub._backlog = list(holdings[:10])
    pub._snapshot_left = 10
    incoming.extend(holdings[: publisher.MAX_BACKLOG + 1])
    pub._collect()
    assert pub._need_resync and not pub._backlog and pub._snapshot_left == 0
    # A full resync starts the count from its own rest only.
    pub._snapshot_left = 123
    pub._taken_blocks = publisher.MAX_BACKLOG_POOLS * n  # the count an outage can leave
    pub._resync()
    assert pub._snapshot_left == n - publisher.MAX_BATCH
    # ... and its block count from nothing: the blocks counted before the snapshot are in it.
    # Left as it was, the next two events overflowed the cap and dropped the snapshot's rest.
    incoming.extend(holdings[:2])
    pub._collect()
    assert not pub._need_resync
    assert len(pub._backlog) == n - publisher.MAX_BATCH + 2


def test_batches_fit_the_index_limits_an_event_too_big_is_split() -> None:
    from services.kvpool.block_pool import AllCleared, BlocksRemoved, BlocksStored
    from services.kvpool.publisher import next_batch

    h = [bytes([i]) * 16 for i in range(10)]
    chain = BlocksStored(None, h[:5], list(range(20)), "s", h[0], 0)
    gone = BlocksRemoved(h[5:8])
    batch, rest = next_batch([chain, gone, AllCleared()], max_events=8, max_blocks=3,
                             block_size=4)
    assert batch == [BlocksStored(None, h[:3], list(range(12)), "s", h[0], 0)]
    assert rest[0] == BlocksStored(h[2], h[3:5], list(range(12, 20)), "s", h[0], 3)
    batch, rest = next_batch(rest, max_events=8, max_blocks=3, block_size=4)
    assert batch == [rest_head := BlocksStored(h[2], h[3:5], list(range(12, 20)), "s", h[0], 3),
                     BlocksRemoved(h[5:6])] and rest_head.start_block == 3
    assert rest == [BlocksRemoved(h[6:8]), AllCleared()]
    batch, rest = next_batch(rest, max_events=1, max_blocks=3, block_size=4)
    assert (batch, rest) == ([BlocksRemoved(h[6:8])], [AllCleared()])


def _publisher_to(eng, handle) -> Publisher:
    """A started publisher of `eng`'s events to the index served by `handle`."""
    return Publisher(eng, address=f"127.0.0.1:{handle.port}", replica_id="kv-0",
                     incarnation="inc-1", public_address="10.0.0.7:50054", model_id="tiny-llama",
                     heartbeat_seconds=0.1, publish_interval_seconds=0.02,
                     channel_factory=grpc.insecure_channel).start()


def test_a_replica_publishes_to_an_index_with_small_batch_limits(make_engine) -> None:
    """The publisher sent up to 512 events per batch whatever the index took: an index set to
    take fewer refused every batch (RESOURCE_EXHAUSTED, retried as transient) and never
    learned this replica's blocks. Register now says the limits; batches are cut to them."""
    index, handle = _real_index(lease_seconds=5, max_events=2, max_blocks=3)
    eng = make_engine(num_blocks=64, hash_key=None)
    pub = _publisher_to(eng, handle)
    try:
        wait_for(lambda: pub.registered)
        prompts = [list(range(35 * i + 1, 35 * i + 31)) for i in range(3)]  # 7 blocks each
        for p in prompts:
            toks, fin = generate(eng, p, max_tokens=2)
            assert len(toks) == 2, fin
        want = [h for p in prompts for h in eng.pool.hasher.hashes(p)]
        wait_for(lambda: all(h in index.tree for h in want))
        assert pub.resyncs == 1  # the first one, at registration: no batch was refused
    finally:
        pub.stop()
        handle.stop(0)


def test_a_stopped_replica_withdraws_its_blocks_from_the_index(make_engine) -> None:
    """Match still named a stopped (SIGTERMed) replica's blocks until its lease lapsed."""
    index, handle = _real_index(lease_seconds=30)
    eng = make_engine(num_blocks=32, hash_key=None)
    pub = _publisher_to(eng, handle)
    try:
        prompt = list(range(1, 23))
        generate(eng, prompt, max_tokens=2)
        want = eng.pool.hasher.hashes(prompt)
        wait_for(lambda: all(h in index.tree for h in want))
        pub.stop()
        assert not any(h in index.tree for h in want)  # at once, not after 30 s
    finally:
        pub.stop()
        handle.stop(0)


def test_an_index_outage_costs_one_snapshot_not_one_per_retry(make_engine, monkeypatch) -> None:
    """Each retry of a failed resync took a new snapshot of the pool on the engine thread
    (~0.3 s per 100k blocks that every decoding answer waits for), every few seconds for as
    long as the index was down. Retries now heartbeat first and snapshot once it answers."""
    from services.common.prefix_client import PublishOutcome

    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "index down"

    eng = make_engine(num_blocks=32)
    generate(eng, list(range(1, 18)), max_tokens=4)
    snapshots: list[int] = []
    real_call = eng.call

    def call(fn):
        if getattr(fn, "__name__", "") == "snapshot":
            snapshots.append(1)
        return real_call(fn)

    monkeypatch.setattr(eng, "call", call)
    pub = Publisher(eng, address="127.0.0.1:1", replica_id="kv-0", incarnation="i",
                    public_address="x:1", model_id="tiny-llama", heartbeat_seconds=30,
                    channel_factory=grpc.insecure_channel)
    up = threading.Event()
    beats: list[int] = []
    sent: list[bool] = []

    def register(*a, **kw):
        return prefix_pb2.RegisterResponse(lease_seconds=90, next_seq=1)

    def heartbeat(*a, **kw):
        beats.append(1)
        if not up.is_set():
            raise Down()
        return {"a": prefix_pb2.HeartbeatResponse(known=True, lease_seconds=90)}

    def publish_events(rid, inc, events, resync=False, only=None):
        if not up.is_set():
            raise Down()
        sent.append(resync)
        return PublishOutcome(False, [], {"a": len(sent)}, {})

    monkeypatch.setattr(pub._client, "register", register)
    monkeypatch.setattr(pub._client, "heartbeat_shards", heartbeat)
    monkeypatch.setattr(pub._client, "publish_events", publish_events)
    pub.start()
    try:
        time.sleep(2.0)  # retries after 0.2, 0.4 and 0.8 s of backoff
        assert len(snapshots) == 1 and beats  # only the first attempt's; retries probed
        up.set()
        wait_for(lambda: pub.resyncs >= 1)
        assert len(snapshots) == 2 and sent[0] is True
    finally:
        pub.stop(timeout=5)


def test_a_backlog_is_bounded_by_the_blocks_it_describes_not_only_by_events() -> None:
    """While the index is unreachable, events pile up, each with its tokens (a 512-token
    prefill's event ~23 KB): 50,000 events could hold ~1 GB per replica. Past twice the pool's
    blocks, a snapshot is smaller than the backlog, so the backlog is dropped for a resync."""
    from types import SimpleNamespace

    from services.kvpool import publisher
    from services.kvpool.block_pool import BlocksStored

    incoming: list = []

    class FakeEngine:
        pool = SimpleNamespace(block_size=16, num_blocks=100,
                               hasher=SimpleNamespace(key=b"k", probe=lambda: b""))

        def take_events(self):
            out = list(incoming)
            incoming.clear()
            return out

    def stored(i: int, blocks: int) -> BlocksStored:
        hashes = [(i * 1000 + j).to_bytes(16, "big") for j in range(blocks)]
        return BlocksStored(None, hashes, [0] * 16 * blocks, "", hashes[0], 0)

    pub = Publisher(FakeEngine(), address="127.0.0.1:1", replica_id="r", incarnation="i",
                    public_address="x", model_id="m", channel_factory=grpc.insecure_channel)
    try:
        pub._need_resync = False
        # Blocks counted since the backlog was last empty: sent batches start the count over.
        for _ in range(3):
            incoming.extend(stored(i, 32) for i in range(5))  # 160 blocks each time
            pub._collect()
            assert len(pub._backlog) == 5 and not pub._need_resync
            pub._backlog.clear()  # published
        # Registered and in step, then the index goes away.
        incoming.extend(stored(i, 32) for i in range(6))  # 192 blocks: under 2 x 100
        pub._collect()
        assert len(pub._backlog) == 6 and not pub._need_resync
        incoming.append(stored(9, 8))  # 200: twice the pool, not beyond it
        pub._collect()
        assert len(pub._backlog) == 7 and not pub._need_resync
        incoming.append(stored(6, 32))  # 232 blocks in 8 events: far under MAX_BACKLOG
        pub._collect()
        assert 8 < publisher.MAX_BACKLOG
        assert pub._backlog == [] and pub._need_resync
    finally:
        pub._client.close()


def test_a_heartbeat_carries_the_replicas_load_and_paces_to_a_third_of_the_lease() -> None:
    """The load the index routes by: running and waiting as the engine counts them, free
    blocks counting cached ones (evictable), the pool's size; and a lease shorter than three
    heartbeat intervals sets the interval to a third of it (two beats may be lost)."""
    loads = []

    def heartbeat_shards(rid, inc, load, only=None, partial=None):
        loads.append(load)
        return {"a": prefix_pb2.HeartbeatResponse(known=True, lease_seconds=9.0)}

    engine = StatsEngine(running=2, waiting=5, blocks_free=7, blocks_cached=11)
    pub = Publisher(engine, address="127.0.0.1:1", replica_id="r", incarnation="i",
                    public_address="x", model_id="m", heartbeat_seconds=30.0,
                    channel_factory=grpc.insecure_channel)
    try:
        pub._client.heartbeat_shards = heartbeat_shards
        pub._heartbeat()
        assert loads == [prefix_pb2.ReplicaLoad(running=2, waiting=5, free_blocks=18,
                                                total_blocks=50)]
        assert pub.connected and pub._beat_every == 3.0
    finally:
        pub._client.close()


def test_a_batch_filled_to_its_block_limit_leaves_the_next_event_whole() -> None:
    """A batch whose events reach max_blocks exactly ends there: the next event goes whole
    into the next batch (split at 0 blocks, it became an empty event in this one and a chain
    continuing after its own last block in the next)."""
    from services.kvpool.block_pool import BlocksRemoved, BlocksStored
    from services.kvpool.publisher import next_batch

    h = [bytes([i]) * 16 for i in range(6)]
    full = BlocksStored(None, h[:3], list(range(12)), "s", h[0], 0)
    chain = BlocksStored(None, h[3:5], list(range(8)), "s", h[3], 0)
    gone = BlocksRemoved(h[5:6])
    for nxt in (chain, gone):
        batch, rest = next_batch([full, nxt], max_events=8, max_blocks=3, block_size=4)
        assert (batch, rest) == ([full], [nxt])


def test_a_full_resync_drops_the_backlog_its_snapshot_reflects(make_engine) -> None:
    """Events waiting when a full resync's snapshot is taken are in the snapshot already:
    replayed after it, a stale 'stored' told the index of a block the pool no longer held."""
    from services.kvpool.block_pool import BlocksStored

    eng = make_engine(num_blocks=32)
    pub, sent = _recording_publisher(eng)
    generate(eng, list(range(1, 18)), max_tokens=1)
    stale = BlocksStored(None, [b"\x01" * 16], [0] * 4, "", b"\x01" * 16, 0)
    pub._backlog = [stale]
    pub._resync()
    assert sent == [(True, 4)] and pub._backlog == [] and not pub._need_resync


def test_a_lagging_shards_snapshot_rest_is_queued_ahead_of_the_events_it_replays(
        make_engine) -> None:
    """The rest of a lagging shard's snapshot goes at the head of the backlog, where
    _snapshot_left counts it (exempt from MAX_BACKLOG), the events taken with it after."""
    eng = make_engine(num_blocks=32)
    pub, sent = _recording_publisher(eng)
    generate(eng, list(range(1, 18)), max_tokens=1)  # one chain of 4 blocks, not yet taken
    snapshot = eng.call(lambda: list(eng.pool.holdings())).result(5)
    pub._max_blocks = 1  # the snapshot's first batch carries 1 block, its rest the other 3
    pub._resync(only={"a"})
    assert sent == [(True, 1)] and pub._snapshot_left == len(snapshot) - 1
    assert pub._backlog[:pub._snapshot_left] == snapshot[1:]
    assert _stored(pub._backlog[pub._snapshot_left:]) == _stored(snapshot)  # replayed


def test_a_batch_answered_not_found_makes_the_replica_register_again(make_engine) -> None:
    """An index that forgot this replica (restarted, lease lapsed) answers its next batch
    NOT_FOUND: the replica registers again and resends its view, even while heartbeats (here
    an index that keeps saying known) would not tell it."""
    class Forgetful(FakeIndex):
        def Heartbeat(self, request, context):
            with self.lock:
                self.heartbeats.append(request)
            return prefix_pb2.HeartbeatResponse(known=True, lease_seconds=5)

    index = Forgetful()
    handle = create_server(service="prefix-fake", address="127.0.0.1:0",
                           services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, index,
                                      "tiercache.v1.PrefixIndex")])
    eng = make_engine(num_blocks=32)
    pub = _publisher_to(eng, handle)
    try:
        wait_for(lambda: index.registers and index.batches, state=lambda: publisher_state(pub))
        with index.lock:
            index.known.clear()
        generate(eng, list(range(1, 18)), max_tokens=4)
        wait_for(lambda: len(index.registers) >= 2 and len(index.holdings) == 5,
                 state=lambda: publisher_state(pub))
    finally:
        pub.stop()
        handle.stop(0)


def test_events_are_taken_from_the_engine_while_the_index_is_unreachable(make_engine) -> None:
    """With the index down the publisher never gets past registering, yet it keeps taking the
    engine's events into its own backlog (bounded, dropped for a resync past its limits):
    left in the engine, they piled up there without any bound."""
    eng = make_engine(num_blocks=32)
    pub = Publisher(eng, address="127.0.0.1:1", replica_id="kv-0", incarnation="i",
                    public_address="x:1", model_id="tiny-llama", heartbeat_seconds=0.1,
                    channel_factory=grpc.insecure_channel).start()
    try:
        generate(eng, list(range(1, 18)), max_tokens=2)
        wait_for(lambda: not eng._events and pub._backlog, state=lambda: publisher_state(pub))
        assert not pub.registered
    finally:
        pub.stop(timeout=0.5)
