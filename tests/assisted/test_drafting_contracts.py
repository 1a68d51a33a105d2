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
