"""Differential review of the sharded prefix index: `PrefixIndexClient` over real in-process
shards against one real unsharded index fed the same events (the reference).

Seeded random events: 1-4 replicas (two models) registering, storing and removing blocks over
chains that share prefixes, clearing, resyncing, heartbeats with loads, a new incarnation;
one shard stopped and started again empty on its port, after which every replica registers
there again and resyncs it alone. After each step Match (token ids or block hashes, two
salts), TopPrefixes and Stats are compared:

- Match on a chain whose owning shard is up equals the reference's answer; while the shard
  is down the call raises `PrefixIndexError` (UNAVAILABLE), and once it is back but before
  a replica resynced it, the answer lacks only that replica;
- TopPrefixes merged equal the reference's top k (hits in order; at the last hit count any of
  the tied prefixes), with a shard down and `allow_partial` the top k of the other shards'
  chains, `allow_partial` off raising;
- Stats sum to the reference's nodes and per-replica held blocks (`shards_answered` of
  `shards_total` with a shard down, the missing shard's chains not counted).

A shard that stalls (calls run out their deadline) is left out as a down one is.

A restarted shard has lost its hit counts: the reference is then rebuilt from the log of
events, its Matches on that shard's chains before the restart made as probes (no hit).
"""

from __future__ import annotations

import random
import threading

import grpc
import pytest
from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

from services.common.bootstrap import create_server
from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient, PrefixIndexError
from services.prefix.config import PrefixConfig
from services.prefix.server import PrefixServicer, build_index
from tests.waits import wait_until

BS = 4
MODELS = ("m", "n")
SALTS = ("", "t")


def start_index(port: int = 0):
    """One prefix index (real servicer and gRPC server) on loopback: (index, handle)."""
    index = build_index(PrefixConfig(block_size=BS, lease_seconds=300.0,
                                     hit_half_life_seconds=0.0))
    h = create_server(service="prefix-shard", address=f"127.0.0.1:{port}",
                      services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server,
                                 PrefixServicer(index), "tiercache.v1.PrefixIndex")])
    h.set_serving()
    return index, h


_HASHERS: dict[str, BlockHasher] = {}


def hashes(model: str, tokens: list[int], salt: str) -> list[bytes]:
    h = _HASHERS.get(model) or _HASHERS.setdefault(model, BlockHasher(model, BS))
    return h.hashes(tokens, salt)


