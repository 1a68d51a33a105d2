"""Tree verification: a sequence checks its proposal and alternative continuations of the
draft in one forward (drafting.Tree, Draft.alternatives, the engine's tree forwards), decoding
alone or in a batch's padding. Pure logic first, then the engine over the tiny random Llama."""

from __future__ import annotations

import pytest
import torch

import services.kvpool.drafting as drafting
from benchmarks.inproc import run_together
from services.kvpool.drafting import Branch, Draft, Source, Tree
from services.kvpool.engine import EngineRequest, Finished
from services.kvpool.paged_cache import ForwardPlan, KvStore, PagedCache
from services.kvpool.sampling import NonFiniteLogits, Sampler, SamplingSpec
from tests.assisted.test_assisted_engine import N_NEW, checking_integrity, prompt, run
from tests.kvpool.conftest import TINY_VOCAB, assert_idle, reference_greedy


def br(tokens: list[int], start: int = 0) -> Branch:
    return Branch(tokens, Source.DRAFT, start)


def follow(tree: Tree, answer: list[int]):
    """`walk` as greedy verification against a known answer."""
    def nxt(i: int) -> int | None:
        d = 0 if i < 0 else tree.depths[i]
        return answer[d] if d < len(answer) else None
    return tree.walk(nxt)


# ---- Tree -------------------------------------------------------------------------------

def test_tree_shares_common_prefixes_and_keeps_the_first_branch_in_order() -> None:
    t = Tree.of([br([1, 2, 3]), br([1, 5]), br([7]), br([1, 2])])
    assert t.tokens == (1, 2, 3, 5, 7)
    assert t.parents == (-1, 0, 1, 0, -1)
    assert t.depths == (1, 2, 3, 2, 1)
    assert t.ends == (2, 3, 4, 1)
    assert t.size == 5
    vis = t.visible()
    # Position 0 is the root (the sequence's last token); node i is position i + 1.
    assert vis[0] == [True, False, False, False, False, False]
    assert vis[3] == [True, True, True, True, False, False]  # node 2: 1 -> 2 -> 3
    assert vis[4] == [True, True, False, False, True, False]  # node 3: 1 -> 5
    assert vis[5] == [True, False, False, False, False, True]  # node 4: 7


def test_walk_follows_the_models_tokens_to_the_deepest_agreeing_node() -> None:
    t = Tree.of([br([1, 2, 3]), br([1, 5, 6]), br([7])])
    path, tok = follow(t, [1, 5, 6, 9])
    assert path == [0, 3, 4] and tok == 9
    assert t.branch_of(path) == 1 and t.along_first(path) == 1
    path, tok = follow(t, [1, 2, 8])
    assert path == [0, 1] and tok == 8
    assert t.branch_of(path) == 0 and t.along_first(path) == 2
    path, tok = follow(t, [4])  # no branch starts with the model's token
    assert path == [] and tok == 4 and t.branch_of(path) == 0
    path, tok = follow(t, [7, 7])
    assert path == [5] and tok == 7 and t.branch_of(path) == 2
    with pytest.raises(ValueError):
        Tree.of([br([1])]).branch_of([3])


def test_a_tree_plan_places_each_node_at_its_depth_and_shows_it_its_ancestors() -> None:
    t = Tree.of([br([1, 2]), br([3])])
    store = KvStore(num_layers=1, kv_heads=1, head_dim=2, num_blocks=2, block_size=4,
                    max_rows=2, max_context=32, dtype=torch.float32, device="cpu")
    cache = PagedCache(store)
    cache.begin(ForwardPlan(0, [5], t.size + 1, depths=[(0, *t.depths)],
                            visible=[t.visible()]))
    assert cache.position_ids().tolist() == [[5, 6, 7, 6]]
    mask = cache.attention_mask()
    assert mask.shape == (1, 1, 4, 9)
    assert mask[0, 0, :, :5].all()  # the cached positions: seen by every node
    assert mask[0, 0, :, 5:].tolist() == [[True, False, False, False],
                                          [True, True, False, False],
                                          [True, True, True, False],
                                          [True, False, False, True]]
    # The accepted path's K/V moves to the slots of its positions.
    store.rows[0, 0, 0, 0, 8] = 7.0
    store.move_slots(0, [8], [6])
    assert store.rows[0, 0, 0, 0, 6].tolist() == [7.0, 7.0]


