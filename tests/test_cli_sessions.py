"""The CLI's sessions and trace replay when the server or the user misbehaves (fake clients
stand in for the server: pure client logic)."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from tiercache.v1 import common_pb2, orchestrator_pb2

from benchmarks.workload import Request, Workload, WorkloadSpec
from clients.python import cli
from clients.python import replay as replay_mod
from clients.python.client import Chunk
from tests.test_cli_input import FakeClient


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "TierCacheClient", FakeClient)
    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path / "home"))
    return tmp_path


def _final() -> Chunk:
    return Chunk("", [], orchestrator_pb2.GenerateFinal(
        finish_reason=common_pb2.FINISH_REASON_EOS, cache_report=common_pb2.CacheReport()))


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


def test_a_stream_without_its_final_message_is_an_error_and_not_saved(fake, monkeypatch,
                                                                       capsys):
    """A proxy cutting the stream with status OK: chat printed the partial answer, exited 0
    and saved it as the assistant's turn (the library's generate refuses the same stream)."""
    assert cli.main(["chat", "-q", "--session", "s", "hi"]) == 0

    def cut(self, messages, **kw):
        yield Chunk("Partial ans", [])

    monkeypatch.setattr(FakeClient, "stream", cut)
    assert cli.main(["chat", "-q", "--session", "s", "more"]) == 1
    assert "without a final message" in capsys.readouterr().err
    saved = json.loads((fake / "home" / "sessions" / "s.json").read_text())
    assert [m["content"] for m in saved] == ["hi", "Hello."]


def test_a_failed_new_turn_says_the_old_session_is_kept(fake, monkeypatch, capsys):
    """`--new` whose turn fails leaves the saved turns (nothing replaced them), so a next turn
    without --new continues the old session: chat now says so. It said only the error."""
    assert cli.main(["chat", "-q", "--session", "s", "hi"]) == 0

    def refused(self, messages, **kw):
        raise Refusal(grpc.StatusCode.UNAVAILABLE, "no replica")
        yield  # a generator, as the real stream

    monkeypatch.setattr(FakeClient, "stream", refused)
    capsys.readouterr()
    assert cli.main(["chat", "-q", "--session", "s", "--new", "again"]) == 75  # retry later
    err = capsys.readouterr().err
    assert "'s' was not started over" in err and "no replica" in err
    saved = json.loads((fake / "home" / "sessions" / "s.json").read_text())
    assert [m["content"] for m in saved] == ["hi", "Hello."]
    cli.main(["chat", "-q", "--session", "t", "--new", "first"])  # no session yet: no note
    assert "started over" not in capsys.readouterr().err

    def cut(self, messages, **kw):
        yield Chunk("Partial ans", [])

    monkeypatch.setattr(FakeClient, "stream", cut)
    assert cli.main(["chat", "-q", "--session", "s", "--new", "again"]) == 1
    assert "'s' was not started over" in capsys.readouterr().err

    def interrupted(self, messages, **kw):
        yield Chunk("Partial ans", [])
        raise KeyboardInterrupt

    monkeypatch.setattr(FakeClient, "stream", interrupted)
    assert cli.main(["chat", "-q", "--session", "s", "--new", "again"]) == 130
    assert "'s' was not started over" in capsys.readouterr().err  # Ctrl-C said nothing

    def silent(self, messages, **kw):
        yield _final()  # answered, with no text: nothing saved

    monkeypatch.setattr(FakeClient, "stream", silent)
    assert cli.main(["chat", "-q", "--session", "s", "--new", "again"]) == 0
    assert "'s' was not started over" in capsys.readouterr().err
    saved = json.loads((fake / "home" / "sessions" / "s.json").read_text())
    assert [m["content"] for m in saved] == ["hi", "Hello."]


def test_two_turns_of_one_session_at_once_both_stay_in_its_history(fake, monkeypatch):
    """Each turn loaded the history, streamed, and saved its own version over the other's:
    one turn was lost, both exited 0. The second now waits for the first."""
    streaming, release = threading.Event(), threading.Event()
    seen: list[list[str]] = []

    def stream(self, messages, **kw):
        seen.append([m["content"] for m in messages])
        if messages[-1]["content"] == "first":
            streaming.set()
            release.wait(10)
        yield Chunk("ans-" + messages[-1]["content"], [])
        yield _final()

    monkeypatch.setattr(FakeClient, "stream", stream)
    rcs: list[int] = []
    a = threading.Thread(target=lambda: rcs.append(cli.main(["chat", "-q", "--session", "s",
                                                             "first"])))
    a.start()
    assert streaming.wait(10)
    b = threading.Thread(target=lambda: rcs.append(cli.main(["chat", "-q", "--session", "s",
                                                             "second"])))
    b.start()
    time.sleep(0.3)
    assert len(seen) == 1  # the second turn waits for the first
    release.set()
    a.join(10)
    b.join(10)
    assert rcs == [0, 0]
    assert seen[1] == ["first", "ans-first", "second"]
    saved = json.loads((fake / "home" / "sessions" / "s.json").read_text())
    assert [m["content"] for m in saved] == ["first", "ans-first", "second", "ans-second"]


@pytest.mark.parametrize(("code", "details"), [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "messages: 5000 tokens exceed tenant limit 4096"),
    (grpc.StatusCode.INVALID_ARGUMENT,
     "messages: 90000 characters cannot fit in the limit of 8192 prompt tokens"),
])
def test_every_refusal_of_the_sessions_length_says_how_to_go_on(fake, monkeypatch, capsys,
                                                                 code, details):
    assert cli.main(["chat", "-q", "--session", "long", "hi"]) == 0

    def refuse(self, messages, **kw):
        raise Refusal(code, details)
        yield

    monkeypatch.setattr(FakeClient, "stream", refuse)
    assert cli.main(["chat", "-q", "--session", "long", "and then?"]) == 1
    assert "grown too long" in capsys.readouterr().err


def _workload(sessions: int = 2, turns: int = 3) -> Workload:
    reqs = [Request(at=0.0, tenant="t0", session_id=f"s{s}", system_index=0, turn=t,
                    question=f"q{s}.{t}?") for s in range(sessions) for t in range(turns)]
    return Workload(WorkloadSpec(), {"t0": ["be brief"]}, reqs)


class ReplayClient:
    """Answers each question; `fail` names questions refused mid-answer."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.fail = fail
        self.sent: list[list[dict[str, str]]] = []
        self.closed = threading.Event()

    def stream(self, messages, **kw):
        self.sent.append(messages)
        q = messages[-1]["content"]
        yield Chunk("Partial ", [])
        if q in self.fail:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "replica lost")
        yield Chunk("answer", [])
        yield _final()

    def close(self) -> None:
        self.closed.set()


