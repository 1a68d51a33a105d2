"""Orchestrator request paths around cancellation, broken streams and Warm targets (pure logic:
fakes for the replicas, the semantic tier and the index; the real pipeline and Warmer)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, orchestrator_pb2, prefix_pb2, semantic_pb2

from services.common import errors
from services.common.bootstrap import on_rpc_end
from services.common.hashing import BlockHasher
from services.orchestrator.backends import ReplicaSet
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.dispatched import DispatchMemory
from services.orchestrator.pipeline import (
    Finished,
    Orchestrator,
    Policy,
    Sampling,
    TextDelta,
    answer_ids,
)
from services.orchestrator.render import RenderedPrompt
from services.orchestrator.routing import PrefixAwarePolicy
from services.orchestrator.server import Warmer, _Gone
from services.orchestrator.tenants import Tenant
from tests.metric_sample import sample_value
from tests.waits import holds_within, wait_until


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name.lower()


class Busy(RpcError):
    """A replica's RESOURCE_EXHAUSTED with the Overloaded trailer (queue full, memory held)."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

    def details(self) -> str:
        return ("replica busy: 1 request waiting for admission (max_waiting 1); retry later "
                "or on another replica")

    def trailing_metadata(self):
        return ((errors.OVERLOADED_KEY, "1"),)


class Call:
    """A Generate stream: its messages, then `err` (or a clean end)."""

    def __init__(self, msgs, err=None) -> None:
        self.msgs, self.err, self.cancelled = msgs, err, False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __iter__(self):
        yield from self.msgs
        if self.err is not None:
            raise self.err


class UnaryCall:
    """A unary call's future, as gRPC's: cancellable until it ends, whatever its handler does
    (`result` then raises grpc.FutureCancelledError)."""

    def __init__(self) -> None:
        self._lock, self._done, self._callbacks = threading.Lock(), threading.Event(), []
        self._response = self._error = None
        self.cancelled = False

    def end(self, response=None, error=None) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._response, self._error = response, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)
        return True

    def cancel(self) -> bool:
        ended = self.end(error=grpc.FutureCancelledError())
        self.cancelled = self.cancelled or ended
        return ended

    def add_done_callback(self, cb) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def result(self, timeout=None):
        self._done.wait(timeout)
        if self._error is not None:
            raise self._error
        return self._response


class Unary:
    """A unary method of a fake stub: called (blocking) or through `.future` (its handler on a
    thread of its own); `calls` holds the futures handed out."""

    def __init__(self, handler) -> None:
        self.handler, self.calls = handler, []

    def __call__(self, req, timeout=None, metadata=None):
        return self.handler(req, timeout=timeout, metadata=metadata)

    def future(self, req, timeout=None, metadata=None) -> UnaryCall:
        call = UnaryCall()
        self.calls.append(call)

        def run() -> None:
            try:
                call.end(response=self.handler(req, timeout=timeout, metadata=metadata))
            except Exception as e:  # noqa: BLE001 - not only a status: a closed channel's ValueError
                call.end(error=e)

        threading.Thread(target=run, daemon=True).start()
        return call


