"""Rules of the engine that a mutation audit found unguarded: what its stats say and when,
the codes its refusals carry, and what it counts. A second round (draft verification, trees,
costs, scheduling) added: a prefill preempted before warm-up pins yield, the batch rule
leaving a lone sequence alone, every tree node counted as proposed and every forward's tokens
as computed, served costs learnt from one-row steps only, blocks of a proposal refused for
memory given back at once, a withheld proposal not learnt as rejected, max_draft_tokens
bounding every forward, accepted draft tokens committed, a cached pure prefill computing
nothing, skip_prefix_cache, waiting slots freed by requests that end unadmitted, and the
draft's guesses after a replaced token verified as a tree. The engine is stepped by hand
(as in test_contracts) where the moment matters."""

from __future__ import annotations

import pytest
import torch

from services.common import errors
from services.kvpool.block_pool import PoolExhausted
from services.kvpool.engine import EngineRequest, Failed, Finished
from services.kvpool.sampling import SamplingSpec
from tests.kvpool.conftest import collect, reference_greedy, request
from tests.kvpool.test_contracts import (
    alone_out_of_blocks,
    by_hand,
    drive,
    no_memory_for_proposals,
    prompt,
)
from tests.waits import wait_until


def test_a_finished_requests_stats_are_out_before_its_result(make_engine) -> None:
    """Stats are computed before the result is put out: a caller who sees a request end sees
    its row and blocks released in stats() at once, not after the engine's next turn."""
    eng = make_engine(num_blocks=32, max_batch_size=1)
    by_hand(eng)
    _, out = eng.submit(request(prompt(6, 1), 6, rid="a", ignore_eos=True))
    _, waiting = eng.submit(request(prompt(6, 2), 2, rid="b"))
    eng._drain_inbox(block=False)
    eng._step()  # "a" prefills and takes the only row; "b" waits
    eng._publish_state()
    st = eng.stats()
    assert (st.running, st.waiting) == (1, 1) and st.blocks_in_use > 0
    while out.empty() or not isinstance(out.queue[-1], Finished):
        eng._step()  # no _publish_state: only finishing may update the stats
    st = eng.stats()
    assert (st.running, st.waiting, st.requests_total) == (0, 1, 1)
    assert st.blocks_in_use == 0
    drive(eng, [], lambda e: None)  # "b" too


def test_a_request_too_big_for_the_pool_is_told_its_figures_and_what_would_fit(
        make_engine) -> None:
    """"prompt + max_tokens need 7 KV blocks" said neither part: a caller could not tell
    whether to cut its prompt or its max_tokens, nor by how much (nor the orchestrator say
    which was its default). The refusal names both and the largest max_tokens that fits, or
    that the prompt alone is too long; nothing is queued."""
    import pytest

    eng = make_engine(num_blocks=4, block_size=4)  # 16 tokens
    with pytest.raises(errors.ResourceExhausted) as ei:
        eng.submit(request(prompt(10, 1), 8))
    assert str(ei.value) == ("token_ids: prompt (10 tokens) + sampling.max_tokens (8) need 5 KV "
                             "blocks, the pool has 4; sampling.max_tokens of at most 7 fits")
    with pytest.raises(errors.ResourceExhausted) as ei:
        eng.submit(request(prompt(17, 1), 1))
    assert str(ei.value) == ("token_ids: prompt (17 tokens) + sampling.max_tokens (1) need 5 KV "
                             "blocks, the pool has 4; the prompt alone is too long for it")
    _, out = eng.submit(request(prompt(10, 1), 7))  # what it said fits, fits
    assert eng.stats().waiting + eng.stats().running <= 1
    collect(out, timeout=30)


def test_a_pool_that_cannot_take_a_request_refuses_new_ones_for_good_streamed_ones_as_busy(
        make_engine, monkeypatch) -> None:
    """With nothing running to free blocks, a new request is RESOURCE_EXHAUSTED ("never fits
    a replica of this size", not Overloaded), while a preempted answer that cannot get back
    in is Overloaded: it may still finish on another replica."""
    eng = make_engine(num_blocks=32)
    by_hand(eng)
    _, streamed = eng.submit(request(prompt(6, 3), 8, rid="s", ignore_eos=True))
    eng._drain_inbox(block=False)
    eng._step()  # prefilled and decoding: tokens went out
    (seq,) = eng._decoding
    eng._preempt(seq)
    _, new = eng.submit(request(prompt(6, 4), 8, rid="n"))

    def exhausted(*a, **kw):
        raise PoolExhausted("no blocks")

    monkeypatch.setattr(eng.pool, "open", exhausted)
    eng._drain_inbox(block=False)
    eng._step()
    toks, fin = collect(streamed, timeout=1)
    assert toks and isinstance(fin, Failed) and isinstance(fin.error, errors.Overloaded)
    _, fin = collect(new, timeout=1)
    assert isinstance(fin, Failed) and isinstance(fin.error, errors.ResourceExhausted)
    assert not isinstance(fin.error, errors.Overloaded)


def test_the_engine_reads_as_stalled_from_the_third_failed_model_step_in_a_row(
        make_engine) -> None:
    """STALL_AFTER_FAILURES (3) model steps failed in a row make the engine read as stalled;
    two do not (idle turns after them still count as progress)."""
    import time

    from services.kvpool.engine import STALL_AFTER_FAILURES

    eng = make_engine(num_blocks=64)

    def broken() -> None:
        raise RuntimeError("device lost")

    eng._decode_step = broken
    for i in range(STALL_AFTER_FAILURES):
        if i == STALL_AFTER_FAILURES - 1:  # not stalled yet: an idle turn counts
            wait_until(lambda: eng.stalled_for() < 0.3, 10, "two failed steps read as a stall",
                       every=0.05)
        _, fin = collect(eng.submit(request(prompt(8, 5), 4))[1])
        assert isinstance(fin, Failed)
    assert eng.step_failures_total == STALL_AFTER_FAILURES
    time.sleep(1.2)  # idle turns (every ~0.5 s) no longer count
    assert eng.stalled_for() >= 1.0


