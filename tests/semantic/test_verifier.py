"""The learned verifier: traps refused, paraphrases above the tier threshold served, the fit
deterministic, the committed weights loadable, and its config checked."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.config import ConfigError
from services.semantic.cache import Namespace, SemanticCache
from services.semantic.config import SemanticConfig
from services.semantic.fit_verifier import PairSet, cross_validate, fit
from services.semantic.store import EntryStore
from services.semantic.verifier import (
    DEFAULT_WEIGHTS,
    FEATURES,
    Verifier,
    VerifierModel,
    pair_features,
)

from .test_guard import PARAPHRASES, TRAPS


@pytest.fixture(scope="module")
def verifier() -> Verifier:
    return Verifier()


def _cos(emb, a: str, b: str) -> float:
    va, vb = emb.embed([a, b])
    return float(va @ vb)


@pytest.mark.parametrize(("query", "cached", "check"), TRAPS)
@pytest.mark.parametrize("tier", ["strict", "standard"])
def test_verifier_refuses_traps(verifier, onnx_embedder, query, cached, check, tier):
    # Even at a perfect cosine: the verifier never serves what the guard refuses.
    for sim in (_cos(onnx_embedder, query, cached), 1.0):
        assert not verifier.check(query, cached, sim, tier).ok
        assert not verifier.check(cached, query, sim, tier).ok


def test_verifier_serves_paraphrases_that_reach_the_threshold(verifier, onnx_embedder):
    """Every paraphrase at (or within 0.005 of) a tier's threshold is served in that tier.
    Pairs below every threshold are misses before the verifier: they are counted, so that the
    test cannot pass by checking nothing (13 of these pairs score under 0.945)."""
    pairs = PARAPHRASES + [
        ("What is the best way to learn guitar?", "What's the best way to learn the guitar?"),
        ("How do I get rid of acne?", "How can I get rid of acne?"),
        ("What are the benefits of drinking green tea?",
         "What are the health benefits of green tea?"),
    ]
    checked: dict[str, int] = {"strict": 0, "standard": 0}
    refused = []
    for query, cached in pairs:
        sim = _cos(onnx_embedder, query, cached)
        for tier, th in (("strict", 0.97), ("standard", 0.95)):
            if sim >= th - 0.005:
                checked[tier] += 1
                r = verifier.check(query, cached, sim, tier)
                if not r.ok:
                    refused.append((tier, round(sim, 4), query, r.reason))
    assert refused == []
    assert checked["standard"] >= 15 and checked["strict"] >= 10, checked


def test_verifier_refuses_an_extra_qualifier_the_guard_lets_through(verifier, onnx_embedder):
    """What the learned part adds: one text asks for more than the other (a QQP non-duplicate
    with cosine 0.98 that every hand-made check passes; depends on the committed weights)."""
    q, c = ("Which is the best and worst Bollywood movie which released between July 2016 and "
            "December 2016?",
            "Which is the worst Bollywood movie which released between July 2016 and December "
            "2016?")
    sim = _cos(onnx_embedder, q, c)
    assert sim >= 0.97 and verifier.guard.check(q, c).ok
    r = verifier.check(q, c, sim, "strict")
    assert not r.ok and "verifier score" in r.reason


def test_scores_are_deterministic_and_increase_with_similarity(verifier):
    q, c = "How do I learn Python quickly?", "What is the fastest way to learn python?"
    a = [verifier.check(q, c, 0.96, "strict").score for _ in range(3)]
    assert a[0] == a[1] == a[2]
    assert verifier.check(q, c, 0.99, "strict").score > a[0]
    np.testing.assert_array_equal(pair_features(q, c, 0.96), pair_features(q, c, 0.96))


def _toy_pairs(seed: int = 0) -> PairSet:
    rng = np.random.default_rng(seed)
    n = 600
    x = np.zeros((n, len(FEATURES)))
    y = rng.integers(0, 2, n)
    x[:, 0] = 0.9 + 0.1 * rng.random(n)
    x[:, FEATURES.index("guard_ok")] = 1.0
    x[:, FEATURES.index("content_jaccard")] = np.where(y == 1, 0.8, 0.5) + 0.2 * rng.random(n)
    x[:, FEATURES.index("extra_words_total")] = rng.integers(0, 4, n)
    return PairSet(x, y, rng.random(n) < 0.5)


def test_fit_is_deterministic_and_round_trips_through_json():
    data = _toy_pairs()
    m1, m2 = fit(data), fit(data)
    assert m1 == m2
    back = VerifierModel.from_json(m1.to_json())
    np.testing.assert_allclose(back.probabilities(data.x), m1.probabilities(data.x))
    assert back.cuts == m1.cuts


def test_cross_validation_scores_each_pair_with_a_model_fitted_without_it():
    data = _toy_pairs()
    p, cuts = cross_validate(data, folds=5, seed=0)
    fold = np.random.default_rng(0).integers(0, 5, len(data.y))
    test = fold == 0
    held_out = fit(data.subset(~test))
    np.testing.assert_allclose(p[test], held_out.probabilities(data.x[test]))
    assert set(cuts) == {"strict", "standard", "relaxed"}
    assert np.all(cuts["strict"][test] == held_out.cuts["strict"])


def test_committed_weights_match_the_features():
    m = VerifierModel.load(DEFAULT_WEIGHTS)
    assert len(m.coef) == len(FEATURES) and set(m.cuts) >= {"strict", "standard"}
    assert 0.0 <= m.cuts["strict"] < 1.0
    bad = m.to_json().replace('"cos"', '"cosine"', 1)
    with pytest.raises(ValueError, match="fit_verifier"):
        VerifierModel.from_json(bad)


def test_verifier_tiers_must_be_guarded():
    with pytest.raises(ConfigError, match="VERIFIER_TIERS"):
        SemanticConfig(guard_tiers=("strict",), verifier_tiers=("standard",)).validate()


def test_cache_uses_the_verifier_only_in_its_tiers(make_cfg, embedder, tmp_path):
    cfg = make_cfg(guard_tiers=("strict", "standard"), verifier_tiers=("strict",))
    cache = SemanticCache(cfg, embedder, EntryStore(str(tmp_path / "v.db"), "NORMAL"))
    try:
        ns = Namespace("t", "m")
        cache.store_entry(ns, "Which is the worst Bollywood movie which released between July "
                              "2016 and December 2016?", "A list.")
        q = ("Which is the best and worst Bollywood movie which released between July 2016 and "
             "December 2016?")
        strict = cache.lookup(ns, q, threshold=0.95, tier="strict")
        standard = cache.lookup(ns, q, tier="standard")
        assert not strict.hit and strict.guard_rejected and "verifier" in strict.guard_reason
        assert standard.hit and not standard.guard_rejected  # guard only in standard here
    finally:
        cache.store.close()


def test_one_pair_probability_matches_the_batch_formula():
    # check() scores one pair in pure Python; the fit and the benchmark use the numpy batch
    # path. Both must give the same P(same meaning), also far out in either tail.
    model = VerifierModel.load()
    rng = np.random.default_rng(5)
    rows = rng.normal(0.0, 1.0, (200, len(FEATURES))) * np.asarray(model.scale) * 3
    rows += np.asarray(model.mean)
    rows[0] = np.asarray(model.mean) + 200 * np.asarray(model.scale) * np.sign(model.coef)
    rows[1] = np.asarray(model.mean) - 200 * np.asarray(model.scale) * np.sign(model.coef)
    batch = model.probabilities(rows)
    one = np.array([model.probability(list(r)) for r in rows])
    np.testing.assert_allclose(one, batch, rtol=1e-12, atol=1e-300)
    assert one[0] == 1.0 and one[1] < 1e-100


def test_check_scores_a_pair_as_its_features_say(verifier):
    # check() computes the features from per-text analyses (cached for short texts) and
    # reuses the guard's breakpoint count; the score must be the one pair_features gives,
    # for texts inside and beyond the cache's length limit.
    long_tail = " and also" * 200  # > 256 characters: analysed uncached
    pairs = [("How do I learn Python quickly?", "What is the fastest way to learn python?"),
             ("Flights from New York to Florida", "Flights from Florida to New York"),
             ("Is it legal to park here?", "Is it illegal to park here?"),
             ("What is 2 + 2" + long_tail, "What is two plus two" + long_tail),
             ("Does the dog chase the cat" + long_tail, "Does the cat chase the dog" + long_tail)]
    for q, c in pairs:
        for sim in (0.91, 0.99):
            got = verifier.check(q, c, sim, "strict")
            x = pair_features(q, c, sim, verifier.guard)
            want = float(verifier.model.probabilities(x)[0])
            assert got.score == pytest.approx(want, rel=1e-12)
            assert x[FEATURES.index("guard_ok")] == float(verifier.guard.check(q, c).ok)
    assert not verifier.check(*pairs[4], 1.0, "strict").ok  # order trap, long texts


def test_the_fitter_reads_the_services_settings(monkeypatch, tmp_path):
    """It read plain defaults: it always fitted (and tagged) the packaged MiniLM, whatever
    model the service runs; and a verifier path not yet written refused the fit."""
    from services.semantic.fit_verifier import semantic_config

    monkeypatch.setenv("TIERCACHE_SEMANTIC_MODEL_NAME", "my-model")
    monkeypatch.setenv("TIERCACHE_SEMANTIC_VERIFIER_PATH", str(tmp_path / "to-fit.json"))
    cfg = semantic_config()
    assert cfg.resolved_model_name() == "my-model"


def test_weights_of_another_versions_features_leave_the_guard_not_a_stopped_shard(
        make_cfg, embedder, tmp_path, caplog):
    """An upgrade that changed the verifier's features, with an old custom weights file
    still configured, stopped every shard (exit 2). A file missing fields is still refused."""
    import json
    import logging

    stale = json.loads(VerifierModel.load().to_json())
    stale["features"] = stale["features"][:-1]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(stale))
    cfg = make_cfg(verifier_path=str(path))
    with caplog.at_level(logging.WARNING, logger="services.semantic"):
        cache = SemanticCache(cfg, embedder, EntryStore(str(tmp_path / "v.db"), "NORMAL"))
    try:
        assert cache.verifier is None and "guard only" in caplog.text
    finally:
        cache.store.close()
    del stale["coef"]
    path.write_text(json.dumps(stale))
    with pytest.raises(ValueError, match="missing coef"):
        VerifierModel.load(path)


def test_weights_no_tier_uses_are_not_read(make_cfg, embedder, tmp_path, caplog):
    """With no verifier tier the weights file configured is never read: one that would be
    refused (fields missing) or stale neither stops the shard nor logs a warning about a
    verifier nothing consults."""
    import json
    import logging

    broken = json.loads(VerifierModel.load().to_json())
    del broken["coef"]
    path = tmp_path / "unused.json"
    path.write_text(json.dumps(broken))
    cfg = make_cfg(verifier_path=str(path), verifier_tiers=())
    with caplog.at_level(logging.WARNING, logger="services.semantic"):
        cache = SemanticCache(cfg, embedder, EntryStore(str(tmp_path / "v.db"), "NORMAL"))
    try:
        assert cache.verifier is None and "verifier" not in caplog.text
    finally:
        cache.store.close()


def test_a_cut_short_weights_file_is_refused_naming_it_and_the_way_out(tmp_path):
    """A weights file cut short (fit_verifier wrote it in place) stopped the shard with a bare
    JSONDecodeError naming no file; weights of the wrong shape failed only at the first
    verified lookup."""
    import json

    text = DEFAULT_WEIGHTS.read_text()
    path = tmp_path / "verifier.json"
    path.write_text(text[: len(text) // 2])
    way_out = (r"refit them with python -m services\.semantic\.fit_verifier --out .*"
               r"verifier\.json, or unset TIERCACHE_SEMANTIC_VERIFIER_PATH")
    with pytest.raises(ValueError, match=rf"{path}: not usable verifier weights "
                       rf"\(JSONDecodeError: .*\); {way_out}"):
        VerifierModel.load(path)
    d = json.loads(text)
    d["coef"] = d["coef"][:-1]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"{path}: .*coef has {len(FEATURES) - 1} values, not "
                       rf"{len(FEATURES)}.*{way_out}"):
        VerifierModel.load(path)
    path.write_text("[1, 2]")  # JSON, not an object
    with pytest.raises(ValueError, match=rf"{path}: not usable verifier weights"):
        VerifierModel.load(path)


def test_the_fitter_replaces_its_output_in_one_step(monkeypatch, tmp_path):
    """It wrote the weights in place (open "w"): a fit interrupted while writing, or a power
    loss, left a file cut short that stopped every shard. The new weights are now on disk
    (fsynced) in a file beside it before they replace the old ones."""
    import dataclasses
    import os
    import stat

    from services.semantic import fit_verifier

    out = tmp_path / "verifier.json"
    out.write_text("old weights")
    out.chmod(0o644)
    model = dataclasses.replace(VerifierModel.load(), meta={"train_pairs": 1})
    monkeypatch.setattr(fit_verifier, "load_pairs", lambda: (None, None, None, "m@w"))
    monkeypatch.setattr(fit_verifier, "fit", lambda data: model)
    synced: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def watching_fsync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), out.read_text()))
        real_fsync(fd)

    monkeypatch.setattr(fit_verifier.os, "fsync", watching_fsync)
    assert fit_verifier.main(["--out", str(out)]) == 0
    written = [p for p, _ in synced if p != str(out) and p != str(tmp_path)]
    assert len(written) == 1 and os.path.dirname(written[0]) == str(tmp_path)
    assert synced[0][1] == "old weights"  # the new file was on disk before the rename
    assert synced[-1][0] == str(tmp_path)  # then the rename itself
    assert VerifierModel.load(out).coef == model.coef
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["verifier.json"]


def test_the_verifier_follows_the_embedding_models_weights_not_its_name(make_cfg, embedder,
                                                                      tmp_path, caplog):
    """Matched by name alone, a fine-tuned model in a folder of the packaged model's name kept
    weights fitted for another model's cosines, and the packaged model served under another
    name lost its verifier."""
    import json

    base = json.loads(VerifierModel.load().to_json())
    assert base["meta"]["embedder_weights"] == embedder.identity.rpartition("@")[2]

    def cache_with(name: str, weights: str | None) -> SemanticCache:
        meta = dict(base["meta"], embedder=name)
        if weights is None:
            meta.pop("embedder_weights")
        else:
            meta["embedder_weights"] = weights
        path = tmp_path / f"{name}-{weights}.json"
        path.write_text(json.dumps(dict(base, meta=meta)))
        cfg = make_cfg(verifier_path=str(path), db_path=str(tmp_path / f"{path.stem}.db"))
        cache = SemanticCache(cfg, embedder, EntryStore(cfg.resolved_db_path(), "NORMAL"))
        cache.store.close()
        return cache

    ours = base["meta"]["embedder_weights"]
    assert cache_with("all-MiniLM-L6-v2", ours).verifier is not None
    assert cache_with("renamed-minilm", ours).verifier is not None  # same weights
    caplog.clear()
    assert cache_with("all-MiniLM-L6-v2", "0123456789abcdef").verifier is None  # fine-tuned
    assert "fitted for all-MiniLM-L6-v2@0123456789abcdef" in caplog.text
    # Files from before weights were recorded: by name, as before.
    assert cache_with("all-MiniLM-L6-v2", None).verifier is not None
    assert cache_with("another-model", None).verifier is None
