"""benchmarks/tenant_scale.py at a tiny size: its figures come from what it claims to run."""

from __future__ import annotations

from benchmarks import tenant_scale as ts
from services.semantic.cache import SemanticCache


def test_the_registry_figures_are_of_a_file_of_that_many_tenants(tmp_path):
    r = ts.registry(30, tmp_path)
    assert r["tenants"] == 30 and r["file_bytes"] == (tmp_path / "tokens-30.json").stat().st_size
    assert r["build_ms"] > 0 and r["memory_mb"] > 0 and 0 < r["auth_us"] < 1000


def test_each_timed_store_at_capacity_evicts_one_entry(tmp_path, monkeypatch):
    evicted = []
    real = SemanticCache.close_indexes

    def counted(self, *a):
        s = self.stats()
        evicted.append((s.entries, s.evictions_total))
        return real(self, *a)

    monkeypatch.setattr(SemanticCache, "close_indexes", counted)
    out = ts.semantic(20, tmp_path)
    assert set(out) == {"tenants", "store_at_capacity_distinct_ms", "store_at_capacity_tied_ms"}
    assert evicted == [(20, 2 * ts.STORES)]
