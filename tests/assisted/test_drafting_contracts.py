"""Contracts of `Draft` (pure logic): what it proposes after each forward."""

from __future__ import annotations

from services.kvpool.drafting import LOOKUP_RATE_MIN, WEAK_RATE_MIN, Draft, LadderChoice, Source

PROMPT = [1, 2, 3]
DRAFT = list(range(100, 140))  # distinct tokens: every n-gram occurs once


def step(d: Draft, gen: list[int], answer: list[int], limit: int = 16) -> list[int]:
    """One forward against a greedy verifier that knows `answer`: propose after PROMPT + gen,
    accept the proposal's prefix that agrees, emit it and the model's own token. Returns the
    proposal; `gen` grows by what was emitted."""
    prop = d.propose(PROMPT + gen, limit)
    a = 0
    while a < len(prop) and len(gen) + a < len(answer) - 1 and prop[a] == answer[len(gen) + a]:
        a += 1
    emitted = prop[:a] + [answer[len(gen) + a]]
    gen += emitted
    d.update(a, emitted)
    return prop


def forwards(answer: list[int], draft: list[int], **kw) -> int:
    """Forward passes to generate `answer` with `draft` (the greedy verifier of `step`)."""
    d = Draft.of(draft, **kw)
    gen: list[int] = []
    n = 0
    while len(gen) < len(answer):
        step(d, gen, answer)
        n += 1
    return n


def test_the_first_proposal_is_the_drafts_start_at_the_top_rung_unit() -> None:
    """It rides on the prompt's prefill forward, where extra tokens are almost free."""
    assert Draft.of(DRAFT).propose(PROMPT, 16) == DRAFT[:16]
    assert Draft.of(DRAFT).propose(PROMPT, 5) == DRAFT[:5]
    assert Draft.of(DRAFT).propose(PROMPT, 0) == []
    assert Draft.of([200], self_lookup=False).propose([], 16) == [200]


def test_a_withdrawn_first_proposal_is_made_again_unit() -> None:
    """No room for it at prefill: the next forward still starts from the draft's start."""
    d = Draft.of(DRAFT)
    assert d.propose(PROMPT, 16) == DRAFT[:16]
    d.withdraw()
    assert d.pending.tokens == []
    assert d.propose(PROMPT, 16) == DRAFT[:16]


def test_a_followed_draft_is_proposed_on_at_the_top_rung_unit() -> None:
    d = Draft.of(DRAFT)
    gen: list[int] = []
    assert step(d, gen, DRAFT) == DRAFT[:16]
    assert gen == DRAFT[:17]  # 16 accepted and the model's own token, the draft's 17th
    assert step(d, gen, DRAFT, limit=5) == DRAFT[17:22]  # capped by the limit
    assert step(d, gen, DRAFT) == DRAFT[23:39]
    assert d.accepted == d.proposed == 16 + 5 + 16 and d.accepted_lookup == 0


def test_a_substituted_token_resumes_the_draft_right_after_it_unit() -> None:
    answer = DRAFT[:20] + [7] + DRAFT[21:]  # the model replaces draft token 20 by its own 7
    d = Draft.of(DRAFT, self_lookup=False)
    gen: list[int] = []
    step(d, gen, answer)
    step(d, gen, answer)
    assert gen == answer[:21]  # accepted 19, 20 and then the model's 7
    prop = step(d, gen, answer)
    assert prop[0] == DRAFT[21] and len(prop) == d.ladder[0]  # a guess: the lowest rung
    assert step(d, gen, answer)[0] == DRAFT[21 + len(prop) + 1]


def test_skipped_tokens_re_align_on_one_matching_token_unit() -> None:
    d = Draft.of(DRAFT, self_lookup=False)
    gen = DRAFT[:6]
    d.update(0, gen)
    gen += [108]  # the model skipped 106, 107
    d.update(0, [108])
    assert d.propose(PROMPT + gen, 16) == DRAFT[9:9 + d.ladder[0]]


