"""Rules of the prefix index that its mutation audit found unguarded: the limits and statuses
of Register, Publish and TopPrefixes, the load order of Match answers, lease renewal by
batches, the pause rule's boundary, the hits kept over a lapse or a resync (boundaries, bound,
aging), reaping steps, and the counters in Stats."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.prefix.index import MAX_REPLICAS, Load

from .conftest import BS, MODEL, make_index, matched, stored, sweep_for, toks
from .test_lapse import hot, reg, top


def test_register_takes_ids_of_256_characters_and_refuses_longer_ones(index):
    """Every Register field is at most 256 characters, named when refused."""
    for field in ("replica_id", "incarnation", "address", "model_id"):
        args = {"replica_id": "r", "incarnation": "i1", "address": "addr", "model_id": MODEL}
        args[field] = "x" * 256
        index.register(args["replica_id"], args["incarnation"], args["address"],
                       args["model_id"], BS)
        args[field] = "x" * 257
        with pytest.raises(InvalidArgument, match=field):
            index.register(args["replica_id"], args["incarnation"], args["address"],
                           args["model_id"], BS)


@pytest.mark.parametrize("field", ["replica_id", "incarnation", "model_id"])
@pytest.mark.parametrize("blank", ["\u3164", "\u200b", " "])
def test_register_refuses_ids_of_only_invisible_characters_naming_the_field(index, field,
                                                                            blank):
    """The Hangul filler passed isprintable(), and model_id is not held to it at all: a
    replica or model nobody could see in Stats or a log line was indexed. Refused as an id
    with nothing visible in it, nothing registered; a visible character among them is an
    id."""
    args = {"replica_id": "r", "incarnation": "i1", "address": "addr", "model_id": MODEL}
    args[field] = blank
    with pytest.raises(InvalidArgument, match=f"^{field}: "):
        index.register(args["replica_id"], args["incarnation"], args["address"],
                       args["model_id"], BS)
    assert index.replica_count == 0
    if field != "model_id" or blank != " ":
        return
    with pytest.raises(InvalidArgument, match="model_id: only whitespace or invisible"):
        index.register("r", "i1", "addr", "\u3164", BS)
    index.register("r", "i1", "addr", "my model", BS)  # a model id may hold spaces
    assert index.replica_count == 1


@pytest.mark.parametrize("bad", ["m\x1b[2J\n", "llama\u200b", "m \u3164", "m\tx", "m\u2028"])
def test_a_model_id_holding_a_character_that_prints_as_nothing_is_refused_naming_it(
        index, hasher, bad):
    """Register took "m\x1b[2J\n" (replica_id, incarnation and address must be printable,
    model_id only not blank): its escape cleared the terminal of whoever read the log line or
    Stats, and "llama\u200b" was a model of its own printed as "llama". Register, Match and
    TopPrefixes refuse it naming model_id and the character, nothing registered or counted;
    every id a hub or a model folder gives is taken."""
    hot(index, hasher, toks(1))
    before = index.stats()
    for call in (lambda: index.register("r9", "i1", "addr", bad, BS),
                 lambda: index.match(bad, token_ids=toks(1)),
                 lambda: index.top_prefixes(10, bad)):
        with pytest.raises(InvalidArgument, match=r"^model_id: holds U\+[0-9A-F]{4}"):
            call()
    after = index.stats()
    assert (len(after.replicas), after.matches_total) == (len(before.replicas),
                                                          before.matches_total)
    goods = ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen2.5-0.5B", "my model", "café",
             "models--org--name", "llama_3.1:8b")
    for i, good in enumerate(goods):
        index.register(f"r{i}", "i1", "addr", good, BS)
    assert len(index.stats().replicas) == len(before.replicas) + len(goods)


def test_a_hash_probe_of_the_wrong_length_is_a_bad_argument_not_a_key_mismatch(index, hasher):
    """A malformed hash_probe is INVALID_ARGUMENT naming it; only a well-formed probe that
    differs is FAILED_PRECONDITION (a key or model mismatch)."""
    with pytest.raises(InvalidArgument, match="hash_probe"):
        index.register("a", "i1", "addr-a", MODEL, BS, hash_probe=hasher.probe()[:8])
    assert index.replica_count == 0
    with pytest.raises(FailedPrecondition, match="hash_probe"):
        index.register("a", "i1", "addr-a", MODEL, BS, hash_probe=bytes(16))
    index.register("a", "i1", "addr-a", MODEL, BS, hash_probe=hasher.probe())
    assert index.replica_count == 1


def test_a_replica_past_the_last_free_slot_is_resource_exhausted_until_one_lapses(index, clock):
    """MAX_REPLICAS slots: one more is RESOURCE_EXHAUSTED (retry later), and a slot freed by a
    lapsed lease takes the next replica."""
    for i in range(MAX_REPLICAS - 1):
        reg(index, f"r{i}")
    clock.t += 5
    reg(index, "late")
    with pytest.raises(ResourceExhausted, match="replica_id"):
        reg(index, "one-more")
    assert index.replica_count == MAX_REPLICAS
    clock.t += 5  # every lease but late's lapsed
    reg(index, "one-more")
    assert sorted(r.replica_id for r in index.stats().replicas) == ["late", "one-more"]


def test_a_lapsed_replica_back_at_once_gets_its_hits_back_for_a_lease_after_registering(
        clock, hasher):
    """A replica back from a lapse has one lease from its Register to restate its blocks and
    get their hits back (its snapshot may come seconds later), and no more."""
    chain = toks(1, 2, 3)
    for waits, want in (((5,), [(chain, 5)]), ((6, 5), [])):
        index = make_index(clock)
        hot(index, hasher, chain)
        clock.t += index.lease_seconds
        assert not index.heartbeat("a", "i1", Load()).known
        seq = reg(index).next_seq
        for wait in waits:  # heartbeats keep the new lease meanwhile
            clock.t += wait
            assert index.heartbeat("a", "i1", Load()).known
        index.publish("a", "i1", seq, [stored(hasher, chain)], resync=True)
        assert top(index) == want, waits
        index.check_integrity()


def test_the_lapse_grace_includes_its_last_instant_for_the_sweeper_and_register(clock, hasher):
    """The hits of a lapsed lease are kept until one lease after the lapse, that instant
    included: the sweeper does not forget them then, and a Register then gets them back."""
    chain = toks(1, 2, 3)
    index = make_index(clock)
    hot(index, hasher, chain)
    assert sweep_for(index, clock, 4) == ["a"]  # dropped exactly at its deadline
    sweep_for(index, clock, 4)  # on time, to exactly one lease after the lapse
    seq = reg(index).next_seq
    index.publish("a", "i1", seq, [stored(hasher, chain)], resync=True)
    assert top(index) == [(chain, 5)]


def test_a_heartbeat_that_changes_the_load_reorders_equal_matches(index, hasher):
    """Replicas that match equally long (or not at all) are answered least loaded first, by
    the load of their last heartbeat."""
    chain = toks(1, 2)
    for rid in ("a", "b"):
        reg(index, rid)
        index.publish(rid, "i1", 1, [stored(hasher, chain)])
    for busy, idle in (("a", "b"), ("b", "a")):
        index.heartbeat(busy, "i1", Load(running=5))
        index.heartbeat(idle, "i1", Load(running=1))
        for tokens in (chain, toks(7)):
            got = index.match(MODEL, token_ids=tokens).matches
            assert [m.replica_id for m in got] == [idle, busy]
            assert got[0].load == Load(running=1)


def test_a_heartbeat_with_more_free_blocks_than_blocks_is_refused_leaving_the_last_load(
        index, clock):
    """free_blocks past total_blocks is INVALID_ARGUMENT naming both fields; the replica keeps
    the load of its last good heartbeat and its lease is not renewed by the bad one (it was
    taken and shown in Stats and Match answers as it came)."""
    reg(index, "a")
    index.heartbeat("a", "i1", Load(running=1, free_blocks=100, total_blocks=100))
    before = index.stats()
    clock.t += 1
    with pytest.raises(InvalidArgument, match=r"load\.free_blocks: 500 .*load\.total_blocks "
                                              r"\(100\)"):
        index.heartbeat("a", "i1", Load(running=2, free_blocks=500, total_blocks=100))
    clock.t -= 1
    assert index.stats() == before
    with pytest.raises(InvalidArgument, match="load.free_blocks"):  # unknown replica alike
        index.heartbeat("nobody", "i1", Load(free_blocks=1))
    assert index.replica_count == 1


@pytest.mark.parametrize("resync_again", [False, True])
def test_a_resyncs_hits_are_given_back_up_to_one_lease_after_it_that_instant_included(
        clock, hasher, resync_again):
    """The hits a resync saved for blocks its first batch did not restate are given back by a
    batch (or by another resync) that stores them until one lease after the resync, that
    instant included, as for a lapse's grace."""
    chain = toks(1, 2, 3)
    index = make_index(clock)
    hot(index, hasher, chain)
    index.publish("a", "i1", 2, [stored(hasher, chain, end=1)], resync=True)
    for _ in range(2):  # heartbeats keep the lease; one lease after the resync exactly
        clock.t += index.lease_seconds / 2
        assert index.heartbeat("a", "i1", Load()).known
    rest = stored(hasher, chain) if resync_again else stored(hasher, chain, start=1)
    index.publish("a", "i1", 3, [rest], resync=resync_again)
    assert top(index) == [(chain, 5)]
    index.check_integrity()


