"""Linear layers on oneDNN with packed weights (services/kvpool/linear.py): when a model is
packed, that the packed model computes what the plain one does, and that the engine stays
token-exact on it (reuse and drafts against computing from scratch)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from services.kvpool.engine import EngineRequest, Finished, fp32_head
from services.kvpool.linear import PackedLinear, Packing, pack_linears, unsupported
from services.kvpool.sampling import SamplingSpec
from tests.kvpool.conftest import assert_idle, collect, make_tiny_model, reference_greedy

ONEDNN = unsupported(make_tiny_model()) == ""
NATIVE_BF16 = ONEDNN and unsupported(make_tiny_model().to(torch.bfloat16)) == ""
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_the_linear_at_every_row_count(bias) -> None:
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
    packed = PackedLinear(lin)
    for shape in [(1, 96), (3, 96), (2, 17, 96)]:
        x = torch.randn(*shape, generator=g)
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-4, atol=1e-4)
    x = torch.randn(2, 9, 96, generator=g)[:, 3:7]  # a strided slice, as the engine's rows are
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_packing_swaps_every_linear_and_keeps_the_logits() -> None:
    plain = make_tiny_model()
    model = copy.deepcopy(plain)
    n = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert n == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert pack_linears(model) == Packing("onednn", n)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linears(model) == Packing("onednn", n)  # packed before: reported, not redone
    ids = torch.tensor([[5, 9, 17, 33, 2, 8, 44, 61, 70, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    head = fp32_head(model)
    assert head is not None and isinstance(head.logits, PackedLinear) and head.weight is None


def test_models_the_kernels_do_not_serve_keep_torchs_and_say_why() -> None:
    half = make_tiny_model().to(torch.float16)
    got = pack_linears(half)
    assert got.kernels == "torch" and got.layers == 0
    if ONEDNN:
        assert "float16" in got.why_not
    assert any(type(m) is torch.nn.Linear for m in half.modules())  # untouched
    mixed = make_tiny_model()
    mixed.lm_head.to(torch.bfloat16)
    if ONEDNN:
        assert "mix" in pack_linears(mixed).why_not
    assert not any(isinstance(m, PackedLinear) for m in mixed.modules())
    plain = make_tiny_model()
    assert pack_linears(plain, "torch") == Packing("torch", 0, "configured")
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())


@needs_onednn
def test_a_bfloat16_model_packs_where_the_cpu_runs_bfloat16_and_keeps_a_float32_head() -> None:
    plain = make_tiny_model().to(torch.bfloat16)
    model = copy.deepcopy(plain)
    got = pack_linears(model)
    if not NATIVE_BF16:
        assert got.kernels == "torch" and "native bfloat16" in got.why_not
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        return
    assert got == Packing("onednn", 2 * 7 + 1)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert model.lm_head.dtype == torch.float32
    assert {m.dtype for m in layers if m is not model.lm_head} == {torch.bfloat16}
    ids = torch.tensor([[5, 9, 17, 33, 2, 8, 44, 61, 70, 3]])
    with torch.inference_mode():
        logits = model(ids).logits
        want = plain(ids).logits.float()
        assert logits.dtype == torch.float32  # from the float32 head
        # bfloat16 hidden states summed in another order: within a few bfloat16 ulps.
        torch.testing.assert_close(logits, want, rtol=3e-2, atol=3e-2)
        # The engine's float32 head is the packed copy, and computes what the unpacked model's
        # float32 copy does from the same hidden states.
        head, ref = fp32_head(model), fp32_head(plain)
        assert head is not None and head.logits is model.lm_head and head.weight is None
        hidden = plain.model(ids).last_hidden_state
        torch.testing.assert_close(head.logits(hidden), ref.logits(hidden.float()),
                                   rtol=1e-4, atol=1e-4)


@needs_onednn
def test_the_engine_on_packed_layers_is_exact_with_reuse_and_drafts(make_engine) -> None:
    """Greedy tokens on the packed model: cold, from a cached prefix, batched, and verifying a
    perfect and a one-token-off draft all equal its plain generate (same kernels), and the
    engine reports the packing."""
    model = make_tiny_model(seed=3)
    pack_linears(model)
    eng = make_engine(num_blocks=96, block_size=4, max_batch_size=4, model=model)
    assert eng.packing.kernels == "onednn" and eng.packing.layers == 15
    prompt = [5, 9, 17, 33, 2, 8, 44, 61, 70, 3, 12, 99, 100, 7]
    ref = reference_greedy(model, prompt, 24)
    plain = SamplingSpec(24, ignore_eos=True)
    toks, fin = collect(eng.submit(EngineRequest("a", prompt, plain))[1])
    assert toks == ref and isinstance(fin, Finished)
    off = list(ref)
    off[10] = (off[10] + 1) % 120
    outs = [eng.submit(EngineRequest(f"b{i}", prompt, plain, draft_token_ids=tuple(d)))[1]
            for i, d in enumerate([ref, off, ()])]
    res = [collect(o) for o in outs]
    assert [t for t, _ in res] == [ref, ref, ref]
    assert all(f.cached_tokens >= 12 for _, f in res)
    assert eng.draft_tokens_accepted_total >= 23  # the perfect draft verified nearly whole
    assert_idle(eng)


def test_the_engine_thread_runs_with_the_threads_it_was_given(make_engine) -> None:
    """A replica process leaves OpenMP to the engine thread (its main thread loads the model
    with one thread): the engine sets its own thread count when it starts."""
    eng = make_engine(threads=1)
    assert eng.call(torch.get_num_threads).result(timeout=10) == 1


def test_an_engine_not_started_names_a_real_thread_count(tiny_model) -> None:
    """threads=0 (all) is only resolved when the engine thread starts: before that, asking
    for a large forward's count gave 0, which torch.set_num_threads refuses."""
    from services.common.hashing import BlockHasher
    from services.kvpool.block_pool import BlockPool
    from services.kvpool.engine import Engine, model_info
    from tests.kvpool.conftest import TINY_ID

    pool = BlockPool(16, 4, BlockHasher(TINY_ID, 4, key=b"k"))
    eng = Engine(tiny_model, model_info(tiny_model, TINY_ID), pool, threads=0,
                 one_thread_below=8)
    assert eng.threads_for(7) == 1
    assert eng.threads_for(8) == torch.get_num_threads() >= 1


