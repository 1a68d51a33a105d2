"""Draft verification in the engine (tiny random Llama): exactness, rollback, statistics."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator

import pytest
import torch

from services.kvpool.engine import EngineRequest, Finished
from services.kvpool.sampling import SamplingSpec
from tests.kvpool.conftest import TINY_VOCAB, assert_idle, collect, prompt, reference_greedy
from tests.kvpool.test_kvpool_engine import paused

N_NEW = 40


def run(eng, tokens: list[int], draft: list[int], max_tokens: int = N_NEW, rid: str = "r",
        **sampling) -> tuple[list[int], Finished]:
    sampling.setdefault("ignore_eos", True)
    req = EngineRequest(rid, list(tokens), SamplingSpec(max_tokens=max_tokens, **sampling),
                        draft_token_ids=tuple(draft))
    toks, fin = collect(eng.submit(req)[1])
    assert isinstance(fin, Finished), fin
    return toks, fin


@contextlib.contextmanager
def checking_integrity(eng) -> Iterator[list[BaseException]]:
    """Checks the engine's integrity (ref counts, free queue, hash table) between its steps,
    over and over while the block runs; yields the list of failures, filled by the end."""
    failures: list[BaseException] = []
    stop = threading.Event()

    def checker() -> None:
        while not stop.is_set():
            try:
                eng.call(eng.check_integrity).result(10)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                failures.append(exc)
                return

    th = threading.Thread(target=checker)
    th.start()
    try:
        yield failures
    finally:
        stop.set()
        th.join()


def other(t: int) -> int:
    return (t + 7) % (TINY_VOCAB - 1)


def drafts_for(ref: list[int]) -> dict[str, list[int]]:
    mid = len(ref) // 2
    return {
        "perfect": list(ref),
        "one_word": ref[:mid] + [other(ref[mid])] + ref[mid + 1:],
        "inserted_word": ref[:mid] + [other(ref[mid])] + ref[mid:],
        "nothing_shared": [t for t in prompt(60, 99) if t not in ref] or [1],
        "longer_than_answer": ref + prompt(30, 98),
    }


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_with_any_draft_is_token_identical(make_engine, tiny_model, seed) -> None:
    eng = make_engine(num_blocks=64, block_size=4)
    p = prompt(13, seed)
    ref, base = run(eng, p, [])
    assert ref == reference_greedy(tiny_model, p, N_NEW)
    assert base.draft_tokens_proposed == 0 and base.forward_passes == N_NEW - 1
    for name, draft in drafts_for(ref).items():
        toks, fin = run(eng, p, draft, rid=name)
        assert toks == ref, name
        assert fin.draft_tokens_accepted <= fin.draft_tokens_proposed
        # Every forward emits >= 1 token, each accepted draft token saves one.
        assert fin.forward_passes == N_NEW - 1 - fin.draft_tokens_accepted, name
        if name in ("perfect", "longer_than_answer"):
            assert fin.draft_tokens_accepted == fin.draft_tokens_proposed >= N_NEW - 5
            assert fin.forward_passes <= 4
        if name in ("one_word", "inserted_word"):
            # Re-alignment: the part after the changed word is verified too.
            assert fin.draft_tokens_accepted >= N_NEW - 1 - 6, name
        if name == "nothing_shared":
            # Only the sequence's own context (prompt lookup) may have proposed usefully.
            assert fin.draft_tokens_accepted == fin.lookup_tokens_accepted
        assert_idle(eng)
    st = eng.stats()
    assert st.draft_tokens_proposed_total >= st.draft_tokens_accepted_total > 3 * (N_NEW - 8)


def test_stop_conditions_inside_an_accepted_run(make_engine, tiny_model) -> None:
    eng = make_engine()
    p = prompt(11, 3)
    ref, _ = run(eng, p, [], max_tokens=30)
    toks, fin = run(eng, p, ref, max_tokens=7)
    assert toks == ref[:7] and fin.completion_tokens == 7
    stop = ref[12]
    toks, fin = run(eng, p, ref, max_tokens=30, stop_token_ids=frozenset([stop]))
    assert toks == ref[:ref.index(stop) + 1]
    assert_idle(eng)


def test_rollback_keeps_the_pool_exact_at_every_step(make_engine, tiny_model) -> None:
    """Integrity (ref counts, free queue, hash table) is checked between every engine step
    while drafts with many rejections run; blocks are back to zero at the end."""
    eng = make_engine(num_blocks=48, block_size=2, max_batch_size=3)
    prompts = [prompt(9, 10 + i) for i in range(3)]
    refs = [reference_greedy(tiny_model, p, N_NEW) for p in prompts]
    bad = [[t if i % 5 else other(t) for i, t in enumerate(r)] for r in refs]  # 1 in 5 wrong
    with checking_integrity(eng) as failures:
        with paused(eng):
            outs = [eng.submit(EngineRequest(f"b{i}", p, SamplingSpec(N_NEW, ignore_eos=True),
                                             draft_token_ids=tuple(d)))[1]
                    for i, (p, d) in enumerate(zip(prompts, bad, strict=True))]
        res = [collect(o) for o in outs]
    assert not failures, failures
    for (toks, fin), ref in zip(res, refs, strict=True):
        assert toks == ref
        assert 0 < fin.draft_tokens_accepted < fin.draft_tokens_proposed
    assert_idle(eng)


def test_drafting_sequence_batched_with_plain_ones_and_prefix_reuse(make_engine,
                                                                    tiny_model) -> None:
    eng = make_engine(num_blocks=96, block_size=4, max_batch_size=4)
    system = prompt(20, 7)
    run(eng, system, [], max_tokens=1)  # caches the shared prefix
    prompts = [system + prompt(3 + i, 30 + i) for i in range(3)]
    refs = [reference_greedy(tiny_model, p, N_NEW) for p in prompts]
    with paused(eng):  # one drafting sequence and two plain ones decode in the same forwards
        outs = [eng.submit(EngineRequest(f"m{i}", p, SamplingSpec(N_NEW, ignore_eos=True),
                                         draft_token_ids=tuple(refs[0]) if i == 0 else ()))[1]
                for i, p in enumerate(prompts)]
    res = [collect(o) for o in outs]
    for i, ((toks, fin), ref) in enumerate(zip(res, refs, strict=True)):
        assert toks == ref, i
        assert fin.cached_tokens == 20
    assert res[0][1].draft_tokens_accepted == res[0][1].draft_tokens_proposed >= N_NEW - 5
    assert res[1][1].draft_tokens_proposed == 0
    # The drafted answer's blocks were committed: the next turn reuses them.
    follow = prompts[0] + refs[0] + [5, 6, 7]
    toks, fin = run(eng, follow, [], max_tokens=4)
    assert fin.cached_tokens >= (len(prompts[0]) + N_NEW) // 4 * 4 - 4
    assert toks == reference_greedy(tiny_model, follow, 4)
    assert_idle(eng)


def test_switches_per_request_and_per_engine(make_engine, tiny_model) -> None:
    p = prompt(10, 4)
    ref = reference_greedy(tiny_model, p, N_NEW)
    off = make_engine(drafts=False)
    toks, fin = run(off, p, ref)
    assert toks == ref and fin.draft_tokens_proposed == 0 and fin.forward_passes == N_NEW - 1
    on = make_engine(max_draft_tokens=3)
    toks, fin = run(on, p, ref)
    assert toks == ref and fin.draft_tokens_accepted == fin.draft_tokens_proposed > 0
    assert fin.forward_passes >= (N_NEW - 1) // 4 - 1  # at most 3 draft tokens per forward
    toks, fin = run(on, p, [])
    assert toks == ref and fin.draft_tokens_proposed == 0


def _chi2_pvalue(observed: list[int], probs: torch.Tensor, n: int) -> float:
    """Pearson chi-square p-value; bins with expectation < 5 are pooled."""
    exp = probs.double() * n
    big = exp >= 5
    obs = torch.tensor(observed, dtype=torch.float64)
    o = torch.cat([obs[big], obs[~big].sum().view(1)])
    e = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_sampling_distribution_after_a_rejection_is_the_models(make_engine, tiny_model) -> None:
    p = prompt(12, 5)
    with torch.no_grad():
        logits = tiny_model(torch.tensor([p])).logits[0, -1].double()
    temp = next(t for t in (0.85 ** k for k in range(200))
                if torch.softmax(logits / t, -1).max() >= 0.4)
    probs = torch.softmax(logits / temp, -1)
    d = int(probs.argmax())  # a draft token the model accepts often but not always
    eng = make_engine(num_blocks=256, block_size=4, max_batch_size=8)
    n = 1500
    firsts, rejected_firsts, accepted = [], [], 0
    for lo in range(0, n, 50):
        with paused(eng):
            outs = [eng.submit(EngineRequest(
                f"s{i}", p, SamplingSpec(2, temperature=temp, seed=i + 1, ignore_eos=True),
                skip_prefix_cache=True, draft_token_ids=(d,)))[1] for i in range(lo, lo + 50)]
        for o in outs:
            toks, fin = collect(o)
            assert fin.draft_tokens_proposed == 1
            firsts.append(toks[0])
            accepted += fin.draft_tokens_accepted
            if not fin.draft_tokens_accepted:
                rejected_firsts.append(toks[0])
    assert_idle(eng)
    pd = float(probs[d])
    # Acceptance happens with probability p(d) (binomial, 5 sigma).
    assert abs(accepted - n * pd) <= 5 * (n * pd * (1 - pd)) ** 0.5
    counts = [0] * TINY_VOCAB
    for t in firsts:
        counts[t] += 1
    assert _chi2_pvalue(counts, probs, n) > 1e-3
    # After a rejection: the residual distribution (p without d, renormalised), never d.
    residual = probs.clone()
    residual[d] = 0
    residual /= residual.sum()
    rcounts = [0] * TINY_VOCAB
    for t in rejected_firsts:
        rcounts[t] += 1
    assert rcounts[d] == 0
    assert _chi2_pvalue(rcounts, residual, len(rejected_firsts)) > 1e-3
    # Power check: the wrong rule (resample from p itself) is rejected by the same test.
    wrong = probs.clone()
    assert _chi2_pvalue(rcounts, wrong, len(rejected_firsts)) < 1e-3


def test_a_seed_samples_the_same_answer_with_or_without_a_draft(make_engine) -> None:
    """One draw per emitted token, as plain decoding makes: a seeded sampled request gives the
    same answer with no draft, with a draft (even its own answer), with a pool too tight for
    whole proposals, and next to another request."""
    p = prompt(12, 5)
    spec = dict(temperature=0.8, seed=1234, max_tokens=20)
    plain, _ = run(make_engine(num_blocks=64), p, [], **spec)
    assert run(make_engine(num_blocks=64), p, [], **spec)[0] == plain
    own = plain[:10]
    for name, draft, blocks in (("own answer", own, 64), ("own answer, tight pool", own, 9),
                                ("unrelated", prompt(20, 77), 64)):
        toks, fin = run(make_engine(num_blocks=blocks), p, draft, rid=name, **spec)
        assert toks == plain, name
        if name == "own answer":
            assert fin.draft_tokens_accepted == fin.draft_tokens_proposed == 10
    eng = make_engine(num_blocks=9)
    with paused(eng):
        other = eng.submit(EngineRequest("other", prompt(16, 1), SamplingSpec(
            max_tokens=8, ignore_eos=True)))[1]
        mine = eng.submit(EngineRequest("mine", p, SamplingSpec(ignore_eos=True, **spec),
                                        draft_token_ids=tuple(own)))[1]
    assert collect(mine)[0] == plain
    collect(other)


def test_filler_positions_stay_inside_the_context(make_engine) -> None:
    """A plain row near the context limit batched with a drafting row: the rows' common length
    must not push the plain row's filler past max_context (the working rows would grow)."""
    from tests.kvpool.conftest import make_tiny_model

    model = make_tiny_model(0, max_pos=64)
    eng = make_engine(num_blocks=64, model=model)
    assert eng.info.max_context == 64
    capacity = eng.store.capacity
    near_end, short = prompt(52, 1), prompt(8, 2)
    ref_b = reference_greedy(model, short, 30)
    with paused(eng):
        outs = [eng.submit(EngineRequest("a", near_end, SamplingSpec(12, ignore_eos=True)))[1],
                eng.submit(EngineRequest("b", short, SamplingSpec(30, ignore_eos=True),
                                         draft_token_ids=tuple(ref_b)))[1]]
    (a, fa), (b, fb) = (collect(o) for o in outs)
    assert b == ref_b and len(a) == 12
    assert fb.draft_tokens_accepted > 0
    assert eng.store.capacity == capacity
    # Proposals cut to the context are not withheld by the batch rule (off: no timing).
    assert eng.stats().draft_tokens_withheld_total == 0


