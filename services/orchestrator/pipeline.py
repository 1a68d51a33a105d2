"""The life of a request (DESIGN.md): auth -> validate, render and tokenize -> semantic -> index
-> route -> generate.

`Orchestrator.generate` yields plain events (`TextDelta`, `Finished`); the gRPC adapter turns
them into proto messages. Every degradation (semantic tier down, index down, a replica lost)
is logged and counted, and the request still completes when any replica can serve it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
from tiercache.v1 import common_pb2, kvpool_pb2, semantic_pb2

from services.common import errors
from services.common.grpc_client import call_metadata, cut_short, health_error
from services.common.hashing import BlockHasher
from services.common.logs import Thinned
from services.common.metrics import SECONDS_BUCKETS, counter, histogram
from services.orchestrator import coalesce as coalesce_mod
from services.orchestrator.backends import (
    CALL_SECONDS,
    ReplicaSet,
    SemanticBackend,
    downs_by_address,
)
from services.orchestrator.detok import IncrementalDetokenizer, complete_decode, decode
from services.orchestrator.dispatched import DispatchMemory
from services.orchestrator.render import PromptRenderer, RenderedPrompt
from services.orchestrator.routing import RoutingPolicy
from services.orchestrator.tenants import REJECTED, Tenant

log = logging.getLogger(__name__)

# Served only (`_count`, once the client has the last token): a live check's cancelled and
# timed-out Generates were in tiercache_rpc_total only, which the help did not say.
REQUESTS = counter("tiercache_orchestrator_requests_total",
                   "Generate requests served, by cache class (cold, prefix_hit, semantic_hit, "
                   "coalesced: the whole answer from an identical request's model run): "
                   "counted once the client has taken the last token, so not those refused, "
                   "failed, cancelled or past their deadline (see tiercache_rpc_total)",
                   ("cache_class",))
DEGRADED = counter("tiercache_orchestrator_degradations_total",
                   "Degraded events, one per event (a request may count several): tier "
                   "skipped, index down, index refused a Match (a prompt past its "
                   "max_blocks), replica failed over (retry/resume), replica busy, "
                   "larger pool sought (larger_pool), or none left to try as the larger one is "
                   "down (larger_pool_down), draft dropped, store failed", ("kind",))
TTFT = histogram("tiercache_orchestrator_ttft_seconds", "Time to first token", ("cache_class",),
                 buckets=SECONDS_BUCKETS)
NOT_SERVED = counter("tiercache_orchestrator_semantic_hits_not_served_total",
                     "Semantic hits the model answered instead (the hit as its draft), by "
                     "reason: too_short (cut shorter than asked), sampled (temperature > 0, "
                     "serve_sampled off), ignore_eos (the answer ended at end of sequence)",
                     ("reason",))
TOKENS = counter("tiercache_orchestrator_tokens_total",
                 "Prompt, cached (prefix), generated and saved_semantic (served from the "
                 "semantic cache, never generated) tokens; a coalesced request's answer is "
                 "generated once, counted with its leader's (its prompt counts as cached)",
                 ("kind",))
DRAFT_TOKENS = counter("tiercache_orchestrator_draft_tokens_total",
                       "Draft tokens proposed to replicas, and accepted by source: the cached "
                       "near-miss or prompt lookup (see forward_passes_saved_total for what "
                       "they saved)", ("kind",))
PASSES_SAVED = counter("tiercache_orchestrator_forward_passes_saved_total",
                       "Decoding forward passes drafts saved: tokens a replica generated, less "
                       "one, less the forward passes it ran (an answer ending on an accepted "
                       "token saves one fewer than it accepted); the last replica's, after a "
                       "failover")
MATCH_SHORTFALL = counter("tiercache_orchestrator_prefix_match_shortfall_tokens_total",
                          "Prompt tokens the prefix index (or routing's memory of prompts just "
                          "sent) said the chosen replica held but that it computed anyway: "
                          "evicted between the match and the request's arrival")
MATCHED_TOKENS = counter("tiercache_orchestrator_prefix_matched_tokens_total",
                         "Prompt tokens the prefix index (or routing's memory of prompts just "
                         "sent) said the chosen replica held, over the requests it served")
COALESCED = counter("tiercache_orchestrator_coalesced_requests_total",
                    "Greedy requests that followed an identical request's model run in flight "
                    "instead of calling a replica (counted as they join it: those that then "
                    "went on by themselves, their leader gone unfinished, included)")
DISPATCH_ROUTES = counter("tiercache_orchestrator_dispatch_memory_routes_total",
                          "Routes to a replica for a prefix the index did not know yet (sent "
                          "there moments before): one per routing decision, so a request "
                          "failed over to another such replica counts again")

# Per-request WARNINGs of a dependency down (a tier skipped, a replica failed over): one per
# request flooded the log while it lasted (76 lines in 16 s at 2 requests in flight with no
# replica up); at most 10 per dependency and status every 10 s, then a count.
_DEGRADED_LINES = Thinned(log, level=logging.WARNING)
# A replica's busy or too-small-pool hand-off, thinned alike per replica: a burst past the
# replicas' queues logged one INFO line per attempt (1,967 in 25 s at 10 requests in flight on
# two replicas with max_waiting 1), burying every other line.
_LOAD_LINES = Thinned(log)

# Semantic-tier INVALID_ARGUMENT details that blame the request's cache policy.
_POLICY_FIELDS = ("tier", "threshold")
# Replica failures that mean "this replica is gone or broken", so another one should try.
_REPLICA_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                 grpc.StatusCode.CANCELLED)
# A replica refusing the orchestrator's internal credential: a deployment fault, failed over.
_REPLICA_REFUSED_US = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class _StreamCut(Exception):
    """A replica's stream ended without its final message."""


class _ReadAhead:
    """The replica side of a request (routing, each replica's stream, failover, the Store of
    the answer), run by a thread of its own at the replicas' pace into a buffer that the
    request drains at its client's pace. Iterating this object gives what `source` yields,
    then raises what it raised, in that order.

    A client reading slowly (a small flow-control window) held the orchestrator inside a send
    while the replica's answer waited unread: the replica's call, and routing's count of our
    requests in flight there, stayed until the client had read everything. A replica's stream
    was then read ahead on a thread of its own (stop 50), but what came after it still waited
    for the client: the answer's Store (until stop 51), and a failover: a replica lost
    mid-answer was resumed only once the client had read the tokens read before the loss.
    Now the whole replica side runs ahead: a lost replica is resumed at once (with every
    token read, however far behind the client is), and the Store is made as the answer ends.

    Memory: an answer is at most max_tokens tokens and each item carries at least one (but the
    detokenizer's tail and the final item), so `limit` (max_tokens + a few) holds all of it;
    past that (a replica breaking its contract) the thread waits for the client. Threads: one
    per request while its replica side runs; `close` (in the request's `finally`) stops it
    (`on_close`: the request is over, its calls are cancelled) and joins it, so these threads
    never outnumber the Generate streams in progress (`max_streams`). The thread runs in a copy
    of the request's context: its log lines carry the request id."""

    JOIN_S = 5.0  # a cancelled call's iteration ends at once; this only bounds a wedged one

    def __init__(self, source: Iterator, limit: int, name: str, deadline: float | None,
                 on_close: Callable[[], None]) -> None:
        """`deadline`: the request's: items are handed out until then, read ahead or not (a
        client too slow for its request's time is ended by it, as when a call ran to it)."""
        self._source = source
        self._deadline = deadline
        self._limit = max(2, limit)
        self._on_close = on_close
        self._buf: deque = deque()
        self._cond = threading.Condition()
        self._ended = False  # the source ended (its error, if any, in _error)
        self._error: BaseException | None = None
        self._closed = False  # the request stopped draining: the thread stops too
        ctx = contextvars.copy_context()
        self._thread = threading.Thread(target=ctx.run, args=(self._run,), name=name,
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            for item in self._source:
                with self._cond:
                    while len(self._buf) >= self._limit and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        break
                    self._buf.append(item)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the request, in order
            error = e
        finally:
            if self._closed:
                try:
                    # Left at a yield: its `finally` blocks (the replica's call cancelled,
                    # its load released) run here, on the thread that ran it.
                    self._source.close()
                except Exception:  # noqa: BLE001 - the request is over; nobody to tell
                    log.exception("stopping a request's replica side failed")
            with self._cond:
                self._ended, self._error = True, error
                self._cond.notify_all()

    def __iter__(self) -> _ReadAhead:
        return self

    def __next__(self):
        with self._cond:
            while not self._buf and not self._ended:
                self._cond.wait()
            if (self._deadline is not None and time.monotonic() >= self._deadline
                    and self._buf):
                raise errors.DeadlineExceeded("deadline exceeded while generating")
            if self._buf:
                item = self._buf.popleft()
                self._cond.notify_all()
                return item
            error, self._error = self._error, None
        if error is not None:
            raise error
        raise StopIteration

    def close(self) -> None:
        """Stop: if the replica side still runs (the request ended early: its client is gone,
        or it failed), `on_close` cancels its calls; the thread has ended on return."""
        with self._cond:
            if self._closed:
                return  # once: a second close (the request's `finally` after one) is a no-op
            self._closed = True
            ended = self._ended
            self._cond.notify_all()
        if not ended:
            self._on_close()
        self._thread.join(self.JOIN_S)
        if self._thread.is_alive():
            log.warning("a request's replica side did not end %.0f s after its calls were "
                        "cancelled", self.JOIN_S)


class _Deferred(NamedTuple):
    """Work the replica side hands to the request, to run when the request takes it from the
    buffer (in the stream's order), not when the replica side reaches it."""

    run: Callable[[], None]


class _Held:
    """A replica call's share of routing's load there (`ReplicaSet.begin`, done before) and
    its hung-replica watcher: both given up once, as the attempt ends (on the request's
    read-ahead thread, at the replica's pace), however often `release` is called."""

    def __init__(self, replicas: ReplicaSet, replica) -> None:
        self.replicas, self.replica = replicas, replica
        self.watcher: Callable[[], None] | None = None
        # Set by `cut_as_hung`: this orchestrator cancelled the call because the poller declared
        # the replica hung (its CANCELLED is ours, not the replica's nor the client's).
        self.hung = False
        self._lock = threading.Lock()
        self._released = False

    def cut_as_hung(self, call) -> Callable[[], None]:
        """The watcher for `call`: notes why, then cancels it."""
        def cut() -> None:
            self.hung = True
            call.cancel()
        return cut

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        if self.watcher is not None:
            self.replicas.unwatch(self.replica, self.watcher)
        self.replicas.end(self.replica)


class PrefixView(NamedTuple):
    """What the prefix index says of a prompt."""

    matches: dict[str, int]  # replica id -> matched prompt tokens
    key: str  # the first block's hash (hex), the affinity key without a session; "" = none
    # KV blocks the prompt needs, given only when the index answered: then an empty match
    # means the prompt is new to every replica, and routing may place it by free blocks (see
    # routing.PrefixAwarePolicy); None = unknown.
    new_blocks: int | None
    hashes: list[bytes]  # the prompt's full-block hashes (salted by tenant)


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    # Whether the client set max_tokens (False: max_tokens is the server's default, or what
    # the model's context leaves): a refusal must not blame a field the client never sent.
    max_tokens_set: bool = True


@dataclass(frozen=True)
class Policy:
    skip_semantic_lookup: bool = False
    skip_semantic_store: bool = False
    skip_prefix_cache: bool = False
    skip_draft: bool = False
    semantic_tier: str = ""
    semantic_threshold: float = 0.0
    store_sampled: bool = False
    serve_sampled: bool = False


def session_routing_key(tenant: Tenant, session_id: str) -> str:
    """The session ring's key for a session ("" for none). A session id is the client's name,
    unique only within its tenant: two tenants that both say "s1" are two sessions, and must
    not be pinned to one replica together."""
    return f"{tenant.name}\x1f{session_id}" if session_id else ""


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]


