"""The soak's check on open descriptors and threads (benchmarks/soak.py): growth after the
warm-up round past COUNT_GROWTH_LIMIT is named per count and process."""

from __future__ import annotations

from benchmarks.soak import SoakResult, count_growth_over


def _rounds(**counts: list[int]) -> SoakResult:
    """A result whose rounds carry these per-round counts for one process ("p")."""
    n = len(next(iter(counts.values())))
    return SoakResult(rounds=[{"rss": {"p": 0}, **{k: {"p": v[i]} for k, v in counts.items()}}
                              for i in range(n)])


def test_count_growth_over_names_the_process_and_count_past_the_slack():
    level = _rounds(fds=[40, 41, 40, 42], threads=[30, 36, 33, 35])
    assert count_growth_over(level) == {}
    leaking = _rounds(fds=[40, 44, 48, 52], threads=[30, 30, 31, 60])
    assert count_growth_over(leaking) == {"fds": {"p": 12}, "threads": {"p": 30}}
    # From round 1 (the short form's span): the warm-up round's jump is not growth.
    assert count_growth_over(_rounds(fds=[10, 40, 40, 40], threads=[5, 30, 30, 30]),
                             since=1) == {}
