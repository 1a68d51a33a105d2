"""benchmarks/routing_bound.py on a tiny simulated cluster: the partition heuristic runs with
the simulator's routing call, and every router is reported under its (non-oracle) name."""

from __future__ import annotations

from benchmarks import routing_bound as rb
from benchmarks import simulate as sim

TINY = sim.SimConfig(replicas=2, sessions=12, seed=4, tenants=2, prompts_per_tenant=2,
                     system_tokens=160, zipf_s=0.6, pool_blocks=24, answer_tokens=(16, 16),
                     req_per_replica_s=0.1)


def test_every_policy_runs_on_the_simulator():
    rates = sim.load_rates()
    bpn = sim.index_bytes_per_node()[0]
    assert "partition_heuristic" in rb.POLICIES and "oracle_partition" not in rb.POLICIES
    hit = {p: rb.run_one(TINY, p, rates, bpn)["token_hit_ratio"] for p in rb.POLICIES}
    assert all(0.0 < h < 1.0 for h in hit.values()), hit
    # On this tiny cluster too, routing by prefix (and the partition) reuses more than
    # round-robin does: the bound's routers are really routing.
    assert hit["tiercache"] > hit["round_robin"] and hit["partition_heuristic"] > hit[
        "round_robin"], hit


def test_the_partition_sends_a_session_to_its_prompts_owner():
    policy = rb.PartitionPolicy({"s1": "r1"})
    # As the simulator and the orchestrator call a routing policy.
    d = policy.choose([], {"r1": 32}, "s1", new_blocks=3, continues=True)
    assert (d.replica_id, d.matched_tokens) == ("r1", 32)
