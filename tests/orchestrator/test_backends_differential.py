"""A differential review of the orchestrator's backends: seeded random sequences of events are
driven through the real code and through small reference models written from the documented
rules (docs/reliability.md's known gaps on hung replicas and cache tiers, docs/settings.md's
replica settings, the docstrings of `HungBackoff`, `ReplicaSet`, `Health`, `tier_health`), and
every answer and the records Stats shows are compared after each step.

Part 1, a sharded semantic tier (`SemanticBackend` over 1-3 fake shards, its clock a fake
one): calls start, and each ends (an answer, an error, its whole timeout, a deadline of the
request's own shorter than the tier's, a cancellation) while others are under way, each call
on a thread of its own blocked in the fake shard until the harness ends it, so that overlaps
are chosen, not raced. The model's rules:
- a call that ran out its whole timeout (a deadline the request's own time did not cut short:
  `cut_short`, a timeout under min(tier timeout, 0.5 s)) marks its shard hung: skipped
  (UNAVAILABLE, "hung: skipped for another X s", the shard not called) for 0.5 s, doubling up
  to 5 s while it stays hung, and once per stall: a call under way when the shard was marked
  that then times out does not double it again;
- when the pause is over one call probes the shard; the others skip it until that probe ends
  or its own timeout has passed; a probe whose request's own deadline cut it short, or which
  was cancelled, passes the turn on (the next call probes, the back-off kept) unless the record
  is no longer its own; a probe answered, even with an error, ends the skipping; any call
  answered ends it;
- each shard's health line: its last call's outcome (no call yet: unhealthy, "no call yet");
  a skipped, cancelled or cut-short call, an INVALID_ARGUMENT or NOT_FOUND, leaves it as it
  was; the tier's line is healthy only when every shard's is, else "k of n shards unhealthy:
  <addresses>"; with one shard the tier's own record is the line.

Part 2, the replica registry (`ReplicaSet` over 1-4 fake replicas): Stats polls (`poll_once`
on a thread, each replica's answer released by the harness, at once or later, in a chosen
order), our in-flight calls beginning and ending, requests' outcomes on a replica
(`traffic_ok`, `fail`), watchers, `stop`. The model's rules:
- a replica still being asked is not asked again; every answer is applied as it comes;
- an answer of another model or block size, or under a replica id another healthy, polled
  replica already answers by, holds the replica down (out of routing) and reports it lost;
  its figures are not taken;
- otherwise its figures are taken: its id (the address when it gives none), its health line's
  name kvpool/<id>, our in-flight count it holds as ours (the larger of ours when the poll
  began and when it answered), and a new incarnation reports it lost by the id it had;
  stalled_for_s at or past replica_stall_s (not 0) holds it down, reports it lost if it was
  healthy and cancels its in-flight calls (its watchers); else it is healthy again;
- `replica_hung_polls` timed-out polls in a row (an answer or a refusal between breaks the
  row) hold it down ("hung: N Stats polls in a row unanswered ..."), report it lost and cancel
  its in-flight calls; any other failed poll holds it down and reports it lost, its calls left
  to finish;
- a request finishing there brings it back unless the poller holds it down; a request failing
  there takes it out of routing until the next answered poll, its error the health line's
  unless the poller holds it down (the poller's reason stands);
- load = our calls in flight + max(0, running + waiting - ours at the poll); routing sees the
  healthy replicas, or every one when none is, less those whose last answer was another
  model or block size (until a poll of theirs fails); max_context is the smallest of theirs.

Run many seeds by hand: `python -m tests.orchestrator.test_backends_differential 300`.
"""

from __future__ import annotations

import random
import sys
import threading
from dataclasses import dataclass, field
from functools import partial

import grpc
import pytest
from tiercache.v1 import kvpool_pb2, semantic_pb2

from services.orchestrator import backends
from services.orchestrator.backends import ReplicaSet, SemanticBackend
from tests import waits
from tests.clock import Clock
from tests.metric_sample import sample_value

WAIT_S = 10.0  # a bound on waiting for a call's thread: it never decides an outcome
FIRST, MOST = SemanticBackend.HUNG_BACKOFF_S


class Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__()
        self._code, self._details = code, details or code.name.lower()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


wait_until = partial(waits.wait_until, timeout=WAIT_S, every=0.0002)


