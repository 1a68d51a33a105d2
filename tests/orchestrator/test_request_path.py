"""The orchestrator's request path where a review found it wrong: a hit honours the request's
stop tokens and ignore_eos, every tier call is bounded by the request's deadline, routing
counts a replica's load before another request can choose, replicas renamed by their first
Stats answer are still found, a replica refusing our internal credential or ending a stream
without its final message is failed over, and a prompt longer than the replicas' context is
refused before any tier (pure logic with the fakes of test_pipeline_paths)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, semantic_pb2

from services.common import errors
from services.orchestrator.pipeline import Finished, Policy, Sampling, TextDelta
from services.orchestrator.render import RenderedPrompt
from services.orchestrator.server import OrchestratorServicer
from tests.metric_sample import sample_value
from tests.orchestrator.test_contracts import (
    RecordingSemantic,
    finished,
    one_replica,
    text_of,
)
from tests.orchestrator.test_pipeline_paths import (
    PROMPT,
    TENANT,
    Call,
    RpcError,
    Stub,
    final,
    make,
)
from tests.orchestrator.test_stream_cap import Context


def hit(answer: str) -> RecordingSemantic:
    return RecordingSemantic(semantic_pb2.LookupResponse(
        hit=True, similarity=0.99, entry=semantic_pb2.SemanticEntry(id="e1", answer=answer)))


def run(orch, *, max_tokens: int = 16, stop: tuple[int, ...] = (), ignore_eos: bool = False,
        deadline_s: float = 30.0) -> list:
    return list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(max_tokens, 0.0, 1.0, 0, stop, ignore_eos), policy=Policy(),
        session_id="s", return_token_ids=True, request_id="rid",
        deadline=time.monotonic() + deadline_s, on_cancel=lambda fn: None))


# ---- a semantic hit obeys the request's stopping rules -----------------------------------

def test_a_hit_ends_at_the_requests_stop_token_as_the_model_would():
    stub, stubs = one_replica()
    orch = make(stubs, semantic=hit("Paris. It is big."))
    events = run(orch, stop=(ord("."),))
    assert stub.requests == []  # still served from the cache
    assert text_of(events) == "Paris."
    fin = finished(events)
    assert fin.finish_reason == common_pb2.FINISH_REASON_STOP and fin.completion_tokens == 6
    assert fin.report.semantic_hit


def test_a_whole_hit_ending_at_eos_stays_whole_when_eos_is_also_a_stop_token():
    """A stored answer keeps the model's EOS at its end; a request listing the EOS id as a stop
    token too (clients often do) was served that answer whole as FINISH_REASON_STOP, where the
    replica (EOS before stop tokens) ends the same ids with EOS and the hit is CACHED."""
    eos = 0  # the fake tokenizer's EOS
    said = list(b"Paris.") + [eos]
    stub, stubs = one_replica()
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=True, similarity=0.99,
        entry=semantic_pb2.SemanticEntry(id="e1", answer="Paris.", answer_token_ids=said)))
    events = run(make(stubs, semantic=sem), stop=(eos, ord("!")))
    assert stub.requests == [] and text_of(events) == "Paris."
    fin = finished(events)
    assert fin.finish_reason == common_pb2.FINISH_REASON_CACHED
    assert fin.completion_tokens == len(said)
    # A stop token before the end still cuts it, EOS listed or not.
    events = run(make(stubs, semantic=sem), stop=(eos, ord("s")))
    assert text_of(events) == "Paris"
    assert finished(events).finish_reason == common_pb2.FINISH_REASON_STOP


def test_an_answer_stored_without_ids_is_tokenized_as_plain_text(tok):
    """An entry without its token ids (a client's Store, an answer cut inside a character) is
    tokenized again; a "<|im_end|>" the model wrote as text became the EOS token, so a request
    with EOS as a stop token got the answer cut there, and a LENGTH cut dropped the text."""
    from services.orchestrator.render import PromptRenderer

    said = "End a turn with <|im_end|> then wait."
    stub, stubs = one_replica()
    orch = make(stubs, semantic=hit(said), tok=tok)
    orch.renderer = PromptRenderer(tok)
    events = run(orch, max_tokens=64, stop=(tok.eos_token_id,))
    assert stub.requests == [] and text_of(events) == said
    assert finished(events).finish_reason == common_pb2.FINISH_REASON_CACHED
    plain = tok.encode(said, add_special_tokens=False, split_special_tokens=True)
    assert finished(events).completion_tokens == len(plain)
    events = run(orch, max_tokens=len(plain) - 2)
    assert text_of(events) == tok.decode(plain[:-2]) and "<|im_end|>" in text_of(events)


def test_a_stop_token_beyond_max_tokens_leaves_the_length_cut():
    stub, stubs = one_replica()
    events = run(make(stubs, semantic=hit("Paris is big. Yes.")), max_tokens=5,
                 stop=(ord("."),))
    assert text_of(events) == "Paris"
    assert finished(events).finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_answers_cut_inside_a_character_end_before_it_not_in_a_replacement_character():
    """max_tokens between the bytes of "é": the served hit, the model's streamed text and the
    answer stored for later requests all end before the character (they ended in U+FFFD)."""
    stub, stubs = one_replica()
    events = run(make(stubs, semantic=hit("Paris é")), max_tokens=7)
    assert stub.requests == [] and text_of(events) == "Paris "
    assert finished(events).finish_reason == common_pb2.FINISH_REASON_LENGTH

    cut = list(b"ok ") + list("é".encode())[:1]
    stub = Stub("A", [Call([kvpool_pb2.KvGenerateResponse(
        token_ids=cut, final=kvpool_pb2.KvGenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_LENGTH, replica_id="A"))])])
    sem = RecordingSemantic()
    events = run(make({"A": stub}, semantic=sem), max_tokens=len(cut))
    assert text_of(events) == "ok "
    assert [r.answer for r in sem.stores] == ["ok "]  # what the client was sent


def test_a_stop_token_inside_a_character_ends_a_hit_before_it():
    """A hit cut by the request's stop token decoded the ids up to it as they were: a stop id
    that is one byte of "é" left a U+FFFD at the end of the answer."""
    stub, stubs = one_replica()
    first_byte = "é".encode()[0]
    events = run(make(stubs, semantic=hit("Paris é")), stop=(first_byte,))
    assert stub.requests == [] and text_of(events) == "Paris "
    assert finished(events).finish_reason == common_pb2.FINISH_REASON_STOP


def test_every_end_of_sequence_id_the_model_lists_ends_an_answer():
    """Only the tokenizer's eos_token_id was read: a model listing several (Llama 3, Qwen 2.5)
    had an ignore_eos answer that ran past another of them stored as an answer."""
    said = [ord("a"), 7, ord("b"), ord("c")]  # 7: the model's second end-of-sequence id

    def replica():
        return Stub("A", [Call([kvpool_pb2.KvGenerateResponse(
            token_ids=said, final=kvpool_pb2.KvGenerateFinal(
                finish_reason=common_pb2.FINISH_REASON_LENGTH, replica_id="A"))])])

    sem = RecordingSemantic()
    run(make({"A": replica()}, semantic=sem), max_tokens=4, ignore_eos=True)
    assert len(sem.stores) == 1  # with the tokenizer's id (0) alone: ran past no end
    orch = make({"A": replica()}, semantic=(sem := RecordingSemantic()))
    orch._eos_ids = frozenset({0, 7})
    run(orch, max_tokens=4, ignore_eos=True)
    assert sem.stores == []


def test_eos_ids_are_read_as_a_replica_reads_them(tmp_path):
    import json

    from services.common.model_store import eos_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert eos_token_ids(str(tmp_path)) == {2}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert eos_token_ids(str(tmp_path)) == {5, 9}  # the generation config first, as a list
    empty = tmp_path / "empty"
    empty.mkdir()
    assert eos_token_ids(str(empty), SimpleNamespace(eos_token_id=3)) == {3}
    assert eos_token_ids(str(empty)) == frozenset()


def test_the_stored_answer_keeps_the_models_leading_space():
    """A raw completion's answer usually starts with a space (" Rome."); it was stored
    stripped, so a hit served "Rome." (and "...Italy isRome." once joined to the prompt), with
    token ids the model never produced."""
    said = list(b" Rome.\n")
    stub = Stub("A", [Call([kvpool_pb2.KvGenerateResponse(
        token_ids=said, final=kvpool_pb2.KvGenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_EOS, replica_id="A"))])])
    sem = RecordingSemantic()
    events = run(make({"A": stub}, semantic=sem))
    assert text_of(events) == " Rome.\n" and [r.answer for r in sem.stores] == [" Rome.\n"]
    stub, stubs = one_replica()
    events = run(make(stubs, semantic=hit(" Rome.\n")))
    assert text_of(events) == " Rome.\n"
    assert [t for e in events if isinstance(e, TextDelta) for t in e.token_ids] == said


def test_an_ignore_eos_request_is_served_an_answer_cut_at_max_tokens():
    # Cut at max_tokens (truncated_at), not ended at EOS: what the model would emit again.
    from tests.orchestrator.test_contracts import cut_hit

    stub, stubs = one_replica()
    events = run(make(stubs, semantic=cut_hit("abcdefgh", 8)), max_tokens=8, ignore_eos=True)
    assert stub.requests == [] and finished(events).report.semantic_hit


def _not_served(reason: str) -> float:
    from services.orchestrator.pipeline import NOT_SERVED

    return NOT_SERVED.labels(reason)._value.get()


def test_an_ignore_eos_request_is_not_served_an_answer_that_ended_at_eos():
    stub, stubs = one_replica()
    orch = make(stubs, semantic=hit("Paris."))
    before = _not_served("ignore_eos")
    events = run(orch, ignore_eos=True)
    assert len(stub.requests) == 1  # the model answers ...
    assert list(stub.requests[0].draft_token_ids) == list(b"Paris.")  # ... from the draft
    fin = finished(events)
    assert not fin.report.semantic_hit and fin.report.draft_entry_id == "e1"
    # Counted: the semantic service counted a hit that nothing said went unserved.
    assert orch.stats.semantic_hits_ignore_eos == 1 and _not_served("ignore_eos") == before + 1


def test_every_semantic_hit_not_served_is_counted_in_metrics_and_saved_tokens_too():
    """Sampled hits were in Stats only, and the tokens the semantic tier saved nowhere in
    Prometheus: the orchestrator's metrics could not be reconciled with the tier's hits."""
    from services.orchestrator.pipeline import TOKENS
    from tests.orchestrator.test_contracts import cut_hit

    saved = TOKENS.labels("saved_semantic")._value.get()
    run(make(one_replica()[1], semantic=hit("Paris.")))
    assert TOKENS.labels("saved_semantic")._value.get() == saved + len("Paris.")
    short = _not_served("too_short")
    run(make(one_replica()[1], semantic=cut_hit("abcdefgh", 8)), max_tokens=16)
    assert _not_served("too_short") == short + 1
    sampled = _not_served("sampled")
    orch = make(one_replica()[1], semantic=hit("Paris."))
    list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(16, 0.8, 1.0, 7, (), False), policy=Policy(), session_id="s",
        return_token_ids=True, request_id="rid", deadline=time.monotonic() + 30,
        on_cancel=lambda fn: None))
    assert orch.stats.semantic_hits_sampled == 1 and _not_served("sampled") == sampled + 1


# ---- every tier call is bounded by the request's deadline --------------------------------

class TimedSemantic(RecordingSemantic):
    timeout_s = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[tuple[str, float | None]] = []

    def lookup(self, req, timeout=None, on_call=None):
        self.timeouts.append(("Lookup", timeout))
        return super().lookup(req, timeout)

    def store(self, req, timeout=None, on_call=None):
        self.timeouts.append(("Store", timeout))
        return super().store(req, timeout)


def test_warms_owner_lookup_is_a_probe_and_a_request_is_not():
    """Warm choosing owners asked the index like traffic: each call credited the prefix a hit,
    so warming made the hottest prefixes hotter (see the index's probe test)."""
    probes: list[bool] = []
    prefix = SimpleNamespace(
        timeout_s=0.5,
        match=lambda h, m, timeout=None, probe=False, on_call=None: probes.append(probe) or {})
    stub, stubs = one_replica()
    orch = make(stubs, prefix=prefix)
    assert orch.owner(TENANT, PROMPT) is not None
    run(orch)
    assert probes == [True, False]


def test_an_index_outage_during_warms_owner_probes_is_not_a_degraded_request():
    """Each Warm prompt's owner probe (up to 64 a call) counted an index_down degradation:
    one warm-up looked like 64 requests served degraded."""
    def down(h, m, timeout=None, probe=False, on_call=None):
        raise RpcError(grpc.StatusCode.UNAVAILABLE)

    stub, stubs = one_replica()
    orch = make(stubs, prefix=SimpleNamespace(timeout_s=0.5, match=down))
    for _ in range(3):
        assert orch.owner(TENANT, PROMPT) is not None  # ring routing still names an owner
    assert orch.stats.degradations["index_down"] == 0
    run(orch)  # a request with the index down is degraded
    assert orch.stats.degradations["index_down"] == 1


def test_an_index_that_times_out_is_said_to_have_given_no_answer_in_time(caplog, monkeypatch):
    """A chaos walkthrough: with the index SIGSTOPped each request's line read "prefix index
    unreachable, ring routing: Deadline Exceeded" (no deadline named) while the index's health
    line said how long it went unanswered. Both say it now."""
    import logging

    from services.common.logs import Thinned
    from services.orchestrator import pipeline

    def late(h, m, timeout=None, probe=False, on_call=None):
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

    monkeypatch.setattr(pipeline, "_DEGRADED_LINES", Thinned(pipeline.log,
                                                             level=logging.WARNING))
    stub, stubs = one_replica()
    orch = make(stubs, prefix=SimpleNamespace(timeout_s=0.5, match=late))
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.pipeline"):
        run(orch)
    lines = [r.getMessage() for r in caplog.records if "ring routing" in r.getMessage()]
    assert lines == ["prefix index unreachable, ring routing: no answer within 0.5s "
                     "(timed out)"]


def test_the_report_and_metrics_say_what_the_index_promised_against_what_was_reused():
    """A prefix-routed request that found less cached than the index said (the replica had
    evicted part of it meanwhile) looked like any partial hit: the report now carries the
    index's figure and a counter sums the shortfall."""

    def metric(name: str) -> float:
        return sample_value(f"tiercache_orchestrator_prefix_{name}_total") or 0.0

    def answered(cached: int) -> Stub:
        msg = final("A", 2)
        msg.final.cached_tokens = cached
        return Stub("A", [Call([msg])])

    prefix = SimpleNamespace(
        timeout_s=0.5, match=lambda h, m, timeout=None, probe=False, on_call=None: {"A": 96})
    for cached, shortfall in ((48, 48), (96, 0)):
        before = {k: metric(k) for k in ("matched_tokens", "match_shortfall_tokens")}
        report = finished(run(make({"A": answered(cached)}, prefix=prefix))).report
        assert (report.route, report.cached_tokens, report.index_matched_tokens) == (
            "prefix", cached, 96)
        assert metric("matched_tokens") - before["matched_tokens"] == 96
        assert metric("match_shortfall_tokens") - before["match_shortfall_tokens"] == shortfall


def test_a_replica_call_carries_one_x_request_id_the_requests_own():
    seen: list = []
    stub, stubs = one_replica()
    gen = stub.Generate

    def recording(req, timeout=None, metadata=None):
        seen.append([v for k, v in metadata if k == "x-request-id"])
        return gen(req, timeout=timeout, metadata=metadata)

    stub.Generate = recording
    run(make(stubs))
    assert seen == [["rid"]]  # was the ambient id and then the request's: two headers


def test_a_stream_finishing_on_a_draining_replica_does_not_bring_it_back():
    """The poller marks a replica that refuses Stats (SIGTERM, draining) down; its streams
    still finish, and each one marked it healthy again, so the next request was sent there,
    refused, and retried elsewhere."""
    stub, stubs = one_replica()
    orch = make(stubs)
    replica = orch.replicas.replicas[0]
    gen = stub.Generate

    def drains_meanwhile(req, timeout=None, metadata=None):
        call = gen(req, timeout=timeout, metadata=metadata)
        replica.health.fail("draining: Stats refused", hold=True)  # the poller, mid-stream
        return call

    stub.Generate = drains_meanwhile
    assert any(isinstance(e, Finished) for e in run(orch))
    assert not replica.health.healthy
    replica.health.ok()  # the poller's next answer
    assert replica.health.healthy and not replica.health.held_down


def test_a_request_past_its_deadline_leaves_no_routing_state():
    """The deadline was checked after routing had recorded the request: a request never sent
    credited the replica with its prompt for 10 s and counted as routed traffic."""
    stub, stubs = one_replica()
    orch = make(stubs)
    with pytest.raises(errors.DeadlineExceeded):
        run(orch, deadline_s=-0.001)
    assert stub.requests == []
    assert orch.dispatched.match(orch.hasher.hashes(PROMPT, TENANT.cache_salt)) == {}
    assert not orch.routing._recent


def test_a_client_gone_during_the_semantic_lookup_asks_the_index_nothing():
    from tests.orchestrator.test_pipeline_paths import Semantic

    callbacks: list = []
    asked: list = []
    prefix = SimpleNamespace(
        timeout_s=1.0,
        match=lambda h, m, timeout=None, probe=False, on_call=None: asked.append(probe) or {})
    stub, stubs = one_replica()
    orch = make(stubs, semantic=Semantic(on_lookup=lambda: [cb() for cb in callbacks]),
                prefix=prefix)
    with pytest.raises(errors.Cancelled):
        list(orch.generate(
            tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
            sampling=Sampling(4, 0.0, 1.0, 0, (), False), policy=Policy(), session_id="s",
            return_token_ids=False, request_id="r", deadline=time.monotonic() + 30,
            on_cancel=callbacks.append))
    assert asked == [] and stub.requests == []


@pytest.mark.parametrize(("method", "kind"), [("store", "semantic_store_failed"),
                                               ("lookup", "semantic_skipped")])
def test_a_semantic_call_cut_short_by_the_requests_deadline_is_no_degradation(method, kind):
    class Slow(TimedSemantic):
        pass

    def slow(self, req, timeout=None, on_call=None):
        getattr(TimedSemantic, method)(self, req, timeout)
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

    setattr(Slow, method, slow)
    stub, stubs = one_replica(2)
    orch = make(stubs, semantic=Slow())
    run(orch, deadline_s=1.0)  # less than the tier's 2 s: the request's own deadline
    assert kind not in orch.stats.degradations
    run(orch, deadline_s=30.0)  # the tier's whole timeout: the tier is slow
    assert orch.stats.degradations[kind] == 1


def test_lookup_store_and_match_get_what_is_left_of_the_deadline():
    sem = TimedSemantic()
    matched: list[float | None] = []
    prefix = SimpleNamespace(
        timeout_s=0.5,
        match=lambda h, m, timeout=None, probe=False, on_call=None: matched.append(timeout) or {})
    stub, stubs = one_replica()
    run(make(stubs, semantic=sem, prefix=prefix), deadline_s=0.3)
    assert [name for name, _ in sem.timeouts] == ["Lookup", "Store"]
    assert all(t is not None and 0 < t <= 0.3 for _, t in sem.timeouts), sem.timeouts
    assert len(matched) == 1 and 0 < matched[0] <= 0.3
    # With time to spare, each call keeps its own (shorter) timeout.
    sem2 = TimedSemantic()
    stub, stubs = one_replica()
    run(make(stubs, semantic=sem2), deadline_s=30)
    assert [t for _, t in sem2.timeouts] == [2.0, 2.0]


# ---- routing: load counted inside the decision; renamed replicas -------------------------

def test_a_replica_is_counted_busy_before_another_request_can_route():
    stub, stubs = one_replica()
    orch = make(stubs)
    seen_locked: list[bool] = []
    begin = orch.replicas.begin

    def begin_checked(r):
        seen_locked.append(orch._route_lock.locked())
        begin(r)

    orch.replicas.begin = begin_checked
    run(orch)
    assert seen_locked == [True]
    assert orch.replicas.replicas[0].inflight == 0  # and given back after the answer


def test_a_replica_renamed_by_its_first_stats_answer_is_still_found():
    stub, stubs = one_replica()
    orch = make(stubs)
    r = orch.replicas.replicas[0]
    chosen = orch.routing.choose

    def choose_then_rename(*a, **kw):
        d = chosen(*a, **kw)
        r.replica_id = "kvpool-0"  # the poller's Stats answer lands right after routing
        return d

    orch.routing.choose = choose_then_rename
    events = run(orch)
    assert text_of(events) == "ok" and len(stub.requests) == 1


# ---- failover on faults that are not the client's ---------------------------------------

@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.PERMISSION_DENIED])
def test_a_replica_refusing_our_internal_credential_is_failed_over(code):
    a = Stub("A", [Call([], RpcError(code))])
    b = Stub("B", [Call([final("B", 2)])])
    orch = make({"A": a, "B": b})
    orch.routing.choose = _prefer("A", orch.routing.choose)
    events = run(orch)
    assert text_of(events) == "ok" and finished(events).report.replica_id == "B"
    assert len(a.requests) == 1 and len(b.requests) == 1
    assert not orch.replicas.by_id("A").health.healthy


