"""BlockTree's rules at their edges: token packing, known heads, free slots, the first node of a
match, usage restored after a lapse, reaping, and recency folds (pure logic).

Written for what a mutation audit found no test checking; each was seen failing on a hand-made
mutant of the rule it checks."""

from __future__ import annotations

from services.common.policy import HybridPolicy
from tests.prefix.test_prefix_tree import BS, ROOT, h, new_tree


def test_a_token_whose_only_high_byte_is_the_top_one_widens_the_planes() -> None:
    """2**24 has byte 2 zero and byte 3 set: it needs 32 bits all the same."""
    tree = new_tree()
    toks = [2**24, 1, 2, 3 << 24]
    assert tree.store(ROOT, [h(1)], toks, 0, 1).added == 1
    tree.check_integrity()
    assert tree.tokens(h(1)) == toks
    assert tree.get(h(1)).token_ids == toks  # type: ignore[union-attr]


def test_a_known_head_under_another_parent_is_dropped_not_held() -> None:
    """A chain whose first block is a known node under another parent is inconsistent (a
    collision or a replica's garbage): the replica must not become a holder of that node,
    which would break the holder closure (it does not hold the node's real parent)."""
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2)], list(range(8)), 0, 1)  # replica 0: h1 -> h2
    tree.store(ROOT, [h(5)], [50] * BS, 1, 2)  # replica 1: h5
    res = tree.store(h(5), [h(2)], [60] * BS, 1, 3)  # h2 claimed under h5
    assert (res.added, res.held, res.dropped) == (0, 0, 1)
    assert tree.get(h(2)).holders == 0b01  # type: ignore[union-attr]
    assert tree.held[1] == 1
    tree.check_integrity()
    segs = tree.match([h(5), h(2)], 4, credit=False)
    assert [(s.holders, s.blocks) for s in segs] == [(0b10, 1)]


def test_a_known_hash_in_a_new_tail_stops_the_store_when_it_fills_freed_slots() -> None:
    """The same rule as a bulk append, on the path that reuses freed slots one at a time."""
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2), h(3), h(4)], list(range(16)), 0, 1)
    assert tree.remove(h(3), 0) == 2  # two free slots
    res = tree.store(h(2), [h(5), h(1), h(6)], list(range(100, 112)), 0, 2)
    assert (res.added, res.dropped) == (1, 2)
    tree.check_integrity()
    assert len(tree) == 3 and h(6) not in tree
    assert tree.get(h(1)).depth == 0  # type: ignore[union-attr]
    assert tree.tokens(h(5)) == list(range(8)) + list(range(100, 104))


def test_a_match_must_start_at_a_first_block() -> None:
    """A request whose first hash is a deeper node (not a chain's first block) matches
    nothing, and credits no hit."""
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2), h(3)], list(range(12)), 0, 1)
    assert tree.match([h(3)], 5) == []
    assert tree.match([h(2), h(3)], 5) == []
    assert [tree.get(h(i)).hits for i in (1, 2, 3)] == [0, 0, 0]  # type: ignore[union-attr]
    assert [(s.holders, s.blocks) for s in tree.match([h(1), h(2)], 6)] == [(1, 2)]


def test_top_may_fill_max_tokens_exactly() -> None:
    """'No more than max_tokens tokens in all': two one-block prefixes fit in 2 blocks."""
    tree = new_tree()
    tree.store(ROOT, [h(1)], [1] * BS, 0, 1)
    tree.store(ROOT, [h(2)], [2] * BS, 0, 2)
    tree.match([h(1)], 3)
    tree.match([h(2)], 4)
    assert [p.last_block_hash for p in tree.top(10, "m", max_tokens=2 * BS)] == [h(2), h(1)]
    assert [p.last_block_hash for p in tree.top(10, "m", max_tokens=2 * BS - 1)] == [h(2)]


def test_a_leaf_used_exactly_at_recent_since_is_still_cold() -> None:
    """Only a leaf used *after* recent_since is spared the cold rule."""
    tree = new_tree()
    tree.store(ROOT, [h(1)], [1] * BS, 0, 1)
    tree.match([h(1)], 4)  # h1: 1 hit (not cold at min_deep_hits=1), last used at 4
    tree.store(ROOT, [h(2)], [2] * BS, 0, 5)  # h2: no hit, used at 5 = recent_since: cold
    assert tree.prune(1, HybridPolicy(0), 0, 1, recent_since=5) == [h(2)]
    tree.check_integrity()