@dataclass
class Finished:
    finish_reason: int
    prompt_tokens: int
    completion_tokens: int
    report: common_pb2.CacheReport
    request_id: str


@dataclass
class OrchestratorStats:
    requests: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    semantic_tokens_saved: int = 0
    semantic_hits_too_short: int = 0  # hits not served: cut shorter than the request wants
    semantic_hits_sampled: int = 0  # hits not served: a sampled request (serve_sampled off)
    semantic_hits_ignore_eos: int = 0  # hits not served: ignore_eos past an answer's EOS
    degradations: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def not_served(self, why: str) -> None:
        """A semantic hit the model answered instead, by its reason (`_why_not_served`)."""
        attr = f"semantic_hits_{why}"  # semantic_hits_too_short, ...
        with self.lock:
            setattr(self, attr, getattr(self, attr) + 1)
        NOT_SERVED.labels(why).inc()

    def degrade(self, kind: str) -> None:
        with self.lock:
            self.degradations[kind] += 1
        DEGRADED.labels(kind).inc()
        notes = _REQUEST_NOTES.get()
        if notes is not None and kind not in notes:
            notes.append(kind)  # the request's CacheReport.degradations


# The degradations of the request whose tier call runs in this context (set around each call,
# see `_noting`): a client saw a 2 s TTFT with nothing to say the semantic tier was skipped.
_REQUEST_NOTES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "request_notes", default=None)


@contextlib.contextmanager
def _noting(notes: list[str]) -> Iterator[None]:
    tok = _REQUEST_NOTES.set(notes)
    try:
        yield
    finally:
        _REQUEST_NOTES.reset(tok)


@dataclass
class _Request:
    """A Generate's inputs and the state its steps share: whether its client has gone
    (`cancelled`), the downstream calls to cancel then (`current`: a cache tier's, one at a
    time, and a replica's), its degradations (`notes`, for its report) and its CacheReport."""

    tenant: Tenant
    prompt: RenderedPrompt
    sampling: Sampling
    policy: Policy
    return_token_ids: bool
    request_id: str
    deadline: float
    t0: float  # TTFT's start
    cancelled: threading.Event = field(default_factory=threading.Event)
    current: dict[str, grpc.Future] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    report: common_pb2.CacheReport = field(default_factory=common_pb2.CacheReport)
    # The request in a flight (coalesce.py): its own, where request ids may be two requests'.
    member: object = field(default_factory=object)

    def cancel_downstream(self) -> None:
        """The client has gone: every call in flight for it is cancelled, and none starts."""
        self.cancelled.set()
        for what in ("tier", "call"):
            call = self.current.get(what)
            if call is not None:
                call.cancel()

    def tier_call_started(self, call: grpc.Future) -> None:
        # A cache tier's call (the lookup, the index Match, the Store after the answer:
        # one at a time) is cancelled with the request: its client gone, the slots it
        # holds come back at once, not when the tier answers (up to the tier's timeout).
        self.current["tier"] = call
        if self.cancelled.is_set():
            call.cancel()

    @contextlib.contextmanager
    def tier_call(self) -> Iterator[None]:
        """Around a cache tier's call: its degradations are this request's, and the call is
        forgotten (no longer to cancel) as it ends."""
        try:
            with _noting(self.notes):
                yield
        finally:
            self.current.pop("tier", None)


def answer_ids(tok, special_ids: frozenset[int], generated: list[int], answer: str
               ) -> list[int]:
    """The model's own ids of `answer`, as the semantic tier stores them with it: `generated`
    as the model's stream gave it (its end of sequence included, so a hit gives back what the
    model did), if it decodes to exactly that text and a special token comes only last; else
    none (not when the answer's last character was cut inside its bytes), and readers tokenize
    the text. Tokenizing it again is not always the same: the model may write a word in pieces
    its tokenizer would not choose (" Mar" "ath" "i"), and a draft made that way disagrees
    with the model there."""
    body = generated[:-1] if generated and generated[-1] in special_ids else generated
    if any(t in special_ids for t in body) or decode(tok, body, False) != answer:
        return []
    return list(generated)


def _why_not_served(look: semantic_pb2.LookupResponse, cached_ids: list[int],
                    sampling: Sampling, greedy: bool, serves_sampled: bool) -> str:
    """Why the semantic tier's hit is not served ("" when it is, or there is none): the first
    of too_short, ignore_eos, sampled. The model answers then, the hit as its draft."""
    if not look.hit:
        return ""
    cut = look.entry.truncated_at
    # The request's stop token inside a cut-short answer ends the answer there, as it
    # ends the model's: the hit covers all the request wants (it went to the model,
    # counted "too_short", the answer's own first tokens as its draft).
    stop = set(sampling.stop_token_ids)
    stops_inside = bool(cut) and any(t in stop for t in cached_ids[:cut])
    if cut and cut < sampling.max_tokens and not stops_inside:
        # A cut-short answer cannot stand for a longer one: the model answers, with
        # the cached part as its draft.
        return "too_short"
    if sampling.ignore_eos and not cut:
        # The stored answer ended at the model's end of sequence (not cut short); a
        # request told to go on past it gets the model (the answer as its draft).
        return "ignore_eos"
    if not greedy and not serves_sampled:
        # A sampled request wants the model's sample (a seed: the same one whatever
        # the cache holds), not the one cached answer every time: the hit is its draft.
        return "sampled"
    return ""


