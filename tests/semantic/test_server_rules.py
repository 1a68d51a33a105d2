"""The gRPC adapter's rules a mutation audit found unguarded, called on the servicer in process
(a fake call context, fake vectors): a caller counts as gone once it cancelled or its deadline
passed, a Lookup whose caller has gone is not counted, a refused candidate's verdict reaches
the LookupResponse, and a servicer not yet given its cache answers UNAVAILABLE; and the
housekeeper purges expired entries and writes the hit counters at its stop, and a stop says
when an index merge outlived the time it was given."""

from __future__ import annotations

import os
import threading

import pytest
from tiercache.v1 import semantic_pb2 as pb

from services.common.errors import DeadlineExceeded, Unavailable
from services.semantic.server import Housekeeper, SemanticServicer, _still_wanted, serve
from tests.semantic import test_cache_edges as edges
from tests.semantic.test_cache_edges import A
from tests.waits import holds_within

emb, make_cache = edges.emb, edges.make_cache  # the fixtures of test_cache_edges
NS = pb.Namespace(tenant=A.tenant, model_id=A.model_id, context_hash=A.context_hash)


class Call:
    """A call context: `active` False once the caller cancelled; `left` its deadline's
    seconds left (None: no deadline)."""

    def __init__(self, active: bool = True, left: float | None = None) -> None:
        self.active, self.left = active, left

    def is_active(self) -> bool:
        return self.active

    def time_remaining(self) -> float | None:
        return self.left

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


@pytest.mark.parametrize(("call", "wanted"), [
    (Call(), True), (Call(left=5.0), True),
    (Call(active=False, left=5.0), False),  # cancelled, its deadline still ahead
    (Call(left=0.0), False), (Call(active=False), False),
])
def test_a_caller_is_gone_once_it_cancelled_or_its_deadline_passed(call, wanted):
    """Not cancelled, and deadline not passed: either alone means nobody waits."""
    assert _still_wanted(call) is wanted


def test_a_lookup_whose_caller_has_gone_is_not_counted(make_cache, emb):
    """A Lookup's caller gone before the search: DEADLINE_EXCEEDED, no lookup counted, no hit
    recorded on the entry; the same request from a caller still waiting hits."""
    c = make_cache()
    e = c.store_entry(A, "query", "an answer")
    emb.fixed["query again"] = emb.fixed["query"]  # not an exact repeat: it is embedded
    servicer = SemanticServicer(c)
    req = pb.LookupRequest(namespace=NS, text="query again")
    with pytest.raises(DeadlineExceeded):
        servicer.Lookup(req, Call(active=False, left=5.0))
    assert c.stats().lookups_total == 0 and c.get(e.id).hit_count == 0
    r = servicer.Lookup(req, Call(left=5.0))
    assert r.hit and r.entry.id == e.id and c.stats().lookups_total == 1


def test_a_refused_candidate_is_reported_in_the_lookup_response(make_cache, emb):
    """LookupResponse.guard_rejected and guard_reason say a check refused the candidate."""
    c = make_cache()
    c.store_entry(A, "query", "an answer")
    emb.fixed["query again"] = emb.fixed["query"]
    c._second_opinion = lambda text, prompt, sim, tier: "refused by the test's check"
    r = SemanticServicer(c).Lookup(pb.LookupRequest(namespace=NS, text="query again",
                                                    want_draft=True), Call())
    assert not r.hit and r.guard_rejected
    assert r.guard_reason == "refused by the test's check" and r.entry.prompt == "query"


