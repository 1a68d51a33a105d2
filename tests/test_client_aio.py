"""The asyncio client (clients/python/aio.py) against a scripted orchestrator on loopback
(real gRPC): the sync client's checks, results and errors, and what asyncio adds (a cancelled
task cancels its call, close() ends the calls of other tasks, one event loop per client)."""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import subprocess
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from tiercache.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from clients.python.aio import AsyncChunkStream, AsyncTierCacheClient
from clients.python.client import (
    Chunk,
    IncompleteStream,
    TierCacheClient,
    _Answer,
    _whole_at_end,
    retry_later,
)
from tests.fake_orchestrator import serving
from tests.test_client_library import Scripted as LibraryScripted
from tests.waits import holds_within


def ended(context, key: str) -> None:
    """Scripted.ended gets `key` once the call ends: its callback, or at once where the call
    had already ended as its handler began (add_callback refuses then; a client's cancel while
    its request was being sent, and the test waited for an end that was never recorded)."""
    if not context.add_callback(lambda: Scripted.ended.append(key)):
        Scripted.ended.append(key)


class Scripted(LibraryScripted):
    """The library tests' script ('cut', 'busy', 'late', 'final then error', ...), plus
    'hang': one chunk, then nothing until the client ends the call; Stats answers at once,
    or hangs with the x-request-id 'hang'. `ended` holds the keys of calls that ended."""

    ended: list[str] = []

    def Generate(self, request, context):  # noqa: N802
        q = request.messages[-1].content if request.messages else request.prompt
        ended(context, q)
        if q != "hang":
            yield from super().Generate(request, context)
            return
        self._seen("Generate", request, context)
        yield orchestrator_pb2.GenerateResponse(text="Partial ")
        holds_within(lambda: not context.is_active(), 20, 0.005)

    def Stats(self, request, context):  # noqa: N802
        self._seen("Stats", request, context)
        ended(context, "Stats")
        if dict(context.invocation_metadata()).get("x-request-id") == "hang":
            holds_within(lambda: not context.is_active(), 20, 0.005)
        return orchestrator_pb2.StatsResponse(requests_total=7)


@pytest.fixture
def address():
    Scripted.calls = []
    Scripted.ended = []
    with serving(Scripted(), 8) as port:
        yield f"127.0.0.1:{port}"


