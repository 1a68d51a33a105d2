"""The Python client library against a scripted orchestrator on loopback (real gRPC)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tiercache.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from benchmarks.workload import Request, Workload, WorkloadSpec
from clients.python import replay as replay_mod
from clients.python.client import Chunk, IncompleteStream, TierCacheClient, retry_later


class Scripted(orchestrator_pb2_grpc.OrchestratorServicer):
    """Generate answers by the last message's content: 'cut' ends without the final message,
    'busy' fails after one chunk (RESOURCE_EXHAUSTED marked overloaded), else a whole answer."""

    def Generate(self, request, context):  # noqa: N802
        q = request.messages[-1].content if request.messages else request.prompt
        yield orchestrator_pb2.GenerateResponse(text="Partial ")
        if q == "cut":
            return
        if q == "busy":
            context.set_trailing_metadata((("tiercache-overloaded", "1"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "every replica is busy")
        yield orchestrator_pb2.GenerateResponse(final=orchestrator_pb2.GenerateFinal())
        if q == "final then error":
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "ended at the deadline")
        if q == "final then internal":
            context.abort(grpc.StatusCode.INTERNAL, "something the server meant")


@pytest.fixture
def address():
    server = grpc.server(ThreadPoolExecutor(4))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Scripted(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_a_stream_without_its_final_message_raises_for_every_caller(address):
    """stream() ended quietly on a cut answer: only generate(), the CLI and replay checked."""
    with TierCacheClient(address) as c:
        got: list[Chunk] = []
        with pytest.raises(IncompleteStream):
            for ch in c.stream("cut"):
                got.append(ch)
        assert [ch.text for ch in got] == ["Partial "]
        with pytest.raises(IncompleteStream):
            c.generate("cut")
        assert c.generate("fine").text == "Partial "


def test_a_status_after_the_final_message_leaves_the_answer_whole(address):
    """A server that ends a call at its deadline may cut one that finished that moment: the
    final message was in, and the client raised all the same."""
    with TierCacheClient(address) as c:
        assert c.generate("final then error").text == "Partial "
        with pytest.raises(grpc.RpcError) as e:  # any other status is the server's to say
            c.generate("final then internal")
        assert e.value.code() == grpc.StatusCode.INTERNAL


def test_retry_later_is_false_once_part_of_the_answer_arrived(address):
    """A busy error after text had been streamed said 'retry': the text came twice."""
    with TierCacheClient(address) as c:
        with pytest.raises(grpc.RpcError) as e:
            for _ in c.stream("busy"):
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.chunks_received == 1 and not retry_later(e.value)
        e.value.chunks_received = 0  # the same error before any text: retry later
        assert retry_later(e.value)


def test_bad_tokens_request_ids_and_timeouts_are_named_before_any_call(address):
    """gRPC's INTERNAL "Invalid metadata" named no field; timeout=0 became the 300 s default."""
    assert TierCacheClient(address, token="s3cret\n").token == "s3cret"  # a secret file's
    # Inner spaces: the server's tokens file allows them, and gRPC metadata carries them.
    assert TierCacheClient(address, token="team secret 1").token == "team secret 1"
    with pytest.raises(ValueError, match="^token:"):
        TierCacheClient(address, token="tök")
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="^timeout:"):
            TierCacheClient(address, timeout=bad)
    with TierCacheClient(address) as c:
        with pytest.raises(ValueError, match="^request_id:"):
            c.generate("fine", request_id="a\nb")
        with pytest.raises(ValueError, match="^timeout:"):
            c.generate("fine", timeout=0)
        # One message given as a dict, not a list of them.
        assert c.generate({"role": "user", "content": "fine"}).text == "Partial "


def test_an_address_gRPC_would_misread_and_a_closed_client_are_named(address):
    """A client review: "localhost:99999" was dialed as port 34463 and "localhost" as 443,
    each UNAVAILABLE, which retry_later calls worth retrying, for good; a call after close()
    raised gRPC's "ValueError: Cannot invoke RPC: Channel closed!"."""
    for bad in ("localhost:99999", "localhost", "http://h:1", ""):
        with pytest.raises(ValueError, match="^address:"):
            TierCacheClient(bad)
    c = TierCacheClient(f" {address} ")
    assert c.generate("fine").text == "Partial "
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.generate("fine")
    with pytest.raises(RuntimeError, match="closed"):
        with c:
            pass


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", float("nan")), ("temperature", 1e39), ("temperature", 1e-50),
    ("temperature", -0.5), ("top_p", 1e-50), ("top_p", float("nan")), ("top_p", -0.1),
    ("top_p", 1.5)])
