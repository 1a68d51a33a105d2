"""Durable entry store: SQLite in WAL mode, one row per cached answer.

`insert` returns only after the transaction has committed with the configured `synchronous`
level (FULL by default: the WAL is fsynced at every commit), which is what makes an
acknowledged `Store` survive `kill -9` and power loss. Hit counters are not worth an fsync per
lookup: they are buffered and written in the background (`flush_hits`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import resource
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from services.common.errors import ResourceExhausted

log = logging.getLogger(__name__)

# Rows per transaction of a bulk update or delete: each commit is an fsync (synchronous=FULL),
# and the store's lock is let go between chunks so that Stores are not held up behind a long
# write.
WRITE_CHUNK = 5000
SCHEMA_VERSION = 1  # PRAGMA user_version this build writes and understands
# The -wal file is truncated to this after a checkpoint: a large transaction (an Invalidate of
# a big namespace) otherwise leaves it at its largest size on disk for good.
_JOURNAL_SIZE_LIMIT = 64 << 20

# When the `truncated` column came to be (commit 970136f): see _mark_uncertain_answers.
_COLUMN_ADDED = 1796004933.0


class NotWritable(PermissionError):
    """A path the service must write that it cannot (a read-only volume, one owned by another
    uid): its start says so, naming the path and the cause, not "bad configuration"."""


class DatabaseInUse(RuntimeError):
    """Another process has the database open: two caches on one file would each keep their own
    view of it and delete each other's rows (start-up de-duplication, lowered limits)."""


class FolderInTheWay(RuntimeError):
    """A folder where the store opens a file (the database, its lock, its -wal or -shm): the
    start said "bad configuration: IsADirectoryError" for the lock, and a bare "disk I/O
    error" for the -wal, naming neither the path nor the way out."""


# The files beside the database that a start opens, by suffix: what each is, and the way out
# when a folder stands there. None holds the database's rows, so a folder there is removed.
_SIBLINGS = (
    (".lock", "the database's lock file (it holds only the holder's pid, and the service "
              "makes it)"),
    ("-wal", "SQLite's write-ahead log of the database (SQLite makes it)"),
    ("-shm", "SQLite's shared-memory index of the database (SQLite makes it)"),
)


def _folders_in_the_way(path: str) -> None:
    """Raises FolderInTheWay naming the first of the database and the files beside it that is
    a folder, what belongs there and the way out. The siblings sit beside the file the path
    resolves to, as SQLite and `_lock_database` put them."""
    if os.path.isdir(path):
        raise FolderInTheWay(
            f"{path} is a folder, where the database file must be: move it aside, or point "
            "TIERCACHE_SEMANTIC_DB_PATH at a file (a new one starts an empty cache)")
    real = os.path.realpath(path)
    for suffix, what in _SIBLINGS:
        if os.path.isdir(real + suffix):
            raise FolderInTheWay(
                f"{real + suffix} is a folder, where {what} must be: move it aside (the service "
                "keeps nothing in a folder there), then start again")


def _say_if_emptied(path: str) -> None:
    """Warns of a database file that exists with nothing in it (nor in its -wal): SQLite
    opens a 0-byte file as a new, empty database, so one cut to nothing (a full disk, a copy
    or restore that stopped) started an empty cache without a word, its snapshot's graphs
    dropped unsaid. A first start killed before it wrote the schema leaves one too."""
    if not os.path.isfile(path) or os.path.getsize(path):  # none yet (a first start), or data
        return
    wal = f"{path}-wal"
    if os.path.isfile(wal) and os.path.getsize(wal):  # SQLite reads its pages from there
        return
    log.warning("%s is empty (0 bytes): a database cut to nothing (a full disk, a copy or "
                "restore that stopped) or a first start killed before it wrote one; starting "
                "with an empty cache, which refills (restore a backup to keep the entries: "
                "docs/deploy.md)", path)


