"""The orchestrator benchmark's unbounded-cache ceiling: what it counts, on a tiny workload."""

from __future__ import annotations

import pytest

from benchmarks.orchestrator import reuse_ceiling
from benchmarks.workload import WorkloadSpec, generate

pytestmark = pytest.mark.model  # renders with SmolLM2's tokenizer and chat template

ONE = WorkloadSpec(seed=1, tenants=1, prompts_per_tenant=1, system_tokens=200, sessions=1,
                   turns=2, repeat_fraction=0.0)


def test_a_first_turn_has_nothing_earlier_to_reuse():
    (sid, reqs), = generate(ONE).sessions().items()
    first = reuse_ceiling(ONE, 16, {(sid, reqs[0].turn)})
    assert first == {"requests_counted": 1, "prefix_hit_token_ratio": 0.0}


def test_a_second_turn_reuses_the_first_turn_and_its_answer():
    (sid, reqs), = generate(ONE).sessions().items()
    second = reuse_ceiling(ONE, 16, {(sid, reqs[1].turn)})
    both = reuse_ceiling(ONE, 16)
    assert second["requests_counted"] == 1 and both["requests_counted"] == 2
    # Turn 2 = system prompt + turn 1 + answer + a short question: nearly all of it is cached.
    assert second["prefix_hit_token_ratio"] > 0.8
    # Counting turn 1 too (nothing cached) lowers the ratio to about half.
    assert 0.3 < both["prefix_hit_token_ratio"] < second["prefix_hit_token_ratio"]


def test_nothing_served_counts_nothing():
    assert reuse_ceiling(ONE, 16, set()) == {"requests_counted": 0, "prefix_hit_token_ratio": 0.0}
