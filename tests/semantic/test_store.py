"""EntryStore on real SQLite: failed writes leave no open transaction, old databases upgrade."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from services.semantic.store import EntryStore, pack_tokens, unpack_tokens

VEC = np.ones(4, np.float32) / 2.0


def insert(st: EntryStore, eid: str, **kw) -> int:
    args = dict(id=eid, tenant="t", model_id="m", context_hash="", prompt=f"q {eid}",
                answer=f"a {eid}", embedding=VEC, embed_model="e", verified=False,
                created_at=1.0, ttl_seconds=0)
    args.update(kw)
    return st.insert(**args)


def create_old_table(db: sqlite3.Connection, *added: str) -> None:
    """The entries table as the first build created it, with the columns `added` since."""
    db.execute("CREATE TABLE entries (" + ", ".join((
        "label INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, "
        "tenant TEXT NOT NULL, model_id TEXT NOT NULL, context_hash TEXT NOT NULL, "
        "prompt TEXT NOT NULL, answer TEXT NOT NULL, embedding BLOB NOT NULL, "
        "embed_model TEXT NOT NULL, verified INTEGER NOT NULL DEFAULT 0, "
        "created_at REAL NOT NULL, last_hit_at REAL NOT NULL DEFAULT 0, "
        "hit_count INTEGER NOT NULL DEFAULT 0, ttl_seconds INTEGER NOT NULL DEFAULT 0",
        *added)) + ")")


def committed_ids(path) -> set[str]:
    """What another connection sees: only committed rows."""
    with sqlite3.connect(path) as other:
        return {r[0] for r in other.execute("SELECT id FROM entries")}


def test_a_failed_hit_flush_rolls_back_and_keeps_the_hits(tmp_path):
    path = str(tmp_path / "s.db")
    st = EntryStore(path, "NORMAL")
    lab = insert(st, "one")
    # Every UPDATE fails mid-transaction, as a disk or I/O error would.
    st._db.execute("CREATE TRIGGER no_update BEFORE UPDATE ON entries "
                   "BEGIN SELECT RAISE(ABORT, 'simulated I/O error'); END")
    st.record_hit(lab, 5.0, 1)
    with pytest.raises(sqlite3.DatabaseError, match="simulated"):
        st.flush_hits()
    assert not st._db.in_transaction
    insert(st, "two")  # acknowledged, so it must be committed
    assert committed_ids(path) == {"one", "two"}
    st._db.execute("DROP TRIGGER no_update")
    assert st.flush_hits() == 1  # the hit that failed to flush is written next time
    assert st.get("one").hit_count == 1 and st.get("one").last_hit_at == 5.0
    st.close()


def test_truncated_flag_round_trips(tmp_path):
    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    insert(st, "cut", truncated=16)
    insert(st, "whole")
    st.insert_many([dict(id="bulk", tenant="t", model_id="m", context_hash="", prompt="p",
                         answer="a", embedding=VEC, embed_model="e", verified=False,
                         created_at=1.0, ttl_seconds=0, truncated=8)])
    assert (st.get("cut").truncated, st.get("whole").truncated, st.get("bulk").truncated) == (
        16, 0, 8)
    st.close()


def test_a_database_from_before_the_truncated_column_is_upgraded(tmp_path):
    path = str(tmp_path / "old.db")
    with sqlite3.connect(path) as db:
        create_old_table(db)
        db.execute("INSERT INTO entries (id, tenant, model_id, context_hash, prompt, answer, "
                   "embedding, embed_model, created_at) VALUES ('old', 't', 'm', '', 'q', 'a', "
                   "?, 'e', 1.0)", (VEC.tobytes(),))
    st = EntryStore(path, "NORMAL")
    old = st.get("old")
    # Whether it was cut short is unknown: taken as cut (it serves no longer request), not
    # as whole (a 24-token cut was served as the complete answer to a 64-token request).
    assert old is not None and old.truncated == 1 and old.answer == "a"
    insert(st, "new", truncated=5)
    assert st.get("new").truncated == 5
    st.close()


def test_a_database_from_before_the_token_ids_column_reads_none_and_takes_them(tmp_path):
    path = str(tmp_path / "s.db")
    with sqlite3.connect(path) as db:  # as the build before the column left its table
        create_old_table(db, "truncated INTEGER NOT NULL DEFAULT 1")
        db.execute("PRAGMA user_version = 1")
        db.execute("INSERT INTO entries (id, tenant, model_id, context_hash, prompt, answer, "
                   "embedding, embed_model, created_at, truncated) VALUES ('old', 't', 'm', "
                   "'', 'q', 'a', ?, 'e', 1.0, 0)", (VEC.tobytes(),))
    st = EntryStore(path, "NORMAL")
    try:
        assert st.get("old").answer_tokens == b"" and st.get("old").truncated == 0
        insert(st, "new", answer_tokens=pack_tokens([7, 70000]))
        assert unpack_tokens(st.get("new").answer_tokens) == [7, 70000]
        st.insert_many([dict(id="bulk", tenant="t", model_id="m", context_hash="", prompt="p",
                             answer="a", embedding=VEC, embed_model="e", verified=False,
                             created_at=1.0, ttl_seconds=0, answer_tokens=pack_tokens([5]))])
        assert unpack_tokens(st.get("bulk").answer_tokens) == [5]
    finally:
        st.close()
    with sqlite3.connect(path) as db:  # no schema version: a build without the column opens it
        assert db.execute("PRAGMA user_version").fetchone()[0] == 1


def test_hit_counters_never_go_down_in_sqlite(tmp_path):
    """Counters are absolute values buffered per entry: one restored after a failed flush,
    or recorded late, must not overwrite a higher one already written."""
    import numpy as np

    s = EntryStore(str(tmp_path / "h.db"), "NORMAL")
    try:
        lab = s.insert(id="e", tenant="t", model_id="m", context_hash="", prompt="p",
                       answer="a", embedding=np.ones(4, np.float32), embed_model="x",
                       verified=False, created_at=1.0, ttl_seconds=60)
        s.record_hit(lab, 10.0, 5)
        s.flush_hits()
        s.record_hit(lab, 7.0, 3)
        s.flush_hits()
        (row,) = [r for rows in s.iter_all() for r in rows]
        assert (row.hit_count, row.last_hit_at) == (5, 10.0)
    finally:
        s.close()


def test_one_process_at_a_time_holds_a_database(tmp_path):
    """Two services on one file each kept their own view of it: an entry invalidated through
    one was still served by the other, and the second one's start-up trimming deleted rows
    the first had acknowledged. The second is now refused, naming the holder."""
    import os

    from services.semantic.store import DatabaseInUse

    path = str(tmp_path / "s.db")
    first = EntryStore(path)
    with pytest.raises(DatabaseInUse) as e:
        EntryStore(path)
    assert path in str(e.value) and f"pid {os.getpid()}" in str(e.value)
    assert "TIERCACHE_SEMANTIC_DB_PATH" in str(e.value)
    first.close()
    first.close()  # idempotent
    second = EntryStore(path)  # the lock went with the first store
    second.close()
    EntryStore(":memory:").close()  # no file, no lock


def test_a_database_reached_through_a_symlink_is_the_same_database(tmp_path):
    """The lock was named after the path as given: a second store opened the database
    through a link, and its start-up trimming deleted the first one's acknowledged rows."""
    import os

    from services.semantic.store import DatabaseInUse, database_in_use

    path = str(tmp_path / "s.db")
    link = str(tmp_path / "link.db")
    os.symlink(path, link)
    first = EntryStore(path)
    try:
        with pytest.raises(DatabaseInUse):
            EntryStore(link)
        assert database_in_use(link) is True
    finally:
        first.close()
    through_link = EntryStore(link)
    try:
        with pytest.raises(DatabaseInUse):
            EntryStore(path)
    finally:
        through_link.close()


