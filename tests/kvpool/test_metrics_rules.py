"""The kvpool metrics that no test read, checked against what docs/metrics.md says they count:
each documented event is driven on the real engine (the tiny test model), the exported series
read from the Prometheus registry (deltas: the metrics are one set per process), and compared
with an independent count of the event (the forwards' widths, the trees and proposals the
engine made, the sequences preempted) and with what Stats (`EngineStats`) and each answer's
`Finished` report for the same events. Events the meaning leaves out must not move them:
requests refused at submit, cancelled or timed out before admission, warm-up prefills,
answers without drafts, a failure of one request that is not an engine step's."""

from __future__ import annotations

import time

import pytest

from services.common import errors
from services.kvpool.engine import EngineRequest, Failed, Finished
from services.kvpool.metrics import KvMetrics
from services.kvpool.sampling import SamplingSpec
from tests.kvpool.conftest import collect, reference_greedy, request
from tests.kvpool.test_contracts import alone_out_of_blocks, by_hand, drive, prompt
from tests.kvpool.test_kvpool_engine import paused
from tests.metric_sample import sample_value

COUNTERS = ("prompt_tokens", "preemptions", "engine_step_failures", "draft_tokens_proposed",
            "draft_tokens_accepted", "draft_tokens_withheld", "draft_tree_forwards",
            "draft_tree_branch_wins")
# The EngineStats field each counter mirrors (engine_step_failures: the engine's own total).
STATS_OF = {"prompt_tokens": "prompt_tokens_total", "preemptions": "preemptions_total",
            "draft_tokens_proposed": "draft_tokens_proposed_total",
            "draft_tokens_accepted": "draft_tokens_accepted_total",
            "draft_tokens_withheld": "draft_tokens_withheld_total",
            "draft_tree_forwards": "draft_tree_forwards_total",
            "draft_tree_branch_wins": "draft_tree_branch_wins_total"}
BATCH = "tiercache_kvpool_batch_size"


def metric(name: str, **labels) -> float:
    return sample_value(name, labels) or 0.0


class Deltas:
    """The counters' and the engine's Stats' increments since construction."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.m0 = self._metrics()
        self.s0 = self._stats()

    def _metrics(self) -> dict[str, float]:
        out = {c: metric(f"tiercache_kvpool_{c}_total") for c in COUNTERS}
        out["batch_count"] = metric(f"{BATCH}_count")
        out["batch_sum"] = metric(f"{BATCH}_sum")
        for le in ("1.0", "2.0", "4.0"):
            out[f"batch_le_{le}"] = metric(f"{BATCH}_bucket", le=le)
        return out

    def _stats(self) -> dict[str, int]:
        if self.eng.running:
            self.eng.call(lambda: None).result(10)  # one more turn publishes the stats
        st = self.eng.stats() if self.eng.running else self.eng._compute_stats()
        out = {c: getattr(st, f) for c, f in STATS_OF.items()}
        out["engine_step_failures"] = self.eng.step_failures_total
        return out

    def metrics(self) -> dict[str, float]:
        now = self._metrics()
        return {k: now[k] - self.m0[k] for k in now}

    def stats(self) -> dict[str, int]:
        now = self._stats()
        return {k: now[k] - self.s0[k] for k in now}

    def agree(self) -> dict[str, float]:
        """The counters' increments, checked equal to the Stats' own."""
        m, s = self.metrics(), self.stats()
        for c in COUNTERS:
            assert m[c] == s[c], f"{c}: metric +{m[c]}, Stats +{s[c]}"
        return m


def counting_forwards(eng) -> list[tuple[str, int, int]]:
    """(kind, rows, tokens) of every model forward from now: kind "prefill" for a prefill
    chunk's (its last chunk may verify draft tokens too), "decode" for any other."""
    seen: list[tuple[str, int, int]] = []
    forward, prefill_chunk = eng._forward, eng._prefill_chunk
    in_prefill = [False]

    def chunk(seq):
        in_prefill[0] = True
        try:
            return prefill_chunk(seq)
        finally:
            in_prefill[0] = False

    def counted(ids, plan, *a, **kw):
        seen.append(("prefill" if in_prefill[0] else "decode", ids.shape[0], ids.shape[1]))
        return forward(ids, plan, *a, **kw)

    eng._forward, eng._prefill_chunk = counted, chunk
    return seen


