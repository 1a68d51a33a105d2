"""DispatchMemory: the prompts routing sent to each replica moments ago (pure logic)."""

from __future__ import annotations

import pytest

from services.common.hashing import BlockHasher
from services.orchestrator.dispatched import DispatchMemory
from services.orchestrator.routing import PrefixAwarePolicy, ReplicaView
from tests.clock import Clock

HASHER = BlockHasher("m", 16, b"k" * 32)
SYSTEM = list(range(1000, 1160))  # 10 full blocks


def hashes(tokens: list[int], salt: str = "") -> list[bytes]:
    return HASHER.hashes(tokens, salt)


def test_a_prompt_sent_to_a_replica_matches_its_full_blocks_there_only():
    mem = DispatchMemory(16, ttl_s=10, clock=Clock(100.0))
    assert mem.match(hashes(SYSTEM)) == {}
    mem.record("r0", hashes(SYSTEM + [1, 2, 3]))
    # A later request with the same system prompt and its own question.
    assert mem.match(hashes(SYSTEM + [7] * 40)) == {"r0": 160}
    # Another tenant's salt, or another prompt: nothing.
    assert mem.match(hashes(SYSTEM, salt="tenant-b")) == {}
    assert mem.match(hashes([5] + SYSTEM)) == {}


def test_only_the_leading_run_counts():
    mem = DispatchMemory(16, ttl_s=10, clock=Clock(100.0))
    h = hashes(SYSTEM)
    mem.record("r0", h[:3] + h[5:])
    assert mem.match(h) == {"r0": 48}


def test_entries_expire_after_ttl_and_a_resend_refreshes_them():
    clock = Clock(100.0)
    mem = DispatchMemory(16, ttl_s=10, clock=clock)
    mem.record("r0", hashes(SYSTEM))
    clock.t += 6
    mem.record("r1", hashes(SYSTEM[:64]))
    mem.record("r0", hashes(SYSTEM[:32]))  # the first two blocks again
    clock.t += 5  # r0's first send is 11 s old, its resend 5 s
    assert mem.match(hashes(SYSTEM)) == {"r0": 32, "r1": 64}
    assert len(mem) == 2 + 4
    clock.t += 5
    assert mem.match(hashes(SYSTEM)) == {}
    assert len(mem) == 0


def test_a_failed_replica_is_forgotten():
    mem = DispatchMemory(16, ttl_s=10, clock=Clock(100.0))
    mem.record("r0", hashes(SYSTEM))
    mem.record("r1", hashes(SYSTEM))
    mem.forget("r0")
    assert mem.match(hashes(SYSTEM)) == {"r1": 160}
    assert len(mem) == 10


def test_an_erased_tenant_is_forgotten_on_a_replica_and_no_other_tenant():
    """Review: EraseTenant forgot everything sent to each replica that dropped the tenant's
    blocks, and every other tenant's next request there routed as if new (its blocks were
    still there). Only the erased tenant's salt goes, on that replica only."""
    mem = DispatchMemory(16, ttl_s=10, clock=Clock(100.0))
    a, b = hashes(SYSTEM, salt="salt-a"), hashes(SYSTEM, salt="salt-b")
    mem.record("r0", a, "salt-a")
    mem.record("r0", b, "salt-b")
    mem.record("r1", a, "salt-a")
    mem.forget("r0", "salt-a")
    assert mem.match(a) == {"r1": 160}
    assert mem.match(b) == {"r0": 160}
    assert len(mem) == 20
    mem.forget("r0", "salt-b")  # its last blocks: the replica has no records left
    assert mem.match(b) == {} and set(mem._by_replica) == {"r1"}


def test_past_max_blocks_the_oldest_go_first_whichever_replica_holds_them():
    clock = Clock(100.0)
    mem = DispatchMemory(16, ttl_s=60, max_blocks=12, clock=clock)
    mem.record("r0", hashes(SYSTEM))  # 10 blocks
    clock.t += 1
    other = list(range(5000, 5064))
    mem.record("r1", hashes(other))  # 4 more: r0's two oldest go
    assert len(mem) == 12
    assert mem.match(hashes(SYSTEM)) == {}  # its leading blocks are gone
    assert mem.match(hashes(other)) == {"r1": 64}


