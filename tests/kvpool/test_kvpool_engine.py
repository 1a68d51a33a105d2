"""Engine invariants on a tiny random Llama: exactness, ref counts, cancellation, preemption."""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from services.common import errors
from services.kvpool.engine import Failed, Finished, FinishReason
from services.kvpool.paged_cache import ForwardPlan
from tests.kvpool.conftest import (
    TINY_ID,
    TINY_VOCAB,
    assert_idle,
    collect,
    generate,
    prompt,
    reference_greedy,
    request,
)
from tests.metric_sample import sample_value
from tests.waits import wait_until


@contextlib.contextmanager
def paused(eng) -> Iterator[None]:
    """Hold the engine thread between steps, so requests submitted meanwhile arrive together."""
    gate, entered = threading.Event(), threading.Event()
    eng.call(lambda: (entered.set(), gate.wait(120)))
    assert entered.wait(60), "the engine thread never reached the pause"
    try:
        yield
    finally:
        gate.set()


def test_cached_prefix_logits_equal_one_full_pass(make_engine, tiny_model) -> None:
    eng = make_engine(max_prefill_chunk=7)
    toks = prompt(45)
    generate(eng, toks[:32], max_tokens=1)  # caches 8 blocks of 4
    full = tiny_model(torch.tensor([toks])).logits[0]

    def suffix_logits():
        # On the engine thread: reuse the cached prefix, compute the rest in one forward.
        eng.pool.open("probe", toks, keep_uncached=1)
        try:
            table = eng.pool.blocks_of("probe")
            cached = 32
            eng.store.load_row(0, table, cached)
            eng.pool.ensure_capacity("probe", len(toks))
            eng.cache.begin(ForwardPlan(0, [cached], len(toks) - cached))
            with torch.inference_mode():
                out = tiny_model(input_ids=torch.tensor([toks[cached:]]), cache=eng.cache,
                                 position_ids=eng.cache.position_ids(),
                                 attention_mask=eng.cache.attention_mask())
            return out.logits[0]
        finally:
            eng.pool.close("probe")

    got = eng.call(suffix_logits).result(10)
    assert torch.allclose(got, full[32:], atol=1e-4)


def test_greedy_equals_transformers_with_and_without_cached_prefix(make_engine,
                                                                     tiny_model) -> None:
    eng = make_engine(max_prefill_chunk=5)
    base = prompt(32, 1)
    ref = reference_greedy(tiny_model, base, 12)
    toks, fin = generate(eng, base, max_tokens=12)
    assert toks == ref and isinstance(fin, Finished) and fin.cached_tokens == 0
    toks, fin = generate(eng, base, max_tokens=12)  # whole prompt cached but one token (COW)
    assert toks == ref and fin.cached_tokens == 31
    longer = base + prompt(9, 2)
    toks, fin = generate(eng, longer, max_tokens=12)  # partial reuse
    assert toks == reference_greedy(tiny_model, longer, 12) and fin.cached_tokens == 32
    assert_idle(eng)


def test_prefill_runs_in_equal_chunks_and_stays_exact(make_engine, tiny_model) -> None:
    eng = make_engine(max_prefill_chunk=16)
    sizes: list[int] = []
    forward = eng._forward

    def recording(ids, plan, keep=1, need=None):
        sizes.append(plan.q_len)
        return forward(ids, plan, keep, need)

    eng._forward = recording
    toks = prompt(34, 6)
    got, _ = generate(eng, toks, max_tokens=3)
    # Prompt chunks, then one decode forward per further token.
    assert sizes == [12, 11, 11, 1, 1]
    assert got == reference_greedy(tiny_model, toks, 3)


def test_next_turn_reuses_blocks_of_generated_tokens(make_engine, tiny_model) -> None:
    eng = make_engine()
    turn1 = prompt(10, 3)
    answer, _ = generate(eng, turn1, max_tokens=14)
    turn2 = turn1 + answer + prompt(6, 4)
    toks, fin = generate(eng, turn2, max_tokens=6)
    # KV exists for every token but the last generated one (never fed back): 23 of 24 tokens.
    assert fin.cached_tokens == (len(turn1) + len(answer) - 1) // 4 * 4 == 20
    assert toks == reference_greedy(tiny_model, turn2, 6)


def test_concurrent_requests_share_blocks_and_batch_exactly(make_engine, tiny_model) -> None:
    eng = make_engine(num_blocks=64, max_batch_size=4)
    system = prompt(24, 5)
    generate(eng, system, max_tokens=1)  # warm the shared prefix
    prompts = [system + prompt(3 + i, 10 + i) for i in range(4)]
    with paused(eng):
        outs = [eng.submit(request(p, max_tokens=10, rid=f"c{i}"))[1]
                for i, p in enumerate(prompts)]
    peak = 0
    results = []
    for out in outs:
        while True:
            peak = max(peak, eng.stats().blocks_in_use)
            if not out.empty():
                break
            time.sleep(0.001)
        results.append(collect(out))
    for p, (toks, fin) in zip(prompts, results, strict=True):
        assert isinstance(fin, Finished) and fin.cached_tokens == 24
        assert toks == reference_greedy(tiny_model, p, 10)
    # 6 shared prefix blocks once + at most 4 private blocks per request (with 4 unshared copies
    # it would be 4 * (6 + 4) = 40).
    assert peak <= 6 + 4 * 4


