"""A differential review of the `tiercache` command line (clients/python/cli.py) but for its
sessions (tests/test_cli_sessions_differential.py): argument parsing and validation, the
request each subcommand sends, its output and its exit status, against a model written from
the --help texts and docstrings, README.md ("Calling it"), docs/reliability.md and the proto
comments, with a scripted Orchestrator on loopback (real gRPC) that answers each call as the
step says and records the request, its metadata and its deadline.

Model, per invocation (random global options, environment and subcommand, shuffled):
- a usage error (exactly one bad value: an integer or float32 out of its field, not a number,
  nan/inf, a float rounding to 0, an unknown --tier, a session name that is no file name, a
  token that is not printable ASCII from --token or TIERCACHE_TOKEN, a timeout outside
  (0, 1e6], an --address/TIERCACHE_ADDRESS that is not host:port, warm with neither --system
  nor --top-k, --cert without TLS or without --key, replay's --concurrency, --time-scale and
  --tenant-tokens): exit 2, nothing on stdout, nothing sent, one `error:` line that names the
  option (argparse's usage lines before it), no traceback;
- a TLS file that cannot be read or is no certificate/key (not PEM, a key as the CA, a key
  that is not the certificate's): exit 1, one line naming the file, nothing sent;
  --tls or --ca against this plaintext server: exit 1, UNAVAILABLE (not retry later: the
  handshake fails again) saying the server does not speak TLS, nothing handled;
- chat sends [system]? + user text, session_id = --session, sampling {max_tokens,
  temperature, top_p, seed} as float32/ints given, a cache policy from --tier, --threshold,
  --no-semantic (skip lookup and store), --no-prefix-cache, no raw prompt or token ids;
  prints the streamed text and a newline (a failed stream: what came, and a newline only if
  any text came; control characters replaced on a terminal), then the report line of the
  README on stderr unless -q ("[semantic hit 0.971 | route ..., prompt N tok, cached M, replica
  R, ttft T ms, draft a/p accepted, draft from X, entry Y, degraded: ...]"); exit 0; a stream
  without its final message: the line saying so, exit 1; a status after the final message:
  answered if DEADLINE_EXCEEDED/CANCELLED (the library's rule), else an error;
- warm sends [--system as a system message, or with --raw as the raw prompt], top_k, target
  OWNERS with --owners else ALL, pin_ttl_seconds; prints the reply as JSON (camelCase, zero
  values included); no results: "nothing was warmed" on stderr, exit 1; a result with an
  error: exit 1; else 0;
- feedback sends the entry id and GOOD/BAD; prints {"invalidated", "verified"}; --bad on an
  entry not invalidated says it was already gone; exit 0;
- stats: the reply as JSON (every zero figure present); per tier (semantic, prefix): unset
  while named in dependencies "no figures", fewer shards answered than there are, a shard
  list mismatch (the server's words, shown) on stderr; exit 0;
- replay's options validated; a trace that does not exist: one line naming it, exit 1;
- every call: the Bearer token (stripped; blank = none), an x-request-id, the --timeout as its
  deadline (300 s by default); any status: "error: CODE[ (retry later)]: details" (retry later
  for UNAVAILABLE, RESOURCE_EXHAUSTED with the overloaded trailer or gRPC's concurrent-call
  refusal, never after part of an answer), exit 75 with retry later (EX_TEMPFAIL), else 1; a
  token in plaintext to another host warned
  of (loopback spelled as localhost, 127.x, ipv4:, dns:///, [::1] not).
Invariant only (the docs are silent): argparse's usage lines, JSON indentation (two spaces, for
every reply: feedback's one line was its own), the "(index
expected N)" part of the report only past cached + 1.

Run offline: 3,000 seeds of 12 invocations (CLI_DIFFERENTIAL_SEEDS=3000, 90 s), clean after the
fixes below; 60 by default (~2 s). Found and fixed (cli.py, guarded in tests/test_cli_rules.py):
- a TLS file that is no PEM, a key given as --ca, or a --key that is not --cert's: every call
  failed as "UNAVAILABLE (retry later): ... Failed to create security handshaker", which
  says to retry what never succeeds and names no file (replay first complained of its
  trace); now one line naming the flag and file before any call (exit 1), as the services
  refuse such files at start;
- a shard list mismatch from `stats` reached a terminal with its control characters acting on
  it (the other server words on stderr are shown replaced).
Left as is: an empty TIERCACHE_ADDRESS is a usage error (the docs say the variable stands in
for --address, and --address "" is one); `--ca ""` drops an explicit --cert/--key without a
word (it cannot tell them from the exported variables); a stream cut without its final
message and without text prints an empty line (the sessions review took that as is); a
--timeout of 1e-9 s is taken (and expires at once).
Teeth: 15 bugs injected one at a time, each caught by the default seeds: --no-semantic
setting only the lookup skip; --owners ignored; --raw ignored; feedback --bad sent as GOOD;
"retry later" for any RESOURCE_EXHAUSTED; TIERCACHE_TOKEN not read; the report's "replica -"
left out; warm's empty results exiting 0; --seed not sent; the timeout default 30 s; the
float32 check dropped from --top-p; stats' shard note for a tier fully answered;
"LOCALHOST" warned of as another host; chat's --max-tokens bounded as uint32; an error
glued to the partial answer's line.

More seeds: CLI_DIFFERENTIAL_SEEDS=3000 pytest tests/test_cli_differential.py
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from tiercache.v1 import (
    common_pb2,
    orchestrator_pb2,
    prefix_pb2,
    semantic_pb2,
)

from clients.python import cli
from tests.blank_text import blank
from tests.fake_orchestrator import CLIENT_ENV, UnaryScripted, serving
from tests.wire import f32

SEEDS = int(os.environ.get("CLI_DIFFERENTIAL_SEEDS", "60"))
STEPS = 12
SC = grpc.StatusCode
CODES = [c for c in SC if c != SC.OK]
ROOT = Path(__file__).resolve().parent.parent
CONTROL = {c: "\ufffd" for c in range(32) if chr(c) not in "\n\t"} | {0x7F: "\ufffd"}
TEXTS = ["", "Hel", "lo.", " world", "\n", "é€", "a\tb", "\x1b[2J", "x\x07\x7fy"]
WORDS = ["no replica", "", "naïve", "bad\x1b]0;title\x07 value", "Concurrent RPC limit exceeded!"]


class Scripted(UnaryScripted):
    """Every call is recorded (method, request, metadata, time left) and answered by `answer`:
    ("reply", message) / ("abort", code, details, overloaded) for unary calls, a list of
    ("chunk", text) / ("final", text, report) / ("abort", ...) / ("end",) for Generate."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.answer: object = None
        self.lock = threading.Lock()

    def _record(self, method, request, context) -> None:
        with self.lock:
            self.calls.append((method, request, dict(context.invocation_metadata()),
                               context.time_remaining()))

    @staticmethod
    def _abort(context, act) -> None:
        _, code, details, overloaded = act
        if overloaded:
            context.set_trailing_metadata((("tiercache-overloaded", "1"),))
        context.abort(code, details)

    def _unary(self, method, request, context):
        self._record(method, request, context)
        act = self.answer
        if act[0] == "abort":
            self._abort(context, act)
        return act[1]

    def Generate(self, request, context):  # noqa: N802
        self._record("Generate", request, context)
        for act in self.answer:
            if act[0] == "chunk":
                yield orchestrator_pb2.GenerateResponse(text=act[1])
            elif act[0] == "final":
                final = orchestrator_pb2.GenerateFinal(
                    finish_reason=common_pb2.FINISH_REASON_EOS, cache_report=act[2])
                yield orchestrator_pb2.GenerateResponse(text=act[1], final=final)
            elif act[0] == "abort":
                self._abort(context, act)
            else:
                return


