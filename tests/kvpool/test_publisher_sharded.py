"""A replica publishing to a prefix index that runs as two shards (real servicers, real gRPC).

Each shard must learn exactly the chains it owns (by the first block's hash on the ring), every
shard must know the replica (Register/Heartbeat fan out), and the sharded client's Match must
find the replica's holdings whichever shard owns the prompt.
"""

from __future__ import annotations

import time
from functools import partial

import grpc
import pytest
from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

from services.common.bootstrap import create_server
from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient, PrefixIndexError
from services.kvpool.publisher import Publisher
from services.prefix.config import PrefixConfig
from services.prefix.server import PrefixServicer, build_index
from tests.kvpool.conftest import TINY_ID, TINY_VOCAB, generate
from tests.waits import wait_until

wait_for = partial(wait_until, timeout=15.0, every=0.05)  # a test may pass its own timeout


def start_shard(port: int = 0, lease_seconds: float = 1.0):
    """One prefix-index shard (real servicer and gRPC server): (index, server handle)."""
    index = build_index(PrefixConfig(block_size=4, lease_seconds=lease_seconds))
    h = create_server(service="prefix-shard", address=f"127.0.0.1:{port}",
                      services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server,
                                 PrefixServicer(index), "tiercache.v1.PrefixIndex")])
    h.set_serving()
    return index, h


def two_shards(lease_seconds: float = 1.0):
    """Two shards (`start_shard`): their server handles and their addresses."""
    (_, ha), (_, hb) = start_shard(lease_seconds=lease_seconds), start_shard(
        lease_seconds=lease_seconds)
    return ha, hb, [f"127.0.0.1:{ha.port}", f"127.0.0.1:{hb.port}"]


def start_publisher(eng, addrs: list[str]) -> Publisher:
    return Publisher(eng, address=",".join(addrs), replica_id="kv-0", incarnation="inc-1",
                     public_address="10.0.0.7:50054", model_id=TINY_ID,
                     heartbeat_seconds=0.2, publish_interval_seconds=0.02,
                     channel_factory=grpc.insecure_channel).start()


def test_publisher_feeds_every_shard_its_own_chains(make_engine) -> None:
    shards, handles = zip(*(start_shard(lease_seconds=5) for _ in range(2)), strict=True)
    addrs = [f"127.0.0.1:{h.port}" for h in handles]
    eng = make_engine(num_blocks=64, hash_key=None)  # the cluster key, as the index uses
    pub = start_publisher(eng, addrs)
    client = PrefixIndexClient(addrs, block_size=4, channel_factory=grpc.insecure_channel)
    hasher = BlockHasher(TINY_ID, 4)
    try:
        # Prompts until both shards own at least one (the ring decides; a few suffice).
        prompts: list[list[int]] = []
        owners: set[str] = set()
        for k in range(12):
            p = [100 + k] + list(range(1, 12))  # distinct first block, 3 full blocks
            prompts.append(p)
            owners.add(client.shard_for(hasher.hashes(p, "t")[0]))
            if len(owners) == 2 and len(prompts) >= 4:
                break
        assert owners == set(addrs), "the ring put every test prompt on one shard"
        for p in prompts:
            generate(eng, p, max_tokens=2, salt="t")

        def matched(p: list[int]) -> int:
            r = client.match(TINY_ID, token_ids=p, cache_salt="t")
            return max((m.matched_blocks for m in r.matches if m.replica_id == "kv-0"),
                       default=0)

        wait_for(lambda: all(matched(p) >= 2 for p in prompts))
        # Each shard holds only the chains whose first block it owns, and knows the replica.
        for addr, index in zip(addrs, shards, strict=True):
            stats = index.stats()
            mine = [p for p in prompts if client.shard_for(hasher.hashes(p, "t")[0]) == addr]
            theirs = [p for p in prompts if p not in mine]
            direct = prefix_pb2_grpc.PrefixIndexStub(grpc.insecure_channel(addr))
            for p, want in [(p, True) for p in mine] + [(p, False) for p in theirs]:
                r = direct.Match(prefix_pb2.MatchRequest(model_id=TINY_ID, token_ids=p,
                                                         cache_salt="t"), timeout=5)
                got = any(m.replica_id == "kv-0" and m.matched_blocks for m in r.matches)
                assert got == want, (addr, p[:2], want)
            assert "kv-0" in {r.replica_id for r in stats.replicas}
            index.check_integrity()
        # Evictions reach every shard: after a clear, nothing matches anywhere.
        eng.call(eng.pool.clear).result(5)
        wait_for(lambda: all(matched(p) == 0 for p in prompts))
    finally:
        client.close()
        pub.stop()
        for h in handles:
            h.stop(0)


