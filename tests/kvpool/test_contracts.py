"""Contracts of the block pool and the engine that a mutation audit found unguarded.

Eviction ranks shallow blocks by use (LFU), re-pinning never shortens a pin, a colliding hash
with other tokens is never reused, rejected draft tokens give their blocks back, and pool
pressure preempts the newest decoding sequence. The engine tests drive a stopped engine one
`_step` at a time, so the pool can be inspected between steps.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from services.common.hashing import BlockHasher
from services.common.policy import HybridPolicy
from services.kvpool.block_pool import BlockPool, PoolExhausted
from services.kvpool.engine import Engine, EngineRequest, Finished
from services.kvpool.sampling import SamplingSpec
from tests.clock import Clock
from tests.kvpool.conftest import TINY_VOCAB, collect, prompt, reference_greedy, request

BS = 4


def make_pool(n: int = 8, shallow: int = 64, hasher=None) -> tuple[BlockPool, Clock]:
    clock = Clock()
    hasher = hasher or BlockHasher("m", BS, key=b"k")
    return BlockPool(n, BS, hasher, HybridPolicy(shallow), clock=clock), clock


def run_seq(pool: BlockPool, sid: str, toks: list[int]) -> None:
    """Open, compute everything, commit, close."""
    pool.open(sid, toks)
    pool.commit(sid, toks, len(toks))
    pool.close(sid)
    pool.check_integrity()


# ---- M07: shallow leaves are evicted least frequently used first ------------------------------

def test_shallow_leaves_are_evicted_by_fewest_hits_not_by_age() -> None:
    pool, clock = make_pool(n=8, shallow=64)  # every block here starts before token 64
    a, b = [11, 12, 13, 14], [21, 22, 23, 24]
    clock.t = 1.0
    run_seq(pool, "a", a)
    (blk_a,) = pool.match(a)
    for i in range(2):  # two later prompts reuse A's block (and end with an uncached token)
        clock.t = 2.0 + i
        adm = pool.open(f"a{i}", a + [99])
        assert adm.cached_tokens == BS
        pool.close(f"a{i}")
    clock.t = 10.0
    run_seq(pool, "b", b)  # B: newer than A's last use, never reused
    (blk_b,) = pool.match(b)
    # LRU would take A (older) first; the shallow rule is LFU: B (0 hits) before A (2 hits).
    assert pool.eviction_order() == [blk_b, blk_a]
    assert pool.evict(1) == [blk_b]
    assert pool.match(a) == [blk_a] and pool.match(b) == []
    pool.check_integrity()


# ---- M18: a second, shorter pin does not shorten the first --------------------------------------

def test_re_pinning_with_a_shorter_ttl_keeps_the_longer_pin() -> None:
    pool, clock = make_pool()
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    run_seq(pool, "x", toks)
    blocks = pool.match(toks)
    assert len(blocks) == 2
    assert pool.pin(blocks, 20.0) == 2
    assert pool.pin(blocks, 10.0) == 2
    clock.t += 15.0  # past the second pin, inside the first
    assert all(pool.is_pinned(b) for b in blocks)
    assert pool.eviction_order() == []
    assert pool.evict(2) == []
    assert pool.stats().pinned == 2
    clock.t += 5.0  # 20 s after pinning: the pin has run out
    assert not any(pool.is_pinned(b) for b in blocks)
    assert sorted(pool.evict(2)) == sorted(blocks)
    pool.check_integrity()


# ---- M19: a hash hit whose tokens differ is a collision, never reused ---------------------------

class CollidingHasher:
    """Test double: a block's hash depends only on its position, so any two chains collide."""

    block_size = BS

    def hashes(self, token_ids: Sequence[int], cache_salt: str = "",
               parent: bytes | None = None) -> list[bytes]:
        first = 0 if parent is None else int.from_bytes(parent, "little") + 1
        n = len(token_ids) // BS
        return [i.to_bytes(16, "little") for i in range(first, first + n)]


