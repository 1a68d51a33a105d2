"""Rules of the orchestrator's wiring (services/orchestrator/app.py) that the mutation audit
found unguarded: a tenant's automatic concurrency, and routing's memory of what it sent to a
replica dropped when that replica is lost."""

from __future__ import annotations

from services.orchestrator.app import build, tenant_concurrency
from services.orchestrator.config import OrchestratorConfig


def test_tenant_concurrency_with_tokens_is_16_but_never_past_the_stream_slots():
    """Automatic (0) with tenant tokens: 16, or every stream slot when there are fewer
    (max_workers - 8)."""
    assert tenant_concurrency(OrchestratorConfig(tokens="t=a")) == 16
    assert tenant_concurrency(OrchestratorConfig(tokens="t=a", max_workers=20)) == 12
    assert tenant_concurrency(OrchestratorConfig(max_workers=20)) == 12  # no tokens: every slot
    assert tenant_concurrency(OrchestratorConfig(tokens="t=a", max_concurrent_per_tenant=3,
                                                 max_workers=20)) == 3


def test_a_lost_replica_is_forgotten_by_routings_dispatch_memory():
    """What routing sent to a replica moments ago raises its match only while the replica
    lives: when the replica set says a replica's cache is gone, that memory is dropped."""
    cfg = OrchestratorConfig(address="127.0.0.1:0", metrics_port=-1,
                             kvpool_addresses=("127.0.0.1:1",), warm_interval_s=0,
                             dispatch_memory_s=10.0)
    app = build(cfg)
    try:
        memory, block = app.orch.dispatched, [b"h" * 16]
        memory.record("kv-1", block)
        assert memory.match(block) == {"kv-1": cfg.block_size}
        for listener in app.orch.replicas.on_lost:  # as the replica set tells of a loss
            listener("kv-1")
        assert memory.match(block) == {}
        # The warm-up loop warms the tenants the tokens file has now (a removed one, erased,
        # is not warmed again): it reads the registry the servicer authenticates with.
        assert app.warmer.tenants is app.tenants
    finally:
        app.close()


def test_a_tokens_file_that_is_not_json_is_refused_before_the_model_loads(tmp_path,
                                                                         monkeypatch):
    """Read first: a malformed tokens file was refused only after the model had been
    converted into the cache (20 s on a cold cache, its files left behind by a start that
    failed) and the replica and semantic pollers had started."""
    import pytest

    from services.orchestrator import app as app_mod

    bad = tmp_path / "tokens.json"
    bad.write_text("{not json")
    loads: list = []
    monkeypatch.setattr(app_mod, "load_resolved", lambda *a, **k: loads.append(a))
    monkeypatch.setenv("TIERCACHE_HASH_KEY", "k" * 32)
    cfg = OrchestratorConfig(address="127.0.0.1:0", metrics_port=-1, tokens_file=str(bad),
                             kvpool_addresses=("127.0.0.1:1",), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="not JSON"):
        build(cfg)
    assert loads == [] and not (tmp_path / "c").exists()
