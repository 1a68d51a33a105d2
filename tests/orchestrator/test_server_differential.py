"""A differential review of the orchestrator servicer's Feedback and Stats (services/orchestrator/
server.py with backends.py, prefix_backend.py and the prefix client's Stats), called over
loopback gRPC through the real server start-up (its interceptor: status codes, rpc counts).

Part 1, Feedback: seeded random sequences of Stores (through the orchestrator's
`SemanticBackend`), Feedback calls by tenants a and b (entry references issued to the caller,
to the other tenant, signed for ids that never existed, malformed or empty; ratings good, bad,
unset or 42; a token nobody has), exact lookups of each entry, the clock moving past TTLs,
the housekeeper's purge, and the semantic tier (one shard, or two with one of them down at
times; a few seeds with no tier) going down and up, against real semantic shards (a real
`SemanticCache` with SQLite and a fixed-vector embedder behind a real `SemanticServicer`; a
switch in front of it answers UNAVAILABLE while the shard is "down"). The model, from the
proto's comments (Orchestrator.Feedback, FeedbackResponse), docs/reliability.md's error table
and tenant isolation rules, README.md and the backends' docstrings:
- an unknown token is UNAUTHENTICATED; an empty entry id or a rating other than good/bad is
  INVALID_ARGUMENT; no semantic tier is FAILED_PRECONDITION (or NOT_FOUND for a reference
  that is not the caller's: the docs do not order the two); a reference not issued to the
  caller (another tenant's, forged, malformed) is NOT_FOUND and changes nothing;
- an entry is held while stored, not replaced by a Store of its prompt in its namespace, not
  invalidated and not purged; it is servable (an exact lookup hits it, with its verified flag)
  while held and not past its TTL;
- where the entry is servable on a shard that answers: bad -> OK, invalidated (no longer
  servable nor held); good -> OK, verified (served verified from then on);
- the entry is not servable (gone or expired): with every shard answering, bad -> OK with
  invalidated false, good -> NOT_FOUND; with a shard down the tier cannot tell where an id
  is, so UNAVAILABLE; one servable on a shard that is down: UNAVAILABLE, unchanged;
- tiercache_rpc_total{orchestrator, Feedback} counts each call once, under the code its
  client got; Stats' semantic entries and expirations_total are those of the shards that
  answered (an expired entry is held, and counted, until the purge); Stats is refused to the
  tenants (PERMISSION_DENIED), given to the admin token.
Found: a bad rating of an entry past its TTL (not yet purged) said invalidated true and the
entry was never counted expired (the semantic tier removed it: fixed there, NOT_FOUND as its
Verify says; 7 seeds of 100, one of the default 20).

Part 2, Stats: seeded random figures for 0-3 semantic shards and 0-3 prefix shards (fake
servicers on loopback: up, down, refusing, and in the by-hand runs slow past the caller's
time), 0-3 replicas with figures or none and healthy or not, the orchestrator's own counters,
and callers admin, tenant, unknown or without a token (or no tokens configured: everyone is
the admin `default`). The model, from StatsResponse's comments and the backends' docstrings:
- the request counts, tokens and degradations are the orchestrator's own; replicas lists the
  figures of the healthy replicas that have some, in order; dependencies are every replica's
  line, then the semantic tier's, then the prefix index's;
- a tier's figures are unset when no shard answered, else summed over the shards that
  answered (shards_answered of shards_total): counts summed, hits by tier summed per tier,
  latency percentiles and threshold_floor the highest, the embedding model the first
  shard's, the shard-list notes joined (each prefixed with its address when sharded); the
  prefix index's replicas merged by id (held blocks summed, sorted by id; last_seen_s within
  the shards' range: which one is not documented);
- each shard's line is healthy when its last call answered and its last answered Stats had no
  shard-list note (a note is said in the line); a sharded tier's own line is healthy only when
  every shard's is, else "k of n shards unhealthy: <addresses>";
- with a slow shard (by hand), only invariants: the call answers OK within the caller's time,
  the semantic sum is that of some of the shards that answered.
Found: a prefix shard refusing Stats hid every other shard's figures (fixed in the prefix
client: 44 seeds of 100); a prefix shard that never answered made the caller's Stats
DEADLINE_EXCEEDED (the tiers were given all its time; fixed: a fifth is kept; 3 seeds of 20
slow ones; test_server_rules.py pins it, the slow runs take seconds a seed).

Runs by hand: 300 Feedback seeds of 40 steps (~45 s), 1,000 Stats seeds of 12 steps (~30 s),
40 slow Stats seeds (~55 s): no divergence left. Injected bugs (seeds failing of 100 Feedback
/ 300 Stats; of the defaults): any 16-character reference tag taken (77; 18 of 20), NOT_FOUND
winning over a shard down (40; 7), a good rating of a gone entry OK (35; 6); unhealthy
replicas' figures listed (199; 53 of 80), p99 summed over shards (120; 26), a replica's held
blocks the largest shard's, not the sum (134; 30), a sharded tier's line healthy while any
shard is (226; 58).
`ORCH_SERVER_DIFFERENTIAL_SEEDS=N` runs N Stats seeds and N/4 Feedback seeds (default 80,
~4 s); `python -m tests.orchestrator.test_server_differential feedback|stats|slow N` by hand.
Shard placement follows the ports the shards got: a seed's steps are its own, where its
namespaces land may differ between runs (the model does not depend on it).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections import Counter
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import (
    kvpool_pb2,
    orchestrator_pb2_grpc,
    prefix_pb2,
    prefix_pb2_grpc,
    semantic_pb2_grpc,
)
from tiercache.v1 import orchestrator_pb2 as opb
from tiercache.v1 import semantic_pb2 as spb

from services.common import errors
from services.common.bootstrap import create_server
from services.orchestrator.backends import Health, SemanticBackend
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.pipeline import OrchestratorStats
from services.orchestrator.prefix_backend import PrefixBackend
from services.orchestrator.server import OrchestratorServicer
from services.orchestrator.tenants import TenantRegistry
from services.semantic.cache import SemanticCache
from services.semantic.config import SemanticConfig
from services.semantic.server import SemanticServicer
from services.semantic.store import EntryStore
from tests.clock import Clock
from tests.metric_sample import sample_value
from tests.semantic.test_cache_edges import FixedEmbedder

SEEDS = int(os.environ.get("ORCH_SERVER_DIFFERENTIAL_SEEDS", "80"))
ADMIN, TOKEN_A, TOKEN_B = ("tok-ops-0123456789abcdef", "tok-a-0123456789abcdef",
                           "tok-b-0123456789abcdef")
TENANTS = {TOKEN_A: "a", TOKEN_B: "b", ADMIN: "ops"}
CODES = ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE", "FAILED_PRECONDITION",
         "UNAUTHENTICATED", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN")
WEEK = 7 * 24 * 3600  # the semantic tier's default TTL
SEM_SUM = ("entries", "namespaces", "lookups_total", "near_misses_total",
           "guard_rejections_total", "evictions_total", "expirations_total",
           "shard_list_mismatches_total")
PX_SUM = ("nodes", "bytes", "matches_total", "matches_hit", "match_blocks_total",
          "match_blocks_hit", "pruned_total", "resyncs_total", "dropped_blocks_total",
          "max_nodes", "shard_list_mismatches_total", "unheld_nodes")


class Failed(AssertionError):
    pass


class Log:
    def __init__(self, seed: int, what: str) -> None:
        self.seed, self.what, self.lines = seed, what, []

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            tail = "\n".join(self.lines[-12:])
            raise Failed(f"{self.what} seed {self.seed}, step {len(self.lines)}: {what}\n{tail}")


def _tokens_file(folder: str) -> str:
    path = os.path.join(folder, "tokens.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({t: {"tenant": n, "admin": n == "ops"} for t, n in TENANTS.items()}, f)
    return path


def _registry(tokens_file: str) -> TenantRegistry:
    return TenantRegistry.build(tokens_file=tokens_file, tokens="", key=b"k" * 16,
                                max_prompt_tokens=100, max_tokens=100, max_concurrent=4)


class Orchestrator:
    """An OrchestratorServicer served on loopback; `orch` is what it reads (set per seed)."""

    def __init__(self) -> None:
        self.svc = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("h:1",)))
        self.handle = create_server(
            service="orchestrator", address="127.0.0.1:0",
            services=[(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, self.svc,
                       "tiercache.v1.Orchestrator")], authenticate=self.svc.authenticate_call)
        self.handle.set_serving()
        self.channel = grpc.insecure_channel(self.handle.address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def call(self, method: str, req, token: str, timeout: float = 10.0):
        md = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            return "OK", getattr(self.stub, method)(req, timeout=timeout, metadata=md)
        except grpc.RpcError as e:
            return e.code().name, e.details()

    def close(self) -> None:
        self.channel.close()
        self.handle.stop(0)


# ------------------------------------------------------------------------- part 1: Feedback

class Switch(semantic_pb2_grpc.SemanticCacheServicer):
    """A real SemanticServicer, or UNAVAILABLE for every call while `down`."""

    def __init__(self) -> None:
        self.real = SemanticServicer()
        self.down = False

    def _pass(self, name: str, req, ctx):
        if self.down:
            raise errors.Unavailable("shard down")
        return getattr(self.real, name)(req, ctx)

    def Lookup(self, req, ctx):  # noqa: N802
        return self._pass("Lookup", req, ctx)

    def Store(self, req, ctx):  # noqa: N802
        return self._pass("Store", req, ctx)

    def Verify(self, req, ctx):  # noqa: N802
        return self._pass("Verify", req, ctx)

    def Invalidate(self, req, ctx):  # noqa: N802
        return self._pass("Invalidate", req, ctx)

    def Stats(self, req, ctx):  # noqa: N802
        return self._pass("Stats", req, ctx)


class FeedbackRig:
    """Two semantic shards and an orchestrator, served for the whole run; each seed gets
    fresh caches (`fresh`)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.switches = [Switch(), Switch()]
        self.handles = [create_server(
            service="semantic", address="127.0.0.1:0",
            services=[(semantic_pb2_grpc.add_SemanticCacheServicer_to_server, s,
                       "tiercache.v1.SemanticCache")]) for s in self.switches]
        self.tenants = _registry(_tokens_file(folder))
        self.orch = SimpleNamespace(stats=OrchestratorStats(), prefix=None, semantic=None,
                                    replicas=SimpleNamespace(replicas=[]), model_id="m")
        self.server = Orchestrator()
        self.server.svc.attach(self.orch, self.tenants)
        self.caches: list[SemanticCache] = []

    def fresh(self, seed: int, shards: int) -> SemanticBackend:
        self._close_caches()
        self.clock = Clock(1_000_000.0)
        emb = FixedEmbedder()
        for i in range(shards):
            cfg = SemanticConfig(address="127.0.0.1:0", metrics_port=-1,
                                 db_path=os.path.join(self.folder, f"s{seed}-{i}.db"),
                                 sqlite_synchronous="NORMAL", guard_tiers=(),
                                 verifier_tiers=())
            cfg.validate()
            cache = SemanticCache(cfg, emb, EntryStore(cfg.resolved_db_path(), "NORMAL"),
                                  self.clock)
            cache.load()
            self.caches.append(cache)
            self.switches[i].real.attach(cache)
            self.switches[i].down = False
        self.orch.semantic = SemanticBackend(
            ",".join(h.address for h in self.handles[:shards]), "", 5.0)
        return self.orch.semantic

    def _close_caches(self) -> None:
        for c in self.caches:
            c.close_indexes()
            c.store.close()
        self.caches = []

    def close(self) -> None:
        self._close_caches()
        self.server.close()
        for h in self.handles:
            h.stop(0)


