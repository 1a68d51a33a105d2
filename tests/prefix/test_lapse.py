"""A lapsed lease's grace (the hits of what only that replica held, kept for one lease): saved
in the clear's own walk, and not ended by a pause of the index itself."""

from __future__ import annotations

import random

import pytest

from services.prefix.index import Load, PrefixIndex, Removed
from services.prefix.tree import _HITS, _HOLD, _LAST, _USE, BlockTree
from tests.clock import Clock

from .conftest import BS, MODEL, make_index, matched, stored, sweep_for, toks


def reg(index, rid: str = "a", inc: str = "i1", capacity: int = 100):
    return index.register(rid, inc, f"addr-{rid}", MODEL, BS, capacity)


# -- one walk ------------------------------------------------------------------------------

REPLICAS = ("a", "b", "c", "d")


def build(hasher, seed: int) -> PrefixIndex:
    """Four replicas with overlapping chains under two tenants, some hit, some removed, all
    leases renewed at the end; "a" holds at most 10 blocks and still has hits of an earlier
    resync to be given back (some aged), so that its saved hits are capped."""
    rng = random.Random(seed)
    index = make_index(Clock(), verify_hashes=False, hit_half_life_seconds=4)
    seqs = dict.fromkeys(REPLICAS, 1)
    chains: dict[str, list[tuple[list[int], str]]] = {r: [] for r in REPLICAS}

    def chain() -> tuple[list[int], str]:
        ids = [rng.randint(1, 3)] + [rng.randint(1, 5) for _ in range(rng.randint(0, 5))]
        return toks(*ids), rng.choice(("", "t1"))

    def publish(rid: str, events, resync: bool = False) -> None:
        index.publish(rid, "i1", seqs[rid], events, resync=resync)
        seqs[rid] += 1

    def traffic(rid: str, n: int) -> None:
        for _ in range(n):
            tokens, salt = chain()
            chains[rid].append((tokens, salt))
            publish(rid, [stored(hasher, tokens, salt=salt)])
            if rng.random() < 0.2:  # evicted again: the block and all below it
                hs = hasher.hashes(tokens, salt)
                publish(rid, [Removed([rng.choice(hs)])])
        for _ in range(3 * n):
            tokens, salt = rng.choice(chains[rid])
            for _ in range(rng.randint(1, 3)):
                matched(index, tokens[: BS * rng.randint(1, len(tokens) // BS)], salt)

    for rid in REPLICAS:
        reg(index, rid, capacity=10 if rid == "a" else 100)
        traffic(rid, 12)
    # A resync of "a" restating a few of its chains: the rest's hits wait to be given back.
    publish("a", [stored(hasher, t, salt=s) for t, s in chains["a"][:3]], resync=True)
    index.clock.t += 4
    index.age_hits()
    traffic("a", 6)
    for rid in REPLICAS:
        assert index.heartbeat(rid, "i1", Load()).known
    return index


def lapse(index: PrefixIndex, gone: str) -> None:
    """Every lease but `gone`'s renewed, then `gone`'s runs out."""
    index.clock.t += 5
    for rid in REPLICAS:
        if rid != gone:
            index.heartbeat(rid, "i1", Load())
    index.clock.t += 6


def kids_calls(monkeypatch, tree: BlockTree) -> list[int]:
    """The slots whose children the tree lists from now on (a node visited by a walk)."""
    calls: list[int] = []
    real = tree._kids
    monkeypatch.setattr(tree, "_kids", lambda s: calls.append(s) or real(s))
    return calls


def test_a_lapse_or_a_resync_walks_the_holdings_no_more_than_a_plain_clear(hasher,
                                                                          monkeypatch):
    # The hits to keep were gathered by a walk of their own before the clear walked the same
    # nodes again, holding the index lock twice as long for a big replica (every Match,
    # Publish and Heartbeat waiting on it).
    for event in ("lapse", "resync"):
        index, plain = build(hasher, 1), build(hasher, 1)
        lapse(index, "a")
        lapse(plain, "a")
        walked, cleared = kids_calls(monkeypatch, index.tree), kids_calls(monkeypatch,
                                                                           plain.tree)
        seq = index._replicas["a"].next_seq
        if event == "lapse":
            assert index.expire() == ["a"]
            assert index._lapsed["a"][1]  # hits were saved
        else:
            index._replicas["a"].deadline = plain._replicas["a"].deadline = float("inf")
            index.publish("a", "i1", seq, [], resync=True)
            assert index._replicas["a"].usage
        plain.tree.clear(plain._replicas["a"].bit)
        assert cleared and len(walked) == len(cleared), event
        index.check_integrity()


def two_walks(tree: BlockTree, bit: int) -> dict[bytes, tuple[int, int]]:
    """What `clear_saving` replaces, as it was: the hits of the used nodes only `bit` holds,
    gathered by a walk of their own (`BlockTree.usage_held_only_by`), then `clear(bit)`."""
    mask = 1 << bit
    use, key = tree._use, tree._key
    out: dict[bytes, tuple[int, int]] = {}
    stack = [k for root in tree._roots.values() for k in tree._kids(root)
             if use[_USE * k + _HOLD] & mask]
    while stack:
        s = stack.pop()
        if use[_USE * s + _HOLD] == mask and use[_USE * s + _HITS]:
            out[key[s]] = (use[_USE * s + _HITS], use[_USE * s + _LAST])  # type: ignore[index]
        stack.extend(k for k in tree._kids(s) if use[_USE * k + _HOLD] & mask)
    tree.clear(bit)
    return out


def state(index: PrefixIndex) -> tuple:
    """Everything a drop or a resync changes, in order where order is kept (slots, dicts)."""
    t = index.tree
    return (list(t._table.items()), list(t._roots.items()), list(t._meta.items()),
            list(t._key), t._nav.tobytes(), t._use.tobytes(), [bytes(p) for p in t._planes],
            list(t._free), list(t.held),
            [(rid, inc, list(usage.items()), until, halvings)
             for rid, (inc, usage, until, halvings) in index._lapsed.items()],
            list(index._seq_floor.items()), index._next_deadline,
            [(r.replica_id, r.bit, r.deadline, r.usage_until, r.usage_halvings,
              r.usage and list(r.usage.items())) for r in index._replicas.values()])


@pytest.mark.parametrize("seed", range(12))
def test_saving_the_hits_in_the_clears_walk_leaves_what_two_walks_left(hasher, monkeypatch,
                                                                       seed):
    new, old = build(hasher, seed), build(hasher, seed)
    monkeypatch.setattr(old.tree, "clear_saving", lambda bit: two_walks(old.tree, bit))
    assert state(new) == state(old)
    for index in (new, old):
        # A resync of "a" (hits of its last one still pending, more than it can hold)...
        index.publish("a", "i1", index._replicas["a"].next_seq,
                      [stored(hasher, toks(*range(1, k + 1))) for k in (1, 3, 5)],
                      resync=True)
        # ...and a lapse of "c".
        lapse(index, "c")
        assert index.expire() == ["c"]
        index.check_integrity()
    assert new._lapsed["c"][1] and new._replicas["a"].usage
    assert state(new) == state(old)


# -- a pause of the index ------------------------------------------------------------------


def top(index) -> list[tuple[list[int], int]]:
    return [(p.token_ids, p.hits) for p in index.top_prefixes(5)]


def hot(index, hasher, chain: list[int]) -> None:
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    for _ in range(5):
        matched(index, chain)


def test_a_pause_of_the_index_does_not_end_a_lapsed_leases_grace(clock, hasher):
    # a's lease lapsed (a late heartbeat) just before the index stood still for 2.5 leases;
    # a's Register, sent at once, waited through the pause and came past the grace: every
    # hit of what only a held was lost, as the pause itself no longer costs a lease.
    chain = toks(1, 2, 3)
    index = make_index(clock)
    hot(index, hasher, chain)
    assert sweep_for(index, clock, 4) == ["a"]
    clock.t += 25  # the index stood still
    seq = reg(index).next_seq  # the first call on waking
    index.publish("a", "i1", seq, [stored(hasher, chain)], resync=True)
    assert top(index) == [(chain, 5)]
    index.check_integrity()
    # The pause is forgiven, not more: back a lease after it (the sweeper on time), none.
    index = make_index(clock)
    hot(index, hasher, chain)
    assert sweep_for(index, clock, 4) == ["a"]
    clock.t += 25
    assert sweep_for(index, clock, 5) == []  # the first turn forgives 25 s; then 10 s pass
    seq = reg(index).next_seq
    index.publish("a", "i1", seq, [stored(hasher, chain)], resync=True)
    assert top(index) == []


def test_a_pause_of_the_index_does_not_end_a_resyncs_give_back(clock, hasher):
    # A snapshot spread over batches: its later blocks get their hits back within a lease of
    # the resync; a pause in between (the lease itself forgiven) let that lease run out.
    chain = toks(1, 2, 3)
    index = make_index(clock)
    hot(index, hasher, chain)
    index.sweep()
    index.publish("a", "i1", 2, [stored(hasher, chain, end=1)], resync=True)
    clock.t += 25  # the index stood still between the snapshot's batches
    index.publish("a", "i1", 3, [stored(hasher, chain, start=1)])
    assert top(index) == [(chain, 5)]
    index.check_integrity()