def test_preemption_recomputes_and_stays_exact(make_engine, tiny_model) -> None:
    # 14 blocks of 4: two sequences of 20 prompt + 24 new tokens cannot both finish at once.
    eng = make_engine(num_blocks=14, max_batch_size=2, max_prefill_chunk=32)
    a, b = prompt(20, 20), prompt(20, 21)
    with paused(eng):  # both arrive in the same engine step, whatever the machine's load
        outs = [eng.submit(request(p, max_tokens=24, rid=r))[1] for p, r in ((a, "a"), (b, "b"))]
    res = [collect(o) for o in outs]
    assert res[0][0] == reference_greedy(tiny_model, a, 24)
    assert res[1][0] == reference_greedy(tiny_model, b, 24)
    assert eng.stats().preemptions_total >= 1


def test_request_that_can_never_fit_is_refused(make_engine) -> None:
    eng = make_engine(num_blocks=8)
    with pytest.raises(errors.ResourceExhausted, match="KV blocks") as e:
        eng.submit(request(prompt(30), max_tokens=8))
    assert not isinstance(e.value, errors.Overloaded)  # no other replica of its size fits it


def test_a_pool_held_by_pins_lets_a_request_in_instead_of_hanging(make_engine) -> None:
    eng = make_engine(num_blocks=8)
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec

    pin = EngineRequest("p", prompt(28, 30), SamplingSpec(max_tokens=0), prefill_only=True,
                        pin_ttl_seconds=60)
    _, fin = collect(eng.submit(pin)[1])
    assert isinstance(fin, Finished) and fin.pinned_blocks == 7
    _, fin = generate(eng, prompt(12, 31), max_tokens=4)  # 4 blocks, 1 free: 3 pins yield
    assert isinstance(fin, Finished)
    assert eng.stats().blocks_pinned == 4  # the prompt's first 4 blocks
    eng.call(eng.pool.release_pins).result()


def test_a_prefill_longer_than_the_pin_share_pins_its_leading_blocks(make_engine) -> None:
    """The pin was all-or-nothing: a prompt longer than a tenant's share of the pins (a
    ~1,000-token system prompt on a small pool) kept none of it pinned."""
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec

    eng = make_engine(num_blocks=32)
    eng.pool.max_pinned_per_salt = 3

    def prefill(rid: str, toks: list[int]):
        return collect(eng.submit(EngineRequest(rid, toks, SamplingSpec(max_tokens=0),
                                                prefill_only=True, pin_ttl_seconds=60))[1])[1]

    long = prompt(28, 40)  # 7 full blocks
    fin = prefill("p", long)
    assert isinstance(fin, Finished) and fin.pinned_blocks == 3
    table = [eng.pool._table[h] for h in eng.pool.hasher.hashes(long)]
    assert [eng.pool.is_pinned(b) for b in table] == [True] * 3 + [False] * 4
    fin = prefill("q", prompt(12, 41))  # the share is used up: nothing pinned, said so
    assert isinstance(fin, Failed) and isinstance(fin.error, errors.ResourceExhausted)
    assert "max_pinned_per_tenant_fraction" in str(fin.error)
    # The work was done all the same (a Warm result read as "nothing computed"): said.
    assert "12 of its 12 tokens computed now, 3 blocks cached, none pinned" in str(fin.error)
    assert isinstance(fin.error, errors.PinRefused) and fin.error.work == (12, 0, 12)
    assert eng.stats().blocks_pinned == 3
    eng.call(eng.pool.release_pins).result()


@pytest.mark.parametrize("where", ["waiting", "prefill", "decode"])
def test_cancel_releases_everything(make_engine, where) -> None:
    from services.kvpool.engine import Phase

    eng = make_engine(num_blocks=200, max_batch_size=1, max_prefill_chunk=4)
    blocker = None
    if where == "waiting":  # holds the only row until cancelled
        blocker = eng.submit(request(prompt(40, 40), max_tokens=150, rid="blocker",
                                     ignore_eos=True))
        blocker[1].get(timeout=30)
    sid, out = eng.submit(request(prompt(120, 41), max_tokens=200, rid="victim",
                                  ignore_eos=True))
    want = {"waiting": Phase.WAITING, "prefill": Phase.PREFILL, "decode": Phase.DECODE}[where]

    def cancel_if_there() -> bool:
        """On the engine thread, between steps: the cancel is handled in this same turn."""
        seq = eng._by_id.get(sid)
        if seq is None or seq.phase is not want:
            return False
        eng.cancel(sid)
        return True

    wait_until(lambda: eng.call(cancel_if_there).result(30), 30,  # one engine turn a try
               f"the victim never reached {where}", every=0)
    _, fin = collect(out)
    assert isinstance(fin, Failed) and isinstance(fin.error, errors.Cancelled)
    if blocker is not None:
        eng.cancel(blocker[0])
        collect(blocker[1])
    assert_idle(eng)


