"""A differential review of the prefix index client (`services.common.prefix_client`) against a
model of its documented behaviour (its docstrings, docs/deploy.md, the prefix.proto comments),
driven over real prefix index servers (`services.prefix.server.serve`) on loopback.

The model, written from the docs:
- shards: the addresses, stripped, in any order and spelling; the ring places by canonical
  address (`ShardRing`, reviewed on its own); none, or one shard twice, is a ValueError;
- routing: a stored chain goes to the shard owning its first block (`first_block_hash`, or
  its own first block at the root; a continuation without it is a ValueError that uses no
  batch number), removals and clears to every shard; Match to the shard owning the first
  block hash (given, or hashed from the first full block of token ids), with no full block to
  the first configured shard; Register, Heartbeat, TopPrefixes and Stats to every shard;
- batch numbers: per (replica, incarnation, shard), from 1, one used by every batch sent
  (a failed one too: the shard then sees a gap), never moved back by a Register or Publish
  answer; an empty ordinary batch is sent nowhere, an empty resync to every shard (or those
  in `only`);
- failures: Register and Heartbeat (every shard) pass over shards that are down; a refusal
  (any code but UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, CANCELLED, UNKNOWN,
  INTERNAL, ABORTED) raises, and so does no shard answering, the first failure in the
  configured order; with `only`, any shard asked failing raises; Stats with allow_partial
  takes a refusal as one more shard that did not answer; PublishEvents reports failed shards
  in `failed` while another applied its batch, and raises when every shard sent to failed,
  `shards_failed` naming each (as for every call failing on all its shards);
- merging: Register's shortest lease and smallest limits said; Heartbeat `known` only when
  every shard answering knows the replica; TopPrefixes the k hottest of all shards' answers,
  the longer first among equally hot; Stats figures summed, a replica's held blocks summed,
  its load the one of the shard that heard from it last, `shards_answered` of `shards_total`;
- shard health (`shard_errors`, `on_outcome`): each call's outcome per shard, "" when it
  answered, "CODE: details" when it failed, nothing for INVALID_ARGUMENT and NOT_FOUND.

And the server side, as prefix.proto and index.py document it (each shard a model of its
replicas: incarnation, address, model, load, next batch number, the blocks it holds):
Register starts or refreshes a lease (a new incarnation drops the old one's blocks, and the
old one is refused FAILED_PRECONDITION from then on); a batch under the expected number is
taken and ignored, over it (not a resync) is answered RESYNC, else applied (a resync first
drops the replica's blocks); a stored block behind a parent the replica does not hold there
is dropped and counted; Match gives every live replica of the model its leading blocks held,
longest first; Stats counts nodes, matches and resyncs per shard.

Seeded random runs: 1-3 shards (shuffled, respelled addresses), 1-3 replicas of two models,
prompts sharing prefixes under two salts; stores, continuations (one of a chain the replica no
longer holds: dropped), leaf removals, clears, resyncs (to all shards or some), heartbeats with
loads (to all, to some, to each in turn 30 ms apart), a publisher's answers to RESYNC and
NOT_FOUND (register again, resync), Matches by hashes and by tokens (probes too, and from a
client listing one shard fewer: a shard-list mismatch in Stats), TopPrefixes, Stats, replica
restarts (new incarnation) and the old incarnation registering again, bad calls (an address
with a space, a malformed hash, an empty Match, k = 0, an unknown replica's batch, a malformed
removal, `only` naming no shard of the client), and shards stopped and started again empty on
their port. Every answer, error (code and address), `shards_failed`, the batch numbers used,
`shard_errors` and `on_outcome` are compared with the model after every step. Placement
follows the ports the servers got, so a seed's run differs a little between runs; a failure
prints the shards and the last calls.

Run offline: 1,300 seeds of 150 steps and 200 of 600 (PREFIX_CLIENT_DIFFERENTIAL_SEEDS,
PREFIX_CLIENT_DIFFERENTIAL_STEPS), on a loaded 2-core host; one false alarm (a Stats 30 ms
slow read the shards' last_seen_s out of order) made the load check allow for Stats' own time.
The default 6 seeds take ~4 s.
Found and fixed (prefix_client.py, guarded in tests/prefix/test_prefix_client_rules.py):
- Register, Heartbeat, TopPrefixes and Stats failing on every shard raised the first shard's
  error with `shards_failed` naming that shard only (PublishEvents named each, as the
  attribute's comment says for every call): a caller could not tell which shards were down;
- `only` that was empty crashed Register and Heartbeat with "min() arg is an empty sequence",
  and an address none of the client's shards was passed over (a resync sent to no shard
  returned as done); both are now a ValueError naming `only`, before any call.
Injected bugs caught: 16 of 16 (removals to one shard, a token Match hashed without its salt,
a failed batch's number reused, batch numbers moved back by a Publish or a Register answer,
`known` when any shard knows, held blocks not summed, the stalest shard's load, shorter
prefixes first among equally hot ones (at the default seeds in most runs: placement decides
whether a tie comes up), the shard list fingerprinted as spelled, a refusal passed over like a
shard down, an empty resync sent nowhere, a continuation without first_block_hash routed by its
own block, `shards_answered` counting every shard, a shard's answer to Stats not recorded as
its health, a Match routed by its last block).
Stop 68: a merged Stats replica's incarnation, address and capacity were the first answering
shard's in the configured order (mid-restart it could show the old incarnation beside the new
one's load); they are now the record of the shard that heard from it last, as its load was.
Left as is: PublishEvents failures are not recorded in `shard_errors` / `on_outcome` (the
publisher does not read them; the orchestrator, which does, never publishes); merged
TopPrefixes are cut to k but not to the index's 1,000,000-token bound (used in-process only);
and which shard heard from
a replica last is read from each shard's last_seen_s at its own Stats, so calls a few ms apart
can be told apart wrongly (the model allows 20 ms and the time Stats took).
"""

