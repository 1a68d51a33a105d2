"""The CLI on input a user can give it by mistake: every case ends with a message and an exit
status, never a traceback (a fake client stands in for the server: pure client logic)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from tiercache.v1 import common_pb2, orchestrator_pb2

from clients.python import cli
from clients.python.client import Chunk

ROOT = Path(__file__).resolve().parent.parent


class FakeClient:
    """Streams `pieces`, then a final message."""

    pieces = ["Hel", "lo."]

    def __init__(self, *a, **kw) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self) -> None:
        pass

    def stream(self, messages, **kw):
        for p in self.pieces:
            yield Chunk(p, [])
        yield Chunk("", [], orchestrator_pb2.GenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_EOS, cache_report=common_pb2.CacheReport()))


class Refusal(grpc.RpcError):
    """The server refusing a request (INVALID_ARGUMENT) with `details`."""

    def __init__(self, details):
        self._d = details

    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return self._d


def refuse_with(details):
    """A FakeClient.stream that the server refuses with `details`."""
    def refuse(self, messages, **kw):
        raise Refusal(details)
        yield  # a generator, as the client's stream is
    return refuse


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "TierCacheClient", FakeClient)
    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path / "home"))
    return tmp_path


@pytest.mark.parametrize("name", ["../../escaped", "a/b", "a\\b", ".hidden", "x" * 201,
                                  "é" * 101, "nul\0"])
def test_session_names_that_are_not_plain_file_names_are_refused(fake, capsys, name):
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", "--session", name, "hi"])
    assert e.value.code == 2 and "--session" in capsys.readouterr().err
    assert not (fake / "escaped.json").exists()


@pytest.mark.parametrize("name", ["my chat", "café", "会话1", "2024-06-01 notes", "x" * 200])
def test_plain_session_names_with_spaces_or_any_letters_work(fake, name):
    assert cli.main(["chat", "-q", "--session", name, "hi"]) == 0
    assert (fake / "home" / "sessions" / f"{name}.json").is_file()


@pytest.mark.parametrize("argv", [["chat", "\udcff\udcfe"], ["chat", "--system", "\udcff", "hi"],
                                  ["feedback", "\udcff"], ["--token", "\udcff", "stats"],
                                  ["chat", "--session", "\udcff", "hi"]])
def test_arguments_that_are_not_utf8_are_a_usage_error(fake, capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and "UTF-8" in capsys.readouterr().err


def test_a_session_that_cannot_be_saved_is_a_message_not_a_traceback(fake, monkeypatch,
                                                                     capsys):
    blocker = fake / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(blocker))  # sessions/ cannot be made in it
    with pytest.raises(SystemExit, match="cannot save session history"):
        cli.main(["chat", "-q", "--session", "s1", "hi"])
    # Found before the request (taking the session's lock): no answer that could not be kept.
    assert "Hello." not in capsys.readouterr().out


def test_a_session_saved_over_a_loose_folder_and_leftover_is_private(fake):
    folder = fake / "home" / "sessions"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    leftover = folder / "s2.json.tmp"
    leftover.write_text("[]")
    leftover.chmod(0o644)
    assert cli.main(["chat", "-q", "--session", "s2", "hi"]) == 0
    assert (folder / "s2.json").stat().st_mode & 0o077 == 0
    assert folder.stat().st_mode & 0o077 == 0


def test_a_session_is_saved_whole_and_read_back(fake):
    assert cli.main(["chat", "-q", "--session", "s1", "hi"]) == 0
    assert cli.main(["chat", "-q", "--session", "s1", "and then?"]) == 0
    path = fake / "home" / "sessions" / "s1.json"
    assert [m["role"] for m in cli._load_history(path)] == ["user", "assistant"] * 2
    assert not path.with_name("s1.json.tmp").exists()
    assert path.stat().st_mode & 0o077 == 0  # a conversation: this user's only


def test_two_turns_of_one_session_saving_at_once_each_save_whole(fake, monkeypatch):
    """The temporary file had one fixed name (`<session>.json.tmp`): two turns of a session
    at once wrote the same file, and the first to rename it away made the other fail
    ("cannot save session history") or save what the other had half written."""
    path = fake / "home" / "sessions" / "s1.json"
    real_replace = os.replace
    temps: list[str] = []

    def interleaved(src, dst):
        temps.append(str(src))
        if len(temps) == 1:  # the other turn saves while this one is about to rename
            cli._save_history(path, [{"role": "user", "content": "second"}])
        real_replace(src, dst)

    monkeypatch.setattr(cli.os, "replace", interleaved)
    cli._save_history(path, [{"role": "user", "content": "first"}])
    assert len(set(temps)) == 2  # a temporary file each
    assert cli._load_history(path) == [{"role": "user", "content": "first"}]  # renamed last
    assert os.listdir(path.parent) == ["s1.json"]
    assert path.stat().st_mode & 0o077 == 0


def test_replay_refuses_a_bad_trace_or_concurrency_with_a_message(fake, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["replay", "--concurrency", "0", "t.jsonl"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="trace /nonexistent.jsonl"):
        cli.main(["replay", "/nonexistent.jsonl"])
    bad = fake / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(SystemExit, match="error: trace"):
        cli.main(["replay", str(bad)])


def test_a_closed_output_pipe_ends_chat_quietly():
    # `tiercache chat ... | head -c 3`: the reader goes away mid-answer.
    script = (
        "import sys\n"
        "from clients.python import cli\n"
        "from tests.test_cli_input import FakeClient\n"
        "FakeClient.pieces = ['word ' * 20 + '\\n'] * 20000\n"
        "cli.TierCacheClient = FakeClient\n"
        "sys.exit(cli.main(['chat', '-q', 'hi']))\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'gen'}"}
    r = subprocess.run(["bash", "-c", f"{sys.executable} -c \"$S\" | head -c 3; "
                        "echo \"rc=${PIPESTATUS[0]}\" >&2"],
                       env={**env, "S": script}, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout == "wor"
    assert "Traceback" not in r.stderr and "rc=141" in r.stderr, r.stderr[-2000:]


def test_a_session_too_long_for_the_model_says_how_to_go_on(fake, monkeypatch, capsys):
    import grpc

    class TooLong(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return "messages: 14063 tokens exceed the limit of 8192"

    assert cli.main(["chat", "-q", "--session", "long", "hi"]) == 0

    def refuse(self, messages, **kw):
        raise TooLong()
        yield  # a generator, as the real stream is

    monkeypatch.setattr(FakeClient, "stream", refuse)
    assert cli.main(["chat", "-q", "--session", "long", "and then?"]) == 1
    err = capsys.readouterr().err
    assert "grown too long" in err and "long.json" in err
    assert "INVALID_ARGUMENT: messages: 14063 tokens exceed" in err


def test_the_long_session_note_is_only_for_the_prompts_size_in_a_session_with_history(
        fake, monkeypatch, capsys):
    # A new session (only --system + the question): no history to blame.
    monkeypatch.setattr(FakeClient, "stream", refuse_with(
        "messages: prompt (9 tokens) + sampling.max_tokens (99999) exceed the model context"))
    assert cli.main(["chat", "-q", "--session", "new", "--system", "be brief", "hi"]) == 1
    assert "grown too long" not in capsys.readouterr().err
    # An old session refused for another field: not its length.
    monkeypatch.undo()
    monkeypatch.setattr(cli, "TierCacheClient", FakeClient)
    assert cli.main(["chat", "-q", "--session", "old", "hi"]) == 0
    monkeypatch.setattr(FakeClient, "stream", refuse_with(
        "sampling.max_tokens: 5000 exceeds the limit of 512"))
    assert cli.main(["chat", "-q", "--session", "old", "more"]) == 1
    assert "grown too long" not in capsys.readouterr().err


def test_warm_with_nothing_to_warm_names_the_clis_flags(capsys):
    """It reached the server and came back as 'prompts: give prompts or top_k', the wire's
    field names, not the flags the user can type."""
    with pytest.raises(SystemExit) as e:
        cli.main(["warm"])
    assert e.value.code == 2
    assert "--system PROMPT or --top-k K" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "words"), [
    (["--timeout", "0", "stats"], "--timeout"), (["--timeout", "nan", "stats"], "--timeout"),
    (["--timeout", "1e10", "stats"], "--timeout"),
    (["--token", "a\nb", "stats"], "--token"), (["--token", "é", "stats"], "--token"),
    (["replay", "t.jsonl", "--time-scale", "inf"], "--time-scale"),
    (["replay", "t.jsonl", "--time-scale", "-1"], "--time-scale"),
    (["replay", "t.jsonl", "--tenant-tokens", "abc"], "--tenant-tokens"),
    (["--cert", "c.pem", "stats"], "--cert"),
    (["--ca", "ca.pem", "--cert", "c.pem", "stats"], "--cert and --key"),
    # Dialed as port 34463 (99999 modulo 65536), as port 443, and a bare IPv6 never.
    (["--address", "127.0.0.1:99999", "stats"], "--address"),
    (["--address", "localhost", "stats"], "--address"),
    (["--address", "::1:50051", "stats"], "--address"),
    (["chat", "hi", "--temperature", "nan"], "--temperature"),
    (["chat", "hi", "--temperature", "-1"], "--temperature"),
    # float32 on the wire: 1e-50 went out as 0 (top_p unset = full sampling; greedy), 1e39 as
    # inf, which the server refused as "got inf".
    (["chat", "hi", "--top-p", "1e-50"], "--top-p"),
    (["chat", "hi", "--temperature", "1e-50"], "--temperature"),
    (["chat", "hi", "--temperature", "1e39"], "--temperature"),
])
def test_values_that_failed_later_or_named_nothing_are_usage_errors(fake, capsys, argv, words):
    """A 0, nan or 1e10 s timeout came back as DEADLINE_EXCEEDED from the server; a token with
    a newline or an accent as gRPC's INTERNAL "Invalid metadata"; an infinite time scale as an
    OverflowError traceback; a tenant pair without '=' was dropped; --cert without TLS exited
    1, not 2 as other usage errors."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and "Traceback" not in err


