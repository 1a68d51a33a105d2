"""Contracts of the orchestrator's pieces that a wrong constant or a swapped field would break
silently: the semantic namespace, the policy flags, session affinity, failover resume, cut-short
hits, replica free blocks, routing boundaries, tenant salts and context hashes.

Pipeline tests are pure logic with the fakes of test_pipeline_paths (no processes, no model);
the context-hash test renders with the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, semantic_pb2

from services.common.ring import HashRing
from services.orchestrator.backends import ReplicaSet
from services.orchestrator.pipeline import (
    Finished,
    Policy,
    Sampling,
    TextDelta,
    session_routing_key,
)
from services.orchestrator.render import Message, PromptRenderer, RenderedPrompt
from services.orchestrator.routing import PrefixAwarePolicy, ReplicaView, bounded_cap
from services.orchestrator.server import parse_policy
from services.orchestrator.tenants import TenantRegistry
from tests.metric_sample import sample_value
from tests.orchestrator.test_pipeline_paths import (
    PROMPT,
    TENANT,
    Call,
    RpcError,
    Semantic,
    Stub,
    final,
    make,
)


class RecordingSemantic(Semantic):
    """The semantic fake, keeping every Lookup/Store request and answering `answer`."""

    def __init__(self, answer: semantic_pb2.LookupResponse | None = None) -> None:
        super().__init__()
        self.answer = answer or semantic_pb2.LookupResponse()
        self.lookups: list[semantic_pb2.LookupRequest] = []
        self.stores: list[semantic_pb2.StoreRequest] = []

    def lookup(self, req, timeout=None, on_call=None):
        self.lookups.append(req)
        return self.answer

    def store(self, req, timeout=None, on_call=None):
        self.stores.append(req)
        return SimpleNamespace(id=f"stored-{len(self.stores)}")


def run(orch, *, prompt: RenderedPrompt | None = None, policy: Policy = Policy(),
        session_id: str = "s", max_tokens: int = 4, sampling: Sampling | None = None) -> list:
    """The request's events; greedy `max_tokens` unless `sampling` is given."""
    return list(orch.generate(
        tenant=TENANT, prompt=prompt or RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=sampling or Sampling(max_tokens, 0.0, 1.0, 0, (), False), policy=policy,
        session_id=session_id, return_token_ids=True, request_id="rid",
        deadline=time.monotonic() + 30, on_cancel=lambda fn: None))


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def finished(events) -> Finished:
    fin = [e for e in events if isinstance(e, Finished)]
    assert len(fin) == 1
    return fin[0]


def one_replica(n_calls: int = 1) -> tuple[Stub, dict[str, Stub]]:
    stub = Stub("A", [Call([final("A", 2)]) for _ in range(n_calls)])
    return stub, {"A": stub}


# ---- semantic namespace (M26) ------------------------------------------------------------

def test_semantic_lookup_and_store_use_the_prompts_context_and_the_tenants_name():
    sem = RecordingSemantic()
    stub, stubs = one_replica()
    prompt = RenderedPrompt(PROMPT, "what is a kv cache?", "0123456789abcdef0123456789abcdef")
    events = run(make(stubs, semantic=sem), prompt=prompt)
    assert text_of(events) == "ok"
    assert len(sem.lookups) == 1 and len(sem.stores) == 1
    for req in (sem.lookups[0], sem.stores[0]):
        assert req.namespace.context_hash == prompt.context_hash
        assert req.namespace.tenant == TENANT.name
        assert req.namespace.model_id == "m"
    assert sem.lookups[0].text == prompt.query_text
    assert sem.stores[0].prompt == prompt.query_text and sem.stores[0].answer == "ok"


# ---- cache policy flags (M29) ------------------------------------------------------------

POLICY_FLAGS = ("skip_semantic_lookup", "skip_semantic_store", "skip_prefix_cache", "skip_draft",
                "store_sampled", "serve_sampled")


