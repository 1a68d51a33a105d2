"""Drafts in a batch: proposals are cut to what pays for every row's longer forward."""

from __future__ import annotations

import pytest

from services.kvpool.drafting import (
    BatchTrust,
    Draft,
    LadderChoice,
    ServedCosts,
    batch_keep,
    forward_cost,
)
from services.kvpool.engine import EngineRequest
from services.kvpool.sampling import SamplingSpec
from tests.assisted.test_assisted_engine import N_NEW, prompt
from tests.kvpool.conftest import assert_idle, collect, reference_greedy
from tests.kvpool.test_kvpool_engine import paused

# Relative costs of a forward of q = 1..17 tokens: as timed on the 2-core host (oneDNN), where
# 5 tokens cost less than 1 and 17 cost 1.36x; steep, where each extra token costs half a step;
# flat, as on a GPU.
CPU = (1.0, 0.988, 0.829, 0.739, 0.736, 0.723, 0.838, 0.896, 0.978, 1.027, 1.003, 1.102, 1.129,
       1.21, 1.275, 1.274, 1.357)
STEEP = tuple(1.0 + 0.5 * i for i in range(17))
FLAT = (1.0,) * 17


def test_forward_cost_is_the_timing_then_its_upper_half_slope() -> None:
    assert [forward_cost(STEEP, n) for n in (1, 2, 17)] == [1.0, 1.5, 9.0]
    assert forward_cost(STEEP, 41) == pytest.approx(9.0 + 0.5 * 24)
    assert forward_cost(FLAT, 1000) == 1.0
    # Timings that fall in their upper half (noise) never make longer forwards cheaper.
    falling = (1.0,) * 8 + tuple(1.0 - 0.01 * i for i in range(9))
    assert forward_cost(falling, 200) == falling[-1]
    # The slope of the upper half, not its end points: one noisy last timing moves it little.
    bumped = STEEP[:-1] + (STEEP[-1] + 2.0,)
    assert forward_cost(bumped, 117) - bumped[-1] < 0.8 * 100


def test_batch_keep_weighs_expected_tokens_against_every_rows_cost() -> None:
    # On a GPU-like device every proposal rides along, however poor.
    assert batch_keep(FLAT, [16, 0, 0, 0], [0.05, 0, 0, 0]) == 16
    # One row alone keeps a cheap proposal (5 tokens cost less than 1 there).
    assert batch_keep(CPU, [4], [0.0]) == 4
    # A batch of 8: one row's proposal would make all 8 rows pay for 5 or 16 tokens each.
    assert batch_keep(CPU, [4] + [0] * 7, [1.0] + [0.0] * 7) == 0
    assert batch_keep(CPU, [15] + [0] * 7, [1.0] + [0.0] * 7) == 0
    # A batch of 4 with a draft that keeps verifying: 15 tokens for it are worth 4 rows of 16
    # (a decode step of 4 single-token rows costs a 1-token forward, not the cheap 4-token one
    # of the timing), and 4 weak ones are not.
    assert batch_keep(CPU, [15, 0, 0, 0], [1.0, 0.0, 0.0, 0.0]) == 15
    assert batch_keep(CPU, [4, 0, 0, 0], [0.1, 0.0, 0.0, 0.0]) == 0
    # Two rows that keep verifying: worth it.
    assert batch_keep(CPU, [15, 15], [0.9, 0.9]) == 15
    # ... not when they keep failing.
    assert batch_keep(CPU, [15, 15], [0.02, 0.02]) == 0
    # Steep costs: of a 15- and a 4-token proposal that verify, only the first 4 tokens pay
    # for themselves; at a 30% rate for the longer one, not even those.
    assert batch_keep(STEEP, [15, 4], [1.0, 1.0]) == 4
    assert batch_keep(STEEP, [15, 4], [0.3, 1.0]) == 0
    assert batch_keep(FLAT, [15, 4], [1.0, 1.0]) == 15


def test_batch_keep_scales_expectations_by_the_trust_batches_earned() -> None:
    # Two rows that verify 90% of their proposals pay for 15 tokens each; trusted to verify
    # a twentieth of that, they do not. Under steep costs the 4 tokens that paid no longer do
    # at half the trust.
    assert batch_keep(CPU, [15, 15], [0.9, 0.9], trust=1.0) == 15
    assert batch_keep(CPU, [15, 15], [0.9, 0.9], trust=0.05) == 0
    assert batch_keep(STEEP, [15, 4], [1.0, 1.0], trust=1.0) == 4
    assert batch_keep(STEEP, [15, 4], [1.0, 1.0], trust=0.5) == 0
    # Where forwards cost alike, every proposal rides however little it is trusted.
    assert batch_keep(FLAT, [16, 0], [0.05, 0.0], trust=0.1) == 16


def test_batch_trust_follows_what_kept_proposals_verified() -> None:
    t = BatchTrust()
    assert t.factor == 1.0
    for _ in range(40):
        t.observe(10.0, 5)  # half of what was expected
    assert t.factor == pytest.approx(0.5, abs=0.03)
    for _ in range(200):
        t.observe(10.0, 0)
    assert t.factor == BatchTrust.FLOOR  # never zero: proposals can earn it back
    for _ in range(200):
        t.observe(1.0, 10)
    assert t.factor == BatchTrust.CEILING


