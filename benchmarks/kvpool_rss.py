"""RSS of one kvpool replica under steady short chat traffic, sampled over a bounded run.

    python -m benchmarks.kvpool_rss [--minutes 8] [--rate 2] [--concurrency 4]
        [--env MALLOC_ARENA_MAX=2] [--set draft_costs=...] [--label NAME]
        [--count-primitives]
        ->  benchmarks/results/kvpool_rss-<label>.json
    python -m benchmarks.kvpool_rss --shapes   (in-process, no replica: see `shapes_probe`)

Starts `python -m services.kvpool` (the defaults; `--set field=value` adds
TIERCACHE_KVPOOL_<FIELD>, `--env` any other variable, e.g. glibc's MALLOC_ARENA_MAX, which
must be in the environment when the process starts) and drives it over gRPC with the generated
stub: `--rate` requests a second from up to `--concurrency` streams at once, each a prompt of
one of 6 shared system prompts (40-200 tokens, prefix hits) plus a fresh 8-40 token user turn,
or one time in five a cold prompt of up to 320 tokens, answered with 8-32 tokens (ignore_eos).
Token ids are seeded random ids (memory and timing do not depend on their meaning).

Every `--sample` seconds: `VmRSS` of the process and, from /proc/<pid>/smaps, the resident
bytes of its anonymous memory split into the main heap (`[heap]`), glibc's per-thread malloc
arenas (64 MiB-aligned anonymous regions of at most 64 MiB: how a non-main arena is mapped) and
other anonymous mappings (torch's large allocations, the KV pool, thread stacks). Reported:
the samples (with `--count-primitives`, how many oneDNN primitives the replica has created
so far: ONEDNN_VERBOSE=profile_create's lines for primitives not found in oneDNN's cache),
growth from the first sample after `--warmup` minutes to the last (total and per
minute, per category), and decode tokens/s of the traffic (generated tokens over stream time).
A "it still grows" verdict needs a run long enough to see past the warm-up: the working rows
and the pool fill in the first minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from benchmarks import plaintext_env, rss_bytes
from benchmarks.kvpool import Client, free_port
from services.launcher import wait_healthy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ARENA = 64 << 20  # glibc HEAP_MAX_SIZE on 64-bit: a non-main arena's heap is aligned to it


def rss_kib(pid: int) -> int:
    return rss_bytes(pid) // 1024


def smaps_split(pid: int) -> dict[str, int]:
    """Resident KiB of anonymous memory: main heap, malloc arenas, other anonymous."""
    out = {"heap": 0, "arenas": 0, "anon_other": 0, "arena_count": 0}
    maps: list[tuple[int, int, str, int]] = []
    cur = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = [lo, hi, head[5] if len(head) > 5 else "", 0]
                maps.append(cur)
            elif head[0] == "Rss:" and cur is not None:
                cur[3] = int(head[1])
    arena_bases = set()
    for lo, hi, name, rss in maps:
        if name == "[heap]":
            out["heap"] += rss
        elif name == "":
            base = lo - lo % ARENA
            if hi - base <= ARENA and (lo == base or base in arena_bases):
                arena_bases.add(base)
                out["arenas"] += rss
            else:
                out["anon_other"] += rss
    out["arena_count"] = len(arena_bases)
    return out


def start(env_extra: dict[str, str], settings: dict[str, str], port: int = 0,
          created: list[int] | None = None) -> tuple[subprocess.Popen, str]:
    """Start the replica; with `created`, count in created[0] the oneDNN primitives it
    creates (ONEDNN_VERBOSE=profile_create: a line per primitive not in oneDNN's cache)."""
    port = port or free_port()
    env = dict(os.environ, TIERCACHE_KVPOOL_ADDRESS=f"127.0.0.1:{port}",
               TIERCACHE_KVPOOL_METRICS_PORT="-1", TIERCACHE_LOG_LEVEL="WARNING",
               **{f"TIERCACHE_KVPOOL_{k.upper()}": v for k, v in settings.items()}, **env_extra,
               **plaintext_env(os.environ))  # as the benchmark's channel speaks
    if created is not None:
        env["ONEDNN_VERBOSE"] = "profile_create"
    proc = subprocess.Popen([sys.executable, "-m", "services.kvpool"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE if created is not None else None, text=True)
    if created is not None:
        def count() -> None:  # oneDNN's verbose lines go to stdout
            for line in proc.stdout:
                if "create:cache_miss" in line:
                    created[0] += 1
                elif not line.startswith("onednn_verbose"):
                    sys.stdout.write(line)

        threading.Thread(target=count, daemon=True).start()
    addr = f"127.0.0.1:{port}"
    try:
        wait_healthy(addr, 300, proc, env=env)
    except TimeoutError:
        proc.kill()
        raise
    return proc, addr


def shapes_probe(sizes: int = 512, step: int = 128) -> list[dict]:
    """In this process, no replica: SmolLM2's four linear layer shapes (576->576, 576->192,
    576->1536, 1536->576) packed as the replica packs them, run at every forward size 1..`sizes`
    tokens on one thread; the RSS above the start after each `step` sizes, after malloc_trim(0)
    (so free memory is not counted). ONEDNN_PRIMITIVE_CACHE_CAPACITY, if set, must be set
    before this process loads torch."""
    import ctypes

    import torch

    from services.kvpool.linear import PackedLinear

    torch.set_num_threads(1)
    trim = ctypes.CDLL(None).malloc_trim
    lins = [PackedLinear(torch.nn.Linear(i, o))
            for i, o in ((576, 576), (576, 192), (576, 1536), (1536, 576))]
    xs = {n: torch.randn(sizes, n) for n in (576, 1536)}
    trim(0)
    r0 = rss_kib(os.getpid())
    out = []
    with torch.no_grad():
        for upto in range(step, sizes + 1, step):
            for m in range(upto - step + 1, upto + 1):
                for lin in lins:
                    lin(xs[lin.in_features][:m])
            trim(0)
            out.append({"sizes_seen": upto, "shapes_seen": 4 * upto,
                        "rss_growth_mib": round((rss_kib(os.getpid()) - r0) / 1024, 1)})
            print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0, help="minutes before growth counts")
    ap.add_argument("--rate", type=float, default=2.0, help="requests a second")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--label", default="default")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--port", type=int, default=0, help="0 = any free port")
    ap.add_argument("--count-primitives", action="store_true",
                    help="count oneDNN primitives created (ONEDNN_VERBOSE=profile_create)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", action="store_true",
                    help="no replica: the in-process probe of memory per forward size "
                         "(shapes_probe)")
    a = ap.parse_args(argv)
    if a.shapes:
        cap = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "oneDNN's default (1024)")
        print(json.dumps({"onednn_primitive_cache_capacity": cap,
                          "steps": shapes_probe()}, indent=2))
        return 0
    env_extra = dict(kv.split("=", 1) for kv in a.env)
    settings = dict(kv.split("=", 1) for kv in a.set)
    rng = random.Random(a.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 49_000) for _ in range(n)]

    systems = [ids(rng.randrange(40, 200)) for _ in range(6)]
    created = [0] if a.count_primitives else None
    proc, addr = start(env_extra, settings, a.port, created)
    client = Client(addr)
    lock = threading.Lock()
    stats = {"requests": 0, "tokens": 0, "all_tokens": 0, "stream_s": 0.0, "errors": {}}
    slots = threading.Semaphore(a.concurrency)

    def one(prompt: list[int], n: int) -> None:
        try:
            r = client.stream(prompt, n)
            with lock:
                stats["requests"] += 1
                stats["all_tokens"] += len(r.tokens)
                stats["tokens"] += len(r.tokens) - 1  # decode tokens: after the first
                stats["stream_s"] += r.token_times[-1] - r.token_times[0] if r.tokens else 0.0
        except grpc.RpcError as e:
            with lock:
                stats["errors"][e.code().name] = stats["errors"].get(e.code().name, 0) + 1
        finally:
            slots.release()

    samples = []
    t_start = time.monotonic()
    next_sample = t_start
    end = t_start + a.minutes * 60
    skipped = 0
    try:
        while True:
            now = time.monotonic()
            if now >= next_sample:
                s = {"t_min": round((now - t_start) / 60, 2), "vmrss_kib": rss_kib(proc.pid),
                     **smaps_split(proc.pid)}
                if created is not None:
                    s["onednn_primitives_created"] = created[0]
                samples.append(s)
                print(f"[{a.label}] {s['t_min']:5.1f} min  VmRSS {s['vmrss_kib'] / 1024:7.1f} MiB"
                      f"  heap {s['heap'] / 1024:6.1f}  arenas {s['arenas'] / 1024:6.1f}"
                      f" ({s['arena_count']})  other anon {s['anon_other'] / 1024:7.1f}"
                      f"  reqs {stats['requests']}"
                      + (f"  oneDNN primitives {created[0]}" if created else ""), flush=True)
                next_sample += a.sample
            if now >= end:
                break
            if rng.random() < 0.2:
                prompt = ids(rng.randrange(32, 320))
            else:
                prompt = rng.choice(systems) + ids(rng.randrange(8, 40))
            n = rng.randrange(8, 33)
            if slots.acquire(blocking=False):
                threading.Thread(target=one, args=(prompt, n), daemon=True).start()
            else:
                skipped += 1
            time.sleep(rng.expovariate(a.rate))
        for _ in range(a.concurrency):  # let streams under way finish
            slots.acquire(timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    base = next((s for s in samples if s["t_min"] >= a.warmup), samples[0])
    last = samples[-1]
    span = max(last["t_min"] - base["t_min"], 1e-9)
    growth = {k: round((last[k] - base[k]) / 1024, 1)
              for k in ("vmrss_kib", "heap", "arenas", "anon_other")}
    out = {"benchmark": "kvpool_rss", "label": a.label, "env": env_extra, "settings": settings,
           "config": {"minutes": a.minutes, "rate": a.rate, "concurrency": a.concurrency,
                      "warmup_min": a.warmup, "seed": a.seed},
           "requests": stats["requests"], "skipped_busy": skipped, "errors": stats["errors"],
           "decode_tok_s_per_stream": round(stats["tokens"] / stats["stream_s"], 2)
           if stats["stream_s"] else None,
           # every generated token over the run's wall time (the same seeded workload each run)
           "tokens_per_s": round(stats["all_tokens"] / (a.minutes * 60), 2),
           "growth_mib_after_warmup": growth,
           "growth_mib_per_min": {k: round(v / span, 2) for k, v in growth.items()},
           "samples": samples}
    path = a.out or RESULTS / f"kvpool_rss-{a.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("label", "requests", "errors", "skipped_busy",
                                          "decode_tok_s_per_stream", "tokens_per_s",
                                          "growth_mib_after_warmup",
                                          "growth_mib_per_min")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
