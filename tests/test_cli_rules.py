"""CLI and replay rules a mutation audit found unguarded: Ctrl-C's status and line end, which
chat flags make a cache policy, feedback and stats notes, the TLS and tenant-token flags,
warm with --top-k alone, replay's progress lines, exit status and tenant tokens (fake clients
stand in for the server: pure client logic)."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys

import grpc
import pytest
from tiercache.v1 import orchestrator_pb2, prefix_pb2

from benchmarks.workload import Request, Workload, WorkloadSpec, save_trace
from clients.python import cli
from clients.python import replay as replay_mod
from clients.python.client import Chunk
from tests import test_cli_input
from tests.test_cli_input import FakeClient, Tty
from tests.test_cli_sessions import Refusal, ReplayClient, _final, _workload
from tests.wire import f32

fake = test_cli_input.fake


def _streaming(monkeypatch, *pieces: str, then: BaseException) -> None:
    def stream(self, messages, **kw):
        for p in pieces:
            yield Chunk(p, [])
        raise then

    monkeypatch.setattr(FakeClient, "stream", stream)


def test_ctrl_c_mid_answer_ends_its_line_and_exits_130(fake, monkeypatch, capsys):
    """Ctrl-C: status 130 (as a shell reports SIGINT), and the partial answer's line ended."""
    _streaming(monkeypatch, "partial", then=KeyboardInterrupt())
    assert cli.main(["chat", "-q", "hi"]) == 130
    assert capsys.readouterr().out == "partial\n"