def test_pruning_folds_recency_into_a_parent_without_aging_it() -> None:
    """A leaf's recency folds into its parent as the later of the two: a parent matched at 10
    is not made older by a child last used at 1."""
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2)], list(range(8)), 0, 1)
    tree.match([h(1)], 10)  # the match ends at h1: h1 hit at 10
    assert tree.prune(1, HybridPolicy(0), 0, 0) == [h(2)]
    info = tree.get(h(1))
    assert info is not None and info.last == 10 and info.hits == 1


def test_restored_usage_never_moves_last_use_back_nor_overwrites_new_hits() -> None:
    tree = new_tree()
    tree.store(ROOT, [h(1)], [1] * BS, 0, 1)
    tree.store(ROOT, [h(2)], [2] * BS, 0, 1)
    for c in (2, 3, 4):
        tree.match([h(1)], c)
        tree.match([h(2)], c)
    saved = tree.clear_saving(0)
    assert saved == {h(1): (3, 4), h(2): (3, 4)}
    tree.store(ROOT, [h(1)], [1] * BS, 0, 10)  # stored again, later than the saved use
    tree.store(ROOT, [h(2)], [2] * BS, 0, 10)
    tree.match([h(2)], 11)  # h2 was hit since: it is not "no hits yet"
    assert tree.restore_usage(saved) == {}
    one, two = tree.get(h(1)), tree.get(h(2))
    assert one is not None and (one.hits, one.last) == (3, 10)
    assert two is not None and (two.hits, two.last) == (1, 11)
    tree.check_integrity()


def test_the_reap_queue_is_dropped_once_nothing_is_unheld() -> None:
    """A cleared chain whose first block is stored again: reaping the rest leaves nothing
    unheld, and the queue (its last entry now a live node's slot) is dropped, not kept."""
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2), h(3)], list(range(12)), 0, 1)
    tree.clear(0)
    assert tree.unheld == 3
    tree.store(ROOT, [h(1)], list(range(4)), 0, 2)  # h1 held again
    assert tree.unheld == 2
    assert tree.reap(2) == 0  # h3 and h2 deleted; h1's queued slot is not looked at
    assert h(1) in tree and h(2) not in tree and len(tree) == 1
    assert not tree._reap and tree._reap_at == 0
    tree.check_integrity()


def test_a_match_that_leaves_its_chain_stops_where_the_parent_link_breaks() -> None:
    """A list that is not one chain falls back to a walk along parent links: a held node at
    the right depth under another first block is not the next block of this chain, and
    nothing after it counts (the tail may be this chain's again, as here)."""
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2), h(3), h(4)], list(range(16)), 0, 1)  # replica 0
    tree.store(ROOT, [h(1)], list(range(4)), 1, 2)  # replica 1: the first block only
    tree.store(ROOT, [h(5), h(6)], list(range(50, 58)), 0, 3)  # h6: depth 1 under h5
    segs = tree.match([h(1), h(6), h(3), h(4)], 4)
    assert [(s.holders, s.blocks) for s in segs] == [(0b11, 1)]
    assert tree.get(h(1)).hits == 1  # type: ignore[union-attr]
    assert tree.get(h(4)).hits == 0  # type: ignore[union-attr]


def test_a_walked_match_gives_one_segment_per_holder_set_and_none_empty() -> None:
    """Along the walk, a block held by the same replicas as the next one adds no segment:
    every segment names the replicas whose match ends there (none with no holders)."""
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2), h(3)], list(range(12)), 0, 1)  # replica 0
    tree.store(ROOT, [h(1)], list(range(4)), 1, 2)  # replica 1: the first block only
    tree.store(ROOT, [h(i) for i in range(10, 15)], list(range(50, 70)), 2, 3)  # replica 2
    segs = tree.match([h(1), h(2), h(3), h(13), h(14)], 4)  # h13: depth 3, not under h3
    assert [(s.holders, s.blocks) for s in segs] == [(0b01, 3), (0b10, 1)]
