"""Request coalescing under races (services/orchestrator/coalesce.py), through the real
pipeline with fake replicas: requests arriving, ending and taking over in the orders that
only threads racing give, each pinned by a hook that holds one step back until the others
have happened."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from services.common import errors
from services.orchestrator.coalesce import Flight
from services.orchestrator.pipeline import Policy
from tests.orchestrator.test_coalesce import (
    WANT,
    FailsAt,
    Gated,
    HungStore,
    Stores,
    coalesced,
    ids_of,
    last,
    lead_and_follow,
    run,
    token,
)
from tests.orchestrator.test_pipeline_paths import PROMPT, RpcError, Stub, final, make
from tests.waits import wait_until


def held_take_overs(orch) -> threading.Event:
    """Every `Flights.take_over` waits until the event returned is set (a follower of a leader
    gone unfinished, slow to go on)."""
    go, real = threading.Event(), orch.flights.take_over

    def take_over(*args, **kwargs):
        go.wait(10)
        return real(*args, **kwargs)

    orch.flights.take_over = take_over
    return go


def test_one_taking_over_from_a_fresh_flight_behind_it_starts_its_own_with_all_it_read():
    # f0 read 104, 105 from the leader, gone; a fresh identical request led a flight from
    # scratch meanwhile, which f0 followed; it ended too, after 104 alone. f0 took over from it
    # with that flight's tokens (104) though it went on from its own (104, 105): the flight it
    # led read 104, 33, 10, and a request joining it got that answer.
    resume = threading.Event()
    stub = Stub("A", [Gated([*map(token, WANT[:-1]), last(10)], threading.Event(), free=2),
                      Gated([*map(token, WANT[:-1]), last(10)], threading.Event(), free=1),
                      Gated([token(33), last(10)], resume)])
    orch = make({"A": stub})
    go = held_take_overs(orch)
    out, cancels = {}, {}
    threads = list(lead_and_follow(orch, lambda: stub.requests, out, cancels))
    time.sleep(0.1)  # f0 has read the two tokens the leader has
    cancels["lead"]()
    wait_until(lambda: len(orch.flights) == 0, 5, "the leader's flight never ended")
    threads.append(run(orch, "fresh", out, cancels))
    wait_until(lambda: len(stub.requests) == 2, 5, "the fresh one never called its replica")
    go.set()  # f0 goes on: it follows the fresh one's flight
    time.sleep(0.1)  # the fresh one has read 104
    cancels["fresh"]()
    wait_until(lambda: len(stub.requests) == 3, 5, "f0 never went on")
    assert list(stub.requests[2].token_ids) == PROMPT + [104, 105]
    before = coalesced()
    threads.append(run(orch, "late", out, cancels))  # joins the flight f0 leads
    wait_until(lambda: coalesced() == before + 1, 5, "the late one never joined")
    resume.set()
    for t in threads:
        t.join(10)
    assert isinstance(out["lead"], errors.Cancelled) and isinstance(out["fresh"], errors.Cancelled)
    assert ids_of(out["f0"]) == WANT and out["f0"][-1].report.route == "resume"
    assert ids_of(out["late"]) == WANT
    rep = out["late"][-1].report
    assert (rep.route, rep.coalesced_with) == ("coalesced", "f0")
    assert len(stub.requests) == 3 and len(orch.flights) == 0


def test_a_chain_of_takers_failing_or_gone_ends_in_the_answer_once_exact():
    # Not pinned before: a taker failing (a replica's error, its attempts spent) rather than
    # cancelled, and a taker gone after a token of its own run, which the next one goes on
    # from. The leader's client goes after 104, 105; the first to take over fails; the second
    # reads 33 from its replica, then its client goes; the last goes on after 104, 105, 33.
    fail, semantic = threading.Event(), Stores()
    stub = Stub("A", [Gated([*map(token, WANT[:-1]), last(10)], threading.Event(), free=2),
                      FailsAt(fail, RpcError(grpc.StatusCode.INTERNAL)),
                      Gated([token(33), last(10)], threading.Event(), free=1),
                      Gated([last(10)], threading.Event(), free=1)])
    orch = make({"A": stub}, semantic=semantic, max_attempts=1)
    out, cancels = {}, {}
    threads = lead_and_follow(orch, lambda: stub.requests, out, cancels, 3)
    time.sleep(0.1)  # the followers have read the two tokens the leader has
    cancels["lead"]()
    wait_until(lambda: len(stub.requests) == 2, 5, "no follower went on")
    fail.set()
    wait_until(lambda: len(stub.requests) == 3, 5, "none went on after the first failed")
    time.sleep(0.1)  # the second has read 33 from its replica
    cancels[stub.requests[2].request_id]()
    wait_until(lambda: len(stub.requests) == 4, 5, "none went on after the second went")
    for t in threads:
        t.join(10)
    first, second, third = (r.request_id for r in stub.requests[1:])
    assert [list(r.token_ids) for r in stub.requests[1:]] == [
        PROMPT + [104, 105], PROMPT + [104, 105], PROMPT + [104, 105, 33]]
    assert isinstance(out[first], errors.TierCacheError)
    assert not isinstance(out[first], errors.Cancelled)
    assert isinstance(out[second], errors.Cancelled)
    assert ids_of(out[third]) == WANT
    rep = out[third][-1].report
    # Its last tokens before its own run came from the second's.
    assert (rep.route, rep.coalesced_with, rep.semantic_entry_id) == ("resume", second, "e1")
    assert len(semantic.stored) == 1 and semantic.stored[0].answer == "hi!\n"
    assert sum(orch.stats.requests.values()) == 1 and len(orch.flights) == 0


def test_one_joining_a_flight_taken_over_whole_names_the_request_whose_run_gave_it():
    # The leader read the whole answer, then its client went before its final: f0 took over
    # with the answer whole, running nothing (its report: coalesced with "lead"), and stores
    # it. One arriving during that Store joined f0's flight and named f0, whose report has no
    # run's figures (forward passes 0), as the request whose model run gave its answer.
    semantic = HungStore()
    stub = Stub("A", [Gated([*map(token, WANT), final("A", 0)], threading.Event(),
                            free=len(WANT))])
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    threads = list(lead_and_follow(orch, lambda: stub.requests, out, cancels))
    time.sleep(0.1)  # f0 has read the whole answer
    cancels["lead"]()
    assert semantic.storing.wait(5)  # f0 stores it
    before = coalesced()
    threads.append(run(orch, "late", out, cancels))
    wait_until(lambda: coalesced() == before + 1, 5, "the late one never joined f0's flight")
    semantic.release.set()
    for t in threads:
        t.join(10)
    assert ids_of(out["f0"]) == ids_of(out["late"]) == WANT and len(stub.requests) == 1
    reps = {r: out[r][-1].report for r in ("f0", "late")}
    assert {r: (rep.route, rep.coalesced_with, rep.semantic_entry_id)
            for r, rep in reps.items()} == {"f0": ("coalesced", "lead", "e1"),
                                            "late": ("coalesced", "lead", "e1")}
    assert len(orch.flights) == 0


def after_the_claim(orch, storing: threading.Event, may_end: threading.Event) -> None:
    """The leader's Store (one it may not make: nothing stored) waits until `storing` is set
    (a follower that claimed the Store is storing), its flight's end until `may_end` is."""
    store_answer, end = orch._store_answer, orch.flights.end

    def held_store_answer(*args):
        if not args[4]:  # may_store
            storing.wait(5)
        return store_answer(*args)

    def held_end(flight):
        may_end.wait(5)
        end(flight)

    orch._store_answer, orch.flights.end = held_store_answer, held_end


