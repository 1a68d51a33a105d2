"""Two real shard processes behind the client-side router."""

from __future__ import annotations

import grpc
import pytest
from tiercache.v1 import prefix_pb2

from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient, PrefixIndexError
from services.launcher import ServiceProcess, free_port

BS = 16
MODEL = "tiny"


@pytest.fixture(scope="module")
def shards():
    env = {"TIERCACHE_PREFIX_METRICS_PORT": "-1", "TIERCACHE_PREFIX_BLOCK_SIZE": str(BS)}
    procs: list[ServiceProcess] = []
    try:  # the first shard is stopped even if the second fails to start
        for _ in range(2):
            procs.append(ServiceProcess("prefix", free_port(), env=env).start())
        for p in procs:
            p.wait(60)
        yield procs
    finally:
        for p in procs:
            p.stop(5)


def ev(tokens: list[int], start: int = 0, end: int | None = None) -> prefix_pb2.KvEvent:
    hs = BlockHasher(MODEL, BS).hashes(tokens)
    end = len(hs) if end is None else end
    return prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
        parent_hash=hs[start - 1] if start else b"", block_hashes=hs[start:end],
        token_ids=tokens[start * BS : end * BS], first_block_hash=hs[0], start_block=start))


@pytest.mark.e2e
def test_orchestrator_stats_name_the_index_shard_down_and_count_those_that_answered(
        shards, capsys, monkeypatch):
    """With one index shard down, the orchestrator's `prefix` health line followed the shard
    that answered last (healthy), and its prefix figures summed the shard that answered
    without saying so. Read through `tiercache stats` (first, while both shards run: it
    stops shard A and starts it again for the tests after it)."""
    import json
    import time

    from clients.python import cli
    from services.orchestrator.backends import SemanticBackend
    from services.orchestrator.prefix_backend import PrefixBackend
    from tests.orchestrator.stats_view import stats_server

    for v in ("TIERCACHE_TOKEN", "TIERCACHE_TLS_CA", "TIERCACHE_TLS_CLIENT_CERT",
              "TIERCACHE_TLS_CLIENT_KEY"):
        monkeypatch.delenv(v, raising=False)
    a, b = (p.address for p in shards)
    pb = PrefixBackend((a, b), "", 2.0, BS)

    def stats(addr: str) -> tuple[dict, dict, str]:
        capsys.readouterr()
        assert cli.main(["--address", addr, "--timeout", "30", "stats"]) == 0
        out = capsys.readouterr()
        s = json.loads(out.out)
        return s, {(d["name"], d["address"]): d for d in s["dependencies"]}, out.err

    try:
        with stats_server(SemanticBackend("", "", 1.0), pb) as addr:
            s, deps, err = stats(addr)  # both up
            assert deps[("prefix", f"{a},{b}")]["healthy"], deps
            assert (s["prefix"]["shardsTotal"], s["prefix"]["shardsAnswered"]) == (2, 2)
            assert err == ""

            shards[0].stop(5)  # shard A down; B answers the Stats round
            s, deps, err = stats(addr)
            assert pb.health.healthy  # the tier's call-by-call record: the last call worked
            tier = deps[("prefix", f"{a},{b}")]
            assert not tier["healthy"]
            assert tier["lastError"] == f"1 of 2 shards unhealthy: {a}"
            assert not deps[("prefix shard", a)]["healthy"]
            assert deps[("prefix shard", b)]["healthy"]
            assert (s["prefix"]["shardsTotal"], s["prefix"]["shardsAnswered"]) == (2, 1)
            assert err == "prefix: 1 of 2 shards answered; its figures leave out the others'\n"

            shards[0].start().wait(60)  # A back: the tier line heals once A answers again
            end = time.monotonic() + 30
            while True:
                s, deps, err = stats(addr)
                if deps[("prefix", f"{a},{b}")]["healthy"] or time.monotonic() > end:
                    break
                time.sleep(0.5)
            assert deps[("prefix", f"{a},{b}")]["healthy"], deps
            assert (s["prefix"]["shardsTotal"], s["prefix"]["shardsAnswered"]) == (2, 2)
            assert err == ""
    finally:
        pb.client.close()
        if shards[0].proc is None or shards[0].proc.poll() is not None:
            shards[0].start().wait(60)


