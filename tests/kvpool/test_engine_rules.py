"""Rules of the engine that a mutation audit found unguarded: what its stats say and when,
the codes its refusals carry, and what it counts. The engine is stepped by hand (as in
test_contracts) where the moment matters."""

from __future__ import annotations

from services.common import errors
from services.kvpool.block_pool import PoolExhausted
from services.kvpool.engine import Failed, Finished
from tests.kvpool.conftest import collect, reference_greedy, request
from tests.kvpool.test_contracts import by_hand, drive, prompt


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
            deadline = time.monotonic() + 10
            while eng.stalled_for() >= 0.3:
                assert time.monotonic() < deadline, "two failed steps read as a stall"
                time.sleep(0.05)
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
    _, out = eng.submit(request(prompt(6, 6), 8, rid="a", ignore_eos=True))
    eng._drain_inbox(block=False)
    eng._step()

    def exhausted(*a, **kw):
        raise PoolExhausted("no blocks")

    monkeypatch.setattr(eng.pool, "ensure_capacity", exhausted)
    eng._step()
    toks, fin = collect(out, timeout=1)
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
