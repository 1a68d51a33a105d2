"""Rules of the kvpool's attention (services/kvpool/attention.py) that the mutation audit
found unguarded: only CPU forwards take the grouped call, and only without the options the
grouped call does not apply; every other case keeps transformers' stock SDPA function."""

from __future__ import annotations

import types

import pytest
import torch

from services.kvpool import attention


def test_a_forward_off_the_cpu_keeps_the_stock_sdpa(monkeypatch):
    """A masked multi-token forward of a grouped-query model on another device (meta here,
    CUDA in service) goes to transformers' sdpa_attention_forward, as on CUDA masked GQA
    would otherwise fall back to the math kernel."""
    from transformers.integrations import sdpa_attention

    calls: list[str] = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                        lambda module, q, *a, **k: (calls.append(q.device.type), None))
    module = types.SimpleNamespace(num_key_value_groups=2)
    q = torch.empty(1, 4, 3, 8, device="meta")
    kv = torch.empty(1, 2, 5, 8, device="meta")
    mask = torch.empty(1, 1, 3, 5, dtype=torch.bool, device="meta")
    attention._sdpa(module, q, kv, kv, mask)
    assert calls == ["meta"]
    # On the CPU the same call is the grouped one (the stock function is not called).
    out, _ = attention._sdpa(module, torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 5, 8),
                             torch.zeros(1, 2, 5, 8), torch.ones(1, 1, 3, 5, dtype=torch.bool))
    assert calls == ["meta"] and out.shape == (1, 3, 4, 8)


@pytest.mark.parametrize("option", [{"softcap": 30.0}, {"position_bias": torch.zeros(1)},
                                    {"output_attentions": True}])
def test_a_forward_with_an_option_the_grouped_call_lacks_keeps_the_stock_sdpa(monkeypatch,
                                                                             option):
    """A soft cap, a position bias or attention weights asked for: the grouped call has none
    of them, so such a forward stays on the stock function, on the CPU too."""
    from transformers.integrations import sdpa_attention

    calls: list[dict] = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                        lambda module, q, *a, **k: (calls.append(k), None))
    module = types.SimpleNamespace(num_key_value_groups=2)
    attention._sdpa(module, torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 5, 8),
                    torch.zeros(1, 2, 5, 8), torch.ones(1, 1, 3, 5, dtype=torch.bool), **option)
    assert len(calls) == 1 and option.keys() <= calls[0].keys()
