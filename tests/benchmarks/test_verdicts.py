"""How a benchmark judges its targets (benchmarks.emit.verdicts, used by the kvpool, assisted
and orchestrator benchmarks): on the unrounded figure, shown rounded."""

from benchmarks.emit import verdicts

TARGETS = {"speedup": (">=", 2.0), "passes": ("<=", 0.4)}


def test_a_figure_within_rounding_of_its_bound_is_not_met():
    exact = {"speedup": 1.9996, "passes": 0.40004}
    shown = {"speedup": round(1.9996, 3), "passes": round(0.40004, 3)}
    assert shown == {"speedup": 2.0, "passes": 0.4}
    got = verdicts(TARGETS, exact, shown)
    assert got == {"speedup": {"value": 2.0, "target": ">= 2.0", "met": False},
                   "passes": {"value": 0.4, "target": "<= 0.4", "met": False}}


def test_bounds_are_inclusive_and_none_is_not_met():
    assert verdicts(TARGETS, {"speedup": 2.0, "passes": 0.4}) == {
        "speedup": {"value": 2.0, "target": ">= 2.0", "met": True},
        "passes": {"value": 0.4, "target": "<= 0.4", "met": True}}
    got = verdicts(TARGETS, {"speedup": None})  # passes missing: could not be computed
    assert [v["met"] for v in got.values()] == [False, False]
    assert [v["value"] for v in got.values()] == [None, None]
