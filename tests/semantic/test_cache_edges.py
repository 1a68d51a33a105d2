"""SemanticCache edge cases that need exact similarities: a fake embedder with chosen vectors.

The cache's candidate loop, expiry and load are pure logic over the vectors they are given,
so these tests place entries at exact cosines instead of hunting for sentences that land there.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

import numpy as np
import pytest

from services.common.errors import DeadlineExceeded, NotFound
from services.semantic import cache as cache_mod
from services.semantic.cache import Namespace, SemanticCache
from services.semantic.index import IndexParams, NamespaceIndex
from services.semantic.store import EntryStore
from tests.metric_sample import sample_value
from tests.waits import holds_within

DIM = 16
A = Namespace("tenant-a", "smollm2", "")
B = Namespace("tenant-b", "smollm2", "")


class FixedEmbedder:
    """Each text's vector is given by the test (or derived from its hash)."""

    name = identity = "fixed@test"
    dim = DIM

    def __init__(self) -> None:
        self.fixed: dict[str, np.ndarray] = {}

    def at(self, text: str, cos: float, axis: int) -> None:
        """Places `text` at cosine `cos` to the query direction e0, off along `axis`."""
        v = np.zeros(DIM, np.float32)
        v[0], v[axis] = cos, np.sqrt(1.0 - cos * cos)
        self.fixed[text] = v

    def embed_one(self, text: str) -> np.ndarray:
        if text in self.fixed:
            return self.fixed[text]
        rng = np.random.default_rng(abs(hash(text)) % 2**32)
        v = rng.standard_normal(DIM).astype(np.float32)
        v[0] = 0.0  # far from the query direction
        return v / np.linalg.norm(v)

    def embed(self, texts: list[str]) -> np.ndarray:
        return (np.stack([self.embed_one(t) for t in texts]) if texts
                else np.zeros((0, DIM), np.float32))


@pytest.fixture
def emb() -> FixedEmbedder:
    e = FixedEmbedder()
    e.at("query", 1.0, 1)
    return e


@pytest.fixture
def make_cache(cache_factory, emb):
    def make(**kw) -> SemanticCache:
        kw.setdefault("guard_tiers", ())
        kw.setdefault("verifier_tiers", ())
        return cache_factory(emb, **kw)

    return make


def test_expired_neighbours_do_not_hide_a_live_hit(make_cache, emb, clock):
    """Four nearer entries past their TTL, not yet removed by the housekeeper, sit in front of
    a live one at 0.98: the lookup must look past them."""
    c = make_cache()
    for i in range(4):
        emb.at(f"short-lived {i}", 0.999 - 0.001 * i, 2 + i)
        c.store_entry(A, f"short-lived {i}", f"old {i}", ttl_seconds=60)
    emb.at("long-lived", 0.98, 8)
    c.store_entry(A, "long-lived", "live answer", ttl_seconds=3600)
    clock.t += 61
    r = c.lookup(A, "query", tier="relaxed")
    assert r.hit and r.entry.answer == "live answer"
    assert r.similarity == pytest.approx(0.98, abs=1e-4)


def test_unverified_near_misses_do_not_hide_a_verified_hit(make_cache, emb):
    """Standard tier: 0.95, or 0.93 for a verified entry. Four unverified entries between the
    two thresholds come first; the verified one at 0.94 behind them is a hit."""
    c = make_cache()
    for i in range(4):
        emb.at(f"unverified {i}", 0.948 - 0.002 * i, 2 + i)
        c.store_entry(A, f"unverified {i}", f"draft {i}")
    emb.at("verified", 0.94, 8)
    e = c.store_entry(A, "verified", "checked answer", verified=True)
    r = c.lookup(A, "query", tier="standard", want_draft=True)
    assert r.hit and r.entry.id == e.id
    c.verify(e.id, False)
    r = c.lookup(A, "query", tier="standard", want_draft=True)
    assert not r.hit and r.entry.answer == "draft 0"  # the nearest one, as a draft


def test_a_lookup_stops_fetching_once_nothing_further_can_hit(make_cache, emb, monkeypatch):
    """Neighbours are fetched in growing rounds only while they could still be hits."""
    c = make_cache()
    for i in range(6):
        emb.at(f"near miss {i}", 0.90 - 0.01 * i, 2 + i)
        c.store_entry(A, f"near miss {i}", f"a {i}")
    asked: list[int] = []
    index = c.index_of(A)
    real = index.search
    monkeypatch.setattr(index, "search", lambda vec, k=1: asked.append(k) or real(vec, k))
    r = c.lookup(A, "query", tier="standard", want_draft=True)
    assert not r.hit and r.entry.answer == "a 0"
    assert asked == [cache_mod._CANDIDATES]  # 0.90 < 0.93: the first round settles it


