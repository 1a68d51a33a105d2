"""The block pool's rules at their edges: copy-on-write fallbacks, deduplication by tokens, pin
expiry and limits, clearing, exhaustion, recency and eviction order (pure logic).

Written for what a mutation audit found no test checking; each was seen failing on a hand-made
mutant of the rule it checks."""

from __future__ import annotations

import pytest

from services.common.hashing import BlockHasher
from services.common.policy import HybridPolicy
from services.kvpool.block_pool import BlockPool, BlocksRemoved, Flushed, PoolExhausted
from tests.clock import Clock
from tests.kvpool.test_kvpool_block_pool import BS, X, Y, make_pool, run_seq


def test_cow_fallback_reports_only_the_shared_blocks_as_cached() -> None:
    """When the copy-on-write source and its copy do not both fit, the source is given up and
    its block recomputed: cached_tokens must fall back to the whole shared blocks, or the
    engine skips computing tokens that sit in a fresh, unwritten block."""
    pool, _, _ = make_pool(n=2)
    run_seq(pool, "a", X[:8])  # blocks 0, 1: the pool is full of cache
    adm = pool.open("b", X[:8])  # full hit: would need block 1 + a copy of it (3 blocks)
    assert adm.copies == []
    assert adm.cached_tokens == 4  # only block 0 is reused; tokens 4..7 are recomputed
    assert pool.blocks_of("b") == [0, 1]
    assert pool.block_hash(1) is None  # block 1 was evicted and is a fresh block now
    pool.check_integrity()


def test_a_copy_on_write_source_counts_as_a_hit_for_lfu() -> None:
    """A full-prompt hit reuses the last block through a copy: it is a use of that block, and
    shallow blocks are evicted by fewest hits (LFU), not by age."""
    pool, clock, hasher = make_pool(n=8, shallow=8)
    clock.t = 1.0
    run_seq(pool, "a", X[:4])  # one shallow block
    clock.t = 2.0
    adm = pool.open("c", X[:4])  # full hit: block 0 is the COW source
    assert adm.copies and adm.copies[0][0] == 0
    pool.close("c")  # block 0 used at t=2: still older than Y's block
    clock.t = 3.0
    run_seq(pool, "b", Y[:4])  # a younger shallow block with no hits
    y = pool.match(Y[:4])[0]
    assert pool.eviction_order() == [y, 0]  # fewer hits first, although block 0 is older


def test_a_request_that_cannot_fit_evicts_nothing() -> None:
    """Blocks held by pins are not available: an allocation that cannot succeed must be
    refused before it evicts the cache it could not use anyway."""
    pool, clock, _ = make_pool(n=6)
    run_seq(pool, "x", X)  # blocks 0, 1, 2
    pins = pool.match(X)
    assert pool.pin(pins, ttl_seconds=100) == 3
    run_seq(pool, "y", Y)  # blocks 3, 4, unpinned; block 5 free
    assert pool.evictable_count() == 3
    with pytest.raises(PoolExhausted) as exc:
        pool.open("big", list(range(300, 320)))  # 5 blocks: only 3 could ever be freed
    assert exc.value.short == 2
    assert pool.match(Y) == [3, 4]  # y's cache is still there
    assert pool.evictions_total == 0
    pool.check_integrity()


def test_a_pin_ends_exactly_at_its_expiry() -> None:
    """A pin holds until now + ttl, not at that instant: counts and eviction agree on it."""
    pool, clock, _ = make_pool()
    clock.t = 1.0
    run_seq(pool, "x", X[:4])
    assert pool.pin([0], ttl_seconds=10) == 1
    clock.t = 11.0  # exactly the expiry
    assert not pool.is_pinned(0)
    assert pool.stats().pinned == 0
    assert pool.evictable_count() == 8
    assert pool.eviction_order() == [0]
    pool.check_integrity()


