"""Verifier rules a mutation audit found unguarded: a tier's cut is the lowest score served
(inclusive), a weights file that does not say `guard_veto` keeps the guard's veto, the fit
does not shrink the intercept, and the features read pairs of identical texts as agreeing in
every respect, also texts without content words (where the ratios have empty sets)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from services.semantic.verifier import (
    FEATURES,
    Verifier,
    VerifierModel,
    fit_logistic,
    pair_features,
)

ZEROS = (0.0,) * len(FEATURES)


def test_a_score_equal_to_the_tiers_cut_is_served():
    """cuts: "minimum P(same meaning) to serve a hit" (the module's `P >= the tier's cut`).
    All-zero weights score every pair 1/2 exactly: at a cut of 1/2 it is served, above refused."""
    flat = VerifierModel(ZEROS, (1.0,) * len(FEATURES), ZEROS, 0.0,
                         {"strict": 0.5, "standard": 0.5000001})
    v = Verifier(flat)
    q = "How do I learn Python quickly?"
    at = v.check(q, q, 0.99, "strict")
    assert at.score == 0.5 and at.ok and at.reason == ""
    above = v.check(q, q, 0.99, "standard")
    assert not above.ok and "below 0.500" in above.reason


@pytest.mark.parametrize("text", ["How do I learn Python quickly?", "What is it?", "Why?"])
def test_a_text_paired_with_itself_differs_in_no_feature(text):
    """Identical texts share all their content words and bigrams (Jaccard 1, also of empty
    sets), keep their order, ask with the same word and add no word."""
    x = dict(zip(FEATURES, pair_features(text, text, 1.0), strict=True))
    assert x["content_jaccard"] == 1.0 and x["bigram_jaccard"] == 1.0
    assert x["discordant_rate"] == 0.0 and x["wh_differs"] == 0.0
    assert x["extra_words_total"] == 0.0 and x["len_log_ratio"] == 0.0
    assert x["same_normalised"] == 1.0 and x["guard_ok"] == 1.0


def test_weights_that_do_not_say_guard_veto_keep_the_guards_veto():
    """The guard stays a hard veto: a weights file without the field (an older fit) reads
    as guard_veto true, so a pair the guard refuses is refused even at the score of 1."""
    sure = json.loads(VerifierModel(ZEROS, (1.0,) * len(FEATURES), ZEROS, 50.0,
                                    {"strict": 0.5}).to_json())
    del sure["guard_veto"]
    v = Verifier(VerifierModel.from_json(json.dumps(sure)))
    assert v.model.guard_veto
    trap = v.check("Flights from New York to Florida", "Flights from Florida to New York", 1.0,
                   "strict")
    assert trap.score > 0.99 and not trap.ok and "order" in trap.reason


def test_the_fit_does_not_shrink_the_intercept():
    """L2 shrinks the feature weights only: with features that say nothing (constant), the
    fitted P(same) is the labels' base rate however strong the regularisation."""
    y = np.array([1.0] * 80 + [0.0] * 20)
    x = np.ones((len(y), len(FEATURES)))
    _, _, coef, intercept = fit_logistic(x, y, l2=100.0)
    assert np.all(coef == 0.0)
    assert intercept == pytest.approx(math.log(0.8 / 0.2), abs=1e-6)


def test_a_pair_of_the_same_words_reordered_reads_as_reordered():
    """The order features see a swap: the same content words (Jaccard 1), but pairs of them
    in the other order (discordant) and word bigrams lost."""
    x = dict(zip(FEATURES, pair_features("Flights from New York to Florida",
                                         "Flights from Florida to New York", 0.99),
                 strict=True))
    assert x["content_jaccard"] == 1.0
    assert x["discordant_rate"] > 0.0 and x["bigram_jaccard"] < 1.0


def test_a_question_word_a_few_words_in_is_the_one_asked_with():
    """wh_differs: whether the two ask with the same question word, also when it comes after
    a polite opening ("Can you tell me why ..." against "... how ...")."""
    x = dict(zip(FEATURES, pair_features("Can you tell me why the sky is blue?",
                                         "Can you tell me how the sky is blue?", 0.97),
                 strict=True))
    assert x["wh_differs"] == 1.0


def test_a_guard_verdict_given_to_pair_features_is_the_one_used():
    """`guard_ok`: the caller's verdict, taken as given (not computed again over it)."""
    q = "How do I learn Python quickly?"
    given = dict(zip(FEATURES, pair_features(q, q, 1.0, guard_ok=False), strict=True))
    assert given["guard_ok"] == 0.0
    assert dict(zip(FEATURES, pair_features(q, q, 1.0), strict=True))["guard_ok"] == 1.0


@pytest.mark.parametrize("verdict", [True, False])
def test_a_given_verdict_changes_no_feature_but_guard_ok(verdict):
    """Given the verdict, pair_features counted the breakpoints over the words as written, not
    as the guard's order check counts them (plurals as singulars: "startups" is "startup"),
    which `check` and the fit use: 0 here against the guard's 3 (a differential review found
    it, on 1.5% of the guarded QQP and PAWS pairs)."""
    q, c = "What are the best ideas for startups?", "What are good startup ideas?"
    computed = dict(zip(FEATURES, pair_features(q, c, 0.97), strict=True))
    given = dict(zip(FEATURES, pair_features(q, c, 0.97, guard_ok=verdict), strict=True))
    assert computed["guard_ok"] == 1.0 and computed["breakpoints"] == 3.0
    assert given == {**computed, "guard_ok": float(verdict)}


@pytest.mark.parametrize("field,value", [("coef", math.nan), ("mean", math.inf),
                                         ("intercept", math.nan), ("cuts", math.nan),
                                         ("cuts", -math.inf), ("scale", 0.0),
                                         ("scale", -1.0), ("scale", math.inf)])
def test_weights_with_a_number_that_cannot_score_are_refused_at_load(tmp_path, field, value):
    """A NaN or infinite weight made every score NaN, never below a cut: every pair the guard
    passes was served; a NaN cut served them all too; a scale of 0 raised ZeroDivisionError at
    every verified lookup, not at the start. Refused when loaded, naming the file."""
    d = json.loads(VerifierModel(ZEROS, (1.0,) * len(FEATURES), ZEROS, 0.0,
                                 {"strict": 0.5}).to_json())
    if field == "intercept":
        d[field] = value
    elif field == "cuts":
        d[field]["strict"] = value
    else:
        d[field][2] = value
    path = tmp_path / "v.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"{path}: not usable verifier weights.*{field}"):
        VerifierModel.load(path)
