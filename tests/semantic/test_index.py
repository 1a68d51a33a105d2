"""Namespace index: flat -> HNSW, removals, lock-free searches during writes, recall."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from services.semantic.index import IndexParams, NamespaceIndex
from tests.waits import holds_within


def _unit(rng, n, d=32):
    v = rng.standard_normal((n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_add_search_remove_and_integrity():
    rng = np.random.default_rng(0)
    vecs = _unit(rng, 50)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000, delta_capacity=8))
    for i, v in enumerate(vecs):
        idx.add(100 + i, v)
        idx.check_integrity()
    assert len(idx) == 50
    for i in (0, 17, 49):  # searched across main and delta, whatever merges have run
        top = idx.search(vecs[i], 1)[0]
        assert top.label == 100 + i and abs(top.score - 1.0) < 1e-5
    assert idx.remove(117) and not idx.remove(117)
    idx.check_integrity()
    assert idx.search(vecs[17], 1)[0].label != 117
    assert all(nb.label != 117 for nb in idx.search(vecs[17], 50))
    idx.compact()
    idx.check_integrity()
    assert len(idx) == 49 and len(idx.search(vecs[0], 100)) == 49 and idx.kind == "flat"


@pytest.mark.parametrize("hnsw_min", [20000, 10])  # a flat main index, an HNSW one
def test_a_label_still_indexed_is_not_taken_again(hnsw_min):
    """Re-adding a removed label before a purge left its old row in the index: the label was
    indexed twice and a query near the old vector found it at the old vector's score."""
    rng = np.random.default_rng(1)
    vecs = _unit(rng, 40)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=hnsw_min, delta_capacity=8),
                         background=False)
    idx.add_many(np.arange(30), vecs[:30])
    with pytest.raises(ValueError, match="label 3 is already indexed"):
        idx.add(3, vecs[35])  # live
    assert idx.remove(3)
    with pytest.raises(ValueError, match="label 3 is already indexed"):
        idx.add(3, vecs[35])  # tombstoned, its row still there
    with pytest.raises(ValueError, match="already indexed"):
        idx.add_many(np.array([31, 3]), vecs[31:33])
    with pytest.raises(ValueError, match="label 32 is already indexed"):
        idx.add_many(np.array([32, 32]), vecs[32:34])
    idx.check_integrity()
    assert len(idx) == 29 and all(nb.label != 3 for nb in idx.search(vecs[3], 40))
    idx.compact()  # purged: the label is free again
    idx.add(3, vecs[35])
    idx.check_integrity()
    assert [nb.label for nb in idx.search(vecs[3], 40)].count(3) == 1
    assert idx.search(vecs[35], 1)[0].label == 3


def test_a_label_purged_and_added_again_during_a_search_is_not_scored_by_its_old_vector():
    """A search holds the snapshot it read; a merge purging a removed label, then an add of
    that label (free again) meanwhile, left the old row there and the label live: the search
    returned it scored by the vector it no longer has (1.0 for a query equal to it)."""
    rng = np.random.default_rng(7)
    vecs = _unit(rng, 41, 16)
    idx = NamespaceIndex(IndexParams(16, hnsw_min_entries=1000), background=False)
    idx.add_many(np.arange(40), vecs[:40])
    real = idx._search_snapshot

    def racing(*a, **kw):
        idx._search_snapshot = real  # once: the search has read its snapshot, then a writer
        assert idx.remove(3)
        idx.compact()
        idx.add(3, vecs[40])
        return real(*a, **kw)

    idx._search_snapshot = racing
    got = idx.search(vecs[3], 5)
    assert [(nb.label, round(nb.score, 5)) for nb in got] == \
        [(nb.label, round(nb.score, 5)) for nb in idx.search_exact(vecs[3], 5)]
    assert got[0].label != 3