class Cancellable:
    """A call that hangs until cancelled: `cancelled` is set by `cancel`."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class HungCall(Cancellable):
    """A replica's Generate that hangs: CANCELLED once cancelled, else DEADLINE_EXCEEDED
    after 10 s."""

    def __iter__(self):
        if self.cancelled.wait(10):
            raise RpcError(grpc.StatusCode.CANCELLED)
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)
        yield  # pragma: no cover


class HungIndex:
    """A prefix index whose Match hangs (up to `timeout_s`) until the caller cancels it; each
    call is kept in `probes`, `started` set once one is under way."""

    timeout_s = 5.0

    def __init__(self) -> None:
        self.probes: list[Cancellable] = []
        self.started = threading.Event()

    def match(self, hashes, model_id, timeout=None, probe=False, on_call=None):
        call = Cancellable()
        self.probes.append(call)
        if on_call is not None:
            on_call(call)
        self.started.set()
        if call.cancelled.wait(self.timeout_s):
            raise grpc.FutureCancelledError()
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)


class Stub:
    def __init__(self, rid: str, calls: list[Call]) -> None:
        self.rid, self.calls, self.requests = rid, list(calls), []
        self.Prefill = Unary(self._prefill)

    def Generate(self, req, timeout=None, metadata=None):  # noqa: N802
        self.requests.append(req)
        return self.calls.pop(0)

    def _prefill(self, req, timeout=None, metadata=None):
        self.requests.append(req)
        return kvpool_pb2.PrefillResponse(prompt_tokens=len(req.token_ids),
                                          computed_tokens=len(req.token_ids), replica_id=self.rid)


class Tok:
    """Byte-level: id i is byte i."""

    eos_token_id = 0

    def __len__(self) -> int:
        return 256

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i for i in ids if i).decode("utf-8", "replace")

    def encode(self, text: str, add_special_tokens=False) -> list[int]:
        return list(text.encode())


class Semantic:
    enabled = True
    timeout_s = 2.0

    def shard_for(self, ns) -> str:
        return "sem:1"

    def __init__(self, on_lookup=None) -> None:
        self.on_lookup = on_lookup

    def lookup(self, req, timeout=None, on_call=None):
        if self.on_lookup:
            self.on_lookup()
        return None

    def store(self, req, timeout=None, on_call=None):
        return SimpleNamespace(id="e1")


TENANT = Tenant("a", "salt-a", 10_000, 1_000, 4)
PROMPT = list(range(1, 100))


def make(stubs: dict[str, Stub], semantic=None, max_attempts=3, prefix=None,
         tok=None) -> Orchestrator:
    replicas = ReplicaSet(tuple(stubs), "")
    for r in replicas.replicas:
        r.stub = stubs[r.address]
        r.health.ok()
    tok = tok or Tok()
    return Orchestrator(
        renderer=SimpleNamespace(encode=tok.encode, encode_literal=tok.encode), tokenizer=tok,
        model_id="m",
        hasher=BlockHasher("m", 16, b"k" * 32), replicas=replicas,
        semantic=semantic or Semantic(), prefix=prefix, routing=PrefixAwarePolicy(),
        internal_token="", default_tier="standard", enable_drafts=True, store_sampled=False,
        max_attempts=max_attempts, min_prefix_tokens=32, dispatched=DispatchMemory(16, 10.0))


def generate(orch: Orchestrator, callbacks: list):
    return list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(4, 0.0, 1.0, 0, (), False), policy=Policy(), session_id="s",
        return_token_ids=True, request_id="rid", deadline=time.monotonic() + 30,
        on_cancel=callbacks.append))


def final(rid: str, n: int) -> kvpool_pb2.KvGenerateResponse:
    return kvpool_pb2.KvGenerateResponse(token_ids=[ord("o"), ord("k")][:n], final=kvpool_pb2.
                                         KvGenerateFinal(finish_reason=common_pb2.
                                                         FINISH_REASON_LENGTH, replica_id=rid))


def test_a_client_gone_during_the_semantic_lookup_gets_no_model_call():
    callbacks: list = []
    stub = Stub("A", [Call([final("A", 2)])])
    # The client cancels while the lookup runs: gRPC runs the registered callbacks.
    orch = make({"A": stub}, semantic=Semantic(on_lookup=lambda: [cb() for cb in callbacks]))
    with pytest.raises(errors.Cancelled):
        generate(orch, callbacks)
    assert stub.requests == []
    assert orch.replicas.replicas[0].inflight == 0


def in_order(*replica_ids: str) -> SimpleNamespace:
    """Routing that takes the replicas in this order, skipping the ones already tried."""
    return SimpleNamespace(choose=lambda views, seen, aff, exclude, *rest: next(
        (SimpleNamespace(replica_id=r, route="least_loaded", matched_tokens=0)
         for r in replica_ids if r not in exclude), None))


def test_a_call_sent_as_the_poller_declares_its_replica_hung_fails_over_at_once():
    """The poller found A hung (3 timed-out Stats) after this request was routed there but
    before its call was watched: the cancel went to the watchers registered so far, none, and
    the call waited on A to its deadline while B was idle. A replica already down when the
    request was routed (the last resort, none healthy) is still tried."""
    hung = HungCall()

    class HangsAsDeclaredDown(Stub):
        def Generate(self, req, timeout=None, metadata=None):  # noqa: N802
            self.requests.append(req)
            a.health.fail("deadline_exceeded", hold=True)  # the poller, right now
            orch.replicas._notify_down(a)
            return hung

    b = Stub("B", [Call([final("B", 2)])])
    orch = make({"A": HangsAsDeclaredDown("A", []), "B": b})
    a = orch.replicas.by_id("A")
    orch.routing = in_order("A", "B")
    t0 = time.monotonic()
    events = list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(4, 0.0, 1.0, 0, (), False), policy=Policy(), session_id="s",
        return_token_ids=True, request_id="rid", deadline=time.monotonic() + 5,
        on_cancel=lambda fn: None))
    assert events[-1].report.replica_id == "B" and time.monotonic() - t0 < 3
    assert hung.cancelled.is_set() and [r.inflight for r in orch.replicas.replicas] == [0, 0]

    # Alone and already declared down when routed: tried, not cancelled at once.
    solo = Stub("A", [Call([final("A", 2)])])
    orch = make({"A": solo})
    a = orch.replicas.by_id("A")
    a.health.fail("deadline_exceeded", hold=True)
    orch.replicas._notify_down(a)
    assert generate(orch, [])[-1].report.replica_id == "A"


def test_a_failed_replica_renamed_by_its_first_stats_answer_is_not_tried_again():
    """A replica is known by its address until its first Stats answer names it. That answer
    landing between two attempts renamed the replica that had just failed, its new name was
    not among those excluded, and the request went back to it (B never tried)."""
    a = Stub("A", [Call([], RpcError(grpc.StatusCode.INTERNAL))] * 2)
    b = Stub("B", [Call([final("B", 2)])])
    orch = make({"A": a, "B": b}, max_attempts=2)
    ra = orch.replicas.by_id("A")
    orch.routing = SimpleNamespace(choose=lambda views, seen, aff, exclude, *rest: next(
        (SimpleNamespace(replica_id=v.replica_id, route="least_loaded", matched_tokens=0)
         for v in views if v.replica_id not in exclude), None))
    views, calls = orch.replicas.views, [0]

    def views_renaming_a_at_the_second_attempt():
        calls[0] += 1
        if calls[0] == 2:
            ra.replica_id = "kvpool-a"  # the poller's first answer from A lands now
        return views()

    orch.replicas.views = views_renaming_a_at_the_second_attempt
    assert generate(orch, [])[-1].report.replica_id == "B"
    assert (len(a.requests), len(b.requests)) == (1, 1)


def test_a_busy_replica_hands_the_request_to_another_and_stays_in_routing():
    """A replica's queue full or memory held by pins (RESOURCE_EXHAUSTED) went to the client
    as final though the other replica was idle; an answer cut short by it resumes exactly."""
    a = Stub("A", [Call([kvpool_pb2.KvGenerateResponse(token_ids=[ord("o")])], Busy())])
    b = Stub("B", [Call([kvpool_pb2.KvGenerateResponse(
        token_ids=[ord("k")], final=kvpool_pb2.KvGenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_LENGTH, replica_id="B"))])])
    orch = make({"A": a, "B": b})
    orch.routing = in_order("A", "B")
    events = generate(orch, [])
    assert "".join(e.text for e in events if hasattr(e, "text")) == "ok"
    assert list(b.requests[0].token_ids) == PROMPT + [ord("o")]  # resumed after "o"
    assert all(r.health.healthy for r in orch.replicas.replicas)  # busy is not down
    # Counted as saturation, not as a replica failure (alerts on retry/resume mean broken).
    assert orch.stats.degradations["busy_replica"] == 1
    assert orch.stats.degradations["resume"] == 0 and orch.stats.degradations["retry"] == 0
    # Nothing steers this prefix back to the busy replica ("sent there moments ago").
    hashes = orch.hasher.hashes(PROMPT, TENANT.cache_salt)
    assert orch.dispatched.match(hashes).get("B")  # what was sent, recorded
    assert "A" not in orch.dispatched.match(hashes)

    both = make({"A": Stub("A", [Call([], Busy())]), "B": Stub("B", [Call([], Busy())])})
    with pytest.raises(errors.Overloaded, match="every kvpool replica is busy"):
        generate(both, [])  # retry later: the client sees the tiercache-overloaded trailer
    never = make({r: Stub(r, [Call([], RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED))])
                  for r in ("A", "B")})
    with pytest.raises(errors.TierCacheError) as e:  # can never fit: the replica's verdict
        generate(never, [])
    assert e.value.code == "RESOURCE_EXHAUSTED" and not isinstance(e.value, errors.Overloaded)
    assert sum(len(r.stub.requests) for r in never.replicas.replicas) == 1


def test_a_replica_past_its_call_cap_hands_the_request_to_another(caplog):
    """gRPC's own refusal of a call past a replica's cap on concurrent calls
    (RESOURCE_EXHAUSTED, no trailer) is busy now, not the replica's verdict on the request;
    and no "replica failed" WARNING (a busy hand-off logged one for a while: alerts on it are
    for broken replicas)."""
    class CapRefused(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return errors.RPC_CAP_DETAILS

    b = Stub("B", [Call([kvpool_pb2.KvGenerateResponse(
        token_ids=[ord("o"), ord("k")], final=kvpool_pb2.KvGenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_LENGTH, replica_id="B"))])])
    orch = make({"A": Stub("A", [Call([], CapRefused())]), "B": b})
    orch.routing = in_order("A", "B")
    with caplog.at_level(logging.INFO, logger="services.orchestrator.pipeline"):
        events = generate(orch, [])
    assert "".join(e.text for e in events if hasattr(e, "text")) == "ok"
    assert list(b.requests[0].token_ids) == PROMPT
    assert orch.stats.degradations["busy_replica"] == 1
    assert all(r.health.healthy for r in orch.replicas.replicas)
    assert "is busy" in caplog.text and "failed" not in caplog.text


def sized(orch, sizes: dict[str, int]):
    """`orch` with each replica's pool of `sizes[replica_id]` blocks, routed A then B."""
    for r in orch.replicas.replicas:
        r.stats = kvpool_pb2.KvStatsResponse(replica_id=r.replica_id,
                                             blocks_total=sizes[r.replica_id])
    orch.routing = in_order("A", "B")
    return orch


