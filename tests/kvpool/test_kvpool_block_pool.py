"""Block pool scenarios (exact block ids, eviction order, events) and a property test."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.hashing import BlockHasher
from services.common.policy import HybridPolicy
from services.kvpool.block_pool import (
    AllCleared,
    BlockPool,
    BlocksRemoved,
    BlocksStored,
    PoolExhausted,
)
from tests.clock import Clock

BS = 4


def make_pool(n: int = 8, shallow: int = 8) -> tuple[BlockPool, Clock, BlockHasher]:
    clock = Clock(1.0)
    hasher = BlockHasher("m", BS, key=b"k")
    return BlockPool(n, BS, hasher, HybridPolicy(shallow), clock=clock), clock, hasher


def run_seq(pool: BlockPool, sid: str, toks: list[int], salt: str = "") -> None:
    """Open, compute everything, commit, close."""
    pool.open(sid, toks, salt)
    pool.commit(sid, toks, len(toks))
    pool.check_integrity()
    pool.close(sid)
    pool.check_integrity()


X = list(range(100, 112))  # 3 full blocks
Y = list(range(200, 208))  # 2 full blocks


def test_reuse_takes_exact_blocks_and_frees_tails() -> None:
    pool, _, _ = make_pool()
    adm = pool.open("a", X[:10])
    assert adm.cached_tokens == 0 and adm.copies == []
    assert pool.blocks_of("a") == [0, 1, 2]
    pool.commit("a", X[:10], 10)
    pool.close("a")
    pool.check_integrity()
    assert pool.stats() == (8, 6, 2, 0, 0)
    assert pool.match(X[:10]) == [0, 1]
    adm = pool.open("b", X[:10])
    assert adm.cached_tokens == 8
    assert pool.blocks_of("b") == [0, 1, 3]  # block 2 went back to the tail of the free queue
    assert pool.ref_count(0) == 1 and pool.ref_count(3) == 1
    pool.check_integrity()
    pool.close("b")
    pool.check_integrity()


def test_full_hit_copies_the_last_block_before_writing_it() -> None:
    pool, _, _ = make_pool()
    run_seq(pool, "a", X[:8])
    adm = pool.open("b", X[:8])  # everything cached, but one token must be recomputed
    assert adm.cached_tokens == 7
    assert adm.copies == [(1, 2)]
    assert pool.blocks_of("b") == [0, 2]
    assert pool.ref_count(1) == 0  # the shared original is not written to
    pool.commit("b", X[:8], 8)  # the copy fills up: identical to block 1, so it is deduplicated
    assert pool.blocks_of("b") == [0, 1]
    pool.check_integrity()
    pool.close("b")
    pool.check_integrity()
    assert pool.stats().free == 6


def test_concurrent_identical_prompts_end_up_sharing_blocks() -> None:
    pool, _, _ = make_pool()
    pool.open("a", Y)
    pool.open("b", Y)
    assert pool.blocks_of("a") == [0, 1] and pool.blocks_of("b") == [2, 3]
    pool.commit("a", Y, 8)
    assert pool.commit("b", Y, 8) == [2, 3]
    assert pool.blocks_of("b") == [0, 1] and pool.ref_count(0) == 2
    pool.check_integrity()
    events = pool.take_events()
    assert len(events) == 1 and isinstance(events[0], BlocksStored)
    pool.close("a")
    pool.close("b")
    pool.check_integrity()
    assert pool.stats() == (8, 6, 2, 0, 0)


def test_salt_isolates_tenants() -> None:
    pool, _, _ = make_pool()
    run_seq(pool, "a", Y, salt="tenant-a")
    assert pool.match(Y, "tenant-b") == []
    assert pool.match(Y, "tenant-a") == [0, 1]


def test_events_carry_chain_position_and_parent() -> None:
    pool, _, hasher = make_pool()
    run_seq(pool, "a", X)
    hs = hasher.hashes(X)
    assert pool.take_events() == [BlocksStored(None, hs, X, "", hs[0], 0)]
    longer = X + [1, 2, 3, 4, 5]
    run_seq(pool, "b", longer)
    h3 = hasher.hashes(longer)[3]
    assert pool.take_events() == [BlocksStored(hs[2], [h3], [1, 2, 3, 4], "", hs[0], 3)]


def _three_chains(pool: BlockPool, clock: Clock) -> None:
    clock.t = 1.0
    run_seq(pool, "x", X)  # blocks 0,1,2 at starts 0,4,8
    clock.t = 2.0
    run_seq(pool, "y", Y)  # blocks 3,4 at starts 0,4
    clock.t = 3.0
    run_seq(pool, "z", X[:8] + [1, 2, 3])  # hits blocks 0,1; block 5 is freed again
    pool.take_events()


def test_eviction_is_leaves_first_deep_lru_then_shallow_lfu() -> None:
    pool, clock, hasher = make_pool()
    _three_chains(pool, clock)
    # Leaves: 2 (deep -> LRU, goes first) and 4 (shallow, 0 hits).
    assert pool.eviction_order() == [2, 4]
    assert pool.evict(5) == [2, 4, 3, 1, 0]
    pool.check_integrity()
    removed = pool.take_events()
    assert removed == [BlocksRemoved([hasher.hashes(X)[2], hasher.hashes(Y)[1],
                                      hasher.hashes(Y)[0], hasher.hashes(X)[1],
                                      hasher.hashes(X)[0]])]
    assert pool.stats() == (8, 8, 0, 0, 0)


def test_blocks_in_use_or_pinned_are_never_evicted() -> None:
    pool, clock, _ = make_pool()
    _three_chains(pool, clock)
    assert pool.pin([3], ttl_seconds=10) == 1
    pool.open("hold", X[:9])  # references blocks 0,1 (and 2 for... no: 2 holds token 8 only)
    assert pool.blocks_of("hold")[:2] == [0, 1]
    evicted = pool.evict(8)
    assert 0 not in evicted and 1 not in evicted and 3 not in evicted
    assert set(evicted) == {2, 4}
    pool.check_integrity()
    assert pool.stats().pinned == 1
    pool.close("hold")
    clock.t = 20.0  # the pin expired
    assert sorted(pool.evict(8)) == [0, 1, 3]
    pool.check_integrity()


def test_allocation_evicts_and_refuses_without_changing_state() -> None:
    pool, clock, _ = make_pool(n=6)
    _three_chains(pool, clock)  # 5 cached blocks, 1 free
    pool.open("big", list(range(300, 316)))  # 4 blocks: 1 free + evicts 3 (2, 4, then 3)
    assert pool.blocks_of("big") == [5, 2, 4, 3]
    pool.check_integrity()
    before = pool.stats()
    with pytest.raises(PoolExhausted):
        pool.open("too-big", list(range(400, 416)))
    assert pool.stats() == before and not pool.has("too-big")
    pool.check_integrity()
    pool.close("big")
    pool.check_integrity()


def test_truncate_rolls_back_uncommitted_blocks() -> None:
    pool, _, _ = make_pool()
    pool.open("a", X[:5])
    pool.ensure_capacity("a", 12)
    assert len(pool.blocks_of("a")) == 3
    pool.commit("a", X, 5)
    pool.truncate("a", 5)
    assert len(pool.blocks_of("a")) == 2
    pool.check_integrity()
    pool.close("a")
    pool.check_integrity()


def test_clear_drops_everything_unused() -> None:
    pool, clock, _ = make_pool()
    _three_chains(pool, clock)
    assert pool.clear() == 5
    assert pool.take_events() == [AllCleared()]
    pool.check_integrity()


def test_eviction_takes_the_oldest_chain_whole_before_a_younger_leaf() -> None:
    """Deep blocks go in LRU order even across parents an eviction exposes: the oldest
    conversation's blocks all go before the leaf of a younger one."""
    pool, clock, _ = make_pool(n=8, shallow=0)  # every block deep (LRU)
    old, young = list(range(500, 512)), list(range(600, 612))  # 3 blocks each
    run_seq(pool, "old", old)
    clock.t += 1
    run_seq(pool, "young", young)
    old_ids, young_ids = pool.match(old), pool.match(young)
    assert pool.evict(3) == old_ids[::-1]  # leaf, then each exposed parent
    assert pool.match(young) == young_ids
    pool.check_integrity()