def test_a_withdrawn_prefill_proposal_still_advances_the_draft(make_engine, tiny_model) -> None:
    """No room for a proposal on the prefill forward (another request holds the pool): the
    token that forward emits must move the draft on. Left behind, the next proposal repeats
    that token, is rejected at once, and the draft re-aligns on a short match with a small
    gamma: 3 forwards instead of 2 here."""
    short = prompt(9, 2)
    ref = reference_greedy(tiny_model, short, 12)
    eng = make_engine(num_blocks=8)
    with paused(eng):
        outs = [eng.submit(EngineRequest("a", prompt(16, 1), SamplingSpec(3, ignore_eos=True)))[1],
                eng.submit(EngineRequest("b", short, SamplingSpec(12, ignore_eos=True),
                                         draft_token_ids=tuple(ref)))[1]]
    collect(outs[0])
    toks, fin = collect(outs[1])
    assert toks == ref
    assert fin.draft_tokens_accepted == fin.draft_tokens_proposed  # a perfect draft
    assert fin.forward_passes == 11 - fin.draft_tokens_accepted <= 2


def test_max_draft_tokens_above_the_top_rung_proposes_longer(make_engine, tiny_model) -> None:
    p = prompt(13, 3)
    ref = reference_greedy(tiny_model, p, 50)
    passes = {}
    for top in (16, 32):
        toks, fin = run(make_engine(num_blocks=64, max_draft_tokens=top), p, ref,
                        max_tokens=50, rid=f"top{top}")
        assert toks == ref
        passes[top] = fin.forward_passes
    assert passes[32] < passes[16]


