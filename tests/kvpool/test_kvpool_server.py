"""KvPool over a real gRPC channel (port 0) with the tiny model: contract, bad input, cancel."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, kvpool_pb2_grpc

from services.common import errors
from services.common.bootstrap import create_server
from services.kvpool.app import build_replica
from services.kvpool.config import KvPoolConfig
from services.kvpool.server import KvPoolServicer
from tests.kvpool.conftest import TINY_ID, TINY_VOCAB, assert_idle, reference_greedy
from tests.metric_sample import sample_value
from tests.waits import holds_within, wait_until

CFG = KvPoolConfig(address="127.0.0.1:0", metrics_port=-1, num_blocks=64, block_size=4,
                   max_batch_size=4, max_prefill_chunk=16, max_new_tokens_limit=64,
                   replica_id="kv-test", pin_ttl_max_seconds=30)


class Served:
    def __init__(self, cfg: KvPoolConfig, model) -> None:
        self.servicer = KvPoolServicer(cfg)
        self.handle = create_server(
            service="kvpool", address=cfg.address,
            services=[(kvpool_pb2_grpc.add_KvPoolServicer_to_server, self.servicer,
                       "tiercache.v1.KvPool")])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.handle.port}")
        self.stub = kvpool_pb2_grpc.KvPoolStub(self.channel)
        self.replica = None
        if model is not None:
            self.replica = build_replica(cfg, model=model, model_id=TINY_ID, metrics=False)
            self.servicer.attach(self.replica.engine, self.replica.info)
            self.handle.set_serving()

    def close(self) -> None:
        self.channel.close()
        self.handle.stop(0)
        if self.replica is not None:
            self.replica.engine.stop()


@pytest.fixture
def served(tiny_model) -> Iterator[Served]:
    s = Served(CFG, tiny_model)
    yield s
    try:
        assert_idle(s.replica.engine)
    finally:
        s.close()


def gen(stub, ids, timeout=20, **sampling) -> tuple[list[int], kvpool_pb2.KvGenerateFinal]:
    sampling.setdefault("max_tokens", 8)
    req = kvpool_pb2.KvGenerateRequest(token_ids=ids,
                                       sampling=common_pb2.SamplingParams(**sampling))
    toks, final = [], None
    for msg in stub.Generate(req, timeout=timeout):
        assert final is None, "nothing may follow the final message"
        toks.extend(msg.token_ids)
        if msg.HasField("final"):
            final = msg.final
    return toks, final


PROMPT = [5, 9, 17, 33, 2, 8, 44, 61, 70, 3, 12, 99, 100, 7]


def test_generate_streams_tokens_and_a_final_report(served, tiny_model) -> None:
    toks, final = gen(served.stub, PROMPT, max_tokens=10)
    assert toks == reference_greedy(tiny_model, PROMPT, 10)
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == len(PROMPT) and final.usage.completion_tokens == 10
    assert final.replica_id == "kv-test" and final.ttft_ms > 0
    toks2, final2 = gen(served.stub, PROMPT, max_tokens=10)
    assert toks2 == toks and final2.cached_tokens == 12
    st = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    assert st.model_id == TINY_ID and st.block_size == 4 and st.blocks_total == 64
    assert st.blocks_free + st.blocks_cached + st.blocks_pinned + st.blocks_in_use == 64
    assert st.prompt_tokens_total == 2 * len(PROMPT) and st.cached_tokens_total == 12
    assert st.requests_total == 2 and st.vocab_size == TINY_VOCAB and st.device == "cpu"
    assert st.dtype == "float32"
    # A model given to the replica keeps its kernels: the shared tiny model is not packed.
    assert (st.linear_kernels, st.linear_kernels_why) == ("torch", "not packed")
    # The draft proposal lengths the replica measured at its start, as its engine uses them.
    assert len(st.draft_ladder) == 3 and tuple(st.draft_ladder) == served.replica.engine.ladder()
    assert served.replica.engine.draft_ladder.source != "fixed: the engine was given no lengths"
    # Trees: their most branches as configured; the two answers carried no draft.
    assert st.draft_branches == CFG.draft_branches == served.replica.engine.draft_branches
    assert st.draft_tree_forwards_total == st.draft_tree_branch_wins_total == 0
    assert st.draft_batch_trust == 1.0  # no batch has drafted yet
    # Where they came from, and the timing (forwards of 1..max_draft_tokens + 1 tokens).
    assert st.draft_ladder_source == served.replica.engine.draft_ladder.source
    assert st.draft_ladder_source == "measured" or st.draft_ladder_source.startswith("fixed: ")
    if st.draft_ladder_source == "measured":
        assert len(st.draft_forward_costs) == CFG.max_draft_tokens + 1
        assert st.draft_forward_costs[0] == 1.0
        # What steps cost as served is learned over that timing: the two answers' 1-token
        # steps (9 each) were timed.
        assert len(st.draft_costs_served) == len(st.draft_forward_costs)
        assert st.draft_costs_served_steps[0] >= 8 and st.draft_costs_served[0] == 1.0
    else:
        assert not st.draft_costs_served and not st.draft_costs_served_steps


def test_the_last_token_travels_with_the_final_message(served) -> None:
    """A reader that holds every token of an answer also holds its end: otherwise a failover
    between the two would resume an answer that had already finished."""
    for n in (1, 3, 7):
        req = kvpool_pb2.KvGenerateRequest(token_ids=PROMPT,
                                           sampling=common_pb2.SamplingParams(max_tokens=n))
        msgs = list(served.stub.Generate(req, timeout=20))
        assert msgs[-1].HasField("final") and list(msgs[-1].token_ids)
        assert not any(m.HasField("final") for m in msgs[:-1])
        assert sum(len(m.token_ids) for m in msgs) == msgs[-1].final.usage.completion_tokens == n


def test_prefill_pins_and_the_next_request_hits(served) -> None:
    ids = list(range(1, 25))
    before = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    r = served.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=ids, pin=True, ttl_seconds=600),
                            timeout=10)
    assert (r.prompt_tokens, r.cached_tokens, r.computed_tokens, r.pinned_blocks) == (24, 0, 24, 6)
    st = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    assert st.blocks_pinned == 6
    r2 = served.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=ids), timeout=10)
    assert (r2.cached_tokens, r2.computed_tokens, r2.pinned_blocks) == (24, 0, 0)
    # Warm-up is counted apart: with requests, the replica's request count and hit ratio
    # drifted from what the orchestrator served.
    st = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    assert (st.requests_total, st.prompt_tokens_total, st.cached_tokens_total) == (
        before.requests_total, before.prompt_tokens_total, before.cached_tokens_total)
    assert st.prefills_total == before.prefills_total + 2
    assert st.prefill_computed_tokens_total == before.prefill_computed_tokens_total + 24
    _, final = gen(served.stub, ids + [3], max_tokens=2)
    assert final.cached_tokens == 24
    st = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    assert st.requests_total == before.requests_total + 1
    assert st.prompt_tokens_total == before.prompt_tokens_total + 25
    assert st.cached_tokens_total == before.cached_tokens_total + 24


def test_a_refused_pin_says_in_trailers_what_the_prefill_computed(served) -> None:
    """A prefill whose pin the pool refused had computed and cached its prompt, but the Warm
    result said 0 tokens (only the status text told), and the replica's prefill counters
    left that work out."""
    pool = served.replica.engine.pool
    before = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    saved = pool.max_pinned_per_salt
    pool.max_pinned_per_salt = 0  # this tenant's share of the pins is used up
    try:
        with pytest.raises(grpc.RpcError) as ei:
            served.stub.Prefill(kvpool_pb2.PrefillRequest(
                token_ids=list(range(30, 50)), pin=True, ttl_seconds=60), timeout=10)
    finally:
        pool.max_pinned_per_salt = saved
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ei.value.details().startswith("pin refused:")
    assert errors.prefill_work(ei.value) == (20, 0, 20)
    st = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    assert (st.blocks_pinned, st.prefills_total) == (before.blocks_pinned, before.prefills_total)
    assert st.prefill_computed_tokens_total == before.prefill_computed_tokens_total + 20
    # Computed and cached all the same: the same prompt now finds all 5 blocks cached.
    r = served.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=list(range(30, 50))),
                            timeout=10)
    assert (r.cached_tokens, r.computed_tokens) == (20, 0)


BAD = [
    (dict(token_ids=[]), "token_ids"),
    (dict(token_ids=[TINY_VOCAB]), "token_ids"),
    (dict(sampling=dict(max_tokens=0)), "sampling.max_tokens"),
    (dict(sampling=dict(max_tokens=-3)), "sampling.max_tokens"),
    (dict(sampling=dict(max_tokens=65)), "sampling.max_tokens"),
    (dict(token_ids=[1] * 1000, sampling=dict(max_tokens=30)), "token_ids"),
    (dict(sampling=dict(max_tokens=4, temperature=-0.5)), "sampling.temperature"),
    (dict(sampling=dict(max_tokens=4, top_p=1.5)), "sampling.top_p"),
    (dict(sampling=dict(max_tokens=4, top_p=-0.1)), "sampling.top_p"),
    (dict(sampling=dict(max_tokens=4, stop_token_ids=[10**6])), "sampling.stop_token_ids"),
    (dict(draft_token_ids=[TINY_VOCAB + 1]), "draft_token_ids"),
    (dict(sampling=dict(max_tokens=4, stop_token_ids=list(range(257)))),
     "sampling.stop_token_ids"),
    (dict(cache_salt="s" * 257), "cache_salt"),
]


@pytest.mark.parametrize("fields,field", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(served, fields, field) -> None:
    before = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    kw = {"token_ids": PROMPT, "sampling": {"max_tokens": 4}, **fields}
    req = kvpool_pb2.KvGenerateRequest(token_ids=kw["token_ids"],
                                       sampling=common_pb2.SamplingParams(**kw["sampling"]),
                                       draft_token_ids=kw.get("draft_token_ids", []),
                                       cache_salt=kw.get("cache_salt", ""))
    with pytest.raises(grpc.RpcError) as ei:
        list(served.stub.Generate(req, timeout=5))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith(field + ":")
    if field.startswith("sampling.") and field != "sampling.stop_token_ids":
        # The value received, as the orchestrator says it (NaN and inf too).
        value = kw["sampling"][field.split(".")[1]]
        assert float(ei.value.details().rsplit(", got ", 1)[1]) == pytest.approx(value)
    after = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    assert after == before  # state unchanged


def test_a_prefill_runs_under_the_callers_request_id(served) -> None:
    """Prefill gave its engine sequence a random id: the engine's log lines for a warm-up
    (admission failures, preemption) could not be matched to the orchestrator's Warm."""
    engine = served.replica.engine
    submitted: list[str] = []
    submit = engine.submit

    def recording(req):
        submitted.append(req.request_id)
        return submit(req)

    engine.submit = recording
    try:
        served.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=list(range(1, 25))), timeout=10,
                            metadata=[("x-request-id", "warm-7")])
    finally:
        del engine.submit
    assert submitted == ["warm-7"]


