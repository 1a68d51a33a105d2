"""tiercache_prefix_replicas ("Live replicas known to the prefix index", docs/metrics.md), which
no test read: driven through the servicer's own methods (in process, a test clock) and read
from the Prometheus registry after each call, it must equal the replicas Stats lists (the
index's live replicas): a new one counts, a re-Register or a new incarnation of a known id does
not add one, a refused Register or an unknown replica's heartbeat changes nothing, and a
lapsed lease takes it off once a call (or the sweeper) has noticed it."""

from __future__ import annotations

import pytest
from tiercache.v1 import prefix_pb2

from services.common.errors import TierCacheError
from services.prefix.index import PrefixIndex
from services.prefix.server import PrefixServicer
from tests.clock import Clock
from tests.metric_sample import sample_value

BS = 16
LEASE = 10.0


def gauge() -> float | None:
    return sample_value("tiercache_prefix_replicas")


def register(s: PrefixServicer, rid: str, inc: str = "i", **kw) -> None:
    req = dict(replica_id=rid, incarnation=inc, address="127.0.0.1:7000", model_id="m",
               block_size=BS, capacity_blocks=64)
    req.update(kw)
    s.Register(prefix_pb2.RegisterRequest(**req), None)


def listed(s: PrefixServicer) -> int:
    return len(s.Stats(prefix_pb2.PrefixStatsRequest(), None).replicas)


def test_the_replicas_gauge_is_the_live_replicas_stats_lists():
    clock = Clock(100.0)
    s = PrefixServicer(PrefixIndex(BS, lease_seconds=LEASE, clock=clock))
    register(s, "r0")
    assert gauge() == 1
    register(s, "r1")
    assert gauge() == 2 == listed(s)
    register(s, "r0")  # a refresh of the same incarnation
    register(s, "r1", inc="j")  # r1 restarted: the same replica, its memory gone
    assert gauge() == 2 == listed(s)
    for bad in (dict(address="not an address"), dict(block_size=BS * 2), dict(model_id="")):
        with pytest.raises(TierCacheError):
            register(s, "r2", **bad)
    with pytest.raises(TierCacheError):  # a replaced incarnation may not come back
        register(s, "r1", inc="i")
    assert gauge() == 2
    r = s.Heartbeat(prefix_pb2.HeartbeatRequest(replica_id="r9", incarnation="i"), None)
    assert not r.known and gauge() == 2
    # r1's lease lapses while r0 keeps heartbeating: a Match drops r1 (the index no longer
    # lists it), and the gauge follows at once (it lagged until the next call that set it).
    clock.t += LEASE * 0.6
    s.Heartbeat(prefix_pb2.HeartbeatRequest(replica_id="r0", incarnation="i"), None)
    clock.t += LEASE * 0.6
    s.Match(prefix_pb2.MatchRequest(model_id="m", token_ids=list(range(BS))), None)
    assert len(s.index._replicas) == 1 and gauge() == 1
    s.Heartbeat(prefix_pb2.HeartbeatRequest(replica_id="r0", incarnation="i"), None)
    assert gauge() == 1 == listed(s)
    clock.t += LEASE * 1.1  # r0 lapses too: Stats drops it and says so
    assert listed(s) == 0 and gauge() == 0


def test_a_replica_back_from_a_lapse_that_resyncs_unasked_counts_no_resync():
    """tiercache_prefix_resyncs_total counts the resyncs the index asks for, as its help says:
    a replica stopped past its lease (SIGSTOP on the live stack) finds itself forgotten at its
    next heartbeat, registers and resyncs unasked, and the counter stays where it was (the
    help said "at its first batch back from a lapsed lease", read as every lapse counting);
    the lapse shows in tiercache_prefix_replicas instead."""
    from services.prefix import server

    assert "asked for" in server.RESYNCS._documentation  # noqa: SLF001
    clock = Clock(100.0)
    s = PrefixServicer(PrefixIndex(BS, lease_seconds=LEASE, clock=clock))
    register(s, "r0")
    before = sample_value("tiercache_prefix_resyncs_total")
    clock.t += LEASE * 1.5
    r = s.Heartbeat(prefix_pb2.HeartbeatRequest(replica_id="r0", incarnation="i"), None)
    assert not r.known and gauge() == 0
    register(s, "r0")
    out = s.PublishEvents(prefix_pb2.PublishEventsRequest(
        replica_id="r0", incarnation="i", seq=1, resync=True), None)
    assert out.status == prefix_pb2.PUBLISH_STATUS_OK and gauge() == 1
    assert sample_value("tiercache_prefix_resyncs_total") == before


def test_the_dropped_blocks_counter_is_stats_dropped_blocks_total():
    """Stats' dropped_blocks_total (stored blocks whose parent the replica does not hold) was
    the one counter of Stats with no metric: tiercache_prefix_dropped_blocks_total follows
    it, block for block, and a chain placed behind a held parent adds nothing."""
    from services.common.hashing import BlockHasher

    def dropped() -> float:
        return sample_value("tiercache_prefix_dropped_blocks_total") or 0.0

    s = PrefixServicer(PrefixIndex(BS, lease_seconds=LEASE, clock=Clock(100.0)))
    register(s, "r0")
    toks = list(range(5 * BS))
    hs = BlockHasher("m", BS).hashes(toks, "")

    def publish(seq: int, start: int, end: int) -> None:
        s.PublishEvents(prefix_pb2.PublishEventsRequest(
            replica_id="r0", incarnation="i", seq=seq, events=[prefix_pb2.KvEvent(
                stored=prefix_pb2.BlocksStored(
                    parent_hash=hs[start - 1] if start else b"", block_hashes=hs[start:end],
                    token_ids=toks[start * BS:end * BS], first_block_hash=hs[0],
                    start_block=start))]), None)

    before = dropped()
    publish(1, 3, 5)  # its parent, block 2, is not held: both blocks dropped
    stats = s.Stats(prefix_pb2.PrefixStatsRequest(), None)
    assert stats.dropped_blocks_total == 2 == dropped() - before
    publish(2, 0, 2)  # from the root: placed
    stats = s.Stats(prefix_pb2.PrefixStatsRequest(), None)
    assert stats.dropped_blocks_total == 2 == dropped() - before and stats.nodes == 2
