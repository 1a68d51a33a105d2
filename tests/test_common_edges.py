"""Shared infrastructure at its edges: TLS variables, the internal token, flags over env,
request ids, the hash key, the probe's timeout and the launcher's signals and ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config, require_addresses
from services.prefix.config import PrefixConfig
from tests.waits import holds_within, wait_until

ROOT = Path(__file__).resolve().parent


@pytest.mark.parametrize(("env", "problem"), [
    ({"TIERCACHE_TLS_CA": "ca.pem", "TIERCACHE_TLS_CLIENT_KEY": "k.pem"}, "CLIENT_CERT"),
    ({"TIERCACHE_TLS_CA": "ca.pem", "TIERCACHE_TLS_CLIENT_CERT": "c.pem"}, "CLIENT_CERT"),
    ({"TIERCACHE_TLS_CA": "ca.pem"}, "TIERCACHE_TLS_CERT"),  # servers plaintext, clients TLS
    ({}, ""),
    ({"TIERCACHE_TLS_CERT": "s.pem", "TIERCACHE_TLS_KEY": "s.key"}, ""),
])
def test_tls_variables_that_cannot_work_are_named(env, problem):
    from services.common.grpc_client import channel_credentials_from_env, tls_env_problem

    got = tls_env_problem(env)
    assert (problem in got) if problem else got == ""
    if "CLIENT" in problem:
        # gRPC's C core aborted the whole process on half a client key pair.
        with pytest.raises(ValueError, match="together"):
            channel_credentials_from_env(env)


def test_a_service_refuses_to_start_on_half_a_tls_client_pair():
    env = {**os.environ, "TIERCACHE_TLS_CA": "/nonexistent/ca.pem",
           "TIERCACHE_TLS_CERT": "/nonexistent/s.pem", "TIERCACHE_TLS_KEY": "/nonexistent/s.key",
           "TIERCACHE_TLS_CLIENT_KEY": "/nonexistent/k.pem",
           "TIERCACHE_PREFIX_ADDRESS": "127.0.0.1:0", "TIERCACHE_PREFIX_METRICS_PORT": "-1"}
    r = subprocess.run([sys.executable, "-m", "services.prefix"], cwd=ROOT.parent, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "TIERCACHE_TLS_CLIENT_CERT" in r.stdout + r.stderr


@pytest.fixture(scope="module")
def two_cert_sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    for name in ("a", "b"):
        subprocess.run([str(ROOT.parent / "scripts" / "gen-certs.sh"), str(root / name)],
                       check=True, capture_output=True, timeout=60)
    return root / "a", root / "b"


@pytest.mark.parametrize("case", ["cert without key", "own cert with the shared key",
                                  "own key without any cert"])
def test_a_server_pair_that_cannot_work_is_refused_at_start(two_cert_sets, case):
    """Half the server's pair was a ValueError traceback at bind (exit 1); a service's own
    certificate beside the shared key of another certificate failed in gRPC's C core and was
    reported as "cannot listen on <address>". Each is now one line naming the variables, and
    exit 2, before anything binds."""
    from services.common.grpc_client import tls_env_problem, tls_files_problem

    a, b = two_cert_sets
    env = {"cert without key": {"TIERCACHE_TLS_CERT": str(a / "server.pem")},
           "own cert with the shared key": {
               "TIERCACHE_TLS_CERT": str(a / "server.pem"),
               "TIERCACHE_TLS_KEY": str(a / "server.key"),
               "TIERCACHE_PREFIX_TLS_CERT": str(b / "server.pem")},
           "own key without any cert": {"TIERCACHE_PREFIX_TLS_KEY": str(b / "server.key")},
           }[case]
    want = {"cert without key": "TIERCACHE_TLS_CERT and TIERCACHE_TLS_KEY must be set together",
            "own cert with the shared key": "TIERCACHE_PREFIX_TLS_CERT (",
            "own key without any cert":
                "TIERCACHE_TLS_CERT and TIERCACHE_PREFIX_TLS_KEY must be set together"}[case]
    assert want in (tls_env_problem(env, service="prefix") or tls_files_problem("prefix", env))
    r = subprocess.run([sys.executable, "-m", "services.prefix"], cwd=ROOT.parent,
                       env={**os.environ, **env, "TIERCACHE_PREFIX_ADDRESS": "127.0.0.1:0",
                            "TIERCACHE_PREFIX_METRICS_PORT": "-1"},
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and want in out and "Traceback" not in out, out[-2000:]
    # The shared pair alone, and a service's own whole pair beside it, are fine.
    good = {"TIERCACHE_TLS_CERT": str(a / "server.pem"),
            "TIERCACHE_TLS_KEY": str(a / "server.key")}
    assert tls_env_problem(good, "prefix") == tls_files_problem("prefix", good) == ""
    good |= {"TIERCACHE_PREFIX_TLS_CERT": str(b / "server.pem"),
             "TIERCACHE_PREFIX_TLS_KEY": str(b / "server.key")}
    assert tls_env_problem(good, "prefix") == tls_files_problem("prefix", good) == ""


@pytest.mark.parametrize(("raw", "want"), [("s3cret\n", "s3cret"), ("  s3cret ", "s3cret")])
def test_the_internal_token_is_trimmed(raw, want):
    cfg = load_config(PrefixConfig, "prefix", [], {"TIERCACHE_PREFIX_INTERNAL_TOKEN": raw})
    assert cfg.internal_token == want


@pytest.mark.parametrize("raw", ["tökén", "two words", "ctl\x01", "", "\n", "   "])
def test_an_internal_token_grpc_cannot_send_is_refused_at_load(raw):
    """It loaded, the service said SERVING, and every internal call then failed INTERNAL
    ("Invalid metadata") on the caller's side. Set but empty (a Secret from an unset variable
    or an empty file) it turned internal authentication off."""
    with pytest.raises(ConfigError, match="TIERCACHE_PREFIX_INTERNAL_TOKEN"):
        load_config(PrefixConfig, "prefix", [], {"TIERCACHE_PREFIX_INTERNAL_TOKEN": raw})


def test_a_flag_wins_without_the_env_value_it_overrides_being_read():
    cfg = load_config(PrefixConfig, "prefix", ["--block-size", "32"],
                      {"TIERCACHE_PREFIX_BLOCK_SIZE": "sixteen"})
    assert cfg.block_size == 32
    with pytest.raises(ConfigError, match="TIERCACHE_PREFIX_BLOCK_SIZE"):
        load_config(PrefixConfig, "prefix", [], {"TIERCACHE_PREFIX_BLOCK_SIZE": "sixteen"})


def test_an_address_with_surrounding_spaces_binds_as_validated():
    """" 127.0.0.1:0" passed validation (which strips it), then failed to bind."""
    from services.common.bootstrap import create_server

    cfg = load_config(PrefixConfig, "prefix", [], {"TIERCACHE_PREFIX_ADDRESS": " 127.0.0.1:0 "})
    h = create_server(service="prefix", address=cfg.address, services=[])
    try:
        assert h.port > 0
    finally:
        h.stop(0)


def test_ports_are_ascii_digits():
    with pytest.raises(ConfigError, match="TIERCACHE_PREFIX_X"):
        require_addresses(["127.0.0.1:\u0665\u0660\u0660\u0665\u0664"], "prefix", "x",
                          allow_none=False)


def test_a_hash_key_that_is_not_utf8_is_used_as_bytes(monkeypatch):
    from services.common.hashing import hash_key_from_env

    monkeypatch.setitem(os.environb, b"TIERCACHE_HASH_KEY", b"\xff\xfe-key")
    assert hash_key_from_env() == b"\xff\xfe-key"  # was a UnicodeEncodeError traceback


def test_pure_python_hash_reads_booleans_like_the_config():
    from services.common import hashing

    if not hashing.native():
        pytest.skip("no C block hasher here")
    probe = "from services.common import hashing; print(hashing.native())"
    for value, native in (("false", "True"), ("off", "True"), ("true", "False"),
                          ("on", "False"), ("1", "False"), ("yes", "False")):
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT.parent, timeout=60,
                             env={**os.environ, "TIERCACHE_PURE_PYTHON_HASH": value},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == native, value


@pytest.mark.parametrize("timeout", ["inf", "1e10", "0", "nan"])
def test_the_probe_refuses_timeouts_grpc_cannot_keep(timeout):
    from services.common import probe

    with pytest.raises(SystemExit) as e:
        probe.main(["127.0.0.1:1", "--timeout", timeout])
    assert e.value.code == 2


def test_a_client_request_id_is_kept_only_when_short_and_plain():
    """A client's id goes into every log line and downstream call: a 12 KB one failed calls
    two hops down (metadata too large)."""
    import grpc

    from services.common.bootstrap import create_server
    from services.common.logs import request_id_var

    seen: list[str] = []

    def call(request: bytes, context) -> bytes:
        seen.append(request_id_var.get())
        return b""

    def add(_servicer, server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "x.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call)}),))

    handle = create_server(service="rid-test", address="127.0.0.1:0",
                           services=[(add, None, "x.Echo")])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            echo = ch.unary_unary("/x.Echo/Call")
            for rid in ("req-1.a:b", "x" * 5000, "bad id", "a/b"):
                echo(b"", timeout=5, metadata=[("x-request-id", rid)])
    finally:
        handle.stop(0)
    assert seen[0] == "req-1.a:b"
    assert len(seen) == 4 and all(len(r) == 16 for r in seen[1:]), seen


def test_a_refused_call_leaves_one_line_with_its_request_id_and_a_flood_is_thinned():
    """Refused and failed calls (INVALID_ARGUMENT, NOT_FOUND, CANCELLED) left no log line: a
    support ticket quoting a request id could not be traced."""
    import logging

    import grpc

    from services.common import bootstrap, errors
    from services.common.bootstrap import create_server
    from tests.log_lines import lines_with_ids

    def call(request: bytes, context) -> bytes:
        raise errors.InvalidArgument("text", "must not be empty")

    def add(_servicer, server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "x.Refuse", {"Call": grpc.unary_unary_rpc_method_handler(call)}),))

    # INFO: the services' default (TIERCACHE_LOG_LEVEL).
    with lines_with_ids(bootstrap.log.name, logging.INFO) as seen:
        bootstrap._ERROR_LINES = bootstrap.Thinned(bootstrap.log, per_window=3, window_s=60.0)
        handle = create_server(service="refuse-test", address="127.0.0.1:0",
                               services=[(add, None, "x.Refuse")])
        try:
            with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
                refuse = ch.unary_unary("/x.Refuse/Call")
                for i in range(5):
                    with pytest.raises(grpc.RpcError):
                        refuse(b"", timeout=5, metadata=[("x-request-id", f"ticket-{i}")])
        finally:
            handle.stop(0)
            bootstrap._ERROR_LINES = bootstrap.Thinned(bootstrap.log)
    lines = [(m, rid) for m, rid in seen if "ended INVALID_ARGUMENT" in m]
    assert lines == [("Call ended INVALID_ARGUMENT: text: must not be empty", f"ticket-{i}")
                     for i in range(3)]  # then thinned


@pytest.mark.parametrize("port", ["65535", "-1", "70000"])
def test_the_launcher_refuses_a_base_port_its_stack_cannot_fit(port):
    from services.launcher import main

    with pytest.raises(SystemExit) as e:
        main(["--base-port", port])
    assert e.value.code == 2


@pytest.fixture
def saved_signals():
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    old = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, h in old.items():
        signal.signal(s, h)


def test_a_closed_terminal_stops_the_stack(monkeypatch, saved_signals):
    """SIGHUP (the terminal closed) left every child running: they have their own sessions,
    and the next `make run` found the ports taken."""
    from services.launcher import Stack, main

    stopped: list[bool] = []

    def start(self):
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(2)  # the handler interrupts this
        raise AssertionError("SIGHUP did not interrupt the start")

    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(Stack, "stop", lambda self: stopped.append(True))
    assert main(["--base-port", "0", "--replicas", "1"]) == 0
    assert stopped == [True]


def test_a_service_that_died_while_others_started_fails_the_start(monkeypatch, saved_signals,
                                                                   capsys):
    """Each service was waited for in turn and never checked again: one that died meanwhile
    still got "TierCache is up" printed."""
    from services.launcher import ServiceProcess, Stack, main

    class Proc:
        def __init__(self, code):
            self.returncode = code

        def poll(self):
            return self.returncode

    def Child(code):  # noqa: N802 - a started service, its process a stand-in
        p = ServiceProcess("semantic" if code else "orchestrator", 1, {})
        p.proc = Proc(code)
        return p

    def start(self):
        self.procs = {"semantic": Child(1), "orchestrator": Child(None)}
        return self

    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(Stack, "stop", lambda self: None)
    assert main(["--base-port", "0", "--replicas", "1"]) == 1
    out = capsys.readouterr()
    assert "TierCache is up" not in out.out
    assert "semantic (127.0.0.1:1) exited with 1" in out.err


def test_tls_files_that_cannot_be_read_or_are_not_pem_are_named(tmp_path):
    """A bad certificate file surfaced as gRPC's "Failed to bind to address"."""
    from services.common.grpc_client import tls_files_problem

    good = tmp_path / "good.pem"
    good.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    assert tls_files_problem("prefix", {"TIERCACHE_TLS_CERT": str(good)}) == ""
    got = tls_files_problem("prefix", {"TIERCACHE_TLS_CERT": str(good),
                                       "TIERCACHE_TLS_KEY": str(junk)})
    assert got.startswith("TIERCACHE_TLS_KEY:") and "not a PEM" in got
    # A key given as the CA was reported as "cannot listen on <address>" (the port in use).
    key = tmp_path / "key.pem"
    key.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    got = tls_files_problem("prefix", {"TIERCACHE_TLS_CA": str(key)})
    assert got.startswith(f"TIERCACHE_TLS_CA: {key} holds no CA certificate")
    got = tls_files_problem("prefix", {"TIERCACHE_PREFIX_TLS_CERT": str(tmp_path / "none")})
    assert got.startswith("TIERCACHE_PREFIX_TLS_CERT: cannot read")
    env = {**os.environ, "TIERCACHE_TLS_CERT": str(junk), "TIERCACHE_TLS_KEY": str(junk),
           "TIERCACHE_PREFIX_ADDRESS": "127.0.0.1:0", "TIERCACHE_PREFIX_METRICS_PORT": "-1"}
    r = subprocess.run([sys.executable, "-m", "services.prefix"], cwd=ROOT.parent, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "TIERCACHE_TLS_CERT" in r.stdout + r.stderr


def test_the_launcher_waits_out_a_services_drain_delay_before_sigkill(monkeypatch):
    from services.launcher import ServiceProcess

    waited: list[float] = []

    class Proc:
        def poll(self):
            return None

        def send_signal(self, sig):
            pass

        def wait(self, timeout=None):
            waited.append(timeout)

    p = ServiceProcess("prefix", 1, env={"TIERCACHE_DRAIN_DELAY_S": "20"})
    p.proc = Proc()
    p.stop()
    monkeypatch.delenv("TIERCACHE_DRAIN_DELAY_S", raising=False)
    plain = ServiceProcess("prefix", 1)
    plain.proc = Proc()
    plain.stop()
    assert waited[0] >= 20 + 10 and waited[1] >= 10


def test_client_values_in_status_messages_are_cut_short():
    from services.common.errors import SHOWN_CHARS, shown

    assert shown("tier") == "'tier'"
    long = shown("x" * 100)
    assert long.endswith("... (100 characters)") and len(long) < SHOWN_CHARS + 30


def test_no_status_message_is_longer_than_the_cap():
    """The backstop behind errors.shown: gRPC refuses a status over 16 KiB of metadata."""
    from services.common.bootstrap import MAX_DETAILS_CHARS, _capped

    assert _capped("short") == "short"
    cut = _capped("y" * 10_000)
    assert cut.startswith("y" * MAX_DETAILS_CHARS) and cut.endswith("characters cut)")
    assert len(cut) < MAX_DETAILS_CHARS + 40


def test_a_ca_with_only_the_services_own_certificate_pair_is_accepted():
    """docs/reliability.md allows TIERCACHE_<SERVICE>_TLS_CERT/_KEY per service; with a CA and
    only those, the start was refused for want of the shared pair."""
    from services.common.grpc_client import tls_env_problem

    env = {"TIERCACHE_TLS_CA": "ca.pem", "TIERCACHE_PREFIX_TLS_CERT": "p.pem",
           "TIERCACHE_PREFIX_TLS_KEY": "p.key"}
    assert tls_env_problem(env, service="prefix") == ""
    assert "TIERCACHE_TLS_CERT" in tls_env_problem(env, service="semantic")  # not its pair


def test_an_unexpected_error_in_a_stream_is_logged_with_its_request_id():
    """The stream path reset the request id before mapping the error, so the traceback of an
    INTERNAL in Generate (the client is told "see server logs") had no id to find it by."""
    import logging

    import grpc

    from services.common.bootstrap import create_server
    from services.common.logs import request_id_var

    def call(request: bytes, context):
        yield b"one"
        raise RuntimeError("boom")

    def add(_servicer, server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "x.Stream", {"Call": grpc.unary_stream_rpc_method_handler(call)}),))

    seen: list[tuple[str, str]] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info:
                seen.append((record.getMessage(), request_id_var.get()))

    grab = Grab()
    logging.getLogger().addHandler(grab)
    handle = create_server(service="rid-stream", address="127.0.0.1:0",
                           services=[(add, None, "x.Stream")])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stream = ch.unary_stream("/x.Stream/Call")
            with pytest.raises(grpc.RpcError) as e:
                list(stream(b"", timeout=5, metadata=[("x-request-id", "req-42")]))
    finally:
        handle.stop(0)
        logging.getLogger().removeHandler(grab)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert seen and seen[0][0].startswith("unhandled error") and seen[0][1] == "req-42", seen