def test_a_colliding_hash_with_other_tokens_is_not_reused() -> None:
    pool, _ = make_pool(hasher=CollidingHasher())
    x = [1, 2, 3, 4, 5, 6, 7, 8]
    y = [9, 10, 11, 12, 13, 14, 15, 16]
    assert CollidingHasher().hashes(x) == CollidingHasher().hashes(y)  # the premise
    run_seq(pool, "x", x)
    assert len(pool.match(x)) == 2  # X itself is cached
    assert pool.match(y) == []
    adm = pool.open("y", y + [0])
    assert adm.cached_tokens == 0 and adm.copies == []
    assert not set(pool.blocks_of("y")) & set(pool.match(x))
    pool.commit("y", y + [0], len(y))
    pool.close("y")
    pool.check_integrity()
    assert pool.match(y) == []  # Y's blocks stay out of the table: X keeps the hashes
    assert len(pool.match(x)) == 2


# ---- engine: synchronous stepping ----------------------------------------------------------

def by_hand(eng: Engine) -> None:
    """Stop the engine thread; the test's own loop steps it (a stopped engine refuses
    requests, so it is opened again for that)."""
    eng.stop()
    eng._closed = False


def alone_out_of_blocks(eng: Engine, monkeypatch, tokens: list[int]):
    """On an engine stepped by hand: the only answer (ignoring EOS) decodes one step, then the
    pool has no block for its next token. Returns `collect`'s (tokens, how it ended)."""

    def exhausted(*a, **kw):
        raise PoolExhausted("no blocks")

    _, out = eng.submit(request(tokens, 8, rid="a", ignore_eos=True))
    eng._drain_inbox(block=False)
    eng._step()
    monkeypatch.setattr(eng.pool, "ensure_capacity", exhausted)
    eng._step()
    return collect(out, timeout=1)


def drive(eng: Engine, reqs: list[EngineRequest], after_step: Callable[[Engine], None],
          max_steps: int = 5000) -> list[tuple[list[int], Finished]]:
    """Run requests to completion on a stopped engine, calling `after_step` after each step."""
    assert not eng.running
    outs = [eng.submit(r)[1] for r in reqs]
    try:
        for _ in range(max_steps):
            eng._drain_inbox(block=False)
            if not (eng._waiting or eng._decoding or eng._prefilling):
                break
            eng._expire()
            eng._step()
            eng._publish_state()
            eng.check_integrity()
            after_step(eng)
        else:
            raise AssertionError(f"requests not done after {max_steps} steps")
    except BaseException:
        # End what is left, so that the failure is reported once (not again by make_engine).
        eng._fail_everything(RuntimeError("test failed"))
        raise
    res = []
    for out in outs:
        toks, fin = collect(out, timeout=1)
        assert isinstance(fin, Finished), fin
        res.append((toks, fin))
    return res


def other(t: int) -> int:
    return (t + 7) % (TINY_VOCAB - 1)


# ---- M30: blocks reserved for rejected draft tokens are released in the same step -------------

def test_rejected_draft_tokens_give_their_blocks_back_at_every_step(make_engine,
                                                                    tiny_model) -> None:
    eng = make_engine(num_blocks=64, block_size=2, max_batch_size=3)
    by_hand(eng)  # stepped by hand below
    n_new = 30
    prompts = [prompt(9, 40 + i) for i in range(3)]
    refs = [reference_greedy(tiny_model, p, n_new) for p in prompts]
    drafts = [
        [t if i % 5 else other(t) for i, t in enumerate(refs[0])],  # 1 in 5 wrong
        [other(t) for t in refs[1]],  # every token wrong
        [t if i % 3 else other(t) for i, t in enumerate(refs[2])],  # 1 in 3 wrong
    ]
    reqs = [EngineRequest(f"d{i}", p, SamplingSpec(n_new, ignore_eos=True),
                          draft_token_ids=tuple(d))
            for i, (p, d) in enumerate(zip(prompts, drafts, strict=True))]
    pool = eng.pool
    checked = []

    def held_blocks_are_needed(e: Engine) -> None:
        # Between steps nothing is speculatively reserved: a decoding sequence holds the blocks
        # of its computed tokens plus the next one's, a prefilling one those of its prompt.
        for s in e._decoding:
            assert len(pool.blocks_of(s.seq_id)) <= pool.blocks_needed(s.num_computed + 1), \
                (s.seq_id, s.num_computed, len(pool.blocks_of(s.seq_id)))
            assert len(s.tokens) == s.num_computed + 1
            checked.append(s.seq_id)
        if e._prefilling is not None:
            s = e._prefilling
            assert len(pool.blocks_of(s.seq_id)) <= pool.blocks_needed(len(s.tokens))

    res = drive(eng, reqs, held_blocks_are_needed)
    assert len(checked) > n_new
    for (toks, fin), ref in zip(res, refs, strict=True):
        assert toks == ref
        assert fin.draft_tokens_proposed > fin.draft_tokens_accepted  # rejections happened
    assert pool.stats().in_use == 0


