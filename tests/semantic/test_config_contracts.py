"""The semantic tier's draft floor may not exceed its threshold floor (config validation)."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.semantic.config import SemanticConfig


def load(**env: str) -> SemanticConfig:
    return load_config(SemanticConfig, "semantic", [],
                       {f"TIERCACHE_SEMANTIC_{k.upper()}": v for k, v in env.items()})


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
