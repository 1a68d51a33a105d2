"""The semantic cache's metrics that no test read, checked against what docs/metrics.md says
they count: lookups by tier and outcome, exact-repeat hits, evictions, and the embedding and
search timings' observations. Entries sit at chosen cosines to the query (the fake embedder
of test_cache_edges; guard and verifier off), so the expected outcome of every lookup is
worked out from the tiers' thresholds and the draft floor alone (the model), and the exported
series (read from the Prometheus registry, as deltas: one set per process) must match it and
what `SemanticCache.stats()` says of the same lookups. Lookups refused as bad input, or whose
caller went away, count nowhere; a replaced prompt or an expired entry is no eviction."""

from __future__ import annotations

import pytest

from services.common.errors import DeadlineExceeded, InvalidArgument
from services.semantic.cache import Namespace, SemanticCache
from tests.metric_sample import sample_value
from tests.semantic import test_cache_edges

# The edge tests' embedder and cache (guard and verifier off): their fixtures, shared.
emb = test_cache_edges.emb
make_cache = test_cache_edges.make_cache

TIERS = ("strict", "standard", "relaxed", "explicit")
OUTCOMES = ("hit", "draft", "miss")


def metric(name: str, **labels) -> float:
    return sample_value(name, labels) or 0.0


def snapshot(c: SemanticCache) -> dict:
    st = c.stats()
    out: dict = {(t, o): metric("tiercache_semantic_lookups_total", tier=t, outcome=o)
                 for t in TIERS for o in OUTCOMES}
    for name in ("exact_hits_total", "evictions_total", "embed_seconds_count",
                 "search_seconds_count", "expirations_total"):
        out[name] = metric(f"tiercache_semantic_{name}")
    out["stats"] = (st.lookups_total, dict(st.hits_by_tier), st.near_misses_total,
                    st.evictions_total, st.expirations_total)
    return out


def moved(before: dict, after: dict) -> dict:
    """The series that moved, by how much (Stats apart)."""
    return {k: after[k] - before[k] for k in before if k != "stats" and after[k] != before[k]}


def test_lookups_count_by_tier_and_outcome_as_the_thresholds_decide(make_cache, emb):
    """One entry per namespace at a chosen cosine to the query: each lookup's outcome is a
    hit at or above the tier's threshold (an explicit one counts under "explicit"), a draft
    in [draft_floor, threshold), a miss below (or with nothing stored); Stats agree."""
    c = make_cache()
    cfg = c.cfg
    thresholds = {"strict": cfg.tier_strict, "standard": cfg.tier_standard,
                  "relaxed": cfg.tier_relaxed}
    cosines = (0.99, 0.96, 0.92, 0.85, 0.5)
    for i, cos in enumerate(cosines):
        emb.at(f"entry {i}", cos, 2 + i)
        c.store_entry(Namespace(f"t{i}", "m", ""), f"entry {i}", f"answer {i}")
    spaces = [(Namespace(f"t{i}", "m", ""), cos) for i, cos in enumerate(cosines)]
    spaces.append((Namespace("empty", "m", ""), None))
    asks = [(t, 0.0) for t in thresholds] + [("standard", 0.88), ("relaxed", 0.98)]
    want: dict = {}
    hits: dict = {}
    near = 0
    before = snapshot(c)
    for ns, cos in spaces:
        for tier, explicit in asks:
            r = c.lookup(ns, "query", tier=tier, threshold=explicit, want_draft=True)
            th = explicit or thresholds[tier]
            label = "explicit" if explicit else tier
            outcome = ("miss" if cos is None else "hit" if cos >= th
                       else "draft" if cos >= cfg.draft_floor else "miss")
            assert r.hit == (outcome == "hit") and not r.exact, (ns, tier, explicit)
            want[(label, outcome)] = want.get((label, outcome), 0) + 1
            if outcome == "hit":
                hits[label] = hits.get(label, 0) + 1
            near += outcome == "draft"
    after = snapshot(c)
    n = len(spaces) * len(asks)
    assert moved(before, after) == {**want, "embed_seconds_count": n,
                                    "search_seconds_count": n}
    lookups, by_tier, near_total, _, _ = before["stats"]
    st = after["stats"]
    assert st[0] - lookups == n and st[2] - near_total == near
    assert {t: st[1].get(t, 0) - by_tier.get(t, 0) for t in st[1]} == hits