def _rpc_counts() -> dict[str, float]:
    return {c: sample_value("tiercache_rpc_total", {
        "service": "orchestrator", "method": "Feedback", "code": c}) or 0.0 for c in CODES}


def run_feedback(rig: FeedbackRig, seed: int, steps: int = 40) -> None:
    rng = random.Random(seed)
    shards = rng.choice([0, 1, 2, 2, 2]) if rng.random() < 0.1 else rng.choice([1, 2, 2])
    be = rig.fresh(seed, shards)
    addrs = be.addresses
    log = Log(seed, "feedback")
    tenant = {n: rig.tenants.authenticate((("authorization", f"Bearer {t}"),))
              for t, n in TENANTS.items()}
    token = {n: t for t, n in TENANTS.items()}
    entries: dict[str, dict] = {}  # id -> ns, prompt, shard, held, verified, expires
    by_prompt: dict[tuple, str] = {}
    refs: list[tuple[str, str, str]] = []  # (issued to, reference, entry id)
    down: set[str] = set()
    expired: Counter = Counter()
    for _ in range(steps):
        now = rig.clock.t
        r = rng.random()
        if r < 0.3 and shards:
            name = rng.choice("ab")
            ns = spb.Namespace(tenant=name, model_id="m", context_hash=rng.choice(["", "c1"]))
            prompt, ttl = f"q{rng.randint(0, 6)}", rng.choice([0, 5, 5, 10])
            shard = be.shard_for(ns)
            try:
                got = be.store(spb.StoreRequest(namespace=ns, prompt=prompt, answer="a " + prompt,
                                                ttl_seconds=ttl))
            except grpc.RpcError as e:
                log(f"store {name}/{ns.context_hash}/{prompt} -> {e.code().name}")
                log.check(shard in down and e.code() == grpc.StatusCode.UNAVAILABLE,
                          "a Store failed on a shard that is up")
                continue
            log(f"t={now} store {name}/{ns.context_hash}/{prompt} ttl={ttl} on {shard} "
                f"-> {got.id[:6]}")
            log.check(shard not in down, "a Store succeeded on a shard that is down")
            key = (name, ns.context_hash, prompt)
            old = by_prompt.get(key)
            if old is not None and old != got.id and entries[old]["held"]:
                entries[old]["held"] = False  # replaced
            entries[got.id] = dict(ns=ns, prompt=prompt, shard=shard, held=True,
                                   verified=False, expires=now + (ttl or WEEK))
            by_prompt[key] = got.id
            refs.append((name, rig.tenants.entry_ref(tenant[name], got.id), got.id))
        elif r < 0.7:
            feedback_step(rig, rng, log, shards, tenant, token, entries, refs, down)
        elif r < 0.78 and shards:
            i = rng.randrange(shards)
            rig.switches[i].down = not rig.switches[i].down
            (down.add if rig.switches[i].down else down.discard)(addrs[i])
            log(f"shard {addrs[i]} {'down' if rig.switches[i].down else 'up'}")
        elif r < 0.84:
            rig.clock.t += rng.choice([1, 5, 10])
            log(f"t={rig.clock.t}")
        elif r < 0.85 and rng.random() < 0.5:
            for c in rig.caches:  # the housekeeper's purge (in the shard: up or not)
                c.expire()
            for e in entries.values():
                if e["held"] and now >= e["expires"]:
                    e["held"] = False
                    expired[e["shard"]] += 1
            log("purge")
        elif r < 0.93 and entries and shards:
            eid = rng.choice(list(entries))
            e = entries[eid]
            try:
                got = be.lookup(spb.LookupRequest(namespace=e["ns"], text=e["prompt"]))
            except grpc.RpcError as ex:
                log(f"lookup {eid[:6]} -> {ex.code().name}")
                log.check(e["shard"] in down, "a lookup failed on a shard that is up")
                continue
            log(f"lookup {eid[:6]} -> hit={got.hit} {got.entry.id[:6]} v={got.entry.verified}")
            log.check(e["shard"] not in down, "a lookup answered from a shard that is down")
            if e["held"] and now < e["expires"]:
                log.check(got.hit and got.entry.id == eid, "a servable entry is not served")
                log.check(got.entry.verified == e["verified"], "verified flag differs")
            else:
                log.check(not got.hit or (got.entry.id != eid and entries[got.entry.id]["held"]),
                          "an entry gone is served")
        else:
            stats_of_feedback(rig, rng, log, shards, addrs, entries, down, expired)
    for c in rig.caches:
        c.check_integrity()


