"""A differential test of the semantic cache's lifecycle against a reference model of its
documented rules (services/semantic/README.md, docs/settings.md, the docstrings of cache.py).

Seeded random operations (Store, Lookup in every tier and with explicit thresholds, Verify,
Invalidate by id and by namespace, expiry, hit flushes, clean restarts, restarts that lose the
unflushed hits, restarts under lowered limits or TTL caps, restarts taking a saved HNSW graph)
drive a real `SemanticCache` (real SQLite, real faiss) and a small model; every answer
(hit / draft / miss and which entry, the similarity, counts returned, NOT_FOUND), the Stats
counters, every entry's fields and the SQLite row count are compared after every step.

The rules the model holds:
- an exact repeat of a live entry's prompt is a hit at similarity 1; otherwise the nearest live
  candidate at or above its threshold (the tier's or the explicit one, minus the verified bonus
  for a verified entry, never below the floor) is the hit; else the nearest live candidate at
  or above the draft floor is a near miss (a draft when asked for);
- a Store of a prompt the namespace holds replaces it (neither an eviction nor an expiry);
- TTL: an entry expires at created_at + ttl (ttl 0 = the default, 0 = never); a hit does not
  extend it; expired entries are served by nothing but counted as held until purged (expire,
  a Store past capacity, or a restart);
- capacity: past the namespace's cap its least recently used entry goes, past the tenant's
  quota the tenant's, past the global cap the least recently used of the tenant holding the
  most; before evicting, every expired entry is purged; a use is a Store or a hit;
- Verify of an unknown or expired entry is NOT_FOUND; Invalidate of an unknown or expired
  entry NOT_FOUND too (one expired but not yet purged is left to the purge, which counts it
  expired: Feedback's docs answer a bad rating of an expired entry "invalidated" false);
- a restart serves exactly the acknowledged, unexpired, non-invalidated entries, with their
  verified flags and the hit counts flushed before it, in the LRU order those give; lowered
  limits and TTL caps apply at load, and a TTL cut so stays cut at later starts; times
  stamped after the start's clock (a clock read behind) are clamped to it.

Vectors are chosen (a fake embedder, as in test_cache_edges): prompt i is the basis vector e_i,
its paraphrase 0.94 e_i + 0.34 e_(K+i) (cosine 0.94: a hit in the relaxed tier, in the standard
tier only when verified, never in the strict tier; a draft otherwise); every other pair is
orthogonal. Guard and verifier are off: their decisions are not the subject here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from services.common.errors import InvalidArgument, NotFound
from services.semantic.cache import Namespace, SemanticCache
from services.semantic.config import SemanticConfig
from services.semantic.store import EntryStore
from tests.clock import Clock

K = 6  # base prompts; each has one paraphrase
DIM = 2 * K + 4
PARA_COS = 0.94
FLOOR, BONUS, DRAFT_FLOOR = 0.85, 0.02, 0.80
TIERS = {"strict": 0.97, "standard": 0.95, "relaxed": 0.90}
BASES = [f"what is topic {i}" for i in range(K)]
PARAS = [f"tell me about topic {i} please" for i in range(K)]
PROMPTS = BASES + PARAS


class PairEmbedder:
    """Prompt i -> e_i; its paraphrase at cosine PARA_COS to it; all else orthogonal."""

    name = identity = "pairs@differential"
    dim = DIM

    def embed_one(self, text: str) -> np.ndarray:
        v = np.zeros(DIM, np.float32)
        if text in BASES:
            v[BASES.index(text)] = 1.0
        elif text in PARAS:
            i = PARAS.index(text)
            v[i], v[K + i] = PARA_COS, math.sqrt(1 - PARA_COS ** 2)
        else:
            v[2 * K] = 1.0  # a text nothing is stored under
        return v

    def embed(self, texts: list[str]) -> np.ndarray:
        return (np.stack([self.embed_one(t) for t in texts]) if texts
                else np.zeros((0, DIM), np.float32))


def similarity(a: str, b: str) -> float:
    if a == b:
        return 1.0
    if {a, b} <= set(PROMPTS) and PROMPTS.index(a) % K == PROMPTS.index(b) % K:
        return PARA_COS  # a prompt and its paraphrase
    return 0.0


# ---- the reference model ----------------------------------------------------------------------


@dataclass
class MEntry:
    id: str
    ns: Namespace
    prompt: str
    answer: str
    verified: bool
    created_at: float
    ttl: int
    stored_ttl: int = 0  # as SQLite holds it (a restart caps it under its own limits)
    hit_count: int = 0
    last_hit_at: float = 0.0
    used: float = 0.0  # the last use (Store or hit): LRU order
    # What SQLite holds of the hit counters (written by a flush, or a clean stop).
    saved_hits: int = 0
    saved_last_hit: float = 0.0

    def expires_at(self) -> float:
        return self.created_at + self.ttl if self.ttl > 0 else math.inf

    def expired(self, now: float) -> bool:
        return now >= self.expires_at()


@dataclass
class Limits:
    per_ns: int
    per_tenant: int
    total: int
    default_ttl: int
    max_ttl: int


@dataclass
class Model:
    limits: Limits
    entries: dict[str, MEntry] = field(default_factory=dict)
    lookups: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    near: int = 0
    evicted: int = 0
    expired: int = 0

    def held(self, ns: Namespace) -> list[MEntry]:
        return [e for e in self.entries.values() if e.ns == ns]

    def by_prompt(self, ns: Namespace, prompt: str) -> MEntry | None:
        return next((e for e in self.held(ns) if e.prompt == prompt), None)

    # -- lookup
    def lookup(self, ns, text, tier, threshold, want_draft, now):
        """(hit, entry id or None, similarity, exact, threshold or None)."""
        name = tier or "standard"
        th = threshold if threshold else TIERS[name]
        self.lookups += 1
        key = "explicit" if threshold else name
        live = [e for e in self.held(ns) if not e.expired(now)]

        def th_of(e):
            return max(FLOOR, th - BONUS) if e.verified else th

        exact = next((e for e in live if e.prompt == text), None)
        if exact is not None:
            self._hit(exact, now, key)
            return True, exact.id, 1.0, True, th_of(exact)
        near = sorted((e for e in live if similarity(text, e.prompt) > 0),
                      key=lambda e: -similarity(text, e.prompt))
        for e in near:
            if similarity(text, e.prompt) >= th_of(e):
                self._hit(e, now, key)
                return True, e.id, similarity(text, e.prompt), False, th_of(e)
        best = near[0] if near else None
        if best is not None and similarity(text, best.prompt) >= DRAFT_FLOOR:
            self.near += 1
            return (False, best.id if want_draft else None, similarity(text, best.prompt),
                    False, th_of(best))
        return False, None, 0.0, False, None

    def _hit(self, e: MEntry, now: float, key: str) -> None:
        e.hit_count += 1
        e.last_hit_at = e.used = now
        self.hits[key] = self.hits.get(key, 0) + 1

    # -- store
    def store(self, eid, ns, prompt, answer, verified, ttl, now) -> None:
        old = self.by_prompt(ns, prompt)
        if old is not None:  # replaced: neither evicted nor expired
            del self.entries[old.id]
        ttl = ttl or self.limits.default_ttl
        self.entries[eid] = MEntry(eid, ns, prompt, answer, verified, now, ttl, ttl, used=now)
        if self._over(ns):
            self.expired += self.purge(now)
        self._evict(ns)

    def _over(self, ns) -> bool:
        lim = self.limits
        tenant = sum(1 for e in self.entries.values() if e.ns.tenant == ns.tenant)
        return (len(self.held(ns)) > lim.per_ns or len(self.entries) > lim.total
                or 0 < lim.per_tenant < tenant)

    def _evict(self, ns) -> None:
        self._evict_ns(ns)
        self._evict_tenant(ns.tenant)
        self._evict_total()

    def _drop_lru(self, pool: list[MEntry]) -> None:
        victim = min(pool, key=lambda e: e.used)
        del self.entries[victim.id]
        self.evicted += 1

    def _evict_ns(self, ns) -> None:
        while len(self.held(ns)) > self.limits.per_ns:
            self._drop_lru(self.held(ns))

    def _evict_tenant(self, tenant) -> None:
        while True:
            mine = [e for e in self.entries.values() if e.ns.tenant == tenant]
            if not 0 < self.limits.per_tenant < len(mine):
                return
            self._drop_lru(mine)

    def _evict_total(self) -> None:
        while len(self.entries) > self.limits.total:
            count: dict[str, list[MEntry]] = {}
            for e in self.entries.values():
                count.setdefault(e.ns.tenant, []).append(e)
            most = max(len(v) for v in count.values())
            heads = [min(v, key=lambda e: e.used) for v in count.values() if len(v) == most]
            self._drop_lru(heads)  # between tenants holding as many, the least recent

    def purge(self, now) -> int:
        gone = [e.id for e in self.entries.values() if e.expired(now)]
        for i in gone:
            del self.entries[i]
        return len(gone)

    # -- lifecycle
    def verify(self, eid, verified, now) -> bool:
        e = self.entries.get(eid)
        if e is None or e.expired(now):
            return False
        e.verified = verified
        return True

    def invalidate_id(self, eid, now) -> int | None:
        e = self.entries.get(eid)
        if e is None or e.expired(now):
            return None
        del self.entries[eid]
        return 1

    def invalidate_ns(self, ns, now) -> int:
        """Removes the namespace's entries; those past their TTL count as expired, the live
        ones as removed (the figure returned)."""
        gone = self.held(ns)
        for e in gone:
            del self.entries[e.id]
        expired = sum(1 for e in gone if e.expired(now))
        self.expired += expired
        return len(gone) - expired

    def flush(self) -> None:
        for e in self.entries.values():
            e.saved_hits, e.saved_last_hit = e.hit_count, e.last_hit_at

    def restart(self, limits: Limits, now: float, clean: bool) -> None:
        if clean:
            self.flush()
        self.limits = limits
        self.lookups, self.hits, self.near, self.evicted, self.expired = 0, {}, 0, 0, 0
        for e in self.entries.values():
            e.hit_count, e.last_hit_at = e.saved_hits, e.saved_last_hit
            # Stamped after now (the clock was behind at the start): now, TTL counted from it.
            e.created_at, e.last_hit_at = min(e.created_at, now), min(e.last_hit_at, now)
            e.saved_last_hit = e.last_hit_at
            e.used = max(e.created_at, e.last_hit_at)
            # Today's limits over the TTL as stored (not over the one a restart before cut).
            if e.stored_ttl > 0:
                e.ttl = min(e.stored_ttl, limits.max_ttl)
            else:
                e.ttl = limits.max_ttl if limits.default_ttl > 0 else 0
            e.stored_ttl = e.ttl  # cut for good: a later restart must not lengthen it
        self.expired = self.purge(now)
        for ns in {e.ns for e in self.entries.values()}:
            self._evict_ns(ns)
        for tenant in {e.ns.tenant for e in self.entries.values()}:
            self._evict_tenant(tenant)
        self._evict_total()


# ---- the driver -------------------------------------------------------------------------------

NAMESPACES = [Namespace(t, m, c) for t in ("t0", "t1", "t2") for m in ("m0", "m1")
              for c in ("", "ab")]


def _norm(ns: Namespace) -> Namespace:
    return Namespace(ns.tenant, ns.model_id, ns.context_hash.lower())


def _limits(rng: random.Random) -> Limits:
    default_ttl = rng.choice([0, 0, 20])
    return Limits(per_ns=rng.choice([2, 3, 5, 200_000]),
                  per_tenant=rng.choice([0, 0, 4, 7]),
                  total=rng.choice([5, 8, 12, 2_000_000]),
                  default_ttl=default_ttl, max_ttl=rng.choice([max(default_ttl, 1), 30, 100]))


class Run:
    """One seed: the real cache and the model, step by step."""

    def __init__(self, seed: int, folder, steps: int = 300) -> None:
        self.rng = random.Random(seed)
        self.seed, self.folder, self.steps = seed, folder, steps
        self.db = str(folder / "s.db")
        self.clock = Clock(1_000_000.0)
        self.emb = PairEmbedder()
        self.index_kw = dict(hnsw_min_entries=self.rng.choice([20000, 3]),
                             delta_capacity=self.rng.choice([2048, 2]), hnsw_m=8,
                             hnsw_ef_construction=40, hnsw_ef_search=64)
        self.model = Model(_limits(self.rng))
        self.nss = self.rng.sample(NAMESPACES, self.rng.choice([2, 3, 5]))
        self.ids: list[str] = []  # every id the cache ever gave
        self.cache = self._open(self.model.limits)
        self.log: list[str] = []

    def _open(self, lim: Limits, snapshot: str = "") -> SemanticCache:
        cfg = SemanticConfig(address="127.0.0.1:0", metrics_port=-1, db_path=self.db,
                             sqlite_synchronous="NORMAL", guard_tiers=(), verifier_tiers=(),
                             max_entries_per_namespace=lim.per_ns,
                             max_entries_per_tenant=lim.per_tenant,
                             max_entries_total=lim.total, default_ttl_seconds=lim.default_ttl,
                             max_ttl_seconds=lim.max_ttl, **self.index_kw)
        cfg.validate()
        c = SemanticCache(cfg, self.emb, EntryStore(self.db, "NORMAL"), self.clock)
        c.load(snapshot)
        return c

    def close(self) -> None:
        self.cache.close_indexes()
        self.cache.store.close()

    def fail(self, what: str) -> None:
        tail = "\n".join(self.log[-15:])
        raise AssertionError(f"seed {self.seed}, step {len(self.log)}: {what}\n{tail}")

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.fail(what)

    # -- steps
    def run(self) -> None:
        try:
            for _ in range(self.steps):
                self.step()
                self.compare()
        finally:
            self.close()

    def _tick(self) -> None:
        rng, now = self.rng, self.clock.t
        due = [e.expires_at() for e in self.model.entries.values()
               if now < e.expires_at() < math.inf]
        if due and rng.random() < 0.15:
            self.clock.t = rng.choice(due)  # exactly at an entry's expiry
        else:
            self.clock.t += rng.choice([0.25, 0.5, 1.0, 2.0, 5.0])

    def step(self) -> None:
        rng = self.rng
        self._tick()
        op = rng.choices(["store", "lookup", "verify", "invalidate", "invalidate_ns", "expire",
                          "flush", "restart", "bad"],
                         [30, 38, 7, 7, 2, 5, 3, 4, 4])[0]
        getattr(self, "op_" + op)()

    def _ns(self) -> Namespace:
        ns = self.rng.choice(self.nss)
        if ns.context_hash and self.rng.random() < 0.3:
            ns = ns._replace(context_hash=ns.context_hash.upper())  # the same namespace
        return ns

    def _some_id(self) -> str:
        live = list(self.model.entries)
        r = self.rng.random()
        if live and r < 0.7:
            return self.rng.choice(live)
        if self.ids and r < 0.95:
            return self.rng.choice(self.ids)
        return "0" * 32  # never given

    def op_store(self) -> None:
        ns, prompt = self._ns(), self.rng.choice(PROMPTS)
        verified = self.rng.random() < 0.2
        ttl = self.rng.choice([t for t in (0, 0, 3, 10, 25, self.model.limits.max_ttl)
                               if t <= self.model.limits.max_ttl])
        answer = f"answer {len(self.log)}"
        e = self.cache.store_entry(ns, prompt, answer, verified=verified, ttl_seconds=ttl)
        self.log.append(f"t={self.clock.t} store {ns} {prompt!r} v={verified} ttl={ttl} "
                        f"-> {e.id[:6]}")
        self.ids.append(e.id)
        self.check(e.answer == answer and e.namespace == _norm(ns), f"stored {e}")
        self.model.store(e.id, _norm(ns), prompt, answer, verified, ttl, self.clock.t)

    def op_lookup(self, ns: Namespace | None = None, text: str = "") -> None:
        rng = self.rng
        ns = ns or self._ns()
        held = [e.prompt for e in self.model.held(_norm(ns))]
        text = text or rng.choice(held if held and rng.random() < 0.5
                                  else PROMPTS + ["something else entirely"])
        tier = rng.choice(["", "strict", "standard", "relaxed"])
        threshold = rng.choice([0.0, 0.0, 0.0, FLOOR, 0.92, PARA_COS, 0.96, 1.0])
        want = rng.random() < 0.5
        r = self.cache.lookup(ns, text, tier=tier, threshold=threshold, want_draft=want)
        got = (r.hit, r.entry.id if r.entry else None, r.similarity, r.exact, r.threshold)
        self.log.append(f"t={self.clock.t} lookup {ns} {text!r} {tier or '-'} {threshold} "
                        f"draft={want} -> {got[0]} {got[1] and got[1][:6]} {got[2]:.4f} "
                        f"exact={got[3]}")
        want_ = self.model.lookup(_norm(ns), text, tier, threshold, want, self.clock.t)
        self.check(got[:2] == want_[:2] and got[3] == want_[3],
                   f"lookup: cache {got}, model {want_}")
        if want_[1] is not None or want_[0]:
            self.check(abs(got[2] - want_[2]) < 1e-5, f"similarity {got[2]} != {want_[2]}")
            self.check(abs(got[4] - want_[4]) < 1e-9, f"threshold {got[4]} != {want_[4]}")
            self.check(r.entry.prompt == self.model.entries[want_[1]].prompt, "entry")
        self.check(r.tier == (tier or "standard") and not r.guard_rejected, f"tier {r}")

    def op_verify(self) -> None:
        eid, flag = self._some_id(), self.rng.random() < 0.7
        try:
            e = self.cache.verify(eid, flag)
            got = True
            self.check(e.verified == flag and e.id == eid, f"verify returned {e}")
        except NotFound:
            got = False
        self.log.append(f"t={self.clock.t} verify {eid[:6]} {flag} -> {got}")
        want = self.model.verify(eid, flag, self.clock.t)
        self.check(got == want, f"verify: cache {got}, model {want}")

    def op_invalidate(self) -> None:
        eid = self._some_id()
        try:
            got = self.cache.invalidate_id(eid)
        except NotFound:
            got = None
        self.log.append(f"t={self.clock.t} invalidate {eid[:6]} -> {got}")
        want = self.model.invalidate_id(eid, self.clock.t)
        self.check(got == want, f"invalidate: cache {got}, model {want}")

    def op_invalidate_ns(self) -> None:
        ns = self._ns()
        got = self.cache.invalidate_namespace(ns)
        self.log.append(f"t={self.clock.t} invalidate_ns {ns} -> {got}")
        want = self.model.invalidate_ns(_norm(ns), self.clock.t)
        self.check(got == want, f"invalidate_namespace: cache {got}, model {want}")

    def op_expire(self) -> None:
        got = self.cache.expire()
        self.log.append(f"t={self.clock.t} expire -> {got}")
        want = self.model.purge(self.clock.t)
        self.model.expired += want
        self.check(got == want, f"expire: cache {got}, model {want}")

    def op_flush(self) -> None:
        self.cache.store.flush_hits()
        self.log.append(f"t={self.clock.t} flush")
        self.model.flush()

    def op_restart(self) -> None:
        rng = self.rng
        clean = rng.random() < 0.7
        lim = self.model.limits if rng.random() < 0.6 else _limits(rng)
        snapshot = ""
        if clean and rng.random() < 0.5:
            snapshot = str(self.folder / "s.db.hnsw")
            self.cache.save_snapshot(snapshot)
        if not clean:  # a kill -9: the hits buffered since the last flush are lost
            with self.cache.store._hits_lock:
                self.cache.store._pending_hits.clear()
        self.close()
        stamps = sorted({s for e in self.model.entries.values()
                         for s in (e.created_at, e.last_hit_at if clean else e.saved_last_hit)
                         if s})  # 0: never hit
        if len(stamps) >= 2 and rng.random() < 0.2:
            # The wall clock read again at the start is behind the newest stamp (a correction
            # of the clock): that row's times are clamped to now. Between the two newest
            # stamps, so that one entry is (no two entries tie in LRU order).
            self.clock.t = (stamps[-2] + stamps[-1]) / 2
        self.cache = self._open(lim, snapshot)
        self.log.append(f"t={self.clock.t} restart clean={clean} snapshot={bool(snapshot)} "
                        f"{lim}")
        self.model.restart(lim, self.clock.t, clean)
        if rng.random() < 0.3:  # every (namespace, prompt): served exactly what is held
            for ns in self.nss:
                for text in PROMPTS:
                    self.clock.t += 0.25  # one use at a time: no two tie in LRU order
                    self.op_lookup(ns, text)
                    self.compare()

    def op_bad(self) -> None:
        """Refused calls change nothing (and are not counted)."""
        with pytest.raises(InvalidArgument):
            if self.rng.random() < 0.5:
                self.cache.lookup(self._ns(), BASES[0], tier="loose")
            else:
                self.cache.store_entry(self._ns(), BASES[0], "x",
                                       ttl_seconds=self.model.limits.max_ttl + 1)
        self.log.append(f"t={self.clock.t} refused call")

    # -- comparison
    def compare(self) -> None:
        c, m = self.cache, self.model
        s = c.stats()
        want = dict(entries=len(m.entries), namespaces=len({e.ns for e in m.entries.values()}),
                    lookups_total=m.lookups, near_misses_total=m.near,
                    guard_rejections_total=0, evictions_total=m.evicted,
                    expirations_total=m.expired)
        got = {k: getattr(s, k) for k in want}
        self.check(got == want, f"stats: cache {got}, model {want}")
        hits = {k: v for k, v in s.hits_by_tier.items() if v}
        self.check(hits == m.hits, f"hits_by_tier: cache {hits}, model {m.hits}")
        self.check(c.store.count() == len(m.entries), "SQLite rows != entries held")
        for e in m.entries.values():
            try:
                ce = c.get(e.id)
            except NotFound:
                self.fail(f"entry {e.id[:6]} ({e.prompt!r} in {e.ns}) is not held")
            fields = (ce.namespace, ce.prompt, ce.answer, ce.verified, ce.created_at,
                      ce.ttl_seconds, ce.hit_count, ce.last_hit_at)
            model = (e.ns, e.prompt, e.answer, e.verified, e.created_at, e.ttl, e.hit_count,
                     e.last_hit_at)
            self.check(fields == model, f"entry {e.id[:6]}: cache {fields}, model {model}")
        gone = set(self.ids) - set(m.entries)
        for eid in gone:
            with pytest.raises(NotFound):
                c.get(eid)
        c.check_integrity()


SEEDS = (*range(10), 14, 32, 141, 178, 185, 211)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_cache_agrees_with_the_model_of_its_rules(seed, tmp_path):
    """Every answer, count and entry after every step is the model's (see the module
    docstring for the rules)."""
    Run(seed, tmp_path).run()
