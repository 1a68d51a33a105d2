"""Faults on the request path (issue 6): a replica SIGKILLed mid-stream, the semantic tier or
the prefix index stopped. Requests keep succeeding; degradations are visible in Stats."""

from __future__ import annotations

import time

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, kvpool_pb2_grpc

from clients.python.client import TierCacheClient
from services.common.prefix_client import PrefixIndexClient
from tests.e2e.stack import INTERNAL, INTERNAL_MD, admin_stats, start_full_stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

LEASE_S = 3.0
NO_SEMANTIC = common_pb2.CachePolicy(skip_semantic_lookup=True, skip_semantic_store=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_full_stack(tmp_path_factory.mktemp("failover"), "failover", lease_s=LEASE_S)
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def revived(stack):
    """Each test stops a service: it runs again for the next, so that the tests pass in any
    order or alone (they depended on file order)."""
    yield
    stack.revive_dead()


@pytest.fixture(scope="module")
def a(stack):
    with TierCacheClient(stack.orch.address, token="tok-a", timeout=180) as c:
        yield c


def running_on(stack) -> list[int]:
    out = []
    for k in stack.kv:
        stub = kvpool_pb2_grpc.KvPoolStub(grpc.insecure_channel(k.address))
        st = stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=10, metadata=INTERNAL_MD)
        out.append(st.running)
    return out


def test_replica_killed_mid_stream_completes_with_the_same_tokens(stack, a):
    q = "Write a short poem about the sea."
    # Long enough that the kill after 8 tokens always lands mid-stream, however late the
    # client reads (it asks two Stats first).
    kw = dict(max_tokens=96, ignore_eos=True, return_token_ids=True, cache_policy=NO_SEMANTIC)
    reference = a.generate(q, **kw)
    assert len(reference.token_ids) == 96

    stream = a.stream(q, **kw)
    got: list[int] = []
    final = None
    killed = None
    for ch in stream:
        got.extend(ch.token_ids)
        if killed is None and len(got) >= 8:
            busy = running_on(stack)
            killed = stack.kv[busy.index(1)]
            killed.kill()  # SIGKILL, no drain
        if ch.final is not None:
            final = ch.final
    assert killed is not None and final is not None
    assert got == reference.token_ids  # one uninterrupted stream, same greedy tokens
    assert final.cache_report.route == "resume"
    survivor = next(k for k in stack.kv if k is not killed)
    assert final.cache_report.replica_id == survivor.env["TIERCACHE_KVPOOL_REPLICA_ID"]

    # Later requests route around the dead replica.
    for i in range(3):
        r = a.generate(f"Count to {i + 2}.", max_tokens=6, cache_policy=NO_SEMANTIC)
        assert r.report.replica_id == survivor.env["TIERCACHE_KVPOOL_REPLICA_ID"]

    # The index forgets the dead replica within its lease.
    dead_id = killed.env["TIERCACHE_KVPOOL_REPLICA_ID"]
    with PrefixIndexClient([stack.prefix.address], INTERNAL) as idx:
        end = time.monotonic() + LEASE_S + 3.0
        while time.monotonic() < end:
            ids = {r.replica_id for r in idx.stats().replicas}
            if dead_id not in ids:
                break
            time.sleep(0.2)
        assert dead_id not in ids and ids, ids
    s = admin_stats(stack)
    assert s.degradations["resume"] >= 1
    assert any(not d.healthy and dead_id in d.name for d in s.dependencies)


def test_semantic_down_requests_still_succeed(stack, a):
    before = admin_stats(stack).degradations.get("semantic_skipped", 0)
    stack.semantic.stop()
    r = a.generate("Name a planet.", max_tokens=6)
    assert r.completion_tokens > 0 and not r.report.semantic_hit
    s = admin_stats(stack)
    assert s.degradations["semantic_skipped"] == before + 1
    assert any(d.name == "semantic" and not d.healthy for d in s.dependencies)


def test_prefix_index_down_falls_back_to_the_ring(stack, a):
    before = admin_stats(stack).degradations.get("index_down", 0)
    stack.prefix.stop()
    r = a.generate("Name a colour.", max_tokens=6, session_id="ring-1", cache_policy=NO_SEMANTIC)
    assert r.completion_tokens > 0 and r.report.route == "ring"
    s = admin_stats(stack)
    assert s.degradations["index_down"] == before + 1
    assert any(d.name == "prefix" and not d.healthy for d in s.dependencies)