def test_a_service_started_by_the_launcher_stops_when_the_launcher_is_killed(tmp_path):
    """Services run in their own sessions (Ctrl-C reaches the launcher alone); a launcher
    killed with SIGKILL left every one of them running, holding the stack's ports. Each
    now stops once its parent is gone."""
    import signal
    import textwrap
    import time

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from services.launcher import ServiceProcess, free_port
        p = ServiceProcess("prefix", free_port(), env={{"TIERCACHE_PREFIX_METRICS_PORT": "-1"}})
        p.start().wait(60)
        pathlib.Path({str(pid_file)!r}).write_text(str(p.proc.pid))
        time.sleep(600)
        """)], cwd=ROOT.parent,
        env={**os.environ, "PYTHONPATH": f"{ROOT.parent}:{ROOT.parent / 'gen'}"})
    child = 0
    try:
        end = time.monotonic() + 90
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < end, "the service did not start"
            time.sleep(0.2)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not _alive(child), 20, "the service outlived its launcher", every=0.2)
        child = 0
    finally:
        if parent.poll() is None:
            parent.kill()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (not a zombie waiting for its reaper, which init is after re-parenting)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_launcher_says_a_conversion_comes_only_when_one_will(tmp_path):
    """The launcher looked only at the default cache folder, without the version check: it
    announced a 30-60 s conversion for a stack on a model folder (nothing converts), and
    none for a stale conversion (converted again)."""
    import json

    from services.common import model_store
    from services.launcher import model_to_convert

    folder = tmp_path / "hf-model"
    folder.mkdir()
    both_folders = {"TIERCACHE_KVPOOL_MODEL": str(folder),
                    "TIERCACHE_ORCHESTRATOR_MODEL": str(folder),
                    "TIERCACHE_CACHE_DIR": str(tmp_path / "empty")}
    assert not model_to_convert(both_folders)
    empty = {"TIERCACHE_KVPOOL_CACHE_DIR": str(tmp_path / "empty"),
             "TIERCACHE_ORCHESTRATOR_MODEL": str(folder)}
    assert model_to_convert(empty)
    # A conversion of another source (an older release): converted again, so said.
    stale = tmp_path / "stale" / "models" / model_store.SMOLLM2_MODEL_ID
    stale.mkdir(parents=True)
    (stale / model_store._DONE_MARKER).write_text('{"source_id": "older", "files": {}}')
    assert model_to_convert({"TIERCACHE_KVPOOL_CACHE_DIR": str(tmp_path / "stale"),
                             "TIERCACHE_ORCHESTRATOR_MODEL": str(folder)})
    # The current one, where the services look: nothing to say.
    sid = model_store.source_id(model_store.packaged_gguf_path())
    (stale / model_store._DONE_MARKER).write_text(json.dumps({"source_id": sid, "files": {}}))
    assert not model_to_convert({"TIERCACHE_KVPOOL_CACHE_DIR": str(tmp_path / "stale"),
                                 "TIERCACHE_ORCHESTRATOR_MODEL": str(folder)})


def test_a_variable_no_setting_reads_is_refused_with_the_closest_name():
    """TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESS (singular) was ignored: the default replica
    address stayed in force and the service said it was ready."""
    from services.orchestrator.config import OrchestratorConfig

    env = {"TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESS": "10.0.0.1:50054",
           "TIERCACHE_ORCHESTRATOR_TLS_CERT": "c.pem",  # read by the TLS set-up, not a field
           "TIERCACHE_KVPOOL_NOT_MINE": "1"}  # another service's prefix: not this one's to judge
    with pytest.raises(ConfigError, match=r"^TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESS \(did you "
                                          r"mean TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES\?\)"):
        load_config(OrchestratorConfig, "orchestrator", [], env)
    env.pop("TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESS")
    # What Kubernetes adds for a Service named tiercache-orchestrator (service links) is no
    # typo: refused, every pod crash-looped.
    env.update({"TIERCACHE_ORCHESTRATOR_SERVICE_HOST": "10.0.0.9",
                "TIERCACHE_ORCHESTRATOR_SERVICE_PORT": "50051",
                "TIERCACHE_ORCHESTRATOR_SERVICE_PORT_GRPC": "50051",
                "TIERCACHE_ORCHESTRATOR_PORT": "tcp://10.0.0.9:50051",
                "TIERCACHE_ORCHESTRATOR_PORT_50051_TCP": "tcp://10.0.0.9:50051",
                "TIERCACHE_ORCHESTRATOR_PORT_50051_TCP_ADDR": "10.0.0.9",
                # A Service tiercache-orchestrator-public (a LoadBalancer), IPv6.
                "TIERCACHE_ORCHESTRATOR_PUBLIC_SERVICE_HOST": "fd00:10:96::a",
                "TIERCACHE_ORCHESTRATOR_PUBLIC_PORT": "tcp://[fd00:10:96::a]:50051",
                "TIERCACHE_ORCHESTRATOR_PUBLIC_PORT_50051_TCP_PROTO": "tcp",
                "TIERCACHE_ORCHESTRATOR_PUBLIC_PORT_50051_TCP_PORT": "50051"})
    assert load_config(OrchestratorConfig, "orchestrator", [], env).kvpool_addresses
    # ... but only those, by name and value: a name merely ending in _PORT is a typo.
    for typo, value in (("TIERCACHE_ORCHESTRATOR_METRIC_PORT", "9999"),
                        ("TIERCACHE_ORCHESTRATOR_PORT", "6000"),
                        ("TIERCACHE_ORCHESTRATOR_GRPC_PORT", "6000")):
        with pytest.raises(ConfigError, match=f"^{typo}"):
            load_config(OrchestratorConfig, "orchestrator", [], {**env, typo: value})


@pytest.mark.parametrize(("name", "hint"), [
    ("TIERCACHE_ORCHESTRATOR_DEBUG", None),  # nothing close: no made-up hint (was "MODEL")
    ("TIERCACHE_ORCHESTRATOR_TLS_CA", "TIERCACHE_TLS_CA"),
    ("TIERCACHE_ORCHESTRATOR_TLS_CLIENT_CERT", "TIERCACHE_TLS_CLIENT_CERT"),
    ("TIERCACHE_ORCHESTRATOR_SEMANTIC_ADRESS", "TIERCACHE_ORCHESTRATOR_SEMANTIC_ADDRESS"),
])
def test_the_hint_for_an_unknown_name_is_a_real_neighbour(name, hint):
    from services.orchestrator.config import OrchestratorConfig

    with pytest.raises(ConfigError) as e:
        load_config(OrchestratorConfig, "orchestrator", [], {name: "x"})
    msg = str(e.value)
    assert msg.startswith(name)
    assert (f"did you mean {hint}?" in msg) if hint else "did you mean" not in msg
    assert "TIERCACHE_ORCHESTRATOR_TLS_CERT/_KEY" in msg


def test_a_flag_is_never_taken_for_a_longer_one():
    """--max-tokens 512 silently set max_tokens_limit (argparse's abbreviations)."""
    from services.orchestrator.config import OrchestratorConfig

    with pytest.raises(SystemExit):
        load_config(OrchestratorConfig, "orchestrator", ["--max-tokens", "512"], {})
    cfg = load_config(OrchestratorConfig, "orchestrator", ["--max-tokens-limit", "512"], {})
    assert cfg.max_tokens_limit == 512


def test_addresses_gRPC_cannot_reach_are_refused_with_the_fix():
    """'a:1;b:2' and 'http://a:1' started and reported ready; a bare IPv6 address to dial
    failed at every call ("Misformatted domain name"), and to listen on was reported as "the
    port is in use"."""
    from services.common.config import is_host_port, require_listen_address

    for bad in ("a:1;b:2", "http://a:1", "a/b:1"):
        with pytest.raises(ConfigError, match="is not host:port"):
            require_addresses([bad], "orchestrator", "kvpool_addresses", allow_none=False)
    with pytest.raises(ConfigError, match=r"IPv6 address goes in brackets: \[fd00::1\]:port"):
        require_addresses(["fd00::1:50054"], "orchestrator", "kvpool_addresses",
                          allow_none=False)
    with pytest.raises(ConfigError, match=r"TIERCACHE_PREFIX_ADDRESS: .*in brackets"):
        require_listen_address("::1:58101", "prefix")
    require_addresses(["[fd00::1]:50054", "dns:///kvpool-0.kvpool:50054", "kv-0:50054"],
                      "orchestrator", "kvpool_addresses", allow_none=False)
    require_listen_address("[::]:50054", "prefix")
    # An address nobody dials (a replica's advertised pod IP) may stay bare.
    assert is_host_port("fd00:10:244::5:50054") and not is_host_port("fd00::5:1", dialed=True)


def test_library_progress_bars_are_off_when_logs_go_to_a_file():
    """transformers' "Loading weights: 0%|...\\r" bar went into kvpool's JSON-lines log (a file,
    a pod's stderr) and broke its parsing."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    probe = ("import transformers.utils.logging as l; from services.common.logs import "
             "setup_logging; assert l.is_progress_bar_enabled(); setup_logging('x'); "
             "print(l.is_progress_bar_enabled())")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env["PYTHONPATH"] = f"{root}{os.pathsep}{root / 'gen'}"
    r = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]


def test_our_own_step_bar_is_a_log_line_per_step_when_logs_go_to_a_file(monkeypatch, caplog):
    """A conversion's or an export's tqdm bar wrote carriage-return lines into the JSON-lines
    log (a file, a pod's stderr), as the libraries' bars had: off a terminal each step done
    is an INFO line instead, naming the step."""
    import io
    import logging

    from services.common.logs import step_progress

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    caplog.set_level(logging.INFO)
    with step_progress(2, "converting M", logging.getLogger("t")) as bar:
        bar.set_postfix_str("load")
        bar.update(1)
        bar.update(1)
    assert [r.getMessage() for r in caplog.records] == [
        "converting M: 1/2 steps done (load)", "converting M: 2/2 steps done"]
    assert err.getvalue() == ""


def test_thinned_error_lines_are_counted_even_when_their_flood_stops(caplog):
    """The count of lines left out was said only by the same key's next line: a flood that
    stopped was never counted. Any key's line after the window says it, and so does a stop;
    the line says when they were left out, under no request's id (an operator saw one carry
    an unrelated request's id, minutes after the lines it counted)."""
    import logging
    import re
    import time

    from services.common import bootstrap
    from services.common.logs import bound_request_id
    from tests.log_lines import lines_with_ids

    t = bootstrap.Thinned(bootstrap.log, per_window=1, window_s=0.05)
    t.SWEEP_S = 0.0
    with lines_with_ids(bootstrap.log.name, logging.INFO) as lines, \
            caplog.at_level(logging.INFO, logger=bootstrap.log.name):
        assert t.allow(("svc", "Lookup", "INVALID_ARGUMENT"))
        assert not t.allow(("svc", "Lookup", "INVALID_ARGUMENT"))
        assert not t.allow(("svc", "Lookup", "INVALID_ARGUMENT"))
        assert "left out" not in caplog.text  # the window is not over
        time.sleep(0.06)
        with bound_request_id("unrelated-request"):
            assert t.allow(("svc", "Store", "NOT_FOUND"))  # another key
        assert re.search(r"svc/Lookup/INVALID_ARGUMENT: 2 more lines left out between "
                         r"\d\d:\d\d:\d\d and \d\d:\d\d:\d\dZ", caplog.text)
        assert not t.allow(("svc", "Store", "NOT_FOUND"))
        t.flush()
    assert "svc/Store/NOT_FOUND: 1 more lines left out" in caplog.text
    assert caplog.text.count("left out") == 2
    assert [rid for m, rid in lines if "left out" in m] == ["", ""]


def test_a_stream_cut_at_the_end_of_the_servers_drain_is_counted_unavailable():
    """An operator's SIGTERM of the orchestrator cut a 256-token stream at the end of its
    grace: the log said "Generate ended CANCELLED: client cancelled", and the metric agreed,
    while the client got UNAVAILABLE."""
    import threading
    import time

    import grpc

    from services.common.bootstrap import create_server
    from services.common.metrics import RPC_TOTAL

    started = threading.Event()

    def slow(request: bytes, context):
        started.set()
        for _ in range(200):
            yield b"x"
            time.sleep(0.05)

    def add(_servicer, server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "x.Slow", {"Stream": grpc.unary_stream_rpc_method_handler(slow)}),))

    def count(code: str) -> float:
        return RPC_TOTAL.labels("cut-test", "Stream", code)._value.get()

    before = {c: count(c) for c in ("CANCELLED", "UNAVAILABLE")}
    handle = create_server(service="cut-test", address="127.0.0.1:0",
                           services=[(add, None, "x.Slow")])
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        call = channel.unary_stream("/x.Slow/Stream")(b"", timeout=30)
        got = []

        def read() -> None:
            try:
                for m in call:
                    got.append(m)
            except grpc.RpcError as e:
                got.append(e.code())

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(10)
        handle.stop(0.3)
        reader.join(10)
        assert got[-1] == grpc.StatusCode.UNAVAILABLE
        holds_within(lambda: count("UNAVAILABLE") != before["UNAVAILABLE"], 5, 0.05)
        assert count("UNAVAILABLE") == before["UNAVAILABLE"] + 1
        assert count("CANCELLED") == before["CANCELLED"]
    finally:
        channel.close()
        handle.stop(0)


