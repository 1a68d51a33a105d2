"""Rules of the orchestrator's prefix index wrapper (services/orchestrator/prefix_backend.py)
that the mutation audit found unguarded: the match map holds only replicas that matched, one
index is one health record (no per-shard series), a shard never called is not healthy, and
Stats waits at most the index's own timeout; and those its differential review
(test_prefix_backend_differential.py) found broken: a caller's bad request leaves one index
healthy, and the health names the shards as the client dials them (padding, blank entries)."""

from __future__ import annotations

import pytest
from tiercache.v1 import prefix_pb2

from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient
from services.orchestrator.prefix_backend import PrefixBackend
from services.prefix.config import PrefixConfig
from services.prefix.server import serve
from tests.metric_sample import sample_value

BS = 16
MODEL = "tiny"


@pytest.fixture
def index():
    svc = serve(PrefixConfig(address="127.0.0.1:0", block_size=BS, metrics_port=-1))
    yield svc
    svc.stop(0)


def _healthy(dependency: str, address: str) -> float | None:
    return sample_value("tiercache_orchestrator_dependency_healthy",
                                     {"dependency": dependency, "address": address})


def test_a_match_maps_only_replicas_that_matched_and_one_index_is_one_record(index):
    """The index lists every live replica of the model, those with 0 blocks too: routing gets
    only those that matched (an empty map = the prompt is new to every replica, placed by
    free blocks). A single index's health is the tier's record, not a "prefix shard" one."""
    kv = PrefixIndexClient([index.address], block_size=BS, timeout=5)
    try:
        for rid in ("r0", "r1"):
            kv.register(rid, "i", f"127.0.0.1:{7000 + int(rid[1])}", MODEL, BS, 64)
        toks = list(range(3 * BS))
        hs = BlockHasher(MODEL, BS).hashes(toks)
        kv.publish_events("r0", "i", [prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
            block_hashes=hs, token_ids=toks, first_block_hash=hs[0]))])
    finally:
        kv.close()
    pb = PrefixBackend((index.address,), "", 5.0, BS)
    try:
        assert pb.match(hs[:2], MODEL) == {"r0": 2 * BS}
        assert pb.match(BlockHasher(MODEL, BS).hashes([7] * (2 * BS)), MODEL) == {}
        assert _healthy("prefix", index.address) == 1.0
        assert _healthy("prefix shard", index.address) is None
    finally:
        pb.client.close()


def test_a_shard_never_called_is_not_healthy():
    """Before its first call a shard's line says "no call yet", unhealthy (as the tier's)."""
    pb = PrefixBackend(("127.0.0.9:1", "127.0.0.9:2"), "", 1.0, BS)
    try:
        tier, *shards = pb.dependencies()
        assert [(d.address, d.healthy, d.last_error) for d in shards] == [
            ("127.0.0.9:1", False, "no call yet"), ("127.0.0.9:2", False, "no call yet")]
        assert not tier.healthy
    finally:
        pb.client.close()


def test_stats_waits_at_most_the_index_timeout():
    """`stats(timeout)`: the caller's deadline when shorter, else the index's own timeout;
    no timeout given: the client's default (its own timeout)."""
    pb = PrefixBackend(("127.0.0.9:1",), "", 0.5, BS)
    seen: list[float | None] = []

    def stats(**kw):
        seen.append(kw.get("timeout"))
        return prefix_pb2.PrefixStatsResponse()

    pb.client.stats = stats
    try:
        pb.stats(timeout=10.0)
        pb.stats(timeout=0.2)
        pb.stats()
        assert seen == [0.5, 0.2, None]
    finally:
        pb.client.close()


def test_a_callers_bad_request_leaves_one_index_healthy(index):
    """A Match with a malformed block hash or a TopPrefixes with k = 0 is the caller's fault,
    INVALID_ARGUMENT, not the index's: one index's record (its Stats line and gauge) stays as
    it was, as a shard's does in a sharded tier (`PrefixIndexClient._outcome`). It read
    unhealthy, its gauge 0 (a "dependency down" alert), on a healthy index."""
    import grpc

    pb = PrefixBackend((index.address,), "", 5.0, BS)
    good = BlockHasher(MODEL, BS).hashes(list(range(2 * BS)))
    try:
        assert pb.match(good, MODEL) == {}
        for bad in (lambda: pb.match([good[0], b"y" * 15], MODEL),
                    lambda: pb.top_prefixes(0, MODEL)):
            with pytest.raises(grpc.RpcError) as e:
                bad()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            [line] = pb.dependencies()
            assert (line.healthy, line.last_error) == (True, "")
            assert _healthy("prefix", index.address) == 1.0
    finally:
        pb.client.close()


def test_padded_and_blank_addresses_are_the_shards_the_client_dials(index):
    """The settings' check lets a blank entry (a trailing comma) and padding through, and the
    client strips and skips them: so does the health. One index listed as "a, " is one
    index (its "prefix" gauge, no "prefix shard" one; it was exported as a shard and its own
    gauge never set), and a padded shard's gauge is set under the address the client names
    (" a:1"'s never was: no alert could fire on it)."""
    from services.orchestrator.backends import DEPENDENCY_HEALTHY

    dead = "127.0.0.7:1"
    for dep, a in (("prefix", index.address), ("prefix shard", index.address),
                   ("prefix shard", dead)):
        try:
            DEPENDENCY_HEALTHY.remove(dep, a)
        except KeyError:
            pass
    one = PrefixBackend((f" {index.address} ", ""), "", 5.0, BS)
    try:
        one.stats()
        [line] = one.dependencies()
        assert (line.address, line.healthy) == (index.address, True)
        assert _healthy("prefix", index.address) == 1.0
        assert _healthy("prefix shard", index.address) is None
    finally:
        one.client.close()
    two = PrefixBackend((f" {dead}", index.address, " "), "", 5.0, BS)
    try:
        assert two.stats().shards_answered == 1
        tier, *shards = two.dependencies()
        assert tier.address == f"{dead},{index.address}"
        assert [(d.address, d.healthy) for d in shards] == [(dead, False), (index.address, True)]
        assert (_healthy("prefix shard", dead), _healthy("prefix shard", index.address)) == (
            0.0, 1.0)
    finally:
        two.client.close()


