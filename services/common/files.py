"""Small file-system helpers shared by the services' on-disk caches."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


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
    its owner's clean-up to recognise by `prefix`."""
    old = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    os.rename(target, old / "x")
    shutil.rmtree(old, ignore_errors=True)
