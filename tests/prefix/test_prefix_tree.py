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
