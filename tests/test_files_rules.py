"""Rules of `services.common.files` that the mutation audit found unguarded: the digest a
cache's completion record keeps is blake2b-128 of the whole file (records written by another
version must still compare equal)."""

from __future__ import annotations

import hashlib

from services.common.files import file_digest


def test_the_file_digest_is_blake2b_128_of_the_whole_file(tmp_path):
    """16 bytes, hex, over every chunk: two files that differ only past the first MiB differ."""
    data = bytes(range(256)) * (5 * 4096 + 3)  # 5 MiB and a bit: several 1 MiB chunks
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(data[:-1] + b"\x00")
    want = hashlib.blake2b(data, digest_size=16).hexdigest()
    assert file_digest(tmp_path / "a") == want and len(want) == 32
    assert file_digest(str(tmp_path / "b")) != want
