"""Request coalescing (services/orchestrator/coalesce.py): the flight and its registry as pure
logic, then through the real pipeline with fake replicas (identical greedy requests in flight
together make one replica call; a leader gone unfinished leaves its followers one resumed run
between them)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2

from services.common import errors
from services.orchestrator.coalesce import Flights, flight_key, may_coalesce
from services.orchestrator.pipeline import Finished, Policy, Sampling, TextDelta
from services.orchestrator.render import RenderedPrompt
from services.orchestrator.tenants import Tenant
from tests.metric_sample import sample_value
from tests.orchestrator.test_pipeline_paths import (
    PROMPT,
    TENANT,
    RpcError,
    Semantic,
    Stub,
    final,
    make,
)
from tests.waits import wait_until

SAMPLING = Sampling(4, 0.0, 1.0, 0, (), False)
KEY = flight_key("a", "salt-a", "m", PROMPT, SAMPLING)
FAR = time.monotonic() + 3600  # a deadline no test reaches


# ---- the flight and its registry ----------------------------------------------------------

def test_a_follower_reads_the_backlog_at_once_then_live_tokens_then_the_final():
    flights = Flights()
    flight, leads = flights.join(KEY, "leader")
    assert leads
    flight.publish([1, 2])
    same, follows = flights.join(KEY, "follower")
    assert same is flight and not follows
    stop = threading.Event()
    assert flight.read(0, FAR, stop).ids == [1, 2]  # the backlog, at once
    threading.Timer(0.1, flight.publish, ([3],)).start()
    got = flight.read(2, FAR, stop)  # waits for the live batch
    assert got.ids == [3] and not got.ended
    fin = kvpool_pb2.KvGenerateFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    flight.finish(fin, "kvpool-0")
    flights.end(flight)
    got = flight.read(3, FAR, stop)
    assert got.ended and got.final is fin and flight.replica_id == "kvpool-0"
    assert len(flights) == 0


def test_a_leader_ending_unfinished_leaves_its_tokens_and_no_final():
    flights = Flights()
    flight, _ = flights.join(KEY, "leader")
    flight.publish([5, 6])
    threading.Timer(0.1, flights.end, (flight,)).start()
    stop = threading.Event()
    assert flight.read(0, FAR, stop).ids == [5, 6]
    got = flight.read(2, FAR, stop)
    assert got.ended and got.final is None and got.ids == []
    assert len(flights) == 0
    # Ended: the next identical request leads a flight of its own.
    again, leads = flights.join(KEY, "next")
    assert leads and again is not flight


def test_a_followers_wait_ends_at_its_deadline_or_when_it_is_told_to_stop():
    flight, _ = Flights().join(KEY, "leader")
    stop = threading.Event()
    t0 = time.monotonic()
    got = flight.read(0, time.monotonic() + 0.2, stop)
    assert got == ([], False, None) and time.monotonic() - t0 >= 0.2

    def cancel() -> None:
        stop.set()
        flight.wake()

    threading.Timer(0.1, cancel).start()
    t0 = time.monotonic()
    got = flight.read(0, FAR, stop)
    assert got == ([], False, None) and time.monotonic() - t0 < 5


def test_the_answer_has_one_storer_whose_entry_the_others_are_told():
    stop = threading.Event()
    fin = kvpool_pb2.KvGenerateFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    # None stores it (the leader may not, no follower claimed): nothing for "w", one that may
    # not store, to wait for.
    flight, _ = Flights().join(KEY, "leader")
    flight.finish(fin, "kvpool-0")
    t0 = time.monotonic()
    assert flight.settle("w", False, FAR, stop) == "" and time.monotonic() - t0 < 1
    # The first follower that claims it stores it; a second may not; the others wait for it.
    assert claims(flight, "f0") and not claims(flight, "f1")
    threading.Timer(0.1, flight.stored, ("f0", "e7")).start()
    flight.stored("f1", "e8")  # not the storer: nothing
    assert flight.settle("w", False, FAR, stop) == "e7"
    # The leader, claimed as it finishes: its Store waited for until it ends, or its side
    # does (its Store never to come); at most until the wait's deadline.
    flights = Flights()
    flight, _ = flights.join(KEY, "leader")
    flight.finish(fin, "kvpool-0", stores=True)
    assert not claims(flight, "f0")
    t0 = time.monotonic()
    assert flight.settle("w", False, time.monotonic() + 0.2, stop) == ""
    assert time.monotonic() - t0 >= 0.2
    threading.Timer(0.1, flights.end, (flight,)).start()
    assert flight.settle("w", False, FAR, stop) == ""


def test_a_store_not_made_passes_to_a_follower_that_may_store_and_is_still_there():
    stop = threading.Event()
    fin = kvpool_pb2.KvGenerateFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    flights = Flights()
    flight, _ = flights.join(KEY, "leader")
    for rid, may_store in (("f0", True), ("f1", True), ("f2", False)):
        assert flights.join(KEY, rid, may_store=may_store) == (flight, False)
    flight.finish(fin, "kvpool-0", stores=True)
    # The leader's Store not made (its client went during it): f0, waiting, claims it; the
    # leader's word after that is no longer the storer's.
    threading.Timer(0.1, flight.stored, ("leader", None)).start()
    assert flight.settle("f0", True, FAR, stop) is None
    flight.stored("leader", "e9")
    assert not claims(flight, "f1")
    threading.Timer(0.1, flight.stored, ("f0", "e7")).start()
    assert flight.settle("f2", False, FAR, stop) == "e7"
    assert flight.settle("f1", True, FAR, stop) == "e7"  # stored once: named, not stored
    # None claimed yet: one that may not store waits while a follower that may is still
    # there (it claims, its Store named), and not once the last of them left.
    flight = finished_with_a_follower_that_may_store(fin)
    threading.Timer(0.1, claim_and_store, (flight, "e5")).start()
    assert flight.settle("f2", False, FAR, stop) == "e5"
    flight = finished_with_a_follower_that_may_store(fin)
    threading.Timer(0.1, flight.leave, ("f0",)).start()
    t0 = time.monotonic()
    assert flight.settle("f2", False, FAR, stop) == "" and time.monotonic() - t0 < 5
    # A Store that stored nothing (the tier refused it) is not passed on.
    flight = finished_with_a_follower_that_may_store(fin)
    flight.add_follower("f1", True)
    claim_and_store(flight, "")
    assert flight.settle("f1", True, FAR, stop) == ""


def finished_with_a_follower_that_may_store(fin):
    """A flight finished by a leader that may not store, "f0" (that may) following it."""
    flight, _ = Flights().join(KEY, "leader")
    flight.add_follower("f0", True)
    flight.finish(fin, "kvpool-0")
    return flight


def claim_and_store(flight, entry_id: str) -> None:
    """"f0" claims the Store of `flight` and stores the answer as `entry_id`."""
    assert flight.settle("f0", True, FAR, threading.Event()) is None
    flight.stored("f0", entry_id)


def claims(flight, member) -> bool:
    """Whether `member`, that may store, claims the Store of `flight` at once (else it waits
    50 ms for it)."""
    return flight.settle(member, True, time.monotonic() + 0.05, threading.Event()) is None


def test_the_followers_of_a_flight_ended_unfinished_all_take_over_into_one_flight():
    flights = Flights()
    gone, _ = flights.join(KEY, "leader")
    gone.publish([5, 6], "kvpool-0")
    flights.end(gone)
    first, leads = flights.take_over(gone, "f0")
    # It starts with the tokens read: one joining it now reads the answer from token 0.
    assert leads and first.leader_id == "f0" and first.tokens() == [5, 6]
    assert first.replica_id == "kvpool-0"
    assert flights.join(KEY, "late") == (first, False)
    flights.end(first)  # its leader gone too, before another follower of `gone` asked
    assert flights.take_over(gone, "f1") == (first, False)  # the same way: it ended
    second, leads = flights.take_over(first, "f1")
    assert leads and second.tokens() == [5, 6] and second is not first
    flights.end(second)
    # A flight an identical request opened meanwhile (from token 0) is followed instead.
    fresh, _ = flights.join(KEY, "fresh")
    assert flights.take_over(second, "f2") == (fresh, False)
    flights.end(fresh)
    assert len(flights) == 0


def test_a_take_over_with_the_tokens_already_whole_is_finished_and_claimed_at_once():
    stop = threading.Event()
    fin = kvpool_pb2.KvGenerateFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    flights = Flights()
    gone, _ = flights.join(KEY, "leader")
    gone.publish([5, 6, 7, 8], "kvpool-0")
    flights.end(gone)
    fresh, _ = flights.join(KEY, "fresh")  # opened since: not followed, its run not whole
    taker, leads = flights.take_over(gone, "f0", fin, stores=True)
    assert leads and taker is not fresh and taker.read(4, FAR, stop).final is fin
    # The others see it finished, its Store claimed by the one that took over.
    assert flights.take_over(gone, "f1", fin, stores=True) == (taker, False)
    assert not claims(taker, "f1")
    taker.stored("f0", "e7")
    assert taker.settle("w", False, FAR, stop) == "e7"
    flights.end(taker)
    flights.end(fresh)
    # One that may not store leaves the claim to the first of the others that may.
    gone, _ = flights.join(KEY, "leader")
    flights.end(gone)
    taker, _ = flights.take_over(gone, "f0", fin, stores=False)
    assert flights.join(KEY, "late") == (taker, False)  # open until it ends
    assert claims(taker, "f1")
    flights.end(taker)
    assert len(flights) == 0


def test_the_followers_that_may_store_of_a_flight_taken_over_are_its_successors_at_once():
    # Known to the flight taking over only as each asked to: one that took over first, that
    # may not store, named no entry though a follower that may was yet to claim it.
    stop = threading.Event()
    fin = kvpool_pb2.KvGenerateFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    for gone_first in (False, True):
        flights = Flights()
        gone, _ = flights.join(KEY, "leader")
        flights.join(KEY, "f0", may_store=True)
        flights.join(KEY, "f1")
        flights.end(gone)
        taker, leads = flights.take_over(gone, "f1", fin)
        assert leads
        if gone_first:  # f0's side ended before it asked: it leaves the taker's flight too
            threading.Timer(0.1, gone.leave, ("f0",)).start()
            t0 = time.monotonic()
            assert taker.settle("f1", False, FAR, stop) == ""
            assert time.monotonic() - t0 < 5
        else:
            threading.Timer(0.1, claim_and_store, (taker, "e5")).start()
            assert taker.settle("f1", False, FAR, stop) == "e5"
        flights.end(taker)
        assert len(flights) == 0


def test_requests_that_differ_in_what_decides_the_tokens_never_share_a_flight():
    flights = Flights()
    keys = [KEY,
            flight_key("b", "salt-a", "m", PROMPT, SAMPLING),  # another tenant
            flight_key("a", "salt-b", "m", PROMPT, SAMPLING),  # another salt
            flight_key("a", "salt-a", "m2", PROMPT, SAMPLING),  # another model
            flight_key("a", "salt-a", "m", PROMPT + [7], SAMPLING),  # another prompt
            flight_key("a", "salt-a", "m", PROMPT, Sampling(5, 0.0, 1.0, 0, (), False)),
            flight_key("a", "salt-a", "m", PROMPT, Sampling(4, 0.0, 1.0, 0, (9,), False)),
            flight_key("a", "salt-a", "m", PROMPT, Sampling(4, 0.0, 1.0, 0, (), True))]
    assert all(flights.join(k, f"r{i}")[1] for i, k in enumerate(keys))
    assert len(flights) == len(keys)


def test_greedy_requests_that_differ_in_nothing_that_decides_the_tokens_share_a_flight():
    # Greedy is the argmax: seed and top_p choose nothing; stop ids are a set (another order,
    # one twice); max_tokens_set only words a refusal. Each had a flight of its own.
    stops = Sampling(4, 0.0, 1.0, 0, (9, 3), False)
    same = [Sampling(4, 0.0, 1.0, 0, (3, 9, 9), False), Sampling(4, 0.0, 0.5, 7, (9, 3), False),
            Sampling(4, 0.0, 1.0, 0, (9, 3), False, max_tokens_set=False)]
    key = flight_key("a", "salt-a", "m", PROMPT, stops)
    assert all(flight_key("a", "salt-a", "m", PROMPT, s) == key for s in same)


def test_only_greedy_requests_with_their_caches_on_coalesce():
    assert may_coalesce(True, True, False, False)
    assert not may_coalesce(False, True, False, False)  # switched off
    assert not may_coalesce(True, False, False, False)  # sampled
    assert not may_coalesce(True, True, True, False)  # skip_semantic_lookup
    assert not may_coalesce(True, True, False, True)  # skip_prefix_cache


# ---- through the pipeline -----------------------------------------------------------------

class Gated:
    """A replica's Generate: its first `free` messages at once, the rest once `gate` is set;
    CANCELLED (the call cancelled) while it waits."""

    def __init__(self, msgs, gate: threading.Event, free: int = 0) -> None:
        self.msgs, self.gate, self.free = msgs, gate, free
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        self.gate.set()
        return True

    def __iter__(self):
        for i, msg in enumerate(self.msgs):
            if i >= self.free:
                self.gate.wait(10)
            if self.cancelled.is_set():
                raise RpcError(grpc.StatusCode.CANCELLED)
            yield msg


def token(t: int) -> kvpool_pb2.KvGenerateResponse:
    return kvpool_pb2.KvGenerateResponse(token_ids=[t])


def last(t: int, rid: str = "A") -> kvpool_pb2.KvGenerateResponse:
    return kvpool_pb2.KvGenerateResponse(token_ids=[t], final=kvpool_pb2.KvGenerateFinal(
        finish_reason=common_pb2.FINISH_REASON_LENGTH, replica_id=rid, forward_passes=3))


def request(orch, rid: str, policy: Policy = Policy(), tenant: Tenant = TENANT,
            deadline_s: float = 30, on_cancel=lambda cb: None):
    """Request `rid`'s events (the prompt and SAMPLING every test shares), as they are read."""
    return orch.generate(
        tenant=tenant, prompt=RenderedPrompt(PROMPT, "q", "ctx"), sampling=SAMPLING,
        policy=policy, session_id="", return_token_ids=True, request_id=rid,
        deadline=time.monotonic() + deadline_s, on_cancel=on_cancel)


