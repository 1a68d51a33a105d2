"""The orchestrator benchmark's repeats: which run is reported and how runs are summarised."""

from benchmarks.orchestrator import median_run, repeat_summary


def run(hit: float, load: float = 1.0, ttft: float = 300.0) -> dict:
    return {"prefix_hit_token_ratio": round(hit, 4), "replica_load_max_over_mean": load,
            "ttft_p50_ms_all": ttft, "routes": {}, "classes": {},
            "unrounded": {"prefix_hit_token_ratio": hit}}


def test_median_run_is_the_middle_by_hit_ratio():
    runs = [run(0.65), run(0.53), run(0.60)]
    assert median_run(runs) is runs[2]
    assert median_run([run(0.7), run(0.5)])["prefix_hit_token_ratio"] == 0.5  # lower middle
    one = [run(0.8)]
    assert median_run(one) is one[0]


def test_repeat_summary_lists_every_run_and_pairs_the_ratio_in_order():
    s = repeat_summary({"tiercache": [run(0.8, 1.1), run(0.75, 1.2)],
                        "round_robin": [run(0.64), run(0.5)]})
    assert [r["prefix_hit_token_ratio"] for r in s["tiercache"]] == [0.8, 0.75]
    assert s["tiercache"][1]["replica_load_max_over_mean"] == 1.2
    assert "classes" not in s["round_robin"][0]
    assert s["prefix_hit_ratio_vs_round_robin_by_run"] == [1.25, 1.5]
    # Each run's ratio from the unrounded hit ratios: 0.66664 / 0.5 is 1.333, where the
    # 4-place figures (0.6666 / 0.5) would give 1.332.
    s = repeat_summary({"tiercache": [run(0.66664)], "round_robin": [run(0.5)]})
    assert s["tiercache"][0]["prefix_hit_token_ratio"] == 0.6666
    assert s["prefix_hit_ratio_vs_round_robin_by_run"] == [1.333]


def test_summaries_split_the_model_served_requests_by_route():
    from benchmarks.orchestrator import summarize
    from clients.python.replay import Outcome

    def o(route: str, prompt: int, cached: int, semantic: bool = False, error: str = "",
          expected: int = 0):
        return Outcome("s", "t", 1, "new", 0.0, 10.0, 20.0, prompt, cached, 4, semantic, 0.0,
                       "kvpool-0", route, error, expected)

    # The index promised 96 of the first prompt's tokens and 48 were there; the second's whole
    # prompt (50) was held, of which the replica recomputes the last token anyway.
    s = summarize([o("prefix", 100, 48, expected=96), o("prefix", 50, 49, expected=50),
                   o("ring", 100, 0), o("", 30, 0), o("prefix", 10, 0, semantic=True),
                   o("ring", 9, 9, error="x")],
                  ("kvpool-0", "kvpool-1"))
    assert s["routes"] == {
        "prefix": {"requests": 2, "prompt_tokens": 150, "cached_tokens": 97,
                   "expected_tokens": 146, "shortfall_tokens": 48},
        "ring": {"requests": 1, "prompt_tokens": 100, "cached_tokens": 0, "expected_tokens": 0,
                 "shortfall_tokens": 0},
        "unknown": {"requests": 1, "prompt_tokens": 30, "cached_tokens": 0,
                    "expected_tokens": 0, "shortfall_tokens": 0}}
    assert s["prefix_hit_token_ratio"] == round(97 / 280, 4)
    rep = repeat_summary({"tiercache": [s], "round_robin": [s]})
    assert rep["tiercache"][0]["routes"] == s["routes"]


def test_the_result_records_how_the_workload_was_replayed():
    """orchestrator.json gave the workload's arrival-rate fields but not that the replay
    ignores them, nor the answer length or concurrency the figures were measured at."""
    from benchmarks.orchestrator import (
        CONCURRENCY,
        MAX_TOKENS,
        TIME_SCALE,
        full_spec,
        replay_settings,
    )

    r = replay_settings(full_spec(), CONCURRENCY, MAX_TOKENS)
    assert (r["concurrency"], r["max_tokens"], r["time_scale"]) == (2, 16, TIME_SCALE) == (
        2, 16, 0.0)
    assert "arrival times" in r["note"] and "not waited for" in r["note"]
    assert "capped at 16 tokens" in r["note"] and "s=0.6" in r["note"]
