"""Linear kernels of a CPU replica: torch's (MKL) against oneDNN with packed weights.

    .venv/bin/python -m benchmarks.linear [--dtype float32|bfloat16] [--out PATH] [--reps N]

On torch's threads (`OMP_NUM_THREADS=1`: one, as a replica runs forwards under
`TIERCACHE_KVPOOL_ONE_THREAD_BELOW` tokens; the command recorded says so).

- head_ms: SmolLM2's head (49,152 x 576, float32) applied to 1, 2, 3, 4, 8, 16 and 17 rows
  (a decode step, draft verify forwards), median of `--reps` calls, both kernels.
- forward_ms: the whole model's forward of q = 1..17 new tokens over a 96-token cache, as the
  replica times it at start to choose its draft lengths (`calibrate.forward_costs`), loaded with
  each kernel setting (`TIERCACHE_KVPOOL_LINEAR_KERNELS`); and each over its 1-token forward.
- logits_max_abs_diff / greedy_tokens_equal: the two kernels on one chat prompt (the last
  float32 bits differ; whether 64 greedy tokens still agree is reported, not required).

`--dtype bfloat16` (→ `results/linear_bfloat16.json`): the model loaded in bfloat16, packed
where oneDNN runs bfloat16 natively on this CPU (its head as a float32 copy, as a replica packs
it); the head timing is of that float32 head either way. Unpacked, the model's forward runs its
own bfloat16 head, where a replica computes logits with a float32 copy on torch's kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = (1, 2, 3, 4, 8, 16, 17)


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def head_ms(weight: torch.Tensor, reps: int) -> dict[str, dict[int, float]]:
    from services.kvpool.linear import PackedLinear

    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    packed = PackedLinear(lin)
    g = torch.Generator().manual_seed(0)
    out: dict[str, dict[int, float]] = {"torch": {}, "onednn": {}}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], generator=g)
            out["torch"][rows] = _median_ms(lambda x=x: lin(x), reps)
            out["onednn"][rows] = _median_ms(lambda x=x: packed(x), reps)
            print(f"  head, {rows:2d} rows: torch {out['torch'][rows]:7.2f} ms, "
                  f"oneDNN {out['onednn'][rows]:7.2f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.linear")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: results/linear.json, linear_bfloat16.json for bfloat16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    out = args.out or RESULTS / ("linear.json" if args.dtype == "float32"
                                 else f"linear_{args.dtype}.json")

    from services.common.model_store import load_tokenizer, resolve_model
    from services.kvpool.app import load_model
    from services.kvpool.calibrate import forward_costs
    from services.kvpool.config import KvPoolConfig
    from services.kvpool.linear import pack_linears

    t_start = time.monotonic()
    print(f"loading SmolLM2 ({args.dtype}) on torch's kernels ...", flush=True)
    model, model_id, packing = load_model(KvPoolConfig(linear_kernels="torch", dtype=args.dtype))
    assert packing.kernels == "torch"
    tok = load_tokenizer(resolve_model("smollm2").path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "How do I learn to swim?"}],
                                     add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)["input_ids"]

    def greedy(m) -> tuple[torch.Tensor, list[int]]:
        with torch.inference_mode():
            logits = m(prompt).logits[0, -1].float()
            out = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64,
                             do_sample=False)
        return logits, out[0, prompt.shape[1]:].tolist()

    print("timing the head ...", flush=True)
    head_shape = list(model.lm_head.weight.shape)
    head = head_ms(model.lm_head.weight.detach().float(), args.reps)
    forward: dict[str, dict[int, float]] = {}
    print("timing forwards of 1..17 tokens on torch's kernels ...", flush=True)
    forward["torch"] = {q: round(s * 1e3, 2) for q, s in forward_costs(model, 17, sweeps=4,
                                                                         budget_s=300).items()}
    logits_t, toks_t = greedy(model)
    got = pack_linears(model)
    if got.kernels != "onednn":
        print(f"no oneDNN here: {got.why_not}", file=sys.stderr)
        return 1
    print("timing forwards of 1..17 tokens on oneDNN ...", flush=True)
    forward["onednn"] = {q: round(s * 1e3, 2) for q, s in forward_costs(model, 17, sweeps=4,
                                                                          budget_s=300).items()}
    logits_o, toks_o = greedy(model)
    relative = {k: {q: round(v[q] / v[1], 3) for q in v} for k, v in forward.items()}
    for q in forward["torch"]:
        print(f"  forward of {q:2d}: torch {forward['torch'][q]:7.1f} ms "
              f"({relative['torch'][q]:.2f}x), oneDNN {forward['onednn'][q]:7.1f} ms "
              f"({relative['onednn'][q]:.2f}x)")
    threads = os.environ.get("OMP_NUM_THREADS")
    command = (f"OMP_NUM_THREADS={threads} " if threads else "") + "python -m benchmarks.linear" + (
        "" if args.dtype == "float32" else f" --dtype {args.dtype}")
    result = {
        "benchmark": "linear",
        "command": command,
        "model": f"{model_id} {args.dtype} cpu",
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpu_model": cpu_model()},
        "head_shape": head_shape,
        "head_ms": head,
        "forward_ms": forward,
        "forward_over_1_token": relative,
        "figures": {
            "decode_step_speedup": round(forward["torch"][1] / forward["onednn"][1], 3),
            "forward_17_speedup": round(forward["torch"][17] / forward["onednn"][17], 3),
            "forward_17_over_1_torch": relative["torch"][17],
            "forward_17_over_1_onednn": relative["onednn"][17],
            "logits_max_abs_diff": float((logits_t - logits_o).abs().max()),
            "greedy_tokens_equal": toks_t == toks_o,
        },
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["figures"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
