"""Contracts of the prefix index that a mutation audit found unguarded: the order in which the
tree prunes leaves (cold deep first, then deep LRU, then shallow LFU) and the lease boundary."""

from __future__ import annotations

import pytest

from services.common.hashing import MAX_SALT_CHARS
from services.common.policy import HybridPolicy
from services.prefix.index import Load

from .conftest import BS, MODEL, make_index, matched, stored, toks

SHALLOW = 2 * BS  # blocks 0 and 1 of a chain are shallow, block 2 on is deep


def reg(index, rid: str = "a") -> None:
    index.register(rid, "i1", f"addr-{rid}", MODEL, BS, 100)


def last_hash(hasher, tokens: list[int]) -> bytes:
    return hasher.hashes(tokens)[-1]


# ---- M07: shallow leaves are pruned least frequently used first ------------------------------

def test_prune_takes_the_shallow_leaf_with_fewer_hits_before_an_older_hit_one(clock, hasher):
    policy = HybridPolicy(SHALLOW)
    index = make_index(clock, policy=policy, min_deep_hits=1)
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, toks(1))])  # shallow leaf A
    assert matched(index, toks(1)) == {"a": 1}
    assert matched(index, toks(1)) == {"a": 1}  # A: 2 hits, both before B exists
    index.publish("a", "i1", 2, [stored(hasher, toks(6))])  # shallow leaf B: newer, no hits
    a, b = last_hash(hasher, toks(1)), last_hash(hasher, toks(6))
    assert (index.tree.get(a).hits, index.tree.get(b).hits) == (2, 0)
    assert index.tree.get(a).last < index.tree.get(b).last  # LRU would take A first
    tree = index.tree
    assert tree.prune(len(tree) - 1, policy, SHALLOW, 1) == [b]
    assert b not in tree and a in tree
    index.check_integrity()
    assert matched(index, toks(1)) == {"a": 1}


# ---- M08 / M08b: deep leaves hit fewer than min_deep_hits times are pruned first -------------

def test_a_cold_newer_deep_leaf_is_pruned_before_an_older_one_hit_min_deep_hits_times(
        clock, hasher):
    policy = HybridPolicy(SHALLOW)
    index = make_index(clock, policy=policy, min_deep_hits=1)
    reg(index)
    base = toks(1, 2)  # two shallow blocks
    index.publish("a", "i1", 1, [stored(hasher, base + toks(3))])  # deep leaf D
    assert matched(index, base + toks(3)) == {"a": 3}  # D: exactly min_deep_hits (1) hit
    index.publish("a", "i1", 2, [stored(hasher, base + toks(4), start=2)])  # deep leaf C: newer
    d, c = last_hash(hasher, base + toks(3)), last_hash(hasher, base + toks(4))
    tree = index.tree
    assert (tree.get(d).hits, tree.get(c).hits) == (1, 0)
    assert tree.get(d).last < tree.get(c).last  # plain deep LRU would take D first
    assert len(tree) == 4
    # C is cold (0 < 1 hit) and goes first; D, with exactly min_deep_hits, is not cold.
    assert tree.prune(len(tree) - 1, policy, SHALLOW, 1) == [c]
    assert d in tree and c not in tree
    index.check_integrity()
    # Then the deep LRU leaf (D) before any shallow one; D's hit folds into block 2.
    assert tree.prune(len(tree) - 1, policy, SHALLOW, 1) == [d]
    assert tree.get(last_hash(hasher, base)).hits == 1


def test_cold_deep_leaves_go_before_warm_deep_and_shallow_ones_in_one_prune(clock, hasher):
    policy = HybridPolicy(SHALLOW)
    index = make_index(clock, policy=policy, min_deep_hits=2)
    reg(index)
    base = toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, base + toks(3))])  # deep W (warm: 2 hits)
    matched(index, base + toks(3))
    matched(index, base + toks(3))
    index.publish("a", "i1", 2, [stored(hasher, base + toks(4), start=2)])  # deep K: 1 hit
    matched(index, base + toks(4))
    index.publish("a", "i1", 3, [stored(hasher, toks(7))])  # shallow S, no hits
    w, k = last_hash(hasher, base + toks(3)), last_hash(hasher, base + toks(4))
    s = last_hash(hasher, toks(7))
    tree = index.tree
    # K (1 < 2 hits: cold, newest) first; then deep LRU: W; then the shallow leaves by hits:
    # S (0) before block 2 (1 + 2 folded hits).
    assert tree.prune(len(tree) - 3, policy, SHALLOW, 2) == [k, w, s]
    index.check_integrity()


# ---- M09: a lease has expired when the clock reaches its deadline -----------------------------

