"""The semantic service over a real gRPC channel (in-process server on port 0)."""

from __future__ import annotations

import grpc
import pytest
from tiercache.v1 import semantic_pb2 as pb
from tiercache.v1 import semantic_pb2_grpc as pbg

from services.semantic.server import serve

NS = pb.Namespace(tenant="acme", model_id="smollm2", context_hash="00ff")


@pytest.fixture
def svc(make_cfg, embedder):
    s = serve(make_cfg(), embedder=embedder)
    yield s
    s.handle.stop(0)
    s.housekeeper.stop()
    s.cache.store.close()


@pytest.fixture
def stub(svc):
    with grpc.insecure_channel(svc.handle.address) as ch:
        yield pbg.SemanticCacheStub(ch)


def _code(fn, req):
    with pytest.raises(grpc.RpcError) as exc:
        fn(req, timeout=10)
    return exc.value.code(), exc.value.details()


def test_store_lookup_verify_invalidate_stats(stub):
    sid = stub.Store(pb.StoreRequest(namespace=NS, prompt="How do I center a div?",
                                     answer="Use flexbox."), timeout=10).id
    r = stub.Lookup(pb.LookupRequest(namespace=NS, text="How do I center a div?",
                                     tier="strict"), timeout=10)
    assert r.hit and r.entry.id == sid and r.entry.answer == "Use flexbox."
    assert r.tier == "strict" and r.threshold == pytest.approx(0.97)
    # The stored prompt itself: found by text, not embedded.
    assert r.exact and r.similarity == 1.0 and r.embed_ms == 0 and r.search_ms > 0
    assert r.handler_ms >= r.search_ms
    d = stub.Lookup(pb.LookupRequest(namespace=NS, text="What is the way to center a div?",
                                     tier="strict", want_draft=True), timeout=10)
    assert not d.hit and d.entry.id == sid and 0.8 <= d.similarity < 0.97
    assert not d.exact and d.search_ms > 0 and d.embed_ms > 0
    assert d.handler_ms >= d.embed_ms + d.search_ms  # the handler times both, and more
    other = pb.Namespace(tenant="other", model_id="smollm2", context_hash="00ff")
    assert not stub.Lookup(pb.LookupRequest(namespace=other, text="How do I center a div?"),
                           timeout=10).HasField("entry")
    v = stub.Verify(pb.VerifyRequest(id=sid, verified=True), timeout=10)
    assert v.verified and v.hit_count == 1
    st = stub.Stats(pb.SemanticStatsRequest(), timeout=10)
    assert (st.entries, st.namespaces, st.lookups_total) == (1, 1, 3)
    assert st.hits_by_tier["strict"] == 1 and st.near_misses_total == 1
    assert st.threshold_floor == pytest.approx(0.85)  # orchestrators check requests against it
    assert st.embedding_model == "all-MiniLM-L6-v2"
    assert stub.Invalidate(pb.InvalidateRequest(id=sid), timeout=10).removed == 1
    assert stub.Stats(pb.SemanticStatsRequest(), timeout=10).entries == 0


def test_invalidate_namespace(stub):
    for q in ("Why is the sky blue?", "Why is grass green?"):
        stub.Store(pb.StoreRequest(namespace=NS, prompt=q, answer="physics"), timeout=10)
    assert stub.Invalidate(pb.InvalidateRequest(namespace=NS), timeout=10).removed == 2
    assert stub.Stats(pb.SemanticStatsRequest(), timeout=10).entries == 0


def test_invalidate_tenant_removes_its_every_namespace_only(stub):
    """Erasure on request: one call per shard removes a tenant's entries of every model and
    context; another tenant's stay, and a blank tenant is INVALID_ARGUMENT naming it."""
    other_ctx = pb.Namespace(tenant="acme", model_id="other", context_hash="ab")
    other_tenant = pb.Namespace(tenant="globex", model_id="smollm2", context_hash="00ff")
    for ns in (NS, other_ctx, other_tenant):
        stub.Store(pb.StoreRequest(namespace=ns, prompt="Why is the sky blue?",
                                   answer="physics"), timeout=10)
    assert stub.Invalidate(pb.InvalidateRequest(tenant="acme"), timeout=10).removed == 2
    assert stub.Stats(pb.SemanticStatsRequest(), timeout=10).entries == 1
    code, details = _code(stub.Invalidate, pb.InvalidateRequest(tenant=" "))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in details


