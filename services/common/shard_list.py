"""How a shard reports that the shard lists its callers place keys by differ (prefix and
semantic tiers alike).

Whoever places keys on a sharded tier builds its own consistent-hash ring from its own list
(`services.common.addresses`). Two lists that really differ (a shard on one side only, two
names for one host) send keys to one shard and their lookups to another, and every call
succeeds: nothing fails, the cache just misses. So callers send their list's size and
fingerprint (`ShardList` in common.proto), and a shard that sees two lists differ says so.
What a shard compares is its tier's (`services.prefix.shard_list`: replicas' lists against
Matches'; `services.semantic.shard_list`: orchestrators' against each other); how it says it
is here: `MismatchReport` counts each mismatch (the tier's metric), logs a warning at most once
a minute (a misconfigured caller mismatches on every call), and gives Stats a note for 5
minutes after the last one. A mismatch never fails the call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from prometheus_client import Counter

# How long Stats go on saying a mismatch after the last one seen.
SHOWN_SECONDS = 300.0
# At most one warning per this long.
WARN_EVERY_SECONDS = 60.0


class ShardList(NamedTuple):
    """A caller's shard list as sent: its size and `shard_fingerprint` ("" = not said)."""

    shards: int
    fingerprint: str

    def __str__(self) -> str:
        # Ours are hex. Any other is a caller's text, which went as sent into Stats' note, the
        # warning and `tiercache stats`' stderr ("\x1b[2J" cleared the operator's terminal).
        fp = self.fingerprint
        shown = fp if fp.isascii() and fp.isprintable() else ascii(fp)
        return f"{self.shards} shard{'s' * (self.shards != 1)} ({shown})"

    def differs(self, other: ShardList) -> bool:
        """Whether keys placed by the two lists may land on different shards. Two lists of
        one shard each never do (nothing is placed: one shard may be named differently on
        each side)."""
        return self.fingerprint != other.fingerprint and max(self.shards, other.shards) > 1


def said(sent: Any) -> str:
    """A side's own list as its client sends it (a `common_pb2.ShardList`: size and
    fingerprint), named as a mismatch note names lists ("2 shards (40798ea3909ab9e3)"), for
    its start line: notes name fingerprints only, and no log said which pod had which, so with
    several orchestrators the one on the old list could not be found."""
    return str(ShardList(sent.shards, sent.fingerprint))


def merged_note(notes: Mapping[str, str], sharded: bool) -> str:
    """A client's one note from its shards' (address -> note, "" = none), as its Stats merge
    them: each prefixed with the shard's address when there are several."""
    return "; ".join(f"{a}: {n}" if sharded else n for a, n in notes.items() if n)


class MismatchReport:
    """The mismatches a shard saw: counted, warned of, and said in Stats for a while. Not
    thread-safe: callers hold their own lock.

    `tier` opens the warning ("prefix shard lists differ: ..."), `between` the note ("shard
    list differs between orchestrators: ..."); `calls` names the calls counted, one and
    several (("Match", "Matches"): "1 such Match", not "1 such Matches"), and `advice` ends
    the warning with what a mismatch does and how to fix it.
    """

    def __init__(self, clock: Callable[[], float], metric: Counter, log: logging.Logger, *,
                 tier: str, between: str, calls: tuple[str, str], advice: str) -> None:
        self.clock = clock
        self.metric = metric
        self.log = log
        self.tier, self.between, self.calls, self.advice = tier, between, calls, advice
        self.total = 0
        self._last: tuple[float, str] | None = None
        self._warned_at: float | None = None
        self._unwarned = 0  # mismatches since the last warning

    def record(self, what: str) -> None:
        """One mismatch; `what` says which lists ("replica r0 registered with 2 shards (..), a
        Match came with 1 shard (..)")."""
        now = self.clock()
        self.total += 1
        self.metric.inc()
        self._last = (now, what)
        self._unwarned += 1
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_SECONDS:
            self.log.warning("%s shard lists differ: %s (%d such %s since the last warning); "
                             "%s", self.tier, what, self._unwarned,
                             self.calls[self._unwarned != 1], self.advice)
            self._warned_at, self._unwarned = now, 0

    def note(self) -> str:
        """Stats' word on it: the last mismatch while it is recent, else ""."""
        if self._last is None:
            return ""
        at, what = self._last
        ago = self.clock() - at
        if ago > SHOWN_SECONDS:
            return ""
        return (f"shard list differs between {self.between}: {what} {ago:.0f} s ago "
                f"({self.total} such {self.calls[self.total != 1]} in all)")
