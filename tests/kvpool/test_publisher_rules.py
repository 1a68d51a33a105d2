"""Rules of the publisher that a second mutation audit found unguarded: a lagging shard's
catch-up waits for its own retry time; sent incremental events never count against the
backlog limit; a full resync leaves no shard lagging; a lease of 0 is no lease; shards that
forgot the replica are registered again once; heartbeats keep their interval under a longer
publish interval and pace to the shortest lease of the shards; an accepted batch marks the
publisher connected; a probe answered by an index that forgot the replica fails; batches
skip lagging shards; the retry backoff grows through an outage of the index, said once at
WARNING and once when it ends, and again at once when its status changes."""

from __future__ import annotations

import time

from tests.kvpool.conftest import StatsEngine
from tests.kvpool.test_publisher_sharded import (
    start_publisher,
    start_shard,
    two_shards,
    wait_for,
)


def test_a_lagging_shard_is_caught_up_only_once_its_retry_time_has_come(make_engine) -> None:
    """The loop resyncs a lagging shard on the shard's own timer (`_lag_retry_at`, pushed back
    by each failure): turn after turn passes without a try before that time, and the try
    comes once it is reached."""
    ha, hb, addrs = two_shards()
    eng = make_engine(num_blocks=16, hash_key=None)
    pub = start_publisher(eng, addrs)
    tries: list[set[str]] = []
    turns = [0]
    collect = pub._collect

    def counted() -> None:
        turns[0] += 1
        collect()

    def catch_up() -> None:
        tries.append(set(pub._lagging))
        pub._lagging = set()

    try:
        wait_for(lambda: pub.registered and not pub._need_resync and pub.resyncs >= 1)
        pub._collect, pub._catch_up_lagging = counted, catch_up
        pub._lag_retry_at = time.monotonic() + 600.0  # as a failed try leaves it
        pub._lagging = {addrs[1]}
        wait_for(lambda: turns[0] >= 20)
        assert tries == []
        pub._lag_retry_at = time.monotonic()
        wait_for(lambda: tries == [{addrs[1]}])
    finally:
        pub.stop()
        ha.stop(0)
        hb.stop(0)


def test_sent_incremental_events_leave_the_backlog_limit_where_it_was(make_engine,
                                                                      monkeypatch) -> None:
    """Only the rest of a snapshot is exempt from MAX_BACKLOG, counted down as it goes out:
    incremental events sent never count against it (as a negative count they made a later,
    small backlog read as an overflow and drop it for a needless resync)."""
    from services.kvpool import publisher
    from services.kvpool.block_pool import BlocksStored
    from tests.kvpool.test_kvpool_publisher import _recording_publisher

    monkeypatch.setattr(publisher, "MAX_BACKLOG", 3)
    eng = make_engine(num_blocks=32)
    pub, sent = _recording_publisher(eng)
    pub.registered, pub._need_resync = True, False

    def events(k: int) -> list[BlocksStored]:
        hs = [bytes([k, i]) * 8 for i in range(3)]
        return [BlocksStored(None, [h], [0] * 4, "", h, 0) for h in hs]

    try:
        for k in range(3):
            pub._backlog = events(k)  # as _collect takes them: at the limit, not past it
            pub._publish()
            assert pub._backlog == [] and pub._snapshot_left == 0
        eng._events.extend(events(9))
        pub._collect()
        assert not pub._need_resync and len(pub._backlog) == 3
        assert sent == [(False, 3)] * 3
    finally:
        pub._client.close()


def test_a_full_resync_brings_lagging_shards_up_to_date_too(make_engine) -> None:
    """A full resync sends the snapshot to every shard, lagging ones included: none is left
    lagging after it (else each got a second snapshot of its own, and batches skipped it
    until then)."""
    from tests.kvpool.test_kvpool_publisher import _recording_publisher

    eng = make_engine(num_blocks=32)
    pub, sent = _recording_publisher(eng)
    try:
        pub.registered = True
        pub._lagging = {"a"}
        pub._resync()
        assert sent == [(True, 0)] and pub._lagging == set() and not pub._need_resync
    finally:
        pub._client.close()


def test_an_index_that_names_no_lease_leaves_the_heartbeat_interval_as_configured() -> None:
    """A lease of 0 in an index's answer is the field unset (proto3's default): the heartbeats
    keep their configured interval (taken as a lease of 0 s, a third of it had the loop beat
    at every turn, without a pause)."""
    from tiercache.v1 import prefix_pb2

    from services.kvpool.publisher import Publisher

    pub = Publisher(StatsEngine(), address="127.0.0.1:1", replica_id="r", incarnation="i",
                    public_address="x", model_id="m", heartbeat_seconds=2.0)
    try:
        pub._client.heartbeat_shards = lambda *a, **kw: {
            "a": prefix_pb2.HeartbeatResponse(known=True, lease_seconds=0.0)}
        pub._heartbeat()
        assert pub.connected and pub._beat_every == 2.0
    finally:
        pub._client.close()