from __future__ import annotations

import os
import random
import time
from collections import deque

import grpc
import pytest
from tiercache.v1 import prefix_pb2

from services.common.addresses import ShardRing
from services.common.bootstrap import channel_options
from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient, PrefixIndexError
from services.prefix.config import PrefixConfig
from services.prefix.server import serve

SEEDS = int(os.environ.get("PREFIX_CLIENT_DIFFERENTIAL_SEEDS", "6"))
STEPS = int(os.environ.get("PREFIX_CLIENT_DIFFERENTIAL_STEPS", "150"))
BS = 4
MODELS = ("m", "n")
SALTS = ("", "t")
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED}
UNRECORDED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
OK = "ok"
UNAVAILABLE, INVALID = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND, REFUSED = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION


# -- the model ------------------------------------------------------------------------------

class Prompt:
    def __init__(self, model: str, salt: str, tokens: list[int]) -> None:
        self.model, self.salt, self.tokens = model, salt, tokens
        self.hashes = BlockHasher(model, BS).hashes(tokens, salt)


def random_prompts(rng: random.Random) -> list[Prompt]:
    """Per model and salt, 3 prompts of 1-4 whole blocks, each sharing 0-3 leading blocks of
    one base (so that prefixes are shared, stored under one root, and split)."""
    out = []
    for model in MODELS:
        for salt in SALTS:
            base = [rng.randrange(1, 50_000) for _ in range(4 * BS)]
            for _ in range(3):
                cut = rng.randint(0, 3) * BS
                tail = [rng.randrange(1, 50_000) for _ in range(4 * BS)]
                out.append(Prompt(model, salt, (base[:cut] + tail)[:rng.randint(1, 4) * BS]))
    return out


class Rep:
    """A replica as one shard knows it."""

    def __init__(self, inc: str, address: str, model: str, heard: float) -> None:
        self.inc, self.address, self.model = inc, address, model
        self.load = (0, 0, 0, 0)
        self.next_seq = 1
        self.held: set[bytes] = set()
        self.heard = heard  # when its lease was last renewed here (time.monotonic())


