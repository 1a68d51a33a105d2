"""gRPC adapter of the orchestrator: proto <-> pipeline, plus Warm, Feedback and Stats."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import grpc
from tiercache.v1 import (
    common_pb2,
    kvpool_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    semantic_pb2,
)

from services.common import errors
from services.common.bootstrap import on_rpc_end, rpc_ended
from services.common.grpc_client import call_metadata, cut_short
from services.common.logs import Thinned, bound_request_id, request_id_var
from services.common.metrics import counter
from services.common.reaper import StreamReaper
from services.common.tokens import validate_stop_ids
from services.orchestrator.backends import downs_by_address, timed
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.pipeline import Finished, Orchestrator, Policy, Sampling
from services.orchestrator.render import Message
from services.orchestrator.tenants import (
    MAX_TENANT_CHARS,
    REJECTED,
    TenantRegistry,
    check_prompt_tokens,
)

log = logging.getLogger(__name__)

WARM_CYCLES = counter("tiercache_orchestrator_warmup_cycles_total",
                      "Background warm-up cycles by outcome: ran (some prefill sent), "
                      "nothing_to_warm (every hot prefix held where it could be), "
                      "replicas_busy (the replicas lacking one had requests), held_load "
                      "(cluster load above warm_max_load), no_replica (none healthy), "
                      "index_unavailable", ("outcome",))
WARM_PREFILLS = counter("tiercache_orchestrator_warmup_prefills_total",
                        "Prefills the background warm-up sent, by result (ok, failed)",
                        ("result",))
WARM_TOKENS = counter("tiercache_orchestrator_warmup_tokens_total",
                      "Prompt tokens of the background warm-up's prefills that succeeded: "
                      "computed (new on the replica) and cached (held there already)",
                      ("kind",))
_WARM_FAILED_LINES = Thinned(log, level=logging.WARNING)
REAPED = counter("tiercache_orchestrator_streams_ended_at_deadline_total",
                 "Generate streams still under way a second past their deadline, ended from "
                 "outside: a client that stopped reading (its handler stuck sending), or a "
                 "handler stuck anywhere else (the pipeline ends a request at its deadline)")
# Ratings applied: without them a tuned semantic threshold could be judged in production by
# its hit rate alone, the false hits users reported nowhere in the metrics.
FEEDBACK = counter("tiercache_orchestrator_feedback_total",
                   "Feedback ratings of semantic hits applied, by rating: good (the entry "
                   "verified, served at the verified bonus from then on) and bad (a wrong answer: "
                   "invalidated, or gone already); bad against requests_total{cache_class="
                   "\"semantic_hit\"} is the false hits users reported", ("rating",))
# How long past a request's deadline the reaper waits: the pipeline ends a request by itself
# at its deadline (its replica call runs to it; what was read ahead is handed out until it);
# the reaper is for one stuck in a send.
REAP_GRACE_S = 1.0


def parse_sampling(s: common_pb2.SamplingParams, cfg: OrchestratorConfig,
                   vocab_size: int | None = None) -> Sampling:
    """Validate sampling fields; raises InvalidArgument naming the field.

    Stop ids are checked here, before the semantic lookup and routing: a request the replica
    would refuse must not be answered from the cache, nor leave routing state behind."""
    if s.max_tokens < 0:
        # 0 is valid here (the default): "must be > 0" told a client its unset field was wrong.
        raise errors.InvalidArgument("sampling.max_tokens", f"must be >= 0 (0 = the server's "
                                     f"default_max_tokens), got {s.max_tokens}")
    max_tokens = s.max_tokens or cfg.default_max_tokens
    if max_tokens > cfg.max_tokens_limit:
        raise errors.InvalidArgument("sampling.max_tokens",
                                     f"{max_tokens} exceeds the limit of {cfg.max_tokens_limit}")
    if not 0.0 <= s.temperature < math.inf:  # also rejects NaN
        raise errors.InvalidArgument("sampling.temperature",
                                     f"must be a finite number >= 0, got {s.temperature}")
    top_p = s.top_p if s.top_p != 0.0 else 1.0
    if not 0.0 < top_p <= 1.0:
        raise errors.InvalidArgument("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
    # The replicas' own check, before any tier runs (count only when the vocabulary is unknown).
    validate_stop_ids(s.stop_token_ids, math.inf if vocab_size is None else vocab_size)
    return Sampling(max_tokens, float(s.temperature), float(top_p), int(s.seed),
                    tuple(s.stop_token_ids), bool(s.ignore_eos), max_tokens_set=s.max_tokens > 0)


def parse_policy(p: common_pb2.CachePolicy, floor: float = 0.0) -> Policy:
    """The request's cache policy; `floor` is the semantic tier's threshold floor where its
    shards have said it (0.0: not yet)."""
    if p.semantic_tier and p.semantic_tier not in ("strict", "standard", "relaxed"):
        # The accepted names said, as the semantic tier's own refusal says them.
        raise errors.InvalidArgument("cache_policy.semantic_tier",
                                     f"unknown tier {errors.shown(p.semantic_tier)}; expected "
                                     "one of strict, standard, relaxed")
    if p.semantic_threshold and not 0.0 < p.semantic_threshold <= 1.0:
        # The value said: "must be in (0, 1]" alone sent a caller who gave 1.5 to 0.5, which
        # the floor check refuses next.
        # The floor's value where known, as the floor check below says it: NaN or 1.5 read
        # "[the semantic floor, 1]" while 0.84 read "[0.85, 1]", the same bound.
        bound = f"{floor:g}" if floor else "the semantic floor"
        raise errors.InvalidArgument("cache_policy.semantic_threshold",
                                     f"must be 0 (tier default) or in [{bound}, 1], "
                                     f"got {errors.as_written(p.semantic_threshold)}")
    return Policy(p.skip_semantic_lookup, p.skip_semantic_store, p.skip_prefix_cache,
                  p.skip_draft, p.semantic_tier, p.semantic_threshold, p.store_sampled,
                  p.serve_sampled)


def check_size(renderer, cfg: OrchestratorConfig, tenant, field: str, texts: list[str]) -> None:
    """Before any rendering: what cannot fit in the server's prompt limit (INVALID_ARGUMENT)
    or in the tenant's (RESOURCE_EXHAUSTED, as the tenant's check after tokenizing says). A
    tenant limited to 100 tokens had the server render and tokenize up to the server limit's
    worth of text (660k characters at 8,192 tokens) only to be refused."""
    chars = sum(map(len, texts))
    renderer.check_size(field, len(texts), chars, cfg.max_prompt_tokens)
    if tenant.max_prompt_tokens < cfg.max_prompt_tokens:
        why = renderer.size_problem(len(texts), chars, tenant.max_prompt_tokens, "tenant limit")
        if why:
            REJECTED.labels(tenant.name, "prompt_tokens").inc()
            raise errors.ResourceExhausted(f"{field}: {why}")


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    """Bound before the tokenizer loads (health NOT_SERVING); `attach` makes it ready."""

    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg
        self.orch: Orchestrator | None = None
        self.tenants: TenantRegistry | None = None
        self.warmer = None
        self._streams = 0  # Generate streams in progress (see OrchestratorConfig.max_streams)
        self._streams_lock = threading.Lock()
        self._reaper = StreamReaper(on_reap=lambda details: (REAPED.inc(), log.warning(
            "ended a Generate stream at its deadline: %s", details)))

    def attach(self, orch: Orchestrator, tenants: TenantRegistry, warmer=None) -> None:
        self.orch, self.tenants, self.warmer = orch, tenants, warmer

    def authenticate_call(self, metadata) -> None:
        """The interceptor's check, before a call's request is parsed: a call without a valid
        token is refused at the cost of its transfer alone (16 MiB of empty messages took
        1.2 s and 420 MB to parse, only to be refused). While loading, the handler says so."""
        tenants = self.tenants
        if tenants is not None:
            tenants.authenticate(metadata)

    def _tenant(self, context: grpc.ServicerContext):
        if self.orch is None or self.tenants is None:
            raise errors.Starting("orchestrator is still loading")
        tenant = self.tenants.authenticate(tuple(context.invocation_metadata() or ()))
        self.tenants.check_rate(tenant)
        return tenant

    def Generate(self, request, context):
        # TTFT counts from here: rendering and tokenizing a long prompt is part of what the
        # client waits for.
        arrived = time.monotonic()
        tenant = self._tenant(context)
        sampling = parse_sampling(request.sampling, self.cfg, len(self.orch.tok))
        floor = self.orch.semantic.threshold_floor() if self.orch.semantic.enabled else 0.0
        policy = parse_policy(request.cache_policy, floor)
        if (policy.semantic_threshold and not policy.skip_semantic_lookup
                and policy.semantic_threshold < floor - 1e-6):
            # Checked here too, against the floor the tier said: only its Lookup refused it,
            # so the same request was refused while the tier was up and served while it was
            # skipped. The tier's own words (it checks again). The value as the caller wrote
            # it (`errors.as_written`, as parse_policy says it): the wire's float32 made 0.1
            # "0.10000000149011612".
            raise errors.InvalidArgument(
                "cache_policy.semantic_threshold", f"must be 0 (tier default) or in "
                f"[{floor:g}, 1], got {errors.as_written(policy.semantic_threshold)}")
        if not request.messages and not request.prompt:
            raise errors.InvalidArgument("messages", "must not be empty (or give prompt)")
        if request.messages and request.prompt:
            # The prompt was dropped without a word: a client that set both meant one of them.
            raise errors.InvalidArgument("prompt", "give messages or prompt, not both")
        if len(request.session_id) > MAX_SESSION_ID_CHARS:
            # Routing hashes it once per replica under the route lock: a 15 MiB id held that
            # lock for every tenant's requests for 40-200 ms a decision.
            raise errors.InvalidArgument("session_id", f"{len(request.session_id)} characters "
                                         f"exceed the limit of {MAX_SESSION_ID_CHARS}")
        if request.messages:
            check_size(self.orch.renderer, self.cfg, tenant, "messages",
                       [m.content for m in request.messages])
        # The id the interceptor bound to this call's logs (the client's x-request-id if short
        # and plain, else one it made up) and sent in the response headers: one id in every
        # log line, every downstream call and GenerateFinal.
        request_id = request_id_var.get() or uuid.uuid4().hex[:16]
        remaining = context.time_remaining()
        budget = self.cfg.request_timeout_s if remaining is None else min(
            remaining, self.cfg.request_timeout_s)
        deadline = time.monotonic() + budget
        # A client that stops reading (its connection open, answering keepalives) held this
        # handler inside a send, past every check of the deadline: the stream, a worker and
        # the tenant's slot stayed taken until the connection's maximum age, or for good.
        # Ended from outside at the deadline (request_timeout_s caps a longer client one).
        reap = self._reaper.arm(
            deadline + REAP_GRACE_S, context,
            f"deadline exceeded: the answer was not read within {budget:.4g} s "
            f"(request {request_id}; request_timeout_s {self.cfg.request_timeout_s:g} s)")
        try:
            # Rendering and tokenizing is the costly part of checking a request: it runs in
            # the server's stream slot and the tenant's, under their limits. (A call ended here
            # just after its final message went out is whole: clients take a status after the
            # final message as the end of a whole answer.)
            with self._admitted(tenant):
                prompt, sampling = self._prepare(request, tenant, sampling)
                yield from self._generate(context, tenant, prompt, sampling, policy,
                                          request, request_id, deadline, arrived)
        finally:
            self._reaper.disarm(reap)

    def _prepare(self, request, tenant, sampling):
        """The rendered prompt and the sampling it runs with, after every limit."""
        if request.messages:
            prompt = self.orch.renderer.render_chat(
                [Message(m.role, m.content) for m in request.messages], scope=tenant.name)
        else:
            prompt = self.orch.renderer.render_raw(request.prompt, scope=tenant.name)
        if len(prompt.token_ids) > self.cfg.max_prompt_tokens:
            raise errors.InvalidArgument(
                "messages" if request.messages else "prompt",
                f"{len(prompt.token_ids)} tokens exceed the limit of {self.cfg.max_prompt_tokens} "
                "(the orchestrator's max_prompt_tokens)")  # one past the context said neither
        if not request.sampling.max_tokens and sampling.max_tokens > tenant.max_tokens:
            # Unset max_tokens means the server default, capped by the tenant's limit: a
            # field the client never set must not fail its request.
            sampling = dataclasses.replace(sampling, max_tokens=tenant.max_tokens)
        context_limit = self.orch.replicas.max_context()
        n_prompt = len(prompt.token_ids)
        if context_limit and n_prompt + sampling.max_tokens > context_limit:
            # Checked here, before any tier: a request the replicas would refuse must not be
            # answered from the semantic cache, nor leave routing state behind.
            if not request.sampling.max_tokens and n_prompt < context_limit:
                sampling = dataclasses.replace(sampling, max_tokens=context_limit - n_prompt)
            elif not request.sampling.max_tokens:
                # Not "+ sampling.max_tokens (256)": a client that never set it was told to
                # change a field it did not send; the prompt alone is too long.
                raise errors.InvalidArgument(
                    "messages" if request.messages else "prompt",
                    f"prompt ({n_prompt} tokens) leaves no room for an answer in the model "
                    f"context ({context_limit}): at most {context_limit - 1} prompt tokens")
            else:
                raise errors.InvalidArgument(
                    "messages" if request.messages else "prompt",
                    f"prompt ({n_prompt} tokens) + sampling.max_tokens ({sampling.max_tokens}) "
                    f"exceed the model context ({context_limit})")
        self.tenants.check_limits(tenant, len(prompt.token_ids), sampling.max_tokens,
                                  "messages" if request.messages else "prompt")
        return prompt, sampling

    def _generate(self, context, tenant, prompt, sampling, policy, request, request_id,
                  deadline, arrived: float | None = None):
        try:
            events = self.orch.generate(
                tenant=tenant, prompt=prompt, sampling=sampling, policy=policy,
                session_id=request.session_id, return_token_ids=request.return_token_ids,
                request_id=request_id, deadline=deadline, arrived=arrived,
                on_cancel=lambda fn: on_rpc_end(context, fn))
            for ev in events:
                if isinstance(ev, Finished):
                    ev.report.semantic_entry_id = self.tenants.entry_ref(
                        tenant, ev.report.semantic_entry_id)
                    ev.report.draft_entry_id = self.tenants.entry_ref(
                        tenant, ev.report.draft_entry_id)
                    yield orchestrator_pb2.GenerateResponse(
                        final=orchestrator_pb2.GenerateFinal(
                            finish_reason=ev.finish_reason,
                            usage=common_pb2.Usage(prompt_tokens=ev.prompt_tokens,
                                                   completion_tokens=ev.completion_tokens),
                            cache_report=ev.report, request_id=ev.request_id))
                else:
                    yield orchestrator_pb2.GenerateResponse(text=ev.text, token_ids=ev.token_ids)
        except errors.Cancelled:
            # The RPC-end callback fires for an expired deadline too: say which it was
            # (the client sees DEADLINE_EXCEEDED either way; metrics and logs must agree).
            raise rpc_ended(context) from None

    @contextlib.contextmanager
    def _admitted(self, tenant) -> Iterator[None]:
        """A server stream slot and one of the tenant's, held for the call. A call either
        refuses gives its rate token back: it did no work."""
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self._stream_slot(tenant.name))
                counted = self.tenants.acquire(tenant)
            except errors.Overloaded:
                self.tenants.refund(tenant)
                raise
            held.callback(self.tenants.release, counted)
            yield

    @contextlib.contextmanager
    def _stream_slot(self, tenant_name: str) -> Iterator[None]:
        """One of the server's `max_streams` Generate slots, for the stream's lifetime."""
        with self._streams_lock:
            if self._streams >= self.cfg.max_streams:
                REJECTED.labels(tenant_name, "server_streams").inc()
                raise errors.Overloaded(
                    f"server: {self._streams} concurrent streams (limit {self.cfg.max_streams}"
                    "); retry shortly or on another orchestrator")
            self._streams += 1
        try:
            yield
        finally:
            with self._streams_lock:
                self._streams -= 1

    def Warm(self, request, context):
        tenant = self._tenant(context)
        if self.warmer is None:
            raise errors.FailedPrecondition("warm-up is not available")
        # A warm-up holds a tenant slot and a server stream slot like a request does (it holds
        # a worker thread for up to 120 s: uncounted, Warm calls could take the threads kept
        # for health probes and Stats), and ends by the caller's deadline.
        with self._admitted(tenant):
            gone = _Gone()  # the caller cancelled or went away
            on_rpc_end(context, gone.set)
            return self.warmer.warm(tenant, request, context.time_remaining(),
                                    charge=lambda n: self.tenants.charge(tenant, n), gone=gone,
                                    afford=lambda n: self.tenants.afford(tenant, n))

    def Feedback(self, request, context):
        tenant = self._tenant(context)
        if not request.semantic_entry_id:
            raise errors.InvalidArgument("semantic_entry_id", "required")
        if request.rating not in (orchestrator_pb2.RATING_GOOD, orchestrator_pb2.RATING_BAD):
            raise errors.InvalidArgument("rating", "must be RATING_GOOD or RATING_BAD")
        sem = self.orch.semantic
        if not sem.enabled:
            raise errors.FailedPrecondition("the semantic tier is not configured")
        # Only references this tenant was given: another tenant's entry is simply not found.
        entry_id = self.tenants.entry_id(tenant, request.semantic_entry_id)
        if entry_id is None:
            # A reference of the right shape whose signature fails: said what may be behind it
            # (a bare "unknown" after a hash-key rotation sent operators looking for a lost
            # entry). Not said for one of another shape, which no key ever signed.
            raise errors.NotFound(
                f"semantic_entry_id: {errors.shown(request.semantic_entry_id)} unknown"
                + (" (not issued to this tenant, or signed with an earlier hash key: "
                   "references given before the hash key was rotated are no longer accepted)"
                   if self.tenants.signed_like(request.semantic_entry_id) else ""))
        # The tier's call under way when the caller cancels is cancelled with it, as a
        # Generate's are: it ran to its end (up to the tier's 2 s on a hung shard), holding a
        # worker, and the tier applied a rating whose client had seen CANCELLED.
        gone = _Gone()
        on_rpc_end(context, gone.set)
        try:
            deadline = _call_deadline(context)
            if request.rating == orchestrator_pb2.RATING_BAD:
                n = sem.invalidate(entry_id, deadline, on_call=gone.holding).removed
                # 0: removed meanwhile by another call (a race with a second "bad"): done, as
                # for an entry already gone (below).
                FEEDBACK.labels("bad").inc()
                return orchestrator_pb2.FeedbackResponse(invalidated=n > 0)
            sem.verify(entry_id, True, deadline, on_call=gone.holding)
            FEEDBACK.labels("good").inc()
            return orchestrator_pb2.FeedbackResponse(verified=True)
        except grpc.FutureCancelledError:
            # Its deadline passed or its client went: said as such, not "client cancelled".
            raise rpc_ended(context) from None
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                # An entry this tenant was given, gone since (expired, evicted, invalidated): a
                # second "bad" is answered as done (the answer is not served either way); a
                # "good" cannot be kept. Named by the client's reference, as an unknown one is
                # (the tier's message named its own internal id).
                if request.rating == orchestrator_pb2.RATING_BAD:
                    FEEDBACK.labels("bad").inc()
                    return orchestrator_pb2.FeedbackResponse(invalidated=False)
                raise errors.NotFound(
                    f"semantic_entry_id: {errors.shown(request.semantic_entry_id)} unknown "
                    "(expired, evicted or invalidated)") from None
            why = _public_details(e, "the semantic tier")
            # The field named only for the tier's verdict on it: "semantic_entry_id: the
            # semantic tier is unavailable" blamed a reference that was fine.
            exc = errors.TierCacheError(why if e.code() in _TRANSPORT_CODES
                                        else f"semantic_entry_id: {why}")
            exc.code = _tier_status(e, deadline)
            raise exc from None

    def Stats(self, request, context):
        # Cluster-wide figures (every tenant's traffic, replica loads): operators only.
        tenant = self._tenant(context)  # UNAVAILABLE while loading, before tenants exist
        self.tenants.require_admin(tenant, "cluster stats")
        o = self.orch
        st = o.stats
        with st.lock:
            resp = orchestrator_pb2.StatsResponse(
                requests_total=sum(st.requests.values()),
                semantic_hits=st.requests["semantic_hit"], prefix_hits=st.requests["prefix_hit"],
                cold=st.requests["cold"], prompt_tokens_total=st.prompt_tokens,
                cached_tokens_total=st.cached_tokens,
                tokens_saved_semantic=st.semantic_tokens_saved,
                degradations=dict(st.degradations),
                semantic_hits_too_short=st.semantic_hits_too_short,
                semantic_hits_sampled=st.semantic_hits_sampled,
                semantic_hits_ignore_eos=st.semantic_hits_ignore_eos,
                # Its own, beside the replicas' (a replica on another id is out of routing):
                # the replicas' were shown and this one's was not.
                model_id=o.model_id, coalesced=st.requests["coalesced"])
        for r in o.replicas.replicas:
            if r.stats is not None and r.health.healthy:
                resp.replicas.append(r.stats)
            resp.dependencies.append(r.health.proto())
        deadline = _tiers_deadline(context)
        if o.semantic.enabled:
            try:
                # Half of what is left: the prefix index's figures get the rest.
                resp.semantic.CopyFrom(o.semantic.stats(
                    None if deadline is None
                    else time.monotonic() + (deadline - time.monotonic()) / 2))
            except (grpc.RpcError, errors.DeadlineExceeded):
                pass
            resp.dependencies.extend(o.semantic.dependencies())
        if o.prefix is not None:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                if left is None or left > 0:
                    resp.prefix.CopyFrom(o.prefix.stats(timeout=left))
            except grpc.RpcError:
                pass
            resp.dependencies.extend(o.prefix.dependencies())
        return resp

    def EraseTenant(self, request, context):
        # Every tenant's data is an operator's to erase, never another tenant's.
        caller = self._tenant(context)
        self.tenants.require_admin(caller, "a tenant's data", "erase")
        name = request.tenant
        if errors.blank(name):
            raise errors.InvalidArgument("tenant", "required (the tenant's name, as in the "
                                         "tokens file)")
        if len(name) > MAX_TENANT_CHARS:
            # No tenant has such a name (the tokens file allows no longer one), and checked
            # here, the shards and replicas are all called at once with none refusing it.
            raise errors.InvalidArgument("tenant", f"longer than {MAX_TENANT_CHARS} characters "
                                         "(no tenant has such a name)")
        # A name that prints as another (errors.name_problem) is no tenant's now, but an
        # earlier release took one: its data is erased by that name, never kept for its TTL.
        # Bounded as a Generate is: a client without a deadline (grpcurl's default) gave
        # time_remaining() of years, a timeout gRPC cut to nothing, and every call failed.
        # Time kept back to answer in, as Stats keeps: a replica that hung (stopped, not
        # gone) took the caller's whole time, and the caller got DEADLINE_EXCEEDED instead of
        # the counts and the not_reached line naming it.
        deadline = time.monotonic() + ERASE_TIMEOUT_S
        answer_by = _tiers_deadline(context)
        if answer_by is not None:
            deadline = min(deadline, answer_by)
        resp = self._erase_everywhere(name, deadline)
        # Its prompts' pieces kept for tokenizing (scoped by tenant name).
        self.orch.renderer.forget_scope(name)
        # A WARNING when a shard or replica was not reached: the erasure is not done, and an
        # INFO line was the only trace of the tenant's data left there. A name that prints as
        # another is escaped ('acme\u200b'): printed, it read as an erasure of "acme".
        log.log(logging.WARNING if resp.not_reached else logging.INFO,
                "erased tenant %s: %d semantic entries, %d KV blocks dropped, %d kept in use; "
                "not reached: %s", ascii(name) if errors.name_problem(name) else name,
                resp.semantic_entries_removed, resp.kv_blocks_dropped,
                resp.kv_blocks_in_use, "; ".join(resp.not_reached) or "none")
        return resp

    def _erase_everywhere(self, name: str, deadline: float
                          ) -> orchestrator_pb2.EraseTenantResponse:
        """The tenant `name`'s entries invalidated on every semantic shard and its KV blocks
        flushed on every replica, by `deadline` (time.monotonic()); what each removed, summed,
        and those not reached, named."""
        o = self.orch
        resp = orchestrator_pb2.EraseTenantResponse()

        # Every shard and replica at once: called one after another, one hung shard took the
        # whole budget and every shard and replica after it went unreached.
        shards = o.semantic.addresses if o.semantic.enabled else ()
        inval = semantic_pb2.InvalidateRequest(tenant=name)
        # The salt the tenant's requests carried: keyed by the hash key, from the name.
        flush = kvpool_pb2.KvFlushRequest(cache_salt=self.tenants.salt_for(name, self.tenants.key))
        md = call_metadata(o.internal_token)

        def left() -> float:
            # As each call starts: past ERASE_FANOUT of them, one that waited for a thread
            # behind hung ones, sent with the whole budget, ran past the caller's deadline.
            return max(0.01, deadline - time.monotonic())

        with ThreadPoolExecutor(max_workers=max(1, min(ERASE_FANOUT, len(shards) + len(
                o.replicas.replicas))), thread_name_prefix="erase") as pool:
            # Ended early only when the shard is found hung: a healthy one may take a minute.
            invalidated = [(a, pool.submit(lambda a=a: o.semantic.call_unless_hung(
                a, "Invalidate", inval, left()))) for a in shards]
            flushed = [(r, pool.submit(lambda r=r: _flush_unless_down(
                o.replicas, r, flush, md, left()))) for r in o.replicas.replicas]
        for a, call in invalidated:
            try:
                resp.semantic_entries_removed += call.result().removed
            except Exception as e:  # noqa: BLE001 - see _not_reached
                resp.not_reached.append(_not_reached(f"semantic shard {a}", e))
        for r, call in flushed:
            try:
                f = call.result()
            except _FoundDown:
                resp.not_reached.append(f"kvpool {r.public_id}: UNAVAILABLE: found hung by the "
                                        "orchestrator's replica polls (its Flush cancelled)")
                continue
            except Exception as e:  # noqa: BLE001 - see _not_reached
                resp.not_reached.append(_not_reached(f"kvpool {r.public_id}", e))
                continue
            resp.kv_blocks_dropped += f.blocks_dropped
            resp.kv_blocks_in_use += f.blocks_in_use
            if f.blocks_dropped and o.dispatched is not None:
                # What this orchestrator sent there moments ago of the tenant's: routed on, its
                # next request went "prefix" to a replica holding nothing of it ("cached 0,
                # index expected 48"). Only its own: the other tenants' blocks stay there.
                o.dispatched.forget(r.replica_id, flush.cache_salt)
        return resp


def _flush_unless_down(replicas, r, req, md, timeout: float):
    """KvPool.Flush `req` on replica `r`, cancelled (_FoundDown) once the poller declares `r`
    down (`_unless_down`). A live walk's EraseTenant with a replica SIGSTOPped answered after
    62 s, when gRPC's keepalive gave up (ERASE_TIMEOUT_S else), though the poller had found
    it hung within ~9 s, as a Warm's prefill there is cut."""
    downs = r.downs
    call = r.stub.Flush.future(req, timeout=timeout, metadata=md)
    return _unless_down(replicas, r, call, downs, "flush", lambda c: c.result())