class Orchestrator:
    """Runs requests through the tiers. Thread-safe; one instance per process."""

    def __init__(self, *, renderer: PromptRenderer, tokenizer, model_id: str, hasher: BlockHasher,
                 replicas: ReplicaSet, semantic: SemanticBackend, prefix, routing: RoutingPolicy,
                 internal_token: str, default_tier: str, enable_drafts: bool,
                 store_sampled: bool, max_attempts: int, min_prefix_tokens: int,
                 dispatched: DispatchMemory | None = None, serve_sampled: bool = False,
                 eos_token_ids: frozenset[int] | None = None, coalesce: bool = True) -> None:
        self.renderer = renderer
        self.tok = tokenizer
        self._vocab = len(tokenizer)  # ids a draft may hold: the tokenizer's
        self.model_id = model_id
        self.hasher = hasher
        self.replicas = replicas
        self.semantic = semantic
        self.prefix = prefix
        self.routing = routing
        self.internal_token = internal_token
        self.default_tier = default_tier
        self.enable_drafts = enable_drafts
        self.store_sampled = store_sampled
        self.serve_sampled = serve_sampled
        self.max_attempts = max_attempts
        self.min_prefix_tokens = min_prefix_tokens
        # Prompts sent to each replica moments ago, before the index has them (None = off).
        self.dispatched = dispatched
        self.stats = OrchestratorStats()
        self._route_lock = threading.Lock()
        # Identical greedy requests in flight together share one model run (coalesce.py).
        self.coalesce = coalesce
        self.flights = coalesce_mod.Flights()
        # Tokens a stored answer's text leaves out (skip_special_tokens): the end of sequence.
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        # Every id that ends the model's answer, as the replicas read them (the generation
        # config's list: Llama 3 and Qwen 2.5 name several), else the tokenizer's one: with
        # that one alone, an answer ending on another was not seen as ended.
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        self._eos_ids: frozenset[int] = (frozenset(eos_token_ids) if eos_token_ids
                                         else frozenset([tok_eos]) if tok_eos is not None
                                         else frozenset())

    # ---- semantic tier -------------------------------------------------------------------
    def _namespace(self, tenant: Tenant, prompt: RenderedPrompt) -> semantic_pb2.Namespace:
        return semantic_pb2.Namespace(tenant=tenant.name, model_id=self.model_id,
                                      context_hash=prompt.context_hash)

    def _at_shard(self, ns: semantic_pb2.Namespace, details: str) -> str:
        """`details` of a failed call, naming the shard `ns` went to unless they do: a hung
        shard's Store logged only gRPC's "Deadline Exceeded" (neither which nor where)."""
        address = self.semantic.shard_for(ns)
        return details if address in details else f"semantic shard {address}: {details}"

    def _lookup(self, tenant: Tenant, prompt: RenderedPrompt, policy: Policy, want_draft: bool,
                deadline: float, on_call: Callable[[grpc.Future], None] | None = None
                ) -> semantic_pb2.LookupResponse | None:
        """The semantic tier's answer, or None to go without it. `on_call` is handed the
        lookup's call as it starts (to cancel it when the request's client goes away)."""
        if not self.semantic.enabled or policy.skip_semantic_lookup:
            return None
        timeout = _within(self.semantic.timeout_s, deadline, _CACHE_SHARE)
        if timeout is None:
            return None  # the request's deadline has passed: the replica step reports it
        ns = self._namespace(tenant, prompt)
        try:
            return self.semantic.lookup(semantic_pb2.LookupRequest(
                namespace=ns, text=prompt.query_text,
                tier=policy.semantic_tier or self.default_tier,
                threshold=policy.semantic_threshold, want_draft=want_draft), timeout,
                on_call=on_call)
        except grpc.FutureCancelledError:
            return None  # cancelled with the request (its client went away): not the tier's
        except grpc.RpcError as e:
            details = e.details() or ""
            if (e.code() == grpc.StatusCode.INVALID_ARGUMENT
                    and details.startswith(_POLICY_FIELDS)):
                # The request's own tier/threshold is bad: tell the caller, in its own field
                # names ("threshold: must be 0 or in [0.85, 1]" -> cache_policy.semantic_...).
                field, _, why = details.partition(":")
                raise errors.InvalidArgument(f"cache_policy.semantic_{field}",
                                             why.strip()) from None
            if cut_short(e, timeout, self.semantic.timeout_s):
                return None  # the request's own deadline, not the tier: no degradation
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # A text the tier will not take (a message over its size limit): this request
                # goes without the tier, which is healthy; not a degradation to alert on.
                log.info("semantic tier skipped for this request: %s", details)
                return None
            # Anything else (the tier down) only means this request goes without the tier.
            if _DEGRADED_LINES.allow(("semantic lookup", e.code().name)):
                log.warning("semantic lookup failed, skipping the tier: %s",
                            self._at_shard(ns, details))
            self.stats.degrade("semantic_skipped")
            return None

    def _store_timeout(self, deadline: float, by: float | None = None) -> float | None:
        """How long a request's Store may take, None for no Store at all. Before the final
        message, whose report names the stored entry: bounded by half of what is left of the
        request's deadline (past it, the answer is not stored), so a slow Store cannot turn a
        finished answer into DEADLINE_EXCEEDED; and by `by` (time.monotonic), where given:
        a follower's Store passed on to it ends when its own would have."""
        timeout = _within(self.semantic.timeout_s, deadline, _STORE_SHARE)
        if timeout is not None and by is not None:
            timeout = min(timeout, by - time.monotonic())
        if timeout is None or timeout < min(_STORE_MIN_S, self.semantic.timeout_s):
            # Too little left to embed and write it (and then send the final message): sent
            # anyway, the Store timed out here while the tier still wrote the entry, which
            # the client could then not name.
            return None
        return timeout

    def _store(self, tenant: Tenant, prompt: RenderedPrompt, answer: str, truncated_at: int,
               deadline: float, answer_ids: Sequence[int] = (),
               on_call: Callable[[grpc.Future], None] | None = None,
               by: float | None = None) -> str | None:
        """The stored entry's id ("" = not stored), or None where the Store was not made for
        this request's sake: no time left for it (`_store_timeout`, `by`), cancelled with the
        request (its client went), or timed out under this request's own bound (shorter than
        the tier's timeout); another request of its flight may make it then
        (`_ReplicaSide._store`: harmless where this one landed late, the tier writing nothing
        for a Store of the answer its prompt's entry holds). `on_call` is handed the Store's
        call as it starts (to cancel it when the request's client goes away)."""
        timeout = self._store_timeout(deadline, by)
        if timeout is None:
            return None
        ns = self._namespace(tenant, prompt)
        try:
            return self.semantic.store(semantic_pb2.StoreRequest(
                namespace=ns, prompt=prompt.query_text,
                answer=answer, truncated_at=truncated_at, answer_token_ids=answer_ids),
                timeout, on_call=on_call).id
        except grpc.FutureCancelledError:
            # Cancelled with the request (its client went away): not the tier's. The answer
            # goes unstored (the tier writes nothing for a caller gone, unless it had begun:
            # then a Store of the same answer after it, passed on, returns that entry).
            return None
        except grpc.RpcError as e:
            if cut_short(e, timeout, self.semantic.timeout_s):
                return None  # the request's own deadline, not the tier: no degradation
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # A prompt or answer the tier will not take (over its size limits): not stored,
                # and not a degradation of a healthy tier.
                log.info("answer not stored in the semantic tier: %s", e.details())
                return ""
            if _DEGRADED_LINES.allow(("semantic store", e.code().name)):
                log.warning("semantic store failed: %s", self._at_shard(ns, e.details() or ""))
            self.stats.degrade("semantic_store_failed")
            # Timed out under this request's own bound (long enough to tell of the tier's
            # health): one with more time left may still make it.
            own = timeout < self.semantic.timeout_s
            return None if own and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else ""

    # ---- prefix tier ---------------------------------------------------------------------
    def _matches(self, tenant: Tenant, token_ids: list[int],
                 deadline: float | None = None, probe: bool = False,
                 on_call: Callable[[grpc.Future], None] | None = None) -> PrefixView:
        """What the prefix index knows of this prompt (see PrefixView); `probe`: asked for
        routing's sake, not a request (the index credits no hit). `on_call` is handed the
        Match's call as it starts (to cancel it when the request's client goes away)."""
        ring = self._ring_view(tenant, token_ids)  # nothing from the index: ring routing
        hashes = ring.hashes
        if self.prefix is None or not hashes:
            return ring
        timeout = None
        if deadline is not None:
            timeout = _within(self.prefix.timeout_s, deadline, _CACHE_SHARE)
            if timeout is None:
                return ring  # no time left
        try:
            # Full blocks are hashed; the partial last block and the answer need one more.
            return PrefixView(self.prefix.match(hashes, self.model_id, timeout, probe=probe,
                                                on_call=on_call),
                              ring.key, len(hashes) + 1, hashes)
        except grpc.FutureCancelledError:
            # Cancelled with the request (its client went away): not the index's.
            return ring
        except grpc.RpcError as e:
            if timeout is not None and cut_short(e, timeout, self.prefix.timeout_s):
                # The request's deadline, not the index: ring routing, no degradation.
                return ring
            # A timeout said as how long the index did not answer (gRPC's bare "Deadline
            # Exceeded" named no deadline), as its health line says it.
            said = health_error(e, timeout, self.prefix.timeout_s)
            said = said if isinstance(said, str) else e.details()
            # A live index refusing this Match (more blocks than its max_blocks, which the
            # orchestrator is not told) is not an outage, and its health stays good
            # (`tells_of_health`): logged and counted as "index down" it read as one.
            refused = e.code() == grpc.StatusCode.INVALID_ARGUMENT
            what = "refused the Match" if refused else "unreachable"
            if probe:
                # A Warm choosing owners (up to 64 prompts a call) is not a request served
                # degraded: counting each probe swamped the per-request figure.
                log.info("prefix index %s (a routing probe): %s", what, said)
                return ring
            if _DEGRADED_LINES.allow(("prefix match", e.code().name)):
                log.warning("prefix index %s, ring routing: %s", what, said)
            self.stats.degrade("index_refused" if refused else "index_down")
            return ring

    def _ring_view(self, tenant: Tenant, token_ids: list[int]) -> PrefixView:
        """The prompt's view without the index: its block hashes and ring key, no matches."""
        hashes = self.hasher.hashes(token_ids, tenant.cache_salt)
        return PrefixView({}, hashes[0].hex() if hashes else "", None, hashes)

    def _with_dispatched(self, matches: dict[str, int], hashes: list[bytes]) -> dict[str, int]:
        """`matches` raised by what was sent to each replica moments ago (the caller holds
        the route lock, so a request sent just before this one is already recorded)."""
        if self.dispatched is None or not hashes:
            return matches
        return self.dispatched.merged(matches, hashes)

    def owner(self, tenant: Tenant, token_ids: list[int], deadline: float | None = None,
              on_call: Callable[[grpc.Future], None] | None = None) -> str | None:
        """The replica a request with this prompt would be routed to now (Warm's owners), not
        counted as routed traffic; None when no replica is available. Past `deadline` the
        index is not asked (ring routing). `on_call` is handed the index probe's call as it
        starts (to cancel it when the Warm's caller goes away: ring routing then)."""
        view = self._matches(tenant, token_ids, deadline, probe=True, on_call=on_call)
        with self._route_lock:  # the policy's ring changes as replicas come and go
            d = self.routing.choose(self.replicas.views(),
                                    self._with_dispatched(view.matches, view.hashes), view.key,
                                    new_blocks=view.new_blocks, record=False)
        return d.replica_id if d is not None else None

    # ---- the request ---------------------------------------------------------------------
    def generate(self, *, tenant: Tenant, prompt: RenderedPrompt, sampling: Sampling,
                 policy: Policy, session_id: str, return_token_ids: bool, request_id: str,
                 deadline: float, on_cancel: Callable[[Callable[[], None]], None],
                 arrived: float | None = None) -> Iterator[TextDelta | Finished]:
        """One request's events, in its phases: the semantic lookup and its verdict
        (`_weigh_lookup`: a hit served here, `_serve_hit`, or the model's draft), the prefix
        index's view of the prompt and its routing key, then the replica side
        (`_ReplicaSide`: routing, each replica's attempt, failover, the report and the
        answer's Store), read ahead on a thread of its own (`_ReadAhead`) and drained here at
        the client's pace."""
        # TTFT's start: when the server received the request (rendering and tokenizing
        # included), or now.
        t0 = time.monotonic() if arrived is None else arrived
        state = _Request(tenant, prompt, sampling, policy, return_token_ids, request_id,
                         deadline, t0)
        # Registered first: a client gone during the semantic lookup or the index match must
        # not get a model call (nor hold its slots until the replica's first token).
        on_cancel(state.cancel_downstream)
        greedy = sampling.temperature == 0.0
        # An unseeded sample gets its seed here rather than on the replica: an answer resumed
        # on another replica then continues the same draw (`seed_offset`), as a seeded one
        # does, instead of going on from a new random seed.
        seed = sampling.seed if greedy or sampling.seed else secrets.randbits(63) + 1
        want_draft = self.enable_drafts and not policy.skip_draft
        serves_sampled = policy.serve_sampled or self.serve_sampled
        may_store = not policy.skip_semantic_store and (greedy or policy.store_sampled
                                                        or self.store_sampled)
        # A sampled request that can neither be served a hit nor draft from one has no use
        # for the lookup: it embedded the text, credited the entry a hit (hit_count, LRU) and
        # counted a hit not served, all for nothing. Kept where its answer may be stored: the
        # lookup is what stops a cut-short sample from replacing a longer stored answer.
        useless = not greedy and not serves_sampled and not want_draft and not may_store
        with state.tier_call():
            look = None if useless else self._lookup(tenant, prompt, policy, want_draft,
                                                     deadline, state.tier_call_started)
        draft_ids: list[int] = []
        if look is not None:
            served, draft_ids = self._weigh_lookup(look, state, greedy, serves_sampled,
                                                   want_draft)
            if served is not None:
                yield from self._serve_hit(look, served, state)
                return

        if state.cancelled.is_set():
            # Gone during the semantic lookup: no Match either (the index would count it as
            # traffic, and its hits steer warm-up).
            raise errors.Cancelled("client cancelled")
        with self._flight(state, greedy, may_store) as (flight, leads):
            yield from self._model_answer(state, session_id, seed, draft_ids, look, may_store,
                                          flight, leads)

    @contextlib.contextmanager
    def _flight(self, req: _Request, greedy: bool, may_store: bool
                ) -> Iterator[tuple[coalesce_mod.Flight | None, bool]]:
        """The request's flight (coalesce.py) and whether it leads it: (None, False) where it
        may not share one. A leader's flight ends with its replica side (`_ReplicaSide.run`),
        or here, the side never run (the request failed or was cancelled before); a follower
        leaves the flight it follows as its side ends (`may_store`: till then, the Store may
        pass to it)."""
        policy = req.policy
        if not coalesce_mod.may_coalesce(self.coalesce, greedy, policy.skip_semantic_lookup,
                                         policy.skip_prefix_cache):
            yield None, False
            return
        key = coalesce_mod.flight_key(req.tenant.name, req.tenant.cache_salt, self.model_id,
                                      req.prompt.token_ids, req.sampling)
        flight, leads = self.flights.join(key, req.request_id, req.member, may_store)
        if not leads:
            COALESCED.inc()
        try:
            yield flight, leads
        finally:
            if leads:
                self.flights.end(flight)
            else:
                flight.leave(req.member)  # the side never run (else left as it ended)

    def _model_answer(self, state: _Request, session_id: str, seed: int, draft_ids: list[int],
                      look, may_store: bool, flight: coalesce_mod.Flight | None, leads: bool
                      ) -> Iterator[TextDelta | Finished]:
        """The model's answer (the semantic tier's missed): the prefix index's view of the
        prompt and its routing key, then the replica side, read ahead and drained here at the
        client's pace. A follower of a flight asks the index only if it must go on by itself."""
        tenant, policy, deadline = state.tenant, state.policy, state.deadline
        ids = state.prompt.token_ids
        # A Match cancelled with the request gives ring routing's empty view: the loop's
        # first check below ends the request before anything is routed.
        with state.tier_call():
            view = (PrefixView({}, "", None, []) if policy.skip_prefix_cache
                    else self._ring_view(tenant, ids) if flight is not None and not leads
                    else self._matches(tenant, ids, deadline, on_call=state.tier_call_started))
        session_key = session_routing_key(tenant, session_id)
        key = view.key
        if not key:
            # Keyed by tenant too: two tenants' prompts never share KV (their salts differ).
            # Not hash() of a str: it is salted per process, and every orchestrator pod must
            # put a prompt on the same replica (a tuple of ints hashes alike everywhere).
            key = session_key or f"{tenant.name}\x1f{hash(tuple(ids[:64]))}"
        affinity = session_key or key
        side = _ReplicaSide(self, state, seed=seed, draft_ids=draft_ids, view=view,
                            affinity=affinity, look=look, may_store=may_store, flight=flight,
                            leads=leads)
        ahead = _ReadAhead(side.run(), state.sampling.max_tokens + 4,
                           f"replica-stream-{state.request_id}", deadline,
                           state.cancel_downstream)
        try:
            for item in ahead:
                if isinstance(item, _Deferred):
                    item.run()  # on the request's thread, once the client has come this far
                else:
                    yield item
        finally:
            ahead.close()

    def _weigh_lookup(self, look: semantic_pb2.LookupResponse, req: _Request, greedy: bool,
                      serves_sampled: bool, want_draft: bool
                      ) -> tuple[list[int] | None, list[int]]:
        """What the semantic tier's answer `look` is for: (the hit's token ids to serve from
        the cache, or None when the model answers; the model's draft, [] for none). Fills the
        request's report's semantic fields, and counts a hit not served by its reason
        (too_short, ignore_eos, sampled), the hit then being the model's draft; a draft of ids
        outside this model's vocabulary is dropped (draft_dropped, in the request's notes)."""
        sampling, report, request_id = req.sampling, req.report, req.request_id
        report.semantic_similarity = look.similarity
        # What the similarity was held to, and a refusal above it: without them a model
        # answer after "nearest entry 0.962" did not say whether 0.962 missed the
        # threshold or the guard/verifier refused it.
        report.semantic_threshold = look.threshold
        report.semantic_tier = look.tier
        report.semantic_guard_rejected = look.guard_rejected
        report.semantic_guard_reason = look.guard_reason
        # A request's own threshold read as its tier's ("standard threshold 0.900").
        # Worked out here, not taken from the reply's threshold_from_request: it is the
        # threshold this orchestrator sent (0 = the tier's), and an older semantic tier
        # mid-roll leaves that field false.
        report.semantic_threshold_from_request = req.policy.semantic_threshold != 0.0
        # The answer's ids as the model generated them; tokenized again only for an entry
        # stored without them (the text alone: a client's Store, an older build's row).
        cached_ids = ((list(look.entry.answer_token_ids)
                       or self.renderer.encode_literal(look.entry.answer))
                      if look.HasField("entry") else [])
        # Whether this model has a token for every id: one pass, for the hit and for the
        # draft below alike.
        in_vocab = all(0 <= t < self._vocab for t in cached_ids)
        if look.hit and not in_vocab:
            # A hit whose ids this model has no token for (an entry stored by a client, or
            # by another model under the same id) was served with them: a client asking
            # for token ids got ids no token has, and one cut at max_tokens or a stop
            # token got its text decoded from them ("", the text lost). Its text is what
            # is served: tokenized again, as for an entry stored without ids. (A
            # near-miss's draft of such ids is dropped below.)
            log.warning("request %s: entry %s holds token ids outside the vocabulary of "
                        "%d; its answer is tokenized again", request_id, look.entry.id,
                        self._vocab)
            cached_ids = self.renderer.encode_literal(look.entry.answer)
            in_vocab = True  # the tokenizer's own ids
        why = _why_not_served(look, cached_ids, sampling, greedy, serves_sampled)
        if why:
            self.stats.not_served(why)
            report.semantic_not_served = why
        elif look.hit:
            return cached_ids, []
        if look.HasField("entry") and want_draft:
            if in_vocab:
                report.draft_entry_id = look.entry.id
                return None, cached_ids
            else:
                # Ids this model has no token for (an entry stored by a client, or by
                # another model under the same id): the replica refused the whole request
                # for them. A draft is advice: the answer goes on without it.
                log.warning("request %s: dropped the draft of entry %s (token ids outside "
                            "the vocabulary of %d)", request_id, look.entry.id, self._vocab)
                with _noting(req.notes):
                    self.stats.degrade("draft_dropped")
        return None, []

    def _store_answer(self, tenant: Tenant, prompt: RenderedPrompt, sampling: Sampling, look,
                      may_store: bool, generated: Sequence[int], finish_reason: int,
                      deadline: float, on_call: Callable[[grpc.Future], None],
                      by: float | None = None) -> str | None:
        """Stores the model's whole answer `generated` in the semantic tier where it may be
        served again; the entry's id, "" (not stored, or not to be), or None: not made, for
        want of time (`by`: the latest it may end; or timed out under it), or its client gone
        (`_store`)."""
        # Stored as the model said it: leading whitespace included (a raw completion's answer
        # often starts with a space; stripped, a hit's text and tokens were not the model's).
        answer = complete_decode(self.tok, generated)
        # An ignore_eos answer that ran on past the model's end of sequence is not an answer
        # to serve. One that ended at max_tokens or a stop token is stored as cut short after
        # its token count (it serves only requests that want no more tokens than that).
        past_end = sampling.ignore_eos and (not self._eos_ids
                                            or not self._eos_ids.isdisjoint(generated))
        cut_short = finish_reason != common_pb2.FINISH_REASON_EOS
        # An answer replaces a stored answer of the same prompt: a cut-short one not where the
        # lookup hit one at least as long (an ignore_eos request with a small max_tokens,
        # answered by the model despite a whole hit, replaced it, and every later request
        # missed). A request that skipped the lookup refreshes the entry, as it asked.
        shorter = cut_short and look is not None and look.hit and (
            not look.entry.truncated_at or look.entry.truncated_at >= len(generated))
        if not (self.semantic.enabled and may_store and not errors.blank(answer) and not past_end
                and not shorter):
            return ""
        return self._store(tenant, prompt, answer, len(generated) if cut_short else 0,
                           deadline, answer_ids(self.tok, self._special_ids, list(generated),
                                                answer),
                           on_call, by)

    def _ended(self, generated: list[int], sampling: Sampling) -> int | None:
        """The finish reason if `generated` is already a whole answer, else None."""
        if not generated:
            return None
        # In the replica's order: the end of sequence before a stop token (a client often
        # gives the EOS id as a stop token too).
        if not sampling.ignore_eos and generated[-1] in self._eos_ids:
            return common_pb2.FINISH_REASON_EOS
        if generated[-1] in sampling.stop_token_ids:
            return common_pb2.FINISH_REASON_STOP
        if len(generated) >= sampling.max_tokens:
            return common_pb2.FINISH_REASON_LENGTH
        return None

    def _serve_hit(self, look, ids: list[int], req: _Request):
        sampling, report = req.sampling, req.report
        answer = look.entry.answer
        finish = common_pb2.FINISH_REASON_CACHED
        stop = set(sampling.stop_token_ids)
        # In the replica's order: the end of sequence before a stop token. A stored answer that
        # ends at EOS, served whole to a request that lists EOS as a stop token too (clients
        # often do), is the whole answer (CACHED), not one cut at a stop token.
        last = len(ids) - 1
        first_stop = next((i for i, t in enumerate(ids) if t in stop
                           and not (i == last and t in self._eos_ids
                                    and not sampling.ignore_eos)), None)
        if first_stop is not None and first_stop < sampling.max_tokens:
            # The request's stop token ends the answer there, as it would end the model's
            # (the stop token is emitted, as the replica emits it).
            ids = ids[:first_stop + 1]
            # The stop token may be part of a character: never end on a broken one.
            answer = complete_decode(self.tok, ids)
            finish = common_pb2.FINISH_REASON_STOP
        elif len(ids) > sampling.max_tokens:  # the request wants less than the answer holds
            ids = ids[:sampling.max_tokens]
            answer = complete_decode(self.tok, ids)
            finish = common_pb2.FINISH_REASON_LENGTH
        elif look.entry.truncated_at:
            # Served whole, but the stored answer was itself cut short (the model would have
            # gone on): not CACHED, which says "whole", but LENGTH, as the model's run ended.
            finish = common_pb2.FINISH_REASON_LENGTH
        report.semantic_hit = True
        report.semantic_entry_id = look.entry.id
        report.route = "semantic"
        report.ttft_ms = (time.monotonic() - req.t0) * 1000.0
        yield TextDelta(answer, ids if req.return_token_ids else [])
        self._count("semantic_hit", 0, 0, 0, report.ttft_ms)
        with self.stats.lock:
            self.stats.semantic_tokens_saved += len(ids)
        TOKENS.labels("saved_semantic").inc(len(ids))
        yield Finished(finish, 0, len(ids), report, req.request_id)

    def _larger_pool(self, blocks: int, exclude: set, need: int | None) -> bool:
        """Whether a healthy replica not tried yet has more KV blocks than `blocks` and, when
        the request's `need` is known, at least that many: a larger pool still too small was
        handed the request anyway, one call more for the same refusal."""
        return any(r.stats is not None and _may_hold(r.stats.blocks_total, blocks, need)
                   for r in self.replicas.healthy()
                   if r.replica_id not in exclude and r.address not in exclude)

    def _larger_down(self, blocks: int, need: int | None):
        """The replica with the largest pool of those known down (not one serving another
        model) whose pool, as its last Stats said, has more KV blocks than `blocks` and, when
        the request's `need` is known, at least that many; None if none has."""
        down = [r for r in self.replicas.replicas
                if not r.health.healthy and not r.misfit
                and _may_hold(_pool_blocks(r), blocks, need)]
        return max(down, key=_pool_blocks, default=None)

    def _in_largest_pool(self, e: grpc.RpcError, refused_by=None) -> grpc.RpcError:
        """A replica's refusal of a request past every pool (`e`), in the words the largest
        pool known (its last Stats, up or down) gives: a small pool's own figures ("the pool
        has 8; sampling.max_tokens of at most 80 fits") told the client to fit under a pool
        smaller than the one it may use. `e` itself when its replica's pool is the largest,
        the need is not said, or a pool known may hold it. The refusing replica (`refused_by`)
        counts at the size its refusal says: its last Stats may be stale (restarted with a
        smaller pool), and named a pool of that old size that no replica has."""
        details = e.details() or ""
        need, said = _blocks_needed(e), _POOL_HAS.search(details)
        sizes = [r.stats for r in self.replicas.replicas
                 if r.stats is not None and not r.misfit and r is not refused_by]
        if need is None or said is None or not sizes:
            return e
        largest = max(sizes, key=lambda st: st.blocks_total)
        if not int(said.group(1)) < largest.blocks_total < need:
            return e
        # kvpool's words (engine `submit`): the room left for max_tokens by the prompt.
        tokens = _PROMPT_TOKENS.search(details)
        block = largest.block_size or self.hasher.block_size
        fits = (errors.pool_room(largest.blocks_total, block, int(tokens.group(1)))
                if tokens else "")
        return _Refusal(e.code(), details[:said.start()]
                        + f"the pool has {largest.blocks_total}{fits}" + details[said.end():])

    def _too_big_stands(self, too_big: grpc.RpcError | None, too_big_pool: int,
                        only_busy: bool, why_public: str
                        ) -> tuple[grpc.RpcError | None, bool, str]:
        """(too_big, only_busy, why_public) for the client's error once no replica is left
        to try. "Too big" is the answer only while no larger pool is down: one declared down
        after the small pool's refusal (or before it, only small pools left healthy) may
        hold the request once back, as a larger pool tried and lost on this request may
        (`failed_pool`), so it is UNAVAILABLE naming that replica, not a RESOURCE_EXHAUSTED
        clients never retry."""
        down = (None if too_big is None
                else self._larger_down(too_big_pool, _blocks_needed(too_big)))
        if down is None:
            return too_big, only_busy, why_public
        # Its health reason stays in Stats and the log (transport errors name addresses).
        return None, False, f"{down.public_id}, with a larger KV pool, is down"

    def _count(self, cache_class: str, prompt: int, cached: int, completion: int,
               ttft_ms: float) -> None:
        with self.stats.lock:
            self.stats.requests[cache_class] += 1
            self.stats.prompt_tokens += prompt
            self.stats.cached_tokens += cached
        REQUESTS.labels(cache_class).inc()
        TTFT.labels(cache_class).observe(ttft_ms / 1000.0)
        TOKENS.labels("prompt").inc(prompt)
        TOKENS.labels("cached").inc(cached)
        TOKENS.labels("generated").inc(completion)


