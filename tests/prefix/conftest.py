"""Fixtures for the prefix index tests: a hand-driven clock, an index, chain builders."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.common.hashing import BlockHasher
from services.prefix.index import PrefixIndex, Stored
from tests.clock import Clock

BS = 4
MODEL = "m"
KEY = b"test-key"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def hasher() -> BlockHasher:
    return BlockHasher(MODEL, BS, KEY)


def make_index(clock: Clock, **kw) -> PrefixIndex:
    kw.setdefault("lease_seconds", 10.0)
    kw.setdefault("verify_hashes", True)  # also makes check_integrity re-hash every node
    return PrefixIndex(BS, hash_key=KEY, clock=clock, **kw)


@pytest.fixture
def index(clock: Clock) -> PrefixIndex:
    return make_index(clock)


def toks(*blocks: int) -> list[int]:
    """Tokens of blocks named by small ints: block b = [b*10+0, .., b*10+3]."""
    return [b * 10 + i for b in blocks for i in range(BS)]


def stored(hasher: BlockHasher, tokens: Sequence[int], start: int = 0, salt: str = "",
           end: int | None = None) -> Stored:
    """A stored event for blocks [start, end) of the chain `tokens` (from the root)."""
    hs = hasher.hashes(tokens, salt)
    end = len(hs) if end is None else end
    parent = hs[start - 1] if start else b""
    return Stored(parent, hs[start:end], list(tokens[start * BS : end * BS]), salt, hs[0], start)


def matched(index: PrefixIndex, tokens: Sequence[int], salt: str = "") -> dict[str, int]:
    r = index.match(MODEL, salt, token_ids=tokens)
    return {m.replica_id: m.matched_blocks for m in r.matches}


def sweep_for(index, clock, turns: int) -> list[str]:
    """`turns` turns of the lease sweeper, on time (a quarter lease apart); who it dropped."""
    gone = []
    for _ in range(turns):
        clock.t += index.lease_seconds / 4
        gone += index.sweep()
    return gone