def test_a_replica_serving_another_model_is_failed_over_not_blamed_on_the_client():
    class WrongModel(RpcError):
        def details(self) -> str:
            return "model_id: this replica serves 'other', not 'm'"

    a = Stub("A", [Call([], WrongModel(grpc.StatusCode.FAILED_PRECONDITION))])
    b = Stub("B", [Call([final("B", 2)])])
    orch = make({"A": a, "B": b})
    orch.routing.choose = _prefer("A", orch.routing.choose)
    events = run(orch)
    assert text_of(events) == "ok" and finished(events).report.replica_id == "B"
    assert not orch.replicas.by_id("A").health.healthy


def test_only_replicas_refusing_our_credential_is_unavailable_not_unauthenticated():
    a = Stub("A", [Call([], RpcError(grpc.StatusCode.UNAUTHENTICATED))])
    orch = make({"A": a}, max_attempts=1)
    with pytest.raises(errors.Unavailable, match="UNAUTHENTICATED"):
        run(orch)


def test_a_stream_ended_without_its_final_message_resumes_elsewhere():
    def tok(t: str) -> kvpool_pb2.KvGenerateResponse:
        return kvpool_pb2.KvGenerateResponse(token_ids=[ord(t)])

    a = Stub("A", [Call([tok("o")])])  # one token, then a clean end: no final message
    b = Stub("B", [Call([final("B", 2)])])
    orch = make({"A": a, "B": b})
    orch.routing.choose = _prefer("A", orch.routing.choose)
    events = run(orch)
    assert len(b.requests) == 1
    assert list(b.requests[0].token_ids) == PROMPT + [ord("o")]  # resumed after the token
    assert finished(events).report.route == "resume"
    assert orch.stats.degradations["resume"] == 1


