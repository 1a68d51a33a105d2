"""Rules of the prefix index's gRPC adapter (services/prefix/server.py) that the mutation
audit found unguarded: what its metrics count (docs/metrics.md; a probe Match counts nowhere,
as prefix.proto says), an AllCleared event applied, and `metrics_port = 0` served."""

from __future__ import annotations

import urllib.request

import pytest
from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

from services.common.grpc_client import call_metadata, make_channel
from services.common.hashing import BlockHasher
from services.prefix.config import PrefixConfig
from services.prefix.server import serve
from tests.metric_sample import sample_value

BS = 16
MODEL = "tiny"
MD = call_metadata("")


@pytest.fixture
def stub():
    svc = serve(PrefixConfig(address="127.0.0.1:0", block_size=BS, metrics_port=-1))
    ch = make_channel(svc.address)
    try:
        yield prefix_pb2_grpc.PrefixIndexStub(ch)
    finally:
        ch.close()
        svc.stop(0)


def _value(name: str, **labels: str) -> float:
    return sample_value(name, labels) or 0.0


def _register_and_store(stub, tokens: list[int], rid: str = "r0") -> None:
    stub.Register(prefix_pb2.RegisterRequest(
        replica_id=rid, incarnation="i", address="127.0.0.1:7000", model_id=MODEL,
        block_size=BS, capacity_blocks=64), metadata=MD, timeout=5)
    hs = BlockHasher(MODEL, BS).hashes(tokens)
    r = stub.PublishEvents(prefix_pb2.PublishEventsRequest(
        replica_id=rid, incarnation="i", seq=1, events=[prefix_pb2.KvEvent(
            stored=prefix_pb2.BlocksStored(block_hashes=hs, token_ids=tokens,
                                           first_block_hash=hs[0]))]), metadata=MD, timeout=5)
    assert r.status == prefix_pb2.PUBLISH_STATUS_OK


def _counts() -> tuple[float, ...]:
    return (_value("tiercache_prefix_matches_total", result="hit"),
            _value("tiercache_prefix_matches_total", result="miss"),
            _value("tiercache_prefix_match_blocks_total", result="asked"),
            _value("tiercache_prefix_match_blocks_total", result="hit"))


def test_match_metrics_count_hits_misses_and_blocks_but_no_probe(stub):
    """A hit is counted under result=hit with its matched blocks, a miss under result=miss,
    the blocks asked about under asked; a probe Match (routing, not traffic) counts nowhere."""
    toks = list(range(3 * BS))
    _register_and_store(stub, toks)
    before = _counts()
    stub.Match(prefix_pb2.MatchRequest(model_id=MODEL, token_ids=toks[: 2 * BS]),
               metadata=MD, timeout=5)
    stub.Match(prefix_pb2.MatchRequest(model_id=MODEL, token_ids=[9999] * (4 * BS)),
               metadata=MD, timeout=5)
    after = _counts()
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 6, 2]
    r = stub.Match(prefix_pb2.MatchRequest(model_id=MODEL, token_ids=toks, probe=True),
                   metadata=MD, timeout=5)
    assert r.matches[0].matched_blocks == 3  # answered as any Match
    assert _counts() == after


def test_a_batch_after_a_gap_counts_a_resync(stub):
    """tiercache_prefix_resyncs_total: each resync asked of a replica after a gap."""
    _register_and_store(stub, list(range(BS)))
    before = _value("tiercache_prefix_resyncs_total")
    r = stub.PublishEvents(prefix_pb2.PublishEventsRequest(
        replica_id="r0", incarnation="i", seq=5, events=[]), metadata=MD, timeout=5)
    assert r.status == prefix_pb2.PUBLISH_STATUS_RESYNC
    assert _value("tiercache_prefix_resyncs_total") == before + 1


def test_an_all_cleared_event_drops_the_replicas_blocks(stub):
    """KvEvent.cleared (the replica's pool was emptied) is applied: its blocks match no more
    (the replica is still listed, with 0 blocks, as every live replica of the model is)."""
    toks = list(range(2 * BS))
    _register_and_store(stub, toks)
    r = stub.PublishEvents(prefix_pb2.PublishEventsRequest(
        replica_id="r0", incarnation="i", seq=2,
        events=[prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared())]), metadata=MD, timeout=5)
    assert r.status == prefix_pb2.PUBLISH_STATUS_OK and r.next_seq == 3
    m = stub.Match(prefix_pb2.MatchRequest(model_id=MODEL, token_ids=toks), metadata=MD,
                   timeout=5)
    assert [(x.replica_id, x.matched_blocks) for x in m.matches] == [("r0", 0)]


def test_metrics_port_0_serves_metrics_on_a_free_port():
    """`metrics_port = 0` is any free port (-1 is off): /metrics answers there."""
    svc = serve(PrefixConfig(address="127.0.0.1:0", block_size=BS, metrics_port=0))
    try:
        port = svc.handle.metrics_port
        assert port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"tiercache_prefix_nodes" in r.read()
    finally:
        svc.stop(0)
    off = serve(PrefixConfig(address="127.0.0.1:0", block_size=BS, metrics_port=-1))
    try:
        assert off.handle.metrics_port is None
    finally:
        off.stop(0)