def test_a_lease_has_lapsed_exactly_at_its_deadline(clock, hasher):
    # The index's rule: a lease renewed at t lasts until t + lease_seconds, and a replica whose
    # deadline <= now is gone (PrefixIndex._expire).
    index = make_index(clock)
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    start = clock.t
    clock.t = start + index.lease_seconds - 0.5
    assert matched(index, toks(1, 2)) == {"a": 2}  # still inside the lease
    clock.t = start + index.lease_seconds  # exactly the deadline
    assert matched(index, toks(1, 2)) == {}
    assert index.stats().replicas == [] and index.stats().nodes == 0
    assert not index.heartbeat("a", "i1", Load()).known


def test_an_explicit_sweep_at_the_deadline_drops_the_replica(clock, hasher):
    index = make_index(clock)
    reg(index)
    reg(index, "b")
    index.publish("a", "i1", 1, [stored(hasher, toks(1))])
    deadline = clock.t + index.lease_seconds
    clock.t += 1
    assert index.heartbeat("b", "i1", Load()).known  # b's lease now ends 1 s later
    assert index.expire(deadline - 0.001) == []
    assert index.expire(deadline) == ["a"]
    assert [r.replica_id for r in index.stats().replicas] == ["b"]
    index.check_integrity()


# ---- a conversation's newest turn is not "rarely used": it has had no chance of a hit --------

@pytest.mark.parametrize("grace", [0, 1000])
def test_pruning_spares_tails_stored_moments_ago_under_a_grace(clock, hasher, grace):
    """Near the node budget, tails stored a moment ago (0 hits: hits count where a match
    ends) were pruned before deep leaves hit once long ago; the replica still held them, so
    the next turn's store was dropped (unknown parent) and the conversation stayed invisible
    to the index."""
    index = make_index(clock, policy=HybridPolicy(8), min_deep_hits=1, max_nodes=59,
                       prune_to=0.848, prune_step=10**9, cold_after_ticks=grace)
    reg(index)
    seq = 0

    def publish(*events):
        nonlocal seq
        seq += 1
        return index.publish("a", "i1", seq, list(events))

    old = [[k * 10 + j for j in range(1, 5)] for k in range(10)]
    for chain in old:  # ten old conversations, each matched once
        publish(stored(hasher, toks(*chain)))
        matched(index, toks(*chain))
    index._tick += 100_000  # long ago, by the index's clock
    live = [[500 + k * 10 + j for j in range(1, 5)] for k in range(5)]
    for chain in live:  # five new ones: turn 1 just stored
        publish(stored(hasher, toks(*chain)))
    index.check_integrity()
    held = [index.match(MODEL, token_ids=toks(*c), probe=True).matches[0].matched_blocks
            for c in live]
    if grace:
        assert held == [4] * 5  # the old, once-hit tails went instead
        before = index.dropped_blocks_total
        publish(stored(hasher, toks(*live[0], 700, 701), start=4))  # turn 2
        assert index.dropped_blocks_total == before
        assert matched(index, toks(*live[0], 700, 701)) == {"a": 6}
    else:
        assert held == [2] * 5  # no grace: the fresh tails were the first to go


def test_a_block_another_replica_stores_again_counts_as_used_now(clock, hasher):
    """A prefix review: a block replica b stored as its newest turn, which replica a had
    stored long before, kept a's old recency: pruned first as cold (b's next turn then
    dropped for want of its parent) while a's untouched leaves stayed."""
    index = make_index(clock, policy=HybridPolicy(4), min_deep_hits=1, max_nodes=4,
                       prune_to=0.75, cold_after_ticks=5)
    reg(index)
    reg(index, "b")
    z, x, y = toks(1, 4), toks(1, 2), toks(1, 3)  # three deep leaves under one root block
    for seq, chain in enumerate((z, x, y), 1):
        index.publish("a", "i1", seq, [stored(hasher, chain)])
    for _ in range(10):  # time passes: ten matches that hit nothing (traffic; not probes)
        index.match(MODEL, token_ids=toks(9))
    index.publish("b", "i1", 1, [stored(hasher, x)])  # b's newest turn: x
    index.publish("a", "i1", 4, [stored(hasher, toks(5))])  # over the budget: a prune
    index.check_integrity()
    assert matched(index, x) == {"a": 2, "b": 2}
    assert matched(index, z) == matched(index, y) == {"a": 1, "b": 1}  # the root block only


def test_stats_bytes_stay_at_the_memory_held_after_the_nodes_go(clock, hasher):
    """Stats.bytes was live nodes x 210: after a lease lapse it read near 0 while the freed
    slots (reused, never returned) still held the peak."""
    index = make_index(clock)
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, toks(*range(1, 41)))])
    full = index.stats()
    assert full.nodes == 40 and full.bytes >= 40 * 210
    clock.t += index.lease_seconds  # the replica's lease lapses: its nodes go
    gone = index.stats()
    assert gone.nodes == 0 and gone.bytes == full.bytes


