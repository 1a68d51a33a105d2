"""Prometheus metrics: one registry per process, served over HTTP by the bootstrap."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_cache: dict[tuple[str, str], object] = {}


def _get(kind, name: str, doc: str, labels: tuple[str, ...] = (), registry: CollectorRegistry
         = REGISTRY, **kw):
    # Idempotent: tests build several servers in one process, and prometheus_client refuses
    # to register a name twice.
    key = (kind.__name__, name)
    m = _cache.get(key)
    if m is None:
        m = kind(name, doc, labels, registry=registry, **kw)
        _cache[key] = m
    return m


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return _get(Counter, name, doc, labels)


# Fine between 10 ms and 1 s, where decode steps (CPU 50-90 ms, GPU ~25 ms) and TTFTs (cold
# 0.2 s, a prefix hit 0.15 s on 2 cores) fall: with 0.1-0.25 s one bucket, a histogram's p50
# could not tell a prefix hit from a cold request.
# Up to the orchestrator's default request timeout (300 s): a first token or a stream slower
# than the last finite bucket shows only as +Inf, and a quantile over it reads as that bucket.
SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1,
                   2.5, 5, 10, 30, 60, 120, 300)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return _get(Gauge, name, doc, labels)


def histogram(name: str, doc: str, labels: tuple[str, ...] = (), buckets=None) -> Histogram:
    kw = {"buckets": buckets} if buckets else {}
    return _get(Histogram, name, doc, labels, **kw)


class TotalCounter:
    """A counter fed from a running total kept elsewhere (a pool's evictions, a tree's pruned
    nodes): each `update` adds what is new since the last one, so rate() works on it."""

    def __init__(self, metric: Counter) -> None:
        self.metric = metric
        self.counted = 0

    def update(self, total: int) -> None:
        if total > self.counted:
            self.metric.inc(total - self.counted)
            self.counted = total


RPC_TOTAL = counter("tiercache_rpc_total", "RPCs handled", ("service", "method", "code"))
RPC_SECONDS = histogram(
    "tiercache_rpc_seconds", "RPC handling time (until the last message for streams)",
    ("service", "method"),
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
             120, 300),  # streams last up to the request timeout (300 s by default)
)
# Apart from the other RESOURCE_EXHAUSTED in tiercache_rpc_total (a tenant's limits, a full
# queue or disk): only this says the process itself took no more calls.
RPC_REFUSED_AT_CAP = counter(
    "tiercache_rpc_refused_at_cap_total",
    "Calls gRPC refused at once, before any handler, at the server's cap on calls under way or "
    "waiting for a worker thread (max_concurrent_rpcs; RESOURCE_EXHAUSTED \"Concurrent RPC limit "
    "exceeded!\", also counted in tiercache_rpc_total)", ("service", "method"))
