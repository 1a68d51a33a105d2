"""The whole request path over real processes: semantic tier, prefix reuse across turns and
requests, warm-up on every replica, tenant isolation, auth and limits (issue 6), erasing a
tenant's data."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from tiercache.v1 import (
    common_pb2,
    kvpool_pb2,
    kvpool_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    prefix_pb2,
    prefix_pb2_grpc,
)

from clients.python import cli
from clients.python.client import TierCacheClient
from services.orchestrator.pipeline import session_routing_key
from services.orchestrator.routing import PrefixAwarePolicy, ReplicaView
from services.orchestrator.tenants import Tenant, TenantRegistry
from tests.e2e.conftest import CACHES_OFF, HASH_KEY
from tests.e2e.stack import (
    ADMIN_TOKEN,
    INTERNAL_MD,
    admin_stats,
    replica_stats,
    start_full_stack,
    wait_index_caught_up,
    wait_pools_idle,
)

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SYSTEM = ("You are the support assistant of Northwind Traders. " + " ".join(
    f"Policy {i}: orders of category {i} ship within {i % 5 + 1} business days and may be "
    f"returned within {10 + i} days with the original receipt." for i in range(12)))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # Routing's recent-share rule (unit-tested in tests/orchestrator) would make where a new
    # conversation goes depend on the traffic of earlier tests here: a 10 ms window turns it off.
    s = start_full_stack(tmp_path_factory.mktemp("stack"), "stack",
                         orch_env={"TIERCACHE_ORCHESTRATOR_ROUTING_LOAD_WINDOW_S": "0.01"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def a(stack):
    with TierCacheClient(stack.orch.address, token="tok-a", timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def b(stack):
    with TierCacheClient(stack.orch.address, token="tok-b", timeout=180) as c:
        yield c


def kv_requests(stack) -> int:
    total = 0
    for k in stack.kv:
        stub = kvpool_pb2_grpc.KvPoolStub(grpc.insecure_channel(k.address))
        st = stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=10, metadata=INTERNAL_MD)
        total += st.requests_total
    return total


def wait_admitted(stack, errors: list, sender: threading.Thread,
                  timeout: float = 120.0) -> None:
    """Until some replica runs (or queues) a request, or `sender` has its answer already:
    the request it sent has been routed. Sleeping a guessed while instead was too short on a
    loaded machine."""
    channels = [grpc.insecure_channel(k.address) for k in stack.kv]
    try:
        stubs = [kvpool_pb2_grpc.KvPoolStub(ch) for ch in channels]
        end = time.monotonic() + timeout
        while not errors and sender.is_alive():
            if any(st.running + st.waiting > 0 for st in (
                    s.Stats(kvpool_pb2.KvStatsRequest(), timeout=10, metadata=INTERNAL_MD)
                    for s in stubs)):
                return
            assert time.monotonic() < end, "the request never reached a replica"
            time.sleep(0.01)
    finally:
        for ch in channels:
            ch.close()
    if errors:
        raise errors[0]


def recorded(send, results: dict, errors: list):
    """A thread's target: results[key] = send(key), or its error appended to `errors` (for
    the test's own thread to raise)."""
    def run(key) -> None:
        try:
            results[key] = send(key)
        except BaseException as exc:  # noqa: BLE001 - raised by the test's thread
            errors.append(exc)

    return run


def in_turn(stack, send, n: int = 2, gap_s: float | None = None) -> list:
    """send(0), then send(1) ... send(n - 1) at once when the first is on a replica (or
    answered), or `gap_s` after it; the n answers in order, a thread's error raised here."""
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    run = recorded(send, results, errors)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    ts[0].start()
    if gap_s is None:
        wait_admitted(stack, errors, ts[0])
    else:
        time.sleep(gap_s)
    for t in ts[1:]:
        t.start()
    for t in ts:
        t.join(180)
    assert not errors, errors[0]
    return [results[i] for i in range(n)]


