"""Rules of the orchestrator's gRPC servicer that its other tests leave unchecked: the bounds
of the sampling and cache-policy fields (each refusal names its field), and what a refused
request leaves behind (nothing). Then Warm and the background warm-up (the Warmer), as a
mutation audit found them unguarded: the pin a Warm asks for, each prefill's deadline, salt
and model, which replicas WARM_TARGET_OWNERS picks, limits at their boundaries, what a
WarmResult reports, a gone caller's prefills queued behind others', and the loop's start,
stop, turns over tenants and outcomes (fakes for replicas and index: pure logic)."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, orchestrator_pb2, prefix_pb2

from services.common import errors
from services.common.logs import bound_request_id, request_id_var
from services.orchestrator.config import STREAM_HEADROOM, OrchestratorConfig
from services.orchestrator.pipeline import OrchestratorStats
from services.orchestrator.server import (
    MAX_SESSION_ID_CHARS,
    OrchestratorServicer,
    _Gone,
    parse_policy,
    parse_sampling,
)
from services.orchestrator.tenants import TenantRegistry
from tests.e2e.conftest import grpcurl_path
from tests.metric_sample import sample_value
from tests.orchestrator.test_request_path import ContextOrchestrator, generate_call
from tests.orchestrator.test_stream_cap import Context, request, servicer
from tests.waits import holds_within

CFG = OrchestratorConfig(kvpool_addresses=("A",), default_max_tokens=100, max_tokens_limit=500)
SP = common_pb2.SamplingParams


def _on_loopback(s: OrchestratorServicer):
    """`s` served by the service's own server (its interceptors, its authentication) on a
    free loopback port: the handle; the caller stops it."""
    from tiercache.v1 import orchestrator_pb2_grpc

    from services.common.bootstrap import create_server

    return create_server(service="orchestrator", address="127.0.0.1:0",
                         services=[(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, s,
                                    "tiercache.v1.Orchestrator")],
                         authenticate=s.authenticate_call, request_id_headers=True)


def test_max_tokens_unset_is_the_default_and_the_limit_itself_is_allowed():
    """Unset max_tokens means default_max_tokens (not the limit); max_tokens_limit is the
    largest value taken, one more is INVALID_ARGUMENT naming sampling.max_tokens."""
    assert parse_sampling(SP(), CFG, 1000).max_tokens == CFG.default_max_tokens
    assert parse_sampling(SP(max_tokens=CFG.max_tokens_limit), CFG, 1000).max_tokens == \
        CFG.max_tokens_limit
    with pytest.raises(errors.InvalidArgument) as ei:
        parse_sampling(SP(max_tokens=CFG.max_tokens_limit + 1), CFG, 1000)
    assert str(ei.value).startswith("sampling.max_tokens")


@pytest.mark.parametrize("value", [-1, -7])
def test_a_negative_max_tokens_is_refused_naming_the_field(value):
    """Every negative max_tokens is INVALID_ARGUMENT (a -1 was not 'unset')."""
    with pytest.raises(errors.InvalidArgument) as ei:
        parse_sampling(SP(max_tokens=value), CFG, 1000)
    assert str(ei.value).startswith("sampling.max_tokens")
    # 0 is the default, not a wrong value: the refusal says so (was "must be > 0").
    assert "must be >= 0 (0 = the server's default_max_tokens)" in str(ei.value)


def test_a_prompt_that_fills_the_context_is_told_so_without_max_tokens_it_never_set():
    """The fake prompt is 10 tokens: with max_tokens unset, a 10-token context leaves no room
    and the refusal names the prompt alone (it said "+ sampling.max_tokens (256)", the server
    default, a field the client never sent)."""
    with pytest.raises(errors.InvalidArgument) as ei:
        generate_call(10, 0)
    assert str(ei.value) == ("prompt: prompt (10 tokens) leaves no room for an answer in the "
                             "model context (10): at most 9 prompt tokens")


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.1])
def test_a_temperature_that_is_not_a_finite_number_at_least_0_is_refused(value):
    """temperature must be a finite number >= 0: NaN and infinity are refused as a negative
    value is, naming sampling.temperature."""
    with pytest.raises(errors.InvalidArgument) as ei:
        parse_sampling(SP(temperature=value), CFG, 1000)
    assert str(ei.value).startswith("sampling.temperature")


def test_top_p_and_the_semantic_threshold_of_exactly_1_are_allowed():
    """Both are in (0, 1]: 1 itself is taken, as is 0 (unset: top_p 1, the tier's default)."""
    assert parse_sampling(SP(top_p=1.0), CFG, 1000).top_p == 1.0
    assert parse_sampling(SP(), CFG, 1000).top_p == 1.0
    assert parse_policy(common_pb2.CachePolicy(semantic_threshold=1.0)).semantic_threshold == 1.0
    for bad in (1.5, -0.2):
        with pytest.raises(errors.InvalidArgument) as ei:
            parse_policy(common_pb2.CachePolicy(semantic_threshold=bad))
        assert str(ei.value).startswith("cache_policy.semantic_threshold")


def test_a_bad_tier_or_threshold_says_what_is_accepted_and_what_came():
    """An app review: "unknown tier 'loose'" listed no tier, and a threshold of 1.5 was "must
    be in (0, 1]", which sent the caller to 0.5, below the floor, refused next."""
    with pytest.raises(errors.InvalidArgument) as ei:
        parse_policy(common_pb2.CachePolicy(semantic_tier="loose"))
    assert str(ei.value).endswith("expected one of strict, standard, relaxed")
    with pytest.raises(errors.InvalidArgument) as ei:
        parse_policy(common_pb2.CachePolicy(semantic_threshold=1.5))
    assert str(ei.value) == ("cache_policy.semantic_threshold: must be 0 (tier default) or in "
                             "[the semantic floor, 1], got 1.5")


@pytest.mark.parametrize("bad,said", [(1.5, "1.5"), (math.nan, "nan"), (-0.2, "-0.2")])
def test_a_threshold_outside_0_1_names_the_floor_the_tier_said(bad, said):
    """A walkthrough: NaN, 1.5 or -0.2 read "in [the semantic floor, 1]" while 0.84 read
    "in [0.85, 1]" for the same bound; the floor the shards said is named, once known."""
    with pytest.raises(errors.InvalidArgument) as ei:
        parse_policy(common_pb2.CachePolicy(semantic_threshold=bad), 0.85)
    assert str(ei.value) == ("cache_policy.semantic_threshold: must be 0 (tier default) or in "
                             f"[0.85, 1], got {said}")


# ---- Generate: bad input leaves nothing behind, limits at their boundary ----------------------

def _held(s) -> tuple[int, int]:
    """The slots a call holds: the server's stream slots and the tenant's."""
    return s._streams, s.tenants._active.get("default", 0)


def test_messages_and_prompt_together_are_refused_before_any_work():
    """A request giving both messages and prompt is INVALID_ARGUMENT naming prompt, refused
    before it renders or takes a slot."""
    s, orch = servicer(STREAM_HEADROOM + 2)
    before = _held(s)
    req = request()
    req.prompt = "hello"
    with pytest.raises(errors.InvalidArgument) as ei:
        next(s.Generate(req, Context()))
    assert str(ei.value).startswith("prompt:")
    assert orch.renderer.rendered == 0 and _held(s) == before


def test_a_session_id_of_the_limit_is_taken_and_one_more_character_refused():
    """session_id is capped at MAX_SESSION_ID_CHARS characters: that many pass, one more is
    INVALID_ARGUMENT naming session_id, with nothing held."""
    s, orch = servicer(STREAM_HEADROOM + 2)
    orch.release.set()
    ok = request()
    ok.session_id = "s" * MAX_SESSION_ID_CHARS
    assert [m.text for m in s.Generate(ok, Context())] == ["hi"]
    before = _held(s)
    bad = request()
    bad.session_id = "s" * (MAX_SESSION_ID_CHARS + 1)
    with pytest.raises(errors.InvalidArgument) as ei:
        next(s.Generate(bad, Context()))
    assert str(ei.value).startswith("session_id:") and _held(s) == before


def test_a_threshold_just_under_the_tiers_floor_is_refused():
    """The floor the tier said is the lowest threshold taken: 0.005 under it is refused."""
    orch = ContextOrchestrator(0)
    e = _threshold_refused(orch, 0.845)  # the fake tier's floor is 0.85
    assert str(e).startswith("cache_policy.semantic_threshold") and orch.calls == []


def _threshold_refused(orch, threshold: float) -> errors.InvalidArgument:
    """The refusal of a Generate with `threshold`, through a servicer on `orch`."""
    s = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("h:1",)))
    s.attach(orch, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                        max_prompt_tokens=1000, max_tokens=1000,
                                        max_concurrent=10))
    req = orchestrator_pb2.GenerateRequest(prompt="x" * 40)
    req.cache_policy.semantic_threshold = threshold
    with pytest.raises(errors.InvalidArgument) as ei:
        list(s.Generate(req, Context()))
    return ei.value


def test_the_pipeline_gets_the_bound_request_id_and_a_deadline_capped_by_request_timeout():
    """The request id the interceptor bound is the one the pipeline runs under, and a client
    deadline longer than request_timeout_s is cut to it; the stream's reaper entry is gone
    once the stream has ended."""
    orch = ContextOrchestrator(0)
    s = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("h:1",),
                                                request_timeout_s=30.0))
    s.attach(orch, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                        max_prompt_tokens=1000, max_tokens=1000,
                                        max_concurrent=10))

    class LongDeadline(Context):
        def time_remaining(self):
            return 10_000.0

    t0 = time.monotonic()
    with bound_request_id("rid-42"):
        list(s.Generate(orchestrator_pb2.GenerateRequest(prompt="x" * 40), LongDeadline()))
    (call,) = orch.calls
    assert call["request_id"] == "rid-42"
    assert t0 + 29.0 <= call["deadline"] <= time.monotonic() + 30.0
    assert s._reaper.armed() == 0


# ---- Warm, Feedback, Stats ---------------------------------------------------------------------

def test_warm_without_a_warmer_is_failed_precondition_holding_nothing():
    """No warm-up configured: FAILED_PRECONDITION (not a retryable UNAVAILABLE), no slot kept."""
    s, _ = servicer(STREAM_HEADROOM + 1)
    before = _held(s)
    with pytest.raises(errors.FailedPrecondition, match="warm-up"):
        s.Warm(orchestrator_pb2.WarmRequest(top_k=1), Context())
    assert _held(s) == before