def run(orch, rid: str, out: dict, cancels: dict, policy: Policy = Policy(),
        tenant: Tenant = TENANT, deadline_s: float = 30) -> threading.Thread:
    """Starts request `rid` on a thread; its events (or error) land in out[rid]."""
    def go() -> None:
        try:
            out[rid] = list(request(orch, rid, policy, tenant, deadline_s,
                                    on_cancel=lambda cb: cancels.__setitem__(rid, cb)))
        except errors.TierCacheError as e:
            out[rid] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def ids_of(events) -> list[int]:
    return [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]


def coalesced() -> float:
    return sample_value("tiercache_orchestrator_coalesced_requests_total") or 0.0


def lead_and_follow(orch, sent, out: dict, cancels: dict, n: int = 1,
                    policy: Policy = Policy(), lead_policy: Policy = Policy(),
                    lead_deadline_s: float = 30) -> tuple[threading.Thread, ...]:
    """Request "lead" (with `lead_policy`, `lead_deadline_s`) running on a replica (`sent`
    true once it called one), then "f0" (to "f{n-1}", with `policy`) joined to its flight as
    followers: the threads, the leader's first."""
    lead = run(orch, "lead", out, cancels, lead_policy, deadline_s=lead_deadline_s)
    wait_until(sent, 5, "the leader never called its replica")
    before = coalesced()
    followers = [run(orch, f"f{i}", out, cancels, policy) for i in range(n)]
    wait_until(lambda: coalesced() == before + n, 5, "the followers never joined")
    return lead, *followers