def _not_reached(what: str, e: Exception) -> str:
    """EraseTenant's not_reached line for a shard or replica whose call raised `e`. Not only
    an RpcError: a stub's ValueError (its channel closed as the replica set changed) ended the
    whole call with UNKNOWN, the other calls' counts lost, their credit and the tenant's
    prompt pieces kept."""
    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        return f"{what}: {e.code().name}: {(e.details() or '')[:200]}"
    log.warning("EraseTenant: %s failed", what, exc_info=e)
    return f"{what}: failed ({type(e).__name__})"


# The most an EraseTenant takes, its calls to every shard and replica together (an Invalidate
# of a large tenant takes about a second per 100k entries).
ERASE_TIMEOUT_S = 120.0
# Shards or replicas an EraseTenant calls at once.
ERASE_FANOUT = 16

# What Stats keeps of its caller's time to answer in: this share of it, at most this long.
STATS_SLACK_SHARE = 0.2
STATS_SLACK_S = 0.25


def _call_deadline(context) -> float | None:
    """The RPC's deadline as a time.monotonic() instant; None when the client set none."""
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


def _tiers_deadline(context) -> float | None:
    """When the calls an answer waits on (Stats' tiers, EraseTenant's shards and replicas)
    must end, as a time.monotonic() instant: this much before the caller's deadline, which is
    its own and passes a little before ours. Given all of it, a prefix shard that never
    answered ran to the deadline, the answer came too late, and the caller got
    DEADLINE_EXCEEDED instead of every figure that had come in time. None when the client set
    no deadline."""
    deadline = _call_deadline(context)
    if deadline is not None:
        left = max(0.0, deadline - time.monotonic())
        deadline -= min(STATS_SLACK_S, STATS_SLACK_SHARE * left)
    return deadline


