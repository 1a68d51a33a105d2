"""The request path's rules at their edges: near misses, draft ids, ignore_eos and stop tokens
in served hits and resumes, what is stored as whole or cut short, and the report's and
metrics' counts (pure logic with the fakes of test_pipeline_paths and test_contracts).

Written for what a mutation audit found no test checking; each was seen failing on a hand-made
mutant of the rule it checks."""

from __future__ import annotations

import logging

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, semantic_pb2

from services.common import errors
from services.orchestrator.pipeline import NOT_SERVED, Policy, Sampling
from services.orchestrator.render import RenderedPrompt
from tests.metric_sample import sample_value
from tests.orchestrator.test_contracts import (
    RecordingSemantic,
    finished,
    one_replica,
    run,
    text_of,
    tokens,
    two_replicas,
)
from tests.orchestrator.test_pipeline_paths import (
    PROMPT,
    TENANT,
    Busy,
    Call,
    RpcError,
    Stub,
    final,
    generate,
    in_order,
    make,
    sized,
)
from tests.orchestrator.test_request_path import hit
from tests.orchestrator.test_request_path import run as run_stop


def test_a_near_miss_with_a_cut_short_entry_is_no_hit_not_served():
    """A near miss (hit=False) is a draft, never a hit: its entry's truncated_at must not
    count a "too_short" hit not served (NOT_SERVED counts hits the model answered instead)."""
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=False, similarity=0.9,
        entry=semantic_pb2.SemanticEntry(id="e3", answer="abc", truncated_at=3)))
    stub, stubs = one_replica()
    orch = make(stubs, semantic=sem)
    before = NOT_SERVED.labels("too_short")._value.get()
    events = run(orch, max_tokens=8)
    assert list(stub.requests[0].draft_token_ids) == list(b"abc")  # still the draft
    assert finished(events).report.draft_entry_id == "e3"
    assert orch.stats.semantic_hits_too_short == 0
    assert NOT_SERVED.labels("too_short")._value.get() == before


def test_a_draft_id_equal_to_the_vocabulary_size_is_dropped():
    """Ids run 0..len(tok)-1: the id len(tok) (256 for the byte fake) has no token and the
    replica refuses the whole request for it."""
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=False, similarity=0.9,
        entry=semantic_pb2.SemanticEntry(id="e7", answer="hi", answer_token_ids=[104, 256])))
    stub = Stub("A", [Call([final("A", 2)])])
    orch = make({"A": stub}, semantic=sem)
    events = run(orch)
    assert list(stub.requests[0].draft_token_ids) == []
    assert finished(events).report.draft_entry_id == ""
    assert orch.stats.degradations["draft_dropped"] == 1


@pytest.mark.parametrize(("max_tokens", "text"), [(16, "hello"), (2, "he")])
def test_a_hit_with_ids_outside_the_vocabulary_is_served_from_its_text(max_tokens, text):
    """A hit on an entry a client stored with ids the model has no token for (the byte fake has
    256) returned those ids to a client asking for token ids, and a hit cut at max_tokens
    decoded its text from them (the real tokenizer gave ""). Its text is served, tokenized
    again as for an entry stored without ids; the replica is not asked."""
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=True, similarity=0.99, entry=semantic_pb2.SemanticEntry(
            id="e8", answer="hello", answer_token_ids=[104, 300, 301, 302, 303])))
    stub, stubs = one_replica()
    orch = make(stubs, semantic=sem)
    events = run(orch, max_tokens=max_tokens)
    assert text_of(events) == text
    assert [t for e in events if hasattr(e, "token_ids") for t in e.token_ids] == list(
        text.encode())
    assert finished(events).report.semantic_hit and not stub.requests


def test_a_hit_s_ids_are_checked_against_the_vocabulary_in_one_pass():
    """The hit's check (581b7d7) and the draft's were the same scan written twice: a hit the
    model answers instead (cut short, here) scanned every id of its answer twice. One pass
    serves both: each id is compared with the vocabulary size once."""
    compared = []

    class Vocab(int):  # `t < vocab` with an int t asks the subclass's reflected __gt__ first
        def __gt__(self, t):
            compared.append(t)
            return int(self) > t

    ids = [104, 101, 108, 108, 111]
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=True, similarity=0.99, entry=semantic_pb2.SemanticEntry(
            id="e9", answer="hello", answer_token_ids=ids, truncated_at=5)))
    stub, stubs = one_replica()
    orch = make(stubs, semantic=sem)
    orch._vocab = Vocab(orch._vocab)
    events = run(orch, max_tokens=16)
    assert list(stub.requests[0].draft_token_ids) == ids  # too short: the model, with a draft
    assert finished(events).report.draft_entry_id == "e9"
    assert compared == ids


def test_an_ignore_eos_answer_lost_right_after_an_eos_token_is_resumed():
    """With ignore_eos the end of sequence is an ordinary token: a replica lost just after
    streaming it has not finished the answer, which resumes on another replica."""
    sem = RecordingSemantic()
    calls = [Call([tokens("hi\x00")], RpcError(grpc.StatusCode.UNAVAILABLE)),
             Call([tokens("yo"), kvpool_pb2.KvGenerateResponse(final=kvpool_pb2.KvGenerateFinal(
                 finish_reason=common_pb2.FINISH_REASON_LENGTH))])]
    stubs, asked = two_replicas(calls)
    orch = make(stubs, semantic=sem)
    events = run(orch, sampling=Sampling(16, 0.0, 1.0, 0, (), True))
    assert len(asked) == 2
    resumed = asked[1].requests[0]
    assert list(resumed.token_ids) == PROMPT + list(b"hi\x00")
    assert resumed.sampling.max_tokens == 13 and resumed.seed_offset == 3
    fin = finished(events)
    assert fin.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert fin.completion_tokens == 5 and fin.report.route == "resume"


def test_a_stop_token_just_past_max_tokens_leaves_the_length_cut():
    """The stop token is the (max_tokens+1)-th token: the model stops at max_tokens first."""
    stub, stubs = one_replica()
    events = run_stop(make(stubs, semantic=hit("abcd.ef")), max_tokens=4, stop=(ord("."),))
    assert stub.requests == []
    assert text_of(events) == "abcd"
    fin = finished(events)
    assert fin.finish_reason == common_pb2.FINISH_REASON_LENGTH and fin.completion_tokens == 4


