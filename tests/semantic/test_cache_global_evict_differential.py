"""A differential test of the choice of global-capacity victims (`_global_excess_locked`).

The cache keeps per-tenant counts, the tenants per count and a heap of each count's oldest
entries, updated where entries come and go, so that a Store past `max_entries_total` reads a
few tenants, not every tenant tied at the most. Its choice must stay exactly that of the
function it replaced, kept here as the reference (`reference_victims`): each victim the least
recently used entry of the tenant holding the most at that point, ties between tenants by the
key (-held, max(last_hit_at, created_at), label).

Seeded random workloads over few tenants (most tied, as at steady state, and clock steps of
zero so that ages tie too) of Stores, replacing Stores, hits, expiries, an expiry under way
(entries marked expiring, then dropped or, its delete failed, held again), Invalidate by id,
namespace and tenant, and restarts under lowered limits drive a real `SemanticCache`; every
choice (each Store, and each load) is compared with the reference's on the same state.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter

import pytest

from services.common.errors import NotFound
from services.semantic.cache import Namespace, SemanticCache
from tests.semantic.test_cache_edges import FixedEmbedder

TENANTS = [f"t{i}" for i in range(7)]
MODELS = ["m1", "m2"]
# Each Store a new answer: one the prompt's entry already holds leaves it standing (no new
# label), and the walk is about replacements and the evictions they make.
_ANSWERS = (f"a{i}" for i in itertools.count())


def reference_victims(c: SemanticCache, chosen: list[int]) -> list[int]:
    """`_global_excess_locked` as it was (0dc8b163): it read every tenant within `over` of
    the largest."""
    over = len(c._entries) - len(chosen) - len(c._expiring) - c.cfg.max_entries_total
    if over <= 0:
        return []
    skip = set(chosen)
    held = {t: len(lru) for t, lru in c._tenant_lru.items()}
    for t, n in c._expiring_tenant.items():
        if t in held:
            held[t] -= n
    for lab in skip:
        held[c._entries[lab].namespace.tenant] -= 1
    floor = max(held.values(), default=0) - over + 1
    going = c._expiring
    order = {t: iter(c._tenant_lru[t]) for t, n in held.items() if n >= floor}

    def head(t: str) -> tuple | None:
        lab = next((x for x in order[t] if x not in skip and x not in going), None)
        if lab is None:
            return None
        e = c._entries[lab]
        return (-held[t], max(e.last_hit_at, e.created_at), lab, t)

    heap = [h for t in order if (h := head(t)) is not None]
    heapq.heapify(heap)
    out: list[int] = []
    while len(out) < over and heap:
        _, _, lab, t = heapq.heappop(heap)
        out.append(lab)
        held[t] -= 1
        if (h := head(t)) is not None:
            heapq.heappush(heap, h)
    return out


@pytest.fixture
def compared(monkeypatch) -> list[tuple[int, int]]:
    """Every choice is checked against the reference's; (over-capacity, tied) per choice."""
    real = SemanticCache._global_excess_locked
    seen: list[tuple[int, int]] = []

    def checked(self, chosen):
        want = reference_victims(self, chosen)
        got = real(self, chosen)
        assert got == want, (chosen, got, want)
        if want:
            held = [len(lru) for lru in self._tenant_lru.values()]
            seen.append((len(want), held.count(max(held))))
        return got

    monkeypatch.setattr(SemanticCache, "_global_excess_locked", checked)
    return seen