class Stores(Semantic):
    """A semantic tier that keeps each Store's request; entry i's id is f"e{i}"."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: list = []

    def store(self, req, timeout=None, on_call=None):
        self.stored.append(req)
        return SimpleNamespace(id=f"e{len(self.stored)}")


def test_identical_greedy_requests_in_flight_share_one_replica_call():
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), token(105), token(33), last(10)], gate, free=1)])
    semantic = Stores()
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    threads = lead_and_follow(orch, lambda: stub.requests, out, cancels, n=3)
    gate.set()
    for t in threads:
        t.join(10)
    assert len(stub.requests) == 1  # one model run for the four
    want = [104, 105, 33, 10]
    assert all(ids_of(out[r]) == want for r in out), out
    assert "".join(e.text for e in out["f0"] if isinstance(e, TextDelta)) == "hi!\n"
    lead = out["lead"][-1].report
    assert lead.route != "coalesced" and not lead.coalesced_with
    # Stored once, by the leader; each report names that entry (what Feedback rates).
    assert len(semantic.stored) == 1 and lead.semantic_entry_id == "e1"
    for r in ("f0", "f1", "f2"):
        fin = out[r][-1]
        assert isinstance(fin, Finished) and fin.finish_reason == common_pb2.FINISH_REASON_LENGTH
        rep = fin.report
        assert (rep.route, rep.coalesced_with, rep.replica_id) == ("coalesced", "lead", "A")
        assert rep.prompt_tokens == rep.cached_tokens == len(PROMPT)
        assert rep.forward_passes == 0 and rep.semantic_entry_id == "e1"
    assert orch.stats.requests["coalesced"] == 3
    assert len(orch.flights) == 0


def test_a_leader_whose_client_goes_leaves_its_followers_to_resume_exactly():
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), token(105), token(33), last(10)], gate, free=2),
                      Gated([token(33), last(10)], threading.Event(), free=2)])
    orch = make({"A": stub})
    out, cancels = {}, {}
    lead, follower = lead_and_follow(orch, lambda: stub.requests, out, cancels)
    time.sleep(0.1)  # the follower has read the two tokens the leader has
    cancels["lead"]()  # the leader's client goes
    lead.join(10)
    follower.join(10)
    assert isinstance(out["lead"], errors.TierCacheError)
    assert ids_of(out["f0"]) == [104, 105, 33, 10]
    resumed = stub.requests[1]
    assert list(resumed.token_ids) == PROMPT + [104, 105]
    assert (resumed.sampling.max_tokens, resumed.seed_offset) == (2, 2)
    rep = out["f0"][-1].report
    assert (rep.route, rep.coalesced_with) == ("resume", "lead")
    assert orch.stats.requests["coalesced"] == 0
    assert len(orch.flights) == 0


WANT = [104, 105, 33, 10]


def resumes(*gates: threading.Event) -> list[Gated]:
    """A replica's Generates resuming after 104, 105: the rest, each once its gate is set."""
    return [Gated([token(33), last(10)], gate) for gate in gates]