class Shard:
    """A prefix index shard as its docs describe it."""

    def __init__(self) -> None:
        self.reps: dict[str, Rep] = {}
        self.replaced: set[tuple[str, str]] = set()
        self.matches = [0, 0, 0, 0]  # total, hit, blocks total, blocks hit
        self.resyncs = 0
        self.dropped = 0
        self.mismatches = 0  # Matches routed by another shard list (op_foreign_match)

    def register(self, rid, inc, address, model, now):
        if (rid, inc) in self.replaced:
            return REFUSED
        rep = self.reps.get(rid)
        if rep is not None and rep.inc == inc and rep.model == model:
            rep.address = address
        else:
            if rep is not None and rep.inc != inc:
                self.replaced.add((rid, rep.inc))
            rep = self.reps[rid] = Rep(inc, address, model, now)
        rep.heard = now
        return rep.next_seq

    def heartbeat(self, rid, inc, load, now):
        rep = self.reps.get(rid)
        if rep is None or rep.inc != inc:
            return False
        rep.load, rep.heard = load, now
        return True

    def publish(self, rid, inc, seq, events, resync, now):
        """(status, next_seq) or an error code."""
        rep = self.reps.get(rid)
        if rep is None or rep.inc != inc:
            return NOT_FOUND
        if seq < rep.next_seq:
            rep.heard = now
            return (prefix_pb2.PUBLISH_STATUS_OK, rep.next_seq)
        if not resync and seq > rep.next_seq:
            rep.heard = now
            self.resyncs += 1
            return (prefix_pb2.PUBLISH_STATUS_RESYNC, rep.next_seq)
        if any(e.WhichOneof("event") == "removed"
               and any(len(h) != 16 for h in e.removed.block_hashes) for e in events):
            return INVALID  # nothing applied, the lease not renewed
        rep.heard = now
        if resync:
            rep.held = set()
        for e in events:
            which = e.WhichOneof("event")
            if which == "stored":
                s = e.stored
                if s.parent_hash and s.parent_hash not in rep.held:
                    self.dropped += len(s.block_hashes)
                else:
                    rep.held |= set(s.block_hashes)
            elif which == "removed":
                rep.held -= set(e.removed.block_hashes)
            else:
                rep.held = set()
        rep.next_seq = seq + 1
        return (prefix_pb2.PUBLISH_STATUS_OK, rep.next_seq)

    def match(self, model, hashes, probe):
        got = []
        for rid, rep in self.reps.items():
            if rep.model != model:
                continue
            n = 0
            while n < len(hashes) and hashes[n] in rep.held:
                n += 1
            got.append((rid, rep.address, n, n * BS, rep.load))
        got.sort(key=lambda m: (-m[2], m[0]))
        if not probe:
            best = got[0][2] if got else 0
            self.matches[0] += 1
            self.matches[1] += bool(best)
            self.matches[2] += len(hashes)
            self.matches[3] += best
        return got

    def nodes(self) -> int:
        return len(set().union(*(r.held for r in self.reps.values())))


def fan_out_expect(order, got, allow_partial, refusals_partial=False):
    """The documented rule of a call to several shards: the error raised (address, code), or
    None. `got`: address -> OK or an error code."""
    errs = [(a, got[a]) for a in order if got[a] is not OK]
    answered = [a for a in order if got[a] is OK]
    refused = [e for e in errs if e[1] not in TRANSIENT]
    if refused and not (allow_partial and refusals_partial and answered):
        return refused[0]
    if errs and (not allow_partial or not answered):
        return errs[0]
    return None


def load_pb(t) -> prefix_pb2.ReplicaLoad:
    return prefix_pb2.ReplicaLoad(running=t[0], waiting=t[1], free_blocks=t[2], total_blocks=t[3])


def load_t(pb) -> tuple[int, int, int, int]:
    return (pb.running, pb.waiting, pb.free_blocks, pb.total_blocks)


# -- the run --------------------------------------------------------------------------------

def fast_channel(address: str) -> grpc.Channel:
    """The services' channel, reconnecting within 50 ms (their 500 ms backoff made each shard
    restart here cost ~1 s)."""
    fast = {"grpc.initial_reconnect_backoff_ms": 50, "grpc.min_reconnect_backoff_ms": 50,
            "grpc.max_reconnect_backoff_ms": 100}
    return grpc.insecure_channel(address, options=[
        *((k, v) for k, v in channel_options() if k not in fast), *fast.items()])


def respell(rng: random.Random, address: str) -> str:
    return rng.choice([address, f" {address} ", f"ipv4:{address}", f"dns:///{address}"])


