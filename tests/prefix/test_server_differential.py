"""A differential review of the prefix index's gRPC adapter (`services.prefix.server`) against
a model of its documented contract (protos/tiercache/v1/prefix.proto, docs/metrics.md, the
docstrings of server.py, index.py, tree.py and shard_list.py), over a real loopback server
(`serve`, 127.0.0.1:0, the index `build_index` makes, its lease sweeper running) on a test
clock.

The model (written from those documents, not from the code; the index behind the adapter at
the level the proto and the index's docstrings describe it, reviewed on its own in
test_index_differential.py):
- every refused call is the documented status (INVALID_ARGUMENT, NOT_FOUND for an unknown
  replica or a stale incarnation, FAILED_PRECONDITION for another block size, a hash probe
  that differs or a replaced incarnation, RESOURCE_EXHAUSTED past max_events / max_blocks)
  with a one-line message that starts with the field it names ("replica_id:", "address:",
  "events[1].stored.first_block_hash:", "block_hashes[1]:", "k:", ...; invalid UTF-8 in any
  string field, "FIELD: invalid UTF-8 ..."), and leaves nothing behind: Stats (replicas,
  leases, held blocks, every counter, the shard-list figures), every prefix metric and later
  Match answers (a probe Match of the refused batch's chain) are as before; only
  tiercache_rpc_total counts it, under its code. Ids and the address: required, at most 256
  printable characters without spaces, no NUL, not blank (model_id: spaces allowed); the
  address also as `announce_problem` says; stored events: hashes of 16 bytes, not repeated,
  not a root's key (h_0), block_size tokens a block, parent_hash empty or 16 bytes and not
  h_0, at the root start_block 0, first_block_hash empty or block_hashes[0], a valid salt; with
  verify_hashes, hashes that match the tokens; Match: model_id required (at most 256), one of
  token_ids and block_hashes, at most max_blocks blocks, a valid salt with tokens; k in
  1..1000;
- Register: the lease, the next batch number and the advertised limits (as configured);
  the same incarnation refreshes address and capacity; another drops the old holdings,
  starts at 1 and makes the old one refused for good; the same incarnation back after a
  lapse carries its numbers on, must resync first, and gets the hits its lapse saved back
  (within a lease). Heartbeat: known, and the load recorded, for the live incarnation only
  (a load with more free_blocks than total_blocks refused, whoever sends it);
- leases lapse at their deadline; a publish taken (applied, a retry, a RESYNC answer)
  renews like a heartbeat, a refused one does not; a lapse forgets the replica's shard list;
- PublishEvents: an old seq is acknowledged and ignored, a later one (or any but a resync
  while one is due) is RESYNC with the seq expected; a batch applies in order, a chain
  waiting within the batch for a parent the replica does not hold yet, else dropped
  (dropped_blocks_total); a removal takes the replica off a block's subtree and reaches
  waiting chains; a resync restates the holdings, keeping the hits of what it stores again;
- Match: every live replica of the model in load order (running + waiting, then id),
  longest leading run of the request's chain first, matched_tokens = blocks * block_size;
  request_blocks, block_size; a hit credited to the deepest block matched unless probe;
  matches/blocks counted in Stats and metrics unless probe; the shard list compared with
  those of the replicas named (or, naming none, with every one registered);
- TopPrefixes: held blocks with at least max(1, min_hits) hits under the filters (an unset
  cache_salt: every salt), hottest first (ties in any order), token ids from the root,
  holders sorted; a block nobody holds loses its hits;
- Stats: nodes (blocks held), bytes (a multiple of 210 covering nodes and unheld ones),
  replicas by id with incarnation, address, model, held blocks, load, last_seen_s and
  capacity, the counters, max_nodes, shards 0/0, the mismatch count and note; the metrics
  of docs/metrics.md: rpc_total by method and code, events_total by kind (batches applied,
  not retries), matches_total and match_blocks_total by result, resyncs_total (as Stats'),
  shard_list_mismatches_total, pruned_total (0), dropped_blocks_total (as Stats'), and the
  nodes, replicas and unheld gauges;
  at the end the sweeper has deleted every unheld node.
Time is a test clock put in the index's place before `serve`, moved under half a lease a
step with a call after each (a longer silence reads as a pause of the process, which the
index forgives); the sweeper runs on real time and sees the same instant as the calls.

Each seed makes every refused call once (67 kinds, 68 with verify_hashes) among 70 random
accepted ones (Register, Heartbeat, PublishEvents, Match, TopPrefixes, time, the limits exactly)
by five replica ids of two models, two salts, blocks of 2 tokens, max_events 6 and max_blocks
12, verify_hashes on in half the seeds; Stats and the metrics are compared after every call.

Run offline: 2,000 seeds (PREFIX_SERVER_DIFFERENTIAL_SEEDS=2000, ~10 min), 15 by default (~6 s);
PREFIX_SERVER_DIFFERENTIAL_STEPS sets the accepted calls per seed. Found:
tiercache_prefix_resyncs_total was documented as "Resyncs requested after a gap", and the log
said "batch N after a gap ... (expects N)", for the RESYNC a replica gets at its first batch
back from a lapsed lease too (the proto's second case, counted in Stats' resyncs_total as well):
the help text and the log now say which (test_server_rules.py).
Nothing else in server.py; the harness's own first versions had a refusal case name the wrong
field (at the root first_block_hash is checked before a root's key) and took a Match of a
chain past max_blocks for accepted.
Stop 68: Register checked a non-empty address before the other fields (a request with an empty
replica_id and a malformed address named the address); it now checks in field order.
Left as is: Match and TopPrefixes take any
model id or salt as a filter (no replica has a whitespace one; a NUL in either, or a salt past
its length limit, is refused since: test_index_rules.py), and Match's limit of
max_blocks blocks was not in the proto (it is since, in full blocks: 65,536 and a partial
one were refused as "more than 1048576 tokens"); the nodes and unheld gauges follow a lapse that a
Match or TopPrefixes found at the sweeper's next turn (it wakes within 5 ms while anything is
unheld); the 64-replica limit and pruning (max_nodes large here) are not driven.
Injected bugs (one at a time in server.py, then reverted), caught 24 of 24 at the default 15
seeds: the address check dropped, max_blocks advertised as max_events, shard lists not
registered, a lapse keeping its list, a Match's list compared with nobody's, Heartbeat's
running and waiting swapped, events counted for retries, resyncs not counted, next_seq sent
as the request's, a stored event's salt or start_block dropped, probe not passed, probes
counted, blocks hit counted as asked, matched_tokens sent as blocks, Match without loads,
TopPrefixes' unset salt read as "", its min_hits dropped, holders dropped, Stats' resyncs
sent as dropped blocks, capacity or unheld nodes not sent, verify_hashes not passed to the
index, the sweeper never reaping.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import REGISTRY
from tiercache.v1 import common_pb2
from tiercache.v1 import prefix_pb2 as pb
from tiercache.v1 import prefix_pb2_grpc as pbg

from services.common.hashing import BlockHasher
from services.prefix.config import PrefixConfig
from services.prefix.server import build_index, serve
from tests.blank_text import blank
from tests.clock import Clock
from tests.prefix.test_index_differential import Universe as Chains
from tests.prefix.test_index_differential import toks
from tests.wire import bad_utf8

SEEDS = int(os.environ.get("PREFIX_SERVER_DIFFERENTIAL_SEEDS", "15"))
STEPS = int(os.environ.get("PREFIX_SERVER_DIFFERENTIAL_STEPS", "70"))
SERVICE = "tiercache.v1.PrefixIndex"
BS = 2
LEASE = 1.0
MAX_EVENTS, MAX_BLOCKS, MAX_NODES = 6, 12, 100_000
BYTES_PER_NODE = 210  # index.APPROX_BYTES_PER_NODE: Stats.bytes counts slots of this size
MODELS = ("m1", "m2")
SALTS = ("", "t")
IDS = {"r0": "m1", "r1": "m1", "r2": "m1", "r3": "m2", "r4": "m1"}
INCS = ("a", "b", "c")
ADDRESSES = ("127.0.0.1:7000", "kv-1.kvpool:50054", "[fd00::5]:50054", "10.0.0.5:1")
FINGERPRINTS = ("", "fp-a", "fp-b", "x" * 70, "x" * 64 + "y")
INVALID = grpc.StatusCode.INVALID_ARGUMENT


class Universe(Chains):
    """The index differential's chains (`toks` of small-int paths) under the index's default
    hash key, the one `serve` builds it with."""

    def __init__(self) -> None:
        super().__init__(key=None)

    def below(self, k: bytes, other: bytes) -> bool:
        """`other` is `k` or lies below it."""
        return other == k or super().below(k, other)


@dataclass
class Rep:
    inc: str
    model: str
    address: str
    capacity: int
    deadline: float
    last_seen: float
    next_seq: int = 1
    awaiting: bool = False
    load: tuple[int, int, int, int] = (0, 0, 0, 0)
    holds: set[bytes] = field(default_factory=set)
    pending: dict[bytes, int] | None = None  # hits a resync or a lapse saved, to give back
    pending_until: float = 0.0


@dataclass
class Model:
    """What the service must hold, answer and have counted, per the documented contract."""

    u: Universe
    now: float
    reps: dict[str, Rep] = field(default_factory=dict)
    hits: dict[bytes, int] = field(default_factory=dict)
    seq_floor: dict[str, tuple[str, int]] = field(default_factory=dict)
    replaced: set[tuple[str, str]] = field(default_factory=set)
    lapsed: dict[str, tuple[str, dict[bytes, int], float]] = field(default_factory=dict)
    lists: dict[str, tuple[int, str]] = field(default_factory=dict)
    matches: int = 0
    matches_hit: int = 0
    blocks: int = 0
    blocks_hit: int = 0
    resyncs: int = 0
    dropped: int = 0
    mismatches: int = 0
    mismatch_at: float | None = None
    verify: bool = False  # the index recomputes stored blocks' hashes
    metrics: dict[tuple, float] = field(default_factory=dict)

    def bump(self, name: str, labels: tuple = (), n: float = 1) -> None:
        key = (name, labels)
        self.metrics[key] = self.metrics.get(key, 0) + n

    def rpc(self, method: str, code: str = "OK") -> None:
        self.bump("tiercache_rpc_total", (("code", code), ("method", method),
                                          ("service", "prefix")))

    # -- holdings -------------------------------------------------------------------------

    def nodes(self) -> set[bytes]:
        return set().union(*(r.holds for r in self.reps.values())) if self.reps else set()

    def forget_hits(self) -> None:
        """A node nobody holds (deleted, or unheld until reaped) has no hits."""
        live = self.nodes()
        for k in [k for k in self.hits if k not in live]:
            del self.hits[k]

    def clear_saving(self, rid: str) -> dict[bytes, int]:
        """The replica's holdings dropped (a lapse, a resync): the hits of the nodes only it
        held, and of those it still had to be given back, are saved."""
        rep = self.reps[rid]
        others = set().union(*(r.holds for o, r in self.reps.items() if o != rid))
        saved = {k: self.hits[k] for k in rep.holds
                 if k not in others and self.hits.get(k, 0) > 0}
        pending = {}
        if rep.pending and self.now <= rep.pending_until:
            pending = {k: v for k, v in rep.pending.items() if k not in saved}
        rep.holds = set()
        self.forget_hits()
        return {**pending, **saved}

    def restore(self, usage: dict[bytes, int]) -> dict[bytes, int]:
        """Saved hits given to nodes stored again with none yet; the rest (not stored)."""
        left = {}
        live = self.nodes()
        for k, h in usage.items():
            if k not in live:
                left[k] = h
            elif not self.hits.get(k):
                self.hits[k] = h
        return left

    def lapse(self) -> None:
        # In the index's order of its replicas (registration; a new incarnation keeps its
        # place): a block two lapsing replicas held is saved for the second.
        for rid in [r for r, rep in self.reps.items() if rep.deadline <= self.now]:
            rep = self.reps[rid]
            self.seq_floor[rid] = (rep.inc, rep.next_seq)
            usage = self.clear_saving(rid)
            self.lapsed.pop(rid, None)
            if usage:
                self.lapsed[rid] = (rep.inc, usage, self.now + LEASE)
            del self.reps[rid]
            self.lists.pop(rid, None)
            self.forget_hits()

    def renew(self, rep: Rep) -> None:
        rep.last_seen, rep.deadline = self.now, self.now + LEASE

    def by_load(self, model: str) -> list[tuple[str, Rep]]:
        return sorted(((rid, r) for rid, r in self.reps.items() if r.model == model),
                      key=lambda x: (x[1].load[0] + x[1].load[1], x[0]))

    # -- the shard-list check -------------------------------------------------------------

    def check_lists(self, shards: int, fp: str, named: list[str]) -> None:
        if not fp or not self.lists:
            return
        sent = (shards, fp[:64])

        def differs(a, b) -> bool:
            return a[1] != b[1] and max(a[0], b[0]) > 1

        theirs = [self.lists[r] for r in named if r in self.lists]
        if theirs:
            bad = any(differs(t, sent) for t in theirs)
        else:
            bad = all(differs(t, sent) for t in self.lists.values())
        if bad:
            self.mismatches += 1
            self.mismatch_at = self.now
            self.bump("tiercache_prefix_shard_list_mismatches_total")


class Refused(Exception):
    """The model's refusal: (code, field)."""

    def __init__(self, code: grpc.StatusCode, fld: str) -> None:
        super().__init__(code, fld)
        self.code, self.fld = code, fld