def herd_of_three(gates: list[threading.Event], semantic: Stores, policy: Policy = Policy()):
    """A leader and three followers (with `policy`) on a replica whose first call sends two
    tokens at once (the rest never: the leader's client goes), then the resumed calls `gates`
    let finish (and spares an extra run would take)."""
    stub = Stub("A", [Gated([token(t) for t in WANT[:-1]] + [last(10)], threading.Event(),
                            free=2), *resumes(*gates), *resumes(*[threading.Event()] * 4)])
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    threads = lead_and_follow(orch, lambda: stub.requests, out, cancels, 3, policy)
    time.sleep(0.1)  # the followers have read the two tokens the leader has
    cancels["lead"]()
    wait_until(lambda: len(stub.requests) >= 2, 5, "no follower went on")
    return stub, orch, out, cancels, list(threads)


def test_a_leader_gone_unfinished_leaves_its_followers_one_resumed_run():
    # Each follower went on by itself from the tokens read: a herd whose first client went
    # ran the model once more per follower (here 3 resumed calls, not 1).
    gate, semantic = threading.Event(), Stores()
    stub, orch, out, cancels, threads = herd_of_three([gate], semantic)
    resumer = stub.requests[1].request_id
    # One arriving now joins the flight that took over: the whole answer, from token 0.
    before = coalesced()
    threads.append(run(orch, "late", out, cancels))
    wait_until(lambda: coalesced() == before + 1, 5, "the late one never joined")
    gate.set()
    for t in threads:
        t.join(10)
    assert len(stub.requests) == 2  # one model run more for the four
    assert list(stub.requests[1].token_ids) == PROMPT + [104, 105]
    assert isinstance(out["lead"], errors.Cancelled)
    others = {"f0", "f1", "f2", "late"} - {resumer}
    assert resumer in ("f0", "f1", "f2") and len(others) == 3
    assert all(ids_of(out[r]) == WANT for r in others | {resumer}), out
    rep = out[resumer][-1].report
    assert (rep.route, rep.coalesced_with, rep.semantic_entry_id) == ("resume", "lead", "e1")
    for r in others:
        rep = out[r][-1].report
        assert (rep.route, rep.coalesced_with, rep.replica_id) == ("coalesced", resumer, "A")
        # The entry the one that took over stored the answer as (for Feedback).
        assert rep.cached_tokens == len(PROMPT) and rep.semantic_entry_id == "e1"
    assert len(semantic.stored) == 1  # the one that ran the model stores the answer
    assert orch.stats.requests["coalesced"] == 3 and sum(orch.stats.requests.values()) == 4
    assert len(orch.flights) == 0


