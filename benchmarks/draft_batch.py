"""What one drafting request costs the requests batched with it, with and without the gate.

    .venv/bin/python -m benchmarks.draft_batch [--out PATH] [--reps N] [--batches 2,4,8]

Every row of a batch's forward is as long as its longest draft proposal, so one request
verifying a cached near-miss answer makes every request decoding beside it pay for its
proposal's tokens. With `TIERCACHE_KVPOOL_DRAFT_BATCH_GATE` (on by default) the engine cuts
proposals to the length expected to emit the most tokens per forward cost
(`drafting.batch_keep`). This runs batches of B requests through a real replica engine
(SmolLM2, the replica's kernels and measured draft ladder, in-process): row 0 asks QQP question
B of a near-miss pair (`benchmarks.assisted.near_miss_pairs`) with A's greedy answer as its
draft, the other rows ask other QQP questions without one; greedy, up to 128 tokens, every row
admitted before the first decode step. Each repeat runs the same batch three ways, in rotating
order: no draft at all (`plain`), the draft with the gate (`gate_on`) and without it
(`gate_off`), and checks that every row's tokens are the same all three ways. Reported per B,
medians over the repeats (a different pair each repeat):

- batch_s: wall time until every row has finished;
- drafting_row_s: until the drafting row has finished (what drafting is for);
- batch_over_plain: batch_s over plain's (above 1: the draft slowed the whole batch down);
- withheld / verified draft tokens, and the forwards of several rows that verified any.

With `--all-draft` every row drafts: row i asks B of near pair i (a different pair per row
and repeat) with A's greedy answer as its draft, and the three ways are no draft (`plain`),
drafts with trees in the padding of shorter rows (`trees`, the replica's
TIERCACHE_KVPOOL_DRAFT_BRANCHES) and without (`no_trees`), the gate on in both; also the
trees built and the ones an alternative won (→ `results/draft_batch_all.json`).
"""

from __future__ import annotations

import os

