"""One way to start any TierCache service.

    handle = create_server(service="prefix", address="127.0.0.1:0",
                           services=[(add_PrefixIndexServicer_to_server, servicer, FULL_NAME)])
    ...load heavy state...
    handle.set_serving()          # health flips from NOT_SERVING to SERVING
    run_until_signal(handle, grace=10)

Every server gets: the stock gRPC health service (NOT_SERVING until `set_serving`; with a
metrics port, the same status over HTTP at `/healthz` beside `/metrics`, and at `/readyz` with
the service's own readiness check, `ServerHandle.readiness`, on top), server reflection
(for grpcurl), an interceptor that binds the caller's `x-request-id` to the logs,
counts RPCs and latency in Prometheus, enforces the internal credential when one is configured,
and maps domain errors (`services.common.errors`) to status codes so that no traceback ever
reaches a client. SIGTERM/SIGINT -> health NOT_SERVING -> stop accepting -> drain -> exit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hmac
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import errors
from services.common.config import ConfigError
from services.common.logs import (
    Thinned,
    bound_request_id,
    package_version,
    plain_request_id,
    request_id_var,
)
from services.common.metrics import RPC_REFUSED_AT_CAP, RPC_SECONDS, RPC_TOTAL
from services.common.reaper import StreamReaper
from services.common.reflection import SourceInfoPool, source_info_pool
from services.common.wire import find_invalid_utf8

log = logging.getLogger(__name__)


_ERROR_LINES = Thinned(log)
# Calls refused while the service loads (errors.Starting): one line per method a minute, then
# how many more (the orchestrator, the launcher and probes poll every second meanwhile).
_STARTING_LINES = Thinned(log, per_window=1, window_s=60.0)
# Callers refused for their credential, one line per peer and code (thinned): only a counter
# said so, and token guessing could not be traced to a peer. The credential is never logged.
# Two-way streams refused for the open-stream caps too (`_refuse`, no credential needed).
_AUTH_LINES = Thinned(log, per_window=3, window_s=60.0, level=logging.WARNING)
# Responses refused for size: WARNINGs, so their count is one too (_ERROR_LINES counts INFO).
_TOO_LARGE_LINES = Thinned(log, level=logging.WARNING)


def _peer(context) -> str:
    """The caller's address as gRPC gives it ("ipv4:10.0.3.7:50412"), "?" when unknown."""
    try:
        return context.peer() or "?"
    except Exception:  # noqa: BLE001 - a context without a peer
        return "?"


def _refused_caller(context, method: str, code: str, why: str) -> None:
    peer = _peer(context)
    # Its first part says what the count of the rest counts: "ipv4:10.0.3.7/UNAUTHENTICATED:
    # 97 more lines left out" did not say they were callers refused.
    if _AUTH_LINES.allow(("callers refused", peer.rpartition(":")[0], code)):
        log.warning("%s refused %s from %s: %s", method, code, peer[:128], why[:200])


def _refuse(context, service: str, short: str, code: str, why: str, details: str,
            say: bool = True) -> None:
    """A call refused before its handler ran (its credential, the open-stream caps, a malformed
    request): counted under `code`, said in one line thinned per peer host (`_refused_caller`,
    when `say`; a malformed request says its own line, `_say_ended`), its request id (bound by
    the caller) in its trailers as every failed call's, then aborted with `details`."""
    RPC_TOTAL.labels(service, short, code).inc()
    if say:
        _refused_caller(context, short, code, why)
    context.set_trailing_metadata(_told_request_id())
    context.abort(_status_code(code), details)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# On the metrics port: 200 "SERVING" or 503 "NOT_SERVING", what gRPC health says. Kubernetes'
# liveness and readiness probes ask here: gRPC's own health service shares the server's call
# cap and worker threads, so a flood that filled them got the probes refused, and a pod that
# was only busy was taken out of its Service and then restarted, its streams lost.
HEALTH_PATH = "/healthz"
# Readiness (Kubernetes' readiness probe): health, and the service's own `readiness` check
# (ServerHandle). Liveness stays HEALTH_PATH: a pod whose dependencies are down is not to be
# restarted for it, only kept out of its Service (and a rolling update held back).
READY_PATH = "/readyz"
METRICS_PATH = "/metrics"
_REFLECTION_METHODS = "/grpc.reflection."
_OPEN_METHODS = ("/grpc.health.v1.Health/", _REFLECTION_METHODS)
# Open two-way streams (server reflection) one server serves at once: each holds a worker
# thread while open, and needs no credential.
MAX_OPEN_STREAMS = 4
# Of them, one peer host may hold at most this many, each for at most OPEN_STREAM_MAX_S: one
# client with no credential held all 4 idle (for good on the internal services, which close
# no connection), and the operator's `grpcurl list` was refused. A tool's session lasts
# well under a second.
MAX_OPEN_STREAMS_PER_PEER = 2
OPEN_STREAM_MAX_S = 60.0
# How long a stream over either cap waits for a slot before it is refused. A client sees its
# last stream's answer before the server's handler has given that stream's slot back, and the
# stock reflection client (a stream a request) was refused now and then for a slot that came
# back a moment later; a stream held open still gets its refusal within this.
OPEN_SLOT_GRACE_S = 0.5
# A waiting stream holds a worker thread too: one peer host waits with one stream at a time,
# the server with at most this many (the stock client asks one at a time); any other over the
# caps is refused at once. Unbounded, a client with no credential opening streams faster than
# the grace ran out held every worker thread of the server, in waits.
MAX_WAITING_STREAMS = MAX_OPEN_STREAMS
_OPEN_REAPER = StreamReaper()
# Longest service name Health.Watch accepts (the names served are a few dozen characters).
MAX_HEALTH_NAME = 256


class _StatusSender:
    """One Watch stream's send callback, with its own lock: gRPC allows one message send at a
    time on a call, and a Watch's first message and a `set` broadcast could overlap (sending
    both under the servicer's lock deadlocked the server; sending both at once crashed gRPC's
    polling thread). The lock is never taken for the end of the stream (`None`, sent by close
    callbacks on that polling thread, which an ongoing send waits on), which gRPC allows
    alongside a send.

    Each call sends the status as it is *now* (`current()`, read under this sender's lock),
    not the one its caller read: a Watch starting while the status flipped twice otherwise
    sent SERVING last although NOT_SERVING was current (the second flip's message had been
    deduplicated against the Watch's own first one). A status equal to the last one sent
    is not sent again."""

    __slots__ = ("_send", "_lock", "_last", "_current")

    def __init__(self, send, current) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._last = None
        self._current = current

    def __call__(self, response) -> None:
        """`response`: None ends the stream; anything else says "send the status now"."""
        if response is None:
            self._send(None)
            return
        with self._lock:
            status = self._current()
            if status != self._last:
                self._send(health_pb2.HealthCheckResponse(status=status))
                self._last = status


def _told_request_id() -> tuple[tuple[str, str], ...]:
    """The failed call's request id (bound by the interceptor) as a trailer: a caller that
    sent none (grpcurl), or one the server replaced, had no way to learn the id its error's
    log line carries (only a Generate that finished says it, in GenerateFinal)."""
    rid = request_id_var.get()
    return (("x-request-id", rid),) if rid else ()


def _send_request_id(context, rid: str) -> None:
    """The call's request id told to its caller at once, in the response headers, before
    its request is parsed: a call its client ends (a cancel, its deadline) gets no trailers,
    and one that sent no id (grpcurl, a client in another language) had none to quote. Every
    method's, in `_Call.prologue` where all pass, on a server asked to (`request_id_headers`:
    the orchestrator's). A refused call has it in its trailers alone (ended at once, it gets
    them); one its client ended already has no one to tell, and runs on as it did."""
    with contextlib.suppress(grpc.RpcError):
        context.send_initial_metadata((("x-request-id", rid),))


