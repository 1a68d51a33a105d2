"""Rules of a prefix shard's shard-list check (services/prefix/shard_list.py) that the
mutation audit found unguarded: how many replicas' lists it remembers, and which it drops."""

from __future__ import annotations

from services.prefix.shard_list import MAX_REMEMBERED, ShardListCheck
from tests.clock import Clock


def test_the_latest_4096_replicas_lists_are_remembered_the_oldest_dropped_first():
    """Up to MAX_REMEMBERED (4,096) replicas' lists are kept; one more drops the replica that
    registered first, whose list then no longer counts for a Match naming nobody."""
    assert MAX_REMEMBERED == 4096
    c = ShardListCheck(Clock())
    for i in range(MAX_REMEMBERED):
        c.registered(f"r{i}", 2, f"fp{i}")
    assert c.check(2, "fp0", [])  # the first one's list still agrees
    c.registered("r-new", 2, "fp-new")
    assert not c.check(2, "fp0", [])  # r0 was dropped: nobody here has fp0 now
    assert c.check(2, "fp1", []) and c.check(2, "fp-new", [])