def test_a_batch_plan_lays_out_a_tree_row_beside_a_plain_one() -> None:
    from services.kvpool.engine import _row_layout

    t = Tree.of([br([1, 2]), br([3])])  # 3 nodes: a row of 4 with its root; padded to 6
    store = KvStore(num_layers=1, kv_heads=1, head_dim=2, num_blocks=2, block_size=4,
                    max_rows=2, max_context=32, dtype=torch.float32, device="cpu")
    cache = PagedCache(store)
    layouts = [_row_layout(t, 6), _row_layout(None, 6)]
    cache.begin(ForwardPlan(0, [5, 2], 6, depths=[d for d, _ in layouts],
                            visible=[v for _, v in layouts]))
    # The tree's nodes at their depths, its fillers after; the plain row in order.
    assert cache.position_ids().tolist() == [[5, 6, 7, 6, 9, 10], [2, 3, 4, 5, 6, 7]]
    rows, slots = cache.index_tensors()  # K/V goes to the rows' next slots, not positions
    assert rows.tolist() == [[0] * 6, [1] * 6]
    assert slots.tolist() == [[5, 6, 7, 8, 9, 10], [2, 3, 4, 5, 6, 7]]
    mask = cache.attention_mask()
    assert mask.shape == (2, 1, 6, 11)
    assert mask[0, 0, :, :5].all() and mask[1, 0, :, :2].all()  # each row's cached keys
    assert mask[0, 0, :, 5:].tolist() == [[True, False, False, False, False, False],
                                          [True, True, False, False, False, False],
                                          [True, True, True, False, False, False],
                                          [True, False, False, True, False, False],
                                          [False, False, False, False, True, False],
                                          [False, False, False, False, False, True]]
    causal = [[j <= i for j in range(6)] for i in range(6)]
    assert mask[1, 0, :, 2:8].tolist() == causal
    assert not mask[1, 0, :, 8:].any()  # past the plain row's last new token


def test_verify_tree_walks_the_argmax_and_fails_only_on_rows_it_uses() -> None:
    t = Tree.of([br([1, 2]), br([3, 4])])  # nodes: 0:1 1:2 2:3 3:4
    logits = torch.zeros(t.size + 1, 8)
    logits[0, 3] = logits[3, 4] = logits[4, 6] = 5.0  # root -> 3 -> 4 -> then 6
    logits[1, 0] = logits[2, 0] = 5.0
    greedy = Sampler(SamplingSpec(max_tokens=4))
    assert greedy.verify_tree(logits, t) == ([2, 3], 6)
    logits[1, 5] = float("nan")  # node 0's row: not on the path
    assert greedy.verify_tree(logits, t) == ([2, 3], 6)
    logits[3, 5] = float("nan")  # node 2's row: on it
    with pytest.raises(NonFiniteLogits):
        greedy.verify_tree(logits, t)


# ---- Draft.alternatives ------------------------------------------------------------------

# After the context's last token 9 the draft goes on three ways: at 2 (-> 20), at 6 (-> 30)
# and at 10 (-> 40 41 42).
DRAFT = [5, 9, 20, 21, 22, 9, 30, 31, 32, 9, 40, 41, 42, 43]


def proposing(draft: list[int], context: list[int], **kw) -> Draft:
    d = Draft.of(draft, self_lookup=False, **kw)
    d.fresh = False
    assert d.propose(context, 16)
    return d


def test_alternatives_are_the_other_matches_each_once() -> None:
    d = proposing(DRAFT, [1, 2, 9], branches=4)
    assert d.pending.source is Source.DRAFT and d.matched == 1
    alts = d.alternatives([1, 2, 9], 16)
    starts = {a.start for a in alts}
    assert d.start not in starts and starts | {d.start} == {2, 6, 10}
    g = d.ladder[0]  # without costs: the lowest rung
    assert all(a.tokens == DRAFT[a.start:a.start + g] for a in alts)
    assert len(Draft.of(DRAFT, branches=2).ladder) == 3
    d2 = proposing(DRAFT, [1, 2, 9], branches=2)
    assert len(d2.alternatives([1, 2, 9], 16)) == 1
    d1 = proposing(DRAFT, [1, 2, 9], branches=1)
    assert d1.alternatives([1, 2, 9], 16) == []


