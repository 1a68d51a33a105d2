"""Draft proposal lengths chosen from what a forward costs on the device (pure logic), and
measured at a replica's start (the tiny model)."""

from __future__ import annotations

import pytest

from services.kvpool.drafting import (
    LADDER,
    Draft,
    choose_ladder,
    default_ladder,
    expected_run,
    frontier,
)

# Relative forward costs by tokens per row, as measured on three devices: an Intel Xeon host
# (2-3 tokens nearly free), an AMD EPYC host (2-3 tokens dear, 5-6 cheap), a flat one (GPU).
XEON = {1: 1.0, 2: 1.12, 3: 1.24, 4: 1.62, 5: 1.7, 6: 1.8, 7: 1.9, 8: 1.98, 9: 1.97,
        10: 1.96, 11: 1.95, 12: 1.94, 13: 1.93, 14: 1.92, 15: 1.91, 16: 1.86, 17: 1.93}
EPYC = {1: 1.0, 2: 1.41, 3: 1.73, 4: 1.48, 5: 1.00, 6: 1.03, 7: 1.56, 8: 1.07, 9: 1.24,
        10: 1.49, 11: 1.40, 12: 1.31, 13: 1.31, 14: 1.24, 15: 1.24, 16: 1.30, 17: 1.20}
FLAT = {q: 1.0 for q in range(1, 18)}


def test_each_device_gets_lengths_its_forwards_pay_for():
    assert choose_ladder(XEON, 16) == (1, 2, 16)  # the fixed LADDER, hand-tuned there
    low, mid, high = choose_ladder(EPYC, 16)
    assert low == 4  # 1-3 tokens cost more than 4: never proposed
    assert EPYC[mid + 1] < EPYC[3] and high == 16
    assert choose_ladder(FLAT, 16) == (16, 16, 16)  # forwards cost alike: always the most


@pytest.mark.parametrize("costs", [XEON, EPYC, FLAT])
def test_no_rung_costs_as_much_as_a_longer_proposal(costs):
    ladder = choose_ladder(costs, 16)
    assert list(ladder) == sorted(ladder) and 1 <= ladder[0] and ladder[-1] <= 16
    for g in ladder:
        assert all(costs[g + 1] < costs[h + 1] for h in range(g + 1, 17) if h in ladder)


def test_a_draft_proposes_the_ladder_it_is_given():
    d = Draft.of(list(range(100, 140)), ladder=(4, 7, 12))
    assert len(d.propose([1, 2, 3], 16)) == 12  # the first proposal is a full rung
    d.update(0, [999])
    # One token matches the draft: the lowest rung; two: the middle; three: the top.
    assert d.propose([1, 2, 3, 999, 120], 16) == list(range(121, 125))
    d.withdraw()
    assert len(d.propose([1, 2, 3, 999, 120, 121], 16)) == 7
    d.withdraw()
    assert len(d.propose([1, 2, 3, 999, 120, 121, 122], 16)) == 12
    assert Draft.of([1, 2]).ladder == default_ladder(16) == LADDER


def _lengths(draft: list[int], answer: list[int], costs: dict[int, float]) -> list[int]:
    """Proposal lengths of a draft (lengths by cost) verified greedily against `answer`."""
    d = Draft.of(draft, self_lookup=False, costs=tuple(costs[q] for q in sorted(costs)))
    assert d.lengths == frontier(costs, 16)
    gen: list[int] = []
    out = []
    while len(gen) < len(answer):
        prop = d.propose([1, 2, 3] + gen, 16)
        out.append(len(prop))
        a = 0
        while a < len(prop) and len(gen) + a < len(answer) and prop[a] == answer[len(gen) + a]:
            a += 1
        d.update(a, answer[len(gen):len(gen) + a + 1])
        gen += answer[len(gen):len(gen) + a + 1]
    return out