def test_a_warm_says_its_request_id_in_its_headers_before_it_ends():
    """A Warm's response headers carry the id it runs under (one the server made up: the
    client sent none), before its prefills end: a warm-up runs up to 120 s, and one its
    caller cancels gets no trailers to read the id from."""
    s, _ = servicer(STREAM_HEADROOM + 2)
    ran_under: list[str] = []
    release = threading.Event()

    def warm(tenant, request, remaining, **kw):
        ran_under.append(request_id_var.get())
        release.wait(10)
        return orchestrator_pb2.WarmResponse()

    s.warmer = SimpleNamespace(warm=warm)
    h = _on_loopback(s)
    try:
        # grpcurl (Go) prints the headers as they come; gRPC Python reads a unary call's
        # headers only with its end. Its deadline ends the call while the warm-up runs.
        out = subprocess.run(
            [grpcurl_path(), "-plaintext", "-v", "-max-time", "2", "-d", '{"top_k": 1}',
             h.address, "tiercache.v1.Orchestrator/Warm"],
            capture_output=True, text=True, timeout=30)
    finally:
        release.set()
        h.stop(0)
    said = re.search(r"Response headers received:\n(?:.*\n)*?x-request-id: (\S+)", out.stdout)
    assert "DeadlineExceeded" in out.stderr + out.stdout, (out.stdout, out.stderr)
    assert len(ran_under) == 1 and ran_under[0]
    assert said is not None and said.group(1) == ran_under[0], out.stdout


def test_feedback_without_a_rating_is_refused_naming_rating():
    """RATING_UNSPECIFIED (the field left unset) is INVALID_ARGUMENT naming rating, and the
    semantic tier is not called."""
    s, orch = servicer(STREAM_HEADROOM + 1)
    called: list = []
    orch.semantic = SimpleNamespace(enabled=True, invalidate=lambda *a, **kw: called.append(a),
                                    verify=lambda *a, **kw: called.append(a))
    ref = s.tenants.entry_ref(s.tenants.authenticate({}), "e1")
    with pytest.raises(errors.InvalidArgument, match="^rating:"):
        s.Feedback(orchestrator_pb2.FeedbackRequest(semantic_entry_id=ref), Context())
    assert called == []


def test_feedback_on_a_reference_signed_otherwise_hints_at_a_hash_key_rotation():
    """A reference signed with an earlier hash key (rotated since, docs/deploy.md) was a bare
    NOT_FOUND "unknown", as a mistyped one: the hint is given for a reference of the signed
    shape whose signature fails, NOT_FOUND still, and for no other; the tier is not called."""
    from services.orchestrator.tenants import TenantRegistry

    s, orch = servicer(STREAM_HEADROOM + 1)
    called: list = []
    orch.semantic = SimpleNamespace(enabled=True, invalidate=lambda *a, **kw: called.append(a),
                                    verify=lambda *a, **kw: called.append(a))
    before = TenantRegistry.build(tokens_file="", tokens="", key=b"an earlier key",
                                  max_prompt_tokens=100, max_tokens=100, max_concurrent=4)
    old_ref = before.entry_ref(before.authenticate({}), "e1")
    for ref, hint in ((old_ref, True), ("e1", False), ("e1.not-a-tag", False)):
        with pytest.raises(errors.NotFound) as ei:
            s.Feedback(orchestrator_pb2.FeedbackRequest(
                semantic_entry_id=ref, rating=orchestrator_pb2.RATING_GOOD), Context())
        said = str(ei.value)
        assert said.startswith(f"semantic_entry_id: {ref!r} unknown"), said
        assert ("signed with an earlier hash key" in said) == hint, said
    assert called == []


@pytest.mark.parametrize("code,left,answered,said", [
    (grpc.StatusCode.UNAVAILABLE, None, "UNAVAILABLE", "the semantic tier is unavailable"),
    # The tier's own timeout (a hung shard, 2 s) with the caller's time left: retry later.
    (grpc.StatusCode.DEADLINE_EXCEEDED, None, "UNAVAILABLE",
     "the semantic tier did not answer in time"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 30.0, "UNAVAILABLE",
     "the semantic tier did not answer in time"),
    # The caller's own deadline, passed while the tier had not answered: its own status.
    (grpc.StatusCode.DEADLINE_EXCEEDED, 0.0, "DEADLINE_EXCEEDED",
     "the semantic tier did not answer in time")])
def test_feedback_while_the_semantic_tier_is_down_blames_the_tier_not_the_reference(
        code, left, answered, said):
    """A chaos walkthrough: with the semantic service down, Feedback said "semantic_entry_id:
    the semantic tier is unavailable (unavailable)", a field that was fine blamed and the
    code said twice. The tier's address (in gRPC's text) is kept out. A live walk (the
    semantic service SIGSTOPped, grpcurl with no deadline): a Feedback ended
    DEADLINE_EXCEEDED after the tier's own 2 s, which docs/clients.md (and the Python
    client's retry_later) says never to send again ("the same deadline runs out again") though
    Feedback is safe to send again and the caller had set no deadline: the tier's timeout is
    UNAVAILABLE (retry later) while the caller's time is not up."""
    from tests.orchestrator.test_pipeline_paths import RpcError

    class Down(RpcError):
        def details(self) -> str:
            return "failed to connect to all addresses; last error: 10.0.3.9:50052"

    def fail(*a, **kw):
        raise Down(code)

    class Timed(Context):
        def time_remaining(self):
            return left

    s, orch = servicer(STREAM_HEADROOM + 1)
    orch.semantic = SimpleNamespace(enabled=True, invalidate=fail, verify=fail)
    ref = s.tenants.entry_ref(s.tenants.authenticate({}), "e1")
    for rating in (orchestrator_pb2.RATING_GOOD, orchestrator_pb2.RATING_BAD):
        with pytest.raises(errors.TierCacheError) as ei:
            s.Feedback(orchestrator_pb2.FeedbackRequest(semantic_entry_id=ref, rating=rating),
                       Timed())
        assert (ei.value.code, str(ei.value)) == (answered, said)


@pytest.mark.parametrize("left,ended", [(None, errors.Cancelled), (0.0, errors.DeadlineExceeded)])
@pytest.mark.parametrize("rating", [orchestrator_pb2.RATING_GOOD, orchestrator_pb2.RATING_BAD])
def test_a_feedback_whose_caller_cancels_cancels_the_tiers_call(rating, left, ended):
    """A live walkthrough: a Feedback cancelled while the semantic tier was slow left its
    Invalidate running (up to the tier's 2 s, a worker held), and the tier applied the rating
    of a client that had seen CANCELLED. The call under way is cancelled with the caller, as
    a Generate's tier calls are, and the Feedback ends CANCELLED (DEADLINE_EXCEEDED, not
    "client cancelled", when it was the deadline that passed)."""
    from tests.orchestrator.test_pipeline_paths import Cancellable

    class Cancelling(Context):
        def __init__(self) -> None:
            self.callbacks: list = []

        def add_callback(self, fn):
            self.callbacks.append(fn)
            return True

        def time_remaining(self):
            return left

    ctx = Cancelling()
    calls: list[Cancellable] = []

    def slow(*a, on_call=None, **kw):
        call = Cancellable()
        calls.append(call)
        on_call(call)
        for fn in ctx.callbacks:  # the client cancels while the tier has not answered
            fn()
        assert call.cancelled.wait(5)
        raise grpc.FutureCancelledError()

    s, orch = servicer(STREAM_HEADROOM + 1)
    orch.semantic = SimpleNamespace(enabled=True, invalidate=slow, verify=slow)
    ref = s.tenants.entry_ref(s.tenants.authenticate({}), "e1")
    with pytest.raises(ended):
        s.Feedback(orchestrator_pb2.FeedbackRequest(semantic_entry_id=ref, rating=rating), ctx)
    assert len(calls) == 1 and calls[0].cancelled.is_set()


def _stats_servicer(tokens: str = ""):
    s = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("h:1",)))
    health = [SimpleNamespace(healthy=h, proto=lambda h=h: common_pb2.DependencyHealth(
        name=f"kvpool-{h}")) for h in (True, False)]
    replicas = [SimpleNamespace(stats=kvpool_pb2.KvStatsResponse(replica_id=f"r{i}"), health=h)
                for i, h in enumerate(health)]
    orch = SimpleNamespace(stats=OrchestratorStats(), replicas=SimpleNamespace(replicas=replicas),
                           semantic=SimpleNamespace(enabled=False), prefix=None,
                           model_id="SmolLM2-135M-Instruct")
    return s, orch, TenantRegistry.build(tokens_file="", tokens=tokens, key=b"k",
                                         max_prompt_tokens=100, max_tokens=100,
                                         max_concurrent=4)


def test_stats_is_unavailable_while_loading_and_lists_only_healthy_replicas_figures():
    """Before attach, Stats is UNAVAILABLE (the tenants are not loaded yet); after, it
    carries the figures of healthy replicas only, and every replica's health."""
    s, orch, tenants = _stats_servicer()
    with pytest.raises(errors.Unavailable):
        s.Stats(orchestrator_pb2.StatsRequest(), Context())
    s.attach(orch, tenants)
    resp = s.Stats(orchestrator_pb2.StatsRequest(), Context())
    assert [r.replica_id for r in resp.replicas] == ["r0"]
    assert [d.name for d in resp.dependencies] == ["kvpool-True", "kvpool-False"]


def test_stats_names_the_orchestrators_own_model_id():
    """`tiercache stats` showed each replica's model id and not the orchestrator's, which
    decides which replicas are routed to: a replica out of routing for serving another model
    could not be compared with it."""
    s, orch, tenants = _stats_servicer()
    s.attach(orch, tenants)
    resp = s.Stats(orchestrator_pb2.StatsRequest(), Context())
    assert resp.model_id == "SmolLM2-135M-Instruct"


def test_stats_is_refused_to_a_tenant_without_admin():
    """Cluster-wide Stats are for admin tenants only: PERMISSION_DENIED naming authorization."""
    s, orch, tenants = _stats_servicer(tokens="tok-a=alice")
    s.attach(orch, tenants)

    class Alice(Context):
        def invocation_metadata(self):
            return (("authorization", "Bearer tok-a"),)

    with pytest.raises(errors.PermissionDenied, match="authorization"):
        s.Stats(orchestrator_pb2.StatsRequest(), Alice())