# ---- the metrics -------------------------------------------------------------------------------


def _metric_values() -> dict[tuple, float]:
    out = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            if s.name == "tiercache_rpc_total" and s.labels.get("service") == "prefix" or \
                    s.name.startswith("tiercache_prefix_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- calls -------------------------------------------------------------------------------------


@dataclass
class Svc:
    stub: pbg.PrefixIndexStub
    channel: grpc.Channel


def call(svc: Svc, method: str, req):
    """The answer, or the RpcError (a request given as bytes goes out as they are: only
    refused ones are)."""
    fn = (svc.channel.unary_unary(f"/{SERVICE}/{method}") if isinstance(req, bytes)
          else getattr(svc.stub, method))
    try:
        return fn(req, timeout=30)
    except grpc.RpcError as e:
        return e


def expect_refused(m: Model, method: str, got, code: grpc.StatusCode, fld: str, what) -> None:
    assert isinstance(got, grpc.RpcError), (method, "accepted", str(what)[:400])
    details = got.details() or ""
    assert got.code() == code, (method, str(what)[:400], got.code(), details)
    assert details.startswith(fld + ":"), (method, fld, details)
    assert "\n" not in details
    m.rpc(method, code.name)


def ok(m: Model, method: str, got, what):
    assert not isinstance(got, grpc.RpcError), (method, str(what)[:400], got.code(),
                                                got.details())
    m.rpc(method)
    return got


# ---- Register ----------------------------------------------------------------------------------


def expected_register(m: Model, req: pb.RegisterRequest) -> pb.RegisterResponse:
    """Register as documented: the model changes, or Refused (and nothing changed)."""
    def check_id(name: str, value: str, printable: bool = True) -> None:
        if not value:
            raise Refused(INVALID, name)
        if blank(value) or len(value) > 256:  # nothing visible: as good as empty
            raise Refused(INVALID, name)
        if printable and (not value.isprintable() or any(c.isspace() for c in value)):
            raise Refused(INVALID, name)
        if "\0" in value:
            raise Refused(INVALID, name)

    check_id("replica_id", req.replica_id)
    check_id("incarnation", req.incarnation)
    from services.common.config import announce_problem
    if announce_problem(req.address):  # the rule a replica's start applies too
        raise Refused(INVALID, "address")
    check_id("model_id", req.model_id, printable=False)
    if req.hash_probe and len(req.hash_probe) != 16:
        raise Refused(INVALID, "hash_probe")
    if not req.block_size:
        raise Refused(INVALID, "block_size")
    if req.block_size != BS:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "block_size")
    if req.hash_probe and req.hash_probe != BlockHasher(req.model_id, BS).probe():
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "hash_probe")
    rid, inc = req.replica_id, req.incarnation
    if (rid, inc) in m.replaced:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "incarnation")
    rep = m.reps.get(rid)
    if rep is not None and rep.inc == inc and rep.model == req.model_id:
        rep.address, rep.capacity = req.address, req.capacity_blocks
    else:
        if rep is not None:  # a restarted replica keeps its name, not its memory
            rep.holds = set()
            m.forget_hits()
        floor = m.seq_floor.pop(rid, None)
        back = rep is None and floor is not None and floor[0] == inc
        lapsed = m.lapsed.pop(rid, None)
        old = rep.inc if rep is not None else floor[0] if floor else None
        if old is not None and old != inc:
            m.replaced.add((rid, old))
        rep = m.reps[rid] = Rep(inc, req.model_id, req.address, req.capacity_blocks, m.now,
                                m.now, next_seq=floor[1] if back else 1, awaiting=back)
        if back and lapsed and lapsed[0] == inc and m.now <= lapsed[2]:
            rep.pending, rep.pending_until = dict(lapsed[1]), m.now + LEASE
    m.renew(rep)
    m.lists.pop(rid, None)
    if req.shard_list.fingerprint:
        m.lists[rid] = (req.shard_list.shards, req.shard_list.fingerprint[:64])
    return pb.RegisterResponse(lease_seconds=LEASE, next_seq=rep.next_seq,
                               max_events=MAX_EVENTS, max_blocks=MAX_BLOCKS)


