"""Typed Python client for the public TierCache API (tiercache.v1.Orchestrator).

    with TierCacheClient("localhost:50051", token="...") as c:
        for chunk in c.stream([{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)
        result = c.generate("What is a KV cache?")
        print(result.text, result.report.cached_tokens)

The server keeps no conversation: each turn sends the whole history (system prompt first, the
user's new message last), with one `session_id` per conversation so its turns reuse one
replica's cached prefix. Errors are grpc.RpcError (its code() and details() name the problem;
`retry_later` says whether to send it again); a bad argument is refused here, before anything
is sent (ValueError or TypeError naming it), and a call on a closed client, or on one made
before a fork() (in the child), is a RuntimeError. From asyncio: AsyncTierCacheClient
(clients/python/aio.py), the same calls awaited.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import re
import struct
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from tiercache.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

from services.common.config import is_host_port
from services.common.errors import lone_surrogate

Messages = str | Sequence[dict[str, str]]

# The trailer the server sets on a RESOURCE_EXHAUSTED that means "busy now, retry later"
# (concurrency or rate limits, every replica busy). Without it the request exceeds a fixed
# limit (the tenant's prompt-token or max_tokens limit, the largest pool) and fails the same way
# every time.
OVERLOADED_TRAILER = "tiercache-overloaded"
# gRPC's own answer (no trailer) to a call past a server's cap on concurrent calls.
RPC_CAP_DETAILS = "Concurrent RPC limit exceeded!"


class IncompleteStream(RuntimeError):
    """A Generate stream ended (status OK: a proxy or a cut connection) without its final
    message: the answer may be cut short, and there is no CacheReport."""


def _name_request(e: grpc.RpcError, metadata: list[tuple[str, str]]) -> None:
    """Give a failed call's `grpc.RpcError` `request_id`, the x-request-id it was sent with:
    the id its server's lines carry (an id made up here was never shown, and a ticket had
    none to quote)."""
    with contextlib.suppress(AttributeError):
        e.request_id = dict(metadata)["x-request-id"]


@contextlib.contextmanager
def _naming_request(metadata: list[tuple[str, str]]) -> Iterator[None]:
    """`_name_request` for the unary calls (Warm, Feedback, Stats)."""
    try:
        yield
    except grpc.RpcError as e:
        _name_request(e, metadata)
        raise


# gRPC's words for a connection that fails the same way every time: a TLS handshake that
# failed (a server certificate the CA does not sign, TLS to a plaintext server), and a server
# that speaks no HTTP/2 (no gRPC server: a web server's port).
TLS_HANDSHAKE_FAILED = "Tls handshake failed"
NO_HTTP2 = "Failed parsing HTTP/2"


def wrong_server(details: str) -> bool:
    """Whether an UNAVAILABLE's details say the connection fails the same way again."""
    return TLS_HANDSHAKE_FAILED in details or NO_HTTP2 in details


def retry_later(error: grpc.RpcError) -> bool:
    """True when `error` says the same request may succeed later (RESOURCE_EXHAUSTED marked
    overloaded or refused by the server's cap on concurrent calls, or UNAVAILABLE other than
    a failed TLS handshake or a server speaking no gRPC, which fail again); False for
    a request that can never succeed as it is, and for a stream that failed after part of its
    answer had arrived (`chunks_received` > 0: sent again, that text would come twice).
    False too for DEADLINE_EXCEEDED (the same deadline runs out again: give a longer
    `timeout`) and CANCELLED (the caller's own cancel or close()). The server sends no delay
    in its metadata (a tenant's rate-limit refusal says "retry in 0.35s" in its details): back
    off (exponentially, with jitter) and give up after a few tries; the client itself never
    retries. Sending Feedback or Warm again is safe (a rating sets a state, a pin is only ever
    extended: a second bad rating answers `invalidated` False); a Generate sent again after
    UNAVAILABLE may have run on the server already (its work done twice)."""
    if getattr(error, "chunks_received", 0):
        return False
    code = error.code() if callable(getattr(error, "code", None)) else None
    details = error.details() if callable(getattr(error, "details", None)) else None
    if code == grpc.StatusCode.UNAVAILABLE:
        # Not one that fails again: the same certificates, the same server at that address.
        return not wrong_server(details or "")
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    if details == RPC_CAP_DETAILS:
        return True
    try:
        trailers = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error object without trailers
        return False
    return any(k == OVERLOADED_TRAILER for k, _ in trailers)


