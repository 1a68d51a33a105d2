"""Connections to the internal services, with health tracking.

Each backend remembers whether its last call worked so that `Stats` can show which
dependencies are healthy, and the pipeline can degrade (skip the semantic tier, fall back to
ring routing) instead of failing.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from tiercache.v1 import common_pb2, kvpool_pb2, kvpool_pb2_grpc, semantic_pb2, semantic_pb2_grpc

from services.common import errors
from services.common.addresses import ShardRing, shard_fingerprint
from services.common.grpc_client import (
    call_metadata,
    cut_short,
    health_error,
    make_channel,
    tells_of_health,
    timeout_or,
    unary_call,
)
from services.common.metrics import SECONDS_BUCKETS, gauge, histogram
from services.common.shard_list import merged_note
from services.orchestrator.routing import ReplicaView

log = logging.getLogger(__name__)
T = TypeVar("T")

DEPENDENCY_HEALTHY = gauge(
    "tiercache_orchestrator_dependency_healthy",
    "1 while a dependency (kvpool replica, semantic or prefix tier or shard) is healthy as "
    "the orchestrator last found it, 0 once it failed a call or a health poll (a semantic "
    "tier that refused a Store for a full disk: until a Store succeeds); absent until its "
    "first call", ("dependency", "address"))
IN_FLIGHT = gauge("tiercache_orchestrator_replica_requests_in_flight",
                  "Generate calls this orchestrator has under way on each replica (by its "
                  "address): routing's own share of the replica's load", ("replica",))

# Only the tiers' own records said how they fared (health, degradations): a shard answering
# every Lookup, slowly, within its timeout, fired no alert and showed in no figure.
CALL_SECONDS = histogram(
    "tiercache_orchestrator_backend_call_seconds",
    "Time the orchestrator's calls to the other services take, by tier (semantic, prefix, "
    "kvpool), method (semantic Lookup, Store, Verify, Invalidate, Stats; prefix Match; kvpool "
    "Generate until the replica's first message or its failure, Prefill, Stats) and address "
    "(the shard or replica): failed calls included (a hung one at its timeout), not those "
    "skipped while a hung shard backs off nor those cancelled for a client gone",
    ("tier", "method", "address"),
    buckets=SECONDS_BUCKETS)


def timed(tier: str, method: str, address: str, fn: Callable[[], T]) -> T:
    """`fn()`, its time in CALL_SECONDS whatever its outcome, but for a call cancelled with
    its client (grpc.FutureCancelledError): that time is the client's, not the tier's."""
    t0: float | None = time.monotonic()
    try:
        return fn()
    except grpc.FutureCancelledError:
        t0 = None
        raise
    finally:
        if t0 is not None:
            CALL_SECONDS.labels(tier, method, address).observe(time.monotonic() - t0)


# Reasons a dependency's outage says at WARNING, its first included: each new one once.
MAX_REASONS_SAID = 4
_FIGURE = re.compile(r"\b\d+(\.\d+)?(ms|s)?\b")  # a count or a duration in a reason


@dataclass
class Health:
    name: str
    address: str
    healthy: bool = False
    last_error: str = ""
    last_ok: float = 0.0
    # Marked down by the health poller (a replica refusing Stats, e.g. draining): only the
    # poller brings it back, not a request that still finishes there.
    held_down: bool = False
    # The reasons said at WARNING since it went down (see `fail`).
    _said: set[str] = field(default_factory=set, repr=False, compare=False)
    # traffic_ok's check and set, against the poller's fail(hold=True) in between.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # Whether its state is a metric and its recovery a log line. Off for a sharded tier's own
    # record, which every shard's call sets in turn: with one shard down it flapped 0/1 with
    # the traffic mix (each shard's record says it; the tier's line in Stats is derived).
    exported: bool = True

    def ok(self) -> None:
        with self._lock:
            self._ok()

    def _ok(self) -> None:
        if not self.healthy and self.last_error and self.exported:
            # Said as its going down was: recovery was only visible in Stats. One never
            # healthy before (its line said "not healthy yet") is healthy, not "again".
            log.info("%s at %s is healthy%s", self.name, self.address,
                     " again" if self.last_ok else "")
        self._said.clear()
        self.healthy, self.last_error, self.last_ok = True, "", time.time()
        self.held_down = False
        self._export()

    def _export(self) -> None:
        if not self.exported:
            return
        # Labelled by the dependency's kind ("kvpool/kvpool-0" is "kvpool") and address: a
        # replica's name changes once its first Stats names it.
        DEPENDENCY_HEALTHY.labels(self.name.split("/")[0], self.address).set(
            1.0 if self.healthy else 0.0)

    def traffic_ok(self) -> None:
        """A call succeeded: healthy again, unless the poller holds it down."""
        with self._lock:
            if not self.held_down:
                self._ok()

    def fail(self, err: BaseException | str, hold: bool = False) -> None:
        msg = err.details() if isinstance(err, grpc.RpcError) else str(err)
        # A reason is new by its words, not its figures: a paused replica's "hung: 3 Stats
        # polls in a row ..." then "hung: 4 ...", "hung: 5 ..." was said at every poll and
        # used up the reasons said, so a real new one (UNAUTHENTICATED after a restart) was not.
        # Whole numbers only ("70s" too): a model id's "135M" stays a word.
        said_as = _FIGURE.sub("#", str(msg))
        with self._lock:
            if self.exported and (self.healthy or not self._said):
                # Never healthy yet (the orchestrator started while its replicas load, or an
                # address nothing answers): "is still unhealthy, now:" said a going-down that
                # no line had said.
                log.warning("%s at %s is %s: %s", self.name, self.address,
                            "unhealthy" if self.healthy or self.last_ok else "not healthy yet",
                            msg)
                self._said = {said_as}
            elif (self.exported and said_as not in self._said
                  and len(self._said) < MAX_REASONS_SAID):
                # A new reason while down is said too (a few per outage): a replica restarted
                # on another internal token read "Connection refused" from its restart in
                # the log for as long as it refused us UNAUTHENTICATED.
                log.warning("%s at %s is still unhealthy, now: %s", self.name, self.address,
                            msg)
                self._said.add(said_as)
            if hold or not self.held_down:
                # The poller's verdict stands in Stats while it holds the replica down: a
                # hung replica's calls, cancelled by the poller, said "Locally cancelled by
                # application!" there in place of why it was taken out.
                self.last_error = str(msg)
            self.healthy = False
            self.held_down = self.held_down or hold
            self._export()

    def proto(self) -> common_pb2.DependencyHealth:
        return common_pb2.DependencyHealth(name=self.name, address=self.address,
                                           healthy=self.healthy, last_error=self.last_error)


def tier_health(name: str, address: str, shards: Sequence[common_pb2.DependencyHealth]
                ) -> common_pb2.DependencyHealth:
    """A sharded tier's own health line, from its shards' lines: healthy only when every shard
    is, else which are not ("1 of 2 shards unhealthy: <address>"; their errors are on their own
    lines). The tier's call-by-call record followed whichever shard answered last, so a tier
    with a shard down read healthy whenever the other one had just answered."""
    down = [s.address for s in shards if not s.healthy]
    if not down:
        return common_pb2.DependencyHealth(name=name, address=address, healthy=True)
    return common_pb2.DependencyHealth(
        name=name, address=address, healthy=False,
        last_error=f"{len(down)} of {len(shards)} shards unhealthy: {', '.join(down)}")


class Polled:
    """A tier asked for its Stats in the background: its health gauges, set only by calls,
    stayed 0 after a recovery for as long as no request came (a "dependency down" alert
    firing on a healthy idle stack), and a tier gone down while no request came read
    healthy. Subclasses give `poll_once(every)`, `POLL_NAME` and `polled()`."""

    POLL_S = 5.0
    POLL_NAME = ""

    def poll_once(self, every: float = POLL_S) -> None:
        raise NotImplementedError

    def polled(self) -> bool:
        """Whether `start` polls at all."""
        return True

    def start(self, every: float = POLL_S) -> threading.Event:
        """Call `poll_once(every)` every `every` seconds on a daemon thread (when `polled()`);
        the returned event stops it (`stop`). An exception is logged and the loop goes on: a
        dead poller froze the gauges again."""
        self._stop_poll = stop = threading.Event()

        def loop() -> None:
            while True:
                try:
                    self.poll_once(every)
                except Exception:  # noqa: BLE001 - see above
                    log.exception("%s poll failed", self.POLL_NAME)
                if stop.wait(every):
                    return

        if self.polled():
            threading.Thread(target=loop, name=f"{self.POLL_NAME}-poll", daemon=True).start()
        return stop

    def stop(self) -> None:
        stop = getattr(self, "_stop_poll", None)
        if stop is not None:
            stop.set()


def with_note(line: common_pb2.DependencyHealth, note: str) -> None:
    """Mark `line` unhealthy with `note` (a shard's word that the shard lists it is reached by
    differ: every call succeeds while lookups go to the wrong shard) beside any error it has."""
    if note:
        line.last_error = f"{line.last_error}; {note}" if line.last_error else note
        line.healthy = False


@dataclass
class Replica:
    """One kvpool replica: its stub, last stats, and requests this orchestrator has in flight."""

    address: str
    stub: kvpool_pb2_grpc.KvPoolStub
    health: Health
    replica_id: str = ""
    stats: kvpool_pb2.KvStatsResponse | None = None
    inflight: int = 0
    # Our in-flight count when `stats` was taken: the part of the replica's figure that is ours.
    inflight_at_poll: int = 0
    # (stats, inflight_at_poll) as one value, replaced whole by the poller: `load` reads it
    # without the set's lock, and the two read one after the other could come from two polls
    # (a load of 10 where 5 was true, which put the replica holding a prefix over the cap).
    polled: tuple[kvpool_pb2.KvStatsResponse | None, int] = (None, 0)
    slow_polls: int = 0
    # A name for errors before the replica's first Stats answer ("kvpool#2"): see public_id.
    alias: str = ""
    # Called when the poller declares the replica unhealthy: in-flight calls on it cancel
    # themselves and fail over (a hung replica would otherwise hold them to their deadline);
    # a Warm's prefills and an EraseTenant's flushes are cancelled, not failed over (each
    # watcher's kind here, `ReplicaSet.watch`).
    watchers: dict[Callable[[], None], str] = field(default_factory=dict)
    # Times the poller has declared it down (`_notify_down`): `watch` compares it with the
    # count seen at routing.
    downs: int = 0
    # Why its last Stats answer says it can never serve this orchestrator (its id, another
    # model or block size; "" = none): kept out even of the last-resort routing.
    misfit: str = ""

    @property
    def public_id(self) -> str:
        """The id tenants may see: the replica's own, or, until its first Stats answer (when
        `replica_id` is still the address), a name that says nothing of the network."""
        if self.replica_id and self.replica_id != self.address:
            return self.replica_id
        return self.alias or "kvpool (not yet polled)"

    @property
    def load(self) -> float:
        """Active sequences: ours in flight now, plus the other callers' share of the last poll.

        The replica's own figure is up to a poll interval old. Taking it as the load (or the max
        of it and ours) counts a request of ours that has since finished, so a conversation's
        next turn could find its replica "over the cap" and be sent to one that holds nothing
        of it. Only what the poll counted beyond our own requests is carried over.
        """
        s, ours_at_poll = self.polled
        engine = (s.running + s.waiting) if s is not None else 0
        return self.inflight + max(0, engine - ours_at_poll)


def _cutting(kinds: Iterable[str]) -> str:
    """What a replica's down line says is done to its calls in flight (`kinds`: each one's
    kind, `ReplicaSet.watch`), naming only the kinds there are: requests fail over, a Warm's
    prefills and an EraseTenant's flushes are cancelled (the line counted a prefill as a
    request failing over, though it is not sent elsewhere)."""
    n = Counter(kinds)
    said = [f"failing over {n['request']} in-flight request(s)"] if n["request"] else []
    if n["prefill"]:
        said.append(f"cancelling {n['prefill']} warm prefill(s)")
    if n["flush"]:
        said.append(f"cancelling {n['flush']} erase flush(es)")
    return ", ".join(said)


def downs_by_address(replicas: Iterable[Replica]) -> dict[str, int]:
    """How often the poller has declared each replica (by address) down so far: read before
    their health for routing, and handed to `ReplicaSet.watch` as `downs_seen`, so that one
    declared down in between has its call cancelled at once."""
    return {r.address: r.downs for r in replicas}


@dataclass
class ReplicaSet:
    """All configured replicas, polled in the background for health and load."""

    addresses: tuple[str, ...]
    internal_token: str
    poll_s: float = 1.0
    # What every replica must serve (checked on each Stats poll; "" / 0 = not checked): one
    # with another model or block size is a deployment fault, kept out of routing.
    model_id: str = ""
    block_size: int = 0
    # A replica whose engine reports no finished turn for this long is held out of routing
    # and its in-flight calls fail over (see OrchestratorConfig.replica_stall_s); 0 = off.
    stall_s: float = 60.0
    # A Stats poll unanswered for stats_timeout_s is missed; hung_polls missed in a row mark
    # the replica hung (see OrchestratorConfig.replica_stats_timeout_s).
    stats_timeout_s: float = 2.0
    hung_polls: int = 3
    replicas: list[Replica] = field(default_factory=list)
    # Called with a replica's id when the poller finds it failed or restarted (its cache may be
    # gone): routing forgets what it sent there.
    on_lost: list[Callable[[str], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Answers are applied one at a time: a late one is applied on the asker's thread, and two
    # replicas left at one replica id, answering together, each passed the duplicate-id check
    # before the other took the id, and both entered routing.
    _applying: threading.RLock = field(default_factory=threading.RLock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _asker: ThreadPoolExecutor = field(init=False)
    # Each replica's Stats call still under way or not yet applied (index -> future): a hung
    # replica is not asked again until it answers or times out, and no poll cycle waits for it.
    _pending: dict[int, Future | None] = field(default_factory=dict)
    # What `unready` said last: None before it was first asked, then whether not ready.
    # Read, logged and written under `_said_lock`: each /readyz probe asks on its own thread,
    # and two at once both said a change (or one's late write undid the other's).
    _said_unready: bool | None = None
    _said_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for i, addr in enumerate(self.addresses):
            ch = make_channel(addr)
            self.replicas.append(Replica(addr, kvpool_pb2_grpc.KvPoolStub(ch),
                                         Health("kvpool", addr), replica_id=addr,
                                         alias=f"kvpool#{i}"))
        # All replicas asked at once: one at a time, each hung replica added its whole
        # timeout to every cycle, and every other replica's load and health went stale.
        self._asker = ThreadPoolExecutor(max_workers=min(32, max(1, len(self.replicas))),
                                         thread_name_prefix="replica-stats")

    def _ask(self, r: Replica) -> tuple[kvpool_pb2.KvStatsResponse, int]:
        """The replica's Stats, and our in-flight count there when it answered."""
        # Stats reads the last step's figures off the engine thread, so a long prefill does
        # not hold it up (tens of ms at worst on a busy CPU); still, only repeated silence
        # counts, as one slow answer may be a pause of the host.
        s = timed("kvpool", "Stats", r.address, lambda: r.stub.Stats(
            kvpool_pb2.KvStatsRequest(), timeout=self.stats_timeout_s,
            metadata=call_metadata(self.internal_token)))
        with self._lock:
            return s, r.inflight

    def poll_once(self) -> None:
        """Ask every replica for its Stats and apply each answer as it arrives. The cycle waits
        at most max(1 s, poll_s): an answer later than that (a hung replica's, which takes its
        whole `stats_timeout_s`) is applied when it comes, so one hung replica no longer
        stretches every cycle, and every other replica's load and health, to its timeout."""
        with self._lock:
            before = [r.inflight for r in self.replicas]
        if self._stop.is_set():  # the asker is shut down: a poll racing `stop` asks nothing
            return
        futs: dict[Future, int] = {}
        for i, r in enumerate(self.replicas):
            if i in self._pending:
                # Still asking, or its answer not yet applied (a future is done before its
                # callbacks run): a second ask could apply an older answer after a newer one.
                continue
            self._pending[i] = None
            try:
                fut = self._asker.submit(self._ask, r)
            except RuntimeError:  # shut down meanwhile (stop)
                self._pending.pop(i, None)
                return
            futs[fut] = i
            self._pending[i] = fut
        applied: set[Future] = set()
        try:
            # Each answer applied as it arrives: a hung replica first in the list must not
            # hold back the others' loads and health.
            for fut in as_completed(futs, timeout=max(1.0, self.poll_s)):
                applied.add(fut)
                self._apply(futs[fut], before[futs[fut]], fut)
        except FutureTimeout:
            for fut, i in futs.items():
                if fut not in applied:
                    fut.add_done_callback(lambda f, i=i, ours=before[i]: self._apply(i, ours, f))

    def _apply(self, i: int, ours_before: int, fut: Future) -> None:
        """Apply replica i's Stats answer (or failure); then it may be asked again."""
        try:
            if not self._stop.is_set():
                with self._applying:
                    self._apply_answer(i, ours_before, fut)
        finally:
            self._pending.pop(i, None)

    def _apply_answer(self, i: int, ours_before: int, fut: Future) -> None:
        r = self.replicas[i]
        try:
            s, ours_after = fut.result()
            self._answered(r, s, ours_before, ours_after)
        except grpc.RpcError as e:
            self._poll_failed(r, e)
        except Exception:  # noqa: BLE001 - one replica's odd answer must not stop the poll
            log.exception("polling replica %s failed", r.replica_id)

    def _answered(self, r: Replica, s: kvpool_pb2.KvStatsResponse, ours_before: int,
                  ours_after: int) -> None:
        """Replica `r` answered Stats with `s`: out of routing if it must not serve our
        requests or its engine stalled; else its load and id taken and it is healthy."""
        misfit = self._mismatch(s)
        wrong = misfit or self._id_taken(r, s)
        # Named by the id it answered with: one never healthy is still known by its alias.
        r.misfit = f"{s.replica_id or r.public_id}: {misfit}" if misfit else ""
        if wrong:
            if misfit and s.replica_id:
                # Named as a replica in routing is (its Stats line and log lines): it stayed
                # "kvpool", which of the replicas out of routing for another model unsaid.
                # (Not one answering under a taken id: that id is another's name.)
                with self._lock:
                    r.health.name = f"kvpool/{s.replica_id}"
            if r.health.healthy or r.health.last_error != wrong:
                log.error("replica %s at %s is out of routing: %s", s.replica_id,
                          r.address, wrong)
            r.health.fail(wrong, hold=True)
            r.slow_polls = 0  # it answered: the row of timed-out polls is broken
            self._lost(r)
            return
        restarted = (r.stats is not None and s.incarnation
                     and s.incarnation != r.stats.incarnation)
        # What routing sent to it was recorded under the id it had; a restart may bring
        # another (TIERCACHE_KVPOOL_REPLICA_ID changed), and the old one's records are
        # the ones to forget.
        known_as = r.replica_id
        with self._lock:
            r.stats = s
            # The replica counted at some moment during the call; attribute to us the
            # larger of our counts at either end, so ours never inflate the others'.
            r.inflight_at_poll = max(ours_before, ours_after)
            r.polled = (s, r.inflight_at_poll)
            r.replica_id = s.replica_id or r.address
            r.health.name = f"kvpool/{r.replica_id}"
            r.slow_polls = 0
        if restarted:
            self._lost(r, known_as)
        if self.stall_s > 0 and s.stalled_for_s >= self.stall_s:
            # Its gRPC server answers, its engine does not: requests sent there would
            # wait to their deadline. Out of routing, and in-flight calls fail over.
            why = (f"engine stalled: no step finished for {s.stalled_for_s:.0f}s "
                   f"(replica_stall_s {self.stall_s:g})")
            was = r.health.healthy
            r.health.fail(why, hold=True)
            if was:
                log.error("replica %s at %s is out of routing: %s", r.replica_id,
                          r.address, why)
                self._lost(r)
            self._notify_down(r)
            return
        r.health.ok()

    def _poll_failed(self, r: Replica, e: grpc.RpcError) -> None:
        """Replica `r`'s Stats call failed with `e`: out of routing unless it timed out fewer
        than hung_polls times in a row; a hung one has its in-flight calls cancelled."""
        # What it serves is not known now (restarting, maybe on our model): a last resort
        # again, and a request finding none is not told it serves another model.
        r.misfit = ""
        hung = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Consecutive timed-out polls: a refusal in between (draining) is not one.
        r.slow_polls = r.slow_polls + 1 if hung else 0
        if not hung or r.slow_polls >= self.hung_polls:
            # No new requests go there. A hung one is said so: "Deadline Exceeded" alone
            # did not say whose deadline, nor that the replica was taken out for it.
            r.health.fail(f"hung: {r.slow_polls} Stats polls in a row unanswered within "
                          f"{self.stats_timeout_s:g}s (replica_hung_polls "
                          f"{self.hung_polls})" if hung else e, hold=True)
            self._lost(r)
        if hung and r.slow_polls >= self.hung_polls:
            # Only a hung replica has its in-flight calls cancelled: one that refuses
            # Stats because it is draining (SIGTERM) still finishes its streams, and
            # one that died fails them itself (UNAVAILABLE), which fails them over.
            self._notify_down(r)

    def _mismatch(self, s: kvpool_pb2.KvStatsResponse) -> str:
        """Why a replica answering `s` must not serve this orchestrator's requests ("" = it
        may): another model (every request would be refused) or another block size (its
        prefix hashes would never match ours)."""
        if self.model_id and s.model_id and s.model_id != self.model_id:
            return f"it serves model {s.model_id!r}, this orchestrator {self.model_id!r}"
        if self.block_size and s.block_size and s.block_size != self.block_size:
            return f"its KV block size is {s.block_size}, this orchestrator's {self.block_size}"
        return ""

    def _id_taken(self, r: Replica, s: kvpool_pb2.KvStatsResponse) -> str:
        """Why `r` must stay out of routing because another address in routing already answers
        under its replica id ("" = none does). Two replicas left at the default id
        (kvpool-0) both looked healthy: one got every request, and the index, which keys
        holdings by id, swapped one for the other every heartbeat. The first to answer keeps
        the id; the other comes in once that one leaves routing."""
        rid = s.replica_id
        if not rid:
            return ""
        with self._lock:
            other = next((o for o in self.replicas if o is not r and o.replica_id == rid
                          and o.stats is not None and o.health.healthy), None)
        if other is None:
            return ""
        return (f"replica id {rid!r} is also answered by {other.address}: give each replica "
                "its own TIERCACHE_KVPOOL_REPLICA_ID")

    def _lost(self, r: Replica, replica_id: str | None = None) -> None:
        """Tell the listeners that `r`'s cache is gone, under `replica_id` (by default the
        id it has now)."""
        for fn in self.on_lost:
            try:
                fn(replica_id or r.replica_id)
            except Exception:  # a listener must not stop the poller
                log.exception("on_lost listener failed")

    def _notify_down(self, r: Replica) -> None:
        with self._lock:
            r.downs += 1
            watchers = dict(r.watchers)
        if watchers:
            log.warning("replica %s is down: %s", r.replica_id, _cutting(watchers.values()))
        for fn in watchers:
            try:
                fn()
            except Exception:  # a watcher must not stop the poller
                log.exception("replica-down watcher failed")

    def watch(self, r: Replica, fn: Callable[[], None], downs_seen: int | None = None,
              kind: str = "request") -> None:
        """Call `fn` if the poller declares `r` down (until `unwatch`); `kind`: what `fn` cuts,
        "request" (failed over), "prefill" (a Warm's) or "flush" (an EraseTenant's), both
        cancelled (its down line says which is which).

        `downs_seen`: `r.downs` when the call was routed there. If the poller declared it down
        since (between routing and this watch), `fn` is called at once: that call was sent
        to a replica just found hung, and nothing else would cancel it before its deadline.
        (One routed to a replica already down, as a last resort when none is healthy, is
        left to run.)"""
        with self._lock:
            r.watchers[fn] = kind
            missed = downs_seen is not None and r.downs != downs_seen
        if missed:
            fn()

    def unwatch(self, r: Replica, fn: Callable[[], None]) -> None:
        with self._lock:
            r.watchers.pop(fn, None)

    def start(self) -> None:
        self.poll_once()
        threading.Thread(target=self._loop, name="replica-poll", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - a dead poller froze health and loads for good
                log.exception("replica poll failed")

    def stop(self) -> None:
        self._stop.set()
        self._asker.shutdown(wait=False)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.health.healthy]

    def unready(self) -> str:
        """Why this orchestrator must not take traffic now ("" = it may): no replica serving
        its model id (and block size) is healthy. Its readiness (`/readyz`): it said ready
        with none, so a rolling update to another model id replaced every old orchestrator
        (whose replicas still served) with new ones that could only refuse. Said in the log
        as it changes, when asked (each readiness probe)."""
        healthy = self.healthy()
        if healthy:
            with self._said_lock:
                if self._said_unready:
                    log.info("ready (/readyz): healthy kvpool replica(s) %s",
                             ", ".join(r.replica_id for r in healthy))
                self._said_unready = False
            return ""
        with self._lock:
            # A replica on another model is named by the id it answered with (its misfit).
            lines = [r.misfit[:200] or f"{r.public_id}: "
                     f"{r.health.last_error[:200] or 'not answered yet'}" for r in self.replicas]
        why = (f"no healthy kvpool replica serves model {self.model_id!r}" if self.model_id
               else "no kvpool replica is healthy") + f" ({'; '.join(lines)})"
        with self._said_lock:
            if self._said_unready is None:  # starting: the replicas may still be loading
                log.info("not ready yet (/readyz): %s", why)
            elif not self._said_unready:
                log.warning("not ready (/readyz) until a replica is back: %s", why)
            self._said_unready = True
        return why

    def _routable(self) -> list[Replica]:
        return self.healthy() or [r for r in self.replicas if not r.misfit]

    def views(self) -> list[ReplicaView]:
        """Replicas to route to: the healthy ones, or every one when none is known healthy
        (at start-up, or after a network blip) — trying costs one fast connection error.
        Never one that said it serves another model or block size: mid-roll (every replica
        on the new model, this orchestrator not yet), each request was sent to every replica
        in turn, refused by each, and logged an ERROR and a WARNING per replica."""
        live = self._routable()
        return [ReplicaView(r.replica_id, r.load,
                            r.stats.blocks_free if r.stats is not None else -1) for r in live]

    def misfits(self) -> str:
        """Why routing has no replica because of the deployment ("" = not so): every replica
        said it serves another model (or block size). Names both ids and what to set."""
        with self._lock:
            why = [r.misfit for r in self.replicas]
        if not why or not all(why):
            return ""
        return ("no kvpool replica serves this orchestrator's model: " + "; ".join(why)
                + ". Set the orchestrator's TIERCACHE_ORCHESTRATOR_MODEL and _MODEL_ID (and "
                "_BLOCK_SIZE) to the replicas', or restart the replicas on this one's")

    def by_id(self, replica_id: str) -> Replica | None:
        """The replica named `replica_id`, also by its address: a replica is known by its
        address until its first Stats answer names it, which may land between routing and
        this lookup."""
        for r in self.replicas:
            if r.replica_id == replica_id:
                return r
        for r in self.replicas:
            if r.address == replica_id:
                return r
        return None

    def max_context(self) -> int:
        """The smallest model context the replicas routing can use report (0 = none has
        answered Stats yet): a request longer than it could be refused by the replica it is
        routed to. Those routing cannot use (down, stalled, gone) do not count: one with a
        smaller context that had crashed or been scaled away still cut every request short;
        nor one on another model (its figures are the old model's, from before it changed)."""
        live = self._routable()
        with self._lock:
            sizes = [r.stats.max_context for r in live
                     if r.stats is not None and r.stats.max_context]
        return min(sizes, default=0)

    def begin(self, r: Replica) -> None:
        with self._lock:
            r.inflight += 1
            IN_FLIGHT.labels(r.address).set(r.inflight)

    def end(self, r: Replica) -> None:
        with self._lock:
            r.inflight -= 1
            IN_FLIGHT.labels(r.address).set(r.inflight)


