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
may (`settle`); the others' reports name the entry it was stored as (`settle`), for Feedback,
where its Store ends while they may still wait for it. A storer whose Store is not made (its
client went during it, it had no time left for one, or it timed out under the storer's own
bound) passes it on (`stored` with None): the next follower that may store and is still there
claims it (the followers that may store are known from their joining, `Flights.join`, a
flight taking over knowing those of the one it takes over from, until they leave), so the
answer is stored once in all (a Store that timed out may still have landed: the tier writes
nothing for a second Store of the answer its prompt's entry holds, and names that entry), and
one that may not store waits while such a follower may still claim it. A flight taken over is
a new flight (its own storer: its leader, the one that took over, where it may store); one
taken over with tokens already whole is finished at once, its leader's claim made with it."""

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
                 replica_id: str = "", *, leader: Hashable) -> None:
        """`ids`: the tokens it starts with (those of the flight it takes over, from
        `replica_id`), for a request joining it to read from token 0. `leader`: the leader as
        a member of the flight (its storer, `finish`; `Flights.join`): a client's
        x-request-id may be two requests' (the pipeline gives each request a token of its
        own), the members' tokens are told apart where their ids are not."""
        self.key, self.leader_id, self._leader = key, leader_id, leader
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
        self._storer: Hashable = None  # the member storing the answer (None = none now)
        # The followers that may store the answer and are still there, not yet settled: one
        # of them claims the Store while none holds it (a storer's not made passes it on).
        self._standby: set = set()
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
            if stores and self._storer is None:
                self._storer = self._leader
            self._cond.notify_all()

    def end(self) -> None:
        """The leader's replica side ended, finished (`finish` before) or not; a Store it
        claimed and never made is passed on (`stored`)."""
        with self._cond:
            self._ended = True
            if self._storer == self._leader and self._entry is None:
                self._storer = None
            self._cond.notify_all()

    def add_follower(self, member: Hashable, may_store: bool) -> None:
        """`member` follows the flight; `may_store`: one that may store the answer, its claim
        to come (`settle`) until it leaves (`leave`)."""
        if may_store:
            with self._cond:
                self._standby.add(member)

    def leave(self, member: Hashable) -> None:
        """`member` is gone from the flight (its client, its deadline, its end): it claims no
        Store, and none waits for it to; nor in the flights that took over from this one (it
        was to follow them, `hand_on`)."""
        with self._cond:
            self._leave(member)
            successor = self.successor
        if successor is not None:
            successor.leave(member)

    def hand_on(self, successor: Flight, taker: Hashable) -> None:
        """`successor` takes over from this flight (`Flights.take_over`), `taker` its first to
        ask: this flight's followers that may store, still there, are that flight's from now
        (each follows it as it goes on), not only once each asks."""
        with self._cond, successor._cond:  # one leaving meanwhile leaves both (`leave`)
            self.successor = successor
            successor._standby |= self._standby - {taker}

    def _leave(self, member: Hashable) -> None:
        if member in self._standby:
            self._standby.discard(member)
            self._cond.notify_all()

    def stored(self, member: Hashable, entry_id: str | None) -> None:
        """The Store of `member` ended: `entry_id` ("" = not stored), or None where it was not
        made (its client went during it, it had no time left for one, or it timed out under
        its own bound): passed on, to a follower that may store and is still there
        (`settle`). Nothing where `member` is not the flight's storer (its Store passed on
        already)."""
        with self._cond:
            if self._storer != member or self._entry is not None:
                return
            if entry_id is None:
                self._storer = None
            else:
                self._entry = entry_id
            self._cond.notify_all()

    def settle(self, member: Hashable, stores: bool, deadline: float,
               stop: threading.Event) -> str | None:
        """The entry id the answer was stored as, or None: `member` is to store it (`stores`:
        it may, with time for it; claimed where none holds the claim, the first Store passed
        on included). "" where none stores it (none holds the claim, and no follower that may
        store is still there to), its Store stored nothing, or neither came by `deadline`
        (time.monotonic) or `stop` (set, then `wake`). `member` leaves the flight's followers
        that may store, as it returns (or at once: not `stores`)."""
        with self._cond:
            if not stores:
                self._leave(member)
            try:
                return self._settled(member, stores, deadline, stop)
            finally:
                self._leave(member)

    def _settled(self, member: Hashable, stores: bool, deadline: float,
                 stop: threading.Event) -> str | None:
        while self._entry is None:
            left = deadline - time.monotonic()
            if left <= 0 or stop.is_set():
                return ""
            if self._storer is None:
                if stores:
                    self._storer = member
                    return None
                if not self._standby:
                    return ""  # none holds the claim, and none left may take it
            self._cond.wait(left)
        return self._entry

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

    def join(self, key: Hashable, request_id: str, member: Hashable = None,
             may_store: bool = False) -> tuple[Flight, bool]:
        """(the flight, whether this request leads it). `member`: the request's token in the
        flight (default `request_id`); `may_store`: it may store the answer (a follower that
        may is waited for, `Flight.settle`)."""
        with self._lock:
            return self._join(key, request_id, _member(member, request_id), may_store)

    def take_over(self, gone: Flight, request_id: str, final=None, stores: bool = False,
                  ids: list[int] | None = None, member: Hashable = None
                  ) -> tuple[Flight, bool]:
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
        that it followed on taking over from one further on; default `gone`'s. `member`, and
        `stores` for a follower of the flight returned: as `join`'s `member` and `may_store`."""
        ids = gone.tokens() if ids is None else ids
        member = _member(member, request_id)
        with self._lock:
            if gone.successor is not None:
                gone.successor.add_follower(member, stores)
                return gone.successor, False
            if final is None:
                flight, leads = self._join(gone.key, request_id, member, stores, ids,
                                           gone.replica_id)
            else:
                flight = Flight(gone.key, request_id, ids, gone.replica_id, leader=member)
                leads = True
                flight.ran_by = gone.ran_by
                flight.finish(final, gone.replica_id, stores)
                self._open.setdefault(gone.key, flight)  # joined until it ends, if none is open
            gone.hand_on(flight, member)
            return flight, leads

    def _join(self, key: Hashable, request_id: str, member: Hashable, may_store: bool,
              ids: list[int] | tuple = (), replica_id: str = "") -> tuple[Flight, bool]:
        flight = self._open.get(key)
        if flight is not None:
            flight.add_follower(member, may_store)
            return flight, False
        flight = self._open[key] = Flight(key, request_id, ids, replica_id, leader=member)
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


def _member(member: Hashable, request_id: str) -> Hashable:
    """A request's token in a flight: `member`, default its id."""
    return request_id if member is None else member
