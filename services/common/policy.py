"""Eviction policy shared by the kvpool's block pool and the prefix index.

Blocks (or index nodes) that start before `shallow_tokens` (default 128) hold the shared base
of many prompts — system prompts — so they are ranked by how often they are used (LFU). Deeper
blocks follow current traffic and are ranked by recency (LRU). Deep blocks always go before
shallow ones: a shallow block is the parent of every deep one under it, and keeping hot bases
is the point of the split. Only unreferenced, unpinned leaves are ever candidates; that is the
caller's job, the policy only orders them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import NamedTuple


class BlockUsage(NamedTuple):
    """What the policy needs to know about a candidate."""

    start_token: int  # position of the block's first token in its sequence
    hits: int  # times the block was reused (or matched)
    last_access: float  # monotonic time (or logical clock) of the last use


class EvictionPolicy(ABC):
    """Orders eviction candidates: a smaller key is evicted first."""

    @abstractmethod
    def key(self, usage: BlockUsage) -> tuple:
        """Sort key; candidates are evicted in ascending order of it."""

    def order(self, usages: dict) -> list:
        """Ids of `usages` (id -> BlockUsage) in eviction order."""
        return sorted(usages, key=lambda i: self.key(usages[i]))


class LRUPolicy(EvictionPolicy):
    """Plain least-recently-used (a baseline for comparisons)."""

    def key(self, usage: BlockUsage) -> tuple:
        return (usage.last_access,)


class HybridPolicy(EvictionPolicy):
    """LFU for blocks starting before `shallow_tokens`, LRU for deeper ones; deep go first.

    `half_life` (seconds of `last_access`; None = counts never age): a block's hits count
    half as much per half-life since its last use, so a base hot yesterday does not outrank
    one hot today for good. Ranked by log2(1 + hits) + last_access / half_life, that is by
    (1 + hits) halved per half-life since the last use (the 1 keeps a block not reused yet
    from ranking below every block ever reused, however long ago): the same order at any
    later moment, so a key computed once stays right. Not the order of the aged hits alone:
    1 hit now ties with 3 an hour ago (2 vs 4 halved), where the aged hits say 1 < 1.5."""

    def __init__(self, shallow_tokens: int = 128, half_life: float | None = None) -> None:
        if shallow_tokens < 0:
            raise ValueError("shallow_tokens must be >= 0")
        if half_life is not None and not half_life > 0:
            raise ValueError("half_life must be > 0 (or None)")
        self.shallow_tokens = shallow_tokens
        self.half_life = half_life

    def is_shallow(self, start_token: int) -> bool:
        return start_token < self.shallow_tokens

    def key(self, usage: BlockUsage) -> tuple:
        if self.is_shallow(usage.start_token):
            if self.half_life is not None:
                return (1, math.log2(1 + usage.hits) + usage.last_access / self.half_life,
                        usage.last_access)
            return (1, usage.hits, usage.last_access)
        return (0, usage.last_access, 0)


# The kvpool's hit half-life (its pool's clock is in seconds; the prefix index ages its own
# counts, on index ticks): as the index's default hit_half_life_seconds.
POOL_HIT_HALF_LIFE_S = 3600.0


def make_policy(name: str, shallow_tokens: int = 128,
                half_life: float | None = None) -> EvictionPolicy:
    """Policy by config name: "hybrid" (default; `half_life` as HybridPolicy's) or "lru"."""
    if name == "hybrid":
        return HybridPolicy(shallow_tokens, half_life)
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown eviction policy {name!r} (expected 'hybrid' or 'lru')")
