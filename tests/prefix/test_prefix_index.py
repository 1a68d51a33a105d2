"""Scenario tests of the pure index: exact match lengths, eviction order, leases, resyncs."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.hashing import BlockHasher
from services.prefix.index import Cleared, Load, Removed

from .conftest import BS, KEY, MODEL, make_index, matched, stored, toks


def reg(index, rid: str, inc: str = "i1", model: str = MODEL) -> None:
    index.register(rid, inc, f"addr-{rid}", model, BS, 100)


def test_match_lengths_per_replica(index, hasher):
    reg(index, "a")
    reg(index, "b")
    chain = toks(1, 2, 3, 4)
    assert index.publish("a", "i1", 1, [stored(hasher, chain)]).next_seq == 2
    index.publish("b", "i1", 1, [stored(hasher, chain, end=2)])
    index.check_integrity()
    assert matched(index, chain + [7, 7]) == {"a": 4, "b": 2}
    # Longest first; token count is blocks * block size.
    r = index.match(MODEL, token_ids=toks(1, 2, 9))
    assert [(m.replica_id, m.matched_blocks, m.matched_tokens) for m in r.matches] == [
        ("a", 2, 8), ("b", 2, 8)]
    assert r.request_blocks == 3
    # A divergent first block matches nothing; replicas are still listed (with 0).
    assert matched(index, toks(9, 2)) == {"a": 0, "b": 0}
    # Block hashes given directly give the same answer.
    assert {m.replica_id: m.matched_blocks for m in index.match(
        MODEL, block_hashes=hasher.hashes(chain)[:3]).matches} == {"a": 3, "b": 2}


def test_tenant_salt_isolates_chains(index, hasher):
    reg(index, "a")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2), salt="tenant-a")])
    assert matched(index, toks(1, 2), salt="tenant-a") == {"a": 2}
    assert matched(index, toks(1, 2), salt="tenant-b") == {"a": 0}
    assert matched(index, toks(1, 2)) == {"a": 0}


def test_other_models_replicas_are_not_listed(index, hasher):
    reg(index, "a")
    reg(index, "z", model="other")
    index.publish("a", "i1", 1, [stored(hasher, toks(1))])
    assert matched(index, toks(1)) == {"a": 1}


def test_removal_drops_the_subtree_for_that_replica_only(index, hasher):
    reg(index, "a")
    reg(index, "b")
    chain = toks(1, 2, 3)
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    index.publish("b", "i1", 1, [stored(hasher, chain)])
    hs = hasher.hashes(chain)
    index.publish("a", "i1", 2, [Removed([hs[1]])])
    index.check_integrity()
    # a kept block 1 only (block 3 is useless to it without block 2); b keeps everything.
    assert matched(index, chain) == {"b": 3, "a": 1}
    assert index.stats().nodes == 3
    index.publish("b", "i1", 2, [Removed([hs[0]])])
    index.check_integrity()
    assert matched(index, chain) == {"a": 1, "b": 0}
    assert index.stats().nodes == 1
    index.publish("a", "i1", 3, [Cleared()])
    assert index.stats().nodes == 0
    index.check_integrity()


def test_stored_block_with_unknown_parent_is_dropped_not_orphaned(index, hasher):
    reg(index, "a")
    chain = toks(1, 2, 3)
    # Blocks 2..3 without block 1: they could never be matched, so they are not kept.
    index.publish("a", "i1", 1, [stored(hasher, chain, start=1)])
    index.check_integrity()
    assert index.stats().nodes == 0
    assert index.stats().dropped_blocks_total == 2
    # Within one batch the order does not matter: the child waits for its parent.
    index.publish("a", "i1", 2, [stored(hasher, chain, start=1), stored(hasher, chain, end=1)])
    index.check_integrity()
    assert matched(index, chain) == {"a": 3}
    assert index.stats().dropped_blocks_total == 2


def test_parent_held_only_by_another_replica_is_not_enough(index, hasher):
    reg(index, "a")
    reg(index, "b")
    chain = toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, chain, end=1)])
    index.publish("b", "i1", 1, [stored(hasher, chain, start=1)])
    index.check_integrity()
    assert matched(index, chain) == {"a": 1, "b": 0}
    assert index.stats().dropped_blocks_total == 1


def test_lease_expiry_removes_replica_and_holdings(index, hasher, clock):
    reg(index, "a")
    reg(index, "b")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    index.publish("b", "i1", 1, [stored(hasher, toks(1, 3))])
    clock.t += 6
    assert index.heartbeat("a", "i1", Load(1, 2, 3, 4)).known
    clock.t += 6  # b's lease (10 s) lapsed, a's was renewed 6 s ago
    assert matched(index, toks(1, 2)) == {"a": 2}
    index.check_integrity()
    assert [r.replica_id for r in index.stats().replicas] == ["a"]
    assert index.stats().nodes == 2
    assert not index.heartbeat("b", "i1", Load()).known
    with pytest.raises(NotFound, match="replica_id"):
        index.publish("b", "i1", 2, [])
    r = index.match(MODEL, token_ids=toks(1))
    assert r.matches[0].load == Load(1, 2, 3, 4)


def test_new_incarnation_drops_what_the_old_one_held(index, hasher):
    reg(index, "a", "i1")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    index.publish("a", "i1", 2, [stored(hasher, toks(1, 2, 3), start=2)])
    assert index.register("a", "i1", "addr-a", MODEL, BS).next_seq == 3  # same: idempotent
    assert matched(index, toks(1, 2, 3)) == {"a": 3}
    assert index.register("a", "i2", "addr-a", MODEL, BS).next_seq == 1
    index.check_integrity()
    assert matched(index, toks(1, 2, 3)) == {"a": 0}
    assert index.stats().nodes == 0
    with pytest.raises(NotFound, match="incarnation"):
        index.publish("a", "i1", 3, [])


def test_gap_asks_for_resync_and_resync_replaces_holdings(index, hasher):
    reg(index, "a")
    assert index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))]) == (False, 2, True)
    # Batch 2 was lost: batch 3 is not applied.
    r = index.publish("a", "i1", 3, [stored(hasher, toks(5))])
    assert r == (True, 2, False)
    assert matched(index, toks(5)) == {"a": 0}
    assert index.stats().resyncs_total == 1
    # A retry of batch 1 is acknowledged and ignored.
    assert index.publish("a", "i1", 1, [Cleared()]) == (False, 2, False)  # a retry
    assert matched(index, toks(1, 2)) == {"a": 2}
    # The full holdings, one block per event as a snapshot sends them.
    snap = [stored(hasher, toks(5, 6), end=1), stored(hasher, toks(5, 6), start=1)]
    assert index.publish("a", "i1", 7, snap, resync=True) == (False, 8, True)
    index.check_integrity()
    assert matched(index, toks(1, 2)) == {"a": 0}
    assert matched(index, toks(5, 6)) == {"a": 2}
    assert index.publish("a", "i1", 8, [Removed([hasher.hashes(toks(5))[0]])]) == (
        False, 9, True)
    assert index.stats().nodes == 0


def test_pruning_order_cold_deep_then_lru_deep_then_lfu_shallow(clock, hasher):
    from services.common.policy import HybridPolicy

    # Blocks starting before token 8 (blocks 0-1) are shallow.
    index = make_index(clock, max_nodes=7, prune_to=0.5, policy=HybridPolicy(8),
                       min_deep_hits=1)
    reg(index, "a")
    base = toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, base + toks(3, 4))])     # deep 3,4
    index.publish("a", "i1", 2, [stored(hasher, base + toks(5), start=2)])  # deep 5
    index.publish("a", "i1", 3, [stored(hasher, toks(7, 8))])            # shallow 7,8
    assert index.stats().nodes == 7
    matched(index, base + toks(5))  # hit on deep 5
    matched(index, base + toks(3, 4))  # hit on deep 4
    matched(index, toks(7, 8))  # shallow 8: 2 hits
    matched(index, toks(7, 8))
    matched(index, base)  # hit on shallow block 2 (an inner node)
    # One more node (8 > 7) triggers pruning down to int(7 * 0.5) = 3 nodes.
    index.publish("a", "i1", 4, [stored(hasher, base + toks(6), start=2)])  # deep 6, no hits
    index.check_integrity()
    hs = {n: hasher.hashes(c)[-1] for n, c in {
        6: base + toks(6), 5: base + toks(5), 4: base + toks(3, 4), 3: base + toks(3)}.items()}
    s = index.stats()
    assert (s.nodes, s.pruned_total) == (3, 5)
    # Cold deep leaf 6 first; then deep LRU: 5 (hit first; its hit folds into 2), 4 (its hit
    # folds into 3), 3 (folds into 2: own 1 + 5's + 4's = 3 hits); then among shallow leaves
    # LFU: 8 (2 hits) before 2 (3 hits).
    assert all(index.tree.get(hs[n]) is None for n in (6, 5, 4, 3))
    assert index.tree.get(hasher.hashes(toks(7, 8))[-1]) is None
    assert index.tree.get(hasher.hashes(base)[-1]).hits == 3
    assert matched(index, base + toks(3)) == {"a": 2}
    assert matched(index, toks(7, 8)) == {"a": 1}


def test_top_prefixes_hottest_first(index, hasher):
    reg(index, "a")
    reg(index, "b")
    sys_prompt = toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, sys_prompt + toks(3))])
    index.publish("b", "i1", 1, [stored(hasher, sys_prompt)])
    for _ in range(3):
        matched(index, sys_prompt + toks(9))
    matched(index, sys_prompt + toks(3, 4))
    top = index.top_prefixes(5)
    assert [(p.token_ids, p.hits, p.holders) for p in top] == [
        (sys_prompt, 3, ["a", "b"]), (sys_prompt + toks(3), 1, ["a"])]
    assert top[0].last_block_hash == hasher.hashes(sys_prompt)[-1]
    assert [p.hits for p in index.top_prefixes(5, min_hits=2)] == [3]
    assert index.top_prefixes(5, model_id="other") == []


def _state(index):
    s = index.stats()
    return (s.nodes, [(r.replica_id, r.incarnation, r.held_blocks) for r in s.replicas],
            [(p.token_ids, p.holders) for p in index.top_prefixes(1000)],
            {r.replica_id: r.next_seq for r in index._replicas.values()},
            s.matches_total, s.match_blocks_total)


def test_bad_input_is_refused_and_changes_nothing(index, hasher):
    reg(index, "a")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    matched(index, toks(1, 2))
    before = _state(index)
    good = stored(hasher, toks(1, 2, 3), start=2)
    bad_hash = stored(hasher, toks(1, 2, 3), start=2)
    bad_hash = bad_hash._replace(block_hashes=[b"short"])
    wrong_tokens = stored(hasher, toks(1, 2, 3), start=2)
    wrong_tokens = wrong_tokens._replace(token_ids=[1, 2, 3])
    forged = stored(hasher, toks(1, 2, 3), start=2)
    forged = forged._replace(token_ids=toks(4))
    cases = [
        (lambda: index.publish("a", "i1", 2, [good, bad_hash]), InvalidArgument,
         r"events\[1\].stored.block_hashes\[0\]"),
        (lambda: index.publish("a", "i1", 2, [good, wrong_tokens]), InvalidArgument,
         r"events\[1\].stored.token_ids"),
        (lambda: index.publish("a", "i1", 2, [good, forged]), InvalidArgument,
         r"events\[1\].stored.block_hashes: do not match"),
        (lambda: index.publish("a", "i1", 0, [good]), InvalidArgument, "seq"),
        (lambda: index.publish("a", "i1", 2**64 - 1, [good]), InvalidArgument, "seq"),
        (lambda: index.publish("a", "i1", 2, [stored(hasher, toks(9), salt="s" * 257)]),
         InvalidArgument, r"events\[0\].stored.cache_salt"),
        (lambda: index.match(MODEL, "s" * 257, toks(1)), InvalidArgument, "cache_salt"),
        (lambda: index.publish("nobody", "i1", 2, [good]), NotFound, "replica_id"),
        (lambda: index.match(MODEL), InvalidArgument, "token_ids: empty"),
        (lambda: index.match("", token_ids=toks(1)), InvalidArgument, "model_id"),
        (lambda: index.match(MODEL, block_hashes=[b"x" * 15]), InvalidArgument,
         r"block_hashes\[0\]"),
        # Lengths that add up to whole digests (15 + 17, 0 + 32) are still wrong.
        (lambda: index.match(MODEL, block_hashes=[b"x" * 15, b"y" * 17]), InvalidArgument,
         r"block_hashes\[0\]"),
        (lambda: index.match(MODEL, block_hashes=[b"", b"y" * 32]), InvalidArgument,
         r"block_hashes\[0\]"),
        (lambda: index.match("m" * 257, token_ids=toks(1)), InvalidArgument, "model_id"),
        (lambda: index.register("b", "i1", "addr", MODEL, BS * 2), FailedPrecondition,
         "block_size"),
        (lambda: index.register("", "i1", "addr", MODEL, BS), InvalidArgument, "replica_id"),
        (lambda: index.top_prefixes(0), InvalidArgument, "k"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
        index.check_integrity()
        assert _state(index) == before, msg
    from services.common.errors import ResourceExhausted

    small = make_index(index.clock, max_events=1, max_blocks=2)
    reg(small, "a")
    with pytest.raises(ResourceExhausted, match="events"):
        small.publish("a", "i1", 1, [good, good])
    with pytest.raises(ResourceExhausted, match="events"):
        small.publish("a", "i1", 1, [stored(hasher, toks(1, 2, 3))])
    assert small.stats().nodes == 0
    small.check_integrity()


def test_a_repeated_block_hash_is_refused_with_hash_checks_off(clock, hasher):
    """With verify_hashes off (the default), a chain repeating a hash was acknowledged with
    part of it stored and the repeat dropped; chained hashes never repeat in a real chain."""
    index = make_index(clock, verify_hashes=False)
    reg(index, "a")
    before = _state(index)
    ev = stored(hasher, toks(1, 2))
    twice = ev._replace(block_hashes=[ev.block_hashes[0]] * 2)
    with pytest.raises(InvalidArgument,
                       match=r"events\[1\].stored.block_hashes: a block hash is repeated"):
        index.publish("a", "i1", 1, [stored(hasher, toks(5)), twice])
    assert _state(index) == before and index.stats().dropped_blocks_total == 0
    index.check_integrity()
    index.publish("a", "i1", 1, [ev])  # the same seq, well formed: taken
    assert matched(index, toks(1, 2)) == {"a": 2}


def test_verified_hashes_cannot_be_bypassed_by_dropping_a_block_in_the_same_batch(
        index, hasher):
    """With verify_hashes on, blocks the tree already held were not hashed again; a batch
    that drops them first (a resync clears the replica's holdings, or a Removed earlier in
    the batch) then stored them again from tokens nobody checked: the node held the forged
    tokens, TopPrefixes handed them out for warm-up, and integrity failed."""
    reg(index, "a")
    reg(index, "b")
    good = toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, good)])
    forged = stored(hasher, good)._replace(token_ids=toks(9, 9))
    before = _state(index)
    with pytest.raises(InvalidArgument, match="do not match the tokens"):
        index.publish("a", "i1", 2, [forged], resync=True)
    with pytest.raises(InvalidArgument, match="do not match the tokens"):
        index.publish("a", "i1", 2, [Removed([forged.block_hashes[0]]), forged])
    assert _state(index) == before
    assert index.tree.tokens(forged.block_hashes[-1]) == good
    index.check_integrity()
    # The truth, restated, is taken (a resync of what the tree holds; a drop and a re-store).
    index.publish("a", "i1", 2, [stored(hasher, good)], resync=True)
    index.publish("a", "i1", 3, [Removed([forged.block_hashes[0]]), stored(hasher, good)])
    assert matched(index, good) == {"a": 2, "b": 0}
    index.check_integrity()


def test_hash_probe_refuses_a_replica_hashing_differently(index, hasher, clock):
    assert index.register("a", "i", "x:1", MODEL, BS, 0, hasher.probe()).next_seq == 1
    foreign = BlockHasher(MODEL, BS, b"another-key").probe()
    with pytest.raises(FailedPrecondition, match="hash_probe"):
        index.register("b", "i", "x:2", MODEL, BS, 0, foreign)
    assert [r.replica_id for r in index.stats().replicas] == ["a"]
    # Without per-block verification a forged chain is taken at its word (advisory index);
    # with it, refused.
    lax = make_index(clock, verify_hashes=False)
    reg(lax, "a")
    forged = stored(hasher, toks(1, 2))
    forged = forged._replace(token_ids=toks(3, 4))
    assert lax.publish("a", "i1", 1, [forged]).resync is False
    with pytest.raises(InvalidArgument, match="do not match"):
        reg(index, "c") or index.publish("c", "i1", 1, [forged])


def test_a_waiting_chain_removed_later_in_the_batch_is_not_stored(index, hasher):
    """The index pruned P; the replica stores C under P, evicts C and P, then recomputes P,
    all in one batch (its own order is right). C waited for P and must not be stored when P
    comes back: the replica no longer holds it and no later event would withdraw the claim."""
    reg(index, "a")
    chain = toks(1, 2, 3)
    hs = hasher.hashes(chain)
    index.publish("a", "i1", 1, [stored(hasher, chain, end=2)])
    index.tree.prune(1, index.policy, index.shallow_tokens, index.min_deep_hits)
    assert matched(index, chain) == {"a": 1}  # P (block 2) pruned
    index.publish("a", "i1", 2, [stored(hasher, chain, start=2), Removed([hs[2]]),
                                 Removed([hs[1]]), stored(hasher, chain, start=1, end=2)])
    index.check_integrity()
    assert matched(index, chain) == {"a": 2}  # P again, not C


def test_a_removal_cuts_a_waiting_chain_at_the_removed_block(index, hasher):
    reg(index, "a")
    chain = toks(1, 2, 3, 4)
    hs = hasher.hashes(chain)
    index.publish("a", "i1", 1, [stored(hasher, chain, start=1), Removed([hs[2]]),
                                 stored(hasher, chain, end=1)])
    index.check_integrity()
    assert matched(index, chain) == {"a": 2}  # blocks 1-2; 3 was removed, so 4 went with it


def test_a_batch_delayed_from_before_a_lapsed_lease_is_not_taken_for_a_new_one(index, hasher,
                                                                                clock):
    reg(index, "a")
    chain = toks(1, 2)
    hs = hasher.hashes(chain)
    index.publish("a", "i1", 1, [stored(hasher, chain, end=1)], resync=True)
    delayed = [stored(hasher, chain, start=1)]  # batch 2, queued while the client timed out
    clock.t += 11.0
    assert index.expire() == ["a"]
    nxt = index.register("a", "i1", "addr-a", MODEL, BS).next_seq  # same incarnation again
    assert nxt == 2  # numbering continues: batch 2 cannot be reused
    index.publish("a", "i1", nxt, [stored(hasher, chain, end=1)], resync=True)
    assert index.publish("a", "i1", 2, delayed).next_seq == nxt + 1  # ignored as old
    index.publish("a", "i1", nxt + 1, [Removed([hs[0]])])
    assert matched(index, chain) == {"a": 0}


def test_a_resync_overtaken_by_a_newer_one_is_ignored(index, hasher):
    reg(index, "a")
    chain = toks(1, 2)
    hs = hasher.hashes(chain)
    old_snapshot = [stored(hasher, chain)]  # resync 1: its call timed out, still queued
    index.publish("a", "i1", 2, [stored(hasher, chain, end=1)], resync=True)  # the retry
    index.publish("a", "i1", 3, [Removed([hs[0]])])
    assert index.publish("a", "i1", 1, old_snapshot, resync=True).next_seq == 4
    index.check_integrity()
    assert matched(index, chain) == {"a": 0}


def test_a_replica_cannot_hang_blocks_under_another_models_root():
    from services.prefix.index import PrefixIndex, Stored

    idx = PrefixIndex(4)
    ha, hb = BlockHasher("model-a", 4), BlockHasher("model-b", 4)
    idx.register("ra", "i", "a:1", "model-a", 4, 10, ha.probe())
    idx.register("rb", "i", "b:1", "model-b", 4, 10, hb.probe())
    idx.publish("rb", "i", 1, [Stored(b"", hb.hashes([1, 2, 3, 4]), [1, 2, 3, 4])])
    root_b = hb.root("")
    forged = ha.hashes([9, 9, 9, 9], parent=root_b)
    with pytest.raises(InvalidArgument, match=r"events\[0\].stored.parent_hash: is the root"):
        idx.publish("ra", "i", 1, [Stored(root_b, forged, [9, 9, 9, 9])])
    idx.check_integrity()
    assert {r.replica_id: r.held_blocks for r in idx.stats().replicas} == {"ra": 0, "rb": 1}


def test_a_match_for_a_model_nobody_serves_keeps_no_hasher(index, hasher):
    """Any model id may be asked about; none is remembered (a hasher holds a ~3 MB memo)."""
    reg(index, "a")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    r = index.match("nobody-serves-this", token_ids=toks(1, 2))
    assert r.matches == [] and r.request_blocks == 2
    assert "nobody-serves-this" not in index._hashers
    assert matched(index, toks(1, 2)) == {"a": 2}


def test_refused_registrations_keep_no_hasher_and_a_lapsed_model_drops_its_own(
        index, hasher, clock):
    """Register built and kept a hasher for the model before refusing a wrong hash_probe:
    1,024 refused made-up models filled the cache for good, and every Match of a real model
    then built a cold hasher (no memo). Hashers are kept for served models only."""
    for i in range(1030):
        with pytest.raises(FailedPrecondition, match="hash_probe"):
            index.register("r", "i", "x:1", f"bogus-{i}", BS, 0, b"\1" * 16)
    assert index._hashers == {} and index.replica_count == 0
    reg(index, "a")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    assert matched(index, toks(1, 2)) == {"a": 2}
    assert index.hasher(MODEL) is index.hasher(MODEL)  # kept: the model is served
    clock.t += 11  # the lease lapses: nobody serves the model any more
    index.expire()
    assert MODEL not in index._hashers and MODEL not in index._verifiers


def test_nul_in_a_model_id_or_salt_is_refused(index, hasher):
    """Roots hash model and salt with NUL between them: model "a" with salt "b\\0" had the
    root of model "a\\0b" with no salt, so one model's replica held the other's blocks."""
    with pytest.raises(InvalidArgument, match="model_id: must not contain NUL"):
        index.register("r", "i", "x:1", "a\0b", BS)
    reg(index, "a", model="a")
    with pytest.raises(InvalidArgument, match="cache_salt: must not contain NUL"):
        index.publish("a", "i1", 1, [stored(BlockHasher("a", BS, KEY), toks(1), salt="b\0")])
    with pytest.raises(InvalidArgument, match="cache_salt: must not contain NUL"):
        index.match("a", "b\0", token_ids=toks(1))
    index.check_integrity()


def test_top_prefixes_stop_at_the_token_budget_hottest_first(index, hasher, monkeypatch):
    """Each hot prefix carries every token from the root: 1,000 matches ending along one
    16,000-token conversation made an answer of 24 MB, past gRPC's 16 MiB limit, and the
    call failed (RESOURCE_EXHAUSTED; the orchestrator then took the index for unhealthy)."""
    import services.prefix.index as index_mod

    monkeypatch.setattr(index_mod, "MAX_TOP_TOKENS", 10 * BS)
    reg(index, "a")
    chain = toks(*range(1, 9))  # 8 blocks
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    for n, hits in ((8, 1), (2, 5), (4, 3), (6, 2)):  # hottest: 2 blocks, then 4, 6, 8
        for _ in range(hits):
            matched(index, chain[:n * BS])
    top = index.top_prefixes(10)
    # 2 + 4 blocks fit in 10; the 6-block one would not, and the list stops there.
    assert [(len(p.token_ids) // BS, p.hits) for p in top] == [(2, 5), (4, 3)]
    monkeypatch.setattr(index_mod, "MAX_TOP_TOKENS", 1_000_000)
    assert [len(p.token_ids) // BS for p in index.top_prefixes(10)] == [2, 4, 6, 8]


def test_top_prefixes_leave_out_a_replica_whose_lease_lapsed(index, hasher, clock):
    reg(index, "a")
    reg(index, "b")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    index.publish("b", "i1", 1, [stored(hasher, toks(1, 2))])
    matched(index, toks(1, 2, 9))
    assert index.top_prefixes(5)[0].holders == ["a", "b"]
    clock.t += 6
    assert index.heartbeat("a", "i1", Load()).known
    clock.t += 6  # b's lease lapsed; nothing else has looked since
    assert [p.holders for p in index.top_prefixes(5)] == [["a"]]


def test_a_resync_keeps_the_hits_of_what_the_replica_still_holds(index, hasher):
    """A resync (after any gap) restates the holdings; the nodes only this replica held are
    deleted and stored again, and used to come back with no hits: TopPrefixes forgot the hot
    prompt and LFU pruning took it first."""
    reg(index, "a")
    hot = toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, hot + toks(3))])
    for _ in range(5):
        matched(index, hot + toks(9))
    assert [(p.token_ids, p.hits) for p in index.top_prefixes(5)] == [(hot, 5)]
    assert not index.publish("a", "i1", 2, [stored(hasher, hot + toks(3))], resync=True).resync
    assert [(p.token_ids, p.hits) for p in index.top_prefixes(5)] == [(hot, 5)]
    assert not index.publish("a", "i1", 3, [stored(hasher, toks(1))], resync=True).resync
    assert index.top_prefixes(5) == []  # block 2 is not held any more: its hits go with it
    index.check_integrity()


def hot_chain(index, hasher) -> tuple[list[int], list[tuple[list[int], int]]]:
    """Replica "a" holds a 6-block chain matched 5 times; (chain, TopPrefixes as pairs)."""
    reg(index, "a")
    chain = toks(1, 2, 3, 4, 5, 6)
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    for _ in range(5):
        matched(index, chain)
    return chain, [(p.token_ids, p.hits) for p in index.top_prefixes(5)]


def test_a_resync_spread_over_several_batches_keeps_the_hits_of_its_later_blocks(
        index, hasher, clock):
    """The publisher sends a snapshot as one resync batch and then plain batches; hits were
    kept only for the blocks of the first, so a hot chain stored later came back with none and
    dropped out of TopPrefixes (and was pruned first)."""
    chain, top = hot_chain(index, hasher)
    assert top == [(chain, 5)]
    assert not index.publish("a", "i1", 2, [stored(hasher, chain, end=2)], resync=True).resync
    assert not index.publish("a", "i1", 3, [stored(hasher, chain, start=2, end=4)]).resync
    assert not index.publish("a", "i1", 4, [stored(hasher, chain, start=4)]).resync
    assert [(p.token_ids, p.hits) for p in index.top_prefixes(5)] == top
    index.check_integrity()
    # What is not stored again within a lease is forgotten (no hits for ever after).
    assert not index.publish("a", "i1", 5, [stored(hasher, chain, end=2)], resync=True).resync
    for _ in range(2):  # 12 s, the lease renewed halfway
        clock.t += 6
        assert index.heartbeat("a", "i1", Load()).known
    index.publish("a", "i1", 6, [stored(hasher, chain, start=2)])
    assert index.top_prefixes(5) == []


def test_hits_saved_by_a_resync_outlive_a_batch_that_could_not_keep_their_blocks(index,
                                                                                hasher):
    """A later batch naming blocks it then dropped (their parent not held yet) took their
    saved hits and lost them: stored again by the next batch, they came back with none."""
    chain, top = hot_chain(index, hasher)
    index.publish("a", "i1", 2, [stored(hasher, chain, end=2)], resync=True)
    before = index.dropped_blocks_total
    index.publish("a", "i1", 3, [stored(hasher, chain, start=3)])  # block 2 missing: dropped
    assert index.dropped_blocks_total - before == 3
    index.publish("a", "i1", 4, [stored(hasher, chain, start=2)])
    assert [(p.token_ids, p.hits) for p in index.top_prefixes(5)] == top == [(chain, 5)]
    index.check_integrity()


def test_publishing_renews_the_lease(index, hasher, clock):
    """Only Register and Heartbeat renewed it: a resync of many batches, queued behind other
    replicas' at the index, let the lease lapse midway (NOT_FOUND, a new registration, a new
    snapshot, again)."""
    reg(index, "a")
    chain = toks(*range(1, 20))
    index.publish("a", "i1", 1, [stored(hasher, chain, end=1)], resync=True)
    for i in range(1, 18):
        clock.t += 1.0  # 17 s in all, past the 10 s lease, without a heartbeat
        assert not index.publish("a", "i1", i + 1, [stored(hasher, chain, start=i,
                                                           end=i + 1)]).resync
    assert matched(index, chain) == {"a": 18}


def test_lapsed_replicas_batch_numbers_are_remembered_for_a_bounded_number(hasher, clock,
                                                                         monkeypatch):
    """Each lapsed replica id leaves its next batch number behind (for a re-Register); ids
    change with every restart, so the memory must not grow with them."""
    from services.prefix import index as index_mod

    monkeypatch.setattr(index_mod, "MAX_SEQ_FLOORS", 3)
    idx = make_index(clock)
    for i in range(10):
        reg(idx, f"r{i}")
        clock.t += 11  # its lease (10 s) lapses
        idx.stats()  # expires it
    assert list(idx._seq_floor) == ["r7", "r8", "r9"]
    reg(idx, "r9")  # the newest kept one registers again with its floor
    assert "r9" not in idx._seq_floor and idx._replicas["r9"].next_seq == 1


def test_hash_lists_that_are_not_one_chain_match_up_to_the_break(clock, hasher):
    """Match assumed every block between two known ones is known: a list with a foreign hash
    in the middle raised TypeError (INTERNAL) after counting a hit; so did an honest prompt
    once a publisher (hashes unverified) had hung a block one level too high."""
    index = make_index(clock, verify_hashes=False)
    reg(index, "a")
    reg(index, "b")
    chain = toks(1, 2, 3, 4, 5, 6, 7, 8)
    hs = hasher.hashes(chain)
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    index.publish("b", "i1", 1, [stored(hasher, chain, end=2)])
    junk = b"\x00" * len(hs[0])

    def by_hashes(bh):
        return {m.replica_id: m.matched_blocks
                for m in index.match(MODEL, block_hashes=bh).matches}

    assert by_hashes(hs) == {"a": 8, "b": 2}
    assert by_hashes([hs[0], junk, *hs[2:]]) == {"a": 1, "b": 1}
    # Found by a binary search: a break it does not probe is not seen (a caller's own lie).
    assert by_hashes([*hs[:5], junk, *hs[6:]]) in ({"a": 5, "b": 2}, {"a": 8, "b": 2})
    assert by_hashes([*hs[:5], junk, junk, junk]) == {"a": 5, "b": 2}
    assert by_hashes([hs[0], hs[2], hs[3]]) == {"a": 1, "b": 1}  # a block skipped
    assert by_hashes([hs[3], *hs[4:]]) == {"a": 0, "b": 0}  # starts mid-chain
    # A publisher that skips a block: its chain [x1, y3] hangs y3 under x1.
    other = toks(1, 8, 9)
    ho = hasher.hashes(other)
    index.publish("b", "i1", 2, [type(stored(hasher, other))(
        b"", [ho[0], ho[2]], other[:2 * BS], "", ho[0], 0)])
    assert matched(index, other) == {"a": 1, "b": 1}
    assert matched(index, chain) == {"a": 8, "b": 2}
    top = index.top_prefixes(10, MODEL)
    assert sum(p.hits for p in top) == index.stats().matches_hit


def test_another_models_hashes_match_nothing_and_count_no_hit(index, hasher):
    """Hashes are keyed by model, but Match(block_hashes) took any chain: model B's request
    with model A's hashes credited A's prefix with a hit and counted a hit in Stats."""
    reg(index, "a")
    reg(index, "z", model="other")
    chain = toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    r = index.match("other", block_hashes=hasher.hashes(chain))
    assert [(m.replica_id, m.matched_blocks) for m in r.matches] == [("z", 0)]
    st = index.stats()
    assert (st.matches_total, st.matches_hit) == (1, 0)
    assert index.top_prefixes(5, MODEL) == []


def test_a_probe_gets_the_answer_without_counting_a_hit(index, hasher):
    """Warm's owner lookups asked the index as if they were traffic: every Warm call made the
    hottest prefixes hotter and raised the hit ratio."""
    reg(index, "a")
    chain = toks(1, 2, 3)
    index.publish("a", "i1", 1, [stored(hasher, chain)])
    assert matched(index, chain) == {"a": 3}
    before = index.stats()
    for _ in range(5):
        r = index.match(MODEL, token_ids=chain, probe=True)
        assert [(m.replica_id, m.matched_blocks) for m in r.matches] == [("a", 3)]
        index.match(MODEL, token_ids=toks(7), probe=True)
    index.match("unserved", token_ids=chain, probe=True)
    after = index.stats()
    assert (after.matches_total, after.matches_hit, after.match_blocks_total) == (
        before.matches_total, before.matches_hit, before.match_blocks_total)
    assert [p.hits for p in index.top_prefixes(5, MODEL)] == [1]


@pytest.mark.parametrize("name", ["hybrid", "lru"])
def test_the_cold_deep_rule_spares_shallow_leaves_under_either_policy(name):
    """The LRU policy carries no shallow/deep split, and the index then took every leaf for
    deep: a new, never-matched one-block prompt went before an old deep leaf."""
    from services.prefix.config import PrefixConfig
    from services.prefix.server import build_index

    index = build_index(PrefixConfig(block_size=BS, max_nodes=5, prune_to=0.8,
                                     eviction_policy=name, shallow_tokens=8, min_deep_hits=1))
    hasher = BlockHasher(MODEL, BS)  # the service's index uses the default hash key
    reg(index, "a")
    deep = toks(1, 2, 3, 4)  # blocks from token 8 on are deep
    index.publish("a", "i1", 1, [stored(hasher, deep)])
    matched(index, deep)  # the deep leaf is hit once, long ago
    index.publish("a", "i1", 2, [stored(hasher, toks(9))])  # 5 nodes: at the budget
    index.publish("a", "i1", 3, [stored(hasher, toks(8))])  # 6 nodes: prune to 4
    index.check_integrity()
    assert matched(index, toks(8)) == {"a": 1} and matched(index, toks(9)) == {"a": 1}
    assert matched(index, deep) == {"a": 2}


def test_a_node_under_the_wrong_parent_or_model_is_not_part_of_the_chain(clock, hasher):
    """Depth alone let a block hung one level right but under another parent (a publisher's
    [A1, X, A3], hashes unverified) rank its holder first with 3 blocks of a prompt it holds 1
    of; and another model's deeper block at the end of a list took the match and its hit."""
    index = make_index(clock, verify_hashes=False)
    reg(index, "r0")
    reg(index, "r1")
    reg(index, "z", model="m2")
    p = toks(1, 2, 3, 4)
    a = hasher.hashes(p)
    x = hasher.hashes(toks(1, 9))[1]
    index.publish("r1", "i1", 1, [type(stored(hasher, p))(b"", [a[0], x, a[2]], toks(1, 9, 3),
                                                        "", a[0], 0)])
    index.publish("r0", "i1", 1, [stored(hasher, p, end=3)])
    assert matched(index, p) == {"r0": 2, "r1": 1}
    other = BlockHasher("m2", BS, KEY)
    z = other.hashes(toks(7, 8, 9, 6))
    index.publish("z", "i1", 1, [stored(other, toks(7, 8, 9, 6))])
    got = index.match(MODEL, block_hashes=[a[0], a[1], z[2], z[3]])
    assert {m.replica_id: m.matched_blocks for m in got.matches} == {"r0": 2, "r1": 1}
    assert index.top_prefixes(5, "m2") == []