def _message_list(messages: object) -> list:
    """`messages` as a list, or a TypeError saying what a request takes (None was "'NoneType'
    object is not iterable")."""
    try:
        return list(messages)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError("messages: a string (the question) or a list of {'role', 'content'} "
                        f"dicts, not {messages!r:.80}") from None


def _wire_text(where: str, text: object) -> str:
    """`text` as a protobuf string field carries it (UTF-8), or an error naming `where`: a
    TypeError for what is no string; a ValueError for a lone surrogate (a JSON "\\ud800" in
    a replayed trace, a str decoded with surrogateescape), which was protobuf's bare
    UnicodeEncodeError, naming no field."""
    if not isinstance(text, str):
        raise TypeError(f"{where}: a string, not {type(text).__name__}")
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(f"{where}: not valid Unicode: a lone surrogate at character {at}")
    return text


def _message(where: str, m: object) -> dict[str, str]:
    """One chat message's fields, or a TypeError naming it: a missing "content" was a bare
    KeyError 'content', a number there protobuf's "bad argument type for built-in operation",
    and a string in place of the dict "string indices must be integers"."""
    if not isinstance(m, Mapping):
        raise TypeError(f"{where}: a {{'role', 'content'}} dict, not {m!r:.80}")
    for key in ("role", "content"):
        if key not in m:
            raise TypeError(f"{where}: no {key!r} (a message is {{'role', 'content'}})")
        _wire_text(f"{where}.{key}", m[key])
    return {"role": m["role"], "content": m["content"]}


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def checked_token(token: str | None) -> str | None:
    """The bearer token as gRPC metadata can carry it: surrounding whitespace (a secret file's
    newline) dropped; anything but printable ASCII (inner spaces allowed, as the server's
    tokens file allows them) is a ValueError naming it (it was gRPC's INTERNAL "Invalid
    metadata")."""
    if token is None:
        return None
    if not isinstance(token, str):  # was "'int' object has no attribute 'strip'"
        raise TypeError(f"token: a string, not {type(token).__name__}")
    token = token.strip()
    if not all(0x20 <= ord(ch) <= 0x7E for ch in token):
        raise ValueError("token: printable ASCII only (it travels as gRPC metadata)")
    return token


# What every client channel is opened with: answers up to 16 MiB, as the services' channels
# take them (gRPC's default is 4 MiB).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]

# The longest timeout a call may have, as the CLI's --timeout: gRPC turned one past about
# 1e9 s into a deadline already passed, and every call failed at once with DEADLINE_EXCEEDED.
MAX_TIMEOUT = 1e6


def _checked_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        # Was "'<' not supported between instances of 'int' and 'str'", naming nothing.
        raise TypeError(f"timeout: a number of seconds, not {type(timeout).__name__}")
    if not 0 < timeout <= MAX_TIMEOUT:  # nan fails both
        raise ValueError(f"timeout: must be a number of seconds in (0, 1e6], got {timeout!r}")
    return float(timeout)


def float32_problem(value: float, top: float = math.inf) -> str | None:
    """What is wrong with `value` as a sampling field in [0, top], judged as the wire carries
    it (a proto float, 32 bits), or None. Checked as float32, not as given: 1e-50 became 0.0,
    which the server reads as unset (top_p 1.0: full sampling instead of the narrowest
    nucleus; temperature: greedy), and 1e39 became inf, refused as "got inf", a value
    nobody sent."""
    if not 0.0 <= value <= top:  # nan fails both
        if top == math.inf:
            return f"must be a finite number >= 0, got {value!r}"
        return f"must be in [0, {top:g}], got {value!r}"
    try:
        wire = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # struct refuses exactly what the cast to float32 makes inf
        wire = math.inf
    if wire == math.inf:
        return f"must be a finite float32 (at most ~3.4e38), got {value!r}"
    if value > 0 and wire == 0.0:
        return f"{value!r} rounds to 0 as a float32 (0 means unset); give 0 or >= 1.4e-45"
    return None


