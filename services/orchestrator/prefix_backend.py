"""The prefix index as the orchestrator uses it (Match, TopPrefixes, Stats), with health.

Sharding is the shared client's job (`PrefixIndexClient` routes by the first block hash);
this wrapper adds the health record that `Stats` reports and turns a Match into the
replica -> matched tokens map that routing needs.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from tiercache.v1 import common_pb2

from services.common.grpc_client import health_error, tells_of_health, timeout_or
from services.common.prefix_client import PrefixIndexClient
from services.orchestrator.backends import (
    Health,
    HungBackoff,
    Polled,
    tier_health,
    timed,
    with_note,
)


class PrefixBackend(Polled):
    # An index shard whose Match ran out its whole timeout is skipped (ring routing) for this
    # long, doubling while it stays hung: every request waited the timeout on it before.
    HUNG_BACKOFF_S = (0.5, 5.0)

    def __init__(self, addresses: tuple[str, ...], internal_token: str, timeout_s: float,
                 block_size: int, clock=None) -> None:
        self.client = PrefixIndexClient(addresses, internal_token, timeout=timeout_s,
                                        block_size=block_size)
        # The shards as the client dials them and names them to `on_outcome`: stripped, blank
        # entries (a trailing comma, which the settings' check lets through) left out. As
        # given, " a:1" was a shard whose gauge was never set, and "a:1," one index exported
        # as a shard, its own gauge never set.
        addresses = tuple(self.client.addresses)
        # Sharded, the tier's record is set by each shard's call in turn: its state is no
        # metric then (each shard's is in Stats).
        self.health = Health("prefix", ",".join(addresses), exported=len(addresses) == 1)
        # Sharded, each shard's state is a metric instead (dependency "prefix shard"), as a
        # semantic shard's is; Stats' lines still come from the client's `shard_errors`.
        self.shard_health = {a: Health("prefix shard", a)
                             for a in (addresses if len(addresses) > 1 else ())}
        if self.shard_health:
            self.client.on_outcome = self._shard_outcome
        self.timeout_s = timeout_s
        self.hung = HungBackoff("prefix index shard", self.HUNG_BACKOFF_S,
                                *([clock] if clock else []))

    # The index is asked for its Stats (`Polled.start`) as the semantic tier is: with the
    # background warm-up off, its gauge stayed 0 for good on an idle stack after it came back.
    POLL_NAME = "prefix index"

    def poll_once(self, every: float = Polled.POLL_S) -> None:
        """Stats on the index (every shard): its health records, as a Match would set them."""
        try:
            self.stats(timeout=every)
        except grpc.RpcError:
            pass  # marked down by _guard (and each shard by its outcome)

    def _shard_outcome(self, address: str, error: str) -> None:
        h = self.shard_health.get(address)
        if h is not None:
            h.fail(error) if error else h.ok()

    def _guard(self, fn, *args, **kw):
        try:
            r = fn(*args, **kw)
            self.health.ok()
            return r
        except grpc.RpcError as e:
            # Nor a caller's bad request (a malformed hash, k = 0): as a shard's record
            # (`PrefixIndexClient._outcome`) and the semantic tier's, not the index's fault. One
            # index read unhealthy after it, its gauge 0, while the same index sharded did not.
            if tells_of_health(e, kw.get("timeout"), self.timeout_s):
                self.health.fail(health_error(e, kw.get("timeout"), self.timeout_s))
            raise

    def match(self, block_hashes: list[bytes], model_id: str,
              timeout: float | None = None, probe: bool = False,
              on_call: Callable[[grpc.Future], None] | None = None) -> dict[str, int]:
        """`on_call`: see `PrefixIndexClient._call` (the request cancels its Match when its
        client goes: grpc.FutureCancelledError, not held against the shard)."""
        shard = self.client.shard_for(block_hashes[0]) if block_hashes else ""
        r = self.hung.call(shard, timeout_or(timeout, self.timeout_s), self.timeout_s,
                           lambda: timed("prefix", "Match", shard or self.health.address,
                                         lambda: self._guard(
                                             self.client.match, model_id,
                                             block_hashes=block_hashes, timeout=timeout,
                                             probe=probe, on_call=on_call)))
        return {m.replica_id: m.matched_tokens for m in r.matches if m.matched_blocks}

    def dependencies(self) -> list:
        """Stats' health entries: the tier, and with shards each shard's own (a partial answer
        hides a shard that is down; its last call's outcome does not), the tier's then derived
        from theirs (`tier_health`: its own record follows whichever shard answered last).

        A shard that said in its last Stats that replicas registered with another shard list
        than our Matches came with reads unhealthy, saying so: every lookup of the chains it
        should hold goes elsewhere and misses, though each call succeeds."""
        if len(self.client.addresses) <= 1:
            line = self.health.proto()
            with_note(line, self.client.shard_list_notes.get(self.client.addresses[0], ""))
            return [line]
        shards = []
        for a in self.client.addresses:
            err = self.client.shard_errors.get(a)
            shards.append(common_pb2.DependencyHealth(
                name="prefix shard", address=a, healthy=err == "",
                last_error="no call yet" if err is None else err))
            with_note(shards[-1], self.client.shard_list_notes.get(a, ""))
        return [tier_health(self.health.name, self.health.address, shards), *shards]

    def top_prefixes(self, k: int, model_id: str, cache_salt: str | None = None,
                     min_hits: int = 0):
        return self._guard(self.client.top_prefixes, k, model_id, min_hits,
                           cache_salt=cache_salt, allow_partial=True).prefixes

    def stats(self, timeout: float | None = None):
        """`timeout`: at most this long (the caller's deadline), else the index's own."""
        answered: set[str] = set()
        r = self._guard(self.client.stats, allow_partial=True, answered=answered,
                        timeout=None if timeout is None else min(timeout, self.timeout_s))
        # A shard that answered is not hung. Its Matches were still skipped for the rest of
        # their back-off (up to 5 s) after this call had logged the index "healthy again" and
        # set its gauge to 1: ring routing and "unreachable" lines under it. So too when
        # another shard did not answer (a partial Stats ended no shard's back-off).
        for a in answered:
            self.hung.answered(a)
        return r
