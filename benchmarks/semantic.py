"""Semantic tier benchmark (issue 5).

    python -m benchmarks.semantic [--quick] [--out-dir DIR]
        [--parts embed,quality,chinese,latency,ef_sweep,exporters]
        ->  benchmarks/results/semantic.json (+ semantic_pr.png, semantic_table.md)

`--out-dir` writes those files to DIR instead (and keeps the parts not run from DIR's file),
so a trial run leaves the committed results alone.

`--parts` runs a subset (e.g. `--parts latency` on a quiet machine, `--parts quality` anywhere:
precision does not depend on load) and keeps the other parts' figures from the existing file;
`part_runs` records when each part last ran and the load average then.

1. embed    — ONNX Runtime vs the torch model: batch-1 latency, sentences/s at batch 32, cosine.
2. quality  — per tier, on QQP pairs (hits among duplicates vs non-duplicates) and PAWS
              non-paraphrases (false-hit rate): similarity only, + the hand-made guard, + the
              learned verifier (out-of-sample: 5-fold cross-validation, weights and cuts fitted
              without the scored fold, folds grouped so that no test pair shares a sentence
              with a training pair; per-pair folds reported beside for comparison); QQP label
              noise counted; a precision-recall plot.
3. chinese  — Chinese STS-B with the configured (English) model.
4. latency  — 10k and 100k entries in one namespace (QQP questions padded with synthetic ones),
              looked up through the gRPC API of a real `python -m services.semantic` process:
              p50/p99 excluding embedding, p50 including it, and recall@1 of the index against
              exact search on near-duplicate queries.
5. ef_sweep — the HNSW index of the 100k entries built in this process (the service's own
              `NamespaceIndex`, its configured M and efConstruction): per efSearch, search time
              and recall@1 against exact search on the latency part's near-duplicate queries and
              on harder ones (an indexed question with a word dropped and two words swapped),
              counted where the exact best similarity reaches the draft floor. It is what the
              configured efSearch is chosen from.
6. exporters — the model exported by each ONNX exporter (`TIERCACHE_SEMANTIC_ONNX_EXPORTER`:
              torch's legacy tracer, the default, and the dynamo exporter), run by ONNX Runtime
              as the service runs it: batch-1 p50 and sentences/s at batch 32 (in alternating
              blocks), and how far apart their vectors are.

`--quick` runs a reduced version (subsets, 5k entries) in under 3 minutes and writes
`semantic_quick.json`. Data are read from ../shared/data (never copied into the repository).

Every figure but the latency part's is the default configuration's: tiers strict 0.97,
standard 0.95, relaxed 0.90, the default guard and verifier tiers, the packaged model.
`TIERCACHE_SEMANTIC_*` settings are not read (a note names those set); to choose other
thresholds, read `quality.curve` (QQP precision / recall and the PAWS false-hit rate every
0.005 from 0.80 to 1.00, similarity alone and with the guard; the verifier's cuts are per tier,
not on it). Pairs of one's own, scored by a running shard under its settings:
`python -m benchmarks.semantic_pairs` (services/semantic/README.md, "Tuning the thresholds").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from benchmarks import cpu_model, plaintext_env
from benchmarks.emit import verdicts
from services.semantic.config import SemanticConfig, default_cache_dir
from services.semantic.embedder import OnnxEmbedder
from services.semantic.fit_verifier import (
    PairSet,
    _sentence_key,
    cross_validate,
    featurise,
    fold_of_each_pair,
    sentence_groups,
)
from services.semantic.guard import ParaphraseGuard, spelling_differs
from services.semantic.labelled_data import (  # noqa: F401 (re-exported for older callers)
    DATA,
    embed_all,
    load_paws,
    load_qqp,
    load_stsb_zh,
)
from services.semantic.policy import HIT_TOLERANCE
from services.semantic.verifier import FEATURES, Verifier, _text

ROOT = Path(__file__).resolve().parents[1]
# Scores within this of the exact search's best are its top entry too (recall@1, in the
# latency part and the efSearch sweep alike).
TIED = 1e-5
RESULTS = Path(__file__).resolve().parent / "results"
TIERS = {"strict": 0.97, "standard": 0.95, "relaxed": 0.90}
# Latency is timed in the default tier, whose candidates the verifier and guard check (the
# relaxed tier skips that work).
LATENCY_TIER = "standard"


def log(msg: str) -> None:
    print(f"[semantic-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


# ---- 1. embedding speed ---------------------------------------------------------------------

def _seconds(fn, batch: list[str]) -> float:
    """Wall time of one `fn(batch)`."""
    t0 = time.perf_counter()
    fn(batch)
    return time.perf_counter() - t0


EMBED_ROUNDS = 3  # rounds of A B B A blocks in bench_embed


def bench_embed(emb: OnnxEmbedder, model_dir: str, texts: list[str], reps: int) -> dict:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok.enable_truncation(emb.max_seq_length)
    tok.enable_padding()
    model = AutoModel.from_pretrained(model_dir).eval()

    def torch_embed(batch: list[str]) -> np.ndarray:
        enc = tok.encode_batch(batch)
        ids = torch.tensor([e.ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        types = torch.tensor([e.type_ids for e in enc])
        with torch.inference_mode():
            h = model(input_ids=ids, attention_mask=mask, token_type_ids=types)[0]
            m = mask.unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(v, dim=1).numpy()

    def timed(fn, batch: list[str], n: int) -> list[float]:
        fn(batch)
        return [_seconds(fn, batch) for _ in range(n)]

    # In blocks, order A B B A, so that background load hits both alike. Interleaved call by
    # call (as this once did), ONNX Runtime's threads still spin after each call while torch
    # runs: both slowed, ONNX to 2.4x its time, and the ratio read 1.8 to 3.6 run to run.
    # Three rounds of A B B A: one round's ratio moved 2.36-2.58 from run to run on the 2-core
    # Xeon host (the torch p50 drifting 4.8-5.2 ms); each round's own ratio is reported.
    runs = {"onnx": emb.embed, "torch": torch_embed}
    b1: dict[str, list[float]] = {k: [] for k in runs}
    b32: dict[str, list[float]] = {k: [] for k in runs}
    n32 = 10 if reps > 50 else 3
    by_round = []
    for _ in range(EMBED_ROUNDS):
        r1: dict[str, list[float]] = {k: [] for k in runs}
        for k in ("onnx", "torch", "torch", "onnx"):
            timed(runs[k], [texts[0]], 0)  # warm
            r1[k] += [_seconds(runs[k], [t]) for t in texts[:max(1, reps // 2)]]
            b32[k] += [_seconds(runs[k], texts[32 * i:32 * (i + 1)])
                       for i in range(n32 // 2 or 1)]
        by_round.append(round(pct(r1["torch"], 50) / pct(r1["onnx"], 50), 3))
        for k in runs:
            b1[k] += r1[k]
    b1_onnx, b1_torch, b32_onnx, b32_torch = b1["onnx"], b1["torch"], b32["onnx"], b32["torch"]
    sample = texts[:256]
    cos = (embed_all(emb, sample, 32) * np.concatenate(
        [torch_embed(sample[i:i + 32]) for i in range(0, len(sample), 32)])).sum(1)
    onnx_b1, torch_b1 = pct(b1_onnx, 50) * 1000, pct(b1_torch, 50) * 1000
    return {
        "onnx_batch1_p50_ms": onnx_b1, "torch_batch1_p50_ms": torch_b1,
        "embed_speedup_onnx_over_torch": torch_b1 / onnx_b1,
        "embed_speedup_by_round": by_round,
        "onnx_sentences_per_s_batch32": 32 / pct(b32_onnx, 50),
        "torch_sentences_per_s_batch32": 32 / pct(b32_torch, 50),
        "speedup_batch32": pct(b32_torch, 50) / pct(b32_onnx, 50),
        "cosine_onnx_vs_torch_min": float(cos.min()),
        "cosine_onnx_vs_torch_mean": float(cos.mean()),
        "pairs": len(sample), "batch1_runs": len(b1_onnx),
        "quantized": False,
        "torch": "transformers AutoModel fp32 + mean pooling + L2 norm, same tokenizer",
    }


# ---- 2. quality -----------------------------------------------------------------------------

def _reaches(sim: np.ndarray, th: float) -> np.ndarray:
    """Where a similarity reaches threshold `th` as the served policy decides a hit
    (`ThresholdPolicy.decide`: inclusive, within `HIT_TOLERANCE` below, in float64). `sim >=
    th` on the float32 similarities compared in float32 (numpy's rule for a Python float),
    and in float64 against the curve's thresholds: a similarity at or just under a threshold
    the service serves was a miss, and the curve and the tier rows at one threshold disagreed
    (0.95 and 0.90 round down in float32, 0.97 up)."""
    return np.asarray(sim, np.float64) >= float(th) - HIT_TOLERANCE


def _pr(sim: np.ndarray, guard_ok: np.ndarray, labels: np.ndarray, th: float,
        guard: bool) -> tuple[float, float, int, int]:
    hit = _reaches(sim, th) & (guard_ok if guard else True)
    tp = int((hit & (labels == 1)).sum())
    fp = int((hit & (labels == 0)).sum())
    prec = tp / (tp + fp) if tp + fp else float("nan")
    return prec, tp / max(1, int((labels == 1).sum())), tp, fp


def _curve(qs: np.ndarray, qg: np.ndarray, ql: np.ndarray, ps: np.ndarray, pg: np.ndarray,
           pl: np.ndarray, q_spell: np.ndarray, p_spell: np.ndarray) -> list[dict]:
    """QQP precision/recall and the PAWS false-hit rate at thresholds 0.80-1.00, similarity
    only and with the guard. Each point with the spelling check every tier applies before a
    hit (`q_spell`/`p_spell`: True where it passes; the strict tier's stricter one is in its
    row only): without it the curve sat above the tier rows plotted on it (0.9331 against
    0.9316 at 0.97 with the guard)."""
    curve = []
    for th in np.round(np.arange(0.80, 1.0001, 0.005), 3):
        pt = {"threshold": float(th)}
        for g in (False, True):
            prec, rec, _, _ = _pr(qs, qg & q_spell if g else q_spell, ql, th, True)
            p0 = _reaches(ps, th) & p_spell & (pg if g else True)
            sfx = "_guard" if g else ""
            pt["precision" + sfx], pt["recall" + sfx] = prec, rec
            pt["paws_fhr" + sfx] = float(p0[pl == 0].mean())
        curve.append(pt)
    return curve


def _norm(t: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", t.lower()).strip()


def _content(t: str) -> tuple[str, ...]:
    """Content words (stop words dropped, plural -s stripped) in order."""
    return _text(t).content


def bench_quality(emb: OnnxEmbedder, qqp, paws, cfg: SemanticConfig, png: Path | None) -> dict:
    """Per tier: similarity only, + the hand-made guard, + the learned verifier.

    The verifier's figures are out-of-sample: 5-fold cross-validation over QQP + PAWS, each
    pair scored by weights and per-tier cuts fitted (`fit_verifier.fit`) on the other folds.
    The folds are grouped by `sentence_groups`: QQP and PAWS reuse sentences across pairs, and
    with folds drawn per pair (kept beside, `per_pair_folds`) most PAWS test pairs shared a
    sentence with training pairs.
    """
    guard = ParaphraseGuard()
    t0 = time.perf_counter()
    qa = embed_all(emb, [a for a, _, _ in qqp])
    qb = embed_all(emb, [b for _, b, _ in qqp])
    pa = embed_all(emb, [a for a, _, _ in paws])
    pb = embed_all(emb, [b for _, b, _ in paws])
    log(f"embedded {2 * (len(qqp) + len(paws))} sentences in {time.perf_counter() - t0:.0f}s")
    qs, ps = (qa * qb).sum(1), (pa * pb).sum(1)
    ql = np.array([y for _, _, y in qqp])
    pl = np.array([y for _, _, y in paws])
    # The cached text is the first of a pair, the incoming query the second.
    t0 = time.perf_counter()
    qg = np.array([guard.check(b, a).ok for a, b, _ in qqp])
    pg = np.array([guard.check(b, a).ok for a, b, _ in paws])
    # The check the served cache applies before a hit (what the uncased embedder cannot see:
    # indentation in every tier, case beyond a first letter and accents in the strict one).
    def spelling_ok(strict: bool) -> tuple[np.ndarray, np.ndarray]:
        return (np.array([not spelling_differs(b, a, strict) for a, b, _ in qqp], bool),
                np.array([not spelling_differs(b, a, strict) for a, b, _ in paws], bool))

    spelling = {True: spelling_ok(True), False: spelling_ok(False)}
    guard_us = (time.perf_counter() - t0) / (len(qqp) + len(paws)) * 1e6
    t0 = time.perf_counter()
    x = np.vstack([featurise([(a, b) for a, b, _ in qqp], qs),
                   featurise([(a, b) for a, b, _ in paws], ps)])
    feat_us = (time.perf_counter() - t0) / len(x) * 1e6
    data = PairSet(x, np.concatenate([ql, pl]),
                   np.concatenate([np.zeros(len(ql), bool), np.ones(len(pl), bool)]))
    nq = len(qqp)
    all_pairs = [(a, b) for a, b, _ in qqp] + [(a, b) for a, b, _ in paws]
    groups = sentence_groups(all_pairs)
    keys = [(_sentence_key(a), _sentence_key(b)) for a, b in all_pairs]

    def sharing(fold: np.ndarray) -> np.ndarray:
        """Pairs sharing a sentence (`_sentence_key`) with a pair of another fold."""
        folds_of: dict[str, set[int]] = {}
        for (ka, kb), f in zip(keys, fold, strict=True):
            folds_of.setdefault(ka, set()).add(int(f))
            folds_of.setdefault(kb, set()).add(int(f))
        return np.array([len(folds_of[ka] | folds_of[kb]) > 1 for ka, kb in keys], bool)

    cv: dict[tuple[str, int], tuple[np.ndarray, dict]] = {}
    leakage: dict[str, dict] = {}
    # seed 0 of the grouped split is reported; seeds 1 and 2 show how much the fold split
    # matters, and the per-pair split (the one used before) how much shared sentences did.
    for split, g in (("grouped", groups), ("per_pair", None)):
        for seed in (0, 1, 2):
            p, cuts = cross_validate(data, folds=5, seed=seed, groups=g)
            cv[split, seed] = ({t: (p >= c)[:nq] for t, c in cuts.items()},
                               {t: (p >= c)[nq:] for t, c in cuts.items()}, cuts)
        shared = sharing(fold_of_each_pair(len(all_pairs), 5, 0, g))
        leakage[split] = {"qqp_test_pairs_sharing_a_sentence_with_training": int(shared[:nq].sum()),
                          "paws_test_pairs_sharing_a_sentence_with_training":
                              int(shared[nq:].sum())}
    qv, pv, cuts0 = cv["grouped", 0]

    qsp = psp = None  # the current tier's spelling check (set in the loop below)

    def variant(th: float, qok: np.ndarray | None, pok: np.ndarray | None) -> dict:
        qhit = _reaches(qs, th) & qsp & (True if qok is None else qok)
        phit = _reaches(ps, th) & psp & (True if pok is None else pok)
        tp = int((qhit & (ql == 1)).sum())
        fp = int((qhit & (ql == 0)).sum())
        return {"qqp_precision": tp / (tp + fp) if tp + fp else float("nan"),
                "qqp_recall": tp / max(1, int((ql == 1).sum())), "qqp_true_hits": tp,
                "qqp_false_hits": fp,
                "paws_false_hit_rate": float(phit[pl == 0].mean()),
                "paws_paraphrase_hit_rate": float(phit[pl == 1].mean())}

    tiers = {}
    for name, th in TIERS.items():
        qsp, psp = spelling[name == "strict"]
        in_verifier = name in cfg.verifier_tiers and name in cfg.guard_tiers
        row = {"threshold": th, "guard_in_default_config": name in cfg.guard_tiers,
               "verifier_in_default_config": in_verifier,
               "default": "verifier" if in_verifier else (
                   "guard_on" if name in cfg.guard_tiers else "guard_off"),
               "guard_off": variant(th, None, None),
               "guard_on": variant(th, qg, pg),
               "verifier": variant(th, qg & qv[name], pg & pv[name])}
        row["verifier"]["cuts_per_fold"] = sorted({float(c) for c in cuts0[name]})
        def brief(split: str, seed: int, th: float = th, name: str = name) -> dict:
            q, w, _ = cv[split, seed]
            return {k: v for k, v in variant(th, qg & q[name], pg & w[name]).items()
                    if k in ("qqp_precision", "qqp_recall", "paws_false_hit_rate")}

        row["verifier"]["other_cv_splits"] = [brief("grouped", seed) for seed in (1, 2)]
        row["verifier"]["per_pair_folds"] = [brief("per_pair", seed) for seed in (0, 1, 2)]
        # Label noise: the non-duplicates this variant serves that are the same text up to
        # case/punctuation, or the same content words in the same order (they differ only in
        # function words: "How can I ..." / "How do I ...").
        for key, qok in (("guard_on", qg), ("verifier", qg & qv[name])):
            fp = np.where(_reaches(qs, th) & qsp & qok & (ql == 0))[0]
            same_text = sum(1 for i in fp if _norm(qqp[i][0]) == _norm(qqp[i][1]))
            same_content = sum(1 for i in fp if _content(qqp[i][0]) == _content(qqp[i][1]))
            r = row[key]
            r["false_hits_same_text"] = same_text
            r["false_hits_same_content_words"] = same_content
            r["qqp_precision_if_those_were_duplicates"] = (
                (r["qqp_true_hits"] + same_content) / max(1, r["qqp_true_hits"]
                                                          + r["qqp_false_hits"]))
            # The precision left if a second check removed every other false hit and no true
            # one. Not a ceiling: "same content words" ignores wh-words, modals, quantifiers
            # and pronouns ("Why did ..." / "When did ..."), which a check could still tell.
            r["qqp_precision_if_only_same_content_false_hits_remained"] = (
                r["qqp_true_hits"] / max(1, r["qqp_true_hits"] + same_content))
        tiers[name] = row
    # QQP labels are noisy: non-duplicates that are the same text up to case and punctuation.
    same_text_nondup = sum(1 for a, b, y in qqp if y == 0 and _norm(a) == _norm(b))
    same_content_nondup = sum(1 for a, b, y in qqp if y == 0 and _content(a) == _content(b))
    curve = _curve(qs, qg, ql, ps, pg, pl, *spelling[False])
    if png is not None:
        _plot(curve, tiers, png)
    return {
        "qqp_pairs": len(qqp), "qqp_duplicates": int(ql.sum()),
        "paws_pairs": len(paws), "paws_non_paraphrases": int((pl == 0).sum()),
        "paws_non_paraphrase_cosine_median": float(np.median(ps[pl == 0])),
        "paws_paraphrase_cosine_median": float(np.median(ps[pl == 1])),
        "qqp_duplicate_cosine_median": float(np.median(qs[ql == 1])),
        "qqp_non_duplicate_cosine_median": float(np.median(qs[ql == 0])),
        "qqp_non_duplicates_identical_up_to_case_and_punctuation": same_text_nondup,
        "qqp_non_duplicates_same_content_words": same_content_nondup,
        "qqp_duplicates_identical_up_to_case_and_punctuation": sum(
            1 for a, b, y in qqp if y == 1 and _norm(a) == _norm(b)),
        "guard_check_us_per_pair": guard_us,
        "verifier_features_us_per_pair": feat_us,
        "verifier": {"evaluation": "5-fold cross-validation over QQP + PAWS pairs (seed 0), "
                                   "folds grouped by connected component of shared sentences "
                                   "(fit_verifier.sentence_groups: no test pair shares a "
                                   "sentence with a training pair); weights and per-tier cuts "
                                   "fitted without the scored fold "
                                   "(services/semantic/fit_verifier.py); a hit needs the "
                                   "guard and P(same) >= the fold's cut. other_cv_splits: "
                                   "grouped seeds 1, 2; per_pair_folds: seeds 0-2 with folds "
                                   "drawn per pair (test pairs then share sentences with "
                                   "training pairs: leakage_seed0). The served verifier.json "
                                   "is fitted on all these pairs and is not what is scored.",
                     "sentence_groups": int(groups.max()) + 1 if len(groups) else 0,
                     "leakage_seed0": leakage,
                     "features": list(FEATURES)},
        "tiers": tiers, "curve": curve,
    }


_SUFFIX = {"guard_off": "", "guard_on": " +g", "verifier": " +v"}


def _plot(curve: list[dict], tiers: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    # every curve point with the spelling check every tier applies (`_curve`)
    for sfx, label, style in (("", "similarity (+ spelling check)", "--"),
                              ("_guard", "with guard (+ spelling check)", "-")):
        ax1.plot([p["recall" + sfx] for p in curve], [p["precision" + sfx] for p in curve],
                 style, label=label)
        ax2.plot([p["threshold"] for p in curve], [p["paws_fhr" + sfx] for p in curve],
                 style, label=label)
    for name, row in tiers.items():
        for key, mk in (("guard_off", "o"), ("guard_on", "s"), ("verifier", "^")):
            r = row[key]
            ax1.plot(r["qqp_recall"], r["qqp_precision"], mk, color="k", ms=4)
            ax1.annotate(name + _SUFFIX[key],
                         (r["qqp_recall"], r["qqp_precision"]), fontsize=7,
                         xytext=(3, 3), textcoords="offset points")
    ax1.set(xlabel="recall (QQP duplicates served)", ylabel="precision (QQP)",
            title="QQP precision-recall, threshold 0.80-1.00 (+v: verifier)", ylim=(0.6, 1.0))
    ax2.set(xlabel="similarity threshold", ylabel="false-hit rate",
            title="PAWS non-paraphrases served as hits")
    ax2.axhline(0.05, color="grey", lw=0.8, ls=":")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# ---- 3. Chinese -----------------------------------------------------------------------------

def _rank(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for v in np.unique(x):  # average ranks of ties
        m = x == v
        ranks[m] = ranks[m].mean()
    return ranks


def chinese_verdict(out: dict) -> str:
    """`bench_chinese`'s verdict in words. Its precision leaves out the pairs scored between 2
    and 4; the share of hits it calls wrong is of the rest, and the figure with those counted
    wrong is given beside it (it said "of its hits", which read as all of them)."""
    strict = out["tiers"].get("strict", {})
    return (
        f"Poor: the default model (all-MiniLM-L6-v2) is English. On Chinese it reads "
        f"{out['unknown_token_fraction']:.0%} of tokens as unknown, ranks pairs by meaning "
        f"weakly (Spearman {out['spearman']:.2f}), and in the strict tier about "
        f"{1 - strict.get('served_precision', 0.0):.0%} of its hits among pairs scored "
        "clearly alike (>= 4) or different (<= 2) are wrong (served precision "
        f"{strict.get('served_precision', 0.0):.2f}; "
        f"{strict.get('served_precision_mid_scores_wrong', 0.0):.2f} with the pairs scored "
        "between counted wrong). Serve Chinese traffic from "
        "the semantic tier only with a multilingual model (TIERCACHE_SEMANTIC_MODEL_DIR).")


def bench_chinese(emb: OnnxEmbedder, rows) -> dict:
    guard = ParaphraseGuard()
    a = embed_all(emb, [r[0] for r in rows])
    b = embed_all(emb, [r[1] for r in rows])
    sim = (a * b).sum(1)
    score = np.array([r[2] for r in rows])
    g = np.array([guard.check(r[1], r[0]).ok for r in rows])
    same, diff = score >= 4, score <= 2
    # Chinese characters are outside all-MiniLM-L6-v2's useful vocabulary: count [UNK]s.
    enc = emb._tok.encode_batch([r[0] for r in rows[:200]])
    unk = sum(e.ids.count(100) for e in enc) / max(1, sum(len(e.ids) - 2 for e in enc))
    out = {"pairs": len(rows), "same_meaning_pairs": int(same.sum()),
           "different_pairs": int(diff.sum()),
           "spearman": float(np.corrcoef(_rank(sim), _rank(score))[0, 1]),
           "cosine_median_same": float(np.median(sim[same])),
           "cosine_median_different": float(np.median(sim[diff])),
           "unknown_token_fraction": unk, "tiers": {}}
    cfg = SemanticConfig()
    verifier = Verifier()
    for name, th in TIERS.items():
        hit = _reaches(sim, th)
        # As served in the default config: the verifier (guard included) in its tiers, the
        # guard alone in the other guarded ones, similarity alone elsewhere.
        if name in cfg.verifier_tiers:
            ok = np.array([verifier.check(r[1], r[0], float(c), name).ok if h else False
                           for r, c, h in zip(rows, sim, hit, strict=True)])
        elif name in cfg.guard_tiers:
            ok = g
        else:
            ok = np.ones(len(rows), bool)
        served = hit & ok
        out["tiers"][name] = {
            # similarity alone
            "hit_rate_same_meaning": float(hit[same].mean()),
            "false_hit_rate_different": float(hit[diff].mean()),
            "false_hit_rate_different_guard_on": float((hit & g)[diff].mean()),
            "precision": float((hit & same).sum() / max(1, (hit & (same | diff)).sum())),
            # the default configuration's second check applied
            "served_check": ("verifier" if name in cfg.verifier_tiers
                             else "guard" if name in cfg.guard_tiers else "none"),
            "served_hit_rate_same_meaning": float(served[same].mean()),
            "served_false_hit_rate_different": float(served[diff].mean()),
            "served_precision": float((served & same).sum()
                                      / max(1, (served & (same | diff)).sum())),
            # Pairs scored between 2 and 4 counted as wrong too (the precision above leaves
            # them out of its denominator, which flatters it).
            "served_precision_mid_scores_wrong": float((served & same).sum()
                                                       / max(1, served.sum())),
        }
    out["note"] = ("hit_rate/false_hit_rate/precision: similarity alone; served_*: with the "
                   "default configuration's second check (verifier and guard, fitted and "
                   "written for English)")
    out["verdict"] = chinese_verdict(out)
    return out


# ---- 4. latency through gRPC ----------------------------------------------------------------

def _synthetic(questions: list[str], n: int, seed: int = 7) -> list[str]:
    """Question-like texts spliced from two real questions (distinct, plausible, seeded)."""
    rng = random.Random(seed)
    words = [q.rstrip("?").split() for q in questions if len(q.split()) >= 4]
    out, seen = [], set(questions)
    while len(out) < n:
        a, b = rng.choice(words), rng.choice(words)
        t = " ".join(a[:rng.randint(2, len(a) - 1)] + b[rng.randint(1, len(b) - 2):]) + "?"
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def _latency_corpus(qqp, size: int, n_queries: int, rng: random.Random
                    ) -> tuple[list[str], list[str], int, int]:
    """The latency part's entries and near-duplicate queries at `size` entries: (entries,
    queries, how many queries are QQP paraphrases (the rest are light edits), how many
    entries are real QQP questions (the rest are synthetic)). `rng` draws the queries: the
    latency part passes one generator through its sizes in turn."""
    dup_pairs = [(a, b) for a, b, y in qqp if y == 1 and a != b]
    # The paraphrase side of every duplicate pair is held out of the entries, so that at every
    # size half the queries are real QQP paraphrases of an indexed question (at 100k every
    # real question is indexed: without the hold-out none would be left to ask).
    held = {b for _, b in dup_pairs}
    real = [t for t in dict.fromkeys([a for a, _, _ in qqp] + [b for _, b, _ in qqp])
            if t not in held]
    base = real[:size] + _synthetic(real, max(0, size - len(real)))
    base = base[:size]
    present = set(base)
    # Near-duplicate queries: QQP paraphrases of indexed questions, plus light edits.
    queries = list(dict.fromkeys(b for a, b in dup_pairs if a in present and b not in present))
    edits = [q.lower().rstrip("?") + " please?" for q in rng.sample(base, min(len(base),
                                                                          n_queries))]
    n_para = min(len(queries), n_queries // 2)
    queries = rng.sample(queries, n_para) + edits[:n_queries - n_para]
    rng.shuffle(queries)
    return base, queries, n_para, min(size, len(real))


def _harder_queries(base: list[str], n: int, seed: int = 5) -> list[str]:
    """Indexed questions with one word dropped and two neighbouring words swapped."""
    rng = random.Random(seed)
    out = []
    for t in rng.sample(base, min(len(base), 2 * n)):
        w = t.split()
        if len(w) < 5:
            continue
        del w[rng.randrange(len(w))]
        j = rng.randrange(len(w) - 1)
        w[j], w[j + 1] = w[j + 1], w[j]
        out.append(" ".join(w))
        if len(out) == n:
            break
    return out


def bench_ef_sweep(emb: OnnxEmbedder, qqp, size: int, n_queries: int,
                   efs: tuple[int, ...] = (16, 24, 32, 48, 64, 128)) -> dict:
    from services.semantic.index import IndexParams, NamespaceIndex, set_search_threads

    cfg = SemanticConfig()
    base, near, _, _ = _latency_corpus(qqp, size, n_queries, random.Random(11))
    vecs = embed_all(emb, base)
    # HNSW at any size (the service builds it from hnsw_min_entries on; --quick's 5k entries
    # would otherwise be a flat index, with no efSearch to sweep).
    index = NamespaceIndex(IndexParams(dim=vecs.shape[1], hnsw_min_entries=0,
                                       hnsw_m=cfg.hnsw_m,
                                       hnsw_ef_construction=cfg.hnsw_ef_construction),
                           background=False)
    t0 = time.perf_counter()
    index.add_many(np.arange(size), vecs)
    build_s = time.perf_counter() - t0
    log(f"ef_sweep: built {index.kind} over {size} entries in {build_s:.0f}s")
    set_search_threads(cfg.faiss_threads)
    out: dict = {"entries": size, "index": index.kind, "hnsw_m": cfg.hnsw_m,
                 "hnsw_ef_construction": cfg.hnsw_ef_construction, "build_s": build_s,
                 "configured_ef_search": cfg.hnsw_ef_search, "sets": {}}
    main = index._snap.main
    for name, texts in (("near_duplicate", near), ("word_dropped_and_swapped",
                                                     _harder_queries(base, n_queries))):
        qv = embed_all(emb, texts)
        exact = (qv @ vecs.T).max(1)
        counted = exact >= cfg.draft_floor + 0.01
        rows = {}
        for ef in efs:
            if main is not None:
                main.hnsw.efSearch = ef
            times, agree = [], 0
            for rep in range(2):  # the first pass warms caches; the second is timed
                times = []
                for i, v in enumerate(qv):
                    t1 = time.perf_counter()
                    nb = index.search(v, 1)
                    times.append((time.perf_counter() - t1) * 1000)
                    if rep == 0 and counted[i]:
                        agree += int(bool(nb) and nb[0].score >= exact[i] - TIED)
            rows[str(ef)] = {"search_p50_ms": pct(times, 50), "search_p99_ms": pct(times, 99),
                             "recall_at_1_vs_exact": agree / max(1, int(counted.sum()))}
        out["sets"][name] = {"queries": len(texts), "recall_queries": int(counted.sum()),
                             "by_ef_search": rows}
        log(f"ef_sweep {name}: {json.dumps(rows)}")
    index.close()
    out["note"] = ("index.search in this process (no gRPC, no verifier): one thread, k=1; a hit "
                   "counts when the top score equals the exact best (1e-5)")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exact_top(scores: np.ndarray, pos: int | None) -> bool:
    """Whether entry `pos` (None: Lookup returned none) is a top entry of exact search over
    `scores` (the query's similarity to every entry): within TIED of the best, as `ef_sweep`
    counts. Compared by position with `argmax`, an entry tied with the first top one (the
    uncased embedder gives texts that differ only in case one vector) counted as a miss of
    the index."""
    return pos is not None and bool(scores[pos] >= scores.max() - TIED)


def bench_latency(emb: OnnxEmbedder, qqp, sizes: list[int], n_queries: int) -> dict:
    import grpc
    from tiercache.v1 import semantic_pb2 as pb
    from tiercache.v1 import semantic_pb2_grpc as pbg

    from services.launcher import wait_healthy
    from services.semantic.store import EntryStore

    cfg = SemanticConfig()
    rng = random.Random(11)  # one generator through the sizes, as the part always drew them
    results = {}
    for size in sizes:
        base, queries, n_para, n_real = _latency_corpus(qqp, size, n_queries, rng)
        t0 = time.perf_counter()
        vecs = embed_all(emb, base)
        embed_s = time.perf_counter() - t0
        log(f"{size}: embedded {size} entries in {embed_s:.0f}s")
        qv = embed_all(emb, queries)
        exact = qv @ vecs.T  # brute force reference
        exact_sim = exact.max(1)
        tmp = tempfile.mkdtemp(prefix="semantic-bench-")
        db = os.path.join(tmp, "semantic.db")
        store = EntryStore(db, "NORMAL")
        ids = [uuid.uuid4().hex for _ in base]
        now = time.time()
        store.insert_many([{"id": ids[i], "tenant": "bench", "model_id": "m", "context_hash": "",
                            "prompt": base[i], "answer": f"answer {i}", "embedding": vecs[i],
                            "embed_model": emb.identity, "verified": False,
                            "created_at": now, "ttl_seconds": 0} for i in range(size)])
        store.close()
        port = _free_port()
        env = dict(os.environ, TIERCACHE_SEMANTIC_ADDRESS=f"127.0.0.1:{port}",
                   TIERCACHE_SEMANTIC_METRICS_PORT="-1", TIERCACHE_SEMANTIC_DB_PATH=db,
                   TIERCACHE_SEMANTIC_SQLITE_SYNCHRONOUS="NORMAL", PYTHONPATH=str(ROOT),
                   **plaintext_env(os.environ))  # as the channel below speaks
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "services.semantic"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # Loading 100k entries took ~18 s.
            wait_healthy(f"127.0.0.1:{port}", 600, proc, env=env)
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
            start_s = time.perf_counter() - t0
            log(f"{size}: service loaded and indexed in {start_s:.1f}s")
            stub = pbg.SemanticCacheStub(ch)
            ns = pb.Namespace(tenant="bench", model_id="m")
            for q in queries[:20]:  # warm-up
                stub.Lookup(pb.LookupRequest(namespace=ns, text=q, tier=LATENCY_TIER), timeout=10)
            rtt, excl, search, handler, agree, counted = [], [], [], [], 0, 0
            id_pos = {sid: i for i, sid in enumerate(ids)}
            for qi, q in enumerate(queries):
                t1 = time.perf_counter()
                r = stub.Lookup(pb.LookupRequest(namespace=ns, text=q, tier=LATENCY_TIER,
                                                 want_draft=True), timeout=10)
                dt = (time.perf_counter() - t1) * 1000
                rtt.append(dt)
                excl.append(dt - r.embed_ms)
                search.append(r.search_ms)
                handler.append(r.handler_ms - r.embed_ms)
                if exact_sim[qi] >= cfg.draft_floor + 0.01:
                    counted += 1
                    pos = id_pos.get(r.entry.id) if r.HasField("entry") else None
                    agree += int(_exact_top(exact[qi], pos))
            stats = stub.Stats(pb.SemanticStatsRequest(), timeout=10)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        results[str(size)] = {
            "entries": int(stats.entries),
            "index": "hnsw" if size >= cfg.hnsw_min_entries else "flat",
            "queries": len(queries),
            "paraphrase_queries": n_para,  # QQP duplicates of an indexed question
            "edit_queries": len(queries) - n_para,  # an indexed text + " please?"
            "lookup_p50_ms": pct(excl, 50), "lookup_p99_ms": pct(excl, 99),
            "lookup_embed_p50_ms": pct(rtt, 50), "lookup_embed_p99_ms": pct(rtt, 99),
            "server_search_p50_ms": pct(search, 50), "server_search_p99_ms": pct(search, 99),
            # Where lookup_*_ms goes: inside the server's handler (minus embedding) vs gRPC
            # transport, thread hand-offs and scheduling between the two processes.
            "server_handler_excl_embed_p50_ms": pct(handler, 50),
            "server_handler_excl_embed_p99_ms": pct(handler, 99),
            "transport_p50_ms": pct(np.subtract(excl, handler), 50),
            "transport_p99_ms": pct(np.subtract(excl, handler), 99),
            "recall_at_1_vs_exact": agree / max(1, counted), "recall_queries": counted,
            "service_start_s": start_s, "entries_embed_s": embed_s,
            "real_questions": n_real,
            "synthetic_questions": size - n_real,
        }
        log(f"{size}: {json.dumps(results[str(size)])}")
    results["tier"] = LATENCY_TIER
    results["note"] = (f"Lookups in the {LATENCY_TIER} tier (the default: the verifier and guard "
                       "check its candidates). "
                       "lookup_*_ms = client round trip of Lookup minus the server's embed_ms "
                       "(gRPC + search + policy + verifier/guard); lookup_embed_* = full round "
                       "trip; "
                       "server_handler_excl_embed_* = the server's Lookup handler minus embed_ms, "
                       "transport_* = lookup_*_ms minus that (per query). "
                       f"hnsw: M={cfg.hnsw_m} efConstruction={cfg.hnsw_ef_construction} "
                       f"efSearch={cfg.hnsw_ef_search}; flat below {cfg.hnsw_min_entries}. "
                       "recall_at_1_vs_exact: the entry Lookup returns (hit or draft) is a "
                       f"top entry of exact search (one tied with it within {TIED:g} counts), "
                       "over "
                       "the recall_queries whose exact best "
                       "similarity is at least the draft floor + 0.01 "
                       f"({cfg.draft_floor + 0.01:.2f}; below the floor Lookup returns no "
                       "entry); a hit on an entry further "
                       "down, after the top one was refused, counts as a miss. "
                       "Lookups only, no Store meanwhile: entries are written to SQLite and "
                       "indexed at start, so the write buffer is empty and no background merge "
                       "runs (the best case; under steady stores a lookup also scans the buffer "
                       "exactly, and a merge competes for the cores).")
    return results


# ---- targets and output ---------------------------------------------------------------------

# The targets, in the order the result lists them.
TARGETS = {"lookup_p50_ms@100k": ("<=", 2.0), "lookup_p99_ms@100k": ("<=", 6.0),
           "lookup_embed_p50_ms@100k": ("<=", 8.0), "recall_at_1_vs_exact@100k": (">=", 0.98),
           "embed_speedup_onnx_over_torch": (">=", 2.5),
           "cosine_onnx_vs_torch_min": (">=", 0.9999),
           "strict_paws_false_hit_rate": ("<=", 0.05), "strict_qqp_precision": (">=", 0.97),
           "standard_qqp_precision": (">=", 0.92)}


def targets(res: dict) -> dict:
    """The targets of the parts `res` holds, judged by the shared `verdicts`."""
    got = {}
    lat = res.get("latency", {}).get("100000")
    if lat:
        for k in ("lookup_p50_ms", "lookup_p99_ms", "lookup_embed_p50_ms",
                  "recall_at_1_vs_exact"):
            got[f"{k}@100k"] = lat[k]
    e = res.get("embed")
    if e:
        got["embed_speedup_onnx_over_torch"] = e["embed_speedup_onnx_over_torch"]
        got["cosine_onnx_vs_torch_min"] = e["cosine_onnx_vs_torch_min"]
    q = res.get("quality", {}).get("tiers")
    if q:
        # Each tier is judged as the default configuration serves it.
        strict = q["strict"][q["strict"].get("default", "guard_on")]
        std = q["standard"][q["standard"].get("default", "guard_on")]
        got["strict_paws_false_hit_rate"] = strict["paws_false_hit_rate"]
        got["strict_qqp_precision"] = strict["qqp_precision"]
        got["standard_qqp_precision"] = std["qqp_precision"]
    out = verdicts({k: v for k, v in TARGETS.items() if k in got}, got)
    if q:
        # The issue sets one strict-tier target: the false-hit rate *with* that precision. A
        # low false-hit rate at a precision short of 0.97 is not it met (it counted as met).
        paws = out["strict_paws_false_hit_rate"]
        paws["target"] += " with strict_qqp_precision >= 0.97"
        paws["met"] = paws["met"] and out["strict_qqp_precision"]["met"]
    return out


def table(res: dict) -> str:
    lines = ["| tier | threshold | second check | QQP precision | QQP recall "
             "| QQP hits (true/false) | PAWS false-hit rate | PAWS paraphrase hit rate |",
             "|---|---|---|---|---|---|---|---|"]
    names = {"guard_off": "none", "guard_on": "old guard", "verifier": "new verifier"}
    for name, row in res["quality"]["tiers"].items():
        for key in ("guard_off", "guard_on", "verifier"):
            if key not in row:
                continue
            r = row[key]
            mark = " (default)" if row.get("default") == key else ""
            lines.append(f"| {name} | {row['threshold']:.2f} | {names[key]}{mark} | "
                         f"{r['qqp_precision']:.3f} | {r['qqp_recall']:.3f} | "
                         f"{r['qqp_true_hits']}/{r['qqp_false_hits']} | "
                         f"{r['paws_false_hit_rate']:.3f} | {r['paws_paraphrase_hit_rate']:.3f} |")
    return "\n".join(lines) + "\n"


PARTS = ("embed", "quality", "chinese", "latency", "ef_sweep", "exporters")


def bench_exporters(cfg: SemanticConfig, texts: list[str], reps: int) -> dict:
    """Both ONNX exporters' graphs, timed alike (exports to the default cache if missing)."""
    embs = {x: OnnxEmbedder(cfg.resolved_model_dir(), default_cache_dir(),
                            cfg.resolved_model_name(), exporter=x)
            for x in ("torchscript", "dynamo")}
    b1: dict[str, list[float]] = {x: [] for x in embs}
    b32: dict[str, list[float]] = {x: [] for x in embs}
    # In blocks, order A B B A: interleaved call by call, each session's threads would still
    # be spinning (the service's setting) while the other one runs, slowing both.
    for x in ("torchscript", "dynamo", "dynamo", "torchscript"):
        e = embs[x]
        e.embed(texts[:32])  # warm
        b1[x] += [_seconds(e.embed, [t]) for t in texts[:reps // 2]]
        b32[x] += [_seconds(e.embed, texts[32 * i:32 * (i + 1)])
                   for i in range(5 if reps > 50 else 2)]
    sample = texts[:256]
    a, b = (embed_all(embs[x], sample, 32) for x in ("torchscript", "dynamo"))
    out: dict = {x: {"batch1_p50_ms": pct(b1[x], 50) * 1000,
                     "batch1_p99_ms": pct(b1[x], 99) * 1000,
                     "sentences_per_s_batch32": 32 / pct(b32[x], 50)} for x in embs}
    out.update({
        "dynamo_over_torchscript_batch1_p50": out["dynamo"]["batch1_p50_ms"]
        / out["torchscript"]["batch1_p50_ms"],
        "max_abs_difference": float(np.abs(a - b).max()),
        "cosine_min": float((a * b).sum(1).min()), "sentences": len(sample),
        "batch1_runs": len(b1["dynamo"]),
    })
    return out


def settings_not_read(environ) -> list[str]:
    """The `TIERCACHE_SEMANTIC_*` variables set in `environ`: the in-process parts measure the
    default configuration (`TIERS`, the default guard and verifier tiers, the packaged model)
    and read none of them. A user tuning thresholds exported TIERCACHE_SEMANTIC_TIER_STRICT=0.98
    and got the 0.97 row, without a word; only the latency part's service process reads them."""
    return sorted(k for k in environ if k.startswith("TIERCACHE_SEMANTIC_"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.semantic",
        epilog="Figures are the default configuration's (tiers "
               f"{', '.join(f'{t} {v:.2f}' for t, v in TIERS.items())}): "
               "TIERCACHE_SEMANTIC_* settings are not read; quality.curve in "
               "the results file gives other thresholds'. Data: TIERCACHE_DATA_DIR, else "
               "../shared/data. The module docstring says more.")
    ap.add_argument("--quick", action="store_true", help="reduced run (< 3 minutes)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)}; parts not run keep "
                         "their figures from the existing results file (default: all)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS,
                    help="folder of the results file, plot and table (default: "
                         "benchmarks/results; another keeps the committed ones as they are)")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; expected some of {', '.join(PARTS)}")
    quick = args.quick
    ignored = settings_not_read(os.environ)
    if ignored:
        log(f"note: {', '.join(ignored)} not read: the figures are the default configuration's "
            f"(tiers {', '.join(f'{t} {v:g}' for t, v in TIERS.items())}); for other thresholds "
            "read quality.curve (every 0.005 from 0.80), and only the latency part's service "
            "process takes these settings")
    cfg = SemanticConfig()
    t_all = time.perf_counter()
    emb = OnnxEmbedder(cfg.resolved_model_dir(), default_cache_dir(), cfg.resolved_model_name())
    qqp, paws, zh = load_qqp(), load_paws(), load_stsb_zh()
    sfx = "_quick" if quick else ""
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)  # the quality part writes its plot there
    out = out_dir / f"semantic{sfx}.json"
    res: dict = json.loads(out.read_text()) if out.is_file() and len(parts) < len(PARTS) else {}
    res.update({"quick": quick, "model": cfg.resolved_model_name(), "cpu_count": os.cpu_count(),
                "data": str(DATA)})
    res.pop("targets", None)
    if quick:
        rng = random.Random(3)
        qqp_q, paws_q, zh_q = rng.sample(qqp, 1000), rng.sample(paws, 800), zh[:300]
    else:
        qqp_q, paws_q, zh_q = qqp, paws, zh
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = res.setdefault("part_runs", {})
    if "embed" in parts:
        log("embedding speed: ONNX vs torch")
        res["embed"] = bench_embed(emb, cfg.resolved_model_dir(), [a for a, _, _ in qqp],
                                   30 if quick else 300)
        log(json.dumps(res["embed"]))
    if "quality" in parts:
        log("quality: QQP / PAWS per tier")
        png = out_dir / f"semantic{sfx}_pr.png"
        res["quality"] = bench_quality(emb, qqp_q, paws_q, cfg, png)
    if "chinese" in parts:
        log("Chinese STS-B")
        res["chinese_stsb"] = bench_chinese(emb, zh_q)
        log(json.dumps(res["chinese_stsb"]))
    if "latency" in parts:
        log("latency through gRPC")
        res["latency"] = bench_latency(emb, qqp, [5_000] if quick else [10_000, 100_000],
                                       200 if quick else 1000)
    if "ef_sweep" in parts:
        log("HNSW efSearch sweep")
        res["ef_sweep"] = bench_ef_sweep(emb, qqp, 5_000 if quick else 100_000,
                                         200 if quick else 1000)
    if "exporters" in parts:
        log("ONNX exporters: traced vs dynamo")
        res["exporters"] = bench_exporters(cfg, [a for a, _, _ in qqp], 30 if quick else 300)
        log(json.dumps(res["exporters"]))
    for p in parts:
        # The host with the time: parts kept from an earlier run may come from another
        # machine (search and loopback gRPC took twice as long on a 2-core AMD EPYC as on
        # the 2-core Intel Xeon before it, the same code).
        runs[p] = {"at": stamp, "load_average_1m": os.getloadavg()[0], "cpu_model": cpu_model()}
    res["targets"] = targets(res)
    res["wall_s"] = time.perf_counter() - t_all
    out.write_text(json.dumps(res, indent=1))
    if "quality" in res:
        (out_dir / f"semantic{sfx}_table.md").write_text(table(res))
        print(table(res))
    for name, t in res["targets"].items():
        print(f"{name}: {t['value']:.4g} (target {t['target']}) {'met' if t['met'] else 'NOT met'}")
    print(f"wrote {out} in {res['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