def test_a_timed_out_index_says_how_long_nobody_answered():
    """A SIGSTOPped index read "Deadline Exceeded" in Stats (and in the "is unhealthy" line):
    gRPC's words, naming neither whose deadline nor that the index had not answered."""
    import grpc

    from tests.orchestrator.test_pipeline_paths import RpcError

    pb = PrefixBackend(("127.0.0.9:1",), "", 0.5, BS)

    def match(*args, **kw):
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

    pb.client.match = match
    try:
        with pytest.raises(grpc.RpcError):
            pb.match([b"\0" * 16], MODEL)  # the index's whole 0.5 s
        [line] = pb.dependencies()
        assert (line.healthy, line.last_error) == (False, "no answer within 0.5s (timed out)")
    finally:
        pb.client.close()


def test_an_index_that_answers_stats_is_no_longer_skipped_as_hung():
    """After a SIGSTOPped index was continued, the orchestrator's Stats found it answering
    (logged "healthy again", gauge 1) while every Match still skipped it as hung for the rest
    of the back-off: ring routing, and "prefix index unreachable" lines, under a healthy
    index."""
    import grpc

    from tests.orchestrator.test_pipeline_paths import RpcError

    pb = PrefixBackend(("127.0.0.9:1",), "", 0.5, BS)
    calls: list[str] = []

    def hangs(*args, **kw):
        calls.append("match")
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

    def stats(answered=None, **kw):
        answered.add("127.0.0.9:1")
        return prefix_pb2.PrefixStatsResponse(shards_total=1, shards_answered=1)

    pb.client.match = hangs
    pb.client.stats = stats
    try:
        with pytest.raises(grpc.RpcError):
            pb.match([b"\0" * 16], MODEL)  # its whole timeout: hung, skipped a while
        with pytest.raises(grpc.RpcError) as skipped:
            pb.match([b"\0" * 16], MODEL)
        assert "skipped" in skipped.value.details() and calls == ["match"]
        pb.stats()
        assert pb.dependencies()[0].healthy
        pb.client.match = lambda *a, **kw: prefix_pb2.MatchResponse()
        assert pb.match([b"\0" * 16], MODEL) == {}  # asked, not skipped
    finally:
        pb.client.close()


def test_a_partial_stats_ends_the_back_off_of_the_shards_that_answered():
    """With one shard down, a Stats the other shards answered ended none of their hung
    back-offs (only a Stats every shard answered did): a shard answering Stats kept its
    Matches skipped up to 5 s. The shards that answered are no longer hung; the one that
    did not stays skipped."""
    import grpc

    from tests.orchestrator.test_pipeline_paths import RpcError

    a, b = "127.0.0.9:1", "127.0.0.9:2"
    pb = PrefixBackend((a, b), "", 0.5, BS)
    for shard in (a, b):  # both ran out a Match's whole timeout: both skipped
        with pytest.raises(grpc.RpcError):
            pb.hung.call(shard, 0.5, 0.5, lambda: (_ for _ in ()).throw(
                RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)))

    def stats(answered=None, **kw):
        answered.add(a)  # b did not answer
        return prefix_pb2.PrefixStatsResponse(shards_total=2, shards_answered=1)

    pb.client.stats = stats
    try:
        pb.stats()
        assert pb.hung.call(a, 0.5, 0.5, lambda: "asked") == "asked"
        with pytest.raises(grpc.RpcError) as skipped:
            pb.hung.call(b, 0.5, 0.5, lambda: "asked")
        assert "skipped" in skipped.value.details()
    finally:
        pb.client.close()


def test_a_poll_finds_the_index_down_and_back_with_no_request(index):
    """The index's health was set by calls only: back after an outage, its gauge stayed 0 for
    as long as no request came (with the background warm-up off, for good: a dependency alert
    firing on a healthy idle stack), and one gone down while idle read healthy. The poller
    (Stats, as the semantic tier's) finds both without a Match."""
    import grpc

    pb = PrefixBackend((index.address,), "", 0.5, BS)
    real = pb.client.stats
    try:
        pb.poll_once(every=0.5)
        assert pb.health.healthy and _healthy("prefix", index.address) == 1.0

        class Down(grpc.RpcError):
            def code(self):
                return grpc.StatusCode.UNAVAILABLE

            def details(self):
                return "failed to connect to all addresses"

        def down(**kw):
            raise Down()

        pb.client.stats = down
        pb.poll_once(every=0.5)
        assert not pb.health.healthy and _healthy("prefix", index.address) == 0.0
        pb.client.stats = real
        pb.poll_once(every=0.5)
        assert pb.health.healthy and _healthy("prefix", index.address) == 1.0
        stop = pb.start(every=0.05)
        assert not stop.is_set()
        pb.stop()
        assert stop.is_set()
    finally:
        pb.stop()
        pb.client.close()