def test_a_request_too_big_for_one_pool_goes_to_a_replica_with_a_larger_one():
    """Pools sized by kv_cache_bytes differ with the hardware: a request one replica can never
    hold went back to the client as final, though another replica's pool could."""
    class TooBig(RpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED)

        def details(self) -> str:
            return "token_ids: prompt + max_tokens need 300 KV blocks, the pool has 200"

    a, b = Stub("A", [Call([], TooBig())]), Stub("B", [Call([final("B", 2)])])
    orch = sized(make({"A": a, "B": b}), {"A": 200, "B": 400})
    assert "".join(e.text for e in generate(orch, []) if hasattr(e, "text")) == "ok"
    assert len(b.requests) == 1 and orch.replicas.by_id("A").health.healthy
    assert orch.stats.degradations["larger_pool"] == 1 and orch.stats.degradations["retry"] == 0
    # The prompt is not credited to the small pool as "sent there moments ago": renewed by
    # every request routed there, that credit kept drawing the prompt back to it.
    hashes = orch.hasher.hashes(PROMPT, TENANT.cache_salt)
    assert "A" not in orch.dispatched.match(hashes) and orch.dispatched.match(hashes).get("B")

    same = sized(make({r: Stub(r, [Call([], TooBig())]) for r in ("A", "B")}),
                 {"A": 200, "B": 200})
    with pytest.raises(errors.TierCacheError, match="need 300 KV blocks") as e:
        generate(same, [])  # no larger pool: the first replica's verdict, no second call
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert sum(len(r.stub.requests) for r in same.replicas.replicas) == 1

    # The larger pool lost: "too big" was the answer, though the request may fit there once it
    # is back, and it never said so.
    lost = sized(make({"A": Stub("A", [Call([], TooBig())]),
                       "B": Stub("B", [Call([], RpcError(grpc.StatusCode.UNAVAILABLE))])},
                      max_attempts=2), {"A": 200, "B": 400})
    with pytest.raises(errors.TierCacheError) as e:
        generate(lost, [])
    assert e.value.code == "UNAVAILABLE" and "need 300 KV blocks" not in str(e.value)


def test_a_callback_refused_because_the_rpc_already_ended_runs_at_once():
    ran = []
    on_rpc_end(SimpleNamespace(add_callback=lambda fn: False), lambda: ran.append(1))
    assert ran == [1]
    live = []
    on_rpc_end(SimpleNamespace(add_callback=lambda fn: live.append(fn) or True),
               lambda: ran.append(2))
    assert ran == [1] and len(live) == 1  # registered, not run


@pytest.mark.parametrize("max_attempts", [1, 3])
def test_a_stream_that_breaks_after_its_final_message_is_a_complete_answer(max_attempts):
    stub = Stub("A", [Call([final("A", 2)], RpcError(grpc.StatusCode.UNAVAILABLE))])
    orch = make({"A": stub}, max_attempts=max_attempts)
    events = generate(orch, [])
    fin = [e for e in events if isinstance(e, Finished)]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "ok"
    assert len(fin) == 1 and fin[0].report.route == "ring" and fin[0].report.replica_id == "A"
    assert len(stub.requests) == 1  # no retry, no resume
    assert not orch.stats.degradations
    assert orch.replicas.replicas[0].health.healthy
    assert orch.dispatched.match(orch.hasher.hashes(PROMPT, TENANT.cache_salt)) == {"A": 96}


def test_a_dispatch_is_recorded_under_its_tenants_cache_salt():
    """EraseTenant forgets an erased tenant's dispatches by its cache salt (the salt its
    flush dropped): the record carries the salt of the tenant whose request it was."""
    orch = make({"A": Stub("A", [Call([final("A", 2)])])})
    generate(orch, [])
    hashes = orch.hasher.hashes(PROMPT, TENANT.cache_salt)
    orch.dispatched.forget("A", "another tenant's salt")
    assert orch.dispatched.match(hashes) == {"A": 96}
    orch.dispatched.forget("A", TENANT.cache_salt)
    assert orch.dispatched.match(hashes) == {}


def test_warm_top_k_for_owners_warms_only_the_owner():
    stubs = {r: Stub(r, []) for r in ("A", "B", "C")}
    hot = list(range(100, 164))
    prefix = SimpleNamespace(
        timeout_s=0.5,
        match=lambda hashes, model_id, timeout=None, probe=False, on_call=None: {"A": 64},
        top_prefixes=lambda k, model_id, cache_salt=None: [prefix_pb2.HotPrefix(
            token_ids=hot, holders=["A"], hits=5, cache_salt=TENANT.cache_salt)])
    orch = make(stubs, prefix=prefix)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    try:
        assert orch.owner(TENANT, hot) == "A"
        owners = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            top_k=1, target=orchestrator_pb2.WARM_TARGET_OWNERS))
        # The owner holds it already: asked again only to pin it (a holder computes nothing;
        # skipped, a top_k Warm pinned nothing once the loop had cached it everywhere).
        assert [r.replica_id for r in owners.results] == ["A"]
        assert all(req.pin for req in stubs["A"].requests)
        everyone = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(top_k=1))
        assert sorted(r.replica_id for r in everyone.results) == ["A", "B", "C"]
    finally:
        warmer.stop()


def test_warm_top_k_keeps_k_of_the_tenants_own_prefixes_and_names_an_index_outage():
    """top_k took the cluster's k hottest prefixes and then dropped other tenants': a tenant
    whose prefixes ranked below k others' got nothing. An index outage was INTERNAL."""
    stubs = {r: Stub(r, []) for r in ("A", "B")}
    asked: list[int] = []
    others = [prefix_pb2.HotPrefix(token_ids=list(range(200 + i, 264 + i)), holders=["A"],
                                   hits=50, cache_salt="someone-else") for i in range(3)]
    mine = [prefix_pb2.HotPrefix(token_ids=list(range(300 + i, 364 + i)), holders=["A"],
                                 hits=5 - i, cache_salt=TENANT.cache_salt) for i in range(3)]

    def top(k, model_id, cache_salt=None):
        asked.append((k, cache_salt))
        return [p for p in others + mine if cache_salt in (None, p.cache_salt)][:k]

    prefix = SimpleNamespace(
        match=lambda hashes, model_id, timeout=None, probe=False, on_call=None: {},
        top_prefixes=top)
    orch = make(stubs, prefix=prefix)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    try:
        got = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(top_k=2))
        assert sorted((r.replica_id, r.prompt_index) for r in got.results) == [
            ("A", -1), ("A", -1), ("B", -1), ("B", -1)]  # the holder A: to pin them
        # The prefills run on the warmer's thread pool: in any order.
        for r in ("A", "B"):
            assert sorted(list(req.token_ids) for req in stubs[r].requests) == [
                list(p.token_ids) for p in mine[:2]]
        assert asked == [(2, TENANT.cache_salt)]  # the index filters: k of the tenant's own

        def down(k, model_id, cache_salt=None):
            raise RpcError(grpc.StatusCode.UNAVAILABLE)

        prefix.top_prefixes = down
        with pytest.raises(errors.Unavailable, match="top_k: the prefix index"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(top_k=2))
    finally:
        warmer.stop()


