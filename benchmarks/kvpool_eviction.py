"""What an admission that must evict costs the engine thread, as the pool grows.

    .venv/bin/python -m benchmarks.kvpool_eviction [--out PATH]
        -> benchmarks/results/kvpool_eviction.json

Pure pool logic (no model): unique prompts are opened, committed and closed until the pool is
full of cached blocks; then 50 more `BlockPool.open` calls, each of which has to evict as many
blocks as the prompt needs, are timed. Pools from 2,048 blocks (the CPU default here) to 131,072
(a GPU-sized pool of short prompts: ~16k leaves). Eviction pops the lowest policy key from a
heap of leaves (O(log leaves) per block); before, every eviction sorted all leaves.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from services.common.hashing import BlockHasher
from services.kvpool.block_pool import BlockPool

OUT = Path(__file__).resolve().parent / "results" / "kvpool_eviction.json"
CASES = ((2048, 512), (32768, 512), (131072, 128))  # (blocks, prompt tokens)


def one_case(num_blocks: int, prompt: int, samples: int = 50) -> dict:
    pool = BlockPool(num_blocks, 16, BlockHasher("bench", 16), record_events=False)
    rng = random.Random(1)
    times: list[float] = []
    i = 0
    while len(times) < samples:
        toks = [rng.randrange(100, 40000) for _ in range(prompt)]
        full = pool.stats().free == 0
        t0 = time.perf_counter()
        pool.open(f"s{i}", toks, keep_uncached=1)
        dt = time.perf_counter() - t0
        pool.commit(f"s{i}", toks, prompt)
        pool.close(f"s{i}")
        if full:
            times.append(dt)
        i += 1
    pool.check_integrity()
    return {"blocks": num_blocks, "prompt_tokens": prompt, "leaves": len(pool._leaves),
            "open_with_eviction_ms_p50": statistics.median(times) * 1e3,
            "open_with_eviction_ms_max": max(times) * 1e3,
            "evictions_total": pool.evictions_total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kvpool_eviction")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    res = []
    for nb, plen in CASES:
        res.append(one_case(nb, plen))
        print(json.dumps(res[-1]), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "kvpool_eviction",
                                 "command": "python -m benchmarks.kvpool_eviction",
                                 "cases": res}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
