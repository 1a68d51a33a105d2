"""A differential review of trace replay's scheduling (clients/python/replay.py, and the
`tiercache replay` summary in cli.py) against a model written from replay's docstring, the
CLI's summary and README, with scripted fake clients (pure scheduling logic: no server).

Each seed draws a workload (1-6 sessions of 1-4 turns over two tenants, arrival times that
collide, some sessions whose trace lines interleave), a concurrency (1-3), a time scale (0,
or milliseconds per trace second) and a script per request: text chunks then the final
message, an answer of only blank text, a gRPC status (before or after the final), an
IncompleteStream, a stream that ends quietly without its final, or any other exception, each
step after a delay of a few milliseconds. The model, per session: its turns in order, each sent
once with exactly [system prompt, earlier questions and their answers as received (joined,
not stripped), the question]; an outcome per turn with the final's figures (the last final that
came, kept by a turn that failed after it: undocumented, the code's choice) and its error
("CODE: details", "stream ended without a final message", "Type: message"); after a turn that
failed or answered nothing every later turn skipped ("skipped: turn K of the session failed /
answered nothing"), never sent. Checked on the fakes: no turn sent before its predecessor's
answer ended, none before its scaled arrival (`sent_at` too), never more than `concurrency`
requests in flight, ttft/total at least the scripted delays, progress counted 1..N. Half the
seeds go through `cli.main(["replay", ...])`: the JSON summary (requests, errors counting the
skipped, classes, cached and prompt tokens of the answered turns only) and exit 0 / 1.

Ctrl-C (a third of the seeds): KeyboardInterrupt raised in the caller's thread while the
sessions are submitted (the k-th submit), after the m-th request went out, or after a few
milliseconds. Then replay raises it (the CLI exits 130, no summary), every client is closed,
every request in flight ends cancelled (the fake's close ends its calls as a closed channel
does), and no request goes out after replay returned (the library case: nothing closes the
clients but replay itself).

Not redone here: tests/test_client_differential.py replays 1-4 sessions through the real
client and a scripted server on a per-session fake clock (the stream's statuses, the
metadata); this file covers what it leaves out: Ctrl-C, the CLI's summary, gate contention
across sessions on one clock, exceptions other than gRPC's, and the liveness of the gate (the
last test: `concurrency` requests in flight at once, not fewer).

Run: 2,000 seeds (about a third with Ctrl-C), clean after two fixes. Found: a Ctrl-C while
the sessions were being submitted (before the handler's `try`) left the sessions already
submitted sending at their times, their clients never closed (56 of 1,000 seeds; through the
CLI, closed clients but timed sessions waiting on, 4) -> submitted under the handler
(tests/test_client_library.py); the calls Ctrl-C cancelled were still counted by `progress`
after replay had raised (the CLI's terminal counter printed after its line was ended; 105 of
1,000 seeds) -> no progress once stopped (tests/test_cli_rules.py). Undocumented, asserted
as invariants only: the order of outcomes (compared by session and turn), a skipped turn's
`sent_at` (the end of the turn that ended its session), a status after the final keeping the
final's figures.
Teeth (300 seeds each): the history's answer unstripped 116 failed (when the model
stripped it; it no longer does); one request more in flight
than `concurrency` 120; only a session's first turn waiting for its time 44; an empty answer
not ending its session 115; Ctrl-C not closing the clients 37; the summary summing the tokens
of failed turns too 17.

More seeds: REPLAY_DIFFERENTIAL_SEEDS=2000 pytest tests/test_replay_differential.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import threading
import time
import types
from collections import Counter
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as real_wait
from dataclasses import dataclass, field

import grpc
import pytest
from tiercache.v1 import common_pb2, orchestrator_pb2

from benchmarks.workload import Request, Workload, WorkloadSpec, save_trace
from clients.python import cli
from clients.python import replay as replay_mod
from clients.python.client import Chunk, IncompleteStream
from tests.blank_text import blank
from tests.test_cli_sessions import Refusal as Status  # a gRPC status as a client raises it
from tests.waits import wait_until

SEEDS = int(os.environ.get("REPLAY_DIFFERENTIAL_SEEDS", "100"))
CLOSED = "TierCacheClient is closed: make a new one"


# ---------------------------------------------------------------- scripts and the fake side

@dataclass
class Script:
    """What the server does with one request: steps of ("chunk", text, final | None),
    ("raise", exception) and ("wait", seconds)."""

    steps: list = field(default_factory=list)


@dataclass
class Call:
    question: str
    client: FakeClient
    messages: list
    kw: dict
    seq: int
    at: float
    end_seq: int = -1
    end: str = ""  # "done", "raised", "cancelled"
    cancel: threading.Event = field(default_factory=threading.Event)


class Net:
    """Every fake client's calls: sequence numbers, requests in flight and their peak."""

    def __init__(self, scripts: dict[str, Script], kill_after: int | None = None) -> None:
        self.lock = threading.Lock()
        self.scripts = scripts
        self.seq = 0
        self.calls: dict[str, list[Call]] = {}
        self.attempts: list[float] = []  # stream() called, sent or refused as closed
        self.flight = 0
        self.peak = 0
        self.kill_after = kill_after
        self.kill = threading.Event()

    def tick(self) -> int:
        self.seq += 1
        return self.seq