def test_a_prompt_of_exactly_max_prompt_tokens_is_served_and_one_token_more_refused():
    """max_prompt_tokens is the most a rendered prompt may have: that many tokens run, one more
    is INVALID_ARGUMENT naming messages, holding nothing."""
    s, orch = servicer(STREAM_HEADROOM + 2, max_prompt_tokens=3)  # the renderer gives 3 tokens
    orch.release.set()
    assert [m.text for m in s.Generate(request(), Context())] == ["hi"]
    s, orch = servicer(STREAM_HEADROOM + 2, max_prompt_tokens=2)
    before = _held(s)
    with pytest.raises(errors.InvalidArgument, match="^messages: 3 tokens exceed the limit of 2 "
                       r"\(the orchestrator's max_prompt_tokens\)$"):
        next(s.Generate(request(), Context()))
    assert _held(s) == before


def test_a_prompt_too_long_for_the_tenant_is_counted_as_a_prompt_tokens_rejection():
    """The size check before rendering refuses for the tenant's limit as the check after
    tokenizing would, and counts it the same (rejections_total, reason prompt_tokens)."""

    s, orch = servicer(STREAM_HEADROOM + 2)  # the tenant's limit: 100 prompt tokens
    labels = {"tenant": "default", "reason": "prompt_tokens"}
    before = sample_value("tiercache_orchestrator_rejections_total", labels) or 0
    long = orchestrator_pb2.GenerateRequest(messages=[{"role": "user", "content": "w" * 801}])
    with pytest.raises(errors.ResourceExhausted, match="tenant limit"):
        next(s.Generate(long, Context()))
    assert orch.renderer.rendered == 0
    assert sample_value("tiercache_orchestrator_rejections_total",
                                     labels) == before + 1


def test_stats_answers_when_the_semantic_tier_runs_out_of_time_and_skips_a_late_index():
    """Stats is best effort: a semantic tier out of time leaves its figures out (not the
    answer), and once the call's deadline has passed the prefix index is not asked at all
    (its health is still listed)."""
    s, orch, tenants = _stats_servicer()

    def out_of_time(deadline):
        raise errors.DeadlineExceeded("semantic stats: deadline exceeded")

    asked: list = []
    orch.semantic = SimpleNamespace(enabled=True, stats=out_of_time, dependencies=lambda: [])
    orch.prefix = SimpleNamespace(stats=lambda timeout: asked.append(timeout),
                                  dependencies=lambda: [common_pb2.DependencyHealth(name="px")])
    s.attach(orch, tenants)

    class Late(Context):
        def time_remaining(self):
            return -0.5

    resp = s.Stats(orchestrator_pb2.StatsRequest(), Late())
    assert [r.replica_id for r in resp.replicas] == ["r0"] and not resp.HasField("semantic")
    assert asked == [] and resp.dependencies[-1].name == "px"


@pytest.mark.parametrize("field", ["prompts", "top_k"])
def test_a_warm_may_ask_for_max_warm_prompts_and_not_one_more(field):
    """A Warm names at most MAX_WARM_PROMPTS prompts (or top_k): one more is INVALID_ARGUMENT
    naming the field, before any rendering or replica call."""
    from services.orchestrator.render import PromptRenderer
    from services.orchestrator.server import MAX_WARM_PROMPTS, Warmer
    from tests.orchestrator.test_pipeline_paths import TENANT, Stub, Tok, make

    stubs = {"A": Stub("A", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    try:
        def warm(n: int):
            if field == "top_k":
                return warmer.warm(TENANT, orchestrator_pb2.WarmRequest(top_k=n))
            return warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt="")] * n))

        with pytest.raises(errors.InvalidArgument, match=f"^{field}: at most {MAX_WARM_PROMPTS}"):
            warm(MAX_WARM_PROMPTS + 1)
        with pytest.raises(errors.TierCacheError) as ei:  # refused later, for another reason
            warm(MAX_WARM_PROMPTS)
        assert f"at most {MAX_WARM_PROMPTS}" not in str(ei.value)
        assert stubs["A"].requests == []
    finally:
        warmer.stop()


def test_a_request_refused_as_bad_input_takes_its_rate_token_and_a_limit_refusal_none(
        tmp_path):
    """As docs/reliability.md says: the bucket is taken before the request is read, so a
    malformed call, or one past the tenant's size limits, takes its token (a flood of them is
    limited too), while a call refused by the tenant's concurrency limit gives it back."""
    f = tmp_path / "tokens.json"
    f.write_text('{"tok": {"tenant": "a", "rate_per_s": 0.001, "burst": 4, '
                 '"max_concurrent": 1}}')
    s, orch = servicer(STREAM_HEADROOM + 4)
    s.attach(orch, TenantRegistry.build(tokens_file=str(f), tokens="", key=b"k",
                                        max_prompt_tokens=100, max_tokens=100,
                                        max_concurrent=100))

    class Authed(Context):
        def invocation_metadata(self):
            return (("authorization", "Bearer tok"),)

    bad = request()
    bad.prompt = "hello"  # with messages: INVALID_ARGUMENT
    with pytest.raises(errors.InvalidArgument):
        next(s.Generate(bad, Authed()))
    too_long = request()
    too_long.sampling.max_tokens = 101  # past the tenant's max_tokens (100)
    with pytest.raises(errors.ResourceExhausted, match="tenant limit"):
        next(s.Generate(too_long, Authed()))
    held = s.Generate(request(), Authed())
    assert next(held).text == "hi"  # the tenant's one slot, under way
    with pytest.raises(errors.ResourceExhausted, match="concurrent"):
        next(s.Generate(request(), Authed()))  # refused by the limit: token given back
    orch.release.set()
    list(held)
    assert [m.text for m in s.Generate(request(), Authed())][0] == "hi"  # the third token
    with pytest.raises(errors.Overloaded, match="rate limit"):
        next(s.Generate(request(), Authed()))  # 4 taken: the two refused, the two served


# ---- Warm and the warm-up loop (Warmer): rules the mutation audit found unguarded -------------

def _warm_stubs(replicas=("A", "B"), prefix=None, **cfg):
    """A real Warmer over fake replicas (`Stub`s recording each PrefillRequest) and a
    byte-level renderer: (stubs, warmer). Stop the warmer after use."""
    from services.orchestrator.render import PromptRenderer
    from services.orchestrator.server import Warmer
    from tests.orchestrator.test_pipeline_paths import Stub, Tok, make

    stubs = {r: Stub(r, []) for r in replicas}
    orch = make(stubs, prefix=prefix)
    orch.renderer = PromptRenderer(Tok(), max_chars=5000)
    return stubs, Warmer(orch, OrchestratorConfig(kvpool_addresses=replicas, **cfg))


def _prompt(text: str) -> orchestrator_pb2.WarmPrompt:
    return orchestrator_pb2.WarmPrompt(prompt=text)


def _sent(stubs) -> list:
    """Every PrefillRequest the fake replicas received."""
    return [req for s in stubs.values() for req in s.requests]


def test_a_warm_pins_for_the_ttl_it_asks_up_to_the_limit_or_else_the_server_default():
    """pin_ttl_seconds 0 is warm_pin_ttl_s; a TTL given is the one each replica pins for, and
    warm_pin_ttl_max_s itself is allowed (only a longer one is INVALID_ARGUMENT)."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    stubs, warmer = _warm_stubs(warm_pin_ttl_s=600, warm_pin_ttl_max_s=3600)
    try:
        for asked, pinned in ((0, 600), (120, 120), (3600, 3600)):
            for s in stubs.values():
                s.requests.clear()
            out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[_prompt("x" * 16)], pin_ttl_seconds=asked))
            assert [r.error for r in out.results] == ["", ""]
            assert [(req.pin, req.ttl_seconds) for req in _sent(stubs)] == [(True, pinned)] * 2
    finally:
        warmer.stop()


def test_a_warms_prefills_carry_the_tenants_cache_salt_and_the_served_model():
    """A prompt is cached under its tenant's salt (under another it is another tenant's, or
    nobody's), and names the model, which the replica checks against its own."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    stubs, warmer = _warm_stubs()
    try:
        warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 16)]))
    finally:
        warmer.stop()
    assert [(req.cache_salt, req.model_id) for req in _sent(stubs)] == [
        (TENANT.cache_salt, "m")] * 2


def test_a_warm_result_carries_the_replicas_figures():
    """WarmResult says what the replica did: tokens prefilled, found cached, computed, and the
    blocks it pinned, as its PrefillResponse said them."""
    from tests.orchestrator.test_pipeline_paths import TENANT, Unary

    stubs, warmer = _warm_stubs(replicas=("A",))
    stubs["A"].Prefill = Unary(lambda req, timeout=None, metadata=None: kvpool_pb2.
                               PrefillResponse(prompt_tokens=48, cached_tokens=32,
                                               computed_tokens=16, pinned_blocks=2,
                                               replica_id="A"))
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 48)]))
    finally:
        warmer.stop()
    r = out.results[0]
    assert (r.replica_id, r.prompt_index, r.prompt_tokens, r.cached_tokens, r.computed_tokens,
            r.pinned_blocks, r.error) == ("A", 0, 48, 32, 16, 2, "")


@pytest.mark.parametrize(("left", "lo", "hi"), [(5.0, 2.0, 5.0), (None, 100.0, 120.0),
                                                (1000.0, 100.0, 120.0)])
