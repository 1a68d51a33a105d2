"""A differential review of the figures `python -m benchmarks.assisted` reports
(benchmarks/assisted.py) against the issue's definition and the module's docstring and NOTES.

The model (from the issue's text, the module docstring, NOTES and the helpers' docstrings,
not the code):
- Shares: "A's answer shares >= 50% of B's tokens" is the multiset overlap over B's tokens
  (each of B's tokens counts while the draft holds an unused copy), exact (Fractions), at
  exactly one half included; the screen on the untimed answer, the near pairs on the timed
  no-draft one, both against the served draft cut to 128 tokens.
- Pairs: candidates are the QQP duplicates (two different texts) in file order whose cosine
  is at least the draft floor 0.80 (at it too), the first n, `scanned` counting duplicates to
  the n-th (a fake embedder over a synthetic file). Near-misses: B not a hit and its entry a
  stored answer; timed: the screened >= 50% ones, then near-misses in file order up to
  --min-timed; each timed pair runs the six kinds once; the unrelated draft is another
  pair's answer as drafted (neither B's own question's nor its draft's entry), the lookup-only
  draft one token the model never emits, the random one as long as the unrelated draft.
- Figures, computed from what a fake stack served (every answer, entry, wall and count chosen
  by the test; walls in 1/256 s so every sum is exact): `decode_speedup` = sum of plain walls /
  sum of draft walls over the near pairs, `forward_passes_per_token` = (decode forwards + one
  prefill forward a request) / tokens (NOTES), the other forward figures decode forwards only;
  acceptance and coverage over the near pairs, split by source with the lookup counts of the
  replay as served (the replica's ladder, costs learned when B arrived, lengths by cost for a
  measured ladder, trees); `unrelated_slowdown` and the other unrelated, random and
  lookup-only figures over all timed pairs; ratios of sums to 3 places (None over 0); the
  ladder replays given the near pairs and the costs served at the end, only for a measured
  ladder; the three targets met exactly when the figure meets the issue's bound.
- Hindsight bounds: the fewest forwards of the docstring's relaxation by dynamic programming
  over every slice it allows (not only the longest), equal to `hindsight_passes` (caps 1..16,
  and every answer of up to 6 tokens over 3 symbols), and at or below what the replica's own
  drafting needs (`replay` with random ladders, costs, trees, cheap guesses, hindsight
  ranking, lookup on and off), itself consistent (each forward emits its accepted tokens and
  one more; the prefill forward not counted).

Run offline: 2,000 seeds (2,000 runs of `main`, 100,000 shares, 80,000 bound checks against
the model, 16,000 against the replica's drafting, 500 candidate scans). Found and fixed:
- benchmarks/prompt_lookup.py and benchmarks/draft_batch.py imported `QQP` from this module
  after d4d34b8 had removed it: both failed with an ImportError at launch; they read
  labelled_data's DATA folder now (tests/benchmarks/test_assisted_rules.py).
- The unrelated draft was the first stored answer, rotating from pair i + n/2, whose entry was
  not B's draft's; where the others before it all were (few candidates, or one answer stored
  for a repeated question), it was pair i's own A answer, the answer to B's paraphrase, and
  with one candidate there was none (StopIteration after the whole run). B's own pair is
  skipped now and --candidates below 3 is refused. No reported figure changes: over 128
  candidates the first pair tried, i + 64, is never B's own.
- The docstring called `forward_passes_per_token` decode forwards / tokens; it counts each
  request's prefill forward too, as NOTES says (the code was right; the docstring now says so).
Left as is: the near-pair test reads the share rounded to 3 places (at most 128 tokens, a share
under one half is at most 0.496, so it cannot round across); targets are checked on the
rounded figures (1.9996 reports 2.0, met); the near share and the replay use the screening
run's draft entry, though the timed run's tier may choose another (`same_draft_as_screening`
records it); nodes a lookup proposal shares with a draft alternative in a tree count as
lookup's, the alternatives as the draft's (`acceptance_rate_draft`).
Injected bugs: 29 of 29 caught (share over the draft's tokens or as a set; > 50% for near or
screened; decode_speedup inverted, over all timed pairs, or a mean of per-pair ratios; the
prefill forward dropped or counted per timed pair; unrelated_slowdown over near pairs or
against lookup only; acceptance over all timed pairs; draft coverage with lookup's tokens; no
--min-timed top-up; hindsight counting the prefill, uncapped, without the answer so far, or
missing the last draft position; replay counting the prefill; strict targets; the row share on
the screening answer; the draft not cut to 128; candidates above the floor only or with
identical texts; the random draft as long as B's; own-question count over all timed; the
lookup split from the draft-only replay; an unrelated draft from B's own entry; the replay at
the start-up costs).
`BENCH_ASSISTED_DIFFERENTIAL_SEEDS=N` runs more (default 40, ~2.5 s; no model, no stack).
"""

from __future__ import annotations

import csv
import functools
import json
import os
import random
import threading
from collections import defaultdict
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import assisted
from benchmarks.assisted import MAX_DRAFT_TOKENS, hindsight_passes, replay

SEEDS = int(os.environ.get("BENCH_ASSISTED_DIFFERENTIAL_SEEDS", "40"))
MAX_TOKENS = 128  # the issue's: greedy, 128 tokens
ISSUE_TARGETS = {"decode_speedup": (">=", 2.0), "forward_passes_per_token": ("<=", 0.4),
                 "unrelated_slowdown": ("<=", 1.10)}
