"""Prefix shard placement is the same however a side spells a shard, and a real difference
between kvpool's and the orchestrator's shard lists shows in the shards' Stats.

Each side builds its own ring of the shards from its own configuration. Keyed by the address
text, `dns:///127.0.0.1:p` on one side and `127.0.0.1:p` on the other were two shards: chains
were published to one and looked up on another, and nothing said so.
"""

from __future__ import annotations

import logging

import pytest
from tiercache.v1 import common_pb2, prefix_pb2

from clients.python.cli import MISMATCH_FIX
from services.common.addresses import canonical_address, shard_fingerprint
from services.common.config import ConfigError, require_addresses
from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient
from services.common.shard_list import SHOWN_SECONDS, WARN_EVERY_SECONDS
from services.prefix.config import PrefixConfig
from services.prefix.server import serve
from services.prefix.shard_list import ShardListCheck
from tests.clock import Clock
from tests.metric_sample import sample_value

BS = 16
MODEL = "tiny"
DIFFERS = "shard list differs between replicas and orchestrator"


class _Chan:
    """A channel nobody calls (placement only)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def unary_unary(self, *a, **k):
        def call(*a, **k):
            raise AssertionError("placement must not call a shard")
        return call

    def close(self) -> None:
        pass


@pytest.mark.parametrize("spelled, canonical", [
    ("  prefix-0.prefix:50053 ", "prefix-0.prefix:50053"),
    ("Prefix-0.PREFIX:50053", "prefix-0.prefix:50053"),
    ("prefix-0.prefix.svc.cluster.local.:50053", "prefix-0.prefix.svc.cluster.local:50053"),
    ("dns:///prefix-0.prefix:50053", "prefix-0.prefix:50053"),
    ("DNS:prefix-0.prefix:50053", "prefix-0.prefix:50053"),
    ("dns://10.0.0.10:53/prefix-0.prefix:50053", "prefix-0.prefix:50053"),  # the DNS server
    ("ipv4:10.1.2.3:50053", "10.1.2.3:50053"),
    ("ipv6:[FD00:0:0::5]:50053", "[fd00::5]:50053"),
    ("[FD00:0000::5]:050053", "[fd00::5]:50053"),
    ("dns:53", "dns:53"),  # the host "dns", not a scheme
    ("xds:///prefix", "xds:///prefix"),  # resolved by the control plane: kept
])
def test_canonical_address(spelled, canonical):
    assert canonical_address(spelled) == canonical


def test_names_that_may_differ_stay_apart():
    """Only the configuration can say whether two names are one host."""
    assert canonical_address("localhost:1") != canonical_address("127.0.0.1:1")
    assert canonical_address("prefix-0:1") != canonical_address("prefix-0.prefix:1")


def test_canonical_spellings_place_identically():
    plain = ["prefix-0.prefix:50053", "prefix-1.prefix:50053", "[fd00::7]:50053"]
    spelled = [" dns:///PREFIX-1.prefix.:50053", "ipv6:[FD00:0::7]:50053",
               "Prefix-0.Prefix:50053 "]
    a = PrefixIndexClient(plain, block_size=BS, channel_factory=_Chan)
    b = PrefixIndexClient(spelled, block_size=BS, channel_factory=_Chan)
    keys = [bytes([i, j]) * 8 for i in range(16) for j in range(16)]
    by_a = [canonical_address(a.shard_for(k)) for k in keys]
    assert by_a == [canonical_address(b.shard_for(k)) for k in keys]
    assert len(set(by_a)) == 3  # every shard owns some keys
    # Dialed as configured (only the whitespace goes).
    assert {b.shard_for(k) for k in keys} == set(b.addresses) == {x.strip() for x in spelled}
    assert a.shard_list == b.shard_list
    assert a.shard_list.shards == 3 and len(a.shard_list.fingerprint) == 16
    assert shard_fingerprint(plain) != shard_fingerprint(plain[:2])


def test_one_shard_spelled_twice_is_a_duplicate():
    with pytest.raises(ValueError, match="duplicate shard address"):
        PrefixIndexClient(["h:1", " H.:1"], channel_factory=_Chan)
    with pytest.raises(ConfigError, match="h:1 and dns:///H:1 name the same address"):
        require_addresses(["h:1", "dns:///H:1"], "kvpool", "prefix_address", allow_none=False)
    with pytest.raises(ConfigError, match="h:1 given twice"):
        require_addresses(("h:1", "h:1"), "kvpool", "prefix_address", allow_none=False)


# -- over gRPC: two shards in-process ----------------------------------------------------------


@pytest.fixture
def shards():
    svcs = [serve(PrefixConfig(address="127.0.0.1:0", block_size=BS, metrics_port=-1))
            for _ in range(2)]
    yield svcs
    for s in svcs:
        s.stop(0)


def _prompts(n: int) -> list[list[int]]:
    return [[1000 * p + i for i in range(3 * BS)] for p in range(n)]


def _publish(kvpool: PrefixIndexClient, prompts: list[list[int]]) -> None:
    kvpool.register("r0", "i", "127.0.0.1:7000", MODEL, BS, 1000)
    for p in prompts:
        hs = BlockHasher(MODEL, BS).hashes(p)
        out = kvpool.publish_events("r0", "i", [prefix_pb2.KvEvent(
            stored=prefix_pb2.BlocksStored(block_hashes=hs, token_ids=p,
                                           first_block_hash=hs[0]))])
        assert not out.resync and not out.failed


def _mismatches() -> float:
    return sample_value("tiercache_prefix_shard_list_mismatches_total") or 0.0


def test_chains_published_by_one_spelling_are_found_by_another(shards):
    """kvpool lists the shards plainly, the orchestrator through gRPC target schemes and with
    stray whitespace: every chain is found, and no shard reports a mismatch."""
    a, b = (s.address for s in shards)
    kvpool = PrefixIndexClient([a, b], timeout=5, block_size=BS)
    orch = PrefixIndexClient([f" ipv4:{b} ", f"dns:///{a}"], timeout=5, block_size=BS)
    try:
        prompts = _prompts(24)
        _publish(kvpool, prompts)
        before = _mismatches()
        found = [orch.match(MODEL, token_ids=p).matches[0].matched_blocks for p in prompts]
        assert found == [3] * len(prompts)
        s = orch.stats()
        assert (s.shard_list_mismatches_total, s.shard_list_mismatch) == (0, "")
        assert orch.shard_list_notes == {orch.addresses[0]: "", orch.addresses[1]: ""}
        assert _mismatches() == before
    finally:
        kvpool.close()
        orch.close()


def test_a_shard_missing_on_one_side_is_reported_while_match_answers(shards, capsys,
                                                                     monkeypatch):
    """The replica publishes to both shards, the orchestrator knows only the first: its
    Matches all go there, and half the chains are on the other shard. Every Match still
    answers; the shard counts the Matches, and the orchestrator's Stats (`tiercache stats`)
    mark the tier unhealthy naming both lists."""
    from services.orchestrator.backends import SemanticBackend
    from services.orchestrator.prefix_backend import PrefixBackend
    from tests.orchestrator.stats_view import stats_via_cli

    a, b = (s.address for s in shards)
    kvpool = PrefixIndexClient([a, b], timeout=5, block_size=BS)
    pb = PrefixBackend((a,), "", 5.0, BS)
    try:
        prompts = _prompts(12)
        _publish(kvpool, prompts)
        owned_by_a = [kvpool.shard_for(BlockHasher(MODEL, BS).hashes(p)[0]) == a
                      for p in prompts]
        assert 0 < sum(owned_by_a) < len(prompts)
        before = _mismatches()
        hashes = [BlockHasher(MODEL, BS).hashes(p) for p in prompts]
        got = [pb.match(h, MODEL) for h in hashes]  # answered, never refused
        assert [g == {"r0": 3 * BS} for g in got] == owned_by_a
        assert _mismatches() == before + len(prompts)
        assert shards[1].servicer.shard_lists.mismatches_total == 0  # never asked

        s = pb.stats()
        assert s.shard_list_mismatches_total == len(prompts)
        kv, orch = kvpool.shard_list, pb.client.shard_list
        assert s.shard_list_mismatch.startswith(
            f"{DIFFERS}: replica r0 registered with 2 shards ({kv.fingerprint}), a Match came "
            f"with 1 shard ({orch.fingerprint})"), s.shard_list_mismatch
        [line] = pb.dependencies()
        assert not line.healthy and line.last_error == s.shard_list_mismatch

        shown, err = stats_via_cli(capsys, monkeypatch, SemanticBackend("", "", 1.0), pb)
        assert shown["prefix"]["shardListMismatch"] == s.shard_list_mismatch
        assert shown["prefix"]["shardListMismatchesTotal"] == str(len(prompts))
        assert [d["lastError"] for d in shown["dependencies"]] == [s.shard_list_mismatch]
        assert err == f"prefix: {s.shard_list_mismatch}; {MISMATCH_FIX['prefix']}\n"
    finally:
        kvpool.close()
        pb.client.close()


def test_sharded_orchestrator_names_the_shard_that_saw_a_mismatch(shards):
    """The replica publishes to one index, the orchestrator shards over it and another: the
    lookups placed on the first shard find it, those placed on the second miss. The first
    shard's line says so, and the tier's line names that shard."""
    from services.orchestrator.prefix_backend import PrefixBackend

    a, b = (s.address for s in shards)
    kvpool = PrefixIndexClient([a], timeout=5, block_size=BS)
    pb = PrefixBackend((a, b), "", 5.0, BS)
    try:
        prompts = _prompts(12)
        _publish(kvpool, prompts)
        got = [pb.match(BlockHasher(MODEL, BS).hashes(p), MODEL) for p in prompts]
        placed_on_a = [pb.client.shard_for(BlockHasher(MODEL, BS).hashes(p)[0]) == a
                       for p in prompts]
        assert [g == {"r0": 3 * BS} for g in got] == placed_on_a
        s = pb.stats()
        assert s.shard_list_mismatches_total == sum(placed_on_a) > 0
        assert s.shard_list_mismatch.startswith(
            f"{a}: {DIFFERS}: replica r0 registered with 1 shard"), s.shard_list_mismatch
        lines = {(d.name, d.address): d for d in pb.dependencies()}
        assert not lines[("prefix shard", a)].healthy
        assert DIFFERS in lines[("prefix shard", a)].last_error
        assert lines[("prefix shard", b)].healthy  # no replica registered there
        tier = lines[("prefix", f"{a},{b}")]
        assert not tier.healthy and tier.last_error == f"1 of 2 shards unhealthy: {a}"
    finally:
        kvpool.close()
        pb.client.close()


# -- the shard's check on its own --------------------------------------------------------------


def test_the_check_compares_only_what_both_sides_said():
    clock = Clock()
    c = ShardListCheck(clock)
    c.registered("old", 0, "")  # an older kvpool: says no list
    assert c.check(2, "bbbb", ["old"])
    assert c.check(2, "bbbb", [])
    c.registered("single", 1, "aaaa")
    assert c.check(0, "", ["single"])  # an older orchestrator
    assert c.check(1, "cccc", ["single"])  # one index named differently on each side
    assert c.check(1, "dddd", ["gone"])  # a replica not registered here; one index each
    assert c.check(1, "dddd", [])  # naming nobody: no registered list differs in placement
    assert c.mismatches_total == 0 and c.note() == ""
    assert not c.check(2, "bbbb", ["old", "single"])  # one side shards: placement differs
    c.registered("single", 0, "")  # registered again without a list: no longer checked
    assert c.check(2, "bbbb", ["single"])
    assert c.mismatches_total == 1


def test_a_match_that_names_no_replica_is_checked_against_every_list():
    # Chains published by a list the Match's does not share are not on this shard: the Match
    # finds nothing and names no replica, which is when the check matters most.
    clock = Clock()
    c = ShardListCheck(clock)
    c.registered("r0", 2, "aaaa")
    c.registered("r1", 3, "bbbb")  # mid-rollout: two lists among the replicas
    assert c.check(3, "bbbb", [])  # one of them agrees
    assert c.check(2, "aaaa", ["unknown"])
    assert not c.check(4, "cccc", [])  # none does
    assert c.note().startswith(f"{DIFFERS}: replica r1 registered with 3 shards (bbbb), a "
                               "Match came with 4 shards (cccc)")
    c.registered("r1", 2, "aaaa")  # r1 re-registered with r0's list: bbbb is nobody's now
    assert not c.check(3, "bbbb", [])
    assert c.check(2, "aaaa", [])
    assert c.mismatches_total == 2


def test_a_long_fingerprint_is_cut_not_kept_whole():
    # A 1 MB fingerprint was kept for each replica and copied whole into Stats and the log.
    c = ShardListCheck(Clock())
    c.registered("r0", 2, "a" * 1_000_000)
    assert not c.check(3, "b" * 1_000_000, [])
    assert len(c.note()) < 1000
    assert c.check(2, "a" * 64 + "different tail", ["r0"])  # compared as cut


def test_a_fingerprint_with_control_characters_is_shown_escaped():
    # Fingerprints came into Stats' note, the warning and `tiercache stats`' stderr as sent:
    # a Match's "\x1b[2J" cleared the operator's terminal, a newline began a line of its own.
    c = ShardListCheck(Clock())
    c.registered("r0", 2, "aaaa\n")
    assert not c.check(3, "\x1b[2Jall healthy\nnext", [])
    note = c.note()
    assert note.isprintable(), note
    assert "registered with 2 shards ('aaaa\\n'), a Match came with 3 shards " \
        "('\\x1b[2Jall healthy\\nnext')" in note, note


def test_a_lapsed_replicas_list_is_forgotten():
    """A lapsed replica's list was kept: a Match naming no live replica was compared with it,
    and agreed with a list no live replica had (a mismatch missed)."""
    from services.prefix.server import PrefixServicer
    from tests.prefix.conftest import BS, MODEL, make_index

    clock = Clock()
    index = make_index(clock, lease_seconds=10.0)
    s = PrefixServicer(index)
    for rid, fp in (("old", "aaaa"), ("new", "bbbb")):
        s.Register(prefix_pb2.RegisterRequest(
            replica_id=rid, incarnation="i1", address=f"{rid}:1", model_id=MODEL, block_size=BS,
            capacity_blocks=10, shard_list=common_pb2.ShardList(shards=2, fingerprint=fp)),
            None)
        clock.t += 6  # "old"'s lease lapses at 10, "new"'s at 16
    assert index.sweep() == ["old"]
    assert not s.shard_lists.check(2, "aaaa", [])  # only "new"'s list is left: it differs
    assert s.shard_lists.check(2, "bbbb", [])


def test_the_note_lasts_a_while_and_warnings_are_rate_limited(caplog):
    clock = Clock()
    c = ShardListCheck(clock)
    c.registered("r0", 2, "aaaa")
    caplog.set_level(logging.WARNING, "services.prefix.shard_list")
    for _ in range(5):
        assert not c.check(3, "bbbb", ["r0"])
    assert len(caplog.records) == 1
    assert "r0 registered with 2 shards (aaaa), a Match came with 3 shards (bbbb)" in (
        caplog.records[0].getMessage())
    clock.t += WARN_EVERY_SECONDS
    c.check(3, "bbbb", ["r0"])
    assert len(caplog.records) == 2
    assert "(5 such Matches since the last warning)" in caplog.records[1].getMessage()
    assert c.note().startswith(f"{DIFFERS}: replica r0 registered with 2 shards (aaaa)")
    assert c.check(2, "aaaa", ["r0"])  # a right Match does not count
    clock.t += SHOWN_SECONDS + 1
    assert c.note() == "" and c.mismatches_total == 6
