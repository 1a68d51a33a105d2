"""Rules of the orchestrator's settings (services/orchestrator/config.py) that the mutation
audit found unguarded: the edges of their bounds, and the paths checked at start."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.orchestrator.config import OrchestratorConfig

ORCH = "TIERCACHE_ORCHESTRATOR_"


@pytest.mark.parametrize(("name", "taken", "refused"), [
    ("MIN_PREFIX_TOKENS", "1", "0"),  # 0 made every replica a prefix holder
    ("MAX_REQUEST_BYTES", "65536", "65535"),  # "must be in [65536, 2^31-1]"
    ("MAX_REQUEST_BYTES", str(2**31 - 1), str(2**31)),
    ("REPLICA_HUNG_POLLS", "100", "101"),  # "must be in 1..100"
    ("WARM_INTERVAL_S", "1", "0.5"),  # "must be <= 0 (off) or >= 1"
    # Sent in int32 / uint32 fields: one past failed every request / every warm-up.
    ("MAX_TOKENS_LIMIT", str(2**31 - 1), str(2**31)),
    ("WARM_PIN_TTL_MAX_S", str(2**32 - 1), str(2**32)),
    # max_streams = max_workers - 8: at 8 every Generate was refused.
    ("MAX_WORKERS", "9", "8"),
    # Must exceed max_workers (64): streams alone must never fill it.
    ("MAX_CONCURRENT_RPCS", "65", "64"),
])
def test_each_bound_is_taken_at_its_edge_and_refused_past_it(name, taken, refused):
    cfg = load_config(OrchestratorConfig, "orchestrator", [], environ={ORCH + name: taken})
    assert getattr(cfg, name.lower()) == float(taken)
    with pytest.raises(ConfigError, match=ORCH + name):
        load_config(OrchestratorConfig, "orchestrator", [], environ={ORCH + name: refused})


def test_the_longest_pin_may_equal_the_default_pin():
    """warm_pin_ttl_max_s must be >= warm_pin_ttl_s: equal is taken, less is refused."""
    env = {ORCH + "WARM_PIN_TTL_S": "600"}
    cfg = load_config(OrchestratorConfig, "orchestrator", [],
                      environ={**env, ORCH + "WARM_PIN_TTL_MAX_S": "600"})
    assert cfg.warm_pin_ttl_max_s == cfg.warm_pin_ttl_s == 600
    with pytest.raises(ConfigError, match=ORCH + "WARM_PIN_TTL_MAX_S"):
        load_config(OrchestratorConfig, "orchestrator", [],
                    environ={**env, ORCH + "WARM_PIN_TTL_MAX_S": "599"})


def test_a_cache_dir_not_made_yet_passes_the_start_check(tmp_path):
    """cache_dir is created when a model is first converted: one that does not exist yet is
    fine at start; only one that exists and is no directory is refused."""
    OrchestratorConfig(cache_dir=str(tmp_path / "not-yet" / "cache")).check_paths()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=ORCH + "CACHE_DIR"):
        OrchestratorConfig(cache_dir=str(tmp_path / "file")).check_paths()


def test_a_tokens_file_that_is_a_folder_is_refused_at_start(tmp_path):
    """tokens_file must be a readable file: a folder (a volume mounted at the file's path) is
    refused at start naming the setting, not found only when the tokens are read."""
    with pytest.raises(ConfigError, match=ORCH + "TOKENS_FILE.*is no readable file"):
        OrchestratorConfig(tokens_file=str(tmp_path)).check_paths()
    (tmp_path / "tokens.json").write_text("{}")
    OrchestratorConfig(tokens_file=str(tmp_path / "tokens.json")).check_paths()


def test_warm_min_hits_past_its_bound_is_refused_stating_the_bound():
    """"must be >= 1" was the refusal of 2^64 too: the line states the range."""
    with pytest.raises(ConfigError, match=r"^TIERCACHE_ORCHESTRATOR_WARM_MIN_HITS: .*2\^63"):
        load_config(OrchestratorConfig, "orchestrator", [],
                    {"TIERCACHE_ORCHESTRATOR_WARM_MIN_HITS": str(2**64)})
    cfg = load_config(OrchestratorConfig, "orchestrator", [],
                      {"TIERCACHE_ORCHESTRATOR_WARM_MIN_HITS": str(2**63)})
    assert cfg.warm_min_hits == 2**63


@pytest.mark.parametrize("bad", ["x" * 257, "a\0b", "\u3164", "m\x1b[2J\n", "llama\u200b"])
def test_a_model_id_the_replicas_and_the_index_would_refuse_is_refused_at_start(bad):
    """kvpool's model_id is at most 256 characters, without NUL, and visible, with no
    character that prints as nothing or as a space (the index's rules at Register and Match):
    the orchestrator took any, and then every Match it sent the index was refused (a
    257-character id) or hashed blocks no replica holds. Refused at start by the variable's
    name, as kvpool's; 256 characters are taken."""
    env = ORCH + "MODEL_ID"
    assert len(load_config(OrchestratorConfig, "orchestrator", [],
                           environ={env: "x" * 256}).model_id) == 256
    with pytest.raises(ConfigError, match=f"^{env}: "):
        load_config(OrchestratorConfig, "orchestrator", [], environ={env: bad})
