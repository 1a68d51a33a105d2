"""A differential review of the verifier (`services/semantic/verifier.py`) and its fitter
(`services/semantic/fit_verifier.py`): a brute-force model of each documented rule, compared
with the code on seeded random pairs built from ../shared/data (QQP questions and PAWS-Wiki
sentences) and seeded random label/score tables.

The model, feature by feature (`FEATURES`; the words of a text are the guard's, `_facts`, and
"content words" those words less `_STOP` and "n't", stemmed by `_stem`: the module's own
definition of them):

- numbers_differ, negation_differs, entities_missing, guard_ok: the guard, asked through its
  public `check` with one check switched on (its reason lists up to 4 missing entities);
- content_jaccard, extra_words_max/min/total, bigram_jaccard, len_log_ratio, same_normalised,
  discordant_rate ("pairs of shared first-occurrence content words whose order flips"):
  written out by brute force from those definitions;
- breakpoints (capped at 8), breakpoints_rate: the guard's docstring definition (adjacencies of
  shared words in the cached text, sentinels included, the k-th repeat paired with the k-th,
  that the query no longer has) counted pair by pair, over the lowercased words or over the
  words as the guard's order check compares them (whichever the guard got to: only its
  invariants are asserted, see below), and 0 when the guard let a coordination swap through;
- cos, cos_excess, wh_differs: invariants only (the docs say no more): cos as given,
  cos_excess >= 0 and non-decreasing in cos; wh_differs symmetric, 0 for the same question
  word at the start.
Invariants besides: every feature but breakpoints and guard_ok is symmetric in (query,
cached); identical texts agree in every respect; dropping accents (the guard: "Pokémon" is
"Pokemon"), collapsing whitespace and adding a trailing "?" change no feature;
lowercasing a text changes no lexical feature (names aside: the entity and guard features are
case-sensitive by design); the per-text cache (`cached_while_short`) gives what the uncached
analysis gives, also past its 256-character limit, where nothing is cached.

Serving: `Verifier.check`'s score is a plain numpy logistic of the reference features with the
committed verifier.json weights read as JSON, and it serves iff the guard passes and
P >= the tier's cut.

Fitting: `sentence_groups` is compared with a brute-force breadth-first search over the
sentence graph (nodes: a sentence's lowercased alphanumeric words in any order, as
`_sentence_key`'s docstring says); with grouped folds no test pair shares a sentence with a
training pair; `_choose_cut` and `fit`'s cuts follow the docstring's rule scanned by brute
force over the cut grid (0.00, 0.01, ..., 0.98).

A verdict given to `pair_features` (`guard_ok=`) changes the guard_ok feature and nothing else.

Run while reviewing: 9,000 seeded pairs (each also swapped, against itself, edited four ways,
scored by `check`), a hand-made cross product of 34 edge texts (empty, "?", "n't" alone, CJK,
emoji, full-width, ligatures, "U.S.A.", 300-character and 560-character texts), 3,000 grouping
seeds, 20,000 cut-choice seeds, 100 fit seeds. Found and fixed: given the guard's verdict,
`pair_features` counted the breakpoints over the words as written, not as the guard's order
check counts them, which `check` and the fit use (1.5% of the guarded data pairs; a
deterministic test in test_verifier_rules.py). Model errors fixed: lowercasing is no lexical
invariant where the guard's tokenizer reads capitals ("U.S.", "US dollars", "36 ° C").
Reported, not changed: `_sentence_key` drops non-ASCII letters with the punctuation
("Pokémon" is "pok mon", a sentence without ASCII letters or digits the empty key: "?" and
"…………..", the two such data sentences, are one node), so groups are at worst coarser than
the docstring's, which keeps the no-shared-sentence guarantee (checked with a Unicode key too).

Teeth (bugs put in one at a time; failing seeds of the scratch runs): discordant pairs read at
a word's last place 233/1000 pairs; "n't" a content word 31/1000; extra_words_min capped at 6
27/1000; the intercept left out of the folded weights 300/300; a text's analysis cached by its
first 256 characters 37/1000; union-find joining the pair, not its root 1535/3000 grouping
seeds; the key not lowercased 272/3000; folds drawn per pair despite groups 2650/3000; a PAWS
false-hit rate of 5% refused 475/3000 cut seeds; that rate over the tier's PAWS pairs only
475/3000; the goal without its margin 97/3000 (and 30/100 fit seeds); the largest of equally
precise cuts 2393/3000; the verdict-given breakpoints (the defect) 4/1000.

More seeds: SEMANTIC_VERIFIER_SEEDS=3000 (default 400: 400 pairs, 800 grouping and 800 cut
seeds, 8 fits; ~4 s).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import unicodedata
from collections import Counter, deque

import numpy as np
import pytest

from services.semantic import guard as guard_mod
from services.semantic import verifier as vmod
from services.semantic.fit_verifier import (
    GOAL_MARGIN,
    MIN_KEEP,
    TIER_GOALS,
    PairSet,
    _choose_cut,
    fit,
    fold_of_each_pair,
    sentence_groups,
)
from services.semantic.guard import ParaphraseGuard
from services.semantic.labelled_data import load_paws, load_qqp
from services.semantic.verifier import (
    DEFAULT_WEIGHTS,
    FEATURES,
    Verifier,
    pair_features,
)

SEEDS = int(os.environ.get("SEMANTIC_VERIFIER_SEEDS", "400"))
F = {name: k for k, name in enumerate(FEATURES)}
GUARD = ParaphraseGuard()
ONLY = {name: ParaphraseGuard(**{f"check_{k}": k == name for k in
                                 ("numbers", "negation", "entities", "order", "contrast")})
        for name in ("numbers", "negation", "entities")}
LEXICAL = ("content_jaccard", "extra_words_max", "extra_words_min", "extra_words_total",
           "bigram_jaccard", "len_log_ratio", "wh_differs", "same_normalised", "discordant_rate")
SYMMETRIC = tuple(f for f in FEATURES if f not in ("breakpoints", "breakpoints_rate", "guard_ok"))


# ---- the reference ------------------------------------------------------------------------

def words(text: str) -> tuple[str, ...]:
    """The lowercased words, from the guard's uncached analysis."""
    return guard_mod._facts(text).lower


