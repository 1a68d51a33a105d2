"""The low-traffic warm-up loop (pure logic, fakes for the replicas and the index)."""

from types import SimpleNamespace

import grpc
from tiercache.v1 import kvpool_pb2, prefix_pb2

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.server import Warmer
from tests.metric_sample import sample_value


class Err(grpc.RpcError):
    """A dependency's failure: a status code, its text and trailers."""

    def __init__(self, code: grpc.StatusCode, details: str = "", trailers=()) -> None:
        self._c, self._d, self._t = code, details, tuple(trailers)

    def trailing_metadata(self):
        return self._t

    def code(self) -> grpc.StatusCode:
        return self._c

    def details(self) -> str:
        return self._d


class FakeStub:
    def __init__(self, rid):
        self.rid = rid
        self.calls = []

    def Prefill(self, req, timeout=None, metadata=None):  # noqa: N802
        self.calls.append(list(req.token_ids))
        # The loop's prefills are not pinned: pins count against the tenant's pin quota,
        # and the loop's filled it, refusing the tenant's own Warm calls.
        assert not req.pin and req.ttl_seconds == 0
        return kvpool_pb2.PrefillResponse(prompt_tokens=len(req.token_ids),
                                          computed_tokens=len(req.token_ids), replica_id=self.rid)


def make(loads, hot):
    reps = [SimpleNamespace(replica_id=f"r{i}", public_id=f"r{i}", load=load,
                            address=f"r{i}:1", stub=FakeStub(f"r{i}"))
            for i, load in enumerate(loads)]
    replicas = SimpleNamespace(healthy=lambda: reps)
    prefix = SimpleNamespace(top_prefixes=lambda k, model_id, min_hits=0: [
        h for h in hot if h.hits >= min_hits][:k])
    orch = SimpleNamespace(replicas=replicas, prefix=prefix, model_id="m", internal_token="")
    cfg = OrchestratorConfig(warm_interval_s=1.0, warm_top_k=8, warm_max_load=1.0,
                             warm_max_prompts_per_cycle=3, warm_pin_ttl_s=60)
    return Warmer(orch, cfg), reps


def hp(tokens, holders, hits=10):
    return prefix_pb2.HotPrefix(token_ids=tokens, holders=holders, hits=hits, cache_salt="s")


def test_warms_replicas_that_lack_hot_prefixes_when_quiet():
    w, reps = make([0, 0, 0], [hp([1] * 32, ["r0"]), hp([2] * 32, ["r0", "r1", "r2"])])
    assert w.cycle() == 2
    assert reps[0].stub.calls == []
    assert reps[1].stub.calls == [[1] * 32] and reps[2].stub.calls == [[1] * 32]


def test_cap_on_work_per_cycle():
    hot = [hp([i] * 32, []) for i in range(1, 5)]
    w, reps = make([0, 0], hot)
    assert w.cycle() == 3
    assert sum(len(r.stub.calls) for r in reps) == 3


def test_replicas_with_prefix_caching_off_are_left_alone():
    """Such a replica refuses every prefill: asking each cycle wasted the cycle's budget
    (here 3 prefills), so the replica with caching on got none."""
    hot = [hp([i] * 32, []) for i in range(1, 5)]
    w, reps = make([0, 0], hot)
    reps[0].stats = kvpool_pb2.KvStatsResponse(prefix_caching_disabled=True)
    reps[1].stats = kvpool_pb2.KvStatsResponse()
    real = reps[0].stub.Prefill

    def refuse(req, timeout=None, metadata=None):
        real(req, timeout, metadata)
        raise AssertionError("prefill sent to a replica with prefix caching off")

    reps[0].stub.Prefill = refuse
    assert w.cycle() == 3
    assert reps[0].stub.calls == []
    assert reps[1].stub.calls == [[1] * 32, [2] * 32, [3] * 32]


def test_no_warm_up_while_busy():
    w, reps = make([3, 2], [hp([1] * 32, [])])
    assert w.cycle() == 0
    assert all(r.stub.calls == [] for r in reps)


def test_warm_max_load_itself_lets_a_cycle_warm():
    """The loop warms at or under warm_max_load (docs/settings.md): a mean load equal to it
    warms, and 0 warms only a cluster with nothing running."""
    import dataclasses

    for max_load, loads, prefills in ((0.4, [1, 0], 0), (0.5, [1, 0], 1), (0.0, [0, 0], 2),
                                      (0.0, [1, 0, 0, 0], 0)):
        w, reps = make(loads, [hp([1] * 32, [])])
        w.cfg = dataclasses.replace(w.cfg, warm_max_load=max_load)
        got = w.cycle()
        assert got == prefills, (max_load, loads, got)
        assert all(r.stub.calls == [] for r in reps if r.load)