def _prefer(rid: str, choose):
    """Routing that picks `rid` first (while it is not excluded)."""
    def pick(views, matches, key, exclude=frozenset(), *a, **kw):
        d = choose(views, matches, key, exclude, *a, **kw)
        if d is not None and rid not in exclude and any(v.replica_id == rid for v in views):
            return d._replace(replica_id=rid)
        return d
    return pick


# ---- a prompt the replicas' context cannot hold is refused before any tier ---------------

def test_the_context_limit_is_the_smallest_any_routable_replica_reports():
    """A replica down (crashed, scaled away, held out) with a smaller context still cut every
    request to it, though none could be routed there."""
    from services.orchestrator.backends import ReplicaSet

    rs = ReplicaSet(("A", "B", "C"), "")
    assert rs.max_context() == 0  # nothing known before the first Stats answer
    a, b, c = rs.replicas
    a.stats = kvpool_pb2.KvStatsResponse(max_context=128)
    b.stats = kvpool_pb2.KvStatsResponse(max_context=96)
    for r in (a, b, c):
        r.health.ok()
    assert rs.max_context() == 96  # the smallest a request might be routed to
    b.health.fail(RuntimeError("gone"))
    assert rs.max_context() == 128  # B is out of routing: it limits nothing
    a.health.fail(RuntimeError("gone"))
    c.health.fail(RuntimeError("gone"))
    assert rs.max_context() == 96  # none known healthy: every replica may be tried


