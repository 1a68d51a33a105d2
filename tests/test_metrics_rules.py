"""Rules of the shared metrics (services/common/metrics.py)."""

from __future__ import annotations

from services.common.metrics import RPC_SECONDS, SECONDS_BUCKETS
from services.orchestrator.config import OrchestratorConfig


def _finite_buckets(hist) -> list[float]:
    return [b for b in hist._upper_bounds if b != float("inf")]


def test_time_histograms_reach_the_default_request_timeout():
    """A stream or a first token may take up to the orchestrator's request timeout; with the
    last finite bucket at 60 s (30 s for first tokens) the slower ones were only +Inf and a
    p99 over them read 60 s (30 s)."""
    limit = OrchestratorConfig().request_timeout_s
    assert max(SECONDS_BUCKETS) >= limit
    assert max(_finite_buckets(RPC_SECONDS)) >= limit
    assert list(SECONDS_BUCKETS) == sorted(set(SECONDS_BUCKETS))