def test_commit_never_swaps_in_a_colliding_block_with_other_tokens() -> None:
    """commit() shares a block already in the table only when its tokens are the same: a hash
    collision must not point the sequence's table at another prompt's KV."""
    from tests.kvpool.test_contracts import CollidingHasher

    clock = Clock(1.0)
    pool = BlockPool(8, BS, CollidingHasher(), HybridPolicy(8), clock=clock)
    x = [1, 2, 3, 4, 5, 6, 7, 8]
    y = [9, 10, 11, 12, 13, 14, 15, 16]
    run_seq(pool, "x", x)
    xs = pool.match(x)
    assert len(xs) == 2
    pool.open("y", y + [0])
    own = pool.blocks_of("y")
    replaced = pool.commit("y", y + [0], len(y))
    assert replaced == []
    assert pool.blocks_of("y") == own  # still its own blocks, holding y's tokens
    assert not set(pool.blocks_of("y")[:2]) & set(xs)
    assert all(pool.ref_count(b) == 0 for b in xs)
    pool.check_integrity()
    pool.close("y")


def test_truncate_below_the_committed_blocks_keeps_them() -> None:
    """truncate() rolls back draft tokens only: committed blocks hold verified tokens and stay
    in the table, whatever length it is asked for."""
    pool, _, _ = make_pool()
    pool.open("a", X[:9])
    pool.commit("a", X[:9], 9)  # blocks 0, 1 committed; block 2 holds token 8
    committed = pool.blocks_of("a")[:2]
    pool.truncate("a", 3)
    assert pool.blocks_of("a") == committed
    assert all(pool.ref_count(b) == 1 for b in committed)
    pool.check_integrity()
    pool.close("a")
    assert pool.match(X[:8]) == committed


def test_max_pinned_holds_across_tenants() -> None:
    """max_pinned bounds the pins of every tenant together: with one tenant's pins at 3 of 4,
    another tenant gets the one block left, not two."""
    clock = Clock(1.0)
    pool = BlockPool(16, BS, BlockHasher("m", BS, key=b"k"), HybridPolicy(8), clock=clock,
                     max_pinned=4)  # per-salt limit defaults to 4 too: it does not bind here
    run_seq(pool, "ax", X, salt="a")
    run_seq(pool, "by", Y, salt="b")
    xs = pool.match(X, "a")
    ys = pool.match(Y, "b")
    assert pool.pin(xs, ttl_seconds=10) == 3
    assert pool.pin(ys, ttl_seconds=10) == 1
    assert [pool.is_pinned(b) for b in ys] == [True, False]
    assert pool.stats().pinned == 4
    with pytest.raises(PoolExhausted, match="limit of 4"):
        pool.pin(ys[1:], ttl_seconds=10)
    pool.check_integrity()


def test_release_pins_unpins_only_unreferenced_blocks_and_only_as_many_as_asked() -> None:
    """release_pins(n) frees room for an allocation: it unpins at most n blocks, deepest
    first, and never the pins of blocks a live sequence holds (unpinning those frees nothing
    now and loses their warm-up)."""
    pool, clock, _ = make_pool(n=16)
    run_seq(pool, "x", X)  # blocks 0, 1, 2
    run_seq(pool, "y", Y)  # blocks 3, 4
    xs, ys = pool.match(X), pool.match(Y)
    assert pool.pin(xs, ttl_seconds=10) == 3
    assert pool.pin(ys, ttl_seconds=10) == 2
    assert pool.release_pins(1) == 1
    assert [pool.is_pinned(b) for b in xs] == [True, True, False]  # the deepest went
    assert all(pool.is_pinned(b) for b in ys)
    pool.open("hold", Y + [1])  # references both of y's blocks
    assert pool.release_pins() == 2  # x's two: y's are in use
    assert all(pool.is_pinned(b) for b in ys)
    assert not any(pool.is_pinned(b) for b in xs)
    pool.check_integrity()
    pool.close("hold")


def test_an_allocation_evicts_only_the_blocks_it_is_short() -> None:
    pool, _, _ = make_pool(n=8)
    run_seq(pool, "x", X)  # 3 cached blocks, 5 free
    pool.open("big", list(range(300, 324)))  # 6 blocks: 5 free + 1 evicted
    assert pool.evictions_total == 1
    assert len(pool.match(X)) == 2  # only x's deepest block went
    pool.check_integrity()
    pool.close("big")


