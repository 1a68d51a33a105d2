"""SemanticCache logic with the real ONNX embedder: namespaces, thresholds, guard, lifecycle."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument, NotFound
from services.semantic.cache import Namespace, SemanticCache
from services.semantic.store import EntryStore
from tests.metric_sample import sample_value

A = Namespace("tenant-a", "smollm2", "")
B = Namespace("tenant-b", "smollm2", "")


@pytest.fixture
def make_cache(cache_factory, embedder):
    return lambda **kw: cache_factory(embedder, **kw)


def test_namespace_isolation(make_cache):
    c = make_cache()
    c.store_entry(A, "How do I reset my router?", "Hold the button for 10 s.")
    assert c.lookup(A, "How do I reset my router?").hit
    for ns in (B, Namespace("tenant-a", "other-model"), Namespace("tenant-a", "smollm2", "ab12")):
        r = c.lookup(ns, "How do I reset my router?", want_draft=True)
        assert not r.hit and r.entry is None and r.similarity == 0.0
    c.check_integrity()


def test_hit_draft_and_miss(make_cache):
    c = make_cache()
    e = c.store_entry(A, "How do I learn Python quickly?", "Write code every day.")
    hit = c.lookup(A, "How do I learn Python quickly?", tier="strict")
    assert hit.hit and hit.entry.id == e.id and hit.entry.answer == "Write code every day."
    near = c.lookup(A, "How can I learn Python fast?", tier="strict", want_draft=True)
    assert 0.80 <= near.similarity < 0.97
    assert not near.hit and near.entry.id == e.id  # a draft candidate, never a hit
    assert c.lookup(A, "How can I learn Python fast?", tier="strict").entry is None
    miss = c.lookup(A, "What is the capital of France?", want_draft=True)
    assert not miss.hit and miss.entry is None and miss.similarity < 0.5
    s = c.stats()
    assert (s.lookups_total, s.hits_by_tier["strict"], s.near_misses_total) == (4, 1, 2)


def test_explicit_threshold_and_verified_bonus(make_cache):
    c = make_cache()
    e = c.store_entry(A, "How can I learn Python fast?", "Practice.")
    sim = c.lookup(A, "How do I learn Python quickly?").similarity
    assert c.lookup(A, "How do I learn Python quickly?", threshold=sim - 0.001).hit
    assert not c.lookup(A, "How do I learn Python quickly?", threshold=sim + 0.005).hit
    c.verify(e.id, True)
    # verified entries need threshold - 0.02
    r = c.lookup(A, "How do I learn Python quickly?", tier="relaxed", threshold=sim + 0.015)
    assert r.hit and r.threshold == pytest.approx(sim + 0.015 - 0.02, abs=1e-6)
    with pytest.raises(InvalidArgument, match="threshold"):
        c.lookup(A, "x", threshold=0.5)
    # Hits at a request's own threshold count apart from the tiers' (a metrics review: they
    # were counted under the default tier, mixing other thresholds into its hit rate).
    s = c.stats()
    assert s.hits_by_tier["explicit"] == 2 and s.hits_by_tier["relaxed"] == 0
    # The exact-repeat path (the same text again) counts it the same way.
    assert c.lookup(A, "How can I learn Python fast?", threshold=0.9).hit
    after = c.stats()
    assert after.hits_by_tier["explicit"] == 3
    assert after.hits_by_tier["standard"] == s.hits_by_tier["standard"]


def test_a_verified_entry_below_an_unverified_near_miss_still_hits(make_cache, embedder):
    """The nearest entry misses its threshold, the next one is verified and within the bonus:
    the lookup must go on past the first and serve the verified one."""
    c = make_cache()
    q = "How do I learn Python quickly?"
    near, verified = "How can I learn Python fast?", "Best way to learn Python quickly?"
    v = embedder.embed([q, near, verified])
    s_near, s_ver = float(v[0] @ v[1]), float(v[0] @ v[2])
    th = s_near + 0.002  # the nearest entry just misses
    assert s_ver < s_near and s_ver >= th - 0.02 + 0.001  # the verified one is within the bonus
    c.store_entry(A, near, "Practice every day.")
    e = c.store_entry(A, verified, "Build small projects.", verified=True)
    r = c.lookup(A, q, tier="relaxed", threshold=th)
    assert r.hit and r.entry.id == e.id
    c.verify(e.id, False)
    assert not c.lookup(A, q, tier="relaxed", threshold=th).hit


def test_guard_refuses_a_swapped_trap_in_strict_tier_only(make_cache):
    c = make_cache()
    c.store_entry(A, "Flights from New York to Florida", "Daily at 9am.")
    strict = c.lookup(A, "Flights from Florida to New York", tier="strict", want_draft=True)
    assert strict.similarity >= 0.97, "the trap must pass the similarity threshold"
    assert not strict.hit and strict.guard_rejected and "order" in strict.guard_reason
    assert strict.entry is not None  # still offered as a draft: the model verifies drafts
    relaxed = c.lookup(A, "Flights from Florida to New York", tier="relaxed")
    assert relaxed.hit and not relaxed.guard_rejected
    assert c.stats().guard_rejections_total == 1


class _DropsOnCheck(dict):
    """Entries that a concurrent Invalidate empties right after a membership check."""

    def __contains__(self, key) -> bool:
        found = super().__contains__(key)
        if found:
            del self[key]
        return found


def test_an_entry_dropped_while_looked_up_by_id_is_not_found_not_a_keyerror(make_cache):
    """Verify/Invalidate read the entry once: a check-then-read let a concurrent removal turn
    NOT_FOUND into a KeyError (INTERNAL at the server)."""
    c = make_cache()
    e = c.store_entry(A, "How do I reset my router?", "Hold the button for 10 s.")
    c._entries = _DropsOnCheck(c._entries)
    assert c.get(e.id).id == e.id
    del c._entries[e.label]
    with pytest.raises(NotFound, match="id:"):
        c.get(e.id)


def test_ttl_is_not_extended_by_hits(make_cache, clock):
    c = make_cache()
    c.store_entry(A, "What is the boiling point of water?", "100 C at sea level.",
                  ttl_seconds=100)
    clock.t += 60
    assert c.lookup(A, "What is the boiling point of water?").hit
    clock.t += 39
    assert c.lookup(A, "What is the boiling point of water?").hit
    clock.t += 1  # 100 s after creation, regardless of the hits
    assert not c.lookup(A, "What is the boiling point of water?").hit
    assert c.expire() == 1 and c.stats().entries == 0
    assert c.store.count() == 0
    c.check_integrity()


def test_expire_examines_nothing_until_the_earliest_expiry(make_cache, clock):
    c = make_cache()
    c.store_entry(A, "What is the boiling point of water?", "100 C.", ttl_seconds=100)
    assert c.expire() == 0 and c._expiry_examined == 0  # nothing expires before t+100
    clock.t += 50
    c.store_entry(A, "Who wrote Hamlet?", "Shakespeare.", ttl_seconds=20)  # expires at t+70
    clock.t += 10
    assert c.expire() == 0 and c._expiry_examined == 0  # t+60: before any expiry
    clock.t += 10
    assert c.expire() == 1 and c._expiry_examined == 1  # t+70: the late entry expires on time
    clock.t += 29
    assert c.expire() == 0 and c._expiry_examined == 1
    clock.t += 1
    assert c.expire() == 1 and c.stats().entries == 0
    c.check_integrity()


def test_lru_eviction_per_namespace_and_global(make_cache, clock):
    c = make_cache(max_entries_per_namespace=3, max_entries_total=5)
    ids = []
    for i, q in enumerate(["How tall is Mount Everest?", "Who wrote Hamlet?",
                           "What is photosynthesis?"]):
        clock.t += 1
        ids.append(c.store_entry(A, q, f"answer {i}").id)
    clock.t += 1
    assert c.lookup(A, "How tall is Mount Everest?").hit  # now most recently used
    c.store_entry(A, "How do vaccines work?", "answer 3")
    left = {e.prompt for e in c._entries.values()}
    assert "Who wrote Hamlet?" not in left and "How tall is Mount Everest?" in left
    c.check_integrity()
    for q in ["Why is the sea salty?", "What causes rain?", "How do magnets work?"]:
        clock.t += 1
        c.store_entry(B, q, "b")
    s = c.stats()
    assert (s.entries, s.evictions_total) == (5, 2)
    # the global LRU victim is the oldest untouched entry of namespace A
    assert "What is photosynthesis?" not in {e.prompt for e in c._entries.values()}
    assert c.store.count() == 5
    c.check_integrity()


def test_a_tenant_storing_without_end_evicts_its_own_entries_not_others(make_cache, clock):
    """The global capacity was one LRU over every tenant: a tenant storing distinct prompts
    (in as many namespaces as it liked) evicted every other tenant's answers."""
    c = make_cache(max_entries_total=6)
    kept = []
    for q in ("How tall is Mount Everest?", "Who wrote Hamlet?"):
        clock.t += 1
        kept.append(c.store_entry(A, q, "answer").id)
    for i in range(12):  # tenant-b floods, each prompt in a namespace of its own
        clock.t += 1
        c.store_entry(Namespace("tenant-b", "smollm2", f"{i:02x}"), f"Spell the number {i}.",
                      str(i))
    assert all(eid in c._by_id for eid in kept)  # the oldest entries, yet kept
    assert c.stats().entries == 6 and c.stats().evictions_total == 8
    c.check_integrity()
    assert c.lookup(A, "Who wrote Hamlet?").hit