def test_a_cut_short_hit_holding_the_requests_stop_token_is_served():
    """A hit cut short after 9 tokens serves a request for 16 that stops at "." (token 6): the
    model's answer would end there too. It went to the model as "too_short"."""
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=True, similarity=0.99,
        entry=semantic_pb2.SemanticEntry(id="e1", answer="Paris. It", truncated_at=9)))
    stub, stubs = one_replica()
    orch = make(stubs, semantic=sem)
    events = run_stop(orch, max_tokens=16, stop=(ord("."),))
    assert stub.requests == []
    assert text_of(events) == "Paris."
    fin = finished(events)
    assert fin.finish_reason == common_pb2.FINISH_REASON_STOP and fin.completion_tokens == 6
    assert fin.report.semantic_hit and orch.stats.semantic_hits_too_short == 0
    # Without the stop token the cut answer is still too short for 16 tokens.
    run_stop(orch, max_tokens=16)
    assert len(stub.requests) == 1 and orch.stats.semantic_hits_too_short == 1


def _answer(ids: bytes, reason: int, cached: int = 0) -> kvpool_pb2.KvGenerateResponse:
    return kvpool_pb2.KvGenerateResponse(token_ids=list(ids), final=kvpool_pb2.KvGenerateFinal(
        finish_reason=reason, replica_id="A", cached_tokens=cached))


def test_an_answer_ended_by_a_stop_token_is_stored_as_cut_short():
    """The model would have gone on past the request's stop token: stored whole
    (truncated_at 0), it is served CACHED to later requests that never asked to stop there."""
    sem = RecordingSemantic()
    stub = Stub("A", [Call([_answer(b"hi!", common_pb2.FINISH_REASON_STOP)])])
    run(make({"A": stub}, semantic=sem), sampling=Sampling(16, 0.0, 1.0, 0, (ord("!"),), False))
    assert [(st.answer, st.truncated_at) for st in sem.stores] == [("hi!", 3)]


def test_a_cut_short_sample_does_not_replace_a_hit_cut_at_the_same_length():
    """'a cut-short one not where the lookup hit one at least as long': equal counts."""
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=True, similarity=1.0,
        entry=semantic_pb2.SemanticEntry(id="e1", answer="ab", truncated_at=2)))
    stub, stubs = one_replica()  # "ok", LENGTH
    events = run(make(stubs, semantic=sem), sampling=Sampling(2, 0.8, 1.0, 7, (), False),
                  policy=Policy(store_sampled=True))
    assert len(stub.requests) == 1 and text_of(events) == "ok"  # the sample, not the hit
    assert sem.stores == []


def test_a_whitespace_only_answer_is_not_stored():
    sem = RecordingSemantic()
    stub = Stub("A", [Call([_answer(b" \n ", common_pb2.FINISH_REASON_EOS)])])
    events = run(make({"A": stub}, semantic=sem), max_tokens=16)
    assert text_of(events) == " \n "
    assert sem.stores == [] and finished(events).report.semantic_entry_id == ""


def test_an_answer_of_only_invisible_characters_is_not_stored():
    """A zero-width answer passed `answer.strip()` and was stored: a hit on it serves nothing
    a reader sees. Not stored, as a whitespace-only one is not; served as generated."""
    sem = RecordingSemantic()
    answer = "\u200b\u200b\n".encode()
    stub = Stub("A", [Call([_answer(answer, common_pb2.FINISH_REASON_EOS)])])
    events = run(make({"A": stub}, semantic=sem), max_tokens=16)
    assert text_of(events) == "\u200b\u200b\n"
    assert sem.stores == [] and finished(events).report.semantic_entry_id == ""


def test_a_resumed_replicas_cached_tokens_never_exceed_the_prompt():
    """A resume sends the prompt plus the tokens already streamed: the replica may report
    more cached tokens than the client's prompt has; the report counts the prompt's."""
    calls = [Call([tokens("he")], RpcError(grpc.StatusCode.UNAVAILABLE)),
             Call([_answer(b"llo", common_pb2.FINISH_REASON_LENGTH,
                           cached=len(PROMPT) + 1)])]
    stubs, asked = two_replicas(calls)
    orch = make(stubs, semantic=RecordingSemantic())
    fin = finished(run(orch, max_tokens=16))
    assert len(asked) == 2 and fin.report.route == "resume"
    assert fin.report.cached_tokens == len(PROMPT) == fin.prompt_tokens
    assert orch.stats.cached_tokens == len(PROMPT)


def test_a_whole_prompt_matched_and_all_but_its_last_token_reused_is_no_shortfall():
    """A replica computes at least the prompt's last token: a 96-token prompt the index
    holds whole, answered with 95 cached, evicted nothing."""
    from types import SimpleNamespace


    def short() -> float:
        return sample_value(
            "tiercache_orchestrator_prefix_match_shortfall_tokens_total") or 0.0

    prompt = list(range(1, 97))
    prefix = SimpleNamespace(
        timeout_s=0.5, match=lambda h, m, timeout=None, probe=False, on_call=None: {"A": 96})
    stub = Stub("A", [Call([_answer(b"ok", common_pb2.FINISH_REASON_LENGTH, cached=95)])])
    before = short()
    fin = finished(run(make({"A": stub}, prefix=prefix),
                        prompt=RenderedPrompt(prompt, "q", "ctx")))
    assert (fin.report.index_matched_tokens, fin.report.cached_tokens) == (96, 95)
    assert short() == before


def test_a_request_reusing_exactly_min_prefix_tokens_counts_as_a_prefix_hit():
    """min_prefix_tokens (32 in `make`) is the least a useful prefix hit reuses."""
    stub = Stub("A", [Call([_answer(b"ok", common_pb2.FINISH_REASON_LENGTH, cached=32)])])
    orch = make({"A": stub})
    run(orch, max_tokens=16)
    assert orch.stats.requests["prefix_hit"] == 1 and orch.stats.requests["cold"] == 0


