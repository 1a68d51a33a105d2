"""Rules of the orchestrator's gRPC servicer that its other tests leave unchecked: the bounds
of the sampling and cache-policy fields (each refusal names its field), and what a refused
request leaves behind (nothing)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, orchestrator_pb2

from services.common import errors
from services.common.logs import bound_request_id
from services.orchestrator.config import STREAM_HEADROOM, OrchestratorConfig
from services.orchestrator.pipeline import OrchestratorStats
from services.orchestrator.server import (
    MAX_SESSION_ID_CHARS,
    OrchestratorServicer,
    parse_policy,
    parse_sampling,
)
from services.orchestrator.tenants import TenantRegistry
from tests.orchestrator.test_request_path import ContextOrchestrator
from tests.orchestrator.test_stream_cap import Context, request, servicer

CFG = OrchestratorConfig(kvpool_addresses=("A",), default_max_tokens=100, max_tokens_limit=500)
SP = common_pb2.SamplingParams


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
    s = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("h:1",)))
    orch = ContextOrchestrator(0)
    s.attach(orch, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                        max_prompt_tokens=1000, max_tokens=1000,
                                        max_concurrent=10))
    req = orchestrator_pb2.GenerateRequest(prompt="x" * 40)
    req.cache_policy.semantic_threshold = 0.845  # the fake tier's floor is 0.85
    with pytest.raises(errors.InvalidArgument, match="^cache_policy.semantic_threshold"):
        list(s.Generate(req, Context()))
    assert orch.calls == []


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


def test_feedback_without_a_rating_is_refused_naming_rating():
    """RATING_UNSPECIFIED (the field left unset) is INVALID_ARGUMENT naming rating, and the
    semantic tier is not called."""
    s, orch = servicer(STREAM_HEADROOM + 1)
    called: list = []
    orch.semantic = SimpleNamespace(enabled=True, invalidate=lambda *a: called.append(a),
                                    verify=lambda *a: called.append(a))
    ref = s.tenants.entry_ref(s.tenants.authenticate({}), "e1")
    with pytest.raises(errors.InvalidArgument, match="^rating:"):
        s.Feedback(orchestrator_pb2.FeedbackRequest(semantic_entry_id=ref), Context())
    assert called == []


def _stats_servicer(tokens: str = ""):
    s = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("h:1",)))
    health = [SimpleNamespace(healthy=h, proto=lambda h=h: common_pb2.DependencyHealth(
        name=f"kvpool-{h}")) for h in (True, False)]
    replicas = [SimpleNamespace(stats=kvpool_pb2.KvStatsResponse(replica_id=f"r{i}"), health=h)
                for i, h in enumerate(health)]
    orch = SimpleNamespace(stats=OrchestratorStats(), replicas=SimpleNamespace(replicas=replicas),
                           semantic=SimpleNamespace(enabled=False), prefix=None)
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
    with pytest.raises(errors.InvalidArgument, match="^messages: 3 tokens exceed the limit of 2"):
        next(s.Generate(request(), Context()))
    assert _held(s) == before


def test_a_prompt_too_long_for_the_tenant_is_counted_as_a_prompt_tokens_rejection():
    """The size check before rendering refuses for the tenant's limit as the check after
    tokenizing would, and counts it the same (rejections_total, reason prompt_tokens)."""
    from prometheus_client import REGISTRY

    s, orch = servicer(STREAM_HEADROOM + 2)  # the tenant's limit: 100 prompt tokens
    labels = {"tenant": "default", "reason": "prompt_tokens"}
    before = REGISTRY.get_sample_value("tiercache_orchestrator_rejections_total", labels) or 0
    long = orchestrator_pb2.GenerateRequest(messages=[{"role": "user", "content": "w" * 801}])
    with pytest.raises(errors.ResourceExhausted, match="tenant limit"):
        next(s.Generate(long, Context()))
    assert orch.renderer.rendered == 0
    assert REGISTRY.get_sample_value("tiercache_orchestrator_rejections_total",
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
