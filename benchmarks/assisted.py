"""Cache-assisted generation: a near-miss's answer as a draft the model only verifies.

Workload (the issue's): near-miss pairs from `../shared/data/qqp_val.csv` duplicates
(is_duplicate = 1), run through the served path: a loopback stack of real processes (semantic,
prefix, one kvpool replica, orchestrator; `services/launcher.py`).

 1. Candidates: duplicates in file order whose cosine under the tier's embedder
    (all-MiniLM-L6-v2 through ONNX Runtime) is at least the draft floor (0.80). There is no
    upper cut: a match at or above the hit threshold that the tier's guard or verifier
    refuses is a near-miss too (the tier then returns it as a draft). This only saves
    answering pairs that cannot be near-misses; the served tier decides hit or near-miss.
 2. Each candidate's question A is answered through the orchestrator (greedy, up to 128
    tokens, semantic lookup skipped) and, as for any greedy answer, the orchestrator stores it
    in the semantic tier. All pairs share one namespace (default tenant, no system prompt),
    so B's lookup searches every stored answer.
 3. Paraphrase B is asked through the orchestrator in the standard tier with its answer not
    stored and the prefix cache skipped (every run computes the same prompt). B is a near-miss
    when the tier hands the orchestrator a draft (the CacheReport names an entry and it is not
    a hit); hits and B's without a draft are counted and left out. One untimed run per B,
    8 at a time, gives B's greedy answer and its draft entry.
 4. Timed, at batch 1, rotating the order: B through the orchestrator without the draft
    (`skip_draft`) and with it (the entry the tier chose, re-tokenized by the orchestrator);
    and, because the orchestrator cannot be told which draft to use, B on the replica directly
    without a draft, with an unrelated draft (another pair's answer), with a one-token draft
    the model never emits (prompt lookup alone) and with a draft of random token ids (fixed
    seed, as long as the unrelated draft; about as costly to time as the lookup-only run,
    under a minute over 12 pairs). Only pairs whose
    screening share is >= 50% are timed, plus further near-miss pairs in file order until
    at least `--min-timed` are timed (so the unrelated-draft figure also covers drafts that
    share little). The target subset is decided on the timed no-draft answer.

Figures (ratios are measured within one run; the machine is shared and noisy):
  decode_speedup            sum of B's wall time through the orchestrator without draft /
                            with draft (request start to final message), over timed pairs whose
                            draft shares >= 50% of B's tokens (multiset overlap)
  forward_passes_per_token  forwards / generated tokens of B with the draft (same pairs):
                            its decode forwards (CacheReport.forward_passes) plus its prefill
                            forward, which verifies the first proposal too (NOTES;
                            forward_passes_per_token_decode_only leaves it out)
  acceptance_rate           accepted / proposed tokens as served (CacheReport), both sources;
                            acceptance_rate_draft / _lookup split them by source
  draft_coverage            tokens proposed from the cached answer and accepted / generated
  lookup_coverage           tokens proposed by prompt lookup (the sequence's own prompt and
                            output, used where they match longer than the draft) and accepted /
                            generated tokens; the split by source comes from replaying the
                            replica's pure drafting logic (`services/kvpool/drafting.py`)
                            against the greedy answer, which must reproduce the served forward
                            and accepted counts (`replay_matches_server`)
  unrelated_slowdown        wall with an unrelated draft / without, on the replica directly,
                            over all timed pairs (as the issue defines it). Any draft turns on
                            prompt lookup, so this mixes lookup's gain with the draft's cost;
                            read it with the next figure:
  unrelated_draft_cost_vs_lookup_only  the unrelated draft's own cost: wall with it / with a
                            one-token draft the model never emits (prompt lookup alone), same
                            pairs; and lookup_only_speedup_vs_plain,
                            forward_passes_per_token_lookup_only
  random_draft_slowdown     wall with a draft of random token ids / without, on the replica
                            directly, same pairs (a draft that never agrees; with it,
                            random_draft_cost_vs_lookup_only)
Context figures, computed from the greedy answers, not timed:
  forward_passes_per_token_draft_only_replayed  the same replay with prompt lookup off
  forward_passes_per_token_replayed_without_tree  the same replay without trees (each forward
                            verifying its proposal alone); tree_forwards_replayed: forwards
                            that verified a tree in the replay as served
  forward_passes_per_token_hindsight_bound_draft  a lower bound (no drafter can need fewer
                            forwards) for drafting from the cached answer alone: with the answer
                            known, each forward proposes the best slice of the draft starting
                            at any position, at most MAX_DRAFT_TOKENS; proposals are free
                            (`hindsight_passes`)
  forward_passes_per_token_hindsight_bound  the same bound with the sequence's own context
                            (prompt + answer so far, what prompt lookup sees) as a second source
  replayed_speedup_by_ladder  the decode speed-up of the near pairs' answers replayed as the
                            replica drafts (its ladder, lengths chosen by cost), and with
                            lengths by match length on rungs: the replica's ladder, the fixed
                            fallback LADDER, 4,8,16, 16,16,16 and the best rungs in hindsight;
                            each forward costs what the replica's served steps of that
                            length cost by the end of the run (draft_costs_served_at_end; the
                            start-up timing for lengths served under 8 times): forward cost
                            only, no serving overhead, so how much the choice of lengths gave
                            away. The replica's own choices used the costs it had learned
                            when each B arrived, which the replay of that B uses too.
                            All with the replica's trees; also "replica_no_tree", and
                            "flat_costs": as a replica would draft where every forward costs
                            one (a GPU, as expected; not measured), with and without trees
Greedy outputs of all six timed runs are compared token by token (`identical_outputs`).

Run: python -m benchmarks.assisted [--quick]   (~21 minutes on the 2-core Intel host; --quick ~5)
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import cpu_model, plaintext_env, stack_log_dir
from benchmarks.emit import rounded, verdicts
from benchmarks.kvpool import write_result

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MAX_TOKENS = 128
MAX_DRAFT_TOKENS = 16  # the replica's default max_draft_tokens (the replay must use the same)
SHARE_MIN = 0.5
UNTIMED_BATCH = 8
TIER = "standard"
RANDOM_DRAFT_SEED = 20240607  # the random-token draft's seed (plus the pair index)

# Printed into the result beside the figures they qualify (and by benchmarks/report.py).
NOTES = {
    "forward_passes_per_token": "the target figure counts each request's prefill forward too "
                          "(it also verifies the first draft proposal, up to "
                          f"{MAX_DRAFT_TOKENS} tokens); every other forward_passes_* figure "
                          "counts decoding forwards only, as the CacheReport does "
                          "(forward_passes_per_token_decode_only is this one without it).",
    "unrelated_slowdown": "wall with the unrelated draft / without any draft, as the issue "
                          "defines it. Any draft turns on prompt lookup (proposals from the "
                          "sequence's own prompt and output), so this includes lookup's gain; "
                          "the unrelated draft's own cost is unrelated_draft_cost_vs_lookup_only "
                          "(with it / with prompt lookup alone).",
    "forward_passes_per_token_hindsight_bound": "lower bounds, not estimates: with the answer "
                          "known, each forward proposes the slice (at most "
                          f"{MAX_DRAFT_TOKENS} tokens) starting at any position that agrees "
                          "longest, from the cached answer (_bound_draft) or from it and the "
                          "sequence's own prompt and output so far (_bound, what prompt lookup "
                          "can use); no drafter using those sources needs fewer forwards.",
    "near_pairs": "the target figures are over the near pairs: timed pairs whose served draft "
                  "(the stored answer the tier chose for B) shares >= 50% of B's greedy "
                  "no-draft tokens (multiset overlap). The issue names A's answer; the two "
                  "differ where the tier drafted from another question's stored answer "
                  "(near_pairs - near_pairs_draft_from_own_question pairs). Decided on B's "
                  "answer and the draft, never on a timing.",
    "hindsight_ranking": "in replayed_speedup_by_ladder: the replica's drafting, except that "
                         "each re-alignment takes, of the draft positions after the context's "
                         "last token, the one that agrees longest with the known answer. Not a "
                         "bound: what perfect ranking would give a drafter that re-aligns on "
                         "matched context, at the served costs and at flat ones.",
}

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
    entry_id: str = ""  # semantic entry stored (A) or used as the draft / served (B)
    similarity: float = 0.0
    hit: bool = False
    prompt_tokens: int = 0


class Served:
    """The stack's orchestrator (the served path) and its one replica (the unrelated draft)."""

    def __init__(self, orchestrator: str, replica: str) -> None:
        import grpc
        from tiercache.v1 import common_pb2, kvpool_pb2, kvpool_pb2_grpc

        from clients.python.client import TierCacheClient

        self.common, self.kv = common_pb2, kvpool_pb2
        self.client = TierCacheClient(orchestrator, timeout=900)
        self.channel = grpc.insecure_channel(replica)
        self.replica = kvpool_pb2_grpc.KvPoolStub(self.channel)

    def close(self) -> None:
        self.client.close()
        self.channel.close()

    def ask(self, question: str, *, lookup: bool = True, store: bool = False,
            draft: bool = True) -> Run:
        """One request through the orchestrator, prefix cache skipped."""
        policy = self.common.CachePolicy(
            skip_semantic_lookup=not lookup, skip_semantic_store=not store,
            skip_prefix_cache=True, skip_draft=not draft, semantic_tier=TIER)
        t0 = time.perf_counter()
        r = self.client.generate(question, max_tokens=MAX_TOKENS, cache_policy=policy,
                                 return_token_ids=True)
        wall = time.perf_counter() - t0
        rep = r.report
        # The draft's entry when B got one (draft_entry_id), else the entry served (a hit)
        # or the one A's answer was stored as (semantic_entry_id).
        return Run(r.token_ids, wall, rep.forward_passes, rep.draft_tokens_proposed,
                   rep.draft_tokens_accepted, rep.draft_entry_id or rep.semantic_entry_id,
                   rep.semantic_similarity, rep.semantic_hit, r.prompt_tokens)

    def direct(self, ids: list[int], draft: list[int] | None) -> Run:
        """The same prompt on the replica itself, with a draft of our choosing."""
        req = self.kv.KvGenerateRequest(
            token_ids=ids, draft_token_ids=draft or [], skip_prefix_cache=True,
            sampling=self.common.SamplingParams(max_tokens=MAX_TOKENS))
        t0 = time.perf_counter()
        toks: list[int] = []
        final = None
        for msg in self.replica.Generate(req, timeout=900):
            toks.extend(msg.token_ids)
            if msg.HasField("final"):
                final = msg.final
        wall = time.perf_counter() - t0
        assert final is not None
        return Run(toks, wall, final.forward_passes, final.draft_tokens_proposed,
                   final.draft_tokens_accepted, prompt_tokens=len(ids))

    def stats(self):
        return self.client.stats()

    def ladder(self) -> tuple[tuple[int, ...], str, list[float], bool]:
        """The replica's draft proposal lengths (measured at its start), where they came from,
        the relative forward costs they were chosen from, and whether its drafts make cheap
        guesses (`LadderChoice.cheap_guesses`)."""
        st = self.replica.Stats(self.kv.KvStatsRequest(), timeout=30)
        return (tuple(st.draft_ladder), st.draft_ladder_source, list(st.draft_forward_costs),
                st.draft_cheap_guesses)

    def branches(self) -> int:
        """Most branches of the replica's trees (1 = proposals alone)."""
        return self.replica.Stats(self.kv.KvStatsRequest(), timeout=30).draft_branches

    def costs_served(self) -> tuple[list[float], list[int]]:
        """The relative forward costs the replica's choices by cost read now (learned from
        its served steps over its start-up timing) and the steps timed per length."""
        st = self.replica.Stats(self.kv.KvStatsRequest(), timeout=30)
        return list(st.draft_costs_served), list(st.draft_costs_served_steps)