class Held:
    """One call blocked in a fake server until the harness says how it ends."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.go = threading.Event()
        self.outcome: tuple[str, object] | None = None

    def end(self, kind: str, value: object = None) -> None:
        self.outcome = (kind, value)
        self.go.set()

    def finish(self):
        if not self.go.wait(WAIT_S):
            raise AssertionError("the harness never ended a call")
        kind, value = self.outcome
        if kind == "answer":
            return value
        if kind == "cancel":
            raise grpc.FutureCancelledError()
        raise value


# ------------------------------------------------------------------ part 1: the semantic tier

class FakeFuture:
    def __init__(self, held: Held) -> None:
        self.held = held

    def result(self, timeout=None):
        return self.held.finish()

    def cancel(self) -> bool:
        return True


class FakeMethod:
    """A shard's Lookup: called plainly, or as a future (a call the request can cancel)."""

    def __init__(self, on_enter) -> None:
        self.on_enter = on_enter

    def __call__(self, req, timeout=None, metadata=None):
        held = Held(timeout)
        self.on_enter(held)
        return held.finish()

    def future(self, req, timeout=None, metadata=None):
        held = Held(timeout)
        self.on_enter(held)
        return FakeFuture(held)


class FakeShard:
    def __init__(self, on_enter) -> None:
        self.Lookup = FakeMethod(on_enter)  # noqa: N815 - the gRPC method's name


@dataclass
class Rec:
    """The model's hung record of a shard: skipped until `until`; `probe` is the call that
    holds it as its probe (None: nobody)."""

    until: float
    back: float
    probe: int | None = None


@dataclass
class ShardModel:
    rec: Rec | None = None
    mark_seq: int = -1  # the step at which a timeout last marked it
    healthy: bool = False
    error: str = ""


