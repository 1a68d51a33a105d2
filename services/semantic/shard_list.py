"""A semantic shard's check that the orchestrators calling it place namespaces on one shard list.

Semantic shards are placed by the orchestrators alone: each builds its consistent-hash ring of
the shards from its own `semantic_address`. Two spellings of one shard place alike
(`services.common.addresses`), but a real difference (a shard one orchestrator lists and
another lacks, two names that are not the same host) has each store namespaces where the
others do not look: their lookups miss, and nothing failed. Orchestrators send their list's
size and fingerprint with Lookup and Store; a shard remembers the lists it saw lately (each
fingerprint's last call) and a call whose list differs from one seen within `WINDOW_SECONDS`
is a mismatch: counted, logged at most once a minute, and said in Stats for a while
(`services.common.shard_list`). The call is answered as ever. A shard cannot tell which list
is right, and it sees only the orchestrators whose rings send it namespaces: the shard both
lists share says it, a shard that only one list names does not.

A change of the list on every orchestrator (a shard added) is counted too, until the old list
was last seen `WINDOW_SECONDS` before: during a rollout the two lists are both in use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from services.common import metrics
from services.common.shard_list import MismatchReport, ShardList

log = logging.getLogger(__name__)

MISMATCHES = metrics.counter(
    "tiercache_semantic_shard_list_mismatches_total",
    "Lookup and Store calls that came with another semantic shard list than another call "
    "within the 5 minutes before")

# A call is compared with the lists seen within this long before it.
WINDOW_SECONDS = 300.0
# Distinct lists remembered (the least recently seen go first): a deployment has one, two
# during a change of the shards.
MAX_LISTS = 64
# Characters of a fingerprint kept (ours are 16): a caller's longer one is cut, not stored whole.
MAX_FINGERPRINT = 64


class RecentShardLists:
    """The shard lists of recent Lookup and Store calls, each compared with the others.
    Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # fingerprint -> (the list, when last seen, who sent it), the least recently seen
        # first.
        self._seen: OrderedDict[str, tuple[ShardList, float, str]] = OrderedDict()
        self._lock = threading.Lock()
        self.report = MismatchReport(
            clock, MISMATCHES, log, tier="semantic", between="orchestrators",
            calls=("call", "calls"),
            advice="namespaces one orchestrator stores are looked up on another shard by the "
                   "other: list the same semantic shards, by the same names, in every "
                   "orchestrator's semantic_address")

    @property
    def mismatches_total(self) -> int:
        return self.report.total

    def check(self, shards: int, fingerprint: str, method: str = "call",
              caller: str = "") -> bool:
        """Whether a `method` call (Lookup, Store) from `caller` (its peer address, "" =
        unknown), placed by this list (`fingerprint` "" = not said: an older orchestrator, not
        checked), agrees with every list seen within `WINDOW_SECONDS`; counts and logs when it
        does not. Two lists of one shard each always agree (nothing is placed)."""
        if not fingerprint:
            return True
        fingerprint = fingerprint[:MAX_FINGERPRINT]
        sent = ShardList(shards, fingerprint)
        with self._lock:
            now = self.clock()
            while self._seen:  # forget the lists not seen within the window
                _, at, _ = next(iter(self._seen.values()))
                if now - at <= WINDOW_SECONDS:
                    break
                self._seen.popitem(last=False)
            other = next((seen for seen in reversed(self._seen.values())
                          if seen[0].differs(sent)), None)  # the latest that differs
            self._seen[fingerprint] = (sent, now, caller)
            self._seen.move_to_end(fingerprint)
            while len(self._seen) > MAX_LISTS:
                self._seen.popitem(last=False)
            if other is None:
                return True
            theirs, _, their_caller = other
            self.report.record(f"a call came with {theirs}{_from(their_caller)}, a {method} "
                               f"with {sent}{_from(caller)}")
            return False

    def note(self) -> str:
        """Stats' word on it: the last mismatch while it is recent, else ""."""
        with self._lock:
            return self.report.note()


def _from(caller: str) -> str:
    return f" from {caller}" if caller else ""