def test_prefill_is_refused_when_prefix_caching_is_off(tiny_model) -> None:
    """Nothing prefilled can be kept on such a replica: an OK with 0 pinned blocks hid that
    warm-up cannot work there. The refusal names the setting and leaves the pool as it was."""
    s = Served(replace(CFG, prefix_caching=False), tiny_model)
    try:
        before = s.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
        assert before.prefix_caching_disabled  # what the orchestrator's warm-up loop reads
        for pin in (True, False):
            with pytest.raises(grpc.RpcError) as ei:
                s.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=list(range(1, 25)), pin=pin,
                                                         ttl_seconds=60), timeout=10)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "PREFIX_CACHING" in ei.value.details()
        assert s.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5) == before
        assert_idle(s.replica.engine)
    finally:
        s.close()


def test_prefill_bad_input_and_model_mismatch(served) -> None:
    with pytest.raises(grpc.RpcError) as ei:
        served.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=[1, 2], pin=True), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("ttl_seconds:")
    with pytest.raises(grpc.RpcError) as ei:
        served.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=[]), timeout=5)
    assert ei.value.details().startswith("token_ids:")
    # Pinned, a prompt shorter than a block kept nothing, and the answer said OK.
    short = list(range(1, served.replica.engine.pool.block_size))
    with pytest.raises(grpc.RpcError) as ei:
        served.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=short, pin=True, ttl_seconds=60),
                            timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shorter than one KV block" in ei.value.details()
    assert served.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=short), timeout=10)
    with pytest.raises(grpc.RpcError) as ei:
        list(served.stub.Generate(kvpool_pb2.KvGenerateRequest(
            token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=1), model_id="other"),
            timeout=5))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "model_id" in ei.value.details()