def test_an_exact_repeat_is_an_exact_hit_counted_as_a_lookup_that_embedded_nothing(
        make_cache, emb, clock):
    """The text of a live entry's prompt: a hit of its tier (or "explicit") and an exact hit,
    searched (timed) but not embedded. Its entry expired, the same text is searched as any
    (embedded), and is no exact hit (a miss: the search skips expired entries)."""
    c = make_cache()
    a = Namespace("a", "m", "")
    emb.at("the prompt", 0.9, 3)
    c.store_entry(a, "the prompt", "its answer", ttl_seconds=60)
    before = snapshot(c)
    r = c.lookup(a, "the prompt", tier="strict")
    assert r.hit and r.exact
    r = c.lookup(a, "the prompt", threshold=0.99)
    assert r.hit and r.exact
    after = snapshot(c)
    assert moved(before, after) == {("strict", "hit"): 1, ("explicit", "hit"): 1,
                                    "exact_hits_total": 2, "search_seconds_count": 2}
    assert after["stats"][0] - before["stats"][0] == 2
    clock.t += 61
    before = after
    r = c.lookup(a, "the prompt", tier="strict")
    assert not r.hit and not r.exact
    # Expired entries are skipped by the search: nothing else is there, a miss.
    assert moved(before, snapshot(c)) == {("strict", "miss"): 1, "embed_seconds_count": 1,
                                          "search_seconds_count": 1}


def test_the_embedding_time_is_a_lookups_and_not_a_stores(make_cache, emb):
    """Store embeds its prompt too (unless a missed Lookup of it kept the vector), but the
    embedding histogram observes Lookups' embeddings only, as its help text says."""
    c = make_cache()
    a = Namespace("a", "m", "")
    before = snapshot(c)
    c.store_entry(a, "never looked up", "answer")  # embedded here
    assert not c.lookup(a, "query").hit  # embedded, missed: its vector kept for the Store
    c.store_entry(a, "query", "answer")  # the kept vector: nothing embedded
    assert moved(before, snapshot(c)) == {("standard", "miss"): 1, "embed_seconds_count": 1,
                                          "search_seconds_count": 1}


def test_lookups_refused_or_abandoned_count_nowhere(make_cache, emb):
    """INVALID_ARGUMENT (empty text, unknown tier, a threshold under the floor, no tenant) and
    a caller gone before the search (DEADLINE_EXCEEDED): no series moves, nor Stats."""
    c = make_cache()
    a = Namespace("a", "m", "")
    emb.at("entry", 0.99, 2)
    c.store_entry(a, "entry", "answer")
    before = snapshot(c)
    for kw in (dict(ns=a, text=" "), dict(ns=a, text="query", tier="loose"),
               dict(ns=a, text="query", threshold=0.5), dict(ns=Namespace("", "m", ""),
                                                             text="query")):
        with pytest.raises(InvalidArgument):
            c.lookup(**kw)
    for text in ("query", "entry"):  # embedded first, or an exact repeat
        with pytest.raises(DeadlineExceeded):
            c.lookup(a, text, wanted=lambda: False)
    after = snapshot(c)
    assert moved(before, after) == {} and after["stats"] == before["stats"]


