"""The C block-hash chain (services/common/_blockhash.c) against the definition.

Every path of BlockHasher.hashes (memo on/off, warm/cold spans, a given parent) must give the
same digests with the extension and with hashlib; packing must refuse what array("I") refuses.
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest

from services.common import hashing
from services.common.hashing import BlockHasher
from tests.prefix.test_prefix_ring_hashing import _plain

native = pytest.mark.skipif(hashing._blockhash is None, reason="C extension not built")


def test_the_extension_is_built_where_a_compiler_is():
    """`make setup` (pip install -e) builds it; a silent fallback would hide a slow path."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: hashlib fallback by design")
    import os
    if os.environ.get("TIERCACHE_PURE_PYTHON_HASH", "") not in ("", "0"):
        pytest.skip("turned off by TIERCACHE_PURE_PYTHON_HASH")
    assert hashing.native()


@native
@pytest.mark.parametrize("bs", [1, 2, 16, 28, 29, 32, 33, 64])
def test_chain_equals_hashlib_for_block_sizes_that_span_compressions(bs: int):
    # 16 + 4 * bs bytes per block: bs >= 29 needs two BLAKE2b compressions, 61+ three.
    rng = random.Random(bs)
    for key in (b"k", b"tiercache-dev-hash-key", bytes(range(64))):
        toks = [rng.randrange(2**32) for _ in range(bs * 5 + rng.randrange(bs))]
        want = _plain(key, "m", bs, toks, "salt")
        got = BlockHasher("m", bs, key, memo_blocks=0).hashes(toks, "salt")
        assert got == want


@pytest.mark.parametrize("native", [True, False], ids=["c-chain", "hashlib"])
def test_spans_each_path_remembers_map_to_their_hashes(native: bool):
    """The memo entries written after a C chain or hashlib's: (parent ‖ the span's first
    block) -> (its other blocks, its hashes) (every hashing path is compared with the
    definition in test_prefix_ring_hashing)."""
    if native and hashing._blockhash is None:
        pytest.skip("C extension not built")
    rng = random.Random(11)
    # tiny: generations turn over often
    fast = BlockHasher("m", 16, b"key", memo_blocks=64, native=native)
    slow = BlockHasher("m", 16, b"key", memo_blocks=0, native=False)
    assert (fast._chain is not None) == native and slow._chain is None
    base = [rng.randrange(200_000) for _ in range(400)]
    for _ in range(40):
        toks = base[: rng.randrange(0, 400)] + [rng.randrange(200_000)
                                                for _ in range(rng.randrange(0, 300))]
        assert fast.hashes(toks) == _plain(b"key", "m", 16, toks, "")
    memo = {**fast._old, **fast._young}
    assert len(memo) > 4
    for key, (rest, *digests) in memo.items():
        tokens = np.frombuffer(key[16:] + rest, dtype="<u4").tolist()
        assert len(key) == 16 + 16 * 4 and len(tokens) == 8 * 16
        assert slow.hashes(tokens, parent=key[:16]) == digests


@pytest.mark.parametrize("native", [True, False], ids=["c-chain-if-built", "hashlib"])
def test_spans_sharing_parent_and_first_block_never_take_each_others_hashes(native: bool):
    """The memo's key is (parent ‖ a span's first block): spans that differ only later in
    the span share it, and each must still get its own digests, cold and warm, in any order."""
    rng = random.Random(12)
    head = [rng.randrange(49_152) for _ in range(16 * 9)]  # one whole span, then a block
    spans = [head + [rng.randrange(49_152) for _ in range(16 * 7)] for _ in range(3)]
    spans.append(spans[0][:-1] + [spans[0][-1] ^ 1])  # only the span's last token differs
    h = BlockHasher("m", 16, b"key", native=native)
    for toks in spans + spans[::-1] + spans:
        assert h.hashes(toks) == _plain(b"key", "m", 16, toks, "")


@pytest.mark.parametrize("native", [True, False], ids=["c-chain-if-built", "hashlib"])
def test_a_span_found_in_the_old_generation_moves_into_the_young_one(native: bool):
    """Hot spans survive every generation change: each span a call finds in the old
    generation is put in the young one (left there, it went with the next change)."""
    rng = random.Random(13)
    toks = [rng.randrange(49_152) for _ in range(16 * 8 * 2 + 5)]  # two spans, then some
    h = BlockHasher("m", 16, b"key", native=native)
    want = h.hashes(toks)
    h._old, h._young = h._young, {}
    h._hashlib_chain = lambda *a: pytest.fail("a span the old generation holds was hashed")
    assert h.hashes(toks[: 16 * 8 * 2]) == want[:16]  # both spans found, nothing hashed
    assert len(h._young) == 2 and h._young == h._old