def test_an_error_before_any_text_prints_no_empty_line(fake, monkeypatch, capsys):
    """Only an answer of which something was printed gets its line ended."""
    _streaming(monkeypatch, "", then=Refusal(grpc.StatusCode.INTERNAL, "boom"))
    assert cli.main(["chat", "-q", "hi"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == "error: INTERNAL: boom\n"


class Overloaded(Refusal):
    """A refusal with the server's overloaded trailer (busy now, as a tenant's limit says)."""

    def trailing_metadata(self):
        return (("tiercache-overloaded", "1"),)


class CutShort(Refusal):
    chunks_received = 1  # as the client marks an error after part of an answer


SC = grpc.StatusCode


@pytest.mark.parametrize(("error", "status"), [
    (Refusal(SC.UNAVAILABLE, "no kvpool replica is available"), 75),
    (Overloaded(SC.RESOURCE_EXHAUSTED, "tenant acme: 2 concurrent requests (limit 2)"), 75),
    (Refusal(SC.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"), 75),
    (Refusal(SC.RESOURCE_EXHAUSTED, "messages: 5000 tokens exceed tenant limit 4096"), 1),
    (CutShort(SC.UNAVAILABLE, "Stream removed (Socket closed)"), 1),
    (Refusal(SC.UNAVAILABLE, "failed to connect: Tls handshake failed (WRONG_VERSION_NUMBER)"),
     1),
    (Refusal(SC.DEADLINE_EXCEEDED, "Deadline Exceeded"), 1),
    (Refusal(SC.INVALID_ARGUMENT, "messages: empty"), 1)])
def test_busy_now_exits_75_and_every_other_failure_1(fake, monkeypatch, capsys, error, status):
    """A script could not tell "busy now, send it again later" from a failure that repeats:
    both exited 1. What the error line marks "(retry later)" exits 75 (EX_TEMPFAIL)."""
    _streaming(monkeypatch, "", then=error)
    assert cli.main(["chat", "-q", "hi"]) == status
    assert ("(retry later)" in capsys.readouterr().err) == (status == 75)


def test_a_busy_unary_call_exits_75(fake, monkeypatch, capsys):
    def busy(self, *a, **kw):
        raise Overloaded(SC.RESOURCE_EXHAUSTED, "every replica is busy")

    for cmd in ("stats", "feedback", "warm"):
        monkeypatch.setattr(FakeClient, cmd, busy, raising=False)
    assert cli.main(["stats"]) == 75
    assert cli.main(["feedback", "e1"]) == 75
    assert cli.main(["warm", "--top-k", "1"]) == 75
    err = capsys.readouterr().err
    assert err == "error: RESOURCE_EXHAUSTED (retry later): every replica is busy\n" * 3, err


@pytest.mark.parametrize(("flags", "want"), [
    (["--no-prefix-cache"], (False, False, True)),
    (["--no-semantic"], (True, True, False))])
def test_each_skip_flag_alone_sets_the_cache_policy(fake, monkeypatch, flags, want):
    """--no-prefix-cache alone is a policy; --no-semantic skips both lookup and store."""
    seen = []
    plain = FakeClient.stream

    def stream(self, messages, **kw):
        seen.append(kw["cache_policy"])
        yield from plain(self, messages, **kw)

    monkeypatch.setattr(FakeClient, "stream", stream)
    assert cli.main(["chat", "-q", *flags, "hi"]) == 0
    p = seen[0]
    assert (p.skip_semantic_lookup, p.skip_semantic_store, p.skip_prefix_cache) == want


def test_a_session_that_cannot_be_renamed_into_place_leaves_no_temporary_file(fake,
                                                                              monkeypatch):
    path = fake / "home" / "sessions" / "s1.json"

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.os, "replace", fail)
    with pytest.raises(SystemExit, match="cannot save session history"):
        cli._save_history(path, [{"role": "user", "content": "hi"}])
    assert list(path.parent.iterdir()) == []


class _Feedback:
    def __init__(self, invalidated: bool) -> None:
        self.invalidated = invalidated

    def feedback(self, entry_id, good):
        return orchestrator_pb2.FeedbackResponse(invalidated=self.invalidated)


def test_only_bad_feedback_on_a_gone_entry_says_it_is_gone(capsys):
    """Good feedback invalidates nothing: no "already gone" note for it."""
    import argparse

    assert cli.cmd_feedback(_Feedback(False), argparse.Namespace(entry_id="e", bad=False)) == 0
    assert capsys.readouterr().err == ""
    assert cli.cmd_feedback(_Feedback(False), argparse.Namespace(entry_id="e", bad=True)) == 0
    assert "already gone" in capsys.readouterr().err
    assert cli.cmd_feedback(_Feedback(True), argparse.Namespace(entry_id="e", bad=True)) == 0
    assert capsys.readouterr().err == ""


def test_feedback_prints_its_json_indented_as_stats_warm_and_erase_tenant_do(fake, monkeypatch,
                                                                           capsys):
    """feedback printed one line of JSON where the other replies are indented: a script or a
    reader met two layouts of one kind of output."""
    monkeypatch.setattr(FakeClient, "feedback", lambda self, entry_id, good: (
        orchestrator_pb2.FeedbackResponse(verified=good)), raising=False)
    monkeypatch.setattr(FakeClient, "stats", lambda self: orchestrator_pb2.StatsResponse(
        model_id="m"), raising=False)
    for argv in (["feedback", "e1"], ["stats"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert out == json.dumps(json.loads(out), indent=2) + "\n", (argv, out)
    assert json.loads(out)["modelId"] == "m"


def test_stats_says_when_a_tiers_shard_lists_disagree(capsys):
    """Every call succeeds while lookups go to the wrong shard: said on stderr too."""

    class Client:
        def stats(self):
            return orchestrator_pb2.StatsResponse(
                model_id="m", prefix=prefix_pb2.PrefixStatsResponse(
                    shards_total=2, shards_answered=2, shard_list_mismatch="shard 1 lists 3"))

    assert cli.cmd_stats(Client(), None) == 0
    assert capsys.readouterr().err == f"prefix: shard 1 lists 3; {cli.MISMATCH_FIX['prefix']}\n"


def test_stats_says_an_orchestrator_older_than_the_client_reports_no_model_id(capsys):
    """Mid-upgrade, this CLI against an orchestrator without StatsResponse.model_id (field 16)
    printed "modelId": "" beside replicas reporting theirs, as if it served no model."""

    class Client:
        def __init__(self, model_id):
            self.model_id = model_id

        def stats(self):
            return orchestrator_pb2.StatsResponse(model_id=self.model_id)

    assert cli.cmd_stats(Client(""), None) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["modelId"] == ""  # the key stays, for scripts reading it
    assert out.err.startswith("modelId: not reported (an orchestrator older than this client")
    assert cli.cmd_stats(Client("SmolLM2"), None) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("tier", "setting"), [
    ("semantic", "TIERCACHE_ORCHESTRATOR_SEMANTIC_ADDRESS"),
    ("prefix", "TIERCACHE_KVPOOL_PREFIX_ADDRESS")])
def test_stats_says_what_to_do_about_a_shard_list_mismatch(capsys, tier, setting):
    """The note named the two lists and not the fix (that was in the shard's log alone), nor
    that a change of the shards under way shows it too, and for how long after."""
    from tiercache.v1 import semantic_pb2

    st = (semantic_pb2 if tier == "semantic" else prefix_pb2)
    kind = st.SemanticStatsResponse if tier == "semantic" else st.PrefixStatsResponse

    class Client:
        def stats(self):
            return orchestrator_pb2.StatsResponse(model_id="m", **{tier: kind(
                shards_total=2, shards_answered=2, shard_list_mismatch="lists differ")})

    assert cli.cmd_stats(Client(), None) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"{tier}: lists differ; list the same {tier} shards")
    assert setting in err and "minutes after" in err


@pytest.mark.parametrize("argv", [["--ca", "ca.pem", "--key", "k.pem", "stats"],
                                  ["replay", "t.jsonl", "--tenant-tokens", "=tok"]])
def test_a_key_without_its_certificate_or_a_token_without_its_tenant_is_a_usage_error(
        fake, capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_warm_with_top_k_alone_is_sent(fake, monkeypatch):
    """--top-k without --system warms the hottest prefixes: not a usage error."""
    sent = []

    def warm(self, prompts, **kw):
        sent.append((prompts, kw["top_k"]))
        return orchestrator_pb2.WarmResponse(results=[orchestrator_pb2.WarmResult()])

    monkeypatch.setattr(FakeClient, "warm", warm, raising=False)
    assert cli.main(["warm", "--top-k", "3"]) == 0
    assert sent == [([], 3)]


def _trace(path, requests: int, tenants=("t0",)):
    reqs = [Request(at=0.0, tenant=tenants[i % len(tenants)], session_id=f"s{i}",
                    system_index=0, turn=0, question=f"q{i}?") for i in range(requests)]
    save_trace(Workload(WorkloadSpec(), {t: ["be brief"] for t in tenants}, reqs), path)
    return str(path)


def test_replay_to_a_log_writes_a_progress_line_per_tenth(fake, monkeypatch, capsys):
    """Not a terminal: one line per tenth of the run (and the first), not one per request."""
    assert cli.main(["replay", _trace(fake / "t.jsonl", 40)]) == 0
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.endswith(" requests")]
    assert lines == [f"{n}/40 requests" for n in (1, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40)]
    assert json.loads(out.out)["errors"] == 0


@pytest.mark.parametrize(("scale", "said"), [
    ("20", "the last of 3 requests is due 30 min 0 s after the start (the trace's timestamps x "
           "--time-scale 20; later, when its session's earlier turns answer late)"),
    ("0.5", "the last of 3 requests is due 45.0 s after the start (the trace's timestamps x "
            "--time-scale 0.5; later, when its session's earlier turns answer late)"),
    ("0", None)])
def test_a_timed_replay_says_first_how_long_it_will_take(fake, monkeypatch, capsys, scale,
                                                          said):
    """`replay --time-scale 20` of a 90 s trace waited half an hour without a word (the
    counter stood at 0); the line on stderr comes before anything is sent, stdout's summary
    is as it was."""
    trace = fake / "t.jsonl"
    reqs = [Request(at=at, tenant="t0", session_id=f"s{i}", system_index=0, turn=0,
                    question=f"q{i}?") for i, at in enumerate((0.0, 30.0, 90.0))]
    save_trace(Workload(WorkloadSpec(), {"t0": ["be brief"]}, reqs), trace)
    real, before = replay_mod.replay, []

    def untimed(w, clients, **kw):  # the run itself untimed: the test does not wait
        before.append(capsys.readouterr())  # what was said before anything is sent
        return real(w, clients, **kw | {"time_scale": 0.0})

    monkeypatch.setattr(replay_mod, "replay", untimed)
    assert cli.main(["replay", str(trace), "--time-scale", scale]) == 0
    out = capsys.readouterr().out
    assert [(o.out, o.err) for o in before] == [("", said + "\n" if said else "")]
    assert json.loads(out) == {"requests": 3, "errors": 0, "classes": {"cold": 3},
                               "cached_tokens": 0, "prompt_tokens": 0}
    assert out == json.dumps(json.loads(out), indent=2) + "\n"


def test_a_replays_length_is_said_in_the_unit_that_reads_best():
    assert [cli._duration(s) for s in (0.25, 59.94, 59.96, 3599, 3600, 7530)] == [
        "0.2 s", "59.9 s", "1 min 0 s", "59 min 59 s", "1 h 0 min", "2 h 5 min"]


def test_replay_on_a_terminal_ends_its_counter_line(fake, monkeypatch):
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main(["replay", _trace(fake / "t.jsonl", 3)]) == 0
    assert err.getvalue().endswith("\r3/3 requests\n")


def test_a_replay_stopped_by_ctrl_c_counts_no_more_on_its_ended_line(fake, monkeypatch):
    """A review (tests/test_replay_differential.py): the calls Ctrl-C cancelled were still
    counted after the CLI had ended the counter's line: "\r1/2 requests" came after it, and
    the shell's prompt after that."""
    import threading
    import time

    sent = threading.Event()
    ended = threading.Event()

    class Client(FakeClient):
        closed = threading.Event()

        def stream(self, messages, **kw):
            sent.set()
            try:
                Client.closed.wait(5)  # in flight until Ctrl-C closes the clients
                raise Refusal(grpc.StatusCode.CANCELLED, "Channel closed!")
                yield
            finally:
                ended.set()

        def close(self):
            Client.closed.set()

    def wait(fs, return_when):
        sent.wait(5)
        raise KeyboardInterrupt  # Ctrl-C once the request is in flight

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(cli, "TierCacheClient", Client)
    monkeypatch.setattr(replay_mod, "wait", wait)
    assert cli.main(["replay", _trace(fake / "t.jsonl", 2)]) == 130
    assert ended.wait(5)
    time.sleep(0.2)  # the cancelled call's outcome recorded meanwhile
    assert err.getvalue() == "\n", repr(err.getvalue())


def test_replay_exits_1_when_a_request_failed_and_uses_each_tenants_token(fake, monkeypatch,
                                                                          capsys):
    tokens: dict[str, str | None] = {}

    class Client(FakeClient):
        def __init__(self, *a, token=None, **kw):
            self.token = token

        def stream(self, messages, **kw):
            tokens[kw["session_id"]] = self.token
            if kw["session_id"] == "s1":
                raise Refusal(grpc.StatusCode.UNAVAILABLE, "down")
            yield from super().stream(messages, **kw)

    monkeypatch.setattr(cli, "TierCacheClient", Client)
    trace = _trace(fake / "t.jsonl", 2, tenants=("t0", "t1"))
    assert cli.main(["--token", "tok-all", "replay", trace, "--tenant-tokens", "t1=tok-1"]) == 1
    assert tokens == {"s0": "tok-all", "s1": "tok-1"}
    assert "error (1x): UNAVAILABLE: down" in capsys.readouterr().err


def test_a_request_naming_a_system_index_one_past_its_tenants_prompts_is_refused(fake):
    trace = fake / "t.jsonl"
    trace.write_text(json.dumps({"spec": {}, "system_prompts": {"t0": ["x"]}}) + "\n"
                     + json.dumps(dict(at=0.0, tenant="t0", session_id="a", system_index=1,
                                       turn=0, question="q?")) + "\n")
    with pytest.raises(SystemExit, match="request 1 names tenant 't0' system_index 1"):
        cli.main(["replay", str(trace)])


def test_an_address_with_spaces_around_a_loopback_host_is_not_warned_of(fake, capsys):
    """The address is stripped before it is judged loopback (as before it is dialed)."""
    assert cli.main(["--address", " 127.0.0.1:50051 ", "--token", "t", "chat", "-q", "hi"]) == 0
    assert "plaintext" not in capsys.readouterr().err


def test_a_later_turn_carries_the_earlier_question_and_answer():
    """History is [system, q0, a0, q1]: the user's own earlier turns included."""
    client = ReplayClient()
    replay_mod.replay(_workload(1, 2), {"t0": client}, concurrency=1)
    assert [(m["role"], m["content"]) for m in client.sent[1]] == [
        ("system", "be brief"), ("user", "q0.0?"), ("assistant", "Partial answer"),
        ("user", "q0.1?")]


def test_ttft_is_measured_to_the_first_text_not_the_first_chunk():
    """An empty first chunk is not the first text; the figure is not the total either."""
    import time

    class Slow(ReplayClient):
        def stream(self, messages, **kw):
            yield Chunk("", [])
            time.sleep(0.1)
            yield Chunk("text", [])
            time.sleep(0.2)
            yield _final()

    (o,) = replay_mod.replay(_workload(1, 1), {"t0": Slow()}, concurrency=1)
    assert o.ttft_ms >= 95 and o.total_ms - o.ttft_ms >= 150, (o.ttft_ms, o.total_ms)


def test_an_outcome_keeps_what_the_index_expected_the_replica_to_hold():
    from tiercache.v1 import common_pb2

    class Evicted(ReplayClient):
        def stream(self, messages, **kw):
            yield Chunk("a", [])
            yield Chunk("", [], orchestrator_pb2.GenerateFinal(cache_report=common_pb2.CacheReport(
                prompt_tokens=64, cached_tokens=16, index_matched_tokens=48)))

    (o,) = replay_mod.replay(_workload(1, 1), {"t0": Evicted()}, concurrency=1)
    assert (o.prompt_tokens, o.cached_tokens, o.expected_tokens) == (64, 16, 48)


def test_replays_cache_classes_match_the_orchestrators_default_prefix_hit_rule():
    """A prefix hit reuses at least the orchestrator's default min_prefix_tokens (exactly that
    many counts), as its own request counts say."""
    from services.orchestrator.config import OrchestratorConfig

    n = OrchestratorConfig().min_prefix_tokens

    def outcome(cached: int, semantic: bool = False) -> replay_mod.Outcome:
        return replay_mod.Outcome("s", "t0", 0, "turn", 0.0, 1.0, 1.0, 64, cached, 1, semantic,
                                  0.0, "A", "prefix")

    assert [outcome(n - 1).cache_class, outcome(n).cache_class,
            outcome(0, semantic=True).cache_class] == ["cold", "prefix_hit", "semantic_hit"]


_FAILING_DEVICE_SCRIPT = (
    "import errno, io, os, sys\n"
    "class Device(io.RawIOBase):\n"
    "    # fd 1 as a device that fails every write with ERRNO, until fd 1 is /dev/null\n"
    "    def writable(self): return True\n"
    "    def fileno(self): return 1\n"
    "    def write(self, b):\n"
    "        if os.path.samestat(os.fstat(1), os.stat(os.devnull)):\n"
    "            return os.write(1, bytes(b))\n"
    "        raise OSError(ERRNO, os.strerror(ERRNO))\n"
    "sys.stdout = io.TextIOWrapper(io.BufferedWriter(Device()), encoding='utf-8')\n"
    + test_cli_input._STATS_SCRIPT)


@pytest.mark.parametrize("name", ["EIO", "EFBIG", "EDQUOT"])
def test_every_output_error_is_one_line_and_status_1(name, tmp_path):
    """Output that cannot be written for a device error (EIO), a file over its size limit
    (EFBIG) or a quota (EDQUOT) is one line and status 1, as a full disk is: the buffer that
    could not be written is dropped, not flushed again at exit ("Exception ignored ...")."""
    import errno

    script = _FAILING_DEVICE_SCRIPT.replace("ERRNO", f"errno.{name}")
    with open(tmp_path / "out", "wb") as out:
        r = test_cli_input._run_cli(script, out)
    assert r.returncode == 1, r.stderr[-2000:]
    err = r.stderr.decode()
    assert err.count("\n") == 1 and os.strerror(getattr(errno, name)) in err, err
    assert "Exception ignored" not in err


def test_stats_shows_a_shard_list_mismatch_on_a_terminal_without_control_characters(
        monkeypatch):
    """The mismatch is the server's words: on a terminal its control characters acted on it
    (the other server words on stderr are shown replaced; the CLI differential)."""
    err = test_cli_input.Tty()
    monkeypatch.setattr(sys, "stderr", err)

    class Client:
        def stats(self):
            return orchestrator_pb2.StatsResponse(
                model_id="m", prefix=prefix_pb2.PrefixStatsResponse(
                    shards_total=1, shards_answered=1, shard_list_mismatch="lists 3\x1b[2J"))

    assert cli.cmd_stats(Client(), None) == 0
    assert err.getvalue() == f"prefix: lists 3\ufffd[2J; {cli.MISMATCH_FIX['prefix']}\n"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    subprocess.run([str(test_cli_input.ROOT / "scripts" / "gen-certs.sh"), str(root)],
                   check=True, capture_output=True, timeout=60)
    (root / "garbage.pem").write_text("not a certificate\n")
    return root


@pytest.mark.parametrize(("flags", "named"), [
    ({"--ca": "garbage.pem"}, "--ca: {}/garbage.pem is not a PEM file"),
    ({"--ca": "missing.pem"}, "--ca: cannot read {}/missing.pem: No such file"),
    ({"--ca": "ca.key"}, "--ca {}/ca.key: holds no CA certificate"),
    ({"--ca": "ca.pem", "--cert": "garbage.pem", "--key": "client.key"},
     "--cert: {}/garbage.pem is not a PEM file"),
    ({"--ca": "ca.pem", "--cert": "client.pem", "--key": "server.key"},
     "--cert {0}/client.pem and --key {0}/server.key are not a certificate and its"),
])
def test_a_tls_file_that_is_no_certificate_is_named_before_any_call(fake, certs, flags, named):
    """gRPC took them and failed every call as "UNAVAILABLE (retry later): ... Failed to
    create security handshaker": retry what never succeeds, no file named."""
    argv = [x for flag, name in flags.items() for x in (flag, str(certs / name))]
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["stats"])  # FakeClient has no stats: a call would be a traceback
    assert str(e.value.code).startswith("error: " + named.format(certs))


def test_sound_tls_files_make_credentials(certs):
    a = argparse.Namespace(ca=str(certs / "ca.pem"), cert=str(certs / "client.pem"),
                           key=str(certs / "client.key"), tls=False)
    assert isinstance(cli.credentials(a), grpc.ChannelCredentials)


@pytest.mark.parametrize("cmd", ["chat", "warm", "feedback", "stats", "erase-tenant",
                                 "replay"])
def test_every_argument_of_every_command_says_what_it_is_in_help(cmd, capsys):
    """`warm --help` listed a bare --system, `feedback --help` a bare entry_id and --bad:
    nothing said which id, or what --bad does to the entry."""
    with pytest.raises(SystemExit):
        cli.main([cmd, "--help"])
    body = capsys.readouterr().out.split("\n\n", 1)[1]  # past the usage lines
    lines = body.splitlines()
    for i, ln in enumerate(lines):
        if not ln.startswith("  ") or ln.startswith("   "):
            continue  # not an argument's first line
        inline = re.search(r"\S {2,}\S", ln.strip())
        wrapped = i + 1 < len(lines) and lines[i + 1].startswith(" " * 8)
        assert inline or wrapped, f"{cmd}: {ln.strip()!r} has no help"


def test_chat_raw_sends_the_text_as_a_raw_prompt(fake, monkeypatch, capsys):
    """A model without a chat template refuses `messages` (FAILED_PRECONDITION "send a raw
    `prompt`"), and chat had no way to send one: --raw sends the text alone, unwrapped; with
    --session or --system (a history, a system message) it is a usage error."""
    seen = []
    plain = FakeClient.stream

    def stream(self, messages, **kw):
        seen.append((messages, kw.get("raw", False)))
        yield from plain(self, messages, **kw)

    monkeypatch.setattr(FakeClient, "stream", stream)
    assert cli.main(["chat", "--raw", "Once upon a time"]) == 0  # its report line too
    assert cli.main(["chat", "-q", "hi"]) == 0
    assert seen == [("Once upon a time", True), ([{"role": "user", "content": "hi"}], False)]
    for flags in (["--session", "s1"], ["--system", "be brief"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["chat", "--raw", *flags, "hi"])
        assert e.value.code == 2
        assert "--raw" in capsys.readouterr().err
    # The server's refusal of messages for a model without a template points at --raw.
    _streaming(monkeypatch, then=Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                                         "the model has no chat template (a base model?): "
                                         "send a raw `prompt` instead of `messages`"))
    assert cli.main(["chat", "-q", "hi"]) == 1
    assert "note: --raw sends the text as a raw prompt" in capsys.readouterr().err


def test_the_report_line_and_an_error_name_the_request_id(fake, monkeypatch, capsys):
    """A support ticket quotes the call's request id (every service's log lines of it carry
    that id): chat showed none, neither after an answer nor with an error."""
    final = orchestrator_pb2.GenerateFinal(request_id="rid-42")
    monkeypatch.setattr(FakeClient, "stream",
                        lambda self, messages, **kw: iter([Chunk("hi", [], final)]))
    assert cli.main(["chat", "hi"]) == 0
    assert capsys.readouterr().err.rstrip().endswith(", request rid-42]")
    refused = Refusal(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    refused.request_id = "rid-43"
    _streaming(monkeypatch, "", then=refused)
    assert cli.main(["chat", "-q", "hi"]) == 1
    assert capsys.readouterr().err == "error: INVALID_ARGUMENT: bad (request rid-43)\n"


def test_a_session_whose_prompt_alone_fills_the_context_says_it_has_grown_too_long(
        fake, monkeypatch, capsys):
    """With --max-tokens unset (the default) the server words the overflow as "leaves no
    room", not "exceed": the note on how to go on was left out, and every later turn failed
    the same way."""
    assert cli.main(["chat", "-q", "--session", "full", "hi"]) == 0

    def refuse(self, messages, **kw):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      "messages: prompt (1038 tokens) leaves no room for an answer in the "
                      "model context (1024): at most 1023 prompt tokens")
        yield  # a generator, as the client's stream is

    monkeypatch.setattr(FakeClient, "stream", refuse)
    assert cli.main(["chat", "-q", "--session", "full", "and then?"]) == 1
    err = capsys.readouterr().err
    assert "grown too long" in err and "full.json" in err and "--max-tokens" not in err
    assert "start it over with --new" in err  # the flag that does it, named


def test_a_sessions_note_on_a_kv_pool_refusal_says_how_many_tokens_fit():
    """Past every KV pool, a session's note said only "start it over" though the refusal says
    what answer would still fit this turn; it says that, as for the model's context. Not for
    a prompt too long for the pool by itself."""
    fits = ("prompt (rendered messages): prompt (35 tokens) + the default max_tokens (256; the "
            "request set no sampling.max_tokens) need 19 KV blocks, the pool has 16; "
            "sampling.max_tokens of at most 222 fits")
    alone = ("prompt (rendered messages): prompt (391 tokens) + sampling.max_tokens (4) need "
             "25 KV blocks, the pool has 16; the prompt alone is too long for it")
    assert cli._room_left(fits) == 222 and cli._room_left(alone) == 0


def test_a_request_over_the_orchestrators_size_limit_names_the_setting(fake, monkeypatch,
                                                                       capsys):
    """gRPC refuses a request over max_request_bytes before any handler, in its own words
    ("SERVER: Received message larger than max (N vs. M)"), which name no setting; the CLI
    says which one it is. gRPC's words for anything else are left as they are."""
    words = "SERVER: Received message larger than max (5000016 vs. 4194304)"
    _streaming(monkeypatch, "", then=Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, words))
    assert cli.main(["chat", "-q", "hi"]) == 1
    assert capsys.readouterr().err == (
        f"error: RESOURCE_EXHAUSTED: {words} (bytes: the request's vs. the orchestrator's "
        "limit, TIERCACHE_ORCHESTRATOR_MAX_REQUEST_BYTES; send less, or raise it)\n")
    other = "CLIENT: Received message larger than max (20000000 vs. 16777216)"
    _streaming(monkeypatch, "", then=Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, other))
    assert cli.main(["chat", "-q", "hi"]) == 1
    assert capsys.readouterr().err == f"error: RESOURCE_EXHAUSTED: {other}\n"


