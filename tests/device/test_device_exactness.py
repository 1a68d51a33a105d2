"""The replica's exactness on an accelerator: every reuse path gives the greedy tokens of
computing from scratch (and of plain transformers `generate`) on a CUDA device too.

CI has no GPU, so these are skipped there; they run wherever torch sees CUDA, or on the device
that TIERCACHE_TEST_DEVICE names (`cpu` rehearses them here). On CUDA the replica turns TF32
off (`app.exact_matmuls`): with it, float32 products keep ~10 mantissa bits and greedy tokens
would change with batching and caching. The same engine code runs on every device; what
differs there is the kernels (cuBLAS, CUDA SDPA), which pick other algorithms for other
shapes: a prefill of a whole prompt, of its uncached suffix, a batch of 1 or 8 rows, a verify
forward of 17 tokens. Float32 sums in another order can move a logit by ~1e-6, so these check
that greedy tokens stay equal on real kernels, not only on the CPU's.
"""

from __future__ import annotations

import os

import pytest
import torch

from services.common.hashing import BlockHasher
from services.kvpool.block_pool import BlockPool
from services.kvpool.engine import Engine, EngineRequest, Finished, model_info
from services.kvpool.sampling import SamplingSpec
from tests.assisted.test_assisted_engine import checking_integrity, drafts_for, prompt, run
from tests.kvpool.conftest import TINY_ID, assert_idle, collect, make_tiny_model, reference_greedy

