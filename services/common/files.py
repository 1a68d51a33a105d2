"""Small file-system helpers shared by the services' on-disk caches."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any


def hash_file(hasher: Any, path: str | os.PathLike) -> Any:
    """Feeds the bytes of the file at `path` to `hasher` (a hashlib object) in 1 MiB chunks,
    so a model file of gigabytes is never held whole; returns `hasher`."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            hasher.update(chunk)
    return hasher


def file_digest(path: str | os.PathLike) -> str:
    """The blake2b digest (16 bytes, hex) of the file at `path`: what a cache's completion
    record keeps of a small file, to notice it damaged in place."""
    return hash_file(hashlib.blake2b(digest_size=16), path).hexdigest()


def not_writable(exc: BaseException, writes: str, settings: str, where: str = "") -> str:
    """Why a start failed when a path the service writes is not writable, or its volume is
    full, as one line ("" when that is not `exc`'s cause): `writes` says what it writes there,
    `settings` where else it may be put, `where` the folder a full volume's error without a
    path is said of. A read-only volume read "bad configuration: ... [Errno 30]", though no
    setting was wrong and the fix is the volume's."""
    if not isinstance(exc, OSError):
        return ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and (exc.filename or exc.strerror):
        # A full volume (or a quota) is no setting either. Without a path, the message names
        # it (the ONNX export's does).
        path = exc.filename or where
        what = f"{path} cannot be written ({exc.strerror})" if path else exc.strerror
        said = "free space" in (exc.strerror or "")  # the lock file's own advice
        return what + ("" if said else ": free space on its volume or grow it, then start again")
    if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not exc.filename:
        return ""
    if (exc.errno != errno.EROFS and os.path.exists(exc.filename)
            and not os.access(exc.filename, os.R_OK)):
        # EACCES is also a file it may not read (a tokens file or weights owner-only for
        # another uid): "not writable ... mount the volume read-write" named the wrong fault.
        return ""
    return (f"{exc.filename} is not writable ({exc.strerror}): the service writes {writes}; "
            f"mount the volume read-write or make it writable by uid {os.geteuid()}, or point "
            f"{settings} at a writable folder")


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder by path (a folder: the renames and creations in it, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_aside(target: Path, prefix: str) -> None:
    """Deletes the folder `target` after renaming it into a fresh folder beside it named
    `prefix` + 8 random characters: a process still reading it never sees it half deleted,
    and `target` is gone in one step. A crash while deleting leaves that folder behind, for
    its owner's clean-up to recognise by `prefix`. A rename that fails (no `target`) raises
    and leaves nothing behind."""
    old = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        os.rename(target, old / "x")
    except OSError:
        os.rmdir(old)  # still empty: a failed call leaves no folder for a clean-up to find
        raise
    shutil.rmtree(old, ignore_errors=True)


def current_umask() -> int:
    """The process's umask, read from /proc/self/status where Linux shows it (4.7+). Reading it
    otherwise means setting it: `os.umask` returns the old one only by setting a new one, and a
    file another thread creates before it is set back gets that one instead (no mask at all)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    umask = os.umask(0o077)  # no /proc: the short window gets the strictest usual mask
    os.umask(umask)
    return umask


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Replaces `path` with `text` in one step: written to a temporary file beside it, fsynced,
    then renamed over it. Written in place, an interrupted write (or a power loss) left a file
    cut short (the verifier's weights: every semantic shard then refused to start). Keeps the
    mode of the file it replaces (a new one gets the umask's), as writing in place did. A
    symbolic link at `path` is replaced by the file (its target is left as it was; whoever
    reads `path` reads the new text), where writing in place wrote through it."""
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~current_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(folder)  # the rename itself, durable
