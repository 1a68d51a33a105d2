"""Threads of a CPU replica's forwards: where all of them start to pay over one.

    .venv/bin/python -m benchmarks.threads [--out PATH] [--reps N] [--sizes 16,32,...]

A replica runs forwards of fewer than `one_thread_below` new tokens (all rows together) on one
thread and longer ones on all its torch threads (`Engine.threads_for`), because under
`OMP_WAIT_POLICY=PASSIVE` (what `python -m services.kvpool` sets) OpenMP workers sleep between
parallel regions and waking them costs more than a small forward gains from them. This times
prefill forwards of each size through a real engine (paged cache, the replica's kernels), on
one thread and on all, interleaved, `--reps` each, under the same waiting policy, and reports:

- prefill_ms: median milliseconds of one prefill of q tokens, by threads;
- all_over_one: all threads' median over one thread's (below 1: the other cores pay);
- crossover: the smallest size from which every larger one measured runs at least 5% faster on
  all threads (null if none does) — the `one_thread_below` this host and model call for;
- one_thread_below_default: the configured default it is set against.

Decode steps (1 token a row) and draft verifies (2-17) are far below any crossover measured
here; their one-thread rule is in services/kvpool/README.md.
"""

from __future__ import annotations

import os

# As the replica process: before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "threads.json"
SIZES = (16, 32, 64, 128, 256, 512)
PAYS = 0.95  # all threads "pay" at a size where they take at most this share of one's time
ALL = 0  # one_thread_below 0: every forward on all threads
ONE = 1 << 30  # every forward on one thread


def crossover(all_over_one: dict[int, float]) -> int | None:
    """The smallest size from which every larger size measured has all threads at most `PAYS`
    of one thread's time; None when the largest does not."""
    best = None
    for q in sorted(all_over_one, reverse=True):
        if all_over_one[q] > PAYS:
            break
        best = q
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.threads")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="prefill sizes in tokens, at most the replica's max_prefill_chunk")
    args = ap.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})

    import dataclasses

    from services.kvpool.app import build_replica
    from services.kvpool.config import KvPoolConfig
    from services.kvpool.engine import EngineRequest, Failed, Finished
    from services.kvpool.sampling import SamplingSpec

    t_start = time.monotonic()
    default = KvPoolConfig().one_thread_below
    cfg = KvPoolConfig(num_blocks=max(sizes) // 16 + 8, drafts=False, prefix_caching=False)
    if max(sizes) > cfg.max_prefill_chunk:
        ap.error(f"--sizes: at most max_prefill_chunk ({cfg.max_prefill_chunk}) tokens")
    cfg = dataclasses.replace(cfg, torch_threads=cfg.torch_threads or torch.get_num_threads())
    # The replica's main thread loads on one thread (as `python -m services.kvpool` does).
    torch.set_num_threads(1)
    print(f"loading the replica's model ({cfg.torch_threads} torch threads, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}) ...", flush=True)
    replica = build_replica(cfg, metrics=False)
    engine = replica.engine
    vocab = replica.info.vocab_size
    g = torch.Generator().manual_seed(0)
    times: dict[str, dict[int, list[float]]] = {"one": {}, "all": {}}
    n = 0

    def prefill(q: int) -> float:
        nonlocal n
        n += 1
        ids = torch.randint(0, vocab, (q,), generator=g).tolist()
        t0 = time.perf_counter()
        _, out = engine.submit(EngineRequest(f"threads-{n}", ids, SamplingSpec(max_tokens=1),
                                             skip_prefix_cache=True, prefill_only=True))
        while not isinstance(msg := out.get(timeout=600), Finished):
            if isinstance(msg, Failed):
                raise RuntimeError(f"prefill of {q} tokens failed: {msg.error}")
        return time.perf_counter() - t0

    try:
        for below in (ONE, ALL):  # warm both thread counts up
            engine.one_thread_below = below
            prefill(max(sizes))
        for rep in range(args.reps):
            for q in sizes:
                order = (("one", ONE), ("all", ALL)) if rep % 2 == 0 else \
                    (("all", ALL), ("one", ONE))
                for which, below in order:
                    engine.one_thread_below = below
                    times[which].setdefault(q, []).append(prefill(q))
            print(f"  round {rep + 1}/{args.reps}: " + ", ".join(
                f"{q}: {times['one'][q][-1] * 1e3:.0f}/{times['all'][q][-1] * 1e3:.0f} ms"
                for q in sizes), flush=True)
    finally:
        engine.stop()
    ms = {k: {q: round(statistics.median(v[q]) * 1e3, 1) for q in sizes}
          for k, v in times.items()}
    ratio = {q: round(ms["all"][q] / ms["one"][q], 3) for q in sizes}
    cross = crossover(ratio)
    for q in sizes:
        print(f"  prefill of {q:3d} tokens: one thread {ms['one'][q]:7.1f} ms, "
              f"{cfg.torch_threads} threads {ms['all'][q]:7.1f} ms ({ratio[q]:.2f}x)")
    result = {
        "benchmark": "threads",
        "command": "python -m benchmarks.threads",
        "model": f"{replica.info.model_id} float32 cpu, {engine.packing.kernels} kernels",
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "torch_threads": cfg.torch_threads,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                    "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")},
        "reps": args.reps,
        "prefill_ms": ms,
        "prefill_ms_runs": {k: {q: [round(t * 1e3, 1) for t in v[q]] for q in sizes}
                            for k, v in times.items()},
        "all_over_one": ratio,
        "crossover": cross,
        "one_thread_below_default": default,
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"crossover: {cross} tokens (one_thread_below default {default})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
