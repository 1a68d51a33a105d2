"""A differential review of ThresholdPolicy (policy.py) and how SemanticCache applies it: seeded
random configurations and requests against a model of the documented rules in exact rational
arithmetic (fractions.Fraction).

The rules the model holds (semantic.proto, docs/settings.md, services/semantic/README.md, the
policy docstrings):
- a request's tier is its own or the configured default; an unknown one is INVALID_ARGUMENT
  naming `tier`; threshold 0 is the tier's threshold (explicit False), else the request's own,
  which must be in [floor, 1] (INVALID_ARGUMENT naming `threshold` otherwise, NaN and infinities
  included); the float32 the wire carries for the floor or for 1 is that bound itself;
- an entry is held to the threshold, less the verified bonus for a verified entry, never below
  the floor; Decision.threshold is that, whatever the outcome;
- HIT at or above it, else DRAFT at or above the draft floor, else MISS; a similarity equal to
  the float32 nearest a bound counts as at it (similarities are float32);
- a lookup hits the nearest candidate that is a HIT (verified ones deeper down included, ties
  with an unverified one too); with none, it reports the best similarity, the threshold one of
  the best candidates was held to, and (asked for) one of them as a draft when in the band.
Where the docs are silent the model only holds invariants: an explicit threshold further than
one float32 step but within 2e-6 of the floor (or of 1) may be refused or taken as that bound;
a similarity within 2e-6 below an entry's threshold may be a hit or not (policy.py's 1e-6
tolerance); the cache test takes the policy's answer for such a candidate.

Configurations are drawn as the config accepts them (floor up to 1, tiers equal to the floor
or to 1, bonus 0 to 0.1999999, draft floor down to 1e-9 or equal to the floor, tiny floors),
requests at the floor, 1, their float32 neighbours and a little outside, similarities at each
bound (threshold, threshold - bonus, draft floor, floor, 1), their float32 neighbours and 1e-6
below. Run: 4,000 policy seeds (~1M decisions) and 2,000 cache seeds. Found: a float32
similarity at a draft floor float32 rounds down (0.7, 0.9, 0.95) was a miss, not a draft
(fixed: ThresholdPolicy.in_draft_band; test_policy / test_cache_rules guard it). Not a defect
but undocumented: the 1e-6 slack below the floor and below each threshold is about 16 float32
steps, not one. Injected bugs, failing seeds of 500 policy / 300 cache seeds in the scratch
run, then failing tests here: the bonus unclamped (393 / 85; 67), a floor slack of 1e-3
(281 / 0; 1), an exclusive draft floor (468 / 8; 6), the clamp to [floor, 1] dropped
(470 / 9; 13), a miss reporting the tier's threshold (- / 9; 5), the search stopping at the
unverified threshold (- / 4; 5), the draft fix reverted (5).

Here: 600 policy seeds (one test) and 250 cache seeds (one test each), about 3 s. More:
TIERCACHE_POLICY_DIFF_SEEDS=4000 TIERCACHE_POLICY_CACHE_SEEDS=2000.
"""

from __future__ import annotations

import math
import os
import random
from fractions import Fraction as F

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.semantic.config import SemanticConfig
from services.semantic.policy import Outcome, ThresholdPolicy
from tests.semantic import test_cache_edges as edges
from tests.semantic.test_cache_edges import A

emb, make_cache = edges.emb, edges.make_cache  # the fixtures of test_cache_edges

POLICY_SEEDS = int(os.environ.get("TIERCACHE_POLICY_DIFF_SEEDS", "600"))
CACHE_SEEDS = int(os.environ.get("TIERCACHE_POLICY_CACHE_SEEDS", "250"))
SLACK = F(2e-6)  # undocumented band: either answer allowed
TIERS = ("strict", "standard", "relaxed")


def f32(x: float) -> float:
    return float(np.float32(x))


def f32_around(x: float) -> list[float]:
    """The float32 nearest x and its neighbours either side."""
    y = np.float32(x)
    return [float(np.nextafter(y, np.float32(-1))), float(y), float(np.nextafter(y, np.float32(2)))]