class _HealthServicer(health.HealthServicer):
    """gRPC's health servicer, minus what anyone who can connect could do to it:

    - a Watch of a never-registered name kept an entry per name after the stream ended, and
      names had no length limit (200 watches of 1 MB names held 200 MiB);
    - a Watch that ended before its close callback was added (cancelled right after its first
      message, a short deadline) was never removed: ~2.8 KB for good per such call;
    - Watch and `set` sent responses while holding the servicer's lock, and sending waits on
      gRPC's polling thread, which runs the close callbacks that take that lock: one Watch
      cancelled while another started deadlocked the two, and with the polling thread stuck
      the whole server stopped answering (about 2,500 Watch + cancel calls froze it). Sends
      now happen outside the lock, one at a time per stream (`_StatusSender`).
    """

    def Check(self, request, context):  # noqa: N802
        with self._lock:
            status = self._server_status.get(request.service)
            names = sorted(self._server_status)
        if status is None:
            # The library's NOT_FOUND had no message (grpcurl printed an empty "Message:"):
            # the name refused, and those this server answers for ("" = the whole server).
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"service: unknown name {errors.shown(request.service)}; this "
                          f"server knows {', '.join(map(repr, names)) or 'none'}")
        return health_pb2.HealthCheckResponse(status=status)

    def List(self, request, context):  # noqa: N802
        """Every name and its status: the library left it UNIMPLEMENTED ("Method not
        implemented!") while reflection advertised it."""
        with self._lock:
            statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in statuses.items()})

    def Watch(self, request, context, send_response_callback=None):  # noqa: N802
        if len(request.service) > MAX_HEALTH_NAME:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"service: longer than {MAX_HEALTH_NAME} characters")
        blocking_watcher = None
        if send_response_callback is None:  # a server without non-blocking streams
            blocking_watcher = health._Watcher()
            send_response_callback = health._watcher_to_send_response_callback_adapter(
                blocking_watcher)
        service = request.service
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

        def current() -> int:
            with self._lock:
                return self._server_status.get(service, unknown)

        send_response_callback = _StatusSender(send_response_callback, current)
        with self._lock:
            self._send_response_callbacks.setdefault(service, set()).add(send_response_callback)
        # The status now; a `set` from here on sends to this stream too (registered above),
        # and each send reads the status as it is then.
        send_response_callback(True)
        close = self._on_close_callback(send_response_callback, service)
        on_rpc_end(context, close)  # ended already, at once: nothing else would remove it
        return blocking_watcher

    def set(self, service, status):
        """The library's `set`, sending to the watchers after releasing the lock."""
        with self._lock:
            if self._gracefully_shutting_down:
                return
            self._server_status[service] = status
            watchers = list(self._send_response_callbacks.get(service, ()))
        for send in watchers:
            send(health_pb2.HealthCheckResponse(status=status))

    def close_watches(self) -> None:
        """End every open Watch stream (each got NOT_SERVING first): the server counts them
        as RPCs in flight, so one open Watch held every shutdown for its whole grace."""
        with self._lock:
            callbacks = [cb for cbs in self._send_response_callbacks.values() for cb in cbs]
            self._send_response_callbacks.clear()
        for cb in callbacks:
            cb(None)

    def _on_close_callback(self, send_response_callback, service):
        def callback():
            with self._lock:
                watchers = self._send_response_callbacks.get(service)
                if watchers is not None:
                    watchers.discard(send_response_callback)
                    if not watchers:
                        del self._send_response_callbacks[service]
            send_response_callback(None)

        return callback


# Clients ping an idle connection this often (a dead peer is found without traffic).
KEEPALIVE_MS = 20_000


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """channel_options, plus what a server needs to accept our clients' keepalive pings: by
    default gRPC servers take pings without data at most every 5 minutes, and answered our
    20 s pings on idle connections with GOAWAY "too_many_pings" (connections dropped). gRPC
    1.85 knows the setting as min_ping_interval_without_data_ms (the documented
    min_recv_ping_interval_without_data_ms is not in its library, and alone still drew the
    GOAWAY, measured)."""
    return [*channel_options(max_message_bytes),
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
            ("grpc.so_reuseport", 0)]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for servers and channels alike."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC's default reconnect backoff grows to 120 s: a restarted replica (or index) would
        # stay unreachable through its channel that long after it is back.
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]


# Longest status message sent: gRPC refuses a status over 16 KiB of metadata, and the client
# then gets RESOURCE_EXHAUSTED naming no field. Messages repeat client values cut short
# (errors.shown); this is the backstop for any that does not.
MAX_DETAILS_CHARS = 2048
# ... and at most this many bytes as gRPC sends it (percent-encoded: 3 bytes for each UTF-8
# byte outside printable ASCII, and for "%"): 2,048 emoji were 24 KiB of trailers, past gRPC's
# hard limit (16 KiB; between 8 and 16 it refuses some at random), and the client got
# RESOURCE_EXHAUSTED "Stream removed" instead. 6 KiB leaves room for the other trailers.
MAX_DETAILS_WIRE_BYTES = 6144


def _wire_bytes(c: str) -> int:
    return 1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode("utf-8", "replace"))


def _capped(details: str) -> str:
    if len(details) <= MAX_DETAILS_CHARS and \
            sum(map(_wire_bytes, details)) <= MAX_DETAILS_WIRE_BYTES:
        return details
    keep = size = 0
    for c in details[:MAX_DETAILS_CHARS]:
        size += _wire_bytes(c)
        if size > MAX_DETAILS_WIRE_BYTES - 64:  # room for what says how much was cut
            break
        keep += 1
    return f"{details[:keep]}... ({len(details) - keep} characters cut)"


def _status_code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


def _parse_request(deserialize, raw, context, service: str, short: str):
    """The request parsed by us, so that a malformed one is INVALID_ARGUMENT naming the field,
    not the INTERNAL status gRPC gives a failing deserializer; said as a handler's
    INVALID_ARGUMENT is (one thinned line, the id trailer: it had neither), the call's
    request id bound by the caller."""
    if deserialize is None:
        return raw
    try:
        return deserialize(raw)
    except Exception:  # noqa: BLE001 - any parse failure is the client's input
        cls = getattr(deserialize, "__self__", None)
        where = find_invalid_utf8(cls.DESCRIPTOR, raw) if cls is not None else None
        details = (f"{where}: invalid UTF-8 in a string field" if where
                   else "request: malformed protobuf message")
        _say_ended(service, short, "INVALID_ARGUMENT", details)
        _refuse(context, service, short, "INVALID_ARGUMENT", details, details, say=False)


def _say_ended(service: str, short: str, code: str, details: str,
               lines: Thinned | None = None, why: tuple[str, ...] = ()) -> None:
    """One INFO line for a call that ended `code` (its `details` cut to 300 characters), under
    the request id the caller bound; thinned by `lines` (default `_ERROR_LINES`) per service,
    method, code (and `why`)."""
    if (lines or _ERROR_LINES).allow((service, short, code, *why)):
        log.info("%s ended %s: %s", short, code, details[:300])


def _counted_code(context, code: str) -> str:
    """`code` while the call is still open; once it ended under its handler (its deadline
    passed, its client cancelled, the server's stop cut it), the status its client got
    instead (`rpc_ended`): a unary call whose handler returned after the client's deadline
    was counted OK while the client saw DEADLINE_EXCEEDED. A call the server ended itself
    (`reaper.end_call`) may still read as active for a moment: an idle reflection stream,
    reaped, saw its requests end and returned, and was counted OK."""
    return rpc_ended(context).code if _call_ended(context) else code


def _call_ended(context) -> bool:
    """Whether the call ended under its handler (see `_counted_code`)."""
    if getattr(context, "tiercache_ended_with", None) is not None:
        return True
    is_active = getattr(context, "is_active", None)
    return is_active is not None and not is_active()


