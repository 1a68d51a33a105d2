"""Aging of the prefix index's hit counts (`hit_half_life_seconds`): a burst long ago used to
keep its prefix first in TopPrefixes (warmed everywhere) and ahead in shallow LFU pruning for
ever; and a lease that lapsed and came straight back lost the hits of what only it held."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.common.policy import HybridPolicy
from services.prefix.config import PrefixConfig
from services.prefix.index import Load
from services.prefix.server import build_index
from services.prefix.tree import BlockTree
from tests.waits import holds_within

from .conftest import BS, MODEL, make_index, matched, stored, sweep_for, toks

HOUR = 3600.0
OLD, NEW = toks(1, 2), toks(3, 4)  # two shallow chains (blocks start before token 8)


def reg(index, rid: str = "a", inc: str = "i1"):
    return index.register(rid, inc, f"addr-{rid}", MODEL, BS, 100)


def burst_then_steady(clock, hasher, **kw):
    """OLD matched 100 times at once, then NEW twice every 10 minutes for 6 hours, the
    sweeper turning after each (leases long: only the hits are under test)."""
    index = make_index(clock, lease_seconds=1e6, **kw)
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, OLD), stored(hasher, NEW)])
    for _ in range(100):
        matched(index, OLD)
    for _ in range(36):
        clock.t += 600
        matched(index, NEW)
        matched(index, NEW)
        index.sweep()
    return index


def top(index, **kw) -> list[tuple[list[int], int]]:
    return [(p.token_ids, p.hits) for p in index.top_prefixes(5, **kw)]


def test_a_burst_long_ago_no_longer_outranks_steady_use_in_top_prefixes(clock, hasher):
    index = burst_then_steady(clock, hasher, hit_half_life_seconds=HOUR)
    # OLD: 100 halved 6 times; NEW: 12 an hour, halved at each hour's end.
    assert top(index) == [(NEW, 11), (OLD, 1)]
    assert top(index, min_hits=2) == [(NEW, 11)]  # the floor applies to aged counts
    assert index.hit_halvings == 6
    index.check_integrity()


def test_a_burst_long_ago_is_pruned_before_steady_use_by_shallow_lfu(clock, hasher):
    index = burst_then_steady(clock, hasher, hit_half_life_seconds=HOUR,
                              policy=HybridPolicy(2 * BS), max_nodes=4, prune_to=0.75,
                              prune_step=10**9)
    # A fifth node: pruned back to 3, the new unhit leaf first, then the least hit one.
    index.publish("a", "i1", 2, [stored(hasher, toks(5))])
    assert index.stats().pruned_total == 2
    assert hasher.hashes(OLD)[-1] not in index.tree
    assert hasher.hashes(NEW)[-1] in index.tree
    assert matched(index, NEW) == {"a": 2}
    index.check_integrity()


def test_a_deep_leaf_whose_hits_decayed_to_zero_is_cold(clock, hasher):
    """Hit once long ago, a deep leaf is pruned first, before an older one still hit."""
    index = make_index(clock, policy=HybridPolicy(2 * BS), min_deep_hits=1, max_nodes=4,
                       prune_to=0.75, prune_step=10**9, hit_half_life_seconds=HOUR,
                       lease_seconds=1e6)
    reg(index)
    base = toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, base + toks(3))])
    index.publish("a", "i1", 2, [stored(hasher, base + toks(4), start=2)])
    y, x = hasher.hashes(base + toks(3))[-1], hasher.hashes(base + toks(4))[-1]
    matched(index, base + toks(3))
    matched(index, base + toks(3))  # Y: 2 hits, used before X
    matched(index, base + toks(4))  # X: 1 hit
    clock.t += HOUR
    assert index.sweep() == [] and index.hit_halvings == 1
    assert (index.tree.get(y).hits, index.tree.get(x).hits) == (1, 0)
    # Two out of five: the new unhit deep leaf and X (cold, older), not Y (LRU's first).
    index.publish("a", "i1", 3, [stored(hasher, base + toks(5), start=2)])
    assert y in index.tree and x not in index.tree
    index.check_integrity()


def test_decay_off_at_zero_keeps_every_hit(clock, hasher):
    index = burst_then_steady(clock, hasher, hit_half_life_seconds=0)
    assert top(index) == [(OLD, 100), (NEW, 72)]
    assert index.hit_halvings == 0 and index.age_hits(clock.t + 1e8) == 0


def test_a_late_sweeper_halves_once_per_half_life_passed_and_at_most_64_times(clock, hasher):
    index = make_index(clock, lease_seconds=1e6, hit_half_life_seconds=HOUR)
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, OLD)])
    for _ in range(64):
        matched(index, OLD)
    for _ in range(4):  # turns short of a half-life add up to one (no drift)
        clock.t += 0.3 * HOUR
        index.sweep()
    assert top(index) == [(OLD, 32)]
    clock.t += 2.9 * HOUR  # late (a pause): 3 more half-lives since the last halving
    index.sweep()
    assert top(index) == [(OLD, 4)] and index.hit_halvings == 4
    matched(index, OLD)
    clock.t += 1000 * HOUR
    assert index.age_hits() == 64
    assert top(index) == [] and index.tree.get(hasher.hashes(OLD)[-1]).hits == 0
    index.check_integrity()


def test_hits_a_resync_saved_age_like_the_rest(clock, hasher):
    """A snapshot spread over batches: the hits of blocks stored after a halving come back
    halved too, not as they were when saved."""
    index = make_index(clock, hit_half_life_seconds=4)
    reg(index)
    chain = toks(1, 2, 3, 4, 5, 6)
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    for _ in range(8):
        matched(index, chain)
    index.publish("a", "i1", 2, [stored(hasher, chain, end=2)], resync=True)
    clock.t += 4
    index.sweep()
    assert index.hit_halvings == 1
    index.publish("a", "i1", 3, [stored(hasher, chain, start=2)])
    assert top(index) == [(chain, 4)]
    index.check_integrity()


def test_a_lease_that_lapses_and_comes_straight_back_keeps_its_hits(clock, hasher):
    index = make_index(clock)
    reg(index)
    chain = toks(1, 2, 3)
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    for _ in range(5):
        matched(index, chain)
    clock.t += 11  # a's heartbeat is late: its lease lapsed
    assert not index.heartbeat("a", "i1", Load()).known
    assert top(index) == []
    seq = reg(index).next_seq  # the publisher registers again, then resyncs
    index.publish("a", "i1", seq, [stored(hasher, chain, end=1)], resync=True)
    index.publish("a", "i1", seq + 1, [stored(hasher, chain, start=1)])
    assert top(index) == [(chain, 5)]
    index.check_integrity()
    # Back only after a lease more, or as a new incarnation: a replica that held nothing.
    for late, inc in ((5, "i1"), (0, "i2")):
        assert sweep_for(index, clock, 5) == ["a"]  # the sweeper on time drops it
        sweep_for(index, clock, late)
        seq = reg(index, inc=inc).next_seq
        index.publish("a", inc, seq, [stored(hasher, chain)], resync=True)
        assert top(index) == []
        matched(index, chain)


def test_decay_hits_halves_every_node_in_place_and_the_tree_still_grows():
    tree = BlockTree(BS)
    root, h = b"r" * 16, [i.to_bytes(16, "little") for i in range(6)]
    tree.ensure_root(root, MODEL, "")
    tree.store(root, h[:3], list(range(3 * BS)), 0, 1)
    for _ in range(5):
        tree.match(h[:3], 7)
    tree.match(h[:2], 8)
    tree.decay_hits(1)
    assert [(b.hits, b.last, b.holders) for b in tree.blocks()] == [(0, 1, 1), (0, 8, 1),
                                                                   (2, 7, 1)]
    tree.store(h[2], h[3:], list(range(3 * BS)), 0, 9)  # the arrays grow after the view
    tree.check_integrity()
    tree.decay_hits(64)
    assert all(b.hits == 0 for b in tree.blocks())


def test_the_half_life_is_configured_and_refused_when_negative():
    assert PrefixConfig().hit_half_life_seconds == HOUR
    assert build_index(PrefixConfig()).hit_half_life_seconds == HOUR
    cfg = load_config(PrefixConfig, "prefix", [],
                      environ={"TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS": "0"})
    assert build_index(cfg).hit_half_life_seconds == 0
    with pytest.raises(ConfigError, match=r"^TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS: must be "
                                          r">= 0 \(0 = hit counts never decay\)"):
        load_config(PrefixConfig, "prefix", [],
                    environ={"TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS": "-1"})
    with pytest.raises(ConfigError, match=r"^--hit-half-life-seconds \(env "
                                          r"TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS\): "):
        load_config(PrefixConfig, "prefix", ["--hit-half-life-seconds", "-5"])
    for bad in ("soon", "inf"):
        with pytest.raises(ConfigError, match="TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS"):
            load_config(PrefixConfig, "prefix", [],
                        environ={"TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS": bad})
    # Shorter than a lease: halvings every sweep would drop every pruning run under way.
    with pytest.raises(ConfigError, match=r"^TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS: "
                                          r"hit_half_life_seconds \(2\) must be 0 \(off\) or "
                                          r"at least lease_seconds \(10\)"):
        load_config(PrefixConfig, "prefix", [],
                    environ={"TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS": "2"})
    # A lease raised past the default half-life: the lease is what the user set, and named.
    with pytest.raises(ConfigError, match=r"^TIERCACHE_PREFIX_LEASE_SECONDS: "
                                          r"hit_half_life_seconds \(3600\)"):
        load_config(PrefixConfig, "prefix", [],
                    environ={"TIERCACHE_PREFIX_LEASE_SECONDS": "7200"})
    assert load_config(PrefixConfig, "prefix", [], environ={
        "TIERCACHE_PREFIX_HIT_HALF_LIFE_SECONDS": "2",
        "TIERCACHE_PREFIX_LEASE_SECONDS": "2"}).hit_half_life_seconds == 2


def test_resyncs_again_and_again_keep_no_more_saved_hits_than_the_replica_can_hold(clock, hasher):
    # Each resync carried forward the hits an earlier one still had to give back, with a
    # fresh deadline: a replica resyncing again and again (a flapping publisher) piled up
    # the hits of every block it had ever evicted.
    index = make_index(clock, hit_half_life_seconds=HOUR)
    index.register("a", "i1", "addr-a", MODEL, BS, 4)  # holds 4 blocks at most
    seq = 1
    for i in range(10):
        chain = toks(100 + 2 * i, 101 + 2 * i)
        index.publish("a", "i1", seq, [stored(hasher, chain)])
        matched(index, chain)
        seq += 1
        # The replica evicted it and restates what it holds now: a block never seen again.
        index.publish("a", "i1", seq, [stored(hasher, toks(200 + i))], resync=True)
        seq += 1
        saved = index._replicas["a"].usage or {}
        assert len(saved) <= 4, (i, len(saved))
    index.check_integrity()


def test_the_sweeper_goes_on_after_a_sweep_fails(caplog):
    # The one thread that sweeps leases nobody calls about, ages the hits and ends the lapse
    # grace was ended for good by a single error.

    from services.prefix.server import serve

    cfg = PrefixConfig(address="127.0.0.1:0", metrics_port=-1, block_size=BS, lease_seconds=0.4)
    index = build_index(cfg)
    turns = []
    real = index.sweep

    def flaky(*a, **kw):
        turns.append(1)
        if len(turns) == 1:
            raise RuntimeError("a sweep that fails once")
        return real(*a, **kw)

    index.sweep = flaky
    svc = serve(cfg, index)
    try:
        holds_within(lambda: len(turns) >= 3, 10, 0.05)
    finally:
        svc.stop()
    assert len(turns) >= 3
    assert "prefix index sweep failed" in caplog.text


def test_shards_started_apart_halve_together_on_the_wall_clocks_half_lives(clock, hasher):
    # Each shard halved on its own start's clock: two shards of one sharded TopPrefixes were
    # up to one halving (2x) apart for the same traffic.
    wall = [7 * HOUR + 0.25 * HOUR]  # a quarter into a half-life of the Unix epoch's count
    first = make_index(clock, lease_seconds=1e6, hit_half_life_seconds=HOUR,
                       wall_clock=lambda: wall[0])
    clock.t += 0.5 * HOUR
    wall[0] += 0.5 * HOUR
    second = make_index(clock, lease_seconds=1e6, hit_half_life_seconds=HOUR,
                        wall_clock=lambda: wall[0])
    for index in (first, second):
        reg(index)
        index.publish("a", "i1", 1, [stored(hasher, OLD)])
        for _ in range(8):
            matched(index, OLD)
    clock.t += 0.2 * HOUR  # 0.95 into the half-life: neither halves
    assert first.age_hits() == 0 and second.age_hits() == 0
    clock.t += 0.1 * HOUR  # past the boundary: both halve, 0.75 h and 0.25 h after starting
    assert first.age_hits() == 1 and second.age_hits() == 1
    assert top(first) == top(second) == [(OLD, 4)]
    clock.t += HOUR
    assert first.age_hits() == 1 and second.age_hits() == 1
    # Without a wall clock (the library's default) a half-life counts from the start.
    alone = make_index(clock, hit_half_life_seconds=HOUR)
    clock.t += 0.99 * HOUR
    assert alone.age_hits() == 0
    clock.t += 0.02 * HOUR
    assert alone.age_hits() == 1


def test_the_service_aligns_its_halvings_with_the_wall_clock():
    import time

    index = build_index(PrefixConfig(hit_half_life_seconds=HOUR))
    started = time.monotonic() - index._decayed_at  # how far into the half-life it started
    off = (started - time.time()) % HOUR  # ~0, or ~HOUR read across a boundary
    assert min(off, HOUR - off) < 5.0