def test_a_heap_compaction_during_eviction_loses_no_candidate() -> None:
    """evict() pops its heap while each eviction may expose a parent (a push) and used to
    compact the heap right there: the parents pushed after it were lost to that evict(), which
    freed too few blocks, and open() failed with the cache already half evicted."""
    pool, clock, _ = make_pool(n=15, shallow=0)
    leaves = [[1000 + 4 * i + j for j in range(4)] for i in range(10)]
    for i, p in enumerate(leaves):
        run_seq(pool, f"e{i}", p)
    chain = list(range(100, 112))
    run_seq(pool, "c", chain)  # 3 blocks: evicting its leaf exposes its parent, and so on
    k = 0
    # Re-reference the one-block leaves until stale heap entries reach the compaction point.
    while len(pool._heap) < 4 * len(pool._leaves) + 4096:
        clock.t += 0.001
        pool.open("x", leaves[k % 10], keep_uncached=0)
        pool.close("x")
        k += 1
    for i, p in enumerate(leaves):  # held: only the chain is evictable
        pool.open(f"h{i}", p, keep_uncached=0)
    pool.open("fill", list(range(5000, 5008)), use_cache=False)  # the 2 free blocks
    pool.check_integrity()
    assert pool.evictable_count() == 3
    pool.open("new", list(range(7000, 7012)), use_cache=False)  # needs all 3 of the chain
    pool.check_integrity()
    assert pool.stats().cached == 0


