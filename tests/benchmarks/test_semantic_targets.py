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


def test_the_chinese_verdict_says_which_hits_its_wrong_share_counts():
    """served_precision leaves out the pairs scored between 2 and 4; the verdict called
    1 - it the share of "its hits" that are wrong, which read as all of them."""
    from benchmarks.semantic import chinese_verdict

    out = {"unknown_token_fraction": 0.26, "spearman": 0.463,
           "tiers": {"strict": {"served_precision": 0.7632,
                                "served_precision_mid_scores_wrong": 0.5577}}}
    v = chinese_verdict(out)
    assert ("about 24% of its hits among pairs scored clearly alike (>= 4) or different "
            "(<= 2) are wrong (served precision 0.76; 0.56 with the pairs scored between "
            "counted wrong)") in v
    assert "26% of tokens as unknown" in v and "Spearman 0.46" in v