def test_a_token_from_a_secret_file_loses_its_trailing_newline(fake, monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "cmd_stats", lambda c, a: seen.append(a.token) or 0)
    assert cli.main(["--token", "tok-1\n", "stats"]) == 0
    monkeypatch.setenv("TIERCACHE_TOKEN", "tok-2\n")
    assert cli.main(["stats"]) == 0
    monkeypatch.setenv("TIERCACHE_TOKEN", "")  # empty (or blank) = no auth, as before
    assert cli.main(["stats"]) == 0
    assert cli.main(["--token", " ", "stats"]) == 0
    monkeypatch.setenv("TIERCACHE_TOKEN", "bad-env")
    assert cli.main(["--token", "", "stats"]) == 0  # an explicit empty --token wins
    monkeypatch.setenv("TIERCACHE_TOKEN", "tok 3")  # inner spaces: the tokens file allows them
    assert cli.main(["stats"]) == 0
    monkeypatch.setenv("TIERCACHE_TOKEN", "tök")
    with pytest.raises(SystemExit) as e:
        cli.main(["stats"])
    assert e.value.code == 2 and seen == ["tok-1", "tok-2", None, None, None, "tok 3"]


def test_output_that_cannot_be_written_is_one_line_not_a_traceback(fake, monkeypatch, capsys):
    import errno

    def full(c, a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli, "cmd_stats", full)
    assert cli.main(["stats"]) == 1
    assert "No space left on device" in capsys.readouterr().err