def test_a_batch_computes_logits_only_where_a_row_verifies(make_engine, tiny_model) -> None:
    """One drafting row pads every row of the forward to its proposal's length; only the
    drafting row's positions (and each plain row's one) need logits. The head used to run over
    every padded position: at batch 64 and 16 draft tokens, ~200 MB of float32 per step."""
    eng = make_engine(num_blocks=96, block_size=4, max_batch_size=4)
    prompts = [prompt(6 + i, 40 + i) for i in range(3)]
    refs = [reference_greedy(tiny_model, p, N_NEW) for p in prompts]
    computed: list[tuple[int, int]] = []  # (logit rows, batch x positions) per batched forward
    real_head = eng._head.logits
    real_forward = eng._forward

    def head(x):
        if computed and computed[-1][0] < 0:
            computed[-1] = (x.reshape(-1, x.shape[-1]).shape[0], computed[-1][1])
        return real_head(x)

    def forward(ids, plan, keep=1, need=None):
        if plan.batch > 1 and plan.q_len > 1:
            computed.append((-1, plan.batch * plan.q_len))
        return real_forward(ids, plan, keep, **({} if need is None else {"need": need}))

    eng._head = eng._head._replace(logits=head)
    eng._forward = forward
    with paused(eng):
        outs = [eng.submit(EngineRequest(f"m{i}", p, SamplingSpec(N_NEW, ignore_eos=True),
                                         draft_token_ids=tuple(refs[0]) if i == 0 else ()))[1]
                for i, p in enumerate(prompts)]
    res = [collect(o) for o in outs]
    assert [t for t, _ in res] == refs
    assert computed and all(0 < rows < padded for rows, padded in computed), computed
    assert_idle(eng)