def test_an_answer_decoding_alone_that_runs_out_of_blocks_ends_as_busy(make_engine,
                                                                      monkeypatch) -> None:
    """The only decoding answer cannot get a block for its next token and nothing else can
    give one back: it ends Overloaded (another replica may finish it), its blocks freed."""
    eng = make_engine(num_blocks=32)
    by_hand(eng)
    toks, fin = alone_out_of_blocks(eng, monkeypatch, prompt(6, 6))
    assert toks and isinstance(fin, Failed) and isinstance(fin.error, errors.Overloaded)
    assert "while decoding" in str(fin.error) and eng.pool.stats().in_use == 0


def test_a_request_queued_during_the_engines_last_turn_is_answered(make_engine) -> None:
    """A request submitted after the loop's last drain of its inbox, but before the engine
    closed, is drained once more at the end and answered Unavailable (not left queued for
    nobody, its caller waiting for good)."""
    import threading

    eng = make_engine()
    entered, gate = threading.Event(), threading.Event()
    real = eng._publish_state

    def publish_state() -> None:  # the end of a turn: its inbox drained already
        entered.set()
        gate.wait(10)
        real()

    eng._publish_state = publish_state
    assert entered.wait(10)
    eng._stop.set()  # as stop() does; this turn is the last
    _, out = eng.submit(request(prompt(6, 7), 2))
    gate.set()
    eng._thread.join(10)
    _, fin = collect(out, timeout=5)
    assert isinstance(fin, Failed) and isinstance(fin.error, errors.Unavailable)


def test_an_answer_ends_when_it_fills_the_context(make_engine) -> None:
    """An answer ends LENGTH when prompt and answer fill the model's context, whatever
    max_tokens still allows: a token past it has no position."""
    from services.kvpool.engine import FinishReason
    from tests.kvpool.conftest import make_tiny_model

    model = make_tiny_model(0, max_pos=64)
    eng = make_engine(num_blocks=64, model=model, drafts=False)
    toks, fin = collect(eng.submit(request(prompt(60, 8), 10, ignore_eos=True))[1])
    assert isinstance(fin, Finished) and fin.finish_reason is FinishReason.LENGTH
    assert len(toks) == fin.completion_tokens == 4


def test_a_preempted_answer_goes_back_ahead_of_requests_that_never_ran(make_engine,
                                                                      tiny_model) -> None:
    """A preempted sequence returns to the head of the queue: it has streamed part of its
    answer, and behind requests that never ran it would wait for them all (its caller's
    stream stalled mid-answer). Every answer stays exact."""
    # As test_contracts' preemption test: two answers of 20 + 24 tokens do not both fit 14
    # blocks of 4; a third request waits for a row throughout.
    eng = make_engine(num_blocks=14, max_batch_size=2, max_prefill_chunk=32)
    by_hand(eng)
    reqs = [request(prompt(20, 20), 24, rid="a"), request(prompt(20, 21), 24, rid="b"),
            request(prompt(8, 22), 4, rid="c")]
    queues: list[list[str]] = []

    def record(e) -> None:
        if any(s.admitted_once for s in e._waiting) and not queues:
            queues.append([s.req.request_id for s in e._waiting])

    res = drive(eng, reqs, record)
    assert queues == [["b", "c"]]  # "b" preempted, ahead of "c"
    for r, (toks, _) in zip(reqs, res, strict=True):
        assert toks == reference_greedy(tiny_model, list(r.token_ids), r.sampling.max_tokens)



def test_a_preempted_answer_counts_the_forward_that_resumes_it_as_a_decoding_pass(
        make_engine, tiny_model) -> None:
    """forward_passes counts the forwards that emitted an answer's tokens after its first
    (CacheReport: completion - 1 - draft_tokens_accepted). A preempted answer's recompute
    emits its next token as a decode step would: uncounted, an answer with no draft reported
    fewer passes than tokens - 1, and the orchestrator counted the difference as passes that
    drafts saved (forward_passes_saved_total)."""
    eng = make_engine(num_blocks=14, max_batch_size=2, max_prefill_chunk=32)
    by_hand(eng)
    reqs = [request(prompt(20, 20), 24, rid="a", ignore_eos=True),
            request(prompt(20, 21), 24, rid="b", ignore_eos=True)]
    res = drive(eng, reqs, lambda e: None)
    assert eng.preemptions_total >= 1
    for r, (toks, fin) in zip(reqs, res, strict=True):
        assert toks == reference_greedy(tiny_model, list(r.token_ids), r.sampling.max_tokens)
        assert fin.draft_tokens_accepted == 0
        assert fin.forward_passes == fin.completion_tokens - 1, (r.request_id, fin)

# ---- a second round: draft verification, trees, costs, scheduling ---------------------------

def test_a_prefill_is_preempted_before_warm_up_pins_yield_to_a_decoding_answer(
        make_engine, tiny_model) -> None:
    """Short of a block for a decoding answer, a newer sequence still prefilling (it holds its
    whole prompt's blocks, and has streamed nothing) is preempted at once: warm-up pins yield
    only for decoding answers. Both answers stay exact."""
    eng = make_engine(num_blocks=8, max_batch_size=2, max_prefill_chunk=2, drafts=False)
    by_hand(eng)
    warm = EngineRequest("warm", prompt(8, 60), SamplingSpec(max_tokens=0), prefill_only=True,
                         pin_ttl_seconds=600)
    ((_, wfin),) = drive(eng, [warm], lambda e: None)
    assert wfin.pinned_blocks == 2
    a, b = prompt(4, 61), prompt(16, 62)
    _, out_a = eng.submit(request(a, 12, rid="a", ignore_eos=True))
    eng._drain_inbox(block=False)
    eng._step()
    eng._step()  # "a" prefilled (2 chunks) and decoding: 2 blocks
    assert [s.req.request_id for s in eng._decoding] == ["a"]
    _, out_b = eng.submit(request(b, 4, rid="b", ignore_eos=True))
    eng._drain_inbox(block=False)
    seen = []
    for _ in range(6):
        eng._step()
        eng.check_integrity()
        pre = eng._prefilling.req.request_id if eng._prefilling else None
        seen.append((pre, eng.preemptions_total, eng.pool.stats().pinned))
        if eng.preemptions_total or eng.pool.stats().pinned < 2:
            break
    # "a" needed its third block while "b" (4 blocks, 2 tokens a step) was still prefilling.
    assert seen[-1] == (None, 1, 2), seen
    drive(eng, [], lambda e: None)
    toks_a, fin_a = collect(out_a, timeout=1)
    toks_b, fin_b = collect(out_b, timeout=1)
    assert isinstance(fin_a, Finished) and toks_a == reference_greedy(tiny_model, a, 12)
    assert isinstance(fin_b, Finished) and toks_b == reference_greedy(tiny_model, b, 4)
    eng.pool.release_pins()