def test_deadline_ends_request_and_frees_blocks(make_engine) -> None:
    eng = make_engine(num_blocks=200, max_batch_size=2)
    _, out = eng.submit(request(prompt(20), max_tokens=500, ignore_eos=True,
                                deadline=time.monotonic() + 0.2))
    toks, fin = collect(out)
    assert isinstance(fin, Failed) and isinstance(fin.error, errors.DeadlineExceeded)
    assert_idle(eng)


def test_stop_conditions(make_engine, tiny_model) -> None:
    eng = make_engine()
    p = prompt(12, 50)
    ref = reference_greedy(tiny_model, p, 10)
    toks, fin = generate(eng, p, max_tokens=10, stop_token_ids=frozenset([ref[3]]))
    first = ref.index(ref[3])
    assert toks == ref[: first + 1] and fin.finish_reason is FinishReason.STOP
    toks, fin = generate(eng, p, max_tokens=5)
    assert fin.finish_reason is FinishReason.LENGTH and fin.completion_tokens == 5


def test_eos_stops_unless_ignored(tiny_model, make_engine) -> None:
    from tests.kvpool.conftest import make_tiny_model

    model = make_tiny_model()
    p = prompt(12, 50)
    ref = reference_greedy(tiny_model, p, 6)
    model.generation_config.eos_token_id = ref[2]  # make the model's 3rd token its EOS
    eng = make_engine(model=model)
    toks, fin = generate(eng, p, max_tokens=6)
    assert toks == ref[:3] and fin.finish_reason is FinishReason.EOS
    toks, fin = generate(eng, p, max_tokens=6, ignore_eos=True)
    assert toks == ref and fin.finish_reason is FinishReason.LENGTH


def test_seeded_sampling_is_reproducible(make_engine) -> None:
    eng = make_engine()
    p = prompt(10, 60)
    a, _ = generate(eng, p, max_tokens=12, temperature=1.5, top_p=0.9, seed=7)
    b, _ = generate(eng, p, max_tokens=12, temperature=1.5, top_p=0.9, seed=7)
    c, _ = generate(eng, p, max_tokens=12, temperature=1.5, top_p=0.9, seed=8)
    assert a == b and a != c
    d, _ = generate(eng, p, max_tokens=12, temperature=1.0, top_p=1e-6, seed=9)
    assert d[0] == generate(eng, p, max_tokens=1)[0][0]  # tiny top_p keeps only the argmax


def test_a_tiny_temperature_samples_the_argmax(make_engine, tiny_model) -> None:
    """logits / 1e-45 overflows to inf; sampling must still work (a point mass on the argmax),
    not crash the engine step."""
    eng = make_engine()
    p = prompt(13, 61)
    toks, fin = generate(eng, p, max_tokens=6, temperature=1e-45, seed=3)
    assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, p, 6)


def test_a_failed_sampling_step_leaves_no_block_cached_without_its_kv(make_engine, tiny_model,
                                                                       monkeypatch) -> None:
    """The prompt's last blocks are committed before the first token is sampled and copied
    after it: when sampling raises, the copy must still happen, or the next request with the
    same prefix reuses blocks that hold no KV of it."""
    from services.kvpool import sampling

    real = sampling.Sampler.draw

    def draw(self, probs):
        if self.spec.seed == 13:
            raise ValueError("sampling: simulated failure")
        return real(self, probs)

    monkeypatch.setattr(sampling.Sampler, "draw", draw)
    eng = make_engine()
    p = prompt(13, 62)  # 3 full blocks of 4, one prefill chunk
    _, fin = generate(eng, p, max_tokens=6, temperature=1.0, seed=13)
    assert isinstance(fin, Failed)
    toks, fin = generate(eng, p, max_tokens=6)
    assert isinstance(fin, Finished) and fin.cached_tokens == 12
    assert toks == reference_greedy(tiny_model, p, 6)


def test_a_failure_while_admitting_ends_the_request_and_frees_its_blocks(make_engine,
                                                                        tiny_model) -> None:
    """An allocation error after the pool opened the sequence (the KV rows grow for a long
    prompt) fails that request; it must not linger holding blocks, nor disturb the next one."""
    eng = make_engine()
    real = eng.store.ensure_capacity
    calls = []

    def ensure_capacity(n):
        calls.append(n)
        if len(calls) == 1:
            raise RuntimeError("simulated out of memory")
        return real(n)

    eng.store.ensure_capacity = ensure_capacity
    a = prompt(29, 63)
    _, fin = generate(eng, a, max_tokens=4)
    assert isinstance(fin, Failed)
    assert eng.call(lambda: eng.pool.stats().in_use).result(10) == 0
    b = prompt(40, 64)
    toks, fin = generate(eng, b, max_tokens=4)
    assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, b, 4)