def test_an_answer_the_console_cannot_encode_is_printed_with_replacements():
    """On a console whose encoding cannot spell the answer (PYTHONIOENCODING=ascii, a Windows
    code page) the CLI died with a UnicodeEncodeError traceback mid-answer."""
    script = (
        "import sys\n"
        "from clients.python import cli\n"
        "from tests.test_cli_input import FakeClient\n"
        "FakeClient.pieces = ['缓存是', 'é ok']\n"
        "cli.TierCacheClient = FakeClient\n"
        "sys.exit(cli.main(['chat', '-q', 'hi']))\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'gen'}",
           "PYTHONIOENCODING": "ascii"}
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                       timeout=60)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.decode("ascii").rstrip("\n") == "???? ok"


def test_chat_sends_the_seed_and_top_p_it_is_given(fake, monkeypatch):
    """`chat` had --temperature only: a seeded sample could not be asked for again."""
    sent: list[dict] = []
    plain = FakeClient.stream

    def stream(self, messages, **kw):
        sent.append(kw)
        yield from plain(self, messages, **kw)

    monkeypatch.setattr(FakeClient, "stream", stream)
    argv = ["chat", "-q", "--temperature", "0.8", "--top-p", "0.9", "--seed", str(2**64 - 1),
            "Hi?"]
    assert cli.main(argv) == 0
    assert (sent[0]["temperature"], sent[0]["top_p"], sent[0]["seed"]) == (0.8, 0.9, 2**64 - 1)
    for bad in (["--seed", "-1"], ["--top-p", "1.5"], ["--top-p", "nan"], ["--top-p", "-0.1"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["chat", *bad, "Hi?"])
        assert e.value.code == 2


@pytest.mark.parametrize(("field", "value"), [
    ("system_index", 0.0), ("question", 5), ("tenant", ["t0"]), ("at", None), ("at", "1"),
    ("turn", True), ("at", float("nan"))])
def test_replay_refuses_a_trace_field_of_the_wrong_type_before_sending(fake, monkeypatch,
                                                                       field, value):
    """Only the tenant and system_index range were checked: a float index, a number for a
    question, a null time... were tracebacks, some in a worker after requests had gone out."""
    import json as _json

    base = dict(at=0.0, tenant="t0", session_id="a", system_index=0, turn=0, question="q?")
    trace = fake / "t.jsonl"
    lines = [{"spec": {}, "system_prompts": {"t0": ["sys"]}}, base,
             dict(base, session_id="b", **{field: value})]
    trace.write_text("\n".join(_json.dumps(x) for x in lines) + "\n")
    sent: list = []
    monkeypatch.setattr(FakeClient, "stream", lambda self, *a, **kw: sent.append(a) or iter(()))
    with pytest.raises(SystemExit, match=f"error: trace .*line 3: {field} has the wrong type"):
        cli.main(["replay", str(trace)])
    assert sent == []


def test_replay_refuses_system_prompts_that_are_not_lists_of_texts(fake):
    """"system_prompts": {"t0": "abc"} passed, and "a" went out as the system prompt."""
    trace = fake / "t.jsonl"
    trace.write_text('{"spec": {}, "system_prompts": {"t0": "abc"}}\n'
                     '{"at": 0, "tenant": "t0", "session_id": "a", "system_index": 0, '
                     '"turn": 0, "question": "q"}\n')
    with pytest.raises(SystemExit, match="line 1: system_prompts must map"):
        cli.main(["replay", str(trace)])


@pytest.mark.parametrize("home", ["", "~/tc"])
def test_the_cli_home_setting_empty_is_the_default_and_tilde_is_expanded(
        fake, monkeypatch, home):
    """TIERCACHE_CLI_HOME= wrote ./sessions/ wherever the command ran; '~/tc' made a folder
    named '~' there."""
    monkeypatch.setenv("HOME", str(fake / "user"))
    monkeypatch.setenv("TIERCACHE_CLI_HOME", home)
    monkeypatch.chdir(fake)
    assert cli.main(["chat", "-q", "--session", "s1", "hi"]) == 0
    want = fake / "user" / (".cache/tiercache" if not home else "tc") / "sessions" / "s1.json"
    assert want.is_file()
    assert not (fake / "sessions").exists() and not (fake / "~").exists()


def test_warm_with_one_string_warms_one_system_prompt():
    """A plain string was walked character by character: 28 one-letter prompts."""
    from clients.python.client import TierCacheClient

    sent = []
    c = TierCacheClient("127.0.0.1:1")
    try:
        c.stub.Warm = lambda req, **kw: sent.append(req)
        c.warm("You are a helpful assistant.")
    finally:
        c.close()
    assert len(sent[0].prompts) == 1
    assert sent[0].prompts[0].messages[0].content == "You are a helpful assistant."


def _run_cli(script: str, stdout) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter whose stdout is buffered as a user's shell has it
    (no PYTHONUNBUFFERED) and goes to `stdout`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{ROOT / 'gen'}"
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, stdout=stdout,
                          stderr=subprocess.PIPE, timeout=60)