def test_a_thinned_count_is_said_when_its_outage_ends_with_no_later_line(caplog):
    """The orchestrator's per-dependency WARNINGs stop with the outage: no later line of the
    same instance came to say how many were left out, and only the error lines were flushed
    at stop (a review of the change that thinned them)."""
    import logging

    from services.common.logs import Thinned

    log = logging.getLogger("tests.thinned-outage")
    t = Thinned(log, per_window=1, window_s=0.05)
    with caplog.at_level(logging.INFO, logger=log.name):
        assert t.allow(("replica r1", "UNAVAILABLE"))
        assert not t.allow(("replica r1", "UNAVAILABLE"))
        # no call of `t` at all: the background sweep says it
        holds_within(lambda: "left out" in caplog.text, 3 * Thinned.SWEEP_S + 1, 0.05)
    assert "replica r1/UNAVAILABLE: 1 more lines left out" in caplog.text
    t2 = Thinned(log, per_window=1, window_s=60.0)
    with caplog.at_level(logging.INFO, logger=log.name):
        t2.allow(("semantic lookup", "UNAVAILABLE"))
        t2.allow(("semantic lookup", "UNAVAILABLE"))
        Thinned.flush_all()  # what a server's stop calls
    assert "semantic lookup/UNAVAILABLE: 1 more lines left out" in caplog.text


