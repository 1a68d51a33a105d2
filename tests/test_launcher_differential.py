"""A differential review of `make run`'s supervision (services/launcher.py: `main`, `Stack`,
`ServiceProcess`): seeded random stacks whose children start, fail, hang or ignore SIGTERM,
with stop signals at random moments, against a model of what the docs and docstrings promise.

The model, from the module docstring, README "Two commands", `Stack.stop`'s comment and the
rules tests: children start in dependency order (semantic, prefix, kvpool-0.., orchestrator),
none at all when a port of the stack is taken (the lowest taken one is named), none once a stop
was asked for; a child that exits before it is ready, or never becomes ready within the wait,
fails the start (the first to exit is named, whichever child is being waited for, else the
first never ready in that order; with its exit code and the problem its log quotes); a child
that dies after "TierCache is up" is named too; either failure exits 1, a stop signal that came
before any failure exits 0 ("stopping ..."); exactly one of the two is said, and a failure once
reported is never turned into exit 0. Stopping sends SIGTERM in reverse start order to each
child still running, SIGKILL only to one still running 15 s + its drain setting later, nothing
before the outcome is printed, and when `main` returns every child it started has exited and
been reaped ("stopped" said iff one was started). A second signal, or one during the stop,
changes none of this. Where the docs are silent (which failures a signal racing them reports)
only the exit code's agreement with what was printed is asserted.

`test_fake_stacks` drives the real code over fake children, a virtual clock and a fake health
probe; a signal is delivered at a virtual time (interrupting a sleep or wait), right after the
n-th line printed, or right after the k-th call the launcher makes into the fakes (Popen,
poll, wait, kill, Check, print, signal.signal): points where CPython runs a handler. Also
checked: "TierCache is up" is never said with a child already gone, and a child that dies
after it is noticed (not only at a late signal). `test_real_children` runs stacks of real
`python -c` children (a marker file for health, waits and grace cut to ~1 s, real
SIGINT/SIGTERM to this process from a timer) and checks that no child outlives `main`.

Run: 20,000 fake seeds and 60 real ones. Found (4.4% of fake seeds failed before the fix in
StopSignals, none after): a stop signal handled right after a child's fork, before it was in
`Stack.procs`, left that child out of the stop, running after `main` returned; one as the
stop began (before the signals were ignored) skipped the stop entirely; one while a failure
was reported escaped `main` as KeyboardInterrupt (no exit code), or turned exit 1 into 0
after "service(s) exited"; one between installing the handlers and the start escaped `main`
(test_launcher_rules.py pins each moment). Injected bugs caught (of 2,000 seeds): SIGTERM in
start order 1,845; no SIGKILL after the grace 975; a failed start exiting 0 501; no hold at
the fork 44; no dead check after the start 7; the watch loop waiting for all to die 35.
More seeds: LAUNCHER_DIFFERENTIAL_SEEDS (fake, default 1500), LAUNCHER_DIFFERENTIAL_REAL
(default 4), LAUNCHER_DIFFERENTIAL_FIRST_SEED.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal as _signal
import subprocess as _subprocess
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

import grpc as _grpc
from grpc_health.v1 import health_pb2

from services import launcher

SEEDS = int(os.environ.get("LAUNCHER_DIFFERENTIAL_SEEDS", "1500"))
REAL = int(os.environ.get("LAUNCHER_DIFFERENTIAL_REAL", "4"))
FIRST = int(os.environ.get("LAUNCHER_DIFFERENTIAL_FIRST_SEED", "0"))

STOP_SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT)
WAIT_S = 600.0  # Stack.start's default wait for each child (main passes none)
DEATH_AFTER = 40.0  # virtual: deaths after readiness come once every child is up (<= 7 s)


# ---------------------------------------------------------------------------------------------
# Scenarios


@dataclass
class Child:
    """What one child does: `kind` ok (ready at `ready`), exit (exits at `at` with `code`
    before it is ready), never (never ready), dies (ready, then exits with `code` at `at`);
    `term` seconds to exit after SIGTERM (None: ignores it); `problem`: a line it logs."""

    kind: str
    ready: float = 0.0
    at: float = math.inf
    code: int = 0
    term: float | None = 0.05
    problem: str | None = None


@dataclass
class Scenario:
    replicas: int
    base_port: int
    taken: set[int]
    children: dict[str, Child]
    graces: dict[str, str]  # TIERCACHE_<SVC>_GRACE_SECONDS per service name, when set
    signals: list[tuple[str, float, int]] = field(default_factory=list)  # (mode, when, sig)


def keys(replicas: int) -> list[str]:
    return ["semantic", "prefix", *[f"kvpool-{i}" for i in range(replicas)], "orchestrator"]


def service(key: str) -> str:
    return key.split("-")[0]


def scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    replicas = rng.choice([1, 1, 2, 3])
    base = rng.choice([0, 41000])
    taken: set[int] = set()
    if base and rng.random() < 0.12:
        taken = set(rng.sample(range(base, base + 3 + replicas), rng.choice([1, 1, 2])))
    children = {}
    for k in keys(replicas):
        r = rng.random()
        term = rng.choice([0.0, 0.05, 0.05, 3.0, 30.0, None])
        problem = (f"bad configuration: TIERCACHE_{k.upper()}_X: wrong ({seed})"
                   if rng.random() < 0.5 else None)
        ready = rng.choice([0.0, 0.05, 0.3, 2.0, 7.0])
        if r < 0.78:
            c = Child("ok", ready=ready, term=term)
        elif r < 0.88:
            c = Child("exit", at=rng.choice([0.0, 0.01, 0.3, 3.0]), code=rng.choice(
                [0, 1, 2, 2, -11]), problem=problem)
        elif r < 0.93:
            c = Child("never", term=term)
        else:  # mostly once every child is up; else soon after its own readiness
            at = rng.choice([DEATH_AFTER, DEATH_AFTER + 0.5, DEATH_AFTER + 3.0, ready + 0.1,
                             ready + 1.0])
            c = Child("dies", ready=ready, at=at, code=rng.choice([1, 3, -9]), term=term,
                      problem=problem)
        children[k] = c
    graces = {s: rng.choice(["0", "2", "60"]) for s in launcher.SERVICES if rng.random() < 0.3}
    sc = Scenario(replicas, base, taken, children, graces)
    n = rng.choice([0, 1, 1, 1, 2, 3])
    for _ in range(n):
        sig = rng.choice(STOP_SIGNALS)
        r = rng.random()
        if r < 0.2:  # right after the n-th line printed: the reports, the stop
            sc.signals.append(("print", rng.randrange(1, 12), sig))
        elif r < 0.6:
            sc.signals.append(("time", rng.choice([0.0, 0.01, 0.2, 1.0, 5.0, 8.0, 41.0, 80.0])
                               + rng.random() * 0.5, sig))
        else:
            sc.signals.append(("hook", rng.randrange(1, 90), sig))
    return sc


def failure_free(sc: Scenario) -> bool:
    return not sc.taken and all(c.kind == "ok" for c in sc.children.values())


# ---------------------------------------------------------------------------------------------
# The fakes: a virtual clock, children, health probe, signal table and print


class Hang(AssertionError):
    pass


class ProcessDied(BaseException):
    """A signal whose disposition is the default one: the launcher process is gone."""


class RpcError(_grpc.RpcError):
    pass


class World:
    def __init__(self, sc: Scenario, log_dir: Path) -> None:
        self.sc, self.log_dir = sc, log_dir
        self.now = 0.0
        self.calls = 0  # calls into the fakes since the launcher's handlers are installed
        self.armed = False
        self.handlers: dict[int, object] = {s: _signal.SIG_DFL for s in STOP_SIGNALS}
        self.handlers[_signal.SIGINT] = _signal.default_int_handler
        self.children: list[FakeChild] = []
        self.by_address: dict[str, FakeChild] = {}
        self.out: list[tuple[float, int, str, str]] = []  # (time, call, stream, text)
        self.deliveries: list[tuple[float, int, int, str]] = []  # (time, call, sig, handler)
        self.pending = sorted(sc.signals, key=lambda s: (s[0], s[1]))
        self.seq = 0  # orders every event below
        self.up_with_dead: list[str] = []  # children dead as "TierCache is up" was said
        self.unnoticed: list[str] = []  # children long dead when the late signal came

    def tick(self) -> int:
        self.seq += 1
        return self.seq

    # -- time and signals
    def deliver(self, sig: int) -> None:
        h = self.handlers[sig]
        kind = ("ignored" if h is _signal.SIG_IGN else "default" if h is _signal.SIG_DFL
                else "python" if h is _signal.default_int_handler else "launcher")
        self.deliveries.append((self.now, self.tick(), sig, kind))
        if kind == "ignored":
            return
        if kind == "default":
            raise ProcessDied(sig)
        h(sig, None)

    def advance(self, to: float) -> None:
        if to > 1e5:
            raise Hang(f"virtual time runs away ({to}): the launcher never stops")
        while True:
            due = [s for s in self.pending if s[0] == "time" and s[1] <= to]
            if not due:
                break
            first = min(due, key=lambda s: s[1])
            self.pending.remove(first)
            self.now = max(self.now, first[1])
            self.deliver(first[2])
        self.now = max(self.now, to)

    def hook(self, what: str) -> None:
        if not self.armed:
            return
        self.calls += 1
        for s in list(self.pending):
            if s[0] == "hook" and s[1] == self.calls:
                self.pending.remove(s)
                self.deliver(s[2])
        if self.now > 150.0 and not any(d[3] == "launcher" for d in self.deliveries) \
                and not self.out_failures():
            # nothing ends a healthy stack but a signal: one comes, late
            self.unnoticed = [ch.key for ch in self.children if ch.spec.kind in ("exit", "dies")
                              and ch.created + ch.spec.at < self.now - 10.0]
            self.deliver(_signal.SIGTERM)

    def out_failures(self) -> list:
        return [o for o in self.out if o[2] == "err"]

    # -- the launcher's modules
    def popen(self, cmd, cwd=None, env=None, stdout=None, stderr=None,
              start_new_session=False) -> FakeChild:
        name = cmd[2].split(".")[1]
        key = env.get("TIERCACHE_KVPOOL_REPLICA_ID", name) if name == "kvpool" else name
        address = env[f"TIERCACHE_{name.upper()}_ADDRESS"]
        assert start_new_session, "each child runs in its own session"
        child = FakeChild(self, key, self.sc.children[key], address, env)
        if child.spec.problem and hasattr(stdout, "write"):
            stdout.write(json.dumps({"level": "ERROR", "msg": child.spec.problem}).encode()
                         + b"\n")
            stdout.flush()
        self.children.append(child)
        self.by_address[address] = child
        self.hook("popen")  # a signal right after the fork
        return child

    def sleep(self, dt: float) -> None:
        self.advance(self.now + dt)
        self.hook("sleep")

    def monotonic(self) -> float:
        return self.now

    def set_signal(self, sig: int, handler) -> object:
        old, self.handlers[sig] = self.handlers[sig], handler
        if not self.armed and all(callable(self.handlers[s]) and
                                  self.handlers[s] is not _signal.default_int_handler
                                  for s in STOP_SIGNALS):
            self.armed = True  # from here on every call is a moment a signal may come
        self.hook("signal")
        return old

    def print(self, *args, file=None, flush=False, sep=" ", end="\n") -> None:
        text = sep.join(str(a) for a in args)
        self.out.append((self.now, self.tick(), "err" if file is sys.stderr else "out", text))
        if "TierCache is up" in text:
            self.up_with_dead += [ch.key for ch in self.children if ch.exited()]
        for s in list(self.pending):
            if s[0] == "print" and s[1] == len(self.out) and self.armed:
                self.pending.remove(s)
                self.deliver(s[2])
        self.hook("print")

    def port_is_free(self, port: int, host: str = "127.0.0.1") -> bool:
        return port not in self.sc.taken

    def modules(self) -> dict[str, object]:
        world = self

        class Channel:
            def __init__(self, address: str) -> None:
                self.address = address

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                pass

        class Stub:
            def __init__(self, channel: Channel) -> None:
                self.address = channel.address

            def Check(self, request, timeout=None):  # noqa: N802 - gRPC's name
                world.advance(world.now + 0.01)
                child = world.by_address.get(self.address)
                up = child is not None and child.serving()
                world.hook("check")
                if not up:
                    raise RpcError("unavailable")
                return health_pb2.HealthCheckResponse(
                    status=health_pb2.HealthCheckResponse.SERVING)

        return {
            "time": types.SimpleNamespace(monotonic=self.monotonic, sleep=self.sleep),
            "subprocess": types.SimpleNamespace(
                Popen=self.popen, TimeoutExpired=_subprocess.TimeoutExpired,
                DEVNULL=_subprocess.DEVNULL, STDOUT=_subprocess.STDOUT),
            "signal": types.SimpleNamespace(
                SIGINT=_signal.SIGINT, SIGTERM=_signal.SIGTERM, SIGHUP=_signal.SIGHUP,
                SIGQUIT=_signal.SIGQUIT, SIGKILL=_signal.SIGKILL, SIG_IGN=_signal.SIG_IGN,
                Signals=_signal.Signals, signal=self.set_signal),
            "grpc": types.SimpleNamespace(insecure_channel=Channel, RpcError=_grpc.RpcError,
                                          secure_channel=None),
            "health_pb2_grpc": types.SimpleNamespace(HealthStub=Stub),
            "print": self.print,
            "port_is_free": self.port_is_free,
        }


class FakeChild:
    """Popen's surface over a scripted child on the virtual clock."""

    _pids = iter(range(100_000, 10**9))

    def __init__(self, world: World, key: str, spec: Child, address: str, env) -> None:
        self.world, self.key, self.spec, self.address = world, key, spec, address
        self.env = env
        self.pid = next(self._pids)
        self.created, self.created_seq = world.now, world.tick()
        self.returncode: int | None = None
        self.signals: list[tuple[float, int]] = []  # what the launcher sent, when
        self.ends: list[tuple[float, int]] = []  # (time, code) of ways it will exit
        if spec.kind in ("exit", "dies"):
            self.ends.append((self.created + spec.at, spec.code))

    def end(self) -> tuple[float, int]:
        return min(self.ends, default=(math.inf, 0))

    def exited(self) -> bool:
        return self.end()[0] <= self.world.now

    def serving(self) -> bool:
        return (not self.exited() and self.spec.kind in ("ok", "dies")
                and self.world.now >= self.created + self.spec.ready)

    def _reap(self) -> int | None:
        if self.returncode is None and self.exited():
            self.returncode = self.end()[1]
        return self.returncode

    def poll(self) -> int | None:
        rc = self._reap()
        self.world.hook("poll")
        return rc

    def send_signal(self, sig: int) -> None:
        if self._reap() is None:  # as Popen: nothing to a child already waited for
            self.signals.append((self.world.now, sig, self.world.tick()))
            if sig == _signal.SIGKILL:
                self.ends.append((self.world.now, -_signal.SIGKILL))
            elif sig == _signal.SIGTERM and self.spec.term is not None:
                self.ends.append((self.world.now + self.spec.term, -_signal.SIGTERM))
        self.world.hook("send_signal")

    def terminate(self) -> None:
        self.send_signal(_signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(_signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        t_end = self.end()[0]
        if timeout is None:
            if t_end == math.inf:
                raise Hang(f"wait() without a timeout on {self.key}, which never exits")
            self.world.advance(t_end)
        elif t_end <= self.world.now + timeout:
            self.world.advance(t_end)
        else:
            self.world.advance(self.world.now + timeout)
            self.world.hook("wait")
            raise _subprocess.TimeoutExpired("x", timeout)
        rc = self._reap()
        self.world.hook("wait")
        return rc


def run_fake(sc: Scenario, log_dir: Path, monkeypatch) -> tuple[World, object]:
    """`launcher.main` over scenario `sc`: the world it ran in and what it returned (or the
    exception that left it)."""
    world = World(sc, log_dir)
    with monkeypatch.context() as m:
        for name, value in world.modules().items():
            m.setattr(launcher, name, value, raising=False)
        m.setattr(launcher, "ROOT", log_dir)
        m.setattr(launcher, "_HANDED", set())  # one process hands out ~10 per stack
        m.setattr(launcher, "service_exists", lambda name: True)
        m.setattr(launcher, "semantic_db_env", lambda port, env: {})
        m.setattr(launcher, "model_to_convert", lambda env: False)
        m.setattr(launcher, "prune_pid_logs", lambda logs: [])
        for k in list(os.environ):
            if k.startswith("TIERCACHE_") or k == "PYTHONPATH":
                m.delenv(k)
        for s, v in sc.graces.items():
            m.setenv(f"TIERCACHE_{s.upper()}_GRACE_SECONDS", v)
        try:
            got: object = launcher.main(["--base-port", str(sc.base_port),
                                         "--replicas", str(sc.replicas)])
        except (Exception, KeyboardInterrupt, ProcessDied) as e:  # noqa: BLE001
            got = e
    return world, got


# ---------------------------------------------------------------------------------------------
# The model


def grace(sc: Scenario, key: str) -> float:
    raw = sc.graces.get(service(key))
    return 15.0 + (min(float(raw), 600.0) if raw is not None else 10.0)


# One health poll of the wait (the fake Check's 0.01 s and the 0.2 s sleep): exits this close
# together are seen at the same poll, and which of them is named is then the check's order.
POLL_S = 0.25


def expected_failure(sc: Scenario, world: World) -> tuple[str, list[list[str]]]:
    """("port"|"start"|"exited", the words the failure line must hold: one list of them per
    failure it may name) when no signal came first."""
    if sc.taken:
        return "port", [[f"port {min(sc.taken)} ", "is in use"]]
    if any(c.kind == "dies" and c.at < DEATH_AFTER for c in sc.children.values()):
        return "any", [[]]  # which failure the launcher meets first is timing: see `check`
    started = {ch.key: ch for ch in world.children}
    never = None  # the first child in start order never ready
    for k in keys(sc.replicas):
        never = started.get(k)
        if never is None:
            return "none", [[f"({k} never started)"]]
        if sc.children[k].kind == "never":
            break
        never = None
    # The start fails at the first exit of any child (each wait watches them all), else at the
    # end of the wait for one never ready: every exit (by DEATH_AFTER + 3 s) comes before it.
    exits = sorted((ch.created + sc.children[ch.key].at, i, ch)
                   for i, ch in enumerate(world.children)
                   if sc.children[ch.key].kind in ("exit", "dies"))
    assert all(t < WAIT_S for t, *_ in exits)
    if exits:
        if never is None and all(sc.children[ch.key].kind == "dies" for *_, ch in exits):
            first = exits[0][2]  # after "TierCache is up"
            note = f"{first.key} ({first.address}) {ended(sc.children[first.key].code)}"
            return "exited", [[f"service(s) exited: {note}" if first is world.children[0]
                               else note]]
        return "start", [start_failure(sc, ch) for t, _, ch in exits
                         if t <= exits[0][0] + POLL_S]
    if never is not None:
        return "start", [[f"failed to start: {never.key} ({never.address}) not SERVING after "]]
    return "none", [["(no failure in this scenario)"]]


def start_failure(sc: Scenario, ch: FakeChild) -> list[str]:
    """The words naming `ch`, exited during the start, in the failure line."""
    c = sc.children[ch.key]
    return ([f"failed to start: {ch.key} ({ch.address}) {ended(c.code)}"]
            + ([f"{ended(c.code)}: {c.problem}"] if c.problem else []))


def ended(code: int) -> str:
    """How a child's end is told: its exit status, or the signal that killed it (Popen's
    negative code)."""
    return f"was killed by {_signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


def check(sc: Scenario, world: World, got: object) -> list[str]:
    """What the run broke of the model (empty: nothing)."""
    bad: list[str] = []
    if isinstance(got, ProcessDied):  # a default disposition: only before anything started
        if world.children:
            bad.append(f"the launcher died by signal {got} with children started")
        return bad
    if not isinstance(got, int) or got not in (0, 1):
        bad.append(f"main did not return 0 or 1: {got!r}")
    for ch in world.children:  # every child exited and reaped
        if not ch.exited():
            bad.append(f"{ch.key} left running")
        elif ch.returncode is None:
            bad.append(f"{ch.key} not reaped")
    order = [ch.key for ch in world.children]
    if order != keys(sc.replicas)[:len(order)]:
        bad.append(f"start order {order}")
    if sc.taken and order:
        bad.append("children started with a port of the stack taken")
    if world.unnoticed and any("TierCache is up" in o[3] for o in world.out):
        bad.append(f"{world.unnoticed} exited after the start and went unnoticed")
    if world.up_with_dead:
        bad.append(f"'TierCache is up' said with {world.up_with_dead} exited")
    stop = next((d for d in world.deliveries if d[3] == "launcher"), None)  # the first
    stop_seq = stop[1] if stop else math.inf
    if any(ch.created_seq > stop_seq for ch in world.children):
        bad.append("a child started after the stop signal")
    fails = world.out_failures()
    stopping = [o for o in world.out if o[3].strip() == "stopping ..."]
    # the outcome: exactly one of "stopping ..." and a failure line; the exit code agrees
    if got == 0 and (fails or not stopping or stop is None):
        bad.append(f"exit 0, printed {[o[3][:90] for o in fails]}, stopping={bool(stopping)}")
    if got == 1 and (len(fails) != 1 or stopping):
        bad.append(f"exit 1, failure lines {len(fails)}, stopping={bool(stopping)}")
    if stop is None or (fails and fails[0][1] < stop_seq):
        # no stop signal before the failure was reported: the failure decides
        if got != 1:
            bad.append(f"exit {got!r} after a failure (no stop signal before it)")
        if fails:
            failing = [ch for ch in world.children if sc.children[ch.key].kind != "ok"]
            if not any(f"{ch.key} ({ch.address}) {ended(sc.children[ch.key].code)}"
                       in fails[0][3]
                       or f"{ch.key} ({ch.address}) not SERVING" in fails[0][3] for ch in failing) \
                    and not sc.taken:
                bad.append(f"failure line {fails[0][3]!r} names no failing child")
            named = expected_failure(sc, world)[1]
            if not any(all(w in fails[0][3] for w in words) for words in named):
                bad.append(f"failure line {fails[0][3]!r} lacks {named!r}")
    elif stop[0] < failure_time(sc, world) and got != 0:
        bad.append(f"exit {got!r} though the stop signal came before any failure")
    # the stop: reverse order, SIGTERM, SIGKILL only after the grace, after the outcome said
    said = min([o[1] for o in fails + stopping], default=math.inf)
    sent = sorted((x[2], ch.key, x[1]) for ch in world.children for x in ch.signals)
    termed = [k for _, k, s in sent if s == _signal.SIGTERM]
    if termed != [ch.key for ch in reversed(world.children) if ch.key in termed]:
        bad.append(f"SIGTERM order {termed}")
    for ch in world.children:
        sigs = [x[1] for x in ch.signals]
        if sigs not in ([], [_signal.SIGTERM], [_signal.SIGTERM, _signal.SIGKILL]):
            bad.append(f"{ch.key} got {sigs}")
        if len(sigs) == 2 and abs(ch.signals[1][0] - ch.signals[0][0] - grace(sc, ch.key)) \
                > 1e-6:
            bad.append(f"{ch.key} killed {ch.signals[1][0] - ch.signals[0][0]} s after "
                       f"SIGTERM, not {grace(sc, ch.key)}")
        if ch.signals and ch.signals[0][2] < said:
            bad.append(f"{ch.key} signalled before the outcome was printed")
    stopped = [o for o in world.out if o[3] == "stopped"]
    if len(stopped) != bool(world.children):
        bad.append(f"'stopped' said {len(stopped)} times with {len(world.children)} children")
    if stopped and any(x[2] > stopped[0][1] for ch in world.children for x in ch.signals):
        bad.append("'stopped' said before the stop was through")
    return bad


def failure_time(sc: Scenario, world: World) -> float:
    """Virtual time of the first failure among the children started (the launcher may see
    it later)."""
    if sc.taken:
        return 0.0
    times = [math.inf]
    for ch in world.children:
        c = sc.children[ch.key]
        if c.kind in ("exit", "dies"):
            times.append(ch.created + c.at)
        elif c.kind == "never":
            times.append(ch.created + WAIT_S)
    return min(times)


def one(seed: int, tmp: Path, monkeypatch) -> list[str]:
    sc = scenario(seed)
    log_dir = tmp / f"s{seed}"
    world, got = run_fake(sc, log_dir, monkeypatch)
    bad = check(sc, world, got)
    return [f"seed {seed}: {b}" for b in bad]


def test_fake_stacks(tmp_path, monkeypatch):
    bad: list[str] = []
    for seed in range(FIRST, FIRST + SEEDS):
        bad += one(seed, tmp_path, monkeypatch)
        if len(bad) > 10:
            break
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------
# Real children: tiny `python -c` processes in place of the services

CHILD = r"""
import json, os, signal, sys, time
spec = json.loads(sys.argv[1])
if spec["term"] is None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if spec["problem"]:
    print(json.dumps({"level": "ERROR", "msg": spec["problem"]}), flush=True)
time.sleep(spec["delay"])
if spec["kind"] == "exit":
    sys.exit(spec["code"])
if spec["kind"] != "never":
    open(spec["marker"], "w").close()
if spec["kind"] == "dies":
    time.sleep(spec["after"])
    sys.exit(spec["code"])
time.sleep(600)
"""


def real_scenario(seed: int) -> tuple[dict[str, dict], float | None, int]:
    rng = random.Random(10**6 + seed)
    specs = {}
    for k in keys(1):
        r = rng.random()
        kind = "ok" if r < 0.7 else "exit" if r < 0.82 else "never" if r < 0.9 else "dies"
        specs[k] = {"kind": kind, "delay": rng.choice([0.0, 0.1]), "code": rng.choice([0, 2, 3]),
                    "after": rng.choice([0.3, 1.5]), "term": rng.choice([0.0, 0.0, None]),
                    "problem": f"bad configuration: {k} ({seed})" if rng.random() < 0.5
                    else None}
    when = rng.choice([None, 0.0, 0.05, 0.3, 1.0])
    if when is None and all(s["kind"] == "ok" for s in specs.values()):
        when = 1.5  # nothing else ends a healthy stack
    return specs, when, rng.choice([_signal.SIGINT, _signal.SIGTERM])


def run_real(seed: int, tmp: Path, monkeypatch) -> list[str]:
    specs, when, sig = real_scenario(seed)
    tmp.mkdir(parents=True)
    real_popen, children, out = _subprocess.Popen, {}, []

    def popen(cmd, cwd=None, env=None, stdout=None, stderr=None, start_new_session=False):
        name = cmd[2].split(".")[1]
        key = env.get("TIERCACHE_KVPOOL_REPLICA_ID", name) if name == "kvpool" else name
        port = env[f"TIERCACHE_{name.upper()}_ADDRESS"].rsplit(":", 1)[1]
        spec = {**specs[key], "marker": str(tmp / f"ready-{port}")}
        child = real_popen([sys.executable, "-c", CHILD, json.dumps(spec)], stdout=stdout,
                           stderr=stderr, start_new_session=start_new_session)
        children[key] = child
        return child

    class Channel:
        def __init__(self, address: str) -> None:
            self.port = address.rsplit(":", 1)[1]

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    class Stub:
        def __init__(self, channel: Channel) -> None:
            self.marker = tmp / f"ready-{channel.port}"

        def Check(self, request, timeout=None):  # noqa: N802 - gRPC's name
            if not self.marker.exists():
                raise RpcError("unavailable")
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVING)

    start, stop = launcher.Stack.start, launcher.ServiceProcess.stop
    saved = {s: _signal.getsignal(s) for s in STOP_SIGNALS}
    timer = None if when is None else threading.Timer(when, os.kill, (os.getpid(), sig))

    def set_signal(signum, handler):  # the signal comes once the launcher handles them all
        old = _signal.signal(signum, handler)
        if timer is not None and signum == STOP_SIGNALS[-1] and callable(handler):
            timer.start()
        return old

    with monkeypatch.context() as m:
        m.setattr(launcher.subprocess, "Popen", popen)
        m.setattr(launcher, "grpc", types.SimpleNamespace(insecure_channel=Channel,
                                                          RpcError=_grpc.RpcError))
        m.setattr(launcher, "health_pb2_grpc", types.SimpleNamespace(HealthStub=Stub))
        m.setattr(launcher.Stack, "start", lambda self, timeout=0: start(self, 1.0))
        m.setattr(launcher.ServiceProcess, "stop", lambda self, grace=None: stop(self, 0.3))
        m.setattr(launcher, "print", lambda *a, **kw: out.append(
            ("err" if kw.get("file") is sys.stderr else "out", " ".join(map(str, a)))),
            raising=False)
        m.setattr(launcher, "ROOT", tmp)
        m.setattr(launcher, "service_exists", lambda name: True)
        m.setattr(launcher, "signal", types.SimpleNamespace(
            **{n: getattr(_signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT",
                                                "SIGKILL", "SIG_IGN", "Signals")},
            signal=set_signal))
        m.setattr(launcher, "semantic_db_env", lambda port, env: {})
        m.setattr(launcher, "model_to_convert", lambda env: False)
        m.setattr(launcher, "prune_pid_logs", lambda logs: [])
        for k in list(os.environ):
            if k.startswith("TIERCACHE_"):
                m.delenv(k)
        try:
            got: object = launcher.main(["--base-port", "0", "--replicas", "1"])
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
            got = e
        finally:
            if timer is not None and timer.is_alive():
                timer.cancel()
                timer.join()
            for s, h in saved.items():
                _signal.signal(s, h)
            left = [k for k, c in children.items() if c.poll() is None]
            for c in children.values():
                if c.poll() is None:
                    c.kill()
                    c.wait()
    bad = [f"{k} left running" for k in left]
    if sorted(children) != sorted(keys(1)) and when is None:
        bad.append(f"started {sorted(children)}")
    fails = [t for s, t in out if s == "err"]
    stopping = any(t.strip() == "stopping ..." for s, t in out)
    failing = [k for k, s in specs.items() if s["kind"] != "ok"]
    if got == 0 and (fails or not stopping or when is None):
        bad.append(f"exit 0: failures {fails}, stopping {stopping}, signal at {when}")
    elif got == 1:
        if len(fails) != 1 or stopping or not failing:
            bad.append(f"exit 1: failures {fails}, stopping {stopping}, failing {failing}")
        elif not any(f"{k} (127.0.0.1:" in fails[0] or "not SERVING" in fails[0]
                     for k in failing):
            bad.append(f"the failure line names none of {failing}: {fails[0]}")
    elif got not in (0, 1):
        bad.append(f"main did not return 0 or 1: {got!r}")
    if not failing and got != 0:
        bad.append(f"exit {got!r} for a healthy stack stopped by a signal")
    if ("stopped" in [t for _, t in out]) != bool(children):
        bad.append("'stopped' not said once every child was stopped")
    return [f"real seed {seed} ({when}, {specs}): {b}" for b in bad]


def test_real_children(tmp_path, monkeypatch):
    bad: list[str] = []
    for seed in range(FIRST, FIRST + REAL):
        bad += run_real(seed, tmp_path / str(seed), monkeypatch)
    assert not bad, "\n".join(bad)