def test_warms_prefill_calls_carry_the_warm_calls_request_id():
    """The prefills run on the warmer's thread pool, which does not inherit the call's request
    id: each one made up its own."""
    from services.common.logs import request_id_var
    from services.orchestrator.render import PromptRenderer

    stubs = {r: Stub(r, []) for r in ("A", "B")}
    seen: list = []
    for stub in stubs.values():
        plain = stub.Prefill

        def recording(req, timeout=None, metadata=None, plain=plain):
            seen.append([v for k, v in metadata if k == "x-request-id"])
            return plain(req, timeout=timeout, metadata=metadata)

        stub.Prefill = Unary(recording)
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A", "B")))
    tok = request_id_var.set("warm-call-1")
    charged: list[int] = []
    try:
        warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16),
                     orchestrator_pb2.WarmPrompt(prompt="y" * 16)]), charge=charged.append)
    finally:
        request_id_var.reset(tok)
        warmer.stop()
    assert seen == [["warm-call-1"]] * 4
    assert charged == [3]  # 2 prompts x 2 replicas; the call itself paid for the first
    charged.clear()
    for stub in stubs.values():  # refreshes that computed nothing are not charged
        stub.Prefill = Unary(lambda req, timeout=None, metadata=None: kvpool_pb2.PrefillResponse(
            prompt_tokens=len(req.token_ids), cached_tokens=len(req.token_ids)))
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A", "B")))
    try:
        warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16)]), charge=charged.append)
    finally:
        warmer.stop()
    assert charged == []


def test_warm_that_cannot_do_anything_says_why_instead_of_ok():
    from services.orchestrator.render import PromptRenderer

    stubs = {"A": Stub("A", [])}
    orch = make(stubs)  # no prefix index
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    try:
        with pytest.raises(errors.FailedPrecondition, match="top_k: no prefix index"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(top_k=2))
        orch.replicas.replicas[0].health.fail(RpcError(grpc.StatusCode.UNAVAILABLE))
        with pytest.raises(errors.Unavailable, match="no healthy replica"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16)]))
    finally:
        warmer.stop()


def test_warm_top_k_zero_turns_the_loop_off_without_asking_the_index():
    asked = []
    orch = SimpleNamespace(prefix=SimpleNamespace(top_prefixes=lambda k, m: asked.append(k)),
                           replicas=SimpleNamespace(healthy=lambda: [SimpleNamespace(load=0)]))
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",), warm_top_k=0))
    try:
        assert warmer.cycle() == 0 and asked == []
    finally:
        warmer.stop()


def test_stop_ids_outside_the_vocabulary_or_too_many_are_refused_before_any_tier():
    from services.orchestrator.server import parse_sampling

    cfg = OrchestratorConfig(kvpool_addresses=("A",))
    ok = parse_sampling(common_pb2.SamplingParams(stop_token_ids=[0, 999]), cfg, 1000)
    assert ok.stop_token_ids == (0, 999)
    for stops, msg in (([1000], "outside the vocabulary"), ([2**31], "outside the vocabulary"),
                       (list(range(257)), "more than 256")):
        with pytest.raises(errors.InvalidArgument, match=msg) as ei:
            parse_sampling(common_pb2.SamplingParams(stop_token_ids=stops), cfg, 1000)
        assert str(ei.value).startswith("sampling.stop_token_ids")


def test_warm_refuses_long_pins_and_names_the_bad_prompt():
    from services.orchestrator.render import PromptRenderer

    stubs = {"A": Stub("A", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",), max_message_chars=50))
    try:
        cases = [
            (orchestrator_pb2.WarmRequest(prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16)],
                                          pin_ttl_seconds=3601), "pin_ttl_seconds"),
            (orchestrator_pb2.WarmRequest(prompts=[
                orchestrator_pb2.WarmPrompt(prompt="x" * 16),
                orchestrator_pb2.WarmPrompt(messages=[orchestrator_pb2.ChatMessage(
                    role="wizard", content="hi")])]), r"prompts\[1\].messages\[0\].role"),
            (orchestrator_pb2.WarmRequest(prompts=[orchestrator_pb2.WarmPrompt(
                messages=[orchestrator_pb2.ChatMessage(role="system", content="y" * 51)])]),
             r"prompts\[0\].messages\[0\].content"),
            (orchestrator_pb2.WarmRequest(prompts=[orchestrator_pb2.WarmPrompt(prompt="z" * 51)]),
             r"prompts\[0\].prompt"),
        ]
        for req, field in cases:
            with pytest.raises(errors.InvalidArgument, match=field):
                warmer.warm(TENANT, req)
        assert stubs["A"].requests == []
    finally:
        warmer.stop()


@pytest.mark.parametrize("content", ["", "  \n", "\u200b"])
def test_warm_refuses_an_empty_message_as_generate_does_and_sends_nothing(content):
    """A message of no visible text is INVALID_ARGUMENT naming its content in Generate; Warm
    took it and pinned a prefix that no request Generate takes can ever reuse."""
    from services.orchestrator.render import Message, PromptRenderer

    stubs = {"A": Stub("A", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    said = "must not be empty"
    try:
        with pytest.raises(errors.InvalidArgument, match=r"^messages\[1\].content: " + said):
            orch.renderer.render_chat([Message("system", "Be brief."), Message("user", content)])
        req = orchestrator_pb2.WarmRequest(prompts=[
            orchestrator_pb2.WarmPrompt(prompt="x" * 16),
            orchestrator_pb2.WarmPrompt(messages=[
                orchestrator_pb2.ChatMessage(role="system", content="Be brief."),
                orchestrator_pb2.ChatMessage(role="user", content=content)])])
        with pytest.raises(errors.InvalidArgument,
                           match=r"^prompts\[1\].messages\[1\].content: " + said):
            warmer.warm(TENANT, req)
        assert stubs["A"].requests == []
    finally:
        warmer.stop()


def test_a_replica_refusal_names_the_callers_field_not_the_replicas():
    class Refusal(RpcError):
        def details(self) -> str:
            return "token_ids: prompt + max_tokens need 144 KV blocks, the pool has 128"

    stub = Stub("A", [Call([], Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED))])
    orch = make({"A": stub})
    with pytest.raises(errors.TierCacheError) as ei:
        generate(orch, [])
    assert ei.value.code == "RESOURCE_EXHAUSTED"
    assert str(ei.value).startswith("prompt (rendered messages): prompt + max_tokens need 144")
    assert len(stub.requests) == 1  # the replica's verdict: no retry elsewhere


def test_warm_refuses_what_cannot_fit_before_rendering_it():
    """Generate checked sizes before rendering; Warm rendered 15 MB of messages (20 s of CPU
    for one rate-limit token) only to refuse them."""
    from services.orchestrator.render import PromptRenderer

    orch = make({"A": Stub("A", [])})
    renderer = PromptRenderer(Tok(), max_chars=1000)
    renderer._max_token_chars = 4  # no token stands for more than 4 characters
    rendered: list[str] = []
    plain_render = renderer.render_raw
    renderer.render_raw = lambda p, field="prompt", scope="": (rendered.append(p)
                                                             or plain_render(p, field, scope))
    orch.renderer = renderer
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",), max_prompt_tokens=8))
    try:
        for req, msg in (
            (orchestrator_pb2.WarmRequest(prompts=[orchestrator_pb2.WarmPrompt(prompt="x"),
                                                   orchestrator_pb2.WarmPrompt(prompt="y" * 33)]),
             r"^prompts\[1\]: 33 characters cannot fit"),
            (orchestrator_pb2.WarmRequest(prompts=[orchestrator_pb2.WarmPrompt(messages=[
                orchestrator_pb2.ChatMessage(role="user", content="hi")] * 9)]),
             r"^prompts\[0\]: 9 messages exceed")):
            with pytest.raises(errors.InvalidArgument, match=msg):
                warmer.warm(TENANT, req)
        # The tenant's own, lower limit too (RESOURCE_EXHAUSTED, as after tokenizing).
        small = dataclasses.replace(TENANT, max_prompt_tokens=4)
        with pytest.raises(errors.ResourceExhausted,
                           match=r"^prompts\[0\]: 17 characters cannot fit in tenant limit 4 "):
            warmer.warm(small, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt="z" * 17)]))
        assert rendered == []  # refused before any rendering
    finally:
        warmer.stop()


