"""A differential review of the kvpool's attention (services/kvpool/attention.py) against a
brute-force model written from its docstring, transformers' SDPA contract and first
principles: `_sdpa(module, q [B, Hq, T, D], k/v [B, Hkv, S, D], mask, ...)` returns
(out [B, T, Hq, D] contiguous, in q's dtype, None) where query head h reads key/value head
h // (Hq / Hkv) (transformers' `repeat_kv` order), each query's weights are the float64
softmax of q.k * scale (scale = 1/sqrt(D) unless given) over the keys its mask lets it see (a
bool mask: True = seen; a float mask is added to the scores; no mask: causal from the top-left
for T > 1, as the stock function does), plus a position bias where one is given. The grouped
call is taken exactly on the CPU, with a mask, for T > 1, with num_key_value_groups > 1 and no
position bias, soft cap or attention weights asked for; every other call goes to
transformers' `sdpa_attention_forward` unchanged (its soft-cap refusal included).

Seeded random cases: batch 1-3, 1-3 KV heads, groups 1-4 (1 keeps the stock path), 1-24 new
tokens over 0-60 cached ones, sometimes slots past every row's end (unused pool rows), head dim
4-64, float32 / bfloat16 / float16, masks as the engine builds them (ragged causal rows,
draft trees whose queries see their cached prefix and some of the new tokens), random masks,
float additive masks, a batch-1 mask broadcast over the batch, no mask; a scale or none; the
options that keep the stock path. Checked against the model (float32 within 2e-5 of it,
bfloat16 2e-2, float16 4e-3, relative to the values' size), and exactly: the grouped output is
bit-for-bit the stock function's (what the kvpool's greedy exactness rests on; also with
dropout under one seed), keys and values a row's mask hides from all its queries (unused
slots, stale blocks) change no bit of the output, a row's output is the same bits alone or in
a batch, `repeat_kv` is never called on the grouped path, and `register` installs `_sdpa` and
SDPA's mask builder under `NAME`.

Run offline: 3,000 seeds (ATTENTION_DIFFERENTIAL_SEEDS=3000), clean; 300 by default (~1.5 s
of the file's ~4.5 s on a busy host). Found: nothing to fix. Left as is: a query row that
sees no key gives zeros (torch's CPU SDPA, on both paths; the engine's queries always see
themselves), and a NaN in a hidden key or value would poison its row (0 x NaN; the paged
cache allocates zeros for that reason), so the hidden-key check uses finite values.
Injected bugs caught 13 of 13 (one at a time): enable_gqa dropped, the scale dropped, the mask
dropped, the mask inverted, the output not transposed, `.contiguous()` dropped, decode steps
(T = 1) taken on the grouped path, groups of 1 taken on it, the CPU check dropped (meta
taken on it), a position bias ignored there, a soft cap taken there, dropout dropped, the mask
builder registered as eager's.

More seeds: ATTENTION_DIFFERENTIAL_SEEDS=3000 pytest tests/kvpool/test_attention_differential.py
"""

from __future__ import annotations

import math
import os
import random
import types

import pytest
import torch

from services.kvpool import attention

SEEDS = int(os.environ.get("ATTENTION_DIFFERENTIAL_SEEDS", "300"))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


# ---- the model ---------------------------------------------------------------------------------

def model_attention(q, k, v, mask, scale, is_causal, bias) -> torch.Tensor:
    """[B, T, Hq, Dv] in float64: explicit softmax over each query's visible keys."""
    b_, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    groups = hq // hkv
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b_, t, hq, v.shape[-1], dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            kh, vh = k[b, h // groups].double(), v[b, h // groups].double()
            scores = q[b, h].double() @ kh.T * sc
            if bias is not None:
                bb = bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1)]
                scores = scores + bb.double()
            if mask is None:
                if t > 1 and is_causal:
                    seen = torch.arange(s)[None, :] <= torch.arange(t)[:, None]
                    scores = scores.masked_fill(~seen, -math.inf)
            else:
                m = mask[min(b, mask.shape[0] - 1), min(h, mask.shape[1] - 1)]
                scores = (scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool
                          else scores + m.double())
            out[b, :, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def takes_grouped_path(device: str, mask, t: int, groups: int, kwargs: dict) -> bool:
    return (device == "cpu" and mask is not None and t > 1 and groups > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False))


# ---- random cases ------------------------------------------------------------------------------