def test_repeat_is_a_semantic_hit_without_a_model_call(stack, a):
    q = "What is the capital city of Australia?"
    first = a.generate(q, max_tokens=16, return_token_ids=True)
    assert not first.report.semantic_hit and first.report.replica_id
    before = kv_requests(stack)
    again = a.generate(q, max_tokens=16, return_token_ids=True)
    assert again.report.semantic_hit
    assert again.report.semantic_similarity >= 0.95
    assert again.text == first.text.strip()
    # The model's own ids, its end of sequence included, not the text tokenized again.
    assert again.token_ids == first.token_ids
    assert again.completion_tokens == first.completion_tokens
    assert again.report.replica_id == "" and again.report.prompt_tokens == 0
    assert kv_requests(stack) == before  # no model call
    # A real paraphrase below the standard tier's 0.95 (MiniLM: 0.917): the model answers,
    # with the near-miss's answer as its draft.
    para = a.generate("Name the capital city of Australia.", max_tokens=8)
    assert not para.report.semantic_hit
    assert 0.80 <= para.report.semantic_similarity < 0.95
    assert para.report.replica_id and para.report.draft_entry_id
    assert kv_requests(stack) == before + 1
    other = a.generate("Which animals live in Australia?", max_tokens=8)
    assert not other.report.semantic_hit and other.report.semantic_similarity < 0.80
    assert other.report.replica_id and not other.report.draft_entry_id
    assert kv_requests(stack) == before + 2


def test_feedback_that_an_answer_was_wrong_invalidates_it(stack, a):
    q = "Which river flows through the city of Vienna?"
    first = a.generate(q, max_tokens=8)
    assert first.report.semantic_entry_id
    assert a.generate(q, max_tokens=8).report.semantic_hit
    assert a.feedback(first.report.semantic_entry_id, good=False).invalidated
    before = kv_requests(stack)
    again = a.generate(q, max_tokens=8)
    assert not again.report.semantic_hit and again.report.replica_id  # the model answers
    assert kv_requests(stack) == before + 1


def test_a_cut_short_answer_serves_only_requests_that_want_no_more(stack, a):
    """An answer stopped by max_tokens is stored as truncated: it serves requests for as many
    tokens or fewer (cut to their max_tokens), never one that wants more — the model answers
    that one, with the cached part as its draft."""
    q = "Name three famous rivers of Europe and describe each of them in detail."
    first = a.generate(q, max_tokens=6, return_token_ids=True)
    assert first.finish_reason == "FINISH_REASON_LENGTH" and first.completion_tokens == 6
    before = kv_requests(stack)
    too_short_before = admin_stats(stack).semantic_hits_too_short
    same = a.generate(q, max_tokens=6, return_token_ids=True)
    assert same.report.semantic_hit and same.text == first.text.strip()
    assert same.token_ids == first.token_ids  # the stored answer re-encodes to the model's ids
    fewer = a.generate(q, max_tokens=3, return_token_ids=True)
    assert fewer.report.semantic_hit
    assert fewer.completion_tokens == 3 and fewer.finish_reason == "FINISH_REASON_LENGTH"
    assert fewer.token_ids == first.token_ids[:3]  # cut by tokens, not by characters
    assert kv_requests(stack) == before  # both served without the model
    more = a.generate(q, max_tokens=10, return_token_ids=True)
    assert not more.report.semantic_hit and more.report.replica_id
    assert kv_requests(stack) == before + 1
    assert more.token_ids[:6] == first.token_ids  # greedy: the same start, then more
    assert more.report.draft_tokens_accepted > 0  # the cut-short answer was its draft
    assert admin_stats(stack).semantic_hits_too_short == too_short_before + 1


