"""gRPC adapter of the prefix index: proto <-> plain values, one lock around the index.

Domain errors raised by the index become statuses in the bootstrap's interceptor.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

from services.common import hashing, metrics
from services.common.bootstrap import ServerHandle, create_server
from services.common.config import announce_problem
from services.common.errors import InvalidArgument
from services.common.policy import make_policy
from services.common.prefix_client import batch_blocks
from services.prefix.config import PrefixConfig
from services.prefix.index import Cleared, Event, Load, PrefixIndex, Removed, Stored
from services.prefix.shard_list import ShardListCheck

log = logging.getLogger(__name__)

SERVICE_NAME = "tiercache.v1.PrefixIndex"

NODES = metrics.gauge("tiercache_prefix_nodes", "Blocks (nodes) in the prefix index")
REPLICAS = metrics.gauge("tiercache_prefix_replicas", "Live replicas known to the prefix index")
MATCHES = metrics.counter("tiercache_prefix_matches_total", "Match calls", ("result",))
MATCH_BLOCKS = metrics.counter("tiercache_prefix_match_blocks_total",
                               "Blocks asked about in Match calls", ("result",))
EVENTS = metrics.counter("tiercache_prefix_events_total", "Replica events applied", ("kind",))
# Only those the index asks for: a replica whose heartbeat finds it forgotten (a lapse) registers
# and resyncs unasked, and a SIGSTOPped replica's return left this at 0, read as "no lapse".
RESYNCS = metrics.counter("tiercache_prefix_resyncs_total",
                          "Resyncs the index asked for: a batch after a gap in a replica's "
                          "numbers, or its first after a Register that carried them on past a "
                          "lapsed lease (Stats' resyncs_total); not the resync a replica sends "
                          "unasked when its heartbeat finds it forgotten (see "
                          "tiercache_prefix_replicas for lapses)")
# A counter (rate() and increase() work on it), fed from the tree's running total.
PRUNED = metrics.counter("tiercache_prefix_pruned_total", "Nodes pruned by the memory budget")
# Stats' dropped_blocks_total, the one counter of Stats no metric had: a replica publishing
# chains the index cannot place (a lost parent) showed only to whoever polled Stats.
DROPPED = metrics.counter("tiercache_prefix_dropped_blocks_total",
                          "Stored blocks ignored because their parent was unknown or not held "
                          "by the replica (Stats' dropped_blocks_total)")
UNHELD = metrics.gauge("tiercache_prefix_unheld_nodes",
                       "Nodes a lapse or a resync left held by no replica, invisible to calls, "
                       "that the sweeper has still to delete")
# The sweeper deletes those in steps of this many (~25 ms under the lock on a 2-core host),
# pausing between steps so that waiting calls get the lock: a million-node replica's lapse
# held every call for 2-3.5 s when it was deleted in one go.
REAP_STEP = 5000
REAP_PAUSE_S = 0.005
REAP_IDLE_S = 0.25


def build_index(cfg: PrefixConfig) -> PrefixIndex:
    """The index as configured (`max_blocks` within one message: `batch_blocks`)."""
    hashing.say_which_hasher()  # it hashes every Match prompt (published blocks: verify_hashes)
    max_blocks = batch_blocks(cfg.block_size, cfg.max_blocks)
    if max_blocks < cfg.max_blocks:
        log.info("max_blocks %d lowered to %d: a batch of blocks of %d tokens must fit one "
                 "gRPC message", cfg.max_blocks, max_blocks, cfg.block_size)
    return PrefixIndex(
        cfg.block_size, lease_seconds=cfg.lease_seconds, max_nodes=cfg.max_nodes,
        prune_to=cfg.prune_to, prune_step=cfg.prune_step,
        policy=make_policy(cfg.eviction_policy, cfg.shallow_tokens),
        shallow_tokens=cfg.shallow_tokens, min_deep_hits=cfg.min_deep_hits,
        cold_after_ticks=cfg.cold_after_ticks, hit_half_life_seconds=cfg.hit_half_life_seconds,
        max_events=cfg.max_events, max_blocks=max_blocks, verify_hashes=cfg.verify_hashes,
        wall_clock=time.time)


def _load_pb(load: Load) -> prefix_pb2.ReplicaLoad:
    return prefix_pb2.ReplicaLoad(running=load.running, waiting=load.waiting,
                                  free_blocks=load.free_blocks, total_blocks=load.total_blocks)


def _event(ev: prefix_pb2.KvEvent) -> Event | None:
    which = ev.WhichOneof("event")
    if which == "stored":
        s = ev.stored
        return Stored(s.parent_hash, list(s.block_hashes), s.token_ids, s.cache_salt,
                      s.first_block_hash, s.start_block)
    if which == "removed":
        return Removed(list(ev.removed.block_hashes))
    if which == "cleared":
        return Cleared()
    return None


class PrefixServicer(prefix_pb2_grpc.PrefixIndexServicer):
    """Serves one PrefixIndex; every call holds the index lock (the index is not thread-safe)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.lock = threading.Lock()
        self._pruned = metrics.TotalCounter(PRUNED)
        self._dropped_blocks = metrics.TotalCounter(DROPPED)
        # Replicas' shard lists against Matches' (services.prefix.shard_list).
        self.shard_lists = ShardListCheck(index.clock)
        # A lapsed replica's list was kept, and a Match naming no live replica was still
        # compared with it (and agreed: a mismatch missed).
        index.on_drop = self._dropped

    def _dropped(self, replica_id: str) -> None:
        """A replica's lease lapsed (in whichever call found it): its shard list is forgotten,
        and the replicas gauge follows at once (a Match that found the lapse left it one high
        until the next Register, Heartbeat, Publish, Stats or sweep)."""
        self.shard_lists.forget(replica_id)
        REPLICAS.set(self.index.replica_count)

    def _gauges(self) -> None:
        NODES.set(len(self.index.tree))
        UNHELD.set(self.index.tree.unheld)
        REPLICAS.set(self.index.replica_count)
        self._pruned.update(self.index.tree.pruned_total)
        self._dropped_blocks.update(self.index.dropped_blocks_total)

    def Register(self, request, context):
        with self.lock:
            # The address by the rule a replica's start applies too, in field order (an empty
            # replica_id is named before a malformed address).
            r = self.index.register(request.replica_id, request.incarnation, request.address,
                                    request.model_id, request.block_size,
                                    request.capacity_blocks, request.hash_probe,
                                    check_address=announce_problem)
            self.shard_lists.registered(request.replica_id, request.shard_list.shards,
                                        request.shard_list.fingerprint)
            self._gauges()
        log.info("replica %s/%s registered at %s (model %s)", request.replica_id,
                 request.incarnation, request.address, request.model_id)
        return prefix_pb2.RegisterResponse(lease_seconds=r.lease_seconds, next_seq=r.next_seq,
                                           max_events=self.index.max_events,
                                           max_blocks=self.index.max_blocks)

    def Heartbeat(self, request, context):
        load = Load(request.load.running, request.load.waiting, request.load.free_blocks,
                    request.load.total_blocks)
        with self.lock:
            r = self.index.heartbeat(request.replica_id, request.incarnation, load)
            self._gauges()
        return prefix_pb2.HeartbeatResponse(known=r.known, lease_seconds=r.lease_seconds)

    def PublishEvents(self, request, context):
        events = [_event(e) for e in request.events]
        for i, e in enumerate(events):
            if e is None:
                raise InvalidArgument(f"events[{i}]", "no event set")
        with self.lock:
            before = self.index.resyncs_total
            r = self.index.publish(request.replica_id, request.incarnation, request.seq,
                                   events, request.resync)  # type: ignore[arg-type]
            resynced = self.index.resyncs_total - before
            self._gauges()
        if resynced:
            RESYNCS.inc(resynced)
            # The batch expected, yet a resync: the replica registered back from a lapsed
            # lease and the index holds nothing of it ("after a gap" named a lost batch that
            # never was).
            why = ("after a gap" if request.seq > r.next_seq
                   else "is its first since its lease lapsed")
            log.info("replica %s: batch %d %s; asking for a resync (expects %d)",
                     request.replica_id, request.seq, why, r.next_seq)
        elif r.applied:  # not a retry of an applied batch, nor an overtaken resync
            for e in request.events:
                EVENTS.labels(e.WhichOneof("event")).inc()
        status = (prefix_pb2.PUBLISH_STATUS_RESYNC if r.resync
                  else prefix_pb2.PUBLISH_STATUS_OK)
        return prefix_pb2.PublishEventsResponse(status=status, next_seq=r.next_seq)

    def Match(self, request, context):
        with self.lock:
            r = self.index.match(request.model_id, request.cache_salt, request.token_ids,
                                 list(request.block_hashes), probe=request.probe)
            # Answered either way: a Match routed by another shard list is reported, not
            # refused (it may have landed right; the index is advisory).
            self.shard_lists.check(request.shard_list.shards, request.shard_list.fingerprint,
                                   (m.replica_id for m in r.matches))
        if not request.probe:
            best = r.matches[0].matched_blocks if r.matches else 0
            MATCHES.labels("hit" if best else "miss").inc()
            MATCH_BLOCKS.labels("asked").inc(r.request_blocks)
            MATCH_BLOCKS.labels("hit").inc(best)
        return prefix_pb2.MatchResponse(
            matches=[prefix_pb2.ReplicaMatch(
                replica_id=m.replica_id, address=m.address, matched_blocks=m.matched_blocks,
                matched_tokens=m.matched_tokens, load=_load_pb(m.load)) for m in r.matches],
            request_blocks=r.request_blocks, block_size=r.block_size)

    def TopPrefixes(self, request, context):
        with self.lock:
            top = self.index.top_prefixes(
                request.k, request.model_id, request.min_hits,
                request.cache_salt if request.HasField("cache_salt") else None)
        return prefix_pb2.TopPrefixesResponse(prefixes=[prefix_pb2.HotPrefix(
            token_ids=p.token_ids, hits=p.hits, holders=p.holders, cache_salt=p.cache_salt,
            model_id=p.model_id, last_block_hash=p.last_block_hash) for p in top])

    def Stats(self, request, context):
        with self.lock:
            s = self.index.stats()
            self._gauges()
            mismatch, mismatches = self.shard_lists.note(), self.shard_lists.mismatches_total
        return prefix_pb2.PrefixStatsResponse(
            nodes=s.nodes, bytes=s.bytes, replicas=[prefix_pb2.ReplicaInfo(
                replica_id=r.replica_id, incarnation=r.incarnation, address=r.address,
                model_id=r.model_id, held_blocks=r.held_blocks, load=_load_pb(r.load),
                last_seen_s=r.last_seen_s, capacity_blocks=r.capacity_blocks)
                for r in s.replicas],
            matches_total=s.matches_total, matches_hit=s.matches_hit,
            match_blocks_total=s.match_blocks_total, match_blocks_hit=s.match_blocks_hit,
            pruned_total=s.pruned_total, resyncs_total=s.resyncs_total,
            block_size=s.block_size, dropped_blocks_total=s.dropped_blocks_total,
            max_nodes=s.max_nodes, unheld_nodes=s.unheld_nodes,
            shard_list_mismatches_total=mismatches,
            shard_list_mismatch=mismatch)


