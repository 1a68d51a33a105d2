"""The floor under every latency figure measured through gRPC on this host: one unary call of
a minimal Python gRPC server (sync, a thread pool as the services use, no interceptor, a
handler that returns its request) from a client in another process.

    .venv/bin/python -m benchmarks.grpc_floor [--calls N] [--out PATH]

The semantic benchmark's `lookup_p50_ms` is this round trip plus the service's own work
(interceptor, parsing, search, the entry's fields). A context figure, no target: it says how
much of a 2 ms budget a host's loopback gRPC leaves (~0.7 ms on the 2-core Intel host the
targets were first met on, ~1.0 ms on the 2-core AMD EPYC host of later stops).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cpu_model

RESULT = Path(__file__).resolve().parent / "results" / "grpc_floor.json"
METHOD = "/bench.Echo/Echo"
SIZES = (100, 2000)  # a small request; about a Lookup answer with its entry and token ids


def serve() -> None:
    """The server process: echo on a free port, printed on stdout; runs until stdin closes."""
    from concurrent import futures

    import grpc

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(None)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=RESULT)
    a = ap.parse_args(argv)
    if a.calls < 10:
        ap.error("--calls: at least 10")
    import grpc

    t_start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.grpc_floor", "--serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        port = int(proc.stdout.readline())
        out: dict = {"benchmark": "grpc_floor", "cpu_model": cpu_model(),
                     "cpus": os.cpu_count(), "grpcio": grpc.__version__, "calls": a.calls,
                     "load_average_1m": os.getloadavg()[0], "by_request_bytes": {}}
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            echo = ch.unary_unary(METHOD)
            for size in SIZES:
                body = b"x" * size
                for _ in range(200):  # connection, warm paths
                    echo(body, timeout=10)
                ms = []
                for i in range(a.calls):
                    t0 = time.perf_counter()
                    echo(body, timeout=10)
                    ms.append((time.perf_counter() - t0) * 1000)
                    if (i + 1) % 1000 == 0:
                        print(f"  {size} B: {i + 1}/{a.calls} calls", file=sys.stderr)
                out["by_request_bytes"][str(size)] = {
                    "round_trip_p50_ms": round(percentile(ms, 0.5), 4),
                    "round_trip_p99_ms": round(percentile(ms, 0.99), 4)}
    finally:
        proc.stdin.close()
        proc.wait(10)
    out["elapsed_s"] = round(time.monotonic() - t_start, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["by_request_bytes"], indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        sys.exit(main())