def run(coro):
    """asyncio.run, failing on what asyncio logs about tasks left behind ("Task was destroyed
    but it is pending", "exception was never retrieved") and on any warning."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("asyncio")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = asyncio.run(coro, debug=True)
            gc.collect()
    finally:
        log.removeHandler(handler)
    bad = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    bad += [str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)]
    assert not bad, bad
    return out


async def until(pred, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "not in time"
        await asyncio.sleep(0.01)


def test_answers_cut_streams_and_late_statuses_are_the_sync_clients(address):
    async def main():
        async with AsyncTierCacheClient(address) as c:
            r = await c.generate("fine")
            assert (r.text, r.chunks) == ("Partial ", 2)
            got = []
            with pytest.raises(IncompleteStream):
                async for ch in c.stream("cut"):
                    got.append(ch.text)
            assert got == ["Partial "]
            assert (await c.generate("final then error")).text == "Partial "  # whole
            with pytest.raises(grpc.RpcError) as e:
                await c.generate("final then internal")
            assert e.value.code() == grpc.StatusCode.INTERNAL
            with pytest.raises(grpc.RpcError) as e:
                await c.generate("busy")
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.chunks_received == 1 and not retry_later(e.value)
            e.value.chunks_received = 0
            assert retry_later(e.value)  # the overloaded trailer read from an aio error
            with pytest.raises(grpc.RpcError) as e:
                await c.generate("late", request_id="req-late")
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (e.value.chunks_received, e.value.request_id) == (1, "req-late")
    run(main())


def test_bad_arguments_are_the_sync_clients_errors_before_any_call(address):
    for kw in ({"token": "tök"}, {"timeout": 0}, {"timeout": 1e10}):
        with pytest.raises(ValueError, match="^(token|timeout):"):
            AsyncTierCacheClient(address, **kw)
    with pytest.raises(ValueError, match="^address:"):
        AsyncTierCacheClient("localhost:99999")

    async def main():
        async with AsyncTierCacheClient(address) as c:
            with pytest.raises(ValueError, match="^request_id:"):
                c.stream("fine", request_id="a\nb")
            with pytest.raises(ValueError, match="^temperature:"):
                await c.generate("fine", temperature=float("nan"))
            with pytest.raises(ValueError, match="^timeout:"):
                await c.stats(timeout=0)
            with pytest.raises(TypeError, match=r"^prompts\[1\]\.messages\[0\]: no 'content'"):
                await c.warm(["system prompt", [{"role": "system"}]])
            with pytest.raises(TypeError, match="^good:"):
                await c.feedback("entry", "bad")
            with pytest.raises(ValueError, match="^tenant: required"):
                await c.erase_tenant(" ")
            c.stream("fine")  # never read: nothing sent
            assert c.channel is None  # not even opened
        assert Scripted.calls == []
    run(main())


def test_every_call_carries_the_token_and_a_request_id(address):
    async def main():
        async with AsyncTierCacheClient(address, token=" tok-1 ") as c:
            await c.generate("fine", request_id="r" * 128)
            await c.warm("be brief", owners_only=True)
            await c.feedback("entry-1", good=False)
            assert (await c.stats()).requests_total == 7
            assert list((await c.erase_tenant("acme")).not_reached) == [
                "kvpool r1: UNAVAILABLE: x"]
    run(main())
    assert [m for m, _, _ in Scripted.calls] == ["Generate", "Warm", "Feedback", "Stats",
                                                 "EraseTenant"]
    assert Scripted.calls[-1][1].tenant == "acme"
    assert all(md["authorization"] == "Bearer tok-1" and md["x-request-id"]
               for _, _, md in Scripted.calls)
    assert Scripted.calls[0][2]["x-request-id"] == "r" * 128
    assert Scripted.calls[1][1].target == orchestrator_pb2.WARM_TARGET_OWNERS
    assert Scripted.calls[2][1].rating == orchestrator_pb2.RATING_BAD


def test_a_cancelled_task_cancels_its_call(address):
    """The point of the asyncio client: a task cancelled around asyncio.to_thread(generate)
    left the answer generating to its end."""
    async def main():
        async with AsyncTierCacheClient(address) as c:
            task = asyncio.create_task(c.generate("hang"))
            await until(lambda: Scripted.calls)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: "hang" in Scripted.ended)  # the server saw the call end
    run(main())


def test_a_cancelled_task_cancels_its_unary_call(address):
    async def main():
        async with AsyncTierCacheClient(address) as c:
            c._metadata = lambda request_id="": [("x-request-id", "hang")]
            task = asyncio.create_task(c.stats())
            await until(lambda: Scripted.calls)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: "Stats" in Scripted.ended)
    run(main())


def test_cancel_from_another_task_and_close_end_the_readers_call_cancelled(address):
    """The reader gets grpc.RpcError CANCELLED, as the sync client's does, not grpc.aio's
    asyncio.CancelledError in a task nobody cancelled."""
    got: list[str] = []

    async def read(s: AsyncChunkStream) -> None:
        async for ch in s:
            got.append(ch.text)

    async def main():
        c = AsyncTierCacheClient(address)
        s = c.stream("hang")
        reader = asyncio.create_task(read(s))
        await until(lambda: got)  # its first chunk in, the reader waits for the next
        s.cancel()
        with pytest.raises(grpc.RpcError) as e:
            await reader
        assert e.value.code() == grpc.StatusCode.CANCELLED and e.value.chunks_received == 1
        reader = asyncio.create_task(read(c.stream("hang")))
        await until(lambda: len(Scripted.calls) == 2)
        await c.close()
        with pytest.raises(grpc.RpcError) as e:
            await reader
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.CANCELLED,
                                                      "Channel closed!")
        await until(lambda: Scripted.ended.count("hang") == 2)
        with pytest.raises(RuntimeError, match="^AsyncTierCacheClient is closed"):
            await c.generate("fine")
        await c.close()  # again: a no-op
    run(main())


def _in_a_thread(fn) -> None:
    """`fn()` in another thread, the event loop blocked until it returns; its error raised."""
    errs: list[BaseException] = []

    def run_it() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errs.append(e)
    t = threading.Thread(target=run_it)
    t.start()
    t.join()
    if errs:
        raise errs[0]


@pytest.mark.timeout(30)  # a cancel asyncio refused left the reader waiting for good
def test_cancel_from_another_thread_ends_the_readers_call_cancelled(address):
    """cancel() from a thread (a UI's, a worker's) cancelled the grpc.aio call off its event
    loop: while the call was being sent, asyncio refused it ("Non-thread-safe operation",
    the call left running). Handed to the stream's loop, it ends as a cancel from a task does;
    after the reader's first chunk and before its first read alike."""
    got: list[str] = []

    async def read(s: AsyncChunkStream) -> None:
        async for ch in s:
            got.append(ch.text)

    async def main():
        async with AsyncTierCacheClient(address) as c:
            for when in ("sending", "after a chunk"):
                s = c.stream("hang")
                reader = asyncio.create_task(read(s))
                if when == "sending":
                    for _ in range(2):  # the call made, its request being sent
                        await asyncio.sleep(0)
                    assert s._call is not None and not s._call._preparation.done()
                else:
                    await until(lambda: got)  # its first chunk in, the reader waits
                _in_a_thread(s.cancel)
                with pytest.raises(grpc.RpcError) as e:
                    await asyncio.wait_for(reader, 5)
                assert e.value.code() == grpc.StatusCode.CANCELLED
                await until(lambda: Scripted.ended.count("hang") == len(Scripted.calls))
            s = c.stream("fine")
            _in_a_thread(s.cancel)  # before the first read: nothing is sent
            with pytest.raises(grpc.RpcError) as e:
                await s.__anext__()
            assert e.value.code() == grpc.StatusCode.CANCELLED
        assert len(Scripted.calls) <= 2 and all(m == "Generate" for m, _, _ in Scripted.calls)
    run(main())


