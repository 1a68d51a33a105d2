"""How long pruning holds the prefix index, at its default million-node budget.

    .venv/bin/python -m benchmarks.prefix_prune [--nodes N] [--out PATH]

The index serves every call under one lock, so the longest single call is how long a Match
waits behind pruning. Workload (seeded): one replica publishes 8-block chains under 64 system
prompts until the tree holds `--nodes` nodes (the budget), then goes on publishing the same
way, with a Heartbeat every 10 publishes, until one pruning run has finished, all under the
same clock. Run twice: with the service's `prune_step` (the run spread over the calls that
follow) and with no bound on a step (the whole run inside one call, as before 2026-12-01).
Figures: the longest, first and median call, and the calls over 50 ms, while pruning.
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
from services.prefix.config import PrefixConfig
from services.prefix.index import Load, PrefixIndex, Stored

BS = 16
MODEL = "bench-model"
CHAIN = 8
RESULT = Path(__file__).resolve().parent / "results" / "prefix_prune.json"


def run(nodes: int, step: int, seed: int = 7) -> dict:
    rng = random.Random(seed)
    hasher = BlockHasher(MODEL, BS, memo_blocks=0)
    index = PrefixIndex(BS, max_nodes=nodes, prune_step=step, lease_seconds=1e9)
    index.register("r0", "i", "127.0.0.1:7000", MODEL, BS, 1 << 30)
    roots = [[rng.randrange(49152) for _ in range(BS)] for _ in range(64)]
    seq = 0
    calls: list[float] = []
    pruning = False
    t_fill = time.perf_counter()
    while True:
        toks = rng.choice(roots) + [rng.randrange(49152) for _ in range(BS * CHAIN)]
        hs = hasher.hashes(toks)
        seq += 1
        ev = Stored(b"", hs, toks, "", hs[0], 0)
        before = index.tree.pruned_total
        t0 = time.perf_counter()
        index.publish("r0", "i", seq, [ev])
        if seq % 10 == 0:
            index.heartbeat("r0", "i", Load())
        dt = time.perf_counter() - t0
        if not pruning and index.tree.pruned_total == before and index._prune_run is None:
            continue
        if not pruning:
            pruning, fill_s = True, time.perf_counter() - t_fill
        calls.append(dt)
        if index._prune_run is None:
            break
    return {"prune_step": step, "max_nodes": nodes, "fill_s": round(fill_s, 1),
            "calls_while_pruning": len(calls),
            "longest_call_ms": round(max(calls) * 1e3, 1),
            "first_call_ms": round(calls[0] * 1e3, 1),  # takes the run's snapshot of slots
            "median_call_ms": round(statistics.median(calls) * 1e3, 2),
            "calls_over_50ms": sum(c > 0.05 for c in calls),
            "pruning_total_s": round(sum(calls), 3),
            "nodes_after": len(index.tree), "pruned": index.tree.pruned_total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefix_prune")
    ap.add_argument("--nodes", type=int, default=PrefixConfig.max_nodes)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    res = {"benchmark": "prefix_prune", "command": "python -m benchmarks.prefix_prune"
           + ("" if args.nodes == PrefixConfig.max_nodes else f" --nodes {args.nodes}"),
           "spread": run(args.nodes, PrefixConfig.prune_step),
           "one_call": run(args.nodes, sys.maxsize)}
    text = json.dumps(res, indent=2)
    print(text)
    out = args.out or (RESULT if args.nodes == PrefixConfig.max_nodes else None)
    if out is not None:
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
