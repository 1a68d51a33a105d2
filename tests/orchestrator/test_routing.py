"""Routing policy: prefix match under a bounded-load cap, else a bounded-load session ring."""

from collections import Counter

from services.orchestrator.routing import (
    PrefixAwarePolicy,
    ReplicaView,
    RoundRobinPolicy,
    bounded_cap,
)


def views(**loads):
    return [ReplicaView(k, float(v)) for k, v in loads.items()]


def test_longest_useful_prefix_wins():
    p = PrefixAwarePolicy(epsilon=0.25, min_prefix_tokens=32)
    d = p.choose(views(r0=0, r1=0, r2=0), {"r1": 64, "r2": 512}, "s")
    assert d.replica_id == "r2" and d.route == "prefix" and d.matched_tokens == 512


def test_tiny_match_is_not_useful_and_uses_the_ring():
    p = PrefixAwarePolicy(min_prefix_tokens=32)
    d = p.choose(views(r0=0, r1=0), {"r1": 16}, "session-x")
    assert d.route == "ring"


def test_overloaded_holder_is_skipped():
    p = PrefixAwarePolicy(epsilon=0.25, min_prefix_tokens=32)
    # r0 holds the prefix but already runs 6 of 8 active sequences: over the cap.
    assert bounded_cap([6, 1, 1], 0.25) < 6
    d = p.choose(views(r0=6, r1=1, r2=1), {"r0": 1024, "r1": 0}, "s")
    assert d.replica_id != "r0"


def test_load_penalty_spreads_a_hot_prompt_between_holders():
    p = PrefixAwarePolicy(epsilon=0.25, min_prefix_tokens=32, load_penalty_tokens=16)
    d = p.choose(views(r0=2, r1=0), {"r0": 1024, "r1": 1024}, "s")
    assert d.replica_id == "r1"


def test_session_affinity_is_stable_and_moves_only_when_its_replica_leaves():
    p = PrefixAwarePolicy()
    v = views(r0=0, r1=0, r2=0, r3=0)
    first = {f"s{i}": p.choose(v, {}, f"s{i}").replica_id for i in range(200)}
    assert all(p.choose(v, {}, s).replica_id == r for s, r in first.items())
    assert len(set(first.values())) == 4  # sessions spread over all replicas
    v3 = [x for x in v if x.replica_id != "r3"]
    moved = {s for s, r in first.items() if p.choose(v3, {}, s).replica_id != r}
    assert moved == {s for s, r in first.items() if r == "r3"}


def test_ring_respects_bounded_load():
    p = PrefixAwarePolicy(epsilon=0.25)
    loads = Counter()
    for _ in range(400):
        v = [ReplicaView(r, float(loads[r])) for r in ("r0", "r1", "r2", "r3")]
        loads[p.choose(v, {}, "same-session").replica_id] += 1
    assert max(loads.values()) <= 1.25 * (400 / 4) + 1


def test_excluded_and_empty():
    p = PrefixAwarePolicy()
    assert p.choose(views(r0=0), {}, "s", exclude=frozenset({"r0"})) is None
    d = p.choose(views(r0=0, r1=0), {"r0": 500}, "s", exclude=frozenset({"r0"}))
    assert d.replica_id == "r1"


def test_round_robin_cycles():
    p = RoundRobinPolicy()
    v = views(a=0, b=0, c=0)
    assert [p.choose(v, {}, "s").replica_id for _ in range(4)] == ["a", "b", "c", "a"]