def test_a_busy_replica_is_skipped_and_traffic_mid_cycle_stops_the_warm_up():
    """The cluster is quiet on average (one request on one of five replicas): that replica is
    not warmed; once traffic comes back during the cycle, no further prefill goes out."""
    w, reps = make([1, 0, 0, 0, 0], [hp([1] * 32, []), hp([2] * 32, [])])
    w.cfg = OrchestratorConfig(warm_interval_s=1.0, warm_top_k=8, warm_max_load=0.5,
                               warm_max_prompts_per_cycle=10, warm_pin_ttl_s=60)
    real = reps[1].stub.Prefill

    def prefill_then_traffic(req, timeout=None, metadata=None):
        for r in reps:
            r.load = 2  # requests arrive while the first warm prefill runs
        return real(req, timeout, metadata)

    reps[1].stub.Prefill = prefill_then_traffic
    assert w.cycle() == 1
    assert reps[0].stub.calls == [] and reps[1].stub.calls == [[1] * 32]
    assert all(r.stub.calls == [] for r in reps[2:])


def test_bad_warm_settings_fail_at_boot():
    import pytest

    from services.common.config import ConfigError

    for field, value in (("warm_pin_ttl_s", 0), ("warm_max_load", -1),
                         ("warm_max_prompts_per_cycle", -1), ("warm_max_prefills_per_call", 0),
                         ("warm_max_prefills_per_call", 4097), ("max_connection_age_s", -1),
                         ("warm_min_hits", 0)):
        with pytest.raises(ConfigError, match=f"TIERCACHE_ORCHESTRATOR_{field.upper()}"):
            OrchestratorConfig(kvpool_addresses=("h:1",), **{field: value}).validate()


def test_warm_results_and_feedback_errors_keep_internal_addresses_out():
    """A tenant's WarmResult.error (and Feedback's status) carried the dependency's own text:
    for a transport failure that names internal addresses. Its verdicts stay readable."""
    from services.orchestrator.server import _public_details

    w, reps = make([0], [])

    def down(req, timeout=None, metadata=None):
        raise Err(grpc.StatusCode.UNAVAILABLE, "ipv4:10.0.3.7:50053: Connection refused")

    reps[0].stub.Prefill = down
    res = w._prefill(reps[0], [1] * 32, "s", 60, 0)
    assert res.error == "UNAVAILABLE: replica r0 is unavailable"
    refused = Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "pin refused: pins would hold 134 blocks")
    assert _public_details(refused, "replica r0") == "pin refused: pins would hold 134 blocks"
    hung = Err(grpc.StatusCode.UNAVAILABLE, "semantic shard 10.0.3.9:50052 hung: skipped")
    assert "10.0.3.9" not in _public_details(hung, "the semantic tier")


def test_a_warm_whose_own_short_deadline_ran_out_does_not_call_the_replica_failed(caplog):
    """A concurrency review: Warms with 50 ms deadlines logged a WARNING "replica kv-N failed:
    DEADLINE_EXCEEDED" per prefill while the replicas were healthy. A deadline the call's
    own short timeout ran into says nothing of the replica; a long one still does."""
    import logging

    w, reps = make([0], [])

    def slow(req, timeout=None, metadata=None):
        raise Err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    reps[0].stub.Prefill = slow
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.server"):
        res = w._prefill(reps[0], [1] * 32, "s", 60, 0, timeout=0.05)
        assert res.error == "DEADLINE_EXCEEDED: the call's deadline passed during this prefill"
        assert "failed" not in caplog.text
        res = w._prefill(reps[0], [1] * 32, "s", 60, 0, timeout=30.0)
    assert res.error == "DEADLINE_EXCEEDED: replica r0 did not answer in time"
    assert "replica r0 failed: DEADLINE_EXCEEDED" in caplog.text