def test_the_service_refuses_to_start_on_a_database_in_use(tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "s.db")
    holder = EntryStore(path)
    try:
        # A process of its own: one that started anyway would serve until stopped.
        p = subprocess.run([sys.executable, "-m", "services.semantic", "--address",
                            "127.0.0.1:0", "--metrics-port", "-1", "--db-path", path],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr[-2000:]
        assert "in use by another process" in p.stderr
    finally:
        holder.close()


def test_the_database_and_its_lock_are_readable_by_their_owner_only(tmp_path):
    """Every tenant's prompts and answers: they were 0644 in a 0755 folder."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        folder = tmp_path / "fresh"
        st = EntryStore(str(folder / "s.db"))
        insert(st, "a")  # the WAL file exists now
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
        assert mode(folder) == 0o700
        for name in ("s.db", "s.db-wal", "s.db.lock"):
            assert mode(folder / name) == 0o600, name
        st.close()
        (folder / "s.db").chmod(0o644)  # one made by an older version
        EntryStore(str(folder / "s.db")).close()
        assert mode(folder / "s.db") == 0o600
    finally:
        os.umask(old)


def test_a_database_that_cannot_be_opened_leaves_no_lock_behind(tmp_path):
    """A failure between taking the lock and opening SQLite kept the lock: the retry in the
    same process was refused as 'in use by another process'."""
    import sqlite3

    path = tmp_path / "s.db"
    # Not a database (a folder there is refused before the lock is taken: FolderInTheWay).
    path.write_bytes(b"not a database, but long enough to be read as a header" * 4)
    with pytest.raises(sqlite3.DatabaseError):
        EntryStore(str(path))
    path.unlink()
    EntryStore(str(path)).close()  # not DatabaseInUse


def test_a_database_owned_by_another_user_keeps_its_mode(tmp_path):
    """A volume shared through a group (Kubernetes' fsGroup) holds a database another uid
    made, 0660: changing its mode is not ours to do (and as that group's member, not root,
    it failed the start with EPERM)."""
    import os
    import stat

    if os.geteuid() != 0:
        pytest.skip("making a file another user owns needs root")
    path = tmp_path / "s.db"
    EntryStore(str(path)).close()
    os.chown(path, 1000, 2000)
    path.chmod(0o660)
    EntryStore(str(path)).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o660


def test_rows_an_earlier_version_upgraded_as_whole_are_marked_once(tmp_path):
    """Databases opened between the column's arrival and this fix already had it, with 0
    ('whole') on rows older than the column: those stayed served as complete answers."""
    from services.semantic.store import _COLUMN_ADDED

    path = str(tmp_path / "s.db")
    st = EntryStore(path)
    insert(st, "before", created_at=_COLUMN_ADDED - 3600)
    insert(st, "after", created_at=_COLUMN_ADDED + 3600, truncated=0)
    st._db.execute("PRAGMA user_version = 0")  # as a database the earlier version upgraded
    st.close()
    st = EntryStore(path)
    assert st.get("before").truncated == 1 and st.get("after").truncated == 0
    insert(st, "later-but-backdated", created_at=_COLUMN_ADDED - 10)
    st.close()
    st = EntryStore(path)  # once only: rows written since keep what they were written with
    assert st.get("later-but-backdated").truncated == 0
    st.close()


def test_probing_a_free_database_leaves_it_free(tmp_path):
    """The launcher probes before starting the service: a probe that kept the lock would have
    the service refused as 'in use by another process'."""
    from services.semantic.store import database_in_use

    path = str(tmp_path / "s.db")
    assert database_in_use(path) is False
    assert database_in_use(path) is False  # twice: nothing kept the first time
    EntryStore(path).close()
    held = EntryStore(path)
    try:
        assert database_in_use(path) is True
    finally:
        held.close()


def test_a_full_disk_at_close_still_closes_and_frees_the_database(tmp_path, monkeypatch):
    """Buffered hit counters are flushed at close; on a full disk that raised, the store
    stayed open and locked, and the service's stop ended in a traceback."""
    import contextlib

    path = str(tmp_path / "s.db")
    st = EntryStore(path)
    label = insert(st, "a")
    st.record_hit(label, 5.0, 1)

    @contextlib.contextmanager
    def full():
        raise sqlite3.OperationalError("database or disk is full")
        yield  # pragma: no cover

    monkeypatch.setattr(st, "_transaction", full)
    st.close()  # no exception
    EntryStore(path).close()  # and the lock went with it


def test_every_write_on_a_full_disk_is_resource_exhausted_naming_it(tmp_path):
    """Verify's write was the one left out: on a full disk it raised SQLite's own error, which
    clients got as INTERNAL with a traceback in the log."""
    from services.common.errors import ResourceExhausted

    st = EntryStore(str(tmp_path / "s.db"))
    label = insert(st, "a")

    class FullDisk:
        """The connection, but every write fails as SQLite's do on a full disk."""

        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def execute(self, sql: str, *args):
            if sql.split()[0] in ("INSERT", "UPDATE", "DELETE"):
                raise sqlite3.OperationalError("database or disk is full")
            return self.db.execute(sql, *args)

        def executemany(self, sql: str, *args):
            raise sqlite3.OperationalError("database or disk is full")

        def __getattr__(self, name: str):
            return getattr(self.db, name)

    real = st._db
    st._db = FullDisk(real)
    try:
        for write in (lambda: st.set_verified(label, True), lambda: insert(st, "b"),
                      lambda: st.delete([label])):
            with pytest.raises(ResourceExhausted, match="disk"):
                write()
    finally:
        st._db = real
    assert st.get("a").verified is False and st.get("b") is None
    st.close()


def test_many_embeddings_are_rewritten_in_one_transaction_per_chunk(tmp_path):
    """Start-up re-embedding wrote one autocommitted row at a time: an fsync per row."""
    from services.semantic.store import WRITE_CHUNK
    from tests.semantic.sql_trace import SqlTrace

    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    n = 2 * WRITE_CHUNK + 1
    st.insert_many([dict(id=f"e{i}", tenant="t", model_id="m", context_hash="", prompt=f"q{i}",
                         answer="a", embedding=VEC, embed_model="old", verified=False,
                         created_at=1.0, ttl_seconds=0) for i in range(n)])
    labels = [r.label for rows in st.iter_all() for r in rows]
    trace = SqlTrace(st)
    new = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    st.set_embeddings([(lab, new, "new") for lab in labels])
    assert len(trace.transactions("UPDATE")) == 3  # ceil(n / WRITE_CHUNK)
    rows = [r for rows in st.iter_all() for r in rows]
    assert {r.embed_model for r in rows} == {"new"}
    assert all(np.array_equal(r.embedding, new) for r in rows)
    st.close()


def test_a_large_delete_commits_chunk_by_chunk(tmp_path):
    """An Invalidate of 200k entries deleted them in one transaction holding the store's lock:
    every Store waited seconds behind it."""
    from services.semantic.store import WRITE_CHUNK
    from tests.semantic.sql_trace import SqlTrace

    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    n = 2 * WRITE_CHUNK + 1
    st.insert_many([dict(id=f"e{i}", tenant="t", model_id="m", context_hash="", prompt=f"q{i}",
                         answer="a", embedding=VEC, embed_model="e", verified=False,
                         created_at=1.0, ttl_seconds=0) for i in range(n + 1)])
    labels = [r.label for rows in st.iter_all() for r in rows]
    st.record_hit(labels[0], 5.0, 1)
    trace = SqlTrace(st)
    st.delete(labels[:n])
    assert [len(t) for t in trace.transactions("DELETE")] == [WRITE_CHUNK, WRITE_CHUNK, 1]
    assert st.count() == 1 and st.flush_hits() == 0  # the deleted row's hit is dropped too
    st.close()


def test_the_wal_is_bounded_and_the_unread_namespace_index_is_dropped(tmp_path):
    """After a large transaction the -wal file stayed at its largest size; the (tenant, model,
    context) index, read by no query, cost every insert and delete a b-tree update."""
    path = str(tmp_path / "s.db")
    with sqlite3.connect(path) as old:  # a database created by an earlier version
        create_old_table(old, "truncated INTEGER NOT NULL DEFAULT 0")
        old.execute("CREATE INDEX entries_ns ON entries (tenant, model_id, context_hash)")
        old.execute("PRAGMA user_version = 1")
    st = EntryStore(path, "NORMAL")
    insert(st, "one")
    assert st._db.execute("PRAGMA journal_size_limit").fetchone()[0] == 64 << 20
    names = {r[0] for r in st._db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "entries_ns" not in names
    assert st.get("one").answer == "a one"
    st.close()


def test_a_database_of_a_newer_schema_is_refused_naming_it(tmp_path):
    """A rollback past a schema change opened the newer database silently: this build would
    read rows it does not understand and never run the newer migration again."""
    path = tmp_path / "s.db"
    EntryStore(str(path)).close()
    con = sqlite3.connect(path)
    con.execute("PRAGMA user_version = 7")
    con.close()
    with pytest.raises(ValueError, match=r"s\.db: schema version 7 is newer than this build"):
        EntryStore(str(path))
    con = sqlite3.connect(path)
    con.execute("PRAGMA user_version = 1")
    con.close()
    EntryStore(str(path)).close()  # the refused open let its lock go


def test_a_damaged_database_is_refused_naming_the_file_and_the_way_out(tmp_path):
    path = tmp_path / "s.db"
    st = EntryStore(str(path))
    insert(st, "a")
    st.close()
    path.write_bytes(b"\x00" * 4096)  # the header overwritten
    with pytest.raises(sqlite3.DatabaseError, match=r"s\.db: .*stop the service, then move "
                       r"s\.db together with its s\.db-wal and s\.db-shm files aside"):
        EntryStore(str(path))
    path.unlink()
    EntryStore(str(path)).close()  # its lock was let go: the next start works


class FakeEmbedder:
    name = "e"
    dim = 4

    def embed_one(self, text: str) -> np.ndarray:
        return VEC

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.stack([VEC for _ in texts])


def damage_pages_past_the_header(path) -> None:
    """Random bytes over three pages in the middle of a checkpointed database: the header and
    the schema still read, so the open succeeds (bit rot, a bad restore)."""
    st = EntryStore(str(path))
    st.insert_many([dict(id=f"id{i}", tenant="t", model_id="m", context_hash="",
                         prompt=f"question number {i} " * 5, answer="answer " * 40,
                         embedding=VEC, embed_model="e", verified=False, created_at=1.0,
                         ttl_seconds=0) for i in range(3000)])
    st.close()  # checkpointed into the file, the WAL removed
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2 // 4096 * 4096)
        f.write(np.random.default_rng(0).bytes(3 * 4096))


def test_pages_damaged_past_the_header_are_named_where_they_are_read(tmp_path):
    """The open checks only the header and the schema: pages damaged in the middle surfaced
    from `load` as a bare "database disk image is malformed", which the service printed as
    "bad configuration" naming no file."""
    from services.semantic.cache import SemanticCache
    from services.semantic.config import SemanticConfig

    path = tmp_path / "s.db"
    damage_pages_past_the_header(path)
    st = EntryStore(str(path))
    try:
        way_out = (rf"{path}: database disk image is malformed \(a damaged database: stop the "
                   r"service, then move s\.db together with its s\.db-wal and s\.db-shm files "
                   "aside")
        with pytest.raises(sqlite3.DatabaseError, match=way_out):
            for _ in st.iter_all():
                pass
        with pytest.raises(sqlite3.DatabaseError, match=way_out):  # where the service reads
            SemanticCache(SemanticConfig(verifier_tiers=()), FakeEmbedder(), st).load()
    finally:
        st.close()


def test_a_lock_file_that_cannot_be_written_is_let_go(tmp_path, monkeypatch):
    """A full disk failed writing the pid into the lock file after the lock was taken: the
    fd stayed open, holding the lock, and the retry in the same process (space freed) was
    refused as "in use by another process"."""
    import errno
    import os

    import services.semantic.store as store_mod

    path = str(tmp_path / "s.db")
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_mod.os, "pwrite", full)
    with pytest.raises(OSError, match=r"writing the lock file; free space on its volume") as e:
        EntryStore(path)
    assert e.value.filename == path + ".lock" and e.value.errno == errno.ENOSPC
    monkeypatch.setattr(store_mod.os, "pwrite", real_pwrite)
    EntryStore(path).close()  # not DatabaseInUse


def test_a_newer_database_is_refused_before_anything_is_written_to_it(tmp_path):
    """The version was read after the journal mode and the schema script had run: a newer
    database was refused only once this build had created its table in it (and dropped an
    index of that name) and switched it to WAL."""
    path = tmp_path / "s.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE entries_v7 (x)")
    con.execute("CREATE INDEX entries_ns ON entries_v7 (x)")
    con.execute("PRAGMA user_version = 7")
    con.commit()
    con.close()
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"s\.db: schema version 7 is newer than this build.*"
                       r"run the newer build, or stop the service, then move s\.db together "
                       r"with its s\.db-wal and s\.db-shm files aside"):
        EntryStore(str(path))
    assert path.read_bytes() == before
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    names = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
    con.close()
    assert names == {"entries_v7", "entries_ns"}


