"""Rules of the sharded prefix-index client (`PrefixIndexClient`) that its mutation audit found
unguarded, checked against fake shards: what Register, Heartbeat, PublishEvents, TopPrefixes
and Stats make of several shards' answers and failures, and how events are routed."""

from __future__ import annotations

import grpc
import pytest
from tiercache.v1 import prefix_pb2

from services.common.prefix_client import PrefixIndexClient, PrefixIndexError
from tests.orchestrator.test_semantic_errors import Refusal

A, B = "shard-a:1", "shard-b:1"


class _Done:
    def __init__(self, fn, req) -> None:
        self.fn, self.req = fn, req

    def result(self):
        return self.fn(self.req)


class _Method:
    def __init__(self, shard: FakeShards, address: str, name: str) -> None:
        self.shard, self.address, self.name = shard, address, name

    def __call__(self, req, timeout=None, metadata=None):
        self.shard.timeouts.append(timeout)
        return self._answer(req)

    def future(self, req, timeout=None, metadata=None):
        self.shard.timeouts.append(timeout)
        return _Done(self._answer, req)

    def _answer(self, req):
        self.shard.calls.append((self.address, self.name, req))
        got = self.shard.answers[self.address][self.name]
        if isinstance(got, grpc.StatusCode):
            raise Refusal(got, f"{self.address} says {got.name}")
        return got(req) if callable(got) else got


class FakeShards:
    """`channel_factory` for a client: each shard answers each method as `answers` says (a
    response, a function of the request, or a status code to fail with); `calls` records
    (address, method, request), `timeouts` each call's timeout."""

    def __init__(self, answers: dict[str, dict[str, object]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str, object]] = []
        self.timeouts: list[float | None] = []

    def __call__(self, address: str):
        shards = self

        class Chan:
            def unary_unary(self, path, *a, **k):
                return _Method(shards, address, path.rsplit("/", 1)[-1])

            def close(self):
                pass

        return Chan()


def client_of(answers: dict[str, dict[str, object]]) -> tuple[PrefixIndexClient, FakeShards]:
    fake = FakeShards(answers)
    return PrefixIndexClient(list(answers), block_size=4, hash_key=b"k",
                             channel_factory=fake), fake


def _stats(**kw) -> prefix_pb2.PrefixStatsResponse:
    return prefix_pb2.PrefixStatsResponse(block_size=4, **kw)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_partial_answer_covers_shards_down_or_overloaded_only(code):
    """With allow_partial, a shard that is down or overloaded (a failure another try can cure)
    leaves the others' answer standing, said to be partial; one that refuses the call fails
    it (TopPrefixes; Stats, below, takes the others'); and so does every shard failing, or any
    failure without allow_partial."""
    c, fake = client_of({A: {"Stats": _stats(nodes=3)}, B: {"Stats": code}})
    got = c.stats(allow_partial=True)
    assert (got.nodes, got.shards_answered, got.shards_total) == (3, 1, 2)
    with pytest.raises(PrefixIndexError) as e:
        c.stats()
    assert (e.value.address, e.value.code()) == (B, code)
    fake.answers[A]["Stats"] = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(PrefixIndexError):
        c.stats(allow_partial=True)
    fake.answers[A]["TopPrefixes"] = grpc.StatusCode.PERMISSION_DENIED
    fake.answers[B]["TopPrefixes"] = prefix_pb2.TopPrefixesResponse()
    with pytest.raises(PrefixIndexError) as e:
        c.top_prefixes(3, allow_partial=True)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("code", [grpc.StatusCode.PERMISSION_DENIED,
                                  grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.UNIMPLEMENTED])
