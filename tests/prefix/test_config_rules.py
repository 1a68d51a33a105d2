"""Bounds of the prefix index's settings (services/prefix/config.py) that the mutation audit
found unguarded: each edge that its message says is taken is taken, and the value past it is
refused naming the variable."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.prefix.config import PrefixConfig

P = "TIERCACHE_PREFIX_"


@pytest.mark.parametrize(("name", "taken", "refused"), [
    ("BLOCK_SIZE", "1024", "1025"),  # "must be in 1..1024"
    ("LEASE_SECONDS", "0.1", "0.09"),  # "must be >= 0.1"
    ("MAX_NODES", "1", "0"),  # "must be in 1..2^64-1"
    ("MAX_EVENTS", str(2**32 - 1), str(2**32)),  # "must be in 1..2^32-1"
    ("MAX_BLOCKS", str(2**32 - 1), str(2**32)),
    ("METRICS_PORT", "-1", "-2"),  # "-1 (off), 0 or a port"
])
def test_each_bound_is_taken_at_its_edge_and_refused_past_it(name, taken, refused):
    cfg = load_config(PrefixConfig, "prefix", [], environ={P + name: taken})
    assert str(getattr(cfg, name.lower())) == taken
    with pytest.raises(ConfigError, match=P + name):
        load_config(PrefixConfig, "prefix", [], environ={P + name: refused})


def test_a_hit_half_life_is_off_or_at_least_a_lease():
    """hit_half_life_seconds: 0 (off) or >= lease_seconds (a halving drops the pruning run
    under way; one every sweep would never let a run finish); refused naming the setting set."""
    env = {P + "LEASE_SECONDS": "10"}
    for ok in ("0", "10", "3600"):
        load_config(PrefixConfig, "prefix", [], environ={**env, P + "HIT_HALF_LIFE_SECONDS": ok})
    with pytest.raises(ConfigError, match=P + "HIT_HALF_LIFE_SECONDS.*at least lease_seconds"):
        load_config(PrefixConfig, "prefix", [], environ={**env, P + "HIT_HALF_LIFE_SECONDS": "9.5"})