@pytest.mark.parametrize("late, dropped", [(5.0, ["a"]), (6.0, [])])
def test_a_sweeper_turn_late_by_over_half_a_lease_is_a_pause(clock, late, dropped):
    """A turn of the sweeper with no call served for over half a lease (`late` after the
    last) is a pause of the index, forgiven; exactly half a lease is not: a's 10 s lease,
    from t=0, ends at t=10, and the turn at t=5+late drops it only if nothing is forgiven."""
    index = make_index(clock)
    reg(index)
    sweep_for(index, clock, 2)  # on time, to t=5
    clock.t += late
    assert index.sweep() == dropped


def test_a_batch_of_exactly_the_event_and_block_limits_is_taken(clock, hasher):
    """max_events and max_blocks are the most a batch may hold, not one past it."""
    index = make_index(clock, max_events=2, max_blocks=3)
    reg(index)
    first, second = stored(hasher, toks(1, 2, 3), end=2), stored(hasher, toks(1, 2, 3), start=2)
    assert index.publish("a", "i1", 1, [first, second]).next_seq == 2
    assert matched(index, toks(1, 2, 3)) == {"a": 3}


@pytest.mark.parametrize("seq, resync", [(1, False), (3, True)])
def test_a_retried_batch_or_one_answered_with_resync_renews_the_lease(clock, hasher, seq,
                                                                      resync):
    """A batch taken, even if only acknowledged again (a retry) or answered RESYNC (a gap),
    shows the replica alive and renews its lease as a heartbeat does."""
    index = make_index(clock)
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, toks(1))])
    clock.t += 6
    assert index.publish("a", "i1", seq, [stored(hasher, toks(2))]).resync == resync
    clock.t += 6  # 12 s after the Register, 6 s after that batch, on a 10 s lease
    assert index.heartbeat("a", "i1", Load()).known