def test_a_shard_refusing_stats_leaves_the_others_figures_said_to_be_partial(code):
    """Stats is a read whose shards' parts stand alone: with allow_partial a shard refusing it
    is one more that did not answer (its failure recorded), not the end of the others'
    figures. One refusal left the orchestrator's Stats without the index's figures (documented
    as summed over the shards that answered). Without allow_partial, or with no answer, it
    still raises."""
    c, fake = client_of({A: {"Stats": code}, B: {"Stats": _stats(nodes=3)}})
    got = c.stats(allow_partial=True)
    assert (got.nodes, got.shards_answered, got.shards_total) == (3, 1, 2)
    assert c.shard_errors[A].startswith(code.name) and c.shard_errors[B] == ""
    with pytest.raises(PrefixIndexError) as e:
        c.stats()
    assert e.value.code() == code
    fake.answers[B]["Stats"] = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(PrefixIndexError) as e:
        c.stats(allow_partial=True)
    assert e.value.code() == code  # the refusal, rather than the passing failure


def test_shard_health_records_failures_not_a_callers_bad_request_and_tells_on_outcome():
    """A shard's failure is recorded (and told to `on_outcome`); a caller's bad request
    (INVALID_ARGUMENT, NOT_FOUND) says nothing of the shard and leaves its record alone."""
    c, fake = client_of({A: {"Match": prefix_pb2.MatchResponse()}})
    told: list[tuple[str, str]] = []
    c.on_outcome = lambda address, said: told.append((address, said))
    c.match("m", block_hashes=[b"x" * 16])
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        fake.answers[A]["Match"] = code
        with pytest.raises(PrefixIndexError):
            c.match("m", block_hashes=[b"x" * 16])
    assert c.shard_errors == {A: ""} and told == [(A, "")]
    fake.answers[A]["Match"] = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(PrefixIndexError):
        c.match("m", block_hashes=[b"x" * 16])
    assert c.shard_errors[A].startswith("UNAVAILABLE") and told[-1] == (A, c.shard_errors[A])


def _registered(lease: float, next_seq: int = 1, **kw) -> prefix_pb2.RegisterResponse:
    return prefix_pb2.RegisterResponse(lease_seconds=lease, next_seq=next_seq, **kw)


def test_register_takes_the_shortest_lease_and_the_smallest_limits_said():
    """Register's outcome is the shortest lease of the shards and the smallest batch limits
    of those that said one (0: not said)."""
    c, _ = client_of({A: {"Register": _registered(10, max_events=500, max_blocks=0)},
                      B: {"Register": _registered(4, max_events=900, max_blocks=700)}})
    got = c.register("r", "i1", "addr", "m", 4)
    assert (got.lease_seconds, got.max_events, got.max_blocks) == (4, 500, 700)


def _published(status=prefix_pb2.PUBLISH_STATUS_OK, next_seq: int = 0):
    return lambda req: prefix_pb2.PublishEventsResponse(status=status,
                                                        next_seq=next_seq or req.seq + 1)


def test_batch_numbers_never_go_back_when_a_shard_hands_back_a_lower_one():
    """A Register or a RESYNC answer naming a lower next batch number than the client has
    used (a batch still queued at the shard) does not move the client's number back."""
    c, fake = client_of({A: {"Register": _registered(10, next_seq=1),
                             "PublishEvents": _published()}})
    c.register("r", "i1", "addr", "m", 4)
    for _ in range(3):
        c.publish_events("r", "i1", [prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared())])
    c.register("r", "i1", "addr", "m", 4)  # the shard lost the replica: next_seq 1 again
    assert c.publish_events("r", "i1", [], resync=True).sent == {A: 4}
    fake.answers[A]["PublishEvents"] = _published(prefix_pb2.PUBLISH_STATUS_RESYNC, 2)
    assert c.publish_events("r", "i1", [], resync=True).resync
    assert c.publish_events("r", "i1", [], resync=True).sent == {A: 6}