def _finished_code(context) -> str:
    """The status of a call whose handler returned: OK, or the code the handler set on the
    way, which gRPC sends (health's Check of an unknown name sets NOT_FOUND and returns: it
    was counted OK), or what ended the call under the handler (`_counted_code`)."""
    set_code = context.code() if hasattr(context, "code") else None
    code = set_code.name if isinstance(set_code, grpc.StatusCode) else "OK"
    return _counted_code(context, code)


def _bound_items(start: Callable[[], Any], rid: str, encode: Callable[[Any], Any]) -> Iterator:
    """The messages of `start()` (a streaming handler's) as `encode` gives them, with the
    request id bound around each step of the handler's own code and each message's `encode`
    (a stream's response refused for its size was logged under no id); when the client went away
    (or `encode` refused a message), the handler's generator is closed under the id too (its
    cleanup logs as that request, not under none)."""
    it = None
    try:
        with bound_request_id(rid):
            it = iter(start())
        while True:
            try:
                with bound_request_id(rid):
                    data = encode(next(it))  # a refusal for its size logs under the id
            except StopIteration:
                return
            yield data
    except BaseException:
        close = getattr(it, "close", None)
        if close:
            with bound_request_id(rid):
                close()
        raise


# What gRPC says (and its client sees) when a message is over the server's send limit.
_SENT_TOO_LARGE = "SERVER: Sent message larger than max ({} vs. {})"


def _too_large(context, service: str, short: str, size: int, limit: int) -> None:
    """Refuse a response over the server's send limit (`max_message_bytes`) as gRPC does,
    RESOURCE_EXHAUSTED with its words, but before gRPC sees it: gRPC refused it after the
    handler had returned, and the call was counted OK (a stream's: CANCELLED)."""
    if _TOO_LARGE_LINES.allow((service, short)):
        log.warning("%s: a response of %d bytes is over the server's limit of %d (refused "
                    "RESOURCE_EXHAUSTED)", short, size, limit)
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _SENT_TOO_LARGE.format(size, limit))


def _encoded(message, serialize, limit: int, context, service: str, short: str):
    """A response serialized here (gRPC is given bytes), checked against the send limit
    (`_too_large`): every kind of method's, a stream's for each message."""
    data = message if serialize is None else serialize(message)
    if len(data) > limit >= 0:
        _too_large(context, service, short, len(data), limit)
    return data


def _encoder(serialize, limit: int, context, service: str, short: str) -> Callable[[Any], Any]:
    """`_encoded` for each message of one call's stream."""
    return lambda message: _encoded(message, serialize, limit, context, service, short)


def _cut_under(requests) -> bool:
    """Whether a call that has ended (see `_count_at_end`) was cut by gRPC rather than ended
    by the status its handler gave: gRPC's request iterator raises RpcError for a call whose
    end was a cancel (its client's, a request over the size limit, the deadline, the stop),
    and ends (StopIteration) for one that ended with the server's status."""
    try:
        next(requests)
    except grpc.RpcError:
        return True
    except Exception:  # noqa: BLE001 - StopIteration: ended by the server's status
        return False
    return False


def _count_at_end(context, requests, service: str, short: str, code: str) -> None:
    """Count a client-streaming or two-way call, whose handler finished while the call was
    still open, under `code` once the call has ended, unless gRPC cut it meanwhile: gRPC's
    server hands a handler "no more requests" also when the call was cut while it waited for
    one (a request over `max_message_bytes`, its client's cancel), and learns of the cut a
    moment later. Such calls were counted OK while the client got RESOURCE_EXHAUSTED or
    CANCELLED. The count comes when the call has ended (gRPC's `add_callback`)."""
    def count() -> None:
        RPC_TOTAL.labels(service, short,
                         rpc_ended(context).code if _cut_under(requests) else code).inc()

    add = getattr(context, "add_callback", None)
    if add is None or not add(count):  # ended already: its state is final
        count()


def _parsed_non_blocking(handler, service: str, short: str, prologue):
    """`handler` (a non-blocking unary-stream method), parsing its request itself: malformed
    bytes are INVALID_ARGUMENT, as for every other method. `prologue(context)` runs first (the
    credential check). Counted and timed when the call ends (Health.Watch was neither): OK when
    the server ended it (`None` sent while the call was open), else as `rpc_ended` says."""
    behavior, deserialize = handler.unary_stream, handler.request_deserializer

    def parsed(raw, context, send_response_callback=None):
        with bound_request_id(prologue(context)):
            request = _parse_request(deserialize, raw, context, service, short)
        t0, ended_here = time.perf_counter(), []
        send = send_response_callback
        if send_response_callback is not None:
            def send(response) -> None:
                if response is None and not ended_here and context.is_active():
                    ended_here.append(True)
                send_response_callback(response)

        def count(code: str | None = None) -> None:
            if code is None:
                code = "OK" if ended_here else rpc_ended(context).code
            RPC_TOTAL.labels(service, short, code).inc()
            RPC_SECONDS.labels(service, short).observe(time.perf_counter() - t0)

        try:
            result = behavior(request, context, send)
        except BaseException:
            set_code = context.code()  # an abort's (a name too long); else gRPC's UNKNOWN
            count(set_code.name if isinstance(set_code, grpc.StatusCode) else "UNKNOWN")
            raise
        on_rpc_end(context, count)
        return result

    parsed.experimental_non_blocking = True
    return grpc.unary_stream_rpc_method_handler(
        parsed, request_deserializer=None, response_serializer=handler.response_serializer)


