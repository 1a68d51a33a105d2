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