def _owner_only(path: str) -> None:
    """Creates the database file readable by this user only, and tightens one of ours made
    by an older version. One owned by another user (a volume shared through a group, as
    Kubernetes' fsGroup does) is left as it is: its mode is its owner's choice."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    st = os.stat(path)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(path, 0o600)


def database_in_use(path: str) -> bool:
    """Whether a running store holds `path` (a probe: takes and drops the lock)."""
    try:
        fd = _lock_database(path)
    except DatabaseInUse:
        return True
    except OSError:
        return False  # cannot even create the lock file: the service will say so itself
    os.close(fd)
    return False


def _lock_database(path: str) -> int:
    """Holds an exclusive lock on `<path>.lock` for the life of the store (released by the
    kernel if the process dies); raises DatabaseInUse naming the holder when it is taken.

    The lock sits beside the file the path resolves to: SQLite follows a symlink, and a
    second service that reached the same database through a link took a lock of its own,
    opened the file anyway and trimmed rows the first had acknowledged."""
    lock_path = os.path.realpath(path) + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise DatabaseInUse(
            f"{path} is in use by another process (pid {holder}, holding {lock_path}); stop "
            "it, or give this one its own database (TIERCACHE_SEMANTIC_DB_PATH)") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        # Kept open, this fd held the lock for the life of the process: a retry (a full disk
        # freed) was refused as "in use by another process".
        os.close(fd)
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise OSError(e.errno, f"{e.strerror} (writing the lock file"
                      f"{'; free space on its volume, then start again' if full else ''})",
                      lock_path) from e
    return fd


def _damaged_advice(path: str) -> str:
    """The way out of a damaged database, for every message that names one. Its -wal holds
    acknowledged rows not yet copied into the file: moved alone, the file's copy lacks them,
    and SQLite discards the WAL left behind at the next start."""
    name = os.path.basename(path) or path
    return (f"stop the service, then move {name} together with its {name}-wal and "
            f"{name}-shm files aside")


def _damaged_error(path: str, e: sqlite3.DatabaseError) -> sqlite3.DatabaseError:
    """`e` (not a database, or a malformed one) as an error naming the file and the way out:
    "database disk image is malformed" named neither, and the pod crash-looped. The way out
    names a backup too: a restore that left the old -wal beside the copy (replayed into it)
    ends here, and "starts empty" alone had the operator throw the restored entries away."""
    name = os.path.basename(path) or path
    return sqlite3.DatabaseError(
        f"{path}: {e} (a damaged database: {_damaged_advice(path)}; the service then starts "
        f"empty and the cache refills; or, to keep the entries, put a backup in as {name} "
        f"with no {name}-wal or {name}-shm beside it: docs/deploy.md)")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    label        INTEGER PRIMARY KEY AUTOINCREMENT,  -- faiss id; never reused
    id           TEXT NOT NULL UNIQUE,               -- public entry id
    tenant       TEXT NOT NULL,
    model_id     TEXT NOT NULL,
    context_hash TEXT NOT NULL,
    prompt       TEXT NOT NULL,
    answer       TEXT NOT NULL,
    embedding    BLOB NOT NULL,                      -- float32 little-endian, unit length
    embed_model  TEXT NOT NULL,                      -- embedding model that produced it
    verified     INTEGER NOT NULL DEFAULT 0,
    created_at   REAL NOT NULL,
    last_hit_at  REAL NOT NULL DEFAULT 0,
    hit_count    INTEGER NOT NULL DEFAULT 0,
    ttl_seconds  INTEGER NOT NULL DEFAULT 0,         -- 0 = never expires
    -- Answer cut after N tokens; 0 = whole. Every insert here sets it: the default is for a
    -- writer that does not know the column (a build rolled back to, before it existed),
    -- whose answers may have been cut, as _mark_uncertain_answers assumes of old rows. (A
    -- table created with DEFAULT 0 by an earlier build keeps it: IF NOT EXISTS leaves it.)
    truncated    INTEGER NOT NULL DEFAULT 1,
    -- The model's token ids of the answer (pack_tokens); empty = not given (readers
    -- tokenize the answer). Added without a schema version: a build that does not know it
    -- writes the default, which means just that.
    answer_tokens BLOB NOT NULL DEFAULT x''
);
-- Once created, never read: namespaces live in memory and rows are read by label or id. It
-- cost every insert and delete a b-tree update, and each row 30-65 bytes of disk.
DROP INDEX IF EXISTS entries_ns;
"""