def test_a_single_continuation_is_held_to_the_block_limit_too(clock, hasher):
    """A batch of one continuation (the common case, taken on a shorter path) may hold
    max_blocks blocks and no more."""
    index = make_index(clock, max_blocks=3)
    reg(index)
    chain = toks(1, 2, 3, 4, 5)
    index.publish("a", "i1", 1, [stored(hasher, chain, end=1)])
    with pytest.raises(ResourceExhausted, match="3 blocks"):
        index.publish("a", "i1", 2, [stored(hasher, chain, start=1)])
    head = chain[: 3 * BS]  # a Match is bounded by max_blocks as well
    assert matched(index, head) == {"a": 1}
    index.publish("a", "i1", 2, [stored(hasher, chain, start=1, end=4)])
    assert matched(index, head) == {"a": 3}


def test_the_hits_kept_for_lapsed_replicas_are_bounded_oldest_forgotten_first(clock, hasher):
    """The hits of at most MAX_REPLICAS lapsed replicas are kept (ids come and go with every
    restart): past that, the earliest lapse's are forgotten, even within its grace."""
    chain = toks(1, 2, 3)
    index = make_index(clock, verify_hashes=False)
    hot(index, hasher, chain)
    index.expire(clock.t + index.lease_seconds)  # a lapses first
    for i in range(MAX_REPLICAS):  # then as many others, each holding a hit block of its own
        reg(index, f"r{i}")
        index.publish(f"r{i}", "i1", 1, [stored(hasher, toks(100 + i))])
        matched(index, toks(100 + i))
    index.expire(clock.t + index.lease_seconds)
    seq = reg(index).next_seq
    index.publish("a", "i1", seq, [stored(hasher, chain)], resync=True)
    assert top(index) == []