def test_a_tenant_quota_evicts_only_that_tenants_oldest(make_cache, clock):
    c = make_cache(max_entries_per_tenant=2)
    b = c.store_entry(B, "Why is the sea salty?", "salt").id
    ids = []
    for q in ("How tall is Mount Everest?", "Who wrote Hamlet?", "What is photosynthesis?"):
        clock.t += 1
        ids.append(c.store_entry(Namespace("tenant-a", "smollm2", f"{len(ids)}"), q, "a").id)
    assert [eid in c._by_id for eid in ids] == [False, True, True] and b in c._by_id
    assert c.store.count() == 3
    c.check_integrity()
    smaller = make_cache(max_entries_per_tenant=1)  # a lower quota at load: the excess goes
    assert {e.id for e in smaller._entries.values()} == {b, ids[2]}
    smaller.check_integrity()


def test_of_two_stores_of_one_prompt_at_once_the_later_commit_stands(make_cache):
    """Rows commit outside the cache lock: a Store committed first but taking the lock last
    replaced the later answer in memory, while a restart (newest row wins) served the later
    one, so the answer flipped."""
    c = make_cache()
    real = c.store.insert
    later: list = []

    def insert_then_overtaken(**row):
        label = real(**row)
        if c.store.insert is insert_then_overtaken:
            # The second Store runs whole between this commit and this Store's lock.
            c.store.insert = real
            later.append(c.store_entry(A, "Who wrote Hamlet?", "Shakespeare (later)"))
        return label

    c.store.insert = insert_then_overtaken
    got = c.store_entry(A, "Who wrote Hamlet?", "Shakespeare (earlier)")
    assert got.id == later[0].id and got.answer == "Shakespeare (later)"
    assert c.lookup(A, "Who wrote Hamlet?").entry.answer == "Shakespeare (later)"
    assert c.store.count() == 1
    c.check_integrity()
    assert make_cache().lookup(A, "Who wrote Hamlet?").entry.answer == "Shakespeare (later)"