def feedback_step(rig, rng, log, shards, tenant, token, entries, refs, down) -> None:
    caller = rng.choice(["a", "b", "a", "b", "ops", "nobody"])
    kind = rng.random()
    eid = owner = None
    mine = [r for r in refs if r[0] == caller]
    if kind < 0.4 and mine:
        owner, ref, eid = rng.choice(mine)
    elif kind < 0.55 and refs:
        owner, ref, eid = rng.choice(refs)
    elif kind < 0.65:
        ref = ""
    elif kind < 0.8:
        ref = rng.choice(["x", "x.y", ".abc", "abc.", "é.0123456789abcdef", "..", "a.b.c"])
    else:  # signed for the caller (or a), for an id that may not exist
        owner = caller if caller != "nobody" else "a"
        eid = rng.choice(["nope", "00ff", *list(entries)[:1]])
        ref = rig.tenants.entry_ref(tenant[owner], eid)
    rating = rng.choice([opb.RATING_GOOD, opb.RATING_BAD] * 2 + [opb.RATING_UNSPECIFIED, 42])
    before = _rpc_counts()
    code, resp = rig.server.call("Feedback", opb.FeedbackRequest(semantic_entry_id=ref,
                                                                 rating=rating),
                                 token.get(caller, "no-such-token-0123456789"))
    log(f"t={rig.clock.t} {caller} rates {ref[:12]!r} (of {owner}) {rating} -> {code} "
        f"{resp if code != 'OK' else (resp.invalidated, resp.verified)}")
    e = entries.get(eid) if eid else None
    servable = e is not None and e["held"] and rig.clock.t < e["expires"]
    if caller == "nobody":
        want: tuple = ("UNAUTHENTICATED",)
    elif not ref or rating not in (opb.RATING_GOOD, opb.RATING_BAD):
        want = ("INVALID_ARGUMENT",)
    elif not shards:
        want = ("FAILED_PRECONDITION",) + (("NOT_FOUND",) if owner != caller else ())
    elif owner != caller:
        want = ("NOT_FOUND",)
    elif (servable and e["shard"] in down) or (not servable and down):
        want = ("UNAVAILABLE",)
    elif rating == opb.RATING_BAD or servable:
        want = ("OK",)
    else:
        want = ("NOT_FOUND",)
    log.check(code in want, f"{code}, the model says {want}")
    after = _rpc_counts()
    log.check(all(after[c] == before[c] + (c == code) for c in CODES),
              f"tiercache_rpc_total moved by {({c: after[c] - before[c] for c in CODES})}")
    if code == "OK" and rating == opb.RATING_BAD:
        log.check((resp.invalidated, resp.verified) == (servable, False),
                  f"invalidated {resp.invalidated}, the model says {servable}")
        if servable:
            e["held"] = False
    elif code == "OK":
        log.check(resp.verified and not resp.invalidated, "a good rating not said verified")
        e["verified"] = True