def test_warm_refuses_a_prompt_shorter_than_a_block_and_says_how_long_one_is():
    """Only full blocks are cached and pinned: a 14-token system prompt was 'warmed' (OK,
    computed 14 tokens) and nothing was kept."""
    from services.orchestrator.render import PromptRenderer

    stubs = {"A": Stub("A", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=5000)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",), max_prompt_tokens=64))
    try:
        with pytest.raises(errors.InvalidArgument,
                           match=r"^prompts\[0\]: 15 tokens, shorter than one KV block \(16\)"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 15)]))
        with pytest.raises(errors.InvalidArgument,
                           match=r"^prompts\[0\]: 65 tokens exceed the limit of 64 "
                                 r"\(the orchestrator.s max_prompt_tokens\)$"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 65)]))
        assert stubs["A"].requests == []
        warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16)]))
        assert len(stubs["A"].requests) == 1
    finally:
        warmer.stop()


def test_warm_sends_whole_blocks_and_refuses_what_no_replica_can_hold():
    """The tail past the last whole block was computed and thrown away: a refresh of a warm
    prompt recomputed it every time and was charged as work. A prompt over the replicas'
    context went to each of them, and each answered with its own field name."""
    from services.orchestrator.render import PromptRenderer

    stubs = {r: Stub(r, []) for r in ("A", "B")}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=5000)
    for r in orch.replicas.replicas:
        r.stats = kvpool_pb2.KvStatsResponse(max_context=64)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A", "B")))
    try:
        got = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 40)]))
        assert [len(req.token_ids) for req in stubs["A"].requests + stubs["B"].requests] == [32,
                                                                                             32]
        assert [r.prompt_tokens for r in got.results] == [32, 32]
        with pytest.raises(errors.InvalidArgument,
                           match=r"^prompts\[0\]: 65 tokens exceed the model context \(64\)"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 65)]))
        assert len(stubs["A"].requests) == 1 and len(stubs["B"].requests) == 1
    finally:
        warmer.stop()


def test_a_warms_replica_failure_is_logged_with_the_warms_request_id():
    """The Warm pool's threads do not inherit the call's context: 'replica X failed' was
    logged with no request id (only the Prefill's metadata carried it)."""
    import logging

    from services.common.logs import request_id_var
    from services.orchestrator.render import PromptRenderer

    class Down(Stub):
        def _prefill(self, req, timeout=None, metadata=None):
            raise RpcError(grpc.StatusCode.UNAVAILABLE)

    orch = make({"A": Down("A", [])})
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A",)))
    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "failed" in record.getMessage():
                seen.append(request_id_var.get())

    grab = Grab()
    logger = logging.getLogger("services.orchestrator")
    logger.addHandler(grab)
    tok = request_id_var.set("warm-9")
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16)]))
    finally:
        request_id_var.reset(tok)
        logger.removeHandler(grab)
        warmer.stop()
    assert out.results[0].error.startswith("UNAVAILABLE")
    assert seen == ["warm-9"]


def test_a_warm_sends_no_prefill_once_its_deadline_has_passed():
    """Prefills queued behind the call's others (prompts x replicas share one pool) were still
    sent after the deadline, with a 0.1 s timeout: replicas computed for a caller that had its
    answer, and other tenants' Warm calls waited behind them."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from services.orchestrator.render import PromptRenderer

    class Slow(Stub):
        def _prefill(self, req, timeout=None, metadata=None):
            time.sleep(2.0)  # past the call's 1 s
            return super()._prefill(req, timeout, metadata)

    stubs = {"A": Slow("A", []), "B": Stub("B", [])}
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=50)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A", "B")))
    warmer._pool.shutdown()
    warmer._pool = ThreadPoolExecutor(max_workers=1)  # the jobs queue, as when it is busy
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="x" * 16)]), time_remaining=1.0)
    finally:
        warmer.stop()
    first, second = out.results  # A's, then B's (the jobs' order)
    assert not first.error and second.error.startswith("DEADLINE_EXCEEDED"), out
    assert stubs["B"].requests == []  # never sent


def _gated_warmer(**cfg):
    """A Warmer over three fake replicas whose prefills of prompts starting with "x" wait for
    `gate`; `inflight`/`peak` count them: (stubs, gate, inflight, peak, warmer)."""
    from services.orchestrator.render import PromptRenderer

    stubs = {r: Stub(r, []) for r in ("A", "B", "C")}
    gate, lock = threading.Event(), threading.Lock()
    inflight, peak = [0], [0]
    for stub in stubs.values():
        plain = stub.Prefill

        def held(req, timeout=None, metadata=None, plain=plain):
            if list(req.token_ids)[0] == ord("x"):  # the big call's prompts wait for the gate
                with lock:
                    inflight[0] += 1
                    peak[0] = max(peak[0], inflight[0])
                assert gate.wait(30)
                with lock:
                    inflight[0] -= 1
            return plain(req, timeout=timeout, metadata=metadata)

        stub.Prefill = Unary(held)
    orch = make(stubs)
    orch.renderer = PromptRenderer(Tok(), max_chars=100)
    return stubs, gate, inflight, peak, Warmer(orch, OrchestratorConfig(
        kvpool_addresses=("A",), **cfg))


def _prefills_timed(replica) -> float:
    """Prefills on `replica` timed in backend_call_seconds."""
    return sample_value("tiercache_orchestrator_backend_call_seconds_count", {
        "tier": "kvpool", "method": "Prefill", "address": replica.address}) or 0.0


def test_warm_caps_prefills_per_call_and_leaves_pool_threads_to_other_calls():
    """prompts x replicas was unbounded (4,096 prefills at 64 x 64), and one call queued all
    of its prefills on the 8 shared warm threads: another tenant's Warm waited for all of them."""
    stubs, gate, inflight, peak, warmer = _gated_warmer(warm_max_prefills_per_call=12)
    prompts = [orchestrator_pb2.WarmPrompt(prompt=f"x{i:02d}" + "." * 16) for i in range(5)]
    try:
        with pytest.raises(errors.InvalidArgument, match="15 prefills .* limit of 12"):
            warmer.warm(TENANT, orchestrator_pb2.WarmRequest(prompts=prompts))
        assert all(not s.requests for s in stubs.values())  # refused before any prefill
        big: list = []
        t = threading.Thread(target=lambda: big.append(warmer.warm(
            TENANT, orchestrator_pb2.WarmRequest(prompts=prompts[:4]))))
        t.start()
        deadline = time.monotonic() + 30
        while inflight[0] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        small = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=[orchestrator_pb2.WarmPrompt(prompt="y" * 16)]))
        assert [r.error for r in small.results] == ["", "", ""] and not big
        # A second big call takes the other 4 threads; a call queued behind both ends by its
        # deadline, not when a thread frees up.
        t2 = threading.Thread(target=lambda: big.append(warmer.warm(
            TENANT, orchestrator_pb2.WarmRequest(prompts=prompts[:4]))))
        t2.start()
        while inflight[0] < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        late: list = []
        t3 = threading.Thread(target=lambda: late.append(warmer.warm(
            TENANT, orchestrator_pb2.WarmRequest(
                prompts=[orchestrator_pb2.WarmPrompt(prompt="z" * 16)]), time_remaining=0.3)))
        t3.start()
        t3.join(10)
        assert late and {r.error.split(":")[0] for r in late[0].results} == {
            "DEADLINE_EXCEEDED"} and len(late[0].results) == 3
        assert inflight[0] == 8 and not big
        gate.set()
        t.join(30)
        t2.join(30)
        assert [r.prompt_index for r in big[0].results] == [i for i in range(4) for _ in "ABC"]
        assert peak[0] == 8  # two calls' windows, however many prefills each has
    finally:
        gate.set()
        warmer.stop()