def test_the_lookup_response_says_where_its_threshold_came_from(make_cache, emb):
    """A direct Lookup caller could not tell whether its explicit threshold was used:
    `threshold` is the verified entry's, lowered by the bonus, and the tier's name is there
    either way. threshold_from_request and base_threshold say it (the orchestrator's
    CacheReport worked it out on its side); an exact repeat (found by text) says it too."""
    c = make_cache()
    e = c.store_entry(A, "query", "an answer")
    c.verify(e.id, True)
    emb.fixed["query again"] = emb.fixed["query"]
    floor, bonus = c.policy.floor, c.cfg.verified_bonus
    for text in ("query again", "query"):
        r = SemanticServicer(c).Lookup(pb.LookupRequest(namespace=NS, text=text,
                                                        threshold=0.97), Call())
        assert r.threshold_from_request and r.base_threshold == pytest.approx(0.97)
        assert r.threshold == pytest.approx(max(floor, 0.97 - bonus))
        r = SemanticServicer(c).Lookup(pb.LookupRequest(namespace=NS, text=text,
                                                        tier="strict"), Call())
        assert not r.threshold_from_request and r.tier == "strict"
        assert r.base_threshold == pytest.approx(c.policy.resolve("strict").threshold)
    # One a float's rounding under the floor is taken as the floor, and says so.
    r = SemanticServicer(c).Lookup(pb.LookupRequest(namespace=NS, text="query again",
                                                    threshold=floor - 5e-7), Call())
    assert r.threshold_from_request and r.base_threshold == pytest.approx(floor, abs=1e-7)


@pytest.mark.parametrize("method", ["Lookup", "Store", "Verify", "Invalidate", "Stats"])
def test_every_call_before_the_cache_is_attached_is_unavailable(method):
    """While the entries load (serve() attaches the cache after), each RPC is UNAVAILABLE,
    not an INTERNAL error from a cache that is not there."""
    with pytest.raises(Unavailable, match="still loading"):
        getattr(SemanticServicer(), method)(pb.InvalidateRequest(id="x"), Call())


def test_the_housekeeper_purges_expired_entries(make_cache, clock):
    """Every expiry_interval_s the housekeeper removes what expired, from memory and SQLite."""
    c = make_cache()
    c.store_entry(A, "query", "an answer", ttl_seconds=10)
    kept = c.store_entry(A, "kept", "another answer", ttl_seconds=100)
    clock.t += 11
    keeper = Housekeeper(c, interval_s=0.01).start()
    try:
        holds_within(lambda: c.store.count() <= 1, 10, 0.01)
    finally:
        keeper.stop()
    assert c.store.count() == 1 and c.stats().expirations_total == 1
    assert c.get(kept.id).answer == "another answer"


def test_the_housekeepers_stop_writes_the_hit_counters(make_cache):
    """Hits are buffered in memory; a clean stop writes them, so a restart keeps the counts
    (and the LRU order they give)."""
    c = make_cache()
    e = c.store_entry(A, "query", "an answer")
    keeper = Housekeeper(c, interval_s=3600).start()
    assert c.lookup(A, "query").hit
    keeper.stop()
    assert c.store.get(e.id).hit_count == 1


def test_a_full_disk_is_one_warning_from_the_housekeeper_not_a_traceback_a_tick(
        make_cache, caplog):
    """A full disk (or a file-size limit) made every tick's hit-counter flush an ERROR with a
    traceback ("housekeeping failed", once a second for as long as the disk stayed full); it
    is one WARNING naming the disk per minute now, and the stop still closes the store."""
    import sqlite3

    c = make_cache()
    c.store_entry(A, "query", "an answer")
    assert c.lookup(A, "query").hit  # a hit counter waiting to be written

    flushes = []
    three_handled = threading.Event()

    def full(sql, *args):
        if sql.startswith("UPDATE"):  # a tick's flush: the 4th starts once 3 were handled
            flushes.append(sql)
            if len(flushes) >= 4:
                three_handled.set()
        raise sqlite3.OperationalError("database or disk is full")

    real = c.store._db
    c.store._db = type("Full", (), {"execute": staticmethod(
        lambda sql, *a: real.execute(sql, *a) if sql in ("BEGIN", "ROLLBACK") else full(sql)),
        "executemany": staticmethod(full), "in_transaction": property(
            lambda self: real.in_transaction), "close": staticmethod(real.close)})()
    keeper = Housekeeper(c, interval_s=0.01).start()
    try:
        # Ticks counted, not slept through (a loaded host ran none in 0.3 s).
        assert three_handled.wait(30)
    finally:
        keeper.stop()
    lines = [r for r in caplog.records if r.name == "services.semantic.server"]
    assert not [r for r in lines if r.levelname == "ERROR"], [r.getMessage() for r in lines]
    warned = [r.getMessage() for r in lines if r.levelname == "WARNING"
              and "not written (retried" in r.getMessage()]
    assert len(warned) == 1 and "disk: the entry store is full" in warned[0]


