"""The prefix index: membership with leases, ordered event batches, matches, hot prefixes.

Pure logic (no grpc); the server adapter serialises calls with one lock.

Lifecycle of a replica, in the index's eyes:
  1. Register(replica_id, incarnation, ...) gives it a slot (a bit in every node's holder mask)
     and a lease. A new incarnation of a known id drops everything the old one held.
  2. Heartbeat renews the lease and records load; a lease that lapses removes the replica
     and its holdings.
  3. PublishEvents batches are numbered 1, 2, 3...: the expected one is applied, an old one is
     acknowledged and ignored (a retry), a later one means a batch was lost -> RESYNC, and the
     replica answers with its full holdings in a batch marked `resync`. So does the first
     batch after a registration back from a lapse that carries the numbers on (the view here
     is empty then, whatever the replica believes).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NamedTuple

from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    blank,
    model_id_problem,
    shown,
)
from services.common.hashing import DIGEST_SIZE, BlockHasher, check_salt
from services.common.policy import EvictionPolicy, HybridPolicy
from services.prefix.tree import BlockTree, MatchSegment, PruneRun, bits

log = logging.getLogger(__name__)

MAX_REPLICAS = 64
# Measured by benchmarks/prefix_index.py (tracemalloc); used for the Stats estimate only.
APPROX_BYTES_PER_NODE = 210
# Tokens one TopPrefixes answer carries at most (5 bytes each at worst: 5 MB, well inside the
# 16 MiB message limit); the coldest of the k prefixes are left out past it.
MAX_TOP_TOKENS = 1_000_000
MAX_SEQ_FLOORS = 4096  # lapsed replicas whose next batch number is remembered
# Halvings of the hit counts at most per sweeper turn: a uint64 count is 0 after 64.
MAX_HALVINGS = 64
# Pruning work units (`PruneRun.step`) per slot looked at by `BlockTree.reap`, so that a reaping
# step holds the lock about as long as a pruning step (measured at 200k nodes: a reap of 8,000
# slots ~20 ms, ~2.8 us a slot; a pruning step ranking 8,000 leaves ~3 ms).
REAP_UNITS = 7


def _remember(records: dict, key, value) -> None:
    """`records[key] = value` as its newest entry, the oldest dropped past `MAX_SEQ_FLOORS`:
    what is remembered of replicas gone is bounded (ids come and go with every restart)."""
    records.pop(key, None)
    records[key] = value
    while len(records) > MAX_SEQ_FLOORS:
        del records[next(iter(records))]


class Load(NamedTuple):
    """A replica's load at its last heartbeat."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


class Stored(NamedTuple):
    """Blocks newly cached by a replica: a chain continuing `parent_hash` (b"" = the root)."""

    parent_hash: bytes
    block_hashes: Sequence[bytes]
    token_ids: Sequence[int]
    cache_salt: str = ""
    first_block_hash: bytes = b""
    start_block: int = 0


class Removed(NamedTuple):
    """Blocks a replica evicted."""

    block_hashes: Sequence[bytes]


class Cleared(NamedTuple):
    """The replica dropped every block."""


Event = Stored | Removed | Cleared


class ReplicaMatch(NamedTuple):
    replica_id: str
    address: str
    matched_blocks: int
    matched_tokens: int
    load: Load


@dataclass
class Replica:
    replica_id: str
    incarnation: str
    address: str
    model_id: str
    capacity_blocks: int
    bit: int
    deadline: float
    last_seen: float
    next_seq: int = 1
    load: Load = field(default_factory=Load)
    zero: ReplicaMatch | None = None  # this replica's answer when it holds nothing asked for
    # Hits of the nodes a resync deleted that its first batch did not store again: a
    # snapshot spans many batches, and the rest arrive in the next ones. Given back as those
    # store them, until `usage_until` (one lease after the resync). Also the hits of what a
    # lapse of its lease deleted, when it registers again at once (a late heartbeat).
    usage: dict[bytes, tuple[int, int]] | None = None
    usage_until: float = 0.0
    usage_halvings: int = 0  # the index's `hit_halvings` when `usage` was saved
    # Registered again after a lapse with its batch numbers carried on: its view here is
    # empty, so only a resync may come next (a Register that landed late, after the lapse,
    # would else have later batches applied onto nothing while the replica's heartbeats
    # find it known and it never resends what it holds).
    awaiting_resync: bool = False

    def refresh(self) -> None:
        """Rebuild the cached zero-length answer after address or load changed."""
        self.zero = ReplicaMatch(self.replica_id, self.address, 0, 0, self.load)


class RegisterResult(NamedTuple):
    lease_seconds: float
    next_seq: int


class HeartbeatResult(NamedTuple):
    known: bool
    lease_seconds: float


class PublishResult(NamedTuple):
    resync: bool  # False = applied (or an already applied retry)
    next_seq: int
    applied: bool = True  # False for a retry or an overtaken resync: nothing changed


class MatchResult(NamedTuple):
    matches: list[ReplicaMatch]  # every live replica of the model, longest match first
    request_blocks: int
    block_size: int


class HotPrefix(NamedTuple):
    token_ids: list[int]
    hits: int
    holders: list[str]
    cache_salt: str
    model_id: str
    last_block_hash: bytes


class ReplicaInfo(NamedTuple):
    replica_id: str
    incarnation: str
    address: str
    model_id: str
    held_blocks: int
    load: Load
    last_seen_s: float
    capacity_blocks: int = 0


class IndexStats(NamedTuple):
    nodes: int
    bytes: int
    replicas: list[ReplicaInfo]
    matches_total: int
    matches_hit: int
    match_blocks_total: int
    match_blocks_hit: int
    pruned_total: int
    resyncs_total: int
    block_size: int
    dropped_blocks_total: int
    max_nodes: int
    unheld_nodes: int = 0  # left by a lapse or a resync, not yet reaped (not in `nodes`)


_ONE_DIGEST = {DIGEST_SIZE}

_blocks = itemgetter(2)  # ReplicaMatch.matched_blocks
# A NamedTuple's own constructor runs a Python-level __new__; tuple.__new__ builds the same
# object in C (~4x cheaper), which counts for the up to 64 answers of every Match.
_new = tuple.__new__


def _check_hashes(name: str, hashes: Sequence[bytes]) -> None:
    """Every hash DIGEST_SIZE bytes, or InvalidArgument naming the first that is not."""
    # C-level length checks first, the Python loop only to name a bad one (a total alone
    # would take 15 + 17).
    if set(map(len, hashes)) == _ONE_DIGEST:
        return
    for i, h in enumerate(hashes):
        if len(h) != DIGEST_SIZE:
            raise InvalidArgument(f"{name}[{i}]", f"must be {DIGEST_SIZE} bytes, got {len(h)}")