class _Call:
    """One call as `_ServerInterceptor` wraps it: the caller's credential and request id
    checked first and the id sent in the response headers (`prologue`), the call counted
    (`count`), what its handler raised mapped to a status (`fail`), and the wrappers of unary
    and server-streaming handlers. Built for each call (`intercept_service` runs per call): it
    holds that call's metadata, credential included, so one kept per method would check every
    later call against the first's."""

    def __init__(self, interceptor: _ServerInterceptor, method: str, short: str, handler,
                 pairs) -> None:
        self.interceptor, self.method = interceptor, method
        self.service, self.short = interceptor.service, short
        self.pairs, self.metadata = pairs, dict(pairs)
        open_method = method.startswith(_OPEN_METHODS)
        self.need_auth = bool(interceptor.internal_token) and not open_method
        self.authenticate = None if open_method else interceptor.authenticate
        # Reflection is tooling's: grpcurl opens a stream before each call, with the call's
        # headers, so a bad id was said twice, the reflection's line telling nothing the
        # call's does not. Still replaced (its trailers carry the new id), without a line.
        self.say_replaced = not method.startswith(_REFLECTION_METHODS)
        # Two credentials: which one counts would depend on who reads them (a proxy the
        # first, `dict` here the last); none is taken.
        self.twice = self.need_auth and sum(k == "authorization" for k, _ in pairs) > 1
        self.token = interceptor.internal_token or ""
        self.deserialize = handler.request_deserializer
        self.serialize, self.limit = handler.response_serializer, interceptor.max_send

    def prologue(self, context) -> str:
        """The caller's credential, checked before its request is parsed: a request
        without one (up to the message size limit) cost nothing but its transfer. A refusal
        has the call's request id, as every failed call has (its line, its trailers): it had
        none, and the id a client printed after 'unknown token' was in no log line."""
        with contextlib.suppress(AttributeError):
            context.tiercache_server = self.interceptor  # for `rpc_ended`
        given = self.metadata.get("x-request-id", "")
        rid = plain_request_id(given)
        with bound_request_id(rid):
            if self.need_auth:
                self._check_token(context)
            if self.authenticate is not None:
                self._check_caller(context)
        # Said once the caller is known: an unknown one's bad ids would use up the lines
        # (thinned per method) of those the callers with a credential sent.
        self._say_replaced(given, rid)
        if self.interceptor.request_id_headers:
            _send_request_id(context, rid)
        return rid

    def _check_token(self, context) -> None:
        got = "" if self.twice else self.metadata.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            _refuse(context, self.service, self.short, "UNAUTHENTICATED",
                    "missing or wrong internal credential",
                    "authorization: missing or wrong internal credential")

    def _check_caller(self, context) -> None:
        try:
            self.authenticate(self.pairs)
        except errors.TierCacheError as exc:
            _refuse(context, self.service, self.short, exc.code, str(exc), _capped(str(exc)),
                    say=exc.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"))

    def _say_replaced(self, given: str, rid: str) -> None:
        if self.say_replaced and given and rid != given and \
                _ERROR_LINES.allow((self.service, self.short, "x-request-id")):
            # Replaced without a word, the caller's id (a ticket quotes it) matched no
            # line, and a refused call never told its caller the new one.
            with bound_request_id(rid):
                log.info("%s: x-request-id %s replaced by %s (not 1-128 characters of "
                         "A-Z a-z 0-9 . _ : -)", self.short, errors.shown(given), rid)

    def count(self, context, code: str, requests) -> None:
        """`code` counted now; for a call whose handler read a request stream
        (`requests`) and that is still open, once the call has ended (`_count_at_end`)."""
        if requests is not None and not _call_ended(context):
            _count_at_end(context, requests, self.service, self.short, code)
        else:
            RPC_TOTAL.labels(self.service, self.short, code).inc()

    def fail(self, context, exc: BaseException, requests=None) -> None:
        """`exc` (what the handler raised) mapped to a status and counted under it;
        `requests`: the call's request stream, when its handler read one."""
        if isinstance(exc, grpc.RpcError) and _call_ended(context):
            # gRPC's request iterator saying the call ended under the handler (its client
            # cancelled, its deadline passed): no failure of the handler. Logged as one,
            # every reflection stream its client cancelled left an ERROR and a traceback.
            RPC_TOTAL.labels(self.service, self.short, rpc_ended(context).code).inc()
            raise exc
        if isinstance(exc, errors.TierCacheError):
            self._fail_domain(context, exc, requests)
        context.set_trailing_metadata(_told_request_id())
        code = context.code() if hasattr(context, "code") else None
        if code not in (None, grpc.StatusCode.OK):
            self._abort_again(context, code, requests)
        log.exception("unhandled error in %s", self.method)
        self.count(context, _counted_code(context, "INTERNAL"), requests)
        context.abort(grpc.StatusCode.INTERNAL,
                      f"internal error in {self.short}; see server logs")

    def _fail_domain(self, context, exc: errors.TierCacheError, requests) -> None:
        # The status its client got, counted and logged alike: a handler giving up on a
        # caller that cancelled (semantic's "caller is gone", DeadlineExceeded) was
        # counted CANCELLED but logged "ended DEADLINE_EXCEEDED".
        ended = _counted_code(context, exc.code)
        self.count(context, ended, requests)
        details = _capped(str(exc))
        # A refused or failed call left no line: a ticket quoting its request id could
        # not be traced. One line, with the id bound; a flood of them is thinned.
        lines = (_STARTING_LINES if isinstance(exc, errors.Starting) and ended ==
                 exc.code else _ERROR_LINES)
        _say_ended(self.service, self.short, ended, details, lines)
        trailers = exc.trailers + (((errors.OVERLOADED_KEY, "1"),)
                                   if isinstance(exc, errors.Overloaded) else ())
        context.set_trailing_metadata(trailers + _told_request_id())
        context.abort(_status_code(exc.code), details)

    def _abort_again(self, context, code: grpc.StatusCode, requests) -> None:
        # The handler already aborted, or set a code and then raised. Abort again
        # with that code and the handler's own details: left to gRPC, a code set
        # without details would go out with the exception's text as its message.
        self.count(context, _counted_code(context, code.name), requests)
        details = context.details() if hasattr(context, "details") else None
        if isinstance(details, bytes):
            details = details.decode("utf-8", "replace")
        context.abort(code, _capped(details or f"{self.short} failed: {code.name}"))

    def parse(self, raw, context):
        return _parse_request(self.deserialize, raw, context, self.service, self.short)

    def unary_behavior(self, inner, parsed: bool = False):
        """`parsed`: gRPC parses the requests (a client stream's, read by the handler).
        The response is serialized here, to check it against the send limit."""
        def wrapped(raw, context):
            with self.interceptor.running():
                return self._unary_call(inner, parsed, raw, context)

        return wrapped

    def _unary_call(self, inner, parsed: bool, raw, context):
        rid = self.prologue(context)
        requests = raw if parsed else None  # a client stream's, for `count` and `fail`
        with bound_request_id(rid):
            request = raw if parsed else self.parse(raw, context)
            t0 = time.perf_counter()
            try:
                resp = inner(request, context)
                data = _encoded(resp, self.serialize, self.limit, context, self.service,
                                self.short)
                self.count(context, _finished_code(context), requests)
                return data
            except BaseException as exc:  # noqa: BLE001 - mapped to a status
                self.fail(context, exc, requests)
            finally:
                RPC_SECONDS.labels(self.service, self.short).observe(time.perf_counter() - t0)

    def stream_behavior(self, inner):
        def wrapped(raw, context) -> Iterator:
            with self.interceptor.running():
                yield from self._stream_call(inner, raw, context)

        return wrapped

    def _stream_call(self, inner, raw, context) -> Iterator:
        rid = self.prologue(context)
        with bound_request_id(rid):
            request = self.parse(raw, context)
        t0 = time.perf_counter()
        try:
            yield from _bound_items(lambda: inner(request, context), rid,
                                    _encoder(self.serialize, self.limit, context, self.service,
                                             self.short))
            RPC_TOTAL.labels(self.service, self.short, _finished_code(context)).inc()
        except GeneratorExit:
            # Client went away (or its deadline passed); `_bound_items` closed the
            # inner generator, running its cleanup.
            self._caller_left(context, rid)
            raise
        except BaseException as exc:  # noqa: BLE001
            # Bound again: the id was reset when next() raised, and an unexpected
            # error's traceback must carry the id the client was told to look for.
            with bound_request_id(rid):
                self.fail(context, exc)
        finally:
            RPC_SECONDS.labels(self.service, self.short).observe(time.perf_counter() - t0)

    def _caller_left(self, context, rid: str | None) -> None:
        ended = rpc_ended(context)
        RPC_TOTAL.labels(self.service, self.short, ended.code).inc()
        # Logged as any other status is (one line, the id bound, thinned): a
        # replica's Generate its orchestrator cancelled (the client's cancel or
        # deadline) left no line, so a ticket's id never named the replica.
        # Thinned apart from the handlers' own errors of the same code (a flood of
        # cancels hid none of them).
        with bound_request_id(rid):
            _say_ended(self.service, self.short, ended.code, str(ended), why=("caller left",))


class _ServerInterceptor(grpc.ServerInterceptor):
    """Request id, metrics, internal auth and domain-error mapping around every handler."""

    def __init__(self, service: str, internal_token: str | None,
                 authenticate: Callable[[Sequence[tuple[str, str]]], object] | None = None,
                 max_send: int = DEFAULT_MAX_MESSAGE_BYTES,
                 request_id_headers: bool = False) -> None:
        self.service = service
        self.request_id_headers = request_id_headers  # `_send_request_id` in every call
        self.max_send = max_send  # the server's gRPC send limit (max_message_bytes)
        self.internal_token = internal_token
        self.authenticate = authenticate
        self._open_streams = threading.BoundedSemaphore(MAX_OPEN_STREAMS)
        self._open_by_peer: dict[str, int] = {}
        self._open_freed = threading.Condition()  # guards both; notified as one frees
        self._open_waiting: set[str] = set()  # the peers with a stream waiting for a slot
        # When this server's stop cuts the calls still running (monotonic; None = running).
        self.cut_at: float | None = None
        # The server's own state (grpcio's private `_state`, pinned version), for `_past_cap`.
        self.server_state: Any = None
        # Calls whose handler is running (Health.Watch, which holds no thread, aside): what a
        # drain waits for, said in its log lines.
        self.in_flight = 0
        self._in_flight_lock = threading.Lock()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._in_flight_lock:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._in_flight_lock:
                self.in_flight -= 1

    def _past_cap(self) -> bool:
        """Whether gRPC refuses the call being intercepted for its concurrent-call cap right
        after this (RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!", before any handler
        runs). gRPC asks the interceptor under its state lock, between reading the count and
        refusing, so the same test here is its verdict."""
        st = self.server_state
        cap = getattr(st, "maximum_concurrent_rpcs", None)
        return cap is not None and getattr(st, "active_rpc_count", 0) >= cap

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        short = method.rsplit("/", 1)[-1]
        if self._past_cap():
            # Refused by gRPC before any handler: counted here or nowhere (a flood refused
            # at the cap left tiercache_rpc_total flat, and an error-ratio alert silent).
            RPC_TOTAL.labels(self.service, short, "RESOURCE_EXHAUSTED").inc()
            # And on their own: in tiercache_rpc_total they read as any other
            # RESOURCE_EXHAUSTED (a tenant over its limit), which no capacity alert pages for.
            RPC_REFUSED_AT_CAP.labels(self.service, short).inc()
            return handler
        call = _Call(self, method, short, handler,
                     tuple(handler_call_details.invocation_metadata or ()))
        if getattr(handler.unary_stream, "experimental_non_blocking", False):
            # Health.Watch answers through callbacks and holds no thread; wrapped like the
            # others, it would fall back to a blocking generator that holds one per open watch
            # (32 of them, with no credential, stalled a 32-thread server). Only its request
            # is parsed here: gRPC's own deserializer answered malformed bytes with INTERNAL.
            return _parsed_non_blocking(handler, call.service, call.short, call.prologue)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                call.unary_behavior(handler.unary_unary),
                request_deserializer=None, response_serializer=None)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                call.stream_behavior(handler.unary_stream),
                request_deserializer=None, response_serializer=None)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                self._limited(handler.stream_stream, call.short, call.prologue, call.fail,
                              call.count, call.serialize),
                request_deserializer=handler.request_deserializer, response_serializer=None)
        if handler.stream_unary:
            # None is served today; one added later is not open to callers without the
            # credential (only the kinds above were checked, and a client-streaming method
            # answered anyone), and is counted, timed and mapped like a unary one (it was
            # none of them: a domain error reached its client as UNKNOWN "Exception calling
            # application: <its text>", any other exception's text too).
            return grpc.stream_unary_rpc_method_handler(
                call.unary_behavior(handler.stream_unary, parsed=True),
                request_deserializer=handler.request_deserializer, response_serializer=None)
        return handler

    def _limited(self, inner, short: str, prologue, fail, count, serialize):
        """Two-way streams (reflection) under a small cap: each holds a worker thread while
        open, so idle ones, with no credential, could take every thread of the server. A
        two-way method outside the open ones needs the credential like any other, and its
        errors are mapped by `fail` as every other kind's (a domain error reached the client
        as UNKNOWN "Exception iterating responses: <its text>")."""
        service, limit = self.service, self.max_send

        def wrapped(request_iterator, context) -> Iterator:
            rid = prologue(context)
            peer = _peer(context).rpartition(":")[0] or "?"  # its host: one client, any port
            refused = self._take_open_slot(peer, context)
            if refused:
                # With its request id, as every other failed call (it had neither trailer
                # nor line); its line thinned per peer host: these streams need no
                # credential, and a flood of them must not write a line each.
                with bound_request_id(rid):
                    _refuse(context, service, short, "RESOURCE_EXHAUSTED",
                            f"{refused}; close one", f"{short}: {refused}; close one")
            reaped = _OPEN_REAPER.arm(time.monotonic() + OPEN_STREAM_MAX_S, context,
                                      f"{short}: open for {OPEN_STREAM_MAX_S:g} s, the most a "
                                      "stream may be; open another")
            # Counted and timed however they end: only refusals were, so an error-ratio
            # alert on the method read 100%.
            t0, code = time.perf_counter(), "OK"
            try:
                yield from _bound_items(lambda: inner(request_iterator, context), rid,
                                        _encoder(serialize, limit, context, service, short))
                code = None  # counted here, or once the call has ended
                count(context, _finished_code(context), request_iterator)
            except GeneratorExit:
                code = rpc_ended(context).code
                raise
            except BaseException as exc:  # noqa: BLE001 - mapped to a status
                code = None  # `fail` counts it under the status it ends the call with
                with bound_request_id(rid):
                    fail(context, exc, request_iterator)
            finally:
                _OPEN_REAPER.disarm(reaped)
                self._free_open_slot(peer)
                if code is not None:
                    RPC_TOTAL.labels(service, short, code).inc()
                RPC_SECONDS.labels(service, short).observe(time.perf_counter() - t0)

        return wrapped

    def _take_open_slot(self, peer: str, context) -> str:
        """Takes an open stream's slot for a stream of `peer` (its host), waiting up to
        OPEN_SLOT_GRACE_S for one to free; returns why it was refused ("" = taken: give it
        back with `_free_open_slot`)."""
        slots, by_peer = self._open_streams, self._open_by_peer
        freed, waiting = self._open_freed, self._open_waiting
        give_up = time.monotonic() + OPEN_SLOT_GRACE_S
        mine_waits = False
        with freed:
            while True:
                mine = by_peer.get(peer, 0)
                if mine < MAX_OPEN_STREAMS_PER_PEER and slots.acquire(blocking=False):
                    by_peer[peer] = mine + 1
                    refused = ""
                    break
                refused = (f"at most {MAX_OPEN_STREAMS_PER_PEER} open streams per client"
                           if mine >= MAX_OPEN_STREAMS_PER_PEER
                           else f"at most {MAX_OPEN_STREAMS} open streams at once")
                left = give_up - time.monotonic()
                if left <= 0 or not context.is_active():
                    break
                if not mine_waits:
                    if peer in waiting or len(waiting) >= MAX_WAITING_STREAMS:
                        break  # refused at once: no more threads held in waits
                    waiting.add(peer)
                    mine_waits = True
                    # Its client going away wakes it: it held its thread (and the
                    # peer's one wait) for the rest of the grace. Refused (False), the
                    # call ended since is_active() above: the callback will never run.
                    if not context.add_callback(lambda: _notify_all(freed)):
                        break
                freed.wait(left)
            if mine_waits:
                waiting.discard(peer)
        return refused

    def _free_open_slot(self, peer: str) -> None:
        """Gives back a slot `_take_open_slot` took for `peer`, waking a stream waiting for
        one."""
        with self._open_freed:
            left = self._open_by_peer.get(peer, 1) - 1
            if left > 0:
                self._open_by_peer[peer] = left
            else:
                self._open_by_peer.pop(peer, None)
            self._open_streams.release()
            self._open_freed.notify_all()