@pytest.mark.parametrize(("name", "hint"), [
    # A config review: each was ignored, mutual TLS left off or the public development hash
    # key in force, without a word.
    ("TIERCACHE_TLS_CA_FILE", "TIERCACHE_TLS_CA"),
    ("TIERCACHE_HASHKEY", "TIERCACHE_HASH_KEY"),
    ("TIERCACHE_ORCHESTRATR_TOKENS", None),
])
def test_an_unknown_shared_name_is_refused(name, hint):
    from services.prefix.config import PrefixConfig

    with pytest.raises(ConfigError) as e:
        load_config(PrefixConfig, "prefix", [], {name: "x"})
    msg = str(e.value)
    assert msg.startswith(name) and "no such setting" in msg
    assert (f"did you mean {hint}?" in msg) if hint else "did you mean" not in msg


def test_shared_names_other_services_and_service_links_pass():
    from services.prefix.config import PrefixConfig

    env = {"TIERCACHE_TLS_CA": "/x", "TIERCACHE_HASH_KEY": "k", "TIERCACHE_ADDRESS": "h:1",
           "TIERCACHE_KVPOOL_NUM_BLOCKS": "8",  # another service's, in a shared environment
           "TIERCACHE_SERVICE_HOST": "10.0.0.9", "TIERCACHE_PORT": "tcp://10.0.0.9:50051",
           "TIERCACHE_WEB_SERVICE_PORT": "80"}
    load_config(PrefixConfig, "prefix", [], env)