_STATS_SCRIPT = (
    "import sys\n"
    "from clients.python import cli\n"
    "from tests.test_cli_input import FakeClient\n"
    "from tiercache.v1 import orchestrator_pb2\n"
    "FakeClient.stats = lambda self, **kw: orchestrator_pb2.StatsResponse(model_id='m')\n"
    "cli.TierCacheClient = FakeClient\n"
    "sys.exit(cli.main(['stats']))\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_full_disk_under_buffered_output_is_one_line_and_status_1():
    # The JSON sat in stdout's buffer until Python flushed it at exit, past main's handlers:
    # "Exception ignored ... OSError: [Errno 28]" and status 120.
    with open("/dev/full", "wb") as full:
        r = _run_cli(_STATS_SCRIPT, full)
    assert r.returncode == 1, r.stderr[-2000:]
    assert b"No space left on device" in r.stderr and b"Exception ignored" not in r.stderr


def test_a_reader_gone_under_buffered_output_is_a_quiet_141():
    read, write = os.pipe()
    os.close(read)  # `| head -0`: nobody reads
    with os.fdopen(write, "wb") as pipe:
        r = _run_cli(_STATS_SCRIPT, pipe)
    assert r.returncode == 141 and r.stderr == b"", r.stderr[-2000:]


class FailingClient(FakeClient):
    def stream(self, messages, **kw):
        import grpc

        yield Chunk("partial", [])

        class Lost(grpc.RpcError):
            chunks_received = 1  # as the client marks an error after part of an answer

            def code(self):
                return grpc.StatusCode.UNAVAILABLE

            def details(self):
                return "replica died"

        raise Lost()


class RestartingClient(FakeClient):
    def stream(self, messages, **kw):
        import grpc

        class Down(grpc.RpcError):
            chunks_received = 0

            def code(self):
                return grpc.StatusCode.UNAVAILABLE

            def details(self):
                return "no kvpool replica is available"

        raise Down()
        yield  # a generator, as the client's stream is


def test_an_unavailable_stack_says_retry_later(fake, monkeypatch, capsys):
    """An operator's rolling restart: the CLI said UNAVAILABLE with no hint, though the same
    request would succeed later (the hint was given for RESOURCE_EXHAUSTED only)."""
    monkeypatch.setattr(cli, "TierCacheClient", RestartingClient)
    assert cli.main(["chat", "hi"]) == 75  # EX_TEMPFAIL: busy or unreachable now
    assert capsys.readouterr().err == (
        "error: UNAVAILABLE (retry later): no kvpool replica is available\n")


def test_an_answer_cut_short_by_an_error_ends_its_line(fake, monkeypatch, capsys):
    monkeypatch.setattr(cli, "TierCacheClient", FailingClient)
    assert cli.main(["chat", "hi"]) == 1
    out = capsys.readouterr()
    assert out.out == "partial\n" and out.err == "error: UNAVAILABLE: replica died\n"


def test_warm_takes_one_message_or_one_conversation_as_one_prompt():
    from clients.python.client import TierCacheClient

    sent = []
    c = TierCacheClient.__new__(TierCacheClient)
    c.stub = type("Stub", (), {"Warm": lambda self, req, **kw: sent.append(req)})()
    c._timeout = lambda t: t
    c._metadata = lambda rid="": ()
    msg = {"role": "system", "content": "x"}
    for shape in (msg, [msg], [[msg]], "x", ["x"]):
        c.warm(shape)
        (p,) = sent.pop().prompts  # one prompt, not one per key or per message
        assert [(m.role, m.content) for m in p.messages] == [("system", "x")], shape
    with pytest.raises(TypeError, match="list of messages"):
        c.warm([["not a message"]])


@pytest.mark.parametrize("bad, said", [
    ('{"at": 1, "tenant": "t1",}', "line 3: not JSON"),
    ('{"at": 1, "tenant": "t1", "session_id": "s", "system_index": 0, "turn": 0}',
     "line 3: missing fields ['question']"),
    ('{"at": 1, "tenant": "t1", "session_id": "s", "system_index": 0, "turn": 0, '
     '"question": "q", "colour": "red"}', "line 3: unknown fields ['colour']"),
    # A time a timed replay cannot wait for (an OverflowError in a worker, every outcome lost).
    ('{"at": 1e300, "tenant": "t1", "session_id": "s", "system_index": 0, "turn": 0, '
     '"question": "q"}', "line 3: at must be in [0, 1e+06] seconds"),
])
def test_a_bad_trace_line_is_named_by_its_line(tmp_path, bad, said):
    from benchmarks.workload import WorkloadSpec, generate, load_trace, save_trace

    w = generate(WorkloadSpec(sessions=2, turns=1))
    path = tmp_path / "t.jsonl"
    save_trace(w, path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1], bad, *lines[2:]]) + "\n")
    with pytest.raises(ValueError) as e:
        load_trace(path)
    assert str(e.value).startswith(said), str(e.value)