def _check_id(name: str, value: str) -> None:
    """An id Register and Match take: given, visible, at most 256 characters."""
    if not value:
        raise InvalidArgument(name, "required")
    if blank(value):
        # isprintable() takes the Hangul filler U+3164 (a letter that draws nothing), and
        # model_id is not held to it: an id nobody could see or type was indexed.
        raise InvalidArgument(name, "only whitespace or invisible characters (such as U+200B "
                                    "or U+3164); give a visible id")
    if len(value) > 256:
        raise InvalidArgument(name, "longer than 256 characters")


def _check_model_id(model_id: str) -> None:
    """A model id Register, Match and TopPrefixes take: an id (`_check_id`) without NUL, nor
    any other character that prints as nothing or as a space (errors.model_id_problem)."""
    _check_id("model_id", model_id)
    if "\0" in model_id:
        # Roots hash model and salt with NUL between them (see check_salt).
        raise InvalidArgument("model_id", "must not contain NUL")
    if problem := model_id_problem(model_id):
        raise InvalidArgument("model_id", problem)


def _ranked(reps: Sequence[Replica], segments: list[MatchSegment],
            bs: int) -> list[ReplicaMatch]:
    """A match's answers from the tree's `segments` (longest first): each replica holding one
    with its longest, longest first, then the zero answers of those holding none."""
    hit, zero = [], []
    for rep in reps:
        for holders, blocks in segments:
            if holders >> rep.bit & 1:
                hit.append(_new(ReplicaMatch, (rep.replica_id, rep.address, blocks,
                                               blocks * bs, rep.load)))
                break
        else:
            zero.append(rep.zero)
    # One segment: every holder matched the same length, already in load order.
    if len(segments) > 1 and len(hit) > 1:
        hit.sort(key=_blocks, reverse=True)  # stable: ties stay in load order
    hit += zero
    return hit