def stop_all(client: PrefixIndexClient, pub: Publisher, *handles) -> None:
    client.close()
    pub.stop()
    for h in handles:
        h.stop(0)


def prompts_owned_by(client: PrefixIndexClient, addrs: list[str]) -> tuple[list[int], list[int]]:
    """A 3-block prompt whose chain each of the two shards owns (the ring decides)."""
    hasher = BlockHasher(TINY_ID, 4)
    owned: dict[str, list[int]] = {}
    for k in range(40):
        p = [60 + k] + list(range(1, 12))
        owned.setdefault(client.shard_for(hasher.hashes(p, "t")[0]), p)
        if len(owned) == 2:
            break
    return owned[addrs[0]], owned[addrs[1]]


def held(index, p: list[int]) -> int:
    """Blocks of `p` (salt "t") the shard says replica kv-0 holds; -1 if it lists none."""
    r = index.match(TINY_ID, "t", token_ids=p)
    return max((m.matched_blocks for m in r.matches if m.replica_id == "kv-0"), default=-1)


def test_one_shard_down_holds_back_neither_the_others_nor_itself_once_back(make_engine,
                                                                          monkeypatch) -> None:
    """Shard A goes away: B still learns every eviction and keeps the replica's lease (before,
    a failing heartbeat or publish to A stopped B's updates, then its heartbeats). A restarted
    on the same port learns the replica's holdings again."""
    # B's lease is 2 s against 0.2 s heartbeats: a stall of the loaded machine is no lapse.
    (ia, ha), (ib, hb) = start_shard(), start_shard(lease_seconds=2.0)
    addrs = [f"127.0.0.1:{ha.port}", f"127.0.0.1:{hb.port}"]
    eng = make_engine(num_blocks=64, hash_key=None)
    pub = start_publisher(eng, addrs)
    client = PrefixIndexClient(addrs, block_size=4, channel_factory=grpc.insecure_channel)
    pa, pb = prompts_owned_by(client, addrs)

    try:
        generate(eng, pa, max_tokens=2, salt="t")
        generate(eng, pb, max_tokens=2, salt="t")
        wait_for(lambda: held(ia, pa) >= 2 and held(ib, pb) >= 2)
        ha.stop(0)  # shard A goes away
        eng.call(eng.pool.clear).result(5)
        wait_for(lambda: held(ib, pb) == 0)  # B learns the eviction
        # ... although the same batch failed on A (marked lagging once both sends ended,
        # which may be just after B applied it)
        wait_for(lambda: addrs[0] in pub._lagging)
        # Enough events while A is down to overflow the backlog (which resyncs).
        monkeypatch.setattr("services.kvpool.publisher.MAX_BACKLOG", 3)
        for k in range(4):
            generate(eng, [100 + k] + list(range(1, 12)), max_tokens=2, salt="u")
        generate(eng, pb, max_tokens=2, salt="t")
        wait_for(lambda: held(ib, pb) >= 2)
        time.sleep(2.5)  # past B's lease: heartbeats still reach it
        assert "kv-0" in {r.replica_id for r in ib.stats().replicas}
        eng.call(eng.pool.clear).result(5)
        wait_for(lambda: held(ib, pb) == 0)
        ia2, ha2 = start_shard(ha.port)  # A restarts, empty, on the same address
        try:
            generate(eng, pa, max_tokens=2, salt="t")
            wait_for(lambda: held(ia2, pa) >= 2)
            ia2.check_integrity()
            ib.check_integrity()
        finally:
            ha2.stop(0)
    finally:
        stop_all(client, pub, hb)


