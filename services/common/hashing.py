"""Chained, keyed block hashes: the one definition shared by kvpool and the prefix index.

    h_0 = H(model_id ‖ cache_salt)                 (root seed; never a block)
    h_i = H(h_{i-1} ‖ tokens of block i)           (i = 1..n, full blocks only)

H is BLAKE2b with a 128-bit digest, keyed with the cluster's hash key so that nobody without
the key can craft colliding blocks. Tokens are packed as little-endian uint32. Because the seed
includes the tenant's cache salt, two tenants' identical prompts share no hash and no block.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from hashlib import blake2b

DIGEST_SIZE = 16
DEFAULT_KEY = b"tiercache-dev-hash-key"  # dev only; production sets TIERCACHE_HASH_KEY
_LITTLE = array("I").itemsize == 4 and __import__("sys").byteorder == "little"


def hash_key_from_env() -> bytes:
    """The cluster hash key (`TIERCACHE_HASH_KEY`, at most 64 bytes), or the dev default."""
    raw = os.environ.get("TIERCACHE_HASH_KEY", "")
    key = raw.encode() if raw else DEFAULT_KEY
    if len(key) > 64:
        raise ValueError("TIERCACHE_HASH_KEY: at most 64 bytes")
    return key


class BlockHasher:
    """Computes chained block hashes for one model and block size with one key."""

    def __init__(self, model_id: str, block_size: int, key: bytes | None = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.model_id = model_id
        self.block_size = block_size
        self.key = hash_key_from_env() if key is None else key
        # A keyed state costs a key-block compression to set up; copying a prepared one is cheaper.
        self._proto = blake2b(key=self.key, digest_size=DIGEST_SIZE)
        self._roots: dict[str, bytes] = {}

    def root(self, cache_salt: str = "") -> bytes:
        """h_0 for a tenant salt (cached: few tenants, many requests)."""
        r = self._roots.get(cache_salt)
        if r is None:
            h = self._proto.copy()
            h.update(b"tiercache/v1\x00" + self.model_id.encode() + b"\x00" + cache_salt.encode())
            r = h.digest()
            if len(self._roots) < 65536:
                self._roots[cache_salt] = r
        return r

    def hashes(
        self, token_ids: Sequence[int], cache_salt: str = "", parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Hashes of every *full* block of `token_ids`.

        Args:
            token_ids: tokens from the start of the sequence (or from block `start_block`).
            cache_salt: tenant salt seeding the chain (ignored when `parent` is given).
            parent: hash of the block before `token_ids[0]`; None = start at the root.
            start_block: unused for hashing, kept for callers that resume a chain.
        Returns:
            One 16-byte hash per full block, in order.
        """
        bs = self.block_size
        n = len(token_ids) // bs
        if n == 0:
            return []
        buf = array("I", token_ids[: n * bs])
        if not _LITTLE:
            buf.byteswap()
        mv = memoryview(buf.tobytes())
        step = bs * 4
        prev = self.root(cache_salt) if parent is None else parent
        proto = self._proto
        out = []
        append = out.append
        for off in range(0, n * step, step):
            h = proto.copy()
            h.update(prev)
            h.update(mv[off : off + step])
            prev = h.digest()
            append(prev)
        return out

    def next_hash(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
        """Hash of one more full block after `parent`."""
        if len(block_tokens) != self.block_size:
            raise ValueError("block must be full")
        return self.hashes(block_tokens, parent=parent)[0]