def test_rows_written_by_a_build_that_does_not_know_truncated_are_not_taken_as_whole(tmp_path):
    """A rollback to a build from before the `truncated` column, then forward again: that
    build's rows read as whole answers (the column's default was 0), and a cut-off answer was
    served to requests wanting more."""
    path = str(tmp_path / "s.db")
    EntryStore(path, "NORMAL").close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO entries (id, tenant, model_id, context_hash, prompt, answer, "
               "embedding, embed_model, created_at) VALUES ('old', 't', 'm', '', 'q', 'a', ?, "
               "'e', 1.0)", (np.ones(4, "<f4").tobytes(),))
    db.commit()
    db.close()
    s = EntryStore(path, "NORMAL")
    try:
        assert s.get("old").truncated == 1
    finally:
        s.close()


@pytest.mark.parametrize(("ids", "size"), [
    ([], 0),
    ([0, 49151, 65535], 1 + 3 * 2),  # SmolLM2's vocabulary: two bytes an id
    ([7, 65536], 1 + 2 * 4),  # one id past 16 bits: four bytes each
    ([2**32 - 1], 1 + 4),
])
def test_token_ids_are_packed_as_narrow_as_they_fit_and_read_back(ids, size):
    blob = pack_tokens(ids)
    assert len(blob) == size and unpack_tokens(blob) == ids


