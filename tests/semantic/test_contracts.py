"""Contracts of the semantic cache that a mutation audit found unguarded: the default TTL, the
LRU order rebuilt at load, truncated_at over gRPC and sentence-initial acronyms in the guard."""

from __future__ import annotations

from tiercache.v1 import semantic_pb2 as pb

from services.semantic.cache import Namespace
from services.semantic.guard import ParaphraseGuard
from tests.semantic.test_grpc import NS, stub, svc  # noqa: F401 - fixtures

A = Namespace("tenant-a", "smollm2", "")
B = Namespace("tenant-b", "smollm2", "")
EVEREST = "How tall is Mount Everest?"
HAMLET = "Who wrote Hamlet?"


# ---- M13: an entry stored without a TTL gets the configured default ---------------------------

def test_an_entry_stored_without_ttl_expires_after_the_default_ttl(cache_factory, embedder,
                                                                   clock):
    c = cache_factory(embedder, default_ttl_seconds=100)
    ttl = c.cfg.default_ttl_seconds
    e = c.store_entry(A, EVEREST, "8,849 m")
    assert e.ttl_seconds == ttl and e.expires_at() == e.created_at + ttl
    assert c.store.get(e.id).ttl_seconds == ttl  # durably, too
    clock.t = e.created_at + ttl - 1
    assert c.lookup(A, EVEREST).hit
    clock.t = e.created_at + ttl
    assert not c.lookup(A, EVEREST).hit
    assert c.expire() == 1 and c.stats().entries == 0
    assert c.store.count() == 0
    c.check_integrity()


# ---- M28: load rebuilds the LRU order from the last hit, not from creation -------------------

def _older_entry_hit_recently(c, clock, ns_old, ns_new) -> tuple[str, str]:
    """Stores an entry, then a newer one, then hits the older one; returns their ids."""
    clock.t += 1
    old = c.store_entry(ns_old, EVEREST, "8,849 m")
    clock.t += 1
    new = c.store_entry(ns_new, HAMLET, "Shakespeare")
    clock.t += 1
    assert c.lookup(ns_old, EVEREST).hit
    c.store.flush_hits()
    return old.id, new.id


def test_an_older_entry_hit_recently_survives_a_lower_namespace_limit_at_load(cache_factory,
                                                                             embedder, clock):
    c = cache_factory(embedder)
    old, new = _older_entry_hit_recently(c, clock, A, A)
    smaller = cache_factory(embedder, max_entries_per_namespace=1)  # the same database
    assert old in smaller._by_id and new not in smaller._by_id
    assert smaller.get(old).hit_count == 1
    assert smaller.stats().evictions_total == 1 and smaller.store.count() == 1
    smaller.check_integrity()


def test_an_older_entry_hit_recently_survives_a_lower_global_limit_at_load(cache_factory,
                                                                          embedder, clock):
    c = cache_factory(embedder)
    old, new = _older_entry_hit_recently(c, clock, A, B)
    smaller = cache_factory(embedder, max_entries_total=1)
    assert old in smaller._by_id and new not in smaller._by_id
    assert smaller.store.count() == 1
    smaller.check_integrity()


# ---- M35: truncated_at travels through Store and back out of Lookup -------------------------

def test_truncated_at_round_trips_over_grpc(stub):  # noqa: F811 - the fixture
    sid = stub.Store(pb.StoreRequest(namespace=NS, prompt="List every planet with its moons.",
                                     answer="Mercury: none; Venus:", truncated_at=6),
                     timeout=10).id
    r = stub.Lookup(pb.LookupRequest(namespace=NS, text="List every planet with its moons."),
                    timeout=10)
    assert r.hit and r.entry.id == sid
    assert r.entry.truncated_at == 6
    whole = stub.Store(pb.StoreRequest(namespace=NS, prompt="How far is the Moon?",
                                       answer="384,400 km"), timeout=10).id
    r = stub.Lookup(pb.LookupRequest(namespace=NS, text="How far is the Moon?"), timeout=10)
    assert r.entry.id == whole and r.entry.truncated_at == 0


# ---- M16: a sentence-initial two-letter acronym is an entity -------------------------------

def test_a_sentence_initial_two_letter_acronym_is_an_entity():
    g = ParaphraseGuard()
    r = g.check("UK citizens need a visa?", "US citizens need a visa?")
    assert not r.ok
    assert r.reason.startswith("entities differ") and "uk" in r.reason and "us" in r.reason
    assert g.check("UK citizens need a visa?", "UK citizens need a visa?").ok
    # Only the entity check tells these apart.
    assert ParaphraseGuard(check_entities=False).check("UK citizens need a visa?",
                                                       "US citizens need a visa?").ok