@pytest.mark.parametrize(("address", "warned"), [
    ("api.example.com:443", True), ("10.0.3.7:50051", True), ("dns:///tiercache:50051", True),
    ("localhost:50051", False), ("127.0.0.1:50051", False), ("[::1]:50051", False),
    ("app.localhost:50051", False), ("dns:///127.0.0.1:50051", False),
    ("ipv6:[::1]:50051", False), ("dns:///[::1]:50051", False),
])
def test_a_token_sent_in_plaintext_to_another_host_is_warned_of(fake, capsys, monkeypatch,
                                                                address, warned):
    """A security review: the bearer token went out in clear text to any host without a
    word unless --tls or --ca was given."""
    monkeypatch.delenv("TIERCACHE_TLS_CA", raising=False)
    assert cli.main(["--address", address, "--token", "tok-1", "chat", "-q", "hi"]) == 0
    err = capsys.readouterr().err
    assert ("sending the token in plaintext" in err) == warned, err
    assert "tok-1" not in err
    assert cli.main(["--address", address, "chat", "-q", "hi"]) == 0  # no token: nothing said
    assert "plaintext" not in capsys.readouterr().err


def test_a_token_sent_over_tls_is_not_warned_of(fake, capsys, monkeypatch):
    monkeypatch.delenv("TIERCACHE_TLS_CA", raising=False)
    argv = ["--tls", "--address", "api.example.com:443", "--token", "tok-1", "chat", "-q", "hi"]
    assert cli.main(argv) == 0
    assert "plaintext" not in capsys.readouterr().err


def test_a_closed_stderr_is_exit_1_without_a_traceback(fake, monkeypatch):
    """With stderr closed (`2>&-`) there is no one to tell: exit 1, nothing sent."""
    sent = []
    monkeypatch.setattr(FakeClient, "stream", lambda self, m, **kw: sent.append(m) or iter(()))
    monkeypatch.setattr(sys, "stderr", None)
    assert cli.main(["--address", "127.0.0.1:1", "chat", "hi"]) == 1
    assert sent == []


def test_an_answered_turn_is_saved_even_when_stderr_cannot_take_the_report(fake, monkeypatch):
    """A client review: the report line was written before the history was saved, so with
    stderr closed or full the answered turn was lost without a word."""
    class Full(io.StringIO):
        def write(self, s):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(sys, "stderr", Full())
    with pytest.raises(OSError):
        cli.main(["chat", "--session", "full", "hi"])
    saved = json.loads((fake / "home" / "sessions" / "full.json").read_text())
    assert [m["role"] for m in saved] == ["user", "assistant"]