def test_each_prefill_is_given_what_is_left_of_the_warms_deadline_at_most_120_s(left, lo, hi):
    """A Warm ends by its caller's deadline, and holds its worker thread and slots for at most
    120 s whatever that deadline (none, or an hour): each prefill's timeout is what is left."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    stubs, warmer = _warm_stubs(replicas=("A",))
    timeouts: list = []
    plain = stubs["A"].Prefill.handler
    stubs["A"].Prefill.handler = lambda req, timeout=None, metadata=None: (
        timeouts.append(timeout) or plain(req, timeout, metadata))
    try:
        warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 16)]),
                    time_remaining=left)
    finally:
        warmer.stop()
    assert len(timeouts) == 1 and lo < timeouts[0] <= hi, timeouts


def test_a_prefill_whose_deadline_is_reached_as_it_starts_is_not_sent():
    """Nothing is left of the call's time (0 s): answered DEADLINE_EXCEEDED at once, as past
    the deadline, not sent with a token timeout."""
    from tests.orchestrator.test_pipeline_paths import Stub
    from tests.orchestrator.test_warm_loop import make as make_loop

    w, reps = make_loop([0], [])
    stub = Stub("r0", [])
    reps[0].stub = stub
    try:
        res = w._prefill(reps[0], [1] * 32, "s", 60, 0, timeout=0.0)
    finally:
        w.stop()
    assert res.error.startswith("DEADLINE_EXCEEDED") and stub.requests == []


def test_warm_for_owners_warms_the_owner_whichever_replica_that_is():
    """WARM_TARGET_OWNERS: only the replica routing would pick for the prompt (here the last
    of three, the one the index says holds it), not merely one replica."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    prefix = SimpleNamespace(timeout_s=0.5, top_prefixes=None,
                             match=lambda hashes, model_id, timeout=None, probe=False,
                             on_call=None: {"C": 64})
    stubs, warmer = _warm_stubs(replicas=("A", "B", "C"), prefix=prefix)
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[_prompt("x" * 64)], target=orchestrator_pb2.WARM_TARGET_OWNERS))
    finally:
        warmer.stop()
    assert [r.replica_id for r in out.results] == ["C"]
    assert [len(s.requests) for s in stubs.values()] == [0, 0, 1]


def test_an_unknown_warm_target_is_refused_naming_target_before_any_prefill():
    """A WarmTarget this server does not know is INVALID_ARGUMENT naming target (it once warmed
    every replica)."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    stubs, warmer = _warm_stubs()
    try:
        with pytest.raises(errors.InvalidArgument, match="^target: unknown WarmTarget 7"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 16)],
                                                             target=7))
    finally:
        warmer.stop()
    assert _sent(stubs) == []


def test_a_warm_prompt_at_the_server_limit_or_the_model_context_is_warmed():
    """Prompts over max_prompt_tokens or the replicas' model context are refused; one of
    exactly that many tokens fits (a replica's Prefill takes a prompt of its whole context)."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    stubs, warmer = _warm_stubs(replicas=("A",), max_prompt_tokens=64)
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 64)]))
        assert [(r.prompt_tokens, r.error) for r in out.results] == [(64, "")]
        for r in warmer.orch.replicas.replicas:
            r.stats = kvpool_pb2.KvStatsResponse(max_context=48)
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 48)]))
        assert [(r.prompt_tokens, r.error) for r in out.results] == [(48, "")]
    finally:
        warmer.stop()


def test_a_warm_prompt_at_the_tenants_limit_is_warmed_one_past_it_refused_and_counted():
    """The tenant's max_prompt_tokens holds for Warm as for its requests: that many tokens are
    warmed; one more is RESOURCE_EXHAUSTED, counted as a prompt_tokens rejection."""

    from tests.orchestrator.test_pipeline_paths import TENANT

    small = dataclasses.replace(TENANT, max_prompt_tokens=48)
    labels = {"tenant": small.name, "reason": "prompt_tokens"}
    before = sample_value("tiercache_orchestrator_rejections_total", labels) or 0
    stubs, warmer = _warm_stubs(replicas=("A",))
    try:
        out = warmer.warm(small, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 48)]))
        assert [(r.prompt_tokens, r.error) for r in out.results] == [(48, "")]
        with pytest.raises(errors.ResourceExhausted, match=r"^prompts\[0\]: 49 tokens exceed"):
            warmer.warm(small, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 49)]))
    finally:
        warmer.stop()
    assert len(_sent(stubs)) == 1
    assert sample_value("tiercache_orchestrator_rejections_total",
                                     labels) == before + 1


def test_a_top_k_warm_prefills_k_of_the_callers_own_prefixes_whatever_the_index_returns():
    """Warm(top_k) warms only the caller's own hot prefixes, k of them: an index that hands
    back other tenants' prefixes, or more than k (an older one that ignores the filter), does
    not make the orchestrator prefill them."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    others = [prefix_pb2.HotPrefix(token_ids=[200 + i] * 32, holders=["A"], hits=50,
                                   cache_salt="someone-else") for i in range(2)]
    mine = [prefix_pb2.HotPrefix(token_ids=[100 + i] * 32, holders=["A"], hits=5 - i,
                                 cache_salt=TENANT.cache_salt) for i in range(3)]
    prefix = SimpleNamespace(top_prefixes=lambda k, model_id, cache_salt=None: others + mine)
    stubs, warmer = _warm_stubs(prefix=prefix)
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(top_k=2))
    finally:
        warmer.stop()
    assert len(out.results) == 4 and all(not r.error for r in out.results)
    for s in stubs.values():
        assert sorted(list(req.token_ids) for req in s.requests) == [[100] * 32, [101] * 32]
        assert {req.cache_salt for req in s.requests} == {TENANT.cache_salt}


def test_a_warm_past_the_per_call_limit_names_the_field_it_asked_with():
    """More prefills than warm_max_prefills_per_call is INVALID_ARGUMENT naming what asked for
    them: prompts, or top_k for a Warm of hot prefixes alone."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    hot = [prefix_pb2.HotPrefix(token_ids=[100 + i] * 32, holders=[], hits=5,
                                cache_salt=TENANT.cache_salt) for i in range(2)]
    prefix = SimpleNamespace(top_prefixes=lambda k, model_id, cache_salt=None: hot[:k])
    stubs, warmer = _warm_stubs(prefix=prefix, warm_max_prefills_per_call=3)
    try:
        with pytest.raises(errors.InvalidArgument, match="^top_k: 4 prefills"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(top_k=2))
        with pytest.raises(errors.InvalidArgument, match="^prompts: 4 prefills"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[_prompt("x" * 16), _prompt("y" * 16)]))
        # A prompt and a hot prefix on two replicas: the prefix's two count as the prompt's
        # (the message said "prompts x target replicas", as if the prompt alone made four).
        with pytest.raises(errors.InvalidArgument, match=r"^prompts: 4 prefills \(one per "
                           r"prompt or top-k prefix and target replica\) exceed the limit of 3 "
                           r"per call: warm fewer prompts or a smaller top_k"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 16)],
                                                             top_k=1))
    finally:
        warmer.stop()
    assert _sent(stubs) == []


def test_a_warm_reserves_the_prefills_beyond_the_one_its_call_paid_for():
    """afford(n) is asked for the prefills beyond the first (the call's own request paid for
    that one), before any runs; charge settles what computed against what was reserved."""
    from tests.orchestrator.test_pipeline_paths import TENANT

    stubs, warmer = _warm_stubs()
    asked: list = []
    charged: list = []

    def afford(n):
        asked.append((n, len(_sent(stubs))))
        return n

    try:
        warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[_prompt("x" * 16), _prompt("y" * 16)]), charge=charged.append,
            afford=afford)
    finally:
        warmer.stop()
    assert asked == [(3, 0)]  # 2 prompts x 2 replicas, less the first; none sent yet
    assert charged == []  # all 4 computed: 3 beyond the first, as reserved


