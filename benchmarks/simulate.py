"""Routing at cluster size: the real routing policy, hash ring and prefix index, simulated.

    python -m benchmarks.simulate            # 8, 64, 512 replicas x 100k sessions
    python -m benchmarks.simulate --quick    # 8 and 64 replicas x 2k sessions (< 3 minutes)
        -> benchmarks/results/simulate.json (simulate-quick.json with --quick)

What is real: `PrefixAwarePolicy` / `RoundRobinPolicy` (services/orchestrator/routing.py), the
bounded-load `HashRing` inside them (services/common/ring.py), the prefix index
(`PrefixIndex` over the radix `BlockTree`, services/prefix/) fed with the same Stored/Removed
events a kvpool publishes, chained keyed `BlockHasher` hashes, and `HybridPolicy` eviction
order. What is modelled: token ids (no tokenizer: random ids per system prompt, question and
answer, seeded by the workload's structure), each replica's pool (block counts, ref-counted
while a request runs, leaves-first eviction in HybridPolicy order), and compute time.

Workload: `benchmarks.workload.generate` (tenants, Zipf-hot system prompts, multi-turn sessions,
paraphrased repeats, diurnal Poisson arrivals). A session's next turn is sent 5 s after the
previous answer finished (closed loop: a user reads the answer first). The session arrival
rate is scaled with the replica count so that each replica gets `--req-per-replica-s`
requests per second at the diurnal mean.

Compute model per replica (an event-driven clock): at most `max_batch` sequences run; waiting
ones queue FIFO; prefills run one at a time at the measured prefill rate plus a fixed
per-request overhead; decoding runs at the measured per-sequence rate for the batch size at
decode start (aggregate decode tok/s at batch 1/4/8, interpolated). Prefill does not slow
running decodes here (an optimistic simplification shared by every policy).

Prefix index scale-out: one `PrefixIndex` tracks at most 64 replicas (its holder bitmask), so
larger clusters get one index *cell* per 64 replicas and a request asks every cell.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import multiprocessing as mp
import os
import random
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from benchmarks.emit import verdicts
from benchmarks.workload import WorkloadSpec, generate
from services.common.hashing import BlockHasher
from services.common.policy import BlockUsage, HybridPolicy
from services.orchestrator.routing import (
    PrefixAwarePolicy,
    ReplicaView,
    RoundRobinPolicy,
    RoutingPolicy,
)
from services.prefix.index import APPROX_BYTES_PER_NODE, MAX_REPLICAS, PrefixIndex, Removed, Stored

RESULTS = Path(__file__).resolve().parent / "results"
NOTES = Path(__file__).resolve().parent.parent.parent / "shared" / "NOTES.md"
MODEL = "sim-model"
HASH_KEY = b"tiercache-sim"
POLICIES = ("round_robin", "session_ring", "prefix_uncapped", "tiercache", "tiercache_tiebreak")
REQUIRED = POLICIES[:4]  # the comparison the targets are about; the last is a proposal


# -- inputs -------------------------------------------------------------------------------


class Rates(NamedTuple):
    """Compute figures the clock uses, and where they came from."""

    prefill_tok_s: float
    overhead_s: float  # per request: cached-context attention, sampling, scheduling
    decode_tok_s: dict[int, float]  # batch size -> aggregate decode tokens/s
    source: str


def load_rates(results: Path = RESULTS) -> Rates:
    """From `kvpool.json` (the full kvpool benchmark) when present, else ../shared/NOTES.md."""
    path = results / "kvpool.json"
    if path.exists():
        d = json.loads(path.read_text())
        f, shape = d["figures"], d["shape"]
        prefill = (shape["prefix"] + shape["user"]) / f["ttft_cold_s"]
        b1, b8 = f["decode_tok_s_b1"], f["decode_tok_s_b8"]
        return Rates(prefill, max(0.0, f["ttft_hit_s"] - shape["user"] / prefill),
                     {1: b1, 4: b1 + (b8 - b1) * 3 / 7, 8: b8},
                     "benchmarks/results/kvpool.json (cold TTFT, hit TTFT, decode b1/b8)")
    # NOTES.md: prefill ~330-410 tok/s; decode 12.6/33/60 tok/s at batch 1/4/8; a 1,024-token
    # cached prefix + 32 new tokens took 0.20 s -> ~0.11 s beyond the 32 tokens' prefill.
    return Rates(370.0, 0.20 - 32 / 370.0, {1: 12.6, 4: 33.0, 8: 60.0},
                 "../shared/NOTES.md (prefill ~370 tok/s, decode 12.6/33/60 tok/s at b1/4/8)")


def per_seq_decode_s(rates: Rates, batch: int) -> float:
    """Seconds per generated token for one sequence in a batch of `batch`."""
    pts = sorted(rates.decode_tok_s.items())
    b = max(1, batch)
    if b >= pts[-1][0]:
        agg = pts[-1][1] * b / pts[-1][0] if b > pts[-1][0] else pts[-1][1]
    else:
        agg = pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if x0 <= b <= x1:
                agg = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
                break
    return b / agg


def index_bytes_per_node(results: Path = RESULTS) -> tuple[float, str]:
    """Bytes per index node from prefix_index.json (tracemalloc), else the index's constant."""
    path = results / "prefix_index.json"
    if path.exists():
        d = json.loads(path.read_text())
        v = _find_key(d, "bytes_per_block")
        if isinstance(v, (int, float)) and v > 0:
            return float(v), "benchmarks/results/prefix_index.json bytes_per_block"
    return float(APPROX_BYTES_PER_NODE), "services/prefix/index.py APPROX_BYTES_PER_NODE"


