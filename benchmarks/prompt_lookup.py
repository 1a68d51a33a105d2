"""What prompt lookup gives requests that carry no draft (TIERCACHE_KVPOOL_PROMPT_LOOKUP).

    .venv/bin/python -m benchmarks.prompt_lookup [--out PATH] [--questions N] [--batch B]

With the setting on, a request without draft tokens proposes what followed the end of its
context where that occurred earlier in its prompt or output, verified as a draft is (greedy
tokens unchanged). This answers the first `--questions` distinct QQP questions
(`../shared/data/qqp_val.csv`, file order) through a real replica engine (SmolLM2, the
replica's kernels and measured draft ladder, in-process), greedy, up to 128 tokens, each
question with lookup off and on (in alternating order), alone (`--batch 1`, the default) or
`--batch` questions at a time. Reported: decode wall time off / on (first token to the last,
summed over questions: `decode_speedup`), forward passes per generated token off and on, the
share of tokens lookup supplied, and whether every answer was the same both ways; with
`--batch`, also each batch's wall time, its first token to its slowest row's end, summed
(`batch_speedup`): a batch is only done when its slowest row is.
"""

from __future__ import annotations

import os

# As the replica process: before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.emit import write  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "prompt_lookup.json"
MAX_TOKENS = 128


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prompt_lookup")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1, help="questions decoding together")
    args = ap.parse_args(argv)
    if args.questions < 1 or not 1 <= args.batch <= args.questions:
        ap.error("--questions >= 1 and 1 <= --batch <= --questions")
    out_path = args.out or (RESULT if args.batch == 1 else
                            RESULT.with_name(f"prompt_lookup-b{args.batch}.json"))

    from benchmarks.inproc import Streamed, load_replica, result_header, run_together
    from services.common.model_store import load_tokenizer, resolve_model
    from services.kvpool.engine import EngineRequest
    from services.kvpool.sampling import SamplingSpec
    from services.orchestrator.render import Message, PromptRenderer
    from services.semantic.labelled_data import load_qqp  # ../shared/data or TIERCACHE_DATA_DIR

    t_start = time.monotonic()
    renderer = PromptRenderer(load_tokenizer(resolve_model("smollm2").path))
    questions: list[str] = []
    for q, _, _ in load_qqp():
        if len(questions) < args.questions and q not in questions:
            questions.append(q)
    prompts = [renderer.render_chat([Message("user", q)]).token_ids for q in questions]
    replica = load_replica(max_batch_size=max(8, args.batch))
    engine = replica.engine
    n = 0

    def run(group: list[list[int]]) -> list[Streamed]:
        """Each prompt's answer, all admitted together."""
        nonlocal n
        reqs = []
        for p in group:
            n += 1
            reqs.append(EngineRequest(f"lookup-{n}", p, SamplingSpec(max_tokens=MAX_TOKENS),
                                      skip_prefix_cache=True))
        return run_together(engine, reqs)[1]

    rows = []
    group_wall = {False: 0.0, True: 0.0}  # first token of a group to its last row's end
    try:
        for i in range(0, len(prompts), args.batch):
            group = prompts[i:i + args.batch]
            got = {}
            for on in ((False, True) if (i // args.batch) % 2 == 0 else (True, False)):
                engine.prompt_lookup = on
                got[on] = run(group)
                group_wall[on] += max(r.end for r in got[on]) - min(r.first for r in got[on])
            for j, ((t_off, a_off, e_off, f_off), (t_on, a_on, e_on, f_on)) in enumerate(
                    zip(got[False], got[True], strict=True)):
                s_off, s_on = e_off - a_off, e_on - a_on
                rows.append({"question": questions[i + j], "tokens": len(t_on),
                             "same_answer": t_off == t_on,
                             "decode_s_off": round(s_off, 3), "decode_s_on": round(s_on, 3),
                             "passes_off": f_off.forward_passes,
                             "passes_on": f_on.forward_passes,
                             "lookup_accepted": f_on.lookup_tokens_accepted,
                             "lookup_proposed": f_on.draft_tokens_proposed})
                print(f"  {i + j + 1}/{len(prompts)}: {len(t_on)} tokens, decode "
                      f"{s_off:.2f} -> {s_on:.2f} s, forwards {f_off.forward_passes} -> "
                      f"{f_on.forward_passes}", flush=True)
    finally:
        engine.stop()
    tokens = sum(r["tokens"] for r in rows)
    wall_off = sum(r["decode_s_off"] for r in rows)
    wall_on = sum(r["decode_s_on"] for r in rows)
    figures = {
        "questions": len(rows), "batch": args.batch, "tokens": tokens,
        "decode_wall_s_off": round(wall_off, 2), "decode_wall_s_on": round(wall_on, 2),
        "decode_speedup": round(wall_off / wall_on, 3) if wall_on else None,
        "forward_passes_per_token_off": round(sum(r["passes_off"] for r in rows) / tokens, 3),
        "forward_passes_per_token_on": round(sum(r["passes_on"] for r in rows) / tokens, 3),
        "lookup_share_of_tokens": round(sum(r["lookup_accepted"] for r in rows) / tokens, 3),
        "lookup_acceptance_rate": round(sum(r["lookup_accepted"] for r in rows)
                                        / max(1, sum(r["lookup_proposed"] for r in rows)), 3),
        "identical_outputs": all(r["same_answer"] for r in rows),
    }
    if args.batch > 1:  # what a batch took, first token to its slowest row's end
        figures["batch_wall_s_off"] = round(group_wall[False], 2)
        figures["batch_wall_s_on"] = round(group_wall[True], 2)
        figures["batch_speedup"] = round(group_wall[False] / group_wall[True], 3)
    print(json.dumps(figures), flush=True)
    result = {
        **result_header(replica, "prompt_lookup", "python -m benchmarks.prompt_lookup"
                        + (f" --batch {args.batch}" if args.batch > 1 else ""), MAX_TOKENS),
        "figures": figures,
        "per_question": rows,
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    write(out_path, result)
    return 0 if figures["identical_outputs"] else 1


if __name__ == "__main__":
    sys.exit(main())
