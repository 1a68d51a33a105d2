"""A shard's check that replicas and the callers of Match place chains on the same shard list.

Each side builds its own consistent-hash ring of the prefix shards from its own configuration
(kvpool's `prefix_address`, the orchestrator's `prefix_addresses`). Two spellings of one shard
place alike (`services.common.addresses`), but a real difference (a shard listed on one side
only, two names that are not the same host) sends chains to one shard and their lookups to
another: every such Match misses, and nothing failed. Clients send their list's size and
fingerprint with Register and Match; the shard remembers each replica's and compares it with
every Match that names the replica, and a Match that names none (the usual case when chains
went to another shard: nothing here matches) with every list registered here: a mismatch when
none of them agrees. A mismatch never fails the Match (the index is advisory, and a Match
that lands right still answers right): it is counted, logged at most once a minute, and said
in Stats for a while.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple

from services.common import metrics

log = logging.getLogger(__name__)

MISMATCHES = metrics.counter(
    "tiercache_prefix_shard_list_mismatches_total",
    "Match calls routed by another prefix shard list than the replicas here registered with")

# How long Stats go on saying a mismatch after the last one seen.
SHOWN_SECONDS = 300.0
# At most one warning per this long (every Match of a misconfigured orchestrator mismatches).
WARN_EVERY_SECONDS = 60.0
# Replicas whose list is remembered: ids come and go with restarts (a live replica dropped
# from here past it is only left unchecked).
MAX_REMEMBERED = 4096


class ShardList(NamedTuple):
    shards: int
    fingerprint: str

    def __str__(self) -> str:
        return f"{self.shards} shard{'s' * (self.shards != 1)} ({self.fingerprint})"


class ShardListCheck:
    """Replicas' registered shard lists, compared with those of Match calls. Not thread-safe:
    the servicer calls it under its lock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._lists: dict[str, ShardList] = {}
        self._counts: Counter[ShardList] = Counter()  # how many replicas registered each list
        self.mismatches_total = 0
        self._last: tuple[float, str, ShardList, ShardList] | None = None
        self._warned_at: float | None = None
        self._unwarned = 0  # mismatches since the last warning

    def registered(self, replica_id: str, shards: int, fingerprint: str) -> None:
        """`replica_id` registered with this list (an empty fingerprint: not said, so not
        checked; also what a replica downgraded to an older client registers with)."""
        self._forget(replica_id)
        if fingerprint:
            self._lists[replica_id] = got = ShardList(shards, fingerprint)
            self._counts[got] += 1
            while len(self._lists) > MAX_REMEMBERED:
                self._forget(next(iter(self._lists)))

    def _forget(self, replica_id: str) -> None:
        old = self._lists.pop(replica_id, None)
        if old is not None:
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]

    def check(self, shards: int, fingerprint: str, replica_ids: Iterable[str]) -> bool:
        """Whether a Match routed by this list (`fingerprint` "" = not said) agrees with the
        lists of the replicas it names (those registered here with one), or, naming none of
        them, with the list of at least one replica registered here; counts and logs when it
        does not. Two lists of one shard each always agree (nothing is placed)."""
        if not fingerprint or not self._lists:
            return True
        sent = ShardList(shards, fingerprint)

        def differs(theirs: ShardList) -> bool:
            return theirs.fingerprint != fingerprint and max(theirs.shards, shards) > 1

        named = False
        for rid in replica_ids:
            theirs = self._lists.get(rid)
            if theirs is None:
                continue
            named = True
            if differs(theirs):
                self._mismatch(rid, theirs, sent)
                return False
        if named or not all(differs(theirs) for theirs in self._counts):
            return True
        # No replica here registered with the Match's list: its chains, if any, are elsewhere.
        rid = next(reversed(self._lists))  # the latest registered, to name one in the report
        self._mismatch(rid, self._lists[rid], sent)
        return False

    def _mismatch(self, replica_id: str, theirs: ShardList, sent: ShardList) -> None:
        now = self.clock()
        self.mismatches_total += 1
        MISMATCHES.inc()
        self._last = (now, replica_id, theirs, sent)
        self._unwarned += 1
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_SECONDS:
            log.warning("prefix shard lists differ: replica %s registered with %s, a Match "
                        "came with %s (%d such Matches since the last warning); chains it "
                        "publishes here are looked up on another shard: list the same shards "
                        "in kvpool's prefix_address and the orchestrator's prefix_addresses",
                        replica_id, theirs, sent, self._unwarned)
            self._warned_at, self._unwarned = now, 0

    def note(self) -> str:
        """Stats' word on it: the last mismatch while it is recent, else ""."""
        if self._last is None:
            return ""
        at, replica_id, theirs, sent = self._last
        ago = self.clock() - at
        if ago > SHOWN_SECONDS:
            return ""
        return (f"shard list differs between replicas and orchestrator: replica {replica_id} "
                f"registered with {theirs}, a Match came with {sent} {ago:.0f} s ago "
                f"({self.mismatches_total} such Matches in all)")