def test_a_closed_stdout_is_one_line_before_anything_is_sent(fake, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", None)
    assert cli.main(["chat", "hi"]) == 1
    assert "stdout is closed" in capsys.readouterr().err


class Tty(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


def test_model_text_reaches_a_terminal_without_its_control_characters(monkeypatch):
    monkeypatch.setattr(sys, "stdout", Tty())
    assert cli.shown("a\x1b[2Jb\x07\nc\td") == "a\ufffd[2Jb\ufffd\nc\td"
    assert cli.shown("a\x7fb\rc") == "a\ufffdb\ufffdc"  # DEL, and a carriage return
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a pipe or file: as the model wrote it
    assert cli.shown("a\x1b[2J") == "a\x1b[2J"


def test_a_chat_answer_reaches_a_terminal_without_its_control_characters(fake, monkeypatch):
    out = Tty()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(FakeClient, "pieces", ["clear \x1b[2J", "screen"])
    assert cli.main(["chat", "-q", "hi"]) == 0
    assert "\x1b" not in out.getvalue() and "clear \ufffd[2Jscreen" in out.getvalue()


def test_the_servers_words_reach_a_terminal_on_stderr_without_control_characters(
        fake, monkeypatch):
    """Status details and a report's replica id and route come from the server: on a
    terminal their control characters were written as they came (the client differential)."""
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)

    def stream(self, messages, **kw):
        yield Chunk("Hi", [], orchestrator_pb2.GenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_EOS,
            cache_report=common_pb2.CacheReport(replica_id="kv\x1b]0;title\x07", route="ring")))

    monkeypatch.setattr(FakeClient, "stream", stream)
    assert cli.main(["chat", "hi"]) == 0
    assert "\x1b" not in err.getvalue() and "kv\ufffd]0;title\ufffd" in err.getvalue()

    monkeypatch.setattr(FakeClient, "stream", refuse_with("messages: bad \x1b[2J text"))
    assert cli.main(["chat", "hi"]) == 1
    assert "\x1b" not in err.getvalue() and "bad \ufffd[2J text" in err.getvalue()
    piped = io.StringIO()  # a log file gets the words as they came
    monkeypatch.setattr(sys, "stderr", piped)
    assert cli.main(["chat", "hi"]) == 1
    assert "bad \x1b[2J text" in piped.getvalue()


def test_a_session_too_deep_to_parse_is_one_line(fake, capsys):
    path = fake / "home" / "sessions" / "deep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[" * 100_000)
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", "--session", "deep", "hi"])
    assert "unreadable" in str(e.value) and "--new" in str(e.value)


def test_the_note_says_how_many_tokens_fit_when_only_the_answer_overflows():
    d = ("messages: prompt (8185 tokens) + sampling.max_tokens (16) exceed the model "
         "context (8192)")
    assert cli._room_left(d) == 7 and cli._room_left("messages: 9000 tokens exceed") == 0