def test_lengths_by_cost_follow_how_long_a_source_keeps_verifying():
    assert expected_run(0.5, 2) == 0.75 and expected_run(1.0, 7) == 7.0
    assert frontier(EPYC, 16) == (4, 5, 7, 16) and frontier(FLAT, 16) == (16,)
    answer = list(range(100, 300))
    # A draft the model follows: the longest proposals on every device.
    for costs in (EPYC, XEON, FLAT):
        assert set(_lengths(answer, answer, costs)[:-1]) == {16}
    # One that fails every second token: after its first (full-rung) proposal, the length
    # that pays for about one verified token: EPYC's cheapest (1-3 tokens cost more than 4),
    # XEON's 2 (1.24x a decode step for 1.75 tokens expected).
    halves = [t if i % 2 == 0 else 999 for i, t in enumerate(answer)]
    assert set(_lengths(halves, answer, EPYC)[1:-1]) == {4}
    assert set(_lengths(halves, answer, XEON)[1:-1]) == {2}


def test_a_replica_measures_its_ladder_or_takes_the_configured_one(tiny_model):
    from services.kvpool.app import draft_ladder
    from services.kvpool.config import KvPoolConfig

    assert draft_ladder(KvPoolConfig(draft_ladder="2,3,5"), tiny_model) == ((2, 3, 5),
                                                                           "configured", ())
    # Measured, or (a busy host) the fixed lengths: within max_draft_tokens either way.
    choice = draft_ladder(KvPoolConfig(max_draft_tokens=8), tiny_model)
    low, mid, high = choice.ladder
    assert 1 <= low <= mid <= high <= 8
    assert choice.source == "measured" or choice.source.startswith("fixed: ")
    if choice.source == "measured":  # forwards of 1..9 tokens, relative to one token's
        assert len(choice.costs) == 9 and choice.costs[0] == 1.0


def test_the_fixed_lengths_stay_within_max_draft_tokens():
    assert default_ladder(16) == (1, 2, 16)
    assert default_ladder(32) == (1, 2, 32)  # hardware that pays for longer proposals
    assert default_ladder(8) == (1, 2, 8)  # was (1, 2, 16): a CI run on a busy host fell back
    assert default_ladder(1) == (1, 1, 1)


def test_a_replica_whose_timing_fails_or_looks_disturbed_keeps_the_fixed_lengths(
        tiny_model, monkeypatch, caplog):
    """A model the engine serves may fail the plain-cache timing (a sliding window shorter
    than the timing's context): the replica did not start. A busy host gave one length 14x
    cheaper than the rest, and an absurd ladder for the replica's whole life."""
    from services.kvpool import app
    from services.kvpool.config import KvPoolConfig

    def fails(model, max_q, **kw):
        raise RuntimeError("The size of tensor a (64) must match the size of tensor b (97)")

    monkeypatch.setattr(app, "forward_costs", fails)
    choice = app.draft_ladder(KvPoolConfig(), tiny_model)
    assert choice.ladder == default_ladder(16) and choice.costs == ()
    assert choice.source.startswith("fixed: could not time draft forwards (RuntimeError")
    assert "could not time draft forwards" in caplog.text
    disturbed = {q: 1.0 for q in range(1, 18)}
    disturbed[9] = 0.07
    monkeypatch.setattr(app, "forward_costs", lambda model, max_q, **kw: disturbed)
    choice = app.draft_ladder(KvPoolConfig(), tiny_model)
    assert choice.ladder == default_ladder(16) and "look disturbed" in choice.source
    assert choice.costs[8] == 0.07  # what it refused, for Stats
    assert "look disturbed" in caplog.text
    # On oneDNN a forward of a few tokens costs about one token's: a replica started beside
    # the other services timed 2-6 tokens at 0.84x, and that is a ladder, not noise.
    one_dnn = {q: 0.84 if q <= 6 else 0.84 + 0.04 * (q - 6) for q in range(1, 18)}
    one_dnn[1] = 1.0
    monkeypatch.setattr(app, "forward_costs", lambda model, max_q, **kw: one_dnn)
    choice = app.draft_ladder(KvPoolConfig(), tiny_model)
    assert choice.source == "measured" and choice.ladder[-1] == 16


