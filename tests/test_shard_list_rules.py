"""Rules of `services.common.shard_list` (how a shard reports shard lists that differ) that
the mutation audit found unguarded: the warning is written at most once a minute."""

from __future__ import annotations

import logging

from services.prefix.shard_list import ShardListCheck
from tests.clock import Clock


def test_a_mismatch_warns_at_most_once_a_minute(caplog):
    """A misconfigured caller mismatches on every call: one warning, then none until a minute
    after it (each mismatch is still counted)."""
    clock = Clock()
    c = ShardListCheck(clock)
    c.registered("r0", 2, "aaaa")
    caplog.set_level(logging.WARNING, "services.prefix.shard_list")
    assert not c.check(3, "bbbb", ["r0"])
    for _ in range(5):
        clock.t += 11  # 55 s after the warning in all
        assert not c.check(3, "bbbb", ["r0"])
    assert len(caplog.records) == 1
    clock.t += 5
    assert not c.check(3, "bbbb", ["r0"])
    assert len(caplog.records) == 2 and c.mismatches_total == 7