def _step(c: SemanticCache, rnd: random.Random, clock, marked: list[int]) -> None:
    clock.t += rnd.choice([0, 0, 1, 2])  # ages tie often
    ns = Namespace(rnd.choice(TENANTS), rnd.choice(MODELS), "")
    op = rnd.random()
    held = list(c._entries.values())
    if op < 0.45 or not held:
        c.store_entry(ns, f"q{rnd.randrange(12)}", next(_ANSWERS),
                      ttl_seconds=rnd.choice([0, 0, 0, 5]))
    elif op < 0.65:
        e = rnd.choice(held)
        r = c.lookup(e.namespace, e.prompt, tier="strict")
        assert r.hit or e.expired(clock.t)
    elif op < 0.72:
        clock.t += 3
        c.expire()
    elif op < 0.80 and not marked:  # an expiry under way: its entries count as gone
        dead = [e.label for e in held if e.expired(clock.t)]
        with c._lock:
            marked += rnd.sample(dead, min(len(dead), rnd.randint(1, 3)))
            for lab in marked:
                c._mark_expiring_locked(lab, 1)
    elif op < 0.86 and marked:  # ... ends: some deleted, the rest held again
        gone: list[int] = []
        c.store.delete(marked[::2], gone)
        c._drop_in_chunks(gone)
        with c._lock:
            for lab in marked[1::2]:
                c._mark_expiring_locked(lab, -1)
        marked.clear()
    elif op < 0.93:
        try:
            c.invalidate_id(rnd.choice(held).id)
        except NotFound:  # expired
            pass
    elif op < 0.97:
        c.invalidate_namespace(ns)
    else:
        c.invalidate_tenant(ns.tenant)
    c.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_the_global_victims_are_those_of_the_reference(cache_factory, clock, compared, seed):
    rnd = random.Random(seed)
    emb = FixedEmbedder()
    limits = dict(guard_tiers=(), verifier_tiers=(), max_entries_per_namespace=6)
    c = cache_factory(emb, max_entries_total=14, **limits)
    for _ in range(4):
        marked: list[int] = []
        for _ in range(250):
            _step(c, rnd, clock, marked)
        if marked:
            with c._lock:
                for lab in marked:
                    c._mark_expiring_locked(lab, -1)
        # A restart under a lowered (or raised) limit: the load chooses many victims at once.
        c = cache_factory(emb, max_entries_total=rnd.choice([3, 5, 9, 12, 14]),
                          max_entries_per_tenant=rnd.choice([0, 0, 4]), **limits)
        c.check_integrity()
    assert sum(n for n, _ in compared) > 100
    assert sum(1 for _, tied in compared if tied > 1) > 50  # ties between tenants
    assert any(n > 1 for n, _ in compared)  # several victims in one choice


def test_many_tied_tenants(cache_factory, clock, compared):
    """Every tenant holds as many; a new tenant, then the oldest's, then others store."""
    c = cache_factory(FixedEmbedder(), guard_tiers=(), verifier_tiers=(), max_entries_total=300)
    for i in range(300):
        clock.t += i % 2
        c.store_entry(Namespace(f"t{i % 100}", "m", ""), f"q{i}", "a")
    for i in range(200):
        clock.t += i % 3 == 0
        c.store_entry(Namespace(f"n{i % 7}" if i % 4 else f"t{i % 100}", "m", ""), f"r{i}", "a")
        if i % 5 == 0:
            e = c._entries[next(iter(c._tenant_lru[f"t{(i * 7) % 100}"]))]
            assert c.lookup(e.namespace, e.prompt, tier="strict").hit
    c.check_integrity()
    assert len(compared) == 200