# As the replica process: before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.emit import write  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "draft_batch.json"
RESULT_ALL = RESULT.with_name("draft_batch_all.json")
BATCHES = (2, 4, 8)
MAX_TOKENS = 128
MODES = ("plain", "gate_on", "gate_off")
MODES_ALL = ("plain", "trees", "no_trees")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.draft_batch")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="batch sizes (rows decoding together), at least 2")
    ap.add_argument("--all-draft", action="store_true",
                    help="every row drafts; compare trees in the padding on and off")
    args = ap.parse_args(argv)
    batches = sorted({int(b) for b in args.batches.split(",")})
    if min(batches) < 2:
        ap.error("--batches: at least 2 rows (one drafting, others plain)")
    all_draft = args.all_draft
    modes = MODES_ALL if all_draft else MODES
    out_path = args.out or (RESULT_ALL if all_draft else RESULT)

    from benchmarks.assisted import near_miss_pairs
    from benchmarks.inproc import load_replica, result_header, run_together
    from services.common.model_store import load_tokenizer, resolve_model
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec
    from services.orchestrator.render import Message, PromptRenderer
    from services.semantic.labelled_data import load_qqp  # ../shared/data or TIERCACHE_DATA_DIR

    t_start = time.monotonic()
    renderer = PromptRenderer(load_tokenizer(resolve_model("smollm2").path))

    def prompt_ids(q: str) -> list[int]:  # as the orchestrator renders a one-message chat
        return renderer.render_chat([Message("user", q)]).token_ids

    pairs, _ = near_miss_pairs(args.reps * max(batches) if all_draft else args.reps)
    others: list[str] = []  # plain rows: QQP questions of non-duplicate pairs, file order
    for q, _, duplicate in load_qqp():
        if duplicate == 0 and len(others) < max(batches):
            others.append(q)
    replica = load_replica(max_batch_size=max(batches))
    engine = replica.engine
    shapes: list[tuple[int, int]] = []
    real_forward = engine._forward

    def forward(ids, plan, keep=1, need=None):  # counts forwards of several rows by length
        if plan.batch > 1:
            shapes.append((plan.batch, plan.q_len))
        return real_forward(ids, plan, keep, **({} if need is None else {"need": need}))

    engine._forward = forward
    n = 0

    def run(rows: list[tuple[list[int], list[int]]]) -> tuple[list[list[int]], list[float]]:
        """Every (prompt, draft) row admitted together: each row's tokens and seconds until it
        finished."""
        nonlocal n
        reqs = []
        for p, d in rows:
            n += 1
            reqs.append(EngineRequest(f"batch-{n}", p, SamplingSpec(max_tokens=MAX_TOKENS),
                                      skip_prefix_cache=True, draft_token_ids=tuple(d)))
        t0, res = run_together(engine, reqs)
        return [r.tokens for r in res], [r.end - t0 for r in res]

    results: dict[int, dict[str, list[dict[str, float]]]] = {b: {m: [] for m in modes}
                                                             for b in batches}
    branches = engine.draft_branches
    try:
        drafts = []
        for pair in pairs:  # A's greedy answer: the cached near-miss B drafts with
            (ans,), _ = run([(prompt_ids(pair.qa), [])])
            drafts.append(ans)
        for rep in range(args.reps):
            pair, draft = pairs[rep % len(pairs)], drafts[rep % len(drafts)]
            for b in batches:
                if all_draft:  # row i: near pair rep * max(batches) + i, its own draft
                    ks = [(rep * max(batches) + i) % len(pairs) for i in range(b)]
                    rows = [(prompt_ids(pairs[k].qb), drafts[k]) for k in ks]
                else:
                    rows = [(prompt_ids(pair.qb), draft)] + [(prompt_ids(q), [])
                                                             for q in others[:b - 1]]
                order = modes[rep % 3:] + modes[:rep % 3]
                toks_by = {}
                for mode in order:
                    engine.batch_gate = mode != "gate_off"
                    engine.draft_branches = 1 if mode == "no_trees" else branches
                    w0, v0 = engine.draft_tokens_withheld_total, \
                        engine.draft_tokens_proposed_total
                    t0, t1 = engine.draft_tree_forwards_total, \
                        engine.draft_tree_branch_wins_total
                    shapes.clear()
                    # Without a draft every row decodes plainly; else only the ones that have
                    # one draft (the first, unless --all-draft).
                    toks, done = run([(p, [] if mode == "plain" else d) for p, d in rows])
                    toks_by[mode] = toks
                    results[b][mode].append({
                        "batch_s": max(done), "drafting_row_s": done[0],
                        "tokens": sum(len(t) for t in toks),
                        "withheld": engine.draft_tokens_withheld_total - w0,
                        "verified": engine.draft_tokens_proposed_total - v0,
                        "trees": engine.draft_tree_forwards_total - t0,
                        "tree_wins": engine.draft_tree_branch_wins_total - t1,
                        "batched_forwards": len(shapes),
                        "batched_forwards_verifying": sum(q > 1 for _, q in shapes)})
                if any(toks_by[m] != toks_by["plain"] for m in modes):
                    raise AssertionError(f"B={b}, pair {rep}: a draft changed an answer")
                print(f"  repeat {rep + 1}/{args.reps}, B={b}: " + ", ".join(
                    f"{m} {results[b][m][-1]['batch_s']:.2f} s" for m in modes), flush=True)
    finally:
        engine.stop()

    def med(b: int, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[b][mode])

    table = {}
    for b in batches:
        plain = med(b, "plain", "batch_s")
        table[b] = {m: {"batch_s": round(med(b, m, "batch_s"), 3),
                        "drafting_row_s": round(med(b, m, "drafting_row_s"), 3),
                        "batch_over_plain": round(med(b, m, "batch_s") / plain, 3),
                        "batch_tokens_per_s": round(med(b, m, "tokens") / med(b, m, "batch_s"),
                                                    2),
                        "withheld": med(b, m, "withheld"), "verified": med(b, m, "verified"),
                        "trees": med(b, m, "trees"), "tree_wins": med(b, m, "tree_wins"),
                        "batched_forwards_verifying": med(b, m, "batched_forwards_verifying"),
                        "batched_forwards": med(b, m, "batched_forwards")}
                    for m in modes}
        one, two = modes[1], modes[2]
        print(f"B={b}: batch wall over plain: {one} {table[b][one]['batch_over_plain']}, "
              f"{two} {table[b][two]['batch_over_plain']}; first row "
              f"{table[b][one]['drafting_row_s']} / {table[b][two]['drafting_row_s']} s (plain "
              f"{table[b]['plain']['drafting_row_s']} s); trees {table[b][one]['trees']}",
              flush=True)
    command = "python -m benchmarks.draft_batch" + (" --all-draft" if all_draft else "")
    result = {
        **result_header(replica, "draft_batch", command, MAX_TOKENS),
        "rows_drafting": "all" if all_draft else "the first",
        "pairs": [{"qa": p.qa, "qb": p.qb, "cosine": p.cosine} for p in pairs],
        "reps": args.reps,
        "by_batch": table,
        "runs": results,
        "identical_outputs": True,
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    write(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