@native
def test_pack_accepts_integer_types_and_refuses_what_array_refuses():
    ok = [0, 1, 2**32 - 1, np.int64(5), np.uint32(7), True]
    want = hashing.pack_tokens([0, 1, 2**32 - 1, 5, 7, 1], 6, native=False)
    assert hashing.pack_tokens(ok, 6) == want
    assert hashing.pack_tokens(range(4), 4) == hashing.pack_tokens([0, 1, 2, 3], 4, native=False)
    assert hashing.pack_tokens(np.arange(5), 3) == hashing.pack_tokens([0, 1, 2], 3, native=False)
    for bad, exc in (([-1], OverflowError), ([2**32], OverflowError), ([1.5], TypeError),
                     (["1"], TypeError)):
        with pytest.raises(exc):
            hashing.pack_tokens(bad, 1)
        with pytest.raises(exc):
            hashing.pack_tokens(bad, 1, native=False)
    with pytest.raises(ValueError):
        hashing._blockhash.pack([1, 2], 3)


@native
def test_pack_checks_only_the_tokens_it_packs_and_refuses_too_few_either_way():
    """The C and Python packers agree on edge cases: a bad token past `count` is not packed
    (nor refused), and fewer tokens than `count`, or a negative `count`, is an error in both
    (the Python packer took -1 as a slice bound: [1, 2, 3] packed as [1])."""
    for native in (True, False):
        assert hashing.pack_tokens([1, 2, 3, 4, -5], 4, native=native) == \
            hashing.pack_tokens([1, 2, 3, 4], 4, native=False)
        with pytest.raises(ValueError):
            hashing.pack_tokens([1, 2], 3, native=native)
        with pytest.raises(ValueError):
            hashing.pack_tokens([1, 2, 3], -1, native=native)


@native
def test_chain_rejects_malformed_arguments():
    chain = hashing._blockhash.chain
    good = bytes(64)
    assert len(chain(b"k", bytes(16), good, 16)) == 1
    assert chain(b"k", bytes(16), b"", 16) == []
    with pytest.raises(ValueError, match="parent"):
        chain(b"k", bytes(15), good, 16)
    with pytest.raises(ValueError, match="key"):
        chain(b"", bytes(16), good, 16)
    with pytest.raises(ValueError, match="key"):
        chain(bytes(65), bytes(16), good, 16)
    with pytest.raises(ValueError, match="whole number of blocks"):
        chain(b"k", bytes(16), good[:-4], 16)
    with pytest.raises(ValueError, match="block_size"):
        chain(b"k", bytes(16), good, 0)


@native
@pytest.mark.parametrize("at", [0, 2])
def test_pack_survives_a_token_whose_index_method_shrinks_the_list(at: int):
    """Python code runs inside pack (an __index__); it must not read freed list memory, first
    or after plain ints (read in a loop of their own: it hands over to the checked reads)."""
    toks: list = []

    class Shrinks:
        def __index__(self) -> int:
            del toks[at + 1 :]
            return 7

    toks.extend([1, 2][:at] + [Shrinks(), 1, 2, 3])
    for packs in (hashing.pack_tokens, lambda t, n: hashing.token_planes(t, n, False)):
        with pytest.raises(RuntimeError, match="changed size"):
            packs(toks, at + 4)
        toks[at + 1 :] = [1, 2, 3]


# Digests as the hashlib definition gave them (dev key): a change to the C chain, the packer or
# the memo that moves any block hash breaks every index and pool already holding blocks.
_KEY = b"tiercache-dev-hash-key"
_PINNED = [
    ("bench-model", 16, "", list(range(40)), "499fe191c454cc6c054ce0a1cf314dbf",
     ["a92ce5174e183e2e065093c9ba136d03", "e32d6737a90586b5a3c4eaa64a36a5f6"]),
    ("bench-model", 16, "t1", [49151 - i for i in range(32)], "bdfc942b1b4141c11339d659258c390c",
     ["71fc602227cd3d3c99323f0aed672ef7", "e298246f303559174dc84c0cd8d39d9a"]),
    ("m", 29, "", [2**32 - 1] * 29 + [0] * 29, "51d1e7e45eda1783d1731587562ec040",
     ["a829e51675cb954fc01d516f6b0784bb", "a0db58b43146c200ee3d79cb20b1afbf"]),
    ("m", 1, "s", [7, 2**16], "198f93697fb12e94dc2d1a5604a3a2bb",
     ["57c0cc80452a699f067a5c8e7ef7a67c", "0161911ba1785d1f4b4d728feffa68f3"]),
]


