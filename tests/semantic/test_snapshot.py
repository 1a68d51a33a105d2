"""Saved HNSW graphs (services/semantic/snapshot.py): a restart takes a namespace's saved graph
instead of building it, only where it matches the entries in SQLite, and catches up with what
changed since the save."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import faiss
import numpy as np
import pytest

from services.semantic.cache import Namespace, SemanticCache
from services.semantic.index import IndexParams, NamespaceIndex
from services.semantic.server import serve
from services.semantic.store import EntryStore
from tests.metric_sample import sample_value
from tests.semantic.test_cache_edges import FixedEmbedder
from tests.waits import wait_until

A = Namespace("tenant-a", "smollm2", "")
B = Namespace("tenant-b", "smollm2", "ab12")
C = Namespace("tenant-c", "smollm2", "cd34")
DIM = 16
PARAMS = IndexParams(DIM, hnsw_min_entries=40, hnsw_m=8, hnsw_ef_construction=40,
                     hnsw_ef_search=64, delta_capacity=16)


def unit_rows(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def hnsw_of(labels: np.ndarray, vecs: np.ndarray) -> tuple[faiss.Index, np.ndarray]:
    index = NamespaceIndex(PARAMS, background=False)
    index.add_many(labels, vecs)
    main, saved_labels = index.saved_main()
    return faiss.deserialize_index(faiss.serialize_index(main)), saved_labels.copy()


# ---- NamespaceIndex.adopt ------------------------------------------------------------------

def test_an_adopted_graph_finds_what_a_built_one_finds():
    labels, vecs = np.arange(1, 201, dtype=np.int64), unit_rows(200, 0)
    main, saved = hnsw_of(labels, vecs)
    index = NamespaceIndex(PARAMS, background=False)
    assert index.adopt(main, saved, labels, vecs, 200)
    assert index.kind == "hnsw" and len(index) == 200
    for i in range(0, 200, 7):
        assert index.search(vecs[i])[0].label == labels[i]
    index.check_integrity()


def test_an_adopted_graph_drops_entries_gone_since_and_adds_the_new_ones():
    labels, vecs = np.arange(1, 201, dtype=np.int64), unit_rows(200, 1)
    main, saved = hnsw_of(labels, vecs)
    gone = {3, 50, 120}
    keep = np.array([lab not in gone for lab in labels])
    new_l, new_v = np.arange(201, 231, dtype=np.int64), unit_rows(30, 2)
    live_l = np.concatenate([labels[keep], new_l])
    live_v = np.concatenate([vecs[keep], new_v])
    index = NamespaceIndex(PARAMS, background=False)
    assert index.adopt(main, saved, live_l, live_v, 230)
    assert len(index) == 227
    for lab in gone:
        assert all(nb.label != lab for nb in index.search(vecs[lab - 1], k=5))
    for lab, v in zip(new_l, new_v, strict=True):
        assert index.search(v)[0].label == lab
    index.check_integrity()


def test_a_graph_whose_vectors_differ_from_the_entries_is_not_adopted():
    labels, vecs = np.arange(1, 101, dtype=np.int64), unit_rows(100, 3)
    main, saved = hnsw_of(labels, vecs)
    other = vecs.copy()
    other[17] = unit_rows(1, 4)[0]  # one entry re-embedded (or another database's row 18)
    index = NamespaceIndex(PARAMS, background=False)
    assert not index.adopt(main, saved, labels, other, 100)
    assert index.kind == "empty" and len(index) == 0  # unchanged: the caller builds
    flat = faiss.IndexFlatIP(DIM)
    flat.add(vecs)
    assert not index.adopt(flat, labels, labels, vecs, 100)  # not a graph
    assert not index.adopt(main, saved[:-1], labels, vecs, 100)  # labels that do not fit it
    # Labels past what the store has ever given: a graph from a later state of the database.
    assert not index.adopt(main, saved, labels[:90], vecs[:90], 90)
    # None of the live entries in it: nothing to check it by (another database's).
    assert not index.adopt(main, saved, labels[:0], vecs[:0], 1000)
    assert index.adopt(main, saved, labels, vecs, 100)


# ---- through the cache, with SQLite --------------------------------------------------------

@pytest.fixture
def emb() -> FixedEmbedder:
    return FixedEmbedder()


def opened(cfg, emb, clock, snapshot: str, made: list) -> SemanticCache:
    for old in made:  # one process at a time holds a database: the earlier one has stopped
        if old.store.path == cfg.resolved_db_path() and not old.store._closed:
            old.close_indexes()
            old.store.close()
    c = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    c.load(snapshot)
    made.append(c)
    return c


@pytest.fixture
def caches():
    made: list[SemanticCache] = []
    yield made
    for c in made:
        if not c.store._closed:
            c.close_indexes()
            c.store.close()


def probe(emb: FixedEmbedder, prompt: str) -> str:
    """Another text with `prompt`'s vector: found through the index, not by its text."""
    emb.fixed[f"probe {prompt}"] = emb.embed_one(prompt)
    return f"probe {prompt}"