def _shared_names_read_by_the_code() -> set[str]:
    """Every whole-string TIERCACHE_<NAME> literal in the project's own code (not the tests,
    whose literals include typos on purpose) that is not under a service's prefix."""
    import ast
    import re

    whole = re.compile(r"TIERCACHE_([A-Z][A-Z0-9_]*[A-Z0-9])")
    own = re.compile(r"TIERCACHE_(SEMANTIC|PREFIX|KVPOOL|ORCHESTRATOR)_")
    found = set()
    for top in ("services", "clients", "scripts", "benchmarks"):
        for f in sorted((ROOT.parent / top).rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if (isinstance(n, ast.Constant) and isinstance(n.value, str)
                        and (m := whole.fullmatch(n.value)) and not own.match(n.value)):
                    found.add(m.group(1))
    return found


@pytest.mark.parametrize("service", ["semantic", "prefix", "kvpool", "orchestrator"])
def test_every_shared_name_is_accepted_by_every_service(service):
    """A mutation audit: TIERCACHE_DATA_DIR dropped from SHARED_NAMES and no test noticed:
    every service would then refuse to start ("no such setting") where the variable is set
    for the benchmarks. Each name in SHARED_NAMES, and each shared name the code reads, is
    accepted on its own by each service's config."""
    import importlib

    from services.common.config import SHARED_NAMES

    read = _shared_names_read_by_the_code()
    assert {"DATA_DIR", "HASH_KEY", "PARENT_PID", "TLS_CA"} <= read  # the scan finds them
    cls = {"semantic": "SemanticConfig", "prefix": "PrefixConfig", "kvpool": "KvPoolConfig",
           "orchestrator": "OrchestratorConfig"}[service]
    config = getattr(importlib.import_module(f"services.{service}.config"), cls)
    refused = {}
    for name in sorted(SHARED_NAMES | read):
        try:
            load_config(config, service, [], {f"TIERCACHE_{name}": "1"})
        except ConfigError as exc:
            refused[name] = str(exc)
    assert refused == {}


@pytest.mark.parametrize("name", ["TOKENS", "TOKENS_FILE", "INTERNAL_TOKEN"])
def test_an_emptied_security_setting_is_refused_not_taken_as_unset(name):
    """Empty tenant tokens made every caller the admin default tenant, without a word."""
    from services.orchestrator.config import OrchestratorConfig

    var = f"TIERCACHE_ORCHESTRATOR_{name}"
    with pytest.raises(ConfigError, match=f"{var}: set but empty"):
        load_config(OrchestratorConfig, "orchestrator", [], {var: " "})
    flag = "--" + name.lower().replace("_", "-")
    with pytest.raises(ConfigError, match=f"{flag}: set but empty"):
        load_config(OrchestratorConfig, "orchestrator", [flag, ""], {})


def test_an_empty_hash_key_is_refused(monkeypatch):
    from services.common.hashing import DEFAULT_KEY, hash_key_from_env

    monkeypatch.setenv("TIERCACHE_HASH_KEY", "")
    with pytest.raises(ConfigError, match="TIERCACHE_HASH_KEY: set but empty"):
        hash_key_from_env()
    monkeypatch.delenv("TIERCACHE_HASH_KEY")
    assert hash_key_from_env() == DEFAULT_KEY


@pytest.mark.parametrize(("service", "env", "named"), [
    # A config review: each was blamed on the other setting, one the user never set.
    ("semantic", {"THRESHOLD_FLOOR": "0.75"}, "THRESHOLD_FLOOR"),
    ("semantic", {"THRESHOLD_FLOOR": "0.99"}, "THRESHOLD_FLOOR"),
    ("semantic", {"DRAFT_FLOOR": "0.9"}, "DRAFT_FLOOR"),
    ("semantic", {"MAX_TEXT_CHARS": "4000000"}, "MAX_TEXT_CHARS"),
    ("orchestrator", {"MAX_TOKENS_LIMIT": "100"}, "MAX_TOKENS_LIMIT"),
    ("orchestrator", {"DEFAULT_MAX_TOKENS": "5000"}, "DEFAULT_MAX_TOKENS"),
    ("orchestrator", {"WARM_PIN_TTL_S": "7200"}, "WARM_PIN_TTL_S"),
    ("kvpool", {"MAX_PINNED_FRACTION": "0.1"}, "MAX_PINNED_FRACTION"),
    ("kvpool", {"MAX_PINNED_PER_TENANT_FRACTION": "0.9"}, "MAX_PINNED_PER_TENANT_FRACTION"),
])
def test_of_two_settings_in_conflict_the_one_set_is_named(service, env, named):
    import importlib

    cls = {"semantic": "SemanticConfig", "orchestrator": "OrchestratorConfig",
           "kvpool": "KvPoolConfig"}[service]
    config = getattr(importlib.import_module(f"services.{service}.config"), cls)
    prefix = f"TIERCACHE_{service.upper()}_"
    with pytest.raises(ConfigError) as e:
        load_config(config, service, [], {prefix + k: v for k, v in env.items()})
    assert str(e.value).startswith(prefix + named + ":"), str(e.value)


def test_a_url_given_as_an_address_is_told_so():
    with pytest.raises(ConfigError, match="no http:// URL"):
        require_addresses(["http://x:1"], "orchestrator", "semantic_address", allow_none=False)


def test_a_grpc_target_without_a_port_gets_no_url_hint():
    """A mutation audit: a gRPC target scheme (dns:///semantic, no port) is no URL mistake;
    told "no dns:// URL", the user would drop the scheme gRPC accepts. The plain message."""
    from services.orchestrator.config import OrchestratorConfig

    with pytest.raises(ConfigError) as e:
        load_config(OrchestratorConfig, "orchestrator", [],
                    {"TIERCACHE_ORCHESTRATOR_SEMANTIC_ADDRESS": "dns:///semantic"})
    assert str(e.value) == ("TIERCACHE_ORCHESTRATOR_SEMANTIC_ADDRESS: 'dns:///semantic' is "
                            "not host:port")


def test_orchestrator_paths_are_checked_at_start_naming_the_setting(tmp_path):
    from services.orchestrator.config import OrchestratorConfig

    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="^--model \\(env TIERCACHE_ORCHESTRATOR_MODEL\\)"):
        load_config(OrchestratorConfig, "orchestrator", ["--model", " "], {})
    # The files this host must have: checked at start (check_paths), apart from the values
    # (a manifest's settings are validated where its paths do not exist).
    for flag, value, var in (("--tokens-file", str(tmp_path / "nope.json"), "TOKENS_FILE"),
                             ("--cache-dir", str(afile), "CACHE_DIR")):
        cfg = load_config(OrchestratorConfig, "orchestrator", [flag, value],
                          {"TIERCACHE_HASH_KEY": "k" * 32})
        with pytest.raises(ConfigError, match=f"^TIERCACHE_ORCHESTRATOR_{var}: "):
            cfg.check_paths()
    OrchestratorConfig(tokens_file=str(afile), cache_dir=str(tmp_path)).check_paths()