def test_a_taken_over_flights_leader_gone_too_leaves_the_others_one_run_more():
    gates, semantic = [threading.Event(), threading.Event()], Stores()
    stub, orch, out, cancels, threads = herd_of_three(gates, semantic)
    first = stub.requests[1].request_id
    cancels[first]()  # the one that took over goes too, before any token of its own
    wait_until(lambda: len(stub.requests) >= 3, 5, "no other follower went on")
    second = stub.requests[2].request_id
    gates[1].set()
    for t in threads:
        t.join(10)
    assert len(stub.requests) == 3  # one run more each time
    assert list(stub.requests[2].token_ids) == PROMPT + [104, 105]
    assert isinstance(out[first], errors.Cancelled)
    (last_one,) = {"f0", "f1", "f2"} - {first, second}
    assert ids_of(out[second]) == ids_of(out[last_one]) == WANT
    # The second read no token from the first's flight: its tokens are the leader's.
    rep = out[second][-1].report
    assert (rep.route, rep.coalesced_with) == ("resume", "lead")
    rep = out[last_one][-1].report
    assert (rep.route, rep.coalesced_with, rep.replica_id) == ("coalesced", second, "A")
    assert out[second][-1].report.semantic_entry_id == rep.semantic_entry_id == "e1"
    assert len(semantic.stored) == 1
    assert orch.stats.requests["coalesced"] == 1 and sum(orch.stats.requests.values()) == 2
    assert len(orch.flights) == 0


