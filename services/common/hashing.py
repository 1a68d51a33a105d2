"""Chained, keyed block hashes: the one definition shared by kvpool and the prefix index.

    h_0 = H("tiercache/v1" ‖ NUL ‖ model_id ‖ NUL ‖ cache_salt)   (root seed; never a block)
    h_i = H(h_{i-1} ‖ tokens of block i)                            (i = 1..n, full blocks only)

H is BLAKE2b with a 128-bit digest, keyed with the cluster's hash key so that nobody without
the key can craft colliding blocks; strings are UTF-8 and NUL is one zero byte. Tokens are packed
as little-endian uint32. Because the seed includes the tenant's cache salt, two tenants'
identical prompts share no hash and no block.

Speed: one keyed BLAKE2b call per block costs ~0.6 µs in CPython, and most of a request's
blocks are a shared system prompt or an earlier turn whose hashes were computed moments ago.
A hasher therefore remembers recent spans of 8 blocks (aligned from the start of the call; a
bounded memo of two generations, which approximates LRU) as `(h_{i-1} ‖ the span's first
block) -> (the rest of the span's tokens, its 8 hashes)`: one dict lookup and one comparison
replace eight BLAKE2b calls. (Keyed by the whole span, every lookup hashed 528 bytes for the
dict, most of its cost; now 80, and the rest is compared with the entry.) The memo is exact —
a span is taken only where all its tokens and its parent are the entry's — so it changes
speed, never values. Two spans that differ only after their first block share a key: the
newer replaces the older (a miss then costs ≤ 8 BLAKE2b calls). Once one span of a chain
misses, every later span has a new parent and would miss too, so the rest of the chain skips
lookups.

When the optional C extension `services.common._blockhash` is built (setup.py; it needs a C
compiler), packing, the memo's lookups and the cold part of the chain run there: one call
instead of a hashlib state per block and a Python loop per span. It computes the same digests
(tests compare it with hashlib on every path); `TIERCACHE_PURE_PYTHON_HASH=1` turns it off.
"""

from __future__ import annotations

import logging
import os
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

from services.common.config import ConfigError, parse_bool
from services.common.errors import InvalidArgument

DIGEST_SIZE = 16
DEFAULT_KEY = b"tiercache-dev-hash-key"  # dev only; production sets TIERCACHE_HASH_KEY
DEFAULT_MEMO_BLOCKS = 16384  # per generation; two generations hold at most ~3 MB
SPAN_BLOCKS = 8  # blocks remembered (and looked up) together
_LITTLE = array("I").itemsize == 4 and sys.byteorder == "little"

try:
    from services.common import _blockhash

    # A build from an older _blockhash.c (not rebuilt since) lacks these: taken as none.
    _blockhash.memo_chain, _blockhash.planes  # noqa: B018
except (ImportError, AttributeError):  # no compiler where this was installed: hashlib below
    _blockhash = None


def pure_python_from_env() -> bool:
    """`TIERCACHE_PURE_PYTHON_HASH`, read as the config module's booleans ("" = unset: off).

    Raises:
        ConfigError: another word ("enable", "2"), which kept the C hasher without a word.
    """
    given = os.environ.get("TIERCACHE_PURE_PYTHON_HASH", "")
    return bool(given.strip()) and parse_bool(given, "TIERCACHE_PURE_PYTHON_HASH")


log = logging.getLogger(__name__)
_built = _blockhash is not None  # the C extension imported, whether or not it is used
_said = False  # `say_which_hasher` said it in this process

# A word that is neither is refused at start (`load_service_config`), not here at import.
try:
    if pure_python_from_env():
        _blockhash = None
except ConfigError:
    pass


def native() -> bool:
    """Whether hashers use the C extension (for stats and tests)."""
    return _blockhash is not None


def say_which_hasher() -> None:
    """Said once per process, at the start of a service that hashes blocks, when hashes come
    from hashlib: nothing at run time told that the C hasher was missing (an install without
    a compiler), only a slower service. WARNING when it is missing, INFO when
    TIERCACHE_PURE_PYTHON_HASH asked for hashlib; nothing when the C hasher is used."""
    global _said
    if _said or native():
        return
    _said = True
    if _built:
        log.info("block hashes use hashlib, as TIERCACHE_PURE_PYTHON_HASH asks (the same "
                 "digests as the C hasher, slower)")
        return
    # The figure: services/prefix/README.md's benchmark (memo on, most prompts repeat); on
    # 1,350-token prompts never hashed before, ~60 µs against ~44 µs on a 2-core host.
    log.warning("the C block hasher (services/common/_blockhash) is not built: block hashes "
                "use hashlib, the same digests but slower (~40 µs a ~1,350-token request "
                "against ~35 µs in the prefix benchmark, ~1.4x on prompts never seen "
                "before); install where a C compiler is found to build it (README)")