# Delta rows: fewer than a pass fetches, or more (the delta is cut, and the floor must be the
# higher of the two sources' cuts: a mutation audit found nothing checking it).
@pytest.mark.parametrize("delta_rows", [4, 30])
@pytest.mark.parametrize("hnsw_min", [20000, 10])  # a flat main index, an HNSW one
def test_tombstones_filling_one_sources_top_do_not_hide_its_best_live_row(hnsw_min,
                                                                          delta_rows):
    """A dozen removed near-duplicates of a question (invalidated, expired) filled the main
    index's fetched rows, while the delta's few live rows made up k: the search returned
    those, far worse, and a live entry at cosine 0.98 missed even the relaxed tier."""
    rng = np.random.default_rng(0)
    dim = 16
    q = _unit(rng, 1, dim)[0]

    def near(cos: float) -> np.ndarray:
        r = _unit(rng, 1, dim)[0]
        r = r - (r @ q) * q
        v = cos * q + np.sqrt(1 - cos * cos) * r / np.linalg.norm(r)
        return (v / np.linalg.norm(v)).astype(np.float32)

    idx = NamespaceIndex(IndexParams(dim, hnsw_min_entries=hnsw_min, delta_capacity=2048),
                         background=False)
    for lab in range(1, 13):
        idx.add(lab, near(0.999 - lab * 1e-4))
    idx.add(500, near(0.98))
    for i, v in enumerate(_unit(rng, 60, dim)):
        idx.add(1000 + i, v)
    idx.compact()  # all in the main index
    for lab in range(1, 13):
        idx.remove(lab)  # tombstones, fewer than a merge purges
    for i in range(delta_rows):  # live rows in the delta, far from q
        v = -q + 0.1 * _unit(rng, 1, dim)[0]
        idx.add(2000 + i, (v / np.linalg.norm(v)).astype(np.float32))
    assert len(idx._dead) == 12 and idx.kind == ("flat" if hnsw_min > 100 else "hnsw")
    assert idx._snap.count[0] == delta_rows
    for k in (1, 4):
        got = [(nb.label, round(nb.score, 5)) for nb in idx.search(q, k)]
        assert got == [(nb.label, round(nb.score, 5)) for nb in idx.search_exact(q, k)]
        assert got[0][0] == 500


def test_switches_to_hnsw_beyond_the_configured_size_and_keeps_recall():
    rng = np.random.default_rng(1)
    base = _unit(rng, 600)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=400, delta_capacity=64))
    idx.add_many(np.arange(300), base[:300])
    assert idx.kind == "flat"
    for i in range(300, 600):
        idx.add(i, base[i])
    idx.compact()
    assert idx.kind == "hnsw"
    idx.check_integrity()
    # near-duplicate queries: each should find its own source vector
    q = base + 0.05 * _unit(rng, 600)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    agree = sum(idx.search(q[i], 1)[0].label == idx.search_exact(q[i], 1)[0].label
                for i in range(600))
    assert agree / 600 >= 0.98
    for lab in range(0, 600, 3):
        idx.remove(lab)
    idx.check_integrity()
    assert all(idx.search(base[i], 1)[0].label % 3 != 0 for i in range(0, 600, 3))


def test_searches_run_while_writers_add_and_remove():
    rng = np.random.default_rng(2)
    vecs = _unit(rng, 3000)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1500, delta_capacity=128))
    idx.add_many(np.arange(500), vecs[:500])
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader():
        try:
            while not stop.is_set():
                for i in range(0, 500, 50):
                    top = idx.search(vecs[i], 1)
                    # label L < 500 is removed when i = L + 500 is a multiple of 7
                    assert top and (top[0].label == i or (i + 500) % 7 == 0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(3)]
    for t in readers:
        t.start()
    try:  # a writer that raises must not leave the readers spinning
        for i in range(500, 3000):
            idx.add(i, vecs[i])
            if i % 7 == 0:
                idx.remove(i - 500)
    finally:
        stop.set()
        for t in readers:
            t.join(60)
    assert not errors, errors[0]
    idx.check_integrity()
    idx.compact()  # writers never build: merges may still be catching up
    idx.check_integrity()
    assert idx.kind == "hnsw" and len(idx) == 3000 - len(range(504, 3000, 7))


