"""A differential review of the orchestrator's warm-up (server.py `Warmer`): seeded sequences
of Warm calls and background-loop cycles over 1-4 fake replicas and a fake prefix index,
every answer compared with a model of the documented behaviour after every call and cycle.

The model, written from the proto (Warm, WarmRequest/Result), docs/settings.md (warm_*),
docs/deploy.md, docs/metrics.md and the Warmer's docstrings, not from its code:

- a Warm call: which status it returns (the set of statuses the docs allow when a request has
  several faults: which one wins is not documented); that a refused call sends nothing,
  charges nothing and moves no metric; which replicas each prompt (cut to whole KV blocks)
  and each of the caller's own top_k hot prefixes (never another tenant's, even from an index
  that does not filter by salt) goes to: every healthy replica (ALL, UNSPECIFIED) or the one
  routing names when it is healthy (OWNERS); each sent pinned, with the pin TTL or the
  default, under the tenant's salt; the multiset of WarmResults (the replica's figures, a
  refused pin's figures from its trailers, a failure named by its code and never showing an
  internal address, CANCELLED for a caller already gone, DEADLINE_EXCEEDED unsent past the
  deadline); the rate limit's afford(n - 1) and charge (net: one per prefill that computed);
- a loop cycle: nothing while the mean load per healthy replica is over warm_max_load (at it,
  it warms: docs/settings.md), no_replica / held_load / index_unavailable, the index asked
  with warm_min_hits for at least warm_top_k, up to warm_top_k prefixes that some warmable
  replica lacks taken in turn from each tenant (salt), sent in order, unpinned, under their
  own salt, only to idle healthy replicas with caching on that are not holders, re-checking
  the cluster's load before each (traffic arriving mid-cycle stops it), at most
  warm_max_prompts_per_cycle; the outcome and the prefill / token counters moved exactly.

The environment (shared by the code and the model): 1-4 fake replicas that join, leave, go
down, get busy, fail (transport errors naming an address, verdicts), answer slowly (a simulated
latency against the call's timeout), refuse pins past a per-salt limit (PinRefused trailers),
are too small for a prompt, or have prefix caching off; a fake index whose hot list, hits,
holders (learnt with a lag) and availability change between steps, the same tokens hot under
several salts. A replica answers from its state when the step began, so a Warm's concurrent
prefills answer alike in any order; what they did is applied after the step.

Run: 6,000 seeds x 14 steps (19,368 Warm calls that ran, 37,082 WarmResults of which 19,397
errors, 25,650 refused calls, 9,679 loop cycles that sent 14,806 prefills, 1,486 of them with
traffic arriving mid-cycle): no divergence, no defect found. A scratch with replicas that
really take time (0-0.6 s), deadlines of 0.1-0.8 s and callers leaving mid-call (260 seeds)
found every job answered, nothing sent past the deadline or after the caller left, and the
call back within 0.31 s of either. Left as the docs leave them (not
asserted): the order of WarmResults (job order in the code; compared as a multiset); a Warm
that resolves to no target (OWNERS naming no healthy replica, no hot prefix of the caller's)
is OK with no results; warm_max_prompts_per_cycle = 0 counts its cycles as nothing_to_warm;
a prompt's context and size limits apply before it is cut to whole blocks. Six injected bugs
(the load level taken as exclusive, top_k without the salt filter, the per-cycle cap off by
one, the charge counting error-free instead of computing prefills, OWNERS falling back to
every replica, a busy replica warmed while the mean is low) failed 137, 62, 49, 60, 200 and
57 of 300 seeds (58, 26, 25, 22, 83, 22 of the default 120).
`ORCH_WARM_DIFFERENTIAL_SEEDS=N` runs more (default 120, about 6 s); `python -m
tests.orchestrator.test_warm_differential FIRST END` runs a range and groups what fails.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
from collections import Counter
from concurrent.futures import Future

import grpc
import pytest
from tiercache.v1 import kvpool_pb2, orchestrator_pb2, prefix_pb2

from services.common import errors
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.render import PromptRenderer
from services.orchestrator.server import Warmer, _Gone
from services.orchestrator.tenants import Tenant
from tests.blank_text import blank
from tests.metric_sample import sample_value

STATS: Counter = Counter()
SEEDS = int(os.environ.get("ORCH_WARM_DIFFERENTIAL_SEEDS", "120"))
STEPS = 14
ALL, OWNERS = orchestrator_pb2.WARM_TARGET_ALL, orchestrator_pb2.WARM_TARGET_OWNERS
ADDRESS = "ipv4:10.9.8.7:50053"  # internal: never shown to a tenant
TENANTS = [Tenant("a", "salt-a", 10_000, 64, 4), Tenant("b", "salt-b", 10_000, 64, 4),
           Tenant("c", "salt-c", 10_000, 64, 4)]


class Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", trailers=()) -> None:
        self._c, self._d, self._t = code, details, tuple(trailers)

    def code(self):
        return self._c

    def details(self):
        return self._d

    def trailing_metadata(self):
        return self._t


class Tok:
    """Byte-level: id i is byte i."""

    eos_token_id = 0

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens=False) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(ids).decode("utf-8", "replace")


# ---- the environment: replicas and the index (shared by the code and the model) ------------

class Replica:
    """A kvpool replica as the Warmer sees one. Its answers come from `snap` (its state when
    the step began), so prefills running together answer alike whatever their order; what
    they did is applied after the step (`World.settle`)."""

    def __init__(self, world: World, rid: str) -> None:
        self.world, self.replica_id, self.public_id = world, rid, rid
        self.address = f"{rid}:1"  # what the Warmer's Prefill timing labels it by
        self.load = 0
        self.healthy = True
        self.downs = 0  # never declared down here (see World.watch)
        self.stats = None
        self.mode = "ok"  # ok | error | verdict | slow
        self.error_code = grpc.StatusCode.UNAVAILABLE
        self.latency = 0.0
        self.small = 0  # > 0: longest prompt it can hold
        self.pin_limit = 4  # pinned blocks per cache salt
        self.names_itself = True
        self.held: set = set()  # (salt, tuple of a whole-block prefix)
        self.pinned: set = set()
        self.snap = (frozenset(), frozenset())
        self.stub = self

    # What a replica answers (a PrefillResponse or an Err), from its snapshot.
    def answer(self, req, timeout: float):
        bs = self.world.cfg.block_size
        ids = tuple(req.token_ids)
        if self.mode == "error":
            return Err(self.error_code, f"{ADDRESS}: connection reset")
        if self.mode == "verdict":
            return Err(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: the replica refused them")
        if self.latency > timeout:
            return Err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if self.stats is not None and self.stats.prefix_caching_disabled:
            return Err(grpc.StatusCode.FAILED_PRECONDITION, "prefix caching is disabled")
        if self.small and len(ids) > self.small:
            return Err(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"token_ids: {len(ids)} tokens can never fit the pool")
        held, pinned = self.snap
        n = 0
        while (n + 1) * bs <= len(ids) and (req.cache_salt, ids[:(n + 1) * bs]) in held:
            n += 1
        cached = n * bs
        work = (len(ids), cached, len(ids) - cached)
        pins = 0
        if req.pin:
            blocks = [(req.cache_salt, ids[:(j + 1) * bs]) for j in range(len(ids) // bs)]
            mine = sum(1 for p in pinned if p[0] == req.cache_salt)
            room = self.pin_limit - mine + sum(1 for b in blocks if b in pinned)
            if room <= 0:
                return Err(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "pin refused: the salt's pin share is used",
                           zip(errors.PREFILL_WORK_KEYS, map(str, work), strict=True))
            pins = min(room, len(blocks))
        return kvpool_pb2.PrefillResponse(
            prompt_tokens=work[0], cached_tokens=work[1], computed_tokens=work[2],
            pinned_blocks=pins, replica_id=self.replica_id if self.names_itself else "")

    def _call(self, req, timeout=None, metadata=None):
        ans = self.answer(req, timeout)
        with self.world.lock:
            self.world.sent.append((self.replica_id, req))
            self.world.answers.append((self.replica_id, req, ans))
        self.world.after_prefill()
        if isinstance(ans, Exception):
            raise ans
        return ans

    @property
    def Prefill(self):  # noqa: N802 - the stub's method: called, or as a future
        return _Method(self._call)


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, req, timeout=None, metadata=None):
        return self.fn(req, timeout, metadata)

    def future(self, req, timeout=None, metadata=None) -> Future:
        f = Future()
        try:
            f.set_result(self.fn(req, timeout, metadata))
        except grpc.RpcError as e:
            f.set_exception(e)
        return f


class Index:
    """The prefix index: TopPrefixes over the hot prefixes it was told of."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.hot: list = []  # HotPrefix, in insertion order
        self.down = False
        self.leaky = False  # ignores cache_salt (an index that does not filter)
        self.asked: list = []

    def answer(self, k, min_hits=0, cache_salt=None) -> list:
        hot = [h for h in self.hot if h.hits >= min_hits
               and (cache_salt is None or self.leaky or h.cache_salt == cache_salt)]
        return sorted(hot, key=lambda h: -h.hits)[:k]  # stable: ties in insertion order

    def top_prefixes(self, k, model_id, min_hits=0, cache_salt=None):
        self.asked.append((k, min_hits, cache_salt))
        if self.down:
            raise Err(grpc.StatusCode.UNAVAILABLE, f"{ADDRESS}: connection refused")
        return self.answer(k, min_hits, cache_salt)


