"""Where a decode step's time goes: the engine's step against the model's own forward.

    python -m benchmarks.step_profile [--device cuda] [--weights random|real] [--steps 48]

For batch sizes 1 and 8 (greedy, prompts of 64 random token ids), times:
  engine_ms_per_step   the replica's engine (`Engine`, paged KV, in this process): the wall time
                       of answers of 16 and 16 + `--steps` tokens, the difference per step (so
                       the prefill, which in a batch interleaves with the first rows' decoding,
                       drops out);
  model_ms_per_step    the same model's forward alone on transformers' own cache
                       (`DynamicCache`), the same batch, one token per row per step, on the
                       torch threads the engine runs such a step on (`one_thread_below`):
                       what transformers' own decoding loop costs, for comparison;
Each the median of `--repeats` (3) timings, engine and transformers interleaved. Where the
device is CUDA, the same two engine runs profiled: kernels launched per decode step and the
GPU's busy time per step (`torch.profiler`; the sum of kernel durations, copies and memsets
counted apart as `copies_per_step`). A step whose GPU time is far below its wall time is
bound by launches and host work, not by the GPU. On a CPU instead, the operators a decode
step runs, by name (`ops_by_name`; each would be a kernel launch on a GPU).

`--weights random` builds SmolLM2-135M's architecture with random weights: a forward costs what
the real model's does (same shapes, same kernels), and nothing has to be loaded. `real` loads
the packaged SmolLM2. Writes `benchmarks/results/step_profile_<device type>.json`.
"""

from __future__ import annotations

import os

# As the replica process: before torch loads OpenMP (which reads it once, at load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.emit import write  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROMPT = 64
SHORT = 16  # tokens of the shorter answer the step times are differenced against
BATCHES = (1, 8)

