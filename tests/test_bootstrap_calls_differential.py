"""A differential review of what the interceptor does to every call since the first review
(tests/test_bootstrap_differential.py): responses it serializes and refuses over the send
limit, calls cut under their handlers, Health.Watch counts, stop(0), the status-message cap
by wire size and the thinned log lines. Seeded random mixes over real loopback gRPC with a
2 KiB `max_message_bytes`, each call's client status and details compared with a model.

Each call of the four kinds (unary, server stream, client stream, two-way) carries a script:
the sizes of the responses its handler returns or yields (any of them around or over the
limit, a stream's anywhere in it), then how it ends: return, a domain error or a plain
exception, an abort with a code (messages and details empty, short, or long in ASCII, é,
CJK, emoji, '%' and control characters, around 2,048 characters and 6 KiB encoded), a sleep
past its deadline, or holding until its client goes. Clients cancel at random moments,
send requests over the limit (a client stream's anywhere in it), give deadlines; Watches are
cancelled, time out, or stay open for the stop; each seed ends with a stop, with a grace or
none, while calls are held, some finishing within the grace.

The model, from the module's docstrings and comments, docs/reliability.md items 100-101
and docs/metrics.md:
- a response over the limit: RESOURCE_EXHAUSTED "SERVER: Sent message larger than max (N vs.
  2048)", a stream's earlier messages delivered; counted RESOURCE_EXHAUSTED; one WARNING a
  time (thinned per method: past its `per_window`, a count line at WARNING when the server
  stops, "service/method: N more lines left out ...");
- a status message capped to MAX_DETAILS_CHARS characters and MAX_DETAILS_WIRE_BYTES as gRPC
  sends it (printable ASCII but '%' one byte, any other character 3 per UTF-8 byte), keeping
  the longest prefix that leaves 64 bytes for "... (N characters cut)"; the client gets
  exactly that text;
- each call counted once in tiercache_rpc_total under the status its client saw, timed once
  when its handler ran; where a cancel races the handler's end only what the docs allow:
  the client's code, or the handler's own outcome when the handler finished first (a
  cancel in flight); a call cancelled before any handler ran is counted at most once,
  never OK. A client stream cut by a request over the limit: RESOURCE_EXHAUSTED at the
  client, counted CANCELLED (known gap). A call the stop's grace cut: UNAVAILABLE;
- Health.Watch counted and timed when it ends: CANCELLED, DEADLINE_EXCEEDED, and OK when
  the stop ended it, with a grace or none, after NOT_SERVING;
- "<method> ended <CODE>" INFO lines, one per domain error raised (thinned per method and
  code, the count at INFO), CODE the status the client got: where a domain error raced its
  client's cancel or deadline, or a request over the limit (a handler yet to start or at
  work when cancelled; a client stream's requests may just end at a cancel or a cut, its
  handler going on to raise, the call counted CANCELLED), that method's lines are only
  checked to name a code raised or the client's (a stop-70 change logs the status counted,
  and the exact check then failed 1 run in 2); "unhandled error" ERROR lines, one per plain
  exception only.

Run here: seeds 3-82 (13 failed: model error 1), 0-59 and 100-159 (2 failed: model error 2),
then 116, 139 and 200-259, all equal to the model (~1.7 s a seed, 2 shared cores). No defect
found. Divergences, all model errors: a stream refused for an over-limit
message before its late end or hold ends before its deadline (RESOURCE_EXHAUSTED); a
refusal for size settles the call's outcome on the server, so a cancel crossing it is the
same race as a handler's end crossing it (counted either way). The race itself (a cancel in
flight while the server settles its status: client CANCELLED, counted as the server's
outcome) is inherent, allowed, not a rule of the docs. Injected bugs, 12 seeds each: the cap
by characters only (7 failed), size refusals thinned at INFO (4, with the windows made 1 and
2 here), `>=` at the send limit (5), stop(0) not ending Watches first (8), client-streaming
and two-way calls counted at once (4), a Watch counted OK however it ended (12).
More: BOOTSTRAP_CALLS_DIFFERENTIAL_SEEDS=200 (BOOTSTRAP_CALLS_DIFFERENTIAL_FIRST_SEED to
shift them).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common import bootstrap, errors
from services.common.bootstrap import create_server
from tests.test_bootstrap_differential import _add, _counts, _timed, watch_health
from tests.waits import holds_within

SEEDS = int(os.environ.get("BOOTSTRAP_CALLS_DIFFERENTIAL_SEEDS", "3"))
FIRST = int(os.environ.get("BOOTSTRAP_CALLS_DIFFERENTIAL_FIRST_SEED", "0"))
LIMIT = 2048
CHARS, WIRE = 2048, 6144  # the documented caps of a status message
TOO_LARGE_PER_WINDOW, ENDED_PER_WINDOW = 1, 2  # the thinned instances' windows, made small
# What `rpc_ended` says of a call ended under its handler (a client gone, a deadline, a stop).
LEFT = {"client cancelled", "deadline exceeded",
        "the server stopped: its drain ended before this call did"}
SERVICE_NAME = "x.Calls"
METHODS = ("Unary", "Stream", "Gather", "Talk")
NS = health_pb2.HealthCheckResponse.NOT_SERVING
DOMAIN = {"InvalidArgument": "INVALID_ARGUMENT", "NotFound": "NOT_FOUND",
          "ResourceExhausted": "RESOURCE_EXHAUSTED", "FailedPrecondition": "FAILED_PRECONDITION",
          "Unavailable": "UNAVAILABLE", "Cancelled": "CANCELLED",
          "DeadlineExceeded": "DEADLINE_EXCEEDED"}
ABORTS = ("NOT_FOUND", "INTERNAL", "ABORTED", "OUT_OF_RANGE", "CANCELLED", "UNAVAILABLE")
PIECES = ("m", "é", "語", "😀", "%", "\n", "a%b", "ü✓")


def wire_size(text: str) -> int:
    """Bytes as gRPC sends a status message: printable ASCII but '%' as is, every other
    character percent-encoded, 3 bytes for each of its UTF-8 bytes."""
    return sum(1 if 32 <= ord(c) < 127 and c != "%" else 3 * len(c.encode()) for c in text)


def capped(text: str) -> str:
    """The documented cap, brute force: the text when within both limits, else its longest
    prefix of at most CHARS characters and WIRE - 64 bytes, and how many characters were cut."""
    if len(text) <= CHARS and wire_size(text) <= WIRE:
        return text
    keep = max(k for k in range(min(len(text), CHARS) + 1) if wire_size(text[:k]) <= WIRE - 64)
    return f"{text[:keep]}... ({len(text) - keep} characters cut)"


def _text(rng: random.Random) -> str:
    piece = rng.choice(PIECES)
    n = rng.choice([0, 1, 5, 500, 682, 683, 1024, 1500, 2040, 2047, 2048, 2049, 3000, 7000])
    n = max(1, n // len(piece)) if n else 0
    return (rng.choice(["", "why: "]) + piece * n)[:9000]


def _script(rng: random.Random, method: str, call: str) -> dict:
    sizes = [0, 10, LIMIT - 1, LIMIT, LIMIT + 1, LIMIT + 700]
    n = 1 if method in ("Unary", "Gather") else rng.choice([0, 1, 2, 4])
    out = [rng.choice(sizes) if rng.random() < 0.35 else rng.choice([0, 10, 200])
           for _ in range(n)]
    end = rng.choice(["ok"] * 3 + ["raise"] * 3 + ["plain", "abort", "abort", "late", "hold"])
    return {"id": call, "out": out, "end": end, "err": rng.choice(list(DOMAIN)),
            "msg": _text(rng), "code": rng.choice(ABORTS), "details": _text(rng),
            "work": rng.choice([0, 0, 0.005, 0.02])}


class Servicer:
    """Handlers that follow the script their call's first request carries, noting when each
    started and finished and what it raised or produced."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: dict[str, threading.Event] = {}
        self.finished: dict[str, float] = {}  # normal end (return, raise, abort): monotonic
        self.raised: dict[tuple, int] = {}  # (method, code or "plain") -> handlers that raised
        self.too_large: dict[str, int] = {}  # method -> responses over the limit produced
        self.scripts: dict[str, dict] = {}

    def script(self, raw: bytes) -> dict:
        """The script of the call whose id the request's first line names (scripts, long
        messages and all, stay here: the requests stay small)."""
        with self.lock:
            return self.scripts[raw.split(b"\n", 1)[0].decode()]

    def _start(self, s: dict) -> None:
        with self.lock:
            self.started.setdefault(s["id"], threading.Event()).set()

    def event(self, call: str) -> threading.Event:
        with self.lock:
            return self.started.setdefault(call, threading.Event())

    def _produced(self, method: str, s: dict, size: int) -> bytes:
        if size > LIMIT:  # refused by the interceptor: the call's outcome is settled here
            with self.lock:
                self.too_large[method] = self.too_large.get(method, 0) + 1
                self.finished.setdefault(s["id"], time.monotonic())
        return b"b" * size

    def _end(self, method: str, s: dict, context) -> None:
        if s["work"]:
            time.sleep(s["work"])
        if s["end"] == "late":
            time.sleep(0.3)
        if s["end"] == "hold":
            holds_within(lambda: not context.is_active(), 5, 0.003)
            return
        kind = {"raise": DOMAIN[s["err"]], "plain": "plain"}.get(s["end"])
        with self.lock:
            self.finished[s["id"]] = time.monotonic()
            if kind:
                self.raised[(method, kind)] = self.raised.get((method, kind), 0) + 1
        if s["end"] == "raise":
            name = s["err"]
            raise (errors.InvalidArgument("field", s["msg"]) if name == "InvalidArgument"
                   else getattr(errors, name)(s["msg"]))
        if s["end"] == "plain":
            raise RuntimeError("secret " + s["msg"])
        if s["end"] == "abort":
            context.abort(grpc.StatusCode[s["code"]], s["details"])

    def unary(self, raw: bytes, context) -> bytes:
        s = self.script(raw)
        self._start(s)
        self._end("Unary", s, context)
        return self._produced("Unary", s, s["out"][0])

    def stream(self, raw: bytes, context):
        s = self.script(raw)
        self._start(s)
        for size in s["out"]:
            yield self._produced("Stream", s, size)
        self._end("Stream", s, context)

    def gather(self, it, context) -> bytes:
        s = self.script(next(it))
        self._start(s)
        for _ in it:
            pass
        self._end("Gather", s, context)
        return self._produced("Gather", s, s["out"][0])

    def talk(self, it, context):
        s = self.script(next(it))
        self._start(s)
        for _ in it:
            pass
        for size in s["out"]:
            yield self._produced("Talk", s, size)
        self._end("Talk", s, context)