def _find_key(d: object, key: str) -> object:
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            r = _find_key(v, key)
            if r is not None:
                return r
    return None


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster and its traffic."""

    replicas: int = 64
    sessions: int = 100_000
    seed: int = 0
    tenants: int = 64
    prompts_per_tenant: int = 4
    system_tokens: int = 1000
    turns: int = 3
    repeat_fraction: float = 0.2
    zipf_s: float = 1.1
    amplitude: float = 0.6
    cycles: float = 4.0  # diurnal periods over the run
    req_per_replica_s: float = 0.2  # mean request rate per replica
    think_s: float = 5.0  # user's pause between an answer and the next turn
    question_tokens: tuple[int, int] = (12, 48)
    answer_tokens: tuple[int, int] = (32, 96)
    block_size: int = 16
    pool_blocks: int = 1024  # per replica
    max_batch: int = 8
    windows: int = 48  # time-series resolution
    # TierCache's policy (PrefixAwarePolicy's defaults; the orchestrator's config defaults).
    epsilon: float = 0.25
    min_prefix_tokens: int = 32
    load_penalty_tokens: float = 16.0


class TieBreakPrefixAwarePolicy(PrefixAwarePolicy):
    """The tie-break study kept for comparison: the candidate list rotated by a key hash.

    Before eecf49f, `PrefixAwarePolicy` kept the first replica with the best score, so among
    replicas holding the same prompt at the same load the one listed first always won. The
    shipped policy now breaks such ties by a per-key hash itself; this variant stays so the
    earlier `tiercache_tiebreak` results can be re-run.
    """

    def choose(self, replicas, matches, key, exclude=frozenset(), new_blocks=None,
               continues=False):
        n = len(replicas)
        if n > 1:
            at = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % n
            replicas = list(replicas[at:]) + list(replicas[:at])
        return super().choose(replicas, matches, key, exclude, new_blocks, continues)


def make_policy(name: str, cfg: SimConfig, clock: Callable[[], float] = lambda: 0.0
                ) -> tuple[RoutingPolicy, bool]:
    """The policy under test and whether it consults the prefix index; `clock` is simulated
    time (the policy's recent-share counts decay with it)."""
    if name == "round_robin":
        return RoundRobinPolicy(), False
    if name == "session_ring":
        # The same bounded-load ring TierCache falls back to, never given index matches.
        return PrefixAwarePolicy(cfg.epsilon, cfg.min_prefix_tokens, cfg.load_penalty_tokens,
                                 clock=clock), False
    if name == "prefix_uncapped":
        return PrefixAwarePolicy(cfg.epsilon, cfg.min_prefix_tokens, cfg.load_penalty_tokens,
                                 use_cap=False, clock=clock), True
    if name == "tiercache":
        return PrefixAwarePolicy(cfg.epsilon, cfg.min_prefix_tokens, cfg.load_penalty_tokens,
                                 clock=clock), True
    if name == "tiercache_tiebreak":
        return TieBreakPrefixAwarePolicy(cfg.epsilon, cfg.min_prefix_tokens,
                                         cfg.load_penalty_tokens, clock=clock), True
    raise ValueError(f"unknown policy {name!r}")


# -- one replica's pool ---------------------------------------------------------------------


class _Blk:
    __slots__ = ("parent", "kids", "ref", "hits", "last", "start", "ver")

    def __init__(self, parent: bytes | None, start: int, now: float) -> None:
        self.parent = parent
        self.kids = 0
        self.ref = 1
        self.hits = 0
        self.last = now
        self.start = start
        self.ver = 0


class SimPool:
    """Block counts of one replica: cached blocks by hash, private (uncommitted) blocks.

    Invariants: free = capacity - cached - private >= 0; a referenced block's ancestors are
    referenced (a sequence holds its whole chain), so every unreferenced cached block can be
    evicted leaves-first; eviction candidates are unreferenced leaves in HybridPolicy order.
    """

    def __init__(self, capacity: int, block_size: int, policy: HybridPolicy) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.policy = policy
        self.blocks: dict[bytes, _Blk] = {}
        self.private = 0
        self.unref = 0
        self.evicted_total = 0
        self._heap: list[tuple] = []
        self._ver = 0

    @property
    def free(self) -> int:
        return self.capacity - len(self.blocks) - self.private

    def match(self, hashes: Sequence[bytes], limit: int) -> int:
        """Leading blocks of `hashes` cached here (at most `limit`)."""
        blocks = self.blocks
        n = 0
        for h in hashes[:limit]:
            if h not in blocks:
                break
            n += 1
        return n

    def can_admit(self, hashes: Sequence[bytes], matched: int, new: int) -> bool:
        pinned_now = sum(1 for h in hashes[:matched] if self.blocks[h].ref == 0)
        return self.free + self.unref - pinned_now >= new

    def admit(self, hashes: Sequence[bytes], matched: int, new: int, now: float) -> list[bytes]:
        """Reference the matched chain, reserve `new` private blocks; returns evicted hashes."""
        for h in hashes[:matched]:
            b = self.blocks[h]
            if b.ref == 0:
                self.unref -= 1
            b.ref += 1
            b.hits += 1
            b.last = now
        evicted = []
        while self.free < new:
            evicted.append(self._evict_one())
        self.private += new
        return evicted

    def commit(self, hashes: Sequence[bytes], start: int, now: float) -> list[int]:
        """Blocks `start..` of a running sequence are full: cache them (private -> cached).

        Returns the indices of blocks that are new here (the rest already existed: the
        duplicate private block is given back and the existing one referenced).
        """
        blocks = self.blocks
        new: list[int] = []
        for i in range(start, len(hashes)):
            h = hashes[i]
            self.private -= 1
            b = blocks.get(h)
            if b is not None:
                if b.ref == 0:
                    self.unref -= 1
                b.ref += 1
                b.last = now
                continue
            parent = hashes[i - 1] if i else None
            blocks[h] = _Blk(parent, i * self.block_size, now)
            if parent is not None:
                blocks[parent].kids += 1
            new.append(i)
        assert self.private >= 0
        return new

    def release(self, hashes: Sequence[bytes], private: int, now: float) -> None:
        """A sequence ended: drop its references (deepest first) and its private blocks."""
        blocks = self.blocks
        for h in reversed(hashes):
            b = blocks[h]
            b.ref -= 1
            b.last = now
            if b.ref == 0:
                self.unref += 1
                if b.kids == 0:
                    self._push(h, b)
        self.private -= private
        assert self.private >= 0

    def _push(self, h: bytes, b: _Blk) -> None:
        self._ver += 1
        b.ver = self._ver
        heapq.heappush(self._heap, (self.policy.key(BlockUsage(b.start, b.hits, b.last)),
                                    b.ver, h))

    def _evict_one(self) -> bytes:
        blocks = self.blocks
        while True:
            _, ver, h = heapq.heappop(self._heap)  # IndexError = accounting bug
            b = blocks.get(h)
            if b is not None and b.ver == ver and b.ref == 0 and b.kids == 0:
                break
        del blocks[h]
        self.unref -= 1
        self.evicted_total += 1
        if b.parent is not None:
            p = blocks[b.parent]
            p.kids -= 1
            if p.kids == 0 and p.ref == 0:
                self._push(b.parent, p)
        return h

    def check(self) -> None:
        """Raise AssertionError unless the counts add up."""
        if self.free < 0 or self.private < 0:
            raise AssertionError(f"free {self.free}, private {self.private}")
        unref = sum(1 for b in self.blocks.values() if b.ref == 0)
        if unref != self.unref:
            raise AssertionError(f"unref {self.unref} != recount {unref}")


# -- the cluster ----------------------------------------------------------------------------


@dataclass
class _Session:
    sid: str
    tenant: str
    system: list[int]
    turns: int
    history: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of `history`'s full blocks
    turn: int = 0


@dataclass
class _Seq:
    session: _Session
    arrival: float
    prompt: list[int]
    hashes: list[bytes]
    answer: int
    replica: int = -1
    matched: int = 0
    private: int = 0
    refs: list[bytes] = field(default_factory=list)


class _Replica:
    def __init__(self, rid: str, cfg: SimConfig, policy: HybridPolicy) -> None:
        self.rid = rid
        self.pool = SimPool(cfg.pool_blocks, cfg.block_size, policy)
        self.queue: deque[_Seq] = deque()
        self.running = 0
        self.prefill_free_at = 0.0
        self.requests = 0
        self.busy_s = 0.0  # prefill seconds + decode sequence-seconds / max_batch

    @property
    def load(self) -> int:
        return self.running + len(self.queue)


class RunResult(NamedTuple):
    policy: str
    replicas: int
    summary: dict
    series: dict
    ttft_hist: dict


_TTFT_BINS = [0.05 * 1.25 ** i for i in range(40)]  # 50 ms .. ~345 s, log-spaced


def _pct(sorted_vals: Sequence[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def _tokens(tag: str, n_range: tuple[int, int]) -> list[int]:
    """Seeded stand-in token ids (uniform over uint16: only equality matters here)."""
    rng = random.Random(tag)
    n = rng.randint(*n_range)
    return array("H", rng.randbytes(2 * n)).tolist()


def build_workload(cfg: SimConfig, qqp: list | None = None) -> tuple[list, WorkloadSpec]:
    """Sessions (tenant, system prompt, turns, first arrival) from the workload generator."""
    # Mirrors generate(): repeats are one-request sessions making up repeat_fraction of requests.
    n_fresh = cfg.sessions
    n_repeat = round(cfg.repeat_fraction * n_fresh * cfg.turns / (1 - cfg.repeat_fraction))
    req_per_session = (n_fresh * cfg.turns + n_repeat) / (n_fresh + n_repeat)
    base_rate = cfg.replicas * cfg.req_per_replica_s / req_per_session
    duration = (n_fresh + n_repeat) / base_rate
    spec = WorkloadSpec(seed=cfg.seed, tenants=cfg.tenants,
                        prompts_per_tenant=cfg.prompts_per_tenant, system_tokens=10,
                        sessions=cfg.sessions, turns=cfg.turns,
                        repeat_fraction=cfg.repeat_fraction, zipf_s=cfg.zipf_s,
                        base_rate=base_rate, amplitude=cfg.amplitude,
                        period_s=duration / cfg.cycles)
    w = generate(spec, qqp)
    systems: dict[tuple[str, int], list[int]] = {}
    for t in w.system_prompts:
        for i in range(cfg.prompts_per_tenant):
            lo = int(cfg.system_tokens * 0.75)
            systems[(t, i)] = _tokens(f"sys/{cfg.seed}/{t}/{i}", (lo, cfg.system_tokens * 5 // 4))
    firsts = []
    turns: dict[str, int] = {}
    for r in w.requests:
        turns[r.session_id] = max(turns.get(r.session_id, 0), r.turn + 1)
    for r in w.requests:
        if r.turn == 0:
            firsts.append((r.at, _Session(r.session_id, r.tenant, systems[(r.tenant,
                           r.system_index)], turns[r.session_id])))
    return firsts, spec


class Cluster:
    """Replicas, their pools, the index cells and the clock, for one routing policy."""

    def __init__(self, cfg: SimConfig, policy_name: str, rates: Rates,
                 bytes_per_node: float = APPROX_BYTES_PER_NODE, keep_index: bool = False
                 ) -> None:
        self.cfg = cfg
        self.rates = rates
        self.bytes_per_node = bytes_per_node
        self.name = policy_name
        self.now = 0.0  # simulated time of the event being handled
        self.policy, self.uses_index = make_policy(policy_name, cfg, lambda: self.now)
        # Policies that never ask the index do not need one (it changes nothing they do).
        self.keep_index = self.uses_index or keep_index
        evict = HybridPolicy()
        self.replicas = [_Replica(f"r{i:03d}", cfg, evict) for i in range(cfg.replicas)]
        self.views = [ReplicaView(r.rid, 0, r.pool.free) for r in self.replicas]
        self.by_id = {r.rid: i for i, r in enumerate(self.replicas)}
        self.hasher = BlockHasher(MODEL, cfg.block_size, HASH_KEY)
        self.cells = [PrefixIndex(cfg.block_size, lease_seconds=1e12, verify_hashes=False,
                                  hash_key=HASH_KEY, clock=lambda: 0.0)
                      for _ in range(math.ceil(cfg.replicas / MAX_REPLICAS))]
        self.seqno = [1] * cfg.replicas
        for i, r in enumerate(self.replicas):
            self._cell(i).register(r.rid, "1", f"sim:{i}", MODEL, cfg.block_size,
                                   cfg.pool_blocks)
        self.events: list[tuple] = []
        self._tie = 0
        # Outputs.
        self.prompt_tokens = self.cached_tokens = 0
        self.routes: dict[str, int] = {}
        self.ttft: dict[str, list[float]] = {"cold": [], "partial": [], "warm": []}
        self.index_s = 0.0
        self.peak_nodes = 0
        self.finished = 0

    def _cell(self, i: int) -> PrefixIndex:
        return self.cells[i // MAX_REPLICAS]

    def _at(self, t: float, prio: int, payload: object) -> None:
        self._tie += 1
        heapq.heappush(self.events, (t, prio, self._tie, payload))

    def _set_load(self, i: int) -> None:
        r = self.replicas[i]
        # Truly free blocks, as kvpool's Stats reports them (cached ones are not free).
        self.views[i] = ReplicaView(r.rid, r.load, r.pool.free)

    def _publish(self, i: int, events: list) -> None:
        if not events or not self.keep_index:
            return
        t0 = time.perf_counter()
        res = self._cell(i).publish(self.replicas[i].rid, "1", self.seqno[i], events)
        self.index_s += time.perf_counter() - t0
        assert not res.resync
        self.seqno[i] += 1

    # -- a request's life --

    def _extend(self, known: list[bytes], tokens: list[int], salt: str) -> list[bytes]:
        # Only the blocks after an already hashed prefix (same values as hashing from 0).
        bs = self.cfg.block_size
        if not known:
            return self.hasher.hashes(tokens, salt)
        return known + self.hasher.hashes(tokens[len(known) * bs:], parent=known[-1])

    def _arrive(self, now: float, s: _Session) -> None:
        cfg = self.cfg
        q = _tokens(f"q/{s.sid}/{s.turn}", cfg.question_tokens)
        prompt = (s.history or s.system) + q
        hashes = self._extend(s.hashes, prompt, s.tenant)
        answer = random.Random(f"a/{s.sid}/{s.turn}").randint(*cfg.answer_tokens)
        seq = _Seq(s, now, prompt, hashes, answer)
        matches: dict[str, int] = {}
        if self.uses_index and hashes:
            t0 = time.perf_counter()
            for cell in self.cells:
                for m in cell.match(MODEL, s.tenant, block_hashes=hashes).matches:
                    if not m.matched_tokens:
                        break
                    matches[m.replica_id] = m.matched_tokens
            self.index_s += time.perf_counter() - t0
        # As the orchestrator calls it: the block count only when the index answered, and
        # whether this is a later turn (the recent-share rule never moves those).
        d = self.policy.choose(self.views, matches, s.sid,
                               new_blocks=len(hashes) + 1 if self.uses_index else None,
                               continues=s.turn > 0)
        assert d is not None
        self.routes[d.route] = self.routes.get(d.route, 0) + 1
        i = self.by_id[d.replica_id]
        rep = self.replicas[i]
        seq.replica = i
        rep.requests += 1
        rep.queue.append(seq)
        self._admit(now, i)
        self._set_load(i)

    def _admit(self, now: float, i: int) -> None:
        rep, cfg, bs = self.replicas[i], self.cfg, self.cfg.block_size
        while rep.queue and rep.running < cfg.max_batch:
            seq = rep.queue[0]
            # Keep one prompt token uncached: it yields the logits of the first new token.
            matched = rep.pool.match(seq.hashes, (len(seq.prompt) - 1) // bs)
            total = -(-(len(seq.prompt) + seq.answer) // bs)
            new = total - matched
            if not rep.pool.can_admit(seq.hashes, matched, new):
                assert rep.running > 0, "pool too small for one request"
                break
            rep.queue.popleft()
            evicted = rep.pool.admit(seq.hashes, matched, new, now)
            if evicted:
                self._publish(i, [Removed(evicted)])
            seq.matched, seq.private = matched, new
            seq.refs = list(seq.hashes[:matched])
            rep.running += 1
            uncached = len(seq.prompt) - matched * bs
            start = max(now, rep.prefill_free_at)
            dur = self.rates.overhead_s + uncached / self.rates.prefill_tok_s
            rep.prefill_free_at = start + dur
            rep.busy_s += dur
            self._at(start + dur, 1, seq)

    def _prefilled(self, now: float, seq: _Seq) -> None:
        i, bs = seq.replica, self.cfg.block_size
        rep = self.replicas[i]
        n = len(seq.prompt)
        cached = seq.matched * bs
        self.prompt_tokens += n
        self.cached_tokens += cached
        frac = cached / n
        self.ttft["cold" if cached == 0 else "warm" if frac >= 0.8 else "partial"].append(
            now - seq.arrival)
        self._window_add(seq.arrival, n, cached)
        self._commit(i, seq, seq.hashes, now)
        dec = seq.answer * per_seq_decode_s(self.rates, rep.running)
        rep.busy_s += dec / self.cfg.max_batch
        self._at(now + dec, 0, ("done", seq))

    def _commit(self, i: int, seq: _Seq, hashes: list[bytes], now: float) -> None:
        start = len(seq.refs)
        if start >= len(hashes):
            return
        pool = self.replicas[i].pool
        new = pool.commit(hashes, start, now)
        seq.private -= len(hashes) - start
        seq.refs.extend(hashes[start:])
        events: list = []
        bs = self.cfg.block_size
        toks = seq.prompt if hashes is seq.hashes else seq.session.history
        run: list[int] = []
        for k in new + [-1]:
            if run and (k != run[-1] + 1):
                a, b = run[0], run[-1] + 1
                events.append(Stored(hashes[a - 1] if a else b"", hashes[a:b],
                                     toks[a * bs:b * bs], seq.session.tenant))
                run = []
            if k >= 0:
                run.append(k)
        self._publish(i, events)

    def _done(self, now: float, seq: _Seq) -> None:
        i = seq.replica
        rep, s = self.replicas[i], seq.session
        s.history = seq.prompt + _tokens(f"a/{s.sid}/{s.turn}", (seq.answer, seq.answer))
        full = s.hashes = self._extend(seq.hashes, s.history, s.tenant)
        self._commit(i, seq, full, now)
        rep.pool.release(seq.refs, seq.private, now)
        rep.running -= 1
        self.finished += 1
        self._admit(now, i)
        self._set_load(i)
        s.turn += 1
        if s.turn < s.turns:
            self._at(now + self.cfg.think_s, 2, s)

    # -- time series --

    def _window_add(self, t: float, n: int, cached: int) -> None:
        w = min(self.cfg.windows - 1, int(t / self.window_s))
        self.win_prompt[w] += n
        self.win_cached[w] += cached

    def _sample(self, w: int) -> None:
        pools = [r.pool for r in self.replicas]
        self.occ_cached.append(sum(len(p.blocks) for p in pools) / sum(p.capacity for p in pools))
        self.occ_used.append(sum(len(p.blocks) - p.unref + p.private for p in pools)
                             / sum(p.capacity for p in pools))
        nodes = sum(len(c.tree) for c in self.cells)
        self.nodes_series.append(nodes)
        self.peak_nodes = max(self.peak_nodes, nodes)
        self.load_series.append(sum(r.load for r in self.replicas))

    def run(self, firsts: list, duration: float, progress: Callable[[int], None] | None = None,
            check_every: int = 0) -> RunResult:
        cfg = self.cfg
        self.window_s = duration / cfg.windows
        self.win_prompt = [0] * cfg.windows
        self.win_cached = [0] * cfg.windows
        self.occ_cached: list[float] = []
        self.occ_used: list[float] = []
        self.nodes_series: list[int] = []
        self.load_series: list[int] = []
        for at, s in firsts:
            self._at(at, 2, s)
        next_sample, w = self.window_s, 0
        t0 = time.perf_counter()
        steps = 0
        while self.events:
            now, _, _, payload = heapq.heappop(self.events)
            self.now = now
            while now >= next_sample and w < cfg.windows:
                self._sample(w)
                w += 1
                next_sample += self.window_s
            if isinstance(payload, _Session):
                self._arrive(now, payload)
            elif isinstance(payload, _Seq):
                self._prefilled(now, payload)
            else:
                self._done(now, payload[1])
                if progress is not None:
                    progress(1)
            steps += 1
            if check_every and steps % check_every == 0:
                self.check()
        while w < cfg.windows:
            self._sample(w)
            w += 1
        self.check()
        return self._result(now, time.perf_counter() - t0)

    def check(self) -> None:
        """Raise AssertionError unless pools and index cells are consistent."""
        for r in self.replicas:
            r.pool.check()
        for c in self.cells:
            c.check_integrity()

    def _result(self, end: float, wall: float) -> RunResult:
        reqs = [r.requests for r in self.replicas]
        busy = [r.busy_s for r in self.replicas]
        mean_req = sum(reqs) / len(reqs)
        all_ttft = sorted(x for v in self.ttft.values() for x in v)
        summary = {
            "requests": sum(reqs),
            "token_hit_ratio": self.cached_tokens / max(1, self.prompt_tokens),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "load_max_over_mean": max(reqs) / mean_req,
            "requests_per_replica": {"min": min(reqs), "max": max(reqs), "mean": mean_req},
            "busy_max_over_mean": max(busy) / (sum(busy) / len(busy)),
            "ttft_p50_s": _pct(all_ttft, 0.50),
            "ttft_p99_s": _pct(all_ttft, 0.99),
            "ttft_by_class": {k: {"n": len(v), "p50_s": _pct(sorted(v), 0.5),
                                  "p99_s": _pct(sorted(v), 0.99)}
                              for k, v in self.ttft.items()},
            "routes": self.routes,
            "index_cells": len(self.cells),
            "index_peak_nodes": self.peak_nodes,
            "index_peak_bytes": int(self.peak_nodes * self.bytes_per_node),
            "index_us_per_request": (1e6 * self.index_s / max(1, self.finished)),
            "evictions": sum(r.pool.evicted_total for r in self.replicas),
            "simulated_s": end,
            "wall_s": wall,
        }
        series = {
            "window_s": self.window_s,
            "token_hit_ratio": [c / p if p else None
                                for c, p in zip(self.win_cached, self.win_prompt, strict=True)],
            "prompt_tokens": self.win_prompt,
            "pool_cached_fraction": self.occ_cached,
            "pool_in_use_fraction": self.occ_used,
            "index_nodes": self.nodes_series,
            "active_sequences": self.load_series,
        }
        hist = {}
        for k, v in self.ttft.items():
            counts = [0] * (len(_TTFT_BINS) + 1)
            for x in v:
                counts[min(len(_TTFT_BINS), max(0, int(math.log(max(x, 0.05) / 0.05)
                                                     / math.log(1.25)) + 1))] += 1
            hist[k] = counts
        return RunResult(self.name, self.cfg.replicas, summary, series,
                         {"bin_edges_s": _TTFT_BINS, "counts": hist})


# -- driver ---------------------------------------------------------------------------------


def simulate(cfg: SimConfig, policy: str, rates: Rates | None = None, qqp: list | None = None,
             bar_position: int | None = None, bytes_per_node: float | None = None
             ) -> RunResult:
    """Run one policy on one cluster; returns its figures."""
    rates = rates or load_rates()
    firsts, spec = build_workload(cfg, qqp)
    duration = spec.period_s * cfg.cycles
    cl = Cluster(cfg, policy, rates, bytes_per_node or index_bytes_per_node()[0])
    if bar_position is None:
        return cl.run(firsts, duration)
    from tqdm import tqdm

    total = sum(s.turns for _, s in firsts)
    with tqdm(total=total, desc=f"{policy:>15} x{cfg.replicas:<3}", position=bar_position,
              leave=False, mininterval=2.0, unit="req") as bar:
        return cl.run(firsts, duration, bar.update)


def _job(args: tuple) -> RunResult:
    cfg, policy, rates, bpn, pos = args
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return simulate(cfg, policy, rates, bar_position=pos, bytes_per_node=bpn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 and 64 replicas, 2k sessions")
    ap.add_argument("--replicas", type=int, nargs="*", default=None)
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--policies", nargs="*", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--pool-blocks", type=int, default=SimConfig.pool_blocks)
    ap.add_argument("--tenants", type=int, default=SimConfig.tenants)
    ap.add_argument("--req-per-replica-s", type=float, default=SimConfig.req_per_replica_s)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--merge", action="store_true",
                    help="keep the output file's results for cluster sizes not run now")
    a = ap.parse_args(argv)
    sizes = a.replicas or ([8, 64] if a.quick else [8, 64, 512])
    sessions = a.sessions or (2000 if a.quick else 100_000)
    rates = load_rates()
    bpn, bpn_src = index_bytes_per_node()
    t0 = time.perf_counter()
    jobs = []
    for n in sizes:
        cfg = SimConfig(replicas=n, sessions=sessions, pool_blocks=a.pool_blocks,
                        tenants=a.tenants, req_per_replica_s=a.req_per_replica_s)
        # Biggest clusters first: the longest jobs start early.
        # The proposed tie-break variant only where the targets are measured.
        jobs += [(cfg, p, rates, bpn) for p in a.policies if p in REQUIRED or n == 64]
    # The target size first (its two target ratios' runs first), then the biggest (longest)
    # cluster: an interrupted run's partial results stay useful.
    first = ("tiercache", "round_robin", "prefix_uncapped", "session_ring", "tiercache_tiebreak")
    jobs.sort(key=lambda j: (j[0].replicas != 64, -j[0].replicas, first.index(j[1])))
    jobs = [(*j, k % max(1, a.jobs)) for k, j in enumerate(jobs)]
    from tqdm import tqdm

    results: list[RunResult] = []
    path = a.out or RESULTS / ("simulate-quick.json" if a.quick else "simulate.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(path.read_text()) if a.merge and path.exists() else None
    with mp.get_context("fork").Pool(a.jobs) as pool:
        for r in tqdm(pool.imap_unordered(_job, jobs), total=len(jobs), desc="simulations",
                      position=a.jobs, unit="run"):
            tqdm.write(f"{r.policy:>15} x{r.replicas:<3} hit {r.summary['token_hit_ratio']:.3f}"
                       f"  load max/mean {r.summary['load_max_over_mean']:.2f}"
                       f"  TTFT p50 {r.summary['ttft_p50_s']:.2f}s"
                       f" p99 {r.summary['ttft_p99_s']:.2f}s  ({r.summary['wall_s']:.0f}s)")
            results.append(r)
            # Written after every run, so an interrupted run still leaves what it finished.
            out = build_output(results, sizes, sessions, rates, (bpn, bpn_src), a,
                               time.perf_counter() - t0, len(results) == len(jobs))
            if prev is not None:
                out = merge_previous(out, prev)
            path.write_text(json.dumps(out, indent=1))
    wall = time.perf_counter() - t0
    for k, t in out["targets"].items():
        print(f"{k}: {t['value']:.3f} (target {t['target']}) {'met' if t['met'] else 'NOT met'}")
    print(f"wrote {path} in {wall:.0f}s")
    return 0


def merge_previous(out: dict, prev: dict) -> dict:
    """Results of `prev` for cluster sizes `out` did not run (each size keeps its sessions)."""
    for n, res in prev.get("results", {}).items():
        if n in out["results"]:
            continue
        out["results"][n] = res
        out["sessions"][n] = prev.get("sessions", {}).get(n, prev["config"]["sessions"])
        out["config"]["replicas"] = sorted(set(out["config"]["replicas"]) | {int(n)})
        out["complete_sizes"][n] = all(p in res for p in REQUIRED)
        if n == str(prev["targets_at_replicas"]):
            for k in ("targets_at_replicas", "hit_ratio_vs_uncapped_prefix_aware",
                      "load_max_over_mean", "hit_ratio_vs_round_robin", "targets",
                      "series", "ttft_hist"):
                out[k] = prev[k]
    out["commands"] = prev.get("commands", [prev["command"]]) + [out["command"]]
    out["wall_s_total"] = prev.get("wall_s_total", prev["wall_s"]) + out["wall_s"]
    out["complete"] = all(out["complete_sizes"].values())
    return out


def build_output(results: list[RunResult], sizes: list[int], sessions: int, rates: Rates,
                 bpn: tuple[float, str], a: argparse.Namespace, wall: float,
                 complete: bool = True) -> dict:
    by = {(r.replicas, r.policy): r for r in results}
    ref = 64 if 64 in sizes else sizes[-1]
    cfg = SimConfig(replicas=ref, sessions=sessions, pool_blocks=a.pool_blocks,
                    tenants=a.tenants, req_per_replica_s=a.req_per_replica_s)
    tc = by.get((ref, "tiercache"))
    unc = by.get((ref, "prefix_uncapped"))
    rr = by.get((ref, "round_robin"))

    def ratio(x: RunResult | None, y: RunResult | None) -> float | None:
        if x is None or y is None or not y.summary["token_hit_ratio"]:
            return None
        return x.summary["token_hit_ratio"] / y.summary["token_hit_ratio"]

    h_unc, h_rr = ratio(tc, unc), ratio(tc, rr)
    lmm = tc.summary["load_max_over_mean"] if tc else None
    targets = verdicts({"hit_ratio_vs_uncapped_prefix_aware": (">=", 0.90),
                        "load_max_over_mean": ("<=", 1.25),
                        "hit_ratio_vs_round_robin": (">=", 2.0)},
                       {"hit_ratio_vs_uncapped_prefix_aware": h_unc,
                        "load_max_over_mean": lmm, "hit_ratio_vs_round_robin": h_rr})
    cmd = "python -m benchmarks.simulate" + (" --quick" if a.quick else "")
    if a.replicas:
        cmd += " --replicas " + " ".join(map(str, a.replicas))
    if a.sessions:
        cmd += f" --sessions {a.sessions}"
    # Every other option that changes the figures, where given: without them a run of some
    # policies, or of another pool size, was recorded (and reported) as the default command.
    for opt, default in (("policies", list(POLICIES)), ("pool_blocks", SimConfig.pool_blocks),
                         ("tenants", SimConfig.tenants),
                         ("req_per_replica_s", SimConfig.req_per_replica_s)):
        v = getattr(a, opt, default)
        if v != default:
            cmd += f" --{opt.replace('_', '-')} " + (" ".join(v) if isinstance(v, list)
                                                      else str(v))
    if a.merge:
        cmd += " --merge"
    return {
        "benchmark": "simulate",
        "command": cmd,
        "quick": bool(a.quick),
        "complete": complete,  # False while (or if) some runs have not finished
        "targets_at_replicas": ref,
        "hit_ratio_vs_uncapped_prefix_aware": h_unc,
        "load_max_over_mean": lmm,
        "hit_ratio_vs_round_robin": h_rr,
        "targets": targets,
        "config": {k: v for k, v in asdict(cfg).items() if k != "replicas"}
        | {"replicas": sizes},
        "load_definition": "requests routed to a replica over the run, max over mean",
        "rates": rates._asdict() | {"decode_tok_s": {str(k): v for k, v in
                                                     rates.decode_tok_s.items()}},
        "index_bytes_per_node": {"value": bpn[0], "source": bpn[1]},
        "policies": {
            "round_robin": "RoundRobinPolicy()",
            "session_ring": f"PrefixAwarePolicy(eps={cfg.epsilon}) given no index matches: "
                            "bounded-load HashRing on the session id",
            "prefix_uncapped": f"PrefixAwarePolicy(eps={cfg.epsilon}, "
                               f"min_prefix_tokens={cfg.min_prefix_tokens}, "
                               f"load_penalty_tokens={cfg.load_penalty_tokens}, use_cap=False)",
            "tiercache": f"PrefixAwarePolicy(eps={cfg.epsilon}, "
                         f"min_prefix_tokens={cfg.min_prefix_tokens}, "
                         f"load_penalty_tokens={cfg.load_penalty_tokens}) (defaults)",
            "tiercache_tiebreak": "proposed: tiercache with equal scores broken by a hash of "
                                  "the session id instead of replica list order "
                                  "(TieBreakPrefixAwarePolicy in benchmarks/simulate.py)",
        },
        "sessions": {str(n): sessions for n in sizes},
        "complete_sizes": {str(n): all((n, p) in by for p in REQUIRED) for n in sizes},
        "results": {str(n): {p: by[(n, p)].summary for p in POLICIES if (n, p) in by}
                    for n in sizes},
        "series": {str(n): {p: by[(n, p)].series for p in POLICIES if (n, p) in by}
                   for n in sizes if n == ref},
        "ttft_hist": {p: by[(ref, p)].ttft_hist for p in POLICIES if (ref, p) in by},
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": list(os.getloadavg())},
        "wall_s": wall,
    }


if __name__ == "__main__":
    raise SystemExit(main())