def test_no_alternatives_for_a_proposal_matched_on_a_long_run() -> None:
    context = [5, 9, 20, 21, 22, 9]  # matches the draft's first six tokens
    d = proposing(DRAFT, context, branches=4)
    assert d.matched > drafting.ALT_MATCH_MAX
    assert d.alternatives(context, 16) == []


def test_alternatives_already_in_the_tree_are_left_out() -> None:
    draft = [9, 1, 2, 9, 1, 2, 3, 9, 4]
    d = proposing(draft, [7, 9], branches=4)
    alts = d.alternatives([7, 9], 16)
    trees = [d.pending.tokens] + [a.tokens for a in alts]
    for i, a in enumerate(trees):
        for j, b in enumerate(trees):
            assert i == j or b[:len(a)] != a, (a, b)


def test_alternatives_only_where_their_expected_tokens_pay_for_the_forward() -> None:
    top = 8
    flat = tuple([1.0] * (top + 2))
    d = proposing(DRAFT, [1, 2, 9], branches=4, costs=flat, top=top)
    assert len(d.alternatives([1, 2, 9], top)) == 2  # cost nothing more: all of them
    steep = tuple(1.0 + q for q in range(top + 2))  # every token costs a whole forward
    d = proposing(DRAFT, [1, 2, 9], branches=4, costs=steep, top=top)
    assert d.alternatives([1, 2, 9], top) == []
    # An alternative that keeps adding tokens earns its place at a moderate cost.
    mild = tuple(1.0 + 0.1 * q for q in range(top + 2))
    d = proposing(DRAFT, [1, 2, 9], branches=4, costs=mild, top=top)
    d.alt_yield = (0.0, 10.0)
    assert d.alternatives([1, 2, 9], top) == []
    d.alt_yield = (10.0, 10.0)
    assert d.alternatives([1, 2, 9], top)


def test_alternatives_in_a_padded_row_fill_its_room_whatever_they_cost() -> None:
    top = 8
    steep = tuple(1.0 + q for q in range(top + 2))  # alone, no alternative would pay
    d = proposing(DRAFT, [1, 2, 9], branches=4, costs=steep, top=top)
    n = len(d.pending.tokens)
    assert d.alternatives([1, 2, 9], top) == []
    both = d.alternatives([1, 2, 9], top, room=16)
    assert len(both) == 2
    added = Tree.of([d.branch(), *both]).size - n
    one = d.alternatives([1, 2, 9], top, room=added - 1)  # the best ranked one fits
    assert one == both[:1] and Tree.of([d.branch(), *one]).size - n <= added - 1
    assert d.alternatives([1, 2, 9], top, room=0) == []


def after_a_replaced_token(draft: list[int], emitted: list[int], rate: float = 1.0) -> Draft:
    """A draft whose first proposal (its start) verified all of `emitted` but the last token,
    which the model put in place of the next draft token; its next proposal is pending."""
    d = Draft.of(draft, self_lookup=False, branches=4)
    assert d.propose([7], 16) == draft[:16]
    d.update(len(emitted) - 1, emitted)
    assert d.replaced == len(emitted) - 1
    d.rate = rate
    assert d.propose([7, *emitted], 16)
    return d


def test_after_a_replaced_token_the_tree_guesses_an_insertion_and_a_substitution() -> None:
    # The model said 50 where the draft has 3. 50 is nowhere in the draft: the proposal is
    # the substitution guess (the draft goes on after 3); the tree adds the insertion (at 3).
    draft = [1, 2, 3, 4, 5, 6, 7, 8]
    d = after_a_replaced_token(draft, [1, 2, 50])
    assert d.start == 3 and d.matched == 0
    g = d.ladder[0]
    assert d.alternatives([7, 1, 2, 50], 16) == [Branch(draft[2:2 + g], Source.DRAFT, 2)]
    # Here the model's 9 re-aligns the draft (after "2 9" at 4..5): both guesses join the
    # tree after the matches, in that order.
    draft = [1, 2, 3, 4, 2, 9, 5, 6]
    d = after_a_replaced_token(draft, [1, 2, 9])
    assert d.start == 6 and d.matched == 2
    alts = d.alternatives([7, 1, 2, 9], 16)
    assert [(a.start, a.tokens) for a in alts] == [(2, draft[2:2 + g]), (3, draft[3:3 + g])]
    # Guesses are thin evidence: a draft that keeps failing verifies none.
    d = after_a_replaced_token(draft, [1, 2, 9], rate=0.0)
    assert d.start == 6 and d.alternatives([7, 1, 2, 9], 16) == []
    # Nothing was replaced: no guesses.
    d = proposing(draft, [7, 2, 9], branches=4)
    assert d.replaced is None and d.alternatives([7, 2, 9], 16) == []


