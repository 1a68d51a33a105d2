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


@native
def test_spans_the_c_path_remembers_map_to_their_hashes():
    """The memo entries written after a C chain: (parent ‖ 8 packed blocks) -> their hashes
    (every hashing path is compared with the definition in test_prefix_ring_hashing)."""
    rng = random.Random(11)
    fast = BlockHasher("m", 16, b"key", memo_blocks=64)  # tiny: generations turn over often
    slow = BlockHasher("m", 16, b"key", memo_blocks=0, native=False)
    assert fast._chain is not None and slow._chain is None
    base = [rng.randrange(200_000) for _ in range(400)]
    for _ in range(40):
        toks = base[: rng.randrange(0, 400)] + [rng.randrange(200_000)
                                                for _ in range(rng.randrange(0, 300))]
        assert fast.hashes(toks) == _plain(b"key", "m", 16, toks, "")
    memo = {**fast._old, **fast._young}
    assert len(memo) > 4
    for key, digests in memo.items():
        tokens = np.frombuffer(key[16:], dtype="<u4").tolist()
        assert len(tokens) == 8 * 16
        assert slow.hashes(tokens, parent=key[:16]) == list(digests)


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
    (nor refused), and fewer tokens than `count` is an error in both."""
    for native in (True, False):
        assert hashing.pack_tokens([1, 2, 3, 4, -5], 4, native=native) == \
            hashing.pack_tokens([1, 2, 3, 4], 4, native=False)
        with pytest.raises(ValueError):
            hashing.pack_tokens([1, 2], 3, native=native)


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
def test_pack_survives_a_token_whose_index_method_shrinks_the_list():
    """Python code runs inside pack (an __index__); it must not read freed list memory."""
    toks: list = []

    class Shrinks:
        def __index__(self) -> int:
            del toks[1:]
            return 7

    toks.extend([Shrinks(), 1, 2, 3])
    with pytest.raises(RuntimeError, match="changed size"):
        hashing.pack_tokens(toks, 4)
