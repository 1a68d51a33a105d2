"""The index over a real gRPC channel (in-process server on port 0), through the client."""

from __future__ import annotations

import grpc
import pytest
from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

from services.common.grpc_client import call_metadata, make_channel
from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient, PrefixIndexError
from services.prefix.config import PrefixConfig
from services.prefix.server import serve
from tests.metric_sample import sample_value

BS = 16
MODEL = "tiny"
TOKEN = "s3cret"


@pytest.fixture
def server():
    svc = serve(PrefixConfig(address="127.0.0.1:0", internal_token=TOKEN, block_size=BS))
    yield svc
    svc.stop(0)


@pytest.fixture
def client(server):
    c = PrefixIndexClient([server.address], TOKEN, timeout=5)
    yield c
    c.close()


def chain(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n * BS)]


def stored_pb(tokens: list[int], start: int = 0, end: int | None = None, salt: str = ""):
    hs = BlockHasher(MODEL, BS).hashes(tokens, salt)
    end = len(hs) if end is None else end
    return prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
        parent_hash=hs[start - 1] if start else b"", block_hashes=hs[start:end],
        token_ids=tokens[start * BS : end * BS], cache_salt=salt, first_block_hash=hs[0],
        start_block=start))


def test_register_publish_match_top_stats(client):
    out = client.register("r0", "inc1", "127.0.0.1:7000", MODEL, BS, 64)
    assert out.lease_seconds == 10.0 and out.next_seq == {client.addresses[0]: 1}
    client.register("r1", "inc1", "127.0.0.1:7001", MODEL, BS, 64)
    toks = chain(4)
    assert client.publish_events("r0", "inc1", [stored_pb(toks)]).resync is False
    assert client.publish_events("r1", "inc1", [stored_pb(toks, end=2)]).sent == {
        client.addresses[0]: 1}
    load = prefix_pb2.ReplicaLoad(running=2, waiting=1, free_blocks=5, total_blocks=64)
    assert client.heartbeat("r1", "inc1", load).known
    r = client.match(MODEL, token_ids=toks + [5, 6, 7])
    assert [(m.replica_id, m.matched_blocks, m.matched_tokens) for m in r.matches] == [
        ("r0", 4, 64), ("r1", 2, 32)]
    assert r.matches[1].load.running == 2 and r.request_blocks == 4 and r.block_size == BS
    hashes = BlockHasher(MODEL, BS).hashes(toks)
    r = client.match(MODEL, block_hashes=hashes[:3])
    assert [(m.replica_id, m.matched_blocks) for m in r.matches] == [("r0", 3), ("r1", 2)]
    top = client.top_prefixes(5).prefixes
    assert [(list(p.token_ids), p.hits, list(p.holders)) for p in top] == [
        (toks, 1, ["r0"]), (toks[: 3 * BS], 1, ["r0"])]
    s = client.stats()
    assert (s.nodes, s.matches_total, s.matches_hit, s.block_size) == (4, 2, 2, BS)
    assert [(x.replica_id, x.held_blocks) for x in s.replicas] == [("r0", 4), ("r1", 2)]
    assert [x.capacity_blocks for x in s.replicas] == [64, 64]  # as registered (was dropped)


def test_gap_resync_over_grpc(server):
    ch = make_channel(server.address)
    stub = prefix_pb2_grpc.PrefixIndexStub(ch)
    md = call_metadata(TOKEN)
    stub.Register(prefix_pb2.RegisterRequest(replica_id="r", incarnation="i", address="x:1",
                                             model_id=MODEL, block_size=BS), metadata=md)
    r = stub.PublishEvents(prefix_pb2.PublishEventsRequest(
        replica_id="r", incarnation="i", seq=2, events=[stored_pb(chain(1))]), metadata=md)
    assert (r.status, r.next_seq) == (prefix_pb2.PUBLISH_STATUS_RESYNC, 1)
    r = stub.PublishEvents(prefix_pb2.PublishEventsRequest(
        replica_id="r", incarnation="i", seq=5, events=[stored_pb(chain(2))], resync=True),
        metadata=md)
    assert (r.status, r.next_seq) == (prefix_pb2.PUBLISH_STATUS_OK, 6)
    s = stub.Stats(prefix_pb2.PrefixStatsRequest(), metadata=md)
    assert (s.nodes, s.resyncs_total) == (2, 1)
    ch.close()


def _snapshot(client):
    s = client.stats()
    return (s.nodes, [(r.replica_id, r.incarnation, r.held_blocks) for r in s.replicas],
            s.dropped_blocks_total)