def test_a_cancel_from_a_thread_while_the_first_read_makes_the_call_is_not_lost(address):
    """The first read checks for a cancel, then makes the call: a thread's cancel between the
    two saw no call to cancel, and the call went ahead (the reader got its answer)."""
    async def main():
        async with AsyncTierCacheClient(address) as c:
            s = c.stream("hang")
            live = c._live_stub

            def stub_after_a_cancel():
                _in_a_thread(s.cancel)  # lands after the check, before the call is made
                return live()
            c._live_stub = stub_after_a_cancel
            with pytest.raises(grpc.RpcError) as e:
                await asyncio.wait_for(s.__anext__(), 5)
            assert e.value.code() == grpc.StatusCode.CANCELLED
    run(main())


def test_a_stream_left_early_is_cancelled(address):
    async def main():
        async with AsyncTierCacheClient(address) as c:
            async with c.stream("hang") as s:
                async for _ in s:
                    break
            await until(lambda: "hang" in Scripted.ended)
            s = c.stream("fine")
            s.cancel()  # before the first read: nothing is sent
            with pytest.raises(grpc.RpcError) as e:
                await s.__anext__()
            assert e.value.code() == grpc.StatusCode.CANCELLED
        assert [m for m, _, _ in Scripted.calls] == ["Generate"]
    run(main())


def test_timeouts_end_calls_deadline_exceeded(address):
    async def main():
        async with AsyncTierCacheClient(address, timeout=0.3) as c:
            with pytest.raises(grpc.RpcError) as e:
                await c.generate("hang")
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert e.value.chunks_received == 1 and not retry_later(e.value)
            c._metadata = lambda request_id="": [("x-request-id", "hang")]
            with pytest.raises(grpc.RpcError) as e:
                await c.stats(timeout=0.2)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert e.value.request_id == "hang"
    run(main())


def test_concurrent_calls_share_one_channel(address):
    async def main():
        async with AsyncTierCacheClient(address) as c:
            got = await asyncio.gather(*(c.generate("fine", request_id=f"r{i}")
                                         for i in range(32)))
            return c.channel, got
    _, got = run(main())
    assert [r.text for r in got] == ["Partial "] * 32
    assert sorted(md["x-request-id"] for _, _, md in Scripted.calls) == sorted(
        f"r{i}" for i in range(32))


def test_a_client_made_before_the_loop_serves_that_loop_only(address):
    c = AsyncTierCacheClient(address)  # at import time, say: no loop running
    assert run(c.generate("fine")).text == "Partial "

    async def elsewhere():
        with pytest.raises(RuntimeError, match="event loop"):
            await c.generate("fine")
    # The first loop is gone: the same client in a second asyncio.run is refused by name.
    run(elsewhere())
    with pytest.raises(RuntimeError, match="running event loop"):
        c.stream("fine").__anext__().send(None)


def test_tls_credentials_are_the_sync_clients(tmp_path):
    """grpc.ssl_channel_credentials, as TierCacheClient takes them, speak TLS here too."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make the certificates")
    subprocess.run([str(Path(__file__).parent.parent / "scripts" / "gen-certs.sh"),
                    str(tmp_path)], check=True, capture_output=True, timeout=60)
    server = grpc.server(ThreadPoolExecutor(2))
    Scripted.calls = []
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Scripted(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [((tmp_path / "server.key").read_bytes(), (tmp_path / "server.pem").read_bytes())]))
    server.start()
    try:
        creds = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
        r = run(AsyncTierCacheClient(f"localhost:{port}", token="t", credentials=creds
                                     ).generate("fine"))
        assert r.text == "Partial "
        assert Scripted.calls[0][2]["authorization"] == "Bearer t"
    finally:
        server.stop(0)


def test_the_sync_client_still_names_itself():
    c = TierCacheClient("127.0.0.1:1")
    c.close()
    with pytest.raises(RuntimeError, match="^TierCacheClient is closed"):
        c.generate("x")


def test_the_requests_checks_and_stream_rules_are_the_sync_clients_own_code():
    """Shared, not copied: one fix of a check or of the final-message rule serves both."""
    for name in ("build_request", "_warm_request", "_feedback_request", "_erase_request",
                 "_metadata",
                 "_timeout", "_check_open"):
        assert getattr(AsyncTierCacheClient, name) is getattr(TierCacheClient, name), name
    from tests.orchestrator.test_warm_loop import Err
    SC = grpc.StatusCode
    assert _whole_at_end(True, Err(SC.DEADLINE_EXCEEDED, "x"))
    assert _whole_at_end(True, Err(SC.CANCELLED, "x"))
    assert not _whole_at_end(False, Err(SC.CANCELLED, "x"))
    assert not _whole_at_end(True, Err(SC.INTERNAL, "x"))
    answer = _Answer()
    answer.add(Chunk("a", [1]))
    answer.add(Chunk("b", [2], orchestrator_pb2.GenerateFinal(request_id="r")))
    r = answer.result()
    assert (r.text, r.token_ids, r.chunks, r.request_id, r.finish_reason) == (
        "ab", [1, 2], 2, "r", "FINISH_REASON_UNSPECIFIED")