def test_a_decoding_request_is_not_failed_while_a_prefill_holds_blocks(make_engine) -> None:
    """A (14 of 16 blocks at its end) is the only decoding sequence when B's prompt takes every
    free block and is still prefilling: when A needs a block, B is preempted, not A failed."""
    eng = make_engine(num_blocks=16, block_size=4, max_prefill_chunk=4, drafts=False)
    forward = eng._forward

    def slow(ids, plan, keep=1, need=None):
        time.sleep(0.02)  # keeps A from finishing before B arrives, whatever the machine
        return forward(ids, plan, keep, need)

    eng._forward = slow
    a = prompt(8, 65)
    _, out_a = eng.submit(request(a, 48, rid="A", ignore_eos=True))
    first: list[int] = []
    while len(first) < 20:
        first.extend(out_a.get(timeout=30).token_ids)
    with paused(eng):  # the engine is held: the pool's free count is exact
        free = eng.pool.stats().free
        assert free >= 5  # B's prefill (one chunk per block) outlasts A's next 4 tokens
        # B takes every free block; A needs its next one within 4 tokens.
        _, out_b = eng.submit(request(prompt(4 * free, 66), 2, rid="B", ignore_eos=True))
    toks_a, fin_a = collect(out_a)
    toks_b, fin_b = collect(out_b)
    assert isinstance(fin_a, Finished) and len(first + toks_a) == 48
    assert isinstance(fin_b, Finished) and len(toks_b) == 2
    assert eng.stats().preemptions_total >= 1
    eng._forward = forward
    alone, _ = generate(eng, a, max_tokens=48, ignore_eos=True)
    assert first + toks_a == alone


def test_random_mix_of_requests_keeps_integrity(make_engine, tiny_model) -> None:
    eng = make_engine(num_blocks=40, max_batch_size=3, max_prefill_chunk=6)
    rng = random.Random(0)
    base = prompt(16, 70)
    pending = []
    for i in range(12):
        p = (base if rng.random() < 0.6 else []) + prompt(rng.randrange(1, 12), 100 + i)
        sid, out = eng.submit(request(p, max_tokens=rng.randrange(1, 10), rid=f"m{i}"))
        pending.append((sid, out, p))
        if rng.random() < 0.25:
            eng.cancel(sid)
    for _, out, p in pending:
        toks, fin = collect(out)
        if isinstance(fin, Finished):
            assert toks == reference_greedy(tiny_model, p, fin.completion_tokens)
        else:
            assert isinstance(fin.error, errors.Cancelled)
    assert_idle(eng)
    assert eng.stats().cached_tokens_total > 0


def test_metrics_follow_the_engine(make_engine) -> None:

    from services.kvpool.metrics import KvMetrics

    def value(name: str, **labels) -> float:
        return sample_value(name, labels) or 0.0

    before_ttft = value("tiercache_kvpool_ttft_seconds_count")
    before_cached = value("tiercache_kvpool_cached_tokens_total")
    before_prefill = value("tiercache_kvpool_step_seconds_count", kind="prefill")
    eng = make_engine(metrics=KvMetrics())
    p = prompt(17, 80)
    generate(eng, p, max_tokens=3)
    generate(eng, p, max_tokens=3)
    assert_idle(eng)
    # Prefill forwards are timed as such: 17 tokens in chunks of 16 are 2, the hit's 1 is 1.
    assert value("tiercache_kvpool_step_seconds_count", kind="prefill") == before_prefill + 3
    assert value("tiercache_kvpool_ttft_seconds_count") == before_ttft + 2
    assert value("tiercache_kvpool_cached_tokens_total") == before_cached + 16
    assert value("tiercache_kvpool_step_seconds_count", kind="decode") > 0
    eng.call(lambda: None).result(5)  # one more engine step publishes the gauges
    assert value("tiercache_kvpool_capacity_blocks") == 64
    assert value("tiercache_kvpool_blocks", state="in_use") == 0
    # The states partition the pool ("total" was a state too: a sum counted it twice).
    assert sample_value("tiercache_kvpool_blocks", {"state": "total"}) is None
    assert sum(value("tiercache_kvpool_blocks", state=s)
               for s in ("free", "cached", "pinned", "in_use")) == 64
    # Prefills counted (a refactor dropped the counter while Stats kept counting them).
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec

    before = (value("tiercache_kvpool_prefills_total"),
              value("tiercache_kvpool_prefill_computed_tokens_total"))
    collect(eng.submit(EngineRequest("w", prompt(16, 81), SamplingSpec(max_tokens=0),
                                     prefill_only=True))[1])
    assert value("tiercache_kvpool_prefills_total") == before[0] + 1
    assert value("tiercache_kvpool_prefill_computed_tokens_total") == before[1] + 16


def test_stopping_the_engine_answers_every_request(make_engine) -> None:
    eng = make_engine(max_batch_size=1)
    outs = [eng.submit(request(prompt(20, 90 + i), max_tokens=200, ignore_eos=True))[1]
            for i in range(3)]
    eng.stop()
    for out in outs:
        _, fin = collect(out)
        assert isinstance(fin, Failed) and isinstance(fin.error, errors.Unavailable)
    eng.check_integrity()
    assert eng.pool.stats().in_use == 0