def content(text: str) -> list[str]:
    return [vmod._stem(w) for w in words(text) if w not in vmod._STOP and w != "n't"]


def jaccard(a: set, b: set) -> float:
    return 1.0 if not (a or b) else len(a & b) / len(a | b)


def ref_breakpoints(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """Adjacent pairs of shared words in `a` (with sentinels) that are not adjacent, in that
    order, in `b`; the k-th repeat of a word in one text pairs with the k-th in the other."""
    shared = Counter(a) & Counter(b)

    def tagged(ws):
        seen: Counter = Counter()
        out = []
        for w in ws:
            if seen[w] < shared[w]:
                out.append((w, seen[w]))
                seen[w] += 1
        return out

    sa, sb = tagged(a), tagged(b)
    if len(sa) < 2:
        return 0
    sa = [("^", -1), *sa, ("$", -1)]
    sb = [("^", -1), *sb, ("$", -1)]
    where = {item: i for i, item in enumerate(sb)}
    return sum(1 for x, y in zip(sa, sa[1:], strict=False) if where[y] != where[x] + 1)


def ref_discordant(a: list[str], b: list[str]) -> float:
    shared = [w for w in dict.fromkeys(a) if w in b]
    n = len(shared)
    if n < 2:
        return 0.0
    flips = sum(1 for i in range(n) for j in range(i + 1, n)
                if b.index(shared[i]) > b.index(shared[j]))
    return flips / math.comb(n, 2)


def reference(query: str, cached: str, cos: float) -> dict[str, float]:
    """The documented features that have a definition to compute (the rest: invariants)."""
    wq, wc = words(query), words(cached)
    cq, cc = content(query), content(cached)
    sq, sc = set(cq), set(cc)
    ents = entities_listed(query, cached)
    return {
        "cos": cos,
        "numbers_differ": float(not ONLY["numbers"].check(query, cached).ok),
        "negation_differs": float(ONLY["negation"].check(query, cached).reason
                                  == "negation differs"),
        "entities_missing": float(min(3, ents)),
        "content_jaccard": jaccard(sq, sc),
        "extra_words_max": float(min(4, max(len(sq - sc), len(sc - sq)))),
        "extra_words_min": float(min(4, min(len(sq - sc), len(sc - sq)))),
        "extra_words_total": float(min(6, len(sq ^ sc))),
        "bigram_jaccard": jaccard(set(zip(wq, wq[1:], strict=False)),
                                  set(zip(wc, wc[1:], strict=False))),
        "len_log_ratio": abs(math.log(len(wq) + 1) - math.log(len(wc) + 1)),
        "same_normalised": float(wq == wc),
        "discordant_rate": ref_discordant(cc, cq),
        "guard_ok": float(GUARD.check(query, cached).ok),
    }


def entities_listed(query: str, cached: str) -> int:
    """How many entities one text has that the other lacks, from the entity-only guard's
    reason (it lists up to 4: 4 reads as "at least 3" here)."""
    r = ONLY["entities"].check(query, cached)
    if r.ok:
        return 0
    assert r.reason.startswith("entities differ: "), r.reason
    return len(r.reason[len("entities differ: "):].split(", "))


def compare(query: str, cached: str, cos: float) -> list[str]:
    """Every way pair_features(query, cached, cos) departs from the reference (empty: none)."""
    got = dict(zip(FEATURES, pair_features(query, cached, cos).tolist(), strict=True))
    want = reference(query, cached, cos)
    bad = [f"{k}: got {got[k]!r}, want {v!r}" for k, v in want.items()
           if not math.isclose(got[k], v, rel_tol=1e-12, abs_tol=1e-12)]
    # cos_excess: non-negative, non-decreasing in cos
    lo = pair_features(query, cached, cos - 0.01)[F["cos_excess"]]
    if not 0.0 <= lo <= got["cos_excess"]:
        bad.append(f"cos_excess not monotone: {lo} at {cos - 0.01}, {got['cos_excess']}")
    # breakpoints: the guard's definition over the words it compared
    fq, fc = guard_mod._facts(query), guard_mod._facts(cached)
    oq, oc = guard_mod.acronyms_folded(fq, fc)
    candidates = {ref_breakpoints(fc.lower, fq.lower), ref_breakpoints(oc.order, oq.order)}
    if guard_mod.coordination_swapped(fq.lower, fc.lower):
        candidates.add(0)
    bp = got["breakpoints_rate"] * max(1, len(set(fq.lower) & set(fc.lower)))
    if not (any(got["breakpoints"] == min(8, b) for b in candidates)
            and any(math.isclose(bp, b, abs_tol=1e-9) for b in candidates)):
        bad.append(f"breakpoints {got['breakpoints']} (rate {got['breakpoints_rate']}) "
                   f"not one of {sorted(candidates)}")
    if got["guard_ok"] and got["breakpoints"] > GUARD.max_breakpoints:
        bad.append(f"guard passed with {got['breakpoints']} breakpoints")
    # a verdict given changes the guard_ok feature alone
    for verdict in (True, False):
        given = pair_features(query, cached, cos, guard_ok=verdict).tolist()
        want = [float(verdict) if f == "guard_ok" else got[f] for f in FEATURES]
        if given != want:
            bad.append(f"guard_ok={verdict} given: {given} != {want}")
    # ranges
    for k in ("content_jaccard", "bigram_jaccard", "discordant_rate"):
        if not 0.0 <= got[k] <= 1.0:
            bad.append(f"{k} out of [0, 1]: {got[k]}")
    if got["wh_differs"] not in (0.0, 1.0):
        bad.append(f"wh_differs {got['wh_differs']}")
    return bad


def symmetric(query: str, cached: str, cos: float) -> list[str]:
    a, b = pair_features(query, cached, cos), pair_features(cached, query, cos)
    bad = [f"{f} asymmetric: {a[F[f]]} / {b[F[f]]}" for f in SYMMETRIC
           if not math.isclose(a[F[f]], b[F[f]], rel_tol=1e-12, abs_tol=1e-12)]
    if a[F["guard_ok"]] != b[F["guard_ok"]]:  # the guard's verdict is symmetric (its tests)
        bad.append("guard_ok asymmetric")
    return bad


def identity(text: str) -> list[str]:
    x = dict(zip(FEATURES, pair_features(text, text, 1.0).tolist(), strict=True))
    want = {"numbers_differ": 0, "negation_differs": 0, "entities_missing": 0, "breakpoints": 0,
            "breakpoints_rate": 0, "content_jaccard": 1, "extra_words_max": 0,
            "extra_words_min": 0, "extra_words_total": 0, "bigram_jaccard": 1,
            "len_log_ratio": 0, "wh_differs": 0, "same_normalised": 1, "discordant_rate": 0}
    return [f"identity {k}: {x[k]}" for k, v in want.items() if x[k] != v]


_ACCENTED = {"a": "\u00e1", "e": "\u00e9", "i": "\u00ed", "o": "\u00f6", "u": "\u00fc",
             "n": "\u00f1", "c": "\u00e7", "E": "\u00c9", "A": "\u00c0"}


def accented(text: str, r: random.Random) -> str:
    return "".join(_ACCENTED[ch] if ch in _ACCENTED and r.random() < 0.3 else ch
                   for ch in text)


def unaccented(text: str) -> str:
    return unicodedata.normalize("NFC", "".join(
        c for c in unicodedata.normalize("NFD", text) if not unicodedata.combining(c)))


# The guard's tokenizer rules that read capitals: "U.S." is "US", "US dollars" is "dollars",
# "° C" is Celsius (its lowercase forms are other words: not a lexical invariant).
CASED_RULES = re.compile(r"[A-Za-z]\.[A-Za-z]|\bU\.?S\.?\s|\u00b0|\bdegrees?\s+[CF]\b")


def invariant_edits(query: str, cached: str, cos: float, r: random.Random) -> list[str]:
    """Edits of the query that the docs say change nothing lexical."""
    base = pair_features(query, cached, cos)
    bad = []
    edits = {"accents": accented(unaccented(query), r),
             "spaces": "  ".join(query.split()) + " ",
             "question mark": query.rstrip() + " ?"}
    if not CASED_RULES.search(query):
        edits["lowercase"] = query.lower()
    for name, q2 in edits.items():
        x = pair_features(q2, cached, cos)
        for f in LEXICAL if name == "lowercase" else FEATURES:
            if not math.isclose(x[F[f]], base[F[f]], rel_tol=1e-12, abs_tol=1e-12):
                bad.append(f"{name} changed {f}: {base[F[f]]} -> {x[F[f]]} ({q2!r})")
    return bad


def cache_agrees(query: str, cached: str, cos: float) -> list[str]:
    """The cached per-text analyses give what fresh analyses give."""
    warm = pair_features(query, cached, cos)
    vmod._text.cache_clear()
    guard_mod.text_facts.cache_clear()
    cold = pair_features(query, cached, cos)
    again = pair_features(query, cached, cos)
    bad = []
    if not (np.array_equal(warm, cold) and np.array_equal(cold, again)):
        bad.append(f"cache: {warm} / {cold} / {again}")
    for t in (query, cached):
        if vmod._text(t) != vmod._text_uncached(t):
            bad.append(f"cached _text differs for {t[:40]!r}")
    return bad


# ---- serving -------------------------------------------------------------------------------

WEIGHTS = json.loads(DEFAULT_WEIGHTS.read_text())
VERIFIER = Verifier()


def served(query: str, cached: str, cos: float, tier: str) -> list[str]:
    """check(): P = logistic(((x - mean) / scale) . coef + intercept) of the reference
    features, served iff the guard passes and P >= the tier's cut (0.5 for a tier without)."""
    x = pair_features(query, cached, cos)
    want = reference(query, cached, cos)
    for k, v in want.items():
        x[F[k]] = v
    z = ((x - np.array(WEIGHTS["mean"])) / np.array(WEIGHTS["scale"])) @ np.array(
        WEIGHTS["coef"]) + WEIGHTS["intercept"]
    p = 1.0 / (1.0 + np.exp(-z))
    got = VERIFIER.check(query, cached, cos, tier)
    bad = []
    if not math.isclose(got.score, p, rel_tol=1e-9, abs_tol=1e-12):
        bad.append(f"score {got.score} != {p}")
    cut = WEIGHTS["cuts"].get(tier, 0.5)
    if abs(p - cut) > 1e-9 and got.ok != (bool(want["guard_ok"]) and p >= cut):
        bad.append(f"served {got.ok} at p={p} cut={cut} guard={want['guard_ok']}")
    if got.ok == bool(got.reason):
        bad.append(f"ok {got.ok} with reason {got.reason!r}")
    return bad


# ---- pairs from the data -------------------------------------------------------------------

def _data() -> tuple[list[str], list[tuple[str, str]]]:
    pairs = [(a, b) for a, b, _ in load_qqp()] + [(a, b) for a, b, _ in load_paws()]
    return [s for p in pairs for s in p], pairs


def perturbed(s: str, r: random.Random) -> str:
    """One edit of `s`: words swapped, a number changed or added, a negation added or removed,
    case, accents, a word dropped or added, a plural, or the text made empty-ish or long."""
    w = s.split()
    kind = r.randrange(12)
    if kind == 0 and len(w) > 1:
        i, j = r.sample(range(len(w)), 2)
        w[i], w[j] = w[j], w[i]
    elif kind == 1:
        digits = [k for k, t in enumerate(w) if any(ch.isdigit() for ch in t)]
        if digits:
            k = r.choice(digits)
            w[k] = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), w[k], count=1)
        else:
            w.insert(r.randrange(len(w) + 1), str(r.choice([2, 3, 10, 1999, 2.5])))
    elif kind == 2:
        w.insert(r.randrange(len(w) + 1), r.choice(["not", "never", "no", "don't"]))
    elif kind == 3:
        w = [t for t in w if t.lower() not in ("not", "no", "never", "n't")] or w
        w = [t.replace("n't", "") for t in w]
    elif kind == 4:
        return r.choice([s.lower(), s.upper(), s.title()])
    elif kind == 5:
        return accented(s, r)
    elif kind == 6 and w:
        del w[r.randrange(len(w))]
    elif kind == 7:
        w.insert(r.randrange(len(w) + 1), r.choice(["latest", "best", "the", "Google", "cheap",
                                                    "what", "how", "USA", "cats"]))
    elif kind == 8:
        return r.choice(["", " ", "?", "the", "What?", "…", "no", "NASA", "a a a", "2"])
    elif kind == 9:
        return " ".join([s] * r.randint(2, 6))  # past the 256-character cache limit, often
    elif kind == 10:
        w = [t + "s" if t.isalpha() and r.random() < 0.3 else t for t in w]
    else:
        return s
    return " ".join(w)