def test_one_taking_over_that_may_not_store_leaves_it_to_its_first_follower_that_may():
    # The taker asked not to store (skip_semantic_store), two requests joining its flight may:
    # stored by none before (no follower of a taken-over flight stored), their reports empty.
    gate, semantic = threading.Event(), Stores()
    stub = Stub("A", [Gated([token(t) for t in WANT[:-1]] + [last(10)], threading.Event(),
                            free=2), *resumes(gate)])
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    threads = list(lead_and_follow(orch, lambda: stub.requests, out, cancels, 1,
                                   Policy(skip_semantic_store=True)))
    time.sleep(0.1)  # f0 has read the two tokens the leader has
    cancels["lead"]()
    wait_until(lambda: len(stub.requests) >= 2, 5, "f0 never went on")
    before = coalesced()
    threads += [run(orch, rid, out, cancels) for rid in ("late0", "late1")]
    wait_until(lambda: coalesced() == before + 2, 5, "the late ones never joined")
    gate.set()
    for t in threads:
        t.join(10)
    assert len(stub.requests) == 2 and stub.requests[1].request_id == "f0"
    assert [(r.answer, r.truncated_at) for r in semantic.stored] == [("hi!\n", 4)]
    reps = {r: out[r][-1].report for r in ("f0", "late0", "late1")}
    assert all(ids_of(out[r]) == WANT for r in reps)
    # f0 names none (it asked not to store, as a leader that skips it); the first of the
    # late ones stored it, the other names its entry.
    assert {r: (rep.route, rep.coalesced_with, rep.semantic_entry_id)
            for r, rep in reps.items()} == {"f0": ("resume", "lead", ""),
                                            "late0": ("coalesced", "f0", "e1"),
                                            "late1": ("coalesced", "f0", "e1")}
    assert orch.stats.requests["coalesced"] == 2 and sum(orch.stats.requests.values()) == 3
    assert len(orch.flights) == 0


def test_followers_of_a_leader_gone_after_the_answers_last_token_store_it_once():
    # Each follower ended with the tokens read and stored the answer: 3 Stores of one answer.
    gate, semantic = threading.Event(), Stores()
    stub = Stub("A", [Gated([*map(token, WANT), final("A", 0)], gate, free=len(WANT)),
                      *resumes(*[threading.Event()] * 3)])
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    threads = lead_and_follow(orch, lambda: stub.requests, out, cancels, 3)
    time.sleep(0.1)  # the followers have read the whole answer
    cancels["lead"]()
    for t in threads:
        t.join(10)
    assert len(stub.requests) == 1 and len(semantic.stored) == 1
    reps = [out[f"f{i}"][-1].report for i in range(3)]
    assert all(ids_of(out[f"f{i}"]) == WANT for i in range(3))
    assert all((r.route, r.coalesced_with) == ("coalesced", "lead") for r in reps)
    # The one that took over stored it; the others name its entry.
    assert [r.semantic_entry_id for r in reps] == ["e1"] * 3
    assert orch.stats.requests["coalesced"] == 3 and len(orch.flights) == 0


def test_a_followers_deadline_or_cancel_ends_it_and_not_the_leader():
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), last(10)], gate, free=1)])
    orch = make({"A": stub})
    out, cancels = {}, {}
    lead, follower = lead_and_follow(orch, lambda: stub.requests, out, cancels)
    cancels["f0"]()
    follower.join(5)
    assert not follower.is_alive() and isinstance(out["f0"], errors.Cancelled)
    # Another, past its deadline while it waits: DEADLINE_EXCEEDED, as from a replica.
    with pytest.raises(errors.DeadlineExceeded):
        list(request(orch, "late", deadline_s=0.3))
    gate.set()
    lead.join(10)
    assert ids_of(out["lead"]) == [104, 10]
    assert len(stub.requests) == 1 and len(orch.flights) == 0


def test_requests_with_a_cache_turned_off_or_coalescing_off_run_the_model_themselves():
    for policy, on in ((Policy(skip_prefix_cache=True), True),
                       (Policy(skip_semantic_lookup=True), True), (Policy(), False)):
        both_ran(policy, on)


def test_two_tenants_with_one_salt_never_share_a_flight():
    both_ran(Policy(), True, Tenant("b", TENANT.cache_salt, 10_000, 1_000, 4))


def both_ran(policy: Policy, on: bool, other: Tenant = TENANT) -> None:
    """Two identical requests in flight together (the second from tenant `other`), each its
    own replica call."""
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), last(10)], gate), Gated([token(104), last(10)], gate)])
    orch = make({"A": stub})
    orch.coalesce = on
    out, cancels = {}, {}
    threads = [run(orch, "lead", out, cancels, policy)]
    wait_until(lambda: stub.requests, 5, "the first never called its replica")
    threads.append(run(orch, "other", out, cancels, policy, other))
    wait_until(lambda: len(stub.requests) == 2, 5, f"{policy}, on={on}: one model run")
    gate.set()
    for t in threads:
        t.join(10)
    assert ids_of(out["other"]) == [104, 10] and not out["other"][-1].report.coalesced_with