def test_top_prefixes_decide_the_filter_per_root_not_per_node(index, hasher, monkeypatch):
    """With a model or tenant filter every hit node was walked up to its root: 2.4 s at the
    default million-node budget, under the lock every Match waits for. Only the k nodes
    returned are walked now; the same answer."""
    reg(index, "a")
    for i in range(20):
        index.publish("a", "i1", i + 1, [stored(hasher, toks(i + 1, 2, 3), salt=f"t{i % 4}")])
        for _ in range(i % 5 + 1):
            matched(index, toks(i + 1, 2, 3), salt=f"t{i % 4}")
    want = [(p.token_ids, p.hits, p.cache_salt) for p in index.top_prefixes(50, MODEL)
            if p.cache_salt == "t1"][:3]
    walks: list[int] = []
    real = index.tree._root_slot
    monkeypatch.setattr(index.tree, "_root_slot", lambda s: walks.append(s) or real(s))
    got = index.top_prefixes(3, MODEL, cache_salt="t1")
    assert [(p.token_ids, p.hits, p.cache_salt) for p in got] == want and len(want) == 3
    assert len(walks) <= 3  # the results' own model and salt, nothing else
    walks.clear()
    assert len(index.top_prefixes(3, MODEL)) == 3 and len(walks) <= 3


