"""A differential review of the common server start-up (`bootstrap.create_server`, its
interceptor, health, drain) and `reaper.StreamReaper`: seeded random scripts against a model
of the documented rules, every answer compared after every call.

The servicer here registers a unary, a server-streaming, a client-streaming and a two-way
method through `create_server`, as the services do, over real loopback gRPC. Each call carries
its script: return (after k messages for streams), return a last message around the 2 KiB
limit, raise one of the domain errors or a plain exception (messages empty, short, or around
MAX_DETAILS_CHARS), abort with a code, sleep past the caller's deadline, wait for the caller
to cancel, stay open past OPEN_STREAM_MAX_S (two-way, shortened here: the reaper ends it),
with requests and client-stream messages of random sizes around a 2 KiB `max_message_bytes`.
Callers come with the internal credential right, wrong, missing, given twice or malformed,
and with an `x-request-id` plain, 128 or 129 characters, with odd characters, empty or
missing. Health status changes, checks and Watches its client cancels, `/healthz` and
`/metrics`, and a drain (begin_drain, stop with a call still running) come between the calls.

The model, from the module docstrings, docs/deploy.md, docs/metrics.md and docs/reliability.md:
- the status and details each call gets: a domain error's code and message (cut past
  MAX_DETAILS_CHARS, saying how many characters), the Overloaded and PinRefused trailers, a
  plain exception INTERNAL "internal error in <method>; see server logs" (no traceback, no text
  of the exception), an abort's code and details ("<method> failed: <CODE>" when it gave none),
  UNAUTHENTICATED before the handler runs, DEADLINE_EXCEEDED, CANCELLED, RESOURCE_EXHAUSTED
  past the size limit (a response over it: "SERVER: Sent message larger than max (N vs.
  2048)", gRPC's words), UNAVAILABLE once stopped or when the stop's grace cut the call;
- the handler sees the caller's request id when plain (1-128 of [A-Za-z0-9._:-]), else a fresh
  16-hex one, the same at every step of a stream and while its generator closes;
- tiercache_rpc_total counts every call under the code its client got (a client stream cut
  by a too-large request: CANCELLED, a known gap), tiercache_rpc_seconds times every call that
  reached its handler, Health.Watch included, and `/metrics` says the same;
- health: NOT_SERVING until set_serving, then what the last set_serving said, NOT_SERVING for
  good once a drain began (requests still served), `/healthz` 200 SERVING / 503 NOT_SERVING;
  a Watch sees no status twice in a row and ends on NOT_SERVING when the server stops, with
  a grace or none (counted OK);
- run_until_signal: SIGTERM -> NOT_SERVING while calls are still served for the drain delay
  -> stopped, new calls refused;
- StreamReaper: every call armed and not disarmed is ended once, not before its time; a
  disarmed one never.
Where the docs are silent (how a unary or server-stream call refused for its request's size
is counted) only invariants are asserted: the client's status, at most one count, never OK.

Found (each fixed in its own commit, with a deterministic test in test_bootstrap_rules.py):
a unary or stream handler finishing after its client's deadline, or cut by the stop, was
counted OK; client-streaming methods were neither mapped, counted nor timed, and a domain error
in a client-streaming or two-way method reached the client as UNKNOWN with its text; a handler
that set a code and returned (health's Check of an unknown name) was counted OK.
Left open then and fixed since (docs/reliability.md item 101): a client stream cut by a
too-large message could look complete to its handler, which answered (counted OK) while the
client got RESOURCE_EXHAUSTED, now counted CANCELLED once the call has ended; an over-limit
response was counted OK (a stream's CANCELLED); Health.Watch was not counted; with stop(0) a
Watch could be cut (UNAVAILABLE) before its end was sent. A reaped reflection stream counted
OK was fixed. Two harness errors found on the way: a server stream cancelled before any read
may never reach its handler (gRPC runs none), so a held stream reads one message first; a
call's time comes a moment after its count, so settling waits for both.
Run here: 210 seeds of the main test, 25 of the drain, 150 of the reaper (seeds 1000-1149),
then 200 of each (seeds 0-199; the drain 33) after item 101's fixes and 200 more of the main
test (seeds 200-399, with the cancelled Watches), all equal to the model (~1.5-2.5 s a seed).
More: BOOTSTRAP_DIFFERENTIAL_SEEDS=150 (BOOTSTRAP_DIFFERENTIAL_FIRST_SEED to shift them; the
drain runs SEEDS // 6).
"""