def test_turn_two_reuses_turn_one_on_the_same_replica(stack, a):
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "How long do category 3 orders take to ship?"}]
    t1 = a.generate(msgs, max_tokens=24, session_id="conv-1", return_token_ids=True)
    msgs2 = msgs + [{"role": "assistant", "content": t1.text},
                    {"role": "user", "content": "And how long can I return them?"}]
    t2 = a.generate(msgs2, max_tokens=8, session_id="conv-1")
    assert t2.report.replica_id == t1.report.replica_id
    turn1 = t1.prompt_tokens + len(t1.token_ids)
    # Reuse is per 16-token block and the last generated token's KV is never computed, so
    # the cached part is turn 1's prompt + answer rounded down to a block boundary.
    assert t2.report.cached_tokens >= (turn1 - 1) // 16 * 16
    assert t2.report.cached_tokens < t2.prompt_tokens


def test_warm_then_first_requests_hit_on_every_replica(stack, a):
    sys2 = SYSTEM.replace("Northwind", "Contoso")
    resp = a.warm([sys2], pin_ttl_seconds=120)
    assert {r.replica_id for r in resp.results} == {"kv-0", "kv-1"}
    assert all(not r.error and r.computed_tokens > 0 and r.pinned_blocks > 0
               for r in resp.results)
    warm_tokens = resp.results[0].prompt_tokens
    # Both replicas' warmed blocks are in the index: otherwise the second request, sent before
    # the slower replica's publish arrived, saw one holder only (a CI run saw both on kv-1).
    wait_index_caught_up(stack)
    results = in_turn(stack, lambda i: a.generate(
        [{"role": "system", "content": sys2},
         {"role": "user", "content": f"Question number {i}: hello?"}],
        max_tokens=32, ignore_eos=True,
        cache_policy=common_pb2.CachePolicy(skip_semantic_lookup=True)),
        # 0.3 s, not "once the first runs": later, the first's prompt blocks are known on its
        # replica, whose longer match (within the routing floor) then takes the second too.
        gap_s=0.3)
    assert {results[i].report.replica_id for i in range(2)} == {"kv-0", "kv-1"}
    for i in range(2):
        assert results[i].report.cached_tokens >= warm_tokens // 16 * 16 - 16


def test_requests_sharing_a_new_system_prompt_meet_on_one_replica(stack, a):
    """Two sessions whose hashes put them on different replicas open with the same new system
    prompt, the second while the first is still prefilling it (the index cannot know it yet):
    routing remembers where it sent the first, so both land there and one reuses the other's
    KV instead of each computing the prompt on its own replica."""
    sys3 = SYSTEM.replace("Northwind", "Fabrikam")
    policy = PrefixAwarePolicy()
    views = [ReplicaView("kv-0", 0, 512), ReplicaView("kv-1", 0, 512)]
    ring: dict[str, str] = {}
    tenant_a = Tenant("a", "", 0, 0, 0)  # the ring's key is the tenant's and the session's
    for i in range(64):
        sid = f"meet-{i}"
        key = session_routing_key(tenant_a, sid)
        ring.setdefault(policy.choose(views, {}, key, new_blocks=32, record=False).replica_id,
                        sid)
    sids = [ring["kv-0"], ring["kv-1"]]
    results = in_turn(stack, lambda i: a.generate(
        [{"role": "system", "content": sys3},
         {"role": "user", "content": f"Question number {i}: hello?"}],
        max_tokens=4, session_id=sids[i],
        cache_policy=common_pb2.CachePolicy(skip_semantic_lookup=True)))
    assert results[0].report.replica_id == results[1].report.replica_id
    # The question (and the template's closing tokens) differ; the ~300-token system prompt
    # before them is computed once.
    prompt = min(r.prompt_tokens for r in results)
    assert max(r.report.cached_tokens for r in results) >= prompt - 48