def test_top_prefixes_for_one_tenant_salt(index, hasher):
    """Warm(top_k) asked for the cluster's hottest and kept its tenant's: to get k of its own
    it had to ask for 1,000 (384 ms under the index lock at 2,048-token prefixes)."""
    reg(index, "a")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2), salt="hot-tenant")])
    index.publish("a", "i1", 2, [stored(hasher, toks(3, 4), salt="quiet-tenant")])
    for _ in range(5):
        matched(index, toks(1, 2), salt="hot-tenant")
    matched(index, toks(3, 4), salt="quiet-tenant")
    assert [p.cache_salt for p in index.top_prefixes(1, MODEL)] == ["hot-tenant"]
    mine = index.top_prefixes(1, MODEL, cache_salt="quiet-tenant")
    assert [(p.cache_salt, p.hits) for p in mine] == [("quiet-tenant", 1)]
    assert index.top_prefixes(5, MODEL, cache_salt="nobody") == []
    assert len(index.top_prefixes(5, MODEL, cache_salt=None)) == 2


def test_pruning_a_big_tree_is_spread_over_later_calls_and_bounded(clock, hasher):
    """Over max_nodes a pruning run starts; each Publish or Heartbeat does `prune_step`
    leaves of it, and past max_nodes plus the prune gap the run finishes at once."""
    index = make_index(clock, max_nodes=20, prune_to=0.5, prune_step=4)
    reg(index, "a")
    seq = 0
    for b in range(21):  # 21 one-block chains: one over the budget
        seq += 1
        index.publish("a", "i1", seq, [stored(hasher, toks(100 + b))])
    assert 10 < index.stats().nodes <= 21  # a step ranked 4 leaves; nothing evicted yet
    beats = 0
    while index.stats().nodes > 10 and beats < 100:  # bounded: no pruning fails, not hangs
        assert index.heartbeat("a", "i1", Load()).known
        beats += 1
    assert 2 < beats < 100 and index.stats().pruned_total == 11
    index.check_integrity()
    # A flood: arrivals past 2 * 20 - 10 = 30 nodes finish the run within that publish.
    seq += 1
    index.publish("a", "i1", seq, [stored(hasher, toks(200 + b)) for b in range(25)])
    assert index.stats().nodes == 10
    index.check_integrity()