def test_lowered_limits_at_load_evict_only_the_excess(make_cache, clock):
    """Reloaded under smaller limits: each namespace's excess goes, then only what is still
    over the global limit (oldest first), never more."""
    c = make_cache()
    order = []
    for ns in (A, B):
        for q in ("How tall is Mount Everest?", "Who wrote Hamlet?", "What is photosynthesis?"):
            clock.t += 1
            order.append((ns, c.store_entry(ns, q, "answer").id))
    smaller = make_cache(max_entries_per_namespace=2, max_entries_total=3)
    kept = {eid for _, eid in order if eid in smaller._by_id}
    # per namespace: the oldest of A and of B go; global: then the oldest left (A's second).
    assert kept == {order[2][1], order[4][1], order[5][1]}
    assert smaller.store.count() == 3
    smaller.check_integrity()


def test_entries_embedded_by_another_model_are_re_embedded_at_load(make_cache):
    """Vectors tagged with another embedder identity (another model, or other weights under
    the same name) are useless to this one's queries: load re-embeds them."""
    import numpy as np

    c = make_cache()
    e = c.store_entry(A, "How far is the Moon?", "384,400 km")
    assert c.embedder.identity.startswith(c.embedder.name + "@")
    junk = np.zeros(c.embedder.dim, np.float32)
    junk[0] = 1.0
    c.store.set_embedding(c.get(e.id).label, junk, c.embedder.name)  # tagged by name only
    again = make_cache()
    assert again.lookup(A, "How far is the Moon?").hit
    # Not the same text (an exact repeat is found by text): found by its new vector.
    near = again.lookup(A, "How far is the Moon? ")
    assert near.hit and not near.exact and near.entry.id == e.id
    assert again.store.get(e.id).embed_model == c.embedder.identity


def test_the_same_model_under_another_name_keeps_its_vectors(make_cache, caplog):
    """Rows were tagged name@weights and compared whole: renaming the model (or moving its
    folder) re-embedded every entry at start, the service not serving meanwhile."""
    import logging

    import numpy as np

    c = make_cache()
    e = c.store_entry(A, "How far is the Moon?", "384,400 km")
    weights = c.embedder.identity.rpartition("@")[2]
    marker = np.zeros(c.embedder.dim, np.float32)
    marker[0] = 1.0  # a vector no embedding of the prompt would give: re-embedding loses it
    c.store.set_embedding(c.get(e.id).label, marker, f"renamed-model@{weights}")
    with caplog.at_level(logging.INFO, logger="services.semantic.cache"):
        again = make_cache()
    assert "re-embedding" not in caplog.text
    assert np.array_equal(again.store.get(e.id).embedding, marker)
    other = np.zeros(c.embedder.dim, np.float32)
    other[1] = 1.0
    again.store.set_embedding(again.get(e.id).label, other, f"{c.embedder.name}@0123abcd")
    third = make_cache()  # the same name with other weights is another model
    assert not np.array_equal(third.store.get(e.id).embedding, other)
    assert third.store.get(e.id).embed_model == c.embedder.identity


def test_an_expired_entry_cannot_be_verified_before_its_purge(make_cache, clock):
    # Gone to every lookup, it was still verified (OK, and written) until the housekeeper came.
    c = make_cache()
    e = c.store_entry(A, "Who wrote Hamlet?", "Shakespeare.", ttl_seconds=10)
    clock.t += 11
    with pytest.raises(NotFound, match="has expired"):
        c.verify(e.id, True)
    assert not c.store.get(e.id).verified
    assert c.expire() == 1 and c.store.count() == 0


