"""A differential test of the semantic cache under concurrency: seeded rounds of calls from
several threads at once (Store, replacing Stores, Lookup, Verify, Invalidate by id and by
namespace, expiry, hit flushes), released together by a barrier, each round checked against the
reference model of test_cache_differential.

After every round some order of the round's calls, consistent with their real-time order (a
call that returned before another began comes first), must give every call's answer (hit /
draft / miss and which entry, its prompt and answer, counts, NOT_FOUND) and the state the cache
holds afterwards: every entry's fields, each namespace's LRU order, the Stats counters, the
SQLite row count and `check_integrity`. A clean restart over the same SQLite from time to time
must serve exactly what memory held.

What that order may hold, by the cache's documented rules (`SemanticCache._removal`,
`store_entry`):
- an Invalidate by id of an entry unknown or expired (not yet purged) is NOT_FOUND;
- an Invalidate reads its entries, then removes them: between the two a Store replacing one
  of them cannot fall (it waits for the Invalidate), while expiry and evictions may take one
  and count it (the Invalidate then counts only what it removed);
- an expiry takes the due entries off its heap, then removes them: between the two a Store
  past capacity counts them as gone (it evicts none of them and no live entry in their
  place), an Invalidate or a replacing Store may take one (and count it);
- a Store of a prompt another Store wrote at the same time, committed before it but reaching
  memory later, leaves the later answer standing and returns that entry: it changes nothing.

The clock stands still within a round (it moves between rounds, at times exactly to an
entry's expiry): what is expired is the same for every call of a round.
"""

from __future__ import annotations

import copy
import itertools
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from services.common.errors import NotFound
from tests.semantic.test_cache_differential import (
    PROMPTS,
    Limits,
    MEntry,
    Model,
    Run,
    _norm,
)

THREAD_TIMEOUT_S = 20  # one round's calls; they take milliseconds


class CModel(Model):
    """The sequential model, with uses ordered by a counter: calls of one round share a clock
    reading, and LRU order is then the order of the uses."""

    seq: int = 0

    def _use(self, now: float) -> tuple:
        self.seq += 1
        return (now, 0, self.seq)

    def store(self, eid, ns, prompt, answer, verified, ttl, now, going=frozenset()) -> None:
        """`going`: the entries expiries under way took; they count as gone (those expiries
        drop them)."""
        old = self.by_prompt(ns, prompt)
        if old is not None:
            del self.entries[old.id]
        ttl = ttl or self.limits.default_ttl
        self.entries[eid] = MEntry(eid, ns, prompt, answer, verified, now, ttl, ttl,
                                   used=self._use(now))
        aside = {k: self.entries.pop(k) for k in going if k in self.entries}
        if self._over(ns):
            self.expired += self.purge(now)
        self._evict(ns)
        self.entries.update(aside)

    def _hit(self, e: MEntry, now: float, key: str) -> None:
        """Counted at once; the entry is marked used by `touch`, a step of its own."""
        self.hits[key] = self.hits.get(key, 0) + 1

    def touch(self, eid: str, now: float) -> None:
        """A hit's use of its entry, unless the entry is gone by then (it is still served)."""
        e = self.entries.get(eid)
        if e is not None:
            e.hit_count += 1
            e.last_hit_at, e.used = now, self._use(now)


@dataclass
class Call:
    """One call of a round and what the cache answered."""

    thread: int
    kind: str
    args: tuple
    result: object = None
    start: int = 0
    end: int = 0


@dataclass
class Search:
    """A partial order of a round's calls (see `Checker`)."""

    model: CModel
    done: frozenset = frozenset()  # finished calls (an Invalidate or a hit: both halves)
    # Call index -> what its first half read: an Invalidate's ids, a hit's entry.
    reading: dict = field(default_factory=dict)


