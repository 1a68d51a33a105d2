"""The semantic tier's draft floor may not exceed its threshold floor (config validation)."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.semantic.config import SemanticConfig
from tests.semantic.test_config_rules import load


def test_a_draft_floor_above_the_threshold_floor_is_refused_by_name():
    floor = SemanticConfig().threshold_floor
    with pytest.raises(ConfigError, match="TIERCACHE_SEMANTIC_DRAFT_FLOOR"):
        load(draft_floor=str(floor + 0.05))
    with pytest.raises(ConfigError, match="TIERCACHE_SEMANTIC_DRAFT_FLOOR"):
        load(threshold_floor="0.88", tier_relaxed="0.9", draft_floor="0.89")


def test_a_draft_floor_up_to_the_threshold_floor_is_accepted():
    floor = SemanticConfig().threshold_floor
    assert load(draft_floor=str(floor)).draft_floor == floor
    assert load(threshold_floor="0.88", tier_relaxed="0.9", draft_floor="0.88").draft_floor == 0.88
    assert load(draft_floor="0.5").draft_floor == 0.5


@pytest.mark.parametrize("bad", ["0", "-0.1"])
def test_a_draft_floor_of_zero_or_less_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match="TIERCACHE_SEMANTIC_DRAFT_FLOOR"):
        load(draft_floor=bad)


@pytest.mark.parametrize("env, var", [
    # The housekeeper saved ~8,000 times a second under the lock every lookup takes.
    ({"snapshot_interval_s": "1e-9"}, "SNAPSHOT_INTERVAL_S"),
    ({"snapshot_interval_s": "0.5"}, "SNAPSHOT_INTERVAL_S"),
    # Entries past the 16 MiB gRPC message were stored, then every hit on them failed.
    ({"max_answer_chars": "20000000"}, "MAX_ANSWER_CHARS"),
    # The setting moved is named (max_answer_chars, left at its default, was blamed).
    ({"max_text_chars": "4000000"}, "MAX_TEXT_CHARS"),
])
def test_values_that_would_fail_at_run_time_are_refused_at_start(env, var):
    with pytest.raises(ConfigError, match=f"TIERCACHE_SEMANTIC_{var}"):
        load(**env)


def test_the_largest_entry_allowed_fits_in_one_message():
    assert load(snapshot_interval_s="0").snapshot_interval_s == 0
    assert load(snapshot_interval_s="1").snapshot_interval_s == 1
    assert load(max_answer_chars="600000").max_answer_chars == 600000
