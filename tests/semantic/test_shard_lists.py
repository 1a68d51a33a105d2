"""Orchestrators that place semantic namespaces by different shard lists show in the shards'
Stats.

Semantic shards are placed by the orchestrators alone, each on its own ring of the shards it
lists. One that lists a shard the others lack (or names one by another name) stored
namespaces where the others did not look: their lookups missed, every call succeeded, and
nothing compared the lists.
"""

from __future__ import annotations

import logging
from hashlib import blake2b

import grpc
import numpy as np
import pytest
from tiercache.v1 import common_pb2
from tiercache.v1 import semantic_pb2 as pb
from tiercache.v1 import semantic_pb2_grpc as pbg

from clients.python.cli import MISMATCH_FIX
from services.common.addresses import shard_fingerprint
from services.common.shard_list import SHOWN_SECONDS, WARN_EVERY_SECONDS
from services.semantic.server import serve
from services.semantic.shard_list import (
    MAX_FINGERPRINT,
    MAX_LISTS,
    WINDOW_SECONDS,
    RecentShardLists,
)
from tests.clock import Clock
from tests.metric_sample import sample_value

DIFFERS = "shard list differs between orchestrators"


def _mismatches() -> float:
    return sample_value("tiercache_semantic_shard_list_mismatches_total") or 0.0


# -- the shard's check on its own --------------------------------------------------------------


def test_lists_not_said_or_of_one_shard_each_never_differ():
    c = RecentShardLists(Clock())
    assert c.check(0, "", "Lookup")  # an older orchestrator: says no list
    assert c.check(1, "aaaa", "Store")
    assert c.check(1, "bbbb", "Lookup")  # one shard named differently by each: nothing placed
    assert c.check(0, "", "Store")
    assert c.mismatches_total == 0 and c.note() == ""
    assert not c.check(2, "cccc", "Lookup")  # a second shard on one side: placement differs
    assert c.mismatches_total == 1


def test_a_list_differing_from_one_seen_within_the_window_mismatches():
    clock = Clock()
    c = RecentShardLists(clock)
    before = _mismatches()
    assert c.check(2, "aaaa", "Store", "ipv4:10.0.0.1:4000")
    assert c.check(2, "aaaa", "Lookup", "ipv4:10.0.0.1:4000")  # the same list again
    clock.t += 200
    assert not c.check(3, "bbbb", "Lookup", "ipv4:10.0.0.2:5000")  # answered all the same
    assert c.note() == (f"{DIFFERS}: a call came with 2 shards (aaaa) from ipv4:10.0.0.1:4000, "
                        "a Lookup with 3 shards (bbbb) from ipv4:10.0.0.2:5000 0 s ago "
                        "(1 such call in all)")
    # The first orchestrator's next call mismatches too: the other list is recent.
    assert not c.check(2, "aaaa", "Store", "ipv4:10.0.0.1:4000")
    assert c.note().startswith(f"{DIFFERS}: a call came with 3 shards (bbbb) from "
                               "ipv4:10.0.0.2:5000, a Store with 2 shards (aaaa) from "
                               "ipv4:10.0.0.1:4000")
    clock.t += WINDOW_SECONDS - 1
    assert not c.check(2, "aaaa", "Store")  # bbbb was seen 299 s before
    clock.t += 2
    assert c.check(2, "aaaa", "Store")  # not for longer than the window: forgotten
    assert c.mismatches_total == 3 and _mismatches() == before + 3


def test_the_note_lasts_a_while_and_warnings_are_rate_limited(caplog):
    clock = Clock()
    c = RecentShardLists(clock)
    caplog.set_level(logging.WARNING, "services.semantic.shard_list")
    assert c.check(2, "aaaa", "Store")
    for _ in range(5):
        assert not c.check(3, "bbbb", "Lookup")
    assert len(caplog.records) == 1
    assert ("semantic shard lists differ: a call came with 2 shards (aaaa), a Lookup with 3 "
            "shards (bbbb) (1 such call since the last warning)") in caplog.records[0].getMessage()
    clock.t += WARN_EVERY_SECONDS
    assert not c.check(3, "bbbb", "Lookup")
    assert len(caplog.records) == 2
    assert "(5 such calls since the last warning)" in caplog.records[1].getMessage()
    assert c.note().startswith(f"{DIFFERS}: a call came with 2 shards (aaaa)")
    clock.t += SHOWN_SECONDS + 1
    assert c.note() == "" and c.mismatches_total == 6