# A dependency's failures whose text is about the transport (addresses, connection errors):
# logged, not handed to tenants.
_TRANSPORT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def _public_details(e: grpc.RpcError, what: str) -> str:
    """A dependency's error as a tenant may see it: its own verdicts (a refused pin, an unknown
    entry) as they are; transport failures, whose text names internal addresses, only by
    code (the full text is logged)."""
    if e.code() in _TRANSPORT_CODES:
        log.warning("%s failed: %s: %s", what, e.code().name, e.details())
        return f"{what} {_TRANSPORT_WORDS[e.code()]}"
    return e.details() or e.code().name


def _tier_status(e: grpc.RpcError, deadline: float | None) -> str:
    """The status a call answers for its tier's failure `e`, given the caller's `deadline`
    (time.monotonic(); None: it set none): the tier's own, but for the tier's own timeout
    while the caller's time is not up, UNAVAILABLE (retry later). Passed on, a hung tier's
    DEADLINE_EXCEEDED told a caller that had set no deadline never to send it again
    (docs/clients.md: "the same deadline runs out again")."""
    if (e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            and (deadline is None or time.monotonic() < deadline)):
        return grpc.StatusCode.UNAVAILABLE.name
    return e.code().name


# How `_public_details` says each transport failure ("is unavailable (unavailable)" said the
# code twice; a deadline is not a dependency gone).
_TRANSPORT_WORDS = {grpc.StatusCode.UNAVAILABLE: "is unavailable",
                    grpc.StatusCode.DEADLINE_EXCEEDED: "did not answer in time",
                    grpc.StatusCode.INTERNAL: "failed (an internal error)",
                    grpc.StatusCode.UNKNOWN: "failed (an unknown error)"}