class FailsAt:
    """A replica's Generate that fails with `err` once `gate` is set, before any token."""

    def __init__(self, gate: threading.Event, err: grpc.RpcError) -> None:
        self.gate, self.err = gate, err

    def cancel(self) -> bool:
        self.gate.set()
        return True

    def __iter__(self):
        self.gate.wait(10)
        raise self.err
        yield  # pragma: no cover


def test_a_leader_failing_before_any_token_leaves_its_follower_to_run_on_its_own():
    gate = threading.Event()
    # INTERNAL: the leader's one attempt fails, and the replica is not marked down for it.
    stub = Stub("A", [FailsAt(gate, RpcError(grpc.StatusCode.INTERNAL)),
                      Gated([token(104), last(10)], threading.Event(), free=2)])
    orch = make({"A": stub}, max_attempts=1)
    out, cancels = {}, {}
    lead, follower = lead_and_follow(orch, lambda: stub.requests, out, cancels)
    gate.set()
    lead.join(10)
    assert isinstance(out["lead"], errors.TierCacheError)
    wait_until(lambda: not follower.is_alive(), 10, "the follower never ended")
    assert ids_of(out["f0"]) == [104, 10]
    assert list(stub.requests[1].token_ids) == PROMPT  # from scratch: it had no token
    rep = out["f0"][-1].report
    assert rep.route not in ("resume", "coalesced") and not rep.coalesced_with
    assert len(orch.flights) == 0


@pytest.mark.parametrize("tokens, reason", [
    ([104, 0], common_pb2.FINISH_REASON_EOS),  # the end of sequence, max_tokens left
    ([104, 105, 33, 10], common_pb2.FINISH_REASON_LENGTH)])  # max_tokens reached
def test_a_leader_gone_after_the_answers_last_token_leaves_its_follower_the_whole_answer(
        tokens, reason):
    # The leader read the whole answer, then its client went before the final message: a
    # resume generated on past the end of sequence (or asked the replica for 0 tokens).
    gate = threading.Event()
    stub = Stub("A", [Gated([*map(token, tokens), final("A", 0)], gate, free=len(tokens)),
                      Gated([token(33), last(10)], threading.Event(), free=2)])
    semantic = Stores()
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    lead, follower, second = lead_and_follow(orch, lambda: stub.requests, out, cancels, n=2)
    time.sleep(0.1)  # the followers have read the whole answer
    cancels["lead"]()
    for t in (lead, follower, second):
        t.join(10)
    assert ids_of(out["f0"]) == ids_of(out["f1"]) == tokens
    assert len(stub.requests) == 1  # no resume
    for fin in (out["f0"][-1], out["f1"][-1]):
        assert fin.finish_reason == reason
        # The replica whose tokens they are (its public id: its final message never came).
        assert (fin.report.route, fin.report.coalesced_with, fin.report.replica_id) == (
            "coalesced", "lead", orch.replicas.replicas[0].public_id)
        # Stored by a follower, once: its leader, gone, stored nothing (the next identical
        # request went to the model again), and each follower stored it again.
        assert fin.report.semantic_entry_id == "e1"
    assert len(semantic.stored) == 1
    assert orch.stats.requests["coalesced"] == 2 and len(orch.flights) == 0


class CutAfter(Gated):
    """A replica's Generate: its messages, then UNAVAILABLE (the replica lost) once `gate` is
    set."""

    def __iter__(self):
        yield from self.msgs
        self.gate.wait(10)
        raise RpcError(grpc.StatusCode.UNAVAILABLE)


def test_a_leaders_failover_mid_stream_is_one_uninterrupted_stream_for_its_followers():
    # "€" is E2 82 AC: the failover splits it, the follower's text still whole.
    gate = threading.Event()
    calls = [CutAfter([token(0xE2), token(0x82)], gate),
             Gated([token(0xAC), last(10, "R2")], threading.Event(), free=2)]
    stubs = {"A": Stub("A", []), "B": Stub("B", [])}
    for stub in stubs.values():
        stub.calls = calls  # whichever the leader is routed to first, the other resumes
    orch = make(stubs)
    out, cancels = {}, {}
    sent = lambda: [r for s in stubs.values() for r in s.requests]  # noqa: E731
    lead, follower = lead_and_follow(orch, sent, out, cancels)
    gate.set()
    lead.join(10)
    follower.join(10)
    want = [0xE2, 0x82, 0xAC, 10]
    assert ids_of(out["lead"]) == ids_of(out["f0"]) == want
    assert "".join(e.text for e in out["f0"] if isinstance(e, TextDelta)) == "€\n"
    assert len(sent()) == 2 and list(sent()[1].token_ids) == PROMPT + [0xE2, 0x82]
    rep = out["f0"][-1].report
    assert (rep.route, rep.coalesced_with, rep.replica_id) == ("coalesced", "lead", "R2")
    assert out["lead"][-1].report.route == "resume" and len(orch.flights) == 0


