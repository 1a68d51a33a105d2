"""The consistent-hash ring and the memoised block hasher (both in services/common)."""

from __future__ import annotations

import random
from collections import Counter
from hashlib import blake2b

import pytest

from services.common.hashing import BlockHasher
from services.common.ring import HashRing


def test_ring_spreads_keys_and_moves_few_on_change():
    ring = HashRing([f"n{i}" for i in range(4)], vnodes=100)
    keys = [f"k{i}".encode() for i in range(4000)]
    owners = {k: ring.lookup(k) for k in keys}
    counts = Counter(owners.values())
    assert set(counts) == {"n0", "n1", "n2", "n3"}
    assert min(counts.values()) > 600  # 1000 each on average
    ring.add("n4")
    moved = [k for k in keys if ring.lookup(k) != owners[k]]
    assert all(ring.lookup(k) == "n4" for k in moved)  # keys only move to the new node
    assert 400 < len(moved) < 1300  # ~1/5 of the keys
    ring.remove("n4")
    assert all(ring.lookup(k) == owners[k] for k in keys)
    # Same nodes in any order -> same ring.
    other = HashRing(["n3", "n1", "n0", "n2"], vnodes=100)
    assert all(other.lookup(k) == owners[k] for k in keys[:500])


def test_ring_preference_and_errors():
    ring = HashRing(["a", "b", "c"])
    pref = ring.preference(b"key")
    assert sorted(pref) == ["a", "b", "c"] and pref[0] == ring.lookup(b"key")
    with pytest.raises(LookupError):
        HashRing().lookup(b"x")
    with pytest.raises(ValueError):
        ring.lookup_bounded(b"x", {}, -0.1)


def test_bounded_lookup_respects_the_cap():
    ring = HashRing(["a", "b", "c"], vnodes=50)
    key = b"session-1"
    owner = ring.lookup(key)
    assert ring.lookup_bounded(key, {}, 0.25) == owner
    # The owner is loaded beyond (1 + eps) * mean: the next node clockwise takes it.
    loads = {owner: 10, **{n: 0 for n in ring.nodes if n != owner}}
    got = ring.lookup_bounded(key, loads, 0.25)
    assert got == ring.preference(key)[1]
    # Over many sessions no node exceeds ceil((1 + eps) * mean) at any time.
    loads = dict.fromkeys(ring.nodes, 0)
    for i in range(300):
        n = ring.lookup_bounded(f"s{i}", loads, 0.1)
        loads[n] += 1
        assert max(loads.values()) <= ((1.1 * sum(loads.values())) / 3) + 1
    assert max(loads.values()) - min(loads.values()) <= 12