def test_tenants_share_nothing(stack, a, b):
    q = "Explain what a heat pump does in one sentence."
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
    # a's system prompt KV, from a conversation of a's own (not left by other tests).
    a.generate([{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "And what does a compressor do?"}], max_tokens=4)
    ra = a.generate(msgs, max_tokens=12)
    ra2 = a.generate(msgs, max_tokens=12)
    assert ra2.report.semantic_hit  # tenant a hits its own entry
    rb = b.generate(msgs, max_tokens=12)
    assert not rb.report.semantic_hit
    assert rb.report.cached_tokens == 0  # a's system prompt KV is not b's
    assert ra.report.cached_tokens > 0  # while a reuses its own


def test_auth_and_limits(stack):
    for token in (None, "nope"):
        with TierCacheClient(stack.orch.address, token=token) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate("hi", max_tokens=4)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The token is checked before the request is parsed (bytes that are no GenerateRequest
    # are refused as unauthenticated, not as malformed), and the orchestrator reads no request
    # past its max_request_bytes (4 MiB): 16 MiB of empty messages from anyone took 1.2 s and
    # 420 MB to parse, only to be refused.
    with grpc.insecure_channel(stack.orch.address, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as ch:
        raw = ch.unary_stream("/tiercache.v1.Orchestrator/Generate")
        for md in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(raw(b"\xff\xff\xff", timeout=30, metadata=md))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(raw(b"\xff\xff\xff", timeout=30, metadata=(("authorization", "Bearer tok-a"),)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        empty_messages = b"\x0a\x00" * (3 << 20)  # 6 MiB
        with pytest.raises(grpc.RpcError) as e:
            list(raw(empty_messages, timeout=30, metadata=(("authorization", "Bearer tok-a"),)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with TierCacheClient(stack.orch.address, token="tok-small") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("word " * 200, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Named as the request gave it: a chat message, not a raw prompt.
        assert e.value.details().startswith("messages: ")
        assert "tenant limit" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.generate("word " * 200, max_tokens=4, raw=True)
        assert e.value.details().startswith("prompt: ")
        with pytest.raises(grpc.RpcError) as e:
            c.generate("hi", max_tokens=7)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "sampling.max_tokens" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # Warm obeys the tenant's prompt limit too
            c.warm(["word " * 200])
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant limit" in e.value.details()
        # max_tokens left unset: the server default, capped at the tenant's limit of 6.
        r = c.generate("Count from one to twenty in words.")
        assert 0 < r.completion_tokens <= 6


def test_stats_aggregate_every_tier(stack, a):
    before = admin_stats(stack)
    q = "What colour is the sky on a clear afternoon?"
    assert not a.generate(q, max_tokens=4).report.semantic_hit
    assert a.generate(q, max_tokens=4).report.semantic_hit
    s = admin_stats(stack)
    assert s.requests_total == before.requests_total + 2
    assert s.semantic_hits == before.semantic_hits + 1
    assert {r.replica_id for r in s.replicas} == {"kv-0", "kv-1"}
    assert s.prefix.nodes > 0 and len(s.prefix.replicas) == 2
    assert s.semantic.entries >= 1
    assert all(d.healthy for d in s.dependencies)


def test_internal_services_refuse_calls_without_the_internal_credential(stack):
    from tiercache.v1 import prefix_pb2, prefix_pb2_grpc, semantic_pb2, semantic_pb2_grpc

    calls = [
        (kvpool_pb2_grpc.KvPoolStub, stack.kv[0].address, "Stats", kvpool_pb2.KvStatsRequest()),
        (prefix_pb2_grpc.PrefixIndexStub, stack.prefix.address, "Stats",
         prefix_pb2.PrefixStatsRequest()),
        (semantic_pb2_grpc.SemanticCacheStub, stack.semantic.address, "Stats",
         semantic_pb2.SemanticStatsRequest()),
    ]
    for stub_cls, addr, method, req in calls:
        stub = stub_cls(grpc.insecure_channel(addr))
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, method)(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, addr
        getattr(stub, method)(req, timeout=10, metadata=INTERNAL_MD)  # with it: fine


def idle_pools(stack) -> dict[str, tuple[int, int]]:
    """Each replica's (blocks held: cached + pinned, evictions so far) once none runs
    anything and the index agrees with them; every pool's states add up to its total."""
    def read() -> list:
        return replica_stats(stack)

    wait_pools_idle(read, 30)
    wait_index_caught_up(stack)
    # Read again: the counts the index now agrees with (still idle, none lost).
    return {s.replica_id: (s.blocks_cached + s.blocks_pinned, s.evictions_total)
            for s in wait_pools_idle(read, 30)}


def added(before: dict, after: dict) -> dict[str, int]:
    """Blocks each replica holds in `after` (idle_pools) over `before`; none evicted between,
    so these are the blocks stored between."""
    assert all(after[r][1] == before[r][1] for r in before), (before, after)
    return {r: after[r][0] - before[r][0] for r in before}


def fill(stack, client, msgs: list, plain: str):
    """A tenant's system prompt warmed (pinned on every replica) and two answers stored:
    `msgs` (asked again: a semantic hit) and `plain`. The first answer to `msgs`."""
    warm = client.warm([msgs[0]["content"]], pin_ttl_seconds=300)
    assert {r.replica_id for r in warm.results} == {"kv-0", "kv-1"}
    assert all(not r.error and r.pinned_blocks > 0 for r in warm.results), warm
    wait_index_caught_up(stack)
    first = client.generate(msgs, max_tokens=12, return_token_ids=True)
    assert not first.report.semantic_hit and first.token_ids
    # The warmed system prompt's blocks reused (the question after it is computed).
    assert first.report.cached_tokens >= warm.results[0].prompt_tokens // 16 * 16 - 16
    assert client.generate(msgs, max_tokens=12).report.semantic_hit
    assert not client.generate(plain, max_tokens=4).report.semantic_hit
    assert client.generate(plain, max_tokens=4).report.semantic_hit
    return first


def semantic_entries(stack) -> int:
    return admin_stats(stack).semantic.entries


def hot_prefixes(stack, tenant: str) -> int:
    """How many hot prefixes (token ids included) the prefix index lists of `tenant`'s."""
    salt = TenantRegistry.salt_for(tenant, HASH_KEY.encode())
    with grpc.insecure_channel(stack.prefix.address) as ch:
        return len(prefix_pb2_grpc.PrefixIndexStub(ch).TopPrefixes(
            prefix_pb2.TopPrefixesRequest(k=1000, cache_salt=salt), timeout=10,
            metadata=INTERNAL_MD).prefixes)


def refused_erasures(a, b, ops) -> None:
    """EraseTenant by a tenant (even for itself), or for a blank or impossible name: each
    refused with its documented status."""
    for c in (a, b):
        with pytest.raises(grpc.RpcError) as e:
            c.erase_tenant("erase-a")
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    with pytest.raises(ValueError, match="tenant: required"):
        ops.erase_tenant(" ")  # the client says so before sending
    raw = orchestrator_pb2_grpc.OrchestratorStub(ops.channel)
    for name, said in (("", "tenant: required"), ("  ", "tenant: required"),
                       ("x" * 65, "tenant: longer than 64")):
        with pytest.raises(grpc.RpcError) as e:
            raw.EraseTenant(orchestrator_pb2.EraseTenantRequest(tenant=name), timeout=30,
                            metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert e.value.details().startswith(said), e.value.details()


def test_erase_tenant_removes_its_data_everywhere_and_nothing_else(stack, capsys):
    """Two tenants ask the same (same system prompt, same questions; their KV and answers are
    each their own). Erasing one with the operators' token removes exactly what it stored, on
    the semantic tier and on both replicas, and nothing of the other's; refused or empty
    erasures change nothing; the erased tenant's next answer is the same, computed anew."""
    sys4 = SYSTEM.replace("Northwind", "Tailspin")
    msgs = [{"role": "system", "content": sys4},
            {"role": "user", "content": "How long can I return category 7 orders?"}]
    plain = "What is the chemical symbol of gold?"
    with TierCacheClient(stack.orch.address, token="tok-erase-a", timeout=180) as a, \
            TierCacheClient(stack.orch.address, token="tok-erase-b", timeout=180) as b, \
            TierCacheClient(stack.orch.address, token=ADMIN_TOKEN, timeout=180) as ops:
        pools0, entries0 = idle_pools(stack), semantic_entries(stack)
        a_first = fill(stack, a, msgs, plain)
        pools_a = idle_pools(stack)
        a_blocks = added(pools0, pools_a)
        assert all(n > 0 for n in a_blocks.values()), a_blocks
        assert semantic_entries(stack) == entries0 + 2
        b_first = fill(stack, b, msgs, plain)
        assert b_first.token_ids == a_first.token_ids  # greedy, the same prompt
        pools_ab, entries_ab = idle_pools(stack), semantic_entries(stack)
        assert entries_ab == entries0 + 4
        assert hot_prefixes(stack, "erase-a") > 0 and hot_prefixes(stack, "erase-b") > 0

        # Refused, or for no tenant of that name (erasing nothing): nothing changes.
        refused_erasures(a, b, ops)
        nobody = ops.erase_tenant("erase-nobody")
        assert nobody == orchestrator_pb2.EraseTenantResponse(), nobody
        assert idle_pools(stack) == pools_ab and semantic_entries(stack) == entries_ab
        assert a.generate(msgs, max_tokens=12).report.semantic_hit

        erased = ops.erase_tenant("erase-a")
        assert (erased.semantic_entries_removed, erased.kv_blocks_dropped,
                erased.kv_blocks_in_use, list(erased.not_reached)) == (
            2, sum(a_blocks.values()), 0, []), erased
        # Only A's blocks went, on each replica (the index followed: idle_pools waits for it).
        assert added(pools_ab, idle_pools(stack)) == {r: -n for r, n in a_blocks.items()}
        assert semantic_entries(stack) == entries0 + 2
        assert hot_prefixes(stack, "erase-a") == 0 and hot_prefixes(stack, "erase-b") > 0
        # Again, as an operator runs it: nothing left to remove, everything reached (exit 0).
        capsys.readouterr()
        assert cli.main(["--address", stack.orch.address, "--token", ADMIN_TOKEN,
                         "erase-tenant", "erase-a", "--yes"]) == 0
        assert json.loads(capsys.readouterr().out) == {
            "semanticEntriesRemoved": "0", "kvBlocksDropped": 0, "kvBlocksInUse": 0,
            "notReached": []}

        # A: no answer served from the cache, no KV reused; the same tokens, computed anew.
        a_after = a.generate(msgs, max_tokens=12, return_token_ids=True)
        assert not a_after.report.semantic_hit and a_after.report.replica_id
        assert a_after.report.cached_tokens == 0
        assert not a_after.report.draft_entry_id  # no answer of A's (nor B's) left as a draft
        assert a_after.token_ids == a_first.token_ids
        assert not a.generate(plain, max_tokens=4).report.semantic_hit
        # B: its answers still served, its warmed system prompt still reused.
        b_again = b.generate(msgs, max_tokens=12, return_token_ids=True)
        assert b_again.report.semantic_hit and b_again.token_ids == b_first.token_ids
        assert b.generate(plain, max_tokens=4).report.semantic_hit
        b_new = b.generate([msgs[0], {"role": "user", "content": "Hello?"}], max_tokens=4,
                           cache_policy=common_pb2.CachePolicy(skip_semantic_lookup=True))
        assert b_new.report.cached_tokens >= b_first.report.cached_tokens // 16 * 16 - 16
        idle_pools(stack)


def long_question(tag: str) -> str:
    """A prompt new to every cache, long enough (~600 tokens) that its prefill holds the first
    request on its replica while identical ones arrive."""
    return (" ".join(f"Item {i} of the {tag} list weighs {i * 7 % 13} kilograms and ships from "
                     f"depot {i % 4}." for i in range(40))
            + f" Which depot ships the most items of the {tag} list?")


def test_identical_greedy_requests_in_flight_run_the_model_once(stack, a):
    q = long_question("coalesce")
    rids = ["coal-lead", "coal-0", "coal-1", "coal-2"]
    before = kv_requests(stack)
    served0 = admin_stats(stack)
    # The others sent once the leader's prefill is under way: they join its flight.
    lead, *others = in_turn(stack, lambda i: a.generate(
        q, max_tokens=6, return_token_ids=True, request_id=rids[i]), n=4)
    assert kv_requests(stack) == before + 1  # the replicas ran it once
    scratch = a.generate(q, max_tokens=6, return_token_ids=True, cache_policy=CACHES_OFF)
    assert all(r.token_ids == scratch.token_ids for r in [lead, *others])
    assert lead.report.route not in ("coalesced", "")
    for rep in (r.report for r in others):
        assert (rep.route, rep.coalesced_with) == ("coalesced", "coal-lead"), rep
        assert rep.replica_id == lead.report.replica_id
        assert rep.cached_tokens == rep.prompt_tokens == lead.prompt_tokens
    served = admin_stats(stack)
    assert served.coalesced == served0.coalesced + 3
    assert served.requests_total == served0.requests_total + 5
    # Stored once, by the leader: a follower's report names that entry, and Feedback on it
    # invalidates it (the next identical request is the model's again, not a hit).
    assert lead.report.semantic_entry_id
    assert all(r.report.semantic_entry_id == lead.report.semantic_entry_id for r in others)
    assert a.generate(q, max_tokens=6).report.semantic_hit
    assert a.feedback(others[0].report.semantic_entry_id, good=False).invalidated
    assert not a.generate(q, max_tokens=6).report.semantic_hit


def test_followers_of_a_leader_whose_client_goes_mid_stream_finish_exactly(stack, a):
    q = long_question("cancel")
    sent: dict[str, object] = {}
    errs: list[BaseException] = []

    send = recorded(lambda rid: a.generate(q, max_tokens=24, return_token_ids=True,
                                           request_id=rid), sent, errs)

    before = kv_requests(stack)
    stream = a.stream(q, max_tokens=24, return_token_ids=True, request_id="cut-lead")
    reader = threading.Thread(target=lambda: sent.setdefault("first", next(stream)))
    reader.start()
    wait_admitted(stack, errs, reader)  # its prefill under way: the others join its flight
    others = [threading.Thread(target=send, args=(f"cut-{i}",)) for i in range(2)]
    for t in others:
        t.start()
    reader.join(180)
    assert sent["first"].token_ids and sent["first"].final is None  # mid-answer
    stream.cancel()  # the leader's client goes
    for t in others:
        t.join(180)
    assert not errs, errs[0]
    # Completed Generates (the leader's was cancelled): one resumed run for the two (each
    # resumed on its own before: before + 2).
    assert kv_requests(stack) == before + 1
    scratch = a.generate(q, max_tokens=24, return_token_ids=True, cache_policy=CACHES_OFF)
    assert all(sent[f"cut-{i}"].token_ids == scratch.token_ids for i in range(2))
    reps = {rid: sent[rid].report for rid in ("cut-0", "cut-1")}
    # The first to go on resumed the leader's run; the other followed it.
    (resumer,) = [rid for rid, rep in reps.items() if rep.route == "resume"]
    (follower,) = set(reps) - {resumer}
    assert reps[resumer].coalesced_with == "cut-lead"
    assert (reps[follower].route, reps[follower].coalesced_with) == ("coalesced", resumer)
    # Stored once, by the one that resumed: the other's report names that entry.
    assert reps[resumer].semantic_entry_id
    assert reps[follower].semantic_entry_id == reps[resumer].semantic_entry_id