def test_small_forwards_run_on_one_thread_and_large_ones_on_all(make_engine) -> None:
    """With OMP_WAIT_POLICY=PASSIVE, waking OpenMP workers for each small matmul of a decode step
    cost more than the second core gave: forwards under `one_thread_below` new tokens run on
    one thread, longer ones (prefill chunks) on the engine's threads; the start-time timing of
    draft forwards uses the same rule and leaves the count as it found it."""
    from services.kvpool.calibrate import forward_costs

    model = make_tiny_model(seed=5)
    seen: list[tuple[int, int]] = []  # (new tokens, threads) per forward on the engine thread

    def record(module, args, kw) -> None:
        if threading.current_thread().name == "kvpool-engine":
            seen.append((kw["input_ids"].numel(), torch.get_num_threads()))

    hook = model.model.register_forward_pre_hook(record, with_kwargs=True)
    eng = make_engine(model=model, threads=2, one_thread_below=8, max_prefill_chunk=16)
    try:
        assert eng.call(lambda: eng.threads_for(7)).result(timeout=10) == 1
        assert eng.threads_for(8) == 2
        prompt = list(range(3, 23))  # prefill chunks of 10, then decode steps of one token
        plain = SamplingSpec(6, ignore_eos=True)
        toks, _ = collect(eng.submit(EngineRequest("t", prompt, plain))[1])
        assert toks == reference_greedy(model, prompt, 6)
        assert (10, 2) in seen and (1, 1) in seen
        assert all(t == (1 if n < 8 else 2) for n, t in seen)
        seen.clear()
        costs = eng.call(lambda: forward_costs(model, 10, context=8, sweeps=1,
                                               threads_for=eng.threads_for)).result(timeout=60)
        assert sorted(costs) == list(range(1, 11))
        assert {(q, 1 if q < 8 else 2) for q in range(1, 11)} <= set(seen)
        assert eng.call(torch.get_num_threads).result(timeout=10) == eng._threads_now
    finally:
        hook.remove()