def test_a_model_id_no_model_can_have_is_invalid_argument_naming_the_character(served):
    """A model id with a control or invisible character (the prefix index refuses it at
    Register) was a replica serving another model (FAILED_PRECONDITION, which a router looks
    past to the next replica): it is the caller's mistake, named as the index names it."""
    ok = common_pb2.SamplingParams(max_tokens=1)
    for call in (lambda: list(served.stub.Generate(kvpool_pb2.KvGenerateRequest(
                     token_ids=[1], sampling=ok, model_id="m\x1b[2J\n"), timeout=5)),
                 lambda: served.stub.Prefill(kvpool_pb2.PrefillRequest(
                     token_ids=[1, 2], model_id="llama\u200b"), timeout=5)):
        with pytest.raises(grpc.RpcError) as ei:
            call()
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith("model_id: holds U+")
    assert_idle(served.replica.engine)


def test_pool_too_small_is_resource_exhausted(tiny_model) -> None:
    s = Served(replace(CFG, num_blocks=4), tiny_model)
    try:
        with pytest.raises(grpc.RpcError) as ei:
            gen(s.stub, list(range(1, 20)), max_tokens=8)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ei.value.details().startswith(
            "token_ids: prompt (19 tokens) + sampling.max_tokens (8) need 7 KV blocks")
        with pytest.raises(grpc.RpcError) as ei:  # Prefill has no max_tokens to blame
            s.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=list(range(1, 20))), timeout=10)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ei.value.details().startswith("token_ids: the prefix needs 5 KV blocks")
        assert_idle(s.replica.engine)
    finally:
        s.close()