def test_a_warm_whose_caller_went_away_sends_no_further_prefill_and_cancels_the_running():
    """A cancelled Warm kept prefilling and pinning for nobody, up to 120 s, holding its
    stream slot, its tenant slot and the shared warm threads. Then its prefills already
    running still ran to their own timeout on the replicas, which went on computing and
    pinning: they are cancelled now."""
    stubs, gate, inflight, _, warmer = _gated_warmer()
    gone = _Gone()
    out: list = []
    prompts = [orchestrator_pb2.WarmPrompt(prompt=f"x{i:02d}" + "." * 16) for i in range(4)]
    t = threading.Thread(target=lambda: out.append(warmer.warm(
        TENANT, orchestrator_pb2.WarmRequest(prompts=prompts), gone=gone)))
    t.start()
    try:
        holds_within(lambda: inflight[0] >= 4, 30, 0.01)
        gone.set()  # the client cancels while 4 of its 12 prefills run (and never end)
        t.join(10)
        assert not t.is_alive()
        errors_ = [r.error for r in out[0].results]
        assert all(e.startswith("CANCELLED") for e in errors_) and len(errors_) == 12
        assert sum("cancellation was sent to the replica" in e for e in errors_) == 4
        calls = [c for s in stubs.values() for c in s.Prefill.calls]
        assert len(calls) == 4 and all(c.cancelled for c in calls)  # no further one sent
    finally:
        gate.set()
        warmer.stop()


def test_a_warm_prefill_on_a_replica_found_down_is_cancelled_and_said_unavailable(caplog):
    """A Warm with one replica SIGSTOPped waited 60 s for its prefill, though the poller had
    taken it out of routing after ~9 s (a stream there fails over at once): the prefill is
    cancelled as the replica is declared down, the others run on. Its time is the replica's
    (timed as a failed call, as Generate's cut by the poller is), not a caller's going away.
    The down line says it is cancelled ("failing over 1 in-flight request(s)", it said)."""
    stubs, gate, inflight, _, warmer = _gated_warmer()
    rs = warmer.orch.replicas
    down = next(r for r in rs.replicas if r.replica_id == "A")
    timed_before = _prefills_timed(down)
    out: list = []
    t = threading.Thread(target=lambda: out.append(warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
        prompts=[orchestrator_pb2.WarmPrompt(prompt="x0" + "." * 16)]))))
    t.start()
    try:
        wait_until(lambda: inflight[0] >= 3, 30, "the Warm's three prefills never started",
                   every=0.01)
        with caplog.at_level(logging.WARNING, logger="services.orchestrator.backends"):
            caplog.clear()  # what the Warm's start logged (other threads, other loggers)
            rs._notify_down(down)
        assert [r.getMessage() for r in caplog.records
                if r.name == "services.orchestrator.backends"] == [
            f"replica {down.replica_id} is down: cancelling 1 warm prefill(s)"]
        wait_until(lambda: [c.cancelled for c in stubs["A"].Prefill.calls] == [True], 5,
                   "A's prefill was not cancelled as A was declared down")
        gate.set()
        t.join(10)
        assert sorted(r.error for r in out[0].results) == [
            "", "", f"UNAVAILABLE: replica {down.public_id} was found down during this prefill "
                    "(cancelled)"]
        assert _prefills_timed(down) == timed_before + 1
        assert not any(r.watchers for r in rs.replicas)  # each prefill's watch ended with it
    finally:
        gate.set()
        warmer.stop()


def test_a_warm_prefill_queued_for_a_replica_found_down_since_it_was_chosen_is_not_sent():
    """A prefill still queued (behind the call's window) when the poller declared its replica
    down read the down count as it started, so it was sent there all the same, and only cut at
    the next down declaration, a poll cycle later: it is not sent, its result UNAVAILABLE. The
    one running there is cancelled as before; only that one is timed (the other made no call)."""
    stubs, gate, inflight, _, warmer = _gated_warmer()
    rs = warmer.orch.replicas
    down = next(r for r in rs.replicas if r.replica_id == "B")
    timed_before = _prefills_timed(down)
    out: list = []
    # Two prompts on A, B, C: 6 prefills, the window runs 4 (x0 on A, B, C; x1 on A) and
    # queues x1 on B and C.
    prompts = [orchestrator_pb2.WarmPrompt(prompt=f"x{i}" + "." * 16) for i in range(2)]
    t = threading.Thread(target=lambda: out.append(warmer.warm(
        TENANT, orchestrator_pb2.WarmRequest(prompts=prompts))))
    t.start()
    try:
        wait_until(lambda: inflight[0] == 4, 30, "the window's 4 prefills did not start")
        rs._notify_down(down)
        wait_until(lambda: [c.cancelled for c in stubs["B"].Prefill.calls] == [True], 5,
                   "B's running prefill was not cancelled as B was declared down")
        gate.set()  # the window moves on: x1 on B and C start
        t.join(10)
        b = down.public_id
        assert [(r.prompt_index, r.error) for r in out[0].results] == [
            (0, ""),
            (0, f"UNAVAILABLE: replica {b} was found down during this prefill (cancelled)"),
            (0, ""), (1, ""),
            (1, f"UNAVAILABLE: replica {b} was found down before this prefill could start "
                "(not sent)"),
            (1, "")]
        assert len(stubs["B"].Prefill.calls) == 1  # x1 never went to B
        assert _prefills_timed(down) == timed_before + 1
        assert not any(r.watchers for r in rs.replicas)
    finally:
        gate.set()
        warmer.stop()


