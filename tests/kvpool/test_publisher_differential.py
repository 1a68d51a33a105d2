"""A differential review of the publisher (kvpool -> prefix index): seeded random runs of real
block pools, real publishers and real prefix indexes, checked against the pools themselves.

The model is each replica's own pool, read brute force: the set of block hashes it holds
(every hashed block). The documented promise (publisher.py, index.py, docs/architecture.md):
once a publisher has flushed (registered, no resync due, nothing unsent, no shard lagging)
and the index is reachable, the index's view of that replica is exactly the pool's. So, at
every such quiescent point:
  * the blocks each index shard says the replica holds are exactly the pool's blocks whose
    chain starts on that shard (the ring on the first block's hash; one shard: all of them),
  * Match of many prompts (every prompt of the run, longer ones, the live sequences' tokens),
    asked of the owning shard and through the orchestrator's `PrefixIndexClient`, gives that
    replica exactly the number of leading prompt blocks the pool holds (no phantom block, no
    lost one; the index's node budget is never reached here, so pruning loses nothing),
  * both sides pass their own `check_integrity`,
and after `Publisher.stop` the index names none of the replica's blocks.

Driven: one or two replicas (each a tiny pool of 5-14 blocks of 4 tokens, so eviction is
constant) on one index or two shards; random opens (shared prefixes, two salts), partial and
full commits, generation past the prompt, truncation, closes, pins with a TTL on a fake clock,
pin releases, forced evictions, clears, bursts of changes past the backlog limit, events left
in the pool across a snapshot, and replica crashes (a new incarnation, an empty pool, the old
publisher gone without withdrawing); publisher turns interleaved at random with all that
(mid-resync included, half of them without the first heartbeat, so a lapse or a restart is
also first heard of from a batch); and on the index side: small batch limits (snapshots span
batches, events are split), a short lease, shards down for a while (or until the next check),
shards restarted empty, every lease lapsed (the fake clock run past it), sweeps and reaps, and
a transport that loses requests, loses answers after applying them, delivers a call twice,
and delivers a delayed copy of a call up to 3 s later (to the same server process only).

Transport: the real `PrefixIndexClient` over an in-process channel that calls the real
`PrefixServicer` (requests and answers through their wire bytes; domain errors become the
status codes the server's interceptor gives). The publisher's loop (`_run`) runs on the test
thread, a fake stop event bounding its turns and turning its sleeps into fake-clock time (the
publisher's `time` is the same clock), so a run is deterministic for its seed. The last test
does a short run over real gRPC with the publisher on its own thread, the index server
stopped and started again (empty) on the same port.

Run: 4,000 seeds of 300 steps and 300 of 1,000 (one and two replicas, one shard and two).
Found: a shard registered with again (restarted, or its lease lapsed) whose Register was
applied but answered too late (a lost answer) never got its snapshot: the next heartbeat
found it knowing the replica, and it named none of the replica's blocks while the publisher
counted itself up to date (3 of 400 seeds at first; 61 of 300 with this file's final mix). Fixed in
`Publisher._register`; test_publisher_sharded.py guards it deterministically over real gRPC.
A Register delayed past a whole lease that lands after the replica's lease lapsed made the
index know the replica with nothing held while its heartbeats found it known (fixed later: the
first batch after such a registration must be a resync; deterministic test in
tests/prefix/test_lapse.py). Replays may now deliver a Register at any time (half the replays
pick a waiting Register), but a lapse here is mostly forgiven by the index as its own pause
(no other traffic meanwhile), so the seeds rarely reach that case.
Teeth (300 seeds each, one bug at a time): a full resync keeping the old backlog 28 failed;
a split event's second part keeping the first part's parent 13; the pool reporting all but
the last block of an eviction 267; the index's resync not clearing the replica's view 286; a
backlog overflow dropping events without a resync 50; the client giving a failed batch's
number back 21.
More seeds: TIERCACHE_PUBLISHER_DIFF_SEEDS=2000 (default 60 here; the steps per seed:
TIERCACHE_PUBLISHER_DIFF_STEPS, default 300).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

from services.common.bootstrap import create_server
from services.common.errors import TierCacheError
from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient
from services.kvpool import publisher as publisher_mod
from services.kvpool.block_pool import BlockPool, PoolExhausted
from services.kvpool.publisher import Publisher
from services.prefix.index import PrefixIndex
from services.prefix.server import PrefixServicer
from tests.waits import wait_until

MODEL = "m-diff"
BS = 4
SEEDS = int(os.environ.get("TIERCACHE_PUBLISHER_DIFF_SEEDS", "60"))
STEPS = int(os.environ.get("TIERCACHE_PUBLISHER_DIFF_STEPS", "300"))
LEASE = 10.0


class Clock:
    """The one fake time of a run: the pools' pins, the index's leases, the publishers'."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += max(0.0, dt)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Done:
    """A finished call, as `stub.Method.future(...)` returns it."""

    def __init__(self, fn: Callable[[], object]) -> None:
        try:
            self._value, self._exc = fn(), None
        except grpc.RpcError as e:
            self._value, self._exc = None, e

    def result(self, timeout: float | None = None):
        if self._exc is not None:
            raise self._exc
        return self._value