# Prompts (or top_k prefixes) one Warm call may ask for.
MAX_WARM_PROMPTS = 64
PREFILL_TIMEOUT_S = 120.0  # one prefill of the warm-up loop (a Warm call's: its deadline)
MAX_SESSION_ID_CHARS = 256
WARM_WINDOW = 4  # one Warm call's prefills queued or running at once (the pool has 8 threads)
# The background loop's wait is the interval times a random factor in 1 +- this (docs/deploy.md).
WARM_JITTER = 0.1


def _caching_off(replica) -> bool:
    """The replica's last Stats said prefix caching is off: a prefill there is refused every
    time, and each refusal would use one of the warm-up cycle's prefills."""
    stats = getattr(replica, "stats", None)
    return stats is not None and stats.prefix_caching_disabled


def _fair_share(hot: list, replicas: set[str], k: int) -> list:
    """Up to `k` of the hot prefixes (hottest first) that some replica lacks, taken in turn
    from each tenant (cache salt) in the order of its hottest: the cluster's k hottest were
    all one tenant's when it had the most prefix hits, and once they were held everywhere the
    warm-up warmed nothing for anyone."""
    by_salt: dict[str, list] = {}
    for hp in hot:
        if not replicas <= set(hp.holders):
            by_salt.setdefault(hp.cache_salt, []).append(hp)
    out: list = []
    queues = list(by_salt.values())
    while queues and len(out) < k:
        for q in queues:
            out.append(q.pop(0))
        queues = [q for q in queues if q]
    return out[:k]