def checked_float32(name: str, value: float, top: float = math.inf) -> float:
    """`value` for the float32 sampling field `name`, or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: must be a number, got {type(value).__name__}")
    value = float(value)
    problem = float32_problem(value, top)
    if problem:
        raise ValueError(f"{name}: {problem}")
    return value


def checked_int(name: str, value: int, top: int) -> int:
    """`value` for the integer request field `name` (0..`top`), or an error naming it:
    protobuf's own says only "Value out of range: -1", whichever field it was."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: must be an integer, got {type(value).__name__}")
    if not 0 <= value <= top:
        raise ValueError(f"{name}: must be in 0..{top}, got {value}")
    return int(value)


@dataclass
class Chunk:
    """One streamed piece: text (never a broken UTF-8 character, but a grapheme, such as
    emoji joined by U+200D or a letter and its combining marks, may span pieces; may be
    empty), its token ids (only with return_token_ids), and on the last one `final` (the
    GenerateFinal message: finish_reason, usage, cache_report, request_id)."""

    text: str
    token_ids: list[int]
    final: orchestrator_pb2.GenerateFinal | None = None


def _chunk(msg: orchestrator_pb2.GenerateResponse) -> Chunk:
    return Chunk(msg.text, list(msg.token_ids), msg.final if msg.HasField("final") else None)


def _whole_at_end(final: bool, e: grpc.RpcError) -> bool:
    """Whether a stream that failed with `e` after its last message (`final`: it was the
    final one) still holds the whole answer: the call was ended at its deadline, or cancelled,
    only after its final message had come (a server ending calls at their deadline may cut one
    that finished that moment). Any other status is raised."""
    return final and e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _stream_failed(e: grpc.RpcError, received: int, metadata: list[tuple[str, str]]) -> None:
    """Mark a stream's error with the chunks that had arrived (`retry_later` is False once
    any had) and the call's request id."""
    with contextlib.suppress(AttributeError):
        e.chunks_received = received
    _name_request(e, metadata)


def _incomplete() -> IncompleteStream:
    # A bare stream() caller got a cut answer with no sign of it.
    return IncompleteStream("the stream ended without a final message (the answer may be cut "
                            "short)")


class _Answer:
    """What generate() gathers from a stream's chunks (the sync and the asyncio client's)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.final: orchestrator_pb2.GenerateFinal | None = None
        self.chunks = 0

    def add(self, ch: Chunk) -> None:
        self.text.append(ch.text)
        self.ids.extend(ch.token_ids)
        self.chunks += 1
        if ch.final is not None:
            self.final = ch.final

    def result(self) -> GenerateResult:
        final = self.final
        assert final is not None  # stream() raises IncompleteStream otherwise
        return GenerateResult(
            text="".join(self.text), token_ids=self.ids,
            finish_reason=common_pb2.FinishReason.Name(final.finish_reason),
            prompt_tokens=final.usage.prompt_tokens,
            completion_tokens=final.usage.completion_tokens, report=final.cache_report,
            request_id=final.request_id, chunks=self.chunks)


class _CallHolder:
    """The call of one stream once it has started, and whether it was cancelled before: what
    `ChunkStream.cancel` and the stream's generator share (the generator holds this, not the
    ChunkStream, so that dropping the ChunkStream still closes it at once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.call: grpc.Call | None = None
        self.cancelled = False

    def started(self, call: grpc.Call) -> None:
        with self.lock:
            self.call = call
            cancelled = self.cancelled
        if cancelled:
            call.cancel()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            call = self.call
        if call is not None:
            call.cancel()


