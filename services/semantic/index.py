"""Per-namespace vector index: inner product over unit vectors, searches never wait on writes.

    snapshot (immutable, swapped atomically)          delta (append-only buffer)
    +--------------------------------------+          +------------------------+
    | main: faiss Flat (small) or HNSW     |          | rows [0, n) visible    |
    | main_labels[i] -> entry label        |          | labels[0, n)           |
    +--------------------------------------+          +------------------------+

A search reads the current snapshot reference and the delta's published row count, and never
takes a lock: the main index is never mutated after it is published, and delta rows below the
published count are never rewritten. Writers (serialised on one lock) append to the delta; a
delta 3/4 full is merged on a background thread into a new main index (Flat while the namespace
holds fewer than `hnsw_min_entries`, else HNSW — for HNSW a copy of the old graph plus the new
rows), built without the lock and then swapped in with the rows added meanwhile carried over.
A writer never builds: while a merge runs, a full delta is copied into a larger one (readers of
the old snapshot keep theirs). Removals are tombstones, filtered out of results; they stay in
an HNSW graph that is only extended, and are purged by a full rebuild once they are a quarter
of the index (also on a background thread).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import faiss
import numpy as np

_EXTRA_K = 8  # extra neighbours fetched so that tombstoned rows rarely hide a live one
# Background merges building at once, process-wide. Each builds a whole namespace's index
# (HNSW on every core, plus a copy of its vectors): many namespaces filling their deltas at
# once multiplied the CPU contention and the memory peak. A merge waiting here lets its
# namespace go on filling a grown delta, as when a merge runs.
MERGE_SLOTS = threading.BoundedSemaphore(2)
_search_threads = 1
_thread_state = threading.local()


def set_search_threads(n: int) -> None:
    """OpenMP threads faiss may use for a search (every thread that searches).

    One query needs no parallelism, and on a busy machine OpenMP threads waiting for each
    other turned a 0.6 ms flat search over 10k vectors into 23 ms (p50) — so 1 by default.
    OpenMP keeps this setting per thread, and threads it did not start (gRPC's workers) begin
    with the default of one per core: each searching thread applies it itself
    (`_apply_search_threads`).
    """
    global _search_threads
    _search_threads = max(1, n)
    _apply_search_threads()


def _apply_search_threads() -> None:
    if getattr(_thread_state, "threads", None) != _search_threads:
        faiss.omp_set_num_threads(_search_threads)
        _thread_state.threads = _search_threads


def _build_thread_count() -> int:
    """Threads for bulk builds: OMP_NUM_THREADS when set (a pod sets it to its CPU limit; the
    node's core count would oversubscribe the quota and get throttled), else every core."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", "") or 0)
    except ValueError:
        n = 0
    return n if n > 0 else (os.cpu_count() or 1)


@contextlib.contextmanager
def _build_threads() -> Iterator[None]:
    """The build threads while bulk-building an index (at start, before SERVING)."""
    faiss.omp_set_num_threads(_build_thread_count())
    try:
        yield
    finally:
        faiss.omp_set_num_threads(_search_threads)
        _thread_state.threads = _search_threads


set_search_threads(1)


class IndexParams(NamedTuple):
    """How a namespace index is built."""

    dim: int
    hnsw_min_entries: int = 20000
    hnsw_m: int = 32
    hnsw_ef_construction: int = 80
    hnsw_ef_search: int = 32
    delta_capacity: int = 2048


class Neighbor(NamedTuple):
    """One search result: the entry label and its cosine similarity."""

    label: int
    score: float


# Rows a delta starts with when its first row comes (it doubles as it fills). One: most
# namespaces of chat traffic (one per conversation turn) hold a single entry, and a second row
# kept for each was a third of a one-entry namespace's memory (`benchmarks.namespace_scale`).
_INITIAL_DELTA_ROWS = 1
# Numbers the main indexes published, process-wide (`NamespaceIndex.saved_graph`).
_MAIN_VERSIONS = itertools.count(1)


def _stored(main: faiss.Index | None, dim: int) -> np.ndarray:
    """The vectors a main index holds, in its order: a view of faiss's own storage, valid
    while `main` lives and never written (a published main is immutable). A copy kept beside
    it doubled the vectors' memory (about 3 GB at 2M entries of 384 floats)."""
    if main is None:
        return np.zeros((0, dim), np.float32)
    flat = faiss.downcast_index(main.storage) if isinstance(main, faiss.IndexHNSWFlat) else main
    n = flat.ntotal
    if n == 0:
        return np.zeros((0, dim), np.float32)
    return faiss.rev_swig_ptr(flat.get_xb(), n * dim).reshape(n, dim)


@dataclass(frozen=True)
class _Snapshot:
    main: faiss.Index | None
    main_labels: np.ndarray  # int64, position in main -> label
    delta_vecs: np.ndarray  # float32 [capacity, dim]; rows >= count[0] not yet visible
    delta_labels: np.ndarray  # int64 [capacity]
    kind: str  # "flat", "hnsw" or "empty"
    count: list[int]  # [visible delta rows]; the only mutable part, written under the lock
    version: int = 0  # which main index: each one published gets a new number

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(labels, vectors) of main + visible delta (copies)."""
        n = self.count[0]
        return (np.concatenate([self.main_labels, self.delta_labels[:n]]),
                np.concatenate([_stored(self.main, self.delta_vecs.shape[1]),
                                self.delta_vecs[:n]]))


class NamespaceIndex:
    """The vectors of one namespace. `search` is lock-free; writes are serialised.

    Args:
        params: index parameters.
        background: merge a filling delta on a background thread (the writer that fills it
            completely merges synchronously). Off = merges happen inline (deterministic tests).
    """

    def __init__(self, params: IndexParams, background: bool = True) -> None:
        self.params = params
        self.background = background
        self._lock = threading.Lock()
        self._dead: set[int] = set()
        self._live: set[int] = set()
        self._snap = self._new_snapshot(None, np.zeros(0, np.int64), "empty", 0)
        self._merging: threading.Thread | None = None
        self._closing = False
        self._held = 0  # callers inside `merges_held`
        # Removals so far (evictions too): a search (lock-free) that ran while a Store replaced
        # an entry (its row added, the old one removed) may have seen neither row
        # (`SemanticCache._search` asks). An add alone never hides a row that was there, so it
        # is not counted.
        self.removals = 0

    def _new_snapshot(self, main, labels, kind, cap: int) -> _Snapshot:
        # The delta is allocated by the first add (`_grow_delta_locked`) at one row and
        # doubles as it fills (up to `delta_capacity`): chat traffic has about one namespace
        # per conversation turn, and a full-size delta each (3 MiB of address space at
        # 2048 x 384 floats) cost 28-140 KiB of RSS per entry. After a build it holds just the
        # rows added meanwhile, often none: a namespace loaded at start and never written to
        # again holds no delta at all.
        return _Snapshot(main, labels, np.zeros((cap, self.params.dim), np.float32),
                         np.zeros(cap, np.int64), kind, [0], next(_MAIN_VERSIONS))

    @property
    def _first_delta_rows(self) -> int:
        """Rows of a new namespace's delta (and of one grown from none)."""
        return min(_INITIAL_DELTA_ROWS, self.params.delta_capacity)

    def __len__(self) -> int:
        return len(self._live)

    @property
    def kind(self) -> str:
        """"flat", "hnsw" or "empty": what the main index currently is."""
        return self._snap.kind

    def add(self, label: int, vec: np.ndarray) -> None:
        """Adds one unit vector under `label` (visible to searches on return). Labels are
        fresh: one still indexed, live or tombstoned, is refused (ValueError)."""
        with self._lock:
            self._check_fresh_locked((label,))
            snap = self._snap
            n = snap.count[0]
            if (n >= len(snap.delta_labels) and not self.background
                    and n >= self.params.delta_capacity):
                self._swap_locked(self._build(snap, n, set(self._dead)))
                snap, n = self._snap, self._snap.count[0]
            if n >= len(snap.delta_labels):  # full, or a build left no rows
                snap = self._grow_delta_locked(snap, n)
            snap.delta_vecs[n] = vec
            snap.delta_labels[n] = label
            self._live.add(label)
            self._dead.discard(label)
            snap.count[0] = n + 1  # publish the row only after it is written
            self._maybe_merge_locked()

    def _grow_delta_locked(self, snap: _Snapshot, n: int) -> _Snapshot:
        """A snapshot with the same main index and a delta twice as large (rows copied):
        writers go on while a merge is still building, instead of building themselves."""
        cap = max(self._first_delta_rows, 2 * len(snap.delta_labels))
        if len(snap.delta_labels) < self.params.delta_capacity:
            cap = min(cap, self.params.delta_capacity)  # still growing to its planned size
        new = _Snapshot(snap.main, snap.main_labels,
                        np.zeros((cap, self.params.dim), np.float32), np.zeros(cap, np.int64),
                        snap.kind, [n], snap.version)
        new.delta_vecs[:n] = snap.delta_vecs[:n]
        new.delta_labels[:n] = snap.delta_labels[:n]
        self._snap = new
        return new

    def _too_many_dead_locked(self) -> bool:
        return len(self._dead) > max(64, len(self._live) // 4)

    def _needs_merge_locked(self) -> bool:
        snap = self._snap
        return (snap.count[0] >= max(1, self.params.delta_capacity * 3 // 4)
                or self._too_many_dead_locked())

    def _maybe_merge_locked(self) -> None:
        if (self.background and self._merging is None and not self._closing
                and not self._held and self._needs_merge_locked()):
            self._merging = threading.Thread(target=self._merge_in_background,
                                             name="index-merge", daemon=True)
            self._merging.start()

    def add_many(self, labels: np.ndarray, vecs: np.ndarray) -> None:
        """Bulk load (e.g. at start): builds the main index over everything at once."""
        labels = np.asarray(labels, np.int64)
        with self._lock, _build_threads():
            self._check_fresh_locked(int(x) for x in labels)
            snap = self._snap
            n = snap.count[0]
            self._live.update(int(x) for x in labels)
            self._dead.difference_update(int(x) for x in labels)
            old_l, old_v = snap.rows()
            self._swap_locked(self._build(
                snap, n, set(self._dead), np.concatenate([old_l, labels]),
                np.concatenate([old_v, np.asarray(vecs, np.float32)])))

    def saved_main(self) -> tuple[faiss.Index, np.ndarray] | None:
        """The published HNSW main index and its labels, for a snapshot file (None while the
        main index is flat or empty: those rebuild in moments). Immutable once published, so
        it may be written out while searches and merges go on; the delta and tombstones are
        left out (the entries' store has them: `adopt` catches up)."""
        saved = self.saved_graph()
        return saved[:2] if saved is not None else None

    def saved_graph(self) -> tuple[faiss.Index, np.ndarray, int] | None:
        """`saved_main` and the main index's version: a number no other main index published
        in this process has (an object's id() does not do: a freed graph's address is given to
        a later one)."""
        snap = self._snap
        return (snap.main, snap.main_labels, snap.version) if snap.kind == "hnsw" else None

    def adopt(self, main: faiss.Index, main_labels: np.ndarray, labels: np.ndarray,
              vecs: np.ndarray, labels_issued: int) -> bool:
        """Bulk load from a saved HNSW main index instead of building one (at start): the
        build is nearly all of a restart's time (~14 s of 15 at 30k entries, 2 cores).

        `labels`, `vecs`: the namespace's live entries, as the entries' store holds them (the
        truth). The saved index is taken only if it is HNSW over `params.dim` with unique
        labels and every saved row whose label is live holds exactly that entry's vector;
        saved rows no longer live are tombstoned (purged by the usual rule), live entries it
        lacks are added to its graph. `labels_issued`: the highest label the store has ever
        given; a graph holding a higher one is from a later state of the database (a backup
        restored since) and is refused: its rows of those labels would stay as tombstones
        while the store gives the labels again, and every such Store would fail. So is a graph
        that holds none of the live entries (another database's: nothing to check it by).
        Returns False, changing nothing, if it does not fit (or this index is not new): the
        caller builds as before."""
        p = self.params
        main_labels = np.ascontiguousarray(main_labels, np.int64)
        labels = np.asarray(labels, np.int64)
        vecs = np.asarray(vecs, np.float32)
        if (not isinstance(main, faiss.IndexHNSWFlat) or main.d != p.dim
                or main.metric_type != faiss.METRIC_INNER_PRODUCT
                or main.ntotal != len(main_labels) or len(labels) != len(vecs)
                or len(main_labels) == 0 or int(main_labels.max()) > labels_issued
                or len(np.unique(main_labels)) != len(main_labels)):
            return False
        order = np.argsort(main_labels, kind="stable")
        pos = np.minimum(np.searchsorted(main_labels[order], labels), len(order) - 1)
        found = main_labels[order][pos] == labels
        if not found.any():
            return False
        rows = order[pos[found]]
        stored, live = _stored(main, p.dim), vecs[found]
        for s in range(0, len(rows), 8192):  # in chunks: not a third copy of every vector
            if not np.array_equal(stored[rows[s:s + 8192]], live[s:s + 8192]):
                return False  # another database's index, or vectors re-embedded since
        del live
        with self._lock, _build_threads():
            if self._live or self._dead or self._snap.main is not None or self._snap.count[0]:
                return False
            dead = set(main_labels.tolist()) - set(labels[found].tolist())
            new_l, new_v = labels[~found], vecs[~found]
            if len(new_l):
                main.add(np.ascontiguousarray(new_v))  # not yet published: ours to extend
                main_labels = np.concatenate([main_labels, new_l])
            main.hnsw.efSearch = p.hnsw_ef_search
            self._snap = self._new_snapshot(main, main_labels, "hnsw", 0)
            self._live = set(labels.tolist())
            self._dead = dead
            self._after_removal_locked()
        return True

    def _check_fresh_locked(self, labels: Iterable[int]) -> None:
        """A removed label's row stays in the index until a purge: taken back then, the label
        was indexed twice and searches scored it by its old vector too."""
        seen: set[int] = set()
        for label in labels:
            if label in self._live or label in self._dead or label in seen:
                raise ValueError(f"label {label} is already indexed (labels are never reused)")
            seen.add(label)

    def remove(self, label: int) -> bool:
        """Tombstones `label`; returns False if it was not present."""
        with self._lock:
            if label not in self._live:
                return False
            self._live.discard(label)
            self._dead.add(label)
            self.removals += 1
            self._after_removal_locked()
            return True

    def _after_removal_locked(self) -> None:
        """Purges tombstones (inline without a background thread) or starts a merge, if they
        ask for it and no caller holds merges."""
        if self._held:
            return
        if not self.background and self._too_many_dead_locked():
            snap = self._snap
            self._swap_locked(self._build(snap, snap.count[0], set(self._dead), purge=True))
        self._maybe_merge_locked()

    @contextlib.contextmanager
    def merges_held(self) -> Iterator[None]:
        """No merge or purge starts inside (removals are only tombstoned), and a running merge
        stops after its current build: a namespace being emptied crossed the tombstone rule
        a quarter of the way and rebuilt an index about to be thrown away (seconds of HNSW).
        On leaving, an index that still holds entries merges if it needs to."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                if self._live:
                    self._after_removal_locked()

    @property
    def merging(self) -> bool:
        """A background merge is running."""
        t = self._merging
        return t is not None and t.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """Lets a running merge finish and starts no more (before the process exits: a
        thread killed inside faiss aborts the interpreter)."""
        with self._lock:
            self._closing = True
            t = self._merging
        if t is not None:
            t.join(timeout)

    def compact(self) -> None:
        """Merges the delta and purges tombstones now (waits for a running merge)."""
        t = self._merging
        if t is not None:
            t.join()
        with self._lock:
            snap = self._snap
            self._swap_locked(self._build(snap, snap.count[0], set(self._dead), purge=True))

    def _merge_in_background(self) -> None:
        while True:
            try:
                with MERGE_SLOTS:
                    with self._lock:
                        if self._closing:  # shut down while waiting for a slot: no build
                            self._merging = None
                            return
                        snap = self._snap
                        n, dead = snap.count[0], set(self._dead)
                        # The same rule that asked for this merge: many tombstones = purge
                        # them (an extended graph would keep them, and the merge would start
                        # again).
                        purge = self._too_many_dead_locked()
                    built = self._build(snap, n, dead, purge=purge)  # slow; no index lock
            except BaseException:
                with self._lock:
                    self._merging = None
                raise
            with self._lock:
                # Nobody merged meanwhile (a grown delta shares the main and its labels).
                if self._snap.main_labels is snap.main_labels:
                    self._swap_locked(built)
                if self._closing or self._held or not self._needs_merge_locked():
                    self._merging = None
                    return

    def _build(self, snap: _Snapshot, n: int, dead: set[int],
               labels: np.ndarray | None = None, vecs: np.ndarray | None = None,
               purge: bool = False):
        """A new main index over `snap`'s main + its first `n` delta rows (or over `labels`,
        `vecs`), without `dead` unless the HNSW graph is only extended. Returns (main, labels,
        kind, snap, n, purged): `purged` the tombstones it left out."""
        bulk = labels is not None
        p = self.params
        if not bulk:
            labels = np.concatenate([snap.main_labels, snap.delta_labels[:n]])
            if (not purge and snap.kind == "hnsw"
                    and len(labels) - len(dead) >= p.hnsw_min_entries):
                # Extend the graph: a copy of it plus the new rows. Tombstoned rows stay
                # (searches skip them) until a merge purges them (more than a quarter of the
                # live entries); rebuilding HNSW from scratch on every merge cost seconds per
                # thousand rows.
                main = faiss.clone_index(snap.main)
                main.add(np.ascontiguousarray(snap.delta_vecs[:n]))
                main.hnsw.efSearch = p.hnsw_ef_search
                return main, np.ascontiguousarray(labels), "hnsw", snap, n, set()
            vecs = np.concatenate([_stored(snap.main, p.dim), snap.delta_vecs[:n]])
        if dead:
            keep = ~np.isin(labels, np.fromiter(dead, np.int64, len(dead)))
            labels, vecs = labels[keep], vecs[keep]
        if len(labels) == 0:
            main, kind = None, "empty"
        elif len(labels) < p.hnsw_min_entries:
            main, kind = faiss.IndexFlatIP(p.dim), "flat"
            main.add(vecs)
        else:
            main, kind = faiss.IndexHNSWFlat(p.dim, p.hnsw_m, faiss.METRIC_INNER_PRODUCT), "hnsw"
            main.hnsw.efConstruction = p.hnsw_ef_construction
            main.add(vecs)
        if kind == "hnsw":
            main.hnsw.efSearch = p.hnsw_ef_search
        return main, np.ascontiguousarray(labels), kind, snap, n, dead

    def _swap_locked(self, built) -> None:
        """Publishes a built main index; delta rows added since the build carry over."""
        main, labels, kind, snap, n, dead = built
        cur = self._snap
        # `cur` is `snap`, or a copy of it with a larger delta (same main, same first rows).
        assert cur.main_labels is snap.main_labels, "a snapshot was swapped under a build"
        late = cur.count[0] - n
        new = self._new_snapshot(main, labels, kind, 2 * late)
        if late:
            new.delta_vecs[:late] = cur.delta_vecs[n:n + late]
            new.delta_labels[:late] = cur.delta_labels[n:n + late]
            new.count[0] = late
        # Readers holding the old snapshot keep a consistent view (its rows are never
        # rewritten); new readers see the new one whole.
        self._snap = new
        self._dead -= dead

    def search(self, vec: np.ndarray, k: int = 1) -> list[Neighbor]:
        """The `k` most similar live entries, best first. Never blocks on writers."""
        q = np.asarray(vec, np.float32).reshape(1, -1)
        _apply_search_threads()
        while True:
            snap = self._snap
            n = snap.count[0]
            total = len(snap.main_labels) + n
            # Tombstoned rows may fill the top of the list; the snapshot may even hold rows
            # whose tombstones a newer snapshot already purged. Fetch extra, and more until the
            # k best live rows are known: k live rows are not enough when one source's fetched
            # rows were all tombstones (a popular question invalidated a dozen times) and the
            # other's live ones score lower than what the first holds beyond them.
            want = k + _EXTRA_K
            while True:
                live, floor = self._search_snapshot(snap, n, q, want)
                if (len(live) >= k and live[k - 1].score >= floor) or want >= total:
                    break
                want *= 4
            # A label purged by a merge published meanwhile may have been added again (a
            # purged label is free): `snap` still holds its old row, which passed as live and
            # scored the label by a vector it no longer has (at 1.0 for a query equal to the
            # old one). Every merge publishes new main labels: search the new snapshot then.
            if self._snap.main_labels is snap.main_labels:
                return live[:k]

    def _search_snapshot(self, snap: _Snapshot, n: int, q: np.ndarray,
                         want: int) -> tuple[list[Neighbor], float]:
        """The live rows among each source's `want` best, best first, and the best score an
        unfetched row may have (the lowest fetched of a source cut at `want`; -inf if none
        was cut)."""
        found: dict[int, float] = {}
        floor = -np.inf
        if snap.main is not None:
            scores, pos = snap.main.search(q, min(want, len(snap.main_labels)))
            got = pos[0] >= 0
            if want < len(snap.main_labels):
                floor = float(scores[0][got].min()) if got.any() else np.inf
            for s, i in zip(scores[0][got], pos[0][got], strict=True):
                found[int(snap.main_labels[i])] = float(s)
        if n:
            ds = snap.delta_vecs[:n] @ q[0]
            top = np.argsort(-ds)[:want]
            if want < n:
                floor = max(floor, float(ds[top[-1]]))
            for i in top:
                lab = int(snap.delta_labels[i])
                found[lab] = max(found.get(lab, -2.0), float(ds[i]))
        live = [Neighbor(lab, s) for lab, s in found.items() if lab in self._live]
        live.sort(key=lambda nb: -nb.score)
        return live, floor

    def search_exact(self, vec: np.ndarray, k: int = 1) -> list[Neighbor]:
        """Brute-force reference search over every live vector (benchmarks, tests)."""
        labels, vecs = self._snap.rows()
        scores = vecs @ np.asarray(vec, np.float32)
        out = [Neighbor(int(labels[i]), float(scores[i])) for i in np.argsort(-scores)]
        return [nb for nb in out if nb.label in self._live][:k]

    def check_integrity(self) -> None:
        """Raises AssertionError unless labels, tombstones and vectors agree."""
        with self._lock:
            # The sets with the snapshot, under one hold of the lock: read after it, a merge
            # finishing between could have purged tombstones the snapshot still held, and a
            # sound index failed the check ("an unknown label is indexed"; found by a stress
            # run, 8 in 20,000 checks with a 1 us switch interval).
            snap = self._snap
            labels, _ = snap.rows()
            live, dead = set(self._live), set(self._dead)
        present = set(int(x) for x in labels)
        assert len(present) == len(labels), "a label is indexed twice"
        assert live <= present, "a live label is missing from the index"
        assert not (live & dead), "a label is both live and dead"
        assert present - live <= dead, "an unknown label is indexed"
        if snap.main is not None:
            assert snap.main.ntotal == len(snap.main_labels)