def test_requests_sharing_a_request_id_name_the_entry_their_answer_was_stored_as():
    # A client's x-request-id is kept as the request's id: two requests may carry one. The
    # leader "x" may not store (skip_semantic_store); its follower "x" claimed the Store. The
    # leader, its Store (none) or its end, was read as the storer's (its id): "" for "y".
    gate, semantic, may_end = threading.Event(), HungStore(), threading.Event()
    stub = Stub("A", [Gated([token(104), last(10)], gate)])
    orch = make({"A": stub}, semantic=semantic)
    after_the_claim(orch, semantic.storing, may_end)
    out, cancels = {}, {}
    threads = [run(orch, "x", out, cancels, Policy(skip_semantic_store=True))]
    wait_until(lambda: stub.requests, 5, "the leader never called its replica")
    before = coalesced()
    out2, cancels2 = {}, {}
    threads.append(run(orch, "x", out2, cancels2))  # the same id, another request
    wait_until(lambda: coalesced() == before + 1, 5, "the second x never joined")
    gate.set()
    assert semantic.storing.wait(5)  # the second x stores it
    # y joins the flight (the answer whole, its Store claimed), then the leader ends.
    threads.append(run(orch, "y", out, cancels))
    wait_until(lambda: coalesced() == before + 2, 5, "y never joined")
    time.sleep(0.1)  # y waits for the second x's Store
    may_end.set()
    wait_until(lambda: not threads[0].is_alive(), 5, "the leader never ended")
    semantic.release.set()
    for t in threads:
        t.join(10)
    assert ids_of(out["x"]) == ids_of(out2["x"]) == ids_of(out["y"]) == [104, 10]
    assert not out["x"][-1].report.semantic_entry_id
    assert out2["x"][-1].report.semantic_entry_id == out["y"][-1].report.semantic_entry_id == "e1"
    assert len(orch.flights) == 0


