"""Threshold policy: tiers, explicit thresholds, the floor, the verified bonus, the draft band."""

from __future__ import annotations

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