# ---- drafts: proposed and accepted --------------------------------------------------------

def test_draft_tokens_proposed_are_the_tokens_forwards_verified_and_accepted_the_ones_used(
        make_engine, tiny_model) -> None:
    """One answer decoding alone with a draft one token in three wrong (no trees): proposed is
    every forward's width past the prompt and each decode step's own token (what the model
    verified), accepted is what the answer used, so completion = accepted + the forwards
    that emitted a token of the model's own (the prefill's last and each decode), less one
    where the answer ended on a draft token. Both equal the answer's Finished and Stats."""
    eng = make_engine(num_blocks=64, max_prefill_chunk=32, draft_branches=1,
                      metrics=KvMetrics())
    widths = counting_forwards(eng)
    d = Deltas(eng)
    p = prompt(9, 63)
    ref = reference_greedy(tiny_model, p, 30)
    draft = [t if i % 3 else (t + 7) % 127 for i, t in enumerate(ref)]
    toks, fin = collect(eng.submit(request(p, 30, ignore_eos=True, draft=draft))[1])
    assert isinstance(fin, Finished) and toks == ref
    m = d.agree()
    verified = sum(r * q for _, r, q in widths) - len(p) - fin.forward_passes
    assert m["draft_tokens_proposed"] == fin.draft_tokens_proposed == verified > 0
    assert m["draft_tokens_accepted"] == fin.draft_tokens_accepted > 0
    emitting = 1 + fin.forward_passes
    assert fin.completion_tokens - emitting + 1 >= m["draft_tokens_accepted"] \
        >= fin.completion_tokens - emitting
    assert m["draft_tokens_proposed"] > m["draft_tokens_accepted"]  # rejections happened
    assert m["draft_tokens_withheld"] == m["draft_tree_forwards"] == 0


def test_accepted_draft_tokens_past_a_stop_are_verified_but_not_accepted(make_engine,
                                                                        tiny_model) -> None:
    """A perfect draft through a stop token: the tokens after the stop verified (proposed)
    but the answer ended at the stop, so only those up to it count as accepted; the answer
    ended on a draft token (its last run saves one forward fewer)."""
    eng = make_engine(num_blocks=64, max_prefill_chunk=32, draft_branches=1,
                      metrics=KvMetrics())
    p = prompt(9, 70)
    ref = reference_greedy(tiny_model, p, 30)
    k = next(i for i in range(8, 30) if ref[i] not in ref[:i])
    d = Deltas(eng)
    toks, fin = collect(eng.submit(request(p, 30, ignore_eos=True, draft=ref,
                                           stop_token_ids=[ref[k]]))[1])
    assert isinstance(fin, Finished) and toks == ref[:k + 1]
    m = d.agree()
    assert m["draft_tokens_accepted"] == fin.draft_tokens_accepted
    assert m["draft_tokens_accepted"] == fin.completion_tokens - 1 - fin.forward_passes + 1
    assert m["draft_tokens_proposed"] == fin.draft_tokens_proposed > m["draft_tokens_accepted"]


def test_answers_without_drafts_move_no_draft_counter(make_engine, tiny_model) -> None:
    """Drafts on but none given (prompt lookup off), and a draft given to an engine with
    drafts off: nothing proposed, accepted, withheld or verified as a tree."""
    for kw, draft in (({}, ()), ({"drafts": False}, "ref")):
        eng = make_engine(num_blocks=64, metrics=KvMetrics(), **kw)
        p = prompt(9, 71)
        ref = reference_greedy(tiny_model, p, 12)
        d = Deltas(eng)
        toks, fin = collect(eng.submit(request(p, 12, ignore_eos=True,
                                               draft=ref if draft else ()))[1])
        assert isinstance(fin, Finished) and toks == ref
        m = d.agree()
        for c in COUNTERS[3:]:
            assert m[c] == 0, (kw, c, m[c])


