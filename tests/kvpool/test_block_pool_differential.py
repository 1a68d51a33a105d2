"""A differential review of BlockPool (with HybridPolicy): seeded random histories against a
brute-force model of the documented rules, every answer and every block compared after every
step.

The model (`Model`) is written from the docstrings of block_pool.py and policy.py, the kvpool
README and DESIGN.md's eviction text, not from the pool's algorithm: a block is a record of
(chain key = cache salt + every token up to its end, hits, last use, pin expiry); its ref count
is how many live block tables list it; its state (in_use / pinned / cached / free) follows
from those; the hash table is a dict keyed by chain; a block's children are found by scanning
the table; the eviction candidates are rebuilt from scratch at every step (committed,
unreferenced, unpinned, no committed child) and ranked by the documented keys (shallow blocks,
starting before `shallow_tokens`, by fewest hits (with a half-life, as the replica's policy:
hits + 1 halved per half-life since the last use) then oldest use; deep ones by oldest use;
every deep one first). Ties are undocumented: the pool may take any candidate with the
smallest key, and the model follows the pool's pick. Likewise for release_pins (any deepest
first selection) and for the ids a new allocation gets (any free blocks).

Rules the model holds the pool to: open's cached_tokens, shared blocks and copy-on-write
(and its fallback when the source and its copy do not fit together), hits and recency
(a shared or copied-from block is a hit and a use; allocation, commit and close refresh
recency), exactly the evictions an allocation is short, refusals (PoolExhausted, `short`,
the sequence not opened, nothing referenced, and nothing evicted unless enough blocks looked
evictable: the documented exception where unpinned parents of a pinned leaf cannot be freed),
deduplication by tokens on commit, truncate, close, pins with expiry (a pin ends at its
expiry instant), max_pinned and the per-salt limit (leading blocks, refreshes count once),
release_pins, evict, clear (children first; AllCleared iff the table empties), stats,
evictable_count, eviction_order, match. Every event is replayed onto a second hash table, as
the prefix index learns it (a stored chain's hashes recomputed from its parent and tokens, its
first hash and start block checked; a removed hash present and childless); that table must
equal the pool's table at every step, and holdings() must rebuild it.

Run (scratch, Dec 5): 3,000 seeds x 300 steps (2-12 blocks, block size 1-4, shallow depth
0-3 blocks, off-grid or none, 15% of pools on LRUPolicy, half with the heap compacted eagerly),
400 more with 2-40 blocks x 600 steps: no divergence from the documented rules. Seen and
documented, counted in `Notes`: a refusal after evicting (unpinned parents of a pinned leaf
counted as evictable; ~1 in 1,000 refusals, only with pins that do not start a chain, which
the engine never makes), `short` below the blocks really missing then. Undocumented, left as
is: a refused open() re-queues the leaves it held for a moment behind other leaves of equal
key (tie order only; 8 in 38,000 refusals); a block shared by deduplication gets no hit.
Mutants caught over the default 150 seeds: shallow boundary `<=` 49 seeds, COW fallback
keeping cached_tokens 10, COW source without its hit 12, close without recency 15, pin ending
after its expiry 84, no refusal before evicting 143, release_pins shallowest first 25, the
per-salt pin room not spent 34, heap compacted inside evict() 1 (test_kvpool_block_pool.py
pins it), a wrong first_block_hash 142, no AllCleared 98, pinned leaves dropped from the heap
112. Beyond the model (whose hashes never collide): with a hasher under which every chain
collides, match() returned, and commit() shared, a block holding the prompt's tokens after
another prefix (fixed: a hit must continue the chain; test_block_pool_rules.py pins both; the
second test here checks every sequence's blocks and every match along their chains, and,
since a later fix, that their first block is the sequence's own tenant's (salt); still
open there: check_integrity's no-shadowed-duplicate rule fails under collisions, when a
block kept out of the table by a collision outlives the entry that kept it out and the same
chain is committed again). The bounded tests run KVPOOL_POOL_DIFFERENTIAL_SEEDS seeds
(default 150, and half as many under collisions; ~4 s); `KVPOOL_POOL_DIFFERENTIAL_SEEDS=3000`
is the full run (`KVPOOL_POOL_DIFFERENTIAL_STEPS` sets the history length).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field

import pytest

from services.common.hashing import BlockHasher
from services.common.policy import HybridPolicy, LRUPolicy
from services.kvpool.block_pool import (
    AllCleared,
    BlockPool,
    BlocksRemoved,
    BlocksStored,
    PoolExhausted,
)
from tests.clock import Clock

SEEDS = int(os.environ.get("KVPOOL_POOL_DIFFERENTIAL_SEEDS", "150"))
STEPS = int(os.environ.get("KVPOOL_POOL_DIFFERENTIAL_STEPS", "300"))



class EagerCompactionPool(BlockPool):
    """The pool with its heap compacted whenever it holds a few stale entries (the real slack is
    4096, which these small histories never reach): the compaction path under the same model."""

    def _maybe_compact_heap(self) -> None:
        if len(self._heap) >= len(self._leaves):
            self._rebuild_heap()


Key = tuple[str, tuple[int, ...]]  # (cache salt, every token from the start to a block's end)


@dataclass
class MBlock:
    key: Key | None = None  # None: not committed
    hits: int = 0
    last: float = 0.0
    pin_until: float = 0.0


@dataclass
class MSeq:
    blocks: list[int]
    committed: int
    salt: str


@dataclass
class Notes:
    """Documented but notable behaviours seen (counted, not failures)."""

    refused_after_evicting: int = 0  # PoolExhausted after evicting (the documented exception)
    short_below_missing: int = 0  # `short` smaller than the blocks that could not be freed
    cow_fallbacks: int = 0
    dedups: int = 0
    evictions: int = 0
    refusals: int = 0
    partial_pins: int = 0
    pin_refusals: int = 0
    refusal_reordered_ties: int = 0  # a refused open moved equal-key leaves behind the rest


class Model:
    """The pool as its docs describe it; brute force over every block at every step."""

    def __init__(self, n: int, bs: int, shallow: int, hasher: BlockHasher, clock: Clock,
                 max_pinned: int, max_per_salt: int, lru: bool = False,
                 half_life: float | None = None) -> None:
        self.lru, self.half_life = lru, half_life
        self.n, self.bs, self.shallow, self.hasher, self.clock = n, bs, shallow, hasher, clock
        self.max_pinned, self.max_per_salt = max_pinned, max_per_salt
        self.blocks = [MBlock() for _ in range(n)]
        self.table: dict[Key, int] = {}
        self.seqs: dict[str, MSeq] = {}
        self.evictions = 0
        self._hash: dict[Key, bytes] = {}
        self.notes = Notes()

    # ---- derived facts ---------------------------------------------------------------------

    def hash_of(self, key: Key) -> bytes:
        if key not in self._hash:
            self._hash[key] = self.hasher.hashes(list(key[1]), key[0])[-1]
        return self._hash[key]

    def refs(self, held: list[int] = ()) -> list[int]:
        out = [0] * self.n
        for s in self.seqs.values():
            for b in s.blocks:
                out[b] += 1
        for b in held:
            out[b] += 1
        return out

    def now(self) -> float:
        return self.clock.t

    def pinned(self, b: int) -> bool:
        return self.blocks[b].pin_until > self.now()

    def parent_key(self, key: Key) -> Key | None:
        return (key[0], key[1][:-self.bs]) if len(key[1]) > self.bs else None

    def has_child(self, key: Key, table: dict[Key, int] | None = None) -> bool:
        return any(self.parent_key(k) == key for k in (self.table if table is None else table))

    def state(self, b: int, refs: list[int]) -> str:
        blk = self.blocks[b]
        if refs[b]:
            return "in_use"
        if self.pinned(b):
            assert blk.key is not None, f"model: free block {b} pinned"
            return "pinned"
        return "cached" if blk.key is not None else "free"

    def free_blocks(self, refs: list[int]) -> set[int]:
        return {b for b in range(self.n) if refs[b] == 0 and self.blocks[b].key is None}

    def start(self, b: int) -> int:
        return len(self.blocks[b].key[1]) - self.bs

    def policy_key(self, b: int) -> tuple:
        blk = self.blocks[b]
        if self.lru:
            return (0, blk.last)
        if self.start(b) < self.shallow:  # LFU, the older first among equal hits
            if self.half_life is not None:
                # hits + 1 halved per half-life since the last use, as of now (policy.py);
                # rounded so that equal aged counts compare equal in floats.
                aged = math.log2(1 + blk.hits) - (self.now() - blk.last) / self.half_life
                return (1, round(aged, 9), blk.last)
            return (1, blk.hits, blk.last)
        return (0, blk.last)  # LRU; every deep block before any shallow one

    def candidates(self, held: list[int] = (), table: dict[Key, int] | None = None) -> set[int]:
        table = self.table if table is None else table
        refs = self.refs(held)
        return {b for k, b in table.items()
                if refs[b] == 0 and not self.pinned(b) and not self.has_child(k, table)}

    def freeable(self, held: list[int] = ()) -> int:
        """Blocks that leaves-first eviction could free, one leaf after another."""
        table = dict(self.table)
        count = 0
        while True:
            cands = self.candidates(held, table)
            if not cands:
                return count
            for b in cands:
                del table[self.blocks[b].key]
                count += 1

    def naive_evictable(self, held: list[int] = ()) -> int:
        refs = self.refs(held)
        return sum(1 for b in range(self.n)
                   if refs[b] == 0 and self.blocks[b].key is not None and not self.pinned(b))

    def match(self, toks: list[int], salt: str) -> list[int]:
        out = []
        for i in range(len(toks) // self.bs):
            b = self.table.get((salt, tuple(toks[:(i + 1) * self.bs])))
            if b is None:
                break
            out.append(b)
        return out

    # ---- steps -----------------------------------------------------------------------------

    def evict_one(self, actual: int, held: list[int] = ()) -> None:
        """Apply the pool's victim, which must be a candidate with the smallest key."""
        cands = self.candidates(held)
        assert actual in cands, f"evicted block {actual}, not a candidate of {sorted(cands)}"
        best = min(self.policy_key(b) for b in cands)
        assert self.policy_key(actual) == best, (
            f"evicted {actual} key {self.policy_key(actual)}, smallest is {best} "
            f"({sorted(b for b in cands if self.policy_key(b) == best)})")
        del self.table[self.blocks[actual].key]
        self.blocks[actual] = MBlock()
        self.evictions += 1
        self.notes.evictions += 1

    def plan(self, need: int, held: list[int]) -> tuple[bool, int, int]:
        """(fits, evictions, short) for an allocation of `need` blocks with `held` referenced."""
        free = len(self.free_blocks(self.refs(held)))
        if free >= need:
            return True, 0, 0
        avail = free + self.naive_evictable(held)
        if avail < need:  # refused before evicting anything
            return False, 0, need - avail
        fr = self.freeable(held)
        if free + fr >= need:
            return True, need - free, 0
        # Documented exception (open's docstring): evicted while trying, then refused.
        return False, fr, need - free - fr

    def allocate_check(self, got: list[int], need: int) -> None:
        refs = self.refs()
        free = self.free_blocks(refs)
        assert len(got) == need and len(set(got)) == need, f"allocated {got}, need {need}"
        assert set(got) <= free, f"allocated {got}, not all free ({sorted(free)})"
        for b in got:
            self.blocks[b] = MBlock(last=self.now())


