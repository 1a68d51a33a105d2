"""Rules of `services/semantic/fit_verifier.py` a mutation audit found unchecked: how a tier's
cut is chosen (the procedure in the module's docstring: the tier's guarded pairs, the
`MIN_KEEP` floor, goal + `GOAL_MARGIN`, the PAWS false-hit rate over every PAWS
non-paraphrase, the best precision when no cut reaches the goal, a cut of 0 allowed), which
pairs train the weights and how PAWS pairs weigh, each tier's cut in cross-validation, and what
`main` writes where, with what mode; and the grouping that keeps a sentence's pairs in one
cross-validation fold."""

from __future__ import annotations

import dataclasses
import json
import os
import stat

import numpy as np
import pytest

from services.semantic import fit_verifier
from services.semantic.fit_verifier import (
    L2,
    MIN_KEEP,
    PAWS_WEIGHT,
    TRAIN_FLOOR,
    PairSet,
    _choose_cut,
    cross_validate,
    fit,
    fold_of_each_pair,
    sentence_groups,
    write_weights,
)
from services.semantic.verifier import FEATURES, VerifierModel, fit_logistic

GUARD = FEATURES.index("guard_ok")


def _pairs(rows: list[tuple[float, int, int, bool, float]]) -> tuple[np.ndarray, PairSet]:
    """(P(same), label, guard_ok, paws, cosine) per pair -> (p, PairSet)."""
    x = np.zeros((len(rows), len(FEATURES)))
    x[:, 0] = [r[4] for r in rows]
    x[:, GUARD] = [r[2] for r in rows]
    data = PairSet(x, np.array([r[1] for r in rows]), np.array([r[3] for r in rows]))
    return np.array([r[0] for r in rows]), data


def qqp(n: int, p: float, label: int, cos: float = 0.99, guard: int = 1):
    return [(p, label, guard, False, cos)] * n


def paws(n: int, p: float, label: int = 0, cos: float = 0.99, guard: int = 1):
    return [(p, label, guard, True, cos)] * n


def test_a_cut_of_zero_is_chosen_when_every_pair_already_meets_the_goal():
    """The smallest cut that reaches the goal: 0 (the guard alone) when the tier's pairs are
    precise enough as they are."""
    p, data = _pairs(qqp(20, 0.305, 1))
    assert _choose_cut(p, data, 0.95, 0.9) == 0.0


def test_the_goal_is_reached_with_the_margin_not_at_the_goal():
    """Training precision must reach goal + GOAL_MARGIN: 90 true hits of 100 (precision 0.90,
    the goal) is not enough; the first cut that drops a false hit is chosen."""
    p, data = _pairs(qqp(90, 0.505, 1) + qqp(9, 0.505, 0) + qqp(1, 0.005, 0))
    assert _choose_cut(p, data, 0.95, 0.9) == 0.01


def test_a_cut_keeping_exactly_min_keep_of_the_hits_may_be_chosen():
    """A cut is a candidate while it keeps at least MIN_KEEP of the tier's true hits: 8 of 10
    is enough at MIN_KEEP 0.8."""
    assert MIN_KEEP == 0.8
    p, data = _pairs(qqp(2, 0.105, 1) + qqp(8, 0.905, 1) + qqp(3, 0.505, 0))
    assert _choose_cut(p, data, 0.95, 0.95) == 0.51


def test_without_a_cut_reaching_the_goal_the_most_precise_is_chosen():
    """Precision 0.77 up to 0.05, 0.91 at 0.06, 0.90 from 0.07: 0.06 is chosen."""
    p, data = _pairs(qqp(1, 0.065, 1) + qqp(9, 0.905, 1) + qqp(2, 0.055, 0) + qqp(1, 0.955, 0))
    assert _choose_cut(p, data, 0.95, 0.99) == 0.06


def test_a_paws_false_hit_rate_of_five_percent_is_accepted():
    """The PAWS false-hit rate may reach 5%: 1 of 20 PAWS non-paraphrases kept at 0.06."""
    p, data = _pairs(qqp(10, 0.905, 1) + paws(19, 0.055) + paws(1, 0.905))
    assert _choose_cut(p, data, 0.95, 0.5) == 0.06


def test_the_paws_false_hit_rate_counts_every_paws_non_paraphrase():
    """The rate is over every PAWS non-paraphrase, as the benchmark reports it (a pair below
    the tier's threshold counts as one not served): 2 kept of 40 is 5%, not 2 of the 20 in
    the tier."""
    p, data = _pairs(qqp(10, 0.905, 1) + paws(18, 0.055) + paws(2, 0.905)
                     + paws(20, 0.905, cos=0.5))
    assert _choose_cut(p, data, 0.95, 0.5) == 0.06


