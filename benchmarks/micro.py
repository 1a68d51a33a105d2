"""Small figures behind single fixes, each on the real class.

    .venv/bin/python -m benchmarks.micro [--out PATH]

- dispatch_memory_ms_per_request: `DispatchMemory` of 50,000 blocks filled over 64 replicas,
  then record + match of a 64-block prompt, 200 times (the route lock is held for both).
- tenant_auth_us_per_call: `TenantRegistry` built from 1,000 tokens, authenticating the last
  one 2,000 times.
- semantic_index_bytes_per_entry: RSS growth of one `NamespaceIndex` (HNSW) after
  `add_many` of 100,000 unit vectors of 384 floats, the input array freed (Linux VmRSS).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

RESULT = Path(__file__).resolve().parent / "results" / "micro.json"


def dispatch_memory() -> float:
    from services.orchestrator.dispatched import DispatchMemory

    mem = DispatchMemory(16, ttl_s=1e9, max_blocks=50_000)

    def prompt(i: int) -> list[bytes]:
        return [f"{i}-{b}".encode().ljust(16, b"x") for b in range(64)]

    for i in range(800):  # past max_blocks: every record sheds
        mem.record(f"r{i % 64}", prompt(i))
    t0 = time.perf_counter()
    for i in range(800, 1000):
        mem.record(f"r{i % 64}", prompt(i))
        mem.match(prompt(i))
    return (time.perf_counter() - t0) / 200 * 1e3


def tenant_auth() -> float:
    from services.orchestrator.tenants import TenantRegistry

    tokens = ",".join(f"tok-{i:04d}-{'x' * 24}=t{i}" for i in range(1000))
    reg = TenantRegistry.build(tokens_file="", tokens=tokens, key=b"k" * 32,
                               max_prompt_tokens=100, max_tokens=10, max_concurrent=2)
    md = {"authorization": f"Bearer tok-0999-{'x' * 24}"}
    t0 = time.perf_counter()
    for _ in range(2000):
        reg.authenticate(md)
    return (time.perf_counter() - t0) / 2000 * 1e6


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def index_memory(n: int = 100_000, d: int = 384) -> float:
    from services.semantic.index import IndexParams, NamespaceIndex

    x = np.random.default_rng(0).standard_normal((n, d)).astype("float32")
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    gc.collect()
    before = _rss()
    idx = NamespaceIndex(IndexParams(d), background=False)
    idx.add_many(np.arange(n), x)
    input_bytes = x.nbytes
    del x
    gc.collect()
    grown = _rss() - before + input_bytes  # the input was allocated before `before`
    assert len(idx) == n
    return grown / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.micro")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    res = {"benchmark": "micro", "command": "python -m benchmarks.micro",
           "dispatch_memory_ms_per_request": round(dispatch_memory(), 3),
           "tenant_auth_us_per_call": round(tenant_auth(), 2),
           "semantic_index_bytes_per_entry": round(index_memory())}
    text = json.dumps(res, indent=2)
    print(text)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