def test_shards_that_forgot_the_replica_are_registered_again_once(make_engine) -> None:
    """Shards a failed call found to have forgotten the replica are registered again on the
    loop's next turn, once: not again on every later turn (each registration there brings
    the shard a fresh snapshot)."""
    ha, hb, addrs = two_shards()
    eng = make_engine(num_blocks=16, hash_key=None)
    pub = start_publisher(eng, addrs)
    rejoined: list[set[str]] = []
    turns = [0]
    collect, rejoin = pub._collect, pub._rejoin

    def counted() -> None:
        turns[0] += 1
        collect()

    def rejoining(forgot: set[str]) -> None:
        rejoined.append(set(forgot))
        rejoin(forgot)

    try:
        wait_for(lambda: pub.registered and not pub._need_resync and pub.resyncs >= 1)
        pub._collect, pub._rejoin = counted, rejoining
        pub._forgot = {addrs[1]}  # as the loop's NOT_FOUND handler leaves it
        wait_for(lambda: rejoined and turns[0] >= 20)
        assert rejoined == [{addrs[1]}] and pub.registered
    finally:
        pub.stop()
        ha.stop(0)
        hb.stop(0)


def test_heartbeats_keep_their_interval_when_publishing_waits_longer(make_engine) -> None:
    """An idle loop waits for events at most until the next heartbeat is due: with a publish
    interval (3 s) longer than the heartbeat's (0.2 s), beats still go out every 0.2 s (they
    waited the publish interval twice, and the index's lease lapsed in between)."""
    import grpc

    from services.kvpool.publisher import Publisher
    from tests.kvpool.conftest import TINY_ID

    (_, h) = start_shard(lease_seconds=10.0)
    eng = make_engine(num_blocks=16, hash_key=None)
    pub = Publisher(eng, address=f"127.0.0.1:{h.port}", replica_id="kv-0", incarnation="i",
                    public_address="x:1", model_id=TINY_ID, heartbeat_seconds=0.2,
                    publish_interval_seconds=3.0, channel_factory=grpc.insecure_channel)
    beats: list[float] = []
    heartbeat = pub._heartbeat

    def counted(*a, **kw) -> None:
        beats.append(time.monotonic())
        heartbeat(*a, **kw)

    pub._heartbeat = counted
    pub.start()
    try:
        wait_for(lambda: pub.registered and len(beats) >= 1, timeout=15.0)
        first = len(beats)
        # 5 more beats take 1 s; 5 s allows for a loaded host, and is far from the 30 s they
        # took when the loop waited the publish interval.
        wait_for(lambda: len(beats) >= first + 5, timeout=5.0)
    finally:
        pub.stop()
        h.stop(0)


def test_a_batch_the_index_accepts_marks_the_publisher_connected(make_engine) -> None:
    """`connected` reads whether the last call to the index went through, a batch as much as
    a heartbeat or a registration: after an outage the first accepted batch sets it (Stats
    shows the batch number again), not the next heartbeat."""
    from services.kvpool.block_pool import BlocksStored
    from tests.kvpool.test_kvpool_publisher import _recording_publisher

    eng = make_engine(num_blocks=32)
    pub, sent = _recording_publisher(eng)
    try:
        pub.registered, pub._need_resync, pub.connected = True, False, False
        h = b"\x02" * 16
        pub._backlog = [BlocksStored(None, [h], [0] * 4, "", h, 0)]
        pub._publish()
        assert sent == [(False, 1)] and pub.connected and pub.last_seq == 1
    finally:
        pub._client.close()


def _heartbeating_publisher(answers: dict[str, tuple[bool, float]]):
    """A publisher over a fake engine whose index answers heartbeats per shard with (known,
    lease seconds); heartbeats every 30 s unless a lease says otherwise."""
    from tiercache.v1 import prefix_pb2

    from services.kvpool.publisher import Publisher

    pub = Publisher(StatsEngine(), address=",".join(answers), replica_id="r", incarnation="i",
                    public_address="x", model_id="m", heartbeat_seconds=30.0)
    pub._client.heartbeat_shards = lambda *a, **kw: {
        a: prefix_pb2.HeartbeatResponse(known=k, lease_seconds=lease)
        for a, (k, lease) in answers.items()}
    return pub


