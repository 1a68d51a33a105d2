"""The paged block pool's bookkeeping: ids, ref counts, hash table, eviction, pins, events.

Pure logic: it never touches tensors. Block `i` here is row `i` of the KV tensor the engine owns
(`[num_blocks, layers, 2, kv_heads, block_size, head_dim]`); when the pool asks for data to move
(a copy-on-write), it returns the (src, dst) pair and the engine copies.

Every block is in exactly one state:

    in_use   ref > 0                      (held by live sequences; never evicted)
    pinned   ref == 0, pinned             (warm-up; never evicted until the pin expires)
    cached   ref == 0, hashed, unpinned   (eviction candidate when it is a leaf)
    free     ref == 0, not hashed         (in the free queue)

A sequence's block table lists its blocks in order; full blocks whose KV is computed are
"committed": hashed with the chained hash of `services.common.hashing` and entered in the table so
that later prompts starting the same way reuse them. Only the pool's owner thread calls it.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from services.common.hashing import BlockHasher
from services.common.policy import BlockUsage, EvictionPolicy, HybridPolicy


class PoolExhausted(Exception):
    """Not enough free or evictable blocks for an allocation. `short`: how many blocks were
    missing (0 = not known)."""

    def __init__(self, message: str, short: int = 0) -> None:
        super().__init__(message)
        self.short = short


class BlocksStored(NamedTuple):
    """Blocks newly committed, a chain continuing after `parent_hash` (None = the root)."""

    parent_hash: bytes | None
    block_hashes: list[bytes]
    token_ids: list[int]
    cache_salt: str
    first_block_hash: bytes
    start_block: int


class BlocksRemoved(NamedTuple):
    """Blocks evicted from the table."""

    block_hashes: list[bytes]


class AllCleared(NamedTuple):
    """Every cached block was dropped."""


PoolEvent = BlocksStored | BlocksRemoved | AllCleared


class Admission(NamedTuple):
    """What `open` did for a new sequence."""

    cached_tokens: int  # prompt tokens whose KV is already in the table's blocks
    copies: list[tuple[int, int]]  # (src, dst) block copies the engine must do first (COW)


class Flushed(NamedTuple):
    """What `flush_salt` did: the blocks it dropped (now free; their KV rows still hold the
    tenant's data until the engine zeroes them) and how many of the salt's stayed (in use)."""

    block_ids: list[int]
    kept: int


class PoolStats(NamedTuple):
    total: int
    free: int
    cached: int
    pinned: int
    in_use: int


@dataclass
class _Block:
    ref: int = 0
    hash: bytes | None = None
    tokens: tuple[int, ...] = ()
    parent: int | None = None  # block id of the previous block in the chain
    children: int = 0  # committed blocks whose parent is this one
    start_token: int = 0
    cache_salt: str = ""
    first_hash: bytes = b""
    hits: int = 0
    last_access: float = 0.0
    pin_until: float = 0.0


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    committed: int = 0  # leading blocks that are hashed (shared-safe)
    cache_salt: str = ""


class BlockPool:
    """Ref-counted blocks with a prefix hash table; see the module docstring.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        hasher: the chained block hasher (model id + hash key).
        policy: orders eviction candidates (default HybridPolicy).
        clock: monotonic time source (tests pass a fake one).
        record_events: False = emit no events (a replica that publishes to no prefix index
            would otherwise keep every event it never hands to anyone).
    """

    def __init__(self, num_blocks: int, block_size: int, hasher: BlockHasher,
                 policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 record_events: bool = True, max_pinned: int | None = None,
                 max_pinned_per_salt: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be > 0")
        if hasher.block_size != block_size:
            raise ValueError("hasher block size differs from the pool's")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher
        # Most blocks pins may hold at once (None = all): warm-up must not starve requests.
        self.max_pinned = num_blocks if max_pinned is None else max_pinned
        # Most of them one cache salt (one tenant) may hold (None = max_pinned): else one
        # tenant's Warm with a long TTL could hold every pin the pool allows.
        self.max_pinned_per_salt = (self.max_pinned if max_pinned_per_salt is None
                                    else max_pinned_per_salt)
        self.policy = policy or HybridPolicy()
        self.clock = clock
        self.record_events = record_events
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._table: dict[bytes, int] = {}
        self._seqs: dict[str, _Table] = {}
        self._events: list[PoolEvent] = []
        self._in_use = 0  # blocks with ref > 0, kept incrementally: stats run every step
        self._pins: dict[int, float] = {}  # block id -> pin expiry (pinned blocks only)
        # Eviction candidates before the pin check: hashed, unreferenced, no hashed children;
        # block id -> the stamp of its current entry in `_heap`. A leaf's usage never changes
        # while it is a leaf (hits and recency move only while a sequence holds the block), so
        # its policy key is fixed from the moment it becomes one: `_heap` orders (key, stamp,
        # id) lazily, and an entry whose stamp is no longer the block's is skipped when popped.
        self._leaves: dict[int, int] = {}
        self._heap: list[tuple[tuple, int, int]] = []
        self._evicting = False  # inside evict(): the heap must not be compacted
        self._stamp = 0
        self.evictions_total = 0

    # ---- queries ---------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], cache_salt: str = "") -> list[int]:
        """Block ids of the longest cached prefix of full blocks (tokens verified on each hit).

        A hit must also continue the block matched before it (its parent): a block's KV
        depends on every token before it, so under a hash collision the same tokens after
        another prefix are not a hit. The first block must also be the same tenant's (its
        salt): a collision must not share one tenant's KV with another (the parents carry it
        on from there)."""
        out: list[int] = []
        bs, table, blocks = self.block_size, self._table, self._blocks
        parent = None
        for i, h in enumerate(self.hasher.hashes(token_ids, cache_salt)):
            bid = table.get(h)
            if bid is None:
                break
            b = blocks[bid]
            if (b.parent != parent or b.tokens != tuple(token_ids[i * bs:(i + 1) * bs])
                    or (parent is None and b.cache_salt != cache_salt)):
                break
            out.append(bid)
            parent = bid
        return out

    def blocks_of(self, seq_id: str) -> list[int]:
        """The block table of a live sequence (a copy)."""
        return list(self._seqs[seq_id].blocks)

    def free_blocks(self) -> list[int]:
        """Ids of the free blocks (their KV is written before anything reads it)."""
        return list(self._free)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def evictable_count(self) -> int:
        """Blocks an allocation could take right now (free + unreferenced, unpinned cached)."""
        return self.num_blocks - self._in_use - self._pinned_unreferenced()

    def _pinned_unreferenced(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        expired = [bid for bid, until in self._pins.items() if until <= now]
        for bid in expired:
            del self._pins[bid]
        return sum(1 for bid in self._pins if self._blocks[bid].ref == 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self, now: float | None = None) -> PoolStats:
        """Blocks by state (O(pinned blocks), cheap enough for every engine step)."""
        pinned = self._pinned_unreferenced(now)
        free = len(self._free)
        cached = self.num_blocks - self._in_use - pinned - free
        return PoolStats(self.num_blocks, free, cached, pinned, self._in_use)

    def _recount(self, now: float | None = None) -> PoolStats:
        now = self.clock() if now is None else now
        in_use = pinned = cached = 0
        for b in self._blocks:
            if b.ref > 0:
                in_use += 1
            elif b.pin_until > now:
                pinned += 1
            elif b.hash is not None:
                cached += 1
        free = self.num_blocks - in_use - pinned - cached
        return PoolStats(self.num_blocks, free, cached, pinned, in_use)

    # ---- sequences -------------------------------------------------------------------------

    def open(self, seq_id: str, token_ids: Sequence[int], cache_salt: str = "",
             use_cache: bool = True, keep_uncached: int = 1) -> Admission:
        """Start a sequence: reference its longest cached prefix and allocate the rest.

        Args:
            seq_id: unique id of the sequence.
            token_ids: prompt tokens (the KV of all but the last `keep_uncached` is wanted).
            cache_salt: tenant salt (seeds the hash chain).
            use_cache: False = reuse nothing (the sequence's own blocks are still committed).
            keep_uncached: leave at least this many trailing tokens to compute, so there are
                logits to sample from (0 for pure prefill).
        Returns:
            Admission(cached_tokens, copies). When the reused prefix reaches into the block that
            holds a token to recompute, that block is copied first (copy-on-write): the sequence
            never writes into a block other sequences read. If the pool cannot hold the source
            and its copy at once, the source is given up and that block recomputed instead.
        Raises:
            PoolExhausted: not enough blocks even after eviction. The sequence is not opened
                and holds nothing; cached blocks evicted while trying stay evicted (a
                pinned or referenced block below them can leave their parents unfreeable,
                which only eviction finds out).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already open")
        bs = self.block_size
        n = len(token_ids)
        matched = self.match(token_ids, cache_salt) if use_cache else []
        cached_tokens = min(len(matched) * bs, max(0, n - keep_uncached))
        shared = matched[: cached_tokens // bs]
        cow_src = matched[len(shared)] if cached_tokens % bs else None
        need = self.blocks_needed(max(n, 1)) - len(shared)
        while True:
            # Referencing the shared blocks first keeps eviction from taking them for the new
            # ones.
            held = matched[: len(shared) + (cow_src is not None)]
            for bid in held:
                self._ref(bid)
            try:
                new = self._allocate(need)
                break
            except PoolExhausted:
                for bid in held:
                    self._unref(bid)
                if cow_src is None:
                    raise
                # The copy-on-write source is held while its copy is allocated: one block more
                # than computing that block afresh, which can fail a prompt that fills the
                # pool. Give the source up (it may be evicted for the copy) and recompute it.
                cached_tokens, cow_src = len(shared) * bs, None
        now = self.clock()
        for bid in shared:
            b = self._blocks[bid]
            b.hits += 1
            b.last_access = now
        copies: list[tuple[int, int]] = []
        if cow_src is not None:
            copies.append((cow_src, new[0]))
            # A use like the shared blocks' (LFU counts the hit, LRU the time): the copied
            # block is a new one, so close() never touches the source, and a regenerated deep
            # prompt's last block kept its old recency and was evicted first.
            self._blocks[cow_src].hits += 1
            self._blocks[cow_src].last_access = now
            self._unref(cow_src)
        self._seqs[seq_id] = _Table(blocks=shared + new, committed=len(shared),
                                    cache_salt=cache_salt)
        return Admission(cached_tokens, copies)

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> None:
        """Grow the sequence's table to hold `num_tokens` tokens.

        Raises:
            PoolExhausted: not enough blocks even after eviction (the table is unchanged).
        """
        t = self._seqs[seq_id]
        need = self.blocks_needed(num_tokens) - len(t.blocks)
        if need > 0:
            t.blocks.extend(self._allocate(need))

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> list[int]:
        """Enter the sequence's full, computed blocks in the hash table.

        Args:
            token_ids: the sequence's tokens from the start.
            num_computed: tokens whose KV the engine has written into the blocks.
        Returns:
            Block ids that were replaced by an identical block already in the table (their
            contents were duplicates; the table now references the existing block instead).
        """
        t = self._seqs[seq_id]
        bs = self.block_size
        full = min(num_computed, len(token_ids)) // bs
        if full <= t.committed:
            return []
        parent_hash = self._blocks[t.blocks[t.committed - 1]].hash if t.committed else None
        hashes = self.hasher.hashes(token_ids[t.committed * bs: full * bs], t.cache_salt,
                                    parent=parent_hash)
        first_hash = (self._blocks[t.blocks[0]].hash if t.committed
                      else hashes[0])
        now = self.clock()
        replaced: list[int] = []
        stored_hashes: list[bytes] = []
        stored_start = t.committed
        for i, h in enumerate(hashes):
            idx = t.committed + i
            bid = t.blocks[idx]
            toks = tuple(token_ids[idx * bs:(idx + 1) * bs])
            existing = self._table.get(h)
            parent = t.blocks[idx - 1] if idx else None
            if (existing is not None and existing != bid and self._blocks[existing].tokens == toks
                    and self._blocks[existing].parent == parent
                    and (idx or self._blocks[existing].cache_salt == t.cache_salt)):
                # Someone committed the same block first: share theirs, drop our duplicate.
                # (Same tokens after the same parent, a first block of the same tenant: a
                # colliding hash is never shared.)
                self._ref(existing)
                self._blocks[existing].last_access = now
                t.blocks[idx] = existing
                self._unref(bid)
                replaced.append(bid)
                if stored_hashes:
                    self._emit_stored(t, stored_start, stored_hashes, token_ids, first_hash)
                stored_hashes = []
                stored_start = idx + 1
                continue
            b = self._blocks[bid]
            assert b.hash is None and b.ref >= 1
            b.hash, b.tokens, b.parent = h, toks, parent
            b.start_token, b.cache_salt, b.first_hash = idx * bs, t.cache_salt, first_hash
            b.last_access = now
            if parent is not None:
                self._blocks[parent].children += 1
                self._leaves.pop(parent, None)
            if existing is None:  # a colliding hash with other tokens stays out of the table
                self._table[h] = bid
            stored_hashes.append(h)
        if stored_hashes:
            self._emit_stored(t, stored_start, stored_hashes, token_ids, first_hash)
        t.committed = full
        return replaced

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Drop the sequence's blocks beyond `num_tokens` (rollback of rejected draft tokens).

        Committed blocks are kept: they only ever hold verified tokens.
        """
        t = self._seqs[seq_id]
        keep = max(self.blocks_needed(num_tokens), t.committed)
        while len(t.blocks) > keep:
            self._unref(t.blocks.pop())

    def close(self, seq_id: str) -> None:
        """End a sequence: release its blocks, tails first (committed ones stay cached)."""
        t = self._seqs.pop(seq_id, None)
        if t is None:
            return
        now = self.clock()
        for bid in reversed(t.blocks):
            self._blocks[bid].last_access = now
            self._unref(bid)

    # ---- pins ------------------------------------------------------------------------------

    def pin(self, block_ids: Sequence[int], ttl_seconds: float) -> int:
        """Keep committed blocks from eviction until now + ttl (extends, never shortens).

        `block_ids` is a prompt's chain, first block first. When the pin limits leave room for
        only part of it, its leading blocks are pinned (a prefix hit needs the start of a
        chain, and a pinned block keeps its parents anyway) and the rest stay cached, unpinned.
        Blocks pinned already (a refresh) count once. Returns the blocks pinned or refreshed.

        Raises:
            PoolExhausted: none of them could be pinned: the pins already hold `max_pinned`
                blocks, or `max_pinned_per_salt` of the first new block's cache salt.
        """
        now = self.clock()
        self._pinned_unreferenced(now)  # forget expired pins
        room = self.max_pinned - len(self._pins)
        salt_room: dict[str, int] = {}
        until = now + ttl_seconds
        chosen: list[int] = []
        refused = ""
        for bid in dict.fromkeys(block_ids):  # in order, once each
            b = self._blocks[bid]
            if b.hash is None:
                continue
            if bid not in self._pins:
                salt = b.cache_salt
                if salt not in salt_room:
                    held = sum(1 for p in self._pins if self._blocks[p].cache_salt == salt)
                    salt_room[salt] = self.max_pinned_per_salt - held
                if room <= 0:
                    refused = (f"pins hold {len(self._pins)} blocks, the limit of "
                               f"{self.max_pinned} (max_pinned_fraction)")
                    break
                if salt_room[salt] <= 0:
                    refused = ("pins of this tenant (its cache salt) hold "
                               f"{self.max_pinned_per_salt - salt_room[salt]} blocks, the limit "
                               f"of {self.max_pinned_per_salt} (max_pinned_per_tenant_fraction)")
                    break
                room -= 1
                salt_room[salt] -= 1
            chosen.append(bid)
        if not chosen and refused:
            raise PoolExhausted(refused)
        for bid in chosen:
            b = self._blocks[bid]
            b.pin_until = max(b.pin_until, until)
            self._pins[bid] = b.pin_until
        return len(chosen)

    def release_pins(self, blocks: int | None = None) -> int:
        """Unpin unreferenced pinned blocks (they stay cached, now evictable): every one, or
        `blocks` of them, the deepest first (chain tails: the starts of prompts, which prefix
        hits need, stay pinned longest; a chain's child goes before its parent, so what is
        unpinned can be evicted). Returns how many. Pins are advice for warm-up: a request
        that fits the pool must not fail because of them, and one block of pressure must not
        drop every tenant's pins."""
        now = self.clock()
        released = [bid for bid, until in self._pins.items()
                    if until > now and self._blocks[bid].ref == 0]
        if blocks is not None:
            released.sort(key=lambda bid: (-self._blocks[bid].start_token,
                                           self._blocks[bid].pin_until))
            released = released[:max(0, blocks)]
        for bid in released:
            self._blocks[bid].pin_until = 0.0
            del self._pins[bid]
        return len(released)

    def is_pinned(self, block_id: int) -> bool:
        return self._blocks[block_id].pin_until > self.clock()

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref

    def block_hash(self, block_id: int) -> bytes | None:
        return self._blocks[block_id].hash

    # ---- eviction --------------------------------------------------------------------------

    def eviction_order(self) -> list[int]:
        """Current candidates (unreferenced, unpinned, committed leaves) in eviction order."""
        now = self.clock()
        cands = {bid: self._usage(self._blocks[bid]) for bid in self._leaves
                 if self._blocks[bid].pin_until <= now}
        return self.policy.order(cands)

    def evict(self, n: int) -> list[int]:
        """Evict up to `n` blocks, leaves first in policy order; returns their ids.

        Pops the lowest-key leaf each time (O(log leaves)); a parent exposed by an eviction
        becomes a candidate at once, ranked by its own key. Pinned leaves are set aside and
        pushed back afterwards.
        """
        now = self.clock()
        out: list[int] = []
        removed: list[bytes] = []
        pinned: list[tuple[tuple, int, int]] = []
        heap, leaves = self._heap, self._leaves
        # Parents exposed below are pushed onto `heap`: it must stay the heap until the end
        # (a compaction in between would leave them on a list this loop no longer reads).
        self._evicting = True
        try:
            while len(out) < n and heap:
                entry = heapq.heappop(heap)
                _, stamp, bid = entry
                if leaves.get(bid) != stamp:
                    continue  # stale: no longer a leaf, or re-entered with a newer key
                if self._blocks[bid].pin_until > now:
                    pinned.append(entry)
                    continue
                removed.append(self._drop_hash(bid))
                self._free.append(bid)
                out.append(bid)
            for entry in pinned:
                heapq.heappush(heap, entry)
        finally:
            self._evicting = False
        self._maybe_compact_heap()
        if removed:
            self.evictions_total += len(removed)
            self._emit(BlocksRemoved(removed))
        return out

    def clear(self) -> int:
        """Drop every unreferenced, unpinned cached block (AllCleared if the table empties)."""
        now = self.clock()
        _, removed = self._drop_deepest_first(
            bid for bid, b in enumerate(self._blocks) if self._evictable(b, now))
        if not self._table:
            self._emit(AllCleared())
        elif removed:
            self._emit(BlocksRemoved(removed))
        return len(removed)

    def flush_salt(self, cache_salt: str) -> Flushed:
        """Drops every unreferenced cached block of one cache salt (one tenant's: the salt
        seeds each of its chains, and every block of a chain carries it), its pinned ones
        too: erasure on request, where they otherwise stayed until evicted. Children before
        parents, each removal reported (BlocksRemoved) for the prefix index. Blocks a running
        sequence holds stay, as does a parent of one (their KV is being read: dropped under a
        reader, the next request would find a hash without its block). Returns the dropped
        block ids (the engine zeroes their KV) and `kept`: that tenant's blocks still hashed
        (a later call drops them once their requests end)."""
        mine = [bid for bid, b in enumerate(self._blocks)
                if b.hash is not None and b.cache_salt == cache_salt]
        dropped, removed = self._drop_deepest_first(mine)  # pinned too: _drop_hash unpins
        if removed:
            self._emit(BlocksRemoved(removed))
        return Flushed(dropped, len(mine) - len(dropped))

    def _drop_deepest_first(self, bids) -> tuple[list[int], list[bytes]]:
        """Drops each of `bids` no sequence holds and no child hangs from, children before
        parents (deepest first: a parent whose children all go is dropped too), freeing its
        block. Returns their ids and their hashes (for BlocksRemoved)."""
        dropped, removed = [], []
        for bid in sorted(bids, key=lambda i: -self._blocks[i].start_token):
            b = self._blocks[bid]
            if b.ref == 0 and b.children == 0:
                removed.append(self._drop_hash(bid))
                dropped.append(bid)
                self._free.append(bid)
        return dropped, removed

    # ---- events ----------------------------------------------------------------------------

    def _emit(self, ev: PoolEvent) -> None:
        if self.record_events:
            self._events.append(ev)

    def take_events(self) -> list[PoolEvent]:
        """Events since the last call, in order."""
        out, self._events = self._events, []
        return out

    def holdings(self) -> list[BlocksStored]:
        """Every committed block as stored events (parents before children), for a resync."""
        out = []
        for bid in sorted(self._table.values(), key=lambda i: self._blocks[i].start_token):
            b = self._blocks[bid]
            parent = self._blocks[b.parent].hash if b.parent is not None else None
            out.append(BlocksStored(parent, [b.hash], list(b.tokens), b.cache_salt, b.first_hash,
                                    b.start_token // self.block_size))
        return out

    # ---- integrity -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant holds.

        free + cached + pinned + in_use == total; each ref count equals the number of live
        sequence tables holding the block; hash table <-> blocks agree; free queue == the
        unhashed, unreferenced blocks; child counts match; committed blocks are hashed.
        """
        now = self.clock()  # one instant for both counts: a pin may expire in between
        s = self.stats(now)
        recount = self._recount(now)
        assert s == recount, f"incremental counts {s} != recount {recount}"
        holders = [0] * self.num_blocks
        for t in self._seqs.values():
            assert len(set(t.blocks)) == len(t.blocks), "a table lists a block twice"
            assert t.committed <= len(t.blocks)
            for i, bid in enumerate(t.blocks):
                holders[bid] += 1
                if i < t.committed:
                    assert self._blocks[bid].hash is not None, f"committed block {bid} unhashed"
        children = [0] * self.num_blocks
        for bid, b in enumerate(self._blocks):
            assert b.ref == holders[bid], f"block {bid}: ref {b.ref} != holders {holders[bid]}"
            if b.hash is not None and b.parent is not None:
                children[b.parent] += 1
                assert self._blocks[b.parent].hash is not None, f"block {bid}: parent unhashed"
        leaves = {bid for bid, b in enumerate(self._blocks)
                  if b.hash is not None and b.ref == 0 and children[bid] == 0}
        assert self._leaves.keys() == leaves, f"leaf set {set(self._leaves)} != {leaves}"
        live = {(bid, stamp) for _, stamp, bid in self._heap}
        assert all((bid, stamp) in live for bid, stamp in self._leaves.items()), \
            "a leaf has no current entry in the eviction heap"
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "free queue lists a block twice"
        for bid, b in enumerate(self._blocks):
            assert b.children == children[bid], f"block {bid}: children {b.children}"
            in_free = bid in free_set
            assert in_free == (b.ref == 0 and b.hash is None), f"block {bid}: free queue wrong"
            if b.hash is not None and self._table.get(b.hash) not in (bid, None):
                # A duplicate must not be shadowed silently: only a hash collision (other
                # tokens, the same ones after another parent or as another tenant's first
                # block) keeps a block out of the table.
                other = self._blocks[self._table[b.hash]]
                assert (other.tokens != b.tokens or other.parent != b.parent
                        or (b.parent is None and other.cache_salt != b.cache_salt))
        for h, bid in self._table.items():
            assert self._blocks[bid].hash == h, f"table entry for block {bid} is stale"

    # ---- internals -------------------------------------------------------------------------

    def _usage(self, b: _Block) -> BlockUsage:
        return BlockUsage(b.start_token, b.hits, b.last_access)

    @staticmethod
    def _evictable(b: _Block, now: float) -> bool:
        return b.ref == 0 and b.hash is not None and b.pin_until <= now

    def _allocate(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if len(self._free) < n:
            have = self.evictable_count()
            if have < n:
                raise PoolExhausted(f"need {n} blocks, {have} available", short=n - have)
            self.evict(n - len(self._free))
            if len(self._free) < n:  # pinned/referenced parents can block leaves-first eviction
                raise PoolExhausted(f"need {n} blocks, {len(self._free)} could be freed",
                                    short=n - len(self._free))
        out = [self._free.popleft() for _ in range(n)]
        for bid in out:
            self._blocks[bid].ref = 1
            self._blocks[bid].last_access = self.clock()
        self._in_use += n
        return out

    def _ref(self, bid: int) -> None:
        b = self._blocks[bid]
        if b.ref == 0:
            self._in_use += 1
            self._leaves.pop(bid, None)
            if b.hash is None:
                self._free.remove(bid)
        b.ref += 1

    def _unref(self, bid: int) -> None:
        b = self._blocks[bid]
        assert b.ref > 0, f"block {bid} released too often"
        b.ref -= 1
        if b.ref == 0:
            self._in_use -= 1
            if b.hash is not None and b.children == 0:
                self._add_leaf(bid)
        if b.ref == 0 and b.hash is None:
            self._reset(bid)
            self._free.append(bid)

    def _add_leaf(self, bid: int) -> None:
        self._stamp += 1
        self._leaves[bid] = self._stamp
        heapq.heappush(self._heap,
                       (self.policy.key(self._usage(self._blocks[bid])), self._stamp, bid))
        # Only pushes grow the heap, so this (and the end of evict) is where stale entries
        # are compacted.
        if not self._evicting:
            self._maybe_compact_heap()

    def _maybe_compact_heap(self) -> None:
        if len(self._heap) > 4 * len(self._leaves) + 4096:
            self._rebuild_heap()  # many stale entries (leaves referenced again): compact

    def _rebuild_heap(self) -> None:
        key, blocks = self.policy.key, self._blocks
        self._heap = [(key(self._usage(blocks[bid])), stamp, bid)
                      for bid, stamp in self._leaves.items()]
        heapq.heapify(self._heap)

    def _drop_hash(self, bid: int) -> bytes:
        b = self._blocks[bid]
        h = b.hash
        assert h is not None and b.children == 0 and b.ref == 0
        if self._table.get(h) == bid:
            del self._table[h]
        if b.parent is not None:
            p = self._blocks[b.parent]
            p.children -= 1
            if p.children == 0 and p.ref == 0 and p.hash is not None:
                self._add_leaf(b.parent)
        self._reset(bid)
        return h

    def _reset(self, bid: int) -> None:
        b = self._blocks[bid]
        self._pins.pop(bid, None)
        self._leaves.pop(bid, None)
        b.hash, b.tokens, b.parent, b.children = None, (), None, 0
        b.start_token, b.cache_salt, b.first_hash, b.hits, b.pin_until = 0, "", b"", 0, 0.0

    def _emit_stored(self, t: _Table, start: int, hashes: list[bytes], token_ids: Sequence[int],
                     first_hash: bytes) -> None:
        if not self.record_events:
            return
        bs = self.block_size
        parent = self._blocks[t.blocks[start - 1]].hash if start else None
        toks = list(token_ids[start * bs:(start + len(hashes)) * bs])
        self._events.append(BlocksStored(parent, list(hashes), toks, t.cache_salt, first_hash,
                                         start))