@pytest.mark.parametrize("flag", POLICY_FLAGS)
def test_each_cache_policy_flag_lands_in_the_same_named_policy_field(flag):
    policy = parse_policy(common_pb2.CachePolicy(**{flag: True}))
    assert {f: getattr(policy, f) for f in POLICY_FLAGS} == {f: f == flag for f in POLICY_FLAGS}


def test_cache_policy_tier_and_threshold_are_carried_over():
    policy = parse_policy(common_pb2.CachePolicy(semantic_tier="strict", semantic_threshold=0.5))
    assert (policy.semantic_tier, policy.semantic_threshold) == ("strict", 0.5)
    assert not any(getattr(policy, f) for f in POLICY_FLAGS)


def test_skip_semantic_store_still_looks_up_but_stores_nothing():
    sem = RecordingSemantic()
    stub, stubs = one_replica()
    events = run(make(stubs, semantic=sem), policy=Policy(skip_semantic_store=True))
    assert text_of(events) == "ok" and len(stub.requests) == 1
    assert len(sem.lookups) == 1
    assert sem.stores == []


def test_skip_semantic_lookup_still_stores_the_answer():
    sem = RecordingSemantic()
    stub, stubs = one_replica()
    events = run(make(stubs, semantic=sem), policy=Policy(skip_semantic_lookup=True))
    assert text_of(events) == "ok" and len(stub.requests) == 1
    assert sem.lookups == []
    assert len(sem.stores) == 1 and sem.stores[0].answer == "ok"


# ---- session affinity (M37) --------------------------------------------------------------

def test_without_an_index_a_prompt_follows_its_session_on_the_ring():
    ids = ("A", "B", "C")
    stubs = {r: Stub(r, [Call([final(r, 2)]) for _ in range(2)]) for r in ids}
    orch = make(stubs)  # no prefix index
    orch.dispatched = None  # no dispatch memory: only the ring places the prompt
    # The policy's ring, as it will be once synced with the three replicas (all idle).
    ring = HashRing(ids, vnodes=orch.routing.ring.vnodes)
    idle = {r: 0.0 for r in ids}
    owner = {f"session-{i}": ring.lookup_bounded(session_routing_key(TENANT, f"session-{i}"),
                                                 idle, orch.routing.epsilon)
             for i in range(64)}
    first = "session-0"
    second = next(s for s, r in owner.items() if r != owner[first])
    for session in (first, second):
        fin = finished(run(orch, session_id=session))
        assert fin.report.route == "ring"
        assert fin.report.replica_id == owner[session]
    assert {r: len(s.requests) for r, s in stubs.items()} == {
        r: (owner[first] == r) + (owner[second] == r) for r in ids}


# ---- failover resume (M20/M22) -----------------------------------------------------------

def tokens(text: str) -> kvpool_pb2.KvGenerateResponse:
    return kvpool_pb2.KvGenerateResponse(token_ids=list(text.encode()))


class OrderedStub(Stub):
    """A replica whose Generate calls are taken from a list shared by every replica (so the
    first call anywhere gets the first stream), noting in `asked` who was called when."""

    def __init__(self, rid: str, calls: list[Call], asked: list[Stub]) -> None:
        super().__init__(rid, [])
        self.calls, self.asked = calls, asked

    def Generate(self, req, timeout=None, metadata=None):  # noqa: N802
        self.asked.append(self)
        return super().Generate(req, timeout, metadata)


def two_replicas(calls: list[Call]) -> tuple[dict[str, OrderedStub], list[Stub]]:
    """Replicas A and B taking their streams from `calls` in order, and who was asked when."""
    asked: list[Stub] = []
    return {r: OrderedStub(r, calls, asked) for r in ("A", "B")}, asked