def random_config(rng: random.Random, **kw) -> SemanticConfig:
    pick = rng.choice
    floor = pick([1.0, 0.85, 0.9, 0.95, 0.5, 1e-3,
                  round(rng.uniform(0.01, 1.0), pick([2, 3, 6]))])
    choices = [floor, 1.0, 0.97, 0.95, 0.9, round(rng.uniform(floor, 1.0), pick([2, 3, 6]))]
    ts = sorted(min(1.0, max(floor, pick(choices))) for _ in range(3))
    bonus = pick([0.0, 0.02, 0.19, 0.1999999, round(rng.uniform(0, 0.199), 3)])
    draft = pick([floor, 0.8, round(rng.uniform(0, floor), 3), 1e-9, 0.7, 0.9])
    draft = draft if 0 < draft <= floor else floor
    cfg = SemanticConfig(tier_relaxed=ts[0], tier_standard=ts[1], tier_strict=ts[2],
                         default_tier=pick(TIERS), threshold_floor=floor, verified_bonus=bonus,
                         draft_floor=draft, **kw)
    cfg.validate()
    return cfg


class Model:
    """The documented rules, in exact arithmetic."""

    def __init__(self, cfg: SemanticConfig) -> None:
        self.cfg = cfg
        self.tiers = {"strict": cfg.tier_strict, "standard": cfg.tier_standard,
                      "relaxed": cfg.tier_relaxed}
        self.floor = F(cfg.threshold_floor)

    def resolve(self, tier: str, th: float):
        """("ok", tier, threshold, explicit), ("err", field) or ("either",)."""
        name = tier or self.cfg.default_tier
        if name not in self.tiers:
            return ("err", "tier")
        if th == 0:
            return ("ok", name, F(self.tiers[name]), False)
        if not math.isfinite(th):
            return ("err", "threshold")
        t, fl = F(th), self.floor
        if fl <= t <= 1:
            return ("ok", name, t, True)
        if t < fl and th == f32(self.cfg.threshold_floor):
            return ("ok", name, fl, True)  # the floor, off the float32 wire
        if t > 1 and th == f32_around(1.0)[2]:
            return ("ok", name, F(1), True)
        if t < fl - SLACK or t > 1 + SLACK:
            return ("err", "threshold")
        return ("either",)

    def held_to(self, t: F, verified: bool) -> F:
        return max(self.floor, t - F(self.cfg.verified_bonus)) if verified else t

    def decide(self, sim: float, t: F, verified: bool) -> tuple[set[Outcome], F]:
        """The outcomes allowed and the threshold the entry is held to."""
        te, s = self.held_to(t, verified), F(sim)
        draft = self.cfg.draft_floor
        other = Outcome.DRAFT if s >= min(F(draft), F(f32(draft))) else Outcome.MISS
        if s >= min(te, F(f32(float(te)))):
            return {Outcome.HIT}, te
        if s < te - SLACK:
            return {other}, te
        return {Outcome.HIT, other}, te


def similarities(m: Model, t: F, rng: random.Random) -> list[float]:
    out = {0.0, -0.3}
    for b in (float(t), float(m.held_to(t, True)), m.cfg.draft_floor,
              m.cfg.threshold_floor, 1.0):
        out.update(f32_around(b))
        out.update((b, b - 1e-6, b - 1.5e-6, b + 1e-9))
    out.update(f32(rng.random()) for _ in range(4))
    return sorted(s for s in out if s <= 1.0)


def requests(cfg: SemanticConfig, rng: random.Random):
    fl = cfg.threshold_floor
    values = [0.0, 0.0, -0.0, fl, fl - 1e-6, fl - 1e-7, fl - 2e-6, fl - 1e-5, fl - 1e-4,
              fl - 1e-3, fl - 0.01, fl + 1e-9, *f32_around(fl), 1.0, 1.0 + 1e-6, 1.0 + 1e-7,
              1.0001, *f32_around(1.0), math.nan, math.inf, -math.inf, -0.5, cfg.tier_strict,
              f32(cfg.tier_relaxed), f32(rng.uniform(fl, 1.0)), rng.uniform(0, 1)]
    for _ in range(12):
        yield (rng.choice(["", "", *TIERS, "Strict", "lenient"]), rng.choice(values))