def test_a_warm_whose_caller_goes_does_not_wait_for_a_pool_thread():
    """Once the caller is gone, a Warm whose prefills still queue behind other calls' (the
    shared pool busy) answers them at once, CANCELLED, and ends: none waits for a thread."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.orchestrator.test_pipeline_paths import TENANT

    stubs, warmer = _warm_stubs()
    warmer._pool.shutdown()
    warmer._pool = ThreadPoolExecutor(max_workers=1)
    busy, release = threading.Event(), threading.Event()
    warmer._pool.submit(lambda: busy.set() or release.wait(30))  # another call's prefill
    gone = _Gone()
    out: list = []
    t = threading.Thread(target=lambda: out.append(warmer.warm(
        TENANT, orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 16)]), gone=gone)))
    try:
        assert busy.wait(10)
        t.start()
        # both of its prefills queue behind the busy thread
        holds_within(lambda: warmer._pool._work_queue.qsize() >= 2, 10, 0.01)
        assert warmer._pool._work_queue.qsize() == 2
        gone.set()
        t.join(5)
        assert not t.is_alive() and not release.is_set()
        assert [r.error.split(":")[0] for r in out[0].results] == ["CANCELLED"] * 2
    finally:
        release.set()
        t.join(10)
        warmer.stop()
    assert _sent(stubs) == []


def test_an_owner_probe_starting_after_the_caller_went_is_cancelled_at_once():
    """_Gone.holding: a probe handed over once the caller is gone is cancelled as it starts
    (the caller's cancel came between the check and the call), not left to the index's
    timeout; one handed over before is cancelled when the caller goes."""
    from services.orchestrator.server import _Gone
    from tests.orchestrator.test_pipeline_paths import Cancellable

    gone = _Gone()
    before = Cancellable()
    gone.holding(before)
    assert not before.cancelled.is_set()
    gone.set()
    assert before.cancelled.is_set()
    late = Cancellable()
    gone.holding(late)
    assert late.cancelled.is_set()


# The background loop.

def test_the_loop_starts_only_with_an_interval_a_top_k_and_a_prefix_index():
    """warm_interval_s <= 0 or warm_top_k == 0 turn the loop off, and without a prefix index
    there is nothing to name hot prefixes: no loop thread is started."""
    from services.orchestrator.server import Warmer

    def loops() -> int:
        return sum(t.name == "warm-loop" and t.is_alive() for t in threading.enumerate())

    index = SimpleNamespace(top_prefixes=lambda *a, **kw: [])
    cases = ((0, 8, index, 0), (30.0, 0, index, 0), (30.0, 8, None, 0), (30.0, 8, index, 1))
    for interval, top_k, prefix, started in cases:
        before = loops()
        orch = SimpleNamespace(prefix=prefix, replicas=SimpleNamespace(healthy=lambda: []))
        w = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",),
                                            warm_interval_s=interval, warm_top_k=top_k))
        w.start()
        try:
            assert loops() == before + started, (interval, top_k, prefix)
        finally:
            w.stop()


def test_the_loop_runs_a_cycle_each_interval_outlives_a_failing_one_and_ends_on_stop():
    """Each interval runs a cycle; a cycle that raises is logged and the next one runs; stop
    ends the loop."""
    from tests.orchestrator.test_warm_loop import make as make_loop

    w, _ = make_loop([0], [])
    w.cfg = OrchestratorConfig(warm_interval_s=0.01, warm_top_k=8)  # not validated: fast
    asked: list = []

    def top(k, model_id, min_hits=0):
        asked.append(k)
        if len(asked) == 1:
            raise RuntimeError("a bad cycle")
        return []

    w.orch.prefix.top_prefixes = top
    w.start()
    loop = next(t for t in threading.enumerate() if t.name == "warm-loop" and t.is_alive())
    try:
        holds_within(lambda: len(asked) >= 3, 10, 0.01)
        assert len(asked) >= 3
    finally:
        w.stop()
    loop.join(5)
    assert not loop.is_alive()


def test_stop_during_a_cycle_sends_no_further_prefill():
    """A cycle under way when the warmer stops (the server shutting down) sends nothing more."""
    from tests.orchestrator.test_warm_loop import hp
    from tests.orchestrator.test_warm_loop import make as make_loop

    w, reps = make_loop([0, 0, 0], [hp([1] * 32, []), hp([2] * 32, [])])
    real = reps[0].stub.Prefill

    def prefill_then_stop(req, timeout=None, metadata=None):
        w.stop()
        return real(req, timeout, metadata)

    reps[0].stub.Prefill = prefill_then_stop
    assert w.cycle() == 1
    assert sum(len(r.stub.calls) for r in reps) == 1


def _loop_metric(name: str, **labels) -> float:

    return sample_value(f"tiercache_orchestrator_warmup_{name}_total", labels) or 0.0


def test_a_cycle_with_no_healthy_replica_or_no_index_warms_nothing_and_says_which():
    """No healthy replica: outcome no_replica (not held_load); the index unreachable: the
    cycle ends, outcome index_unavailable, instead of raising."""
    from tests.orchestrator.test_warm_loop import Err
    from tests.orchestrator.test_warm_loop import make as make_loop

    outcomes = ("no_replica", "held_load", "index_unavailable")
    before = {o: _loop_metric("cycles", outcome=o) for o in outcomes}
    w, _ = make_loop([], [])
    assert w.cycle() == 0
    w2, _ = make_loop([0], [])

    def down(k, model_id, min_hits=0):
        raise Err(grpc.StatusCode.UNAVAILABLE, "index down")

    w2.orch.prefix.top_prefixes = down
    assert w2.cycle() == 0
    assert {o: _loop_metric("cycles", outcome=o) - before[o] for o in outcomes} == {
        "no_replica": 1, "held_load": 0, "index_unavailable": 1}


def test_the_loop_stops_warming_once_the_cluster_gets_busy_even_on_an_idle_replica():
    """Traffic back during a cycle (the cluster's mean load over warm_max_load) holds the rest
    of it, though the next replica lacking a prefix is itself idle."""
    from tests.orchestrator.test_warm_loop import hp
    from tests.orchestrator.test_warm_loop import make as make_loop

    w, reps = make_loop([0, 0, 0, 0], [hp([1] * 32, []), hp([2] * 32, [])])
    w.cfg = OrchestratorConfig(warm_interval_s=1.0, warm_top_k=8, warm_max_load=0.5,
                               warm_max_prompts_per_cycle=10)
    real = reps[0].stub.Prefill

    def prefill_then_traffic(req, timeout=None, metadata=None):
        reps[0].load = reps[1].load = 5  # the others stay idle; the mean is 2.5
        return real(req, timeout, metadata)

    reps[0].stub.Prefill = prefill_then_traffic
    assert w.cycle() == 1
    assert [len(r.stub.calls) for r in reps] == [1, 0, 0, 0]


def test_the_loop_warms_each_prefix_under_its_own_salt_and_counts_the_tokens_held():
    """A hot prefix is copied under the cache salt it was hot under (its tenant's); the tokens
    a replica already held count as cached in the loop's token metric."""
    from tests.orchestrator.test_warm_loop import make as make_loop

    hot = prefix_pb2.HotPrefix(token_ids=[1] * 32, holders=["r0"], hits=10, cache_salt="t-1")
    w, reps = make_loop([0, 0], [hot])
    salts: list = []

    def prefill(req, timeout=None, metadata=None):
        salts.append(req.cache_salt)
        return kvpool_pb2.PrefillResponse(prompt_tokens=32, cached_tokens=16, computed_tokens=16,
                                          replica_id="r1")

    reps[1].stub.Prefill = prefill
    cached = _loop_metric("tokens", kind="cached")
    assert w.cycle() == 1
    assert salts == ["t-1"]
    assert _loop_metric("tokens", kind="cached") == cached + 16


def test_the_loops_share_of_hot_prefixes_is_k_in_turns_over_every_tenant():
    """_fair_share: up to k prefixes some replica lacks, one from each tenant in turn (hottest
    first within each) for as many turns as it takes, never more than k."""
    from services.orchestrator.server import _fair_share

    def hot(salt, n):
        return [prefix_pb2.HotPrefix(token_ids=[i], holders=[], hits=9 - i, cache_salt=salt)
                for i in range(n)]

    x, y, z = hot("x", 3), hot("y", 2), hot("z", 1)
    got = _fair_share(x + y + z, {"r0"}, 2)
    assert [(p.cache_salt, p.token_ids[0]) for p in got] == [("x", 0), ("y", 0)]
    got = _fair_share(x + y + z, {"r0"}, 5)
    assert [(p.cache_salt, p.token_ids[0]) for p in got] == [
        ("x", 0), ("y", 0), ("z", 0), ("x", 1), ("y", 1)]


# The Warm RPC.

def test_the_warm_rpc_hands_its_warmer_the_callers_deadline_and_cancel():
    """The servicer's Warm passes on the time its caller left, and its cancel: once the RPC
    ends, an owner probe of a hung index under way is cancelled and nothing is prefilled."""
    from services.orchestrator.render import PromptRenderer
    from services.orchestrator.server import Warmer
    from tests.orchestrator.test_pipeline_paths import HungIndex, Stub, Tok, make

    s, _ = servicer(STREAM_HEADROOM + 1)
    index = HungIndex()
    stubs = {r: Stub(r, []) for r in ("A", "B")}
    orch = make(stubs, prefix=index)
    orch.renderer = PromptRenderer(Tok(), max_chars=100)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A", "B")))
    s.attach(orch, s.tenants, warmer)
    ended: list = []

    class Ctx(Context):
        def time_remaining(self):
            return 20.0

        def add_callback(self, fn):
            ended.append(fn)
            return True

    threading.Thread(target=lambda: index.started.wait(5) and [fn() for fn in ended],
                     daemon=True).start()
    t0 = time.monotonic()
    try:
        out = s.Warm(orchestrator_pb2.WarmRequest(
            prompts=[_prompt("x" * 32)], target=orchestrator_pb2.WARM_TARGET_OWNERS), Ctx())
    finally:
        warmer.stop()
    assert time.monotonic() - t0 < 3.0
    assert len(index.probes) == 1 and index.probes[0].cancelled.is_set()
    assert [r.error.split(":")[0] for r in out.results] == ["CANCELLED"] and _sent(stubs) == []
    assert s._streams == 0

    # The caller's deadline bounds the prefills (each one's timeout is what is left of it).
    timeouts: list = []
    for stub in stubs.values():
        plain = stub.Prefill.handler
        stub.Prefill.handler = lambda req, timeout=None, metadata=None, plain=plain: (
            timeouts.append(timeout) or plain(req, timeout, metadata))
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A", "B")))
    s.attach(orch, s.tenants, warmer)
    try:
        s.Warm(orchestrator_pb2.WarmRequest(prompts=[_prompt("x" * 32)]), Ctx())
    finally:
        warmer.stop()
    assert len(timeouts) == 2 and all(10.0 < t <= 20.0 for t in timeouts), timeouts


def test_stats_answers_in_the_callers_time_when_a_prefix_shard_never_does():
    """A prefix index call that runs out all the time it is given leaves the index's figures
    out, not the answer: the tiers were given all of the caller's time, so the answer came as
    its deadline passed and the caller got DEADLINE_EXCEEDED instead of the figures it had."""
    from clients.python.client import TierCacheClient
    from tests.orchestrator.stats_view import stats_server

    class Hung(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    given: list[float] = []

    def never(timeout):
        given.append(timeout)
        if len(given) == 1:  # the first call, to connect: answered
            return prefix_pb2.PrefixStatsResponse()
        time.sleep(timeout)
        raise Hung()

    prefix = SimpleNamespace(stats=never, dependencies=lambda: [
        common_pb2.DependencyHealth(name="prefix", address="px:1")])
    with stats_server(SimpleNamespace(enabled=False), prefix) as addr, \
            TierCacheClient(addr, timeout=30) as c:
        assert c.stats().HasField("prefix")  # connected: the call below is all the handler's
        resp = c.stats(timeout=0.6)
    assert not resp.HasField("prefix") and resp.dependencies[-1].name == "prefix"
    assert len(given) == 2 and given[1] < 0.5  # a fifth of 0.6 s kept to answer in


def test_a_warm_when_every_replica_serves_another_model_names_both_model_ids():
    """Mid-roll (the replicas on new weights, this orchestrator not yet) a Warm was
    UNAVAILABLE "no healthy replica to warm", naming no model; Generate names both ids, and
    so does Warm now (still UNAVAILABLE: a roll ends), asking no replica."""
    from services.orchestrator.render import PromptRenderer
    from services.orchestrator.server import Warmer
    from tests.orchestrator.test_pipeline_paths import TENANT, Stub, Tok, make

    stubs = {"A": Stub("A", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=100)
    r = orch.replicas.replicas[0]
    r.misfit = "kvpool-0: it serves model 'm2', this orchestrator 'm'"
    r.health.fail(r.misfit, hold=True)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    try:
        with pytest.raises(errors.Unavailable, match="serves model 'm2', this orch"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 40)]))
    finally:
        warmer.stop()
    assert _sent(stubs) == []


def test_a_threshold_under_the_floor_is_said_as_written_not_as_its_float32():
    """The floor check said the wire's float32: 0.1 was "got 0.10000000149011612"."""
    assert str(_threshold_refused(ContextOrchestrator(0), 0.1)) == (
        "cache_policy.semantic_threshold: must be 0 (tier default) or in [0.85, 1], got 0.1")


def test_a_warm_prompt_giving_messages_and_prompt_is_refused_before_any_work():
    """A WarmPrompt with both messages and prompt warmed the messages and dropped the prompt
    without a word (Generate refuses the pair): INVALID_ARGUMENT naming the prompt, before
    any rendering or replica call."""
    from services.orchestrator.render import PromptRenderer
    from services.orchestrator.server import Warmer
    from tests.orchestrator.test_pipeline_paths import TENANT, Stub, Tok, make

    stubs = {"A": Stub("A", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=1000)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    try:
        both = orchestrator_pb2.WarmPrompt(
            messages=[orchestrator_pb2.ChatMessage(role="system", content="s " * 40)],
            prompt="p " * 40)
        ok = orchestrator_pb2.WarmPrompt(prompt="q " * 40)
        with pytest.raises(errors.InvalidArgument) as ei:
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=[ok, both]))
        assert str(ei.value) == "prompts[1].prompt: give messages or prompt, not both"
        assert stubs["A"].requests == []
    finally:
        warmer.stop()


def test_a_warm_up_prefill_that_computed_nothing_is_no_info_line(caplog):
    """Another orchestrator's loop warmed the prefix first: the prefill finds it cached. Each
    such duplicate was an INFO line saying "0 tokens computed"; it is DEBUG now, and a
    prefill that computed the prefix is still INFO."""
    import logging

    from tests.orchestrator.test_warm_loop import hp, make

    w, reps = make([0, 0], [hp([1] * 32, [])])
    reps[0].stub.Prefill = lambda req, timeout=None, metadata=None: kvpool_pb2.PrefillResponse(
        prompt_tokens=32, computed_tokens=0, cached_tokens=32, replica_id="r0")
    with caplog.at_level(logging.DEBUG, logger="services.orchestrator.server"):
        assert w.cycle() == 2
    said = {r.getMessage(): r.levelname for r in caplog.records if "warmed" in r.getMessage()}
    assert said == {"warmed a 32-token prefix (10 hits) on r0: 0 tokens computed": "DEBUG",
                    "warmed a 32-token prefix (10 hits) on r1: 32 tokens computed": "INFO"}


def test_the_warm_up_loops_wait_is_jittered_around_its_interval(monkeypatch):
    """Orchestrators started together kept their warm-up cycles in step for good, each
    sending the same prefill at the same moment (docs/deploy.md): each wait is drawn within
    10% of warm_interval_s, so they drift apart."""
    from tests.orchestrator.test_warm_loop import make

    w, _ = make([0], [])
    waits: list[float] = []

    class Stop:
        def wait(self, timeout):
            waits.append(timeout)
            return len(waits) >= 50

    w._stop = Stop()
    monkeypatch.setattr(w, "cycle", lambda: 0)
    w._loop()
    assert len(waits) == 50 and all(0.9 <= t <= 1.1 for t in waits)  # interval 1 s
    assert len(set(waits)) > 40


def test_a_warm_prefill_never_gets_a_later_deadline_than_its_call():
    """A race audit: a prefill sent with less than 0.1 s of the call left got a 0.1 s timeout,
    so the replica computed and pinned it for the whole TTL up to 0.1 s after the Warm's
    caller had been told DEADLINE_EXCEEDED. Its timeout is what is left of the call's."""
    from services.orchestrator.render import PromptRenderer
    from services.orchestrator.server import Warmer
    from tests.orchestrator.test_pipeline_paths import TENANT, Stub, Tok, make

    timeouts: list[float] = []

    class Timed(Stub):
        def _prefill(self, req, timeout=None, metadata=None):
            timeouts.append(timeout)
            return super()._prefill(req, timeout, metadata)

    orch = make({"A": Timed("A", [])})
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16)]), time_remaining=0.05)
    finally:
        warmer.stop()
    assert not out.results[0].error
    assert len(timeouts) == 1 and 0 < timeouts[0] <= 0.05