def test_a_failed_turn_ends_its_session_instead_of_entering_its_history():
    """After a failed turn, the next turns were sent with its partial answer (or a made-up
    "ok") as the assistant's reply: figures of a conversation that never happened."""
    client = ReplayClient(fail=("q0.1?",))
    out = replay_mod.replay(_workload(), {"t0": client}, concurrency=1)
    assert len(out) == 6
    assert not any(m["content"].startswith("Partial") and m["role"] == "assistant"
                   and not m["content"].endswith("answer") for msgs in client.sent for m in msgs)
    assert [m[-1]["content"] for m in client.sent].count("q0.2?") == 0
    errs = {(o.session_id, o.turn): o.error for o in out if o.error}
    assert errs[("s0", 1)].startswith("UNAVAILABLE") and errs[("s0", 2)].startswith("skipped")
    assert len(errs) == 2


def test_a_stream_without_its_final_message_is_a_replay_error():
    class Cut(ReplayClient):
        def stream(self, messages, **kw):
            self.sent.append(messages)
            yield Chunk("Partial", [])

    out = replay_mod.replay(_workload(1, 2), {"t0": Cut()}, concurrency=1)
    assert [o.error for o in out] == ["stream ended without a final message",
                                      "skipped: turn 0 of the session failed"]


def test_an_empty_answer_ends_its_session_without_a_made_up_turn():
    """An empty answer was sent back as the assistant's "ok" in the next turns' history."""
    class Silent(ReplayClient):
        def stream(self, messages, **kw):
            self.sent.append(messages)
            yield _final()

    client = Silent()
    out = replay_mod.replay(_workload(1, 3), {"t0": client}, concurrency=1)
    assert len(client.sent) == 1  # nothing sent after the empty answer
    assert [o.error for o in out] == ["", "skipped: turn 0 of the session answered nothing",
                                      "skipped: turn 0 of the session answered nothing"]


