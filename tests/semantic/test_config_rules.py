"""Rules of `services/semantic/config.py` a mutation audit found unchecked: each range its
message states holds at both edges (the edge accepted, the next value refused by the
variable's name), the largest entry's formula, a file where the snapshot folder must be, the
ONNX cache folder name, and the snapshot path's default."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.semantic.config import SemanticConfig


def load(**env: str) -> SemanticConfig:
    return load_config(SemanticConfig, "semantic", [],
                       {f"TIERCACHE_SEMANTIC_{k.upper()}": v for k, v in env.items()})


@pytest.mark.parametrize("env", [
    {"onnx_threads": "1024"},  # "must be in [0, 1024]"
    {"max_batch": "1"},  # [1, 1024]
    {"batch_wait_ms": "100"},  # [0, 100]
    {"sqlite_synchronous": "EXTRA"},  # FULL, NORMAL or EXTRA
    {"hnsw_m": "4"},  # [4, 128]
    {"hnsw_ef_search": "8"},  # [8, 32768]
    {"hnsw_ef_construction": "8"},
    {"faiss_threads": "1"},  # [1, 1024]
    {"delta_capacity": "1"},  # >= 1
    # Each tier in [threshold_floor, 1]; relaxed <= standard <= strict, equal allowed.
    {"tier_relaxed": "0.85"},
    {"tier_relaxed": "0.95"},
    {"tier_standard": "0.97"},
    {"grace_seconds": "0"},  # >= 0
    {"index_close_seconds": "0"},
    {"max_tenant_chars": "64"},  # >= 64
    {"verified_bonus": "0.19"},  # [0, 0.2)
    {"default_ttl_seconds": "0"},  # 0 = never expire
    {"max_ttl_seconds": str(2**32 - 1), "default_ttl_seconds": "3600"},  # a uint32
    {"expiry_interval_s": "0.1"},  # >= 0.1
    # 4 x 8192 + 24 x 694954 + 64 KiB: the largest that fits 16 MiB.
    {"max_answer_chars": "694954"},
])
def test_a_value_at_the_edge_of_its_range_is_accepted(env):
    cfg = load(**env)
    for k, v in env.items():
        assert str(getattr(cfg, k)) in (v, str(float(v)) if v[0].isdigit() else v)


@pytest.mark.parametrize(("env", "var"), [
    ({"onnx_threads": "1025"}, "ONNX_THREADS"),
    ({"max_batch": "0"}, "MAX_BATCH"),
    ({"batch_wait_ms": "100.5"}, "BATCH_WAIT_MS"),
    ({"hnsw_m": "3"}, "HNSW_M"),
    ({"hnsw_ef_search": "7"}, "HNSW_EF_SEARCH"),
    ({"faiss_threads": "0"}, "FAISS_THREADS"),
    ({"delta_capacity": "0"}, "DELTA_CAPACITY"),
    ({"max_tenant_chars": "63"}, "MAX_TENANT_CHARS"),
    ({"threshold_floor": "0"}, r"THRESHOLD_FLOOR: must be in \(0, 1\]"),
    ({"verified_bonus": "0.2"}, "VERIFIED_BONUS"),
    ({"max_ttl_seconds": str(2**32)}, "MAX_TTL_SECONDS.*uint32"),
    ({"expiry_interval_s": "0.09"}, "EXPIRY_INTERVAL_S"),
    ({"max_answer_chars": "694955"}, "MAX_ANSWER_CHARS.*16777216-byte"),
    # A verifier tier must be guarded: the default guard tiers leave relaxed out.
    ({"verifier_tiers": "relaxed"}, "VERIFIER_TIERS"),
])
def test_a_value_past_the_edge_of_its_range_is_refused_by_name(env, var):
    with pytest.raises(ConfigError, match=f"^TIERCACHE_SEMANTIC_{var}"):
        load(**env)


def test_a_verifier_path_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="^TIERCACHE_SEMANTIC_VERIFIER_PATH: no such file"):
        load(verifier_path=str(tmp_path))


def test_a_file_where_the_snapshot_folder_must_be_is_named_at_start(tmp_path):
    """The snapshot path is a folder of graph files: a file in its way is named with its
    variable at start."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"^TIERCACHE_SEMANTIC_SNAPSHOT_PATH: .*afile is a file"):
        load(snapshot_path=str(tmp_path / "afile" / "graphs"), db_path=str(tmp_path / "s.db"))


@pytest.mark.parametrize("name", [".", "..", "a\\b", "a/b", "tab\there", "line\nbreak"])
def test_a_model_name_must_be_a_plain_folder_name(name):
    """The model name is a folder under <cache_dir>/onnx: "." (the folder itself), a slash of
    either kind, or a control character is refused."""
    with pytest.raises(ConfigError, match="^TIERCACHE_SEMANTIC_MODEL_NAME"):
        load(model_name=name)


@pytest.mark.parametrize("name", ["\u3164", "\u034f", "\ufe0f\u3164"])
def test_a_model_name_of_only_invisible_characters_is_refused_naming_the_variable(name):
    """The Hangul filler and the combining grapheme joiner pass isprintable(): the entries'
    model tag and the ONNX folder got a name nobody can see or type (replica_id and model_id
    of kvpool are refused so, errors.blank). Refused by the variable's name."""
    with pytest.raises(ConfigError, match="^TIERCACHE_SEMANTIC_MODEL_NAME: .*invisible"):
        load(model_name=name)