class ContextOrchestrator:
    """The pipeline's stand-in for Generate's checks: records whether it was reached."""

    def __init__(self, max_context: int) -> None:
        self.renderer = SimpleNamespace(
            render_raw=lambda text, scope="": RenderedPrompt(list(range(1, 11)), text, ""))
        self.tok = range(1000)
        self.replicas = SimpleNamespace(max_context=lambda: max_context)
        self.semantic = SimpleNamespace(enabled=True, threshold_floor=lambda: 0.85)
        self.calls: list[dict] = []

    def generate(self, **kw):
        self.calls.append(kw)
        yield from ()


def generate_call(max_context: int, max_tokens: int):
    from tiercache.v1 import orchestrator_pb2

    from services.orchestrator.config import OrchestratorConfig
    from services.orchestrator.tenants import TenantRegistry

    cfg = OrchestratorConfig(kvpool_addresses=("h:1",))
    cfg.validate()
    s = OrchestratorServicer(cfg)
    orch = ContextOrchestrator(max_context)
    s.attach(orch, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                        max_prompt_tokens=1000, max_tokens=1000,
                                        max_concurrent=10))
    req = orchestrator_pb2.GenerateRequest(prompt="x" * 40)
    if max_tokens:
        req.sampling.max_tokens = max_tokens
    list(s.Generate(req, Context()))
    return orch