def test_clear_keeps_the_parents_of_a_pinned_block() -> None:
    """clear() drops what it can, children first; a chain whose tail is pinned keeps its
    whole chain (its parents have a child) and the call does not fail."""
    pool, _, hasher = make_pool()
    run_seq(pool, "x", X)  # blocks 0, 1, 2
    run_seq(pool, "y", Y)  # blocks 3, 4
    xs = pool.match(X)
    assert pool.pin(xs[2:], ttl_seconds=10) == 1
    pool.take_events()
    assert pool.clear() == 2  # y's two blocks
    assert pool.match(X) == xs and pool.match(Y) == []
    assert pool.take_events() == [BlocksRemoved([hasher.hashes(Y)[1], hasher.hashes(Y)[0]])]
    pool.check_integrity()


def test_parents_of_a_pinned_leaf_count_as_evictable_but_refusal_is_clean() -> None:
    """evictable_count() counts unpinned parents that leaves-first eviction cannot free while
    their pinned child stays: the allocation must be refused with PoolExhausted (which the
    engine handles), not fail on an empty free queue."""
    pool, _, _ = make_pool(n=3)
    run_seq(pool, "x", X)  # blocks 0, 1, 2: the pool is full
    xs = pool.match(X)
    assert pool.pin(xs[2:], ttl_seconds=10) == 1
    assert pool.evictable_count() == 2
    with pytest.raises(PoolExhausted) as exc:
        pool.open("a", list(range(300, 308)))
    assert exc.value.short == 2
    assert not pool.has("a")
    assert pool.match(X) == xs
    pool.check_integrity()


def test_a_reused_block_id_starts_with_no_hits() -> None:
    """Hits belong to a block's contents: a block evicted and reused for another prompt must
    not carry the old prompt's hits into the LFU ranking."""
    pool, clock, _ = make_pool(n=4, shallow=8)
    clock.t = 1.0
    run_seq(pool, "a", X[:4])  # block 0
    for i in range(2):  # two full hits: block 0 is the COW source twice (2 hits)
        pool.open(f"a{i}", X[:4])
        pool.close(f"a{i}")
    assert pool.evict(1) == [0]
    C, D, E = [300, 301, 302, 303, 304, 305, 306, 307], [400, 401, 402, 403], [500, 501, 502, 503]
    clock.t = 3.0
    run_seq(pool, "c", C)
    clock.t = 4.0
    run_seq(pool, "d", D)
    clock.t = 4.5
    pool.open("d2", D + [99])  # one hit for d's block
    pool.close("d2")
    clock.t = 5.0
    run_seq(pool, "e", E)
    c, d, e = pool.match(C)[1], pool.match(D)[0], pool.match(E)[0]
    assert e == 0  # e's block is the one a's prompt had
    # Shallow LFU: c and e have no hits (c is older), d has one.
    assert pool.eviction_order() == [c, e, d]
    pool.check_integrity()


def test_deep_lru_counts_a_block_used_until_its_sequence_closes() -> None:
    """Deep blocks go least recently used first, and a block is in use until its sequence
    releases it: a chain held open until t=10 is more recent than one released at t=5."""
    pool, clock, _ = make_pool(shallow=0)  # every block deep: plain LRU over leaves
    clock.t = 1.0
    pool.open("long", X[:4])
    pool.commit("long", X[:4], 4)
    clock.t = 5.0
    run_seq(pool, "short", Y[:4])
    clock.t = 10.0
    pool.close("long")
    (x0,), (y0,) = pool.match(X[:4]), pool.match(Y[:4])
    assert pool.eviction_order() == [y0, x0]
    assert pool.evict(1) == [y0]


def test_a_deep_leaf_goes_before_a_shallow_one_whatever_its_hits() -> None:
    """The hybrid policy evicts every deep block before any shallow one (shallow blocks are
    the shared bases): a much-reused deep leaf still goes before an unused shallow leaf."""
    pool, clock, _ = make_pool(shallow=8)
    clock.t = 1.0
    run_seq(pool, "x", X)  # block 2 starts at token 8: deep
    for i in range(2):
        clock.t = 2.0 + i
        adm = pool.open(f"x{i}", X + [99])
        assert adm.cached_tokens == 12
        pool.close(f"x{i}")
    clock.t = 5.0
    run_seq(pool, "y", Y[:4])  # shallow, never reused
    x2, (y0,) = pool.match(X)[2], pool.match(Y[:4])
    assert pool.eviction_order() == [x2, y0]