def refused(method: str, s: dict) -> bool:
    """Whether a stream's handler yields a response over the limit (refused: it goes no
    further)."""
    return method in ("Stream", "Talk") and any(n > LIMIT for n in s["out"])


def outcome(method: str, s: dict) -> tuple[str, str, int]:
    """(code, details, messages received) of a call that ran its handler to its end, no
    cancel, no cut, no deadline."""
    sent = 0
    if method in ("Stream", "Talk"):
        for size in s["out"]:
            if size > LIMIT:
                return ("RESOURCE_EXHAUSTED",
                        f"SERVER: Sent message larger than max ({size} vs. {LIMIT})", sent)
            sent += 1
    end = s["end"]
    if end == "raise":
        text = f"field: {s['msg']}" if s["err"] == "InvalidArgument" else s["msg"]
        return DOMAIN[s["err"]], capped(text), sent
    if end == "plain":
        return "INTERNAL", f"internal error in {method}; see server logs", sent
    if end == "abort":
        return s["code"], capped(s["details"] or f"{method} failed: {s['code']}"), sent
    if method in ("Unary", "Gather") and s["out"][0] > LIMIT:
        return ("RESOURCE_EXHAUSTED",
                f"SERVER: Sent message larger than max ({s['out'][0]} vs. {LIMIT})", 0)
    return "OK", "", sent + (1 if method in ("Unary", "Gather") else 0)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