def test_warm_up_pins_yield_to_an_answer_already_streaming(make_engine, tiny_model) -> None:
    """A generation that fits the pool on its own (4 + 28 tokens = all 8 blocks) is running
    when a Warm pins 2 blocks: the pins are released for it instead of failing it mid-answer."""
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec

    eng = make_engine(num_blocks=8, max_batch_size=2, drafts=False)
    p = prompt(4, 50)
    with paused(eng):  # both arrive together: the generation is admitted first
        _, out = eng.submit(request(p, max_tokens=28, rid="gen", ignore_eos=True))
        _, wout = eng.submit(EngineRequest("warm", prompt(8, 51), SamplingSpec(max_tokens=0),
                                           prefill_only=True, pin_ttl_seconds=60))
    _, wfin = collect(wout)
    assert isinstance(wfin, Finished) and wfin.pinned_blocks == 2
    toks, fin = collect(out)
    assert isinstance(fin, Finished) and fin.finish_reason == FinishReason.LENGTH
    alone, _ = generate(make_engine(num_blocks=16, drafts=False), p, max_tokens=28,
                        ignore_eos=True)
    assert toks == alone


def test_a_stop_inside_an_accepted_draft_counts_only_the_draft_tokens_emitted(make_engine,
                                                                              tiny_model):
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec

    eng = make_engine(num_blocks=64)
    p = prompt(11, 52)
    ref, _ = generate(make_engine(num_blocks=64), p, max_tokens=30, ignore_eos=True)
    stop = ref[2]
    first = ref.index(stop)
    toks, fin = collect(eng.submit(EngineRequest(
        "d", p, SamplingSpec(30, ignore_eos=True, stop_token_ids=frozenset([stop])),
        draft_token_ids=tuple(ref)))[1])
    assert toks == ref[:first + 1] and fin.finish_reason == FinishReason.STOP
    # The prefill's forward already verifies the draft: every emitted token is an accepted
    # draft token, and none of the 16 accepted after the stop counts.
    assert fin.draft_tokens_accepted == fin.completion_tokens == first + 1
    assert eng.stats().draft_tokens_accepted_total == first + 1


@pytest.mark.parametrize("when", ["prefill", "decode"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "greedy-draft", "sampled-draft"])
def test_non_finite_logits_fail_only_their_sequence(make_engine, tiny_model, mode,
                                                    when) -> None:
    """NaN logits in one row (a bf16 overflow) used to fail every running request when that
    row sampled, and under greedy silently emitted the NaN's index. Only that sequence fails,
    with INTERNAL naming the cause; the rest of the batch is unaffected."""
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec

    eng = make_engine(max_batch_size=4)
    real = eng._forward

    def forward(ids, plan, keep=1, need=None):
        logits = real(ids, plan, keep, need).clone()
        p = eng._prefilling
        seqs = [p] if p is not None and plan.row0 == p.row else eng._decoding
        for i, s in enumerate(seqs):
            if s.req.request_id == "bad" and (s.generated == 0) == (when == "prefill"):
                if need is None:
                    logits[i] = float("nan")
                else:  # [sum(need), vocab]: row i's positions follow the rows before it
                    logits[sum(need[:i]):sum(need[:i + 1])] = float("nan")
        return logits

    eng._forward = forward
    pa, pb, pc = prompt(9, 70), prompt(11, 71), prompt(10, 72)
    ref_a = reference_greedy(tiny_model, pa, 10)
    ref_b, _ = generate(eng, pb, max_tokens=10, temperature=0.8, seed=5, ignore_eos=True)
    temp = 0.8 if mode.startswith("sampled") else 0.0
    ref_c = reference_greedy(tiny_model, pc, 10)
    # A draft that goes wrong at its third token: the sequence goes on decoding with drafts.
    draft = tuple(ref_c[:2] + [(ref_c[2] + 1) % TINY_VOCAB] + ref_c[3:]) \
        if mode.endswith("draft") else ()
    bad = EngineRequest("bad", pc, SamplingSpec(10, temperature=temp, seed=3, ignore_eos=True),
                        draft_token_ids=draft)
    with paused(eng):
        _, qa = eng.submit(request(pa, 10))
        _, qb = eng.submit(request(pb, 10, temperature=0.8, seed=5, ignore_eos=True))
        _, qc = eng.submit(bad)
    toks_c, fin_c = collect(qc)
    assert isinstance(fin_c, Failed), (toks_c, fin_c)
    assert fin_c.error.code == "INTERNAL" and "non-finite logits" in str(fin_c.error)
    assert (len(toks_c) == 0) == (when == "prefill")
    assert temp or toks_c == ref_c[:len(toks_c)]
    toks_a, fin_a = collect(qa)
    toks_b, fin_b = collect(qb)
    assert isinstance(fin_a, Finished) and toks_a == ref_a[:len(toks_a)]
    assert fin_a.finish_reason is FinishReason.EOS or len(toks_a) == 10
    assert isinstance(fin_b, Finished) and toks_b == ref_b


