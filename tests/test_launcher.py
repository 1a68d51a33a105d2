"""The local launcher's stop: no child may outlive it, even when the stop is interrupted."""

import os
import subprocess
import sys

import pytest

from services.launcher import Stack


class FakeProcess:
    def __init__(self, name: str, log: list, interrupt: bool = False) -> None:
        self.name, self.log, self.interrupt = name, log, interrupt

    def stop(self) -> None:
        self.log.append(("stop", self.name))
        if self.interrupt:  # a second Ctrl-C while this one drains
            raise KeyboardInterrupt

    def kill(self) -> None:
        self.log.append(("kill", self.name))


def test_an_interrupted_stop_still_kills_every_child():
    log: list = []
    stack = Stack(replicas=0)
    stack.procs = {n: FakeProcess(n, log, interrupt=(n == "kvpool-0"))
                   for n in ("prefix", "kvpool-0", "orchestrator")}
    with pytest.raises(KeyboardInterrupt):
        stack.stop()
    assert log[:2] == [("stop", "orchestrator"), ("stop", "kvpool-0")]  # drains first
    assert {n for op, n in log if op == "kill"} == {"prefix", "kvpool-0", "orchestrator"}


class _Started:
    """A service `Stack.start` believes it started (see `fake_starts`)."""

    address, name, proc = "127.0.0.1:1", "fake", None

    def wait(self, timeout: float, others=()) -> None:
        pass

    def stop(self) -> None:
        pass

    def kill(self) -> None:
        pass


def fake_starts(monkeypatch) -> dict[str, dict[str, str]]:
    """Stack.start starts nothing; returns each service's environment as it would be."""
    started: dict[str, dict[str, str]] = {}

    def fake_start(self, name, port, env, key=None):
        started[key or name] = env
        self.procs[key or name] = _Started()
        return self.procs[key or name]

    monkeypatch.setattr(Stack, "_start", fake_start)
    return started


def test_make_run_keeps_metrics_ports_the_user_set(monkeypatch):
    """Metrics are off by default (local services would all want the same port), but a
    `TIERCACHE_<SVC>_METRICS_PORT` the user exported is kept; replica i gets that port + i."""
    started = fake_starts(monkeypatch)
    monkeypatch.setattr("services.launcher.semantic_db_env", lambda port, env: {})
    monkeypatch.setenv("TIERCACHE_KVPOOL_METRICS_PORT", "9300")
    monkeypatch.setenv("TIERCACHE_SEMANTIC_METRICS_PORT", "9199")
    monkeypatch.delenv("TIERCACHE_ORCHESTRATOR_METRICS_PORT", raising=False)
    Stack(replicas=2, base_port=0).start()
    assert started["semantic"]["TIERCACHE_SEMANTIC_METRICS_PORT"] == "9199"
    assert started["kvpool-0"]["TIERCACHE_KVPOOL_METRICS_PORT"] == "9300"
    assert started["kvpool-1"]["TIERCACHE_KVPOOL_METRICS_PORT"] == "9301"
    assert started["orchestrator"]["TIERCACHE_ORCHESTRATOR_METRICS_PORT"] == "-1"


