"""Operational edges: config parsing, the CLI's session files and timeouts, a busy port,
and the launcher's own settings (pure logic or one in-process server; no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from clients.python import cli
from services.common.config import ConfigError, load_config
from services.kvpool.config import KvPoolConfig
from services.launcher import free_port


def test_an_empty_boolean_is_an_error_not_false():
    with pytest.raises(ConfigError, match="TIERCACHE_KVPOOL_PREFIX_CACHING"):
        load_config(KvPoolConfig, "kvpool", [], {"TIERCACHE_KVPOOL_PREFIX_CACHING": ""})
    cfg = load_config(KvPoolConfig, "kvpool", [], {"TIERCACHE_KVPOOL_PREFIX_CACHING": "off"})
    assert cfg.prefix_caching is False


@pytest.mark.parametrize("content", ["{not json", '{"role": "user"}', '[{"role": "user"}]'])
def test_a_broken_session_file_is_a_clear_error_naming_it(tmp_path, monkeypatch, content):
    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path))
    path = tmp_path / "sessions" / "s1.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    a = SimpleNamespace(session="s1", system="", text="hi", max_tokens=0, temperature=0.0,
                        quiet=True, new=False)
    with pytest.raises(SystemExit, match="s1.json"):
        cli.cmd_chat(SimpleNamespace(), a)


def test_stats_and_feedback_use_the_clients_timeout():
    from clients.python.client import TierCacheClient

    seen = []

    class Stub:
        def Stats(self, req, timeout=None, metadata=None):  # noqa: N802
            seen.append(timeout)

        def Feedback(self, req, timeout=None, metadata=None):  # noqa: N802
            seen.append(timeout)

    c = TierCacheClient("127.0.0.1:1", timeout=2.0)
    try:
        c.stub = Stub()
        c.stats()
        c.feedback("e.1", good=True)
    finally:
        c.close()
    assert seen == [2.0, 2.0]


def test_a_busy_port_fails_the_bind_instead_of_sharing_it():
    from services.prefix.config import PrefixConfig
    from services.prefix.server import serve

    first = serve(PrefixConfig(address="127.0.0.1:0", metrics_port=-1))
    try:
        from services.common.bootstrap import BindError

        with pytest.raises(BindError, match="TIERCACHE_PREFIX_ADDRESS: cannot listen"):
            second = serve(PrefixConfig(address=f"127.0.0.1:{first.handle.port}",
                                        metrics_port=-1))
            second.stop(0)
    finally:
        first.stop(0)


def test_the_launcher_names_a_bad_replica_count(monkeypatch, capsys):
    from services import launcher

    monkeypatch.setenv("TIERCACHE_REPLICAS", "two")
    with pytest.raises(SystemExit) as ei:
        launcher.main([])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    # Named as it is started (README, `make run`), as the services are: not "launcher.py".
    assert "TIERCACHE_REPLICAS" in err and "python -m services.launcher: error:" in err
    with pytest.raises(SystemExit) as ei:  # the help is there to read all the same
        launcher.main(["--help"])
    out = capsys.readouterr().out
    assert ei.value.code == 0 and "TIERCACHE_REPLICAS" in out
    assert out.startswith("usage: python -m services.launcher ")


def test_orchestrator_stats_while_loading_is_unavailable_not_internal():
    from services.common import errors
    from services.orchestrator.config import OrchestratorConfig
    from services.orchestrator.server import OrchestratorServicer

    servicer = OrchestratorServicer(OrchestratorConfig(kvpool_addresses=("A",)))
    ctx = SimpleNamespace(invocation_metadata=lambda: ())
    for call in (servicer.Stats, servicer.Feedback):
        with pytest.raises(errors.Unavailable, match="still loading"):
            call(None, ctx)


def test_sigterm_reports_not_serving_while_still_serving_for_the_drain_delay():
    """With TIERCACHE_DRAIN_DELAY_S, health turns NOT_SERVING at SIGTERM while new requests
    are still answered (Kubernetes removes endpoints asynchronously); then the process exits."""
    import signal
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

    from tests.e2e.conftest import start

    # A wide window for a loaded machine: NOT_SERVING within 8 s, Stats inside the 10 s.
    p = start("prefix", {"TIERCACHE_DRAIN_DELAY_S": "10"}, key="drain-delay", timeout=60)
    try:
        ch = grpc.insecure_channel(p.address)
        health = health_pb2_grpc.HealthStub(ch)
        index = prefix_pb2_grpc.PrefixIndexStub(ch)
        p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 8
        status = None
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        index.Stats(prefix_pb2.PrefixStatsRequest(), timeout=2)  # still answered
        assert p.proc.wait(timeout=30) == 0
        ch.close()
    finally:
        if p.proc.poll() is None:
            p.proc.kill()


@pytest.mark.parametrize(("service", "cls_path", "var", "value"), [
    ("prefix", "services.prefix.config:PrefixConfig", "LEASE_SECONDS", "inf"),
    ("orchestrator", "services.orchestrator.config:OrchestratorConfig", "GRACE_S", "nan"),
    ("orchestrator", "services.orchestrator.config:OrchestratorConfig", "GRACE_S", "-1"),
    ("orchestrator", "services.orchestrator.config:OrchestratorConfig", "PREFIX_TIMEOUT_S", "0"),
    ("kvpool", "services.kvpool.config:KvPoolConfig", "GRACE_SECONDS", "-5"),
    # These used to fail only after the server had started.
    ("prefix", "services.prefix.config:PrefixConfig", "METRICS_PORT", "99999"),
    ("semantic", "services.semantic.config:SemanticConfig", "METRICS_PORT", "70000"),
    ("kvpool", "services.kvpool.config:KvPoolConfig", "METRICS_PORT", "65536"),
    ("orchestrator", "services.orchestrator.config:OrchestratorConfig", "METRICS_PORT", "99999"),
    ("orchestrator", "services.orchestrator.config:OrchestratorConfig", "TOKENS", "abc"),
    # Pruning to the budget itself rescans every leaf on each publish under the index lock.
    ("prefix", "services.prefix.config:PrefixConfig", "PRUNE_TO", "1.0"),
    ("prefix", "services.prefix.config:PrefixConfig", "PRUNE_TO", "0.9999999"),
])
def test_bad_durations_ports_and_token_lists_are_refused_at_load(service, cls_path, var, value):
    import importlib

    mod, name = cls_path.split(":")
    cls = getattr(importlib.import_module(mod), name)
    env = f"TIERCACHE_{service.upper()}_{var}"
    with pytest.raises(ConfigError, match=env):
        load_config(cls, service, [], {env: value})


def test_a_bad_drain_delay_fails_the_start_not_the_shutdown(monkeypatch):
    from services.common.bootstrap import run_until_signal

    monkeypatch.setenv("TIERCACHE_DRAIN_DELAY_S", "5s")
    stopped = []
    handle = SimpleNamespace(stop=lambda grace: stopped.append(grace), service="x")
    with pytest.raises(ConfigError, match="TIERCACHE_DRAIN_DELAY_S"):
        run_until_signal(handle)  # raises before it waits for a signal
    assert stopped == []


@pytest.mark.parametrize("service,env,words", [
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_TOKENS_FILE": "/nonexistent/tokens.json",
                      "TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES": "127.0.0.1:1",
                      "TIERCACHE_HASH_KEY": "test-key"},
     "/nonexistent/tokens.json"),
    # Tenants with the public default hash key: a tenant could sign another's entry id.
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_TOKENS": "tok=a",
                      "TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES": "127.0.0.1:1"},
     "TIERCACHE_HASH_KEY must be set"),
    ("kvpool", {"TIERCACHE_KVPOOL_MODEL": "/nonexistent/model-folder"},
     "/nonexistent/model-folder")])
def test_a_missing_model_folder_or_tokens_file_is_a_config_error(service, env, words):
    """These paths exist only where the service runs (the orchestrator's tokens file is
    checked at start, before it binds; a model folder only when loaded); the start ends with
    exit 2 and one line naming the path, not a traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    up = service.upper()
    base = {k: v for k, v in os.environ.items() if k != "TIERCACHE_HASH_KEY"}
    full = {**base, **env, f"TIERCACHE_{up}_ADDRESS": "127.0.0.1:0",
            f"TIERCACHE_{up}_METRICS_PORT": "-1",
            "PYTHONPATH": f"{root}{os.pathsep}{root / 'gen'}"}
    r = subprocess.run([sys.executable, "-m", f"services.{service}"], env=full, cwd=root,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "bad configuration" in r.stderr and words in r.stderr
    assert "Traceback" not in r.stderr


def test_a_model_folder_without_weights_is_a_config_error(tmp_path):
    """A folder with a config but no weights passes the model store and fails in
    transformers (OSError): still exit 2 and one line naming the folder, not a traceback."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 256}))
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TIERCACHE_KVPOOL_MODEL": str(folder),
           "TIERCACHE_KVPOOL_ADDRESS": "127.0.0.1:0", "TIERCACHE_KVPOOL_METRICS_PORT": "-1",
           "PYTHONPATH": f"{root}{os.pathsep}{root / 'gen'}"}
    r = subprocess.run([sys.executable, "-m", "services.kvpool"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "bad configuration" in r.stderr and str(folder) in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.e2e  # starts a process
def test_a_native_crash_leaves_every_threads_stack_in_the_log(tmp_path):
    """A SIGSEGV or SIGABRT in torch, faiss or gRPC left only 'exit 134' in the pod's log:
    services now enable faulthandler, which writes each thread's Python stack to stderr."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import grpc

    from tests.procs import wait_serving

    port = free_port()
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TIERCACHE_PREFIX_ADDRESS=f"127.0.0.1:{port}",
               TIERCACHE_PREFIX_METRICS_PORT="-1")
    env.pop("PYTHONFAULTHANDLER", None)
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "services.prefix"], cwd=root, env=env,
                                stdout=subprocess.DEVNULL, stderr=f)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            wait_serving(ch, "", proc, 60, err.read_text)
        proc.send_signal(signal.SIGABRT)
        assert proc.wait(30) == -signal.SIGABRT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = err.read_text()
    assert "Fatal Python error: Aborted" in text and "most recent call first" in text, text
