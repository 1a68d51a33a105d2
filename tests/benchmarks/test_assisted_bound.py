"""The assisted benchmark's hindsight bound on forward passes (`hindsight_passes`): known counts
on small hand-made cases, optimal for its relaxation, and never above what the replica's real
drafting logic (`replay`, the engine's `Draft` policy) needs."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.assisted import MAX_DRAFT_TOKENS, hindsight_passes, replay

ANSWER = list(range(100, 140))  # 40 distinct tokens


# -- known counts (the first proposal rides on the prefill forward, which is not counted) ----


def test_without_any_usable_draft_every_token_but_the_first_costs_a_forward():
    assert hindsight_passes(ANSWER, []) == len(ANSWER) - 1
    assert hindsight_passes(ANSWER, [1, 2, 3]) == len(ANSWER) - 1
    # The same count as the replica needs without a draft (replay = the served counts).
    assert replay([1, 2], ANSWER, [1, 2, 3])["passes"] == len(ANSWER) - 1


def test_a_perfect_draft_is_verified_in_chunks_of_the_cap():
    # Each forward accepts MAX_DRAFT_TOKENS (16) and emits one more: 17 tokens per forward.
    assert MAX_DRAFT_TOKENS == 16
    assert hindsight_passes(ANSWER, ANSWER) == 2  # 0 -> 17 -> 34 -> 40: 3 forwards, 1 free
    assert hindsight_passes(ANSWER[:10], ANSWER[:10]) == 0  # all on the prefill forward
    assert hindsight_passes(ANSWER[:17], ANSWER[:17]) == 0  # 16 accepted + the model's own
    assert hindsight_passes(ANSWER[:18], ANSWER[:18]) == 1
    assert hindsight_passes(ANSWER, ANSWER, cap=4) == 7  # 5 tokens a forward: 8 forwards


def test_one_substituted_token_costs_one_forward():
    draft = list(ANSWER[:20])
    draft[5] = 7
    # 5 accepted + the model's token (the substitution), then the rest from draft index 6.
    assert hindsight_passes(ANSWER[:20], draft) == 1


def test_any_draft_position_counts_not_only_aligned_ones():
    # The answer starts two tokens into the draft: the slice from index 2 is taken at once.
    assert hindsight_passes(ANSWER[:12], [7, 8, *ANSWER[:12]]) == 0
    # Two halves in swapped order: 12 accepted + 1, then the other half from draft index 0.
    a, b = ANSWER[:13], ANSWER[13:26]
    assert hindsight_passes(a + b, b + a) == 1


def test_the_context_source_is_the_prompt_and_the_answer_so_far():
    prompt = list(ANSWER[:10])
    # The answer repeats the prompt: nothing in the draft, all of it from the context.
    assert hindsight_passes(ANSWER[:10], [], prompt) == 0
    assert hindsight_passes(ANSWER[:10], []) == 9
    # The answer repeats itself: its first 4 tokens cost 3 forwards (one rides on the
    # prefill), then the repeat of those 4 and the token after it come from the answer so far.
    rep = [1, 2, 3, 4, 1, 2, 3, 4, 5]
    assert hindsight_passes(rep, [], []) == 4
    assert hindsight_passes(rep, []) == 8


def test_an_empty_answer_takes_no_forward():
    assert hindsight_passes([], [1, 2]) == 0


# -- optimal for the relaxation, and a bound on the real drafting policy --------------------


def optimal_passes(answer: list[int], draft: list[int], prompt: list[int] | None,
                   cap: int) -> int:
    """Fewest forwards over every strategy of the relaxation (any slice of any source, any
    length up to the cap), by dynamic programming: the reference for greedy."""
    n = len(answer)

    def best(t: int) -> int:
        srcs = [draft] + ([prompt + answer[:t]] if prompt is not None else [])
        out = 0
        for src in srcs:
            for j in range(len(src)):
                k = 0
                while k < cap and t + k < n and j + k < len(src) and src[j + k] == answer[t + k]:
                    k += 1
                out = max(out, k)
        return out

    @functools.cache
    def f(t: int) -> int:  # forwards to finish from position t
        if t >= n:
            return 0
        return 1 + min(f(t + k + 1) for k in range(best(t) + 1))

    return f(0) - 1


tokens = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@st.composite
def case(draw):
    answer = draw(tokens)
    kind = draw(st.sampled_from(["random", "edited"]))
    if kind == "random":
        draft = draw(st.lists(st.integers(0, 3), max_size=40))
    else:  # the answer with a few tokens replaced, dropped or inserted: a near-miss
        draft = list(answer)
        for _ in range(draw(st.integers(0, 4))):
            op = draw(st.sampled_from(["sub", "del", "ins"]))
            i = draw(st.integers(0, len(draft)))
            if op == "ins":
                draft.insert(i, draw(st.integers(0, 5)))
            elif draft and i < len(draft):
                if op == "sub":
                    draft[i] = draw(st.integers(0, 5))
                else:
                    del draft[i]
    prompt = draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
    return prompt, answer, draft


@settings(max_examples=300, deadline=None)
@given(case(), st.sampled_from([2, 4, MAX_DRAFT_TOKENS]))
def test_greedy_is_optimal_for_the_relaxation(c, cap):
    prompt, answer, draft = c
    assert hindsight_passes(answer, draft, cap=cap) == optimal_passes(answer, draft, None, cap)
    assert (hindsight_passes(answer, draft, prompt, cap=cap)
            == optimal_passes(answer, draft, prompt, cap))


@settings(max_examples=500, deadline=None)
@given(case())
def test_never_above_what_the_replicas_drafting_needs(c):
    prompt, answer, draft = c
    bound_draft = hindsight_passes(answer, draft)
    bound = hindsight_passes(answer, draft, prompt)
    # Draft alone against the replica with prompt lookup off; with the context against the
    # replica as served (draft and prompt lookup).
    assert bound_draft <= replay(prompt, answer, draft, self_lookup=False)["passes"]
    assert bound <= replay(prompt, answer, draft)["passes"]
    # Trees too: the path a tree accepts lies in one of its branches, a slice of a source.
    assert bound_draft <= replay(prompt, answer, draft, self_lookup=False,
                                 branches=4)["passes"]
    assert bound <= replay(prompt, answer, draft, branches=4)["passes"]
    # A second source can only help.
    assert bound <= bound_draft
    # And no bound is above decoding without a draft.
    assert bound_draft <= len(answer) - 1


# -- replayed costs by draft ladder -------------------------------------------------------------


def test_replayed_cost_counts_each_decode_forward_at_its_length():
    # A perfect 40-token draft with the top rung: forwards of 17 tokens after the prefill one.
    flat = [1.0] * (MAX_DRAFT_TOKENS + 1)
    r = replay([1, 2], ANSWER, ANSWER, ladder=(16, 16, 16), costs=flat)
    assert r["cost"] == r["passes"] == 2
    dear = [1.0] + [3.0] * MAX_DRAFT_TOKENS  # any proposal triples a forward's cost
    assert replay([1, 2], ANSWER, ANSWER, ladder=(16, 16, 16), costs=dear)["cost"] == 6.0
    # No draft to verify: every decode forward is a 1-token one.
    assert replay([1, 2], ANSWER, [], costs=dear)["cost"] == len(ANSWER) - 1


def test_ladder_replays_rank_the_ladders_by_what_their_forwards_cost():
    from benchmarks.assisted import ladder_replays

    draft = list(ANSWER)
    draft[19] = draft[39] = 7  # two substituted tokens
    runs = [([1, 2], ANSWER, draft)]
    flat = [1.0] * (MAX_DRAFT_TOKENS + 1)
    out = ladder_replays(runs, flat, (1, 2, 16))
    # Forwards cost alike: the longest proposals throughout are best. Rungs by match length
    # fall short of them; lengths by cost (the replica's) are them.
    assert out["16,16,16"]["speedup"] > out["replica_rungs"]["speedup"]
    assert out["best"]["speedup"] == out["16,16,16"]["speedup"] == out["replica"]["speedup"]
    assert out["replica"]["ladder"] == out["replica_rungs"]["ladder"] == [1, 2, 16]
    # Given flat costs, the flat-costs replay is the replica's own (no trees by default).
    assert out["flat_costs"]["ladder"] == [16, 16, 16]
    assert (out["flat_costs"]["speedup"] == out["flat_costs"]["without_tree"]["speedup"]
            == out["replica"]["speedup"])
    # A draft agreeing two tokens at a time, and any proposal past 2 tokens costs 5 forwards:
    # the best ladder proposes 2 after a miss, and proposing 16 throughout loses time.
    every_third = [7 if i % 3 == 2 else t for i, t in enumerate(ANSWER)]
    short = [1.0, 1.0, 1.0] + [5.0] * (MAX_DRAFT_TOKENS - 2)
    out = ladder_replays([([1, 2], ANSWER, every_third)], short, (1, 2, 16))
    assert out["best"]["ladder"][0] == 2 and out["best"]["speedup"] > 2.0
    assert out["16,16,16"]["speedup"] < 1.0 < out["replica_rungs"]["speedup"]
    # By cost: 2 tokens (as cheap as one) while they verify two at a time, never 16.
    assert out["replica"]["speedup"] >= out["best"]["speedup"]


def test_replayed_trees_verify_the_alternative_the_proposal_missed():
    # The answer 100..139; after a mismatch at 105 the draft has 105 twice: followed by junk
    # (nearer where the draft was last followed, so proposed) and by the answer's rest.
    answer = list(range(100, 140))
    draft = answer[:5] + [7, 105, 1, 2, 3, 8] + answer[5:]
    alone = replay([1, 2], answer, draft)
    tree = replay([1, 2], answer, draft, branches=4)
    assert alone["trees"] == 0 and tree["trees"] >= 1
    assert tree["passes"] < alone["passes"]
    # Every node of a tree counts as proposed; a tree accepts what its best branch verifies.
    assert tree["proposed"] > tree["accepted"] >= alone["accepted"]


def test_hindsight_ranking_re_aligns_where_the_answer_goes_on():
    # The draft of the tree test: after the mismatch at 105, the replica's ranking proposes
    # the junk after the nearer 105; knowing the answer, the re-alignment takes the other.
    answer = list(range(100, 140))
    draft = answer[:5] + [7, 105, 1, 2, 3, 8] + answer[5:]
    alone = replay([1, 2], answer, draft)
    known = replay([1, 2], answer, draft, hindsight_ranking=True)
    assert known["passes"] < alone["passes"]
    assert known["accepted"] > alone["accepted"]
    # It only re-ranks: never under the hindsight bound, and a draft that agrees nowhere
    # gives it nothing to re-align to (prompt lookup off: every token costs a forward).
    assert known["passes"] >= hindsight_passes(answer, draft, [1, 2])
    none = replay([1, 2], answer, [7, 105, 9], self_lookup=False, hindsight_ranking=True)
    plain = replay([1, 2], answer, [7, 105, 9], self_lookup=False)
    assert none["passes"] == plain["passes"] == len(answer) - 1 and none["accepted"] == 0
    assert none["proposed"] < plain["proposed"]  # not the 9 after 105, which disagrees


def test_ladder_replays_report_the_hindsight_ranking():
    from benchmarks.assisted import ladder_replays

    answer = list(range(100, 140))
    draft = answer[:5] + [7, 105, 1, 2, 3, 8] + answer[5:]
    flat = [1.0] * (MAX_DRAFT_TOKENS + 1)
    out = ladder_replays([([1, 2], answer, draft)], flat, (1, 2, 16))
    known = out["hindsight_ranking"]
    assert known["speedup"] > out["replica_no_tree"]["speedup"]
    assert known["flat_costs"]["forward_passes_per_token"] \
        < out["flat_costs"]["without_tree"]["forward_passes_per_token"]
