"""A differential review of `Orchestrator.generate` (services/orchestrator/pipeline.py): whole
requests under seeded random fault schedules, every answer compared with a reference model.

The real pipeline runs against fakes (pure logic, no processes): replicas whose model is a
deterministic function of the token ids they are given (the next token is a hash of the whole
context, of the seed and the draw's index too when sampled, over a six-token vocabulary with
the end of sequence), a semantic tier that keeps what is stored, an index, and routing that
takes the replicas in the request's order (routing itself has its own differential). Each seed
builds one deployment (1-4 replicas, 1-4 attempts, drafts, store_sampled, serve_sampled, the
tier or the index off, routing's memory of prompts sent on or off) and sends 12 requests over 4
prompts (one of them sent by two tenants), each with a random schedule: the lookup answering (a
hit on what was stored, a near miss, another prompt's entry, an entry stored as text only, cut
short, or with ids outside the vocabulary), down, failing, timing out (the tier's timeout, or
cut short by a short deadline), refusing the text or the request's threshold, or the client
gone during it; the index answering, down, timing out, refusing the Match (INVALID_ARGUMENT:
index_refused) or the client gone; each replica attempt answering whole, failing before its
first token or after k tokens (UNAVAILABLE, UNKNOWN, INTERNAL, CANCELLED, our credential
refused, another model, busy, or a clean end without the final message: k reaching the answer's
end loses only the final message), failing after its final message, passing a verdict on the
request, running out the deadline, or the client going after k tokens (in half the worlds
the replicas have KV pools of 4, 8 or 16 blocks, most known to the orchestrator by their
Stats, some declared down before a request; a request needing more blocks than a replica's
pool is refused there, with or without the figure in its words, and handed to a larger pool
that may hold it (not smaller than the figure), healthy and not tried yet, else UNAVAILABLE
while a larger one that may hold it is down or was lost on the request, else refused for good
at once); the Store answering, down, refusing, or the client gone during it; any sampling
(max_tokens 1-9, stop tokens that may be the end of sequence, ignore_eos, greedy or sampled,
seeded or not) and any cache policy flags.

The model (written from DESIGN.md "The life of a request", docs/architecture.md steps 3-9, the
CacheReport, FinishReason and metrics docs) computes the reference answer from scratch and
follows the schedule: what the client receives (every token once, in order, across resumes; a
hit cut as the model would cut it), the finish reason or the error (busy everywhere:
Overloaded; no replica left: Unavailable; a verdict passed on), each Generate request (prompt +
tokens so far, max_tokens left, seed and seed_offset, the draft from where the answer is), what
routing was given (matches raised by the prompts sent moments ago, the replicas excluded),
every CacheReport field (semantic hit, similarity, threshold and whether the request set it,
tier and guard refusal, the reason a hit was not served, prompt
tokens, cached tokens as the last replica said, at most the prompt, replica, route, draft
figures, index_matched_tokens, the entry stored or hit, the draft's entry, the degradations in
order), whether and what was stored (answer, truncated_at, ids), and the deltas of the
orchestrator's counters and metrics (requests and TTFT by cache class, degradations, tokens,
hits not served, draft tokens, forward passes saved, matched and shortfall tokens). A second
test closes the request after its client took a few events (the replica side racing on):
invariants only, as listed in `run_client_stop`.

Where the docs do not settle it the model follows the code and says so: a replica that failed
INTERNAL or UNKNOWN keeps its credit in routing's memory of prompts sent (architecture.md
step 5 says a replica that fails is forgotten; pipeline.py keeps it for those two codes, which
do not mark a replica down), and one that refuses a request outright (a verdict before any
token, not its deadline) takes back only the credit that request added there; a hit not
served for several reasons counts the first of too_short, ignore_eos, sampled; a prompt
under one block asks the index nothing; a client gone during the Store gets no final message
but may or may not count as a request served (either is accepted: the pipeline counts it, its
client having taken every token).

Run: 3,000 seeds x 12 requests (36,000 requests) and 2,000 client-gone runs: no divergence.
Each of 6 hand-made mutants fails seeds (of 300): the sampled draw restarted on a resume
(87), a stop token not seen as the answer's end when the final message is lost (128), the
draft not advanced on a resume (10), a cut-short
answer replacing a whole hit (14), the shortfall counting the prompt's last token (73),
every failover counted as a retry (287). Of the pool sizes (300 seeds, in groups of 10):
the pipeline before larger_pool_down and the refusal past every pool fails 25 groups of 30;
a too-small pool's hop counted as a failed attempt 22; "too big" never kept after a smaller
pool failed 6; a down pool taken to hold any need 18.
`ORCH_PIPELINE_DIFFERENTIAL_SEEDS=N` runs more (default 200 seeds of each test, ~4 s).
Of the client-gone test, dropping routing's release of a call fails 270 seeds of 300 (dropping
the cancel of a call left mid-stream fails none: the client's own callbacks cancel it first).
"""

from __future__ import annotations

import os
import random
import time
from array import array
from dataclasses import dataclass, field
from hashlib import blake2b
from types import SimpleNamespace
from typing import NoReturn

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2, semantic_pb2

from services.common import errors
from services.common.hashing import BlockHasher
from services.orchestrator import pipeline
from services.orchestrator.backends import ReplicaSet
from services.orchestrator.dispatched import DispatchMemory
from services.orchestrator.pipeline import Finished, Orchestrator, Policy, Sampling, TextDelta
from services.orchestrator.render import RenderedPrompt
from services.orchestrator.tenants import Tenant
from tests.blank_text import blank

SEEDS = int(os.environ.get("ORCH_PIPELINE_DIFFERENTIAL_SEEDS", "200"))

EOS = 0
# The fake model's vocabulary: end of sequence, five letters and a space (ASCII: the
# detokenizer's multi-byte cases have their own differential).
VOCAB = (EOS, *b"abcde ")
BLOCK = 16
R_EOS, R_LENGTH, R_STOP, R_CACHED = (common_pb2.FINISH_REASON_EOS,
                                     common_pb2.FINISH_REASON_LENGTH,
                                     common_pb2.FINISH_REASON_STOP,
                                     common_pb2.FINISH_REASON_CACHED)
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED)


class Tok:
    """Byte-level: id i is byte i; 0 is the end of sequence (special: left out of text)."""

    eos_token_id = EOS
    all_special_ids = [EOS]

    def __len__(self) -> int:
        return 256

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i for i in ids if i or not skip_special_tokens).decode("utf-8", "replace")

    def encode(self, text: str, add_special_tokens=False) -> list[int]:
        return list(text.encode())


TOK = Tok()


def text(ids) -> str:
    return TOK.decode(ids)


# ---- the fake model: the next token is a function of the whole context -------------------

