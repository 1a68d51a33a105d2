"""A semantic cache without a model, for the scale benchmarks (`tenant_scale`,
`namespace_scale`): what they measure is the cache's bookkeeping, not the embedding."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from services.semantic.cache import SemanticCache
from services.semantic.config import SemanticConfig
from services.semantic.store import EntryStore


class HashEmbedder:
    """A unit vector of `dim` floats seeded by each text's hash."""

    def __init__(self, dim: int, name: str) -> None:
        self.dim = dim
        self.name = self.identity = name

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.stack([self.embed_one(t) for t in texts])

    def embed_one(self, text: str) -> np.ndarray:
        v = np.random.default_rng(abs(hash(text)) % 2**32).standard_normal(self.dim)
        return (v / np.linalg.norm(v)).astype(np.float32)


def bare_cache(db_path: str, max_entries_total: int, embedder: HashEmbedder,
               clock: Callable[[], float] | None = None) -> SemanticCache:
    """A cache on the database `db_path` (not loaded yet), without guard or verifier."""
    cfg = SemanticConfig(address="127.0.0.1:0", metrics_port=-1, db_path=db_path,
                         max_entries_total=max_entries_total, guard_tiers=(),
                         verifier_tiers=())
    cfg.validate()
    return SemanticCache(cfg, embedder, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