# ---- M31: pool pressure preempts the newest decoding sequence -------------------------------

def test_pool_pressure_preempts_the_newest_decoding_sequence(make_engine, tiny_model) -> None:
    # 14 blocks of 4: two sequences of 20 prompt + 24 new tokens cannot both finish at once.
    eng = make_engine(num_blocks=14, max_batch_size=2, max_prefill_chunk=32)
    by_hand(eng)  # stepped by hand below
    a, b = prompt(20, 20), prompt(20, 21)
    preempted: set[str] = set()

    def record_preempted(e: Engine) -> None:
        # A preemption sends an admitted sequence back to the waiting queue.
        preempted.update(s.req.request_id for s in e._waiting if s.admitted_once)

    res = drive(eng, [request(a, 24, rid="a"), request(b, 24, rid="b")], record_preempted)
    (toks_a, fin_a), (toks_b, fin_b) = res
    assert eng.stats().preemptions_total >= 1
    assert preempted == {"b"}  # only the later one went back, never the first admitted
    # The first one was computed once: its prompt, then one forward per token but the last.
    assert fin_a.computed_tokens == fin_a.prompt_tokens + fin_a.completion_tokens - 1
    assert fin_b.computed_tokens >= fin_b.prompt_tokens + fin_b.completion_tokens - 1
    # Its cached tokens are those its prompt found when first admitted (none): the blocks it
    # computed itself before the preemption are no cache hit of the request.
    assert fin_b.cached_tokens == fin_a.cached_tokens == 0
    assert toks_a == reference_greedy(tiny_model, a, 24)
    assert toks_b == reference_greedy(tiny_model, b, 24)


def test_preemption_takes_the_latest_submitted_even_after_a_row_move(make_engine,
                                                                      tiny_model) -> None:
    """A, B, C admitted in order; A finishes first and C's row moves into its slot, so the last
    row is B. Pool pressure must still send C back, not B (before: `_decoding[-1]`)."""
    eng = make_engine(num_blocks=16, max_batch_size=3, prefix_caching=False)
    by_hand(eng)
    first_victims: list[str] = []
    preempt = eng._preempt

    def record(seq) -> None:
        first_victims.append(seq.req.request_id)
        preempt(seq)

    eng._preempt = record
    reqs = [request(prompt(4, 1), 8, rid="A", ignore_eos=True),
            request(prompt(4, 2), 40, rid="B", ignore_eos=True),
            request(prompt(4, 3), 40, rid="C", ignore_eos=True)]
    res = drive(eng, reqs, lambda e: None)
    assert first_victims and first_victims[0] == "C", first_victims
    for r, (toks, _) in zip(reqs, res, strict=True):
        assert toks == reference_greedy(tiny_model, list(r.token_ids), r.sampling.max_tokens)


def test_a_request_that_fits_the_pool_exactly_is_admitted(make_engine, tiny_model) -> None:
    """13 prompt + 4 new tokens need KV for 16 (the last token is emitted, never computed):
    4 blocks of 4. It used to be refused as needing 5."""
    eng = make_engine(num_blocks=4)
    p = prompt(13, 4)
    toks, fin = collect(eng.submit(request(p, 4, ignore_eos=True))[1])
    assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, p, 4)