def test_ctrl_c_sends_nothing_more_and_cancels_the_calls_in_flight(monkeypatch):
    """Ctrl-C cancelled only the sessions not yet started; the running ones went on through
    all their turns, sending new requests after it."""
    started = threading.Event()

    class Slow(ReplayClient):
        def stream(self, messages, **kw):
            self.sent.append(messages)
            started.set()
            if self.closed.wait(10):  # a closed channel cancels the call
                raise Refusal(grpc.StatusCode.CANCELLED, "channel closed")
            yield _final()

    client = Slow()

    def interrupted(futures, return_when=None):
        assert started.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(replay_mod, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        replay_mod.replay(_workload(4, 3), {"t0": client}, concurrency=2)
    assert client.closed.is_set()
    time.sleep(0.5)  # the cancelled sessions would have sent their next turns by now
    assert len(client.sent) <= 2


def test_a_trace_naming_a_tenant_its_header_lacks_is_refused_before_sending(fake, capsys):
    trace = fake / "t.jsonl"
    lines = [json.dumps({"spec": {}, "system_prompts": {"t0": ["x"]}}),
             json.dumps(dict(at=0.0, tenant="t0", session_id="a", system_index=0, turn=0,
                             question="q?")),
             json.dumps(dict(at=0.0, tenant="t1", session_id="b", system_index=0, turn=0,
                             question="q?"))]
    trace.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match="request 2 names tenant 't1'"):
        cli.main(["replay", str(trace)])


def test_an_answer_is_saved_as_generated_not_stripped(fake, monkeypatch):
    """A session saved its answers stripped: an answer ending in a newline no longer rendered
    into the next turn's prompt as the tokens the replica had cached for it, so the rest of
    the conversation was computed again. A whitespace-only answer is still not saved."""
    def answers(text):
        def stream(self, messages, **kw):
            yield Chunk(text, [])
            yield _final()
        return stream

    monkeypatch.setattr(FakeClient, "stream", answers(" Paris.\n"))
    assert cli.main(["chat", "-q", "--session", "s", "capital?"]) == 0
    monkeypatch.setattr(FakeClient, "stream", answers(" \n"))
    assert cli.main(["chat", "-q", "--session", "s", "again?"]) == 0
    saved = json.loads((fake / "home" / "sessions" / "s.json").read_text())
    assert [m["content"] for m in saved] == ["capital?", " Paris.\n"]


def test_an_answer_of_only_invisible_characters_is_not_saved_nor_sent_back(fake, monkeypatch,
                                                                            capsys):
    """The orchestrator refuses a message of only zero-width, format or control characters as
    empty (an assistant turn too): a session that saved such an answer, or a replayed session
    that sent it back, had every later turn refused INVALID_ARGUMENT. Answered nothing, as an
    answer of only whitespace is."""
    assert cli.main(["chat", "-q", "--session", "s", "hi"]) == 0

    def invisible(self, messages, **kw):
        yield Chunk("\u200b\u2060\n", [])
        yield _final()

    monkeypatch.setattr(FakeClient, "stream", invisible)
    capsys.readouterr()
    assert cli.main(["chat", "-q", "--session", "s", "more"]) == 0
    assert "empty answer: session 's' left unchanged" in capsys.readouterr().err
    saved = json.loads((fake / "home" / "sessions" / "s.json").read_text())
    assert [m["content"] for m in saved] == ["hi", "Hello."]

    class Invisible(ReplayClient):
        def stream(self, messages, **kw):
            self.sent.append(messages)
            yield Chunk("\ufeff\u200b", [])
            yield _final()

    client = Invisible()
    out = replay_mod.replay(_workload(1, 2), {"t0": client}, concurrency=1)
    assert len(client.sent) == 1
    assert [o.error for o in out] == ["", "skipped: turn 0 of the session answered nothing"]