class Checker:
    """Finds an order of a round's calls that the model agrees with, the cache's state after
    the round included. Two calls come in halves: an Invalidate reads what it removes, then
    removes it (`_removal`); a Lookup finds its hit, then marks it used (`_touch`: an entry
    removed in between is still served); an expiry takes the due entries off its heap, then
    removes them (a Store past capacity, an Invalidate may take one in between)."""

    def __init__(self, calls: list[Call], now: float, final: dict) -> None:
        self.calls, self.now, self.final = calls, now, final
        self.before = {i: {j for j, d in enumerate(calls) if d.end < c.start}
                       for i, c in enumerate(calls)}
        self.nodes = 0
        self.leaves: list[dict] = []  # with `final` None: the states of orders giving answers
        self.longest: tuple = ()  # the longest order of steps giving their answers

    def find(self, model: CModel) -> CModel | None:
        return self._dfs(Search(model))

    def _dfs(self, s: Search, path: tuple = ()) -> CModel | None:
        self.nodes += 1
        if len(path) > len(self.longest):
            self.longest = path
        if self.nodes > 200_000:
            raise AssertionError("search too large")
        if len(s.done) == len(self.calls):
            if self.final is None:
                self.leaves.append(snapshot(s.model))
                return None
            return s.model if snapshot(s.model) == self.final else None
        for i, c in enumerate(self.calls):
            if i in s.done or not self.before[i] <= s.done:
                continue
            if c.kind.startswith("invalidate") and i not in s.reading:
                nxt = self._read(s, i, c)
            elif c.kind == "expire" and i not in s.reading:
                nxt = self._expiring(s, i)
            elif c.kind == "lookup" and i not in s.reading:
                nxt = self._lookup(s, i, c)
            else:
                nxt = self._apply(s, i, c)
            step = (i, "read" if i in nxt.reading else "") if nxt is not None else ()
            if nxt is not None and (found := self._dfs(nxt, (*path, step))) is not None:
                return found
        return None

    def _read(self, s: Search, i: int, c: Call) -> Search | None:
        m = s.model
        if c.kind == "invalidate_id":
            e = m.entries.get(c.args[0])
            if e is None or e.expired(self.now):  # NOT_FOUND (expired: left to the purge)
                if c.result is not None:
                    return None
                return Search(copy.deepcopy(m), s.done | {i}, s.reading)
            read = {e.id}
        else:
            read = {e.id for e in m.held(_norm(c.args[0]))}
        return Search(copy.deepcopy(m), s.done, {**s.reading, i: read})

    def _expiring(self, s: Search, i: int) -> Search:
        """What an expiry takes off its heap: the expired entries no other expiry under way
        took (a frozenset: a Store does not wait for it)."""
        taken = set().union(*(r for r in s.reading.values() if isinstance(r, frozenset)))
        due = frozenset(e.id for e in s.model.entries.values()
                        if e.expired(self.now) and e.id not in taken)
        return Search(copy.deepcopy(s.model), s.done, {**s.reading, i: due})

    def _lookup(self, s: Search, i: int, c: Call) -> Search | None:
        m = copy.deepcopy(s.model)
        ns, text, tier, threshold, want = c.args
        hit, eid, sim, exact, th = m.lookup(_norm(ns), text, tier, threshold, want, self.now)
        got = c.result
        if (got.hit, got.entry.id if got.entry else None) != (hit, eid):
            return None
        # A lookup that began before its text's entry was stored finds it by a search, at
        # similarity 1 (`exact` says which way it was found).
        if got.exact and not exact:
            return None
        if eid is not None:
            e = m.entries[eid]
            if (got.entry.prompt, got.entry.answer, got.entry.namespace) != (
                    e.prompt, e.answer, e.ns):
                return None  # another entry's answer, or another namespace's
            if abs(got.similarity - sim) > 1e-5 or abs(got.threshold - th) > 1e-9:
                return None
        if hit:
            return Search(m, s.done, {**s.reading, i: eid})
        return Search(m, s.done | {i}, s.reading)

    def _apply(self, s: Search, i: int, c: Call) -> Search | None:
        m = copy.deepcopy(s.model)
        reading = s.reading
        now = self.now
        if c.kind == "lookup":
            m.touch(reading[i], now)
            reading = {k: v for k, v in reading.items() if k != i}
        elif c.kind.startswith("invalidate"):
            read = reading[i]
            reading = {k: v for k, v in reading.items() if k != i}
            gone = [e for e in (m.entries.pop(eid, None) for eid in read) if e is not None]
            n = len(gone)
            if c.kind == "invalidate_ns":  # those past their TTL are counted expired
                expired = sum(1 for e in gone if e.expired(now))
                m.expired += expired
                n -= expired
            if c.result != n:
                return None
        elif c.kind == "store":
            ns, prompt, answer, verified, ttl = c.args
            ns = _norm(ns)
            e = c.result
            if e.answer != answer:  # overtaken by a Store of the same prompt: no change
                if (e.namespace, e.prompt) != (ns, prompt):
                    return None
                return Search(m, s.done | {i}, reading)
            old = m.by_prompt(ns, prompt)
            if old is not None and any(isinstance(r, set) and old.id in r
                                       for r in reading.values()):
                return None  # waits for the Invalidate that read what it replaces
            going = set().union(*(r for r in reading.values() if isinstance(r, frozenset)))
            m.store(e.id, ns, prompt, answer, verified, ttl, now, going)
        elif c.kind == "verify":
            eid, flag = c.args
            if m.verify(eid, flag, now) != c.result:
                return None
        elif c.kind == "expire":
            n = sum(1 for eid in reading[i] if m.entries.pop(eid, None) is not None)
            reading = {k: v for k, v in reading.items() if k != i}
            m.expired += n
            if n != c.result:
                return None
        elif c.kind != "flush":  # a flush changes nothing a clean restart would not
            raise AssertionError(c.kind)
        return Search(m, s.done | {i}, reading)