def test_a_shard_down_for_long_does_not_slow_the_others(make_engine) -> None:
    """Checking the down shard went through the loop's shared backoff (doubling to 5 s): a
    chain owned by a healthy shard took ~5 s to reach it instead of ~0.2 s, and the replica
    read as disconnected (events_published_seq 0) while most shards took every batch."""
    (_, ha), (ib, hb) = start_shard(), start_shard(lease_seconds=5.0)
    addrs = [f"127.0.0.1:{ha.port}", f"127.0.0.1:{hb.port}"]
    eng = make_engine(num_blocks=64, hash_key=None)
    pub = start_publisher(eng, addrs)
    client = PrefixIndexClient(addrs, block_size=4, channel_factory=grpc.insecure_channel)
    hasher = BlockHasher(TINY_ID, 4)
    on_b = [p for k in range(12, TINY_VOCAB - 1)
            if client.shard_for(hasher.hashes(p := [k, 5] + list(range(1, 10)), "t")[0])
            == addrs[1]][:3]
    assert len(on_b) == 3
    try:
        generate(eng, on_b[0], max_tokens=2, salt="t")
        wait_for(lambda: held(ib, on_b[0]) >= 2)
        ha.stop(0)  # shard A goes away, for long
        eng.call(eng.pool.clear).result(5)
        wait_for(lambda: addrs[0] in pub._lagging)
        time.sleep(7.0)  # long enough for a shared backoff to have reached its 5 s
        for p in on_b[1:]:
            generate(eng, p, max_tokens=2, salt="t")
            t0 = time.monotonic()
            wait_for(lambda p=p: held(ib, p) >= 2)
            assert time.monotonic() - t0 < 2.0  # was ~5 s
        assert pub.connected  # B takes every batch: the index is reachable
    finally:
        stop_all(client, pub, hb)


@pytest.mark.parametrize("told_by", ["heartbeat", "publish"])
def test_a_restarted_shard_is_resynced_alone(make_engine, monkeypatch, told_by) -> None:
    """One shard forgetting the replica (a restart) made it register again everywhere and
    resend its whole view to every shard: N shards' worth of snapshot work for one restart,
    at every replica at once. The replica hears it from a heartbeat (known=false) or, under
    traffic, from a batch that went to that shard alone (NOT_FOUND)."""
    lease = 5.0 if told_by == "heartbeat" else 60.0  # heartbeats every 20 s: none in the test
    (ia, ha), (ib, hb) = start_shard(lease_seconds=lease), start_shard(lease_seconds=lease)
    addrs = [f"127.0.0.1:{ha.port}", f"127.0.0.1:{hb.port}"]
    eng = make_engine(num_blocks=64, hash_key=None)
    client = PrefixIndexClient(addrs, block_size=4, channel_factory=grpc.insecure_channel)
    pa, pb = prompts_owned_by(client, addrs)

    pub = Publisher(eng, address=",".join(addrs), replica_id="kv-0", incarnation="inc-1",
                    public_address="10.0.0.7:50054", model_id=TINY_ID,
                    heartbeat_seconds=0.2 if told_by == "heartbeat" else 60.0,
                    publish_interval_seconds=0.02,
                    channel_factory=grpc.insecure_channel).start()
    try:
        generate(eng, pa, max_tokens=2, salt="t")
        generate(eng, pb, max_tokens=2, salt="t")
        wait_for(lambda: held(ia, pa) >= 2 and held(ib, pb) >= 2)
        to_b: list[bool] = []
        publish = ib.publish
        monkeypatch.setattr(ib, "publish", lambda *a, **kw: (
            to_b.append(bool(kw.get("resync", a[4] if len(a) > 4 else False)))
            or publish(*a, **kw)))
        ha.stop(0)
        ia2, ha2 = start_shard(ha.port, lease_seconds=lease)  # A restarts, empty, same address
        try:
            if told_by == "publish":
                # A batch for A alone (a chain A owns): A answers NOT_FOUND.
                generate(eng, pa[:4] + [7] * 8, max_tokens=2, salt="t")
            wait_for(lambda: held(ia2, pa) >= 2)  # A learns the replica's holdings again
            time.sleep(0.5)
            assert True not in to_b  # B, which never forgot, got no resync
            assert held(ib, pb) >= 2
            for index in (ia2, ib):
                index.check_integrity()
        finally:
            ha2.stop(0)
    finally:
        stop_all(client, pub, hb)