def test_the_longest_match_wins_then_the_nearest_to_where_the_draft_was_followed_unit() -> None:
    draft = [10, 11, 12, 13, 50, 51, 10, 11, 14, 15, 60, 61, 62, 10, 11, 16]
    d = Draft.of(draft, self_lookup=False)
    gen = [60, 61, 62]
    d.update(0, gen)  # followed the draft up to index 13
    # "10 11" occurs three times: after index 13 the nearest is at 13..14 (then 16).
    assert d.propose(PROMPT + gen + [10, 11], 16)[:1] == [16]
    d.withdraw()
    # "13 50 ... 10 11" vs "62 10 11": the 3-token match wins over the nearer 2-token ones.
    assert d.propose(PROMPT + [51, 10, 11], 16)[:1] == [14]
    d.withdraw()
    # Proposal length follows the match: 3+ tokens the top rung, 2 the middle, 1 the lowest.
    assert len(d.propose(PROMPT + [51, 10, 11], 16)) == min(d.ladder[2], 16 - 8)
    d.withdraw()
    assert len(d.propose(PROMPT + [99, 60, 61], 16)) == min(d.ladder[1], 16 - 12)


def test_prompt_lookup_proposes_what_followed_the_latest_match_unit() -> None:
    d = Draft.of([200, 201, 202])
    d.record(0)  # past the first proposal
    ctx = [5, 6, 7, 8, 9, 5, 6]
    prop = d.propose(ctx, 16)
    assert prop == [7, 8, 9, 5, 6][:d.ladder[1]] and d.pending.source is Source.LOOKUP
    d.update(len(prop), prop + [0])
    assert d.accepted == d.accepted_lookup == len(prop)


def test_on_a_tie_the_draft_wins_and_a_longer_context_match_beats_it_unit() -> None:
    draft = [40, 41, 42, 43, 44]
    d = Draft.of(draft)
    d.record(0)
    # "41 42" ends the context; it is in the draft (then 43) and earlier in the context (then 9).
    assert d.propose([41, 42, 9, 41, 42], 16)[:1] == [43]
    assert d.pending.source is Source.DRAFT
    d = Draft.of(draft)  # (a draft indexes its context as it grows: a new one for a new one)
    d.record(0)
    # "30 41 42" occurred in the context: a 3-token match beats the draft's 2-token one.
    assert d.propose([30, 41, 42, 9, 30, 41, 42], 16)[:1] == [9]
    assert d.pending.source is Source.LOOKUP


def test_a_failing_lookup_proposes_on_three_token_matches_only_unit() -> None:
    ctx3 = [1, 2, 3, 9, 1, 2, 3]  # its last 3 tokens occurred before, followed by 9
    ctx2 = ctx3 + [5, 2, 3]  # its last 2 (2, 3) occurred before (last followed by 5), 3 not
    d = Draft.of([200, 201, 202])
    d.record(0)
    assert d.propose(ctx2, 16)[:1] == [5]
    d.withdraw()
    misses = 0
    while d.lookup_rate >= LOOKUP_RATE_MIN:  # lookup proposals the model keeps rejecting
        prop = d.propose(ctx3, 16)
        assert prop and prop[0] == 9
        d.record(0)
        misses += 1
        assert misses < 20
    assert misses > 1  # one rejection alone does not silence 2-token matches
    assert d.propose(ctx3, 16)[:1] == [9]  # a 3-token context match still proposes...
    d.withdraw()
    assert d.propose(ctx2, 16) == []  # ...a 2-token one no longer does
    assert d.pending.tokens == []


def _unrelated(cheap: bool) -> tuple[list[int], Draft]:
    """A draft the model never follows; each generated token is one of the draft's, so every
    forward has a 1-token match (or a substitution guess) to propose on."""
    d = Draft.of(list(range(1, 11)), self_lookup=False, cheap_guesses=cheap)
    gen: list[int] = []
    sizes = []
    for t in [50, 5, 51, 3, 52, 8, 53, 2, 54]:
        sizes.append(len(d.propose([0] + gen, 16)))
        gen.append(t)
        d.update(0, [t])
    return sizes, d


def test_a_failing_draft_proposes_only_on_solid_matches_unless_guesses_are_cheap_unit() -> None:
    sizes, d = _unrelated(cheap=False)
    assert sizes[0] == 10 and sizes[1] >= 1 and sizes[-1] == 0 and d.rate < WEAK_RATE_MIN
    gen = [50, 5, 51, 3, 52, 8, 53, 2, 54, 6, 7]  # a 2-gram of the draft: solid evidence
    assert d.propose([0] + gen, 16)[:2] == [8, 9]
    sizes, d = _unrelated(cheap=True)  # a failed guess costs nothing: it keeps guessing
    assert d.rate < WEAK_RATE_MIN and all(sizes)


