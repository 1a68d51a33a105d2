"""A learned second opinion on a high-similarity match: cosine + pair features -> P(same).

The hand-made `ParaphraseGuard` refuses a match on one signal at a time (numbers, negation,
entities, word order). The verifier feeds those signals, the cosine and a few cheap lexical
features of the pair into a logistic regression fitted on labelled pairs (QQP and PAWS, see
`services/semantic/fit_verifier.py`) and serves a match only when

    guard passes  and  P(same meaning | features) >= the tier's cut

The guard stays a hard veto, so every hand-made trap is still refused; the model adds what the
guard cannot express: how many content words one text has that the other lacks ("best websites
to download *latest* Hindi movies"), whether the two ask with the same question word, how much
of the word order and of the word bigrams survive. The weights are a small JSON file
(`verifier.json` beside this module), fitted once and committed. Scoring one pair is pure
Python and deterministic: each text is analysed once (cached while short), ~0.15-0.2 ms a pair
on a 2-core Xeon (0.26-0.29 ms when the guard and the features analysed each text apart).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import numpy as np

from services.semantic.guard import (
    ParaphraseGuard,
    TextFacts,
    _breakpoints_lower,
    cached_while_short,
    entities_missing,
    negated_alike,
    numbers_agree,
    text_facts,
)

DEFAULT_WEIGHTS = Path(__file__).with_name("verifier.json")

_STOP = frozenset("""a an the is are was were be been being am do does did doing have has had
having i me my mine we our you your he him his she her it its they them their this that these
those to of in on at for with by from as into about than then so such and or but if there here
can could would should will shall may might must what how why when where who whom which whose
some any all most more very just also get got make one s t ll ve re d m""".split())
_WH = ("what", "how", "why", "when", "where", "who", "which", "whom", "whose")

FEATURES = (
    "cos", "cos_excess", "numbers_differ", "negation_differs", "entities_missing",
    "breakpoints", "breakpoints_rate", "content_jaccard", "extra_words_max", "extra_words_min",
    "extra_words_total", "bigram_jaccard", "len_log_ratio", "wh_differs", "same_normalised",
    "discordant_rate", "guard_ok",
)


class VerifierResult(NamedTuple):
    """`ok` False: do not serve the match. `score` is P(same meaning); `reason` says why not."""

    ok: bool
    score: float
    reason: str


def _stem(w: str) -> str:
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
        return w[:-1]
    return w


class _Text(NamedTuple):
    facts: TextFacts
    content: tuple[str, ...]  # stemmed content words, in order
    content_set: frozenset[str]
    norm: str
    wh: str
    bigrams: frozenset[tuple[str, str]]


def _text_uncached(s: str) -> _Text:
    f = text_facts(s)
    lower = f.lower
    content = tuple(_stem(w) for w in lower if w not in _STOP and w != "n't")
    return _Text(f, content, frozenset(content), " ".join(lower), _wh(lower),
                 frozenset(zip(lower, lower[1:], strict=False)))


# The verifier's view of one text (cached for short texts, as the guard's facts are).
_text = cached_while_short(_text_uncached)


def _wh(lower: Sequence[str]) -> str:
    for w in lower[:6]:
        if w in _WH:
            return w
    return ""


def _discordant_rate(a: Sequence[str], b: Sequence[str]) -> float:
    """Fraction of pairs of shared (first-occurrence) content words whose order flips."""
    pos_b: dict[str, int] = {}
    for i, w in enumerate(b):
        pos_b.setdefault(w, i)
    seen: set[str] = set()
    seq = []
    for w in a:
        if w in pos_b and w not in seen:
            seen.add(w)
            seq.append(pos_b[w])
    n = len(seq)
    if n < 2:
        return 0.0
    disc = sum(1 for i in range(n) for j in range(i + 1, n) if seq[i] > seq[j])
    return disc / (n * (n - 1) / 2)


def pair_features(query: str, cached: str, cosine: float,
                  guard: ParaphraseGuard | None = None,
                  guard_ok: bool | None = None) -> np.ndarray:
    """The feature vector (order of `FEATURES`) of one (query, cached prompt) pair.

    `guard_ok`: the guard's verdict when the caller already has it (else it is computed). The
    guard runs either way: the breakpoints are the ones its order check counted (as `check`
    and the fit read them). Given a verdict, they were counted over the words as written
    instead, and differed for 1.5% of the guarded QQP and PAWS pairs ("What are good startup
    ideas?" / "What are the best ideas for startups?": 0, the guard's 3).
    """
    q, c = _text(query), _text(cached)
    verdict, bp = (guard or _GUARD).check_facts(q.facts, c.facts)
    if guard_ok is None:
        guard_ok = verdict.ok
    return np.array(_features(q, c, cosine, guard_ok, bp), dtype=np.float64)


def _features(q: _Text, c: _Text, cosine: float, guard_ok: bool,
              bp: int | None) -> list[float]:
    fq, fc = q.facts, c.facts
    lq, lc = fq.lower_set, fc.lower_set
    missing = entities_missing(fq, fc)
    if bp is None:
        bp = _breakpoints_lower(fc.lower, fq.lower)
    cq, cc = q.content_set, c.content_set
    union = cq | cc
    jac = len(cq & cc) / len(union) if union else 1.0
    extra_q, extra_c = len(cq - cc), len(cc - cq)
    bq, bc = q.bigrams, c.bigrams
    bunion = bq | bc
    shared = len(lq & lc)
    return [
        cosine,
        max(0.0, cosine - 0.9) * 10.0,
        float(not numbers_agree(fq, fc)),
        float(fq.negations != fc.negations and not negated_alike(fq, fc)),
        float(min(3, len(missing))),
        float(min(8, bp)),
        bp / max(1, shared),
        jac,
        float(min(4, max(extra_q, extra_c))),
        float(min(4, min(extra_q, extra_c))),
        float(min(6, extra_q + extra_c)),
        len(bq & bc) / len(bunion) if bunion else 1.0,
        abs(math.log((len(fq.words) + 1) / (len(fc.words) + 1))),
        float(q.wh != c.wh),
        float(q.norm == c.norm),
        _discordant_rate(c.content, q.content),
        float(guard_ok),
    ]


_GUARD = ParaphraseGuard()


class StaleVerifier(ValueError):
    """Weights fitted on another version's features: usable by that version only."""


@dataclass(frozen=True)
class VerifierModel:
    """Logistic regression over standardised `FEATURES`, plus one probability cut per tier.

    Args:
        mean, scale: standardisation of each feature.
        coef, intercept: the fitted weights.
        cuts: tier name -> minimum P(same meaning) to serve a hit (0.5 for a tier without
            one).
        guard_veto: a failed hand-made guard check refuses the match whatever the score.
    """

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    intercept: float
    cuts: dict[str, float]
    guard_veto: bool = True
    meta: dict | None = None

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        """P(same meaning) for feature rows `x` `[n, len(FEATURES)]`."""
        z = (np.atleast_2d(x) - np.asarray(self.mean)) / np.asarray(self.scale)
        return 1.0 / (1.0 + np.exp(-(z @ np.asarray(self.coef) + self.intercept)))

    @cached_property
    def _folded(self) -> tuple[tuple[float, ...], float]:
        """Weights over raw features: coef / scale, and the intercept less mean · that."""
        w = tuple(c / sc for c, sc in zip(self.coef, self.scale, strict=True))
        return w, self.intercept - math.fsum(m * wi for m, wi in zip(self.mean, w, strict=True))

    def probability(self, x: Sequence[float]) -> float:
        """P(same meaning) of one feature row (pure Python: one pair needs no numpy call)."""
        w, b = self._folded
        z = b + math.fsum(xi * wi for xi, wi in zip(x, w, strict=True))
        # Overflow-safe logistic.
        return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))

    def to_json(self) -> str:
        return json.dumps({"features": list(FEATURES), "mean": list(self.mean),
                           "scale": list(self.scale), "coef": list(self.coef),
                           "intercept": self.intercept, "cuts": self.cuts,
                           "guard_veto": self.guard_veto, "meta": self.meta or {}}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> VerifierModel:
        """Raises StaleVerifier (weights of other features: another version's file), or
        ValueError naming what is missing or malformed (a vector of the wrong length, a
        number that is NaN or infinite, a scale <= 0)."""
        d = json.loads(text)
        missing = [k for k in ("features", "mean", "scale", "coef", "intercept", "cuts")
                   if k not in d]
        if missing:
            raise ValueError(f"verifier weights: missing {', '.join(missing)}")
        if tuple(d["features"]) != FEATURES:
            raise StaleVerifier("verifier weights were fitted on other features; refit them "
                                "with python -m services.semantic.fit_verifier")
        vectors = {k: tuple(float(v) for v in d[k]) for k in ("mean", "scale", "coef")}
        for k, v in vectors.items():
            # Checked only when a pair was scored (zip(strict=True)): every verified lookup
            # would then fail, not the start.
            if len(v) != len(FEATURES):
                raise ValueError(f"verifier weights: {k} has {len(v)} values, not "
                                 f"{len(FEATURES)} (one per feature)")
        intercept = float(d["intercept"])
        cuts = {k: float(v) for k, v in d["cuts"].items()}
        # NaN or infinite weights score every pair NaN, below no cut (every pair the guard
        # passes was served), as a NaN cut serves them all; a scale of 0 raised
        # ZeroDivisionError at every verified lookup, not at the start.
        for k, v in (*vectors.items(), ("intercept", (intercept,)), ("cuts", cuts.values())):
            if not all(math.isfinite(x) for x in v):
                raise ValueError(f"verifier weights: {k} has a value that is not a finite "
                                 "number (NaN or infinity)")
        if not all(s > 0 for s in vectors["scale"]):
            raise ValueError("verifier weights: scale has a value <= 0")
        return cls(vectors["mean"], vectors["scale"], vectors["coef"], intercept, cuts,
                   bool(d.get("guard_veto", True)), d.get("meta"))

    @classmethod
    def load(cls, path: str | Path = DEFAULT_WEIGHTS) -> VerifierModel:
        """The weights in `path`.

        Raises:
            StaleVerifier: fitted on another version's features.
            ValueError: not JSON (cut short), or fields missing, of the wrong shape or not
                finite numbers (or a scale <= 0), naming the file and the way out (a bare
                JSONDecodeError named neither).
            OSError: the file cannot be read.
        """
        text = Path(path).read_text()
        try:
            return cls.from_json(text)
        except StaleVerifier:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            if Path(path).resolve() == DEFAULT_WEIGHTS.resolve():
                way_out = ("the packaged weights are damaged: reinstall the package, or refit "
                           "them with python -m services.semantic.fit_verifier")
            else:
                way_out = (f"refit them with python -m services.semantic.fit_verifier --out "
                           f"{path}, or unset TIERCACHE_SEMANTIC_VERIFIER_PATH (--verifier-path) "
                           "to use the packaged weights")
            raise ValueError(f"{path}: not usable verifier weights ({type(e).__name__}: {e}); "
                             f"{way_out}") from e


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0,
                 weights: np.ndarray | None = None, iters: int = 50) -> tuple[np.ndarray,
                                                                           np.ndarray,
                                                                           np.ndarray, float]:
    """L2-regularised logistic regression by Newton's method (deterministic).

    Returns (mean, scale, coef, intercept) over standardised features.
    """
    mean = x.mean(0)
    scale = x.std(0)
    scale[scale < 1e-9] = 1.0
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    w = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    beta = np.zeros(z.shape[1])
    reg = np.full(z.shape[1], l2)
    reg[-1] = 0.0  # the intercept is not shrunk
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(z @ beta)))
        grad = z.T @ (w * (p - y)) + reg * beta
        hess = (z * (w * p * (1 - p))[:, None]).T @ z + np.diag(reg)
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.abs(step).max() < 1e-8:
            break
    return mean, scale, beta[:-1], float(beta[-1])