def test_client_cancel_and_deadline_free_every_block(served) -> None:
    req = kvpool_pb2.KvGenerateRequest(
        token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=64, ignore_eos=True))
    call = served.stub.Generate(req, timeout=20)
    first = next(call)
    assert first.token_ids
    call.cancel()
    assert_idle(served.replica.engine)
    # A deadline that expires mid-generation ends the stream with DEADLINE_EXCEEDED.
    slow_model_steps = kvpool_pb2.KvGenerateRequest(
        token_ids=list(range(1, 76)) * 2,
        sampling=common_pb2.SamplingParams(max_tokens=64, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as ei:
        list(served.stub.Generate(slow_model_steps, timeout=0.03))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(served.replica.engine)


def test_loading_replica_is_unavailable() -> None:
    s = Served(CFG, None)
    try:
        with pytest.raises(grpc.RpcError) as ei:
            s.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.close()


def test_concurrent_streams_over_grpc(served, tiny_model) -> None:
    import threading

    prompts = [PROMPT + [i + 1, i + 2] for i in range(4)]
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        results[i] = gen(served.stub, prompts[i], max_tokens=12)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for i, p in enumerate(prompts):
        assert results[i] == reference_greedy(tiny_model, p, 12)


def test_a_replica_without_prefix_index_keeps_no_events(served) -> None:
    """Events exist for the publisher; with no prefix index nobody takes them, so none pile up
    (a long-running replica would otherwise grow that list forever)."""
    assert not CFG.prefix_address
    for i in range(3):
        gen(served.stub, [i + 1, *PROMPT], max_tokens=4)
    eng = served.replica.engine
    assert eng.call(lambda: eng.pool.stats().cached).result(5) > 0  # blocks were cached...
    assert eng.take_events() == [] and eng.call(eng.pool.take_events).result(5) == []


def test_a_configured_max_context_bounds_requests(tiny_model) -> None:
    """TIERCACHE_KVPOOL_MAX_CONTEXT caps prompt + answer below the model's own context (the
    working rows grow to it): longer requests are INVALID_ARGUMENT, shorter ones served."""
    import dataclasses

    s = Served(dataclasses.replace(CFG, max_context=40), tiny_model)
    try:
        assert s.replica.info.max_context == 40
        with pytest.raises(grpc.RpcError) as e:
            gen(s.stub, list(range(1, 36)), max_tokens=8)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "context (40)" in e.value.details()
        toks, final = gen(s.stub, list(range(1, 30)), max_tokens=8)
        assert final.usage.completion_tokens == len(toks) > 0
    finally:
        s.close()


def test_draft_tokens_past_max_tokens_are_dropped_unread(served, tiny_model) -> None:
    """Only max_tokens draft tokens can ever be verified: a huge draft is cut before it is
    indexed (its n-gram index costs ~240x its wire size); the answer is unchanged."""
    want = reference_greedy(tiny_model, PROMPT, 3)
    draft = want + [7] * 50_000
    seen: list[int] = []
    submit = served.servicer.engine.submit

    def spy(req):
        seen.append(len(req.draft_token_ids))
        return submit(req)

    served.servicer.engine.submit = spy
    req = kvpool_pb2.KvGenerateRequest(token_ids=PROMPT,
                                       sampling=common_pb2.SamplingParams(max_tokens=3),
                                       draft_token_ids=draft)
    toks, final = [], None
    for msg in served.stub.Generate(req, timeout=20):
        toks.extend(msg.token_ids)
        if msg.HasField("final"):
            final = msg.final
    assert toks == want
    assert final.draft_tokens_proposed <= 3
    assert seen == [3]  # the engine got max_tokens draft tokens, not 50,003


def test_a_replica_whose_engine_stopped_refuses_calls_as_unavailable():
    # A stopped (or dead) engine thread answers nothing: Generate would hang to its deadline.
    from types import SimpleNamespace

    from services.common import errors
    from services.kvpool.server import KvPoolServicer

    s = KvPoolServicer.__new__(KvPoolServicer)
    s.engine, s.info = SimpleNamespace(running=False), object()
    with pytest.raises(errors.Unavailable, match="engine is not running"):
        s._ready()
    s.engine = SimpleNamespace(running=True)
    assert s._ready()[1] is s.info


def test_a_stream_ended_by_cancel_or_deadline_is_not_counted_ok(tiny_model) -> None:
    """A Generate whose client went away while the engine worked returned normally, so the
    RPC metric counted every cancel and deadline during a long prefill as OK (and Prefill's
    deadline as CANCELLED)."""
    import queue
    import threading

    from services.common.metrics import RPC_TOTAL

    class Silent:  # a prefill that never answers in time
        running = True
        prefix_caching = True

        def __init__(self) -> None:
            self.cancelled: list[str] = []

        def submit(self, req):
            return "s1", queue.Queue()

        def cancel(self, seq_id) -> None:
            self.cancelled.append(seq_id)

    s = Served(CFG, None)
    eng = Silent()
    from services.kvpool.engine import model_info

    s.servicer.attach(eng, model_info(tiny_model, TINY_ID))
    s.handle.set_serving()

    def count(method: str, code: str) -> float:
        return RPC_TOTAL.labels("kvpool", method, code)._value.get()

    try:
        before = {c: count("Generate", c) for c in ("OK", "CANCELLED", "DEADLINE_EXCEEDED")}
        req = kvpool_pb2.KvGenerateRequest(token_ids=PROMPT,
                                           sampling=common_pb2.SamplingParams(max_tokens=4))
        call = s.stub.Generate(req, timeout=30)
        threading.Timer(0.3, call.cancel).start()
        with pytest.raises(grpc.RpcError):
            list(call)
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(req, timeout=0.3))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        pre = count("Prefill", "DEADLINE_EXCEEDED")
        with pytest.raises(grpc.RpcError):
            s.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=PROMPT), timeout=0.3)
        holds_within(lambda: count("Generate", "DEADLINE_EXCEEDED") != before["DEADLINE_EXCEEDED"]
                     and count("Prefill", "DEADLINE_EXCEEDED") != pre, 5, 0.05)
        after = {c: count("Generate", c) for c in before}
        assert after["OK"] == before["OK"]
        assert after["CANCELLED"] == before["CANCELLED"] + 1
        assert after["DEADLINE_EXCEEDED"] == before["DEADLINE_EXCEEDED"] + 1
        assert count("Prefill", "DEADLINE_EXCEEDED") == pre + 1
        assert len(eng.cancelled) >= 3
    finally:
        s.close()