def test_the_snapshot_path_defaults_to_the_database_path_with_hnsw(tmp_path):
    """"" = <db_path>.hnsw (docs/settings.md)."""
    db = str(tmp_path / "x" / "s.db")
    assert SemanticConfig(db_path=db).resolved_snapshot_path() == db + ".hnsw"
    assert SemanticConfig(db_path=db, snapshot_path=str(tmp_path / "g")
                          ).resolved_snapshot_path() == str(tmp_path / "g")


@pytest.mark.parametrize(("argv", "env", "named"), [
    ([], {"guard_tiers": "strict"}, "TIERCACHE_SEMANTIC_GUARD_TIERS:"),
    (["--guard-tiers", "standard"], {}, "--guard-tiers (env TIERCACHE_SEMANTIC_GUARD_TIERS):"),
    ([], {"guard_tiers": ""}, "TIERCACHE_SEMANTIC_GUARD_TIERS:"),
    ([], {"verifier_tiers": "relaxed"}, "TIERCACHE_SEMANTIC_VERIFIER_TIERS:"),
])
def test_a_verifier_tier_left_unguarded_is_blamed_on_the_setting_moved(argv, env, named):
    """Guard tiers narrowed alone leave a default verifier tier unguarded: the refusal names
    guard_tiers, which the user set (it named verifier_tiers, which the user never set), and
    both settings in its line."""
    with pytest.raises(ConfigError) as e:
        load_config(SemanticConfig, "semantic", argv,
                    {f"TIERCACHE_SEMANTIC_{k.upper()}": v for k, v in env.items()})
    msg = str(e.value)
    assert msg.startswith(named) and "verifier_tiers" in msg and "guard_tiers" in msg


def test_a_verifier_path_under_the_home_folder_is_expanded(tmp_path, monkeypatch):
    """"~/verifier.json" is the file in $HOME, as for every other path setting (it was refused
    as no such file, and would have been opened as a folder named "~")."""
    (tmp_path / "verifier.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load(verifier_path="~/verifier.json")
    assert cfg.resolved_verifier_path() == str(tmp_path / "verifier.json")
    with pytest.raises(ConfigError, match="no such file: '~/absent.json'"):
        load(verifier_path="~/absent.json")


def test_a_shared_cache_dir_that_is_a_file_is_blamed_on_the_shared_setting(tmp_path,
                                                                           monkeypatch):
    """TIERCACHE_CACHE_DIR naming a file: the refusal names it, not the service's own
    cache_dir, which was never set; the service's own, set, is named itself."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"^TIERCACHE_CACHE_DIR: .*file is a file"):
        load()
    with pytest.raises(ConfigError, match=r"^TIERCACHE_SEMANTIC_CACHE_DIR: .*file is a file"):
        load(cache_dir=str(tmp_path / "file"))


def test_a_file_where_a_default_path_puts_a_folder_is_blamed_on_the_setting_it_came_from(
        tmp_path, monkeypatch):
    """Only the cache dir set, and <cache_dir>/semantic a file: the refusal named
    TIERCACHE_SEMANTIC_DB_PATH, which the operator never set; it names the setting the path
    came from (the service's cache_dir, or the shared TIERCACHE_CACHE_DIR), and db_path or
    snapshot_path only when they are set themselves."""
    (tmp_path / "semantic").write_text("")
    monkeypatch.delenv("TIERCACHE_CACHE_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"^TIERCACHE_SEMANTIC_CACHE_DIR: .*semantic is a file"):
        load(cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^--cache-dir \(env TIERCACHE_SEMANTIC_CACHE_DIR\):"):
        load_config(SemanticConfig, "semantic", ["--cache-dir", str(tmp_path)], {})
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^TIERCACHE_CACHE_DIR: .*semantic is a file"):
        load()
    with pytest.raises(ConfigError, match=r"^TIERCACHE_SEMANTIC_DB_PATH: .*semantic is a file"):
        load(db_path=str(tmp_path / "semantic" / "x.db"))
    # The snapshot folder defaults to <db_path>.hnsw: a file there is the db_path's doing.
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "s.db.hnsw").write_text("")
    with pytest.raises(ConfigError, match=r"^TIERCACHE_SEMANTIC_DB_PATH: .*hnsw is a file"):
        load(db_path=str(tmp_path / "db" / "s.db"))
    with pytest.raises(ConfigError, match=r"^TIERCACHE_SEMANTIC_SNAPSHOT_PATH: .*hnsw is a"):
        load(db_path=str(tmp_path / "db" / "s.db"),
             snapshot_path=str(tmp_path / "db" / "s.db.hnsw"))


def test_empty_guard_and_verifier_tiers_are_none_and_only_commas_is_refused():
    """docs/settings.md: "" = none. "," read as none too, until the list rule refused a
    setting of only commas (a list whose entries were lost turned the guard off unsaid)."""
    env = {"TIERCACHE_SEMANTIC_GUARD_TIERS": "", "TIERCACHE_SEMANTIC_VERIFIER_TIERS": ""}
    cfg = load_config(SemanticConfig, "semantic", [], env)
    assert (cfg.guard_tiers, cfg.verifier_tiers) == ((), ())
    with pytest.raises(ConfigError, match="GUARD_TIERS: only commas, no entry"):
        load_config(SemanticConfig, "semantic", [], {**env, "TIERCACHE_SEMANTIC_GUARD_TIERS": ","})
