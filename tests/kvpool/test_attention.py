"""The kvpool's attention: SDPA with grouped-query heads kept grouped in multi-token forwards
on CPU (no copy of every cached key and value per group), and the same logits as the stock
SDPA path (pure model code on the tiny test model: 4 query heads over 2 KV heads)."""

from __future__ import annotations

import pytest
import torch

from services.kvpool import attention
from tests.kvpool.conftest import TINY_VOCAB, make_tiny_model


def _forward(model, cached: int, q: int, batch: int = 2):
    """Logits of `q` new tokens per row after `cached` ones, with an explicit 4-D bool mask
    (as the engine passes one), over a fresh cache."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY_VOCAB, (batch, cached + q), generator=g)
    with torch.no_grad():
        cache = model(ids[:, :cached], use_cache=True).past_key_values
        pos = torch.arange(cached, cached + q)[None].expand(batch, -1)
        mask = (torch.arange(cached + q)[None, None, :] <= pos[:, :, None])[:, None]
        return model(ids[:, cached:], cache=cache, position_ids=pos,
                     attention_mask=mask, use_cache=True).logits


@pytest.mark.parametrize("q", [1, 2, 8, 17])
def test_the_grouped_path_gives_the_stock_logits_without_copying_kv(monkeypatch, q):
    model = make_tiny_model(seed=3)
    stock = _forward(model, 40, q)
    model.set_attn_implementation(attention.register())
    copies: list[int] = []
    from transformers.integrations import sdpa_attention

    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv",
                        lambda *a, **k: copies.append(1) or real(*a, **k))
    grouped = _forward(model, 40, q)
    assert torch.equal(stock, grouped)
    assert copies == []  # a prefill over a cached prefix or a draft: no repeat_kv


def test_the_engine_runs_an_sdpa_model_with_the_grouped_attention(make_engine):
    eng = make_engine()
    assert eng.model.config._attn_implementation == attention.NAME