def test_a_replica_lost_mid_answer_is_resumed_elsewhere_from_the_tokens_already_sent():
    draft = "hello world"
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=False, similarity=0.9, entry=semantic_pb2.SemanticEntry(id="e9", answer=draft)))
    # Whichever replica is asked first streams "he" and dies; the other finishes the answer.
    calls = [Call([tokens("he")], RpcError(grpc.StatusCode.UNAVAILABLE)),
             Call([tokens("llo"), kvpool_pb2.KvGenerateResponse(final=kvpool_pb2.KvGenerateFinal(
                 finish_reason=common_pb2.FINISH_REASON_LENGTH))])]
    stubs, asked = two_replicas(calls)
    orch = make(stubs, semantic=sem)
    events = run(orch, max_tokens=16)

    assert len(asked) == 2 and asked[0] is not asked[1]
    lost, resumer = asked
    first, resumed = lost.requests[0], resumer.requests[0]
    assert list(first.token_ids) == PROMPT and first.sampling.max_tokens == 16
    assert list(first.draft_token_ids) == list(draft.encode())
    sent = list(b"he")
    assert list(resumed.token_ids) == PROMPT + sent
    assert resumed.sampling.max_tokens == 16 - len(sent)
    # A seeded answer continues its randomness where it stopped, not from its start.
    assert first.seed_offset == 0 and resumed.seed_offset == len(sent)
    assert list(resumed.draft_token_ids) == list(draft.encode())[len(sent):]
    assert resumed.cache_salt == first.cache_salt == TENANT.cache_salt

    assert text_of(events) == "hello"  # the tokens before the failure are not emitted twice
    fin = finished(events)
    assert fin.report.route == "resume"
    # The final message names no replica and none was polled: the resumer's public name.
    assert fin.report.replica_id == orch.replicas.by_id(resumer.rid).public_id
    assert fin.report.replica_id.startswith("kvpool#")
    assert fin.completion_tokens == len("hello")
    assert orch.stats.degradations["resume"] == 1
    assert sem.stores[0].answer == "hello"


@pytest.mark.parametrize(("streamed", "sampling", "reason"), [
    (b"abcd", dict(max_tokens=4), common_pb2.FINISH_REASON_LENGTH),
    (b"hi!", dict(max_tokens=16, stop_token_ids=(ord("!"),)), common_pb2.FINISH_REASON_STOP),
    (b"hi\x00", dict(max_tokens=16), common_pb2.FINISH_REASON_EOS),  # 0: the fake's EOS
    # The EOS id given as a stop token too: EOS, as the replica says (a whole answer).
    (b"hi\x00", dict(max_tokens=16, stop_token_ids=(0,)), common_pb2.FINISH_REASON_EOS),
])
def test_a_replica_lost_after_the_answers_last_token_is_not_resumed(streamed, sampling, reason):
    """The stream broke after the last token, before the final message: the resume asked for
    max_tokens 0 (the replica's INVALID_ARGUMENT reached a client whose answer had arrived
    whole), or, after a stop token or EOS, generated on past the answer's end and stored
    that."""
    sem = RecordingSemantic()
    calls = [Call([kvpool_pb2.KvGenerateResponse(token_ids=list(streamed))],
                  RpcError(grpc.StatusCode.UNAVAILABLE)),
             Call([tokens(" more"), kvpool_pb2.KvGenerateResponse(final=kvpool_pb2.KvGenerateFinal(
                 finish_reason=common_pb2.FINISH_REASON_LENGTH))])]
    stubs, asked = two_replicas(calls)
    orch = make(stubs, semantic=sem)
    spec = dict(dict(temperature=0.0, top_p=1.0, seed=0, stop_token_ids=(), ignore_eos=False),
                **sampling)
    events = run(orch, sampling=Sampling(**spec))
    assert len(asked) == 1  # no resume
    fin = finished(events)
    assert fin.finish_reason == reason and fin.completion_tokens == len(streamed)
    assert text_of(events) == streamed.decode().rstrip("\x00")
    assert fin.report.replica_id == orch.replicas.by_id(asked[0].rid).public_id
    assert [st.answer for st in sem.stores] == [streamed.decode().rstrip("\x00")]
    assert orch.stats.degradations["resume"] == 1  # the replica did fail