def test_pruning_keeps_its_bound_when_new_blocks_extend_the_leaves_it_ranked(clock, hasher):
    """A run ranks the leaves it starts with; a batch extending every chain left it nothing
    to evict, so a hard finish ended over the bound and no call started another."""
    index = make_index(clock, max_nodes=20, prune_to=0.5, prune_step=4)
    reg(index, "a")
    for b in range(21):  # a run starts over 20 nodes
        index.publish("a", "i1", b + 1, [stored(hasher, toks(100 + b))])
    index.publish("a", "i1", 22, [stored(hasher, toks(100 + b, 300 + b), start=1)
                                  for b in range(21)])  # every chain one block longer
    assert index.stats().nodes <= 20
    index.check_integrity()


def test_a_pause_of_the_index_itself_drops_no_replica_but_silence_while_sweeping_does(index,
                                                                                     hasher,
                                                                                     clock):
    # The index paused past the lease (SIGSTOP, a paused VM) took its own standstill for
    # every replica's silence: on waking it dropped them all, and each resynced from a full
    # snapshot with its blocks' hit history lost.
    reg(index, "a")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    index.sweep()
    clock.t += 25  # 2.5 leases with no sweep: this process stood still
    assert index.heartbeat("a", "i1", Load()).known  # a's heartbeat, the first call on waking
    assert index.sweep() == []
    assert matched(index, toks(1, 2)) == {"a": 2}
    # Sweeping on time, a replica silent past its lease is dropped as before.
    for _ in range(5):
        clock.t += 2.5
        gone = index.sweep()
    assert gone == ["a"] or not index.stats().replicas
    assert not index.heartbeat("a", "i1", Load()).known
    index.check_integrity()


