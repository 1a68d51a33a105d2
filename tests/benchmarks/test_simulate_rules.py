"""What benchmarks/simulate.py records of how its figures were made."""

from __future__ import annotations

import argparse

from benchmarks.simulate import POLICIES, Rates, RunResult, SimConfig, build_output


def _command(**opts) -> str:
    a = argparse.Namespace(**({"pool_blocks": SimConfig.pool_blocks,
                               "tenants": SimConfig.tenants,
                               "req_per_replica_s": SimConfig.req_per_replica_s,
                               "policies": list(POLICIES), "quick": False, "replicas": [64],
                               "sessions": 10, "merge": True} | opts))
    run = RunResult("tiercache", 64, {"token_hit_ratio": 0.9, "load_max_over_mean": 1.1}, {}, {})
    return build_output([run], [64], 10, Rates(1000.0, 0.01, {1: 50.0}, "test"),
                        (100.0, "test"), a, 1.0)["command"]


def test_the_command_names_every_option_that_changes_the_figures():
    """A run of one policy at another pool size was recorded as the default command (which the
    report prints as how simulate.json was made)."""
    assert _command() == "python -m benchmarks.simulate --replicas 64 --sessions 10 --merge"
    assert _command(policies=["tiercache_tiebreak"], pool_blocks=512, tenants=8,
                    req_per_replica_s=0.5) == (
        "python -m benchmarks.simulate --replicas 64 --sessions 10 --policies "
        "tiercache_tiebreak --pool-blocks 512 --tenants 8 --req-per-replica-s 0.5 --merge")
