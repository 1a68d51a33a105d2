"""The replica on a chosen device (a GPU): exactness of every reuse path, and what drafts give.

    python -m benchmarks.device --device cuda [--pairs 24] [--out PATH]

The served benchmarks run where CI runs, on CPUs. This one answers two questions on any
device a replica can be configured for (`TIERCACHE_KVPOOL_DEVICE`), in one process, with the
real SmolLM2 built as `python -m services.kvpool` builds it (`benchmarks.inproc.load_replica`;
its draft ladder timed on that device at start):

1. Exactness there. A cache must never change the answer: for each near pair (below) B's
   greedy tokens are computed from scratch, then again with its prompt's KV taken from the
   pool (a second run, which must report `cached_tokens` > 0: `cached_path_taken`), with the
   near-miss draft, with an unrelated draft, and all of the pairs' B's decoding together in
   batches of 8, each with its draft; every one of them must equal the first, token for token
   (`identical_outputs`). A seeded sampled answer must be the same with a draft and without
   (`identical_sampled`).
2. Cache-assisted generation there, on the replica in-process (`python -m benchmarks.assisted`
   needs the whole stack: semantic tier, faiss, ONNX Runtime, gRPC): the near pairs are the
   ones that benchmark's last run timed (`qa`, `qb` in `benchmarks/results/assisted.json`), A
   is answered greedily (128 tokens) and its answer's text tokenized again as the draft (the
   orchestrator drafts with the model's own ids where they decode to the text,
   `pipeline.answer_ids`, so a word the model wrote in pieces its tokenizer would not choose
   agrees here a little less often than served), B is timed at batch 1 without a draft, with
   it and with an unrelated draft (the next pair's A answer), the order rotated per pair.
   Figures: `decode_speedup_in_process` (wall without / with the draft, request start to its
   end, over pairs whose draft shares >= 50% of B's tokens; `benchmarks.assisted`'s
   `decode_speedup` times the same through the orchestrator, gRPC and streaming included),
   and as that benchmark defines them `forward_passes_per_token` (counting the prefill
   forward, same pairs), `acceptance_rate` and `unrelated_slowdown` (all pairs; there too
   timed on the replica directly), plus `ms_per_token_plain` and the device's forward costs
   by length (`draft_forward_costs`: a forward of n tokens against one of 1).

Exits 1 when any output differs. Writes `benchmarks/results/device_<type>.json`.
"""

from __future__ import annotations

import os