def replay(table: dict[bytes, tuple], events: list, hasher: BlockHasher, bs: int) -> None:
    """Apply pool events onto a prefix index's view of the replica's table, checking each."""
    for ev in events:
        if isinstance(ev, AllCleared):
            table.clear()
        elif isinstance(ev, BlocksRemoved):
            for h in ev.block_hashes:
                assert h in table, "removed a hash the index never stored"
                del table[h]
                assert not any(v[0] == h for v in table.values()), "removed a parent first"
        else:
            assert isinstance(ev, BlocksStored)
            hs = ev.block_hashes
            assert hs and len(ev.token_ids) == len(hs) * bs, ev
            if ev.start_block == 0:
                assert ev.parent_hash is None and ev.first_block_hash == hs[0]
            else:
                assert ev.parent_hash in table, "stored a chain whose parent is not stored"
                p = table[ev.parent_hash]
                assert p[3] == ev.start_block - 1 and p[2] == ev.cache_salt
                assert p[4] == ev.first_block_hash
            assert hasher.hashes(ev.token_ids, ev.cache_salt, parent=ev.parent_hash) == hs
            parent = ev.parent_hash
            for i, h in enumerate(hs):
                assert h not in table, "stored a hash twice"
                table[h] = (parent, tuple(ev.token_ids[i * bs:(i + 1) * bs]), ev.cache_salt,
                            ev.start_block + i, ev.first_block_hash)
                parent = h