def test_a_shard_whose_register_answer_was_lost_still_gets_the_snapshot(make_engine,
                                                                        monkeypatch) -> None:
    """A restarted shard that forgot the replica is registered with again; that Register is
    applied but its answer lost (a timeout). The next heartbeat finds the shard knowing the
    replica, with nothing held: it must still get the snapshot. It did not (the shards to
    register with were forgotten when the call failed): an idle replica's blocks were missing
    from that shard for good (only a later batch to it, finding a gap, brought a resync) while
    the publisher counted itself up to date. Found by test_publisher_differential.py."""
    (ia, ha), (ib, hb) = start_shard(lease_seconds=5.0), start_shard(lease_seconds=5.0)
    addrs = [f"127.0.0.1:{ha.port}", f"127.0.0.1:{hb.port}"]
    eng = make_engine(num_blocks=64, hash_key=None)
    client = PrefixIndexClient(addrs, block_size=4, channel_factory=grpc.insecure_channel)
    pa, pb = prompts_owned_by(client, addrs)
    pub = start_publisher(eng, addrs)
    register, lost = pub._client.register, []

    def losing_the_answer(*a, **kw):
        out = register(*a, **kw)
        if kw.get("only") and not lost:
            lost.append(set(kw["only"]))
            raise PrefixIndexError("Register", addrs[0], grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "Deadline Exceeded")
        return out

    try:
        generate(eng, pa, max_tokens=2, salt="t")
        generate(eng, pb, max_tokens=2, salt="t")
        wait_for(lambda: held(ia, pa) >= 2 and held(ib, pb) >= 2)
        monkeypatch.setattr(pub._client, "register", losing_the_answer)
        ha.stop(0)
        ia2, ha2 = start_shard(ha.port, lease_seconds=5.0)  # A restarts, empty, same address
        try:
            wait_for(lambda: lost == [{addrs[0]}], timeout=10.0)
            wait_for(lambda: held(ia2, pa) >= 2, timeout=10.0)  # A learns the holdings again
            assert held(ib, pb) >= 2
        finally:
            ha2.stop(0)
    finally:
        stop_all(client, pub, hb)


def test_a_lagging_shard_failing_again_is_retried_later_each_time_until_it_is_back(
        make_engine, monkeypatch) -> None:
    """A lagging shard's resync goes straight out the first time; each failure pushes the next
    try back (0.4 s, doubling, up to 5 s) and has it probed with a heartbeat first. Once a
    resync goes through, the count starts over: the next failure waits 0.4 s again, and the
    next try needs no probe."""
    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    eng = make_engine(num_blocks=8)
    pub = Publisher(eng, address="127.0.0.1:1,127.0.0.1:2", replica_id="kv-0",
                    incarnation="inc-1", public_address="x:1", model_id=TINY_ID,
                    channel_factory=grpc.insecure_channel)
    calls: list[str] = []
    down = [True]

    def resync(only=None):
        calls.append(f"resync {sorted(only)}")
        if down[0]:
            raise Down()

    def probe(only):
        calls.append(f"probe {sorted(only)}")
        return True

    monkeypatch.setattr(pub, "_resync", resync)
    monkeypatch.setattr(pub, "_probe", probe)
    pub._lagging = {"b"}
    try:
        def waits_out() -> tuple[float, float]:
            # The wait set, as bounds: the clock read inside lies between the two read here
            # (a stall of the host inside the call must not change the figure).
            t0 = time.monotonic()
            pub._catch_up_lagging()
            t1 = time.monotonic()
            return pub._lag_retry_at - t1, pub._lag_retry_at - t0

        for want in [0.4, 0.8, 1.6, 3.2, 5.0, 5.0]:
            low, high = waits_out()
            assert low - 1e-9 <= want <= high + 1e-9, (want, low, high)
        assert calls[:3] == ["resync ['b']", "probe ['b']", "resync ['b']"]
        down[0] = False
        pub._catch_up_lagging()
        assert pub._lag_failures == 0
        down[0] = True
        calls.clear()
        low, high = waits_out()
        assert calls == ["resync ['b']"] and low - 1e-9 <= 0.4 <= high + 1e-9
    finally:
        pub._client.close()


