"""Radix tree of KV blocks plus a hash table from chained block hash to node (pure logic).

    roots (one per model_id + cache_salt, keyed by h_0)
      └─ block 1 ── block 2 ── block 3        a node per block; `table[h_i] -> slot`
                       └──── block 3'         branches where prompts diverge

Nodes live in a few flat arrays indexed by a slot number: `_nav` (int32 records: up, down,
next and previous sibling, depth), `_use` (uint64 records: holders, a bitmask of replica
slots; hits; last hit), the hash list and the block's tokens (byte planes: plane p holds byte
p of every token; two planes while the vocabulary fits 16 bits, four after). A stored chain of
k new blocks is then k dict entries plus a handful of C-level `extend` calls, not k Python
objects, and a node's fields share a cache line or two; roots take a slot too (depth -1, no
holders). Slots freed by removals and pruning are reused one at a time before the arrays grow.

    slot:        p    s0   s0+1  s0+2           a new chain appended in one go:
    up:          .    s0-p 1     1              up   = s - parent(s)      (0 = no parent)
    down:        s0-p 1    1     0              down = first_kid(s) - s   (0 = no child)
    depth:       d    d+1  d+2   d+3            so the new records are a repeated template,
                                                patched at both ends and in the depth column

Holder closure: a replica that holds a node holds every ancestor of it. Stores that would break
this are dropped (a block is useless without its parent: a match must be contiguous), removals
take the replica off the whole subtree. Two consequences carry the speed of `match`:
  * presence along a request's chain is monotone, so the deepest known block is found by binary
    search (~log2(n) table lookups instead of n), and
  * holder masks shrink monotonically along the chain, so each replica's matched length is found
    by bisecting only where the mask changes.
Likewise every node has at least one holder: a node nobody holds is deleted with its subtree.
The one exception is a replica's whole holdings dropped at once (`clear`: a lapsed lease, a
resync): its slot comes off every node in one vectorised step, and the nodes nobody holds then
stay as *unheld* nodes, invisible to every query (matches, `get`, `top`, `blocks`, `len`), until
`reap` deletes them in bounded steps, deepest first. A store of such a block revives it as a
new node would be made (no hits). Walking a million-block replica's holdings to delete them
took ~2-3.5 s under the owner's lock, every call waiting; taking the slot off takes tens of
milliseconds (`python -m benchmarks.prefix_lapse`).

Hits are counted where a match *ends* (the deepest matched block). When a leaf is pruned, its
hits and recency fold into its parent, so a leaf's counters always describe its whole subtree's
traffic — exactly what leaves-first eviction needs. The owner ages the counts (`decay_hits`:
every node's halved at once), so old traffic weighs less than recent; folded hits age with
their new node, the subtree's sum still being its traffic (give or take the rounding down).
"""

from __future__ import annotations

import heapq
import sys
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from services.common.hashing import token_planes
from services.common.policy import BlockUsage, EvictionPolicy

NIL = -1  # no slot
# `_nav` record: slot s at [_NAV * s + field]; `_use` record: at [_USE * s + field].
_UP, _DOWN, _NEXT, _PREV, _DEPTH, _NAV = 0, 1, 2, 3, 4, 5
_HOLD, _HITS, _LAST, _USE = 0, 1, 2, 3
_CHAIN = array("i", [1, 1, NIL, NIL, 0])  # an inner block of a new chain (depth patched)
_IOTA = array("i", range(1 << 16))  # depths of a new chain are a slice of this
_BIG = sys.byteorder != "little"
_ALL = (1 << 64) - 1
_new = tuple.__new__  # builds a NamedTuple without its Python-level __new__


def bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class StoreResult(NamedTuple):
    added: int  # new nodes
    held: int  # blocks newly held by the replica (new nodes included)
    dropped: int  # blocks ignored: unknown parent, parent not held, or a chain inconsistency


class MatchSegment(NamedTuple):
    holders: int  # replica bitmask
    blocks: int  # leading blocks of the request those replicas hold


class Prefix(NamedTuple):
    """A hot prefix found by `top`."""

    token_ids: list[int]
    hits: int
    holders: int
    cache_salt: str
    model_id: str
    last_block_hash: bytes


class BlockInfo(NamedTuple):
    """A snapshot of one block (for tests and integrity checks; not kept by the tree)."""

    key: bytes
    parent_key: bytes  # the root key h_0 for a first block
    depth: int  # 0-based block position in its chain
    holders: int
    hits: int
    last: int
    token_ids: list[int]  # this block's tokens only
    model_id: str
    cache_salt: str