KINDS = ("plain", "draft", "direct_plain", "direct_unrelated", "direct_lookup", "direct_random")


# ----------------------------------------------------------------------------------------
# The model: the issue's and the docstring's definitions, written without the module's code.


def model_share(draft: list[int], answer: list[int]) -> Fraction:
    """"A's answer shares >= 50% of B's tokens" (multiset overlap): each of B's tokens counts
    when the draft still holds an unused copy of it; over B's token count (0 for no tokens)."""
    if not answer:
        return Fraction(0)
    pool = list(draft)
    hit = 0
    for t in answer:
        if t in pool:
            pool.remove(t)
            hit += 1
    return Fraction(hit, len(answer))


def model_ratio(a, b):
    """The docstring's ratios: a / b to 3 places, none where b is 0."""
    return round(a / b, 3) if b else None


def slices(src: list[int], cap: int) -> set[tuple[int, ...]]:
    """Every contiguous slice of `src` of 1..cap tokens."""
    return {tuple(src[j:j + k]) for j in range(len(src)) for k in range(1, cap + 1)
            if j + k <= len(src)}


def model_bound(answer: list[int], draft: list[int], prompt: list[int] | None = None,
                cap: int = MAX_DRAFT_TOKENS) -> int:
    """The fewest decode forwards of the docstring's relaxation, by dynamic programming over
    every proposal it allows: before the forward at answer position t, any slice (<= cap) of
    the draft, or of prompt + answer[:t] when a prompt is given, agreeing with the answer
    from t (any shorter proposal too); the forward emits those plus the model's own token.
    The first forward is the prefill one, not counted."""
    n = len(answer)
    if n == 0:
        return 0
    have = slices(draft, cap)
    ctx = list(prompt) if prompt is not None else None
    ctx_slices = slices(ctx, cap) if ctx is not None else set()
    best = []
    for t in range(n):
        if ctx is not None and t:  # the context grew by answer[t - 1]: slices ending there
            ctx.append(answer[t - 1])
            ctx_slices |= {tuple(ctx[len(ctx) - k:]) for k in range(1, min(cap, len(ctx)) + 1)}
        k = 0
        while k < min(cap, n - t) and (tuple(answer[t:t + k + 1]) in have
                                       or tuple(answer[t:t + k + 1]) in ctx_slices):
            k += 1
        best.append(k)
    far = [0] * (n + 1)  # forwards to finish from t
    for t in range(n - 1, -1, -1):
        far[t] = 1 + min(far[min(n, t + k + 1)] for k in range(best[t] + 1))
    return far[0] - 1


# ----------------------------------------------------------------------------------------
# `share` and the hindsight bound against the model.


def random_tokens(rng: random.Random, n: int, alphabet: int) -> list[int]:
    return [rng.randrange(alphabet) for _ in range(n)]


def edited(rng: random.Random, src: list[int], ops: int, alphabet: int) -> list[int]:
    out = list(src)
    for _ in range(ops):
        i = rng.randint(0, len(out))
        op = rng.choice("sdi")
        if op == "i" or not out or i == len(out):
            out.insert(i, rng.randrange(alphabet))
        elif op == "s":
            out[i] = rng.randrange(alphabet)
        else:
            del out[i]
    return out


def test_share_is_the_multiset_overlap_over_bs_tokens():
    rng = random.Random(7)
    for _ in range(SEEDS * 50):
        alphabet = rng.choice([2, 3, 5, 40])
        answer = random_tokens(rng, rng.randint(0, 30), alphabet)
        draft = random_tokens(rng, rng.randint(0, 30), alphabet)
        got = assisted.share(draft, answer)
        assert got == pytest.approx(float(model_share(draft, answer)), abs=1e-12), (draft, answer)
    # Orientation: over B's tokens (the answer), not the draft's: a draft holding all of B
    # and more shares 100% of B's.
    assert assisted.share([1, 2, 3, 4], [1, 2]) == 1.0
    assert assisted.share([1, 2], [1, 2, 3, 4]) == 0.5
    assert assisted.share([1], [1, 1, 1, 1]) == 0.25  # one copy covers one token


@pytest.mark.parametrize("cap", [1, 2, 4, MAX_DRAFT_TOKENS])
def test_hindsight_passes_is_the_relaxations_optimum(cap):
    rng = random.Random(cap)
    for _ in range(SEEDS * 10):
        alphabet = rng.choice([2, 3, 4, 8])
        answer = random_tokens(rng, rng.randint(0, 24), alphabet)
        draft = (edited(rng, answer, rng.randint(0, 4), alphabet + 1) if rng.random() < 0.6
                 else random_tokens(rng, rng.randint(0, 24), alphabet))
        prompt = random_tokens(rng, rng.randint(0, 8), alphabet)
        assert hindsight_passes(answer, draft, cap=cap) == model_bound(answer, draft, cap=cap)
        assert (hindsight_passes(answer, draft, prompt, cap=cap)
                == model_bound(answer, draft, prompt, cap=cap))


def replica_settings(rng: random.Random) -> dict:
    """A replica's drafting settings as `replay` takes them (as the benchmark passes them)."""
    ladder = rng.choice([(1, 2, 16), (2, 4, 16), (4, 8, 16), (16, 16, 16), (1, 1, 1), (3, 6, 9)])
    costs = sorted(round(rng.uniform(1.0, 4.0), 2) for _ in range(MAX_DRAFT_TOKENS + 1))
    costs[0] = 1.0
    by_cost = rng.random() < 0.5
    return {"ladder": ladder, "costs": costs if by_cost or rng.random() < 0.5 else None,
            "by_cost": by_cost, "cheap_guesses": rng.random() < 0.5,
            "branches": rng.choice([1, 1, 2, 4])}