def test_bad_input_gets_a_clear_status_and_changes_nothing(server, client):
    client.register("r", "i", "x:1", MODEL, BS)
    client.publish_events("r", "i", [stored_pb(chain(2))])
    ch = make_channel(server.address)
    stub = prefix_pb2_grpc.PrefixIndexStub(ch)
    md = call_metadata(TOKEN)
    before = _snapshot(client)
    good = stored_pb(chain(3), start=2)
    short = prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
        block_hashes=[b"x" * 16], token_ids=[1, 2]))
    pub = prefix_pb2.PublishEventsRequest
    cases = [
        ("Match", prefix_pb2.MatchRequest(model_id=MODEL), grpc.StatusCode.INVALID_ARGUMENT,
         "token_ids: empty"),
        ("Match", prefix_pb2.MatchRequest(model_id=MODEL, block_hashes=[b"abc"]),
         grpc.StatusCode.INVALID_ARGUMENT, "block_hashes[0]"),
        ("Match", prefix_pb2.MatchRequest(token_ids=[1] * BS), grpc.StatusCode.INVALID_ARGUMENT,
         "model_id"),
        ("Match", prefix_pb2.MatchRequest(model_id=MODEL, token_ids=[1] * (65536 * BS + BS)),
         grpc.StatusCode.INVALID_ARGUMENT, "token_ids: more than"),
        ("PublishEvents", pub(replica_id="ghost", incarnation="i", seq=2, events=[good]),
         grpc.StatusCode.NOT_FOUND, "replica_id"),
        ("PublishEvents", pub(replica_id="r", incarnation="old", seq=2, events=[good]),
         grpc.StatusCode.NOT_FOUND, "incarnation"),
        ("PublishEvents", pub(replica_id="r", incarnation="i", seq=2, events=[good, short]),
         grpc.StatusCode.INVALID_ARGUMENT, "events[1].stored.token_ids"),
        ("PublishEvents", pub(replica_id="r", incarnation="i", seq=2,
                              events=[good, prefix_pb2.KvEvent()]),
         grpc.StatusCode.INVALID_ARGUMENT, "events[1]"),
        ("PublishEvents", pub(replica_id="r", incarnation="i", seq=2, events=[good] * 65537),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "events"),
        ("Register", prefix_pb2.RegisterRequest(replica_id="q", incarnation="i", address="y:1",
                                                model_id=MODEL, block_size=32),
         grpc.StatusCode.FAILED_PRECONDITION, "block_size"),
        ("Register", prefix_pb2.RegisterRequest(replica_id="q", incarnation="i",
                                                model_id=MODEL, block_size=BS),
         grpc.StatusCode.INVALID_ARGUMENT, "address"),
        ("TopPrefixes", prefix_pb2.TopPrefixesRequest(k=0), grpc.StatusCode.INVALID_ARGUMENT,
         "k:"),
    ]
    for method, req, code, text in cases:
        with pytest.raises(grpc.RpcError) as ei:
            getattr(stub, method)(req, metadata=md, timeout=20)
        assert ei.value.code() == code, (method, text, ei.value.details())
        assert text in ei.value.details() and "Traceback" not in ei.value.details()
        assert _snapshot(client) == before, text
    # The batch was not consumed: its number is still the next one.
    r = stub.PublishEvents(pub(replica_id="r", incarnation="i", seq=2, events=[good]),
                           metadata=md)
    assert r.status == prefix_pb2.PUBLISH_STATUS_OK
    assert _snapshot(client)[0] == 3
    ch.close()


def test_register_with_a_foreign_hash_key_is_refused(server):
    c = PrefixIndexClient([server.address], TOKEN, timeout=5, hash_key=b"not-the-cluster-key")
    with pytest.raises(PrefixIndexError) as ei:
        c.register("r", "i", "x:1", MODEL, BS)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "hash_probe" in ei.value.details()
    c.close()


def test_internal_credential_is_required(server):
    c = PrefixIndexClient([server.address], "wrong", timeout=5)
    with pytest.raises(PrefixIndexError) as ei:
        c.stats()
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert isinstance(ei.value, grpc.RpcError) and ei.value.address == server.address
    c.close()


def test_client_errors_name_the_shard_and_have_deadlines():
    c = PrefixIndexClient(["127.0.0.1:1"], timeout=0.5)
    with pytest.raises(PrefixIndexError) as ei:
        c.match(MODEL, token_ids=[1] * BS)
    assert ei.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "127.0.0.1:1" in str(ei.value) and ei.value.method == "Match"
    with pytest.raises(ValueError, match="addresses"):
        PrefixIndexClient([])
    c.close()


def test_events_metric_counts_applied_batches_only(server):
    """A retried batch (a timed-out call sent again) changes nothing, but was counted as
    applied events."""

    def applied() -> float:
        return sample_value("tiercache_prefix_events_total",
                                         {"kind": "stored"}) or 0.0

    ch = make_channel(server.address)
    stub = prefix_pb2_grpc.PrefixIndexStub(ch)
    md = call_metadata(TOKEN)
    try:
        stub.Register(prefix_pb2.RegisterRequest(
            replica_id="r0", incarnation="i", address="127.0.0.1:7000", model_id=MODEL,
            block_size=BS, capacity_blocks=64), metadata=md, timeout=5)
        batch = prefix_pb2.PublishEventsRequest(replica_id="r0", incarnation="i", seq=1,
                                                events=[stored_pb(chain(2))])
        start = applied()
        stub.PublishEvents(batch, metadata=md, timeout=5)
        assert applied() == start + 1
        for _ in range(3):  # retries of the applied batch
            r = stub.PublishEvents(batch, metadata=md, timeout=5)
            assert r.status == prefix_pb2.PUBLISH_STATUS_OK and r.next_seq == 2
        assert applied() == start + 1
    finally:
        ch.close()


def test_top_prefixes_filters_by_cache_salt_over_grpc(client):
    client.register("r0", "inc1", "127.0.0.1:7000", MODEL, BS, 64)
    client.publish_events("r0", "inc1", [stored_pb(chain(2), salt="s1"),
                                          stored_pb(chain(2, base=500), salt="s2")])
    client.match(MODEL, token_ids=chain(2), cache_salt="s1")
    client.match(MODEL, token_ids=chain(2, base=500), cache_salt="s2")
    assert {p.cache_salt for p in client.top_prefixes(5, MODEL).prefixes} == {"s1", "s2"}
    only = client.top_prefixes(5, MODEL, cache_salt="s2").prefixes
    assert [p.cache_salt for p in only] == ["s2"]
    assert list(client.top_prefixes(5, MODEL, cache_salt="").prefixes) == []  # unsalted only