def test_heartbeat_is_unknown_if_any_shard_forgot_and_only_fails_on_a_shard_asked():
    """`known` is False when any shard forgot the replica; a shard down is passed over when
    every shard is asked, but not when it is one of the shards named in `only`."""
    beat = prefix_pb2.HeartbeatResponse
    c, fake = client_of({A: {"Heartbeat": beat(known=True, lease_seconds=10)},
                         B: {"Heartbeat": beat(known=False, lease_seconds=10)}})
    assert not c.heartbeat("r", "i1").known
    fake.answers[B]["Heartbeat"] = grpc.StatusCode.UNAVAILABLE
    assert c.heartbeat("r", "i1").known
    with pytest.raises(PrefixIndexError):
        c.heartbeat("r", "i1", only=[A, B])  # a probe before resending to those shards


def _stored(first: bytes, parent: bytes = b"", with_first: bool = True) -> prefix_pb2.KvEvent:
    return prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
        parent_hash=parent, block_hashes=[parent[::-1] or first], token_ids=[1, 2, 3, 4],
        first_block_hash=first if with_first else b""))


def test_events_are_routed_stored_by_first_block_and_the_rest_to_every_shard():
    """Stored chains go to the shard owning their first block (a continuation must name it);
    removals and clears go to every shard."""
    c, _ = client_of({A: {}, B: {}})
    firsts = [bytes([i]) * 16 for i in range(40)]
    owner = {f: c.shard_for(f) for f in firsts}
    assert set(owner.values()) == {A, B}
    removed = prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(block_hashes=[b"r" * 16]))
    events = [_stored(f, parent=b"p" * 16 if i % 2 else b"") for i, f in enumerate(firsts)]
    per = c.route_events([*events, removed])
    for a in (A, B):
        assert per[a][-1] == removed
        assert [e.stored.first_block_hash for e in per[a][:-1]] == [
            f for f in firsts if owner[f] == a]
    with pytest.raises(ValueError, match="first_block_hash"):
        c.route_events([_stored(firsts[0], parent=b"p" * 16, with_first=False)])
    # From the root the first block is the chain's own: no need to name it.
    assert c.route_events([_stored(firsts[0], with_first=False)])[owner[firsts[0]]]


def test_an_empty_resync_goes_to_every_shard_or_to_those_named():
    """A resync batch with no events still goes to every shard (it clears the replica there),
    or to the shards in `only`; an empty ordinary batch goes nowhere."""
    c, fake = client_of({A: {"PublishEvents": _published()}, B: {"PublishEvents": _published()}})
    assert c.publish_events("r", "i1", []).sent == {}
    assert c.publish_events("r", "i1", [], resync=True).sent == {A: 1, B: 1}
    assert c.publish_events("r", "i1", [], resync=True, only=[B]).sent == {B: 2}
    assert [(a, r.resync) for a, _, r in fake.calls] == [(A, True), (B, True), (B, True)]


def test_a_batch_lost_on_some_shards_is_reported_and_on_all_raised_with_every_error():
    """While one shard applied its batch, the shards that failed are reported in `failed`
    and left out of `sent`; when all failed, the first error is raised naming each shard's;
    every shard that asked for a resync is named."""
    cleared = [prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared())]
    resync = _published(prefix_pb2.PUBLISH_STATUS_RESYNC)
    c, fake = client_of({A: {"PublishEvents": resync}, B: {"PublishEvents": resync}})
    got = c.publish_events("r", "i1", cleared)
    assert got.resync and sorted(got.resync_shards) == [A, B]
    fake.answers[B]["PublishEvents"] = grpc.StatusCode.UNAVAILABLE
    got = c.publish_events("r", "i1", cleared)
    assert got.sent == {A: 2} and list(got.failed) == [B] and got.resync_shards == [A]
    fake.answers[A]["PublishEvents"] = grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(PrefixIndexError) as e:
        c.publish_events("r", "i1", cleared)
    assert sorted(e.value.shards_failed) == [A, B]