def test_a_colliding_block_with_the_same_tokens_after_another_prefix_is_not_shared() -> None:
    """Tokens are verified on every hash hit so that a collision cannot hand a prompt another
    prompt's KV; a block's KV depends on every token before it, so a block that holds the same
    tokens after another prefix is not the same block. commit() shared it (its own tokens
    matched) and the sequence would have attended to KV computed after the other prefix."""
    from tests.kvpool.test_contracts import CollidingHasher

    pool = BlockPool(8, BS, CollidingHasher(), HybridPolicy(0), clock=Clock(1.0))
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    run_seq(pool, "x", a + b)
    xs = pool.match(a + b)
    pool.open("y", c + b + [0])
    own = pool.blocks_of("y")
    assert pool.commit("y", c + b + [0], 2 * BS) == []
    assert pool.blocks_of("y") == own  # b after c is y's own block, not x's b after a
    assert pool.ref_count(xs[1]) == 0
    pool.check_integrity()
    pool.close("y")


def test_match_follows_one_chain_under_a_hash_collision() -> None:
    """match() verified each hit's tokens but not that it continues the block matched before
    it: with a's successor evicted and e committed after c (colliding with a, so c's block
    stays out of the table), a prompt a + e matched a's block and then e's block computed
    after c."""
    from tests.kvpool.test_contracts import CollidingHasher

    pool = BlockPool(8, BS, CollidingHasher(), HybridPolicy(0), clock=Clock(1.0))
    a, b, c, e = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    run_seq(pool, "p", a + b)
    (pa, pb) = pool.match(a + b)
    assert pool.evict(1) == [pb]
    run_seq(pool, "r", c + e)  # c collides with a: stays out of the table; e enters it
    assert pool.match(a + e) == [pa]
    adm = pool.open("q", a + e + [0])
    assert adm.cached_tokens == BS and pool.blocks_of("q")[0] == pa
    pool.check_integrity()
    pool.close("q")


def test_a_colliding_first_block_of_another_tenant_is_neither_matched_nor_shared() -> None:
    """Tenants never share KV (their salts seed the hash chain): under a hash collision, the
    same tokens as another tenant's first block are not a hit, and a commit does not swap that
    block in for the sequence's own."""
    from tests.kvpool.test_contracts import CollidingHasher

    clock = Clock(1.0)
    pool = BlockPool(8, BS, CollidingHasher(), HybridPolicy(8), clock=clock)
    x = [1, 2, 3, 4, 5, 6, 7, 8]
    run_seq(pool, "a", x, salt="a")
    xs = pool.match(x, "a")
    assert len(xs) == 2
    assert pool.match(x, "b") == []
    adm = pool.open("b", x + [0], "b")
    assert adm.cached_tokens == 0
    own = pool.blocks_of("b")
    assert pool.commit("b", x + [0], len(x)) == []
    assert pool.blocks_of("b") == own and not set(own) & set(xs)
    pool.check_integrity()
    pool.close("b")
    pool.check_integrity()
    assert pool.match(x, "a") == xs and pool.match(x, "b") == []


def test_a_copy_on_write_source_counts_as_a_use_for_deep_lru() -> None:
    """A full-prompt hit uses its last block through a copy: that is a use for LRU as it is a
    hit for LFU, or the block of a prompt asked again just now goes before older chains."""
    pool, clock, _ = make_pool(shallow=0)  # every block deep: plain LRU over leaves
    clock.t = 1.0
    run_seq(pool, "x", X)
    clock.t = 2.0
    run_seq(pool, "y", Y)
    clock.t = 3.0
    adm = pool.open("x again", X)  # full hit: X's last block is the copy-on-write source
    x2 = pool.match(X)[2]
    assert adm.copies and adm.copies[0][0] == x2
    pool.close("x again")
    pool.check_integrity()
    y1 = pool.match(Y)[1]
    assert pool.eviction_order()[:2] == [y1, x2]


