"""kvpool on SmolLM2 (fp32, CPU), measured through its gRPC API, against plain transformers.

    .venv/bin/python -m benchmarks.kvpool [--quick] [--out PATH]

Starts `python -m services.kvpool` as a process on a free port and drives it with the generated
stub; every figure below comes from timestamps taken in this client when stream messages arrive.
Then (server stopped, so the CPUs are not shared) runs the library baselines in-process: a plain
`DynamicCache` decode loop and transformers' own continuous batching
(`init_continuous_batching` with `allow_block_sharing=True`). Token ids are seeded random ids
from the vocabulary (timing does not depend on their meaning).

Figures (issue 3): TTFT hit/miss on a 1,024-token system prompt + 32-token user turn; TTFT with
caching on vs off for unique 512-token prompts ("off" = a second replica, same pool size, started
with TIERCACHE_KVPOOL_PREFIX_CACHING=false: no lookup, nothing stored), pooled over 8 fresh pairs
of replica processes (one pair's figure moves by several percent from one start to the next —
between-pair sd ~0.045 in the null runs, twice the 2% being measured; see
benchmarks/kvpool_unique.py): each pair gets the same history, then 16 pairs of prompts in ABBA
order; the figure is the median per-pair ratio, with a bootstrap 90% interval and the ratio of
the medians beside it; blocks in use by 8
concurrent requests sharing the system prompt over 8x one request alone; decode throughput at
batch 8 over batch 1 (~128-token contexts, and with a shared 1,024-token prefix); decode step over
the plain cache at 1k context; TTFT on a cached prefix and 8-request throughput against
transformers continuous batching.

`--quick` keeps every figure and the 1,024-token system prompt but shrinks repetitions (one
replica pair, 4 prompt pairs for the unique-prompt ratio), tokens generated and the transformers
CB workload (4 requests, a 256-token prefix: `ttft_hit_vs_transformers_cb` and
`throughput_vs_transformers_cb` are on that smaller shape) so the whole run takes under ~3
minutes; it writes `kvpool-quick.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks import plaintext_env
from benchmarks.emit import verdicts
from services.launcher import wait_healthy

# Same OpenMP waiting policy as the kvpool process, so the in-process baselines are not
# handicapped (torch is imported lazily, after this).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
VOCAB_LO, VOCAB_HI = 100, 49_000

TARGETS = {
    "ttft_ratio_hit_over_miss": ("<=", 0.10),
    "ttft_ratio_cache_on_over_off_unique": ("<=", 1.02),
    "shared_blocks_over_unshared": ("<=", 0.22),
    "decode_tok_s_ratio_b8_over_b1": (">=", 4.0),
    "decode_tok_s_ratio_b8_over_b1_shared_1k": (">=", 2.5),
    "paged_over_plain_decode_step": ("<=", 1.15),
    "ttft_hit_vs_transformers_cb": ("<=", 1.0),
    "throughput_vs_transformers_cb": (">=", 1.5),
}


@dataclass
class Shape:
    prefix: int = 1024
    user: int = 32
    gen: int = 32
    concurrent: int = 8
    reps: int = 3
    decode_reps: int = 5
    decode_ctx: int = 128
    decode_tokens: int = 48
    cb_concurrent: int = 8
    cb_gen: int = 32
    cb_prefix: int = 1024
    unique_runs: int = 8
    unique_pairs: int = 16


QUICK = Shape(prefix=1024, user=32, gen=16, concurrent=8, reps=1, decode_reps=2, decode_ctx=128,
              decode_tokens=24, cb_concurrent=4, cb_gen=8, cb_prefix=256, unique_runs=1,
              unique_pairs=4)


class Ids:
    """Seeded random token ids."""

    def __init__(self, seed: int = 1234) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


@dataclass
class StreamResult:
    submitted: float
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted


# ---- kvpool process --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(num_blocks: int, **extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, TIERCACHE_KVPOOL_ADDRESS=f"127.0.0.1:{port}",
               TIERCACHE_KVPOOL_METRICS_PORT="-1", TIERCACHE_KVPOOL_NUM_BLOCKS=str(num_blocks),
               TIERCACHE_KVPOOL_MAX_BATCH_SIZE="8", TIERCACHE_LOG_LEVEL="WARNING",
               **{f"TIERCACHE_KVPOOL_{k.upper()}": v for k, v in extra.items()},
               **plaintext_env(os.environ))  # as Client's channel speaks
    proc = subprocess.Popen([sys.executable, "-m", "services.kvpool"], cwd=ROOT, env=env)
    addr = f"127.0.0.1:{port}"
    wait_healthy(addr, 300, proc, env=env)
    return proc, addr


class Client:
    def __init__(self, addr: str) -> None:
        from tiercache.v1 import common_pb2, kvpool_pb2, kvpool_pb2_grpc

        self.pb, self.common = kvpool_pb2, common_pb2
        self.channel = grpc.insecure_channel(addr)
        self.stub = kvpool_pb2_grpc.KvPoolStub(self.channel)

    def stream(self, ids: list[int], max_tokens: int, skip_cache: bool = False) -> StreamResult:
        req = self.pb.KvGenerateRequest(
            token_ids=ids, skip_prefix_cache=skip_cache,
            sampling=self.common.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        res = StreamResult(time.perf_counter())
        for msg in self.stub.Generate(req, timeout=600):
            now = time.perf_counter()
            for t in msg.token_ids:
                res.tokens.append(t)
                res.token_times.append(now)
            if msg.HasField("final"):
                res.cached_tokens = msg.final.cached_tokens
        return res

    def prefill(self, ids: list[int]) -> None:
        self.stub.Prefill(self.pb.PrefillRequest(token_ids=ids), timeout=600)

    def stats(self):
        return self.stub.Stats(self.pb.KvStatsRequest(), timeout=10)

    def concurrent(self, prompts: list[list[int]], max_tokens: int, poll: bool = False
                   ) -> tuple[list[StreamResult], float, int]:
        """Run prompts at once; returns (results, wall seconds, peak blocks in use)."""
        results: list[StreamResult | None] = [None] * len(prompts)
        peak = 0
        done = threading.Event()

        def poller() -> None:
            nonlocal peak
            while not done.is_set():
                s = self.stats()
                if s.running == len(prompts):
                    peak = max(peak, s.blocks_in_use)
                time.sleep(0.01)

        def one(i: int) -> None:
            results[i] = self.stream(prompts[i], max_tokens)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        pt = threading.Thread(target=poller) if poll else None
        t0 = time.perf_counter()
        if pt:
            pt.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        done.set()
        if pt:
            pt.join()
        return [r for r in results if r is not None], wall, peak


def decode_tok_s(results: list[StreamResult]) -> float:
    """Steady-state decode throughput while every stream is generating."""
    if len(results) == 1:
        r = results[0]
        return (len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])
    start = max(r.token_times[0] for r in results)
    end = min(r.token_times[-1] for r in results)
    if end <= start:
        raise RuntimeError("streams did not overlap; raise decode_tokens")
    n = sum(1 for r in results for t in r.token_times if start < t <= end)
    return n / (end - start)


# ---- the measurements ------------------------------------------------------------------------

def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def plain_decode_steps(model: Any, ids: Ids, ctx: int, steps: int) -> list[float]:
    """Decode step times of the library's ordinary DynamicCache at `ctx` context, batch 1."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=torch.tensor([ids(ctx)]), cache=cache, use_cache=True,
                       logits_to_keep=1).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(time.perf_counter() - t0)
    return out