def test_hindsight_bounds_are_below_every_drafters_forwards():
    """Lower bounds, as NOTES says: no drafter using the draft (and the context) needs fewer
    forwards; checked against the replica's own drafting (`replay`: ladders, lengths by cost,
    trees, cheap guesses, hindsight ranking) and against decoding without a draft."""
    rng = random.Random(11)
    for _ in range(SEEDS * 8):
        alphabet = rng.choice([3, 5, 12])
        answer = random_tokens(rng, rng.randint(1, 60), alphabet)
        draft = (edited(rng, answer, rng.randint(0, 6), alphabet + 2) if rng.random() < 0.7
                 else random_tokens(rng, rng.randint(0, 60), alphabet))
        prompt = random_tokens(rng, rng.randint(1, 12), alphabet)
        kw = replica_settings(rng)
        bound_draft = hindsight_passes(answer, draft)
        bound = hindsight_passes(answer, draft, prompt)
        assert bound <= bound_draft <= len(answer) - 1
        served = replay(prompt, answer, draft, **kw)
        alone = replay(prompt, answer, draft, self_lookup=False, **kw)
        assert bound <= served["passes"], (prompt, answer, draft, kw)
        assert bound_draft <= alone["passes"], (prompt, answer, draft, kw)
        assert bound <= replay(prompt, answer, draft, hindsight_ranking=True,
                               **(kw | {"branches": 1}))["passes"]
        # The replay counts forwards as served: each emits what it accepted plus one token,
        # the prefill forward (not counted) the first.
        for r in (served, alone):
            assert r["passes"] + r["accepted"] <= len(answer) <= r["passes"] + 1 + r["accepted"]
            assert r["accepted_lookup"] <= r["accepted"] <= r["proposed"]
            assert r["proposed_lookup"] <= r["proposed"]
        assert alone["accepted_lookup"] == alone["proposed_lookup"] == 0