@pytest.mark.e2e
def test_two_shards_route_by_first_block(shards):
    addrs = [p.address for p in shards]
    c = PrefixIndexClient(addrs, timeout=5)
    single = {a: PrefixIndexClient([a], timeout=5) for a in addrs}
    c.register("r0", "i", "127.0.0.1:7000", MODEL, BS, 100)
    c.register("r1", "i", "127.0.0.1:7001", MODEL, BS, 100)
    prompts = [[1000 * p + i for i in range(3 * BS)] for p in range(12)]
    per_shard = dict.fromkeys(addrs, 0)
    for p in prompts:
        # The first two blocks now, a continuation later: both must land on one shard.
        out = c.publish_events("r0", "i", [ev(p, end=2)])
        assert not out.resync and len(out.sent) == 1
        owner = c.shard_for(BlockHasher(MODEL, BS).hashes(p)[0])
        assert list(out.sent) == [owner]
        assert c.publish_events("r0", "i", [ev(p, start=2)]).sent.keys() == {owner}
        per_shard[owner] += 3
    c.publish_events("r1", "i", [ev(prompts[0], end=1)])
    assert all(per_shard.values()), per_shard  # 12 prompts spread over both shards
    assert {a: single[a].stats().nodes for a in addrs} == per_shard
    for i, p in enumerate(prompts):
        r = c.match(MODEL, token_ids=p + [7] * 5)
        want = [("r0", 3), ("r1", 1 if i == 0 else 0)]
        assert [(m.replica_id, m.matched_blocks) for m in r.matches] == want
    # Removals go to every shard; each ignores what it does not know.
    h = BlockHasher(MODEL, BS).hashes(prompts[3])
    assert c.publish_events("r0", "i", [prefix_pb2.KvEvent(
        removed=prefix_pb2.BlocksRemoved(block_hashes=[h[1]]))]).sent.keys() == set(addrs)
    assert c.match(MODEL, block_hashes=h).matches[0].matched_blocks == 1
    top = c.top_prefixes(20).prefixes
    assert len(top) == 12 and all(p.hits == 1 for p in top)
    s = c.stats()
    assert s.nodes == 36 - 2
    assert [(r.replica_id, r.held_blocks) for r in s.replicas] == [("r0", 34), ("r1", 1)]
    assert c.heartbeat("r0", "i").known
    # One shard down: its chains fail clearly, the other shard's keep working.
    down = addrs[1]
    shards[1].stop(5)
    for p in prompts:
        owner = c.shard_for(BlockHasher(MODEL, BS).hashes(p)[0])
        if owner == down:
            with pytest.raises(PrefixIndexError) as ei:
                c.match(MODEL, token_ids=p)
            assert ei.value.address == down
            assert ei.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                       grpc.StatusCode.DEADLINE_EXCEEDED)
        else:
            assert c.match(MODEL, token_ids=p).matches[0].matched_blocks >= 1
    assert len(c.top_prefixes(20, allow_partial=True).prefixes) == per_shard[addrs[0]] // 3
    with pytest.raises(PrefixIndexError):
        c.top_prefixes(20)
    c.close()
    for x in single.values():
        x.close()


def test_shard_health_skips_cut_short_calls_and_records_refusals():
    """The per-shard record took a deadline the caller's own shorter timeout ran into for a
    shard failure, and ignored an UNAUTHENTICATED refusal (a wrong internal token)."""
    import grpc

    from services.common.prefix_client import PrefixIndexClient

    class Err(grpc.RpcError):
        def __init__(self, code):
            self.c = code

        def code(self):
            return self.c

        def details(self):
            return self.c.name.lower()

    codes = {"a:1": grpc.StatusCode.DEADLINE_EXCEEDED, "b:1": grpc.StatusCode.UNAUTHENTICATED}

    class Chan:
        def __init__(self, addr):
            self.addr = addr

        def unary_unary(self, path, *a, **k):
            def call(req, timeout=None, metadata=None):
                raise Err(codes[self.addr])
            return call

        def close(self):
            pass

    c = PrefixIndexClient(["a:1", "b:1"], timeout=0.5, block_size=16, channel_factory=Chan)
    for addr, first in (("a:1", b"a" * 16), ("b:1", b"b" * 16)):
        c._ring.lookup = lambda key, addr=addr: addr  # route this Match to that shard
        with pytest.raises(grpc.RpcError):
            c.match("m", block_hashes=[first], timeout=0.05)
    assert "a:1" not in c.shard_errors  # cut short by the caller: says nothing of the shard
    assert c.shard_errors["b:1"].startswith("UNAUTHENTICATED")
    with pytest.raises(grpc.RpcError):
        c._ring.lookup = lambda key: "a:1"
        c.match("m", block_hashes=[b"a" * 16])  # the whole timeout: the shard is slow
    assert c.shard_errors["a:1"] == "no answer within 0.5s (timed out)"