class Replica:
    """A replica's own view: the blocks it holds (closed under parents)."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model, self.inc_n = rid, model, 0
        self.blocks: dict[bytes, tuple[bytes, list[int], bytes, int, str]] = {}

    @property
    def inc(self) -> str:
        return f"{self.rid}-i{self.inc_n}"

    def stored(self, tokens: list[int], salt: str, start: int, end: int) -> prefix_pb2.KvEvent:
        hs = hashes(self.model, tokens, salt)
        for i in range(start, end):
            self.blocks[hs[i]] = (hs[i - 1] if i else b"", tokens[i * BS:(i + 1) * BS], hs[0],
                                  i, salt)
        return prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
            parent_hash=hs[start - 1] if start else b"", block_hashes=hs[start:end],
            token_ids=tokens[start * BS:end * BS], first_block_hash=hs[0], start_block=start,
            cache_salt=salt))

    def removed(self, key: bytes) -> prefix_pb2.KvEvent:
        gone = {key}
        grew = True
        while grew:  # the subtree goes with it (holder closure)
            more = {k for k, b in self.blocks.items() if b[0] in gone} - gone
            grew = bool(more)
            gone |= more
        for k in gone:
            self.blocks.pop(k, None)
        return prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(block_hashes=[key]))

    def snapshot(self, rng: random.Random) -> list[prefix_pb2.KvEvent]:
        evs = [prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
            parent_hash=p, block_hashes=[k], token_ids=t, first_block_hash=f, start_block=i,
            cache_salt=s)) for k, (p, t, f, i, s) in self.blocks.items()]
        rng.shuffle(evs)  # a snapshot's order does not matter
        return evs

    def held_prefix(self, tokens: list[int], salt: str) -> int:
        n = 0
        for h in hashes(self.model, tokens, salt):
            if h not in self.blocks:
                break
            n += 1
        return n


def match_view(r: prefix_pb2.MatchResponse) -> tuple:
    return (r.request_blocks, r.block_size,
            [(m.replica_id, m.address, m.matched_blocks, m.matched_tokens, m.load.running,
              m.load.waiting) for m in r.matches])


def prefix_view(p) -> tuple:
    return (tuple(p.token_ids), p.hits, tuple(p.holders), p.cache_salt, p.model_id,
            p.last_block_hash)


class Run:
    """One seed's world: shards, the reference, replicas and the log the reference replays."""

    def __init__(self, seed: int, n_shards: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.shards = [start_index() for _ in range(n_shards)]
        self.addrs = [f"127.0.0.1:{h.port}" for _, h in self.shards]
        self.client = PrefixIndexClient(self.addrs, block_size=BS, timeout=5.0)
        self.ref_index, self.ref_h = start_index()
        self.ref = PrefixIndexClient([f"127.0.0.1:{self.ref_h.port}"], block_size=BS,
                                     timeout=5.0)
        self.log: list[tuple[str, tuple, dict]] = []  # reference calls, to replay
        self.down: str | None = None
        self.restarted = False  # a shard's counters were reset: Stats counters not compared
        self.unsynced: dict[str, set[str]] = {}  # shard -> replicas not registered there yet
        self.no_loads: str | None = None  # a shard the replicas registered on again, no load
        n_rep = self.rng.randint(1, 4)
        self.replicas = [Replica(f"r{i}", self.rng.choice(MODELS)) for i in range(n_rep)]
        # Chains: a few roots, continuations from a small alphabet (shared prefixes).
        self.roots = [[100 + 10 * r + j for j in range(BS)] for r in range(6)]
        self.steps = 0

    def close(self) -> None:
        self.client.close()
        self.ref.close()
        for _, h in self.shards:
            h.stop(0)
        self.ref_h.stop(0)

    # -- the reference ----------------------------------------------------------------------

    def ref_call(self, method: str, *args, **kw):
        self.log.append((method, args, kw))
        return getattr(self.ref, method)(*args, **{k: v for k, v in kw.items() if k != "_owner"})

    def rebuild_reference(self, lost_shard: str) -> None:
        """A fresh reference replaying the log, with no hits on `lost_shard`'s chains."""
        self.ref.close()
        self.ref_h.stop(0)
        self.ref_index, self.ref_h = start_index()
        self.ref = PrefixIndexClient([f"127.0.0.1:{self.ref_h.port}"], block_size=BS,
                                     timeout=5.0)
        for method, args, kw in self.log:
            if method == "match" and kw.get("_owner") == lost_shard:
                kw = dict(kw, probe=True)
            getattr(self.ref, method)(*args, **{k: v for k, v in kw.items() if k != "_owner"})

    # -- helpers ------------------------------------------------------------------------------

    def chain(self, rng: random.Random) -> tuple[list[int], str]:
        toks = list(rng.choice(self.roots))
        for _ in range(rng.randint(0, 5)):
            toks += [rng.randint(0, 2)] * BS if rng.random() < 0.7 else \
                [rng.randint(0, 2) for _ in range(BS)]
        return toks, rng.choice(SALTS)

    def owner(self, model: str, tokens: list[int], salt: str) -> str:
        hs = hashes(model, tokens, salt)
        return self.client.shard_for(hs[0]) if hs else self.addrs[0]

    def shard_index(self, address: str):
        return self.shards[self.addrs.index(address)][0]

    def publish(self, rep: Replica, events: list, resync: bool = False) -> None:
        self.ref_call("publish_events", rep.rid, rep.inc, events, resync)
        try:
            out = self.client.publish_events(rep.rid, rep.inc, events, resync)
        except PrefixIndexError as e:
            assert self.down is not None and set(e.shards_failed) == {self.down}, (self.seed, e)
            return
        assert not out.resync_shards, (self.seed, out)
        assert set(out.failed) <= {self.down}, (self.seed, out.failed)

    # -- events -------------------------------------------------------------------------------

    def register(self, rep: Replica) -> None:
        self.ref_call("register", rep.rid, rep.inc, f"10.0.0.{rep.rid[1:]}:1", rep.model, BS)
        got = self.client.register(rep.rid, rep.inc, f"10.0.0.{rep.rid[1:]}:1", rep.model, BS)
        up = [a for a in self.addrs if a != self.down]
        assert sorted(got.next_seq) == sorted(up), (self.seed, got)
        if self.down:
            self.unsynced.setdefault(self.down, set()).add(rep.rid)

    def step(self) -> None:
        rng = self.rng
        self.steps += 1
        rep = rng.choice(self.replicas)
        x = rng.random()
        if x < 0.45:  # store blocks of a chain from where the replica's hold ends (or not)
            toks, salt = self.chain(rng)
            have = rep.held_prefix(toks, salt)
            n = len(toks) // BS
            if have >= n:
                return
            start = have if rng.random() < 0.9 else rng.randint(0, have)
            end = rng.randint(start + 1, n)
            self.publish(rep, [rep.stored(toks, salt, start, end)])
        elif x < 0.6 and rep.blocks:
            key = rng.choice(sorted(rep.blocks))
            self.publish(rep, [rep.removed(key)])
        elif x < 0.63:
            rep.blocks.clear()
            self.publish(rep, [prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared())])
        elif x < 0.68:  # a full resync to every shard
            if self.down is None:
                self.publish(rep, rep.snapshot(rng), resync=True)
        elif x < 0.70:  # a restarted replica: new incarnation, nothing held
            rep.inc_n += 1
            rep.blocks.clear()
            self.register(rep)
        elif x < 0.8:
            load = prefix_pb2.ReplicaLoad(running=rng.randint(0, 3), waiting=rng.randint(0, 1))
            self.ref_call("heartbeat", rep.rid, rep.inc, load)
            got = self.client.heartbeat_shards(rep.rid, rep.inc, load)
            assert set(got) == {a for a in self.addrs if a != self.down}, (self.seed, got)
            assert all(r.known for r in got.values()), (self.seed, got)
        elif x < 0.84 and len(self.shards) > 1:
            if self.down is None and not self.restarted:
                self.stop_shard(rng.choice(self.addrs))
            elif self.down is not None:
                self.restart_shard()
        self.check_matches(probe=rng.random() < 0.5)
        if self.steps % 4 == 0:
            self.check_top()
            self.check_stats()

    def stop_shard(self, address: str) -> None:
        i = self.addrs.index(address)
        self.shards[i][1].stop(0)
        self.down = address

    def restart_shard(self) -> None:
        """Started again empty on its port; every replica registers there and resyncs it."""
        a = self.down
        assert a is not None
        i = self.addrs.index(a)
        port = int(a.rsplit(":", 1)[1])
        self.shards[i] = start_index(port)
        self.down = None
        self.restarted = True
        self.rebuild_reference(a)
        rep0 = self.replicas[0]

        def answers() -> bool:
            try:
                got = self.client.heartbeat_shards(rep0.rid, rep0.inc, only=[a], timeout=1.0)
            except PrefixIndexError:
                return False
            return not got[a].known  # forgot everyone

        wait_until(answers, 15.0)
        self.unsynced[a] = {r.rid for r in self.replicas}
        self.no_loads = a
        order = list(self.replicas)
        self.rng.shuffle(order)
        for k, rep in enumerate(order):
            if k == 1:
                self.check_matches(probe=True)  # some resynced, some not yet
            got = self.client.register(rep.rid, rep.inc, f"10.0.0.{rep.rid[1:]}:1", rep.model,
                                       BS, only=[a])
            assert list(got.next_seq) == [a]
            out = self.client.publish_events(rep.rid, rep.inc, rep.snapshot(self.rng),
                                             resync=True, only=[a])
            assert list(out.sent) == [a] and not out.failed and not out.resync, out
            self.unsynced[a].discard(rep.rid)
        # Loads as the reference knows them (the shard got no heartbeat yet).
        for rep in self.replicas:
            load = prefix_pb2.ReplicaLoad(running=self.rng.randint(0, 3))
            self.ref_call("heartbeat", rep.rid, rep.inc, load)
            self.client.heartbeat(rep.rid, rep.inc, load)
        self.no_loads = None

    # -- checks -------------------------------------------------------------------------------

    def check_matches(self, probe: bool) -> None:
        rng = self.rng
        for _ in range(3):
            model = rng.choice(MODELS)
            toks, salt = self.chain(rng)
            cut = rng.choice([len(toks), len(toks) - rng.randint(0, len(toks)),
                              len(toks) + rng.randint(1, BS - 1)])
            toks = (toks + [7] * BS)[:cut]
            by_hash = rng.random() < 0.4 and len(toks) >= BS
            kw = dict(block_hashes=hashes(model, toks, salt)) if by_hash else \
                dict(token_ids=toks, cache_salt=salt)
            if not toks:
                continue
            owner = self.owner(model, toks, salt)
            if owner == self.down:
                with pytest.raises(PrefixIndexError) as e:
                    self.client.match(model, probe=probe, **kw)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert e.value.address == owner
                continue
            want = match_view(self.ref_call("match", model, probe=probe, _owner=owner, **kw))
            got = match_view(self.client.match(model, probe=probe, **kw))
            missing = self.unsynced.get(owner, set())
            if missing:
                want = (want[0], want[1], [m for m in want[2] if m[0] not in missing])
            if owner == self.no_loads:  # registered again, no heartbeat yet: loads 0
                assert [m[2] for m in got[2]] == sorted((m[2] for m in got[2]), reverse=True)
                got = (got[0], got[1], sorted(m[:4] for m in got[2]))
                want = (want[0], want[1], sorted(m[:4] for m in want[2]))
            assert got == want, (self.seed, self.steps, model, salt, kw, got, want)

    def check_top(self) -> None:
        rng = self.rng
        k = rng.randint(1, 8)
        model = rng.choice(("",) + MODELS)
        min_hits = rng.randint(0, 2)
        salt = rng.choice((None,) + SALTS)
        ref = [prefix_view(p) for p in self.ref.top_prefixes(
            1000, model, min_hits, cache_salt=salt).prefixes]
        if self.down is not None:
            with pytest.raises(PrefixIndexError):
                self.client.top_prefixes(k, model, min_hits, cache_salt=salt)
            ref = [p for p in ref if self.owner(p[4], list(p[0]), p[3]) != self.down]
        got = [prefix_view(p) for p in self.client.top_prefixes(
            k, model, min_hits, cache_salt=salt, allow_partial=self.down is not None).prefixes]
        want = ref[:k]
        assert [p[1] for p in got] == [p[1] for p in want], (self.seed, self.steps, got, want)
        if got:
            last = got[-1][1]
            assert sorted(p for p in got if p[1] > last) == \
                sorted(p for p in want if p[1] > last), (self.seed, got, want)
            tied = {p for p in ref if p[1] == last}
            assert all(p in tied for p in got if p[1] == last), (self.seed, got, ref)
        # Ties: longer first (the client's merge order).
        assert got == sorted(got, key=lambda p: (-p[1], -len(p[0]))), (self.seed, got)

    def check_stats(self) -> None:
        ref = self.ref.stats()
        if self.down is not None:
            with pytest.raises(PrefixIndexError):
                self.client.stats()
        got = self.client.stats(allow_partial=self.down is not None)
        assert (got.shards_total, got.shards_answered) == (
            len(self.addrs), len(self.addrs) - (self.down is not None)), (self.seed, got)
        ref_held = {r.replica_id: r.held_blocks for r in ref.replicas}
        # The replicas' own view agrees with the reference (the driver's sanity).
        assert ref_held == {r.rid: len(r.blocks) for r in self.replicas}, (self.seed, ref_held)
        want = dict(ref_held)
        if self.down is not None:
            for r in self.replicas:
                want[r.rid] -= sum(self.client.shard_for(f) == self.down
                                   for (_, _, f, _, _) in r.blocks.values())
        assert {r.replica_id: r.held_blocks for r in got.replicas} == want, (
            self.seed, self.steps, got.replicas, want)
        if self.down is None:
            assert got.nodes == ref.nodes, (self.seed, self.steps, got.nodes, ref.nodes)
            assert [r.replica_id for r in got.replicas] == [r.replica_id for r in ref.replicas]
        if not self.restarted and self.down is None:
            for f in ("matches_total", "matches_hit", "match_blocks_total",
                      "match_blocks_hit", "dropped_blocks_total"):
                assert getattr(got, f) == getattr(ref, f), (self.seed, f, got, ref)

    def final_checks(self) -> None:
        if self.down is not None:
            self.restart_shard()
        for ix, _ in self.shards:
            ix.check_integrity()
        self.check_top()
        self.check_stats()


