"""Rules of `make run`'s launcher that no other test pinned: what counts as ready, how much of
a problem is quoted, ports a stopped run leaves behind, metrics ports per replica, child
sessions and reaping, the stop's time bound, the exit codes."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest

from services import launcher
from services.launcher import ServiceProcess, Stack
from tests.test_launcher import _Proc


def test_a_server_reporting_not_serving_is_not_ready():
    """Only SERVING ends the wait: a server that answers NOT_SERVING (still loading its model,
    or draining) times out."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(TimeoutError, match="not SERVING"):
            launcher.wait_healthy(f"127.0.0.1:{port}", 0.6, env={})
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        launcher.wait_healthy(f"127.0.0.1:{port}", 5.0, env={})
    finally:
        server.stop(0)


def test_a_problem_is_quoted_whole_up_to_500_characters(tmp_path: Path):
    log = tmp_path / "s.log"
    for n in (500, 501):
        msg = "bad configuration: " + "x" * (n - len("bad configuration: "))
        log.write_text(json.dumps({"level": "ERROR", "msg": msg}) + "\n")
        got = launcher.last_problem(log)
        assert got == (msg if n == 500 else msg[:497] + "..."), n


def test_a_port_a_stopped_run_left_in_time_wait_is_free():
    """gRPC binds with SO_REUSEADDR: connections of a stopped `make run` still in TIME_WAIT
    must not make the launcher refuse the port."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener
        port = launcher.free_port()  # no bind to 0 elsewhere takes it once closed
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server side closes first: its end goes to TIME_WAIT
        client.close()
        assert not launcher.port_is_free(port)  # still listening
    assert launcher.port_is_free(port)


def test_a_metrics_port_of_zero_stays_zero_for_every_replica(monkeypatch):
    """0 asks each service for any free port: replica i must not be sent port i."""
    monkeypatch.setenv("TIERCACHE_KVPOOL_METRICS_PORT", "0")
    assert [launcher.metrics_env("kvpool", i) for i in range(3)] == [
        {"TIERCACHE_KVPOOL_METRICS_PORT": "0"}] * 3


def test_a_service_runs_in_its_own_session_and_watches_the_launcher(monkeypatch, tmp_path):
    """A terminal's Ctrl-C reaches the launcher alone (it then stops the children in order),
    and each child is told the launcher's pid, so that it stops if the launcher dies."""
    seen = {}

    def popen(cmd, **kw):
        seen.update(kw, cmd=cmd)
        return _Proc()

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    ServiceProcess("prefix", 1234, log_path=tmp_path / "p.log").start()
    assert seen["start_new_session"] is True
    assert seen["env"][launcher.PARENT_PID_ENV] == str(os.getpid())
    assert seen["env"]["TIERCACHE_PREFIX_ADDRESS"] == "127.0.0.1:1234"