def test_an_unseeded_sample_resumed_elsewhere_continues_the_same_draw():
    # Seed 0 went to the replica as "unseeded": a resumed answer went on from a new random
    # seed there. The orchestrator now picks the seed, and the resume carries it on.
    calls = [Call([tokens("he")], RpcError(grpc.StatusCode.UNAVAILABLE)),
             Call([tokens("llo"), kvpool_pb2.KvGenerateResponse(final=kvpool_pb2.KvGenerateFinal(
                 finish_reason=common_pb2.FINISH_REASON_LENGTH))])]
    stubs, asked = two_replicas(calls)
    orch = make(stubs, semantic=RecordingSemantic())
    run(orch, sampling=Sampling(max_tokens=16, temperature=0.8, top_p=1.0, seed=0,
                                stop_token_ids=(), ignore_eos=False))
    first, resumed = asked[0].requests[0], asked[1].requests[0]
    assert first.sampling.seed != 0
    assert resumed.sampling.seed == first.sampling.seed and resumed.seed_offset == 2


# ---- cut-short semantic hits (M21) -------------------------------------------------------

def cut_hit(answer: str, truncated_at: int) -> RecordingSemantic:
    return RecordingSemantic(semantic_pb2.LookupResponse(
        hit=True, similarity=0.99,
        entry=semantic_pb2.SemanticEntry(id="e1", answer=answer, truncated_at=truncated_at)))


def test_a_hit_cut_at_exactly_max_tokens_is_served_from_the_cache():
    max_tokens = 8
    answer = "abcdefgh"  # the fake tokenizer: one token per byte, so 8 tokens
    stub, stubs = one_replica()
    orch = make(stubs, semantic=cut_hit(answer, max_tokens))
    events = run(orch, max_tokens=max_tokens)
    assert stub.requests == []
    assert text_of(events) == answer
    fin = finished(events)
    assert fin.report.semantic_hit and fin.report.route == "semantic"
    # Served whole, but the stored answer was itself cut at max_tokens: the run it stands for
    # ended LENGTH (CACHED says "whole"; clients continue an answer that ended LENGTH).
    assert fin.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert fin.completion_tokens == max_tokens
    assert orch.stats.semantic_hits_too_short == 0


def test_a_hit_cut_shorter_than_max_tokens_goes_to_the_model_as_a_draft():
    max_tokens = 8
    answer = "abcdefg"  # cut after 7 tokens: cannot stand for an 8-token answer
    stub = Stub("A", [Call([kvpool_pb2.KvGenerateResponse(
        token_ids=list(b"ok"), final=kvpool_pb2.KvGenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_EOS, replica_id="A"))])])
    orch = make({"A": stub}, semantic=cut_hit(answer, max_tokens - 1))
    events = run(orch, max_tokens=max_tokens)
    assert len(stub.requests) == 1
    assert list(stub.requests[0].draft_token_ids) == list(answer.encode())
    assert text_of(events) == "ok"
    fin = finished(events)
    assert not fin.report.semantic_hit and fin.report.route == "ring"
    # The draft's source and the entry this answer was stored as (what Feedback rates).
    assert fin.report.draft_entry_id == "e1"
    assert fin.report.semantic_entry_id == "stored-1"
    assert orch.stats.semantic_hits_too_short == 1


# ---- replica views (M36) -----------------------------------------------------------------

class StatsStub:
    def __init__(self, resp: kvpool_pb2.KvStatsResponse) -> None:
        self.resp = resp

    def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
        return self.resp


def test_views_report_the_free_blocks_of_the_last_stats_poll():
    replicas = ReplicaSet(("A", "B"), "")
    stats = {"A": kvpool_pb2.KvStatsResponse(replica_id="A", incarnation="i", blocks_total=500,
                                             blocks_free=123, blocks_cached=77, running=1),
             "B": kvpool_pb2.KvStatsResponse(replica_id="B", incarnation="i", blocks_total=400,
                                             blocks_free=9, blocks_in_use=300)}
    for r in replicas.replicas:
        r.stub = StatsStub(stats[r.address])
    assert [v.free_blocks for v in replicas.views()] == [-1, -1]  # never polled: unknown
    replicas.poll_once()
    views = {v.replica_id: v for v in replicas.views()}
    assert views["A"].free_blocks == 123 and views["B"].free_blocks == 9
    assert views["A"].load == 1 and views["B"].load == 0


