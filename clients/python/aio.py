"""The asyncio client of the public TierCache API (grpc.aio): TierCacheClient's calls, awaited.

    async with AsyncTierCacheClient("localhost:50051", token="...") as c:
        async for chunk in c.stream([{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)
        result = await c.generate("What is a KV cache?")

Arguments, checks, results and errors are TierCacheClient's (clients/python/client.py: the
same code builds and checks the requests): Chunk, GenerateResult, IncompleteStream,
grpc.RpcError with `chunks_received` and `request_id`, `retry_later`. Cancelling the task that
awaits a call cancels the call: the server stops generating and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
from tiercache.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from clients.python.client import (
    CHANNEL_OPTIONS,
    Chunk,
    GenerateResult,
    Messages,
    _Answer,
    _chunk,
    _ClientBase,
    _incomplete,
    _name_request,
    _stream_failed,
    _whole_at_end,
)

# gRPC's own words for a call ended by the client: its cancel(), or its channel's close().
_CANCELLED_HERE = "Locally cancelled by application!"
_CHANNEL_CLOSED = "Channel closed!"

# The channels of clients closed in a child of fork() (their parent's), kept from being freed.
_INHERITED: list[grpc.aio.Channel] = []


def _task_cancelled() -> bool:
    """Whether the running task is being cancelled: grpc.aio raises asyncio.CancelledError
    both for that and for a call the client itself cancelled (cancel(), close())."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _cancelled_error(details: str) -> grpc.aio.AioRpcError:
    """The grpc.RpcError CANCELLED a call ended by the client raises, as the sync client's
    does: grpc.aio raised asyncio.CancelledError in a task nobody cancelled, which ends that
    task as cancelled (a web framework reads it as the request's own cancel)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), details)


class AsyncChunkStream(AsyncIterator[Chunk]):
    """What `AsyncTierCacheClient.stream` returns: an async iterator of Chunks, the last with
    `final`. The call starts at the first read (a stream never read sends nothing). Stopping
    early cancels the call (the server stops generating): cancel the task that reads it, leave
    an `async with` block around it, or `await aclose()`; `cancel()` ends it from another task
    or another thread (the reader's next read then raises grpc.RpcError CANCELLED). A stream
    dropped unclosed is cancelled when it is garbage-collected."""

    def __init__(self, client: AsyncTierCacheClient, req: orchestrator_pb2.GenerateRequest,
                 timeout: float, metadata: list[tuple[str, str]]) -> None:
        self._client = client
        self._req = req
        self._timeout = timeout
        self._metadata = metadata
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the call's, set before it
        self._received = 0
        self._final = False
        self._ended = False
        self._cancelled = False

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        if self._call is None:
            if self._cancelled:  # cancelled before the first read: nothing is sent
                self._ended = True
                raise self._failed(_cancelled_error(_CANCELLED_HERE))
            try:  # closed between stream() and the first read
                stub = self._client._live_stub()
            except BaseException:
                self._ended = True
                raise
            self._loop = asyncio.get_running_loop()
            self._call = stub.Generate(self._req, timeout=self._timeout,
                                       metadata=self._metadata)
            if self._cancelled:  # by another thread, since the check above: it saw no call
                self._call.cancel()
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            self._ended = True
            if _whole_at_end(self._final, e):
                raise StopAsyncIteration from None
            raise self._failed(e) from None
        except asyncio.CancelledError:
            self._ended = True
            self._call.cancel()  # the task's cancel: grpc.aio cancels the call too; made sure
            if _task_cancelled():
                raise
            e = _cancelled_error(_CHANNEL_CLOSED if self._client._closed else _CANCELLED_HERE)
            if _whole_at_end(self._final, e):
                raise StopAsyncIteration from None
            raise self._failed(e) from None
        except BaseException:
            self._ended = True
            self._call.cancel()
            raise
        if msg is grpc.aio.EOF:
            self._ended = True
            if not self._final:
                raise _incomplete()
            raise StopAsyncIteration
        self._received += 1
        chunk = _chunk(msg)
        self._final = chunk.final is not None
        return chunk

    def _failed(self, e: grpc.RpcError) -> grpc.RpcError:
        _stream_failed(e, self._received, self._metadata)
        return e

    def cancel(self) -> None:
        """Cancel the call (the server stops generating), at any time and from any thread:
        before the first read nothing is sent; after its end, a no-op. From outside the
        stream's event loop it is handed to that loop (grpc.aio calls are not thread-safe:
        cancelled from a thread, asyncio refused it, "Non-thread-safe operation", or the
        loop was not woken): a chunk already received may still be read before CANCELLED."""
        self._cancelled = True
        call, loop = self._call, self._loop
        if call is None:
            return
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:  # no loop runs in this thread
            here = False
        if here:
            call.cancel()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: its calls ended with it
            loop.call_soon_threadsafe(call.cancel)

    async def aclose(self) -> None:
        """Stop reading: the call is cancelled if it still runs; later reads end at once."""
        self._ended = True
        self.cancel()


class AsyncTierCacheClient(_ClientBase):
    """TierCacheClient on grpc.aio: `generate`, `warm`, `feedback` and `stats` are awaited,
    `stream` is an async iterator; arguments, checks, results and errors are TierCacheClient's.

    One client serves any number of concurrent tasks (one channel; the client holds no
    per-call state). Cancelling a task cancels the call it awaits (the server stops
    generating); a call's `timeout` ends it DEADLINE_EXCEEDED, as in the sync client.
    `await close()`, or leaving its `async with` block, ends every call still running on it
    (their readers raise grpc.RpcError CANCELLED, "Channel closed!"); closing again is a
    no-op, and any later call is a RuntimeError. The channel opens at the first call, in the
    running event loop, and serves that loop and process only: one made at import time
    (before the loop runs, or in a gunicorn --preload master) is fine; a call from another
    loop (a second asyncio.run) is a RuntimeError, as is a call in a child of fork() made
    after the channel opened (its close() there only marks it closed). While a channel is
    open, a forked child's own grpc.aio calls hang past their deadlines (gRPC's asyncio has no
    fork support): fork before the first call, after close(), or use multiprocessing's
    "spawn"."""

    _name = "AsyncTierCacheClient"
    _made = "opened its channel"

    def __init__(self, address: str = "localhost:50051", token: str | None = None,
                 timeout: float = 300.0, credentials: grpc.ChannelCredentials | None = None
                 ) -> None:
        super().__init__(address, token, timeout)
        # Bound to a process when its channel opens: one made before a fork() (at import, in
        # a gunicorn --preload master) but first called in the child serves the child (it
        # was refused there, though nothing of gRPC had crossed the fork).
        self._pid = None
        self._credentials = credentials
        self.channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stub: orchestrator_pb2_grpc.OrchestratorStub | None = None

    def _live_stub(self) -> orchestrator_pb2_grpc.OrchestratorStub:
        """The stub, its channel opened in the running loop on the first call."""
        self._check_open()
        loop = asyncio.get_running_loop()  # RuntimeError outside a coroutine
        if self._stub is None:
            # Opened here, not in __init__: a grpc.aio channel belongs to the loop running
            # when it is made, and one made at import time took a loop that never ran.
            self.channel = (
                grpc.aio.secure_channel(self.address, self._credentials,
                                        options=CHANNEL_OPTIONS)
                if self._credentials
                else grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS))
            self._loop = loop
            self._pid = os.getpid()
            self._stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        elif loop is not self._loop:
            raise RuntimeError(f"{self._name} serves the event loop of its first call; make "
                               "one per event loop (this call runs in another)")
        return self._stub

    async def __aenter__(self) -> AsyncTierCacheClient:
        self._check_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        if self.channel is not None:
            channel, self.channel, self._stub = self.channel, None, None
            if self._in_fork_child():
                # The parent's channel: closed, or freed, in a forked child it hung or crashed
                # the child and hung the parent's calls past their deadlines. Kept, untouched.
                _INHERITED.append(channel)
            else:
                await channel.close()

    def stream(self, messages: Messages, *, timeout: float | None = None, request_id: str = "",
               **kw: Any) -> AsyncChunkStream:
        """Stream chunks as the model produces them (`async for`); the last chunk carries
        `final`. As TierCacheClient.stream: a bad argument or a closed client raises at this
        call; the request is sent at the first read; a failed call raises grpc.RpcError
        (`chunks_received`, `request_id` on it) and one that ends without its final message
        IncompleteStream. Stop early by cancelling the reading task, leaving
        `async with c.stream(...) as s:`, or `await s.aclose()`; `s.cancel()` from another
        task or thread. Keyword arguments: build_request's."""
        req = self.build_request(messages, **kw)
        return AsyncChunkStream(self, req, self._timeout(timeout), self._metadata(request_id))

    async def generate(self, messages: Messages, **kw: Any) -> GenerateResult:
        """Run a whole generation (a GenerateResult); raises as stream() does. Cancelling the
        awaiting task cancels the call."""
        answer = _Answer()
        async with self.stream(messages, **kw) as chunks:
            async for ch in chunks:
                answer.add(ch)
        return answer.result()

    async def _unary(self, method: str, req: Any, timeout: float | None,
                     md: list[tuple[str, str]]) -> Any:
        timeout = self._timeout(timeout)  # refused before the channel opens
        call = getattr(self._live_stub(), method)(req, timeout=timeout, metadata=md)
        try:
            return await call
        except grpc.RpcError as e:
            _name_request(e, md)
            raise
        except asyncio.CancelledError:
            call.cancel()
            if _task_cancelled():
                raise
            e = _cancelled_error(_CHANNEL_CLOSED if self._closed else _CANCELLED_HERE)
            _name_request(e, md)
            raise e from None

    async def warm(self, prompts: Sequence[Messages] | str = (), *, top_k: int = 0,
                   owners_only: bool = False, pin_ttl_seconds: int = 0,
                   timeout: float | None = None, raw: bool = False,
                   request_id: str = "") -> orchestrator_pb2.WarmResponse:
        """TierCacheClient.warm, awaited."""
        req = self._warm_request(prompts, top_k=top_k, owners_only=owners_only,
                                 pin_ttl_seconds=pin_ttl_seconds, raw=raw)
        return await self._unary("Warm", req, timeout, self._metadata(request_id))

    async def feedback(self, semantic_entry_id: str, good: bool, timeout: float | None = None
                       ) -> orchestrator_pb2.FeedbackResponse:
        """TierCacheClient.feedback, awaited."""
        req = self._feedback_request(semantic_entry_id, good)
        return await self._unary("Feedback", req, timeout, self._metadata())

    async def stats(self, timeout: float | None = None) -> orchestrator_pb2.StatsResponse:
        """TierCacheClient.stats, awaited."""
        return await self._unary("Stats", orchestrator_pb2.StatsRequest(), timeout,
                                 self._metadata())

    async def erase_tenant(self, tenant: str, timeout: float | None = None
                           ) -> orchestrator_pb2.EraseTenantResponse:
        """TierCacheClient.erase_tenant, awaited."""
        req = self._erase_request(tenant)
        return await self._unary("EraseTenant", req, timeout, self._metadata())