def test_a_request_over_the_replicas_context_never_reaches_the_pipeline():
    n = 10  # the fake renderer's prompt tokens
    with pytest.raises(errors.InvalidArgument, match=r"exceed the model context \(64\)"):
        generate_call(64, 64 - n + 1)
    assert generate_call(64, 64 - n).calls[0]["sampling"].max_tokens == 64 - n
    # Unset max_tokens: the server default, cut to what the context leaves.
    assert generate_call(64, 0).calls[0]["sampling"].max_tokens == 64 - n
    # No replica has reported a context yet: the replica checks it.
    assert generate_call(0, 900).calls[0]["sampling"].max_tokens == 900


def test_a_threshold_under_the_tiers_floor_is_refused_even_while_the_tier_is_skipped():
    """Only the tier's Lookup refused it: the same request was refused while the semantic
    tier was up and served while it was down (skipped). The floor is the one the tier's
    Stats said; before any has, the tier's own check is all there is."""
    from tiercache.v1 import orchestrator_pb2

    from services.orchestrator.config import OrchestratorConfig
    from services.orchestrator.tenants import TenantRegistry

    s = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("h:1",)))
    orch = ContextOrchestrator(0)
    s.attach(orch, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                        max_prompt_tokens=1000, max_tokens=1000,
                                        max_concurrent=10))

    def call(threshold, skip=False):
        req = orchestrator_pb2.GenerateRequest(prompt="x" * 40)
        req.cache_policy.semantic_threshold = threshold
        req.cache_policy.skip_semantic_lookup = skip
        list(s.Generate(req, Context()))

    with pytest.raises(errors.InvalidArgument,
                       match=r"^cache_policy\.semantic_threshold: must be 0 \(tier default\) "
                             r"or in \[0\.85, 1\], got 0\.5"):
        call(0.5)
    assert orch.calls == []
    call(0.85)  # the floor itself, and a request that skips the lookup, pass
    call(0.5, skip=True)
    orch.semantic.threshold_floor = lambda: 0.0  # no shard has said its floor yet
    call(0.5)
    assert len(orch.calls) == 3