@dataclass
class PrefixService:
    """A running prefix index: server handle, servicer and lease sweeper."""

    handle: ServerHandle
    servicer: PrefixServicer
    _stop: threading.Event
    _sweeper: threading.Thread

    @property
    def port(self) -> int:
        return self.handle.port

    @property
    def address(self) -> str:
        return self.handle.address

    def stop(self, grace: float | None = 0) -> None:
        self._stop.set()
        if not self.handle.stopped.is_set():
            self.handle.stop(grace)
        self._sweeper.join(5)


def serve(cfg: PrefixConfig, index: PrefixIndex | None = None) -> PrefixService:
    """Start the index server on `cfg.address` (port 0 = any) and mark it SERVING."""
    index = index or build_index(cfg)
    servicer = PrefixServicer(index)
    handle = create_server(
        service="prefix", address=cfg.address,
        services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server, servicer, SERVICE_NAME)],
        internal_token=cfg.internal_token or None,
        metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port)
    stop = threading.Event()

    def sweep() -> None:
        # Leases also lapse lazily on every call; this catches an index nobody calls. It also
        # ages the hit counts (`PrefixIndex.age_hits`), which only it does, and deletes the
        # nodes a lapse or a resync left unheld (`PrefixIndex.reap`), a step per short pause.
        period = max(0.05, index.lease_seconds / 4)
        due = time.monotonic() + period
        # Idle, it still looks every REAP_IDLE_S for nodes a call's lapse or resync left
        # unheld, rather than a quarter lease later.
        while not stop.wait(REAP_PAUSE_S if index.tree.unheld
                            else min(REAP_IDLE_S, max(0.0, due - time.monotonic()))):
            sweep_due = time.monotonic() >= due
            if not sweep_due and not index.tree.unheld:
                continue  # nothing to do: the lock is not taken for nothing
            try:
                with servicer.lock:
                    if sweep_due:
                        due = time.monotonic() + period
                        index.sweep(period=period)  # a lapse logs itself
                    if index.tree.unheld:
                        index.reap(REAP_STEP)
                    servicer._gauges()
            except Exception:  # noqa: BLE001 - the only sweeper: it must go on
                # Leases of replicas nobody calls, the hit counts' aging and the lapse grace
                # are swept only here: a thread ended by one error stopped them for good.
                log.exception("prefix index sweep failed; sweeping again in %.2f s", period)
                stop.wait(period)  # not a tight loop of the same error while reaping
                continue

    sweeper = threading.Thread(target=sweep, name="prefix-lease-sweeper", daemon=True)
    sweeper.start()
    handle.set_serving()
    return PrefixService(handle, servicer, stop, sweeper)
