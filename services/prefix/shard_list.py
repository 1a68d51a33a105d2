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
in Stats for a while (`services.common.shard_list`, shared with the semantic tier's check).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

from services.common import metrics
from services.common.shard_list import MismatchReport, ShardList

log = logging.getLogger(__name__)

MISMATCHES = metrics.counter(
    "tiercache_prefix_shard_list_mismatches_total",
    "Match calls routed by another prefix shard list than the replicas here registered with")

# Replicas whose list is remembered: ids come and go with restarts (a live replica dropped
# from here past it is only left unchecked).
MAX_REMEMBERED = 4096
# Characters of a fingerprint kept (ours are 16): a caller's longer one is cut, not stored whole.
MAX_FINGERPRINT = 64


class ShardListCheck:
    """Replicas' registered shard lists, compared with those of Match calls. Not thread-safe:
    the servicer calls it under its lock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._lists: dict[str, ShardList] = {}
        self._counts: Counter[ShardList] = Counter()  # how many replicas registered each list
        self.report = MismatchReport(
            clock, MISMATCHES, log, tier="prefix", between="replicas and orchestrator",
            calls=("Match", "Matches"),
            advice="chains it publishes here are looked up on another shard: list the same "
                   "shards in kvpool's prefix_address and the orchestrator's prefix_addresses")

    @property
    def mismatches_total(self) -> int:
        return self.report.total

    def registered(self, replica_id: str, shards: int, fingerprint: str) -> None:
        """`replica_id` registered with this list (an empty fingerprint: not said, so not
        checked; also what a replica downgraded to an older client registers with)."""
        self._forget(replica_id)
        if fingerprint:
            # Cut as the semantic shards cut theirs: a 1 MB one was kept for each of up to
            # 4,096 replicas, and copied whole into Stats' note and the log.
            fingerprint = fingerprint[:MAX_FINGERPRINT]
            self._lists[replica_id] = got = ShardList(shards, fingerprint)
            self._counts[got] += 1
            while len(self._lists) > MAX_REMEMBERED:
                self._forget(next(iter(self._lists)))

    def forget(self, replica_id: str) -> None:
        """`replica_id` is gone (its lease lapsed): its list no longer counts."""
        self._forget(replica_id)

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
        sent = ShardList(shards, fingerprint[:MAX_FINGERPRINT])
        named = False
        for rid in replica_ids:
            theirs = self._lists.get(rid)
            if theirs is None:
                continue
            named = True
            if theirs.differs(sent):
                self._mismatch(rid, theirs, sent)
                return False
        if named or not all(theirs.differs(sent) for theirs in self._counts):
            return True
        # No replica here registered with the Match's list: its chains, if any, are elsewhere.
        rid = next(reversed(self._lists))  # the latest registered, to name one in the report
        self._mismatch(rid, self._lists[rid], sent)
        return False

    def _mismatch(self, replica_id: str, theirs: ShardList, sent: ShardList) -> None:
        self.report.record(f"replica {replica_id} registered with {theirs}, a Match came with "
                           f"{sent}")

    def note(self) -> str:
        """Stats' word on it: the last mismatch while it is recent, else ""."""
        return self.report.note()