# ---- a hung semantic tier is skipped, not waited for on every request ---------------------

class TimesOut:
    """A semantic shard whose Lookup runs out of time, recording each call's timeout."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def Lookup(self, req, timeout=None, metadata=None):  # noqa: N802
        self.calls.append(timeout)
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)


def backend_with(stub, now: list[float] | None = None):
    """A one-shard SemanticBackend (timeout 2 s) over `stub`, on the clock `now[0]`."""
    from services.orchestrator.backends import SemanticBackend

    sb = SemanticBackend("s:1", "", 2.0, **({"clock": lambda: now[0]} if now else {}))
    sb.stubs["s:1"] = stub
    return sb


def test_a_hung_semantic_shard_is_skipped_for_a_while_then_tried_again():
    now = [100.0]
    hung = TimesOut()
    calls = hung.calls
    sb = backend_with(hung, now)
    req = semantic_pb2.LookupRequest()
    with pytest.raises(grpc.RpcError):
        sb.lookup(req)  # waited its whole timeout: hung
    with pytest.raises(grpc.RpcError) as e:
        sb.lookup(req)  # skipped at once, the shard not called
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "hung" in e.value.details()
    assert calls == [2.0]
    now[0] += 0.6  # past the first back-off (0.5 s): one call tries it again
    with pytest.raises(grpc.RpcError):
        sb.lookup(req)
    assert calls == [2.0, 2.0]
    now[0] += 0.6  # the back-off doubled to 1 s: still skipped
    with pytest.raises(grpc.RpcError):
        sb.lookup(req)
    assert len(calls) == 2

    class Answers:
        def Lookup(self, req, timeout=None, metadata=None):  # noqa: N802
            calls.append(timeout)
            return semantic_pb2.LookupResponse()

    now[0] += 1.0
    sb.stubs["s:1"] = Answers()
    sb.lookup(req)
    sb.lookup(req)  # recovered: no more skipping
    assert len(calls) == 4 and sb.health.healthy


def test_a_request_running_out_of_its_own_deadline_does_not_mark_the_tier_hung():
    slow = TimesOut()
    sb = backend_with(slow)
    sb.health.ok()
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            sb.lookup(semantic_pb2.LookupRequest(), 0.1)  # the request had only 0.1 s left
    assert slow.calls == [0.1, 0.1]  # both reached the shard
    assert sb.health.healthy  # and the tier is not reported unhealthy for it


def test_a_tier_silent_for_half_a_second_is_hung_whatever_the_requests_deadline():
    """Every request's deadline may be under the tier's 2 s timeout: a call cut to 0.6 s by its
    request still shows the tier hung (it answers in milliseconds), or it was never skipped
    and every request waited on it."""
    now = [100.0]
    slow = TimesOut()
    sb = backend_with(slow, now)
    sb.health.ok()
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest(), 0.6)
    assert not sb.health.healthy and "s:1" in sb._hung
    with pytest.raises(grpc.RpcError) as skipped:
        sb.lookup(semantic_pb2.LookupRequest(), 0.6)
    assert "hung: skipped" in skipped.value.details()
    assert slow.calls == [0.6]  # the second call did not wait on the shard


def test_a_hung_tier_leaves_the_replica_most_of_a_short_deadline():
    """A request with 1.5 s to live and a semantic tier that never answers: the lookup used to
    get all 1.5 s (min(2 s timeout, time left)), and the request then failed with
    DEADLINE_EXCEEDED before any replica was asked, every time."""
    from tests.orchestrator.test_pipeline_paths import Call, Semantic, Stub, final, make

    class Hung(Semantic):  # its tier's timeout (2 s) and shard; calls that never answer
        def __init__(self) -> None:
            self.timeouts: list[float] = []

        def lookup(self, req, timeout=None, on_call=None):
            self.timeouts.append(timeout)
            time.sleep(timeout)
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

        def store(self, req, timeout=None, on_call=None):
            self.timeouts.append(timeout)
            time.sleep(timeout)
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

    sem = Hung()
    stub = Stub("A", [Call([final("A", 2)])])
    orch = make({"A": stub}, semantic=sem)
    t0 = time.monotonic()
    events = list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(2, 0.0, 1.0, 0, (), False), policy=Policy(), session_id="s",
        return_token_ids=True, request_id="rid", deadline=t0 + 1.5, on_cancel=lambda fn: None))
    took = time.monotonic() - t0
    assert isinstance(events[-1], Finished) and len(stub.requests) == 1
    lookup, store = sem.timeouts
    assert lookup <= 0.25 * 1.5 + 1e-6  # a quarter of what was left
    assert store <= 0.5 * (1.5 - lookup) + 1e-6  # half of what was left after the answer
    assert took < 1.5  # the final message came before the deadline


def test_after_the_pause_one_call_probes_the_hung_shard_and_the_others_keep_skipping():
    now = [100.0]
    inner: list[str] = []

    class Hung(TimesOut):
        def Lookup(self, req, timeout=None, metadata=None):  # noqa: N802
            if not inner:  # a concurrent request arrives while the probe is in flight
                try:
                    sb.lookup(req)
                    inner.append("called")
                except grpc.RpcError as e:
                    inner.append(e.details())
            return super().Lookup(req, timeout, metadata)

    sb = backend_with(Hung(), now)
    sb._hung["s:1"] = (now[0] - 1, 0.5)  # hung before; its pause just ended
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest())  # the probe
    assert len(inner) == 1 and "hung" in inner[0]  # the concurrent one was skipped


def test_a_probe_cut_short_by_its_request_leaves_the_shard_marked_hung():
    now = [100.0]
    hung = TimesOut()
    calls = hung.calls
    sb = backend_with(hung, now)
    sb._hung["s:1"] = (now[0] - 1, 1.0)
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest(), 0.2)  # a probe with only 0.2 s to spare
    assert sb._hung["s:1"][1] == 1.0  # still hung, same back-off: the next call probes again
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest())  # a whole-timeout probe: hung, back-off x2
    assert calls == [0.2, 2.0] and sb._hung["s:1"] == (now[0] + 2.0, 2.0)


def index_over(match, now: list[float] | None = None):
    """A one-shard PrefixBackend (timeout 0.5 s) whose client's Match is `match`."""
    from services.orchestrator.prefix_backend import PrefixBackend

    pb = PrefixBackend(("p:1",), "", 0.5, 16, clock=(lambda: now[0]) if now else None)
    pb.client = SimpleNamespace(match=match, shard_for=lambda h: "p:1")
    pb.health.ok()
    return pb