def test_the_launcher_keeps_no_copy_of_a_childs_log_file(monkeypatch, tmp_path):
    """The child writes its log through its own descriptor; the launcher's copy was left to
    the garbage collector to close."""
    fds = Path("/proc/self/fd")

    def open_logs() -> list[str]:
        out = []
        for fd in fds.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(str(tmp_path)):
                out.append(target)
        return out

    real_popen = subprocess.Popen
    # a small child in place of the service: only the launcher's descriptors are looked at
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, **kw: real_popen(
        [sys.executable, "-c", "print('child', flush=True)"], **kw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        p = ServiceProcess("prefix", 1, log_path=tmp_path / "p.log").start()
        gc.collect()
    # left to the garbage collector, the copy was closed with a warning ("unclosed file")
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    p.proc.wait(10)
    assert open_logs() == []
    assert (tmp_path / "p.log").read_text() == "child\n"


def test_a_killed_service_is_reaped_before_kill_returns():
    """After kill() the child has exited and been waited for (no zombie, its exit code set)."""
    p = ServiceProcess("prefix", 1)
    p.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p.kill()
    assert p.proc.returncode == -signal.SIGKILL


def test_the_wait_before_sigkill_is_bounded(monkeypatch):
    """A drain setting is read as the service reads it, at most 600 s: stop() never waits
    longer than 15 + 600 s for a drain (+ the drain delay)."""
    monkeypatch.delenv("TIERCACHE_DRAIN_DELAY_S", raising=False)
    p = ServiceProcess("kvpool", 1, env={"TIERCACHE_KVPOOL_GRACE_SECONDS": "100000"})
    p.proc = proc = _Proc()
    p.stop()
    assert proc.waits[0] == 615.0


def _main(monkeypatch, start, argv=("--base-port", "0")) -> int | str:
    """`launcher.main` with `start` for Stack.start, nothing pruned, converted or signalled
    (a KeyboardInterrupt leaving it is a failed assertion, not the end of the session)."""
    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(launcher, "model_to_convert", lambda env: False)
    monkeypatch.setattr(launcher, "prune_pid_logs", lambda logs: [])
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                               signal.SIGQUIT)}
    try:
        return launcher.main(list(argv))
    except KeyboardInterrupt:
        return "KeyboardInterrupt left main"
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_the_last_replicas_metrics_port_may_be_65535(monkeypatch, capsys):
    """Replica i serves metrics on the port + i: 65534 with two replicas ends at 65535, which
    is a port; 65535 with two is refused."""
    monkeypatch.setenv("TIERCACHE_KVPOOL_METRICS_PORT", "65534")

    def start(self):
        raise KeyboardInterrupt

    assert _main(monkeypatch, start, ("--base-port", "0", "--replicas", "2")) == 0
    monkeypatch.setenv("TIERCACHE_KVPOOL_METRICS_PORT", "65535")
    with pytest.raises(SystemExit):
        _main(monkeypatch, start, ("--base-port", "0", "--replicas", "2"))
    assert "past 65535" in capsys.readouterr().err


def test_a_stack_that_fails_to_start_exits_1(monkeypatch, capsys):
    def start(self):
        raise RuntimeError("prefix (127.0.0.1:1) exited with 2")

    assert _main(monkeypatch, start) == 1
    assert "failed to start: prefix (127.0.0.1:1) exited with 2" in capsys.readouterr().err


class _DiesLater:
    """A child that is running at first and then has exited with 3."""

    def __init__(self) -> None:
        self.polls, self.returncode = 0, None

    def poll(self):
        self.polls += 1
        if self.polls > 1:
            self.returncode = 3
        return self.returncode


def _kvpool_dies_later(self):
    """A `Stack.start` stand-in: kvpool-0 up, then dying at its second poll; the orchestrator
    running."""
    p = ServiceProcess("kvpool", 1, key="kvpool-0")
    p.proc = _DiesLater()
    self.procs = {"kvpool-0": p, "orchestrator": ServiceProcess("orchestrator", 2)}
    self.procs["orchestrator"].proc = _Running()
    return self


def test_a_service_that_dies_after_the_start_exits_1_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(Stack, "stop", lambda self: None)
    assert _main(monkeypatch, _kvpool_dies_later) == 1
    assert "service(s) exited: kvpool-0 (127.0.0.1:1) exited with 3" in capsys.readouterr().err


class _Running:
    returncode = None

    def poll(self):
        return None


def test_a_second_signal_while_stopping_does_not_interrupt_again(monkeypatch):
    """The first SIGINT/SIGTERM stops the stack; another one arriving before the orderly stop
    has begun must not raise a second KeyboardInterrupt in the middle of the handling."""
    second = []

    def start(self):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                second.append("ignored")
            except KeyboardInterrupt:
                second.append("raised")
            raise
        return self

    monkeypatch.setattr(Stack, "stop", lambda self: None)
    assert _main(monkeypatch, start) == 0
    assert second == ["ignored"]


def test_a_launcher_of_another_user_counts_as_running(monkeypatch):
    """os.kill(pid, 0) refused (EPERM): the process exists, so its log folder is kept."""
    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(launcher.os, "kill", refused)
    assert launcher._running(12345)


