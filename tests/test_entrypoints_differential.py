"""A differential review of the four service entry points (services/{kvpool,orchestrator,
prefix,semantic}/__main__.py, through bootstrap's `service_main` / `load_service_config`)
against a model of what docs/settings.md, docs/deploy.md, the README and `--help` say about
starting a service.

The model: every setting is read from its TIERCACHE_<SVC>_ variable and a `--flag` wins over it
(the variable then not read at all); `--help` lists every setting of docs/settings.md with its
variable and the start of its meaning there, and exits 0. A start is refused with exit 2 when
anything is wrong, and the one ERROR line names what the user typed (the flag if one was given,
else the variable): a bad value, a TIERCACHE_ variable that is no setting (a Kubernetes service
link and another service's setting are no error), TIERCACHE_LOG_LEVEL not a level,
TIERCACHE_DRAIN_DELAY_S not seconds in [0, 300], TIERCACHE_HASH_KEY set but empty or over 64
bytes, half a TLS key pair or a TLS file that cannot be read, an internal credential set but
empty or not printable ASCII, an address or metrics port that cannot be bound (in use),
orchestrator tenant tokens with the public development hash key, a tokens file that is no
readable file, a cache_dir that is a file, a kvpool CUDA device torch does not see; an unknown
flag or a flag without its value is argparse's usage error (exit 2, naming the flag). A refused
start leaves nothing behind: no file in HOME, the working directory or the paths it was given,
and no listening socket. An accepted start (prefix, orchestrator) serves health SERVING on the
address asked for (the port asked for, or a free one for port 0), /healthz on the metrics port
(off at -1), warns where the docs say it warns (no tenant tokens; a credential or hash key
shorter than 16 characters), and its drain closes every socket it opened.

Seeded starts run each service's `main` in-process against real sockets and a real gRPC
health check: first every check alone (one start each), then random starts of 1-6 pieces
(settings by variable, by flag or both, valid or not, shared variables, typos, busy ports;
kvpool and semantic always get a refusal before any model loads). Refusals other than a busy
port, a missing model folder or a tokens file that is not JSON (found by the bind or the build)
must come before anything binds (no "listening" line). Subprocesses check what only a process
shows: the exit status through `exit_process`, the lines on stderr, SIGTERM's drain (exit 0,
ports closed), SIGTERM while starting (143), tokens without a hash key refused for real.

Run offline: ENTRYPOINTS_DIFFERENTIAL_SEEDS=300 twice (about 2,500 starts; the orchestrator's
accepted starts load its tokenizer), clean after the fixes; 10 random starts per service by
default (the file ~6 s on this 2-core host, the orchestrator subprocess's tokenizer the
longest part).
Found and fixed: a refusal found after the config was read named the variable although the
user had typed the flag (`--address` of a busy port, `--metrics-port`, kvpool `--device cuda`
on a CPU-only torch; semantic also said "BindError: "), unlike every refusal of the config
itself (tests/test_entrypoints_rules.py); a tokens file that is not JSON was refused only
after the orchestrator had converted the model into the cache (20 s cold, its files left
behind) and started its replica pollers (tests/orchestrator/test_app_rules.py).
Stop 68: TIERCACHE_LOG_LEVEL with surrounding spaces was refused where every setting's value
is stripped; it is stripped too (tests/test_config.py).
Left as is (reported): a port that cannot be bound also gets gRPC's own C-core line on stderr
("E... add_port.cc:83] Failed to add port", not JSON) beside ours; a TIERCACHE_PARENT_PID
that is no pid is ignored; the orchestrator's model refusal names the path, not the setting
(as the README says).
Injected bugs caught 14 of 14 with the default seeds (one at a time): exit 1 on a bad config,
the drain-delay check dropped, the hash-key check dropped, tokens without a key allowed,
check_paths skipped, the orchestrator's build failure leaving its port bound, the variable
winning over the flag, the TLS check dropped, the no-tokens warning dropped, the weak-secret
warning dropped, a metrics-port failure leaving the gRPC port bound, unknown variables
accepted, and the flag-naming fix reverted in service_main and in semantic's main.

More seeds: ENTRYPOINTS_DIFFERENTIAL_SEEDS=300 pytest tests/test_entrypoints_differential.py
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.procs import ROOT

DEFAULT_SEEDS = 10
SEEDS = int(os.environ.get("ENTRYPOINTS_DIFFERENTIAL_SEEDS", str(DEFAULT_SEEDS)))
SERVICES = ("prefix", "orchestrator", "semantic", "kvpool")
GRACE = {"prefix": "grace_seconds", "orchestrator": "grace_s", "semantic": "grace_seconds",
         "kvpool": "grace_seconds"}
# A setting of each service that no other service has (another service's setting in the
# environment is no error: `make run` gives every service the same environment).
OWN = {"prefix": ("LEASE_SECONDS", "12"), "orchestrator": ("MIN_PREFIX_TOKENS", "16"),
       "semantic": ("MAX_BATCH", "8"), "kvpool": ("MAX_WAITING", "32")}
REAL_CACHE = os.path.expanduser(os.environ.get("TIERCACHE_CACHE_DIR", "~/.cache/tiercache"))
STRONG = "s3cr3t-" + "x" * 24
GRPC_CORE_LINE = re.compile(r"^[EWID]\d{4} \d\d:\d\d:\d\d")


def documented_settings() -> dict[str, list[str]]:
    """Each service's variables, as docs/settings.md lists them."""
    out: dict[str, list[str]] = {}
    svc = None
    for line in (ROOT / "docs" / "settings.md").read_text().splitlines():
        if line.startswith("## "):
            svc = line[3:].strip()
        m = re.match(r"\| `(TIERCACHE_[A-Z0-9_]+)` \|", line)
        if m and svc:
            out.setdefault(svc, []).append(m.group(1))
    return out