def test_a_late_register_of_a_replaced_incarnation_is_refused(clock, hasher):
    """A Register of the dead incarnation arriving after the new one's (delayed in the
    network, or waiting on the lock) took the id back: it cleared the live incarnation's
    holdings and sent Match to the old address."""
    from services.common.errors import FailedPrecondition

    index = make_index(clock)
    index.register("a", "i1", "10.0.0.1:1", MODEL, BS, 100)
    index.register("a", "i2", "10.0.0.2:1", MODEL, BS, 100)  # restarted
    index.publish("a", "i2", 1, [stored(hasher, toks(1, 2, 3))])
    with pytest.raises(FailedPrecondition, match="incarnation: 'i1' of 'a' was replaced"):
        index.register("a", "i1", "10.0.0.1:1", MODEL, BS, 100)
    assert matched(index, toks(1, 2, 3)) == {"a": 3}
    assert index.match(MODEL, token_ids=toks(1)).matches[0].address == "10.0.0.2:1"
    # Replaced after its lease lapsed too (no record left to replace, only the floor).
    clock.t += index.lease_seconds
    index.register("a", "i3", "10.0.0.3:1", MODEL, BS, 100)
    with pytest.raises(FailedPrecondition):
        index.register("a", "i2", "10.0.0.2:1", MODEL, BS, 100)
    index.check_integrity()


# ---- found by a review (stop 54) -----------------------------------------------------------

def test_a_refused_publish_does_not_renew_the_lease(clock, hasher):
    from services.common.errors import InvalidArgument, ResourceExhausted
    from services.prefix.index import Stored

    index = make_index(clock, lease_seconds=10.0, max_events=4)
    index.register("a", "i1", "addr-a", MODEL, BS, 100)
    clock.t += 9.5
    with pytest.raises(ResourceExhausted):
        index.publish("a", "i1", 1, [stored(hasher, toks(1))] * 5)
    with pytest.raises(InvalidArgument):
        index.publish("a", "i1", 1, [Stored(b"", [], [], "", b"", 0)])
    clock.t += 1.0  # 10.5 s after the last call taken
    assert not index.heartbeat("a", "i1", Load()).known
    # A batch taken renews it: the replica is alive, talking sense.
    index.register("a", "i2", "addr-a", MODEL, BS, 100)
    clock.t += 9.5
    assert index.publish("a", "i2", 1, [stored(hasher, toks(1))]).applied
    clock.t += 1.0
    assert index.heartbeat("a", "i2", Load()).known
    index.check_integrity()


def test_a_block_keyed_as_a_root_is_refused(clock, hasher):
    """With verify_hashes off (the default), a block whose hash was a root's key (h_0, which
    any replica can compute) was taken, and every other replica's chains under that root were
    then dropped."""
    from services.common.errors import InvalidArgument
    from services.prefix.index import Stored

    index = make_index(clock, verify_hashes=False)
    for rid in ("a", "b"):
        index.register(rid, "i1", f"addr-{rid}", MODEL, BS, 100)
    root = hasher.root("")
    with pytest.raises(InvalidArgument, match="root's key"):
        index.publish("a", "i1", 1, [Stored(b"", [root], toks(1), "", root, 0)])
    assert index.publish("a", "i1", 1, [stored(hasher, toks(1))]).applied
    first = hasher.hashes(toks(1))[0]
    with pytest.raises(InvalidArgument, match="root's key"):  # below a known block too
        index.publish("a", "i1", 2, [Stored(first, [root], toks(2), "", b"", 1)])
    assert index.publish("b", "i1", 1, [stored(hasher, toks(1, 2))]).applied
    assert matched(index, toks(1, 2)) == {"a": 1, "b": 2}
    # The root of a salt nobody has stored under yet passes the check: taken as a block, it
    # shadowed that root when it came, and every chain under it went nowhere.
    later = hasher.root("t")
    assert index.publish("a", "i1", 2, [Stored(first, [later], toks(2), "", b"", 1)]).applied
    assert index.publish("b", "i1", 2, [stored(hasher, toks(1, 2), salt="t")]).applied
    assert matched(index, toks(1, 2), salt="t")["b"] == 2
    index.check_integrity()