def test_credit_and_take_steer_what_the_draft_learns() -> None:
    d = proposing(DRAFT, [1, 2, 9], branches=4)
    alts = d.alternatives([1, 2, 9], 16)
    before = d.alt_yield
    d.credit(len(alts), 2)
    assert d.alt_yield == (drafting.DECAY * before[0] + 2, drafting.DECAY * before[1] + len(alts))
    won = next(a for a in alts if a.start == 10)
    d.take(won)
    d.record(1, proposed=3)
    d.advance([40, 41])
    assert d.hint == 12 and d.proposed == 3 and d.accepted == 1
    # `follow` does both for a verified tree: the branch holding the path is taken.
    d = proposing(DRAFT, [1, 2, 9], branches=4)
    alts = d.alternatives([1, 2, 9], 16)
    tree = Tree.of([d.branch(), *alts])
    k = next(i for i, b in enumerate(tree.branches) if b.start == 10)
    path, _ = follow(tree, [40, 41])
    before = d.alt_yield
    assert d.follow(tree, path) == k and d.start == 10
    assert d.alt_yield == (drafting.DECAY * before[0] + len(path),
                           drafting.DECAY * before[1] + len(alts))


# ---- the engine ---------------------------------------------------------------------------

def crafted(ref: list[int], vocab: range = range(1, TINY_VOCAB - 1)) -> tuple[list[int], int]:
    """A draft for `ref` whose proposal right after the first mismatch is wrong and whose
    alternative is right: ref[:k], junk, ref[k] followed by junk (nearer, so ranked first),
    junk, then ref[k] followed by the rest of ref. Junk: tokens of `vocab` not in `ref`."""
    junk = [t for t in vocab if t not in ref]
    for k in range(3, 12):
        if ref[k] not in ref[:k] and ref[k] not in ref[k + 1:]:
            z, j1, j2, j3, q = junk[:5]
            return ref[:k] + [z, ref[k], j1, j2, j3, q] + ref[k:], k
    raise AssertionError("no position to build the draft around")


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_an_alternative_that_wins_keeps_greedy_output_exact(make_engine, tiny_model,
                                                            seed) -> None:
    """The alternative's node sits past the proposal's in the row; after it verifies, its K/V
    must be moved to its position's slot, or every later token would read a wrong key."""
    eng = make_engine(num_blocks=64, block_size=4)
    p = prompt(13, seed)
    ref = reference_greedy(tiny_model, p, N_NEW)
    draft, _ = crafted(ref)
    with checking_integrity(eng) as checks:
        toks, fin = run(eng, p, draft)
    assert not checks, checks
    assert toks == ref
    st = eng.stats()
    assert st.draft_tree_forwards_total >= 1 and st.draft_tree_branch_wins_total >= 1
    assert fin.forward_passes == N_NEW - 1 - fin.draft_tokens_accepted
    assert fin.draft_tokens_accepted >= N_NEW - 10
    assert_idle(eng)


def test_without_branches_no_tree_and_the_same_tokens(make_engine, tiny_model) -> None:
    eng = make_engine(num_blocks=64, block_size=4, draft_branches=1)
    p = prompt(13, 4)
    ref = reference_greedy(tiny_model, p, N_NEW)
    toks, fin = run(eng, p, crafted(ref)[0])
    assert toks == ref
    assert eng.stats().draft_tree_forwards_total == 0
    with_tree = make_engine(num_blocks=64, block_size=4)
    toks2, fin2 = run(with_tree, p, crafted(ref)[0])
    assert toks2 == ref
    # The tree verified the right continuation in the forward that proposed the wrong one.
    assert fin2.forward_passes < fin.forward_passes