class _Attempt:
    """One replica tried for a request: the routing decision, the replica's call and what its
    failure, if it fails, means for the request (see `_ReplicaSide._judge_failure`)."""

    def __init__(self, decision, replica, held: _Held, seen: dict[str, int],
                 downs_at: dict[str, int]) -> None:
        self.decision, self.replica, self.held = decision, replica, held
        self.seen = seen  # the matches routing saw (the index's and those sent moments ago)
        # How often each replica had been declared down before its health was read for
        # routing (see ReplicaSet.watch).
        self.downs_at = downs_at
        self.recorded = None  # this attempt's dispatch credit (DispatchMemory.record)
        self.from_here = 0  # this replica's tokens start here (in `generated`)
        self.call: grpc.Future | None = None
        # When this attempt's Generate was sent, until its first message or its end
        # (then timed: backend_call_seconds).
        self.called_at: float | None = None
        self.stream_ended = False
        self.busy = self.larger = False
        self.larger_kind = "larger_pool"  # the degradation a too-small pool counts as
        self.lost: BaseException | None = None  # the error to mark the replica down with
        self.why = ""  # the failure, for the log


class _ReplicaSide:
    """The replica side of one request, run on its read-ahead thread (see `_ReadAhead`):
    routes it, relays each replica's stream, fails over to another replica (resuming after
    the tokens already read) or hands a request too big for one pool to a larger one, then
    reports the answer and stores it. Its attributes are the state its attempts share."""

    def __init__(self, orch: Orchestrator, req: _Request, *, seed: int, draft_ids: list[int],
                 view: PrefixView, affinity: str, look: semantic_pb2.LookupResponse | None,
                 may_store: bool, flight: coalesce_mod.Flight | None = None,
                 leads: bool = False) -> None:
        self.orch, self.req = orch, req
        # The flight this request publishes its tokens into (`leads`), or reads them from.
        self.leads = flight if leads else None
        self.follows = None if leads else flight
        self.ids = req.prompt.token_ids
        self.seed, self.draft_ids, self.affinity = seed, draft_ids, affinity
        self.matches, self.new_blocks, self.hashes = view.matches, view.new_blocks, view.hashes
        self.look, self.may_store = look, may_store
        self.detok = IncrementalDetokenizer(orch.tok)
        self.generated: list[int] = []
        self.exclude: set[str] = set()
        self.tried: list[str] = []  # replica ids, for the client's error (addresses stay internal)
        self.final: kvpool_pb2.KvGenerateFinal | None = None
        # The final made here for a replica lost after the answer's last token: its figures
        # (cached tokens, forward passes, drafts) were never said, and read as zeros.
        self.made_up = False
        self.first_token_at: float | None = None
        self.attempts = 0
        # Of `attempts`, those max_attempts bounds: not a pool too small with a larger one
        # left (a hop to that pool, each replica asked once): counted, the attempts ran out
        # on small pools and the client was told "too big" for good, though the largest
        # replica held the request.
        self.failures = 0
        self.only_busy = True  # every replica tried so far said it was busy (Overloaded)
        # The first "needs more KV blocks than the pool has": the client's answer if no
        # replica with a larger pool takes the request either.
        self.too_big: grpc.RpcError | None = None
        self.too_big_pool = 0  # the largest pool that said so
        self.too_big_by = None  # the replica whose refusal too_big is
        # The largest pool among the replicas tried that failed otherwise (lost, busy): a
        # smaller pool's "too big" after it is no verdict, the request fits there once back.
        self.failed_pool = 0
        # That replica: its id (for the log), public id and failure (for the client's).
        self.failed_by = self.failed_public = self.failed_why = ""
        self.why_public = ""  # the last replica failure, as the client may see it
        # The report's `route` label (CacheReport.route): the first attempt's routing reason
        # ("prefix", "ring", ...), else "retry" ("resume" once tokens were read) whenever a
        # replica tried before the one that served it did not, busy or its pool too small
        # included (no failures, but the replica first chosen did not serve it; the
        # degradations say which), as the proto comment and README say.
        self.route = ""

    def run(self) -> Iterator[TextDelta | Finished | _Deferred]:
        """Tries replicas until one gives the whole answer (none left: the client's error),
        then reports it and stores it. A follower reads its leader's flight first: whole, it
        is the answer; else it goes on from the tokens read, leading the flight that takes
        over from its leader's (`_follow`)."""
        try:
            if self.follows is not None and (yield from self._follow()):
                yield from self._finish_followed()
                return
            while self.final is None:
                if self.req.cancelled.is_set():
                    raise errors.Cancelled("client cancelled")
                att = self._route()
                if (yield from self._attempt(att)):
                    self._after_failure(att)
            yield from self._finish(att)
        finally:
            if self.leads is not None:
                self.orch.flights.end(self.leads)  # whatever way it ended
            if self.follows is not None:
                self.follows.leave(self.req.member)  # no Store passes to it now

    def _follow(self) -> Generator[TextDelta, None, bool]:
        """The answer read from the flights followed (`_read_flight`); whether it is whole (its
        final in `final`). A leader that ended without finishing (its client gone, an error)
        is taken over (`Flights.take_over`): the first of its followers to go on leads a flight
        from the tokens read and goes on by itself from them, as a failover resumes (route
        "resume"; False here); the others follow that flight, and the same again if its leader
        ends unfinished. Tokens read that already make the whole answer end it as a finish
        would: the one taking over stores it where it may (`_followed_entry`), the others finish
        at once, naming its entry."""
        while True:
            self.final = yield from self._read_flight()
            if self.final is not None:
                return True
            # The tokens read may make the whole answer where the leader went before its final
            # message, as after a replica lost there.
            whole = self._whole_already()
            flight, leads = self.orch.flights.take_over(
                self.follows, self.req.request_id, self.final if whole else None,
                stores=self.may_store, ids=self.generated, member=self.req.member)
            if leads:
                self.leads = flight  # ended with this replica side (`run`), whatever way
                if not whole:
                    self._ask_index()
                return whole
            # The flight of the one taking over (finished at once where the tokens are whole:
            # the entry it stores them as is named, `_followed_entry`).
            self.follows = flight
            if whole:
                return True

    def _read_flight(self) -> Generator[TextDelta, None, kvpool_pb2.KvGenerateFinal | None]:
        """The tokens of the flight followed past those read, as they come (its backlog at
        once), handed on as this request's own until it ends: its final (None: its leader
        ended unfinished). The request whose run gave them (`Flight.ran_by`: its leader, but
        for a flight taken over whole) is `coalesced_with` if it gave a token or the final."""
        flight, req = self.follows, self.req
        had = len(self.generated)
        with self._woken_by_cancel(flight):
            while True:
                got = flight.read(len(self.generated), req.deadline, req.cancelled)
                if req.cancelled.is_set():
                    raise errors.Cancelled("client cancelled")
                if got.ids:
                    yield from self._take(got.ids)
                elif got.ended:
                    break
                else:
                    raise errors.DeadlineExceeded("deadline exceeded while generating")
        if len(self.generated) > had or got.final is not None:
            req.report.coalesced_with = flight.ran_by
        return got.final

    def _ask_index(self) -> None:
        """A follower going on by itself is routed as any request: the index asked now (the
        replica of the leader it takes over from holds the prompt and the tokens read, most
        likely)."""
        req = self.req
        with req.tier_call():
            view = self.orch._matches(req.tenant, self.ids, req.deadline,
                                      on_call=req.tier_call_started)
        self.matches, self.new_blocks = view.matches, view.new_blocks

    def _whole_already(self) -> bool:
        """Whether the tokens read make the whole answer (they reached max_tokens, a stop
        token or the end of sequence) though no final message came: then `final` is made
        here (`made_up`), as a resume would ask for 0 tokens, or generate on past the
        answer's end."""
        ended = self.orch._ended(self.generated, self.req.sampling)
        if ended is None:
            return False
        self.final = kvpool_pb2.KvGenerateFinal(finish_reason=ended)
        self.made_up = True
        return True

    def _finish_followed(self) -> Iterator[TextDelta | Finished | _Deferred]:
        """The answer is whole from the leader's run (its final in `final`): the report says
        so (route "coalesced", coalesced_with, the leader's replica; none of the prompt was
        computed for this request, so all of it counts as cached, and no forward pass or
        draft: the leader's report has its run's), counted as cache class "coalesced", and
        the entry the answer was stored as (`_followed_entry`)."""
        o, req, report = self.orch, self.req, self.req.report
        yield from self._flush()
        prompt_tokens = len(self.ids)
        ttft = ((self.first_token_at or time.monotonic()) - req.t0) * 1000.0
        report.prompt_tokens = report.cached_tokens = prompt_tokens
        report.replica_id = self.follows.replica_id
        report.ttft_ms = ttft
        report.route = "coalesced"
        yield _Deferred(lambda: o._count("coalesced", prompt_tokens, prompt_tokens, 0, ttft))
        yield from self._finished(self._followed_entry())

    def _followed_entry(self) -> str:
        """The entry the flight's answer was stored as ("" = none): stored by this request
        where it leads it (it took over, the tokens already whole) or claims the Store
        (`Flight.settle`: none holds it, its leader may not store, skip_semantic_store, or
        passed it on, its Store not made), where it may; else by the one that holds it, or
        will (a follower that may store, still there), waited for as long as a Store of this
        request's own may take (`_store_timeout`), the Store it claims meanwhile bounded by
        the same end: a follower's final comes no later than it would have without
        coalescing. The wait ends at once where none stores it, and with this request's
        client."""
        # One that took over with the tokens already whole leads its flight, its claim to the
        # Store made with it where it may store (`_follow`); else it waits as the others do.
        flight, req = self.leads or self.follows, self.req
        if self.may_store and self.leads is not None:
            return self._store()
        timeout = self.orch._store_timeout(req.deadline)
        by = time.monotonic() + (timeout or 0.0)
        with self._woken_by_cancel(flight):
            entry = flight.settle(req.member, self.may_store and timeout is not None, by,
                                  req.cancelled)
        return self._store(by) if entry is None else entry

    @contextlib.contextmanager
    def _woken_by_cancel(self, flight: coalesce_mod.Flight) -> Iterator[None]:
        """While inside, the request's client going wakes its wait on `flight` (its "call"
        in `current` is cancelled with the request)."""
        self.req.current["call"] = coalesce_mod.Waker(flight)
        try:
            yield
        finally:
            self.req.current.pop("call", None)

    def _route(self) -> _Attempt:
        """The replica for the next attempt, its load there counted (and the prompt's dispatch
        credit recorded) under the route lock; none left to try: the client's error (replicas
        of another model, too big for every pool, every one busy, or none available)."""
        o, req = self.orch, self.req
        with o._route_lock:
            if req.deadline - time.monotonic() <= 0:
                # Before routing, with the lock held (the time may run out waiting for
                # it): a request never sent must leave no prompt credit or routed count
                # behind (requests sharing its prefix would follow it there).
                raise errors.DeadlineExceeded(
                    "deadline exceeded before a replica answered")
            # How often each replica had been declared down before its health is read for
            # routing (see ReplicaSet.watch).
            downs_at = downs_by_address(o.replicas.replicas)
            seen = o._with_dispatched(self.matches, self.hashes)
            views = o.replicas.views()
            # A replica that failed is excluded by its address too: its first Stats
            # answer may rename it (from its address to its own id) between attempts.
            excluded = frozenset(self.exclude | {r.replica_id for r in o.replicas.replicas
                                                 if r.address in self.exclude})
            decision = o.routing.choose(views, seen, self.affinity, excluded, self.new_blocks,
                                        req.prompt.continues)
            replica = (o.replicas.by_id(decision.replica_id) if decision is not None
                       else None)
            if replica is not None:
                # Counted before the lock is released: a request routed right after this
                # one sees this replica's load with it.
                o.replicas.begin(replica)
                att = _Attempt(decision, replica, _Held(o.replicas, replica), seen, downs_at)
                if self.hashes and o.dispatched is not None:
                    att.recorded = o.dispatched.record(decision.replica_id, self.hashes,
                                                       self.req.tenant.cache_salt)
                return att
        self.too_big, self.only_busy, self.why_public = o._too_big_stands(
            self.too_big, self.too_big_pool, self.only_busy, self.why_public)
        misfits = "" if self.tried else o.replicas.misfits()
        if misfits:
            # Mid-roll to another model (or one left behind): said once per
            # request, naming both model ids and what to set (the replicas are
            # not asked). UNAVAILABLE, not FAILED_PRECONDITION: in a planned roll
            # the same request succeeds moments later on a rolled orchestrator
            # or replica, and clients retry UNAVAILABLE (`retry_later`).
            raise errors.Unavailable(misfits)
        raise _counted(req.tenant, _give_up(
            None if self.too_big is None else o._in_largest_pool(self.too_big, self.too_big_by),
            bool(self.tried) and self.only_busy,
            f"every kvpool replica is busy (tried {', '.join(self.tried)}); retry later",
            "no kvpool replica is available"
            + (f" (tried {', '.join(self.tried)})" if self.tried else "")
            + (f"; last: {self.why_public}" if self.why_public else ""),
            req.sampling)) from None

    def _attempt(self, att: _Attempt) -> Generator[TextDelta, None, bool]:
        """Sends the request (resumed after the tokens already read) to the attempt's replica
        and relays its stream; whether the replica is lost for this request (failed, busy or
        its pool too small: `_after_failure`, then the next attempt). Its call, its share of
        routing's load and its watcher end with the attempt."""
        o, req, replica, decision = self.orch, self.req, att.replica, att.decision
        sampling = req.sampling
        try:
            if (decision.route == "prefix"
                    and att.seen.get(decision.replica_id, 0) > self.matches.get(
                        decision.replica_id, 0)):
                DISPATCH_ROUTES.inc()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("route %s: %s -> %s (matched %d; index %s; sent moments ago %s; "
                          "loads %s)", req.request_id, decision.route, decision.replica_id,
                          decision.matched_tokens, dict(self.matches),
                          {r: t for r, t in att.seen.items() if t > self.matches.get(r, 0)},
                          {v.replica_id: v.load for v in o.replicas.views()})
            # A follower going on from its leader's tokens resumes at its first attempt.
            self.route = (decision.route if self.attempts == 0 and not self.generated
                          else ("resume" if self.generated else "retry"))
            remaining = req.deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded("deadline exceeded before a replica answered")
            att.from_here = len(self.generated)  # this replica's tokens start here
            kv_request = kvpool_pb2.KvGenerateRequest(
                request_id=req.request_id, token_ids=self.ids + self.generated,
                sampling=common_pb2.SamplingParams(
                    max_tokens=sampling.max_tokens - len(self.generated),
                    temperature=sampling.temperature, top_p=sampling.top_p,
                    seed=self.seed, stop_token_ids=sampling.stop_token_ids,
                    ignore_eos=sampling.ignore_eos),
                cache_salt=req.tenant.cache_salt, skip_prefix_cache=req.policy.skip_prefix_cache,
                draft_token_ids=self.draft_ids[len(self.generated):] if self.draft_ids else [],
                model_id=o.model_id,
                # A resumed answer continues the seeded randomness where it stopped.
                seed_offset=len(self.generated))
            att.called_at = time.monotonic()
            att.call = replica.stub.Generate(kv_request, timeout=remaining,
                                             metadata=call_metadata(o.internal_token,
                                                                    req.request_id))
            req.current["call"] = att.call
            # Declared down by the poller (hung: Stats unanswered) -> cancel this call; it
            # ends CANCELLED, which fails over below like any lost replica.
            att.held.watcher = att.held.cut_as_hung(att.call)
            o.replicas.watch(replica, att.held.watcher, att.downs_at.get(replica.address))
            if req.cancelled.is_set():
                att.call.cancel()
            yield from self._relay(att)
            att.stream_ended = True
            if self.final is None:
                # Ended cleanly but without its final message: the replica broke off (a
                # proxy or a replica going away); fail over as for a lost replica.
                raise _StreamCut(f"replica {replica.public_id} ended the stream without "
                                 "a final message")
            # Not ok(): a draining replica (down by the poller) finishing its streams must
            # not come back into routing with each one.
            replica.health.traffic_ok()
        except grpc.RpcError as e:
            att.stream_ended = True  # its status: the call is over
            return self._judge_failure(att, e)
        except _StreamCut as e:
            att.lost, att.why = e, str(e)
            self.why_public = att.why
            return True
        else:
            return False  # the final message arrived: the loop ends
        finally:
            if att.call is not None and not att.stream_ended:
                att.call.cancel()  # left mid-stream (the request closed): stop the replica
            req.current.pop("call", None)
            att.held.release()

    def _relay(self, att: _Attempt) -> Iterator[TextDelta]:
        """The replica's stream, read at its pace and handed on as text (and token ids, where
        asked); its final message kept in `final`."""
        # Read at the replica's pace (this runs on the request's read-ahead thread),
        # drained at the client's: the replica's share of routing's load and its
        # watcher are released as soon as its stream ends, and a lost replica is
        # resumed at once with every token read, however far behind the client is.
        for msg in att.call:
            if att.called_at is not None:
                # The replica's answer time (its queue and prefill, as this
                # orchestrator sees them); the rest of a stream is decode.
                CALL_SECONDS.labels("kvpool", "Generate", att.replica.address).observe(
                    time.monotonic() - att.called_at)
                att.called_at = None
            if msg.token_ids:
                yield from self._take(list(msg.token_ids), att.replica.public_id)
            if msg.HasField("final"):
                self.final = msg.final

    def _take(self, new: list[int], replica_id: str = "") -> Iterator[TextDelta]:
        """Tokens read (from replica `replica_id`, or a leader's flight): the answer's,
        published to this request's followers, handed on as text (and token ids, where
        asked)."""
        self.generated.extend(new)
        if self.leads is not None:
            self.leads.publish(new, replica_id)
        text = self.detok.push(new)
        if self.first_token_at is None:
            # When the orchestrator has it (handed on at once to a client keeping up; a slow
            # one takes it later).
            self.first_token_at = time.monotonic()
        return_ids = self.req.return_token_ids
        if text or return_ids:
            yield TextDelta(text, new if return_ids else [])

    def _judge_failure(self, att: _Attempt, e: grpc.RpcError) -> bool:
        """What a replica's failed call means for the request: whether it is lost for it (try
        another: busy, its pool too small, or the replica failed, refused our credential or
        serves another model; `att.lost` the error to mark it down with, `att.why` its log
        reason), False when the answer was already whole; the client's error when the client
        went, the deadline passed or the replica judged the request itself."""
        o, req, replica = self.orch, self.req, att.replica
        code = e.code()
        if att.called_at is not None and not req.cancelled.is_set():
            # Failed before its first message (refused, lost, hung and cut by the
            # poller): timed too, as the other tiers' failed calls are. Not one
            # its client cancelled: that time is the client's.
            CALL_SECONDS.labels("kvpool", "Generate", replica.address).observe(
                time.monotonic() - att.called_at)
        if self.final is not None:
            # The answer is whole: the stream broke only after the final message
            # (its trailing status lost, or the hung-replica watcher firing just then).
            log.info("replica %s: %s after the final message; answer complete",
                     replica.replica_id, code.name)
            return False
        if req.cancelled.is_set():
            raise errors.Cancelled("client cancelled") from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise errors.DeadlineExceeded(
                "deadline exceeded while generating") from None
        att.busy = code == grpc.StatusCode.RESOURCE_EXHAUSTED and errors.overloaded(e)
        if att.busy:
            # Full queue or memory held on this replica only: another may serve it
            # (an answer under way resumes there, exactly). Not marked down.
            if _LOAD_LINES.allow((f"replica {replica.replica_id}", "busy")):
                log.info("replica %s is busy (%s); trying another",
                         replica.replica_id, e.details())
        elif code in _REPLICA_REFUSED_US:
            # Our internal credential, not the client's: a misconfigured replica.
            # Never the client's UNAUTHENTICATED; try another replica.
            log.error("replica %s refused the orchestrator's internal credential (%s: "
                      "%s): check TIERCACHE_ORCHESTRATOR_INTERNAL_TOKEN and "
                      "TIERCACHE_KVPOOL_INTERNAL_TOKEN", replica.replica_id,
                      code.name, e.details())
        elif (code == grpc.StatusCode.FAILED_PRECONDITION
              and (e.details() or "").startswith("model_id:")):
            # The orchestrator sends its own model id: a replica serving another
            # model is a deployment fault, not the client's; try another replica.
            log.error("replica %s serves another model (%s)", replica.replica_id,
                      e.details())
        elif (code == grpc.StatusCode.RESOURCE_EXHAUSTED
              and (e.details() or "").startswith("token_ids:")
              and self._another_may_hold(_refused_pool(replica, e), e)):
            self._too_small(att, e)
        elif code not in _REPLICA_LOST:
            # The replica judged the request itself: pass its verdict on unchanged.
            if len(self.generated) == att.from_here and o.dispatched is not None:
                # Refused before computing anything (too big for every pool, say):
                # the prompt is not held there, and a request sharing it must not
                # follow this one's credit to that replica (and count the miss as
                # an eviction).
                o.dispatched.withdraw(att.recorded)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                e = o._in_largest_pool(e, replica)  # past every pool: the largest one's figures
            raise _counted(req.tenant, _as_domain(e, req.sampling)) from None
        self._note_why(att, e)
        return True

    def _note_why(self, att: _Attempt, e: grpc.RpcError) -> None:
        """Why the attempt's replica is lost for the request (its call failed with `e`): the
        error to mark it down with (`att.lost`, None where it is not to be), its log reason
        (`att.why`) and what the client's error will say (`why_public`)."""
        code, replica = e.code(), att.replica
        # INTERNAL / UNKNOWN: the replica failed this request, perhaps only it; try
        # another, but it is not marked down for everyone (Stats polls judge that):
        # one request that breaks replicas must not take every replica out of routing.
        att.lost = (None if att.busy or att.larger
                    or code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else e)
        att.why = f"{code.name}: {e.details()}"
        if not (att.larger and self.why_public):
            # A small pool's refusal after a replica failed keeps that failure as
            # the last reason ("last: RESOURCE_EXHAUSTED" named no replica's fault).
            self.why_public = f"{code.name}: {e.details()}" if att.busy else code.name
        if att.held.hung and code == grpc.StatusCode.CANCELLED:
            # Cancelled by us, the replica found hung: gRPC's own "Locally
            # cancelled by application!" read as if someone had asked for it.
            self.why_public = "hung (Stats polls unanswered)"
            att.why = ("cancelled by this orchestrator: "
                       f"{replica.health.last_error or self.why_public}")

    def _another_may_hold(self, blocks: int, e: grpc.RpcError) -> bool:
        """Whether a request too big for a pool of `blocks` KV blocks (its refusal `e`) may fit
        another one: a larger pool not tried yet, one tried that failed otherwise, or one
        down."""
        o, need = self.orch, _blocks_needed(e)
        return (o._larger_pool(blocks, self.exclude, need)
                or _may_hold(self.failed_pool, blocks, need)
                or o._larger_down(blocks, need) is not None)

    def _too_small(self, att: _Attempt, e: grpc.RpcError) -> None:
        """The attempt's replica refused the request as too big for its pool, not for every
        one: noted as "too big" unless a larger pool already failed on it, and said as a hand-
        off to a larger pool (larger_pool) or as none left to try (larger_pool_down)."""
        # Too big for this replica's pool, not for every one: pools sized by
        # kv_cache_bytes differ with each replica's hardware. A larger one
        # down is no verdict either (`_too_big_stands`), unless the request
        # needs more blocks than that pool has too.
        o, replica = self.orch, att.replica
        att.larger = True
        mine, need = _refused_pool(replica, e), _blocks_needed(e)
        if self.failed_pool <= mine:
            if self.too_big is None:
                self.too_big, self.too_big_by = e, replica
            self.too_big_pool = max(self.too_big_pool, mine)
        if o._larger_pool(mine, self.exclude, need):
            att.larger_kind, next_step = "larger_pool", "trying a larger pool"
        else:
            # No larger pool left to try: the one that may hold the request is
            # down (or failed on this request). Said and counted apart: "trying
            # a larger pool" and larger_pool read as a hand-off, though the
            # request then ended UNAVAILABLE.
            down = o._larger_down(mine, need)
            att.larger_kind = "larger_pool_down"
            next_step = ("no larger pool to try: "
                         + (f"{down.replica_id}, with a larger pool, is down"
                            if down is not None else
                            f"{self.failed_by}, with a larger pool, failed on it"))
        if _may_hold(self.failed_pool, mine, need):
            # A larger pool failed on this request (now down, too, if lost):
            # "(tried kvpool#1, kvpool#0); last: UNAVAILABLE" read as the small
            # pool's failure, and did not say the request needs that pool.
            self.why_public = (f"{self.failed_public}, with a larger KV pool, failed "
                               f"({self.failed_why})")
        if _LOAD_LINES.allow((f"replica {replica.replica_id}", "too small")):
            log.info("replica %s cannot hold the request (%s); %s",
                     replica.replica_id, e.details(), next_step)

    def _note_failure(self, att: _Attempt) -> None:
        """Notes the attempt's failure: its replica excluded and tried, what the client's
        error will say (busy, too big, the largest pool that failed), the replica marked down
        if lost, its dispatch credit forgotten, the attempt and the degradation counted."""
        o, req, replica = self.orch, self.req, att.replica
        busy, larger = att.busy, att.larger
        self.exclude.update((replica.replica_id, replica.address))
        self.tried.append(replica.public_id)
        # A pool too small is no reason to retry later; busy ones are: every replica
        # tried busy or too small is still "busy, retry later".
        self.only_busy = self.only_busy and (busy or larger)
        if not larger:
            # A replica with a larger pool was tried and failed otherwise (lost, busy):
            # the request may fit there once it is back, so "too big" is not the
            # answer (it was, though that replica never said so). Unless its pool, as
            # its last Stats said, is too small for what the refusal needs as well.
            if self.too_big is None or not _pool_blocks(replica) or _may_hold(
                    _pool_blocks(replica), self.too_big_pool, _blocks_needed(self.too_big)):
                self.too_big = None
            if _pool_blocks(replica) > self.failed_pool:
                self.failed_pool, self.failed_by = _pool_blocks(replica), replica.replica_id
                self.failed_public, self.failed_why = replica.public_id, self.why_public
        if att.lost is not None and not att.held.hung:
            # Not when the poller found it hung and we cut the call: it holds the
            # replica down with why, and our own CANCELLED ("Locally cancelled by
            # application!") was logged as the replica's new reason to be unhealthy.
            replica.health.fail(att.lost)
        if (att.lost is not None or busy or larger) and o.dispatched is not None:
            # What was sent there moments ago is not held there (lost), or would steer
            # the same prefix back to a replica that cannot take it (busy, or its pool
            # too small: every request routed there renewed the credit, so it never
            # expired while traffic went on).
            o.dispatched.forget(replica.replica_id)
        self.attempts += 1
        self.failures += not larger
        with _noting(req.notes):
            if busy or larger:
                # Saturation or a small pool, already logged at INFO above: counted
                # apart from replica failures, so alerts on "retry"/"resume" mean broken
                # replicas.
                o.stats.degrade("busy_replica" if busy else att.larger_kind)
            else:
                o.stats.degrade("resume" if self.generated else "retry")
                if _DEGRADED_LINES.allow((f"replica {replica.replica_id}",
                                          att.why.partition(":")[0])):
                    log.warning("replica %s failed (%s) after %d tokens; attempt %d",
                                replica.replica_id, att.why, len(self.generated),
                                self.attempts + 1)

    def _after_failure(self, att: _Attempt) -> None:
        """The attempt's replica is lost for this request: its failure noted
        (`_note_failure`). Then either the tokens read already make the whole answer (`final`
        made here), or the next replica is tried (resuming after them), unless max_attempts
        failures used the attempts up."""
        self._note_failure(att)
        o, req, replica = self.orch, self.req, att.replica
        if self._whole_already():  # the final message was lost
            log.info("replica %s failed after the answer's last token; answer complete",
                     replica.replica_id)
            return
        if self.failures >= o.max_attempts:
            # A "too big" that still stands where no pool, tried or not, up or down, may hold
            # the request is the answer (RESOURCE_EXHAUSTED, for good): the failure that used
            # up the attempts was a pool smaller than the request's need, and UNAVAILABLE had
            # clients retry a request that can never fit. One a pool may still hold is not.
            # The replica's own message (transport errors name internal addresses) is in
            # the log line above, not in the client's status.
            too_big = (self.too_big if self.too_big is not None
                       and not self._another_may_hold(self.too_big_pool, self.too_big)
                       else None)
            raise _counted(req.tenant, _give_up(
                None if too_big is None else o._in_largest_pool(too_big, self.too_big_by),
                self.only_busy,
                f"every kvpool replica tried is busy (tried {', '.join(self.tried)}); "
                f"last: {self.why_public}"
                # A replica's own refusal may say it already (past max_waiting).
                + ("" if "retry later" in self.why_public else "; retry later"),
                f"kvpool replicas failed {self.failures} times "
                f"(tried {', '.join(self.tried)}); last: {self.why_public}",
                req.sampling)) from None

    def _finish(self, att: _Attempt) -> Iterator[TextDelta | Finished | _Deferred]:
        """The answer is whole (`att` its last attempt): the detokenizer's tail, the report,
        the request's counts and metrics (deferred until its client has the last token), the
        answer stored in the semantic tier, then the final event."""
        o, req, report, final = self.orch, self.req, self.req.report, self.final
        # The replica whose tokens end the answer: its own id (its final message), or its
        # public id where the final was made here (lost after the answer's last token, before
        # its final message). Naming the lost replica is right there: it produced the answer
        # (its part, after a resume); being lost is what became of it afterwards (counted as
        # retry/resume in the degradations).
        report.replica_id = final.replica_id or att.replica.public_id
        if self.leads is not None:
            # Its followers need not wait more; the Store below is the flight's where it may.
            self.leads.finish(final, report.replica_id, stores=self.may_store)
        yield from self._flush()
        prompt_tokens = len(self.ids)
        cached = min(final.cached_tokens, prompt_tokens)
        ttft = ((self.first_token_at or time.monotonic()) - req.t0) * 1000.0
        report.prompt_tokens = prompt_tokens
        report.cached_tokens = cached
        report.ttft_ms = ttft
        report.draft_tokens_proposed = final.draft_tokens_proposed
        report.draft_tokens_accepted = final.draft_tokens_accepted
        report.lookup_tokens_accepted = final.lookup_tokens_accepted
        report.forward_passes = final.forward_passes
        report.route = self.route
        # What the last replica chosen was expected to hold, against what it reused.
        expected = min(att.seen.get(att.decision.replica_id, 0), prompt_tokens)
        report.index_matched_tokens = expected
        fin, completion, made_up = final, len(self.generated), self.made_up
        passes_saved = (0 if made_up
                        else max(0, completion - att.from_here - 1 - fin.forward_passes))

        def account() -> None:
            # The request's counts and metrics, made as before once its client has taken
            # the last token (a client gone before is not a request served).
            DRAFT_TOKENS.labels("proposed").inc(fin.draft_tokens_proposed)
            DRAFT_TOKENS.labels("accepted_from_cache").inc(
                max(0, fin.draft_tokens_accepted - fin.lookup_tokens_accepted))
            DRAFT_TOKENS.labels("accepted_from_lookup").inc(fin.lookup_tokens_accepted)
            PASSES_SAVED.inc(passes_saved)
            MATCHED_TOKENS.inc(expected)
            # A replica computes at least the prompt's last token, held or not. Not known
            # of a replica lost before its final message: counted as nothing reused, its
            # whole match read as evicted.
            if not made_up:
                MATCH_SHORTFALL.inc(max(0, min(expected, prompt_tokens - 1) - cached))
            cache_class = "prefix_hit" if cached >= o.min_prefix_tokens else "cold"
            o._count(cache_class, prompt_tokens, cached, completion, ttft)

        yield _Deferred(account)
        # Stored as the replica finishes, not once the client has read the answer: a client
        # reading slowly no longer holds the Store back, nor, too slow for its deadline,
        # leaves its whole answer unstored.
        yield from self._finished(self._store())

    def _store(self, by: float | None = None) -> str:
        """The whole answer stored in the semantic tier where it may be (`by`: the latest its
        Store may end, one passed on to a follower): its entry id, or ""; told to the
        request's flight (its followers name the entry) where it is its storer: where it may
        store (one that may, storing, has claimed it: `_finish`, `_follow`,
        `_followed_entry`). A Store not made (no time left for it, cancelled with the request,
        or timed out under its own bound) is passed on to another of the flight that may store
        (`Flight.stored`)."""
        req, sid = self.req, ""
        try:
            with req.tier_call():
                sid = self.orch._store_answer(req.tenant, req.prompt, req.sampling, self.look,
                                              self.may_store, self.generated,
                                              self.final.finish_reason, req.deadline,
                                              req.tier_call_started, by)
        finally:
            flight = self.leads or self.follows
            if flight is not None and self.may_store:
                flight.stored(req.member, sid)
        return sid or ""

    def _flush(self) -> Iterator[TextDelta]:
        """The detokenizer's tail (text held back for a character's next bytes), if any."""
        tail = self.detok.flush()
        if tail:
            yield TextDelta(tail, [])

    def _finished(self, sid: str = "") -> Iterator[Finished]:
        """The final event (`sid`: the entry the answer was stored as), unless the client has
        gone."""
        req, report = self.req, self.req.report
        report.degradations.extend(req.notes)
        if req.cancelled.is_set():
            # Gone during the Store (cancelled with it): no final message, for nobody.
            raise errors.Cancelled("client cancelled")
        if sid:
            report.semantic_entry_id = sid
        yield Finished(self.final.finish_reason, len(self.ids), len(self.generated), report,
                       req.request_id)