def test_an_answer_ended_at_eos_is_stored_whole():
    """truncated_at 0 means whole: an answer that ended at the end of sequence stored as cut
    would be served LENGTH, and never to a request wanting more tokens than it has."""
    sem = RecordingSemantic()
    stub = Stub("A", [Call([_answer(b"ok\x00", common_pb2.FINISH_REASON_EOS)])])
    run(make({"A": stub}, semantic=sem), max_tokens=16)
    assert [(st.answer, st.truncated_at) for st in sem.stores] == [("ok", 0)]


def test_an_ignore_eos_answer_is_not_stored_when_no_end_of_sequence_id_is_known():
    """Without an EOS id the answer may have run past the model's end unseen: not stored."""
    from tests.orchestrator.test_pipeline_paths import Tok

    class NoEos(Tok):
        eos_token_id = None

    sem = RecordingSemantic()
    stub, stubs = one_replica()  # "ok", LENGTH
    run(make(stubs, semantic=sem, tok=NoEos()), sampling=Sampling(2, 0.0, 1.0, 0, (), True))
    assert len(stub.requests) == 1 and sem.stores == []


def test_a_request_every_pool_refuses_takes_back_its_dispatch_credit():
    """A replica that refuses a request outright (too big for every pool) computed nothing of
    its prompt: its credit "sent there moments ago" drew the next request sharing the prompt
    there (counted as a match the replica then fell short of), for up to dispatch_memory_s.
    A credit the prompt had there before (an earlier request's) stays."""
    class TooBig(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return "token_ids: prompt + max_tokens need 300 KV blocks, the pool has 200"

    orch = make({"A": Stub("A", [Call([], TooBig())])})
    hashes = orch.hasher.hashes(PROMPT, TENANT.cache_salt)
    with pytest.raises(errors.TierCacheError, match="need 300 KV blocks"):
        generate(orch, [])
    assert orch.dispatched.match(hashes) == {}

    held = make({"A": Stub("A", [Call([], TooBig())])})
    held.dispatched.record("A", hashes[:2])  # an earlier request's prompt, sent there
    with pytest.raises(errors.TierCacheError, match="need 300 KV blocks"):
        generate(held, [])
    assert held.dispatched.match(hashes) == {"A": 32}


@pytest.mark.parametrize("client_set", [True, False])
def test_a_kv_pool_refusal_names_max_tokens_as_the_client_gave_it_or_not(client_set):
    """A request no pool can hold said "prompt + max_tokens need 19 KV blocks" to a client
    that had set no max_tokens (the server's default, 256, was too much for the pool): it was
    told to change a field it never sent. Set, the client's field is named; unset, the
    default is said to be one, both on a replica's own verdict and on giving up."""
    import time

    from services.orchestrator.pipeline import _give_up

    said = ("token_ids: prompt (37 tokens) + sampling.max_tokens (256) need 19 KV blocks, the "
            "pool has 16; sampling.max_tokens of at most 220 fits")

    class TooBig(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return said

    sampling = Sampling(256, 0.0, 1.0, 0, (), False, max_tokens_set=client_set)
    orch = make({"A": Stub("A", [Call([], TooBig())])})
    with pytest.raises(errors.TierCacheError) as ei:
        list(orch.generate(
            tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"), sampling=sampling,
            policy=Policy(), session_id="s", return_token_ids=True, request_id="rid",
            deadline=time.monotonic() + 30, on_cancel=lambda fn: None))
    gave_up = _give_up(TooBig(), False, "busy", "unavailable", sampling)
    for e in (ei.value, gave_up):
        assert e.code == "RESOURCE_EXHAUSTED"
        assert str(e) == "prompt (rendered messages): prompt (37 tokens) + " + (
            "sampling.max_tokens (256)" if client_set else
            "the default max_tokens (256; the request set no sampling.max_tokens)") + (
            " need 19 KV blocks, the pool has 16; sampling.max_tokens of at most 220 fits")


def test_a_call_cancelled_because_its_replica_was_found_hung_is_logged_as_hung(caplog):
    """The poller declares A hung and cancels its call: the failover line said gRPC's own
    "CANCELLED: Locally cancelled by application!", as if someone had asked for the cancel,
    and not that the replica was hung."""
    import logging
    import time
    from types import SimpleNamespace

    from tests.orchestrator.test_pipeline_paths import TENANT, HungCall

    why = "hung: 3 Stats polls in a row unanswered within 2s (replica_hung_polls 3)"

    class HangsAsDeclaredDown(Stub):
        def Generate(self, req, timeout=None, metadata=None):  # noqa: N802
            self.requests.append(req)
            a.health.fail(why, hold=True)  # the poller, right now
            orch.replicas._notify_down(a)
            return HungCall()

    orch = make({"A": HangsAsDeclaredDown("A", []), "B": Stub("B", [Call([final("B", 2)])])})
    a = orch.replicas.by_id("A")
    orch.routing = SimpleNamespace(choose=lambda views, seen, aff, exclude, *rest: next(
        (SimpleNamespace(replica_id=r, route="least_loaded", matched_tokens=0)
         for r in ("A", "B") if r not in exclude), None))
    with caplog.at_level(logging.WARNING, logger="services.orchestrator"):
        events = list(orch.generate(
            tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
            sampling=Sampling(4, 0.0, 1.0, 0, (), False), policy=Policy(), session_id="s",
            return_token_ids=True, request_id="rid", deadline=time.monotonic() + 5,
            on_cancel=lambda fn: None))
    assert events[-1].report.replica_id == "B"
    lines = [r.getMessage() for r in caplog.records if "replica A failed" in r.getMessage()]
    assert lines == [f"replica A failed (cancelled by this orchestrator: {why}) after 0 "
                     "tokens; attempt 2"]
    # Our own cancel is no reason of A's: it was logged as one ("A is still unhealthy, now:
    # Locally cancelled by application!"), taking a slot of the few new reasons said.
    said = [r.getMessage() for r in caplog.records if r.name.endswith(".backends")]
    assert said and all(why in line for line in said), said
    assert a.health.last_error == why


def test_a_request_every_replica_refused_as_busy_counts_once_as_replicas_busy():
    """A burst past every replica's queue reached clients as RESOURCE_EXHAUSTED "every kvpool
    replica is busy" but counted in no refusal reason: only busy_replica degradations, one per
    replica tried (two for this request; a request that then found room counted one too). It
    counts once, under its tenant, as replicas_busy; a request refused by one replica and
    served by another counts nothing there."""
    from tests.orchestrator.test_pipeline_paths import Busy

    labels = {"tenant": TENANT.name, "reason": "replicas_busy"}
    before = sample_value("tiercache_orchestrator_rejections_total", labels) or 0
    both = make({r: Stub(r, [Call([], Busy())]) for r in ("A", "B")})
    with pytest.raises(errors.Overloaded, match="every kvpool replica is busy"):
        generate(both, [])
    assert sample_value("tiercache_orchestrator_rejections_total", labels) == before + 1
    assert both.stats.degradations["busy_replica"] == 2
    served = make({"A": Stub("A", [Call([], Busy())]),
                   "B": Stub("B", [Call([final("B", 2)])])})
    generate(served, [])
    assert sample_value("tiercache_orchestrator_rejections_total", labels) == before + 1


def test_a_request_refused_as_busy_until_its_attempts_ran_out_counts_as_replicas_busy():
    """The other way to "every replica busy": max_attempts used up with replicas left untried
    ("every kvpool replica tried is busy") is the same refusal, counted once too."""
    from tests.orchestrator.test_pipeline_paths import Busy

    labels = {"tenant": TENANT.name, "reason": "replicas_busy"}
    before = sample_value("tiercache_orchestrator_rejections_total", labels) or 0
    orch = make({r: Stub(r, [Call([], Busy())]) for r in ("A", "B", "C")}, max_attempts=2)
    with pytest.raises(errors.Overloaded, match="every kvpool replica tried is busy") as e:
        generate(orch, [])
    # Said once: the replica's refusal already says to retry ("...; retry later" came twice).
    assert str(e.value).count("retry later") == 1, str(e.value)
    assert sample_value("tiercache_orchestrator_rejections_total", labels) == before + 1
    assert orch.stats.degradations["busy_replica"] == 2


def test_a_request_no_pool_can_hold_counts_once_as_kv_pool():
    """A replica's own RESOURCE_EXHAUSTED (prompt + max_tokens more KV blocks than its pool
    has) reached the client as it came but was counted in no rejections_total reason: a
    fixed limit an operator could not see by reason. It counts once as kv_pool, whether the
    only replica refused it or every pool tried did; a refusal served by a larger pool counts
    nothing there."""
    class TooBig(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return "token_ids: prompt + max_tokens need 300 KV blocks, the pool has 200"

    labels = {"tenant": TENANT.name, "reason": "kv_pool"}
    before = sample_value("tiercache_orchestrator_rejections_total", labels) or 0
    with pytest.raises(errors.TierCacheError, match="need 300 KV blocks") as e:
        generate(make({"A": Stub("A", [Call([], TooBig())])}), [])
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert sample_value("tiercache_orchestrator_rejections_total", labels) == before + 1

    larger = sized(make({"A": Stub("A", [Call([], TooBig())]),
                         "B": Stub("B", [Call([final("B", 2)])])}), {"A": 200, "B": 400})
    generate(larger, [])
    assert sample_value("tiercache_orchestrator_rejections_total", labels) == before + 1
    every = sized(make({"A": Stub("A", [Call([], TooBig())]),
                        "B": Stub("B", [Call([], TooBig())])}), {"A": 200, "B": 400})
    with pytest.raises(errors.TierCacheError, match="need 300 KV blocks"):
        generate(every, [])
    assert sample_value("tiercache_orchestrator_rejections_total", labels) == before + 2


def test_a_busy_replicas_hand_offs_are_thinned_in_the_log(caplog):
    """A burst past a replica's queue logged "replica X is busy ...; trying another" at every
    hand-off (1,967 lines in 25 s on a live stack): at most 10 per replica every 10 s, then
    a count, as the other per-request lines of a degraded dependency."""
    from tests.orchestrator.test_pipeline_paths import Busy

    with caplog.at_level(logging.INFO, logger="services.orchestrator.pipeline"):
        for _ in range(15):
            orch = make({"busy-q": Stub("busy-q", [Call([], Busy())]),
                         "B": Stub("B", [Call([final("B", 2)])])})
            orch.routing = in_order("busy-q", "B")
            generate(orch, [])
            assert orch.stats.degradations["busy_replica"] == 1
    said = [r for r in caplog.records if r.getMessage().startswith("replica busy-q is busy")]
    assert 1 <= len(said) <= 10


def test_a_request_when_every_replica_serves_another_model_is_refused_naming_both_ids():
    """Mid-roll to new weights (every replica restarted on model "m2", the orchestrator still
    on "m"): routing fell back to every replica "as none is healthy", each refused the request
    (model_id), the orchestrator logged an ERROR and a WARNING per replica per request, and
    the client got UNAVAILABLE "...; last: FAILED_PRECONDITION", naming no model. The
    replicas are not asked; the client is told both ids and what to set, still UNAVAILABLE
    (retryable: in a planned roll a retry succeeds once a rolled orchestrator takes it)."""
    stubs = {r: Stub(r, [Call([final(r, 2)])]) for r in ("A", "B")}
    orch = make(stubs)
    for r in orch.replicas.replicas:
        r.replica_id = r.address
        r.misfit = f"{r.address}: it serves model 'm2', this orchestrator 'm'"
        r.health.fail(r.misfit, hold=True)
    with pytest.raises(errors.Unavailable) as e:
        generate(orch, [])
    assert "A: it serves model 'm2', this orchestrator 'm'" in str(e.value)
    assert "TIERCACHE_ORCHESTRATOR_MODEL" in str(e.value)
    assert stubs["A"].requests == [] and stubs["B"].requests == []
    # B merely down, not known to serve another model: still tried as a last resort.
    orch.replicas.replicas[1].misfit = ""
    assert finished(generate(orch, [])).report.replica_id == "B"
    assert stubs["A"].requests == [] and len(stubs["B"].requests) == 1



@pytest.mark.parametrize("first", ["lost", "lost_mid_answer", "busy"])
def test_a_small_pool_after_the_larger_one_failed_is_not_too_big(first):
    """Routed first to the replica with the larger pool (it held the prefix), lost there
    (before or after its first token) or found busy, then refused by a smaller pool: the
    small pool's "need 300 KV blocks" was the client's answer, a request that fits the
    cluster refused as too big for good (its figures those of the resumed request: prompt
    plus the tokens streamed). Unavailable or busy (retry later) instead, as when the small
    pool was tried first."""
    class TooBig(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return "token_ids: prompt + max_tokens need 300 KV blocks, the pool has 200"

    msgs = ([kvpool_pb2.KvGenerateResponse(token_ids=[ord("o")])]
            if first == "lost_mid_answer" else [])
    fail = Busy() if first == "busy" else RpcError(grpc.StatusCode.UNAVAILABLE)
    orch = sized(make({"A": Stub("A", [Call([], TooBig())]), "B": Stub("B", [Call(msgs, fail)])}),
                 {"A": 200, "B": 400})
    orch.routing = in_order("B", "A")
    with pytest.raises(errors.TierCacheError) as e:
        generate(orch, [])
    assert "need 300 KV blocks" not in str(e.value)
    assert e.value.code == ("RESOURCE_EXHAUSTED" if first == "busy" else "UNAVAILABLE")
    assert "last: RESOURCE_EXHAUSTED" not in str(e.value)
    if first != "busy":
        # "(tried kvpool#1, kvpool#0); last: UNAVAILABLE" read as the small pool's failure
        # and did not say the request needs the pool that failed.
        assert str(e.value).endswith(
            "; last: kvpool#1, with a larger KV pool, failed (UNAVAILABLE)"), str(e.value)


def test_the_report_says_the_threshold_applied_and_a_guard_refusal_above_it():
    """The CacheReport carried the similarity only: not what it was held to, nor that the
    guard or verifier refused a candidate above its threshold (a model answer after a
    similarity past the threshold read as a bug). The tier's reply is passed on, on a miss
    and on a hit; a request with no lookup leaves the fields unset."""
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=False, similarity=0.981, threshold=0.95, tier="standard", guard_rejected=True,
        guard_reason="numbers differ"))
    _, stubs = one_replica()
    rep = finished(run(make(stubs, semantic=sem))).report
    assert (rep.semantic_tier, rep.semantic_guard_rejected, rep.semantic_guard_reason) == (
        "standard", True, "numbers differ")
    assert rep.semantic_threshold == pytest.approx(0.95)
    sem = hit("cached")
    sem.answer.threshold, sem.answer.tier = 0.93, "standard"
    rep = finished(run(make(one_replica()[1], semantic=sem))).report
    assert rep.semantic_hit and rep.semantic_threshold == pytest.approx(0.93)
    assert (rep.semantic_tier, rep.semantic_guard_rejected) == ("standard", False)
    rep = finished(run(make(one_replica()[1], semantic=sem),
                       policy=Policy(skip_semantic_lookup=True))).report
    assert (rep.semantic_threshold, rep.semantic_tier) == (0.0, "")


@pytest.mark.parametrize("max_attempts", [1, 2])
def test_a_pool_too_small_with_a_larger_one_left_does_not_use_up_the_attempts(max_attempts):
    """A replica whose pool is too small for the request, a larger one left to try, is a hop
    to that pool, not a failed attempt: counted as one, the attempts ran out first (here one
    small pool at max_attempts 1; two at 2) and the client was told "need 300 KV blocks"
    (RESOURCE_EXHAUSTED for good), though the largest replica holds the request."""
    class TooBig(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return "token_ids: prompt + max_tokens need 300 KV blocks, the pool has 200"

    small = ("A", "B")[:max_attempts]
    stubs = {r: Stub(r, [Call([], TooBig())]) for r in small}
    stubs["C"] = Stub("C", [Call([final("C", 2)])])
    orch = sized(make(stubs, max_attempts=max_attempts),
                 {"A": 100, "B": 200, "C": 400})
    orch.routing = in_order(*small, "C")
    assert finished(generate(orch, [])).report.replica_id == "C"
    assert orch.stats.degradations["larger_pool"] == max_attempts
    # Failures still count: a lost replica after the small pool ends the request at 1.
    lost = {"A": Stub("A", [Call([], TooBig())]),
            "B": Stub("B", [Call([], RpcError(grpc.StatusCode.UNAVAILABLE))]),
            "C": Stub("C", [Call([final("C", 2)])])}
    orch = sized(make(lost, max_attempts=1), {"A": 100, "B": 400, "C": 400})
    orch.routing = in_order("A", "B", "C")
    with pytest.raises(errors.Unavailable, match=r"failed 1 times \(tried kvpool#0, kvpool#1\)"):
        generate(orch, [])
    assert lost["C"].requests == []


@pytest.mark.parametrize("when", ["after_the_refusal", "before_it"])
def test_a_small_pool_with_the_larger_one_down_is_unavailable_not_too_big(when):
    """The larger pool's replica declared down (its Stats polls failed) between a small
    pool's refusal and the next routing decision, or already before it with only small
    pools healthy: the small pool's "need 300 KV blocks" was the client's answer
    (RESOURCE_EXHAUSTED, never retried), though the request fits once that replica is back.
    Unavailable, naming that replica, as when the larger pool was tried and lost."""
    from types import SimpleNamespace

    class TooBig(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return "token_ids: prompt + max_tokens need 300 KV blocks, the pool has 200"

    class DownsB(Stub):
        def Generate(self, req, timeout=None, metadata=None):  # noqa: N802
            if when == "after_the_refusal" and not self.requests:  # the first request only
                orch.replicas.by_id("B").health.fail("Connection refused", hold=True)
            return super().Generate(req, timeout, metadata)

    stubs = {"A": DownsB("A", [Call([], TooBig())]), "B": Stub("B", [Call([final("B", 2)])]),
             "C": Stub("C", [Call([], TooBig())])}
    orch = sized(make(stubs), {"A": 200, "B": 400, "C": 200})
    if when == "before_it":
        orch.replicas.by_id("B").health.fail("Connection refused", hold=True)
    # Routing as the real one sees it: healthy replicas only (`ReplicaSet.views`).
    orch.routing = SimpleNamespace(choose=lambda views, seen, aff, exclude, *rest: next(
        (SimpleNamespace(replica_id=v.replica_id, route="least_loaded", matched_tokens=0)
         for v in sorted(views, key=lambda v: v.replica_id) if v.replica_id not in exclude),
        None))
    with pytest.raises(errors.Unavailable) as e:
        generate(orch, [])
    assert "need 300 KV blocks" not in str(e.value)
    assert "kvpool#1" in str(e.value) and "Connection refused" not in str(e.value)
    assert stubs["B"].requests == [] and len(stubs["C"].requests) == 1
    # The larger pool back: the same request is served there.
    orch.replicas.by_id("B").health.ok()
    stubs["A"].calls, stubs["C"].calls = [Call([], TooBig())], [Call([], TooBig())]
    assert finished(generate(orch, [])).report.replica_id == "B"


def test_a_match_the_index_refuses_is_not_the_index_down(caplog):
    """A prompt of more blocks than the prefix index's max_blocks: the live index refuses its
    Match (INVALID_ARGUMENT) and the request was logged "prefix index unreachable" and
    counted as index_down, an outage alert for a healthy index. Ring routing still, said
    and counted as the index's refusal (index_refused)."""
    from types import SimpleNamespace

    class Refused(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.INVALID_ARGUMENT)

        def details(self) -> str:
            return "block_hashes: more than 4 blocks"

    def refuse(h, m, timeout=None, probe=False, on_call=None):
        raise Refused()

    stub, stubs = one_replica()
    orch = make(stubs, prefix=SimpleNamespace(timeout_s=0.5, match=refuse))
    with caplog.at_level(logging.INFO, logger="services.orchestrator.pipeline"):
        assert orch.owner(TENANT, PROMPT) is not None  # a Warm's probe: ring routing
        run(orch)
    assert len(stub.requests) == 1
    assert orch.stats.degradations["index_down"] == 0
    assert orch.stats.degradations["index_refused"] == 1
    said = [r.getMessage() for r in caplog.records if "prefix index" in r.getMessage()]
    assert said and not any("unreachable" in s for s in said), said
    assert all("refused" in s and "more than 4 blocks" in s for s in said), said


def test_the_report_says_why_a_hit_was_not_served_and_a_threshold_from_the_request():
    """A hit the orchestrator declined (too short for the request, a sampled request, one going
    past the answer's end of sequence) reported its similarity above the threshold, no refusal
    and a model answer: nothing said why. And a request's own threshold read as its tier's.
    semantic_not_served names the reason (NOT_SERVED's label); semantic_threshold_from_request
    says where the threshold came from."""
    def report(answer: str, *, cut: int = 0, policy: Policy = Policy(), **sampling):
        sem = hit(answer)
        sem.answer.entry.truncated_at = cut
        sem.answer.threshold, sem.answer.tier = 0.9, "standard"
        s = Sampling(**{"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": 0,
                        "stop_token_ids": (), "ignore_eos": False, **sampling})
        return finished(run(make(one_replica()[1], semantic=sem), policy=policy,
                            sampling=s)).report

    assert report("abc", cut=3).semantic_not_served == "too_short"
    assert report("abc", ignore_eos=True).semantic_not_served == "ignore_eos"
    assert report("abc", temperature=0.7, seed=5).semantic_not_served == "sampled"
    rep = report("abcdefgh")
    assert rep.semantic_hit and rep.semantic_not_served == ""
    assert not rep.semantic_threshold_from_request
    rep = report("abc", cut=3, policy=Policy(semantic_threshold=0.9))
    assert rep.semantic_threshold_from_request and rep.semantic_not_served == "too_short"
    rep = report("abc", policy=Policy(semantic_threshold=0.9, skip_semantic_lookup=True))
    assert not rep.semantic_threshold_from_request  # no lookup: nothing was held to it


def _too_big(need: int, pool: int) -> RpcError:
    """A replica's refusal of a request its pool can never hold, in kvpool's words."""
    class TooBig(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return (f"token_ids: prompt (9 tokens) + sampling.max_tokens (8) need {need} KV "
                    f"blocks, the pool has {pool}")
    return TooBig()


def _healthy_in_order():
    """Routing as the real one sees it: healthy replicas only (`ReplicaSet.views`), by id."""
    from types import SimpleNamespace

    return SimpleNamespace(choose=lambda views, seen, aff, exclude, *rest: next(
        (SimpleNamespace(replica_id=v.replica_id, route="least_loaded", matched_tokens=0)
         for v in sorted(views, key=lambda v: v.replica_id) if v.replica_id not in exclude),
        None))


def test_a_small_pool_with_the_larger_one_down_is_logged_and_counted_as_such(caplog):
    """The larger pool's replica down: the small pool's refusal was logged "trying a larger
    pool" and counted as larger_pool, a hand-off, though no larger pool was left to try and
    the request ended UNAVAILABLE. Said naming the replica down and counted as
    larger_pool_down (a label value of the same metric); with it up, as before."""
    labels = {"kind": "larger_pool_down"}
    before = sample_value("tiercache_orchestrator_degradations_total", labels) or 0
    # Replica ids of their own: the hand-off lines are thinned per replica (`_LOAD_LINES`).
    stubs = {"small-a": Stub("small-a", [Call([], _too_big(300, 200))]),
             "large-b": Stub("large-b", [Call([final("large-b", 2)])])}
    orch = sized(make(stubs), {"small-a": 200, "large-b": 400})
    orch.replicas.by_id("large-b").health.fail("Connection refused", hold=True)
    orch.routing = _healthy_in_order()
    with caplog.at_level(logging.INFO, logger="services.orchestrator.pipeline"):
        with pytest.raises(errors.Unavailable):
            generate(orch, [])
    said = [r.getMessage() for r in caplog.records if "cannot hold" in r.getMessage()]
    assert said and "trying a larger pool" not in said[-1], said
    assert "no larger pool to try: large-b, with a larger pool, is down" in said[-1], said
    assert orch.stats.degradations["larger_pool_down"] == 1
    assert orch.stats.degradations["larger_pool"] == 0
    assert sample_value("tiercache_orchestrator_degradations_total", labels) == before + 1

    caplog.clear()
    orch.replicas.by_id("large-b").health.ok()
    stubs["small-a"].calls = [Call([], _too_big(300, 200))]
    orch.routing = in_order("small-a", "large-b")
    with caplog.at_level(logging.INFO, logger="services.orchestrator.pipeline"):
        assert finished(generate(orch, [])).report.replica_id == "large-b"
    said = [r.getMessage() for r in caplog.records if "cannot hold" in r.getMessage()]
    assert said and said[-1].endswith("; trying a larger pool"), said
    assert orch.stats.degradations["larger_pool"] == 1
    assert orch.stats.degradations["larger_pool_down"] == 1


@pytest.mark.parametrize("larger", ["down", "lost_here", "up"])
def test_a_request_past_every_pool_is_too_big_for_good_with_the_larger_one_down(larger):
    """A request needing more KV blocks than every pool, the largest's replica down (or lost
    on this request) included: UNAVAILABLE naming that replica, retried by clients forever,
    though it never fits once that replica is back. The sizes are known (the replicas' last
    Stats): the same RESOURCE_EXHAUSTED, in the replica's words, as with that replica up."""
    stubs = {"A": Stub("A", [Call([], _too_big(500, 200))]),
             "B": Stub("B", [Call([], RpcError(grpc.StatusCode.UNAVAILABLE) if larger ==
                                  "lost_here" else _too_big(500, 400))])}
    orch = sized(make(stubs), {"A": 200, "B": 400})
    if larger == "down":
        orch.replicas.by_id("B").health.fail("Connection refused", hold=True)
        orch.routing = _healthy_in_order()
    else:
        orch.routing = in_order("B", "A") if larger == "lost_here" else in_order("A", "B")
    with pytest.raises(errors.TierCacheError) as e:
        generate(orch, [])
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert "need 500 KV blocks, the pool has" in str(e.value)
    assert not isinstance(e.value, errors.Unavailable)
    if larger == "down":
        assert stubs["B"].requests == []
    # One the larger pool holds stays UNAVAILABLE while it is down (it fits once it is back).
    if larger != "up":
        stubs = {"A": Stub("A", [Call([], _too_big(300, 200))]),
                 "B": Stub("B", [Call([], RpcError(grpc.StatusCode.UNAVAILABLE))])}
        orch = sized(make(stubs), {"A": 200, "B": 400})
        if larger == "down":
            orch.replicas.by_id("B").health.fail("Connection refused", hold=True)
            orch.routing = _healthy_in_order()
        else:
            orch.routing = in_order("B", "A")
        with pytest.raises(errors.Unavailable):
            generate(orch, [])


def test_a_larger_pool_lost_after_the_small_ones_refusal_keeps_a_refusal_past_it():
    """The small pool refused first (a larger one left), then the larger pool's replica was
    lost: "too big" was dropped for UNAVAILABLE, though the refusal needed more blocks than
    the lost pool has. It stands (RESOURCE_EXHAUSTED); one the lost pool could hold does
    not."""
    for need, code in ((500, "RESOURCE_EXHAUSTED"), (300, "UNAVAILABLE")):
        stubs = {"A": Stub("A", [Call([], _too_big(need, 200))]),
                 "B": Stub("B", [Call([], RpcError(grpc.StatusCode.UNAVAILABLE))])}
        orch = sized(make(stubs), {"A": 200, "B": 400})
        orch.routing = in_order("A", "B")
        with pytest.raises(errors.TierCacheError) as e:
            generate(orch, [])
        assert e.value.code == code, (need, str(e.value))


@pytest.mark.parametrize("larger", ["past_it", "shrunk"])
def test_attempts_used_up_on_a_request_no_pool_can_hold_is_too_big_not_unavailable(larger):
    """max_attempts 1: the small pool refused (a larger one left to try), then the larger
    pool's replica was lost, its pool (as its Stats said, or say once it came back smaller)
    too small for the request as well. The attempts ran out and the client was told
    UNAVAILABLE, which it retries, though the request can never fit: the small pool's refusal
    (RESOURCE_EXHAUSTED, for good). One the lost pool may hold stays UNAVAILABLE."""
    need = 500 if larger == "past_it" else 300

    class Shrinks(Stub):
        def Generate(self, req, timeout=None, metadata=None):  # noqa: N802
            if larger == "shrunk":  # its next Stats: a pool smaller than the request's need
                orch.replicas.by_id("B").stats.blocks_total = 250
            return super().Generate(req, timeout, metadata)

    stubs = {"A": Stub("A", [Call([], _too_big(need, 200))]),
             "B": Shrinks("B", [Call([], RpcError(grpc.StatusCode.UNAVAILABLE))])}
    orch = sized(make(stubs, max_attempts=1), {"A": 200, "B": 400})
    with pytest.raises(errors.TierCacheError) as e:
        generate(orch, [])
    assert e.value.code == "RESOURCE_EXHAUSTED", str(e.value)
    assert f"need {need} KV blocks" in str(e.value)
    stubs = {"A": Stub("A", [Call([], _too_big(300, 200))]),
             "B": Stub("B", [Call([], RpcError(grpc.StatusCode.UNAVAILABLE))])}
    orch = sized(make(stubs, max_attempts=1), {"A": 200, "B": 400})
    with pytest.raises(errors.Unavailable):
        generate(orch, [])


def test_a_request_past_every_pool_is_refused_at_once_with_the_larger_one_up():
    """Both replicas up, the request needing more KV blocks than either pool (as their last
    Stats said): the small pool's refusal handed it to the larger one, one call more for the
    same RESOURCE_EXHAUSTED. Refused at once, the larger pool not called, counted as no
    hand-off; one the larger pool holds (or a refusal without the figure) is still handed
    on."""
    stubs = {"A": Stub("A", [Call([], _too_big(500, 200))]),
             "B": Stub("B", [Call([], _too_big(500, 400))])}
    orch = sized(make(stubs), {"A": 200, "B": 400})
    with pytest.raises(errors.TierCacheError) as e:
        generate(orch, [])
    assert e.value.code == "RESOURCE_EXHAUSTED" and "need 500 KV blocks" in str(e.value)
    assert stubs["B"].requests == []
    assert orch.stats.degradations["larger_pool"] == 0
    class NoFigure(RpcError):  # another build's words: the need unknown
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return "token_ids: too long for this pool"

    for refusal in (_too_big(300, 200), NoFigure()):
        stubs = {"A": Stub("A", [Call([], refusal)]), "B": Stub("B", [Call([final("B", 2)])])}
        orch = sized(make(stubs), {"A": 200, "B": 400})
        assert finished(generate(orch, [])).report.replica_id == "B"
        assert orch.stats.degradations["larger_pool"] == 1


def _refusal(prompt: int, max_tokens: int, pool: int) -> RpcError:
    """kvpool's refusal (engine `submit`, 16-token blocks) of a request past a pool."""
    need = -(-(prompt + max_tokens - 1) // 16)
    room = pool * 16 - prompt + 1
    fits = (f"; sampling.max_tokens of at most {room} fits" if room > 0
            else "; the prompt alone is too long for it")
    said = (f"token_ids: prompt ({prompt} tokens) + sampling.max_tokens ({max_tokens}) need "
            f"{need} KV blocks, the pool has {pool}{fits}")

    class Refused(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return said
    return Refused()


@pytest.mark.parametrize("larger", ["down", "up"])
def test_a_refusal_past_every_pool_names_the_largest_pools_figures(larger):
    """A request past every pool refused by the small pool, the larger one down (or up: not
    called, see above): the client was told the small pool's figures ("the pool has 8; the
    prompt alone is too long for it"), though under the largest pool a max_tokens of 81
    fits. The words the largest pool gives, its figures; a refusal by the largest pool
    itself is passed on as it came."""
    stubs = {"A": Stub("A", [Call([], _refusal(1200, 200, 8))]),
             "B": Stub("B", [Call([final("B", 2)])])}
    orch = sized(make(stubs), {"A": 8, "B": 80})
    if larger == "down":
        orch.replicas.by_id("B").health.fail("Connection refused", hold=True)
        orch.routing = _healthy_in_order()
    with pytest.raises(errors.TierCacheError) as e:
        generate(orch, [])
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert str(e.value) == (
        "prompt (rendered messages): prompt (1200 tokens) + sampling.max_tokens (200) need 88 "
        "KV blocks, the pool has 80; sampling.max_tokens of at most 81 fits"), str(e.value)
    assert stubs["B"].requests == []
    stubs = {"B": Stub("B", [Call([], _refusal(1200, 200, 80))]),
             "A": Stub("A", [Call([], _refusal(1200, 200, 8))])}
    orch = sized(make(stubs), {"A": 8, "B": 80})
    orch.routing = in_order("B", "A")
    with pytest.raises(errors.TierCacheError) as e:
        generate(orch, [])
    assert str(e.value).endswith("the pool has 80; sampling.max_tokens of at most 81 fits")


def test_the_report_names_the_replica_whose_tokens_end_the_answer_and_a_hand_off_as_retry():
    """Pinned (checked right, not changed): a replica lost after the answer's last token
    (its final message, which carries the replica id, lost) is named in the report: it made
    the answer's end (here after a resume from A), not a replica that did nothing. And a
    request a busy or too-small replica handed to another reports route "retry", as the
    proto comment of `route` says (the replica first chosen did not serve it), its
    degradations saying why (busy_replica / larger_pool), not retry."""
    tok = [kvpool_pb2.KvGenerateResponse(token_ids=[c]) for c in b"abcd"]
    stubs = {"A": Stub("A", [Call(tok[:2], RpcError(grpc.StatusCode.UNAVAILABLE))]),
             "B": Stub("B", [Call(tok[2:], RpcError(grpc.StatusCode.UNAVAILABLE))])}
    orch = make(stubs)
    orch.routing = in_order("A", "B")
    rep = finished(generate(orch, [])).report
    # Its public id (never polled here, B's own id unknown: "kvpool#1"), B's tokens "cd".
    assert (rep.replica_id, rep.route) == ("kvpool#1", "resume")
    assert list(rep.degradations) == ["resume"]
    for first, kind in ((Busy(), "busy_replica"), (_too_big(300, 200), "larger_pool")):
        stubs = {"A": Stub("A", [Call([], first)]), "B": Stub("B", [Call([final("B", 2)])])}
        rep = finished(generate(sized(make(stubs), {"A": 200, "B": 400}), [])).report
        assert (rep.replica_id, rep.route, list(rep.degradations)) == ("B", "retry", [kind])


def test_a_refusal_by_a_pool_its_stats_said_larger_is_handed_to_a_pool_that_holds_it():
    """Review: a replica restarted with a smaller pool (100 blocks), its Stats not polled
    since (400), refused a request needing 200 blocks: judged by its old size, B's pool (300)
    was not larger, and the request was refused for good, though B holds it. The refusal's own
    "the pool has 100" is the refusing pool's size; its last Stats only where it says none."""
    stubs = {"A": Stub("A", [Call([], _refusal(3000, 200, 100))]),
             "B": Stub("B", [Call([final("B", 2)])])}
    orch = sized(make(stubs), {"A": 400, "B": 300})
    orch.routing = in_order("A", "B")
    assert finished(generate(orch, [])).report.replica_id == "B"
    assert orch.stats.degradations["larger_pool"] == 1


def test_a_refusal_past_every_pool_names_no_pool_only_the_refusers_stale_stats_had():
    """Review: the refusing replica restarted with a smaller pool (100 blocks, its Stats not
    polled since: 400) and the request past every pool (500 blocks): the refusal was rewritten
    to "the pool has 400", a pool no replica has, and a max_tokens that fits none. The
    refusing replica counts at its refusal's own size: the largest pool is B's (300)."""
    stubs = {"A": Stub("A", [Call([], _refusal(7800, 201, 100))]),
             "B": Stub("B", [Call([final("B", 2)])])}
    orch = sized(make(stubs), {"A": 400, "B": 300})
    orch.routing = in_order("A", "B")
    with pytest.raises(errors.TierCacheError) as e:
        generate(orch, [])
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert str(e.value).endswith("need 500 KV blocks, the pool has 300; the prompt alone is "
                                 "too long for it"), str(e.value)
    assert stubs["B"].requests == []
