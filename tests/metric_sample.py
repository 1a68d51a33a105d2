"""`sample_value`: `REGISTRY.get_sample_value` read from the one collector that holds the
name, not from a collect of the whole registry. The whole collect grows with every series
the suite's earlier tests left behind (each rpc method and code, each bucket of each
histogram): a differential test reading its counters after every step spent 45-70 s a seed
on it in the full suite, against 1-3 s alone."""

from __future__ import annotations

from prometheus_client import REGISTRY


def sample_value(name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of sample `name` with exactly `labels` in the default registry, or None
    (as `REGISTRY.get_sample_value`)."""
    labels = labels or {}
    collector = REGISTRY._names_to_collectors.get(name)  # noqa: SLF001 - read only
    if collector is None:  # not a registered name: the library's own search says so
        return REGISTRY.get_sample_value(name, labels)
    for metric in collector.collect():
        for s in metric.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None
