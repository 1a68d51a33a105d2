"""gRPC adapter of the semantic cache: proto <-> dataclasses; domain errors become statuses
through the common interceptor."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass

from tiercache.v1 import semantic_pb2, semantic_pb2_grpc

from services.common.bootstrap import ServerHandle, create_server
from services.common.errors import InvalidArgument, ResourceExhausted, Starting
from services.common.logs import Thinned
from services.semantic.cache import Embedder, Entry, Namespace, SemanticCache
from services.semantic.config import SemanticConfig
from services.semantic.index import set_search_threads
from services.semantic.shard_list import RecentShardLists
from services.semantic.snapshot import unwritable
from services.semantic.store import EntryStore, NotWritable

log = logging.getLogger(__name__)

FULL_NAME = "tiercache.v1.SemanticCache"


def namespace_from_proto(msg: semantic_pb2.Namespace) -> Namespace:
    return Namespace(msg.tenant, msg.model_id, msg.context_hash)


def entry_to_proto(e: Entry) -> semantic_pb2.SemanticEntry:
    return semantic_pb2.SemanticEntry(
        id=e.id, namespace=semantic_pb2.Namespace(tenant=e.namespace.tenant,
                                                  model_id=e.namespace.model_id,
                                                  context_hash=e.namespace.context_hash),
        prompt=e.prompt, answer=e.answer, verified=e.verified, created_at=e.created_at,
        last_hit_at=e.last_hit_at, hit_count=e.hit_count, ttl_seconds=e.ttl_seconds,
        truncated_at=e.truncated, answer_token_ids=e.answer_token_ids)


def _ns(request) -> Namespace | None:
    return namespace_from_proto(request.namespace) if request.HasField("namespace") else None


def _still_wanted(context) -> bool:
    """Whether the caller still waits for this RPC's answer: not cancelled, deadline not passed."""
    left = context.time_remaining()
    return context.is_active() and (left is None or left > 0)


class SemanticServicer(semantic_pb2_grpc.SemanticCacheServicer):
    """Implements tiercache.v1.SemanticCache over a `SemanticCache`."""

    def __init__(self, cache: SemanticCache | None = None,
                 shard_lists: RecentShardLists | None = None) -> None:
        self._cache = cache
        # The orchestrators' shard lists, compared (services.semantic.shard_list).
        self.shard_lists = shard_lists or RecentShardLists()

    def attach(self, cache: SemanticCache) -> None:
        """Starts answering with `cache` (until then every RPC is UNAVAILABLE)."""
        self._cache = cache

    @property
    def cache(self) -> SemanticCache:
        if self._cache is None:
            raise Starting("semantic cache is still loading")
        return self._cache

    def _placed_by(self, request, method: str, context) -> None:
        """Compares the shard list the caller placed the namespace by with the other callers';
        a mismatch is reported, never refused (the call may have landed where it belongs)."""
        if request.shard_list.fingerprint:
            self.shard_lists.check(request.shard_list.shards, request.shard_list.fingerprint,
                                   method, context.peer())

    def Lookup(self, request, context):
        t0 = time.perf_counter()
        r = self.cache.lookup(_ns(request), request.text, request.tier, request.threshold,
                              request.want_draft, wanted=lambda: _still_wanted(context))
        # After the call: a request refused as bad input leaves nothing behind, its list too.
        self._placed_by(request, "Lookup", context)
        resp = semantic_pb2.LookupResponse(
            hit=r.hit, similarity=r.similarity, threshold=r.threshold, tier=r.tier,
            guard_rejected=r.guard_rejected, guard_reason=r.guard_reason,
            search_ms=r.search_ms, embed_ms=r.embed_ms, exact=r.exact,
            threshold_from_request=r.threshold_from_request, base_threshold=r.base_threshold)
        if r.entry is not None:
            resp.entry.CopyFrom(entry_to_proto(r.entry))
        resp.handler_ms = (time.perf_counter() - t0) * 1000
        return resp

    def Store(self, request, context):
        e = self.cache.store_entry(_ns(request), request.prompt, request.answer,
                                   request.verified, request.ttl_seconds, request.truncated_at,
                                   wanted=lambda: _still_wanted(context),
                                   answer_token_ids=request.answer_token_ids)
        self._placed_by(request, "Store", context)
        return semantic_pb2.StoreResponse(id=e.id)

    def Verify(self, request, context):
        return entry_to_proto(self.cache.verify(request.id, request.verified,
                                                wanted=lambda: _still_wanted(context)))

    def Invalidate(self, request, context):
        which = request.WhichOneof("target")
        if which == "id":
            n = self.cache.invalidate_id(request.id, wanted=lambda: _still_wanted(context))
        elif which == "namespace":
            n = self.cache.invalidate_namespace(namespace_from_proto(request.namespace))
        elif which == "tenant":
            n = self.cache.invalidate_tenant(request.tenant)
        else:
            raise InvalidArgument("target", "set one of id, namespace or tenant")
        return semantic_pb2.InvalidateResponse(removed=n)

    def Stats(self, request, context):
        s = self.cache.stats()
        return semantic_pb2.SemanticStatsResponse(
            entries=s.entries, namespaces=s.namespaces, lookups_total=s.lookups_total,
            hits_by_tier=s.hits_by_tier, near_misses_total=s.near_misses_total,
            guard_rejections_total=s.guard_rejections_total, evictions_total=s.evictions_total,
            expirations_total=s.expirations_total, lookup_p50_ms=s.lookup_p50_ms,
            lookup_p99_ms=s.lookup_p99_ms, embedding_model=s.embedding_model,
            shard_list_mismatches_total=self.shard_lists.mismatches_total,
            shard_list_mismatch=self.shard_lists.note(),
            threshold_floor=self.cache.policy.floor)


