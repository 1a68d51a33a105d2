"""One live semantic shard as namespaces of one entry grow (docs/capacity.md, "How many
namespaces a shard holds"): RSS, Stats and call times, an Invalidate of 2,000 namespaces, the
restart.

    python -m benchmarks.namespace_scale_live [--port P]  (~3 minutes; the real embedder, a
                                                          private database in a temporary folder)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from tiercache.v1 import semantic_pb2 as pb
from tiercache.v1 import semantic_pb2_grpc as pbg

from benchmarks import rss_bytes
from services.launcher import free_port

CALLS = 100


def _start(db: str, port: int) -> tuple[subprocess.Popen, pbg.SemanticCacheStub, float]:
    env = dict(os.environ, TIERCACHE_SEMANTIC_ADDRESS=f"127.0.0.1:{port}",
               TIERCACHE_SEMANTIC_METRICS_PORT="-1", TIERCACHE_SEMANTIC_DB_PATH=db,
               PYTHONPATH=os.pathsep.join([".", "gen", os.environ.get("PYTHONPATH", "")]))
    # nice execs the service in its place: the pid is the service's.
    p = subprocess.Popen(["nice", "-n", "5", sys.executable, "-m", "services.semantic"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    stub = pbg.SemanticCacheStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    while True:
        try:
            stub.Stats(pb.SemanticStatsRequest(), timeout=5)
            return p, stub, time.monotonic() - t0
        except grpc.RpcError:
            if p.poll() is not None or time.monotonic() - t0 > 300:
                raise
            time.sleep(0.2)


def _stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGINT)
    p.wait(60)


def _rss_mb(p: subprocess.Popen) -> float:
    return rss_bytes(p.pid) / 2**20


def _ns(i: int) -> pb.Namespace:
    return pb.Namespace(tenant=f"t{i % 10}", model_id="m", context_hash=f"{i:032x}")


def _q(i: int) -> str:
    return f"What does turn {i} of this conversation ask about item {i * 7}?"


def _store(stub, i: int, answer: str = "a" * 200) -> None:
    stub.Store(pb.StoreRequest(namespace=_ns(i), prompt=_q(i), answer=answer), timeout=30)


def _grow(p, stub) -> None:
    done = 0
    with ThreadPoolExecutor(2) as pool:
        for target in (1000, 5000, 10000):
            list(pool.map(lambda i: _store(stub, i), range(done, target)))
            done = target
            t0 = time.perf_counter()
            for i in range(CALLS):
                _store(stub, 10**6 + target + i, "b")  # a new namespace each
            store = (time.perf_counter() - t0) / CALLS * 1e3
            t0 = time.perf_counter()
            hits = sum(stub.Lookup(pb.LookupRequest(namespace=_ns(i * 37 % target),
                                                    text=_q(i * 37 % target), tier="standard"),
                                   timeout=30).hit for i in range(CALLS))
            lookup = (time.perf_counter() - t0) / CALLS * 1e3
            s = stub.Stats(pb.SemanticStatsRequest(), timeout=5)
            print(f"namespaces {s.namespaces} entries {s.entries} rss_mb {_rss_mb(p):.0f} "
                  f"store_ms {store:.2f} lookup_ms {lookup:.2f} hits {hits}/{CALLS}", flush=True)
    for i in range(2000):
        stub.Invalidate(pb.InvalidateRequest(namespace=_ns(i)), timeout=30)
    s = stub.Stats(pb.SemanticStatsRequest(), timeout=5)
    print(f"after 2000 namespace invalidates: namespaces {s.namespaces} entries {s.entries} "
          f"rss_mb {_rss_mb(p):.0f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="the shard's port (0 = any free one)")
    port = ap.parse_args().port or free_port()
    with tempfile.TemporaryDirectory() as folder:
        db = os.path.join(folder, "semantic.db")
        p, stub, t = _start(db, port)
        try:
            print(f"start_s {t:.1f} rss_mb {_rss_mb(p):.0f}", flush=True)
            _grow(p, stub)
        finally:
            _stop(p)
        p, stub, t = _start(db, port)
        try:
            s = stub.Stats(pb.SemanticStatsRequest(), timeout=5)
            print(f"restart_s {t:.1f} namespaces {s.namespaces} rss_mb {_rss_mb(p):.0f}",
                  flush=True)
        finally:
            _stop(p)


if __name__ == "__main__":
    main()