def test_a_sequence_failed_on_non_finite_values_leaves_its_row_usable(make_engine) -> None:
    """A request whose KV overflowed (inf, as bf16/fp16 can) failed alone, but its inf/NaN
    stayed in its working row beyond where the next sequences wrote: a shorter request on
    that row, batched with a longer one, read those masked positions (NaN + -inf = NaN,
    0 * inf = NaN) and failed with "non-finite logits" too, though it succeeds alone."""
    from tests.kvpool.conftest import make_tiny_model

    model = make_tiny_model()
    b, c = prompt(4, 3), prompt(40, 4)
    ref_b, ref_c = reference_greedy(model, b, 10), reference_greedy(model, c, 10)
    used = set(b) | set(c) | set(ref_b) | set(ref_c)
    poison = next(t for t in range(6, TINY_VOCAB) if t not in used)
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("inf")  # an overflowed activation
    eng = make_engine(max_batch_size=2, model=model, drafts=False)
    a = [t for t in prompt(10, 1) if t != poison] + [poison] + prompt(19, 2)
    toks_a, fin_a = collect(eng.submit(request(a, 4, rid="a"))[1])
    assert isinstance(fin_a, Failed) and "non-finite logits" in str(fin_a.error)
    assert torch.isfinite(eng.store.rows).all()
    with paused(eng):  # b on the row a used, batched with the longer c
        _, qb = eng.submit(request(b, 10, rid="b", ignore_eos=True, skip_prefix_cache=True))
        _, qc = eng.submit(request(c, 10, rid="c", ignore_eos=True))
    toks_b, fin_b = collect(qb)
    toks_c, fin_c = collect(qc)
    assert isinstance(fin_b, Finished) and isinstance(fin_c, Finished), (fin_b, fin_c)
    # The references stop at EOS; these requests go on past it.
    assert toks_b[:len(ref_b)] == ref_b and toks_c[:len(ref_c)] == ref_c


@pytest.mark.parametrize("kernels", ["torch", "onednn"])
def test_bfloat16_greedy_is_the_same_with_drafts_and_cached_prefixes(make_engine,
                                                                     kernels) -> None:
    """bfloat16 (the GPU deployment's dtype) keeps 8 bits of mantissa: the top two logits used
    to tie exactly at many positions, and a draft's verification or a cached prefix (other
    matmul shapes) broke the tie differently from plain decoding. Logits are now computed in
    float32 (no exact ties). The hidden states are still bfloat16 and shape-dependent, so a
    variant may still pick the other token where the top two are within one bfloat16 ulp; it
    must not differ anywhere else. Also on oneDNN's packed bfloat16 layers, where this CPU
    runs them (`linear.pack_linears`)."""
    from services.kvpool.linear import pack_linears
    from tests.kvpool.conftest import make_tiny_model

    model = make_tiny_model().to(torch.bfloat16)
    if kernels == "onednn" and pack_linears(model).kernels != "onednn":
        pytest.skip("oneDNN does not pack bfloat16 layers on this CPU")
    plain = make_engine(model=model, num_blocks=128, prefix_caching=False)
    cached = make_engine(model=model, num_blocks=128)
    assert plain.packing.kernels == cached.packing.kernels == kernels
    seen: list[torch.Tensor] = []
    real = plain._forward

    def forward(ids, plan, keep=1, need=None):
        logits = real(ids, plan, keep, need)
        if need is None:  # the reference answers (no draft): [B, keep, vocab]
            seen.append(logits[0, -1].clone())
        return logits

    plain._forward = forward
    rng = random.Random(5)
    n, ties, near = 30, 0, 0
    for i in range(10):
        p = prompt(rng.randrange(5, 40), 100 + i)
        seen.clear()
        ref, _ = generate(plain, p, max_tokens=n, ignore_eos=True)
        ref_logits = seen[-n:]  # one forward per token: the last prefill chunk, then decodes
        assert ref_logits[0].dtype == torch.float32
        top2 = [torch.topk(lg, 2).values.tolist() for lg in ref_logits]
        ties += sum(a == b for a, b in top2)
        generate(cached, p, max_tokens=n, ignore_eos=True)  # caches the prompt and answer
        for name, toks in (
                ("draft", generate(plain, p, max_tokens=n, ignore_eos=True, draft=ref)[0]),
                ("cached", generate(cached, p, max_tokens=n, ignore_eos=True)[0]),
                ("cached+draft", generate(cached, p, max_tokens=n, ignore_eos=True,
                                          draft=ref)[0])):
            if toks == ref:
                continue
            k = next(j for j in range(n) if toks[j] != ref[j])
            a, b = top2[k]
            ulp = 2.0 ** (math.floor(math.log2(abs(a))) - 7)
            assert a - b <= ulp, (i, name, k, a, b)
            near += 1
    assert ties == 0  # bfloat16 logits tied exactly at several positions here
    assert near <= 6  # a rare near-tie, not a systematic difference