def test_verify_invalidate_and_not_found(make_cache):
    c = make_cache()
    e = c.store_entry(A, "How do I boil an egg?", "8 minutes.")
    c.store_entry(A, "How do I fry an egg?", "3 minutes.")
    c.store_entry(B, "How do I boil an egg?", "9 minutes.")
    assert c.verify(e.id, True).verified
    with pytest.raises(NotFound, match="id"):
        c.verify("nope", True)
    assert c.invalidate_id(e.id) == 1
    with pytest.raises(NotFound):
        c.invalidate_id(e.id)
    assert c.invalidate_namespace(A) == 1
    assert c.invalidate_namespace(A) == 0
    assert c.stats().entries == 1 and c.store.count() == 1
    assert c.lookup(B, "How do I boil an egg?").entry.answer == "9 minutes."
    c.check_integrity()


def test_same_prompt_again_replaces_the_answer(make_cache):
    c = make_cache()
    c.store_entry(A, "Who is the CEO?", "Alice")
    c.store_entry(A, "Who is the CEO?", "Bob")
    assert c.stats().entries == 1
    assert c.lookup(A, "Who is the CEO?").entry.answer == "Bob"


def test_the_same_answer_again_keeps_the_entry_every_caller_was_given(make_cache):
    """A herd: N identical requests miss together, the model gives each the same answer, and
    each Store replaced the one before, so N - 1 callers held the id of an entry gone (their
    Feedback "bad" invalidated nothing, their "good" was NOT_FOUND) while that answer stayed
    served under another id."""
    c = make_cache()
    first = c.store_entry(A, "Who is the CEO?", "Alice", answer_token_ids=[1, 2])
    again = c.store_entry(A, "Who is the CEO?", "Alice", answer_token_ids=[1, 2])
    assert again.id == first.id and c.stats().entries == 1 and c.store.count() == 1
    assert c.invalidate_id(first.id) == 1
    assert not c.lookup(A, "Who is the CEO?").hit
    c.check_integrity()


def test_the_same_answer_again_keeps_its_entry_across_a_crash_during_that_store(
        make_cache, monkeypatch):
    """A walk (kill -9 during a burst of Stores of answers already held): such a Store wrote
    a row of its own, found the entry standing, and deleted its row again. Killed between
    the two, the restart kept the newest row of the prompt (as after a replacing Store), so
    the entry every earlier caller was given went (their Feedback NOT_FOUND, the same answer
    served under a new id, its TTL counted afresh). The held answer is now found before
    anything is written."""
    c = make_cache()
    first = c.store_entry(A, "Who is the CEO?", "Alice", answer_token_ids=[1, 2])

    class Killed(BaseException):
        pass

    def killed(labels, *a, **kw):
        raise Killed  # the process dies before the Store's own row is deleted

    monkeypatch.setattr(c.store, "delete", killed)
    try:
        c.store_entry(A, "Who is the CEO?", "Alice", answer_token_ids=[1, 2])
    except Killed:
        pass
    monkeypatch.undo()
    c = make_cache()  # restarted on the same database
    r = c.lookup(A, "Who is the CEO?")
    assert r.hit and r.entry.id == first.id and r.entry.created_at == first.created_at
    assert c.store.count() == 1
    c.check_integrity()


def test_the_same_answer_keeps_the_entry_until_the_instant_it_expires(make_cache, clock):
    """Kept while unexpired, to its last moment (a herd's Stores a little before the TTL
    runs out keep one id); from its expiry on (`Entry.expired`: now >= expires_at) a Store
    replaces it."""
    c = make_cache()
    old = c.store_entry(A, "Who is the CEO?", "Alice", ttl_seconds=10)
    clock.t += 9.5
    assert c.store_entry(A, "Who is the CEO?", "Alice", ttl_seconds=10).id == old.id
    clock.t += 0.5  # its expiry itself: expired, not purged yet
    new = c.store_entry(A, "Who is the CEO?", "Alice", ttl_seconds=10)
    assert new.id != old.id and c.lookup(A, "Who is the CEO?").entry.id == new.id
    assert c.store.count() == 1
    c.check_integrity()