def test_heartbeats_pace_to_the_shortest_lease_of_the_shards() -> None:
    """Shards that give different leases: heartbeats go every third of the shortest, else the
    shard with the shortest lease dropped a healthy replica between two beats."""
    pub = _heartbeating_publisher({"127.0.0.1:1": (True, 9.0), "127.0.0.1:2": (True, 30.0)})
    try:
        pub._heartbeat()
        assert pub._beat_every == 3.0
    finally:
        pub._client.close()


def test_a_probe_answered_by_an_index_that_forgot_the_replica_fails() -> None:
    """The heartbeat before a snapshot after an outage (`_probe`) counts only if the index
    knows the replica: one that forgot it (restarted) fails the probe, so the loop registers
    again before it takes a snapshot (a pass over the pool on the engine thread), not after
    sending one to an index that refuses it."""
    pub = _heartbeating_publisher({"127.0.0.1:1": (False, 9.0)})
    try:
        pub.registered = True
        assert pub._probe(None) is False and not pub.registered
    finally:
        pub._client.close()


def test_batches_skip_lagging_shards(make_engine) -> None:
    """A batch goes to the shards in step only: a lagging one gets a snapshot later (the
    events would change nothing there), and a hung one held every batch for its timeout."""
    import grpc

    from services.common.prefix_client import PublishOutcome
    from services.kvpool.block_pool import BlocksStored
    from services.kvpool.publisher import Publisher
    from tests.kvpool.conftest import TINY_ID

    eng = make_engine(num_blocks=32)
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    pub = Publisher(eng, address=f"{a},{b}", replica_id="kv-0", incarnation="i",
                    public_address="x:1", model_id=TINY_ID, channel_factory=grpc.insecure_channel)
    to: list = []

    def publish_events(rid, inc, events, resync=False, only=None):
        to.append(only)
        return PublishOutcome(False, [], {s: 1 for s in (only or (a, b))}, {})

    pub._client.publish_events = publish_events
    try:
        pub.registered, pub._need_resync, pub._lagging = True, False, {b}
        h = b"\x03" * 16
        pub._backlog = [BlocksStored(None, [h], [0] * 4, "", h, 0)]
        pub._publish()
        assert to == [{a}] and pub._backlog == [] and pub._lagging == {b}
    finally:
        pub._client.close()


def test_a_shard_that_misses_a_heartbeat_lags_and_is_no_longer_beaten(make_engine,
                                                                      caplog) -> None:
    """A shard gone while the replica had nothing to publish (a prefix shard removed before
    the replicas' lists were) got a heartbeat every beat, each one a WARNING, for as long as
    it was gone: only a failed batch marked a shard lagging. Now a missed heartbeat does, and
    the shard is left to its own retry timer."""
    ha, hb, addrs = two_shards(lease_seconds=5.0)
    eng = make_engine(num_blocks=16, hash_key=None)
    pub = start_publisher(eng, addrs)  # heartbeats every 0.2 s
    try:
        wait_for(lambda: pub.registered and not pub._need_resync and pub.resyncs >= 1)
        hb.stop(0)
        wait_for(lambda: addrs[1] in pub._lagging, timeout=5.0)
        caplog.clear()
        time.sleep(1.5)  # ~7 beats
        beats = [r for r in caplog.records if "Heartbeat" in r.getMessage()
                 and r.levelname == "WARNING"]
        assert beats == []
        assert addrs[0] not in pub._lagging
    finally:
        pub.stop()
        ha.stop(0)


def test_the_registration_line_names_the_shard_list_as_the_notes_do(make_engine,
                                                                    caplog) -> None:
    """A shard's mismatch note names lists by fingerprint; the replica's line said only the
    addresses, so which pod had the other list took computing fingerprints by hand."""
    import logging

    from tiercache.v1 import common_pb2

    from services.common.addresses import shard_fingerprint
    from services.common.shard_list import said

    caplog.set_level(logging.INFO, "services.kvpool.publisher")
    ha, hb, addrs = two_shards(lease_seconds=5.0)
    pub = start_publisher(make_engine(num_blocks=16, hash_key=None), addrs)
    try:
        wait_for(lambda: pub.registered)
        sent = common_pb2.ShardList(shards=2, fingerprint=shard_fingerprint(addrs))
        wait_for(lambda: any(f"(shard list {said(sent)})" in r.getMessage()
                             for r in caplog.records), timeout=5.0)
    finally:
        pub.stop()
        ha.stop(0)
        hb.stop(0)