def test_hits_a_resync_saves_after_a_halving_are_not_halved_again(clock, hasher):
    """The hits a resync saves are already aged by the halvings before it: given back after
    it, they are halved only by those that came since."""
    index = make_index(clock, hit_half_life_seconds=4)
    chain = toks(1, 2, 3)
    hot(index, hasher, chain)  # 5 hits
    for _ in range(3):
        matched(index, chain)
    clock.t += 4
    index.sweep()
    assert top(index) == [(chain, 4)] and index.hit_halvings == 1
    index.publish("a", "i1", 2, [stored(hasher, chain, end=1)], resync=True)
    index.publish("a", "i1", 3, [stored(hasher, chain, start=1)])
    assert top(index) == [(chain, 4)]
    index.check_integrity()


def test_match_counters_count_blocks_asked_and_blocks_found(index, hasher):
    """Stats count every Match's blocks (a model nobody serves included) and, for a hit, the
    blocks of its longest match only."""
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    assert matched(index, toks(1, 2, 3)) == {"a": 2}
    index.match("nobody-serves-it", token_ids=toks(1, 2, 3, 4))
    s = index.stats()
    assert (s.matches_total, s.matches_hit) == (2, 1)
    assert (s.match_blocks_total, s.match_blocks_hit) == (3 + 4, 2)


def test_top_prefixes_takes_k_from_1_to_1000(index, hasher):
    """TopPrefixes' k is 1..1000: 1000 answers, 1001 is refused naming k."""
    hot(index, hasher, toks(1))
    assert len(index.top_prefixes(1000)) == len(index.top_prefixes(1)) == 1
    with pytest.raises(InvalidArgument, match="k"):
        index.top_prefixes(1001)


def test_top_prefixes_refuses_a_blank_model_id_and_takes_an_empty_one_as_every_model(
        index, hasher):
    """An empty model_id means every model; a blank one (" ", U+3164) matched none and read as
    a cold cache: it is refused naming model_id, as Match refuses it."""
    hot(index, hasher, toks(1))
    assert len(index.top_prefixes(10, "")) == 1
    for bad in (" ", "\u3164"):
        with pytest.raises(InvalidArgument, match="model_id"):
            index.top_prefixes(10, bad)


def test_match_and_top_prefixes_refuse_a_model_id_or_salt_no_replica_can_have(index, hasher):
    """A model id with a NUL (Register refuses it) was answered by Match with no replica and
    counted in Stats as a miss, and by TopPrefixes with nothing hot; a salt Match and
    publishes refuse (NUL, too long) was taken by TopPrefixes as a filter matching nothing.
    Refused naming the field, nothing counted."""
    hot(index, hasher, toks(1))
    before = index.stats()
    with pytest.raises(InvalidArgument, match="^model_id: must not contain NUL"):
        index.match(MODEL + "\0", token_ids=toks(1))
    with pytest.raises(InvalidArgument, match="^model_id: must not contain NUL"):
        index.top_prefixes(10, MODEL + "\0")
    for salt in ("t\0", "s" * 100_000):
        with pytest.raises(InvalidArgument, match="^cache_salt: "):
            index.top_prefixes(10, MODEL, cache_salt=salt)
    after = index.stats()
    assert (after.matches_total, after.match_blocks_total) == (before.matches_total,
                                                               before.match_blocks_total)
    assert len(index.top_prefixes(10, MODEL, cache_salt="")) == 1