def test_a_stop_says_when_an_index_merge_outlived_its_time(make_cfg, emb):
    """RunningService.stop waits up to `index_close` for index merges and returns False when
    one still runs (the process must then exit without finalizing), True otherwise."""
    svc = serve(make_cfg(guard_tiers=(), verifier_tiers=()), embedder=emb)
    svc.cache.store_entry(A, "query", "an answer")
    release = threading.Event()
    merge = threading.Thread(target=release.wait, daemon=True)  # stands in for a slow merge
    merge.start()
    svc.cache.index_of(A)._merging = merge
    try:
        assert svc.stop(grace=0, index_close=0.2) is False
        assert merge.is_alive()
    finally:
        release.set()


def test_a_failing_snapshot_save_names_its_error_with_one_traceback(make_cache, caplog,
                                                                    monkeypatch):
    """A snapshot save failing at every interval (a full volume) was an ERROR saying only
    "failed; retried in N s" and a traceback each time: the cause (faiss's write error) was
    in the traceback's last line alone. Each line names it now, the traceback once."""
    import logging

    c = make_cache()
    calls = []

    def full(folder):
        calls.append(folder)
        raise RuntimeError("write error in x.faiss: 244 != 500 (No space left on device)")

    monkeypatch.setattr(c, "save_snapshot", full)
    keeper = Housekeeper(c, interval_s=0.01, snapshot_path="/snap",
                         snapshot_interval_s=0.01).start()
    try:
        holds_within(lambda: len(calls) >= 3, 10, 0.01)
    finally:
        keeper.stop()
    lines = [r for r in caplog.records if r.levelno == logging.ERROR
             and r.getMessage().startswith("saving the HNSW graphs to /snap failed")]
    assert len(lines) >= 3
    assert all("No space left on device" in r.getMessage() for r in lines)
    assert [bool(r.exc_info) for r in lines[:3]] == [True, False, False]


@pytest.mark.parametrize("err", [
    OSError(30, "Read-only file system", "/data/semantic.db.lock"),  # the lock file, first
    PermissionError(13, "Permission denied", "/data/cache/onnx"),  # another uid's volume
])
def test_a_start_on_a_volume_it_cannot_write_says_so_not_bad_configuration(
        monkeypatch, caplog, err):
    """A read-only data volume stopped the start with "bad configuration: OSError: [Errno
    30] ...", though no setting was wrong: the line names the path, the cause and the fix."""
    import logging

    import services.semantic.__main__ as main

    monkeypatch.setattr(main, "load_service_config", lambda *a: object())

    def refuse(cfg):
        raise err
    monkeypatch.setattr(main, "serve", refuse)
    with caplog.at_level(logging.ERROR, logger="services.semantic"):
        assert main._main([]) == 2
    line = caplog.records[-1].getMessage()
    assert line.startswith(f"cannot start: {err.filename} is not writable ({err.strerror})")
    assert "bad configuration" not in line and "TIERCACHE_SEMANTIC_DB_PATH" in line


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs (read-only to all)")
def test_a_snapshot_folder_that_cannot_be_written_stops_the_start_naming_its_variable(
        make_cfg, emb, tmp_path):
    """The HNSW graphs' folder on a read-only volume was found only when a save failed (after
    snapshot_interval_s, or at the stop): refused at start, as the database's folder is, in a
    line naming TIERCACHE_SEMANTIC_SNAPSHOT_PATH (sysfs refuses even root, whom os.access
    answers yes). A folder not there yet but creatable is taken, and not made until a save."""
    from services.semantic.store import NotWritable

    with pytest.raises(NotWritable, match=r"^TIERCACHE_SEMANTIC_SNAPSHOT_PATH: /sys/kernel "
                                          r"is not writable"):
        serve(make_cfg(snapshot_path="/sys/kernel/tiercache/graphs"), embedder=emb)
    # Nothing held: the database is not left locked.
    graphs = tmp_path / "not" / "yet" / "graphs"
    svc = serve(make_cfg(snapshot_path=str(graphs)), embedder=emb)
    try:
        assert not (tmp_path / "not").exists()
    finally:
        svc.stop(grace=0)
    assert list(tmp_path.glob("**/.write-probe.*")) == []