def run_seed(seed: int, steps: int = 60) -> int:
    n_shards = random.Random(seed * 7919).randint(2, 4)
    run = Run(seed, n_shards)
    try:
        for rep in run.replicas:
            run.register(rep)
        for _ in range(steps):
            run.step()
        run.final_checks()
        return run.steps
    finally:
        run.close()


@pytest.mark.parametrize("seed", range(6))
def test_sharded_client_answers_as_one_index(seed: int) -> None:
    """Match, TopPrefixes and Stats over 2-4 shards equal one index fed the same events, a
    shard down answering partially (its chains only missing) and back empty once resynced."""
    run_seed(seed, steps=60)


class _Stalling(PrefixServicer):
    """A real shard that stalls (holds every call until released) while `stalled` is set."""

    def __init__(self, index, stalled: threading.Event, release: threading.Event) -> None:
        super().__init__(index)
        for name in ("Heartbeat", "PublishEvents", "Match", "TopPrefixes", "Stats"):
            real = getattr(self, name)

            def held(request, context, real=real):
                if stalled.is_set():
                    release.wait(10)
                return real(request, context)
            setattr(self, name, held)


def test_an_overloaded_shard_is_left_out_as_a_down_one_is() -> None:
    """A shard that lets calls run out their deadline answers like one down: its chains'
    Matches raise DEADLINE_EXCEEDED naming it, the other shard's equal the reference's, and
    TopPrefixes / Stats with `allow_partial` hold the other shard's part only (marked in
    `shards_answered`); the shard's failure shows in `shard_errors`."""
    stalled, release = threading.Event(), threading.Event()
    slow_index = build_index(PrefixConfig(block_size=BS, lease_seconds=300.0,
                                          hit_half_life_seconds=0.0))
    slow = create_server(service="prefix-shard", address="127.0.0.1:0",
                         services=[(prefix_pb2_grpc.add_PrefixIndexServicer_to_server,
                                    _Stalling(slow_index, stalled, release),
                                    "tiercache.v1.PrefixIndex")])
    slow.set_serving()
    (_, fast), (_, ref_h) = start_index(), start_index()
    addrs = [f"127.0.0.1:{slow.port}", f"127.0.0.1:{fast.port}"]
    client = PrefixIndexClient(addrs, block_size=BS, timeout=5.0)
    ref = PrefixIndexClient([f"127.0.0.1:{ref_h.port}"], block_size=BS, timeout=5.0)
    # Its own deadline, not a shorter one per call (which says nothing of the shard).
    impatient = PrefixIndexClient(addrs, block_size=BS, timeout=0.5)
    rep = Replica("r0", "m")
    try:
        chains: dict[str, list[int]] = {}
        for r in range(40):  # a chain owned by each shard
            toks = [200 + r] * BS + [1] * BS
            chains.setdefault(client.shard_for(hashes("m", toks, "")[0]), toks)
        assert len(chains) == 2
        for c in (client, ref):
            c.register("r0", rep.inc, "10.0.0.0:1", "m", BS)
        evs = [rep.stored(t, "", 0, 2) for t in chains.values()]
        for c in (client, ref):
            c.publish_events("r0", rep.inc, evs)
        for t in chains.values():
            for c in (client, ref):
                c.match("m", token_ids=t)
        stalled.set()
        with pytest.raises(PrefixIndexError) as e:
            impatient.match("m", token_ids=chains[addrs[0]])
        assert (e.value.code(), e.value.address) == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                    addrs[0])
        assert match_view(impatient.match("m", token_ids=chains[addrs[1]], probe=True)) == \
            match_view(ref.match("m", token_ids=chains[addrs[1]], probe=True))
        got = impatient.top_prefixes(10, allow_partial=True)
        want = [p for p in ref.top_prefixes(10).prefixes if list(p.token_ids) != chains[addrs[0]]]
        assert [prefix_view(p) for p in got.prefixes] == [prefix_view(p) for p in want]
        st = impatient.stats(allow_partial=True)
        assert (st.shards_total, st.shards_answered) == (2, 1)
        assert [(r.replica_id, r.held_blocks) for r in st.replicas] == [("r0", 2)]
        assert impatient.shard_errors[addrs[0]].startswith("no answer within")
        assert impatient.shard_errors[addrs[1]] == ""
        with pytest.raises(PrefixIndexError):
            impatient.top_prefixes(10)
    finally:
        release.set()
        client.close()
        impatient.close()
        ref.close()
        for h in (slow, fast, ref_h):
            h.stop(0)