def test_a_short_deadline_on_the_index_is_not_an_index_failure():
    def match(model_id, block_hashes=(), timeout=None, probe=False, on_call=None):
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

    pb = index_over(match)
    with pytest.raises(grpc.RpcError):
        pb.match([b"h"], "m", timeout=0.1)  # the request had 0.1 s left
    assert pb.health.healthy and not pb.hung.state
    with pytest.raises(grpc.RpcError):
        pb.match([b"h"], "m", timeout=0.5)  # its whole timeout: the index is slow
    assert not pb.health.healthy


def test_a_hung_index_shard_is_skipped_for_a_while_then_tried_again():
    """Every request waited the index's whole timeout (0.5 s) while a shard was hung: the
    semantic tier's back-off now covers the index too."""
    now = [50.0]
    calls: list[float | None] = []
    answer = []

    def match(model_id, block_hashes=(), timeout=None, probe=False, on_call=None):
        calls.append(timeout)
        if answer:
            return SimpleNamespace(matches=[])
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

    pb = index_over(match, now)
    with pytest.raises(grpc.RpcError):
        pb.match([b"h"], "m", timeout=0.5)  # its whole timeout: hung
    assert not pb.health.healthy
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as skipped:
            pb.match([b"h"], "m", timeout=0.5)
        assert skipped.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "hung: skipped" in skipped.value.details()
    assert calls == [0.5]  # the skipped ones did not wait on the shard
    now[0] += 0.6
    answer.append(True)
    assert pb.match([b"h"], "m", timeout=0.5) == {}  # the pause is over: it answers again
    assert pb.match([b"h"], "m", timeout=0.5) == {} and len(calls) == 3
    assert pb.health.healthy


@pytest.mark.parametrize(("code", "down"), [(grpc.StatusCode.INTERNAL, False),
                                            (grpc.StatusCode.UNAVAILABLE, True)])
def test_an_error_before_the_first_token_fails_over(code, down):
    """UNAVAILABLE before the first token (the issue's own case) and INTERNAL alike: the
    request goes to the next candidate. An unreachable replica is held down at once; one that
    answered INTERNAL is left to the poller."""
    a = Stub("A", [Call([], RpcError(code))])
    b = Stub("B", [Call([final("B", 2)])])
    orch = make({"A": a, "B": b})
    orch.routing.choose = _prefer("A", orch.routing.choose)
    events = run(orch)
    assert finished(events).report.replica_id == "B" and len(a.requests) == 1
    assert orch.replicas.by_id("A").health.healthy is not down
    assert orch.stats.degradations["retry"] == 1


