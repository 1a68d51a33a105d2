"""Orchestrator metrics no test read, checked against what docs/metrics.md says they count
(pure logic with the fakes of test_pipeline_paths and test_stream_cap; the series read from
the Prometheus registry as deltas):

- tiercache_orchestrator_dispatch_memory_routes_total: requests routed to a replica for a
  prefix the index did not know yet, sent there moments before (routing's DispatchMemory),
  and not those routed by the ring, by what the index itself knew, or without the memory;
- tiercache_orchestrator_streams_ended_at_deadline_total: Generate streams ended from
  outside (the reaper) a second past their deadline, and not streams read through, nor
  requests refused before they started;
- tiercache_orchestrator_feedback_total: Feedback ratings applied, by rating, and none
  refused or not applied."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import orchestrator_pb2

from services.common import errors
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.pipeline import Finished
from services.orchestrator.server import REAP_GRACE_S, OrchestratorServicer
from services.orchestrator.tenants import TenantRegistry
from tests.metric_sample import sample_value
from tests.orchestrator.test_pipeline_paths import Call, RpcError, Stub, final, generate, make
from tests.orchestrator.test_stream_cap import Context, SlowOrchestrator, request
from tests.waits import holds_within

ROUTES = "tiercache_orchestrator_dispatch_memory_routes_total"
REAPED = "tiercache_orchestrator_streams_ended_at_deadline_total"


def metric(name: str) -> float:
    return sample_value(name) or 0.0


def reaped_reaches(want: float) -> float:
    """The reaped count once it reaches `want` (5 s at most): the reaper thread counts a call
    after ending it, which on a loaded host may come well after the end the test saw."""
    holds_within(lambda: metric(REAPED) >= want, 5, 0.01)
    return metric(REAPED)


def stubs() -> dict[str, Stub]:
    return {r: Stub(r, [Call([final(r, 2)]) for _ in range(4)]) for r in ("A", "B")}


def report(events):
    (fin,) = [e for e in events if isinstance(e, Finished)]
    return fin.report


def test_a_route_counts_only_where_the_memory_of_a_prompt_just_sent_chose_it():
    """The first request of a new prompt is routed by the ring (the index knows nothing, nor
    the memory): not counted. The next one with the same prompt follows it on the memory's
    word alone: counted once. Where the index itself knows the prefix there (as long a match
    as the memory's), where the memory's credit is too short for a prefix route, or without a
    memory, nothing is counted."""
    orch = make(stubs())
    before = metric(ROUTES)
    first = report(generate(orch, []))
    assert first.route == "ring" and metric(ROUTES) == before
    second = report(generate(orch, []))
    assert second.route == "prefix" and second.replica_id == first.replica_id
    assert metric(ROUTES) == before + 1

    held = first.replica_id
    index = SimpleNamespace(timeout_s=0.5, match=lambda hashes, model_id, timeout=None,
                            probe=False, on_call=None: {held: 16 * len(hashes)})
    knows = make(stubs(), prefix=index)
    knows.dispatched.record(held, knows.hasher.hashes(list(range(1, 100)), "salt-a"))
    before = metric(ROUTES)
    r = report(generate(knows, []))
    assert r.route == "prefix" and r.replica_id == held and metric(ROUTES) == before

    # A credit shorter than a prefix route needs (min_prefix_tokens, 32) decides nothing.
    short = make(stubs())
    for rid in ("A", "B"):
        short.dispatched.record(rid, short.hasher.hashes(list(range(1, 17)), "salt-a"))
    before = metric(ROUTES)
    assert report(generate(short, [])).route == "ring" and metric(ROUTES) == before

    plain = make(stubs())
    plain.dispatched = None
    before = metric(ROUTES)
    assert [report(generate(plain, [])).route for _ in range(2)] == ["ring", "ring"]
    assert metric(ROUTES) == before


def test_each_route_the_memory_decides_counts_a_failover_again():
    """The count is of routing decisions (docs/architecture.md: "the routes it decided"): a
    request sent on the memory's word to A, lost there, and sent on its word again to B
    counts twice; its third route, by the ring to C, not at all."""
    lost = {r: Stub(r, [Call([], RpcError(grpc.StatusCode.UNAVAILABLE))]) for r in ("A", "B")}
    orch = make({**lost, "C": Stub("C", [Call([final("C", 2)])])})
    hashes = orch.hasher.hashes(list(range(1, 100)), "salt-a")
    for rid in ("A", "B"):
        orch.dispatched.record(rid, hashes)
    before = metric(ROUTES)
    r = report(generate(orch, []))
    assert r.replica_id == "C" and [len(s.requests) for s in lost.values()] == [1, 1]
    assert metric(ROUTES) == before + 2


class Unending(Context):
    """A call the reaper fails to end (its cancel raises)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.tried = threading.Event()

    def time_remaining(self):
        return self.seconds

    def cancel(self) -> None:
        self.tried.set()
        raise RuntimeError("cannot cancel")


class Reaped(Context):
    """A call with `seconds` left of its deadline; `cancel` is how the reaper ends it here
    (a real call is cancelled with DEADLINE_EXCEEDED)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.ended = threading.Event()

    def time_remaining(self):
        return self.seconds

    def cancel(self) -> None:
        self.ended.set()


def servicer() -> tuple[OrchestratorServicer, SlowOrchestrator]:
    cfg = OrchestratorConfig(kvpool_addresses=("h:1",))
    cfg.validate()
    s = OrchestratorServicer(cfg)
    orch = SlowOrchestrator()
    s.attach(orch, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                        max_prompt_tokens=100, max_tokens=100,
                                        max_concurrent=10))
    return s, orch


def test_a_stream_whose_client_stopped_reading_is_ended_and_counted_once():
    """A client takes the first message and reads no more: a grace second past its deadline
    the stream is ended from outside and counted, once. A stream read through to its end and
    a request refused before it started count nothing."""
    s, orch = servicer()
    orch.release.set()  # the answer ends at once
    before = metric(REAPED)
    assert [m.text for m in s.Generate(request(), Reaped(0.2))] == ["hi"]
    bad = request()
    bad.prompt = "both"
    with pytest.raises(errors.InvalidArgument):
        next(s.Generate(bad, Reaped(0.2)))
    s2, orch2 = servicer()  # its answer waits (10 s) after the first message
    ctx = Reaped(0.2)
    stream = s2.Generate(request(), ctx)
    assert next(stream).text == "hi"  # then the client reads no more
    assert ctx.ended.wait(0.2 + REAP_GRACE_S + 5)
    assert reaped_reaches(before + 1) == before + 1  # the count follows the end
    assert s._reaper.armed() == s2._reaper.armed() == 0
    orch2.release.set()
    stream.close()
    assert metric(REAPED) == before + 1


def test_a_handler_stuck_past_its_deadline_is_counted_though_its_client_reads():
    """The reaper cannot tell why a stream is still under way past its deadline: one stuck
    before its first message (a pipeline not ending at its deadline) while its client waits
    to read is ended and counted as one whose client stopped reading is."""
    from services.orchestrator.pipeline import TextDelta

    s, orch = servicer()
    ctx = Reaped(0.1)

    def stuck(**kw):
        ctx.ended.wait(0.1 + REAP_GRACE_S + 5)  # stuck until the reaper ends the call
        yield TextDelta("late", [])

    orch.generate = stuck
    before = metric(REAPED)
    got = list(s.Generate(request(), ctx))  # the client reads all along
    assert ctx.ended.is_set() and [m.text for m in got] == ["late"]
    assert reaped_reaches(before + 1) == before + 1


def test_a_stream_the_reaper_failed_to_end_is_not_counted(caplog):
    """Ending the call raised (logged): the stream was not ended, so it is not counted."""
    s, orch = servicer()
    before = metric(REAPED)
    ctx = Unending(0.1)
    stream = s.Generate(request(), ctx)
    assert next(stream).text == "hi"
    assert ctx.tried.wait(0.1 + REAP_GRACE_S + 5)
    # The reaper's thread takes its calls one at a time: once a call armed after it has been
    # ended and counted, whatever it did with the failed one is done (a sleep here passed
    # whether or not a late count came).
    s._reaper.arm(time.monotonic(), Reaped(0), "a later call")
    # its line is written after its count
    holds_within(lambda: any("a later call" in r.getMessage() for r in caplog.records), 5, 0.01)
    assert metric(REAPED) == before + 1  # that call only
    orch.release.set()
    stream.close()


def test_prompt_pieces_counts_pieces_of_the_length_its_help_names(tok):
    """tiercache_orchestrator_prompt_pieces_total's help names the length a piece needs
    (docs/metrics.md said "PIECE_CACHE_MIN_CHARS", a name no operator can look up: a live
    stack's ~200-character system prompts left the series absent). A piece (the template's
    "system\n" and the prompt, between control tokens) one character under it is not counted;
    one of it is, a miss then a hit."""
    from services.orchestrator import render
    from services.orchestrator.render import PIECE_CACHE_MIN_CHARS, Message, PromptRenderer

    help_text = render.PIECES._documentation  # noqa: SLF001
    assert f"of {PIECE_CACHE_MIN_CHARS} characters or more" in help_text
    renderer = PromptRenderer(tok, max_chars=10_000)
    name = "tiercache_orchestrator_prompt_pieces_total"

    def counts() -> tuple[float, float]:
        return (sample_value(name, {"result": "miss"}) or 0.0,
                sample_value(name, {"result": "hit"}) or 0.0)

    head = len("system\n")
    for size, want in ((PIECE_CACHE_MIN_CHARS - head - 1, [(0, 0), (0, 0)]),
                       (PIECE_CACHE_MIN_CHARS - head, [(1, 0), (1, 1)])):
        before = counts()
        system = ("Be brief. " * 100)[:size]
        seen = []
        for _ in range(2):
            renderer.render_chat([Message("system", system), Message("user", "Hi")])
            now = counts()
            seen.append((now[0] - before[0], now[1] - before[1]))
        assert seen == want, size


def rejections() -> float:
    from services.orchestrator.tenants import REJECTED

    return sum(s.value for m in REJECTED.collect() for s in m.samples
               if s.name == "tiercache_orchestrator_rejections_total")


def test_rejections_count_a_tenants_limits_not_the_servers_invalid_arguments():
    """tiercache_orchestrator_rejections_total, as its help now says: a tenant's limit counts
    (RESOURCE_EXHAUSTED, by tenant name); a max_tokens past the server's own limit is
    INVALID_ARGUMENT and counts nothing here (the help said "a tenant or server limit", and a
    live stack's `--max-tokens 5000` moved only tiercache_rpc_total)."""
    from tiercache.v1 import common_pb2

    from services.orchestrator.server import parse_sampling
    from services.orchestrator.tenants import REJECTED

    help_text = REJECTED._documentation  # noqa: SLF001
    assert "tenant's limit" in help_text and "not those past the server's own" in help_text
    cfg = OrchestratorConfig(max_tokens_limit=64)
    reg = TenantRegistry.build(tokens_file="", tokens="acme-token=acme", key=b"k",
                               max_prompt_tokens=100, max_tokens=16, max_concurrent=10)
    acme = reg.authenticate({"authorization": "Bearer acme-token"})
    before = rejections()
    with pytest.raises(errors.InvalidArgument):
        parse_sampling(common_pb2.SamplingParams(max_tokens=65), cfg)
    assert rejections() == before
    with pytest.raises(errors.ResourceExhausted):
        reg.check_limits(acme, 10, 17)
    assert rejections() == before + 1
    assert sample_value("tiercache_orchestrator_rejections_total",
                        {"tenant": "acme", "reason": "max_tokens"}) is not None


def test_requests_count_a_request_once_its_client_has_the_last_token():
    """tiercache_orchestrator_requests_total counts requests served, as its help now says: a
    client gone after the first text (a cancel, a deadline on the live stack) counts nothing;
    one read through counts once, by its cache class."""
    from services.orchestrator.pipeline import REQUESTS, Policy, Sampling
    from services.orchestrator.render import RenderedPrompt
    from tests.orchestrator.test_pipeline_paths import PROMPT, TENANT

    help_text = REQUESTS._documentation  # noqa: SLF001
    assert "counted once the client has taken the last token" in help_text

    def cold() -> float:
        return sample_value("tiercache_orchestrator_requests_total",
                            {"cache_class": "cold"}) or 0.0

    orch = make(stubs())
    before = cold()
    events = orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(4, 0.0, 1.0, 0, (), False), policy=Policy(), session_id="s",
        return_token_ids=True, request_id="rid", deadline=time.monotonic() + 30,
        on_cancel=[].append)
    first = next(events)  # the first text, then the client is gone
    assert not isinstance(first, Finished)
    events.close()
    assert cold() == before
    report(generate(orch, []))
    assert cold() == before + 1


CALL_SECONDS = "tiercache_orchestrator_backend_call_seconds"


def test_a_slow_semantic_shard_shows_in_the_backend_call_histogram():
    """A shard answering every Lookup slowly, within its timeout, stayed healthy and counted no
    degradation: no figure showed it. Each call is timed by tier, method and shard, a failed
    one too."""
    from tiercache.v1 import semantic_pb2

    from services.orchestrator.backends import SemanticBackend

    addr = "slow-shard:1"
    labels = {"tier": "semantic", "method": "Lookup", "address": addr}
    answers: list = [semantic_pb2.LookupResponse(), RpcError(grpc.StatusCode.UNAVAILABLE)]

    def lookup(req, **kw):
        time.sleep(0.35)
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    sem = SemanticBackend(addr, "", timeout_s=2.0)
    sem.stubs[addr] = SimpleNamespace(Lookup=lookup)
    req = semantic_pb2.LookupRequest(namespace=semantic_pb2.Namespace(tenant="t"), text="q")

    def seen(suffix: str, le: str | None = None) -> float:
        want = labels if le is None else {**labels, "le": le}
        return sample_value(CALL_SECONDS + suffix, want) or 0.0

    sem.lookup(req)
    with pytest.raises(grpc.RpcError):
        sem.lookup(req)
    assert seen("_count") == 2 and seen("_sum") >= 0.7
    assert seen("_bucket", "0.3") == 0 and seen("_bucket", "+Inf") == 2
    assert sem.health.healthy is False  # UNAVAILABLE, as before


def test_a_replica_generate_is_timed_to_its_first_message_or_its_failure():
    """A Generate is timed until the replica's first message (the rest is decode), and one
    that fails before any (refused, lost) when it fails, as the other tiers' failed calls
    are: a replica failing every call at once showed in no figure of this histogram."""
    def count(address: str) -> float:
        return sample_value(CALL_SECONDS + "_count", {"tier": "kvpool", "method": "Generate",
                                                      "address": address}) or 0.0

    ok = make({"gen-ok:1": Stub("A", [Call([final("A", 2)])])})
    report(generate(ok, []))
    assert count("gen-ok:1") == 1
    bad = make({"gen-bad:1": Stub("B", [Call([], err=RpcError(grpc.StatusCode.UNAVAILABLE))])})
    with pytest.raises(errors.TierCacheError):
        generate(bad, [])
    assert count("gen-bad:1") == 1


FEEDBACK = "tiercache_orchestrator_feedback_total"


def test_feedback_counts_each_applied_rating_by_rating_and_no_refused_one():
    """docs/metrics.md: a good rating applied (Verify) counts good, a bad one (Invalidate,
    the entry gone already too) counts bad; one the tier could not apply, or refused before
    it, counts nothing. No metric said how many hits users rated wrong."""
    from services.orchestrator.config import STREAM_HEADROOM
    from tests.orchestrator.test_semantic_errors import Refusal
    from tests.orchestrator.test_stream_cap import servicer

    def count(rating: str) -> float:
        return sample_value(FEEDBACK, {"rating": rating}) or 0.0

    s, orch = servicer(STREAM_HEADROOM + 1)
    gone: list[bool] = []

    def invalidate(*a, **kw):
        if gone:
            raise Refusal(grpc.StatusCode.NOT_FOUND, "id: no entry 'e1'")
        gone.append(True)
        return SimpleNamespace(removed=1)

    def verify(*a, **kw):
        if gone:
            raise Refusal(grpc.StatusCode.NOT_FOUND, "id: no entry 'e1'")

    orch.semantic = SimpleNamespace(enabled=True, invalidate=invalidate, verify=verify)
    ref = s.tenants.entry_ref(s.tenants.authenticate({}), "e1")
    good, bad = count("good"), count("bad")

    def rate(rating, entry=ref):
        return s.Feedback(orchestrator_pb2.FeedbackRequest(semantic_entry_id=entry,
                                                           rating=rating), Context())

    assert rate(orchestrator_pb2.RATING_GOOD).verified
    assert (count("good"), count("bad")) == (good + 1, bad)
    assert rate(orchestrator_pb2.RATING_BAD).invalidated
    assert not rate(orchestrator_pb2.RATING_BAD).invalidated  # gone already: still a report
    assert (count("good"), count("bad")) == (good + 1, bad + 2)
    with pytest.raises(errors.NotFound):  # a good rating of an entry gone: not applied
        rate(orchestrator_pb2.RATING_GOOD)
    with pytest.raises(errors.NotFound):  # an unknown reference: refused before the tier
        rate(orchestrator_pb2.RATING_BAD, "nope")
    with pytest.raises(errors.InvalidArgument):
        rate(orchestrator_pb2.RATING_UNSPECIFIED)
    assert (count("good"), count("bad")) == (good + 1, bad + 2)