def settings(make_cfg, **kw):
    return make_cfg(hnsw_min_entries=40, hnsw_m=8, hnsw_ef_construction=40, hnsw_ef_search=64,
                    delta_capacity=16, guard_tiers=(), verifier_tiers=(), **kw)


def filled(cfg, emb, clock, snap, caches, n=120) -> SemanticCache:
    c = opened(cfg, emb, clock, snap, caches)
    for i in range(n):
        c.store_entry(A, f"q{i}", f"answer {i}")
    for i in range(10):
        c.store_entry(B, f"b{i}", f"b answer {i}")  # small: flat, not saved
    c.index_of(A).compact()
    c.index_of(B).compact()
    assert c.index_of(A).kind == "hnsw" and c.index_of(B).kind == "flat"
    return c


def metric(name: str, **labels) -> float:

    return sample_value(name, labels) or 0.0


def test_a_restart_takes_the_saved_graph_and_serves_the_same(make_cfg, emb, clock, caches,
                                                             tmp_path):
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, snap, caches)
    saves = metric("tiercache_semantic_snapshot_saves_total", result="ok")
    assert c.save_snapshot(snap) == 1
    assert metric("tiercache_semantic_snapshot_saves_total", result="ok") == saves + 1
    assert metric("tiercache_semantic_snapshot_last_save_timestamp_seconds") > 0
    c2 = opened(cfg, emb, clock, snap, caches)
    assert c2.graphs_adopted == 1 and c2.index_of(A).kind == "hnsw"
    assert metric("tiercache_semantic_hnsw_graphs_from_snapshot") == 1
    for i in range(0, 120, 11):
        r = c2.lookup(A, probe(emb, f"q{i}"))
        assert r.hit and r.entry.prompt == f"q{i}" and not r.exact
    assert c2.lookup(B, probe(emb, "b3")).entry.prompt == "b3"
    c2.check_integrity()


def test_the_save_age_clock_starts_at_the_start(make_cfg, emb, clock, caches, tmp_path):
    """The gauge read 0 (1970) until the first periodic save, ten minutes in: an alert on its
    age fired at every start."""
    gauge = "tiercache_semantic_snapshot_last_save_timestamp_seconds"
    before = time.time()
    opened(settings(make_cfg), emb, clock, str(tmp_path / "snap"), caches)
    assert metric(gauge) >= before


def test_a_restart_catches_up_with_what_changed_after_the_save(make_cfg, emb, clock, caches,
                                                               tmp_path):
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, snap, caches)
    c.save_snapshot(snap)
    # Then, before a kill -9 (no save): entries removed, others stored.
    gone = [c.lookup(A, f"q{i}").entry.id for i in range(10)]
    for entry_id in gone:
        c.invalidate_id(entry_id)
    for i in range(20):
        c.store_entry(A, f"r{i}", f"r answer {i}")
    c2 = opened(cfg, emb, clock, snap, caches)
    assert c2.graphs_adopted == 1
    assert len(c2.index_of(A)) == 130
    for i in range(10):
        r = c2.lookup(A, probe(emb, f"q{i}"))
        assert not r.hit and (r.entry is None or r.entry.prompt != f"q{i}")
    for i in range(20):
        r = c2.lookup(A, probe(emb, f"r{i}"))
        assert r.hit and r.entry.prompt == f"r{i}"
    c2.check_integrity()