def test_a_sequence_decoding_alone_is_not_cut_by_the_batch_rule(make_engine, tiny_model) -> None:
    """The batch rule (`batch_keep`) cuts proposals only with several sequences decoding: one
    decoding alone verifies what its draft proposes (its lengths are chosen by cost already),
    even where steep costs would have a batch withhold them."""
    from services.kvpool.drafting import LadderChoice
    from tests.assisted.test_batch_gate import STEEP

    eng = make_engine(num_blocks=64, max_batch_size=4, batch_gate=True)
    eng.draft_ladder = LadderChoice((1, 2, 16), "measured", STEEP)
    p = prompt(9, 63)
    ref = reference_greedy(tiny_model, p, 30)
    draft = [t if i % 3 else (t + 7) % 127 for i, t in enumerate(ref)]  # 1 in 3 wrong
    toks, fin = collect(eng.submit(request(p, 30, ignore_eos=True, draft=draft))[1])
    assert isinstance(fin, Finished) and toks == ref
    assert fin.draft_tokens_proposed > fin.draft_tokens_accepted > 0
    assert eng.stats().draft_tokens_withheld_total == 0


def test_every_node_of_a_verified_tree_counts_as_a_proposed_draft_token(make_engine,
                                                                        tiny_model) -> None:
    """A tree forward's proposed draft tokens are all its nodes (the README: "every node
    counts as a proposed draft token"), not only the branch it followed: with the prompt in
    one forward, what the forwards computed beyond the prompt and each decode step's own token
    is what the answer reports proposed."""
    from tests.assisted.test_draft_tree import crafted

    eng = make_engine(num_blocks=64, block_size=4, max_prefill_chunk=32)
    widths: list[int] = []
    forward = eng._forward

    def counting(ids, plan, *a, **kw):
        widths.append(ids.shape[0] * ids.shape[1])
        return forward(ids, plan, *a, **kw)

    eng._forward = counting
    p = prompt(13, 4)
    ref = reference_greedy(tiny_model, p, 40)
    toks, fin = collect(eng.submit(request(p, 40, ignore_eos=True, draft=crafted(ref)[0]))[1])
    assert isinstance(fin, Finished) and toks == ref
    st = eng.stats()
    assert st.draft_tree_forwards_total >= 1 and st.draft_tree_branch_wins_total >= 1
    assert len(widths) == 1 + fin.forward_passes
    assert fin.draft_tokens_proposed == sum(widths) - len(p) - fin.forward_passes
    # ... and everything those forwards computed is the answer's computed tokens.
    assert fin.computed_tokens == sum(widths)


def test_served_costs_learn_from_steps_of_one_sequence_only(make_engine, tiny_model) -> None:
    """`learn_costs` times the steps of a sequence decoding alone (what the timing measured:
    one row); a step of several rows costs what their rows together do, and taught as a
    one-row cost it would skew every later choice by cost."""
    from services.kvpool.drafting import LadderChoice
    from tests.assisted.test_batch_gate import STEEP
    from tests.kvpool.test_kvpool_engine import paused

    eng = make_engine(num_blocks=128, max_batch_size=4, drafts=False)
    eng.draft_ladder = LadderChoice((1, 2, 16), "measured", STEEP)
    rows_when_taught: list[int] = []
    observe = eng.served_costs.observe

    def watched(q: int, seconds: float) -> None:
        rows_when_taught.append(len(eng._decoding))
        observe(q, seconds)

    eng.served_costs.observe = watched
    prompts = [prompt(6, 64), prompt(6, 65)]
    with paused(eng):
        outs = [eng.submit(request(p, 20, rid=f"b{i}", ignore_eos=True))[1]
                for i, p in enumerate(prompts)]
    for p, out in zip(prompts, outs, strict=True):
        toks, fin = collect(out)
        assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, p, 20)
    assert rows_when_taught and max(rows_when_taught) <= 1, rows_when_taught


def test_a_proposal_refused_for_memory_gives_its_blocks_back_in_the_same_step(
        make_engine, tiny_model, monkeypatch) -> None:
    """No memory to grow the rows for a draft's proposal: the answer decodes without it, and
    the pool blocks reserved for the proposal are given back at once (between two steps a
    sequence holds blocks for its computed tokens only), not when the answer ends."""
    eng = make_engine(num_blocks=64, block_size=2)
    by_hand(eng)
    refused = no_memory_for_proposals(eng, monkeypatch)
    a = prompt(7, 66)
    want = reference_greedy(tiny_model, a, 12)
    # drive checks integrity (blocks held against tokens computed) after every step.
    ((toks, fin),) = drive(eng, [request(a, 12, ignore_eos=True, draft=want)], lambda e: None)
    assert toks == want and len(refused) > 1 and fin.draft_tokens_proposed == 0


def test_a_proposal_the_batch_withheld_is_not_learned_as_rejected(make_engine,
                                                                  tiny_model) -> None:
    """A proposal the batch rule cut to nothing was never verified: the draft forgets it
    (`Draft.trim`), not counts it as a proposal that failed. A draft of the answer withheld
    while two plain rows decode beside it still proposes long once it decodes alone."""
    from services.kvpool.drafting import LadderChoice
    from tests.assisted.test_batch_gate import STEEP
    from tests.kvpool.test_kvpool_engine import paused

    # Costs as timed (not as served, which vary from run to run).
    eng = make_engine(num_blocks=128, max_batch_size=4, learn_costs=False)
    eng.draft_ladder = LadderChoice((1, 2, 16), "measured", STEEP)
    prompts = [prompt(6 + i, 67 + i) for i in range(3)]
    ref = reference_greedy(tiny_model, prompts[0], 48)
    with paused(eng):
        outs = [eng.submit(request(p, 48 if i == 0 else 12, rid=f"w{i}", ignore_eos=True,
                                   draft=ref if i == 0 else ()))[1]
                for i, p in enumerate(prompts)]
    (toks, fin), *rest = [collect(o) for o in outs]
    assert toks == ref and all(isinstance(f, Finished) for _, f in rest)
    assert eng.stats().draft_tokens_withheld_total > 0
    assert fin.forward_passes <= 17, fin  # 15; 20 when each withheld step counted as a miss