@pytest.mark.parametrize(("env", "mode", "grpcurl", "note"), [
    ({}, "", "-plaintext", ""),
    ({"TIERCACHE_TLS_CERT": "s.pem", "TIERCACHE_TLS_KEY": "s.key"}, "roots", "", " (TLS)"),
    ({"TIERCACHE_TLS_CERT": "s.pem", "TIERCACHE_TLS_CA": "ca.pem"}, "ca", "-cacert ca.pem",
     " (TLS, mutual when client certificates are set)"),
    ({"TIERCACHE_TLS_CA": "ca.pem", "TIERCACHE_TLS_CLIENT_CERT": "c.pem",
      "TIERCACHE_TLS_CLIENT_KEY": "c.key"}, "ca", "-cacert ca.pem -cert c.pem -key c.key",
     " (TLS, mutual when client certificates are set)"),
])
def test_clients_health_wait_and_grpcurl_hint_agree_on_tls(monkeypatch, env, mode, grpcurl,
                                                           note):
    # One decision (tls_mode) behind the internal clients' credentials, the launcher's note
    # and the grpcurl flags it prints: a stack whose servers speak TLS is never called in
    # plaintext by one of them and over TLS by another.
    from services import launcher
    from services.common.grpc_client import channel_credentials_from_env, tls_mode

    for k in ("TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY", "TIERCACHE_TLS_CA",
              "TIERCACHE_TLS_CLIENT_CERT", "TIERCACHE_TLS_CLIENT_KEY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert tls_mode() == mode
    assert launcher.grpcurl_transport() == grpcurl
    assert launcher.tls_note() == note
    # The CLI reads TIERCACHE_TLS_CA itself; without a CA it needs --tls to speak TLS at all.
    assert launcher.cli_transport() == (" --tls" if mode == "roots" else "")
    if mode != "ca":  # (with a CA the files would be read)
        assert (channel_credentials_from_env() is None) == (mode == "")


def test_a_stack_refuses_to_start_on_a_port_something_already_listens_on(tmp_path):
    # Before: the new service's health check reached the old listener, "TierCache is up" was
    # printed, and the new service died failing to bind.
    import socket

    from services import launcher

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not launcher.port_is_free(port)
        stack = Stack(replicas=1, base_port=port, log_dir=tmp_path)
        with pytest.raises(RuntimeError, match=f"port {port} for orchestrator is in use"):
            stack._start("orchestrator", port, {})
        assert stack.procs == {}
        # start() looks at every port first: before, a second stack said it would use a
        # database of its own (the first's being in use) and only then found the port taken.
        second = Stack(replicas=1, base_port=port - 3, log_dir=tmp_path)  # kvpool-0's port
        with pytest.raises(RuntimeError, match=r"port \d+ is in use"):  # {port}, or one below
            second.start()
        assert second.procs == {}
    assert launcher.port_is_free(port)


def test_a_second_stack_gets_its_own_semantic_database(monkeypatch, tmp_path, capsys):
    """One semantic process per database: a second `make run ARGS=--base-port N` (which the
    port-in-use message suggests) would otherwise find the first stack's database locked."""
    import os

    from services.launcher import semantic_db_env
    from services.semantic.store import EntryStore

    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIERCACHE_SEMANTIC_DB_PATH", raising=False)
    monkeypatch.delenv("TIERCACHE_SEMANTIC_CACHE_DIR", raising=False)
    default = tmp_path / "semantic" / "semantic.db"
    assert semantic_db_env(50062, {}) == {}  # free: the default database
    holder = EntryStore(str(default))
    try:
        own = str(tmp_path / "semantic" / "semantic-50062.db")
        assert semantic_db_env(50062, {}) == {"TIERCACHE_SEMANTIC_DB_PATH": own}
        assert "in use by another stack" in capsys.readouterr().out
        EntryStore(own).close()  # and that one is free
        # Ports drawn at random (--base-port 0): a temporary database, not one file per run
        # left behind under a port number never used again; the stack deletes it at stop.
        started = fake_starts(monkeypatch)
        stack = Stack(replicas=1, base_port=0).start()
        tmp = started["semantic"]["TIERCACHE_SEMANTIC_DB_PATH"]
        assert "temporary" in capsys.readouterr().out
        EntryStore(tmp).close()  # the semantic service made it
        stack.stop()
        assert not os.path.exists(os.path.dirname(tmp))
        stack = Stack(replicas=1, base_port=50061).start()  # a chosen port: a named one, kept
        assert started["semantic"]["TIERCACHE_SEMANTIC_DB_PATH"].endswith("semantic-50061.db")
        stack.stop()
        # A database the user chose is theirs to manage.
        assert semantic_db_env(50062, {"TIERCACHE_SEMANTIC_DB_PATH": "/x.db"}) == {}
        monkeypatch.setenv("TIERCACHE_SEMANTIC_DB_PATH", "/y.db")
        assert semantic_db_env(50062, {}) == {}
    finally:
        holder.close()


def test_a_stack_without_replicas_is_a_usage_error(capsys):
    """--replicas 0 started semantic and prefix, then failed naming a variable the user never
    set (TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES)."""
    from services import launcher

    with pytest.raises(SystemExit) as e:
        launcher.main(["--replicas", "0"])
    assert e.value.code == 2
    assert "0: the stack needs 1..64 kvpool replicas" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "env", "words"), [
    # A bad variable was an error even with the flag given in its place.
    (["--replicas", "0"], {"TIERCACHE_REPLICAS": "abc"}, "--replicas (or TIERCACHE_REPLICAS) 0"),
    (["--replicas", "99999"], {}, "--replicas (or TIERCACHE_REPLICAS) 99999"),  # not --base-port
    (["--replicas", "3"], {"TIERCACHE_KVPOOL_METRICS_PORT": "65535"},
     "TIERCACHE_KVPOOL_METRICS_PORT: replica i serves metrics on the port + i"),
])
def test_launcher_usage_errors_name_what_was_given(capsys, monkeypatch, argv, env, words):
    from services import launcher

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        launcher.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_each_replica_gets_its_own_metrics_port_written_with_a_plus_too(monkeypatch):
    from services.launcher import metrics_env

    monkeypatch.setenv("TIERCACHE_KVPOOL_METRICS_PORT", "+9104")  # int() reads it
    assert [metrics_env("kvpool", i)["TIERCACHE_KVPOOL_METRICS_PORT"] for i in range(3)] == [
        "+9104", "9105", "9106"]
    for odd in ("++9104", "+-5", "abc"):  # left for the service to refuse, naming it
        monkeypatch.setenv("TIERCACHE_KVPOOL_METRICS_PORT", odd)
        assert metrics_env("kvpool", 1) == {"TIERCACHE_KVPOOL_METRICS_PORT": odd}