class Housekeeper:
    """Background thread: flushes buffered hit counters, purges expired entries, and saves
    the HNSW graphs every `snapshot_interval_s` into `snapshot_path` (if both are set)."""

    def __init__(self, cache: SemanticCache, interval_s: float, snapshot_path: str = "",
                 snapshot_interval_s: float = 0.0) -> None:
        self.cache = cache
        self.interval_s = interval_s
        self.snapshot_path = snapshot_path
        self.snapshot_interval_s = snapshot_interval_s
        self._stop = threading.Event()
        self._disk_lines = Thinned(log, per_window=1, window_s=60.0, level=logging.WARNING)
        self._thread = threading.Thread(target=self._run, name="semantic-housekeeper",
                                        daemon=True)

    def start(self) -> Housekeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.cache.store.flush_hits()
        except (sqlite3.Error, ResourceExhausted) as exc:  # a full disk: it must still stop
            log.warning("hit counters not written at stop: %s", exc)

    def _run(self) -> None:
        flush_every = min(1.0, self.interval_s)
        if self.snapshot_path and self.snapshot_interval_s > 0:
            flush_every = min(flush_every, self.snapshot_interval_s)
        next_expiry = 0.0
        next_save = time.monotonic() + self.snapshot_interval_s
        failed_saves = 0  # in a row
        while not self._stop.wait(flush_every):
            try:
                self.cache.store.flush_hits()
                if time.monotonic() >= next_expiry:
                    n = self.cache.expire()
                    if n:
                        log.info("expired %d entries", n)
                    next_expiry = time.monotonic() + self.interval_s
            except ResourceExhausted as exc:
                # A full disk, a file-size limit or a quota: lookups go on, and the flush
                # retries every tick. Logged as a failure, it was an ERROR with a traceback
                # every second (while any hit waited) for as long as the disk stayed full.
                if self._disk_lines.allow(("housekeeping", "disk full")):
                    log.warning("hit counters or expired entries not written (retried every "
                                "%g s): %s", flush_every, exc)
            except Exception:  # noqa: BLE001 - keep housekeeping alive; it retries next tick
                log.exception("housekeeping failed")
            # An erasure (Invalidate) that emptied a namespace with a saved graph: saved now,
            # so that its embeddings do not stay on disk until the next interval, or the stop.
            erased = bool(self.snapshot_path) and self.cache.take_save_request()
            if ((erased or (self.snapshot_path and self.snapshot_interval_s > 0
                            and time.monotonic() >= next_save)) and not self._stop.is_set()):
                next_save = time.monotonic() + self.snapshot_interval_s
                try:
                    self.cache.save_snapshot(self.snapshot_path)
                    failed_saves = 0
                except Exception as exc:  # noqa: BLE001 - a speed-up lost; retried next interval
                    # Why in the line itself (a full or read-only volume), the traceback once
                    # per run of failures: each retry was an ERROR whose only words were
                    # "failed" and a 20-line traceback ending in faiss's write error.
                    # Without periodic saves (snapshot_interval_s 0) an erasure's failed save
                    # waits for the stop or the next erasure: it read "retried in 0 s".
                    retry = (f"retried in {self.snapshot_interval_s:.0f} s"
                             if self.snapshot_interval_s > 0 else
                             "retried at the next erasure or at the stop (periodic saves are "
                             "off: snapshot_interval_s 0)")
                    log.error("saving the HNSW graphs to %s failed (%s); %s",
                              self.snapshot_path, exc, retry, exc_info=not failed_saves)
                    failed_saves += 1