# ---- routing boundaries (M01, M02) -------------------------------------------------------

def idle(*ids: str) -> list[ReplicaView]:
    return [ReplicaView(r, 0.0) for r in ids]


def test_a_match_of_exactly_min_prefix_tokens_is_useful():
    p = PrefixAwarePolicy(min_prefix_tokens=32)
    d = p.choose(idle("r0", "r1", "r2"), {"r1": 32}, "s")
    assert (d.replica_id, d.route, d.matched_tokens) == ("r1", "prefix", 32)
    short = PrefixAwarePolicy(min_prefix_tokens=32).choose(idle("r0", "r1", "r2"), {"r1": 31}, "s")
    assert short.route == "ring"


@pytest.mark.parametrize(("loads", "epsilon", "cap"), [
    # ceil((1 + eps) * (total + 1) / n) - 1, worked by hand:
    ([6, 1, 1], 0.25, 3),  # 1.25 * 9 / 3 = 3.75 -> 4 - 1
    ([2, 0], 0.25, 1),  # 1.25 * 3 / 2 = 1.875 -> 2 - 1
    ([0, 0], 0.25, 0),  # 1.25 * 1 / 2 = 0.625 -> 1 - 1
    ([7, 0, 0, 0, 0], 0.25, 1),  # 1.25 * 8 / 5 = 2.0 exactly -> 2 - 1
    ([3, 1], 0.0, 2),  # 5 / 2 = 2.5 -> 3 - 1
    ([1, 1, 0], 0.0, 0),  # 3 / 3 = 1.0 exactly -> 1 - 1
    ([], 0.25, 1),  # no replicas counts as one: 1.25 * 1 / 1 -> 2 - 1
])
def test_bounded_cap_is_the_documented_formula(loads, epsilon, cap):
    assert bounded_cap(loads, epsilon) == cap


# ---- ring bounded lookup (M04) -----------------------------------------------------------

def test_a_sessions_owner_keeps_it_while_its_load_plus_one_is_within_the_cap():
    ring = HashRing(["n0", "n1"], vnodes=64)
    key = "session-x"
    owner = ring.lookup(key)
    (other,) = [n for n in ring.nodes if n != owner]
    # total 1 + 0 + 1 = 2: cap ceil(1.25 * 2 / 2) = 2; the owner's 1 + 1 <= 2 qualifies.
    assert ring.lookup_bounded(key, {owner: 1, other: 0}, 0.25) == owner
    # epsilon 0, total 1 + 1 + 1 = 3: cap ceil(3 / 2) = 2; still 1 + 1 <= 2.
    assert ring.lookup_bounded(key, {owner: 1, other: 1}, 0.0) == owner
    # total 2 + 0 + 1 = 3: cap ceil(1.25 * 3 / 2) = 2; the owner's 2 + 1 > 2 spills.
    assert ring.lookup_bounded(key, {owner: 2, other: 0}, 0.25) == other


# ---- tenant salts (M05) ------------------------------------------------------------------

KEY = b"configured-secret-key"


def test_tenant_salts_are_keyed_with_the_configured_key():
    assert TenantRegistry.salt_for("alice", KEY) != TenantRegistry.salt_for("alice", b"")
    reg = TenantRegistry.build(tokens_file="", tokens="tok-a=alice", key=KEY,
                               max_prompt_tokens=100, max_tokens=50, max_concurrent=2)
    alice = reg.authenticate({"authorization": "Bearer tok-a"})
    assert alice.cache_salt == TenantRegistry.salt_for("alice", KEY)
    assert alice.cache_salt != TenantRegistry.salt_for("alice", b"")
    local = TenantRegistry.build(tokens_file="", tokens="", key=KEY, max_prompt_tokens=100,
                                 max_tokens=50, max_concurrent=2).authenticate({})
    assert local.cache_salt == TenantRegistry.salt_for("default", KEY)
    assert local.cache_salt != TenantRegistry.salt_for("default", b"")