def test_max_waiting_holds_against_a_burst_between_two_steps(make_engine) -> None:
    """The limit was read from the last step's stats, so a burst arriving before the next step
    was all accepted (40 of 40 with max_waiting=2)."""
    from services.common.errors import Overloaded as ResourceExhausted  # busy, not "never"

    eng = make_engine(max_waiting=2)
    by_hand(eng)  # nothing is admitted meanwhile
    accepted, refused = [], 0
    for i in range(10):
        try:
            accepted.append(eng.submit(request(prompt(4, i), 2, rid=f"r{i}"))[1])
        except ResourceExhausted:
            refused += 1
    assert (len(accepted), refused) == (2, 8)
    drive(eng, [], lambda e: None)  # admits and finishes the two
    for out in accepted:
        assert isinstance(collect(out, timeout=1)[1], Finished)
    eng.submit(request(prompt(4, 99), 2, rid="after"))  # room again once they were admitted
    drive(eng, [], lambda e: None)


# ---- warm-up pins yield before a streaming answer is preempted ------------------------------

def test_pins_are_released_before_any_streaming_answer_is_preempted(make_engine,
                                                                   tiny_model) -> None:
    # 13 blocks of 4. A Warm pins 2; then two answers of 12 prompt + 12 new tokens (6 blocks
    # each) decode side by side: together with the pins they need 14 blocks, without them 12.
    # The pins are warm-up advice: they must go before either answer is stopped and
    # recomputed (before, they went only when a single answer was decoding).
    eng = make_engine(num_blocks=13, max_batch_size=2, max_prefill_chunk=32, drafts=False)
    by_hand(eng)
    warm = EngineRequest("warm", prompt(8, 30), SamplingSpec(max_tokens=0), prefill_only=True,
                         pin_ttl_seconds=600)
    ((_, wfin),) = drive(eng, [warm], lambda e: None)
    assert wfin.pinned_blocks == 2 and eng.pool.stats().pinned == 2
    a, b = prompt(12, 31), prompt(12, 32)
    res = drive(eng, [request(a, 12, rid="a", ignore_eos=True),
                      request(b, 12, rid="b", ignore_eos=True)], lambda e: None)
    (toks_a, fin_a), (toks_b, fin_b) = res
    assert eng.stats().preemptions_total == 0
    assert eng.pool.stats().pinned < 2  # the pins yielded, as many as the answers needed
    assert fin_b.computed_tokens == fin_b.prompt_tokens + fin_b.completion_tokens - 1
    assert toks_a == reference_greedy(tiny_model, a, 12)
    assert toks_b == reference_greedy(tiny_model, b, 12)


def test_a_request_that_fits_the_pool_gets_in_past_pins_which_yield_only_what_it_needs(
        make_engine, tiny_model) -> None:
    """Memory-pressure review: a new request that fits the pool was refused (busy) for as long
    as warm-up pins held the rest, up to their hour; with an answer decoding it held the head
    of the queue until that answer ended, then was refused anyway; and any pressure released
    every tenant's pins. Now as few pins yield as the request needs, chain tails first."""
    eng = make_engine(num_blocks=16, max_batch_size=4, max_prefill_chunk=64, drafts=False)
    by_hand(eng)
    eng.pool.max_pinned = 8
    warms = [EngineRequest(f"warm-{salt}", prompt(16, seed), SamplingSpec(max_tokens=0), salt,
                           prefill_only=True, pin_ttl_seconds=3600)
             for salt, seed in (("a", 50), ("b", 51))]
    assert [fin.pinned_blocks for _, fin in drive(eng, warms, lambda e: None)] == [4, 4]
    chains = [[eng.pool._table[h] for h in eng.pool.hasher.hashes(w.token_ids, w.cache_salt)]
              for w in warms]

    # A long answer decodes; then a 40-token prompt (+4 new: 11 of 16 blocks) arrives.
    big = prompt(40, 52)
    seen: list[int] = []
    (toks_d, _), (toks_big, fin_big) = drive(
        eng, [request(prompt(4, 53), 20, rid="d", ignore_eos=True), request(big, 4, rid="w")],
        lambda e: seen.append(len(e._decoding)))
    assert toks_big == reference_greedy(tiny_model, big, 4)
    assert max(seen) == 2  # admitted beside the decoding answer, not after it
    pinned = [[eng.pool.is_pinned(b) for b in c] for c in chains]
    # Only what the two needed yielded (all 8 did before), the deepest first: each prompt
    # keeps its first blocks pinned, a pinned block never below an unpinned one.
    assert 2 <= sum(map(sum, pinned)) < 8
    assert all(c[0] and c == sorted(c, reverse=True) for c in pinned)
    eng.pool.release_pins()