def test_a_database_folder_the_service_cannot_write_is_named():
    """The file writable but not its folder (a read-only volume, one owned by another uid):
    SQLite's WAL cannot make its -wal and -shm files, and the start failed with a bare
    "attempt to write a readonly database", naming neither the file nor the folder."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable]
    if os.geteuid() == 0:
        # Root writes any folder: the store runs as root without its capabilities, so that
        # a folder's mode binds it as any user (another uid could not run this venv's
        # python, which lies under /root).
        if shutil.which("setpriv") is None:
            pytest.skip("as root, needs setpriv to drop the capabilities")
        cmd = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", sys.executable]
    folder = Path(tempfile.mkdtemp(prefix="tiercache-ro-"))
    try:
        path = folder / "s.db"
        EntryStore(str(path)).close()
        folder.chmod(0o555)
        probe = ("import sys, sqlite3\n"
                 "from services.semantic.store import EntryStore\n"
                 "try:\n    EntryStore(sys.argv[1]).close()\n"
                 "except OSError as e:\n    print(e)\n")
        out = subprocess.run([*cmd, "-c", probe, str(path)], capture_output=True, text=True,
                             timeout=120, cwd="/", check=True,
                             env={**os.environ, "PYTHONPATH": f"{root}:{root / 'gen'}"}).stdout
        assert out.startswith(f"{path}: attempt to write a readonly database"), out
        assert f"the folder {folder} must be writable" in out and "s.db-wal" in out
        assert "TIERCACHE_SEMANTIC_DB_PATH" in out
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder, ignore_errors=True)


def test_ttls_are_capped_a_chunk_per_transaction_and_a_failure_keeps_the_chunks_written(
        tmp_path, monkeypatch):
    """cap_ttls rewrites rows WRITE_CHUNK at a time, each chunk committed: a lowered limit
    matches every row, and one transaction needed a WAL about the database's size (a fuller
    disk failed it at every start). TTLs of 0 or less ("never") are capped with `never`."""
    import contextlib

    import services.semantic.store as store_mod
    from services.common.errors import ResourceExhausted

    monkeypatch.setattr(store_mod, "WRITE_CHUNK", 2)
    path = str(tmp_path / "s.db")
    st = EntryStore(path)
    try:
        ttls = {"a": 10, "b": 500, "c": 600, "d": 0, "e": -5, "f": 50, "g": 800}
        for eid, ttl in ttls.items():
            insert(st, eid, ttl_seconds=ttl)
        commits = []
        st._db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
        assert st.cap_ttls(100, never=False) == 3  # b, c, g: two chunks
        assert len(commits) == 2
        with sqlite3.connect(path) as other:
            got = dict(other.execute("SELECT id, ttl_seconds FROM entries"))
        assert got == {**ttls, "b": 100, "c": 100, "g": 100}

        real, calls = st._transaction, []

        @contextlib.contextmanager
        def second_is_full():
            calls.append(1)
            if len(calls) == 2:
                raise sqlite3.OperationalError("database or disk is full")
            with real():
                yield

        monkeypatch.setattr(st, "_transaction", second_is_full)
        with pytest.raises(ResourceExhausted):
            st.cap_ttls(40, never=True)  # all but a (10) match: 6 rows, 3 chunks
        with sqlite3.connect(path) as other:
            got = dict(other.execute("SELECT id, ttl_seconds FROM entries"))
        assert sorted(got.values()).count(40) == 2  # the first chunk stayed written
        monkeypatch.setattr(st, "_transaction", real)
        assert st.cap_ttls(40, never=True) == 4
        with sqlite3.connect(path) as other:
            got = dict(other.execute("SELECT id, ttl_seconds FROM entries"))
        assert got == {**{k: 40 for k in ttls}, "a": 10}
    finally:
        st.close()