def test_a_tiers_pairs_are_those_at_or_above_its_threshold_that_the_guard_passes():
    """False hits at exactly the tier's threshold count (a hit needs cosine >= threshold); ones
    the guard vetoes do not (the guard refuses them before the verifier)."""
    p, data = _pairs(qqp(10, 0.905, 1) + qqp(10, 0.505, 0, cos=0.95))
    assert _choose_cut(p, data, 0.95, 0.9) == 0.51
    p, data = _pairs(qqp(10, 0.905, 1) + qqp(10, 0.505, 0, guard=0))
    assert _choose_cut(p, data, 0.95, 0.9) == 0.0


def _training_data() -> PairSet:
    rng = np.random.default_rng(3)
    n = 400
    x = np.zeros((n, len(FEATURES)))
    y = rng.integers(0, 2, n)
    x[:, 0] = np.round(0.85 + 0.15 * rng.random(n), 3)
    x[:40, 0] = TRAIN_FLOOR  # at the floor: trained on
    x[:, GUARD] = (rng.random(n) < 0.8).astype(float)
    x[:, FEATURES.index("content_jaccard")] = np.where(y == 1, 0.7, 0.4) + 0.3 * rng.random(n)
    return PairSet(x, y, rng.random(n) < 0.4)


def test_the_weights_are_fitted_on_guarded_pairs_from_the_floor_with_paws_weighed_down():
    """Training pairs: cosine >= TRAIN_FLOOR and the guard passes; PAWS pairs weigh
    PAWS_WEIGHT, QQP pairs 1 (step 1 and 2 of the procedure)."""
    data = _training_data()
    model = fit(data)
    keep = (data.x[:, 0] >= TRAIN_FLOOR) & (data.x[:, GUARD] > 0)
    assert model.meta["train_pairs"] == int(keep.sum())
    train = data.subset(keep)
    mean, scale, coef, b = fit_logistic(train.x, train.y.astype(np.float64), L2,
                                        np.where(train.paws, PAWS_WEIGHT, 1.0))
    np.testing.assert_allclose(model.coef, coef, rtol=1e-12)
    assert model.intercept == pytest.approx(b, rel=1e-12)


def test_cross_validation_gives_each_tier_its_own_folds_cut():
    """Each tier's cut, per pair, is the one its held-out model chose for that tier."""
    data = _training_data()
    _, cuts = cross_validate(data, folds=3, seed=1)
    fold = np.random.default_rng(1).integers(0, 3, len(data.y))
    seen = set()
    for k in range(3):
        held_out = fit(data.subset(fold != k))
        for tier, c in cuts.items():
            assert np.all(c[fold == k] == held_out.cuts[tier]), (k, tier)
        seen.add(tuple(held_out.cuts.values()))
    assert any(len(set(v)) > 1 for v in seen), "tiers with different cuts, or nothing checked"


def _main_writing(monkeypatch, tmp_path, identity: str = "mini@0123abcd"):
    """`main` with the data and the fit stood in for (no embedding); the packaged default
    path pointed into tmp_path."""
    model = dataclasses.replace(VerifierModel.load(), meta={"train_pairs": 1})
    monkeypatch.setattr(fit_verifier, "load_pairs", lambda: (None, None, None, identity))
    monkeypatch.setattr(fit_verifier, "fit", lambda data: model)
    monkeypatch.setattr(fit_verifier, "DEFAULT_WEIGHTS", tmp_path / "packaged.json")
    return model