class World:
    def __init__(self, rng: random.Random, cfg: OrchestratorConfig) -> None:
        self.rng, self.cfg = rng, cfg
        self.lock = threading.Lock()
        self.replicas: list[Replica] = []
        self.index = Index(self)
        self.next_id = 0
        self.sent: list = []
        self.answers: list = []
        self.owners: dict = {}  # (salt, ids) -> replica id or None
        self.context = 0
        self.traffic_after: int | None = None  # loads rise after this many prefills
        self.traffic_loads: dict = {}
        self.prefills_in_step = 0
        self.renderer = PromptRenderer(Tok(), max_chars=5000)
        self.prefix = self.index
        self.model_id = "m"
        self.internal_token = ""

    # the orchestrator's face, as the Warmer uses it
    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def max_context(self) -> int:
        return self.context

    def misfits(self) -> str:
        return ""  # no replica here serves another model

    def watch(self, r, fn, downs_seen=None, kind="request") -> None:
        pass  # no replica here is declared down while a prefill runs

    def unwatch(self, r, fn) -> None:
        pass

    def owner(self, tenant, token_ids, deadline=None, on_call=None):
        key = (tenant.cache_salt, tuple(token_ids))
        if key not in self.owners:
            pool = [r.replica_id for r in self.replicas] + [None]
            self.owners[key] = self.rng.choice(pool)
        return self.owners[key]

    def after_prefill(self) -> None:
        with self.lock:
            self.prefills_in_step += 1
            if self.traffic_after is not None and self.prefills_in_step == self.traffic_after:
                for r in self.replicas:
                    r.load = self.traffic_loads.get(r.replica_id, r.load)

    def begin(self) -> None:
        self.sent, self.answers = [], []
        self.prefills_in_step = 0
        for r in self.replicas:
            r.snap = (frozenset(r.held), frozenset(r.pinned))

    def settle(self) -> None:
        """What the step's prefills left on the replicas; the index learns some of it."""
        bs = self.cfg.block_size
        for rid, req, ans in self.answers:
            r = next((x for x in self.replicas if x.replica_id == rid), None)
            if r is None:
                continue
            if isinstance(ans, Err) and not errors.prefill_work(ans)[0]:
                continue
            ids = tuple(req.token_ids)
            blocks = [(req.cache_salt, ids[:(j + 1) * bs]) for j in range(len(ids) // bs)]
            r.held.update(blocks)
            if req.pin and isinstance(ans, kvpool_pb2.PrefillResponse):
                r.pinned.update(blocks[:ans.pinned_blocks])
        for h in self.index.hot:
            if self.rng.random() < 0.7:  # the index hears of it (or not yet)
                key = (h.cache_salt, tuple(h.token_ids))
                del h.holders[:]
                h.holders.extend(r.replica_id for r in self.replicas if key in r.held)


# ---- the model --------------------------------------------------------------------------

def _result(job_index: int, r: Replica, ans) -> tuple:
    """What the docs say a WarmResult holds for replica `r`'s answer `ans`: the replica's
    figures; a failure named by its code, a transport failure's text not shown."""
    if isinstance(ans, kvpool_pb2.PrefillResponse):
        return (job_index, ans.replica_id or r.public_id, ans.prompt_tokens, ans.cached_tokens,
                ans.computed_tokens, ans.pinned_blocks, "")
    work = errors.prefill_work(ans)
    return (job_index, r.public_id, *work, 0, ans.code().name)


def model_warm(world: World, tenant: Tenant, req, time_remaining, gone: bool, budget):
    """(status or None, expected results as tuples, jobs [(replica, ids, salt, ttl, i)],
    afford argument or None). Statuses: the set any of which the docs allow."""
    cfg = world.cfg
    bad: set[str] = set()
    if not req.prompts and not req.top_k:
        bad.add("INVALID_ARGUMENT")
    if len(req.prompts) > 64 or req.top_k > 64:
        bad.add("INVALID_ARGUMENT")
    if req.target not in (0, ALL, OWNERS):
        bad.add("INVALID_ARGUMENT")
    if req.pin_ttl_seconds > cfg.warm_pin_ttl_max_s:
        bad.add("INVALID_ARGUMENT")
    if req.top_k and world.prefix is None:
        bad.add("FAILED_PRECONDITION")
    ttl = req.pin_ttl_seconds or cfg.warm_pin_ttl_s
    bs = cfg.block_size
    healthy = world.healthy()
    wanted = []
    for i, p in enumerate(req.prompts[:64]):
        ids = list(p.prompt.encode())
        if blank(p.prompt):
            bad.add("INVALID_ARGUMENT")
            continue
        if len(ids) > cfg.max_prompt_tokens or len(ids) < bs:
            bad.add("INVALID_ARGUMENT")
            continue
        if len(ids) > tenant.max_prompt_tokens:
            bad.add("RESOURCE_EXHAUSTED")
            continue
        if world.context and len(ids) > world.context:
            bad.add("INVALID_ARGUMENT")
            continue
        wanted.append((ids[:len(ids) // bs * bs], tenant.cache_salt, i))
    if req.top_k and world.prefix is not None and req.top_k <= 64:
        if world.index.down:
            bad.add("UNAVAILABLE")
        else:
            # The caller's own k hottest, never another tenant's.
            own = [h for h in world.index.answer(req.top_k, cache_salt=tenant.cache_salt)
                   if h.cache_salt == tenant.cache_salt][:req.top_k]
            wanted += [(list(h.token_ids), h.cache_salt, -1) for h in own]
    if bad:
        return bad, None, [], None
    jobs = []
    for ids, salt, i in wanted:
        if req.target == OWNERS:
            owner = world.owner(tenant, ids)
            targets = [r for r in healthy if r.replica_id == owner]
        else:
            targets = healthy
        jobs += [(r, ids, salt, ttl, i) for r in targets]
    if len(jobs) > cfg.warm_max_prefills_per_call:
        return {"INVALID_ARGUMENT"}, None, [], None
    if not healthy:
        return {"UNAVAILABLE"}, None, [], None
    afford = len(jobs) - 1 if jobs else None
    if afford is not None and afford > 0 and budget is not None and afford > budget:
        return {"RESOURCE_EXHAUSTED"}, None, [], afford
    timeout = 120.0 if time_remaining is None else min(120.0, time_remaining)
    results = []
    for r, ids, salt, ttl_, i in jobs:
        if gone:
            results.append((i, r.public_id, 0, 0, 0, 0, "CANCELLED"))
        elif timeout <= 0:
            results.append((i, r.public_id, 0, 0, 0, 0, "DEADLINE_EXCEEDED"))
        else:
            preq = kvpool_pb2.PrefillRequest(token_ids=ids, cache_salt=salt, pin=True,
                                             ttl_seconds=ttl_, model_id="m")
            results.append(_result(i, r, r.answer(preq, timeout)))
    return None, results, jobs, afford


def model_cycle(world: World, script: dict):
    """(prefills [(replica id, ids, salt)] in order, outcome or None, ok, failed, computed,
    cached), from the docs: nothing while mean load per healthy replica is over warm_max_load
    (at it warms), the index's hot prefixes hit warm_min_hits times, taken in turn from each
    tenant, sent unpinned to idle healthy replicas lacking them (caching on), at most
    warm_max_prompts_per_cycle."""
    cfg = world.cfg
    if cfg.warm_top_k <= 0:
        return [], None, 0, 0, 0, 0
    loads = {r.replica_id: r.load for r in world.replicas}

    def healthy():
        return [r for r in world.replicas if r.healthy]

    def mean():
        h = healthy()
        return sum(loads[r.replica_id] for r in h) / len(h)

    if not healthy():
        return [], "no_replica", 0, 0, 0, 0
    if mean() > cfg.warm_max_load:
        return [], "held_load", 0, 0, 0, 0
    if world.index.down:
        return [], "index_unavailable", 0, 0, 0, 0
    asked = world.index.asked[-1][0] if world.index.asked else cfg.warm_top_k
    hot = world.index.answer(asked, min_hits=cfg.warm_min_hits)
    off = {r.replica_id for r in healthy()
           if r.stats is not None and r.stats.prefix_caching_disabled}
    warmable = {r.replica_id for r in healthy()} - off
    lacking = [h for h in hot if not warmable <= set(h.holders)]
    queues: dict = {}
    for h in lacking:
        queues.setdefault(h.cache_salt, []).append(h)
    chosen = []
    while len(chosen) < cfg.warm_top_k and any(queues.values()):
        for q in queues.values():
            if q and len(chosen) < cfg.warm_top_k:
                chosen.append(q.pop(0))
    sent, busy, ok, failed, computed, cached = [], 0, 0, 0, 0, 0
    for h in chosen:
        for r in healthy():
            if len(sent) >= cfg.warm_max_prompts_per_cycle:
                break
            if r.replica_id in h.holders or r.replica_id in off:
                continue
            if loads[r.replica_id] > 0 or mean() > cfg.warm_max_load:
                busy += 1
                continue
            sent.append((r.replica_id, list(h.token_ids), h.cache_salt))
            preq = kvpool_pb2.PrefillRequest(token_ids=h.token_ids, cache_salt=h.cache_salt,
                                             model_id="m")
            ans = r.answer(preq, 120.0)
            if isinstance(ans, kvpool_pb2.PrefillResponse):
                ok += 1
                computed += ans.computed_tokens
                cached += ans.cached_tokens
            else:
                failed += 1
            if script.get("after") == len(sent):
                loads.update(script["loads"])
    outcome = "ran" if sent else "replicas_busy" if busy else "nothing_to_warm"
    return sent, outcome, ok, failed, computed, cached


# ---- the driver ---------------------------------------------------------------------------

def _metric(name: str, **labels) -> float:
    return sample_value(name, labels) or 0.0


def _metrics() -> dict:
    out = {}
    for o in ("ran", "nothing_to_warm", "replicas_busy", "held_load", "no_replica",
              "index_unavailable"):
        out[("cycle", o)] = _metric("tiercache_orchestrator_warmup_cycles_total", outcome=o)
    for r in ("ok", "failed"):
        out[("prefill", r)] = _metric("tiercache_orchestrator_warmup_prefills_total", result=r)
    for k in ("computed", "cached"):
        out[("tokens", k)] = _metric("tiercache_orchestrator_warmup_tokens_total", kind=k)
    return out


class Divergence(AssertionError):
    pass


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise Divergence(what)


def _token_text(rng: random.Random, n: int, alphabet: str) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def run_seed(seed: int, log: list | None = None) -> None:
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    cfg = OrchestratorConfig(
        block_size=bs, warm_interval_s=0, warm_top_k=rng.choice([0, 1, 1, 2, 2, 3, 3, 8]),
        warm_max_load=rng.choice([0.0, 0.25, 0.5, 1.0]),
        warm_max_prompts_per_cycle=rng.choice([0, 1, 2, 3, 6]),
        warm_min_hits=rng.choice([1, 2, 3]), warm_pin_ttl_s=rng.choice([60, 600]),
        warm_pin_ttl_max_s=rng.choice([600, 3600]),
        warm_max_prefills_per_call=rng.choice([1, 3, 8, 256, 256]),
        max_prompt_tokens=rng.choice([3 * bs, 8 * bs]))
    world = World(rng, cfg)
    if rng.random() < 0.1:
        world.prefix = None
    for _ in range(rng.randint(1, 4)):
        world.replicas.append(Replica(world, f"r{world.next_id}"))
        world.next_id += 1
    # Prefix texts shared by tenants (the same tokens under other salts).
    alphabet = "abcdefgh"[:rng.randint(1, 8)]
    texts = [_token_text(rng, rng.choice([bs - 1, bs, bs + 1, 2 * bs, 2 * bs + 3, 3 * bs,
                                          4 * bs]), alphabet) for _ in range(6)]
    texts += ["  ", ""]
    warmer = Warmer(SimpleOrch(world), cfg)
    tenants = [dataclasses.replace(t, max_prompt_tokens=rng.choice([10_000, 10_000, 2 * bs]))
               for t in TENANTS]
    try:
        for step in range(STEPS):
            _mutate(world, rng, texts, bs)
            world.begin()
            before = _metrics()
            world.index.asked = []
            if rng.random() < 0.5 or world.prefix is None:  # the loop needs an index
                _warm_step(world, warmer, rng, tenants, texts, seed, step, log, before)
            else:
                _cycle_step(world, warmer, rng, seed, step, log, before)
            world.settle()
    finally:
        warmer.stop()


class SimpleOrch:
    def __init__(self, world: World) -> None:
        self.world = world
        self.replicas = world
        self.renderer = world.renderer
        self.model_id, self.internal_token = "m", ""

    @property
    def prefix(self):
        return self.world.prefix

    def owner(self, tenant, token_ids, deadline=None, on_call=None):
        return self.world.owner(tenant, token_ids, deadline, on_call)


def _mutate(world: World, rng: random.Random, texts: list, bs: int) -> None:
    """Replicas join, leave, go down, get busy or slow; the index's hot list changes."""
    world.traffic_after = None
    for r in list(world.replicas):
        x = rng.random()
        if x < 0.05 and len(world.replicas) > 1:
            world.replicas.remove(r)
            continue
        if x < 0.15:
            r.healthy = not r.healthy
        r.load = rng.choice([0, 0, 0, 0, 1, 2])
        r.mode = rng.choices(["ok", "error", "verdict", "slow"], [12, 1, 1, 1])[0]
        r.error_code = rng.choice([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                   grpc.StatusCode.UNKNOWN])
        r.latency = rng.choice([5.0, 60.0, 200.0]) if r.mode == "slow" else 0.0
        r.small = rng.choice([0, 0, 0, 0, 0, 2 * bs])
        r.pin_limit = rng.choice([0, 1, 2, 4, 100, 100])
        r.names_itself = rng.random() < 0.9
        if rng.random() < 0.2:
            r.stats = rng.choice([None, kvpool_pb2.KvStatsResponse(),
                                  kvpool_pb2.KvStatsResponse(),
                                  kvpool_pb2.KvStatsResponse(prefix_caching_disabled=True)])
        if rng.random() < 0.05:
            r.held.clear()
        if rng.random() < 0.3:  # pins expire
            r.pinned.clear()
    if len(world.replicas) < 4 and rng.random() < 0.1:
        world.replicas.append(Replica(world, f"r{world.next_id}"))
        world.next_id += 1
    world.context = rng.choice([0, 0, 0, 0, 0, 3 * bs])
    world.index.down = rng.random() < 0.08
    world.index.leaky = rng.random() < 0.2
    if rng.random() < 0.3:
        world.owners.clear()
    if rng.random() < 0.5 or not world.index.hot:
        salt = rng.choice([t.cache_salt for t in TENANTS])
        text = rng.choice(texts[:6])
        ids = list(text.encode())[:len(text) // bs * bs]
        if ids and not any(h.cache_salt == salt and list(h.token_ids) == ids
                           for h in world.index.hot):
            holders = [r.replica_id for r in world.replicas if rng.random() < 0.4]
            world.index.hot.append(prefix_pb2.HotPrefix(
                token_ids=ids, holders=holders, hits=rng.randint(1, 9), cache_salt=salt))
    for h in world.index.hot:
        if rng.random() < 0.3:
            h.hits = rng.randint(1, 9)
    if rng.random() < 0.1 and world.index.hot:
        world.index.hot.pop(rng.randrange(len(world.index.hot)))


def _warm_step(world, warmer, rng, tenants, texts, seed, step, log, before) -> None:
    tenant = rng.choice(tenants)
    good = [t for t in texts if t.strip() and world.cfg.block_size <= len(t) <= min(
        world.cfg.max_prompt_tokens, tenant.max_prompt_tokens, world.context or 10**9)]
    n = rng.choice([0, 1, 1, 2, 3])
    req = orchestrator_pb2.WarmRequest(
        prompts=[orchestrator_pb2.WarmPrompt(prompt=rng.choice(good or texts))
                 for _ in range(n)],
        top_k=rng.choice([0, 1, 2]) if n else rng.choice([1, 2, 3]),
        target=rng.choice([0, ALL, OWNERS, OWNERS]),
        pin_ttl_seconds=rng.choice([0, 0, 30, 600]))
    if rng.random() < 0.25:  # one thing wrong with it (or not: the model says)
        fault = rng.randrange(6)
        if fault == 0:
            req.prompts.append(orchestrator_pb2.WarmPrompt(prompt=rng.choice(texts)))
        elif fault == 1:
            del req.prompts[:]
            req.prompts.extend([orchestrator_pb2.WarmPrompt(prompt=good[0] if good else "x")]
                               * rng.choice([64, 65]))
        elif fault == 2:
            req.top_k = rng.choice([0, 64, 65]) if req.prompts else rng.choice([0, 65])
        elif fault == 3:
            req.target = rng.choice([3, 7])
        elif fault == 4:
            req.pin_ttl_seconds = rng.choice([3600, 3601, world.cfg.warm_pin_ttl_max_s + 1])
        else:
            req.prompts.append(orchestrator_pb2.WarmPrompt(prompt=rng.choice(["", "  "])))
    time_remaining = rng.choices([None, 30.0, 0.0], [5, 5, 1])[0]
    gone = rng.random() < 0.08
    budget = rng.choice([None, None, 0, 2, 100])  # None: unlimited (afford takes nothing)
    want_status, want, jobs, want_afford = model_warm(world, tenant, req, time_remaining,
                                                      gone, budget)
    afforded: list = []
    charged: list = []

    def afford(k: int) -> int:
        afforded.append(k)
        if budget is None or k <= 0:
            return 0
        if k > budget:
            raise errors.ResourceExhausted("rate limit: retry later")
        return k

    ev = _Gone()
    if gone:
        ev.set()
    got_status = None
    try:
        resp = warmer.warm(tenant, req, time_remaining, charge=charged.append,
                           gone=ev, afford=afford)
    except errors.TierCacheError as e:
        got_status = e.code
    where = f"seed {seed} step {step} warm {tenant.name} {req} tr={time_remaining} gone={gone}"
    if log is not None:
        log.append(where)
    if want_status is not None:
        _check(got_status in want_status,
               f"{where}: status {got_status}, the docs allow {sorted(want_status)}")
        STATS["warm_refused_" + str(got_status)] += 1
        _check(not world.sent, f"{where}: a refused call sent {len(world.sent)} prefills")
        _check(not charged, f"{where}: a refused call charged {charged}")
        _check(_metrics() == before, f"{where}: a Warm moved the loop's metrics")
        return
    _check(got_status is None, f"{where}: status {got_status}, the model answers OK")
    STATS["warm_ok"] += 1
    STATS["results"] += len(want)
    STATS["errors"] += sum(1 for w in want if w[-1])
    STATS["owners"] += req.target == OWNERS
    STATS["top_k"] += sum(1 for w in want if w[0] == -1)
    got = [(r.prompt_index, r.replica_id, r.prompt_tokens, r.cached_tokens, r.computed_tokens,
            r.pinned_blocks, r.error.partition(":")[0]) for r in resp.results]
    _check(Counter(got) == Counter(want), f"{where}: results {sorted(got)} != {sorted(want)}")
    for r in resp.results:
        _check(ADDRESS not in r.error and "10.9.8.7" not in r.error,
               f"{where}: an internal address in {r.error!r}")
        if r.error.startswith("INVALID_ARGUMENT") or r.error.startswith("FAILED_PRECONDITION"):
            _check("refused" in r.error or "disabled" in r.error,
                   f"{where}: the replica's verdict not shown: {r.error!r}")
    # What was sent: each job not answered at once, pinned, with the tenant's salt.
    expect_sent = Counter() if gone or time_remaining == 0.0 else Counter(
        (r.replica_id, tuple(ids), salt, True, ttl) for r, ids, salt, ttl, _ in jobs)
    sent = Counter((rid, tuple(q.token_ids), q.cache_salt, q.pin, q.ttl_seconds)
                   for rid, q in world.sent)
    _check(sent == expect_sent, f"{where}: sent {sorted(sent)} != {sorted(expect_sent)}")
    _check(all(q.cache_salt == tenant.cache_salt for _, q in world.sent),
           f"{where}: a prefill under another tenant's salt")
    # The rate limit: one per prefill that computed something (the call paid for one).
    worked = sum(1 for r in resp.results if r.computed_tokens > 0)
    _check(afforded == ([] if want_afford is None else [want_afford]),
           f"{where}: afford({afforded}), the model {want_afford}")
    reserved = 0 if budget is None or not afforded or afforded[0] <= 0 else afforded[0]
    _check(reserved + sum(charged) == max(0, worked - 1),
           f"{where}: charged {reserved} + {charged} for {worked} prefills that computed")
    _check(_metrics() == before, f"{where}: a Warm moved the loop's metrics")


def _cycle_step(world, warmer, rng, seed, step, log, before) -> None:
    script: dict = {}
    if rng.random() < 0.3 and world.replicas:
        script = {"after": rng.randint(1, 3),
                  "loads": {r.replica_id: rng.choice([0, 1, 3]) for r in world.replicas}}
        world.traffic_after, world.traffic_loads = script["after"], script["loads"]
    snapshot_loads = {r.replica_id: r.load for r in world.replicas}
    done = warmer.cycle()
    where = f"seed {seed} step {step} cycle"
    if log is not None:
        log.append(where)
    got_loads = {r.replica_id: r.load for r in world.replicas}
    for r in world.replicas:  # replay for the model from the loads the cycle began with
        r.load = snapshot_loads[r.replica_id]
    sent, outcome, ok, failed, computed, cached = model_cycle(world, script)
    for r in world.replicas:
        r.load = got_loads[r.replica_id]
    got = [(rid, list(q.token_ids), q.cache_salt) for rid, q in world.sent]
    _check(got == sent, f"{where}: sent {got} != {sent}")
    STATS["cycle_" + str(outcome)] += 1
    STATS["cycle_prefills"] += len(sent)
    STATS["cycle_traffic"] += bool(script) and world.prefills_in_step >= script["after"]
    _check(done == len(sent), f"{where}: cycle() said {done}, sent {len(sent)}")
    _check(all(not q.pin and q.ttl_seconds == 0 for _, q in world.sent),
           f"{where}: the loop pinned")
    hot = {(h.cache_salt, tuple(h.token_ids)) for h in world.index.hot
           if h.hits >= world.cfg.warm_min_hits}
    _check(all((q.cache_salt, tuple(q.token_ids)) in hot for _, q in world.sent),
           f"{where}: warmed a prefix under a salt that is not its own (or not hot)")
    if world.index.asked:
        k, min_hits, _ = world.index.asked[-1]
        _check(k >= world.cfg.warm_top_k and min_hits == world.cfg.warm_min_hits,
               f"{where}: asked the index for {k} (min_hits {min_hits})")
    after = _metrics()
    delta = {key: after[key] - before[key] for key in after}
    want = {key: 0.0 for key in after}
    if outcome is not None:
        want[("cycle", outcome)] = 1.0
    want[("prefill", "ok")], want[("prefill", "failed")] = ok, failed
    want[("tokens", "computed")], want[("tokens", "cached")] = computed, cached
    _check(delta == want, f"{where}: metrics moved {delta}, the model {want}")


@pytest.mark.parametrize("first", range(0, SEEDS, 20))
def test_warm_calls_and_cycles_agree_with_the_model(first):
    for seed in range(first, min(first + 20, SEEDS)):
        run_seed(seed)


if __name__ == "__main__":  # scratch: python -m tests.orchestrator.test_warm_differential N
    import logging
    import sys
    import traceback

    logging.disable(logging.CRITICAL)

    n0, n1 = int(sys.argv[1]), int(sys.argv[2])
    fails = Counter()
    first: dict = {}
    for s in range(n0, n1):
        try:
            run_seed(s)
        except Divergence as e:
            kind = str(e).split(": ", 1)[1][:60]
            fails[kind] += 1
            first.setdefault(kind, str(e)[:1500])
        except Exception:  # noqa: BLE001
            fails["crash"] += 1
            first.setdefault("crash", f"seed {s}\n" + traceback.format_exc()[-2000:])
    print(f"{n1 - n0} seeds, {sum(fails.values())} failing", dict(STATS))
    for k, v in fails.most_common():
        print(v, k)
        print("   ", first[k])
