"""Short soak (the long form is `make soak` -> benchmarks/soak.py): mixed traffic from two
tenants with 10% client cancellations and 10% deadline expiries, in rounds on the shared stack.
After every round no block is referenced; RSS, open descriptors and threads do not grow after
the warm-up round."""

from __future__ import annotations

import pytest

from benchmarks.soak import count_growth_over, growth, rss_growth_ok, run_soak
from tests.hardening.conftest import TOK_A, TOK_B

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_short_soak_leaks_nothing_and_memory_is_flat(stack):
    pids = {f"{p.name}:{p.port}": p.proc.pid for p in stack.all()}
    # Round 0 warms caches (semantic entries, cached prefixes, allocator arenas); rounds 1..3
    # repeat the same content with fresh cancellation/deadline draws.
    res = run_soak(address=stack.orch.address, pids=pids, wait_idle=stack.wait_kv_idle,
                   rounds=4, requests=16, concurrency=4, tokens=(TOK_A, TOK_B), max_tokens=4)
    summary = res.summary()
    print("soak:", summary["outcomes"], "latency ms", summary["latency_ms"])
    print("fds per round:", [r["fds"] for r in res.rounds])
    print("threads per round:", [r["threads"] for r in res.rounds])
    assert summary["outcomes"].get("OK", 0) >= 40
    assert summary["outcomes"].get("CANCELLED", 0) + summary["outcomes"].get(
        "DEADLINE_EXCEEDED", 0) >= 4  # the faults really happened
    # From round 1: the warm-up round's growth is not counted.
    grew = {k: round(g / 2**20, 1) for k, g in growth(res, "rss", since=1).items()}
    assert all(rss_growth_ok(res, since=1).values()), grew
    assert count_growth_over(res, since=1) == {}