def test_a_deadline_is_counted_as_one_though_the_engine_answers_the_cancel_first(
        tiny_model) -> None:
    """At a client's deadline the RPC's end callback cancels the sequence, and the engine
    answers that cancel (Failed: Cancelled) at once: the handler raised it, so Generate and
    Prefill streams ended by their deadline were counted CANCELLED while the client saw
    DEADLINE_EXCEEDED (the differential in test_kvpool_server_differential.py found it)."""
    import queue

    from services.common.metrics import RPC_TOTAL
    from services.kvpool.engine import Failed, model_info

    class Answering:  # never finishes; answers a cancel as the real engine does
        running = True
        prefix_caching = True

        def __init__(self) -> None:
            self.outs: dict[str, queue.Queue] = {}

        def submit(self, req):
            seq = f"s{len(self.outs)}"
            self.outs[seq] = queue.Queue()
            return seq, self.outs[seq]

        def cancel(self, seq_id) -> None:
            self.outs[seq_id].put(Failed(errors.Cancelled("request cancelled")))

    s = Served(CFG, None)
    s.servicer.attach(Answering(), model_info(tiny_model, TINY_ID))
    s.handle.set_serving()

    def count(method: str, code: str) -> float:
        return RPC_TOTAL.labels("kvpool", method, code)._value.get()

    try:
        codes = ("OK", "CANCELLED", "DEADLINE_EXCEEDED")
        before = {(m, c): count(m, c) for m in ("Generate", "Prefill") for c in codes}
        req = kvpool_pb2.KvGenerateRequest(token_ids=PROMPT,
                                           sampling=common_pb2.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.RpcError) as ei:
            list(s.stub.Generate(req, timeout=0.3))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as ei:
            s.stub.Prefill(kvpool_pb2.PrefillRequest(token_ids=PROMPT), timeout=0.3)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        want = dict(before)
        want["Generate", "DEADLINE_EXCEEDED"] += 1
        want["Prefill", "DEADLINE_EXCEEDED"] += 1
        holds_within(lambda: {k: count(*k) for k in before} == want, 5, 0.05)
        assert {k: count(*k) for k in before} == want
    finally:
        s.close()