class ChunkStream(Iterator[Chunk]):
    """What `TierCacheClient.stream` returns: an iterator of Chunks. `cancel()` ends the call
    from any thread (a user's cancel while another thread waits for the next chunk; that
    thread's next() then raises grpc.RpcError CANCELLED); `close()` does it from the thread
    that reads (a generator's close, which another thread cannot call while it waits:
    "generator already executing", and the answer ran on to its end), and so does leaving
    `with c.stream(...) as s:` (by a break, a return or any exception: a Ctrl-C in the loop's
    body, past a stream kept in a variable, left it generating until the process exited)."""

    def __init__(self, holder: _CallHolder, chunks: Iterator[Chunk]) -> None:
        self._holder = holder
        self._chunks = chunks

    def __iter__(self) -> ChunkStream:
        return self

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]

    def cancel(self) -> None:
        """Cancel the call (the server stops generating), from any thread, at any time: before
        the first next() the call is cancelled as it starts; after its end, a no-op."""
        self._holder.cancel()


@dataclass
class GenerateResult:
    """A whole answer. `token_ids` is empty unless the request set return_token_ids; it holds
    every generated id, a stop token or EOS that ended the answer included (counted in
    `completion_tokens`; EOS and other control tokens have no text). `finish_reason` is the
    FinishReason enum's name: "FINISH_REASON_EOS", "_LENGTH" (max_tokens), "_STOP" (a stop
    token id) or "_CACHED" (a whole semantic hit). On a semantic hit `prompt_tokens` is 0
    (no model ran) and `report.semantic_hit` is True. `request_id` is the call's
    x-request-id (the caller's, or one made up). `chunks` counts the stream's messages;
    `extra` is left empty, for the caller's own use."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    report: common_pb2.CacheReport
    request_id: str
    chunks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class _ClientBase:
    """What TierCacheClient and AsyncTierCacheClient share: the checks of the address, token
    and timeouts, each call's metadata, and the requests, built and checked before any call."""

    _name = "TierCacheClient"  # the class a closed or forked client's error names
    _made = "was made"  # what happened in the process a forked client's error names

    def __init__(self, address: str, token: str | None, timeout: float) -> None:
        if not isinstance(address, str) or not is_host_port(address.strip(), dialed=True):
            # gRPC dialed "localhost:99999" as port 34463 and "localhost" as 443: UNAVAILABLE,
            # which retry_later calls worth retrying, for good.
            raise ValueError(f"address: {address!r} is not host:port (port 1..65535; an IPv6 "
                             "address in brackets)")
        self.address = address.strip()
        self._closed = False
        # The process the client serves (None: any, until it binds): a forked child's calls
        # are refused, see _check_open.
        self._pid: int | None = os.getpid()
        self.token = checked_token(token)
        self.timeout = _checked_timeout(timeout)

    def __reduce__(self) -> Any:
        # Sent to another process (a spawn pool's argument), it was "no default __reduce__
        # due to non-trivial __cinit__" (the channel), naming neither the client nor the way.
        raise TypeError(f"{self._name} cannot be pickled (sent to another process): make one "
                        "in each process, from its address and token")

    def _timeout(self, timeout: float | None) -> float:
        # Not `timeout or self.timeout`: 0 became the 300 s default.
        return self.timeout if timeout is None else _checked_timeout(timeout)

    def _check_open(self) -> None:
        if self._closed:
            # gRPC's own "ValueError: Cannot invoke RPC: Channel closed!" read as a bad value.
            raise RuntimeError(f"{self._name} is closed: make a new one")
        if self._in_fork_child():
            # A gRPC channel does not survive fork() (gRPC Python does not support it): in a
            # gunicorn --preload worker a call on the master's client failed UNAVAILABLE
            # "Wrong file descriptor generation", which retry_later calls worth retrying, or
            # went through, by luck.
            raise RuntimeError(f"{self._name} {self._made} in process {self._pid}, before "
                               "a fork(): gRPC channels do not survive a fork; make one in each "
                               "process (gunicorn: in post_fork, or on first use)")

    def _in_fork_child(self) -> bool:
        """Whether this process is a child of fork() of the process the client serves."""
        return self._pid is not None and os.getpid() != self._pid

    def _metadata(self, request_id: str = "") -> list[tuple[str, str]]:
        """Call metadata: the caller's request id (it names the call in every service's logs
        and comes back in GenerateFinal.request_id) or a new one; the bearer token."""
        self._check_open()
        if not isinstance(request_id, str):  # re's "expected string or bytes-like object"
            raise TypeError(f"request_id: a string, not {type(request_id).__name__}")
        if request_id and not _REQUEST_ID.fullmatch(request_id):
            # gRPC's "Invalid metadata" (INTERNAL) named no field; the server would replace an
            # id outside this pattern with its own anyway.
            raise ValueError(f"request_id: {request_id!r} is not 1-128 characters of "
                             "A-Z a-z 0-9 . _ : -")
        md = [("x-request-id", request_id or uuid.uuid4().hex[:16])]
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        return md

    @staticmethod
    def build_request(messages: Messages, *, max_tokens: int = 0, temperature: float = 0.0,
                      top_p: float = 0.0, seed: int = 0, session_id: str = "",
                      cache_policy: common_pb2.CachePolicy | None = None,
                      return_token_ids: bool = False, raw: bool = False,
                      stop_token_ids: Sequence[int] = (), ignore_eos: bool = False
                      ) -> orchestrator_pb2.GenerateRequest:
        """The GenerateRequest that stream() and generate() send; their keyword arguments
        are these.

        messages: a string (one user message; with `raw`, the raw prompt itself, no chat
            template), one {"role", "content"} dict, or a list of them (roles "system",
            "user", "assistant"; the last one the user's). `raw` is ignored for a list.
        max_tokens: new tokens at most; 0 = the server's default (capped by the tenant's
            limit, and by what the model's context leaves after the prompt: the answer then
            stops there, finish_reason LENGTH). More than the tenant's limit is
            RESOURCE_EXHAUSTED, and more than the server's own,
            TIERCACHE_ORCHESTRATOR_MAX_TOKENS_LIMIT (2048), INVALID_ARGUMENT; a prompt that
            with max_tokens passes the model's context, or fills it alone, is INVALID_ARGUMENT
            naming the tokens and the context (a conversation grown that long fails so on
            every later turn); none retryable.
        temperature: 0 = greedy; top_p: nucleus mass in (0, 1], 0 = 1.0; seed: 0 = none (a
            seed makes a sampled answer reproducible).
        session_id: one id per conversation (at most 256 characters): routing only, the
            server keeps no history.
        cache_policy: a tiercache.v1.common_pb2.CachePolicy, e.g.
            CachePolicy(semantic_tier="strict"), CachePolicy(semantic_threshold=0.95) (0.85
            is the default floor; below it INVALID_ARGUMENT), or everything off:
            CachePolicy(skip_semantic_lookup=True, skip_semantic_store=True,
            skip_prefix_cache=True, skip_draft=True). None = every tier on.
        return_token_ids: send the generated ids too (Chunk.token_ids).
        stop_token_ids: ids that end the answer besides EOS; the one that ended it is part of
            the answer (its id and its text). There are no stop strings.
        ignore_eos: generate past EOS, up to max_tokens."""
        # Checked here: protobuf stores them as float32 without a word (nan built silently).
        temperature = checked_float32("temperature", temperature)
        top_p = checked_float32("top_p", top_p, top=1.0)
        max_tokens = checked_int("max_tokens", max_tokens, 2**31 - 1)
        seed = checked_int("seed", seed, 2**64 - 1)
        # The wrong type named (protobuf's "bad argument type for built-in operation", or
        # "'int' object is not iterable", said which argument of a dozen was wrong).
        if not isinstance(stop_token_ids, Iterable) or isinstance(stop_token_ids, (str, bytes)):
            raise TypeError("stop_token_ids: a list of token ids, not "
                            f"{type(stop_token_ids).__name__}")
        stop_token_ids = [checked_int("stop_token_ids", t, 2**32 - 1) for t in stop_token_ids]
        _wire_text("session_id", session_id)
        if cache_policy is not None and not isinstance(cache_policy, common_pb2.CachePolicy):
            raise TypeError("cache_policy: a tiercache.v1.common_pb2.CachePolicy, not "
                            f"{type(cache_policy).__name__}")
        req = orchestrator_pb2.GenerateRequest(
            session_id=session_id, return_token_ids=return_token_ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                               top_p=top_p, seed=seed,
                                               stop_token_ids=list(stop_token_ids),
                                               ignore_eos=ignore_eos))
        if cache_policy is not None:
            req.cache_policy.CopyFrom(cache_policy)
        if isinstance(messages, dict):  # one message: not its keys as messages
            messages = [messages]
        if isinstance(messages, str):
            _wire_text("messages", messages)
            if raw:
                req.prompt = messages
            else:
                req.messages.add(role="user", content=messages)
        else:
            for i, m in enumerate(_message_list(messages)):
                req.messages.add(**_message(f"messages[{i}]", m))
        return req

    @staticmethod
    def _warm_request(prompts: Sequence[Messages] | str, *, top_k: int, owners_only: bool,
                      pin_ttl_seconds: int, raw: bool) -> orchestrator_pb2.WarmRequest:
        """The WarmRequest warm() sends (its docstring says what the arguments are)."""
        if isinstance(prompts, str):
            # One system prompt, not one prompt per character (28 single-letter prompts, then
            # a server error that did not point here).
            prompts = [prompts]
        elif isinstance(prompts, Mapping):
            prompts = [[prompts]]  # one message (its keys were taken for two system prompts)
        else:
            prompts = list(prompts)
            if prompts and isinstance(prompts[0], Mapping):
                prompts = [prompts]  # one conversation's messages, not a list of them
        # Named here: protobuf's own refusal of -1 was "Value out of range: -1", no field.
        top_k = checked_int("top_k", top_k, 2**32 - 1)
        pin_ttl_seconds = checked_int("pin_ttl_seconds", pin_ttl_seconds, 2**32 - 1)
        req = orchestrator_pb2.WarmRequest(
            top_k=top_k, pin_ttl_seconds=pin_ttl_seconds,
            target=(orchestrator_pb2.WARM_TARGET_OWNERS if owners_only
                    else orchestrator_pb2.WARM_TARGET_ALL))
        for i, p in enumerate(prompts):
            wp = req.prompts.add()
            if isinstance(p, str):
                _wire_text(f"prompts[{i}]", p)
                if raw:
                    wp.prompt = p
                else:
                    wp.messages.add(role="system", content=p)
            else:
                for j, m in enumerate([p] if isinstance(p, Mapping) else p):
                    if not isinstance(m, Mapping):
                        raise TypeError("warm: each prompt is a system prompt (str) or a list "
                                        f"of messages ({{'role', 'content'}} dicts), not {m!r:.80}")
                    wp.messages.add(**_message(f"prompts[{i}].messages[{j}]", m))
        return req

    @staticmethod
    def _feedback_request(semantic_entry_id: str, good: bool
                          ) -> orchestrator_pb2.FeedbackRequest:
        """The FeedbackRequest feedback() sends."""
        # Named here: protobuf's own refusal of a number was "bad argument type for built-in
        # operation", naming nothing.
        _wire_text("semantic_entry_id", semantic_entry_id)
        if not isinstance(good, bool):
            # Truth-tested, feedback(entry, "bad") marked a wrong answer verified.
            raise TypeError(f"good: True (verified) or False (wrong: invalidate), not {good!r:.40}")
        req = orchestrator_pb2.FeedbackRequest(
            semantic_entry_id=semantic_entry_id,
            rating=orchestrator_pb2.RATING_GOOD if good else orchestrator_pb2.RATING_BAD)
        return req

    @staticmethod
    def _erase_request(tenant: str) -> orchestrator_pb2.EraseTenantRequest:
        """The EraseTenantRequest erase_tenant() sends."""
        _wire_text("tenant", tenant)
        if not tenant.strip():
            # Said here, before anything is sent (the server's INVALID_ARGUMENT says the same).
            raise ValueError("tenant: required (the tenant's name, as in the tokens file)")
        return orchestrator_pb2.EraseTenantRequest(tenant=tenant)