@dataclass
class Pair:
    qa: str
    qb: str
    cosine: float


def near_miss_pairs(n: int) -> tuple[list[Pair], int]:
    """The first `n` QQP duplicates (file order) whose MiniLM cosine is at least the draft
    floor; also returns how many duplicates were scanned. No upper cut: a match at or above
    the hit threshold that the tier's guard or verifier refuses comes back as a draft, so
    whether B is a hit or a near-miss is left to the served tier."""
    from services.semantic.config import SemanticConfig, default_cache_dir
    from services.semantic.embedder import OnnxEmbedder
    from services.semantic.labelled_data import DATA  # ../shared/data or TIERCACHE_DATA_DIR

    cfg = SemanticConfig()
    floor = cfg.draft_floor
    emb = OnnxEmbedder(cfg.resolved_model_dir(), default_cache_dir(), cfg.resolved_model_name())
    dups = []
    with (DATA / "qqp_val.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            if row["is_duplicate"] == "1" and row["question1"] != row["question2"]:
                dups.append((row["question1"], row["question2"]))
    out: list[Pair] = []
    scanned = 0
    for i in range(0, len(dups), 64):
        chunk = dups[i:i + 64]
        a = emb.embed([q for q, _ in chunk])
        b = emb.embed([q for _, q in chunk])
        for (qa, qb), cos in zip(chunk, (a * b).sum(axis=1).tolist(), strict=True):
            scanned += 1
            if cos >= floor:
                out.append(Pair(qa, qb, round(cos, 4)))
                if len(out) >= n:
                    return out, scanned
    return out, scanned


def ratio(a: float, b: float, places: int | None = 3) -> float | None:
    """a / b to `places` places (unrounded for None), or None where b is 0."""
    if not b:
        return None
    return a / b if places is None else round(a / b, places)


def share(draft: list[int], answer: list[int]) -> float:
    """Share of `answer`'s tokens that also occur in `draft` (multiset overlap)."""
    if not answer:
        return 0.0
    return sum((Counter(draft) & Counter(answer)).values()) / len(answer)


def replay(prompt: list[int], answer: list[int], draft: list[int],
           self_lookup: bool = True, ladder: tuple[int, ...] | None = None,
           costs: list[float] | None = None, cheap_guesses: bool = False,
           by_cost: bool = False, branches: int = 1,
           hindsight_ranking: bool = False) -> dict[str, float]:
    """The replica's drafting logic run against a known greedy answer (greedy verification
    accepts exactly the proposal's prefix that equals the answer): forward passes, and proposed
    and accepted tokens by source, as the engine counts them for one sequence decoded alone.
    With `costs` (a forward of q tokens costs costs[q - 1]), also "cost": what the counted
    forwards cost together. `by_cost`: lengths chosen by `costs`, as a replica whose ladder
    was measured does (`Draft.length`); else by match length on the ladder's rungs.
    `branches`: as a replica with TIERCACHE_KVPOOL_DRAFT_BRANCHES, a proposal's alternatives
    are verified with it as a tree (`Draft.alternatives`), the deepest agreeing path
    accepted. `hindsight_ranking`: the drafter re-aligns with the answer known
    (`_hindsight_draft`), not a replica's drafting."""
    from services.kvpool.drafting import Draft, Source, Tree, forward_cost

    assert costs is not None or not by_cost, "lengths by cost need the costs"
    cls = _hindsight_draft() if hindsight_ranking else Draft
    d = cls.of(draft, self_lookup, ladder=ladder, cheap_guesses=cheap_guesses,
               costs=tuple(costs) if by_cost and costs is not None else (),
               branches=branches)
    if hindsight_ranking:
        d.answer, d.prompt_len = list(answer), len(prompt)
    gen: list[int] = []
    proposed_lookup = 0
    passes = -1  # the first proposal rides on the prefill forward, which is not counted
    cost = 0.0
    trees = 0
    while len(gen) < len(answer):
        t = len(gen)
        limit = min(MAX_DRAFT_TOKENS, MAX_TOKENS - t - 1)
        prop = d.propose(prompt + gen, limit)
        if d.pending.source is Source.LOOKUP:
            proposed_lookup += len(prop)
        alts = d.alternatives(prompt + gen, limit) if prop else []
        n = len(prop)
        if alts:
            tree = Tree.of([d.branch(), *alts])
            path = _verified_path(tree, answer[t:])
            a, n = len(path), tree.size
            d.follow(tree, path)
            trees += 1
        else:
            a = agreement(prop, 0, answer[t:])
        emitted = answer[t:t + a + 1]
        if costs is not None and passes >= 0:
            cost += forward_cost(tuple(costs), n + 1)
        gen += emitted
        passes += 1
        d.record(a, proposed=n)
        d.advance(emitted)
    out = {"passes": passes, "proposed": d.proposed, "accepted": d.accepted,
           "proposed_lookup": proposed_lookup, "accepted_lookup": d.accepted_lookup,
           "trees": trees}
    if costs is not None:
        out["cost"] = cost
    return out


@functools.cache
def _hindsight_draft() -> type:
    """A `Draft` that re-aligns knowing the answer: of the draft positions it can re-align to
    (those after an occurrence of the context's last token), the one whose continuation
    agrees longest with the answer, or none where no continuation agrees at all; everything
    else (lengths, thresholds on how many context tokens the position matches, prompt
    lookup, guesses) as the replica's. Not a bound (the drafter's other choices stay as
    they are): what a perfect ranking of where the draft goes on would give, beside
    `hindsight_passes`, which may also start where no context token matches."""
    from services.kvpool.drafting import Draft

    @dataclass
    class HindsightDraft(Draft):
        answer: list[int] = field(default_factory=list)
        prompt_len: int = 0

        def _draft_matches(self, context: list[int]) -> list[tuple[int, int, int]]:
            t = len(context) - self.prompt_len
            rest = self.answer[t:t + MAX_DRAFT_TOKENS]
            # (agreement, nearness to the hint, then the earliest): the best ranked is max.
            spots = [(agreement(self.tokens, j, rest), -abs(j - self.hint), -j)
                     for j in range(1, len(self.tokens))
                     if context and self.tokens[j - 1] == context[-1]]
            best = max(spots, default=None)
            if best is None or best[0] == 0:
                return []
            return [(self._extend(self.tokens, -best[2], context, 1), 0, -best[2])]

    return HindsightDraft


def agreement(src: list[int], j: int, rest: list[int]) -> int:
    """How many tokens of `rest` src[j:] agrees with, from the start."""
    k = 0
    while k < len(rest) and j + k < len(src) and src[j + k] == rest[k]:
        k += 1
    return k


def _verified_path(tree, rest: list[int]) -> list[int]:
    """The nodes of `tree` greedy verification accepts when the answer goes on with `rest`:
    the model's token after a node of depth k is rest[k]."""
    path, _ = tree.walk(lambda i: rest[tree.depths[i] if i >= 0 else 0]
                        if (tree.depths[i] if i >= 0 else 0) < len(rest) else None)
    return path


def ladder_replays(runs: list[tuple[list[int], list[int], list[int]]], costs: list[float],
                   chosen: tuple[int, ...], branches: int = 1) -> dict:
    """Decode speed-up each draft ladder would give on `runs` (prompt, greedy answer, draft) if
    forwards cost `costs` (relative to a 1-token forward; the run passes what the replica's
    served steps cost by its end, `draft_costs_served_at_end`):
    as the replica drafts (its ladder `chosen`, later lengths by cost), and with lengths by
    match length on the rungs of its ladder, the fixed fallback, two others, and the best of
    every ascending ladder within MAX_DRAFT_TOKENS (816). Forward cost only (no serving
    overhead), so above the served decode_speedup; it says how much the choice of lengths gave
    away. All with the replica's trees (`branches`); "replica_no_tree" without them;
    "flat_costs": as the replica would draft where every forward costs one (a GPU, as
    expected), with and without trees, and forwards per token there. "hindsight_ranking":
    the replica's drafting (no trees: the ranking leaves them nothing to add) re-aligning
    with the answer known (`_hindsight_draft`), at these costs and at flat ones."""
    import itertools

    from services.kvpool.drafting import LADDER, LadderChoice, choose_ladder

    assert len(costs) == MAX_DRAFT_TOKENS + 1, "costs of forwards of 1..MAX_DRAFT_TOKENS + 1"
    plain = sum(len(answer) - 1 for _, answer, _ in runs)  # a 1-token forward costs 1

    @functools.cache
    def speedup(ladder: tuple[int, ...], by_cost: bool = False, trees: int = branches) -> float:
        # Whether its drafts guess on thin evidence follows from the ladder and these costs,
        # as on the replica.
        cheap = LadderChoice(ladder, "measured", tuple(costs)).cheap_guesses
        used = sum(replay(p, a, d, ladder=ladder, costs=costs, cheap_guesses=cheap,
                          by_cost=by_cost, branches=trees)["cost"] for p, a, d in runs)
        return round(plain / used, 3) if used else 0.0

    named = {"replica_rungs": tuple(chosen), "fixed_fallback": LADDER, "4,8,16": (4, 8, 16),
             "16,16,16": (16, 16, 16)}
    out = {"replica": {"ladder": list(chosen), "lengths": "by cost", "branches": branches,
                       "speedup": speedup(tuple(chosen), by_cost=True)},
           "replica_no_tree": {"ladder": list(chosen), "lengths": "by cost", "branches": 1,
                               "speedup": speedup(tuple(chosen), by_cost=True, trees=1)}}
    out |= {name: {"ladder": list(lad), "speedup": speedup(lad)} for name, lad in named.items()}
    best = max(itertools.combinations_with_replacement(range(1, MAX_DRAFT_TOKENS + 1), 3),
               key=lambda lad: (speedup(lad), lad))
    out["best"] = {"ladder": list(best), "speedup": speedup(best)}
    # Forwards costing alike at every length, as expected on a GPU (not measured: no GPU):
    # the replica's choices from such a timing, with and without trees.
    flat = [1.0] * len(costs)
    flat_ladder = choose_ladder(dict(enumerate(flat, 1)), MAX_DRAFT_TOKENS)
    tokens = sum(len(answer) for _, answer, _ in runs)

    def replayed(on_flat: bool, **kw) -> dict[str, float]:
        lad, cs = (flat_ladder, flat) if on_flat else (tuple(chosen), costs)
        cheap = LadderChoice(lad, "measured", tuple(cs)).cheap_guesses
        rs = [replay(p, a, d, ladder=lad, costs=cs, cheap_guesses=cheap, by_cost=True, **kw)
              for p, a, d in runs]
        return {"speedup": round(plain / sum(r["cost"] for r in rs), 3),
                "forward_passes_per_token": round(sum(r["passes"] for r in rs) / tokens, 3)}

    out["flat_costs"] = {"ladder": list(flat_ladder), "branches": branches,
                         **replayed(True, branches=branches),
                         "without_tree": replayed(True, branches=1)}
    out["hindsight_ranking"] = {**replayed(False, hindsight_ranking=True),
                                "flat_costs": replayed(True, hindsight_ranking=True)}
    return out


def hindsight_passes(answer: list[int], draft: list[int], prompt: list[int] | None = None,
                     cap: int = MAX_DRAFT_TOKENS) -> int:
    """A lower bound on the decode forwards any drafter limited to `draft` (and, with `prompt`,
    to the sequence's own context) needs for `answer`: no real drafter can need fewer.

    The relaxation: the answer is known in advance, and before each forward the drafter may
    propose the contiguous slice, at most `cap` tokens (MAX_DRAFT_TOKENS, as the replica), of a
    source starting at ANY position that agrees longest with the answer from where it stands.
    The sources are the draft and, when `prompt` is given, the context prompt lookup sees:
    prompt + the answer generated so far. Proposals cost nothing. Each forward emits the
    accepted tokens plus the model's own one; forwards are counted as `replay` and the served
    CacheReport count them: the first proposal rides on the prompt's prefill forward, which is
    not counted (an answer without any draft takes len(answer) - 1). Every proposal the
    replica's `Draft` can make (a draft slice from where it matches, or a slice of the
    context after a lookup match, at most MAX_DRAFT_TOKENS) is one of these slices, so it
    accepts no more tokens than the best slice, hence `replay` never needs fewer forwards.

    Taking the longest agreement at each step is optimal for this relaxation. With best(t) the
    longest agreement from answer position t, a forward at t can reach any position up to
    reach(t) = t + best(t) + 1 (shorter proposals reach less). reach is non-decreasing:
    agree(t + 1, j + 1) >= agree(t, j) - 1 for the same source (the cap included), and the
    context only grows with t, so best(t + 1) >= best(t) - 1. By induction, after k forwards
    greedy stands at or past any other strategy's position s: the next one reaches at most
    reach(s) <= reach(greedy's position). So greedy finishes first.
    """
    n = len(answer)
    if n == 0:
        return 0

    def best_from(src: list[int], t: int) -> int:
        top = min(cap, n - t)
        rest = answer[t:t + top]
        best = 0
        for j in range(len(src)):
            k = agreement(src, j, rest)
            if k > best:
                best = k
                if best == top:
                    break
        return best

    t, passes = 0, -1  # the first proposal rides on the prefill forward, which is not counted
    while t < n:
        best = best_from(draft, t)
        if prompt is not None:
            best = max(best, best_from(list(prompt) + answer[:t], t))
        t += best + 1
        passes += 1
    return passes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.assisted")
    ap.add_argument("--quick", action="store_true", help="reduced run (~5 minutes)")
    ap.add_argument("--candidates", type=int, default=0,
                    help="candidate pairs to answer (default 16 quick / 128)")
    ap.add_argument("--min-timed", type=int, default=0,
                    help="near-miss pairs to time at least (default 3 quick / 10)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.candidates and args.candidates < 3:
        # Each timed pair's unrelated draft is another pair's answer, neither its own A's nor
        # the one it drafts from: two pairs may leave none.
        ap.error("--candidates must be at least 3 (the unrelated drafts are other pairs' answers)")
    # 128: about 24 near pairs timed (Intel host, ~21 minutes). 64 gave 12, too few for a
    # figure whose pairs range from 1.3x to 3.2x.
    n = args.candidates or (16 if args.quick else 128)
    min_timed = args.min_timed or (3 if args.quick else 10)
    out_path = args.out or RESULTS / ("assisted-quick.json" if args.quick else "assisted.json")

    from services.common.model_store import load_tokenizer, resolve_model
    from services.launcher import Stack
    from services.orchestrator.detok import complete_decode
    from services.orchestrator.pipeline import answer_ids
    from services.orchestrator.render import Message, PromptRenderer

    tok = load_tokenizer(resolve_model("smollm2").path)
    renderer = PromptRenderer(tok)

    def prompt_ids(q: str) -> list[int]:  # as the orchestrator renders a one-message chat
        return renderer.render_chat([Message("user", q)]).token_ids

    special = frozenset(tok.all_special_ids)

    def draft_of(answer: list[int]) -> list[int]:
        """A's answer as the orchestrator stores it and drafts with it: its generated ids
        (`pipeline.answer_ids`), or its text tokenized again where the tier keeps none."""
        text = complete_decode(tok, answer)
        return answer_ids(tok, special, answer, text) or renderer.encode_literal(text)

    t0 = time.time()
    load_avg = os.getloadavg()
    pairs, scanned = near_miss_pairs(n)
    print(f"{len(pairs)} candidate pairs at or above the draft floor among {scanned} "
          "duplicates",
          flush=True)
    rows = []
    replayed: list[tuple[list[int], list[int], list[int]]] = []  # near pairs, for ladder_replays
    with tempfile.TemporaryDirectory(prefix="bench-assisted-") as tmp:
        env = {"TIERCACHE_SEMANTIC_DB_PATH": str(Path(tmp) / "semantic.db"),
               "TIERCACHE_KVPOOL_NUM_BLOCKS": "4096", "TIERCACHE_KVPOOL_MAX_BATCH_SIZE": "8",
               "TIERCACHE_LOG_LEVEL": "WARNING",
               **plaintext_env(os.environ)}  # as Served's channels speak
        stack = Stack(replicas=1, base_port=0, extra_env=env,
                      log_dir=stack_log_dir("assisted"))
        print("starting stack (semantic, prefix, 1 kvpool replica, orchestrator) ...",
              flush=True)
        stack.start(timeout=600)
        try:
            s = Served(stack.procs["orchestrator"].address, stack.procs["kvpool-0"].address)
            s.ask("Warm-up question?", lookup=False)
            ladder, ladder_source, forward_costs, cheap_guesses = s.ladder()
            branches = s.branches()
            print(f"replica's draft proposal lengths: {ladder} ({ladder_source}; forwards of "
                  f"1.. tokens cost {forward_costs} x one token's; cheap guesses "
                  f"{cheap_guesses})", flush=True)
            with ThreadPoolExecutor(UNTIMED_BATCH) as ex:
                a_runs = list(ex.map(lambda p: s.ask(p.qa, lookup=False, store=True), pairs))
            drafts = {r.entry_id: draft_of(r.tokens) for r in a_runs if r.entry_id}
            print(f"{len(drafts)} answers to A stored in {time.time() - t0:.0f} s", flush=True)
            with ThreadPoolExecutor(UNTIMED_BATCH) as ex:
                screen = list(ex.map(lambda p: s.ask(p.qb), pairs))
            near_miss = [i for i, r in enumerate(screen)
                         if not r.hit and r.entry_id in drafts]
            shares = {i: share(drafts[screen[i].entry_id][:MAX_TOKENS], screen[i].tokens)
                      for i in near_miss}
            timed = [i for i in near_miss if shares[i] >= SHARE_MIN]
            timed += [i for i in near_miss if i not in timed][:max(0, min_timed - len(timed))]
            print(f"B: {sum(r.hit for r in screen)} semantic hits, {len(near_miss)} near-misses "
                  f"with a draft ({len([i for i in near_miss if shares[i] >= SHARE_MIN])} "
                  f"share >= {SHARE_MIN}); timing {len(timed)} pairs "
                  f"({time.time() - t0:.0f} s)", flush=True)
            kinds = ["plain", "draft", "direct_plain", "direct_unrelated", "direct_lookup",
                     "direct_random"]
            # A draft of one token the model never emits: rejected at the first forward, then
            # nothing in it to re-align on, so the replica proposes by prompt lookup alone
            # (which any request with a draft gets): the baseline that isolates the cost of
            # the unrelated draft's own proposals.
            never = [len(tok) - 1]
            # An adversarial unrelated draft: random token ids (seeded by the pair, as long as
            # the unrelated draft). Timing it costs about one lookup-only run per pair (~5 s,
            # under a minute over the full run's 12 pairs).
            vocab = tok.vocab_size
            for k, i in enumerate(sorted(timed)):
                q = pairs[i].qb
                ids = prompt_ids(q)
                entry = screen[i].entry_id
                draft = drafts[entry][:MAX_TOKENS]  # the replica keeps at most max_tokens
                # Another pair's answer: not the one B drafts from, nor its own question's (A's
                # answer to B's paraphrase, drafted from another entry, is no unrelated draft).
                others = [(i + len(pairs) // 2 + j) % len(pairs) for j in range(len(pairs))]
                unrelated = next(draft_of(a_runs[o].tokens) for o in others
                                 if o != i and a_runs[o].entry_id != entry)
                rng = random.Random(RANDOM_DRAFT_SEED + i)
                random_draft = [rng.randrange(vocab) for _ in unrelated]
                runs: dict[str, Run] = {}
                costs_then = forward_costs  # what B's draft chose its lengths by
                for kind in kinds[k % len(kinds):] + kinds[:k % len(kinds)]:
                    if kind == "plain":
                        runs[kind] = s.ask(q, draft=False)
                    elif kind == "draft":
                        # Costs learned from served steps change as the replica serves; B's
                        # draft takes them as they stand when it arrives (nothing else runs).
                        costs_then = s.costs_served()[0] or forward_costs
                        runs[kind] = s.ask(q)
                    else:
                        runs[kind] = s.direct(ids, {"direct_unrelated": unrelated,
                                                    "direct_lookup": never,
                                                    "direct_random": random_draft}.get(kind))
                plain, with_draft = runs["plain"], runs["draft"]
                # As the replica drafts: lengths by cost where its ladder was measured.
                as_replica = {"ladder": ladder, "cheap_guesses": cheap_guesses,
                              "costs": costs_then or None,
                              "by_cost": ladder_source == "measured", "branches": branches}
                rep = replay(ids, plain.tokens, draft, **as_replica)
                no_tree = replay(ids, plain.tokens, draft, **(as_replica | {"branches": 1}))
                draft_only = replay(ids, plain.tokens, draft, self_lookup=False, **as_replica)
                rows.append({
                    "pair": i, "cosine": pairs[i].cosine,
                    "similarity_served": round(with_draft.similarity, 4),
                    "draft_from_own_question": entry == a_runs[i].entry_id,
                    "same_draft_as_screening": with_draft.entry_id == entry,
                    "prompt_matches_server": plain.prompt_tokens == len(ids),
                    "b_tokens": len(plain.tokens), "draft_tokens": len(draft),
                    "share": round(share(draft, plain.tokens), 3),
                    "screen_share": round(shares[i], 3),
                    "wall_plain_s": plain.wall_s, "wall_draft_s": with_draft.wall_s,
                    "wall_direct_plain_s": runs["direct_plain"].wall_s,
                    "wall_unrelated_s": runs["direct_unrelated"].wall_s,
                    "wall_lookup_only_s": runs["direct_lookup"].wall_s,
                    "wall_random_s": runs["direct_random"].wall_s,
                    "passes_lookup_only": runs["direct_lookup"].forward_passes,
                    "passes_plain": plain.forward_passes,
                    "passes_draft": with_draft.forward_passes,
                    "passes_unrelated": runs["direct_unrelated"].forward_passes,
                    "passes_random": runs["direct_random"].forward_passes,
                    "proposed": with_draft.proposed, "accepted": with_draft.accepted,
                    "proposed_lookup": rep["proposed_lookup"],
                    "accepted_lookup": rep["accepted_lookup"],
                    "passes_draft_only_replayed": draft_only["passes"],
                    "passes_hindsight_bound_draft": hindsight_passes(plain.tokens, draft),
                    "passes_hindsight_bound": hindsight_passes(plain.tokens, draft, ids),
                    "passes_replayed": rep["passes"], "proposed_replayed": rep["proposed"],
                    "accepted_replayed": rep["accepted"], "trees_replayed": rep["trees"],
                    "passes_replayed_without_tree": no_tree["passes"],
                    "replay_matches": rep["passes"] == with_draft.forward_passes
                    and rep["accepted"] == with_draft.accepted,
                    "unrelated_proposed": runs["direct_unrelated"].proposed,
                    "unrelated_accepted": runs["direct_unrelated"].accepted,
                    "identical": all(r.tokens == plain.tokens for r in runs.values()),
                    "qa": pairs[i].qa, "qb": pairs[i].qb,
                })
                r = rows[-1]
                if r["share"] >= SHARE_MIN:
                    replayed.append((ids, plain.tokens, draft))
                print(f"pair {i:2d} cos {r['similarity_served']:.3f} share {r['share']:.2f} "
                      f"tokens {r['b_tokens']:3d} wall {r['wall_plain_s']:.2f}/"
                      f"{r['wall_draft_s']:.2f} s (replica {r['wall_direct_plain_s']:.2f}/"
                      f"unrelated {r['wall_unrelated_s']:.2f}/random {r['wall_random_s']:.2f}"
                      f") passes {r['passes_draft']} (bound {r['passes_hindsight_bound']}) "
                      f"acc {r['accepted']}/{r['proposed']} (lookup {r['accepted_lookup']}/"
                      f"{r['proposed_lookup']}) same {r['identical']}", flush=True)
            stats = s.stats()
            s_costs = s.costs_served()
            s.close()
        finally:
            stack.stop()

    near = [r for r in rows if r["share"] >= SHARE_MIN]

    def total(rs: list[dict], key: str) -> float:
        return sum(r[key] for r in rs)

    # The three figures, unrounded: the targets are judged on these (a 1.9996 shown
    # as 2.0 does not meet ">= 2.0"); the figures show them to 3 places.
    exact = {
        "decode_speedup": ratio(total(near, "wall_plain_s"), total(near, "wall_draft_s"), None),
        # Each request's prefill forward counts too.
        "forward_passes_per_token": ratio(total(near, "passes_draft") + len(near),
                                          total(near, "b_tokens"), None),
        # As the issue defines it: wall with the unrelated draft / without any draft. Any
        # draft also turns on prompt lookup, so this mixes lookup's gain with the draft's cost;
        # the draft's own cost is unrelated_draft_cost_vs_lookup_only (against lookup alone).
        "unrelated_slowdown": ratio(total(rows, "wall_unrelated_s"),
                                    total(rows, "wall_direct_plain_s"), None),
    }
    figures = {
        "candidate_pairs": len(pairs),
        "duplicates_scanned": scanned,
        "a_answers_stored": len(drafts),
        "b_semantic_hits": sum(r.hit for r in screen),
        "b_without_draft": sum(not r.hit and r.entry_id not in drafts for r in screen),
        "near_miss_pairs": len(near_miss),
        "screened_near_pairs": sum(shares[i] >= SHARE_MIN for i in near_miss),
        "timed_pairs": len(rows),
        "near_pairs": len(near),
        "near_pairs_draft_from_own_question": sum(r["draft_from_own_question"] for r in near),
        **rounded(exact),
        "forward_passes_per_token_decode_only": ratio(total(near, "passes_draft"),
                                                      total(near, "b_tokens")),
        "forward_passes_per_token_without_draft": ratio(total(near, "passes_plain"),
                                                        total(near, "b_tokens")),
        "forward_passes_per_token_draft_only_replayed": ratio(
            total(near, "passes_draft_only_replayed"), total(near, "b_tokens")),
        "forward_passes_per_token_replayed_without_tree": ratio(
            total(near, "passes_replayed_without_tree"), total(near, "b_tokens")),
        "tree_forwards_replayed": total(near, "trees_replayed"),
        # Lower bounds (hindsight, any draft position; `hindsight_passes`): from the cached
        # answer alone, and with the sequence's own context (what prompt lookup can use) too.
        "forward_passes_per_token_hindsight_bound_draft": ratio(
            total(near, "passes_hindsight_bound_draft"), total(near, "b_tokens")),
        "forward_passes_per_token_hindsight_bound": ratio(
            total(near, "passes_hindsight_bound"), total(near, "b_tokens")),
        "acceptance_rate": ratio(total(near, "accepted"), total(near, "proposed")),
        "acceptance_rate_draft": ratio(total(near, "accepted") - total(near, "accepted_lookup"),
                                       total(near, "proposed") - total(near, "proposed_lookup")),
        "acceptance_rate_lookup": ratio(total(near, "accepted_lookup"),
                                        total(near, "proposed_lookup")),
        "draft_coverage": ratio(total(near, "accepted") - total(near, "accepted_lookup"),
                                total(near, "b_tokens")),
        "lookup_coverage": ratio(total(near, "accepted_lookup"), total(near, "b_tokens")),
        "decode_speedup_timed_pairs": ratio(total(rows, "wall_plain_s"),
                                            total(rows, "wall_draft_s")),
        "draft_coverage_timed_pairs": ratio(
            total(rows, "accepted") - total(rows, "accepted_lookup"), total(rows, "b_tokens")),
        "unrelated_draft_cost_vs_lookup_only": ratio(total(rows, "wall_unrelated_s"),
                                                     total(rows, "wall_lookup_only_s")),
        "lookup_only_speedup_vs_plain": ratio(total(rows, "wall_direct_plain_s"),
                                              total(rows, "wall_lookup_only_s")),
        "unrelated_acceptance_rate": ratio(total(rows, "unrelated_accepted"),
                                           total(rows, "unrelated_proposed")),
        # The same figures as for the near pairs (decoding forwards; accepted tokens over the
        # answer's, prompt lookup's included: the unrelated run's split is not reported).
        "forward_passes_per_token_unrelated": ratio(total(rows, "passes_unrelated"),
                                                    total(rows, "b_tokens")),
        "unrelated_coverage_with_lookup": ratio(total(rows, "unrelated_accepted"),
                                                total(rows, "b_tokens")),
        # An adversarial unrelated draft, random token ids: with it / without any draft, and
        # against prompt lookup alone.
        "random_draft_slowdown": ratio(total(rows, "wall_random_s"),
                                       total(rows, "wall_direct_plain_s")),
        "random_draft_cost_vs_lookup_only": ratio(total(rows, "wall_random_s"),
                                                  total(rows, "wall_lookup_only_s")),
        "forward_passes_per_token_lookup_only": ratio(total(rows, "passes_lookup_only"),
                                                      total(rows, "b_tokens")),
        "forward_passes_per_token_random_draft": ratio(total(rows, "passes_random"),
                                                       total(rows, "b_tokens")),
        "orchestrator_over_replica_wall_no_draft": ratio(total(rows, "wall_plain_s"),
                                                         total(rows, "wall_direct_plain_s")),
        "wall_plain_s_near": round(total(near, "wall_plain_s"), 3),
        "wall_draft_s_near": round(total(near, "wall_draft_s"), 3),
        "identical_outputs": all(r["identical"] for r in rows),
        "replay_matches_server": all(r["replay_matches"] for r in rows),
        # The bounds are below what the replica's drafting needed on every pair (as they must).
        "hindsight_bounds_hold": all(
            r["passes_hindsight_bound"] <= r["passes_replayed"]
            and r["passes_hindsight_bound_draft"] <= r["passes_draft_only_replayed"]
            for r in rows),
        "prompts_match_server": all(r["prompt_matches_server"] for r in rows),
        "stats_semantic_near_misses_total": stats.semantic.near_misses_total,
        "stats_replica_draft_tokens_proposed_total":
            sum(rep.draft_tokens_proposed_total for rep in stats.replicas),
        "stats_replica_draft_tokens_accepted_total":
            sum(rep.draft_tokens_accepted_total for rep in stats.replicas),
        "stats_replica_draft_tree_forwards_total":
            sum(rep.draft_tree_forwards_total for rep in stats.replicas),
        "stats_replica_draft_tree_branch_wins_total":
            sum(rep.draft_tree_branch_wins_total for rep in stats.replicas),
    }
    costs_served, costs_served_steps = s_costs
    if ladder_source == "measured" and replayed:  # not timings the replica refused as noise
        print("replaying the timed answers with other draft ladders ...", flush=True)
        try:
            # Costed as served steps cost by the end of the run (the start-up timing where
            # a length was not served often enough).
            figures["replayed_speedup_by_ladder"] = ladder_replays(
                replayed, costs_served or forward_costs, ladder, branches)
        except Exception as e:  # noqa: BLE001 - a context figure: keep the run's results
            figures["replayed_speedup_by_ladder"] = {"error": f"{type(e).__name__}: {e}"}
    targets = verdicts(TARGETS, exact, figures)
    # Beside the target, the unrelated draft's own cost (any draft turns on prompt lookup).
    targets["unrelated_slowdown"].update(
        note=NOTES["unrelated_slowdown"],
        unrelated_draft_cost_vs_lookup_only=figures["unrelated_draft_cost_vs_lookup_only"],
        random_draft_slowdown=figures["random_draft_slowdown"])
    result = {
        "benchmark": "assisted",
        "command": "python -m benchmarks.assisted" + (" --quick" if args.quick else "") + (
            f" --candidates {args.candidates}" if args.candidates else "") + (
            f" --min-timed {args.min_timed}" if args.min_timed else ""),
        "quick": args.quick,
        "model": "SmolLM2-135M-Instruct fp32 cpu, greedy, max 128 tokens, prefix cache skipped",
        "path": "loopback stack (semantic, prefix, 1 kvpool replica, orchestrator); A stored "
                "by the orchestrator, B asked through it in the standard tier; the unrelated "
                "draft on the replica directly",
        "pairs_from": "QQP duplicates in file order, MiniLM cosine >= the draft floor 0.80 "
                      "(no upper cut: a refused match above the hit threshold is a near-miss "
                      "too); hit or near-miss as the served semantic tier decides",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "cpu_model": cpu_model(),
                    "load_avg_at_start": load_avg, "load_avg_at_end": os.getloadavg()},
        "draft_ladder": list(ladder),
        "draft_ladder_source": ladder_source,
        "draft_forward_costs": forward_costs,
        "draft_cheap_guesses": cheap_guesses,
        "draft_branches": branches,
        "draft_costs_served_at_end": costs_served,
        "draft_costs_served_steps": costs_served_steps,
        "figures": figures,
        "targets": targets,
        "notes": NOTES,
        "pairs": rows,
        "elapsed_s": round(time.time() - t0, 1),
    }
    write_result(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
