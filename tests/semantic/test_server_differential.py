"""A differential review of the semantic tier's gRPC adapter (`services.semantic.server`)
against a model of its documented contract (protos/tiercache/v1/semantic.proto, docs/metrics.md,
the docstrings of server.py and cache.py), over a real loopback server (`serve`, 127.0.0.1:0, a
temp SQLite database) and the real ONNX embedder of the other semantic tests.

The model:
- every refused call (Lookup, Store, Verify, Invalidate) is INVALID_ARGUMENT (or NOT_FOUND for
  an unknown id) with a message that starts with the field it names ("text:", "namespace.tenant:",
  "threshold:", "answer_token_ids:", "id:", "target:", ...; a string field with invalid UTF-8
  "FIELD: invalid UTF-8 ..."), and leaves nothing behind: the entries (SQLite rows and Stats),
  every Stats counter, the shard-list check (a refused call's list is not compared) and every
  semantic metric stay as they were; only tiercache_rpc_total counts it, under its code;
- the limits: text and prompt not empty or whitespace only, at most max_text_chars characters;
  answer likewise within max_answer_chars; tenant and model_id required, at most
  max_tenant_chars; context_hash hex of at most 128 characters (compared lower-cased); tier one
  of strict/standard/relaxed ("" = the default); threshold 0 (the tier's) or in [floor, 1]
  (within float32 rounding); ttl_seconds at most max_ttl_seconds (0 = the default TTL);
  answer_token_ids at most one per UTF-8 byte of the answer, plus one;
- Lookup: a live entry whose prompt is the text is an exact hit (similarity 1, embed_ms 0);
  else, by brute-force cosine over the namespace's entries (the embedder's own vectors), the
  nearest entry at or above its threshold (the tier's or the explicit one, less the verified
  bonus for a verified entry, never below the floor) that no check refuses (embedding window,
  unread characters, spelling in the strict tier, the guard in its tiers) is the hit; a refused
  one sets guard_rejected and the first refusal's reason; with no hit, the nearest entry is a
  draft (want_draft, similarity in the draft band); `similarity` and `threshold` are the
  served or nearest entry's (0 and the tier's for an empty namespace); a text past the window
  hits only its identical prompt. A hit counts on the entry (hit_count, last_hit_at) and makes it
  the most recently used;
- Store: the entry comes back with the fields stored (namespace lower-cased, ttl 0 = the
  default, truncated_at, answer_token_ids); the same prompt in a namespace replaces the entry
  (not an eviction); past a namespace's capacity its least recently used entry is evicted, past
  the global capacity the least recently used of the tenant holding the most;
- Verify sets the flag and returns the entry; Invalidate by id removes 1, by namespace the
  namespace's entries; an unknown id is NOT_FOUND;
- Stats: entries, namespaces, lookups_total, hits_by_tier (an explicit threshold's hits under
  "explicit"), near_misses_total (a lookup that did not hit, its similarity in the draft band),
  guard_rejections_total, evictions_total, expirations_total (0: nothing expires here),
  embedding_model, threshold_floor, shard_list_mismatches_total (a Lookup or Store whose list
  differs from one seen before: another fingerprint, cut to 64 characters, and more than one
  shard on either side) and shard_list_mismatch (said while there is one);
- metrics (docs/metrics.md): tiercache_semantic_lookups_total{tier, outcome},
  _exact_hits_total, _guard_rejections_total, _evictions_total, _entries,
  _shard_list_mismatches_total, tiercache_rpc_total{semantic, method, code}.
Similarities within 1e-4 of a boundary (a threshold, the draft floor, a tie: a text and the same
text with an emoji the model cannot read embed alike) are taken from the server's answer when
the model allows it either way. Time is a test clock put in the cache's place (the housekeeper
stopped), so TTLs run out where the sequence says: an expired entry is served by nothing, is
NOT_FOUND to Verify and Invalidate, counts expired (not removed) in an Invalidate of its
namespace, and is purged, counted expired, by a Store past a capacity.

Each seed makes every refused call once (63 kinds) among ~45 random accepted ones, in
four namespaces of two tenants, with guard tiers of none, strict, or strict and standard (the
learned verifier off: its decisions are verifier.py's, reviewed on their own), and the limits
lowered so that the boundaries are cheap to reach (texts of 1,500 characters, answers of 900,
4 entries a namespace, 7 in all).

Run offline: 1,000 seeds (SEMANTIC_SERVER_DIFFERENTIAL_SEEDS=1000, ~8 min), 4 by default (~2 s
after the embedder's load). Found: nothing in server.py; the model's own first version read a
tie between two entries as one answer; a tenant or model id of whitespace only was accepted
(refused now, as blank texts are: tests/semantic/test_cache_rules.py). Left as is: an
Invalidate of a namespace whose caller gave up still removes it (Invalidate by id, Store and
Verify check first; the proto promises it for none).
Injected bugs (one at a time in server.py, then reverted) caught 18 of 18 at the default 4
seeds: the explicit threshold or want_draft dropped, truncated_at, hit_count, the draft entry or
`exact` not sent, a refused Lookup's shard list compared, a Store's not compared, Store dropping
`verified` or its token ids, ttl_seconds and truncated_at swapped, Verify always setting true,
an Invalidate without a target answered removed 0, a missing namespace read as an empty one,
similarity sent as the threshold, near misses from the guard's count, evictions and expirations
swapped, the floor sent as the draft floor.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY
from tiercache.v1 import common_pb2
from tiercache.v1 import semantic_pb2 as pb
from tiercache.v1 import semantic_pb2_grpc as pbg

from services.semantic.guard import ParaphraseGuard, spelling_differs
from services.semantic.server import serve
from tests.clock import Clock
from tests.wire import bad_utf8, f32

SEEDS = int(os.environ.get("SEMANTIC_SERVER_DIFFERENTIAL_SEEDS", "4"))
STEPS = int(os.environ.get("SEMANTIC_SERVER_DIFFERENTIAL_STEPS", "45"))
EPS = 1e-4
TIERS = {"strict": 0.97, "standard": 0.95, "relaxed": 0.90}
FLOOR, BONUS, DRAFT_FLOOR, DEFAULT_TIER = 0.85, 0.02, 0.80, "standard"
DRAFT_BOUND = min(DRAFT_FLOOR, f32(DRAFT_FLOOR))
MAX_TEXT, MAX_ANSWER, MAX_TENANT, MAX_TTL = 1500, 900, 64, 10_000
DEFAULT_TTL = 5_000
NS_CAP, TOTAL_CAP = 4, 7
SERVICE = "tiercache.v1.SemanticCache"

# Paraphrase groups: similarities within a group spread over the tiers and the draft band.
GROUPS = [
    ["how do i center a div", "what is the way to center a div", "how can i center a div",
     "centering a div in css", "how do i center a DIV"],
    ["why is the sky blue", "what makes the sky blue", "why does the sky look blue",
     "why is the sky blue \U0001f642"],
    ["what is 2 plus 2", "what is 3 plus 2", "what is two plus two"],
    ["how do i reverse a list in python", "how to reverse a python list",
     "reverse a list in python"],
    ["what is the capital of france", "which city is the capital of france",
     "what is the capital city of france"],
    ["how long should i boil an egg", "how long do i boil an egg", "boiling time for an egg"],
]
# Past the embedding window (256 tokens): the same start, other ends.
LONG = ["lorem ipsum dolor sit amet " * 50 + "what is the answer",
        "lorem ipsum dolor sit amet " * 50 + "who wrote this text"]
TEXTS = [t for g in GROUPS for t in g] + LONG
NAMESPACES = [("acme", "m1", ""), ("acme", "m1", "00ff"), ("beta", "m1", ""),
              ("acme", "m2", "ab")]
FINGERPRINTS = ["", "fp-a", "fp-b", "x" * 70, "x" * 64 + "y"]


@dataclass
class MEntry:
    id: str
    ns: tuple[str, str, str]
    prompt: str
    answer: str
    verified: bool
    ttl: int
    truncated: int
    tokens: list[int]
    created_at: float = 0.0
    seq: int = 0  # store order (the row's label)
    hit_count: int = 0
    last_hit_at: float = 0.0
    used: int = 0  # LRU order: the step of the last Store or hit

    def expired(self, now: float) -> bool:
        return self.ttl > 0 and now >= self.created_at + self.ttl

    def used_at(self) -> float:
        return max(self.last_hit_at, self.created_at)


@dataclass
class Model:
    """What the service must hold and have counted, per the documented contract."""

    guard_tiers: tuple[str, ...]
    now: float
    entries: dict[str, MEntry] = field(default_factory=dict)
    lookups: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    near: int = 0
    guarded: int = 0
    evicted: int = 0
    expired: int = 0
    mismatches: int = 0
    lists: dict[str, int] = field(default_factory=dict)  # fingerprint -> shards, last seen
    metrics: dict[tuple, float] = field(default_factory=dict)  # expected metric deltas
    tick: int = 0

    def bump(self, key: tuple, n: float = 1) -> None:
        self.metrics[key] = self.metrics.get(key, 0) + n

    def ns_entries(self, ns, live: bool = False) -> list[MEntry]:
        return [e for e in self.entries.values()
                if e.ns == ns and not (live and e.expired(self.now))]

    def shard_list(self, shards: int, fp: str) -> None:
        """RecentShardLists.check as documented (all within its window here)."""
        if not fp:
            return
        fp = fp[:64]
        if any(other != fp and max(n, shards) > 1 for other, n in self.lists.items()):
            self.mismatches += 1
            self.bump(("tiercache_semantic_shard_list_mismatches_total", ()))
        self.lists[fp] = shards

    def evict(self, ns) -> None:
        """Past a capacity, every expired entry is purged (counted expired) first; then past the
        namespace's capacity its LRU entries go, past the global the LRU entry of the tenant
        holding the most (ties: the one used longer ago, then the one stored first)."""
        if len(self.ns_entries(ns)) > NS_CAP or len(self.entries) > TOTAL_CAP:
            dead = [e for e in self.entries.values() if e.expired(self.now)]
            for e in dead:
                del self.entries[e.id]
            self.expired += len(dead)
            if dead:
                self.bump(("tiercache_semantic_expirations_total", ()), len(dead))
        lru = sorted(self.ns_entries(ns), key=lambda e: e.used)
        victims = lru[:max(0, len(lru) - NS_CAP)]
        for v in victims:
            del self.entries[v.id]
        while len(self.entries) > TOTAL_CAP:
            held: dict[str, list[MEntry]] = {}
            for e in self.entries.values():
                held.setdefault(e.ns[0], []).append(e)
            v = min((min(es, key=lambda e: e.used) for es in held.values()),
                    key=lambda e: (-len(held[e.ns[0]]), e.used_at(), e.seq))
            del self.entries[v.id]
            victims.append(v)
        self.evicted += len(victims)
        if victims:
            self.bump(("tiercache_semantic_evictions_total", ()), len(victims))


class Oracle:
    """The embedder's own vectors and checks, for brute-force similarities."""

    def __init__(self, onnx) -> None:
        self.onnx = onnx
        self.guard = ParaphraseGuard()
        self._vec: dict[str, np.ndarray] = {}

    def vec(self, text: str) -> np.ndarray:
        if text not in self._vec:
            self._vec[text] = self.onnx.embed([text])[0]
        return self._vec[text]

    def sim(self, a: str, b: str) -> float:
        return 1.0 if a == b else min(1.0, float(self.vec(a) @ self.vec(b)))

    def refusal(self, text: str, prompt: str, tier: str, guard_tiers) -> str:
        """The first check that refuses `prompt`'s entry for `text` ("" = none), in the
        cache's order: window, unread characters, spelling, guard."""
        if text == prompt:
            return ""
        if self.onnx.exceeds_window(text) or self.onnx.exceeds_window(prompt):
            return (f"longer than the embedding window ({self.onnx.max_seq_length} tokens): "
                    "only an exact repeat is served")
        if self.onnx.unseen(text) != self.onnx.unseen(prompt):
            return ("differs in characters the embedding model cannot read (emoji, unknown "
                    "scripts, control characters)")
        why = spelling_differs(text, prompt, tier == "strict")
        if why:
            return why
        if tier in guard_tiers:
            g = self.guard.check(text, prompt)
            return "" if g.ok else g.reason
        return ""