GONE_POLL_S = 0.25  # how often a running Warm prefill checks whether its caller went away


class _Gone(threading.Event):
    """Set when a Warm's caller cancelled or went away; setting it also cancels the index
    probe under way (`holding`), which would otherwise run to the index's timeout."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._wakes: list[threading.Event] = []  # running prefills' waits (`wake_on_set`)

    def set(self) -> None:
        super().set()
        with self._lock:
            call, wakes = self._call, list(self._wakes)
        if call is not None:
            call.cancel()
        for wake in wakes:
            wake.set()

    def wake_on_set(self, wake: threading.Event) -> None:
        """Sets `wake` once this is set (at once if it is already)."""
        with self._lock:
            self._wakes.append(wake)
        if self.is_set():
            wake.set()

    def holding(self, call: grpc.Future | None) -> None:
        """`call` is the one under way now (None: it ended); cancelled at once if already
        set."""
        with self._lock:
            self._call = call
        if call is not None and self.is_set():
            call.cancel()


class _FoundDown(Exception):
    """A Warm's prefill (or an EraseTenant's Flush) cancelled as the poller declared its
    replica down."""


def _unless_gone(call, gone: _Gone):
    """`call`'s response (a unary gRPC future); grpc.FutureCancelledError when `gone` is set
    before it ends: the call is then cancelled, and the replica's handler cancels its work
    (and its time is not the replica's, in `timed`)."""
    done, wake = threading.Event(), threading.Event()
    call.add_done_callback(lambda _call: (done.set(), wake.set()))
    # Woken as the caller goes: polled alone, the cancel reached the replica up to
    # GONE_POLL_S late, and a prefill ending meanwhile pinned its blocks for the whole
    # TTL for a caller already gone.
    gone.wake_on_set(wake)
    while not (done.is_set() or gone.is_set()):
        wake.wait(GONE_POLL_S)
    if not done.is_set() and call.cancel():
        raise grpc.FutureCancelledError()
    return call.result()


def _unless_down(replicas, replica, call, downs_seen: int | None, kind: str,
                 result: Callable[[Any], Any]):
    """`result(call)` (`call`: a unary gRPC future on `replica`, a `kind` of call, see
    `ReplicaSet.watch`), the call cancelled as the poller declares `replica` down (at once if
    it has since `downs_seen`): _FoundDown then."""
    down = threading.Event()

    def on_down() -> None:
        down.set()
        call.cancel()

    replicas.watch(replica, on_down, downs_seen, kind)
    try:
        return result(call)
    except grpc.FutureCancelledError:
        if down.is_set():
            # Not the caller's cancellation: the replica's time, timed as a failure
            # (as Generate times a call the poller cut).
            raise _FoundDown() from None
        raise
    finally:
        replicas.unwatch(replica, on_down)


def _not_run(replica, index: int, error: str) -> orchestrator_pb2.WarmResult:
    """The result of a Warm's prefill on `replica` that did no work (prompt `index`, -1: a
    top-k prefix): `error`, its status name first."""
    return orchestrator_pb2.WarmResult(prompt_index=index, replica_id=replica.public_id,
                                       error=error)


def _unsent(replica, index: int, timeout: float,
            downs_seen: int | None) -> orchestrator_pb2.WarmResult | None:
    """The result of a Warm's prefill that must not be sent now (None: it may be)."""
    if timeout <= 0:
        # Queued behind the call's other prefills (prompts x replicas share the pool)
        # until its deadline: sending it anyway made replicas compute for a caller that
        # had its answer, and held the pool from other tenants' Warm calls.
        return _not_run(replica, index, "DEADLINE_EXCEEDED: the call's deadline passed "
                                         "before this prefill could start")
    if downs_seen is not None and replica.downs != downs_seen:
        # Declared down since the Warm chose it (queued behind the call's other prefills):
        # not sent, rather than sent and cancelled at once (nothing for a replica out of
        # routing to start, nor a call to time). One declared down between here and its
        # watch is cancelled there (`Warmer._prefill_watched`).
        return _not_run(replica, index, f"UNAVAILABLE: replica {replica.public_id} was found "
                                         "down before this prefill could start (not sent)")
    return None


class Warmer:
    """Prefills prompts on replicas (Warm RPC) and runs the low-traffic warm-up loop."""

    def __init__(self, orch: Orchestrator, cfg: OrchestratorConfig,
                 tenants: TenantRegistry | None = None) -> None:
        self.orch = orch
        self.cfg = cfg
        # The loop warms only these tenants' salts (None: every salt).
        self.tenants = tenants
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="warm")

    def _prefill(self, replica, token_ids, cache_salt, ttl, index,
                 timeout: float = PREFILL_TIMEOUT_S,
                 request_id: str = "", gone: _Gone | None = None,
                 downs_seen: int | None = None):
        """One Prefill on `replica`, pinned for `ttl` seconds (0: not pinned). With `gone` (the
        Warm caller cancelled or went away), a running prefill is cancelled once it is set:
        the replica stops computing and pins nothing more for nobody; so it is when the
        poller declares the replica down (UNAVAILABLE in its result) since `downs_seen`
        (`replica.downs` when the Warm chose it): declared so before it starts, it is not
        sent."""
        unsent = _unsent(replica, index, timeout, downs_seen)
        if unsent is not None:
            return unsent
        req = kvpool_pb2.PrefillRequest(token_ids=token_ids, cache_salt=cache_salt,
                                        pin=ttl > 0, ttl_seconds=ttl,
                                        model_id=self.orch.model_id)
        # What is left of the call's time, never more: raised to 0.1 s, a prefill sent with
        # less left ran (and pinned for the TTL) on the replica up to 0.1 s after its Warm's
        # caller was told DEADLINE_EXCEEDED.
        kw = dict(timeout=timeout,
                  metadata=call_metadata(self.orch.internal_token, request_id))
        try:
            try:
                r = timed("kvpool", "Prefill", replica.address,
                          (lambda: replica.stub.Prefill(req, **kw)) if gone is None else
                          lambda: self._prefill_watched(replica, req, kw, gone, downs_seen))
            except _FoundDown:
                return _not_run(replica, index, f"UNAVAILABLE: replica {replica.public_id} "
                                                 "was found down during this prefill "
                                                 "(cancelled)")
            except grpc.FutureCancelledError:
                return _not_run(replica, index, "CANCELLED: the caller went away; this "
                                                 "prefill's cancellation was sent to the "
                                                 "replica")
            return orchestrator_pb2.WarmResult(
                prompt_index=index, replica_id=r.replica_id or replica.public_id,
                prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                computed_tokens=r.computed_tokens, pinned_blocks=r.pinned_blocks)
        except grpc.RpcError as e:
            # A refused pin still computed and cached the prompt: its figures come as
            # trailers (zeros from any other failure), so the result says what was done.
            prompt, cached, computed = errors.prefill_work(e)
            if cut_short(e, timeout, PREFILL_TIMEOUT_S):
                # The Warm's own short deadline ran out: nothing said of the replica (a
                # WARNING per prefill named a healthy replica as failed).
                why = "the call's deadline passed during this prefill"
            else:
                why = _public_details(e, f"replica {replica.public_id}")
            return orchestrator_pb2.WarmResult(
                prompt_index=index, replica_id=replica.public_id, prompt_tokens=prompt,
                cached_tokens=cached, computed_tokens=computed, error=f"{e.code().name}: {why}")

    def _prefill_watched(self, replica, req, kw: dict, gone: _Gone, downs_seen: int):
        """A Warm call's Prefill, cancelled as its caller goes (`_unless_gone`) or as the
        poller declares the replica down (`_FoundDown` then): a Warm with one replica
        SIGSTOPped waited 60 s for it, long after the poller had taken it out of routing."""
        call = replica.stub.Prefill.future(req, **kw)
        return _unless_down(self.orch.replicas, replica, call, downs_seen, "prefill",
                            lambda c: _unless_gone(c, gone))

    def _targets(self, tenant, token_ids, target, deadline: float, gone: _Gone) -> list:
        """The replicas to prefill `token_ids` on, each as (replica, its `downs` when chosen):
        read before their health, as Generate reads them, so that one the poller declares
        down after this is not sent its prefill (a prefill queued behind the call's others
        went to it, and ran there until its next down declaration, a poll cycle later)."""
        downs = downs_by_address(self.orch.replicas.replicas)
        healthy = self.orch.replicas.healthy()
        if target == orchestrator_pb2.WARM_TARGET_OWNERS:
            # The caller's deadline bounds each owner lookup (and once it has passed, or the
            # caller is gone, the index is not asked): one lookup per prompt at the index's
            # whole timeout held a hung index's Warm far past its deadline.
            # A probe under way when the caller goes is cancelled (`_Gone`), not waited for.
            try:
                owner = self.orch.owner(tenant, token_ids,
                                        time.monotonic() if gone.is_set() else deadline,
                                        on_call=gone.holding)
            finally:
                gone.holding(None)
            healthy = [r for r in healthy if r.replica_id == owner]
        return [(r, downs[r.address]) for r in healthy]

    def warm(self, tenant, request, time_remaining: float | None = None,
             charge: Callable[[int], None] | None = None,
             gone: _Gone | None = None,
             afford: Callable[[int], int] | None = None) -> orchestrator_pb2.WarmResponse:
        """Prefill and pin the request's prompts (and/or the tenant's top_k hot prefixes) on
        their target replicas. `afford(n)` reserves the n prefills beyond the first from the
        tenant's rate limit first (raising if it cannot) and returns what it took, and
        `charge(k)` settles afterwards: k is the prefills beyond the first that computed
        something, less what was reserved (negative: given back). The call itself paid for
        one; the tenant's rate limit counts each prefill that computed something. Once `gone`
        is set (the caller cancelled), no further prefill is sent."""
        gone = gone or _Gone()  # a call without one: never set
        deadline = time.monotonic() + (120.0 if time_remaining is None
                                       else min(120.0, time_remaining))
        self._check_request(tenant, request)
        ttl = request.pin_ttl_seconds or self.cfg.warm_pin_ttl_s
        # Choosing owners asks the index once per prompt, one after another: together those
        # lookups get at most a quarter of the call's time (each a share of what is left of
        # it), so a hung index leaves the prefills most of it.
        owners_until = time.monotonic() + 0.25 * max(0.0, deadline - time.monotonic())
        jobs = []
        for i, p in enumerate(request.prompts):
            ids = self._prompt_ids(tenant, i, p)
            for r, downs in self._targets(tenant, ids, request.target, owners_until, gone):
                jobs.append((r, ids, tenant.cache_salt, ttl, i, downs))
        if request.top_k:
            for ids, salt in self._hot_prefixes(tenant, request.top_k):
                for r, downs in self._targets(tenant, ids, request.target, owners_until, gone):
                    # Holders too: a Warm always pins (ttl > 0), and on a holder the
                    # prefill computes nothing and pins. Skipped, a top_k Warm pinned nothing
                    # once the background loop had cached the hot prefixes everywhere.
                    jobs.append((r, ids, salt, ttl, -1, downs))
        self._check_jobs(request, jobs)
        reserved = afford(len(jobs) - 1) if afford is not None and jobs else 0
        return orchestrator_pb2.WarmResponse(
            results=self._prefill_all(jobs, deadline, gone, reserved, charge))

    def _check_request(self, tenant, request) -> None:
        """The Warm request's own fields, before any rendering or index lookup."""
        if not request.prompts and not request.top_k:
            raise errors.InvalidArgument("prompts", "give prompts or top_k")
        if len(request.prompts) > MAX_WARM_PROMPTS:
            raise errors.InvalidArgument("prompts", f"at most {MAX_WARM_PROMPTS} per call")
        if request.top_k > MAX_WARM_PROMPTS:
            raise errors.InvalidArgument("top_k", f"at most {MAX_WARM_PROMPTS}")
        if request.target not in orchestrator_pb2.WarmTarget.values():
            raise errors.InvalidArgument("target", f"unknown WarmTarget {request.target}")
        if request.pin_ttl_seconds > self.cfg.warm_pin_ttl_max_s:
            raise errors.InvalidArgument(
                "pin_ttl_seconds", f"{request.pin_ttl_seconds} s exceeds the limit of "
                f"{self.cfg.warm_pin_ttl_max_s} s")
        for i, p in enumerate(request.prompts):  # before any rendering, as Generate does
            if p.messages and p.prompt:
                # The prompt was dropped without a word (Generate refuses the pair): a caller
                # that set both meant one of them, and got the other warmed.
                raise errors.InvalidArgument(f"prompts[{i}].prompt",
                                             "give messages or prompt, not both")
            check_size(self.orch.renderer, self.cfg, tenant, f"prompts[{i}]",
                       [m.content for m in p.messages] if p.messages else [p.prompt])
        if request.top_k and self.orch.prefix is None:
            raise errors.FailedPrecondition(
                "top_k: no prefix index is configured to name the hot prefixes")

    def _prompt_ids(self, tenant, i: int, p) -> list:
        """Prompt `i`'s token ids, checked against every limit, cut to whole KV blocks."""
        # As Generate's `_prepare`: a prompt given (blank too) is the raw one, refused naming
        # prompts[i].prompt; neither given is refused naming prompts[i].messages. A blank
        # prompt was "prompts[i]: give messages or prompt", though it had given one.
        if p.prompt:
            ids = self.orch.renderer.render_raw(p.prompt, f"prompts[{i}].prompt",
                                                scope=tenant.name).token_ids
        else:
            ids = self.orch.renderer.render_warm([Message(m.role, m.content)
                                                  for m in p.messages], f"prompts[{i}]",
                                                 scope=tenant.name)
        if len(ids) > self.cfg.max_prompt_tokens:
            raise errors.InvalidArgument(
                f"prompts[{i}]", f"{len(ids)} tokens exceed the limit of "
                                 f"{self.cfg.max_prompt_tokens} (the orchestrator's "
                                 "max_prompt_tokens)")
        if len(ids) < self.cfg.block_size:
            # Only full KV blocks are cached and pinned: such a warm-up would report
            # success and leave nothing behind.
            raise errors.InvalidArgument(
                f"prompts[{i}]", f"{len(ids)} tokens, shorter than one KV block "
                                 f"({self.cfg.block_size}): nothing could be kept")
        check_prompt_tokens(tenant, len(ids), f"prompts[{i}]")  # as the tenant's requests
        context = self.orch.replicas.max_context()
        if context and len(ids) > context:
            # Every target replica refused it, one call each, naming its own field.
            raise errors.InvalidArgument(
                f"prompts[{i}]", f"{len(ids)} tokens exceed the model context ({context})")
        # Only whole KV blocks are kept: the tail past the last one was computed and
        # thrown away, and a refresh of a prompt already warm recomputed it every time
        # (reported as work, and charged to the tenant as work).
        return ids[:len(ids) // self.cfg.block_size * self.cfg.block_size]

    def _hot_prefixes(self, tenant, top_k: int) -> list[tuple[list, str]]:
        """The tenant's `top_k` hottest prefixes as the index names them: (token ids, salt)."""
        try:
            # This tenant's prefixes only (another tenant's salt is not ours to use): the
            # index filters, so k of them come back, not k of everyone's.
            hot = self.orch.prefix.top_prefixes(top_k, self.orch.model_id,
                                                cache_salt=tenant.cache_salt)
        except grpc.RpcError as e:
            raise errors.Unavailable(f"top_k: the prefix index is unavailable "
                                     f"({e.code().name})") from None
        mine = [hp for hp in hot if hp.cache_salt == tenant.cache_salt][:top_k]
        return [(list(hp.token_ids), hp.cache_salt) for hp in mine]

    def _check_jobs(self, request, jobs: list) -> None:
        """The prefills a Warm asks for: at most the per-call limit, and a replica to run them."""
        limit = self.cfg.warm_max_prefills_per_call
        if len(jobs) > limit:
            raise errors.InvalidArgument(
                "prompts" if request.prompts else "top_k",
                f"{len(jobs)} prefills (one per prompt or top-k prefix and target replica) "
                f"exceed the limit of {limit} per call: warm fewer prompts or a smaller top_k, "
                f"or target the owners")
        if not self.orch.replicas.healthy():  # after the checks of the request itself
            # Every replica on another model (mid-roll): said as Generate says it, naming both
            # model ids ("no healthy replica to warm" named none).
            raise errors.Unavailable(self.orch.replicas.misfits() or "no healthy replica to warm")

    def _prefill_all(self, jobs: list, deadline: float, gone: _Gone,
                     reserved: int, charge: Callable[[int], None] | None) -> list:
        """Each job's prefill (`_run_windowed`), then the tenant charged for the work done."""
        # The pool's threads do not inherit the call's request id: bound there for the logs,
        # and handed to each Prefill.
        rid = request_id_var.get()

        def prefill(job) -> orchestrator_pb2.WarmResult:
            if gone.is_set():  # nobody to tell: the replicas' work and pins would be wasted
                return _not_run(job[0], job[4], "CANCELLED: the caller went away before "
                                                 "this prefill started")
            with bound_request_id(rid):
                return self._prefill(*job[:5], timeout=deadline - time.monotonic(),
                                     request_id=rid, gone=gone, downs_seen=job[5])

        results: list = []
        try:
            results = self._run_windowed(prefill, jobs, deadline, gone)
        finally:
            if charge is not None:
                # A prefill whose pin was refused computed its prompt too. What `afford`
                # reserved and no prefill used (refreshes that computed nothing, failures, a
                # call that raised) is given back.
                worked = sum(1 for r in results if r.computed_tokens > 0)
                owed = max(0, worked - 1) - reserved
                if owed:
                    charge(owed)
        return results

    def _run_windowed(self, fn, jobs: list, deadline: float,
                      gone: threading.Event) -> list:
        """`fn` over `jobs` on the shared pool, results in order, with at most `WARM_WINDOW`
        of them queued or running at once: a call's next prefill queues behind what other
        calls already queued, so one big call does not hold every warm thread until it is
        done. Past `deadline`, or once `gone` is set, no job waits for a thread: `fn` answers
        those at once (a prefill's own timeout is what is left of the deadline)."""
        results: list = [None] * len(jobs)
        todo = iter(enumerate(jobs))
        running: dict = {}

        def over() -> bool:
            return gone.is_set() or time.monotonic() >= deadline

        def submit_next() -> None:
            for i, job in todo:
                if not over():
                    running[self._pool.submit(fn, job)] = i
                    return
                results[i] = fn(job)  # answered at once, no thread needed

        for _ in range(WARM_WINDOW):
            submit_next()
        while running:
            # Woken at least every 0.5 s to see whether the caller went away.
            done, _ = wait(running, timeout=min(0.5, max(0.0, deadline - time.monotonic())),
                           return_when=FIRST_COMPLETED)
            if not done and over():  # some still wait for a thread: they need not
                for f in [f for f in running if f.cancel()]:
                    i = running.pop(f)
                    results[i] = fn(jobs[i])
                # Started: each ends by its own timeout (the deadline), or is cancelled
                # within GONE_POLL_S once the caller is gone.
                done, _ = wait(running)
            for f in done:
                results[running.pop(f)] = f.result()
                submit_next()
        return results

    # ---- background loop ----
    def start(self) -> None:
        if (self.cfg.warm_interval_s > 0 and self.cfg.warm_top_k > 0
                and self.orch.prefix is not None):
            threading.Thread(target=self._loop, name="warm-loop", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def cluster_load(self) -> float:
        healthy = self.orch.replicas.healthy()
        if not healthy:
            return float("inf")
        return sum(r.load for r in healthy) / len(healthy)

    def cycle(self) -> int:
        """One warm-up pass; returns the number of prefills issued."""
        if self.cfg.warm_top_k <= 0:
            return 0
        if not self.orch.replicas.healthy():
            WARM_CYCLES.labels("no_replica").inc()
            return 0
        if self.cluster_load() > self.cfg.warm_max_load:
            WARM_CYCLES.labels("held_load").inc()
            return 0
        k = self.cfg.warm_top_k
        try:
            # More than k: the k hottest are often one tenant's, and already held everywhere.
            hot = self.orch.prefix.top_prefixes(min(1000, 4 * k), self.orch.model_id,
                                                min_hits=self.cfg.warm_min_hits)
        except grpc.RpcError:
            WARM_CYCLES.labels("index_unavailable").inc()
            return 0
        done = busy = 0
        # Replicas this cycle could warm: one with prefix caching off never holds a prefix,
        # and kept every prefix "lacking somewhere" while the cycle skipped it anyway.
        warmable = {r.replica_id for r in self.orch.replicas.healthy() if not _caching_off(r)}
        # Only the tenants the tokens file has now (and unsalted prefixes): a tenant removed
        # for erasure was warmed on, and a cycle that read the hot prefixes before an
        # EraseTenant computed the erased tenant's KV again on the replicas it reached after.
        hot = self._of_tenants_now(hot)
        for hp in _fair_share(hot, warmable, k):
            if done >= self.cfg.warm_max_prompts_per_cycle or self._stop.is_set():
                break
            for r in self.orch.replicas.healthy():
                if done >= self.cfg.warm_max_prompts_per_cycle or self._stop.is_set():
                    break
                if r.replica_id in hp.holders or _caching_off(r):
                    continue
                # Traffic may have come back since the cycle began (or a prefill of ours is
                # load itself): warm only idle replicas while the cluster stays quiet.
                if r.load > 0 or self.cluster_load() > self.cfg.warm_max_load:
                    busy += 1
                    continue
                if not self._of_tenants_now([hp]):  # removed during the cycle
                    break
                # Not pinned: pins count against the tenant's pin quota on the replica, and
                # the loop's filled it for warm_pin_ttl_s, refusing the tenant's own Warm
                # calls. Hot prefixes stay cached while they are used.
                res = self._prefill(r, list(hp.token_ids), hp.cache_salt, 0, -1)
                if not res.error:
                    WARM_PREFILLS.labels("ok").inc()
                    WARM_TOKENS.labels("computed").inc(res.computed_tokens)
                    WARM_TOKENS.labels("cached").inc(res.cached_tokens)
                    # A prefill that computed nothing found the prefix cached: another
                    # orchestrator's loop warmed it first (the index had not listed it yet).
                    # Not news: at INFO, every pod's duplicate said "0 tokens computed".
                    log.log(logging.INFO if res.computed_tokens else logging.DEBUG,
                            "warmed a %d-token prefix (%d hits) on %s: %d tokens computed",
                            res.prompt_tokens, hp.hits, r.replica_id, res.computed_tokens)
                else:
                    WARM_PREFILLS.labels("failed").inc()
                    if _WARM_FAILED_LINES.allow((r.replica_id, res.error.partition(":")[0])):
                        log.warning("warm-up prefill on %s failed: %s", r.replica_id,
                                    res.error)
                done += 1
        WARM_CYCLES.labels("ran" if done else "replicas_busy" if busy
                           else "nothing_to_warm").inc()
        return done

    def _of_tenants_now(self, hot: list) -> list:
        """The prefixes of `hot` under a salt of a tenant the tokens file has now, or none."""
        if self.tenants is None:
            return hot
        salts = self.tenants.cache_salts()
        return [hp for hp in hot if not hp.cache_salt or hp.cache_salt in salts]

    def _loop(self) -> None:
        # Each wait drawn within +-WARM_JITTER of the interval: pods started together kept
        # their cycles in step, each sending the same prefill in the same moment.
        while not self._stop.wait(self.cfg.warm_interval_s
                                  * random.uniform(1 - WARM_JITTER, 1 + WARM_JITTER)):
            try:
                self.cycle()
            except Exception:  # noqa: BLE001 - the loop must survive a bad cycle
                log.exception("warm-up cycle failed")