def test_a_namespace_shrunk_below_the_hnsw_size_since_the_save_is_built_flat(
        make_cfg, emb, clock, caches, tmp_path, caplog):
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, snap, caches)
    c.save_snapshot(snap)
    gone = [c.lookup(A, f"q{i}").entry.id for i in range(90)]
    for entry_id in gone:  # 30 left, under hnsw_min_entries (40)
        c.invalidate_id(entry_id)
    with caplog.at_level(logging.WARNING):
        c2 = opened(cfg, emb, clock, snap, caches)
    assert c2.graphs_adopted == 0 and "does not match" not in caplog.text
    assert c2.index_of(A).kind == "flat" and len(c2.index_of(A)) == 30
    for i in range(90, 120):
        r = c2.lookup(A, probe(emb, f"q{i}"))
        assert r.hit and r.entry.prompt == f"q{i}"
    assert not c2.lookup(A, probe(emb, "q5")).hit
    c2.check_integrity()


def test_another_databases_snapshot_is_not_taken(make_cfg, emb, clock, caches, tmp_path):
    snap = str(tmp_path / "snap")
    first = filled(settings(make_cfg, db_path=str(tmp_path / "one.db")), emb, clock, snap,
                   caches)
    first.save_snapshot(snap)
    # The same labels and namespace in another database, with other texts (other vectors).
    cfg2 = settings(make_cfg, db_path=str(tmp_path / "two.db"))
    c = opened(cfg2, emb, clock, "", caches)
    for i in range(120):
        c.store_entry(A, f"other {i}", f"other answer {i}")
    c.close_indexes()
    c.store.close()
    c2 = opened(cfg2, emb, clock, snap, caches)
    assert c2.graphs_adopted == 0
    for i in range(0, 120, 13):
        assert c2.lookup(A, probe(emb, f"other {i}")).entry.prompt == f"other {i}"
    c2.check_integrity()


def test_a_damaged_or_mismatched_snapshot_is_ignored_with_a_warning(make_cfg, emb, clock, caches,
                                                                    tmp_path, caplog):
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, snap, caches)
    c.save_snapshot(snap)
    (graph,) = [p for p in os.listdir(snap) if p.endswith(".faiss")]
    with open(os.path.join(snap, graph), "r+b") as f:
        f.truncate(100)  # cut short
    with caplog.at_level(logging.WARNING, logger="services.semantic.snapshot"):
        c2 = opened(cfg, emb, clock, snap, caches)
    assert c2.graphs_adopted == 0 and "ignoring the saved HNSW graph" in caplog.text
    assert c2.lookup(A, probe(emb, "q5")).entry.prompt == "q5"
    # Saved again, then read with other index settings: the manifest is not taken at all.
    c2.index_of(A).compact()
    c2.save_snapshot(snap)
    assert len([p for p in os.listdir(snap) if p.endswith(".faiss")]) == 1  # the old one gone
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.semantic.snapshot"):
        other = make_cfg(hnsw_min_entries=40, hnsw_m=16, hnsw_ef_construction=40,
                         delta_capacity=16, guard_tiers=(), verifier_tiers=())
        c3 = opened(other, emb, clock, snap, caches)
    assert c3.graphs_adopted == 0 and "built with other settings" in caplog.text
    assert c3.lookup(A, probe(emb, "q7")).entry.prompt == "q7"
    with open(os.path.join(snap, "manifest.json"), "w") as f:
        f.write('{"format": 1, "embed')  # cut short
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.semantic.snapshot"):
        c4 = opened(cfg, emb, clock, snap, caches)
    assert c4.graphs_adopted == 0 and "ignoring the HNSW snapshot" in caplog.text


def served_then_stopped(cfg, emb) -> None:
    """The service run over `cfg`'s database with 60 entries in A's HNSW graph, then stopped
    cleanly (which saves the graph)."""
    s = serve(cfg, embedder=emb)
    try:
        for i in range(60):
            s.cache.store_entry(A, f"q{i}", f"answer {i}")
        s.cache.index_of(A).compact()
    finally:
        s.stop(grace=0)