def do_register(svc: Svc, m: Model, rng: random.Random) -> None:
    rid = rng.choice(list(IDS))
    rep = m.reps.get(rid)
    inc = rep.inc if rep is not None and rng.random() < 0.6 else rng.choice(INCS)
    if rep is None and rid in m.seq_floor and rng.random() < 0.7:
        inc = m.seq_floor[rid][0]  # back after its lease lapsed (a late heartbeat)
    model = IDS[rid] if rng.random() < 0.9 else rng.choice(MODELS)
    req = pb.RegisterRequest(
        replica_id=rid, incarnation=inc, address=rng.choice(ADDRESSES), model_id=model,
        block_size=BS, capacity_blocks=rng.choice([0, 500, 1000]),
        hash_probe=BlockHasher(model, BS).probe() if rng.random() < 0.5 else b"",
        shard_list=common_pb2.ShardList(shards=rng.choice([1, 2, 3]),
                                        fingerprint=rng.choice(FINGERPRINTS)))
    try:
        want = expected_register(m, req)
    except Refused as r:
        expect_refused(m, "Register", call(svc, "Register", req), r.code, r.fld, req)
        return
    got = ok(m, "Register", call(svc, "Register", req), req)
    assert got == want, (got, want)


# ---- Heartbeat ---------------------------------------------------------------------------------


def do_heartbeat(svc: Svc, m: Model, rng: random.Random) -> None:
    rid = rng.choice(list(IDS))
    rep = m.reps.get(rid)
    inc = rep.inc if rep is not None and rng.random() < 0.85 else rng.choice(INCS)
    load = tuple(rng.choice([0, 1, 2, 5, 2**32 - 1]) if i > 1 else rng.randrange(4)
                 for i in range(4))
    req = pb.HeartbeatRequest(replica_id=rid, incarnation=inc, load=pb.ReplicaLoad(
        running=load[0], waiting=load[1], free_blocks=load[2], total_blocks=load[3]))
    if load[2] > load[3]:  # more free blocks than blocks: refused, nothing renewed
        expect_refused(m, "Heartbeat", call(svc, "Heartbeat", req), INVALID,
                       "load.free_blocks", req)
        return
    got = ok(m, "Heartbeat", call(svc, "Heartbeat", req), req)
    known = rep is not None and rep.inc == inc
    if known:
        rep.load = load  # type: ignore[assignment]
        m.renew(rep)
    assert (got.known, got.lease_seconds) == (known, LEASE)


# ---- PublishEvents -----------------------------------------------------------------------------


def stored_pb(m: Model, model: str, salt: str, path: tuple[int, ...], start: int, end: int,
              first: bool = True) -> pb.KvEvent:
    hs = m.u.chain(model, salt, path)
    return pb.KvEvent(stored=pb.BlocksStored(
        parent_hash=hs[start - 1] if start else b"", block_hashes=hs[start:end],
        token_ids=toks(path)[start * BS : end * BS], cache_salt=salt,
        first_block_hash=hs[0] if first else b"", start_block=start))