def engine_mask(rng: random.Random, b_: int, t: int, s: int, cached: list[int]) -> torch.Tensor:
    """[B, 1, T, S] bool as the paged cache builds it: ragged causal rows, or draft trees."""
    mask = torch.zeros(b_, 1, t, s, dtype=torch.bool)
    tree = rng.random() < 0.3
    for b in range(b_):
        c = cached[b]
        for i in range(t):
            if tree:  # the cached prefix, itself, and some earlier new tokens (its ancestors)
                mask[b, 0, i, :c] = True
                mask[b, 0, i, c + i] = True
                for j in range(i):
                    mask[b, 0, i, c + j] = rng.random() < 0.5
            else:
                mask[b, 0, i, :c + i + 1] = True
    return mask


def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice(DTYPES)
    b_ = rng.randint(1, 3)
    hkv = rng.randint(1, 3)
    groups = rng.choice([1, 2, 2, 3, 4])
    t = rng.choice([1, 1, 2, 3, 5, 8, rng.randint(2, 24)])
    cached = [rng.randint(0, 60) for _ in range(b_)]
    s = max(cached) + t + rng.choice([0, 0, 0, 3, 17])  # unused slots past every row
    d = rng.choice([4, 8, 16, 64])
    q = torch.randn(b_, hkv * groups, t, d, generator=gen).to(dtype)
    k = torch.randn(b_, hkv, s, d, generator=gen).to(dtype)
    v = torch.randn(b_, hkv, s, d, generator=gen).to(dtype)
    if rng.random() < 0.3:  # as the model passes them: transposed views
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    kind = rng.choice(["engine"] * 5 + ["random", "float", "broadcast", "heads", "none"])
    if kind == "none":
        mask = None
    elif kind in ("random", "heads"):
        mask = torch.rand(b_, hkv * groups if kind == "heads" else 1, t, s,
                          generator=gen) < rng.random()
        mask[..., rng.randrange(s)] = True  # no query sees nothing
    else:
        mask = engine_mask(rng, b_ if kind != "broadcast" else 1, t, s,
                           cached if kind != "broadcast" else [max(cached)])
        if kind == "float":
            fill = rng.choice([-math.inf, torch.finfo(dtype).min])
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, fill)
    kwargs: dict = {}
    opt = rng.random()
    if opt < 0.08:
        kwargs["output_attentions"] = True
    elif opt < 0.16:
        kwargs["position_bias"] = torch.randn(1, hkv * groups, t, s, generator=gen).to(dtype)
    elif opt < 0.2:
        kwargs["softcap"] = 30.0
    elif opt < 0.3:
        kwargs["sliding_window"] = None  # what models pass along, ignored by SDPA
    if rng.random() < 0.3:
        kwargs["is_causal"] = rng.choice([True, False])
    scale = rng.choice([None, None, rng.uniform(0.05, 1.0)])
    module = types.SimpleNamespace(num_key_value_groups=groups)
    if rng.random() < 0.5:
        module.is_causal = True
    return dict(dtype=dtype, q=q, k=k, v=v, mask=mask, scale=scale, kwargs=kwargs,
                module=module, groups=groups, cached=cached, t=t, kind=kind)


def run(c: dict, q=None, k=None, v=None, mask=..., **extra):
    q = c["q"] if q is None else q
    k = c["k"] if k is None else k
    v = c["v"] if v is None else v
    mask = c["mask"] if mask is ... else mask
    return attention._sdpa(c["module"], q, k, v, mask, scaling=c["scale"],
                           **{**c["kwargs"], **extra})


def hidden_keys(mask) -> list[list[int]]:
    """Per row, the key slots its mask hides from every query and head."""
    if mask is None:
        return []
    seen = (mask if mask.dtype == torch.bool else mask == 0).any(dim=(1, 2))
    return [torch.nonzero(~seen[b]).flatten().tolist() for b in range(seen.shape[0])]


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one thread is fastest, and on a shared 2-core host OpenMP's barriers
    under contention took 300 seeds from 1 s to a minute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def calls(monkeypatch):
    """Which function answered: the stock one (counted), and repeat_kv (counted)."""
    from transformers.integrations import sdpa_attention

    seen = {"stock": 0, "repeat_kv": 0}
    real_stock, real_repeat = sdpa_attention.sdpa_attention_forward, sdpa_attention.repeat_kv

    def stock(*a, **k):
        seen["stock"] += 1
        return real_stock(*a, **k)

    def repeat(*a, **k):
        seen["repeat_kv"] += 1
        return real_repeat(*a, **k)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", stock)
    monkeypatch.setattr(sdpa_attention, "repeat_kv", repeat)
    return seen