def test_a_resync_restates_shared_blocks_without_using_them(clock, hasher):
    """The diff review of the fix above: a resync re-sends a replica's whole holdings, and
    every block another replica also held became used just now: a leaf never matched was
    kept and one matched three times pruned."""
    shallow = 2 * BS
    index = make_index(clock, policy=HybridPolicy(shallow), min_deep_hits=1,
                       cold_after_ticks=5)
    reg(index)
    reg(index, "b")
    base = toks(1, 2)
    x, y = base + toks(3), base + toks(4)  # deep leaves: x never matched, y matched
    for rid in ("a", "b"):
        index.publish(rid, "i1", 1, [stored(hasher, y), stored(hasher, x, start=2)])
    for _ in range(3):
        matched(index, y)
    for _ in range(10):  # time passes (matches of traffic: probes take no tick)
        index.match(MODEL, token_ids=toks(9))
    index.publish("b", "i1", 2, [stored(hasher, y), stored(hasher, x, start=2)], resync=True)
    tree = index.tree
    gone = tree.prune(len(tree) - 1, HybridPolicy(shallow), shallow, 1, index._recent_since())
    assert gone == [hasher.hashes(x)[-1]]
    index.check_integrity()


@pytest.mark.parametrize("made", [False, True])
def test_a_roots_key_named_as_a_parent_is_refused(clock, hasher, made):
    """A prefix review: a chain sent with its root's key (h_0) as parent_hash was accepted and
    its blocks dropped without a word while no chain had made that root, stored once another
    replica's had. kvpool sends such a chain with an empty parent_hash."""
    from services.common.errors import InvalidArgument
    from services.prefix.index import Stored

    index = make_index(clock)
    reg(index)
    reg(index, "b")
    if made:
        index.publish("b", "i1", 1, [stored(hasher, toks(1))])
    hs = hasher.hashes(toks(1, 2))
    with pytest.raises(InvalidArgument, match=r"parent_hash: is a root's key"):
        index.publish("a", "i1", 1, [Stored(hasher.root(""), hs, toks(1, 2))])
    assert index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))]).applied  # nothing kept
    got = matched(index, toks(1, 2))
    assert got["a"] == 2 and got.get("b", 0) == (1 if made else 0)
    index.check_integrity()


@pytest.mark.parametrize("salt", ["x" * (MAX_SALT_CHARS + 1), "a\0b"])
def test_a_salt_below_the_root_is_not_checked(clock, hasher, salt):
    """Only a chain from the root needs its salt (the proto says so): the check for a root's
    key named as parent refused a batch for a salt below the root that nothing reads."""
    index = make_index(clock)
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, toks(1))])
    below = stored(hasher, toks(1, 2), start=1)._replace(cache_salt=salt)
    assert index.publish("a", "i1", 2, [below]).applied
    assert matched(index, toks(1, 2)) == {"a": 2}


@pytest.mark.parametrize("field, value", [
    ("lease_seconds", 0.05), ("max_events", 2**32), ("max_blocks", 2**32),
    ("max_nodes", 2**64)])
def test_config_values_that_fail_later_are_refused_at_start(field, value):
    from services.common.config import ConfigError
    from services.prefix.config import PrefixConfig

    with pytest.raises(ConfigError, match=f"TIERCACHE_PREFIX_{field.upper()}"):
        PrefixConfig(**{field: value}).validate()


def test_a_full_batch_fits_one_grpc_message_at_any_block_size():
    """The index advertised 65,536 blocks a batch whatever their size: of 1,024 tokens a full
    batch was ~340 MB, and replicas filling batches to it sent what no server takes."""
    from tiercache.v1 import prefix_pb2

    from services.common.bootstrap import DEFAULT_MAX_MESSAGE_BYTES
    from services.common.hashing import MAX_SALT_CHARS
    from services.common.prefix_client import batch_blocks
    from services.prefix.config import PrefixConfig
    from services.prefix.server import build_index

    assert build_index(PrefixConfig()).max_blocks == PrefixConfig().max_blocks  # 16 tokens
    for bs in (16, 1024):
        n = build_index(PrefixConfig(block_size=bs)).max_blocks
        assert n == batch_blocks(bs, 65536) and (bs == 16 or n < 4000)
        # The worst batch: every block an event of its own, every token id 5 bytes, and
        # 512 events (the most a replica sends) at the root with the longest salt.
        req = prefix_pb2.PublishEventsRequest(replica_id="r" * 256, incarnation="i" * 64,
                                              seq=2**64 - 2)
        for i in range(n):
            st = req.events.add().stored
            st.parent_hash, st.first_block_hash = b"\xff" * 16, b"\xfd" * 16
            st.block_hashes.append(b"\xfe" * 16)
            st.token_ids.extend([2**32 - 1] * bs)
            st.start_block = 2**32 - 1
            if i < 512:
                st.cache_salt = "\U0001f600" * MAX_SALT_CHARS
        assert req.ByteSize() < DEFAULT_MAX_MESSAGE_BYTES, (bs, n, req.ByteSize())