def pair_for(seed: int, sentences, pairs) -> tuple[str, str, float]:
    r = random.Random(seed)
    if r.random() < 0.5:
        q, c = r.choice(pairs)
    else:
        c = r.choice(sentences)
        q = perturbed(c, r)
    if r.random() < 0.3:
        q = perturbed(q, r)
    return q, c, r.choice([0.86, 0.9, 0.91, 0.95, 0.97, 0.99, 1.0, r.uniform(0.8, 1.0)])


def check_seed(seed: int, sentences, pairs) -> list[str]:
    q, c, cos = pair_for(seed, sentences, pairs)
    r = random.Random(~seed)
    bad = (compare(q, c, cos) + symmetric(q, c, cos) + identity(q)
           + invariant_edits(q, c, cos, r) + served(q, c, cos, r.choice(list(TIER_GOALS))))
    if seed % 10 == 0:
        bad += cache_agrees(q, c, cos)
    return [f"seed {seed}: {b} | q={q[:120]!r} c={c[:120]!r}" for b in bad]


# ---- fitting -------------------------------------------------------------------------------

def ref_key(text: str) -> tuple[str, ...]:
    """A sentence as `_sentence_key`'s docstring says: its words (runs of letters and digits),
    lowercased, punctuation dropped, in any order (a multiset)."""
    return tuple(sorted(re.findall(r"[a-z0-9]+", text.lower())))