def test_tls_files_from_the_environment_or_flags_expand_a_leading_tilde(fake, monkeypatch):
    """TIERCACHE_TLS_CA="~/certs/ca.pem" (an env file's, never expanded by a shell) and
    "--cert=~/..." were "cannot read ~/...": expanded, as the services expand theirs."""
    (fake / "c").mkdir()
    subprocess.run([os.path.join(os.path.dirname(__file__), "..", "scripts", "gen-certs.sh"),
                    str(fake / "c")], check=True, capture_output=True, timeout=60)
    monkeypatch.setenv("HOME", str(fake))
    monkeypatch.setenv("TIERCACHE_TLS_CA", "~/c/ca.pem")
    seen = []
    real = cli.credentials
    monkeypatch.setattr(cli, "credentials", lambda a: seen.append((a, real(a))) or seen[-1][1])
    cli.main(["--cert=~/c/client.pem", "--key", "~/c/client.key", "chat", "hi"])
    (a, creds), = seen
    assert (a.ca, a.cert, a.key) == tuple(str(fake / "c" / n)
                                          for n in ("ca.pem", "client.pem", "client.key"))
    assert isinstance(creds, grpc.ChannelCredentials)


def test_the_stats_help_says_its_request_counts_are_one_orchestrators(capsys):
    """"figures of every tier" read as the cluster's totals; with several orchestrators the
    request and token counts are the answering one's only (README)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "request and token counts are the answering orchestrator's own" in said


def test_the_report_never_shows_a_missed_similarity_at_the_threshold_it_missed():
    """A walkthrough tuning thresholds: a miss at 0.9696 in the strict tier (0.97) read
    "model (nearest entry 0.970)", rounded up to the threshold. The figure is rounded down,
    within the tier's float32 tolerance: a 3-decimal threshold it reaches is one the
    similarity reached as the service decides."""
    from tiercache.v1 import common_pb2

    from services.semantic.policy import Outcome, ThresholdPolicy

    policy = ThresholdPolicy({"strict": 0.97, "standard": 0.95, "relaxed": 0.90})
    for th in (0.97, 0.95, 0.90):
        resolved = policy.resolve(threshold=th)
        for sim in (th - 4e-4, th - 2e-6, f32(th) - 2 ** -24, f32(th), th + 4e-4):
            sim = f32(sim)
            hit = policy.decide(sim, resolved, False).outcome is Outcome.HIT
            line = cli.format_report(common_pb2.CacheReport(semantic_hit=hit,
                                                            semantic_similarity=sim))
            shown = float(re.search(r"(\d\.\d{3})", line).group(1))
            assert (shown >= th) == hit, (th, sim, line)
    near = common_pb2.CacheReport(semantic_similarity=f32(0.9696))
    assert cli.format_report(near).startswith("[model (nearest entry 0.969) |")


def test_version_prints_the_installed_distributions_version(monkeypatch, capsys):
    """`tiercache --version` was refused ("the following arguments are required: cmd"): an
    operator who installed a wheel had no way to ask which release it was."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "9.8.7" if name == "tiercache" else "?")
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == "tiercache 9.8.7"