class FakeClient:
    """A TierCacheClient's stream/close as replay uses them: a closed client sends nothing
    (the real one raises RuntimeError), closing ends its calls in flight with CANCELLED."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.closed = False
        self.open_calls: list[Call] = []

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self.net.lock:
            self.closed = True
            for c in self.open_calls:
                c.cancel.set()

    def stream(self, messages, **kw):
        net = self.net
        with net.lock:
            net.attempts.append(time.monotonic())
            if self.closed:
                raise RuntimeError(CLOSED)
            q = messages[-1]["content"]
            call = Call(q, self, [dict(m) for m in messages], dict(kw), net.tick(),
                        time.monotonic())
            net.calls.setdefault(q, []).append(call)
            self.open_calls.append(call)
            net.flight += 1
            net.peak = max(net.peak, net.flight)
            if net.kill_after is not None and net.seq >= net.kill_after:
                net.kill.set()
        end = "raised"
        try:
            for step in net.scripts[q].steps:
                if step[0] == "wait":
                    if call.cancel.wait(step[1]):
                        end = "cancelled"
                        raise Status(grpc.StatusCode.CANCELLED, "Channel closed!")
                elif step[0] == "chunk":
                    if call.cancel.is_set():
                        end = "cancelled"
                        raise Status(grpc.StatusCode.CANCELLED, "Channel closed!")
                    yield Chunk(step[1], [], step[2])
                else:
                    raise step[1]
            end = "done"
        finally:
            with net.lock:
                call.end, call.end_seq = end, net.tick()
                self.open_calls.remove(call)
                net.flight -= 1


def rand_final(rng: random.Random) -> orchestrator_pb2.GenerateFinal:
    rep = common_pb2.CacheReport(
        prompt_tokens=rng.choice([0, 40, 64, 100]), cached_tokens=rng.choice([0, 16, 31, 32, 64]),
        semantic_hit=rng.random() < 0.2, semantic_similarity=rng.choice([0.0, 0.5, 0.97]),
        replica_id=rng.choice(["", "kvpool-0", "kvpool-1"]), route=rng.choice(["", "prefix"]),
        index_matched_tokens=rng.choice([0, 16, 48]))
    return orchestrator_pb2.GenerateFinal(
        cache_report=rep, usage=common_pb2.Usage(completion_tokens=rng.randint(0, 9)))


TEXTS = ["Yes", " a", "b ", "  ", "", "\n", "answer."]


def rand_script(rng: random.Random) -> Script:
    def delay() -> tuple:
        return ("wait", rng.choice([0.0, 0.0, 0.0, 0.001, 0.003, 0.006]))

    kind = rng.choices(["ok", "blank", "status", "status_after_final", "incomplete", "quiet",
                        "other"], [10, 2, 2, 1, 1, 1, 1])[0]
    steps: list = []
    for _ in range(rng.randint(0, 3)):
        steps += [delay(), ("chunk", rng.choice(["  ", ""]) if kind == "blank"
                            else rng.choice(TEXTS), None)]
    steps.append(delay())
    if kind in ("ok", "blank", "status_after_final"):
        steps.append(("chunk", rng.choice(["", " ", "\u200b"]) if kind == "blank"
                      else rng.choice(TEXTS),
                      rand_final(rng)))
    if kind in ("status", "status_after_final"):
        code = rng.choice([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                           grpc.StatusCode.RESOURCE_EXHAUSTED])
        steps.append(("raise", Status(code, rng.choice(["down", "boom: x"]))))
    elif kind == "incomplete":
        steps.append(("raise", IncompleteStream("cut")))
    elif kind == "other":
        steps.append(("raise", rng.choice([ValueError("bad"), UnicodeEncodeError(
            "utf-8", "\ud800", 0, 1, "surrogates not allowed")])))
    return Script(steps)


# ---------------------------------------------------------------- the model

@dataclass
class Want:
    """One turn as the model has it."""

    sent: bool
    messages: list | None
    error: str
    final: orchestrator_pb2.GenerateFinal | None
    min_total_s: float = 0.0
    min_ttft_s: float = 0.0
    ends_session: str = ""  # the turn whose failure skipped this one ("" when not skipped)


def expect_turn(script: Script) -> tuple[str, str, orchestrator_pb2.GenerateFinal | None,
                                          float, float]:
    """(error, answer, last final, delays before the end, delays before the first text)."""
    texts: list[str] = []
    final = None
    waited = 0.0
    ttft = None
    for step in script.steps:
        if step[0] == "wait":
            waited += step[1]
        elif step[0] == "chunk":
            texts.append(step[1])
            if step[1] and ttft is None:
                ttft = waited
            if step[2] is not None:
                final = step[2]
        else:
            e = step[1]
            if isinstance(e, grpc.RpcError):
                err = f"{e.code().name}: {e.details()}"
            elif isinstance(e, IncompleteStream):
                err = "stream ended without a final message"
            else:
                err = f"{type(e).__name__}: {e}"
            return err, "".join(texts), final, waited, waited if ttft is None else ttft
    err = "" if final is not None else "stream ended without a final message"
    return err, "".join(texts), final, waited, waited if ttft is None else ttft


def model(w: Workload, scripts: dict[str, Script]) -> dict[tuple[str, int], Want]:
    want: dict[tuple[str, int], Want] = {}
    for sid, reqs in w.sessions().items():
        sys_prompt = w.system_prompts[reqs[0].tenant][reqs[0].system_index]
        history: list[dict] = []
        skipped = ""
        for r in reqs:
            if skipped:
                want[(sid, r.turn)] = Want(False, None, skipped, None)
                continue
            msgs = [{"role": "system", "content": sys_prompt}, *history,
                    {"role": "user", "content": r.question}]
            err, answer, final, total, ttft = expect_turn(scripts[r.question])
            want[(sid, r.turn)] = Want(True, msgs, err, final, total, ttft)
            if err or blank(answer):
                why = "failed" if err else "answered nothing"
                skipped = f"skipped: turn {r.turn} of the session {why}"
                continue
            history += [{"role": "user", "content": r.question},
                        {"role": "assistant", "content": answer}]
    return want


def summary(w: Workload, want: dict) -> dict:
    """The CLI's JSON summary from the model's outcomes (README: classes as the orchestrator's
    stats name them, figures of the answered requests)."""
    ok = [x for x in want.values() if not x.error]

    def cls(f) -> str:
        rep = f.cache_report
        return "semantic_hit" if rep.semantic_hit else (
            "prefix_hit" if rep.cached_tokens >= 32 else "cold")

    return {"requests": len(w.requests), "errors": len(want) - len(ok),
            "classes": dict(Counter(cls(x.final) for x in ok)),
            "cached_tokens": sum(x.final.cache_report.cached_tokens for x in ok),
            "prompt_tokens": sum(x.final.cache_report.prompt_tokens for x in ok)}


# ---------------------------------------------------------------- one seed

def draw(rng: random.Random, seed: int) -> tuple[Workload, dict[str, Script]]:
    tenants = {"t0": ["sys a", "sys b"], "t1": ["sys c"]}
    scripts: dict[str, Script] = {}
    per_session: list[list[Request]] = []
    for s in range(rng.randint(1, 6)):
        tenant = rng.choice(sorted(tenants))
        sys_i = rng.randrange(len(tenants[tenant]))
        at = rng.choice([0.0, 0.0, 1.0, 2.0, 5.0])
        reqs = []
        for t in range(rng.randint(1, 4)):
            q = f"q{seed}.{s}.{t}?"
            reqs.append(Request(at=at, tenant=tenant, session_id=f"s{s}", system_index=sys_i,
                                turn=t, question=q, kind=rng.choice(["turn", "repeat"])))
            scripts[q] = rand_script(rng)
            at += rng.choice([0.0, 0.5, 3.0])
        per_session.append(reqs)
    order: list[Request] = []
    queues = [list(rs) for rs in per_session]
    while queues:  # a trace's sessions interleave; a session's turns keep their order
        qu = rng.choice(queues)
        order.append(qu.pop(0))
        if not qu:
            queues.remove(qu)
    return Workload(WorkloadSpec(), tenants, order), scripts


def run_seed(seed: int, tmp_path=None) -> None:
    rng = random.Random(seed)
    w, scripts = draw(rng, seed)
    concurrency = rng.randint(1, 3)
    scale = rng.choice([0.0, 0.0, 0.004, 0.01])  # seconds of replay per trace second
    via_cli = tmp_path is not None and rng.random() < 0.5
    n_sessions = len(w.sessions())
    ctrl_c = None
    if rng.random() < 1 / 3:
        ctrl_c = rng.choice([("submit", rng.randint(1, n_sessions)),
                             ("send", rng.randint(1, len(w.requests))),
                             ("after", rng.choice([0.0, 0.002, 0.01]))])
    net = Net(scripts, kill_after=ctrl_c[1] if ctrl_c and ctrl_c[0] == "send" else None)
    clients = {t: FakeClient(net) for t in w.system_prompts}
    want = model(w, scripts)

    t0: list[float] = []

    def monotonic() -> float:
        now = time.monotonic()
        if not t0:
            t0.append(now)
        return now

    started = [0.0]

    class Pool(ThreadPoolExecutor):
        submitted = 0

        def submit(self, *a, **kw):
            Pool.submitted += 1
            if ctrl_c and ctrl_c[0] == "submit" and Pool.submitted == ctrl_c[1]:
                raise KeyboardInterrupt
            return super().submit(*a, **kw)

    def fake_wait(fs, return_when=FIRST_EXCEPTION):
        while True:
            done, left = real_wait(fs, timeout=0.001, return_when=return_when)
            if ctrl_c and (net.kill.is_set() or (
                    ctrl_c[0] == "after" and time.monotonic() - started[0] >= ctrl_c[1])):
                raise KeyboardInterrupt
            if not left or any(not f.cancelled() and f.exception() is not None for f in done):
                return done, left

    progress: list[tuple[int, int]] = []
    captured: list[list] = []
    real_replay = replay_mod.replay

    def replay_capturing(*a, **kw):
        out = real_replay(*a, **kw)
        captured.append(out)
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(replay_mod, "time", types.SimpleNamespace(monotonic=monotonic))
    mp.setattr(replay_mod, "ThreadPoolExecutor", Pool)
    mp.setattr(replay_mod, "wait", fake_wait)
    interrupted = False
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        started[0] = time.monotonic()
        if via_cli:
            trace = tmp_path / f"t{seed}.jsonl"
            save_trace(w, trace)
            made = dict(clients)
            mp.setattr(cli, "TierCacheClient", _maker(made))
            mp.setattr(replay_mod, "replay", replay_capturing)
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                rc = cli.main(["--address", "127.0.0.1:1", "replay", str(trace),
                               "--concurrency", str(concurrency), "--time-scale", str(scale),
                               "--max-tokens", "7"])
            interrupted = rc == 130
            if not interrupted:
                (out,) = captured
                assert rc == (1 if any(x.error for x in want.values()) else 0), rc
                assert json.loads(stdout.getvalue()) == summary(w, want), (
                    stdout.getvalue(), summary(w, want))
            clients = made
        else:
            try:
                out = real_replay(w, clients, concurrency=concurrency, time_scale=scale,
                                  max_tokens=7, progress=lambda d, n: progress.append(
                                      (d, n, time.monotonic())))
            except KeyboardInterrupt:
                interrupted = True
        returned = time.monotonic()
    finally:
        mp.undo()
    ctx = (seed, concurrency, scale, ctrl_c, via_cli)
    assert net.peak <= concurrency, ("in flight", net.peak, ctx)
    for calls in net.calls.values():
        assert len(calls) == 1, ("sent twice", calls[0].question, ctx)
    if interrupted:
        assert ctrl_c is not None, ctx
        if via_cli:
            assert stdout.getvalue() == "", ctx
        linger = max(r.at for r in w.requests) * scale + 0.02  # past the latest arrival
        check_interrupted(net, clients, returned, linger, ctx)
        assert all(p[2] <= returned for p in progress), ("counted after Ctrl-C", ctx)
        return
    if ctrl_c and ctrl_c[0] == "submit":
        raise AssertionError(("a Ctrl-C while submitting was lost", ctx))
    check_outcomes(w, want, out, net, scale, t0[0], ctx)
    if not via_cli:
        assert [p[:2] for p in progress] == [(i + 1, len(w.requests))
                                             for i in range(len(w.requests))], ctx


def _maker(made: dict[str, FakeClient]):
    """cli builds one client for the command, then one per tenant in header order."""
    pending = list(made.values())
    spare: list[FakeClient] = []

    def make(*a, **kw) -> FakeClient:
        if not spare:  # the command's own client (closed unused)
            spare.append(FakeClient(pending[0].net))
            return spare[0]
        return pending.pop(0)
    return make


def check_interrupted(net: Net, clients: dict[str, FakeClient], returned: float,
                      linger: float, ctx) -> None:
    assert all(c.closed for c in clients.values()), ("a client left open", ctx)
    def none_in_flight() -> bool:
        with net.lock:
            return net.flight == 0

    wait_until(none_in_flight, 2.0, lambda: f"a call in flight was never cancelled: {net.flight} "
               f"in flight, {ctx}", every=0.002)
    time.sleep(linger)
    with net.lock:
        late = [c for calls in net.calls.values() for c in calls if c.at > returned]
        after = sum(a > returned for a in net.attempts)
    assert not late, ("sent after Ctrl-C", [c.question for c in late], ctx)
    # A thread past the gate's check when Ctrl-C came may still try (its client refuses).
    assert after <= ctx[1], ("tried to send after Ctrl-C", after, ctx)


def check_outcomes(w: Workload, want: dict, out: list, net: Net, scale: float, t0: float,
                   ctx) -> None:
    got = {(o.session_id, o.turn): o for o in out}
    assert len(got) == len(out) == len(w.requests), ctx
    assert set(got) == set(want), ctx
    reqs = {(r.session_id, r.turn): r for r in w.requests}
    for sid, rs in w.sessions().items():
        prev = None
        for r in rs:
            key = (sid, r.turn)
            o, x = got[key], want[key]
            assert (o.tenant, o.kind) == (r.tenant, r.kind), ctx
            assert o.error == x.error, (key, o.error, x.error, ctx)
            calls = net.calls.get(r.question, [])
            if not x.sent:
                assert not calls, ("a skipped turn was sent", key, ctx)
                assert (o.prompt_tokens, o.cached_tokens, o.completion_tokens, o.ttft_ms,
                        o.total_ms, o.semantic_hit) == (0, 0, 0, 0.0, 0.0, False), ctx
                assert o.sent_at == pytest.approx(prev[0].sent_at + prev[0].total_ms / 1000,
                                                  abs=1e-6), ctx
                continue
            (call,) = calls
            assert call.messages == x.messages, (key, call.messages, x.messages, ctx)
            assert call.kw["session_id"] == sid and call.kw["max_tokens"] == 7, ctx
            if prev is not None:  # the predecessor's answer came before this was sent
                assert call.seq > prev[1].end_seq, ("sent before its predecessor ended", ctx)
            assert call.at - t0 >= reqs[key].at * scale - 1e-9, ("sent early", key, ctx)
            assert o.sent_at >= reqs[key].at * scale - 1e-9, ctx
            rep = x.final.cache_report if x.final is not None else common_pb2.CacheReport()
            assert (o.prompt_tokens, o.cached_tokens, o.semantic_hit, o.replica_id, o.route,
                    o.expected_tokens) == (rep.prompt_tokens, rep.cached_tokens,
                                           rep.semantic_hit, rep.replica_id, rep.route,
                                           rep.index_matched_tokens), (key, ctx)
            assert o.similarity == pytest.approx(rep.semantic_similarity), ctx
            assert o.completion_tokens == (x.final.usage.completion_tokens
                                           if x.final is not None else 0), ctx
            assert x.min_total_s * 1000 - 0.5 <= o.total_ms, (o.total_ms, x.min_total_s, ctx)
            assert x.min_ttft_s * 1000 - 0.5 <= o.ttft_ms <= o.total_ms, ctx
            prev = (o, call)


def test_replay_matches_the_documented_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path / "home"))
    for seed in range(SEEDS):
        run_seed(seed, tmp_path)


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_an_untimed_replay_keeps_concurrency_requests_in_flight(concurrency):
    """"0 = as fast as the concurrency allows": with more sessions than `concurrency`, that
    many requests are in flight at once (each request here waits until they are, 2 s at
    most), and never more."""
    scripts = {f"q{s}.{t}?": Script([("chunk", "a", orchestrator_pb2.GenerateFinal())])
               for s in range(2 * concurrency + 1) for t in range(2)}
    net = Net(scripts)
    full = threading.Event()
    inside = [0]

    class Client(FakeClient):
        def stream(self, messages, **kw):
            with net.lock:  # replay calls stream() with its request counted in flight
                inside[0] += 1
                if inside[0] >= concurrency:
                    full.set()
            try:
                full.wait(2.0)
                yield from super().stream(messages, **kw)
            finally:
                with net.lock:
                    inside[0] -= 1

    reqs = [Request(at=0.0, tenant="t0", session_id=f"s{s}", system_index=0, turn=t,
                    question=f"q{s}.{t}?") for s in range(2 * concurrency + 1) for t in range(2)]
    started = time.monotonic()
    out = replay_mod.replay(Workload(WorkloadSpec(), {"t0": ["be brief"]}, reqs),
                            {"t0": Client(net)}, concurrency=concurrency)
    assert full.is_set() and time.monotonic() - started < 1.5, "fewer requests in flight"
    assert net.peak <= concurrency and not any(o.error for o in out)