def _notify_all(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()


class BindError(ConfigError):
    """The service's address or metrics port cannot be bound (in use, or not this host's)."""


@dataclass
class ServerHandle:
    """A started gRPC server and the pieces around it."""

    service: str
    server: grpc.Server
    port: int
    health: _HealthServicer
    service_names: list[str]
    metrics_port: int | None = None
    _metrics_httpd: Any = None
    _interceptor: Any = None
    serving: bool = False  # what health says now, under every name (HEALTH_PATH reads it)
    stopped: threading.Event = field(default_factory=threading.Event)
    # Set when a drain begins: health stays NOT_SERVING from then on, whoever asks (a watcher
    # that turns it off and on again, such as kvpool's stalled-engine check).
    draining: threading.Event = field(default_factory=threading.Event)
    _health_lock: threading.Lock = field(default_factory=threading.Lock)
    # Why the service, though SERVING, must not take traffic yet ("" = it may), asked at
    # READY_PATH only (None = ready whenever SERVING). The orchestrator's: no healthy replica
    # serves its model.
    readiness: Callable[[], str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool = True) -> None:
        """Health SERVING or NOT_SERVING; SERVING is ignored once a drain has begun."""
        with self._health_lock:
            if serving and self.draining.is_set():
                return
            if serving:
                _serving_began.set()
            self.serving = serving
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ["", *self.service_names]:
                self.health.set(name, status)

    def begin_drain(self) -> None:
        """Health NOT_SERVING for good (requests are still served until `stop`)."""
        self.draining.set()
        self.set_serving(False)

    def stop(self, grace: float | None = 5.0) -> None:
        """Health NOT_SERVING, refuse new RPCs, let in-flight ones finish within `grace`."""
        self.begin_drain()
        # The drain said as it goes: how many calls it waits for, and whether they finished
        # or the grace cut them (the log said "draining", then "stopped", nothing between).
        # Said once: semantic and prefix stop their handle again as they close (no calls).
        calls = (self._interceptor.in_flight
                 if self._interceptor is not None and not self.stopped.is_set() else None)
        began = time.monotonic()
        if calls is not None:
            log.info("refusing new calls; %d call(s) under way, %.1fs to finish", calls,
                     grace or 0.0)
        if self._interceptor is not None:
            # Calls still running when the grace ends are cut by gRPC: their handlers see the
            # call closed, as if their client had gone (`rpc_ended` tells them apart).
            self._interceptor.cut_at = time.monotonic() + (grace or 0.0)
        if not grace:
            # gRPC cuts every call at once (UNAVAILABLE): the open Watches are ended first,
            # each on NOT_SERVING and OK, as with a grace (they were cut, or not, by chance,
            # and counted OK either way). One opened from here on is cut, and counted so.
            self.health.close_watches()
        stopping = self.server.stop(grace)  # new RPCs (a Watch opened again) refused from here
        if grace:
            self.health.close_watches()
        stopping.wait()
        took = time.monotonic() - began
        if calls is not None:
            left = self._interceptor.in_flight
            if left and took >= (grace or 0.0) - STOP_CUT_SLACK_S:
                log.warning("drain grace of %.1fs ended with %d call(s) under way: cut "
                            "(their clients get UNAVAILABLE)", grace or 0.0, left)
            else:
                log.info("drained in %.1fs: every call finished", took)
        Thinned.flush_all()  # every instance: the orchestrator's WARNINGs too
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        self.stopped.set()


def tls_file(env: Mapping[str, str], var: str) -> str:
    """A TLS file variable's path, `~` expanded as every other path setting's is (it arrives
    literally from env files and manifests: "~/certs/server.pem" was "cannot read"); "" =
    unset."""
    return os.path.expanduser(env.get(var) or "")


def server_tls_files(service: str, env: Mapping[str, str] | None = None
                     ) -> tuple[tuple[str, str], tuple[str, str]]:
    """The server's (variable, certificate file) and (variable, key file): the service's own
    TIERCACHE_<SERVICE>_TLS_CERT / _KEY where set, else the shared TIERCACHE_TLS_CERT / _KEY
    (each of the two on its own: several certificates may share one key); "" = unset."""
    env = os.environ if env is None else env
    picked = []
    for part in ("CERT", "KEY"):
        own = f"TIERCACHE_{service.upper()}_TLS_{part}" if service else ""
        var = own if own and env.get(own) else f"TIERCACHE_TLS_{part}"
        picked.append((var, tls_file(env, var)))
    return picked[0], picked[1]


CLIENT_AUTH_VALUES = ("require", "none")


def client_auth_var(service: str) -> str:
    """The variable that says whether `service`'s server requires client certificates."""
    return f"TIERCACHE_{service.upper()}_TLS_CLIENT_AUTH"


def client_auth(service: str, env: Mapping[str, str] | None = None) -> str:
    """`service`'s TIERCACHE_<SERVICE>_TLS_CLIENT_AUTH as read: stripped and lower-cased, as
    every setting's value is; "" when unset or empty (the default: require)."""
    env = os.environ if env is None else env
    return (env.get(client_auth_var(service)) or "").strip().lower()


def requires_client_certs(service: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether `service`'s server demands a client certificate: with `TIERCACHE_TLS_CA` set,
    unless its own TIERCACHE_<SERVICE>_TLS_CLIENT_AUTH is `none` (the public orchestrator:
    tenants bring bearer tokens, not certificates, while its own calls stay mutual TLS)."""
    env = os.environ if env is None else env
    return bool(env.get("TIERCACHE_TLS_CA")) and client_auth(service, env) != "none"


def server_credentials_from_env(service: str) -> grpc.ServerCredentials | None:
    """TLS from `TIERCACHE_TLS_CERT`/`_KEY` files; mutual TLS when `TIERCACHE_TLS_CA` is set
    (and the service's TIERCACHE_<SERVICE>_TLS_CLIENT_AUTH is not `none`).

    Raises:
        ConfigError: a certificate without its key, or a key without its certificate.
    """
    (cert_var, cert), (key_var, key) = server_tls_files(service)
    if not cert and not key:
        return None
    if not (cert and key):
        raise ConfigError(f"{cert_var} and {key_var} must be set together")
    ca = tls_file(os.environ, "TIERCACHE_TLS_CA") if requires_client_certs(service) else None
    with open(cert, "rb") as f:
        cert_b = f.read()
    with open(key, "rb") as f:
        key_b = f.read()
    ca_b = None
    if ca:
        with open(ca, "rb") as f:
            ca_b = f.read()
    return grpc.ssl_server_credentials([(key_b, cert_b)], root_certificates=ca_b,
                                       require_client_auth=ca_b is not None)


# A client whose deadline passes while the server is stuck sending to it ends the stream a
# little before the server's copy of that deadline passes (it was taken on arrival).
DEADLINE_SLACK_S = 0.25
# gRPC cuts the calls left at its stop's grace end; their handlers see it a moment later.
STOP_CUT_SLACK_S = 0.05


def rpc_ended(context: grpc.ServicerContext) -> errors.TierCacheError:
    """Why an RPC ended under a handler that was still working: its deadline passed, or the
    server ended it at a deadline of its own (`reaper.end_call`: DeadlineExceeded), else the
    client cancelled or went away (Cancelled). Reaped streams and streams whose client gave up
    at its deadline were counted CANCELLED, while their client saw DEADLINE_EXCEEDED."""
    if getattr(context, "tiercache_ended_with", None) == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded("deadline exceeded")
    cut_at = getattr(getattr(context, "tiercache_server", None), "cut_at", None)
    if cut_at is not None and time.monotonic() >= cut_at - STOP_CUT_SLACK_S:
        # The server's stop cut it at the end of its drain: the client sees UNAVAILABLE.
        return errors.Unavailable("the server stopped: its drain ended before this call did")
    left = context.time_remaining() if hasattr(context, "time_remaining") else None
    if left is not None and left <= DEADLINE_SLACK_S:
        return errors.DeadlineExceeded("deadline exceeded")
    return errors.Cancelled("client cancelled")


def on_rpc_end(context: grpc.ServicerContext, fn: Callable[[], None]) -> None:
    """Run `fn` when the RPC ends (the client cancelled or went away) — at once if it has
    ended already: gRPC then refuses the callback instead of running it."""
    if not context.add_callback(fn):
        fn()


def create_server(
    *,
    service: str,
    address: str,
    services: Sequence[tuple[Callable[[Any, grpc.Server], None], Any, str]],
    max_workers: int = 32,
    internal_token: str | None = None,
    metrics_port: int | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_concurrent_rpcs: int | None = None,
    credentials: grpc.ServerCredentials | None = None,
    max_connection_age_s: float = 0.0,
    connection_age_grace_s: float = 0.0,
    authenticate: Callable[[Sequence[tuple[str, str]]], object] | None = None,
    request_id_headers: bool = False,
) -> ServerHandle:
    """Build and start a server; health starts NOT_SERVING.

    Args:
        service: short name ("kvpool", "prefix", ...), used in logs and metrics.
        address: host:port to bind; port 0 picks a free one (see `ServerHandle.port`).
        services: (add_XServicer_to_server, servicer, "tiercache.v1.X") triples.
        internal_token: when set, every non-health RPC must carry `authorization: Bearer <it>`.
        authenticate: called with the call's metadata before its request is read, for every
            RPC but health and reflection; a `TierCacheError` it raises is the call's status
            (the orchestrator's tenant tokens: a call without one is refused before its
            request, up to `max_message_bytes`, is parsed).
        max_concurrent_rpcs: calls under way or waiting for a worker thread; past it gRPC
            refuses new ones at once (RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!")
            instead of queueing them without bound (a flood of cheap calls, unauthenticated
            ones too, holds bounded memory). None: 4 x max_workers.
        metrics_port: serve Prometheus metrics over HTTP on this port (0 = free port, None = off),
            and health at HEALTH_PATH (readiness at READY_PATH).
        credentials: TLS credentials; None = from env (server_credentials_from_env) or plaintext.
        max_connection_age_s: > 0: a client connection is closed (GOAWAY) after this long;
            clients reconnect for their next calls, so behind a Service connections spread
            over pods added since. Calls under way get `connection_age_grace_s` to end.
        request_id_headers: every call sends its request id in its response headers
            (`_send_request_id`): the orchestrator's, for callers that sent none. The
            internal tiers' callers send theirs, and a unary call's separate headers cost
            tens of microseconds on their hot paths.
    Raises:
        BindError: the address or the metrics port cannot be bound (`_bind`, `_start_metrics`).
    """
    # As validated (`require_listen_address`): a value with a leading space (a YAML quirk)
    # passed the check, then failed gRPC's lookup as "cannot listen".
    address = address.strip()
    server, interceptor = _grpc_server(
        service=service, max_workers=max_workers, internal_token=internal_token,
        authenticate=authenticate, max_message_bytes=max_message_bytes,
        max_concurrent_rpcs=max_concurrent_rpcs, max_connection_age_s=max_connection_age_s,
        connection_age_grace_s=connection_age_grace_s, request_id_headers=request_id_headers)
    hs, names = _add_services(server, services)
    credentials = credentials or server_credentials_from_env(service)
    port = _bind(server, service, address, credentials)
    server.start()
    handle = ServerHandle(service, server, port, hs, names)
    handle._interceptor = interceptor
    handle.set_serving(False)
    if metrics_port is not None:
        _start_metrics(handle, service, address, metrics_port)
    # The version too: which build a pod runs, read from its first line (a rollout's pods
    # told apart without kubectl describe).
    log.info("%s listening on port %d (metrics %s; tiercache %s)", service, port,
             "off" if handle.metrics_port is None else handle.metrics_port, package_version())
    return handle


def _grpc_server(*, service: str, max_workers: int, internal_token: str | None,
                 authenticate: Callable[[Sequence[tuple[str, str]]], object] | None,
                 max_message_bytes: int, max_concurrent_rpcs: int | None,
                 max_connection_age_s: float, connection_age_grace_s: float,
                 request_id_headers: bool) -> tuple[grpc.Server, _ServerInterceptor]:
    """`create_server`'s gRPC server (not started, nothing added) and its interceptor."""
    interceptor = _ServerInterceptor(service, internal_token, authenticate, max_message_bytes,
                                     request_id_headers)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{service}-rpc"),
        interceptors=[interceptor],
        # gRPC sets SO_REUSEPORT by default: a second server on a busy port would bind and
        # split connections with the first (and a launcher would take the old one's health
        # for the new one's). A port in use must fail the bind.
        options=server_options(max_message_bytes) + (
            [("grpc.max_connection_age_ms", _int32_ms(max_connection_age_s)),
             ("grpc.max_connection_age_grace_ms", _int32_ms(connection_age_grace_s))]
            if max_connection_age_s > 0 else []),
        maximum_concurrent_rpcs=max_concurrent_rpcs or 4 * max_workers,
    )
    interceptor.server_state = getattr(server, "_state", None)
    return server, interceptor


def _add_services(server: grpc.Server,
                  services: Sequence[tuple[Callable[[Any, grpc.Server], None], Any, str]]
                  ) -> tuple[_HealthServicer, list[str]]:
    """Adds `create_server`'s `services` to `server`, then health and reflection; returns the
    health servicer and the full names of `services`."""
    names = []
    for add, servicer, full_name in services:
        add(servicer, server)
        names.append(full_name)
    hs = _HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    # Without the descriptor set (not generated) the compiled descriptors are served, still
    # through SourceInfoPool: the stock pool finds no method names (`grpcurl describe` of one).
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server, pool=source_info_pool() or SourceInfoPool({}))
    return hs, names


def _bind(server: grpc.Server, service: str, address: str,
          credentials: grpc.ServerCredentials | None) -> int:
    """The port `server` listens on at `address` (TLS with `credentials`, else plaintext).

    Raises:
        BindError: it cannot listen there.
    """
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # gRPC raises where it once returned 0
        port = 0
    if port == 0:
        raise BindError(f"TIERCACHE_{service.upper()}_ADDRESS: cannot listen on {address} "
                        "(the port is in use, or the host is not an address of this machine)")
    return port


def _start_metrics(handle: ServerHandle, service: str, address: str, metrics_port: int) -> None:
    """Serves `handle`'s metrics and health over HTTP on `metrics_port`, on the host of the
    gRPC `address` (`_serve_metrics_and_health`).

    Raises:
        BindError: it cannot listen there (the gRPC server is stopped).
    """
    host = address.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
    try:
        httpd = _serve_metrics_and_health(handle, host, metrics_port)
    except OSError as exc:
        handle.server.stop(None)
        raise BindError(f"TIERCACHE_{service.upper()}_METRICS_PORT: cannot listen on "
                        f"{host}:{metrics_port} ({exc.strerror or exc})") from None
    handle._metrics_httpd = httpd
    handle.metrics_port = httpd.server_address[1]


def _int32_ms(seconds: float) -> int:
    """`seconds` in milliseconds as gRPC's int options take them: 24.8 days at most (30 days
    of connection age overflowed the C int, a traceback at start). Longer is never anyway."""
    return min(int(seconds * 1000), 2**31 - 1)


def _unready(handle: ServerHandle) -> str:
    """Why the serving service is not ready (`ServerHandle.readiness`; "" = ready)."""
    if handle.readiness is None:
        return ""
    try:
        return handle.readiness()
    except Exception as exc:  # noqa: BLE001 - a broken check must not pass the probe
        log.exception("readiness check failed")
        return f"readiness check failed: {type(exc).__name__}"


def _serve_metrics_and_health(handle: ServerHandle, host: str, port: int) -> Any:
    """Start an HTTP server on a daemon thread: HEALTH_PATH answers with `handle`'s health,
    METRICS_PATH with Prometheus metrics, any other path 404 naming the two. Every path was
    metrics (as prometheus_client's own server does), so a probe set to a wrong path
    ("/health") passed whatever the service's health: a NOT_SERVING pod kept its traffic."""
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    metrics = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO")
        if path == METRICS_PATH:
            return metrics(environ, start_response)
        if path not in (HEALTH_PATH, READY_PATH):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found: {METRICS_PATH} (metrics), {HEALTH_PATH} (health) or "
                    f"{READY_PATH} (readiness)\n".encode()]
        ok = handle.serving
        body = b"SERVING\n" if ok else b"NOT_SERVING\n"
        if ok and path == READY_PATH:
            why = _unready(handle)
            # The reason in the body: `curl` (or the kubelet's event) says what is missing.
            ok, body = (True, b"READY\n") if not why else (
                False, f"NOT_READY: {why}\n".encode("utf-8", "replace"))
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    # The family of the address asked for (WSGIServer alone binds IPv4 only).
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):  # a thread per request, not joined at close
        address_family = family

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # a line per scrape and probe
            pass

    httpd = make_server(sockaddr[0], port, app, Server, handler_class=QuietHandler)
    threading.Thread(target=httpd.serve_forever, name=f"{handle.service}-http",
                     daemon=True).start()
    return httpd


