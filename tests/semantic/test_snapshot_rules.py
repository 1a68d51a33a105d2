"""Snapshot saves at their edges: every file is durable before the manifest naming it is renamed
into place, a failed save leaves no temporary manifest, and a manifest naming files outside the
save's own names is not read.

Written for what a mutation audit found no test checking; each was seen failing on a hand-made
mutant of the rule it checks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from services.semantic import snapshot
from tests.semantic.test_snapshot import PARAMS, hnsw_of, unit_rows
from tests.waits import holds_within

KEY = ("tenant-a", "smollm2", "")


def graph():
    """A 60-row HNSW graph and its labels."""
    return hnsw_of(np.arange(1, 61, dtype=np.int64), unit_rows(60, 0))


def test_every_file_is_fsynced_before_the_manifest_is_renamed_into_place(tmp_path,
                                                                           monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(str(src)), os.path.basename(str(dst))))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    main, labels = graph()
    folder = tmp_path / "snap"
    snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)])
    (rename,) = [i for i, e in enumerate(events) if e[0] == "replace"]
    synced_before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    tmp_manifest = events[rename][1]
    written = {p.name for p in folder.iterdir() if p.name != snapshot.MANIFEST}
    assert written and written <= synced_before, (written, synced_before)
    assert tmp_manifest in synced_before
    assert ("fsync", "snap") in events[rename:]  # the rename itself, durable


def test_a_save_failing_while_writing_the_manifest_leaves_no_temporary_file(tmp_path,
                                                                            monkeypatch):
    main, labels = graph()
    folder = tmp_path / "snap"

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot.json, "dump", full)
    with pytest.raises(OSError):
        snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)])
    assert sorted(p.name for p in folder.iterdir()) == []


def test_a_manifest_naming_files_outside_the_saves_own_names_is_not_read(tmp_path):
    main, labels = graph()
    folder = tmp_path / "snap"
    snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)])
    path = folder / snapshot.MANIFEST
    manifest = json.loads(path.read_text())
    (sub := folder / "sub").mkdir()
    stem = manifest["namespaces"][0]["stem"]
    manifest["namespaces"][0]["stem"] = f"sub/../{stem}"  # the same files, another name
    path.write_text(json.dumps(manifest))
    assert snapshot.Saved(folder, PARAMS, "emb").take(KEY) is None
    assert sub.exists()


def test_a_save_removes_no_file_whose_name_only_starts_like_its_own(tmp_path):
    main, labels = graph()
    folder = tmp_path / "snap"
    folder.mkdir()
    (folder / "1234-0.faiss.bak").write_text("an operator's copy")
    snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)])
    assert (folder / "1234-0.faiss.bak").exists()


@pytest.mark.parametrize("suffix", [".faiss", ".labels.npy"])
def test_a_graph_whose_files_went_missing_is_written_again_at_the_next_save(tmp_path, suffix):
    """A graph unchanged since the last save keeps its files, but only while they are there:
    one deleted since (a cleanup of the folder, a lost file) is written again, so that the
    next start still takes every graph rather than building one (a mutation audit found
    nothing checking it)."""
    main, labels = graph()
    folder = tmp_path / "snap"
    state = snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)])
    (gone,) = [p for p in folder.iterdir() if p.name.endswith(suffix)]
    gone.unlink()
    snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)], previous=state)
    got = snapshot.Saved(folder, PARAMS, "emb").take(KEY)
    assert got is not None
    assert got[0].ntotal == main.ntotal and got[1].tolist() == labels.tolist()


def test_a_new_processs_save_with_no_graph_supersedes_the_snapshot_it_found(tmp_path):
    """A save handed no graph and no `previous` (the first save of a new process) still
    replaces the manifest a past process left: it returned at once ("nothing merged since"),
    and the past graphs' files stayed in the folder for good while every namespace was flat,
    and were read again (and refused as another database's) once one grew back. Found by
    tests/semantic/test_snapshot_differential.py."""
    main, labels = graph()
    folder = tmp_path / "snap"
    snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)])
    assert snapshot.save(folder, PARAMS, "emb", []) == {}
    assert sorted(p.name for p in folder.iterdir()) == [snapshot.MANIFEST]
    assert json.loads((folder / snapshot.MANIFEST).read_text())["namespaces"] == []
    assert snapshot.Saved(folder, PARAMS, "emb").take(KEY) is None


def test_a_save_removes_temporary_manifests_of_saves_killed_and_nothing_like_them(
        tmp_path, monkeypatch):
    """A save killed between writing its temporary manifest and renaming it leaves that file;
    the next save removes it (saves remove the files saves wrote that no manifest names). A
    save that fails removes its own temporary manifest only: it removed every file whose name
    began `.manifest.json.` (an editor's swap file of the manifest, say). Found by
    tests/semantic/test_snapshot_differential.py."""
    main, labels = graph()
    folder = tmp_path / "snap"
    folder.mkdir()
    (folder / ".manifest.json.4242.tmp").write_text("{}")  # a save killed before its rename
    (folder / ".manifest.json.swp").write_text("an editor's")
    snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)])
    assert not (folder / ".manifest.json.4242.tmp").exists()
    assert (folder / ".manifest.json.swp").exists()

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot.json, "dump", full)
    with pytest.raises(OSError):
        snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 2)])
    assert (folder / ".manifest.json.swp").exists()
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_snapshot_is_taken_under_another_name_of_the_same_weights_only(tmp_path):
    """Renaming the model (TIERCACHE_SEMANTIC_MODEL_NAME) re-embeds nothing, but its graphs
    were ignored as "built with other settings" and built again; other weights still are."""
    main, labels = graph()
    folder = tmp_path / "snap"
    snapshot.save(folder, PARAMS, "all-MiniLM-L6-v2@c271f490407437f4", [(KEY, main, labels, 1)])
    assert snapshot.Saved(folder, PARAMS, "minilm-prod@c271f490407437f4").take(KEY) is not None
    for other in ("all-MiniLM-L6-v2@0000000000000000", "all-MiniLM-L6-v2"):
        assert snapshot.Saved(folder, PARAMS, other).take(KEY) is None
    manifest = folder / snapshot.MANIFEST  # an embedder that is no identity: ignored
    text = manifest.read_text()
    assert text.count("\"all-MiniLM-L6-v2@c271f490407437f4\"") == 1
    manifest.write_text(text.replace('"all-MiniLM-L6-v2@c271f490407437f4"', "5"))
    assert snapshot.Saved(folder, PARAMS, "minilm-prod@c271f490407437f4").take(KEY) is None


def test_graph_files_without_their_manifest_are_said_once_at_warning(tmp_path, caplog):
    """A manifest gone while the graphs it named are still there (deleted, left out of a copy)
    was taken for a first start: every graph was built again without a line. One WARNING names
    the manifest and says the graphs are built from SQLite; no folder, or an empty one, is a
    first start and says nothing."""
    import logging

    main, labels = graph()
    folder = tmp_path / "snap"
    with caplog.at_level(logging.WARNING, logger=snapshot.__name__):
        assert snapshot.Saved(folder, PARAMS, "emb").take(KEY) is None  # no folder
        folder.mkdir()
        assert snapshot.Saved(folder, PARAMS, "emb").take(KEY) is None  # an empty one
        assert caplog.records == []
        snapshot.save(folder, PARAMS, "emb", [(KEY, main, labels, 1)])
        (folder / snapshot.MANIFEST).unlink()
        caplog.clear()
        assert snapshot.Saved(folder, PARAMS, "emb").take(KEY) is None
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1, lines
    assert f"{folder / snapshot.MANIFEST} is missing" in lines[0]
    assert "built from SQLite" in lines[0]


@pytest.mark.parametrize("fails", ["exists", "iterdir"])
def test_a_snapshot_folder_that_cannot_be_read_is_one_warning_not_a_failed_start(
        tmp_path, monkeypatch, caplog, fails):
    """A snapshot folder the shard may not read (mode 000: the manifest's stat is EACCES; mode
    300: listing it is) raised PermissionError out of the scan for graph files, stopping the
    start with a traceback, though a snapshot is only a speed-up. One WARNING names the folder
    and the error; every namespace is built from SQLite."""
    import logging
    from pathlib import Path

    folder = tmp_path / "snap"
    folder.mkdir()
    real = getattr(Path, fails)

    def denied(self, *a, **kw):
        if self in (folder, folder / snapshot.MANIFEST):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, fails, denied)
    with caplog.at_level(logging.WARNING, logger=snapshot.__name__):
        assert snapshot.Saved(folder, PARAMS, "emb").take(KEY) is None
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1, lines
    assert str(folder) in lines[0] and "Permission denied" in lines[0], lines[0]
    assert "built" in lines[0]


def test_erasing_a_saved_namespace_has_the_housekeeper_save_at_once(make_cfg, clock, tmp_path):
    """An Invalidate of a namespace (or its tenant) whose HNSW graph was saved left every
    erased entry's embedding in the snapshot's files until the next periodic save (600 s) or
    the stop: the housekeeper now saves at its next tick, dropping them. A flat namespace,
    never saved, asks for no save."""

    from services.semantic.server import Housekeeper
    from tests.semantic.test_snapshot import A, B, FixedEmbedder, filled, settings

    cfg, snap = settings(make_cfg), str(tmp_path / "snap")
    made: list = []
    c = filled(cfg, FixedEmbedder(), clock, snap, made)
    try:
        assert c.save_snapshot(snap) == 1
        graphs = [p for p in os.listdir(snap) if p.endswith(".faiss")]
        assert len(graphs) == 1
        c.invalidate_namespace(B)
        assert c.take_save_request() is False  # flat: nothing of it on disk
        keeper = Housekeeper(c, interval_s=3600, snapshot_path=snap,
                             snapshot_interval_s=3600).start()
        try:
            c.invalidate_tenant(A.tenant)
            holds_within(lambda: not os.path.exists(os.path.join(snap, graphs[0])), 10, 0.02)
        finally:
            keeper.stop()
        assert not [p for p in os.listdir(snap) if p.endswith((".faiss", ".labels.npy"))]
        assert c.take_save_request() is False  # taken by the housekeeper
    finally:
        for x in made:
            x.close_indexes()
            x.store.close()


@pytest.mark.parametrize("interval_s, says", [
    (0.0, "retried at the next erasure or at the stop"), (600.0, "retried in 600 s")])
def test_a_failed_save_after_an_erasure_says_when_it_is_retried(caplog, interval_s, says):
    """An erasure's save that failed with periodic saves off (snapshot_interval_s 0) was
    logged "retried in 0 s", though nothing retries it before the stop or the next erasure."""
    import logging
    import threading

    from services.semantic import server

    tried = threading.Event()

    class Cache:
        class store:  # noqa: N801 - stands in for the cache's store
            @staticmethod
            def flush_hits() -> None:
                pass

        asked = [True]

        def expire(self) -> int:
            return 0

        def take_save_request(self) -> bool:
            return bool(self.asked) and self.asked.pop()

        def save_snapshot(self, path: str) -> int:
            tried.set()
            raise OSError(28, "No space left on device")

    keeper = server.Housekeeper(Cache(), interval_s=3600, snapshot_path="/nowhere",
                                snapshot_interval_s=interval_s)
    with caplog.at_level(logging.ERROR, logger=server.log.name):
        keeper.start()
        try:
            assert tried.wait(10)
        finally:
            keeper.stop()
    lines = [r.getMessage() for r in caplog.records if "HNSW graphs" in r.getMessage()]
    assert len(lines) == 1, lines
    assert says in lines[0] and "No space left" in lines[0], lines[0]
    assert "retried in 0 s" not in lines[0]


def test_a_save_says_how_many_graphs_it_wrote_and_kept(tmp_path, caplog):
    """The save's log line counts the graphs written (and their rows) apart from those kept
    unchanged since the last save: pinned before `save` was split into its steps."""
    a, a_labels = graph()
    b, b_labels = hnsw_of(np.arange(101, 141, dtype=np.int64), unit_rows(40, 1))
    other = ("tenant-b", "smollm2", "")
    folder = tmp_path / "snap"
    state = snapshot.save(folder, PARAMS, "emb", [(KEY, a, a_labels, 1)])
    with caplog.at_level("INFO", logger=snapshot.log.name):
        caplog.clear()  # the first save's line, where a test before left INFO on
        snapshot.save(folder, PARAMS, "emb", [(KEY, a, a_labels, 1), (other, b, b_labels, 1)],
                      previous=state)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved ")]
    assert line.startswith(f"saved 2 HNSW namespaces to {folder} in ")
    assert line.endswith("(1 written, 40 rows; 1 unchanged)")


def test_an_old_file_that_cannot_be_removed_is_a_warning_not_a_failed_save(
        tmp_path, monkeypatch, caplog):
    """The previous save's graph files are removed once the new manifest is in force; one
    that cannot be (a permission changed by hand) is a warning naming it, and the save
    stands: pinned before `save` was split into its steps."""
    a, a_labels = graph()
    folder = tmp_path / "snap"
    state = snapshot.save(folder, PARAMS, "emb", [(KEY, a, a_labels, 1)])
    old = sorted(p for p in folder.iterdir() if p.name != snapshot.MANIFEST)
    real = type(folder).unlink

    def unlink(self, *args, **kwargs):
        if self in old:
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(folder), "unlink", unlink)
    with caplog.at_level("WARNING", logger=snapshot.log.name):
        snapshot.save(folder, PARAMS, "emb", [(KEY, a, a_labels, 2)], previous=state)
    said = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert len(old) == 2 and said == [
        f"could not remove an old snapshot file {p}: [Errno 13] Permission denied" for p in old]
    got = snapshot.Saved(folder, PARAMS, "emb").take(KEY)
    assert got is not None and got[1].tolist() == a_labels.tolist()