def test_unheld_nodes_over_the_budget_are_reaped_a_step_at_a_time_below_the_hard_bound(
        clock, hasher):
    """Unheld nodes that bring the tree just over max_nodes are reaped a step per call
    (prune_step / REAP_UNITS slots), not all at once under the lock: only past the hard bound
    (max_nodes plus the gap down to the prune target) are they all reaped at once."""
    index = make_index(clock, max_nodes=34, prune_to=0.9, prune_step=14, verify_hashes=False)
    for rid in ("a", "b"):
        reg(index, rid)
    index.publish("a", "i1", 1, [stored(hasher, toks(*range(1, 31)))])
    index.publish("b", "i1", 1, [stored(hasher, toks(*range(40, 45)))])
    clock.t += 6
    index.heartbeat("b", "i1", Load())
    clock.t += 5
    assert index.expire() == ["a"] and index.tree.unheld == 30
    index.publish("b", "i1", 2, [stored(hasher, toks(*range(40, 46)), start=5)])  # 36 in all
    assert 0 < index.tree.unheld < 30 and len(index.tree) == 6
    assert index.tree.pruned_total == 0
    index.check_integrity()


def test_chains_of_a_batch_whose_parent_never_came_count_as_dropped(index, hasher):
    """Chains of a many-event batch (or a resync) that wait for a parent the batch never
    stores are dropped at its end, and counted in dropped_blocks_total."""
    reg(index)
    chain, other = toks(1, 2, 3), toks(4, 5)
    index.publish("a", "i1", 1, [stored(hasher, chain, start=1), stored(hasher, other, start=1)])
    assert index.stats().dropped_blocks_total == 2 + 1
    index.publish("a", "i1", 2, [stored(hasher, chain, start=2)], resync=True)
    assert index.stats().dropped_blocks_total == 3 + 1
    assert index.stats().nodes == 0


def test_the_same_incarnation_registering_for_another_model_starts_afresh(index, hasher):
    """A Register naming another model than the replica's record is a new replica: its
    holdings under the old model are dropped and it is matched for the new model only."""
    reg(index)
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2))])
    index.register("a", "i1", "addr-a", "m2", BS, 100)
    assert [(r.replica_id, r.model_id, r.held_blocks) for r in index.stats().replicas] == [
        ("a", "m2", 0)]
    assert matched(index, toks(1, 2)) == {}
    assert [m.replica_id for m in index.match("m2", token_ids=toks(1)).matches] == ["a"]
    index.check_integrity()


@pytest.mark.parametrize("batch", [1, 2])
def test_a_chain_cut_short_by_a_known_hash_counts_its_rest_as_dropped(clock, hasher, batch):
    """A chain whose tail names a block already in the tree elsewhere (hash checks off) is
    stored up to it; the rest is counted dropped, whether the batch holds one event or more."""
    index = make_index(clock, verify_hashes=False)
    reg(index)
    x = stored(hasher, toks(1, 2))
    index.publish("a", "i1", 1, [x])
    y = stored(hasher, toks(3, 4, 5))
    y = y._replace(block_hashes=[*y.block_hashes[:2], x.block_hashes[0]])
    head = stored(hasher, toks(3))
    tail = y._replace(parent_hash=y.block_hashes[0], block_hashes=y.block_hashes[1:],
                      token_ids=y.token_ids[BS:], start_block=1)
    if batch == 1:  # the continuation alone: the one-event path
        index.publish("a", "i1", 2, [head])
        index.publish("a", "i1", 3, [tail])
    else:
        index.publish("a", "i1", 2, [head, tail])
    assert index.stats().dropped_blocks_total == 1
    assert matched(index, toks(3, 4, 5)) == {"a": 2}
    index.check_integrity()