@pytest.mark.parametrize("with_draft", [False, True])
def test_a_seeded_answer_resumed_elsewhere_continues_its_randomness(make_engine,
                                                                    with_draft) -> None:
    """A failover resumes on another replica with prompt + generated and the same seed. The
    sampler used to restart the seed's random stream at the first resumed token (copying the
    randomness of the answer's first tokens); with seed_offset = tokens already generated,
    draw n depends on (seed, n) only, so the resumed answer is the uninterrupted one."""
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec

    p = prompt(12, 80)
    sp = dict(temperature=0.8, seed=1234, ignore_eos=True)
    n = 20
    full, _ = generate(make_engine(), p, max_tokens=n, **sp)
    eng = make_engine()
    for k in (1, 8, 13):
        draft = tuple(full[k:]) if with_draft else ()
        spec = SamplingSpec(n - k, seed_offset=k, **sp)
        rest, fin = collect(eng.submit(EngineRequest(f"resume-{k}", p + full[:k], spec,
                                                     draft_token_ids=draft))[1])
        assert isinstance(fin, Finished) and full[:k] + rest == full, k
        if with_draft:
            assert fin.draft_tokens_accepted > 0
    # The seed still matters.
    other, _ = generate(eng, p, max_tokens=n, **{**sp, "seed": 4321})
    assert other != full


def test_the_float32_head_is_for_plain_half_precision_heads_only(tiny_model) -> None:
    """Soft-capped (or otherwise post-processed) logits are not lm_head(hidden): such models
    keep their own forward (with .float() on its logits); a float32 model's head is used as it
    is (no copy)."""
    import copy

    import torch

    from services.kvpool.engine import fp32_head

    own = fp32_head(tiny_model)  # float32 already: its own weight, not a copy
    assert own is not None and own.weight.data_ptr() == tiny_model.lm_head.weight.data_ptr()
    half = copy.deepcopy(tiny_model).to(torch.bfloat16)
    got = fp32_head(half)
    assert got is not None and got.weight.dtype == torch.float32
    half.config.final_logit_softcapping = 30.0
    assert fp32_head(half) is None


def test_each_token_of_a_seeded_answer_gets_its_own_randomness() -> None:
    """Token n is drawn from (seed, n): were the index ignored, every token would reuse the
    first one's random numbers (a uniform distribution then gives one token over and over)."""
    import torch

    from services.kvpool.sampling import Sampler, SamplingSpec, draw_seed

    assert draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 1)
    s = Sampler(SamplingSpec(max_tokens=20, temperature=1.0, seed=7))
    assert len({s.sample(torch.zeros(1000)) for _ in range(20)}) > 5


def test_a_failed_step_names_the_sequences_it_fails_and_is_counted(make_engine, caplog,
                                                                   tiny_model) -> None:
    """The engine thread has no request id: 'engine step failed' named no request, so the
    clients' INTERNAL could not be traced to the traceback, and no metric counted it."""
    import logging

    eng = make_engine(num_blocks=200, max_batch_size=2)
    real = eng._decode_step
    broken = threading.Event()

    def once() -> None:
        if not broken.is_set():
            broken.set()
            raise RuntimeError("device lost")
        real()

    eng._decode_step = once
    with caplog.at_level(logging.ERROR, logger="services.kvpool"):
        _, fin = collect(eng.submit(request(prompt(12), max_tokens=8, rid="trace-me"))[1])
    assert isinstance(fin, Failed) and fin.error.code == "INTERNAL"
    failed = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert failed and "trace-me#" in failed[0].getMessage()
    assert eng.step_failures_total == 1
    toks, fin = collect(eng.submit(request(prompt(12), max_tokens=4))[1])  # the engine goes on
    assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, prompt(12), 4)
    assert_idle(eng)


def test_a_row_copy_that_fails_while_a_sequence_leaves_fails_the_batch_not_the_engine(
        make_engine, tiny_model) -> None:
    """Cancelling a decoding sequence copies the last row down. When that copy raised, the
    moved sequence sat in no row (never stepped, never answered) and the leaving one kept
    decoding unseen; every step after failed, for good, while health said SERVING."""
    eng = make_engine(num_blocks=64, max_batch_size=4)
    outs = [eng.submit(request(prompt(7, seed=i), max_tokens=200, ignore_eos=True,
                               rid=f"r{i}")) for i in range(3)]
    with paused(eng):
        pass
    for _, out in outs:  # all three decoding
        out.get(timeout=30)
    real, calls = eng.store.move_row, []

    def flaky(*a):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("device error in move_row")
        return real(*a)

    eng.store.move_row = flaky
    eng.cancel(outs[0][0])  # row 0 leaves: the last row is copied into it, and raises
    ends = [collect(out)[1] for _, out in outs]
    assert calls and isinstance(ends[0], Failed) and ends[0].error.code == "CANCELLED"
    assert all(isinstance(f, Failed) and f.error.code == "INTERNAL" for f in ends[1:])
    toks, fin = collect(eng.submit(request(prompt(12), max_tokens=4))[1])
    # The engine goes on, with exact answers (no row left holding another sequence's KV).
    assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, prompt(12), 4)
    assert_idle(eng)
    assert eng.step_failures_total == 1