def test_a_conversion_is_announced_when_either_model_service_has_none(tmp_path, monkeypatch):
    """kvpool and the orchestrator each read their own cache folder: one of them without a
    current conversion converts at start, whatever the other has."""
    import json

    from services.common import model_store

    monkeypatch.setattr(model_store, "source_id", lambda gguf: "sid")
    done = tmp_path / "done" / "models" / model_store.SMOLLM2_MODEL_ID
    done.mkdir(parents=True)
    (done / model_store._DONE_MARKER).write_text(json.dumps({"source_id": "sid", "files": {}}))
    both = {"TIERCACHE_KVPOOL_CACHE_DIR": str(tmp_path / "done"),
            "TIERCACHE_ORCHESTRATOR_CACHE_DIR": str(tmp_path / "done")}
    assert not launcher.model_to_convert(both)
    assert launcher.model_to_convert({**both, "TIERCACHE_ORCHESTRATOR_CACHE_DIR":
                                      str(tmp_path / "none")})


def test_grpcurl_gets_a_client_certificate_only_with_its_key(monkeypatch):
    for k in ("TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY", "TIERCACHE_TLS_CLIENT_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TIERCACHE_TLS_CA", "ca.pem")
    monkeypatch.setenv("TIERCACHE_TLS_CLIENT_CERT", "c.pem")
    assert launcher.grpcurl_transport() == "-cacert ca.pem"


def test_signals_are_ignored_while_the_stack_stops(monkeypatch):
    """A second Ctrl-C (or a SIGTERM, SIGHUP) during the orderly stop must not cut it short."""
    seen = {}

    def start(self):
        raise KeyboardInterrupt

    def stop(self):
        seen.update({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM,
                                                       signal.SIGHUP, signal.SIGQUIT)})

    monkeypatch.setattr(Stack, "stop", stop)
    assert _main(monkeypatch, start) == 0
    assert set(seen.values()) == {signal.SIG_IGN}


def test_free_ports_are_free_distinct_and_under_the_ephemeral_range(monkeypatch):
    """A port the kernel picked for a bind to 0 it hands out again (outgoing connections,
    other binds to 0) before the server binds it: free_port picks under that range, each port
    free when handed out and none twice; with no room under the range it falls back to one the
    kernel picks, still never twice."""
    lo, _ = launcher._ephemeral_range()
    ports = [launcher.free_port() for _ in range(40)]
    assert len(set(ports)) == 40
    assert all(launcher._BELOW_EPHEMERAL <= p < lo for p in ports)
    assert all(launcher.port_is_free(p) for p in ports)
    monkeypatch.setattr(launcher, "_ephemeral_range", lambda: (launcher._BELOW_EPHEMERAL, 60999))
    fallback = [launcher.free_port() for _ in range(5)]
    assert len(set(fallback) | set(ports)) == 45 and all(p > 0 for p in fallback)


def test_a_stop_signal_right_after_a_childs_fork_stops_that_child_too(monkeypatch, tmp_path):
    """A SIGTERM handled between a child's fork and its place in `Stack.procs` was raised
    there: that child was left out of the stop, running after `main` returned."""
    real_popen, children = subprocess.Popen, []

    def popen(cmd, **kw):
        child = real_popen([sys.executable, "-c", "import time; time.sleep(60)"],
                           stdout=kw["stdout"], stderr=kw["stderr"], start_new_session=True)
        children.append(child)
        if len(children) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before Popen has returned
        return child

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    monkeypatch.setattr(launcher, "ROOT", tmp_path)
    monkeypatch.setattr(launcher, "semantic_db_env", lambda port, env: {})
    try:
        assert _main(monkeypatch, Stack.start, ("--base-port", "0", "--replicas", "1")) == 0
        assert len(children) == 2 and [c.poll() for c in children] == [-signal.SIGTERM] * 2
    finally:
        for c in children:
            c.kill()
            c.wait()


