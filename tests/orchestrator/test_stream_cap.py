"""The orchestrator's server-wide cap on Generate streams (fakes behind the servicer: pure logic).

Each stream holds a worker thread until it ends; past max_workers - STREAM_HEADROOM streams a
new one is refused with RESOURCE_EXHAUSTED so health checks and Stats always find a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from tiercache.v1 import orchestrator_pb2

from services.common.errors import ResourceExhausted
from services.orchestrator.config import STREAM_HEADROOM, OrchestratorConfig
from services.orchestrator.pipeline import TextDelta
from services.orchestrator.render import PromptRenderer, RenderedPrompt
from services.orchestrator.server import OrchestratorServicer
from services.orchestrator.tenants import TenantRegistry
from tests.metric_sample import sample_value
from tests.waits import holds_within


class Renderer:
    max_token_chars = 8  # no token stands for more than 8 characters
    check_size = PromptRenderer.check_size
    size_problem = PromptRenderer.size_problem

    def __init__(self) -> None:
        self.rendered = 0

    def render_chat(self, messages, scope=""):
        self.rendered += 1
        return RenderedPrompt([1, 2, 3], messages[-1].content, "")


class SlowOrchestrator:
    """Streams one delta, then waits until released (a long generation)."""

    tok = range(1000)  # only its length (the vocabulary size) is read
    replicas = SimpleNamespace(max_context=lambda: 0)  # no replica has reported its context
    semantic = SimpleNamespace(enabled=False)
    model_id = "m"  # what Stats says it serves

    def __init__(self) -> None:
        self.release = threading.Event()
        self.renderer = Renderer()

    def generate(self, **kw):
        yield TextDelta("hi", [])
        self.release.wait(10)


class Context:
    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    def add_callback(self, fn):
        return True


def servicer(max_workers: int, max_concurrent: int = 100, max_prompt_tokens: int = 8192
             ) -> tuple[OrchestratorServicer, SlowOrchestrator]:
    cfg = OrchestratorConfig(kvpool_addresses=("h:1",), max_workers=max_workers,
                             max_prompt_tokens=max_prompt_tokens)
    cfg.validate()
    s = OrchestratorServicer(cfg)
    orch = SlowOrchestrator()
    s.attach(orch, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                        max_prompt_tokens=100, max_tokens=100,
                                        max_concurrent=max_concurrent))
    return s, orch


def request() -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(messages=[{"role": "user", "content": "hi"}])


def test_streams_past_the_cap_are_refused_and_slots_come_back():
    s, orch = servicer(STREAM_HEADROOM + 2)  # room for 2 streams
    open_streams = [s.Generate(request(), Context()) for _ in range(2)]
    for g in open_streams:
        assert next(g).text == "hi"  # both in progress
    labels = {"tenant": "default", "reason": "server_streams"}
    before = sample_value("tiercache_orchestrator_rejections_total", labels) or 0
    with pytest.raises(ResourceExhausted, match="concurrent streams"):
        next(s.Generate(request(), Context()))
    assert sample_value("tiercache_orchestrator_rejections_total",
                                     labels) == before + 1
    orch.release.set()
    for g in open_streams:
        list(g)  # they end
    orch.release.clear()
    again = s.Generate(request(), Context())
    assert next(again).text == "hi"  # the slots were released
    orch.release.set()
    list(again)
    assert s._streams == 0


def test_too_few_workers_is_a_config_error():
    from services.common.config import ConfigError

    with pytest.raises(ConfigError, match="TIERCACHE_ORCHESTRATOR_MAX_WORKERS"):
        OrchestratorConfig(kvpool_addresses=("h:1",), max_workers=STREAM_HEADROOM).validate()


def test_warm_takes_a_stream_slot_so_the_headroom_stays_for_probes():
    """A Warm holds a worker thread for up to 120 s; uncounted, a tenant's Warm calls could
    take the threads kept for health checks and Stats."""
    s, orch = servicer(STREAM_HEADROOM + 1)  # room for 1 stream
    calls: list[int] = []
    s.warmer = SimpleNamespace(warm=lambda tenant, req, left, charge, gone, afford:
                               calls.append(s._streams) or orchestrator_pb2.WarmResponse())
    s.Warm(orchestrator_pb2.WarmRequest(top_k=1), Context())
    assert calls == [1] and s._streams == 0  # held during the call, released after
    g = s.Generate(request(), Context())
    assert next(g).text == "hi"
    with pytest.raises(ResourceExhausted, match="concurrent streams"):
        s.Warm(orchestrator_pb2.WarmRequest(top_k=1), Context())
    orch.release.set()
    list(g)
    assert s._streams == 0 and calls == [1]


def test_a_warm_pays_the_tenants_rate_limit_for_each_prefill_it_runs():
    """One Warm runs up to 64 prompts x replicas prefills: the tenant's rate limit counted it
    as one request."""
    import dataclasses

    from tests.clock import Clock

    s, orch = servicer(STREAM_HEADROOM + 1)
    s.tenants.default = dataclasses.replace(s.tenants.default, rate_per_s=1.0, burst=2)
    s.tenants.clock = clock = Clock(100.0)
    s.warmer = SimpleNamespace(warm=lambda tenant, req, left, charge, gone, afford: charge(5)
                               or orchestrator_pb2.WarmResponse())
    s.Warm(orchestrator_pb2.WarmRequest(top_k=1), Context())  # 6 prefills: 2 - 6 -> -2 (floor)
    labels = {"tenant": "default", "reason": "rate_limit"}
    before = sample_value("tiercache_orchestrator_rejections_total", labels) or 0
    clock.t += 2.0  # refilled to 0: still short of one request
    with pytest.raises(ResourceExhausted, match="rate limit"):
        s.Warm(orchestrator_pb2.WarmRequest(top_k=1), Context())
    assert sample_value("tiercache_orchestrator_rejections_total",
                                     labels) == before + 1
    clock.t += 1.0  # the debt never exceeds one burst: back after (burst + 1) / rate
    g = s.Generate(request(), Context())
    assert next(g).text == "hi"
    orch.release.set()
    list(g)


def test_a_warm_past_what_the_rate_limit_allows_is_refused_before_any_prefill():
    import dataclasses

    from services.common.errors import Overloaded
    from tests.clock import Clock

    s, orch = servicer(STREAM_HEADROOM + 1)
    s.tenants.default = dataclasses.replace(s.tenants.default, rate_per_s=1.0, burst=2)
    s.tenants.clock = Clock(100.0)
    ran = []
    s.warmer = SimpleNamespace(
        warm=lambda tenant, req, left, charge, gone, afford: afford(10)
        or ran.append(1) or orchestrator_pb2.WarmResponse())
    with pytest.raises(ResourceExhausted, match="at most 4 per call") as e:
        s.Warm(orchestrator_pb2.WarmRequest(top_k=1), Context())
    assert not isinstance(e.value, Overloaded) and ran == []
    assert s.tenants._buckets["default"].tokens == 2.0  # nothing taken
    assert s._streams == 0 and s.tenants._active.get("default", 0) == 0


@pytest.mark.parametrize(("left", "want"), [(0.0, "DeadlineExceeded"), (-0.2, "DeadlineExceeded"),
                                            (5.0, "Cancelled"), (None, "Cancelled")])
def test_a_stream_ended_by_its_deadline_is_not_counted_as_cancelled(left, want):
    """The RPC-end callback fires for an expired deadline as for a client cancel, and the
    pipeline raised Cancelled for both: the metrics counted deadlines as CANCELLED."""
    from services.common import errors

    s, orch = servicer(STREAM_HEADROOM + 1)

    def ended(**kw):
        yield TextDelta("hi", [])
        raise errors.Cancelled("client cancelled")

    orch.generate = ended

    class Ctx(Context):
        calls = 0

        def time_remaining(self):
            Ctx.calls += 1
            return None if left is None else (30.0 if Ctx.calls == 1 else left)

    g = s.Generate(request(), Ctx())
    assert next(g).text == "hi"
    with pytest.raises(errors.TierCacheError) as ei:
        next(g)
    assert type(ei.value).__name__ == want
    assert s._streams == 0


def test_the_request_id_is_the_one_the_interceptor_bound_to_the_logs():
    """Generate made up a second id when the client sent none: GenerateFinal and kvpool got one
    id, every orchestrator log line and the semantic and prefix calls another."""
    from services.common.logs import request_id_var

    s, orch = servicer(STREAM_HEADROOM + 1)
    seen: list[str] = []

    def record(**kw):
        seen.append(kw["request_id"])
        yield TextDelta("hi", [])

    orch.generate = record
    tok = request_id_var.set("bound-by-interceptor")
    try:
        list(s.Generate(request(), Context()))
    finally:
        request_id_var.reset(tok)
    assert seen == ["bound-by-interceptor"]


def _served(s, orch, content: str) -> None:
    """`content` as one message is rendered once and answered."""
    g = s.Generate(orchestrator_pb2.GenerateRequest(
        messages=[{"role": "user", "content": content}]), Context())
    assert next(g).text == "hi" and orch.renderer.rendered == 1
    orch.release.set()
    list(g)


def test_a_request_that_cannot_fit_is_refused_before_rendering():
    """Rendering and tokenizing 12 MB of messages took 20 s only to refuse them: more messages
    than prompt tokens, or more characters than the tokens can stand for, are refused first."""
    from services.common.errors import InvalidArgument

    s, orch = servicer(STREAM_HEADROOM + 2, max_prompt_tokens=64)
    many = orchestrator_pb2.GenerateRequest(messages=[{"role": "user", "content": "hi"}] * 65)
    with pytest.raises(InvalidArgument, match="^messages: 65 messages exceed"):
        next(s.Generate(many, Context()))
    long = orchestrator_pb2.GenerateRequest(messages=[{"role": "user", "content": "w" * 513}])
    with pytest.raises(InvalidArgument, match="^messages: 513 characters cannot fit"):
        next(s.Generate(long, Context()))
    assert orch.renderer.rendered == 0 and s._streams == 0
    _served(s, orch, "w" * 512)  # the largest that can fit


def test_a_request_past_the_tenants_own_limit_is_refused_before_rendering():
    """Only the server's limit was checked first: a tenant limited to 100 prompt tokens had
    the server render and tokenize up to 8,192 tokens' worth of text, only to refuse it."""
    s, orch = servicer(STREAM_HEADROOM + 2)  # the server's 8,192 tokens, the tenant's 100
    long = orchestrator_pb2.GenerateRequest(messages=[{"role": "user", "content": "w" * 801}])
    with pytest.raises(ResourceExhausted,
                       match="^messages: 801 characters cannot fit in tenant limit 100 "):
        next(s.Generate(long, Context()))
    assert orch.renderer.rendered == 0 and s._streams == 0
    _served(s, orch, "w" * 800)