class Run:
    def __init__(self, seed: int) -> None:
        self.seed, self.rng = seed, random.Random(seed)
        # Methods where a handler's domain error may have come after its call ended (its
        # client's cancel or deadline, a cut for a request over the limit): its line may say
        # the status the call ended with (CANCELLED, DEADLINE_EXCEEDED) rather than the one
        # raised (check_lines).
        self.raced: set[str] = set()
        self.service = f"calls-{seed}-{os.getpid()}-{time.monotonic_ns()}"
        self.servicer = Servicer()
        # Each call: (method, key of what the model allows). Counted per (method, code):
        self.exact: dict = {}  # counted exactly so
        self.either: list = []  # (method, {codes}, exactly one or at most one)
        self.timed_exact: dict = {}
        self.timed_loose: dict = {}
        self.h = create_server(service=self.service, address="127.0.0.1:0",
                               max_message_bytes=LIMIT, max_workers=12,
                               services=[(_add(self.servicer, SERVICE_NAME), None, SERVICE_NAME)])
        self.h.set_serving()
        self.ch = grpc.insecure_channel(self.h.address)
        self.n = 0

    def _head(self, s: dict) -> bytes:
        with self.servicer.lock:
            self.servicer.scripts[s["id"]] = s
        return s["id"].encode() + b"\n"

    def where(self, what: str) -> str:
        return f"seed {self.seed}, call {self.n}: {what}"

    def expect(self, method: str, codes: set, ran: bool, timed: bool | None = None) -> None:
        """One call counted under one of `codes` (exactly once when its handler ran, else at
        most once) and timed once when its handler ran."""
        timed = ran if timed is None else timed
        if len(codes) == 1 and ran:
            (code,) = codes
            self.exact[(method, code)] = self.exact.get((method, code), 0) + 1
        else:
            self.either.append((method, frozenset(codes), ran))
        if timed:
            self.timed_exact[method] = self.timed_exact.get(method, 0) + 1
        elif not ran:
            self.timed_loose[method] = self.timed_loose.get(method, 0) + 1

    def counts_fit(self, got: dict) -> bool:
        """Whether `got` is the exact counts plus one assignment of the loose calls."""
        rest = {k: v - self.exact.get(k, 0) for k, v in got.items()}
        if any(v < 0 for v in rest.values()) or any(
                k not in got for k, v in self.exact.items() if v):
            return False
        # Give each loose call a code, most constrained first (sets are tiny: greedy with
        # backtracking over at most a few dozen calls).
        loose = sorted(self.either, key=lambda e: len(e[1]))

        def place(i: int, rest: dict) -> bool:
            if i == len(loose):
                return not any(rest.values())
            method, codes, must = loose[i]
            for code in codes:
                if rest.get((method, code), 0) > 0:
                    rest[(method, code)] -= 1
                    if place(i + 1, rest):
                        return True
                    rest[(method, code)] += 1
            return not must and place(i + 1, rest)

        return place(0, dict(rest))

    def timed_fit(self, got: dict) -> bool:
        return all(self.timed_exact.get(m, 0) <= got.get(m, 0) <= self.timed_exact.get(m, 0)
                   + self.timed_loose.get(m, 0) for m in set(got) | set(self.timed_exact))

    def settle(self, before: dict, timed_before: dict) -> None:
        end = time.monotonic() + 5
        while True:
            got = {k: v - before.get(k, 0) for k, v in _counts(self.service).items()
                   if v - before.get(k, 0)}
            timed = {k: v - timed_before.get(k, 0) for k, v in _timed(self.service).items()
                     if v - timed_before.get(k, 0)}
            if self.counts_fit(got) and self.timed_fit(timed) or time.monotonic() > end:
                break
            time.sleep(0.02)
        assert self.counts_fit(got), self.where(
            f"counts {sorted(got.items())} != exact {sorted(self.exact.items())} + one of "
            f"{[(m, sorted(c), r) for m, c, r in self.either]}")
        assert self.timed_fit(timed), self.where(
            f"timed {timed} != {self.timed_exact} (+ at most {self.timed_loose})")

    # --- calls ---------------------------------------------------------------------------

    def _requests(self, s: dict, over_at: int | None, gate: _Never):
        """A client stream: the script, 0-3 requests (one over the limit at `over_at`), then
        open until `gate` closes."""
        head = self._head(s)
        sizes = [self.rng.choice([0, 10, LIMIT]) for _ in range(self.rng.randint(0, 3))]
        if over_at is not None:
            sizes.insert(min(over_at, len(sizes)), LIMIT + self.rng.choice([1, 300]))

        def gen():
            yield head
            for size in sizes:
                yield b"g" * size
            gate.wait(10)
        return gen()

    def call(self) -> None:
        self.n += 1
        rng = self.rng
        method = rng.choice(METHODS)
        cid = f"{self.seed}-{self.n}"
        s = _script(rng, method, cid)
        mode = rng.choice(["plain"] * 4 + ["cancel", "cancel", "deadline", "over"])
        if s["end"] == "hold" and mode == "plain":
            mode = "cancel"
        if s["end"] == "late":
            mode = "deadline"
        timeout = 0.15 if mode == "deadline" else 5.0
        over_at = rng.randint(0, 3) if mode == "over" else None
        gate = _Never()  # a client stream ends at once, or (some cancelled ones) stays open
        if mode != "cancel" or rng.random() < 0.5:
            gate.close()
        items: list = []
        result: dict = {}
        if method in ("Unary", "Stream"):
            head = self._head(s)
            raw = head + b"p" * ((LIMIT + rng.choice([1, 400]) - len(head))
                                 if mode == "over" else rng.choice([0, 10]))
            if method == "Unary":
                fut = self.ch.unary_unary(f"/{SERVICE_NAME}/Unary").future(
                    raw, timeout=timeout)
            else:
                fut = self.ch.unary_stream(f"/{SERVICE_NAME}/Stream")(raw, timeout=timeout)
        else:
            reqs = self._requests(s, over_at, gate)
            if method == "Gather":
                fut = self.ch.stream_unary(f"/{SERVICE_NAME}/Gather").future(
                    reqs, timeout=timeout)
            else:
                fut = self.ch.stream_stream(f"/{SERVICE_NAME}/Talk")(reqs, timeout=timeout)

        def read() -> None:
            try:
                if method in ("Unary", "Gather"):
                    items.append(fut.result())
                else:
                    for m in fut:
                        items.append(m)
                result["code"], result["details"] = "OK", ""
            except grpc.RpcError as exc:
                result["code"], result["details"] = exc.code().name, exc.details()
            except grpc.FutureCancelledError:
                result["code"], result["details"] = "CANCELLED", ""

        t = threading.Thread(target=read)
        t.start()
        cancelled_at = None
        if mode == "cancel":
            if rng.random() < 0.5:
                self.servicer.event(cid).wait(2)
            time.sleep(rng.choice([0, 0.001, 0.005, 0.02]))
            cancelled_at = time.monotonic()
            fut.cancel()
        t.join(10)
        gate.close()
        assert not t.is_alive(), self.where(f"{method} {mode} never ended")
        code, details = result["code"], result["details"]
        self._judge(method, s, mode, code, details, items, cancelled_at)

    def _judge(self, method, s, mode, code, details, items, cancelled_at) -> None:
        started = self.servicer.event(s["id"]).is_set()
        if mode == "over":
            assert code == "RESOURCE_EXHAUSTED" and "larger than max" in details, \
                self.where(f"{method} request over the limit: {code} {details!r}")
            if method in ("Unary", "Stream"):
                assert not started, self.where("a handler ran for a request over the limit")
                self.expect(method, {c for c in ("RESOURCE_EXHAUSTED", "CANCELLED",
                                                 "INTERNAL")}, ran=False, timed=False)
            else:  # counted CANCELLED once the call has ended (known gap)
                self.expect(method, {"CANCELLED"}, ran=started)
                self._may_raise_after_end(method, s)  # (its requests may just end at the cut)
            return
        want, want_details, n_items = outcome(method, s)
        # (a refused stream ends before its deadline)
        if mode == "deadline" and not refused(method, s):
            if s["end"] in ("late", "hold"):
                assert code == "DEADLINE_EXCEEDED", self.where(f"{method} late: {code}")
                self.expect(method, {"DEADLINE_EXCEEDED"}, ran=started)
                return
            if code == "DEADLINE_EXCEEDED":  # a loaded host: the handler was not done yet
                self.expect(method, {"DEADLINE_EXCEEDED", want}, ran=started)
                self._may_raise_after_end(method, s)
                return
        if mode == "cancel" and code == "CANCELLED" and (want, want_details) != (
                "CANCELLED", details):
            # Yet to start or at work when cancelled: a client stream's requests may just end
            # at the cancel (gRPC sees its stream end before the cancel), the handler goes on.
            self._may_raise_after_end(method, s)
            if not started:
                self.expect(method, {"CANCELLED", want}, ran=False, timed=None)
                return
            finished = self.servicer.finished.get(s["id"])
            # Held, or at work when cancelled: CANCELLED. But a unary or server-stream handler
            # at work when its client saw CANCELLED may end before the cancel reaches the
            # server (a loaded host: 1 run in 40), and is counted as it ended. (A client
            # stream's is counted when the call has ended, after the cancel.)
            sure = s["end"] == "hold" or method in ("Gather", "Talk")
            if finished is None and sure:
                self.expect(method, {"CANCELLED"}, ran=True)
            else:  # the handler's end and the cancel raced: either is what happened
                self.expect(method, {"CANCELLED", want}, ran=True)
            return
        assert (code, details) == (want, want_details), self.where(
            f"{method} {s['end']} {mode} out={s['out']}: got {code} {details[:60]!r} "
            f"({len(details)} chars), model {want} {want_details[:60]!r} "
            f"({len(want_details)} chars)")
        assert wire_size(details) <= WIRE, self.where("a status message over 6 KiB")
        assert len(items) == n_items, self.where(f"{method}: {len(items)} messages, "
                                                 f"model {n_items}")
        self.expect(method, {want}, ran=True)

    def _may_raise_after_end(self, method: str, s: dict) -> None:
        """A handler that may raise its domain error once its call has ended (its client
        cancelled, its deadline passed, a request over the limit cut it): logged under the
        status the call ended with. (A stream refused for its size never reaches its end.)"""
        if s["end"] == "raise" and not refused(method, s):
            self.raced.add(method)

    def watch(self) -> None:
        """A Watch its client cancels, or one past its deadline."""
        self.n += 1
        late = self.rng.random() < 0.4
        stream, t, seen = watch_health(self.ch, timeout=0.2 if late else 5)
        if not late:
            holds_within(lambda: seen, 5, 0.003)
            stream.cancel()
        t.join(5)
        want = "DEADLINE_EXCEEDED" if late else "CANCELLED"
        assert seen and seen[-1] == want, self.where(f"Watch {seen}")
        # A late Watch that got no first status may have reached its deadline before its
        # handler ran (a loaded host): gRPC ends such a call itself, uncounted (at most once).
        self.expect("Watch", {want}, ran=not late or len(seen) > 1)

    def stop(self) -> None:
        """Held calls, calls that finish within the grace, and open Watches; then a stop."""
        rng = self.rng
        grace = rng.choice([0, 0, 0.3])
        watches = [watch_health(self.ch, timeout=10) for _ in range(rng.randint(0, 3))]
        for _, _, seen in watches:
            holds_within(lambda seen=seen: seen, 5, 0.003)
        held: list = []
        for i in range(rng.randint(0, 3)):
            method = rng.choice(METHODS)
            quick = rng.random() < 0.4
            s = {"id": f"{self.seed}-stop-{i}", "out": [10], "end": "ok" if quick else "hold",
                 "err": "NotFound", "msg": "", "code": "ABORTED", "details": "",
                 "work": 0.05 if quick else 0}
            head = self._head(s)
            res: dict = {}
            gate = _Never()

            def run(method=method, head=head, res=res, gate=gate) -> None:
                try:
                    if method == "Unary":
                        self.ch.unary_unary(f"/{SERVICE_NAME}/Unary")(head, timeout=10)
                    elif method == "Stream":
                        list(self.ch.unary_stream(f"/{SERVICE_NAME}/Stream")(head, timeout=10))
                    elif method == "Gather":
                        self.ch.stream_unary(f"/{SERVICE_NAME}/Gather")(
                            _open(head, gate), timeout=10)
                    else:
                        list(self.ch.stream_stream(f"/{SERVICE_NAME}/Talk")(
                            _open(head, gate), timeout=10))
                    res["code"] = "OK"
                except grpc.RpcError as exc:
                    res["code"] = exc.code().name
            t = threading.Thread(target=run)
            t.start()
            assert self.servicer.event(s["id"]).wait(5), self.where("held call never started")
            held.append((method, s, res, t, gate))
        # a quick Gather/Talk needs its request stream closed to end within the grace
        for _method, s, _res, _t, gate in held:
            if s["end"] == "ok":
                gate.close()
        self.h.stop(grace)
        for method, s, res, t, gate in held:
            gate.close()
            t.join(10)
            quick_in_time = s["end"] == "ok" and grace
            if quick_in_time:
                assert res.get("code") == "OK", self.where(f"{method} within the grace: {res}")
                self.expect(method, {"OK"}, ran=True)
            elif s["end"] == "ok":  # stop(0): cut, or done before the cut (0.05 s of work)
                assert res.get("code") in ("UNAVAILABLE", "OK"), self.where(f"{method} {res}")
                self.expect(method, {res["code"]}, ran=True)
            else:
                assert res.get("code") == "UNAVAILABLE", self.where(f"{method} held: {res}")
                self.expect(method, {"UNAVAILABLE"}, ran=True)
        for _, t, seen in watches:
            t.join(10)
            assert seen[-2:] == [NS, "ended"], self.where(f"Watch at stop({grace}): {seen}")
            self.expect("Watch", {"OK"}, ran=True)