def paged_vs_plain_forward(model: Any, ids: Ids, ctx: int, steps: int) -> tuple[float, float]:
    """Median forward time of one decode step at `ctx`, batch 1: our PagedCache vs DynamicCache.

    In-process and alternated step by step, so both see the same machine load; this isolates
    the cache class from the gRPC/engine path measured by `paged_decode_step_1k_s`.
    """
    import torch
    from transformers import DynamicCache

    from services.kvpool.paged_cache import ForwardPlan, KvStore, PagedCache

    cfg = model.config
    store = KvStore(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.hidden_size // cfg.num_attention_heads, num_blocks=1,
                    block_size=16, max_rows=1, max_context=cfg.max_position_embeddings,
                    dtype=torch.float32, device="cpu", initial_capacity=ctx + steps + 16)
    paged = PagedCache(store)
    prompt = torch.tensor([ids(ctx)])
    with torch.inference_mode():
        paged.begin(ForwardPlan(0, [0], ctx))
        model(input_ids=prompt, cache=paged, position_ids=paged.position_ids(),
              attention_mask=paged.attention_mask(), logits_to_keep=1)
        plain = DynamicCache(config=cfg)
        model(input_ids=prompt, cache=plain, use_cache=True, logits_to_keep=1)
        tp, tq = [], []
        for i in range(steps):
            tok = torch.tensor([[ids(1)[0]]])
            t0 = time.perf_counter()
            paged.begin(ForwardPlan(0, [ctx + i], 1))
            model(input_ids=tok, cache=paged, position_ids=paged.position_ids(),
                  attention_mask=paged.attention_mask(), logits_to_keep=1)
            t1 = time.perf_counter()
            model(input_ids=tok, cache=plain, use_cache=True, logits_to_keep=1)
            t2 = time.perf_counter()
            tp.append(t1 - t0)
            tq.append(t2 - t1)
    return statistics.median(tp), statistics.median(tq)