@pytest.mark.parametrize("by", ["token_ids", "block_hashes"])
def test_matches_for_a_model_nobody_serves_while_the_sweeper_is_starved_are_no_pause(
        index, hasher, clock, caplog, by):
    """Every call served proves the index ran, a Match for a model no replica serves
    included: with the sweeper starved meanwhile, its next turn is no pause, and a replica
    silent past its lease is dropped (not kept alive, with a warning of a standstill)."""
    import logging

    reg(index)
    index.sweep()
    ask = {"token_ids": toks(1)} if by == "token_ids" else {"block_hashes": hasher.hashes(toks(1))}
    for _ in range(210):  # a Match every 0.05 s for 10.5 s
        clock.t += 0.05
        index.match("nobody-serves-it", **ask)
    with caplog.at_level(logging.WARNING, logger="services.prefix.index"):
        index.sweep()
    assert not index.stats().replicas and "stood still" not in caplog.text


@pytest.mark.parametrize("blank", ["\u3164", "\u200b", " "])
def test_match_refuses_a_model_id_of_only_invisible_characters_naming_the_field(index, blank):
    """Register refuses such a model_id, so no replica serves it: Match answered an empty
    match, as if the request were fine and merely cold. Refused as at Register, by tokens or
    by hashes, and nothing counted."""
    for kw in ({"token_ids": toks(1)}, {"block_hashes": [b"\0" * 16]}):
        with pytest.raises(InvalidArgument, match="^model_id: only whitespace or invisible"):
            index.match(blank, "", **kw)
    assert index.matches_total == 0


def test_probe_matches_take_no_tick_so_a_fresh_tail_keeps_its_grace(clock, hasher):
    """A race audit: health and warm-up probes (Match with probe set: routing asking, not
    traffic) advanced the index's tick clock, so a tail stored moments ago aged by every probe
    and lost its cold_after_ticks grace: pruned first, though no traffic had passed since."""
    from services.common.policy import HybridPolicy

    shallow = 2 * BS
    index = make_index(clock, policy=HybridPolicy(shallow), min_deep_hits=1,
                       cold_after_ticks=5)
    reg(index)
    base = toks(1, 2)
    old, fresh = base + toks(4), base + toks(3)  # deep leaves
    index.publish("a", "i1", 1, [stored(hasher, old)])
    matched(index, old)  # hit once: not cold
    index.publish("a", "i1", 2, [stored(hasher, fresh, start=2)])  # the newest turn
    tick = index._tick
    for _ in range(10):  # probes only: no traffic since the store
        index.match(MODEL, token_ids=fresh, probe=True)
        index.match(MODEL, token_ids=toks(9), probe=True)
    assert index._tick == tick
    tree = index.tree
    gone = tree.prune(len(tree) - 1, HybridPolicy(shallow), shallow, 1, index._recent_since())
    assert gone == [hasher.hashes(old)[-1]]  # the least recent deep leaf, not the fresh one
    index.check_integrity()


def test_a_match_of_max_blocks_full_blocks_and_a_partial_one_is_taken_by_tokens(clock, hasher):
    """Match's limit is in blocks (max_blocks, as for block_hashes): max_blocks full blocks and
    a partial last one, never hashed, were refused as "more than max_blocks*block_size
    tokens", though their hashes were taken. One full block more is refused, naming blocks."""
    index = make_index(clock, max_blocks=3)
    reg(index, "a")
    index.publish("a", "i1", 1, [stored(hasher, toks(1, 2, 3))])
    for extra in (0, 1, BS - 1):
        r = index.match(MODEL, token_ids=toks(1, 2, 3) + [7] * extra)
        assert r.request_blocks == 3 and [(m.replica_id, m.matched_blocks)
                                          for m in r.matches] == [("a", 3)]
    with pytest.raises(InvalidArgument, match=r"^token_ids: more than 3 full blocks of "):
        index.match(MODEL, token_ids=toks(1, 2, 3, 4))
    with pytest.raises(InvalidArgument, match=r"^block_hashes: more than 3 blocks"):
        index.match(MODEL, block_hashes=hasher.hashes(toks(1, 2, 3, 4), ""))