def test_a_clean_stop_saves_the_graphs_and_the_next_start_takes_them(make_cfg, emb, tmp_path):
    cfg = settings(make_cfg)
    served_then_stopped(cfg, emb)
    manifest = json.loads(open(os.path.join(cfg.resolved_snapshot_path(),
                                            "manifest.json")).read())
    assert [e["rows"] for e in manifest["namespaces"]] == [60]
    s2 = serve(cfg, embedder=emb)
    try:
        assert s2.cache.graphs_adopted == 1
        assert s2.cache.lookup(A, probe(emb, "q9")).entry.prompt == "q9"
    finally:
        s2.stop(grace=0)
    off = settings(make_cfg, snapshot_on_stop=False, snapshot_path=str(tmp_path / "never"))
    s3 = serve(off, embedder=emb)
    s3.stop(grace=0)
    assert not os.path.exists(tmp_path / "never")


def test_a_graph_file_changed_in_place_is_not_read(make_cfg, emb, clock, caches, tmp_path,
                                                    caplog):
    # One flipped byte keeps the size: faiss could read a garbled size field and allocate it
    # (or crash) instead of raising, so the file's digest is checked first.
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, snap, caches)
    c.save_snapshot(snap)
    (graph,) = [p for p in os.listdir(snap) if p.endswith(".faiss")]
    path = os.path.join(snap, graph)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="services.semantic.snapshot"):
        c2 = opened(cfg, emb, clock, snap, caches)
    assert c2.graphs_adopted == 0 and "not the file the snapshot saved" in caplog.text
    assert c2.lookup(A, probe(emb, "q4")).entry.prompt == "q4"


def test_a_save_that_fails_leaves_the_previous_snapshot_and_no_files_of_its_own(
        make_cfg, emb, clock, caches, tmp_path, monkeypatch):
    from services.semantic import snapshot

    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, snap, caches)
    c.save_snapshot(snap)
    before = sorted(os.listdir(snap))
    for i in range(120, 200):  # a second HNSW namespace, so the save fails half way
        c.store_entry(B, f"b{i}", "x")
    c.index_of(B).compact()
    real = snapshot.faiss.write_index
    calls = []

    def full_disk(index, path):
        calls.append(path)
        real(index, path)  # the file half written, say
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot.faiss, "write_index", full_disk)
    failed = metric("tiercache_semantic_snapshot_saves_total", result="failed")
    with pytest.raises(OSError):
        c.save_snapshot(snap)  # A's graph is unchanged (kept), B's is new: written, and fails
    assert metric("tiercache_semantic_snapshot_saves_total", result="failed") == failed + 1
    assert len(calls) == 1 and sorted(os.listdir(snap)) == before
    monkeypatch.undo()
    c2 = opened(cfg, emb, clock, snap, caches)
    assert c2.graphs_adopted == 1  # A's, from the save before (B's graph is built)


def test_the_snapshot_is_the_owners_alone_and_not_made_for_nothing(make_cfg, emb, clock, caches,
                                                                   tmp_path):
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = opened(cfg, emb, clock, snap, caches)
    c.store_entry(A, "q", "a")  # flat: no graph to save
    assert c.save_snapshot(snap) == 0 and not os.path.exists(snap)
    for i in range(60):
        c.store_entry(A, f"q{i}", "a")
    c.index_of(A).compact()
    assert c.save_snapshot(snap) == 1
    assert os.stat(snap).st_mode & 0o777 == 0o700
    assert {os.stat(os.path.join(snap, p)).st_mode & 0o777 for p in os.listdir(snap)} == {0o600}
    c.invalidate_namespace(A)  # the graph gone: the empty manifest supersedes the saved one
    assert c.save_snapshot(snap) == 0
    assert os.listdir(snap) == ["manifest.json"]


def test_a_graph_saved_after_the_backup_the_database_was_restored_from_is_not_taken(
        make_cfg, emb, clock, caches, tmp_path):
    # Taken, its rows of the labels the backup never gave stayed as tombstones while the
    # database gave those labels again: 20 of 30 Stores failed ("label ... already indexed").
    db, snap = tmp_path / "s.db", str(tmp_path / "snap")
    cfg = settings(make_cfg, db_path=str(db))
    c = filled(cfg, emb, clock, "", caches, n=100)
    c.close_indexes()
    c.store.close()
    shutil.copy(db, tmp_path / "backup.db")
    c = opened(cfg, emb, clock, "", caches)
    for i in range(20):
        c.store_entry(A, f"late{i}", f"late answer {i}")
    c.index_of(A).compact()
    c.save_snapshot(snap)
    c.close_indexes()
    c.store.close()
    for p in tmp_path.glob("s.db*"):
        p.unlink()
    shutil.copy(tmp_path / "backup.db", db)
    c2 = opened(cfg, emb, clock, snap, caches)
    assert c2.graphs_adopted == 0
    for i in range(30):
        c2.store_entry(A, f"new{i}", f"new answer {i}")
    assert c2.lookup(A, probe(emb, "new7")).entry.prompt == "new7"
    c2.check_integrity()