# The most of what is left of a request's deadline that an optional cache call may take: a
# tier that hangs must leave the replica most of the time (a lookup given all of it failed
# every request with a deadline under the tier's timeout), and a Store after the answer must
# leave time for the final message.
_CACHE_SHARE = 0.25
_STORE_SHARE = 0.5
_STORE_MIN_S = 0.05  # a Store is only sent with at least this long for it (embed + write)


def _within(timeout_s: float, deadline: float, share: float = 1.0) -> float | None:
    """`timeout_s`, or `share` of what is left of the request's deadline when that is less;
    None when the deadline has passed."""
    left = deadline - time.monotonic()
    return None if left <= 0 else min(timeout_s, share * left)


def _pool_blocks(replica) -> int:
    """`replica`'s KV blocks as its last Stats said (0 before any)."""
    return replica.stats.blocks_total if replica.stats is not None else 0


# A replica's "too big" refusal: "token_ids: prompt (37 tokens) + sampling.max_tokens (256) need
# 19 KV blocks, the pool has 16; ..." (kvpool's engine, `submit`).
_NEED = re.compile(r"\bneed (\d+) KV blocks\b")
# Its pool's figures, and the prompt's length they were worked out from.
_POOL_HAS = re.compile(r"\bthe pool has (\d+)(?:; sampling\.max_tokens of at most \d+ fits"
                       r"|; the prompt alone is too long for it)?")
