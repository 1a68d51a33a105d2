"""Rules of the semantic benchmark's figures (benchmarks/semantic.py) that a differential
review found computed otherwise than defined (tests/test_bench_semantic_differential.py)."""

from __future__ import annotations

import numpy as np

from benchmarks.semantic import TIERS, _curve, _exact_top, _pr, settings_not_read
from services.semantic.policy import Outcome, ThresholdPolicy
from tests.wire import f32


def test_a_hit_reaches_the_threshold_as_the_served_policy_decides():
    """The issue's precision counts a pair as a hit where the cache serves one: the policy's
    threshold is inclusive, with a float32 tolerance. `sim >= th` on float32 similarities
    compared in float32 for the tier rows and in float64 for the curve: a similarity at the
    float32 nearest 0.95 (0.94999999) was a hit in the standard row and a miss on the curve,
    and one a few float32 steps under 0.97 a miss in the strict row, both served as hits."""
    policy = ThresholdPolicy(dict(TIERS))
    for tier, th in TIERS.items():
        resolved = policy.resolve(tier)
        for sim in (f32(th), f32(th) - 2 ** -24, f32(th - 9e-7), f32(th - 2e-6)):
            served = policy.decide(sim, resolved, False).outcome is Outcome.HIT
            qs = np.array([sim], np.float32)
            prec, rec, tp, fp = _pr(qs, np.ones(1, bool), np.array([1]), th, False)
            assert (tp == 1) is served, (tier, sim)
    at = {p["threshold"]: p for p in _curve(
        np.array([f32(0.95)], np.float32), np.ones(1, bool), np.array([1]),
        np.array([f32(0.95)], np.float32), np.ones(1, bool), np.array([0]),
        np.ones(1, bool), np.ones(1, bool))}
    assert at[0.95]["recall"] == 1.0 and at[0.95]["paws_fhr"] == 1.0  # served: a hit


def test_recall_at_1_counts_an_entry_tied_with_the_exact_top():
    """An entry with the exact search's best similarity is an exact nearest entry: compared
    by position with argmax, a tie (case variants share a vector under the uncased embedder)
    read as a miss of the index."""
    scores = np.array([0.91, 0.97, 0.97, 0.5], np.float32)
    assert _exact_top(scores, 1) and _exact_top(scores, 2)
    assert not _exact_top(scores, 0) and not _exact_top(scores, None)


def test_the_semantic_settings_the_benchmark_does_not_read_are_named():
    """The quality and Chinese parts measure the default tiers: a user who exported
    TIERCACHE_SEMANTIC_TIER_STRICT=0.98 got the 0.97 row without a word. Every
    TIERCACHE_SEMANTIC_ variable set is named (the note main logs), no other."""
    env = {"TIERCACHE_SEMANTIC_TIER_STRICT": "0.98", "TIERCACHE_SEMANTIC_MODEL_DIR": "/m",
           "TIERCACHE_DATA_DIR": "/d", "TIERCACHE_ORCHESTRATOR_SEMANTIC_TIER": "strict",
           "HOME": "/root"}
    assert settings_not_read(env) == ["TIERCACHE_SEMANTIC_MODEL_DIR",
                                      "TIERCACHE_SEMANTIC_TIER_STRICT"]
    assert settings_not_read({"TIERCACHE_DATA_DIR": "/d"}) == []


def test_every_benchmark_waits_for_a_service_with_the_launchers_wait_healthy():
    """kvpool and kvpool_rss each had a copy of the health loop, now the launcher's
    `wait_healthy`; semantic's latency part kept its own, with no time limit (a service stuck
    loading held the benchmark for good)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    own = [p.name for p in sorted(root.glob("*.py")) if "HealthStub" in p.read_text()]
    assert own == [], own
