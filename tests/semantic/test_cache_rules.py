"""SemanticCache rules a mutation audit found unguarded: the bounds of each input (the largest
value accepted, the next refused), context hashes in either case, no TTL under a default of
0, the draft floor's own value, similarities above 1 from float32 rounding, which refusal a
lookup reports (and that the metric counts it), the embedding-window rule seen past the
window, the vectors kept for the Store after a missed Lookup, a namespace's evictions counted
toward its tenant's quota, and an entry at its expiry time at a restart. Fake vectors
(test_cache_edges.FixedEmbedder): pure logic."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidArgument, NotFound
from services.semantic.cache import RECENT_VECTORS, Namespace
from services.semantic.store import unpack_tokens
from tests.semantic import test_cache_edges as edges
from tests.semantic.test_cache_edges import DIM, A, CountingEmbedder, WindowEmbedder
from tests.semantic.test_snapshot import metric

emb, make_cache = edges.emb, edges.make_cache  # the fixtures of test_cache_edges

LIMITS = dict(max_text_chars=40, max_answer_chars=60, max_tenant_chars=64,
              max_ttl_seconds=1000, default_ttl_seconds=100)


def _store(c, **kw):
    args = dict(ns=A, prompt="A fine question?", answer="A fine answer.")
    args.update(kw)
    return c.store_entry(args.pop("ns"), **args)


@pytest.mark.parametrize(("field", "at_limit", "past_limit"), [
    ("namespace.tenant", dict(ns=Namespace("t" * 64, "m")), dict(ns=Namespace("t" * 65, "m"))),
    ("namespace.model_id", dict(ns=Namespace("t", "m" * 64)), dict(ns=Namespace("t", "m" * 65))),
    ("namespace.context_hash", dict(ns=Namespace("t", "m", "a" * 128)),
     dict(ns=Namespace("t", "m", "a" * 129))),
    ("prompt", dict(prompt="q" * 40), dict(prompt="q" * 41)),
    ("answer", dict(answer="a" * 60), dict(answer="a" * 61)),
    ("ttl_seconds", dict(ttl_seconds=1000), dict(ttl_seconds=1001)),
    # One id per UTF-8 byte plus an end of sequence: "ab" takes 3, not 4.
    ("answer_token_ids", dict(answer="ab", answer_token_ids=[1, 2, 3]),
     dict(answer="ab", answer_token_ids=[1, 2, 3, 4])),
    ("answer_token_ids", dict(answer_token_ids=[2**32 - 1]), dict(answer_token_ids=[2**32])),
])
def test_each_store_limit_accepts_its_bound_and_refuses_one_past_it(make_cache, field,
                                                                    at_limit, past_limit):
    """The limits are inclusive, as their messages say ("longer than N", "in [0, N]", "at
    most one per byte, and an end of sequence", "[0, 2^32)"): the bound itself is stored, one
    past it is INVALID_ARGUMENT naming the field and writes nothing."""
    c = make_cache(**LIMITS)
    with pytest.raises(InvalidArgument) as exc:
        _store(c, **past_limit)
    assert exc.value.field == field
    assert c.store.count() == 0
    e = _store(c, **at_limit)
    assert c.get(e.id) == e and c.store.count() == 1
    if "answer_token_ids" in at_limit:
        assert unpack_tokens(c.store.get(e.id).answer_tokens) == at_limit["answer_token_ids"]


def test_a_lookup_text_at_the_limit_is_looked_up_and_one_past_it_refused(make_cache):
    """Lookup's text limit is inclusive too, and a refused lookup is not counted."""
    c = make_cache(**LIMITS)
    with pytest.raises(InvalidArgument) as exc:
        c.lookup(A, "q" * 41)
    assert exc.value.field == "text" and c.stats().lookups_total == 0
    assert not c.lookup(A, "q" * 40).hit
    assert c.stats().lookups_total == 1


def test_a_context_hash_names_the_same_namespace_in_either_case(make_cache):
    """A hex context hash is a number: "AB12" and "ab12" are one conversation context, so an
    answer stored under one is found, and invalidated, under the other."""
    c = make_cache()
    upper, lower = Namespace("t", "m", "AB12"), Namespace("t", "m", "ab12")
    e = c.store_entry(upper, "query", "an answer")
    assert e.namespace == lower
    r = c.lookup(lower, "query")
    assert r.hit and r.entry.id == e.id
    assert c.invalidate_namespace(upper) == 1 and c.store.count() == 0
    c.check_integrity()


def test_an_entry_without_ttl_never_expires_under_a_default_of_zero(make_cache, clock):
    """default_ttl_seconds 0 means never expire: an entry stored without a TTL is served
    however long after, and the housekeeper's expiry leaves it."""
    c = make_cache(default_ttl_seconds=0)
    e = c.store_entry(A, "query", "an answer")
    assert e.ttl_seconds == 0
    clock.t += 10 * 365 * 24 * 3600
    assert c.lookup(A, "query").hit
    assert c.expire() == 0 and c.store.count() == 1
    c.verify(e.id, True)  # not refused as expired either


def test_an_expired_entry_is_not_found_by_invalidate_and_left_to_the_purge(make_cache, clock):
    """An entry past its TTL (not purged yet) is gone to Invalidate as to Verify and lookups:
    NOT_FOUND, so Feedback's bad rating says invalidated false (the orchestrator's docs), and
    the housekeeper's purge removes it, counted as expired. It was removed and counted 1."""
    c = make_cache()
    e = c.store_entry(A, "query", "an answer", ttl_seconds=60)
    clock.t = e.created_at + 60
    with pytest.raises(NotFound, match="expired"):
        c.invalidate_id(e.id)
    assert c.stats().entries == 1
    assert c.expire() == 1
    s = c.stats()
    assert (s.entries, s.expirations_total) == (0, 1) and c.store.count() == 0
    live = c.store_entry(A, "query", "an answer", ttl_seconds=60)
    clock.t = live.created_at + 59
    assert c.invalidate_id(live.id) == 1


def test_invalidating_a_namespace_counts_its_expired_entries_as_expired(make_cache, clock):
    """Invalidate of a namespace removes an entry past its TTL too, but counts it as the purge
    would (expired), not in `removed`: by id the same entry is NOT_FOUND, so Feedback and an
    operator's Invalidate of the namespace would otherwise disagree on what was invalidated.
    It was counted in `removed` and never as expired."""
    c = make_cache()
    old = c.store_entry(A, "query", "an answer", ttl_seconds=60)
    c.store_entry(A, "another query", "another answer", ttl_seconds=600)
    clock.t = old.created_at + 60
    assert c.invalidate_namespace(A) == 1
    s = c.stats()
    assert (s.entries, s.expirations_total) == (0, 1) and c.store.count() == 0
    assert c.expire() == 0
    c.check_integrity()


def test_a_candidate_exactly_at_the_draft_floor_is_a_draft(make_cache, emb):
    """draft_floor: near-misses "at or above it" are drafts, and counted as near misses.
    0.75 is exact in float32, so the similarity is the floor itself."""
    c = make_cache(draft_floor=0.75)
    emb.at("at the floor", 0.75, 2)
    e = c.store_entry(A, "at the floor", "a draft")
    r = c.lookup(A, "query", want_draft=True)
    assert r.similarity == 0.75 and not r.hit
    assert r.entry is not None and r.entry.id == e.id
    assert c.stats().near_misses_total == 1


def test_a_float32_similarity_at_a_draft_floor_float32_rounds_down_is_a_draft(make_cache, emb):
    """draft_floor 0.9 is 0.89999998 in float32, the similarity an entry at cosine 0.9 gets:
    that is at the floor (a draft, counted as a near miss), as it is at a threshold."""
    c = make_cache(draft_floor=0.9, threshold_floor=0.9, tier_relaxed=0.9)
    emb.at("at the floor", 0.9, 2)
    e = c.store_entry(A, "at the floor", "a draft")
    r = c.lookup(A, "query", tier="strict", want_draft=True)
    assert r.similarity < 0.9 and not r.hit
    assert r.entry is not None and r.entry.id == e.id
    assert c.stats().near_misses_total == 1


def test_a_similarity_rounded_past_one_is_reported_as_one(make_cache, emb):
    """float32 inner products of unit vectors can come out a hair above 1 (1.0000001): a
    cosine is at most 1, and that is what a lookup reports."""
    c = make_cache()
    over = np.zeros(DIM, np.float32)
    over[0] = np.nextafter(np.float32(1.0), np.float32(2.0))
    emb.fixed["twin"] = over
    e = c.store_entry(A, "twin", "an answer")
    r = c.lookup(A, "query", tier="strict")
    assert r.hit and r.entry.id == e.id and not r.exact
    assert r.similarity == 1.0


def test_a_lookup_reports_the_refusal_of_its_nearest_refused_candidate(make_cache, emb):
    """guard_reason says why the best candidate was refused: with two refused candidates, the
    nearer one's reason, not the last one looked at."""
    c = make_cache()
    emb.at("nearer", 0.99, 2)
    emb.at("farther", 0.98, 3)
    c.store_entry(A, "nearer", "one")
    c.store_entry(A, "farther", "two")
    c._second_opinion = lambda text, prompt, sim, tier: f"refused {prompt}"
    r = c.lookup(A, "query", tier="relaxed", want_draft=True)
    assert not r.hit and r.guard_rejected and r.guard_reason == "refused nearer"
    assert r.entry.prompt == "nearer"


def test_a_text_past_the_window_close_to_a_short_prompt_is_refused_by_the_window_rule(
        cache_factory, emb):
    """Past the embedding window only an exact repeat is served, also when the stored prompt
    near it is short: the lookup says the window rule refused the candidate."""
    w = WindowEmbedder()
    w.fixed = emb.fixed
    w.fixed["short prompt"] = w.fixed["query"]  # where every "LONG..." text lands
    c = cache_factory(w, guard_tiers=(), verifier_tiers=())
    e = c.store_entry(A, "short prompt", "an answer")
    r = c.lookup(A, "LONG document, then a question", want_draft=True)
    assert not r.hit and r.entry.id == e.id
    assert r.guard_rejected and "embedding window" in r.guard_reason
    assert c.stats().guard_rejections_total == 1


def test_the_vectors_kept_for_stores_drop_the_oldest_lookup_first(cache_factory):
    """The kept vectors are bounded, newest last: past the bound the oldest lookup's goes, so
    the Store that follows the latest missed Lookup still takes its vector."""
    counting = CountingEmbedder()
    c = cache_factory(counting, guard_tiers=(), verifier_tiers=())
    for i in range(RECENT_VECTORS + 5):
        assert not c.lookup(A, f"question {i}").hit
    last = f"question {RECENT_VECTORS + 4}"
    counting.calls.clear()
    c.store_entry(A, last, "an answer")
    assert counting.calls == []
    c.store_entry(A, "question 0", "an answer")  # its vector was the first to go
    assert counting.calls == ["question 0"]


def test_a_namespace_eviction_counts_toward_the_tenant_quota(make_cache, clock):
    """An entry evicted for its namespace's limit leaves the tenant's count too: a Store that
    takes the namespace over its limit, with the tenant then at its quota, evicts one entry,
    not one more for a quota already met."""
    c = make_cache(max_entries_per_namespace=2, max_entries_per_tenant=3)
    other = Namespace(A.tenant, A.model_id, "0f")
    kept = c.store_entry(other, "in another namespace", "x")
    first = []
    for i in range(3):
        clock.t += 1
        first.append(c.store_entry(A, f"question {i}", "x"))
    assert [e.id in c._by_id for e in first] == [False, True, True] and kept.id in c._by_id
    assert c.stats().evictions_total == 1 and c.store.count() == 3
    c.check_integrity()


def test_a_refused_lookup_is_counted_in_the_guard_rejections_metric(make_cache, emb):
    """tiercache_semantic_guard_rejections_total counts lookups whose best candidate a check
    refused, as Stats' guard_rejections_total does; a lookup that hits adds nothing."""
    c = make_cache()
    emb.at("near", 0.99, 2)
    c.store_entry(A, "near", "an answer")
    before = metric("tiercache_semantic_guard_rejections_total")
    assert c.lookup(A, "query", tier="relaxed").hit
    c._second_opinion = lambda text, prompt, sim, tier: "refused"
    assert c.lookup(A, "query", tier="relaxed").guard_rejected
    assert metric("tiercache_semantic_guard_rejections_total") == before + 1
    assert c.stats().guard_rejections_total == 1


def test_an_entry_at_its_expiry_time_is_not_loaded(make_cache, clock):
    """An entry is expired from the instant its TTL runs out (created_at + ttl): no lookup
    serves it then, and a restart at that instant does not load it either (it deletes it and
    counts it expired)."""
    c = make_cache()
    e = c.store_entry(A, "query", "an answer", ttl_seconds=60)
    clock.t = e.created_at + 60
    assert not c.lookup(A, "query").hit
    again = make_cache()
    s = again.stats()
    assert (s.entries, s.expirations_total) == (0, 1) and again.store.count() == 0


@pytest.mark.parametrize(("stored_ttl", "first", "lowered"), [
    (600, dict(default_ttl_seconds=0, max_ttl_seconds=1000),
     dict(default_ttl_seconds=0, max_ttl_seconds=100)),
    # Stored to never expire (TTL 0 under a default of 0), then a default set: the cap.
    (0, dict(default_ttl_seconds=0, max_ttl_seconds=1000),
     dict(default_ttl_seconds=50, max_ttl_seconds=100)),
])
def test_a_ttl_cut_at_a_restart_stays_cut_at_the_next(make_cache, clock, stored_ttl, first,
                                                      lowered):
    """A restart under a lower TTL limit cuts an entry's TTL to it ("a longer one is cut to
    it"); once the entry has expired under the cut TTL, a restart under the old limit again
    must not serve it: the cut was made in memory only, and an expired answer (not yet purged
    by the housekeeper) came back for its old TTL, or for good."""
    c = make_cache(**first)
    e = c.store_entry(A, "query", "an answer", ttl_seconds=stored_ttl)
    clock.t += 1
    c = make_cache(**lowered)
    assert c.get(e.id).ttl_seconds == 100
    clock.t = e.created_at + 150
    assert not c.lookup(A, "query").hit  # expired under the cut TTL
    c = make_cache(**first)
    assert not c.lookup(A, "query").hit
    s = c.stats()
    assert (s.entries, s.expirations_total, c.store.count()) == (0, 1, 0)


def test_a_ttl_cut_not_written_on_a_full_disk_still_applies_in_memory(make_cache,
                                                                    monkeypatch):
    """Writing the cut TTLs is best effort: on a full disk the start goes on (as its other
    writes at load do), memory cuts the TTLs as before and the next start writes them."""
    from services.common.errors import ResourceExhausted
    from services.semantic.store import EntryStore

    c = make_cache(default_ttl_seconds=0, max_ttl_seconds=1000)
    e = c.store_entry(A, "query", "an answer", ttl_seconds=600)

    def full(self, cap, never):
        raise ResourceExhausted("disk: the entry store is full")

    monkeypatch.setattr(EntryStore, "cap_ttls", full)
    c = make_cache(default_ttl_seconds=0, max_ttl_seconds=100)
    assert c.get(e.id).ttl_seconds == 100 and c.store.get(e.id).ttl_seconds == 600



@pytest.mark.parametrize("blank", [" \t", "\u3164", "\u200b", "\u2800"])
@pytest.mark.parametrize("field", ["tenant", "model_id"])
def test_a_whitespace_only_tenant_or_model_is_refused_and_nothing_is_written(make_cache, field,
                                                                             blank):
    """A differential review: " " passed as a tenant or model id, though it names nobody's
    (text fields refuse whitespace only); refused now, naming the field, nothing stored. So
    are ids of only invisible characters (the Hangul filler, a zero-width space): the rule
    of blank text (errors.blank), which strip() missed."""
    c = make_cache()
    ns = Namespace(**{"tenant": "t", "model_id": "m", field: blank})
    with pytest.raises(InvalidArgument, match=f"namespace.{field}: required"):
        _store(c, ns=ns)
    with pytest.raises(InvalidArgument, match=f"namespace.{field}: required"):
        c.lookup(ns, "A fine question?")
    assert c.stats().entries == 0 and c.stats().lookups_total == 0


def test_a_lookup_whose_caller_left_says_the_lookup_was_not_made(make_cache):
    """A Lookup whose caller had gone said "before the lookup was written", though a lookup
    writes nothing; a Store's refusal still says its answer was not written."""
    from services.common.errors import DeadlineExceeded

    c = make_cache()
    with pytest.raises(DeadlineExceeded, match="before the lookup was made: nothing changed"):
        c.lookup(A, "A fine question?", wanted=lambda: False)
    with pytest.raises(DeadlineExceeded, match="before the answer was written: nothing"):
        _store(c, wanted=lambda: False)


class _UnreadEmbedder(edges.FixedEmbedder):
    """Reads ASCII only: every other character is unseen (MiniLM maps Hangul it lacks to
    [UNK], whether typed composed or decomposed)."""

    def unseen(self, text: str) -> str:
        return "".join(ch for ch in text if not ch.isascii() and not ch.isspace())


def test_the_same_unread_text_composed_otherwise_hits_its_entry(cache_factory):
    """A Korean question typed decomposed (NFD, as macOS writes it) embeds to the vector of
    its composed (NFC) form, but its unread characters are jamo, not syllables: it missed its
    own entry at similarity 1.0, in every tier. What differs beyond composition still does."""
    import unicodedata

    e = _UnreadEmbedder()
    nfc = "한국의 수도는 어디입니까?"
    nfd = unicodedata.normalize("NFD", nfc)
    for text in (nfc, nfd, "일본의 수도는 어디입니까?"):
        e.at(text, 1.0, 1)
    c = cache_factory(e, guard_tiers=(), verifier_tiers=())
    c.store_entry(A, nfc, "서울")
    r = c.lookup(A, nfd, tier="strict")
    assert r.hit and r.entry.answer == "서울"
    assert not c.lookup(A, "일본의 수도는 어디입니까?", tier="relaxed").hit


@pytest.mark.parametrize("invisible", ["\u200b", "\u200b\u200c\ufeff", " \u2060\n\x00", "\u200e",
                                       "\u2800\u2800"])
def test_text_of_only_invisible_characters_is_refused_and_nothing_is_written(make_cache,
                                                                             invisible):
    """str.strip() kept zero-width and control characters as content: a question or answer
    of only "\\u200b" was stored, and every other invisible question then matched it. Refused
    as empty, naming the field, nothing stored or counted; a visible character among them is
    text."""
    c = make_cache()
    for field in ("prompt", "answer"):
        with pytest.raises(InvalidArgument, match=f"{field}: must not be empty"):
            _store(c, **{field: invisible})
    with pytest.raises(InvalidArgument, match="text: must not be empty"):
        c.lookup(A, invisible)
    assert c.stats().entries == 0 and c.stats().lookups_total == 0
    _store(c, prompt=invisible + "Why?", answer=invisible + "Because.")
    assert c.stats().entries == 1


def test_invalidating_a_tenant_erases_its_every_namespace_from_the_files(make_cache):
    """Erasure on request: a namespace Invalidate needs each model id and context hash, which
    no caller can list, so a tenant's entries could not all be removed. `invalidate_tenant`
    removes them in every namespace, leaves other tenants' alone, and leaves none of their
    text readable in the database file or its WAL (deleted rows stayed there as written)."""
    import os

    c = make_cache(**LIMITS)
    secret = "ZEBRAPOX-7731"
    spaces = [A, Namespace(A.tenant, "other-model", ""), Namespace(A.tenant, "smollm2", "ab12")]
    for i, ns in enumerate(spaces):
        _store(c, ns=ns, prompt=f"{secret} q{i}?", answer=f"{secret} a{i}.")
    kept = _store(c, ns=edges.B, prompt="B's question?", answer="B's answer.")
    assert c.invalidate_tenant(A.tenant) == 3
    assert c.store.count() == 1 and c.get(kept.id) == kept
    assert all(c.index_of(ns) is None or len(c._ns_lru.get(ns, ())) == 0 for ns in spaces)
    path = c.store.path
    for f in (path, path + "-wal"):
        if os.path.exists(f):
            with open(f, "rb") as fh:
                assert secret.encode() not in fh.read(), f
    assert c.invalidate_tenant(A.tenant) == 0  # nothing left: not an error
    for bad in ("", " ", "t" * 65):
        with pytest.raises(InvalidArgument) as exc:
            c.invalidate_tenant(bad)
        assert exc.value.field == "tenant"


def test_a_store_whose_caller_left_while_its_row_was_written_leaves_nothing(make_cache):
    """A race audit: `wanted` was asked only before the row was written, and the write waits
    for the store's lock behind every other Store and flush. A deadline passing meanwhile left
    the answer in memory and SQLite, served to everyone, its caller told DEADLINE_EXCEEDED.
    Asked again once the row is written: refused, the row deleted, memory never holding it."""
    from services.common.errors import DeadlineExceeded

    c = make_cache()
    asked = []

    def wanted() -> bool:  # the caller waits through the write, and has gone once it is done
        asked.append(c.store.count())
        return len(asked) == 1

    with pytest.raises(DeadlineExceeded, match="before the answer was written"):
        _store(c, wanted=wanted)
    assert asked == [0, 1]  # asked before the write, and again once the row was there
    assert c.stats().entries == 0 and c.store.count() == 0
    assert not c.lookup(A, "A fine question?").hit
    assert _store(c).id  # nothing left in the way of the next Store of that prompt
    assert c.stats().entries == 1 and c.store.count() == 1


def _gone_after_the_write(c, e, asked: list):
    """A `wanted` whose caller waits through the write and has gone once it is done; `asked`
    gets the row's verified flag at each ask (None once the row is gone)."""
    def wanted() -> bool:
        row = c.store.get(e.id)
        asked.append(row and row.verified)
        return len(asked) == 1
    return wanted


def test_a_verify_whose_caller_left_while_its_flag_was_written_changes_nothing(make_cache):
    """A race audit: Verify asked `wanted` only before the write, as Store once did: a deadline
    passing during the write left the flag set (the entry served at the verified threshold)
    though its caller was told DEADLINE_EXCEEDED. Asked again once written: the old flag is
    written back, memory never holding the new one."""
    from services.common.errors import DeadlineExceeded

    c = make_cache()
    e = _store(c)
    asked: list = []
    with pytest.raises(DeadlineExceeded, match="before the rating was written: nothing"):
        c.verify(e.id, True, wanted=_gone_after_the_write(c, e, asked))
    assert asked == [False, True]  # asked before the write, and again once it was there
    assert not c.get(e.id).verified and not c.store.get(e.id).verified
    assert c.verify(e.id, True).verified and c.store.get(e.id).verified


def test_a_verify_whose_undo_fails_leaves_memory_as_the_row(make_cache, monkeypatch):
    """Review: the old flag written back on a full disk raised with the row holding the new
    flag and memory the old one: lookups served the entry at one threshold, and a restart at
    the other. Memory now takes the flag the row kept, and the disk's error is raised."""
    from services.common.errors import ResourceExhausted

    c = make_cache()
    e = _store(c)
    real, writes = c.store.set_verified, []

    def full_on_the_undo(label: int, verified: bool) -> None:
        writes.append(verified)
        if len(writes) > 1:
            raise ResourceExhausted("disk full")
        real(label, verified)

    monkeypatch.setattr(c.store, "set_verified", full_on_the_undo)
    with pytest.raises(ResourceExhausted):
        c.verify(e.id, True, wanted=_gone_after_the_write(c, e, []))
    assert writes == [True, False]
    assert c.get(e.id).verified and c.store.get(e.id).verified


def test_an_invalidate_whose_caller_left_while_it_was_written_still_removes(make_cache):
    """The other rule, on purpose: an Invalidate by id is asked before the delete only. A
    removal is erasure on request, harmless when late, and never undone (a bad answer put
    back would be served again); a retry is told NOT_FOUND."""
    c = make_cache()
    e = _store(c)
    asked: list = []
    assert c.invalidate_id(e.id, wanted=_gone_after_the_write(c, e, asked)) == 1
    assert asked == [False]  # asked once, before the delete
    assert c.store.get(e.id) is None and not c.lookup(A, "A fine question?").hit
    with pytest.raises(NotFound):
        c.invalidate_id(e.id)


def _text_in_files(c, secret: str) -> list[str]:
    import os

    found = []
    for f in (c.store.path, c.store.path + "-wal"):
        if os.path.exists(f):
            with open(f, "rb") as fh:
                if secret.encode() in fh.read():
                    found.append(f)
    return found


@pytest.mark.parametrize("how", ["id", "namespace", "expiry"])
def test_every_erasing_delete_leaves_no_text_in_the_wal(make_cache, clock, how):
    """Invalidate by id (a `feedback --bad`), by namespace and the expiry purge overwrote the
    rows in the file (secure_delete) but left their text in semantic.db-wal as written, only
    the tenant Invalidate emptied it: each now does."""
    c = make_cache(**LIMITS)
    secret = "QUOKKAVAX-5190"
    e = _store(c, prompt=f"{secret} q?", answer=f"{secret} a.", ttl_seconds=60)
    kept = _store(c, ns=edges.B, prompt="B's question?", answer="B's answer.")
    assert _text_in_files(c, secret)  # the check can see it
    if how == "id":
        assert c.invalidate_id(e.id) == 1
    elif how == "namespace":
        assert c.invalidate_namespace(A) == 1
    else:
        clock.t = e.created_at + 61
        assert c.expire() == 1
    assert _text_in_files(c, secret) == []
    assert c.get(kept.id) == kept


@pytest.mark.parametrize("then", ["repeat", "tick"])
def test_a_wal_left_full_by_a_reader_is_emptied_by_the_repeat_or_the_next_tick(make_cache,
                                                                                then):
    """Review: an Invalidate by id whose WAL emptying a backup's read kept from finishing
    returned with the row's text left in semantic.db-wal, and repeating it found no entry and
    returned NOT_FOUND without emptying it: the text stayed until later writes overwrote it.
    The repeat (still NOT_FOUND) empties it now, and so does the housekeeper's next purge."""
    import sqlite3

    c = make_cache(**LIMITS)
    secret = "QUOKKAVAX-5190"
    e = _store(c, prompt=f"{secret} q?", answer=f"{secret} a.")
    reader = sqlite3.connect(c.store.path)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM entries").fetchone()  # a backup's read snapshot
    assert c.invalidate_id(e.id) == 1
    assert _text_in_files(c, secret) == [c.store.path + "-wal"]  # the reader held it
    reader.rollback()
    reader.close()
    if then == "repeat":
        with pytest.raises(NotFound):
            c.invalidate_id(e.id)
    else:
        assert c.expire() == 0  # nothing expired: the tick finishes the emptying owed
    assert _text_in_files(c, secret) == []
    assert not c.store.wal_owed


def test_an_evicted_or_replaced_answer_leaves_the_wal_at_the_next_purge(make_cache):
    """Review: an answer replaced by a newer one to the same prompt, or evicted at capacity,
    was overwritten in semantic.db but stayed in semantic.db-wal, as written, until an
    erasing call or later writes overwrote it: the purge emptied the WAL only after
    expiring something. A delete now owes the emptying, and the next purge makes it."""
    c = make_cache(max_entries_per_namespace=1, **LIMITS)
    _store(c, prompt="q one?", answer="OKAPIVAX-1 a.")
    _store(c, prompt="q one?", answer="plain.")  # replaces it
    _store(c, prompt="q two?", answer="EMUPOX-2 a.")  # evicts q one
    _store(c, prompt="q three?", answer="plain.")  # evicts q two
    for secret in ("OKAPIVAX-1", "EMUPOX-2"):
        assert _text_in_files(c, secret) == [c.store.path + "-wal"]
    assert c.expire() == 0  # nothing expired: the tick empties the WAL owed
    assert _text_in_files(c, "OKAPIVAX-1") == _text_in_files(c, "EMUPOX-2") == []
    assert not c.store.wal_owed
    assert c.lookup(A, "q three?").hit


def test_invalidating_a_tenant_forgets_its_texts_just_looked_up_and_no_others(cache_factory):
    """Review: after a tenant's erasure, the vectors of texts it had just looked up stayed in
    memory keyed by their text (kept for the Store that usually follows a miss) until newer
    lookups pushed them out. They go with the erasure; they went with every other tenant's
    too (kept by text alone), whose next Stores embedded their texts again. Only the erased
    tenant's go now, the same text looked up by another tenant included."""
    counting = CountingEmbedder()
    c = cache_factory(counting, guard_tiers=(), verifier_tiers=(), **LIMITS)
    c.lookup(A, "ZEBRAPOX-7731 what is a KV cache?")
    c.lookup(edges.B, "B's own question?")
    c.lookup(edges.B, "ZEBRAPOX-7731 what is a KV cache?")
    c.invalidate_tenant(A.tenant)
    assert all(tenant != A.tenant for tenant, _ in c._recent)
    counting.calls.clear()
    c.store_entry(edges.B, "B's own question?", "B's answer.")
    c.store_entry(edges.B, "ZEBRAPOX-7731 what is a KV cache?", "B's answer.")
    assert counting.calls == []  # B's vectors were kept for its Stores
    c.store_entry(A, "ZEBRAPOX-7731 what is a KV cache?", "A's answer.")
    assert counting.calls == ["ZEBRAPOX-7731 what is a KV cache?"]  # A's was dropped


def test_a_tenant_erasure_that_fails_still_forgets_its_texts_just_looked_up(make_cache,
                                                                           monkeypatch):
    """Review: the tenant's texts just looked up were dropped after the WAL was emptied, so
    an emptying that raised (a full disk) left them in memory, told RESOURCE_EXHAUSTED. They
    go whatever the disk says: dropping them writes nothing."""
    from services.common.errors import ResourceExhausted

    c = make_cache(**LIMITS)
    c.lookup(A, "ZEBRAPOX-7731 what is a KV cache?")
    c.lookup(edges.B, "B's own question?")

    def full() -> bool:
        raise ResourceExhausted("disk full")

    monkeypatch.setattr(c.store, "truncate_wal", full)
    with pytest.raises(ResourceExhausted):
        c.invalidate_tenant(A.tenant)
    assert [t for t, _ in c._recent] == [edges.B.tenant]


@pytest.mark.parametrize("name", ["acme\u200b", "cafe\u0301", "a\nb", "a\u202eb", "acme ", " acme",
                                  "acme\u2800"])
def test_a_tenant_name_that_prints_as_another_is_refused_to_store_and_look_up_but_erasable(
        make_cache, monkeypatch, name):
    """"acme\u200b" was a namespace of its own, printed as "acme". Store and Lookup refuse
    such a tenant naming the character (as the orchestrator's tokens file does), storing
    nothing; Invalidate by namespace and by tenant take it: an earlier release stored entries
    under such a name, and refused, they could not be erased by name (they stayed until their
    TTL). A plain space inside a tenant's name stays allowed; one leading or trailing ("acme ",
    printed as "acme") is refused, as the tokens file refuses it."""
    import services.semantic.cache as cache_mod

    with monkeypatch.context() as earlier:  # the earlier release: no such check
        earlier.setattr(cache_mod, "name_problem", lambda _: "")
        c = make_cache(**LIMITS)
        for ns in (Namespace(name, "m"), Namespace(name, "m2", "ab12"), Namespace("acme", "m")):
            _store(c, ns=ns)
    c = make_cache(**LIMITS)  # restarted as the new release, on the same database
    assert c.store.count() == 3
    ns = Namespace(name, "m")
    for call in (lambda: _store(c, ns=ns), lambda: c.lookup(ns, "A fine question?")):
        with pytest.raises(InvalidArgument, match=r"U\+[0-9A-F]{4}") as exc:
            call()
        assert exc.value.field == "namespace.tenant"
    assert c.store.count() == 3
    assert c.invalidate_namespace(ns) == 1
    assert c.invalidate_tenant(name) == 1  # the other namespace, "m2"
    assert [r.tenant for rows in c.store.iter_all() for r in rows] == ["acme"]
    _store(c, ns=Namespace("acme corp", "m"))
    assert c.invalidate_tenant("acme corp") == 1


@pytest.mark.parametrize("model", ["m\x1b[2J\n", "llama\u200b", "m\u3164", "m\tx", "m\u2800"])
def test_a_model_id_that_prints_as_another_is_refused_to_store_and_look_up_but_erasable(
        make_cache, monkeypatch, model):
    """A model id holding a control, format or invisible character ("m\\x1b[2J\\n" cleared
    the terminal of whoever read it; "llama\\u200b" printed as "llama") was a namespace of
    its own. Store and Lookup refuse it naming the character, as the prefix index's Register
    does, storing nothing; Invalidate by namespace takes it (an earlier release stored
    entries under one). Every id a hub or a model folder gives is taken."""
    import services.semantic.cache as cache_mod

    with monkeypatch.context() as earlier:  # the earlier release: no such check
        earlier.setattr(cache_mod, "model_id_problem", lambda _: "")
        _store(make_cache(**LIMITS), ns=Namespace("acme", model))
    c = make_cache(**LIMITS)  # restarted as the new release, on the same database
    ns = Namespace("acme", model)
    for call in (lambda: _store(c, ns=ns), lambda: c.lookup(ns, "A fine question?")):
        with pytest.raises(InvalidArgument, match=r"U\+[0-9A-F]{4}") as exc:
            call()
        assert exc.value.field == "namespace.model_id"
    assert c.store.count() == 1 and c.stats().lookups_total == 0
    assert c.invalidate_namespace(ns) == 1
    for good in ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen2.5-0.5B", "my model", "café"):
        _store(c, ns=Namespace("acme", good))
    assert c.store.count() == 4