class Verifier:
    """Decides whether a candidate above the similarity threshold may be served.

    Args:
        model: fitted weights and cuts (default: the committed `verifier.json`).
        guard: the hand-made checks used as features and as a veto.
    """

    def __init__(self, model: VerifierModel | None = None,
                 guard: ParaphraseGuard | None = None) -> None:
        self.model = model or VerifierModel.load()
        self.guard = guard or ParaphraseGuard()

    def check(self, query: str, cached: str, cosine: float, tier: str) -> VerifierResult:
        """VerifierResult(True, p, "") if `cached` may answer `query` in `tier`."""
        q, c = _text(query), _text(cached)
        g, bp = self.guard.check_facts(q.facts, c.facts)
        p = self.model.probability(_features(q, c, cosine, g.ok, bp))
        if self.model.guard_veto and not g.ok:
            return VerifierResult(False, p, g.reason)
        cut = self.model.cuts.get(tier, 0.5)
        if p < cut:
            return VerifierResult(False, p, f"verifier score {p:.3f} below {cut:.3f}")
        return VerifierResult(True, p, "")

    def scores(self, pairs: Sequence[tuple[str, str, float]]) -> np.ndarray:
        """P(same meaning) of many (query, cached, cosine) triples (benchmarks)."""
        x = np.stack([pair_features(q, c, s, self.guard) for q, c, s in pairs])
        return self.model.probabilities(x)