def test_merged_raises_the_index_matches_never_lowers_them():
    mem = DispatchMemory(16, ttl_s=10, clock=Clock(100.0))
    mem.record("r0", hashes(SYSTEM[:48]))
    got = mem.merged({"r0": 96, "r1": 32}, hashes(SYSTEM))
    assert got == {"r0": 96, "r1": 32}
    mem.record("r1", hashes(SYSTEM))
    assert mem.merged({"r0": 96, "r1": 32}, hashes(SYSTEM)) == {"r0": 96, "r1": 160}


def test_ttl_zero_is_off():
    mem = DispatchMemory(16, ttl_s=0, clock=Clock(100.0))
    mem.record("r0", hashes(SYSTEM))
    assert not mem.enabled and mem.match(hashes(SYSTEM)) == {} and len(mem) == 0


@pytest.mark.parametrize("kwargs", [{"block_size": 0, "ttl_s": 1}, {"block_size": 16, "ttl_s": 1,
                                                                     "max_blocks": 0}])
def test_bad_sizes_are_refused(kwargs):
    with pytest.raises(ValueError):
        DispatchMemory(**kwargs)


def test_routing_sends_a_second_request_for_a_new_prompt_where_the_first_went():
    """The index knows nothing yet (both requests arrive within one prefill): without the
    memory the second goes wherever its session hashes; with it, to the first one's replica."""
    clock = Clock(100.0)
    policy = PrefixAwarePolicy(clock=clock)
    mem = DispatchMemory(16, ttl_s=10, clock=clock)
    h = hashes(SYSTEM + [1, 2, 3])
    views = [ReplicaView("r0", 0, 500), ReplicaView("r1", 0, 500)]
    # Two sessions the ring puts on different replicas.
    sessions = [f"s{i}" for i in range(50)]
    first = next(s for s in sessions if policy.choose(views, {}, s, new_blocks=12,
                                                      record=False).replica_id == "r0")
    second = next(s for s in sessions if policy.choose(views, {}, s, new_blocks=12,
                                                       record=False).replica_id == "r1")
    d1 = policy.choose(views, mem.merged({}, h), first, new_blocks=12)
    assert (d1.replica_id, d1.route) == ("r0", "ring")
    mem.record(d1.replica_id, h)
    busy = [ReplicaView("r0", 1, 488), ReplicaView("r1", 0, 500)]
    assert policy.choose(busy, {}, second, new_blocks=12).replica_id == "r1"  # blind
    d2 = policy.choose(busy, mem.merged({}, hashes(SYSTEM + [9, 9])), second, new_blocks=12)
    assert (d2.replica_id, d2.route, d2.matched_tokens) == ("r0", "prefix", 160)


def test_withdraw_takes_back_only_what_that_record_added_and_no_one_sent_since():
    clock = Clock(100.0)
    mem = DispatchMemory(16, ttl_s=10, clock=clock)
    h = hashes(SYSTEM)
    mem.record("r0", h[:2])
    clock.t += 1
    rec = mem.record("r0", h)  # adds blocks 3..10
    assert rec is not None and rec.added == tuple(h[2:])
    clock.t += 1
    mem.record("r0", h[:4])  # another request sent blocks 1..4 since
    mem.withdraw(rec)
    assert mem.match(h) == {"r0": 64}
    assert len(mem) == 4
    mem.withdraw(None)  # nothing recorded (memory off, no full block): nothing to do
    assert DispatchMemory(16, ttl_s=0).record("r0", h) is None


def test_withdraw_keeps_a_credit_another_request_renewed_at_the_same_clock_reading():
    """Two requests routed within one tick of a coarse clock (or a test's): the later one's
    credit on the shared blocks carried the earlier one's time, and withdrawing the earlier
    (refused) took the later one's credit too."""
    clock = Clock(100.0)
    mem = DispatchMemory(16, ttl_s=10, clock=clock)
    h = hashes(SYSTEM)
    rec = mem.record("r0", h)
    mem.record("r0", h)  # another request, same reading of the clock
    mem.withdraw(rec)
    assert mem.match(h) == {"r0": 16 * len(h)}