@pytest.mark.parametrize("seed", range(8))
def test_global_victims_besides_a_loads_namespace_and_tenant_excess(cache_factory, clock,
                                                                    compared, seed):
    """A restart under lowered per-namespace and per-tenant caps and a global capacity a few
    entries below what those leave: the global choice is made besides their victims (`skip`,
    its tenants holding fewer), over few victims among many tenants (not the path that reads
    every tenant), and must be the reference's."""
    rnd = random.Random(seed)
    emb = FixedEmbedder()
    limits = dict(guard_tiers=(), verifier_tiers=())
    tenants = [f"u{i}" for i in range(30)]
    c = cache_factory(emb, max_entries_total=1000, **limits)
    for i in range(150):
        clock.t += rnd.choice([0, 0, 1])
        ns = Namespace(rnd.choice(tenants[: 10 + i // 10]), rnd.choice(MODELS), "")
        c.store_entry(ns, f"q{rnd.randrange(40)}", next(_ANSWERS))  # a repeat replaces
    per_ns, per_tenant = rnd.choice([2, 3, 4]), rnd.choice([0, 4, 5])
    left = Counter()
    for ns, lru in c._ns_lru.items():
        left[ns.tenant] += min(len(lru), per_ns)
    kept = sum(min(n, per_tenant) if per_tenant else n for n in left.values())
    over = rnd.randint(1, 4)
    c = cache_factory(emb, max_entries_total=kept - over, max_entries_per_namespace=per_ns,
                      max_entries_per_tenant=per_tenant, **limits)
    c.check_integrity()
    assert len(c._entries) == kept - over
    assert compared and compared[-1][0] == over  # the load chose `over` global victims


def test_a_tenants_expiring_oldest_entry_does_not_rank_it_among_the_tied(cache_factory, clock,
                                                                          compared):
    """Two tenants hold three entries each (not counting one of A's, its oldest, taken by an
    expiry under way); a third's second Store takes one victim. It is B's oldest (older than
    A's oldest left): A's expiring entry must not make A the tenant read at that count."""
    c = cache_factory(FixedEmbedder(), guard_tiers=(), verifier_tiers=(), max_entries_total=7)
    a, b = Namespace("A", "m", ""), Namespace("B", "m", "")
    c.store_entry(a, "gone", "x")
    for ns, q in [(b, "b1"), (b, "b2"), (b, "b3"), (a, "a1"), (a, "a2"), (a, "a3")]:
        clock.t += 1
        c.store_entry(ns, q, "x")
    with c._lock:
        c._mark_expiring_locked(c._by_prompt[(a, "gone")], 1)
    for q in ("c1", "c2"):
        c.store_entry(Namespace("C", "m", ""), q, "x")
    assert [n for n, _ in compared] == [1]
    assert (b, "b1") not in c._by_prompt and (a, "a1") in c._by_prompt
    c.check_integrity()


def test_a_tenant_listed_twice_at_its_count_is_read_once(cache_factory, clock, compared):
    """A hit on a tenant's newest entry lists it again at the same count with the same oldest
    entry. Over capacity by two (an expired entry an expiry took, held again when its delete
    failed), a Store's choice of two victims reads the two tenants with the oldest entries at
    the top count: A and B, not A twice (which left B's oldest, the second victim, unread).
    (The Store then drops the expired entry first and chooses again.)"""
    c = cache_factory(FixedEmbedder(), guard_tiers=(), verifier_tiers=(), max_entries_total=6)
    a, b = Namespace("A", "m", ""), Namespace("B", "m", "")
    c.store_entry(Namespace("X", "m", ""), "x1", "x", ttl_seconds=1)
    for ns, q in [(a, "a1"), (b, "b1"), (Namespace("C", "m", ""), "c1"), (a, "a2"), (b, "b2")]:
        clock.t += 1
        c.store_entry(ns, q, "x")
    clock.t += 10  # x1 expired; an expiry takes it, its delete fails: held again
    with c._lock:
        c._mark_expiring_locked(c._by_prompt[(Namespace("X", "m", ""), "x1")], 1)
    c.store_entry(Namespace("C", "m", ""), "c2", "x")
    with c._lock:
        c._mark_expiring_locked(c._by_prompt[(Namespace("X", "m", ""), "x1")], -1)
    assert c.lookup(a, "a2", tier="strict").hit
    c.store_entry(Namespace("D", "m", ""), "d1", "x")
    assert compared[0][0] == 2  # the choice of two victims (checked against the reference)
    assert (a, "a1") not in c._by_prompt
    c.check_integrity()


def test_the_levels_rebuilt_from_stale_items_stay_a_heap_and_bounded(cache_factory, clock,
                                                                     compared):
    """Each hit and each short-lived tenant leaves a stale or repeated item in `_levels`;
    past twice the tenants (+64) they are built again from the counts (memory stays bounded)
    as heaps: the tenant re-listed last, whose entry is the oldest, is still read first."""
    c = cache_factory(FixedEmbedder(), guard_tiers=(), verifier_tiers=(),
                      max_entries_total=21)
    tenants = [Namespace(f"t{i}", "m", "") for i in range(10)]
    for q in ("q0", "q1"):
        for ns in tenants:
            clock.t += 1
            c.store_entry(ns, q, "x")
    z, rebuilt = Namespace("z", "m", ""), False
    for i in range(200):
        before = c._level_items
        assert c.lookup(tenants[0], "q1", tier="strict").hit  # t0 listed again, at the end
        c.store_entry(z, f"z{i}", "x")
        c.invalidate_tenant("z")
        assert c._level_items <= 2 * len(c._level_of) + 64 + 1, "stale items without bound"
        if c._level_items < before:
            rebuilt = True
            break
    assert rebuilt, "the levels were never built again"
    w = Namespace("w", "m", "")
    c.store_entry(w, "w1", "x")
    c.store_entry(w, "w2", "x")  # one over: t0's q0, the oldest of the tied
    assert compared and (tenants[0], "q0") not in c._by_prompt
    c.check_integrity()