# ---- context hash of a conversation (M34) ------------------------------------------------

@pytest.fixture(scope="module")
def renderer(tok):
    return PromptRenderer(tok, max_chars=1000)


@pytest.mark.model  # the real SmolLM2 tokenizer
def test_context_hash_covers_every_earlier_turn_not_just_the_system_prompt(renderer):
    system, q = Message("system", "You are terse."), Message("user", "And the second one?")

    def chat(u: str, a: str, query: Message = q):
        return renderer.render_chat([system, Message("user", u), Message("assistant", a), query])

    one = chat("Name a prime.", "2.")
    other = chat("Name a colour.", "Red.")
    assert one.context_hash != other.context_hash
    again = chat("Name a prime.", "2.")
    assert again.context_hash == one.context_hash
    # The query itself is not context: another question in the same conversation shares it.
    assert chat("Name a prime.", "2.", Message("user", "Why?")).context_hash == one.context_hash


@pytest.mark.parametrize(("field", "value"), [
    ("kvpool_addresses", ("127.0.0.1:1", "127.0.0.1:1")),
    ("prefix_addresses", ("p:1", "q")),
    ("kvpool_addresses", ("", " ")),
    ("semantic_address", "s:1,s:1"),
    ("semantic_address", "s"),
])
def test_bad_address_lists_fail_the_start_naming_the_variable(field, value):
    from services.common.config import ConfigError
    from services.orchestrator.config import OrchestratorConfig

    with pytest.raises(ConfigError, match=f"TIERCACHE_ORCHESTRATOR_{field.upper()}"):
        OrchestratorConfig(**{field: value}).validate()


@pytest.mark.parametrize("field, value", [("replica_poll_s", 1e-9), ("warm_interval_s", 1e-9),
                                          ("warm_interval_s", 0.5)])
def test_poll_and_warm_intervals_that_would_spin_fail_the_start(field, value):
    from services.common.config import ConfigError
    from services.orchestrator.config import OrchestratorConfig

    with pytest.raises(ConfigError, match=f"TIERCACHE_ORCHESTRATOR_{field.upper()}"):
        OrchestratorConfig(**{field: value}).validate()
    OrchestratorConfig(warm_interval_s=0).validate()  # off
    OrchestratorConfig(warm_interval_s=-1).validate()


# ---- drafts switched off (issue 7: per request and by config) ---------------------------

NEAR = semantic_pb2.LookupResponse(hit=False, similarity=0.9,
                                   entry=semantic_pb2.SemanticEntry(id="e9",
                                                                    answer="hello world"))


def test_a_near_miss_becomes_the_draft_unless_the_request_or_the_config_says_no():
    sem = RecordingSemantic(NEAR)
    stub, stubs = one_replica()
    run(make(stubs, semantic=sem))
    assert sem.lookups[0].want_draft and len(stub.requests[0].draft_token_ids) > 0

    sem = RecordingSemantic(NEAR)
    stub, stubs = one_replica()
    run(make(stubs, semantic=sem), policy=Policy(skip_draft=True))  # per request
    assert not sem.lookups[0].want_draft and not stub.requests[0].draft_token_ids

    sem = RecordingSemantic(NEAR)
    stub, stubs = one_replica()
    orch = make(stubs, semantic=sem)
    orch.enable_drafts = False  # TIERCACHE_ORCHESTRATOR_ENABLE_DRAFTS=false
    run(orch)
    assert not sem.lookups[0].want_draft and not stub.requests[0].draft_token_ids