from __future__ import annotations

import builtins
import json
import os
import random
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common import bootstrap, errors
from services.common.bootstrap import create_server
from services.common.logs import request_id_var
from services.common.metrics import RPC_SECONDS, RPC_TOTAL
from services.common.reaper import StreamReaper
from tests.waits import holds_within

SEEDS = int(os.environ.get("BOOTSTRAP_DIFFERENTIAL_SEEDS", "3"))
FIRST = int(os.environ.get("BOOTSTRAP_DIFFERENTIAL_FIRST_SEED", "0"))
LIMIT = 2048  # max_message_bytes here: sizes around it are cheap
DETAILS_MAX = 2048  # MAX_DETAILS_CHARS, as docs say it: longer messages are cut
DEADLINE_S, LATE_S = 0.2, 0.4
OPEN_MAX_S = 0.3  # OPEN_STREAM_MAX_S, shortened
TOKEN = "diff-internal-credential"
PLAIN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
FRESH_ID = re.compile(r"[0-9a-f]{16}")
SERVICE_NAME = "x.Diff"
METHODS = ("Unary", "Stream", "Gather", "Talk")
NS, OK = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING

# Each domain error and the code the docs give it (errors.py: `code`); plain ones are INTERNAL.
DOMAIN = {"InvalidArgument": "INVALID_ARGUMENT", "NotFound": "NOT_FOUND",
          "ResourceExhausted": "RESOURCE_EXHAUSTED", "Overloaded": "RESOURCE_EXHAUSTED",
          "PinRefused": "RESOURCE_EXHAUSTED", "FailedPrecondition": "FAILED_PRECONDITION",
          "Unavailable": "UNAVAILABLE", "DeadlineExceeded": "DEADLINE_EXCEEDED",
          "Unauthenticated": "UNAUTHENTICATED", "PermissionDenied": "PERMISSION_DENIED",
          "Cancelled": "CANCELLED", "TierCacheError": "INTERNAL"}
PLAIN_ERRORS = ("RuntimeError", "ValueError", "KeyError", "ZeroDivisionError")
ABORT_CODES = [c.name for c in grpc.StatusCode if c != grpc.StatusCode.OK]


def _msg(s: dict) -> str:
    text, times = s["msg"]
    return text * times


def _error(name: str, msg: str) -> BaseException:
    if name == "InvalidArgument":
        return errors.InvalidArgument("field", msg)
    if name == "PinRefused":
        return errors.PinRefused(msg, 7, 3, 4)
    if name in PLAIN_ERRORS:
        return getattr(builtins, name)("secret-detail " + msg)
    return getattr(errors, name)(msg)


class Servicer:
    """Handlers that follow the script their call carries, noting the request id they see."""

    def __init__(self) -> None:
        self.ids: dict[str, list[str]] = {}
        self.started: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def note(self, call: str) -> None:
        with self.lock:
            self.ids.setdefault(call, []).append(request_id_var.get())
            self.started.setdefault(call, threading.Event()).set()

    def finish(self, s: dict, context) -> bytes:
        act = s["act"]
        if act in ("late", "late_raise"):
            time.sleep(LATE_S)
        if act in ("raise", "late_raise"):
            raise _error(s["err"], _msg(s))
        if act == "abort":
            context.abort(grpc.StatusCode[s["code"]], s["details"])
        if act == "hold":  # until the client cancels (or the stop cuts it)
            holds_within(lambda: not context.is_active(), 5, 0.005)
        self.note(s["id"])
        return b"b" * s["size"] if act == "big" else b"done"

    def unary(self, raw: bytes, context) -> bytes:
        s = json.loads(raw.split(b"\n", 1)[0])
        self.note(s["id"])
        return self.finish(s, context)

    def stream(self, raw: bytes, context):
        s = json.loads(raw.split(b"\n", 1)[0])
        self.note(s["id"])
        try:
            for i in range(s["k"]):
                yield b"item-%d" % i
                self.note(s["id"])
            if s["act"] == "hold":
                while True:
                    yield b"more"
                    time.sleep(0.002)
            last = self.finish(s, context)
            if s["act"] == "big":
                yield last
        finally:
            self.note(s["id"])  # closed (client gone) under its id too

    def gather(self, it, context) -> bytes:
        s = json.loads(next(it).split(b"\n", 1)[0])
        self.note(s["id"])
        sizes = [len(m) for m in it]
        last = self.finish(s, context)
        return last if s["act"] == "big" else b"got:%d:%d" % (len(sizes), sum(sizes))

    def talk(self, it, context):
        s = json.loads(next(it))
        self.note(s["id"])
        for _ in range(s["k"]):
            m = next(it)
            self.note(s["id"])
            yield b"echo:" + m
        if s["act"] == "open":
            next(it)  # the client sends nothing more and keeps the stream open
        last = self.finish(s, context)
        if s["act"] == "big":
            yield last