@pytest.mark.parametrize(("req", "field"), [
    (pb.LookupRequest(namespace=NS, text=""), "text"),
    (pb.LookupRequest(namespace=NS, text="x" * 9000), "text"),
    (pb.LookupRequest(namespace=NS, text="hi", tier="lenient"), "tier"),
    (pb.LookupRequest(namespace=NS, text="hi", threshold=0.5), "threshold"),
    (pb.LookupRequest(namespace=NS, text="hi", threshold=1.5), "threshold"),
    (pb.LookupRequest(text="hi"), "namespace"),
    (pb.LookupRequest(namespace=pb.Namespace(model_id="m"), text="hi"), "namespace.tenant"),
])
def test_bad_lookup_is_invalid_argument(stub, req, field):
    code, details = _code(stub.Lookup, req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":")
    assert stub.Stats(pb.SemanticStatsRequest(), timeout=10).lookups_total == 0


@pytest.mark.parametrize(("req", "field"), [
    (pb.StoreRequest(namespace=NS, prompt="", answer="a"), "prompt"),
    (pb.StoreRequest(namespace=NS, prompt="q?", answer=""), "answer"),
    (pb.StoreRequest(namespace=NS, prompt="q?", answer="a" * 70000), "answer"),
    (pb.StoreRequest(namespace=NS, prompt="q?", answer="a", ttl_seconds=4_000_000_000),
     "ttl_seconds"),
    (pb.StoreRequest(prompt="q?", answer="a"), "namespace"),
    (pb.StoreRequest(namespace=pb.Namespace(tenant="t"), prompt="q?", answer="a"),
     "namespace.model_id"),
    # Three tokens for one byte of text (one for it, one for an end of sequence): not this
    # answer's ids.
    (pb.StoreRequest(namespace=NS, prompt="q?", answer="a", answer_token_ids=[64, 65, 2]),
     "answer_token_ids"),
])
def test_bad_store_is_invalid_argument_and_writes_nothing(stub, svc, req, field):
    code, details = _code(stub.Store, req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":")
    assert stub.Stats(pb.SemanticStatsRequest(), timeout=10).entries == 0
    assert svc.cache.store.count() == 0


def test_the_models_token_ids_come_back_with_the_entry_and_after_a_restart(make_cfg, embedder):
    cfg = make_cfg()
    ids = [34, 1116, 46, 30, 0, 4294967295]  # any uint32, as the model's vocabulary has them
    s = serve(cfg, embedder=embedder)
    try:
        with grpc.insecure_channel(s.handle.address) as ch:
            stub = pbg.SemanticCacheStub(ch)
            with_ids = stub.Store(pb.StoreRequest(namespace=NS, prompt="Name six rivers.",
                                                  answer="1. Nile, 2. Amazon",
                                                  answer_token_ids=ids), timeout=10).id
            stub.Store(pb.StoreRequest(namespace=NS, prompt="Name a lake.", answer="Baikal."),
                       timeout=10)
            r = stub.Lookup(pb.LookupRequest(namespace=NS, text="Name six rivers."), timeout=10)
            assert r.hit and r.entry.id == with_ids and list(r.entry.answer_token_ids) == ids
            assert stub.Verify(pb.VerifyRequest(id=with_ids, verified=True),
                               timeout=10).answer_token_ids == ids
    finally:
        s.handle.stop(0)
        s.housekeeper.stop()
        s.cache.store.close()
    s = serve(cfg, embedder=embedder)  # the same database: the ids were committed with the row
    try:
        with grpc.insecure_channel(s.handle.address) as ch:
            stub = pbg.SemanticCacheStub(ch)
            r = stub.Lookup(pb.LookupRequest(namespace=NS, text="Name six rivers."), timeout=10)
            assert r.hit and list(r.entry.answer_token_ids) == ids
            r = stub.Lookup(pb.LookupRequest(namespace=NS, text="Name a lake."), timeout=10)
            assert r.hit and r.entry.answer == "Baikal." and not r.entry.answer_token_ids
    finally:
        s.handle.stop(0)
        s.housekeeper.stop()
        s.cache.store.close()