class _SignalsSending:
    """The `signal` module, sending `sig` to this process once `when(signum, handler)` holds
    for a handler being installed."""

    def __init__(self, sig, when) -> None:
        self.sig, self.when, self.sent = sig, when, False

    def __getattr__(self, name):
        return getattr(signal, name)

    def signal(self, signum, handler):
        old = signal.signal(signum, handler)
        if not self.sent and self.when(signum, handler):
            self.sent = True
            os.kill(os.getpid(), self.sig)
        return old


@pytest.mark.parametrize(("moment", "code"), [
    # as the stop begins (SIGINT ignored, SIGTERM not yet): the stop was skipped entirely
    ("stop", 1),
    # once the handlers are in place, before the start: KeyboardInterrupt left `main`
    ("installed", 0),
])
def test_a_stop_signal_as_the_handlers_change_neither_skips_the_stop_nor_escapes(
        monkeypatch, moment, code):
    stopped = []

    def start(self):
        raise RuntimeError("prefix (127.0.0.1:1) exited with 2")

    def when(signum, handler) -> bool:
        if moment == "stop":
            return signum == signal.SIGINT and handler == signal.SIG_IGN
        return signum == signal.SIGQUIT and callable(handler)

    monkeypatch.setattr(launcher, "signal", _SignalsSending(signal.SIGTERM, when))
    monkeypatch.setattr(Stack, "stop", lambda self: stopped.append(True))
    assert _main(monkeypatch, start) == code
    assert stopped == [True]


@pytest.mark.parametrize("failure", ["failed to start", "service(s) exited"])
def test_a_stop_signal_while_a_failure_is_reported_keeps_exit_1(monkeypatch, failure):
    """A SIGINT handled just after the failure was printed left `main` as KeyboardInterrupt
    (no exit code; after "failed to start") or turned its exit 1 into 0 ("stopping ...",
    after "service(s) exited")."""
    stopped = []

    def start(self):
        if failure == "failed to start":
            raise RuntimeError("prefix (127.0.0.1:1) exited with 2")
        return _kvpool_dies_later(self)

    def say(*args, **kw):
        print(*args, **kw)
        if failure in " ".join(map(str, args)):
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(launcher, "print", say, raising=False)
    monkeypatch.setattr(launcher, "time", types.SimpleNamespace(sleep=lambda s: None))
    monkeypatch.setattr(Stack, "stop", lambda self: stopped.append(True))
    assert _main(monkeypatch, start) == 1
    assert stopped == [True]


def test_a_service_never_ready_is_named_and_one_that_died_at_the_end_gives_its_exit(
        monkeypatch, tmp_path):
    """A child still running at the end of the wait is named with its address ("127.0.0.1:P
    not SERVING after 600s" named no service, unlike an exit); one that exited in the wait's
    last moments is reported by its exit, not as not ready."""
    def timed_out(address, timeout, proc, env, check=None):
        raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")

    monkeypatch.setattr(launcher, "wait_healthy", timed_out)
    p = ServiceProcess("kvpool", 1234, key="kvpool-1")
    p.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(TimeoutError,
                           match=r"^kvpool-1 \(127\.0\.0\.1:1234\) not SERVING after 7s$"):
            p.wait(7.0)
    finally:
        p.kill()
    p.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    p.proc.wait(10)
    with pytest.raises(RuntimeError, match=r"^kvpool-1 \(127\.0\.0\.1:1234\) exited with 3"):
        p.wait(7.0)


def test_a_wait_ends_as_soon_as_another_process_of_the_stack_exits():
    """A stack's processes are waited for in turn: an orchestrator that exited at boot (tenant
    tokens without a hash key) was reported only once every replica before it was up,
    minutes on a CPU. Any of them exiting ends the wait, named with its exit."""
    slow = ServiceProcess("kvpool", launcher.free_port(), key="kvpool-0")  # never serves
    gone = ServiceProcess("orchestrator", 1235)
    slow.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    gone.proc.wait(10)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^orchestrator \(127\.0\.0\.1:1235\) exited "
                                               r"with 2"):
            slow.wait(30.0, [slow, gone])
        assert time.monotonic() - start < 10
    finally:
        slow.kill()