@pytest.mark.parametrize(("first", "second"), [
    (dict(truncated=1), dict()),
    (dict(answer_token_ids=[1, 2]), dict(answer_token_ids=[1, 3])),
    (dict(ttl_seconds=100), dict(ttl_seconds=200)),
    (dict(verified=True), dict(verified=False)),
    (dict(verified=False), dict(verified=True)),
], ids=["cut", "tokens", "ttl", "verified-then-not", "unverified-then-verified"])
def test_the_same_text_stored_otherwise_replaces_the_entry(make_cache, first, second):
    """Only a Store that brings nothing the entry lacks keeps it: the same text cut otherwise,
    with other token ids, another TTL or another verified flag is a new answer, and replaces
    the entry as any Store of its prompt does (an unverified one over a verified one too)."""
    c = make_cache()
    old = c.store_entry(A, "Who is the CEO?", "Alice", **first)
    new = c.store_entry(A, "Who is the CEO?", "Alice", **second)
    assert new.id != old.id
    held = c.lookup(A, "Who is the CEO?").entry
    assert held.id == new.id and c.store.count() == 1
    assert (held.truncated, held.answer_token_ids, held.ttl_seconds, held.verified) == (
        new.truncated, new.answer_token_ids, new.ttl_seconds, new.verified)
    c.check_integrity()


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(ns=Namespace("", "m")), "namespace.tenant"),
    (dict(ns=Namespace("t", "")), "namespace.model_id"),
    (dict(ns=Namespace("t", "m", "not-hex")), "namespace.context_hash"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="   "), "prompt"),
    (dict(prompt="x" * 9000), "prompt"),
    (dict(answer=""), "answer"),
    (dict(answer="y" * 70000), "answer"),
    (dict(ttl_seconds=10**9), "ttl_seconds"),
])
def test_bad_store_input_writes_nothing(make_cache, kwargs, field):
    c = make_cache()
    args = dict(ns=A, prompt="A fine question?", answer="A fine answer.")
    args.update(kwargs)
    with pytest.raises(InvalidArgument) as exc:
        c.store_entry(args.pop("ns"), **args)
    assert exc.value.field == field
    assert c.stats().entries == 0 and c.store.count() == 0


def test_reload_from_sqlite(make_cache, make_cfg, embedder, clock):
    c = make_cache()
    keep = c.store_entry(A, "How far is the Moon?", "384,400 km", verified=True)
    cut = c.store_entry(A, "List every planet with its moons.", "Mercury: none; Venus:",
                        truncated=6)
    c.store_entry(A, "Short-lived fact?", "soon gone", ttl_seconds=10)
    c.lookup(A, "How far is the Moon?")
    c.store.flush_hits()
    clock.t += 11
    again = make_cache()  # same database file
    assert again.stats().entries == 2
    e = again.get(keep.id)
    assert e.verified and e.hit_count == 1 and e.answer == "384,400 km" and e.truncated == 0
    assert again.get(cut.id).truncated == 6
    assert again.lookup(A, "How far is the Moon?").hit
    near = again.lookup(A, "How far is the Moon? ")  # through the rebuilt index
    assert near.hit and not near.exact and near.entry.id == keep.id
    again.check_integrity()


def entries_gauge() -> float:

    return sample_value("tiercache_semantic_entries")


def test_a_second_store_of_a_prompt_replaces_it_whatever_its_near_twins(make_cache):
    """MiniLM is uncased and strips accents: these variants embed (almost) identically and
    used to fill the two nearest slots that the duplicate check searched, so the old answer
    to the exact prompt stayed beside the new one."""
    c = make_cache()
    for q, twins in (("How do I get to Zürich airport?",
                      ("How do I get to Zurich airport?", "how do i get to zurich airport?")),
                     ("What is the price of Apple stock?",
                      ("what is the price of apple stock?", "WHAT IS THE PRICE OF APPLE STOCK?"))):
        for v in twins:
            c.store_entry(A, v, f"answer to {v}")
        c.store_entry(A, q, "old answer")
        c.store_entry(A, q, "new answer")
        same = [e for e in c._entries.values() if e.prompt == q]
        assert [e.answer for e in same] == ["new answer"], q
    assert c.stats().entries == 6 and c.store.count() == 6
    assert entries_gauge() == 6
    c.check_integrity()


def test_a_store_that_fails_after_its_commit_leaves_no_row(make_cache, monkeypatch):
    c = make_cache()
    c.store_entry(A, "What is a heat pump?", "A machine that moves heat.")

    def boom(ns):
        raise RuntimeError("injected")

    monkeypatch.setattr(c, "_victims_locked", boom)
    with pytest.raises(RuntimeError):
        c.store_entry(A, "What does a compressor do?", "It raises the gas pressure.")
    assert c.store.count() == 1 and c.stats().entries == 1
    c.check_integrity()