def check_case(seed: int, calls: dict) -> None:
    from transformers.integrations import sdpa_attention

    c = random_case(seed)
    kw = c["kwargs"]
    grouped = takes_grouped_path("cpu", c["mask"], c["t"], c["groups"], kw)
    calls.update(stock=0, repeat_kv=0)
    if kw.get("softcap") is not None:
        with pytest.raises(ValueError, match="softcap"):  # the stock function's refusal
            run(c)
        assert calls["stock"] == 1, seed
        return
    out, weights = run(c)
    assert weights is None
    assert calls["stock"] == (0 if grouped else 1), (seed, c["kind"], kw.keys())
    if grouped:
        assert calls["repeat_kv"] == 0, seed  # no copy of every key and value per group
    b_, hq, t, _ = c["q"].shape
    assert out.shape == (b_, t, hq, c["v"].shape[-1]) and out.dtype == c["dtype"], seed
    assert out.is_contiguous(), seed
    is_causal = kw.get("is_causal")
    is_causal = getattr(c["module"], "is_causal", True) if is_causal is None else is_causal
    ref = model_attention(c["q"], c["k"], c["v"], c["mask"], c["scale"], is_causal,
                          kw.get("position_bias"))
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[c["dtype"]] * (1 + ref.abs().max().item()), (seed, c["dtype"], err)
    if not grouped:
        return
    # Exact: the stock function's bits (the path the kvpool's exactness tests compare with).
    stock, _ = sdpa_attention.sdpa_attention_forward(
        c["module"], c["q"], c["k"], c["v"], c["mask"], scaling=c["scale"], **kw)
    assert torch.equal(out, stock), (seed, (out.double() - stock.double()).abs().max().item())
    # Exact: keys and values no query of a row sees (unused slots, another row's longer
    # prefix, stale blocks) change nothing, whatever finite values they hold.
    hidden = hidden_keys(c["mask"])
    if c["mask"].shape[0] == b_ and any(hidden):
        k2, v2 = c["k"].clone(), c["v"].clone()
        gen = torch.Generator().manual_seed(seed + 1)
        for b, slots in enumerate(hidden):
            for s in slots:
                k2[b, :, s] = (torch.randn(k2.shape[1], k2.shape[3], generator=gen) * 50
                               ).to(k2.dtype)
                v2[b, :, s] = (torch.randn(v2.shape[1], v2.shape[3], generator=gen) * 50
                               ).to(v2.dtype)
        again, _ = run(c, k=k2, v=v2)
        assert torch.equal(out, again), (seed, "hidden keys changed the output")
    # Exact: a row alone gives the bits it gives in the batch.
    if b_ > 1:
        b = seed % b_
        m = c["mask"][b:b + 1] if c["mask"].shape[0] == b_ else c["mask"]
        alone, _ = run(c, q=c["q"][b:b + 1], k=c["k"][b:b + 1], v=c["v"][b:b + 1], mask=m)
        assert torch.equal(alone[0], out[b]), (seed, "a row alone differs")
    # Exact with dropout too (training): the same draws as the stock function's.
    torch.manual_seed(seed)
    a, _ = run(c, dropout=0.25)
    torch.manual_seed(seed)
    s_, _ = sdpa_attention.sdpa_attention_forward(
        c["module"], c["q"], c["k"], c["v"], c["mask"], dropout=0.25, scaling=c["scale"], **kw)
    assert torch.equal(a, s_), (seed, "dropout")


def test_random_attention_cases_agree_with_the_model(calls):
    for seed in range(SEEDS):
        check_case(seed, calls)


def test_a_forward_on_another_device_keeps_the_stock_function(calls):
    """The grouped call is for the CPU only (meta stands in for CUDA: no data, the dispatch
    and the output shape are what is checked)."""
    for seed in range(20):
        c = random_case(10_000 + seed)
        if c["kwargs"].get("softcap") is not None:
            continue
        if c["kwargs"].get("position_bias") is not None:
            c["kwargs"]["position_bias"] = c["kwargs"]["position_bias"].to("meta")
        calls.update(stock=0, repeat_kv=0)
        meta = {n: c[n].to("meta") for n in ("q", "k", "v")}
        mask = None if c["mask"] is None else c["mask"].to("meta")
        out, _ = run(c, mask=mask, **meta)
        assert calls["stock"] == 1, seed
        b_, hq, t, _ = c["q"].shape
        assert out.shape == (b_, t, hq, c["v"].shape[-1])


def test_register_installs_the_attention_and_sdpas_mask_builder():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    assert attention.register() == attention.NAME == "tiercache_sdpa"
    assert AttentionInterface._global_mapping[attention.NAME] is attention._sdpa
    assert AttentionMaskInterface._global_mapping[attention.NAME] is sdpa_mask
