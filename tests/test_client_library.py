"""The Python client library against a scripted orchestrator on loopback (real gRPC)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tiercache.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from benchmarks.workload import Request, Workload, WorkloadSpec
from clients.python import replay as replay_mod
from clients.python.client import (
    RPC_CAP_DETAILS,
    Chunk,
    IncompleteStream,
    TierCacheClient,
    retry_later,
)
from tests.fake_orchestrator import serving
from tests.orchestrator.test_warm_loop import Err


class Scripted(orchestrator_pb2_grpc.OrchestratorServicer):
    """Generate answers by the last message's content: 'cut' ends without the final message,
    'busy' fails after one chunk (RESOURCE_EXHAUSTED marked overloaded), 'late' fails after
    one chunk at its deadline, 'big' answers 5 MiB of text, else a whole answer. Every call's
    method, request and metadata are kept in `calls`."""

    calls: list[tuple[str, object, dict[str, str]]] = []

    def _seen(self, method, request, context) -> None:
        self.calls.append((method, request, dict(context.invocation_metadata())))

    def Warm(self, request, context):  # noqa: N802
        self._seen("Warm", request, context)
        return orchestrator_pb2.WarmResponse()

    def Feedback(self, request, context):  # noqa: N802
        self._seen("Feedback", request, context)
        return orchestrator_pb2.FeedbackResponse()

    def EraseTenant(self, request, context):  # noqa: N802
        self._seen("EraseTenant", request, context)
        return orchestrator_pb2.EraseTenantResponse(semantic_entries_removed=3,
                                                    not_reached=["kvpool r1: UNAVAILABLE: x"])

    def Generate(self, request, context):  # noqa: N802
        self._seen("Generate", request, context)
        q = request.messages[-1].content if request.messages else request.prompt
        if q == "big":
            yield orchestrator_pb2.GenerateResponse(text="x" * (5 << 20))
        yield orchestrator_pb2.GenerateResponse(text="Partial ")
        if q == "cut":
            return
        if q == "late":
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline before the end")
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
    Scripted.calls = []
    with serving(Scripted(), 4) as port:
        yield f"127.0.0.1:{port}"


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


def test_a_ctrl_c_while_the_sessions_are_submitted_stops_those_already_submitted(monkeypatch):
    """A review (tests/test_replay_differential.py): the submits came before the handler, so
    a Ctrl-C among them left the sessions already submitted sending at their times, and
    their clients were never closed."""
    sent: list[str] = []

    class Client:
        closed = False

        def stream(self, messages, **kw):
            if self.closed:
                raise RuntimeError("TierCacheClient is closed: make a new one")
            sent.append(messages[-1]["content"])
            yield Chunk("ok", [], orchestrator_pb2.GenerateFinal())

        def close(self):
            self.closed = True

    class Pool(ThreadPoolExecutor):
        submitted = 0

        def submit(self, *a, **kw):
            if self.submitted == 2:  # the third session's submit: Ctrl-C
                raise KeyboardInterrupt
            self.submitted += 1
            return super().submit(*a, **kw)

    monkeypatch.setattr(replay_mod, "ThreadPoolExecutor", Pool)
    reqs = [Request(at=2.0 + i, tenant="t0", session_id=f"s{i}", system_index=0, turn=0,
                    question=f"q{i}?") for i in range(4)]
    client = Client()
    with pytest.raises(KeyboardInterrupt):
        replay_mod.replay(Workload(WorkloadSpec(), {"t0": ["be brief"]}, reqs),
                          {"t0": client}, concurrency=1, time_scale=0.25)
    # past the first two sessions' times (0.5 s, 0.75 s); they are 0.5 s away from the start,
    # room for a stalled main thread before the third submit
    time.sleep(1.0)
    assert sent == [] and client.closed


def test_a_status_before_the_final_message_is_raised_even_at_the_deadline(address):
    """Only a call ended at its deadline after its final message is whole: one cut at its
    deadline mid-answer raises, with the chunks that had arrived."""
    with TierCacheClient(address) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("late")
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert e.value.chunks_received == 1


def test_an_answer_larger_than_grpcs_4_mib_default_is_received(address):
    """The client's channel takes answers up to 16 MiB, as the services' channels do."""
    with TierCacheClient(address) as c:
        r = c.generate("big")
    assert len(r.text) == (5 << 20) + len("Partial ") and r.chunks == 3


def test_every_call_carries_the_bearer_token_and_a_request_id(address):
    """Generate, Warm, Feedback and EraseTenant each send `authorization: Bearer <token>` and an
    x-request-id (the caller's when given); Feedback sends the rating asked for."""
    with TierCacheClient(address, token=" tok-1 ") as c:
        c.generate("fine", request_id="r" * 128)
        c.warm("be brief", owners_only=True)
        c.feedback("entry-1", good=False)
        c.feedback("entry-2", good=True)
        erased = c.erase_tenant("acme")
    methods = [m for m, _, _ in Scripted.calls]
    assert methods == ["Generate", "Warm", "Feedback", "Feedback", "EraseTenant"]
    assert Scripted.calls[-1][1].tenant == "acme"
    assert (erased.semantic_entries_removed, list(erased.not_reached)) == (
        3, ["kvpool r1: UNAVAILABLE: x"])
    assert all(md["authorization"] == "Bearer tok-1" and md["x-request-id"]
               for _, _, md in Scripted.calls)
    assert Scripted.calls[0][2]["x-request-id"] == "r" * 128
    assert Scripted.calls[1][1].target == orchestrator_pb2.WARM_TARGET_OWNERS
    assert [req.rating for m, req, _ in Scripted.calls if m == "Feedback"] == [
        orchestrator_pb2.RATING_BAD, orchestrator_pb2.RATING_GOOD]


def test_a_request_id_past_128_characters_is_refused_before_the_call(address):
    with TierCacheClient(address) as c:
        with pytest.raises(ValueError, match="^request_id:"):
            c.generate("fine", request_id="r" * 129)
    assert Scripted.calls == []


def test_a_closed_client_has_released_its_channel(address):
    """close() closes the gRPC channel, not only the client's own flag."""
    c = TierCacheClient(address)
    c.close()
    with pytest.raises(ValueError, match="closed channel"):
        c.stub.Stats(orchestrator_pb2.StatsRequest(), timeout=5)


def test_a_bare_ipv6_address_is_refused_as_grpc_cannot_dial_it():
    """gRPC fails to dial fd00::5:50051 ("Misformatted domain name"); in brackets it is fine."""
    with pytest.raises(ValueError, match="^address:"):
        TierCacheClient("::1:50051")
    TierCacheClient("[::1]:50051").close()


@pytest.mark.parametrize("token", ["\ttok", " tok", "tok\n"])
def test_a_tokens_surrounding_whitespace_is_dropped_on_both_sides(token):
    c = TierCacheClient("127.0.0.1:1", token=token)
    c.close()
    assert c.token == "tok"


def test_a_token_with_del_is_refused_as_not_printable():
    """DEL (0x7f) is not printable ASCII: gRPC metadata cannot carry it."""
    with pytest.raises(ValueError, match="^token:"):
        TierCacheClient("127.0.0.1:1", token="tok\x7f")


def test_the_smallest_double_is_refused_as_it_rounds_to_0_in_float32():
    """5e-324 > 0 goes out as 0.0 (unset) like 1e-50."""
    with pytest.raises(ValueError, match="^top_p:"):
        TierCacheClient.build_request("hi", top_p=5e-324)


def test_a_bool_is_not_taken_as_a_sampling_number():
    with pytest.raises(TypeError, match="^temperature: must be a number"):
        TierCacheClient.build_request("hi", temperature=True)


def test_a_raw_string_is_sent_as_the_prompt_not_as_a_user_message():
    req = TierCacheClient.build_request("<|im_start|>user\nhi", raw=True)
    assert req.prompt == "<|im_start|>user\nhi" and not req.messages
    chat = TierCacheClient.build_request("hi")
    assert [(m.role, m.content) for m in chat.messages] == [("user", "hi")] and not chat.prompt


def test_warm_takes_a_list_of_messages_as_one_conversation():
    """[system, user] is one prompt of two messages, not two prompts."""
    sent = []
    c = TierCacheClient("127.0.0.1:1")
    try:
        c.stub.Warm = lambda req, **kw: sent.append(req)
        c.warm([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    finally:
        c.close()
    (p,) = sent[0].prompts
    assert [(m.role, m.content) for m in p.messages] == [("system", "s"), ("user", "u")]


BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED


def test_retry_later_only_for_busy_or_unavailable_refusals():
    """Busy = RESOURCE_EXHAUSTED with the overloaded trailer or gRPC's concurrent-call cap;
    another trailer, another code, or trailers that cannot be read are not worth retrying."""

    class Unreadable(Err):
        def trailing_metadata(self):
            raise RuntimeError("call not finished")

    assert retry_later(Err(BUSY, "queue full", [("tiercache-overloaded", "1")]))
    assert retry_later(Err(BUSY, RPC_CAP_DETAILS))
    assert not retry_later(Err(BUSY, "max_tokens: 900 exceeds the limit", [("other", "1")]))
    assert not retry_later(Err(grpc.StatusCode.PERMISSION_DENIED, "x",
                               [("tiercache-overloaded", "1")]))
    assert not retry_later(Unreadable(BUSY, "x"))



@pytest.mark.parametrize("timeout", [1e10, 1e300])
def test_a_timeout_past_what_grpc_can_carry_is_refused_not_expired_at_once(address, timeout):
    """A client differential (tests/test_client_differential.py): timeout=1e10, finite, was
    taken, and every call then failed at once with DEADLINE_EXCEEDED (gRPC's deadline past
    about 1e9 s), read as a slow server. The CLI's --timeout stops at 1e6 for this; so does
    the library now, naming it before any call."""
    with pytest.raises(ValueError, match=r"^timeout: .*1e6"):
        TierCacheClient(address, timeout=timeout)
    with TierCacheClient(address, timeout=1e6) as c:
        assert c.generate("fine").text == "Partial "
        with pytest.raises(ValueError, match=r"^timeout: .*1e6"):
            c.generate("fine", timeout=timeout)
    assert [m for m, _, _ in Scripted.calls] == ["Generate"]


@pytest.mark.parametrize("field,kw", [
    ("max_tokens", {"max_tokens": 2**31}), ("max_tokens", {"max_tokens": -1}),
    ("seed", {"seed": -1}), ("seed", {"seed": 2**64}),
    ("stop_token_ids", {"stop_token_ids": [5, -1]}),
    ("stop_token_ids", {"stop_token_ids": [2**32]})])
def test_an_integer_out_of_its_fields_range_is_refused_naming_the_field(address, field, kw):
    """protobuf refused these with "Value out of range: -1", naming no field (and took
    max_tokens=-1, for the server to refuse after a round trip); the library names the field
    before any call. The largest values each field carries still go out."""
    with TierCacheClient(address) as c:
        with pytest.raises(ValueError, match=rf"^{field}: must be in 0\.\."):
            c.generate("fine", **kw)
        assert not Scripted.calls
        req = c.build_request("x", max_tokens=2**31 - 1, seed=2**64 - 1,
                              stop_token_ids=[0, 2**32 - 1])
        assert (req.sampling.max_tokens, req.sampling.seed, list(req.sampling.stop_token_ids)
                ) == (2**31 - 1, 2**64 - 1, [0, 2**32 - 1])
        with pytest.raises(TypeError, match="^seed: must be an integer"):
            c.build_request("x", seed=1.5)
