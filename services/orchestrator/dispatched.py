"""What this orchestrator has just sent where, for routing before the prefix index knows it.

The prefix index learns a prompt's blocks when the replica has computed and published them:
for a long prompt that is seconds after dispatch (a 1,000-token prefill takes ~3 s on a CPU,
longer behind a queue). Requests sharing that prompt that arrive in between would be routed
as if it were new: by session hash, to any replica, each computing the same prompt again and
holding a second copy of it. That is the common case for a burst of requests that open with
one new system prompt.

`DispatchMemory` remembers, per replica, the full-block hashes of the prompts routed there in
the last `ttl_s` seconds, and routing takes, for each replica, the longer of the index's
match and this one. A request credited this way waits behind the earlier one on the same
replica, and kvpool prefills one sequence at a time, so it is admitted after the shared
blocks are committed and reuses them. A stale credit (the replica evicted the blocks, or the
request failed) lasts at most `ttl_s`; a replica that fails is forgotten at once, a tenant
erased is forgotten on each replica that dropped its blocks (each block is kept with the
cache salt it was hashed with), and a request a replica refuses outright (nothing computed
there) takes its own credit back.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple


class Recorded(NamedTuple):
    """What one `DispatchMemory.record` added: the blocks new to the replica, and when (its
    time and its number: two records within one tick of the clock are told apart)."""

    replica_id: str
    at: tuple[float, int]
    added: tuple[bytes, ...]


class DispatchMemory:
    """Block hashes routed to each replica recently. Thread-safe."""

    def __init__(self, block_size: int, ttl_s: float, max_blocks: int = 50_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        if max_blocks <= 0:
            raise ValueError("max_blocks must be > 0")
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks  # over all replicas; the oldest go first
        self.clock = clock
        self._lock = threading.Lock()
        # (replica id, block hash) -> (time recorded, record number), oldest first over every
        # replica: expiry and shedding pop from the front, O(1) a block (a per-replica order
        # made shedding scan every replica for the oldest, under the route lock, once per
        # block). The number: `withdraw` takes a block back only while the refused record is
        # the last that sent it (a time alone matched a later record's within one clock tick).
        self._order: OrderedDict[tuple[str, bytes], tuple[float, int]] = OrderedDict()
        self._records = 0
        # For match: what each replica was sent, each block with its owner (the cache salt of
        # the tenant whose prompt it is: `forget` of one tenant).
        self._by_replica: dict[str, dict[bytes, str]] = {}

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        with self._lock:
            self._expire(self.clock())
            return len(self._order)

    def record(self, replica_id: str, hashes: Sequence[bytes],
               owner: str = "") -> Recorded | None:
        """`replica_id` was sent a prompt whose full blocks hash to `hashes`, salted with
        `owner` (its tenant's cache salt). Returns what this added (for `withdraw`; None when
        nothing was recorded)."""
        if not self.enabled or not hashes:
            return None
        added: list[bytes] = []
        with self._lock:
            now = self.clock()
            self._records += 1
            stamp = (now, self._records)
            blocks = self._by_replica.setdefault(replica_id, {})
            order = self._order
            for h in hashes:
                key = (replica_id, h)
                if key in order:
                    order.move_to_end(key)
                else:
                    blocks[h] = owner
                    added.append(h)
                order[key] = stamp
            self._expire(now)
            while len(order) > self.max_blocks:  # the oldest go, whichever replica's
                self._pop_oldest()
        return Recorded(replica_id, stamp, tuple(added))

    def withdraw(self, rec: Recorded | None) -> None:
        """Take back what `record` added for a request its replica refused without computing
        anything (its own verdict: too big for every pool, a bad field): that replica holds
        nothing of the prompt, and requests sharing it would follow the credit there. Only
        blocks no other request has sent there since (their stamp is still the record's): a
        request sharing them keeps its credit. Blocks that were credited before stay."""
        if rec is None or not rec.added:
            return
        with self._lock:
            blocks = self._by_replica.get(rec.replica_id)
            if blocks is None:
                return
            for h in rec.added:
                key = (rec.replica_id, h)
                if self._order.get(key) == rec.at:
                    del self._order[key]
                    del blocks[h]
            if not blocks:
                del self._by_replica[rec.replica_id]

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Replica id -> prompt tokens in leading blocks of `hashes` sent there recently.

        Block hashes are chained (each covers the whole prefix up to its block), so the
        leading run of known hashes is a shared prefix."""
        if not self.enabled or not hashes:
            return {}
        out: dict[str, int] = {}
        with self._lock:
            self._expire(self.clock())
            for rid, blocks in self._by_replica.items():
                n = 0
                for h in hashes:
                    if h not in blocks:
                        break
                    n += 1
                if n:
                    out[rid] = n * self.block_size
        return out

    def merged(self, matches: Mapping[str, int], hashes: Sequence[bytes]) -> dict[str, int]:
        """The index's `matches` with each replica raised to what was sent there recently."""
        out = dict(matches)
        for rid, tokens in self.match(hashes).items():
            if tokens > out.get(rid, 0):
                out[rid] = tokens
        return out

    def forget(self, replica_id: str, owner: str | None = None) -> None:
        """Drop everything sent to `replica_id` (it failed: its work may be lost), or with
        `owner` only the blocks of that cache salt (its tenant's blocks were flushed there:
        the other tenants' stay, and so does their credit)."""
        with self._lock:
            blocks = self._by_replica.get(replica_id)
            if blocks is None:
                return
            for h in [h for h, o in blocks.items() if owner is None or o == owner]:
                del blocks[h]
                del self._order[(replica_id, h)]
            if not blocks:
                del self._by_replica[replica_id]

    def _pop_oldest(self) -> None:
        (rid, h), _ = self._order.popitem(last=False)
        blocks = self._by_replica[rid]
        del blocks[h]
        if not blocks:
            del self._by_replica[rid]

    def _expire(self, now: float) -> None:
        cutoff = now - self.ttl_s
        order = self._order
        while order and next(iter(order.values()))[0] <= cutoff:
            self._pop_oldest()