class _SkippedShard(grpc.RpcError):
    """A shard skipped while it is hung (see HungBackoff)."""

    def __init__(self, what: str, address: str, left_s: float) -> None:
        super().__init__()
        self._details = f"{what} {address} hung: skipped for another {left_s:.1f}s"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class ShardFoundHung(grpc.RpcError):
    """A call cancelled as the shard was found hung (`SemanticBackend.call_unless_hung`)."""

    def __init__(self, method: str, timeout_s: float) -> None:
        super().__init__()
        self._details = (f"found hung: a call to it ran out the tier's whole timeout "
                         f"({timeout_s:g}s) meanwhile; its {method} cancelled (call again)")

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class HungBackoff:
    """Skips a cache tier's shard while it is hung (a call ran out its whole timeout), for
    `backoff_s[0]` seconds, doubling up to `backoff_s[1]` while it stays hung; then one call
    probes it again. Without it every request waits the tier's timeout on a tier that answers
    nobody (the semantic tier twice: Lookup, then Store).

    `call` runs one call under it (raising `_SkippedShard`, UNAVAILABLE, while the pause
    lasts).
    """

    def __init__(self, what: str, backoff_s: tuple[float, float],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.backoff_s = backoff_s
        self.clock = clock
        self.state: dict[str, tuple[float, float]] = {}  # address -> (skip until, backoff)
        self.marked: dict[str, float] = {}  # address -> when a timeout last set it
        # address -> what to call when a timeout marks it hung (`watch`).
        self.watchers: dict[str, set[Callable[[], None]]] = {}
        self.lock = threading.Lock()

    def watch(self, address: str, fn: Callable[[], None], marked_seen: float | None) -> None:
        """Call `fn` when a call's timeout marks `address` hung (until `unwatch`), at once
        if one has since `marked_seen` (its `marked` record then)."""
        with self.lock:
            self.watchers.setdefault(address, set()).add(fn)
            missed = self.marked.get(address) != marked_seen
        if missed:
            fn()

    def unwatch(self, address: str, fn: Callable[[], None]) -> None:
        with self.lock:
            self.watchers.get(address, set()).discard(fn)

    def call(self, address: str, timeout: float, full_s: float, fn: Callable[[], T]) -> T:
        """`fn()`, a call of `timeout` seconds to `address` (the tier's own timeout is
        `full_s`: a shorter one may be cut short by the request, see `cut_short`)."""
        # A probe given longer than the tier's timeout (an EraseTenant's Invalidate) holds
        # the others off only that long: it held off every call, the health poll's too, for
        # its whole 120 s, and nothing marked the shard hung meanwhile (`watch`).
        began, hung, probe = self.enter(address, min(timeout, full_s))
        try:
            out = fn()
        except grpc.RpcError as e:
            self.failed(address, e, timeout, not cut_short(e, timeout, full_s), began, hung,
                        probe)
            raise
        except grpc.FutureCancelledError:
            # Cancelled by its own request: nothing learnt of the shard. A probe's turn
            # passes to the next call.
            if hung is not None:
                with self.lock:
                    self._probe_again(address, probe, hung[1])
            raise
        self.answered(address)
        return out

    def enter(self, address: str, timeout: float
              ) -> tuple[float, tuple[float, float] | None, tuple[float, float] | None]:
        """Before a call of `timeout` seconds: (when it began, the hung record it probes, the
        record it set as the probe)."""
        began = self.clock()
        probe = None
        with self.lock:
            hung = self.state.get(address)
            if hung is not None:
                now = self.clock()
                if now < hung[0]:
                    raise _SkippedShard(self.what, address, hung[0] - now)
                # The pause is over: this call probes the shard; the others keep skipping it
                # until the probe answers or times out.
                probe = self.state[address] = (now + timeout, hung[1])
        return began, hung, probe

    def _probe_again(self, address: str, probe: tuple[float, float] | None, back: float) -> None:
        """A probe that learnt nothing: the next call probes, unless the record is no longer
        this probe's (another call got an answer meanwhile and cleared it, or marked the
        shard hung again): a stale probe must not bring back a cleared record. Under
        `self.lock`."""
        if self.state.get(address) == probe:
            self.state[address] = (self.clock(), back)

    def answered(self, address: str) -> None:
        with self.lock:
            self.state.pop(address, None)

    def failed(self, address: str, e: grpc.RpcError, timeout: float, whole: bool,
               began: float, hung: tuple[float, float] | None,
               probe: tuple[float, float] | None = None) -> None:
        """The call failed with `e`; `whole`: not a deadline the request's own shorter
        timeout ran into (see `cut_short`)."""
        code = e.code()
        watchers: list[Callable[[], None]] = []
        with self.lock:
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and whole:
                # Hung: it let a call run out its whole timeout. The back-off grows from
                # what is recorded now (a call begun before another marked the shard
                # hung held no record, and reset a grown back-off to the first one), and
                # once per stall: calls under way together when it stalled time out
                # together, and each doubled it (one hiccup skipped the shard 5 s).
                first, most = self.backoff_s
                now_hung = self.state.get(address)
                if now_hung is None or self.marked.get(address, -math.inf) <= began:
                    back = min(most, now_hung[1] * 2) if now_hung is not None else first
                    self.state[address] = (self.clock() + back, back)
                    self.marked[address] = self.clock()
                    watchers = list(self.watchers.get(address, ()))
                    log.warning("%s %s timed out (%.1fs): skipped for %.1fs", self.what,
                                address, timeout, back)
            elif hung is not None and code == grpc.StatusCode.DEADLINE_EXCEEDED:
                # The probe ran out of its request's own time: nothing learnt, the next
                # call probes again (the back-off stays), unless another call answered or
                # marked it meanwhile (the record is no longer this probe's).
                self._probe_again(address, probe, hung[1])
            elif hung is not None:
                self.state.pop(address, None)  # the probe got an answer (an error)
        for fn in watchers:
            fn()


class SemanticBackend(Polled):
    """The semantic cache (one process or N shards), or nothing when no address is configured.

    Shards own whole namespaces: Lookup/Store go to the shard a consistent-hash ring picks for
    `tenant|model|context`, so a namespace's entries are all in one place and adding a shard
    moves ~1/N of them. Verify/Invalidate by id ask every shard (ids do not name a shard;
    feedback is rare). Stats are summed.
    """

    # A shard whose call ran out its whole timeout (hung, not down) is skipped for this long,
    # doubling while it stays hung, then one call tries it again: otherwise every request
    # would wait the timeout twice (Lookup, then Store) for a tier that answers nobody.
    HUNG_BACKOFF_S = (0.5, 5.0)

    def __init__(self, address: str, internal_token: str, timeout_s: float,
                 clock=time.monotonic) -> None:
        self.addresses = [a.strip() for a in address.split(",") if a.strip()]
        self.enabled = bool(self.addresses)
        # The tier's record of its calls: Stats' line for one shard (with several, see
        # `dependencies`: it would follow whichever shard answered last).
        self.health = Health("semantic", ",".join(self.addresses),
                             exported=len(self.addresses) == 1)
        # Each shard's own.
        self.shard_health = {a: Health("semantic shard", a, exported=len(self.addresses) > 1)
                             for a in self.addresses}
        self.timeout_s = timeout_s
        self.hung = HungBackoff("semantic shard", self.HUNG_BACKOFF_S, clock)
        self._hung = self.hung.state  # address -> (skip until, backoff)
        self.internal_token = internal_token
        self.stubs = {a: semantic_pb2_grpc.SemanticCacheStub(make_channel(a))
                      for a in self.addresses}
        # Placed by canonical address: orchestrators that spell a shard differently
        # (dns:///, case, a trailing dot) keep each namespace on the same shard.
        self.ring = ShardRing(self.addresses)
        # Sent with Lookup and Store: a shard that sees orchestrators place by different lists
        # (a shard one lists and another lacks: each stores namespaces where the others do not
        # look) says so in its Stats. The same fingerprint as the prefix tier's lists.
        self.shard_list = common_pb2.ShardList(shards=len(self.addresses),
                                               fingerprint=shard_fingerprint(self.addresses))
        # address -> the shard's own word on the shard lists it sees differ (its last Stats;
        # "" = none).
        self.shard_list_notes: dict[str, str] = {}
        # address -> the shard's threshold_floor (its Stats; 0 = not said yet, or an older
        # shard): requests' explicit thresholds are checked against the highest even while the
        # tier is skipped, so such a request is refused alike whether the tier is up or not.
        self.floors: dict[str, float] = {}
        # Shards whose last Store was refused RESOURCE_EXHAUSTED (a full or read-only disk):
        # only a Store that succeeds brings them back. Any call's success did, and every
        # request's Lookup then flipped the line healthy between two refused Stores: the
        # gauge read 1 or 0 by the traffic mix (an alert on it missed the incident) and the
        # log had an "unhealthy" / "healthy again" pair per request.
        self._store_refused: set[str] = set()

    def threshold_floor(self) -> float:
        """The highest threshold_floor the shards have said (0.0 before any has)."""
        return max(self.floors.values(), default=0.0)

    # Every shard is asked for its Stats (`Polled.start`); the gauge was also absent until the
    # first request.
    POLL_NAME = "semantic"

    def polled(self) -> bool:
        return self.enabled

    def poll_once(self, every: float = Polled.POLL_S) -> None:
        """Stats on each shard: its health, and its threshold_floor (asked of busy shards
        too: a shard restarted with another floor said it only to an idle poll, and requests
        were checked against the old one)."""
        for a in self.addresses:
            try:
                reply = self._call(a, "Stats", semantic_pb2.SemanticStatsRequest(),
                                   min(self.timeout_s, every))
            except grpc.RpcError:
                continue  # marked down by _call (a hung shard: skipped while it backs off)
            self._took_stats({a: reply})

    def _took_stats(self, replies: dict[str, Any]) -> None:
        """Keep what shards' Stats (by address) say beyond their figures: their word on shard
        lists (`dependencies`) and their threshold_floor (`threshold_floor`)."""
        self.shard_list_notes.update({a: r.shard_list_mismatch for a, r in replies.items()})
        self.floors.update({a: r.threshold_floor for a, r in replies.items()})

    def dependencies(self) -> list[common_pb2.DependencyHealth]:
        """Stats' health entries: the tier's, and with shards each shard's, the tier's then
        derived from theirs (`tier_health`).

        A shard that said in its last Stats that orchestrators call it with different shard
        lists reads unhealthy, saying so: namespaces one stores there are looked up elsewhere
        by another (or the reverse), though each call succeeds."""
        if len(self.addresses) <= 1:
            line = self.health.proto()
            with_note(line, self.shard_list_notes.get(self.health.address, ""))
            return [line]
        shards = [h.proto() for h in self.shard_health.values()]
        for sh in shards:
            if not sh.healthy and not sh.last_error:
                sh.last_error = "no call yet"  # as prefix shards say it
            with_note(sh, self.shard_list_notes.get(sh.address, ""))
        return [tier_health(self.health.name, self.health.address, shards), *shards]

    def shard_for(self, ns: semantic_pb2.Namespace) -> str:
        if len(self.addresses) == 1:
            return self.addresses[0]
        return self.ring.lookup(f"{ns.tenant}|{ns.model_id}|{ns.context_hash}")

    def _call(self, address: str, method: str, req, timeout: float | None = None,
              on_call: Callable[[grpc.Future], None] | None = None):
        """One call of `method` on the shard at `address`. With `on_call`, the call is made
        as a future, handed to `on_call` as it starts: cancelled (the request's client went
        away), it raises grpc.FutureCancelledError at once, and counts for nothing against
        the shard."""
        timeout = timeout_or(timeout, self.timeout_s)
        rpc = getattr(self.stubs[address], method)
        md = call_metadata(self.internal_token)
        try:
            resp = self.hung.call(address, timeout, self.timeout_s, lambda: timed(
                "semantic", method, address,
                lambda: unary_call(rpc, req, on_call, timeout=timeout, metadata=md)))
            if method == "Store":
                self._store_refused.discard(address)
            if address not in self._store_refused:
                self.health.ok()
                self.shard_health[address].ok()
            return resp
        except grpc.RpcError as e:
            if isinstance(e, _SkippedShard):
                raise
            if tells_of_health(e, timeout, self.timeout_s):
                # Not only down or hung: a tier refusing our credential (UNAUTHENTICATED) or
                # every Store (RESOURCE_EXHAUSTED: a full disk) does no work either, and
                # Stats must say so. A request's own bad input or an unknown id is not the
                # tier's fault.
                why = health_error(e, timeout, self.timeout_s)
                if method == "Store" and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._store_refused.add(address)
                self.health.fail(why)
                self.shard_health[address].fail(why)
            raise

    def call_unless_hung(self, address: str, method: str, req, timeout: float):
        """`_call` given `timeout`, longer than the tier's own (an EraseTenant's Invalidate: a
        healthy shard takes about a second per 100k entries, answering its health polls
        meanwhile), cancelled once another call to the shard (the health poll's Stats, every
        POLL_S) runs out the tier's whole timeout meanwhile: the shard is hung. A SIGSTOPped
        shard's erase waited for gRPC's keepalive (77 s). Raises ShardFoundHung then."""
        seen = self.hung.marked.get(address)
        calls: list[grpc.Future] = []
        found = threading.Event()

        def cancel() -> None:
            found.set()
            for call in calls:
                call.cancel()

        def on_call(call: grpc.Future) -> None:
            calls.append(call)
            self.hung.watch(address, cancel, seen)

        try:
            return self._call(address, method, req, timeout, on_call=on_call)
        except grpc.FutureCancelledError:
            if not found.is_set():
                raise
            raise ShardFoundHung(method, self.timeout_s) from None
        finally:
            self.hung.unwatch(address, cancel)

    def _each(self, method: str, req, deadline: float | None = None,
              on_call: Callable[[grpc.Future], None] | None = None
              ) -> tuple[dict[str, Any], Exception | None]:
        """Call every shard: the answers of those that had it (by address, in the shards'
        order), and why some shard did not answer (None if every one did, NOT_FOUND aside).

        A shard that is down does not hide the answer of one that acted (the entry lives on
        one shard: a rating applied there must not be reported as failed). With no answer,
        another error wins over NOT_FOUND (the entry may be on the shard that failed).
        `deadline` (time.monotonic()) bounds the whole round: each shard gets what is left of
        it, and none is called once it has passed (DeadlineExceeded if none answered).
        `on_call`: see `_call` (a Feedback cancels its call when its client goes; the round
        then ends with grpc.FutureCancelledError).
        """
        out: dict[str, Any] = {}
        not_found: grpc.RpcError | None = None
        failed: Exception | None = None
        for a in self.addresses:
            timeout = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    failed = failed or errors.DeadlineExceeded(
                        f"deadline exceeded before the semantic tier answered {method}")
                    break
                timeout = min(self.timeout_s, left)
            try:
                out[a] = self._call(a, method, req, timeout, on_call=on_call)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    not_found = e
                else:
                    failed = failed or e
        if out:
            return out, failed
        raise failed or not_found or RuntimeError("no semantic shard configured")

    def lookup(self, req: semantic_pb2.LookupRequest, timeout: float | None = None,
               on_call: Callable[[grpc.Future], None] | None = None
               ) -> semantic_pb2.LookupResponse:
        """`on_call`: see `_call` (the request cancels its lookup when its client goes).
        `req` is sent with this orchestrator's shard list (set here)."""
        req.shard_list.CopyFrom(self.shard_list)
        return self._call(self.shard_for(req.namespace), "Lookup", req, timeout, on_call)

    def store(self, req: semantic_pb2.StoreRequest, timeout: float | None = None,
              on_call: Callable[[grpc.Future], None] | None = None
              ) -> semantic_pb2.StoreResponse:
        """`on_call`: see `_call` (the request cancels its Store when its client goes).
        `req` is sent with this orchestrator's shard list (set here)."""
        req.shard_list.CopyFrom(self.shard_list)
        return self._call(self.shard_for(req.namespace), "Store", req, timeout, on_call)

    def verify(self, entry_id: str, verified: bool, deadline: float | None = None,
               on_call: Callable[[grpc.Future], None] | None = None
               ) -> semantic_pb2.SemanticEntry:
        got, _ = self._each("Verify", semantic_pb2.VerifyRequest(id=entry_id, verified=verified),
                            deadline, on_call)
        return next(iter(got.values()))

    def invalidate(self, entry_id: str, deadline: float | None = None,
                   on_call: Callable[[grpc.Future], None] | None = None
                   ) -> semantic_pb2.InvalidateResponse:
        got, failed = self._each("Invalidate", semantic_pb2.InvalidateRequest(id=entry_id),
                                 deadline, on_call)
        removed = sum(r.removed for r in got.values())
        if removed == 0 and failed is not None:
            # The shards that answered do not hold it; the one that did not may: "unknown"
            # would tell the client not to retry while the entry is still served.
            raise failed
        return semantic_pb2.InvalidateResponse(removed=removed)

    def stats(self, deadline: float | None = None) -> semantic_pb2.SemanticStatsResponse:
        """Every shard's figures summed. `shards_answered` < `shards_total` says some shard's
        are missing (it was down or slow), rather than the sum passing for the whole tier's.
        Each shard's word on differing shard lists is kept for `dependencies` and joined,
        prefixed with its address when there are several shards."""
        got, _ = self._each("Stats", semantic_pb2.SemanticStatsRequest(), deadline)
        self._took_stats(got)
        notes = merged_note({a: r.shard_list_mismatch for a, r in got.items()},
                            len(self.addresses) > 1)
        parts = list(got.values())
        if len(parts) == 1:
            out = semantic_pb2.SemanticStatsResponse()
            out.CopyFrom(parts[0])
            out.shards_total, out.shards_answered = len(self.addresses), 1
            out.shard_list_mismatch = notes
            return out
        out = semantic_pb2.SemanticStatsResponse(embedding_model=parts[0].embedding_model,
                                                 shards_total=len(self.addresses),
                                                 shards_answered=len(parts),
                                                 shard_list_mismatch=notes)
        for p in parts:
            for f in ("entries", "namespaces", "lookups_total", "near_misses_total",
                      "guard_rejections_total", "evictions_total", "expirations_total",
                      "shard_list_mismatches_total"):
                setattr(out, f, getattr(out, f) + getattr(p, f))
            for tier, n in p.hits_by_tier.items():
                out.hits_by_tier[tier] += n
            # Percentiles do not add up; the slowest shard's is the honest cluster figure.
            out.lookup_p50_ms = max(out.lookup_p50_ms, p.lookup_p50_ms)
            out.lookup_p99_ms = max(out.lookup_p99_ms, p.lookup_p99_ms)
            out.threshold_floor = max(out.threshold_floor, p.threshold_floor)
        return out