def test_seed_offset_continues_a_seeded_answer(served) -> None:
    """KvGenerateRequest.seed_offset (set by the orchestrator when it resumes an answer on
    another replica) reaches the sampler: the resumed tokens are the uninterrupted ones."""
    sp = dict(temperature=0.8, seed=99, ignore_eos=True)
    full, _ = gen(served.stub, PROMPT, max_tokens=12, **sp)
    req = kvpool_pb2.KvGenerateRequest(
        token_ids=PROMPT + full[:5], seed_offset=5,
        sampling=common_pb2.SamplingParams(max_tokens=7, **sp))
    rest = [t for msg in served.stub.Generate(req, timeout=20) for t in msg.token_ids]
    assert full[:5] + rest == full


def test_the_drafts_setting_reaches_the_engine(tiny_model) -> None:
    """TIERCACHE_KVPOOL_DRAFTS=false: the replica's engine ignores drafts."""
    for on in (True, False):
        replica = build_replica(replace(CFG, drafts=on), model=tiny_model, model_id=TINY_ID,
                                metrics=False)
        try:
            assert replica.engine.drafts is on
            if not on:  # no drafts: no lengths, and no timing spent on them
                servicer = KvPoolServicer(CFG)
                servicer.attach(replica.engine, replica.info)
                st = servicer.Stats(kvpool_pb2.KvStatsRequest(), None)
                assert (list(st.draft_ladder), st.draft_ladder_source,
                        list(st.draft_forward_costs), list(st.draft_costs_served)
                        ) == ([], "", [], [])
        finally:
            replica.engine.stop()


def test_a_long_or_odd_request_id_is_replaced_not_carried_into_sequence_ids(served,
                                                                             monkeypatch) -> None:
    """The id goes into sequence ids and every log line: a 1 MB id with newlines was taken as
    it came. Short plain ids are kept (the orchestrator's, for tracing)."""
    seen: list[str] = []
    real = served.replica.engine.submit

    def submit(req):
        seen.append(req.request_id)
        return real(req)

    monkeypatch.setattr(served.replica.engine, "submit", submit)
    for rid in ("x" * 1_000_000 + "\n", "abc\u202edef", "trace-42.a:b"):
        req = kvpool_pb2.KvGenerateRequest(token_ids=PROMPT, request_id=rid,
                                           sampling=common_pb2.SamplingParams(max_tokens=2))
        assert list(served.stub.Generate(req, timeout=20))[-1].HasField("final")
    assert len(seen[0]) <= 128 and "\n" not in seen[0]
    assert "\u202e" not in seen[1] and len(seen[1]) <= 128
    assert seen[2] == "trace-42.a:b"


def test_pin_limits_reach_the_pool(tiny_model) -> None:
    replica = build_replica(replace(CFG, num_blocks=64, max_pinned_fraction=0.5,
                                    max_pinned_per_tenant_fraction=0.25),
                            model=tiny_model, model_id=TINY_ID, metrics=False)
    try:
        assert (replica.engine.pool.max_pinned, replica.engine.pool.max_pinned_per_salt) \
            == (32, 16)
    finally:
        replica.engine.stop()


def test_a_dead_engine_turns_health_not_serving_so_the_replica_is_restarted() -> None:
    """Health stayed SERVING with the engine thread dead (every call UNAVAILABLE), so the
    liveness probe never restarted the replica; a drain's own engine stop says nothing."""
    import threading
    from types import SimpleNamespace

    from services.kvpool.server import watch_engine

    calls: list[bool] = []
    engine = SimpleNamespace(running=True)
    handle = SimpleNamespace(stopped=threading.Event(), set_serving=calls.append)
    t = watch_engine(engine, handle, every=0.01)
    engine.running = False  # the thread died
    t.join(5)
    assert not t.is_alive() and calls == [False]

    calls.clear()
    engine.running, handle.stopped = True, threading.Event()
    t = watch_engine(engine, handle, every=0.01)
    handle.stopped.set()  # the server drained and stopped...
    engine.running = False  # ... then stopped its engine
    t.join(5)
    assert not t.is_alive() and calls == []


