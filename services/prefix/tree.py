"""Radix tree of KV blocks plus a hash table from chained block hash to node (pure logic).

    roots (one per model_id + cache_salt, keyed by h_0)
      └─ block 1 ── block 2 ── block 3        a node per block; `table[h_i] -> node`
                       └──── block 3'         branches where prompts diverge

Each node keeps its block's tokens (compactly: a slice of one uint16/uint32 array shared by the
blocks stored together), its parent, its children, the set of replicas holding it (a bitmask of
replica slots), a hit counter and the logical time of its last hit.

Holder closure: a replica that holds a node holds every ancestor of it. Stores that would break
this are dropped (a block is useless without its parent: a match must be contiguous), removals
take the replica off the whole subtree. Two consequences carry the speed of `match`:
  * presence along a request's chain is monotone, so the deepest known block is found by binary
    search (~log2(n) table lookups instead of n), and
  * holder masks shrink monotonically along the chain, so each replica's matched length is found
    by bisecting only where the mask changes.
Likewise every node has at least one holder: a node nobody holds is deleted with its subtree.

Hits are counted where a match *ends* (the deepest matched block). When a leaf is pruned, its
hits and recency fold into its parent, so a leaf's counters always describe its whole subtree's
traffic — exactly what leaves-first eviction needs.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from services.common.policy import BlockUsage, EvictionPolicy

_LITTLE = sys.byteorder == "little" and array("H").itemsize == 2 and array("I").itemsize == 4


class _Chunk(array):
    """Tokens of consecutive new blocks stored in one event; `start` = depth of the first."""

    __slots__ = ("start",)


class Root:
    """The virtual block 0 of one (model_id, cache_salt) chain; never matched itself."""

    __slots__ = ("key", "model_id", "cache_salt", "kids")

    def __init__(self, key: bytes, model_id: str, cache_salt: str) -> None:
        self.key = key
        self.model_id = model_id
        self.cache_salt = cache_salt
        self.kids: set[Node] = set()


class Node:
    """One block. `kids` is None (leaf), one Node, or a set of Nodes (memory: most have 0-1)."""

    __slots__ = ("key", "parent", "kids", "tok", "idx", "holders", "hits", "last")

    def __init__(self, key: bytes, parent: Node | Root, tok: _Chunk, idx: int, holders: int,
                 last: int) -> None:
        self.key = key
        self.parent = parent
        self.kids: Node | set[Node] | None = None
        self.tok = tok
        self.idx = idx
        self.holders = holders
        self.hits = 0
        self.last = last

    @property
    def depth(self) -> int:
        """0-based block position in its chain."""
        return self.tok.start + self.idx


def _kids(x: Node | Root) -> Iterator[Node]:
    k = x.kids
    if k is None:
        return iter(())
    if isinstance(k, Node):
        return iter((k,))
    return iter(tuple(k))


def _add_kid(parent: Node | Root, node: Node) -> None:
    k = parent.kids
    if isinstance(parent, Root) or isinstance(k, set):
        k.add(node)  # type: ignore[union-attr]
    elif k is None:
        parent.kids = node
    else:
        parent.kids = {k, node}


def _del_kid(parent: Node | Root, node: Node) -> None:
    k = parent.kids
    if isinstance(k, set):
        k.discard(node)
        if isinstance(parent, Node) and len(k) <= 1:
            parent.kids = next(iter(k)) if k else None
    elif k is node:
        parent.kids = None


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


class BlockTree:
    """The tree and its table. Not thread-safe: the owner serialises calls."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        self._table: dict[bytes, Node] = {}
        self._roots: dict[bytes, Root] = {}
        self.held = [0] * 64  # blocks held per replica slot
        self.pruned_total = 0

    def __len__(self) -> int:
        return len(self._table)

    def get(self, key: bytes) -> Node | None:
        return self._table.get(key)

    def is_known(self, key: bytes) -> bool:
        """True if `key` is a node or a root."""
        return key in self._table or key in self._roots

    def ensure_root(self, key: bytes, model_id: str, cache_salt: str) -> None:
        if key not in self._roots:
            self._roots[key] = Root(key, model_id, cache_salt)

    def gc_root(self, key: bytes) -> None:
        """Forget root `key` if no block hangs under it."""
        root = self._roots.get(key)
        if root is not None and not root.kids:
            del self._roots[key]

    def root_of(self, node: Node) -> Root:
        p: Node | Root = node
        while isinstance(p, Node):
            p = p.parent
        return p

    def tokens(self, node: Node) -> list[int]:
        """Token ids of the whole prefix ending at `node`."""
        parts = []
        bs = self.block_size
        p: Node | Root = node
        while isinstance(p, Node):
            parts.append(p.tok[p.idx * bs : (p.idx + 1) * bs])
            p = p.parent
        out: list[int] = []
        for a in reversed(parts):
            out.extend(a)
        return out

    # -- stores and removals ---------------------------------------------------------------

    def store(self, parent_key: bytes, hashes: Sequence[bytes], token_ids: Sequence[int],
              bit: int, clock: int) -> StoreResult:
        """Record that replica slot `bit` holds the chain `hashes` continuing `parent_key`.

        Args:
            parent_key: a root key (h_0) or the hash of a known block.
            hashes: block hashes in chain order; `token_ids` holds their tokens, concatenated.
        """
        par: Node | Root | None = self._table.get(parent_key) or self._roots.get(parent_key)
        if par is None:
            return StoreResult(0, 0, len(hashes))
        mask = 1 << bit
        if isinstance(par, Node) and not par.holders & mask:
            return StoreResult(0, 0, len(hashes))
        table = self._table
        n = len(hashes)
        held = j = 0
        # Known head: the replica now holds it too.
        while j < n:
            node = table.get(hashes[j])
            if node is None:
                break
            if node.parent is not par:
                # Only a hash collision or a replica sending inconsistent chains gets here.
                self.held[bit] += held
                return StoreResult(0, held, n - j)
            if not node.holders & mask:
                node.holders |= mask
                held += 1
            par = node
            j += 1
        # New tail: one node per block, the tokens in shared chunks of up to 256 blocks.
        added = 0
        depth = 0 if isinstance(par, Root) else par.depth + 1
        while j < n:
            chunk = self._new_chunk(token_ids, j, n, depth)
            for idx in range(len(chunk) // self.block_size):
                h = hashes[j]
                if h in table:  # an existing block below a new one: inconsistent chain
                    self.held[bit] += held + added
                    return StoreResult(added, held + added, n - j)
                node = Node(h, par, chunk, idx, mask, clock)
                table[h] = node
                if par.kids is None and par.__class__ is Node:
                    par.kids = node
                else:
                    _add_kid(par, node)
                par = node
                added += 1
                j += 1
            depth += len(chunk) // self.block_size
        self.held[bit] += held + added
        return StoreResult(added, held + added, 0)

    def _new_chunk(self, token_ids: Sequence[int], j: int, n: int, depth: int) -> _Chunk:
        # One array for the rest of the event's blocks (at most 256 so `idx` stays a small int).
        bs = self.block_size
        end = min(n, j + 256)
        part = token_ids[j * bs : end * bs]
        wide = array("I")
        wide.fromlist(part if type(part) is list else list(part))
        if _LITTLE:
            # uint16 halves the bytes whenever the vocabulary fits. Converting through bytes is
            # ~2x faster than array("H", list), which parses every item separately.
            halves = array("H", wide.tobytes())
            high = halves[1::2]
            if high.tobytes() == bytes(2 * len(high)):
                chunk = _Chunk("H", halves[::2])
            else:
                chunk = _Chunk("I", wide)
        else:
            try:
                chunk = _Chunk("H", wide)
            except OverflowError:
                chunk = _Chunk("I", wide)
        chunk.start = depth
        return chunk

    def remove(self, key: bytes, bit: int) -> int:
        """Replica slot `bit` dropped block `key`: it drops the block's whole subtree too.

        Returns the number of blocks the replica stopped holding.
        """
        node = self._table.get(key)
        mask = 1 << bit
        if node is None or not node.holders & mask:
            return 0
        return self._drop_subtree(node, mask, bit)

    def clear(self, bit: int) -> int:
        """Replica slot `bit` holds nothing any more. Returns the blocks it stopped holding."""
        mask = 1 << bit
        n = 0
        for root in list(self._roots.values()):
            for kid in list(root.kids):
                if kid.holders & mask:
                    n += self._drop_subtree(kid, mask, bit)
        return n

    def _drop_subtree(self, top: Node, mask: int, bit: int) -> int:
        n = 0
        stack = [top]
        dead: list[Node] = []
        while stack:
            node = stack.pop()
            node.holders &= ~mask
            n += 1
            if not node.holders:
                dead.append(node)
            stack.extend(k for k in _kids(node) if k.holders & mask)
        self.held[bit] -= n
        # By closure, a node nobody holds has only such descendants: unlink top-down.
        for node in dead:
            if node.key in self._table:
                self._unlink_subtree(node)
        return n

    def _unlink_subtree(self, top: Node) -> None:
        _del_kid(top.parent, top)
        self._gc_root(top.parent)
        stack = [top]
        while stack:
            node = stack.pop()
            del self._table[node.key]
            for b in bits(node.holders):
                self.held[b] -= 1
            stack.extend(_kids(node))

    def _gc_root(self, p: Node | Root) -> None:
        if isinstance(p, Root) and not p.kids:
            del self._roots[p.key]

    # -- queries --------------------------------------------------------------------------

    def match(self, hashes: Sequence[bytes], clock: int) -> list[MatchSegment]:
        """Which replica slots hold how many leading blocks of `hashes`.

        Returns segments, deepest first; slots in no segment hold 0 blocks. The deepest matched
        node is credited with a hit at `clock`.
        """
        n = len(hashes)
        if not n:
            return []
        get = self._table.get
        first = get(hashes[0])
        if first is None:
            return []
        # Binary search for the deepest known block (presence is monotone along the chain).
        lo, lo_node = 1, first
        deep = get(hashes[-1])
        if deep is not None:
            lo, lo_node = n, deep
        else:
            hi = n
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                nd = get(hashes[mid - 1])
                if nd is None:
                    hi = mid
                else:
                    lo, lo_node = mid, nd
        lo_node.hits += 1
        lo_node.last = clock
        out = [MatchSegment(lo_node.holders, lo)]
        if first.holders != lo_node.holders:
            # Masks shrink along the chain; bisect only between positions whose masks differ.
            stack = [(1, first.holders, lo, lo_node.holders)]
            while stack:
                a, ma, b, mb = stack.pop()
                if ma == mb:
                    continue
                if b - a == 1:
                    out.append(MatchSegment(ma & ~mb, a))
                    continue
                m = (a + b) >> 1
                mm = get(hashes[m - 1]).holders  # type: ignore[union-attr]
                stack.append((a, ma, m, mm))
                stack.append((m, mm, b, mb))
            out.sort(key=lambda s: -s.blocks)
        return out

    def top(self, k: int, model_id: str = "", min_hits: int = 1) -> list[Prefix]:
        """The `k` most hit prefixes (where matches ended), hottest first."""
        floor = max(1, min_hits)
        cands = [nd for nd in self._table.values() if nd.hits >= floor]
        cands.sort(key=lambda nd: (-nd.hits, -nd.last))
        out: list[Prefix] = []
        for nd in cands:
            root = self.root_of(nd)
            if model_id and root.model_id != model_id:
                continue
            out.append(Prefix(self.tokens(nd), nd.hits, nd.holders, root.cache_salt,
                              root.model_id, nd.key))
            if len(out) >= k:
                break
        return out

    # -- bounded memory -------------------------------------------------------------------

    def prune(self, target: int, policy: EvictionPolicy, shallow_tokens: int,
              min_deep_hits: int) -> list[bytes]:
        """Evict leaves until at most `target` nodes remain; returns evicted hashes in order.

        Deep leaves hit fewer than `min_deep_hits` times go first, then the policy's order
        (deep LRU before shallow LFU). An evicted leaf's hits and recency fold into its parent,
        which becomes a candidate once it is a leaf.
        """
        bs = self.block_size

        def rank(nd: Node) -> tuple:
            start = nd.depth * bs
            cold = start >= shallow_tokens and nd.hits < min_deep_hits
            return (0 if cold else 1, *policy.key(BlockUsage(start, nd.hits, nd.last)))

        heap = [(rank(nd), i, nd) for i, nd in enumerate(self._table.values()) if nd.kids is None]
        heapq.heapify(heap)
        tie = len(heap)
        evicted: list[bytes] = []
        while len(self._table) > target and heap:
            _, _, nd = heapq.heappop(heap)
            if nd.key not in self._table or nd.kids is not None:
                continue
            parent = nd.parent
            self._unlink_subtree(nd)
            evicted.append(nd.key)
            if isinstance(parent, Node):
                parent.hits += nd.hits
                parent.last = max(parent.last, nd.last)
                if parent.kids is None:
                    tie += 1
                    heapq.heappush(heap, (rank(parent), tie, parent))
        self.pruned_total += len(evicted)
        return evicted

    # -- checks ---------------------------------------------------------------------------

    def nodes(self) -> Iterator[tuple[bytes, Node]]:
        return iter(self._table.items())

    def check_integrity(self) -> None:
        """Raise AssertionError unless tree, table, holders and counters agree."""
        bs = self.block_size
        reach = 0
        held = [0] * 64
        for rkey, root in self._roots.items():
            if root.key != rkey or not root.kids:
                raise AssertionError(f"root {rkey.hex()}: bad key or no children")
            stack = list(root.kids)
            while stack:
                nd = stack.pop()
                reach += 1
                if self._table.get(nd.key) is not nd:
                    raise AssertionError(f"node {nd.key.hex()} reachable but not in the table")
                if not nd.holders:
                    raise AssertionError(f"node {nd.key.hex()} has no holder")
                if len(nd.tok) < (nd.idx + 1) * bs:
                    raise AssertionError(f"node {nd.key.hex()} lacks tokens")
                p = nd.parent
                if isinstance(p, Node):
                    if nd.depth != p.depth + 1:
                        raise AssertionError(f"node {nd.key.hex()}: depth")
                    if nd.holders & ~p.holders:
                        raise AssertionError(f"node {nd.key.hex()}: holder closure broken")
                elif nd.depth != 0:
                    raise AssertionError(f"node {nd.key.hex()}: root child at depth {nd.depth}")
                if isinstance(nd.kids, set) and len(nd.kids) < 2:
                    raise AssertionError(f"node {nd.key.hex()}: kid set of size < 2")
                for b in bits(nd.holders):
                    held[b] += 1
                for kid in _kids(nd):
                    if kid.parent is not nd:
                        raise AssertionError(f"node {kid.key.hex()}: wrong parent")
                    stack.append(kid)
        if reach != len(self._table):
            raise AssertionError(f"{len(self._table) - reach} table entries unreachable")
        if held != self.held:
            raise AssertionError(f"held counts {self.held} != recount {held}")