def stats_of_feedback(rig, rng, log, shards, addrs, entries, down, expired) -> None:
    code, resp = rig.server.call("Stats", opb.StatsRequest(), ADMIN)
    log(f"stats -> {code}")
    log.check(code == "OK", f"Stats: {code} {resp}")
    up = [a for a in addrs if a not in down]
    if not up:
        log.check(not resp.HasField("semantic"), "figures of a tier none of whose shards is up")
    else:
        got = resp.semantic
        want = sum(1 for e in entries.values() if e["held"] and e["shard"] in up)
        log.check((got.shards_total, got.shards_answered) == (len(addrs), len(up)),
                  f"shards {got.shards_answered} of {got.shards_total}")
        log.check(got.entries == want, f"entries {got.entries}, the model says {want}")
        log.check(got.expirations_total == sum(expired[a] for a in up),
                  f"expirations {got.expirations_total}, the model says {expired}")
    code, _ = rig.server.call("Stats", opb.StatsRequest(), rng.choice([TOKEN_A, TOKEN_B]))
    log.check(code == "PERMISSION_DENIED", f"a tenant's Stats: {code}")


# ------------------------------------------------------------------------- part 2: Stats

class Fake:
    """A shard answering Stats with `figs`: up, down, refusing, or slow (answers late)."""

    def __init__(self) -> None:
        self.state, self.figs, self.delay = "up", None, 0.5

    def Stats(self, req, ctx):  # noqa: N802
        if self.state == "down":
            raise errors.Unavailable("shard down")
        if self.state == "refused":
            raise errors.FailedPrecondition("refused")
        if self.state == "slow":
            time.sleep(self.delay)
        return self.figs