class TierCacheClient(_ClientBase):
    """A channel to the orchestrator. Every call has a timeout; errors surface as grpc.RpcError.

    `token` is the tenant's bearer token (sent as `authorization: Bearer <token>`; None when
    the server has no tokens). `timeout` (seconds, default 300) is each call's default
    deadline, for a stream the whole stream's, not a gap between chunks; the server cuts it to
    its request_timeout_s (300 s by default). `credentials` (grpc.ssl_channel_credentials)
    speaks TLS. One client may be shared by any number of threads (a gRPC channel is
    thread-safe; the client holds no per-call state). `close()`, or leaving its `with` block,
    ends every call still running on it, in any thread (their iterators raise grpc.RpcError
    CANCELLED, "Channel closed!"); closing again is a no-op, and any later call is a
    RuntimeError. A client serves the process that made it: in a child of fork() (gunicorn
    --preload, multiprocessing's fork) its calls are a RuntimeError, as gRPC channels do not
    survive a fork, and its close() only marks it closed (the channel is the parent's); make
    one per process. From asyncio, use AsyncTierCacheClient
    (clients/python/aio.py: the same calls, awaited; cancelling the task cancels the call),
    not this client in a thread: cancelling a task does not stop its thread, and a task
    cancelled around `to_thread(c.generate, ...)` left its answer generating to the end."""

    def __init__(self, address: str = "localhost:50051", token: str | None = None,
                 timeout: float = 300.0, credentials: grpc.ChannelCredentials | None = None
                 ) -> None:
        super().__init__(address, token, timeout)
        self.channel = (grpc.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
                        if credentials
                        else grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def __enter__(self) -> TierCacheClient:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        if not self._in_fork_child():
            # In a forked child the channel is the parent's: its close() there hung while a
            # call of the parent's was under way (an atexit close in a gunicorn worker).
            self.channel.close()

    def stream(self, messages: Messages, *, timeout: float | None = None, request_id: str = "",
               **kw: Any) -> ChunkStream:
        """Stream chunks as the model produces them; the last chunk carries `final`.
        `request_id` (plain, at most 128 characters) correlates the call with your own logs.

        Raises:
            grpc.RpcError: the call failed; `chunks_received` on it says how many chunks had
                arrived (then `retry_later` is False: a resent request repeats their text);
                `request_id` on it is the call's x-request-id, the id the servers' logs carry.
            IncompleteStream: the stream ended without its final message.
        A bad argument or a closed client raises at this call; the request is sent at the
        first next(). Stopping early cancels the call (the server stops generating): leave
        `with c.stream(...) as s:` (any exit: break, return, an exception, Ctrl-C), call
        `close()` on the iterator, or `break` out of a for loop that holds the only reference
        to it (`for ch in c.stream(...)`); an iterator kept in a variable goes on generating
        after a `break` until it is closed or garbage-collected. From another thread (a user's
        cancel while the reader waits), call its `cancel()` (a ChunkStream). Keyword
        arguments: those of build_request."""
        # Checked now, at the call: in the generator below a bad argument or a closed client
        # was raised only at the first next(), past a caller's try around stream().
        req = self.build_request(messages, **kw)
        holder = _CallHolder()
        return ChunkStream(holder, self._stream(req, self._timeout(timeout),
                                                self._metadata(request_id), holder))

    def _stream(self, req: orchestrator_pb2.GenerateRequest, timeout: float,
                metadata: list[tuple[str, str]], holder: _CallHolder) -> Iterator[Chunk]:
        # The call starts at the first next(), not before: an iterator never read (never
        # closed either) would otherwise leave a generation running to its deadline.
        self._check_open()  # closed between stream() and the first next()
        call = self.stub.Generate(req, timeout=timeout, metadata=metadata)
        holder.started(call)  # cancelled at once if ChunkStream.cancel came first
        received, final = 0, False
        try:
            for msg in call:
                received += 1
                chunk = _chunk(msg)
                final = chunk.final is not None
                yield chunk
        except grpc.RpcError as e:
            if _whole_at_end(final, e):
                return
            _stream_failed(e, received, metadata)
            raise
        finally:
            call.cancel()  # no-op when finished; stops generation if the caller stops early
        if not final:
            raise _incomplete()

    def generate(self, messages: Messages, **kw: Any) -> GenerateResult:
        """Run a whole generation and return the text and figures (a GenerateResult).
        Keyword arguments: stream()'s (timeout, request_id) and build_request's; it raises as
        stream() does."""
        answer = _Answer()
        for ch in self.stream(messages, **kw):
            answer.add(ch)
        return answer.result()

    def warm(self, prompts: Sequence[Messages] | str = (), *, top_k: int = 0,
             owners_only: bool = False, pin_ttl_seconds: int = 0,
             timeout: float | None = None, raw: bool = False,
             request_id: str = "") -> orchestrator_pb2.WarmResponse:
        """Prefill and pin prompts: a string is a system prompt, or with `raw` a raw prompt
        (a model without a chat template); a list of messages is rendered as given. `prompts`
        is a list of those, or one of them (a string, a message dict, a list of messages).
        Each prompt must be at least one 16-token KV block (INVALID_ARGUMENT otherwise), and
        only whole blocks are kept. `top_k` (at most 64) also warms this tenant's k hottest
        prefixes; `owners_only` warms only the replica(s) routing would pick;
        `pin_ttl_seconds` (0 = the server's default; past its limit INVALID_ARGUMENT) how long
        the blocks stay pinned. A replica that failed is a WarmResult.error, not an
        exception; no results at all means nothing was warmed. A pin the replica's pin limits
        cut short is no failure: its `pinned_blocks` is fewer than the prompt's blocks."""
        req = self._warm_request(prompts, top_k=top_k, owners_only=owners_only,
                                 pin_ttl_seconds=pin_ttl_seconds, raw=raw)
        md = self._metadata(request_id)
        with _naming_request(md):
            return self.stub.Warm(req, timeout=self._timeout(timeout), metadata=md)

    def feedback(self, semantic_entry_id: str, good: bool, timeout: float | None = None
                 ) -> orchestrator_pb2.FeedbackResponse:
        """Rate a cached answer: `semantic_entry_id` is CacheReport.semantic_entry_id (of the
        hit that answered, or the entry an answer was just stored as); `good` True marks it
        verified (served at a slightly lower threshold), False invalidates it (a wrong
        answer: no longer served). The reply's `invalidated` / `verified` say what changed;
        a bad rating of an entry already gone is `invalidated` False, a good one NOT_FOUND,
        and so is an id this tenant was not given."""
        req = self._feedback_request(semantic_entry_id, good)
        md = self._metadata()
        with _naming_request(md):
            return self.stub.Feedback(req, timeout=self._timeout(timeout), metadata=md)

    def stats(self, timeout: float | None = None) -> orchestrator_pb2.StatsResponse:
        """Figures of every tier, over every tenant: PERMISSION_DENIED unless the token is an
        admin one (or the server has no tokens)."""
        md = self._metadata()
        with _naming_request(md):
            return self.stub.Stats(orchestrator_pb2.StatsRequest(),
                                   timeout=self._timeout(timeout), metadata=md)

    def erase_tenant(self, tenant: str, timeout: float | None = None
                     ) -> orchestrator_pb2.EraseTenantResponse:
        """Erase one tenant's cached data: its semantic entries on every shard, its KV blocks
        on every kvpool replica (PERMISSION_DENIED unless the token is an admin one, or the
        server has no tokens). `tenant` is its name as in the tokens file (it may already be
        removed there). The reply counts what was removed; `not_reached` names each shard or
        replica that did not answer, and why: the tenant's data there stays (call again).
        `kv_blocks_in_use` blocks were kept because a running request reads them."""
        req = self._erase_request(tenant)
        md = self._metadata()
        with _naming_request(md):
            return self.stub.EraseTenant(req, timeout=self._timeout(timeout), metadata=md)