def test_a_failed_expiry_delete_is_retried_on_the_next_tick(make_cache, emb, clock,
                                                           monkeypatch):
    c = make_cache()
    for i in range(3):
        c.store_entry(A, f"question {i}", f"answer {i}", ttl_seconds=60)
    c.store_entry(A, "kept", "kept answer", ttl_seconds=86_400)
    clock.t += 61
    real = c.store.delete
    calls = {"n": 0}

    def failing_once(labels, committed=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("disk full")
        return real(labels, committed)

    monkeypatch.setattr(c.store, "delete", failing_once)
    with pytest.raises(OSError):
        c.expire()
    assert c.stats().entries == 4
    assert c.expire() == 3
    assert c.stats().entries == 1 and c.store.count() == 1
    c.check_integrity()


class _FullWhenDeleting:
    """The store's connection, but deleting `label`'s row fails as SQLite does on a full
    disk (the transaction holding it rolls back)."""

    def __init__(self, db, label: int) -> None:
        self.db, self.label = db, label

    def executemany(self, sql: str, params):
        params = list(params)
        if sql.startswith("DELETE") and (self.label,) in params:
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.executemany(sql, params)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


def _fail_deleting(c: SemanticCache, label: int) -> None:
    c.store._db = _FullWhenDeleting(c.store._db, label)


def _disk_freed(c: SemanticCache) -> None:
    c.store._db = c.store._db.db


def test_a_namespace_invalidation_failing_part_way_serves_no_row_already_deleted(
        make_cache, monkeypatch):
    """A full disk after the first chunk (a namespace over 5,000 entries) left the rows it had
    deleted from SQLite served from memory until the next restart, though they were gone
    from disk: the index and SQLite disagreed, and a restart changed the answers."""
    from services.common.errors import ResourceExhausted
    from services.semantic import store as store_mod

    monkeypatch.setattr(store_mod, "WRITE_CHUNK", 2)
    c = make_cache()
    for i in range(5):
        c.store_entry(A, f"question {i}", f"answer {i}")
    order = list(c._ns_lru[A])  # the order the invalidation deletes in
    _fail_deleting(c, order[2])  # the second chunk fails
    with pytest.raises(ResourceExhausted, match="full"):
        c.invalidate_namespace(A)
    left = {r.label for rows in c.store.iter_all() for r in rows}
    assert left == set(order[2:])  # the first chunk is gone from SQLite...
    assert c.stats().entries == 3  # ...and from memory
    for lab in order[:2]:
        gone = c._entries.get(lab)
        assert gone is None
    c.check_integrity()
    _disk_freed(c)
    assert c.invalidate_namespace(A) == 3  # a retry removes the rest
    assert c.stats().entries == 0 and c.store.count() == 0
    c.check_integrity()


def test_an_expiry_failing_part_way_drops_what_it_deleted_and_retries_the_rest(
        make_cache, clock, monkeypatch):
    from services.common.errors import ResourceExhausted
    from services.semantic import store as store_mod

    monkeypatch.setattr(store_mod, "WRITE_CHUNK", 2)
    c = make_cache()
    for i in range(4):
        c.store_entry(A, f"question {i}", f"answer {i}", ttl_seconds=60)
    c.store_entry(A, "kept", "kept answer", ttl_seconds=86_400)
    clock.t += 61
    due = sorted(c._expiry_heap)[:4]
    _fail_deleting(c, due[2][1])
    counted = sample_value("tiercache_semantic_expirations_total") or 0.0
    with pytest.raises(ResourceExhausted):
        c.expire()
    assert c.stats().entries == 3 and c.store.count() == 3
    # The two deleted are counted as expired, and only the two left are due again.
    assert sample_value("tiercache_semantic_expirations_total") == counted + 2
    assert sorted(c._expiry_heap)[:2] == due[2:] and len(c._expiry_heap) == 3
    c.check_integrity()
    _disk_freed(c)
    assert c.expire() == 2
    assert c.stats().entries == 1 and c.store.count() == 1
    assert c.stats().expirations_total == 4
    c.check_integrity()


class NoScan(dict):
    """The cache's entry map, refusing to be walked while armed: expiry must not touch every
    entry."""

    armed = True

    def _walk(name: str):
        def method(self, *a):
            assert not self.armed, "expire() walked every entry"
            return getattr(dict, name)(self, *a)

        return method

    copy, items, values, keys, __iter__ = map(_walk, ("copy", "items", "values", "keys",
                                                      "__iter__"))


def test_expiry_pops_only_what_is_due_however_many_entries_are_held(make_cache, clock):
    """Once entries expired under steady traffic the next expiry was always seconds away, and
    every tick copied and walked every entry under the cache lock (2M entries: seconds)."""
    c = make_cache()
    for i in range(300):
        c.store_entry(A, f"long-lived {i}", "kept", ttl_seconds=86_400)
    for i in range(3):
        c.store_entry(B, f"short-lived {i}", "gone", ttl_seconds=60)
    c.store_entry(A, "never expires", "kept")
    clock.t += 30
    c._entries = NoScan(c._entries)
    assert c.expire() == 0 and c._expiry_examined == 0
    clock.t += 31
    c.store_entry(A, "stored later", "kept", ttl_seconds=86_400)
    assert c.expire() == 3 and c._expiry_examined == 3
    assert c.expire() == 0 and c._expiry_examined == 3
    c._entries.armed = False
    assert c.stats().entries == 302 and c.store.count() == 302
    assert c.lookup(A, "long-lived 7").hit  # a hit does not extend its TTL
    clock.t += 86_400 - 61  # day-long entries stored at t
    assert c.expire() == 300 and c._expiry_examined == 303
    clock.t += 61  # and the one stored at t+61
    assert c.expire() == 1 and c._expiry_examined == 304
    assert [e.prompt for e in c._entries.values()] == ["never expires"]
    c.check_integrity()


def test_items_of_entries_removed_otherwise_do_not_pile_up(make_cache, clock, monkeypatch):
    """Evicted, replaced and invalidated entries leave their expiry items behind: once they
    outnumber the entries they are compacted away, and expiry still works."""
    monkeypatch.setattr(cache_mod, "_EXPIRY_HEAP_SLACK", 10)
    c = make_cache(max_entries_per_namespace=5)
    for i in range(200):  # 195 evicted
        c.store_entry(A, f"question {i}", "x", ttl_seconds=3600 + i)
    for _ in range(3):
        c.store_entry(B, "replaced", "again", ttl_seconds=60)
    assert c.expire() == 0
    assert len(c._expiry_heap) <= 2 * c.stats().entries + 10
    assert sorted(lab for _, lab in c._expiry_heap) == sorted(c._entries)
    clock.t += 60
    assert c.expire() == 1 and c.stats().entries == 5
    clock.t += 3600 + 200
    assert c.expire() == 5 and c.stats().entries == 0
    c.check_integrity()


def test_load_does_not_bring_back_an_answer_replaced_by_one_that_expired(
        make_cache, make_cfg, emb, clock):
    """A replacing Store killed between committing its row and deleting the old one; by the
    restart the newer row has expired. The older answer was replaced: it must not return."""
    c = make_cache()
    q = "How long does a passport renewal take?"
    emb.at(q, 1.0, 1)
    c.store_entry(A, q, "Six weeks.", ttl_seconds=86_400)
    clock.t += 5
    c.store.insert(id="crashed-replacement", tenant=A.tenant, model_id=A.model_id,
                   context_hash=A.context_hash, prompt=q, answer="Ten weeks.",
                   embedding=emb.embed_one(q), embed_model=c._embed_id, verified=False,
                   created_at=clock.t, ttl_seconds=60)
    c.store.close()
    clock.t += 120
    cfg = make_cfg(guard_tiers=(), verifier_tiers=())
    again = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        assert again.load() == 0
        r = again.lookup(A, q, want_draft=True)
        assert not r.hit and r.entry is None
        assert again.store.count() == 0
    finally:
        again.store.close()


def test_load_counts_what_it_evicts_and_expires(make_cache, make_cfg, emb, clock):
    c = make_cache()
    c.store_entry(A, "expiring", "x", ttl_seconds=60)
    for i in range(3):
        c.store_entry(A, f"question {i}", f"answer {i}", ttl_seconds=86_400)
    c.store.close()
    clock.t += 61
    cfg = make_cfg(guard_tiers=(), verifier_tiers=(), max_entries_per_namespace=2)
    again = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        assert again.load() == 2
        s = again.stats()
        assert (s.evictions_total, s.expirations_total) == (1, 1)
    finally:
        again.store.close()


def test_load_logs_what_it_loaded_expired_evicted_and_replaced(make_cache, make_cfg, emb,
                                                               clock, caplog):
    """The start's summary line counts each way a row was left out: expired, over a lowered
    limit, replaced by a newer answer (a replacing Store killed between its two writes). The
    evicted are the least recently used of the namespace over its limit."""
    c = make_cache()
    for i in range(3):  # three expired, two over capacity, one replaced: each count its own
        c.store_entry(A, f"expiring {i}", "x", ttl_seconds=60)
    for i in range(4):
        clock.t += 1
        c.store_entry(A, f"question {i}", f"answer {i}", ttl_seconds=86_400)
    c.store_entry(B, "other", "y", ttl_seconds=86_400)
    clock.t += 1
    c.store.insert(id="crashed-replacement", tenant=B.tenant, model_id=B.model_id,
                   context_hash=B.context_hash, prompt="other", answer="z",
                   embedding=emb.embed_one("other"), embed_model=c._embed_id, verified=False,
                   created_at=clock.t, ttl_seconds=86_400)
    c.store.close()
    clock.t += 61
    cfg = make_cfg(guard_tiers=(), verifier_tiers=(), max_entries_per_namespace=2)
    again = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        with caplog.at_level(logging.INFO, logger="services.semantic.cache"):
            caplog.clear()  # the first cache's load line, where a test before left INFO on
            assert again.load() == 3
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded")] \
            == ["loaded 3 entries in 2 namespaces (3 expired, 2 over capacity, 1 replaced by a "
                "newer answer to the same prompt; 0 HNSW graphs taken from the snapshot, not "
                "built)"]
        assert sorted(e.prompt for e in again._entries.values()) == [
            "other", "question 2", "question 3"]
        assert again.lookup(B, "other").entry.answer == "z"
        again.check_integrity()
    finally:
        again.store.close()


def test_invalidating_a_large_namespace_lets_lookups_through_between_chunks(
        make_cache, emb, monkeypatch):
    """Removing a namespace's entries from memory takes the cache lock a chunk at a time, so a
    lookup elsewhere waits for one chunk, not for the whole namespace."""
    c = make_cache()
    for i in range(200):
        c.store_entry(A, f"question {i}", f"answer {i}")
    emb.at("other", 0.99, 2)
    c.store_entry(B, "other", "other answer")
    monkeypatch.setattr(cache_mod, "_DROP_CHUNK", 20, raising=False)
    started = threading.Event()  # the invalidation has dropped its first chunk
    looked = threading.Event()  # the lookup has returned
    real = c._drop_locked
    dropped = [0]

    def counting_drop(label):
        dropped[0] += 1
        return real(label)

    class GateLock:
        """The cache's lock; once the invalidating thread has let go of it after its first
        chunk, that thread waits (outside the lock) until the lookup has returned. No timing
        involved: had the whole namespace been dropped under one hold of the lock, the lookup
        could not run before the invalidation ended."""

        def __init__(self, inner) -> None:
            self.inner = inner

        def __enter__(self):
            return self.inner.__enter__()

        def __exit__(self, *exc):
            out = self.inner.__exit__(*exc)
            if (threading.current_thread() is t and dropped[0] >= 20
                    and not self.inner._is_owned() and not started.is_set()):
                started.set()
                looked.wait(30)
            return out

    monkeypatch.setattr(c, "_drop_locked", counting_drop)
    t = threading.Thread(target=c.invalidate_namespace, args=(A,), daemon=True)
    c._lock = GateLock(c._lock)
    t.start()
    try:
        assert started.wait(10)
        r = c.lookup(B, "query", tier="relaxed")
        dropped_before_lookup = dropped[0]
        looked.set()
    finally:
        looked.set()
        t.join(60)
    assert r.hit and r.entry.answer == "other answer"
    assert dropped_before_lookup == 20, "the lookup waited for the whole invalidation"
    assert c.stats().entries == 1
    c.check_integrity()


def test_invalidating_a_large_namespace_starts_no_index_rebuild(make_cache, monkeypatch):
    """Past a quarter of its entries the tombstones of a namespace being invalidated asked for
    a purge: a background rebuild (seconds of HNSW at 100k) of an index about to be emptied."""
    c = make_cache()
    for i in range(300):
        c.store_entry(A, f"question {i}", f"answer {i}")
    c.store_entry(B, "other", "kept")
    started: list[NamespaceIndex] = []
    monkeypatch.setattr(NamespaceIndex, "_merge_in_background",
                        lambda self: started.append(self))
    index = c.index_of(A)
    assert index is not None and not index.merging
    assert c.invalidate_namespace(A) == 300
    assert started == [] and index._merging is None
    assert c.index_of(A) is None and c.stats().entries == 1
    assert c.store.count() == 1  # durably gone
    c.check_integrity()


class HeldInvalidate:
    """An Invalidate of entry `old` (by id or namespace) on a thread, held inside its SQLite
    delete (after it read what it removes) until `proceed` is set; `out["removed"]` its
    count once it has ended."""

    def __init__(self, c: SemanticCache, monkeypatch, by: str, old) -> None:
        self.deleting, self.proceed = threading.Event(), threading.Event()
        self.out: dict[str, object] = {}
        real_delete = c.store.delete

        def gated(labels, committed=None):
            if not self.deleting.is_set():  # the Invalidate's delete, held
                self.deleting.set()
                assert self.proceed.wait(30)
            return real_delete(labels, committed)

        def invalidate() -> None:
            self.out["removed"] = (c.invalidate_id(old.id) if by == "id"
                                   else c.invalidate_namespace(A))

        monkeypatch.setattr(c.store, "delete", gated)
        self.thread = threading.Thread(target=invalidate, daemon=True)
        self.thread.start()
        assert self.deleting.wait(30)

    def end(self) -> object:
        self.proceed.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.out["removed"]


def _watch_waits(c: SemanticCache, monkeypatch) -> threading.Event:
    """An event set once a Store waits for an Invalidate under way (`_removal`)."""
    waiting = threading.Event()

    class Watched(threading.Condition):
        def wait(self, timeout=None):
            waiting.set()
            return super().wait(timeout)

    monkeypatch.setattr(c, "_removed", Watched(c._lock), raising=False)
    return waiting


@pytest.mark.parametrize("behind", [False, True])
@pytest.mark.parametrize("restarted", [False, True])
@pytest.mark.parametrize("by", ["id", "namespace"])
def test_a_store_into_a_namespace_being_invalidated_waits_for_the_invalidation(
        make_cache, monkeypatch, by, restarted, behind):
    """An Invalidate read the namespace's entries; a Store of the same prompt then replaced
    the entry before the Invalidate removed it, and the Invalidate said removed=0 while the
    namespace held an answer to that prompt throughout (a count no order of the two calls
    gives: 9 of 300 races through gRPC). The Store now waits for the Invalidate's end; also
    for an entry loaded at start (the label the namespace read goes up to is set there too),
    and (`behind`) for one stored after another entry of the namespace: a namespace's
    Invalidate reads up to its highest label, not to its least recently used one's."""
    c = make_cache()
    if behind:
        c.store_entry(A, "stored before", "another answer")
    old = c.store_entry(A, "query", "old answer")
    if restarted:
        c = make_cache()
    waiting = _watch_waits(c, monkeypatch)
    held = HeldInvalidate(c, monkeypatch, by, old)
    st = threading.Thread(target=lambda: c.store_entry(A, "query", "new answer"), daemon=True)
    st.start()
    # until the Store has replaced the entry, or waits
    holds_within(lambda: not st.is_alive() or waiting.is_set(), 30, every=0.005)
    assert held.end() == (2 if behind and by == "namespace" else 1)
    st.join(30)
    assert not st.is_alive()
    r = c.lookup(A, "query", tier="strict")
    assert r.hit and r.entry.answer == "new answer"
    left = 2 if behind and by == "id" else 1
    assert c.stats().entries == left and c.store.count() == left
    c.check_integrity()


def test_a_store_waiting_for_an_invalidation_gives_up_when_its_caller_stops_waiting(
        make_cache, monkeypatch):
    """A Store held by an Invalidate (above) asks whether its caller still waits: once not,
    it is refused with DEADLINE_EXCEEDED and its row deleted. It waited on past the caller's
    deadline, and its answer then stood though the caller had been told it failed."""
    c = make_cache()
    old = c.store_entry(A, "query", "old answer")
    waiting = _watch_waits(c, monkeypatch)
    held = HeldInvalidate(c, monkeypatch, "id", old)
    still = threading.Event()
    still.set()
    out: dict[str, object] = {}

    def store() -> None:
        try:
            c.store_entry(A, "query", "new answer", wanted=still.is_set)
        except DeadlineExceeded as e:
            out["error"] = e

    st = threading.Thread(target=store, daemon=True)
    try:
        st.start()
        assert waiting.wait(10) and st.is_alive()  # waits for the Invalidate
        still.clear()  # the caller's deadline passes
        st.join(10)
        assert not st.is_alive() and "error" in out
    finally:
        removed = held.end()
    assert removed == 1
    assert c.stats().entries == 0 and c.store.count() == 0
    assert not c.lookup(A, "query", tier="strict").hit
    c.check_integrity()


@pytest.mark.parametrize("by", ["id", "namespace"])
def test_a_store_of_another_prompt_does_not_wait_for_an_invalidation(make_cache, monkeypatch,
                                                                        by):
    """Only a Store that would replace an entry an Invalidate read waits for it: the first
    version held every Store into the namespace, and a stream of Invalidates (Feedback on
    6,000 entries) held one for all of them (found by the review of that fix)."""
    c = make_cache()
    old = c.store_entry(A, "query", "old answer")
    held = HeldInvalidate(c, monkeypatch, by, old)
    try:
        stored = c.store_entry(A, "another question", "another answer")  # does not wait
        assert c.get(stored.id).answer == "another answer"
    finally:
        removed = held.end()
    assert removed == 1
    assert c.stats().entries == 1 and c.store.count() == 1
    c.check_integrity()


def test_a_delta_capacity_of_one_merges_and_then_rests():
    """3/4 of a capacity of 1 rounds to 0: the merge loop must not take "0 rows >= 0" as work
    left and rebuild forever."""
    idx = NamespaceIndex(IndexParams(DIM, delta_capacity=1))
    v = np.zeros(DIM, np.float32)
    v[0] = 1.0
    idx.add(1, v)
    holds_within(lambda: not idx.merging, 10)
    try:
        assert not idx.merging
        assert idx.search(v, 1)[0].label == 1
    finally:
        idx.close(5)


class WindowEmbedder(FixedEmbedder):
    """Texts starting with "LONG" are past the window: they all embed like their start."""

    def embed_one_checked(self, text: str):
        if text.startswith("LONG"):
            return self.fixed["query"], True
        return self.embed_one(text), False

    def exceeds_window(self, text: str) -> bool:
        return text.startswith("LONG")


def test_an_exact_repeat_past_the_window_hits_among_hundreds_that_tie(cache_factory, emb):
    """300 stored prompts share their first 256 tokens, so all tie at similarity 1.0: the
    search refused the others one by one and gave up after 256 candidates, and 44 of the 300
    exact repeats missed."""
    w = WindowEmbedder()
    w.fixed = emb.fixed
    c = cache_factory(w, guard_tiers=(), verifier_tiers=())
    for i in range(300):
        c.store_entry(A, f"LONG shared document, question {i}", f"answer {i}")
    for i in (0, 255, 256, 299):
        r = c.lookup(A, f"LONG shared document, question {i}", tier="strict")
        assert r.hit and r.entry.answer == f"answer {i}", (i, r)
    r = c.lookup(A, "LONG shared document, another question", want_draft=True)
    assert not r.hit and r.entry is not None and "embedding window" in r.guard_reason
    assert c.lookup(A, "LONG shared document, another question").entry is None


def test_an_exact_repeat_past_the_window_that_a_check_refuses_is_not_served(cache_factory, emb
                                                                           ) -> None:
    """The exact repeat is looked up by text first, with the checks a hit must pass. Past the
    window, the search after it found the same entry by text again and served it without
    them: what the verifier or guard had refused was served anyway."""
    w = WindowEmbedder()
    w.fixed = emb.fixed
    c = cache_factory(w, guard_tiers=(), verifier_tiers=())
    e = c.store_entry(A, "LONG shared document, question 1", "answer 1")
    assert c.lookup(A, "LONG shared document, question 1").hit
    c._second_opinion = lambda *args: "refused by the test's check"  # a check that refuses all
    r = c.lookup(A, "LONG shared document, question 1", want_draft=True)
    assert not r.hit and r.guard_rejected and r.guard_reason == "refused by the test's check"
    assert r.entry is not None and r.entry.id == e.id  # offered as a draft instead
    c.check_integrity()


def test_past_the_window_a_verified_candidate_reports_its_own_threshold(cache_factory, emb):
    """LookupResponse.threshold is what applied to the candidate, after the verified bonus;
    past the embedding window it was always the tier's (0.95, where 0.93 applied)."""
    w = WindowEmbedder()
    w.fixed = emb.fixed
    c = cache_factory(w, guard_tiers=(), verifier_tiers=())
    e = c.store_entry(A, "LONG shared document, question 1", "answer 1")
    r = c.lookup(A, "LONG shared document, question 2", tier="standard", want_draft=True)
    assert r.threshold == pytest.approx(0.95)
    c.verify(e.id, True)
    r = c.lookup(A, "LONG shared document, question 2", tier="standard", want_draft=True)
    assert not r.hit and r.entry.id == e.id
    assert r.threshold == pytest.approx(0.95 - c.cfg.verified_bonus)


def test_an_expired_entry_goes_before_a_live_one_at_capacity(make_cache, emb, clock):
    """Eviction went by LRU alone: a namespace at its limit evicted a live answer and kept one
    already expired (not yet purged by the housekeeper), which it can never serve."""
    c = make_cache(max_entries_per_namespace=2)
    emb.at("live", 0.99, 2)
    c.store_entry(A, "live", "B")  # least recently used, but live
    c.store_entry(A, "short-lived", "A", ttl_seconds=10)
    clock.t += 11
    c.store_entry(A, "third", "C")
    assert sorted(e.prompt for e in c._entries.values()) == ["live", "third"]
    r = c.lookup(A, "query", tier="relaxed")
    assert r.hit and r.entry.answer == "B"
    assert c._evicted == 0 and c._expired == 1
    assert c.store.count() == 2  # its row went with it
    # Past capacity with nothing expired, LRU still decides (the hit made "live" recent).
    c.store_entry(A, "fourth", "D")
    assert sorted(e.prompt for e in c._entries.values()) == ["fourth", "live"]
    assert c._evicted == 1
    c.check_integrity()


def test_a_row_stored_under_a_larger_ttl_limit_loads_with_todays(make_cfg, emb, clock):
    """Rows written while the TTL limit was higher (past the API's uint32 once) hit after a
    restart and then failed in entry_to_proto: every hit on them was INTERNAL."""
    from services.semantic.server import entry_to_proto

    cfg = make_cfg(guard_tiers=(), verifier_tiers=())
    store = EntryStore(cfg.resolved_db_path(), "NORMAL")
    store.insert(id="old", tenant=A.tenant, model_id=A.model_id, context_hash="",
                 prompt="query", answer="x", embedding=emb.embed_one("query"),
                 embed_model=emb.identity, verified=False, created_at=clock.t,
                 ttl_seconds=2**33)
    store.close()
    c = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        assert c.load() == 1
        r = c.lookup(A, "query")
        assert r.hit and r.entry.ttl_seconds == cfg.max_ttl_seconds
        assert entry_to_proto(r.entry).ttl_seconds == cfg.max_ttl_seconds
    finally:
        c.close_indexes()
        c.store.close()


def test_vectors_stored_before_unit_length_are_normalised_at_load(make_cfg, emb, clock):
    """Every vector is now unit length, but rows stored before (a folder without a Normalize
    module: norms of 5-7) were loaded as they were, and an unrelated question still scored
    cosine x 6, capped at 1.0: a hit."""
    cfg = make_cfg(guard_tiers=(), verifier_tiers=())
    emb.at("unrelated", 0.39, 2)
    store = EntryStore(cfg.resolved_db_path(), "NORMAL")
    store.insert(id="old", tenant=A.tenant, model_id=A.model_id, context_hash="",
                 prompt="How do I cook pasta?", answer="Boil water.",
                 embedding=emb.embed_one("query") * 6.0, embed_model=emb.identity,
                 verified=False, created_at=clock.t, ttl_seconds=0)
    emb.at("short", 1.0, 3)
    store.insert(id="short", tenant=B.tenant, model_id=B.model_id, context_hash="",
                 prompt="short", answer="x", embedding=emb.embed_one("short") * 0.5,
                 embed_model=emb.identity, verified=False, created_at=clock.t, ttl_seconds=0)
    store.close()
    c = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        assert c.load() == 2
        r = c.lookup(A, "unrelated", tier="relaxed")
        assert not r.hit and abs(r.similarity - 0.39) < 1e-3
        assert c.lookup(A, "query").hit  # its own direction still hits
        rows = [r for rows in c.store.iter_all() for r in rows]
        assert len(rows) == 2  # too long and too short alike: written back at unit length
        assert all(abs(float(np.linalg.norm(r.embedding)) - 1.0) < 1e-5 for r in rows)
    finally:
        c.close_indexes()
        c.store.close()


def test_load_rewrites_vectors_in_one_transaction_not_one_per_row(make_cfg, emb, clock):
    """Re-embedding and normalising at start committed (and fsynced) every row on its own:
    a restart after a model change took minutes at 100k entries."""
    from tests.semantic.sql_trace import SqlTrace

    cfg = make_cfg(guard_tiers=(), verifier_tiers=())
    store = EntryStore(cfg.resolved_db_path(), "NORMAL")
    for i in range(30):
        store.insert(id=f"other-{i}", tenant=A.tenant, model_id=A.model_id, context_hash="",
                     prompt=f"other model {i}", answer="x", embedding=np.ones(8, np.float32),
                     embed_model="another@model", verified=False, created_at=clock.t,
                     ttl_seconds=0)
        store.insert(id=f"long-{i}", tenant=B.tenant, model_id=B.model_id, context_hash="",
                     prompt=f"too long {i}", answer="x",
                     embedding=emb.embed_one(f"too long {i}") * 6.0, embed_model=emb.identity,
                     verified=False, created_at=clock.t, ttl_seconds=0)
    store.insert(id="fine", tenant=B.tenant, model_id=B.model_id, context_hash="",
                 prompt="fine", answer="x", embedding=emb.embed_one("fine"),
                 embed_model=emb.identity, verified=False, created_at=clock.t, ttl_seconds=0)
    store.close()
    c = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    trace = SqlTrace(c.store)
    try:
        assert c.load() == 61
        # One for the 30 re-embedded rows, one for the 30 normalised: not 60.
        written = trace.transactions("UPDATE entries SET embedding")
        assert [len(t) for t in written] == [30, 30]
        rows = {r.id: r for rows in c.store.iter_all() for r in rows}
        assert {r.embed_model for r in rows.values()} == {emb.identity}
        for eid in ("other-3", "long-3", "fine"):
            r = rows[eid]
            assert np.allclose(r.embedding, emb.embed_one(r.prompt), atol=1e-6)
        assert c.lookup(A, "other model 3").hit and c.lookup(B, "too long 3").hit
    finally:
        c.close_indexes()
        c.store.close()


def test_re_embedding_at_start_says_what_it_does_and_how_far_it_is(make_cfg, emb, clock,
                                                                    monkeypatch, caplog):
    """After a change of embedding model a full shard re-embeds for ~10 minutes before it
    serves, and said nothing until the end: a pod that looked hung to its operator (and
    outlasted the startup probe)."""
    import logging

    from services.semantic import cache as cache_mod

    monkeypatch.setattr(cache_mod, "WRITE_CHUNK", 64)
    cfg = make_cfg(guard_tiers=(), verifier_tiers=())
    store = EntryStore(cfg.resolved_db_path(), "NORMAL")
    store.insert_many([{"id": f"e{i}", "tenant": A.tenant, "model_id": A.model_id,
                        "context_hash": "", "prompt": f"question {i}", "answer": "x",
                        "embedding": np.ones(8, np.float32), "embed_model": "old@model",
                        "verified": False, "created_at": clock.t, "ttl_seconds": 0}
                       for i in range(200)])
    store.close()
    c = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        with caplog.at_level(logging.INFO, logger=cache_mod.log.name):
            assert c.load() == 200
        text = caplog.text
        assert f"re-embedding 200 entries stored by old@model with {emb.identity}" in text
        assert "re-embedded 128 of 200 entries (64%)" in text  # every 64 written here
        assert "re-embedded 200 entries with" in text
    finally:
        c.close_indexes()
        c.store.close()


def test_load_lets_go_of_each_rows_vector_once_its_namespace_is_stacked(make_cfg, emb, clock,
                                                                      monkeypatch):
    """load() kept every row's own vector array alive until it returned, beside the stacked
    copy, the index's copy and faiss's: the peak memory of a restart."""
    import weakref

    cfg = make_cfg(guard_tiers=(), verifier_tiers=())
    store = EntryStore(cfg.resolved_db_path(), "NORMAL")
    for ns in (A, B):
        for i in range(5):
            q = f"{ns.tenant} question {i}"
            store.insert(id=q, tenant=ns.tenant, model_id=ns.model_id, context_hash="",
                         prompt=q, answer="x", embedding=emb.embed_one(q),
                         embed_model=emb.identity, verified=False, created_at=clock.t,
                         ttl_seconds=0)
    store.close()
    c = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    read: list[weakref.ref] = []  # every row's vector as read from SQLite
    real_iter = c.store.iter_all

    def iter_all(*a, **kw):
        for rows in real_iter(*a, **kw):
            read.extend(weakref.ref(r.embedding) for r in rows)
            yield rows

    alive_at_build: list[int] = []
    real_add_many = NamespaceIndex.add_many

    def add_many(self, labels, vecs):
        alive_at_build.append(sum(ref() is not None for ref in read))
        return real_add_many(self, labels, vecs)

    monkeypatch.setattr(c.store, "iter_all", iter_all)
    monkeypatch.setattr(NamespaceIndex, "add_many", add_many)
    try:
        assert c.load() == 10
        # Building the first namespace: its rows' arrays are gone, the second's still held.
        assert alive_at_build == [5, 0] and len(read) == 10
        assert c.lookup(B, "tenant-b question 4").hit
        c.check_integrity()
    finally:
        c.close_indexes()
        c.store.close()


@pytest.mark.parametrize("default_ttl", [0, 3600])
def test_a_never_expiring_row_ages_out_once_entries_expire_by_default(make_cfg, emb, clock,
                                                                      default_ttl):
    """A row stored to never expire (TTL 0, under a default of 0) stayed so after the
    operator set a default TTL: entries of a no-TTL past could only be deleted by hand."""
    cfg = make_cfg(guard_tiers=(), verifier_tiers=(), default_ttl_seconds=default_ttl,
                   max_ttl_seconds=7200)
    store = EntryStore(cfg.resolved_db_path(), "NORMAL")
    for eid, age in (("old", 7300), ("young", 100)):
        store.insert(id=eid, tenant=A.tenant, model_id=A.model_id, context_hash="",
                     prompt=f"query {eid}", answer="x", embedding=emb.embed_one("query"),
                     embed_model=emb.identity, verified=False, created_at=clock.t - age,
                     ttl_seconds=0)
    store.close()
    c = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        if default_ttl == 0:  # never-expiring entries are still allowed: kept as they were
            assert c.load() == 2 and c.get("old").ttl_seconds == 0
        else:  # today's limit (2 h): the 2-hour-old row is gone, the other expires in time
            assert c.load() == 1 and c.get("young").ttl_seconds == 7200
            clock.t += 7200
            c.expire()
            assert c.stats().entries == 0
    finally:
        c.close_indexes()
        c.store.close()


def test_a_row_expired_under_todays_ttl_limit_is_not_loaded(make_cfg, emb, clock):
    """The clamp came after the expiry check: a row expired under today's limit was loaded,
    took capacity, and could push out a live entry."""
    from services.semantic.store import EntryStore as Store

    cfg = make_cfg(guard_tiers=(), verifier_tiers=(), max_entries_per_namespace=1)
    store = Store(cfg.resolved_db_path(), "NORMAL")
    two_years = 2 * 365 * 24 * 3600
    old = store.insert(id="old", tenant=A.tenant, model_id=A.model_id, context_hash="",
                       prompt="old question", answer="x",
                       embedding=emb.embed_one("old question"), embed_model=emb.identity,
                       verified=False, created_at=clock.t - two_years, ttl_seconds=2**33)
    store.record_hit(old, clock.t - 1, 5)  # hit recently: the LRU pass would keep it
    store.flush_hits()
    store.insert(id="fresh", tenant=A.tenant, model_id=A.model_id, context_hash="",
                 prompt="query", answer="live", embedding=emb.embed_one("query"),
                 embed_model=emb.identity, verified=False, created_at=clock.t - 100,
                 ttl_seconds=3600)
    store.close()
    c = SemanticCache(cfg, emb, Store(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        assert c.load() == 1
        assert c.lookup(A, "query").entry.answer == "live"
        assert [r.id for rows in c.store.iter_all() for r in rows] == ["fresh"]
    finally:
        c.close_indexes()
        c.store.close()


from services.semantic.cache import RECENT_VECTORS as RECENT  # noqa: E402


class CountingEmbedder(FixedEmbedder):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def embed_one(self, text: str) -> np.ndarray:
        self.calls.append(text)
        return super().embed_one(text)


def test_a_store_after_a_lookup_of_its_text_does_not_embed_it_again(cache_factory):
    """The orchestrator looks a text up, then stores the model's answer under it: the Store
    embedded the text a second time (~95% of its time, 5-12 ms per answered request)."""
    emb = CountingEmbedder()
    cache = cache_factory(emb, guard_tiers=(), verifier_tiers=())
    assert not cache.lookup(A, "What is a KV cache?").hit
    e = cache.store_entry(A, "What is a KV cache?", "Keys and values kept.")
    assert emb.calls == ["What is a KV cache?"]
    # Not the same text (so it is embedded), the same vector (so it hits).
    emb.fixed["What is a KV cache "] = FixedEmbedder.embed_one(emb, "What is a KV cache?")
    hit = cache.lookup(A, "What is a KV cache ")
    assert hit.hit and hit.entry.id == e.id and not hit.exact
    assert emb.calls == ["What is a KV cache?", "What is a KV cache "]
    cache.store_entry(A, "What is a KV cache?", "Replaced.")  # after a hit nothing was kept
    assert emb.calls[2:] == ["What is a KV cache?"]
    assert not cache.lookup(A, "Never stored?").hit
    cache.store_entry(A, "Never stored?", "x")
    cache.store_entry(A, "Never stored?", "y")  # each kept vector serves one Store
    assert emb.calls[3:] == ["Never stored?"] * 2
    for i in range(RECENT + 10):  # bounded
        cache.lookup(A, f"q{i}")
    assert len(cache._recent) == RECENT
    cache._recent.clear()  # a hit keeps nothing: no Store follows it
    assert cache.lookup(A, "What is a KV cache?").hit and not cache._recent


def test_an_exact_repeat_is_served_by_text_without_embedding(cache_factory, clock):
    """A repeated question was embedded again (3-6 ms of a ~7 ms lookup on a CPU) only to find
    its own entry at similarity 1 (or just under it: at threshold 1.0 it could miss)."""
    emb = CountingEmbedder()
    emb.at("Far away?", 0.0, 2)  # orthogonal to the stored prompt's vector below
    emb.at("What is a KV cache?", 1.0, 1)
    cache = cache_factory(emb, guard_tiers=(), verifier_tiers=())
    e = cache.store_entry(A, "What is a KV cache?", "Keys and values kept.", ttl_seconds=60)
    emb.calls.clear()
    r = cache.lookup(A, "What is a KV cache?", threshold=1.0)
    assert r.hit and r.exact and r.entry.id == e.id and r.entry.hit_count == 1
    assert (r.similarity, r.embed_ms) == (1.0, 0.0) and emb.calls == []
    assert not cache.lookup(B, "What is a KV cache?").hit  # another namespace: searched
    assert not cache.lookup(A, "Far away?").exact
    assert emb.calls == ["What is a KV cache?", "Far away?"]
    s = cache.stats()
    assert s.lookups_total == 3 and sum(s.hits_by_tier.values()) == 1
    clock.t += 61  # expired: not served by its text either
    gone = cache.lookup(A, "What is a KV cache?", want_draft=True)
    assert not gone.hit and not gone.exact and gone.entry is None
    assert emb.calls[-1] == "What is a KV cache?"  # searched by similarity instead
    cache.check_integrity()


def test_an_exact_repeat_refused_by_a_check_is_searched_as_before(cache_factory):
    """A check that refuses the exact pair (the verifier, as it may refuse any pair) refuses
    it found by text too: the lookup then searches by similarity as before."""
    emb = CountingEmbedder()
    cache = cache_factory(emb, guard_tiers=(), verifier_tiers=())
    e = cache.store_entry(A, "Is it safe?", "Yes.")
    refused: list[str] = []

    def no(text, prompt, sim, tier):  # the verifier says no, as it may for any pair
        refused.append(text)
        return "verifier score 0.100 below 0.880"

    cache._second_opinion = no
    emb.calls.clear()
    r = cache.lookup(A, "Is it safe?")
    assert not r.hit and not r.exact and r.guard_rejected
    assert emb.calls == ["Is it safe?"] and refused == ["Is it safe?", "Is it safe?"]
    assert cache.get(e.id).hit_count == 0


@pytest.mark.parametrize("limit", ["max_entries_per_namespace", "max_entries_per_tenant",
                                   "max_entries_total"])
def test_a_store_past_capacity_counts_what_an_expiry_under_way_took_as_gone(
        make_cache, clock, monkeypatch, limit):
    """Past capacity a Store purges expired entries before it evicts a live one. With the
    housekeeper's expiry under way (it had taken the due entries off its heap and was deleting
    their rows), the Store found nothing due and evicted the live entry beside the expired
    one: a live answer lost while a dead one kept its slot, and Stats counting an eviction
    where no order of the two calls gives one (found by the concurrency differential test).
    The entries that expiry took count as gone: the Store evicts nothing, leaves them to the
    expiry (it purged the whole batch under the lock once, and deleted their rows twice).
    Each of the three limits counts them so (the concurrency differential runs with the global
    one off, and its seeds missed the tenant's)."""
    c = make_cache(**{limit: 2})
    c.store_entry(A, "live", "live answer")  # least recently used, never expires
    dying = c.store_entry(A, "dying", "dying answer", ttl_seconds=5)
    clock.t += 6
    real = c.store.delete
    deleting, release = threading.Event(), threading.Event()
    deletes: list[list[int]] = []

    def held_delete(labels, committed=None):
        deletes.append(list(labels))
        if labels and not deleting.is_set():  # the expiry's delete: held
            deleting.set()
            assert release.wait(10)
        return real(labels, committed)

    monkeypatch.setattr(c.store, "delete", held_delete)
    out: dict[str, int] = {}
    ex = threading.Thread(target=lambda: out.setdefault("expired", c.expire()), daemon=True)
    ex.start()
    try:
        assert deleting.wait(10)
        c.store_entry(A, "new", "new answer")
        c.check_integrity()  # over capacity by the entry the expiry is dropping only
        assert not c.lookup(A, "dying", tier="strict").hit  # expired: never served
    finally:
        release.set()
        ex.join(10)
    assert not ex.is_alive()
    assert c.lookup(A, "live", tier="strict").hit
    s = c.stats()
    assert (s.entries, s.evictions_total, s.expirations_total) == (2, 0, 1)
    assert out["expired"] == 1  # the expiry dropped what it took
    assert [d for d in deletes if dying.label in d] == [[dying.label]]  # its row, once
    assert c.store.count() == 2
    c.check_integrity()


@pytest.mark.parametrize("limit", ["max_entries_per_namespace", "max_entries_per_tenant",
                                   "max_entries_total"])
def test_a_store_past_capacity_beside_an_expiry_under_way_evicts_the_oldest_live_entry(
        make_cache, clock, monkeypatch, limit):
    """Past capacity even without the entries an expiry under way took, a Store evicts the
    least recently used live entry, never one of those (the least recently used of all here):
    that expiry drops it, and evicting it too would count it twice and keep one entry too
    many."""
    c = make_cache(**{limit: 2})
    dying = c.store_entry(A, "dying", "dying answer", ttl_seconds=5)  # least recently used
    old = c.store_entry(A, "old", "old answer")
    clock.t += 6
    real = c.store.delete
    deleting, release = threading.Event(), threading.Event()

    def held_delete(labels, committed=None):
        if labels and not deleting.is_set():  # the expiry's delete: held
            deleting.set()
            assert release.wait(10)
        return real(labels, committed)

    monkeypatch.setattr(c.store, "delete", held_delete)
    ex = threading.Thread(target=c.expire, daemon=True)
    ex.start()
    try:
        assert deleting.wait(10)
        c.store_entry(A, "newer", "newer answer")  # at the limit without the dying one
        c.store_entry(A, "newest", "newest answer")  # past it: "old" goes
        c.check_integrity()
    finally:
        release.set()
        ex.join(10)
    assert not ex.is_alive()
    s = c.stats()
    assert (s.entries, s.evictions_total, s.expirations_total) == (2, 1, 1)
    for gone in (old, dying):
        with pytest.raises(NotFound):
            c.get(gone.id)
    assert c.lookup(A, "newer", tier="strict").hit and c.lookup(A, "newest", tier="strict").hit
    c.check_integrity()


def test_an_expiry_whose_delete_failed_leaves_its_entries_expired_until_the_next_tick(
        make_cache, clock, monkeypatch):
    """A Store past capacity counted the entries an expiry under way took as gone; when that
    expiry's delete then fails, they are held again (not expiring) and the cache holds more
    than its limit until the next tick purges them: never served meanwhile, and integrity
    holds (expired entries count as gone there too). The review's repro."""
    import sqlite3

    c = make_cache(max_entries_total=2)
    c.store_entry(A, "live", "live answer")
    c.store_entry(A, "dying", "dying answer", ttl_seconds=5)
    clock.t += 6
    real = c.store.delete
    deleting, release = threading.Event(), threading.Event()

    def failing_delete(labels, committed=None):
        if labels and not deleting.is_set():  # the expiry's delete: held, then it fails
            deleting.set()
            assert release.wait(10)
            raise sqlite3.OperationalError("disk I/O error")
        return real(labels, committed)

    monkeypatch.setattr(c.store, "delete", failing_delete)
    failed: list[BaseException] = []

    def expire() -> None:
        try:
            c.expire()
        except sqlite3.OperationalError as e:
            failed.append(e)

    ex = threading.Thread(target=expire, daemon=True)
    ex.start()
    try:
        assert deleting.wait(10)
        c.store_entry(A, "new", "new answer")
    finally:
        release.set()
        ex.join(10)
    assert not ex.is_alive() and len(failed) == 1
    s = c.stats()
    assert (s.entries, s.evictions_total, s.expirations_total) == (3, 0, 0)
    assert not c.lookup(A, "dying", tier="strict").hit  # expired: never served
    c.check_integrity()  # no entry left marked as expiring; the dead one counts as gone
    assert c.expire() == 1  # the next tick takes it
    s = c.stats()
    assert (s.entries, s.evictions_total, s.expirations_total) == (2, 0, 1)
    assert c.lookup(A, "live", tier="strict").hit and c.lookup(A, "new", tier="strict").hit
    assert c.store.count() == 2
    c.check_integrity()


def _store_after_first_search(c, monkeypatch, prompt: str, answer: str, hide: bool = False
                              ) -> list[int]:
    """Makes namespace A's first index search be followed, before the lookup reads its result,
    by a Store of (`prompt`, `answer`), its result dropped when `hide`; returns the k of every
    search, filled as they run."""
    index = c.index_of(A)
    real = index.search
    searches: list[int] = []

    def search(vec, k=1):
        searches.append(k)
        found = real(vec, k)
        if len(searches) == 1:
            c.store_entry(A, prompt, answer)
            if hide:
                return []
        return found

    monkeypatch.setattr(index, "search", search)
    return searches


@pytest.mark.parametrize("saw", ["the old row", "neither row"])
def test_a_lookup_racing_a_store_that_replaces_its_hit_still_hits(make_cache, emb,
                                                                  monkeypatch, saw):
    """A Store of the same prompt replaces an entry in one hold of the lock (the new entry in,
    the old one out), so the namespace holds an answer to that prompt throughout. A Lookup of
    a paraphrase whose search (lock-free) had found the old entry, and which read it after the
    replacement, missed: a miss no order of the two calls gives (found by the concurrency
    differential test); so did one whose search saw neither row (the index's row count read
    before the add, its tombstones after the removal). It searches again when the namespace
    changed under a search that missed."""
    emb.at("question", 0.96, 2)
    c = make_cache()
    c.store_entry(A, "question", "old answer")
    searches = _store_after_first_search(c, monkeypatch, "question", "new answer",
                                         hide=saw == "neither row")
    r = c.lookup(A, "query", tier="relaxed")
    assert searches  # the replacing Store ran
    assert r.hit and r.entry.answer == "new answer" and r.entry.prompt == "question"
    c.check_integrity()


def test_a_miss_while_stores_only_add_is_searched_once(make_cache, emb, monkeypatch):
    """Only a removal can hide a row a search would have found: a lookup that missed while a
    Store merely added an entry to its namespace is not searched again (a namespace taking
    Stores would otherwise pay a second and third search on its misses)."""
    emb.at("question", 0.5, 2)  # far below every threshold: a miss
    c = make_cache()
    c.store_entry(A, "question", "answer")
    searches = _store_after_first_search(c, monkeypatch, "another question", "another answer")
    r = c.lookup(A, "query", tier="relaxed")
    assert not r.hit and c.stats().entries == 2
    assert len(searches) == 1, searches


class CountsReads(dict):
    """The cache's entry map, counting the entries read by key."""

    reads = 0

    def __getitem__(self, label):
        self.reads += 1
        return dict.__getitem__(self, label)


def test_a_store_at_global_capacity_reads_only_the_largest_tenants_oldest_entries(
        make_cache, clock):
    """Past the global capacity a Store evicts from the tenant holding the most entries. It
    read the oldest entry of every tenant first, under the cache lock: with 20,000 tenants a
    Store at capacity held the lock ~50 ms (every lookup waiting). Only a tenant within
    `over` entries of the largest can lose one."""
    c = make_cache(max_entries_total=203)
    for i in range(200):
        clock.t += 1
        c.store_entry(Namespace(f"small-{i}", "smollm2", ""), f"q{i}", "a")
    big = [c.store_entry(Namespace("big", "smollm2", ""), f"big {i}", "a").id for i in range(3)]
    clock.t += 1
    c._entries = CountsReads(c._entries)
    c.store_entry(Namespace("small-0", "smollm2", ""), "one more", "a")
    assert [eid in c._by_id for eid in big] == [False, True, True]  # the largest's oldest
    assert c._entries.reads < 10
    c.store_entry(Namespace("small-1", "smollm2", ""), "and another", "a")
    # Tied at two entries (big, small-0, small-1): the least recently used goes, small-0's.
    assert "q0" not in {e.prompt for e in dict.values(c._entries)}
    assert c.stats().entries == 203 and c.stats().evictions_total == 2
    c.check_integrity()


def test_a_store_at_global_capacity_among_tied_tenants_reads_few_entries(make_cache, clock):
    """Tenants tied at the most (as at steady state: evicting the largest levels them): a
    Store past the global capacity read the oldest entry of every one of them, under the
    lock (20,000 tenants: ~47 ms a Store). Still the least recently used of them goes."""
    c = make_cache(max_entries_total=200)
    for i in range(200):
        clock.t += 1
        c.store_entry(Namespace(f"t{i}", "smollm2", ""), f"q{i}", "a")
    c._entries = CountsReads(c._entries)
    for i in range(3):
        clock.t += 1
        c.store_entry(Namespace(f"new-{i}", "smollm2", ""), f"n{i}", "a")
    assert c._entries.reads < 30
    assert {e.prompt for e in dict.values(c._entries)} == (
        {f"q{i}" for i in range(3, 200)} | {"n0", "n1", "n2"})
    c.check_integrity()


def _gate_inserts(c: SemanticCache, arrivals: int, wait_s: float = 2.0) -> list[int]:
    """Counts the rows Stores write (`store.insert`); each insert waits until `arrivals`
    inserts have begun, or `wait_s`, so Stores that would each write are all caught writing."""
    real, begun = c.store.insert, []
    lock = threading.Condition()

    def insert(**row):
        with lock:
            begun.append(1)
            lock.notify_all()
            lock.wait_for(lambda: len(begun) >= arrivals, wait_s)
        return real(**row)

    c.store.insert = insert
    return begun


def _stores_at_once(c: SemanticCache, n: int, **kw) -> list:
    """`n` threads each storing the same answer to one prompt at once; their results (an
    Entry or the exception raised)."""
    out: list = [None] * n
    start = threading.Barrier(n)

    def store(i: int) -> None:
        start.wait(10)
        try:
            out[i] = c.store_entry(A, "query", "one answer", answer_token_ids=[1, 2], **kw)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[i] = e

    threads = [threading.Thread(target=store, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


def test_identical_stores_at_once_with_no_entry_yet_write_one_row(make_cache):
    """A herd (identical requests across orchestrators: each coalesces its own only) stored
    one answer at once before any entry held the prompt: each Store wrote a row, and all but
    one deleted theirs once they found the other's entry. A kill -9 between such a commit and
    its delete left two rows, the restart kept the newest, and the id callers were given went
    (Feedback NOT_FOUND, the TTL counted afresh). The Stores in flight at once now write one
    row, and every caller is given its id."""
    c = make_cache()
    begun = _gate_inserts(c, arrivals=4)
    got = _stores_at_once(c, 4)
    assert all(not isinstance(e, Exception) for e in got), got
    assert len(begun) == 1 and len({e.id for e in got}) == 1
    assert c.store.count() == 1 and c.stats().entries == 1
    assert c.lookup(A, "query", tier="strict").entry.id == got[0].id
    c.check_integrity()


def test_identical_stores_at_once_keep_their_id_across_a_crash_during_them(make_cache):
    """The crash itself (see above): the process dies as soon as a Store deletes a row it
    wrote (as a herd's loser did, once it found the winner's entry), and the restart still
    serves the entry under the id every caller was given."""
    c = make_cache()
    _gate_inserts(c, arrivals=3)
    real_delete = c.store.delete

    class Killed(Exception):
        pass

    def delete(labels, *a, **kw):
        if labels:
            raise Killed  # kill -9 before the row is gone
        return real_delete(labels, *a, **kw)

    c.store.delete = delete
    given = {e.id for e in _stores_at_once(c, 3) if not isinstance(e, Killed)}
    restarted = make_cache()  # on the same database
    r = restarted.lookup(A, "query", tier="strict")
    assert r.hit and given == {r.entry.id} and restarted.store.count() == 1
    restarted.check_integrity()


def test_of_identical_stores_at_once_one_whose_caller_left_leaves_the_others_to_store(
        make_cache):
    """The first of a herd's Stores writes for all; when its caller has gone (its deadline
    passed) it writes nothing, and the Stores waiting on it store the answer themselves:
    one row, one id among them."""
    c = make_cache()
    begun = _gate_inserts(c, arrivals=3, wait_s=0.5)
    first = threading.Event()

    def wanted() -> bool:  # the first Store asking is refused; the rest still wanted
        if first.is_set():
            return True
        first.set()
        return False

    got = _stores_at_once(c, 3, wanted=wanted)
    refused = [e for e in got if isinstance(e, DeadlineExceeded)]
    stored = [e for e in got if not isinstance(e, Exception)]
    assert len(refused) == 1 and len(stored) == 2, got
    assert len({e.id for e in stored}) == 1 and len(begun) == 1
    assert c.store.count() == 1 and c.stats().entries == 1
    c.check_integrity()


def test_a_store_waiting_for_an_identical_one_gives_up_when_its_caller_stops_waiting(
        make_cache):
    """A Store waiting for an identical one in flight (above) asks whether its caller still
    waits: once not, it is refused with DEADLINE_EXCEEDED, and the one in flight still
    stores."""
    c = make_cache()
    real, writing, go = c.store.insert, threading.Event(), threading.Event()

    def held_insert(**row):
        writing.set()
        go.wait(10)
        return real(**row)

    c.store.insert = held_insert
    out: list = []
    first = threading.Thread(target=lambda: out.append(c.store_entry(A, "query", "x")),
                             daemon=True)
    first.start()
    try:
        assert writing.wait(10)
        with pytest.raises(DeadlineExceeded):
            c.store_entry(A, "query", "x", wanted=lambda: False)
    finally:
        go.set()
        first.join(10)
    assert len(out) == 1 and c.store.count() == 1
    assert c.lookup(A, "query", tier="strict").entry.id == out[0].id
    c.check_integrity()


def test_a_store_finding_no_entry_and_no_flight_meanwhile_does_not_write_again(make_cache):
    """An identical Store that finds no entry (`_held_answer`) and, before it looks for a flight,
    lets the first one write, take memory and land, finds the first one's entry: it led a
    flight of its own and wrote a second row (deleted again once it found the entry, the very
    window a kill -9 turned into a lost id)."""
    c = make_cache()
    inserts = _gate_inserts(c, arrivals=1)
    real_held, first = c._held_answer, []

    def held_then_first_store(probe):
        held = real_held(probe)
        if not first:  # the second Store, between its look and its flight: the first runs
            first.append(threading.Thread(
                target=lambda: first.append(c.store_entry(A, "query", "one answer")),
                daemon=True))
            first[0].start()
            first[0].join(0.5)  # as far as it gets while this Store has not looked for flights
        return held

    c._held_answer = held_then_first_store
    second = c.store_entry(A, "query", "one answer")
    first[0].join(10)
    assert not first[0].is_alive() and first[1].id == second.id
    assert len(inserts) == 1 and c.store.count() == 1
    c.check_integrity()