def unicode_key(text: str) -> tuple[str, ...]:
    return tuple(sorted(re.findall(r"[^\W_]+", text.lower())))


def ref_groups(pairs) -> list[int]:
    """Connected components of the graph: nodes the sentences, edges the pairs (BFS)."""
    adj: dict = {}
    for a, b in pairs:
        ka, kb = ref_key(a), ref_key(b)
        adj.setdefault(ka, set()).add(kb)
        adj.setdefault(kb, set()).add(ka)
    comp: dict = {}
    for start in adj:
        if start in comp:
            continue
        comp[start] = start
        todo = deque([start])
        while todo:
            for nxt in adj[todo.popleft()]:
                if nxt not in comp:
                    comp[nxt] = start
                    todo.append(nxt)
    return [comp[ref_key(a)] for a, _ in pairs]


def same_partition(a, b) -> bool:
    return all((a[i] == a[j]) == (b[i] == b[j]) for i in range(len(a)) for j in range(len(a)))


def grouping_seed(seed: int, sentences) -> list[str]:
    r = random.Random(seed)
    pool = r.sample(sentences, r.randint(1, 12))
    variants = []
    for s in pool:  # the same sentence as the key sees it: case, punctuation, word order
        w = s.split()
        r.shuffle(w)
        variants.append(r.choice([s, s.upper(), " ".join(w), s.replace(" ", " , ") + "?",
                                  accented(s, r), "\u2026", ""]))
    pool += variants
    pairs = [(r.choice(pool), r.choice(pool)) for _ in range(r.randint(0, 25))]
    bad = []
    g = sentence_groups(pairs)
    if len(pairs) and sorted(set(g.tolist())) != list(range(int(g.max()) + 1)):
        bad.append(f"group ids not 0..G-1: {sorted(set(g.tolist()))}")
    want = ref_groups(pairs)
    if not same_partition(g.tolist(), want):
        bad.append(f"groups {g.tolist()} != {want}")
    folds = r.randint(2, 5)
    fold = fold_of_each_pair(len(pairs), folds, seed, g)
    if len(fold) != len(pairs) or not all(0 <= f < folds for f in fold.tolist()):
        bad.append(f"folds {fold.tolist()}")
    # no test pair shares a sentence with a training pair: also a sentence read with its
    # non-ASCII letters ("Pok\u00e9mon"), which `_sentence_key` drops (coarser groups, as safe)
    for key in (ref_key, unicode_key):
        for k in range(folds):
            test = {key(t) for i, p in enumerate(pairs) if fold[i] == k for t in p}
            train = {key(t) for i, p in enumerate(pairs) if fold[i] != k for t in p}
            if test & train:
                bad.append(f"fold {k} shares {sorted(test & train)[:2]} with training")
    return [f"grouping seed {seed}: {b} | pairs={pairs}" for b in bad]


