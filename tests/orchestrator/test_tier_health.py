"""A sharded cache tier's own health line, derived from its shards' lines."""

from tiercache.v1 import common_pb2

from tests.metric_sample import sample_value


def shard(address: str, healthy: bool, err: str = "") -> common_pb2.DependencyHealth:
    return common_pb2.DependencyHealth(name="prefix shard", address=address, healthy=healthy,
                                       last_error=err)


def test_healthy_only_when_every_shard_is():
    from services.orchestrator.backends import tier_health

    t = tier_health("prefix", "a:1,b:1", [shard("a:1", True), shard("b:1", True)])
    assert (t.name, t.address, t.healthy, t.last_error) == ("prefix", "a:1,b:1", True, "")


def test_names_the_shards_that_are_not_whichever_answered_last():
    from services.orchestrator.backends import tier_health

    one = tier_health("semantic", "a:1,b:1,c:1", [shard("a:1", False, "UNAVAILABLE: refused"),
                                                 shard("b:1", True), shard("c:1", True)])
    assert not one.healthy
    assert one.last_error == "1 of 3 shards unhealthy: a:1"
    both = tier_health("semantic", "a:1,b:1,c:1", [shard("a:1", False), shard("b:1", True),
                                                  shard("c:1", False, "no call yet")])
    assert not both.healthy and both.last_error == "2 of 3 shards unhealthy: a:1, c:1"


def test_prefix_backend_derives_its_tier_line_only_with_shards():
    """One shard: the tier's own call record, as before. Several: derived from the shards'
    records, though the tier's record says its last call (to the live shard) worked."""
    from services.orchestrator.prefix_backend import PrefixBackend

    single = PrefixBackend(("a:1",), "", 1.0, 16)
    single.health.ok()
    assert [(d.name, d.healthy) for d in single.dependencies()] == [("prefix", True)]

    pb = PrefixBackend(("a:1", "b:1"), "", 1.0, 16)
    pb.client.shard_errors.update({"a:1": "UNAVAILABLE: connection refused", "b:1": ""})
    pb.health.ok()  # b answered last
    tier, *lines = pb.dependencies()
    assert (tier.name, tier.healthy) == ("prefix", False)
    assert tier.last_error == "1 of 2 shards unhealthy: a:1"
    assert [(d.address, d.healthy) for d in lines] == [("a:1", False), ("b:1", True)]
    pb.client.shard_errors["a:1"] = ""
    assert pb.dependencies()[0].healthy
    single.client.close()
    pb.client.close()



def test_a_semantic_shard_never_called_says_so_as_prefix_shards_do():
    # The tier line said "1 of 2 shards unhealthy: ..., their errors are on their lines",
    # and the shard's line had no error at all.
    from services.orchestrator.backends import SemanticBackend

    be = SemanticBackend("127.0.0.1:1,127.0.0.1:2", "", 1.0)
    lines = be.dependencies()
    assert [(d.name, d.healthy, d.last_error) for d in lines[1:]] == [
        ("semantic shard", False, "no call yet")] * 2
    assert lines[0].last_error == "2 of 2 shards unhealthy: 127.0.0.1:1, 127.0.0.1:2"


def test_a_dependencys_health_is_a_metric_and_its_recovery_is_logged(caplog):
    """An operator saw a replica and the semantic tier go unhealthy in Stats and a WARNING,
    and nothing in /metrics; recovery was in Stats alone."""
    import logging

    from services.orchestrator.backends import Health

    def value():
        return sample_value("tiercache_orchestrator_dependency_healthy",
                                         {"dependency": "kvpool", "address": "h:9"})

    h = Health("kvpool", "h:9")
    assert value() is None  # no call yet: no series to alert on
    h.ok()
    assert value() == 1.0
    h.name = "kvpool/kvpool-0"  # renamed by its first Stats: the same series
    with caplog.at_level(logging.INFO, logger="services.orchestrator.backends"):
        h.fail("Deadline Exceeded")
        assert value() == 0.0
        h.ok()
    assert value() == 1.0
    assert "kvpool/kvpool-0 at h:9 is healthy again" in caplog.text


