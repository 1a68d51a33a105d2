"""Tells the prefix index what this replica holds: Register, Heartbeat, PublishEvents.

The index may be one process or N shards (`address` = "host:port[,host:port...]"): the
sharded client (`services.common.prefix_client`) registers and heartbeats on every shard,
sends each stored chain to the shard that owns its first block's hash and removals to every
shard, and keeps one batch sequence per shard.

One background thread. It registers (replica id, a fresh incarnation per boot, address,
model id, block size, capacity), sends its full holdings as a resync batch, then publishes
the pool's events in numbered batches (1, 2, 3...) and heartbeats with its load. When the
index answers RESYNC (a gap, or it restarted) or a heartbeat says "unknown", the replica
re-registers and sends a fresh snapshot. The index is advisory: when it is down, the
replica keeps serving and catches up with a resync later.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from tiercache.v1 import prefix_pb2

from services.common.grpc_client import make_channel
from services.common.prefix_client import PrefixIndexClient, batch_blocks
from services.common.shard_list import said
from services.kvpool.block_pool import AllCleared, BlocksRemoved, BlocksStored, PoolEvent
from services.kvpool.engine import result_unless_late

log = logging.getLogger(__name__)

# Beyond this many unsent events (the index unreachable, or slower than the pool changes), drop
# them and resync instead.
# Only incremental events count: the rest of a snapshot waiting to go out is not a backlog (a
# replica may hold more blocks than this).
MAX_BACKLOG = 50_000
# ... or beyond this many times the pool's blocks in the events taken since the backlog was
# last empty: an event carries its tokens (a 512-token prefill's ~23 KB of Python ints), so
# 50,000 events could hold ~1 GB per replica, while a snapshot is never larger than the pool.
MAX_BACKLOG_POOLS = 2
MAX_BATCH = 512
# Blocks per batch when the index does not say its limit (its default).
MAX_BATCH_BLOCKS = 65536
# While the index stays unreachable, its failed tries are a WARNING this often (DEBUG between).
OUTAGE_WARNING_EVERY_S = 60.0
# How long a resync waits for the engine thread to take its snapshot (between two steps).
SNAPSHOT_TIMEOUT = 60.0


def to_proto(ev: PoolEvent) -> prefix_pb2.KvEvent:
    """A pool event as the index's KvEvent."""
    if isinstance(ev, BlocksStored):
        return prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
            parent_hash=ev.parent_hash or b"", block_hashes=ev.block_hashes,
            token_ids=ev.token_ids, cache_salt=ev.cache_salt,
            first_block_hash=ev.first_block_hash, start_block=ev.start_block))
    if isinstance(ev, BlocksRemoved):
        return prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(block_hashes=ev.block_hashes))
    assert isinstance(ev, AllCleared)
    return prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared())


def _blocks(ev: PoolEvent) -> int:
    return 0 if isinstance(ev, AllCleared) else len(ev.block_hashes)


def _split(ev: PoolEvent, n: int, block_size: int) -> tuple[PoolEvent, PoolEvent]:
    """`ev`'s first `n` blocks, and the rest: a stored chain's second part continues after the
    first part's last block."""
    if isinstance(ev, BlocksRemoved):
        return BlocksRemoved(ev.block_hashes[:n]), BlocksRemoved(ev.block_hashes[n:])
    assert isinstance(ev, BlocksStored)
    cut = n * block_size
    return (ev._replace(block_hashes=ev.block_hashes[:n], token_ids=ev.token_ids[:cut]),
            ev._replace(parent_hash=ev.block_hashes[n - 1], block_hashes=ev.block_hashes[n:],
                        token_ids=ev.token_ids[cut:], start_block=ev.start_block + n))


def next_batch(events: list[PoolEvent], max_events: int, max_blocks: int, block_size: int
               ) -> tuple[list[PoolEvent], list[PoolEvent]]:
    """The next batch within the index's limits, and what is left. An event with more blocks
    than a batch may carry is split (a batch over the limits was refused RESOURCE_EXHAUSTED,
    retried as transient for ever, and the index never heard of this replica again)."""
    batch: list[PoolEvent] = []
    room = max_blocks
    for i, ev in enumerate(events):
        if len(batch) >= max_events:
            return batch, events[i:]
        b = _blocks(ev)
        if b > room:
            if room == 0:
                return batch, events[i:]
            head, tail = _split(ev, room, block_size)
            return [*batch, head], [tail, *events[i + 1:]]
        batch.append(ev)
        room -= b
    return batch, []