def _tiny_publisher(make_engine, port: int, heartbeat_seconds: float):
    """A started Publisher of a tiny engine, publishing to the index shard on `port`."""
    import grpc

    from services.kvpool.publisher import Publisher
    from tests.kvpool.conftest import TINY_ID

    return Publisher(make_engine(num_blocks=16, hash_key=None), address=f"127.0.0.1:{port}",
                     replica_id="kv-0", incarnation="i", public_address="x:1",
                     model_id=TINY_ID, heartbeat_seconds=heartbeat_seconds,
                     publish_interval_seconds=0.02, channel_factory=grpc.insecure_channel).start()


def test_the_retry_backoff_grows_through_an_outage_of_the_index(make_engine, caplog) -> None:
    """With the only index down, each failed heartbeat doubles the wait before the next try
    (0.2, 0.4, 0.8 s ...): the quiet turns between heartbeats (no beat due, no events) reset
    it, so every beat retried after 0.2 s and logged a WARNING saying so, for as long as the
    index was down."""
    import logging
    import re

    (_, h) = start_shard(lease_seconds=10.0)
    # Beats 1 s apart, longer than the first waits: quiet turns come between the failures.
    pub = _tiny_publisher(make_engine, h.port, heartbeat_seconds=1.0)
    try:
        wait_for(lambda: pub.registered and pub.connected)
        h.stop(0)
        with caplog.at_level(logging.DEBUG, logger="services.kvpool.publisher"):
            waits = lambda: [float(w) for w in re.findall(  # noqa: E731
                r"retrying in ([0-9.]+)s", caplog.text)]
            wait_for(lambda: len(waits()) >= 3)
        assert waits()[:3] == [0.2, 0.4, 0.8], caplog.text
    finally:
        pub.stop()


def test_an_outage_of_the_index_is_one_warning_then_a_line_when_it_answers_again(
        make_engine, caplog) -> None:
    """The first failed try of an outage is a WARNING, the tries after it DEBUG (one a
    minute WARNING again); once the index answers, one INFO line says after how long. Each
    try was a WARNING: 12 a minute per replica through an index's restart."""
    import logging


    (_, h) = start_shard(lease_seconds=10.0)
    port = h.port
    pub = _tiny_publisher(make_engine, port, heartbeat_seconds=0.2)
    try:
        wait_for(lambda: pub.registered and pub.connected)
        with caplog.at_level(logging.DEBUG, logger="services.kvpool.publisher"):
            h.stop(0)
            wait_for(lambda: caplog.text.count("retrying in") >= 4)
            (_, h) = start_shard(port=port, lease_seconds=10.0)
            wait_for(lambda: "answers again" in caplog.text)
        failed = [r for r in caplog.records if "retrying in" in r.getMessage()]
        assert [r.levelno for r in failed[:4]] == [logging.WARNING] + [logging.DEBUG] * 3
        assert "(failing for" in failed[1].getMessage()
    finally:
        pub.stop()
        h.stop(0)


def test_a_new_status_within_an_outage_is_said_at_once(make_engine, caplog) -> None:
    """An outage whose cause changes (the index restarted on another internal token: refused
    connections, then UNAUTHENTICATED) says the new status at WARNING at its first try, not
    a minute later: the log's last line said UNAVAILABLE while every try was refused."""
    import logging

    import grpc

    class Refused(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return "refused"

    (_, h) = start_shard(lease_seconds=10.0)
    pub = _tiny_publisher(make_engine, h.port, heartbeat_seconds=0.2)
    codes = [grpc.StatusCode.UNAVAILABLE] * 2 + [grpc.StatusCode.UNAUTHENTICATED] * 2

    def beat(*_a, **_k) -> None:
        raise Refused(codes.pop(0) if len(codes) > 1 else codes[0])

    try:
        wait_for(lambda: pub.registered and pub.connected)
        with caplog.at_level(logging.DEBUG, logger="services.kvpool.publisher"):
            pub._heartbeat = beat
            wait_for(lambda: caplog.text.count("retrying in") >= 4)
        failed = [(r.levelno, r.getMessage().split(" (")[0].rsplit(" ", 1)[-1])
                  for r in caplog.records if "retrying in" in r.getMessage()][:4]
        assert failed == [(logging.WARNING, "UNAVAILABLE"), (logging.DEBUG, "UNAVAILABLE"),
                          (logging.WARNING, "UNAUTHENTICATED"),
                          (logging.DEBUG, "UNAUTHENTICATED")], caplog.text
    finally:
        pub.stop()
        h.stop(0)