def test_hindsight_bound_exhaustively_on_tiny_answers():
    """Every answer of up to 6 tokens over {0, 1, 2}, against a few drafts each: the bound is
    the relaxation's optimum and below what the replica's drafting needs."""
    rng = random.Random(5)
    answers = [[]]
    for n in range(1, 7):
        answers += [[(k // 3 ** i) % 3 for i in range(n)] for k in range(3 ** n)]
    for answer in answers[::max(1, 40 // SEEDS)]:
        for draft in ([], answer[::-1], edited(rng, answer, 1, 3)):
            prompt = random_tokens(rng, 3, 3)
            for cap in (1, 3, MAX_DRAFT_TOKENS):
                assert hindsight_passes(answer, draft, prompt, cap) == model_bound(
                    answer, draft, prompt, cap)
            if answer:
                assert hindsight_passes(answer, draft, prompt) <= replay(
                    prompt, answer, draft)["passes"]


# ----------------------------------------------------------------------------------------
# Pair selection: `near_miss_pairs` over a synthetic QQP file and a fake embedder.


class VectorEmbedder:
    """Unit vectors whose products are the cosines the test chose (pairs' questions unique)."""

    vectors: dict[str, np.ndarray] = {}

    def __init__(self, *args, **kwargs) -> None:
        pass

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])


def test_candidates_are_the_first_duplicates_at_or_above_the_draft_floor(tmp_path,
                                                                          monkeypatch):
    from services.semantic import embedder, labelled_data

    monkeypatch.setattr(embedder, "OnnxEmbedder", VectorEmbedder)
    monkeypatch.setattr(labelled_data, "DATA", tmp_path)
    rng = random.Random(3)
    for seed in range(max(3, SEEDS // 4)):
        rows, vectors = [], {}
        for k in range(rng.randint(0, 200)):
            q1, q2 = f"a{seed}-{k}?", f"b{seed}-{k}?"
            if rng.random() < 0.05:
                q2 = q1  # the same text twice: no paraphrase
            cos = rng.choice([0.8, 0.7999, 0.95, 1.0, 0.3, rng.random()])
            vectors[q1] = np.array([1.0, 0.0])
            vectors[q2] = np.array([cos, (1 - cos * cos) ** 0.5])
            rows.append({"question1": q1, "question2": q2,
                         "is_duplicate": rng.choice(["0", "1", "1"]), "cos": cos})
        with (tmp_path / "qqp_val.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, ["question1", "question2", "is_duplicate"])
            w.writeheader()
            w.writerows({k: r[k] for k in ("question1", "question2", "is_duplicate")}
                        for r in rows)
        VectorEmbedder.vectors = vectors
        n = rng.randint(1, 80)
        # Model: duplicates (is_duplicate 1, two texts) in file order; the first n whose
        # cosine is at least the floor 0.80; scanned = duplicates looked at until the n-th.
        dups = [r for r in rows if r["is_duplicate"] == "1" and r["question1"] != r["question2"]]
        want, scanned = [], 0
        for r in dups:
            scanned += 1
            if r["cos"] >= 0.80:
                want.append((r["question1"], r["question2"]))
                if len(want) == n:
                    break
        pairs, got_scanned = assisted.near_miss_pairs(n)
        assert [(p.qa, p.qb) for p in pairs] == want
        assert got_scanned == scanned
        assert all(p.cosine >= 0.8 for p in pairs)


# ----------------------------------------------------------------------------------------
# The run: `main` over a fake stack whose every answer the test chose, its figures against
# the model's, computed from what the fake served (not from the result's rows).


def dyadic(rng: random.Random, lo: float, hi: float) -> float:
    """A wall time in 1/256 s steps: sums are exact in any order."""
    return rng.randint(int(lo * 256), int(hi * 256)) / 256


class World:
    """What the stack serves: each pair's A and B answers, the tier's choices, timings."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.tag = rng.random()
        self.screen_differs = 0.2  # how often the screening answer is not the timed one
        self.vocab = 400
        self.lock = threading.Lock()
        n = rng.randint(3, 12)
        self.pairs = [assisted.Pair(f"A{k}?", f"B{k}?", round(rng.uniform(0.8, 1.0), 4))
                      for k in range(n)]
        self.prompt = {p.qb: random_tokens(rng, rng.randint(4, 20), 300) for p in self.pairs}
        self.a_answer: dict[str, list[int]] = {}
        self.b_answer: dict[str, list[int]] = {}
        self.retok: dict[tuple[int, ...], list[int]] = {}  # text tokenized again
        self.entry: dict[str, str] = {}  # A's stored entry id ("" where not stored)
        self.screen_entry: dict[str, tuple[bool, str]] = {}  # B: (hit, entry)
        for k, p in enumerate(self.pairs):
            lo = rng.choice([0, 50, 100])
            a = random_tokens(rng, rng.randint(4, MAX_TOKENS), 50)
            a = [lo + t for t in a]
            if rng.random() < 0.2:
                a = a[:MAX_TOKENS - 1] + [399]  # ends on its end-of-sequence token
            self.a_answer[p.qa] = a
            if rng.random() < 0.15:  # the ids do not decode to the text: tokenized again
                self.retok[tuple(a)] = edited(rng, a, rng.randint(1, 3), 300) + (
                    random_tokens(rng, rng.randint(0, 20), 300) if rng.random() < 0.5 else [])
            self.entry[p.qa] = "" if rng.random() < 0.05 else f"entry-{k}"
            kind = rng.choice(["edit", "edit", "mix", "far", "half", "under_half"])
            if kind == "edit":
                b = edited(rng, a, rng.randint(0, 12), 300)
            elif kind == "mix":  # a share of A's tokens, the rest fresh
                f = rng.random()
                b = [t if rng.random() < f else 300 + rng.randrange(99) for t in a]
            elif kind == "far":
                b = random_tokens(rng, rng.randint(2, MAX_TOKENS), 300)
            else:  # exactly half of B from A's tokens, or one short of half
                h = rng.randint(1, len(a) // 2 or 1)
                b = a[:h] + [300 + rng.randrange(99) for _ in range(h + (kind != "half"))]
            for _ in range(rng.choice([0, 0, 1, 3])):  # repeats prompt lookup can propose
                src = rng.choice([self.prompt[p.qb], b])
                x, y = rng.randint(0, len(b)), rng.randint(0, max(0, len(src) - 4))
                b = b[:x] + src[y:y + rng.randint(4, 12)] + b[x:]
            self.b_answer[p.qb] = b[:MAX_TOKENS] or [5]
        stored = [e for e in self.entry.values() if e]
        for p in self.pairs:
            u = rng.random()
            own = self.entry[p.qa]
            if u < 0.1:
                self.screen_entry[p.qb] = (True, own or "entry-x")
            elif u < 0.2:
                self.screen_entry[p.qb] = (False, rng.choice(["", "entry-gone"]))
            elif u < 0.35 and stored:
                self.screen_entry[p.qb] = (False, rng.choice(stored))
            else:
                self.screen_entry[p.qb] = (False, own)
        self.qb_of_prompt = {tuple(v): k for k, v in self.prompt.items()}
        self.ladder = (rng.choice([(1, 2, 16), (2, 4, 16), (4, 8, 16)]),
                       rng.choice(["measured", "measured", "default"]),
                       [1.0] + sorted(round(rng.uniform(1, 3), 2) for _ in range(16)),
                       rng.random() < 0.5)
        self.branches = rng.choice([1, 1, 3])
        self.speed = {p.qb: rng.choice([1.2, 1.6, 1.9, 2.0, 2.5, 3.0]) for p in self.pairs}
        self.base = {p.qb: (dyadic(rng, 1.0, 10.0), dyadic(rng, 1.0, 10.0)) for p in self.pairs}
        self.costs_now: list[float] = []
        self.log: list[tuple] = []  # (kind, question or B, Run, draft)
        self.costs_at_draft: dict[str, list[float]] = {}

    def served(self) -> None:
        """A timed request was served: the costs the replica learns may move."""
        if self.rng.random() < 0.5:
            self.costs_now = [1.0] + sorted(round(self.rng.uniform(1, 3), 2)
                                            for _ in range(16))

    def costs_served(self) -> tuple[list[float], list[int]]:
        # Costs learned from served steps: none yet at first, then as it has served.
        return list(self.costs_now), [self.rng.randint(0, 30) for _ in self.costs_now]


class FakeServed:
    world: World

    def __init__(self, orchestrator: str, replica: str) -> None:
        assert orchestrator == "orch:1" and replica == "kv:1"
        self.w = self.world
        self.asked: dict[str, int] = defaultdict(int)
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def ask(self, question: str, *, lookup: bool = True, store: bool = False,
            draft: bool = True) -> assisted.Run:
        w, rng = self.w, self.w.rng
        with w.lock:
            if question in w.a_answer:  # A: answered without lookup, and stored
                assert not lookup and store and draft
                run = assisted.Run(list(w.a_answer[question]), 1.0, 0, 0, 0,
                                   w.entry[question], 0.0, False)
                w.log.append(("A", question, run, None))
                return run
            if question not in w.b_answer:  # the warm-up
                assert not store
                return assisted.Run([1, 2], 0.1, 1, 0, 0)
            assert lookup and not store  # B: its answer never stored
            b = list(w.b_answer[question])
            hit, entry = w.screen_entry[question]
            self.asked[question] += 1
            if self.asked[question] == 1:  # the untimed screening run
                assert draft
                own = random.Random(f"{w.tag}-{question}")  # threads: not the shared rng
                if own.random() < w.screen_differs:  # 8 at a time: maybe not the timed answer
                    b = edited(own, b, own.randint(1, 30), 300) or b
                run = assisted.Run(b, 1.0, 0, 0, 0, entry, 0.9, hit)
                w.log.append(("screen", question, run, None))
                return run
            ids = w.prompt[question]
            wall = w.base[question][0]
            if draft:  # the costs the replica had learned when B arrived
                w.costs_at_draft[question] = w.costs_now or w.ladder[2]
            w.served()
            if not draft:
                run = assisted.Run(b, wall, len(b) - 1, 0, 0, "", 0.0, False,
                                   len(ids) if rng.random() < 0.95 else len(ids) + 1)
                w.log.append(("plain", question, run, None))
                return run
            # With the draft: timed against the plain run's wall (the speed-up straddles 2).
            wall = max(1 / 256, round(wall / w.speed[question] * 256) / 256)
            lad, source, costs, cheap = w.ladder
            d = drafted(w, w.a_answer_of_entry(entry))[:MAX_TOKENS]
            r = replay(ids, b, d, ladder=lad, cheap_guesses=cheap,
                       costs=w.costs_at_draft[question], by_cost=source == "measured",
                       branches=w.branches)
            if rng.random() < 0.15:  # a replay that does not reproduce the server's counts
                r = dict(r, passes=r["passes"] + rng.choice([-1, 1]))
            if rng.random() < 0.05:
                b = b[:-1] + [b[-1] + 1]  # an output that differs
            w.served()
            run = assisted.Run(b, wall, r["passes"], r["proposed"], r["accepted"], entry,
                               0.9, False)
            w.log.append(("draft", question, run, None))
            return run

    def direct(self, ids: list[int], draft: list[int] | None) -> assisted.Run:
        w, rng = self.w, self.w.rng
        with w.lock:
            qb = w.qb_of_prompt[tuple(ids)]
            b = w.b_answer[qb]
            if not draft:
                kind = "direct_plain"
            elif len(draft) == 1 and draft[0] not in range(w.vocab):
                kind = "direct_lookup"
            elif any(draft == drafted(w, a) for a in w.a_answer.values()):
                kind = "direct_unrelated"
            else:
                kind = "direct_random"
            base = w.base[qb][1]
            wall = base if kind == "direct_plain" else max(
                1 / 256, round(base * rng.choice([0.8, 0.95, 1.0, 1.1, 1.25]) * 256) / 256)
            passes = rng.randint(max(0, len(b) // 3), len(b))
            proposed = rng.randint(0, 3 * len(b)) if draft else 0
            run = assisted.Run(list(b), wall, passes, proposed,
                               rng.randint(0, min(proposed, len(b))), prompt_tokens=len(ids))
            w.log.append((kind, qb, run, list(draft or [])))
            w.served()
            return run

    def stats(self):
        w = self.w
        w.stats = SimpleNamespace(
            semantic=SimpleNamespace(near_misses_total=w.rng.randint(0, 50)),
            replicas=[SimpleNamespace(**{f"draft_{k}_total": w.rng.randint(0, 999)
                                         for k in ("tokens_proposed", "tokens_accepted",
                                                   "tree_forwards", "tree_branch_wins")})])
        return w.stats

    def ladder(self):
        return self.w.ladder

    def branches(self) -> int:
        return self.w.branches

    def costs_served(self):
        with self.w.lock:
            out = self.w.costs_served()
            self.w.log.append(("costs", "", out, None))
            return out


def drafted(w: World, answer: list[int]) -> list[int]:
    """A's answer as the tier stores it and the orchestrator drafts with it: its ids, or its
    text tokenized again where the ids do not decode to it."""
    return list(w.retok.get(tuple(answer), answer))


def _a_answer_of_entry(self: World, entry: str) -> list[int]:
    for qa, e in self.entry.items():
        if e == entry:
            return self.a_answer[qa]
    raise KeyError(entry)


World.a_answer_of_entry = _a_answer_of_entry


class FakeTokenizer:
    vocab_size = 400
    all_special_ids = [399, 401]

    def __len__(self) -> int:
        return 403  # added tokens past vocab_size: the last is one the model never emits


class FakeRenderer:
    world: World

    def __init__(self, tok) -> None:
        pass

    def render_chat(self, messages):
        (m,) = messages
        return SimpleNamespace(token_ids=list(self.world.prompt[m.content]))

    def encode_literal(self, text: str) -> list[int]:
        ids = [int(t) for t in text.split(",") if t]
        return list(self.world.retok[tuple(ids)])


class FakeStack:
    started = stopped = 0

    def __init__(self, **kw) -> None:
        assert kw["replicas"] == 1
        self.procs = {"orchestrator": SimpleNamespace(address="orch:1"),
                      "kvpool-0": SimpleNamespace(address="kv:1")}

    def start(self, timeout: float) -> None:
        FakeStack.started += 1

    def stop(self) -> None:
        FakeStack.stopped += 1


def install(monkeypatch, world: World, calls: list) -> None:
    from services import launcher
    from services.common import model_store
    from services.orchestrator import detok, pipeline, render

    FakeServed.world = FakeRenderer.world = world
    monkeypatch.setattr(assisted, "Served", FakeServed)
    monkeypatch.setattr(assisted, "near_miss_pairs",
                        lambda n: (world.pairs[:n], 1000 + len(world.pairs)))
    monkeypatch.setattr(launcher, "Stack", FakeStack)
    monkeypatch.setattr(assisted, "stack_log_dir", lambda name: None)  # no stack, no logs
    monkeypatch.setattr(model_store, "load_tokenizer", lambda path: FakeTokenizer())
    monkeypatch.setattr(model_store, "resolve_model", lambda spec: SimpleNamespace(path="x"))
    monkeypatch.setattr(render, "PromptRenderer", FakeRenderer)
    monkeypatch.setattr(detok, "complete_decode",
                        lambda tok, ids: ",".join(str(t) for t in ids))
    monkeypatch.setattr(pipeline, "answer_ids",
                        lambda tok, special, ids, text: [] if tuple(ids) in world.retok
                        else list(ids))

    def fake_ladder_replays(runs, costs, chosen, branches=1):
        calls.append((runs, costs, chosen, branches))
        return {"stub": len(runs)}

    monkeypatch.setattr(assisted, "ladder_replays", fake_ladder_replays)


def expected(world: World, args: SimpleNamespace, calls: list) -> dict:
    """The figures as the issue and the docstring define them, from what the fake served."""
    w = world
    pairs = w.pairs[:args.n]
    log = w.log
    a_runs = {q: r for k, q, r, _ in log if k == "A"}
    screen = {q: r for k, q, r, _ in log if k == "screen"}
    assert set(a_runs) == {p.qa for p in pairs} and set(screen) == {p.qb for p in pairs}
    stored = {r.entry_id: drafted(w, r.tokens) for r in a_runs.values() if r.entry_id}
    # A near-miss: the tier handed B a draft (an entry that is a stored answer) and no hit.
    near_miss = [k for k, p in enumerate(pairs)
                 if not screen[p.qb].hit and screen[p.qb].entry_id in stored]
    screen_share = {k: model_share(stored[screen[pairs[k].qb].entry_id][:MAX_TOKENS],
                                   screen[pairs[k].qb].tokens) for k in near_miss}
    # Timed: the screened shares >= 50%, then near-misses in file order up to --min-timed.
    timed = [k for k in near_miss if screen_share[k] >= Fraction(1, 2)]
    for k in near_miss:
        if len(timed) >= args.min_timed:
            break
        if k not in timed:
            timed.append(k)
    timed.sort()
    runs = defaultdict(dict)
    drafts_sent = defaultdict(dict)
    for kind, q, r, d in log:
        if kind in KINDS:
            assert kind not in runs[q], f"{kind} of {q} timed twice"
            runs[q][kind] = r
            drafts_sent[q][kind] = d
    assert set(runs) == {pairs[k].qb for k in timed}
    lad, source, costs, cheap = w.ladder
    rows = []
    for k in timed:
        p = pairs[k]
        rr = runs[p.qb]
        assert set(rr) == set(KINDS), f"pair {k}: every kind once"
        entry = screen[p.qb].entry_id
        draft = stored[entry][:MAX_TOKENS]
        b = rr["plain"].tokens  # B's answer: the timed no-draft one
        ids = w.prompt[p.qb]
        # The direct runs' drafts: none; another pair's answer as drafted (not B's draft's
        # entry); one token the model never emits; random ids as long as the unrelated one.
        ds = drafts_sent[p.qb]
        assert ds["direct_plain"] == []
        others = [q for q in a_runs if a_runs[q].entry_id != entry and q != p.qa]
        assert any(ds["direct_unrelated"] == drafted(w, a_runs[q].tokens) for q in others)
        assert len(ds["direct_lookup"]) == 1 and ds["direct_lookup"][0] >= w.vocab
        assert len(ds["direct_random"]) == len(ds["direct_unrelated"])
        assert all(0 <= t < w.vocab for t in ds["direct_random"])
        as_replica = {"ladder": lad, "cheap_guesses": cheap, "costs": w.costs_at_draft[p.qb],
                      "by_cost": source == "measured", "branches": w.branches}
        rep = replay(ids, b, draft, **as_replica)
        alone = replay(ids, b, draft, self_lookup=False, **as_replica)
        rows.append({
            "k": k, "ids": ids, "b": b, "d": draft, "share": model_share(draft, b),
            "own": entry == a_runs[p.qa].entry_id, "rep": rep, "alone": alone,
            "no_tree": replay(ids, b, draft, **(as_replica | {"branches": 1})),
            "bound": model_bound(b, draft, ids), "bound_draft": model_bound(b, draft),
            **{kind: rr[kind] for kind in KINDS}})
    near = [r for r in rows if r["share"] >= Fraction(1, 2)]

    def tot(rs, f):
        return sum(f(r) for r in rs)

    R = model_ratio
    tok = functools.partial(tot, f=lambda r: len(r["b"]))
    acc_lookup = functools.partial(tot, f=lambda r: r["rep"]["accepted_lookup"])
    prop_lookup = functools.partial(tot, f=lambda r: r["rep"]["proposed_lookup"])
    acc = functools.partial(tot, f=lambda r: r["draft"].accepted)
    prop = functools.partial(tot, f=lambda r: r["draft"].proposed)

    def wall(rs, kind):
        return tot(rs, lambda r: r[kind].wall_s)

    def passes(rs, kind):
        return tot(rs, lambda r: r[kind].forward_passes)

    st = w.stats
    fig = {
        "candidate_pairs": len(pairs),
        "duplicates_scanned": 1000 + len(w.pairs),
        "a_answers_stored": len(stored),
        "b_semantic_hits": sum(r.hit for r in screen.values()),
        "b_without_draft": sum(not r.hit and r.entry_id not in stored for r in screen.values()),
        "near_miss_pairs": len(near_miss),
        "screened_near_pairs": sum(s >= Fraction(1, 2) for s in screen_share.values()),
        "timed_pairs": len(rows),
        "near_pairs": len(near),
        "near_pairs_draft_from_own_question": sum(r["own"] for r in near),
        # The issue's: wall without the draft over with it, through the orchestrator, summed
        # over the near pairs.
        "decode_speedup": R(wall(near, "plain"), wall(near, "draft")),
        # NOTES: each request's prefill forward counted too (one a request).
        "forward_passes_per_token": R(passes(near, "draft") + len(near), tok(near)),
        "forward_passes_per_token_decode_only": R(passes(near, "draft"), tok(near)),
        "forward_passes_per_token_without_draft": R(passes(near, "plain"), tok(near)),
        "forward_passes_per_token_draft_only_replayed": R(
            tot(near, lambda r: r["alone"]["passes"]), tok(near)),
        "forward_passes_per_token_replayed_without_tree": R(
            tot(near, lambda r: r["no_tree"]["passes"]), tok(near)),
        "tree_forwards_replayed": tot(near, lambda r: r["rep"]["trees"]),
        "forward_passes_per_token_hindsight_bound_draft": R(
            tot(near, lambda r: r["bound_draft"]), tok(near)),
        "forward_passes_per_token_hindsight_bound": R(tot(near, lambda r: r["bound"]),
                                                      tok(near)),
        "acceptance_rate": R(acc(near), prop(near)),
        "acceptance_rate_draft": R(acc(near) - acc_lookup(near), prop(near) - prop_lookup(near)),
        "acceptance_rate_lookup": R(acc_lookup(near), prop_lookup(near)),
        "draft_coverage": R(acc(near) - acc_lookup(near), tok(near)),
        "lookup_coverage": R(acc_lookup(near), tok(near)),
        "decode_speedup_timed_pairs": R(wall(rows, "plain"), wall(rows, "draft")),
        "draft_coverage_timed_pairs": R(acc(rows) - acc_lookup(rows), tok(rows)),
        # The issue's: wall with the unrelated draft over without, on the replica, all timed.
        "unrelated_slowdown": R(wall(rows, "direct_unrelated"), wall(rows, "direct_plain")),
        "unrelated_draft_cost_vs_lookup_only": R(wall(rows, "direct_unrelated"),
                                                 wall(rows, "direct_lookup")),
        "lookup_only_speedup_vs_plain": R(wall(rows, "direct_plain"),
                                          wall(rows, "direct_lookup")),
        "unrelated_acceptance_rate": R(tot(rows, lambda r: r["direct_unrelated"].accepted),
                                       tot(rows, lambda r: r["direct_unrelated"].proposed)),
        "forward_passes_per_token_unrelated": R(passes(rows, "direct_unrelated"), tok(rows)),
        "unrelated_coverage_with_lookup": R(tot(rows, lambda r: r["direct_unrelated"].accepted),
                                            tok(rows)),
        "random_draft_slowdown": R(wall(rows, "direct_random"), wall(rows, "direct_plain")),
        "random_draft_cost_vs_lookup_only": R(wall(rows, "direct_random"),
                                              wall(rows, "direct_lookup")),
        "forward_passes_per_token_lookup_only": R(passes(rows, "direct_lookup"), tok(rows)),
        "forward_passes_per_token_random_draft": R(passes(rows, "direct_random"), tok(rows)),
        "orchestrator_over_replica_wall_no_draft": R(wall(rows, "plain"),
                                                     wall(rows, "direct_plain")),
        "wall_plain_s_near": round(wall(near, "plain"), 3),
        "wall_draft_s_near": round(wall(near, "draft"), 3),
        "identical_outputs": all(r[kind].tokens == r["b"] for r in rows for kind in KINDS),
        "replay_matches_server": all(r["rep"]["passes"] == r["draft"].forward_passes
                                     and r["rep"]["accepted"] == r["draft"].accepted
                                     for r in rows),
        "hindsight_bounds_hold": all(r["bound"] <= r["rep"]["passes"]
                                     and r["bound_draft"] <= r["alone"]["passes"]
                                     for r in rows),
        "prompts_match_server": all(r["plain"].prompt_tokens == len(r["ids"]) for r in rows),
        "stats_semantic_near_misses_total": st.semantic.near_misses_total,
        "stats_replica_draft_tokens_proposed_total": st.replicas[0].draft_tokens_proposed_total,
        "stats_replica_draft_tokens_accepted_total": st.replicas[0].draft_tokens_accepted_total,
        "stats_replica_draft_tree_forwards_total": st.replicas[0].draft_tree_forwards_total,
        "stats_replica_draft_tree_branch_wins_total":
            st.replicas[0].draft_tree_branch_wins_total,
    }
    # The ladder replays: the near pairs' (prompt, B's answer, draft), at the costs served by
    # the end (the start-up timing where none), only for a measured ladder.
    costs_end = [r for k, _, r, _ in log if k == "costs"][-1][0]
    if source == "measured" and near:
        assert calls == [([(r["ids"], r["b"], r["d"]) for r in near],
                          costs_end or costs, lad, w.branches)]
        fig["replayed_speedup_by_ladder"] = {"stub": len(near)}
    else:
        assert calls == []
    # Rows checked against the model where the figures leave them unread.
    # The targets are judged on the three figures unrounded.
    exact = {"decode_speedup": (wall(near, "plain"), wall(near, "draft")),
             "forward_passes_per_token": (passes(near, "draft") + len(near), tok(near)),
             "unrelated_slowdown": (wall(rows, "direct_unrelated"), wall(rows, "direct_plain"))}
    exact = {k: Fraction(a) / Fraction(b) if b else None for k, (a, b) in exact.items()}
    return {"figures": fig, "rows": rows, "near": near, "exact": exact}


def run_main(tmp_path, monkeypatch, seed: int):
    rng = random.Random(seed)
    world = World(rng)
    calls: list = []
    install(monkeypatch, world, calls)
    argv, n, min_timed = [], 128, 10
    if rng.random() < 0.2:
        argv, n, min_timed = ["--quick"], 16, 3
    if rng.random() < 0.8:
        n = rng.randint(3, len(world.pairs) + 2)
        argv += ["--candidates", str(n)]
    if rng.random() < 0.8:
        min_timed = rng.randint(1, 8)
        argv += ["--min-timed", str(min_timed)]
    out = tmp_path / f"assisted-{seed}.json"
    assert assisted.main(argv + ["--out", str(out)]) == 0
    res = json.loads(out.read_text())
    return world, res, expected(world, SimpleNamespace(n=n, min_timed=min_timed), calls)


def test_the_run_reports_the_issues_figures(tmp_path, monkeypatch, capsys):
    for seed in range(SEEDS):
        world, res, exp = run_main(tmp_path, monkeypatch, seed)
        capsys.readouterr()
        fig = res["figures"]
        want = exp["figures"]
        assert set(fig) == set(want), set(fig) ^ set(want)
        for name, v in want.items():
            assert fig[name] == v, (seed, name, fig[name], v)
        # Targets: the issue's three, shown as the figure, met exactly when the unrounded
        # figure meets its bound (a 1.9996 shown as 2.0 does not meet ">= 2.0").
        ex = exp["exact"]
        assert {k: (v["value"], v["target"], v["met"]) for k, v in res["targets"].items()} == {
            name: (want[name], f"{op} {bound}",
                   ex[name] is not None
                   and (ex[name] >= bound if op == ">=" else ex[name] <= bound))
            for name, (op, bound) in ISSUE_TARGETS.items()}
        # Rows: the timed pairs in file order, each share of B's no-draft tokens.
        assert [r["pair"] for r in res["pairs"]] == [r["k"] for r in exp["rows"]]
        for got, r in zip(res["pairs"], exp["rows"], strict=True):
            assert got["share"] == round(float(r["share"]), 3)
            assert got["b_tokens"] == len(r["b"]) and got["draft_tokens"] == len(r["d"])
            assert got["passes_hindsight_bound"] == r["bound"]
            assert got["passes_hindsight_bound_draft"] == r["bound_draft"]
        assert FakeStack.started == FakeStack.stopped


@pytest.mark.parametrize("at", ["below", "at", "above"])
def test_near_pairs_are_decided_at_exactly_half_of_bs_tokens(tmp_path, monkeypatch, capsys,
                                                             at):
    """A pair whose draft holds exactly half of B's tokens is a near pair; one token short
    of half is not (multiset overlap over B's no-draft answer)."""
    for seed in range(200):
        world = World(random.Random(seed))
        if len(world.pairs) >= 3:
            break
    p = world.pairs[0]
    a = world.a_answer[p.qa]
    h = 10
    world.a_answer[p.qa] = a = list(range(10, 10 + 2 * h))
    world.retok.pop(tuple(a), None)
    world.screen_differs = 0.0
    extra = {"below": 1, "at": 0, "above": -1}[at]
    world.b_answer[p.qb] = a[:h] + list(range(300, 300 + h + extra))
    world.entry[p.qa] = "entry-0"
    world.screen_entry[p.qb] = (False, "entry-0")
    for q in world.pairs[1:3]:  # hits: pair 0 alone is timed
        world.screen_entry[q.qb] = (True, "entry-x")
    calls: list = []
    install(monkeypatch, world, calls)
    out = tmp_path / "a.json"
    assert assisted.main(["--candidates", "3", "--min-timed", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["figures"]["screened_near_pairs"] == res["figures"]["near_pairs"] == (
        at != "below")