class PrefixIndex:
    """Which replica holds which blocks; see the module docstring for the protocol."""

    def __init__(
        self,
        block_size: int = 16,
        *,
        lease_seconds: float = 10.0,
        max_nodes: int = 1_000_000,
        prune_to: float = 0.9,
        prune_step: int = 8000,
        policy: EvictionPolicy | None = None,
        shallow_tokens: int | None = None,
        min_deep_hits: int = 1,
        cold_after_ticks: int = 0,
        max_events: int = 65536,
        max_blocks: int = 65536,
        verify_hashes: bool = False,
        hit_half_life_seconds: float = 0.0,
        hash_key: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        """
        Args:
            max_nodes: node budget; over it the tree is pruned down to `prune_to * max_nodes`,
                `prune_step` units of work per call (Publish or Heartbeat) while it runs.
            policy: eviction order of leaves (default HybridPolicy(128)).
            shallow_tokens: blocks starting before this token are never "deep" for the
                `min_deep_hits` rule (default: the policy's split, else 128).
            min_deep_hits: deep leaves hit fewer times than this are pruned first.
            cold_after_ticks: ...unless used within this many ticks (stores and matches, not
                probes):
                a conversation's newest turn, stored a moment ago, has had no chance of a
                hit; pruned first, its later turns' stores were dropped (unknown parent) and
                the conversation stayed invisible to the index. 0 = no grace.
            max_events / max_blocks: per PublishEvents batch (blocks also bound a Match).
            verify_hashes: recompute the hashes of every new stored block and refuse chains
                that do not match their tokens (~0.6 us per block on the one central index;
                off by default: `hash_probe` at Register catches a key or model mismatch once,
                and a replica that lies about its blocks only misroutes its own requests).
            hit_half_life_seconds: every hit count is halved once per this much time (by
                `sweep`), so that a burst long ago does not outrank steady use today in
                TopPrefixes and LFU pruning. 0 = counts never age.
            wall_clock: with it (the service passes `time.time`), the halvings fall on the
                multiples of the half-life since the Unix epoch, as on every other shard
                (within the hosts' clock skew), not on this process's start: a sharded
                TopPrefixes merges counts of the same age. The first half-life is then
                shorter. Read once, here: halvings then follow `clock`, so a wall clock
                stepped later moves nothing.
        """
        self.block_size = block_size
        self.lease_seconds = lease_seconds
        self.max_nodes = max_nodes
        self.prune_target = max(0, int(max_nodes * prune_to))
        self.policy = policy or HybridPolicy()
        # Where "deep" starts for the cold-leaf rule; the hybrid policy's own split by default.
        # Given apart from the policy: the LRU policy has none, and took every leaf for deep.
        self.shallow_tokens = (getattr(self.policy, "shallow_tokens", 128)
                               if shallow_tokens is None else shallow_tokens)
        self.min_deep_hits = min_deep_hits
        self.cold_after_ticks = cold_after_ticks
        self.max_events = max_events
        self.max_blocks = max_blocks
        self.verify_hashes = verify_hashes
        self.hash_key = hash_key
        self.clock = clock
        # Told the id of each replica whose lease lapsed (under the caller's lock, as every
        # call is): the server forgets its shard list.
        self.on_drop: Callable[[str], None] | None = None
        self.hit_half_life_seconds = hit_half_life_seconds
        self.hit_halvings = 0  # halvings of every hit count so far (an age for saved hits)
        self._decayed_at = clock()  # the end of the last half-life counted
        if wall_clock is not None and hit_half_life_seconds > 0:
            self._decayed_at -= wall_clock() % hit_half_life_seconds
        self.tree = BlockTree(block_size)
        self._replicas: dict[str, Replica] = {}
        self._by_bit: list[Replica | None] = [None] * MAX_REPLICAS
        self._by_model: dict[str, list[Replica]] = {}
        self._hashers: dict[str, BlockHasher] = {}
        self._verifiers: dict[str, BlockHasher] = {}
        self._next_deadline = float("inf")
        # When the lease sweeper last ran (`sweep`); None: no sweeper (leases lapse only as
        # calls come). A gap far past its period is a pause of this process, not of replicas.
        self._swept_at: float | None = None
        self._sweep_period = lease_seconds / 4
        # When a call last entered the index (`_expire`): a call served proves the process ran.
        self._active_at = -math.inf
        self._tick = 0
        self.matches_total = self.matches_hit = 0
        self.match_blocks_total = self.match_blocks_hit = 0
        self.resyncs_total = 0
        self.dropped_blocks_total = 0
        # Where a dropped replica record's batch numbers ended (by replica id: incarnation,
        # next seq): the same incarnation registering again after its lease lapsed continues
        # from there, so a batch delayed from before the lapse can never pass for a new one.
        # (Another incarnation's batches are refused by the incarnation check.)
        self._seq_floor: dict[str, tuple[str, int]] = {}
        # (replica id, incarnation) pairs another incarnation has replaced, bounded, oldest
        # first: a late Register of a dead incarnation (delayed, or waiting on the lock) took
        # the id back, cleared the live one's holdings and sent Match to the old address.
        self._replaced: dict[tuple[str, str], None] = {}
        # The hits of what a lapsed lease deleted (by replica id: incarnation, hits by key,
        # kept until, `hit_halvings` then), given back if the same incarnation registers again
        # within a lease (not counting a pause of this process, as for leases) and stores
        # those blocks again: a late heartbeat lost them all.
        self._lapsed: dict[str, tuple[str, dict[bytes, tuple[int, int]], float, int]] = {}
        self.prune_step = prune_step
        self._prune_run: PruneRun | None = None

    @property
    def replica_count(self) -> int:
        return len(self._replicas)

    def hasher(self, model_id: str) -> BlockHasher:
        h = self._hashers.get(model_id)
        if h is None:
            h = BlockHasher(model_id, self.block_size, self.hash_key)
            if len(self._hashers) < 1024:
                self._hashers[model_id] = h
        return h

    def _verifier(self, model_id: str) -> BlockHasher:
        # No memo: stored blocks are new by definition, a memo would only cost memory.
        h = self._verifiers.get(model_id)
        if h is None:
            h = BlockHasher(model_id, self.block_size, self.hash_key, memo_blocks=0)
            if len(self._verifiers) < 1024:
                self._verifiers[model_id] = h
        return h

    # -- membership -----------------------------------------------------------------------

    def register(self, replica_id: str, incarnation: str, address: str, model_id: str,
                 block_size: int, capacity_blocks: int = 0, hash_probe: bytes = b"",
                 check_address: Callable[[str], str] | None = None) -> RegisterResult:
        """Start (or refresh) a replica's lease.

        Args:
            hash_probe: the replica's `BlockHasher.probe()`; checked against the index's own
                when given, so that a replica hashing with another key is refused up front.
            check_address: why `address` is refused, or "" (the gRPC server passes the rule
                a kvpool replica applies at start); applied in field order, after the ids.
        Raises:
            InvalidArgument: a required field is empty.
            FailedPrecondition: block_size or the hash probe differs from the index's.
            ResourceExhausted: all replica slots are taken.
        """
        self._check_registration(replica_id, incarnation, address, model_id, block_size,
                                 hash_probe, check_address)
        now = self.clock()
        self._expire(now)
        rep = self._replicas.get(replica_id)
        if rep is not None and rep.incarnation == incarnation and rep.model_id == model_id:
            rep.address, rep.capacity_blocks = address, capacity_blocks
            rep.refresh()
        else:
            if rep is not None:
                # A restarted pod keeps its name, not its memory.
                self.tree.clear(rep.bit)
                bit = rep.bit
            else:
                free = [i for i, r in enumerate(self._by_bit) if r is None]
                if not free:
                    raise ResourceExhausted(
                        f"replica_id: the index already tracks {MAX_REPLICAS} replicas")
                bit = free[0]
            floor = self._seq_floor.pop(replica_id, None)
            back = rep is None and floor is not None and floor[0] == incarnation
            start = floor[1] if back else 1  # type: ignore[index]
            lapsed = self._lapsed.pop(replica_id, None)
            old = rep.incarnation if rep is not None else floor[0] if floor else None
            if old is not None and old != incarnation:
                _remember(self._replaced, (replica_id, old), None)
            rep = Replica(replica_id, incarnation, address, model_id, capacity_blocks, bit,
                          now, now, next_seq=start, awaiting_resync=back)
            if back and lapsed and lapsed[0] == incarnation and now <= lapsed[2]:
                # Back from a lapse: its resync gives the hits back as it stores the blocks.
                rep.usage, rep.usage_until, rep.usage_halvings = (
                    lapsed[1], now + self.lease_seconds, lapsed[3])
            rep.refresh()
            self._replicas[replica_id] = rep
            self._by_bit[bit] = rep
            self._reindex_models()
        self._renew(rep, now)
        return RegisterResult(self.lease_seconds, rep.next_seq)

    def _check_registration(self, replica_id: str, incarnation: str, address: str,
                            model_id: str, block_size: int, hash_probe: bytes,
                            check_address: Callable[[str], str] | None) -> None:
        """`register`'s checks of the call (its Raises, less ResourceExhausted), in field
        order; nothing changes."""
        for name, value in (("replica_id", replica_id), ("incarnation", incarnation),
                            ("address", address), ("model_id", model_id)):
            why = check_address(value) if name == "address" and check_address else ""
            if why:
                raise InvalidArgument(name, why)
            if name == "model_id":
                _check_model_id(value)
                continue
            _check_id(name, value)
            if not value.isprintable() or any(c.isspace() for c in value):
                # Ids and the address go into Stats, logs and routing as they are (a NUL is
                # not printable: refused here).
                raise InvalidArgument(name, "printable characters without spaces only")
        if hash_probe and len(hash_probe) != DIGEST_SIZE:
            raise InvalidArgument("hash_probe", f"must be {DIGEST_SIZE} bytes, got "
                                                f"{len(hash_probe)}")
        if not block_size:
            raise InvalidArgument("block_size", "required")
        if block_size != self.block_size:
            raise FailedPrecondition(
                f"block_size: replica uses {block_size}, this index {self.block_size}")
        # Probed with a hasher kept only for a model already served: refused registrations
        # of made-up models filled the cache (1,024), and every real model's went cold.
        probe_with = self._hashers.get(model_id) or BlockHasher(
            model_id, self.block_size, self.hash_key, memo_blocks=0)
        if hash_probe and hash_probe != probe_with.probe():
            raise FailedPrecondition(
                "hash_probe: the replica's block hashes differ from the index's "
                "(TIERCACHE_HASH_KEY or model_id mismatch)")
        if (replica_id, incarnation) in self._replaced:
            raise FailedPrecondition(
                f"incarnation: {shown(incarnation)} of {shown(replica_id)} was replaced by a "
                "newer one (a restarted replica registers under a new incarnation)")

    def heartbeat(self, replica_id: str, incarnation: str, load: Load) -> HeartbeatResult:
        """Renew a lease; `known` is False if the replica must register again."""
        if not replica_id:
            raise InvalidArgument("replica_id", "required")
        if load.free_blocks > load.total_blocks:
            # Taken as it came, it was handed on in Stats and every Match answer (a pool with
            # more free blocks than blocks). A kvpool replica's own never is: free + cached
            # of one figure of its fixed-size pool, taken at once.
            raise InvalidArgument(
                "load.free_blocks", f"{load.free_blocks} is more than load.total_blocks "
                f"({load.total_blocks})")
        now = self.clock()
        self._expire(now)
        rep = self._replicas.get(replica_id)
        if rep is None or rep.incarnation != incarnation:
            return HeartbeatResult(False, self.lease_seconds)
        if load != rep.load:
            rep.load = load
            rep.refresh()
            self._reindex_models()
        self._renew(rep, now)
        if self._prune_run is not None or len(self.tree) > self.max_nodes:
            self._prune_some()  # a run started by a burst of publishes goes on without them
        return HeartbeatResult(True, self.lease_seconds)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop replicas whose lease lapsed (and their holdings); returns their ids."""
        return self._expire(self.clock() if now is None else now, force=True)

    def _renew(self, rep: Replica, now: float) -> None:
        rep.last_seen = now
        rep.deadline = now + self.lease_seconds
        self._next_deadline = min(self._next_deadline, rep.deadline)

    def sweep(self, now: float | None = None, period: float | None = None) -> list[str]:
        """The lease sweeper's turn, every `period` (default a quarter lease): `expire`, after
        forgiving the time this process was not running; then the hit counts' aging."""
        now = self.clock() if now is None else now
        self._sweep_period = self.lease_seconds / 4 if period is None else period
        gone = self._expire(now, force=True)
        self._swept_at = now
        self.age_hits(now)
        for rid in [r for r, v in self._lapsed.items() if v[2] < now]:
            del self._lapsed[rid]
        return gone

    def age_hits(self, now: float | None = None) -> int:
        """Halves every hit count once per `hit_half_life_seconds` passed since the last
        halving (the sweeper's turn); returns how many times.

        A turn late by several half-lives halves as many times (at most `MAX_HALVINGS`), a
        pause of this process included: the counts say how recent the traffic they saw is,
        and what was seen before a pause is that old (the replicas' traffic went on, routed
        without the index). Halving once would leave pre-pause hits outranking the traffic
        that comes after, the very bias this aging removes; the order among old counts is
        kept either way (halving preserves it, give or take ties). Unlike leases, nothing is
        wrongly dropped for it: a count only weighs less.
        """
        life = self.hit_half_life_seconds
        if life <= 0:
            return 0
        now = self.clock() if now is None else now
        n = int((now - self._decayed_at) // life)
        if n <= 0:
            return 0
        self._decayed_at += n * life
        n = min(n, MAX_HALVINGS)
        self.tree.decay_hits(n)
        self.hit_halvings += n
        # A pruning run under way ranked the leaves on the old counts; the next call over
        # the budget starts one on the new (the bound holds: it only restarts).
        self._prune_run = None
        return n

    def _pending_usage(self, rep: Replica, now: float) -> dict[bytes, tuple[int, int]]:
        """The hits `rep` still has to be given back (empty past their time), aged to now."""
        pending = rep.usage
        if not pending or now > rep.usage_until:
            return {}
        shift = self.hit_halvings - rep.usage_halvings
        if not shift:
            return pending
        return {k: (h >> shift, last) for k, (h, last) in pending.items() if h >> shift}

    def _clear_saving(self, rep: Replica, now: float) -> dict[bytes, tuple[int, int]]:
        """Clears `rep`'s holdings (a resync, a lapse) and returns the hits to keep for it:
        those of the nodes only it held (gathered by the clear itself, one vectorised step:
        nothing walks a big replica's holdings under the lock; see `reap`), and those still
        to be given back from before, at most `capacity_blocks` in all (no replica holds more
        blocks at once), the held ones first, then the most hit: a replica resyncing again
        and again must not pile up the hits of blocks it evicted long ago."""
        held = self.tree.clear_saving(rep.bit)
        pending = {k: v for k, v in self._pending_usage(rep, now).items() if k not in held}
        room = len(pending) if rep.capacity_blocks <= 0 else rep.capacity_blocks - len(held)
        if len(pending) > room:
            keep = sorted(pending, key=lambda k: pending[k][0], reverse=True)[:max(0, room)]
            pending = {k: pending[k] for k in keep}
        return {**pending, **held}

    def _forgive_pause(self, now: float) -> None:
        """Pushes every lease back by the time this process stood still (SIGSTOP, a VM or
        container paused, a host swapping), seen as the sweeper's turn late by over half a
        lease with no call served meanwhile: the index's own pause read as every replica's
        silence, and it dropped them all at once on waking (each then resynced from a full
        snapshot, and the hit history of every block was lost).

        The hits kept for one lease (a lapsed replica's, and those a resync or a return from
        a lapse still has to give back) are kept that much longer too: a replica whose lease
        lapsed just before the pause sent its Register during it, and lost them all while
        the Register waited for an index that could not answer."""
        swept = self._swept_at
        if swept is None:
            return
        # The last sign that the process ran: the sweeper's turn, or a call served since. A
        # sweeper starved while calls came (a busy lock, the GIL) is not a pause: read as one,
        # it pushed a silent replica's lease past its end while the index answered every 50 ms.
        # (Comparisons, not max(): this runs on every call.)
        if now - (swept if swept > self._active_at else self._active_at) <= self.lease_seconds / 2:
            return
        # The sweeper's own period was time the index ran: only the lateness is forgiven (a
        # sweeper late at every turn still lets a silent replica's lease run out).
        stood = now - max(self._swept_at + self._sweep_period, self._active_at)
        for rep in self._replicas.values():
            rep.deadline += stood
            rep.usage_until += stood
        self._next_deadline += stood
        for rid, (inc, usage, until, halvings) in self._lapsed.items():
            self._lapsed[rid] = (inc, usage, until + stood, halvings)
        self._swept_at = now
        log.warning("the index stood still for %.1f s (paused?): leases, and the hits kept "
                    "for one, pushed back by as much", stood)

    def _expire(self, now: float, force: bool = False) -> list[str]:
        self._forgive_pause(now)
        if now > self._active_at:
            self._active_at = now
        if now < self._next_deadline and not force:
            return []
        gone = [r for r in self._replicas.values() if r.deadline <= now]
        for rep in gone:
            self._drop(rep, now)
        if gone:
            # Here, not by the sweeper alone: whichever call comes first drops a lapsed lease
            # (a Match, another replica's heartbeat), so the sweeper's line was nearly never
            # written (1 of 8 lapses in an operator's run). INFO, not WARNING: every replica
            # stopped on purpose (a rollout, a scale-down) lapses so, having withdrawn its
            # blocks (there is no Deregister), and a lapse that is a fault is a WARNING where it
            # happened: the orchestrator's "kvpool/<name> at <address> is unhealthy" (killed,
            # hung), the replica's own "prefix index <address>: UNAVAILABLE ..." (cut off).
            log.info("leases lapsed: dropped replicas %s (lease %g s; last seen %s s ago)",
                     ", ".join(r.replica_id for r in gone), self.lease_seconds,
                     ", ".join(f"{now - r.last_seen:.1f}" for r in gone))
        self._next_deadline = min((r.deadline for r in self._replicas.values()),
                                  default=float("inf"))
        return [r.replica_id for r in gone]

    def _drop(self, rep: Replica, now: float) -> None:
        # Kept for a re-Register of the same incarnation (a batch sent before the lapse may
        # still arrive).
        _remember(self._seq_floor, rep.replica_id, (rep.incarnation, rep.next_seq))
        # ...and, for a lease, the hits of what only it held (and of what a resync still had
        # to give back): a lease lapsed by a late heartbeat lost them.
        usage = self._clear_saving(rep, now)
        self._lapsed.pop(rep.replica_id, None)
        if usage:
            self._lapsed[rep.replica_id] = (rep.incarnation, usage, now + self.lease_seconds,
                                            self.hit_halvings)
            while len(self._lapsed) > MAX_REPLICAS:
                del self._lapsed[next(iter(self._lapsed))]
        del self._replicas[rep.replica_id]
        self._by_bit[rep.bit] = None
        self._reindex_models()
        if self.on_drop is not None:
            self.on_drop(rep.replica_id)

    def _reindex_models(self) -> None:
        # Least busy first, so that equally long matches come out in load order.
        by_model: dict[str, list[Replica]] = {}
        for r in sorted(self._replicas.values(),
                        key=lambda r: (r.load.running + r.load.waiting, r.replica_id)):
            by_model.setdefault(r.model_id, []).append(r)
        self._by_model = by_model
        # Hashers only for the models served (a lapsed model's memo goes with it).
        for cache in (self._hashers, self._verifiers):
            for m in [m for m in cache if m not in by_model]:
                del cache[m]

    def _known(self, replica_id: str, incarnation: str) -> Replica:
        if not replica_id:
            raise InvalidArgument("replica_id", "required")
        rep = self._replicas.get(replica_id)
        if rep is None:
            raise NotFound(f"replica_id: unknown replica {shown(replica_id)}; Register first")
        if rep.incarnation != incarnation:
            raise NotFound(f"incarnation: {shown(incarnation)} is not the registered "
                           f"incarnation of {shown(replica_id)}; Register again")
        return rep

    # -- events ---------------------------------------------------------------------------

    def publish(self, replica_id: str, incarnation: str, seq: int, events: Sequence[Event],
                resync: bool = False) -> PublishResult:
        """Apply a batch of events in order, or ask for a resync after a gap.

        Raises:
            NotFound: unknown replica or stale incarnation (register again).
            InvalidArgument: a malformed event (nothing of the batch is applied).
            ResourceExhausted: the batch exceeds the event or block limit.
        """
        now = self.clock()
        self._expire(now)  # at once unless a lease is due; marks the index active (see pause)
        rep = self._known(replica_id, incarnation)
        if not 1 <= seq < 2**64 - 1:  # the next batch number must fit the uint64 answer
            raise InvalidArgument("seq", "must be in 1..2^64-2")
        if len(events) > self.max_events:
            raise ResourceExhausted(f"events: {len(events)} events > limit {self.max_events}")
        # A publish taken (applied, acknowledged again, or answered with a resync) shows the
        # replica alive as much as a heartbeat does: a resync of many batches queued behind
        # other replicas' let the lease lapse midway (NOT_FOUND, a new registration, a new
        # snapshot, again). A refused one does not: a replica sending only malformed batches
        # stayed live, and offered in Match answers.
        if seq < rep.next_seq:
            # A retry of an applied batch, or a resync overtaken by a newer one (a timed-out
            # call still queued here): applying it would bring back an older view.
            self._renew(rep, now)
            return PublishResult(False, rep.next_seq, applied=False)
        if not resync and (seq > rep.next_seq or rep.awaiting_resync):
            # A gap in the batches, or the first batch after a registration that carried the
            # numbers on past a lapse (see `Replica.awaiting_resync`): ask for the snapshot.
            self._renew(rep, now)
            self.resyncs_total += 1
            return PublishResult(True, rep.next_seq, applied=False)
        if len(events) == 1 and not resync and type(events[0]) is Stored \
                and events[0].parent_hash:
            done = self._publish_one(rep, seq, events[0])
            self._renew(rep, now)
            return done
        plan = self._validate(rep, events)
        self._renew(rep, now)
        self._apply_plan(rep, plan, resync, now)
        rep.next_seq = seq + 1
        self._prune_some()
        return PublishResult(False, rep.next_seq)

    def _apply_plan(self, rep: Replica, plan: list[tuple], resync: bool, now: float) -> None:
        """Applies a validated batch (`_validate`'s plan) of the replica's events to the tree;
        a resync first clears what the replica held, keeping its nodes' hits."""
        self._tick += 1
        tick = self._tick
        tree = self.tree
        usage = None
        if resync:
            # A resync restates the replica's holdings; nodes it alone held are deleted and
            # stored again, and must keep their hits (TopPrefixes, LFU pruning); so must those
            # an earlier resync or a lapse still had to give back.
            usage = self._clear_saving(rep, now)
            rep.awaiting_resync = False
            rep.usage, rep.usage_until = None, now + self.lease_seconds
            rep.usage_halvings = self.hit_halvings
        # A chain whose parent the replica does not hold (yet) waits for that parent to be
        # stored later in this batch (a snapshot's order must not matter); else it is dropped.
        # A removal later in the batch also reaches the chains still waiting.
        waiting: dict[bytes, list[tuple]] = {}
        for kind, a, b, c, salt in plan:
            if kind == "stored":
                if salt is not None:
                    tree.ensure_root(a, rep.model_id, salt)
                # A resync's stores restate holdings: no use (shared blocks kept their
                # recency, and pruning its order).
                self._store(rep.bit, (a, b, c), tick, waiting, touch=not resync)
                tree.gc_root(a)
            elif kind == "removed":
                for h in a:
                    tree.remove(h, rep.bit)
                if waiting:
                    self._forget_waiting(waiting, a)
            else:
                tree.clear(rep.bit)
                self._drop_waiting(waiting)
        self._drop_waiting(waiting)  # parents that never came
        if usage:
            rep.usage = tree.restore_usage(usage) or None
        elif rep.usage is not None:
            self._give_back_usage(rep, now, (h for kind, _, b, _, _ in plan
                                             if kind == "stored" for h in b))

    def _publish_one(self, rep: Replica, seq: int, ev: Stored) -> PublishResult:
        """`publish` of the most common batch: one stored chain below a known block.

        The same steps as the general path, without its bookkeeping for batches whose chains
        wait for each other.
        """
        parent, hashes = self._check_stored(rep, 0, ev)
        if len(hashes) > self.max_blocks:
            raise ResourceExhausted(f"events: more than {self.max_blocks} blocks in a batch")
        self._tick += 1
        tree = self.tree
        self.dropped_blocks_total += tree.store(parent, hashes, ev.token_ids, rep.bit,
                                                self._tick).dropped
        tree.gc_root(parent)
        if rep.usage is not None:
            self._give_back_usage(rep, self.clock(), hashes)
        rep.next_seq = seq + 1
        self._prune_some()
        return _new(PublishResult, (False, rep.next_seq, True))

    def reap(self, budget: int | None = None) -> int:
        """Deletes up to `budget` (None: all) of the nodes a lapse or a resync left unheld
        (`BlockTree.reap`); returns how many remain. The server's sweeper calls it in short
        steps, letting other calls in between."""
        return self.tree.reap(budget)

    def _prune_some(self) -> None:
        """Over `max_nodes`, one step of a pruning run (`prune_step` units: a node looked at
        costs 1, an eviction 20), so that a big tree's pruning is spread over the calls that
        follow instead of holding the index for half a second. Past `max_nodes` plus the gap
        down to the prune target (arrivals outran the steps), the run finishes at once:
        memory stays bounded by that. Unheld nodes waiting for the sweeper's `reap` count
        for memory: over `max_nodes` in all, they are reaped first (a step, or all of them
        past the hard bound), before any block a replica holds is pruned."""
        tree = self.tree
        if tree.unheld:
            total = len(tree) + tree.unheld
            if total > self.max_nodes:
                # A step of `prune_step` slots held the lock ~7x as long as a pruning step
                # (see REAP_UNITS).
                tree.reap(None if total > 2 * self.max_nodes - self.prune_target
                          else max(1, self.prune_step // REAP_UNITS))
        run = self._prune_run
        n = len(self.tree)
        if run is None:
            if n <= self.max_nodes:
                return
            run = self._prune_run = self.tree.pruning(
                self.prune_target, self.policy, self.shallow_tokens, self.min_deep_hits,
                self._recent_since())
        hard = n > 2 * self.max_nodes - self.prune_target
        if run.step(None if hard else self.prune_step):
            self._prune_run = None
            if hard and len(self.tree) > self.max_nodes:
                # Its candidates were the leaves when it began; chains extended since (each
                # turn of a conversation extends one) left it nothing to evict. A run over
                # today's leaves, at once: the bound holds.
                self.tree.prune(self.prune_target, self.policy, self.shallow_tokens,
                                self.min_deep_hits, self._recent_since())

    def _recent_since(self) -> int | None:
        """The tick after which a use is recent for pruning (None: no grace)."""
        return self._tick - self.cold_after_ticks if self.cold_after_ticks > 0 else None

    def _give_back_usage(self, rep: Replica, now: float, stored) -> None:
        """Gives the blocks `stored` by this batch the hits a resync saved for them (the
        replica's pending ones); blocks the batch named but did not keep (a parent that never
        came) stay pending. All are forgotten one lease after the resync."""
        pending = rep.usage
        if pending is None:
            return
        if now > rep.usage_until:
            rep.usage = None
            return
        mine = {h: pending.pop(h) for h in stored if h in pending}
        if mine:
            pending.update(self.tree.restore_usage(mine, self.hit_halvings - rep.usage_halvings))
        rep.usage = pending or None

    def _drop_waiting(self, waiting: dict[bytes, list[tuple]]) -> None:
        """Counts every waiting chain's blocks as dropped and forgets them."""
        self.dropped_blocks_total += sum(len(st[1]) for sts in waiting.values() for st in sts)
        waiting.clear()

    def _forget_waiting(self, waiting: dict[bytes, list[tuple]], gone: list[bytes]) -> None:
        """Blocks the replica no longer holds: waiting chains lose them and all below them.

        Without this a chain waiting for a pruned parent, then removed by the replica, would
        still be stored when the parent comes back later in the batch: a claim on blocks the
        replica evicted, which no later event would ever withdraw.
        """
        gone_set = set(gone)
        bs = self.block_size
        for key in list(waiting):
            kept = []
            for a, b, c in waiting[key]:
                cut = next((i for i, h in enumerate(b) if h in gone_set), len(b))
                if cut < len(b):
                    self.dropped_blocks_total += len(b) - cut
                    gone_set.update(b[cut:])  # what waits below them goes too
                if cut:
                    kept.append((a, b[:cut], c[: cut * bs]))
            if kept:
                waiting[key] = kept
            else:
                del waiting[key]
        stack = [h for h in gone_set if h in waiting]
        while stack:
            for _, b, _ in waiting.pop(stack.pop(), ()):
                self.dropped_blocks_total += len(b)
                stack.extend(h for h in b if h in waiting)

    def _store(self, bit: int, step: tuple, tick: int, waiting: dict[bytes, list[tuple]],
               touch: bool = True) -> None:
        a, b, c = step
        res = self.tree.store(a, b, c, bit, tick, touch)
        if res.dropped == len(b):
            waiting.setdefault(a, []).append(step)
            return
        self.dropped_blocks_total += res.dropped
        if not waiting:
            return
        todo = [st for h in b[: len(b) - res.dropped] for st in waiting.pop(h, ())]
        while todo:
            a, b, c = todo.pop()
            res = self.tree.store(a, b, c, bit, tick, touch)
            if res.dropped == len(b):
                waiting.setdefault(a, []).append((a, b, c))
                continue
            self.dropped_blocks_total += res.dropped
            if waiting:
                for h in b[: len(b) - res.dropped]:
                    todo.extend(waiting.pop(h, ()))

    def _validate(self, rep: Replica, events: Sequence[Event]) -> list[tuple]:
        """Check every event before any is applied; returns (kind, args...) steps."""
        plan: list[tuple] = []
        blocks = 0
        for i, ev in enumerate(events):
            if isinstance(ev, Stored):
                parent, hashes = self._check_stored(rep, i, ev)
                blocks += len(hashes)
                salt = None if ev.parent_hash else ev.cache_salt
                plan.append(("stored", parent, hashes, ev.token_ids, salt))
            elif isinstance(ev, Removed):
                _check_hashes(f"events[{i}].removed.block_hashes", ev.block_hashes)
                blocks += len(ev.block_hashes)
                plan.append(("removed", [bytes(h) for h in ev.block_hashes], None, None, None))
            elif isinstance(ev, Cleared):
                plan.append(("cleared", None, None, None, None))
            else:
                raise InvalidArgument(f"events[{i}]", "no event set")
            if blocks > self.max_blocks:
                raise ResourceExhausted(f"events: more than {self.max_blocks} blocks in a batch")
        return plan

    def _root_of(self, rep: Replica, salt: str) -> bytes | None:
        """h_0 of `rep`'s model for `salt`; None for a salt no root can have (below the root a
        salt is not needed, and one no chain could start with is not refused there)."""
        try:
            return self.hasher(rep.model_id).root(check_salt("cache_salt", salt))
        except InvalidArgument:
            return None

    def _check_stored(self, rep: Replica, i: int, ev: Stored) -> tuple[bytes, list[bytes]]:
        """Validate stored event `i`; returns its parent key (h_0 at the root) and hashes."""
        bs = self.block_size
        hashes = ev.block_hashes
        if not isinstance(hashes, list):
            hashes = list(hashes)
        if not hashes:
            raise InvalidArgument(f"events[{i}].stored.block_hashes", "empty")
        _check_hashes(f"events[{i}].stored.block_hashes", hashes)
        if len(ev.token_ids) != bs * len(hashes):
            raise InvalidArgument(
                f"events[{i}].stored.token_ids",
                f"{len(ev.token_ids)} tokens for {len(hashes)} blocks of {bs}")
        uniq = set(hashes)
        if len(uniq) != len(hashes):
            # Chained hashes never repeat within a chain (each covers its whole prefix). With
            # verify_hashes off (the default) nothing else caught it: part of the chain was
            # stored, the repeat dropped, and the batch acknowledged.
            raise InvalidArgument(f"events[{i}].stored.block_hashes", "a block hash is repeated")
        if self.tree.holds_root_among(uniq):
            # A block keyed as a prompt's root (h_0, which any replica can compute): every
            # other replica's chains under that root were then dropped.
            raise InvalidArgument(f"events[{i}].stored.block_hashes",
                                  "a block hash is a root's key (h_0)")
        if ev.parent_hash:
            parent = self._named_parent(rep, i, ev)
        else:
            parent = self._root_parent(rep, i, ev, hashes)
        if self.verify_hashes:
            self._verify_stored(rep, i, ev, parent, hashes)
        return parent, hashes

    def _named_parent(self, rep: Replica, i: int, ev: Stored) -> bytes:
        """Stored event `i`'s parent_hash, checked: no root's key (h_0)."""
        if len(ev.parent_hash) != DIGEST_SIZE:
            raise InvalidArgument(f"events[{i}].stored.parent_hash",
                                  f"must be empty or {DIGEST_SIZE} bytes")
        parent = bytes(ev.parent_hash)
        model = self.tree.root_model(parent)
        if model is not None and model != rep.model_id:
            # A root's own children skip the holder check: without this, a replica could
            # hang its blocks under another model's prompts.
            raise InvalidArgument(f"events[{i}].stored.parent_hash",
                                  f"is the root of model {model!r}, not {rep.model_id!r}")
        if model is not None or parent == self._root_of(rep, ev.cache_salt):
            # Named as a parent, a root's key was taken while another replica's chain had
            # made the root, and its blocks silently dropped while none had.
            raise InvalidArgument(f"events[{i}].stored.parent_hash",
                                  "is a root's key (h_0): a chain from the root is sent "
                                  "with an empty parent_hash")
        return parent

    def _root_parent(self, rep: Replica, i: int, ev: Stored, hashes: list[bytes]) -> bytes:
        """The root key (h_0) stored event `i` continues, its parent_hash empty."""
        if ev.start_block:
            raise InvalidArgument(f"events[{i}].stored.start_block",
                                  "must be 0 when parent_hash is empty")
        if ev.first_block_hash and ev.first_block_hash != hashes[0]:
            raise InvalidArgument(f"events[{i}].stored.first_block_hash",
                                  "must equal block_hashes[0] at the root")
        parent = self.hasher(rep.model_id).root(
            check_salt(f"events[{i}].stored.cache_salt", ev.cache_salt))
        if parent in hashes:  # the root not made yet: the same, once it is
            raise InvalidArgument(f"events[{i}].stored.block_hashes",
                                  "a block hash is a root's key (h_0)")
        return parent

    def _verify_stored(self, rep: Replica, i: int, ev: Stored, parent: bytes,
                       hashes: list[bytes]) -> None:
        """Stored event `i`'s hashes against its tokens."""
        bs = self.block_size
        # Known blocks were verified when first stored; only the new tail needs hashing.
        # A known block counts only where the event says what the tree holds (its tokens,
        # its parent): the same batch may drop it first (a resync clears the replica's
        # holdings, a Removed may come earlier), and store then makes it again from the
        # event's tokens, which were never checked (any tokens, under any parent).
        j = 0
        prev_key = parent
        while j < len(hashes):
            known = self.tree.get(hashes[j])
            if known is None or known.parent_key != prev_key or \
                    known.token_ids != list(ev.token_ids[j * bs:(j + 1) * bs]):
                break
            prev_key = hashes[j]
            j += 1
        prev = hashes[j - 1] if j else parent
        want = self._verifier(rep.model_id).hashes(ev.token_ids[j * bs :], parent=prev)
        if want != hashes[j:]:
            raise InvalidArgument(
                f"events[{i}].stored.block_hashes",
                "do not match the tokens (hash key, model_id or parent mismatch)")

    # -- queries --------------------------------------------------------------------------

    def match(self, model_id: str, cache_salt: str = "", token_ids: Sequence[int] = (),
              block_hashes: Sequence[bytes] = (), probe: bool = False) -> MatchResult:
        """Every live replica of `model_id` with the leading blocks of the request it holds.

        Only chains under `model_id`'s roots match. A `probe` (routing asking, not traffic)
        gets the same answer without a hit credited, a match counted or a tick (the clock of
        `cold_after_ticks`) taken.

        Raises:
            InvalidArgument: no model, no or both inputs, malformed hashes, too many blocks.
        """
        # As Register refuses it: no replica can serve such a model, and an empty match read
        # as a cold cache, not as the caller's mistake (one with a NUL was answered and
        # counted as a miss in Stats). A served model's id passed this check at Register: a
        # dict lookup instead of the checks (blank() walks the id) on every Match.
        if model_id not in self._by_model:
            _check_model_id(model_id)
        if len(token_ids) and len(block_hashes):
            raise InvalidArgument("token_ids", "give token_ids or block_hashes, not both")
        if len(block_hashes):
            if len(block_hashes) > self.max_blocks:
                raise InvalidArgument("block_hashes", f"more than {self.max_blocks} blocks")
            _check_hashes("block_hashes", block_hashes)
            hashes = block_hashes
        elif len(token_ids):
            if len(token_ids) // self.block_size > self.max_blocks:
                # The limit is in blocks, as for block_hashes: a partial last block is not
                # hashed (max_blocks full ones and a few tokens more were refused).
                raise InvalidArgument(
                    "token_ids", f"more than {self.max_blocks} full blocks of "
                                 f"{self.block_size} tokens ({len(token_ids)} tokens)")
            salt = check_salt("cache_salt", cache_salt)
            hashes = None  # below, once the model is known to be served
        else:
            raise InvalidArgument("token_ids", "empty: give token_ids or block_hashes")
        now = self.clock()
        self._expire(now)  # at once unless a lease is due; marks the index active (see pause)
        if hashes is None:
            if model_id not in self._by_model:
                # No replica serves it: nothing to hash, and no hasher to keep for it.
                if not probe:
                    self.matches_total += 1
                    self.match_blocks_total += len(token_ids) // self.block_size
                return MatchResult([], len(token_ids) // self.block_size, self.block_size)
            hashes = self.hasher(model_id).hashes(token_ids, salt)
        if not probe:
            # A probe is no use: advancing the clock, health and warm-up probes aged every
            # block's last use, and a tail stored moments ago lost its cold_after_ticks grace.
            self._tick += 1
        segments = self.tree.match(hashes, self._tick, model_id, credit=not probe)
        bs = self.block_size
        reps = self._by_model.get(model_id, ())
        if not probe:
            self.matches_total += 1
            self.match_blocks_total += len(hashes)
        if not segments:
            return MatchResult([r.zero for r in reps], len(hashes), bs)  # type: ignore[misc]
        if not probe:
            self.matches_hit += 1
            self.match_blocks_hit += segments[0].blocks
        return _new(MatchResult, (_ranked(reps, segments, bs), len(hashes), bs))

    def top_prefixes(self, k: int, model_id: str = "", min_hits: int = 0,
                     cache_salt: str | None = None) -> list[HotPrefix]:
        """The `k` (1..1000) prefixes where most matches ended, hottest first (only under
        `cache_salt` when given), stopping before the first that would bring the answer past
        MAX_TOP_TOKENS tokens in all: each prefix carries every token from the root, and 1,000
        long ones made an answer past gRPC's message limit, which failed the call."""
        if not 1 <= k <= 1000:
            raise InvalidArgument("k", "must be in 1..1000")
        if model_id:  # empty = every model; a blank one matched none and read as a cold cache
            _check_model_id(model_id)
        if cache_salt is not None:
            # A salt Match and every publish refuse (a NUL, past the length limit) matched
            # nothing here either, and an empty answer read as "nothing hot yet".
            check_salt("cache_salt", cache_salt)
        now = self.clock()
        self._expire(now)  # a lapsed replica's prefixes are not reported, as in match
        out = []
        for p in self.tree.top(k, model_id, min_hits, cache_salt, MAX_TOP_TOKENS):
            holders = [r.replica_id for b in bits(p.holders) if (r := self._by_bit[b])]
            out.append(HotPrefix(p.token_ids, p.hits, sorted(holders), p.cache_salt,
                                 p.model_id, p.last_block_hash))
        return out

    def stats(self) -> IndexStats:
        now = self.clock()
        self._expire(now)
        reps = [ReplicaInfo(r.replica_id, r.incarnation, r.address, r.model_id,
                            self.tree.held[r.bit], r.load, max(0.0, now - r.last_seen),
                            r.capacity_blocks)
                for r in sorted(self._replicas.values(), key=lambda r: r.replica_id)]
        n = len(self.tree)
        # Slots held, not live nodes: freed slots are reused, never returned, and after a
        # lapse or a prune the live count alone read as near nothing at the peak's memory.
        return IndexStats(n, self.tree.slots * APPROX_BYTES_PER_NODE, reps, self.matches_total,
                          self.matches_hit, self.match_blocks_total, self.match_blocks_hit,
                          self.tree.pruned_total, self.resyncs_total, self.block_size,
                          self.dropped_blocks_total, self.max_nodes, self.tree.unheld)

    def check_integrity(self) -> None:
        """Raise AssertionError unless tree, table, holders and membership agree."""
        self.tree.check_integrity()
        for b, rep in enumerate(self._by_bit):
            if rep is None:
                if self.tree.held[b]:
                    raise AssertionError(f"free slot {b} still holds {self.tree.held[b]} blocks")
            elif self._replicas.get(rep.replica_id) is not rep or rep.bit != b:
                raise AssertionError(f"slot {b} and replica {rep.replica_id} disagree")
        if len(self._replicas) != sum(r is not None for r in self._by_bit):
            raise AssertionError("replica table and slots disagree")
        for blk in self.tree.blocks():
            for b in bits(blk.holders):
                rep = self._by_bit[b]
                if rep is None or rep.model_id != blk.model_id:
                    raise AssertionError(f"node {blk.key.hex()} held by slot {b} of another model")
            if self.verify_hashes:
                want = self.hasher(blk.model_id).hashes(blk.token_ids, parent=blk.parent_key)
                if want != [blk.key]:
                    raise AssertionError(f"node {blk.key.hex()}: hash does not match its tokens")