class Net:
    """In-process transport to shard servicers by address, with faults on demand."""

    def __init__(self, rng: random.Random, clock: Clock) -> None:
        self.rng = rng
        self.clock = clock
        self.servers: dict[str, PrefixServicer] = {}
        self.down: set[str] = set()
        # Per call: lose the request, lose the answer (after applying it), apply it twice,
        # keep a copy to replay later.
        self.p_lose_req = self.p_lose_ans = self.p_dup = self.p_delay = 0.0
        # (address, the server process it went to, when it was sent, method, request bytes)
        self.delayed: list[tuple[str, PrefixServicer, float, str, bytes]] = []
        self.calls = 0
        # The batch limits the shards give at Register (small: snapshots span batches, and
        # events are split).
        self.max_events = rng.choice([2, 3, 512])
        self.max_blocks = rng.choice([2, 3, 65536])
        # A lease under 3 heartbeats (2 s) has the publisher beat faster.
        self.lease = rng.choice([3.0, LEASE])

    def start(self, addr: str) -> PrefixIndex:
        """(Re)start the shard at `addr` with an empty index."""
        index = PrefixIndex(BS, lease_seconds=self.lease, clock=self.clock, max_nodes=10**6,
                            max_events=self.max_events, max_blocks=self.max_blocks)
        self.servers[addr] = PrefixServicer(index)
        self.down.discard(addr)
        return index

    def index(self, addr: str) -> PrefixIndex:
        return self.servers[addr].index

    def _apply(self, addr: str, method: str, data: bytes):
        server = self.servers[addr]
        req_type = getattr(prefix_pb2, "PrefixStatsRequest" if method == "Stats"
                           else f"{method}Request")
        req = req_type.FromString(data)
        try:
            resp = getattr(server, method)(req, None)
        except TierCacheError as e:
            raise FakeRpcError(grpc.StatusCode[e.code], str(e)) from None
        return type(resp).FromString(resp.SerializeToString())

    def invoke(self, addr: str, method: str, request) -> object:
        self.calls += 1
        data = request.SerializeToString()
        if addr in self.down:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        r = self.rng.random()
        if r < self.p_lose_req:
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "request lost")
        r -= self.p_lose_req
        if r < self.p_lose_ans:
            self._apply(addr, method, data)
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost")
        r -= self.p_lose_ans
        if r < self.p_dup:
            try:
                self._apply(addr, method, data)
            except grpc.RpcError:
                pass
            return self._apply(addr, method, data)
        r -= self.p_dup
        if r < self.p_delay:
            self.delayed.append((addr, self.servers[addr], self.clock(), method, data))
        return self._apply(addr, method, data)

    def replay_one(self) -> None:
        """A delayed copy of a request reaches its shard now: only the process it was sent to
        (a restarted one never sees the old connection's calls), within a few seconds (a call
        waiting on the index's lock), or, a Register, at any time: one landing after the
        replica's lease lapsed must not leave the index knowing it with nothing held."""
        if not self.delayed:
            return
        # Registers are rare among the calls: half the replays pick one when one waits.
        regs = [i for i, d in enumerate(self.delayed) if d[3] == "Register"]
        pick = (self.rng.choice(regs) if regs and self.rng.random() < 0.5
                else self.rng.randrange(len(self.delayed)))
        addr, server, sent, method, data = self.delayed.pop(pick)
        late = self.clock() - sent > 3.0
        if addr in self.down or self.servers[addr] is not server or (late and method != "Register"):
            return
        try:
            self._apply(addr, method, data)
        except grpc.RpcError:
            pass

    def channel(self, addr: str) -> FakeChannel:
        return FakeChannel(self, addr)