class SemanticFake(Fake, semantic_pb2_grpc.SemanticCacheServicer):
    pass


class PrefixFake(Fake, prefix_pb2_grpc.PrefixIndexServicer):
    pass


class StatsRig:
    def __init__(self, folder: str) -> None:
        self.sem = [SemanticFake() for _ in range(3)]
        self.px = [PrefixFake() for _ in range(3)]
        self.handles = [create_server(
            service="semantic", address="127.0.0.1:0",
            services=[(semantic_pb2_grpc.add_SemanticCacheServicer_to_server, s,
                       "tiercache.v1.SemanticCache")]) for s in self.sem]
        self.handles += [create_server(
            service="prefix", address="127.0.0.1:0",
            services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, s,
                       "tiercache.v1.PrefixIndex")]) for s in self.px]
        self.sem_addrs = [h.address for h in self.handles[:3]]
        self.px_addrs = [h.address for h in self.handles[3:]]
        self.registries = {True: _registry(_tokens_file(folder)), False: _registry("")}
        self.server = Orchestrator()

    def close(self) -> None:
        self.server.close()
        for h in self.handles:
            h.stop(0)


def _semantic_figures(rng: random.Random, i: int) -> spb.SemanticStatsResponse:
    r = spb.SemanticStatsResponse(embedding_model=f"emb{i}",
                                  lookup_p50_ms=rng.choice([0.0, 0.5, 1.25, 3.0]),
                                  lookup_p99_ms=rng.choice([0.0, 2.0, 7.5, 9.0]),
                                  threshold_floor=rng.choice([0.0, 0.8, 0.85]),
                                  shard_list_mismatch=rng.choice(["", "", "", f"differs {i}"]))
    for f in SEM_SUM:
        setattr(r, f, rng.choice([0, 1, 2, 7, 2**40]))
    for t in rng.sample(["strict", "standard", "relaxed", "explicit"], rng.randint(0, 3)):
        r.hits_by_tier[t] = rng.randint(0, 9)
    return r