def test_the_database_probed_is_the_one_the_semantic_service_will_open(tmp_path, monkeypatch):
    """The semantic cache folder can be set for the stack (extra_env) or the user's shell."""
    from services.launcher import semantic_db_env
    from services.semantic.store import EntryStore

    monkeypatch.delenv("TIERCACHE_SEMANTIC_DB_PATH", raising=False)
    monkeypatch.delenv("TIERCACHE_SEMANTIC_CACHE_DIR", raising=False)
    holder = EntryStore(str(tmp_path / "semantic" / "semantic.db"))
    try:
        got = semantic_db_env(50070, {"TIERCACHE_SEMANTIC_CACHE_DIR": str(tmp_path)})
        assert got == {"TIERCACHE_SEMANTIC_DB_PATH":
                       str(tmp_path / "semantic" / "semantic-50070.db")}
        monkeypatch.setenv("TIERCACHE_SEMANTIC_CACHE_DIR", str(tmp_path))
        assert semantic_db_env(50070, {}) == got
    finally:
        holder.close()


class _Proc:
    """A child that outlives any wait: records how long `stop` gave it."""

    def __init__(self) -> None:
        self.waits: list = []
        self.signals: list = []

    def poll(self):
        return None

    def send_signal(self, sig) -> None:
        self.signals.append(sig)

    def kill(self) -> None:
        self.signals.append("kill")

    def wait(self, timeout=None):
        import subprocess

        self.waits.append(timeout)
        if timeout is not None:
            raise subprocess.TimeoutExpired("x", timeout)


@pytest.mark.parametrize(("name", "env", "want"), [
    ("kvpool", {"TIERCACHE_KVPOOL_GRACE_SECONDS": "60", "TIERCACHE_DRAIN_DELAY_S": "5"}, 80.0),
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_GRACE_S": "30"}, 45.0),
    ("semantic", {}, 25.0),
    ("prefix", {"TIERCACHE_PREFIX_GRACE_SECONDS": "nope"}, 25.0),  # refused by the service
])
def test_stop_waits_for_the_services_own_drain_before_killing_it(monkeypatch, name, env, want):
    """The launcher killed every child 15 s (+ drain delay) after SIGTERM: a kvpool set to
    drain for 60 s (as in the Kubernetes config) was cut short mid-drain."""
    from services.launcher import ServiceProcess

    for k in ("TIERCACHE_DRAIN_DELAY_S", f"TIERCACHE_{name.upper()}_GRACE_SECONDS",
              f"TIERCACHE_{name.upper()}_GRACE_S"):
        monkeypatch.delenv(k, raising=False)
    p = ServiceProcess(name, 1, env=env)
    p.proc = proc = _Proc()
    p.stop()
    assert proc.waits[0] == want and proc.signals[-1] == "kill"