# ---- trees ---------------------------------------------------------------------------------

def test_trees_verified_and_branch_wins_are_counted_as_the_forwards_had_them(make_engine,
                                                                           tiny_model) -> None:
    """Every tree the engine verified counts once (one per sequence and forward), and a win
    is a tree whose accepted path left the proposal (its first branch: nodes 0..len - 1 in
    order), told here from the path itself; every node counts as proposed. A draft wrong
    every third token has trees won and lost."""
    eng = make_engine(num_blocks=64, block_size=4, max_prefill_chunk=32, metrics=KvMetrics())
    made: list = []
    verdicts: list[tuple[int, bool]] = []
    tree_of, apply_tree = eng._tree, eng._apply_tree

    def tree(seq, prop, room=None):
        t = tree_of(seq, prop, room)
        if t is not None:
            made.append(t)
        return t

    def applied(seq, t, start, path, tok):
        first = len(t.branches[0].tokens)
        along_first = path == list(range(len(path))) and len(path) <= first
        verdicts.append((t.size, not along_first))
        return apply_tree(seq, t, start, path, tok)

    eng._tree, eng._apply_tree = tree, applied
    widths = counting_forwards(eng)
    d = Deltas(eng)
    p = prompt(13, 1)
    ref = reference_greedy(tiny_model, p, 40)
    verified = reported = 0
    for draft in ([t if i % 3 else (t + 7) % 127 for i, t in enumerate(ref)],):
        widths.clear()
        toks, fin = collect(eng.submit(request(p, 40, ignore_eos=True, draft=draft))[1])
        assert isinstance(fin, Finished) and toks == ref
        # What the forwards computed past the prompt's uncached part and each decode token.
        verified += (sum(r * q for _, r, q in widths) - (len(p) - fin.cached_tokens)
                     - fin.forward_passes)
        reported += fin.draft_tokens_proposed
    m = d.agree()
    wins = sum(w for _, w in verdicts)
    assert m["draft_tree_forwards"] == len(made) == len(verdicts) > wins
    assert m["draft_tree_branch_wins"] == wins >= 1
    assert m["draft_tokens_proposed"] == verified == reported


# ---- withheld ------------------------------------------------------------------------------

def test_every_proposed_token_is_verified_or_withheld_by_the_batch(make_engine,
                                                                  tiny_model) -> None:
    """With two drafted answers decoding together and measured costs that rise with length,
    the batch rule cuts proposals (to nothing, or shorter): each proposal token (as the
    drafts made them) is either verified by a forward (proposed) or left out of it
    (withheld), nothing else in a roomy pool and context; with the batch rule off the same
    batch withholds nothing."""
    from services.kvpool.drafting import LadderChoice

    for gate in (True, False):
        eng = make_engine(num_blocks=128, max_batch_size=4, learn_costs=False,
                          draft_branches=1, batch_gate=gate, metrics=KvMetrics())
        eng.draft_ladder = LadderChoice((1, 4, 16), "measured",
                                        tuple(1.0 + 0.1 * i for i in range(17)))
        made: list[int] = []
        proposal = eng._proposal

        def proposed(seq, proposal=proposal, made=made):
            out = proposal(seq)
            made.append(len(out))
            return out

        eng._proposal = proposed
        d = Deltas(eng)
        prompts = [prompt(6 + i, 67 + i) for i in range(2)]
        refs = [reference_greedy(tiny_model, q, 24) for q in prompts]
        with paused(eng):
            outs = [eng.submit(request(q, 24, rid=f"w{i}", ignore_eos=True, draft=[
                t if j % 3 else (t + 7) % 127 for j, t in enumerate(ref)]))[1]
                for i, (q, ref) in enumerate(zip(prompts, refs, strict=True))]
        fins = []
        for out, ref in zip(outs, refs, strict=True):
            toks, fin = collect(out)
            assert isinstance(fin, Finished) and toks == ref
            fins.append(fin)
        m = d.agree()
        assert m["draft_tokens_proposed"] + m["draft_tokens_withheld"] == sum(made)
        assert m["draft_tokens_proposed"] == sum(f.draft_tokens_proposed for f in fins)
        if gate:
            assert m["draft_tokens_withheld"] > 0
        else:
            assert m["draft_tokens_withheld"] == 0