# SmolLM2-135M-Instruct's architecture (its config.json), for --weights random.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def load(weights: str, device: str):
    from services.kvpool.app import exact_matmuls
    from services.kvpool.linear import pack_linears

    if device.startswith("cuda"):
        exact_matmuls()
    if weights == "random":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE, attn_implementation="sdpa"))
        model_id = "SmolLM2-135M-shape-random"
    else:
        from transformers import AutoModelForCausalLM

        from services.common.model_store import resolve_model

        r = resolve_model("smollm2")
        model = AutoModelForCausalLM.from_pretrained(r.path, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        model_id = r.model_id
    model = model.to(device).eval()
    pack_linears(model)  # the kernels a replica runs the model on (oneDNN on CPU, else torch's)
    return model, model_id


def prompts(batch: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(batch)]


def engine_wall_s(engine, batch: int, steps: int, vocab: int) -> float:
    """Seconds from letting `batch` requests of `steps` tokens go to the last one's end."""
    from benchmarks.inproc import run_together
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec

    reqs = [EngineRequest(f"p{batch}-{i}-{time.monotonic_ns()}", p,
                          SamplingSpec(max_tokens=steps, ignore_eos=True),
                          skip_prefix_cache=True)
            for i, p in enumerate(prompts(batch, vocab))]
    t0, res = run_together(engine, reqs)
    return max(s.end for s in res) - t0


def engine_step_ms(engine, batch: int, steps: int, vocab: int) -> float:
    """A decode step's wall time: answers of SHORT and SHORT + `steps` tokens, the difference
    over `steps`, so that the prompts' prefill (chunked, and in a batch interleaved with the
    first rows' decoding) is left out."""
    short = engine_wall_s(engine, batch, SHORT, vocab)
    return 1000 * (engine_wall_s(engine, batch, SHORT + steps, vocab) - short) / steps


def model_step_ms(model, batch: int, steps: int, device: str, threads: int) -> float:
    """transformers' loop on `threads` torch threads (what the engine runs such a step on)."""
    from transformers import DynamicCache

    ids = torch.tensor(prompts(batch, model.config.vocab_size), device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # As `generate` calls it: an attention mask (all ones here) one column longer each step.
    mask = torch.ones(batch, PROMPT + steps, dtype=torch.long, device=device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            cache = DynamicCache()
            out = model(ids, attention_mask=mask[:, :PROMPT], past_key_values=cache,
                        use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            t0 = time.perf_counter()
            for k in range(steps - 1):
                out = model(nxt, attention_mask=mask[:, :PROMPT + k + 1], past_key_values=cache,
                            use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.tolist()  # the engine takes each step's tokens to the host too
            sync()
    finally:
        torch.set_num_threads(before)
    return 1000 * (time.perf_counter() - t0) / (steps - 1)


def profiled(engine, batch: int, steps: int, vocab: int) -> dict:
    """Kernels launched and GPU busy time per decode step, differenced as `engine_step_ms`."""
    from torch.profiler import ProfilerActivity, profile

    def run(n: int) -> tuple[int, float, int]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine_wall_s(engine, batch, n, vocab)
        on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [e for e in on_gpu if not e.name.startswith(("Memcpy", "Memset"))]
        return len(kernels), sum(e.device_time for e in kernels), len(on_gpu) - len(kernels)

    (k0, us0, c0), (k1, us1, c1) = run(SHORT), run(SHORT + steps)
    return {"kernels_per_step": round((k1 - k0) / steps, 1),
            "gpu_busy_ms_per_step": round((us1 - us0) / 1000 / steps, 3),
            "copies_per_step": round((c1 - c0) / steps, 1)}


VIEWS = {"aten::reshape", "aten::view", "aten::slice", "aten::select", "aten::transpose",
         "aten::unsqueeze", "aten::as_strided", "aten::expand", "aten::t", "aten::permute",
         "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::alias", "aten::empty",
         "aten::to", "aten::resolve_conj", "aten::resolve_neg"}


def ops_per_step(engine, batch: int, steps: int, vocab: int) -> dict[str, float]:
    """The operators one decode step runs, by name (torch's top-level ones on the engine
    thread, views and allocations left out), differenced as `engine_step_ms`: what each
    layer of the model and the engine's own bookkeeping cost in calls (each one a kernel
    launch on a GPU)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    def run(n: int) -> Counter:
        prof = profile(activities=[ProfilerActivity.CPU])
        engine.call(prof.__enter__).result(30)  # the engine thread's operators, not ours
        try:
            engine_wall_s(engine, batch, n, vocab)
        finally:
            engine.call(lambda: prof.__exit__(None, None, None)).result(120)
        ops = ("aten::", "mkldnn::")  # the latter: the packed linear layers (linear.py)
        return Counter(e.name for e in prof.events()
                       if e.name.startswith(ops) and e.name not in VIEWS
                       and (e.cpu_parent is None or not e.cpu_parent.name.startswith(ops)))

    c0, c1 = run(SHORT), run(SHORT + steps)
    per = {k: round((c1[k] - c0[k]) / steps, 1) for k in c1}
    return dict(sorted(((k, v) for k, v in per.items() if v >= 0.5), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_profile")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--weights", choices=("random", "real"), default="random")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="timings per figure (median)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.steps < 4 or args.repeats < 1:
        ap.error("--steps >= 4 and --repeats >= 1")
    out_path = args.out or RESULTS / f"step_profile_{args.device.split(':')[0]}.json"

    from benchmarks import device_name
    from services.common.hashing import BlockHasher
    from services.kvpool.block_pool import BlockPool
    from services.kvpool.engine import Engine, model_info

    model, model_id = load(args.weights, args.device)
    vocab = model.config.vocab_size
    pool = BlockPool(1024, 16, BlockHasher(model_id, 16))
    engine = Engine(model, model_info(model, model_id), pool, max_batch_size=max(BATCHES),
                    drafts=False).start()
    rows = {}
    try:
        for b in BATCHES:
            engine_wall_s(engine, b, SHORT, vocab)  # warm the shapes up
            threads = engine.threads_for(b)  # a decode step's: one row per sequence
            model_step_ms(model, b, 8, args.device, threads)
            eng_ms, mod_ms = [], []
            for _ in range(args.repeats):  # interleaved, so a slow spell lands on both
                eng_ms.append(engine_step_ms(engine, b, args.steps, vocab))
                mod_ms.append(model_step_ms(model, b, args.steps, args.device, threads))
            row = {"engine_ms_per_step": round(statistics.median(eng_ms), 2),
                   "model_ms_per_step": round(statistics.median(mod_ms), 2),
                   "engine_ms_runs": [round(x, 2) for x in eng_ms],
                   "model_ms_runs": [round(x, 2) for x in mod_ms]}
            if args.device.startswith("cuda"):
                row |= profiled(engine, b, args.steps, vocab)
            else:
                ops = ops_per_step(engine, b, args.steps, vocab)
                row |= {"ops_per_step": round(sum(ops.values()), 1), "ops_by_name": ops}
            rows[f"batch_{b}"] = row
            print(f"batch {b}: {row}", flush=True)
    finally:
        engine.stop()
    result = {"benchmark": "step_profile",
              "command": f"python -m benchmarks.step_profile --device {args.device} "
                         f"--weights {args.weights} --steps {args.steps} --repeats {args.repeats}",
              "model": f"{model_id} float32 {args.device}, prompt {PROMPT} tokens, greedy",
              "device_name": device_name(args.device),
              "torch": torch.__version__, "figures": rows}
    write(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