def test_a_token_match_of_one_full_block_goes_to_the_shard_owning_that_block():
    """A sharded Match by token ids is routed by the hash of its first full block, a single
    block included; with no full block it goes to the first shard."""
    from services.common.hashing import BlockHasher

    c, fake = client_of({A: {"Match": prefix_pb2.MatchResponse()},
                         B: {"Match": prefix_pb2.MatchResponse()}})
    hasher = BlockHasher("m", 4, b"k")
    for tokens in ([i, i + 1, i + 2, i + 3] for i in range(0, 80, 4)):
        c.match("m", token_ids=tokens)
        assert fake.calls[-1][0] == c.shard_for(hasher.hashes(tokens)[0])
        c.match("m", token_ids=tokens[:3])
        assert fake.calls[-1][0] == A
    assert {a for a, _, _ in fake.calls} == {A, B}


def test_top_prefixes_merge_hottest_then_longest_first_cut_to_k_and_pass_an_empty_salt():
    """Merged TopPrefixes are the k hottest of all shards, the longer first among equally hot
    ones; an empty cache_salt is sent as a filter (the unsalted tenant), None as none."""
    def tops(*pairs):
        return prefix_pb2.TopPrefixesResponse(prefixes=[
            prefix_pb2.HotPrefix(token_ids=list(range(n)), hits=h) for n, h in pairs])

    c, fake = client_of({A: {"TopPrefixes": tops((4, 5), (8, 2))},
                         B: {"TopPrefixes": tops((12, 2), (4, 9))}})
    got = c.top_prefixes(3, cache_salt="")
    assert [(len(p.token_ids), p.hits) for p in got.prefixes] == [(4, 9), (4, 5), (12, 2)]
    assert all(r.HasField("cache_salt") for _, _, r in fake.calls)
    c.top_prefixes(3)
    assert not any(r.HasField("cache_salt") for _, _, r in fake.calls[-2:])


def test_stats_sum_a_replicas_blocks_over_shards_and_keep_its_longest_silence():
    """A replica's held blocks are summed over the shards, and its last_seen_s is the
    longest any shard reports (the most stale); its load is the one the shard that heard it
    last reports (it was the first answering shard's, however old)."""
    def info(held, seen, running, inc="i-1", address="10.0.0.1:1", capacity=0):
        return prefix_pb2.ReplicaInfo(replica_id="r", held_blocks=held, last_seen_s=seen,
                                      load=prefix_pb2.ReplicaLoad(running=running),
                                      incarnation=inc, address=address,
                                      capacity_blocks=capacity)

    # Mid-restart: the shard that heard it last holds the new incarnation (at a new address,
    # with a bigger pool); its record is the replica's, whichever shard answers first (the
    # first's incarnation was shown beside the other's load).
    old, new = info(3, 7.0, 1), info(4, 1.5, 5, "i-2", "10.0.0.2:1", 64)
    for first, second in ((old, new), (new, old)):
        c, _ = client_of({A: {"Stats": _stats(replicas=[first])},
                          B: {"Stats": _stats(replicas=[second])}})
        got = c.stats()
        assert [(r.held_blocks, r.last_seen_s, r.load.running, r.incarnation, r.address,
                 r.capacity_blocks) for r in got.replicas] == [
            (7, 7.0, 5, "i-2", "10.0.0.2:1", 64)]
        assert (got.shards_answered, got.shards_total) == (2, 2)


def test_stats_sum_every_count_field_of_the_message_over_shards():
    """The sum is a list of field names: a uint64 field added to PrefixStatsResponse and left
    off it read 0 in the orchestrator's Stats, and no test failed. Every uint64 field is a
    count (max_nodes the shards' budgets) and is summed."""
    from google.protobuf.descriptor import FieldDescriptor

    counts = [f.name for f in prefix_pb2.PrefixStatsResponse.DESCRIPTOR.fields
              if f.type == FieldDescriptor.TYPE_UINT64 and not f.is_repeated]
    c, _ = client_of({A: {"Stats": _stats(**{n: 1 + i for i, n in enumerate(counts)})},
                      B: {"Stats": _stats(**{n: 100 + i for i, n in enumerate(counts)})}})
    got = c.stats()
    assert counts and {n: getattr(got, n) for n in counts} == {
        n: 101 + 2 * i for i, n in enumerate(counts)}