def test_the_drafts_settings_are_read_from_the_environment():
    from services.common.config import load_config
    from services.kvpool.config import KvPoolConfig
    from services.orchestrator.config import OrchestratorConfig

    o = load_config(OrchestratorConfig, "orchestrator", [],
                    {"TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES": "h:1",
                     "TIERCACHE_ORCHESTRATOR_ENABLE_DRAFTS": "false"})
    assert o.enable_drafts is False
    k = load_config(KvPoolConfig, "kvpool", [], {"TIERCACHE_KVPOOL_DRAFTS": "false"})
    assert k.drafts is False


def test_the_report_and_metrics_split_accepted_draft_tokens_by_source():
    """The cached near-miss's own contribution is draft - lookup; prompt-lookup guesses are
    not cache-assisted generation."""

    def metric(kind: str) -> float:
        return sample_value("tiercache_orchestrator_draft_tokens_total",
                                         {"kind": kind}) or 0.0

    msg = final("A", 2)
    msg.final.draft_tokens_proposed, msg.final.draft_tokens_accepted = 9, 5
    msg.final.lookup_tokens_accepted, msg.final.forward_passes = 2, 3
    stub = Stub("A", [Call([msg])])
    before = {k: metric(k) for k in ("proposed", "accepted_from_cache", "accepted_from_lookup")}
    report = [e for e in run(make({"A": stub}, semantic=RecordingSemantic(NEAR)))
              if isinstance(e, Finished)][0].report
    assert (report.draft_tokens_proposed, report.draft_tokens_accepted,
            report.lookup_tokens_accepted, report.forward_passes) == (9, 5, 2, 3)
    assert metric("proposed") - before["proposed"] == 9
    assert metric("accepted_from_cache") - before["accepted_from_cache"] == 3
    assert metric("accepted_from_lookup") - before["accepted_from_lookup"] == 2


@pytest.mark.parametrize("serve", ["off", "policy", "config"])
def test_a_sampled_request_gets_the_models_sample_with_the_hit_as_its_draft(serve):
    """A sampled request (temperature > 0, maybe seeded) was served the one cached greedy
    answer every time: its seed no longer said what it would get, and it lost its diversity.
    Unless serve_sampled is on (per request or for the server), the hit is its draft."""
    sem = cut_hit("abcdefgh", 0)
    stub, stubs = one_replica()
    orch = make(stubs, semantic=sem)
    orch.serve_sampled = serve == "config"
    events = list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(16, 0.8, 1.0, 7, (), False),
        policy=Policy(serve_sampled=serve == "policy"), session_id="s", return_token_ids=True,
        request_id="rid", deadline=time.monotonic() + 30, on_cancel=lambda fn: None))
    fin = finished(events)
    if serve == "off":
        assert len(stub.requests) == 1 and not fin.report.semantic_hit
        assert list(stub.requests[0].draft_token_ids) == list(b"abcdefgh")
        assert stub.requests[0].sampling.temperature == pytest.approx(0.8)
        assert orch.stats.semantic_hits_sampled == 1
    else:
        assert stub.requests == [] and fin.report.semantic_hit and text_of(events) == "abcdefgh"
        assert orch.stats.semantic_hits_sampled == 0


@pytest.mark.parametrize(("temperature", "policy", "drafts", "looks"), [
    (0.8, Policy(skip_draft=True), True, False),  # sampled, no draft: nothing to look for
    (0.8, Policy(), False, False),  # drafts off for the server
    (0.0, Policy(skip_draft=True), True, True),  # greedy: the hit is served
    (0.8, Policy(), True, True),  # the hit is its draft
    (0.8, Policy(skip_draft=True, serve_sampled=True), True, True),
    # Its answer may be stored: the lookup says whether a longer answer is already there.
    (0.8, Policy(skip_draft=True, store_sampled=True), True, True),
])
def test_a_sampled_request_with_no_use_for_a_hit_does_not_look_one_up(temperature, policy,
                                                                      drafts, looks):
    """A sampled request that could neither be served a hit nor draft from it still called
    Lookup: it embedded, spent time, credited the entry a hit (hit_count, LRU) and counted
    semantic_hits_not_served_total{reason="sampled"}."""
    sem = cut_hit("abcdefgh", 0)
    stub, stubs = one_replica()
    orch = make(stubs, semantic=sem)
    orch.enable_drafts = drafts
    events = list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(16, temperature, 1.0, 7, (), False), policy=policy, session_id="s",
        return_token_ids=True, request_id="rid", deadline=time.monotonic() + 30,
        on_cancel=lambda fn: None))
    finished(events)
    assert len(sem.lookups) == int(looks)
    if not looks:
        assert len(stub.requests) == 1 and not stub.requests[0].draft_token_ids
        assert orch.stats.semantic_hits_sampled == 0 and text_of(events) == "ok"