def test_policy_matches_the_documented_rules():
    failures = []
    for seed in range(POLICY_SEEDS):
        rng = random.Random(seed)
        cfg = random_config(rng)
        m, p = Model(cfg), ThresholdPolicy.from_config(cfg)
        for tier, th in requests(cfg, rng):
            want = m.resolve(tier, th)
            try:
                r = p.resolve(tier, th)
                got = ("ok", r.tier, r.threshold, r.explicit)
            except InvalidArgument as exc:
                got = ("err", exc.field)
                assert str(exc).startswith(f"{exc.field}: "), str(exc)
            if want[0] == "either":
                if got[0] == "ok" and not m.floor <= F(got[2]) <= 1:
                    failures.append((seed, tier, th, "outside [floor, 1]", got))
                continue
            if got != (want if want[0] == "err" else (*want[:2], float(want[2]), want[3])):
                failures.append((seed, tier, th, want, got))
                continue
            if got[0] != "ok":
                continue
            for verified in (False, True):
                for sim in similarities(m, want[2], rng):
                    allowed, te = m.decide(sim, want[2], verified)
                    d = p.decide(sim, r, verified)
                    if d.outcome not in allowed or abs(F(d.threshold) - te) > F(1e-12):
                        failures.append((seed, tier, th, verified, sim, allowed, float(te), d))
        assert not failures, failures[:5]


@pytest.mark.parametrize("seed", range(CACHE_SEEDS))
def test_a_lookup_applies_the_policy_per_candidate(make_cache, emb, seed):
    """Up to five entries at cosines on the bounds (ties frequent, some verified), one lookup."""
    rng = random.Random(seed)
    cfg = random_config(rng)
    m = Model(cfg)
    c = make_cache(tier_relaxed=cfg.tier_relaxed, tier_standard=cfg.tier_standard,
                   tier_strict=cfg.tier_strict, default_tier=cfg.default_tier,
                   threshold_floor=cfg.threshold_floor, verified_bonus=cfg.verified_bonus,
                   draft_floor=cfg.draft_floor)
    tier = rng.choice(["", *TIERS])
    th = rng.choice([0.0, 0.0, cfg.threshold_floor, f32(cfg.threshold_floor), 1.0,
                     f32(rng.uniform(cfg.threshold_floor, 1.0))])
    want = m.resolve(tier, th)
    assert want[0] == "ok"
    t, r = want[2], c.policy.resolve(tier, th)
    points = [f32(rng.uniform(0.5, 1.0)), 1.0]
    for b in (float(t), float(m.held_to(t, True)), cfg.draft_floor):
        points += f32_around(b)
    ents = []  # (id, similarity, verified, a hit, threshold held to)
    for i in range(rng.randint(1, 5)):
        cos = rng.choice(points) if not ents or rng.random() < 0.7 else ents[-1][1]
        cos = min(1.0, max(0.0, cos))
        emb.at(f"entry number {i}", cos, 2 + i)
        verified = rng.random() < 0.5
        e = c.store_entry(A, f"entry number {i}", f"answer {i}", verified=verified)
        sim = f32(cos)  # the query is e0: the inner product is the float32 cosine itself
        allowed, te = m.decide(sim, t, verified)
        hit = (allowed == {Outcome.HIT} if len(allowed) == 1
               else c.policy.decide(sim, r, verified).outcome is Outcome.HIT)
        ents.append((e.id, sim, verified, hit, te))
    want_draft = rng.random() < 0.8
    res = c.lookup(A, "query", tier=tier, threshold=th, want_draft=want_draft)
    hits = [x for x in ents if x[3]]
    if hits:
        top = max(x[1] for x in hits)
        best = [x for x in hits if x[1] == top]
        assert res.hit and res.similarity == top, (res, ents)
        assert res.entry.id in [x[0] for x in best], (res, ents)
    else:
        top = max(x[1] for x in ents)
        best = [x for x in ents if x[1] == top]
        assert not res.hit and res.similarity == top, (res, ents)
        draft = F(top) >= min(F(cfg.draft_floor), F(f32(cfg.draft_floor)))
        if want_draft and draft:
            assert res.entry is not None and res.entry.id in [x[0] for x in best], (res, ents)
        else:
            assert res.entry is None, (res, ents)
    assert any(abs(F(res.threshold) - x[4]) <= F(1e-12) for x in best
               if not res.hit or x[0] == res.entry.id), (res, ents)