# ---- batch size ------------------------------------------------------------------------------

def test_batch_size_observes_the_sequences_of_every_decode_forward_only(make_engine) -> None:
    """Three answers decoding together: one observation per decode forward, of its rows;
    prefill forwards (and a warm-up prefill's) are not observed."""
    eng = make_engine(num_blocks=128, max_batch_size=4, drafts=False, metrics=KvMetrics())
    seen = counting_forwards(eng)
    d = Deltas(eng)
    with paused(eng):
        outs = [eng.submit(request(prompt(5, 80 + i), 4 + 3 * i, rid=f"b{i}",
                                   ignore_eos=True))[1] for i in range(3)]
        outs.append(eng.submit(EngineRequest("w", prompt(16, 90), SamplingSpec(max_tokens=0),
                                             prefill_only=True))[1])
    for out in outs:
        assert isinstance(collect(out)[1], Finished)
    m = d.agree()
    rows = [r for kind, r, _ in seen if kind == "decode"]
    assert max(rows) == 3 and min(rows) == 1
    assert m["batch_count"] == len(rows) and m["batch_sum"] == sum(rows)
    for le in (1, 2, 4):
        assert m[f"batch_le_{le}.0"] == sum(r <= le for r in rows), le
    assert m["prompt_tokens"] == 15  # the warm-up prefill's 16 are not Generate traffic


# ---- engine step failures ------------------------------------------------------------------

def test_a_step_that_raises_counts_once_and_fails_its_running_sequences(make_engine,
                                                                       monkeypatch) -> None:
    """One engine step raising with two answers decoding: one step failure, both answers
    INTERNAL. A request whose admission alone failed (INTERNAL too) is no step failure."""
    eng = make_engine(num_blocks=64, max_batch_size=4, drafts=False, metrics=KvMetrics())
    decode_step = eng._decode_step

    def breaking() -> None:
        if len(eng._decoding) == 2:
            raise RuntimeError("device lost")
        decode_step()

    eng._decode_step = breaking
    d = Deltas(eng)
    with paused(eng):
        outs = [eng.submit(request(prompt(6, 91 + i), 30, rid=f"f{i}", ignore_eos=True))[1]
                for i in range(2)]
    for out in outs:
        _, fin = collect(out)
        assert isinstance(fin, Failed) and fin.error.code == "INTERNAL"
    m = d.agree()
    assert m["engine_step_failures"] == 1
    eng._decode_step = decode_step

    def broken_open(*a, **kw):
        raise RuntimeError("bad table")

    d = Deltas(eng)
    monkeypatch.setattr(eng.pool, "open", broken_open)
    _, fin = collect(eng.submit(request(prompt(6, 93), 4))[1])
    monkeypatch.undo()
    assert isinstance(fin, Failed) and fin.error.code == "INTERNAL"
    m = d.agree()
    assert m["engine_step_failures"] == 0 and m["prompt_tokens"] == 0


# ---- preemptions and prompt tokens -----------------------------------------------------------