def test_a_seeded_sampled_answer_is_the_same_with_a_tree(make_engine, tiny_model) -> None:
    """Sampling walks the tree by one draw per emitted token at each node's own context: the
    seeded answer equals the one without any draft, whichever branch the draws follow."""
    eng = make_engine(num_blocks=96, block_size=4)
    p = prompt(13, 5)
    ref = reference_greedy(tiny_model, p, N_NEW)
    draft = crafted(ref)[0]
    for temperature, seed in ((0.05, 3), (0.05, 4), (0.8, 5)):
        plain, _ = run(eng, p, [], temperature=temperature, seed=seed)
        trees = eng.stats().draft_tree_forwards_total
        toks, fin = run(eng, p, draft, temperature=temperature, seed=seed)
        assert toks == plain, (temperature, seed)
        assert fin.forward_passes == N_NEW - 1 - fin.draft_tokens_accepted
        if temperature < 0.1:  # near-greedy: the crafted mismatch happens, and a tree after it
            assert eng.stats().draft_tree_forwards_total > trees
    st = eng.stats()
    # A win is a tree forward whose path left the proposal's branch: not every one here.
    assert 1 <= st.draft_tree_branch_wins_total < st.draft_tree_forwards_total
    assert_idle(eng)


def batched_trees(eng) -> list[Tree]:
    """The trees the engine builds in batches' padded rows (recorded as they are built)."""
    made: list[Tree] = []
    build = eng._tree

    def spy(seq, prop, room=None):
        tree = build(seq, prop, room)
        if tree is not None and room is not None:
            made.append(tree)
        return tree

    eng._tree = spy
    return made