@pytest.mark.parametrize("native", [True, False], ids=["c-chain-if-built", "hashlib"])
@pytest.mark.parametrize("memo", [0, 64])
def test_block_hashes_are_pinned(native: bool, memo: int):
    for model, bs, salt, toks, root, want in _PINNED:
        h = BlockHasher(model, bs, _KEY, memo_blocks=memo, native=native)
        assert h.root(salt).hex() == root
        for _ in range(2):  # the second call takes the memo's spans where there is one
            assert [d.hex() for d in h.hashes(toks, salt)] == want
    long = [i * 7919 % 2**32 for i in range(16 * 20)]  # two whole 8-block spans and 4 more
    h = BlockHasher("bench-model", 16, _KEY, memo_blocks=memo, native=native)
    for _ in range(2):
        got = h.hashes(long)
        assert [got[i].hex() for i in (7, 15, 19)] == [
            "85132a1e924c1fddfaef72cc53eb469c", "ab2707c7cc27066a5029738d7d14dd70",
            "9e8a6fa4d0076c3445272bd292e81be5"]


@native
def test_memo_chain_answers_what_chain_does_and_checks_its_memo():
    """`memo_chain` (the memo's walk in C) gives `chain`'s digests cold, warm (young), after a
    generation change (old, promoted into young), and refuses a memo entry that is no span."""
    mc, chain = hashing._blockhash.memo_chain, hashing._blockhash.chain
    rng = random.Random(5)
    data = hashing.pack_tokens([rng.randrange(2**32) for _ in range(16 * 21)], 16 * 21)
    want = chain(b"k", bytes(16), data, 16)
    young: dict = {}
    assert mc(b"k", bytes(16), data, 16, 8, young, {}) == want
    assert len(young) == 2  # two whole spans of 8 blocks; the 5 left are no span
    assert mc(b"k", bytes(16), data, 16, 8, young, {}) == want
    old, young = young, {}
    assert mc(b"k", bytes(16), data, 16, 8, young, old) == want
    assert young == old
    young[next(iter(young))] = ("not a digest",) * 8
    with pytest.raises(TypeError, match="memo"):
        mc(b"k", bytes(16), data, 16, 8, young, {})
    k, (rest, *digests) = next(iter(old.items()))
    young = {k: (rest, *digests[:-1], b"short")}  # the right shape, a digest of 5 bytes
    with pytest.raises(TypeError, match="memo: a digest is not 16 bytes"):
        mc(b"k", bytes(16), data, 16, 8, young, {})
    with pytest.raises(ValueError, match="span_blocks"):
        mc(b"k", bytes(16), data, 16, 0, {}, {})
    with pytest.raises(ValueError, match="parent"):
        mc(b"k", bytes(15), data, 16, 8, {}, {})


@native
def test_planes_are_the_packed_bytes_split_and_refuse_what_pack_refuses(monkeypatch):
    """The C `planes` against the hashlib build's slicing of `pack_tokens` (the tree's token
    store): two planes below 2**16 unless wide, four from the first token past it."""
    rng = random.Random(9)
    cases = [([], False), ([0, 1, 2**16 - 1], False), ([5, 2**16, 7], False), ([1, 2], True),
             ([rng.randrange(2**32) for _ in range(300)], False), ([np.int64(3), True], False),
             ([3, 2**24, 4], False)]  # its third byte 0, its fourth not
    got = [hashing.token_planes(t, len(t), w) for t, w in cases]
    monkeypatch.setattr(hashing, "_blockhash", None)
    assert got == [hashing.token_planes(t, len(t), w) for t, w in cases]
    assert [len(p) for p in got] == [2, 2, 4, 4, 4, 2, 4]
    monkeypatch.undo()
    for bad, exc in (([-1], OverflowError), ([2**32], OverflowError), (["1"], TypeError)):
        with pytest.raises(exc):
            hashing.token_planes(bad, 1, False)
    with pytest.raises(ValueError):
        hashing.token_planes([1], 2, False)