def test_a_refused_pin_keeps_what_the_replica_computed_in_the_warm_result():
    """The replica computed and cached the prompt, then could not pin it: the WarmResult
    said 0 tokens computed (its error alone told). Trailers that are not ours give zeros."""
    from services.common import errors

    w, reps = make([0], [])
    trailers = [(errors.PREFILL_WORK_KEYS[0], "32"), (errors.PREFILL_WORK_KEYS[1], "16"),
                (errors.PREFILL_WORK_KEYS[2], "16")]

    def refuse(req, timeout=None, metadata=None):
        raise Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "pin refused: share used", trailers)

    reps[0].stub.Prefill = refuse
    res = w._prefill(reps[0], [1] * 32, "s", 60, 0)
    assert res.error.startswith("RESOURCE_EXHAUSTED: pin refused")
    assert (res.prompt_tokens, res.cached_tokens, res.computed_tokens) == (32, 16, 16)
    for bad in ([(errors.PREFILL_WORK_KEYS[2], "x")], [(errors.PREFILL_WORK_KEYS[2], "-4")],
                [(errors.PREFILL_WORK_KEYS[2], str(2**40))], []):
        trailers = bad
        res = w._prefill(reps[0], [1] * 32, "s", 60, 0)
        assert res.error and res.computed_tokens == 0, bad


def test_internal_and_unknown_failures_are_transport_failures_to_tenants():
    from services.orchestrator.server import _public_details

    text = "Exception iterating responses: ipv4:10.0.3.7:50053 reset"
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                 grpc.StatusCode.DEADLINE_EXCEEDED):
        assert "10.0.3.7" not in _public_details(Err(code, text), "replica r0"), code


def test_warm_names_a_replica_not_yet_polled_by_position():
    """Until its first Stats answer a replica's id is its address."""
    from services.orchestrator.backends import ReplicaSet

    rs = ReplicaSet(("10.0.3.7:50053",), "")
    r = rs.replicas[0]

    def down(req, timeout=None, metadata=None):
        raise Err(grpc.StatusCode.UNAVAILABLE, "connection refused")

    r.stub = SimpleNamespace(Prefill=down)
    w, _ = make([0], [])
    res = w._prefill(r, [1] * 32, "s", 60, 0)
    assert res.replica_id == "kvpool#0" and "10.0.3.7" not in res.error
    r.stub = SimpleNamespace(Prefill=lambda req, timeout=None, metadata=None:
                             kvpool_pb2.PrefillResponse(prompt_tokens=32))  # names no replica
    assert w._prefill(r, [1] * 32, "s", 60, 0).replica_id == "kvpool#0"


def test_the_warm_up_takes_tenants_in_turn_and_skips_what_every_replica_holds():
    """The cluster's k hottest prefixes were often one tenant's: it took every slot, and once
    they were held everywhere the cycle warmed nothing for anyone."""
    def salted(tokens, holders, salt, hits):
        return prefix_pb2.HotPrefix(token_ids=tokens, holders=holders, hits=hits,
                                    cache_salt=salt)

    cfg = OrchestratorConfig(warm_interval_s=1.0, warm_top_k=2, warm_max_load=1.0,
                             warm_max_prompts_per_cycle=10, warm_pin_ttl_s=60)
    everywhere = [salted([i] * 32, ["r0", "r1"], "x", 100 - i) for i in range(1, 3)]
    w, reps = make([0, 0], everywhere + [salted([9] * 32, ["r0"], "y", 5)])
    w.cfg = cfg
    assert w.cycle() == 1 and reps[1].stub.calls == [[9] * 32]
    lacking = [salted([i] * 32, ["r0"], "x", 100 - i) for i in range(1, 4)]
    w, reps = make([0, 0], lacking + [salted([9] * 32, ["r0"], "y", 5)])
    w.cfg = cfg
    assert w.cycle() == 2 and reps[1].stub.calls == [[1] * 32, [9] * 32]  # x's hottest, y's


def test_a_replica_with_caching_off_does_not_keep_held_prefixes_in_the_warm_up():
    """Such a replica holds nothing, so every prefix lacked "somewhere" and the tenant whose
    prefixes every other replica held kept the slots while the cycle skipped that replica."""
    held = prefix_pb2.HotPrefix(token_ids=[1] * 32, holders=["r0", "r1"], hits=100,
                                cache_salt="x")
    other = prefix_pb2.HotPrefix(token_ids=[9] * 32, holders=["r0"], hits=5, cache_salt="y")
    w, reps = make([0, 0, 0], [held, other])
    reps[2].stats = kvpool_pb2.KvStatsResponse(prefix_caching_disabled=True)
    w.cfg = OrchestratorConfig(warm_interval_s=1.0, warm_top_k=1, warm_max_load=1.0,
                               warm_max_prompts_per_cycle=10, warm_pin_ttl_s=60)
    assert w.cycle() == 1 and reps[1].stub.calls == [[9] * 32] and not reps[2].stub.calls