def test_unknown_ids_are_not_found(stub):
    code, details = _code(stub.Verify, pb.VerifyRequest(id="deadbeef", verified=True))
    assert code == grpc.StatusCode.NOT_FOUND and "id" in details
    code, _ = _code(stub.Invalidate, pb.InvalidateRequest(id="deadbeef"))
    assert code == grpc.StatusCode.NOT_FOUND
    code, details = _code(stub.Invalidate, pb.InvalidateRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("target")
    code, details = _code(stub.Verify, pb.VerifyRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("id")


def test_concurrent_lookups_are_micro_batched(stub, embedder):
    from concurrent.futures import ThreadPoolExecutor

    stub.Store(pb.StoreRequest(namespace=NS, prompt="What is a monad?", answer="A monoid."),
               timeout=10)
    before = (embedder.batches, embedder.batched_texts)
    texts = [f"What is a monad, question {i}?" for i in range(48)]
    with ThreadPoolExecutor(16) as pool:
        out = list(pool.map(lambda t: stub.Lookup(
            pb.LookupRequest(namespace=NS, text=t, tier="relaxed"), timeout=30), texts))
    assert all(r.similarity > 0.5 for r in out)
    batches = embedder.batches - before[0]
    assert embedder.batched_texts - before[1] == 48
    assert batches < 48, "concurrent requests should share forward passes"


def test_a_failed_start_releases_the_database_for_the_next_one(make_cfg, embedder, tmp_path):
    """serve() stopped the server on a failed start but kept the store open, with its lock:
    the next start in the same process was refused as 'in use by another process'."""
    bad = tmp_path / "verifier.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError):
        serve(make_cfg(verifier_path=str(bad)), embedder=embedder)
    s = serve(make_cfg(), embedder=embedder)  # the same database
    s.handle.stop(0)  # not s.stop(): that would close the session's shared embedder
    s.housekeeper.stop()
    s.cache.store.close()


def test_a_store_whose_caller_gave_up_writes_nothing(make_cfg, embedder):
    """A Store whose deadline passed while the prompt was embedded still wrote the entry: the
    caller, told DEADLINE_EXCEEDED, could not name (nor rate, nor invalidate) it."""
    import threading
    import time

    release = threading.Event()

    class Slow:
        """The real embedder, held until the test releases it."""

        def __getattr__(self, name):
            return getattr(embedder, name)

        def embed_one_checked(self, text):
            release.wait(10)
            return embedder.embed_one_checked(text)

    s = serve(make_cfg(), embedder=Slow())
    try:
        with grpc.insecure_channel(s.handle.address) as ch:
            stub = pbg.SemanticCacheStub(ch)
            req = pb.StoreRequest(namespace=NS, prompt="What is a KV cache?", answer="a")
            with pytest.raises(grpc.RpcError) as e:
                stub.Store(req, timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            release.set()
            time.sleep(0.5)  # the handler finishes its embedding, then would have written
            assert s.cache.store.count() == 0
            assert stub.Stats(pb.SemanticStatsRequest(), timeout=10).entries == 0
            assert stub.Store(req, timeout=10).id  # a caller still waiting gets it stored
            assert s.cache.store.count() == 1
    finally:
        release.set()
        s.handle.stop(0)
        s.housekeeper.stop()
        s.cache.store.close()


def test_a_rating_whose_caller_gave_up_changes_nothing(svc, stub):
    """A Verify or Invalidate that reached its write after the caller's deadline still
    applied it: the client, told DEADLINE_EXCEEDED, retried a BAD rating and got NOT_FOUND."""
    import threading
    import time

    from services.common.errors import DeadlineExceeded

    eid = stub.Store(pb.StoreRequest(namespace=NS, prompt="What is a KV cache?", answer="a"),
                     timeout=10).id
    release: list[threading.Event] = []
    ended = threading.Semaphore(0)
    outcomes: list[BaseException | None] = []
    real_get = svc.cache.get
    real = {"invalidate_id": svc.cache.invalidate_id, "verify": svc.cache.verify}

    def held_get(entry_id):
        release[-1].wait(10)
        return real_get(entry_id)

    def watched(name):
        def call(*a, **kw):
            try:
                out = real[name](*a, **kw)
                outcomes.append(None)
                return out
            except BaseException as exc:
                outcomes.append(exc)
                raise
            finally:
                ended.release()
        return call

    svc.cache.get = held_get
    for name in real:
        setattr(svc.cache, name, watched(name))
    try:
        for call, req in ((stub.Invalidate, pb.InvalidateRequest(id=eid)),
                          (stub.Verify, pb.VerifyRequest(id=eid, verified=True))):
            release.append(threading.Event())
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The server's deadline runs from when it took the call: on a loaded host that
            # trails the client's, and its cancel may not have landed yet. The write must wait
            # past both (released at once, a run beside two busy reviews saw the call still
            # wanted and the entry removed).
            time.sleep(0.6)
            release[-1].set()
            # The handler goes on past the lookup to where it would write, and must refuse
            # there (if gRPC ran it at all: a call whose deadline passed while queued may
            # never reach it, and then nothing ends here).
            if ended.acquire(timeout=5):
                assert isinstance(outcomes[-1], DeadlineExceeded), outcomes[-1]
            e = real_get(eid)
            assert not e.verified and svc.cache.store.count() == 1
    finally:
        for r in release:
            r.set()
        svc.cache.get = real_get
        for name, fn in real.items():
            setattr(svc.cache, name, fn)
    assert stub.Verify(pb.VerifyRequest(id=eid, verified=True), timeout=10).verified
    assert stub.Invalidate(pb.InvalidateRequest(id=eid), timeout=10).removed == 1