class _Method:
    def __init__(self, net: Net, addr: str, name: str) -> None:
        self.net, self.addr, self.name = net, addr, name

    def __call__(self, request, timeout=None, metadata=None, **kw):
        return self.net.invoke(self.addr, self.name, request)

    def future(self, request, timeout=None, metadata=None, **kw):
        return _Done(lambda: self.net.invoke(self.addr, self.name, request))


class FakeChannel:
    def __init__(self, net: Net, addr: str) -> None:
        self.net, self.addr = net, addr

    def unary_unary(self, path: str, *a, **kw) -> _Method:
        return _Method(self.net, self.addr, path.rsplit("/", 1)[1])

    def close(self) -> None:
        pass


class FakeEngine:
    """What the publisher reads of an engine; its 'engine thread' is the test's thread."""

    def __init__(self, pool: BlockPool, clock: Clock) -> None:
        self.pool = pool
        self.clock = clock
        self._events: list = []

    def call(self, fn: Callable[[], object]) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn())
        except Exception as e:  # noqa: BLE001 - handed to the caller as the engine would
            fut.set_exception(e)
        return fut

    def stats(self):
        s = self.pool.stats()
        return SimpleNamespace(running=0, waiting=0, blocks_free=s.free, blocks_cached=s.cached,
                               blocks_total=s.total)

    def take_events(self) -> list:
        out, self._events = self._events, []
        return out

    def wait_events(self, timeout: float) -> bool:
        if not self._events:
            self.clock.advance(timeout)
        return bool(self._events)

    def step_end(self) -> None:
        """The end of an engine step: the pool's events go to the engine's queue."""
        self._events.extend(self.pool.take_events())


class Turns:
    """The publisher's stop event: `_run` goes on for at most `budget` checks, or (flush) until
    the publisher is quiescent; its sleeps advance the fake clock instead."""

    def __init__(self, clock: Clock, budget: int, quiet: Callable[[], bool] | None) -> None:
        self.clock, self.budget, self.quiet = clock, budget, quiet
        self.checks = 0
        self.converged = False

    def is_set(self) -> bool:
        self.checks += 1
        if self.checks > 1 and self.quiet is not None and self.quiet():
            self.converged = True
            return True
        return self.checks > self.budget

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.advance(timeout or 0.0)
        return self.is_set()

    def set(self) -> None:
        self.budget = 0