def test_a_prefix_hit_once_is_not_copied_everywhere():
    """A conversation's own history (hit once, by its next turn) was copied to every replica,
    where session affinity never sends that conversation."""
    w, reps = make([0, 0], [hp([1] * 32, ["r0"], hits=1), hp([2] * 32, ["r0"], hits=2)])
    assert w.cycle() == 1
    assert reps[1].stub.calls == [[2] * 32]


def test_what_the_loop_did_is_counted_and_logged(caplog):
    """An operator could not tell what the loop did: no metric, and a log line that named no
    computed-versus-held split; held-off cycles and failures left nothing."""
    import logging


    def value(name, **labels):
        return sample_value(name, labels) or 0.0

    cycles = "tiercache_orchestrator_warmup_cycles_total"
    before = {o: value(cycles, outcome=o) for o in ("ran", "held_load", "nothing_to_warm")}
    ok = value("tiercache_orchestrator_warmup_prefills_total", result="ok")
    failed = value("tiercache_orchestrator_warmup_prefills_total", result="failed")
    computed = value("tiercache_orchestrator_warmup_tokens_total", kind="computed")

    w, reps = make([0, 0], [hp([1] * 32, ["r0"]), hp([2] * 32, ["r0"])])

    def refuse(req, timeout=None, metadata=None):
        raise Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool full")

    real = reps[1].stub.Prefill
    calls = iter([real, refuse])
    reps[1].stub.Prefill = lambda *a, **kw: next(calls)(*a, **kw)
    with caplog.at_level(logging.INFO, logger="services.orchestrator.server"):
        assert w.cycle() == 2
    assert value("tiercache_orchestrator_warmup_prefills_total", result="ok") == ok + 1
    assert value("tiercache_orchestrator_warmup_prefills_total", result="failed") == failed + 1
    assert value("tiercache_orchestrator_warmup_tokens_total", kind="computed") == computed + 32
    assert "warmed a 32-token prefix (10 hits) on r1: 32 tokens computed" in caplog.text
    assert "warm-up prefill on r1 failed: RESOURCE_EXHAUSTED" in caplog.text
    for r in reps:
        r.load = 5
    assert w.cycle() == 0
    w2, _ = make([0, 0], [hp([1] * 32, ["r0", "r1"])])
    assert w2.cycle() == 0
    assert value(cycles, outcome="ran") == before["ran"] + 1
    assert value(cycles, outcome="held_load") == before["held_load"] + 1
    assert value(cycles, outcome="nothing_to_warm") == before["nothing_to_warm"] + 1
    # The replica lacking it is busy (the cluster as a whole quiet): not "nothing to warm".
    busy = value(cycles, outcome="replicas_busy")
    w3, reps3 = make([0, 1], [hp([1] * 32, ["r0"])])
    assert w3.cycle() == 0 and reps3[1].stub.calls == []
    assert value(cycles, outcome="replicas_busy") == busy + 1


