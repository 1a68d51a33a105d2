"""Rules of `services.common.ring` that the differential review (test_ring_differential.py)
found broken, each pinned deterministically."""

from __future__ import annotations

from services.common.ring import HashRing


def test_a_node_named_empty_string_is_the_fallback_when_prefer_holds_no_qualifying_node():
    """With `prefer` and no preferred node qualifying, the first qualifying node clockwise is
    taken, even one named "" (the fallback was kept with `or`, so "" lost to the next)."""
    ring = HashRing(["", "a", "b"], vnodes=8)
    keys = [f"k{i}" for i in range(200) if ring.preference(f"k{i}")[0] == ""]
    assert keys
    for key in keys:
        assert ring.lookup_bounded(key, {}, 0.25, prefer={"absent"}) == ""
        assert ring.lookup_bounded(key, {}, 0.25, prefer=set()) == ""