class CancelledStore(Stores):
    """A semantic tier whose first Store waits until its call is cancelled (its request's
    client gone: grpc.FutureCancelledError, nothing written; `storer` names that request, by
    its replica side's thread); the later ones store at once."""

    def __init__(self) -> None:
        super().__init__()
        self.storing, self.storer = threading.Event(), ""

    def store(self, req, timeout=None, on_call=None):
        if self.storing.is_set():
            return super().store(req, timeout, on_call)
        self.storer = threading.current_thread().name.removeprefix("replica-stream-")
        cancelled = threading.Event()
        on_call(SimpleNamespace(cancel=cancelled.set))
        self.storing.set()
        cancelled.wait(10)
        raise grpc.FutureCancelledError()


@pytest.mark.parametrize("lead_policy", [Policy(), Policy(skip_semantic_store=True)])
def test_a_storer_whose_client_goes_during_its_store_passes_it_to_another_that_may(
        lead_policy):
    # The storer (the leader, or the first follower to claim the Store where the leader asked
    # not to store) is cancelled during its Store: the answer went unstored for the herd, and
    # no report named an entry.
    gate, semantic = threading.Event(), CancelledStore()
    semantic.timeout_s = 5  # how long the others wait for it: ample
    stub = Stub("A", [Gated([token(104), last(10)], gate)])
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    threads = lead_and_follow(orch, lambda: stub.requests, out, cancels, 3,
                              lead_policy=lead_policy)
    gate.set()
    assert semantic.storing.wait(5)
    cancels[semantic.storer]()
    for t in threads:
        t.join(10)
    assert isinstance(out[semantic.storer], errors.Cancelled)
    others = {"lead", "f0", "f1", "f2"} - {semantic.storer}
    assert all(ids_of(out[r]) == [104, 10] for r in others), out
    # Stored once, by a follower still there; each of the others that asked no
    # skip_semantic_store names its entry.
    assert [(r.answer, r.truncated_at) for r in semantic.stored] == [("h\n", 2)]
    skips = {"lead"} if lead_policy.skip_semantic_store else set()
    assert {r: out[r][-1].report.semantic_entry_id for r in others} == {
        r: "" if r in skips else "e1" for r in others}
    assert len(orch.flights) == 0


