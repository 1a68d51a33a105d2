"""Rules of the Python client library's request building: a message of the wrong shape is a
TypeError naming it, before anything is sent."""

from __future__ import annotations

import grpc
import pytest

from clients.python.client import TierCacheClient
from tests.waits import holds_within


@pytest.mark.parametrize(("messages", "said"), [
    ([{"role": "user"}], "messages[0]: no 'content'"),
    ([{"content": "hi"}], "messages[0]: no 'role'"),
    ([{"role": "user", "content": 5}], "messages[0].content: a string, not int"),
    (["hi"], "messages[0]: a {'role', 'content'} dict, not 'hi'"),
    ([{"role": "user", "content": "a"}, ("user", "b")], "messages[1]: a {'role', 'content'}"),
    (None, "messages: a string (the question) or a list of"),
])
def test_a_message_of_the_wrong_shape_is_a_type_error_naming_it(messages, said):
    """A missing content was a bare KeyError 'content', a number there protobuf's "bad
    argument type for built-in operation", a string for the dict "string indices must be
    integers": none named the message."""
    with pytest.raises(TypeError) as e:
        TierCacheClient.build_request(messages)
    assert str(e.value).startswith(said)


def test_well_formed_messages_still_build_as_before():
    req = TierCacheClient.build_request(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q", "name": "x"}])
    assert [(m.role, m.content) for m in req.messages] == [("system", "s"), ("user", "q")]
    assert [(m.role, m.content) for m in TierCacheClient.build_request("q").messages] == [
        ("user", "q")]


def test_a_warm_prompt_message_of_the_wrong_shape_names_its_prompt_and_message():
    c = TierCacheClient("localhost:1")
    try:
        with pytest.raises(TypeError, match=r"^prompts\[1\]\.messages\[0\]: no 'content'"):
            c.warm(["system prompt", [{"role": "system"}]])
    finally:
        c.close()


def test_stream_refuses_a_bad_argument_and_a_closed_client_at_the_call():
    """stream() is a generator: a bad value, or a closed client, was raised only at the first
    next(), past an application's try around the stream() call itself."""
    c = TierCacheClient("localhost:1")
    with pytest.raises(ValueError, match="^temperature:"):
        c.stream("q", temperature=-1)
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.stream("q")


def test_stream_sends_nothing_until_read():
    """The call starts at the first next(): one never read would have generated to its
    deadline (a generator never started runs no finally, so nothing would cancel it)."""
    c = TierCacheClient("localhost:1")
    try:
        calls = []
        c.stub = type("Stub", (), {"Generate": lambda self, *a, **k: calls.append(a)})()
        c.stream("q")
        assert calls == []
    finally:
        c.close()


@pytest.mark.parametrize(("kw", "said"), [
    ({"top_k": -1}, "^top_k: must be in 0..4294967295, got -1"),
    ({"pin_ttl_seconds": -1}, "^pin_ttl_seconds: must be in 0..4294967295, got -1"),
    ({"top_k": "8"}, "^top_k: must be an integer, got str"),
])
def test_warm_names_a_count_out_of_its_range(kw, said):
    """protobuf's own refusal said "Value out of range: -1", naming no field."""
    c = TierCacheClient("localhost:1")
    try:
        with pytest.raises((ValueError, TypeError), match=said):
            c.warm("a system prompt", **kw)
    finally:
        c.close()


@pytest.mark.parametrize("good", ["bad", "no", 0, None])
def test_feedback_takes_only_a_bool_as_the_rating(good):
    """feedback(entry, "bad") was truth-tested: it marked a wrong answer verified."""
    c = TierCacheClient("localhost:1")
    try:
        with pytest.raises(TypeError, match="^good: True"):
            c.feedback("entry", good)
    finally:
        c.close()


@pytest.mark.parametrize(("kw", "said"), [
    ({"timeout": "5"}, "^timeout: a number of seconds, not str"),
    ({"request_id": 5}, "^request_id: a string, not int"),
    ({"session_id": 5}, "^session_id: a string, not int"),
    ({"stop_token_ids": 5}, "^stop_token_ids: a list of token ids, not int"),
    ({"cache_policy": {"skip_prefix_cache": True}}, "^cache_policy: a tiercache.v1.common_pb2"),
])
def test_an_argument_of_the_wrong_type_is_named(kw, said):
    """protobuf's "bad argument type for built-in operation", "'<' not supported between
    instances of 'int' and 'str'" or "'int' object is not iterable" named no argument."""
    c = TierCacheClient("localhost:1")
    try:
        with pytest.raises(TypeError, match=said):
            c.stream("q", **kw)
    finally:
        c.close()


def test_a_client_given_a_token_or_timeout_of_the_wrong_type_says_which():
    with pytest.raises(TypeError, match="^token: a string, not int"):
        TierCacheClient("localhost:1", token=123)
    for bad in ("5", None, True):
        with pytest.raises(TypeError, match="^timeout: a number of seconds"):
            TierCacheClient("localhost:1", timeout=bad)


def test_stop_token_ids_may_be_any_iterable_of_ids():
    req = TierCacheClient.build_request("q", stop_token_ids=iter([7, 9]))
    assert list(req.sampling.stop_token_ids) == [7, 9]


class _HangingCall:
    """A Generate call that yields one chunk, then waits until cancelled (CANCELLED)."""

    def __init__(self) -> None:
        import threading

        self.cancelled = threading.Event()
        self.waiting = threading.Event()

    def __iter__(self):
        import grpc
        from tiercache.v1 import orchestrator_pb2

        yield orchestrator_pb2.GenerateResponse(text="a")
        self.waiting.set()
        assert self.cancelled.wait(10)

        class Cancelled(grpc.RpcError):
            def code(self):
                return grpc.StatusCode.CANCELLED

        raise Cancelled()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def _hanging_client():
    c = TierCacheClient("localhost:1")
    calls: list[_HangingCall] = []

    def generate(self, *a, **k):
        calls.append(_HangingCall())
        return calls[-1]

    c.stub = type("Stub", (), {"Generate": generate})()
    return c, calls


def test_a_stream_is_cancelled_from_another_thread_while_its_reader_waits():
    """A live walkthrough: a user's cancel from another thread could not stop a stream
    (close() raised "generator already executing" while the reader waited, and the answer ran
    to its end). ChunkStream.cancel ends the call; the reader gets CANCELLED, with the chunks
    it had."""
    import threading

    import grpc

    c, calls = _hanging_client()
    try:
        s = c.stream("q")
        got: list = []

        def read() -> None:
            try:
                for ch in s:
                    got.append(ch.text)
            except grpc.RpcError as e:
                got.append((e.code(), e.chunks_received))

        t = threading.Thread(target=read)
        t.start()
        holds_within(lambda: calls, 10, 0.01)  # bounded: a reader that died fails, not hangs
        assert calls and calls[0].waiting.wait(10)
        s.cancel()
        t.join(10)
        assert not t.is_alive()
        assert got == ["a", (grpc.StatusCode.CANCELLED, 1)]
        # Before the first next(): the call is cancelled as it starts.
        early = c.stream("q")
        early.cancel()
        with pytest.raises(grpc.RpcError):
            list(early)
        assert calls[1].cancelled.is_set()
    finally:
        c.close()


@pytest.mark.parametrize("make", ["TierCacheClient", "AsyncTierCacheClient"])
def test_a_client_sent_to_another_process_is_refused_by_name(make):
    """A client passed to a multiprocessing "spawn" pool's task: the sync one's pickling
    failed "no default __reduce__ due to non-trivial __cinit__" (its channel), naming
    neither; an AsyncTierCacheClient not yet called was copied, channel options and all."""
    import copy
    import pickle

    from clients.python.aio import AsyncTierCacheClient

    c = {"TierCacheClient": TierCacheClient, "AsyncTierCacheClient": AsyncTierCacheClient}[
        make]("localhost:1")
    for send in (pickle.dumps, copy.copy):
        with pytest.raises(TypeError, match=f"^{make} cannot be pickled .*make one in each "
                                            "process, from its address and token"):
            send(c)


def test_a_stream_left_by_an_exception_from_its_with_block_is_cancelled():
    """A live walkthrough: a Ctrl-C in the body of the loop over a stream kept in a variable
    left its call generating until the process exited (the orchestrator logged the
    CANCELLED 6 s later, at the exit), and ChunkStream had no `with`. Leaving
    `with c.stream(...) as s:` by any exception now cancels the call."""
    c, calls = _hanging_client()
    try:
        with pytest.raises(KeyboardInterrupt), c.stream("q") as s:
            for _ in s:
                raise KeyboardInterrupt
        assert calls[0].cancelled.is_set()
        with c.stream("q") as never_read:  # left before the first next(): nothing is sent
            pass
        assert len(calls) == 1 and list(never_read) == []
    finally:
        c.close()


@pytest.mark.parametrize(("args", "kw", "said"), [
    (("caf\udce9?",), {}, "messages: not valid Unicode: a lone surrogate at character 3"),
    (("x\ud800",), {"raw": True}, "messages: not valid Unicode"),
    (([{"role": "system", "content": "s"}, {"role": "user", "content": "\ud83d!"}],), {},
     "messages[1].content: not valid Unicode: a lone surrogate at character 0"),
    (([{"role": "us\udcffer", "content": "hi"}],), {}, "messages[0].role: not valid Unicode"),
    (("hi",), {"session_id": "s\ud800"}, "session_id: not valid Unicode"),
])
def test_a_lone_surrogate_is_a_value_error_naming_its_field(args, kw, said):
    """A str protobuf cannot encode (a trace's JSON "\\ud83d", a surrogateescape'd byte) was
    protobuf's UnicodeEncodeError ("position 0: surrogates not allowed"), naming no field;
    replay reported it so for every turn."""
    with pytest.raises(ValueError) as e:
        TierCacheClient.build_request(*args, **kw)
    assert str(e.value).startswith(said)
    assert not isinstance(e.value, UnicodeError)
    # Text outside the BMP, written properly, still builds.
    req = TierCacheClient.build_request("🇯🇵 👨\u200d👩\u200d👧 \U0010ffff", session_id="s😀")
    assert req.messages[0].content.startswith("🇯🇵")


def test_a_warm_prompt_with_a_lone_surrogate_names_it():
    c = TierCacheClient("localhost:1")
    try:
        with pytest.raises(ValueError, match=r"^prompts\[1\]: not valid Unicode"):
            c.warm(["fine", "bad \udc80"])
    finally:
        c.close()


class _Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return "refused"


def test_a_failed_call_names_the_request_id_it_was_sent_with():
    """The RpcError of a failed stream, Warm, Feedback or Stats carries `request_id`, the
    x-request-id sent (the caller's or one made up): a made-up one was never shown, so a
    failed call had no id to trace in the servers' logs."""
    c = TierCacheClient("localhost:1")
    sent: list[str] = []

    def refuse(_req, timeout=None, metadata=()):
        sent.append(dict(metadata)["x-request-id"])
        raise _Refused()

    class Call:  # what gRPC's Generate returns: the error comes from reading it
        def __init__(self, _req, timeout=None, metadata=()):
            self.metadata = metadata

        def __iter__(self):
            refuse(None, metadata=self.metadata)

        def cancel(self) -> bool:
            return True

    c.stub = type("Stub", (), {"Generate": staticmethod(Call), "Warm": staticmethod(refuse),
                               "Feedback": staticmethod(refuse),
                               "Stats": staticmethod(refuse),
                               "EraseTenant": staticmethod(refuse)})()
    with pytest.raises(grpc.RpcError) as e:
        list(c.stream("hi", request_id="mine-1"))
    assert e.value.request_id == "mine-1"
    with pytest.raises(grpc.RpcError) as e:
        c.warm("system", request_id="mine-2")
    assert e.value.request_id == "mine-2"
    with pytest.raises(grpc.RpcError) as e:
        c.feedback("entry", good=True)
    assert e.value.request_id == sent[-1] and sent[-1]
    with pytest.raises(grpc.RpcError) as e:
        c.stats()
    assert e.value.request_id == sent[-1] and sent[-2] != sent[-1]
    with pytest.raises(grpc.RpcError) as e:
        c.erase_tenant("acme")
    assert e.value.request_id == sent[-1] and sent[-2] != sent[-1]
    c.close()


def test_a_client_made_before_a_fork_refuses_calls_in_the_child(monkeypatch):
    """A live walkthrough (gunicorn --preload): a client made in the master and used in a
    forked worker failed UNAVAILABLE "Wrong file descriptor generation" (retry_later: True),
    or went through, by luck; gRPC channels do not survive a fork. Now a RuntimeError saying
    so, before anything is sent, in the child only."""
    import os

    from clients.python import client as client_mod

    c = TierCacheClient("localhost:1")
    try:
        parent = os.getpid()
        monkeypatch.setattr(client_mod.os, "getpid", lambda: parent + 1)  # the forked child
        calls = [lambda: c.stream("q"), lambda: c.warm("system"), lambda: c.stats(),
                 lambda: c.feedback("entry", True), lambda: c.__enter__()]
        for call in calls:
            with pytest.raises(RuntimeError, match=f"made in process {parent}, before a fork"):
                call()
        monkeypatch.undo()
        sent: list = []
        c.stub = type("Stub", (), {"Stats": lambda self, *a, **k: sent.append(a)})()
        c.stats()  # the process that made it still calls
        assert len(sent) == 1
    finally:
        c.close()


@pytest.mark.parametrize(("entry", "error", "said"), [
    (123, TypeError, "^semantic_entry_id: a string, not int"),
    (None, TypeError, "^semantic_entry_id: a string, not NoneType"),
    ("e\ud800", ValueError, "^semantic_entry_id: not valid Unicode"),
])
def test_feedback_names_an_entry_id_that_is_no_string(entry, error, said):
    """feedback(123, True) was protobuf's "bad argument type for built-in operation"."""
    c = TierCacheClient("localhost:1")
    try:
        with pytest.raises(error, match=said):
            c.feedback(entry, True)
    finally:
        c.close()


@pytest.mark.parametrize(("tenant", "error", "said"), [
    ("", ValueError, "^tenant: required"),
    ("  ", ValueError, "^tenant: required"),
    (None, TypeError, "^tenant: a string, not NoneType"),
    ("a\ud800", ValueError, "^tenant: not valid Unicode"),
])
def test_erase_tenant_names_a_missing_or_bad_tenant_before_any_call(tenant, error, said):
    """Refused here, naming the argument: nothing is sent (no server, no stub call)."""
    c = TierCacheClient("localhost:1")
    c.stub = None  # any call would be an AttributeError
    try:
        with pytest.raises(error, match=said):
            c.erase_tenant(tenant)
    finally:
        c.close()