def test_a_sweeper_starved_while_calls_are_served_is_no_pause_of_the_index(index, hasher,
                                                                           clock):
    """The sweeper's turn late by over half a lease was read as a pause of the whole index
    even while other calls were served (a busy lock, the GIL): every lease was pushed back by
    its lateness, and a silent replica was matched past its lease's end (seen over gRPC by a
    concurrency review: 0.09 s past a 0.5 s lease)."""
    reg(index, "a")
    reg(index, "b")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    index.sweep()  # and then no turn of the sweeper
    for _ in range(21):  # b's heartbeat every 0.5 s, 10.5 s on a 10 s lease: the index ran
        clock.t += 0.5
        assert index.heartbeat("b", "i1", Load()).known
    assert "a" not in matched(index, toks(1, 2))
    assert [r.replica_id for r in index.stats().replicas] == ["b"]
    index.check_integrity()


def test_matches_alone_while_the_sweeper_is_starved_are_no_pause_either(index, hasher, clock):
    """The same with only Matches served: a Match called the lease check only once a lease
    was due, so the Match at a's deadline was read as the first call after a pause (a
    review of the fix above)."""
    reg(index, "a")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    index.sweep()
    for _ in range(210):  # a Match every 0.05 s for 10.5 s
        clock.t += 0.05
        seen = matched(index, toks(1, 2))
    assert "a" not in seen
    assert not index.stats().replicas