def test_shallow_hits_age_so_a_base_hot_long_ago_goes_before_one_hot_now() -> None:
    """Shallow blocks ranked by hits alone (LFU) never aged: a system prompt reused 20 times
    yesterday outranked, for good, one reused 3 times in the last minute, which was evicted
    (its hits reset) again and again. The replica's policy halves hits per half-life since
    their last use; at equal age the counts still decide."""
    from services.common.policy import POOL_HIT_HALF_LIFE_S, make_policy

    H = POOL_HIT_HALF_LIFE_S
    clock = Clock(1.0)
    pool = BlockPool(8, BS, BlockHasher("m", BS, key=b"k"),
                     make_policy("hybrid", 8, half_life=H), clock=clock)
    old, new = X[:4], Y[:4]
    run_seq(pool, "old", old)
    for i in range(20):  # 20 hits, a day ago
        pool.open(f"o{i}", old + [99])
        pool.close(f"o{i}")
    clock.t = 1.0 + 24 * H
    run_seq(pool, "new", new)
    for i in range(3):  # 3 hits, now
        pool.open(f"n{i}", new + [99])
        pool.close(f"n{i}")
    (o0,), (n0,) = pool.match(old), pool.match(new)
    assert pool.eviction_order() == [o0, n0]
    assert pool.evict(1) == [o0]
    pool.check_integrity()
    # Within a half-life, more hits still keep a block longer.
    pool2 = BlockPool(8, BS, BlockHasher("m", BS, key=b"k"),
                      make_policy("hybrid", 8, half_life=H), clock=Clock(1.0))
    run_seq(pool2, "old", old)
    for i in range(20):
        pool2.open(f"o{i}", old + [99])
        pool2.close(f"o{i}")
    pool2.clock.t = 1.0 + H / 4
    run_seq(pool2, "new", new)
    pool2.open("n", new + [99])
    pool2.close("n")
    assert pool2.eviction_order() == [pool2.match(new)[0], pool2.match(old)[0]]



@pytest.mark.parametrize("half_life", [0.0, -1.0, float("nan")])
def test_a_hit_half_life_that_is_not_positive_is_refused(half_life):
    """Keys divide last_access by half_life: 0 would fail with ZeroDivisionError at the first
    shallow block's key (a negative one would rank by age backwards), so the policy refuses it
    when built."""
    with pytest.raises(ValueError, match="half_life must be > 0"):
        HybridPolicy(128, half_life)
    assert HybridPolicy(128, None).half_life is None
    assert HybridPolicy(128, 1e-9).half_life == 1e-9


def test_flushing_a_salt_drops_that_tenants_blocks_pins_included_and_keeps_those_in_use() -> None:
    """Erasure on request: one tenant's cached blocks stayed until evicted. flush_salt drops
    every unreferenced block of the salt, pinned ones too, children before parents, reports
    each removal for the prefix index, and keeps the blocks a running sequence holds (and
    other tenants' blocks, X's included under another salt)."""
    pool, _, hasher = make_pool(n=16)
    run_seq(pool, "ax", X, salt="a")  # 3 blocks
    run_seq(pool, "ay", Y, salt="a")  # 2 blocks
    run_seq(pool, "bx", X, salt="b")  # 3 blocks: same tokens, another tenant
    ax, ay = pool.match(X, "a"), pool.match(Y, "a")
    assert pool.pin(ay, ttl_seconds=10) == 2
    pool.open("running", X[:8] + [1], "a")  # holds a's first two X blocks
    pool.take_events()
    # a's X tail and both (pinned) Y blocks, their ids for the engine to zero; 2 in use
    assert pool.flush_salt("a") == Flushed([ax[2], *reversed(ay)], 2)
    ev = pool.take_events()
    assert len(ev) == 1 and sorted(ev[0].block_hashes) == sorted(
        [hasher.hashes(X, "a")[2], *hasher.hashes(Y, "a")])
    assert pool.match(Y, "a") == [] and len(pool.match(X, "a")) == 2
    assert len(pool.match(X, "b")) == 3 and pool.stats().pinned == 0
    pool.check_integrity()
    pool.close("running")
    assert pool.flush_salt("a") == Flushed([ax[1], ax[0]], 0)  # once its request ends
    assert pool.match(X, "a") == [] and len(pool.match(X, "b")) == 3
    assert pool.flush_salt("a") == ([], 0) and pool.take_events()[-1] == BlocksRemoved(
        [hasher.hashes(X, "a")[1], hasher.hashes(X, "a")[0]])
    pool.check_integrity()