def test_a_running_warm_prefill_is_cancelled_as_its_caller_goes_not_at_the_next_poll(
        monkeypatch):
    """A race audit: a running prefill looked for its caller's cancel every GONE_POLL_S
    (0.25 s), so a prefill ending within that time still pinned its blocks for the whole TTL
    for a caller already gone. It is woken by the cancel itself. Forced: the caller goes right
    after the prefill's wait checked for it, and the poll is made a minute long (only the
    wake can end the call in time)."""
    import time

    from services.orchestrator import server
    from services.orchestrator.render import PromptRenderer
    from services.orchestrator.server import Warmer, _Gone
    from tests.orchestrator.test_pipeline_paths import TENANT, Stub, Tok, Unary, make

    monkeypatch.setattr(server, "GONE_POLL_S", 60.0)
    release = threading.Event()

    class LateGone(_Gone):
        armed = False

        def is_set(self) -> bool:
            was = super().is_set()
            if (self.armed and not was  # the prefill's wait has just checked: gone now
                    and threading.current_thread().name.startswith("warm")):
                self.armed = False
                self.set()
            return was

    gone = LateGone()

    class Arming(Unary):
        def future(self, req, timeout=None, metadata=None):
            call = super().future(req, timeout, metadata)
            gone.armed = True  # the next look at `gone` is the prefill's wait
            return call

    class Hung(Stub):
        def __init__(self, *a) -> None:
            super().__init__(*a)
            self.Prefill = Arming(self._prefill)

        def _prefill(self, req, timeout=None, metadata=None):
            release.wait(10)
            return super()._prefill(req, timeout, metadata)

    stubs = {"A": Hung("A", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    t0 = time.monotonic()
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16)]), time_remaining=30.0,
            gone=gone)
    finally:
        release.set()
        warmer.stop()
    assert time.monotonic() - t0 < 5.0
    assert out.results[0].error.startswith("CANCELLED")
    assert [c.cancelled for c in stubs["A"].Prefill.calls] == [True]


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.RpcError:
    err = grpc.RpcError()
    err.code = lambda: code
    err.details = lambda: details
    return err


class _FlushStub:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.asked = fail, []

    def Flush(self, req, timeout=None, metadata=None):
        self.asked.append(req.cache_salt)
        self.timeouts = [*getattr(self, "timeouts", []), timeout]
        if self.fail:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return kvpool_pb2.KvFlushResponse(blocks_dropped=5, blocks_in_use=1)


def _erase_servicer(semantic, stubs, tokens="tok-o=ops", dispatched=None):
    """A servicer for EraseTenant whose tenant "ops" (token tok-o) is an admin, over
    `semantic` and kvpool replicas kv0, kv1... answering with `stubs` (each Flush a future of
    its own, cancellable: `Unary`), in a ReplicaSet whose poller has declared none down."""
    from services.orchestrator.backends import ReplicaSet
    from tests.orchestrator.test_pipeline_paths import Unary

    s, orch, tenants = _stats_servicer(tokens=tokens)
    tenants.by_token["tok-o"] = dataclasses.replace(tenants.by_token["tok-o"], admin=True)
    tenants.__post_init__()
    orch.semantic = semantic
    orch.replicas = ReplicaSet(addresses=(), internal_token="")
    orch.replicas.replicas.extend(
        SimpleNamespace(stub=SimpleNamespace(Flush=Unary(st.Flush)), public_id=f"kv{i}",
                        replica_id=f"kv{i}", downs=0, watchers={})
        for i, st in enumerate(stubs))
    orch.internal_token = ""
    orch.dispatched = dispatched
    orch.renderer = SimpleNamespace(forgot=[])
    orch.renderer.forget_scope = orch.renderer.forgot.append
    s.attach(orch, tenants)
    return s, orch, tenants


def _caller(token, remaining):
    """A call's context: `token`, and `remaining` seconds left (1e9: a client without a
    deadline, as gRPC tells it: grpcurl's default)."""
    class C(Context):
        def invocation_metadata(self):
            return (("authorization", f"Bearer {token}"),)

        def time_remaining(self):
            return remaining
    return C()


def test_erase_tenant_fans_out_to_every_shard_and_replica_for_admins_only():
    """Erasure on request needed one Invalidate per semantic shard and had no way to drop a
    tenant's KV blocks but a replica restart. EraseTenant (admin only) invalidates the tenant
    on every shard and flushes its cache salt on every replica, names what did not answer,
    and refuses an empty name before touching anything."""
    from tiercache.v1 import semantic_pb2

    calls = []
    timeouts = []

    def sem_call(address, method, req, timeout=None):
        calls.append((address, method, req.tenant))
        timeouts.append(timeout)
        return semantic_pb2.InvalidateResponse(removed=3)

    stubs = [_FlushStub(), _FlushStub(fail=True)]
    forgot = []
    s, orch, tenants = _erase_servicer(
        SimpleNamespace(enabled=True, addresses=("s:1", "s:2"), call_unless_hung=sem_call), stubs,
        tokens="tok-a=alice,tok-o=ops",
        dispatched=SimpleNamespace(forget=lambda *a: forgot.append(a)))

    def as_(tok):
        return _caller(tok, 1e9)

    with pytest.raises(errors.PermissionDenied, match="authorization: tenant alice may not "
                       "erase a tenant's data"):
        s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"), as_("tok-a"))
    with pytest.raises(errors.InvalidArgument, match="^tenant: required"):
        s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant=" "), as_("tok-o"))
    assert calls == [] and stubs[0].asked == []
    r = s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"), as_("tok-o"))
    assert sorted(calls) == [("s:1", "Invalidate", "alice"), ("s:2", "Invalidate", "alice")]
    salt = tenants.by_token["tok-a"].cache_salt
    assert stubs[0].asked == [salt] and stubs[1].asked == [salt]
    assert (r.semantic_entries_removed, r.kv_blocks_dropped, r.kv_blocks_in_use) == (6, 5, 1)
    assert list(r.not_reached) == ["kvpool kv1: UNAVAILABLE: connection refused"]
    # No credit for what went: the tenant's, on the replica that dropped it.
    assert forgot == [(orch.replicas.replicas[0].replica_id, salt)]
    assert orch.renderer.forgot == ["alice"]  # its prompts' pieces kept for tokenizing
    # Every call bounded (ERASE_TIMEOUT_S): years of timeout were cut to nothing by gRPC.
    assert all(0 < t <= 120 for t in timeouts + stubs[0].timeouts + stubs[1].timeouts)


