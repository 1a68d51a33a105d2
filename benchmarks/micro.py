"""Small figures behind single fixes, each on the real class.

    .venv/bin/python -m benchmarks.micro [--out PATH]

- dispatch_memory_ms_per_request: `DispatchMemory` of 50,000 blocks filled over 64 replicas,
  then record + match of a 64-block prompt, 200 times (the route lock is held for both).
- tenant_auth_us_per_call: `TenantRegistry` built from 1,000 tokens, authenticating the last
  one 2,000 times.
- semantic_index_bytes_per_entry: RSS growth of one `NamespaceIndex` (HNSW) after
  `add_many` of 100,000 unit vectors of 384 floats, the input array freed (Linux VmRSS).
- finite_check_ms: checking float32 logits of a 49,152-token vocabulary for NaN/inf per row,
  on one torch thread, at 1, 17 (a 16-token verify) and 64 rows: `torch.isfinite(x).all(-1)`
  (what kvpool's sampling used) against `finite_rows` (services/kvpool/sampling.py), and a
  whole greedy `verify_batch` of 17 rows with 16 draft tokens, for scale.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import rss_bytes

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


def index_memory(n: int = 100_000, d: int = 384) -> float:
    from services.semantic.index import IndexParams, NamespaceIndex

    x = np.random.default_rng(0).standard_normal((n, d)).astype("float32")
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    gc.collect()
    before = rss_bytes()
    idx = NamespaceIndex(IndexParams(d), background=False)
    idx.add_many(np.arange(n), x)
    input_bytes = x.nbytes
    del x
    gc.collect()
    grown = rss_bytes() - before + input_bytes  # the input was allocated before `before`
    assert len(idx) == n
    return grown / n


def finite_check(reps: int = 300) -> dict:
    import torch

    from services.kvpool.sampling import Sampler, SamplingSpec, finite_rows, verify_batch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def ms(f) -> float:
        f()
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        return round((time.perf_counter() - t0) / reps * 1e3, 3)

    try:
        out: dict = {}
        gen = torch.Generator().manual_seed(0)
        for rows in (1, 17, 64):
            x = torch.randn(rows, 49_152, generator=gen)
            out[f"rows_{rows}"] = {
                "isfinite_all": ms(lambda x=x: torch.isfinite(x).all(-1).tolist()),
                "finite_rows": ms(lambda x=x: finite_rows(x).tolist())}
        x = torch.randn(17, 49_152, generator=gen)
        draft = torch.argmax(x, dim=-1).tolist()[:16]
        sampler = [Sampler(SamplingSpec(32))]
        out["verify_batch_17_rows"] = ms(lambda: verify_batch(sampler, x, [draft]))
        return out
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.micro")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    res = {"benchmark": "micro", "command": "python -m benchmarks.micro",
           "dispatch_memory_ms_per_request": round(dispatch_memory(), 3),
           "tenant_auth_us_per_call": round(tenant_auth(), 2),
           "semantic_index_bytes_per_entry": round(index_memory()),
           "finite_check_ms": finite_check()}
    text = json.dumps(res, indent=2)
    print(text)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