def test_max_draft_tokens_bounds_every_forward_whatever_the_ladder(make_engine,
                                                                   tiny_model) -> None:
    """max_draft_tokens is the most draft tokens one forward verifies (gamma's bound), also
    where the ladder the engine is given has a longer rung: a perfect draft of 30 tokens is
    verified at most 3 at a time, in the prefill's forward and every decode step."""
    from services.kvpool.drafting import LadderChoice

    eng = make_engine(num_blocks=64, max_prefill_chunk=32, max_draft_tokens=3,
                      draft_ladder=LadderChoice((1, 2, 16), "configured"))
    widths: list[int] = []
    forward = eng._forward

    def counting(ids, plan, *a, **kw):
        widths.append(ids.shape[1])
        return forward(ids, plan, *a, **kw)

    eng._forward = counting
    p = prompt(9, 70)
    ref = reference_greedy(tiny_model, p, 30)
    toks, fin = collect(eng.submit(request(p, 30, ignore_eos=True, draft=ref))[1])
    assert isinstance(fin, Finished) and toks == ref
    assert fin.draft_tokens_accepted == fin.draft_tokens_proposed > 0
    assert widths[0] <= len(p) + 3 and max(widths[1:]) <= 1 + 3, widths


def test_an_answer_verified_from_a_draft_leaves_all_its_full_blocks_cached(make_engine,
                                                                           tiny_model) -> None:
    """Accepted draft tokens are committed with the answer: a next turn that repeats prompt
    and answer reuses every full block of them (all but the last token have their KV), as it
    does after an answer decoded token by token."""
    eng = make_engine(num_blocks=64, max_prefill_chunk=64)
    for n, seed in ((21, 71), (26, 72), (30, 73)):
        p = prompt(9, seed)
        ref = reference_greedy(tiny_model, p, n)
        toks, fin = collect(eng.submit(request(p, n, ignore_eos=True, draft=ref))[1])
        assert isinstance(fin, Finished) and toks == ref
        assert fin.draft_tokens_accepted == fin.draft_tokens_proposed >= n - 5
        nxt = p + ref + [5, 6]
        toks, fin = collect(eng.submit(request(nxt, 2, ignore_eos=True))[1])
        assert toks == reference_greedy(tiny_model, nxt, 2)
        assert fin.cached_tokens == (len(p) + n - 1) // 4 * 4, (n, fin.cached_tokens)


def test_a_prefill_of_a_prefix_cached_whole_computes_nothing(make_engine) -> None:
    """A pure prefill (warm-up) whose every block is cached already recomputes no token (a
    generating request recomputes its last one, for its first token's logits): it reports
    0 computed, the whole prefix cached, and adds nothing to prefill_computed_tokens_total."""
    eng = make_engine(num_blocks=32)
    p = prompt(16, 74)
    warm = [EngineRequest(f"w{i}", p, SamplingSpec(max_tokens=0), prefill_only=True)
            for i in range(2)]
    fins = [collect(eng.submit(w)[1])[1] for w in warm]
    assert all(isinstance(f, Finished) for f in fins)
    assert [(f.cached_tokens, f.computed_tokens) for f in fins] == [(0, 16), (16, 0)]
    assert eng.stats().prefill_computed_tokens_total == 16


def test_a_request_skipping_the_prefix_cache_reuses_nothing_and_still_caches(
        make_engine, tiny_model) -> None:
    """skip_prefix_cache (the proto: "do not reuse cached prefix blocks for this request (its
    own blocks are still cached)"): a prompt cached already is computed again from scratch,
    the same answer; with the pool emptied, a later request reuses what such a one cached."""
    eng = make_engine(num_blocks=64, drafts=False)
    p = prompt(16, 75)
    want = reference_greedy(tiny_model, p, 4)

    def run(skip: bool) -> Finished:
        toks, fin = collect(eng.submit(request(p, 4, ignore_eos=True, skip_prefix_cache=skip))[1])
        assert toks == want
        return fin

    assert run(False).cached_tokens == 0
    fin = run(True)  # the prompt is cached: not reused
    assert fin.cached_tokens == 0 and fin.computed_tokens == 16 + 3
    eng.call(eng.pool.clear).result(5)
    assert run(True).cached_tokens == 0
    assert run(False).cached_tokens == 15  # what it cached; all but the token recomputed



def test_requests_that_end_while_waiting_free_their_waiting_slots(make_engine) -> None:
    """A request cancelled or timed out before it was admitted no longer counts against
    max_waiting: else each one held a slot for good, and the replica ended up refusing every
    request as busy."""
    import time

    eng = make_engine(max_waiting=2)
    by_hand(eng)  # nothing is admitted meanwhile
    for _ in range(3):  # past max_waiting in all
        _, late = eng.submit(request(prompt(4, 77), 2, rid="late", deadline=time.monotonic() - 1))
        sid, gone = eng.submit(request(prompt(4, 78), 2, rid="gone"))
        eng.cancel(sid)
        eng._drain_inbox(block=False)
        eng._expire()
        for out in (late, gone):
            _, fin = collect(out, timeout=1)
            assert isinstance(fin, Failed)
    drive(eng, [request(prompt(4, 79), 2)], lambda e: None)  # and one is served