def test_writers_never_wait_for_an_index_build():
    """A build may take seconds (HNSW over a large namespace) and the cache calls the index
    under its own lock, which every lookup also takes: writers must not build."""
    rng = np.random.default_rng(4)
    vecs = _unit(rng, 300)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=10**6, delta_capacity=16))
    gate = threading.Event()
    real = idx._build

    def slow_build(*a, **kw):
        gate.wait(30)
        return real(*a, **kw)

    idx._build = slow_build
    done = threading.Event()

    def writer():
        for i in range(300):
            idx.add(i, vecs[i])
        for i in range(0, 300, 2):
            idx.remove(i)
        done.set()

    threading.Thread(target=writer, daemon=True).start()
    try:
        assert done.wait(20), "a writer waited for an index build"
        assert idx.search(vecs[7], 1)[0].label == 7
        assert all(nb.label % 2 for nb in idx.search(vecs[8], 5))  # removed ones never come back
    finally:
        gate.set()
    idx.close()
    idx.compact()
    idx.check_integrity()
    assert len(idx) == 150 and idx.search(vecs[9], 1)[0].label == 9


def settled(idx: NamespaceIndex) -> None:
    """Waits up to 30 s for `idx`'s background merge to end, and checks that it did."""
    holds_within(lambda: idx._merging is None, 30, 0.02)
    assert idx._merging is None, "the background merge did not settle"


def counting_builds(idx: NamespaceIndex) -> list[bool]:
    """The `purge` flag of each build `idx` runs from now on."""
    builds: list[bool] = []
    real = idx._build

    def counting_build(*a, **kw):
        builds.append(kw.get("purge", False))
        return real(*a, **kw)

    idx._build = counting_build
    return builds


def test_many_removals_are_purged_by_one_background_merge_not_a_loop():
    """Tombstones past a quarter of the live entries ask for a merge; that merge must purge
    them (a graph only extended would keep them, and the merge would start over forever)."""
    rng = np.random.default_rng(5)
    vecs = _unit(rng, 1200)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=200, delta_capacity=64))
    idx.add_many(np.arange(1200), vecs)
    assert idx.kind == "hnsw"
    builds = counting_builds(idx)
    for lab in range(0, 1200, 3):  # 400 removed: a third of the entries
        idx.remove(lab)
    settled(idx)
    assert True in builds and len(builds) <= 3, builds
    # Purged down to below the rule that asks for a merge (removals made while the merge ran
    # may stay as tombstones: too few to ask for another).
    assert len(idx._dead) <= max(64, len(idx) // 4)
    idx.check_integrity()
    assert len(idx) == 800 and all(nb.label % 3 for nb in idx.search(vecs[1], 10))


def test_bulk_builds_use_the_pods_cpu_limit_not_the_nodes_cores(monkeypatch):
    """A pod sets OMP_NUM_THREADS to its CPU limit; builds used os.cpu_count() (the node's
    cores), oversubscribing the quota at every start."""
    import os

    from services.semantic.index import _build_thread_count

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert _build_thread_count() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _build_thread_count() == (os.cpu_count() or 1)


def test_every_searching_thread_uses_the_configured_openmp_threads():
    # OpenMP keeps its thread count per thread: gRPC's worker threads (not started by the
    # thread that configured faiss) began with one per core, and a flat search over 10k
    # entries in the server took 2.3 ms instead of 0.7 ms with both threads contending.
    import faiss

    from services.semantic.index import set_search_threads

    idx = NamespaceIndex(IndexParams(dim=8, hnsw_min_entries=10**6), background=False)
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(50, 8)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    idx.add_many(np.arange(50), vecs)
    seen: list[int] = []

    def worker() -> None:
        assert idx.search(vecs[3], 1)[0].label == 3
        seen.append(faiss.omp_get_max_threads())

    try:
        for n in (3, 1):
            set_search_threads(n)
            t = threading.Thread(target=worker)
            t.start()
            t.join()
            assert seen[-1] == n
    finally:
        set_search_threads(1)


def _delta_rows(idx: NamespaceIndex) -> int:
    return len(idx._snap.delta_labels)


def test_a_small_namespace_holds_a_small_delta_that_grows_as_it_fills():
    """Chat traffic has about one namespace per conversation turn: a full-size delta each
    (2048 x 384 floats, 3 MiB of address space) cost 25-140 KiB of RSS per entry."""
    rng = np.random.default_rng(3)
    for background in (False, True):
        idx = NamespaceIndex(IndexParams(384, hnsw_min_entries=10_000, delta_capacity=2048),
                             background=background)
        vecs = _unit(rng, 300, 384)
        idx.add(1, vecs[0])
        assert _delta_rows(idx) <= 16
        for i, v in enumerate(vecs[1:], start=2):
            idx.add(i, v)
        assert 300 <= _delta_rows(idx) <= 512  # doubled as needed, not the full 2048
        for i in (0, 150, 299):
            assert idx.search(vecs[i], 1)[0].label == i + 1
        idx.check_integrity()
        idx.close(5)
    # An uneven capacity is reached exactly (inline merges happen at that size).
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000, delta_capacity=100),
                         background=False)
    vecs = _unit(rng, 250)
    for i, v in enumerate(vecs):
        idx.add(i, v)
        assert _delta_rows(idx) <= 100
    assert all(idx.search(vecs[i], 1)[0].label == i for i in (0, 99, 100, 249))
    idx.check_integrity()