def random_path(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(3) for _ in range(rng.randint(1, 5)))


def random_event(m: Model, rng: random.Random, model: str, rep: Rep | None) -> pb.KvEvent:
    x = rng.random()
    if x < 0.7 or not m.u.info:
        salt, path = rng.choice(SALTS), random_path(rng)
        start = rng.randrange(len(path)) if rng.random() < 0.5 else 0
        return stored_pb(m, model, salt, path, start, rng.randint(start + 1, len(path)),
                         first=rng.random() < 0.8)
    if x < 0.95:
        pool = sorted(rep.holds) if rep is not None and rep.holds and rng.random() < 0.7 \
            else sorted(m.u.info)
        return pb.KvEvent(removed=pb.BlocksRemoved(
            block_hashes=rng.sample(pool, min(len(pool), rng.randint(1, 2)))))
    return pb.KvEvent(cleared=pb.AllCleared())


def apply_batch(m: Model, rid: str, events: list[pb.KvEvent], resync: bool) -> None:
    """A validated batch applied: chains wait within the batch for a parent the replica does
    not hold yet, else are dropped (counted); removals take subtrees and reach waiting chains;
    a resync first drops the holdings, saving hits, and gives them back to what it stores."""
    rep = m.reps[rid]
    usage = None
    if resync:
        usage = m.clear_saving(rid)
        rep.awaiting = False
        rep.pending, rep.pending_until = None, m.now + LEASE
    waiting: dict[bytes, list[list[bytes]]] = {}

    def store(parent: bytes | None, hashes: list[bytes]) -> None:
        todo = [(parent, hashes)]
        while todo:
            par, hs = todo.pop()
            if par is not None and par not in rep.holds:
                waiting.setdefault(par, []).append(hs)
                continue
            rep.holds.update(hs)
            for h in hs:
                todo.extend((h, w) for w in waiting.pop(h, ()))

    def drop_all() -> None:
        m.dropped += sum(len(c) for cs in waiting.values() for c in cs)
        waiting.clear()

    stored_keys: list[bytes] = []
    for ev in events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            s = ev.stored
            hs = list(s.block_hashes)
            stored_keys += hs
            store(bytes(s.parent_hash) or None, hs)
        elif kind == "removed":
            gone = [bytes(h) for h in ev.removed.block_hashes]
            for h in gone:
                if h in rep.holds:
                    rep.holds -= {k for k in rep.holds if m.u.below(h, k)}
            gone_set = set(gone)
            for key in list(waiting):
                kept = []
                for c in waiting[key]:
                    cut = next((i for i, h in enumerate(c) if h in gone_set), len(c))
                    if cut < len(c):
                        m.dropped += len(c) - cut
                        gone_set.update(c[cut:])
                    if cut:
                        kept.append(c[:cut])
                if kept:
                    waiting[key] = kept
                else:
                    del waiting[key]
            stack = [h for h in gone_set if h in waiting]
            while stack:
                for c in waiting.pop(stack.pop(), ()):
                    m.dropped += len(c)
                    stack.extend(h for h in c if h in waiting)
            m.forget_hits()
        else:
            rep.holds = set()
            m.forget_hits()
            drop_all()
    drop_all()
    m.forget_hits()
    if usage is not None:
        rep.pending = m.restore(usage) or None
    elif rep.pending is not None:
        if m.now > rep.pending_until:
            rep.pending = None
        else:
            mine = {h: rep.pending.pop(h) for h in stored_keys if h in rep.pending}
            rep.pending.update(m.restore(mine))
            rep.pending = rep.pending or None
    for ev in events:
        m.bump("tiercache_prefix_events_total", (("kind", ev.WhichOneof("event")),))


def validate_events(m: Model, rep: Rep, events: list[pb.KvEvent], verify: bool) -> None:
    blocks = 0
    for i, ev in enumerate(events):
        kind = ev.WhichOneof("event")
        if kind == "stored":
            s = ev.stored
            f = f"events[{i}].stored"
            hs = list(s.block_hashes)
            if not hs:
                raise Refused(INVALID, f"{f}.block_hashes")
            for j, h in enumerate(hs):
                if len(h) != 16:
                    raise Refused(INVALID, f"{f}.block_hashes[{j}]")
            if len(s.token_ids) != BS * len(hs):
                raise Refused(INVALID, f"{f}.token_ids")
            if len(set(hs)) != len(hs):
                raise Refused(INVALID, f"{f}.block_hashes")
            roots = {m.u.hashers[mo].root(sa) for mo in MODELS for sa in SALTS}
            if set(hs) & roots:
                raise Refused(INVALID, f"{f}.block_hashes")
            if s.parent_hash:
                if len(s.parent_hash) != 16 or s.parent_hash in roots:
                    raise Refused(INVALID, f"{f}.parent_hash")
            else:
                if s.start_block:
                    raise Refused(INVALID, f"{f}.start_block")
                if s.first_block_hash and s.first_block_hash != hs[0]:
                    raise Refused(INVALID, f"{f}.first_block_hash")
                if len(s.cache_salt) > 256 or "\0" in s.cache_salt:
                    raise Refused(INVALID, f"{f}.cache_salt")
            if verify and BlockHasher(rep.model, BS).hashes(
                    list(s.token_ids), s.cache_salt, parent=bytes(s.parent_hash) or None) != hs:
                raise Refused(INVALID, f"{f}.block_hashes")
            blocks += len(hs)
        elif kind == "removed":
            for j, h in enumerate(ev.removed.block_hashes):
                if len(h) != 16:
                    raise Refused(INVALID, f"events[{i}].removed.block_hashes[{j}]")
            blocks += len(ev.removed.block_hashes)
        if blocks > MAX_BLOCKS:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "events")


def expected_publish(m: Model, req: pb.PublishEventsRequest, verify: bool
                     ) -> pb.PublishEventsResponse:
    events = list(req.events)
    for i, e in enumerate(events):
        if e.WhichOneof("event") is None:
            raise Refused(INVALID, f"events[{i}]")
    if not req.replica_id:
        raise Refused(INVALID, "replica_id")
    rep = m.reps.get(req.replica_id)
    if rep is None:
        raise Refused(grpc.StatusCode.NOT_FOUND, "replica_id")
    if rep.inc != req.incarnation:
        raise Refused(grpc.StatusCode.NOT_FOUND, "incarnation")
    if not 1 <= req.seq <= 2**64 - 2:
        raise Refused(INVALID, "seq")
    if len(events) > MAX_EVENTS:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "events")
    if req.seq < rep.next_seq:  # a retry, or an overtaken resync: acknowledged, ignored
        m.renew(rep)
        return pb.PublishEventsResponse(status=pb.PUBLISH_STATUS_OK, next_seq=rep.next_seq)
    if not req.resync and (req.seq > rep.next_seq or rep.awaiting):
        m.renew(rep)
        m.resyncs += 1
        m.bump("tiercache_prefix_resyncs_total")
        return pb.PublishEventsResponse(status=pb.PUBLISH_STATUS_RESYNC, next_seq=rep.next_seq)
    validate_events(m, rep, events, verify)
    m.renew(rep)
    apply_batch(m, req.replica_id, events, req.resync)
    rep.next_seq = req.seq + 1
    return pb.PublishEventsResponse(status=pb.PUBLISH_STATUS_OK, next_seq=rep.next_seq)


