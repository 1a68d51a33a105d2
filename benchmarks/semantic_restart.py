"""How long a semantic shard takes to start over a full database: building every HNSW graph
from SQLite, against taking the graphs saved by its last clean stop.

    .venv/bin/python -m benchmarks.semantic_restart [--quick] [--entries N] [--out PATH]

Workload (seeded): one SQLite database of `--entries` entries (default 100,000; 30,000 with
--quick) in one namespace, 384-dimensional unit vectors (all-MiniLM-L6-v2's size; random, so
the vectors are not embedded here: the start's own re-embedding does not run, every row is
tagged with the embedder's identity) and 450-character answers, the service's index settings
(HNSW M 32, efConstruction 80 past 20,000 entries). Measured on the real code path
(`SemanticCache.load`, `save_snapshot`):
  * `load_build_s`: a start without a snapshot (every graph built, as before);
  * `save_s`, `snapshot_mb`: the save a clean stop makes, and its size on disk;
  * `load_snapshot_s`: a start that takes the saved graph (checked against SQLite first);
  * `load_snapshot_catch_up_s`: the same after 1% of the entries were removed and 1% stored
    after the save (a kill -9 later: no save since), which the start tombstones and adds;
  * `same_top10`: the two starts' indexes give the same 10 nearest entries for 200 queries
    (near-duplicates of stored vectors); `recall_at_1_vs_exact_from_snapshot` compares the
    taken graph with exact search (random vectors are HNSW's hardest case: the semantic
    benchmark's recall on real question embeddings is 0.999).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.emit import emit, machine
from services.semantic.cache import Namespace, SemanticCache
from services.semantic.config import SemanticConfig
from services.semantic.store import EntryStore

RESULT = Path(__file__).resolve().parent / "results" / "semantic_restart.json"
NS = Namespace("tenant", "model", "")
DIM = 384
ANSWER = ("The answer, at the length of a typical cached reply. " * 9)[:450]
TARGET_SPEEDUP = 5.0


class _Identity:
    """Stands for the embedder at load: its identity tags the rows; nothing is embedded."""

    name = "bench-384"
    identity = "bench-384@snapshot"
    dim = DIM

    def embed_one(self, text: str) -> np.ndarray:
        raise AssertionError("the restart benchmark embeds nothing")

    def embed(self, texts: list[str]) -> np.ndarray:
        raise AssertionError("the restart benchmark embeds nothing")


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def fill(store: EntryStore, start: int, vecs: np.ndarray, now: float) -> None:
    for s in range(0, len(vecs), 10_000):
        chunk = vecs[s:s + 10_000]
        store.insert_many([dict(id=f"e{start + s + i}", tenant=NS.tenant, model_id=NS.model_id,
                                context_hash="", prompt=f"question {start + s + i}",
                                answer=ANSWER, embedding=v, embed_model=_Identity.identity,
                                verified=False, created_at=now, ttl_seconds=0)
                           for i, v in enumerate(chunk)])


def start(cfg: SemanticConfig, snapshot: str) -> tuple[SemanticCache, float]:
    cache = SemanticCache(cfg, _Identity(), EntryStore(cfg.resolved_db_path(), "NORMAL"))
    t = time.perf_counter()
    cache.load(snapshot)
    return cache, time.perf_counter() - t


def stop(cache: SemanticCache) -> None:
    cache.close_indexes()
    cache.store.close()


def top10(cache: SemanticCache, queries: np.ndarray) -> list[list[int]]:
    index = cache.index_of(NS)
    return [[nb.label for nb in index.search(q, k=10)] for q in queries]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.semantic_restart")
    ap.add_argument("--quick", action="store_true", help="30,000 entries; prints, no file")
    ap.add_argument("--entries", type=int, default=None)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    n = args.entries or (30_000 if args.quick else 100_000)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="tiercache-restart-")
    try:
        cfg = SemanticConfig(db_path=os.path.join(tmp, "semantic.db"), verifier_tiers=(),
                             max_entries_per_namespace=max(200_000, 2 * n))
        snap = os.path.join(tmp, "semantic.db.hnsw")
        rng = np.random.default_rng(args.seed)
        vecs = unit(rng, n)
        store = EntryStore(cfg.resolved_db_path(), "NORMAL")
        fill(store, 0, vecs, time.time())
        store.close()
        print(f"stored {n:,} entries in {time.perf_counter() - t0:.0f} s; starting without a "
              "snapshot...", file=sys.stderr)
        queries = vecs[rng.integers(0, n, 200)] + 0.02 * unit(rng, 200)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)

        built, build_s = start(cfg, "")
        assert built.index_of(NS).kind == "hnsw"
        ref = top10(built, queries)
        exact = [[nb.label for nb in built.index_of(NS).search_exact(q, k=1)] for q in queries]
        t = time.perf_counter()
        saved = built.save_snapshot(snap)
        save_s = time.perf_counter() - t
        size = sum(p.stat().st_size for p in Path(snap).iterdir())
        stop(built)
        print(f"built in {build_s:.1f} s, saved in {save_s:.1f} s; starting from the "
              "snapshot...", file=sys.stderr)

        taken, snap_s = start(cfg, snap)
        got = top10(taken, queries)
        adopted = taken.graphs_adopted
        # Then changes after the save, with no save since (a kill -9): 1% removed, 1% new.
        gone = rng.choice(n, n // 100, replace=False)
        for i in gone:
            taken.invalidate_id(f"e{i}")
        extra = unit(rng, n // 100)
        fill(taken.store, n, extra, time.time())
        stop(taken)
        caught, catch_s = start(cfg, snap)
        index = caught.index_of(NS)
        caught_len = len(index)
        # Each entry stored after the save is in the graph: found among its own vector's 10
        # nearest as often as an entry of the saved graph is (random vectors are HNSW's
        # hardest case: neither is always found).
        found = float(np.mean([caught._by_id[f"e{n + i}"] in
                               [nb.label for nb in index.search(v, k=10)]
                               for i, v in enumerate(extra)]))
        # The same for as many entries that were in the saved graph: HNSW's own miss rate.
        gone_set = set(int(i) for i in gone)
        old_rows = [int(i) for i in rng.choice(n, 3 * len(extra)) if int(i) not in gone_set]
        old_rows = old_rows[:len(extra)]
        found_saved = float(np.mean([caught._by_id[f"e{i}"] in
                                     [nb.label for nb in index.search(vecs[i], k=10)]
                                     for i in old_rows]))
        removed_served = sum(1 for i in gone if f"e{i}" in caught._by_id)
        caught_ok = (caught.graphs_adopted == 1 and caught_len == n and removed_served == 0
                     and found >= found_saved - 0.01)
        caught.check_integrity()
        stop(caught)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    same = got == ref
    recall = float(np.mean([g[0] == e[0] for g, e in zip(got, exact, strict=True)]))
    speedup = build_s / snap_s
    res = {
        "benchmark": "semantic_restart", "quick": args.quick,
        "workload": {"entries": n, "namespaces": 1, "dim": DIM, "answer_chars": len(ANSWER),
                     "hnsw_m": cfg.hnsw_m, "hnsw_ef_construction": cfg.hnsw_ef_construction,
                     "seed": args.seed, "cpus": os.cpu_count()},
        "load_build_s": round(build_s, 2),
        "save_s": round(save_s, 2),
        "snapshot_mb": round(size / 2**20, 1),
        "namespaces_saved": saved,
        "load_snapshot_s": round(snap_s, 2),
        "graphs_adopted": adopted,
        "load_snapshot_catch_up_s": round(catch_s, 2),
        "catch_up_removed": int(len(gone)), "catch_up_added": int(len(extra)),
        "catch_up_index_entries": caught_len,
        "catch_up_added_found_in_top10": found,
        "catch_up_saved_rows_found_in_top10": found_saved,
        "catch_up_removed_still_indexed": removed_served,
        "catch_up_served_correctly": caught_ok,
        "start_speedup": round(speedup, 1),
        "same_top10": same,
        "recall_at_1_vs_exact_from_snapshot": recall,
        "targets": {"start_speedup": {"target": f">= {TARGET_SPEEDUP:g}",
                                      "value": round(speedup, 1),
                                      "met": speedup >= TARGET_SPEEDUP}},
        "machine": machine(),
        "notes": ("The target is this benchmark's own: taking a saved graph should make a start "
                  "several times faster than building it. Both starts read every row from "
                  "SQLite (the truth); only the graph build differs."),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    emit(res, args.out or (None if args.quick else RESULT))
    return 0 if same and adopted == 1 and caught_ok else 1


if __name__ == "__main__":
    sys.exit(main())
