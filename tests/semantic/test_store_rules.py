"""The SQLite entry store at its edges: hit counters kept across a failed flush and flushed at
close, future times clamped, the configured synchronous level, the buffer cleared, and the
database's permissions tightened.

Written for what a mutation audit found no test checking; each was seen failing on a hand-made
mutant of the rule it checks."""

from __future__ import annotations

import os
import re
import sqlite3

import pytest

from services.semantic.store import EntryStore
from tests.semantic.test_store import insert


def test_a_hit_recorded_while_a_flush_fails_is_not_overwritten_by_the_older_one(tmp_path):
    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    lab = insert(st, "one")
    # A lookup records a newer hit while the flush is inside SQLite; then the flush fails.
    st._db.create_function("newer_hit", 0, lambda: st.record_hit(lab, 9.0, 2) or 0)
    st._db.execute("CREATE TRIGGER no_update BEFORE UPDATE ON entries "
                   "BEGIN SELECT newer_hit(); SELECT RAISE(ABORT, 'simulated I/O error'); END")
    st.record_hit(lab, 5.0, 1)
    with pytest.raises(sqlite3.DatabaseError, match="simulated"):
        st.flush_hits()
    st._db.execute("DROP TRIGGER no_update")
    assert st.flush_hits() == 1
    row = st.get("one")
    assert (row.hit_count, row.last_hit_at) == (2, 9.0)
    st.close()


def test_the_latest_of_two_buffered_hits_is_the_one_written(tmp_path):
    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    lab = insert(st, "one")
    st.record_hit(lab, 5.0, 1)
    st.record_hit(lab, 6.0, 2)
    assert st.flush_hits() == 1
    assert (st.get("one").hit_count, st.get("one").last_hit_at) == (2, 6.0)
    st.close()


def test_a_flush_writes_each_buffered_hit_once(tmp_path):
    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    lab = insert(st, "one")
    st.record_hit(lab, 5.0, 1)
    assert st.flush_hits() == 1
    assert st.flush_hits() == 0  # nothing new: the buffer was emptied
    st.close()


def test_close_writes_the_buffered_hits(tmp_path):
    path = str(tmp_path / "s.db")
    st = EntryStore(path, "NORMAL")
    lab = insert(st, "one")
    st.record_hit(lab, 5.0, 3)
    st.close()
    st = EntryStore(path, "NORMAL")
    assert (st.get("one").hit_count, st.get("one").last_hit_at) == (3, 5.0)
    st.close()


def test_a_last_hit_stamped_ahead_of_the_clock_is_clamped_too(tmp_path):
    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    lab = insert(st, "one", created_at=1.0)
    st.record_hit(lab, 500.0, 1)
    st.flush_hits()
    assert st.clamp_future(100.0) == 1
    row = st.get("one")
    assert (row.created_at, row.last_hit_at) == (1.0, 100.0)
    st.close()


@pytest.mark.parametrize("level, value", [("NORMAL", 1), ("FULL", 2), ("OFF", 0)])
def test_the_configured_synchronous_level_is_applied(tmp_path, level, value):
    st = EntryStore(str(tmp_path / "s.db"), level)
    assert st._db.execute("PRAGMA synchronous").fetchone()[0] == value
    st.close()


def test_deleted_rows_are_overwritten_and_the_wal_can_be_emptied(tmp_path):
    """A deleted row's text stays readable in the file unless secure_delete is on (off in
    SQLite's own default build) and in the WAL until a truncating checkpoint; both are what
    an erasure on request needs."""
    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    assert st._db.execute("PRAGMA secure_delete").fetchone()[0] == 1
    label = insert(st, "gone", prompt="ZEBRAPOX-7731 secret")
    st.delete([label])
    assert st.truncate_wal() is True
    assert (tmp_path / "s.db-wal").stat().st_size == 0
    assert b"ZEBRAPOX-7731" not in (tmp_path / "s.db").read_bytes()
    st.close()


def test_emptying_the_wal_behind_a_reader_does_not_wait_under_the_store_lock(tmp_path):
    """A backup reading the database keeps the WAL from being emptied: truncate_wal says so at
    once (the caller calls again) instead of waiting SQLite's busy timeout under the store's
    lock, which stalled every Store and hit flush 5 s; the timeout is the same afterwards."""
    import sqlite3
    import time

    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    wait = st._db.execute("PRAGMA busy_timeout").fetchone()[0]
    insert(st, "one")
    reader = sqlite3.connect(str(tmp_path / "s.db"))
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM entries").fetchone()  # a read snapshot held
    insert(st, "two")  # a WAL frame the reader's snapshot predates
    t0 = time.monotonic()
    assert st.truncate_wal() is False
    assert time.monotonic() - t0 < wait / 1000 / 2
    assert st._db.execute("PRAGMA busy_timeout").fetchone()[0] == wait
    reader.rollback()
    reader.close()
    assert st.truncate_wal() is True
    st.close()


def test_a_group_readable_database_of_ours_is_tightened(tmp_path):
    import os
    import stat

    path = tmp_path / "s.db"
    path.touch()
    os.chmod(path, 0o640)
    st = EntryStore(str(path), "NORMAL")
    st.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_flush_counts_the_rows_it_updated_not_the_counters_it_held(tmp_path):
    """flush_hits returned how many counters it held, as its docstring's "rows updated": a hit
    recorded for an entry deleted meanwhile (an Invalidate racing a lookup) counted though it
    updated no row. Found by the store's differential review."""
    st = EntryStore(str(tmp_path / "s.db"), "NORMAL")
    one, two = insert(st, "one"), insert(st, "two")
    st.delete([two])
    st.record_hit(one, 5.0, 1)
    st.record_hit(two, 6.0, 1)  # after the delete: the delete could not drop it
    assert st.flush_hits() == 1
    assert st.flush_hits() == 0
    st.close()


