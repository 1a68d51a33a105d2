"""Contracts of `Draft` (pure logic) that a mutation audit found unguarded."""

from __future__ import annotations

from services.kvpool.drafting import LOOKUP_RATE_MIN, Draft

# Context whose last 3 tokens (1, 2, 3) occurred before, followed by 9.
CTX3 = [1, 2, 3, 9, 1, 2, 3]
# CTX3 grown by 3 tokens: its last 2 (2, 3) occurred before (last followed by 5), its last 3 not.
CTX2 = CTX3 + [5, 2, 3]


def unaligned() -> Draft:
    """A draft with nothing aligned: proposals come from the sequence's own context only."""
    d = Draft.of([200, 201, 202])
    d.pos = None
    return d


def test_a_fresh_lookup_trusts_two_and_three_token_context_matches_unit() -> None:
    assert unaligned().propose(CTX3, 16)[:1] == [9]
    assert unaligned().propose(CTX2, 16) == [5]


def test_a_failing_lookup_proposes_on_three_token_matches_only_unit() -> None:
    d = unaligned()
    misses = 0
    while d.lookup_rate >= LOOKUP_RATE_MIN:  # lookup proposals the model keeps rejecting
        prop = d.propose(CTX3, 16)
        assert prop and prop[0] == 9
        d.record(0)
        misses += 1
        assert misses < 20
    assert misses > 1  # one rejection alone does not silence 2-token matches
    # A 3-token context match still proposes...
    assert d.propose(CTX3, 16)[:1] == [9]
    d.withdraw()
    # ...a 2-token one no longer does.
    assert d.propose(CTX2, 16) == []
    assert d.pending.tokens == []


def _forwards(answer: list[int], draft: list[int], prompt=(1, 2, 3)) -> int:
    """Forward passes to generate `answer` with `draft`, against a greedy verifier that
    accepts the longest agreeing prefix of each proposal and then emits its own token."""
    d = Draft.of(draft)
    gen: list[int] = []
    forwards = 0
    while len(gen) < len(answer):
        prop = d.propose([*prompt, *gen], 16)
        a = 0
        while (a < len(prop) and len(gen) + a < len(answer) - 1
               and prop[a] == answer[len(gen) + a]):
            a += 1
        emitted = prop[:a] + [answer[len(gen) + a]]
        gen += emitted
        d.update(a, emitted, gen)
        forwards += 1
    return forwards


def test_a_draft_proposes_again_after_a_replaced_phrase_of_any_length_unit() -> None:
    """The model replaces 1..8 draft tokens by its own, then follows the draft again (distinct
    tokens: no n-gram to re-align on). From 5 replaced tokens on, the draft's rate fell below
    the weak-alignment floor and it never proposed again: 61 forwards for 80 tokens, although
    the last 55 equal the draft."""
    draft = list(range(1000, 1080))
    own = list(range(100, 108))
    assert _forwards(draft, draft) == 5
    for n in range(1, 9):
        answer = draft[:20] + own[:n] + draft[20 + n:]
        assert _forwards(answer, draft) <= 8 + n, (n, _forwards(answer, draft))