class BlockTree:
    """The tree and its table. Not thread-safe: the owner serialises calls."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        self._table: dict[bytes, int] = {}  # block hash -> slot
        self._roots: dict[bytes, int] = {}  # h_0 -> slot
        self._meta: dict[int, tuple[str, str]] = {}  # root slot -> (model_id, cache_salt)
        self._key: list[bytes | None] = []  # None = a free slot
        # up: slot - parent slot (0 = none: a root or a free slot); down: first child slot -
        # slot (0 = none); next/prev: sibling slots (NIL = none); depth: -1 for a root.
        self._nav = array("i")
        self._use = array("Q")  # holders, hits, last
        # Slot s's tokens: bytes [s * block_size, (s + 1) * block_size) of each plane; plane p
        # holds byte p (little-endian) of every token. Planes 2 and 3 appear with the first
        # token >= 2**16. (Planes are cheap to cut from packed uint32: one bytes slice each.)
        self._planes = [bytearray(), bytearray()]
        self._free: list[int] = []
        self.held = [0] * 64  # blocks held per replica slot
        self.pruned_total = 0
        # Nodes in the table that nobody holds (left by `clear`), and the slots `reap` will
        # look at, one array per clear, deepest first; `_reap_at` is the place in the first.
        self.unheld = 0
        self._reap: deque[np.ndarray] = deque()
        self._reap_at = 0

    @property
    def slots(self) -> int:
        """Node slots allocated: live nodes, roots and freed slots kept for reuse (the arrays
        never shrink, so memory stays at its peak)."""
        return len(self._key)

    def __len__(self) -> int:
        """Nodes held by some replica (unheld ones waiting for `reap` not counted)."""
        return len(self._table) - self.unheld

    def __contains__(self, key: bytes) -> bool:
        s = self._table.get(key)
        return s is not None and self._use[_USE * s + _HOLD] != 0

    def get(self, key: bytes) -> BlockInfo | None:
        """A snapshot of block `key`, or None (an unheld node is not there)."""
        s = self._table.get(key)
        return None if s is None or not self._use[_USE * s + _HOLD] else self._info(s)

    def is_known(self, key: bytes) -> bool:
        """True if `key` is a (held) node or a root."""
        return key in self or key in self._roots

    def ensure_root(self, key: bytes, model_id: str, cache_salt: str) -> None:
        if key not in self._roots:
            s = self._new_slot(key, NIL, 0, 0, -1, [bytes(self.block_size)] * len(self._planes))
            self._roots[key] = s
            self._meta[s] = (model_id, cache_salt)

    def root_model(self, key: bytes) -> str | None:
        """The model of root `key` (h_0), or None when `key` is not a root."""
        s = self._roots.get(key)
        return None if s is None else self._meta[s][0]

    def holds_root_among(self, keys: set[bytes]) -> bool:
        """Whether any of `keys` is a root's (h_0): a pass over the fewer of the two (the roots
        are one per model and tenant salt; a chain is its blocks)."""
        roots = self._roots
        if len(roots) < len(keys):
            return not keys.isdisjoint(roots)
        return any(k in roots for k in keys)

    def gc_root(self, key: bytes) -> None:
        """Forget root `key` if no block hangs under it."""
        s = self._roots.get(key)
        if s is not None:
            self._gc_root(s)

    def tokens(self, key: bytes) -> list[int]:
        """Token ids of the whole prefix ending at block `key`."""
        return self._prefix_tokens(self._table[key])

    # -- slots ----------------------------------------------------------------------------

    def _parent(self, s: int) -> int:
        d = self._nav[_NAV * s + _UP]
        return s - d if d else NIL

    def _kid(self, s: int) -> int:
        d = self._nav[_NAV * s + _DOWN]
        return s + d if d else NIL

    def _set_kid(self, s: int, k: int) -> None:
        self._nav[_NAV * s + _DOWN] = k - s if k != NIL else 0

    def _depth(self, s: int) -> int:
        return self._nav[_NAV * s + _DEPTH]

    def _holders(self, s: int) -> int:
        return self._use[_USE * s + _HOLD]

    def _new_slot(self, key: bytes, parent: int, holders: int, clock: int, depth: int,
                  tokens: list[bytes]) -> int:
        """One slot, reused if one is free; not linked under its parent.

        `tokens` holds the block's bytes of each token plane (see `_pack`).
        """
        nav = array("i", (0, 0, NIL, NIL, depth))
        use = array("Q", (holders, 0, clock))
        if self._free:
            s = self._free.pop()
            self._key[s] = key
            nav[_UP] = s - parent if parent != NIL else 0
            self._nav[_NAV * s : _NAV * (s + 1)] = nav
            self._use[_USE * s : _USE * (s + 1)] = use
            bs = self.block_size
            for plane, part in zip(self._planes, tokens, strict=True):
                plane[s * bs : (s + 1) * bs] = part
            return s
        s = len(self._key)
        self._key.append(key)
        nav[_UP] = s - parent if parent != NIL else 0
        self._nav += nav
        self._use += use
        for plane, part in zip(self._planes, tokens, strict=True):
            plane += part
        return s

    def _free_slot(self, s: int) -> None:
        self._key[s] = None
        nav = self._nav
        base = _NAV * s
        nav[base + _UP] = nav[base + _DOWN] = 0
        nav[base + _NEXT] = nav[base + _PREV] = NIL
        self._use[_USE * s + _HOLD] = self._use[_USE * s + _HITS] = 0
        self._free.append(s)

    def _link(self, par: int, s: int) -> None:
        """Push `s` in front of `par`'s children."""
        nav = self._nav
        first = self._kid(par)
        nav[_NAV * s + _NEXT] = first
        nav[_NAV * s + _PREV] = NIL
        if first != NIL:
            nav[_NAV * first + _PREV] = s
        self._set_kid(par, s)

    def _unlink(self, s: int) -> None:
        nav = self._nav
        p, n = nav[_NAV * s + _PREV], nav[_NAV * s + _NEXT]
        if p == NIL:
            self._set_kid(self._parent(s), n)
        else:
            nav[_NAV * p + _NEXT] = n
        if n != NIL:
            nav[_NAV * n + _PREV] = p

    def _kids(self, s: int) -> list[int]:
        out = []
        k = self._kid(s)
        nav = self._nav
        while k != NIL:
            out.append(k)
            k = nav[_NAV * k + _NEXT]
        return out

    def _pack(self, part: Sequence[int]) -> list[bytes]:
        """Token planes of `part` (widening the tree's planes if a token needs 32 bits)."""
        planes = self._planes
        out = token_planes(part, len(part), len(planes) == 4)  # in one C call when built
        if len(out) > len(planes):
            size = len(planes[0])
            planes += [bytearray(size), bytearray(size)]  # once: this vocabulary needs 32 bits
        return out

    # -- stores and removals ---------------------------------------------------------------

    def store(self, parent_key: bytes, hashes: Sequence[bytes], token_ids: Sequence[int],
              bit: int, clock: int, touch: bool = True) -> StoreResult:
        """Record that replica slot `bit` holds the chain `hashes` continuing `parent_key`.

        Args:
            parent_key: a root key (h_0) or the hash of a known block.
            hashes: block hashes in chain order; `token_ids` holds their tokens, concatenated.
            touch: the store is a use (known blocks are used at `clock`); off for a resync,
                which restates holdings without using them.
        """
        table = self._table
        n = len(hashes)
        # A root first: a block keyed as a root (h_0, which any replica can compute) stored
        # before that root was made shadowed it, and every chain under it went nowhere.
        par = self._roots.get(parent_key)
        if par is None:
            par = table.get(parent_key)
            if par is None:
                return StoreResult(0, 0, n)
        mask = 1 << bit
        use, nav = self._use, self._nav
        if nav[_NAV * par + _DEPTH] >= 0 and not use[_USE * par + _HOLD] & mask:
            return StoreResult(0, 0, n)
        held = j = 0
        # Known head: the replica now holds it too.
        while j < n:
            s = table.get(hashes[j])
            if s is None:
                break
            if s - nav[_NAV * s + _UP] != par:
                # Only a hash collision or a replica sending inconsistent chains gets here.
                self.held[bit] += held
                return StoreResult(0, held, n - j)
            h = use[_USE * s + _HOLD]
            if not h & mask:
                if not h:
                    # A node a clear left unheld, held again: as a new node would be (no
                    # hits; the owner may give saved hits back).
                    self.unheld -= 1
                    self._drop_stale_queue()
                    use[_USE * s + _LAST] = clock
                use[_USE * s + _HOLD] = h | mask
                held += 1
            if touch:
                # Stored is used: a block another replica held, stored as this one's newest
                # turn, kept its old recency and was pruned first as cold, and the turn after
                # it was dropped for want of its parent.
                use[_USE * s + _LAST] = clock
            par = s
            j += 1
        if j == n:
            self.held[bit] += held
            return StoreResult(0, held, 0)
        # New tail, up to the first hash that is known or repeated (which only an
        # inconsistent chain has).
        bs = self.block_size
        part = token_ids if not j and len(token_ids) == n * bs else token_ids[j * bs : n * bs]
        k = self._add_chain(par, hashes, j, self._pack(part), mask, clock)
        self.held[bit] += held + k
        return _new(StoreResult, (k, held + k, n - j - k))

    def _add_chain(self, par: int, hashes: Sequence[bytes], j: int, tokens: list[bytes],
                   mask: int, clock: int) -> int:
        """Add `hashes[j:]` as a chain of new blocks under slot `par`; returns how many.

        Stops before the first hash already in the table (or repeated). `tokens` holds the
        chain's token planes (see `_pack`).
        """
        table = self._table
        n = len(hashes)
        depth = self._depth(par) + 1 - j  # depth of hashes[i] is depth + i; a root's is -1
        bs = self.block_size
        lo = j
        # Free slots first (after removals or pruning), one at a time.
        while j < n and self._free:
            h = hashes[j]
            if h in table:
                return j - lo
            i = j - lo
            s = self._new_slot(h, par, mask, clock, depth + j,
                               [t[i * bs : (i + 1) * bs] for t in tokens])
            table[h] = s
            if j == lo:
                self._link(par, s)
            else:
                self._set_kid(par, s)  # `par` is the block before: no other child
            par = s
            j += 1
        if j == n:
            return j - lo
        # The rest in bulk: table entries first, then every array grows by one run.
        s0 = len(self._key)
        m = self._claim_slots(hashes[j:] if j else hashes, s0)
        if not m:
            return j - lo
        i = j - lo  # blocks already placed in free slots
        self._key.extend(hashes[j : j + m])
        run = _CHAIN * m
        run[_UP] = s0 - par
        run[_NAV * (m - 1) + _DOWN] = 0
        d0, d1 = depth + j, depth + j + m
        run[_DEPTH::_NAV] = _IOTA[d0:d1] if d1 <= len(_IOTA) else array("i", range(d0, d1))
        first = NIL if i else self._kid(par)  # s0 goes in front of par's children
        run[_NEXT] = first
        self._nav += run
        self._use += array("Q", (mask, 0, clock)) * m
        whole = not i and m * bs == len(tokens[0])
        for plane, t in zip(self._planes, tokens, strict=True):
            plane += t if whole else t[i * bs : (i + m) * bs]
        if first != NIL:
            self._nav[_NAV * first + _PREV] = s0
        self._set_kid(par, s0)
        return i + m

    def _claim_slots(self, hashes: Sequence[bytes], s0: int) -> int:
        """Table entries for `hashes` at slots s0, s0 + 1, ... up to the first hash that is
        known or repeated; returns how many were made."""
        table = self._table
        if table.keys().isdisjoint(hashes):
            # The usual tail, all new: two C-level passes (a probe a hash took ~0.3 us in a
            # Python loop over a big table, most of it the loop).
            size = len(table)
            table.update(zip(hashes, range(s0, s0 + len(hashes)), strict=True))
            if len(table) - size == len(hashes):
                return len(hashes)
            for h in hashes:  # a hash repeated (an inconsistent chain): undone, done below
                table.pop(h, None)
        s = s0
        setdefault = table.setdefault  # answers the existing slot for a known or repeated hash
        for h in hashes:
            if setdefault(h, s) != s:
                break
            s += 1
        return s - s0

    def remove(self, key: bytes, bit: int) -> int:
        """Replica slot `bit` dropped block `key`: it drops the block's whole subtree too.

        Returns the number of blocks the replica stopped holding.
        """
        s = self._table.get(key)
        mask = 1 << bit
        if s is None or not self._holders(s) & mask:
            return 0
        return self._drop_subtree(s, mask, bit)

    def clear(self, bit: int) -> int:
        """Replica slot `bit` holds nothing any more. Returns the blocks it stopped holding."""
        return self._clear(bit, None)

    def clear_saving(self, bit: int) -> dict[bytes, tuple[int, int]]:
        """`clear(bit)`, returning the hits and last use, by key, of the used nodes only slot
        `bit` held (those it leaves unheld; see `restore_usage`), in slot order."""
        saved: dict[bytes, tuple[int, int]] = {}
        self._clear(bit, saved)
        return saved

    def _clear(self, bit: int, saved: dict[bytes, tuple[int, int]] | None) -> int:
        """`clear`: the slot comes off every node in one vectorised step over the usage
        records (~40 ms at a million nodes, noisy; walking the replica's holdings to delete them
        took 2-3.5 s under the owner's lock). The nodes nobody holds then are left unheld,
        queued deepest first for `reap`; with `saved`, the hits of those used go in it."""
        n = self.held[bit]  # counted as they come and go (`check_integrity` recounts)
        if not n:
            return 0
        self._drop_stale_queue()
        mask = np.uint64(1 << bit)
        view = np.frombuffer(self._use, dtype=np.uint64)
        hold = view[_HOLD::_USE]
        dead = np.flatnonzero(hold == mask)  # held by this slot alone
        np.bitwise_and(hold, np.uint64(_ALL ^ (1 << bit)), out=hold)
        self.held[bit] = 0
        if dead.size:
            all_hits = view[_HITS::_USE]
            if saved is not None:
                hits = all_hits[dead]
                used = np.flatnonzero(hits)
                key = self._key
                for s, ht, ls in zip(dead[used].tolist(), hits[used].tolist(),
                                     view[_LAST::_USE][dead[used]].tolist(), strict=True):
                    saved[key[s]] = (ht, ls)  # type: ignore[index]
            # Gone with the holder, as when the node was deleted: stored again, it starts
            # from none (unless the owner gives saved hits back).
            all_hits[dead] = 0
            del all_hits
            # Deepest first: a radix sort of 16-bit keys (~5 ms for a million; a comparison
            # sort of the depths took 30-75 ms), or that comparison sort for a chain past
            # 65,535 blocks (a million tokens): sharing the deepest key, its blocks came in
            # slot order, shallowest first, and `reap` deleted one of them per pass.
            depth = np.frombuffer(self._nav, dtype=np.intc)[_DEPTH::_NAV][dead]
            if depth.max() <= 0xFFFF:
                order = np.argsort((0xFFFF - depth).astype(np.uint16), kind="stable")
            else:
                order = np.argsort(-depth, kind="stable")
            self._reap.append(dead[order])
            del depth
            self.unheld += int(dead.size)
        # The arrays cannot grow while a view of their buffers lives.
        del hold, view
        return n

    def reap(self, budget: int | None = None) -> int:
        """Deletes the unheld nodes `clear` left, looking at up to `budget` queued slots (None:
        all); returns how many unheld nodes remain. Only leaves are deleted (~5 us each), so a
        step's work stays bounded: an unheld node that still has children (its slot reused
        since it was queued, out of depth order) goes to the back of the queue, behind them.
        A slot deleted meanwhile, reused by a held node, or holding a block stored again is
        passed. Once nothing is unheld, what is still queued is dropped (`_drop_stale_queue`:
        a resync restating its holdings revives them all before any reaping)."""
        left = sys.maxsize if budget is None else budget
        q, key, use, nav = self._reap, self._key, self._use, self._nav
        later: list[int] = []
        while q and left > 0 and self.unheld:
            arr, at = q[0], self._reap_at
            chunk = arr[at : at + left].tolist()
            for s in chunk:
                if (key[s] is not None and nav[_NAV * s + _DEPTH] >= 0
                        and not use[_USE * s + _HOLD]):
                    if nav[_NAV * s + _DOWN]:
                        later.append(s)  # its (unheld) children are queued ahead of it
                    else:
                        self._unlink_subtree(s)
            left -= len(chunk)
            self._reap_at = at + len(chunk)
            if self._reap_at >= len(arr):
                q.popleft()
                self._reap_at = 0
        if later:
            q.append(np.array(later, dtype=np.int64))
        self._drop_stale_queue()
        return self.unheld

    def _drop_stale_queue(self) -> None:
        """Once nothing is unheld, every slot still queued for `reap` is stale (deleted,
        revived, or reused since): the queue is dropped rather than kept, one array per
        clear, for good."""
        if not self.unheld:
            self._reap.clear()
            self._reap_at = 0

    def restore_usage(self, usage: dict[bytes, tuple[int, int]], halvings: int = 0
                      ) -> dict[bytes, tuple[int, int]]:
        """Gives nodes stored again (no hits yet) the hits they had before a clear, halved
        `halvings` times (the `decay_hits` since they were saved); last use only moves forward
        (a parent is never older than its children). Returns the entries of `usage` whose
        node is not in the tree (not stored again yet), as they were given."""
        use, table = self._use, self._table
        left: dict[bytes, tuple[int, int]] = {}
        for k, (hits, last) in usage.items():
            s = table.get(k)
            if s is None or not use[_USE * s + _HOLD]:
                left[k] = (hits, last)
            elif not use[_USE * s + _HITS]:
                use[_USE * s + _HITS] = hits >> halvings
                use[_USE * s + _LAST] = max(use[_USE * s + _LAST], last)
        return left

    def decay_hits(self, halvings: int) -> None:
        """Halves every node's hit count `halvings` times (64 or more: zero), in one vectorised
        step over the usage records: ~2.5 ms for a million nodes, against ~0.4 s for a Python
        loop, under the owner's lock. Recency and holders are left alone. A `PruneRun` begun
        before was ranked on the old counts (the owner drops it)."""
        if halvings <= 0 or not self._use:
            return
        view = np.frombuffer(self._use, dtype=np.uint64)
        hits = view[_HITS::_USE]
        if halvings >= 64:
            hits[:] = 0
        else:
            hits >>= halvings
        # The array cannot grow while a view of its buffer lives.
        del hits, view

    def _drop_subtree(self, top: int, mask: int, bit: int) -> int:
        """Takes slot `bit` (`mask`) off `top` and its subtree, deleting the nodes nobody
        holds then (with any unheld ones below them)."""
        use = self._use
        n = 0
        stack = [top]
        dead: list[int] = []
        while stack:
            s = stack.pop()
            h = use[_USE * s + _HOLD] & ~mask
            use[_USE * s + _HOLD] = h
            n += 1
            if not h:
                dead.append(s)
            for k in self._kids(s):
                if use[_USE * k + _HOLD] & mask:
                    stack.append(k)
        self.held[bit] -= n
        self.unheld += len(dead)  # for the moment: `_unlink_subtree` counts them off
        # By closure, a node nobody holds has only such descendants: unlink top-down.
        for s in dead:
            if self._key[s] is not None:
                self._unlink_subtree(s)
        return n

    def _unlink_subtree(self, top: int) -> None:
        par = self._parent(top)
        self._unlink(top)
        key, held = self._key, self.held
        stack = [top]
        while stack:
            s = stack.pop()
            del self._table[key[s]]  # type: ignore[arg-type]
            h = self._holders(s)
            if not h:
                self.unheld -= 1
            for b in bits(h):
                held[b] -= 1
            stack.extend(self._kids(s))
            self._free_slot(s)
        self._gc_root(par)

    def _gc_root(self, s: int) -> None:
        if self._depth(s) < 0 and self._kid(s) == NIL:
            del self._roots[self._key[s]]  # type: ignore[arg-type]
            del self._meta[s]
            self._free_slot(s)

    # -- queries --------------------------------------------------------------------------

    def match(self, hashes: Sequence[bytes], clock: int, model_id: str | None = None,
              credit: bool = True) -> list[MatchSegment]:
        """Which replica slots hold how many leading blocks of `hashes`.

        Returns segments, deepest first; slots in no segment hold 0 blocks. The deepest matched
        node is credited with a hit at `clock` (unless `credit` is False). With `model_id`, a
        chain under another model's root matches nothing. A list that is not one chain of the
        tree (a caller's garbage, or a publisher's chain that skips blocks) never raises: it
        matches up to the first break the binary search probes (each probed node must sit at
        its position's depth under the previous position's node; where the bisect finds a
        gap, parent links are followed instead).
        """
        n = len(hashes)
        if not n:
            return []
        get, nav, use, key = self._table.get, self._nav, self._use, self._key
        first = get(hashes[0])
        if first is None or nav[_NAV * first + _DEPTH] != 0 or not use[_USE * first + _HOLD]:
            return []
        if model_id is not None and self._meta.get(self._parent(first), ("",))[0] != model_id:
            return []  # another model's hashes, asked for under this one
        # With no node unheld (a clear's leftovers, see `reap`), every node in the table is
        # held: the probes below skip that test (~0.2 us of a Match).
        unheld = self.unheld
        def at(i: int) -> int | None:
            """The node of hashes[i] if it sits at depth i under the node of hashes[i-1] (a
            node elsewhere is not part of this chain: a publisher's skip, another model)."""
            s = get(hashes[i])
            if s is None or nav[_NAV * s + _DEPTH] != i or unheld and not use[_USE * s + _HOLD]:
                return None  # (an unheld node is not there: holders shrink along a chain)
            up = nav[_NAV * s + _UP]
            # Its parent is hashes[i-1]'s node: the parent's key read back, not a second table
            # lookup (a depth >= 1 node's parent is a block, keyed in `table` as in `_key`).
            return s if up and key[s - up] == hashes[i - 1] else None

        # Binary search for the deepest known block (presence is monotone along a chain).
        lo, lo_s = 1, first
        deep = at(n - 1) if n > 1 else None
        if deep is not None:
            lo, lo_s = n, deep
        else:
            hi = n
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                s = at(mid - 1)
                if s is None:
                    hi = mid
                else:
                    lo, lo_s = mid, s
        first_h, lo_h = use[_USE * first + _HOLD], use[_USE * lo_s + _HOLD]
        out = [MatchSegment(lo_h, lo)]
        if first_h != lo_h:
            # Masks shrink along the chain; bisect only between positions whose masks differ.
            stack = [(1, first_h, lo, lo_h)]
            while stack:
                a, ma, b, mb = stack.pop()
                if ma == mb:
                    continue
                if b - a == 1:
                    out.append(_new(MatchSegment, (ma & ~mb, a)))
                    continue
                m = (a + b) >> 1
                s = at(m - 1)
                if s is None:
                    return self._match_walk(hashes, first, clock, credit)  # not one chain
                mm = use[_USE * s + _HOLD]
                stack.append((a, ma, m, mm))
                stack.append((m, mm, b, mb))
            out.sort(key=lambda seg: -seg.blocks)
        if credit:
            use[_USE * lo_s + _HITS] += 1
            use[_USE * lo_s + _LAST] = clock
        return out

    def _match_walk(self, hashes: Sequence[bytes], first: int, clock: int, credit: bool
                    ) -> list[MatchSegment]:
        """`match` one block at a time, following parent links: for lists whose blocks are
        not all one chain of the tree, where the binary search's assumption fails."""
        get, use = self._table.get, self._use
        path = [first]
        for h in hashes[1:]:
            s = get(h)
            if s is None or self._parent(s) != path[-1] or not use[_USE * s + _HOLD]:
                break
            path.append(s)
        out: list[MatchSegment] = []
        for i, s in enumerate(path):
            mask = use[_USE * s + _HOLD]
            below = use[_USE * path[i + 1] + _HOLD] if i + 1 < len(path) else 0
            if mask & ~below:
                out.append(_new(MatchSegment, (mask & ~below, i + 1)))
        out.sort(key=lambda seg: -seg.blocks)
        if credit:
            use[_USE * path[-1] + _HITS] += 1
            use[_USE * path[-1] + _LAST] = clock
        return out

    def top(self, k: int, model_id: str = "", min_hits: int = 1,
            cache_salt: str | None = None, max_tokens: int | None = None) -> list[Prefix]:
        """The `k` most hit prefixes (where matches ended), hottest first; only `model_id`'s
        and only under `cache_salt` when given; no more than `max_tokens` tokens in all (the
        list stops before the first prefix past it)."""
        floor = max(1, min_hits)
        use, meta = self._use, self._meta
        # The filter is decided per root (a few per model and tenant), not per node: walking
        # every hit node up to its root took seconds at a million nodes, under the index lock
        # every Match waits for. Only the passing roots' subtrees are visited.
        roots = [r for r, (model, salt) in meta.items()
                 if (not model_id or model == model_id)
                 and (cache_salt is None or salt == cache_salt)]
        slots = (self._table.values() if len(roots) == len(meta)
                 else self._slots_under(roots))
        cands = (s for s in slots if use[_USE * s + _HITS] >= floor and use[_USE * s + _HOLD])
        # A bounded heap, not a sort of every hit node: the caller holds the index's lock.
        best = heapq.nlargest(k, cands, key=lambda s: (use[_USE * s + _HITS],
                                                         use[_USE * s + _LAST]))
        out: list[Prefix] = []
        left = max_tokens
        for s in best:
            if left is not None:
                left -= (self._depth(s) + 1) * self.block_size
                if left < 0:
                    break
            model, salt = meta[self._root_slot(s)]
            out.append(Prefix(self._prefix_tokens(s), use[_USE * s + _HITS], self._holders(s),
                              salt, model, self._key[s]))  # type: ignore[arg-type]
        return out

    def _slots_under(self, roots: list[int]) -> Iterator[int]:
        """Every slot of the subtrees under `roots` (the roots included)."""
        stack = list(roots)
        while stack:
            s = stack.pop()
            yield s
            stack.extend(self._kids(s))

    def _root_slot(self, s: int) -> int:
        nav = self._nav
        while nav[_NAV * s + _DEPTH] >= 0:
            s -= nav[_NAV * s + _UP]
        return s

    def _block_tokens(self, s: int) -> list[int]:
        bs = self.block_size
        raw = bytearray(4 * bs)
        for p, plane in enumerate(self._planes):
            raw[p::4] = plane[s * bs : (s + 1) * bs]
        out = array("I", bytes(raw))
        if _BIG:
            out.byteswap()
        return out.tolist()

    def _prefix_tokens(self, s: int) -> list[int]:
        parts = []
        while self._depth(s) >= 0:
            parts.append(s)
            s = self._parent(s)
        out: list[int] = []
        for p in reversed(parts):
            out.extend(self._block_tokens(p))
        return out

    def _info(self, s: int) -> BlockInfo:
        model, salt = self._meta[self._root_slot(s)]
        return BlockInfo(self._key[s], self._key[self._parent(s)],  # type: ignore[arg-type]
                         self._depth(s), *self._use[_USE * s : _USE * (s + 1)],
                         self._block_tokens(s), model, salt)

    def blocks(self) -> Iterator[BlockInfo]:
        """A snapshot of every (held) block, in table order."""
        use = self._use
        for s in self._table.values():
            if use[_USE * s + _HOLD]:
                yield self._info(s)

    # -- bounded memory -------------------------------------------------------------------

    def prune(self, target: int, policy: EvictionPolicy, shallow_tokens: int,
              min_deep_hits: int, recent_since: int | None = None) -> list[bytes]:
        """Evict leaves until at most `target` nodes remain; returns evicted hashes in order.

        Deep leaves hit fewer than `min_deep_hits` times go first, then the policy's order
        (deep LRU before shallow LFU). An evicted leaf's hits and recency fold into its parent,
        which becomes a candidate once it is a leaf. A leaf used (stored or matched) after the
        clock `recent_since` is not counted cold, whatever its hits: a conversation's newest
        turn has had no chance of a hit yet. All at once: see `pruning` for the same work in
        bounded steps.
        """
        run = self.pruning(target, policy, shallow_tokens, min_deep_hits, recent_since)
        while not run.step(None):
            pass
        return run.evicted

    def pruning(self, target: int, policy: EvictionPolicy, shallow_tokens: int,
                min_deep_hits: int, recent_since: int | None = None) -> PruneRun:
        """`prune` as a run of bounded steps (`PruneRun.step`), so that the owner can let
        other calls in between: ranking every leaf of a million-node tree takes most of a
        second."""
        return PruneRun(self, target, policy, shallow_tokens, min_deep_hits, recent_since)

    # -- checks ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless tree, table, holders, free slots and counters agree."""
        size = len(self._key)
        self._check_slots(size)
        reach, held, unheld = self._check_reachable(size)
        if reach != len(self._table):
            raise AssertionError(f"{len(self._table) - reach} table entries unreachable")
        if held != self.held:
            raise AssertionError(f"held counts {self.held} != recount {held}")
        if unheld != self.unheld:
            raise AssertionError(f"unheld count {self.unheld} != recount {unheld}")
        if unheld:
            self._check_reap_queue()

    def _check_slots(self, size: int) -> None:
        """The record arrays, token planes, free list and roots against the slots."""
        bs = self.block_size
        if len(self._nav) != _NAV * size or len(self._use) != _USE * size:
            raise AssertionError("record arrays out of step with the slots")
        if len(self._planes) not in (2, 4) or any(len(p) != size * bs for p in self._planes):
            raise AssertionError("token planes out of step with the slots")
        free = set(self._free)
        if len(free) != len(self._free) or any(self._key[s] is not None for s in free):
            raise AssertionError("free list repeats a slot or lists a live one")
        if size - len(free) != len(self._table) + len(self._roots):
            raise AssertionError("live slots != nodes + roots")
        if set(self._meta) != set(self._roots.values()):
            raise AssertionError("root metadata and roots disagree")

    def _check_reachable(self, size: int) -> tuple[int, list[int], int]:
        """Walk every root's subtree, checking each node; returns the nodes reached, the
        recount of `held` and of `unheld`."""
        reach = unheld = 0
        held = [0] * 64
        for rkey, r in self._roots.items():
            if (self._key[r] != rkey or self._depth(r) != -1 or self._kid(r) == NIL
                    or self._parent(r) != NIL):
                raise AssertionError(f"root {rkey.hex()}: bad key, depth or no children")
            stack = self._checked_kids(r, size)
            while stack:
                s = stack.pop()
                reach += 1
                h = self._checked_node(s)
                unheld += not h  # left by a clear for `reap` (closure: so is its subtree)
                for b in bits(h):
                    held[b] += 1
                stack.extend(self._checked_kids(s, size))
        return reach, held, unheld

    def _checked_node(self, s: int) -> int:
        """Check reachable slot `s` (table entry, depth, holder closure); returns its holders."""
        key = self._key[s]
        if key is None or self._table.get(key) != s:
            raise AssertionError(f"slot {s} reachable but not in the table")
        h = self._holders(s)
        p = self._parent(s)
        if self._depth(s) != self._depth(p) + 1:
            raise AssertionError(f"node {key.hex()}: depth")
        if self._depth(p) >= 0 and h & ~self._holders(p):
            raise AssertionError(f"node {key.hex()}: holder closure broken")
        return h

    def _check_reap_queue(self) -> None:
        """Every unheld slot is queued ahead for reaping."""
        ahead: set[int] = set()
        for i, arr in enumerate(self._reap):
            ahead.update(arr[self._reap_at if i == 0 else 0 :].tolist())
        for s in self._table.values():
            if not self._use[_USE * s + _HOLD] and s not in ahead:
                raise AssertionError(f"unheld slot {s} is not queued ahead for reaping")

    def _checked_kids(self, s: int, size: int) -> list[int]:
        out = []
        prev, k = NIL, self._kid(s)
        while k != NIL:
            if not 0 <= k < size or self._parent(k) != s or self._nav[_NAV * k + _PREV] != prev:
                raise AssertionError(f"slot {k}: wrong parent or sibling link")
            out.append(k)
            if len(out) > size:
                raise AssertionError(f"slot {s}: cycle in its children")
            prev, k = k, self._nav[_NAV * k + _NEXT]
        return out


