"""Client of the prefix index, sharded or not: `PrefixIndexClient(["host:port", ...])`.

One address = one index. N addresses = N independent shard processes; the client routes:

    Match(token_ids | block_hashes)  -> the shard owning the request's first block hash
    TopPrefixes, Stats               -> every shard, merged (hottest first / summed)
    Register, Heartbeat              -> every shard (each keeps its own lease and seq)
    PublishEvents  stored            -> the shard owning the chain's first_block_hash
                   removed, cleared  -> every shard (a shard ignores blocks it does not know)

so all continuations of one system prompt live on one shard. Shards are placed on a
consistent-hash ring (`services.common.ring`), so adding a shard moves ~1/N of the chains, by
their canonical address (`services.common.addresses`): kvpool and the orchestrator each build
the ring from their own list, and two spellings of one shard must place alike. A list that
really differs (a shard missing on one side) still splits chains from their lookups, so
Register and Match carry the list's size and fingerprint, and a shard whose replicas
registered with another list than a Match's says so in its Stats.

Batch sequence numbers are per shard and kept here: callers publish events and get back
whether some shard asked for a resync (then send the full holdings with `resync=True`).
Every call has a deadline; a failed call raises `PrefixIndexError`, a `grpc.RpcError` that
names the method and shard, so code that already catches RpcError keeps working.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import grpc
from tiercache.v1 import common_pb2, prefix_pb2, prefix_pb2_grpc

from services.common.addresses import ShardRing, shard_fingerprint
from services.common.bootstrap import DEFAULT_MAX_MESSAGE_BYTES
from services.common.grpc_client import (
    call_metadata,
    health_error,
    make_channel,
    tells_of_health,
    timeout_or,
    unary_call,
)
from services.common.hashing import BlockHasher
from services.common.shard_list import merged_note

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
# A stored block's bytes in a PublishEvents message besides its token ids, at most: its 16-byte
# hash, and an event of its own (a parent hash, a short salt), tags and lengths; and what is
# kept of a message for everything else in it (up to 512 events' salts of 256 characters).
BLOCK_FRAMING = 48
BATCH_HEADROOM = 1 << 20


def batch_blocks(block_size: int, max_blocks: int) -> int:
    """`max_blocks`, lowered to what one PublishEvents message can carry, a block being its
    token ids (5 bytes each at most) and `BLOCK_FRAMING`. At the default 65,536 blocks of 16
    tokens a full batch is at most ~10 MB; of 1,024 tokens it was ~340 MB, and the replicas,
    filling batches to the limit Register gave them, sent batches no server takes
    (RESOURCE_EXHAUSTED naming no field, retried for ever). The index lowers what it
    advertises with it, and a replica what it sends (an older index advertises the default)."""
    per_block = 5 * block_size + BLOCK_FRAMING
    return max(1, min(max_blocks, (DEFAULT_MAX_MESSAGE_BYTES - BATCH_HEADROOM) // per_block))


class PrefixIndexError(grpc.RpcError):
    """A call to one index shard failed; `code()`/`details()` as on any RpcError."""

    def __init__(self, method: str, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"prefix index {address} {method}: {code.name}: {details}")
        self.method = method
        self.address = address
        self._code = code
        self._details = details
        # When a call to several shards raised: each failed shard's error (every shard's
        # when all of them failed).
        self.shards_failed: dict[str, PrefixIndexError] = {address: self}

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    @classmethod
    def wrap(cls, method: str, address: str, exc: grpc.RpcError) -> PrefixIndexError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return cls(method, address, code or grpc.StatusCode.UNKNOWN, details or "")


# Failures that another try (or the shard coming back) can cure.
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.ABORTED})


class RegisterOutcome(NamedTuple):
    lease_seconds: float  # the shortest lease of all shards
    next_seq: dict[str, int]  # per shard address
    # The smallest batch limits of the shards that said theirs (0 = none said).
    max_events: int = 0
    max_blocks: int = 0


class PublishOutcome(NamedTuple):
    resync: bool  # some shard saw a gap: send the full holdings with resync=True
    resync_shards: list[str]
    sent: dict[str, int]  # seq used per shard that got a batch
    # Shards whose call failed while others applied theirs (their batch is lost: resync them
    # once they answer again), with the error.
    failed: dict[str, PrefixIndexError] = {}


class _Shard:
    def __init__(self, address: str, channel: grpc.Channel) -> None:
        self.address = address
        self.channel = channel
        self.stub = prefix_pb2_grpc.PrefixIndexStub(channel)


class PrefixIndexClient:
    """Routes prefix-index calls to one index or to N shards (see the module docstring).

    Args:
        addresses: shard addresses (host:port); the order does not matter.
        internal_token: credential sent as `authorization: Bearer ...`.
        timeout: default deadline of each call in seconds.
        block_size / hash_key: only used to hash the first block of a token-id Match when
            sharded (must equal the index's; the key defaults to `TIERCACHE_HASH_KEY`).
    """

    def __init__(self, addresses: Sequence[str], internal_token: str = "", *,
                 timeout: float = DEFAULT_TIMEOUT_S, block_size: int = 16,
                 hash_key: bytes | None = None,
                 channel_factory: Callable[[str], grpc.Channel] = make_channel) -> None:
        addrs = [a.strip() for a in addresses if a.strip()]
        if not addrs:
            raise ValueError("addresses: at least one prefix index address is required")
        try:
            # Placed by each address's canonical spelling, so that kvpool and the orchestrator
            # place alike however each spells a shard; dialed as given.
            self._ring = ShardRing(addrs)
        except ValueError as e:
            raise ValueError(f"addresses: duplicate shard address: {e}") from None
        self.addresses = addrs
        # Sent with Register and Match: a shard that sees its replicas' list differ from a
        # Match's says so in its Stats (chains published to one shard are looked up on
        # another). The count, so that one index named two ways is no mismatch.
        self.shard_list = common_pb2.ShardList(shards=len(addrs),
                                               fingerprint=shard_fingerprint(addrs))
        self.internal_token = internal_token
        self.timeout = timeout
        self.block_size = block_size
        self.hash_key = hash_key
        self._shards = {a: _Shard(a, channel_factory(a)) for a in addrs}
        # address -> how its last call went ("" = answered; else the transient failure).
        self.shard_errors: dict[str, str] = {}
        # Told (address, the shard's new `shard_errors` entry) after each outcome recorded
        # there: the orchestrator exports a sharded index's shards as health gauges.
        self.on_outcome: Callable[[str, str], None] | None = None
        # address -> the shard's own word on the shard lists it sees differ (its last Stats;
        # "" = none).
        self.shard_list_notes: dict[str, str] = {}
        self._hashers: dict[str, BlockHasher] = {}
        self._lock = threading.Lock()
        self._seq: dict[tuple[str, str, str], int] = {}  # (replica, incarnation, shard) -> next

    def close(self) -> None:
        for s in self._shards.values():
            s.channel.close()

    def __enter__(self) -> PrefixIndexClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def sharded(self) -> bool:
        return len(self.addresses) > 1

    # -- routing --------------------------------------------------------------------------

    def shard_for(self, first_block_hash: bytes) -> str:
        """Address of the shard that owns chains starting with `first_block_hash`."""
        if not self.sharded:
            return self.addresses[0]
        return self._ring.lookup(first_block_hash)

    def _first_hash(self, model_id: str, cache_salt: str, token_ids: Sequence[int]) -> bytes:
        h = self._hashers.get(model_id)
        if h is None:
            h = self._hashers.setdefault(model_id,
                                         BlockHasher(model_id, self.block_size, self.hash_key))
        got = h.hashes(token_ids[: self.block_size], cache_salt)
        return got[0] if got else b""

    def _call(self, address: str, method: str, request, timeout: float | None,
              on_call: Callable[[grpc.Future], None] | None = None):
        """One call of `method` on the shard at `address`. With `on_call`, the call is made as
        a future, handed to `on_call` as it starts: cancelled (its caller went away), it
        raises grpc.FutureCancelledError at once, and says nothing of the shard."""
        try:
            resp = unary_call(getattr(self._shards[address].stub, method), request, on_call,
                              timeout=timeout_or(timeout, self.timeout),
                              metadata=call_metadata(self.internal_token))
        except grpc.RpcError as e:
            err = PrefixIndexError.wrap(method, address, e)
            self._outcome(address, err, timeout)
            raise err from e
        self._outcome(address, None)
        return resp

    def _outcome(self, address: str, err: PrefixIndexError | None,
                 timeout: float | None = None) -> None:
        """Remember how `address`'s last call went (`shard_errors`): a shard's failure hidden
        by a partial answer must still show in Stats. Not a caller's bad request, nor a
        deadline its own shorter timeout ran into (as for the tier's health)."""
        if err is None:
            said = ""
        else:
            if not tells_of_health(err, timeout, self.timeout):
                return
            # A timeout said as how long the shard did not answer, as an unsharded index's
            # and a semantic shard's lines say it ("DEADLINE_EXCEEDED: Deadline Exceeded").
            said = health_error(err, timeout, self.timeout)
            if not isinstance(said, str):
                said = f"{err.code().name}: {err.details()}"
        self.shard_errors[address] = said
        if self.on_outcome is not None:
            self.on_outcome(address, said)

    def _fan_out(self, requests: dict[str, object], method: str, timeout: float | None,
                 allow_partial: bool = False, refusals_partial: bool = False
                 ) -> dict[str, object]:
        """Call `method` on several shards at once; raise the first failure unless partial.

        Partial success covers shards that are down or slow only: a shard that refuses the
        call (FAILED_PRECONDITION, INVALID_ARGUMENT, ...) always raises, since retrying the
        others would only repeat the refusal; with `refusals_partial` (a read whose parts
        stand alone: Stats) it is one more shard that did not answer.
        """
        md = call_metadata(self.internal_token)
        futs = {a: getattr(self._shards[a].stub, method).future(
            r, timeout=timeout_or(timeout, self.timeout), metadata=md) for a, r in requests.items()}
        out: dict[str, object] = {}
        errors: list[PrefixIndexError] = []
        for a, f in futs.items():
            try:
                out[a] = f.result()
                self._outcome(a, None)
            except grpc.RpcError as e:
                errors.append(PrefixIndexError.wrap(method, a, e))
                self._outcome(a, errors[-1], timeout)
        refused = [e for e in errors if e.code() not in _TRANSIENT]
        raised = None
        if refused and not (allow_partial and refusals_partial and out):
            raised = refused[0]
        elif errors and (not allow_partial or not out):
            raised = errors[0]
        if raised is not None:
            # Every failed shard's error, as PublishEvents gives: a Register or Heartbeat that
            # failed on all shards named the first one's only.
            raised.shards_failed = {e.address: e for e in errors}
            raise raised
        for e in errors:
            log.warning("%s", e)
        return out

    # -- membership -----------------------------------------------------------------------

    def register(self, replica_id: str, incarnation: str, address: str, model_id: str,
                 block_size: int, capacity_blocks: int = 0, *, timeout: float | None = None,
                 hash_probe: bytes | None = None,
                 only: Collection[str] | None = None) -> RegisterOutcome:
        """Register on every shard (or the shards in `only`: those that forgot the replica);
        remembers each shard's next batch number.

        Sends this process's hash probe, so a shard refuses (FAILED_PRECONDITION) a replica
        whose TIERCACHE_HASH_KEY differs from its own. `hash_probe` overrides it with the
        caller's own hasher's probe (a replica sends what its pool really computes).
        """
        probe = hash_probe or BlockHasher(model_id, block_size, self.hash_key,
                                          memo_blocks=0).probe()
        req = prefix_pb2.RegisterRequest(
            replica_id=replica_id, incarnation=incarnation, address=address, model_id=model_id,
            block_size=block_size, capacity_blocks=capacity_blocks, hash_probe=probe,
            shard_list=self.shard_list)
        # Shards that are down are registered with later (they answer NOT_FOUND to the first
        # batch once back, and the publisher registers again); the others start now.
        got = self._fan_out({a: req for a in self._shards_in(only)}, "Register", timeout,
                            allow_partial=True)
        with self._lock:
            for a, r in got.items():
                key = (replica_id, incarnation, a)
                # Never backwards: a batch sent before a lease lapse may still be queued at the
                # shard under the number the shard now hands back, and reusing it would let
                # that old batch stand in for this one.
                self._seq[key] = max(self._seq.get(key, 1), r.next_seq or 1)  # type: ignore[attr-defined]
        def smallest(field: str) -> int:
            said = [getattr(r, field) for r in got.values() if getattr(r, field)]
            return min(said) if said else 0

        return RegisterOutcome(min(r.lease_seconds for r in got.values()),  # type: ignore[attr-defined]
                               {a: r.next_seq for a, r in got.items()},  # type: ignore[attr-defined]
                               smallest("max_events"), smallest("max_blocks"))

    def heartbeat(self, replica_id: str, incarnation: str,
                  load: prefix_pb2.ReplicaLoad | None = None, *, timeout: float | None = None,
                  only: Collection[str] | None = None) -> prefix_pb2.HeartbeatResponse:
        """Renew the lease on every shard that answers; `known` is False if any of them forgot
        the replica. Raises only when no shard answers: one shard down must not let the
        others' leases lapse. With `only` (shard addresses): those shards, and raises if any
        of them does not answer (a probe before resending a snapshot to them)."""
        got = self.heartbeat_shards(replica_id, incarnation, load, timeout=timeout, only=only)
        return prefix_pb2.HeartbeatResponse(
            known=all(r.known for r in got.values()),  # type: ignore[attr-defined]
            lease_seconds=min(r.lease_seconds for r in got.values()))  # type: ignore[attr-defined]

    def heartbeat_shards(self, replica_id: str, incarnation: str,
                         load: prefix_pb2.ReplicaLoad | None = None, *,
                         timeout: float | None = None, only: Collection[str] | None = None,
                         partial: bool | None = None
                         ) -> dict[str, prefix_pb2.HeartbeatResponse]:
        """`heartbeat`, answered per shard address (the shards that answered). `partial`:
        some may fail (default: when every shard is asked)."""
        req = prefix_pb2.HeartbeatRequest(replica_id=replica_id, incarnation=incarnation,
                                          load=load or prefix_pb2.ReplicaLoad())
        return self._fan_out({a: req for a in self._shards_in(only)}, "Heartbeat",  # type: ignore[return-value]
                             timeout, allow_partial=only is None if partial is None else partial)

    def _shards_in(self, only: Collection[str] | None) -> list[str]:
        """Every shard address, or those in `only`, in the configured order.

        Raises:
            ValueError: `only` names no shard, or an address that is none of this client's
                (an empty `only` crashed Register and Heartbeat on `min()` of nothing, and an
                unknown address was passed over: a resync sent to no shard, said to be done).
        """
        if only is None:
            return list(self.addresses)
        unknown = sorted(set(only) - set(self.addresses))
        if unknown:
            raise ValueError(f"only: {unknown[0]!r} is not one of this client's shard "
                             f"addresses {self.addresses}")
        if not only:
            raise ValueError("only: names no shard (None means every shard)")
        return [a for a in self.addresses if a in only]

    # -- events ---------------------------------------------------------------------------

    def route_events(self, events: Sequence[prefix_pb2.KvEvent]
                     ) -> dict[str, list[prefix_pb2.KvEvent]]:
        """Events per shard address, in order (see the module docstring)."""
        out: dict[str, list[prefix_pb2.KvEvent]] = {a: [] for a in self.addresses}
        for i, ev in enumerate(events):
            which = ev.WhichOneof("event")
            if which == "stored" and self.sharded:
                s = ev.stored
                first = s.first_block_hash or (
                    s.block_hashes[0] if not s.parent_hash and s.block_hashes else b"")
                if not first:
                    raise ValueError(f"events[{i}].stored.first_block_hash: required to route "
                                     "a continuation to its shard")
                out[self.shard_for(first)].append(ev)
            elif which == "stored":
                out[self.addresses[0]].append(ev)
            else:
                for a in self.addresses:
                    out[a].append(ev)
        return out

    def publish_events(self, replica_id: str, incarnation: str,
                       events: Sequence[prefix_pb2.KvEvent], resync: bool = False, *,
                       timeout: float | None = None,
                       only: Collection[str] | None = None) -> PublishOutcome:
        """Send a batch, split per shard, each with that shard's next sequence number.

        A resync batch goes to every shard (an empty one clears the replica there), or to the
        shards in `only`. A shard that fails has lost its batch: its number is used up, so
        its next batch shows a gap and it asks for a resync. While another shard applied its
        batch, failures are reported in `failed` (one shard down must not hold the others
        back); when every shard that got a batch failed, the first error is raised.

        Raises:
            PrefixIndexError: every shard that got a batch failed.
            ValueError: a stored continuation lacks first_block_hash on a sharded index; or
                `only` names no shard of this client (see `_shards_in`). No number is used.
        """
        per = self.route_events(events)
        asked = self._shards_in(only)
        reqs: dict[str, prefix_pb2.PublishEventsRequest] = {}
        with self._lock:
            for a, evs in per.items():
                if a not in asked:
                    continue
                if not evs and not resync:
                    continue
                key = (replica_id, incarnation, a)
                seq = self._seq.get(key, 1)
                self._seq[key] = seq + 1
                reqs[a] = prefix_pb2.PublishEventsRequest(
                    replica_id=replica_id, incarnation=incarnation, seq=seq, events=evs,
                    resync=resync)
        if not reqs:
            return PublishOutcome(False, [], {})
        md = call_metadata(self.internal_token)
        futs = {a: self._shards[a].stub.PublishEvents.future(
            r, timeout=timeout_or(timeout, self.timeout), metadata=md) for a, r in reqs.items()}
        need: list[str] = []
        failed: dict[str, PrefixIndexError] = {}
        for a, f in futs.items():
            try:
                r = f.result()
            except grpc.RpcError as e:
                failed[a] = PrefixIndexError.wrap("PublishEvents", a, e)
                continue
            if r.status == prefix_pb2.PUBLISH_STATUS_RESYNC:
                need.append(a)
            if r.next_seq:
                with self._lock:
                    # Never backwards (see register): after RESYNC the shard's next_seq can be
                    # the number of a timed-out batch still queued there; the resync must come
                    # after it, or the shard takes the old batch and then drops the resync.
                    key = (replica_id, incarnation, a)
                    self._seq[key] = max(self._seq.get(key, 1), r.next_seq)
        if failed and len(failed) == len(futs):
            first = next(iter(failed.values()))
            first.shards_failed = dict(failed)  # every shard's error, not only the first's
            raise first
        for e in failed.values():
            log.warning("%s", e)
        return PublishOutcome(bool(need), need, {a: r.seq for a, r in reqs.items()
                                                 if a not in failed}, failed)

    # -- queries --------------------------------------------------------------------------

    def match(self, model_id: str, *, token_ids: Sequence[int] = (),
              block_hashes: Sequence[bytes] = (), cache_salt: str = "",
              timeout: float | None = None, probe: bool = False,
              on_call: Callable[[grpc.Future], None] | None = None) -> prefix_pb2.MatchResponse:
        """Replicas of `model_id` by matched prefix length, longest first (from one shard).
        `probe`: routing asking, not traffic (no hit credited, nothing counted). `on_call`:
        see `_call` (a request cancels its Match when its client goes)."""
        if len(block_hashes):
            first = block_hashes[0]
        elif self.sharded and len(token_ids) >= self.block_size:
            first = self._first_hash(model_id, cache_salt, token_ids)
        else:
            first = b""
        address = self.shard_for(first) if first else self.addresses[0]
        req = prefix_pb2.MatchRequest(model_id=model_id, cache_salt=cache_salt,
                                      token_ids=token_ids, block_hashes=block_hashes,
                                      probe=probe, shard_list=self.shard_list)
        return self._call(address, "Match", req, timeout, on_call)

    def top_prefixes(self, k: int, model_id: str = "", min_hits: int = 0, *,
                     cache_salt: str | None = None, timeout: float | None = None,
                     allow_partial: bool = False) -> prefix_pb2.TopPrefixesResponse:
        """The `k` hottest prefixes over all shards, hottest first (only under `cache_salt`
        when given)."""
        req = prefix_pb2.TopPrefixesRequest(k=k, model_id=model_id, min_hits=min_hits)
        if cache_salt is not None:
            req.cache_salt = cache_salt
        got = self._fan_out({a: req for a in self.addresses}, "TopPrefixes", timeout,
                            allow_partial)
        allp = [p for r in got.values() for p in r.prefixes]  # type: ignore[attr-defined]
        allp.sort(key=lambda p: (-p.hits, -len(p.token_ids)))
        return prefix_pb2.TopPrefixesResponse(prefixes=allp[:k])

    def stats(self, *, timeout: float | None = None, allow_partial: bool = False,
              answered: set[str] | None = None) -> prefix_pb2.PrefixStatsResponse:
        """Figures summed over shards; a replica's held blocks summed over shards, the rest
        of its record (load, incarnation, address, capacity) from the shard that heard from
        it last.
        `shards_answered` < `shards_total` (with `allow_partial`) says some shard's are
        missing, rather than the sum passing for the whole index's: a shard down, slow or
        refusing (one refusal hid every other shard's figures: the orchestrator's Stats left
        the index's unset, documented as summed over the shards that answered).
        `answered`: given, the addresses of the shards that answered are added to it."""
        got = self._fan_out({a: prefix_pb2.PrefixStatsRequest() for a in self.addresses},
                            "Stats", timeout, allow_partial, refusals_partial=True)
        if answered is not None:
            answered.update(got)
        out = prefix_pb2.PrefixStatsResponse(shards_total=len(self.addresses),
                                             shards_answered=len(got))
        reps: dict[str, prefix_pb2.ReplicaInfo] = {}
        freshest: dict[str, float] = {}  # per replica, the shortest silence any shard saw
        for r in got.values():
            for f in ("nodes", "bytes", "matches_total", "matches_hit", "match_blocks_total",
                      "match_blocks_hit", "pruned_total", "resyncs_total",
                      "dropped_blocks_total", "max_nodes", "shard_list_mismatches_total",
                      "unheld_nodes"):
                setattr(out, f, getattr(out, f) + getattr(r, f))
            out.block_size = r.block_size  # type: ignore[attr-defined]
            for ri in r.replicas:  # type: ignore[attr-defined]
                cur = reps.get(ri.replica_id)
                if cur is None:
                    reps[ri.replica_id] = prefix_pb2.ReplicaInfo()
                    reps[ri.replica_id].CopyFrom(ri)
                    freshest[ri.replica_id] = ri.last_seen_s
                else:
                    held = cur.held_blocks + ri.held_blocks
                    oldest = max(cur.last_seen_s, ri.last_seen_s)
                    if ri.last_seen_s < freshest[ri.replica_id]:
                        # The shard that heard from it last: its load, and its incarnation,
                        # address and capacity (mid-restart a shard not yet reached holds the
                        # old incarnation), not whichever shard answered first.
                        freshest[ri.replica_id] = ri.last_seen_s
                        cur.CopyFrom(ri)
                    cur.held_blocks, cur.last_seen_s = held, oldest
        out.replicas.extend(reps[k] for k in sorted(reps))
        notes = {a: r.shard_list_mismatch for a, r in got.items()}  # type: ignore[attr-defined]
        self.shard_list_notes.update(notes)
        out.shard_list_mismatch = merged_note(notes, self.sharded)
        return out
