"""Threshold policy: tiers, explicit thresholds, the floor, the verified bonus, the draft band."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.semantic.config import SemanticConfig
from services.semantic.policy import Outcome, ThresholdPolicy


@pytest.fixture
def policy() -> ThresholdPolicy:
    return ThresholdPolicy.from_config(SemanticConfig())


def test_tiers_from_config(policy):
    assert policy.resolve("strict").threshold == pytest.approx(0.97)
    assert policy.resolve("standard").threshold == pytest.approx(0.95)
    assert policy.resolve("relaxed").threshold == pytest.approx(0.90)
    assert policy.resolve("").tier == "standard"


def test_threshold_boundaries(policy):
    r = policy.resolve("standard")
    assert policy.decide(0.95, r, False).outcome is Outcome.HIT
    assert policy.decide(0.9499, r, False).outcome is Outcome.DRAFT
    assert policy.decide(0.80, r, False).outcome is Outcome.DRAFT
    assert policy.decide(0.7999, r, False).outcome is Outcome.MISS


def test_verified_bonus_at_the_boundary(policy):
    r = policy.resolve("strict")
    assert policy.decide(0.95, r, verified=True).outcome is Outcome.HIT
    assert policy.decide(0.95, r, verified=True).threshold == pytest.approx(0.95)
    assert policy.decide(0.9499, r, verified=True).outcome is Outcome.DRAFT
    assert policy.decide(0.95, r, verified=False).outcome is Outcome.DRAFT


def test_verified_bonus_never_goes_below_the_floor(policy):
    r = policy.resolve("", 0.86)
    assert policy.threshold_for(r, verified=True) == pytest.approx(0.85)
    assert policy.decide(0.8499, r, verified=True).outcome is Outcome.DRAFT


def test_explicit_threshold_wins_and_is_validated(policy):
    r = policy.resolve("strict", 0.9)
    assert (r.tier, r.threshold, r.explicit) == ("strict", pytest.approx(0.9), True)
    assert policy.resolve("", 1.0).threshold == 1.0
    assert policy.resolve("", 0.85).threshold == pytest.approx(0.85)
    for bad in (0.84, 1.01, -0.5, float("nan")):
        with pytest.raises(InvalidArgument) as exc:
            policy.resolve("", bad)
        assert exc.value.field == "threshold"


def test_unknown_tier(policy):
    with pytest.raises(InvalidArgument) as exc:
        policy.resolve("lenient")
    assert exc.value.field == "tier"


@pytest.mark.parametrize("floor", [0.85, 0.9, 0.95])
def test_a_threshold_equal_to_the_floor_survives_the_float32_wire(floor):
    """The proto's float carries 0.9 as 0.89999998: that is still the floor, not below it."""
    import numpy as np

    p = ThresholdPolicy.from_config(SemanticConfig(threshold_floor=floor))
    wire = float(np.float32(floor))
    assert p.resolve("", wire).threshold == pytest.approx(floor)
    assert p.resolve("", float(np.float32(1.0))).threshold == 1.0
    with pytest.raises(InvalidArgument):
        p.resolve("", float(np.float32(floor - 0.001)))


def test_the_configured_default_tier_applies_to_a_request_naming_none():
    """A deployment whose default tier is strict holds tier-less requests to 0.97, not 0.95."""
    p = ThresholdPolicy.from_config(SemanticConfig(default_tier="strict"))
    r = p.resolve("")
    assert (r.tier, r.threshold, r.explicit) == ("strict", pytest.approx(0.97), False)
    assert p.decide(0.96, r, verified=False).outcome is Outcome.DRAFT


def test_the_configured_draft_floor_bounds_the_draft_band():
    p = ThresholdPolicy.from_config(SemanticConfig(draft_floor=0.70))
    r = p.resolve("standard")
    assert p.draft_floor == pytest.approx(0.70)
    assert p.decide(0.75, r, verified=False).outcome is Outcome.DRAFT
    assert p.decide(0.6999, r, verified=False).outcome is Outcome.MISS


def test_a_draft_or_miss_reports_the_threshold_the_entry_was_held_to(policy):
    """Decision.threshold is the entry's own threshold (verified bonus applied) whatever the
    outcome: the cache reports it for a miss whose nearest entry is verified."""
    r = policy.resolve("strict")
    assert policy.decide(0.90, r, verified=True) == (Outcome.DRAFT, pytest.approx(0.95))
    assert policy.decide(0.50, r, verified=True) == (Outcome.MISS, pytest.approx(0.95))
    assert policy.decide(0.90, r, verified=False) == (Outcome.DRAFT, pytest.approx(0.97))


def test_float32_similarities_at_the_threshold_are_hits(policy):
    """Similarities come as float32: an exact repeat is 0.99999994 and 0.95 is 0.949999988.
    Both are at the threshold, so both hit (the boundary is inclusive)."""
    one = float(np.float32(0.99999994))
    assert one < 1.0
    assert policy.decide(one, policy.resolve("", 1.0), verified=False).outcome is Outcome.HIT
    at = float(np.float32(0.95))
    assert at < 0.95
    assert policy.decide(at, policy.resolve("standard"), verified=False).outcome is Outcome.HIT


@pytest.mark.parametrize("floor", [0.9, 0.95])  # float32 rounds these below the floor
def test_a_float32_floor_resolves_to_the_floor_itself(floor):
    """0.89999998 off the wire is the floor the caller wrote: exactly it, not 2e-8 below."""
    p = ThresholdPolicy.from_config(SemanticConfig(threshold_floor=floor))
    assert float(np.float32(floor)) < floor
    assert p.resolve("", float(np.float32(floor))).threshold == floor


def test_a_threshold_above_one_beyond_float32_rounding_is_refused(policy):
    for bad in (float(np.float32(1.0005)), 1.0001):
        with pytest.raises(InvalidArgument) as exc:
            policy.resolve("", bad)
        assert exc.value.field == "threshold"


@pytest.mark.parametrize("draft_floor", [0.7, 0.9, 0.95])  # float32 rounds these down
def test_a_float32_similarity_at_the_draft_floor_is_a_draft(draft_floor):
    """"Near-misses at or above it are draft candidates": a similarity of 0.9 arrives as the
    float32 0.89999998, at the draft floor as at a threshold (it was a miss); one float32
    step further down is below it."""
    p = ThresholdPolicy.from_config(SemanticConfig(draft_floor=draft_floor, threshold_floor=0.95))
    r = p.resolve("strict")
    at = np.float32(draft_floor)
    assert float(at) < draft_floor
    assert p.decide(float(at), r, verified=False).outcome is Outcome.DRAFT
    below = float(np.nextafter(at, np.float32(0)))
    assert p.decide(below, r, verified=False).outcome is Outcome.MISS