def test_the_lists_remembered_are_bounded():
    c = RecentShardLists(Clock())
    for i in range(MAX_LISTS + 10):
        assert c.check(1, f"{i:04x}", "Lookup")  # one shard each: never a mismatch
    assert len(c._seen) == MAX_LISTS
    assert "0000" not in c._seen and f"{MAX_LISTS + 9:04x}" in c._seen  # the oldest went
    assert c.check(1, "f" * 100_000, "Lookup")  # a caller's overlong fingerprint is cut
    assert "f" * MAX_FINGERPRINT in c._seen and len(c._seen) == MAX_LISTS


# -- over gRPC: two semantic shards in-process -------------------------------------------------


class HashEmbedder:
    """A vector per text from its hash (no model: these tests only place namespaces)."""

    name = identity = "hash@test"
    dim = 8

    def embed_one(self, text: str) -> np.ndarray:
        seed = int.from_bytes(blake2b(text.encode(), digest_size=4).digest(), "little")
        v = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
        return v / np.linalg.norm(v)

    def embed(self, texts: list[str]) -> np.ndarray:
        return (np.stack([self.embed_one(t) for t in texts]) if texts
                else np.zeros((0, self.dim), np.float32))


@pytest.fixture
def shards(make_cfg, tmp_path):
    svcs = [serve(make_cfg(db_path=str(tmp_path / f"s{i}.db")), embedder=HashEmbedder())
            for i in range(2)]
    yield svcs
    for s in svcs:
        s.stop(0)


NS = pb.Namespace(tenant="acme", model_id="m", context_hash="00ff")


def test_a_shard_called_with_two_lists_says_so_and_answers_both(shards):
    a = shards[0].handle.address
    one = common_pb2.ShardList(shards=1, fingerprint=shard_fingerprint([a]))
    two = common_pb2.ShardList(shards=2, fingerprint=shard_fingerprint([a, "semantic-1:1"]))
    before = _mismatches()
    with grpc.insecure_channel(a) as ch:
        stub = pbg.SemanticCacheStub(ch)
        sid = stub.Store(pb.StoreRequest(namespace=NS, prompt="q", answer="x", shard_list=one),
                         timeout=10).id
        st = stub.Stats(pb.SemanticStatsRequest(), timeout=10)
        assert (st.shard_list_mismatches_total, st.shard_list_mismatch) == (0, "")
        r = stub.Lookup(pb.LookupRequest(namespace=NS, text="q", shard_list=two), timeout=10)
        assert r.hit and r.entry.id == sid  # answered as ever
        st = stub.Stats(pb.SemanticStatsRequest(), timeout=10)
        assert st.shard_list_mismatches_total == 1
        note = st.shard_list_mismatch
        assert note.startswith(f"{DIFFERS}: a call came with 1 shard ({one.fingerprint}) from "
                               "ipv4:127.0.0.1:"), note
        assert f", a Lookup with 2 shards ({two.fingerprint}) from ipv4:127.0.0.1:" in note
        assert note.endswith("(1 such call in all)")
        # An older orchestrator's call (no list) is not checked.
        assert stub.Lookup(pb.LookupRequest(namespace=NS, text="q"), timeout=10).hit
        assert stub.Stats(pb.SemanticStatsRequest(),
                          timeout=10).shard_list_mismatches_total == 1
    assert _mismatches() == before + 1