def next_token(context: list[int], sample: tuple[int, int] | None) -> int:
    """Greedy: a hash of the context; sampled: of the context, the seed and the draw's index
    (so a resume that passes the wrong seed or seed_offset draws otherwise)."""
    h = blake2b(array("I", context).tobytes(), digest_size=8)
    if sample is not None:
        h.update(b"s%d:%d" % sample)
    return VOCAB[int.from_bytes(h.digest(), "big") % len(VOCAB)]


def continuation(context: list[int], max_tokens: int, stop: tuple[int, ...], ignore_eos: bool,
                 seed: int | None, offset: int) -> tuple[list[int], int]:
    """What a replica generates for `context`, and why it stopped (its own rules: the end of
    sequence before a stop token, then max_tokens)."""
    out: list[int] = []
    while True:
        t = next_token(context + out, None if seed is None else (seed, offset + len(out)))
        out.append(t)
        if not ignore_eos and t == EOS:
            return out, R_EOS
        if t in stop:
            return out, R_STOP
        if len(out) >= max_tokens:
            return out, R_LENGTH


# ---- fakes: replicas, semantic tier, index, routing --------------------------------------

class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", busy: bool = False) -> None:
        self._code, self._details, self._busy = code, details or code.name.lower(), busy

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ((errors.OVERLOADED_KEY, "1"),) if self._busy else ()


def failure(kind: str) -> RpcError:
    """A replica failure by name."""
    if kind == "busy":
        return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "replica busy: queue full", True)
    if kind == "other_model":
        return RpcError(grpc.StatusCode.FAILED_PRECONDITION, "model_id: serves another")
    if kind == "too_big":
        return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "token_ids: need 9 blocks, have 4")
    if kind.startswith("too_big:"):  # a pool too small for the request: too_big:<need>:<pool>
        need, pool = kind.split(":")[1:]
        return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"token_ids: prompt + sampling.max_tokens need {need} KV blocks, the "
                        f"pool has {pool}" if need else "token_ids: too long for this pool")
    return RpcError(getattr(grpc.StatusCode, kind.upper()))


@dataclass
class Attempt:
    """One Generate call's fate: `ok` (the whole rest, then the final message), `die` (k
    tokens, then `error` or, error None, a clean end without the final message), `after`
    (everything, the final message, then `error`), `cancel` (the client goes after k tokens).
    `final`: the figures of the final message."""

    kind: str
    k: int = 0
    error: str | None = None
    cached: int = 0
    replica_id_said: bool = True
    proposed: int = 0
    accepted: int = 0
    lookup: int = 0
    passes: int = 0
    chunks: list[int] = field(default_factory=list)
    final_attached: bool = False


class GenCall:
    """A Generate stream following an `Attempt`, as gRPC's: `cancel` ends it CANCELLED."""

    def __init__(self, world: World, rid: str, req, att: Attempt) -> None:
        self.world, self.rid, self.req, self.att = world, rid, req, att
        self.cancelled = self.ended = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def _check(self):
        if self.cancelled:
            raise RpcError(grpc.StatusCode.CANCELLED)

    def __iter__(self):
        try:
            yield from self._stream()
        finally:
            self.ended = True

    def _stream(self):
        req, att = self.req, self.att
        sampled = req.sampling.temperature > 0
        cont, reason = continuation(
            list(req.token_ids), req.sampling.max_tokens, tuple(req.sampling.stop_token_ids),
            req.sampling.ignore_eos, req.sampling.seed if sampled else None, req.seed_offset)
        fin = kvpool_pb2.KvGenerateFinal(
            finish_reason=reason, cached_tokens=att.cached,
            replica_id=self.rid if att.replica_id_said else "",
            draft_tokens_proposed=att.proposed, draft_tokens_accepted=att.accepted,
            lookup_tokens_accepted=att.lookup, forward_passes=att.passes,
            usage=common_pb2.Usage(prompt_tokens=len(req.token_ids),
                                   completion_tokens=len(cont)))
        whole = att.kind in ("ok", "after")
        n = len(cont) if whole else min(att.k, len(cont))
        sent, chunks = 0, list(att.chunks)
        self._check()
        if att.kind == "cancel" and n == 0:
            self.world.client_gone()
            self._check()
        while sent < n:
            size = min(chunks.pop(0) if chunks else 1, n - sent)
            part = cont[sent:sent + size]
            sent += size
            attach = whole and sent == n and att.final_attached
            yield kvpool_pb2.KvGenerateResponse(token_ids=part, final=fin if attach else None)
            if att.kind == "cancel" and sent == n:
                self.world.client_gone()
            self._check()
        if whole and not att.final_attached:
            yield kvpool_pb2.KvGenerateResponse(final=fin)
        if att.kind == "ok":
            return
        if att.error is not None:
            raise failure(att.error)


class Stub:
    def __init__(self, world: World, address: str) -> None:
        self.world, self.address = world, address

    def Generate(self, req, timeout=None, metadata=None):  # noqa: N802
        w = self.world
        att = w.attempt_on(self.address, w.attempts[len(w.calls)])
        w.calls.append((self.address, req))
        call = GenCall(w, w.rid_of[self.address], req, att)
        w.gen_calls.append(call)
        return call


class Cancellable:
    def cancel(self) -> bool:
        return True


def cancelled(world: World, on_call) -> NoReturn:
    """A tier call whose client goes while it is under way: `on_call` is given the call to
    cancel, and the call ends cancelled."""
    if on_call is not None:
        on_call(Cancellable())
    world.client_gone()
    raise grpc.FutureCancelledError()


class SemanticTier:
    """Entries by (namespace, prompt text); each call does what the request's schedule says."""

    timeout_s = 2.0

    def shard_for(self, ns) -> str:
        return "sem:1"

    def __init__(self, world: World, enabled: bool) -> None:
        self.world, self.enabled = world, enabled
        self.entries: dict[tuple, semantic_pb2.SemanticEntry] = {}
        self.lookups: list = []
        self.stores: list = []
        self.n = 0

    def lookup(self, req, timeout=None, on_call=None):
        self.lookups.append(req)
        mode = self.world.plan.lookup
        if mode == "cancel":
            cancelled(self.world, on_call)
        if mode in ("unavailable", "internal", "deadline_exceeded", "invalid_argument"):
            raise RpcError(getattr(grpc.StatusCode, mode.upper()), "text: too long")
        if mode == "bad_threshold":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "threshold: must be 0 or in [.85, 1]")
        return self.world.plan.answer

    def store(self, req, timeout=None, on_call=None):
        self.stores.append(req)
        mode = self.world.plan.store
        if mode == "cancel":
            cancelled(self.world, on_call)
        if mode in ("unavailable", "invalid_argument", "internal"):
            raise RpcError(getattr(grpc.StatusCode, mode.upper()))
        self.n += 1
        entry = semantic_pb2.SemanticEntry(
            id=f"s{self.n}", prompt=req.prompt, answer=req.answer,
            truncated_at=req.truncated_at, answer_token_ids=req.answer_token_ids)
        self.entries[(req.namespace.tenant, req.namespace.context_hash, req.prompt)] = entry
        return SimpleNamespace(id=entry.id)