# As the replica process: before torch loads OpenMP (which reads it once, at load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.emit import write  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAIRS_FROM = RESULTS / "assisted.json"
MAX_TOKENS = 128
SHARE_MIN = 0.5
BATCH = 8
SAMPLE_SEED = 1234


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device")
    ap.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N")
    ap.add_argument("--pairs", type=int, default=24, help="near pairs (at most those stored)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out_path = args.out or RESULTS / f"device_{args.device.split(':')[0]}.json"

    from benchmarks import device_name
    from benchmarks.assisted import ratio, share
    from benchmarks.inproc import load_replica, result_header, run_together
    from services.common.model_store import load_tokenizer, resolve_model
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec
    from services.orchestrator.render import Message, PromptRenderer

    t_start = time.monotonic()
    stored = json.loads(PAIRS_FROM.read_text())["pairs"]
    pairs = [(p["qa"], p["qb"]) for p in stored][:args.pairs]
    if len(pairs) < 2:
        ap.error(f"{PAIRS_FROM} holds {len(stored)} pairs; at least 2 are needed")
    tok = load_tokenizer(resolve_model("smollm2").path)
    renderer = PromptRenderer(tok)

    def prompt(q: str) -> list[int]:
        return renderer.render_chat([Message("user", q)]).token_ids

    replica = load_replica(max_batch_size=BATCH, device=args.device)
    engine = replica.engine
    n = 0

    def req(p: list[int], draft: list[int] = (), cache: bool = False, **sampling
            ) -> EngineRequest:
        nonlocal n
        n += 1
        return EngineRequest(f"dev-{n}", list(p), SamplingSpec(max_tokens=MAX_TOKENS, **sampling),
                             skip_prefix_cache=not cache, draft_token_ids=tuple(draft))

    def one(r: EngineRequest):
        t0, (s,) = run_together(engine, [r])
        return s.tokens, s.end - t0, s.final

    rows, plain_tokens = [], []
    try:
        drafts = []
        for i, (qa, _) in enumerate(pairs):
            a, _, _ = one(req(prompt(qa)))
            drafts.append(list(tok.encode(tok.decode(a, skip_special_tokens=True),
                                          add_special_tokens=False)))
            print(f"  A {i + 1}/{len(pairs)}: {len(a)} tokens", flush=True)
        for i, (qa, qb) in enumerate(pairs):
            pb = prompt(qb)
            unrelated = drafts[(i + 1) % len(pairs)]
            runs = {"plain": lambda pb=pb: one(req(pb)),
                    "draft": lambda pb=pb, d=drafts[i]: one(req(pb, d)),
                    "unrelated": lambda pb=pb, u=unrelated: one(req(pb, u))}
            order = list(runs)[i % 3:] + list(runs)[:i % 3]
            got = {k: runs[k]() for k in order}
            b = got["plain"][0]
            plain_tokens.append(b)
            # The prompt's KV from the pool: stored by the first run, taken by the second.
            c1, c2 = one(req(pb, cache=True)), one(req(pb, cache=True))
            sampled = [one(req(pb, d, temperature=0.8, top_p=0.95, seed=SAMPLE_SEED + i))[0]
                       for d in ([], drafts[i])]
            fin = got["draft"][2]
            rows.append({
                "qa": qa, "qb": qb, "b_tokens": len(b),
                "share": round(share(drafts[i], b), 3),
                "wall_plain_s": round(got["plain"][1], 4),
                "wall_draft_s": round(got["draft"][1], 4),
                "wall_unrelated_s": round(got["unrelated"][1], 4),
                "passes_plain": got["plain"][2].forward_passes,
                "passes_draft": fin.forward_passes,
                "passes_unrelated": got["unrelated"][2].forward_passes,
                "proposed": fin.draft_tokens_proposed, "accepted": fin.draft_tokens_accepted,
                "cached_tokens_second_run": c2[2].cached_tokens,
                "identical": all(x[0] == b for x in (got["draft"], got["unrelated"], c1, c2)),
                "identical_sampled": sampled[0] == sampled[1],
            })
            r = rows[-1]
            print(f"  B {i + 1}/{len(pairs)}: {len(b)} tokens, share {r['share']:.2f}, "
                  f"{r['wall_plain_s']:.3f} -> {r['wall_draft_s']:.3f} s "
                  f"(unrelated {r['wall_unrelated_s']:.3f}), forwards {r['passes_plain']} -> "
                  f"{r['passes_draft']}, same {r['identical']}, sampled same "
                  f"{r['identical_sampled']}", flush=True)
        # Every B decoding together, BATCH at a time, each with its draft.
        batch_wall = 0.0
        for k in range(0, len(pairs), BATCH):
            group = list(range(k, min(k + BATCH, len(pairs))))
            t0, res = run_together(engine, [req(prompt(pairs[i][1]), drafts[i]) for i in group])
            batch_wall += max(s.end for s in res) - t0
            for i, s in zip(group, res, strict=True):
                rows[i]["identical_batched"] = s.tokens == plain_tokens[i]
        header = result_header(replica, "device", "python -m benchmarks.device --device "
                               f"{args.device} --pairs {args.pairs}", MAX_TOKENS)
        in_use = engine.call(lambda: (engine.check_integrity(), engine.pool.stats())[1]
                             ).result(30).in_use
    finally:
        engine.stop()

    near = [r for r in rows if r["share"] >= SHARE_MIN]
    tokens = sum(r["b_tokens"] for r in rows)

    figures = {
        "pairs": len(rows), "near_pairs": len(near),
        "decode_speedup_in_process": ratio(sum(r["wall_plain_s"] for r in near),
                                           sum(r["wall_draft_s"] for r in near)),
        "forward_passes_per_token": ratio(sum(r["passes_draft"] + 1 for r in near),
                                          sum(r["b_tokens"] for r in near)),
        "acceptance_rate": ratio(sum(r["accepted"] for r in near),
                                 sum(r["proposed"] for r in near)),
        "unrelated_slowdown": ratio(sum(r["wall_unrelated_s"] for r in rows),
                                    sum(r["wall_plain_s"] for r in rows)),
        "ms_per_token_plain": round(1000 * sum(r["wall_plain_s"] for r in rows) / tokens, 2),
        "batched_wall_s": round(batch_wall, 3),
        "batched_vs_one_at_a_time_with_draft": ratio(sum(r["wall_draft_s"] for r in rows),
                                                     batch_wall),
        "identical_outputs": all(r["identical"] and r["identical_batched"] for r in rows),
        "identical_sampled": all(r["identical_sampled"] for r in rows),
        "cached_path_taken": all(r["cached_tokens_second_run"] > 0 for r in rows),
        "pool_blocks_in_use_at_end": in_use,
    }
    print(json.dumps(figures), flush=True)
    import transformers

    result = {**header, "device_name": device_name(args.device),
              "transformers": transformers.__version__,
              "pairs_from": f"{PAIRS_FROM.relative_to(ROOT)} (the pairs its run timed)",
              "figures": figures, "per_pair": rows,
              "elapsed_s": round(time.monotonic() - t_start, 1)}
    write(out_path, result)
    ok = (figures["identical_outputs"] and figures["identical_sampled"]
          and figures["cached_path_taken"] and in_use == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