class Replica:
    def __init__(self, rid: str, rng: random.Random, clock: Clock, net: Net,
                 addrs: list[str], blocks: int, boot: int = 1) -> None:
        self.rid = rid
        self.rng = rng
        self.clock = clock
        self.pool = BlockPool(blocks, BS, BlockHasher(MODEL, BS), clock=clock,
                              max_pinned=rng.choice([None, blocks // 2]))
        self.eng = FakeEngine(self.pool, clock)
        self.pub = Publisher(self.eng, address=",".join(addrs), replica_id=rid,
                             incarnation=f"{rid}-boot{boot}", public_address=f"10.0.0.{len(rid)}:1",
                             model_id=MODEL, heartbeat_seconds=2.0,
                             publish_interval_seconds=0.2, channel_factory=net.channel)
        self.seqs: dict[str, list] = {}  # seq id -> [tokens, computed, salt]
        self.n = 0

    def quiet(self) -> bool:
        p = self.pub
        return (p.registered and not p._need_resync and not p._backlog and not p._lagging
                and not p._forgot and not self.eng._events and not self.pool._events)

    def turns(self, budget: int, flush: bool = False) -> bool:
        """`budget` turns of the publisher's loop, or (flush) until it is quiescent. `_run`
        heartbeats on its first turn; half the time that one is skipped, as a heartbeat not
        yet due (so a lapse or a restart is also first heard of from a batch); never in a
        flush, which must ask the index whether it still knows the replica."""
        stop = Turns(self.clock, budget, self.quiet if flush else None)
        pub = self.pub
        pub._stop = stop
        if not flush and self.rng.random() < 0.5:
            beat = pub._heartbeat

            def not_yet_due(only=None, partial=None):
                del pub._heartbeat
                if not partial:
                    beat(only, partial)

            pub._heartbeat = not_yet_due
        try:
            pub._run()
        finally:
            pub.__dict__.pop("_heartbeat", None)
        return stop.converged

    # -- pool changes (the engine thread's) -------------------------------------------------

    def pool_step(self, prompts: list[tuple[list[int], str]]) -> None:
        rng, pool = self.rng, self.pool
        op = rng.random()
        live = list(self.seqs)
        try:
            if op < 0.25 or not live:
                toks, salt = rng.choice(prompts)
                self.n += 1
                sid = f"s{self.n}"
                adm = pool.open(sid, toks, salt, use_cache=rng.random() < 0.9,
                                keep_uncached=rng.choice([0, 1]))
                self.seqs[sid] = [list(toks), adm.cached_tokens, salt]
            elif op < 0.5:
                sid = rng.choice(live)
                st = self.seqs[sid]
                st[1] = min(len(st[0]), st[1] + rng.randint(1, 9))
                pool.commit(sid, st[0], st[1])
            elif op < 0.58:
                sid = rng.choice(live)
                st = self.seqs[sid]
                more = [rng.randrange(6) for _ in range(rng.randint(1, 6))]
                pool.ensure_capacity(sid, len(st[0]) + len(more))
                st[0].extend(more)
            elif op < 0.62:
                sid = rng.choice(live)
                st = self.seqs[sid]
                keep = rng.randint(st[1], len(st[0]))
                pool.truncate(sid, keep)
                del st[0][keep:]
            elif op < 0.8:
                pool.close(rng.choice(live))
            elif op < 0.86:
                toks, salt = rng.choice(prompts)
                pool.pin(pool.match(toks, salt), rng.choice([0.5, 3.0, 30.0]))
            elif op < 0.89:
                pool.release_pins(rng.choice([None, 1, 3]))
            elif op < 0.95:
                pool.evict(rng.randint(1, 4))
            elif op < 0.97:
                pool.clear()
            else:
                self.clock.advance(rng.choice([0.3, 1.0, 4.0]))
        except PoolExhausted:
            pass
        # Keep the live-sequence list in step with the pool (close above).
        for sid in [s for s in self.seqs if not pool.has(s)]:
            del self.seqs[sid]
        if rng.random() < 0.85:
            self.eng.step_end()

    def held(self) -> set[bytes]:
        """The model: every block the pool holds (brute force over all blocks)."""
        return {h for b in range(self.pool.num_blocks) if (h := self.pool.block_hash(b))}

    def first_hash_of(self) -> dict[bytes, bytes]:
        return {b.hash: b.first_hash for b in self.pool._blocks if b.hash is not None}


def index_held(index: PrefixIndex, rid: str) -> set[bytes]:
    rep = index._replicas.get(rid)
    if rep is None:
        return set()
    return {blk.key for blk in index.tree.blocks() if blk.holders >> rep.bit & 1}


def matched(index: PrefixIndex, rid: str, toks: list[int], salt: str) -> int:
    r = index.match(MODEL, salt, token_ids=toks, probe=True)
    return next((m.matched_blocks for m in r.matches if m.replica_id == rid), 0)


def make_prompts(rng: random.Random) -> list[tuple[list[int], str]]:
    """Prompts sharing prefixes (a few bases, short random tails) under two salts."""
    bases = [[rng.randrange(6) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    out = []
    for _ in range(14):
        base = rng.choice(bases)
        cut = rng.choice([len(base), len(base) - 2, 4])
        toks = base[:cut] + [rng.randrange(6) for _ in range(rng.randint(0, 9))]
        if toks:
            out.append((toks, rng.choice(["", "", "t"])))
    return out


class Run:
    def __init__(self, seed: int, replicas: int | None = None, shards: int | None = None
                 ) -> None:
        self.rng = rng = random.Random(seed)
        self.seed = seed
        self.clock = Clock()
        self.net = Net(rng, self.clock)
        n_shards = shards or rng.choice([1, 1, 2])
        self.addrs = [f"10.9.0.{i}:5005{i}" for i in range(n_shards)]
        for a in self.addrs:
            self.net.start(a)
        n_reps = replicas or rng.choice([1, 2])
        self.reps = [Replica(f"kv-{i}", rng, self.clock, self.net, self.addrs,
                             rng.randint(5, 14)) for i in range(n_reps)]
        self.prompts = make_prompts(rng)
        self.faults = rng.random() < 0.6
        # Some runs check rarely and keep a shard down until the next check (long outages:
        # the backlog outgrows its limit and is dropped for a resync).
        self.p_flush = rng.choice([0.03, 0.12])
        self.outages = rng.random() < 0.3
        # The orchestrator's client: a Match goes to the shard owning the first block.
        self.client = PrefixIndexClient(self.addrs, block_size=BS, channel_factory=self.net.channel)
        self.checks = 0
        self.boots = 1
        self.log: list[str] = []

    def set_faults(self, on: bool) -> None:
        f = 0.04 if on and self.faults else 0.0
        self.net.p_lose_req = self.net.p_lose_ans = self.net.p_dup = self.net.p_delay = f

    def index_step(self) -> None:
        rng, net = self.rng, self.net
        op = rng.random()
        addr = rng.choice(self.addrs)
        if op < 0.15:
            net.down.add(addr)
            self.log.append(f"down {addr}")
        elif op < 0.4:
            if not self.outages:
                net.down.discard(addr)
        elif op < 0.5:
            net.start(addr)
            self.log.append(f"restart {addr}")
        elif op < 0.6:
            self.clock.advance(net.lease + rng.random() * 3)  # every lease lapses
            self.log.append("lapse")
        elif op < 0.75:
            net.replay_one()
        elif op < 0.85:
            if addr not in net.down:
                idx = net.index(addr)
                idx.sweep()
                idx.reap(rng.choice([None, 3]))
        else:
            self.clock.advance(rng.random() * 3)

    def flush_and_check(self, where: str) -> None:
        self.net.down.clear()
        self.set_faults(True)
        for r in self.reps:
            r.eng.step_end()
        # Each replica in turn, then again: a replica's flush may pass a lease's time for the
        # other (its backoffs are fake-clock time), which must then flush again.
        for _ in range(6):
            for r in self.reps:
                ok = r.turns(400, flush=True)
                assert ok, f"seed {self.seed} {where}: {r.rid} never converged ({self.state(r)})"
            self.set_faults(False)
            if all(self._known(r) for r in self.reps):
                break
        self.set_faults(False)
        for r in self.reps:
            assert self._known(r), f"seed {self.seed} {where}: {r.rid} unknown to a shard"
        self.check(where)

    def _known(self, r: Replica) -> bool:
        """The replica's lease holds on every shard (a flush of the other replica may have run
        the fake clock past it)."""
        return all(r.rid in self.net.index(a)._replicas and
                   self.net.index(a)._replicas[r.rid].deadline > self.clock()
                   for a in self.addrs)

    def state(self, r: Replica) -> str:
        p = r.pub
        return (f"registered={p.registered} need_resync={p._need_resync} "
                f"backlog={len(p._backlog)} lagging={p._lagging} forgot={p._forgot} "
                f"log={self.log[-8:]}")

    def owner(self, r: Replica, first: bytes) -> str:
        return r.pub._client.shard_for(first)

    def check(self, where: str) -> None:
        self.checks += 1
        for a in self.addrs:
            self.net.index(a).check_integrity()
        for r in self.reps:
            r.pool.check_integrity()
            held = r.held()
            firsts = r.first_hash_of()
            for a in self.addrs:
                want = {h for h in held if self.owner(r, firsts[h]) == a}
                got = index_held(self.net.index(a), r.rid)
                assert got == want, (
                    f"seed {self.seed} {where}: shard {a} holds for {r.rid} "
                    f"{len(got - want)} phantom, {len(want - got)} lost blocks "
                    f"(log {self.log[-10:]})")
            hasher = r.pool.hasher
            asks = list(self.prompts) + [(t + [self.rng.randrange(6)] * 4, s)
                                         for t, s in self.prompts[:4]]
            asks += [(st[0], st[2]) for st in r.seqs.values()]
            for toks, salt in asks:
                toks = toks[:self.net.max_blocks * BS]  # the index's limit on a Match
                hs = hasher.hashes(toks, salt)
                want_n = 0
                while want_n < len(hs) and hs[want_n] in held:
                    want_n += 1
                assert want_n == len(r.pool.match(toks, salt))
                if not hs:
                    continue
                got_n = matched(self.net.index(self.owner(r, hs[0])), r.rid, toks, salt)
                got = self.client.match(MODEL, token_ids=toks, cache_salt=salt, probe=True)
                assert got_n == next((m.matched_blocks for m in got.matches
                                      if m.replica_id == r.rid), 0)
                assert got_n == want_n, (
                    f"seed {self.seed} {where}: {r.rid} match {got_n} blocks, pool holds "
                    f"{want_n} (log {self.log[-10:]})")

    def run(self, steps: int) -> None:
        rng = self.rng
        self.flush_and_check("start")
        for i in range(steps):
            op = rng.random()
            r = rng.choice(self.reps)
            if op < 0.6 or 0.88 <= op < 1 - self.p_flush:
                # Now and then a burst of changes between two publisher turns: more than
                # the backlog may take (twice the pool's blocks), dropped for a resync.
                for _ in range(25 if rng.random() < 0.05 else 1):
                    r.pool_step(self.prompts)
            elif op < 0.75:
                self.set_faults(True)
                r.turns(rng.randint(1, 6))
                self.set_faults(False)
            elif op < 0.85:
                self.index_step()
            elif op < 0.855:
                # The replica crashes and comes back: a new incarnation, its pool empty (the
                # old publisher never withdraws; the new registration replaces its view).
                i = self.reps.index(r)
                r.pub._client.close()
                self.boots += 1
                self.reps[i] = Replica(r.rid, rng, self.clock, self.net, self.addrs,
                                       r.pool.num_blocks, boot=self.boots)
                self.log.append(f"crash {r.rid}")
            elif op < 0.88:
                # The sequences end (as requests finish), so evictions can reach everything.
                for sid in list(r.seqs):
                    r.pool.close(sid)
                r.seqs.clear()
                r.eng.step_end()
            else:
                self.flush_and_check(f"step {i}")
        for r in self.reps:
            for sid in list(r.seqs):
                r.pool.close(sid)
            r.seqs.clear()
        self.flush_and_check("end")
        # A stopped publisher withdraws the replica's blocks (an empty resync).
        r = self.reps[0]
        r.pub._thread = None
        r.pub.stop()
        for a in self.addrs:
            assert index_held(self.net.index(a), r.rid) == set(), f"seed {self.seed}: stop"


@pytest.fixture
def fake_time(monkeypatch):
    """The publisher's `time` and `random` as the run's: set per run by `use_clock`."""
    def use_clock(clock: Clock, rng: random.Random) -> None:
        monkeypatch.setattr(publisher_mod, "time", SimpleNamespace(monotonic=clock))
        monkeypatch.setattr(publisher_mod, "random", rng)

    return use_clock


def run_seed(seed: int, use_clock, steps: int = STEPS, **kw) -> Run:
    run = Run(seed, **kw)
    use_clock(run.clock, run.rng)
    try:
        run.run(steps)
    finally:
        for r in run.reps:
            r.pub._client.close()
        run.client.close()
    return run


@pytest.mark.parametrize("replicas,shards", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_index_converges_to_each_pools_holdings(fake_time, replicas, shards) -> None:
    checks = 0
    for seed in range(SEEDS // 4 + 1):
        checks += run_seed(seed * 4 + replicas + 2 * shards, fake_time, replicas=replicas,
                           shards=shards).checks
    assert checks > SEEDS  # quiescent points were reached and compared


class ThreadedEngine(FakeEngine):
    """FakeEngine for a publisher on its own thread: the pool changes, snapshots and event
    hand-offs are serialised by one lock, as the engine thread serialises them."""

    def __init__(self, pool: BlockPool) -> None:
        super().__init__(pool, Clock())
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)

    def call(self, fn: Callable[[], object]) -> Future:
        with self.lock:
            return super().call(fn)

    def take_events(self) -> list:
        with self.lock:
            return super().take_events()

    def wait_events(self, timeout: float) -> bool:
        with self.cv:
            if not self._events:
                self.cv.wait(timeout)
            return bool(self._events)

    def step_end(self) -> None:
        with self.cv:
            super().step_end()
            self.cv.notify_all()


def _fast_reconnect(addr: str) -> grpc.Channel:
    # gRPC waits ~1 s before its first reconnect to a server that went away.
    return grpc.insecure_channel(addr, options=[("grpc.initial_reconnect_backoff_ms", 50),
                                                ("grpc.min_reconnect_backoff_ms", 50),
                                                ("grpc.max_reconnect_backoff_ms", 100)])


def _serve(port: int = 0):
    index = PrefixIndex(BS, lease_seconds=2.0, max_nodes=10**6)
    handle = create_server(service="prefix-diff", address=f"127.0.0.1:{port}",
                           services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server,
                                      PrefixServicer(index), "tiercache.v1.PrefixIndex")])
    handle.set_serving()
    return index, handle


def test_over_grpc_the_index_converges_after_restarts_and_outages() -> None:
    """The same invariant over real gRPC and a real publisher thread: random pool changes,
    the index server stopped for a while and started again (empty) on the same port; after
    each phase, Match (through the client) must come to say exactly what the pool holds."""
    rng = random.Random(7)
    index, handle = _serve()
    port = handle.port
    addr = f"127.0.0.1:{port}"
    pool = BlockPool(10, BS, BlockHasher(MODEL, BS))
    eng = ThreadedEngine(pool)
    rep = SimpleNamespace(rid="kv-0", rng=rng, clock=eng.clock, pool=pool, eng=eng, seqs={},
                          n=0)
    pub = Publisher(eng, address=addr, replica_id="kv-0", incarnation="boot-1",
                    public_address="10.0.0.7:50054", model_id=MODEL, heartbeat_seconds=0.1,
                    publish_interval_seconds=0.01, channel_factory=_fast_reconnect).start()
    client = PrefixIndexClient([addr], block_size=BS, channel_factory=_fast_reconnect)
    prompts = make_prompts(rng)

    def converged() -> bool:
        with eng.lock:
            held = {h for b in range(pool.num_blocks) if (h := pool.block_hash(b))}
        for toks, salt in prompts:
            hs = pool.hasher.hashes(toks, salt)
            want = next((i for i, h in enumerate(hs) if h not in held), len(hs))
            try:
                r = client.match(MODEL, token_ids=toks, cache_salt=salt, probe=True, timeout=1)
            except grpc.RpcError:
                return False
            got = next((m.matched_blocks for m in r.matches if m.replica_id == "kv-0"), -1)
            if got != want:
                return False
        return True

    try:
        for phase in range(6):
            with eng.lock:
                for _ in range(30):
                    Replica.pool_step(rep, prompts)  # type: ignore[arg-type]
                if phase % 2:
                    for sid in list(rep.seqs):
                        pool.close(sid)
                    rep.seqs.clear()
                eng.step_end()
            if phase in (2, 4):
                handle.stop(0)
                time.sleep(0.2)  # the publisher retries, pool changes pile up
                with eng.lock:
                    for _ in range(10):
                        Replica.pool_step(rep, prompts)  # type: ignore[arg-type]
                    eng.step_end()
                index, handle = _serve(port)  # back, empty, on the same port
            wait_until(converged, 10, f"phase {phase}: no convergence in 10 s")
            with eng.lock:
                pool.check_integrity()
                held = {h for b in range(pool.num_blocks) if (h := pool.block_hash(b))}
            assert index_held(index, "kv-0") == held
            index.check_integrity()
    finally:
        pub.stop(timeout=1.0)
        client.close()
        handle.stop(0)