def drain_delay_from_env() -> float:
    """`TIERCACHE_DRAIN_DELAY_S`: seconds between SIGTERM (health NOT_SERVING) and refusing new
    requests; 0 (the default) stops at once, as `make run` wants."""
    raw = os.environ.get("TIERCACHE_DRAIN_DELAY_S", "0").strip()
    if not raw:
        # As every number setting set but empty (config._parse) and TIERCACHE_LOG_LEVEL: taken
        # as 0, a manifest's empty key meant for a drain stopped the pod without one.
        raise ConfigError("TIERCACHE_DRAIN_DELAY_S: set but empty; unset it for no delay (0), "
                          "or give seconds in [0, 300]")
    try:
        delay = float(raw)
    except ValueError:
        raise ConfigError(f"TIERCACHE_DRAIN_DELAY_S: expected seconds, got {raw!r}") from None
    if not 0 <= delay <= 300:
        raise ConfigError(f"TIERCACHE_DRAIN_DELAY_S: must be in [0, 300], got {raw!r}")
    return delay


# A signal that came after health turned SERVING but before `run_until_signal` took over:
# that drain starts at once.
_early_stop = threading.Event()
_serving_began = threading.Event()


def _exit_while_starting(signum: int, _frame: Any) -> None:
    """SIGTERM/SIGINT before the service serves (loading a model, rebuilding indexes): exit
    now, 128 + signum. Nothing is served yet, and what loading writes survives a kill (as it
    must survive kill -9). As PID 1 in a container a signal without a handler is ignored: the
    pod went on loading, turned SERVING, and was killed at the end of its grace period. Once
    serving has begun, the signal is kept for `run_until_signal`'s drain instead."""
    if _serving_began.is_set():
        log.info("signal %d as serving began: draining", signum)
        _early_stop.set()
        return
    log.info("signal %d while starting: exiting", signum)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(128 + signum)