def test_a_cut_short_answer_does_not_replace_a_whole_hit():
    """A request that goes on past the end of sequence (ignore_eos) gets the model despite a
    whole hit; its answer, cut at max_tokens, was stored and replaced the whole one (same
    prompt), so every later request missed."""
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=True, similarity=1.0, entry=semantic_pb2.SemanticEntry(id="e1", answer="okay")))
    stub, stubs = one_replica()  # "ok", LENGTH
    orch = make(stubs, semantic=sem)
    events = list(orch.generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(2, 0.0, 1.0, 0, (), True), policy=Policy(), session_id="s",
        return_token_ids=True, request_id="rid", deadline=time.monotonic() + 30,
        on_cancel=lambda fn: None))
    assert len(stub.requests) == 1 and text_of(events) == "ok"
    assert sem.stores == []
    # A hit cut shorter than the new answer is still replaced by it.
    sem.answer = semantic_pb2.LookupResponse(hit=True, similarity=1.0, entry=semantic_pb2.
                                             SemanticEntry(id="e1", answer="o", truncated_at=1))
    stub2, stubs2 = one_replica()
    list(make(stubs2, semantic=sem).generate(
        tenant=TENANT, prompt=RenderedPrompt(PROMPT, "q", "ctx"),
        sampling=Sampling(2, 0.0, 1.0, 0, (), False), policy=Policy(), session_id="s",
        return_token_ids=True, request_id="rid", deadline=time.monotonic() + 30,
        on_cancel=lambda fn: None))
    assert [st.answer for st in sem.stores] == ["ok"]


@pytest.mark.parametrize(("cached", "drafted"), [([104, 105], True), ([104, 300], False)])
def test_a_draft_with_ids_outside_the_vocabulary_is_dropped_not_the_request(cached, drafted):
    # An entry a client stored with ids this model has no token for: the replica refused the
    # whole request (INVALID_ARGUMENT draft_token_ids, a field the client never sent), and
    # every near-miss on that entry failed until it expired.
    sem = RecordingSemantic(semantic_pb2.LookupResponse(
        hit=False, similarity=0.9,
        entry=semantic_pb2.SemanticEntry(id="e7", answer="hi", answer_token_ids=cached)))
    stub = Stub("A", [Call([final("A", 2)])])
    orch = make({"A": stub}, semantic=sem)  # the byte tokenizer: 256 ids
    events = run(orch)
    assert finished(events).completion_tokens == 2  # answered either way
    assert list(stub.requests[0].draft_token_ids) == (cached if drafted else [])
    assert finished(events).report.draft_entry_id == ("e7" if drafted else "")
    assert orch.stats.degradations["draft_dropped"] == (0 if drafted else 1)


def test_forward_passes_saved_are_counted_from_the_replicas_report():

    def saved() -> float:
        return sample_value(
            "tiercache_orchestrator_forward_passes_saved_total") or 0.0

    before = saved()
    done = kvpool_pb2.KvGenerateResponse(token_ids=list(b"hello"), final=kvpool_pb2.
                                         KvGenerateFinal(finish_reason=common_pb2.
                                                         FINISH_REASON_LENGTH, replica_id="A",
                                                         draft_tokens_accepted=3,
                                                         forward_passes=1))
    orch = make({"A": Stub("A", [Call([done])])})
    run(orch, max_tokens=5)
    assert saved() - before == 3  # 5 tokens: 4 forwards without drafts, 1 with
