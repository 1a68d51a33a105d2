"""Cache-assisted generation: a near-miss's answer as a draft the model only verifies.

Near-miss pairs are QQP duplicates (`../shared/data/qqp_val.csv`, is_duplicate = 1). For each
pair, question A is answered by SmolLM2 (greedy, up to 128 tokens) through a real kvpool replica
over gRPC; A's answer (re-tokenized from its text, as the orchestrator does) is then the draft
for paraphrase B. B is generated with and without the draft, alternating which goes first, with
the prefix cache skipped so both compute the same prompt. An unrelated draft (another pair's
answer) measures what a bad draft costs.

Figures (ratios are measured within one run; the machine is shared and noisy):
  decode_speedup            sum of B's wall time without draft / with draft (request start to
                            final message), over pairs whose A answer shares >= 50% of B's tokens
  forward_passes_per_token  decode forwards / generated tokens of B with the draft (same pairs)
  acceptance_rate           accepted / proposed draft tokens (same pairs)
  draft_coverage            accepted draft tokens / generated tokens of B (same pairs)
  unrelated_slowdown        wall with an unrelated draft / without, over all pairs
Greedy outputs with and without a draft are compared token by token (`identical_outputs`).

Run: python -m benchmarks.assisted [--quick]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.kvpool import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
QQP = ROOT.parent / "shared" / "data" / "qqp_val.csv"
MAX_TOKENS = 128
SHARE_MIN = 0.5

TARGETS = {
    "decode_speedup": (">=", 2.0),
    "forward_passes_per_token": ("<=", 0.4),
    "unrelated_slowdown": ("<=", 1.10),
}


@dataclass
class Run:
    tokens: list[int]
    wall_s: float
    forward_passes: int
    proposed: int
    accepted: int


class Client:
    def __init__(self, addr: str) -> None:
        import grpc
        from tiercache.v1 import common_pb2, kvpool_pb2, kvpool_pb2_grpc

        self.pb, self.common = kvpool_pb2, common_pb2
        self.channel = grpc.insecure_channel(addr)
        self.stub = kvpool_pb2_grpc.KvPoolStub(self.channel)

    def generate(self, ids: list[int], draft: list[int] | None = None) -> Run:
        req = self.pb.KvGenerateRequest(
            token_ids=ids, draft_token_ids=draft or [], skip_prefix_cache=True,
            sampling=self.common.SamplingParams(max_tokens=MAX_TOKENS))
        t0 = time.perf_counter()
        toks: list[int] = []
        final = None
        for msg in self.stub.Generate(req, timeout=600):
            toks.extend(msg.token_ids)
            if msg.HasField("final"):
                final = msg.final
        wall = time.perf_counter() - t0
        assert final is not None
        return Run(toks, wall, final.forward_passes, final.draft_tokens_proposed,
                   final.draft_tokens_accepted)

    def stats(self):
        return self.stub.Stats(self.pb.KvStatsRequest(), timeout=10)


def load_pairs(n: int) -> list[tuple[str, str]]:
    out = []
    with QQP.open(newline="") as f:
        for row in csv.DictReader(f):
            if row["is_duplicate"] == "1" and row["question1"] != row["question2"]:
                out.append((row["question1"], row["question2"]))
                if len(out) >= n:
                    break
    return out


def share(draft: list[int], answer: list[int]) -> float:
    """Share of `answer`'s tokens that also occur in `draft` (multiset overlap)."""
    if not answer:
        return 0.0
    return sum((Counter(draft) & Counter(answer)).values()) / len(answer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.assisted")
    ap.add_argument("--quick", action="store_true", help="reduced run (<= ~3 minutes)")
    ap.add_argument("--pairs", type=int, default=0, help="pairs to run (default 3 / 16)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    n = args.pairs or (3 if args.quick else 16)
    out_path = args.out or RESULTS / ("assisted-quick.json" if args.quick else "assisted.json")

    from services.common.model_store import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2").path)

    def prompt(q: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def retokenize(ids: list[int]) -> list[int]:
        return list(tok.encode(tok.decode(ids, skip_special_tokens=True),
                               add_special_tokens=False))

    t0 = time.time()
    load_avg = os.getloadavg()
    proc, addr = start_server(4096)
    rows = []
    try:
        cli = Client(addr)
        cli.generate(prompt("Warm-up question?"))
        pairs = load_pairs(n)
        answers = [cli.generate(prompt(a)).tokens for a, _ in pairs]
        for i, (_, qb) in enumerate(pairs):
            ids = prompt(qb)
            draft = retokenize(answers[i])
            unrelated = retokenize(answers[(i + len(pairs) // 2) % len(pairs)])
            order = ["plain", "draft", "unrelated"] if i % 2 == 0 else \
                ["unrelated", "draft", "plain"]
            runs: dict[str, Run] = {}
            for kind in order:
                d = {"plain": None, "draft": draft, "unrelated": unrelated}[kind]
                runs[kind] = cli.generate(ids, d)
            plain = runs["plain"]
            rows.append({
                "pair": i, "b_tokens": len(plain.tokens),
                "share": round(share(draft, plain.tokens), 3),
                "wall_plain_s": plain.wall_s, "wall_draft_s": runs["draft"].wall_s,
                "wall_unrelated_s": runs["unrelated"].wall_s,
                "passes_plain": plain.forward_passes,
                "passes_draft": runs["draft"].forward_passes,
                "passes_unrelated": runs["unrelated"].forward_passes,
                "proposed": runs["draft"].proposed, "accepted": runs["draft"].accepted,
                "unrelated_proposed": runs["unrelated"].proposed,
                "unrelated_accepted": runs["unrelated"].accepted,
                "identical": runs["draft"].tokens == plain.tokens
                and runs["unrelated"].tokens == plain.tokens,
            })
            r = rows[-1]
            print(f"pair {i:2d} share {r['share']:.2f} tokens {r['b_tokens']:3d} "
                  f"wall {r['wall_plain_s']:.2f}/{r['wall_draft_s']:.2f}/"
                  f"{r['wall_unrelated_s']:.2f} s passes {r['passes_draft']} "
                  f"acc {r['accepted']}/{r['proposed']} same {r['identical']}", flush=True)
        stats = cli.stats()
    finally:
        stop_server(proc)

    near = [r for r in rows if r["share"] >= SHARE_MIN]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    figures = {
        "pairs": len(rows),
        "near_pairs": len(near),
        "decode_speedup": ratio(sum(r["wall_plain_s"] for r in near),
                                sum(r["wall_draft_s"] for r in near)),
        "forward_passes_per_token": ratio(sum(r["passes_draft"] for r in near),
                                          sum(r["b_tokens"] for r in near)),
        "forward_passes_per_token_without_draft": ratio(
            sum(r["passes_plain"] for r in near), sum(r["b_tokens"] for r in near)),
        "acceptance_rate": ratio(sum(r["accepted"] for r in near),
                                 sum(r["proposed"] for r in near)),
        "draft_coverage": ratio(sum(r["accepted"] for r in near),
                                sum(r["b_tokens"] for r in near)),
        "decode_speedup_all_pairs": ratio(sum(r["wall_plain_s"] for r in rows),
                                          sum(r["wall_draft_s"] for r in rows)),
        "draft_coverage_all_pairs": ratio(sum(r["accepted"] for r in rows),
                                          sum(r["b_tokens"] for r in rows)),
        "unrelated_slowdown": ratio(sum(r["wall_unrelated_s"] for r in rows),
                                    sum(r["wall_plain_s"] for r in rows)),
        "unrelated_acceptance_rate": ratio(sum(r["unrelated_accepted"] for r in rows),
                                           sum(r["unrelated_proposed"] for r in rows)),
        "wall_plain_s_near": round(sum(r["wall_plain_s"] for r in near), 3),
        "wall_draft_s_near": round(sum(r["wall_draft_s"] for r in near), 3),
        "identical_outputs": all(r["identical"] for r in rows),
        "stats_draft_tokens_proposed_total": stats.draft_tokens_proposed_total,
        "stats_draft_tokens_accepted_total": stats.draft_tokens_accepted_total,
    }
    targets = {}
    for name, (op, target) in TARGETS.items():
        v = figures.get(name)
        met = v is not None and (v <= target if op == "<=" else v >= target)
        targets[name] = {"value": v, "target": f"{op} {target}", "met": bool(met)}
    result = {
        "benchmark": "assisted",
        "command": "python -m benchmarks.assisted" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "model": "SmolLM2-135M-Instruct fp32 cpu, greedy, max 128 tokens, prefix cache skipped",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg_at_start": load_avg, "load_avg_at_end": os.getloadavg()},
        "figures": figures,
        "targets": targets,
        "pairs": rows,
        "elapsed_s": round(time.time() - t0, 1),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    for name, v in targets.items():
        print(f"{name:28s} {v['value']!s:>8} target {v['target']:>8}  "
              f"{'met' if v['met'] else 'NOT met'}")
    print(f"wrote {out_path} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