def snapshot(m: CModel) -> dict:
    """What the model holds, in the form `held` reads the cache in."""
    entries = {e.id: (e.ns, e.prompt, e.answer, e.verified, e.created_at, e.ttl, e.hit_count,
                      e.last_hit_at) for e in m.entries.values()}
    lru = {}
    for ns in {e.ns for e in m.entries.values()}:
        lru[ns] = [e.id for e in sorted(m.held(ns), key=lambda e: e.used)]
    tenants = {}
    for t in {e.ns.tenant for e in m.entries.values()}:
        tenants[t] = [e.id for e in sorted(m.entries.values(), key=lambda e: e.used)
                      if e.ns.tenant == t]
    hits = {k: v for k, v in m.hits.items() if v}
    return dict(entries=entries, lru=lru, tenants=tenants, hits=hits,
                stats=(m.lookups, m.near, m.evicted, m.expired))


def held(run: Run) -> dict:
    c = run.cache
    with c._lock:
        entries = {e.id: (e.namespace, e.prompt, e.answer, e.verified, e.created_at,
                          e.ttl_seconds, e.hit_count, e.last_hit_at)
                   for e in c._entries.values()}
        lru = {ns: [c._entries[lab].id for lab in order] for ns, order in c._ns_lru.items()}
        tenants = {t: [c._entries[lab].id for lab in order]
                   for t, order in c._tenant_lru.items()}
    s = c.stats()
    hits = {k: v for k, v in s.hits_by_tier.items() if v}
    return dict(entries=entries, lru=lru, tenants=tenants, hits=hits,
                stats=(s.lookups_total, s.near_misses_total, s.evictions_total,
                       s.expirations_total))