def test_verify_batch_is_each_rows_verify() -> None:
    """Greedy and sampled rows, with and without drafts, checked together (one argmax, one copy
    to the CPU) give what each row's own `Sampler.verify` gives."""
    from services.kvpool.sampling import NonFiniteLogits, Sampler, verify_batch

    gen = torch.Generator().manual_seed(3)
    vocab = 50
    for trial in range(40):
        rng = random.Random(trial)
        specs, drafts = [], []
        for b in range(rng.randrange(1, 6)):
            temp = rng.choice([0.0, 0.0, 0.7, 1.3])
            specs.append(SamplingSpec(8, temperature=temp, top_p=rng.choice([1.0, 0.8]),
                                      seed=1000 * trial + b + 1))
            drafts.append([rng.randrange(vocab) for _ in range(rng.choice([0, 0, 1, 3, 6]))])
        logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, generator=gen) * 3
        for b, d in enumerate(drafts):  # drafts the greedy rows partly agree with
            at = sum(len(x) + 1 for x in drafts[:b])
            for j in range(rng.randrange(len(d) + 1)):
                d[j] = int(torch.argmax(logits[at + j]))
        if trial % 5 == 0:
            logits[rng.randrange(logits.shape[0])] = float("nan")
        got = verify_batch([Sampler(s) for s in specs], logits, drafts)
        at = 0
        for s, d, g in zip(specs, drafts, got, strict=True):
            try:
                want = Sampler(s).verify(logits[at:at + len(d) + 1], d)
            except NonFiniteLogits:
                want = "nan"
            assert (("nan" if isinstance(g, NonFiniteLogits) else g) == want), (trial, s, d)
            at += len(d) + 1