def test_an_engine_whose_model_steps_keep_failing_reads_as_stalled(make_engine,
                                                                   tiny_model) -> None:
    """The stall watch saw only steps that never ended; an engine failing every model step
    turned on and on, serving nobody, and health stayed SERVING. Idle turns between requests
    (a second apart) must not count as progress either."""
    eng = make_engine(num_blocks=64)
    real = eng._decode_step

    def broken() -> None:
        raise RuntimeError("device lost")

    eng._decode_step = broken
    deadline = time.monotonic() + 60
    while eng.step_failures_total < 4:  # requests a while apart, each failing
        _, fin = collect(eng.submit(request(prompt(8), max_tokens=4))[1])
        assert isinstance(fin, Failed) and time.monotonic() < deadline
        time.sleep(0.6)  # idle turns in between
    assert eng.stalled_for() >= 0.6
    # Not stuck, though: the loop turns (what the orchestrator's routing reads, so an idle
    # replica whose steps failed is not held out of routing until a step succeeds there).
    # (The idle loop turns every ~0.5 s: allow a loaded machine's late wake-up.)
    wait_until(lambda: eng.stuck_for() < 0.6, deadline - time.monotonic(),
               lambda: f"stuck for {eng.stuck_for():.2f} s", every=0.05)
    eng._decode_step = real
    toks, fin = collect(eng.submit(request(prompt(8), max_tokens=4))[1])
    assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, prompt(8), 4)
    wait_until(lambda: eng.stalled_for() < 0.6,  # a model step went through: progress again
               deadline - time.monotonic(), lambda: f"stalled for {eng.stalled_for():.2f} s",
               every=0.05)


def test_a_row_copy_failing_while_a_failed_batch_is_failed_fails_the_rest_too(
        make_engine) -> None:
    """Failing a batch stopped at the first row copy that raised: the other sequences
    decoded on, one on a row whose KV was never copied in, and finished as if all were
    well."""
    eng = make_engine(num_blocks=64, max_batch_size=4)
    outs = [eng.submit(request(prompt(7, seed=i), max_tokens=200, ignore_eos=True,
                               rid=f"r{i}")) for i in range(3)]
    for _, out in outs:
        out.get(timeout=30)  # all three decoding
    real_step, real_move = eng._decode_step, eng.store.move_row
    broken = []

    def step_once() -> None:
        if not broken:
            broken.append(1)
            eng.store.move_row = move_once
            raise RuntimeError("device error in a step")
        real_step()

    def move_once(*a):
        eng.store.move_row = real_move
        raise RuntimeError("device error in move_row")

    eng._decode_step = step_once
    ends = [collect(out)[1] for _, out in outs]
    assert all(isinstance(f, Failed) and f.error.code == "INTERNAL" for f in ends), ends
    assert_idle(eng)


def test_a_stopped_engine_refuses_requests_instead_of_queueing_them_for_nobody(
        make_engine) -> None:
    """A request queued after the loop's last drain was never answered: its handler waited
    for the client's deadline, or for good without one."""
    eng = make_engine(num_blocks=64)
    eng.stop()
    with pytest.raises(errors.Unavailable, match="shutting down"):
        eng.submit(request(prompt(8), max_tokens=2))
    with pytest.raises(errors.Unavailable):
        eng.call(lambda: None).result(5)


def test_a_forwards_positions_are_built_once(make_engine) -> None:
    """The model's position ids, the attention mask and the KV writes all use the plan's
    positions; each build copies the start list to the device (a sync on CUDA), and it used to
    be built three times per forward."""
    from services.kvpool.paged_cache import ForwardPlan

    eng = make_engine()
    cache = eng.cache
    with paused(eng):
        cache.begin(ForwardPlan(0, [3, 5], 2))
        pos = cache.position_ids()
        assert cache.position_ids() is pos and cache.index_tensors()[1] is pos
        assert pos.tolist() == [[3, 4], [5, 6]]
        cache.begin(ForwardPlan(0, [7], 1))
        assert cache.position_ids().tolist() == [[7]]


def test_time_between_building_an_engine_and_starting_it_is_not_a_stall(tiny_model) -> None:
    """A replica times draft forwards between building its engine and starting it (~16 s on
    SmolLM2): Stats read that time as a stall until the engine's first turn ended."""
    from services.common.hashing import BlockHasher
    from services.kvpool.block_pool import BlockPool
    from services.kvpool.engine import Engine, model_info

    eng = Engine(tiny_model, model_info(tiny_model, TINY_ID),
                 BlockPool(16, 4, BlockHasher(TINY_ID, 4, key=b"k")))
    time.sleep(1.2)
    eng.start()
    try:
        assert eng.stuck_for() < 1.0 and eng.stalled_for() < 1.0
    finally:
        eng.stop()