def test_a_namespace_holds_only_the_delta_rows_its_entries_need():
    """Most namespaces of chat traffic hold one entry: an empty one holds no delta rows, one
    entry one row (two held a second 1.5 KiB row of 384 floats per namespace, a third of its
    memory), and the delta doubles from there, every entry found exactly."""
    rng = np.random.default_rng(11)
    vecs = _unit(rng, 5, 384)
    idx = NamespaceIndex(IndexParams(384, hnsw_min_entries=1000), background=False)
    assert _delta_rows(idx) == 0
    for n, want in ((1, 1), (2, 2), (3, 4), (5, 8)):
        while len(idx) < n:
            idx.add(len(idx), vecs[len(idx)])
        assert _delta_rows(idx) == want
        for i in range(n):
            assert idx.search(vecs[i], n) == idx.search_exact(vecs[i], n)
            assert idx.search(vecs[i], 1)[0].label == i
    idx.check_integrity()


def test_after_a_merge_the_delta_starts_small_again():
    rng = np.random.default_rng(5)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000, delta_capacity=64),
                         background=False)
    for i, v in enumerate(_unit(rng, 64)):  # fills the delta: merged inline
        idx.add(i, v)
    idx.compact()
    assert _delta_rows(idx) <= 2


def test_a_namespace_that_adopts_a_saved_graph_holds_no_delta_until_written():
    """A namespace loaded at start from a saved graph and never written to again (most of a
    restart's) holds no delta rows; its first add allocates one, found exactly."""
    rng = np.random.default_rng(6)
    vecs = _unit(rng, 40, 32)
    built = NamespaceIndex(IndexParams(32, hnsw_min_entries=10), background=False)
    built.add_many(np.arange(40), vecs)
    built.compact()
    main, main_labels, _ = built.saved_graph()
    fresh = NamespaceIndex(IndexParams(32, hnsw_min_entries=10), background=False)
    assert fresh.adopt(main, main_labels, np.arange(40), vecs, 39)
    assert _delta_rows(fresh) == 0
    extra = _unit(rng, 1, 32)[0]
    fresh.add(40, extra)
    assert _delta_rows(fresh) == 1 and fresh.search(extra, 1)[0].label == 40
    fresh.check_integrity()


def test_removals_while_merges_are_held_start_none_until_released():
    """A namespace being emptied must not purge its tombstones on the way; one that still
    holds entries afterwards purges them once, when the hold ends."""
    rng = np.random.default_rng(7)
    vecs = _unit(rng, 400)
    for background in (False, True):
        idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000, delta_capacity=64),
                             background=background)
        idx.add_many(np.arange(400), vecs)
        builds = []
        real = idx._build

        def counting_build(*a, _real=real, _builds=builds, **kw):
            _builds.append(kw.get("purge", False))
            return _real(*a, **kw)

        idx._build = counting_build
        with idx.merges_held():
            for lab in range(300):
                assert idx.remove(lab)
            assert builds == [] and idx._merging is None
            assert idx.search(vecs[350], 1)[0].label == 350
        # the release purged inline, or started a merge
        holds_within(lambda i=idx: i._merging is None, 30, 0.02)
        assert builds == [True] and len(idx._dead) == 0
        idx.check_integrity()
        assert len(idx) == 100 and idx.search(vecs[399], 1)[0].label == 399
        idx.close(5)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000))
    idx.add_many(np.arange(400), vecs)
    with idx.merges_held():
        for lab in range(400):
            idx.remove(lab)
    assert idx._merging is None  # emptied: nothing to rebuild