def test_a_call_refused_as_bad_input_leaves_no_list_behind(shards):
    a = shards[0].handle.address
    one = common_pb2.ShardList(shards=1, fingerprint=shard_fingerprint([a]))
    two = common_pb2.ShardList(shards=2, fingerprint=shard_fingerprint([a, "semantic-1:1"]))
    with grpc.insecure_channel(a) as ch:
        stub = pbg.SemanticCacheStub(ch)
        for method, bad in (
                (stub.Lookup, pb.LookupRequest(namespace=NS, text="", shard_list=two)),
                (stub.Store, pb.StoreRequest(namespace=NS, prompt="q", answer="",
                                             shard_list=two))):
            with pytest.raises(grpc.RpcError) as e:
                method(bad, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Had the refused calls' list been kept, this one would differ from it.
        stub.Lookup(pb.LookupRequest(namespace=NS, text="q", shard_list=one), timeout=10)
        st = stub.Stats(pb.SemanticStatsRequest(), timeout=10)
        assert (st.shard_list_mismatches_total, st.shard_list_mismatch) == (0, "")


def _namespaces(n: int) -> list[pb.Namespace]:
    return [pb.Namespace(tenant=f"t{i}", model_id="m", context_hash="c") for i in range(n)]


def test_orchestrators_spelling_the_shards_differently_agree(shards):
    from services.orchestrator.backends import SemanticBackend

    a, b = (s.handle.address for s in shards)
    one = SemanticBackend(f"{a},{b}", "", 5.0)
    other = SemanticBackend(f" ipv4:{b}, dns:///{a} ", "", 5.0)
    # The prefix tier's fingerprint, over the semantic addresses as placement sees them.
    assert one.shard_list == other.shard_list == common_pb2.ShardList(
        shards=2, fingerprint=shard_fingerprint([a, b]))
    for ns in _namespaces(12):
        one.store(pb.StoreRequest(namespace=ns, prompt="q", answer="a"))
        assert other.lookup(pb.LookupRequest(namespace=ns, text="q")).hit
    st = other.stats()
    assert (st.shard_list_mismatches_total, st.shard_list_mismatch) == (0, "")
    assert all(d.healthy for d in other.dependencies())


def test_an_orchestrator_missing_a_shard_is_reported_while_calls_answer(shards, capsys,
                                                                      monkeypatch):
    """Orchestrator X lists shard A only, Y lists A and B: X stores every namespace on A, Y
    looks those it places on B up there and misses. Every call answers; A, called with both
    lists, counts Y's calls, and both orchestrators' Stats (`tiercache stats`) mark A's line
    unhealthy naming both lists."""
    from services.orchestrator.backends import SemanticBackend
    from tests.orchestrator.stats_view import stats_via_cli

    a, b = (s.handle.address for s in shards)
    x = SemanticBackend(a, "", 5.0)
    y = SemanticBackend(f"{a},{b}", "", 5.0)
    namespaces = _namespaces(12)
    for ns in namespaces:
        x.store(pb.StoreRequest(namespace=ns, prompt="q", answer="a"))
    on_a = [y.shard_for(ns) == a for ns in namespaces]
    assert 0 < sum(on_a) < len(namespaces)
    before = _mismatches()
    found = [y.lookup(pb.LookupRequest(namespace=ns, text="q")).hit for ns in namespaces]
    assert found == on_a  # never refused: found on A, missed on B
    assert _mismatches() == before + sum(on_a)  # B saw only Y's list

    s = y.stats()
    assert s.shard_list_mismatches_total == sum(on_a)
    assert s.shard_list_mismatch.startswith(
        f"{a}: {DIFFERS}: a call came with 1 shard ({x.shard_list.fingerprint}) from "), (
        s.shard_list_mismatch)
    assert f", a Lookup with 2 shards ({y.shard_list.fingerprint}) from " in (
        s.shard_list_mismatch)
    lines = {(d.name, d.address): d for d in y.dependencies()}
    assert not lines[("semantic shard", a)].healthy
    assert lines[("semantic shard", a)].last_error.startswith(DIFFERS)
    assert lines[("semantic shard", b)].healthy  # it saw one list only
    tier = lines[("semantic", f"{a},{b}")]
    assert not tier.healthy and tier.last_error == f"1 of 2 shards unhealthy: {a}"

    s = x.stats()  # X's one shard is A: its line says the same, without an address
    assert s.shard_list_mismatch.startswith(f"{DIFFERS}: a call came with 1 shard")
    [line] = x.dependencies()
    assert not line.healthy and line.last_error == s.shard_list_mismatch

    shown, err = stats_via_cli(capsys, monkeypatch, x)
    note = shown["semantic"]["shardListMismatch"]
    assert note.startswith(DIFFERS)
    assert shown["semantic"]["shardListMismatchesTotal"] == str(sum(on_a))
    assert [d["lastError"] for d in shown["dependencies"]] == [note]
    assert err == f"semantic: {note}; {MISMATCH_FIX['semantic']}\n"