def _metric_values() -> dict[tuple, float]:
    out = {}
    for fam in REGISTRY.collect():
        if not (fam.name.startswith("tiercache_semantic") or fam.name == "tiercache_rpc"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            if s.name == "tiercache_rpc_total" and s.labels.get("service") != "semantic":
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- requests ---------------------------------------------------------------------------------


def ns_pb(ns) -> pb.Namespace:
    return pb.Namespace(tenant=ns[0], model_id=ns[1], context_hash=ns[2])


def spelled(rng: random.Random, ns) -> pb.Namespace:
    """The namespace as a caller may write it: its context hash in either case."""
    return pb.Namespace(tenant=ns[0], model_id=ns[1],
                        context_hash=ns[2].upper() if rng.random() < 0.3 else ns[2])


@dataclass
class Svc:
    stub: pbg.SemanticCacheStub
    channel: grpc.Channel
    store: object  # the EntryStore, for the SQLite row count


def refused(svc: Svc, method: str, req, code: grpc.StatusCode, fld: str) -> str:
    """Calls `method` (`req` a message or raw bytes) and checks it fails with `code` naming
    `fld`; returns the details."""
    if isinstance(req, bytes):
        call = svc.channel.unary_unary(f"/{SERVICE}/{method}")
    else:
        call = getattr(svc.stub, method)
    with pytest.raises(grpc.RpcError) as exc:
        call(req, timeout=30)
    details = exc.value.details() or ""
    assert exc.value.code() == code, (method, req if isinstance(req, bytes) else str(req)[:300],
                                      exc.value.code(), details)
    assert details.startswith(fld + ":"), (method, fld, details)
    assert "\n" not in details
    return details


# ---- the comparison ---------------------------------------------------------------------------


def check_entry(got: pb.SemanticEntry, want: MEntry) -> None:
    assert got.id == want.id
    assert (got.namespace.tenant, got.namespace.model_id, got.namespace.context_hash) == want.ns
    assert (got.prompt, got.answer, got.verified) == (want.prompt, want.answer, want.verified)
    assert (got.ttl_seconds, got.truncated_at) == (want.ttl, want.truncated)
    assert list(got.answer_token_ids) == want.tokens
    assert got.hit_count == want.hit_count, (got.hit_count, want.hit_count, want.prompt)
    assert (got.created_at, got.last_hit_at) == (want.created_at, want.last_hit_at)


def check_stats(svc: Svc, m: Model, before: dict) -> None:
    st = svc.stub.Stats(pb.SemanticStatsRequest(), timeout=30)
    m.bump(("tiercache_rpc_total", (("code", "OK"), ("method", "Stats"),
                                    ("service", "semantic"))))
    assert st.entries == len(m.entries) == svc.store.count()
    assert st.namespaces == len({e.ns for e in m.entries.values()})
    assert st.lookups_total == m.lookups
    assert dict(st.hits_by_tier) == {k: v for k, v in m.hits.items()
                                     if v or k in TIERS}, (dict(st.hits_by_tier), m.hits)
    assert st.near_misses_total == m.near
    assert st.guard_rejections_total == m.guarded
    assert (st.evictions_total, st.expirations_total) == (m.evicted, m.expired)
    assert st.embedding_model == "all-MiniLM-L6-v2"
    assert st.threshold_floor == pytest.approx(FLOOR)
    assert st.shard_list_mismatches_total == m.mismatches
    assert bool(st.shard_list_mismatch) == bool(m.mismatches)
    if m.mismatches:
        assert st.shard_list_mismatch.startswith("shard list differs between orchestrators")
        said = "call" if m.mismatches == 1 else "calls"
        assert f"({m.mismatches} such {said} in all)" in st.shard_list_mismatch
    assert (st.shards_total, st.shards_answered) == (0, 0)
    assert 0 <= st.lookup_p50_ms <= st.lookup_p99_ms
    assert (st.lookup_p99_ms > 0) == (m.lookups > 0)
    # The Stats call itself is counted before it returns: read the metrics after it.
    now = _metric_values()
    for key in set(now) | set(m.metrics):
        name = key[0]
        if name.endswith(("_bucket", "_sum")) or name.startswith("tiercache_rpc_seconds") or \
                name.startswith(("tiercache_semantic_snapshot", "tiercache_semantic_hnsw")):
            continue
        if name == "tiercache_semantic_entries":
            assert now[key] == len(m.entries)
            continue
        assert now.get(key, 0) - before.get(key, 0) == m.metrics.get(key, 0), key


def rpc(m: Model, method: str, code: str = "OK") -> None:
    m.bump(("tiercache_rpc_total", (("code", code), ("method", method),
                                    ("service", "semantic"))))


def expected_lookup(m: Model, o: Oracle, ns, text: str, tier: str, threshold: float):
    """(outcomes the model allows, each as a dict of the answer's fields), resolved tier,
    threshold and whether explicit."""
    name = tier or DEFAULT_TIER
    th = TIERS[name] if threshold == 0 else min(1.0, max(FLOOR, f32(threshold)))
    explicit = threshold != 0

    def th_for(e: MEntry) -> float:
        return max(FLOOR, th - BONUS) if e.verified else th

    held = m.ns_entries(ns, live=True)
    exact = next((e for e in held if e.prompt == text), None)
    if exact is not None:
        return [dict(hit=True, entry=exact, sim=1.0, th=th_for(exact), exact=True,
                     rejected=False, reason="")], name, explicit
    if not held:
        return [dict(hit=False, entry=None, sim=0.0, th=th, exact=False, rejected=False,
                     reason="")], name, explicit
    cands = sorted(((o.sim(text, e.prompt), e) for e in held), key=lambda x: -x[0])
    over = o.onnx.exceeds_window(text)
    options = []
    # Every order of candidates within EPS of each other, every boundary within EPS read
    # either way: the answers the model allows.
    for flip in range(8):
        order = list(cands)
        if flip & 1 and len(order) > 1 and order[0][0] - order[1][0] < EPS:
            order[0], order[1] = order[1], order[0]

        def passes(sim, e, bit, flip=flip):
            t = th_for(e)
            return sim >= t - 1e-6 if abs(sim - t) > EPS else bool(flip & bit)

        def in_band(sim, flip=flip):
            return sim >= DRAFT_BOUND if abs(sim - DRAFT_BOUND) > EPS else bool(flip & 4)

        best_sim, best = order[0]
        if over:
            reason = (o.refusal(text, best.prompt, name, m.guard_tiers)
                      if passes(best_sim, best, 2) else "")
            options.append(dict(hit=False, entry=best if in_band(best_sim) else None,
                                sim=best_sim, th=th_for(best), exact=False,
                                rejected=bool(reason), reason=reason, band=in_band(best_sim)))
            continue
        rejected, reason, hit = False, "", None
        for sim, e in order:
            if not passes(sim, e, 2):
                continue
            why = o.refusal(text, e.prompt, name, m.guard_tiers)
            if why:
                if not rejected:
                    rejected, reason = True, why
                continue
            hit = (sim, e)
            break
        if hit is not None:
            options.append(dict(hit=True, entry=hit[1], sim=hit[0], th=th_for(hit[1]),
                                exact=False, rejected=rejected, reason=reason))
        else:
            options.append(dict(hit=False, entry=best if in_band(best_sim) else None,
                                sim=best_sim, th=th_for(best), exact=False, rejected=rejected,
                                reason=reason, band=in_band(best_sim)))
    return options, name, explicit


def do_lookup(svc: Svc, m: Model, o: Oracle, rng: random.Random) -> None:
    ns = pick_ns(rng)
    held = m.ns_entries(ns, live=True)
    roll = rng.random()
    if held and roll < 0.3:
        text = rng.choice(held).prompt
    elif held and roll < 0.7:  # another text of a held prompt's group: near the boundaries
        prompt = rng.choice(held).prompt
        text = rng.choice(next((g for g in GROUPS if prompt in g), LONG))
    else:
        text = rng.choice(TEXTS)
    tier = rng.choice(["", "", "strict", "standard", "relaxed"])
    threshold = rng.choice([0.0] * 6 + [0.85, 0.88, 0.9, 0.93, 0.96, 0.99, 1.0])
    want_draft = rng.random() < 0.6
    fp, shards = rng.choice(FINGERPRINTS), rng.choice([1, 2, 3])
    req = pb.LookupRequest(namespace=spelled(rng, ns), text=text, tier=tier,
                           threshold=threshold, want_draft=want_draft,
                           shard_list=common_pb2.ShardList(shards=shards, fingerprint=fp))
    options, name, explicit = expected_lookup(m, o, ns, text, tier, threshold)
    r = svc.stub.Lookup(req, timeout=30)
    got_id = r.entry.id if r.HasField("entry") else None
    match = None
    for opt in options:
        want_entry = opt["entry"] if (opt["hit"] or want_draft) else None
        if (r.hit == opt["hit"] and got_id == (want_entry.id if want_entry else None)
                and r.exact == opt["exact"] and r.guard_rejected == opt["rejected"]
                and r.guard_reason == opt["reason"]
                # Two entries tied (an emoji the model cannot read): either may be the nearest.
                and abs(r.similarity - opt["sim"]) <= EPS and abs(r.threshold - opt["th"]) <= 1e-6):
            match = opt
            break
    assert match is not None, (text, name, threshold, want_draft, r, [
        (o_["hit"], o_["entry"] and o_["entry"].prompt, o_["sim"], o_["reason"])
        for o_ in options])
    assert r.tier == name
    assert r.similarity == pytest.approx(match["sim"], abs=EPS), (r.similarity, match["sim"])
    assert r.threshold == pytest.approx(match["th"], abs=1e-6)
    assert r.handler_ms >= r.embed_ms + r.search_ms and r.search_ms > 0
    if r.exact:
        assert r.similarity == 1.0 and r.embed_ms == 0
    else:
        assert r.embed_ms > 0
    # The model follows the server where a boundary was read either way.
    m.tick += 1
    if r.hit:
        e = match["entry"]
        e.hit_count += 1
        e.used, e.last_hit_at = m.tick, m.now
    if got_id is not None:
        check_entry(r.entry, match["entry"])
    m.lookups += 1
    tier_key = "explicit" if explicit else name
    draft = not r.hit and match.get("band", False)
    if r.hit:
        m.hits[tier_key] = m.hits.get(tier_key, 0) + 1
    elif draft:
        m.near += 1
    if r.guard_rejected:
        m.guarded += 1
        m.bump(("tiercache_semantic_guard_rejections_total", ()))
    outcome = "hit" if r.hit else "draft" if draft else "miss"
    m.bump(("tiercache_semantic_lookups_total", (("outcome", outcome), ("tier", tier_key))))
    if r.hit and match["entry"].verified:
        m.bump(("tiercache_semantic_verified_hits_total", (("tier", tier_key),)))
    m.bump(("tiercache_semantic_search_seconds_count", ()))
    if r.exact:
        m.bump(("tiercache_semantic_exact_hits_total", ()))
    else:
        m.bump(("tiercache_semantic_embed_seconds_count", ()))
    m.shard_list(shards, fp)
    rpc(m, "Lookup")


def pick_ns(rng: random.Random) -> tuple[str, str, str]:
    """Half the calls in one namespace, so that its entries meet."""
    return NAMESPACES[0] if rng.random() < 0.5 else rng.choice(NAMESPACES)


def do_store(svc: Svc, m: Model, o: Oracle, rng: random.Random) -> None:
    ns = pick_ns(rng)
    prompt = rng.choice(TEXTS[:-1] if rng.random() < 0.9 else TEXTS)
    answer = rng.choice(["a", "Use flexbox.", "Rayleigh scattering.", "é" * 3,
                         "z" * MAX_ANSWER])
    nbytes = len(answer.encode())
    tokens = rng.choice([[], [], [7], list(range(nbytes + 1)), [0, 2**32 - 1]])
    if len(tokens) > nbytes + 1:
        tokens = tokens[:1]
    ttl = rng.choice([0, 0, 1, 60, MAX_TTL])
    truncated = rng.choice([0, 0, 1, 2**32 - 1])
    verified = rng.random() < 0.3
    fp, shards = rng.choice(FINGERPRINTS), rng.choice([1, 2, 3])
    req = pb.StoreRequest(namespace=spelled(rng, ns), prompt=prompt, answer=answer,
                          verified=verified, ttl_seconds=ttl, truncated_at=truncated,
                          answer_token_ids=tokens,
                          shard_list=common_pb2.ShardList(shards=shards, fingerprint=fp))
    eid = svc.stub.Store(req, timeout=30).id
    assert eid and eid not in m.entries
    old = next((e for e in m.ns_entries(ns) if e.prompt == prompt), None)
    if old is not None:
        del m.entries[old.id]  # replaced: neither evicted nor expired
    m.tick += 1
    m.entries[eid] = MEntry(eid, ns, prompt, answer, verified, ttl or DEFAULT_TTL, truncated,
                            list(tokens), m.now, m.tick, used=m.tick)
    m.evict(ns)
    m.shard_list(shards, fp)
    rpc(m, "Store")


def do_verify(svc: Svc, m: Model, rng: random.Random) -> None:
    if m.entries and rng.random() < 0.8:
        e = rng.choice(sorted(m.entries.values(), key=lambda e: e.seq))
        if e.expired(m.now):  # never served again: not found, nothing written
            details = refused(svc, "Verify", pb.VerifyRequest(id=e.id, verified=True),
                              grpc.StatusCode.NOT_FOUND, "id")
            assert "expired" in details
            rpc(m, "Verify", "NOT_FOUND")
            return
        flag = rng.random() < 0.5
        got = svc.stub.Verify(pb.VerifyRequest(id=e.id, verified=flag), timeout=30)
        e.verified = flag
        check_entry(got, e)
        rpc(m, "Verify")
    else:
        refused(svc, "Verify", pb.VerifyRequest(id=rng.choice(["deadbeef", "x" * 100]),
                                                verified=True), grpc.StatusCode.NOT_FOUND, "id")
        rpc(m, "Verify", "NOT_FOUND")


def do_invalidate(svc: Svc, m: Model, rng: random.Random) -> None:
    if rng.random() < 0.5:
        if m.entries and rng.random() < 0.8:
            e = rng.choice(sorted(m.entries.values(), key=lambda e: e.seq))
            if e.expired(m.now):  # left to the purge, which counts it expired
                details = refused(svc, "Invalidate", pb.InvalidateRequest(id=e.id),
                                  grpc.StatusCode.NOT_FOUND, "id")
                assert "expired" in details
                rpc(m, "Invalidate", "NOT_FOUND")
                return
            del m.entries[e.id]
            assert svc.stub.Invalidate(pb.InvalidateRequest(id=e.id), timeout=30).removed == 1
            rpc(m, "Invalidate")
        else:
            refused(svc, "Invalidate", pb.InvalidateRequest(id="0" * 32),
                    grpc.StatusCode.NOT_FOUND, "id")
            rpc(m, "Invalidate", "NOT_FOUND")
        return
    ns = rng.choice(NAMESPACES + [("nobody", "m1", "")])
    gone = m.ns_entries(ns)
    got = svc.stub.Invalidate(pb.InvalidateRequest(namespace=spelled(rng, ns)), timeout=30)
    dead = [e for e in gone if e.expired(m.now)]  # removed, but counted expired
    assert got.removed == len(gone) - len(dead)
    for e in gone:
        del m.entries[e.id]
    m.expired += len(dead)
    if dead:
        m.bump(("tiercache_semantic_expirations_total", ()), len(dead))
    rpc(m, "Invalidate")


BAD_NAMESPACES = [
    (None, "namespace"),
    (pb.Namespace(model_id="m1"), "namespace.tenant"),
    (pb.Namespace(tenant="acme"), "namespace.model_id"),
    (pb.Namespace(tenant="a" * (MAX_TENANT + 1), model_id="m1"), "namespace.tenant"),
    (pb.Namespace(tenant="acme", model_id="m" * (MAX_TENANT + 1)), "namespace.model_id"),
    (pb.Namespace(tenant="acme", model_id="m1", context_hash="xyz"), "namespace.context_hash"),
    (pb.Namespace(tenant="acme", model_id="m1", context_hash="a" * 129),
     "namespace.context_hash"),
]
NOT_FOUND, INVALID = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT


def refusals(rng: random.Random) -> list[tuple[str, object, grpc.StatusCode, str]]:
    """Every kind of call the contract refuses, once: (method, request or raw bytes, code, the
    field named). Lookup and Store come with a shard list that must not be compared."""
    ns = ns_pb(rng.choice(NAMESPACES))
    sl = common_pb2.ShardList(shards=3, fingerprint=rng.choice(["fp-zz", "fp-yy"]))

    def lookup(**kw) -> pb.LookupRequest:
        base = dict(namespace=ns, text="why is the sky blue", shard_list=sl)
        base.update(kw)
        return pb.LookupRequest(**{k: v for k, v in base.items() if v is not None})

    def store(**kw) -> pb.StoreRequest:
        base = dict(namespace=ns, prompt="why is the sky blue", answer="physics", shard_list=sl)
        base.update(kw)
        return pb.StoreRequest(**{k: v for k, v in base.items() if v is not None})

    out = []
    for bad, fld in BAD_NAMESPACES:
        out += [("Lookup", lookup(namespace=bad), INVALID, fld),
                ("Store", store(namespace=bad), INVALID, fld)]
        if bad is not None:
            out.append(("Invalidate", pb.InvalidateRequest(namespace=bad), INVALID, fld))
    out.append(("Invalidate", pb.InvalidateRequest(namespace=pb.Namespace()), INVALID,
                "namespace.tenant"))
    for text in ("", "   ", "\n\t \u2028", "q" * (MAX_TEXT + 1)):
        out += [("Lookup", lookup(text=text), INVALID, "text"),
                ("Store", store(prompt=text), INVALID, "prompt")]
    for tier in ("lenient", "Strict", "explicit", " standard"):
        out.append(("Lookup", lookup(tier=tier), INVALID, "tier"))
    for th in (0.5, 0.84, 1.01, 1.5, -0.9, math.nan, math.inf, -math.inf, 1e-30):
        out.append(("Lookup", lookup(threshold=th, tier=rng.choice(["", "relaxed"])), INVALID,
                    "threshold"))
    for answer in ("", "  \n", "a" * (MAX_ANSWER + 1)):
        out.append(("Store", store(answer=answer), INVALID, "answer"))
    for ttl in (MAX_TTL + 1, 2**32 - 1):
        out.append(("Store", store(ttl_seconds=ttl), INVALID, "ttl_seconds"))
    for answer in ("physics", "\u00e9", "\U0001f642"):
        # One more id than one per UTF-8 byte and an end of sequence.
        ids = list(range(len(answer.encode()) + 2))
        out.append(("Store", store(answer=answer, answer_token_ids=ids), INVALID,
                    "answer_token_ids"))
    # Invalid UTF-8 in a string field: the bytes as a client may send them.
    for method, msg, fld in [
            ("Lookup", lookup(text="PLACEHOLDER1"), "text"),
            ("Lookup", lookup(namespace=pb.Namespace(tenant="PLACEHOLDER1", model_id="m1")),
             "namespace.tenant"),
            ("Lookup", lookup(tier="PLACEHOLDER1"), "tier"),
            ("Store", store(prompt="PLACEHOLDER1"), "prompt"),
            ("Store", store(answer="PLACEHOLDER1"), "answer"),
            ("Verify", pb.VerifyRequest(id="PLACEHOLDER1"), "id"),
            ("Invalidate", pb.InvalidateRequest(id="PLACEHOLDER1"), "id")]:
        out.append((method, bad_utf8(msg, "PLACEHOLDER1"), INVALID, fld))
    out += [("Verify", pb.VerifyRequest(verified=True), INVALID, "id"),
            ("Verify", pb.VerifyRequest(id="deadbeef", verified=True), NOT_FOUND, "id"),
            ("Verify", pb.VerifyRequest(id="x" * 100), NOT_FOUND, "id"),
            ("Invalidate", pb.InvalidateRequest(), INVALID, "target"),
            ("Invalidate", pb.InvalidateRequest(id=""), INVALID, "id"),
            ("Invalidate", pb.InvalidateRequest(id="0" * 32), NOT_FOUND, "id")]
    rng.shuffle(out)
    return out


def do_refused(svc: Svc, m: Model, case) -> None:
    """One call the contract refuses: nothing may change but its RPC count."""
    method, req, code, fld = case
    details = refused(svc, method, req, code, fld)
    if isinstance(req, bytes):
        assert "UTF-8" in details
    rpc(m, method, code.name)


def do_boundary(svc: Svc, m: Model, rng: random.Random) -> None:
    """The limits are inclusive: a namespace and a text at their longest, a threshold at the
    floor or at 1, are accepted."""
    req = pb.LookupRequest(namespace=pb.Namespace(tenant="t" * MAX_TENANT,
                                                  model_id="m" * MAX_TENANT,
                                                  context_hash="A" * 128),
                           text="q" * MAX_TEXT, threshold=rng.choice([FLOOR, 1.0]))
    r = svc.stub.Lookup(req, timeout=30)
    assert not r.hit and not r.HasField("entry") and r.similarity == 0
    assert r.threshold == pytest.approx(req.threshold, abs=1e-6)
    m.lookups += 1
    m.bump(("tiercache_semantic_lookups_total", (("outcome", "miss"), ("tier", "explicit"))))
    m.bump(("tiercache_semantic_search_seconds_count", ()))
    m.bump(("tiercache_semantic_embed_seconds_count", ()))
    rpc(m, "Lookup")


def run_seed(seed: int, make_cfg, embedder, onnx_embedder, oracle: Oracle) -> None:
    rng = random.Random(seed)
    guard_tiers = rng.choice([(), ("strict",), ("strict", "standard")])
    cfg = make_cfg(guard_tiers=guard_tiers, verifier_tiers=(), max_text_chars=MAX_TEXT,
                   max_answer_chars=MAX_ANSWER, max_tenant_chars=MAX_TENANT,
                   max_ttl_seconds=MAX_TTL, default_ttl_seconds=DEFAULT_TTL,
                   max_entries_per_namespace=NS_CAP, max_entries_total=TOTAL_CAP,
                   expiry_interval_s=3600)
    before = _metric_values()
    svc = serve(cfg, embedder=embedder)
    # Time is the test's: the housekeeper's purge (its first at a second in) is stopped, and
    # expired entries stay held, never served, until a Store past capacity purges them.
    svc.housekeeper.stop()
    clock = Clock(svc.cache.clock())
    svc.cache.clock = clock
    m = Model(guard_tiers, clock.t)
    try:
        with grpc.insecure_channel(svc.handle.address) as ch:
            s = Svc(pbg.SemanticCacheStub(ch), ch, svc.cache.store)
            # Every refusal once per seed, spread over the sequence (what it leaves behind
            # shows in the figures checked after it).
            cases = refusals(rng)
            ops = ["refused"] * len(cases) + rng.choices(
                ["lookup", "store", "verify", "invalidate", "boundary", "time"],
                [8, 5, 1.5, 1.5, 0.3, 1], k=STEPS)
            rng.shuffle(ops)
            for op in ops:
                if op == "time":
                    clock.t += rng.choice([1, 30, 100, 1000, 6000])
                    m.now = clock.t
                elif op == "lookup":
                    do_lookup(s, m, oracle, rng)
                elif op == "store":
                    do_store(s, m, oracle, rng)
                elif op == "verify":
                    do_verify(s, m, rng)
                elif op == "invalidate":
                    do_invalidate(s, m, rng)
                elif op == "boundary":
                    do_boundary(s, m, rng)
                else:
                    do_refused(s, m, cases.pop())
                check_stats(s, m, before)
    finally:
        svc.handle.stop(0)
        svc.housekeeper.stop()
        svc.cache.store.close()


@pytest.fixture(scope="module")
def oracle(onnx_embedder) -> Oracle:
    return Oracle(onnx_embedder)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_server_matches_the_model(seed, make_cfg, embedder, onnx_embedder, oracle):
    run_seed(seed, make_cfg, embedder, onnx_embedder, oracle)
