"""Unheld nodes: what a lapse or a resync leaves for `reap` instead of deleting it under the lock.

The slot comes off every node at once; nodes nobody holds then stay, invisible to every query,
until the sweeper deletes them in bounded steps. These tests hold them to being invisible, to
being revived as new nodes would be made, and to being reaped in steps, by the server too.
"""

from __future__ import annotations

import time

import grpc
from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

from services.prefix import server as prefix_server
from services.prefix.config import PrefixConfig
from services.prefix.index import Load
from services.prefix.server import build_index, serve
from services.prefix.tree import BlockTree
from tests.waits import holds_within

from .conftest import BS, MODEL, make_index, matched, stored, toks


def chain_hashes(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i // 256, i % 256]) * 4 for i in range(n)]


def tree_with_chain(n: int) -> tuple[BlockTree, bytes, list[bytes]]:
    tree = BlockTree(BS)
    root = b"root" * 4
    tree.ensure_root(root, MODEL, "")
    hs = chain_hashes(n)
    tree.store(root, hs, list(range(n * BS)), 0, 1)
    return tree, root, hs


def test_a_cleared_chain_is_invisible_and_reaped_deepest_first_in_bounded_steps():
    tree, root, hs = tree_with_chain(50)
    tree.match(hs, 2)  # a hit on the deepest block
    assert tree.clear_saving(0) == {hs[-1]: (1, 2)}
    assert tree.unheld == 50 and len(tree) == 0 and tree.held[0] == 0
    assert tree.match(hs, 3) == [] and tree.get(hs[0]) is None and hs[0] not in tree
    assert list(tree.blocks()) == [] and tree.top(5) == []
    assert not tree.is_known(hs[0]) and tree.is_known(root)
    tree.check_integrity()
    assert tree.reap(10) == 40
    # The deepest ten went; the rest still hang from the root, unheld.
    assert all(h not in tree._table for h in hs[40:]) and all(h in tree._table for h in hs[:40])
    tree.check_integrity()
    assert tree.reap() == 0
    assert not tree._table and root not in tree._roots  # the root went with its last block
    tree.check_integrity()


def test_a_reaping_step_deletes_only_leaves_whatever_order_its_slots_come_in():
    # A slot queued by one clear can hold, by the time it comes up, a node that a later clear
    # left unheld with its whole subtree below it (the slot freed and reused meanwhile):
    # deleting that subtree at once was a step of unbounded length under the lock.
    tree, root, hs = tree_with_chain(60)
    tree.clear(0)
    tree._reap[0] = tree._reap[0][::-1].copy()  # shallowest first: the worst order
    while tree.unheld:
        before = len(tree._table)
        tree.reap(10)
        assert before - len(tree._table) <= 10
        tree.check_integrity()
    assert not tree._table and not tree._reap


def test_nothing_stays_queued_once_every_unheld_node_is_gone():
    # A resync restating its holdings revives every node its clear left unheld: the queued
    # slots are all stale then and must not pile up, one array per resync.
    tree, root, hs = tree_with_chain(30)
    for clock in range(2, 12):
        tree.clear(0)
        tree.store(root, hs, list(range(30 * BS)), 0, clock)
        assert tree.unheld == 0 and not tree._reap
    tree.clear(0)
    assert tree.reap(5) == 25 and tree._reap  # still under way
    tree.reap()
    assert not tree._reap and tree._reap_at == 0


def test_a_block_stored_again_before_reaping_is_revived_as_a_new_one_and_kept():
    tree, root, hs = tree_with_chain(20)
    for _ in range(3):
        tree.match(hs[:10], 2)
    tree.clear(0)
    # Replica slot 1 stores the first 12 blocks again: held, no hits, used now.
    r = tree.store(root, hs[:12], list(range(12 * BS)), 1, 9)
    assert (r.added, r.held, r.dropped) == (0, 12, 0)
    assert tree.unheld == 8 and len(tree) == 12 and tree.held[1] == 12
    info = tree.get(hs[9])
    assert info is not None and (info.holders, info.hits, info.last) == (2, 0, 9)
    # A chain continuing an unheld block is dropped, as one continuing an unknown block was.
    assert tree.store(hs[15], chain_hashes(2, 1), list(range(2 * BS)), 1, 10).dropped == 2
    tree.check_integrity()
    assert tree.reap() == 0
    assert sorted(b.key for b in tree.blocks()) == sorted(hs[:12])
    tree.check_integrity()
    # A stored-again block keeps the hits given back for it; one still unheld does not count.
    tree.clear(1)
    left = tree.restore_usage({hs[0]: (5, 3)})
    assert left == {hs[0]: (5, 3)}


def test_a_match_credits_the_deepest_held_block_not_an_unheld_one_below_it(clock, hasher):
    index = make_index(clock)
    for rid in ("a", "b"):
        index.register(rid, "i1", f"{rid}:1", MODEL, BS, 100)
    long, short = toks(1, 2, 3, 4, 5), toks(1, 2)
    index.publish("a", "i1", 1, [stored(hasher, long)])
    index.publish("b", "i1", 1, [stored(hasher, short)])
    clock.t += 6
    index.heartbeat("b", "i1", Load())
    clock.t += 5
    assert index.expire() == ["a"]
    assert index.tree.unheld == 3
    assert matched(index, long) == {"b": 2}
    assert [(p.token_ids, p.hits) for p in index.top_prefixes(5)] == [(short, 1)]
    index.check_integrity()


def test_pruning_reaps_unheld_nodes_before_it_prunes_a_held_block(clock, hasher):
    # A lapse leaves 30 unheld nodes; "b" then stores past the node budget counting them: they
    # are reaped, and no block a replica holds is pruned (the live count fits the budget).
    index = make_index(clock, max_nodes=40, prune_to=0.9, verify_hashes=False)
    for rid in ("a", "b"):
        index.register(rid, "i1", f"{rid}:1", MODEL, BS, 100)
    index.publish("a", "i1", 1, [stored(hasher, toks(*range(1, 31)))])
    index.publish("b", "i1", 1, [stored(hasher, toks(*range(40, 45)))])
    clock.t += 6
    index.heartbeat("b", "i1", Load())
    clock.t += 5
    assert index.expire() == ["a"]
    assert index.tree.unheld == 30
    index.publish("b", "i1", 2, [stored(hasher, toks(*range(40, 60)))])  # 20 held: 50 in all
    assert index.tree.unheld == 0 and len(index.tree) == 20
    assert index.tree.pruned_total == 0
    index.check_integrity()


def test_the_servers_sweeper_reaps_in_steps_and_calls_go_on_meanwhile(hasher, monkeypatch):
    monkeypatch.setattr(prefix_server, "REAP_STEP", 7)
    cfg = PrefixConfig(address="127.0.0.1:0", metrics_port=-1, block_size=BS,
                       lease_seconds=0.4)
    index = build_index(cfg)
    steps: list[int | None] = []
    real = index.reap

    def counted(budget=None):
        steps.append(budget)
        return real(budget)

    index.reap = counted  # type: ignore[method-assign]
    svc = serve(cfg, index)
    channel = grpc.insecure_channel(svc.address)
    try:
        stub = prefix_pb2_grpc.PrefixIndexStub(channel)
        with svc.servicer.lock:  # registered and stored directly, then left to lapse
            index.register("a", "i1", "a:1", MODEL, BS, 100)
            index.publish("a", "i1", 1, [stored(hasher, toks(*range(1, 41)))])
        answers: list[list[str]] = []
        end = time.monotonic() + 10
        while time.monotonic() < end and (not steps or index.tree.unheld):
            lapsed = bool(steps)  # reaping begins in the sweeper turn that drops "a"
            r = stub.Match(prefix_pb2.MatchRequest(model_id=MODEL,
                                                   block_hashes=hasher.hashes(toks(1, 2))),
                           timeout=5)
            got = [m.replica_id for m in r.matches]
            # "a" until its lease lapses (on a call, or in the sweeper's turn), then nothing.
            if lapsed or (answers and not answers[-1]):
                assert got == []
            else:
                assert got in ([], ["a"])
            answers.append(got)
            time.sleep(0.01)
        with svc.servicer.lock:
            assert index.tree.unheld == 0 and not index.tree._table
            index.check_integrity()
    finally:
        channel.close()
        svc.stop()
    assert len(steps) >= 40 // 7 and set(steps) == {7}


def test_stats_say_how_many_unheld_nodes_are_left_summed_over_shards(hasher, monkeypatch):
    from services.common.prefix_client import PrefixIndexClient

    monkeypatch.setattr(prefix_server, "REAP_STEP", 0)  # the sweepers reap nothing here
    cfg = PrefixConfig(address="127.0.0.1:0", metrics_port=-1, block_size=BS,
                       lease_seconds=0.3)
    svcs = [serve(cfg), serve(cfg)]
    client = PrefixIndexClient([s.address for s in svcs], timeout=5)
    try:
        for svc, n in zip(svcs, (12, 5), strict=True):
            with svc.servicer.lock:
                svc.servicer.index.register("a", "i1", "a:1", MODEL, BS, 100)
                svc.servicer.index.publish("a", "i1", 1, [stored(hasher, toks(*range(1, n + 1)))])
        assert client.stats().nodes == 17 and client.stats().unheld_nodes == 0
        # the leases lapse (the sweepers drop "a")
        holds_within(lambda: not any(s.servicer.index.replica_count for s in svcs), 10, 0.05)
        for svc, n in zip(svcs, (12, 5), strict=True):
            with grpc.insecure_channel(svc.address) as ch:
                s = prefix_pb2_grpc.PrefixIndexStub(ch).Stats(prefix_pb2.PrefixStatsRequest(),
                                                            timeout=5)
            assert (s.nodes, s.unheld_nodes) == (0, n)
        s = client.stats()
        assert (s.nodes, s.unheld_nodes, s.shards_answered) == (0, 17, 2)
    finally:
        client.close()
        for svc in svcs:
            svc.stop()


def test_a_clear_made_by_a_call_is_reaped_soon_not_a_quarter_lease_later(hasher):
    # The sweeper's turn comes every quarter lease (10 s here); what a Publish's `cleared`
    # event (or a resync) left unheld is looked for every REAP_IDLE_S meanwhile.
    from services.prefix.index import Cleared

    cfg = PrefixConfig(address="127.0.0.1:0", metrics_port=-1, block_size=BS,
                       lease_seconds=40)
    svc = serve(cfg)
    index = svc.servicer.index
    try:
        with svc.servicer.lock:
            index.register("a", "i1", "a:1", MODEL, BS, 100)
            index.publish("a", "i1", 1, [stored(hasher, toks(*range(1, 21)))])
            index.publish("a", "i1", 2, [Cleared()])
            assert index.tree.unheld == 20
        holds_within(lambda: not index.tree.unheld, 5, 0.02)
        assert index.tree.unheld == 0 and index.replica_count == 1  # reaped; "a" still there
    finally:
        svc.stop()


def test_a_chain_deeper_than_65535_blocks_is_reaped_deepest_first_and_all_by_reap():
    """A clear queues its unheld nodes deepest first. Depths past 65,535 blocks (a million
    tokens at 16 a block) shared one sort key, so a long chain's deepest blocks were queued
    shallowest first: every pass of `reap` deleted one of them, `reap()` (all) left all but one
    unheld, and steps of bounded work took a pass over the queue per block deleted."""
    n = 65_540
    tree = BlockTree(1)
    root = b"root" * 4
    hs = [i.to_bytes(16, "little") for i in range(1, n + 1)]
    for clock in (1, 2):
        tree.ensure_root(root, MODEL, "")  # (the last block reaped took the root with it)
        assert tree.store(root, hs, list(range(n)), 0, clock).added == n
        tree.clear(0)
        if clock == 1:
            assert tree.reap() == 0 and not tree._table
        else:
            assert tree.reap(10) == n - 10  # a bounded step: the ten deepest blocks
            assert all(h not in tree._table for h in hs[-10:]) and hs[-11] in tree._table
    tree.check_integrity()
