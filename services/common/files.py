"""Small file-system helpers shared by the services' on-disk caches."""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder by path (a folder: the renames and creations in it, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