def test_eviction_keys_are_fixed_while_a_block_is_a_leaf() -> None:
    """A leaf referenced again (a hit) gets a new key when it is released; its old heap entry
    must not be used."""
    pool, clock, _ = make_pool(n=8, shallow=0)
    a, b = list(range(500, 504)), list(range(600, 604))  # one block each
    run_seq(pool, "a", a)
    clock.t += 1
    run_seq(pool, "b", b)
    clock.t += 1
    run_seq(pool, "a2", a)  # hit: a's block is now the most recent
    (a_id,), (b_id,) = pool.match(a), pool.match(b)
    assert pool.eviction_order() == [b_id, a_id]
    assert pool.evict(1) == [b_id]
    pool.check_integrity()


# ---- property test against a naive reference ----------------------------------------------

ALPHABET = st.lists(st.integers(0, 2), min_size=1, max_size=14)
OPS = st.lists(st.tuples(st.sampled_from(["open", "commit", "grow", "close", "pin", "evict",
                                          "tick"]),
                         st.integers(0, 3), ALPHABET, st.integers(0, 20)),
               min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_interleavings_match_a_naive_reference(ops) -> None:
    pool, clock, _ = make_pool(n=10, shallow=4)
    live: dict[str, list[int]] = {}  # naive reference: live sequences and their tokens
    committed: dict[str, int] = {}  # tokens each live sequence has committed
    ever: set[tuple[int, ...]] = set()  # every committed full-block prefix
    pinned: dict[tuple[int, ...], float] = {}
    for op, slot, toks, n in ops:
        sid = f"s{slot}"
        if op == "open" and sid not in live:
            try:
                pool.open(sid, toks)
            except PoolExhausted:
                assert not pool.has(sid)
            else:
                live[sid], committed[sid] = list(toks), 0
        elif op == "commit" and sid in live:
            upto = min(n, len(live[sid]))
            pool.commit(sid, live[sid], upto)
            committed[sid] = max(committed[sid], upto // BS * BS)
            for k in range(BS, committed[sid] + 1, BS):
                ever.add(tuple(live[sid][:k]))
        elif op == "grow" and sid in live:
            extra = live[sid] + toks
            try:
                pool.ensure_capacity(sid, len(extra))
            except PoolExhausted:
                st = pool.stats()  # refused only when free and evictable blocks fall short
                need = -(-len(extra) // BS) - len(pool.blocks_of(sid))
                assert need > st.free + st.cached, (need, st)
            else:
                live[sid] = extra
        elif op == "close" and sid in live:
            pool.close(sid)
            del live[sid], committed[sid]
        elif op == "pin" and sid in live and committed[sid]:
            blocks = pool.blocks_of(sid)[: committed[sid] // BS]
            pool.pin(blocks, ttl_seconds=5)
            pinned[tuple(live[sid][: committed[sid]])] = clock.t + 5
        elif op == "evict":
            # Keys of the candidates now (a full sort's view); the heap's first pick must be a
            # candidate with the smallest key (ties may pick another one).
            keys = {b: pool.policy.key(pool._usage(pool._blocks[b]))
                    for b in pool.eviction_order()}
            got = pool.evict(n)
            if n and keys:
                assert got and keys[got[0]] == min(keys.values())
            evicted = set(got)
            held = {b for s in live for b in pool.blocks_of(s)}
            assert not evicted & held, "evicted a block in use"
        elif op == "tick":
            clock.t += n / 4
        pool.check_integrity()
        # Reference ref counts: how many live tables list each block.
        counts: dict[int, int] = {}
        for s in live:
            for b in pool.blocks_of(s):
                counts[b] = counts.get(b, 0) + 1
        assert all(pool.ref_count(b) == c for b, c in counts.items())
        assert pool.stats().in_use == len(counts)
        # Committed blocks of live sequences, and pinned prefixes, are always still matchable.
        for s, c in committed.items():
            assert len(pool.match(live[s][:c])) == c // BS
        for prefix, until in pinned.items():
            if until > clock.t:
                assert len(pool.match(list(prefix))) == len(prefix) // BS
        # No phantom blocks: a match is always a prefix that was committed at some point.
        for s in live:
            m = len(pool.match(live[s])) * BS
            assert m == 0 or tuple(live[s][:m]) in ever
    for s in list(live):
        pool.close(s)
    pool.check_integrity()
    assert pool.stats().in_use == 0


def test_a_pool_that_records_no_events_still_caches() -> None:
    hasher = BlockHasher("m", BS, key=b"k")
    pool = BlockPool(8, BS, hasher, record_events=False)
    run_seq(pool, "a", X)
    assert pool.take_events() == [] and pool.match(X, "") == [0, 1, 2]
    pool.clear()
    assert pool.take_events() == []
    pool.check_integrity()


def test_pins_past_max_pinned_keep_the_chains_leading_blocks() -> None:
    """A pin past the limit was refused whole: on a small pool a ~1,000-token system prompt
    was longer than a tenant's share and kept nothing pinned. Its leading blocks (what a
    prefix hit needs) are now pinned up to the limit; only a pin with no room at all fails."""
    clock = Clock(1.0)
    pool = BlockPool(8, BS, BlockHasher("m", BS, key=b"k"), HybridPolicy(8), clock=clock,
                     max_pinned=4)
    run_seq(pool, "x", X)  # 3 blocks
    run_seq(pool, "y", Y)  # 2 blocks
    xs = [pool._table[h] for h in pool.hasher.hashes(X)]
    ys = [pool._table[h] for h in pool.hasher.hashes(Y)]
    assert pool.pin(xs, ttl_seconds=10) == 3
    assert pool.pin(xs, ttl_seconds=20) == 3  # re-pinning is not more blocks
    assert pool.pin(ys, ttl_seconds=10) == 1  # room for one more: the chain's first block
    assert [pool.is_pinned(b) for b in ys] == [True, False]
    with pytest.raises(PoolExhausted, match="limit of 4"):
        pool.pin(ys[1:], ttl_seconds=10)
    assert pool.pin(ys, ttl_seconds=30) == 1  # the pinned start is refreshed, nothing more
    clock.t += 21  # x's pins expire: room again
    assert pool.pin(ys, ttl_seconds=10) == 2
    pool.check_integrity()


def test_one_tenants_pins_are_held_to_its_share_of_the_pool() -> None:
    """Pins were capped only overall (half the pool): one tenant's Warm with a one-hour TTL
    held all of it, and every other tenant's Warm was refused. Each cache salt now gets its
    own share; refreshing pins already held counts once."""
    clock = Clock(1.0)
    pool = BlockPool(16, BS, BlockHasher("m", BS, key=b"k"), HybridPolicy(8), clock=clock,
                     max_pinned=8, max_pinned_per_salt=3)
    a_x, a_y, b_x = X, Y, X  # tenant b sends the same tokens under its own salt
    run_seq(pool, "ax", a_x, salt="a")  # 3 blocks
    run_seq(pool, "ay", a_y, salt="a")  # 2 blocks
    run_seq(pool, "bx", b_x, salt="b")  # 3 blocks
    ids = {k: [pool._table[h] for h in pool.hasher.hashes(toks, salt)]
           for k, toks, salt in (("ax", a_x, "a"), ("ay", a_y, "a"), ("bx", b_x, "b"))}
    assert pool.pin(ids["ax"], ttl_seconds=10) == 3
    assert pool.pin(ids["ax"], ttl_seconds=20) == 3  # a refresh is not more blocks
    with pytest.raises(PoolExhausted, match="this tenant .* limit of 3"):
        pool.pin(ids["ay"], ttl_seconds=10)
    assert not any(pool.is_pinned(b) for b in ids["ay"])
    assert pool.pin(ids["bx"], ttl_seconds=10) == 3  # another tenant has its own share
    clock.t += 21  # a's pins lapse
    assert pool.pin(ids["ay"], ttl_seconds=10) == 2
    assert pool.pin(ids["ax"], ttl_seconds=10) == 1  # a's share: the start of its chain
    assert [pool.is_pinned(b) for b in ids["ax"]] == [True, False, False]
    pool.check_integrity()