GRID = [k / 100 for k in range(99)]


def ref_cut(p, data: PairSet, threshold: float, goal: float) -> float:
    """The docstring's rule, scanned: among the cuts keeping >= MIN_KEEP of the tier's guarded
    QQP true hits, the smallest reaching goal + GOAL_MARGIN precision with a PAWS false-hit rate
    (over every PAWS non-paraphrase) <= 5%; else the one of best precision (the smallest of
    equals); 0 when no cut keeps a hit."""
    tier = (data.x[:, 0] >= threshold) & (data.x[:, F["guard_ok"]] > 0)
    qqp_hits = [i for i in range(len(p)) if tier[i] and not data.paws[i]]
    true0 = sum(1 for i in qqp_hits if data.y[i] == 1)
    paws_neg = max(1, sum(1 for i in range(len(p)) if data.paws[i] and data.y[i] == 0))
    eligible = []
    for cut in GRID:
        kept = [i for i in qqp_hits if p[i] >= cut]
        tp = sum(1 for i in kept if data.y[i] == 1)
        if tp == 0 or tp < MIN_KEEP * true0:
            continue
        fhr = sum(1 for i in range(len(p)) if tier[i] and data.paws[i] and data.y[i] == 0
                  and p[i] >= cut) / paws_neg
        eligible.append((cut, tp / len(kept), fhr))
    for cut, prec, fhr in eligible:
        if prec >= goal + GOAL_MARGIN and fhr <= 0.05:
            return cut
    if not eligible:
        return 0.0
    best = max(prec for _, prec, _ in eligible)
    return min(cut for cut, prec, _ in eligible if prec == best)