def test_load_keeps_the_newest_row_of_a_prompt(make_cache, make_cfg, embedder, clock):
    """A replacing Store killed between committing its row and deleting the old one leaves
    two rows of one prompt: the next start serves the newer answer only."""
    c = make_cache()
    q = "How long does a passport renewal take?"
    old = c.store_entry(A, q, "Six weeks.")
    clock.t += 5
    c.store.insert(id="crashed-replacement", tenant=A.tenant, model_id=A.model_id,
                   context_hash=A.context_hash, prompt=q, answer="Ten weeks.",
                   embedding=embedder.embed_one(q), embed_model=c._embed_id, verified=False,
                   created_at=clock.t, ttl_seconds=old.ttl_seconds)
    assert c.store.count() == 2
    c.store.close()
    cfg = make_cfg()
    again = SemanticCache(cfg, embedder, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        assert again.load() == 1
        assert again.lookup(A, q).entry.answer == "Ten weeks."
        assert again.store.count() == 1
        again.check_integrity()
    finally:
        again.store.close()


def test_invalidating_by_id_updates_the_entries_gauge(make_cache):
    c = make_cache()
    e = c.store_entry(A, "What is the boiling point of water?", "100 °C at sea level.")
    c.store_entry(A, "What is the freezing point of water?", "0 °C.")
    assert entries_gauge() == 2
    assert c.invalidate_id(e.id) == 1
    assert entries_gauge() == 1


def test_shutdown_waits_for_the_merge_of_a_namespace_emptied_meanwhile(make_cache):
    import threading
    import time

    c = make_cache()
    e = c.store_entry(B, "Where is the Eiffel tower?", "In Paris.")
    index = c.index_of(B)
    release = threading.Event()
    merge = threading.Thread(target=release.wait, daemon=True)  # stands in for a slow merge
    merge.start()
    index._merging = merge
    c.invalidate_id(e.id)
    assert c.index_of(B) is None
    closer = threading.Thread(target=c.close_indexes, kwargs={"timeout": 10})
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # waiting on the retired index's merge
    release.set()
    closer.join(5)
    assert not closer.is_alive()


def test_shutdown_waits_for_a_merge_only_as_long_as_it_was_given(make_cache):
    """close_indexes took up to 20 s whatever was left of the pod's termination grace; the
    service now passes index_close_seconds and exits without finalizing when told False."""
    import threading

    c = make_cache()
    c.store_entry(B, "Where is the Eiffel tower?", "In Paris.")
    release = threading.Event()
    merge = threading.Thread(target=release.wait, daemon=True)  # stands in for a slow merge
    merge.start()
    c.index_of(B)._merging = merge
    assert c.close_indexes(timeout=0.3) is False  # gave up: the merge still runs
    assert merge.is_alive()
    release.set()
    assert c.close_indexes(timeout=5) is True


def test_a_context_hash_with_a_trailing_newline_is_not_hex(make_cache):
    c = make_cache()
    with pytest.raises(InvalidArgument, match="namespace.context_hash"):
        c.store_entry(Namespace("t", "m", "ab\n"), "Hello?", "Hi.")
    assert c.store.count() == 0


def test_a_failed_repeat_store_leaves_sqlite_and_memory_agreeing(make_cache, monkeypatch):
    c = make_cache()
    q = "What is the speed of sound?"
    c.store_entry(A, q, "About 343 m/s in air.")

    def boom(ns):
        raise RuntimeError("injected")

    monkeypatch.setattr(c, "_victims_locked", boom)
    with pytest.raises(RuntimeError):
        c.store_entry(A, q, "About 1,235 km/h.")
    # The old entry was already dropped from memory when the Store failed: its row goes too.
    assert c.store.count() == c.stats().entries == 0
    assert entries_gauge() == 0
    c.check_integrity()


def test_verify_does_not_hold_up_lookups_while_it_waits_for_sqlite(make_cache):
    import threading

    c = make_cache()
    e = c.store_entry(A, "Who wrote Hamlet?", "William Shakespeare.")
    done, looked, writing = threading.Event(), threading.Event(), threading.Event()
    set_verified = c.store.set_verified

    def signalled(*args, **kw):
        writing.set()  # verify has reached its SQLite write (and will wait for the lock)
        return set_verified(*args, **kw)

    c.store.set_verified = signalled
    with c.store._lock:  # a Store's fsync or a hit flush in progress
        t = threading.Thread(target=lambda: (c.verify(e.id, True), done.set()), daemon=True)
        t.start()
        assert writing.wait(5)
        # In a thread: a lookup stuck behind the verify must fail the test, not hang it.
        lt = threading.Thread(target=lambda: c.lookup(A, "Who wrote Hamlet?").hit
                              and looked.set(), daemon=True)
        lt.start()
        lt.join(30)  # generous for a loaded machine: the verify below holds until released
        assert looked.is_set()  # not behind the verify (it waits on SQLite, not the cache lock)
        assert not done.is_set()
    t.join(5)
    assert done.is_set() and c.get(e.id).verified


POLICY = ("Our travel policy covers every trip an employee takes on company business. "
          "Bookings go through the travel desk, receipts are kept for seven years, and any "
          "exception needs a manager's written approval before the trip starts. ") * 9


@pytest.mark.parametrize("tier", ["relaxed", "standard", "strict"])
def test_texts_that_differ_only_where_the_model_cannot_read_do_not_hit(make_cache, embedder,
                                                                      tier):
    """MiniLM maps emoji and unknown scripts to [UNK] and drops control characters, so these
    pairs embed to one vector (similarity 1.0): the snake's answer was served for the shark,
    in the strict tier too."""
    c = make_cache(guard_tiers=(), verifier_tiers=())
    pairs = [("Is 🐍 a good pet?", "Is 🦈 a good pet?"),
             ("Translate to English: ሰላም", "Translate to English: ደህና"),
             ("Repeat after me: \x00", "Repeat after me: \u200b"),  # (alone: refused as empty)
             ("Describe this emoji in one word: 🍕", "Describe this emoji in one word: 🥶"),
             # A word past WordPiece's 100 characters is one [UNK], and plain ASCII was
             # taken as read in full.
             ("Decode this string please: " + "QWERTYUIOP" * 12,
              "Decode this string please: " + "ZXCVBNMASD" * 12)]
    for stored, asked in pairs:
        e = c.store_entry(A, stored, f"answer to {stored!r}")
        for _ in range(2):  # the second time from what the entry remembered of its prompt
            r = c.lookup(A, asked, tier=tier, want_draft=True)
            assert r.similarity > 0.999, (stored, asked)  # the vectors cannot tell them apart
            assert not r.hit and r.guard_rejected and "cannot read" in r.guard_reason
        assert r.entry is not None and r.entry.id == e.id  # still offered as a draft
        assert c.lookup(A, stored, tier=tier).hit  # the exact repeat is served
    # What the model reads may still differ: case, spacing, punctuation and the same emoji;
    # accents too below the strict tier (there "salé" is not "sale", see spelling_differs).
    c.store_entry(A, "Is 🐱 a good pet for Zürich flats?", "Yes.")
    assert c.lookup(A, "is 🐱  a good pet for Zürich flats", tier=tier).hit
    assert c.lookup(A, "is 🐱  a good pet for Zurich flats", tier=tier).hit == (tier != "strict")


@pytest.mark.parametrize("tier", ["relaxed", "standard", "strict"])
def test_texts_past_the_embedding_window_hit_only_an_exact_repeat(make_cache, make_cfg,
                                                                   embedder, clock, tier):
    """MiniLM reads 256 tokens: a pasted document followed by two different questions embeds
    to one vector (similarity 1.0), and the first question's answer was served for the second
    in every tier."""
    c = make_cache()
    stored = POLICY + "May I fly business class on long flights?"
    other = POLICY + "Must I delete customer data after an audit?"
    assert embedder.exceeds_window(stored) and not embedder.exceeds_window("Short question?")
    e = c.store_entry(A, stored, "Yes, business class is allowed on long flights.")
    r = c.lookup(A, other, tier=tier, want_draft=True)
    assert r.similarity > 0.999  # the vectors cannot tell them apart
    assert not r.hit and r.guard_rejected and "embedding window" in r.guard_reason
    assert r.entry is not None and r.entry.id == e.id  # still offered as a draft
    assert c.lookup(A, stored, tier=tier).hit  # the exact repeat is served
    # A short text that is the start of the long prompt: within the window itself, but the
    # stored vector stands for the long prompt's start only.
    start = POLICY[:1300]  # 251 tokens, similarity 0.999 to the stored prompt
    assert not embedder.exceeds_window(start)
    r = c.lookup(A, start, tier=tier)
    assert not r.hit and "embedding window" in r.guard_reason
    # After a restart the flag is not stored: it is found again from the prompt.
    c.store.close()
    cfg = make_cfg()
    again = SemanticCache(cfg, embedder, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        assert again.load() == 1
        r = again.lookup(A, start, tier=tier)
        assert not r.hit and "embedding window" in r.guard_reason
        assert again.lookup(A, stored, tier=tier).hit
    finally:
        again.close_indexes()
        again.store.close()


def test_texts_the_embedder_reads_alike_but_spelt_otherwise_are_not_hits(make_cache):
    """all-MiniLM-L6-v2 lowercases, strips accents and reads whitespace as a separator: these
    pairs embed identically (similarity 1.0) and were served each other's answers, though they
    ask different things. They are near-misses now (a draft); a capital first letter is not a
    difference."""
    c = make_cache()
    pairs = [("Explain what CO is, in one sentence.", "Explain what Co is, in one sentence."),
             ("Is this meat salé?", "Is this meat sale?"),
             ("What does this print?\nfor x in xs:\n    f(x)\n    print(x)",
              "What does this print?\nfor x in xs:\n    f(x)\nprint(x)")]
    for k, (stored, asked) in enumerate(pairs):
        c.store_entry(A, stored, "answer to " + stored)
        r = c.lookup(A, asked, tier="strict", want_draft=True)
        assert r.similarity > 0.99, (asked, r.similarity)
        assert not r.hit and r.entry is not None and r.entry.prompt == stored, asked
        assert c.lookup(A, stored, tier="strict").hit  # the same text still hits
        # Below the strict tier only indentation counts: in users' questions a case or
        # accent difference is nearly always one word typed otherwise ("gta" / "GTA").
        assert c.lookup(A, asked, tier="relaxed").hit == (k < 2), asked
    assert c.lookup(A, "explain what CO is, in one sentence.", tier="strict").hit
    c.check_integrity()


@pytest.mark.parametrize(("a", "b", "refused"), [
    ("What is a KV cache?", "what is a KV cache?", False),  # a first letter's case
    ("How do I learn Python?", "how do I learn python?", False),
    ("a  b\tc", "a b c", False),  # spacing within a line
    ("What is a KV cache?", "What is a kv cache?", True),
    ("NASA budget", "Nasa budget", True),
    ("iPhone battery", "Iphone battery", True),
    ("año nuevo", "ano nuevo", True),
    ("if x:\n  y()\nz()", "if x:\n  y()\n  z()", True),
    (" What is the capital of France?", "What is the capital of France?", False),
    ("What is the capital\nof France?", "What is the capital of France?", False),
    ("\n  What is it?\n  Why?", "What is it?\nWhy?", False),  # the same layout, a margin
])
def test_spelling_differs_refuses_case_accents_and_indentation_only(a, b, refused):
    from services.semantic.guard import spelling_differs

    assert bool(spelling_differs(a, b)) is refused
    assert bool(spelling_differs(b, a)) is refused
    indentation = "\n" in a
    assert bool(spelling_differs(a, b, case_and_accents=False)) is (refused and indentation)


@pytest.mark.parametrize(("a", "b", "refused"), [
    # Served at similarity 1.0 in every tier before: the answer named the other string.
    ("How long is the string 'a    b'?", "How long is the string 'a b'?", True),
    ("What does `ls  -l` print?", "What does `ls -l` print?", True),
    ('Is "x  y" a name?', 'Is "x y" a name?', True),
    ("Is this valid Python?\nx = 1\ny = 2", "Is this valid Python? x = 1 y = 2", True),
    ("Translate the Japanese word バス into English.",
     "Translate the Japanese word ハス into English.", True),  # "bus" / "lotus"
    ("What does ज़रा mean?", "What does जरा mean?", True),  # Devanagari nukta
    # Still the same text: spacing outside quotes, prose wrapped otherwise, an apostrophe,
    # Latin accents below the strict tier, a word typed decomposed.
    ("Don't  you know 'x'?", "Don't you know 'x'?", False),
    ("What is the capital\nof France?", "What is the capital of France?", False),
    (" What is the capital\nof France?", "What is the capital of France?", False),
    ("Question:\n  What is the capital of France?", "Question: What is the capital of France?",
     False),
    ("I like tea; what about\ncoffee?", "I like tea; what about coffee?", False),
    ("If x = 2, what is\nx squared?", "If x = 2, what is x squared?", False),
    ("Does this compile?\nint a = 1;\nint b = 2;", "Does this compile? int a = 1; int b = 2;",
     True),
    ("Is this meat salé?", "Is this meat sale?", False),
    ("Is it cafe\u0301 au lait?", "Is it café au lait?", False),
])
def test_spelling_differs_in_every_tier_on_quoted_spacing_code_lines_and_letter_marks(a, b,
                                                                                     refused):
    from services.semantic.guard import spelling_differs

    assert bool(spelling_differs(a, b, case_and_accents=False)) is refused
    assert bool(spelling_differs(b, a, case_and_accents=False)) is refused


def test_a_kana_voicing_mark_is_another_word_in_the_standard_tier(make_cache):
    c = make_cache()
    c.store_entry(A, "Translate the Japanese word バス into English.", "Bus.")
    r = c.lookup(A, "Translate the Japanese word ハス into English.", tier="standard",
                 want_draft=True)
    assert r.similarity > 0.999  # MiniLM strips the mark: one vector for both
    assert not r.hit and "another letter" in r.guard_reason
    assert c.lookup(A, "Translate the Japanese word バス into English.", tier="standard").hit


def test_a_step_of_the_system_clock_neither_expires_nor_revives_entries(make_cfg, embedder,
                                                                         monkeypatch):
    # On the wall clock an NTP step or a VM resumed an hour ahead had the housekeeper delete
    # every entry the step carried past its TTL, from SQLite (for good); a step back served
    # expired ones. The default clock follows elapsed time.
    import time as time_module

    from services.semantic.cache import SteadyWallClock

    cfg = make_cfg()
    c = SemanticCache(cfg, embedder, EntryStore(cfg.resolved_db_path(), "NORMAL"))
    try:
        c.load()
        assert isinstance(c.clock, SteadyWallClock)
        c.store_entry(A, "Who wrote Hamlet?", "Shakespeare.", ttl_seconds=60)
        real = time_module.time
        monkeypatch.setattr(time_module, "time", lambda: real() + 3600)
        assert c.expire() == 0 and c.lookup(A, "Who wrote Hamlet?").hit
        monkeypatch.setattr(time_module, "time", lambda: real() - 3600)
        assert abs(c.clock() - real()) < 60  # stepped neither way
    finally:
        c.close_indexes()
        c.store.close()


def test_an_entry_stamped_ahead_of_the_clock_keeps_only_its_ttl_after_a_restart(make_cache,
                                                                                clock):
    # Written while the clock ran an hour ahead, it outlived its TTL by that hour once the
    # service restarted on the corrected clock.
    clock.t += 3600
    make_cache().store_entry(A, "Who wrote Hamlet?", "Shakespeare.", ttl_seconds=100)
    clock.t -= 3600
    c = make_cache()  # the restart, on the corrected clock
    assert c.lookup(A, "Who wrote Hamlet?").hit
    # Clamped in memory only, the row took "now" again at every restart and lived on.
    for _ in range(2):
        clock.t += 60
        c = make_cache()
    assert not c.lookup(A, "Who wrote Hamlet?").hit
    assert c.store.count() == 0  # expired at the last load, 120 s after the corrected write