def _add(servicer, name: str = SERVICE_NAME):
    """`servicer`'s four methods (unary, stream, gather, talk) as the service `name`."""
    def add(_unused, srv) -> None:
        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {
            "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
            "Stream": grpc.unary_stream_rpc_method_handler(servicer.stream),
            "Gather": grpc.stream_unary_rpc_method_handler(servicer.gather),
            "Talk": grpc.stream_stream_rpc_method_handler(servicer.talk)}),))
    return add


def _counts(service: str) -> dict:
    return {(s.labels["method"], s.labels["code"]): s.value for m in RPC_TOTAL.collect()
            for s in m.samples if s.name.endswith("_total") and s.labels["service"] == service}


def _timed(service: str) -> dict:
    return {s.labels["method"]: s.value for m in RPC_SECONDS.collect() for s in m.samples
            if s.name.endswith("_count") and s.labels["service"] == service}


def _delta(now: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


class Model:
    """What the docs say each call gets and how it is counted."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.counts: dict = {}
        self.timed: dict = {}
        self.loose: dict = {}  # method -> calls counted at most once, under a code not OK
        self.timed_loose: dict = {}  # method -> calls timed at most once
        self.serving = False
        self.draining = False

    def accepted(self, md: list) -> bool:
        auth = [v for k, v in md if k == "authorization"]
        return not self.token or auth == [f"Bearer {self.token}"]

    def count(self, method: str, code: str, timed: bool = True) -> None:
        self.counts[(method, code)] = self.counts.get((method, code), 0) + 1
        if timed:
            self.timed[method] = self.timed.get(method, 0) + 1

    def outcome(self, method: str, s: dict) -> tuple[str, str]:
        """(code, details) of a call that reached its handler and was not cut or cancelled."""
        act = s["act"]
        if act in ("late", "late_raise"):
            return "DEADLINE_EXCEEDED", "Deadline Exceeded"
        if act == "open":
            return "DEADLINE_EXCEEDED", (f"{method}: open for {OPEN_MAX_S:g} s, the most a "
                                         "stream may be; open another")
        if act in ("ok", "hold") or act == "big" and s["size"] <= LIMIT:
            return "OK", ""
        if act == "big":  # gRPC's refusal of a response over its send limit, and its words
            return ("RESOURCE_EXHAUSTED",
                    f"SERVER: Sent message larger than max ({s['size']} vs. {LIMIT})")
        if act == "abort":
            return s["code"], s["details"] or f"{method} failed: {s['code']}"
        if s["err"] in PLAIN_ERRORS:
            return "INTERNAL", f"internal error in {method}; see server logs"
        text = f"field: {_msg(s)}" if s["err"] == "InvalidArgument" else _msg(s)
        if len(text) > DETAILS_MAX:
            text = f"{text[:DETAILS_MAX]}... ({len(text) - DETAILS_MAX} characters cut)"
        return DOMAIN[s["err"]], text


def _script(rng: random.Random, method: str, call: str) -> dict:
    acts = ["ok"] * 4 + ["raise"] * 4 + ["abort"] * 2 + ["late", "late_raise", "hold", "big"]
    if method == "Talk":
        acts = [a for a in acts if a not in ("hold",)] + ["open"]
    act = rng.choice(acts)
    # (text, times): the script stays small whatever the message's length
    msg = rng.choice([("", 1), ("why: not here", 1), ("é ünïcode ✓", 1), ("m", DETAILS_MAX),
                      ("m", DETAILS_MAX + 1), ("x", rng.randint(DETAILS_MAX - 20, 5000))])
    return {"id": call, "act": act, "k": rng.choice([0, 0, 1, 2, 5]),
            "err": rng.choice([*DOMAIN, *PLAIN_ERRORS]), "msg": msg,
            "code": rng.choice(ABORT_CODES), "details": rng.choice(["", "field: aborted", "d"]),
            "size": rng.choice([0, LIMIT - 1, LIMIT, LIMIT + 1, LIMIT + 500])}


def _metadata(rng: random.Random) -> tuple[list, str | None]:
    auth = rng.choice([
        [("authorization", f"Bearer {TOKEN}")], [("authorization", f"Bearer {TOKEN}")], [],
        [("authorization", "Bearer nope")], [("authorization", f"Bearer {TOKEN}")] * 2,
        [("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer nope")],
        [("authorization", f"bearer {TOKEN}")], [("authorization", f"Bearer {TOKEN} ")],
        [("authorization", TOKEN)], [("authorization", "")]])
    alphabet = "abcXYZ0189._:-"
    rid = rng.choice([None, "", "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))),
                      "r" * 128, "r" * 129, "has space", "semi;colon", "slash/id", "x" * 300])
    return auth + ([("x-request-id", rid)] if rid is not None else []), rid


def _size(rng: random.Random) -> int:
    return rng.choice([0, 1, 100, LIMIT - 1, LIMIT, LIMIT, LIMIT + 1, LIMIT + 300, 700])


def _padded(s: dict, size: int) -> bytes:
    head = json.dumps(s).encode() + b"\n"
    return head + b"p" * max(0, size - len(head))


class Run:
    """One seed: a server, its model, and the calls."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.service = f"diff-{seed}"
        self.model = Model(TOKEN if self.rng.random() < 0.75 else None)
        self.servicer = Servicer()
        self.before, self.timed_before = _counts(self.service), _timed(self.service)
        self.h = create_server(service=self.service, address="127.0.0.1:0",
                               internal_token=self.model.token, metrics_port=0,
                               max_message_bytes=LIMIT, max_workers=8,
                               services=[(_add(self.servicer), None, SERVICE_NAME)])
        self.ch = grpc.insecure_channel(self.h.address)
        self.n = 0

    def where(self, what: str) -> str:
        return f"seed {self.seed}, step {self.n}: {what}"

    def settle(self) -> None:
        """Counts of calls that ended under their handler come once the handler returned (a
        client stream's and a two-way stream's once the call has ended), each call's time
        when its handler returned: both are waited for."""
        want, want_t, loose_t = self.model.counts, self.model.timed, self.model.timed_loose

        def timed_ok(timed: dict) -> bool:
            return all(want_t.get(m, 0) <= timed.get(m, 0) <= want_t.get(m, 0)
                       + loose_t.get(m, 0) for m in set(timed) | set(want_t))

        holds_within(lambda: self._matches(_delta(_counts(self.service), self.before), want)
                     and timed_ok(_delta(_timed(self.service), self.timed_before)), 5)
        got = _delta(_counts(self.service), self.before)
        assert self._matches(got, want), self.where(f"counts {got} != model {want} "
                                                    f"(+ at most {self.model.loose} not OK)")
        timed = _delta(_timed(self.service), self.timed_before)
        assert timed_ok(timed), self.where(f"timed {timed} != {want_t} (+ at most {loose_t})")

    def _matches(self, got: dict, want: dict) -> bool:
        extra: dict = {}
        for key in set(got) | set(want):
            d = got.get(key, 0) - want.get(key, 0)
            if d < 0:
                return False
            extra[key[0]] = extra.get(key[0], 0) + d
            if key[1] == "OK":
                extra[(key[0], "OK")] = d
        return all(extra.get(m, 0) <= self.model.loose.get(m, 0)
                   and not extra.get((m, "OK"), 0)
                   for m in {k[0] for k in set(got) | set(want)})

    def call(self) -> None:
        self.n += 1
        rng, model = self.rng, self.model
        method = rng.choice(METHODS)
        if method == "Talk":
            # Two-way streams of one client are capped (MAX_OPEN_STREAMS_PER_PEER): the late
            # ones before must have ended, which settling waits for.
            self.settle()
        call_id = f"{self.seed}-{self.n}"
        s = _script(rng, method, call_id)
        md, rid = _metadata(rng)
        accepted = model.accepted(md)
        timeout = DEADLINE_S if s["act"] in ("late", "late_raise") else 5.0
        over = False
        items: list = []
        code, details, err = "OK", "", None
        try:
            if method in ("Unary", "Stream"):
                size = _size(rng)
                raw = _padded(s, size)
                over = len(raw) > LIMIT
                timeout = 5.0 if over else timeout  # a refusal for size takes ~0.1-0.3 s
                if method == "Unary":
                    fn = self.ch.unary_unary(f"/{SERVICE_NAME}/Unary")
                    if s["act"] == "hold" and accepted and not over:
                        fut = fn.future(raw, timeout=timeout, metadata=md)
                        assert self._started(call_id), self.where("hold never started")
                        fut.cancel()
                        code = "CANCELLED"
                    else:
                        items = [fn(raw, timeout=timeout, metadata=md)]
                else:
                    stream = self.ch.unary_stream(f"/{SERVICE_NAME}/Stream")(
                        raw, timeout=timeout, metadata=md)
                    if s["act"] == "hold" and accepted and not over:
                        # One message read at least: a stream cancelled at once may
                        # never reach its handler (gRPC runs none for a call ended first).
                        want = rng.randint(0 if s["k"] else 1, 3)
                        items = [next(stream) for _ in range(s["k"] + want)]
                        stream.cancel()
                        code = "CANCELLED"
                    else:
                        for item in stream:  # kept as they come: an error ends the loop
                            items.append(item)
            elif method == "Gather":
                sizes = [rng.choice([0, 10, LIMIT, LIMIT + 1, 500])
                         for _ in range(rng.randint(0, 4))]
                first = _padded(s, rng.choice([0, LIMIT]))
                over = any(n > LIMIT for n in sizes)
                timeout = 5.0 if over else timeout
                msgs = [first] + [b"g" * n for n in sizes]
                fn = self.ch.stream_unary(f"/{SERVICE_NAME}/Gather")
                if s["act"] == "hold" and accepted and not over:
                    fut = fn.future(iter(msgs), timeout=timeout, metadata=md)
                    assert self._started(call_id), self.where("hold never started")
                    fut.cancel()
                    code = "CANCELLED"
                else:
                    items = [fn(iter(msgs), timeout=timeout, metadata=md)]
                    assert items == ([b"b" * s["size"]] if s["act"] == "big" else
                                     [b"got:%d:%d" % (len(sizes), sum(sizes))])
            else:
                release = threading.Event()

                def requests():
                    yield json.dumps(s).encode()
                    for i in range(s["k"]):
                        yield b"m%d" % i
                    release.wait(5)  # the stream stays open until its call ended

                try:
                    for item in self.ch.stream_stream(f"/{SERVICE_NAME}/Talk")(
                            requests(), timeout=timeout, metadata=md):
                        items.append(item)
                finally:
                    release.set()
        except grpc.RpcError as exc:
            err = exc
            code, details = exc.code().name, exc.details()
        if over and not accepted and method == "Gather":
            # The refusal and the too-large message race: either status, counted once.
            assert code in ("UNAUTHENTICATED", "RESOURCE_EXHAUSTED"), self.where(code)
            model.loose[method] = model.loose.get(method, 0) + 1
            return
        if not accepted and not (over and method != "Gather"):
            assert (code, details) == ("UNAUTHENTICATED",
                                       "authorization: missing or wrong internal credential"), \
                self.where(f"{method} refused as {code} {details!r}")
            assert call_id not in self.servicer.ids, self.where("handler ran unauthenticated")
            model.count(method, "UNAUTHENTICATED", timed=False)
            return
        if over:
            assert code == "RESOURCE_EXHAUSTED" and "larger than max" in details, \
                self.where(f"{method} over the limit: {code} {details!r}")
            if method == "Gather":
                # Its handler reads the stream and finds it cut where the too-large message
                # was: counted CANCELLED, once the call has ended, while the client gets
                # RESOURCE_EXHAUSTED (gRPC tells the server no more than "cancelled";
                # docs/reliability.md, known gaps).
                model.count(method, "CANCELLED")
            else:  # refused before its handler: the docs do not say how it is counted
                model.loose[method] = model.loose.get(method, 0) + 1
                assert call_id not in self.servicer.ids, self.where("handler ran over limit")
            return
        if s["act"] == "hold":
            model.count(method, "CANCELLED")
            self._ids(call_id, rid)
            return
        want_code, want_details = model.outcome(method, s)
        if want_details == "Deadline Exceeded" and "Deadline Exceeded" in details:
            want_details = details  # the client's own words ("Stream removed (...)" too)
        assert (code, details) == (want_code, want_details), \
            self.where(f"{method} {s['act']} {s['err'] if 'raise' in s['act'] else ''}: got "
                       f"{code} {details[:80]!r}, model {want_code} {want_details[:80]!r}")
        assert "Traceback" not in details and "secret-detail" not in details
        big = [b"b" * s["size"]] if s["act"] == "big" and want_code == "OK" else []
        if method == "Stream":
            k = s["k"] if want_code == "OK" or s["act"] in ("raise", "abort", "big") else None
            if k is not None:
                assert items == [b"item-%d" % i for i in range(k)] + big, \
                    self.where(f"items {items}")
        if method == "Talk" and s["act"] in ("ok", "raise", "abort", "big"):
            assert items == [b"echo:m%d" % i for i in range(s["k"])] + big, self.where(f"{items}")
        if err is not None:
            trailers = s["act"] in ("raise", "late_raise") and s["err"]
            assert errors.overloaded(err) == (trailers == "Overloaded" and code != "DEADLINE"
                                              "_EXCEEDED"), self.where("overloaded trailer")
            work = (7, 3, 4) if trailers == "PinRefused" and s["act"] == "raise" else (0, 0, 0)
            assert errors.prefill_work(err) == work, self.where("PinRefused trailers")
        if self._ids(call_id, rid, late=s["act"] in ("late", "late_raise")):
            model.count(method, want_code)

    def _started(self, call_id: str) -> bool:
        with self.servicer.lock:
            ev = self.servicer.started.setdefault(call_id, threading.Event())
        return ev.wait(5)

    def _ids(self, call_id: str, rid: str | None, late: bool = False) -> bool:
        """The id every step of the handler saw: the caller's when plain, else a fresh one.
        False when the handler of a call with a short deadline never ran (on a loaded
        machine its deadline can pass first: gRPC then runs, counts and times nothing)."""
        end = time.monotonic() + (1 if late else 5)
        while True:  # a late handler notes its last step after the client's status
            with self.servicer.lock:
                seen = list(self.servicer.ids.get(call_id, []))
            if seen or time.monotonic() > end:
                break
            time.sleep(0.01)
        if late and not seen:
            return False
        assert seen and len(set(seen)) == 1, self.where(f"ids {seen}")
        if rid is not None and PLAIN_ID.fullmatch(rid):
            assert seen[0] == rid, self.where(f"id {seen[0]!r} for {rid!r}")
        else:
            assert FRESH_ID.fullmatch(seen[0]), self.where(f"fresh id {seen[0]!r}")
        return True

    def health(self) -> None:
        self.n += 1
        rng, model = self.rng, self.model
        op = rng.choice(["serve", "serve", "check", "check", "http", "watch"])
        if op == "serve":
            on = rng.random() < 0.6
            self.h.set_serving(on)
            model.serving = on and not model.draining
        elif op == "check":
            name = rng.choice(["", SERVICE_NAME, "nothing.Here"])
            hs = health_pb2_grpc.HealthStub(self.ch)
            try:
                got = hs.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                code = "OK"
            except grpc.RpcError as exc:
                got, code = None, exc.code().name
            if name == "nothing.Here":
                assert code == "NOT_FOUND", self.where(f"Check of an unknown name: {code}")
            else:
                assert got == (OK if model.serving else NS), self.where(f"Check {name!r} {got}")
            model.count("Check", code)
        elif op == "watch":  # the status now, then its client cancels it
            stream, t, seen = watch_health(self.ch)
            holds_within(lambda: seen, 5, 0.005)
            assert seen[:1] == [OK if model.serving else NS], self.where(f"Watch {seen}")
            stream.cancel()
            t.join(5)
            assert seen[-1] == "CANCELLED", self.where(f"Watch cancelled: {seen}")
            model.count("Watch", "CANCELLED")
        else:
            status, body = self.healthz()
            assert (status, body) == ((200, b"SERVING\n") if model.serving else
                                      (503, b"NOT_SERVING\n")), self.where(f"/healthz {status}")

    def healthz(self) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.h.metrics_port}{bootstrap.HEALTH_PATH}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def scrape(self) -> None:
        """/metrics says what the counters say."""
        self.settle()
        url = f"http://127.0.0.1:{self.h.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        got = {(s.labels["method"], s.labels["code"]): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "tiercache_rpc_total" and s.labels.get("service") == self.service}
        assert _delta(got, self.before) == _delta(_counts(self.service), self.before), \
            self.where("/metrics and the counters disagree")