class _Never:
    """A gate a request stream waits on until `close` (the call's end)."""

    def __init__(self) -> None:
        self.ev = threading.Event()

    def wait(self, timeout: float) -> bool:
        return self.ev.wait(timeout)

    def close(self) -> None:
        self.ev.set()


def _open(head: bytes, gate: _Never):
    yield head
    gate.wait(10)


def run_seed(seed: int) -> None:
    lines = Lines()
    logger = logging.getLogger(bootstrap.__name__)
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    too_large, ended = bootstrap._TOO_LARGE_LINES, bootstrap._ERROR_LINES
    windows = (too_large.per_window, ended.per_window)
    too_large.per_window, ended.per_window = TOO_LARGE_PER_WINDOW, ENDED_PER_WINDOW
    t0 = time.monotonic()
    run = None
    try:
        run = Run(seed)
        before, timed_before = _counts(run.service), _timed(run.service)
        for _ in range(run.rng.randint(12, 25)):
            if run.rng.random() < 0.85:
                run.call()
            else:
                run.watch()
        run.settle(before, timed_before)
        run.stop()
        run.settle(before, timed_before)
    finally:
        too_large.per_window, ended.per_window = windows
        logger.removeHandler(lines)
        logger.setLevel(level)
        if run is not None:
            run.h.stop(0)
            run.ch.close()
    if time.monotonic() - t0 < 9:  # within one window of the thinned lines (10 s)
        check_lines(run, lines.records)