def test_a_built_index_holds_no_delta_until_written_to():
    """Every namespace loaded at start kept a 2-row delta it might never use: 3 KiB at 384
    dimensions, per namespace, and chat traffic has about one namespace per turn."""
    rng = np.random.default_rng(9)
    vecs = _unit(rng, 40)
    for background in (False, True):
        idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000, delta_capacity=4),
                             background=background)
        idx.add_many(np.arange(10), vecs[:10])
        assert _delta_rows(idx) == 0
        assert idx.search(vecs[3], 1)[0].label == 3
        for i in range(10, 40):  # grows from nothing; merges (inline or not) empty it again
            idx.add(i, vecs[i])
            assert idx.search(vecs[i], 1)[0].label == i
        idx.check_integrity()
        idx.close(5)
        idx.compact()
        assert _delta_rows(idx) == 0 and len(idx) == 40
        idx.check_integrity()


def test_background_merges_wait_for_a_process_wide_slot(monkeypatch):
    """Every namespace merged on its own thread at once: many namespaces filling together
    built many indexes at once (HNSW on every core, a copy of the vectors each). A merge now
    waits for one of a few process-wide slots; its namespace keeps taking adds meanwhile,
    and one shut down while waiting builds nothing."""
    from services.semantic import index as index_mod

    slots = threading.BoundedSemaphore(1)
    monkeypatch.setattr(index_mod, "MERGE_SLOTS", slots)
    rng = np.random.default_rng(9)
    vecs = _unit(rng, 40)

    def waiting_index() -> tuple[NamespaceIndex, list[int]]:
        idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=10**6, delta_capacity=16))
        builds: list[int] = []
        real = idx._build
        idx._build = lambda *a, **kw: builds.append(1) or real(*a, **kw)
        for i in range(20):  # past 3/4 of the delta: a merge is asked for
            idx.add(i, vecs[i])
        return idx, builds

    assert slots.acquire(timeout=1)  # another namespace's merge holds the only slot
    idx, builds = waiting_index()
    time.sleep(0.3)
    assert idx.merging and builds == []  # waiting, not building
    for i in range(20, 40):
        idx.add(i, vecs[i])  # the namespace still takes adds...
    assert [n.label for n in idx.search(vecs[33])][:1] == [33]  # ...and serves them
    slots.release()
    settled(idx)
    assert builds, "the merge did not run once a slot was free"

    assert slots.acquire(timeout=5)
    closing, builds = waiting_index()
    closing.close(timeout=0.2)  # shutdown while it waits
    slots.release()
    holds_within(lambda: closing._merging is None, 10, 0.02)
    assert closing._merging is None and builds == []


@pytest.mark.parametrize("hnsw_min", [10**9, 1000])  # a flat main, an HNSW main
def test_the_index_keeps_its_vectors_once_in_faiss_not_again_beside_it(hnsw_min):
    """Each snapshot kept a numpy copy of every vector beside faiss's own (for rebuilds):
    about 3 GB more at 2M entries. The vectors now come from faiss's storage when needed."""
    import gc
    import tracemalloc

    rng = np.random.default_rng(5)
    vecs = _unit(rng, 4000, 384)  # 6 MB (MiniLM's width), allocated before tracing
    tracemalloc.start()
    try:
        idx = NamespaceIndex(IndexParams(384, hnsw_min_entries=hnsw_min, delta_capacity=64),
                             background=False)
        idx.add_many(np.arange(4000), vecs)
        for i in range(100):  # a merge through the delta as well
            idx.add(4000 + i, vecs[i])
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < vecs.nbytes / 4, held
    assert idx.search(vecs[123], 1)[0].label in (123, 4123)
    assert [nb.label for nb in idx.search_exact(vecs[7], 2)] in ([7, 4007], [4007, 7])
    idx.check_integrity()