def test_a_failed_request_names_replica_ids_not_their_addresses_or_transport_errors():
    """Tenants got 'no kvpool replica is available (tried 10.0.3.7:50053, kvpool-0)' and the
    replica's own transport error text, which names internal addresses."""

    class Leaky(RpcError):
        def details(self) -> str:
            return "failed to connect to all addresses; ipv4:10.0.3.7:50053: Connection refused"

    a = Stub("A", [Call([], Leaky(grpc.StatusCode.UNAVAILABLE))])
    b = Stub("B", [Call([], Leaky(grpc.StatusCode.INTERNAL))])
    orch = make({"A": a, "B": b}, max_attempts=2)
    for r in orch.replicas.replicas:  # ids differ from addresses, as in a cluster
        r.replica_id = f"kvpool-{r.address}"
    with pytest.raises(errors.Unavailable) as e:
        run(orch)
    msg = str(e.value)
    assert "kvpool-A" in msg and "kvpool-B" in msg
    assert "10.0.3.7" not in msg and "connect" not in msg
    assert "'A'" not in msg and ", A" not in msg and "(A" not in msg  # no address either


def test_before_a_replica_answers_stats_errors_name_it_by_position_not_address():
    """Until its first Stats answer a replica's id is its address (routing needs a key):
    errors and reports then named 10.0.3.7:50053."""
    a = Stub("10.0.3.7:50053", [Call([], RpcError(grpc.StatusCode.UNAVAILABLE))])
    orch = make({"10.0.3.7:50053": a}, max_attempts=1)
    with pytest.raises(errors.Unavailable) as e:
        run(orch)
    assert "kvpool#0" in str(e.value) and "10.0.3.7" not in str(e.value)


def test_no_replica_left_names_the_ones_tried_by_id():
    """The other refusal ("no kvpool replica is available (tried ...)") listed addresses."""

    class Leaky(RpcError):
        def details(self) -> str:
            return "ipv4:10.0.3.7:50053: Connection refused"

    a = Stub("A", [Call([], Leaky(grpc.StatusCode.UNAVAILABLE))])
    b = Stub("B", [Call([], Leaky(grpc.StatusCode.UNAVAILABLE))])
    orch = make({"A": a, "B": b}, max_attempts=5)  # runs out of replicas first
    for r in orch.replicas.replicas:
        r.replica_id = f"kvpool-{r.address}"
    with pytest.raises(errors.Unavailable, match="no kvpool replica is available") as e:
        run(orch)
    assert "kvpool-A" in str(e.value) and "kvpool-B" in str(e.value)
    assert "(A" not in str(e.value) and ", A" not in str(e.value)


def test_ttft_is_counted_from_the_arrival_the_servicer_gives():
    """The pipeline's TTFT clock started after the servicer had rendered and tokenized the
    prompt: the time before it (here 5 s) was left out of CacheReport.ttft_ms."""
    stub, stubs = one_replica()
    orch = make(stubs)
    events = list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(16, 0.0, 1.0, 0, (), False), policy=Policy(),
        session_id="s", return_token_ids=True, request_id="rid",
        deadline=time.monotonic() + 30.0, on_cancel=lambda fn: None,
        arrived=time.monotonic() - 5.0))
    assert finished(events).report.ttft_ms >= 5000.0


def test_a_slow_call_begun_before_the_shard_was_marked_hung_keeps_its_grown_back_off():
    """A call took its view of the shard when it began (not hung yet). Timing out after
    another call had doubled the back-off to 4 s, it wrote back the first, 0.5 s."""
    now = [100.0]
    sb = None

    class Late(TimesOut):
        def Lookup(self, req, timeout=None, metadata=None):  # noqa: N802
            sb._hung["s:1"] = (now[0] + 4.0, 4.0)  # meanwhile: hung, back-off grown to 4 s
            return super().Lookup(req, timeout, metadata)

    sb = backend_with(Late(), now)
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest())
    assert sb._hung["s:1"] == (now[0] + 5.0, 5.0)  # doubled from 4 s (capped at 5 s)


def test_calls_that_time_out_together_in_one_stall_grow_the_back_off_once():
    """Every call under way when the shard stalled timed out together and each doubled the
    back-off: one hiccup with 8 calls in flight skipped the shard for 5 s instead of 0.5 s."""
    now = [100.0]
    sb = backend_with(TimesOut(), now)
    started: list = []

    class Together(TimesOut):
        def Lookup(self, req, timeout=None, metadata=None):  # noqa: N802
            if not started:  # 3 more calls began at the same moment, all timing out now
                started.append(1)
                for _ in range(3):
                    with pytest.raises(grpc.RpcError):
                        sb.lookup(req)
            now[0] += 0.001  # each ends a moment after the one before
            return super().Lookup(req, timeout, metadata)

    sb.stubs["s:1"] = Together()
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest())
    assert sb._hung["s:1"][1] == 0.5  # the first back-off, set once


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.PERMISSION_DENIED,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_tier_refusing_every_call_reads_unhealthy(code):
    """A semantic tier that refuses the orchestrator's credential, or every Store (a full
    disk), does no work: its health used to stay "healthy" (only UNAVAILABLE, DEADLINE_EXCEEDED,
    INTERNAL and UNKNOWN counted). A request's own bad input still does not count."""
    class Refuses:
        def __init__(self, code) -> None:
            self.code = code

        def Lookup(self, req, timeout=None, metadata=None):  # noqa: N802
            raise RpcError(self.code)

    sb = backend_with(Refuses(code))
    sb.health.ok()
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest())
    assert not sb.health.healthy and sb.health.last_error == code.name.lower()
    assert not sb.shard_health["s:1"].healthy
    sb = backend_with(Refuses(grpc.StatusCode.INVALID_ARGUMENT))
    sb.health.ok()
    with pytest.raises(grpc.RpcError):
        sb.lookup(semantic_pb2.LookupRequest())
    assert sb.health.healthy