def check_lines(run: Run, records: list) -> None:
    """One WARNING per response over the limit, per method up to its window, then one count
    line at WARNING; one INFO "ended" line per domain error, likewise; an ERROR per plain
    exception only."""
    svc, sv = run.service, run.servicer
    for method in METHODS:
        n = sv.too_large.get(method, 0)
        said = [r for r in records if r[1].startswith(f"{method}: a response of ")]
        assert len(said) == min(n, TOO_LARGE_PER_WINDOW), run.where(
            f"{method}: {len(said)} too-large lines for {n}")
        assert all(lv == logging.WARNING for lv, _ in said)
        counted = [r for r in records if r[1].startswith(f"{svc}/{method}: ")]
        left = n - TOO_LARGE_PER_WINDOW
        assert [(lv, int(m.split(": ")[1].split()[0])) for lv, m in counted] == (
            [(logging.WARNING, left)] if left > 0 else []), run.where(
            f"{method}: count lines {counted} for {n} refusals")
        if method in run.raced:
            # A domain error that raced its client's cancel or deadline is logged (and thinned)
            # under the status the client got: per code only an upper bound holds.
            raised = {c for (m, c) in sv.raised if m == method}
            for lv, m in records:
                if m.startswith(f"{method} ended ") and m.split(": ", 1)[1] not in LEFT:
                    code = m[len(f"{method} ended "):].split(":", 1)[0]
                    assert lv == logging.INFO and code in raised | {
                        "CANCELLED", "DEADLINE_EXCEEDED"}, run.where(f"{method}: {m[:80]}")
            continue
        for code in set(DOMAIN.values()):
            n = sv.raised.get((method, code), 0)
            # (A stream its client left says so too, thinned apart: not a domain error.)
            said = [r for r in records if r[1].startswith(f"{method} ended {code}: ")
                    and r[1].split(": ", 1)[1] not in LEFT]
            assert len(said) == min(n, ENDED_PER_WINDOW), run.where(
                f"{method} {code}: {len(said)} ended lines for {n}")
            counted = [r for r in records if r[1].startswith(f"{svc}/{method}/{code}: ")]
            left = n - ENDED_PER_WINDOW
            assert [(lv, int(m.split(": ")[1].split()[0])) for lv, m in counted] == (
                [(logging.INFO, left)] if left > 0 else []), run.where(
                f"{method} {code}: count lines {counted} for {n}")
    plain = sum(sv.raised.get((m, "plain"), 0) for m in METHODS)
    errs = [m for lv, m in records if lv >= logging.ERROR]
    assert len(errs) == plain and all(m.startswith("unhandled error in") for m in errs), \
        run.where(f"{len(errs)} ERROR lines for {plain} plain exceptions: {errs[:3]}")


@pytest.fixture
def many_open_streams(monkeypatch):
    monkeypatch.setattr(bootstrap, "MAX_OPEN_STREAMS_PER_PEER", 8)
    monkeypatch.setattr(bootstrap, "MAX_OPEN_STREAMS", 8)


@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_every_call_is_answered_counted_and_logged_as_the_model_says(seed, many_open_streams):
    run_seed(seed)