def test_a_warm_past_its_deadline_answers_every_prefill_without_recursing():
    """Each prefill past the deadline was answered by a recursive call: 1,500 of them (the
    cap goes to 4,096) raised RecursionError, INTERNAL to the caller."""
    _, gate, _, _, warmer = _gated_warmer()
    try:
        jobs = list(range(1500))
        assert warmer._run_windowed(lambda job: job, jobs, time.monotonic() - 1,
                                    threading.Event()) == jobs
    finally:
        gate.set()
        warmer.stop()


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_the_clients_error_names_the_replicas_last_failure_however_many_there_are(replicas):
    """With fewer replicas than max_attempts (3) the "no replica left" error used to drop the
    replicas' failure (every one INTERNAL read as a plain UNAVAILABLE); with 3 it said it."""
    from services.common import errors

    stubs = {f"R{i}": Stub(f"R{i}", [Call([], RpcError(grpc.StatusCode.INTERNAL))])
             for i in range(replicas)}
    orch = make(stubs, max_attempts=3)
    with pytest.raises(errors.TierCacheError) as got:
        generate(orch, [])
    assert got.value.code == "UNAVAILABLE" and "last: INTERNAL" in str(got.value)


def _warmer_over(index, prompts: int):
    """Two stub replicas under a Warmer whose orchestrator asks `index`, and `prompts` Warm
    prompts of two blocks or so each."""
    from services.orchestrator.render import PromptRenderer

    stubs = {r: Stub(r, []) for r in ("A", "B")}
    orch = make(stubs, prefix=index)
    orch.renderer = PromptRenderer(Tok(), max_chars=100)
    warmer = Warmer(orch, OrchestratorConfig(kvpool_addresses=("A", "B")))
    return stubs, warmer, [orchestrator_pb2.WarmPrompt(prompt=f"p{i:02d}" + "." * 30)
                           for i in range(prompts)]


def test_a_warm_for_owners_keeps_its_deadline_with_a_hung_index():
    """Choosing each prompt's owner asks the index; with the index hung each lookup waited
    the index's whole timeout (0.5 s), one prompt after another, whatever the Warm call's
    deadline: 12 prompts held a 1 s call for 6 s."""
    import time


    class HungIndex:
        timeout_s = 0.5

        def __init__(self) -> None:
            self.timeouts: list[float | None] = []

        def match(self, hashes, model_id, timeout=None, probe=False, on_call=None):
            self.timeouts.append(timeout)
            time.sleep(self.timeout_s if timeout is None else timeout)
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)

    index = HungIndex()
    _, warmer, prompts = _warmer_over(index, 12)
    t0 = time.monotonic()
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=prompts, target=orchestrator_pb2.WARM_TARGET_OWNERS), time_remaining=1.0)
    finally:
        warmer.stop()
    assert time.monotonic() - t0 < 1.5
    assert len(out.results) == 12 and all(t is not None for t in index.timeouts)
    # The lookups together took at most a quarter of the call: the prefills keep the rest
    # (each taking a quarter of what was left of the whole call used ~97% of it over 12).
    assert sum(index.timeouts) <= 0.25 * 1.0 + 0.01, sum(index.timeouts)


def test_a_warm_owner_probe_under_way_is_cancelled_when_its_caller_goes():
    """A Warm's caller gone during an owner probe of a hung index: the probe ran to the
    index's timeout (at most 0.5 s each); now it is cancelled at once, and no prefill is sent."""

    index = HungIndex()
    stubs, warmer, prompts = _warmer_over(index, 3)
    gone = _Gone()
    threading.Thread(target=lambda: index.started.wait(5) and gone.set(), daemon=True).start()
    t0 = time.monotonic()
    try:
        out = warmer.warm(TENANT, orchestrator_pb2.WarmRequest(
            prompts=prompts, target=orchestrator_pb2.WARM_TARGET_OWNERS), time_remaining=30.0,
            gone=gone)
    finally:
        warmer.stop()
    assert time.monotonic() - t0 < 2.0
    # The first probe was cancelled; none was sent after the caller went, nor any prefill.
    assert len(index.probes) == 1 and index.probes[0].cancelled.is_set()
    assert all(not s.requests for s in stubs.values())
    assert all(r.error.startswith("CANCELLED") for r in out.results)


def test_one_session_id_in_two_tenants_is_two_routing_keys():
    """A session id is unique only within its tenant: two tenants both calling theirs "s"
    were keyed to one replica on the session ring, whatever their load."""
    seen: list[str] = []

    def choose(views, matched, affinity, exclude, *rest):
        seen.append(affinity)
        return SimpleNamespace(replica_id="A", route="session", matched_tokens=0)

    orch = make({"A": Stub("A", [Call([final("A", 2)]), Call([final("A", 2)]),
                                 Call([final("A", 2)])])})
    orch.routing = SimpleNamespace(choose=choose)
    other = Tenant("b", "salt-b", 10_000, 1_000, 4)
    for tenant in (TENANT, other, TENANT):
        list(orch.generate(
            tenant=tenant, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
            sampling=Sampling(4, 0.0, 1.0, 0, (), False), policy=Policy(skip_prefix_cache=True),
            session_id="s", return_token_ids=True, request_id="rid",
            deadline=time.monotonic() + 30, on_cancel=lambda cb: None))
    assert len(seen) == 3
    assert seen[0] == seen[2]  # the same tenant's session keeps its key
    assert seen[0] != seen[1]


def test_no_store_is_sent_with_too_little_of_the_deadline_left_to_write_it():
    """A Store sent with a few ms left timed out here while the tier still wrote the entry:
    the client got DEADLINE_EXCEEDED (or a report without the entry) and an entry it could
    not name."""
    timeouts: list[float] = []

    class Recording(Semantic):
        def store(self, req, timeout=None, on_call=None):
            timeouts.append(timeout)
            return SimpleNamespace(id="e1")

    orch = make({"A": Stub("A", [])}, semantic=Recording())
    prompt = RenderedPrompt(PROMPT, "q", "ctx")
    assert orch._store(TENANT, prompt, "ok", 0, time.monotonic() + 0.06) is None  # not made
    assert timeouts == []
    assert orch._store(TENANT, prompt, "ok", 0, time.monotonic() + 10) == "e1"
    assert timeouts == [2.0]


_AFFINITY_SCRIPT = """
import time
from types import SimpleNamespace
from tests.orchestrator.test_pipeline_paths import (PROMPT, TENANT, Call, Policy,
    RenderedPrompt, Sampling, Stub, final, make)
seen = []
orch = make({"A": Stub("A", [Call([final("A", 2)])])})
orch.routing = SimpleNamespace(choose=lambda v, m, aff, *rest: seen.append(aff) or
                               SimpleNamespace(replica_id="A", route="ring", matched_tokens=0))
list(orch.generate(tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
                   sampling=Sampling(4, 0.0, 1.0, 0, (), False),
                   policy=Policy(skip_prefix_cache=True), session_id="", return_token_ids=True,
                   request_id="r", deadline=time.monotonic() + 30, on_cancel=lambda cb: None))
print(repr(seen[0]))
"""


