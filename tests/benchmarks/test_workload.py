"""The benchmark workload's paraphrased repeats: each a different session's paraphrase."""

from benchmarks.workload import WorkloadSpec, _repeats_after_their_originals, generate


def test_every_repeat_paraphrases_a_different_earlier_session():
    """Drawn with replacement, 6 of the orchestrator benchmark's 12 repeats asked the first
    session's one paraphrase: after the first, each was an exact repeat of an earlier repeat,
    a hit by text, and the semantic hit rate read 0.15 where paraphrase hits were 0.03."""
    for seed in (0, 1, 3, 7):
        w = generate(WorkloadSpec(seed=seed))
        repeats = [r for r in w.requests if r.kind == "repeat"]
        assert repeats and len({r.repeat_of for r in repeats}) == len(repeats)
        assert len({r.question for r in repeats}) == len(repeats)
        first = {r.session_id: r.at for r in w.requests if r.turn == 0 and r.kind == "turn"}
        assert all(first[r.repeat_of] < r.at for r in repeats)  # after what they repeat
    assert _repeats_after_their_originals(["fresh", "repeat", "repeat", "fresh", "fresh"]) == [
        "fresh", "repeat", "fresh", "repeat", "fresh"]
