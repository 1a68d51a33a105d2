"""A differential review of PrefixIndex (services/prefix/index.py): seeded random steps on a
fake clock against a brute-force model of its documented rules, compared after every step.

The model (`Model`) is written from the docstrings of index.py and tree.py, the proto's
comments and docs/settings.md, not from the code's algorithms: per replica its incarnation,
lease deadline, next batch number, whether a resync is due (registered back from a lapse
with its numbers carried on), and the set of block hashes it holds (each block knows its
model, salt and path of small ints, so descendants are found by path prefix). From that:

- Register: a replaced (id, incarnation) is refused; the same incarnation refreshes; a new
  one drops the old holdings and starts at batch 1; the same incarnation back after a lapse
  carries its numbers on and must resync first (and gets back the hits its lapse saved, if
  within a lease).
- Leases lapse at their deadline at any call; a publish taken (applied, a retry, a RESYNC
  answer) renews like a heartbeat, a refused one does not.
- Publish: old seq acknowledged and ignored, a later one (or any first batch while a resync
  is due) answered RESYNC, a resync batch restates the holdings; a chain whose parent the
  replica does not hold waits for it within the batch, else is dropped (counted); a removal
  takes the block and everything below it, and reaches waiting chains; Cleared drops all.
- Match: for each live replica of the model the longest leading run of the request's
  blocks it holds, longest first, ties in load order; the deepest block any of them holds
  is credited a hit unless probe; a probe takes no tick; counters as the proto says.
- Hits: where matches end, halved by `sweep` once per half-life passed; a node nobody holds
  loses them; a resync or a lapse saves those of the nodes only that replica held and gives
  them back to nodes stored again with no hits yet (within a lease); a pruned leaf's hits
  and recency fold into its parent.
- TopPrefixes: nodes with hits >= max(1, min_hits) under the filters, hottest first (ties
  at the cut: any of them; the recency tiebreak is not asserted); holders = who holds it.
- Stats: nodes, per replica held blocks, load, last_seen_s, every counter, unheld nodes.
- Pruning: the model only follows it. Never a phantom (every (replica, block) the index
  holds the model holds), whole subtrees go (leaves first), pruned_total counts them, the
  size stays under the hard bound 2*max_nodes - target; with prune steps large enough to
  finish a run in one call, each evicted block was a leaf whose rank was minimal among the
  leaves then (cold deep leaves first, then the policy: deep LRU before shallow LFU; the
  ranks are the model's own, not the policy object's), pruning stops at the target and
  does not start at or under max_nodes.

Match with a block-hash list that is not one chain (a skip, a swap, a foreign hash) is
sent as a probe and checked only as tree.match documents it ("up to the first break the
binary search probes"): at least the run before the break, never a block the replica does
not hold, longest first. A pause of the index (a clock step past half a lease once the
sweeper has run) pushes leases and the hits kept for a lease back by the sweeper's
lateness, as `_forgive_pause` says. Every step also compares per node holders, hits and
recency (`tree.blocks()`) and runs `check_integrity` (with `verify_hashes` on in some
seeds, which re-hashes every node).

Not covered: the capacity cap on saved hits (capacity 0 or large here; its tiebreak is not
documented), malformed batches beyond two kinds, the bounds on remembered replicas,
sharding (test_sharded_differential.py).

Run in review: 30,000 seeds x 120 steps (and 35,000 of earlier versions of the harness).
Divergences, all on the harness's side: a replica's chains sent under another model (the
index drops an inconsistent chain, as documented), and garbage hash lists matched past
their break (documented in tree.match; now checked as above). Undocumented but harmless,
modelled as the code does: saved hits go back to a node stored again by any replica, not
only by the one that saved them (restore_usage: "nodes stored again"). Injected bugs caught
(failing seeds of 1,000): awaiting_resync ignored 287, removals not reaching waiting chains
30, saved hits not aged 4, a retry not renewing the lease 785, shallow leaves by recency
82, recent deep leaves counted cold 13, probes credited 889, the pause forgiving the
sweeper's period too 254, a lapse saving no hits 27, ties in replica id order 4.
PREFIX_INDEX_SEEDS=N runs N seeds (default 300), PREFIX_INDEX_STEPS the steps of each.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.hashing import BlockHasher
from services.common.policy import HybridPolicy, LRUPolicy
from services.prefix.index import (
    Cleared,
    Load,
    PrefixIndex,
    Removed,
    Stored,
)

SEEDS = int(os.environ.get("PREFIX_INDEX_SEEDS", "300"))
STEPS = int(os.environ.get("PREFIX_INDEX_STEPS", "120"))
BS = 2
KEY = b"diff-key"
LEASE = 1.0
MODELS = ("m1", "m2")
SALTS = ("", "t")
REPLICAS = {"r0": "m1", "r1": "m1", "r2": "m1", "r3": "m2"}
SHALLOW = 4  # tokens: blocks at depth 0 and 1 are shallow
HUGE = 10**9


def toks(path: tuple[int, ...]) -> list[int]:
    return [b * 10 + i for b in path for i in range(BS)]


class Universe:
    """Block hashes of (model, salt, path) chains; path = small ints, one per block."""

    def __init__(self, key: bytes | None = KEY) -> None:
        self.hashers = {m: BlockHasher(m, BS, key) for m in MODELS}
        self.info: dict[bytes, tuple[str, str, tuple[int, ...]]] = {}
        self._memo: dict[tuple, list[bytes]] = {}

    def chain(self, model: str, salt: str, path: tuple[int, ...]) -> list[bytes]:
        k = (model, salt, path)
        hs = self._memo.get(k)
        if hs is None:
            hs = self.hashers[model].hashes(toks(path), salt)
            self._memo[k] = hs
            for i, h in enumerate(hs):
                self.info[h] = (model, salt, path[: i + 1])
        return hs

    def key(self, model: str, salt: str, path: tuple[int, ...]) -> bytes:
        return self.chain(model, salt, path)[-1]

    def parent(self, k: bytes) -> bytes | None:
        model, salt, path = self.info[k]
        return self.key(model, salt, path[:-1]) if len(path) > 1 else None

    def below(self, k: bytes, other: bytes) -> bool:
        """`other` lies strictly below `k` (same model and salt, longer path through it)."""
        m, s, p = self.info[k]
        m2, s2, p2 = self.info[other]
        return m == m2 and s == s2 and len(p2) > len(p) and p2[: len(p)] == p


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
    load: Load = field(default_factory=Load)
    held: set = field(default_factory=set)
    usage: dict | None = None  # key -> (hits, last, halvings when saved)
    usage_until: float = 0.0


class Model:
    def __init__(self, u: Universe, *, now: float, half_life: float, max_nodes: int,
                 prune_to: float, policy, min_deep_hits: int, cold_after_ticks: int) -> None:
        self.u = u
        self.now = now
        self.half_life = half_life
        self.decayed_at = now
        self.halvings = 0
        self.max_nodes = max_nodes
        self.target = int(max_nodes * prune_to)
        self.lru = isinstance(policy, LRUPolicy)
        self.min_deep_hits = min_deep_hits
        self.cold_after = cold_after_ticks
        self.reps: dict[str, Rep] = {}
        self.floor: dict[str, tuple[str, int]] = {}
        self.replaced: set[tuple[str, str]] = set()
        self.lapsed: dict[str, tuple[str, dict, float]] = {}
        self.hits: dict[bytes, int] = {}
        self.last: dict[bytes, int] = {}
        self.unheld: set[bytes] = set()
        self.tick = 0
        self.swept_at: float | None = None  # no sweeper yet: no pause is forgiven
        self.active_at = -1e18
        self.c = dict(matches_total=0, matches_hit=0, match_blocks_total=0,
                      match_blocks_hit=0, pruned_total=0, resyncs_total=0,
                      dropped_blocks_total=0)

    # -- holdings ---------------------------------------------------------------------

    def holders(self, k: bytes) -> set[str]:
        return {rid for rid, r in self.reps.items() if k in r.held}

    def live(self) -> set[bytes]:
        out: set[bytes] = set()
        for r in self.reps.values():
            out |= r.held
        return out

    def _lose(self, keys, save: dict | None) -> None:
        """Nodes in `keys` nobody holds any more after a clear: unheld, hits gone (saved)."""
        live = self.live()
        for k in keys:
            if k not in live:
                if save is not None and self.hits[k] > 0:
                    save[k] = (self.hits[k], self.last[k], self.halvings)
                del self.hits[k], self.last[k]
                self.unheld.add(k)

    def clear(self, r: Rep, save: dict | None = None) -> None:
        old, r.held = r.held, set()
        self._lose(old, save)

    def pending(self, r: Rep) -> dict:
        if not r.usage or self.now > r.usage_until:
            return {}
        out = {}
        for k, (h, last, hv) in r.usage.items():
            h >>= self.halvings - hv
            if h:
                out[k] = (h, last, self.halvings)
        return out

    def clear_saving(self, r: Rep) -> dict:
        held: dict = {}
        self.clear(r, held)
        pend = {k: v for k, v in self.pending(r).items() if k not in held}
        assert r.capacity <= 0 or len(pend) + len(held) <= r.capacity, "cap not modelled"
        return {**pend, **held}

    def restore(self, usage: dict) -> dict:
        left = {}
        for k, (h, last, hv) in usage.items():
            if k not in self.hits:
                left[k] = (h, last, hv)
            elif not self.hits[k]:
                self.hits[k] = h >> (self.halvings - hv)
                self.last[k] = max(self.last[k], last)
        return left

    def store(self, r: Rep, hashes, touch: bool) -> None:
        for k in hashes:
            if k in self.hits:
                if touch:
                    self.last[k] = self.tick
            else:
                self.unheld.discard(k)  # revived as a new node: no hits
                self.hits[k], self.last[k] = 0, self.tick
            r.held.add(k)

    def remove(self, r: Rep, k: bytes) -> None:
        if k not in r.held:
            return
        gone = {k} | {o for o in r.held if self.u.below(k, o)}
        r.held -= gone
        live = self.live()
        for g in gone:
            if g not in live:
                del self.hits[g], self.last[g]
                self.unheld -= {o for o in self.unheld if self.u.below(g, o)}

    # -- leases -------------------------------------------------------------------------

    def forgive_pause(self) -> None:
        """The sweeper's turn late by over half a lease with no call served meanwhile: the
        index stood still, and leases (and the hits kept for one) move on by the lateness."""
        if self.swept_at is None:
            return
        if self.now - max(self.swept_at, self.active_at) <= LEASE / 2:
            return
        stood = self.now - max(self.swept_at + LEASE / 4, self.active_at)
        for r in self.reps.values():
            r.deadline += stood
            r.usage_until += stood
        for rid, (inc, usage, until) in self.lapsed.items():
            self.lapsed[rid] = (inc, usage, until + stood)
        self.swept_at = self.now

    def expire(self) -> list[str]:
        self.forgive_pause()
        self.active_at = max(self.active_at, self.now)
        gone = [rid for rid, r in self.reps.items() if r.deadline <= self.now]
        for rid in gone:
            r = self.reps[rid]
            self.floor[rid] = (r.inc, r.next_seq)
            usage = self.clear_saving(r)
            self.lapsed.pop(rid, None)
            if usage:
                self.lapsed[rid] = (r.inc, usage, self.now + LEASE)
            del self.reps[rid]
        return gone

    def renew(self, r: Rep) -> None:
        r.last_seen, r.deadline = self.now, self.now + LEASE

    def register(self, rid: str, inc: str, address: str, model: str, capacity: int):
        if (rid, inc) in self.replaced:
            raise FailedPrecondition("replaced")
        self.expire()
        r = self.reps.get(rid)
        if r is not None and r.inc == inc and r.model == model:
            r.address, r.capacity = address, capacity
        else:
            if r is not None:
                self.clear(r)
            floor = self.floor.pop(rid, None)
            back = r is None and floor is not None and floor[0] == inc
            lapsed = self.lapsed.pop(rid, None)
            old = r.inc if r is not None else floor[0] if floor else None
            if old is not None and old != inc:
                self.replaced.add((rid, old))
            r2 = Rep(inc, model, address, capacity, self.now, self.now,
                     next_seq=floor[1] if back else 1, awaiting=back)
            if back and lapsed and lapsed[0] == inc and self.now <= lapsed[2]:
                r2.usage, r2.usage_until = lapsed[1], self.now + LEASE
            self.reps[rid] = r = r2
        self.renew(r)
        return (LEASE, r.next_seq)

    def heartbeat(self, rid: str, inc: str, load: Load):
        self.expire()
        r = self.reps.get(rid)
        if r is None or r.inc != inc:
            return (False, LEASE)
        r.load = load
        self.renew(r)
        return (True, LEASE)

    def sweep(self) -> list[str]:
        gone = self.expire()
        self.swept_at = self.now
        if self.half_life > 0:
            n = int((self.now - self.decayed_at) // self.half_life)
            if n > 0:
                self.decayed_at += n * self.half_life
                n = min(n, 64)
                for k in self.hits:
                    self.hits[k] >>= n
                self.halvings += n
        for rid in [r for r, v in self.lapsed.items() if v[2] < self.now]:
            del self.lapsed[rid]
        return gone

    # -- events -------------------------------------------------------------------------

    def publish(self, rid: str, inc: str, seq: int, events, resync: bool):
        self.expire()
        r = self.reps.get(rid)
        if r is None or r.inc != inc:
            raise NotFound("unknown")
        if seq < r.next_seq:
            self.renew(r)
            return (False, r.next_seq, False)
        if not resync and (seq > r.next_seq or r.awaiting):
            self.renew(r)
            self.c["resyncs_total"] += 1
            return (True, r.next_seq, False)
        for ev in events:
            if isinstance(ev, Stored):
                if ev.parent_hash and self.u.info.get(ev.parent_hash) is None:
                    raise InvalidArgument("parent_hash", "a root key")  # the one malformed kind
                if len(ev.token_ids) != BS * len(ev.block_hashes):
                    raise InvalidArgument("token_ids", "count")
        self.renew(r)
        self.tick += 1
        usage = None
        if resync:
            usage = self.clear_saving(r)
            r.awaiting, r.usage, r.usage_until = False, None, self.now + LEASE
        waiting: list[tuple[bytes | None, list[bytes]]] = []
        dropped = 0

        def can(parent):
            return parent is None or parent in r.held

        for ev in events:
            if isinstance(ev, Stored):
                parent = ev.parent_hash or None
                hashes = list(ev.block_hashes)
                if not can(parent):
                    waiting.append((parent, hashes))
                    continue
                self.store(r, hashes, not resync)
                progress = True
                while progress:
                    progress = False
                    for w in list(waiting):
                        if can(w[0]):
                            waiting.remove(w)
                            self.store(r, w[1], not resync)
                            progress = True
            elif isinstance(ev, Removed):
                for h in ev.block_hashes:
                    if h in self.u.info:
                        self.remove(r, h)
                gone = set(ev.block_hashes)
                changed = True
                while changed:
                    changed = False
                    for i, (p, hs) in enumerate(waiting):
                        if p in gone:
                            dropped += len(hs)
                            gone |= set(hs)
                            waiting[i] = (p, [])
                            changed = changed or bool(hs)
                            continue
                        cut = next((j for j, h in enumerate(hs) if h in gone), len(hs))
                        if cut < len(hs):
                            dropped += len(hs) - cut
                            gone |= set(hs[cut:])
                            waiting[i] = (p, hs[:cut])
                            changed = True
                waiting = [w for w in waiting if w[1]]
            else:
                self.clear(r)
                dropped += sum(len(w[1]) for w in waiting)
                waiting = []
        dropped += sum(len(w[1]) for w in waiting)
        self.c["dropped_blocks_total"] += dropped
        if usage:
            r.usage = self.restore(usage) or None
        elif r.usage is not None:
            if self.now > r.usage_until:
                r.usage = None
            else:
                named = [h for ev in events if isinstance(ev, Stored) for h in ev.block_hashes]
                mine = {h: r.usage.pop(h) for h in named if h in r.usage}
                r.usage.update(self.restore(mine))
                r.usage = r.usage or None
        r.next_seq = seq + 1
        return (False, r.next_seq, True)

    # -- queries ------------------------------------------------------------------------

    def order(self, model: str) -> list[tuple[str, Rep]]:
        return sorted(((rid, r) for rid, r in self.reps.items() if r.model == model),
                      key=lambda x: (x[1].load.running + x[1].load.waiting, x[0]))

    def match(self, model: str, salt: str, tokens, hashes, probe: bool):
        self.expire()
        served = any(r.model == model for r in self.reps.values())
        if tokens is not None:
            if not served:
                if not probe:
                    self.c["matches_total"] += 1
                    self.c["match_blocks_total"] += len(tokens) // BS
                return [], len(tokens) // BS
            path = tuple(tokens[i * BS] // 10 for i in range(len(tokens) // BS))
            hashes = self.u.chain(model, salt, path) if path else []
            assert hashes == self.u.hashers[model].hashes(tokens, salt)
        if not probe:  # a probe takes no tick (no use: cold_after_ticks ages by traffic)
            self.tick += 1
        chain = 0  # how far the request is one chain (a caller's list may be garbage)
        while chain < len(hashes) and \
                self.u.parent(hashes[chain]) == (hashes[chain - 1] if chain else None):
            chain += 1
        assert chain == len(hashes) or probe, "the harness asks for garbage as a probe"
        out = []
        for rid, r in self.order(model):
            n = 0  # the leading run held, as one chain: each block below the one before
            while n < len(hashes) and hashes[n] in r.held and \
                    self.u.parent(hashes[n]) == (hashes[n - 1] if n else None):
                n += 1
            out.append((rid, r.address, n, n * BS, r.load))
        best = max((m[2] for m in out), default=0)
        if not probe:
            self.c["matches_total"] += 1
            self.c["match_blocks_total"] += len(hashes)
            if best:
                self.c["matches_hit"] += 1
                self.c["match_blocks_hit"] += best
                k = hashes[best - 1]
                self.hits[k] += 1
                self.last[k] = self.tick
        out.sort(key=lambda m: -m[2])  # stable: load order within a length
        return out, len(hashes)

    def top_candidates(self, model: str, min_hits: int, salt):
        out = {}
        for k, h in self.hits.items():
            m, s, p = self.u.info[k]
            if h >= max(1, min_hits) and (not model or m == model) \
                    and (salt is None or s == salt):
                out[k] = (toks(p), h, sorted(self.holders(k)), s, m, k)
        return out

    # -- pruning ------------------------------------------------------------------------

    def leaves(self) -> list[bytes]:
        nodes = set(self.hits) | self.unheld
        parents = {self.u.parent(k) for k in nodes}
        return [k for k in self.hits if k not in parents]

    def rank(self, k: bytes) -> tuple:
        """Eviction order as documented (smallest first): cold deep leaves (hit fewer than
        min_deep_hits times, not used within cold_after_ticks), then the policy's: hybrid =
        deep by recency before shallow by hits (their tiebreak is not documented: any of
        a tie may go), lru = by recency."""
        start = (len(self.u.info[k][2]) - 1) * BS
        hits, last = self.hits[k], self.last[k]
        recent = self.tick - self.cold_after if self.cold_after > 0 else None
        cold = start >= SHALLOW and hits < self.min_deep_hits and (recent is None
                                                                     or last <= recent)
        if self.lru:
            return (0 if cold else 1, last)
        return (0 if cold else 1, 0, last) if start >= SHALLOW else (0 if cold else 1, 1, hits)

    def evict(self, k: bytes) -> None:
        """A pruned node: gone from every holder, its hits and recency into its parent."""
        for r in self.reps.values():
            r.held.discard(k)
        p = self.u.parent(k)
        h, last = self.hits.pop(k), self.last.pop(k)
        if p is not None and p in self.hits:
            self.hits[p] += h
            self.last[p] = max(self.last[p], last)
        self.c["pruned_total"] += 1


class Harness:
    def __init__(self, seed: int) -> None:
        rnd = self.rnd = random.Random(seed)
        self.u = Universe()
        self.t = 1000.0
        half = rnd.choice([0.0, 0.0, LEASE, 2 * LEASE])
        budget = rnd.choice([HUGE, HUGE, 4, 6, 10, 16])
        self.full = rnd.random() < 0.6  # a pruning run finishes in the call that starts it
        step = HUGE if self.full else rnd.choice([1, 3, 10, 30])
        policy = HybridPolicy(SHALLOW) if rnd.random() < 0.75 else LRUPolicy()
        mdh = rnd.choice([0, 1, 1, 2])
        cold = rnd.choice([0, 0, 3])
        self.index = PrefixIndex(
            BS, lease_seconds=LEASE, max_nodes=budget, prune_step=step, policy=policy,
            shallow_tokens=SHALLOW, min_deep_hits=mdh, cold_after_ticks=cold,
            hit_half_life_seconds=half, hash_key=KEY, clock=lambda: self.t,
            verify_hashes=rnd.random() < 0.3)
        self.model = Model(self.u, now=self.t, half_life=half, max_nodes=budget,
                           prune_to=0.9, policy=policy, min_deep_hits=mdh,
                           cold_after_ticks=cold)
        self.runs: list = []
        orig = self.index.tree.pruning

        def pruning(*a, **kw):
            run = orig(*a, **kw)
            self.runs.append(run)
            return run

        self.index.tree.pruning = pruning  # type: ignore[method-assign]
        self.depth = rnd.choice([2, 3, 5, 5])  # short chains: shallow leaves pruned too
        self.pauses = rnd.random() < 0.3  # steps past half a lease: the index stood still
        self.incs = {rid: 0 for rid in REPLICAS}
        self.models = dict(REPLICAS)
        self.muted: set[str] = set()
        # What each replica believes it holds (its last view here), restated by a resync in
        # pieces: part in the resync batch, out of order, the rest queued for the next ones.
        self.memory: dict[str, set[bytes]] = {rid: set() for rid in REPLICAS}
        self.restate: dict[str, list] = {rid: [] for rid in REPLICAS}
        self.log: list[str] = []

    # -- helpers ------------------------------------------------------------------------

    def same(self, what: str, real, want) -> None:
        assert real == want, f"{what}: index {real!r} != model {want!r}\n" + "\n".join(
            self.log[-25:])

    def call(self, what: str, real_fn, model_fn, exact: bool = True):
        """Both sides: the same answer (when `exact`) or the same error class."""
        self.log.append(what)
        out = []
        for fn in (real_fn, model_fn):
            try:
                out.append(("ok", fn()))
            except (NotFound, FailedPrecondition, InvalidArgument) as e:
                out.append(("error", type(e).__name__))
        real, want = out
        if exact or real[0] != "ok" or want[0] != "ok":
            self.same(what, real, want)
        return real[1], want[1]

    def path(self, lo: int = 1, hi: int = 5) -> tuple[int, ...]:
        hi = min(hi, self.depth)
        return tuple(self.rnd.randrange(3) for _ in range(self.rnd.randint(min(lo, hi), hi)))

    def chain_event(self, rid: str) -> Stored:
        rnd, m = self.rnd, self.model
        r = m.reps.get(rid)
        model = r.model if r is not None else self.models[rid]  # the model it registered
        held = sorted(r.held) if r is not None else []
        if held and rnd.random() < 0.5:
            _, salt, base = self.u.info[rnd.choice(held)]
            path = base + self.path(1, 2)
            start = len(base)
        else:
            salt = rnd.choice(SALTS)
            path = self.path()
            start = rnd.randrange(len(path))
        hs = self.u.chain(model, salt, path)
        parent = hs[start - 1] if start else b""
        if rnd.random() < 0.02:
            parent = self.u.hashers[model].root(salt)  # refused: a root's key as parent
        return Stored(parent, hs[start:], toks(path)[start * BS:], salt, hs[0], start)

    def snapshot(self, rid: str) -> list:
        """The replica's holdings as chains from the root, cut into pieces (a piece below
        the root names its parent), shuffled; now and then a removal among them."""
        rnd, u = self.rnd, self.u
        r = self.model.reps.get(rid)
        model = r.model if r is not None else self.models[rid]
        held = {k for k in self.memory[rid] if u.info[k][0] == model}
        tips = [k for k in held if not any(u.below(k, o) for o in held)]
        out: list = []
        for k in sorted(tips):
            model, salt, path = u.info[k]
            hs = u.chain(model, salt, path)
            cuts = sorted({0, len(path)} | {rnd.randrange(len(path)) for _ in range(2)})
            for a, b in zip(cuts, cuts[1:], strict=False):
                out.append(Stored(hs[a - 1] if a else b"", hs[a:b], toks(path)[a * BS:b * BS],
                                  salt, hs[0], a))
        rnd.shuffle(out)
        if out and rnd.random() < 0.3:
            ev = rnd.choice(out)
            out.insert(rnd.randrange(len(out) + 1), Removed([rnd.choice(ev.block_hashes)]))
        return out

    def events(self, rid: str, resync: bool) -> list:
        rnd = self.rnd
        out: list = []
        if resync:
            snap = self.snapshot(rid)
            cut = rnd.randint(0, len(snap)) if rnd.random() < 0.5 else len(snap)
            self.restate[rid] = snap[cut:]
            out = snap[:cut]
            if rnd.random() < 0.5:
                return out
        elif self.restate[rid] and rnd.random() < 0.7:
            n = rnd.randint(1, 3)
            out, self.restate[rid] = self.restate[rid][:n], self.restate[rid][n:]
            if rnd.random() < 0.5:
                return out
        for _ in range(rnd.choice([1, 1, 1, 2, 3, 4])):
            x = rnd.random()
            if x < 0.72:
                out.append(self.chain_event(rid))
            elif x < 0.96:
                r = self.model.reps.get(rid)
                pool = sorted(r.held) if r is not None and r.held else []
                ks = []
                for _ in range(rnd.randint(1, 2)):
                    if pool and rnd.random() < 0.7:
                        ks.append(rnd.choice(pool))
                    else:
                        ks.append(self.u.key(self.models[rid], rnd.choice(SALTS), self.path()))
                out.append(Removed(ks))
            else:
                out.append(Cleared())
        if rnd.random() < 0.3:
            rnd.shuffle(out)
        return out

    # -- steps --------------------------------------------------------------------------

    def step(self) -> None:
        rnd, m, ix = self.rnd, self.model, self.index
        before_live = None
        x = rnd.random()
        if rnd.random() < 0.04:
            self.muted ^= {rnd.choice(sorted(REPLICAS))}  # silent for a while: lapses
        rid = rnd.choice(sorted(REPLICAS))
        if rid in self.muted and x < 0.62:
            x = 0.62 + rnd.random() * 0.38
        elif rid not in m.reps and rnd.random() < 0.5:
            x = 0.0  # a replica told NOT_FOUND registers again
        cur = f"i{self.incs[rid]}"
        pruning_call = False
        if x < 0.12:
            choice = rnd.random()
            if choice < 0.15:
                self.incs[rid] += 1
                cur = f"i{self.incs[rid]}"
            elif choice < 0.22 and self.incs[rid]:
                cur = f"i{rnd.randrange(self.incs[rid])}"  # a late Register of a dead one
            addr = f"h{rnd.randrange(3)}:1"
            cap = rnd.choice([0, 1000])
            if rnd.random() < 0.03:  # the same id (and incarnation, maybe) serving another model
                self.models[rid] = rnd.choice(MODELS)
                self.memory[rid], self.restate[rid] = set(), []  # holds none of those
            model = self.models[rid]
            self.call(f"register {rid} {cur} {model}",
                      lambda: tuple(ix.register(rid, cur, addr, model, BS, cap)),
                      lambda: m.register(rid, cur, addr, model, cap))
        elif x < 0.27:
            inc = cur if rnd.random() < 0.85 else f"i{rnd.randrange(self.incs[rid] + 2)}"
            who = rid if rnd.random() < 0.95 else "zz"
            load = Load(rnd.randrange(3), rnd.randrange(2), 5, 10)
            pruning_call = True

            def model_hb():
                nonlocal before_live
                res = m.heartbeat(who, inc, load)
                before_live = len(m.live())
                return res

            self.call(f"heartbeat {who} {inc} {load[:2]}",
                      lambda: tuple(ix.heartbeat(who, inc, load)), model_hb)
        elif x < 0.62:
            r = m.reps.get(rid)
            nxt = r.next_seq if r is not None else 1
            seq = max(1, nxt + rnd.choice([0, 0, 0, 0, 0, -1, -2, 1, 2]))
            resync = rnd.random() < 0.15 or (r is not None and r.awaiting
                                             and rnd.random() < 0.6)
            inc = cur if rnd.random() < 0.95 else f"i{rnd.randrange(self.incs[rid] + 2)}"
            evs = self.events(rid, resync)
            pruning_call = True
            self.runs.clear()

            def model_pub():
                nonlocal before_live
                res = m.publish(rid, inc, seq, evs, resync)
                before_live = len(m.live())
                return res

            self.call(f"publish {rid} {inc} seq={seq} resync={resync} {evs!r:.300}",
                      lambda: tuple(ix.publish(rid, inc, seq, evs, resync)), model_pub)
        elif x < 0.77:
            model = rnd.choice(MODELS)
            salt = rnd.choice(SALTS)
            path = self.path(0, 5)
            held = sorted(m.hits)
            if held and rnd.random() < 0.6:  # near what is held: hits, partial matches
                model, salt, path = self.u.info[rnd.choice(held)]
                path = path[: rnd.randint(1, len(path))] + self.path(0, 2)
            probe = rnd.random() < 0.2
            if path and rnd.random() < 0.4:
                hashes = list(self.u.chain(model, salt, path))
                if rnd.random() < 0.1:
                    model = rnd.choice(MODELS)  # maybe another model's hashes
                if len(hashes) > 1 and rnd.random() < 0.15:  # not one chain: a skip, a swap
                    probe = True  # where the index sees the break is not documented
                    i = rnd.randrange(len(hashes) - 1)
                    if rnd.random() < 0.5:
                        del hashes[i]
                    else:
                        hashes[i], hashes[i + 1] = hashes[i + 1], hashes[i]
                if rnd.random() < 0.05:
                    probe = True
                    hashes.append(self.u.key(rnd.choice(MODELS), rnd.choice(SALTS), self.path()))
                tokens = None
            else:
                tokens = toks(path) + [7] * rnd.randrange(BS)
                hashes = None
            if not path and tokens is not None and len(tokens) == 0:
                tokens = [7]

            def real_match():
                res = ix.match(model, salt, token_ids=tokens or (),
                               block_hashes=hashes or (), probe=probe)
                return [tuple(mm) for mm in res.matches], res.request_blocks

            real, want = self.call(f"match {model} {salt!r} {path} probe={probe}",
                                   real_match, lambda: m.match(model, salt, tokens, hashes,
                                                               probe), exact=False)
            self.same_match(real, want, hashes)
        elif x < 0.82:
            k = rnd.randint(1, 6)
            model = rnd.choice(("",) + MODELS)
            mh = rnd.choice([0, 1, 2, 3])
            salt = rnd.choice([None, "", "t"])
            self.log.append(f"top {k} {model} {mh} {salt}")
            self.check_top(ix.top_prefixes(k, model, mh, salt),
                           m.top_candidates(model, mh, salt), k)
        elif x < 0.93:
            self.t += rnd.choice([0.0, 0.125, 0.25, 0.375] + [0.75, 1.5, 3.0] * self.pauses)
            m.now = self.t
            self.log.append(f"t={self.t}")
        elif x < 0.97:
            self.log.append("sweep")
            self.same("sweep", sorted(ix.sweep()), sorted(m.sweep()))
        else:
            budget = rnd.choice([None, 1, 3])
            self.log.append(f"reap {budget}")
            left = ix.reap(budget)
            self.sync_unheld()
            self.same("reap left", left, len(m.unheld))
        self.follow_pruning(pruning_call, before_live)
        self.compare()
        for rid, r in m.reps.items():
            self.memory[rid] = set(r.held)

    def sync_unheld(self) -> None:
        table = self.index.tree._table
        m = self.model
        m.unheld = {k for k in m.unheld if k in table}

    def follow_pruning(self, pruning_call: bool, before_live: int | None) -> None:
        m, ix = self.model, self.index
        self.sync_unheld()
        real = {b.key for b in ix.tree.blocks()}
        live = set(m.hits)
        phantom = real - live
        assert not phantom, f"the index holds blocks the model does not: {len(phantom)}"
        gone = live - real
        if not gone:
            if self.full and before_live is not None and before_live > m.max_nodes:
                assert not m.leaves(), "over max_nodes and nothing pruned"
            self.runs.clear()
            return
        assert pruning_call, "blocks vanished outside a publish or heartbeat"
        for k in gone:  # whole subtrees only
            assert all(o in gone for o in live if self.u.below(k, o)), "a non-leaf pruned"
        if self.full:
            assert before_live is not None and before_live > m.max_nodes, "pruned under budget"
            order = [k for run in self.runs for k in run.evicted]
            assert set(order) == gone
            for k in order:
                leaves = m.leaves()
                assert k in leaves, "evicted a node that was not a leaf"
                best = min(m.rank(o) for o in leaves)
                assert m.rank(k) == best, f"evicted rank {m.rank(k)} before {best}"
                m.evict(k)
            assert len(m.hits) <= m.target or not m.leaves(), "stopped above the target"
        else:
            # Deepest first, so that folding goes up the tree.
            for k in sorted(gone, key=lambda k: -len(self.u.info[k][2])):
                m.evict(k)
            assert len(m.hits) <= 2 * m.max_nodes - m.target, "past the hard bound"
        self.runs.clear()

    def same_match(self, real, want, hashes) -> None:
        rm, rn = real
        wm, wn = want
        self.same("request_blocks", rn, wn)
        if hashes and any(self.u.parent(h) != (hashes[i - 1] if i else None)
                          for i, h in enumerate(hashes)):
            # Not one chain: the tree matches "up to the first break the binary search
            # probes", so only: at least the run before the break, never a block the
            # replica does not hold, longest first, the same replicas.
            self.same("garbage order", [mm[2] for mm in rm],
                      sorted((mm[2] for mm in rm), reverse=True))
            self.same("garbage replicas", sorted(mm[0] for mm in rm), sorted(mm[0] for mm in wm))
            want_n = {mm[0]: mm[2] for mm in wm}
            for mm in rm:
                assert mm[2] >= want_n[mm[0]], "a garbage list matched less than its chain"
                held = self.model.reps[mm[0]].held
                assert all(h in held for h in hashes[: mm[2]]), "a phantom match"
            return
        key = [(mm[2], mm[4].running + mm[4].waiting) for mm in rm]
        self.same("match order", key, [(mm[2], mm[4].running + mm[4].waiting) for mm in wm])
        self.same("matches", sorted(rm), sorted(wm))

    def check_top(self, got, cands: dict, k: int) -> None:
        hits = [p.hits for p in got]
        self.same("top hottest first", hits, sorted(hits, reverse=True))
        self.same("top size", len(got), min(k, len(cands)))
        keys = [p.last_block_hash for p in got]
        assert len(set(keys)) == len(keys)
        for p in got:
            self.same("top prefix", tuple(p), tuple(cands[p.last_block_hash]))
        if got:
            floor = got[-1].hits
            missed = [c for kk, c in cands.items() if kk not in set(keys) and c[1] > floor]
            assert not missed, f"top left out hotter prefixes {missed}"

    def compare(self) -> None:
        m, ix = self.model, self.index
        ix.check_integrity()
        st = ix.stats()
        m.expire()
        want_reps = [(rid, r.inc, r.address, r.model, len(r.held), r.load,
                      max(0.0, m.now - r.last_seen), r.capacity)
                     for rid, r in sorted(m.reps.items())]
        self.same("stats replicas", [tuple(x) for x in st.replicas], want_reps)
        self.same("stats nodes", st.nodes, len(m.hits))
        self.same("stats unheld", st.unheld_nodes, len(m.unheld))
        for name, v in m.c.items():
            self.same(f"stats {name}", getattr(st, name), v)
        by_bit = ix._by_bit
        real = {}
        for b in ix.tree.blocks():
            hold = sorted(by_bit[i].replica_id for i in range(64) if b.holders >> i & 1)
            real[b.key] = (hold, b.hits, b.last)
        want = {k: (sorted(m.holders(k)), m.hits[k], m.last[k]) for k in m.hits}
        if real != want:
            diff = {k.hex()[:8]: (real.get(k), want.get(k)) for k in set(real) | set(want)
                    if real.get(k) != want.get(k)}
            self.same("nodes (holders, hits, last)", diff, {})


def run_seed(seed: int, steps: int = STEPS) -> None:
    h = Harness(seed)
    for _ in range(steps):
        h.step()


@pytest.mark.parametrize("chunk", range(4))
def test_index_agrees_with_the_model_of_its_documented_rules(chunk):
    for seed in range(chunk, SEEDS, 4):
        run_seed(seed)