@dataclass
class Row:
    """One stored entry as read back from SQLite."""

    label: int
    id: str
    tenant: str
    model_id: str
    context_hash: str
    prompt: str
    answer: str
    embedding: np.ndarray
    embed_model: str
    verified: bool
    created_at: float
    last_hit_at: float
    hit_count: int
    ttl_seconds: int
    truncated: int
    answer_tokens: bytes  # see pack_tokens


_COLS = ("label, id, tenant, model_id, context_hash, prompt, answer, embedding, embed_model, "
         "verified, created_at, last_hit_at, hit_count, ttl_seconds, truncated, answer_tokens")


def _row(t: tuple) -> Row:
    return Row(t[0], t[1], t[2], t[3], t[4], t[5], t[6], np.frombuffer(t[7], np.float32).copy(),
               t[8], bool(t[9]), t[10], t[11], t[12], t[13], int(t[14]), bytes(t[15]))


_TOKEN_WIDTHS = {2: "<u2", 4: "<u4"}


def pack_tokens(ids: Sequence[int]) -> bytes:
    """Token ids as stored: a byte giving their width, then each as an unsigned little-endian
    integer of that width: 2 bytes while every id is below 65,536 (SmolLM2's 49,152-token
    vocabulary), else 4. A Python list costs 8 bytes an id and more."""
    if not len(ids):
        return b""
    width = 2 if max(ids) < 1 << 16 else 4
    return bytes([width]) + np.asarray(ids, _TOKEN_WIDTHS[width]).tobytes()


def unpack_tokens(blob: bytes) -> list[int]:
    if not blob:
        return []
    return np.frombuffer(blob, _TOKEN_WIDTHS[blob[0]], offset=1).tolist()


@contextlib.contextmanager
def _damaged_is_named(path: str) -> Iterator[None]:
    """A damaged database (SQLITE_CORRUPT, SQLITE_NOTADB: plain DatabaseError, not one of its
    subclasses) found past the open, where pages are first read, names its file and the way
    out. Only the header and the schema are read at open: a page damaged in the middle
    surfaced as a bare "database disk image is malformed" from `load`."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        if type(e) is sqlite3.DatabaseError:
            raise _damaged_error(path, e) from e
        raise


@contextlib.contextmanager
def _unwritable_folder_is_named(path: str) -> Iterator[None]:
    """A database whose folder the service cannot write, though the file itself it can:
    SQLite's WAL creates `<db>-wal` and `<db>-shm` beside the file, so the open failed with a
    bare "attempt to write a readonly database", naming neither the file nor the folder (a
    volume mounted read-only, or owned by another uid than the pod's)."""
    try:
        yield
    except sqlite3.OperationalError as e:
        folder = os.path.dirname(os.path.abspath(path))
        code = getattr(e, "sqlite_errorcode", 0)
        if path == ":memory:" or not (
                code == sqlite3.SQLITE_READONLY_DIRECTORY
                or (code & 0xFF in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN)
                    and not os.access(folder, os.W_OK))):
            raise
        name = os.path.basename(path)
        raise NotWritable(
            f"{path}: {e}: the folder {folder} must be writable by the service (uid "
            f"{os.geteuid()}), not only the database file: SQLite's WAL keeps {name}-wal and "
            f"{name}-shm beside it; make it writable, or point TIERCACHE_SEMANTIC_DB_PATH at a "
            "writable folder") from None