def test_after_the_model_replaces_a_draft_token_its_guesses_are_verified_as_a_tree(
        make_engine, tiny_model) -> None:
    """Right after the model replaced draft token r, the next forward verifies the draft's
    guesses (it goes on at r, an inserted word, or at r + 1, a substituted one) beside the
    proposal, as one tree (`Draft.alternatives`): the engine moves the draft past every
    forward's tokens (`Draft.advance`), which is where it learns r. Answers stay exact."""
    trees = 0
    for seed in (1, 2):
        eng = make_engine(num_blocks=64, max_prefill_chunk=16)
        p = prompt(13, seed)
        ref = reference_greedy(tiny_model, p, 40)
        junk = next(t for t in range(1, 127) if t not in ref and t not in p)
        # A token of the answer found nowhere else, replaced in the draft by one never said.
        r = next(i for i in range(12, 30) if ref[i] not in ref[:i] + ref[i + 1:] + p)
        toks, fin = collect(eng.submit(request(p, 40, ignore_eos=True,
                                               draft=ref[:r] + [junk] + ref[r + 1:]))[1])
        assert isinstance(fin, Finished) and toks == ref
        trees += eng.stats().draft_tree_forwards_total
    assert trees >= 1


def _phi3_longrope(original: int):
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4 * original, eos_token_id=127, pad_token_id=0,
                     original_max_position_embeddings=original, initializer_range=0.25,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                   "long_factor": [4.0] * 8,
                                   "original_max_position_embeddings": original},
                     attn_implementation="sdpa")
    m = Phi3ForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = 127
    return m


def test_a_longrope_model_is_served_within_its_original_context_exactly(make_engine) -> None:
    """Longrope (Phi-3 128k, Phi-3.5) takes its long rotary factors for a whole forward once
    one of its positions is past the original context: the keys of one position then depend
    on how far the forward that computed them reached, and every answer past it (a cold one,
    prefilled in chunks, too) differed from generate()'s. The context is that original one."""
    import random

    from transformers import Phi3Config

    from services.kvpool.engine import model_info, rope_switch

    m = _phi3_longrope(24)
    assert rope_switch(m.config) == 24
    assert model_info(m, "phi3-longrope").max_context == 24
    assert rope_switch(Phi3Config()) is None  # its original_max_position_embeddings, no longrope
    eng = make_engine(model=m, num_blocks=64, block_size=4, max_prefill_chunk=8)
    rng = random.Random(0)
    long = [rng.randrange(1, 126) for _ in range(20)]
    # Answers that fill the context; the long prompt twice (cached prefix).
    for p in ([rng.randrange(1, 126) for _ in range(9)], long[:16], long, long):
        toks, _ = collect(eng.submit(request(p, 24 - len(p), ignore_eos=True))[1])
        assert toks == reference_greedy(m, p, 24 - len(p))


def test_a_warm_up_cancelled_or_past_its_deadline_during_its_last_forward_pins_nothing(
        make_engine, monkeypatch) -> None:
    """A live walkthrough: a Warm cancelled while its one-chunk prefill ran still pinned its
    28 blocks for the whole TTL (the cancel is taken between steps, after the pin), its
    caller told CANCELLED. The prefill now ends CANCELLED (DEADLINE_EXCEEDED past its
    deadline) with its blocks cached, not pinned."""
    import time

    eng = make_engine(num_blocks=32, max_batch_size=1, drafts=False)
    by_hand(eng)

    def run(out) -> Finished | Failed:
        for _ in range(10):  # steps only: a cancel in the inbox stays untaken, as mid-forward
            if not out.empty():
                break
            eng._step()
        (item,) = list(out.queue)
        return item

    seq_id, out = eng.submit(EngineRequest("w", prompt(32, 70), SamplingSpec(max_tokens=0),
                                           prefill_only=True, pin_ttl_seconds=600))
    eng._drain_inbox(block=False)
    eng.cancel(seq_id)
    item = run(out)
    assert isinstance(item, Failed) and isinstance(item.error, errors.Cancelled)
    assert eng.pool.stats().pinned == 0
    eng._drain_inbox(block=False)  # the cancel itself: a no-op now, and forgotten
    assert eng._cancel_asked == set()

    _, late = eng.submit(EngineRequest("d", prompt(32, 71), SamplingSpec(max_tokens=0),
                                       prefill_only=True, pin_ttl_seconds=600,
                                       deadline=time.monotonic() + 60))
    eng._drain_inbox(block=False)
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + 3600)  # the deadline passes
    item = run(late)
    monkeypatch.undo()
    assert isinstance(item, Failed) and isinstance(item.error, errors.DeadlineExceeded)
    stats = eng.pool.stats()
    assert (stats.pinned, stats.in_use, eng.prefills_total) == (0, 0, 0) and stats.cached > 0


def test_device_done_waits_for_a_cuda_device_only(monkeypatch) -> None:
    """On CUDA kernels run after their launch returns: `device_done` synchronises that device
    (the one given, not the current one) and does nothing on the CPU."""
    import torch

    from services.kvpool.engine import device_done

    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    device_done(torch.device("cpu"))
    assert synced == []
    device_done(torch.device("cuda", 1))
    assert synced == [torch.device("cuda", 1)]


def test_a_prefill_chunk_is_timed_once_the_device_has_run_it(make_engine, monkeypatch) -> None:
    """tiercache_kvpool_step_seconds{kind="prefill"} is read after `device_done`: a chunk
    before the last sends nothing to the host, so on a GPU the clock read right after its
    forward timed the kernel launches only (decode steps are timed after their tokens were
    sampled on the host)."""
    from services.kvpool import engine as engine_mod
    from services.kvpool.metrics import KvMetrics

    events: list[str] = []
    eng = make_engine(metrics=KvMetrics(), max_prefill_chunk=16)
    by_hand(eng)
    monkeypatch.setattr(engine_mod, "device_done", lambda dev: events.append(f"sync {dev}"))

    class Kind:
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def observe(self, seconds: float) -> None:
            events.append(f"observe {self.kind}")

    class Steps:
        def labels(self, kind: str) -> Kind:
            return Kind(kind)

    monkeypatch.setattr(eng.metrics, "step_seconds", Steps())
    drive(eng, [request(prompt(17, 5), 1, rid="p", ignore_eos=True)], lambda e: None)
    prefills = [i for i, e in enumerate(events) if e == "observe prefill"]
    assert len(prefills) == 2  # 17 tokens in two chunks
    assert all(i > 0 and events[i - 1] == f"sync {eng.device}" for i in prefills), events