# ---- the engine thread survives faults around a step ---------------------------------------

def test_a_request_that_cannot_be_admitted_fails_alone(make_engine, tiny_model,
                                                        monkeypatch) -> None:
    # pool.open raising (not PoolExhausted) for one request used to fail the step and leave
    # it at the head of the queue: every later step failed again, with the running answers.
    from services.kvpool.engine import Failed

    eng = make_engine(num_blocks=32, drafts=False)
    real_open = eng.pool.open

    def open_(seq_id, *a, **kw):
        if seq_id.startswith("bad#"):
            raise RuntimeError("boom")
        return real_open(seq_id, *a, **kw)

    monkeypatch.setattr(eng.pool, "open", open_)
    a = prompt(8, 40)
    _, bad = eng.submit(request(prompt(8, 41), 4, rid="bad"))
    _, good = eng.submit(request(a, 6, rid="good", ignore_eos=True))
    _, fin_bad = collect(bad)
    toks, fin_good = collect(good)
    # INTERNAL: the replica's fault, not its load (Overloaded would send it to another).
    assert isinstance(fin_bad, Failed) and fin_bad.error.code == "INTERNAL"
    assert isinstance(fin_good, Finished) and toks == reference_greedy(tiny_model, a, 6)


def test_no_memory_to_grow_the_rows_fails_only_the_request_that_needed_it(
        make_engine, tiny_model, monkeypatch) -> None:
    """An allocation that failed while the working rows grew for a new, longer prompt (a GPU
    runs out far sooner) was raised from the step: every running answer failed with it."""
    import torch

    from services.common import errors
    from services.kvpool.engine import Failed

    eng = make_engine(num_blocks=64, drafts=False)
    real = eng.store.ensure_capacity

    def grow(num_tokens: int) -> None:
        if num_tokens > 48:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real(num_tokens)

    monkeypatch.setattr(eng.store, "ensure_capacity", grow)
    short = prompt(8, 50)
    _, good = eng.submit(request(short, 12, rid="short", ignore_eos=True))
    _, long_ = eng.submit(request(prompt(60, 51), 4, rid="long"))
    toks, fin_good = collect(good)
    _, fin_long = collect(long_)
    assert isinstance(fin_good, Finished) and toks == reference_greedy(tiny_model, short, 12)
    assert isinstance(fin_long, Failed) and isinstance(fin_long.error, errors.Overloaded)
    assert "device memory exhausted" in str(fin_long.error)


def no_memory_for_proposals(eng, monkeypatch) -> list[int]:
    """Makes the pool refuse (as a device out of memory) every growth a draft proposal asks
    for, other growth allowed; returns the list of refused sizes, filled as it goes."""
    import sys

    import torch

    real = eng.store.ensure_capacity
    refused: list[int] = []

    def grow(num_tokens: int) -> None:
        if sys._getframe(1).f_code.co_name == "_proposal":
            refused.append(num_tokens)
            raise torch.OutOfMemoryError("CUDA out of memory")
        real(num_tokens)

    monkeypatch.setattr(eng.store, "ensure_capacity", grow)
    return refused


def test_no_memory_for_a_draft_proposal_decodes_without_it(make_engine, tiny_model,
                                                            monkeypatch) -> None:
    """The rows growing for a draft's proposal failed the step, and with it every answer; now
    the proposal is withdrawn (its blocks given back) and the answer is decoded as usual."""
    eng = make_engine(num_blocks=64)
    refused = no_memory_for_proposals(eng, monkeypatch)
    a = prompt(8, 52)
    want = reference_greedy(tiny_model, a, 10)
    toks, fin = collect(eng.submit(request(a, 10, rid="d", ignore_eos=True, draft=want))[1])
    assert isinstance(fin, Finished) and toks == want
    assert refused and fin.draft_tokens_proposed == 0
    eng.call(eng.check_integrity).result(5)


