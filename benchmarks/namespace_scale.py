"""What does a semantic namespace cost as their number grows? (docs/capacity.md, "Namespaces")

    python -m benchmarks.namespace_scale [--namespaces 1000 10000 100000] [--per 1 2 10]
                                         [--max-rss-gib 4]

A namespace is (tenant, model id, context hash): chat traffic makes about one per conversation
turn. Per (namespaces, entries per namespace), in a fresh process each (prints JSON lines):

  load_s        rebuild from SQLite (`SemanticCache.load`) of rows written in bulk
  snap_load_s   the same with a snapshot folder saved first (tiny namespaces have no graph:
                the snapshot holds none and they are rebuilt as from SQLite)
  rss_mb        the process's RSS growth over the load, and per namespace (`rss_kb_per_ns`)
  py_kb_per_ns  Python-level memory per namespace (tracemalloc over a second load; numpy
                arrays included, faiss's own C++ allocations not)
  store_ms, lookup_ms  mean time of a Store into a new namespace and a Lookup of an existing
                prompt (hit), 200 each
  live_*        the same namespaces filled by Store calls on an empty cache instead (RSS per
                namespace, and the mean Store of the last 1000): a namespace written since
                the start holds its entries in a growing delta, not a flat index (skipped
                past 200k Stores)
  emptied_left  after invalidating up to 1000 namespaces (`invalidate_ms` each): what the
                per-namespace maps hold beyond the namespaces still held (0 = freed)
Vectors are 384 floats (MiniLM's size) from a hash; no model is loaded. Stops a run whose RSS
would pass --max-rss-gib (estimated from the previous run's per-namespace figure).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
import tracemalloc
from pathlib import Path

from benchmarks import rss_bytes
from benchmarks.semantic_bare import HashEmbedder, bare_cache
from services.semantic.cache import Namespace, SemanticCache
from services.semantic.store import EntryStore

DIM = 384
CALLS = 200
LIVE_STORES = 200_000
INVALIDATES = 1000  # each ~4 ms (a SQLite delete and a WAL truncation): not half of 100k


def _ns(i: int) -> Namespace:
    return Namespace(f"t{i % 100}", "m", f"{i:032x}")


def _fill(db: str, n: int, per: int) -> None:
    store = EntryStore(db, "OFF")
    emb = _embedder()
    rows = []
    for i in range(n):
        ns = _ns(i)
        for j in range(per):
            p = f"question {j} of {i}"
            rows.append(dict(id=f"{i}-{j}", tenant=ns.tenant, model_id=ns.model_id,
                             context_hash=ns.context_hash, prompt=p, answer="answer",
                             embedding=emb.embed_one(p), embed_model=emb.identity,
                             verified=False, created_at=time.time(), ttl_seconds=0))
            if len(rows) >= 20000:
                store.insert_many(rows)
                rows = []
    store.insert_many(rows)
    store.close()


def _embedder() -> HashEmbedder:
    return HashEmbedder(DIM, "hash@namespace_scale")


def _cache(db: str, n: int, per: int) -> SemanticCache:
    return bare_cache(db, max(2 * n * per, 1000), _embedder())


def _rss_mb() -> float:
    return rss_bytes() / 2**20


def _run(n: int, per: int, db: str, out) -> None:
    r: dict = {"namespaces": n, "per_ns": per}
    base = _rss_mb()
    cache = _cache(db, n, per)
    t0 = time.perf_counter()
    cache.load()
    r["load_s"] = round(time.perf_counter() - t0, 2)
    r["rss_mb"] = round(_rss_mb() - base, 1)
    r["rss_kb_per_ns"] = round(r["rss_mb"] * 1024 / n, 2)
    t0 = time.perf_counter()
    for i in range(CALLS):
        cache.store_entry(Namespace("new", "m", f"{i:x}"), f"new {i}", "answer")
    r["store_ms"] = round((time.perf_counter() - t0) / CALLS * 1e3, 3)
    t0 = time.perf_counter()
    hits = sum(cache.lookup(_ns(i * 7919 % n), f"question 0 of {i * 7919 % n}",
                            "standard").hit for i in range(CALLS))
    r["lookup_ms"] = round((time.perf_counter() - t0) / CALLS * 1e3, 3)
    r["lookup_hits"] = hits
    snap = db + ".hnsw"
    t0 = time.perf_counter()
    cache.save_snapshot(snap)
    r["save_snapshot_s"] = round(time.perf_counter() - t0, 3)
    gone = min(n // 2, INVALIDATES)
    t0 = time.perf_counter()
    for i in range(gone):
        cache.invalidate_namespace(_ns(i))
    r["invalidate_ms"] = round((time.perf_counter() - t0) / gone * 1e3, 3)
    held = n - gone + CALLS
    r["emptied_left"] = {"indexes": len(cache._indexes) - held,
                         "ns_lru": len(cache._ns_lru) - held, "removing": len(cache._removing),
                         "expiring_ns": len(cache._expiring_ns)}
    cache.close_indexes()
    cache.store.close()
    del cache
    for label, path in (("snap_load_s", snap), ("py_kb_per_ns", "")):
        cache = _cache(db, n, per)
        if label == "py_kb_per_ns":
            tracemalloc.start()
        t0 = time.perf_counter()
        cache.load(path)
        if label == "py_kb_per_ns":
            r[label] = round(tracemalloc.get_traced_memory()[0] / 1024 / held, 2)
            tracemalloc.stop()
        else:
            r[label] = round(time.perf_counter() - t0, 2)
        cache.close_indexes()
        cache.store.close()
        del cache
    out.put(r)


def _live(n: int, per: int, db: str, out) -> None:
    cache = _cache(db, n, per)
    cache.load()
    base = _rss_mb()
    t0 = time.perf_counter()
    for j in range(per):
        for i in range(n):
            if j == per - 1 and i == max(0, n - 1000):
                t0 = time.perf_counter()
            cache.store_entry(_ns(i), f"question {j} of {i}", "answer")
    last = (time.perf_counter() - t0) / min(n, 1000)
    out.put({"live_rss_kb_per_ns": round((_rss_mb() - base) * 1024 / n, 2),
             "live_store_ms_last_1000": round(last * 1e3, 3)})
    cache.close_indexes()
    cache.store.close()


def _spawn(ctx, target, *args) -> dict:
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    r = q.get()
    p.join()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--namespaces", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--per", type=int, nargs="+", default=[1, 2, 10])
    ap.add_argument("--max-rss-gib", type=float, default=4.0)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        for per in a.per:
            kb = 0.0
            for n in sorted(a.namespaces):
                if kb * n / 2**20 > a.max_rss_gib * 0.8:
                    print(json.dumps({"namespaces": n, "per_ns": per, "skipped":
                                      f"~{kb * n / 2**20:.1f} GiB"}), flush=True)
                    continue
                db = str(Path(folder) / f"ns-{n}-{per}.db")
                p = ctx.Process(target=_fill, args=(db, n, per))  # apart: RSS from zero
                p.start()
                p.join()
                r = _spawn(ctx, _run, n, per, db)
                if n * per <= LIVE_STORES:
                    r.update(_spawn(ctx, _live, n, per, db + ".live"))
                kb = r["rss_kb_per_ns"]
                print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