def test_finite_rows_is_isfinite_all_for_one_bad_value_anywhere() -> None:
    """`finite_rows` (two reductions) must flag exactly the rows `isfinite(...).all(-1)` flags:
    a single NaN, inf or -inf wherever it sits in the row (below the max too), and never a row
    of large finite values. verify_batch then fails such a greedy row even when the bad value
    is not where argmax points."""
    from services.kvpool.sampling import NonFiniteLogits, Sampler, finite_rows, verify_batch

    gen = torch.Generator().manual_seed(11)
    rng = random.Random(11)
    for trial in range(60):
        x = torch.randn(rng.randrange(1, 20), rng.choice([7, 50, 4096]), generator=gen) * 4
        if trial % 3 == 0:
            x *= 1e37  # huge but finite: no row may be flagged
        for _ in range(rng.randrange(0, 4)):
            x[rng.randrange(x.shape[0]), rng.randrange(x.shape[1])] = rng.choice(
                [float("nan"), float("inf"), float("-inf")])
        assert finite_rows(x).tolist() == torch.isfinite(x).all(dim=-1).tolist(), trial

    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0  # the argmax of every row
    logits[1, 8] = float("nan")
    logits[2, 0] = float("-inf")
    got = verify_batch([Sampler(SamplingSpec(4)) for _ in range(3)], logits, [[], [], []])
    assert got[0] == (0, 4)
    assert isinstance(got[1], NonFiniteLogits) and isinstance(got[2], NonFiniteLogits)


def test_sampled_rows_leave_the_device_in_one_copy() -> None:
    """Seeded generators draw on the CPU; each sampled row's logits used to be copied there on
    its own (a device synchronisation per row and per draft position on CUDA). `Device` stands
    for logits on an accelerator: it counts the copies made from it."""
    from services.kvpool.sampling import Sampler, sample_batch, verify_batch

    class Device(torch.Tensor):
        copies = 0

        def cpu(self, *a, **kw):
            Device.copies += 1
            return torch.Tensor.cpu(self.as_subclass(torch.Tensor), *a, **kw)

    samplers = [Sampler(SamplingSpec(8, temperature=0.9, seed=i + 1)) for i in range(4)]
    got = verify_batch(samplers, torch.randn(8, 30).as_subclass(Device), [[1, 2, 3], [], [4], []])
    assert len(got) == 4 and all(isinstance(r, tuple) for r in got)
    assert Device.copies == 1
    Device.copies = 0
    samplers = [Sampler(SamplingSpec(8, temperature=0.9, seed=i + 1)) for i in range(4)]
    assert len(sample_batch(samplers, torch.randn(4, 30).as_subclass(Device))) == 4
    assert Device.copies == 1


def test_an_answer_ending_on_a_draft_stop_token_saves_one_pass_fewer(make_engine, tiny_model):
    """What CacheReport.draft_tokens_accepted documents: accepted tokens are the draft tokens
    in the answer; each saved a forward pass, but where the answer ends on one (a stop token
    the draft has too) the forward that accepted the last run emitted no token of its own."""
    p = prompt(6, 3)
    eng = make_engine()
    ans, _ = run(eng, p, [], max_tokens=10)
    stop = ans[3]
    if stop in ans[:3]:
        pytest.skip("the stop token occurs earlier")
    plain, fp = run(eng, p, [], max_tokens=10, stop_token_ids=frozenset([stop]))
    before = eng.draft_tokens_accepted_total
    toks, fd = run(eng, p, ans, max_tokens=10, stop_token_ids=frozenset([stop]))
    assert toks == plain == ans[:4]
    # The replica's total (Stats, and the metric) counts the same 4, not the whole verified
    # run past the stop.
    assert eng.draft_tokens_accepted_total - before == fd.draft_tokens_accepted
    assert fp.forward_passes == len(plain) - 1
    assert fd.draft_tokens_accepted == 4 and fd.forward_passes == 0
    assert fd.forward_passes == len(toks) - fd.draft_tokens_accepted  # not len - 1 - accepted
    assert_idle(eng)