def test_timing_past_its_budget_gives_up(tiny_model):
    from services.kvpool.calibrate import TooSlow, forward_costs

    with pytest.raises(TooSlow):
        forward_costs(tiny_model, 4, budget_s=0.0)


def test_sweeps_timed_while_the_host_was_busy_are_dropped():
    """Measured on this project's host: a busy process beside the timing made its sweep 2.4x
    slower and cut this process's CPU from 1.94 to 1.42 cores; quiet sweeps took 1.99-2.57 s."""
    from services.kvpool.calibrate import Sweep, undisturbed

    quiet = [Sweep({1: 0.07}, wall, 1.94 * wall) for wall in (2.28, 2.25, 2.57, 1.99)]
    slow = Sweep({1: 0.2}, 5.46, 1.42 * 5.46)
    starved = Sweep({1: 0.07}, 2.3, 1.3 * 2.3)  # not slower overall, but short of CPU
    kept = undisturbed(quiet + [slow, starved])
    assert kept == quiet
    assert undisturbed([slow]) == [slow]  # judged against each other: one alone stands
    # One freak fast sweep does not make the quiet ones look slow.
    lucky = Sweep({1: 0.05}, 1.4, 1.94 * 1.4)
    assert undisturbed(quiet + [lucky]) == quiet + [lucky]


def test_forward_costs_times_every_length_from_undisturbed_sweeps(tiny_model):
    from services.kvpool.calibrate import forward_costs

    # The default 60 s budget is the service's; on a host shared with other work the sweeps
    # rarely count as undisturbed, and it ran out (TooSlow) though the code was right.
    costs = forward_costs(tiny_model, 5, sweeps=3, budget_s=600)
    assert sorted(costs) == [1, 2, 3, 4, 5] and all(c > 0 for c in costs.values())


def test_the_top_rung_counts_the_models_own_token():
    """The top rung maximises (g + 1) / costs[g + 1] (every forward also emits the model's own
    token), not g / costs[g + 1]: here 2 tokens (3 per 1.45) beat 4 (5 per 2.6)."""
    costs = {1: 1.0, 2: 1.0, 3: 1.45, 4: 2.2, 5: 2.6}
    assert frontier(costs, 4) == (1, 2, 3, 4)
    assert choose_ladder(costs, 4) == (1, 2, 2)


def test_a_shorter_length_joins_the_frontier_only_when_two_percent_cheaper():
    """Timing noise: a length 1.5% cheaper than a longer one is not on the frontier, 2.1% is."""
    assert frontier({1: 1.0, 2: 0.985, 3: 1.0}, 2) == (2,)
    assert frontier({1: 1.0, 2: 0.979, 3: 1.0}, 2) == (1, 2)


def test_a_length_exactly_two_percent_cheaper_joins_the_frontier() -> None:
    """'at least 2% cheaper': the bound itself counts (it was left out: the differential
    review's frontier by brute force kept 1 here, the code did not)."""
    assert frontier({1: 1.0, 2: 0.98, 3: 1.0}, 2) == (1, 2)
    assert frontier({1: 1.0, 2: 0.5, 3: 0.98, 4: 1.0}, 3) == (1, 2, 3)


def test_guesses_are_cheap_at_exactly_guess_cost_max_unit() -> None:
    """'at most GUESS_COST_MAX of a 1-token decode step': the bound itself counts."""
    from services.kvpool.drafting import GUESS_COST_MAX, LadderChoice

    assert LadderChoice((1, 2, 16), "measured", (1.0, GUESS_COST_MAX)).cheap_guesses
    assert not LadderChoice((1, 2, 16), "measured", (1.0, GUESS_COST_MAX + 0.01)).cheap_guesses
