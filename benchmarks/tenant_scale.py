"""What does a tenant cost as their number grows? (docs/deploy.md, "Many tenants")

    python -m benchmarks.tenant_scale [--tenants 10 1000 20000]  (~1 minute; prints JSON lines)

Per tenant count, in process:

  registry  a tokens file of that many tenants (one in ten with its own limits) read and
            checked (`TenantRegistry.build`, as at start and at each reload), the memory it
            takes (tracemalloc), and per call: authentication, then the rate check and a
            concurrency slot taken and given back.
  semantic  a shard holding one entry per tenant at its global capacity (`max_entries_total`):
            the time of a Store, which evicts one entry, when the storing tenant then holds
            the most (`distinct`), and when every tenant holds as many (`tied`: a new tenant
            stores; as when every tenant sits at `max_entries_per_tenant`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

from benchmarks.semantic_bare import HashEmbedder, bare_cache
from services.orchestrator.tenants import TenantRegistry
from services.semantic.cache import Namespace

CALLS = 20_000
STORES = 100


def registry(n: int, folder: Path) -> dict:
    path = folder / f"tokens-{n}.json"
    entries = {f"token-{i:06d}-0123456789abcdef": {"tenant": f"t{i}", "max_concurrent": 2,
                                                   "rate_per_s": 1e6} if i % 10 == 0
               else f"t{i}" for i in range(n)}
    path.write_text(json.dumps(entries, indent=1))
    tokens = list(entries)

    def build() -> TenantRegistry:
        return TenantRegistry.build(tokens_file=str(path), tokens="", key=b"k" * 32,
                                    max_prompt_tokens=4096, max_tokens=512, max_concurrent=8)

    t0 = time.perf_counter()
    reg = build()
    built = time.perf_counter() - t0
    tracemalloc.start()  # apart: it slows the build it watches several times over
    again = build()
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del again
    calls = [(("authorization", f"Bearer {tokens[i % n]}"),) for i in range(CALLS)]
    t0 = time.perf_counter()
    tenants = [reg.authenticate(md) for md in calls]
    auth = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in tenants:
        reg.check_rate(t)
        reg.release(reg.acquire(t))
    limits = time.perf_counter() - t0
    return {"tenants": n, "file_bytes": path.stat().st_size, "build_ms": round(built * 1e3, 1),
            "memory_mb": round(memory / 1e6, 2), "auth_us": round(auth / CALLS * 1e6, 2),
            "rate_and_slot_us": round(limits / CALLS * 1e6, 2)}


def semantic(n: int, folder: Path) -> dict:
    now = [1e6]

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    # A vector from each text's hash: the eviction, not the embedding, is measured.
    cache = bare_cache(str(folder / f"semantic-{n}.db"), n, HashEmbedder(16, "hash@tenant_scale"),
                       clock)
    cache.load()
    for i in range(n):
        cache.store_entry(Namespace(f"t{i}", "m", ""), f"question {i}", "answer")
    out = {"tenants": n}
    for case, tenant in (("distinct", "t{}"), ("tied", "new-{}")):
        t0 = time.perf_counter()
        for i in range(STORES):
            cache.store_entry(Namespace(tenant.format(i), "m", ""), f"{case} {i}", "answer")
        out[f"store_at_capacity_{case}_ms"] = round((time.perf_counter() - t0) / STORES * 1e3, 2)
    cache.close_indexes()
    cache.store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, nargs="+", default=[10, 1000, 20000])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for n in a.tenants:
            print(json.dumps({"registry": registry(n, Path(folder))}), flush=True)
            print(json.dumps({"semantic": semantic(n, Path(folder))}), flush=True)


if __name__ == "__main__":
    main()
