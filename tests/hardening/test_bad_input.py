"""The bad-input matrix: every RPC of every service, fed empty, oversized, negative, unknown-enum
and malformed values. Each case gets its documented status with a message naming the field, and
the service's Stats are the same after the refused call as before (state unchanged).

kvpool (tiny model), prefix and semantic run in-process on port 0; the orchestrator runs as a
process in the shared stack (it needs the real tokenizer and replicas behind it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import Message
from tiercache.v1 import (
    common_pb2,
    kvpool_pb2,
    orchestrator_pb2,
    prefix_pb2,
    semantic_pb2,
)

from services.common.hashing import MAX_SALT_CHARS, BlockHasher
from tests.hardening.conftest import (
    ADMIN,
    BAD_UTF8,
    INTERNAL_MD,
    TOK_A,
    call,
    md,
    string_field,
)

INV, RES, FP, NF = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
OVER_LIMIT = 17 * 1024 * 1024  # the servers' message limit is 16 MiB


@dataclass(frozen=True)
class Case:
    name: str
    method: str  # "Generate", "Stats"...
    request: bytes
    code: grpc.StatusCode
    field: str  # must appear in the status message
    stream: bool = False
    metadata: tuple | None = None  # None = the service's valid credential


def raw(m: Message | bytes) -> bytes:
    return m if isinstance(m, bytes) else m.SerializeToString()


def case(name, method, req, code, field, **kw) -> Case:
    return Case(name, method, raw(req), code, field, **kw)


# ---- kvpool (tiny model: vocab 128, max_new_tokens_limit 64, context 1024) ---------------------

KvGen = kvpool_pb2.KvGenerateRequest
SP = common_pb2.SamplingParams
OK_SP = SP(max_tokens=2)

KV_CASES = [
    case("empty token_ids", "Generate", KvGen(sampling=OK_SP), INV, "token_ids", stream=True),
    case("token id outside vocab", "Generate", KvGen(token_ids=[1, 128], sampling=OK_SP), INV,
         "token_ids", stream=True),
    case("token id 2^32-1", "Generate", KvGen(token_ids=[2**32 - 1], sampling=OK_SP), INV,
         "token_ids", stream=True),
    case("max_tokens 0", "Generate", KvGen(token_ids=[1, 2]), INV, "sampling.max_tokens",
         stream=True),
    case("negative max_tokens", "Generate", KvGen(token_ids=[1], sampling=SP(max_tokens=-5)),
         INV, "sampling.max_tokens", stream=True),
    case("max_tokens over limit", "Generate", KvGen(token_ids=[1], sampling=SP(max_tokens=65)),
         INV, "sampling.max_tokens", stream=True),
    case("negative temperature", "Generate",
         KvGen(token_ids=[1], sampling=SP(max_tokens=2, temperature=-1)), INV,
         "sampling.temperature", stream=True),
    case("NaN temperature", "Generate",
         KvGen(token_ids=[1], sampling=SP(max_tokens=2, temperature=math.nan)), INV,
         "sampling.temperature", stream=True),
    case("infinite temperature", "Generate",
         KvGen(token_ids=[1], sampling=SP(max_tokens=2, temperature=math.inf)), INV,
         "sampling.temperature", stream=True),
    case("top_p > 1", "Generate", KvGen(token_ids=[1], sampling=SP(max_tokens=2, top_p=1.5)),
         INV, "sampling.top_p", stream=True),
    case("stop id outside vocab", "Generate",
         KvGen(token_ids=[1], sampling=SP(max_tokens=2, stop_token_ids=[500])), INV,
         "sampling.stop_token_ids", stream=True),
    case("draft id outside vocab", "Generate",
         KvGen(token_ids=[1], sampling=OK_SP, draft_token_ids=[7, 999]), INV, "draft_token_ids",
         stream=True),
    case("huge repeated token_ids", "Generate",
         KvGen(token_ids=[5] * 200_000, sampling=OK_SP), INV, "token_ids", stream=True),
    case("other model", "Generate", KvGen(token_ids=[1], sampling=OK_SP, model_id="gpt-9"), FP,
         "model_id", stream=True),
    case("huge other model", "Generate", KvGen(token_ids=[1], sampling=OK_SP,
                                               model_id="g" * 20_000), FP, "model_id",
         stream=True),
    case("invalid UTF-8 request_id", "Generate", raw(KvGen(token_ids=[1], sampling=OK_SP))
         + string_field(1, BAD_UTF8), INV, "request_id", stream=True),
    case("invalid UTF-8 cache_salt", "Generate", raw(KvGen(token_ids=[1], sampling=OK_SP))
         + string_field(4, BAD_UTF8), INV, "cache_salt", stream=True),
    case("truncated message", "Generate", b"\x12\x05\x01", INV, "request", stream=True),
    case("over the size limit", "Generate", KvGen(request_id="r" * OVER_LIMIT), RES,
         "", stream=True),
    case("no credential", "Generate", KvGen(token_ids=[1], sampling=OK_SP), UNAUTH,
         "authorization", stream=True, metadata=()),
    case("prefill empty", "Prefill", kvpool_pb2.PrefillRequest(), INV, "token_ids"),
    case("prefill outside vocab", "Prefill", kvpool_pb2.PrefillRequest(token_ids=[300]), INV,
         "token_ids"),
    case("prefill pin without ttl", "Prefill", kvpool_pb2.PrefillRequest(token_ids=[1] * 8,
                                                                        pin=True), INV,
         "ttl_seconds"),
    case("prefill longer than context", "Prefill",
         kvpool_pb2.PrefillRequest(token_ids=[1] * 5000), INV, "token_ids"),
    case("prefill other model", "Prefill",
         kvpool_pb2.PrefillRequest(token_ids=[1] * 8, model_id="x"), FP, "model_id"),
    # Flush drops a tenant's cached blocks: without a salt it would be every unsalted caller's.
    case("flush without a salt", "Flush", kvpool_pb2.KvFlushRequest(), INV, "cache_salt"),
    case("flush salt with NUL", "Flush", kvpool_pb2.KvFlushRequest(cache_salt="a\0b"), INV,
         "cache_salt"),
    case("flush salt too long", "Flush",
         kvpool_pb2.KvFlushRequest(cache_salt="s" * (MAX_SALT_CHARS + 1)), INV, "cache_salt"),
    case("prefill invalid UTF-8 salt", "Prefill", raw(kvpool_pb2.PrefillRequest(token_ids=[1]))
         + string_field(2, BAD_UTF8), INV, "cache_salt"),
    case("stats malformed", "Stats", b"\xff", INV, "request"),
    case("stats wrong credential", "Stats", b"", UNAUTH, "authorization",
         metadata=(("authorization", "Bearer nope"),)),
]


def kv_state(ch) -> kvpool_pb2.KvStatsResponse:
    r = call(ch, "/tiercache.v1.KvPool/Stats", b"", metadata=INTERNAL_MD)
    assert r.code == grpc.StatusCode.OK, r
    return kvpool_pb2.KvStatsResponse.FromString(r.responses[0])


def check(ch, service: str, c: Case, state) -> None:
    before = state(ch)
    metadata = INTERNAL_MD if c.metadata is None else list(c.metadata)
    out = call(ch, f"/tiercache.v1.{service}/{c.method}", c.request, stream=c.stream,
               metadata=metadata)
    assert out.code == c.code, (c.name, out.code, out.details)
    assert c.field in out.details, (c.name, out.details)
    assert "Traceback" not in out.details and "File \"" not in out.details
    assert state(ch) == before, c.name


@pytest.mark.parametrize("c", KV_CASES, ids=lambda c: c.name)
def test_kvpool_bad_input(kv_inproc, c):
    check(kv_inproc.channel, "KvPool", c, kv_state)


# ---- prefix index (block size 4, max_events 64, max_blocks 256) --------------------------------

H = BlockHasher("m", 4)
GOOD = prefix_pb2.RegisterRequest(replica_id="r1", incarnation="i1", address="127.0.0.1:1",
                                  model_id="m", block_size=4, capacity_blocks=64,
                                  hash_probe=H.probe())
Pub = prefix_pb2.PublishEventsRequest
Ev = prefix_pb2.KvEvent
St = prefix_pb2.BlocksStored
CHAIN = H.hashes(list(range(8)), "")
FRESH = H.hashes(list(range(100, 108)), "s2")  # a chain the index does not hold


def stored(**kw) -> Ev:
    base = dict(parent_hash=b"", block_hashes=list(CHAIN), token_ids=list(range(8)),
                first_block_hash=CHAIN[0], start_block=0)
    base.update(kw)
    return Ev(stored=St(**base))


PREFIX_CASES = [
    case("register empty", "Register", prefix_pb2.RegisterRequest(), INV, "replica_id"),
    case("register long id", "Register", prefix_pb2.RegisterRequest(
        replica_id="x" * 300, incarnation="i", address="a:1", model_id="m", block_size=4),
        INV, "replica_id"),
    case("register other block size", "Register", prefix_pb2.RegisterRequest(
        replica_id="r9", incarnation="i", address="a:1", model_id="m", block_size=16),
        FP, "block_size"),
    case("register without block size", "Register", prefix_pb2.RegisterRequest(
        replica_id="r9", incarnation="i", address="a:1", model_id="m"),
        INV, "block_size: required"),
    case("register wrong hash key", "Register", prefix_pb2.RegisterRequest(
        replica_id="r9", incarnation="i", address="a:1", model_id="m", block_size=4,
        hash_probe=BlockHasher("m", 4, b"another-key").probe()),
        FP, "hash"),
    case("register address not host:port", "Register", prefix_pb2.RegisterRequest(
        replica_id="r9", incarnation="i", address="not an address", model_id="m", block_size=4),
        INV, "address: 'not an address' is not host:port"),
    case("register port out of range", "Register", prefix_pb2.RegisterRequest(
        replica_id="r9", incarnation="i", address="127.0.0.1:99999", model_id="m",
        block_size=4), INV, "address"),
    case("register blank replica id", "Register", prefix_pb2.RegisterRequest(
        replica_id="   ", incarnation="i", address="a:1", model_id="m", block_size=4),
        INV, "replica_id: only whitespace or invisible characters"),
    case("register invisible replica id", "Register", prefix_pb2.RegisterRequest(
        replica_id="\u3164", incarnation="i", address="a:1", model_id="m", block_size=4),
        INV, "replica_id: only whitespace or invisible characters"),
    case("register short hash probe", "Register", prefix_pb2.RegisterRequest(
        replica_id="r9", incarnation="i", address="a:1", model_id="m", block_size=4,
        hash_probe=b"abc"), INV, "hash_probe: must be 16 bytes"),
    case("register invalid UTF-8 address", "Register", raw(GOOD) + string_field(3, BAD_UTF8),
         INV, "address"),
    case("heartbeat empty", "Heartbeat", prefix_pb2.HeartbeatRequest(), INV, "replica_id"),
    case("publish unknown replica", "PublishEvents", Pub(replica_id="ghost", incarnation="x",
                                                         seq=1), NF, "replica_id"),
    case("publish stale incarnation", "PublishEvents", Pub(replica_id="r1", incarnation="old",
                                                           seq=1), NF, "incarnation"),
    case("publish seq 0", "PublishEvents", Pub(replica_id="r1", incarnation="i1", seq=0),
         INV, "seq"),
    case("publish empty event", "PublishEvents", Pub(replica_id="r1", incarnation="i1", seq=2,
                                                     events=[Ev()]), INV, "events[0]"),
    case("publish short hash", "PublishEvents", Pub(
        replica_id="r1", incarnation="i1", seq=2, events=[stored(block_hashes=[b"abc"])]),
        INV, "events[0].stored.block_hashes"),
    case("publish empty stored", "PublishEvents", Pub(
        replica_id="r1", incarnation="i1", seq=2, events=[stored(block_hashes=[])]),
        INV, "events[0].stored"),
    case("publish duplicate hashes", "PublishEvents", Pub(
        replica_id="r1", incarnation="i1", seq=2,
        events=[stored(block_hashes=[FRESH[0], FRESH[0]], token_ids=list(range(100, 108)),
                      cache_salt="s2", first_block_hash=FRESH[0])]),
        INV, "events[0].stored.block_hashes"),
    case("publish tokens do not match", "PublishEvents", Pub(
        replica_id="r1", incarnation="i1", seq=2, events=[stored(token_ids=[1, 2, 3])]),
        INV, "events[0].stored.token_ids"),
    case("publish forged hashes", "PublishEvents", Pub(
        replica_id="r1", incarnation="i1", seq=2,
        events=[stored(block_hashes=list(FRESH), cache_salt="s2", first_block_hash=FRESH[0])]),
        INV, "events[0].stored.block_hashes"),
    case("publish too many events", "PublishEvents", Pub(
        replica_id="r1", incarnation="i1", seq=2,
        events=[Ev(removed=prefix_pb2.BlocksRemoved(block_hashes=[CHAIN[0]]))] * 65),
        RES, "events"),
    case("match empty", "Match", prefix_pb2.MatchRequest(), INV, "model_id"),
    case("match nothing to match", "Match", prefix_pb2.MatchRequest(model_id="m"), INV,
         "token_ids"),
    case("match both inputs", "Match", prefix_pb2.MatchRequest(
        model_id="m", token_ids=[1, 2, 3, 4], block_hashes=[CHAIN[0]]), INV, "token_ids"),
    case("match bad hash", "Match", prefix_pb2.MatchRequest(model_id="m", block_hashes=[b"x"]),
         INV, "block_hashes"),
    case("match huge repeated", "Match", prefix_pb2.MatchRequest(
        model_id="m", token_ids=[1] * 100_000), INV, "token_ids"),
    case("match invalid UTF-8 salt", "Match", raw(prefix_pb2.MatchRequest(
        model_id="m", token_ids=[1, 2, 3, 4])) + string_field(2, BAD_UTF8), INV, "cache_salt"),
    case("match over the size limit", "Match", prefix_pb2.MatchRequest(
        model_id="m" * OVER_LIMIT), RES, ""),
    case("top k 0", "TopPrefixes", prefix_pb2.TopPrefixesRequest(), INV, "k"),
    case("top k huge", "TopPrefixes", prefix_pb2.TopPrefixesRequest(k=5000), INV, "k"),
    case("stats malformed", "Stats", b"\x0a\x10", INV, "request"),
    case("no credential", "Stats", b"", UNAUTH, "authorization", metadata=()),
]


def prefix_state(ch) -> prefix_pb2.PrefixStatsResponse:
    r = call(ch, "/tiercache.v1.PrefixIndex/Stats", b"", metadata=INTERNAL_MD)
    assert r.code == grpc.StatusCode.OK, r
    s = prefix_pb2.PrefixStatsResponse.FromString(r.responses[0])
    for rep in s.replicas:
        rep.last_seen_s = 0.0  # a clock, not state
    # A refused Match is still a Match the index counted; what must not change is the content.
    s.matches_total = s.matches_hit = s.match_blocks_total = s.match_blocks_hit = 0
    return s


@pytest.fixture(scope="module")
def prefix_with_replica(prefix_inproc):
    """The index with one registered replica holding one 2-block chain."""
    ch = prefix_inproc.channel
    assert call(ch, "/tiercache.v1.PrefixIndex/Register", raw(GOOD),
                metadata=INTERNAL_MD).code == grpc.StatusCode.OK
    ok = call(ch, "/tiercache.v1.PrefixIndex/PublishEvents",
              raw(Pub(replica_id="r1", incarnation="i1", seq=1, events=[stored()])),
              metadata=INTERNAL_MD)
    assert ok.code == grpc.StatusCode.OK, ok
    assert prefix_state(ch).nodes == 2
    # Later batches continue at seq 2: the "seq" cases below use 1 (a replay) or 0.
    return prefix_inproc


@pytest.mark.parametrize("c", PREFIX_CASES, ids=lambda c: c.name)
def test_prefix_bad_input(prefix_with_replica, c):
    check(prefix_with_replica.channel, "PrefixIndex", c, prefix_state)
    prefix_with_replica.extra.check_integrity()


# ---- semantic -----------------------------------------------------------------------------------

NS = semantic_pb2.Namespace(tenant="a", model_id="m", context_hash="ab12")
LK = semantic_pb2.LookupRequest
STORE = semantic_pb2.StoreRequest

SEMANTIC_CASES = [
    case("lookup no namespace", "Lookup", LK(text="hi"), INV, "namespace"),
    case("lookup empty tenant", "Lookup", LK(namespace=semantic_pb2.Namespace(model_id="m"),
                                              text="hi"), INV, "namespace.tenant"),
    case("lookup invisible tenant", "Lookup", LK(namespace=semantic_pb2.Namespace(
        tenant="\u200b\u3164", model_id="m"), text="hi"), INV, "namespace.tenant"),
    case("lookup tenant printed as another", "Lookup", LK(namespace=semantic_pb2.Namespace(
        tenant="acme\u200b", model_id="m"), text="hi"), INV, "namespace.tenant"),
    case("lookup non-hex context", "Lookup", LK(namespace=semantic_pb2.Namespace(
        tenant="a", model_id="m", context_hash="zz!"), text="hi"), INV, "namespace.context_hash"),
    case("lookup empty text", "Lookup", LK(namespace=NS), INV, "text"),
    case("lookup oversized text", "Lookup", LK(namespace=NS, text="x" * 2_000_000), INV, "text"),
    case("lookup unknown tier", "Lookup", LK(namespace=NS, text="hi", tier="bogus"), INV,
         "tier"),
    case("lookup negative threshold", "Lookup", LK(namespace=NS, text="hi", threshold=-0.5),
         INV, "threshold"),
    case("lookup threshold > 1", "Lookup", LK(namespace=NS, text="hi", threshold=2.0), INV,
         "threshold"),
    case("lookup NaN threshold", "Lookup", LK(namespace=NS, text="hi", threshold=math.nan),
         INV, "threshold"),
    case("lookup invalid UTF-8 text", "Lookup", raw(LK(namespace=NS)) + string_field(
        2, BAD_UTF8), INV, "text"),
    case("lookup invalid UTF-8 tenant", "Lookup", string_field(1, string_field(1, BAD_UTF8))
         + raw(LK(text="hi")), INV, "namespace.tenant"),
    case("store no namespace", "Store", STORE(prompt="p", answer="a"), INV, "namespace"),
    case("store empty prompt", "Store", STORE(namespace=NS, answer="a"), INV, "prompt"),
    case("store empty answer", "Store", STORE(namespace=NS, prompt="p"), INV, "answer"),
    case("store ttl too long", "Store", STORE(namespace=NS, prompt="p", answer="a",
                                             ttl_seconds=2**32 - 1), INV, "ttl_seconds"),
    case("store oversized answer", "Store", STORE(namespace=NS, prompt="p",
                                                 answer="y" * 3_000_000), INV, "answer"),
    case("store invalid UTF-8 answer", "Store", raw(STORE(namespace=NS, prompt="p"))
         + string_field(3, BAD_UTF8), INV, "answer"),
    case("store more token ids than the answer has bytes", "Store",
         STORE(namespace=NS, prompt="p", answer="ab", answer_token_ids=[1] * 100_000), INV,
         "answer_token_ids"),
    case("store over the size limit", "Store", STORE(namespace=NS, prompt="p",
                                                    answer="z" * OVER_LIMIT), RES, ""),
    case("verify empty id", "Verify", semantic_pb2.VerifyRequest(), INV, "id"),
    case("verify unknown id", "Verify", semantic_pb2.VerifyRequest(id="nope"), NF, "id"),
    # Repeated in full, these made a status over gRPC's 16 KiB limit: RESOURCE_EXHAUSTED
    # naming no field.
    case("verify huge unknown id", "Verify", semantic_pb2.VerifyRequest(id="x" * 1_000_000), NF,
         "id"),
    case("lookup huge unknown tier", "Lookup", LK(namespace=NS, text="hi", tier="t" * 20_000),
         INV, "tier"),
    case("invalidate nothing", "Invalidate", semantic_pb2.InvalidateRequest(), INV, "target"),
    case("invalidate empty namespace", "Invalidate", semantic_pb2.InvalidateRequest(
        namespace=semantic_pb2.Namespace()), INV, "namespace"),
    case("stats malformed", "Stats", b"\x08", INV, "request"),
    case("no credential", "Lookup", LK(namespace=NS, text="hi"), UNAUTH, "authorization",
         metadata=()),
]


def semantic_state(ch) -> semantic_pb2.SemanticStatsResponse:
    r = call(ch, "/tiercache.v1.SemanticCache/Stats", b"", metadata=INTERNAL_MD)
    assert r.code == grpc.StatusCode.OK, r
    return semantic_pb2.SemanticStatsResponse.FromString(r.responses[0])


@pytest.fixture(scope="module")
def semantic_with_entry(semantic_inproc):
    ch = semantic_inproc.channel
    ok = call(ch, "/tiercache.v1.SemanticCache/Store",
              raw(STORE(namespace=NS, prompt="What is two plus two?", answer="Four.")),
              metadata=INTERNAL_MD)
    assert ok.code == grpc.StatusCode.OK, ok
    return semantic_inproc


@pytest.mark.parametrize("c", SEMANTIC_CASES, ids=lambda c: c.name)
def test_semantic_bad_input(semantic_with_entry, c):
    check(semantic_with_entry.channel, "SemanticCache", c, semantic_state)


# ---- orchestrator (process, through the shared stack) -----------------------------------------

Gen = orchestrator_pb2.GenerateRequest
CM = orchestrator_pb2.ChatMessage
HI = [CM(role="user", content="hi")]
CP = common_pb2.CachePolicy
WR = orchestrator_pb2.WarmRequest
WP = orchestrator_pb2.WarmPrompt
FB = orchestrator_pb2.FeedbackRequest
A = tuple(md(TOK_A))

ORCH_CASES = [
    case("no messages", "Generate", Gen(), INV, "messages", stream=True, metadata=A),
    case("messages and prompt", "Generate", Gen(messages=HI, prompt="hello"), INV, "prompt",
         stream=True, metadata=A),
    case("negative max_tokens", "Generate", Gen(messages=HI, sampling=SP(max_tokens=-1)), INV,
         "sampling.max_tokens", stream=True, metadata=A),
    case("max_tokens over limit", "Generate", Gen(messages=HI, sampling=SP(max_tokens=10**6)),
         INV, "sampling.max_tokens", stream=True, metadata=A),
    case("negative temperature", "Generate", Gen(messages=HI, sampling=SP(temperature=-2)), INV,
         "sampling.temperature", stream=True, metadata=A),
    case("NaN temperature", "Generate", Gen(messages=HI, sampling=SP(temperature=math.nan)),
         INV, "sampling.temperature", stream=True, metadata=A),
    case("infinite temperature", "Generate", Gen(messages=HI, sampling=SP(temperature=math.inf)),
         INV, "sampling.temperature", stream=True, metadata=A),
    case("top_p > 1", "Generate", Gen(messages=HI, sampling=SP(top_p=3)), INV, "sampling.top_p",
         stream=True, metadata=A),
    case("unknown tier", "Generate", Gen(messages=HI, cache_policy=CP(semantic_tier="gold")),
         INV, "cache_policy.semantic_tier", stream=True, metadata=A),
    case("threshold > 1", "Generate", Gen(messages=HI, cache_policy=CP(semantic_threshold=7)),
         INV, "cache_policy.semantic_threshold", stream=True, metadata=A),
    case("stop id outside vocab", "Generate", Gen(messages=HI, sampling=SP(
        stop_token_ids=[2**31])), INV, "sampling.stop_token_ids", stream=True, metadata=A),
    case("unknown role", "Generate", Gen(messages=[CM(role="wizard", content="hi")]), INV,
         "messages[0].role", stream=True, metadata=A),
    case("huge unknown role", "Generate", Gen(messages=[CM(role="r" * 20_000, content="hi")]),
         INV, "messages[0].role", stream=True, metadata=A),
    case("huge unknown tier", "Generate", Gen(messages=HI, cache_policy=CP(
        semantic_tier="t" * 20_000)), INV, "cache_policy.semantic_tier", stream=True,
         metadata=A),
    case("oversized message", "Generate", Gen(messages=[CM(role="user", content="w " * 3000)]),
         INV, "messages[0].content", stream=True, metadata=A),
    case("huge repeated messages", "Generate", Gen(messages=HI * 5000), INV, "messages",
         stream=True, metadata=A),
    case("invalid UTF-8 content", "Generate", string_field(1, raw(CM(role="user"))
                                                           + string_field(2, BAD_UTF8)),
         INV, "messages[0].content", stream=True, metadata=A),
    case("invalid UTF-8 session", "Generate", raw(Gen(messages=HI)) + string_field(3, BAD_UTF8),
         INV, "session_id", stream=True, metadata=A),
    case("huge session id", "Generate", Gen(messages=HI, session_id="s" * 100_000), INV,
         "session_id", stream=True, metadata=A),
    case("truncated message", "Generate", b"\x0a\x7f\x01", INV, "request", stream=True,
         metadata=A),
    case("over the size limit", "Generate", Gen(prompt="q" * OVER_LIMIT), RES, "", stream=True,
         metadata=A),
    case("no token", "Generate", Gen(messages=HI), UNAUTH, "authorization", stream=True,
         metadata=()),
    case("unknown token", "Generate", Gen(messages=HI), UNAUTH, "authorization", stream=True,
         metadata=(("authorization", "Bearer guess"),)),
    case("internal credential is not a tenant", "Generate", Gen(messages=HI), UNAUTH,
         "authorization", stream=True, metadata=tuple(INTERNAL_MD)),
    case("warm empty", "Warm", WR(), INV, "prompts", metadata=A),
    case("warm top_k huge", "Warm", WR(top_k=10**6), INV, "top_k", metadata=A),
    case("warm empty prompt", "Warm", WR(prompts=[WP()]), INV, "prompts[0].messages",
         metadata=A),
    case("warm blank prompt", "Warm", WR(prompts=[WP(prompt=" \t ")]), INV,
         "prompts[0].prompt: must not be empty", metadata=A),
    case("blank prompt", "Generate", Gen(prompt=" \t "), INV, "prompt: must not be empty",
         stream=True, metadata=A),
    case("warm unknown target", "Warm", WR(prompts=[WP(prompt="x")], target=7), INV, "target",
         metadata=A),
    case("warm too long", "Warm", WR(prompts=[WP(prompt="w " * 1500)]), INV, "prompts[0]",
         metadata=A),
    case("feedback empty", "Feedback", FB(rating=orchestrator_pb2.RATING_GOOD), INV,
         "semantic_entry_id", metadata=A),
    case("feedback unspecified rating", "Feedback", FB(semantic_entry_id="x"), INV, "rating",
         metadata=A),
    case("feedback unknown rating", "Feedback", FB(semantic_entry_id="x", rating=42), INV,
         "rating", metadata=A),
    case("feedback unknown entry", "Feedback", FB(semantic_entry_id="nope",
                                                  rating=orchestrator_pb2.RATING_BAD), NF,
         "semantic_entry_id", metadata=A),
    case("feedback huge unknown entry", "Feedback", FB(semantic_entry_id="e" * 20_000,
                                                       rating=orchestrator_pb2.RATING_BAD), NF,
         "semantic_entry_id", metadata=A),
    case("stats as a tenant", "Stats", orchestrator_pb2.StatsRequest(), DENIED, "authorization",
         metadata=A),
    case("erase a tenant as a tenant", "EraseTenant", orchestrator_pb2.EraseTenantRequest(
        tenant="a"), DENIED, "authorization", metadata=A),
    case("erase no tenant", "EraseTenant", orchestrator_pb2.EraseTenantRequest(), INV, "tenant",
         metadata=tuple(md(ADMIN))),
    case("erase a tenant name too long", "EraseTenant", orchestrator_pb2.EraseTenantRequest(
        tenant="t" * 20_000), INV, "tenant", metadata=tuple(md(ADMIN))),
]


def orch_state(stack) -> tuple:
    s = stack.admin_stats()
    reps = tuple(sorted((r.replica_id, r.requests_total, r.prompt_tokens_total, r.blocks_in_use,
                         r.blocks_pinned) for r in s.replicas))
    return (s.requests_total, s.semantic_hits, s.prefix_hits, s.cold, s.prompt_tokens_total,
            s.cached_tokens_total, reps, s.semantic.entries, s.prefix.nodes)


@pytest.mark.e2e
@pytest.mark.model
def test_orchestrator_bad_input(stack):
    """One test over the whole table (the stack is shared; one Stats pair per case)."""
    ch = grpc.insecure_channel(stack.orch.address)
    failures = []
    for c in ORCH_CASES:
        before = orch_state(stack)
        out = call(ch, f"/tiercache.v1.Orchestrator/{c.method}", c.request, stream=c.stream,
                   metadata=list(c.metadata) if c.metadata is not None else None)
        if out.code != c.code or c.field not in out.details or "Traceback" in out.details:
            failures.append((c.name, out.code, out.details[:200]))
        after = orch_state(stack)
        if after != before:
            failures.append((c.name, "state changed", before, after))
    ch.close()
    assert not failures, "\n".join(map(str, failures))
