"""A differential review of the verifier's fit (`services/semantic/fit_verifier.py`: `fit`,
`write_weights`, `main`) and of how `services/semantic/verifier.py` loads and applies what it
writes (`VerifierModel.to_json` / `load`, `Verifier.check`), against a plain model of the
docstrings, on seeded random small labelled feature tables (no embedding: the tables stand in
for `load_pairs`, the module's own seam, as tests/semantic/test_fit_verifier_rules.py does).

The model:
- training pairs: cosine >= TRAIN_FLOOR and guard_ok; standardised by their mean and standard
  deviation (1 for a constant feature); the weights are the optimum of the L2 (`L2`, the
  intercept unshrunk) logistic loss with PAWS pairs weighed PAWS_WEIGHT, checked by its
  optimality condition (the gradient vanishes), not by re-running Newton's method;
- each tier's cut: the docstring's rule over the cut grid 0.00 .. 0.98, brute force, on the
  fitted model's P(same) of *all* the pairs; a tier without a QQP true hit to keep gets 0;
- a table without both labels among its training pairs (none at all, one class only) is
  refused with a ValueError naming the counts, as are weights that are not finite (features too
  large to standardise); `main` then says so in one line, exits 2 and leaves the file as it was;
- `main` writes `to_json` of that model plus the embedder's name and weights fingerprint,
  atomically: the file holds the new text or (a write that fails at fchmod, fsync or rename)
  the old one, no temporary file is left beside it, the mode of a replaced file is kept, a new
  file gets 0666 less the umask; a symbolic link there is replaced (its target left as it was);
- `VerifierModel.load` gives the fields back exactly; a file cut short, with a required key
  missing, a vector of the wrong length, a non-finite number, a scale <= 0 or cuts that are not
  numbers is a ValueError naming the file and the way out; other features a StaleVerifier;
- `Verifier.check(q, c, cos, tier)`: refused with the guard's reason when the guard refuses,
  else served iff P >= the tier's cut (0.5 for a tier without one), P the logistic of the
  standardised features written out here, with "verifier score P below CUT" (3 decimals).

Data: 0-150 pairs, features in their real ranges or scaled up to 1e12 (a fifth of the seeds),
duplicated rows, cosines on and around the tiers' thresholds and the floor, one-class,
all-PAWS, all-vetoed and empty tables; 24 text pairs (guard passes and refusals, unicode,
empty) for `check`, their features computed once.

Run while reviewing: 20,000 seeds (FIT_VERIFIER_DIFFERENTIAL_SEEDS=20000, ~90 s; default 600,
~4-5 s). Found and fixed (regression tests in test_fit_verifier_rules.py and
test_verifier_rules.py): (1) `fit` on a table without both labels among its training pairs
raised a bare LinAlgError "Singular matrix" (empty, all vetoed, all below the floor, all
"same") or, all "different", returned weights scoring every pair ~1e-22 with cuts 0, which
serve every guarded hit; weights that are not finite (features ~1e200 and up) were written as
NaN / Infinity; (2) `load` accepted NaN and infinite weights or cuts (every pair the guard
passes was then served: a NaN score is below no cut) and a scale of 0 (every verified lookup
then raised ZeroDivisionError, not the start). Documented, not changed: the cut is 0 when a
tier has no guarded training QQP pair labelled the same; a tier without a cut serves at 0.5; a
symbolic link at `--out` is replaced by the file.

Teeth (bugs put in one at a time, 600 seeds): 23 of 24 fail it: the floor exclusive, PAWS
unweighed, the 5% bound exclusive, the false-hit rate over the tier's PAWS pairs, the largest
of equally precise cuts, cuts chosen on the training pairs' scores, the intercept shrunk, 3
Newton steps, ddof=1, no fchmod, the temporary file kept on failure, a write in place, a
missing guard_veto read as off, NaN cuts or negative scales accepted, a missing cut as 0,
the folded intercept's sign, one-class refusal for all "same" only, the whole identity as the
weights' fingerprint, exit 0 on refusal, meta not written, the MIN_KEEP floor exclusive, the
reason's score at 2 decimals. Missed: the finiteness check without the intercept (equivalent:
a non-finite intercept comes with non-finite weights). Not covered here: exact ties of a
score and a cut (`p >= cut` inclusive; test_verifier_rules.py has it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import stat

import numpy as np
import pytest

from services.semantic import fit_verifier
from services.semantic import verifier as vmod
from services.semantic.fit_verifier import (
    GOAL_MARGIN,
    L2,
    MIN_KEEP,
    PAWS_WEIGHT,
    TIER_GOALS,
    TRAIN_FLOOR,
    PairSet,
    fit,
    write_weights,
)
from services.semantic.verifier import FEATURES, StaleVerifier, Verifier, VerifierModel

SEEDS = int(os.environ.get("FIT_VERIFIER_DIFFERENTIAL_SEEDS", "600"))
F = {name: k for k, name in enumerate(FEATURES)}
NF = len(FEATURES)
GRID = [k / 100 for k in range(99)]

# ---- the reference ------------------------------------------------------------------------


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def ref_p(x: np.ndarray, mean, scale, coef, b) -> np.ndarray:
    with np.errstate(over="ignore"):
        return sigmoid(((x - np.array(mean)) / np.array(scale)) @ np.array(coef) + b)


def ref_train(data: PairSet) -> np.ndarray:
    return (data.x[:, 0] >= TRAIN_FLOOR) & (data.x[:, F["guard_ok"]] > 0)


def ref_refusal(data: PairSet) -> str | None:
    """Why the model refuses the table, or None."""
    t = ref_train(data)
    pos, neg = int((data.y[t] == 1).sum()), int((data.y[t] == 0).sum())
    if pos == 0 or neg == 0:
        return "labels"
    with np.errstate(all="ignore"):
        x = data.x[t]
        mean, sd = x.mean(0), x.std(0)
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(sd))):
        return "finite"
    return None


def ref_cut(p: np.ndarray, data: PairSet, threshold: float, goal: float) -> float:
    tier = [i for i in range(len(p)) if data.x[i, 0] >= threshold
            and data.x[i, F["guard_ok"]] > 0]
    qqp = [i for i in tier if not data.paws[i]]
    hits0 = sum(1 for i in qqp if data.y[i] == 1)
    paws_neg = sum(1 for i in range(len(p)) if data.paws[i] and data.y[i] == 0) or 1
    cands = []
    for cut in GRID:
        kept = [i for i in qqp if p[i] >= cut]
        tp = sum(1 for i in kept if data.y[i] == 1)
        if tp == 0 or tp < MIN_KEEP * hits0:
            continue
        fh = sum(1 for i in tier if data.paws[i] and data.y[i] == 0 and p[i] >= cut)
        cands.append((cut, tp / len(kept), fh / paws_neg))
    for cut, prec, fhr in cands:
        if prec >= goal + GOAL_MARGIN and fhr <= 0.05:
            return cut
    if not cands:
        return 0.0
    best = max(c[1] for c in cands)
    return min(c[0] for c in cands if c[1] == best)


def fit_divergences(tag: str, data: PairSet, model: VerifierModel) -> list[str]:
    bad = []
    t = ref_train(data)
    x, y = data.x[t], data.y[t].astype(float)
    w = np.where(data.paws[t], PAWS_WEIGHT, 1.0)
    mean, sd = x.mean(0), x.std(0)
    sd = np.where(sd < 1e-9, 1.0, sd)
    if not (np.allclose(model.mean, mean, rtol=1e-9, atol=0)
            and np.allclose(model.scale, sd, rtol=1e-9, atol=0)):
        bad.append(f"{tag}: standardisation differs")
    z = np.hstack([(x - mean) / sd, np.ones((len(x), 1))])
    beta = np.array([*model.coef, model.intercept])
    g = z.T @ (w * (sigmoid(z @ beta) - y)) + np.r_[np.full(NF, L2), 0.0] * beta
    if np.abs(g).max() > 1e-6 * max(1.0, w.sum()):
        bad.append(f"{tag}: not the optimum, gradient {np.abs(g).max():.3g}")
    p = ref_p(data.x, model.mean, model.scale, model.coef, model.intercept)
    for tier, (th, goal) in TIER_GOALS.items():
        want = ref_cut(p, data, th, goal)
        if model.cuts.get(tier) != want:
            bad.append(f"{tag}: {tier} cut {model.cuts.get(tier)}, want {want}")
    if set(model.cuts) != set(TIER_GOALS):
        bad.append(f"{tag}: cuts for {sorted(model.cuts)}")
    meta = model.meta or {}
    if meta.get("train_pairs") != int(t.sum()) or meta.get("l2") != L2 \
            or meta.get("tier_goals") != {k: list(v) for k, v in TIER_GOALS.items()}:
        bad.append(f"{tag}: meta {meta}")
    return bad


# ---- random tables ------------------------------------------------------------------------

COS = (0.5, 0.89, 0.8999999, TRAIN_FLOOR, 0.93, 0.95, 0.9499999, 0.96, 0.97, 0.98, 1.0)


def random_table(r: np.random.Generator) -> PairSet:
    kind = r.choice(["plain"] * 14 + ["one_class", "all_paws", "vetoed", "empty", "low",
                                     "tiny"] + ["dupes"] * 4)
    n = {"empty": 0, "tiny": int(r.integers(1, 4))}.get(kind, int(r.integers(2, 150)))
    y = (r.random(n) < r.uniform(0.2, 0.9)).astype(int)
    if kind == "one_class":
        y[:] = int(r.integers(0, 2))
    x = np.zeros((n, NF))
    signal = float(r.choice([0.0, 0.1, 0.4, 1.0]))  # how well the features tell the labels
    x[:, 0] = np.where(r.random(n) < 0.5, r.choice(COS, n), 0.85 + 0.15 * r.random(n))
    if kind == "low":
        x[:, 0] = 0.89 * r.random(n)
    x[:, 1] = np.maximum(0.0, x[:, 0] - 0.9) * 10
    for name in ("numbers_differ", "negation_differs", "wh_differs", "same_normalised"):
        x[:, F[name]] = r.random(n) < 0.1
    x[:, F["entities_missing"]] = r.integers(0, 4, n) * (r.random(n) < 0.2)
    x[:, F["breakpoints"]] = r.integers(0, 9, n)
    x[:, F["breakpoints_rate"]] = r.random(n)
    for name in ("content_jaccard", "bigram_jaccard"):
        x[:, F[name]] = np.clip(0.3 + signal * y + 0.5 * r.random(n) - 0.25, 0, 1)
    x[:, F["extra_words_max"]] = r.integers(0, 5, n)
    x[:, F["extra_words_min"]] = np.minimum(r.integers(0, 5, n), x[:, F["extra_words_max"]])
    x[:, F["extra_words_total"]] = np.minimum(6, r.integers(0, 7, n))
    x[:, F["len_log_ratio"]] = r.exponential(0.3, n)
    x[:, F["discordant_rate"]] = r.random(n) * (r.random(n) < 0.3)
    x[:, F["guard_ok"]] = r.random(n) < (0.0 if kind == "vetoed" else 0.85)
    if r.random() < 0.2:  # extreme but finite magnitudes
        cols = r.choice(NF, int(r.integers(1, 4)), replace=False)
        x[:, cols] *= 10.0 ** float(r.choice([6, 12, 150, 200, 307]))
    paws = r.random(n) < (1.0 if kind == "all_paws" else r.uniform(0, 0.6))
    if kind == "dupes" and n:
        pick = r.integers(0, min(n, int(r.integers(1, 6))), n)  # a few distinct rows
        x, y, paws = x[pick], y[pick], paws[pick]
    return PairSet(x, y, paws)


# ---- texts for check ----------------------------------------------------------------------

TEXTS = [("How do I learn Python?", "How can I learn Python?"),
         ("How do I learn Python?", "How can I learn Java?"),
         ("What is the capital of France?", "What's the capital of France?"),
         ("Flights from New York to Florida", "Flights from Florida to New York"),
         ("I do not like coffee", "I like coffee"),
         ("How many days are in 2024?", "How many days are in 2023?"),
         ("What are the best books to read?", "What are the best books to read in 2020?"),
         ("Why is the sky blue?", "Why is the sky blue?"),
         ("Qu'est-ce que Pokémon ?", "Qu'est-ce que Pokemon ?"),
         ("", ""), ("?", "…"), ("東京の天気は？", "東京の天気は"),
         ("How can I lose weight fast?", "What is the fastest way to lose weight?"),
         ("Who wrote Hamlet?", "Who wrote Macbeth?"),
         ("Is it safe to eat raw eggs?", "Is eating raw eggs safe?"),
         ("What is machine learning", "what is machine learning?"),
         ("best websites to download latest Hindi movies", "best websites to download Hindi "
          "movies"),
         ("How do I become a data scientist?", "How can I become a good data scientist?"),
         ("🙂 emoji test", "emoji test 🙂"),
         ("x" * 300, "x" * 300 + " y"),
         ("When did World War 2 end?", "When did World War II end?"),
         ("How to cook rice", "How to cook rice?"),
         ("Where is Paris?", "Where is Paris, Texas?"),
         ("What is 5 million USD in EUR?", "What is $5 million in EUR?")]


@pytest.fixture(scope="module")
def text_features():
    """Features at cosine 0 of each text pair (query second, as the fit reads them)."""
    return [vmod.pair_features(q, c, 0.0) for c, q in TEXTS]


def served_divergences(tag: str, model: VerifierModel, feats, r: random.Random) -> list[str]:
    """Verifier.check against the model on random text pairs, cosines and tiers."""
    bad = []
    v = Verifier(model)
    m = json.loads(model.to_json())  # the reference reads the numbers as written
    for _ in range(8):
        k = r.randrange(len(TEXTS))
        cached, query = TEXTS[k]
        cos = r.choice([0.9, 0.95, 0.97, 0.999, r.uniform(0.85, 1.0)])
        tier = r.choice([*TIER_GOALS, "other"])
        x = feats[k].copy()
        x[0], x[1] = cos, max(0.0, cos - 0.9) * 10
        p = float(ref_p(x[None, :], m["mean"], m["scale"], m["coef"], m["intercept"])[0])
        cut = m["cuts"].get(tier, 0.5)
        got = v.check(query, cached, cos, tier)
        if abs(got.score - p) > 1e-9 * max(1.0, abs(p)):
            bad.append(f"{tag}: {TEXTS[k]} score {got.score}, want {p}")
            continue
        guard = v.guard.check(query, cached)
        if bool(x[F["guard_ok"]]) != guard.ok:
            bad.append(f"{tag}: guard_ok feature {x[F['guard_ok']]} but guard {guard}")
        if not guard.ok:
            want = (False, guard.reason)
        elif abs(p - cut) < 1e-12:
            continue  # on the cut: float rounding decides
        elif p < cut:
            want = (False, f"verifier score {p:.3f} below {cut:.3f}")
        else:
            want = (True, "")
        if (got.ok, got.reason) != want:
            bad.append(f"{tag}: {TEXTS[k]} {tier} cos {cos}: {got}, want {want}")
    return bad


# ---- files --------------------------------------------------------------------------------

def temp_leftovers(folder) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith(".tmp")]


class Stub:
    def resolved_model_name(self) -> str:
        return "mini-ü"


def main_seed(tag: str, data: PairSet, folder, r: random.Random, monkeypatch) -> list[str]:
    """`main` on `data` (load_pairs stood in for): the file holds fit(data) + the embedder's
    tags, or, refused, what it held before; atomically, mode kept."""
    bad = []
    out = os.path.join(folder, r.choice(["verifier.json", "v é.json", "w"]))
    old = None
    link = r.random() < 0.2  # `out` a symbolic link to the old file: replaced, not followed
    if r.random() < 0.7:
        old = f"old {r.random()}"
        real_file = os.path.join(folder, "target") if link else out
        with open(real_file, "w") as f:
            f.write(old)
        os.chmod(real_file, r.choice([0o600, 0o640, 0o644, 0o664]))
        if link:
            os.symlink("target", out)
    mode_before = stat.S_IMODE(os.stat(out).st_mode) if old is not None else None
    umask = r.choice([0o022, 0o077, 0o002])
    fail = r.choice([None] * 3 + ["fchmod", "fsync", "replace"])
    monkeypatch.setattr(fit_verifier, "load_pairs", lambda: (data, None, None, "mini@ab12"))
    monkeypatch.setattr(fit_verifier, "semantic_config", Stub)
    if fail:
        real = getattr(os, fail)

        def boom(*a, _real=real, **k):
            raise OSError(f"injected {fail}")
        monkeypatch.setattr(os, fail, boom)
    prev = os.umask(umask)
    rc = exc = None
    try:
        with contextlib.redirect_stderr(open(os.devnull, "w")):
            rc = fit_verifier.main(["--out", out])
    except Exception as e:  # noqa: BLE001 - compared with the model below
        exc = e
    finally:
        os.umask(prev)
        if fail:
            monkeypatch.setattr(os, fail, real)
    refused = ref_refusal(data)
    if temp_leftovers(folder):
        bad.append(f"{tag}: temporary files left {temp_leftovers(folder)}")
    if refused or fail:
        if refused and (rc != 2 or exc is not None):
            bad.append(f"{tag}: refusal ({refused}) gave rc {rc}, {exc!r}")
        if fail and not refused and not (isinstance(exc, OSError) and fail in str(exc)):
            bad.append(f"{tag}: failing {fail} gave rc {rc}, {exc!r}")
        now = open(out).read() if os.path.exists(out) else None
        if now != old:
            bad.append(f"{tag}: file holds {now!r:.60}, want the old {old!r}")
        elif old is not None and stat.S_IMODE(os.stat(out).st_mode) != mode_before:
            bad.append(f"{tag}: mode changed")
    else:
        if rc != 0 or exc is not None:
            return [f"{tag}: main gave rc {rc}, {exc!r}"]
        want = fit(data)
        got = VerifierModel.load(out)
        meta = dict(want.meta, embedder="mini-ü", embedder_weights="ab12")
        if (got.mean, got.scale, got.coef, got.intercept, got.cuts, got.guard_veto, got.meta) \
                != (want.mean, want.scale, want.coef, want.intercept, want.cuts, True, meta):
            bad.append(f"{tag}: the file is not fit(data) as written")
        mode = stat.S_IMODE(os.stat(out).st_mode)
        if mode != (mode_before if old is not None else 0o666 & ~umask):
            bad.append(f"{tag}: mode {oct(mode)}")
    if old is not None and link:
        if open(os.path.join(folder, "target")).read() != old:
            bad.append(f"{tag}: the link's target was written")
        if os.path.islink(out) == (not (refused or fail)):
            bad.append(f"{tag}: link {'kept' if os.path.islink(out) else 'replaced'}")
        os.unlink(os.path.join(folder, "target"))
    if os.path.lexists(out):
        os.unlink(out)
    return bad


def corrupt(text: str, r: random.Random) -> tuple[str, str]:
    """(kind, text) of a damaged weights file; kind is what load must do."""
    d = json.loads(text)
    kind = r.choice(["cut", "missing", "length", "stale", "nan", "scale", "cutstr", "extra",
                     "optional"])
    if kind == "cut":
        return "value", text[:r.randrange(len(text.rstrip()))]
    if kind == "missing":
        del d[r.choice(["features", "mean", "scale", "coef", "intercept", "cuts"])]
    elif kind == "length":
        k = r.choice(["mean", "scale", "coef"])
        d[k] = d[k][:-1] if r.random() < 0.5 else d[k] + [0.0]
    elif kind == "stale":
        f = list(d["features"])
        if r.random() < 0.5:
            f.pop(r.randrange(len(f)))
        else:
            i = r.randrange(len(f) - 1)
            f[i], f[i + 1] = f[i + 1], f[i]
        d["features"] = f
        kind = "stale"
    elif kind == "nan":
        bad = r.choice([float("nan"), float("inf"), -float("inf")])
        k = r.choice(["mean", "scale", "coef", "intercept", "cuts"])
        if k == "intercept":
            d[k] = bad
        elif k == "cuts":
            d[k][r.choice(list(d[k]))] = bad
        else:
            d[k][r.randrange(NF)] = bad
    elif kind == "scale":
        d["scale"][r.randrange(NF)] = r.choice([0.0, -0.0, -1.0])
    elif kind == "cutstr":
        d["cuts"] = r.choice([[0.5], "0.5", {"strict": "high"}, {"strict": None}])
    elif kind == "extra":
        d["note"] = "ü"
        return "ok", json.dumps(d)
    elif kind == "optional":
        d.pop("guard_veto", None)
        d.pop("meta", None)
        return "ok", json.dumps(d)
    return ("stale" if kind == "stale" else "value"), json.dumps(d)


def load_divergences(tag: str, model: VerifierModel, folder, r: random.Random) -> list[str]:
    path = os.path.join(folder, "damaged.json")
    kind, text = corrupt(model.to_json() + "\n", r)
    write_weights(path, text)
    try:
        got = VerifierModel.load(path)
    except StaleVerifier:
        return [] if kind == "stale" else [f"{tag}: {kind} file read as stale"]
    except ValueError as e:
        msg = str(e)
        if kind != "value":
            return [f"{tag}: {kind} file refused: {msg:.120}"]
        if not (msg.startswith(f"{path}: not usable verifier weights") and
                f"fit_verifier --out {path}" in msg):
            return [f"{tag}: refusal names neither file nor way out: {msg:.160}"]
        return []
    except Exception as e:  # noqa: BLE001
        return [f"{tag}: {kind} file raised {e!r}"]
    if kind != "ok":
        return [f"{tag}: {kind} file loaded: cuts {got.cuts}"]
    if (got.mean, got.scale, got.coef, got.intercept, got.cuts) != \
            (model.mean, model.scale, model.coef, model.intercept, model.cuts):
        return [f"{tag}: the fields did not come back"]
    if not got.guard_veto:
        return [f"{tag}: guard_veto defaulted off"]
    return []


# ---- one seed -----------------------------------------------------------------------------

def check_seed(seed: int, feats, folder, monkeypatch) -> list[str]:
    r = np.random.default_rng(seed)
    rr = random.Random(seed)
    data = random_table(r)
    tag = f"seed {seed} (n={len(data.y)})"
    refused = ref_refusal(data)
    try:
        with np.errstate(all="ignore"):
            model = fit(data)
    except ValueError as e:
        bad = [] if refused else [f"{tag}: refused: {e}"]
        if refused == "labels" and "both" not in str(e):
            bad.append(f"{tag}: the refusal does not say why: {e}")
    except Exception as e:  # noqa: BLE001
        return [f"{tag}: fit raised {e!r} (want {'a refusal' if refused else 'a model'})"]
    else:
        if refused:
            return [f"{tag}: fitted (intercept {model.intercept}, cuts {model.cuts}), "
                    f"want a refusal ({refused})"]
        bad = fit_divergences(tag, data, model)
        bad += served_divergences(tag, model, feats, rr)
        bad += load_divergences(tag, model, folder, rr)
    if seed % 3 == 0:
        bad += main_seed(tag, data, folder, rr, monkeypatch)
    return bad


def test_fit_write_load_and_serve_follow_the_model(text_features, tmp_path, monkeypatch):
    bad = []
    for seed in range(SEEDS):
        bad += check_seed(seed, text_features, tmp_path, monkeypatch)
    assert not bad, f"{len(bad)} divergences, e.g.:\n" + "\n".join(bad[:8])


def test_the_tables_reach_the_edges():
    """The generator reaches the cases the model singles out (else the run checks less)."""
    kinds = set()
    for seed in range(SEEDS):
        data = random_table(np.random.default_rng(seed))
        kinds.add(ref_refusal(data))
        if len(data.y) == 0:
            kinds.add("empty")
    assert {None, "labels"} <= kinds, kinds

