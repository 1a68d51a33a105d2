"""gRPC adapter of the KvPool service: proto <-> engine requests, domain errors <-> status."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc
from tiercache.v1 import common_pb2, kvpool_pb2, kvpool_pb2_grpc

from services.common import errors
from services.common.bootstrap import on_rpc_end, rpc_ended
from services.common.hashing import check_salt
from services.common.logs import plain_request_id, request_id_var
from services.common.reaper import StreamReaper
from services.common.tokens import validate_stop_ids, validate_tokens
from services.kvpool.config import KvPoolConfig
from services.kvpool.engine import (
    EngineRequest,
    Failed,
    Finished,
    FinishReason,
    ModelInfo,
    TokenDelta,
    result_unless_late,
)
from services.kvpool.sampling import SamplingSpec

log = logging.getLogger(__name__)
_REAPER = StreamReaper(on_reap=lambda details: log.warning(
    "ended a Generate stream whose client stopped reading: %s", details))

_FINISH = {
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
}
_LAST_WAIT_S = 30.0  # for the Finished that follows a last token (queued in the same call)
_POLL_S = 0.1


def sampling_spec(sp: common_pb2.SamplingParams, limit: int, vocab: int,
                  seed_offset: int = 0) -> SamplingSpec:
    """Validate SamplingParams into a SamplingSpec (InvalidArgument names the field);
    `seed_offset`: tokens of the answer generated before (KvGenerateRequest.seed_offset)."""
    if sp.max_tokens <= 0:
        raise errors.InvalidArgument("sampling.max_tokens", f"must be > 0, got {sp.max_tokens}")
    if sp.max_tokens > limit:
        raise errors.InvalidArgument("sampling.max_tokens",
                                     f"must be <= {limit}, got {sp.max_tokens}")
    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        raise errors.InvalidArgument("sampling.temperature",
                                     f"must be a finite number >= 0, got {sp.temperature}")
    top_p = sp.top_p if sp.top_p != 0 else 1.0
    if math.isnan(top_p) or not 0.0 < top_p <= 1.0:
        raise errors.InvalidArgument("sampling.top_p", f"must be in (0, 1], got {sp.top_p}")
    stops = validate_stop_ids(sp.stop_token_ids, vocab)
    return SamplingSpec(sp.max_tokens, float(sp.temperature), float(top_p), int(sp.seed),
                        frozenset(stops), bool(sp.ignore_eos), int(seed_offset))


class KvPoolServicer(kvpool_pb2_grpc.KvPoolServicer):
    """Serves KvPool over an engine that is attached once the model is loaded."""

    def __init__(self, cfg: KvPoolConfig, incarnation: str | None = None) -> None:
        self.cfg = cfg
        self.incarnation = incarnation or uuid.uuid4().hex
        self.engine = None
        self.info: ModelInfo | None = None
        self.publisher = None
        # The server's drain flag (ServerHandle.draining), set from SIGTERM on.
        self.draining: threading.Event | None = None

    def attach(self, engine, info: ModelInfo, publisher=None) -> None:
        self.engine, self.info, self.publisher = engine, info, publisher

    def _ready(self):
        if self.engine is None or self.info is None:
            raise errors.Starting("kvpool is loading its model; retry shortly")
        if not self.engine.running:
            # Stopped (shutting down), or its thread died: nothing submitted would be answered.
            raise errors.Unavailable("kvpool engine is not running")
        return self.engine, self.info

    def _check_model(self, model_id: str, info: ModelInfo) -> None:
        if model_id and model_id != info.model_id:
            if problem := errors.model_id_problem(model_id):
                # No model's id (the index refuses it): the caller's mistake, not a replica
                # serving another model to look past.
                raise errors.InvalidArgument("model_id", problem)
            raise errors.FailedPrecondition(
                f"model_id: this replica serves {info.model_id!r}, not {errors.shown(model_id)}")

    @staticmethod
    def _deadline(context: grpc.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        if remaining is None or remaining > 1e8:
            return None
        return time.monotonic() + remaining

    # ---- Generate --------------------------------------------------------------------------

    def Generate(self, request: kvpool_pb2.KvGenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[kvpool_pb2.KvGenerateResponse]:
        stall = self.cfg.send_stall_seconds
        stream = self._generate(request, context)
        if not stall:
            yield from stream  # closes it when closed itself
            return
        try:
            for msg in stream:
                # A send blocks while the client's flow-control window is full: a client that
                # stopped reading held this worker thread for good. Ended from outside.
                token = _REAPER.arm(
                    time.monotonic() + stall, context,
                    f"the client took no message for {stall:g} s (send_stall_seconds); "
                    f"request {errors.shown(request.request_id)}")
                try:
                    yield msg
                finally:
                    _REAPER.disarm(token)
        finally:
            stream.close()  # closed from outside (the client went), its clean-up runs now

    def _generate(self, request: kvpool_pb2.KvGenerateRequest,
                  context: grpc.ServicerContext) -> Iterator[kvpool_pb2.KvGenerateResponse]:
        engine, info = self._ready()
        self._check_model(request.model_id, info)
        ids = validate_tokens("token_ids", request.token_ids, info.vocab_size)
        spec = sampling_spec(request.sampling, self.cfg.max_new_tokens_limit, info.vocab_size,
                             request.seed_offset)
        # Draft tokens past max_tokens can never be verified: they are dropped before the draft
        # is indexed (its n-gram index costs ~240x the wire size).
        draft = validate_tokens("draft_token_ids", request.draft_token_ids[:spec.max_tokens],
                                info.vocab_size, allow_empty=True)
        if len(ids) + spec.max_tokens > info.max_context:
            raise errors.InvalidArgument(
                "token_ids", f"prompt ({len(ids)} tokens) + sampling.max_tokens "
                f"({spec.max_tokens}) exceed the model context ({info.max_context})")
        # Into sequence ids and log lines: a 1 MB id with newlines was taken as it came.
        req = EngineRequest(plain_request_id(request.request_id), ids, spec,
                            check_salt("cache_salt", request.cache_salt),
                            request.skip_prefix_cache,
                            self._deadline(context), draft_token_ids=tuple(draft))
        seq_id, out = engine.submit(req)
        # Cancelled when the RPC ends, at once where it had already ended (its client
        # cancelled while the request was being read): else the prefill ran to its end for
        # nobody before the first send failed (a Prefill saw it only at its next poll).
        on_rpc_end(context, lambda: engine.cancel(seq_id))
        done = False
        try:
            while True:
                item = self._next(out, context)
                if item is None:
                    # The client went away or its deadline passed (the callback cancels the
                    # sequence): say which, not OK, in the RPC metrics.
                    raise rpc_ended(context)
                if isinstance(item, Failed):
                    done = True
                    raise self._failure(item, context)
                if isinstance(item, Finished):
                    done = True
                    yield kvpool_pb2.KvGenerateResponse(final=self._final(item))
                    return
                toks, last = list(item.token_ids), item.last
                # Coalesce deltas that queued up while the client was slow.
                while not last:
                    try:
                        nxt = out.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(nxt, TokenDelta):
                        toks.extend(nxt.token_ids)
                        last = nxt.last
                        continue
                    yield kvpool_pb2.KvGenerateResponse(token_ids=toks)
                    toks = []
                    if isinstance(nxt, Failed):
                        done = True
                        raise self._failure(nxt, context)
                    done = True
                    yield kvpool_pb2.KvGenerateResponse(final=self._final(nxt))
                    return
                if last:
                    # The engine queues the end right after the last token: one message, so a
                    # reader never holds a finished answer without knowing it finished.
                    end = out.get(timeout=_LAST_WAIT_S)
                    done = True
                    if isinstance(end, Failed):
                        yield kvpool_pb2.KvGenerateResponse(token_ids=toks)
                        raise self._failure(end, context)
                    yield kvpool_pb2.KvGenerateResponse(token_ids=toks, final=self._final(end))
                    return
                yield kvpool_pb2.KvGenerateResponse(token_ids=toks)
        finally:
            if not done:
                engine.cancel(seq_id)

    @staticmethod
    def _next(out: queue.Queue, context: grpc.ServicerContext):
        while True:
            try:
                return out.get(timeout=_POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return None

    @staticmethod
    def _failure(item: Failed, context: grpc.ServicerContext) -> Exception:
        """What a failed sequence ends its RPC with. The engine's Cancelled answers this
        server's own cancel, which the RPC's end callback sends when the call ends: `rpc_ended`
        says why it ended. Raised as it came, a client's deadline (and a drain's cut) was
        counted CANCELLED whenever the engine answered the cancel before the handler looked."""
        if isinstance(item.error, errors.Cancelled):
            return rpc_ended(context)
        return item.error

    def _final(self, f: Finished) -> kvpool_pb2.KvGenerateFinal:
        return kvpool_pb2.KvGenerateFinal(
            finish_reason=_FINISH.get(f.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED),
            usage=common_pb2.Usage(prompt_tokens=f.prompt_tokens,
                                   completion_tokens=f.completion_tokens),
            cached_tokens=f.cached_tokens, ttft_ms=f.ttft_ms, forward_passes=f.forward_passes,
            draft_tokens_proposed=f.draft_tokens_proposed,
            draft_tokens_accepted=f.draft_tokens_accepted, replica_id=self.cfg.replica_id,
            lookup_tokens_accepted=f.lookup_tokens_accepted)

    # ---- Prefill ---------------------------------------------------------------------------

    def Prefill(self, request: kvpool_pb2.PrefillRequest,
                context: grpc.ServicerContext) -> kvpool_pb2.PrefillResponse:
        engine, info = self._ready()
        self._check_model(request.model_id, info)
        ids = validate_tokens("token_ids", request.token_ids, info.vocab_size)
        if len(ids) > info.max_context:
            raise errors.InvalidArgument(
                "token_ids", f"{len(ids)} tokens exceed the model context ({info.max_context})")
        if not engine.prefix_caching:
            # Prefill only fills the prefix cache; with it off the work would be thrown away and
            # an "OK, 0 blocks pinned" would hide that warm-up cannot work on this replica.
            raise errors.FailedPrecondition(
                "prefix caching is off on this replica (TIERCACHE_KVPOOL_PREFIX_CACHING): "
                "nothing can be prefilled or pinned")
        ttl = 0.0
        if request.ttl_seconds and not request.pin:
            # A pin's lifetime without the pin: taken, the prefix was computed and left
            # unpinned, "OK, 0 blocks pinned" with the TTL ignored without a word.
            raise errors.InvalidArgument(
                "ttl_seconds", f"{request.ttl_seconds} s without pin: set pin to pin the "
                "prefix for ttl_seconds, or leave ttl_seconds 0")
        if request.pin:
            if request.ttl_seconds <= 0:
                raise errors.InvalidArgument("ttl_seconds", "must be > 0 when pin is set")
            block = engine.pool.block_size
            if len(ids) < block:
                # Only whole blocks are cached and pinned: "OK, pinned 0" hid that such a
                # warm-up keeps nothing (the orchestrator's Warm refuses it the same way).
                raise errors.InvalidArgument(
                    "token_ids", f"{len(ids)} tokens, shorter than one KV block ({block}): "
                    "nothing could be pinned")
            ttl = float(min(request.ttl_seconds, self.cfg.pin_ttl_max_seconds))
        # The caller's id (bound by the interceptor from x-request-id): the engine's log lines
        # for this warm-up (admission failures, preemption) can be matched to the Warm.
        req = EngineRequest(plain_request_id(request_id_var.get()), ids,
                            SamplingSpec(max_tokens=0),
                            check_salt("cache_salt", request.cache_salt), False,
                            self._deadline(context),
                            prefill_only=True, pin_ttl_seconds=ttl)
        seq_id, out = engine.submit(req)
        on_rpc_end(context, lambda: engine.cancel(seq_id))  # as Generate's
        item = self._next(out, context)
        if item is None:
            engine.cancel(seq_id)
            raise rpc_ended(context)
        if isinstance(item, Failed):
            raise self._failure(item, context)
        assert isinstance(item, Finished)
        return kvpool_pb2.PrefillResponse(
            prompt_tokens=item.prompt_tokens, cached_tokens=item.cached_tokens,
            computed_tokens=item.computed_tokens, pinned_blocks=item.pinned_blocks,
            replica_id=self.cfg.replica_id, elapsed_ms=item.elapsed_ms)

    # ---- Flush -----------------------------------------------------------------------------

    def Flush(self, request: kvpool_pb2.KvFlushRequest,
              context: grpc.ServicerContext) -> kvpool_pb2.KvFlushResponse:
        engine, _ = self._ready()
        salt = check_salt("cache_salt", request.cache_salt)
        if not salt:
            # The unsalted blocks are those of every caller that sends no salt: not a tenant.
            raise errors.InvalidArgument("cache_salt", "required (the tenant's cache salt)")
        # On the engine thread, between steps: the pool has one owner.
        deadline = self._deadline(context)
        try:
            dropped, kept = result_unless_late(
                engine.call(lambda: engine.flush_salt(salt)),
                None if deadline is None else deadline - time.monotonic())
        except FutureTimeout:  # never ran: nothing was dropped
            raise errors.DeadlineExceeded("deadline exceeded before the flush ran") from None
        log.info("flushed %d cached blocks of one cache salt (%d kept: in use)", dropped, kept)
        return kvpool_pb2.KvFlushResponse(blocks_dropped=dropped, blocks_in_use=kept,
                                          replica_id=self.cfg.replica_id)

    # ---- Stats -----------------------------------------------------------------------------

    def Stats(self, request: kvpool_pb2.KvStatsRequest,
              context: grpc.ServicerContext) -> kvpool_pb2.KvStatsResponse:
        if self.draining is not None and self.draining.is_set():
            # Health says NOT_SERVING from SIGTERM on, but orchestrators route by these polls,
            # dialing the pod by name, not through a Service's endpoints: they went on sending
            # new requests through the whole drain delay (5 s in the manifests), each then
            # to finish within the grace. Refused, the replica leaves routing at the next
            # poll while its streams finish (backends.ReplicaSet).
            raise errors.Unavailable("kvpool is draining (stopping): it takes no new requests")
        engine, info = self._ready()
        s = engine.stats()
        served = engine.served_costs
        return kvpool_pb2.KvStatsResponse(
            replica_id=self.cfg.replica_id, incarnation=self.incarnation,
            model_id=info.model_id, block_size=engine.pool.block_size,
            blocks_total=s.blocks_total, blocks_free=s.blocks_free,
            blocks_cached=s.blocks_cached, blocks_pinned=s.blocks_pinned,
            blocks_in_use=s.blocks_in_use, running=s.running, waiting=s.waiting,
            prompt_tokens_total=s.prompt_tokens_total, cached_tokens_total=s.cached_tokens_total,
            requests_total=s.requests_total, max_context=info.max_context,
            prefills_total=s.prefills_total,
            prefill_computed_tokens_total=s.prefill_computed_tokens_total,
            vocab_size=info.vocab_size, device=str(engine.device),
            dtype=str(engine.store.dtype).removeprefix("torch."),
            events_published_seq=(self.publisher.last_seq
                                  if self.publisher and self.publisher.connected else 0),
            evictions_total=s.evictions_total, preemptions_total=s.preemptions_total,
            draft_tokens_proposed_total=s.draft_tokens_proposed_total,
            draft_tokens_accepted_total=s.draft_tokens_accepted_total,
            prefix_caching_disabled=not engine.prefix_caching,
            stalled_for_s=_stalled_s(engine.stuck_for()), draft_ladder=engine.ladder(),
            draft_ladder_source=engine.draft_ladder.source if engine.drafts else "",
            draft_forward_costs=engine.draft_ladder.costs if engine.drafts else (),
            linear_kernels=engine.packing.kernels, linear_kernels_why=engine.packing.why_not,
            draft_cheap_guesses=engine.drafts and engine.draft_ladder.cheap_guesses,
            draft_tokens_withheld_total=s.draft_tokens_withheld_total,
            draft_costs_served=engine.costs() if engine.drafts else (),
            draft_costs_served_steps=(list(served.samples) if engine.drafts and served
                                      else ()),
            draft_tree_forwards_total=s.draft_tree_forwards_total,
            draft_tree_branch_wins_total=s.draft_tree_branch_wins_total,
            draft_branches=engine.draft_branches if engine.drafts else 0,
            draft_batch_trust=engine.batch_trust.factor if engine.drafts else 0.0)


def _stalled_s(seconds: float) -> float:
    """Stats' stalled_for_s: 0 while the engine turns at least once a second (below that it is
    noise, and Stats taken a moment apart stay equal when nothing happened)."""
    return seconds if seconds >= 1.0 else 0.0


def watch_engine(engine: Any, handle: Any, every: float = 1.0,
                 stall_seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> threading.Thread:
    """Turn health NOT_SERVING once the engine thread has died (every call then answers
    UNAVAILABLE): health stayed SERVING, so the liveness probe never restarted the replica.
    Also while the engine thread is alive but has not begun a turn for `stall_seconds` (> 0):
    one step stuck (a hung device, a deadlock) held every stream on the replica while health
    said SERVING. Health turns SERVING again if the engine moves on before the liveness probe
    restarts the replica, unless the server is draining. Ends quietly when the server stops
    (a drain stops the engine on purpose)."""
    def run() -> None:
        stalled = False
        woke = clock()
        while not handle.stopped.wait(every):
            last, woke = woke, clock()
            if not engine.running:
                if not handle.stopped.is_set():
                    log.error("the engine thread has stopped: health NOT_SERVING, so the "
                              "replica is restarted")
                    handle.set_serving(False)
                return
            if stall_seconds <= 0:
                continue
            # How late this watch itself woke: the whole process stood still that long
            # (SIGSTOP, a paused VM), and the engine had no chance to turn either. Counted
            # in, the pause looked like a stuck engine (an ERROR and NOT_SERVING for a
            # second).
            late = max(0.0, woke - last - every) if not stalled else 0.0
            age = max(0.0, engine.stalled_for() - late)
            if age > stall_seconds and not stalled:
                stalled = True
                log.error("the engine has not finished a step in %.0f s (engine_stall_seconds="
                          "%g): health NOT_SERVING", age, stall_seconds)
                handle.set_serving(False)
            elif age <= stall_seconds and stalled:
                stalled = False
                log.warning("the engine is stepping again: health SERVING unless draining")
                handle.set_serving(True)  # ignored once a drain has begun

    t = threading.Thread(target=run, name="engine-watch", daemon=True)
    t.start()
    return t