def test_evictions_count_the_least_recently_used_entries_dropped_for_room(make_cache, emb,
                                                                          clock):
    """Past a namespace's capacity the least recently used entries go, each counted; a Store
    replacing the same prompt evicts nothing, and entries already expired that make the room
    are expirations, not evictions. Stats agree."""
    c = make_cache(max_entries_per_namespace=3)
    a = Namespace("a", "m", "")
    for i in range(3):
        c.store_entry(a, f"p{i}", f"a{i}")
    before = snapshot(c)
    assert c.lookup(a, "p0").hit  # p0 used last: p1 and p2 go first
    c.store_entry(a, "p0", "a0 again")  # replaced, not evicted
    c.store_entry(a, "p3", "a3")
    c.store_entry(a, "p4", "a4")
    after = snapshot(c)
    got = moved(before, after)
    assert got.pop("evictions_total") == 2 and "expirations_total" not in got
    assert after["stats"][3] - before["stats"][3] == 2
    assert sorted(e.prompt for e in c._entries.values()) == ["p0", "p3", "p4"]
    for i in range(3):
        c.store_entry(a, f"q{i}", "short-lived", ttl_seconds=60)  # p0, p3, p4 go
    clock.t += 61
    before = snapshot(c)
    c.store_entry(a, "r", "new")  # the three expired make the room
    after = snapshot(c)
    assert moved(before, after) == {"expirations_total": 3}
    assert after["stats"][3] == before["stats"][3]


def test_a_restart_under_a_lower_capacity_counts_what_it_evicts(make_cache):
    """Limits lowered since the entries were written: the start evicts the least recently
    used past them, each counted, as its Stats say."""
    c = make_cache()
    a = Namespace("a", "m", "")
    for i in range(5):
        c.store_entry(a, f"p{i}", f"a{i}")
    before = metric("tiercache_semantic_evictions_total")
    again = make_cache(max_entries_per_namespace=2)  # the same database, restarted
    assert metric("tiercache_semantic_evictions_total") - before == 3
    assert again.stats().evictions_total == 3 and again.stats().entries == 2


def test_search_seconds_help_says_an_exact_repeat_is_observed_without_a_search(make_cache, emb):
    """An exact repeat is observed in tiercache_semantic_search_seconds (its lookup by text),
    as the help now says; it said "index search and the candidates' checks", and a live
    stack's exact hits filled the lowest buckets as if searches took that little."""
    c = make_cache()
    help_text = c._m["search"]._documentation  # noqa: SLF001
    assert "exact repeat, its lookup by text instead" in help_text
    a = Namespace("a", "m", "")
    emb.at("the prompt", 0.9, 3)
    c.store_entry(a, "the prompt", "its answer")
    before = snapshot(c)
    assert c.lookup(a, "the prompt").exact
    assert moved(before, snapshot(c)) == {("standard", "hit"): 1, "exact_hits_total": 1,
                                          "search_seconds_count": 1}


def test_hits_on_verified_entries_are_counted_apart_by_tier(make_cache, emb):
    """No series told hits on human-verified entries (held to the threshold less the verified
    bonus) from the others: verified_hits_total{tier} counts them (exact repeats and explicit
    thresholds too), and lookups_total goes on counting every hit as before."""
    c = make_cache()
    cfg = c.cfg
    plain, verified = Namespace("plain", "m", ""), Namespace("verified", "m", "")
    below = cfg.tier_standard - cfg.verified_bonus / 2  # a hit for a verified entry only
    emb.at("plain entry", cfg.tier_standard + 0.01, 2)
    emb.at("verified entry", below, 3)
    c.store_entry(plain, "plain entry", "a")
    c.store_entry(verified, "verified entry", "b", verified=True)

    def counts() -> dict:
        return {t: metric("tiercache_semantic_verified_hits_total", tier=t) for t in TIERS}

    before, hits_before = counts(), metric("tiercache_semantic_lookups_total",
                                           tier="standard", outcome="hit")
    assert c.lookup(plain, "query", tier="standard").hit
    assert c.lookup(verified, "query", tier="standard").hit
    assert c.lookup(verified, "verified entry", tier="strict").exact
    assert c.lookup(verified, "query", threshold=cfg.tier_standard).hit
    assert not c.lookup(verified, "query", tier="strict").hit
    after = counts()
    assert {t: after[t] - before[t] for t in TIERS if after[t] != before[t]} == {
        "standard": 1, "strict": 1, "explicit": 1}
    assert metric("tiercache_semantic_lookups_total", tier="standard",
                  outcome="hit") - hits_before == 2