def hash_key_from_env() -> bytes:
    """The cluster hash key (`TIERCACHE_HASH_KEY`, at most 64 bytes), or the dev default.

    Raises:
        ConfigError (a ValueError): the key is longer than 64 bytes, or set but empty.
    """
    raw = os.environb.get(b"TIERCACHE_HASH_KEY", b"") if os.supports_bytes_environ else (
        os.environ.get("TIERCACHE_HASH_KEY", "").encode())
    if "TIERCACHE_HASH_KEY" in os.environ and not raw.strip():
        # A Secret made from an unset variable: the public development key, without a word.
        raise ConfigError("TIERCACHE_HASH_KEY: set but empty; unset it to use the "
                          "development key")
    key = raw or DEFAULT_KEY
    if len(key) > 64:
        raise ConfigError("TIERCACHE_HASH_KEY: at most 64 bytes")
    return key


def pack_tokens(token_ids: Sequence[int], count: int, native: bool = True) -> bytes:
    """The first `count` tokens as little-endian uint32 bytes."""
    if native and _blockhash is not None:
        return _blockhash.pack(token_ids, count)
    if not 0 <= count <= len(token_ids):  # as in C: a negative count is no slice bound
        raise ValueError(f"pack_tokens: count={count} not in [0, {len(token_ids)} tokens]")
    if len(token_ids) != count:  # only the first `count` are packed (and checked), as in C
        token_ids = token_ids[:count]
    if type(token_ids) is list:
        # fromlist indexes the list directly: ~2x faster than array("I", list) item iteration.
        buf = array("I")
        buf.fromlist(token_ids)
    else:
        buf = array("I", token_ids)
    if len(buf) != count:
        del buf[count:]
    if not _LITTLE:
        buf.byteswap()
    return buf.tobytes()


def token_planes(token_ids: Sequence[int], count: int, wide: bool) -> list[bytes]:
    """The first `count` tokens as byte planes: plane p holds byte p (little-endian) of each.
    Two planes where every token is below 2**16 and not `wide`, else four (the prefix tree's
    token store). Refuses what `pack_tokens` refuses."""
    if _blockhash is not None:
        return _blockhash.planes(token_ids, count, wide)
    raw = pack_tokens(token_ids, count)
    if not wide and raw[2::4].count(0) == count and raw[3::4].count(0) == count:
        return [raw[0::4], raw[1::4]]
    return [raw[0::4], raw[1::4], raw[2::4], raw[3::4]]


# Longest cache_salt an RPC accepts (the orchestrator sends 32 hex characters).
MAX_SALT_CHARS = 256


def check_salt(field: str, cache_salt: str) -> str:
    """`cache_salt`, or InvalidArgument naming `field` when it is too long or holds NUL.

    The root hashes model and salt with NUL between them, so a NUL inside either could make
    model "a" with salt "b\\0" the same root as model "a\\0b" with no salt (one model's
    blocks taken for another's); the index refuses NUL in a model id too."""
    if len(cache_salt) > MAX_SALT_CHARS:
        raise InvalidArgument(field, f"{len(cache_salt)} characters > limit {MAX_SALT_CHARS}")
    if "\0" in cache_salt:
        raise InvalidArgument(field, "must not contain NUL")
    return cache_salt