def random_pairset(r: np.random.Generator, n: int) -> tuple[np.ndarray, PairSet]:
    """`n` QQP pairs and 20 or 40 PAWS non-paraphrases (a few PAWS paraphrases), cosines at and
    around the tiers' thresholds, scores on the grid (ties at a cut) and off it; a few PAWS
    non-paraphrases scored high, so that the 5% false-hit bound holds at some cuts, not others."""
    neg = int(r.choice([0, 20, 40]))
    m = n + neg + int(r.integers(0, 5))
    x = np.zeros((m, len(FEATURES)))
    x[:, 0] = r.choice([0.9, 0.95, 0.96, 0.97, 0.98, 1.0], m)
    x[:, F["guard_ok"]] = r.random(m) < 0.85
    y = (r.random(m) < r.uniform(0.3, 0.95)).astype(int)
    paws = np.arange(m) >= n
    y[n:n + neg] = 0
    y[n + neg:] = 1
    p = np.where(r.random(m) < 0.5, r.integers(0, 100, m) / 100,
                 np.clip(0.5 * y + r.random(m) * 0.6, 0, 1))
    high = r.random(m) < r.uniform(0.0, 0.2)
    p = np.where(paws & (y == 0), np.where(high, r.random(m), 0.3 * r.random(m) ** 2), p)
    return p, PairSet(x, y, paws)