def batch_of_three(tiny_model, seed: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, draft, greedy answer) of three rows, admitted in this order: one following a
    perfect draft of a long answer (proposals of 16 tokens while the others decode), one
    without a draft, and one with the crafted draft (its proposal after the mismatch is one
    token, padded to the longest: room for its alternatives)."""
    p, other = prompt(13, seed), prompt(11, seed + 10)
    ref, long_ref = reference_greedy(tiny_model, p, N_NEW), reference_greedy(tiny_model, other,
                                                                              3 * N_NEW)
    return [(other, long_ref, long_ref), (p, [], ref), (p, crafted(ref)[0], ref)]


def run_batch(eng, jobs, **sampling) -> list[tuple[list[int], Finished]]:
    """The jobs' (prompt, draft, answer) requests admitted together (the engine held meanwhile,
    so the schedule is the same every run), each as long as its answer."""
    _, streamed = run_together(eng, [
        EngineRequest(f"b{i}", p, SamplingSpec(len(ref), ignore_eos=True, **sampling),
                      draft_token_ids=tuple(d)) for i, (p, d, ref) in enumerate(jobs)])
    return [(s.tokens, s.final) for s in streamed]


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_trees_in_a_batchs_padding_keep_every_row_exact(make_engine, tiny_model,
                                                          seed) -> None:
    """Rows of a batch are padded to the longest proposal; a row right after its mismatch
    proposes little and verifies its alternatives in the padding. Every row's tokens equal
    its reference, and the alternative saves the crafted row forwards."""
    jobs = batch_of_three(tiny_model, seed)
    eng = make_engine(num_blocks=128, block_size=4, max_batch_size=3)
    made = batched_trees(eng)
    with checking_integrity(eng) as checks:
        res = run_batch(eng, jobs)
    assert not checks, checks
    assert [toks for toks, _ in res] == [ref for _, _, ref in jobs]
    assert made, "no tree was built in a batch's padding"
    assert eng.stats().draft_tree_branch_wins_total >= 1
    for (_, fin), (_, _, ref) in zip(res, jobs, strict=True):
        assert fin.forward_passes == len(ref) - 1 - fin.draft_tokens_accepted
    assert_idle(eng)
    alone = make_engine(num_blocks=128, block_size=4, max_batch_size=3, draft_branches=1)
    res1 = run_batch(alone, jobs)
    assert [toks for toks, _ in res1] == [ref for _, _, ref in jobs]
    assert res[2][1].forward_passes < res1[2][1].forward_passes


def test_a_seeded_sampled_batch_is_the_same_with_trees(make_engine, tiny_model) -> None:
    jobs = batch_of_three(tiny_model, 5)
    eng = make_engine(num_blocks=128, block_size=4, max_batch_size=3)
    made = batched_trees(eng)
    # The tiny model's logits are flat: even near-greedy draws leave its argmax, so these
    # seeds are ones whose draws meet the crafted mismatch (a batch tree follows it).
    for temperature, seed in ((0.01, 5), (0.05, 4), (0.8, 4)):
        plain = run_batch(eng, [(p, [], ref) for p, _, ref in jobs], temperature=temperature,
                          seed=seed)
        before = len(made)
        drafted = run_batch(eng, jobs, temperature=temperature, seed=seed)
        assert [t for t, _ in drafted] == [t for t, _ in plain], (temperature, seed)
        if temperature < 0.1:
            assert len(made) > before, (temperature, seed)
    assert_idle(eng)


def test_alternatives_are_the_cheapest_frontier_length() -> None:
    top = 8
    mild = tuple(1.0 + 0.1 * q for q in range(top + 2))  # every length on the frontier
    d = proposing(DRAFT, [1, 2, 9], branches=4, costs=mild, top=top)
    assert d.lengths[0] == 1 and d.lengths[-1] == top
    d.alt_yield = (10.0, 10.0)
    alts = d.alternatives([1, 2, 9], top)
    assert alts and all(a.tokens == DRAFT[a.start:a.start + 1] for a in alts)


def test_a_path_along_the_proposal_credits_the_alternatives_nothing() -> None:
    d = proposing(DRAFT, [1, 2, 9], branches=4)
    alts = d.alternatives([1, 2, 9], 16)
    tree = Tree.of([d.branch(), *alts])
    before = d.alt_yield
    path, _ = tree.walk(lambda i: DRAFT[d.start + (0 if i < 0 else tree.depths[i])]
                        if (0 if i < 0 else tree.depths[i]) < len(d.pending.tokens) else None)
    assert path == list(range(len(d.pending.tokens)))  # the proposal verified in full
    assert d.follow(tree, path) == 0
    assert d.alt_yield == (drafting.DECAY * before[0], drafting.DECAY * before[1] + len(alts))


def test_alternatives_never_restart_at_the_proposals_own_position() -> None:
    """A batch cut the proposal to one token; its alternatives are the *other* positions (2
    of them with branches=4), not the proposal's own continuation."""
    top = 8
    flat = tuple([1.0] * (top + 2))
    d = proposing(DRAFT, [1, 2, 9], branches=4, costs=flat, top=top)
    assert d.start == 2 and len(d.pending.tokens) == top
    d.trim(1)
    alts = d.alternatives([1, 2, 9], top, room=16)
    assert sorted(a.start for a in alts) == [6, 10]


def test_a_branch_that_goes_on_from_the_proposal_is_credited_with_its_own_nodes() -> None:
    """A batch cut the proposal to one token ([1]); an alternative ([1, 2], at 4) goes on from
    it, so its second node (1) comes right after the proposal's only one (0). The path 0, 1
    holds one node of the proposal: the alternative added the other. (`along_first` counted
    both as the first branch's, and the tree credited its alternatives with nothing.)"""
    draft = [9, 1, 5, 9, 1, 2, 3]
    d = proposing(draft, [7, 9], ladder=(2, 3, 4), branches=2)
    assert d.start == 1 and d.pending.tokens == [1, 5]
    d.trim(1)
    alts = d.alternatives([7, 9], 4, room=4)
    assert alts == [br([1, 2], 4)]
    tree = Tree.of([d.branch(), *alts])
    assert tree.parents == (-1, 0)
    path, tok = follow(tree, [1, 2, 3])
    assert path == [0, 1] and tok == 3
    assert tree.along_first(path) == 1 and tree.along_first([0]) == 1
    before = d.alt_yield
    assert d.follow(tree, path) == 1 and d.start == 4
    assert d.alt_yield == (drafting.DECAY * before[0] + 1, drafting.DECAY * before[1] + 1)