_PROMPT_TOKENS = re.compile(r"\bprompt \((\d+) tokens\)")


class _Refusal(grpc.RpcError):
    """A replica's refusal said in other words (`Orchestrator._in_largest_pool`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _refused_pool(replica, e: grpc.RpcError) -> int:
    """The KV blocks of `replica`'s pool that refused a request as too big (`e`): the
    refusal's own "the pool has N", else its last Stats. A replica just restarted with a
    smaller pool, its Stats not polled since, read as its old size: a larger pool than its
    new one, though smaller than the old, was not handed the request it would hold."""
    said = _POOL_HAS.search(e.details() or "")
    return int(said.group(1)) if said else _pool_blocks(replica)


def _blocks_needed(e: grpc.RpcError) -> int | None:
    """The KV blocks a replica's "too big" refusal says the request needs; None if it does not
    say (another build's words). The replica's own figure, not one worked out here: it counts
    by its block size and knows which tokens its pool keeps (the last generated one is not)."""
    m = _NEED.search(e.details() or "")
    return int(m.group(1)) if m else None


def _may_hold(pool: int, blocks: int, need: int | None) -> bool:
    """Whether a pool of `pool` KV blocks (a replica up, down, or lost on this request) may hold
    a request a pool of `blocks` refused as needing `need` blocks, once it is back: larger,
    and not smaller than the need where the refusal said it. The pool sizes are the replicas'
    last Stats: a request past every pool, down or not, is refused for good (RESOURCE_EXHAUSTED,
    the words of the up case), not UNAVAILABLE, which clients retry forever."""
    return pool > blocks and (need is None or pool >= need)


def _give_up(too_big: grpc.RpcError | None, all_busy: bool, busy: str,
             unavailable: str, sampling: Sampling | None = None) -> errors.TierCacheError:
    """The client's error once no replica is left to try (none routable, or attempts used
    up), in one order: too big for every pool that was tried (a fixed limit), then every
    replica tried busy (retry later: Overloaded), then unavailable."""
    if too_big is not None:
        return _as_domain(too_big, sampling)
    if all_busy:
        return errors.Overloaded(busy)
    return errors.Unavailable(unavailable)


def _counted(tenant: Tenant, e: errors.TierCacheError) -> errors.TierCacheError:
    """`e`, counted in tiercache_orchestrator_rejections_total when it is "every replica busy"
    (reason replicas_busy): a burst past the replicas' queues showed there only as
    busy_replica degradations, one per replica tried (a request that then found a free
    replica counted too), so the refusals by reason did not add up to what clients saw. A
    replica's own RESOURCE_EXHAUSTED (a request its KV pool can never hold) counts as kv_pool:
    passed on as it came, it was counted in no reason at all."""
    if isinstance(e, errors.Overloaded):
        REJECTED.labels(tenant.name, "replicas_busy").inc()
    elif e.code == "RESOURCE_EXHAUSTED":
        REJECTED.labels(tenant.name, "kv_pool").inc()
    return e


def _as_domain(e: grpc.RpcError, sampling: Sampling | None = None) -> errors.TierCacheError:
    """A replica's status, re-raised with the same code and message — its fields renamed to
    the caller's: the replica's token_ids are the rendered prompt (messages or prompt), and
    its sampling.max_tokens, when the client set none (`sampling`), the server's default."""
    details = e.details() or ""
    if details.startswith("token_ids:"):
        details = "prompt (rendered messages):" + details[len("token_ids:"):]
        if sampling is not None and not sampling.max_tokens_set:
            # "prompt + sampling.max_tokens (256) need 19 KV blocks" told a client that had
            # sent no max_tokens to change it as if it had.
            details = re.sub(r"\+ sampling\.max_tokens \((\d+)\)",
                             r"+ the default max_tokens (\1; the request set no "
                             r"sampling.max_tokens)", details, count=1)
    exc = errors.TierCacheError(details)
    exc.code = e.code().name if e.code() is not None else "INTERNAL"
    return exc