def test_a_warm_reserves_its_prefills_from_the_rate_limit_and_gives_back_unused_ones():
    """A diff review: the check before a Warm reserved nothing (Warms admitted together each
    passed on the same tokens: 26 prefills where 8 could run), counted refreshes that compute
    nothing, and its wiring was tested with fakes only. A real registry, the real Warmer."""
    import dataclasses
    from concurrent.futures import Future

    import pytest
    from tiercache.v1 import orchestrator_pb2

    from services.common.errors import Overloaded
    from services.orchestrator.tenants import TenantRegistry
    from tests.clock import Clock

    class PinStub:
        """A replica's Prefill, called as the Warm calls it (a future it can cancel)."""

        def __init__(self, computed):
            self.computed, self.calls = computed, 0
            self.Prefill = SimpleNamespace(future=self._future)

        def _future(self, req, timeout=None, metadata=None):
            self.calls += 1
            f = Future()
            f.set_result(kvpool_pb2.PrefillResponse(prompt_tokens=len(req.token_ids),
                                                    computed_tokens=self.computed,
                                                    replica_id="r"))
            return f

    reg = TenantRegistry.build(tokens_file="", tokens="tok-aaaaaaaaaaaaaaaa=a", key=b"k" * 32,
                               max_prompt_tokens=4096, max_tokens=64, max_concurrent=4)
    tenant = dataclasses.replace(next(iter(reg.by_token.values())), rate_per_s=1.0, burst=3)
    reg._current[tenant.name] = tenant  # the limits in force, as a tokens file sets them
    reg.clock = clock = Clock(100.0)
    # Replica r0 already holds the prefixes (a refresh computes nothing), r1 computes them.
    reps = [SimpleNamespace(replica_id=f"r{i}", public_id=f"r{i}", load=0, stats=None,
                            downs=0, address=f"r{i}:1", stub=PinStub(0 if i == 0 else 32))
            for i in range(2)]
    hot = [prefix_pb2.HotPrefix(token_ids=[7 + j] * 32, holders=["r0"], hits=5,
                                cache_salt=tenant.cache_salt) for j in range(2)]
    orch = SimpleNamespace(
        replicas=SimpleNamespace(replicas=reps, healthy=lambda: reps,
                                 watch=lambda r, fn, seen, warm: None, unwatch=lambda r, fn: None),
        model_id="m", internal_token="",
        prefix=SimpleNamespace(top_prefixes=lambda k, model_id, cache_salt=None: hot[:k]))
    w = Warmer(orch, OrchestratorConfig(warm_interval_s=0))

    def warm(top_k):
        reg.check_rate(tenant)
        return w.warm(tenant, orchestrator_pb2.WarmRequest(top_k=top_k), 30.0,
                      charge=lambda n: reg.charge(tenant, n),
                      afford=lambda n: reg.afford(tenant, n))

    def tokens():
        with reg._lock:
            return reg._refilled(tenant).tokens

    # 4 prefills: the call pays 1 and reserves 3; 2 computed, so 2 reserved are given back.
    res = warm(2)
    assert sorted(r.computed_tokens for r in res.results) == [0, 0, 32, 32]
    assert tokens() == pytest.approx(3 - 2)
    # While one Warm holds its reservation, another finds the bucket taken: it cannot run on
    # the same tokens (checked the old way, both ran their prefills).
    reg.check_rate(tenant)
    assert reg.afford(tenant, 3) == 3 and tokens() == pytest.approx(-3)
    with pytest.raises(Overloaded, match="rate limit"):
        warm(2)
    reg.charge(tenant, -3)  # the first gives its reservation back (computed nothing)
    clock.t += 2.0
    assert tokens() == pytest.approx(2)
    # Past 2 x burst it can never run: refused, its own request given back, nothing sent.
    calls = sum(r.stub.calls for r in reps)
    hot.extend(prefix_pb2.HotPrefix(token_ids=[20 + j] * 32, holders=[], hits=5,
                                    cache_salt=tenant.cache_salt) for j in range(2))
    with pytest.raises(Exception, match="at most 6 per call"):
        warm(4)  # 8 prefills
    assert sum(r.stub.calls for r in reps) == calls and tokens() == pytest.approx(2)
    w.stop()


def test_the_loop_copies_no_prefix_of_a_tenant_no_longer_in_the_tokens_file():
    """Review: a cycle read the hot prefixes, then prefilled them one by one (seconds each);
    an EraseTenant in between was undone on the replicas prefilled after it (the erased
    tenant's KV computed again and cached, though EraseTenant had answered all erased), and a
    tenant removed from the tokens file (erasure's step 1) was still warmed. Only the salts
    of the tenants the tokens file has now are warmed (unsalted prefixes too, as before),
    checked again right before each prefill (a reload during the cycle counts)."""
    from services.orchestrator.tenants import TenantRegistry

    def registry(*names):
        return TenantRegistry.build(tokens_file="", tokens=",".join(
            f"tok-{n}-0123456789abcdef={n}" for n in names), key=b"k" * 32, max_prompt_tokens=100,
            max_tokens=100, max_concurrent=4)

    tenants = registry("alice", "bob")
    salt = {n: TenantRegistry.salt_for(n, b"k" * 32) for n in ("alice", "bob")}
    hot = [prefix_pb2.HotPrefix(token_ids=[i] * 32, holders=[], hits=10, cache_salt=s)
           for i, s in ((1, salt["alice"]), (2, salt["bob"]), (3, "gone"), (4, ""))]
    w, reps = make([0], hot)
    w.cfg = OrchestratorConfig(warm_interval_s=1.0, warm_top_k=8, warm_max_load=1.0,
                               warm_max_prompts_per_cycle=10)
    w.tenants = tenants
    stub = reps[0].stub
    real = stub.Prefill

    def prefill(req, timeout=None, metadata=None):
        out = real(req, timeout, metadata)
        if req.cache_salt == salt["alice"]:
            tenants.adopt(registry("alice"))  # bob's tokens removed during the cycle
        return out

    stub.Prefill = prefill
    assert w.cycle() == 2
    assert stub.calls == [[1] * 32, [4] * 32]  # alice's and the unsalted one; not bob's