def test_a_request_past_max_waiting_is_told_the_limit_and_to_retry(make_engine) -> None:
    """The refusal past max_waiting said only "too many waiting requests": it names the
    limit now, and that the same request may be sent again (it is Overloaded: the trailer)."""
    eng = make_engine(max_waiting=1)
    by_hand(eng)
    eng.submit(request(prompt(6, 1), 2, rid="a"))
    try:
        eng.submit(request(prompt(6, 2), 2, rid="b"))
    except errors.Overloaded as e:
        assert "1 request waiting for admission (max_waiting 1); retry later" in str(e)
    else:
        raise AssertionError("a request past max_waiting was accepted")
    drive(eng, [], lambda e: None)


def test_flushing_a_salt_zeroes_its_blocks_kv_and_leaves_other_tenants_exact(
        make_engine) -> None:
    """Erasure: Flush dropped a tenant's blocks from the pool but their K/V rows stayed in
    the KV tensor until the next allocation wrote there. Now every layer's K and V of each
    dropped block is zero when the flush returns; another tenant's blocks are bit-for-bit as
    they were, and its next request reuses them for the same greedy tokens."""
    eng = make_engine(num_blocks=64, block_size=4)
    by_hand(eng)
    pa, pb = prompt(14, 41), prompt(14, 42)
    (toks_a, _), = drive(eng, [request(pa, 6, "a", rid="a")], lambda e: None)
    (toks_b, _), = drive(eng, [request(pb, 6, "b", rid="b")], lambda e: None)
    a_ids, b_ids = eng.pool.match(pa + toks_a, "a"), eng.pool.match(pb + toks_b, "b")
    assert len(a_ids) >= 3 and len(b_ids) >= 3
    assert all(eng.store.blocks[bid].abs().sum() > 0 for bid in a_ids)  # KV was there
    b_before = eng.store.blocks[b_ids].clone()

    assert eng.flush_salt("a") == (len(a_ids), 0)

    assert not eng.store.blocks[a_ids].any(), "an erased tenant's KV is still in the pool"
    assert torch.equal(eng.store.blocks[b_ids], b_before)
    eng.check_integrity()
    (again, fin), = drive(eng, [request(pb, 6, "b", rid="b2")], lambda e: None)
    assert again == toks_b and fin.cached_tokens == 12  # b's 3 full blocks reused
    (cold, fin), = drive(eng, [request(pa, 6, "a", rid="a2")], lambda e: None)
    assert cold == toks_a and fin.cached_tokens == 0
    assert all(eng.pool.ref_count(bid) == 0 for bid in range(eng.pool.num_blocks))


def test_flushing_a_salt_keeps_the_kv_of_blocks_a_running_request_holds(make_engine) -> None:
    """Flush keeps (and counts) the blocks a running request of the tenant reads: their KV
    must stay too, or the request would go on attending to zeros. The tenant's other blocks
    are zeroed; the request ends with the tokens it gives without a flush."""
    eng = make_engine(num_blocks=64, block_size=4)
    by_hand(eng)
    old = prompt(10, 43)
    drive(eng, [request(old, 4, "a", rid="old")], lambda e: None)
    old_ids = eng.pool.match(old, "a")
    pr = prompt(12, 44)
    (alone, _), = drive(eng, [request(pr, 8, "b", rid="ref", ignore_eos=True)], lambda e: None)
    seen: list[tuple[int, int]] = []

    def flush_once(e) -> None:
        running = e._running()  # noqa: SLF001 - the one sequence stepped by hand
        if seen or not running:
            return
        held = [bid for bid in e.pool.blocks_of(running[0].seq_id)
                if e.pool.block_hash(bid) is not None]
        if len(held) < 3:
            return
        before = e.store.blocks[held].clone()
        seen.append(e.flush_salt("a"))
        assert torch.equal(e.store.blocks[held], before), "a held block's KV was zeroed"

    (toks, _), = drive(eng, [request(pr, 8, "a", rid="run", ignore_eos=True)], flush_once)
    assert seen and seen[0][0] >= len(old_ids) and seen[0][1] >= 3
    assert not eng.store.blocks[old_ids].any()
    assert toks == alone


def test_flushing_a_salt_also_zeroes_free_blocks_and_the_rows_of_ended_requests(
        make_engine) -> None:
    """The tenant's KV had two more copies no flush reached: blocks of it evicted earlier
    (free, still holding their rows) and the working row an ended request leaves its whole KV
    in (its partial last block and all). After a flush both are zero; the other tenant's
    cached blocks are bit-for-bit as they were and give the same tokens."""
    eng = make_engine(num_blocks=8, block_size=4, max_batch_size=2)
    by_hand(eng)
    pa, pb = prompt(14, 45), prompt(14, 46)
    drive(eng, [request(pa, 6, "a", rid="a")], lambda e: None)  # 5 blocks
    (toks_b, _), = drive(eng, [request(pb, 6, "b", rid="b")], lambda e: None)  # evicts a's
    free, b_ids = eng.pool.free_blocks(), eng.pool.match(pb + toks_b, "b")
    assert eng.store.blocks[free].any() and eng.store.rows.any()  # a's evicted KV, both rows
    b_before = eng.store.blocks[b_ids].clone()

    eng.flush_salt("a")

    assert not eng.store.blocks[eng.pool.free_blocks()].any()
    assert not eng.store.rows.any()
    assert torch.equal(eng.store.blocks[b_ids], b_before)
    (again, fin), = drive(eng, [request(pb, 6, "b", rid="b2")], lambda e: None)
    assert again == toks_b and fin.cached_tokens == 12


def test_flushing_a_salt_zeroes_every_idle_row_the_last_too(make_engine) -> None:
    """Two requests run side by side, each in its own working row; both end and leave their
    KV there. A flush zeroes both rows, the last one included (a batch's rows are the ones a
    lone request never writes)."""
    eng = make_engine(num_blocks=32, block_size=4, max_batch_size=2)
    by_hand(eng)
    drive(eng, [request(prompt(9, 50), 4, "a", rid="a", ignore_eos=True),
                request(prompt(9, 51), 4, "a", rid="b", ignore_eos=True)], lambda e: None)
    assert all(eng.store.rows[:, :, r].any() for r in range(2))  # each row holds KV

    eng.flush_salt("a")

    assert not eng.store.rows.any(), "an ended request's KV stayed in its row"