def test_a_call_failing_on_every_shard_names_each_shards_error():
    """Register, Heartbeat, TopPrefixes and Stats failing on every shard raise the first
    error with each shard's in `shards_failed`, as PublishEvents does (they named only the
    first shard's, so a caller could not tell a forgetful shard from one that is down)."""
    codes = {A: grpc.StatusCode.UNAVAILABLE, B: grpc.StatusCode.DEADLINE_EXCEEDED}
    c, _ = client_of({a: {m: code for m in ("Register", "Heartbeat", "TopPrefixes", "Stats")}
                      for a, code in codes.items()})
    for call in (lambda: c.register("r", "i1", "addr", "m", 4), lambda: c.heartbeat("r", "i1"),
                 lambda: c.top_prefixes(3, allow_partial=True),
                 lambda: c.stats(allow_partial=True)):
        with pytest.raises(PrefixIndexError) as e:
            call()
        assert {a: f.code() for a, f in e.value.shards_failed.items()} == codes


@pytest.mark.parametrize("only", [[], ["shard-c:1"], [A, "shard-c:1"]])
def test_only_naming_no_shard_of_the_client_is_refused_before_any_call(only):
    """`only` that is empty or names an address that is none of the client's shards is a
    ValueError naming it, before any call and with no batch number used: an empty one crashed
    Register and Heartbeat on `min()` of nothing, and an unknown address was passed over (a
    resync to it went nowhere and was reported as done)."""
    c, fake = client_of({A: {"PublishEvents": _published()}, B: {"PublishEvents": _published()}})
    for call in (lambda: c.register("r", "i1", "addr", "m", 4, only=only),
                 lambda: c.heartbeat("r", "i1", only=only),
                 lambda: c.publish_events("r", "i1", [], resync=True, only=only)):
        with pytest.raises(ValueError, match="^only: "):
            call()
    assert fake.calls == []
    assert c.publish_events("r", "i1", [], resync=True).sent == {A: 1, B: 1}


def test_a_timeout_of_zero_is_passed_on_not_taken_for_the_default():
    """`timeout=0` (no time left) reaches the call as 0, which gRPC fails at once with
    DEADLINE_EXCEEDED; `timeout or self.timeout` made it the client's full default."""
    ok = {"Match": prefix_pb2.MatchResponse(), "TopPrefixes": prefix_pb2.TopPrefixesResponse(),
          "PublishEvents": _published()}
    client, fake = client_of({A: dict(ok), B: dict(ok)})
    ev = prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared())
    for timeout, want in ((0, 0), (None, client.timeout), (2.5, 2.5)):
        fake.timeouts.clear()
        client.match("m", block_hashes=[b"h" * 16], timeout=timeout)
        client.top_prefixes(3, timeout=timeout)
        client.publish_events("r", "i1", [ev], timeout=timeout)
        assert fake.timeouts == [want] * 5, timeout  # 1 Match, 2 TopPrefixes, 2 PublishEvents


def test_a_shard_that_timed_out_says_how_long_nobody_answered():
    """A SIGSTOPped shard of a sharded index read "DEADLINE_EXCEEDED: Deadline Exceeded" on
    its Stats line (gRPC's words, no deadline named), where one unsharded index and a
    semantic shard say how long nobody answered."""
    late = {"Match": grpc.StatusCode.DEADLINE_EXCEEDED}
    c, fake = client_of({A: dict(late), B: dict(late)})
    told: list[tuple[str, str]] = []
    c.on_outcome = lambda address, said: told.append((address, said))
    with pytest.raises(PrefixIndexError) as e:
        c.match("m", block_hashes=[b"x" * 16])  # the client's whole timeout
    shard = e.value.address
    assert told == [(shard, f"no answer within {c.timeout:g}s (timed out)")]
    assert c.shard_errors[shard] == told[0][1]