def test_preempted_sequences_are_counted_and_their_prompts_once(make_engine, tiny_model) -> None:
    """A pool too small for two answers at once: sequences are preempted (each counted) and
    recomputed later, exact; their prompt tokens count once, however often readmitted."""
    eng = make_engine(num_blocks=10, block_size=4, max_batch_size=2, drafts=False,
                      metrics=KvMetrics())
    preempted: list[str] = []
    preempt = eng._preempt

    def counted(seq):
        preempted.append(seq.seq_id)
        return preempt(seq)

    eng._preempt = counted
    d = Deltas(eng)
    prompts = [prompt(8, 94), prompt(8, 95)]
    with paused(eng):
        outs = [eng.submit(request(q, 20, rid=f"p{i}", ignore_eos=True))[1]
                for i, q in enumerate(prompts)]
    for q, out in zip(prompts, outs, strict=True):
        toks, fin = collect(out)
        assert isinstance(fin, Finished) and toks == reference_greedy(tiny_model, q, 20)
    m = d.agree()
    assert m["preemptions"] == len(preempted) >= 1
    assert m["prompt_tokens"] == 16


def test_a_sequence_preempted_while_still_prefilling_counts_too(make_engine,
                                                                tiny_model) -> None:
    """Short of a block for a decoding answer, a newer sequence still prefilling (nothing
    streamed yet) is preempted: a preemption like any, recomputed later, exact."""
    eng = make_engine(num_blocks=6, max_batch_size=2, max_prefill_chunk=2, drafts=False,
                      metrics=KvMetrics())
    by_hand(eng)
    d = Deltas(eng)
    a, b = prompt(4, 61), prompt(16, 62)
    _, out_a = eng.submit(request(a, 12, rid="a", ignore_eos=True))
    eng._drain_inbox(block=False)
    eng._step()
    eng._step()  # "a" prefilled (2 chunks) and decoding
    preempted: list[tuple[str, int]] = []
    preempt = eng._preempt

    def counted(seq):
        preempted.append((seq.req.request_id, seq.generated))
        return preempt(seq)

    eng._preempt = counted
    ((toks_b, fin_b),) = drive(eng, [request(b, 4, rid="b", ignore_eos=True)], lambda e: None)
    toks_a, fin_a = collect(out_a, timeout=1)
    assert toks_a == reference_greedy(tiny_model, a, 12) and isinstance(fin_a, Finished)
    assert toks_b == reference_greedy(tiny_model, b, 4) and isinstance(fin_b, Finished)
    assert ("b", 0) in preempted
    m = d.agree()
    assert m["preemptions"] == len(preempted) and m["prompt_tokens"] == 20


def test_an_answer_out_of_blocks_alone_is_not_a_preemption(make_engine, monkeypatch) -> None:
    """The only decoding answer that cannot get a block ends Overloaded: it is not recomputed
    later, so it is no preemption."""
    eng = make_engine(num_blocks=32, metrics=KvMetrics())
    by_hand(eng)
    d = Deltas(eng)
    _, fin = alone_out_of_blocks(eng, monkeypatch, prompt(6, 96))
    assert isinstance(fin, Failed) and isinstance(fin.error, errors.Overloaded)
    assert d.agree()["preemptions"] == 0


def test_prompt_tokens_count_generate_requests_admitted_only(make_engine) -> None:
    """Prompt tokens count when a Generate request is admitted: not for one refused at submit
    (it can never fit), cancelled or past its deadline while waiting, nor a warm-up prefill."""
    eng = make_engine(num_blocks=16, block_size=4, metrics=KvMetrics())
    d = Deltas(eng)
    with pytest.raises(errors.ResourceExhausted):
        eng.submit(request(prompt(70, 97), 4))
    by_hand(eng)
    sid, gone = eng.submit(request(prompt(9, 98), 4, rid="gone"))
    _, late = eng.submit(request(prompt(11, 99), 4, rid="late", deadline=time.monotonic() - 1))
    eng.cancel(sid)
    eng._drain_inbox(block=False)
    eng._expire()
    for out in (gone, late):
        assert isinstance(collect(out, timeout=1)[1], Failed)
    served = drive(eng, [request(prompt(7, 100), 3),
                         EngineRequest("w", prompt(8, 101), SamplingSpec(max_tokens=0),
                                       prefill_only=True)], lambda e: None)
    assert all(isinstance(f, Finished) for _, f in served)
    m, s = d.metrics(), d.stats()
    assert m["prompt_tokens"] == s["prompt_tokens"] == 7