def test_a_sharded_tier_exports_each_shard_not_a_flapping_tier_record(caplog):
    """Every shard's call set the one tier-wide record: with one of two shards down, the tier's
    gauge went 1, 0, 1, 0 with the traffic mix, and "healthy again" and "unhealthy" alternated
    in the log."""
    import logging

    import grpc
    from tiercache.v1 import semantic_pb2

    from services.orchestrator.backends import SemanticBackend
    from tests.orchestrator.test_semantic_errors import Refusal

    class Stub:
        def __init__(self, ok):
            self.ok = ok

        def Lookup(self, req, **kw):  # noqa: N802 - the gRPC method's name
            if self.ok:
                return semantic_pb2.LookupResponse()
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused")

    def value(dependency, address):
        return sample_value("tiercache_orchestrator_dependency_healthy",
                                         {"dependency": dependency, "address": address})

    up, down = "127.0.0.7:1", "127.0.0.7:2"
    b = SemanticBackend(f"{up},{down}", "", 1.0)
    b.stubs[up], b.stubs[down] = Stub(True), Stub(False)
    with caplog.at_level(logging.INFO, logger="services.orchestrator.backends"):
        for i in range(6):
            try:
                b._call(b.addresses[i % 2], "Lookup", semantic_pb2.LookupRequest())
            except grpc.RpcError:
                pass
    assert value("semantic", f"{up},{down}") is None  # no tier-wide series
    assert (value("semantic shard", up), value("semantic shard", down)) == (1.0, 0.0)
    assert caplog.text.count("unhealthy") <= 1 and "is healthy" not in caplog.text  # nor "again"


def test_a_sharded_prefix_index_exports_each_shard_as_a_gauge(caplog):
    """The semantic tier's shards were gauges and a sharded prefix index's were not: a prefix
    shard down showed in Stats alone (a known gap until then)."""
    import logging

    import grpc
    from tiercache.v1 import prefix_pb2

    from services.orchestrator.prefix_backend import PrefixBackend
    from tests.orchestrator.test_semantic_errors import Refusal

    class Done:
        def __init__(self, ok):
            self.ok = ok

        def result(self):
            if self.ok:
                return prefix_pb2.PrefixStatsResponse(nodes=3, block_size=16)
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused")

    class Stats:
        def __init__(self, ok):
            self.ok = ok

        def future(self, req, timeout=None, metadata=None):
            return Done(self.ok)

    def value(address):
        return sample_value("tiercache_orchestrator_dependency_healthy",
                                         {"dependency": "prefix shard", "address": address})

    up, down = "127.0.0.8:1", "127.0.0.8:2"
    pb = PrefixBackend((up, down), "", 1.0, 16)
    assert (value(up), value(down)) == (None, None)  # no call yet
    pb.client._shards[up].stub = type("S", (), {"Stats": Stats(True)})()
    pb.client._shards[down].stub = type("S", (), {"Stats": Stats(False)})()
    with caplog.at_level(logging.INFO, logger="services.orchestrator.backends"):
        assert pb.stats().nodes == 3  # partial: the live shard's
        assert (value(up), value(down)) == (1.0, 0.0)
        pb.client._shards[down].stub = type("S", (), {"Stats": Stats(True)})()
        pb.stats()
    assert value(down) == 1.0
    # Never healthy before its refusal ("not healthy yet"): now healthy, not "again".
    assert f"prefix shard at {down} is healthy\n" in caplog.text
    assert sample_value("tiercache_orchestrator_dependency_healthy",
                                     {"dependency": "prefix", "address": f"{up},{down}"}) is None


def test_an_idle_semantic_tier_is_polled_so_its_gauge_follows_it():
    """A metrics review: the gauge was set only by requests' calls, so after a recovery it
    stayed 0 for as long as no request came (an alert firing on a healthy tier), and it was
    absent until the first request (a tier down from the start never read 0)."""
    import grpc
    import pytest
    from tiercache.v1 import semantic_pb2

    from services.orchestrator.backends import SemanticBackend
    from tests.orchestrator.test_semantic_errors import Refusal
    from tests.waits import holds_within

    class Stub:
        ok, calls, floor = False, 0, 0.85

        def Stats(self, req, **kw):  # noqa: N802 - the gRPC method's name
            self.calls += 1
            if self.ok:
                return semantic_pb2.SemanticStatsResponse(shard_list_mismatch="",
                                                          threshold_floor=self.floor)
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused")

    def value():
        return sample_value("tiercache_orchestrator_dependency_healthy",
                                         {"dependency": "semantic", "address": "127.0.0.9:5"})

    b = SemanticBackend("127.0.0.9:5", "", 1.0)
    b.stubs["127.0.0.9:5"] = stub = Stub()
    assert value() is None
    b.poll_once(every=60)  # down from the start: 0, not absent
    assert value() == 0.0
    stub.ok = True
    b.poll_once(every=60)  # back, with no request: 1
    assert value() == 1.0 and stub.calls == 2
    assert b.threshold_floor() == 0.85  # said by its Stats: requests are checked against it
    stub.floor = 0.80  # restarted with another floor, busy: asked all the same
    b.poll_once(every=60)
    assert stub.calls == 3 and b.threshold_floor() == pytest.approx(0.80)
    stop = b.start(every=0.05)  # the background loop does the same
    stub.ok = False
    b.shard_health["127.0.0.9:5"].last_ok = 0.0
    holds_within(lambda: value() == 0.0, 5)
    b.stop()
    assert value() == 0.0 and stop.is_set()