@pytest.fixture(scope="module")
def server():
    s = Scripted()
    with serving(s, 4) as port:
        yield s, port


@pytest.fixture(scope="module")
def far():
    """An address the CLI takes for another host's where nothing listens, refused at once on
    this one: 0.0.0.0 and a port held unlistened (192.0.2.1:9 left the host, and where it is
    the gateway each call waited out its 0.5 s: the default seeds took 10 s, not 3)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"0.0.0.0:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, its client pair, and files that are no certificate."""
    root = tmp_path_factory.mktemp("cli-certs")
    if shutil.which("openssl"):
        subprocess.run([str(ROOT / "scripts" / "gen-certs.sh"), str(root)], check=True,
                       capture_output=True, timeout=60)
    (root / "garbage.pem").write_text("not a certificate\n")
    return root


class Out(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def invoke(monkeypatch, argv, env, tty_out, tty_err) -> tuple[int, str, str]:
    for var in CLIENT_ENV:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    out, err = Out(tty_out), Out(tty_err)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # as the interpreter ends: a message is printed, status 1
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            err.write(e.code + "\n")
    except BaseException as e:  # noqa: BLE001 - a traceback: the comparison fails on it
        rc = -1
        err.write(f"Traceback: {type(e).__name__}: {e}\n")
    finally:
        monkeypatch.undo()
    return rc, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------- the model


def report_line(r: common_pb2.CacheReport) -> str:
    """The README's report line, from a CacheReport as it arrived."""
    # Rounded down to 3 decimals within the tier's float32 tolerance (1e-6): never shown at
    # a threshold it missed.
    sim = r.semantic_similarity
    shown = f"{math.floor((sim + 1e-6) * 1000) / 1000:.3f}"
    if r.semantic_hit:
        head = "semantic hit" + (f" {shown}" if sim else "")
    else:
        head = "model" + (f" (nearest entry {shown})" if sim else "")
    parts = ([f"route {r.route}"] if r.route else []) + [f"prompt {r.prompt_tokens} tok"]
    parts.append(f"cached {r.cached_tokens}" + (
        f" (index expected {r.index_matched_tokens})"
        if r.index_matched_tokens > r.cached_tokens + 1 else ""))
    parts += [f"replica {r.replica_id or '-'}", f"ttft {r.ttft_ms:.0f} ms"]
    if r.draft_tokens_proposed:
        parts.append(f"draft {r.draft_tokens_accepted}/{r.draft_tokens_proposed} accepted"
                     + (f" ({r.lookup_tokens_accepted} by prompt lookup)"
                        if r.lookup_tokens_accepted else ""))
    if r.draft_entry_id:
        parts.append(f"draft from {r.draft_entry_id}")
    if r.semantic_entry_id:
        parts.append(f"entry {r.semantic_entry_id}")
    if r.degradations:
        parts.append("degraded: " + " ".join(r.degradations))
    return f"[{head} | {', '.join(parts)}]"


def rand_report(rng: random.Random) -> common_pb2.CacheReport:
    hit = rng.random() < 0.3
    prop = rng.choice([0, 0, 8])
    acc = rng.randint(0, prop)
    cached = rng.choice([0, 16, 208])
    return common_pb2.CacheReport(
        semantic_hit=hit, semantic_similarity=rng.choice([0.0, 0.971, 0.9125, 1.0]),
        prompt_tokens=rng.choice([0, 226]), cached_tokens=cached,
        draft_tokens_proposed=prop, draft_tokens_accepted=acc,
        lookup_tokens_accepted=rng.randint(0, acc),
        replica_id=rng.choice(["", "kvpool-0", "r\x1b[2J"]), ttft_ms=rng.choice([0.0, 95.4, 1.5]),
        semantic_entry_id=rng.choice(["", "e1"]), route=rng.choice(["", "prefix", "semantic"]),
        draft_entry_id=rng.choice(["", "d9"]),
        index_matched_tokens=rng.choice([0, cached, cached + 1, cached + 2, 300]),
        degradations=rng.sample(["semantic_skipped", "retry", "larger_pool"], rng.randint(0, 2)))


def rand_abort(rng: random.Random) -> tuple:
    code = rng.choice(CODES + [SC.UNAVAILABLE, SC.RESOURCE_EXHAUSTED] * 3)
    return ("abort", code, rng.choice(WORDS), rng.random() < 0.4)


def retry_later(act: tuple, received: int) -> bool:
    """docs/reliability.md "Limits" and the README: busy or unavailable, before any answer."""
    _, code, details, overloaded = act
    if received:
        return False
    return code == SC.UNAVAILABLE or code == SC.RESOURCE_EXHAUSTED and (
        overloaded or details == "Concurrent RPC limit exceeded!")


class Step:
    """One invocation: argv, environment, terminals, the server's answer, and the model."""

    def __init__(self, rng: random.Random, port: int, home: Path, certs: Path, n: int,
                 far: str) -> None:
        self.rng, self.env, self.n, self.far = rng, {}, n, far
        self.tty_out, self.tty_err = rng.random() < 0.3, rng.random() < 0.3
        self.usage: str | None = None  # the words the usage error's line must hold
        self.fail: str | None = None  # a one-line exit-1 failure before any call
        self.no_call: str | None = None  # a failed call that reaches no handler
        self.warned = False
        self.home = home
        self.cmd = rng.choice(["chat", "chat", "warm", "feedback", "stats", "replay"])
        # Which single thing is bad (None: all valid).
        self.bad = rng.random() < 0.3
        self.globals = self._globals(rng, port, certs)
        sub = getattr(self, "_" + self.cmd)(rng)
        self.argv = self.globals + [self.cmd] + sub

    def _bad(self, usage: str) -> bool:
        """Claims this step's one bad value (for the option `usage` names) if still free."""
        if self.bad and self.usage is None and self.fail is None and self.no_call is None:
            if self.rng.random() < 0.25:
                self.usage = usage
                return True
        return False

    # ------------------------------------------------------------ globals
    def _globals(self, rng, port, certs) -> list[str]:
        opts: list[list[str]] = []
        loop = rng.choice(["127.0.0.1:{}", "localhost:{}", " 127.0.0.1:{} ", "ipv4:127.0.0.1:{}",
                           "dns:///localhost:{}", "LOCALHOST:{}", "127.0.0.1:{}"]).format(port)
        address = loop
        if self._bad("--address (env TIERCACHE_ADDRESS)"):
            address = rng.choice(["127.0.0.1:99999", "localhost", "::1:50051", "",
                                  "127.0.0.1:0", "http://x:1", "a b:1"])
        elif rng.random() < 0.03:
            address = self.far  # not loopback to the CLI: nothing listens
            self.no_call = "far"
        if rng.random() < 0.5:
            opts.append(["--address", address])
        else:
            self.env["TIERCACHE_ADDRESS"] = address
        # The token.
        self.token = None
        roll = rng.random()
        if roll < 0.2 and self._bad("--token"):
            opts.append(["--token", rng.choice(["é", "a\nb", "x\x7f", "\x00"])])
        elif roll < 0.4 and self._bad("TIERCACHE_TOKEN"):
            self.env["TIERCACHE_TOKEN"] = rng.choice(["é", "a\nb", "x\x7f"])
        else:
            value = rng.choice([None, "tok", "  tok-2\n", "a b", "", " ", "\n"])
            if value is not None:
                if rng.random() < 0.5:
                    opts.append(["--token", value])
                    if rng.random() < 0.3:
                        self.env["TIERCACHE_TOKEN"] = "é"  # not read: --token wins
                else:
                    self.env["TIERCACHE_TOKEN"] = value
                self.token = value.strip() or None
        if self.no_call == "far":
            self.warned = bool(self.token)
        # The timeout.
        self.timeout = 300.0
        if self._bad("--timeout"):
            opts.append(["--timeout", rng.choice(["0", "-1", "nan", "inf", "1e7", "x", ""])])
        elif self.no_call != "far" and rng.random() < 0.4:
            self.timeout = rng.choice([5.0, 1e6, 30.0, 2.5])
            opts.append(["--timeout", repr(self.timeout)])
        if self.no_call == "far":
            self.timeout = 0.5
            opts.append(["--timeout", "0.5"])
        # TLS.
        good = (certs / "ca.pem").exists()
        roll = rng.random()
        if roll < 0.05 and self._bad("--cert/--key need --ca or --tls"):
            opts.append(["--cert", str(certs / "client.pem")])
        elif roll < 0.1 and self._bad("give --cert and --key together"):
            opts.append(["--ca", str(certs / "ca.pem"), "--cert", str(certs / "client.pem")])
        elif roll < 0.15 and not self.bad and self.no_call is None:
            self.env["TIERCACHE_TLS_CLIENT_CERT"] = str(certs / "client.pem")
            self.env["TIERCACHE_TLS_CLIENT_KEY"] = str(certs / "client.key")
            opts.append(["--ca", ""])  # plaintext all the same
        elif roll < 0.25 and not self.bad and self.no_call is None:
            self._tls_files(rng, certs, good, opts)
        return [x for o in rng.sample(opts, len(opts)) for x in o]

    def _tls_files(self, rng, certs, good, opts) -> None:
        cases = [("--ca", "missing")]
        if good:
            cases += [("--ca", "garbage"), ("--ca", "key"), ("--cert", "garbage"),
                      ("--key", "other"), ("tls", ""), ("ca", "")]
        flag, kind = rng.choice(cases)
        if flag in ("tls", "ca"):  # sound files, but this server speaks plaintext
            opts.append(["--tls"] if flag == "tls" else ["--ca", str(certs / "ca.pem")])
            self.no_call = "tls"
            return
        files = {"--ca": certs / "ca.pem", "--cert": certs / "client.pem",
                 "--key": certs / "client.key"}
        files[flag] = {"missing": certs / "nonexistent.pem", "garbage": certs / "garbage.pem",
                       "key": certs / "ca.key", "other": certs / "server.key"}[kind]
        for f in (("--ca",) if flag == "--ca" else files):
            if rng.random() < 0.5 or flag != "--ca":
                opts.append([f, str(files[f])])
            else:
                self.env["TIERCACHE_TLS_CA"] = str(files[f])
        self.fail = str(files[flag])

    # ------------------------------------------------------------ subcommands
    def _int(self, rng, opts, flag, top, valid, attr) -> None:
        if self._bad(flag):
            opts.append([flag, rng.choice(["-1", str(top + 1), "1.5", "x", ""])])
        elif rng.random() < 0.4:
            v = rng.choice(valid + [0, top])
            setattr(self, attr, v)
            opts.append([flag, str(v)])

    def _float(self, rng, opts, flag, bad, valid, attr) -> None:
        if self._bad(flag):
            opts.append([flag, rng.choice(bad + ["nan", "x", "-1", "1e-50"])])
        elif rng.random() < 0.4:
            text = rng.choice(valid)
            setattr(self, attr, float(text))
            opts.append([flag, text])

    def _chat(self, rng) -> list[str]:
        opts: list[list[str]] = []
        self.text = rng.choice(["What is a KV cache?", "", "é 会话", "x" * 300, "a\x1bb"])
        self.system = ""
        if rng.random() < 0.3:
            self.system = rng.choice(["be brief", " ", "é"])
            opts.append(["--system", self.system])
        self.max_tokens = self.temperature = self.top_p = self.seed = self.threshold = 0
        self._int(rng, opts, "--max-tokens", 2**31 - 1, [1, 64], "max_tokens")
        self._int(rng, opts, "--seed", 2**64 - 1, [1, 42], "seed")
        self._float(rng, opts, "--temperature", ["inf", "1e39"],
                    ["0", "0.7", "1e-45", "3e38", "2"], "temperature")
        self._float(rng, opts, "--top-p", ["1.01", "inf"], ["0", "0.9", "1", "0.1"], "top_p")
        self._float(rng, opts, "--threshold", ["1.5", "2"], ["0", "0.9", "1", "0.3"],
                    "threshold")
        self.tier = ""
        if self._bad("--tier"):
            opts.append(["--tier", rng.choice(["loose", "Strict", ""])])
        elif rng.random() < 0.3:
            self.tier = rng.choice(["strict", "standard", "relaxed"])
            opts.append(["--tier", self.tier])
        self.session = ""
        if self._bad("--session"):
            opts.append(["--session", rng.choice(["a/b", ".x", "x" * 201, "a\\b"])])
        elif rng.random() < 0.2:
            self.session = rng.choice(["s", "é 会话", "s.json"]) + f"-{self.n}"
            opts.append(["--session", self.session] + (["--new"] if rng.random() < 0.5 else []))
        self.quiet = rng.random() < 0.3
        self.no_semantic = rng.random() < 0.2
        self.no_prefix = rng.random() < 0.2
        opts += [["-q" if rng.random() < 0.5 else "--quiet"]] if self.quiet else []
        opts += [["--no-semantic"]] if self.no_semantic else []
        opts += [["--no-prefix-cache"]] if self.no_prefix else []
        opts.insert(rng.randint(0, len(opts)), [self.text])
        # The server's answer.
        acts: list = [("chunk", rng.choice(TEXTS)) for _ in range(rng.choice([0, 1, 2, 3]))]
        self.outcome = rng.choices(["ok", "error", "cut", "late"], [6, 3, 1, 2])[0]
        if self.outcome == "ok":
            acts.append(("final", rng.choice(TEXTS), rand_report(rng)))
        elif self.outcome == "late":  # a status after the final message
            acts.append(("final", rng.choice(TEXTS), rand_report(rng)))
            acts.append(rand_abort(rng))
            self.outcome = "ok" if acts[-1][1] in (SC.DEADLINE_EXCEEDED, SC.CANCELLED) \
                else "error"
        elif self.outcome == "error":
            acts.append(rand_abort(rng))
        else:
            acts.append(("end",))
        self.answer = acts
        return [x for o in opts for x in o]

    def _warm(self, rng) -> list[str]:
        opts: list[list[str]] = []
        self.system, self.top_k, self.ttl = "", 0, 0
        if rng.random() < 0.7:
            self.system = rng.choice(["You are helpful.", " ", "é"])
            opts.append(["--system", self.system])
        self._int(rng, opts, "--top-k", 2**32 - 1, [1, 8], "top_k")
        self._int(rng, opts, "--ttl", 2**32 - 1, [60], "ttl")
        if not self.system and not self.top_k:
            if self.bad and self.usage is None and self.fail is None and self.no_call is None:
                self.usage = "give --system PROMPT or --top-k K"
            else:
                self.system = "You are helpful."
                opts.append(["--system", self.system])
        self.owners, self.raw = rng.random() < 0.3, rng.random() < 0.3
        opts += [["--owners"]] if self.owners else []
        opts += [["--raw"]] if self.raw else []
        rng.shuffle(opts)
        if rng.random() < 0.2:
            self.answer = rand_abort(rng)
        else:
            results = [orchestrator_pb2.WarmResult(
                prompt_index=rng.choice([0, -1]), replica_id=rng.choice(["kvpool-0", ""]),
                prompt_tokens=rng.choice([0, 32]), cached_tokens=rng.choice([0, 16]),
                computed_tokens=16, pinned_blocks=rng.choice([0, 2]),
                error=rng.choice(["", "", "", "busy"])) for _ in range(rng.choice([0, 1, 1, 3]))]
            self.answer = ("reply", orchestrator_pb2.WarmResponse(results=results))
        return [x for o in opts for x in o]

    def _feedback(self, rng) -> list[str]:
        self.entry = rng.choice(["e1", "", "é-entry", "0123456789abcdef"])
        self.bad_rating = rng.random() < 0.5
        opts = [[self.entry]] + ([["--bad"]] if self.bad_rating else [])
        rng.shuffle(opts)
        if rng.random() < 0.3:
            self.answer = rand_abort(rng)
        else:
            self.answer = ("reply", orchestrator_pb2.FeedbackResponse(
                invalidated=rng.random() < 0.5, verified=rng.random() < 0.5))
        return [x for o in opts for x in o]

    def _stats(self, rng) -> list[str]:
        if rng.random() < 0.2:
            self.answer = rand_abort(rng)
            return []
        r = orchestrator_pb2.StatsResponse(
            requests_total=rng.choice([0, 7, 2**64 - 1]), semantic_hits=rng.choice([0, 3]),
            cold=rng.choice([0, 1]), semantic_hits_sampled=rng.choice([0, 2]),
            model_id=rng.choice(["SmolLM2-135M-Instruct", ""]))  # "": an older orchestrator
        for name in rng.sample(["semantic", "prefix", "kvpool-0", "semantic shard"],
                               rng.randint(0, 3)):
            r.dependencies.add(name=name, healthy=rng.random() < 0.5)
        if rng.random() < 0.3:
            r.replicas.add(replica_id="kvpool-0")
        if rng.random() < 0.3:
            r.degradations["retry"] = 2
        for tier, cls in (("semantic", semantic_pb2.SemanticStatsResponse),
                          ("prefix", prefix_pb2.PrefixStatsResponse)):
            if rng.random() < 0.6:
                total = rng.choice([0, 1, 3])
                getattr(r, tier).CopyFrom(cls(
                    shards_total=total, shards_answered=rng.randint(0, total),
                    shard_list_mismatch=rng.choice(["", "", "shard 1 lists 2\x1b[2J shards"])))
        self.answer = ("reply", r)
        return []

    def _replay(self, rng) -> list[str]:
        opts: list[list[str]] = [[str(self.home / f"no-trace-{self.n}.jsonl")]]
        if self._bad("--concurrency"):
            opts.append(["--concurrency", rng.choice(["0", "-1", "x", str(2**31)])])
        elif rng.random() < 0.4:
            opts.append(["--concurrency", rng.choice(["1", "8"])])
        if self._bad("--time-scale"):
            opts.append(["--time-scale", rng.choice(["-1", "inf", "nan", "1e7", "x"])])
        elif rng.random() < 0.4:
            opts.append(["--time-scale", rng.choice(["0", "1.5", "1e6"])])
        if self._bad("--tenant-tokens"):
            opts.append(["--tenant-tokens", rng.choice(["abc", "=t", "a=é", "a=t,b"])])
        elif rng.random() < 0.4:
            opts.append(["--tenant-tokens", rng.choice(["a=t1,b=t2", "a= t1 ,", ""])])
        if self._bad("--max-tokens"):
            opts.append(["--max-tokens", "-1"])
        rng.shuffle(opts)
        if self.usage is None and self.fail is None:  # before any call, TLS or not
            self.fail = str(self.home / f"no-trace-{self.n}.jsonl")
        self.answer = None
        return [x for o in opts for x in o]

    # ------------------------------------------------------------ the check
    def check(self, srv: Scripted, rc: int, out: str, err: str) -> None:
        where = (self.argv, self.env, getattr(self, "answer", None), rc, out, err)
        calls, srv.calls[:] = list(srv.calls), []
        lines = err.splitlines()
        assert not any("Traceback" in ln for ln in lines), where
        if self.usage is not None:
            errors = [ln for ln in lines if "error: " in ln]
            assert rc == 2 and out == "" and not calls, where
            assert len(errors) == 1 and errors[0] == lines[-1], where
            assert lines[-1].startswith("tiercache"), where
            assert self.usage in lines[-1], where
            assert all(ln.startswith(("usage:", " ")) for ln in lines[:-1]), where
            return
        if self.warned:
            assert lines[:1] == ["tiercache: warning: sending the token in plaintext to "
                                 f"{self.far} (no --ca/--tls)"], where
            lines = lines[1:]
        else:
            assert not any("warning" in ln for ln in lines), where
        if self.fail is not None:
            assert rc == 1 and out == "" and not calls, where
            assert len(lines) == 1 and lines[0].startswith("error: "), where
            assert self.fail in lines[0], where
            return
        if self.no_call is not None:
            assert out == "" and not calls, where
            assert len(lines) == 1, where
            if self.no_call == "tls":
                assert rc == 1 and lines[0].startswith("error: UNAVAILABLE: "), where
                assert "does not speak TLS: leave out --tls and --ca" in lines[0], where
                return
            busy = lines[0].startswith("error: UNAVAILABLE (retry later): ")
            assert busy or lines[0].startswith("error: DEADLINE_EXCEEDED: "), where
            assert rc == (75 if busy else 1), where
            return
        assert len(calls) == 1, where
        ((method, request, metadata, left),) = calls
        want_auth = f"Bearer {self.token}" if self.token else None
        assert metadata.get("authorization") == want_auth, where
        assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", metadata.get("x-request-id", "")), where
        # gRPC carries a deadline rounded up to its unit (100 ms past 1e5 ms, and so on).
        assert self.timeout - 2 < left <= self.timeout * 1.01 + 0.2, where
        self.rid = metadata["x-request-id"]  # what an error line names
        getattr(self, "_check_" + self.cmd)(request, method, rc, out, lines, where)

    def _unary_aborted(self, rc, out, lines, where) -> bool:
        """Whether the unary call was scripted to abort; if so, its exit status, nothing on
        stdout, and the error said are checked."""
        if self.answer[0] != "abort":
            return False
        assert out == "", where
        self._said_error(self.answer, 0, rc, lines, where)
        return True

    def _said_error(self, act, received, rc, lines, where) -> None:
        """The error line, and its exit status: 75 (EX_TEMPFAIL) with retry later, else 1."""
        later = " (retry later)" if retry_later(act, received) else ""
        assert rc == (75 if later else 1), where
        details = act[2]
        if act[1] == SC.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            details += f" (no answer within --timeout {self.timeout:g} s)"
        details = details.translate(CONTROL) if self.tty_err else details
        assert "\n".join(lines) == (f"error: {act[1].name}{later}: {details} "
                                   f"(request {self.rid})"), where

    def _check_chat(self, request, method, rc, out, lines, where) -> None:
        assert method == "Generate", where
        sent = ([("system", self.system)] if self.system else []) + [("user", self.text)]
        assert [(m.role, m.content) for m in request.messages] == sent, where
        assert request.prompt == "" and not request.return_token_ids, where
        assert request.session_id == self.session, where
        s = request.sampling
        assert (s.max_tokens, s.seed) == (self.max_tokens, self.seed), where
        assert (s.temperature, s.top_p) == (f32(self.temperature), f32(self.top_p)), where
        assert not s.stop_token_ids and not s.ignore_eos, where
        p = request.cache_policy
        assert (p.skip_semantic_lookup, p.skip_semantic_store, p.skip_prefix_cache) == (
            self.no_semantic, self.no_semantic, self.no_prefix), where
        assert (p.semantic_tier, p.semantic_threshold) == (self.tier, f32(self.threshold)), where
        assert not (p.skip_draft or p.store_sampled or p.serve_sampled), where
        # What came, up to the status or the end.
        text, final, status, received = [], None, None, 0
        for act in self.answer:
            if act[0] in ("chunk", "final"):
                received += 1
                text.append(act[1])
                final = act[2] if act[0] == "final" else final
            elif act[0] == "abort":
                status = act
                break
        shown = "".join(text).translate(CONTROL) if self.tty_out else "".join(text)
        if self.outcome == "error":
            assert out == (shown + "\n" if "".join(text) else ""), where
            self._said_error(status, received, rc, lines, where)
            return
        assert out == shown + "\n", where
        if self.outcome == "cut":
            assert rc == 1, where
            assert lines == ["error: the stream ended without a final message (the answer may "
                             "be incomplete)" + (f"; session {self.session!r} left unchanged"
                                                 if self.session else "")], where
            return
        assert rc == 0, where
        want = [] if self.quiet else [report_line(final)]
        if self.tty_err:
            want = [ln.translate(CONTROL) for ln in want]
        if self.session and blank("".join(text)):
            want.append(f"empty answer: session {self.session!r} left unchanged")
        assert lines == want, where
        if self.session and not blank("".join(text)):
            saved = json.loads((self.home / "sessions" / f"{self.session}.json").read_text())
            assert saved[-1] == {"role": "assistant", "content": "".join(text)}, where

    def _check_warm(self, request, method, rc, out, lines, where) -> None:
        assert method == "Warm", where
        want = orchestrator_pb2.WarmRequest(
            top_k=self.top_k, pin_ttl_seconds=self.ttl,
            target=orchestrator_pb2.WARM_TARGET_OWNERS if self.owners
            else orchestrator_pb2.WARM_TARGET_ALL)
        if self.system:
            if self.raw:
                want.prompts.add(prompt=self.system)
            else:
                want.prompts.add().messages.add(role="system", content=self.system)
        assert request == want, where
        if self._unary_aborted(rc, out, lines, where):
            return
        reply = self.answer[1]
        printed = json.loads(out)
        assert json_format.ParseDict(printed, orchestrator_pb2.WarmResponse()) == reply, where
        keys = {"promptIndex", "replicaId", "promptTokens", "cachedTokens", "computedTokens",
                "pinnedBlocks", "error"}
        assert printed.keys() == {"results"}, where
        assert all(r.keys() == keys for r in printed["results"]), where
        if not reply.results:
            assert rc == 1 and len(lines) == 1 and lines[0].startswith(
                "nothing was warmed"), where
        else:
            assert rc == (1 if any(r.error for r in reply.results) else 0) and not lines, where

    def _check_feedback(self, request, method, rc, out, lines, where) -> None:
        assert method == "Feedback", where
        assert request == orchestrator_pb2.FeedbackRequest(
            semantic_entry_id=self.entry,
            rating=orchestrator_pb2.RATING_BAD if self.bad_rating
            else orchestrator_pb2.RATING_GOOD), where
        if self._unary_aborted(rc, out, lines, where):
            return
        reply = self.answer[1]
        assert json.loads(out) == {"invalidated": reply.invalidated,
                                   "verified": reply.verified}, where
        assert out == json.dumps(json.loads(out), indent=2) + "\n", where  # as stats, warm
        gone = self.bad_rating and not reply.invalidated
        assert rc == 0 and len(lines) == int(gone), where
        assert all("already gone" in ln for ln in lines), where

    def _check_stats(self, request, method, rc, out, lines, where) -> None:
        assert method == "Stats" and request == orchestrator_pb2.StatsRequest(), where
        if self._unary_aborted(rc, out, lines, where):
            return
        reply = self.answer[1]
        printed = json.loads(out)
        assert json_format.ParseDict(printed, orchestrator_pb2.StatsResponse()) == reply, where
        figures = {"requestsTotal", "semanticHits", "prefixHits", "cold", "promptTokensTotal",
                   "cachedTokensTotal", "tokensSavedSemantic", "dependencies", "replicas",
                   "degradations", "semanticHitsTooShort", "semanticHitsSampled",
                   "semanticHitsIgnoreEos"}
        assert figures <= printed.keys(), where
        assert all("replicaId" in r for r in printed["replicas"]), where
        # An older orchestrator reports no model id: said so, not shown as serving none.
        want = [] if reply.model_id else ["modelId: not reported"]
        names = {d.name for d in reply.dependencies}
        for tier in ("semantic", "prefix"):
            if not reply.HasField(tier):
                if tier in names:
                    want.append(f"{tier}: no figures")
                continue
            st = getattr(reply, tier)
            if st.shards_answered < st.shards_total:
                want.append(f"{tier}: {st.shards_answered} of {st.shards_total} shards answered")
            if st.shard_list_mismatch:
                mismatch = st.shard_list_mismatch
                want.append(f"{tier}: " + (mismatch.translate(CONTROL) if self.tty_err
                                           else mismatch))
        assert rc == 0 and len(lines) == len(want), where
        assert all(ln.startswith(w) for ln, w in zip(lines, want, strict=True)), where

    def _check_replay(self, request, method, rc, out, lines, where) -> None:
        raise AssertionError(("replay called the server", where))


def test_the_cli_against_its_model(server, certs, far, tmp_path):
    srv, port = server
    mp = pytest.MonkeyPatch()
    for seed in range(SEEDS):
        rng = random.Random(seed)
        home = tmp_path / f"home-{seed}"
        for n in range(STEPS):
            step = Step(rng, port, home, certs, n, far)
            step.env["TIERCACHE_CLI_HOME"] = str(home)
            srv.answer = step.answer
            rc, out, err = invoke(mp, step.argv, step.env, step.tty_out, step.tty_err)
            step.check(srv, rc, out, err)