def test_a_storer_with_no_time_left_for_its_store_passes_it_to_another_that_may():
    # The leader reaches its Store with under 0.1 s of its deadline left (a Store gets half of
    # it, under the 50 ms one is sent with): not sent, and none stored the answer.
    semantic = Stores()
    semantic.timeout_s = 5  # the followers wait for it up to 5 s: past the leader's deadline
    orch, stub, out = herd_of_two(semantic, left_s=0.06, lead_deadline_s=2.0)
    assert len(semantic.stored) == 1 and len(stub.requests) == 1
    assert all(ids_of(out[f"f{i}"]) == [104, 10] for i in range(2))
    assert [out[f"f{i}"][-1].report.semantic_entry_id for i in range(2)] == ["e1"] * 2
    # The leader's own answer (if its deadline let it have one) names none: it stored none.
    assert (isinstance(out["lead"], errors.DeadlineExceeded)
            or not out["lead"][-1].report.semantic_entry_id)
    assert len(orch.flights) == 0


def herd_of_two(semantic, left_s: float | None = None, lead_deadline_s: float = 30):
    """A leader and two followers of one answer ([104, 10]) on one replica, run to their end:
    (orch, its replica's stub, each one's output). `left_s`: the leader's Store starts with
    that much of its deadline left (its deadline near)."""
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), last(10)], gate)])
    orch = make({"A": stub}, semantic=semantic)
    store_answer = orch._store_answer

    def late(*args):
        if threading.current_thread().name == "replica-stream-lead":
            time.sleep(max(0.0, args[7] - time.monotonic() - left_s))
        return store_answer(*args)

    if left_s is not None:
        orch._store_answer = late
    out: dict = {}
    threads = lead_and_follow(orch, lambda: stub.requests, out, {}, 2,
                              lead_deadline_s=lead_deadline_s)
    gate.set()
    for t in threads:
        t.join(10)
    return orch, stub, out


class TimesOutFirst(Stores):
    """A semantic tier whose first Store times out under its caller's bound (DEADLINE_EXCEEDED),
    the entry written first (`lands`: it landed late) or not; a Store of the answer the
    prompt's entry already holds writes nothing and returns that entry, as the tier does
    (services/semantic/cache.py `_held_answer`). `timeouts`: each Store's timeout."""

    def __init__(self, lands: bool) -> None:
        super().__init__()
        self.lands, self.timeouts = lands, []

    def store(self, req, timeout=None, on_call=None):
        self.timeouts.append(timeout)
        held = [i for i, r in enumerate(self.stored, 1)
                if (r.prompt, r.answer) == (req.prompt, req.answer)]
        if held and len(self.timeouts) > 1:
            return SimpleNamespace(id=f"e{held[-1]}")
        if len(self.timeouts) == 1:
            if self.lands:
                super().store(req, timeout, on_call)
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)
        return super().store(req, timeout, on_call)


@pytest.mark.parametrize("lands", [True, False])
@pytest.mark.parametrize("left_s", [0.3, 1.5])  # a Store of 0.15 s (no stall evidence), 0.75 s
def test_a_storer_whose_store_times_out_under_its_own_bound_passes_it_to_another_that_may(
        lands, left_s):
    # The leader's Store, bounded by half of what is left of its deadline (under the tier's
    # timeout), timed out: the followers named no entry, though a Store of their own had time.
    semantic = TimesOutFirst(lands)
    semantic.timeout_s = 5  # the followers' Stores (and waits) may take up to 5 s
    orch, stub, out = herd_of_two(semantic, left_s=left_s, lead_deadline_s=3.0)
    assert len(stub.requests) == 1
    assert all(ids_of(out[f"f{i}"]) == [104, 10] for i in range(2))
    # Two Stores, the first the leader's (under its own bound), the second a follower's
    # within its own; one row, named by both followers.
    assert len(semantic.timeouts) == 2 and semantic.timeouts[0] < left_s / 2 + 0.01
    assert 1.0 < semantic.timeouts[1] <= 5
    assert [(r.answer, r.truncated_at) for r in semantic.stored] == [("h\n", 2)]
    assert [out[f"f{i}"][-1].report.semantic_entry_id for i in range(2)] == ["e1"] * 2
    assert (isinstance(out["lead"], errors.DeadlineExceeded)
            or not out["lead"][-1].report.semantic_entry_id)
    assert len(orch.flights) == 0


