"""The semantic benchmark's targets as the issue sets them."""

from __future__ import annotations

from benchmarks.semantic import targets


def _res(strict_precision: float, paws: float) -> dict:
    tier = {"default": "verifier",
            "verifier": {"qqp_precision": strict_precision, "paws_false_hit_rate": paws}}
    return {"quality": {"tiers": {"strict": tier, "standard": {
        "default": "verifier", "verifier": {"qqp_precision": 0.93}}}}}


def test_the_strict_false_hit_rate_is_met_only_with_the_strict_precision():
    """"PAWS false-hit rate <= 5% with QQP precision >= 0.97" is one target: a low false-hit
    rate at a lower precision was reported as a target met."""
    short = targets(_res(0.928, 0.022))
    assert short["strict_paws_false_hit_rate"]["met"] is False
    assert short["strict_qqp_precision"]["met"] is False
    assert "with strict_qqp_precision >= 0.97" in short["strict_paws_false_hit_rate"]["target"]
    both = targets(_res(0.975, 0.022))
    assert both["strict_paws_false_hit_rate"]["met"] and both["strict_qqp_precision"]["met"]
    assert not targets(_res(0.975, 0.06))["strict_paws_false_hit_rate"]["met"]
    assert targets(_res(0.975, 0.06))["standard_qqp_precision"]["met"]