def test_a_save_into_the_databases_own_folder_removes_only_its_own_files(make_cfg, emb, clock,
                                                                        caches, tmp_path):
    cfg = settings(make_cfg, db_path=str(tmp_path / "s.db"), snapshot_path=str(tmp_path))
    c = filled(cfg, emb, clock, "", caches)
    (tmp_path / "notes.txt").write_text("an operator's")
    before = set(os.listdir(tmp_path))
    c.save_snapshot(cfg.resolved_snapshot_path())
    c.index_of(A).compact()
    c.save_snapshot(cfg.resolved_snapshot_path())  # the first save's files are removed...
    after = set(os.listdir(tmp_path))
    assert before <= after  # ...and nothing else: the database, its WAL and lock, the notes
    assert len([p for p in after if p.endswith(".faiss")]) == 1


def test_a_failed_fsync_after_the_manifest_is_renamed_keeps_the_new_snapshot(
        make_cfg, emb, clock, caches, tmp_path, monkeypatch, caplog):
    from services.semantic import snapshot

    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, "", caches)
    c.save_snapshot(snap)
    real = snapshot.fsync_path

    def eio_on_folders(p):
        if os.path.isdir(p):
            raise OSError(5, "Input/output error")
        real(p)

    monkeypatch.setattr(snapshot, "fsync_path", eio_on_folders)
    c.store_entry(A, "one more", "x")
    c.index_of(A).compact()  # a new graph, so this save writes
    with caplog.at_level(logging.WARNING, logger="services.semantic.snapshot"):
        assert c.save_snapshot(snap) == 1
    assert "could not fsync" in caplog.text
    monkeypatch.undo()
    assert opened(cfg, emb, clock, snap, caches).graphs_adopted == 1


def test_with_snapshots_off_a_start_takes_none_saved_before(make_cfg, emb):
    cfg = settings(make_cfg)
    served_then_stopped(cfg, emb)
    s2 = serve(settings(make_cfg, snapshot_on_stop=False), embedder=emb)
    try:
        assert s2.cache.graphs_adopted == 0
        assert s2.cache.lookup(A, probe(emb, "q3")).entry.prompt == "q3"
    finally:
        s2.stop(grace=0)



def test_a_save_rewrites_only_the_graphs_merged_since_the_last_one(make_cfg, emb, clock, caches,
                                                                   tmp_path):
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, "", caches)
    for i in range(60):
        c.store_entry(B, f"bb{i}", "x")
    c.index_of(B).compact()
    assert c.save_snapshot(snap) == 2
    files = {p: os.stat(os.path.join(snap, p)).st_ino for p in os.listdir(snap)}
    manifest_at = os.stat(os.path.join(snap, "manifest.json")).st_mtime_ns
    assert c.save_snapshot(snap) == 2  # nothing merged since: nothing written
    assert {p: os.stat(os.path.join(snap, p)).st_ino for p in os.listdir(snap)} == files
    assert os.stat(os.path.join(snap, "manifest.json")).st_mtime_ns == manifest_at
    c.store_entry(A, "one more", "x")
    c.index_of(A).compact()  # A's graph merged: only its files are written again
    assert c.save_snapshot(snap) == 2
    now = set(os.listdir(snap))
    b_files = {p for p in files if p.endswith((".faiss", ".npy"))
               and p.split("-")[1].startswith("1")}
    assert b_files and b_files <= now  # B's (the second namespace saved) kept as they were
    assert len([p for p in now if p.endswith(".faiss")]) == 2
    c2 = opened(cfg, emb, clock, snap, caches)
    assert c2.graphs_adopted == 2
    assert c2.lookup(A, probe(emb, "one more")).entry.prompt == "one more"