@pytest.mark.parametrize("name", ["acme\u200b", "a\nb", "a\u202eb", "cafe\u0301"])
def test_erase_tenant_erases_a_name_that_prints_as_another_an_earlier_release_took(
        monkeypatch, caplog, name):
    """No tenant may have such a name now (the tokens file refuses it), but an earlier release
    took "acme\u200b" and stored its data: refused, EraseTenant left that data until its TTL
    ended. It erases it by that name: every shard's Invalidate gets the name as it is, every
    replica's Flush the salt the earlier release gave the tenant, and the log line shows the
    name escaped (printed, it read as an erasure of "acme")."""
    import logging

    from tiercache.v1 import semantic_pb2

    import services.orchestrator.tenants as tenants_mod

    with monkeypatch.context() as earlier:  # the earlier release's tokens: no such check
        earlier.setattr(tenants_mod, "name_problem", lambda _: "")
        old_salt = _stats_servicer(tokens=f"tok-x={name}")[2].by_token["tok-x"].cache_salt
    calls = []

    def sem_call(address, method, req, timeout=None):
        calls.append((address, method, req.tenant))
        return semantic_pb2.InvalidateResponse(removed=2)

    stubs = [_FlushStub(), _FlushStub()]
    s, orch, _ = _erase_servicer(
        SimpleNamespace(enabled=True, addresses=("s:1", "s:2"), call_unless_hung=sem_call), stubs)
    with caplog.at_level(logging.INFO, logger="services.orchestrator.server"):
        r = s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant=name),
                          _caller("tok-o", 1e9))
    assert sorted(calls) == [("s:1", "Invalidate", name), ("s:2", "Invalidate", name)]
    assert stubs[0].asked == [old_salt] and stubs[1].asked == [old_salt]
    assert (r.semantic_entries_removed, r.kv_blocks_dropped, list(r.not_reached)) == (4, 10, [])
    assert orch.renderer.forgot == [name]
    assert f"erased tenant {ascii(name)}: 4 semantic entries" in caplog.text


def test_erase_tenant_keeps_time_to_answer_when_a_replica_hangs():
    """A live walkthrough: a kvpool replica stopped (SIGSTOP) held its Flush to the caller's
    own deadline (`tiercache --timeout 10 erase-tenant`), and the caller got DEADLINE_EXCEEDED,
    not the counts of what was erased and the line naming the replica. Each call now ends
    before the caller's deadline, leaving time to answer."""
    stubs = [_FlushStub(), _FlushStub(fail=True)]
    s, _, _ = _erase_servicer(SimpleNamespace(enabled=False), stubs)
    r = s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"), _caller("tok-o", 10.0))
    assert list(r.not_reached) == ["kvpool kv1: UNAVAILABLE: connection refused"]
    assert all(t <= 10.0 - 0.2 for t in stubs[0].timeouts + stubs[1].timeouts), (
        stubs[0].timeouts, stubs[1].timeouts)


def test_an_erasure_that_did_not_reach_everything_is_a_warning(caplog):
    """A live walkthrough (one of two semantic shards stopped): the orchestrator's only trace
    of an erasure left unfinished, the tenant's data still on the shard, was an INFO line.
    It is a WARNING now; an erasure that reached everything stays INFO."""
    import logging

    def erase(stubs):
        s, _, _ = _erase_servicer(SimpleNamespace(enabled=False), stubs)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="services.orchestrator.server"):
            s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"),
                          _caller("tok-o", 10.0))
        return [(r.levelno, r.getMessage()) for r in caplog.records
                if r.getMessage().startswith("erased tenant alice")]

    [(level, msg)] = erase([_FlushStub(), _FlushStub(fail=True)])
    assert level == logging.WARNING and "not reached: kvpool kv1: UNAVAILABLE" in msg
    assert erase([_FlushStub()]) == [(logging.INFO, "erased tenant alice: 0 semantic entries, "
                                      "5 KV blocks dropped, 1 kept in use; not reached: none")]


def test_erase_tenant_calls_every_shard_and_replica_at_once():
    """Review: EraseTenant called the shards, then the replicas, one after another, so one hung
    shard took the whole budget and every shard and replica after it was reported unreached
    though it would have answered. They are now called at once: the others answer while the
    hung one waits. A name no tenant can have (over MAX_TENANT_CHARS) is refused before any
    call, as a shard would have refused it."""
    import threading

    from tiercache.v1 import semantic_pb2

    from services.orchestrator.tenants import MAX_TENANT_CHARS

    others_done = threading.Event()
    calls = []

    def sem_call(address, method, req, timeout=None):
        calls.append(address)
        if address == "hung":
            # Answers only once everything else was called (sequentially: never, until
            # its timeout, which is then the whole budget).
            if not others_done.wait(5):
                raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return semantic_pb2.InvalidateResponse(removed=1)
        return semantic_pb2.InvalidateResponse(removed=2)

    class Last(_FlushStub):
        def Flush(self, req, timeout=None, metadata=None):
            out = super().Flush(req, timeout, metadata)
            others_done.set()
            return out

    stubs = [Last()]
    s, _, _ = _erase_servicer(
        SimpleNamespace(enabled=True, addresses=("hung", "s:2"), call_unless_hung=sem_call), stubs)
    with pytest.raises(errors.InvalidArgument, match=f"^tenant: longer than {MAX_TENANT_CHARS}"):
        s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="a" * (MAX_TENANT_CHARS + 1)),
                      _caller("tok-o", 30.0))
    assert calls == [] and stubs[0].asked == []
    r = s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"), _caller("tok-o", 30.0))
    assert list(r.not_reached) == []
    assert (r.semantic_entries_removed, r.kv_blocks_dropped) == (3, 5)


def test_erase_tenant_calls_waiting_for_a_thread_get_only_the_time_left(monkeypatch):
    """Review: with more shards and replicas than ERASE_FANOUT threads, a call that waited for
    a thread behind hung ones was still sent with the whole budget, computed before any call:
    it ran past the caller's deadline, and the caller got DEADLINE_EXCEEDED instead of the
    counts and the not_reached lines. Each call now gets what is left of the budget as it
    starts."""
    import time

    from services.orchestrator import server as srv

    monkeypatch.setattr(srv, "ERASE_FANOUT", 1)

    class Hung(_FlushStub):
        def Flush(self, req, timeout=None, metadata=None):
            self.timeouts = [*getattr(self, "timeouts", []), timeout]
            time.sleep(timeout)  # a stopped replica: its whole timeout
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    stubs = [Hung(), Hung()]
    s, _, _ = _erase_servicer(SimpleNamespace(enabled=False), stubs)

    t0 = time.monotonic()
    r = s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"), _caller("tok-o", 1.0))
    assert time.monotonic() - t0 < 1.0  # answered within the caller's deadline
    assert [line.split(":")[0] for line in r.not_reached] == ["kvpool kv0", "kvpool kv1"]
    assert stubs[1].timeouts[0] < 0.2, stubs[1].timeouts  # what the first one left


def test_erase_tenant_stops_waiting_for_a_replica_the_poller_finds_hung(caplog):
    """A live walk: with one kvpool replica SIGSTOPped, grpcurl's EraseTenant (no deadline)
    answered after 62 s, when gRPC's keepalive gave up on the Flush (ERASE_TIMEOUT_S, 120 s,
    else), though the poller had declared the replica hung within ~9 s and a Warm's prefill
    there is cancelled then. The Flush is cancelled as the poller declares its replica down
    (again at each poll while it stays hung): the answer comes at once, the hung replica named
    in not_reached, the other's counts kept; the down line says the Flush is cancelled."""
    import logging
    import time

    class Hung(_FlushStub):
        def Flush(self, req, timeout=None, metadata=None):
            time.sleep(3)  # a stopped replica, far past the test's wait
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "Stream removed (ping timeout)")

    s, orch, _ = _erase_servicer(SimpleNamespace(enabled=False), [Hung(), _FlushStub()])
    hung = orch.replicas.replicas[0]

    def poller() -> None:
        time.sleep(0.2)
        orch.replicas._notify_down(hung)  # the poller declares it down

    threading.Thread(target=poller, daemon=True).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.backends"):
        r = s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"),
                          _caller("tok-o", 1e9))
    assert time.monotonic() - t0 < 1.5
    assert [rec.getMessage() for rec in caplog.records
            if rec.name == "services.orchestrator.backends"] == [
        "replica kv0 is down: cancelling 1 erase flush(es)"]
    assert list(r.not_reached) == [
        "kvpool kv0: UNAVAILABLE: found hung by the orchestrator's replica polls (its Flush "
        "cancelled)"]
    assert (r.kv_blocks_dropped, r.kv_blocks_in_use) == (5, 1)


class _Shard:
    """A semantic shard whose Invalidate takes `takes` seconds (None answer: hung) and whose
    Stats answer at once, or, hung, run out the poller's whole timeout. Its Invalidate is
    cancellable (`Unary`): a hung one ends UNAVAILABLE when gRPC's keepalive gives up."""

    def __init__(self, takes: float, answer=None) -> None:
        from tests.orchestrator.test_pipeline_paths import Unary

        self.takes, self.answer = takes, answer
        self.Invalidate = Unary(self._invalidate)

    def _invalidate(self, req, timeout=None, metadata=None):
        time.sleep(min(self.takes, timeout))
        if self.answer is None:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "Stream removed (ping timeout)")
        return self.answer

    def Stats(self, req, timeout=None, metadata=None):  # noqa: N802 - the gRPC method's name
        from tiercache.v1 import semantic_pb2
        if self.answer is None:
            time.sleep(timeout)
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return semantic_pb2.SemanticStatsResponse()


def _polled_erase(shard: _Shard, poll_after: float, hung_before: bool = False):
    """EraseTenant (no deadline) over one semantic shard `shard` (the tier's timeout 0.2 s)
    whose health poll runs once, `poll_after` seconds in; its answer and how long it took."""
    from services.orchestrator.backends import SemanticBackend

    sem = SemanticBackend("s:1", "", 0.2)
    sem.stubs["s:1"] = shard
    if hung_before:  # marked hung by an earlier call, its pause over: the erase probes it
        sem.hung.state["s:1"], sem.hung.marked["s:1"] = (time.monotonic(), 0.5), 0.0
    s, _, _ = _erase_servicer(sem, [_FlushStub()])

    def poller() -> None:
        time.sleep(poll_after)
        sem.poll_once()

    threading.Thread(target=poller, daemon=True).start()
    t0 = time.monotonic()
    r = s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"), _caller("tok-o", 1e9))
    return r, time.monotonic() - t0