def load_library_model():
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.model_store import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model().path, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def bench_server(shape: Shape, ids: Ids, out: dict, model: Any) -> dict:
    blocks = 2048
    # 2 (first, while no other replica runs). Unique prompts, caching on vs off ("off": a
    #    replica with TIERCACHE_KVPOOL_PREFIX_CACHING=false, no lookup and nothing stored, else
    #    configured alike). Two replica processes' TTFTs differ by several percent from one
    #    start to the next whichever has caching on (benchmarks/kvpool_unique.py), more than
    #    the 2% asked, so the figure pools `unique_runs` fresh pairs of processes: each gets the
    #    same history, then `unique_pairs` pairs of 512-token prompts in ABBA order.
    from benchmarks.kvpool_unique import bootstrap, one_run

    runs = []
    for r in range(shape.unique_runs):
        runs.append(one_run(r, shape.unique_pairs, random.Random(11 + r)))
        print(f"  unique prompts, process pair {r + 1}/{shape.unique_runs}: on/off "
              f"{runs[-1]['ratio_of_medians']:.3f}", file=sys.stderr, flush=True)
    on = [x for r in runs for x in r["on_s"]]
    off = [x for r in runs for x in r["off_s"]]
    out["ttft_unique_cache_on_s"] = statistics.median(on)
    out["ttft_unique_cache_off_s"] = statistics.median(off)
    # Headline: the median of every pair's on/off ratio (adjacent requests, so slow drifts of
    # the machine cancel); the ratio of the pooled medians and per-run figures beside it.
    out["ttft_ratio_cache_on_over_off_unique"] = statistics.median(
        x for r in runs for x in r["pair_ratios"])
    out["ttft_unique_ratio_of_medians"] = (out["ttft_unique_cache_on_s"]
                                           / out["ttft_unique_cache_off_s"])
    out["ttft_unique_per_run_ratio_of_medians"] = [r["ratio_of_medians"] for r in runs]
    if len(runs) > 1:
        out["ttft_unique_pair_ratio_90ci"] = list(bootstrap(runs, random.Random(5)))
    out["ttft_unique_cache_on_s_runs"], out["ttft_unique_cache_off_s_runs"] = on, off

    proc, addr = start_server(blocks)
    c = Client(addr)
    try:
        c.stream(ids(64), 4)  # warm-up (first forward pays one-off costs)

        # 1. TTFT: 1,024-token system prompt + 32-token user turn, cold vs cached.
        cold, hit = [], []
        for _ in range(shape.reps):
            system = ids(shape.prefix)
            cold.append(c.stream(system + ids(shape.user), 1).ttft)
            r = c.stream(system + ids(shape.user), 1)
            assert r.cached_tokens >= shape.prefix - 16
            hit.append(r.ttft)
        out["ttft_cold_s"] = statistics.median(cold)
        out["ttft_hit_s"] = statistics.median(hit)
        out["ttft_ratio_hit_over_miss"] = out["ttft_hit_s"] / out["ttft_cold_s"]

        # 3. Sharing: blocks in use while 8 requests on one system prompt all run, over 8x one.
        alone, _, peak_alone = c.concurrent([ids(shape.prefix) + ids(shape.user)], shape.gen,
                                            poll=True)
        system = ids(shape.prefix)
        prompts = [system + ids(shape.user) for _ in range(shape.concurrent)]
        res, wall, peak = c.concurrent(prompts, shape.gen, poll=True)
        out["blocks_in_use_one_request"] = peak_alone
        out["blocks_in_use_8_shared"] = peak
        out["shared_blocks_over_unshared"] = peak / (shape.concurrent * peak_alone)
        toks = sum(len(r.tokens) for r in res)
        out["ours_8_shared_cold_wall_s"] = wall
        out["ours_8_shared_cold_tok_s"] = toks / wall

        # 4. Decode throughput, batch 8 over batch 1, ~128-token contexts (prefixes pre-filled,
        #    so that every stream decodes at the same time).
        def decode_case(prompts: list[list[int]]) -> float:
            for p in prompts:
                c.prefill(p)
            res, _, _ = c.concurrent(prompts, shape.decode_tokens)
            return decode_tok_s(res)

        # Alternated and repeated: on shared CPUs a single pair is mostly noise.
        b1, b8 = [], []
        for _ in range(shape.decode_reps):
            b1.append(decode_case([ids(shape.decode_ctx)]))
            b8.append(decode_case([ids(shape.decode_ctx) for _ in range(8)]))
        out["decode_tok_s_b1"] = statistics.median(b1)
        out["decode_tok_s_b8"] = statistics.median(b8)
        out["decode_tok_s_b1_runs"], out["decode_tok_s_b8_runs"] = b1, b8
        out["decode_tok_s_ratio_b8_over_b1"] = out["decode_tok_s_b8"] / out["decode_tok_s_b1"]

        # 5. The same over a shared 1,024-token prefix; the batch-1 run doubles as the paged
        #    decode step at 1k context, interleaved with the library's plain cache (the server
        #    is idle meanwhile).
        shared = ids(1024)
        b1, b8, plain = [], [], []
        for _ in range(shape.decode_reps):
            b1.append(decode_case([shared + ids(16)]))
            plain.append(statistics.median(plain_decode_steps(model, ids, 1040,
                                                              shape.decode_tokens)))
            b8.append(decode_case([shared + ids(16) for _ in range(8)]))
        out["decode_tok_s_b1_shared_1k"] = statistics.median(b1)
        out["decode_tok_s_b8_shared_1k"] = statistics.median(b8)
        out["decode_tok_s_b1_shared_1k_runs"], out["decode_tok_s_b8_shared_1k_runs"] = b1, b8
        out["decode_tok_s_ratio_b8_over_b1_shared_1k"] = (out["decode_tok_s_b8_shared_1k"]
                                                          / out["decode_tok_s_b1_shared_1k"])
        out["paged_decode_step_1k_s"] = 1.0 / out["decode_tok_s_b1_shared_1k"]
        out["plain_decode_step_1k_s"] = statistics.median(plain)
        out["paged_over_plain_decode_step"] = (out["paged_decode_step_1k_s"]
                                               / out["plain_decode_step_1k_s"])

        # 6. For the transformers CB comparison: TTFT on a cached prefix of cb_prefix tokens,
        #    and cb_concurrent requests on a fresh shared prefix.
        sys_cb = ids(shape.cb_prefix)
        c.stream(sys_cb + ids(shape.user), 1)
        out["ours_ttft_hit_cb_shape_s"] = statistics.median(
            c.stream(sys_cb + ids(shape.user), 1).ttft for _ in range(max(1, shape.reps)))
        sys_cb2 = ids(shape.cb_prefix)
        res, wall, _ = c.concurrent([sys_cb2 + ids(shape.user) for _ in range(shape.cb_concurrent)],
                                    shape.cb_gen)
        out["ours_cb_workload_wall_s"] = wall
        out["ours_cb_workload_tok_s"] = sum(len(r.tokens) for r in res) / wall
        s = c.stats()
        out["server_stats"] = {"blocks_total": s.blocks_total, "evictions": s.evictions_total,
                               "preemptions": s.preemptions_total,
                               "prompt_tokens": s.prompt_tokens_total,
                               "cached_tokens": s.cached_tokens_total}
    finally:
        c.channel.close()
        stop_server(proc)
    return out


