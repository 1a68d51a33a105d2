"""Request coalescing under races (services/orchestrator/coalesce.py), through the real
pipeline with fake replicas: requests arriving, ending and taking over in the orders that
only threads racing give, each pinned by a hook that holds one step back until the others
have happened."""

from __future__ import annotations

import threading
import time

from services.common import errors
from tests.orchestrator.test_coalesce import (
    WANT,
    Gated,
    coalesced,
    ids_of,
    last,
    lead_and_follow,
    run,
    token,
)
from tests.orchestrator.test_pipeline_paths import PROMPT, Stub, make
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