@pytest.mark.parametrize(("value", "weak"), [
    ("PLACEHOLDER-change-me-internal-token", True), ("short", True), (b"k", True),
    ("x" * 15, True), ("Zr8q3k0JH2mVx7TcLw9a", False), (b"0123456789abcdef", False),
])
def test_weak_secrets_are_told(value, weak):
    from services.common.config import weak_secret

    assert bool(weak_secret(value)) == weak


def test_a_changeme_secret_is_told_as_a_placeholder():
    """A mutation audit: every placeholder tried also said "placeholder", so "changeme" (24
    characters, long enough to pass as a secret otherwise) could leave the list unnoticed."""
    from services.common.config import weak_secret

    assert weak_secret("changemechangemechangeme") == "a placeholder"
    assert weak_secret(b"ChangeMeChangeMeChangeMe") == "a placeholder"


def test_a_start_with_placeholder_secrets_warns_without_naming_them(tmp_path):
    """A security review: the dev overlay's PLACEHOLDER secrets (public in this repository)
    were taken without a word. In a process of its own: the start sets up logging."""
    code = ("import sys; from services.common.bootstrap import load_service_config; "
            "from services.prefix.config import PrefixConfig; "
            "sys.exit(load_service_config(PrefixConfig, 'prefix', []) is None)")
    env = {**os.environ, "TIERCACHE_HASH_KEY": "PLACEHOLDER-change-me-hash-key",
           "TIERCACHE_PREFIX_INTERNAL_TOKEN": "PLACEHOLDER-change-me-internal"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, cwd=str(Path(__file__).resolve().parent.parent))
    assert r.returncode == 0, r.stderr
    text = r.stderr
    assert "TIERCACHE_PREFIX_INTERNAL_TOKEN is a placeholder" in text
    assert "TIERCACHE_HASH_KEY is a placeholder" in text
    assert "change-me-internal" not in text and "change-me-hash" not in text


