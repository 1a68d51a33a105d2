"""Fixtures of the semantic tests: one real ONNX embedder per session (exported once)."""

from __future__ import annotations

import pytest

from services.semantic.config import SemanticConfig, default_cache_dir
from services.semantic.embedder import BatchingEmbedder, OnnxEmbedder
from tests.clock import Clock


@pytest.fixture(scope="session")
def onnx_embedder() -> OnnxEmbedder:
    """all-MiniLM-L6-v2 through ONNX Runtime; the export is cached under the cache dir."""
    cfg = SemanticConfig()
    return OnnxEmbedder(cfg.resolved_model_dir(), default_cache_dir(), cfg.resolved_model_name())


@pytest.fixture(scope="session")
def embedder(onnx_embedder: OnnxEmbedder):
    b = BatchingEmbedder(onnx_embedder, max_batch=32)
    yield b
    b.close()


@pytest.fixture
def make_cfg(tmp_path):
    """SemanticConfig for tests: loopback port 0, no metrics port, a fresh database."""

    def make(**kw) -> SemanticConfig:
        base = dict(address="127.0.0.1:0", metrics_port=-1, db_path=str(tmp_path / "s.db"),
                    sqlite_synchronous="NORMAL")
        base.update(kw)
        cfg = SemanticConfig(**base)
        cfg.validate()
        return cfg

    return make


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000_000.0)


@pytest.fixture
def cache_factory(make_cfg, clock):
    """A SemanticCache over a fresh database with the given embedder; closed at the end."""
    from services.semantic.cache import SemanticCache
    from services.semantic.store import EntryStore

    made = []

    def make(embedder, **kw) -> SemanticCache:
        cfg = make_cfg(**kw)
        for old in made:
            # A second cache on the same file is the service restarted: the first process is
            # gone (one process at a time holds a database).
            if old.store.path == cfg.resolved_db_path():
                old.store.close()
        c = SemanticCache(cfg, embedder, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
        c.load()
        made.append(c)
        return c

    yield make
    for c in made:
        c.close_indexes()
        c.store.close()