def test_a_sweeper_late_at_every_turn_still_lets_a_silent_replicas_lease_run_out(index,
                                                                                  clock):
    # Forgiving the whole gap since the last sweep (its period included) at every late turn
    # would have kept a dead replica's lease alive for ever.
    reg(index, "a")
    index.sweep(period=2.5)
    gone: list[str] = []
    for _ in range(40):  # each turn 6 s after the last: 3.5 s late for a 2.5 s period
        clock.t += 6
        gone += index.sweep(period=2.5)
    assert gone == ["a"]


def test_an_old_incarnations_heartbeat_neither_counts_nor_renews_the_new_one(index, clock):
    """A replica restarted under the same id: the old process's heartbeats (still in flight,
    or a process that did not die) must not keep the new incarnation's lease alive. A review
    dropped the incarnation check and no test failed."""
    index.register("a", "old", "addr-a", MODEL, BS, 100)
    index.register("a", "new", "addr-a", MODEL, BS, 100)
    for _ in range(4):
        clock.t += 4
        assert not index.heartbeat("a", "old", Load()).known  # told to register again
    # 16 s on a 10 s lease with only the old process's heartbeats: the new one lapsed.
    assert not index.heartbeat("a", "new", Load()).known
    assert all(r.replica_id != "a" for r in index.stats().replicas)


def test_a_lapsed_lease_is_logged_by_whichever_call_drops_it(index, clock, caplog):
    """Only the sweeper logged a lapse, and a Match or another replica's heartbeat nearly
    always dropped the lease first: an operator saw 1 line for 8 lapses. At INFO, as argued
    where it is written (docs/deploy.md, "Scale each tier"): every replica stopped on purpose
    lapses so, and a lapse that is a fault is a WARNING where it happened."""
    import logging

    reg(index, "a")
    reg(index, "b")
    clock.t += 6
    index.heartbeat("a", "i1", Load())
    clock.t += 6  # b's lease (10 s) lapsed; a's heartbeat drops it
    with caplog.at_level(logging.INFO, logger="services.prefix.index"):
        assert index.heartbeat("a", "i1", Load()).known
    lapsed = [r for r in caplog.records if r.getMessage().startswith("leases lapsed")]
    assert [(r.getMessage(), r.levelname) for r in lapsed] == [
        ("leases lapsed: dropped replicas b (lease 10 s; last seen 12.0 s ago)", "INFO")]