ANNOUNCED = ["kvpool-0.kvpool:50054", "10.0.0.5:50054", "fd00::5:50054", "[fd00::5]:50054",
             "a" * 250 + ":50054", "a" * 251 + ":50054", "kv\u200bpool-0:50054",
             "kvpool 0:50054", "kvpool-0:0", "kvpool-0:65536", "kvpool-0", "http://k:1",
             "dns:///kvpool-0:50054", "a,b:1", "k\u00e9:1", "k:\u0661"]


@pytest.mark.parametrize("address", ANNOUNCED)
def test_register_refuses_exactly_the_addresses_a_replica_refuses_to_announce(stub, address):
    """One rule (`announce_problem`) on both sides: an address a kvpool replica with a prefix
    index takes at start is taken at Register, and one the index would refuse (INVALID_ARGUMENT,
    retried for good while the replica served unindexed) is refused at start instead."""
    import grpc

    from services.common.config import ConfigError, load_config
    from services.kvpool.config import KvPoolConfig
    try:
        load_config(KvPoolConfig, "kvpool", [], environ={
            "TIERCACHE_KVPOOL_PREFIX_ADDRESS": "127.0.0.1:50053",
            "TIERCACHE_KVPOOL_ADVERTISE_ADDRESS": address})
        started = True
    except ConfigError as e:
        assert "TIERCACHE_KVPOOL_ADVERTISE_ADDRESS" in str(e)
        started = False
    try:
        stub.Register(prefix_pb2.RegisterRequest(
            replica_id="r0", incarnation="i", address=address, model_id=MODEL, block_size=BS),
            metadata=MD, timeout=5)
        registered = True
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "address" in e.details()
        registered = False
    assert started == registered


def test_register_names_the_first_bad_field_in_field_order(stub):
    """An empty replica_id is named before a malformed address (the address was checked first,
    before any other field), and a refused Register registers nothing."""
    import grpc

    for rid, address, field in (("", "no-port", "replica_id"), ("r0", "no-port", "address"),
                                ("r0", "127.0.0.1:1", "model_id")):
        with pytest.raises(grpc.RpcError) as e:
            stub.Register(prefix_pb2.RegisterRequest(
                replica_id=rid, incarnation="i", address=address,
                model_id="" if field == "model_id" else MODEL, block_size=BS),
                metadata=MD, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(field + ":"), e.value.details()
    assert list(stub.Stats(prefix_pb2.PrefixStatsRequest(), metadata=MD, timeout=5).replicas) == []


def test_a_resync_at_the_first_batch_back_from_a_lapse_is_counted_and_said_so(caplog):
    """A replica registered back from a lapsed lease (the same incarnation, its batch numbers
    carried on) is asked for a resync at the batch the index expects: counted in
    tiercache_prefix_resyncs_total as Stats' resyncs_total is, and logged as what it is, not
    as a gap (the log said "batch 2 after a gap ... (expects 2)")."""
    import logging

    from services.prefix.server import build_index
    from tests.clock import Clock

    cfg = PrefixConfig(address="127.0.0.1:0", block_size=BS, lease_seconds=1.0, metrics_port=-1)
    index = build_index(cfg)
    index.clock = clock = Clock()
    svc = serve(cfg, index)
    ch = make_channel(svc.address)
    try:
        stub = prefix_pb2_grpc.PrefixIndexStub(ch)
        _register_and_store(stub, list(range(BS)))
        for _ in range(4):  # the lease lapses within 1 s
            # Under half a lease a step, a call each: a longer silence is the index's pause.
            clock.t += 0.375
            stub.Stats(prefix_pb2.PrefixStatsRequest(), metadata=MD, timeout=5)
        assert not stub.Stats(prefix_pb2.PrefixStatsRequest(), metadata=MD,
                              timeout=5).replicas
        r = stub.Register(prefix_pb2.RegisterRequest(
            replica_id="r0", incarnation="i", address="127.0.0.1:7000", model_id=MODEL,
            block_size=BS), metadata=MD, timeout=5)
        assert r.next_seq == 2
        before = _value("tiercache_prefix_resyncs_total")
        caplog.set_level(logging.INFO, logger="services.prefix.server")
        for seq in (2, 5):
            r = stub.PublishEvents(prefix_pb2.PublishEventsRequest(
                replica_id="r0", incarnation="i", seq=seq), metadata=MD, timeout=5)
            assert (r.status, r.next_seq) == (prefix_pb2.PUBLISH_STATUS_RESYNC, 2)
        assert _value("tiercache_prefix_resyncs_total") == before + 2
        assert stub.Stats(prefix_pb2.PrefixStatsRequest(), metadata=MD,
                          timeout=5).resyncs_total == 2
        said = [rec.getMessage() for rec in caplog.records if "asking for a resync" in rec.message]
        assert said == ["replica r0: batch 2 is its first since its lease lapsed; asking for a "
                        "resync (expects 2)",
                        "replica r0: batch 5 after a gap; asking for a resync (expects 2)"]
    finally:
        ch.close()
        svc.stop(0)