class Run:
    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.n = rng.choice([1, 2, 2, 3, 3])
        self.services = [serve(PrefixConfig(address="127.0.0.1:0", block_size=BS,
                                            lease_seconds=300.0, hit_half_life_seconds=0.0))
                         for _ in range(self.n)]
        self.ports = [s.port for s in self.services]
        given = [respell(rng, f"127.0.0.1:{p}") for p in self.ports]
        rng.shuffle(given)
        self.addrs = [a.strip() for a in given]  # as configured, in order
        self.by_port = {int(a.rsplit(":", 1)[1]): a for a in self.addrs}
        self.c = PrefixIndexClient(given, timeout=5.0, block_size=BS,
                                   channel_factory=fast_channel)
        self.told: list[tuple[str, str]] = []
        self.c.on_outcome = lambda a, said: self.told.append((a, said))
        self.ring = ShardRing(self.addrs)
        self.shards = {a: Shard() for a in self.addrs}
        self.up = {a: True for a in self.addrs}
        self.foreign = PrefixIndexClient(self.addrs[1:] or self.addrs, block_size=BS)
        self.foreign_ring = ShardRing(self.addrs[1:] or self.addrs)
        self.seq: dict[tuple[str, str, str], int] = {}
        self.errors: dict[str, str] = {}
        self.trace: deque = deque(maxlen=8)  # the last calls, printed on a failure
        # Replicas: id -> [incarnation, model, pool (block hashes held), old incarnations].
        self.reps = {f"r{i}": [f"i{seed}-{i}-0", rng.choice(MODELS), set(), []]
                     for i in range(rng.randint(1, 3))}
        self.prompts = random_prompts(rng)
        self.where: dict[bytes, tuple[Prompt, int]] = {}
        self.children: dict[bytes, set[bytes]] = {}
        for p in self.prompts:
            for j, h in enumerate(p.hashes):
                self.where.setdefault(h, (p, j))
                self.children.setdefault(h, set())
                if j:
                    self.children[p.hashes[j - 1]].add(h)

    def close(self) -> None:
        self.c.close()
        self.foreign.close()
        for s in self.services:
            s.stop()

    # -- bookkeeping --------------------------------------------------------------------

    def owner(self, first: bytes) -> str:
        return self.ring.lookup(first) if self.n > 1 else self.addrs[0]

    def outcome(self, address: str, got) -> None:
        """Record a call's outcome as `_outcome` is documented to."""
        if got is OK:
            self.errors[address] = ""
        elif got not in UNRECORDED:
            self.errors[address] = got.name

    def check_health(self, told_from: int) -> None:
        real = {a: s.split(":")[0] if s else "" for a, s in self.c.shard_errors.items()}
        assert real == self.errors, (real, self.errors)
        for a, said in self.told[told_from:]:
            assert said.split(":")[0] == (self.errors[a] or ""), (a, said)

    def raises(self, fn, want):
        """Call `fn`, which the model says fails with `want` = (address, code)."""
        with pytest.raises(PrefixIndexError) as e:
            fn()
        assert (e.value.address, e.value.code()) == want, (e.value, want)
        return e.value

    # -- operations ---------------------------------------------------------------------

    def op_register(self, rid=None, only=None, address=None, inc=None):
        rng = self.rng
        rid = rid or rng.choice(list(self.reps))
        r = self.reps[rid]
        inc = inc or r[0]
        address = address or f"10.0.0.{rid[1:]}:7000"
        asked = self.addrs if only is None else [a for a in self.addrs if a in only]
        got = {}
        for a in asked:
            if not self.up[a]:
                got[a] = UNAVAILABLE
            elif " " in address:
                got[a] = INVALID
            else:
                got[a] = self.shards[a].register(rid, inc, address, r[1], time.monotonic())
        status = {a: (OK if isinstance(v, int) else v) for a, v in got.items()}
        want = fan_out_expect(asked, status, allow_partial=True)
        call = lambda: self.c.register(rid, inc, address, r[1], BS, 64, only=only)  # noqa: E731
        if want:
            err = self.raises(call, want)
            self.all_failed(err, status)
        else:
            out = call()
            answered = {a: v for a, v in got.items() if status[a] is OK}
            assert out.next_seq == answered
            assert out.lease_seconds == 300.0 and out.max_events == 65536
            assert out.max_blocks == 65536
            for a, v in answered.items():
                k = (rid, inc, a)
                self.seq[k] = max(self.seq.get(k, 1), v)
        for a in asked:
            self.outcome(a, status[a])

    def all_failed(self, err: PrefixIndexError, status: dict) -> None:
        """`shards_failed`: each shard's error when every shard asked failed."""
        if all(v is not OK for v in status.values()):
            assert {a: e.code() for a, e in err.shards_failed.items()} == status

    def op_heartbeat(self, rid=None, only=None):
        rng = self.rng
        rid = rid or rng.choice(list(self.reps))
        inc = self.reps[rid][0] if rng.random() < 0.9 or only else rng.choice(self.reps[rid][3] or
                                                                        ["never"])
        load = tuple(rng.randrange(0, 9) for _ in range(4))
        load = (*load[:3], max(load[2], load[3]))  # a pool's load: free <= total
        asked = self.addrs if only is None else [a for a in self.addrs if a in only]
        got = {a: (self.shards[a].heartbeat(rid, inc, load, time.monotonic()) if self.up[a]
                   else UNAVAILABLE) for a in asked}
        status = {a: (OK if isinstance(v, bool) else v) for a, v in got.items()}
        want = fan_out_expect(asked, status, allow_partial=only is None)
        call = lambda: self.c.heartbeat(rid, inc, load_pb(load), only=only)  # noqa: E731
        if want:
            self.all_failed(self.raises(call, want), status)
        else:
            out = call()
            assert out.known == all(v for v in got.values() if isinstance(v, bool))
            assert out.lease_seconds == 300.0
        for a in asked:
            self.outcome(a, status[a])

    def op_split_heartbeats(self):
        """Heartbeats to the shards one at a time, 30 ms apart (time passing between calls,
        not a wait for anything: Stats' readings of shards that heard from a replica closer
        than that can blur), each with another load; then Stats."""
        rid = self.rng.choice(list(self.reps))
        for a in self.rng.sample(self.addrs, self.n):
            time.sleep(0.03)
            self.op_heartbeat(rid, only=[a])
        self.op_stats()

    def _events(self, pool: set[bytes], model: str) -> list[prefix_pb2.KvEvent]:
        """1-3 events of a replica's pool, applied to `pool`."""
        rng = self.rng
        events = []
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            if kind < 0.7:
                p = rng.choice([p for p in self.prompts if p.model == model])
                j = 0
                while j < len(p.hashes) and p.hashes[j] in pool:
                    j += 1
                if j == len(p.hashes):
                    continue
                k = rng.randint(1, min(2, len(p.hashes) - j))
                # Its first block is named, but may go unsaid at the root (it is the chain's
                # own) and, now and then, on a continuation (a ValueError when sharded).
                first = p.hashes[0] if rng.random() < (0.9 if j else 0.7) else b""
                events.append(prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
                    parent_hash=p.hashes[j - 1] if j else b"", block_hashes=p.hashes[j:j + k],
                    token_ids=p.tokens[j * BS:(j + k) * BS], cache_salt=p.salt,
                    first_block_hash=first, start_block=j)))
                pool |= set(p.hashes[j:j + k])
            elif kind < 0.75:
                # A continuation of a chain this replica does not hold (its blocks evicted
                # meanwhile): dropped by the index at the end of the batch if its parent did
                # not come (so the batch ends here), and not added to the pool here.
                p = rng.choice([p for p in self.prompts if p.model == model])
                j = rng.randrange(1, len(p.hashes)) if len(p.hashes) > 1 else 0
                if j and p.hashes[j - 1] not in pool:
                    events.append(prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
                        parent_hash=p.hashes[j - 1], block_hashes=p.hashes[j:j + 1],
                        token_ids=p.tokens[j * BS:(j + 1) * BS], cache_salt=p.salt,
                        first_block_hash=p.hashes[0], start_block=j)))
                    break
            elif kind < 0.97:
                leaves = sorted(h for h in pool if not self.children[h] & pool)
                if leaves:
                    gone = rng.sample(leaves, min(len(leaves), rng.randint(1, 2)))
                    events.append(prefix_pb2.KvEvent(
                        removed=prefix_pb2.BlocksRemoved(block_hashes=gone)))
                    pool -= set(gone)
            else:
                events.append(prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared()))
                pool.clear()
        return events

    def _holdings(self, pool: set[bytes]) -> list[prefix_pb2.KvEvent]:
        out = []
        for h in sorted(pool, key=lambda h: (self.where[h][1], h)):
            p, j = self.where[h]
            out.append(prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
                parent_hash=p.hashes[j - 1] if j else b"", block_hashes=[h],
                token_ids=p.tokens[j * BS:(j + 1) * BS], cache_salt=p.salt,
                first_block_hash=p.hashes[0], start_block=j)))
        return out

    def route(self, events) -> dict[str, list]:
        per: dict[str, list] = {a: [] for a in self.addrs}
        for e in events:
            if e.WhichOneof("event") == "stored":
                s = e.stored
                per[self.owner(s.first_block_hash or s.block_hashes[0])].append(e)
            else:
                for a in self.addrs:
                    per[a].append(e)
        return per

    def op_publish(self, resync=False, only=None, stale=False, bad=False, rid=None):
        """A batch; returns what the replica is told to do next, as its publisher would
        ("register", "resync" or "")."""
        rng = self.rng
        rid = rid or rng.choice(list(self.reps))
        r = self.reps[rid]
        inc = r[0]
        if stale:
            inc = rng.choice(r[3] or ["never"])
            events = [prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared())]
        elif resync:
            events = self._holdings(r[2])
        elif bad:
            events = [prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(
                block_hashes=[b"x" * 15]))]
        else:
            pool = set(r[2])
            events = self._events(pool, r[1])
            if self.n > 1 and any(e.stored.parent_hash and not e.stored.first_block_hash
                                  for e in events):
                with pytest.raises(ValueError, match="first_block_hash"):
                    self.c.publish_events(rid, inc, events)
                return ""
            r[2] = pool
        per = self.route(events)
        sent = {a: evs for a, evs in per.items()
                if (only is None or a in only) and (evs or resync)}
        seqs = {}
        for a in sent:
            k = (rid, inc, a)
            seqs[a] = self.seq.get(k, 1)
            self.seq[k] = seqs[a] + 1
        got = {}
        for a, evs in sent.items():
            got[a] = (self.shards[a].publish(rid, inc, seqs[a], evs, resync, time.monotonic())
                      if self.up[a] else UNAVAILABLE)
        call = lambda: self.c.publish_events(rid, inc, events, resync, only=only)  # noqa: E731
        self.trace.append(("publish", rid, inc, resync, only, seqs, got, events))
        failed = {a: v for a, v in got.items() if not isinstance(v, tuple)}
        if sent and len(failed) == len(sent):
            err = self.raises(call, next(iter(failed.items())))
            assert {a: e.code() for a, e in err.shards_failed.items()} == failed
        else:
            out = call()
            need = [a for a, v in got.items() if isinstance(v, tuple)
                    and v[0] == prefix_pb2.PUBLISH_STATUS_RESYNC]
            assert (out.resync, sorted(out.resync_shards)) == (bool(need), sorted(need))
            assert out.sent == {a: s for a, s in seqs.items() if a not in failed}
            assert {a: e.code() for a, e in out.failed.items()} == failed
        for a, v in got.items():
            if isinstance(v, tuple):
                k = (rid, inc, a)
                self.seq[k] = max(self.seq[k], v[1])
        if stale:
            return ""
        if NOT_FOUND in got.values():
            return "register"
        return "resync" if any(isinstance(v, tuple) and v[0] == prefix_pb2.PUBLISH_STATUS_RESYNC
                               for v in got.values()) else ""

    def op_publish_as_a_publisher(self):
        """A batch, and most times what the publisher does when told: register again
        (NOT_FOUND) and resync."""
        rid = self.rng.choice(list(self.reps))
        need = self.op_publish(rid=rid)
        if need and self.rng.random() < 0.8:
            if need == "register":
                self.op_register(rid)
            self.op_publish(resync=True, rid=rid)

    def op_match(self, bad=False):
        rng = self.rng
        held = set().union(*(r[2] for r in self.reps.values()))
        p = rng.choice([p for p in self.prompts if p.hashes[0] in held and rng.random() < 0.7]
                       or self.prompts)
        model = p.model if rng.random() < 0.9 else rng.choice(MODELS)
        cut = rng.randint(1, len(p.hashes))
        probe = rng.random() < 0.3
        salt = p.salt if rng.random() < 0.9 else rng.choice(SALTS)
        if bad:
            kw = rng.choice([dict(block_hashes=[b"y" * 15]), dict(token_ids=[])])
            hashes = []
            first = kw.get("block_hashes", [None])[0]
        elif rng.random() < 0.5:
            hashes = list(p.hashes[:cut]) + ([b"z" * 16] if rng.random() < 0.3 else [])
            kw = dict(block_hashes=hashes)
            first = hashes[0]
        else:
            tokens = p.tokens[:cut * BS] + [7] * rng.choice([0, 0, 1, BS])
            if rng.random() < 0.15:
                tokens = tokens[:rng.randint(1, BS - 1)]  # no full block
            kw = dict(token_ids=tokens, cache_salt=salt)
            hashes = BlockHasher(model, BS).hashes(tokens, salt)
            first = hashes[0] if hashes else None
        a = self.owner(first) if first else self.addrs[0]
        call = lambda: self.c.match(model, probe=probe, **kw)  # noqa: E731
        self.trace.append(("match", model, kw, probe, a))
        if not self.up[a]:
            self.raises(call, (a, UNAVAILABLE))
            self.outcome(a, UNAVAILABLE)
            return
        if bad:
            self.raises(call, (a, INVALID))
            return
        want = self.shards[a].match(model, hashes, probe)
        out = call()
        real = [(m.replica_id, m.address, m.matched_blocks, m.matched_tokens, load_t(m.load))
                for m in out.matches]
        assert [m[2] for m in real] == sorted((m[2] for m in real), reverse=True)
        assert sorted(real, key=lambda m: (-m[2], m[0])) == want, (real, want)
        assert (out.request_blocks, out.block_size) == (len(hashes), BS)
        self.outcome(a, OK)

    def op_top(self, bad=False):
        rng = self.rng
        k = 0 if bad else rng.randint(1, 10)
        model = rng.choice(["", "", *MODELS])
        salt = rng.choice([None, None, *SALTS])
        allow = rng.random() < 0.5
        req = prefix_pb2.TopPrefixesRequest(k=k, model_id=model)
        if salt is not None:
            req.cache_salt = salt
        status = {a: (OK if self.up[a] and not bad else UNAVAILABLE if not self.up[a]
                      else INVALID) for a in self.addrs}
        want = fan_out_expect(self.addrs, status, allow)
        call = lambda: self.c.top_prefixes(k, model, cache_salt=salt,  # noqa: E731
                                           allow_partial=allow)
        if want:
            self.all_failed(self.raises(call, want), status)
        else:
            union = []
            for a in self.addrs:
                if status[a] is OK:
                    union += list(self.c._shards[a].stub.TopPrefixes(req, timeout=5).prefixes)
            out = call()
            hits = [p.hits for p in out.prefixes]
            assert len(out.prefixes) == min(k, len(union))
            assert hits == sorted(hits, reverse=True)
            for x, y in zip(out.prefixes, out.prefixes[1:], strict=False):
                assert x.hits > y.hits or len(x.token_ids) >= len(y.token_ids)
            rank = sorted(((p.hits, len(p.token_ids)) for p in union), reverse=True)[:k]
            assert [(p.hits, len(p.token_ids)) for p in out.prefixes] == rank
            keys = {p.SerializeToString() for p in union}
            assert all(p.SerializeToString() in keys for p in out.prefixes)
        for a in self.addrs:
            self.outcome(a, status[a])

    def op_stats(self):
        allow = self.rng.random() < 0.6
        status = {a: OK if self.up[a] else UNAVAILABLE for a in self.addrs}
        want = fan_out_expect(self.addrs, status, allow, refusals_partial=True)
        call = lambda: self.c.stats(allow_partial=allow)  # noqa: E731
        if want:
            self.all_failed(self.raises(call, want), status)
        else:
            began = time.monotonic()
            out = self.c.stats(allow_partial=allow)
            took = time.monotonic() - began
            up = [self.shards[a] for a in self.addrs if status[a] is OK]
            assert (out.shards_total, out.shards_answered) == (self.n, len(up))
            assert out.nodes == sum(s.nodes() for s in up)
            assert [out.matches_total, out.matches_hit, out.match_blocks_total,
                    out.match_blocks_hit] == [sum(s.matches[i] for s in up) for i in range(4)]
            assert out.resyncs_total == sum(s.resyncs for s in up)
            assert out.dropped_blocks_total == sum(s.dropped for s in up)
            assert out.block_size == BS
            assert out.shard_list_mismatches_total == sum(s.mismatches for s in up)
            noted = {a for a in self.addrs if status[a] is OK and self.shards[a].mismatches}
            assert {a for a, n in self.c.shard_list_notes.items() if n} & set(
                a for a in self.addrs if status[a] is OK) == noted
            parts = out.shard_list_mismatch.split("; ") if out.shard_list_mismatch else []
            # Each shard's note, prefixed with its address when there are several.
            said = [part.split(": ", 1) for part in parts] if self.n > 1 else [["", part]
                                                                              for part in parts]
            assert sorted(a for a, _ in said) == sorted(noted if self.n > 1 else [""] * len(noted))
            assert all(n.startswith("shard list differs between replicas and orchestrator")
                       for _, n in said)
            want_reps = {}
            for s in up:
                for rid, rep in s.reps.items():
                    w = want_reps.setdefault(rid, [0, {}])
                    w[0] += len(rep.held)
                    w[1].setdefault(rep.heard, set()).add((rep.load, rep.inc, rep.address))
            assert [r.replica_id for r in out.replicas] == sorted(want_reps)
            for r in out.replicas:
                held, loads = want_reps[r.replica_id]
                assert r.held_blocks == held
                # The shard that heard from it last: any heard within 20 ms of the last, and
                # the time Stats took (a shard's last_seen_s is as of its own answer, and the
                # shards answer a little apart: calls closer than that are told apart by
                # chance).
                last = max(loads)
                assert (load_t(r.load), r.incarnation, r.address) in set().union(*(
                    v for t, v in loads.items() if t >= last - 0.02 - took)), (r, loads)
        for a in self.addrs:
            self.outcome(a, status[a])

    def op_bad_only(self):
        """`only` naming no shard, or one that is not the client's: a ValueError saying so,
        before any call (no batch number used, no shard's health touched)."""
        rng = self.rng
        rid = rng.choice(list(self.reps))
        inc, model = self.reps[rid][0], self.reps[rid][1]
        only = rng.choice([[], ["127.0.0.1:1"], [*self.addrs, " x:1"]])
        calls = [lambda: self.c.register(rid, inc, "10.0.0.9:7000", model, BS, only=only),
                 lambda: self.c.heartbeat(rid, inc, only=only),
                 lambda: self.c.heartbeat_shards(rid, inc, only=only, partial=True),
                 lambda: self.c.publish_events(rid, inc, [], resync=True, only=only)]
        with pytest.raises(ValueError, match="^only: "):
            rng.choice(calls)()

    def op_foreign_match(self):
        """A Match by a client listing one shard fewer (the orchestrator's list differing
        from the replicas'): answered as ever, a mismatch counted by the shard it lands on
        when replicas registered there (with the full list), and said in Stats."""
        rng = self.rng
        p = rng.choice(self.prompts)
        a = self.foreign_ring.lookup(p.hashes[0])
        if not self.up[a]:
            return
        want = self.shards[a].match(p.model, p.hashes, probe=True)
        out = self.foreign.match(p.model, block_hashes=p.hashes, probe=True)
        assert sorted((m.replica_id, m.matched_blocks) for m in out.matches) == sorted(
            (m[0], m[2]) for m in want)
        if self.shards[a].reps:
            self.shards[a].mismatches += 1

    def op_restart_replica(self):
        rid = self.rng.choice(list(self.reps))
        r = self.reps[rid]
        r[3].append(r[0])
        r[0] = f"{r[0].rsplit('-', 1)[0]}-{len(r[3])}"
        r[2] = set()
        self.op_register(rid)

    def op_old_incarnation_registers(self):
        rid = self.rng.choice(list(self.reps))
        if self.reps[rid][3]:
            self.op_register(rid, inc=self.rng.choice(self.reps[rid][3]))

    def op_shard(self):
        i = self.rng.randrange(self.n)
        a = self.by_port[self.ports[i]]
        if self.up[a]:
            self.services[i].stop()
            self.up[a] = False
        else:
            self.services[i] = serve(PrefixConfig(
                address=f"127.0.0.1:{self.ports[i]}", block_size=BS, lease_seconds=300.0,
                hit_half_life_seconds=0.0))
            # Its channel reconnects (the client's own, so that its next call finds it up).
            self.c._shards[a].stub.Stats(prefix_pb2.PrefixStatsRequest(), timeout=10,
                                         wait_for_ready=True)
            self.shards[a] = Shard()
            self.up[a] = True
            self.op_heartbeat()  # one shard forgot the replica, the others know it

    def step_once(self) -> None:
        rng = self.rng
        told = len(self.told)
        x = rng.random()
        some = [a for a in self.addrs if rng.random() < 0.5] or [rng.choice(self.addrs)]
        if x < 0.08:
            self.op_register(only=some if rng.random() < 0.3 else None)
        elif x < 0.10:
            self.op_register(address="has space:1")
        elif x < 0.18:
            self.op_heartbeat(only=some if rng.random() < 0.3 else None)
        elif x < 0.43:
            self.op_publish_as_a_publisher()
        elif x < 0.50:
            self.op_publish(resync=True, only=some if rng.random() < 0.3 else None)
        elif x < 0.52:
            self.op_publish(stale=True)
        elif x < 0.54:
            self.op_publish(bad=True)
        elif x < 0.72:
            self.op_match()
        elif x < 0.74:
            self.op_match(bad=True)
        elif x < 0.82:
            self.op_top(bad=rng.random() < 0.15)
        elif x < 0.89:
            self.op_stats()
        elif x < 0.90 and self.n > 1:
            self.op_foreign_match()
        elif x < 0.905:
            self.op_bad_only()
        elif x < 0.92:
            self.op_restart_replica()
        elif x < 0.93:
            self.op_old_incarnation_registers()
        elif x < 0.95 and self.n > 1:
            self.op_split_heartbeats()
        elif self.n > 1 or x < 0.96:
            self.op_shard()
        self.check_health(told)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_client_matches_its_documented_model(seed):
    run_seed(seed)