def do_publish(svc: Svc, m: Model, rng: random.Random, verify: bool) -> None:
    live = sorted(m.reps)
    rid = rng.choice(live) if live and rng.random() < 0.9 else rng.choice(list(IDS))
    rep = m.reps.get(rid)
    inc = rep.inc if rep is not None and rng.random() < 0.93 else rng.choice(INCS)
    model = rep.model if rep is not None else IDS[rid]
    nxt = rep.next_seq if rep is not None else 1
    x = rng.random()
    seq = nxt if x < 0.8 else max(1, nxt - rng.randint(1, 2)) if x < 0.9 else nxt + 1
    resync = rng.random() < (0.6 if rep is not None and rep.awaiting else 0.12)
    if resync and rep is not None and rng.random() < 0.7:
        # The replica's holdings as they are (a snapshot), give or take a chain.
        chains = {m.u.info[k][:2] + (m.u.info[k][2],) for k in rep.holds}
        leaves = [c for c in chains if not any(o != c and o[:2] == c[:2] and
                                               o[2][: len(c[2])] == c[2] for o in chains)]
        rng.shuffle(leaves)
        events, blocks = [], 0
        for mo, sa, p in leaves[:MAX_EVENTS]:
            if blocks + len(p) <= MAX_BLOCKS:
                events.append(stored_pb(m, mo, sa, p, 0, len(p)))
                blocks += len(p)  # a snapshot's order does not matter (chains wait)
        if not events:
            events = [pb.KvEvent(cleared=pb.AllCleared())]
    else:
        events = [random_event(m, rng, model, rep) for _ in range(rng.choice([1, 1, 2, 3]))]
    req = pb.PublishEventsRequest(replica_id=rid, incarnation=inc, seq=seq, events=events,
                                  resync=resync)
    try:
        want = expected_publish(m, req, verify)
    except Refused as r:
        expect_refused(m, "PublishEvents", call(svc, "PublishEvents", req), r.code, r.fld, req)
        return
    got = ok(m, "PublishEvents", call(svc, "PublishEvents", req), req)
    assert got == want, (got, want, req)


# ---- Match -------------------------------------------------------------------------------------