def _plain(key: bytes, model: str, bs: int, tokens: list[int], salt: str) -> list[bytes]:
    h0 = blake2b(b"tiercache/v1\x00" + model.encode() + b"\x00" + salt.encode(), key=key,
                 digest_size=16).digest()
    out, prev = [], h0
    for i in range(len(tokens) // bs):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[i * bs : (i + 1) * bs])
        prev = blake2b(prev + data, key=key, digest_size=16).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize("native", [True, False], ids=["c-chain-if-built", "hashlib"])
def test_memoised_hasher_equals_the_definition(native: bool):
    rng = random.Random(7)
    # tiny memo: generations turn over often
    memo = BlockHasher("m", 16, b"k", memo_blocks=64, native=native)
    cold = BlockHasher("m", 16, b"k", memo_blocks=0, native=native)
    base = [rng.randrange(200_000) for _ in range(160)]
    for _ in range(60):
        toks = base[: rng.randrange(0, 160)] + [rng.randrange(200_000)
                                                for _ in range(rng.randrange(0, 70))]
        salt = rng.choice(["", "t1"])
        want = _plain(b"k", "m", 16, toks, salt)
        assert memo.hashes(toks, salt) == want
        assert cold.hashes(toks, salt) == want
        k = len(want) // 2
        if k:
            assert memo.hashes(toks[k * 16 :], parent=want[k - 1]) == want[k:]
    assert memo.hashes([1] * 15) == []
    assert BlockHasher("m", 16, b"other").hashes(base) != memo.hashes(base)


def test_bounded_lookup_prefers_qualifying_nodes_in_prefer():
    ring = HashRing(["a", "b", "c"], vnodes=64)
    for i in range(50):
        key = f"k{i}"
        order = ring.preference(key)
        assert ring.lookup_bounded(key, {}, 0.25, prefer={order[2]}) == order[2]
        assert ring.lookup_bounded(key, {}, 0.25, prefer=set()) == order[0]
        # A preferred node over the cap is passed over for the first qualifying node.
        loads = {order[2]: 10.0}
        assert ring.lookup_bounded(key, loads, 0.25, prefer={order[2]}) == order[0]


def test_a_key_past_the_last_point_but_one_belongs_to_the_last_point():
    """A key belongs to the first point clockwise from its own: past the last point it wraps
    to the first, and between the last two it is the last point's."""
    from services.common.ring import _point

    for vnodes in range(4, 40):  # a ring whose first and last points have other owners
        ring = HashRing(["a", "b", "c"], vnodes=vnodes)
        points = sorted((_point(f"{n}#{i}".encode()), n) for n in ring.nodes
                        for i in range(vnodes))
        if points[0][1] != points[-1][1] != points[-2][1]:
            break
    seen = set()
    for i in range(20000):
        key = f"k{i}".encode()
        p = _point(key)
        if points[-2][0] < p < points[-1][0]:
            assert ring.lookup(key) == points[-1][1]
            seen.add("last")
        elif p > points[-1][0]:
            assert ring.lookup(key) == points[0][1]
            seen.add("wrap")
    assert seen == {"last", "wrap"}


def test_a_node_running_no_more_than_floor_requests_always_qualifies():
    """With many nodes and little traffic the bounded-load ceiling is 1; a node running at
    most `floor` requests still takes the key."""
    ring = HashRing([f"n{i}" for i in range(10)], vnodes=16)
    for i in range(20):
        key = f"s{i}"
        owner = ring.lookup(key)
        assert ring.lookup_bounded(key, {owner: 2}, 0.25, floor=2) == owner
        assert ring.lookup_bounded(key, {owner: 3}, 0.25, floor=2) == ring.preference(key)[1]


def test_when_no_node_qualifies_the_least_loaded_one_not_skipped_is_taken():
    """Should no node qualify (epsilon 0, fractional loads: 2.5 > ceil(4 / 2)), the least
    loaded node is taken, the first in preference order, never one in `skip` (a request's
    failed replicas)."""
    ring = HashRing(["a", "b", "c"], vnodes=16)
    for i in range(20):
        key = f"k{i}"
        first = next(n for n in ring.preference(key) if n != "c")
        assert ring.lookup_bounded(key, {"a": 1.5, "b": 1.5, "c": 0.0}, 0.0,
                                   skip={"c"}) == first


def test_skipped_nodes_do_not_count_toward_the_load_cap():
    """Nodes in `skip` are passed over and not counted: a heavily loaded failed replica
    does not raise the ceiling that keeps the others balanced."""
    ring = HashRing(["a", "b", "c"], vnodes=16)
    for i in range(20):
        key = f"k{i}"
        owner, other = [n for n in ring.preference(key) if n != "c"]
        loads = {owner: 2, other: 0, "c": 30}  # cap ceil(1.25 * 3 / 2) = 2 without c
        assert ring.lookup_bounded(key, loads, 0.25, skip={"c"}) == other


def test_a_salt_of_the_longest_allowed_length_is_taken():
    """check_salt takes salts of up to MAX_SALT_CHARS characters and refuses one more."""
    from services.common.errors import InvalidArgument
    from services.common.hashing import MAX_SALT_CHARS, check_salt

    assert check_salt("cache_salt", "s" * MAX_SALT_CHARS) == "s" * MAX_SALT_CHARS
    with pytest.raises(InvalidArgument, match="cache_salt"):
        check_salt("cache_salt", "s" * (MAX_SALT_CHARS + 1))


def test_a_hasher_refuses_an_empty_block_size_and_next_hash_a_block_not_full():
    """Blocks have at least one token, and next_hash hashes one full block only."""
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher("m", 0, b"k")
    h = BlockHasher("m", 4, b"k")
    parent = h.root()
    assert h.next_hash(parent, [1, 2, 3, 4]) == h.hashes([1, 2, 3, 4])[0]
    for short in ([1, 2, 3], [1, 2, 3, 4, 5]):
        with pytest.raises(ValueError, match="full"):
            h.next_hash(parent, short)