def test_flushing_a_salt_zeroes_a_running_rows_slots_past_its_tokens_and_keeps_the_rest(
        make_engine) -> None:
    """A row a running request holds keeps a longer, ended request's KV past the new one's
    computed tokens. The flush zeroes from the first slot not computed on, and keeps every
    slot before it: the request ends with the tokens it gives alone."""
    short = request(prompt(6, 53), 6, "a", rid="short", ignore_eos=True)
    ref = make_engine(num_blocks=32, block_size=4, max_batch_size=1)
    by_hand(ref)
    (alone, _), = drive(ref, [short], lambda e: None)
    eng = make_engine(num_blocks=32, block_size=4, max_batch_size=1)
    by_hand(eng)
    drive(eng, [request(prompt(30, 52), 6, "b", rid="long", ignore_eos=True)], lambda e: None)
    seen: list[int] = []

    def flush_once(e) -> None:
        running = e._running()  # noqa: SLF001 - the one sequence stepped by hand
        if seen or not running:
            return
        row, n = running[0].row, running[0].num_computed
        past = e.store.rows[:, :, row, :, n:]
        assert past.any(), "the longer request's KV should be past the running one's tokens"
        before = e.store.rows[:, :, row, :, :n].clone()
        e.flush_salt("a")
        assert not e.store.rows[:, :, row, :, n:].any(), "KV past a running row's tokens stayed"
        assert torch.equal(e.store.rows[:, :, row, :, :n], before), "a held slot was zeroed"
        seen.append(n)

    (toks, _), = drive(eng, [short], flush_once)
    assert seen and toks == alone


def test_a_flush_with_no_free_block_left_drops_nothing_and_fails_nothing(make_engine) -> None:
    """A request holding every block of the pool while another tenant is flushed: there is no
    free block to zero (an empty fill), and the flush answers (0, 0), the request ending with
    the tokens it gives alone."""
    req = request(prompt(26, 55), 6, "b", rid="all", ignore_eos=True)
    ref = make_engine(num_blocks=8, block_size=4)
    by_hand(ref)
    (alone, _), = drive(ref, [req], lambda e: None)
    eng = make_engine(num_blocks=8, block_size=4)
    by_hand(eng)
    seen: list[tuple[int, int]] = []

    def flush_when_full(e) -> None:
        if not seen and e._running() and not e.pool.free_blocks():
            seen.append(e.flush_salt("a"))

    (toks, _), = drive(eng, [req], flush_when_full)
    assert seen == [(0, 0)] and toks == alone


def test_a_flush_waits_for_the_device_after_its_fills(make_engine, monkeypatch) -> None:
    """On a GPU the fills are queued: Flush answers (the erasure done) only once the device has
    run them, so the engine waits for it after both fills, before returning."""
    from services.kvpool import engine as engine_mod

    eng = make_engine(num_blocks=32, block_size=4)
    by_hand(eng)
    drive(eng, [request(prompt(9, 54), 4, "a", rid="a")], lambda e: None)
    events: list[str] = []
    for name in ("zero_blocks", "zero_unused_rows"):
        real = getattr(eng.store, name)
        monkeypatch.setattr(eng.store, name,
                            lambda *a, _r=real, _n=name: (events.append(_n), _r(*a))[1])
    monkeypatch.setattr(engine_mod, "device_done", lambda dev: events.append(f"sync {dev}"))
    eng.flush_salt("a")
    assert events == ["zero_blocks", "zero_unused_rows", f"sync {eng.device}"]


def test_flushes_between_every_step_change_no_running_requests_tokens(make_engine) -> None:
    """A flush zeroes the working rows past each running sequence's computed tokens and every
    free block: nothing a step reads later. Batched requests with drafts (the prompt repeats
    itself) and prefix reuse, flushed after every step, give the tokens they give alone."""
    reqs = [request(prompt(9, 47) * 3, 12, "a", rid="x", ignore_eos=True),
            request(prompt(9, 47) * 3, 10, "b", rid="y", ignore_eos=True),
            request(prompt(30, 48), 12, "a", rid="z", ignore_eos=True,
                    draft=prompt(8, 49))]
    plain = make_engine(num_blocks=48)
    by_hand(plain)
    want = [toks for toks, _ in drive(plain, reqs, lambda e: None)]
    eng = make_engine(num_blocks=48)
    by_hand(eng)
    flushes: list[tuple[int, int]] = []
    got = drive(eng, reqs, lambda e: flushes.append(e.flush_salt("a")))
    assert [toks for toks, _ in got] == want
    assert any(kept for _, kept in flushes) and any(dropped for dropped, _ in flushes)


def test_the_engines_integrity_check_asserts_what_a_flush_relies_on(make_engine) -> None:
    """The engine's integrity check (run after every step in the engine tests) includes the KV
    store's: K/V where no write was noted fails it, so a write path that forgot to note its
    K/V fails any engine test stepping through it, not only the flush tests that reach it."""
    eng = make_engine(num_blocks=16, block_size=4)
    by_hand(eng)
    eng.check_integrity()
    eng.store.rows[:, :, 0, :, 3] = 1.0  # as a write that did not note itself would leave
    with pytest.raises(AssertionError, match="row 0 holds K/V past its written extent"):
        eng.check_integrity()
    eng.store.rows.zero_()


def _assert_only_running_kv(eng) -> None:
    """What a flush leaves: every free block zero, and every working row zero past the tokens
    its running sequence computed (all of it for a row none holds)."""
    assert not eng.store.blocks[eng.pool.free_blocks()].any(), "a free block kept its KV"
    held = {s.row: s.num_computed for s in eng._running()}  # noqa: SLF001
    for row in range(eng.store.max_rows):
        assert not eng.store.rows[:, :, row, :, held.get(row, 0):].any(), f"row {row} kept KV"