@contextlib.contextmanager
def exit_on_signal_while_starting() -> Iterator[None]:
    """Around a service's `main`: until `run_until_signal` takes over, SIGTERM and SIGINT end
    the process at once; the handlers before it are back afterwards (a caller in-process, such
    as a test, keeps its own). Main thread only: elsewhere signals cannot be handled."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _early_stop.clear()
    _serving_began.clear()
    before = [(s, signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)]
    for s, _ in before:
        signal.signal(s, _exit_while_starting)
    try:
        yield
    finally:
        for s, h in before:
            signal.signal(s, h)


def exit_process(rc: int) -> None:
    """Ends the process with `rc` once the service has stopped (everything closed): logs and
    streams flushed, then `os._exit`, skipping the interpreter's finalisation. There, native
    threads of torch or gRPC still winding down met C++ static destructors: "terminate called
    without an active exception", SIGABRT (exit 134) after a clean drain, now and then."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


# Set by the launcher (`make run`): the pid whose death stops this service. Its children run
# in their own sessions (a Ctrl-C reaches the launcher alone, which stops them in order), so a
# launcher killed with SIGKILL (a CI job cancelled, `timeout -s KILL`) left every service
# running, holding the stack's ports until someone found them.
PARENT_PID_ENV = "TIERCACHE_PARENT_PID"