def test_a_prompt_without_session_or_index_has_one_ring_key_in_every_orchestrator():
    """Orchestrator pods must put such a prompt on the same replica: a key built with hash()
    of a string differs between processes (PYTHONHASHSEED)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    keys = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "PYTHONPATH": os.pathsep.join([str(root), str(root / "gen")])}
        out = subprocess.run([sys.executable, "-c", _AFFINITY_SCRIPT], cwd=root, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        keys.add(out.stdout.strip().splitlines()[-1])
    assert len(keys) == 1, keys


class SpecialTok(Tok):
    all_special_ids = [0]  # the end of sequence, which an answer's text leaves out


class Recorded(Semantic):
    """A tier that answers every lookup with `look` and records each Store."""

    def __init__(self, look=None) -> None:
        super().__init__()
        self.look, self.stored = look, []

    def lookup(self, req, timeout=None, on_call=None):
        return self.look

    def store(self, req, timeout=None, on_call=None):
        self.stored.append(req)
        return SimpleNamespace(id="e1")


def ended(ids: list[int]) -> kvpool_pb2.KvGenerateResponse:
    return kvpool_pb2.KvGenerateResponse(token_ids=ids, final=kvpool_pb2.KvGenerateFinal(
        finish_reason=common_pb2.FINISH_REASON_EOS, replica_id="A"))


def test_an_answer_is_stored_with_the_models_own_ids_unless_they_are_not_its_text():
    sem = Recorded()
    orch = make({"A": Stub("A", [Call([ended([ord("o"), ord("k"), 0])]),
                                 Call([ended([ord("o"), 0xC3, 0])])])},
                semantic=sem, tok=SpecialTok())
    generate(orch, [])
    generate(orch, [])  # ends inside a character: "o" is stored, and its ids are not "o"'s
    assert [(r.answer, list(r.answer_token_ids)) for r in sem.stored] == [
        ("ok", [ord("o"), ord("k"), 0]), ("o", [])]


@pytest.mark.parametrize(("hit", "ids", "expected"), [
    (False, [7, 8], [7, 8]),  # the model's ids, not the text tokenized again
    (False, [], [ord("o"), ord("k")]),  # an entry stored without ids: its text tokenized
    (True, [7, 8], [7, 8]),
])
def test_a_draft_or_a_hit_carries_the_stored_ids_of_the_answer(hit, ids, expected):
    look = semantic_pb2.LookupResponse(hit=hit, similarity=0.99 if hit else 0.9,
                                       entry=semantic_pb2.SemanticEntry(
                                           id="e0", answer="ok", answer_token_ids=ids))
    stub = Stub("A", [Call([final("A", 2)])])
    out = generate(make({"A": stub}, semantic=Recorded(look), tok=SpecialTok()), [])
    if hit:
        assert stub.requests == []  # served by the tier
        assert [d.token_ids for d in out if isinstance(d, TextDelta)] == [expected]
    else:
        assert list(stub.requests[0].draft_token_ids) == expected


@pytest.mark.model
def test_a_word_the_model_wrote_in_unusual_pieces_is_stored_as_it_wrote_it(tok):
    """The model may write " Marathi" as " Mar" "ath" "i" where its tokenizer gives " Mar"
    "athi": tokenized again, the cached answer disagreed with the model there as a draft, and
    a hit's token ids were not the ones the model gave."""
    orch = make({"A": Stub("A", [])}, tok=tok)
    written = tok.encode("It is spoken in", add_special_tokens=False) + \
        tok.convert_tokens_to_ids(["\u0120Mar", "ath", "i", "."])
    answer = tok.decode(written + [tok.eos_token_id], skip_special_tokens=True)
    assert answer == "It is spoken in Marathi."
    assert tok.encode(answer, add_special_tokens=False) != written  # the case is exercised
    special = orch._special_ids
    assert answer_ids(tok, special, written + [tok.eos_token_id], answer) == \
        written + [tok.eos_token_id]
    # A control token inside the answer: its text leaves it out, so the ids are not the text's.
    assert answer_ids(tok, special, written[:2] + [tok.eos_token_id] + written[2:], answer) == []


# ---- found by a review (stop 54) -----------------------------------------------------------

def _metric(name: str) -> float:

    return sample_value(name) or 0.0


def test_a_replica_lost_after_the_last_token_adds_no_made_up_figures():
    """The final made for a replica lost after the answer's last token read as that replica's
    own: 0 forward passes counted as tokens - 1 saved by drafts, 0 cached tokens as the whole
    index match evicted."""
    prefix = SimpleNamespace(
        timeout_s=0.5,
        match=lambda hashes, model_id, timeout=None, probe=False, on_call=None: {"A": 96})
    msgs = [kvpool_pb2.KvGenerateResponse(token_ids=[c]) for c in b"abcd"]
    a = Stub("A", [Call(msgs, RpcError(grpc.StatusCode.UNAVAILABLE))])
    orch = make({"A": a, "B": Stub("B", [])}, prefix=prefix)
    saved = _metric("tiercache_orchestrator_forward_passes_saved_total")
    short = _metric("tiercache_orchestrator_prefix_match_shortfall_tokens_total")
    events = generate(orch, [])
    assert events[-1].completion_tokens == 4  # the answer as streamed, complete
    assert _metric("tiercache_orchestrator_forward_passes_saved_total") == saved
    assert _metric("tiercache_orchestrator_prefix_match_shortfall_tokens_total") == short


def test_a_request_out_of_time_while_waiting_to_route_leaves_no_routing_state():
    """Its time ran out waiting for the route lock; the choice was still recorded (a routed
    count, a dispatch credit), and requests sharing its prefix followed it to a replica never
    sent it."""
    a = Stub("A", [Call([final("A", 2)])])
    orch = make({"A": a})
    orch._route_lock.acquire()
    threading.Timer(0.4, orch._route_lock.release).start()  # another request routing
    with pytest.raises(errors.DeadlineExceeded):
        list(orch.generate(tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
                           sampling=Sampling(4, 0.0, 1.0, 0, (), False), policy=Policy(),
                           session_id="s", return_token_ids=True, request_id="rid",
                           deadline=time.monotonic() + 0.2, on_cancel=lambda fn: None))
    assert a.requests == []
    assert not orch.dispatched.match(orch.hasher.hashes(PROMPT, TENANT.cache_salt))
    assert not orch.routing._recent


def test_a_request_served_degraded_says_so_in_its_report():
    """A client saw a 2 s TTFT and "[model | route ring ...]" with nothing to say the semantic
    tier had been skipped (the tier was down): its report lists the request's degradations,
    the same kinds as the orchestrator's degradations metric, each once."""
    class Down(Semantic):
        def lookup(self, req, timeout=None, on_call=None):
            raise RpcError(grpc.StatusCode.UNAVAILABLE)

        def store(self, req, timeout=None, on_call=None):
            raise RpcError(grpc.StatusCode.UNAVAILABLE)

    a = Stub("A", [Call([kvpool_pb2.KvGenerateResponse(token_ids=[ord("o")])],
                        RpcError(grpc.StatusCode.UNAVAILABLE))])
    b = Stub("B", [Call([final("B", 2)])])
    orch = make({"A": a, "B": b}, semantic=Down())
    orch.routing = in_order("A", "B")
    report = generate(orch, [])[-1].report
    assert list(report.degradations) == ["semantic_skipped", "resume", "semantic_store_failed"]
    healthy = make({"A": Stub("A", [Call([final("A", 2)])])})
    assert list(generate(healthy, [])[-1].report.degradations) == []
