"""How the orchestrator treats a semantic tier that refuses a lookup (pure logic, a fake tier)."""

from __future__ import annotations

import time

import grpc
import pytest

from services.common.errors import InvalidArgument
from services.orchestrator.pipeline import Orchestrator, OrchestratorStats, Policy
from services.orchestrator.render import RenderedPrompt
from services.orchestrator.tenants import Tenant


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class RefusingTier:
    enabled = True
    timeout_s = 2.0

    def __init__(self, error: Refusal) -> None:
        self.error = error

    def lookup(self, request, timeout=None, on_call=None):
        raise self.error

    def store(self, request, timeout=None, on_call=None):
        raise self.error

    def shard_for(self, ns):
        return "10.0.0.7:50052"


def _soon() -> float:
    return time.monotonic() + 30


def orchestrator(error: Refusal) -> Orchestrator:
    o = Orchestrator.__new__(Orchestrator)  # only what _lookup reads
    o.semantic, o.stats, o.model_id, o.default_tier = (RefusingTier(error), OrchestratorStats(),
                                                       "m", "standard")
    return o


TENANT = Tenant("a", "salt", 100, 10, 1)
PROMPT = RenderedPrompt([1, 2, 3], "word " * 3000, "")


@pytest.mark.parametrize("details", ["text: longer than the limit of 8192 characters",
                                     "namespace.tenant: longer than 256 chars"])
def test_a_text_the_tier_will_not_take_skips_the_tier(details):
    """The request goes without the tier, which is healthy: counted as a degradation, a
    client's long messages raised the alerts meant for a tier that is down."""
    o = orchestrator(Refusal(grpc.StatusCode.INVALID_ARGUMENT, details))
    assert o._lookup(TENANT, PROMPT, Policy(), want_draft=True, deadline=_soon()) is None
    assert not o.stats.degradations


def test_an_answer_the_tier_will_not_take_is_not_stored_and_no_degradation():
    o = orchestrator(Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                             "answer: longer than the limit of 32768 characters"))
    assert o._store(TENANT, PROMPT, "x" * 40_000, 0, deadline=_soon()) == ""
    assert not o.stats.degradations
    o = orchestrator(Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert o._store(TENANT, PROMPT, "x", 0, deadline=_soon()) == ""
    assert o.stats.degradations["semantic_store_failed"] == 1


@pytest.mark.parametrize("details", ["tier: unknown tier 'x'", "threshold: must be 0 or in"])
def test_a_bad_tier_or_threshold_is_the_callers_error(details):
    o = orchestrator(Refusal(grpc.StatusCode.INVALID_ARGUMENT, details))
    with pytest.raises(InvalidArgument) as e:
        o._lookup(TENANT, PROMPT, Policy(semantic_tier="x"), want_draft=True, deadline=_soon())
    # Named as the caller's field: cache_policy.semantic_tier / cache_policy.semantic_threshold.
    field, _, why = details.partition(":")
    assert e.value.field == f"cache_policy.semantic_{field}"
    assert str(e.value) == f"cache_policy.semantic_{field}: {why.strip()}"
    assert not o.stats.degradations


def test_an_unavailable_tier_is_skipped():
    o = orchestrator(Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert o._lookup(TENANT, PROMPT, Policy(), want_draft=False, deadline=_soon()) is None
    assert o.stats.degradations["semantic_skipped"] == 1


def test_a_tier_down_is_logged_a_few_times_then_counted_not_once_per_request(caplog,
                                                                          monkeypatch):
    """Every request logged its own WARNING while a dependency was down (an operator's run:
    76 lines in 16 s with 2 requests in flight); each is still counted as a degradation."""
    import logging

    from services.common.logs import Thinned
    from services.orchestrator import pipeline

    monkeypatch.setattr(pipeline, "_DEGRADED_LINES", Thinned(pipeline.log, per_window=3))
    o = orchestrator(Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    with caplog.at_level(logging.WARNING, logger=pipeline.log.name):
        for _ in range(20):
            assert o._lookup(TENANT, PROMPT, Policy(), want_draft=False,
                             deadline=_soon()) is None
    assert caplog.text.count("semantic lookup failed") == 3
    assert o.stats.degradations["semantic_skipped"] == 20


@pytest.mark.parametrize("details,said", [
    ("Deadline Exceeded", "semantic shard 10.0.0.7:50052: Deadline Exceeded"),
    ("semantic shard 10.0.0.7:50052 hung: skipped for another 1.0s",
     "semantic shard 10.0.0.7:50052 hung: skipped for another 1.0s"),
])
def test_a_failed_semantic_call_s_line_names_its_shard(caplog, monkeypatch, details, said):
    """On-call walk-through: with the semantic shard SIGSTOPped, a Store's line read
    "semantic store failed: Deadline Exceeded", naming no shard. Each line names it, once."""
    import logging

    from services.common.logs import Thinned
    from services.orchestrator import pipeline

    monkeypatch.setattr(pipeline, "_DEGRADED_LINES", Thinned(pipeline.log))
    o = orchestrator(Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, details))
    with caplog.at_level(logging.WARNING, logger=pipeline.log.name):
        assert o._lookup(TENANT, PROMPT, Policy(), want_draft=False, deadline=_soon()) is None
        assert o._store(TENANT, PROMPT, "answer", 0, _soon()) == ""
    assert [r.getMessage() for r in caplog.records] == [
        f"semantic lookup failed, skipping the tier: {said}", f"semantic store failed: {said}"]