def test_a_stalled_engine_turns_health_not_serving_until_it_steps_again() -> None:
    """Only a dead engine thread was noticed: one stuck step (a hung device, a deadlock) held
    every stream on the replica while health said SERVING, so nothing restarted it."""
    from types import SimpleNamespace

    from services.kvpool.server import watch_engine

    calls: list[bool] = []
    age = [0.0]
    moved = threading.Event()

    def set_serving(serving: bool) -> None:
        calls.append(serving)
        moved.set()

    engine = SimpleNamespace(running=True, stalled_for=lambda: age[0])
    handle = SimpleNamespace(stopped=threading.Event(), set_serving=set_serving)
    t = watch_engine(engine, handle, every=0.01, stall_seconds=5.0)
    try:
        age[0] = 4.9  # a slow step is not a stall
        time.sleep(0.1)
        assert calls == []
        age[0] = 5.1
        assert moved.wait(5) and calls == [False]
        moved.clear()
        time.sleep(0.1)
        assert calls == [False]  # said once, not on every check
        age[0] = 0.2  # the step finished
        assert moved.wait(5) and calls == [False, True]
    finally:
        handle.stopped.set()
        t.join(5)
    assert not t.is_alive()


@pytest.mark.parametrize("pause", [30.0, 4.8])  # 4.8 + the idle 0.5 s: past the 5 s limit
def test_a_pause_of_the_whole_process_is_not_read_as_a_stalled_engine(pause: float) -> None:
    """After SIGSTOP (or a paused VM) the watch woke before the idle engine's next turn and
    read the pause's length as a stuck step: an ERROR and NOT_SERVING for a second."""
    from types import SimpleNamespace

    from services.kvpool.server import watch_engine

    calls: list[bool] = []
    state = {"now": 0.0, "pause": False, "age": 0.0, "after_pause": [], "ticks": 0}
    lock = threading.Lock()

    def clock() -> float:
        with lock:
            state["ticks"] += 1
            if state["pause"]:  # the process stood still before this tick...
                state["pause"] = False
                state["now"] += pause
                # ...and the idle engine (its last turn up to 0.5 s before the pause) had not
                # turned yet: it does before the next tick.
                state["after_pause"] = [pause + 0.5, state["ticks"]]
            return state["now"]

    def stalled_for() -> float:
        with lock:
            pending = state["after_pause"]
            return pending[0] if pending and pending[1] == state["ticks"] else state["age"]

    def wait_ticks(n: int) -> None:
        with lock:
            until = state["ticks"] + n

        def ticked() -> bool:
            with lock:
                return state["ticks"] >= until

        wait_until(ticked, 5, "the watch stopped ticking", 0.005)

    engine = SimpleNamespace(running=True, stalled_for=stalled_for)
    handle = SimpleNamespace(stopped=threading.Event(), set_serving=calls.append)
    t = watch_engine(engine, handle, every=0.01, stall_seconds=5.0, clock=clock)
    try:
        wait_ticks(3)
        with lock:
            state["pause"] = True
        wait_ticks(5)
        assert calls == []
        with lock:
            state["age"] = 6.0  # a real stall, the watch on time: still caught
        holds_within(lambda: calls, 5, 0.01)
        assert calls == [False]
    finally:
        handle.stopped.set()
        t.join(5)


def test_the_engine_reports_how_long_its_loop_has_been_stuck(make_engine) -> None:
    eng = make_engine()
    assert eng.stalled_for() < 2.0  # idle: the loop turns every ~0.5 s
    started, release = threading.Event(), threading.Event()
    fut = eng.call(lambda: (started.set(), release.wait(10)))
    assert started.wait(5)
    time.sleep(1.0)
    assert eng.stalled_for() >= 0.9  # a call run between steps holds the loop
    release.set()
    fut.result(5)
    holds_within(lambda: eng.stalled_for() <= 0.8, 5, 0.05)
    assert eng.stalled_for() <= 0.8


