"""Request coalescing: identical greedy requests in flight together share one model run.

A thundering herd (N identical requests before the answer is cached) ran the model N times
for one answer (docs/capacity.md: 16 requests took 12.3 s of wall time where one takes ~4.1
s). The first request with a key, its semantic lookup missed, leads: it runs as ever and
publishes into its `Flight` each batch of token ids as read from its replica, then its end.
A later request with the same key while the flight is open follows: it calls no replica, its
tokens are the flight's (the backlog at once, then live). Greedy tokens are decided by the key
alone (`flight_key`), so a follower's answer is the one a run of its own would give. A leader
that ends without finishing (its client gone, an error) leaves its followers the tokens so far;
the first of them to go on leads the flight that takes over (`Flights.take_over`: it starts
with those tokens and resumes from them, a failover's resume), the others follow it, and so
on while a leader ends unfinished: one model run at a time for the herd, not one each.

The answer is stored in the semantic tier once, by its flight's storer: the leader, claimed as
it finishes where it may store (not with skip_semantic_store), else the first follower that
may (`claim_store`); the others' reports name the entry it was stored as (`stored_as`), for
Feedback, where its Store ends while they may still wait for it. A flight taken over is a new
flight (its own storer: its leader, the one that took over, where it may store); one taken
over with tokens already whole is finished at once, its leader's claim made with it."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import NamedTuple


def flight_key(tenant_name: str, cache_salt: str, model_id: str, token_ids, sampling
               ) -> Hashable:
    """What decides a greedy answer's tokens: the tenant (name and salt: tenants never share
    an answer), the model, the whole prompt, max_tokens, the stop ids (a set: their order or
    one given twice changes nothing) and ignore_eos. Not the seed or top_p (greedy is the
    argmax: the semantic tier serves a greedy answer whatever they are, too), drafts or
    return_token_ids: they change no token."""
    return (tenant_name, cache_salt, model_id, tuple(token_ids), sampling.max_tokens,
            frozenset(sampling.stop_token_ids), sampling.ignore_eos)


def may_coalesce(enabled: bool, greedy: bool, skip_semantic_lookup: bool,
                 skip_prefix_cache: bool) -> bool:
    """Whether a request may lead or follow a flight: greedy (a sample is its own draw), and
    with its caches on (a request that turned them off asked to be computed from scratch: the
    benchmarks' "caches off" baseline must stay one)."""
    return enabled and greedy and not skip_semantic_lookup and not skip_prefix_cache


class Read(NamedTuple):
    """What a follower reads from a flight: tokens past what it has (`ids`), or none and the
    flight's end: `final` (the leader's final message) when it finished, `ended` when it ended
    either way. Nothing at all: the wait ran out (its deadline) or it was woken to stop."""

    ids: list[int]
    ended: bool
    final: object | None


class Flight:
    """One leader's model run as its followers read it. Thread-safe."""

    def __init__(self, key: Hashable, leader_id: str, ids: list[int] | tuple = (),
                 replica_id: str = "") -> None:
        """`ids`: the tokens it starts with (those of the flight it takes over, from
        `replica_id`), for a request joining it to read from token 0."""
        self.key, self.leader_id = key, leader_id
        # The request whose model run gave the answer (a follower's coalesced_with): its
        # leader, or, taken over with the tokens already whole, that of the flight taken over.
        self.ran_by = leader_id
        self.replica_id = replica_id  # the replica whose tokens end the answer (with the final)
        # The flight that took over from this one, ended unfinished (`Flights.take_over`).
        self.successor: Flight | None = None
        self._cond = threading.Condition()
        self._ids: list[int] = list(ids)
        self._final = None
        self._ended = False
        self._storer = ""  # the request that stores the answer ("" = none yet)
        # Its leader is (claimed as it finished): not `_storer == leader_id`, as a client's
        # x-request-id may be two requests' (a follower's claim read as the leader's).
        self._leader_stores = False
        self._entry: str | None = None  # what its Store gave ("" = not stored), once it ended

    def publish(self, ids: list[int], replica_id: str = "") -> None:
        """A batch of token ids, as the leader read it from its replica (`replica_id`: named
        by a follower whose answer they make whole, the leader gone before its final)."""
        with self._cond:
            self._ids.extend(ids)
            self.replica_id = replica_id or self.replica_id
            self._cond.notify_all()

    def finish(self, final, replica_id: str, stores: bool = False) -> None:
        """The leader's answer is whole: its final message, and the replica that ended it;
        `stores`: the leader stores it (claimed before any follower reads the final)."""
        with self._cond:
            self._final, self.replica_id = final, replica_id
            if stores and not self._storer:
                self._storer, self._leader_stores = self.leader_id, True
            self._cond.notify_all()

    def end(self) -> None:
        """The leader's replica side ended, finished (`finish` before) or not; a Store it
        claimed has ended too (its outcome given, or never to come: "")."""
        with self._cond:
            self._ended = True
            if self._leader_stores and self._entry is None:
                self._entry = ""
            self._cond.notify_all()

    def claim_store(self, request_id: str) -> bool:
        """Whether request `request_id` is to store the answer: none claimed it before."""
        with self._cond:
            if self._storer:
                return False
            self._storer = request_id
            return True

    def stored(self, request_id: str, entry_id: str) -> None:
        """The Store of request `request_id` ended: `entry_id` ("" = not stored). Nothing
        where that request is not the flight's storer."""
        with self._cond:
            if self._storer == request_id:
                self._entry = entry_id
                self._cond.notify_all()

    def stored_as(self, deadline: float, stop: threading.Event) -> str:
        """The entry id the answer was stored as; "" where none stores it, its Store stored
        nothing, or it had not ended by `deadline` (time.monotonic) or `stop` (set, then
        `wake`)."""
        with self._cond:
            while self._storer and self._entry is None:
                left = deadline - time.monotonic()
                if left <= 0 or stop.is_set():
                    return ""
                self._cond.wait(left)
            return self._entry or ""

    def wake(self) -> None:
        """Wakes the followers waiting (one of them is to stop: its client has gone)."""
        with self._cond:
            self._cond.notify_all()

    def tokens(self) -> list[int]:
        """Every token id published so far."""
        with self._cond:
            return list(self._ids)

    def read(self, have: int, deadline: float, stop: threading.Event) -> Read:
        """The tokens past the first `have` (at once when there are), else the flight's end;
        waits until one of them, `deadline` (time.monotonic) or `stop` (set, then `wake`)."""
        with self._cond:
            while True:
                if len(self._ids) > have:
                    return Read(self._ids[have:], False, None)
                if self._ended or self._final is not None:
                    return Read([], True, self._final)
                left = deadline - time.monotonic()
                if left <= 0 or stop.is_set():
                    return Read([], False, None)
                self._cond.wait(left)


class Waker:
    """Stands for a follower's "call" in its request's `current`: cancelling the request wakes
    its wait on the flight (see `Flight.read`)."""

    def __init__(self, flight: Flight) -> None:
        self._flight = flight

    def cancel(self) -> bool:
        self._flight.wake()
        return True


class Flights:
    """The open flights by key. Thread-safe: `join` makes a request the leader of a new flight
    or a follower of the open one; `take_over` does so for a follower of a flight ended
    unfinished; `end` closes the leader's, once, whatever way it ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Hashable, Flight] = {}

    def join(self, key: Hashable, request_id: str) -> tuple[Flight, bool]:
        """(the flight, whether this request leads it)."""
        with self._lock:
            return self._join(key, request_id)

    def take_over(self, gone: Flight, request_id: str, final=None, stores: bool = False,
                  ids: list[int] | None = None) -> tuple[Flight, bool]:
        """(the flight that goes on from `gone`, ended unfinished, for its followers; whether
        this request, one of them, leads it). The first to ask leads a new flight that starts
        with `gone`'s tokens (an identical request's flight opened since is followed instead);
        the others follow that one, even once it has ended (then, ended unfinished, they take
        over from it in turn): every follower of `gone` goes the same way, so each step runs
        the model once for them all, however late one of them asks. `final`: the tokens read
        are already whole (a final made for them): the new flight, led by the first to ask
        whatever else is open, is finished with it at once, its leader's claim to the Store
        made with it where `stores` (before another follower of `gone` can see the flight).
        `ids`: the tokens this request has read (its flight starts with them: it goes on from
        them), more than `gone`'s where `gone` is an identical request's flight from scratch
        that it followed on taking over from one further on; default `gone`'s."""
        ids = gone.tokens() if ids is None else ids
        with self._lock:
            if gone.successor is not None:
                return gone.successor, False
            if final is None:
                gone.successor, leads = self._join(gone.key, request_id, ids, gone.replica_id)
                return gone.successor, leads
            flight = gone.successor = Flight(gone.key, request_id, ids, gone.replica_id)
            flight.ran_by = gone.ran_by
            flight.finish(final, gone.replica_id, stores)
            self._open.setdefault(gone.key, flight)  # joined until it ends, if none is open
            return flight, True

    def _join(self, key: Hashable, request_id: str, ids: list[int] | tuple = (),
              replica_id: str = "") -> tuple[Flight, bool]:
        flight = self._open.get(key)
        if flight is not None:
            return flight, False
        flight = self._open[key] = Flight(key, request_id, ids, replica_id)
        return flight, True

    def end(self, flight: Flight) -> None:
        """The leader's run ended: followers are told, and no request joins it any more."""
        with self._lock:
            if self._open.get(flight.key) is flight:
                del self._open[flight.key]
        flight.end()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
