"""Rules of `services.common.files` that the mutation audit found unguarded: the digest a
cache's completion record keeps is blake2b-128 of the whole file (records written by another
version must still compare equal)."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from services.common import files
from services.common.files import file_digest, remove_aside


def test_the_file_digest_is_blake2b_128_of_the_whole_file(tmp_path):
    """16 bytes, hex, over every chunk: two files that differ only past the first MiB differ."""
    data = bytes(range(256)) * (5 * 4096 + 3)  # 5 MiB and a bit: several 1 MiB chunks
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(data[:-1] + b"\x00")
    want = hashlib.blake2b(data, digest_size=16).hexdigest()
    assert file_digest(tmp_path / "a") == want and len(want) == 32
    assert file_digest(str(tmp_path / "b")) != want


def test_remove_aside_of_a_missing_folder_leaves_nothing_behind(tmp_path):
    """The fresh `<prefix>XXXXXXXX` folder was made before the rename: a target that was not
    there raised FileNotFoundError but left that empty folder beside it, for a clean-up to
    find (the docstring allows a leftover only for a crash while deleting)."""
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError):
        remove_aside(tmp_path / "gone", ".gone.old-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "f").write_text("x")
    remove_aside(tmp_path / "here", ".here.old-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_only_a_path_it_may_not_write_is_named_not_writable():
    """A read-only volume (EROFS), another uid's folder (EACCES, EPERM) with the path: one
    line naming it, the cause and the settings; a full one (ENOSPC) says to free space (a
    full volume at start read "bad configuration"). Any other error, or one without a path:
    ""."""
    from services.common.files import not_writable

    line = not_writable(OSError(30, "Read-only file system", "/v/x"), "its data", "TIERCACHE_A")
    assert line.startswith("/v/x is not writable (Read-only file system): the service writes "
                           "its data; mount the volume read-write") and "TIERCACHE_A" in line
    assert not_writable(PermissionError(13, "Permission denied", "/v"), "d", "S")
    assert not_writable(OSError(28, "No space left on device", "/v"), "d", "S") == (
        "/v cannot be written (No space left on device): free space on its volume or grow it, "
        "then start again")
    assert not not_writable(OSError(2, "No such file or directory", "/v"), "d", "S")
    assert not_writable(OSError(28, "No space left on device"), "d", "S", "/cache").startswith(
        "/cache cannot be written (No space left on device): free space")
    assert not_writable(OSError(28, "writing x into /v: No space left on device (S)"), "d", "S"
                        ) == ("writing x into /v: No space left on device (S): free space on its "
                              "volume or grow it, then start again")
    assert not not_writable(OSError(30, "Read-only file system"), "d", "S")
    assert not not_writable(ValueError("/v"), "d", "S")


def test_a_path_it_cannot_read_is_not_said_not_writable(tmp_path, monkeypatch):
    """EACCES is also what reading a file the service may not read raises (a tokens file or
    weights mounted owner-only for another uid): that start said "<tokens file> is not
    writable ...: the service writes the packaged model's conversion ...; mount the volume
    read-write", the wrong fault and fix. Only a path it may read, or one not there yet (a file
    it was creating), is named not writable."""
    import os

    from services.common.files import not_writable

    secret = tmp_path / "tokens.json"
    secret.write_text("{}")
    real = os.access
    # As root every file is readable: the mode a pod's non-root uid meets, said by access().
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(secret)
                        and mode == os.R_OK else real(p, mode, **kw))
    assert not_writable(PermissionError(13, "Permission denied", str(secret)), "d", "S") == ""
    assert not_writable(PermissionError(1, "Operation not permitted", str(secret)), "d", "S") == ""
    # A file it was creating (not there), or one it may read but not write: not writable.
    assert not_writable(PermissionError(13, "Permission denied", str(tmp_path / "new.lock")),
                        "d", "S").startswith(f"{tmp_path / 'new.lock'} is not writable")
    (tmp_path / "lock").write_text("")
    assert not_writable(PermissionError(13, "Permission denied", str(tmp_path / "lock")),
                        "d", "S").startswith(f"{tmp_path / 'lock'} is not writable")
    # A read-only volume is about writing, whatever the mode.
    assert not_writable(OSError(30, "Read-only file system", str(secret)), "d", "S")


BUILDS = [("kvpool", "build_replica"), ("orchestrator", "build")]


def _failed_start(service: str, build: str, error: OSError, monkeypatch, caplog,
                  cache_dir: str = "") -> str:
    """The line `python -m services.<service>` ends with when its `build` raises `error` (exit
    2, the server stopped)."""
    import importlib
    import logging
    import types

    from services.kvpool.config import KvPoolConfig
    from services.orchestrator.config import OrchestratorConfig

    entry = importlib.import_module(f"services.{service}.__main__")
    cfg = (KvPoolConfig(metrics_port=-1, cache_dir=cache_dir) if service == "kvpool" else
           OrchestratorConfig(kvpool_addresses=("127.0.0.1:1",), metrics_port=-1,
                              cache_dir=cache_dir))
    stopped: list = []
    handle = types.SimpleNamespace(draining=None, stop=lambda grace: stopped.append(grace))
    monkeypatch.setattr(entry, "create_server", lambda **kw: handle)

    def refuse(cfg):
        raise error
    monkeypatch.setattr(entry, build, refuse)
    monkeypatch.setattr(entry, "load_service_config", lambda *a: cfg)  # logging as it is
    with caplog.at_level(logging.ERROR, logger=f"services.{service}"):
        assert entry._main([]) == 2
    assert stopped == [None]
    return caplog.records[-1].getMessage()


@pytest.mark.parametrize(("service", "build"), BUILDS)
def test_a_cache_folder_the_start_cannot_write_says_so_not_bad_configuration(
        service, build, monkeypatch, caplog):
    """The packaged model to convert into a read-only cache volume stopped the start with "bad
    configuration ...: [Errno 30] Read-only file system: ...", though no setting was wrong:
    the line names the path, the cause, the fix and the service's setting (exit 2, the
    server stopped)."""
    line = _failed_start(service, build, OSError(30, "Read-only file system", "/cache/models"),
                         monkeypatch, caplog)
    assert line.startswith("cannot start: /cache/models is not writable (Read-only file "
                           "system)"), line
    assert "bad configuration" not in line
    assert f"TIERCACHE_{service.upper()}_CACHE_DIR" in line


@pytest.mark.parametrize(("service", "build"), BUILDS)
def test_a_full_cache_volume_names_the_conversions_folder(service, build, tmp_path,
                                                          monkeypatch, caplog):
    """A write to a full volume fails without a path (ENOSPC from a write of an open file):
    kvpool's line named the conversion's folder, the orchestrator's only "cannot start: No
    space left on device" (its copy of the call left the folder out)."""
    line = _failed_start(service, build, OSError(28, "No space left on device"), monkeypatch,
                         caplog, cache_dir=str(tmp_path))
    assert line == (f"cannot start: {tmp_path}/models/SmolLM2-135M-Instruct cannot be written "
                    "(No space left on device): free space on its volume or grow it, then "
                    "start again"), line


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_new_file_reads_the_umask_without_setting_it(tmp_path, monkeypatch, umask):
    """replace_text's new file gets 0666 less the umask, read from /proc/self/status: reading it
    with os.umask set it for a moment, and a file another thread created then got no mask."""
    old = os.umask(umask)
    try:
        assert files.current_umask() == umask

        def no_set(mask):
            raise AssertionError(f"os.umask({mask:o}) called: the umask was set to read it")

        monkeypatch.setattr(files.os, "umask", no_set)
        files.replace_text(tmp_path / "new.txt", "text")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o666 & ~umask


def test_without_proc_the_umask_is_read_by_setting_it_back(tmp_path, monkeypatch):
    """Where /proc/self/status cannot be read, the umask is read through os.umask and put back
    as it was."""
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_proc)
    old = os.umask(0o027)
    try:
        assert files.current_umask() == 0o027
        assert os.umask(0o027) == 0o027  # set back as it was
    finally:
        os.umask(old)
