"""Rules of `services.common.hashing` that the mutation audit found unguarded: the cluster
hash key's length limit is a configuration error at start, not a failure later."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.common.hashing import BlockHasher, hash_key_from_env


def test_a_hash_key_of_more_than_64_bytes_is_a_config_error(monkeypatch):
    """BLAKE2b takes keys of at most 64 bytes: 64 is used as given, 65 is refused naming
    TIERCACHE_HASH_KEY (the start fails with exit 2, not a ValueError where a hasher is built)."""
    monkeypatch.setenv("TIERCACHE_HASH_KEY", "k" * 64)
    assert hash_key_from_env() == b"k" * 64
    assert len(BlockHasher("m", 4).probe()) == 16
    monkeypatch.setenv("TIERCACHE_HASH_KEY", "k" * 65)
    with pytest.raises(ConfigError, match="TIERCACHE_HASH_KEY: at most 64 bytes"):
        hash_key_from_env()
