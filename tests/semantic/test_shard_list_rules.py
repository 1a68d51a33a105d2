"""Rules of `services/semantic/shard_list.py` a mutation audit found unchecked: a call is
compared with the lists seen within the window counted from each list's *last* call, the
mismatch it reports names the latest list that differs, and a call without a list is not
checked whatever lists were seen."""

from __future__ import annotations

from services.semantic.shard_list import WINDOW_SECONDS, RecentShardLists
from tests.clock import Clock


def test_a_list_seen_again_is_remembered_from_its_last_call():
    """aaaa at 0, bbbb at 100, aaaa again at 200: at 450 bbbb was last seen 350 s before (past
    the window) and aaaa 250 s before, so a call with aaaa agrees."""
    clock = Clock()
    c = RecentShardLists(clock)
    start = clock.t
    assert c.check(2, "aaaa", "Store")
    clock.t = start + 100
    assert not c.check(3, "bbbb", "Lookup")
    clock.t = start + 200
    assert not c.check(2, "aaaa", "Store")  # bbbb is recent
    clock.t = start + 200 + WINDOW_SECONDS - 50
    assert c.check(2, "aaaa", "Lookup")
    assert c.mismatches_total == 2


def test_the_mismatch_names_the_latest_list_that_differs():
    clock = Clock()
    c = RecentShardLists(clock)
    assert c.check(2, "aaaa", "Store", "ipv4:10.0.0.1:1")
    clock.t += 10
    assert not c.check(3, "bbbb", "Store", "ipv4:10.0.0.2:2")
    clock.t += 10
    assert not c.check(4, "cccc", "Lookup", "ipv4:10.0.0.3:3")
    assert "a call came with 3 shards (bbbb) from ipv4:10.0.0.2:2, a Lookup with 4 shards " \
           "(cccc) from ipv4:10.0.0.3:3" in c.note()


def test_a_call_without_a_list_is_not_checked_beside_a_list_of_several_shards():
    """An older orchestrator says no list (fingerprint ""): not a mismatch, not counted, and
    not remembered as a list the next call could differ from."""
    c = RecentShardLists(Clock())
    assert c.check(2, "aaaa", "Store")
    assert c.check(0, "", "Lookup") and c.check(3, "", "Store")
    assert c.check(2, "aaaa", "Lookup")
    assert c.mismatches_total == 0 and c.note() == ""