def test_weak_tenant_tokens_are_told_by_tenant_never_by_token(caplog):
    import logging

    from services.orchestrator.tenants import TenantRegistry

    with caplog.at_level(logging.WARNING, logger="services.orchestrator.tenants"):
        TenantRegistry.build(tokens_file="", tokens="tok-a=alpha,Zr8q3k0JH2mVx7TcLw9a=beta",
                             key=b"k" * 32, max_prompt_tokens=10, max_tokens=10,
                             max_concurrent=1)
    assert "tenants alpha" in caplog.text and "beta" not in caplog.text
    assert "tok-a" not in caplog.text


def test_a_path_checked_at_start_is_named_by_the_flag_that_set_it():
    """A second diff review: check_paths named the variable even when a flag set it."""
    from services.common.config import named_as_given

    msg = "TIERCACHE_ORCHESTRATOR_TOKENS_FILE: '/x' is no readable file"
    assert named_as_given(msg, "orchestrator", ["--tokens-file", "/x"]).startswith(
        "--tokens-file (env TIERCACHE_ORCHESTRATOR_TOKENS_FILE): '/x'")
    assert named_as_given(msg, "orchestrator", ["--tokens-file=/x"]).startswith("--tokens-file")
    assert named_as_given(msg, "orchestrator", []) == msg