class Publisher:
    """Background publisher of one replica's pool events to the prefix index.

    Args:
        engine: the replica's Engine (events, stats, snapshot calls).
        address: prefix index host:port, or comma-separated shard addresses.
        replica_id, incarnation, public_address, model_id: what the index is told.
        heartbeat_seconds / publish_interval_seconds: cadence.
        internal_token: credential for the index.
        channel_factory: builds the channel (tests may pass their own).
    """

    def __init__(self, engine: Any, *, address: str, replica_id: str, incarnation: str,
                 public_address: str, model_id: str, heartbeat_seconds: float = 2.0,
                 publish_interval_seconds: float = 0.2, internal_token: str = "",
                 channel_factory: Callable[[str], grpc.Channel] = make_channel) -> None:
        self.engine = engine
        self.address = address
        self.replica_id = replica_id
        self.incarnation = incarnation
        self.public_address = public_address
        self.model_id = model_id
        self.heartbeat_seconds = heartbeat_seconds
        self._beat_every = heartbeat_seconds  # shortened to a third of a shorter lease
        self.publish_interval_seconds = publish_interval_seconds
        self.internal_token = internal_token
        self._client = PrefixIndexClient(
            address.split(","), internal_token, timeout=max(1.0, heartbeat_seconds),
            block_size=engine.pool.block_size, hash_key=engine.pool.hasher.key,
            channel_factory=channel_factory)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = False
        self.last_seq = 0  # the newest batch number any shard accepted (Stats shows it)
        # The last call to the index went through (a heartbeat, a registration, a batch):
        # False from a failure until one does again. Stats shows 0 for the batch number
        # while it is False.
        self.connected = False
        # An outage of the index (every shard failing the same call): when it began, its
        # failed tries, when it was last said at WARNING (monotonic; None = none) and the
        # status said then.
        self._outage: tuple[float, int, float, str] | None = None
        self.resyncs = 0
        self._backlog: list[PoolEvent] = []
        # The index's batch limits, from its Register answer.
        self._max_events = MAX_BATCH
        self._max_blocks = MAX_BATCH_BLOCKS
        # How many events at the head of _backlog are the rest of a snapshot (not held
        # against MAX_BACKLOG).
        self._snapshot_left = 0
        # Blocks in the incremental events taken since the backlog was last empty (held
        # against MAX_BACKLOG_POOLS; counted as they arrive, reset when the backlog empties).
        self._taken_blocks = 0
        self._need_resync = True
        # Shards that missed a batch (down, or asked for a resync) while the others took it:
        # only they get a snapshot, once the backlog is out, so one shard's outage neither
        # stalls the others nor has them reloaded again and again.
        self._lagging: set[str] = set()
        # Lagging shards are checked on a timer of their own: one shard down used to back off
        # the whole loop (every shard got its events 25x later, and a hung one held each
        # batch and heartbeat for its timeout, so healthy shards' leases nearly lapsed).
        self._lag_failures = 0
        self._lag_retry_at = 0.0
        self._forgot: set[str] = set()  # shards that answered NOT_FOUND: register there again

    def start(self) -> Publisher:
        self._thread = threading.Thread(target=self._run, name="kvpool-publisher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop publishing and withdraw this replica's blocks from the index (an empty
        resync): else Match named a stopped replica's blocks until its lease lapsed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.registered and (self._thread is None or not self._thread.is_alive()):
            try:
                self._client.publish_events(self.replica_id, self.incarnation, [], resync=True,
                                            timeout=min(timeout, 2.0))
            except Exception as exc:  # noqa: BLE001 - the lease lapses anyway
                log.info("could not withdraw this replica's blocks from the prefix index: %s",
                         exc)
        self._client.close()

    # ---- loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        self._next_beat = 0.0  # when the next heartbeat is due (monotonic)
        backoff = 0.2
        while not self._stop.is_set():
            # After a failure: a snapshot (a pass over the pool on the engine thread, ~0.3 s
            # per 100k blocks, which every decoding answer waits for) is taken only once the
            # shards it goes to answer a heartbeat, not on every retry of an outage.
            retrying = backoff > 0.2
            try:
                if not self._sync(retrying):
                    continue
                if self.connected:
                    # Only once the index has answered: a turn that called nothing (no beat
                    # due, no events) reset it too, so through an outage every failed
                    # heartbeat retried after 0.2 s and logged a WARNING saying so, every
                    # heartbeat interval for as long as the index was down.
                    backoff = 0.2
                    self._outage_over()
                self._idle()
            except grpc.RpcError as e:
                self.connected = False
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._forgotten(e)
                    continue
                self._say_outage(e, backoff)
                self._collect()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # noqa: BLE001 - a dead publisher leaves the index stale for good
                self.connected = False
                # E.g. the engine did not take the resync snapshot within 60 s (a long step).
                log.exception("prefix publisher step failed; retrying in %.1fs", backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _sync(self, retrying: bool) -> bool:
        """One turn's calls to the index: registration, resync, heartbeat, the backlog and the
        lagging shards. False: the shards due a resync do not answer yet (`retrying`)."""
        if self._forgot:
            forgot, self._forgot = self._forgot, set()
            self._rejoin(forgot)
        if not self.registered:
            self._register()
            self._next_beat = time.monotonic() + self._beat_every
        if self._need_resync:
            if retrying and not self._probe(None):
                return False
            self._resync()
        now = time.monotonic()
        if now >= self._next_beat:
            # Set first: a failing heartbeat must not run again on every retry ahead
            # of publishing.
            self._next_beat = now + self._beat_every
            healthy = self._healthy()
            self._heartbeat(healthy, partial=True)
        self._collect()
        if self._backlog:
            self._publish()
        if (self._lagging and not self._backlog and not self._need_resync
                and time.monotonic() >= self._lag_retry_at):
            self._catch_up_lagging()
        return True

    def _outage_over(self) -> None:
        """Say that the index answers again, if an outage was under way."""
        if self._outage is not None:
            began, tries, _, _ = self._outage
            self._outage = None
            log.info("prefix index %s answers again after %.0fs (%d tries failed)",
                     self.address, time.monotonic() - began, tries)

    def _idle(self) -> None:
        """Wait for events (with none in the backlog) until the next heartbeat is due, at most
        publish_interval_seconds."""
        if self._backlog:
            return
        wait = max(0.0, min(self.publish_interval_seconds, self._next_beat - time.monotonic()))
        self.engine.wait_events(wait)
        # Let a burst of steps accumulate into one batch (no wait once stopped: `_run` ends).
        self._stop.wait(wait)

    def _forgotten(self, e: grpc.RpcError) -> None:
        """The index does not know this incarnation (restart, lapsed lease). A batch or a
        lagging shard's resync that went to the forgetful shards alone fails whole: register
        again on those only (`_rejoin`)."""
        failed = getattr(e, "shards_failed", {})
        forgot = {a for a, f in failed.items()
                  if f.code() == grpc.StatusCode.NOT_FOUND}
        log.info("prefix index: %s; registering again", e.details())
        if self._client.sharded and forgot:
            self._forgot |= forgot
            return
        self.registered = False
        # Spread out: after an index restart every replica hears this at once,
        # and each registration brings a full snapshot.
        self._stop.wait(random.uniform(0.0, self._beat_every))

    def _say_outage(self, e: grpc.RpcError, backoff: float) -> None:
        """Log a failed try of an outage, loud or not."""
        # One WARNING as the outage begins, then one a minute while it lasts (each
        # try one, 12 a minute per replica, filled the log of an index's restart);
        # the tries between at DEBUG, and a line when the index answers again.
        # A new status is said at once: an index restarted on another internal token
        # or hash key (a rotation) refused every try UNAUTHENTICATED or
        # FAILED_PRECONDITION for a minute, while the log's last line still said
        # UNAVAILABLE (connection refused) from its restart.
        now = time.monotonic()
        code = e.code().name if hasattr(e, "code") else "?"
        began, tries, warned, said = self._outage or (now, 0, -math.inf, "")
        loud = now - warned >= OUTAGE_WARNING_EVERY_S or code != said
        self._outage = (began, tries + 1, now if loud else warned,
                        code if loud else said)
        log.log(logging.WARNING if loud else logging.DEBUG,
                "prefix index %s: %s (%s); retrying in %.1fs%s", self.address, code,
                e.details() if hasattr(e, "details") else e, backoff,
                f" (failing for {now - began:.0f}s, {tries + 1} tries)" if tries else "")

    def _register(self, only: set[str] | None = None) -> None:
        """Register on every shard (then resync all), or on the shards in `only` that forgot
        this replica (then resync only those: the others still hold the right view)."""
        s = self.engine.stats()
        if only is not None:
            # Lagging (due a snapshot) before the call, not once it answers: a Register applied
            # whose answer was lost (a timeout) left the shard knowing this replica with nothing
            # held, later heartbeats found it known, and nothing resynced it. If it was not
            # applied, the snapshot's NOT_FOUND (or a heartbeat) has it registered again.
            self._lagging |= only
        # The client keeps each shard's batch numbers from here on.
        out = self._client.register(self.replica_id, self.incarnation, self.public_address,
                                    self.model_id, self.engine.pool.block_size, s.blocks_total,
                                    hash_probe=self.engine.pool.hasher.probe(), only=only)
        self._pace(out.lease_seconds)
        events = min(MAX_BATCH, out.max_events or MAX_BATCH)
        blocks = batch_blocks(self.engine.pool.block_size, out.max_blocks or MAX_BATCH_BLOCKS)
        if only is None:
            self._max_events, self._max_blocks = events, blocks
            self.registered = self.connected = True
            self._need_resync = True
        else:  # every shard's limits hold for batches that fan out to all of them
            self._max_events = min(self._max_events, events)
            self._max_blocks = min(self._max_blocks, blocks)
        # The list's fingerprint as the shards' mismatch notes name it: whose list is whose.
        log.info("registered with prefix index %s as %s/%s (shard list %s)",
                 ", ".join(sorted(only)) if only else self.address, self.replica_id,
                 self.incarnation, said(self._client.shard_list))

    def _rejoin(self, forgot: set[str]) -> None:
        """Shards that forgot this replica (restarted, or its lease lapsed there): register
        again on those alone when others still know it, else everywhere."""
        if self._client.sharded and forgot != set(self._client.addresses):
            log.info("prefix index shard(s) %s forgot this replica; registering there again",
                     ", ".join(sorted(forgot)))
            self._register(only=forgot)
        else:
            log.info("prefix index forgot this replica; registering again")
            self.registered = False

    def _healthy(self) -> set[str] | None:
        """The shards not lagging, where batches and heartbeats go (None: every shard, when
        none lags, or all do: then they are all asked, as unsharded)."""
        if not self._client.sharded or not self._lagging:
            return None
        healthy = set(self._client.addresses) - self._lagging
        return healthy or None

    def _catch_up_lagging(self) -> None:
        """Resync the lagging shards (checked first with a heartbeat after a failure); a
        failure only pushes their next try back, doubling up to 5 s."""
        lagging = set(self._lagging)
        try:
            if self._lag_failures and not self._probe(lagging):
                return
            self._resync(only=lagging)
            self._lag_failures = 0
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise  # register again there: the loop's handler knows how
            self._lag_failures += 1
            wait = min(0.2 * 2 ** self._lag_failures, 5.0)
            self._lag_retry_at = time.monotonic() + wait
            log.log(logging.WARNING if self._lag_failures == 1 else logging.DEBUG,
                    "prefix index shard(s) %s: %s; the others go on, retrying these in %.1fs",
                    ", ".join(sorted(lagging)), e.code().name, wait)

    def _heartbeat(self, only: set[str] | None = None, partial: bool | None = None) -> None:
        s = self.engine.stats()
        got = self._client.heartbeat_shards(
            self.replica_id, self.incarnation,
            prefix_pb2.ReplicaLoad(running=s.running, waiting=s.waiting,
                                   free_blocks=s.blocks_free + s.blocks_cached,
                                   total_blocks=s.blocks_total), only=only, partial=partial)
        self.connected = True
        if self._client.sharded:
            # A shard that did not answer (down, or removed before this replica's list was)
            # lags, as a failed batch leaves it: retried on its own timer and caught up by a
            # snapshot. Heartbeats went on to it every beat, each a WARNING (30 a minute per
            # replica while it was gone), a hung one holding the loop for its timeout.
            asked = set(self._client.addresses) if only is None else set(only)
            self._lagging |= asked - set(got)
        forgot = {a for a, r in got.items() if not r.known}
        if forgot:
            self._rejoin(forgot)
        else:
            self._pace(min(r.lease_seconds for r in got.values()))

    def _probe(self, only: set[str] | None) -> bool:
        """Heartbeat the shards a snapshot would go to (all: None); True if they answered and
        know this replica. Raises (the caller backs off) when one in `only` does not answer,
        or, for all shards, when none does (a shard down then just stays lagging)."""
        self._heartbeat(only)
        return self.registered

    def _pace(self, lease_seconds: float) -> None:
        """Heartbeats every `heartbeat_seconds`, or a third of the index's lease if shorter
        (an index with a shorter lease would otherwise drop a healthy replica between beats)."""
        every = self.heartbeat_seconds
        if lease_seconds > 0:
            every = min(every, lease_seconds / 3)
        if every != self._beat_every:
            if every < self.heartbeat_seconds:
                log.info("prefix index lease %.1fs: heartbeats every %.2fs", lease_seconds,
                         every)
            self._beat_every = every

    def _collect(self) -> None:
        new = self.engine.take_events()
        if not self._backlog:
            self._taken_blocks = 0
        self._backlog.extend(new)
        self._taken_blocks += sum(len(getattr(e, "block_hashes", ())) for e in new)
        cap_blocks = MAX_BACKLOG_POOLS * max(1, self.engine.pool.num_blocks)
        if (len(self._backlog) - self._snapshot_left > MAX_BACKLOG
                or self._taken_blocks > cap_blocks):
            # Unreachable, or slower than this pool changes (a small pool evicting hundreds of
            # blocks a second outruns one slow call): the index cannot be told of each change.
            log.warning("prefix index behind (unreachable or slow): %d events (%d blocks; the "
                        "limit is %d events or %d blocks) dropped, will resync",
                        len(self._backlog), self._taken_blocks, MAX_BACKLOG, cap_blocks)
            self._backlog.clear()
            self._snapshot_left = 0
            self._taken_blocks = 0
            self._need_resync = True

    def _send(self, events: list[PoolEvent], resync: bool,
              only: set[str] | None = None) -> bool:
        """Send one batch; False when the whole view must be resent (every shard resyncs).

        Raises:
            PrefixIndexError: every shard that got the batch failed (retried with backoff).
        """
        out = self._client.publish_events(self.replica_id, self.incarnation,
                                          [to_proto(e) for e in events], resync=resync,
                                          only=only)
        # Shards that answered RESYNC did not apply their batch: its number is not "accepted".
        accepted = [n for a, n in out.sent.items() if a not in out.resync_shards]
        if accepted:
            self.last_seq = max(accepted)
            self.connected = True
        forgot = {a for a, e in out.failed.items() if e.code() == grpc.StatusCode.NOT_FOUND}
        if forgot:
            self._rejoin(forgot)
            if not self.registered:
                return False
        lost = set(out.failed) | set(out.resync_shards)
        if out.resync_shards:
            log.info("prefix index shard(s) %s asked for a resync", ", ".join(out.resync_shards))
        if lost and not self._client.sharded:
            self._need_resync = True
            return False
        self._lagging |= lost
        return True

    def _publish(self) -> None:
        while self._backlog and not self._need_resync and self.registered:
            batch, rest = next_batch(self._backlog, self._max_events, self._max_blocks,
                                     self.engine.pool.block_size)
            # Not to lagging shards: a snapshot brings them up to date, and a hung one held
            # every batch for its whole timeout.
            if not self._send(batch, resync=False, only=self._healthy()):
                return
            sent = len(self._backlog) - len(rest)  # -1 when an event was split
            self._backlog = rest
            self._snapshot_left = max(0, self._snapshot_left - max(0, sent))

    def _resync(self, only: set[str] | None = None) -> None:
        """Replace the index's view of this replica with a snapshot of the pool: on every
        shard, or (`only`, with the backlog already out) on the shards that fell behind."""
        def snapshot() -> tuple[list[PoolEvent], list[PoolEvent]]:
            # On the engine thread: events so far are reflected in the snapshot.
            pending = self.engine.take_events() + self.engine.pool.take_events()
            return list(self.engine.pool.holdings()), pending

        # Not started in time, cancelled (FutureTimeout): left in the inbox, it would still
        # run later and take the pending events, handing them to nobody.
        holdings, pending = result_unless_late(self.engine.call(snapshot), SNAPSHOT_TIMEOUT)
        if only is None:
            self._backlog.clear()  # every shard gets the snapshot, which reflects them
            self._snapshot_left = 0
            self._taken_blocks = 0  # (else the next events could overflow the cap at once)
        else:
            # The other shards have not seen these yet; replayed after the snapshot on the
            # lagging ones they change nothing (their effect is in it already).
            self._backlog.extend(pending)
        # Shards the snapshot fails to reach are marked lagging again by _send.
        before = set(self._lagging)
        self._lagging = set() if only is None else self._lagging - only
        try:
            # The first batch replaces the index's view; large snapshots continue in normal
            # batches.
            first, rest = next_batch(holdings, self._max_events, self._max_blocks,
                                     self.engine.pool.block_size)
            if not self._send(first, resync=True, only=only):
                return
        except grpc.RpcError:
            self._lagging |= before
            raise
        if only is None:
            self._need_resync = False
        self.resyncs += 1
        self._backlog = rest + self._backlog
        self._snapshot_left += len(rest)