def test_the_highest_base_port_whose_stack_fits_is_taken():
    """N..N+3+replicas-1 must fit under 65536: 65532 with one replica (65532..65535) was
    refused."""
    from services.launcher import ports_fit

    assert ports_fit(65532, 1) and not ports_fit(65533, 1)
    assert ports_fit(65530, 3) and not ports_fit(65531, 3)
    assert ports_fit(0, 8) and not ports_fit(-1, 1)


def test_sigint_stops_the_stack_even_when_it_arrived_ignored(monkeypatch, capsys):
    """Started in the background by a script, the launcher inherits SIGINT ignored (the
    shell's rule for `&`): `kill -INT` left the whole stack running. It now handles SIGINT
    itself, as it does SIGTERM."""
    import os
    import signal

    from services import launcher

    stopped = []

    def start(self):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the stack starts
        return self

    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(Stack, "stop", lambda self: stopped.append(True))
    monkeypatch.setattr(launcher, "semantic_db_env", lambda port, env: {})
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                               signal.SIGQUIT)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert launcher.main(["--base-port", "0"]) == 0
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert stopped and "stopping" in capsys.readouterr().out


def test_a_service_that_fails_at_start_is_named_with_the_problem_its_log_gives(tmp_path):
    """"process for 127.0.0.1:47102 exited with 2; see logs in ..." named neither the service
    nor why: the reason was in one log file among several."""
    from services import launcher

    log = tmp_path / "prefix.log"
    # An earlier run's problem, already fixed: the log is appended to across runs.
    log.write_text('{"level": "ERROR", "msg": "bad configuration: an old problem"}\n')
    stack = Stack(replicas=1, base_port=0, log_dir=tmp_path)
    p = stack._start("prefix", launcher.free_port(),
                     {"TIERCACHE_PREFIX_METRICS_PORT": "-1",
                      "TIERCACHE_PREFIX_MAX_NODES": "many"})
    try:
        with pytest.raises(RuntimeError) as err:
            p.wait(60)
    finally:
        stack.stop()
    msg = str(err.value)
    assert msg.startswith(f"prefix ({p.address}) exited with 2: bad configuration: "), msg
    assert "TIERCACHE_PREFIX_MAX_NODES" in msg and "old problem" not in msg


def test_the_problem_quoted_is_the_last_configuration_line_else_the_last_error(tmp_path):
    from services.launcher import last_problem

    log = tmp_path / "s.log"
    log.write_text('{"level": "INFO", "msg": "starting"}\n'
                   '{"level": "ERROR", "msg": "bad configuration: X: wrong"}\n'
                   '{"level": "ERROR", "msg": "cannot start: Y"}\n'
                   "Traceback (most recent call last):\n")
    assert last_problem(log) == "bad configuration: X: wrong"
    log.write_text('{"level": "ERROR", "msg": "cannot start: Y"}\n'
                   '{"level": "WARNING", "msg": "z"}\n')
    assert last_problem(log) == "cannot start: Y"
    assert last_problem(log, offset=log.stat().st_size) is None
    assert last_problem(tmp_path / "none.log") is None and last_problem(None) is None


def test_free_port_stacks_prune_the_log_folders_of_finished_launchers(tmp_path):
    # Before: every `--base-port 0` run left .run/logs/pid-N behind, without end.
    from services import launcher

    dead = []
    for i in range(launcher.KEPT_PID_LOGS + 3):
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        d = tmp_path / f"pid-{proc.pid}"
        d.mkdir()
        (d / "orchestrator.log").write_text("x")
        os.utime(d, (1000 + i, 1000 + i))
        dead.append(d)
    live = tmp_path / f"pid-{os.getpid()}"  # this process: still running
    live.mkdir()
    os.utime(live, (1, 1))
    other = tmp_path / "port-50100"
    other.mkdir()
    for stray in ("pid-99999999999999999999", "pid-\u0663\u0664", "pid-x"):  # not pids
        (tmp_path / stray).mkdir()
    removed = launcher.prune_pid_logs(tmp_path)
    assert sorted(removed) == sorted(dead[:3])  # the oldest finished ones
    assert all(d.exists() for d in dead[3:]) and live.exists() and other.exists()
    assert (tmp_path / "pid-x").exists()