def _prefix_figures(rng: random.Random, i: int) -> prefix_pb2.PrefixStatsResponse:
    r = prefix_pb2.PrefixStatsResponse(block_size=16, shard_list_mismatch=rng.choice(
        ["", "", f"px differs {i}"]))
    for f in PX_SUM:
        setattr(r, f, rng.choice([0, 1, 3, 2**33]))
    for rid in rng.sample([f"r{k}" for k in range(4)], rng.randint(0, 4)):
        r.replicas.add(replica_id=rid, incarnation=f"inc{i}", address=f"a{i}",
                       held_blocks=rng.randint(0, 50), last_seen_s=rng.choice([0.5, 1.0, 4.0]),
                       capacity_blocks=100 * i)
    return r


def _notes(addrs, fakes, sharded: bool) -> str:
    said = [(a, f.figs.shard_list_mismatch) for a, f in zip(addrs, fakes, strict=True)
            if f.state == "up" and f.figs.shard_list_mismatch]
    return "; ".join(f"{a}: {n}" if sharded else n for a, n in said)


def _shard_lines(log, what, lines, addrs, ok, notes, tier=None) -> None:
    """Each shard's line: healthy when its last call answered (`ok`; None: not known) and its
    last answered Stats had no note (None: not known); the tier's own from theirs."""
    log.check([d.address for d in lines] == addrs, f"{what} lines {lines}")
    for a, d in zip(addrs, lines, strict=True):
        log.check(d.healthy or bool(d.last_error), f"{what} {a} unhealthy without a word")
        if ok.get(a, False) is None or notes.get(a, "") is None:
            continue
        note = notes.get(a, "")
        log.check(d.healthy == (ok.get(a, False) and not note),
                  f"{what} {a} healthy={d.healthy}: last call ok {ok.get(a)}, note {note!r}")
        log.check(not note or note in d.last_error, f"{what} {a}: the note is not said")
    if tier is not None:
        down = [a for a, d in zip(addrs, lines, strict=True) if not d.healthy]
        log.check(tier.healthy == (not down), f"{what} tier line {tier}")
        log.check(not down or tier.last_error == f"{len(down)} of {len(addrs)} shards "
                  f"unhealthy: {', '.join(down)}", f"{what} tier line {tier.last_error!r}")