def test_the_graphs_are_saved_while_running_so_a_crash_restart_takes_them(make_cfg, emb,
                                                                          tmp_path):
    cfg = settings(make_cfg, snapshot_interval_s=1)
    manifest = os.path.join(cfg.resolved_snapshot_path(), "manifest.json")
    s = serve(cfg, embedder=emb)
    crashed = False
    try:
        for i in range(60):
            s.cache.store_entry(A, f"q{i}", f"answer {i}")
        s.cache.index_of(A).compact()
        wait_until(lambda: os.path.exists(manifest) and json.loads(open(manifest).read())[
            "namespaces"], 10, "no periodic save", every=0.05)
        for i in range(5):  # stored after the save: caught up from SQLite at the next start
            s.cache.store_entry(A, f"late{i}", f"late answer {i}")
        # A crash: nothing saved at the end (the process is gone; its lock goes with it).
        s.handle.stop(0)
        s.housekeeper.stop()
        s.cache.close_indexes()
        s.cache.store.close()
        crashed = True
    finally:
        if not crashed:
            s.stop(grace=0)
    s2 = serve(cfg, embedder=emb)
    try:
        assert s2.cache.graphs_adopted == 1
        assert s2.cache.lookup(A, probe(emb, "late3")).entry.prompt == "late3"
        assert s2.cache.lookup(A, probe(emb, "q8")).entry.prompt == "q8"
    finally:
        s2.stop(grace=0)


def test_a_graph_merged_since_the_last_save_is_written_though_it_took_the_old_ones_address(
        make_cfg, emb, clock, caches, tmp_path, monkeypatch):
    """A graph's token was its object's id() with its row counts: CPython gives a freed
    object's address to the next one, so a graph merged since the last save (the old one
    freed) with as many rows was taken for the saved one and its files kept, stale, until it
    changed again (1 seed in 150 of tests/semantic/test_snapshot_differential.py). Here every
    object has one address."""
    from services.semantic import cache as cache_module

    monkeypatch.setattr(cache_module, "id", lambda obj: 1, raising=False)
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, "", caches)
    c.save_snapshot(snap)
    c.invalidate_id(c.lookup(A, "q0").entry.id)
    c.store_entry(A, "new", "x")
    c.index_of(A).compact()  # as many rows as the saved graph, one label another
    c.save_snapshot(snap)
    (entry,) = json.loads(open(os.path.join(snap, "manifest.json")).read())["namespaces"]
    saved = np.load(os.path.join(snap, entry["stem"] + ".labels.npy"))
    assert saved.tolist() == c.index_of(A).saved_main()[1].tolist()


def test_a_save_walks_the_namespaces_outside_the_cache_lock(make_cfg, emb, clock, caches,
                                                            tmp_path, monkeypatch):
    """Chat traffic holds up to a namespace per entry (2M a shard): walked under the lock,
    every save held each Lookup and Store for the whole walk. A namespace emptied during the
    walk is not saved (an erasure)."""
    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    c = filled(cfg, emb, clock, snap, caches)
    for i in range(60):
        c.store_entry(C, f"c{i}", "a")
    c.index_of(C).compact()
    real, locked = NamespaceIndex.saved_graph, []

    def watched(index):
        locked.append(c._lock._is_owned())
        if index is c.index_of(C):
            c.invalidate_namespace(C)  # emptied between the walk and the save
        return real(index)

    monkeypatch.setattr(NamespaceIndex, "saved_graph", watched)
    assert c.save_snapshot(snap) == 1  # A's graph; not C's, emptied meanwhile
    assert len(locked) == 3 and not any(locked)
    monkeypatch.undo()
    r = opened(cfg, emb, clock, snap, caches)
    assert r.graphs_adopted == 1 and r.index_of(C) is None


def test_a_save_removes_the_manifest_a_killed_save_left_half_written(make_cfg, emb, clock,
                                                                     caches, tmp_path):
    """A save killed before its rename leaves its temporary manifest (named by its pid): the
    next save removes it with the old graph files, or each crash left one more."""
    cfg, snap = settings(make_cfg), tmp_path / "snap"
    c = filled(cfg, emb, clock, str(snap), caches)
    snap.mkdir(parents=True, exist_ok=True)
    left = snap / ".manifest.json.99999.tmp"
    left.write_text('{"half')
    assert c.save_snapshot(str(snap)) == 1
    assert not left.exists() and (snap / "manifest.json").exists()