def test_rendering_waits_for_the_tenants_slot():
    """Four parallel 4 MB requests of a tenant limited to one request at a time were all
    rendered at once (25-34 s each): the render ran before the tenant's limit applied."""
    s, orch = servicer(STREAM_HEADROOM + 4, max_concurrent=1)
    g = s.Generate(request(), Context())
    assert next(g).text == "hi" and orch.renderer.rendered == 1
    with pytest.raises(ResourceExhausted):
        next(s.Generate(request(), Context()))
    assert orch.renderer.rendered == 1  # refused before rendering
    orch.release.set()
    list(g)
    assert s._streams == 0


def test_a_tenant_without_its_own_limit_cannot_take_every_stream_slot():
    """The default per-tenant limit (64) was above the server's 56 streams: one tenant's
    slow calls refused every other tenant."""
    from services.orchestrator.app import tenant_concurrency

    cfg = OrchestratorConfig(kvpool_addresses=("h:1",), tokens="t=a")
    assert tenant_concurrency(cfg) * 2 <= cfg.max_streams  # room for others


def test_without_tokens_the_one_tenant_may_use_every_stream_slot():
    """The lower default is for tenants sharing a server; a stack without tokens has one
    tenant, every caller, and was capped at 16 of its 56 slots."""
    from services.orchestrator.app import tenant_concurrency

    local = OrchestratorConfig(kvpool_addresses=("h:1",))
    assert tenant_concurrency(local) == local.max_streams == 56
    shared = OrchestratorConfig(kvpool_addresses=("h:1",), tokens="t=a")
    assert tenant_concurrency(shared) == 16
    # A limit the operator set is kept either way (it was raised to 56 without tokens).
    for tokens in ("", "t=a"):
        assert tenant_concurrency(OrchestratorConfig(kvpool_addresses=("h:1",), tokens=tokens,
                                                     max_concurrent_per_tenant=4)) == 4