def cut_seed(seed: int) -> list[str]:
    r = np.random.default_rng(seed)
    p, data = random_pairset(r, int(r.integers(1, 80)))
    bad = []
    for tier, (th, goal) in TIER_GOALS.items():
        got, want = _choose_cut(p, data, th, goal), ref_cut(p, data, th, goal)
        if got != want:
            bad.append(f"cut seed {seed} {tier}: got {got}, want {want}")
    return bad


def fit_seed(seed: int) -> list[str]:
    """fit(): its cuts are the rule applied to its own scores of the data it was fitted on."""
    r = np.random.default_rng(seed)
    _, data = random_pairset(r, 200)
    n = len(data.y)
    data.x[:, F["content_jaccard"]] = np.where(data.y == 1, 0.7, 0.4) + 0.4 * r.random(n)
    data.x[:, F["extra_words_total"]] = r.integers(0, 4, n)
    model = fit(data)
    p = model.probabilities(data.x)
    return [f"fit seed {seed} {t}: cut {model.cuts[t]}, want {ref_cut(p, data, th, g)}"
            for t, (th, g) in TIER_GOALS.items() if model.cuts[t] != ref_cut(p, data, th, g)]


# ---- the bounded tests ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def data():
    return _data()


def _report(bad: list[str]) -> None:
    assert not bad, f"{len(bad)} divergences, e.g.:\n" + "\n".join(bad[:6])


def test_features_and_served_scores_follow_the_reference(data):
    sentences, pairs = data
    _report([b for seed in range(SEEDS) for b in check_seed(seed, sentences, pairs)])


def test_a_text_past_the_cache_limit_is_analysed_uncached_and_alike():
    """Texts of up to 256 characters are analysed once (the same analysis object again), longer
    ones every time, alike."""
    short, long = "How do I learn Python quickly?", "How do I learn Python quickly and well " * 8
    assert len(long) > 256
    vmod._text.cache_clear()
    assert vmod._text(short) is vmod._text(short)
    assert vmod._text(long) is not vmod._text(long)
    assert vmod._text(long) == vmod._text_uncached(long)
    assert not compare(long, long[:-10], 0.97) and not cache_agrees(long, long[:-10], 0.97)


def test_sentence_groups_and_folds_follow_the_sentence_graph(data):
    sentences, _ = data
    _report([b for seed in range(SEEDS * 2) for b in grouping_seed(seed, sentences)])


def test_cuts_follow_the_documented_rule():
    _report([b for seed in range(SEEDS * 2) for b in cut_seed(seed)]
            + [b for seed in range(max(2, SEEDS // 50)) for b in fit_seed(seed)])