def test_addresses_are_stripped_respelled_and_refused_when_none_or_twice():
    """The shards as the docs say: stripped, in any order and canonical spelling alike (the
    same ring and shard list), none or one shard twice refused at once."""
    rng = random.Random(7)
    for _ in range(200):
        ports = rng.sample(range(1000, 2000), rng.randint(1, 4))
        plain = [f"127.0.0.1:{p}" for p in ports]
        other = [respell(rng, a) for a in plain]
        rng.shuffle(other)
        a = PrefixIndexClient(plain, channel_factory=lambda _: _Chan())
        b = PrefixIndexClient([*other, "  "], channel_factory=lambda _: _Chan())
        assert a.shard_list == b.shard_list
        assert b.addresses == [o.strip() for o in other]
        def port(x):
            return int(x.rsplit(":", 1)[1])

        for _ in range(20):
            h = rng.randbytes(16)
            assert port(a.shard_for(h)) == port(b.shard_for(h))
        with pytest.raises(ValueError, match="duplicate"):
            PrefixIndexClient([*plain, respell(rng, rng.choice(plain))],
                              channel_factory=lambda _: _Chan())
    with pytest.raises(ValueError, match="at least one"):
        PrefixIndexClient([" ", ""], channel_factory=lambda _: _Chan())


class _Chan:
    def unary_unary(self, *a, **k):
        return None

    def close(self):
        pass


def run_seed(seed: int) -> None:
    """One seeded run; on a failure, the last calls and the shards' addresses are printed
    (placement follows the ports the servers got, so a seed's run differs between runs)."""
    run = Run(seed)
    try:
        for r in run.reps:
            run.op_register(r)
        for _ in range(STEPS):
            run.step_once()
    except BaseException:
        print("shards", run.addrs, "up", run.up)
        for t in run.trace:
            print(t)
        raise
    finally:
        run.close()
