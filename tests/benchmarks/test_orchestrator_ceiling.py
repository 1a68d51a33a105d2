"""The orchestrator benchmark's ceiling figures: each ratio against the ceiling over the same
requests (those the model answered in that run), the all-requests ceiling for reference."""

from __future__ import annotations

from benchmarks.orchestrator import ceiling_figures

# ((session, turn), prompt tokens, cached tokens with an unbounded cache)
ROWS = [(("s1", 1), 100, 0), (("s1", 2), 200, 160), (("s2", 1), 100, 80), (("s2", 2), 100, 96)]


def run(hit: float, served: list[tuple[str, int]]) -> dict:
    return {"prefix_hit_token_ratio": hit, "model_served": served}


def test_each_ratio_is_set_against_the_ceiling_over_its_own_requests():
    # TierCache's run: s2 turn 2 was a semantic hit; round-robin's: s1 turn 2 was.
    ours = run(0.5, [("s1", 1), ("s1", 2), ("s2", 1)])
    rr = run(0.3, [("s1", 1), ("s2", 1), ("s2", 2)])
    c = ceiling_figures(ROWS, ours, rr)
    assert c["model_served"] == {"requests_counted": 3, "prefix_hit_token_ratio": 0.6}
    assert c["round_robin_model_served"] == {"requests_counted": 3,
                                             "prefix_hit_token_ratio": 0.5867}
    assert c["all_requests"] == {"requests_counted": 4, "prefix_hit_token_ratio": 0.672}
    assert c["tiercache_share_of_ceiling"] == round(0.5 / 0.6, 3)
    assert c["round_robin_share_of_ceiling"] == round(0.3 / 0.5867, 3)
    assert c["ceiling_over_round_robin"] == round(0.5867 / 0.3, 3)  # like for like
    assert c["routing_ratio_ceiling"] == round(0.6 / 0.3, 3)


def test_served_lists_read_back_from_json_count_the_same():
    ours = run(0.5, [["s1", 1], ["s1", 2]])  # json turns tuples into lists
    c = ceiling_figures(ROWS, ours, ours)
    assert c["model_served"]["requests_counted"] == 2


def test_a_run_with_nothing_cached_has_no_share():
    nothing = run(0.0, [("s1", 1)])
    c = ceiling_figures(ROWS, nothing, nothing)
    assert c["model_served"]["prefix_hit_token_ratio"] == 0.0
    assert c["tiercache_share_of_ceiling"] is None
    assert c["ceiling_over_round_robin"] is None