def watch_health(ch, name: str = "", timeout: float = 30.0
                 ) -> tuple[grpc.Future, threading.Thread, list]:
    """A Health.Watch of `name` read on a thread: (the call, the thread, what it saw: each
    status, then "ended" or the error's code name). Also used by test_bootstrap_rules."""
    seen: list = []
    stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=name),
                                                  timeout=timeout)

    def read() -> None:
        try:
            for m in stream:
                seen.append(m.status)
            seen.append("ended")
        except grpc.RpcError as exc:
            seen.append(exc.code().name)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return stream, t, seen


def run_seed(seed: int) -> None:
    run = Run(seed)
    rng, model = run.rng, run.model
    _, watcher, watched = watch_health(run.ch)
    try:
        for _ in range(rng.randint(15, 30)):
            if rng.random() < 0.7:
                run.call()
            else:
                run.health()
        run.scrape()
        if rng.random() < 0.6:  # a drain: NOT_SERVING for good, requests still served
            run.h.begin_drain()
            model.draining, model.serving = True, False
            run.h.set_serving(True)
            for _ in range(rng.randint(1, 4)):
                run.health()
            assert run.healthz() == (503, b"NOT_SERVING\n")
            md = [("authorization", f"Bearer {TOKEN}")]
            s = {"id": f"{seed}-drain", "act": "ok", "k": 0}
            assert run.ch.unary_unary(f"/{SERVICE_NAME}/Unary")(
                _padded(s, 0), timeout=5, metadata=md) == b"done"
            model.count("Unary", "OK")
        cut: list = []
        if rng.random() < 0.4:  # a call still running when the stop's grace ends
            s = {"id": f"{seed}-cut", "act": "hold", "k": 0}

            def held() -> None:
                try:
                    run.ch.unary_unary(f"/{SERVICE_NAME}/Unary")(
                        _padded(s, 0), timeout=5,
                        metadata=[("authorization", f"Bearer {TOKEN}")])
                    cut.append("OK")
                except grpc.RpcError as exc:
                    cut.append(exc.code().name)

            t = threading.Thread(target=held)
            t.start()
            assert run._started(s["id"])
            grace = 0.1
            run.h.stop(grace)
            t.join(10)
            assert cut == ["UNAVAILABLE"], run.where(f"cut call {cut}")
            model.count("Unary", "UNAVAILABLE")
        else:
            grace = rng.choice([0, 0.5])
            run.h.stop(grace)
        watcher.join(10)
        # Stopped, with a grace or none, a Watch gets NOT_SERVING and ends (OK), counted so.
        assert watched[-2:] == [NS, "ended"], run.where(f"watch {watched} (grace {grace})")
        assert all(a != b for a, b in zip(watched, watched[1:], strict=False)), watched
        model.count("Watch", "OK")
        with pytest.raises(grpc.RpcError) as e:
            run.ch.unary_unary(f"/{SERVICE_NAME}/Unary")(b"{}", timeout=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        run.settle()
    finally:
        run.h.stop(0)
        run.ch.close()


@pytest.fixture
def short_open_streams(monkeypatch):
    monkeypatch.setattr(bootstrap, "OPEN_STREAM_MAX_S", OPEN_MAX_S)


@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_every_call_gets_the_documented_status_id_and_count(seed, short_open_streams):
    run_seed(seed)


def run_drain_seed(seed: int) -> None:
    """run_until_signal with a drain delay: SIGTERM -> NOT_SERVING while calls are still served
    -> stop, new calls refused."""
    rng = random.Random(seed)
    delay = rng.choice([0.3, 0.5])
    os.environ["TIERCACHE_DRAIN_DELAY_S"] = str(delay)
    h = create_server(service=f"drain-{seed}", address="127.0.0.1:0", metrics_port=0,
                      services=[(_add(Servicer()), None, SERVICE_NAME)])
    ch = grpc.insecure_channel(h.address)
    hs = health_pb2_grpc.HealthStub(ch)
    unary = ch.unary_unary(f"/{SERVICE_NAME}/Unary")
    seen: list = []

    def status() -> int:
        return hs.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status

    def during() -> None:
        while not h.draining.is_set():
            time.sleep(0.005)
        t_drain = time.monotonic()
        while time.monotonic() - t_drain < delay * 0.6:  # well inside the delay
            s = {"id": f"d{seed}-{len(seen)}", "act": "ok", "k": 0}
            seen.append((unary(_padded(s, 0), timeout=5), status()))
            time.sleep(rng.uniform(0, 0.05))
        h.stopped.wait(10)
        with pytest.raises(grpc.RpcError) as e:
            unary(_padded({"id": "after", "act": "ok", "k": 0}, 0), timeout=2)
        seen.append(e.value.code().name)

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        h.set_serving()
        assert status() == OK
        t = threading.Thread(target=during)
        t.start()
        threading.Timer(rng.uniform(0.05, 0.2), os.kill, (os.getpid(), signal.SIGTERM)).start()
        bootstrap.run_until_signal(h, grace=1.0)
        t.join(10)
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
        del os.environ["TIERCACHE_DRAIN_DELAY_S"]
        h.stop(0)
        ch.close()
    assert h.stopped.is_set() and not h.serving
    assert len(seen) >= 2 and seen[-1] == "UNAVAILABLE", seen
    assert all(x == (b"done", NS) for x in seen[:-1]), seen


@pytest.mark.parametrize("seed", range(FIRST, FIRST + max(1, SEEDS // 6)))
def test_a_signal_drains_as_documented(seed, monkeypatch):
    monkeypatch.delenv("TIERCACHE_DRAIN_DELAY_S", raising=False)
    run_drain_seed(seed)


class _Ctx:
    """A call as the reaper sees it: ended (how often, when) through the public `cancel`."""

    def __init__(self) -> None:
        self.ended: list[float] = []

    def cancel(self) -> None:
        self.ended.append(time.monotonic())


def run_reaper_seed(seed: int) -> None:
    """Random arms and disarms: each armed call not disarmed is ended once, not before its time
    (and within a second after); a disarmed one never; on_reap told of each ended call."""
    rng = random.Random(seed)
    told: list[str] = []
    reaper = StreamReaper(on_reap=told.append)
    now = time.monotonic()
    calls = []
    for i in range(rng.randint(1, 40)):
        ctx = _Ctx()
        off = rng.choice([-0.1, 0.0, 0.1, 0.2, 0.3, 60.0])
        when = time.monotonic() + off
        token = reaper.arm(when, ctx, f"call {i}")
        # A deadline already passed may be reaped before any disarm: those are kept.
        keep = off <= 0 or (rng.random() < 0.6 and off < 10)
        if not keep:
            reaper.disarm(token)
        calls.append((ctx, when, keep, f"call {i}"))
        if rng.random() < 0.2:
            reaper.disarm(rng.randrange(10**6, 10**7))  # never armed: harmless
    kept = [c for c in calls if c[2]]
    holds_within(lambda: all(c[0].ended for c in kept), 5, 0.01)
    time.sleep(0.05)
    for ctx, when, keep, name in calls:
        if keep:
            assert len(ctx.ended) == 1, (seed, name, ctx.ended)
            assert when <= ctx.ended[0] <= max(when, now) + 1.5, (seed, name)
        else:
            assert ctx.ended == [], (seed, name)
    assert sorted(told) == sorted(c[3] for c in kept), seed
    assert reaper.armed() == 0


@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_the_reaper_ends_every_armed_call_once_and_no_disarmed_one(seed):
    run_reaper_seed(seed)