def test_a_service_killed_by_a_signal_is_said_to_be_killed_by_it():
    """`make run` said "kvpool-1 (...) exited with -9" for a replica the OOM killer (or a
    kill -9) ended: Popen's negative code read as an exit status."""
    p = ServiceProcess("kvpool", 1234, key="kvpool-1")
    p.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p.kill()
    assert p.exit_note() == "kvpool-1 (127.0.0.1:1234) was killed by SIGKILL"
    p.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    p.proc.wait(10)
    assert p.exit_note() == "kvpool-1 (127.0.0.1:1234) exited with 3"


@pytest.mark.parametrize(("env", "said"), [
    ({}, False), ({"TIERCACHE_ORCHESTRATOR_TOKENS": " "}, False),
    ({"TIERCACHE_ORCHESTRATOR_TOKENS": "t=alice"}, True),
    ({"TIERCACHE_ORCHESTRATOR_TOKENS_FILE": "/etc/tokens.json"}, True),
])
def test_the_printed_examples_say_a_token_is_needed_when_tenant_tokens_are_set(env, said):
    """With tenant tokens the CLI and grpcurl lines `make run` prints were refused as printed
    (UNAUTHENTICATED "missing bearer token") without a word why."""
    note = launcher.auth_note(env)
    assert bool(note) is said
    if said:
        assert "--token" in note and "authorization: Bearer" in note and note.endswith("\n")


def test_the_readme_says_a_dead_replica_stops_the_local_stack():
    """The launcher stops the stack when any service exits (above): a user killing one
    replica to watch failover found the whole stack gone with no word of it in the README."""
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert ("so does any service exiting (a kvpool replica killed included: the launcher "
            "names it and exits 1)") in readme
    assert "kill -STOP <pid>" in readme


@pytest.mark.parametrize(("env", "made"), [
    ({}, False),
    ({"TIERCACHE_ORCHESTRATOR_TOKENS_FILE": "/etc/tokens.json"}, True),
    ({"TIERCACHE_ORCHESTRATOR_TOKENS": "t=alice", "TIERCACHE_PREFIX_INTERNAL_TOKEN": "x"}, False),
])
def test_tenant_tokens_give_the_internal_services_a_credential(monkeypatch, tmp_path, env, made):
    """With tenant tokens and no internal token the launcher's semantic, prefix and kvpool
    answered any caller: a tenant read every tenant's hot prefixes and salts from
    PrefixIndex/TopPrefixes (and cached answers from SemanticCache/Lookup), around the
    orchestrator's authentication."""
    from tests.test_launcher import fake_starts

    for k in ("TIERCACHE_ORCHESTRATOR_TOKENS", "TIERCACHE_ORCHESTRATOR_TOKENS_FILE",
              *launcher.INTERNAL_TOKEN_VARS):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    started = fake_starts(monkeypatch)
    monkeypatch.setattr(launcher, "semantic_db_env", lambda port, env: {})
    stack = Stack(replicas=1, base_port=0, log_dir=tmp_path).start()
    given = {k: e.get(f"TIERCACHE_{k.split('-')[0].upper()}_INTERNAL_TOKEN")
             for k, e in started.items()}
    assert set(given) == {"semantic", "prefix", "kvpool-0", "orchestrator"}
    if not made:
        assert stack.internal_token_file is None
        assert launcher.auth_note(internal_token_file=None).count("\n") == (1 if env else 0)
        return
    token = given["semantic"]
    assert len(token) == 64 and set(given.values()) == {token}
    path = stack.internal_token_file
    assert path.read_text().strip() == token and path.stat().st_mode & 0o777 == 0o600
    assert str(path) in launcher.auth_note(internal_token_file=path)
    stack.stop()
    assert not path.exists()