def run_stats(rig: StatsRig, seed: int, steps: int = 12, slow: bool = False) -> None:
    rng = random.Random(seed)
    tokens = rng.random() < 0.8
    n_sem, n_px, n_rep = rng.randint(0, 3), rng.randint(0, 3), rng.randint(0, 3)
    sem_addrs, px_addrs = rig.sem_addrs[:n_sem], rig.px_addrs[:n_px]
    sem_fakes, px_fakes = rig.sem[:n_sem], rig.px[:n_px]
    replicas = [SimpleNamespace(stats=None, health=Health(f"kvpool/r{i}", f"h{i}:1"))
                for i in range(n_rep)]
    st = OrchestratorStats()
    rig.server.svc.attach(SimpleNamespace(
        stats=st, replicas=SimpleNamespace(replicas=replicas),
        semantic=SemanticBackend(",".join(sem_addrs), "", 5.0),
        prefix=PrefixBackend(tuple(px_addrs), "", 5.0, 16) if px_addrs else None,
        model_id="m"),
        rig.registries[tokens])
    log = Log(seed, "stats")
    sem_ok: dict = {}  # address -> its last call answered (None: not known)
    sem_notes: dict = {}  # address -> the note of its last answered Stats (None: not known)
    px_ok: dict = {}
    px_notes: dict = {}
    states = ["up", "up", "up", "down", "refused"] + (["slow"] if slow else [])
    for _ in range(steps):
        for i, f in enumerate(sem_fakes):
            f.state, f.figs = rng.choice(states), _semantic_figures(rng, i)
        for i, f in enumerate(px_fakes):
            f.state, f.figs = rng.choice(states), _prefix_figures(rng, i)
        for r in replicas:
            r.stats = rng.choice([None, kvpool_pb2.KvStatsResponse(replica_id=r.health.name,
                                                                   running=rng.randint(0, 9))])
            if rng.random() < 0.5:
                r.health.ok()
            elif rng.random() < 0.7:
                r.health.fail(rng.choice(["boom", "down"]))
        for k in ("semantic_hit", "prefix_hit", "cold"):
            st.requests[k] += rng.choice([0, 1, 5])
        st.prompt_tokens += rng.randint(0, 100)
        st.cached_tokens += rng.randint(0, 100)
        st.semantic_tokens_saved += rng.randint(0, 100)
        st.semantic_hits_too_short += rng.randint(0, 2)
        st.semantic_hits_sampled += rng.randint(0, 2)
        st.semantic_hits_ignore_eos += rng.randint(0, 2)
        if rng.random() < 0.5:
            st.degradations[rng.choice(["semantic_skipped", "index_down", "retry"])] += 1
        who = rng.choice([ADMIN, ADMIN, ADMIN, TOKEN_A, "no-such-token-0123456789", ""])
        timeout = 0.6 if slow and rng.random() < 0.5 else 10.0
        code, resp = rig.server.call("Stats", opb.StatsRequest(), who, timeout)
        log(f"sem {[f.state for f in sem_fakes]} px {[f.state for f in px_fakes]} replicas "
            f"{[(r.stats is not None, r.health.healthy) for r in replicas]} caller "
            f"{who[:6]!r} timeout {timeout} -> {code}")
        if tokens and who == TOKEN_A:
            log.check(code == "PERMISSION_DENIED", f"a tenant's Stats: {code}")
            continue
        if tokens and who != ADMIN:
            log.check(code == "UNAUTHENTICATED", f"an unknown caller's Stats: {code}")
            continue
        log.check(code == "OK", f"Stats: {code} {resp}")
        log.check(resp.requests_total == sum(st.requests.values()), "requests_total")
        log.check((resp.semantic_hits, resp.prefix_hits, resp.cold) == (
            st.requests["semantic_hit"], st.requests["prefix_hit"], st.requests["cold"]),
            "request classes")
        log.check((resp.prompt_tokens_total, resp.cached_tokens_total,
                   resp.tokens_saved_semantic, resp.semantic_hits_too_short,
                   resp.semantic_hits_sampled, resp.semantic_hits_ignore_eos) == (
            st.prompt_tokens, st.cached_tokens, st.semantic_tokens_saved,
            st.semantic_hits_too_short, st.semantic_hits_sampled, st.semantic_hits_ignore_eos),
            "token and hit counts")
        log.check(dict(resp.degradations) == dict(st.degradations), "degradations")
        log.check(list(resp.replicas) == [r.stats for r in replicas
                                          if r.stats is not None and r.health.healthy],
                  "replica figures")
        deps = list(resp.dependencies)
        log.check([(d.name, d.address, d.healthy) for d in deps[:n_rep]] == [
            (r.health.name, r.health.address, r.health.healthy) for r in replicas],
            "replica lines")
        deps = deps[n_rep:]
        slow_now = any(f.state == "slow" for f in sem_fakes + px_fakes)
        if n_sem:
            deps = _check_semantic(log, resp, deps, sem_addrs, sem_fakes, sem_ok, sem_notes,
                                   slow_now)
        else:
            log.check(not resp.HasField("semantic"), "semantic figures without a tier")
        if slow_now:  # the prefix index's share of the time follows the semantic tier's
            for a, f in zip(px_addrs, px_fakes, strict=True):
                answered = f.state in ("up", "slow")
                px_ok[a] = None if answered else False
                if answered:
                    px_notes[a] = None
            continue
        if n_px:
            _check_prefix(log, resp, deps, px_addrs, px_fakes, px_ok, px_notes)
        else:
            log.check(not resp.HasField("prefix") and not deps, f"prefix without an index {deps}")


def _check_semantic(log, resp, deps, addrs, fakes, ok, notes, slow_now):
    n = len(addrs)
    answering = [f.figs for f in fakes if f.state in ("up", "slow")]
    for a, f in zip(addrs, fakes, strict=True):
        if f.state == "slow" or (slow_now and f.state == "up"):
            ok[a] = notes[a] = None  # asked in time or not
        else:
            ok[a] = f.state == "up"
            if f.state == "up":
                notes[a] = f.figs.shard_list_mismatch
    got = resp.semantic
    if slow_now:
        if resp.HasField("semantic"):
            log.check(got.shards_total == n and 1 <= got.shards_answered <= len(answering),
                      f"shards {got.shards_answered} of {got.shards_total}")
            log.check(any(all(getattr(got, f) == sum(getattr(p, f) for p in part)
                              for f in SEM_SUM)
                          for part in itertools.combinations(answering, got.shards_answered)),
                      "the sums are not those of any shards that answered")
        lines = deps[:1] if n == 1 else deps[:1 + n]
        return deps[len(lines):]
    figs = [f.figs for f in fakes if f.state == "up"]
    if not figs:
        log.check(not resp.HasField("semantic"), "semantic figures with no shard answering")
    else:
        log.check((got.shards_total, got.shards_answered) == (n, len(figs)),
                  f"shards {got.shards_answered} of {got.shards_total}")
        for f in SEM_SUM:
            log.check(getattr(got, f) == sum(getattr(p, f) for p in figs), f"semantic {f}")
        tiers: Counter = Counter()
        for p in figs:
            tiers.update(dict(p.hits_by_tier))
        log.check(dict(got.hits_by_tier) == dict(tiers), f"hits_by_tier {got.hits_by_tier}")
        for f in ("lookup_p50_ms", "lookup_p99_ms", "threshold_floor"):
            log.check(getattr(got, f) == max(getattr(p, f) for p in figs), f"semantic {f}")
        log.check(got.embedding_model == figs[0].embedding_model, "embedding_model")
        log.check(got.shard_list_mismatch == _notes(addrs, fakes, n > 1),
                  f"semantic note {got.shard_list_mismatch!r}")
    lines = deps[:1] if n == 1 else deps[1:1 + n]
    _shard_lines(log, "semantic", lines, addrs, ok, notes, deps[0] if n > 1 else None)
    if n > 1:
        log.check((deps[0].name, deps[0].address) == ("semantic", ",".join(addrs)),
                  "the semantic tier's line")
    return deps[len(lines) + (n > 1):]