def _file_size_limit() -> str:
    """The process's file-size limit (`ulimit -f`, RLIMIT_FSIZE) as a clause of a disk error,
    "" when there is none: past it every write fails as on a full disk, whatever the volume
    holds, and nothing else says so."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return "" if soft == resource.RLIM_INFINITY else (
        f"; this process's file-size limit (ulimit -f) is {soft} bytes")


@contextlib.contextmanager
def _full_is_exhausted() -> Iterator[None]:
    """A full disk (SQLITE_FULL: the disk or the database's size limit) is
    RESOURCE_EXHAUSTED naming it, not an INTERNAL error. So is a write the system refused
    for another reason than ENOSPC (SQLITE_IOERR_WRITE): SQLite maps only ENOSPC to
    SQLITE_FULL, and a file-size limit (EFBIG) or a disk quota (EDQUOT) reached read as a bare
    "disk I/O error": INTERNAL, "see server logs", and a traceback per Store (and a start
    that cut TTLs exited 2, "bad configuration"). The statement is rolled back either way."""
    try:
        yield
    except sqlite3.OperationalError as e:
        code = getattr(e, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_FULL or "full" in str(e):
            raise ResourceExhausted(
                f"disk: the entry store is full ({e}{_file_size_limit()})") from None
        if code == sqlite3.SQLITE_IOERR_WRITE:
            raise ResourceExhausted(
                f"disk: the entry store could not be written ({e}: a file-size limit or disk "
                f"quota reached, or the volume failing{_file_size_limit()})") from None
        raise


class EntryStore:
    """All SQLite access of the service, on one connection guarded by a lock."""

    def __init__(self, path: str, synchronous: str = "FULL") -> None:
        self._lock_fd: int | None = None
        self._closed = False
        if path != ":memory:":
            # Every tenant's prompts and answers: readable by this user only (SQLite gives its
            # -wal and -shm files the database's mode).
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
            _folders_in_the_way(path)
            self._lock_fd = _lock_database(path)
        self.path = path
        self._lock = threading.Lock()
        # Rows deleted since the WAL was last emptied (or an emptying that did not finish: a
        # reader, a full disk): their text may still be in the -wal file, and the next
        # erasing call or purge empties it (`wal_owed`).
        self._wal_owed = False
        try:
            # Not a database, or a malformed one: "file is not a database" named no file
            # and no way out, and the pod crash-looped.
            with _damaged_is_named(path), _unwritable_folder_is_named(path):
                if path != ":memory:":
                    _say_if_emptied(path)
                    _owner_only(path)
                self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
                # Read before anything is written (journal mode, schema): a newer database is
                # refused as it was found, for the newer build to open again.
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    # A rollback past a schema change: this build would read (and write) rows
                    # whose meaning it does not know, and never run the newer migration again.
                    raise ValueError(
                        f"{path}: schema version {version} is newer than this build's "
                        f"({SCHEMA_VERSION}); run the newer build, or {_damaged_advice(path)} "
                        "to start this one empty")
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
                self._db.execute(f"PRAGMA journal_size_limit={_JOURNAL_SIZE_LIMIT}")
                # A deleted row (Invalidate, expiry, eviction) is overwritten with zeros, not
                # left readable in a free page or slot of the file: SQLite's default is off
                # unless its build says otherwise (Debian's says on, python.org's does not).
                self._db.execute("PRAGMA secure_delete=ON")
                self._db.executescript(_SCHEMA)
                cols = {r[1] for r in self._db.execute("PRAGMA table_info(entries)")}
                if version < 1:
                    self._mark_uncertain_answers("truncated" in cols)
                if "answer_tokens" not in cols:
                    # Every existing row reads the default (no ids: tokenize the answer).
                    self._db.execute("ALTER TABLE entries ADD COLUMN answer_tokens BLOB "
                                     "NOT NULL DEFAULT x''")
        except BaseException:
            if getattr(self, "_db", None) is not None:
                self._db.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise
        # Hit counters have their own lock: a lookup that records a hit must not wait behind a
        # Store's fsync or a flush holding the connection.
        self._hits_lock = threading.Lock()
        self._pending_hits: dict[int, tuple[float, int]] = {}

    def _mark_uncertain_answers(self, has_column: bool) -> None:
        """Answers stored before the `truncated` column may have been cut by max_tokens, and
        nothing says which: read as 0 ("whole"), a 24-token cut was served as the complete
        answer to a request for 64. They are marked cut after 1 token: they serve no request
        wanting more (the model answers, with the old answer as its draft, and the new answer
        replaces it). Once per database (user_version 1)."""
        with self._lock, self._transaction():
            if not has_column:
                # A schema change only: every existing row reads the default, nothing is
                # rewritten (inserts always give the column).
                self._db.execute(
                    "ALTER TABLE entries ADD COLUMN truncated INTEGER NOT NULL DEFAULT 1")
            else:
                # Upgraded by an earlier version, which gave old rows 0: those from before the
                # column existed (2026-11-30 02:15:33 UTC) are the uncertain ones.
                self._db.execute("UPDATE entries SET truncated = 1 "
                                 "WHERE truncated = 0 AND created_at < ?", (_COLUMN_ADDED,))
            self._db.execute("PRAGMA user_version = 1")

    def close(self) -> None:
        """Writes buffered hit counts, closes the database and releases its lock (idempotent)."""
        if self._closed:
            return
        try:
            self.flush_hits()
        except (sqlite3.Error, ResourceExhausted) as exc:
            # Hit counters are best effort (not worth an fsync per lookup); a full disk at
            # shutdown must not keep the database open and locked.
            log.warning("hit counters not written at close: %s", exc)
        with self._lock:
            self._closed = True
            self._db.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the lock
                self._lock_fd = None

    def insert(self, *, id: str, tenant: str, model_id: str, context_hash: str, prompt: str,
               answer: str, embedding: np.ndarray, embed_model: str, verified: bool,
               created_at: float, ttl_seconds: int, truncated: int = 0,
               answer_tokens: bytes = b"") -> int:
        """Commits one entry durably and returns its label.

        Raises:
            ResourceExhausted: the disk (or the database's size limit) is full; nothing written.
        """
        blob = np.asarray(embedding, "<f4").tobytes()
        # SQLITE_FULL: the statement was rolled back; a client error, not a crash.
        with _full_is_exhausted(), self._lock:
            cur = self._db.execute(
                "INSERT INTO entries (id, tenant, model_id, context_hash, prompt, answer, "
                "embedding, embed_model, verified, created_at, ttl_seconds, truncated, "
                "answer_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (id, tenant, model_id, context_hash, prompt, answer, blob, embed_model,
                 int(verified), created_at, ttl_seconds, int(truncated), answer_tokens))
            return int(cur.lastrowid)

    def insert_many(self, rows: list[dict]) -> None:
        """Bulk load in one transaction (benchmarks, imports); keys as for `insert`."""
        with self._lock, self._transaction():
            self._db.executemany(
                "INSERT INTO entries (id, tenant, model_id, context_hash, prompt, answer, "
                "embedding, embed_model, verified, created_at, ttl_seconds, truncated, "
                "answer_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(r["id"], r["tenant"], r["model_id"], r["context_hash"], r["prompt"],
                  r["answer"], np.asarray(r["embedding"], "<f4").tobytes(),
                  r["embed_model"], int(r["verified"]), r["created_at"], r["ttl_seconds"],
                  int(r.get("truncated", 0)), r.get("answer_tokens", b""))
                 for r in rows])

    def get(self, id: str) -> Row | None:
        with self._lock, _damaged_is_named(self.path):
            t = self._db.execute(f"SELECT {_COLS} FROM entries WHERE id = ?", (id,)).fetchone()
        return _row(t) if t else None

    def set_verified(self, label: int, verified: bool) -> None:
        """Raises:
            ResourceExhausted: the disk (or the database's size limit) is full; not written.
        """
        with _full_is_exhausted(), _damaged_is_named(self.path), self._lock:
            self._db.execute("UPDATE entries SET verified = ? WHERE label = ?",
                             (int(verified), label))

    def clamp_future(self, now: float) -> int:
        """Rows stamped after `now` (written while the clock ran ahead) get `now` as their
        creation and last hit; returns how many. Clamped in memory only, such a row took
        `now` again at every restart, and restarts kept it alive past its TTL."""
        with _full_is_exhausted(), _damaged_is_named(self.path), self._lock:
            cur = self._db.execute(
                "UPDATE entries SET created_at = MIN(created_at, ?1), "
                "last_hit_at = MIN(last_hit_at, ?1) WHERE created_at > ?1 OR last_hit_at > ?1",
                (now,))
            return cur.rowcount

    def cap_ttls(self, cap: int, never: bool) -> int:
        """TTLs over `cap` (>= 1) become `cap` (with `never`, so do TTLs of 0 or less, "never
        expires"); returns how many rows. Cut in memory only (at load), a TTL came back whole
        at the next start under a higher limit, and an answer that had expired under the cut,
        not yet purged, was served again (or, stored to never expire, for good). `WRITE_CHUNK`
        rows per transaction, walking the table by label once: SQLite rewrites each row whole
        (its embedding too), and a lowered limit matches every row, so one transaction needed
        free disk about the size of the database for its WAL, and on a fuller disk failed at
        every start. A failure keeps the chunks already written.

        Raises:
            ResourceExhausted: the disk is full.
        """
        where = "ttl_seconds > ?" + (" OR ttl_seconds <= 0" if never else "")
        done, last = 0, -1
        while True:
            with (_full_is_exhausted(), _damaged_is_named(self.path), self._lock,
                  self._transaction()):
                labels = [r[0] for r in self._db.execute(
                    f"SELECT label FROM entries WHERE label > ? AND ({where}) "
                    "ORDER BY label LIMIT ?", (last, cap, WRITE_CHUNK))]
                if labels:
                    self._db.executemany("UPDATE entries SET ttl_seconds = ? WHERE label = ?",
                                         [(cap, x) for x in labels])
            done += len(labels)
            if len(labels) < WRITE_CHUNK:
                return done
            last = labels[-1]

    def set_embedding(self, label: int, embedding: np.ndarray, embed_model: str) -> None:
        self.set_embeddings([(label, embedding, embed_model)])

    def set_embeddings(self, rows: list[tuple[int, np.ndarray, str]]) -> None:
        """Rewrites many rows' (label, vector, embedding model), `WRITE_CHUNK` rows per
        transaction. Re-embedding or normalising 100k rows at start one autocommitted UPDATE
        at a time cost 100k fsyncs. A failure leaves earlier chunks written: each row is
        whole, and one not yet rewritten is simply fixed again at the next start."""
        for i in range(0, len(rows), WRITE_CHUNK):
            params = [(np.asarray(v, "<f4").tobytes(), model, label)
                      for label, v, model in rows[i:i + WRITE_CHUNK]]
            with (_full_is_exhausted(), _damaged_is_named(self.path), self._lock,
                  self._transaction()):
                self._db.executemany(
                    "UPDATE entries SET embedding = ?, embed_model = ? WHERE label = ?", params)

    def delete(self, labels: list[int], committed: list[int] | None = None) -> None:
        """Deletes entries by label, `WRITE_CHUNK` per transaction with the lock let go between
        them: an Invalidate of 200k entries in one transaction held every Store for seconds.
        Not atomic: a failure leaves the earlier chunks deleted, and deleting them again is
        harmless. `committed`, when given, is extended with each chunk once it is deleted, so
        a caller whose delete failed part-way can drop from memory the rows already gone.

        Raises:
            ResourceExhausted: the disk is full (a delete writes to the WAL first).
        """
        for i in range(0, len(labels), WRITE_CHUNK):
            chunk = labels[i:i + WRITE_CHUNK]
            with (_full_is_exhausted(), _damaged_is_named(self.path), self._lock,
                  self._transaction()):
                self._db.executemany("DELETE FROM entries WHERE label = ?",
                                     [(x,) for x in chunk])
                # Their text stays in the WAL as written until it is emptied: owed, so that
                # the housekeeper's next purge empties it after an eviction or a replacement
                # too (they stayed there until an erasing call or later writes overwrote it).
                self._wal_owed = True
            if committed is not None:
                committed.extend(chunk)
            with self._hits_lock:
                for x in chunk:
                    self._pending_hits.pop(x, None)

    def truncate_wal(self) -> bool:
        """Checkpoints the WAL into the database and truncates it to zero bytes: the WAL keeps
        every page as it was written, deleted rows' text included, until later writes
        overwrite it (up to journal_size_limit). Returns False when a reader kept the
        checkpoint from finishing (another process holding the database open: a backup);
        the WAL then stays as it was and a later call finishes it (`wal_owed` says one is
        due: an erasing call repeated, or the housekeeper's next purge, makes it)."""
        if self.path == ":memory:":
            return True
        with _full_is_exhausted(), _damaged_is_named(self.path), self._lock:
            self._wal_owed = True  # until it has finished: a raise leaves it owed
            # Without waiting: under the store lock SQLite's busy timeout (5 s) stalled every
            # Store and hit flush that long behind a backup's read, only to warn after.
            wait = self._db.execute("PRAGMA busy_timeout").fetchone()[0]
            self._db.execute("PRAGMA busy_timeout = 0")
            try:
                busy = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            finally:
                self._db.execute(f"PRAGMA busy_timeout = {int(wait)}")
            self._wal_owed = bool(busy)
        if busy:
            log.warning("%s: the WAL was not emptied (another connection reads the database);"
                        " deleted rows may stay readable in its -wal file until it is", self.path)
        return not busy

    @property
    def wal_owed(self) -> bool:
        """Whether the WAL may hold deleted rows' text: rows deleted since the last
        `truncate_wal` that finished (or the last did not finish)."""
        return self._wal_owed

    def record_hit(self, label: int, at: float, hit_count: int) -> None:
        """Buffers a hit (written by `flush_hits`); never waits on SQLite."""
        with self._hits_lock:
            self._pending_hits[label] = (at, hit_count)

    def flush_hits(self) -> int:
        """Writes buffered hit counters; returns how many rows were updated (a counter of an
        entry deleted since it was recorded updates none)."""
        with self._hits_lock:
            pending, self._pending_hits = self._pending_hits, {}
        if not pending:
            return 0
        # A counter of an entry deleted meanwhile updates no row: harmless.
        try:
            # A full disk (or a file-size limit) is ResourceExhausted naming it, as every
            # other write's: the housekeeper retries each tick and warns, without a traceback.
            with _full_is_exhausted(), self._lock, self._transaction():
                cur = self._db.executemany(
                    # Never lower: a counter restored after a failed flush may be older.
                    "UPDATE entries SET last_hit_at = MAX(last_hit_at, ?), "
                    "hit_count = MAX(hit_count, ?) WHERE label = ?",
                    [(at, n, lab) for lab, (at, n) in pending.items()])
        except BaseException:
            with self._hits_lock:  # retried next flush; hits recorded since are newer
                for lab, v in pending.items():
                    self._pending_hits.setdefault(lab, v)
            raise
        return cur.rowcount

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """BEGIN ... COMMIT, rolled back on any error (the caller holds `_lock`). Left open, a
        failed transaction would swallow every later insert: acknowledged Stores that are
        never committed."""
        self._db.execute("BEGIN")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # SQLite may already have rolled it back itself
                self._db.execute("ROLLBACK")
            raise

    def iter_all(self, batch: int = 5000) -> Iterator[list[Row]]:
        """Every entry, in label order, in batches (read at start: `load`)."""
        last = -1
        while True:
            with self._lock, _damaged_is_named(self.path):
                rows = self._db.execute(
                    f"SELECT {_COLS} FROM entries WHERE label > ? ORDER BY label LIMIT ?",
                    (last, batch)).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield [_row(t) for t in rows]

    def count(self) -> int:
        with self._lock, _damaged_is_named(self.path):
            return int(self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0])

    def labels_issued(self) -> int:
        """The highest label this database has ever given (AUTOINCREMENT's counter; 0 for
        none): every label it gives from now on is higher. A saved HNSW graph holding a higher
        one was saved from a later state of the database (a backup restored since, or commits
        lost to a power cut) and must not be taken: those labels will be given again."""
        with self._lock, _damaged_is_named(self.path):
            row = self._db.execute(
                "SELECT seq FROM sqlite_sequence WHERE name = 'entries'").fetchone()
        return int(row[0]) if row else 0
