"""Exactness on the real model: greedy tokens with a near-miss draft equal those without."""

from __future__ import annotations

import pytest

from services.common.hashing import BlockHasher
from services.kvpool.block_pool import BlockPool
from services.kvpool.engine import Engine, EngineRequest, Finished, model_info
from services.kvpool.sampling import SamplingSpec
from tests.kvpool.conftest import assert_idle, collect

pytestmark = pytest.mark.model


def test_smollm2_greedy_with_a_paraphrase_draft_is_identical(smollm2) -> None:
    model, tok, model_id = smollm2
    eng = Engine(model, model_info(model, model_id),
                 BlockPool(128, 16, BlockHasher(model_id, 16)), max_batch_size=2,
                 max_prefill_chunk=64).start()

    def ask(q: str, draft: list[int]) -> tuple[list[int], Finished]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, return_dict=True)["input_ids"]
        toks, fin = collect(eng.submit(EngineRequest(
            "q", list(ids), SamplingSpec(max_tokens=40), draft_token_ids=tuple(draft)))[1],
            timeout=120)
        assert isinstance(fin, Finished)
        return toks, fin

    try:
        a, _ = ask("What is the capital of France?", [])
        b, plain = ask("Which city is the capital of France?", [])
        draft = list(tok.encode(tok.decode(a, skip_special_tokens=True),
                                add_special_tokens=False))
        b2, fin = ask("Which city is the capital of France?", draft)
        assert b2 == b
        assert fin.draft_tokens_proposed > 0
        assert fin.forward_passes == len(b) - 1 - fin.draft_tokens_accepted
        assert plain.draft_tokens_proposed == 0
        assert_idle(eng)
    finally:
        eng.stop()


def test_smollm2_tree_alternative_that_wins_is_exact(smollm2) -> None:
    """A draft whose proposal after a mismatch is wrong and whose alternative is right (see
    `crafted`): the tree verifies both, the alternative's K/V moves to its position, and the
    greedy tokens stay those without a draft."""
    from tests.assisted.test_draft_tree import crafted

    model, tok, model_id = smollm2
    eng = Engine(model, model_info(model, model_id),
                 BlockPool(128, 16, BlockHasher(model_id, 16)), max_batch_size=2,
                 max_prefill_chunk=64).start()
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}],
                                  add_generation_prompt=True, return_dict=True)["input_ids"]

    def ask(draft: list[int]) -> tuple[list[int], Finished]:
        toks, fin = collect(eng.submit(EngineRequest(
            "t", list(ids), SamplingSpec(max_tokens=40, ignore_eos=True),
            draft_token_ids=tuple(draft)))[1], timeout=120)
        assert isinstance(fin, Finished)
        return toks, fin

    try:
        plain, _ = ask([])
        draft, _ = crafted(plain, range(1000, 1100))
        toks, fin = ask(draft)
        assert toks == plain
        st = eng.stats()
        assert st.draft_tree_forwards_total >= 1 and st.draft_tree_branch_wins_total >= 1
        assert fin.forward_passes == len(plain) - 1 - fin.draft_tokens_accepted
        assert_idle(eng)
    finally:
        eng.stop()


def test_smollm2_batch_trees_in_padding_are_exact(smollm2) -> None:
    """Three rows admitted together: one following a perfect draft of a long answer (long
    proposals), one without a draft, one with the crafted draft; the crafted row's
    alternatives go into its padding, and every row's greedy tokens equal its own without."""
    from benchmarks.inproc import run_together
    from tests.assisted.test_draft_tree import batched_trees, crafted

    model, tok, model_id = smollm2
    eng = Engine(model, model_info(model, model_id),
                 BlockPool(192, 16, BlockHasher(model_id, 16)), max_batch_size=3,
                 max_prefill_chunk=64).start()

    def ids(q: str) -> list[int]:
        return list(tok.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True,
                                            return_dict=True)["input_ids"])

    def request(rid: str, prompt: list[int], n: int, draft: list[int]) -> EngineRequest:
        return EngineRequest(rid, prompt, SamplingSpec(max_tokens=n, ignore_eos=True),
                             draft_token_ids=tuple(draft))

    try:
        long_q, q = ids("Describe how bread is made."), ids("Name three primary colours.")
        _, (long_ref, ref) = run_together(eng, [request("l", long_q, 100, []),
                                                request("p", q, 40, [])])
        made = batched_trees(eng)
        jobs = [(long_q, long_ref.tokens, long_ref.tokens), (q, [], ref.tokens),
                (q, crafted(ref.tokens, range(1000, 1100))[0], ref.tokens)]
        _, res = run_together(eng, [request(f"b{i}", p, len(r), d)
                                    for i, (p, d, r) in enumerate(jobs)])
        assert [s.tokens for s in res] == [r for _, _, r in jobs]
        assert made, "no tree was built in a batch's padding"
        for s, (_, _, r) in zip(res, jobs, strict=True):
            assert s.final.forward_passes == len(r) - 1 - s.final.draft_tokens_accepted
        assert_idle(eng)
    finally:
        eng.stop()