def test_installed_from_a_wheel_the_stack_logs_and_runs_where_it_was_started(
        monkeypatch, tmp_path, capsys):
    """From site-packages the logs went to site-packages/.run/logs (often not writable; junk
    in the install), the children ran there (a relative TLS path named a file in it), the
    printed CLI was `.venv/bin/tiercache` (not there) and site-packages led their PYTHONPATH."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "services").mkdir(parents=True)
    (tmp_path / "venv" / "bin").mkdir()
    (tmp_path / "venv" / "bin" / "tiercache").touch()
    here = tmp_path / "ops"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setattr(launcher, "ROOT", site)
    monkeypatch.setattr(launcher.sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setenv("PYTHONPATH", "/x")
    seen = {}

    def popen(cmd, **kw):
        seen.update(kw, cmd=cmd)
        return _Proc()

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    assert Stack().log_dir == here / ".run" / "logs"
    ServiceProcess("prefix", 1234).start()
    assert seen.get("cwd") is None  # the launcher's own directory
    assert seen["env"]["PYTHONPATH"] == "/x"

    def start(self):
        self.procs = {}
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "service_exists", lambda name: True)
    assert _main(monkeypatch, start, ("--base-port", "58999")) == 0
    assert f"logs in {here / '.run' / 'logs' / 'port-58999'}" in capsys.readouterr().out
    assert launcher.tool_path("tiercache") == str(tmp_path / "venv" / "bin" / "tiercache")
    assert launcher.tool_path("grpcurl") == "grpcurl"  # not in that venv: the bare name


def test_in_a_checkout_the_stack_logs_in_its_run_folder_and_prints_the_venvs_cli(
        monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "ROOT", tmp_path)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "tiercache").touch()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launcher.sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert Stack().log_dir == tmp_path / ".run" / "logs"
    assert launcher.tool_path("tiercache") == ".venv/bin/tiercache"


def test_a_services_log_file_is_readable_by_its_owner_only(monkeypatch, tmp_path):
    """Logs name tenants and quote refused calls' errors (and whatever DEBUG or a traceback
    says): created 0644 under the usual umask, every local user could read them. A log an
    older launcher left wider is tightened, and appended to, not cut."""
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, **kw: _Proc())
    old = os.umask(0o022)
    try:
        ServiceProcess("prefix", 1, log_path=tmp_path / "new.log").start()
        (tmp_path / "old.log").write_text("earlier run\n")
        os.chmod(tmp_path / "old.log", 0o644)
        p = ServiceProcess("prefix", 1, log_path=tmp_path / "old.log").start()
    finally:
        os.umask(old)
    for name in ("new.log", "old.log"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name
    assert (tmp_path / "old.log").read_text() == "earlier run\n"
    assert p._log_offset == len("earlier run\n")


@pytest.mark.model
def test_the_printed_example_sends_a_raw_prompt_where_the_model_has_no_chat_template(tmp_path):
    """The launcher printed a `messages` example (and a plain `chat`) whatever the model: one
    without a chat template refuses it (FAILED_PRECONDITION). Whether a folder has one is
    decided as the orchestrator's tokenizer (transformers) decides it, without loading it."""
    import shutil

    from google.protobuf import json_format
    from tiercache.v1 import orchestrator_pb2

    from services.common.model_store import load_tokenizer, resolve_model

    src = Path(resolve_model("smollm2").path)
    template = (src / "chat_template.jinja").read_text()

    def folder(name: str, jinja: str = "", extra: str = "", config: dict | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, d / f)
        if jinja:
            (d / "chat_template.jinja").write_text(jinja)
        if extra:
            (d / "additional_chat_templates").mkdir()
            (d / "additional_chat_templates" / "tool_use.jinja").write_text(extra)
        if config is not None:
            base = json.loads((d / "tokenizer_config.json").read_text())
            (d / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
        return d

    cases = {"jinja": folder("jinja", jinja=template), "none": folder("none"),
             "in-config": folder("in-config", config={"chat_template": template}),
             "empty-in-config": folder("empty-in-config", config={"chat_template": ""}),
             "named-only": folder("named-only", extra=template)}
    raw = (launcher.RAW_EXAMPLE_JSON, " --raw")
    chat = (launcher.EXAMPLE_JSON, "")
    got = {k: launcher.example_request({"TIERCACHE_ORCHESTRATOR_MODEL": str(d)})
           for k, d in cases.items()}
    assert got == {"jinja": chat, "none": raw, "in-config": chat, "empty-in-config": raw,
                   "named-only": chat}
    for k, d in cases.items():  # as the tokenizer the orchestrator loads says
        assert launcher.has_chat_template(d) == bool(load_tokenizer(str(d)).chat_template), k
    assert launcher.example_request({}) == chat  # SmolLM2, the default
    assert launcher.example_request({"TIERCACHE_ORCHESTRATOR_MODEL": " SmolLM2 "}) == chat
    req = json_format.Parse(launcher.RAW_EXAMPLE_JSON, orchestrator_pb2.GenerateRequest())
    assert req.prompt == launcher.EXAMPLE_QUESTION and not req.messages


def test_the_started_stack_is_announced_with_how_to_call_it(monkeypatch, capsys):
    """What `main` prints from the start to a child's exit: the services and the log folder,
    then, once every one is up, the orchestrator's address and a CLI and a grpcurl call of it;
    pinned before `main` was split into its steps."""
    monkeypatch.setattr(Stack, "stop", lambda self: None)
    monkeypatch.setattr(launcher, "tool_path", lambda name: f"/t/{name}")
    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)
    monkeypatch.setattr(launcher, "example_request", lambda env: ("{}", " --raw"))
    for name, said in (("tls_note", ""), ("cli_transport", ""), ("grpcurl_transport", "-p"),
                       ("auth_note", "")):
        monkeypatch.setattr(launcher, name, lambda *a, said=said, **k: said)
    assert _main(monkeypatch, _kvpool_dies_later) == 1
    out = capsys.readouterr().out
    first, rest = out.split("\n", 1)
    assert first.startswith("Starting TierCache (") and ", orchestrator" in first
    assert f"; logs in {launcher.run_dir() / 'logs' / f'pid-{os.getpid()}'}" in first
    assert rest == f"""
TierCache is up. Orchestrator: localhost:2
  CLI:      /t/tiercache --address localhost:2 chat --raw "{launcher.EXAMPLE_QUESTION}"
            /t/tiercache --address localhost:2 stats
  grpcurl:  /t/grpcurl -p -d '{{}}' \\
              localhost:2 tiercache.v1.Orchestrator/Generate
Ctrl-C stops everything.
stopped
"""


