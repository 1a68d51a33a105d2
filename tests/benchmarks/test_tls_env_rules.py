"""Servers a benchmark starts serve plaintext, as the benchmark's clients and health waits
speak, whatever TLS variables the shell exported: they started as TLS servers (the parent's
TIERCACHE_TLS_* passed through) and were then waited for in plaintext, until the wait timed
out. No process is started here: the start is captured where it would happen."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import plaintext_env, stack_log_dir
from services.common.bootstrap import requires_client_certs, server_tls_files
from services.common.grpc_client import tls_mode

TLS = {"TIERCACHE_TLS_CERT": "/certs/server.pem", "TIERCACHE_TLS_KEY": "/certs/server.key",
       "TIERCACHE_TLS_CA": "/certs/ca.pem", "TIERCACHE_TLS_CLIENT_CERT": "/certs/client.pem",
       "TIERCACHE_TLS_CLIENT_KEY": "/certs/client.key",
       "TIERCACHE_KVPOOL_TLS_CERT": "/certs/kv.pem", "TIERCACHE_KVPOOL_TLS_KEY": "/certs/kv.key",
       "TIERCACHE_ORCHESTRATOR_TLS_CLIENT_AUTH": "none"}
SERVICES = ("orchestrator", "semantic", "prefix", "kvpool")


class Started(Exception):
    """Raised where the server would start, carrying the environment it would get."""


@pytest.fixture
def tls_shell(monkeypatch):
    for k, v in TLS.items():
        monkeypatch.setenv(k, v)


def assert_plaintext(env):
    assert tls_mode(env) == ""
    for service in SERVICES:
        assert all(path == "" for _, path in server_tls_files(service, env)), service
        assert not requires_client_certs(service, env)


def test_plaintext_env_blanks_every_tls_variable_and_nothing_else():
    env = {**TLS, "TIERCACHE_KVPOOL_NUM_BLOCKS": "8", "PATH": "/bin", "TIERCACHE_HASH_KEY": "k"}
    assert plaintext_env(env) == {k: "" for k in TLS}
    assert_plaintext({**env, **plaintext_env(env)})


def capture_popen(monkeypatch, module):
    seen = {}

    def popen(cmd, env=None, **kw):
        seen["server"] = env
        return SimpleNamespace(poll=lambda: None, kill=lambda: None, wait=lambda *a, **k: 0)

    def wait(addr, timeout, proc, env=None):
        seen["wait"] = env
        raise Started

    monkeypatch.setattr(module.subprocess, "Popen", popen)
    monkeypatch.setattr(module, "wait_healthy", wait)
    return seen


def test_kvpool_benchmark_starts_its_replica_plaintext_and_waits_as_it_serves(tls_shell,
                                                                              monkeypatch):
    from benchmarks import kvpool

    seen = capture_popen(monkeypatch, kvpool)
    with pytest.raises(Started):
        kvpool.start_server(64)
    assert_plaintext(seen["server"])
    assert seen["wait"] == seen["server"]


def test_kvpool_rss_benchmark_starts_its_replica_plaintext(tls_shell, monkeypatch):
    from benchmarks import kvpool_rss

    seen = capture_popen(monkeypatch, kvpool_rss)
    with pytest.raises(Started):
        kvpool_rss.start({}, {"num_blocks": "64"})
    assert_plaintext(seen["server"])
    assert seen["wait"] == seen["server"]


def assert_own_log_dir(log_dir, name: str, tmp: Path) -> None:
    """The stack logs to a new folder of `stack_log_dir`'s, not a fixed one per name."""
    assert log_dir.parent == tmp and log_dir.is_dir(), log_dir
    assert log_dir.name.startswith(f"tiercache-bench-logs-{name}-"), log_dir


def fake_stack(seen):
    def stack(*a, extra_env=None, **kw):
        import os

        # What Stack's services get: this process's environment under extra_env.
        seen["server"] = {**os.environ, **(extra_env or {})}
        seen["log_dir"] = kw["log_dir"]
        raise Started
    return stack


def test_orchestrator_benchmark_stack_serves_plaintext_to_its_plaintext_clients(
        tls_shell, monkeypatch, tmp_path):
    from benchmarks import orchestrator

    seen = {}
    monkeypatch.setattr(orchestrator, "Stack", fake_stack(seen))
    monkeypatch.setattr(orchestrator, "generate", lambda spec: SimpleNamespace(system_prompts=[]))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its semantic store, its logs
    with pytest.raises(Started):
        orchestrator.run_variant("t", None, routing="ring", caches=True, num_blocks=64,
                                 max_tokens=8, concurrency=1)
    assert_plaintext(seen["server"])
    assert_own_log_dir(seen["log_dir"], "t", tmp_path)


def test_assisted_benchmark_stack_serves_plaintext_to_its_plaintext_channels(tls_shell,
                                                                             monkeypatch,
                                                                             tmp_path):
    from benchmarks import assisted
    from services import launcher
    from services.common import model_store
    from services.orchestrator import render

    seen = {}
    monkeypatch.setattr(launcher, "Stack", fake_stack(seen))
    monkeypatch.setattr(model_store, "resolve_model", lambda name: SimpleNamespace(path=name))
    monkeypatch.setattr(model_store, "load_tokenizer",
                        lambda path: SimpleNamespace(all_special_ids=[]))
    monkeypatch.setattr(render, "PromptRenderer", lambda tok: None)
    monkeypatch.setattr(assisted, "near_miss_pairs", lambda n: ([], 0))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its stack's log folder
    with pytest.raises(Started):
        assisted.main(["--quick"])
    assert_plaintext(seen["server"])
    assert_own_log_dir(seen["log_dir"], "assisted", tmp_path)


def test_each_benchmark_stack_logs_to_a_folder_of_its_own_said_at_its_start(monkeypatch,
                                                                           tmp_path, capsys):
    """The orchestrator and assisted benchmarks' stacks logged to one fixed folder per name:
    two runs side by side overwrote each other's logs."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a, b = stack_log_dir("tiercache"), stack_log_dir("tiercache")
    assert a != b and a.is_dir() and b.is_dir() and a.parent == b.parent == tmp_path
    assert a.name.startswith("tiercache-bench-logs-tiercache-")
    assert capsys.readouterr().out == f"[tiercache] stack logs in {a}\n" \
                                      f"[tiercache] stack logs in {b}\n"
