"""A differential review of the Python client library, the `tiercache` CLI and trace replay
(clients/python/client.py, cli.py, replay.py) against a scripted orchestrator on loopback
(real gRPC: the client is the unit under test).

The model is written from the docs (README's client and CLI sections, the Orchestrator proto,
the docstrings of stream(), retry_later(), IncompleteStream and replay), not from the code:
- a Generate stream is its messages in order; the last one with `final` carries the figures.
  Ended OK without the final message: IncompleteStream after the chunks that came. A status
  before the final message: grpc.RpcError with that code and details and `chunks_received`
  (the messages that had arrived); after the final message, DEADLINE_EXCEEDED or CANCELLED
  leave the answer whole and any other status is raised. A server that never ends the call is
  cut at the client's deadline (the call's `timeout`, else the client's): DEADLINE_EXCEEDED.
  Stopping early cancels the call (the server sees it end);
- retry_later: UNAVAILABLE, or RESOURCE_EXHAUSTED with the `tiercache-overloaded` trailer or
  gRPC's concurrent-call cap, and never once a chunk had arrived;
- each call carries `x-request-id` (the caller's, else a new one), `authorization: Bearer`
  with the token stripped (none for no token) and the deadline asked for; the request holds
  exactly the messages (a string is one user message, or with `raw` the prompt; a dict is one
  message), sampling fields, session id and cache policy given; bad values (request id,
  timeout outside (0, 1e6], float32 sampling values) are a ValueError naming one of them
  before any call;
  generate() returns the joined text and token ids, the final's figures and the count of
  messages;
- chat --session: each turn sends the session's saved history (the system prompt it began
  with, then earlier user turns and the assistant's whole answers, as generated, in order) plus
  the question; a turn that fails, is cut, or answers nothing leaves the history as it was;
  --new starts it over, --system counts only for a new session. stdout is the answer and a
  newline (an error after text: the text and a newline; before any: nothing); stderr says
  `error: CODE (retry later): details` (`(retry later)` exactly when retry_later), the README's
  report line unless -q, "continuing session" when history was sent; exit 0, 75 after an error
  with `(retry later)` (EX_TEMPFAIL), else 1. warm,
  feedback: the reply as JSON with zero values, warm's exit 1 when nothing was warmed or a
  result has an error;
- replay: each session's turns in order, each sent with the system prompt, the earlier
  questions and answers as generated, at max(its `at` x time_scale, the previous turn's end) on a
  fake clock (a thread-local clock per session; waits and chunk arrivals advance it), the
  turn's outcome from its final's report; a failed or empty turn ends the session, its later
  turns recorded as skipped; at most `concurrency` requests in flight; progress counts 1..N.
Undocumented, asserted only as invariants: the order of checks when several arguments are bad
(the message names one of them), the order of replay's outcomes (compared as a set), the
`(index expected N)` part of the report line (removed before comparing), the wording of the
CLI's other stderr lines (only their presence is compared).

Run: 3,000 seeds (each: 4-10 library calls, 4-8 CLI commands, one replay of 1-4 sessions),
clean after one fix. Found: a finite timeout past about 1e9 s (TierCacheClient(timeout=1e10),
or a call's) was taken, and gRPC made it a deadline already passed: every call failed at once
with DEADLINE_EXCEEDED (69 of 300 seeds); refused now past 1e6 s as the CLI's --timeout is
(tests/test_client_library.py). Undocumented, reported, taken as the code has it: a status
after the final message other than the deadline's is a replay error whose outcome keeps the
final's figures (and the CLI's JSON summary sums them); a failed or empty `--new` turn
leaves the old history, so the next turn continues it; model text reaches a terminal's
stdout cleaned of control characters, server text (error details, report fields) reaches
stderr as sent. Removing the stream's own `call.cancel()` changes nothing seen: the
abandoned call is cancelled when CPython frees it.
Teeth (300 seeds each): a status at the deadline taken as whole before the final message
94 seeds failed; retry_later ignoring chunks_received 74; replay waiting only for a session's
first turn 74; the CLI saving an empty answer into the history 56.

More seeds: CLIENT_DIFFERENTIAL_SEEDS=3000 pytest tests/test_client_differential.py
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import re
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict
from tiercache.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

from benchmarks.workload import Request, Workload, WorkloadSpec
from clients.python import cli
from clients.python import replay as replay_mod
from clients.python.client import IncompleteStream, TierCacheClient, retry_later
from tests.blank_text import blank
from tests.fake_orchestrator import UnaryScripted, clear_client_env, serving
from tests.waits import holds_within

SEEDS = int(os.environ.get("CLIENT_DIFFERENTIAL_SEEDS", "100"))
SC = grpc.StatusCode
CODES = [c for c in SC if c != SC.OK]
CAP = "Concurrent RPC limit exceeded!"  # gRPC's own words for its concurrent-call cap
HANG_TIMEOUT = 0.3  # the client deadline of a call whose server never ends it


# ---------------------------------------------------------------- the scripted orchestrator

@dataclass
class Seen:
    request: object
    metadata: dict
    remaining: float | None


class Scripted(UnaryScripted):
    """Generate plays the script of its key (the last message's content, or the prompt):
    ("chunk", text, ids), ("final", text, ids, GenerateFinal), ("abort", code, details,
    trailers), ("hang",) until the client ends the call, ("end",) (status OK). Warm, Feedback
    and Stats answer the next reply queued."""

    def __init__(self) -> None:
        self.scripts: dict[str, list] = {}
        self.seen: dict[str, list[Seen]] = {}
        self.ended: set[str] = set()  # calls that have ended
        self.unary: list = []
        self.unary_seen: list[tuple[str, object, dict]] = []
        self.lock = threading.Lock()

    def Generate(self, request, context):  # noqa: N802
        key = request.prompt or (request.messages[-1].content if request.messages else "")
        with self.lock:
            self.seen.setdefault(key, []).append(
                Seen(request, dict(context.invocation_metadata()), context.time_remaining()))
        # When the call ends, however it ends: a call cancelled between two messages is not
        # resumed, so its handler never sees it. At once where it had ended before the handler
        # began (a cancel while the request was being sent): gRPC refuses the callback then.
        if not context.add_callback(lambda: self.ended.add(key)):
            self.ended.add(key)
        for act in self.scripts.get(key, [("end",)]):
            if act[0] == "chunk":
                yield orchestrator_pb2.GenerateResponse(text=act[1], token_ids=act[2])
            elif act[0] == "final":
                yield orchestrator_pb2.GenerateResponse(text=act[1], token_ids=act[2],
                                                        final=act[3])
            elif act[0] == "abort":
                if act[3]:
                    context.set_trailing_metadata(act[3])
                context.abort(act[1], act[2])
            elif act[0] == "hang":
                holds_within(lambda: not context.is_active(), 20, 0.005)
                return
            else:
                return

    def _unary(self, method, request, context):
        with self.lock:
            self.unary_seen.append((method, request, dict(context.invocation_metadata())))
            reply = self.unary.pop(0)
        if isinstance(reply, tuple):
            context.abort(reply[0], reply[1])
        return reply


@pytest.fixture(scope="module")
def server():
    s = Scripted()
    with serving(s, 16) as port:
        yield s, f"127.0.0.1:{port}"


# ---------------------------------------------------------------- random scripts

TEXTS = ["", " ", "a", "Hello", " world", "\n", "é€", "x y ", "  pad  ", "ok.", "\x1b[2J",
         "a\rb\t", "\x7f"]


def rand_final(rng: random.Random) -> orchestrator_pb2.GenerateFinal:
    r = common_pb2.CacheReport(
        semantic_hit=rng.random() < 0.3,
        semantic_similarity=rng.choice([0.0, 0.5, 0.9712, 1.0]),
        prompt_tokens=rng.choice([0, 1, 31, 32, 226, 2**32 - 1]),
        cached_tokens=rng.choice([0, 16, 32, 208]),
        draft_tokens_proposed=rng.choice([0, 0, 8]), draft_tokens_accepted=rng.choice([0, 3, 8]),
        replica_id=rng.choice(["", "kvpool-0", "kvpool-1"]),
        ttft_ms=rng.choice([0.0, 95.4, 1234.5]),
        semantic_entry_id=rng.choice(["", "e1"]), route=rng.choice(["", "semantic", "prefix"]),
        draft_entry_id=rng.choice(["", "d7"]), lookup_tokens_accepted=rng.choice([0, 0, 2]),
        index_matched_tokens=rng.choice([0, 16, 300]),
        degradations=rng.sample(["semantic_skipped", "retry", "index_down"], rng.randint(0, 2)))
    return orchestrator_pb2.GenerateFinal(
        finish_reason=rng.choice(list(common_pb2.FinishReason.values())),
        usage=common_pb2.Usage(prompt_tokens=rng.randint(0, 500),
                               completion_tokens=rng.randint(0, 500)),
        cache_report=r, request_id=rng.choice(["", "rid-1", "abc"]))


def rand_script(rng: random.Random, *, hang: bool) -> list:
    """k chunks, then: the final (sometimes then a status), a cut, an error, or a hang."""
    acts: list = [("chunk", rng.choice(TEXTS), [rng.randint(0, 9)] * rng.randint(0, 2))
                  for _ in range(rng.choice([0, 0, 1, 2, 3, 5]))]
    end = rng.choices(["final", "cut", "abort", "final+abort", "hang", "final+hang"],
                      [6, 1, 3, 2, 1 if hang else 0, 1 if hang else 0])[0]
    if end.startswith("final"):
        acts.append(("final", rng.choice(TEXTS), [rng.randint(0, 9)] * rng.randint(0, 1),
                     rand_final(rng)))
    if end.endswith("abort"):
        code = rng.choice(CODES + [SC.RESOURCE_EXHAUSTED, SC.UNAVAILABLE, SC.DEADLINE_EXCEEDED,
                                   SC.CANCELLED])
        trailers = rng.choice([(), (("tiercache-overloaded", "1"),), (("other", "1"),)])
        details = rng.choice(["d", "every replica is busy", CAP, "naïve détail", ""])
        acts.append(("abort", code, details, trailers))
    elif end.endswith("hang"):
        acts.append(("hang",))
    elif end == "cut":
        acts.append(("end",))
    return acts


# ---------------------------------------------------------------- the model

@dataclass
class Expect:
    """What a caller of stream() sees: the chunks (text, ids, final or None), then how it
    ends: "ok", "incomplete", or ("error", code, details or None, chunks_received, retry)."""

    chunks: list = field(default_factory=list)
    end: object = "ok"


def expect_stream(acts: list) -> Expect:
    e = Expect()
    final = False
    for act in acts:
        if act[0] == "chunk":
            e.chunks.append((act[1], list(act[2]), None))
            final = False
        elif act[0] == "final":
            e.chunks.append((act[1], list(act[2]), act[3]))
            final = True
        elif act[0] in ("abort", "hang"):
            code, details, trailers = ((act[1], act[2], act[3]) if act[0] == "abort"
                                       else (SC.DEADLINE_EXCEEDED, None, ()))
            if final and code in (SC.DEADLINE_EXCEEDED, SC.CANCELLED):
                return e  # whole: the status came after the final message
            n = len(e.chunks)
            busy = (code == SC.UNAVAILABLE or code == SC.RESOURCE_EXHAUSTED and (
                details == CAP or any(k == "tiercache-overloaded" for k, _ in trailers)))
            e.end = ("error", code, details, n, busy and n == 0)
            return e
        else:
            break
    if not final:
        e.end = "incomplete"
    return e


def proto_messages(messages) -> list:
    if isinstance(messages, dict):
        messages = [messages]
    return [orchestrator_pb2.ChatMessage(role=m["role"], content=m["content"])
            for m in messages]


def expect_request(messages, kw: dict) -> orchestrator_pb2.GenerateRequest:
    req = orchestrator_pb2.GenerateRequest(
        session_id=kw.get("session_id", ""), return_token_ids=kw.get("return_token_ids", False),
        sampling=common_pb2.SamplingParams(
            max_tokens=kw.get("max_tokens", 0), temperature=kw.get("temperature", 0.0),
            top_p=kw.get("top_p", 0.0), seed=kw.get("seed", 0),
            stop_token_ids=kw.get("stop_token_ids", ()), ignore_eos=kw.get("ignore_eos", False)))
    if kw.get("cache_policy") is not None:
        req.cache_policy.CopyFrom(kw["cache_policy"])
    if isinstance(messages, str):
        if kw.get("raw"):
            req.prompt = messages
        else:
            req.messages.add(role="user", content=messages)
    else:
        req.messages.extend(proto_messages(messages))
    return req


def float32_ok(v: float, top: float) -> bool:
    """Whether `v` goes on the wire as itself: in [0, top], finite as a float32, and not a
    positive number that rounds to the float32 0 (unset)."""
    if not 0 <= v <= top:
        return False
    with np.errstate(over="ignore"):
        f = float(np.float32(v))
    return f != math.inf and not (v > 0 and f == 0.0)


def check_metadata(md: dict, token: str | None, request_id: str) -> None:
    rid = md.get("x-request-id", "")
    assert rid == request_id if request_id else re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", rid), md
    tok = (token or "").strip()
    assert md.get("authorization") == (f"Bearer {tok}" if tok else None), md


def check_deadline(seen: Seen, want: float) -> None:
    """The deadline asked for (gRPC rounds the header it travels in up a little)."""
    assert seen.remaining is not None and want - 3.0 < seen.remaining <= want * 1.01 + 0.2, (
        seen.remaining, want)


def report_line(r, request_id: str = "") -> str:
    """The README's report line: `[semantic hit 0.971 | route semantic, ...]` or `[model
    (nearest entry 0.912) | route prefix, prompt 226 tok, cached 208, replica kvpool-0, ttft
    95 ms, draft 8/8 accepted, draft from <id>, entry <id>, request <id>]`, with `degraded:
    ...` before the request id."""
    sim = r.semantic_similarity
    head = "semantic hit" if r.semantic_hit else "model"
    if sim:  # rounded down within the tier's float32 tolerance (1e-6)
        shown = f"{math.floor((sim + 1e-6) * 1000) / 1000:.3f}"
        head += f" {shown}" if r.semantic_hit else f" (nearest entry {shown})"
    parts = [f"route {r.route}"] if r.route else []
    parts += [f"prompt {r.prompt_tokens} tok", f"cached {r.cached_tokens}",
              f"replica {r.replica_id or '-'}", f"ttft {r.ttft_ms:.0f} ms"]
    if r.draft_tokens_proposed:
        d = f"draft {r.draft_tokens_accepted}/{r.draft_tokens_proposed} accepted"
        if r.lookup_tokens_accepted:
            d += f" ({r.lookup_tokens_accepted} by prompt lookup)"
        parts.append(d)
    if r.draft_entry_id:
        parts.append(f"draft from {r.draft_entry_id}")
    if r.semantic_entry_id:
        parts.append(f"entry {r.semantic_entry_id}")
    if r.degradations:
        parts.append("degraded: " + " ".join(r.degradations))
    if request_id:
        parts.append(f"request {request_id}")
    return f"[{head} | " + ", ".join(parts) + "]"


# ---------------------------------------------------------------- the library

def rand_messages(rng: random.Random, key: str):
    shape = rng.choice(["str", "raw", "dict", "list"])
    if shape in ("str", "raw"):
        return key, shape == "raw"
    if shape == "dict":
        return {"role": "user", "content": key}, False
    hist = [{"role": rng.choice(["system", "user", "assistant"]), "content": rng.choice(TEXTS)}
            for _ in range(rng.randint(0, 3))]
    return [*hist, {"role": "user", "content": key}], False


def rand_kwargs(rng: random.Random) -> dict:
    kw: dict = {}
    if rng.random() < 0.5:
        kw["max_tokens"] = rng.choice([0, 1, 16, 2**31 - 1])
    if rng.random() < 0.4:
        kw["temperature"] = rng.choice([0.0, 0.7, 3e38, 1e-40, 1e-50, -0.5, 1e39, math.nan])
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([0.0, 0.9, 1.0, 1e-40, 1e-50, 1.5, math.nan])
    if rng.random() < 0.3:
        kw["seed"] = rng.choice([0, 7, 2**64 - 1])
    if rng.random() < 0.3:
        kw["session_id"] = rng.choice(["", "s1", "x" * 256])
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.2:
        kw["ignore_eos"] = True
    if rng.random() < 0.3:
        kw["return_token_ids"] = True
    if rng.random() < 0.3:
        kw["cache_policy"] = common_pb2.CachePolicy(skip_prefix_cache=rng.random() < 0.5,
                                                    semantic_tier=rng.choice(["", "strict"]))
    return kw


def one_library_call(rng, srv: Scripted, c: TierCacheClient, token, key: str, hang: bool):
    acts = rand_script(rng, hang=hang)
    srv.scripts[key] = acts
    messages, raw = rand_messages(rng, key)
    kw = rand_kwargs(rng)
    if raw:
        kw["raw"] = True
    request_id = rng.choice(["", "", "req-1", "r" * 128, "r" * 129, "a b", "é"])
    timeout = rng.choice([None, None, 5.0, 120.0, 1e6, 0.0, -1.0, 1e10, math.inf, math.nan])
    hangs = any(a[0] == "hang" for a in acts)
    bad = []
    if not float32_ok(kw.get("temperature", 0.0), math.inf):
        bad.append("temperature")
    if not float32_ok(kw.get("top_p", 0.0), 1.0):
        bad.append("top_p")
    if timeout is not None and not 0 < timeout <= 1e6:  # the CLI's bound, the library's too
        bad.append("timeout")
    if request_id and not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", request_id):
        bad.append("request_id")
    use = rng.choice(["stream", "generate", "break"])
    if bad:
        with pytest.raises(ValueError) as ei:
            list(c.stream(messages, timeout=timeout, request_id=request_id, **kw))
        assert str(ei.value).split(":")[0] in bad, (str(ei.value), bad)
        assert key not in srv.seen  # refused before any call
        return
    want = expect_stream(acts)
    if hangs and not (use == "break" and want.chunks):
        timeout = HANG_TIMEOUT  # cut at the client's deadline
    call_timeout = timeout if timeout is not None else c.timeout
    if use == "break" and not want.chunks:
        use = "stream"
    got, err = [], None
    if use == "generate":
        try:
            res = c.generate(messages, timeout=timeout, request_id=request_id, **kw)
        except (grpc.RpcError, IncompleteStream) as e:
            err = e
        else:
            assert want.end == "ok", want.end
            finals = [f for _, _, f in want.chunks if f is not None]
            fin = finals[-1]
            assert res.text == "".join(t for t, _, _ in want.chunks)
            assert res.token_ids == [i for _, ids, _ in want.chunks for i in ids]
            assert res.chunks == len(want.chunks)
            assert res.finish_reason == common_pb2.FinishReason.Name(fin.finish_reason)
            assert (res.prompt_tokens, res.completion_tokens) == (
                fin.usage.prompt_tokens, fin.usage.completion_tokens)
            assert res.report == fin.cache_report and res.request_id == fin.request_id
    elif use == "break":  # a caller that stops reading after `stop` chunks
        stop = rng.randint(1, len(want.chunks))
        it = c.stream(messages, timeout=timeout, request_id=request_id, **kw)
        for ch in it:
            got.append(ch)
            if len(got) >= stop:
                break
        it.close()
        want.chunks, want.end = want.chunks[:stop], "stopped"
    else:
        try:
            for ch in c.stream(messages, timeout=timeout, request_id=request_id, **kw):
                got.append(ch)
        except (grpc.RpcError, IncompleteStream) as e:
            err = e
    if use != "generate":
        assert [(ch.text, ch.token_ids, ch.final) for ch in got] == want.chunks, (got, acts)
    if want.end in ("ok", "stopped"):
        assert err is None, (err, acts)
    elif want.end == "incomplete":
        assert isinstance(err, IncompleteStream), (err, acts)
    else:
        _, code, details, n, busy = want.end
        assert isinstance(err, grpc.RpcError), (err, acts)
        assert err.code() == code, (err.code(), acts)
        if details is not None:
            assert err.details() == details
        assert err.chunks_received == n and retry_later(err) == busy, (acts, n, busy)
    # What the server was sent.
    (seen,) = srv.seen[key]
    exp = expect_request(messages, kw)
    assert seen.request == exp, (seen.request, exp)
    check_metadata(seen.metadata, token, request_id)
    check_deadline(seen, call_timeout)
    if want.end == "stopped" and hangs:
        assert holds_within(lambda: key in srv.ended, 3, 0.005), (
            "stopping early did not cancel the call")


def check_library(rng: random.Random, srv: Scripted, address: str, seed: int) -> None:
    token = rng.choice([None, "", "tok", " tok-1 \n", "team secret 1", "  "])
    timeout = rng.choice([5.0, 300.0, 60.0, 1e6])
    with TierCacheClient(address, token=token, timeout=timeout) as c:
        for n in range(rng.randint(4, 10)):
            one_library_call(rng, srv, c, token, f"L{seed}.{n}", hang=seed % 8 == 0 and n == 0)
        # Warm and Feedback: what is sent, and the reply as given.
        reply = orchestrator_pb2.WarmResponse(results=[orchestrator_pb2.WarmResult(
            prompt_index=rng.choice([-1, 0]), replica_id="kvpool-0", error=rng.choice(["", "x"]))
            for _ in range(rng.randint(0, 2))])
        srv.unary.append(reply)
        prompts, want_prompts, raw = rand_warm_prompts(rng)
        top_k, owners = rng.randint(0, 3), rng.random() < 0.5
        got = c.warm(prompts, top_k=top_k, owners_only=owners, raw=raw)
        assert got == reply
        method, req, md = srv.unary_seen.pop()
        assert method == "Warm" and list(req.prompts) == want_prompts, (prompts, req)
        assert req.top_k == top_k and req.target == (
            orchestrator_pb2.WARM_TARGET_OWNERS if owners else orchestrator_pb2.WARM_TARGET_ALL)
        check_metadata(md, token, "")
        good = rng.random() < 0.5
        srv.unary.append(orchestrator_pb2.FeedbackResponse(invalidated=not good))
        c.feedback(f"e{seed}", good=good)
        method, req, md = srv.unary_seen.pop()
        assert method == "Feedback" and req.semantic_entry_id == f"e{seed}"
        assert req.rating == (orchestrator_pb2.RATING_GOOD if good else orchestrator_pb2.RATING_BAD)
        check_metadata(md, token, "")


def rand_warm_prompts(rng: random.Random):
    """A warm() argument and the WarmPrompts the docstring says it is: a string is a system
    prompt (raw: a raw prompt), a dict one message, a list of messages one conversation, a
    list of strings and conversations that many prompts."""
    raw = rng.random() < 0.3

    def conv():
        return [{"role": rng.choice(["system", "user"]), "content": rng.choice(TEXTS[1:])}
                for _ in range(rng.randint(1, 2))]

    def sys_prompt(s):
        return (orchestrator_pb2.WarmPrompt(prompt=s) if raw
                else orchestrator_pb2.WarmPrompt(messages=[{"role": "system", "content": s}]))

    shape = rng.choice(["str", "dict", "conv", "list"])
    if shape == "str":
        s = rng.choice(["be brief", "ab"])
        return s, [sys_prompt(s)], raw
    if shape == "dict":
        m = conv()[0]
        return m, [orchestrator_pb2.WarmPrompt(messages=proto_messages([m]))], raw
    if shape == "conv":
        m = conv()
        return m, [orchestrator_pb2.WarmPrompt(messages=proto_messages(m))], raw
    items = [rng.choice(["s1", "s2"]) if rng.random() < 0.5 else conv()
             for _ in range(rng.randint(0, 3))]
    want = [sys_prompt(p) if isinstance(p, str)
            else orchestrator_pb2.WarmPrompt(messages=proto_messages(p)) for p in items]
    return items, want, raw


# ---------------------------------------------------------------- the CLI

class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def on_terminal(text: str) -> str:
    """What a terminal is shown of model text: control characters (but newline and tab)
    replaced, so an answer cannot clear the screen or set its title."""
    return "".join("\ufffd" if ord(c) < 32 and c not in "\n\t" or c == "\x7f" else c
                   for c in text)


def run_cli(argv: list[str], tty: bool = False) -> tuple[int, str, str]:
    out, err = (Terminal() if tty else io.StringIO()), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int):
                err.write(f"{e.code}\n")
    return rc, out.getvalue(), err.getvalue()


def check_cli_chat(rng, srv: Scripted, address: str, seed: int, n: int,
                   histories: dict[str, list]) -> None:
    key = f"C{seed}.{n}"
    acts = rand_script(rng, hang=seed % 8 == 1 and n == 0)
    srv.scripts[key] = acts
    session = rng.choice(["", "s0", "s1", "s1", "long name é"])
    timeout = (HANG_TIMEOUT if any(a[0] == "hang" for a in acts)
               else rng.choice([None, 5.0, 300.0]))
    token = rng.choice([None, "", "tok", " tok-2\n"])
    argv = ["--address", address]
    argv += ["--timeout", str(timeout)] if timeout is not None else []
    argv += ["--token", token] if token is not None else []
    argv += ["chat", key]
    new = session and rng.random() < 0.15
    system = rng.choice(["", "", "be brief"])
    quiet = rng.random() < 0.3
    if session:
        argv += ["--session", session]
    if new:
        argv.append("--new")
    if system:
        argv += ["--system", system]
    if quiet:
        argv.append("-q")
    flags: dict = {}
    if rng.random() < 0.3:
        flags["max_tokens"] = rng.choice([0, 5])
        argv += ["--max-tokens", str(flags["max_tokens"])]
    if rng.random() < 0.2:
        flags["seed"] = 9
        argv += ["--seed", "9"]
    policy = {}
    if rng.random() < 0.2:
        policy["semantic_tier"] = rng.choice(["strict", "relaxed"])
        argv += ["--tier", policy["semantic_tier"]]
    if rng.random() < 0.2:
        policy["skip_semantic_lookup"] = policy["skip_semantic_store"] = True
        argv.append("--no-semantic")
    if rng.random() < 0.2:
        policy["skip_prefix_cache"] = True
        argv.append("--no-prefix-cache")
    if policy:
        flags["cache_policy"] = common_pb2.CachePolicy(**policy)
    history = [] if not session or new else list(histories.get(session, []))
    sent = list(history)
    if system and not history:
        sent.append({"role": "system", "content": system})
    sent.append({"role": "user", "content": key})
    tty = rng.random() < 0.3
    rc, out, err = run_cli(argv, tty)
    want = expect_stream(acts)
    text = "".join(t for t, _, _ in want.chunks)
    shown = on_terminal(text) if tty else text
    lines = err.splitlines()
    (seen,) = srv.seen[key]
    assert seen.request == expect_request(sent, {**flags, "session_id": session}), (
        seen.request, sent)
    check_metadata(seen.metadata, token, "")
    check_deadline(seen, timeout or 300.0)
    turns = sum(m["role"] == "user" for m in history)
    said = [ln for ln in lines if ln.startswith("continuing session")]
    assert len(said) == (1 if history and not quiet else 0), err
    assert not said or f"({turns} earlier turn{'s' if turns != 1 else ''};" in said[0], err
    assert any("--system ignored" in ln for ln in lines) == bool(system and history), err
    if want.end == "ok":
        assert rc == 0 and out == shown + "\n", (rc, out, err, acts)
        answer = not blank(text)
        fin = [f for _, _, f in want.chunks if f is not None][-1]
        reports = [re.sub(r" \(index expected \d+\)", "", ln) for ln in lines
                   if ln.startswith("[")]
        assert reports == ([] if quiet else [report_line(fin.cache_report, fin.request_id)]), (
            reports, err)
        assert any("empty answer" in ln for ln in lines) == bool(session and not answer), err
        if session and answer:
            histories[session] = [m for m in sent] + [{"role": "assistant", "content": text}]
        elif session and new:
            histories[session] = histories.get(session, [])  # left as it was
    elif want.end == "incomplete":
        assert rc == 1 and out == shown + "\n", (rc, out, err)
        assert "without a final message" in err and ("left unchanged" in err) == bool(session)
    else:
        _, code, details, n_got, busy = want.end
        assert rc == (75 if busy else 1), (rc, out, err, acts)  # EX_TEMPFAIL: busy now
        assert out == (shown + "\n" if text else ""), (rc, out, err, acts)
        said = [ln for ln in lines if ln.startswith("error: ")]
        assert len(said) == 1, err
        if details is None:  # the client's own deadline: its words are gRPC's
            assert said[0].startswith(f"error: {code.name}: "), err
        else:
            assert said[0] == (f"error: {code.name}{' (retry later)' if busy else ''}: {details} "
                               f"(request {seen.metadata['x-request-id']})"), (err, acts)
    if session:
        path = Path(os.environ["TIERCACHE_CLI_HOME"]) / "sessions" / f"{session}.json"
        saved = json.loads(path.read_text()) if path.exists() else []
        assert saved == histories.get(session, []), (saved, histories.get(session))


def check_cli_unary(rng, srv: Scripted, address: str) -> None:
    cmd = rng.choice(["warm", "feedback", "stats"])
    if cmd == "warm":
        reply = orchestrator_pb2.WarmResponse(results=[orchestrator_pb2.WarmResult(
            prompt_index=rng.choice([-1, 0]), replica_id="kvpool-0",
            prompt_tokens=rng.choice([0, 16]), error=rng.choice(["", "", "refused"]))
            for _ in range(rng.randint(0, 2))])
        system = rng.choice(["be brief", ""])
        top_k = rng.choice([0, 3]) if system else 3
        owners, ttl, raw = rng.random() < 0.5, rng.choice([0, 60]), rng.random() < 0.3
        argv = ["--address", address, "warm", "--system", system, "--top-k", str(top_k),
                "--ttl", str(ttl)] + ["--owners"] * owners + ["--raw"] * raw
        prompts = ([] if not system else [orchestrator_pb2.WarmPrompt(prompt=system)] if raw
                   else [orchestrator_pb2.WarmPrompt(messages=proto_messages(
                       [{"role": "system", "content": system}]))])
        sent = orchestrator_pb2.WarmRequest(
            prompts=prompts, top_k=top_k, pin_ttl_seconds=ttl,
            target=orchestrator_pb2.WARM_TARGET_OWNERS if owners else
            orchestrator_pb2.WARM_TARGET_ALL)
        want_rc = 0 if reply.results and not any(r.error for r in reply.results) else 1
    elif cmd == "feedback":
        reply = orchestrator_pb2.FeedbackResponse(invalidated=rng.random() < 0.5)
        bad = rng.random() < 0.5
        argv = ["--address", address, "feedback", "e1"] + (["--bad"] if bad else [])
        sent = orchestrator_pb2.FeedbackRequest(
            semantic_entry_id="e1",
            rating=orchestrator_pb2.RATING_BAD if bad else orchestrator_pb2.RATING_GOOD)
        want_rc = 0
    else:
        reply = orchestrator_pb2.StatsResponse(requests_total=rng.randint(0, 3))
        for tier in ("semantic", "prefix"):
            if rng.random() < 0.3:
                reply.dependencies.add(name=tier, healthy=False)
            if rng.random() < 0.6:
                total = rng.randint(1, 3)
                st = getattr(reply, tier)
                st.shards_total, st.shards_answered = total, rng.randint(1, total)
                st.shard_list_mismatch = rng.choice(["", "", "shard lists differ: a b"])
        argv = ["--address", address, "stats"]
        sent = orchestrator_pb2.StatsRequest()
        want_rc = 0
    if rng.random() < 0.2:
        code = rng.choice([SC.UNAVAILABLE, SC.PERMISSION_DENIED, SC.NOT_FOUND])
        srv.unary.append((code, "no"))
        rc, out, err = run_cli(argv)
        busy = " (retry later)" if code == SC.UNAVAILABLE else ""
        assert rc == (75 if busy else 1) and out == "", (rc, err)
        said = rf"error: {code.name}{re.escape(busy)}: no \(request [0-9a-f]{{16}}\)\n"
        assert re.fullmatch(said, err), err
        return
    srv.unary.append(reply)
    rc, out, err = run_cli(argv)
    assert rc == want_rc, (rc, out, err, reply)
    assert json.loads(out) == MessageToDict(reply, always_print_fields_with_no_presence=True)
    assert srv.unary_seen.pop()[1] == sent
    if cmd == "feedback":
        assert ("already gone" in err) == (bad and not reply.invalidated), err
    if cmd == "stats":
        # The proto: a tier's figures are unset when it did not answer, summed over the shards
        # that answered otherwise; the CLI says so on stderr (its wording undocumented: only
        # which tier a line names, and the figures it must carry).
        lines = err.splitlines()
        for tier in ("semantic", "prefix"):
            said = [ln for ln in lines if ln.startswith(f"{tier}:")]
            if not reply.HasField(tier):
                assert bool(said) == any(d.name == tier for d in reply.dependencies), err
                continue
            st = getattr(reply, tier)
            if st.shards_answered < st.shards_total:
                assert any(f"{st.shards_answered} of {st.shards_total}" in ln
                           for ln in said), err
            if st.shard_list_mismatch:
                assert any(st.shard_list_mismatch in ln for ln in said), err
            if st.shards_answered == st.shards_total and not st.shard_list_mismatch:
                assert not said, err


def check_cli(rng, srv: Scripted, address: str, seed: int, home: Path) -> None:
    os.environ["TIERCACHE_CLI_HOME"] = str(home / f"h{seed}")
    histories: dict[str, list] = {}
    for n in range(rng.randint(3, 7)):
        check_cli_chat(rng, srv, address, seed, n, histories)
    check_cli_unary(rng, srv, address)


# ---------------------------------------------------------------- replay on a fake clock

class FakeClock:
    """A clock per thread (each session runs in a thread of its own): waits and chunk arrivals
    advance it; a fresh thread starts at 1000 (as a real monotonic clock, never 0)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def monotonic(self) -> float:
        return getattr(self.local, "now", 1000.0)

    def advance(self, dt: float) -> None:
        self.local.now = self.monotonic() + dt


def fake_threading(clock: FakeClock):
    class Event(threading.Event):
        def wait(self, timeout=None):
            if timeout is not None and not self.is_set():
                clock.advance(timeout)
            return self.is_set()

    return types.SimpleNamespace(Lock=threading.Lock, Semaphore=threading.Semaphore,
                                 Event=Event)


class ThreadPerTask:
    """A pool with a fresh thread per session (a timed replay's workers are one per session
    up to 512): each session's thread-local clock starts afresh."""

    def __init__(self, max_workers: int) -> None:
        self.threads: list[threading.Thread] = []

    def submit(self, fn, *args):
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001
                fut.set_exception(e)

        t = threading.Thread(target=run, daemon=True)
        self.threads.append(t)
        t.start()
        return fut

    def shutdown(self, wait=True, cancel_futures=False):
        for t in self.threads:
            t.join()


class Timed:
    """A tenant's client for replay: the real client, each chunk's arrival advancing the
    session's fake clock by its scripted delay; counts the requests in flight."""

    def __init__(self, real: TierCacheClient, clock: FakeClock | None, delays: dict,
                 flight: list) -> None:
        self.real, self.clock, self.delays, self.flight = real, clock, delays, flight

    def stream(self, messages, **kw):
        with self.flight[0]:
            self.flight[1] += 1
            self.flight[2] = max(self.flight[2], self.flight[1])
        try:
            for i, ch in enumerate(self.real.stream(messages, **kw)):
                if self.clock is not None:
                    self.clock.advance(self.delays[messages[-1]["content"]][i])
                yield ch
        finally:
            with self.flight[0]:
                self.flight[1] -= 1

    def close(self) -> None:
        self.real.close()


def check_replay(rng, srv: Scripted, address: str, seed: int) -> None:
    tenants = {"t0": ["sys a", "sys b"], "t1": ["sys c"]}
    tokens = {"t0": "tok0", "t1": None}
    reqs: list[Request] = []
    delays: dict[str, list[float]] = {}
    for s in range(rng.randint(1, 4)):
        tenant = rng.choice(sorted(tenants))
        sys_i = rng.randrange(len(tenants[tenant]))
        at = rng.choice([0.0, 1.0, 2.5])
        for t in range(rng.randint(1, 4)):
            q = f"R{seed}.{s}.{t}"
            reqs.append(Request(at=at, tenant=tenant, session_id=f"s{seed}.{s}",
                                system_index=sys_i, turn=t, question=q,
                                kind=rng.choice(["turn", "repeat"])))
            at += rng.choice([0.0, 0.5, 3.0])
            acts = rand_script(rng, hang=False)
            if rng.random() < 0.6:  # mostly whole answers: sessions go on
                acts = [a for a in acts if a[0] == "chunk"] + [
                    ("final", rng.choice(TEXTS), [], rand_final(rng))]
            srv.scripts[q] = acts
            delays[q] = [rng.choice([0.0, 0.25, 1.0]) for _ in acts]
    order: dict[str, list[Request]] = {}
    for r in reqs:
        order.setdefault(r.session_id, []).append(r)
    # A trace's sessions interleave; the turns of one session keep their order.
    queues = [list(rs) for rs in order.values()]
    reqs = []
    while queues:
        q = rng.choice(queues)
        reqs.append(q.pop(0))
        if not q:
            queues.remove(q)
    w = Workload(WorkloadSpec(), tenants, reqs)
    scale = rng.choice([0.0, 0.5, 1.0])
    concurrency = rng.randint(1, 3)
    clock = FakeClock() if scale > 0 else None
    monkeypatch = pytest.MonkeyPatch()
    if clock is not None:
        monkeypatch.setattr(replay_mod, "time", types.SimpleNamespace(monotonic=clock.monotonic))
        monkeypatch.setattr(replay_mod, "threading", fake_threading(clock))
        monkeypatch.setattr(replay_mod, "ThreadPoolExecutor", ThreadPerTask)
    flight = [threading.Lock(), 0, 0]
    clients = {t: Timed(TierCacheClient(address, token=tokens[t]), clock, delays, flight)
               for t in tenants}
    progress: list[tuple[int, int]] = []
    try:
        out = replay_mod.replay(w, clients, concurrency=concurrency, time_scale=scale,
                                max_tokens=7, progress=lambda d, n: progress.append((d, n)))
    finally:
        monkeypatch.undo()
        for c in clients.values():
            c.close()
    assert progress == [(i + 1, len(reqs)) for i in range(len(reqs))], progress
    assert flight[2] <= concurrency, (flight[2], concurrency)
    got = {(o.session_id, o.turn): o for o in out}
    assert len(got) == len(out) == len(reqs)
    for sid, rs in order.items():
        history: list[dict] = []
        end = 0.0
        skipped = ""
        for r in rs:
            o = got[(sid, r.turn)]
            assert (o.tenant, o.kind) == (r.tenant, r.kind)
            if skipped:
                assert r.question not in srv.seen, "a turn after a failed one was sent"
                assert o.error == skipped and o.prompt_tokens == o.completion_tokens == 0
                assert o.ttft_ms == o.total_ms == 0.0
                if clock is not None:
                    assert o.sent_at == pytest.approx(end)
                continue
            (seen,) = srv.seen[r.question]
            sys_prompt = tenants[r.tenant][r.system_index]
            sent = [{"role": "system", "content": sys_prompt}, *history,
                    {"role": "user", "content": r.question}]
            assert list(seen.request.messages) == proto_messages(sent), (seen.request, sent)
            assert seen.request.session_id == sid and seen.request.sampling.max_tokens == 7
            check_metadata(seen.metadata, tokens[r.tenant], "")
            acts = srv.scripts[r.question]
            want = expect_stream(acts)
            fin = [f for _, _, f in want.chunks if f is not None]
            # A status after the final message (not the deadline's) is an error that keeps the
            # final's figures: undocumented, taken as the code has it.
            rep = fin[-1].cache_report if fin else common_pb2.CacheReport()
            if want.end == "ok":
                assert o.error == "", (o.error, acts)
            elif want.end == "incomplete":
                assert o.error == "stream ended without a final message"
            else:
                _, code, details, _, _ = want.end
                assert o.error == f"{code.name}: {details}", (o.error, acts)
            assert (o.prompt_tokens, o.cached_tokens, o.semantic_hit, o.replica_id, o.route,
                    o.expected_tokens) == (
                rep.prompt_tokens, rep.cached_tokens, rep.semantic_hit, rep.replica_id,
                rep.route, rep.index_matched_tokens)
            assert o.similarity == pytest.approx(rep.semantic_similarity)
            assert o.completion_tokens == (fin[-1].usage.completion_tokens if fin else 0)
            assert o.cache_class == ("semantic_hit" if rep.semantic_hit else
                                     "prefix_hit" if rep.cached_tokens >= 32 else "cold")
            assert 0 <= o.ttft_ms <= o.total_ms
            if clock is not None:
                start = max(r.at * scale, end)
                arrived = delays[r.question][:len(want.chunks)]
                first = next((i for i, (t, _, _) in enumerate(want.chunks) if t), None)
                dur = sum(arrived)
                ttft = sum(arrived[:first + 1]) if first is not None else dur
                assert o.sent_at == pytest.approx(start), (o.sent_at, start, r)
                assert o.total_ms == pytest.approx(dur * 1000.0)
                assert o.ttft_ms == pytest.approx(ttft * 1000.0)
                end = start + dur
            answer = "".join(t for t, _, _ in want.chunks)
            if o.error or blank(answer):
                why = "failed" if o.error else "answered nothing"
                skipped = f"skipped: turn {r.turn} of the session {why}"
                continue
            history += [{"role": "user", "content": r.question},
                        {"role": "assistant", "content": answer}]


# ---------------------------------------------------------------- the test

def run_seed(seed: int, srv: Scripted, address: str, home: Path) -> None:
    rng = random.Random(seed)
    check_library(rng, srv, address, seed)
    check_cli(rng, srv, address, seed, home)
    check_replay(rng, srv, address, seed)


def test_client_cli_and_replay_match_the_documented_model(server, tmp_path, monkeypatch):
    srv, address = server
    clear_client_env(monkeypatch, tmp_path)
    for seed in range(SEEDS):
        run_seed(seed, srv, address, tmp_path)


def test_grpcs_own_cap_on_concurrent_calls_is_worth_retrying():
    """The model's one refusal that a scripted abort cannot stand for: a real server's cap on
    concurrent calls refuses the call past it (RESOURCE_EXHAUSTED, gRPC's own words, no
    trailer), which the client calls worth retrying, before any chunk."""
    srv = grpc.server(ThreadPoolExecutor(4), maximum_concurrent_rpcs=1)
    s = Scripted()
    s.scripts["hold"] = [("chunk", "a", []), ("hang",)]
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(s, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        with TierCacheClient(f"127.0.0.1:{port}", timeout=10) as c:
            held = c.stream("hold")
            assert next(held).text == "a"
            with pytest.raises(grpc.RpcError) as e:
                c.generate("second")
            held.close()
        assert e.value.code() == SC.RESOURCE_EXHAUSTED and e.value.details() == CAP
        assert e.value.chunks_received == 0 and retry_later(e.value)
    finally:
        srv.stop(0)