class Index:
    timeout_s = 1.0

    def __init__(self, world: World) -> None:
        self.world = world
        self.calls = 0

    def match(self, hashes, model_id, timeout=None, probe=False, on_call=None):
        self.calls += 1
        mode = self.world.plan.index
        if mode == "cancel":
            cancelled(self.world, on_call)
        if mode in ("unavailable", "deadline_exceeded"):
            raise RpcError(getattr(grpc.StatusCode, mode.upper()))
        if mode == "refused":  # a live index: the prompt is past its max_blocks
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           "hashes: 9000 blocks, more than max_blocks 8192")
        return dict(self.world.plan.matches)


class InOrder:
    """Routing that takes the replicas in the request's order, skipping those excluded; it
    keeps what it was given (the matches it saw, the exclusions) for the comparison."""

    def __init__(self, world: World) -> None:
        self.world = world

    def choose(self, views, seen, affinity, exclude=frozenset(), new_blocks=None,
               continues=False, record=True):
        w = self.world
        w.routed.append((dict(seen), set(exclude)))
        # As the real routing: only the replicas `views` offers (the healthy ones, or every
        # one when none is); a world without pool sizes keeps every replica up.
        offered = {v.replica_id for v in views}
        for addr in w.plan.order:
            rid = w.rid_of[addr]
            if w.pools is not None and rid not in offered:
                continue
            if rid not in exclude and addr not in exclude:
                route = "prefix" if seen.get(rid, 0) >= w.min_prefix else "ring"
                return SimpleNamespace(replica_id=rid, route=route, matched_tokens=seen.get(rid, 0))
        return None


# ---- one run: the world, the schedule of each request ------------------------------------

@dataclass
class Plan:
    """One request and its schedule of faults."""

    prompt: list[int]
    query: str
    tenant: Tenant
    sampling: Sampling
    policy: Policy
    return_ids: bool
    short_deadline: bool
    lookup: str  # answer / cancel / unavailable / internal / deadline_exceeded / ...
    answer: semantic_pb2.LookupResponse | None
    index: str  # answer / cancel / unavailable / deadline_exceeded / refused
    matches: dict[str, int]
    order: list[str]
    store: str  # ok / cancel / unavailable / invalid_argument / internal
    attempts: list[Attempt]
    # In a world with pool sizes (`World.pools`): the KV blocks the request needs (a replica
    # whose pool is smaller refuses it, whatever its attempt said), whether the refusal says
    # the figure (an older build's words do not), and the replicas declared down (their
    # Stats polls failed) before the request.
    need: int = 0
    need_said: bool = True
    down: frozenset = frozenset()


TENANTS = (Tenant("a", "salt-a", 10_000, 1_000, 4), Tenant("b", "salt-b", 10_000, 1_000, 4))
STATS_FIELDS = ("prompt_tokens", "cached_tokens", "semantic_tokens_saved",
                "semantic_hits_too_short", "semantic_hits_sampled", "semantic_hits_ignore_eos")
METRICS = (
    [("tiercache_orchestrator_requests_total", {"cache_class": c})
     for c in ("semantic_hit", "prefix_hit", "cold")]
    + [("tiercache_orchestrator_ttft_seconds_count", {"cache_class": c})
       for c in ("semantic_hit", "prefix_hit", "cold")]
    + [("tiercache_orchestrator_degradations_total", {"kind": k})
       for k in ("semantic_skipped", "index_down", "index_refused", "retry", "resume",
                 "busy_replica", "larger_pool", "larger_pool_down", "draft_dropped",
                 "semantic_store_failed")]
    + [("tiercache_orchestrator_tokens_total", {"kind": k})
       for k in ("prompt", "cached", "generated", "saved_semantic")]
    + [("tiercache_orchestrator_semantic_hits_not_served_total", {"reason": r})
       for r in ("too_short", "sampled", "ignore_eos")]
    + [("tiercache_orchestrator_draft_tokens_total", {"kind": k})
       for k in ("proposed", "accepted_from_cache", "accepted_from_lookup")]
    + [("tiercache_orchestrator_forward_passes_saved_total", {}),
       ("tiercache_orchestrator_prefix_matched_tokens_total", {}),
       ("tiercache_orchestrator_prefix_match_shortfall_tokens_total", {})])


_WANTED = {(n, tuple(sorted(lab.items()))) for n, lab in METRICS}


def metrics() -> dict:
    """The orchestrator's counters named in METRICS (one pass over its own collectors)."""
    out = dict.fromkeys(_WANTED, 0.0)
    for collector in (pipeline.REQUESTS, pipeline.TTFT, pipeline.DEGRADED, pipeline.TOKENS,
                      pipeline.NOT_SERVED, pipeline.DRAFT_TOKENS, pipeline.PASSES_SAVED,
                      pipeline.MATCHED_TOKENS, pipeline.MATCH_SHORTFALL):
        for fam in collector.collect():
            for sm in fam.samples:
                key = (sm.name, tuple(sorted(sm.labels.items())))
                if key in out:
                    out[key] = sm.value
    return out


def metric_key(name: str, **labels) -> tuple:
    return (name, tuple(sorted(labels.items())))