def test_the_serving_line_says_the_thresholds_the_start_took():
    """Thresholds are read at start only: the serving line names the ones taken (tiers,
    verified bonus, floor, guard and verifier tiers), so a restart with new values shows them."""
    from services.semantic.__main__ import thresholds_said
    from services.semantic.config import SemanticConfig

    said = thresholds_said(SemanticConfig(tier_strict=0.98, tier_relaxed=0.88,
                                          verifier_tiers=("strict",)))
    assert said == ("thresholds strict 0.98, standard 0.95, relaxed 0.88 (verified entries 0.02 "
                    "lower, floor 0.85); guard strict,standard, verifier strict")
    assert thresholds_said(SemanticConfig(guard_tiers=(), verifier_tiers=())).endswith(
        "guard none, verifier none")


def test_a_damaged_database_stops_the_start_as_no_bad_configuration(monkeypatch, caplog):
    """A database damaged on disk stopped the start with "bad configuration: DatabaseError:
    ...", though no setting was wrong: the line is the store's own, naming the file and the
    way out."""
    import logging
    import sqlite3

    import services.semantic.__main__ as main

    monkeypatch.setattr(main, "load_service_config", lambda *a: object())

    def refuse(cfg):
        raise sqlite3.DatabaseError("/data/semantic.db: file is not a database (a damaged "
                                    "database: stop the service, then move ...)")
    monkeypatch.setattr(main, "serve", refuse)
    with caplog.at_level(logging.ERROR, logger="services.semantic"):
        assert main._main([]) == 2
    line = caplog.records[-1].getMessage()
    assert line.startswith("cannot start: /data/semantic.db: file is not a database"), line


def test_a_folder_at_the_lock_path_stops_the_start_naming_it_not_bad_configuration(
        monkeypatch, caplog, tmp_path):
    """`semantic.db.lock` a folder read "bad configuration: IsADirectoryError: ...", sending
    the operator to the settings: the line says "cannot start:", the path, and the way out,
    as the damaged database's does."""
    import logging

    import services.semantic.__main__ as main
    from services.semantic.store import EntryStore

    (tmp_path / "semantic.db.lock").mkdir()
    monkeypatch.setattr(main, "load_service_config", lambda *a: object())
    monkeypatch.setattr(main, "serve", lambda cfg: EntryStore(str(tmp_path / "semantic.db")))
    with caplog.at_level(logging.ERROR, logger="services.semantic"):
        assert main._main([]) == 2
    line = caplog.records[-1].getMessage()
    assert line.startswith(f"cannot start: {tmp_path}/semantic.db.lock is a folder, where the "
                           "database's lock file"), line


def test_a_stop_says_what_it_saved_of_the_hnsw_graphs_or_why_nothing(make_cfg, emb, caplog,
                                                                     tmp_path):
    """A shard stopped soon after its first Stores wrote no snapshot and said nothing of it:
    by design (a namespace under hnsw_min_entries is searched flat, rebuilt at start in
    moments, so there is no graph to save), but the operator looking for the folder could not
    tell it from a save lost. The stop's line says what it saved, and why the rest was not."""
    import logging

    snap = tmp_path / "s.db.hnsw"
    svc = serve(make_cfg(guard_tiers=(), verifier_tiers=(), snapshot_path=str(snap)),
                embedder=emb)
    svc.cache.store_entry(A, "query", "an answer")
    with caplog.at_level(logging.INFO, logger="services.semantic.server"):
        assert svc.stop(grace=0, index_close=5) is True
    # The server's own line (the start's "0 HNSW graphs taken from the snapshot" is the
    # cache's, captured too once an earlier test has set the service's log levels).
    (line,) = [r.getMessage() for r in caplog.records
               if r.name == "services.semantic.server" and "HNSW graph" in r.getMessage()]
    assert line.startswith(f"saved 0 HNSW graphs to {snap}") and "1 namespace" in line
    assert "flat" in line and "hnsw_min_entries" in line and not snap.exists()