def test_guesses_are_cheap_where_the_lowest_rung_was_timed_at_a_decode_steps_cost_unit() -> None:
    costs = (1.0, 1.2, 1.0, 0.86, 0.84, 0.84, 0.98)
    assert LadderChoice((5, 9, 16), "measured", costs).cheap_guesses
    assert LadderChoice((6, 9, 16), "measured", costs).cheap_guesses  # 0.98 <= 1.05
    assert not LadderChoice((1, 9, 16), "measured", costs).cheap_guesses  # 1.2x
    assert not LadderChoice((5, 9, 16), "configured").cheap_guesses  # not timed
    assert not LadderChoice((5, 9, 16), "fixed: disturbed", costs).cheap_guesses  # refused


def test_a_draft_proposes_again_after_a_replaced_phrase_of_any_length_unit() -> None:
    """The model replaces 1..8 draft tokens by its own, then follows the draft again (distinct
    tokens: no n-gram to re-align on). From 5 replaced tokens on, the draft's rate fell below
    the weak-alignment floor and it never proposed again: 61 forwards for 80 tokens, although
    the last 55 equal the draft."""
    draft = list(range(1000, 1080))
    own = list(range(100, 108))
    assert forwards(draft, draft) == 5
    for n in range(1, 9):
        answer = draft[:20] + own[:n] + draft[20 + n:]
        assert forwards(answer, draft) <= 8 + n, (n, forwards(answer, draft))


def test_the_proposal_grows_while_proposals_verify_unit() -> None:
    """A fully verified proposal lifts the next one a rung above its own, whatever the match."""
    answer = DRAFT[:20] + [7, DRAFT[21], 8] + DRAFT[23:]  # two one-word substitutions
    d = Draft.of(DRAFT, self_lookup=False, ladder=(1, 4, 8))
    gen: list[int] = []
    sizes = [len(step(d, gen, answer)) for _ in range(6)]
    # The start (8), a 3+ token match (8), then 118 119 verify and the model says 7: a
    # substitution guess at the lowest rung (1) verifies, and the model says 8 where the draft
    # has 122. Another guess, one rung up (4), verifies too: the next is the top rung.
    assert sizes == [8, 8, 8, 1, 4, 8]
    assert gen[:30] == answer[:30]


TAIL = list(range(300, 312))  # 12 distinct tokens that end the context


def test_a_match_is_ranked_by_up_to_32_tokens_not_fewer() -> None:
    """The draft holds the context's last 9 tokens (then 500) near its start and its last 12
    (then 600) further on: the 12-token match wins although the 9-token one is nearer the
    hint (a cap of 8 would tie them and pick the nearer)."""
    draft = [1] + TAIL[-9:] + [500] + [2, 3, 4] + TAIL + [600, 5, 6]
    d = Draft.of(draft, self_lookup=False)
    d.record(0)  # past the first proposal
    assert d.propose(PROMPT + TAIL, 16)[:1] == [600]
    assert d.matched == 12


def test_prompt_lookup_takes_the_latest_of_many_equal_matches() -> None:
    """'5 6' occurs 100 times in the context, each time followed by a new token: lookup
    proposes what followed the latest (199), not one of the first 64."""
    d = Draft.of([900, 901])
    d.record(0)
    ctx = [t for i in range(100) for t in (5, 6, 100 + i)] + [5, 6]
    prop = d.propose(ctx, 16)
    assert d.pending.source is Source.LOOKUP
    assert prop == [199, 5, 6][:d.ladder[1]]


def test_lookup_accepted_counts_only_the_tokens_used() -> None:
    """A stop token among the accepted ends the answer: the accepted counts (and the lookup
    share of them) report the tokens used."""
    d = Draft.of([200, 201, 202])
    d.record(0)
    prop = d.propose([5, 6, 7, 8, 9, 5, 6], 16)
    assert d.pending.source is Source.LOOKUP and len(prop) >= 2
    d.record(len(prop), used=1)
    assert d.accepted == d.accepted_lookup == 1


def test_a_proposal_that_failed_at_once_does_not_move_the_hint() -> None:
    """'among equal matches the one nearest where the draft was last followed': a proposal
    whose first token the model replaced was not followed, so ties keep ranking by the old
    place (index 0 here), not by where that proposal started (11)."""
    draft = [50, 51, 77, 52, 53, 54, 55, 56, 57, 58, 60, 61, 62, 77, 63, 64]
    d = Draft.of(draft, self_lookup=False)
    d.record(0)
    assert d.propose(PROMPT + [60], 16) == [61]  # a 1-token match at 10: the lowest rung
    d.update(0, [77])  # the model said 77, not 61
    # 77 is at 2 and at 13, each a 1-token match: the one nearer index 0 wins.
    assert d.propose(PROMPT + [60, 77], 16)[:1] == [52]