def test_a_store_that_runs_out_the_tiers_whole_timeout_is_not_passed_on():
    # The tier's own timeout, not the storer's: a hung tier, each follower's Store would hang
    # as long. None is sent again; the followers name no entry.
    semantic = TimesOutFirst(False)
    semantic.timeout_s = 0.3  # the leader's Store's bound, as the followers'
    orch, stub, out = herd_of_two(semantic)
    assert semantic.timeouts == [0.3] and not semantic.stored
    assert all(ids_of(out[r]) == [104, 10] for r in ("lead", "f0", "f1"))
    assert not any(out[r][-1].report.semantic_entry_id for r in ("lead", "f0", "f1"))
    assert len(orch.flights) == 0


def test_one_that_may_not_store_names_the_entry_one_that_may_claims_during_its_wait(
        monkeypatch):
    # The leader and f0 asked not to store; f1, which may, reached the Store after f0 began
    # to wait for it: f0 named none (none had claimed it), though f1 stored it at once.
    gate, semantic, skip = threading.Event(), Stores(), Policy(skip_semantic_store=True)
    semantic.timeout_s = 5  # f0 waits up to 5 s
    stub = Stub("A", [Gated([token(104), last(10)], gate)])
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    real_read = Flight.read

    def read(flight, *args):
        got = real_read(flight, *args)
        if got.final is not None and threading.current_thread().name == "replica-stream-f1":
            # f1 has the answer once f0 has ended (before the fix), or has waited a while.
            wait_until(lambda: "f0" in out or time.monotonic() > held_from + 0.5, 5,
                       "f1 was held for ever")
        return got

    held_from = time.monotonic() + 3600
    monkeypatch.setattr(Flight, "read", read)
    threads = list(lead_and_follow(orch, lambda: stub.requests, out, cancels, 1, skip, skip))
    before = coalesced()
    threads.append(run(orch, "f1", out, cancels))
    wait_until(lambda: coalesced() == before + 1, 5, "f1 never joined")
    held_from = time.monotonic()
    gate.set()
    for t in threads:
        t.join(10)
    assert all(ids_of(out[r]) == [104, 10] for r in ("lead", "f0", "f1"))
    assert len(semantic.stored) == 1
    assert {r: out[r][-1].report.semantic_entry_id for r in ("lead", "f0", "f1")} == {
        "lead": "", "f0": "e1", "f1": "e1"}
    assert len(orch.flights) == 0


def test_one_taking_over_whole_that_may_not_store_names_the_entry_a_follower_after_it_stores():
    # The leader read the whole answer, then its client went before its final. f0 (may not
    # store) took over first, with the answer whole; f1 (may) took over after f0 began to wait
    # for the Store: f0 named none (f1 was not yet known to its flight), though f1 stored it.
    semantic, skip = Stores(), Policy(skip_semantic_store=True)
    semantic.timeout_s = 5  # f0 waits up to 5 s
    stub = Stub("A", [Gated([*map(token, WANT), final("A", 0)], threading.Event(),
                            free=len(WANT))])
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    real_take_over = orch.flights.take_over

    def take_over(*args, **kwargs):
        if threading.current_thread().name == "replica-stream-f1":
            # f1 goes on once f0 has ended (before the fix), or has waited a while.
            wait_until(lambda: "f0" in out or time.monotonic() > held_from + 0.5, 5,
                       "f1 was held for ever")
        return real_take_over(*args, **kwargs)

    orch.flights.take_over = take_over
    threads = list(lead_and_follow(orch, lambda: stub.requests, out, cancels, 1, skip))
    before = coalesced()
    threads.append(run(orch, "f1", out, cancels))
    wait_until(lambda: coalesced() == before + 1, 5, "f1 never joined")
    time.sleep(0.1)  # the followers have read the whole answer
    held_from = time.monotonic()
    cancels["lead"]()
    for t in threads:
        t.join(10)
    assert all(ids_of(out[r]) == WANT for r in ("f0", "f1")) and len(stub.requests) == 1
    assert len(semantic.stored) == 1
    assert {r: out[r][-1].report.semantic_entry_id for r in ("f0", "f1")} == {
        "f0": "e1", "f1": "e1"}
    assert len(orch.flights) == 0