@dataclass
class DSeq:
    """The driver's side of a live sequence."""

    tokens: list[int]
    computed: int = 0


@dataclass
class Harness:
    seed: int
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        rng = self.rng = random.Random(self.seed)
        self.bs = bs = rng.randint(1, 4)
        self.n = n = rng.randint(2, 12)
        self.shallow = rng.choice([0, bs, 2 * bs, 3 * bs, rng.randint(0, 3 * bs), 10_000])
        self.lru = rng.random() < 0.15  # LRUPolicy: every block by recency alone
        # Shallow hits aging (the replica's policy), over ticks of 0 to 5; drawn apart, so that
        # each seed's history is the one it was before.
        self.half_life = random.Random(~self.seed).choice([None, None, 0.5, 4.0])
        max_pinned = rng.choice([None, None, 0, 1, 2, n // 2, n])
        mp = n if max_pinned is None else max_pinned
        max_per_salt = rng.choice([None, None, 1, 2, max(1, mp // 2)])
        self.clock = Clock(rng.choice([0.0, 1000.0]))
        self.hasher = BlockHasher("m", bs, key=b"k")
        cls = EagerCompactionPool if rng.random() < 0.5 else BlockPool
        self.pool = cls(n, bs, self.hasher, HybridPolicy(self.shallow, self.half_life),
                        clock=self.clock, max_pinned=max_pinned,
                        max_pinned_per_salt=max_per_salt)
        if self.lru:
            self.pool.policy = LRUPolicy()
        self.model = Model(n, bs, self.shallow, self.hasher, self.clock, mp,
                           mp if max_per_salt is None else max_per_salt, self.lru,
                           self.half_life)
        self.index: dict[bytes, tuple] = {}
        self.live: dict[str, DSeq] = {}
        self.history: list[tuple[list[int], str]] = []
        self.bases = [[rng.randint(0, 3) for _ in range(rng.randint(1, 3 * bs))]
                      for _ in range(3)]
        self.next_id = 0
        self.log: list[str] = []

    # ---- token choice ----------------------------------------------------------------------

    def suffix(self, k: int) -> list[int]:
        return [self.rng.randint(0, 3) for _ in range(k)]

    def prompt(self) -> tuple[list[int], str]:
        rng = self.rng
        r = rng.random()
        if self.history and r < 0.25:
            return list(rng.choice(self.history)[0]), rng.choice(self.history)[1]  # repeat-ish
        if self.history and r < 0.5:
            toks, salt = rng.choice(self.history)  # next turn
            return toks + self.suffix(rng.randint(0, 2 * self.bs)), salt
        salt = rng.choice(["", "", "t"])
        if r < 0.85:
            return rng.choice(self.bases) + self.suffix(rng.randint(0, 2 * self.bs)), salt
        return self.suffix(rng.randint(0, 3 * self.bs)), salt

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        ops = ["open"] * 4 + ["compute"] * 4 + ["decode"] * 2 + ["close"] * 3 + [
            "truncate", "pin", "pin", "release", "evict", "tick", "tick", "tick"]
        if rng.random() < 0.02:
            ops = ["clear"]
        op = rng.choice(ops)
        if op in ("compute", "decode", "close", "truncate") and not self.live:
            op = "open"
        getattr(self, "op_" + op)()
        self.compare()

    def events(self) -> list:
        evs = self.pool.take_events()
        replay(self.index, evs, self.hasher, self.bs)
        return evs

    @staticmethod
    def removed_ids(model: Model, evs: list) -> list[list[int]]:
        """Each BlocksRemoved event's hashes as model block ids (looked up before removal)."""
        by_hash = {model.hash_of(k): b for k, b in model.table.items()}
        return [[by_hash[h] for h in ev.block_hashes] for ev in evs
                if isinstance(ev, BlocksRemoved)]

    def apply_victims(self, groups: list[list[int]], counts: list[int],
                      helds: list[list[int]]) -> None:
        flat = [b for g in groups for b in g]
        assert len(flat) == sum(counts), f"evicted {flat}, expected {counts} evictions"
        i = 0
        for k, held in zip(counts, helds, strict=True):
            for b in flat[i:i + k]:
                self.model.evict_one(b, held)
            i += k

    def op_open(self) -> None:
        rng, m, bs = self.rng, self.model, self.bs
        toks, salt = self.prompt()
        use_cache = rng.random() < 0.9
        keep = rng.choice([0, 1, 1, 2])
        sid = f"s{self.next_id}"
        self.next_id += 1
        self.log.append(f"open {sid} {toks} salt={salt!r} use_cache={use_cache} keep={keep}")
        order_before = self.pool.eviction_order()
        try:
            adm = self.pool.open(sid, toks, salt, use_cache=use_cache, keep_uncached=keep)
            exc = None
        except PoolExhausted as e:
            adm, exc = None, e
        evs = self.events()
        groups = self.removed_ids(m, evs)
        assert not any(isinstance(e, (BlocksStored, AllCleared)) for e in evs)
        # The model's admission.
        n = len(toks)
        matched = m.match(toks, salt) if use_cache else []
        cached = min(len(matched) * bs, max(0, n - keep))
        shared = matched[:cached // bs]
        cow = matched[len(shared)] if cached % bs else None
        need = -(-max(n, 1) // bs) - len(shared)
        attempts = []
        if cow is not None:
            attempts.append((shared + [cow], cached, cow))
        attempts.append((list(shared), len(shared) * bs, None))
        counts, helds = [], []
        fits = False
        short = 0
        for held, cached_try, cow_try in attempts:
            fits, k, short = m.plan(need, held)
            counts.append(k)
            helds.append(held)
            if fits:
                cached, cow = cached_try, cow_try
                break
            if k:
                m.notes.refused_after_evicting += 1
            if cow_try is not None:
                m.notes.cow_fallbacks += 1
        self.apply_victims(groups, counts, helds)
        if not fits:
            m.notes.refusals += 1
            assert exc is not None, f"pool admitted {sid}, the model refuses it"
            assert not self.pool.has(sid)
            assert exc.short == short >= 1, (exc.short, short)
            if not any(counts) and self.pool.eviction_order() != order_before:
                m.notes.refusal_reordered_ties += 1
            if short < need - len(m.free_blocks(m.refs())) - m.freeable():
                m.notes.short_below_missing += 1
            return
        assert exc is None, f"pool refused {sid} ({exc}), the model admits it"
        got = self.pool.blocks_of(sid)
        assert got[:len(shared)] == shared, f"table {got}, shared {shared}"
        m.allocate_check(got[len(shared):], need)
        now = m.now()
        for b in shared:
            m.blocks[b].hits += 1
            m.blocks[b].last = now
        if cow is not None:
            m.blocks[cow].hits += 1
            m.blocks[cow].last = now
        m.seqs[sid] = MSeq(list(got), len(shared), salt)
        copies = [(cow, got[len(shared)])] if cow is not None else []
        assert adm.cached_tokens == cached, (adm, cached)
        assert adm.copies == copies, (adm, copies)
        self.live[sid] = DSeq(list(toks), cached)

    def pick(self) -> str:
        return self.rng.choice(sorted(self.live))

    def op_compute(self) -> None:
        sid = self.pick()
        d, m, bs = self.live[sid], self.model, self.bs
        upto = min(len(d.tokens), d.computed + self.rng.randint(0, 2 * bs))
        if self.rng.random() < 0.1:
            upto = self.rng.randint(0, len(d.tokens))  # an old figure: commits nothing new
        self.log.append(f"commit {sid} {upto}")
        replaced = self.pool.commit(sid, d.tokens, upto)
        d.computed = max(d.computed, upto)
        evs = self.events()
        s = m.seqs[sid]
        full = min(upto, len(d.tokens)) // bs
        want_replaced: list[int] = []
        want_events: list[BlocksStored] = []
        run: list[bytes] = []
        run_start = s.committed
        def flush() -> None:
            if run:
                first = m.hash_of((s.salt, tuple(d.tokens[:bs])))
                parent = (m.hash_of(m.blocks[s.blocks[run_start - 1]].key)
                          if run_start else None)
                want_events.append(BlocksStored(
                    parent, list(run), list(d.tokens[run_start * bs:(run_start + len(run)) * bs]),
                    s.salt, first, run_start))

        for idx in range(s.committed, full):
            key = (s.salt, tuple(d.tokens[:(idx + 1) * bs]))
            own = s.blocks[idx]
            assert m.blocks[own].key is None
            existing = m.table.get(key)
            if existing is not None:
                s.blocks[idx] = existing
                m.blocks[existing].last = m.now()
                m.blocks[own] = MBlock()  # only this sequence held it: free now
                want_replaced.append(own)
                m.notes.dedups += 1
                flush()
                run, run_start = [], idx + 1
                continue
            m.blocks[own].key = key
            m.blocks[own].last = m.now()
            m.table[key] = own
            run.append(m.hash_of(key))
        flush()
        s.committed = max(s.committed, full)
        assert replaced == want_replaced, (replaced, want_replaced)
        assert evs == want_events, (evs, want_events)

    def op_decode(self) -> None:
        sid = self.pick()
        d, m = self.live[sid], self.model
        new = d.tokens + self.suffix(self.rng.randint(1, self.bs + 1))
        self.log.append(f"grow {sid} {len(new)}")
        s = m.seqs[sid]
        old = list(s.blocks)
        try:
            self.pool.ensure_capacity(sid, len(new))
            exc = None
        except PoolExhausted as e:
            exc = e
        evs = self.events()
        groups = self.removed_ids(m, evs)
        need = -(-len(new) // self.bs) - len(old)
        fits, k, short = m.plan(need, []) if need > 0 else (True, 0, 0)
        if not fits and k:
            m.notes.refused_after_evicting += 1
        self.apply_victims(groups, [k], [[]])
        if not fits:
            m.notes.refusals += 1
            assert exc is not None, "pool grew, the model refuses"
            assert self.pool.blocks_of(sid) == old
            return
        assert exc is None, f"pool refused to grow ({exc}), the model grows"
        got = self.pool.blocks_of(sid)
        assert got[:len(old)] == old
        m.allocate_check(got[len(old):], max(0, need))
        s.blocks = got
        d.tokens = new

    def op_truncate(self) -> None:
        sid = self.pick()
        d, m, bs = self.live[sid], self.model, self.bs
        s = m.seqs[sid]
        num = self.rng.randint(0, len(d.tokens))
        self.log.append(f"truncate {sid} {num}")
        self.pool.truncate(sid, num)
        assert self.events() == []
        keep = max(-(-num // bs), s.committed)
        while len(s.blocks) > keep:
            b = s.blocks.pop()
            assert m.blocks[b].key is None
            m.blocks[b] = MBlock()
        d.tokens = d.tokens[:max(num, s.committed * bs)]
        d.computed = min(d.computed, len(d.tokens))

    def op_close(self) -> None:
        sid = self.pick()
        m = self.model
        self.log.append(f"close {sid}")
        self.pool.close(sid)
        assert self.events() == []
        s = m.seqs.pop(sid)
        refs = m.refs()
        for b in s.blocks:
            m.blocks[b].last = m.now()
            if m.blocks[b].key is None and refs[b] == 0:
                m.blocks[b] = MBlock()
        d = self.live.pop(sid)
        self.history.append((d.tokens[:s.committed * self.bs] or d.tokens, s.salt))
        self.history = self.history[-8:]

    def op_pin(self) -> None:
        rng, m = self.rng, self.model
        r = rng.random()
        if self.live and r < 0.4:
            sid = self.pick()
            ids = m.seqs[sid].blocks[:m.seqs[sid].committed]
        elif self.history and r < 0.8:
            toks, salt = rng.choice(self.history)
            ids = m.match(toks, salt)
        else:
            ids = [rng.randrange(self.n) for _ in range(rng.randint(1, 4))]
        ttl = rng.choice([0, 0.5, 1, 2, 5, 10, 100])
        self.log.append(f"pin {ids} ttl={ttl}")
        try:
            got = self.pool.pin(ids, ttl)
            exc = None
        except PoolExhausted as e:
            got, exc = None, e
        assert self.events() == []
        now = m.now()
        pins = {b for b in range(self.n) if m.pinned(b)}
        room = m.max_pinned - len(pins)
        salt_held: dict[str, int] = {}
        for b in pins:
            salt = m.blocks[b].key[0]
            salt_held[salt] = salt_held.get(salt, 0) + 1
        chosen, refused = [], False
        for b in dict.fromkeys(ids):
            key = m.blocks[b].key
            if key is None:
                continue
            if b not in pins:
                if room <= 0 or salt_held.get(key[0], 0) >= m.max_per_salt:
                    refused = True
                    break
                room -= 1
                salt_held[key[0]] = salt_held.get(key[0], 0) + 1
            chosen.append(b)
        if not chosen and refused:
            m.notes.pin_refusals += 1
            assert exc is not None, f"pool pinned {got}, the model refuses"
            return
        if refused:
            m.notes.partial_pins += 1
        assert exc is None, f"pool refused the pin ({exc}), the model pins {chosen}"
        assert got == len(chosen), (got, chosen)
        for b in chosen:
            m.blocks[b].pin_until = max(m.blocks[b].pin_until, now + ttl)

    def op_release(self) -> None:
        m = self.model
        k = self.rng.choice([None, 0, 1, 1, 2, 3])
        self.log.append(f"release_pins {k}")
        refs = m.refs()
        cands = {b for b in range(self.n) if m.pinned(b) and refs[b] == 0}
        got = self.pool.release_pins(k)
        assert self.events() == []
        released = {b for b in cands if not self.pool.is_pinned(b)}
        want = len(cands) if k is None else min(max(0, k), len(cands))
        assert got == want == len(released), (got, want, released)
        kept = cands - released
        if released and kept:
            assert min(m.start(b) for b in released) >= max(m.start(b) for b in kept), \
                "release_pins unpinned a shallower block before a deeper one"
        for b in released:
            m.blocks[b].pin_until = 0.0

    def op_evict(self) -> None:
        m = self.model
        k = self.rng.randint(0, 3) if self.rng.random() < 0.7 else self.rng.randint(0, self.n)
        self.log.append(f"evict {k}")
        fr = m.freeable()
        order = self.pool.eviction_order()
        out = self.pool.evict(k)
        assert not out or out[0] == order[0], f"evict took {out}, eviction_order {order}"
        evs = self.events()
        groups = self.removed_ids(m, evs)
        assert [b for g in groups for b in g] == out, (groups, out)
        assert len(out) == min(k, fr), (out, k, fr)
        for b in out:
            m.evict_one(b)

    def op_clear(self) -> None:
        m = self.model
        self.log.append("clear")
        got = self.pool.clear()
        evs = self.events()
        table = dict(m.table)
        dropped: list[int] = []
        while True:  # fixpoint: every unreferenced, unpinned block with no child left
            cands = m.candidates((), table)
            if not cands:
                break
            for b in cands:
                del table[m.blocks[b].key]
                dropped.append(b)
        assert got == len(dropped), (got, dropped)
        if not table:
            assert evs == [AllCleared()], evs
        elif dropped:
            assert len(evs) == 1 and isinstance(evs[0], BlocksRemoved), evs
            assert set(evs[0].block_hashes) == {m.hash_of(m.blocks[b].key) for b in dropped}
        else:
            assert evs == [], evs
        for b in dropped:
            m.blocks[b] = MBlock()
        m.table = table

    def op_tick(self) -> None:
        dt = self.rng.choice([0, 0.25, 0.5, 1, 1, 2, 5])
        self.log.append(f"tick {dt}")
        self.clock.t += dt

    # ---- comparison ------------------------------------------------------------------------

    def compare(self) -> None:
        pool, m = self.pool, self.model
        pool.check_integrity()
        refs = m.refs()
        counts = {"free": 0, "cached": 0, "pinned": 0, "in_use": 0}
        for b in range(self.n):
            st = m.state(b, refs)
            counts[st] += 1
            got = ("in_use" if pool.ref_count(b) else "pinned" if pool.is_pinned(b)
                   else "cached" if pool.block_hash(b) is not None else "free")
            assert got == st, f"block {b}: pool {got}, model {st}"
            assert pool.ref_count(b) == refs[b], f"block {b}: ref {pool.ref_count(b)}"
            key = m.blocks[b].key
            assert pool.block_hash(b) == (m.hash_of(key) if key else None), f"block {b} hash"
        assert tuple(pool.stats()) == (self.n, counts["free"], counts["cached"],
                                       counts["pinned"], counts["in_use"]), pool.stats()
        assert pool.evictable_count() == counts["free"] + m.naive_evictable()
        order = pool.eviction_order()
        assert set(order) == m.candidates(), (order, m.candidates())
        keys = [m.policy_key(b) for b in order]
        assert keys == sorted(keys), f"eviction_order {order} keys {keys}"
        for sid, s in m.seqs.items():
            assert pool.blocks_of(sid) == s.blocks, (sid, pool.blocks_of(sid), s.blocks)
        want = {m.hash_of(k): b for k, b in m.table.items()}
        assert pool._table == want, "pool table != model table"
        assert set(self.index) == set(want), "events replayed != table"
        for h, v in self.index.items():
            key = m.blocks[want[h]].key
            assert v[1] == key[1][-self.bs:] and v[2] == key[0]
            assert v[3] == len(key[1]) // self.bs - 1
        assert pool.evictions_total == m.evictions
        probes = [d.tokens for d in self.live.values()] + [t for t, _ in self.history[-3:]]
        for toks in probes:
            for salt in ("", "t"):
                assert pool.match(toks, salt) == m.match(toks, salt), (toks, salt)
        if self.rng.random() < 0.1:
            rebuilt: dict[bytes, tuple] = {}
            replay(rebuilt, pool.holdings(), self.hasher, self.bs)
            assert rebuilt == self.index, "holdings() != the replayed events"

    def run(self, steps: int) -> None:
        self.compare()
        for i in range(steps):
            try:
                self.step()
            except AssertionError as e:
                tail = "\n".join(self.log[-12:])
                raise AssertionError(f"seed {self.seed} step {i} (bs={self.bs} n={self.n} "
                                     f"shallow={self.shallow}): {e}\n{tail}") from e
        for sid in sorted(self.live):
            self.pool.close(sid)
        self.pool.check_integrity()
        assert self.pool.stats().in_use == 0


def test_the_pool_keeps_the_documented_rules_step_by_step() -> None:
    notes = Notes()
    for seed in range(SEEDS):
        h = Harness(seed)
        h.run(STEPS)
        for name, v in vars(h.model.notes).items():
            setattr(notes, name, getattr(notes, name) + v)
    if SEEDS >= 100:  # the bounded run still reaches every rare path it is meant to check
        assert notes.evictions and notes.refusals and notes.dedups and notes.cow_fallbacks
        assert notes.refused_after_evicting and notes.partial_pins and notes.pin_refusals


# ---- under hash collisions: invariants only ----------------------------------------------------


class PositionHasher:
    """Every chain collides with every other: a block's hash is its position alone."""

    def __init__(self, bs: int) -> None:
        self.block_size = bs

    def hashes(self, token_ids: list[int], cache_salt: str = "",
               parent: bytes | None = None) -> list[bytes]:
        first = 0 if parent is None else int.from_bytes(parent, "little") + 1
        return [i.to_bytes(16, "little")
                for i in range(first, first + len(token_ids) // self.block_size)]


def _chain_tokens(pool: BlockPool, bid: int | None) -> list[int]:
    out: list[int] = []
    while bid is not None:
        out = list(pool._blocks[bid].tokens) + out
        bid = pool._blocks[bid].parent
    return out


@pytest.mark.parametrize("seed", range(0, max(1, SEEDS // 2), 25))
def test_a_hash_collision_never_hands_a_prompt_another_prompts_blocks(seed: int) -> None:
    """Tokens are verified on every hash hit so that a collision cannot serve another
    prompt's KV. With every chain colliding, each live sequence's committed blocks and every
    match must hold exactly the prompt's tokens, along their whole parent chain (match() and
    commit() once checked only a block's own tokens: 242 of 500 seeds failed). Not checked
    here: check_integrity(), whose no-shadowed-duplicate rule collisions break (an open
    question of the review, harmless for the KV served)."""
    for s in range(seed, min(seed + 25, max(1, SEEDS // 2))):
        rng = random.Random(s)
        bs, n = rng.randint(1, 3), rng.randint(2, 10)
        clock = Clock(1.0)
        pool = BlockPool(n, bs, PositionHasher(bs), HybridPolicy(rng.choice([0, bs, 100])),
                         clock=clock)
        live: dict[str, list] = {}
        hist: list[list[int]] = []
        for k in range(300):
            op = rng.choice(["open"] * 3 + ["commit"] * 3 + ["close"] * 2 + ["evict", "pin"])
            if op == "open" or not live:
                toks = ((rng.choice(hist)[0] if hist and rng.random() < 0.5 else [])
                        + [rng.randint(0, 2) for _ in range(rng.randint(1, 3 * bs))])
                salt = rng.choice(["", "t"])
                try:
                    pool.open(f"s{k}", toks, salt, use_cache=rng.random() < 0.9,
                              keep_uncached=rng.choice([0, 1]))
                    live[f"s{k}"] = [toks, 0, salt]
                except PoolExhausted:
                    pass
            elif op == "commit":
                sid = rng.choice(sorted(live))
                d = live[sid]
                d[1] = min(len(d[0]), d[1] + rng.randint(1, 2 * bs))
                pool.commit(sid, d[0], d[1])
            elif op == "close":
                sid = rng.choice(sorted(live))
                pool.close(sid)
                d = live.pop(sid)
                hist = (hist + [(d[0], d[2])])[-6:]
            elif op == "evict":
                pool.evict(rng.randint(0, 2))
            else:
                clock.t += 1
                sid = rng.choice(sorted(live))
                try:
                    pool.pin(pool.blocks_of(sid)[:pool._seqs[sid].committed], 3)
                except PoolExhausted:
                    pass
            for sid, (toks, _, salt) in live.items():
                t = pool._seqs[sid]
                for i in range(t.committed):
                    assert _chain_tokens(pool, t.blocks[i]) == toks[:(i + 1) * bs], (s, k)
                assert not t.committed or pool._blocks[t.blocks[0]].cache_salt == salt, (s, k)
            for toks, salt in hist + [(d[0], d[2]) for d in live.values()]:
                m = pool.match(toks, salt)
                assert not m or _chain_tokens(pool, m[-1]) == toks[:len(m) * bs], (s, k)
                assert not m or pool._blocks[m[0]].cache_salt == salt, (s, k)