def test_the_weights_are_tagged_with_the_models_name_and_weights_fingerprint(
        monkeypatch, tmp_path):
    """The cache matches a verifier to its embedding model by the weights' fingerprint (the
    part of the identity after "@"), and names the model it was fitted for."""
    _main_writing(monkeypatch, tmp_path)
    monkeypatch.setenv("TIERCACHE_SEMANTIC_MODEL_NAME", "mini")
    out = tmp_path / "v.json"
    assert fit_verifier.main(["--out", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert (meta["embedder"], meta["embedder_weights"]) == ("mini", "0123abcd")


def test_the_output_defaults_to_the_services_verifier_path(monkeypatch, tmp_path):
    """--out defaults to TIERCACHE_SEMANTIC_VERIFIER_PATH (the file the service will load),
    else the packaged verifier.json."""
    model = _main_writing(monkeypatch, tmp_path)
    target = tmp_path / "mine.json"
    monkeypatch.setenv("TIERCACHE_SEMANTIC_VERIFIER_PATH", str(target))
    assert fit_verifier.main([]) == 0
    assert VerifierModel.load(target).coef == model.coef
    assert not (tmp_path / "packaged.json").exists()
    monkeypatch.delenv("TIERCACHE_SEMANTIC_VERIFIER_PATH")
    assert fit_verifier.main([]) == 0
    assert (tmp_path / "packaged.json").is_file()


def test_a_replaced_weights_file_keeps_its_mode(tmp_path):
    """Replacing the file keeps its mode (0600 stays 0600), as writing in place did."""
    out = tmp_path / "verifier.json"
    out.write_text("old")
    out.chmod(0o600)
    old = os.umask(0o022)
    try:
        write_weights(out, "new")
    finally:
        os.umask(old)
    assert out.read_text() == "new" and stat.S_IMODE(out.stat().st_mode) == 0o600


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_new_weights_file_gets_the_umasks_mode(tmp_path, umask):
    """A new file gets 0666 less the umask (not the private mode of a temporary file)."""
    out = tmp_path / "verifier.json"
    old = os.umask(umask)
    try:
        write_weights(out, "new")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask


def test_pairs_sharing_a_sentence_are_grouped_through_chains_and_word_order():
    """A group is a connected component of the sentence graph: pairs sharing a sentence (up to
    case, punctuation and word order, so a PAWS swap is the same node) join, transitively."""
    pairs = [("How do I learn Python?", "What is the best way to learn Python?"),
             ("what is the best way to learn python", "Best way to study Python?"),
             ("Best way to study Python?", "Is Python hard?"),
             ("Flights from New York to Florida", "Flights to Florida from New York"),
             ("flights from florida to new york", "Cheap flights from Florida"),
             ("Why is the sky blue?", "Why is the sea blue?")]
    g = sentence_groups(pairs)
    assert g[0] == g[1] == g[2]
    assert g[3] == g[4]
    assert len({g[0], g[3], g[5]}) == 3
    assert sorted(set(g.tolist())) == [0, 1, 2]


def test_grouped_cross_validation_keeps_each_group_in_one_fold():
    """With groups, every pair of a group is scored by the same held-out model, fitted without
    the group: no test pair shares a sentence with a training pair."""
    data = _training_data()
    groups = np.arange(len(data.y)) // 7  # groups of 7 pairs
    fold = fold_of_each_pair(len(data.y), 3, 2, groups)
    for g in np.unique(groups):
        assert len(set(fold[groups == g].tolist())) == 1
    assert set(fold.tolist()) == {0, 1, 2}
    p, cuts = cross_validate(data, folds=3, seed=2, groups=groups)
    for k in range(3):
        held_out = fit(data.subset(fold != k))
        np.testing.assert_allclose(p[fold == k], held_out.probabilities(data.x[fold == k]))
        assert np.all(cuts["standard"][fold == k] == held_out.cuts["standard"])
    # without groups: one fold per pair, as before (drawn alike)
    np.testing.assert_array_equal(fold_of_each_pair(len(data.y), 3, 1),
                                  np.random.default_rng(1).integers(0, 3, len(data.y)))


def _one_class(label: int, n: int = 30) -> PairSet:
    rng = np.random.default_rng(5)
    x = rng.random((n, len(FEATURES)))
    x[:, 0], x[:, GUARD] = 0.95, 1.0
    return PairSet(x, np.full(n, label), np.zeros(n, bool))


@pytest.mark.parametrize("data", [_one_class(1), _one_class(0), _one_class(1, 0),
                                  dataclasses.replace(_one_class(0), y=np.arange(30) % 2,
                                                      x=np.zeros((30, len(FEATURES))))],
                         ids=["same only", "different only", "empty", "all vetoed"])
def test_a_fit_without_both_labels_among_its_training_pairs_is_refused(data):
    """Weights need both labels among the training pairs: refused, naming the counts. One class
    raised a bare LinAlgError "Singular matrix" (all "same", none, all vetoed) or, all
    "different", gave P ~ 1e-22 to every pair and cuts 0, which serve every guarded hit."""
    with pytest.raises(ValueError, match=r"needs both"):
        fit(data)


def test_weights_that_are_not_finite_are_refused():
    """Features too large to standardise (their spread overflows): no model, as a file of NaN
    or Infinity weights would serve every guarded pair (NaN is below no cut)."""
    data = _training_data()
    data.x[:, FEATURES.index("len_log_ratio")] = np.linspace(0.0, 1e300, len(data.y))
    with pytest.raises(ValueError, match="not finite"):
        fit(data)


def test_main_refuses_in_one_line_and_leaves_the_file(monkeypatch, tmp_path, capsys):
    """A refused fit: exit 2 with one line, the weights file as it was, nothing beside it."""
    monkeypatch.setattr(fit_verifier, "load_pairs",
                        lambda: (_one_class(0), None, None, "m@w"))
    out = tmp_path / "v.json"
    out.write_text("old")
    assert fit_verifier.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs both" in err and "\n" not in err
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["v.json"]
