"""The routing simulation on a tiny cluster: invariants, not figures."""

from __future__ import annotations

import pytest

from benchmarks.simulate import (
    POLICIES,
    Cluster,
    SimConfig,
    SimPool,
    build_workload,
    load_rates,
)
from services.common.policy import HybridPolicy

TINY = SimConfig(replicas=4, sessions=60, tenants=4, prompts_per_tenant=3, system_tokens=160,
                 pool_blocks=64, windows=6)


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Cluster, object]]:
    rates = load_rates()
    out = {}
    for name in POLICIES:
        firsts, spec = build_workload(TINY)  # sessions carry state: a fresh copy per run
        cl = Cluster(TINY, name, rates, keep_index=True)
        res = cl.run(firsts, spec.period_s * TINY.cycles, check_every=50)
        out[name] = (cl, res)
    return out


def test_every_request_routed_once_and_loads_sum(runs) -> None:
    firsts, _ = build_workload(TINY)
    expected = sum(s.turns for _, s in firsts)
    for name, (cl, res) in runs.items():
        assert res.summary["requests"] == expected, name
        assert sum(r.requests for r in cl.replicas) == expected, name
        assert sum(res.summary["routes"].values()) == expected, name
        assert cl.finished == expected, name
        assert sum(len(v) for v in cl.ttft.values()) == expected, name


def test_pools_end_consistent_and_index_agrees(runs) -> None:
    for name, (cl, _) in runs.items():
        for i, rep in enumerate(cl.replicas):
            pool = rep.pool
            assert pool.free >= 0 and pool.private == 0, name
            # Every request ended: no block is referenced, all cached blocks are evictable.
            assert pool.unref == len(pool.blocks), name
            assert all(b.ref == 0 for b in pool.blocks.values()), name
            assert rep.running == 0 and not rep.queue, name
            # The index saw every stored and removed block: it knows exactly what each holds.
            cell = cl._cell(i)
            bit = cell._replicas[rep.rid].bit
            assert cell.tree.held[bit] == len(pool.blocks), name
        assert sum(r.pool.evicted_total for r in cl.replicas) > 0, "tiny pools must evict"


def test_prefix_aware_beats_round_robin(runs) -> None:
    hit = {n: r.summary["token_hit_ratio"] for n, (_, r) in runs.items()}
    assert hit["tiercache"] > hit["round_robin"]
    assert hit["prefix_uncapped"] > hit["round_robin"]
    assert 0.0 < min(hit.values()) and max(hit.values()) < 1.0


def test_pool_evicts_unreferenced_leaves_deep_lru_first() -> None:
    pool = SimPool(capacity=4, block_size=16, policy=HybridPolicy(shallow_tokens=16))
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    pool.admit([], 0, 3, now=0.0)
    assert pool.commit([a, b, c], 0, now=1.0) == [0, 1, 2]
    assert pool.free == 1 and pool.private == 0
    pool.release([a, b, c], 0, now=2.0)
    # Referencing the root keeps it, but its unreferenced tail may go, deepest first.
    evicted = pool.admit([a], 1, 3, now=3.0)
    assert evicted == [c, b]
    assert pool.free == 0 and a in pool.blocks
    pool.check()
    with pytest.raises(IndexError):  # nothing left to evict: the caller must check first
        pool.admit([], 0, 1, now=4.0)
    assert not pool.can_admit([], 0, 1)


def test_targets_judged_by_the_shared_verdicts():
    """The simulation judges its targets with `benchmarks.emit.verdicts` as the other
    benchmarks do: a ratio exactly at its bound is met, a missing one (no round-robin run) is
    not, and the target text is the shared form."""
    import argparse

    from benchmarks.simulate import Rates, RunResult, build_output

    def run(policy: str, hits: float, lmm: float) -> RunResult:
        return RunResult(policy, 64, {"token_hit_ratio": hits, "load_max_over_mean": lmm},
                         {}, {})

    a = argparse.Namespace(pool_blocks=64, tenants=4, req_per_replica_s=1.0, quick=True,
                           replicas=[64], sessions=10, merge=False)
    rates = Rates(1000.0, 0.01, {1: 50.0}, "test")
    out = build_output([run("tiercache", 0.9, 1.25), run("prefix_uncapped", 1.0, 1.0)],
                       [64], 10, rates, (100.0, "test"), a, 1.0)
    t = out["targets"]
    assert t["hit_ratio_vs_uncapped_prefix_aware"] == {"value": 0.9, "target": ">= 0.9",
                                                       "met": True}
    assert t["load_max_over_mean"] == {"value": 1.25, "target": "<= 1.25", "met": True}
    assert t["hit_ratio_vs_round_robin"] == {"value": None, "target": ">= 2.0", "met": False}
