"""An emptied namespace leaves no trace: chat traffic makes about one namespace per
conversation turn (tenant, model, hash of the context), millions a day, and whatever a
namespace left behind once its last entry went (expired, evicted, replaced, invalidated)
would grow without bound though the entries stay under their cap."""

from __future__ import annotations

import pytest

from services.semantic.cache import Namespace
from tests.semantic.test_cache_edges import FixedEmbedder


def _turn(i: int, tenant: str = "t") -> Namespace:
    return Namespace(tenant, "m", f"{i:x}")


def _per_namespace_state(c) -> dict:
    """Every structure keyed by namespace (or by something only a namespace holds)."""
    return {"indexes": set(c._indexes), "lru": set(c._ns_lru), "removing": set(c._removing),
            "expiring": set(c._expiring_ns),
            "prompts": {ns for ns, _ in c._by_prompt},
            "entries": {e.namespace for e in c._entries.values()},
            "stats": c.stats().namespaces}


def _holds_only(c, spaces: set[Namespace]) -> None:
    c.check_integrity()
    assert _per_namespace_state(c) == {
        "indexes": spaces, "lru": spaces, "removing": set(), "expiring": set(),
        "prompts": spaces, "entries": spaces, "stats": len(spaces)}


@pytest.fixture
def make_cache(cache_factory):
    def make(**kw):
        return cache_factory(FixedEmbedder(), guard_tiers=(), verifier_tiers=(), **kw)

    return make


def test_namespaces_emptied_by_expiry_leave_nothing(make_cache, clock):
    c = make_cache()
    for i in range(50):
        c.store_entry(_turn(i), f"q {i}", "a", ttl_seconds=60)
    keep = c.store_entry(_turn(99), "kept", "a").namespace
    clock.t += 61
    assert c.expire() == 50
    _holds_only(c, {keep})


def test_namespaces_emptied_by_eviction_leave_nothing(make_cache):
    """The global cap evicts the oldest turn's only entry with each Store of a new turn: the
    cap bounds the namespaces too."""
    c = make_cache(max_entries_total=10)
    for i in range(200):
        c.store_entry(_turn(i), f"q {i}", "a")
    _holds_only(c, {_turn(i) for i in range(190, 200)})


def test_namespaces_emptied_by_invalidate_leave_nothing(make_cache):
    c = make_cache()
    ids = [c.store_entry(_turn(i), f"q {i}", "a").id for i in range(30)]
    for i in range(10):
        assert c.invalidate_id(ids[i]) == 1
    for i in range(10, 20):
        assert c.invalidate_namespace(_turn(i)) == 1
    c.store_entry(_turn(0, "other"), "q", "a")
    assert c.invalidate_tenant("t") == 10
    _holds_only(c, {_turn(0, "other")})


def test_namespaces_over_their_cap_at_load_leave_nothing(make_cache, cache_factory):
    """A restart under a lower global cap drops the oldest turns whole."""
    c = make_cache()
    for i in range(20):
        c.store_entry(_turn(i), f"q {i}", "a")
    c.close_indexes()
    r = make_cache(max_entries_total=5)
    _holds_only(r, {_turn(i) for i in range(15, 20)})