def test_a_flush_after_every_step_zeroes_what_each_write_path_left(make_engine,
                                                                   tiny_model) -> None:
    """Flush zeroes only what was written since the last zeroing (each block and each row's
    extent noted as written): every path that writes K/V must be noted, or a flush leaves
    it. Prefill chunks, batched decode steps, a draft whose wrong tokens roll back, a tree
    verified and moved down its row, a copy-on-write prefix and a fully cached pure prefill
    (a row loaded with no forward), rows moved as requests end: after each step's flush only
    the running requests' own KV is left, and the tokens are those of an engine never
    flushed."""
    from tests.assisted.test_draft_tree import crafted

    px, pt = prompt(20, 81), prompt(13, 4)
    ref_t = reference_greedy(tiny_model, pt, 40)
    py = prompt(9, 63)
    ref_y = reference_greedy(tiny_model, py, 16)
    wrong = [t if i % 3 else (t + 7) % 127 for i, t in enumerate(ref_y)]
    reqs = [request(px, 10, "a", rid="x", ignore_eos=True),
            request(py, 16, "b", rid="y", ignore_eos=True, draft=wrong),
            request(pt, 40, "b", rid="t", ignore_eos=True, draft=crafted(ref_t)[0]),
            EngineRequest("w", px, SamplingSpec(max_tokens=1), "a", prefill_only=True),
            request(px, 6, "a", rid="v", ignore_eos=True)]  # 19 of 20 cached: a COW
    plain = make_engine(num_blocks=64, max_batch_size=3, max_prefill_chunk=8)
    by_hand(plain)
    want = [toks for toks, _ in drive(plain, reqs, lambda e: None)]
    eng = make_engine(num_blocks=64, max_batch_size=3, max_prefill_chunk=8)
    by_hand(eng)
    salts = iter(["b", "zz"] * 1000)  # "a" stays cached for "w" and "v"

    def flush(e) -> None:
        e.flush_salt(next(salts))
        _assert_only_running_kv(e)

    got = drive(eng, reqs, flush)
    assert [toks for toks, _ in got] == want
    st = eng.stats()
    assert st.draft_tree_forwards_total >= 1
    assert st.draft_tokens_proposed_total > st.draft_tokens_accepted_total
    assert got[3][1].cached_tokens == 20 and got[4][1].cached_tokens == 19


def test_a_flush_zeroes_a_row_a_longer_request_left_under_a_shorter_ones(make_engine) -> None:
    """A row's written extent only grows until a flush: a short request after a long one on
    the same row writes less than the long one left there, which the flush still zeroes."""
    eng = make_engine(num_blocks=64, max_batch_size=1)
    by_hand(eng)
    drive(eng, [request(prompt(30, 82), 6, "a", rid="long", ignore_eos=True)], lambda e: None)
    drive(eng, [request(prompt(5, 83), 2, "b", rid="short", ignore_eos=True)], lambda e: None)
    assert eng.store.rows[:, :, 0, :, 20:35].any()
    eng.flush_salt("a")
    _assert_only_running_kv(eng)
    assert not eng.store.rows.any()


def test_a_flush_zeroes_the_kv_a_row_move_brought_in_before_its_request_ended(
        make_engine) -> None:
    """A request ending moves the prefilling one down into its row; that one cancelled
    before its next forward leaves the row holding the KV the move copied there, further
    than anything written to that row itself: a flush zeroes it."""
    eng = make_engine(num_blocks=64, max_batch_size=2)
    by_hand(eng)
    _, short = eng.submit(request(prompt(5, 84), 4, "b", rid="s", ignore_eos=True))
    sid, long = eng.submit(request(prompt(40, 85), 4, "a", rid="l", ignore_eos=True))
    while short.empty() or not isinstance(short.queue[-1], Finished):
        eng._drain_inbox(block=False)
        eng._step()
    moved = eng._by_id[sid]  # noqa: SLF001
    assert moved.row == 0 and moved.num_computed > 10
    assert eng.store.rows[:, :, 0, :, 10:moved.num_computed].any()
    eng.cancel(sid)
    eng._drain_inbox(block=False)
    assert isinstance(collect(long, timeout=1)[1], Failed)
    eng.flush_salt("a")
    _assert_only_running_kv(eng)
    assert not eng.store.rows.any()


def test_a_flush_zeroes_a_block_copied_for_a_request_that_failed_before_computing(
        make_engine, monkeypatch) -> None:
    """A copy-on-write fills a new block with the cached one's KV at admission; a request
    refused right after (no memory for its rows) frees that block unwritten otherwise. The
    flush zeroes it with the tenant's other blocks."""
    eng = make_engine(num_blocks=64, block_size=4)
    by_hand(eng)
    p = prompt(12, 86)
    drive(eng, [request(p, 2, "a", rid="first")], lambda e: None)
    eng.flush_salt("zz")  # every free block zero: only the copy can dirty one
    _assert_only_running_kv(eng)

    def no_memory(num_tokens: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(eng.store, "ensure_capacity", no_memory)
    _, out = eng.submit(request(p, 2, "a", rid="cow"))
    eng._drain_inbox(block=False)
    eng._step()
    assert isinstance(collect(out, timeout=1)[1].error, errors.Overloaded)
    monkeypatch.undo()
    assert eng.store.blocks[eng.pool.free_blocks()].any()  # the copy, freed
    eng.flush_salt("zz")
    _assert_only_running_kv(eng)


def test_a_flush_while_a_request_runs_still_zeroes_its_row_once_it_is_cancelled(
        make_engine) -> None:
    """A flush cuts a running row's written extent to the tokens its request computed (a
    longer request's KV past them is zeroed), not below: cancelled before its next forward,
    which would have noted its slots again, that request leaves them to the next flush."""
    eng = make_engine(num_blocks=64, max_batch_size=1)
    by_hand(eng)
    drive(eng, [request(prompt(30, 87), 6, "a", rid="long", ignore_eos=True)], lambda e: None)
    sid, out = eng.submit(request(prompt(9, 88), 8, "b", rid="short", ignore_eos=True))
    eng._drain_inbox(block=False)
    eng._step()  # prefilled and one token decoded: row 0 holds its KV, the long one's past it
    (seq,) = eng._running()  # noqa: SLF001
    n = seq.num_computed
    assert n == 10 and eng.store.rows[:, :, 0, :, n:30].any()
    eng.flush_salt("zz")
    _assert_only_running_kv(eng)
    assert eng.store.rows[:, :, 0, :, :n].any()  # its own KV, kept
    eng.cancel(sid)
    eng._drain_inbox(block=False)
    assert isinstance(collect(out, timeout=1)[1], Failed)
    eng.flush_salt("b")
    _assert_only_running_kv(eng)
    assert not eng.store.rows.any()