class BlockHasher:
    """Computes chained block hashes for one model and block size with one key.

    Safe to share between threads: concurrent calls may lose memo entries, never correctness
    (each memo entry is an exact input -> digest pair).
    """

    def __init__(self, model_id: str, block_size: int, key: bytes | None = None,
                 memo_blocks: int = DEFAULT_MEMO_BLOCKS, native: bool = True) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        if memo_blocks < 0:
            raise ValueError("memo_blocks must be >= 0")
        self.model_id = model_id
        self.block_size = block_size
        self.key = hash_key_from_env() if key is None else key
        # A keyed state costs a key-block compression to set up; copying a prepared one is cheaper.
        self._proto = blake2b(key=self.key, digest_size=DIGEST_SIZE)
        self._roots: dict[str, bytes] = {}
        self._memo_blocks = memo_blocks
        # The C chain, or None for hashlib (native=False: tests compare the two).
        self._chain = (_blockhash.chain if native and _blockhash is not None
                       and 1 <= len(self.key) <= 64 else None)
        # (parent ‖ a span's first block) -> (the span's other blocks, packed; its digests)
        self._young: dict[bytes, tuple[bytes, ...]] = {}
        self._old: dict[bytes, tuple[bytes, ...]] = {}

    def root(self, cache_salt: str = "") -> bytes:
        """h_0 for a tenant salt (cached: few tenants, many requests)."""
        r = self._roots.get(cache_salt)
        if r is None:
            h = self._proto.copy()
            h.update(b"tiercache/v1\x00" + self.model_id.encode() + b"\x00" + cache_salt.encode())
            r = h.digest()
            # Only salt-sized keys are kept: a caller's megabyte string must not stay resident.
            if len(self._roots) < 65536 and len(cache_salt) <= 128:
                self._roots[cache_salt] = r
        return r

    def hashes(
        self, token_ids: Sequence[int], cache_salt: str = "", parent: bytes | None = None
    ) -> list[bytes]:
        """Hashes of every *full* block of `token_ids`.

        Args:
            token_ids: tokens from the start of the sequence (or from the block after
                `parent`).
            cache_salt: tenant salt seeding the chain (ignored when `parent` is given).
            parent: hash of the block before `token_ids[0]`; None = start at the root.
        Returns:
            One 16-byte hash per full block, in order.
        """
        n = len(token_ids) // self.block_size
        if n == 0:
            return []
        chain = self._chain if parent is None or len(parent) == DIGEST_SIZE else None
        data = pack_tokens(token_ids, n * self.block_size, chain is not None)
        prev = self.root(cache_salt) if parent is None else parent
        if self._memo_blocks:
            young = self._young
            if chain is not None:
                # `_memo_spans` in one C call (~0.4 us a span in Python, most of it the loop).
                out = _blockhash.memo_chain(self.key, prev, data, self.block_size, SPAN_BLOCKS,
                                            young, self._old)
            else:
                out = self._memo_spans(prev, data)
            if len(young) * SPAN_BLOCKS >= self._memo_blocks:
                # Two generations approximate LRU with O(1) work: what was not touched during a
                # whole generation is dropped with the old dict.
                self._old, self._young = young, {}
            return out
        if chain is not None:
            return chain(self.key, prev, data, self.block_size)
        return self._hashlib_chain(prev, data)

    def _hashlib_chain(self, prev: bytes, data: bytes) -> list[bytes]:
        """The chain of the packed blocks `data` from `prev` with hashlib (`chain` in C)."""
        step = self.block_size * 4
        cp = self._proto.copy
        out = []
        append = out.append
        for off in range(0, len(data), step):
            h = cp()
            h.update(prev)
            h.update(data[off : off + step])
            prev = h.digest()
            append(prev)
        return out

    def _memo_spans(self, prev: bytes, data: bytes) -> list[bytes]:
        """The chain of the packed blocks `data` from `prev` with hashlib and the memo."""
        step = self.block_size * 4
        sstep = SPAN_BLOCKS * step
        young, old = self._young, self._old
        out: list[bytes] = []
        end = len(data)
        off = 0
        # Warm part, a whole span of blocks per lookup: shared system prompts, earlier turns.
        while off + sstep <= end:
            key = prev + data[off : off + step]
            hs = young.get(key) or old.get(key)
            if hs is None or hs[0] != data[off + step : off + sstep]:
                break
            young[key] = hs  # promote: hot spans survive every generation change
            out.extend(hs[1:])
            prev = hs[-1]
            off += sstep
        # Cold part: remember each new full span (the next turn repeats this request).
        while off < end:
            span = data[off : off + sstep]
            hs = self._hashlib_chain(prev, span)
            if len(span) == sstep:
                young[prev + span[:step]] = (span[step:], *hs)
            out += hs
            prev = hs[-1]
            off += sstep
        return out

    def probe(self) -> bytes:
        """Hash of the block [0, 1, ..., block_size-1] at the unsalted root.

        Two hashers agree on every chain iff they agree on this (same key, model and block
        size): a replica sends it when registering so the index can refuse a misconfigured one.
        """
        return self.hashes(range(self.block_size))[0]

    def next_hash(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
        """Hash of one more full block after `parent`."""
        if len(block_tokens) != self.block_size:
            raise ValueError("block must be full")
        return self.hashes(block_tokens, parent=parent)[0]