def _record_forwards(eng) -> list[tuple[int, int]]:
    """Every forward's (rows, tokens per row) that `eng` runs from now on."""
    shapes: list[tuple[int, int]] = []
    real_forward = eng._forward

    def forward(ids, plan, keep=1, need=None):
        shapes.append((plan.batch, plan.q_len))
        return real_forward(ids, plan, keep, need)

    eng._forward = forward
    return shapes


def _batch(eng, tiny_model, ladder: LadderChoice | None):
    """One row drafting its own reference answer beside two plain rows, in the same forwards;
    every batched forward's (rows, tokens per row)."""
    if ladder is not None:
        eng.draft_ladder = ladder
    prompts = [prompt(6 + i, 50 + i) for i in range(3)]
    refs = [reference_greedy(tiny_model, p, N_NEW) for p in prompts]
    shapes = _record_forwards(eng)
    with paused(eng):
        outs = [eng.submit(EngineRequest(f"g{i}", p, SamplingSpec(N_NEW),
                                         draft_token_ids=tuple(refs[0]) if i == 0 else ()))[1]
                for i, p in enumerate(prompts)]
    res = [collect(o) for o in outs]
    assert [t for t, _ in res] == refs  # a cut proposal never changes an answer
    assert_idle(eng)
    return res[0][1], [(b, q) for b, q in shapes if b > 1]


def test_a_batch_withholds_proposals_that_cost_every_row_more_than_they_save(
        make_engine, tiny_model) -> None:
    eng = make_engine(num_blocks=128, block_size=4, max_batch_size=4)
    fin, shapes = _batch(eng, tiny_model, LadderChoice((1, 2, 16), "measured", STEEP))
    # Proposals were verified only where the drafting row ran alone (its prefill, and any
    # step before the others were admitted), never in a forward of several rows.
    assert shapes and all(q == 1 for _, q in shapes), shapes
    assert eng.draft_tokens_withheld_total > 0
    assert eng.stats().draft_tokens_withheld_total == eng.draft_tokens_withheld_total


def test_a_batch_learns_how_far_to_trust_its_proposals(make_engine, tiny_model) -> None:
    """Flat costs keep every proposal, so a draft of the answer verifies in full: what was
    kept verified at least what the rule expected, and the trust does not fall."""
    eng = make_engine(num_blocks=128, block_size=4, max_batch_size=4)
    before = eng.batch_trust.verified
    _batch(eng, tiny_model, LadderChoice((1, 2, 16), "measured", FLAT))
    assert eng.batch_trust.verified > before  # batch forwards with proposals were weighed
    assert eng.batch_trust.factor >= 1.0
    # A draft that shares nothing with its answer verifies less than was expected of it.
    junk = make_engine(num_blocks=128, block_size=4, max_batch_size=4)
    junk.draft_ladder = LadderChoice((1, 2, 16), "measured", FLAT)
    prompts = [prompt(6 + i, 50 + i) for i in range(3)]
    with paused(junk):
        outs = [junk.submit(EngineRequest(f"j{i}", p, SamplingSpec(N_NEW, ignore_eos=True),
                                          draft_token_ids=(7, 8) * 20))[1]
                for i, p in enumerate(prompts)]
    assert all(len(collect(o)[0]) == N_NEW for o in outs)
    assert junk.batch_trust.factor < 1.0
    assert_idle(junk)


@pytest.mark.parametrize("case", ["flat costs", "gate off", "unmeasured ladder"])
def test_a_batch_keeps_proposals_that_pay_or_when_told_to(make_engine, tiny_model,
                                                          case) -> None:
    eng = make_engine(num_blocks=128, block_size=4, max_batch_size=4,
                      batch_gate=case != "gate off")
    ladder = {"flat costs": LadderChoice((1, 2, 16), "measured", FLAT),
              "gate off": LadderChoice((1, 2, 16), "measured", STEEP),
              "unmeasured ladder": LadderChoice((1, 2, 16), "configured")}[case]
    fin, shapes = _batch(eng, tiny_model, ladder)
    assert any(q > 1 for _, q in shapes), shapes
    assert fin.draft_tokens_accepted == fin.draft_tokens_proposed >= N_NEW - 5
    assert eng.draft_tokens_withheld_total == 0