def bench_library(shape: Shape, ids: Ids, out: dict, model: Any) -> None:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    # transformers continuous batching with block sharing.
    gc = GenerationConfig(max_new_tokens=shape.cb_gen, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(allow_block_sharing=True, num_blocks=64,
                                   max_batch_tokens=2048)
    paged, plain = paged_vs_plain_forward(model, ids, 1040, shape.decode_tokens)
    out["inprocess_forward_1k_paged_s"], out["inprocess_forward_1k_plain_s"] = paged, plain
    out["inprocess_forward_1k_paged_over_plain"] = paged / plain

    mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    try:
        def ttft(ids_: list[int]) -> float:
            t0 = time.perf_counter()
            rid = mgr.add_request(ids_, max_new_tokens=1, streaming=True)
            first = None
            for r in mgr.request_id_iter(rid):
                if first is None and r.generated_tokens:
                    first = time.perf_counter() - t0
            return first if first is not None else time.perf_counter() - t0

        sys_cb = ids(shape.cb_prefix)
        ttft(sys_cb + ids(shape.user))  # fills their cache with the prefix
        out["transformers_cb_ttft_hit_s"] = statistics.median(
            ttft(sys_cb + ids(shape.user)) for _ in range(max(1, shape.reps)))
        out["ttft_hit_vs_transformers_cb"] = (out["ours_ttft_hit_cb_shape_s"]
                                              / out["transformers_cb_ttft_hit_s"])
        sys_cb2 = ids(shape.cb_prefix)
        t0 = time.perf_counter()
        for _ in range(shape.cb_concurrent):
            mgr.add_request(sys_cb2 + ids(shape.user), max_new_tokens=shape.cb_gen)
        got = [mgr.get_result(timeout=900) for _ in range(shape.cb_concurrent)]
        wall = time.perf_counter() - t0
        toks = sum(len(r.generated_tokens) for r in got if r is not None)
        out["transformers_cb_workload_wall_s"] = wall
        out["transformers_cb_workload_tok_s"] = toks / wall
        out["throughput_vs_transformers_cb"] = (out["ours_cb_workload_tok_s"]
                                                / out["transformers_cb_workload_tok_s"])
    finally:
        mgr.stop(block=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kvpool")
    ap.add_argument("--quick", action="store_true", help="reduced run (< ~3 minutes)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    shape = QUICK if args.quick else Shape()
    out_path = args.out or RESULTS / ("kvpool-quick.json" if args.quick else "kvpool.json")
    ids = Ids()
    t0 = time.time()
    figures: dict = {}
    load_avg = os.getloadavg()
    model = load_library_model()
    bench_server(shape, ids, figures, model)
    bench_library(shape, ids, figures, model)
    result = {
        "benchmark": "kvpool",
        "command": "python -m benchmarks.kvpool" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "shape": shape.__dict__,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg_at_start": load_avg},
        "model": "SmolLM2-135M-Instruct fp32 cpu",
        "figures": figures,
        "targets": verdicts(TARGETS, figures),  # figures unrounded
        "elapsed_s": time.time() - t0,
    }
    write_result(out_path, result)
    return 0


def write_result(out_path: Path, result: dict) -> None:
    """Write a benchmark's JSON and print its `targets` (value, target, met) one per line."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    targets = result["targets"]
    width = max((len(name) for name in targets), default=0)
    for name, v in targets.items():
        print(f"{name:{width}s} {v['value']!s:>24} target {v['target']:>8}  "
              f"{'met' if v['met'] else 'NOT met'}")
    print(f"wrote {out_path} in {result['elapsed_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