def test_only_a_free_port_stack_prunes_the_log_folders_of_finished_ones(monkeypatch, tmp_path):
    """A free-port run (--base-port 0) logs under its own pid, so such folders pile up: it
    prunes those of finished runs first. A stack on fixed ports logs in one folder each time
    and prunes nothing."""
    pruned: list = []
    monkeypatch.setattr(launcher, "run_dir", lambda: tmp_path)
    monkeypatch.setattr(launcher, "prune_pid_logs", pruned.append)
    assert launcher._log_dir(50051) == tmp_path / "logs"
    assert launcher._log_dir(53500) == tmp_path / "logs" / "port-53500"
    assert pruned == []
    assert launcher._log_dir(0) == tmp_path / "logs" / f"pid-{os.getpid()}"
    assert pruned == [tmp_path / "logs"]


def test_the_most_replicas_the_stack_runs_is_accepted_and_one_more_refused(monkeypatch, capsys):
    """--replicas takes 1..MAX_REPLICAS, both ends included."""
    monkeypatch.delenv("TIERCACHE_KVPOOL_METRICS_PORT", raising=False)
    top = launcher.MAX_REPLICAS
    assert launcher._parse_args(["--base-port", "0", "--replicas", str(top)]).replicas == top
    with pytest.raises(SystemExit):
        launcher._parse_args(["--base-port", "0", "--replicas", str(top + 1)])
    assert f"the stack needs 1..{top} kvpool replicas" in capsys.readouterr().err
