"""Choosing a kvpool replica for a request.

Two signals pull in different directions: the replica that already holds the longest prefix
saves the most compute, but sending every request that shares a hot system prompt to that one
replica overloads it. The policy:

1. Replicas whose load would exceed a bounded-load cap, ceil((1 + eps) * (total + 1) / n),
   are skipped (so a hot prompt spreads to more replicas instead of piling up), and so are
   replicas that took more than (1 + eps) / n of the requests routed recently (a count that
   decays with time constant `window_s`). The instant cap binds under heavy traffic; at low
   traffic (one or two requests in flight) it never does, and without the second rule every
   session of a replica's prompts would stay there however uneven the work. A replica skipped
   for its share has its hot prompt computed once on another, whose later sessions share it.
   The share rule moves only new conversations: a later turn stays with its history.
2. Among the rest, the one with the best score matched_tokens - load_penalty * load wins when
   its match is useful (>= min_prefix_tokens).
3. Otherwise: a consistent-hash ring with bounded loads keyed by the tenant and session id (or
   the first block's hash), so a conversation sticks to one replica while it is healthy. When the
   index answered (so the prompt is new to every replica, not unknown) and some replicas have
   room for it in free blocks while others would have to evict, the ring walk tries the ones
   with room first: the hash alone would pile new system prompts onto a pool that is already
   full while the other has space, and that pool then evicts the prompts it serves. Room
   never outranks rule 1's share: the walk takes one with room under its share, then one
   under its share, then any under the cap.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from services.common.ring import HashRing, _point, load_cap

log = logging.getLogger(__name__)


class ReplicaView(NamedTuple):
    """What routing knows about a replica right now."""

    replica_id: str
    load: float  # active sequences (running + waiting + in flight from this orchestrator)
    free_blocks: int = -1  # free KV blocks at the last poll; -1 = unknown


class RouteDecision(NamedTuple):
    replica_id: str
    route: str  # "prefix" | "ring"
    matched_tokens: int


class RoutingPolicy(ABC):
    @abstractmethod
    def choose(self, replicas: Sequence[ReplicaView], matches: Mapping[str, int], key: str,
               exclude: frozenset[str] = frozenset(),
               new_blocks: int | None = None, continues: bool = False, *,
               record: bool = True) -> RouteDecision | None:
        """Pick a replica, or None when no replica is available. Not thread-safe: callers
        serialise calls (the orchestrator's route lock).

        Args:
            replicas: healthy replicas and their loads.
            matches: replica id -> matched prefix tokens (from the prefix index; may be empty).
            key: affinity key (session id or first block hash).
            exclude: replicas not to use (e.g. failed on this request).
            new_blocks: KV blocks the request needs, given only when the prefix index answered
                (`matches` is then the truth, not a blank); None = unknown.
            continues: the request is a later turn of a conversation; the recent-share rule
                does not move it (its replica holds the whole history, not just the prompt).
            record: count the choice as routed traffic (False for a warm-up's owner lookup).
        """


def bounded_cap(loads: Sequence[float], epsilon: float, floor: int = 0) -> float:
    """Max load a replica may have *before* taking one more request: the bounded-load rule,
    but never below `floor` (see PrefixAwarePolicy's load_floor)."""
    return max(load_cap(sum(loads) + 1, len(loads), epsilon) - 1, floor)


class PrefixAwarePolicy(RoutingPolicy):
    """Longest useful prefix under a bounded-load cap, else a bounded-load session ring."""

    def __init__(self, epsilon: float = 0.25, min_prefix_tokens: int = 32,
                 load_penalty_tokens: float = 16.0, vnodes: int = 64,
                 use_cap: bool = True, window_s: float = 30.0, min_recent: float = 4.0,
                 clock: Callable[[], float] = time.monotonic, load_floor: int = 2) -> None:
        self.epsilon = epsilon
        # A replica running at most this many requests is never over the cap. The bounded-
        # load rule alone gives a cap of 0 while fewer than ~0.8 x n requests are in flight:
        # at 64 replicas a conversation's replica running one request lost its next turn (and
        # a prompt's holder its next user) to a cold replica.
        self.load_floor = load_floor
        # Requests routed to each replica, decaying with time constant window_s; the share
        # rule applies once the recent total reaches min_recent per replica (below it, shares
        # are noise: at 64 replicas a fixed 4 requests made every replica that had served one
        # "over its share").
        self.window_s = window_s
        self.min_recent = min_recent
        self.clock = clock
        self._recent: dict[str, float] = {}
        self._recent_at = clock()
        self._recent_lock = threading.Lock()
        self.min_prefix_tokens = min_prefix_tokens
        self.load_penalty_tokens = load_penalty_tokens
        self.use_cap = use_cap
        self.ring = HashRing([], vnodes=vnodes)

    def _sync_ring(self, ids: Sequence[str]) -> None:
        current = set(self.ring.nodes)
        for r in set(ids) - current:
            self.ring.add(r)
        for r in current - set(ids):
            self.ring.remove(r)

    def choose(self, replicas, matches, key, exclude=frozenset(), new_blocks=None,
               continues=False, *, record=True):
        live = [r for r in replicas if r.replica_id not in exclude]
        if not live:
            return None
        # Every replica on the ring, the excluded ones skipped by the lookup: taking a failed
        # replica off and putting it back rebuilt the ring twice per retry, under the route
        # lock, during exactly the storms when routing must be quick.
        self._sync_ring([r.replica_id for r in replicas])
        loads = {r.replica_id: r.load for r in live}
        cap = (bounded_cap(list(loads.values()), self.epsilon, self.load_floor) if self.use_cap
               else math.inf)
        busy = self._over_share(live) if self.use_cap and not continues else set()
        best: tuple[float, int, str] | None = None
        for r in live:
            m = matches.get(r.replica_id, 0)
            if m < self.min_prefix_tokens or r.load > cap or r.replica_id in busy:
                if m >= self.min_prefix_tokens:
                    log.debug("prefix holder %s (%d tokens) skipped: %s", r.replica_id, m,
                              "over its recent share" if r.replica_id in busy
                              else f"load {r.load} over cap {cap}")
                continue
            score = m - self.load_penalty_tokens * r.load
            # Equal scores are common (a hot prompt held everywhere, all idle): break the tie
            # by a per-key hash, not list order, or the first replicas get more traffic. Not
            # CRC32: it is linear, so for keys of one length crc(k|r1) ^ crc(k|r2) is the same
            # for every key, and of three replicas one won half the ties.
            tie = _point(f"{key}|{r.replica_id}".encode())
            if best is None or (score, tie) > best[:2]:
                best = (score, tie, r.replica_id)
        if best is not None:
            rid = best[2]
            if record:
                self.record(rid)
            return RouteDecision(rid, "prefix", matches.get(rid, 0))
        ok = {r.replica_id for r in live} - busy
        room = ({r.replica_id for r in live if r.free_blocks >= new_blocks}
                if new_blocks is not None else set())
        # Preferences in rank: room and under its share, then under its share. Room never
        # outranks the share rule: when every replica with room is over the load cap, one
        # under its share is taken before one over it (a single walk handed only the room set
        # fell back to the first replica under the cap, over its share or not).
        tiers = [t for t in (room & ok, ok) if t and len(t) < len(live)]
        if len(tiers) == 2 and tiers[0] == tiers[1]:
            del tiers[1]
        rid = ""
        for prefer in tiers or [None]:
            rid = self.ring.lookup_bounded(key, loads, self.epsilon, prefer=prefer,
                                           floor=self.load_floor if self.use_cap else 0,
                                           skip=exclude)
            if prefer is None or rid in prefer:
                break
        if record:
            self.record(rid)
        return RouteDecision(rid, "ring", matches.get(rid, 0))

    def _decay(self) -> None:
        """Age the recent counts to now (the caller holds `_recent_lock`)."""
        now = self.clock()
        a = math.exp(-max(0.0, now - self._recent_at) / self.window_s)
        self._recent = {k: v * a for k, v in self._recent.items() if v * a > 1e-3}
        self._recent_at = now

    def _over_share(self, live: Sequence[ReplicaView]) -> set[str]:
        """Replicas over (1 + eps) / n of the recent requests among `live` (none when few)."""
        with self._recent_lock:
            self._decay()
            counts = {r.replica_id: self._recent.get(r.replica_id, 0.0) for r in live}
        total = sum(counts.values())
        if len(live) < 2 or total < self.min_recent * len(live):
            return set()
        return {rid for rid, c in counts.items() if c > (1 + self.epsilon) * total / len(live)}

    def record(self, replica_id: str) -> None:
        """Count a request sent to `replica_id` (the caller routed it there)."""
        with self._recent_lock:
            self._decay()
            self._recent[replica_id] = self._recent.get(replica_id, 0.0) + 1.0


class RoundRobinPolicy(RoutingPolicy):
    """Baseline for benchmarks: ignores prefixes and sessions."""

    def __init__(self) -> None:
        self.i = 0

    def choose(self, replicas, matches, key, exclude=frozenset(), new_blocks=None,
               continues=False, *, record=True):
        live = sorted(r.replica_id for r in replicas if r.replica_id not in exclude)
        if not live:
            return None
        rid = live[self.i % len(live)]
        if record:
            self.i += 1
        return RouteDecision(rid, "round_robin", matches.get(rid, 0))


def make_routing_policy(name: str, epsilon: float, min_prefix_tokens: int,
                        window_s: float = 30.0, load_floor: int = 2) -> RoutingPolicy:
    if name == "prefix":
        return PrefixAwarePolicy(epsilon, min_prefix_tokens, window_s=window_s,
                                 load_floor=load_floor)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}")