def test_running_totals_are_exported_as_counters_that_only_add_what_is_new() -> None:
    """Blocks evicted (kvpool) and nodes pruned (prefix) were gauges holding running totals:
    rate() and increase() are meant for counters, and the prefix one was named like one."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from services.kvpool.metrics import KvMetrics
    from services.prefix.server import PrefixServicer

    def value(name: str) -> float:
        return sample_value(name) or 0.0

    m = KvMetrics()
    stats = SimpleNamespace(blocks_total=8, blocks_free=1, blocks_cached=2, blocks_pinned=0,
                            blocks_in_use=5, running=1, waiting=0, evictions_total=3,
                            preemptions_total=0)
    before = value("tiercache_kvpool_evictions_total")
    m.observe(stats)
    m.observe(stats)  # the same total again adds nothing
    stats.evictions_total = 7
    m.observe(stats)
    assert value("tiercache_kvpool_evictions_total") - before == 7

    class Tree:
        pruned_total = 2
        unheld = 3

        def __len__(self) -> int:
            return 0

    index = SimpleNamespace(tree=Tree(), replica_count=0, clock=time.monotonic,
                            dropped_blocks_total=1)
    before = value("tiercache_prefix_pruned_total")
    dropped = value("tiercache_prefix_dropped_blocks_total")
    s = PrefixServicer(index)
    s._gauges()
    index.tree.pruned_total, index.dropped_blocks_total = 5, 4
    s._gauges()
    s._gauges()
    assert value("tiercache_prefix_pruned_total") - before == 5
    assert value("tiercache_prefix_dropped_blocks_total") - dropped == 4
    assert value("tiercache_prefix_unheld_nodes") == 3  # what the sweeper has still to reap
    kinds = {m.name: m.type for m in REGISTRY.collect()}
    assert kinds["tiercache_kvpool_evictions"] == kinds["tiercache_prefix_pruned"] == "counter"


def test_stats_say_how_long_the_engine_has_not_turned(served) -> None:
    """The orchestrator takes a replica whose engine is stuck out of routing; Stats (answered
    by the gRPC server, which stays responsive) must say so."""
    import threading
    import time

    assert served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5).stalled_for_s == 0
    release = threading.Event()
    served.replica.engine.call(lambda: release.wait(10))  # a step that does not end
    try:
        time.sleep(1.5)
        stuck = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5).stalled_for_s
        assert stuck >= 1.0
    finally:
        release.set()
    wait_until(lambda: served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5).stalled_for_s
               < 1.0, 5, every=0.05)


def test_a_direct_client_that_stops_reading_is_ended_after_send_stall_seconds(tiny_model):
    """A caller of kvpool itself that stopped reading (no deadline, a small receive window)
    held the handler inside a send, and its worker thread, for good: the replica ran no
    reaper. Enough such streams took the replica down."""
    import queue

    from services.common.metrics import RPC_TOTAL
    from services.kvpool.engine import TokenDelta, model_info

    class Endless:  # an answer far longer than the client's window
        running = True
        prefix_caching = True

        def __init__(self) -> None:
            self.cancelled = threading.Event()

        def submit(self, req):
            out: queue.Queue = queue.Queue()

            def feed() -> None:
                while not self.cancelled.is_set():
                    out.put(TokenDelta(list(range(2000))))
                    time.sleep(0.01)

            threading.Thread(target=feed, daemon=True).start()
            return "s1", out

        def cancel(self, seq_id) -> None:
            self.cancelled.set()

    s = Served(replace(CFG, send_stall_seconds=1.0), None)
    eng = Endless()
    s.servicer.attach(eng, model_info(tiny_model, TINY_ID))
    s.handle.set_serving()
    window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    stuck = grpc.insecure_channel(f"127.0.0.1:{s.handle.port}", options=window)
    before = RPC_TOTAL.labels("kvpool", "Generate", "DEADLINE_EXCEEDED")._value.get()
    try:
        req = kvpool_pb2.KvGenerateRequest(token_ids=PROMPT,
                                           sampling=common_pb2.SamplingParams(max_tokens=64))
        call = kvpool_pb2_grpc.KvPoolStub(stuck).Generate(req)  # no deadline
        assert next(call).token_ids  # started; then never read again
        assert eng.cancelled.wait(15), "the stream was never ended"
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "send_stall_seconds" in e.value.details()
        holds_within(lambda: RPC_TOTAL.labels("kvpool", "Generate", "DEADLINE_EXCEEDED")
                     ._value.get() != before, 5, 0.05)
        # Counted as the client was told, not CANCELLED.
        assert RPC_TOTAL.labels("kvpool", "Generate", "DEADLINE_EXCEEDED")._value.get() == (
            before + 1)
    finally:
        stuck.close()
        s.close()


def test_send_stall_seconds_is_checked():
    with pytest.raises(ValueError, match="SEND_STALL_SECONDS"):
        replace(CFG, send_stall_seconds=0.5).validate()
    replace(CFG, send_stall_seconds=0).validate()