EVICT_COST = 20  # PruneRun work units of one eviction (looking at a node: 1)


class PruneRun:
    """One pruning of a `BlockTree` in steps of bounded work (`BlockTree.pruning`).

    The tree may change between steps (stores, removals, matches). A candidate is checked
    when it comes off the heap: a slot freed or reused since it was ranked is skipped, one
    that gained children is skipped, and one whose rank grew (hits or recency, which only
    grow between steps; `decay_hits` lowers every count at once, and the owner drops a run
    begun before it) goes back with its new rank. Leaves added after the run began are not
    candidates of this run; the next run sees them. Two exceptions, both ranked on their use
    now like any candidate (so the order stays the policy's): a slot of the run's snapshot
    freed and reused by a new leaf before the run ranked it (ranking is spread over steps too),
    and one reused by the same block stored again (same key, same slot: the free list gives
    the last slot freed first), which the key check cannot tell from the old one.
    """

    def __init__(self, tree: BlockTree, target: int, policy: EvictionPolicy,
                 shallow_tokens: int, min_deep_hits: int, recent_since: int | None = None
                 ) -> None:
        self.tree = tree
        self.target = target
        self._policy = policy
        self._shallow = shallow_tokens
        self._min_hits = min_deep_hits
        self._recent = recent_since  # leaves used after this clock are not cold (`prune`)
        self._slots = list(tree._table.values())  # ranked in steps
        self._next = 0
        self._heap: list[tuple] = []
        self._tie = len(self._slots)
        self._step = 0  # steps begun; an entry ranked in this one is still current
        self.evicted: list[bytes] = []

    def _rank(self, s: int) -> tuple:
        t = self.tree
        use = t._use
        start = t._depth(s) * t.block_size
        hits = use[_USE * s + _HITS]
        last = use[_USE * s + _LAST]
        cold = (start >= self._shallow and hits < self._min_hits
                and (self._recent is None or last <= self._recent))
        return (0 if cold else 1, *self._policy.key(BlockUsage(start, hits, last)))

    def step(self, budget: int | None) -> bool:
        """Do up to `budget` units of work (None: no bound); True once the run is done.

        A node looked at while ranking costs one unit, an eviction `EVICT_COST` (measured:
        about 0.85 us and 15 us at a million nodes)."""
        t = self.tree
        left = sys.maxsize if budget is None else budget
        self._step += 1
        step = self._step
        slots, key, heap = self._slots, t._key, self._heap
        while self._next < len(slots) and left > 0:
            chunk = slots[self._next : self._next + left]
            self._next += len(chunk)
            left -= len(chunk)
            for i, s in enumerate(chunk, self._next - len(chunk)):
                k = key[s]
                if (k is not None and t._depth(s) >= 0 and t._kid(s) == NIL
                        and t._use[_USE * s + _HOLD]):  # an unheld one is for `reap`
                    heapq.heappush(heap, (self._rank(s), i, s, k, step))
        if self._next < len(slots):
            return False
        self._slots = []  # ranked: let the snapshot go
        use = t._use
        while len(t) > self.target and heap and left > 0:
            r, _, s, k, ranked = heapq.heappop(heap)
            if (key[s] != k or t._depth(s) < 0 or t._kid(s) != NIL
                    or not use[_USE * s + _HOLD]):
                left -= 1
                continue
            if ranked != step:  # other calls ran since: it may have been used
                now = self._rank(s)
                if now != r:
                    self._tie += 1
                    heapq.heappush(heap, (now, self._tie, s, k, step))
                    left -= 1
                    continue
            left -= EVICT_COST
            p = t._parent(s)
            is_node = t._depth(p) >= 0
            self.evicted.append(k)
            h, last = use[_USE * s + _HITS], use[_USE * s + _LAST]
            t._unlink_subtree(s)
            t.pruned_total += 1
            if is_node:
                use[_USE * p + _HITS] += h
                use[_USE * p + _LAST] = max(use[_USE * p + _LAST], last)
                if t._kid(p) == NIL:
                    self._tie += 1
                    heapq.heappush(heap, (self._rank(p), self._tie, p, key[p], step))
        return len(t) <= self.target or not heap
