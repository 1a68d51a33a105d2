"""BlockTree storage details: token widths, reuse of freed slots, inconsistent chains."""

from __future__ import annotations

from services.common.policy import HybridPolicy
from services.prefix.tree import BlockTree

BS = 4
ROOT = b"r" * 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def chain_tokens(tree: BlockTree, key: bytes) -> list[int]:
    info = tree.get(key)
    assert info is not None
    return tree.tokens(key)


def new_tree() -> BlockTree:
    tree = BlockTree(BS)
    tree.ensure_root(ROOT, "m", "")
    return tree


def test_tokens_round_trip_and_widen_past_16_bits() -> None:
    tree = new_tree()
    small = list(range(8))
    assert tree.store(ROOT, [h(1), h(2)], small, 0, 1).added == 2
    big = [65535, 65536, 2**24 + 7, 2**32 - 1]  # needs all four bytes
    assert tree.store(h(2), [h(3)], big, 0, 2).added == 1
    tree.check_integrity()
    assert chain_tokens(tree, h(3)) == small + big
    assert tree.get(h(1)).token_ids == [0, 1, 2, 3]  # type: ignore[union-attr]
    assert tree.get(h(3)).depth == 2  # type: ignore[union-attr]
    assert tree.store(h(3), [h(4)], [70000] * BS, 1, 3).dropped == 1  # parent not held by 1
    tree.check_integrity()


def test_freed_slots_are_reused_then_the_chain_continues_in_bulk() -> None:
    tree = new_tree()
    tree.store(ROOT, [h(i) for i in range(1, 6)], list(range(20)), 0, 1)
    assert tree.remove(h(3), 0) == 3  # blocks 3, 4, 5: three free slots
    tree.check_integrity()
    assert len(tree) == 2
    # Five new blocks: three take freed slots one by one, two are appended in bulk.
    res = tree.store(h(2), [h(i) for i in range(10, 15)], list(range(100, 120)), 0, 2)
    assert (res.added, res.held, res.dropped) == (5, 5, 0)
    tree.check_integrity()
    assert chain_tokens(tree, h(14)) == list(range(8)) + list(range(100, 120))
    assert [tree.get(h(i)).depth for i in range(10, 15)] == [2, 3, 4, 5, 6]  # type: ignore[union-attr]
    assert tree.match([h(1), h(2), h(10), h(11), h(99)], 3)[0].blocks == 4


def test_a_known_or_repeated_hash_in_a_new_tail_stops_the_store() -> None:
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2)], list(range(8)), 0, 1)
    # h(1) reappears below h(5): an inconsistent chain; h(5) is kept, the rest dropped.
    res = tree.store(h(2), [h(5), h(1), h(6)], list(range(12)), 0, 2)
    assert (res.added, res.dropped) == (1, 2)
    res = tree.store(h(5), [h(7), h(7), h(8)], list(range(12)), 0, 3)
    assert (res.added, res.dropped) == (1, 2)
    tree.check_integrity()
    assert len(tree) == 4 and h(8) not in tree


def test_prune_frees_slots_and_folds_hits() -> None:
    tree = new_tree()
    tree.store(ROOT, [h(1), h(2), h(3)], list(range(12)), 0, 1)
    tree.store(h(1), [h(4)], [9] * BS, 0, 2)
    tree.match([h(1), h(2), h(3)], 5)
    evicted = tree.prune(2, HybridPolicy(0), 0, 0)
    assert evicted == [h(4), h(3)]  # LRU: h(4) never hit (last 2) before h(3) (last 5)
    tree.check_integrity()
    assert tree.get(h(2)).hits == 1  # type: ignore[union-attr]
    tree.store(h(2), [h(6), h(7), h(8)], list(range(12)), 0, 6)
    tree.check_integrity()
    assert tree.tokens(h(8)) == list(range(8)) + list(range(12))


def _leafy_tree(n: int) -> BlockTree:
    """n two-block chains under ROOT: n shallow inner nodes and n leaves, all unhit."""
    tree = new_tree()
    for i in range(n):
        tree.store(ROOT, [h(1000 + i), h(2000 + i)], [i] * 2 * BS, 0, i + 1)
    return tree


def test_a_pruning_run_in_steps_evicts_what_one_prune_does() -> None:
    whole, stepped = _leafy_tree(30), _leafy_tree(30)
    expect = whole.prune(25, HybridPolicy(0), 0, 0)
    run = stepped.pruning(25, HybridPolicy(0), 0, 0)
    steps = 1
    while not run.step(3):
        steps += 1
    assert run.evicted == expect and len(expect) == 35
    assert steps > 10  # it did run in bounded steps
    stepped.check_integrity()
    assert len(stepped) == len(whole) == 25


def test_a_pruning_run_spares_a_leaf_used_between_steps_and_a_slot_reused() -> None:
    tree = _leafy_tree(6)  # LRU: chain i's leaf h(2000+i) last used at i + 1
    run = tree.pruning(len(tree) - 2, HybridPolicy(0), 0, 0)
    assert not run.step(12)  # every leaf ranked; no budget left to evict
    tree.match([h(1000), h(2000)], 50)  # the oldest leaf is used again
    # Chain 1 goes away; its leaf's slot comes back as a new leaf before the run evicts.
    tree.remove(h(1001), 0)
    tree.store(ROOT, [h(3000)], [7] * BS, 0, 60)
    while not run.step(1):
        pass
    tree.check_integrity()
    assert h(2000) in tree and h(3000) in tree  # re-ranked; the reused slot is not the old leaf
    assert run.evicted == [h(2002)] and len(tree) == 10