class _Eraser(FakeClient):
    """Answers EraseTenant with `reply` (or raises it), keeping the tenants asked for."""

    reply: object = orchestrator_pb2.EraseTenantResponse()
    asked: list[str] = []

    def erase_tenant(self, tenant):
        self.asked.append(tenant)
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


@pytest.fixture
def eraser(fake, monkeypatch):
    monkeypatch.setattr(cli, "TierCacheClient", _Eraser)
    monkeypatch.setattr(_Eraser, "asked", [])
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a terminal: no question
    return _Eraser


def test_erase_tenant_prints_the_counts_and_every_unreached_one_and_exits_1(eraser, monkeypatch,
                                                                            capsys):
    """Each shard or replica not reached keeps the tenant's data: every one is said, and the
    exit status is not 0, so that `erase-tenant X --yes && ...` takes no part for all."""
    monkeypatch.setattr(eraser, "reply", orchestrator_pb2.EraseTenantResponse(
        semantic_entries_removed=4, kv_blocks_dropped=9,
        not_reached=["semantic shard h:1: UNAVAILABLE: down", "kvpool r1: UNAVAILABLE: gone"]))
    assert cli.main(["erase-tenant", "acme"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"semanticEntriesRemoved": "4", "kvBlocksDropped": 9,
                               "kvBlocksInUse": 0, "notReached": [
                                   "semantic shard h:1: UNAVAILABLE: down",
                                   "kvpool r1: UNAVAILABLE: gone"]}
    assert "not reached: semantic shard h:1: UNAVAILABLE: down\n" in err
    assert "not reached: kvpool r1: UNAVAILABLE: gone\n" in err
    assert "2 not reached: the tenant's data stays there" in err
    assert eraser.asked == ["acme"]


def test_erase_tenant_that_reached_everything_exits_0_and_in_use_blocks_exit_1(
        eraser, monkeypatch, capsys):
    monkeypatch.setattr(eraser, "reply", orchestrator_pb2.EraseTenantResponse(
        kv_blocks_dropped=3))
    assert cli.main(["erase-tenant", "acme"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(eraser, "reply", orchestrator_pb2.EraseTenantResponse(
        kv_blocks_in_use=2))
    assert cli.main(["erase-tenant", "acme"]) == 1
    assert "2 KV blocks kept: a running request reads them" in capsys.readouterr().err


@pytest.mark.parametrize(("answer", "erased"), [("y\n", True), ("yes\n", True), ("\n", False),
                                                ("n\n", False), ("", False)])
def test_erase_tenant_at_a_terminal_asks_first(eraser, monkeypatch, capsys, answer, erased):
    """Destructive: at a terminal it asks, and anything but y/yes (Enter, end of input) erases
    nothing and exits 1; --yes does not ask."""
    stdin = Tty(answer)
    monkeypatch.setattr(sys, "stdin", stdin)
    assert cli.main(["erase-tenant", "acme"]) == (0 if erased else 1)
    err = capsys.readouterr().err
    assert "erase every cached answer and KV block of tenant 'acme'" in err
    assert eraser.asked == (["acme"] if erased else [])
    assert ("not erased" in err) is not erased
    monkeypatch.setattr(sys, "stdin", Tty(""))
    assert cli.main(["erase-tenant", "--yes", "acme"]) == 0
    assert "[y/N]" not in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", "  "])
def test_erase_tenant_without_a_name_is_a_usage_error(eraser, capsys, name):
    with pytest.raises(SystemExit) as e:
        cli.main(["erase-tenant", "--yes", name])
    assert e.value.code == 2
    assert "tenant: required" in capsys.readouterr().err
    assert eraser.asked == []


def test_erase_tenant_with_a_tenants_token_says_it_needs_an_admin_one(eraser, monkeypatch,
                                                                      capsys):
    class Denied(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.PERMISSION_DENIED

        def details(self):
            return ("authorization: tenant acme may not erase a tenant's data (needs an admin "
                    "token)")

    monkeypatch.setattr(eraser, "reply", Denied())
    assert cli.main(["erase-tenant", "--yes", "beta"]) == 1
    assert capsys.readouterr().err == (
        "error: PERMISSION_DENIED: authorization: tenant acme may not erase a tenant's data "
        "(needs an admin token)\n")


class _CtrlC(Tty):
    def readline(self, *a):
        raise KeyboardInterrupt


@pytest.mark.parametrize(("stdin", "status"), [(Tty(""), 1), (_CtrlC(), 130)])
def test_erase_tenant_left_at_its_question_says_not_erased_on_a_line_of_its_own(
        eraser, monkeypatch, capsys, stdin, status):
    """A walk: Ctrl-D at the question printed "[y/N] not erased" on the question's line, and
    Ctrl-C ended with "[y/N] ^C" and no line end (the shell's prompt went after it), not
    saying whether anything was erased."""
    monkeypatch.setattr(sys, "stdin", stdin)
    assert cli.main(["erase-tenant", "acme"]) == status
    assert capsys.readouterr().err.endswith("[y/N] \nnot erased\n")
    assert eraser.asked == []


def test_tenant_tokens_naming_a_tenant_the_trace_lacks_are_a_usage_error(fake, monkeypatch,
                                                                         capsys):
    """A walk: `--tenant-tokens tenant-O=...` (a letter O for the zero) was dropped without a
    word: every request of tenant-0 went out with --token, another tenant's."""
    sent: list[str] = []

    class Client(FakeClient):
        def stream(self, messages, **kw):
            sent.append(kw["session_id"])
            yield from super().stream(messages, **kw)

    monkeypatch.setattr(cli, "TierCacheClient", Client)
    trace = _trace(fake / "t.jsonl", 2, tenants=("t0", "t1"))
    with pytest.raises(SystemExit) as e:
        cli.main(["--token", "tok-all", "replay", trace, "--tenant-tokens", "t1=a,tO=b"])
    assert e.value.code == 2 and sent == []
    assert capsys.readouterr().err == (
        "tiercache: error: --tenant-tokens: tenant 'tO' is not in the trace (its tenants: "
        "t0, t1)\n")
