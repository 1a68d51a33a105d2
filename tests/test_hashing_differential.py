"""A differential review of services/common/hashing.py: seeded random token sequences hashed by
the C path and the hashlib path (memo on and off, warm and cold spans, given parents) and
compared with a plain reimplementation of the documented chain after every call.

The model (from hashing.py's docstrings): h_0 = keyed BLAKE2b-128("tiercache/v1" NUL model NUL
salt), h_i = keyed BLAKE2b-128(h_{i-1} || block i as little-endian uint32), full blocks only,
one hashlib call per block. Per seed: a block size from 1 to 64 (16 + 4 x bs bytes per block
spans one to three BLAKE2b compressions, 28 and 60 end exactly on one), a key of 1 to 64 bytes,
a model id ("" and unicode too), and four hashers (C chain and hashlib, memo of 8 to 1,000
blocks and none) all compared: roots for every salt (up to 256 characters, shared prefixes,
unicode), the probe, chains from the root (lengths 0, 1, a block +-1, a span +-1, random;
token ids 0, 2^31, 2^32 - 1, random; shared prefixes and repeated blocks so memo spans hit, and
each memo hasher asked twice), resumed from any block's hash, from a parent of any length,
next_hash, token containers (list, tuple, array, numpy uint32 / int64, numpy scalars in a
list), and bad tokens (negative, 2^32, 2^64, float, str, None): the same exception from both
paths inside a full block, ignored by both past the last one. Also: pack_tokens, threads
sharing one hasher, and TIERCACHE_PURE_PYTHON_HASH in a subprocess.

Run offline: 10,000 seeds (and 3,000 on an earlier version). Found: no value defect; the C and
hashlib paths agree bit for bit everywhere tried. The module docstring gave the root as
H(model_id || cache_salt), without the "tiercache/v1" tag and NUL separators: fixed there.
Left as is: a parent that is not 16 bytes is chained from as given on the hashlib path (the C
path is not used for it), the hasher itself takes an empty key (unkeyed BLAKE2b) and NUL in a
model id (the config and the index refuse those); `start_block` is unused, as documented.
Injected bugs: 16 of 16 caught (10 in hashing.py: root without NUL, big-endian packing, a
partial block hashed, memo entries under the wrong parent or rotated, root cache keyed by a
prefix, ...; 6 in _blockhash.c rebuilt with gcc: counter, byte order, key-length parameter,
range check, a message ending on a block boundary, no chaining).
`HASHING_DIFFERENTIAL_SEEDS=N` runs more (default 200, ~1.5 s).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from array import array
from hashlib import blake2b

import numpy as np
import pytest

from services.common import hashing
from services.common.hashing import BlockHasher, pack_tokens

SEEDS = int(os.environ.get("HASHING_DIFFERENTIAL_SEEDS", "200"))
STEPS = 30
BLOCK_SIZES = [1, 2, 3, 4, 7, 16, 27, 28, 29, 32, 60, 61, 64]
MODELS = ["m", "Qwen/Qwen2.5-0.5B", "modèle-🙂", ""]
SALTS = ["", "", "t1", "t10", "t1\x1f", "tenant-a", "tenant-b", "é🙂", "s" * 256,
         "0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdee"]


def root(key: bytes, model: str, salt: str) -> bytes:
    """h_0: keyed BLAKE2b-128 of "tiercache/v1" NUL model NUL salt (UTF-8)."""
    return blake2b(b"tiercache/v1\0" + model.encode() + b"\0" + salt.encode(), key=key,
                   digest_size=16).digest()


def chain(key: bytes, parent: bytes, bs: int, tokens: list[int]) -> list[bytes]:
    """h_i = keyed BLAKE2b-128(h_{i-1} || block i as little-endian uint32), full blocks only."""
    out, prev = [], parent
    for i in range(len(tokens) // bs):
        data = b"".join(int(t).to_bytes(4, "little") for t in tokens[i * bs : (i + 1) * bs])
        prev = blake2b(prev + data, key=key, digest_size=16).digest()
        out.append(prev)
    return out


def _tokens(rng: random.Random, bs: int, base: list[int]) -> list[int]:
    span = 8 * bs
    n = rng.choice([0, 1, bs - 1, bs, bs + 1, span - 1, span, span + 1, 2 * span + bs,
                    rng.randrange(0, 3 * span + 2)])
    kind = rng.random()
    if kind < 0.5:  # a shared prefix (memo hits), then new tokens
        cut = min(n, rng.choice([0, bs, span, 2 * span, rng.randrange(0, len(base) + 1)]))
        toks = base[:cut]
        toks = toks + [rng.randrange(2**32) for _ in range(max(0, n - len(toks)))]
    elif kind < 0.6:  # one block or one span over and over (padding, repeated turns)
        size = rng.choice([bs, 8 * bs])
        unit = rng.choice([[0] * size, base[:size], [rng.randrange(3) for _ in range(size)]])
        toks = (unit * (n // len(unit) + 1))[:n]
    elif kind < 0.7:  # extremes
        toks = [rng.choice([0, 1, 2**32 - 1, 2**31, 2**16]) for _ in range(n)]
    else:
        toks = [rng.randrange(rng.choice([2, 200_000, 2**32])) for _ in range(n)]
    return toks[:n] if len(toks) >= n else toks


def _container(rng: random.Random, toks: list[int]):
    c = rng.random()
    if c < 0.5:
        return toks
    if c < 0.6:
        return tuple(toks)
    if c < 0.7:
        return array("I", toks)
    if c < 0.8:
        return np.array(toks, dtype=np.uint32)
    if c < 0.9:
        return np.array(toks, dtype=np.int64)
    return [np.int64(t) if rng.random() < 0.5 else t for t in toks]


def run_seed(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice(BLOCK_SIZES)
    key = rng.choice([b"k", hashing.DEFAULT_KEY, bytes(range(64)),
                      bytes(rng.randrange(256) for _ in range(rng.randrange(1, 65)))])
    model = rng.choice(MODELS)
    memo = rng.choice([8, 16, 64, 1000])
    hashers = [BlockHasher(model, bs, key, memo_blocks=m, native=nat)
               for m in (memo, 0) for nat in (True, False)]
    assert (hashers[0]._chain is not None) == hashing.native()
    assert hashers[1]._chain is None
    base = [rng.randrange(2**32) for _ in range(3 * 8 * bs + bs)]
    for h in hashers:
        for salt in SALTS:
            assert h.root(salt) == root(key, model, salt)
        assert h.probe() == chain(key, root(key, model, ""), bs, list(range(bs)))[0]
    for _ in range(STEPS):
        toks = _tokens(rng, bs, base)
        salt = rng.choice(SALTS)
        op = rng.random()
        if op < 0.55:
            want = chain(key, root(key, model, salt), bs, toks)
            for h in hashers:
                assert h.hashes(_container(rng, toks), salt) == want, (seed, len(toks))
            for h in hashers[:2]:  # the next turn repeats the request: warm spans this time
                assert h.hashes(toks, salt) == want, (seed, len(toks))
            # Resume after block k from its hash: the rest of the same chain.
            if want:
                k = rng.randrange(len(want))
                for h in hashers:
                    got = h.hashes(_container(rng, toks[(k + 1) * bs :]), parent=want[k])
                    assert got == want[k + 1 :]
        elif op < 0.7:
            # A parent of any length (the hashlib path takes it as bytes to chain from).
            parent = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 15, 16, 17, 32])))
            want = chain(key, parent, bs, toks)
            for h in hashers:
                assert h.hashes(toks, salt, parent=parent) == want
        elif op < 0.8:
            parent = bytes(rng.randrange(256) for _ in range(16))
            block = toks[:bs] if len(toks) >= bs else [rng.randrange(2**32) for _ in range(bs)]
            want = chain(key, parent, bs, block)[0]
            for h in hashers:
                assert h.next_hash(parent, _container(rng, block)) == want
        else:
            # A bad token: refused alike when inside a full block, not looked at past the last.
            if len(toks) < bs:
                continue
            bad, exc = rng.choice([(-1, OverflowError), (2**32, OverflowError),
                                   (2**64, OverflowError), (1.0, TypeError), ("1", TypeError),
                                   (None, TypeError)])
            n_full = len(toks) // bs * bs
            inside = list(toks)
            inside[rng.randrange(n_full)] = bad
            for h in hashers:
                with pytest.raises(exc):
                    h.hashes(inside, salt)
            tail = toks[:n_full] + [bad] * rng.randrange(0, bs)
            want = chain(key, root(key, model, salt), bs, toks[:n_full])
            for h in hashers:
                assert h.hashes(tail, salt) == want


def test_hashing_against_the_model():
    for seed in range(SEEDS):
        run_seed(seed)


@pytest.mark.parametrize("native", [True, False])
def test_pack_tokens_is_little_endian_uint32_of_the_first_count(native: bool):
    rng = random.Random(5)
    for _ in range(300):
        toks = [rng.choice([0, 1, 255, 256, 2**32 - 1, rng.randrange(2**32)])
                for _ in range(rng.randrange(0, 40))]
        count = rng.randrange(0, len(toks) + 1)
        want = b"".join(t.to_bytes(4, "little") for t in toks[:count])
        assert pack_tokens(toks, count, native=native) == want
        assert pack_tokens(tuple(toks), count, native=native) == want
        assert pack_tokens(np.array(toks, dtype=np.uint64), count, native=native) == want


def _hammer(h: BlockHasher, jobs: list, errors: list[str], j: int) -> None:
    for r in range(30):
        toks, want = jobs[(j * 7 + r) % len(jobs)]
        if h.hashes(toks) != want:
            errors.append(f"thread {j} job {r}")


@pytest.mark.parametrize("native", [True, False])
def test_threads_sharing_a_hasher_get_the_definition(native: bool):
    """A hasher shared between threads may lose memo entries, never correctness (the C chain
    lets go of the GIL, so threads interleave inside a call)."""
    bs, key = 4, b"k"
    h = BlockHasher("m", bs, key, memo_blocks=16, native=native)
    rng = random.Random(3)
    base = [rng.randrange(2**32) for _ in range(8 * bs * 3)]
    jobs = []
    for i in range(40):
        toks = base[: rng.randrange(len(base))] + [i] * rng.randrange(0, 70)
        jobs.append((toks, chain(key, root(key, "m", ""), bs, toks)))
    errors: list[str] = []
    threads = [threading.Thread(target=_hammer, args=(h, jobs, errors, j)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_the_pure_python_switch_gives_the_same_digests():
    """TIERCACHE_PURE_PYTHON_HASH=1 turns the extension off (a config word like "off" keeps
    it); the digests do not change."""
    code = ("from services.common import hashing as h; b = h.BlockHasher('m', 16, b'k');"
            "print(h.native(), b.hashes(list(range(200)), 's')[-1].hex())")
    out = {}
    for value in ("1", "off"):
        env = {**os.environ, "TIERCACHE_PURE_PYTHON_HASH": value}
        out[value] = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                    capture_output=True, text=True).stdout.split()
    want = chain(b"k", root(b"k", "m", "s"), 16, list(range(200)))[-1].hex()
    assert out["1"] == ["False", want]
    assert out["off"] == [str(hashing.native()), want]
