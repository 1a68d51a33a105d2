"""Durability: every Store acknowledged before `kill -9` of the real service is served after a
restart; the service also starts from `python -m services.semantic`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from tiercache.v1 import semantic_pb2 as pb
from tiercache.v1 import semantic_pb2_grpc as pbg

from services.launcher import free_port
from tests.procs import terminate, wait_serving

pytestmark = pytest.mark.e2e

NS = pb.Namespace(tenant="durable", model_id="smollm2")


ROOT = Path(__file__).resolve().parents[2]  # not the working directory pytest started in


def _start(db: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, TIERCACHE_SEMANTIC_ADDRESS=f"127.0.0.1:{port}",
               TIERCACHE_SEMANTIC_METRICS_PORT="-1", TIERCACHE_SEMANTIC_DB_PATH=db,
               PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "services.semantic"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_serving(port: int, proc: subprocess.Popen, timeout: float = 120) -> grpc.Channel:
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    wait_serving(ch, "tiercache.v1.SemanticCache", proc, timeout,
                 lambda: proc.stderr.read()[-3000:])
    return ch


def test_acknowledged_stores_survive_kill_9(tmp_path):
    db, port = str(tmp_path / "semantic.db"), free_port()
    proc = _start(db, port)
    acked: dict[str, str] = {}
    lock = threading.Lock()
    stop = threading.Event()
    try:
        stub = pbg.SemanticCacheStub(_wait_serving(port, proc))

        def writer(w: int) -> None:
            i = 0
            while not stop.is_set():
                prompt = f"Writer {w} asks question number {i} about durable storage?"
                try:
                    sid = stub.Store(pb.StoreRequest(namespace=NS, prompt=prompt,
                                                     answer=f"answer {w}/{i}"), timeout=10).id
                except grpc.RpcError:
                    return  # the server died mid-call: not acknowledged, nothing promised
                with lock:
                    acked[sid] = prompt
                i += 1

        threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120  # bounded: writers end on their first error
        while len(acked) < 40:
            assert time.monotonic() < deadline and any(t.is_alive() for t in threads), (
                f"only {len(acked)} stores acknowledged")
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # while the writers are still storing
        proc.wait(timeout=10)
        stop.set()
        for t in threads:
            t.join(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    proc = _start(db, port)
    try:
        stub = pbg.SemanticCacheStub(_wait_serving(port, proc))
        entries = stub.Stats(pb.SemanticStatsRequest(), timeout=10).entries
        assert entries >= len(acked)
        for sid, prompt in acked.items():
            r = stub.Lookup(pb.LookupRequest(namespace=NS, text=prompt, tier="strict"),
                            timeout=10)
            assert r.hit and r.entry.id == sid and r.entry.prompt == prompt
            # And through the rebuilt index (an exact repeat is found by its text).
            r = stub.Lookup(pb.LookupRequest(namespace=NS, text=prompt + " ", tier="strict"),
                            timeout=10)
            assert r.hit and not r.exact and r.entry.id == sid
    finally:
        assert terminate(proc) == 0
