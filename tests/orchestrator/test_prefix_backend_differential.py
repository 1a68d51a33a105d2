"""A differential review of the orchestrator's prefix index backend
(`services.orchestrator.prefix_backend.PrefixBackend`) against a model of its documented
behaviour: its docstrings, the client's (`services.common.prefix_client`) where it hands a
call on, HungBackoff's, docs/deploy.md and docs/reliability.md (a sharded tier's lines, a hung
shard skipped), the proto comments (DependencyHealth, MatchResponse, the orchestrator's
Stats) and the way pipeline.py and server.py call it. Real prefix index shards
(`services.prefix.server.serve`) answer over loopback gRPC; only HungBackoff's clock is the
test's own (so a back-off is stepped, not slept).

The model, written from those docs:
- `match`: the shard owning the first block hash is asked (one shard: that one); the answer is
  replica -> matched tokens (matched_blocks * block_size) for the replicas of the model that
  hold at least the first block, longest first aside (a map); a shard that let a Match run out
  the tier's whole timeout (not a shorter one the request gave: `cut_short`) is skipped,
  UNAVAILABLE, for 0.5 s, doubling to at most 5 s while it stays hung; after the pause one
  call probes it (an answer clears the record, an error other than a deadline clears it, a
  deadline of the request's own or a cancelled call passes the probe on); a call cancelled
  by its request (`on_call`) raises grpc.FutureCancelledError and says nothing of the shard;
- `top_prefixes`: every shard asked (k, model, min_hits, cache_salt as given), the k hottest
  of those that answered; a refusal (k = 0) raises, and so does no shard answering;
- `stats(timeout)`: every shard, waiting at most min(timeout, the tier's timeout); the shards
  that answered are summed (`shards_answered` of `shards_total`); raises only when none did;
  a shard that answered is no longer skipped as hung (its back-off ends), whether or not
  the others answered;
- health (`dependencies`, the gauge tiercache_orchestrator_dependency_healthy): one shard:
  the tier's line ("prefix") is its last counted call's outcome; several: a "prefix shard"
  line each ("no call yet" before its first), the tier's line healthy only when every
  shard's is, else "k of n shards unhealthy: a, b"; each gauge absent until the first counted
  call (the sharded tier's own none). Not counted: a deadline the request's own shorter
  timeout ran into, a call cancelled by its request, a shard skipped while hung, and a
  caller's bad request (INVALID_ARGUMENT, NOT_FOUND: "Not a caller's bad request ... (as for
  the tier's health)", the client's `_outcome`); a shard that said in its last Stats that
  replicas registered with another shard list than our Matches reads unhealthy, saying so.

Seeded random runs: 1-3 shards in shuffled order; 1-3 replicas of two models storing chains
of prompts that share prefixes under two salts (a kvpool-side client), clearing and dropping
leaves; in some runs one more replica registered with another shard list (a mismatch every
Match there notes); Matches (whole, with a junk block after, probes, another model, a
malformed hash or no model, with `on_call`, cancelled by it); TopPrefixes (k = 0 too);
Stats with no, a long or a short timeout; a shard's next Match, TopPrefixes or Stats made to
hang inside its index (released once the caller gave up), under the tier's timeout or a
shorter one; shards stopped and started again empty on their port; the back-off clock
stepped. Every answer, error (code, shard), `dependencies()` line and gauge is compared with
the model after every step.

Run offline: 300 seeds of 60 steps and 40 of 250 with the tier's timeout at 0.4 s, then 200 of
80 and 30 of 300 as it is (PREFIXBACKEND_DIFFERENTIAL_SEEDS, PREFIXBACKEND_DIFFERENTIAL_STEPS),
on a loaded 2-core host; one false alarm (a shard's own pick among equally hot prefixes: the
model had the longest of all shards win ties) made the TopPrefixes check compare hits, and
order only within the answer. Every fourth seed is alike in shape (one shard with a replica
of another list, two, three with one, one), so the default 4 seeds (~4.5 s) see each.
Found and fixed (prefix_backend.py, guarded in tests/orchestrator/test_prefix_backend_rules.py):
- one index's record (its Stats line "prefix", its gauge) was failed by a caller's bad request
  (a Match with a malformed hash, a TopPrefixes with k = 0: INVALID_ARGUMENT), though a
  shard's record skips it ("as for the tier's health", the client's `_outcome`) and the
  semantic tier's does: the same index sharded read healthy (the first seed, at once);
- the health named the shards as configured, not as the client dials them: a padded address
  (" a:1", which the settings' check lets through) was a shard whose gauge was never set
  (`on_outcome` names "a:1"), and one index listed with a blank entry ("a:1,") was exported
  as a shard, its own "prefix" gauge never set, its line's address "a:1,".
Injected bugs caught: 19 of 19 at 16 seeds (each by the seventh), 16-18 of them by the
default 4 (placement follows the ports the shards got, so a run differs a little): replicas
with no block matched kept, matched blocks for tokens, the hung record keyed by the first
shard, a request's short deadline held against the index, a bad request held against it
again, Stats not capped at the tier's timeout, Stats or TopPrefixes not partial, min_hits or
cache_salt not passed, a shard never called healthy, a shard's or the one index's shard-list
note dropped, the tier's line from its last call, a shard's outcome inverted, `probe` or
`on_call` not passed, "prefix shard" gauges for one index, the back-off probe's timeout the
tier's instead of the request's.
Left as is then: `stats(timeout=0)` and `match(timeout=0)` waited the tier's whole timeout
(the client read 0 as "not given"; server.py asks only with time left, and pipeline's
`_within` gives None past the deadline): stop 69 made 0 a deadline already passed
(`grpc_client.timeout_or`), not run here; one index never called reads unhealthy with no error (a
shard's line says "no call yet"; the semantic tier's one line is the same); TopPrefixes and
Stats are not skipped while a shard is hung (each waits the tier's timeout; Stats is held to
its caller's deadline); which of equally hot prefixes a shard gives is its own choice, so the
merged top k among ties need not be the longest of all (the client orders what came).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import deque

import grpc
import pytest
from tiercache.v1 import prefix_pb2

from services.common.addresses import ShardRing
from services.common.prefix_client import PrefixIndexClient, _Shard
from services.orchestrator.backends import DEPENDENCY_HEALTHY
from services.orchestrator.prefix_backend import PrefixBackend
from services.prefix.config import PrefixConfig
from services.prefix.server import serve
from tests.metric_sample import sample_value
from tests.prefix.test_prefix_client_differential import (  # the client's model, shared
    BS,
    MODELS,
    SALTS,
    fan_out_expect,
    fast_channel,
    random_prompts,
)

SEEDS = int(os.environ.get("PREFIXBACKEND_DIFFERENTIAL_SEEDS", "4"))
STEPS = int(os.environ.get("PREFIXBACKEND_DIFFERENTIAL_STEPS", "80"))
TIMEOUT = 0.3  # the tier's timeout (prefix_timeout_s); under STALL_EVIDENCE_S it is the bar
SHORT = 0.15  # a request's own shorter timeout: its deadline says nothing of the shard
FIRST, MOST = PrefixBackend.HUNG_BACKOFF_S
UNAVAILABLE, INVALID = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
BAD_REQUEST = {INVALID, grpc.StatusCode.NOT_FOUND}
OK = "ok"
NOTE = "shard list differs between replicas and orchestrator"


class Hang:
    """Makes the next call of one of a shard's index methods block inside the servicer's lock
    (as a hung index would) until `finish` releases it."""

    def __init__(self, index) -> None:
        self.lock = threading.Lock()
        self.armed: str | None = None
        self.entered = threading.Event()
        self.release = threading.Event()
        for name in ("match", "top_prefixes", "stats"):
            setattr(index, name, self._wrap(name, getattr(index, name)))

    def _wrap(self, name, orig):
        def hung(*a, **kw):
            with self.lock:
                mine = self.armed == name
                if mine:
                    self.armed = None
                    self.entered.set()
            if mine:
                self.release.wait(30)
            return orig(*a, **kw)
        return hung

    def arm(self, name: str) -> None:
        self.entered.clear()
        self.release.clear()
        self.armed = name

    def finish(self) -> bool:
        """The caller gave up: release the call; whether it reached the index (it then runs
        to its end there before any later call, which waits for the servicer's lock)."""
        self.entered.wait(3.0)
        with self.lock:
            reached = self.entered.is_set()
            self.armed = None
        self.release.set()
        return reached


class ShardModel:
    """A prefix index shard as prefix.proto documents it, as far as the backend reads it."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}  # replica -> blocks held here
        self.models: dict[str, str] = {}  # replica registered here -> model
        self.odd = False  # the replica with another shard list is registered here
        self.matches = 0  # non-probe Matches answered
        self.noted: bool | None = False  # a Match saw the lists differ (None: may have)

    def match(self, model: str, hashes: list[bytes]) -> dict[str, int]:
        out = {}
        for rid, m in self.models.items():
            if m != model:
                continue
            n = 0
            while n < len(hashes) and hashes[n] in self.held.get(rid, ()):
                n += 1
            if n:
                out[rid] = n * BS
        return out

    def saw(self, model: str, certain: bool = True) -> None:
        """A Match of `model` reached the index here: a mismatch noted when the odd replica
        (of MODELS[0]) is named in its answer."""
        if self.odd and model == MODELS[0]:
            self.noted = True if certain else (self.noted or None)


class Run:
    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        # Every fourth seed alike: one shard (with a replica of another list, and without),
        # two, three (with one), so that the default few seeds see each.
        self.n = (1, 2, 3, 1)[seed % 4]
        cfg = dict(block_size=BS, lease_seconds=300.0, hit_half_life_seconds=0.0,
                   metrics_port=-1)
        self.cfg = cfg
        self.services = [serve(PrefixConfig(address="127.0.0.1:0", **cfg))
                         for _ in range(self.n)]
        addrs = [s.address for s in self.services]
        self.port_of = {s.address: s.port for s in self.services}
        rng.shuffle(addrs)
        self.addrs = addrs
        self.svc = {s.address: s for s in self.services}
        self.hangs = {a: Hang(self.svc[a].servicer.index) for a in addrs}
        for a in addrs:  # ports come back between seeds: their series start absent
            for dep in ("prefix", "prefix shard"):
                try:
                    DEPENDENCY_HEALTHY.remove(dep, a)
                except KeyError:
                    pass
        self.now = 1000.0
        # As a configuration may give them (validated, not rewritten): padded, a blank entry
        # after a trailing comma; the clients strip and skip them.
        given = [f" {a} " if rng.random() < 0.2 else a for a in addrs]
        if rng.random() < 0.2:
            given.insert(rng.randint(0, len(given)), rng.choice(["", " "]))
        self.pb = PrefixBackend(tuple(given), "", TIMEOUT, BS, clock=lambda: self.now)
        for a in addrs:  # reconnecting within 50 ms after a restart, not 0.5-1 s
            self.pb.client._shards[a].channel.close()
            self.pb.client._shards[a] = _Shard(a, fast_channel(a))
        self.kv = PrefixIndexClient(addrs, timeout=5.0, block_size=BS,
                                    channel_factory=fast_channel)
        self.odd_client = None
        if seed % 4 in (0, 2):
            # A replica configured with one shard more than the orchestrator.
            self.odd_client = PrefixIndexClient([*addrs, "127.0.0.1:9"], timeout=5.0,
                                                block_size=BS, channel_factory=fast_channel)
        self.ring = ShardRing(addrs)
        self.shards = {a: ShardModel() for a in addrs}
        self.up = {a: True for a in addrs}
        self.reps = {f"r{i}": rng.choice(MODELS) for i in range(rng.randint(1, 3))}
        self.pool: dict[str, set[bytes]] = {r: set() for r in self.reps}
        self.prompts = random_prompts(rng)
        self.children: dict[bytes, set[bytes]] = {}
        for p in self.prompts:
            for j, h in enumerate(p.hashes):
                self.children.setdefault(h, set())
                if j:
                    self.children[p.hashes[j - 1]].add(h)
        # The backend, as the model has it.
        self.errors: dict[str, str | None] = {a: None for a in addrs}  # None: no call yet
        # One shard: the tier's last counted outcome (None: none yet; "": answered; else the
        # failure's code).
        self.single: str | None = None
        self.notes = {a: False for a in addrs}
        self.hung: dict[str, tuple[float, float]] = {}  # address -> (skip until, back-off)
        self.trace: deque = deque(maxlen=10)
        for a in addrs:
            self.join(a)

    def close(self) -> None:
        for h in self.hangs.values():
            h.release.set()
        self.pb.client.close()
        self.kv.close()
        if self.odd_client is not None:
            self.odd_client.close()
        for s in self.services:
            s.stop()

    # -- bookkeeping --------------------------------------------------------------------

    def owner(self, first: bytes) -> str:
        return self.ring.lookup(first) if self.n > 1 else self.addrs[0]

    def join(self, a: str) -> None:
        """Every replica registers on shard `a` (up, empty): the odd one too."""
        for rid, model in self.reps.items():
            self.kv.register(rid, "i", f"10.0.0.{rid[1:]}:7000", model, BS, 64, only=[a])
            # Its batch numbers go on from where they were: an empty resync takes them.
            self.kv.publish_events(rid, "i", [], resync=True, only=[a])
            self.shards[a].models[rid] = model
        if self.odd_client is not None:
            self.odd_client.register("rx", "i", "10.0.0.99:7000", MODELS[0], BS, 64, only=[a])
            self.shards[a].models["rx"] = MODELS[0]
            self.shards[a].odd = True

    def outcome(self, a: str, got, timeout: float | None = None) -> None:
        """A call's outcome on shard `a` as the docs say it counts (see the module docstring);
        `timeout`: the one the call was given (None: the tier's)."""
        if got is not OK:
            if got in BAD_REQUEST:
                return
            if got is DEADLINE and timeout is not None and timeout < min(TIMEOUT, 0.5):
                return
        if self.n == 1:
            self.single = "" if got is OK else got.name
        else:
            self.errors[a] = "" if got is OK else got.name

    # -- operations ---------------------------------------------------------------------

    def op_store(self):
        rng = self.rng
        rid = rng.choice(list(self.reps))
        p = rng.choice([p for p in self.prompts if p.model == self.reps[rid]])
        a = self.owner(p.hashes[0])
        if not self.up[a]:
            return
        k = rng.randint(1, len(p.hashes))
        self.kv.publish_events(rid, "i", [prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
            block_hashes=p.hashes[:k], token_ids=p.tokens[:k * BS], cache_salt=p.salt,
            first_block_hash=p.hashes[0]))])
        self.shards[a].held.setdefault(rid, set()).update(p.hashes[:k])
        self.pool[rid] |= set(p.hashes[:k])

    def op_drop(self):
        """A replica's leaf blocks evicted, or all its blocks cleared (to every shard)."""
        rng = self.rng
        if not all(self.up.values()):
            return
        rid = rng.choice(list(self.reps))
        pool = self.pool[rid]
        leaves = sorted(h for h in pool if not self.children[h] & pool)
        if leaves and rng.random() < 0.85:
            gone = set(rng.sample(leaves, min(len(leaves), rng.randint(1, 2))))
            ev = prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(block_hashes=sorted(gone)))
        else:
            gone = set(pool)
            ev = prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared())
        self.kv.publish_events(rid, "i", [ev])
        pool -= gone
        for s in self.shards.values():
            s.held.get(rid, set()).difference_update(gone)

    def _skip_or_probe(self, a: str, timeout: float) -> tuple[bool, tuple | None]:
        """HungBackoff before a Match on `a`: (skipped, the probe's record or None)."""
        rec = self.hung.get(a)
        if rec is None:
            return False, None
        if self.now < rec[0]:
            return True, None
        self.hung[a] = probe = (self.now + timeout, rec[1])
        return False, probe

    def _after(self, a: str, got, timeout: float | None, probe, cancelled=False) -> None:
        """HungBackoff after a Match on `a` that was not skipped."""
        whole = got is DEADLINE and not (timeout is not None and timeout < min(TIMEOUT, 0.5))
        if got is OK:
            self.hung.pop(a, None)
        elif whole:
            rec = self.hung.get(a)
            back = min(MOST, rec[1] * 2) if rec is not None else FIRST
            self.hung[a] = (self.now + back, back)
        elif probe is not None and (got is DEADLINE or cancelled):
            if self.hung.get(a) == probe:
                self.hung[a] = (self.now, probe[1])
        elif probe is not None:
            self.hung.pop(a, None)

    def op_match(self, kind: str = "plain"):
        rng = self.rng
        held = set().union(*self.pool.values())
        p = rng.choice([p for p in self.prompts if p.hashes[0] in held and rng.random() < 0.7]
                       or self.prompts)
        if self.hung and rng.random() < 0.6:  # back at a shard skipped or due for its probe
            p = rng.choice([p for p in self.prompts if self.owner(p.hashes[0]) in self.hung])
        model = p.model if rng.random() < 0.85 else rng.choice(MODELS)
        hashes = list(p.hashes[:rng.randint(1, len(p.hashes))])
        if rng.random() < 0.2:
            hashes.append(rng.randbytes(16))  # a block nobody holds
        probe = kind == "cancel" or rng.random() < 0.3
        timeout = rng.choice([None, TIMEOUT, SHORT, SHORT] if kind == "hang"
                             else [None, None, TIMEOUT, SHORT])
        bad = None
        if kind == "bad":
            if rng.random() < 0.3:
                model = ""
            else:
                hashes[rng.randrange(len(hashes))] = b"y" * 15
            bad = INVALID
        a = self.owner(hashes[0])
        seen: list = []
        cancelled: list[bool] = []

        def on_call(fut):
            seen.append(fut)
            if kind == "cancel":
                # Once the Match is held in the index: cancelled there, not before it came.
                self.hangs[a].entered.wait(3.0)
                cancelled.append(fut.cancel())

        kw = dict(timeout=timeout, probe=probe)
        if kind in ("cancel", "on_call") or rng.random() < 0.2:
            kw["on_call"] = on_call
        self.trace.append(("match", kind, model, len(hashes), probe, timeout, a))
        if kind == "cancel" and not self.up[a]:
            return  # a cancel racing the refusal: either may come first
        skipped, probe_rec = self._skip_or_probe(a, timeout or TIMEOUT)
        if skipped:
            with pytest.raises(grpc.RpcError) as e:
                self.pb.match(hashes, model, **kw)
            assert e.value.code() == UNAVAILABLE and "hung" in e.value.details(), e.value
            assert not seen  # no call made
            return
        hang = kind in ("hang", "cancel") and self.up[a] and not bad
        if hang:
            self.hangs[a].arm("match")
        if not self.up[a]:
            want = UNAVAILABLE
        elif bad:
            want = bad
        elif kind == "hang":
            want = DEADLINE
        else:
            want = OK
        try:
            if kind == "cancel" and hang:
                with pytest.raises(grpc.FutureCancelledError):
                    self.pb.match(hashes, model, **kw)
                assert cancelled == [True]
                got = None
            elif want is OK:
                out = self.pb.match(hashes, model, **kw)
                assert out == self.shards[a].match(model, hashes), (out, a)
                got = OK
            else:
                with pytest.raises(grpc.RpcError) as e:
                    self.pb.match(hashes, model, **kw)
                assert (getattr(e.value, "address", None), e.value.code()) == (a, want), e.value
                got = want
        finally:
            reached = self.hangs[a].finish() if hang else False
        if "on_call" in kw:
            assert len(seen) == 1 and isinstance(seen[0], grpc.Future)
        s = self.shards[a]
        if got is OK:
            s.matches += not probe
            s.saw(model)
        elif reached:
            s.matches += not probe
            s.saw(model, certain=kind != "cancel")
        elif got is None:
            s.saw(model, certain=False)
        if got is None:  # cancelled by its request: nothing learnt of the shard
            self._after(a, None, timeout, probe_rec, cancelled=True)
            return
        self._after(a, got, timeout, probe_rec)
        self.outcome(a, got, timeout)

    def op_top(self, bad=False, hang=False):
        rng = self.rng
        k = 0 if bad else rng.choice([1, 2, 3, 5, 10, 1000])
        model = rng.choice(["", *MODELS])
        salt = rng.choice([None, *SALTS])
        hung = rng.choice([a for a in self.addrs if self.up[a]] or [None]) if hang else None
        status = {a: (UNAVAILABLE if not self.up[a] else INVALID if bad
                      else DEADLINE if a == hung else OK) for a in self.addrs}
        want = fan_out_expect(self.addrs, status, True)
        # Every prefix of the shards that answer (as many as one call gives), then the
        # documented filters: the model, the salt, at least min_hits hits.
        union = []
        for a in self.addrs:
            if status[a] is OK:
                union += list(self.kv._shards[a].stub.TopPrefixes(
                    prefix_pb2.TopPrefixesRequest(k=1000), timeout=5).prefixes)
        hits = sorted({p.hits for p in union})
        min_hits = rng.choice([0, 0, 1, *hits[-2:], (hits or [0])[-1] + 1])
        union = [p for p in union if (not model or p.model_id == model) and p.hits >= min_hits
                 and (salt is None or p.cache_salt == salt)]
        self.trace.append(("top", k, model, salt, min_hits, hung))
        if hung is not None:
            self.hangs[hung].arm("top_prefixes")
        try:
            if want:
                with pytest.raises(grpc.RpcError) as e:
                    self.pb.top_prefixes(k, model, cache_salt=salt, min_hits=min_hits)
                assert (e.value.address, e.value.code()) == want, (e.value, want)
            else:
                out = self.pb.top_prefixes(k, model, cache_salt=salt, min_hits=min_hits)
                # The k hottest (which of equally hot ones a shard gives is its own choice),
                # the longer first among equally hot ones.
                assert [p.hits for p in out] == sorted((p.hits for p in union),
                                                       reverse=True)[:k]
                ranks = [(p.hits, len(p.token_ids)) for p in out]
                assert ranks == sorted(ranks, reverse=True), ranks
                keys = {p.SerializeToString() for p in union}
                assert all(p.SerializeToString() in keys for p in out)
        finally:
            if hung is not None:
                self.hangs[hung].finish()
        for a in self.addrs:
            self.outcome(a, status[a])

    def op_stats(self, hang=False):
        rng = self.rng
        # Hung: mostly a caller's time past the tier's (which must cap it).
        timeout = rng.choice([None, 10.0, 10.0, SHORT]) if hang else rng.choice([None, 10.0])
        given = None if timeout is None else min(timeout, TIMEOUT)
        hung = rng.choice([a for a in self.addrs if self.up[a]] or [None]) if hang else None
        status = {a: (UNAVAILABLE if not self.up[a] else DEADLINE if a == hung else OK)
                  for a in self.addrs}
        want = fan_out_expect(self.addrs, status, True, refusals_partial=True)
        self.trace.append(("stats", timeout, hung))
        if hung is not None:
            self.hangs[hung].arm("stats")
        began = time.monotonic()
        try:
            if want:
                with pytest.raises(grpc.RpcError) as e:
                    self.pb.stats(timeout=timeout)
                assert (e.value.address, e.value.code()) == want, (e.value, want)
            else:
                out = self.pb.stats(timeout=timeout)
                up = [a for a in self.addrs if status[a] is OK]
                assert (out.shards_total, out.shards_answered) == (self.n, len(up))
                assert out.matches_total == sum(self.shards[a].matches for a in up)
                assert {r.replica_id for r in out.replicas} == set().union(
                    *(self.shards[a].models for a in up))
                for a in up:
                    real = bool(self.pb.client.shard_list_notes.get(a))
                    s = self.shards[a]
                    if s.noted is None:
                        s.noted = real or None
                    else:
                        assert real == s.noted, (a, real)
                    self.notes[a] = real
                assert bool(out.shard_list_mismatch) == any(self.notes[a] for a in up)
                for a in up:  # a shard that answered is not skipped as hung any more
                    self.hung.pop(a, None)
        finally:
            took = time.monotonic() - began
            if hung is not None:
                self.hangs[hung].finish()
        if hung is not None:
            # At most the caller's time, and never past the tier's own.
            assert took < (given or TIMEOUT) + 1.5, took
        for a in self.addrs:
            self.outcome(a, status[a], given)

    def op_shard(self, back=False):
        """A shard stopped, or started again (`back`: one that is down)."""
        down = [i for i in range(self.n) if not self.up[self.services[i].address]]
        i = self.rng.choice(down) if back and down else self.rng.randrange(self.n)
        a = self.services[i].address
        if self.up[a]:
            self.services[i].stop()
            self.up[a] = False
            return
        self.services[i] = s = serve(PrefixConfig(address=f"127.0.0.1:{self.port_of[a]}",
                                                  **self.cfg))
        self.svc[a] = s
        self.hangs[a] = Hang(s.servicer.index)
        # Channels reconnect (the backend's own too, so that its next call finds it up).
        for c in (self.kv, self.pb.client):
            c._shards[a].stub.Stats(prefix_pb2.PrefixStatsRequest(), timeout=10,
                                    wait_for_ready=True)
        self.shards[a] = ShardModel()
        self.up[a] = True
        self.join(a)

    # -- the check ----------------------------------------------------------------------

    def check(self) -> None:
        lines = self.pb.dependencies()
        if self.n == 1:
            a = self.addrs[0]
            [line] = lines
            healthy = self.single == "" and not self.notes[a]
            assert (line.name, line.address, line.healthy) == ("prefix", a, healthy), line
            assert bool(line.last_error) == (bool(self.single) or self.notes[a]), line
            assert (NOTE in line.last_error) == self.notes[a], line
            # Its error is the call's details, a deadline said as how long nobody answered.
            assert line.last_error.startswith("no answer within") == (
                self.single == DEADLINE.name), line
            gauge = None if self.single is None else float(self.single == "")
            assert sample_value("tiercache_orchestrator_dependency_healthy",
                                {"dependency": "prefix", "address": a}) == gauge
            assert sample_value("tiercache_orchestrator_dependency_healthy",
                                {"dependency": "prefix shard", "address": a}) is None
            return
        tier, *shards = lines
        assert [(s.name, s.address) for s in shards] == [("prefix shard", a) for a in self.addrs]
        down = []
        for a, line in zip(self.addrs, shards, strict=True):
            err = self.errors[a]
            healthy = err == "" and not self.notes[a]
            assert line.healthy == healthy, (a, line, err)
            if err is None:
                assert line.last_error.startswith("no call yet"), line
            elif err == DEADLINE.name:  # said as how long nobody answered, as unsharded
                assert line.last_error.startswith("no answer within"), line
            elif err:
                assert line.last_error.startswith(f"{err}: "), line
            assert (NOTE in line.last_error) == self.notes[a], line
            if not healthy:
                down.append(a)
            gauge = None if err is None else float(err == "")
            assert sample_value("tiercache_orchestrator_dependency_healthy",
                                {"dependency": "prefix shard", "address": a}) == gauge, a
        assert (tier.name, tier.address) == ("prefix", ",".join(self.addrs))
        assert tier.healthy == (not down), tier
        assert tier.last_error == (f"{len(down)} of {self.n} shards unhealthy: "
                                   f"{', '.join(down)}" if down else ""), tier
        assert sample_value("tiercache_orchestrator_dependency_healthy",
                            {"dependency": "prefix", "address": ",".join(self.addrs)}) is None

    def step_once(self) -> None:
        rng = self.rng
        x = rng.random()
        if x < 0.20:
            self.op_store()
        elif x < 0.25:
            self.op_drop()
        elif x < 0.45:
            self.op_match()
        elif x < 0.49:
            self.op_match("bad")
        elif x < 0.52:
            self.op_match("on_call")
        elif x < 0.55:
            self.op_match("cancel")
        elif x < 0.60:
            self.op_match("hang")
        elif x < 0.70:
            self.op_top(bad=rng.random() < 0.15)
        elif x < 0.71:
            self.op_top(hang=True)
        elif x < 0.77:
            self.op_stats()
        elif x < 0.79:
            self.op_stats(hang=True)
        elif x < 0.91:
            self.now += rng.choice([0.1, 0.3, 0.5, 1.0, 2.0, 6.0])
        elif not all(self.up.values()) and rng.random() < 0.5:
            self.op_shard(back=True)  # a shard is back before long (one shard: half the run)
        else:
            self.op_shard()
        self.check()


def run_seed(seed: int) -> None:
    run = Run(seed)
    try:
        run.check()
        for step in range(STEPS):
            try:
                run.step_once()
            except AssertionError as e:
                raise AssertionError(f"seed {seed} step {step}, {run.n} shards {run.addrs}, "
                                     f"last calls {list(run.trace)}: {e}") from e
    finally:
        run.close()


@pytest.mark.parametrize("seed", range(SEEDS))
def test_prefix_backend_matches_its_documented_model(seed):
    run_seed(seed)
