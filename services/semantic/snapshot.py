"""Saved HNSW graphs, so that a restart does not rebuild them from SQLite.

Building a namespace's HNSW graph is nearly all of a semantic shard's start (~14 of 15 s at
30k entries on 2 cores; minutes at the hundreds of thousands a pod holds), and the shard
serves nothing meanwhile. On a clean stop the shard writes each HNSW namespace's published
main index here; the next start takes a saved graph for a namespace instead of building one
(`NamespaceIndex.adopt`), after checking it against SQLite, which stays the truth: every
saved row whose entry is still live must hold exactly that entry's vector, rows of entries
gone since are tombstoned, entries it lacks are added. A file that does not fit (another
database, another embedder or index settings, damaged, cut short) is ignored, with a warning,
and that namespace is built as before; so is every namespace when the folder or its manifest
is missing (a manifest missing beside graph files is warned of).

Layout of the folder (`snapshot_path`, default `<db_path>.hnsw`): one `<n>.faiss` per saved
namespace (faiss's own format) and `<n>.labels.npy`, and `manifest.json`, written last and
renamed into place: it names the embedder and index settings the graphs were built with and,
per namespace, its key and files. A save writes a new generation of files beside the old
ones for the graphs merged since the last save (the others keep theirs), then the manifest
(with each file's blake2b, checked before faiss reads it: a damaged file can make faiss
allocate what a garbled size says rather than raise), then removes the files saves wrote
that no manifest names and the temporary manifests of saves killed before their rename
(nothing else: the folder may be shared). A crash mid-save leaves the
old manifest (and its files) in force, or none. Saves also run every `snapshot_interval_s`
(600 s) while the shard serves, so a start after a kill -9 takes graphs at most that old,
caught up as above.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import faiss
import numpy as np

from services.common.files import file_digest, fsync_path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
# The files a save writes, named by generation and position: the only ones it ever removes.
_OURS = re.compile(r"([0-9a-f]+-[0-9]+)\.(?:faiss|labels\.npy)")
_TMP = re.compile(rf"\.{re.escape(MANIFEST)}\.[0-9]+\.tmp")  # a manifest being written


def _settings(params, embed_id: str) -> dict:
    return {"format": FORMAT, "embedder": embed_id, "dim": params.dim, "hnsw_m": params.hnsw_m,
            "hnsw_ef_construction": params.hnsw_ef_construction}


def unwritable(folder: str | os.PathLike) -> str:
    """Why a save into `folder` would fail for want of write access ("" = it would not): the
    folder, or where it does not exist yet the nearest folder above it (the save makes the
    rest), must take a new file. Probed by making one and removing it, as the save would
    (os.access says yes to root on a read-only sysfs); nothing is left behind, not even the
    folder. A read-only or foreign-owned volume was found only when a save failed, after
    snapshot_interval_s or at the stop, and every start then built its graphs anew."""
    path = Path(folder).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=path)
    except OSError as exc:
        return f"{path} is not writable ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(probe)
    return ""


def same_vectors(tag: str, ours: str) -> bool:
    """Whether vectors tagged `tag` are the ones embedder identity `ours` makes: by the
    weights part (after "@") where both carry one. By the whole tag, serving the same model
    under a new name (TIERCACHE_SEMANTIC_MODEL_NAME, a custom folder moved or renamed)
    re-embedded every entry before the service would serve: minutes at a full shard. A saved
    snapshot is matched by the same rule: its graphs were ignored under a new name and built
    again (a minute per 100k entries before the shard served); `adopt` still checks every
    saved vector."""
    if "@" in tag and "@" in ours:
        return tag.rpartition("@")[2] == ours.rpartition("@")[2]
    return tag == ours


Key = tuple[str, str, str]
SaveState = dict[Key, tuple[object, dict]]  # namespace -> (its graph's token, manifest entry)


def save(folder: str | os.PathLike, params, embed_id: str,
         items: Iterable[tuple[Key, faiss.Index, np.ndarray, object]],
         previous: SaveState | None = None) -> SaveState:
    """Writes `items` ((namespace key, HNSW main index, its labels, a token that changes when
    the graph does)) as the folder's new snapshot and returns what it holds, to pass back as
    `previous` to the next save into the same folder: a graph whose token is unchanged since
    then keeps its files (a periodic save rewrites only the graphs merged since), and a save
    with nothing changed since `previous` writes nothing (without `previous`, the manifest
    found is superseded even by an empty one). Raises OSError (disk full, no permission): the
    previous snapshot, if any, stays in force."""
    folder = Path(folder)
    items = list(items)
    had_manifest = (folder / MANIFEST).exists()
    if not items and not had_manifest:
        return {}  # nothing to save, nothing saved before to supersede
    # Without `previous` (a new process's first save), the manifest there is not known to
    # hold what `items` hold, even when both hold nothing: it is written.
    known = previous is not None and had_manifest
    # The files of the last save are kept only while its manifest is there to name them.
    previous = (previous or {}) if had_manifest else {}

    def kept(key: Key, token: object) -> dict | None:
        was = previous.get(key)
        if was is None or was[0] != token:
            return None
        stem = was[1]["stem"]
        ok = all((folder / f"{stem}{s}").exists() for s in (".faiss", ".labels.npy"))
        return was[1] if ok else None

    if (known and len(items) == len(previous)
            and all(kept(key, token) is not None for key, _, _, token in items)):
        return previous  # nothing merged since the last save
    # Owner only, as the database is: the vectors say much of the questions they embed.
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    gen = f"{time.time_ns():x}"
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    entries = []
    state: SaveState = {}
    t0 = time.monotonic()
    rows = written = 0
    try:
        for i, (key, main, labels, token) in enumerate(items):
            entry = kept(key, token)
            if entry is None:
                entry = _write_graph(folder, f"{gen}-{i}", key, main, labels)
                rows += len(labels)
                written += 1
            entries.append(entry)
            state[key] = (token, entry)
        _write_manifest(folder, tmp, dict(_settings(params, embed_id), namespaces=entries))
    except BaseException:
        # Disk full, say: the files of this save would stay until the next one. Only before
        # the rename: after it, they are the snapshot in force.
        for p in folder.iterdir():
            if (_OURS.fullmatch(p.name) and p.name.startswith(f"{gen}-")) or p == tmp:
                with contextlib.suppress(OSError):
                    p.unlink()
        raise
    try:
        fsync_path(str(folder))  # the rename, durable
    except OSError as e:
        log.warning("could not fsync %s after saving the HNSW graphs (%s): a power cut now may "
                    "leave the previous snapshot in force", folder, e)
    _remove_old_files(folder, keep={e["stem"] for e in entries})
    log.info("saved %d HNSW namespaces to %s in %.1f s (%d written, %d rows; %d unchanged)",
             len(entries), folder, time.monotonic() - t0, written, rows,
             len(entries) - written)
    return state


def _write_graph(folder: Path, stem: str, key: Key, main: faiss.Index,
                 labels: np.ndarray) -> dict:
    """`save`'s files of one namespace's graph, owner only and fsynced, named `stem`;
    returns its manifest entry."""
    faiss.write_index(main, str(folder / f"{stem}.faiss"))
    os.chmod(folder / f"{stem}.faiss", 0o600)
    fsync_path(folder / f"{stem}.faiss")
    with open(os.open(folder / f"{stem}.labels.npy",
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        np.save(f, np.ascontiguousarray(labels, np.int64))
        f.flush()
        os.fsync(f.fileno())
    return {"namespace": list(key), "stem": stem, "rows": int(len(labels)),
            "faiss_digest": file_digest(folder / f"{stem}.faiss"),
            "labels_digest": file_digest(folder / f"{stem}.labels.npy")}


def _write_manifest(folder: Path, tmp: Path, manifest: dict) -> None:
    """`save`'s manifest, written to `tmp`, fsynced, then renamed into place: the new
    snapshot is in force from the rename on."""
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def _remove_old_files(folder: Path, keep: set[str]) -> None:
    """After a save: the graph files of stems not in `keep` (the snapshot in force names
    them all) and temporary manifests go; a file that cannot be removed is a warning."""
    for p in folder.iterdir():
        # Only files a save writes: the folder may be shared (the database's own, say).
        # A temporary manifest left is a save's killed before its rename.
        m = _OURS.fullmatch(p.name)
        if (m and m.group(1) not in keep) or _TMP.fullmatch(p.name):
            try:
                p.unlink()
            except OSError as e:
                log.warning("could not remove an old snapshot file %s: %s", p, e)


class Saved:
    """A folder's snapshot, read lazily: `take(key)` reads one namespace's graph (or None)."""

    def __init__(self, folder: str | os.PathLike, params, embed_id: str) -> None:
        self.folder = Path(folder)
        self._entries: dict[tuple[str, str, str], dict] = {}
        path = self.folder / MANIFEST
        try:
            missing = not path.exists()
            # No folder, or one no save finished in: a first start, nothing to say. Graph files
            # without their manifest are a snapshot damaged (a manifest deleted, a copy that
            # left it out): every graph was built again without a word, as on a first start.
            graphs = (sorted(p.name for p in self.folder.iterdir() if _OURS.fullmatch(p.name))
                      if missing and self.folder.is_dir() else [])
        except OSError as e:
            # A folder the shard may not read (mode 000: the manifest's stat fails; 300: the
            # listing does) raised out of the start with a traceback; a snapshot is only a
            # speed-up, warned of and ignored as a manifest that cannot be read is.
            log.warning("ignoring the HNSW snapshot in %s (%s: %s); every namespace is built",
                        self.folder, type(e).__name__, e)
            return
        if missing:
            if graphs:
                log.warning("ignoring the HNSW snapshot in %s: %s is missing beside %d graph "
                            "files (%s, ...; deleted, or a first save killed before it wrote "
                            "it); every namespace is built from SQLite, and the next save "
                            "writes it again", self.folder, path, len(graphs), graphs[0])
            return
        try:
            manifest = json.loads(path.read_text())
            settings = {k: manifest[k] for k in _settings(params, embed_id)}
            entries = {}
            for e in manifest["namespaces"]:
                key = tuple(e["namespace"])
                if not (len(key) == 3 and all(isinstance(x, str) for x in key)
                        and isinstance(e["rows"], int) and _OURS.fullmatch(f"{e['stem']}.faiss")
                        and isinstance(e["faiss_digest"], str)
                        and isinstance(e["labels_digest"], str)):
                    raise ValueError(f"malformed namespace entry {e!r:.200}")
                entries[key] = e
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the HNSW snapshot in %s (%s: %s); every namespace is built",
                        self.folder, type(e).__name__, e)
            return
        ours = _settings(params, embed_id)
        saved_by = settings["embedder"]  # matched by its weights (same_vectors), not its name
        if ({**settings, "embedder": embed_id} != ours
                or not isinstance(saved_by, str) or not same_vectors(saved_by, embed_id)):
            log.warning("ignoring the HNSW snapshot in %s: built with other settings (%s, now "
                        "%s); every namespace is built", self.folder, settings, ours)
            return
        self._entries = entries

    def take(self, key: tuple[str, str, str]) -> tuple[faiss.Index, np.ndarray] | None:
        """The saved graph and labels of namespace `key`, or None (not saved, or unreadable:
        warned)."""
        e = self._entries.pop(tuple(key), None)
        if e is None:
            return None
        stem = self.folder / e["stem"]
        try:
            for suffix, key_ in ((".faiss", "faiss_digest"), (".labels.npy", "labels_digest")):
                if file_digest(Path(f"{stem}{suffix}")) != e[key_]:
                    raise ValueError(f"{stem.name}{suffix} is not the file the snapshot saved "
                                     "(damaged or replaced)")
            main = faiss.read_index(f"{stem}.faiss")
            labels = np.load(f"{stem}.labels.npy", allow_pickle=False)
        except (OSError, RuntimeError, ValueError) as err:
            log.warning("ignoring the saved HNSW graph of a namespace of tenant %r (%s: %s); it "
                        "is built", key[0], type(err).__name__, err)
            return None
        if labels.dtype != np.int64 or labels.ndim != 1 or len(labels) != e["rows"]:
            log.warning("ignoring the saved HNSW graph of a namespace of tenant %r: its labels "
                        "do not match the manifest; it is built", key[0])
            return None
        return main, labels
