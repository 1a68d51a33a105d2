"""A lapsed lease's grace (the hits of what only that replica held, kept for one lease): saved
in the clear's own walk, and not ended by a pause of the index itself."""

from __future__ import annotations

import random

import pytest

from benchmarks.prefix_lapse import walk_clear
from services.prefix.index import Load, PrefixIndex, Removed
from services.prefix.tree import BlockTree
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


def test_a_lapse_or_a_resync_walks_nothing_under_the_lock_and_reaping_ends_where_a_walk_did(
        hasher, monkeypatch):
    # Walking a big replica's holdings to delete them held the index lock for seconds (every
    # Match, Publish and Heartbeat waiting on it): the slot now comes off every node at once,
    # and the nodes nobody holds are deleted later, in bounded steps, by `reap`.
    for event in ("lapse", "resync"):
        index, walked_ref = build(hasher, 1), build(hasher, 1)
        lapse(index, "a")
        lapse(walked_ref, "a")
        monkeypatch.setattr(walked_ref.tree, "clear_saving",
                            lambda bit, t=walked_ref.tree: walk_clear(t, bit))
        walked = kids_calls(monkeypatch, index.tree)
        for idx in (index, walked_ref):
            seq = idx._replicas["a"].next_seq
            if event == "lapse":
                assert idx.expire() == ["a"]
                assert idx._lapsed["a"][1]  # hits were saved
            else:
                idx._replicas["a"].deadline = float("inf")
                idx.publish("a", "i1", seq, [], resync=True)
                assert idx._replicas["a"].usage
        assert walked == [], event
        assert index.tree.unheld > 0
        index.check_integrity()  # unheld nodes are allowed while queued for reaping
        assert len(index.tree) == len(walked_ref.tree)
        assert index.tree.reap(3) == index.tree.unheld  # a bounded step
        index.tree.reap()
        assert index.tree.unheld == 0 and not index.tree._reap
        index.check_integrity()
        assert state(index) == state(walked_ref)
        assert len(index.tree._table) == len(walked_ref.tree._table)


def state(index: PrefixIndex) -> tuple:
    """Everything a drop or a resync changes that anyone can see, once the unheld nodes are
    reaped (slot numbers and the free list differ: a walk deleted top-down, reaping deletes
    deepest first)."""
    t = index.tree
    t.reap()
    return (sorted(t.blocks()), sorted(t._roots), sorted(t._meta.values()), list(t.held),
            len(t), [(p.token_ids, p.hits, p.holders) for p in t.top(50)],
            [(rid, inc, list(usage.items()), until, halvings)
             for rid, (inc, usage, until, halvings) in index._lapsed.items()],
            list(index._seq_floor.items()), index._next_deadline,
            [(r.replica_id, r.bit, r.deadline, r.usage_until, r.usage_halvings,
              r.usage and list(r.usage.items())) for r in index._replicas.values()])


@pytest.mark.parametrize("seed", range(12))
def test_a_clear_that_leaves_nodes_unheld_ends_where_a_walk_that_deleted_them_did(
        hasher, monkeypatch, seed):
    new, old = build(hasher, seed), build(hasher, seed)
    monkeypatch.setattr(old.tree, "clear_saving", lambda bit: walk_clear(old.tree, bit))
    monkeypatch.setattr(old.tree, "clear", lambda bit: walk_clear(old.tree, bit) and None)
    assert state(new) == state(old)
    for index in (new, old):
        # A resync of "a" (hits of its last one still pending, more than it can hold)...
        index.publish("a", "i1", index._replicas["a"].next_seq,
                      [stored(hasher, toks(*range(1, k + 1))) for k in (1, 3, 5)],
                      resync=True)
        # ...and a lapse of "c", then traffic before any reaping: "b" stores again some of
        # what only "c" held (revived, without c's hits), matches go over unheld nodes.
        lapse(index, "c")
        assert index.expire() == ["c"]
        index.check_integrity()
    assert new.tree.unheld
    assert new._lapsed["c"][1] and new._replicas["a"].usage
    rng = random.Random(seed)
    unheld = new.tree.unheld
    for _ in range(20):
        tokens = toks(*[rng.randint(1, 3)] + [rng.randint(1, 5) for _ in range(4)])
        results = []
        for index in (new, old):
            results.append(sorted(matched(index, tokens).items()))
            seq = index._replicas["b"].next_seq
            index.publish("b", "i1", seq, [stored(hasher, tokens)])
            index.check_integrity()
        assert results[0] == results[1]
    assert new.tree.unheld < unheld  # some were stored again (revived), none reaped yet
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


# -- a Register that lands after the lapse ---------------------------------------------------

def test_a_register_landing_after_a_lapse_makes_the_next_batch_a_resync(clock, hasher):
    """A Register delayed past a whole lease reaches the index after the lease lapsed: the
    replica is known again with its batch numbers carried on and nothing held, and its
    heartbeats find it known, so it never learns. Its next ordinary batch must be answered
    with a resync request, not applied onto the empty view; the resync restores the view."""
    index = make_index(clock, verify_hashes=False)
    held, later = toks(1, 2), toks(3, 4)
    reg(index)
    assert index.publish("a", "i1", 1, [stored(hasher, held)], resync=True).applied
    assert matched(index, held) == {"a": 2}
    clock.t += 11  # the lease (10 s) lapses: the heartbeats and a re-Register were delayed
    assert index.expire() == ["a"]
    assert reg(index).next_seq == 2  # the late Register: numbers carried on
    assert index.heartbeat("a", "i1", Load()).known
    ordinary = index.publish("a", "i1", 2, [stored(hasher, later)])
    assert (ordinary.resync, ordinary.applied) == (True, False)
    assert matched(index, later) == {"a": 0}  # nothing applied
    redo = index.publish("a", "i1", 2, [stored(hasher, held), stored(hasher, later)],
                         resync=True)
    assert redo.applied and not redo.resync
    assert matched(index, held) == {"a": 2}
    after = index.publish("a", "i1", 3, [Removed([hasher.hashes(later)[-1]])])
    assert after.applied and not after.resync  # ordinary batches apply again
    index.check_integrity()