class HungStore(Semantic):
    """A semantic tier whose Store hangs until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.storing = threading.Event(), threading.Event()

    def store(self, req, timeout=None, on_call=None):
        self.storing.set()
        self.release.wait(10)
        return super().store(req, timeout, on_call)


def test_a_leaders_hung_store_holds_no_follower_back():
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), last(10)], gate)])
    semantic = HungStore()
    # A follower waits for its leader's Store at most as long as a Store of its own could
    # take: then it is answered without the entry's id.
    semantic.timeout_s = 0.3
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    lead, follower = lead_and_follow(orch, lambda: stub.requests, out, cancels)
    gate.set()
    assert semantic.storing.wait(5)
    follower.join(5)
    assert not follower.is_alive() and ids_of(out["f0"]) == [104, 10]
    assert not out["f0"][-1].report.semantic_entry_id
    # Still storing: one arriving now has the whole answer at once, no replica call.
    late = run(orch, "late", out, cancels)
    late.join(5)
    assert ids_of(out["late"]) == [104, 10] and len(stub.requests) == 1
    assert lead.is_alive()
    semantic.release.set()
    lead.join(10)
    assert ids_of(out["lead"]) == [104, 10] and out["lead"][-1].report.semantic_entry_id
    assert len(orch.flights) == 0


def test_a_follower_waits_for_its_leaders_store_until_it_ends_or_its_client_goes():
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), last(10)], gate)])
    semantic = HungStore()
    semantic.timeout_s = 20  # a follower waits up to half its deadline's 30 s
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    lead, follower, second = lead_and_follow(orch, lambda: stub.requests, out, cancels, n=2)
    gate.set()
    assert semantic.storing.wait(5)
    time.sleep(0.2)  # the followers have the answer, and wait for the leader's Store
    assert follower.is_alive() and second.is_alive()
    cancels["f0"]()
    follower.join(2)
    assert not follower.is_alive() and isinstance(out["f0"], errors.Cancelled)
    semantic.release.set()
    for t in (lead, second):
        t.join(10)
    assert out["lead"][-1].report.semantic_entry_id == "e1"
    assert ids_of(out["f1"]) == [104, 10] and out["f1"][-1].report.semantic_entry_id == "e1"
    assert len(orch.flights) == 0


def test_a_leader_that_skips_the_store_leaves_it_to_its_first_follower_that_may():
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), token(105), token(33), last(10)], gate, free=1)])
    semantic = Stores()
    orch = make({"A": stub}, semantic=semantic)
    out, cancels = {}, {}
    threads = lead_and_follow(orch, lambda: stub.requests, out, cancels, n=3,
                              lead_policy=Policy(skip_semantic_store=True))
    gate.set()
    for t in threads:
        t.join(10)
    assert len(stub.requests) == 1
    # One Store of the whole answer (cut short at max_tokens), by one follower; each
    # follower's report names it, the leader's (which asked not to store) none.
    assert [(r.answer, r.truncated_at) for r in semantic.stored] == [("hi!\n", 4)]
    assert not out["lead"][-1].report.semantic_entry_id
    assert [out[f"f{i}"][-1].report.semantic_entry_id for i in range(3)] == ["e1"] * 3
    assert len(orch.flights) == 0


def test_a_leaders_client_reading_slowly_holds_no_follower_back():
    gate = threading.Event()
    stub = Stub("A", [Gated([token(104), token(105), token(33), last(10)], gate, free=1)])
    orch = make({"A": stub})
    leader = request(orch, "lead")
    assert next(leader).token_ids == [104]  # then its client reads no more
    out, cancels = {}, {}
    before = coalesced()
    follower = run(orch, "f0", out, cancels)
    wait_until(lambda: coalesced() == before + 1, 5, "the follower never joined")
    gate.set()
    follower.join(5)
    assert not follower.is_alive() and ids_of(out["f0"]) == [104, 105, 33, 10]
    assert out["f0"][-1].report.route == "coalesced"
    assert len(orch.flights) == 0  # closed with the leader's replica side, not its client
    assert ids_of(leader) == [105, 33, 10]