@contextmanager
def fine_switching():
    """Threads switch every few microseconds: many more interleavings per round."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class ConcurrentRun(Run):
    """One seed: rounds of concurrent calls against the real cache, each checked."""

    def __init__(self, seed: int, folder, rounds: int = 40) -> None:
        super().__init__(seed, folder, steps=0)
        lim = self.model.limits
        # Global capacity off: its choice between tenants ties on clock readings shared by a
        # round's calls (ordered by label), where the model orders uses by a counter.
        self.model = CModel(Limits(lim.per_ns, lim.per_tenant, 2_000_000, lim.default_ttl,
                                   lim.max_ttl))
        self.cache.close_indexes()
        self.cache.store.close()
        self.cache = self._open(self.model.limits)
        self.rounds = rounds
        self.seq = itertools.count()
        self.rounds_run = 0

    def run(self) -> None:
        try:
            with fine_switching():
                for _ in range(self.rounds):
                    self._tick()
                    self.round()
                    if self.rng.random() < 0.12:
                        self.restart()
        finally:
            self.close()

    def _plan(self) -> list[list[tuple]]:
        rng = self.rng
        threads = rng.choice([2, 3, 3, 4])
        plan = []
        for _ in range(threads):
            calls = []
            for _ in range(rng.choice([1, 1, 2, 2, 3])):
                op = rng.choices(["store", "lookup", "verify", "invalidate_id",
                                  "invalidate_ns", "expire", "flush"],
                                 [34, 30, 8, 10, 6, 7, 5])[0]
                calls.append(self._args(op))
            plan.append(calls)
        return plan

    def _args(self, op: str) -> tuple:
        rng, lim = self.rng, self.model.limits
        # Few prompts, so that Stores of a round replace each other and what others read.
        prompts = PROMPTS[:2] + PROMPTS[6:8]
        if op == "store":
            ttl = rng.choice([t for t in (0, 0, 3, 10, lim.max_ttl) if t <= lim.max_ttl])
            return op, (self._ns(), rng.choice(prompts), f"answer {next(self.seq)}",
                        rng.random() < 0.2, ttl)
        if op == "lookup":
            return op, (self._ns(), rng.choice(prompts + ["something else"]),
                        rng.choice(["", "strict", "relaxed"]),
                        rng.choice([0.0, 0.0, 0.92]), rng.random() < 0.5)
        if op == "verify":
            return op, (self._some_id(), rng.random() < 0.7)
        if op == "invalidate_id":
            return op, (self._some_id(),)
        if op == "invalidate_ns":
            return op, (self._ns(),)
        return op, ()

    def _call(self, kind: str, args: tuple):
        c = self.cache
        try:
            if kind == "store":
                ns, prompt, answer, verified, ttl = args
                return c.store_entry(ns, prompt, answer, verified=verified, ttl_seconds=ttl)
            if kind == "lookup":
                ns, text, tier, threshold, want = args
                return c.lookup(ns, text, tier=tier, threshold=threshold, want_draft=want)
            if kind == "verify":
                e = c.verify(*args)
                return e.verified == args[1] and e.id == args[0]
            if kind == "invalidate_id":
                return c.invalidate_id(*args)
            if kind == "invalidate_ns":
                return c.invalidate_namespace(*args)
            if kind == "expire":
                return c.expire()
            c.store.flush_hits()
            return None
        except NotFound:
            return False if kind == "verify" else None

    def round(self) -> None:
        plan = self._plan()
        barrier = threading.Barrier(len(plan))
        calls = [Call(t, kind, args) for t, mine in enumerate(plan) for kind, args in mine]
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                barrier.wait(THREAD_TIMEOUT_S)
                for call in calls:
                    if call.thread == t:
                        call.start = next(self.seq)
                        call.result = self._call(call.kind, call.args)
                        call.end = next(self.seq)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,), daemon=True)
                   for t in range(len(plan))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(THREAD_TIMEOUT_S)
        self.rounds_run += 1
        if any(th.is_alive() for th in threads):
            self.fail(f"a call of round {self.rounds_run} did not return: {calls}")
        if errors:
            self.fail(f"round {self.rounds_run} raised {errors[0]!r}: {calls}")
        for call in calls:
            if call.kind == "store":
                self.ids.append(call.result.id)
        text = ", ".join(f"[{c.thread}] {c.kind}{c.args} -> {_shown(c.result)} "
                         f"({c.start}-{c.end})" for c in calls)
        self.log.append(f"t={self.clock.t} round {self.rounds_run}: {text}")
        final = held(self)
        found = Checker(calls, self.clock.t, final).find(self.model)
        if found is None:
            answers = Checker(calls, self.clock.t, None)
            answers.find(self.model)
            diffs = [{k: (final[k], leaf[k]) for k in final if final[k] != leaf[k]}
                     for leaf in answers.leaves[:3]]
            self.fail(f"no order of round {self.rounds_run}'s calls gives their answers and "
                      f"the state held; {len(answers.leaves)} orders give the answers, their "
                      f"states differ from the cache's (cache, order) in: {diffs}; the "
                      f"longest order giving answers: {answers.longest}\n"
                      f"model before {snapshot(self.model)}")
        self.model = found
        self.compare()

    def restart(self) -> None:
        self.cache.save_snapshot(str(self.folder / "s.db.hnsw"))
        self.close()
        self.cache = self._open(self.model.limits, str(self.folder / "s.db.hnsw"))
        self.log.append(f"t={self.clock.t} clean restart")
        self.model.restart(self.model.limits, self.clock.t, clean=True)
        got = held(self)
        # LRU order at load is by last use; uses of one round tie on the clock, and their
        # order among themselves is not kept: the model takes the cache's.
        for order in got["tenants"].values():
            stamps = [self.model.entries[eid].used for eid in order if eid in self.model.entries]
            self.check(stamps == sorted(stamps), f"restart: LRU order {order} not by last use")
            for n, eid in enumerate(order):
                if eid in self.model.entries:
                    e = self.model.entries[eid]
                    e.used = (e.used, 0, n)  # before any round's uses
        want = snapshot(self.model)
        self.check(got == want, f"restart: cache {got}, model {want}")
        self.compare()


def _shown(r: object) -> str:
    if r is None or isinstance(r, bool | int):
        return str(r)
    if hasattr(r, "hit"):
        return f"hit={r.hit} {r.entry.id[:6] if r.entry else None}"
    return f"{r.id[:6]} {r.answer!r}"


SEEDS = range(16)


@pytest.mark.parametrize("seed", SEEDS)
def test_concurrent_calls_agree_with_some_order_of_them(seed, tmp_path):
    """After every round of calls from several threads at once, some order of them consistent
    with their real-time order gives every answer and the state held (the module docstring
    says what that order may hold)."""
    run = ConcurrentRun(seed, tmp_path)
    run.run()