@dataclass
class RunningService:
    """A started semantic service and the pieces to stop it in order."""

    handle: ServerHandle
    cache: SemanticCache
    embedder: Embedder
    housekeeper: Housekeeper

    snapshot_path: str = ""  # where to save the HNSW graphs on stop ("" = not saved)

    def stop(self, grace: float = 2.0, index_close: float = 20.0) -> bool:
        """Drain, then close. True unless an index merge outlived `index_close` seconds (the
        entries are in SQLite either way; indexes are rebuilt at start). The HNSW graphs are
        saved (`snapshot_path`) once no write can come, so the next start need not build
        them; a failed save is logged, and the next start builds them."""
        self.handle.stop(grace)
        self.housekeeper.stop()
        merged = self.cache.close_indexes(index_close)
        if self.snapshot_path:
            try:
                saved = self.cache.save_snapshot(self.snapshot_path)
            except Exception:  # noqa: BLE001 - a speed-up lost, nothing else: SQLite holds all
                log.exception("saving the HNSW graphs to %s failed; the next start builds them",
                              self.snapshot_path)
            else:
                # Said either way: a stop soon after the first Stores writes no folder (every
                # namespace still flat), which read as a save lost.
                flat, unmerged = self.cache.unsaved_namespaces()
                log.info("saved %d HNSW graph%s to %s; not saved: %d namespace(s) searched "
                         "flat (under hnsw_min_entries, rebuilt at start in moments), %d past "
                         "it not merged into a graph yet (built at the next start)", saved,
                         "" if saved == 1 else "s", self.snapshot_path, flat, unmerged)
        self.cache.store.close()
        close = getattr(self.embedder, "close", None)
        if close is not None:
            close()
        return merged


def make_embedder(cfg: SemanticConfig) -> Embedder:
    """The ONNX embedder of `cfg.model_dir` behind a micro-batcher (exports once if needed)."""
    from services.semantic.embedder import BatchingEmbedder, OnnxEmbedder

    name = cfg.resolved_model_name()
    inner = OnnxEmbedder(cfg.resolved_model_dir(), cfg.resolved_cache_dir(), name,
                         cfg.onnx_threads, spinning=cfg.onnx_spinning,
                         exporter=cfg.onnx_exporter)
    return BatchingEmbedder(inner, cfg.max_batch, cfg.batch_wait_ms)


def serve(cfg: SemanticConfig, embedder: Embedder | None = None) -> RunningService:
    """Starts the server (NOT_SERVING), loads the embedder and the entries, then SERVING."""
    servicer = SemanticServicer()
    handle = create_server(
        service="semantic", address=cfg.address,
        services=[(semantic_pb2_grpc.add_SemanticCacheServicer_to_server, servicer, FULL_NAME)],
        internal_token=cfg.internal_token or None,
        metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port)
    set_search_threads(cfg.faiss_threads)
    # Where the HNSW graphs are taken from at start and saved to ("" = neither).
    snapshot_path = cfg.resolved_snapshot_path() if cfg.snapshot_on_stop else ""
    store = None
    try:
        embedder = embedder or make_embedder(cfg)
        store = EntryStore(cfg.resolved_db_path(), cfg.sqlite_synchronous)
        why = unwritable(snapshot_path) if snapshot_path else ""
        if why:
            # Found at start, as the database's folder is (__main__: one line, exit 2).
            raise NotWritable(
                f"TIERCACHE_SEMANTIC_SNAPSHOT_PATH: {why}: the service saves its HNSW graphs "
                f"there (on stop and every snapshot_interval_s) for the next start to take; "
                f"make it writable by uid {os.geteuid()}, point TIERCACHE_SEMANTIC_SNAPSHOT_PATH "
                "at a writable folder, or set TIERCACHE_SEMANTIC_SNAPSHOT_ON_STOP=false")
        cache = SemanticCache(cfg, embedder, store)
        cache.load(snapshot_path)
    except BaseException:
        handle.stop(0)
        if store is not None:
            # And its database lock: a retry in this process must not be refused.
            with contextlib.suppress(Exception):
                store.close()
        raise
    servicer.attach(cache)
    keeper = Housekeeper(cache, cfg.expiry_interval_s, snapshot_path,
                         cfg.snapshot_interval_s).start()
    handle.set_serving()
    return RunningService(handle, cache, embedder, keeper, snapshot_path)
