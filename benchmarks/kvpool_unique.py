"""What prefix caching costs a request that hits nothing, measured across process restarts.

    python -m benchmarks.kvpool_unique [--runs 5] [--pairs 24]
        -> benchmarks/results/kvpool_unique.json

`python -m benchmarks.kvpool` reports `ttft_ratio_cache_on_over_off_unique` from one pair of
replica processes (caching on; `TIERCACHE_KVPOOL_PREFIX_CACHING=false`). On this 2-core machine
the two processes' TTFTs differ by several percent from one start to the next whichever has
caching on (how threads land on cores, what else runs), which is more than the 2% the target
allows. This script repeats that comparison over `--runs` fresh pairs of processes:

- both replicas get the same history first (a 64-token warm-up, one 1,056-token prompt, one
  512-token prompt), so working-row sizes and allocator state match;
- then `--pairs` pairs of unique 512-token prompts, first token only, in ABBA order;
- which replica starts first alternates between runs.

Reported: per run the ratio of median TTFTs (on / off) and the median per-pair ratio, and over
all runs the median of every per-pair ratio with a bootstrap 90% interval (resampling runs, then
pairs, so between-run differences count) — the figure to compare with the 1.02 target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.kvpool import Client, start_server, stop_server

OUT = Path(__file__).resolve().parent / "results" / "kvpool_unique.json"
TARGET = 1.02


def one_run(run: int, pairs: int, rng: random.Random) -> dict:
    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    order = [("on", {}), ("off", {"prefix_caching": "false"})]
    if run % 2:
        order.reverse()
    procs, clients = {}, {}
    try:
        for name, extra in order:
            procs[name], addr = start_server(2048, **extra)
            clients[name] = Client(addr)
        for n in (64, 1056, 512):  # the same history on both
            for name, _ in order:
                clients[name].stream(ids(n), 4 if n == 64 else 1)
        on, off = [], []
        for i in range(pairs):
            seq = ("on", "off") if i % 2 == 0 else ("off", "on")
            for name in seq:
                ttft = clients[name].stream(ids(512), 1).ttft
                (on if name == "on" else off).append(ttft)
    finally:
        for c in clients.values():
            c.channel.close()
        for p in procs.values():
            stop_server(p)
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    return {"run": run, "started_first": order[0][0], "on_s": on, "off_s": off,
            "ratio_of_medians": statistics.median(on) / statistics.median(off),
            "pair_ratio_median": statistics.median(ratios), "pair_ratios": ratios}


def bootstrap(runs: list[dict], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    meds = []
    for _ in range(n):
        pick = [runs[rng.randrange(len(runs))] for _ in runs]
        sample = [r["pair_ratios"][rng.randrange(len(r["pair_ratios"]))]
                  for r in pick for _ in r["pair_ratios"]]
        meds.append(statistics.median(sample))
    meds.sort()
    return meds[int(0.05 * n)], meds[int(0.95 * n) - 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    rng = random.Random(11)
    t0 = time.monotonic()
    load0 = os.getloadavg()
    runs = []
    for r in range(a.runs):
        res = one_run(r, a.pairs, rng)
        runs.append(res)
        print(f"run {r + 1}/{a.runs} ({res['started_first']} first): on/off "
              f"{res['ratio_of_medians']:.3f}, per-pair median {res['pair_ratio_median']:.3f}",
              flush=True)
    pooled = statistics.median(x for r in runs for x in r["pair_ratios"])
    lo, hi = bootstrap(runs, random.Random(5))
    out = {
        "benchmark": "kvpool_unique", "command": "python -m benchmarks.kvpool_unique",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg_at_start": load0, "load_avg_at_end": os.getloadavg()},
        "runs": a.runs, "pairs_per_run": a.pairs,
        "per_run_ratio_of_medians": [round(r["ratio_of_medians"], 4) for r in runs],
        "per_run_pair_ratio_median": [round(r["pair_ratio_median"], 4) for r in runs],
        "pooled_pair_ratio_median": round(pooled, 4),
        "pooled_90ci": [round(lo, 4), round(hi, 4)],
        "target": {"ttft_ratio_cache_on_over_off_unique": f"<= {TARGET}",
                   "met": pooled <= TARGET, "met_with_90ci_upper": hi <= TARGET},
        "detail": runs, "elapsed_s": round(time.monotonic() - t0, 1),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("per_run_ratio_of_medians", "pooled_pair_ratio_median",
                                          "pooled_90ci", "target")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