_PAST_THE_FILE_SIZE_LIMIT = r"""
import resource, sys
import numpy as np
from services.common.errors import ResourceExhausted
from services.semantic.store import EntryStore
st = EntryStore(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
for i in range(10_000):
    try:
        st.insert(id=f"n{i}", tenant="t", model_id="m", context_hash="", prompt=f"q {i}",
                  answer="a" * 4000, embedding=np.ones(4, np.float32) / 2, embed_model="e",
                  verified=False, created_at=1.0, ttl_seconds=0)
    except ResourceExhausted as e:
        print("refused", i, e)
        break
"""


def test_a_write_past_the_file_size_limit_is_resource_exhausted_naming_the_limit(tmp_path):
    """`ulimit -f` reached (EFBIG), like a disk quota (EDQUOT), is no ENOSPC: SQLite said a
    bare "disk I/O error", and each Store was INTERNAL with a traceback in the log."""
    import subprocess
    import sys

    path = tmp_path / "s.db"
    st = EntryStore(str(path))
    for i in range(50):
        insert(st, f"o{i}", answer="a" * 4000)
    st.close()
    limit = path.stat().st_size + (256 << 10)  # a page multiple: writes past it get EFBIG
    out = subprocess.run([sys.executable, "-c", _PAST_THE_FILE_SIZE_LIMIT, str(path), str(limit)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused"), out.stdout
    assert f"file-size limit (ulimit -f) is {limit} bytes" in out.stdout
    # Rolled back: the rows acknowledged before the refusal are there, whole, and no more.
    refused_at = int(out.stdout.split()[1])
    st = EntryStore(str(path))
    assert st.count() == 50 + refused_at
    assert st._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    st.close()


def test_a_database_folder_the_service_cannot_write_is_said_with_the_setting(tmp_path,
                                                                            monkeypatch):
    """The lock file, made before SQLite opens anything, is the first write: its refusal keeps
    its path, which the start's line says with the fix and the setting (root ignores a
    folder's mode, so the refusal is simulated)."""
    from services.semantic.__main__ import not_writable

    def refused(path):
        raise PermissionError(13, "Permission denied", path + ".lock")

    monkeypatch.setattr("services.semantic.store._lock_database", refused)
    with pytest.raises(PermissionError) as info:
        EntryStore(str(tmp_path / "s.db"), "NORMAL")
    line = not_writable(info.value)
    assert line.startswith(f"{tmp_path / 's.db'}.lock is not writable (Permission denied)")
    assert "TIERCACHE_SEMANTIC_DB_PATH" in line


def test_a_database_cut_to_nothing_is_said_once_at_warning(tmp_path, caplog):
    """SQLite opens a 0-byte file as a new database: one cut to nothing (a full disk, a copy
    that stopped) started an empty cache without a word. A first start (no file) and a file
    with rows say nothing."""
    path = str(tmp_path / "semantic.db")
    with caplog.at_level("WARNING", logger="services.semantic.store"):
        EntryStore(path).close()
        EntryStore(path).close()
    assert not caplog.records
    open(path, "wb").close()
    with caplog.at_level("WARNING", logger="services.semantic.store"):
        EntryStore(path).close()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"{path} is empty (0 bytes)" in warned[0], warned


def test_a_damaged_database_is_told_of_a_backup_too(tmp_path):
    """A backup restored over semantic.db with the old -wal left beside it is damaged by its
    replay at the next open (docs/deploy.md): the refusal's only way out was to start empty,
    throwing the restored entries away; it names putting a backup in without the -wal too."""
    path = tmp_path / "semantic.db"
    path.write_bytes(b"\x07" * 8192)  # as any damage: the same way out
    with pytest.raises(sqlite3.DatabaseError) as err:
        EntryStore(str(path)).close()
    assert f"{path}: file is not a database (a damaged database: " in str(err.value)
    assert ("or, to keep the entries, put a backup in as semantic.db with no semantic.db-wal "
            "or semantic.db-shm beside it: docs/deploy.md") in str(err.value)


@pytest.mark.parametrize("where", ["semantic.db", "semantic.db.lock", "semantic.db-wal",
                                   "semantic.db-shm"])
def test_a_folder_where_a_file_the_start_opens_must_be_is_named_with_the_way_out(
        tmp_path, where):
    """A folder at the lock's path stopped the start with "bad configuration:
    IsADirectoryError", at the -wal's with a bare "disk I/O error": the error names the path,
    that a folder stands where a file must be, and the way out; nothing is left behind (no
    lock file, no database file made)."""
    from services.semantic.store import FolderInTheWay

    (tmp_path / where).mkdir()
    with pytest.raises(FolderInTheWay) as e:
        EntryStore(str(tmp_path / "semantic.db"))
    said = str(e.value)
    assert said.startswith(f"{tmp_path / where} is a folder, where "), said
    assert "move it aside" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == [where]


def test_a_database_in_use_names_the_lock_its_holder_keeps(tmp_path):
    """"in use by another process (pid N)" named the database only: the holder is found by
    the lock file, which the line names too."""
    from services.semantic.store import DatabaseInUse

    path = str(tmp_path / "semantic.db")
    first = EntryStore(path)
    try:
        with pytest.raises(DatabaseInUse, match=rf"pid {os.getpid()}, holding "
                                                rf"{re.escape(path)}\.lock\)"):
            EntryStore(path)
    finally:
        first.close()
