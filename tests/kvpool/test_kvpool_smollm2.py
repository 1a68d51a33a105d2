"""Exactness on the real model: the pool's greedy tokens equal plain transformers generate."""

from __future__ import annotations

import pytest

from services.common.hashing import BlockHasher
from services.kvpool.block_pool import BlockPool
from services.kvpool.engine import Engine, Finished, model_info
from tests.kvpool.conftest import assert_idle, collect, request

pytestmark = pytest.mark.model

SYSTEM = ("You are a concise assistant for a travel agency. Answer in one sentence, name the "
          "city and the country, and never invent facts you are unsure about.")


def chat(tok, user: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        add_generation_prompt=True, return_dict=True)["input_ids"]


def test_smollm2_greedy_matches_transformers_cold_cached_and_batched(smollm2) -> None:
    import torch

    model, tok, model_id = smollm2
    eng = Engine(model, model_info(model, model_id),
                 BlockPool(256, 16, BlockHasher(model_id, 16)), max_batch_size=2,
                 max_prefill_chunk=32).start()
    try:
        prompts = [chat(tok, "What is the capital of France?"),
                   chat(tok, "Where is the Eiffel Tower?")]
        refs = []
        for p in prompts:
            ids = torch.tensor([p])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                     do_sample=False)
            refs.append(out[0, len(p):].tolist())
        toks, fin = collect(eng.submit(request(prompts[0], max_tokens=16))[1], timeout=120)
        assert toks == refs[0] and isinstance(fin, Finished) and fin.cached_tokens == 0
        assert "Paris" in tok.decode(toks)
        # Both at once: the shared system prompt comes from the cache, decoding is batched.
        outs = [eng.submit(request(p, max_tokens=16, rid=f"b{i}"))[1]
                for i, p in enumerate(prompts)]
        res = [collect(o, timeout=120) for o in outs]
        assert [r[0] for r in res] == refs
        assert all(r[1].cached_tokens >= 32 for r in res)
        assert_idle(eng)
    finally:
        eng.stop()