def test_sampling_values_float32_changes_are_refused_naming_the_field(field, value):
    """The fields are float32 on the wire: top_p=1e-50 went out as 0 (unset = full sampling,
    not the narrowest nucleus), temperature=1e39 as inf (refused by the server as "got inf"),
    and nan built without a word."""
    with pytest.raises(ValueError, match=f"^{field}:"):
        TierCacheClient.build_request("hi", **{field: value})


def test_sampling_values_float32_can_carry_are_sent():
    req = TierCacheClient.build_request("hi", temperature=0.8, top_p=1e-40)
    assert req.sampling.temperature == pytest.approx(0.8) and req.sampling.top_p > 0
    req = TierCacheClient.build_request("hi", temperature=3e38, top_p=1)
    assert req.sampling.temperature == pytest.approx(3e38) and req.sampling.top_p == 1.0
    assert TierCacheClient.build_request("hi").sampling.temperature == 0.0  # greedy default


def test_replay_sends_each_turn_at_its_own_time():
    """Only a session's first turn waited for its time: later turns went out at once."""
    sent: list[float] = []

    class Client:
        def stream(self, messages, **kw):
            sent.append(time.monotonic())
            yield Chunk("ok", [], orchestrator_pb2.GenerateFinal())

    reqs = [Request(at=at, tenant="t0", session_id="s", system_index=0, turn=t,
                    question=f"q{t}?") for t, at in enumerate((0.0, 5.0, 10.0))]
    t0 = time.monotonic()
    replay_mod.replay(Workload(WorkloadSpec(), {"t0": ["be brief"]}, reqs), {"t0": Client()},
                      concurrency=1, time_scale=0.05)
    offsets = [s - t0 for s in sent]
    assert offsets[1] >= 0.24 and offsets[2] >= 0.49, offsets


def test_a_timed_replay_starts_every_session_on_time_with_more_sessions_than_concurrency():
    """Sessions waited between turns inside 2 x concurrency workers: later ones started late
    and sent their overdue turns back to back."""
    sent: dict[str, list[float]] = {}

    class Client:
        def stream(self, messages, **kw):
            sent.setdefault(kw["session_id"], []).append(time.monotonic())
            yield Chunk("ok", [], orchestrator_pb2.GenerateFinal())

    reqs = [Request(at=at + s * 0.01, tenant="t0", session_id=f"s{s}", system_index=0,
                    turn=t, question=f"q{s}.{t}?")
            for s in range(8) for t, at in enumerate((0.0, 10.0))]
    t0 = time.monotonic()
    replay_mod.replay(Workload(WorkloadSpec(), {"t0": ["be brief"]}, reqs), {"t0": Client()},
                      concurrency=1, time_scale=0.05)
    firsts = sorted(times[0] - t0 for times in sent.values())
    assert len(firsts) == 8 and firsts[-1] < 0.3, firsts  # all near 0, not after the gaps


def test_a_turn_that_raises_anything_is_recorded_not_the_end_of_the_replay():
    class Client:
        def stream(self, messages, **kw):
            if messages[-1]["content"] == "q1?":
                raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
            yield Chunk("ok", [], orchestrator_pb2.GenerateFinal())

    reqs = [Request(at=0.0, tenant="t0", session_id=f"s{i}", system_index=0, turn=0,
                    question=f"q{i}?") for i in range(3)]
    out = replay_mod.replay(Workload(WorkloadSpec(), {"t0": ["be brief"]}, reqs),
                            {"t0": Client()}, concurrency=1)
    assert sorted(o.error.split(":")[0] for o in out) == ["", "", "UnicodeEncodeError"]


def test_a_replay_whose_progress_reader_is_gone_stops_sending():
    """A client review: `replay ... | head -1`: the worker whose progress line met the broken
    pipe died alone, and the others went on sending (12 requests after head had exited)."""
    sent: list[str] = []

    class Client:
        def stream(self, messages, **kw):
            sent.append(messages[-1]["content"])
            time.sleep(0.02)
            yield Chunk("ok", [], orchestrator_pb2.GenerateFinal())

        def close(self):
            pass

    def progress(done, total):
        raise BrokenPipeError(32, "Broken pipe")

    reqs = [Request(at=0.0, tenant="t0", session_id=f"s{i}", system_index=0, turn=0,
                    question=f"q{i}?") for i in range(16)]
    with pytest.raises(BrokenPipeError):
        replay_mod.replay(Workload(WorkloadSpec(), {"t0": ["be brief"]}, reqs),
                          {"t0": Client()}, concurrency=1, progress=progress)
    time.sleep(0.3)
    assert len(sent) <= 4, sent  # the workers in flight at most, not all 16