@dataclass
class SemCall:
    id: int
    address: str
    timeout: float  # the call's own (the request's, else the tier's)
    began: float
    start_seq: int
    cancellable: bool
    probe_rec: Rec | None = None
    held: Held | None = None
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)
    settled: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class SemanticHarness:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        n = rng.choice((1, 1, 2, 3))
        self.tier_timeout = rng.choice((0.3, 1.0, 2.0))
        self.addresses = [f"sem{seed}-{k}:1" for k in range(n)]
        self.clock = Clock(1000.0)
        self.sb = SemanticBackend(",".join(self.addresses), "", self.tier_timeout,
                                  clock=self.clock)
        self.starting: SemCall | None = None
        for a in self.addresses:
            self.sb.stubs[a] = FakeShard(self._entered)
        # A namespace the ring places on each shard.
        self.ns: dict[str, semantic_pb2.Namespace] = {}
        i = 0
        while len(self.ns) < n:
            ns = semantic_pb2.Namespace(tenant="t", model_id="m", context_hash=f"c{i}")
            self.ns.setdefault(self.sb.shard_for(ns), ns)
            i += 1
        self.model = {a: ShardModel() for a in self.addresses}
        self.calls: dict[int, SemCall] = {}
        self.next_id = 0
        self.seq = 0
        self.log: list[str] = []

    def _entered(self, held: Held) -> None:
        call = self.starting
        assert call is not None and call.held is None, "a shard called out of turn"
        call.held = held
        call.settled.set()

    # -- the events

    def start(self) -> None:
        rng = self.rng
        a = rng.choice(self.addresses)
        own = rng.choice((None, None, 0.05, 0.2, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0))
        timeout = own or self.tier_timeout
        if timeout > self.tier_timeout:  # a request's share never exceeds the tier's timeout
            own = timeout = self.tier_timeout
        cancellable = rng.random() < 0.4
        self.seq += 1
        call = SemCall(self.next_id, a, timeout, self.clock.t, self.seq, cancellable)
        self.next_id += 1
        self.log.append(f"t={self.clock.t:.4f} start #{call.id} on {a} timeout={own} "
                        f"cancellable={cancellable}")
        req = semantic_pb2.LookupRequest(namespace=self.ns[a])

        def run() -> None:
            try:
                call.result = self.sb.lookup(req, own,
                                             (lambda f: None) if cancellable else None)
            except BaseException as e:  # noqa: BLE001 - compared with the model's
                call.error = e
            finally:
                call.done.set()
                call.settled.set()

        self.starting = call
        call.thread = threading.Thread(target=run, daemon=True)
        call.thread.start()
        if not call.settled.wait(WAIT_S):
            raise AssertionError("a call neither reached its shard nor returned")
        self.starting = None
        # The model.
        m = self.model[a]
        if m.rec is not None and self.clock.t < m.rec.until:
            left = m.rec.until - self.clock.t
            call.done.wait(WAIT_S)
            e = call.error
            assert call.held is None, f"#{call.id}: a skipped shard was called"
            assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE, e
            assert e.details() == f"semantic shard {a} hung: skipped for another {left:.1f}s", \
                e.details()
            return
        assert call.held is not None, f"#{call.id}: not called though not skipped: {call.error!r}"
        assert call.held.timeout == pytest.approx(timeout)
        if m.rec is not None:  # the pause is over: this call probes
            m.rec = call.probe_rec = Rec(self.clock.t + timeout, m.rec.back, call.id)
        self.calls[call.id] = call

    def end(self, call: SemCall, kind: str) -> None:
        """End `call` now: "answer", "error:<CODE>", "deadline" (its own timeout ran out; the
        clock is at its end or past it), "cancel"."""
        if kind == "deadline" and self.clock.t > call.began + call.timeout:
            # Seen late: a moment after whatever else the clock reads now (a real clock's
            # readings on two threads are never equal).
            self.clock.t += self.rng.uniform(1e-6, 1e-4)
        self.seq += 1
        m = self.model[call.address]
        self.log.append(f"t={self.clock.t:.4f} end #{call.id} {kind}")
        if kind == "answer":
            call.held.end("answer", semantic_pb2.LookupResponse(hit=False))
        elif kind == "cancel":
            call.held.end("cancel")
        elif kind == "deadline":
            call.held.end("error", Err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        else:
            code = getattr(grpc.StatusCode, kind.split(":")[1])
            call.held.end("error", Err(code, f"{code.name.lower()} from the shard"))
        if not call.done.wait(WAIT_S):
            raise AssertionError("a call did not return once ended")
        del self.calls[call.id]
        # The model.
        now = self.clock.t
        cut = call.timeout < min(self.tier_timeout, 0.5)
        if kind == "answer":
            assert call.error is None, call.error
            m.rec = None
            m.healthy, m.error = True, ""
            return
        if kind == "cancel":
            assert isinstance(call.error, grpc.FutureCancelledError), call.error
            if call.probe_rec is not None and m.rec is call.probe_rec:
                m.rec = Rec(now, m.rec.back)
            return
        e = call.error
        assert isinstance(e, grpc.RpcError), e
        if kind == "deadline":
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if cut:
                if call.probe_rec is not None and m.rec is call.probe_rec:
                    m.rec = Rec(now, m.rec.back)
                return
            m.healthy, m.error = False, f"no answer within {call.timeout:g}s (timed out)"
            if m.rec is None:
                m.rec = Rec(now + FIRST, FIRST)
                m.mark_seq = self.seq
            elif m.mark_seq < call.start_seq:  # not under way when it was last marked
                back = min(MOST, m.rec.back * 2)
                m.rec = Rec(now + back, back)
                m.mark_seq = self.seq
            return
        code = e.code()
        if code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            m.healthy, m.error = False, e.details()
        if call.probe_rec is not None:
            m.rec = None  # the probe got an answer (an error)

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        live = sorted(self.calls.values(), key=lambda c: c.id)
        if r < 0.4 or not live:
            self.start()
        elif r < 0.65:
            call = rng.choice(live)
            kinds = ["answer", "answer", "error:UNAVAILABLE", "error:INVALID_ARGUMENT",
                     "error:NOT_FOUND", "error:RESOURCE_EXHAUSTED"]
            if call.cancellable:
                kinds += ["cancel", "cancel"]
            if self.clock.t >= call.began + call.timeout:  # overdue: it can only time out
                kinds = ["deadline"]
            self.end(call, rng.choice(kinds))
        else:
            # The clock moves on; the calls whose timeout passes meanwhile run out of it at
            # their deadline (now and then one is seen late, as a busy host may).
            dt = rng.choice((0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.3, 2.5, 6.0)) * rng.uniform(0.8, 1.2)
            target = self.clock.t + dt
            for call in sorted(live, key=lambda c: (c.began + c.timeout, c.id)):
                end = call.began + call.timeout
                if end <= target and rng.random() < 0.9:
                    self.clock.t = max(self.clock.t, end)
                    self.end(call, "deadline")
            self.clock.t = max(self.clock.t, target)
            self.log.append(f"t={self.clock.t:.4f} clock")
        self.check()

    # -- the comparison

    def check(self) -> None:
        state = self.sb.hung.state
        for a, m in self.model.items():
            want = None if m.rec is None else (m.rec.until, m.rec.back)
            got = state.get(a)
            assert (got is None) == (want is None), (a, got, want)
            if want is not None:
                assert got == pytest.approx(want), (a, got, want)
        lines = [(d.name, d.address, d.healthy, d.last_error) for d in self.sb.dependencies()]
        if len(self.addresses) == 1:
            m = self.model[self.addresses[0]]
            assert lines == [("semantic", self.addresses[0], m.healthy, m.error)], lines
            return
        shards = [("semantic shard", a, m.healthy,
                   m.error if m.healthy or m.error else "no call yet")
                  for a, m in self.model.items()]
        down = [a for a, m in self.model.items() if not m.healthy]
        tier = ("semantic", ",".join(self.addresses), not down,
                f"{len(down)} of {len(self.addresses)} shards unhealthy: {', '.join(down)}"
                if down else "")
        assert lines == [tier, *shards], lines

    def finish(self) -> None:
        for call in list(self.calls.values()):
            self.clock.t = max(self.clock.t, call.began + call.timeout)
            self.end(call, "deadline")


def run_semantic(seed: int, steps: int) -> None:
    h = SemanticHarness(seed)
    try:
        for _ in range(steps):
            h.step()
        h.finish()
    except BaseException:
        print(f"semantic seed {seed}:\n  " + "\n  ".join(h.log[-40:]), file=sys.stderr)
        raise


# ------------------------------------------------------------- part 2: the replica registry

class FakeReplica:
    def __init__(self, harness: ReplicaHarness, i: int) -> None:
        self.harness, self.i = harness, i

    def Stats(self, req, timeout=None, metadata=None):  # noqa: N802 - the gRPC method's name
        held = Held(timeout)
        self.harness.asked(self.i, held)
        return held.finish()


@dataclass
class ReplicaModel:
    address: str
    alias: str
    replica_id: str
    name: str = "kvpool"
    stats: kvpool_pb2.KvStatsResponse | None = None
    at_poll: int = 0
    inflight: int = 0
    healthy: bool = False
    error: str = ""
    held: bool = False
    touched: bool = False  # its health gauge set
    slow: int = 0
    downs: int = 0
    before: int = 0  # our in-flight count when the poll now asking it began
    asking: bool = False
    # Its "process" as the harness has it: id, incarnation, model, block size.
    own_id: str = ""
    incarnation: str = "a"
    misfit: str = ""  # another model or block size, said by its last answer


class ReplicaHarness:
    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        n = rng.choice((1, 2, 2, 3, 4))
        self.addresses = tuple(f"rep{seed}-{k}:1" for k in range(n))
        self.model_id = rng.choice(("", "m", "m"))
        self.block_size = rng.choice((0, 16, 16))
        self.stall_s = rng.choice((0.0, 30.0, 60.0))
        self.hung_polls = rng.choice((1, 2, 3, 3, 4))
        self.rs = ReplicaSet(addresses=self.addresses, internal_token="",
                             model_id=self.model_id, block_size=self.block_size,
                             stall_s=self.stall_s, stats_timeout_s=0.75,
                             hung_polls=self.hung_polls)
        for k, r in enumerate(self.rs.replicas):
            r.stub = FakeReplica(self, k)
        self.applied: list[int] = []
        real = self.rs._apply_answer

        def spy(i, ours_before, fut):
            self.applied.append(i)
            return real(i, ours_before, fut)

        self.rs._apply_answer = spy
        self.lost: list[str] = []
        self.want_lost: list[str] = []
        self.rs.on_lost.append(self.lost.append)
        self.reps = [ReplicaModel(a, f"kvpool#{k}", a, own_id=f"kv-{k}")
                     for k, a in enumerate(self.addresses)]
        self.held: dict[int, Held] = {}
        self.preset: dict[int, tuple[str, object]] = {}
        self.watchers: list[list] = []  # [replica index, active, calls: list, want calls]
        self.stopped = False
        self.ac_timeout: float | None = None
        self.log: list[str] = []

    def asked(self, i: int, held: Held) -> None:
        assert i not in self.held, f"replica {i} asked again while its Stats is under way"
        assert held.timeout == 0.75
        self.held[i] = held
        if i in self.preset:
            held.end(*self.preset.pop(i))

    def as_completed(self, fs, timeout=None):
        return _as_completed(fs, timeout=timeout if self.ac_timeout is None else self.ac_timeout)

    # -- what a replica answers

    def outcome(self, i: int) -> tuple[str, object]:
        rng, m = self.rng, self.reps[i]
        r = rng.random()
        if r < 0.2:
            return "error", Err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if r < 0.28:
            return "error", Err(grpc.StatusCode.UNAVAILABLE, "draining")
        if rng.random() < 0.08:  # restarted, maybe under another id
            m.incarnation = rng.choice("abcdef")
            m.own_id = rng.choice((m.own_id, f"kv-{rng.randrange(len(self.reps))}", ""))
        stalled = 0.0
        if self.rng.random() < 0.15:
            stalled = rng.choice((10.0, 29.9, 30.0, 45.0, 60.0, 61.0, 300.0))
        s = kvpool_pb2.KvStatsResponse(
            replica_id=m.own_id, incarnation=m.incarnation,
            model_id=rng.choice((self.model_id or "m", self.model_id or "m", "", "other"))
            if rng.random() < 0.15 else (self.model_id or "m"),
            block_size=rng.choice((0, 32)) if rng.random() < 0.1 else (self.block_size or 16),
            running=rng.randrange(4), waiting=rng.randrange(3), stalled_for_s=stalled,
            blocks_free=rng.randrange(100), max_context=rng.choice((0, 512, 1024, 2048)))
        return "answer", s

    # -- the model

    def model_apply(self, i: int, kind: str, value) -> None:
        m = self.reps[i]
        m.asking = False
        if self.stopped:
            return
        after = m.inflight
        if kind == "error":
            e = value
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                m.slow += 1
                if m.slow >= self.hung_polls:
                    # Said as hung: "Deadline Exceeded" alone named no deadline.
                    self.down(m, f"hung: {m.slow} Stats polls in a row unanswered within "
                                 f"0.75s (replica_hung_polls {self.hung_polls})")
                    self.notify_down(m)
            else:
                m.slow = 0
                self.down(m, e.details())
            m.misfit = ""
            return
        s = value
        wrong = ""
        if self.model_id and s.model_id and s.model_id != self.model_id:
            wrong = f"it serves model {s.model_id!r}, this orchestrator {self.model_id!r}"
        elif self.block_size and s.block_size and s.block_size != self.block_size:
            wrong = (f"its KV block size is {s.block_size}, this orchestrator's "
                     f"{self.block_size}")
        elif s.replica_id:
            other = next((o for o in self.reps if o is not m and o.replica_id == s.replica_id
                          and o.stats is not None and o.healthy), None)
            if other is not None:
                wrong = (f"replica id {s.replica_id!r} is also answered by {other.address}: "
                         "give each replica its own TIERCACHE_KVPOOL_REPLICA_ID")
        pub = m.replica_id if m.replica_id != m.address else m.alias
        m.misfit = (f"{s.replica_id or pub}: {wrong}"
                    if wrong.startswith(("it serves model", "its KV block size")) else "")
        if m.misfit and s.replica_id:
            m.name = f"kvpool/{s.replica_id}"  # named by the id it answered with
        if wrong:
            m.slow = 0  # an answer: the row of timed-out polls is broken
            self.down(m, wrong)
            return
        restarted = m.stats is not None and s.incarnation and \
            s.incarnation != m.stats.incarnation
        known = m.replica_id
        m.stats, m.at_poll = s, max(m.before, after)
        m.replica_id = s.replica_id or m.address
        m.name = f"kvpool/{m.replica_id}"
        m.slow = 0
        if restarted:
            self.want_lost.append(known)
        if self.stall_s > 0 and s.stalled_for_s >= self.stall_s:
            was = m.healthy
            why = (f"engine stalled: no step finished for {s.stalled_for_s:.0f}s "
                   f"(replica_stall_s {self.stall_s:g})")
            m.healthy, m.error, m.held, m.touched = False, why, True, True
            if was:
                self.want_lost.append(m.replica_id)
            self.notify_down(m)
            return
        m.healthy, m.error, m.held, m.touched = True, "", False, True

    def down(self, m: ReplicaModel, why: str) -> None:
        m.healthy, m.error, m.held, m.touched = False, why, True, True
        self.want_lost.append(m.replica_id)

    def notify_down(self, m: ReplicaModel) -> None:
        m.downs += 1
        k = self.reps.index(m)
        for w in self.watchers:
            if w[0] == k and w[1]:
                w[3] += 1

    def load(self, m: ReplicaModel) -> int:
        engine = m.stats.running + m.stats.waiting if m.stats is not None else 0
        return m.inflight + max(0, engine - m.at_poll)

    # -- the events

    def poll(self) -> None:
        asked = [] if self.stopped else [k for k, m in enumerate(self.reps) if not m.asking]
        late = {k for k in asked if self.rng.random() < 0.3}
        prompt = [k for k in asked if k not in late]
        if late and len(prompt) > 1:  # answers applied by callbacks at once: one at a time
            late |= set(prompt[1:])
            prompt = prompt[:1]
        self.ac_timeout = 0.0 if late else None
        outcomes = {k: self.outcome(k) for k in prompt}
        self.preset = dict(outcomes)
        for m in self.reps:
            if not m.asking:
                m.before = m.inflight
        for k in asked:
            self.reps[k].asking = True
        said = {k: (o[0], str(o[1]).replace(chr(10), " ")) for k, o in outcomes.items()}
        self.log.append(f"poll asks {asked} late {sorted(late)} {said}")
        del self.applied[:]
        t = threading.Thread(target=self.rs.poll_once, daemon=True)
        t.start()
        t.join(WAIT_S)
        assert not t.is_alive(), "poll_once did not return"
        wait_until(lambda: all(k in self.held for k in asked),
                   what="timed out waiting for the replicas asked")
        for k in prompt:
            wait_until(lambda k=k: k not in self.rs._pending,
                       what=f"timed out waiting for replica {k}'s answer applied")
            del self.held[k]
        assert sorted(self.applied) == sorted(prompt), (self.applied, prompt)
        for k in self.applied:
            self.model_apply(k, *outcomes[k])
        asking = {k for k, m in enumerate(self.reps) if m.asking}
        assert set(self.rs._pending) == asking, (self.rs._pending, asking)

    def release(self, k: int) -> None:
        kind, value = self.outcome(k)
        self.log.append(f"release {k}: {kind} {str(value).replace(chr(10), ' ')}")
        held = self.held.pop(k)
        held.end(kind, value)
        wait_until(lambda: k not in self.rs._pending,
                   what=f"timed out waiting for replica {k}'s late answer applied")
        self.model_apply(k, kind, value)

    def step(self) -> None:
        rng, rs = self.rng, self.rs
        r = rng.random()
        k = rng.randrange(len(self.reps))
        m, real = self.reps[k], self.rs.replicas[k]
        if r < 0.3:
            self.poll()
        elif r < 0.45 and self.held:
            self.release(rng.choice(sorted(self.held)))
        elif r < 0.55:
            self.log.append(f"begin {k}")
            rs.begin(real)
            m.inflight += 1
        elif r < 0.65 and m.inflight:
            self.log.append(f"end {k}")
            rs.end(real)
            m.inflight -= 1
        elif r < 0.72:
            self.log.append(f"traffic_ok {k}")
            real.health.traffic_ok()
            if not m.held:
                m.healthy, m.error, m.touched = True, "", True
        elif r < 0.77:
            self.log.append(f"request failed on {k}")
            real.health.fail("stream lost")
            m.healthy, m.touched = False, True
            if not m.held:  # the poller's reason stands while it holds the replica down
                m.error = "stream lost"
        elif r < 0.85:
            seen = rng.choice((None, m.downs, m.downs, max(0, m.downs - 1)))
            calls: list[int] = []
            w = [k, True, calls, 1 if seen is not None and seen != m.downs else 0]
            self.log.append(f"watch {k} downs_seen={seen}")
            rs.watch(real, lambda calls=calls: calls.append(1), seen)
            w.append(self.rs.replicas[k].watchers)
            self.watchers.append(w)
        elif r < 0.9 and any(w[1] for w in self.watchers):
            w = rng.choice([w for w in self.watchers if w[1]])
            self.log.append(f"unwatch {w[0]}")
            fn = next(f for f in rs.replicas[w[0]].watchers
                      if f.__defaults__[0] is w[2])
            rs.unwatch(rs.replicas[w[0]], fn)
            w[1] = False
        elif r < 0.905 and not self.stopped:
            self.log.append("stop")
            rs.stop()
            self.stopped = True
        self.check()

    # -- the comparison

    def check(self) -> None:

        rs = self.rs
        for m, r in zip(self.reps, rs.replicas, strict=True):
            h = r.health
            got = (h.name, h.healthy, h.last_error, h.held_down, r.replica_id, r.inflight,
                   r.load, r.slow_polls, r.downs, r.public_id)
            pub = m.replica_id if m.replica_id != m.address else m.alias
            want = (m.name, m.healthy, m.error, m.held, m.replica_id, m.inflight, self.load(m),
                    m.slow, m.downs, pub)
            assert got == want, (m.address, got, want)
            gauge = sample_value("tiercache_orchestrator_dependency_healthy",
                                              {"dependency": "kvpool", "address": m.address})
            assert gauge == ((1.0 if m.healthy else 0.0) if m.touched else None), \
                (m.address, gauge)
        healthy = [m for m in self.reps if m.healthy]
        assert [r.address for r in rs.healthy()] == [m.address for m in healthy]
        live = healthy or [m for m in self.reps if not m.misfit]
        want_views = [(m.replica_id, self.load(m), m.stats.blocks_free if m.stats else -1)
                      for m in live]
        assert [tuple(v) for v in rs.views()] == want_views
        sizes = [m.stats.max_context for m in live if m.stats and m.stats.max_context]
        assert rs.max_context() == min(sizes, default=0)
        misfits = rs.misfits()
        if self.reps and all(m.misfit for m in self.reps):
            assert all(m.misfit in misfits for m in self.reps), misfits
        else:
            assert misfits == ""
        for name in {m.replica_id for m in self.reps} | set(self.addresses) | {"nobody"}:
            want_r = next((m for m in self.reps if m.replica_id == name), None) or \
                next((m for m in self.reps if m.address == name), None)
            got_r = rs.by_id(name)
            assert (got_r.address if got_r else None) == (want_r.address if want_r else None)
        assert self.lost == self.want_lost, (self.lost, self.want_lost)
        for w in self.watchers:
            assert len(w[2]) == w[3], (w[0], len(w[2]), w[3])

    def finish(self) -> None:
        for k in sorted(self.held):
            self.release(k)
        self.check()
        self.rs.stop()


_as_completed = backends.as_completed


def run_replicas(seed: int, steps: int) -> None:
    h = ReplicaHarness(seed)
    backends.as_completed = h.as_completed
    try:
        for _ in range(steps):
            h.step()
        h.finish()
    except BaseException:
        print(f"replica seed {seed} (stall_s {h.stall_s}, hung_polls {h.hung_polls}, model "
              f"{h.model_id!r}, block {h.block_size}):\n  " + "\n  ".join(h.log[-30:]),
              file=sys.stderr)
        raise
    finally:
        backends.as_completed = _as_completed
        h.rs.stop()
        for held in list(h.held.values()):
            held.end("error", Err(grpc.StatusCode.CANCELLED))


@pytest.mark.parametrize("seed", range(30))
def test_semantic_shards_follow_the_hung_and_health_rules(seed: int) -> None:
    run_semantic(seed, 300)


@pytest.mark.parametrize("seed", range(12))
def test_the_replica_registry_follows_the_polling_rules(seed: int) -> None:
    run_replicas(seed, 200)


if __name__ == "__main__":
    import logging

    logging.disable(logging.CRITICAL)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    for s in range(n):
        run_semantic(s, 400)
        run_replicas(s, 300)
    print(f"{n} seeds of each: no mismatch")