def test_replays_token_figures_are_of_the_answered_requests_as_its_classes_are(fake, monkeypatch,
                                                                             capsys):
    """A turn failing after its final message (a status after it) is an error, left out of
    the classes, and its final's figures were still summed into cached_tokens and
    prompt_tokens (the client differential): the summary's figures and classes now count the
    same requests."""
    base = dict(at=0.0, tenant="t0", session_id="a", system_index=0, turn=0, question="ok?")
    trace = fake / "t.jsonl"
    lines = [{"spec": {}, "system_prompts": {"t0": ["sys"]}}, base,
             dict(base, session_id="b", question="fails?")]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")

    def stream(self, messages, **kw):
        q = messages[-1]["content"]
        yield Chunk("Hi.", [], orchestrator_pb2.GenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_EOS,
            cache_report=common_pb2.CacheReport(prompt_tokens=100 if q == "ok?" else 7000,
                                                cached_tokens=64 if q == "ok?" else 5000)))
        if q == "fails?":
            raise RuntimeError("status after the final message")

    monkeypatch.setattr(FakeClient, "stream", stream)
    assert cli.main(["replay", str(trace)]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary == {"requests": 2, "errors": 1, "classes": {"prefix_hit": 1},
                       "cached_tokens": 64, "prompt_tokens": 100}


@pytest.mark.parametrize(("details", "said"), [
    ("Deadline Exceeded", "Deadline Exceeded (no answer within --timeout 0.25 s)"),
    ("replica kvpool-0: no answer in 5 s", "replica kvpool-0: no answer in 5 s"),
])
def test_the_calls_own_deadline_names_the_timeout_that_set_it(fake, monkeypatch, capsys,
                                                                details, said):
    """gRPC's own "Deadline Exceeded" (this call's --timeout passed) named no setting; a
    deadline a server reports in its own words is shown as it is."""
    import grpc

    class Expired(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self):
            return details

        def trailing_metadata(self):
            return ()

    def expire(c, a):
        raise Expired()

    monkeypatch.setattr(cli, "cmd_stats", expire)
    assert cli.main(["--timeout", "0.25", "stats"]) == 1
    assert capsys.readouterr().err == f"error: DEADLINE_EXCEEDED: {said}\n"


@pytest.mark.parametrize("argv", [["stats"], ["feedback", "abc"]])
def test_an_address_that_is_no_orchestrator_is_said_so(tmp_path, monkeypatch, capsys, argv):
    """A walk: `tiercache --address` at a semantic shard's port (50052 beside the
    orchestrator's 50051) ended "UNIMPLEMENTED: Method not found!", gRPC's words for a server
    without the RPC, naming neither the address nor what to check. Against a real server
    serving only tiercache.v1.SemanticCache, the line now says the address is no
    orchestrator."""
    from concurrent import futures

    from tiercache.v1 import semantic_pb2_grpc

    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path / "home"))
    server = grpc.server(futures.ThreadPoolExecutor(1))
    semantic_pb2_grpc.add_SemanticCacheServicer_to_server(
        semantic_pb2_grpc.SemanticCacheServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        assert cli.main(["--address", address, "--timeout", "10", *argv]) == 1
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert err.startswith(f"error: UNIMPLEMENTED: Method not found! ({address} serves no "
                          "tiercache.v1.Orchestrator: --address names an orchestrator, not a "
                          "semantic, prefix or kvpool shard)"), err


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def _sent_messages(monkeypatch) -> list:
    sent: list = []
    plain = FakeClient.stream

    def stream(self, messages, **kw):
        sent.append(messages)
        yield from plain(self, messages, **kw)

    monkeypatch.setattr(FakeClient, "stream", stream)
    return sent


def test_a_question_or_system_prompt_given_as_dash_is_read_from_stdin(fake, monkeypatch):
    """A walk: `tiercache chat - < question.txt` asked the model "-" (and answered it), and a
    question past 128 KiB could not be given at all (one argument's limit: "Argument list too
    long"). A lone "-" now reads stdin, its trailing newlines dropped as `"$(cat f)"` does."""
    sent = _sent_messages(monkeypatch)
    question = "Summarise this: " + "word " * 40000  # 200 KB, past one argument's limit
    _stdin(monkeypatch, (question + "\n\n").encode())
    assert cli.main(["chat", "-q", "-"]) == 0
    assert sent[-1] == [{"role": "user", "content": question}]
    _stdin(monkeypatch, "Réponds en français.\n".encode())
    assert cli.main(["chat", "-q", "--system", "-", "Hi?"]) == 0
    assert sent[-1] == [{"role": "system", "content": "Réponds en français."},
                        {"role": "user", "content": "Hi?"}]


def test_warm_reads_its_system_prompt_from_stdin(fake, monkeypatch):
    warmed: list = []
    monkeypatch.setattr(FakeClient, "warm", lambda self, prompts, **kw: warmed.append(prompts)
                        or orchestrator_pb2.WarmResponse(
                            results=[orchestrator_pb2.WarmResult(replica_id="r")]),
                        raising=False)
    _stdin(monkeypatch, b"You are a helpful assistant.\n")
    assert cli.main(["warm", "--system", "-"]) == 0
    assert warmed == [["You are a helpful assistant."]]


@pytest.mark.parametrize(("argv", "data", "said"), [
    (["chat", "-"], b"caf\xe9?\n", "text (stdin): not valid UTF-8 (byte 0xe9 at offset 3)"),
    (["warm", "--system", "-"], b"\xff", "--system (stdin): not valid UTF-8 (byte 0xff at "
                                         "offset 0)"),
    (["chat", "--system", "-", "-"], b"hi", "text and --system cannot both be - (stdin)"),
    # Empty: warm said "give --system PROMPT or --top-k K" of a --system it was given.
    (["warm", "--system", "-"], b"\n", "--system (stdin): empty"),
    (["chat", "-"], b"", "text (stdin): empty"),
])
def test_stdin_that_is_not_utf8_or_asked_for_twice_is_a_usage_error(fake, monkeypatch, capsys,
                                                                    argv, data, said):
    sent = _sent_messages(monkeypatch)
    _stdin(monkeypatch, data)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.endswith(f"error: {said}\n")
    assert sent == []


@pytest.mark.parametrize(("argv", "said"), [
    (["chat", "--new", "-"], "--new starts a --session over: give --session NAME"),
    (["chat", "--raw", "--session", "s", "-"], "--raw sends the text alone: not with "
                                                "--session or --system"),
])
def test_usage_errors_that_need_no_text_come_before_stdin_is_read(fake, monkeypatch, capsys,
                                                                  argv, said):
    """A re-read: `chat --new -` at a terminal had the user type the whole question before
    saying --new needs --session (stdin was read before every other check)."""
    _stdin(monkeypatch, b"caf\xe9?\n")
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.endswith(f"error: {said}\n")
    assert sys.stdin.buffer.tell() == 0  # stdin left unread


def test_a_closed_stdin_for_dash_is_a_usage_error(fake, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", "-"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith("error: text: - reads stdin, which is closed\n")


def test_new_without_a_session_is_a_usage_error(fake, capsys):
    """A walk: `chat --new "hi"` answered as if nothing were asked of --new: nothing started
    over, and nothing said that --new needs --session."""
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", "--new", "hi"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: --new starts a --session over: give --session NAME\n")
    assert cli.main(["chat", "-q", "--new", "--session", "s", "hi"]) == 0


def test_help_says_what_each_exit_status_means(capsys):
    """A walk: no --help, README or docstring said what the exit statuses mean; a script told
    a failed call (1) from a usage error (2), Ctrl-C (130) or a reader gone (141) by guessing,
    and a call busy now (75) from one that fails again (1) not at all."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    said = out.partition("exit status: ")[2]
    for status in ("0 done", "1 failed", "2 usage error", "75 busy or unreachable now",
                   "130 interrupted (Ctrl-C)", "141 stdout closed"):
        assert status in said, out


def test_a_stream_cut_by_its_timeout_names_the_timeout(tmp_path, monkeypatch, capsys):
    """A walk: `--timeout 1.5 chat` of a long answer ended "DEADLINE_EXCEEDED: Stream removed
    (Deadline Exceeded)", gRPC's words for a deadline passed mid-stream (at times), which the
    note naming --timeout (kept for its words before any answer) did not match. Against a real
    server streaming slowly, the line now names the setting, and says part of the answer
    came."""
    import time
    from concurrent import futures

    from tiercache.v1 import orchestrator_pb2_grpc

    class Slow(orchestrator_pb2_grpc.OrchestratorServicer):
        def Generate(self, request, context):
            for i in range(100):
                yield orchestrator_pb2.GenerateResponse(text=f"w{i} ")
                time.sleep(0.1)

    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path / "home"))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Slow(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert cli.main(["--address", f"127.0.0.1:{port}", "--timeout", "0.35", "chat",
                         "hi"]) == 1
    finally:
        server.stop(None)
    out, err = capsys.readouterr()
    assert out.startswith("w0 ") and out.endswith("\n")
    # Either words, as the client's deadline or the server's end of the stream came first.
    assert re.match(r"error: DEADLINE_EXCEEDED: (Stream removed \()?Deadline Exceeded\)? \(the "
                    r"answer did not end within --timeout 0\.35 s\) \(request ", err), err


def test_an_address_that_is_no_grpc_server_is_said_so_not_retry_later(tmp_path, monkeypatch,
                                                                       capsys):
    """A walk: `--address` at a web server's port (HTTP/1.1) ended "UNAVAILABLE (retry later):
    ... Failed parsing HTTP/2 (Expected SETTINGS frame ...)": retry what never succeeds, the
    address not said to be wrong. Against a real HTTP server, the line now says so."""
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # its own lines on stderr
            pass

    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path / "home"))
    web = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{web.server_address[1]}"
    try:
        assert cli.main(["--address", address, "--timeout", "10", "stats"]) == 1
    finally:
        web.shutdown()
        web.server_close()
    err = capsys.readouterr().err
    assert err.startswith("error: UNAVAILABLE: "), err
    assert (f"Failed parsing HTTP/2 (Expected SETTINGS frame as the first frame, got frame "
            f"type 79) ({address} is no gRPC server: --address names the orchestrator's gRPC "
            "port) (request ") in err, err


def test_ctrl_c_while_a_terminal_types_the_question_ends_its_line_and_exits_130(fake, monkeypatch,
                                                                             capsys):
    class Typing(Tty):
        def read(self, *a):
            raise KeyboardInterrupt

    sent = _sent_messages(monkeypatch)
    monkeypatch.setattr(sys, "stdin", Typing())
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", "-"])
    assert e.value.code == 130 and sent == []
    assert capsys.readouterr().err == "reading text from stdin (end it with Ctrl-D)\n\n"


def test_a_prompt_typed_at_a_terminal_with_stderr_closed_is_read(fake, monkeypatch):
    sent = _sent_messages(monkeypatch)
    monkeypatch.setattr(sys, "stdin", Tty("What is a cat?\n"))
    monkeypatch.setattr(sys, "stderr", None)  # `2>&-`: the note had nowhere to go
    assert cli.main(["chat", "-"]) == 1  # exit 1 with stderr closed, as for any command
    assert sent == []