def _stop_with_parent(raw: str, every_s: float = 1.0) -> None:
    """When `raw` names a pid: a daemon thread that sends this process SIGTERM (a drain)
    once its parent is no longer that pid (it died; the process was re-parented)."""
    try:
        parent = int(raw)
    except ValueError:
        return
    if parent <= 1:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        log.warning("parent process %d is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def service_main(service: str, body: Callable[[Sequence[str] | None], int],
                 argv: Sequence[str] | None) -> int:
    """Run a service's `main` body: SIGTERM/SIGINT while it starts exit at once (see
    `exit_on_signal_while_starting`), and a configuration problem found only while starting
    (an address or metrics port that cannot be bound: BindError) is one line and exit 2, not
    a traceback."""
    # A crash in native code (SIGSEGV, SIGABRT from torch, faiss or gRPC) dumps every
    # thread's Python stack to stderr: the pod's log says where, not only "exit 134".
    faulthandler.enable()
    _stop_with_parent(os.environ.get(PARENT_PID_ENV, ""))
    with exit_on_signal_while_starting():
        try:
            return body(argv)
        except ConfigError as exc:
            from services.common.config import named_as_given

            # Named as given, as the config's own refusals are: `--address` of a busy port
            # was blamed on TIERCACHE_<SVC>_ADDRESS, which the user never set.
            args = sys.argv[1:] if argv is None else argv
            logging.getLogger(f"services.{service}").error(
                "bad configuration: %s", named_as_given(str(exc), service, args))
            return 2


def run_until_signal(handle: ServerHandle, grace: float = 10.0,
                     on_stop: Callable[[], None] | None = None) -> None:
    """Block until SIGTERM/SIGINT, then drain and stop. Call from the main thread."""
    stop = threading.Event()

    def _on_signal(signum, _frame):
        log.info("signal %d: draining (grace %.1fs)", signum, grace)
        stop.set()

    delay = drain_delay_from_env()  # read now: a bad value fails the start, not the shutdown
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if _early_stop.is_set():  # signalled between turning SERVING and here
        stop.set()
    while not stop.wait(1.0):
        pass
    if delay > 0:
        # Health says NOT_SERVING while requests are still served: Kubernetes takes a pod out
        # of its endpoints asynchronously, and clients still sent here meanwhile must not be
        # refused.
        handle.begin_drain()
        log.info("not serving; accepting requests for %.1fs more before draining", delay)
        time.sleep(delay)
    handle.stop(grace)
    if on_stop is not None:
        on_stop()
    log.info("%s stopped", handle.service)


def load_service_config(cls: type, service: str, argv: Sequence[str] | None) -> Any | None:
    """Start a service's `main`: JSON logging, then its validated config.

    Returns None (after logging which variable is wrong) when the config is invalid, so
    `main` can exit with status 2 before binding anything.
    """
    import sys

    from services.common.config import load_config
    from services.common.grpc_client import tls_env_problem, tls_files_problem
    from services.common.hashing import hash_key_from_env, pure_python_from_env
    from services.common.logs import setup_logging

    try:
        setup_logging(service)
    except ValueError as exc:
        logging.getLogger(f"services.{service}").error("bad configuration: %s", exc)
        return None
    try:
        cfg = load_config(cls, service, list(sys.argv[1:] if argv is None else argv))
        # Process-wide settings read later (at shutdown, or after the model has loaded):
        # checked here so that a bad value fails the start at once, before anything binds.
        drain_delay_from_env()
        key = hash_key_from_env()
        pure_python_from_env()
        problem = tls_env_problem(service=service) or tls_files_problem(service)
        if problem:
            raise ConfigError(problem)
    except ConfigError as exc:
        logging.getLogger(f"services.{service}").error("bad configuration: %s", exc)
        return None
    _warn_weak_secrets(service, cfg, key)
    return cfg


def _warn_weak_secrets(service: str, cfg: Any, key: bytes) -> None:
    """A placeholder or a short secret, said at every start (a security review: the dev
    overlay's PLACEHOLDER values, public in this repository, were taken without a word)."""
    from services.common.config import env_name, weak_secret
    from services.common.hashing import DEFAULT_KEY

    log_ = logging.getLogger(f"services.{service}")
    token = getattr(cfg, "internal_token", "")
    why = weak_secret(token) if token else ""
    if why:
        log_.warning("%s is %s: anyone who can guess it calls the internal services",
                     env_name(service, "internal_token"), why)
    why = weak_secret(key) if key != DEFAULT_KEY else ""
    if why:
        log_.warning("TIERCACHE_HASH_KEY is %s: a tenant who guesses it can derive cache salts "
                     "and sign another tenant's entry references", why)