@pytest.mark.parametrize("measured", [True, False])
def test_a_measured_ladder_gives_lengths_by_cost(make_engine, tiny_model, measured) -> None:
    """With the replica's timing, a sequence's later proposals take the lengths that pay for
    themselves (`Draft.length`): under STEEP costs a draft that keeps verifying grows from a
    few tokens (5, 6, 7 here), off the ladder's rungs. Configured rungs are kept as given."""
    eng = make_engine(num_blocks=128, block_size=4, max_batch_size=4)
    eng.draft_ladder = LadderChoice((1, 2, 16), "measured" if measured else "configured",
                                    STEEP if measured else ())
    p = prompt(6, 50)
    ref = reference_greedy(tiny_model, p, N_NEW)
    shapes = _record_forwards(eng)
    toks, fin = collect(eng.submit(EngineRequest("m", p, SamplingSpec(N_NEW),
                                                 draft_token_ids=tuple(ref)))[1])
    assert toks == ref
    assert_idle(eng)
    # After the prefill forward (which carries the first proposal), short of the last one
    # (cut to the tokens left to generate).
    q_lens = [q for _, q in shapes]
    decode = q_lens[1:-1]
    if measured:
        assert any(q - 1 not in (1, 2, 16) for q in decode), q_lens
    else:
        assert decode and all(q - 1 in (0, 1, 2, 16) for q in decode), q_lens


def test_served_costs_replace_the_timing_length_by_length() -> None:
    sc = ServedCosts(STEEP)
    for _ in range(ServedCosts.MIN_SAMPLES - 1):
        sc.observe(1, 0.1)
        sc.observe(6, 0.13)
    assert sc.now == STEEP  # too few steps yet
    sc.observe(1, 0.1)
    sc.observe(6, 0.13)
    # 6 tokens per row cost 1.3 steps of one as served (3.5 in the timing); the rest as timed.
    assert sc.now[5] == 1.3 and sc.now[:5] == STEEP[:5] and sc.now[6:] == STEEP[6:]
    sc.observe(6, 10.0)  # a step the host disturbed (past 3x its mean): not counted
    sc.observe(40, 0.5)  # a length past the timing: not learned
    assert sc.now[5] == 1.3 and sc.samples[5] == ServedCosts.MIN_SAMPLES
    for _ in range(200):  # the host got slower at 6 tokens: the mean follows
        sc.observe(6, 0.2)
    assert sc.now[5] == pytest.approx(2.0, abs=0.01)


def test_served_costs_hold_when_the_host_slows_between_lengths() -> None:
    """Each step is costed against the 1-token steps of its time: a host that got twice as
    slow after the 5-token steps were served does not make them look cheap."""
    sc = ServedCosts(STEEP)
    for _ in range(50):  # a 5-token step costs 1.2 one-token steps
        sc.observe(1, 0.010)
        sc.observe(5, 0.012)
    assert sc.now[4] == pytest.approx(1.2)
    for _ in range(50):  # the host got twice as slow; only 1-token steps for a while
        sc.observe(1, 0.020)
    assert sc.now[4] == pytest.approx(1.2)  # mean times at the end: 0.012 / 0.020 = 0.6
    for _ in range(3):
        sc.observe(5, 0.024)
    assert sc.now[4] == pytest.approx(1.2, abs=0.01)
    # A longer step before any 1-token one has nothing to be costed against.
    fresh = ServedCosts(STEEP)
    fresh.observe(5, 0.012)
    assert fresh.samples[4] == 0


@pytest.mark.parametrize("learn", [True, False])
def test_an_engine_learns_its_steps_costs_over_the_timing(make_engine, tiny_model, learn,
                                                         monkeypatch) -> None:
    eng = make_engine(num_blocks=128, block_size=4, max_batch_size=4, learn_costs=learn)
    eng.draft_ladder = LadderChoice((1, 2, 16), "measured", STEEP)
    p = prompt(6, 50)
    ref = reference_greedy(tiny_model, p, N_NEW)
    # 1-token steps, then verify steps: a draft wrong at every other token proposes short.
    halves = tuple(t if k % 2 == 0 else (t + 1) % 50 for k, t in enumerate(ref))
    for i, draft in enumerate([(), halves, halves, halves]):
        toks, _ = collect(eng.submit(EngineRequest(f"c{i}", p, SamplingSpec(N_NEW),
                                                   draft_token_ids=draft))[1])
        assert toks == ref
    if not learn:
        assert eng.served_costs is None and eng.costs() == STEEP
        return
    sc = eng.served_costs
    assert sc.samples[0] >= sc.MIN_SAMPLES and eng.costs()[0] == 1.0
    # The tiny model's steps cost nothing like STEEP's: where a length was served often
    # enough, the choices by cost now read its served cost.
    learned = [q for q in range(2, len(STEEP) + 1) if sc.samples[q - 1] >= sc.MIN_SAMPLES]
    assert learned, sc.samples
    assert all(eng.costs()[q - 1] != STEEP[q - 1] for q in learned)
    assert all(eng.costs()[q - 1] == STEEP[q - 1] for q in range(2, len(STEEP) + 1)
               if q not in learned)
    # New requests' drafts choose their lengths by the learned costs.
    given: list[tuple[float, ...]] = []
    real_of = Draft.of
    monkeypatch.setattr(Draft, "of", staticmethod(
        lambda *a, **kw: given.append(kw["costs"]) or real_of(*a, **kw)))
    now = eng.costs()  # (the request's own steps then go on teaching it)
    collect(eng.submit(EngineRequest("after", p, SamplingSpec(4), draft_token_ids=halves))[1])
    assert given == [now]