def _feedback_with_semantic(code, details: str, entry_id: str):
    """A servicer whose semantic tier fails Verify and Invalidate with `code`/`details`, and a
    reference to `entry_id` the default tenant was given."""
    from tests.orchestrator.test_semantic_errors import Refusal

    def fail(*a, **kw):
        raise Refusal(code, details)

    s, orch = servicer(STREAM_HEADROOM + 2)
    orch.semantic = SimpleNamespace(enabled=True, invalidate=fail, verify=fail)
    return s, s.tenants.entry_ref(s.tenants.authenticate({}), entry_id)


def test_feedback_with_the_semantic_tier_down_names_no_internal_address():
    """Feedback wrapped the semantic service's transport error text, which names its
    address, into the tenant's status."""
    import grpc

    s, ref = _feedback_with_semantic(
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; ipv4:10.0.3.9:50052: Connection refused", "e1")
    for rating in (orchestrator_pb2.RATING_BAD, orchestrator_pb2.RATING_GOOD):
        with pytest.raises(Exception) as e:
            s.Feedback(orchestrator_pb2.FeedbackRequest(semantic_entry_id=ref, rating=rating),
                       Context())
        assert getattr(e.value, "code", "") == "UNAVAILABLE"
        assert "10.0.3.9" not in str(e.value) and "semantic tier" in str(e.value)


def test_feedback_on_an_entry_gone_since_is_done_when_bad_and_named_when_good():
    """A second "bad" on the same answer was NOT_FOUND in the tier's words ("semantic_entry_id:
    id: no entry 'fa0d...'", the bare id, not the reference), unlike an unknown reference's."""
    import grpc

    from services.common.errors import NotFound

    s, ref = _feedback_with_semantic(grpc.StatusCode.NOT_FOUND, "id: no entry 'internal-e1'",
                                     "internal-e1")
    bad = s.Feedback(orchestrator_pb2.FeedbackRequest(
        semantic_entry_id=ref, rating=orchestrator_pb2.RATING_BAD), Context())
    assert not bad.invalidated and not bad.verified
    with pytest.raises(NotFound, match="unknown \\(expired, evicted or invalidated\\)") as e:
        s.Feedback(orchestrator_pb2.FeedbackRequest(
            semantic_entry_id=ref, rating=orchestrator_pb2.RATING_GOOD), Context())
    assert ref in str(e.value)  # the reference the client was given


def test_a_tokens_file_alone_counts_as_tenants_configured(tmp_path):
    from services.orchestrator.app import tenant_concurrency

    cfg = OrchestratorConfig(kvpool_addresses=("h:1",), tokens_file=str(tmp_path / "t.json"))
    assert tenant_concurrency(cfg) == 16


def test_retry_later_is_told_apart_from_a_fixed_limit_on_the_wire():
    """RESOURCE_EXHAUSTED meant both "busy now" (a tenant's concurrent requests, the rate
    limit, every replica busy) and "this request exceeds a limit" (max_tokens, prompt tokens):
    a client could not tell whether retrying the same request made sense. The first kind now
    carries the tiercache-overloaded trailer."""
    import grpc
    from tiercache.v1 import orchestrator_pb2_grpc

    from clients.python.client import retry_later
    from services.common.bootstrap import create_server

    def rejected(reason: str) -> float:
        return sample_value("tiercache_orchestrator_rejections_total",
                                         {"tenant": "default", "reason": reason}) or 0.0

    before = {r: rejected(r) for r in ("concurrent", "max_tokens")}
    s, orch = servicer(STREAM_HEADROOM + 4, max_concurrent=1)
    handle = create_server(service="orchestrator", address="127.0.0.1:0", services=[
        (orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, s,
         "tiercache.v1.Orchestrator")])
    handle.set_serving()
    channel = grpc.insecure_channel(handle.address)
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    try:
        held = stub.Generate(request(), timeout=20)
        assert next(held).text == "hi"  # the tenant's one slot is taken
        with pytest.raises(grpc.RpcError) as busy:
            next(stub.Generate(request(), timeout=20))
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "concurrent requests" in busy.value.details() and retry_later(busy.value)
        orch.release.set()
        list(held)

        big = request()
        big.sampling.max_tokens = 1000  # the tenant's limit is 100
        with pytest.raises(grpc.RpcError) as fixed:
            next(stub.Generate(big, timeout=20))
        assert fixed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_tokens" in fixed.value.details() and not retry_later(fixed.value)
        # Counted by tenant and reason (before, only as one more RESOURCE_EXHAUSTED).
        assert {r: rejected(r) - before[r] for r in before} == {"concurrent": 1, "max_tokens": 1}
    finally:
        orch.release.set()
        channel.close()
        handle.stop(0)


def test_ttft_counts_from_the_requests_arrival_not_from_after_rendering():
    """The pipeline started its TTFT clock after rendering and tokenizing, so a long prompt's
    TTFT (CacheReport and the histogram) understated what the client waited for."""
    import time

    s, orch = servicer(STREAM_HEADROOM + 1)
    seen: dict[str, float] = {}
    render = orch.renderer.render_chat

    def slow_render(messages, scope=""):
        seen["rendered"] = time.monotonic()
        return render(messages, scope=scope)

    def generate(**kw):
        seen["arrived"] = kw["arrived"]
        yield TextDelta("hi", [])

    orch.renderer.render_chat = slow_render
    orch.generate = generate
    assert [d.text for d in s.Generate(request(), Context())] == ["hi"]
    assert seen["arrived"] <= seen["rendered"]


class HeldStats:
    """Cluster figures whose lock the test holds: each Stats call keeps its worker thread
    until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = 0
        self._count = threading.Lock()
        self.requests = {"semantic_hit": 0, "prefix_hit": 0, "cold": 0, "coalesced": 0}
        self.prompt_tokens = self.cached_tokens = self.semantic_tokens_saved = 0
        self.semantic_hits_too_short = self.semantic_hits_sampled = 0
        self.semantic_hits_ignore_eos = 0
        self.degradations: dict[str, int] = {}

    @property
    def lock(self):
        return self

    def __enter__(self):
        with self._count:
            self.entered += 1
        assert self.release.wait(30)

    def __exit__(self, *exc):
        return False


def _flood(workers: int, calls: int, during: Callable[[Any, Any], None] | None = None,
           **server_kw) -> tuple[int, int]:
    """`calls` Stats calls at once at a real server (the servicer, fakes behind it) whose
    `workers` threads all hold one until released: returns (refused at once, each with
    RESOURCE_EXHAUSTED from the cap; admitted, each completing once released). `during`
    (the server's handle, a channel to it) runs while the workers are held."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tiercache.v1 import orchestrator_pb2_grpc

    from clients.python.client import retry_later
    from services.common import errors
    from services.common.bootstrap import create_server

    s, orch = servicer(workers)
    held = HeldStats()
    orch.stats = held
    orch.replicas = SimpleNamespace(replicas=[])
    orch.semantic = SimpleNamespace(enabled=False)
    orch.prefix = None
    handle = create_server(service="orchestrator", address="127.0.0.1:0",
                           services=[(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server,
                                      s, "tiercache.v1.Orchestrator")],
                           max_workers=workers, **server_kw)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        futures = [stub.Stats.future(orchestrator_pb2.StatsRequest(), timeout=60)
                   for _ in range(calls)]
        # Every worker holds a call; the refusals come back at once, the rest wait.
        holds_within(lambda: held.entered >= workers, 20, 0.02)
        time.sleep(0.5)
        assert held.entered == workers
        done = [c for c in futures if c.done()]
        for c in done:
            assert c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.details() == errors.RPC_CAP_DETAILS
            # Busy now: the orchestrator tries another replica, a client retries later.
            assert errors.overloaded(c) and retry_later(c)
        if during is not None:
            during(handle, channel)
        held.release.set()
        admitted = [c for c in futures if c not in done]
        for c in admitted:
            assert c.result().requests_total == 0  # it completes
        assert held.entered == len(admitted)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status in (health_pb2.HealthCheckResponse.SERVING,
                                 health_pb2.HealthCheckResponse.NOT_SERVING)
        return len(done), len(admitted)
    finally:
        held.release.set()
        channel.close()
        handle.stop(None)


@pytest.mark.parametrize("cap", [STREAM_HEADROOM + 4, 0])
def test_calls_past_the_rpc_cap_are_refused_at_once_not_queued(cap):
    """Every worker busy (Stats calls held), more calls wait for one; past
    `max_concurrent_rpcs` gRPC refuses them at once (RESOURCE_EXHAUSTED) instead of queueing
    without bound; the ones admitted all complete. With the default cap (4 x max_workers)
    the same calls are all admitted. The refusals are counted in tiercache_rpc_total (gRPC
    refuses them before any handler, and they were not)."""
    from services.common.metrics import RPC_TOTAL

    workers = STREAM_HEADROOM + 2
    cfg = OrchestratorConfig(kvpool_addresses=("h:1",), max_workers=workers,
                             max_concurrent_rpcs=cap)
    cfg.validate()
    counted = RPC_TOTAL.labels("orchestrator", "Stats", "RESOURCE_EXHAUSTED")
    before = counted._value.get()
    refused, admitted = _flood(workers, workers + 4,
                               max_concurrent_rpcs=cfg.max_concurrent_rpcs or None)
    assert (refused, admitted) == ((2, 12) if cap else (0, 14))
    assert counted._value.get() - before == refused


def test_every_service_caps_its_calls_at_four_times_its_workers_by_default():
    """`create_server` without a cap (kvpool, prefix, semantic) caps at 4 x max_workers."""
    workers = STREAM_HEADROOM + 1
    refused, admitted = _flood(workers, 4 * workers + 2)
    assert (refused, admitted) == (2, 4 * workers)


def test_health_over_http_answers_while_the_rpc_cap_is_full():
    """A flood that fills the call cap gets gRPC's health check refused with it, so the pods'
    liveness and readiness probes ask the metrics port's /healthz instead: it still answers,
    with the same status as gRPC health (SERVING, then NOT_SERVING once a drain begins)."""
    import urllib.error
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.bootstrap import HEALTH_PATH

    seen = []

    def probe(handle, channel):
        url = f"http://127.0.0.1:{handle.metrics_port}{HEALTH_PATH}"
        handle.set_serving(True)
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with urllib.request.urlopen(url, timeout=5) as r:
            seen.append((r.status, r.read()))
        handle.begin_drain()
        with pytest.raises(urllib.error.HTTPError) as down:
            urllib.request.urlopen(url, timeout=5)
        seen.append((down.value.code, down.value.read()))
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{handle.metrics_port}/metrics", timeout=5).read()
        seen.append(b"tiercache_rpc_total" in metrics)

    workers = STREAM_HEADROOM + 1
    assert _flood(workers, 4 * workers + 2, during=probe, metrics_port=0) == (2, 4 * workers)
    assert seen == [(200, b"SERVING\n"), (503, b"NOT_SERVING\n"), True]


def test_an_rpc_cap_streams_could_fill_is_a_config_error():
    from services.common.config import ConfigError

    with pytest.raises(ConfigError, match="TIERCACHE_ORCHESTRATOR_MAX_CONCURRENT_RPCS"):
        OrchestratorConfig(kvpool_addresses=("h:1",), max_workers=16,
                           max_concurrent_rpcs=16).validate()
    OrchestratorConfig(kvpool_addresses=("h:1",), max_workers=16,
                       max_concurrent_rpcs=17).validate()


def test_the_service_serves_with_its_configured_rpc_cap(monkeypatch):
    """`python -m services.orchestrator` builds its server with the cap (wiring only: the
    server is not started)."""
    import services.orchestrator.__main__ as entry

    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_create_server(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(entry, "create_server", fake_create_server)
    monkeypatch.setenv("TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES", "127.0.0.1:1")
    monkeypatch.setenv("TIERCACHE_ORCHESTRATOR_MAX_WORKERS", "20")
    monkeypatch.setenv("TIERCACHE_ORCHESTRATOR_MAX_CONCURRENT_RPCS", "30")
    with pytest.raises(Stop):
        entry._main([])
    assert seen["max_workers"] == 20 and seen["max_concurrent_rpcs"] == 30
    monkeypatch.delenv("TIERCACHE_ORCHESTRATOR_MAX_CONCURRENT_RPCS")
    with pytest.raises(Stop):
        entry._main([])
    assert seen["max_concurrent_rpcs"] is None  # create_server's default: 4 x 20


def test_a_call_refused_for_concurrency_gives_its_rate_token_back():
    """The rate token was taken before the concurrency checks: a client retrying a refused
    call as told ("retry later") emptied its bucket without one request running, and its next
    real request was refused by the rate limit."""
    import dataclasses

    from tests.clock import Clock

    s, orch = servicer(STREAM_HEADROOM + 2, max_concurrent=1)
    s.tenants.default = dataclasses.replace(s.tenants.default, rate_per_s=1.0, burst=2)
    s.tenants.clock = Clock(100.0)  # no refill during the test
    g = s.Generate(request(), Context())
    assert next(g).text == "hi"  # 1 of 2 tokens taken
    s.warmer = SimpleNamespace(warm=lambda *a, **k: orchestrator_pb2.WarmResponse())
    for _ in range(3):
        with pytest.raises(ResourceExhausted, match="concurrent requests"):
            next(s.Generate(request(), Context()))
        with pytest.raises(ResourceExhausted, match="concurrent requests"):
            s.Warm(orchestrator_pb2.WarmRequest(top_k=1), Context())
    orch.release.set()
    list(g)
    orch.release.clear()
    again = s.Generate(request(), Context())
    assert next(again).text == "hi"  # the second token was still there
    orch.release.set()
    list(again)
    with pytest.raises(ResourceExhausted, match="rate limit"):  # and now the bucket is empty
        next(s.Generate(request(), Context()))
    assert s._streams == 0 and s.tenants._active.get("default", 0) == 0


def test_a_server_stream_refusal_gives_the_rate_token_back_too():
    import dataclasses

    from tests.clock import Clock

    s, orch = servicer(STREAM_HEADROOM + 1)  # room for 1 stream
    s.tenants.default = dataclasses.replace(s.tenants.default, rate_per_s=1.0, burst=2)
    s.tenants.clock = Clock(100.0)
    g = s.Generate(request(), Context())
    assert next(g).text == "hi"
    for _ in range(3):
        with pytest.raises(ResourceExhausted, match="concurrent streams"):
            next(s.Generate(request(), Context()))
    orch.release.set()
    list(g)
    assert s.tenants._buckets["default"].tokens == 1.0