class World:
    """The real Orchestrator wired to the fakes, and what the fakes saw of one request."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        n = rng.randint(1, 4)
        self.addresses = [f"r{i}" for i in range(n)]
        # A replica is known by its own id once polled; one may still go by its address.
        self.rid_of = {a: (a if rng.random() < 0.15 else f"kv-{a}") for a in self.addresses}
        self.min_prefix = rng.choice((16, 32))
        self.max_attempts = rng.randint(1, 4)
        self.enable_drafts = rng.random() < 0.7
        self.store_sampled = rng.random() < 0.2
        self.serve_sampled = rng.random() < 0.2
        self.semantic = SemanticTier(self, enabled=rng.random() < 0.9)
        self.index = Index(self) if rng.random() < 0.8 else None
        self.dispatch_on = rng.random() < 0.7
        # Pool sizes (KV blocks) in half the worlds: each replica's, and whether the
        # orchestrator knows it (a replica that never answered a Stats has no size here).
        self.pools: dict[str, int] | None = None
        self.known: set[str] = set()
        if rng.random() < 0.5:
            self.pools = {a: rng.choice((4, 8, 16)) for a in self.addresses}
            self.known = {a for a in self.addresses if rng.random() < 0.9}
        replicas = ReplicaSet(tuple(self.addresses), "")
        for r in replicas.replicas:
            r.stub = Stub(self, r.address)
            r.replica_id = self.rid_of[r.address]
            r.health.ok()
            if self.pools is not None and r.address in self.known:
                r.stats = kvpool_pb2.KvStatsResponse(replica_id=r.replica_id,
                                                     blocks_total=self.pools[r.address])
        self.orch = Orchestrator(
            renderer=SimpleNamespace(encode=TOK.encode, encode_literal=TOK.encode),
            tokenizer=TOK, model_id="m", hasher=BlockHasher("m", BLOCK, b"k" * 32),
            replicas=replicas, semantic=self.semantic, prefix=self.index,
            routing=InOrder(self), internal_token="", default_tier="standard",
            enable_drafts=self.enable_drafts, store_sampled=self.store_sampled,
            max_attempts=self.max_attempts, min_prefix_tokens=self.min_prefix,
            dispatched=DispatchMemory(BLOCK, 3600.0) if self.dispatch_on else None,
            serve_sampled=self.serve_sampled)
        self.plan: Plan | None = None
        self.cancel_fns: list = []
        self.calls: list = []
        self.gen_calls: list[GenCall] = []
        self.routed: list = []
        self.attempts: list[Attempt] = []
        self.prompts = [self._prompt(i) for i in range(3)]
        # A second tenant sending the first prompt: namespaces and salts keep them apart.
        self.prompts.append((list(self.prompts[0][0]), self.prompts[0][1], TENANTS[1]))

    def _prompt(self, i: int) -> tuple[list[int], str, Tenant]:
        rng = self.rng
        n = rng.choice((3, 15, 16, 17, 31, 32, 33, 40))
        ids = [rng.choice(b"pqrstuvwxyz") for _ in range(n)]
        return ids, f"q{i}", TENANTS[0]

    def client_gone(self) -> None:
        for fn in self.cancel_fns:
            fn()

    def attempt_on(self, addr: str, att: Attempt) -> Attempt:
        """What replica `addr` does with the request: a pool smaller than the request's need
        refuses it before anything else (kvpool's `submit`), whatever `att` said."""
        p = self.plan
        if self.pools is not None and p.need > self.pools[addr]:
            return Attempt("die", 0, f"too_big:{p.need if p.need_said else ''}:"
                                     f"{self.pools[addr]}")
        return att

    def set_health(self) -> None:
        """A world with pool sizes: the replicas the request's plan has down declared so (as
        the Stats poller does), the others healthy (those lost by an earlier request too)."""
        if self.pools is None:
            return
        for r in self.orch.replicas.replicas:
            if r.address in self.plan.down:
                r.health.fail("Connection refused", hold=True)
            else:
                r.health.ok()

    def known_pool(self, addr: str) -> int:
        """`addr`'s pool as the orchestrator knows it (its last Stats); 0 if unknown."""
        return self.pools[addr] if self.pools is not None and addr in self.known else 0

    def public_id(self, addr: str) -> str:
        rid = self.rid_of[addr]
        return rid if rid != addr else f"kvpool#{self.addresses.index(addr)}"


# ---- the schedule ------------------------------------------------------------------------

SIMILARITIES = (0.0, 0.5, 0.75, 0.875, 0.9375, 1.0)
DIE_ERRORS = ("unavailable", "unknown", "internal", "cancelled", "unauthenticated",
              "permission_denied", "busy", "other_model", None)
VERDICTS = ("invalid_argument", "too_big", "out_of_range", "deadline_exceeded")


def pick(rng: random.Random, weights: dict[str, float]) -> str:
    return rng.choices(list(weights), list(weights.values()))[0]


def synthetic_entry(rng: random.Random, n: int, may_be_foreign: bool
                    ) -> semantic_pb2.SemanticEntry:
    """An entry the tier may hold though this orchestrator never stored it: a client's Store
    (text only), another prompt's answer, a cut-short answer, ids outside the vocabulary."""
    ids = [rng.choice(VOCAB[1:]) for _ in range(rng.randint(1, 7))]
    cut = 0
    if rng.random() < 0.4:
        ids.append(EOS)
    elif rng.random() < 0.6:
        cut = len(ids)
    entry = semantic_pb2.SemanticEntry(id=f"x{n}", answer=text(ids), truncated_at=cut)
    if may_be_foreign and rng.random() < 0.3:
        entry.answer_token_ids.extend(ids[:-1] + [rng.choice((256, 300, 2**31))])
    elif rng.random() < 0.75:
        entry.answer_token_ids.extend(ids)
    return entry


def make_plan(w: World, rng: random.Random, n: int) -> Plan:
    prompt, query, tenant = rng.choice(w.prompts)
    sampling = Sampling(
        max_tokens=rng.choice((1, 1, 2, 3, 4, 6, 9)),
        temperature=0.0 if rng.random() < 0.75 else 0.7, top_p=1.0,
        seed=0 if rng.random() < 0.5 else rng.randint(1, 1000),
        stop_token_ids=tuple(rng.sample(VOCAB, rng.choice((0, 0, 1, 2)))),
        ignore_eos=rng.random() < 0.15)
    policy = Policy(skip_semantic_lookup=rng.random() < 0.1,
                    skip_semantic_store=rng.random() < 0.1,
                    skip_prefix_cache=rng.random() < 0.1, skip_draft=rng.random() < 0.15,
                    store_sampled=rng.random() < 0.15, serve_sampled=rng.random() < 0.15,
                    semantic_threshold=0.9 if rng.random() < 0.2 else 0.0)
    lookup = pick(rng, {"answer": 0.76, "unavailable": 0.05, "internal": 0.03,
                        "deadline_exceeded": 0.05, "invalid_argument": 0.04,
                        "bad_threshold": 0.02, "cancel": 0.03})
    stored = w.semantic.entries.get((tenant.name, "ctx", query))
    others = list(w.semantic.entries.values())
    sim = rng.choice(SIMILARITIES)
    r = rng.random()
    if stored is not None and r < 0.6:
        answer = semantic_pb2.LookupResponse(hit=rng.random() < 0.75, entry=stored,
                                             similarity=sim)
    elif r < 0.7:
        answer = semantic_pb2.LookupResponse(similarity=sim if rng.random() < 0.5 else 0.0)
    elif r < 0.9 or not others:
        hit = rng.random() < 0.4
        answer = semantic_pb2.LookupResponse(hit=hit, similarity=sim,
                                             entry=synthetic_entry(rng, n, not hit))
    else:
        answer = semantic_pb2.LookupResponse(hit=rng.random() < 0.5, entry=rng.choice(others),
                                             similarity=sim)
    index = pick(rng, {"answer": 0.76, "unavailable": 0.08, "deadline_exceeded": 0.07,
                       "refused": 0.04, "cancel": 0.05})
    rids = list(w.rid_of.values()) + ["kv-gone"]
    matches = {rid: rng.choice((8, 16, 32, 48, 64)) for rid in rids if rng.random() < 0.4}
    order = list(w.addresses)
    rng.shuffle(order)
    store = pick(rng, {"ok": 0.8, "unavailable": 0.06, "internal": 0.02,
                       "invalid_argument": 0.06, "cancel": 0.06})
    attempts = []
    # A pool too small is a hop, not an attempt used up: each replica may be asked once.
    n_attempts = (w.max_attempts + 1 if w.pools is None
                  else max(w.max_attempts + 1, len(w.addresses)))
    for _ in range(n_attempts):
        kind = pick(rng, {"ok": 0.45, "die": 0.35, "after": 0.06, "cancel": 0.03,
                          "verdict": 0.05, "busy": 0.06})
        k = rng.choice((0, 0, 1, 2, 3, 9))
        error = (rng.choice(DIE_ERRORS) if kind == "die" else rng.choice(VERDICTS)
                 if kind == "verdict" else "busy" if kind == "busy"
                 else rng.choice(("unavailable", "cancelled")) if kind == "after" else None)
        if kind == "busy":
            kind, k = "die", rng.choice((0, 0, 1, 9))
        elif kind == "verdict":
            kind = "die"
            if w.pools is not None and error == "too_big":
                error = "invalid_argument"  # in a sized world "too big" follows the sizes
        attempts.append(Attempt(
            kind, k, error, cached=rng.choice((0, 5, 16, 31, 32, 33, 48, 200)),
            replica_id_said=rng.random() < 0.85, proposed=rng.randint(0, 6),
            accepted=rng.randint(0, 4), lookup=rng.randint(0, 2), passes=rng.randint(0, 9),
            chunks=[rng.randint(1, 3) for _ in range(6)],
            final_attached=rng.random() < 0.5))
    plan = Plan(prompt, query, tenant, sampling, policy, rng.random() < 0.7,
                rng.random() < 0.1, lookup, answer, index, matches, order, store, attempts)
    # What the tier held the candidate to, and a refusal above it: passed on in the report.
    answer.threshold = rng.choice((0.0, 0.9, 0.93, 0.95, 0.97))
    answer.tier = rng.choice(("", "strict", "standard", "relaxed"))
    if rng.random() < 0.2:
        answer.guard_rejected, answer.guard_reason = True, "numbers differ"
    if w.pools is not None:
        plan.need = rng.choice((0, 2, 6, 6, 12, 12, 20))
        plan.need_said = rng.random() < 0.9
        plan.down = frozenset(a for a in w.addresses if rng.random() < 0.25)
    return plan


# ---- the reference model -----------------------------------------------------------------

@dataclass
class ModelState:
    """What persists between requests: the answers stored, the prompts sent to each replica
    (routing's memory of them)."""

    entries: dict = field(default_factory=dict)  # (tenant, context, prompt) -> (answer, cut, ids)
    sent: dict = field(default_factory=dict)  # replica id -> {(salt, leading blocks' tokens)}


@dataclass
class Expected:
    ids: list[int] = field(default_factory=list)
    error: str | None = None  # the status code name; "OVERLOADED" for RESOURCE_EXHAUSTED+trailer
    finish: int | None = None
    completion: int = 0
    prompt_tokens: int = 0
    report: dict = field(default_factory=dict)
    lookup: bool = False
    index: bool = False
    requests: list = field(default_factory=list)  # (address, token ids, max, offset, draft)
    routed: list = field(default_factory=list)  # (seen, excluded)
    store: tuple | None = None  # (answer, truncated_at, ids)
    metrics: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    text: str | None = None  # a hit's text, when it is not that of its ids
    # A client gone during the Store: whether the request still counts as served is not
    # settled by the docs (it took every token; it never got the final message).
    either_counted: bool = False


def blocks_of(salt: str, prompt: list[int]) -> list[tuple]:
    return [(salt, tuple(prompt[:BLOCK * (i + 1)])) for i in range(len(prompt) // BLOCK)]


def model(w: World, st: ModelState, p: Plan, seed: int | None, stored: int) -> Expected:
    """The documented behaviour of one request (DESIGN.md "The life of a request",
    docs/architecture.md steps 3-9, CacheReport's and the metrics' own words); `seed`: the
    one the orchestrator drew for an unseeded sample (read from its first Generate); `stored`:
    the entries the tier had stored before (the next one is named after the count)."""
    E = Expected()
    s, pol = p.sampling, p.policy
    met, stats = E.metrics, E.stats

    def bump(d, k, v=1):
        d[k] = d.get(k, 0) + v

    notes: list[str] = []

    def degrade(kind):
        bump(stats, ("degradations", kind))
        bump(met, metric_key("tiercache_orchestrator_degradations_total", kind=kind))
        if kind not in notes:
            notes.append(kind)

    greedy = s.temperature == 0.0
    serves_sampled = pol.serve_sampled or w.serve_sampled
    want_draft = w.enable_drafts and not pol.skip_draft
    may_store = not pol.skip_semantic_store and (greedy or pol.store_sampled or w.store_sampled)
    look = None
    # A sampled request with no use for a hit, nor for a draft, storing nothing: no lookup.
    if (w.semantic.enabled and not pol.skip_semantic_lookup
            and (greedy or serves_sampled or want_draft or may_store)):
        E.lookup = True
        if p.lookup == "cancel":
            E.error = "CANCELLED"
            return E
        if p.lookup == "bad_threshold":
            E.error = "INVALID_ARGUMENT"
            return E
        if p.lookup in ("unavailable", "internal") or (p.lookup == "deadline_exceeded"
                                                       and not p.short_deadline):
            degrade("semantic_skipped")
        elif p.lookup == "answer":
            look = p.answer
    draft: list[int] = []
    E.report["semantic_similarity"] = look.similarity if look is not None else 0.0
    # The rest of the tier's reply, passed on as it said it (unset without a lookup).
    E.report["semantic_threshold"] = look.threshold if look is not None else 0.0
    E.report["semantic_tier"] = look.tier if look is not None else ""
    E.report["semantic_guard_rejected"] = look.guard_rejected if look is not None else False
    E.report["semantic_guard_reason"] = look.guard_reason if look is not None else ""
    # Where the threshold came from: the request's own, if it set one and a lookup was made.
    E.report["semantic_threshold_from_request"] = (look is not None
                                                   and pol.semantic_threshold != 0.0)
    # Why a hit was not served (the first reason), in the report as in NOT_SERVED.
    E.report["semantic_not_served"] = ""
    E.report["draft_entry_id"] = ""
    if look is not None:
        entry = look.entry if look.HasField("entry") else None
        ids = (list(entry.answer_token_ids) or TOK.encode(entry.answer)) if entry else []
        if look.hit:
            cut = entry.truncated_at
            # architecture.md: served to a request whose stop token comes within the N tokens.
            stops_inside = bool(cut) and any(t in s.stop_token_ids for t in ids[:cut])
            reason = ("too_short" if cut and cut < s.max_tokens and not stops_inside
                      else "ignore_eos" if s.ignore_eos and not cut
                      else "sampled" if not greedy and not serves_sampled else None)
            if reason is None:
                return serve_hit(E, look, ids, s, met, stats)
            bump(stats, f"semantic_hits_{reason}")
            E.report["semantic_not_served"] = reason
            bump(met, metric_key("tiercache_orchestrator_semantic_hits_not_served_total",
                                 reason=reason))
        if entry is not None and want_draft:
            if all(0 <= t < 256 for t in ids):
                draft, E.report["draft_entry_id"] = ids, entry.id
            else:
                degrade("draft_dropped")
    prompt, P = p.prompt, len(p.prompt)
    hashed = [] if pol.skip_prefix_cache else blocks_of(p.tenant.cache_salt, prompt)
    matches: dict[str, int] = {}
    if hashed and w.index is not None:
        E.index = True
        if p.index == "cancel":
            E.error = "CANCELLED"
            return E
        if p.index == "unavailable" or (p.index == "deadline_exceeded" and not p.short_deadline):
            degrade("index_down")
        elif p.index == "refused":
            # A live index refusing the Match (deploy.md): ring routing, not an outage.
            degrade("index_refused")
        elif p.index == "answer":
            matches = dict(p.matches)
    sample = None if greedy else (s.seed or seed)
    R, F = continuation(list(prompt), s.max_tokens, s.stop_token_ids, s.ignore_eos, sample, 0)
    gen: list[int] = []
    tried: list[str] = []
    only_busy = True
    attempts = failures = 0
    made_up = False
    # Pool sizes (a world with them; deploy.md, the kv_pool reason): a replica whose pool is
    # too small hands the request to a larger one that may hold it, healthy and not tried
    # yet; with the larger
    # one down (or lost on this request) and able to hold it once back, UNAVAILABLE; past every
    # pool whose size is known, down or not, the refusal for good (RESOURCE_EXHAUSTED).
    down = set(p.down)  # replicas down: before the request, and lost during it
    need = p.need if p.need_said else None
    too_big_pool: int | None = None  # the largest pool whose "too big" stands, if one does
    failed_pool = 0  # the largest known pool that failed otherwise on this request

    def may_hold(pool: int, blocks: int) -> bool:
        return pool > blocks and (need is None or pool >= need)

    def larger_down(blocks: int) -> bool:
        return any(may_hold(w.known_pool(a), blocks) for a in down)

    def larger_up(blocks: int) -> bool:
        """A healthy replica not tried yet whose pool may hold what `blocks` refused: larger,
        and not smaller than the need where the refusal said it (past every pool: refused at
        once, no call to a larger pool still too small)."""
        return any(may_hold(w.known_pool(a), blocks) for a in w.addresses
                   if a not in down and a not in tried)

    def give_up(at_no_route: bool = True):
        E.ids = list(gen)
        # With the attempts used up, a "too big" stands only where no pool, tried or not, up
        # or down, may hold the request (it can never fit).
        stands = too_big_pool is not None and (at_no_route or not (
            larger_up(too_big_pool) or may_hold(failed_pool, too_big_pool)
            or larger_down(too_big_pool)))
        if stands and not larger_down(too_big_pool):
            E.error = "RESOURCE_EXHAUSTED"
        elif at_no_route and too_big_pool is not None:
            E.error = "UNAVAILABLE"  # the larger pool down: the request fits once it is back
        else:
            E.error = "OVERLOADED" if tried and only_busy else "UNAVAILABLE"
        return E

    while True:
        seen = dict(matches)
        if w.dispatch_on and hashed:
            for rid, held in st.sent.items():
                n = 0
                while n < len(hashed) and hashed[n] in held:
                    n += 1
                if n * BLOCK > seen.get(rid, 0):
                    seen[rid] = n * BLOCK
        excluded = {x for a in tried for x in (a, w.rid_of[a])}
        E.routed.append((seen, excluded))
        # Routing is offered the healthy replicas, or every one when none is.
        up = [a for a in w.addresses if a not in down] or w.addresses
        addr = next((a for a in p.order if a not in tried and a in up), None)
        if addr is None:
            return give_up()
        rid = w.rid_of[addr]
        if attempts == 0:
            route = "prefix" if seen.get(rid, 0) >= w.min_prefix else "ring"
        else:
            route = "resume" if gen else "retry"
        added = set()
        if w.dispatch_on and hashed:
            added = set(hashed) - st.sent.get(rid, set())
            st.sent.setdefault(rid, set()).update(hashed)
        att = w.attempt_on(addr, p.attempts[attempts])
        from_here = len(gen)
        E.requests.append((addr, prompt + gen, s.max_tokens - len(gen), len(gen),
                           draft[len(gen):]))
        rest = R[len(gen):]
        if att.kind in ("ok", "after"):
            gen = list(R)
            break
        gen += rest[:att.k]
        if att.kind == "cancel":
            E.ids, E.error = list(gen), "CANCELLED"
            return E
        err = att.error
        mine = w.known_pool(addr)
        larger = err.startswith("too_big:") if err else False
        if larger and not (larger_up(mine) or may_hold(failed_pool, mine) or larger_down(mine)):
            err = "too_big"  # no pool, up or down, may hold it: the replica's verdict
            larger = False
        if err in VERDICTS:
            if added and len(gen) == from_here and err != "deadline_exceeded":
                # Refused before computing anything: this request's own credit goes back (not
                # at its deadline: the replica may have computed part of it).
                st.sent[rid] -= added
                if not st.sent[rid]:
                    del st.sent[rid]
            E.ids = list(gen)
            E.error = {"too_big": "RESOURCE_EXHAUSTED"}.get(err, err.upper())
            return E
        busy = err == "busy"
        if larger:
            if failed_pool <= mine:
                too_big_pool = max(too_big_pool or 0, mine)
            # A hand-off to a larger pool, or none left to try with the larger one down.
            degrade("larger_pool" if larger_up(mine) else "larger_pool_down")
        else:
            degrade("busy_replica" if busy else "resume" if gen else "retry")
            if too_big_pool is not None and (not mine or may_hold(mine, too_big_pool)):
                too_big_pool = None  # it may hold the request once back: no verdict
            failed_pool = max(failed_pool, mine)
            if err in ("unavailable", "cancelled", "unauthenticated", "permission_denied",
                       "other_model", None):
                down.add(addr)  # lost: marked down (not INTERNAL / UNKNOWN, nor busy)
        if w.dispatch_on and err not in ("internal", "unknown"):
            st.sent.pop(rid, None)  # a replica that failed is forgotten at once
        tried.append(addr)
        only_busy = only_busy and (busy or larger)
        attempts += 1
        failures += not larger
        if len(gen) == len(R):  # the whole answer was streamed; its final message lost
            made_up = True
            break
        if failures >= w.max_attempts:
            return give_up(at_no_route=False)
    E.ids, E.finish, E.completion, E.prompt_tokens = gen, F, len(gen), P
    cached = 0 if made_up else min(att.cached, P)
    expected = min(seen.get(rid, 0), P)
    said = not made_up and att.replica_id_said
    E.report.update(
        semantic_hit=False, prompt_tokens=P, cached_tokens=cached,
        replica_id=rid if said else w.public_id(addr), route=route,
        draft_tokens_proposed=0 if made_up else att.proposed,
        draft_tokens_accepted=0 if made_up else att.accepted,
        lookup_tokens_accepted=0 if made_up else att.lookup,
        forward_passes=0 if made_up else att.passes, index_matched_tokens=expected,
        semantic_entry_id="")
    cls = "prefix_hit" if cached >= w.min_prefix else "cold"
    bump(met, metric_key("tiercache_orchestrator_requests_total", cache_class=cls))
    bump(met, metric_key("tiercache_orchestrator_ttft_seconds_count", cache_class=cls))
    bump(stats, ("requests", cls))
    bump(stats, "prompt_tokens", P)
    bump(stats, "cached_tokens", cached)
    for kind, v in (("prompt", P), ("cached", cached), ("generated", len(gen))):
        bump(met, metric_key("tiercache_orchestrator_tokens_total", kind=kind), v)
    if not made_up:
        for kind, v in (("proposed", att.proposed),
                        ("accepted_from_cache", max(0, att.accepted - att.lookup)),
                        ("accepted_from_lookup", att.lookup)):
            bump(met, metric_key("tiercache_orchestrator_draft_tokens_total", kind=kind), v)
        bump(met, metric_key("tiercache_orchestrator_forward_passes_saved_total"),
             max(0, len(gen) - from_here - 1 - att.passes))
        bump(met, metric_key("tiercache_orchestrator_prefix_match_shortfall_tokens_total"),
             max(0, min(expected, P - 1) - cached))
    bump(met, metric_key("tiercache_orchestrator_prefix_matched_tokens_total"), expected)
    # The Store (architecture.md step 9).
    answer = text(gen)
    past_end = s.ignore_eos and EOS in gen
    cut_short = F != R_EOS
    shorter = cut_short and look is not None and look.hit and (
        not look.entry.truncated_at or look.entry.truncated_at >= len(gen))
    if (w.semantic.enabled and may_store and not blank(answer) and not past_end
            and not shorter):
        body = gen[:-1] if gen[-1] == EOS else gen
        ids = [] if EOS in body else list(gen)
        E.store = (answer, len(gen) if cut_short else 0, ids)
        if p.store == "ok":
            st.entries[(p.tenant.name, "ctx", p.query)] = E.store
            E.report["semantic_entry_id"] = f"s{stored + 1}"
        elif p.store in ("unavailable", "internal"):
            degrade("semantic_store_failed")
        elif p.store == "cancel":
            E.error, E.either_counted = "CANCELLED", True
    E.report["degradations"] = list(notes)
    return E


def serve_hit(E: Expected, look, ids: list[int], s: Sampling, met: dict, stats: dict
              ) -> Expected:
    """A hit is served as the model's answer would be: read token by token with the model's
    stopping rules (max_tokens, the end of sequence, the request's stop tokens); whole and
    not cut short: CACHED; cut short when stored: LENGTH."""
    entry = look.entry
    finish, out = None, []
    for t in ids:
        if len(out) >= s.max_tokens:
            finish = R_LENGTH
            break
        out.append(t)
        if not s.ignore_eos and t == EOS:
            break
        if t in s.stop_token_ids:
            finish = R_STOP
            break
    if finish is None:
        finish = R_LENGTH if entry.truncated_at else R_CACHED
    E.ids, E.finish, E.completion = out, finish, len(out)
    E.text = entry.answer if out == ids else text(out)
    E.report.update(semantic_hit=True, semantic_entry_id=entry.id, route="semantic",
                    prompt_tokens=0, cached_tokens=0, replica_id="", degradations=[],
                    index_matched_tokens=0)
    met[metric_key("tiercache_orchestrator_requests_total", cache_class="semantic_hit")] = 1
    met[metric_key("tiercache_orchestrator_ttft_seconds_count", cache_class="semantic_hit")] = 1
    met[metric_key("tiercache_orchestrator_tokens_total", kind="saved_semantic")] = len(out)
    stats[("requests", "semantic_hit")] = 1
    stats["semantic_tokens_saved"] = len(out)
    return E


# ---- driving the real pipeline and comparing ---------------------------------------------

REPORT_FIELDS = ("semantic_hit", "semantic_similarity", "prompt_tokens", "cached_tokens",
                 "replica_id", "route", "draft_tokens_proposed", "draft_tokens_accepted",
                 "lookup_tokens_accepted", "forward_passes", "index_matched_tokens",
                 "semantic_entry_id", "draft_entry_id", "semantic_threshold", "semantic_tier",
                 "semantic_guard_rejected", "semantic_guard_reason", "semantic_not_served",
                 "semantic_threshold_from_request")


def stats_of(orch: Orchestrator) -> dict:
    st = orch.stats
    out = {("requests", k): v for k, v in st.requests.items()}
    out.update({("degradations", k): v for k, v in st.degradations.items()})
    out.update({f: getattr(st, f) for f in STATS_FIELDS})
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def run_request(w: World, p: Plan) -> tuple[list, BaseException | None]:
    w.plan, w.calls, w.routed, w.cancel_fns, w.attempts = p, [], [], [], p.attempts
    w.gen_calls = []
    w.set_health()
    events: list = []
    err = None
    deadline = time.monotonic() + (1.0 if p.short_deadline else 30.0)
    try:
        for ev in w.orch.generate(
                tenant=p.tenant, prompt=RenderedPrompt(list(p.prompt), p.query, "ctx"),
                sampling=p.sampling, policy=p.policy, session_id="", request_id="rid",
                return_token_ids=p.return_ids, deadline=deadline,
                on_cancel=w.cancel_fns.append):
            events.append(ev)
    except errors.TierCacheError as e:
        err = e
    return events, err


def check_request(w: World, st: ModelState, p: Plan, where: str) -> None:
    sem = w.semantic
    n_lookups, n_stores, n_index = len(sem.lookups), len(sem.stores), w.index and w.index.calls
    m0, s0 = metrics(), stats_of(w.orch)
    entries_before, stored = dict(sem.entries), sem.n
    events, err = run_request(w, p)
    m1, s1 = metrics(), stats_of(w.orch)
    seed = w.calls[0][1].sampling.seed if w.calls else None
    E = model(w, st, p, seed, stored)
    ctx = f"{where}: plan={p}\nexpected={E}\nevents={events}\nerror={err!r}\ncalls={w.calls}"
    deltas = [e for e in events if isinstance(e, TextDelta)]
    fins = [e for e in events if isinstance(e, Finished)]
    got_ids = [t for e in deltas for t in e.token_ids]
    got_text = "".join(e.text for e in deltas)
    # The stream: every token once, in order, across every resume.
    assert got_text == (E.text if E.text is not None else text(E.ids)), ctx
    assert got_ids == (E.ids if p.return_ids else []), ctx
    # The outcome.
    if E.error is None:
        assert err is None and len(fins) == 1 and events[-1] is fins[0], ctx
        f = fins[0]
        assert (f.finish_reason, f.completion_tokens, f.prompt_tokens) == (
            E.finish, E.completion, E.prompt_tokens), ctx
        got = {k: getattr(f.report, k) for k in REPORT_FIELDS}
        want = {k: E.report.get(k, got[k] if k not in E.report else None) for k in REPORT_FIELDS}
        assert got == want, f"report {got} != {want}\n{ctx}"
        assert list(f.report.degradations) == E.report["degradations"], ctx
    else:
        assert not fins and err is not None, ctx
        code = "OVERLOADED" if isinstance(err, errors.Overloaded) else err.code
        assert code == E.error, ctx
    # What each tier and replica was asked.
    assert len(sem.lookups) - n_lookups == int(E.lookup), ctx
    if w.index is not None:
        assert w.index.calls - n_index == int(E.index), ctx
    got_reqs = [(a, list(r.token_ids), r.sampling.max_tokens, r.seed_offset,
                 list(r.draft_token_ids)) for a, r in w.calls]
    assert got_reqs == E.requests, ctx
    s = p.sampling
    for _, r in w.calls:
        assert (tuple(r.sampling.stop_token_ids), r.sampling.ignore_eos,
                r.sampling.temperature == 0, r.skip_prefix_cache, r.cache_salt) == (
            s.stop_token_ids, s.ignore_eos, s.temperature == 0, p.policy.skip_prefix_cache,
            p.tenant.cache_salt), ctx
        # One draw for the whole answer: the request's seed, or one drawn for it.
        assert r.sampling.seed == (s.seed if s.temperature == 0 or s.seed else seed) and (
            s.temperature == 0 or r.sampling.seed), ctx
    assert [(seen, set(ex)) for seen, ex in w.routed] == E.routed, ctx
    # The Store, and what the tier holds.
    stores = sem.stores[n_stores:]
    if E.store is None:
        assert not stores, ctx
    else:
        assert len(stores) == 1, ctx
        req = stores[0]
        assert (req.answer, req.truncated_at, list(req.answer_token_ids)) == E.store, ctx
        assert (req.prompt, req.namespace.tenant, req.namespace.context_hash) == (
            p.query, p.tenant.name, "ctx"), ctx
    got_entries = {k: (e.answer, e.truncated_at, list(e.answer_token_ids))
                   for k, e in sem.entries.items()}
    assert got_entries == st.entries, ctx
    assert set(entries_before) <= set(sem.entries), ctx
    # Counters: the orchestrator's own and its metrics.
    md, sd = delta(m1, m0), delta(s1, s0)
    E.metrics = {k: v for k, v in E.metrics.items() if v}
    E.stats = {k: v for k, v in E.stats.items() if v}
    if E.either_counted and not md.get(next(iter(
            k for k in md if k[0] == "tiercache_orchestrator_requests_total"), None)):
        E.metrics = {k: v for k, v in E.metrics.items()
                     if "degradations" in k[0]}
        E.stats = {k: v for k, v in E.stats.items() if k[0] == "degradations"}
    assert md == E.metrics, f"metrics {md} != {E.metrics}\n{ctx}"
    assert sd == E.stats, f"stats {sd} != {E.stats}\n{ctx}"
    # Routing's load: every call given back.
    assert all(r.inflight == 0 for r in w.orch.replicas.replicas), ctx


def run_seed(seed: int, n_requests: int = 12) -> None:
    rng = random.Random(seed)
    w = World(rng)
    st = ModelState()
    # The seed an unseeded sample is given, drawn from the run's own generator: a seed's run
    # is the same every time (the model reads the seed from the replica's request anyway).
    drawn = random.Random(seed + 1)
    real, pipeline.secrets = pipeline.secrets, SimpleNamespace(randbits=drawn.getrandbits)
    try:
        for i in range(n_requests):
            p = make_plan(w, rng, i)
            check_request(w, st, p, f"seed {seed} request {i}")
    finally:
        pipeline.secrets = real


@pytest.mark.parametrize("first", range(0, SEEDS, 10))
def test_whole_requests_match_the_model(first):
    for seed in range(first, min(first + 10, SEEDS)):
        run_seed(seed)


def run_client_stop(seed: int) -> None:
    """A client gone after taking `stop` events (its callbacks run, then the request's
    generator is closed, as the gRPC adapter does), while the replica side runs on its own
    thread: how far that side got is a race, so only invariants are checked: what the client
    took is the start of the reference stream; nothing escapes the close; every replica call
    ended or was cancelled and routing's count of it given back; a Store, if one was made, is
    exactly the one of the whole answer."""
    rng = random.Random(seed)
    w = World(rng)
    st = ModelState()
    p = make_plan(w, rng, 0)
    stop = rng.choice((0, 1, 1, 2, 3))
    w.plan, w.attempts = p, p.attempts
    w.set_health()
    events: list = []
    gen = w.orch.generate(
        tenant=p.tenant, prompt=RenderedPrompt(list(p.prompt), p.query, "ctx"),
        sampling=p.sampling, policy=p.policy, session_id="", request_id="rid",
        return_token_ids=True, deadline=time.monotonic() + 30, on_cancel=w.cancel_fns.append)
    try:
        for ev in gen:
            events.append(ev)
            if len(events) >= stop:
                break
    except errors.TierCacheError:
        pass
    w.client_gone()
    gen.close()
    seed_drawn = w.calls[0][1].sampling.seed if w.calls else None
    E = model(w, st, p, seed_drawn, 0)
    ctx = f"seed {seed}: stop={stop} plan={p}\nexpected={E}\nevents={events}"
    got = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
    assert got == E.ids[:len(got)], ctx
    assert all(c.ended or c.cancelled for c in w.gen_calls), ctx
    assert all(r.inflight == 0 for r in w.orch.replicas.replicas), ctx
    for req in w.semantic.stores:
        assert E.store is not None and (
            req.answer, req.truncated_at, list(req.answer_token_ids)) == E.store, ctx


@pytest.mark.parametrize("first", range(0, SEEDS, 20))
def test_a_client_gone_mid_request_leaves_nothing_behind(first):
    for seed in range(first, min(first + 20, SEEDS)):
        run_client_stop(seed)