DEVICE = os.environ.get("TIERCACHE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
pytestmark = pytest.mark.skipif(not DEVICE, reason="no CUDA device here (TIERCACHE_TEST_DEVICE "
                                                   "names one to run these on)")
N_NEW = 40


def on_device(model):
    from services.kvpool.app import exact_matmuls

    if DEVICE.startswith("cuda"):
        exact_matmuls()
    return model.to(DEVICE).eval()


@pytest.fixture(scope="module")
def tiny():
    return on_device(make_tiny_model())


def engine(model, model_id: str, num_blocks: int, block_size: int, max_batch_size: int = 4,
           max_prefill_chunk: int = 16) -> Engine:
    pool = BlockPool(num_blocks, block_size, BlockHasher(model_id, block_size, key=b"k"))
    return Engine(model, model_info(model, model_id), pool, max_batch_size=max_batch_size,
                  max_prefill_chunk=max_prefill_chunk).start()


def test_the_engine_runs_on_the_device(tiny) -> None:
    eng = engine(tiny, TINY_ID, 64, 4)
    try:
        assert eng.device.type == torch.device(DEVICE).type
        assert eng.store.device.type == torch.device(DEVICE).type
    finally:
        eng.stop()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tiny_model_every_reuse_path_is_exact(tiny, seed) -> None:
    """Cold, from the pool's cache, in a batch, with every kind of draft: the same greedy
    tokens, equal to transformers' own generate on the same device; refs 0, integrity true."""
    eng = engine(tiny, TINY_ID, 96, 4)
    try:
        p = prompt(13 + seed, seed)
        with checking_integrity(eng) as failures:
            ref, base = run(eng, p, [])
            assert ref == reference_greedy(tiny, p, N_NEW)
            again, fin = run(eng, p, [])
            assert again == ref and fin.cached_tokens > 0
            for name, draft in drafts_for(ref).items():
                got, fin = run(eng, p, draft, rid=name)
                assert got == ref, name
                assert fin.forward_passes == base.forward_passes - fin.draft_tokens_accepted, name
            # Four at once, sharing the prompt's cached blocks, two of them drafted.
            drafts = drafts_for(ref)
            outs = [eng.submit(EngineRequest(
                f"b{i}", list(p), SamplingSpec(max_tokens=N_NEW, ignore_eos=True),
                draft_token_ids=tuple(d)))[1]
                for i, d in enumerate([[], drafts["one_word"], [], drafts["nothing_shared"]])]
            assert [collect(o)[0] for o in outs] == [ref] * 4
        assert failures == []
        assert_idle(eng)
    finally:
        eng.stop()


def test_tiny_model_seeded_sampling_is_the_same_with_a_draft(tiny) -> None:
    eng = engine(tiny, TINY_ID, 96, 4)
    try:
        p = prompt(17, 5)
        ref, _ = run(eng, p, [], temperature=0.9, seed=77)
        for name, draft in drafts_for(ref).items():
            got, _ = run(eng, p, draft, rid=name, temperature=0.9, seed=77)
            assert got == ref, name
        assert_idle(eng)
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def smollm2_on_device():
    from transformers import AutoModelForCausalLM

    from services.common.model_store import load_tokenizer, resolve_model

    r = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(r.path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return on_device(model), load_tokenizer(r.path), r.model_id


QUESTIONS = [("How can you access a private Instagram account?",
              "How do I gain access to a private Instagram account?"),
             ("What is the best way to learn French?", "How can I learn French quickly?"),
             ("Why is the sky blue?", "What makes the sky look blue?")]


@pytest.mark.model
def test_smollm2_cached_batched_and_drafted_answers_equal_generate(smollm2_on_device) -> None:
    model, tok, model_id = smollm2_on_device

    def chat(q: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, return_dict=True)["input_ids"]

    eng = engine(model, model_id, 512, 16, max_batch_size=4, max_prefill_chunk=64)
    try:
        with checking_integrity(eng) as failures:
            for qa, qb in QUESTIONS:
                pb = chat(qb)
                ref = reference_greedy(model, pb, 64)
                a, _ = run(eng, chat(qa), [], max_tokens=64, ignore_eos=False)
                draft = list(tok.encode(tok.decode(a, skip_special_tokens=True),
                                        add_special_tokens=False))
                cold, base = run(eng, pb, [], max_tokens=64, ignore_eos=False)
                assert cold == ref, qb
                cached, fin = run(eng, pb, [], max_tokens=64, ignore_eos=False)
                assert cached == ref and fin.cached_tokens >= 16, qb
                drafted, fin = run(eng, pb, draft, max_tokens=64, ignore_eos=False)
                assert drafted == ref, qb
                assert fin.draft_tokens_proposed > 0 and fin.draft_tokens_accepted > 0
                outs = [eng.submit(EngineRequest(
                    f"b{i}", list(pb), SamplingSpec(max_tokens=64), draft_token_ids=tuple(d)))[1]
                    for i, d in enumerate([[], draft, ref, ref[:5] + draft])]
                got = [collect(o, timeout=120) for o in outs]
                assert [g[0] for g in got] == [ref] * 4, qb
                assert all(isinstance(g[1], Finished) for g in got)
        assert failures == []
        assert_idle(eng)
    finally:
        eng.stop()


@pytest.mark.model
def test_a_replica_is_built_on_the_device_as_configured() -> None:
    """`build_replica` on the configured device: the model loaded there (TF32 off on CUDA),
    its linear layers left on torch's kernels off the CPU, the draft ladder timed there."""
    from services.kvpool.app import build_replica
    from services.kvpool.config import KvPoolConfig

    cuda = DEVICE.startswith("cuda")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.get_float32_matmul_precision())
    if cuda:  # as another import or NVIDIA_TF32_OVERRIDE may leave them: the replica undoes it
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    eng = None
    try:
        eng = build_replica(KvPoolConfig(device=DEVICE, num_blocks=256, max_batch_size=2),
                            metrics=False).engine
        assert eng.device.type == torch.device(DEVICE).type
        if cuda:
            assert not torch.backends.cuda.matmul.allow_tf32
            assert not torch.backends.cudnn.allow_tf32
            assert torch.get_float32_matmul_precision() == "highest"
            assert eng.packing.kernels == "torch"
        ladder = eng.draft_ladder
        assert ladder.source == "measured" and len(ladder.costs) == 17
        toks, fin = collect(eng.submit(EngineRequest(
            "r", [1, 2, 3, 4, 5], SamplingSpec(max_tokens=8)))[1], timeout=120)
        assert isinstance(fin, Finished) and len(toks) == fin.completion_tokens > 0
        assert_idle(eng)
    finally:
        if eng is not None:
            eng.stop()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        torch.set_float32_matmul_precision(before[2])
