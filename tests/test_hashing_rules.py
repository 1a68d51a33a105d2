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


def test_a_pure_python_switch_that_is_no_boolean_refuses_the_start(monkeypatch):
    """TIERCACHE_PURE_PYTHON_HASH=enable kept the C hasher without a word: refused at start,
    naming the variable (exit 2), as the services' own booleans are."""
    from services.common.bootstrap import load_service_config
    from services.common.hashing import pure_python_from_env
    from services.prefix.config import PrefixConfig

    for value, pure in (("", False), ("off", False), ("0", False), (" On ", True), ("1", True)):
        monkeypatch.setenv("TIERCACHE_PURE_PYTHON_HASH", value)
        assert pure_python_from_env() is pure, value
    monkeypatch.setenv("TIERCACHE_PURE_PYTHON_HASH", "enable")
    with pytest.raises(ConfigError, match="TIERCACHE_PURE_PYTHON_HASH: expected true/false, "
                                          "got 'enable'"):
        pure_python_from_env()
    assert load_service_config(PrefixConfig, "prefix", []) is None
    monkeypatch.setenv("TIERCACHE_PURE_PYTHON_HASH", "off")
    assert load_service_config(PrefixConfig, "prefix", []) is not None


def test_a_service_says_once_when_hashes_come_from_hashlib(monkeypatch, caplog):
    """Nothing at run time said that the C hasher was missing (only a slower service): a
    WARNING when it was not built, INFO when TIERCACHE_PURE_PYTHON_HASH asked for hashlib,
    each once per process; nothing when the C hasher is used. The prefix index says it as
    it is built (kvpool and the orchestrator where they build their hasher)."""
    from services.common import hashing
    from services.prefix.config import PrefixConfig
    from services.prefix.server import build_index

    def said() -> list[tuple[str, str]]:
        return [(r.levelname, r.getMessage()) for r in caplog.records
                if r.name == "services.common.hashing"]

    with caplog.at_level("INFO", logger="services.common.hashing"):
        for built, used, level, words in ((False, None, "WARNING", "is not built"),
                                          (True, None, "INFO", "TIERCACHE_PURE_PYTHON_HASH")):
            monkeypatch.setattr(hashing, "_built", built)
            monkeypatch.setattr(hashing, "_blockhash", used)
            monkeypatch.setattr(hashing, "_said", False)
            caplog.clear()
            build_index(PrefixConfig())
            build_index(PrefixConfig())
            assert [lv for lv, _ in said()] == [level] and words in said()[0][1], said()
        monkeypatch.setattr(hashing, "_blockhash", object())
        monkeypatch.setattr(hashing, "_said", False)
        caplog.clear()
        hashing.say_which_hasher()
        assert said() == []


def test_only_salt_sized_roots_are_cached():
    """`root` keeps salts of up to 128 characters: a caller's long string is hashed each time
    instead of staying resident (same value either way)."""
    hasher = BlockHasher("m", 4, key=b"k")
    long_root = hasher.root("s" * 129)
    assert hasher._roots == {}
    assert hasher.root("s" * 129) == long_root
    hasher.root("s" * 128)
    assert list(hasher._roots) == ["s" * 128]


@pytest.mark.parametrize("native", [True, False])
def test_the_hash_memo_stays_within_two_generations(native):
    """The span memo drops its older generation once the young one holds `memo_blocks`
    blocks: distinct prompts never grow it past about two generations, and the hashes stay
    those of a hasher without a memo."""
    from services.common.hashing import SPAN_BLOCKS

    memo = 2 * SPAN_BLOCKS
    hasher = BlockHasher("m", 4, key=b"k", memo_blocks=memo, native=native)
    plain = BlockHasher("m", 4, key=b"k", memo_blocks=0, native=native)
    for i in range(50):
        toks = [i] + list(range(4 * SPAN_BLOCKS - 1))  # one full span each
        assert hasher.hashes(toks) == plain.hashes(toks)
        held = (len(hasher._young) + len(hasher._old)) * SPAN_BLOCKS
        assert held <= 2 * memo