def documented_meanings() -> dict[str, str]:
    """Each variable's meaning column in docs/settings.md (markdown escapes as written)."""
    out = {}
    for line in (ROOT / "docs" / "settings.md").read_text().splitlines():
        m = re.match(r"\| `(TIERCACHE_[A-Z0-9_]+)` \| `[^`]*` \| (.*) \|$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def flag_of(var: str, service: str) -> str:
    return "--" + var[len(f"TIERCACHE_{service.upper()}_"):].lower().replace("_", "-")


# ---- sockets and files -------------------------------------------------------------------------

def listening_ports() -> set[int]:
    """Ports this process listens on (TCP, IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(*roots: Path) -> set[str]:
    return {os.path.join(d, n) for r in roots for d, ds, fs in os.walk(r) for n in ds + fs}


# ---- the model ---------------------------------------------------------------------------------

@dataclass
class Start:
    service: str
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    problems: list[tuple[str, ...]] = field(default_factory=list)  # names one line may give
    # Of them, those found only once the port is bound (a busy port, a model folder or tokens
    # file read by the build); every other refusal comes before anything binds.
    late: list[tuple[str, ...]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # text an accepted start must log
    port: int | None = None  # the gRPC port asked for (None: a free one, port 0)
    metrics: int | None = None  # -1 off, 0 any, N that port; None: the service's default


class Case:
    """Random pieces of one start, each setting given by variable, flag or both."""

    def __init__(self, service: str, rng: random.Random, busy: int, tmp: Path):
        self.s = Start(service)
        self.rng, self.busy, self.tmp = rng, busy, tmp
        self.tokens = False  # tenant tokens configured (the flag's value where both given)
        self.used: set[str] = set()  # settings a piece has set

    def setting(self, name: str, value: str, problem: bool, env_value: str | None = None):
        """`name` set to `value`; `problem`: the start must be refused naming it. Given by
        both, the flag's value decides and the variable (any value) is not read."""
        var = f"TIERCACHE_{self.s.service.upper()}_{name.upper()}"
        flag = flag_of(var, self.s.service)
        assert name not in self.used, name  # one piece per setting: its outcome is known
        self.used.add(name)
        via = self.rng.choice(["env", "flag", "flag=", "both"])
        if via == "env":
            self.s.env[var] = value
        else:
            self.s.argv += [f"{flag}={value}"] if via == "flag=" or value.startswith("-") \
                else [flag, value]
            if via == "both":
                self.s.env[var] = env_value if env_value is not None else self.rng.choice(
                    ["not a value", "", value])
        if problem:
            self.s.problems.append((var,) if via == "env" else (flag,))
        return (var,) if via == "env" else (flag,)

    def build(self, pieces: list[str] | None = None) -> Start:
        s, rng, svc = self.s, self.rng, self.s.service
        if pieces is None:
            pieces = rng.sample(self.menu(), rng.randint(1, min(6, len(self.menu()))))
        pieces = list(pieces)
        # Always an address: the defaults (50051-50054) may be taken on this host.
        if "address" not in pieces:
            pieces.append("address")
        if "metrics" not in pieces:
            pieces.append("metrics")
        for p in pieces:
            getattr(self, "p_" + p)()
        if svc in ("semantic", "kvpool") and not s.problems:
            # Nothing of these may start here: it would load a model.
            rng.choice([self.bad_value, self.unknown_service_var, self.bad_drain])()
        if self.tokens and "TIERCACHE_HASH_KEY" not in s.env:
            # Tenant tokens with the public development key: refused.
            s.problems.append(("TIERCACHE_HASH_KEY",))
        return s

    def menu(self) -> list[str]:
        common = ["log_level", "drain", "hash_key", "unknown", "other_service", "link", "tls",
                  "token", "bad_value", "argparse", "grace"]
        return common + {"orchestrator": ["tokens", "tokens_file", "cache_dir", "model"],
                         "kvpool": ["device"]}.get(self.s.service, [])

    # shared variables
    def p_log_level(self):
        if self.rng.random() < 0.6:
            self.s.env["TIERCACHE_LOG_LEVEL"] = self.rng.choice(
                ["info", "INFO", "Warning", "debug", "ERROR", " warning ", "error\n"])
        else:
            self.s.env["TIERCACHE_LOG_LEVEL"] = self.rng.choice(["bogus", "", "5", "verbose"])
            self.s.problems.append(("TIERCACHE_LOG_LEVEL",))

    def p_drain(self):
        if self.rng.random() < 0.5:
            self.s.env["TIERCACHE_DRAIN_DELAY_S"] = self.rng.choice(["0", "2.5", "300", " 1 "])
        else:
            self.bad_drain()

    def bad_drain(self):
        self.s.env["TIERCACHE_DRAIN_DELAY_S"] = self.rng.choice(
            ["301", "-1", "x", "nan", "inf", "1e9", "", " "])
        self.s.problems.append(("TIERCACHE_DRAIN_DELAY_S",))

    def p_hash_key(self):
        r = self.rng.random()
        if r < 0.4:
            self.s.env["TIERCACHE_HASH_KEY"] = "k" * self.rng.randint(16, 64)
        elif r < 0.6:
            self.s.env["TIERCACHE_HASH_KEY"] = "k" * self.rng.randint(1, 15)
            self.s.warnings.append("TIERCACHE_HASH_KEY is")
        else:
            self.s.env["TIERCACHE_HASH_KEY"] = self.rng.choice(["", "  ", "k" * 65])
            self.s.problems.append(("TIERCACHE_HASH_KEY",))

    def p_unknown(self):
        if self.rng.random() < 0.5:
            self.unknown_service_var()
        else:
            var = self.rng.choice(["TIERCACHE_HASHKEY", "TIERCACHE_TLS_CA_FILE",
                                   "TIERCACHE_LOGLEVEL", "TIERCACHE_KVPOOLS_DEVICE"])
            self.s.env[var] = "1"
            self.s.problems.append((var,))

    def unknown_service_var(self):
        var = f"TIERCACHE_{self.s.service.upper()}_" + self.rng.choice(
            ["ADRESS", "METRICS", "BOGUS", "GRACE"])
        self.s.env[var] = "1"
        self.s.problems.append((var,))

    def p_other_service(self):
        other = self.rng.choice([o for o in SERVICES if o != self.s.service])
        name, value = OWN[other]
        self.s.env[f"TIERCACHE_{other.upper()}_{name}"] = value

    def p_link(self):
        self.s.env[f"TIERCACHE_{self.s.service.upper()}_SERVICE_HOST"] = "10.0.0.9"
        self.s.env[f"TIERCACHE_{self.s.service.upper()}_PORT"] = "tcp://10.0.0.9:50051"

    def p_tls(self):
        pem = self.tmp / "cert.pem"
        pem.write_text("-----BEGIN CERTIFICATE-----\nnot really\n-----END CERTIFICATE-----\n")
        r = self.rng.random()
        if r < 0.3:
            self.s.env["TIERCACHE_TLS_CERT"] = str(pem)
        elif r < 0.6:
            self.s.env["TIERCACHE_TLS_CERT"] = str(self.tmp / "missing.pem")
            self.s.env["TIERCACHE_TLS_KEY"] = str(self.tmp / "missing.key")
        else:
            self.s.env["TIERCACHE_TLS_CLIENT_CERT"] = str(pem)
        self.s.problems.append(("TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY",
                                "TIERCACHE_TLS_CLIENT_CERT", "TIERCACHE_TLS_CLIENT_KEY"))

    def p_token(self):
        r = self.rng.random()
        if r < 0.35:
            self.setting("internal_token", STRONG, False)
        elif r < 0.6:
            self.setting("internal_token", "short", False)
            self.s.warnings.append(f"TIERCACHE_{self.s.service.upper()}_INTERNAL_TOKEN is")
        else:
            self.setting("internal_token", self.rng.choice(["", " ", "a b", "caf\u00e9"]), True,
                         env_value=STRONG)

    def p_bad_value(self):
        self.bad_value()

    def bad_value(self):
        name = GRACE[self.s.service]
        if name in self.used:
            self.unknown_service_var()
            return
        self.setting(name, self.rng.choice(["abc", "-1", "nan", "1e10"]), True,
                     env_value="1.0")

    def p_grace(self):
        if GRACE[self.s.service] in self.used:
            return
        self.setting(GRACE[self.s.service], self.rng.choice(["0", "0.5", "3"]), False,
                     env_value="abc")

    def p_argparse(self):
        if self.rng.random() < 0.5:
            flag = self.rng.choice(["--adress", "--metric-port", "--bogus"])
            self.s.argv += [flag, "1"]
        else:  # a flag without its value, last
            flag = "--" + GRACE[self.s.service].replace("_", "-")
            self.s.argv.append(flag)
        self.s.problems.append((flag,))

    def p_address(self):
        r = self.rng.random()
        if r < 0.55:
            self.setting("address", "127.0.0.1:0", False, env_value="nowhere")
        elif r < 0.8:
            self.s.port = free_port()
            self.setting("address", f"127.0.0.1:{self.s.port}", False, env_value="nowhere")
        elif r < 0.92:
            self.s.late.append(self.setting("address", f"127.0.0.1:{self.busy}", True,
                                            env_value="127.0.0.1:0"))
        else:
            self.setting("address", self.rng.choice(["nowhere", "127.0.0.1:70000"]), True,
                         env_value="127.0.0.1:0")

    def p_metrics(self):
        r = self.rng.random()
        if r < 0.4:
            self.s.metrics = -1
        elif r < 0.6:
            self.s.metrics = 0
        elif r < 0.8:
            self.s.metrics = free_port()
        if r < 0.8:
            self.setting("metrics_port", str(self.s.metrics), False, env_value="x")
            return
        bad = self.busy if r < 0.92 else self.rng.choice([70000, -2])
        named = self.setting("metrics_port", str(bad), True, env_value="-1")
        if bad == self.busy:
            self.s.late.append(named)

    def p_tokens(self):
        self.setting("tokens", "tok-acme-0123456789=acme", False)
        self.tokens = True

    def p_tokens_file(self):
        r = self.rng.random()
        if r < 0.4:
            path = self.tmp / "tokens.json"
            path.write_text(json.dumps({"tok-acme-0123456789": {"tenant": "acme"}}))
            self.setting("tokens_file", str(path), False)
            self.tokens = True
        elif r < 0.55:  # not JSON: refused once bound, naming the file, before the model
            path = self.tmp / "bad-tokens.json"
            path.write_text(self.rng.choice(["{not json", "", "[]", '{"t": 5}']))
            self.setting("tokens_file", str(path), False)
            self.s.problems.append((str(path),))
            self.s.late.append((str(path),))
            self.tokens = True
        else:
            path = self.tmp / "missing.json" if r < 0.75 else self.tmp
            self.setting("tokens_file", str(path), True)

    def p_cache_dir(self):
        path = self.tmp / "a-file"
        path.write_text("x")
        self.setting("cache_dir", str(path), True)

    def p_model(self):
        """A model folder that does not exist: refused once bound (the path exists only where
        it runs), naming the path, and the bound ports closed again."""
        path = str(self.tmp / "no-model")
        self.setting("model", path, False, env_value="smollm2")
        self.s.problems.append((path,))
        self.s.late.append((path,))

    def p_device(self):
        import torch

        self.setting("device", self.rng.choice(["cuda", "cuda:0", "cuda:3"]),
                     not torch.cuda.is_available(), env_value="cpu")


# ---- running a main in-process -----------------------------------------------------------------

@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = dict(os.environ)
    try:
        for k in list(os.environ):
            if k.startswith("TIERCACHE_"):
                del os.environ[k]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def call_main(service: str, argv: list[str], env: dict[str, str], run_stub=None):
    """(exit status, stderr lines, stdout) of `services.<service>.__main__.main(argv)`."""
    from services.common import bootstrap

    mod = importlib.import_module(f"services.{service}.__main__")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    real_run, real_fh = mod.run_until_signal, bootstrap.faulthandler.enable
    bootstrap.faulthandler.enable = lambda *a, **k: None  # pytest's own stays
    with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as out:
        real_err, real_out = sys.stderr, sys.stdout
        sys.stderr, sys.stdout = err, out
        try:
            if run_stub is not None:
                mod.run_until_signal = run_stub
            with environment(env):
                try:
                    rc = mod.main(argv)
                except SystemExit as exc:  # argparse: --help, a usage error
                    rc = exc.code
        finally:
            mod.run_until_signal, bootstrap.faulthandler.enable = real_run, real_fh
            sys.stderr, sys.stdout = real_err, real_out
            root.handlers[:] = saved[0]
            root.setLevel(saved[1])
        err.seek(0)
        out.seek(0)
        return rc, err.read().splitlines(), out.read()


def json_lines(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def health(port: int, service: str = "") -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                 timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def check_start(seed: int, service: str, busy: int, tmp_root: Path) -> None:
    rng = random.Random(f"{service}-{seed}")
    tmp = Path(tempfile.mkdtemp(dir=tmp_root))
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    # A third of prefix's and the orchestrator's starts are drawn until nothing is wrong
    # (most random starts have something wrong); the orchestrator's accepted starts load its
    # tokenizer (7 s the first time in a process): by default its third are drawn until only
    # what the bind or the build finds is wrong.
    # Another third have exactly one thing wrong: each check alone decides the outcome.
    # The first seeds go through every check in turn, alone ("one"); then at random.
    kinds = [k for k in Case(service, rng, busy, tmp).menu()
             if k not in ("other_service", "link", "grace")] + ["address", "metrics"]
    mode = "one" if seed < len(kinds) else rng.choice(["valid", "one", "any"])
    if mode == "valid" and service not in ("prefix", "orchestrator"):
        mode = "one"
    late_only = mode == "valid" and service == "orchestrator" and SEEDS <= DEFAULT_SEEDS
    # "one": the seed picks which check, the rest of the start is valid.
    pieces = {"one": [kinds[seed % len(kinds)]],
              "valid": ["hash_key", "token"] + rng.sample(["log_level", "drain", "grace",
                                                           "other_service", "link"], 2),
              }.get(mode)
    if late_only:
        pieces = ["hash_key", "token", rng.choice(["model", "tokens_file"])]
    for _ in range(300):
        start = Case(service, rng, busy, tmp).build(pieces)
        if service == "orchestrator" and SEEDS <= DEFAULT_SEEDS and not start.problems:
            continue
        if late_only:
            if start.problems and set(start.problems) <= set(start.late):
                break
        elif mode == "valid":
            if not start.problems:
                break
        elif mode != "one" or len(start.problems) == 1:
            break
    env = {**start.env, "HOME": str(home)}
    if service == "orchestrator":  # its tokenizer, converted once for the whole host
        env.setdefault("TIERCACHE_CACHE_DIR", REAL_CACHE)
    before_files = tree(tmp)
    before_ports = listening_ports()
    seen: dict = {}

    def run_stub(handle, grace=10.0, on_stop=None):
        seen["port"], seen["metrics"] = handle.port, handle.metrics_port
        seen["health"] = health(handle.port)
        if handle.metrics_port is not None:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{handle.metrics_port}/healthz", timeout=5) as r:
                seen["healthz"] = (r.status, r.read().decode().strip())
        seen["grace"] = grace
        handle.stop(0)
        if on_stop is not None:
            on_stop()

    cwd = os.getcwd()
    os.chdir(work)
    try:
        rc, lines, _ = call_main(service, start.argv, env, run_stub)
    finally:
        os.chdir(cwd)
    what = (seed, service, start.env, start.argv, lines[-3:])
    errors = [j for j in json_lines(lines) if j.get("level") == "ERROR"]
    assert not any("Traceback" in line for line in lines), what
    # Nothing left listening, whatever the outcome (the drain closes what the start opened).
    assert listening_ports() <= before_ports, what
    if start.problems:
        assert rc == 2 and "port" not in seen, what
        names = [n for p in start.problems for n in p]
        if errors:
            assert len(errors) == 1, what
            msg = errors[0]["msg"]
            assert msg.startswith("bad configuration: "), what
            if not set(start.problems) <= set(start.late):  # refused before any bind
                assert not [ln for ln in lines if "listening on port" in ln], what
            # The name the user typed: the flag where one set the value, else the variable.
            assert any(n in msg for n in names), what
        else:  # argparse's usage error
            assert lines and "error:" in lines[-1], what
            assert any(n in lines[-1] for n in names if n.startswith("--")), what
        assert tree(tmp) == before_files, what  # no file, no folder made
        return
    assert rc == 0 and not errors, what
    assert seen["health"] == "SERVING", what
    if start.port is not None:
        assert seen["port"] == start.port, what
    if start.metrics == -1:
        assert seen["metrics"] is None, what
    elif start.metrics is not None:
        assert seen["metrics"] is not None and seen["healthz"] == (200, "SERVING"), what
        if start.metrics > 0:
            assert seen["metrics"] == start.metrics, what
    msgs = " ".join(j["msg"] for j in json_lines(lines) if j.get("level") == "WARNING")
    if start.env.get("TIERCACHE_LOG_LEVEL", "").strip().upper() == "ERROR":
        assert msgs == "", what  # warnings are not logged at ERROR
        return
    for w in start.warnings:
        assert w in msgs, what
    if service == "orchestrator" and not any("TOKENS" in k for k in start.env) and \
            not any(a.startswith("--tokens") for a in start.argv):
        assert "no tenant tokens configured" in msgs, what
    assert tree(home) == set() and tree(work) == set(), what


@pytest.mark.parametrize("service", SERVICES)
def test_random_starts_agree_with_the_documented_rules(service, busy_port, tmp_path):
    # Every check alone first (one seed each: the menu less the three pieces that are never
    # wrong, plus the address and the metrics port), then SEEDS random starts. The
    # orchestrator's accepted starts load its tokenizer (7 s the first time in a process):
    # in-process only past the default seeds; by default its accepted start is the
    # subprocess's.
    n = len(Case(service, random.Random(0), busy_port, tmp_path).menu()) - 1 + SEEDS
    for seed in range(n):
        check_start(seed, service, busy_port, tmp_path)


@pytest.mark.parametrize("service", SERVICES)
def test_help_lists_every_documented_setting(service):
    rc, _, out = call_main(service, ["--help"], {})
    assert rc == 0
    # As wrapped to any width; the docs write a note's backquotes as quotes.
    flat = " ".join(out.replace("`", "'").split())
    for var in documented_settings()[service]:
        assert flag_of(var, service) in out and var in out, var
        # The meaning's first words follow the default (its first sentence, or a head of it).
        meaning = documented_meanings()[var].replace("\\|", "|")
        words = " ".join(meaning.split()[:2]).rstrip(".:;,")
        assert re.search(rf"{var}; default \S+(?: \S+)*? {re.escape(words)}", flat), (var, words)


# ---- what only a process shows -----------------------------------------------------------------

def child(service: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
    base.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
                PYTHONDONTWRITEBYTECODE="1", TQDM_DISABLE="1", **env)
    return subprocess.Popen([sys.executable, "-m", f"services.{service}", *argv], cwd=ROOT,
                            env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen, needle: str, timeout: float = 30.0) -> list[str]:
    """stderr lines up to the first holding `needle` (the process's own announcement)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if needle in line:
            return lines
    proc.kill()
    proc.wait()
    raise AssertionError(f"no {needle!r} line: {lines[-5:]}")


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def serves_and_drains(proc: subprocess.Popen, service: str, ready: str) -> None:
    """An accepted start: health SERVING on the port it announced once ready (NOT_SERVING
    before), /healthz on its metrics port; SIGTERM drains, exit 0, both ports closed."""
    try:
        lines = read_until(proc, f"{service} listening on port")
        port = int(re.search(r"listening on port (\d+)", lines[-1]).group(1))
        metrics = int(re.search(r"\(metrics (\d+);", lines[-1]).group(1))
        lines += read_until(proc, ready, timeout=60)
        assert health(port) == "SERVING"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/healthz", timeout=5) as r:
            assert (r.status, r.read()) == (200, b"SERVING\n")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    logged = [json.loads(ln) for ln in lines + err.splitlines()]
    assert not [j for j in logged if j["level"] == "ERROR"]
    if service == "orchestrator":  # said at every start without tenant tokens
        assert any(j["level"] == "WARNING" and "no tenant tokens configured" in j["msg"]
                   for j in logged)
    assert f"{service} stopped" in err.splitlines()[-1]
    assert port_closed(port) and port_closed(metrics)


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """The subprocesses of `test_processes_serve_drain_and_refuse`, started before the
    in-process starts so that their start-up overlaps them; the one to be signalled while
    starting gets its SIGTERM as soon as it has bound."""
    tmp = tmp_path_factory.mktemp("children")
    homes = [tmp / f"home{i}" for i in range(5)]
    for h in homes:
        h.mkdir()
    orch_env = {"TIERCACHE_CACHE_DIR": REAL_CACHE}
    procs = {
        "signalled": child("orchestrator", ["--address", "127.0.0.1:0", "--metrics-port", "-1"],
                           {"HOME": str(homes[2]), **orch_env}),
        "prefix": child("prefix", ["--address", "127.0.0.1:0", "--metrics-port", "0"],
                        {"HOME": str(homes[0])}),
        "orchestrator": child("orchestrator", ["--address", "127.0.0.1:0",
                                               "--metrics-port", "0"],
                              {"HOME": str(homes[1]), **orch_env}),
        "--max-batch": child("semantic", ["--max-batch", "0", "--address", "127.0.0.1:0"],
                             {"HOME": str(homes[3])}),
        # Tenant tokens with the public development key: had it started, it would serve
        # until the timeout.
        "TIERCACHE_HASH_KEY": child("orchestrator", ["--address", "127.0.0.1:0",
                                                     "--metrics-port", "-1"],
                                    {"TIERCACHE_ORCHESTRATOR_TOKENS": "tok-0123456789=acme",
                                     "HOME": str(homes[4]), **orch_env}),
    }
    try:
        lines = read_until(procs["signalled"], "orchestrator listening on port")
        procs["signalled"].send_signal(signal.SIGTERM)
        port = int(re.search(r"listening on port (\d+)", lines[-1]).group(1))
        yield procs, port, tmp, homes
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def busy_port(children):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_processes_serve_drain_and_refuse(children):
    """Started together (their start-up overlaps): prefix and the orchestrator serve and drain
    on SIGTERM; an orchestrator signalled while its tokenizer loads exits at once (128 + 15,
    nothing served yet; had it turned SERVING first, the drain's exit 0); refused starts exit
    2 through `exit_process` with one JSON line naming what was typed, and leave nothing."""
    procs, port, tmp, homes = children
    proc = procs["signalled"]
    _, err = proc.communicate(timeout=30)
    ready = "orchestrator ready" in err
    assert proc.returncode == (0 if ready else 128 + signal.SIGTERM), err[-2000:]
    assert "Traceback" not in err and port_closed(port)
    try:
        for name in ("--max-batch", "TIERCACHE_HASH_KEY"):
            proc = procs[name]
            _, err = proc.communicate(timeout=60)
            lines = err.splitlines()
            assert proc.returncode == 2 and len(lines) == 1, err[-2000:]
            line = json.loads(lines[0])
            assert line["level"] == "ERROR" and name in line["msg"]
        serves_and_drains(procs["prefix"], "prefix", "prefix index serving on port")
        serves_and_drains(procs["orchestrator"], "orchestrator", "orchestrator ready")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert tree(tmp) == {str(h) for h in homes}  # nothing written in any HOME