def _check_prefix(log, resp, deps, addrs, fakes, ok, notes) -> None:
    n = len(addrs)
    figs = [f.figs for f in fakes if f.state == "up"]
    for a, f in zip(addrs, fakes, strict=True):
        ok[a] = f.state == "up"
        if f.state == "up":
            notes[a] = f.figs.shard_list_mismatch
    got = resp.prefix
    if not figs:
        log.check(not resp.HasField("prefix"), "prefix figures with no shard answering")
    else:
        log.check(resp.HasField("prefix"), "no prefix figures though some shard answered")
        log.check((got.shards_total, got.shards_answered) == (n, len(figs)),
                  f"prefix shards {got.shards_answered} of {got.shards_total}")
        for f in PX_SUM:
            log.check(getattr(got, f) == sum(getattr(p, f) for p in figs), f"prefix {f}")
        log.check(got.block_size == 16, "block_size")
        held: dict[str, list] = {}
        for p in figs:
            for ri in p.replicas:
                h = held.setdefault(ri.replica_id, [0, []])
                h[0] += ri.held_blocks
                h[1].append(ri.last_seen_s)
        log.check([ri.replica_id for ri in got.replicas] == sorted(held), "prefix replicas")
        for ri in got.replicas:
            blocks, seen = held[ri.replica_id]
            log.check(ri.held_blocks == blocks, f"{ri.replica_id} held_blocks {ri.held_blocks}")
            log.check(min(seen) <= ri.last_seen_s <= max(seen), "last_seen_s")
        log.check(got.shard_list_mismatch == _notes(addrs, fakes, n > 1), "prefix note")
    lines = deps if n == 1 else deps[1:]
    _shard_lines(log, "prefix", lines, addrs, ok, notes, deps[0] if n > 1 else None)


# ------------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def feedback_rig(tmp_path_factory):
    rig = FeedbackRig(str(tmp_path_factory.mktemp("feedback")))
    yield rig
    rig.close()


@pytest.fixture(scope="module")
def stats_rig(tmp_path_factory):
    rig = StatsRig(str(tmp_path_factory.mktemp("stats")))
    yield rig
    rig.close()


@pytest.mark.parametrize("first", range(0, max(1, SEEDS // 4), 10))
def test_feedback_answers_as_the_documented_model(feedback_rig, first, caplog) -> None:
    caplog.set_level(logging.CRITICAL)
    for seed in range(first, min(first + 10, max(1, SEEDS // 4))):
        run_feedback(feedback_rig, seed)


@pytest.mark.parametrize("first", range(0, SEEDS, 40))
def test_stats_aggregates_as_the_documented_model(stats_rig, first, caplog) -> None:
    caplog.set_level(logging.CRITICAL)
    for seed in range(first, min(first + 40, SEEDS)):
        run_stats(stats_rig, seed)


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    part = sys.argv[1] if len(sys.argv) > 1 else "stats"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    folder = tempfile.mkdtemp()
    rig = FeedbackRig(folder) if part == "feedback" else StatsRig(folder)
    failed, t0 = 0, time.monotonic()
    for s in range(n):
        try:
            if part == "feedback":
                run_feedback(rig, s)
            else:
                run_stats(rig, s, slow=part == "slow")
        except Failed as e:
            failed += 1
            if failed <= 3:
                print(e, "\n")
    print(f"{part}: {failed} of {n} seeds failed ({time.monotonic() - t0:.0f} s)")
    os._exit(0)  # the servers' threads