def expected_match(m: Model, req: pb.MatchRequest) -> pb.MatchResponse:
    if not req.model_id or len(req.model_id) > 256:
        raise Refused(INVALID, "model_id")
    if req.token_ids and req.block_hashes:
        raise Refused(INVALID, "token_ids")
    if req.block_hashes:
        if len(req.block_hashes) > MAX_BLOCKS:
            raise Refused(INVALID, "block_hashes")
        for i, h in enumerate(req.block_hashes):
            if len(h) != 16:
                raise Refused(INVALID, f"block_hashes[{i}]")
        hashes = [bytes(h) for h in req.block_hashes]
    elif req.token_ids:
        if len(req.token_ids) // BS > MAX_BLOCKS:  # full blocks, as the proto says
            raise Refused(INVALID, "token_ids")
        if len(req.cache_salt) > 256 or "\0" in req.cache_salt:
            raise Refused(INVALID, "cache_salt")
        hashes = (BlockHasher(req.model_id, BS).hashes(list(req.token_ids), req.cache_salt)
                  if req.model_id in MODELS else [None] * (len(req.token_ids) // BS))
    else:
        raise Refused(INVALID, "token_ids")
    # The leading run of `hashes` that is one chain of this model from its root.
    run = 0
    for i, h in enumerate(hashes):
        info = m.u.info.get(h) if h is not None else None
        if info is None or info[0] != req.model_id or len(info[2]) != i + 1 or \
                (i and m.u.chain(*info[:2], info[2][:-1])[-1] != hashes[i - 1]):
            break
        run += 1
    reps = m.by_load(req.model_id)
    lens = []
    for _, rep in reps:
        n = 0
        while n < run and hashes[n] in rep.holds:
            n += 1
        lens.append(n)
    order = sorted(range(len(reps)), key=lambda i: -lens[i])  # stable: load order in ties
    best = max(lens, default=0)
    if not req.probe:
        m.matches += 1
        m.blocks += len(hashes)
        if best:
            m.matches_hit += 1
            m.blocks_hit += best
            m.hits[hashes[best - 1]] = m.hits.get(hashes[best - 1], 0) + 1
        m.bump("tiercache_prefix_matches_total", (("result", "hit" if best else "miss"),))
        m.bump("tiercache_prefix_match_blocks_total", (("result", "asked"),), len(hashes))
        m.bump("tiercache_prefix_match_blocks_total", (("result", "hit"),), best)
    m.check_lists(req.shard_list.shards, req.shard_list.fingerprint, [r for r, _ in reps])
    return pb.MatchResponse(matches=[pb.ReplicaMatch(
        replica_id=reps[i][0], address=reps[i][1].address, matched_blocks=lens[i],
        matched_tokens=lens[i] * BS, load=pb.ReplicaLoad(
            running=reps[i][1].load[0], waiting=reps[i][1].load[1],
            free_blocks=reps[i][1].load[2], total_blocks=reps[i][1].load[3]))
        for i in order], request_blocks=len(hashes), block_size=BS)


def do_match(svc: Svc, m: Model, rng: random.Random) -> None:
    model = rng.choice(MODELS + ("m1", "m3"))
    salt = rng.choice(SALTS)
    held = sorted(m.nodes())
    pool = held if held and rng.random() < 0.6 else sorted(m.u.info)
    if pool and rng.random() < 0.8:
        hmodel, hsalt, path = m.u.info[rng.choice(pool)]
        if rng.random() < 0.7:
            model, salt = hmodel, hsalt
        path = path + tuple(rng.randrange(3) for _ in range(rng.randrange(3)))
    else:
        path = random_path(rng)
    tokens = toks(path) + [7] * rng.choice([0, 0, 1])
    kw = {}
    if rng.random() < 0.5:
        kw["token_ids"] = tokens
    else:
        hs = m.u.chain(model if model in MODELS else "m1", salt, path)
        hs = hs[: rng.randint(0, len(hs))] if rng.random() < 0.3 else hs
        kw["block_hashes"] = hs + [bytes(rng.randrange(256) for _ in range(16))
                                   for _ in range(rng.choice([0, 0, 1]))] or [b"\x01" * 16]
    req = pb.MatchRequest(model_id=model, cache_salt=salt, probe=rng.random() < 0.2,
                          shard_list=common_pb2.ShardList(
                              shards=rng.choice([1, 2, 3]),
                              fingerprint=rng.choice(FINGERPRINTS + ("", ""))), **kw)
    try:
        want = expected_match(m, req)
    except Refused as r:  # a chain past MAX_BLOCKS
        expect_refused(m, "Match", call(svc, "Match", req), r.code, r.fld, req)
        return
    got = ok(m, "Match", call(svc, "Match", req), req)
    assert got == want, (got, want, req)


# ---- TopPrefixes -------------------------------------------------------------------------------


def expected_top(m: Model, model: str, min_hits: int, salt: str | None) -> list:
    """Every prefix TopPrefixes may answer with, as answered, hottest first (ties: any
    order): a held block with at least max(1, min_hits) hits under the filters."""
    out = []
    for key, h in m.hits.items():
        mo, sa, path = m.u.info[key]
        if h < max(1, min_hits) or (model and mo != model) or (salt is not None and sa != salt):
            continue
        holders = sorted(r for r, rep in m.reps.items() if key in rep.holds)
        out.append(pb.HotPrefix(token_ids=toks(path), hits=h, holders=holders, cache_salt=sa,
                                model_id=mo, last_block_hash=key))
    out.sort(key=lambda p: -p.hits)
    return out


def do_top(svc: Svc, m: Model, rng: random.Random) -> None:
    k = rng.choice([1, 2, 3, 1000])
    model = rng.choice(("", "m1", "m2"))
    min_hits = rng.choice([0, 0, 1, 2, 3])
    kw = {"cache_salt": rng.choice(SALTS)} if rng.random() < 0.4 else {}
    req = pb.TopPrefixesRequest(k=k, model_id=model, min_hits=min_hits, **kw)
    got = ok(m, "TopPrefixes", call(svc, "TopPrefixes", req), req).prefixes
    cands = expected_top(m, model, min_hits, kw.get("cache_salt"))
    assert len(got) == min(k, len(cands)), (got, cands)
    hits = [p.hits for p in got]
    assert hits == [p.hits for p in cands[: len(got)]], (hits, cands)
    if got:
        cut = got[-1].hits
        above = sorted(p.SerializeToString() for p in cands if p.hits > cut)
        assert sorted(p.SerializeToString() for p in got if p.hits > cut) == above
        at = {p.SerializeToString() for p in cands if p.hits == cut}
        assert all(p.SerializeToString() in at for p in got if p.hits == cut), (got, cands)


# ---- refusals ----------------------------------------------------------------------------------


def refusals(m: Model, verify: bool) -> list:
    """Every kind of call the contract refuses, once: (method, request, code, field). A
    PublishEvents given as events (or a word for what is wrong) is sent by a live replica of
    m1 at its expected batch number (`do_refused`)."""
    hs = m.u.chain("m1", "", (0, 1))
    root = m.u.hashers["m1"].root("")

    def reg(**kw) -> pb.RegisterRequest:
        base = dict(replica_id="r0", incarnation="a", address="127.0.0.1:7000", model_id="m1",
                    block_size=BS)
        return pb.RegisterRequest(**{**base, **kw})

    def match(**kw) -> pb.MatchRequest:
        return pb.MatchRequest(**{"model_id": "m1", "token_ids": toks((0, 1)), **kw})

    def st(**kw) -> pb.KvEvent:
        base = dict(block_hashes=hs, token_ids=toks((0, 1)), first_block_hash=hs[0])
        return pb.KvEvent(stored=pb.BlocksStored(**{**base, **kw}))

    out = [
        ("Register", reg(replica_id=""), INVALID, "replica_id"),
        ("Register", reg(replica_id="r" * 257), INVALID, "replica_id"),
        ("Register", reg(replica_id="r 0"), INVALID, "replica_id"),
        ("Register", reg(replica_id="r\u200b0"), INVALID, "replica_id"),
        ("Register", reg(replica_id="\u3164"), INVALID, "replica_id"),
        ("Register", reg(model_id="\u200b"), INVALID, "model_id"),
        ("Register", reg(incarnation=""), INVALID, "incarnation"),
        ("Register", reg(incarnation="i\0"), INVALID, "incarnation"),
        ("Register", reg(incarnation="i" * 257), INVALID, "incarnation"),
        ("Register", reg(address=""), INVALID, "address"),
        ("Register", reg(address="kvpool-0"), INVALID, "address"),
        ("Register", reg(address="kvpool-0:0"), INVALID, "address"),
        ("Register", reg(address="http://k:1"), INVALID, "address"),
        ("Register", reg(address="a" * 251 + ":50054"), INVALID, "address"),
        ("Register", reg(model_id=""), INVALID, "model_id"),
        ("Register", reg(model_id="m" * 257), INVALID, "model_id"),
        ("Register", reg(model_id="m\0"), INVALID, "model_id"),
        ("Register", reg(block_size=0), INVALID, "block_size"),
        ("Register", reg(block_size=BS * 2), grpc.StatusCode.FAILED_PRECONDITION, "block_size"),
        ("Register", reg(hash_probe=b"\x01" * 15), INVALID, "hash_probe"),
        ("Register", reg(hash_probe=BlockHasher("m2", BS).probe()),
         grpc.StatusCode.FAILED_PRECONDITION, "hash_probe"),
        ("Heartbeat", pb.HeartbeatRequest(incarnation="a"), INVALID, "replica_id"),
        ("Match", match(model_id=""), INVALID, "model_id"),
        ("Match", match(model_id="m" * 257), INVALID, "model_id"),
        ("Match", match(token_ids=[]), INVALID, "token_ids"),
        ("Match", match(block_hashes=hs), INVALID, "token_ids"),
        ("Match", match(token_ids=[1] * (MAX_BLOCKS * BS + BS)), INVALID, "token_ids"),
        ("Match", match(token_ids=[], block_hashes=[hs[0]] * (MAX_BLOCKS + 1)), INVALID,
         "block_hashes"),
        ("Match", match(token_ids=[], block_hashes=[hs[0], b"\x01" * 17]), INVALID,
         "block_hashes[1]"),
        ("Match", match(cache_salt="s" * 257), INVALID, "cache_salt"),
        ("Match", match(cache_salt="s\0"), INVALID, "cache_salt"),
        ("TopPrefixes", pb.TopPrefixesRequest(k=0), INVALID, "k"),
        ("TopPrefixes", pb.TopPrefixesRequest(k=1001), INVALID, "k"),
        # Publish: the replica's own (live) id and incarnation, filled in when sent.
        ("PublishEvents", (pb.KvEvent(),), INVALID, "events[0]"),
        ("PublishEvents", (st(), pb.KvEvent()), INVALID, "events[1]"),
        ("PublishEvents", "no replica", INVALID, "replica_id"),
        ("PublishEvents", "unknown replica", grpc.StatusCode.NOT_FOUND, "replica_id"),
        ("PublishEvents", "stale incarnation", grpc.StatusCode.NOT_FOUND, "incarnation"),
        ("PublishEvents", "seq 0", INVALID, "seq"),
        ("PublishEvents", "seq 2^64-1", INVALID, "seq"),
        ("PublishEvents", (st(),) * (MAX_EVENTS + 1), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "events"),
        ("PublishEvents", (st(), pb.KvEvent(removed=pb.BlocksRemoved(
            block_hashes=[hs[0]] * (MAX_BLOCKS - 1)))), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "events"),
        ("PublishEvents", (st(block_hashes=[], token_ids=[]),), INVALID,
         "events[0].stored.block_hashes"),
        ("PublishEvents", (st(), st(block_hashes=[hs[0], b"\x02" * 15])), INVALID,
         "events[1].stored.block_hashes[1]"),
        ("PublishEvents", (st(token_ids=toks((0,))),), INVALID, "events[0].stored.token_ids"),
        ("PublishEvents", (st(block_hashes=[hs[0], hs[0]]),), INVALID,
         "events[0].stored.block_hashes"),
        ("PublishEvents", (st(block_hashes=[root, hs[1]], first_block_hash=b""),), INVALID,
         "events[0].stored.block_hashes"),
        ("PublishEvents", (st(parent_hash=b"\x03" * 8, block_hashes=hs[1:],
                              token_ids=toks((1,))),), INVALID, "events[0].stored.parent_hash"),
        ("PublishEvents", (st(parent_hash=root),), INVALID, "events[0].stored.parent_hash"),
        ("PublishEvents", (st(start_block=1),), INVALID, "events[0].stored.start_block"),
        ("PublishEvents", (st(first_block_hash=hs[1]),), INVALID,
         "events[0].stored.first_block_hash"),
        ("PublishEvents", (st(cache_salt="s" * 257),), INVALID, "events[0].stored.cache_salt"),
        ("PublishEvents", (st(cache_salt="s\0"),), INVALID, "events[0].stored.cache_salt"),
        ("PublishEvents", (st(), pb.KvEvent(removed=pb.BlocksRemoved(
            block_hashes=[b"\x04" * 16, b"\x04"]))), INVALID,
         "events[1].removed.block_hashes[1]"),
    ]
    if verify:
        out.append(("PublishEvents", (st(token_ids=toks((0, 2))),), INVALID,
                    "events[0].stored.block_hashes"))
    # Bad UTF-8 in every string field the RPCs take.
    for method, msg, fld in [
        ("Register", reg(replica_id="PLACEHOLDER"), "replica_id"),
        ("Register", reg(incarnation="PLACEHOLDER"), "incarnation"),
        ("Register", reg(address="PLACEHOLDER:1"), "address"),
        ("Register", reg(model_id="PLACEHOLDER"), "model_id"),
        ("Register", reg(shard_list=common_pb2.ShardList(shards=2, fingerprint="PLACEHOLDER")),
         "shard_list.fingerprint"),
        ("Heartbeat", pb.HeartbeatRequest(replica_id="PLACEHOLDER"), "replica_id"),
        ("Heartbeat", pb.HeartbeatRequest(replica_id="r0", incarnation="PLACEHOLDER"),
         "incarnation"),
        ("PublishEvents", pb.PublishEventsRequest(replica_id="PLACEHOLDER", seq=1),
         "replica_id"),
        ("PublishEvents", pb.PublishEventsRequest(replica_id="r0", incarnation="PLACEHOLDER",
                                                  seq=1), "incarnation"),
        ("PublishEvents", pb.PublishEventsRequest(replica_id="r0", incarnation="a", seq=1,
                                                  events=[st(), st(cache_salt="PLACEHOLDER")]),
         "events[1].stored.cache_salt"),
        ("Match", match(model_id="PLACEHOLDER"), "model_id"),
        ("Match", match(cache_salt="PLACEHOLDER"), "cache_salt"),
        ("Match", match(shard_list=common_pb2.ShardList(shards=2, fingerprint="PLACEHOLDER")),
         "shard_list.fingerprint"),
        ("TopPrefixes", pb.TopPrefixesRequest(k=1, model_id="PLACEHOLDER"), "model_id"),
        ("TopPrefixes", pb.TopPrefixesRequest(k=1, cache_salt="PLACEHOLDER"), "cache_salt"),
    ]:
        out.append((method, bad_utf8(msg, "PLACEHOLDER"), INVALID, fld))
    return out


def do_refused(svc: Svc, m: Model, case, rng: random.Random) -> None:
    method, req, code, fld = case
    if method == "PublishEvents" and not isinstance(req, bytes):
        # A live replica of m1 (the events' chains are m1's), registered first if none is.
        live = sorted(r for r, rep in m.reps.items() if rep.model == "m1")
        if not live:
            do_register_live(svc, m)
            live = sorted(r for r, rep in m.reps.items() if rep.model == "m1")
        rid = rng.choice(live)
        rep = m.reps[rid]
        inc, seq, events, resync = rep.inc, rep.next_seq, (), False
        if req == "no replica":
            rid = ""
        elif req == "unknown replica":
            rid = "nobody"
        elif req == "stale incarnation":
            inc = next(i for i in INCS if i != inc)
        elif req == "seq 0":
            seq = 0
        elif req == "seq 2^64-1":
            seq = 2**64 - 1
        else:
            # Past the gap and resync rules, to the events' own checks.
            events, resync = req, rep.awaiting or rng.random() < 0.3
        req = pb.PublishEventsRequest(replica_id=rid, incarnation=inc, seq=seq,
                                      events=list(events), resync=resync)
    expect_refused(m, method, call(svc, method, req), code, fld, req)
    if method == "PublishEvents":
        # Nothing of a refused batch shows in a Match either (Stats are compared after).
        hs = m.u.chain("m1", "", (0, 1))
        probe = pb.MatchRequest(model_id="m1", block_hashes=hs, probe=True)
        assert ok(m, "Match", call(svc, "Match", probe), probe) == expected_match(m, probe)


def do_register_live(svc: Svc, m: Model) -> None:
    rid, inc = next((r, i) for r in IDS for i in INCS if IDS[r] == "m1" and r not in m.reps
                    and (r, i) not in m.replaced)
    req = pb.RegisterRequest(replica_id=rid, incarnation=inc, address=ADDRESSES[0],
                             model_id="m1", block_size=BS)
    want = expected_register(m, req)
    assert ok(m, "Register", call(svc, "Register", req), req) == want


def do_boundary(svc: Svc, m: Model, rng: random.Random) -> None:
    """Accepted at the limits: MAX_EVENTS events and MAX_BLOCKS blocks in a batch, a Match of
    MAX_BLOCKS hashes or MAX_BLOCKS*BS tokens, k of 1000, a 256-character model id."""
    live = sorted(m.reps)
    x = rng.random()
    if x < 0.4 and live:
        rid = rng.choice(live)
        rep = m.reps[rid]
        path = tuple(rng.randrange(3) for _ in range(MAX_BLOCKS))
        events = [stored_pb(m, rep.model, "", path, 0, MAX_BLOCKS - MAX_EVENTS + 1)]
        events += [stored_pb(m, rep.model, "", path, i, i + 1)
                   for i in range(MAX_BLOCKS - MAX_EVENTS + 1, MAX_BLOCKS)]
        assert len(events) == MAX_EVENTS
        req = pb.PublishEventsRequest(replica_id=rid, incarnation=rep.inc, seq=rep.next_seq,
                                      events=events, resync=rep.awaiting)
        try:
            want = expected_publish(m, req, m.verify)
        except Refused as r:  # pragma: no cover - the model's own mistake
            raise AssertionError(r) from None
        assert ok(m, "PublishEvents", call(svc, "PublishEvents", req), req) == want
    elif x < 0.7:
        path = tuple(rng.randrange(3) for _ in range(MAX_BLOCKS))
        kw = ({"token_ids": toks(path)} if rng.random() < 0.5
              else {"block_hashes": m.u.chain("m1", "", path)})
        req = pb.MatchRequest(model_id="m1", **kw)
        assert ok(m, "Match", call(svc, "Match", req), req) == expected_match(m, req)
    else:
        req = pb.MatchRequest(model_id="m" * 256, token_ids=[1] * BS)
        assert ok(m, "Match", call(svc, "Match", req), req) == expected_match(m, req)


# ---- the comparison ----------------------------------------------------------------------------


def check_stats(svc: Svc, m: Model, before: dict) -> None:
    st = ok(m, "Stats", call(svc, "Stats", pb.PrefixStatsRequest()), "Stats")
    nodes = m.nodes()
    assert st.nodes == len(nodes), (st.nodes, len(nodes))
    assert st.bytes % BYTES_PER_NODE == 0 and st.bytes >= BYTES_PER_NODE * (
        st.nodes + st.unheld_nodes)
    want = [pb.ReplicaInfo(
        replica_id=rid, incarnation=r.inc, address=r.address, model_id=r.model,
        held_blocks=len(r.holds), load=pb.ReplicaLoad(
            running=r.load[0], waiting=r.load[1], free_blocks=r.load[2],
            total_blocks=r.load[3]),
        last_seen_s=m.now - r.last_seen, capacity_blocks=r.capacity)
        for rid, r in sorted(m.reps.items())]
    assert list(st.replicas) == want, (st.replicas, want)
    assert (st.matches_total, st.matches_hit, st.match_blocks_total, st.match_blocks_hit) == (
        m.matches, m.matches_hit, m.blocks, m.blocks_hit)
    assert (st.pruned_total, st.resyncs_total, st.block_size, st.dropped_blocks_total) == (
        0, m.resyncs, BS, m.dropped)
    assert (st.max_nodes, st.shards_total, st.shards_answered) == (MAX_NODES, 0, 0)
    assert st.shard_list_mismatches_total == m.mismatches
    if m.mismatch_at is not None and m.now - m.mismatch_at <= 300:
        assert st.shard_list_mismatch.startswith(
            "shard list differs between replicas and orchestrator: replica "), \
            st.shard_list_mismatch
        said = "Match" if m.mismatches == 1 else "Matches"
        assert st.shard_list_mismatch.endswith(f"({m.mismatches} such {said} in all)")
    else:
        assert st.shard_list_mismatch == ""
    # The Stats call itself is counted before it returns: read the metrics after it.
    now = _metric_values()
    assert now[("tiercache_prefix_nodes", ())] == len(nodes)
    assert now[("tiercache_prefix_replicas", ())] == len(m.reps)
    # The sweeper may have reaped some since the answer (never added any: the clock stood).
    assert now[("tiercache_prefix_unheld_nodes", ())] <= st.unheld_nodes
    # Stats' dropped_blocks_total as a counter (docs/metrics.md).
    m.metrics[("tiercache_prefix_dropped_blocks_total", ())] = m.dropped
    for key in set(now) | set(m.metrics):
        name = key[0]
        if name in ("tiercache_prefix_nodes", "tiercache_prefix_replicas",
                    "tiercache_prefix_unheld_nodes") or name.startswith("tiercache_rpc_seconds"):
            continue
        assert now.get(key, 0) - before.get(key, 0) == m.metrics.get(key, 0), key


def run_seed(seed: int) -> None:
    rng = random.Random(seed)
    verify = rng.random() < 0.5
    cfg = PrefixConfig(address="127.0.0.1:0", block_size=BS, lease_seconds=LEASE,
                       max_nodes=MAX_NODES, max_events=MAX_EVENTS, max_blocks=MAX_BLOCKS,
                       hit_half_life_seconds=0, verify_hashes=verify, metrics_port=-1)
    cfg.validate()
    clock = Clock(1000.0)
    index = build_index(cfg)
    # Time is the test's: leases lapse where the sequence says (at any call, or in the
    # sweeper's turn at the same instant: the clock stands between steps).
    index.clock = clock
    before = _metric_values()
    svc = serve(cfg, index)
    m = Model(Universe(), clock.t, verify=verify)
    try:
        with grpc.insecure_channel(svc.address) as ch:
            s = Svc(pbg.PrefixIndexStub(ch), ch)
            cases = refusals(m, verify)
            ops = ["refused"] * len(cases) + rng.choices(
                ["register", "heartbeat", "publish", "match", "top", "time", "boundary"],
                [2, 2, 6, 4, 2.5, 3, 0.3], k=STEPS)
            rng.shuffle(ops)
            rng.shuffle(cases)
            for op in ops:
                if op == "time":
                    # Under half a lease a step: a longer silence of every call reads as a
                    # pause of the process (`_forgive_pause`), which is the index's own.
                    clock.t += rng.choice([0.125, 0.25, 0.375])
                    m.now = clock.t
                    m.lapse()
                elif op == "register":
                    do_register(s, m, rng)
                elif op == "heartbeat":
                    do_heartbeat(s, m, rng)
                elif op == "publish":
                    do_publish(s, m, rng, verify)
                elif op == "match":
                    do_match(s, m, rng)
                elif op == "top":
                    do_top(s, m, rng)
                elif op == "boundary":
                    do_boundary(s, m, rng)
                else:
                    do_refused(s, m, cases.pop(), rng)
                check_stats(s, m, before)
            # What lapses and resyncs left unheld, the sweeper deletes (in short steps, on its
            # own thread: no call of the test's does): every figure comes down to the model's.
            deadline = time.monotonic() + 10
            while (st := s.stub.Stats(pb.PrefixStatsRequest(), timeout=30)).unheld_nodes:
                assert time.monotonic() < deadline, st.unheld_nodes
                time.sleep(0.01)
            assert st.nodes == len(m.nodes())
            assert _metric_values()[("tiercache_prefix_unheld_nodes", ())] == 0
            index.check_integrity()
    finally:
        svc.stop(0)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_server_matches_the_model(seed):
    run_seed(seed)