def test_batch_limits_are_the_smallest_any_registration_gave(make_engine) -> None:
    """Register's limits bound every batch, events at most MAX_BATCH whatever an index
    allows; a shard registered again alone (it forgot the replica) can only lower them, since
    batches fan out to every shard."""
    from services.common.prefix_client import RegisterOutcome
    from services.kvpool import publisher

    eng = make_engine(num_blocks=8)
    pub = Publisher(eng, address="127.0.0.1:1,127.0.0.1:2", replica_id="kv-0",
                    incarnation="inc-1", public_address="x:1", model_id=TINY_ID,
                    channel_factory=grpc.insecure_channel)
    answers = [RegisterOutcome(5.0, {"a": 1, "b": 1}, max_events=10_000, max_blocks=40),
               RegisterOutcome(5.0, {"b": 1}, max_events=7, max_blocks=100),
               RegisterOutcome(5.0, {"b": 1}, max_events=300, max_blocks=20)]
    pub._client.register = lambda *a, **kw: answers.pop(0)
    try:
        pub._register()
        assert (pub._max_events, pub._max_blocks) == (publisher.MAX_BATCH, 40)
        pub._register(only={"b"})
        assert (pub._max_events, pub._max_blocks) == (7, 40)
        pub._register(only={"b"})
        assert (pub._max_events, pub._max_blocks) == (7, 20)
    finally:
        pub._client.close()


def test_with_every_shard_lagging_batches_and_heartbeats_go_to_all(make_engine) -> None:
    """The shards not lagging get batches and heartbeats; when every shard lags, all are
    asked (None), as unsharded: asking none let every lease lapse."""
    eng = make_engine(num_blocks=8)
    pub = Publisher(eng, address="127.0.0.1:1,127.0.0.1:2", replica_id="kv-0",
                    incarnation="inc-1", public_address="x:1", model_id=TINY_ID,
                    channel_factory=grpc.insecure_channel)
    try:
        assert pub._healthy() is None
        pub._lagging = {"127.0.0.1:2"}
        assert pub._healthy() == {"127.0.0.1:1"}
        pub._lagging = {"127.0.0.1:1", "127.0.0.1:2"}
        assert pub._healthy() is None
    finally:
        pub._client.close()


def test_shards_that_forgot_the_replica_are_registered_again_alone_unless_all_did(
        make_engine, monkeypatch) -> None:
    """Some shards forgot the replica: it registers again on those alone; all of them did:
    it registers again everywhere (and resends its whole view), as unsharded."""
    eng = make_engine(num_blocks=8)
    addrs = ["127.0.0.1:1", "127.0.0.1:2"]
    pub = Publisher(eng, address=",".join(addrs), replica_id="kv-0", incarnation="inc-1",
                    public_address="x:1", model_id=TINY_ID, channel_factory=grpc.insecure_channel)
    calls: list = []
    monkeypatch.setattr(pub, "_register", lambda only=None: calls.append(only))
    pub.registered = True
    try:
        pub._rejoin({addrs[1]})
        assert calls == [{addrs[1]}] and pub.registered
        pub._rejoin(set(addrs))
        assert calls == [{addrs[1]}] and not pub.registered  # the loop registers everywhere
    finally:
        pub._client.close()