@pytest.mark.parametrize("hung_before", [False, True])
def test_erase_tenant_stops_waiting_for_a_semantic_shard_its_health_poll_finds_hung(hung_before):
    """A live walk: with the semantic shard SIGSTOPped, grpcurl's EraseTenant (no deadline)
    answered after 77 s, when gRPC's keepalive gave up on the Invalidate (given the whole
    ERASE_TIMEOUT_S, 120 s), though the tier's health poll found the shard hung within
    seconds. The Invalidate is cancelled once a call to the shard (the poll's Stats) runs out
    the tier's whole timeout meanwhile: the shard named in not_reached, the replicas' counts
    kept. Also when the shard was marked hung before and this Invalidate probes it: the
    probe held off every other call (the poll's too) for its whole 120 s."""
    r, took = _polled_erase(_Shard(3.0), 0.3, hung_before)
    assert took < 1.5, took
    assert list(r.not_reached) == [
        "semantic shard s:1: UNAVAILABLE: found hung: a call to it ran out the tier's whole "
        "timeout (0.2s) meanwhile; its Invalidate cancelled (call again)"]
    assert (r.kv_blocks_dropped, r.kv_blocks_in_use) == (5, 1)


def test_erase_tenant_waits_for_a_slow_invalidate_on_a_shard_that_answers_its_polls():
    """An Invalidate of a large tenant takes about a second per 100k entries, far past the
    tier's timeout (2 s) but answered while the shard answers its health polls: it completes,
    counted."""
    from tiercache.v1 import semantic_pb2

    r, took = _polled_erase(_Shard(1.0, semantic_pb2.InvalidateResponse(removed=7)), 0.1)
    assert list(r.not_reached) == [] and r.semantic_entries_removed == 7
    assert took >= 1.0


def test_erase_tenant_names_a_call_that_failed_other_than_by_status():
    """Review: only an RpcError was caught. A stub raising anything else (ValueError: "Cannot
    invoke RPC on closed channel!", a replica's channel closed as the replica set changed) or a
    shard call failing so ended the whole EraseTenant with UNKNOWN: the counts of what the
    other calls erased were lost, and their credit and the tenant's prompt pieces were kept.
    Such a call is named in not_reached like any other that did not answer."""
    from tiercache.v1 import semantic_pb2

    class Closed(_FlushStub):
        def Flush(self, req, timeout=None, metadata=None):
            raise ValueError("Cannot invoke RPC on closed channel!")

    def sem_call(address, method, req, timeout=None):
        if address == "s:2":
            raise KeyError(address)  # its stub gone with a shard set changed
        return semantic_pb2.InvalidateResponse(removed=3)

    forgot = []
    stubs = [Closed(), _FlushStub()]
    s, orch, _ = _erase_servicer(
        SimpleNamespace(enabled=True, addresses=("s:1", "s:2"), call_unless_hung=sem_call), stubs,
        dispatched=SimpleNamespace(forget=lambda rid, salt: forgot.append(rid)))
    r = s.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant="alice"), _caller("tok-o", 1e9))
    assert (r.semantic_entries_removed, r.kv_blocks_dropped, r.kv_blocks_in_use) == (3, 5, 1)
    assert list(r.not_reached) == ["semantic shard s:2: failed (KeyError)",
                                   "kvpool kv0: failed (ValueError)"]
    assert forgot == ["kv1"] and orch.renderer.forgot == ["alice"]


@pytest.mark.parametrize("blank", ["   ", "\u200b\t"])
def test_a_blank_raw_prompt_is_refused_naming_prompt_alike_by_warm_and_generate(blank):
    """A WarmPrompt whose prompt was only whitespace was "prompts[0]: give messages or prompt",
    though it gave one, and Generate said the same input otherwise: both name the prompt and
    say it in the words a blank message's content gets. A WarmPrompt giving neither is named
    as Generate names a request giving neither."""
    from services.orchestrator.render import BLANK, PromptRenderer
    from services.orchestrator.server import Warmer
    from tests.orchestrator.test_pipeline_paths import TENANT, Stub, Tok, make

    stubs = {"A": Stub("A", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=1000)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    try:
        with pytest.raises(errors.InvalidArgument) as warm:
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt=blank)]))
        with pytest.raises(errors.InvalidArgument) as neither:
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt()]))
        assert stubs["A"].requests == []
    finally:
        warmer.stop()
    ctx = ContextOrchestrator(0)
    ctx.renderer = orch.renderer
    s = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("h:1",)))
    s.attach(ctx, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                       max_prompt_tokens=1000, max_tokens=1000,
                                       max_concurrent=10))
    with pytest.raises(errors.InvalidArgument) as generate:
        list(s.Generate(orchestrator_pb2.GenerateRequest(prompt=blank), Context()))
    assert str(generate.value) == f"prompt: {BLANK}; or give messages"
    assert str(warm.value) == f"prompts[0].{generate.value}"
    assert str(neither.value) == "prompts[0].messages: must not be empty (or give prompt)"
    with pytest.raises(errors.InvalidArgument) as generate:
        list(s.Generate(orchestrator_pb2.GenerateRequest(), Context()))
    assert str(neither.value) == f"prompts[0].{generate.value}"


@pytest.mark.parametrize("token", ["", "guess"])
def test_a_call_refused_for_its_tenant_token_says_its_request_id(monkeypatch, token):
    """The orchestrator's refusal of a missing or unknown token (before the request is
    parsed) carries the call's request id in its trailers and its one log line, Stats' and
    Generate's alike: it had none, and the id the CLI printed after 'unknown token' was in no
    log line."""
    from tiercache.v1 import orchestrator_pb2_grpc

    from tests.log_lines import fresh_lines, lines_with_ids

    fresh_lines(monkeypatch)
    s = OrchestratorServicer(CFG)
    s.attach(None, TenantRegistry.build(tokens_file="", tokens="tok-0123456789abcdef=a",
                                        key=b"k", max_prompt_tokens=100, max_tokens=100,
                                        max_concurrent=4))
    h = _on_loopback(s)
    md = [("authorization", f"Bearer {token}")] if token else []
    got = []
    try:
        with grpc.insecure_channel(h.address) as ch, lines_with_ids() as seen:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            for i, call in enumerate((
                    lambda md: stub.Stats(orchestrator_pb2.StatsRequest(), timeout=5,
                                          metadata=md),
                    lambda md: list(stub.Generate(request(), timeout=5, metadata=md)))):
                with pytest.raises(grpc.RpcError) as e:
                    call([*md, ("x-request-id", f"ticket-{i}")])
                got.append((e.value.code(), e.value.details(),
                            dict(e.value.trailing_metadata()).get("x-request-id")))
    finally:
        h.stop(0)
    why = "authorization: unknown token" if token else "authorization: missing bearer token"
    assert got == [(grpc.StatusCode.UNAUTHENTICATED, why, f"ticket-{i}") for i in range(2)]
    assert [(m.split(" from ")[0], i) for m, i in seen] == [
        ("Stats refused UNAUTHENTICATED", "ticket-0"),
        ("Generate refused UNAUTHENTICATED", "ticket-1")], seen


def test_a_stream_says_its_request_id_in_its_headers_before_it_ends():
    """A Generate's response headers carry the id its pipeline (its log lines, its
    GenerateFinal) runs under, here one the server made up (the client sent none, as grpcurl
    and clients in other languages do): a stream the client ends itself (a cancel, its
    deadline) gets no trailers, and had no id to quote."""
    from tiercache.v1 import orchestrator_pb2_grpc

    s, orch = servicer(STREAM_HEADROOM + 2)
    ran_under: list[str] = []
    slow = orch.generate

    def generate(**kw):
        ran_under.append(kw["request_id"])
        yield from slow(**kw)

    orch.generate = generate
    h = _on_loopback(s)
    try:
        with grpc.insecure_channel(h.address) as ch:
            call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(request(), timeout=10)
            assert next(call).text == "hi"
            headers = dict(call.initial_metadata())
            call.cancel()
    finally:
        orch.release.set()
        h.stop(0)
    assert len(ran_under) == 1 and ran_under[0]
    assert headers.get("x-request-id") == ran_under[0], headers


def _stuck_in_handler(s: OrchestratorServicer, release: threading.Event, ran_under: list):
    """Every method of `s` (each the proto names) replaced by one that notes the request id
    it runs under and waits for `release` before answering (a stream: before its first
    message); the methods."""
    def stuck(answer):
        def handler(request, context):
            ran_under.append(request_id_var.get())
            release.wait(10)
            return answer

        return handler

    def stuck_stream(request, context):
        yield stuck(orchestrator_pb2.GenerateResponse())(request, context)

    methods = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].methods
    for m in methods:
        setattr(s, m.name, stuck_stream if m.server_streaming
                else stuck(getattr(orchestrator_pb2, m.output_type.name)()))
    return methods


def test_every_call_says_its_request_id_in_its_headers_before_its_handler_ends():
    """Each method's response headers carry the id its handler runs under (here one the
    server made up: the client sent none, as grpcurl and clients in other languages do),
    sent before the handler answers: a call its deadline ends gets no trailers, and Stats,
    Feedback and EraseTenant had no id to quote. (gRPC Python reads a unary call's headers
    with its end: after its deadline, not after its own cancel.)"""
    from tiercache.v1 import orchestrator_pb2_grpc

    s, _ = servicer(STREAM_HEADROOM + 2)
    release, ran_under, told = threading.Event(), [], {}
    methods = _stuck_in_handler(s, release, ran_under)
    h = _on_loopback(s)
    try:
        with grpc.insecure_channel(h.address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            for m in methods:
                rpc, request = getattr(stub, m.name), getattr(orchestrator_pb2, m.input_type.name)()
                call = (rpc if m.server_streaming else rpc.future)(request, timeout=0.5)
                assert call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                told[m.name] = dict(call.initial_metadata() or ()).get("x-request-id")
    finally:
        release.set()
        h.stop(0)
    assert all(ran_under) and len(set(ran_under)) == len(methods), ran_under
    assert told == {m.name: rid for m, rid in zip(methods, ran_under, strict=True)}