def test_the_engine_keeps_serving_after_publishing_its_state_fails(make_engine, tiny_model,
                                                                  monkeypatch) -> None:
    eng = make_engine(num_blocks=32, drafts=False)
    real = eng._compute_stats
    fails = [1]

    def flaky():
        if fails:
            fails.pop()
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(eng, "_compute_stats", flaky)
    eng.call(lambda: None).result(timeout=10)  # a loop iteration: its publish raises
    a = prompt(8, 42)
    toks, fin = collect(eng.submit(request(a, 5, ignore_eos=True))[1])
    assert not fails and eng.running
    assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, a, 5)


def test_a_submit_that_fails_does_not_use_up_a_waiting_slot(make_engine, monkeypatch) -> None:
    import pytest

    import services.kvpool.engine as engine_mod

    eng = make_engine(num_blocks=32, max_waiting=1)

    def broken(*a, **kw):
        raise RuntimeError("bad draft")

    monkeypatch.setattr(engine_mod.Draft, "of", staticmethod(broken))
    for _ in range(3):
        with pytest.raises(RuntimeError):
            eng.submit(EngineRequest("d", prompt(8, 43), SamplingSpec(max_tokens=4),
                                     draft_token_ids=(1, 2, 3)))
    assert eng._queued == 0
    monkeypatch.undo()
    _, fin = collect(eng.submit(request(prompt(8, 44), 4))[1])
    assert isinstance(fin, Finished)  # max_waiting=1 still admits one


def test_a_whole_prompt_hit_on_a_full_pool_is_served_as_from_scratch(make_engine,
                                                                       tiny_model) -> None:
    """32 tokens fill 8 blocks of 4. From scratch it fits; again, the hit copied its last block
    (copy-on-write) while holding the source, one block more than the pool has, and failed."""
    eng = make_engine(num_blocks=8)
    p = prompt(32, 5)
    want = reference_greedy(tiny_model, p, 1)
    for _ in range(2):
        toks, fin = collect(eng.submit(request(p, 1))[1])
        assert isinstance(fin, Finished) and toks == want, fin


def test_preallocated_rows_hold_the_whole_context_from_the_start(make_engine,
                                                                  tiny_model) -> None:
    """Grown by doubling, the rows peak at 1.5x their full size while copying; allocated at
    start (the GPU overlay) the peak is the full size, and nothing grows later."""
    eng = make_engine(preallocate_rows=True)
    full = eng.store.capacity
    assert full >= eng.info.max_context and full - eng.info.max_context < eng.pool.block_size
    p = prompt(40, 6)
    toks, fin = collect(eng.submit(request(p, 8))[1])
    assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, p, 8)
    assert eng.store.capacity == full
    assert make_engine().store.capacity < full  # the default grows on demand


def test_requests_total_counts_completed_requests_only(make_engine) -> None:
    """Stats' requests_total ("completed since start") counted cancelled, timed-out and
    refused requests too."""
    import time

    from services.kvpool.engine import Failed

    eng = make_engine()
    _, fin = collect(eng.submit(request(prompt(8, 1), 4, deadline=time.monotonic() - 1))[1])
    assert isinstance(fin, Failed)
    assert eng.stats().requests_total == 0
    _, fin = collect(eng.submit(request(prompt(8, 2), 4))[1])
    assert isinstance(fin, Finished) and eng.stats().requests_total == 1


def test_the_working_rows_never_hold_more_than_1_5x_their_full_size_while_growing() -> None:
    """Rows jumped straight to a long prompt's length (256 -> 4,000) and then doubled to the
    context (4,096) while the 4,000 were held: nearly 2x the full size at once. Growing along
    halves of the context, the step to the top always comes from at most half of it."""
    import torch

    from services.kvpool.paged_cache import KvStore

    rng = random.Random(3)
    for max_context in (4096, 4000, 2048, 1000, 8192):
        for _ in range(20):
            s = KvStore(num_layers=1, kv_heads=1, head_dim=2, num_blocks=1, block_size=16,
                        max_rows=1, max_context=max_context, dtype=torch.float32, device="cpu")
            full = s._round(max_context)
            for n in sorted(rng.randint(1, max_context) for _ in range(4)) + [max_context]:
                before = s.capacity
                s.ensure_capacity(n)
                assert s.capacity >= n
                if s.capacity != before:
                    assert before + s.capacity <= 1.5 * full + s.block_size, (
                        max_context, before, s.capacity)
            assert s.capacity == full
