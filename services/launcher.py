"""`make run`: start every TierCache service as its own local process on loopback.

Starts, in dependency order, semantic, prefix, N kvpool replicas and the orchestrator; waits
for each one's gRPC health to report SERVING; prints how to call the stack; Ctrl-C (or
SIGTERM) stops them all. The same `ServiceProcess` class starts real processes in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import model_store
from services.common.bootstrap import PARENT_PID_ENV
from services.common.grpc_client import channel_credentials_from_env, tls_mode

ROOT = Path(__file__).resolve().parent.parent


def installed() -> bool:
    """Whether this runs from an installed package (a wheel in site-packages), not a checkout."""
    return ROOT.name in ("site-packages", "dist-packages")


def _open_log(path: Path):
    """A service's log file, appended to, readable by this user only: created 0644 under the
    usual umask, it let every local user read what the services log (tenant names, refused
    calls' errors, and whatever a DEBUG line or a traceback quotes). One of ours an older
    launcher made wider is tightened; one owned by another user keeps its mode."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.fchmod(fd, 0o600)
    out = os.fdopen(fd, "ab")
    out.seek(0, os.SEEK_END)  # tell() is where this run's lines start (last_problem)
    return out


def run_dir() -> Path:
    """The stacks' `.run/` (logs, the internal token): the checkout's; installed from a wheel,
    the one in the directory the launcher starts in, as site-packages is no place for logs
    (and is often not writable)."""
    return (Path.cwd() if installed() else ROOT) / ".run"
SERVICES = ("semantic", "prefix", "kvpool", "orchestrator")
EXAMPLE_QUESTION = "What is a KV cache?"
EXAMPLE_JSON = json.dumps({"messages": [{"role": "user", "content": EXAMPLE_QUESTION}],
                           "sampling": {"max_tokens": 64}}, separators=(",", ":"))
RAW_EXAMPLE_JSON = json.dumps({"prompt": EXAMPLE_QUESTION, "sampling": {"max_tokens": 64}},
                              separators=(",", ":"))


# Ports this process handed out: none twice (each is free only until its server binds it).
_HANDED: set[int] = set()
_BELOW_EPHEMERAL = 10_000  # lowest port picked under the kernel's ephemeral range


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections and binds to port 0 (Linux's
    default when unreadable)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port free now, for a server this process starts later.

    Picked at random under the kernel's ephemeral range where there is room: a port the
    kernel chose for a bind to 0 is one it hands out again, to an outgoing connection or
    another bind to 0 (other tests, other processes), and one of those could take it before
    the server binds it. Never the same port twice in one process."""
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64 if lo - _BELOW_EPHEMERAL >= 1000 else 0):
        port = rng.randrange(_BELOW_EPHEMERAL, lo)
        if port not in _HANDED and port_is_free(port):
            _HANDED.add(port)
            return port
    while True:  # no room below the range, or nothing free found there
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED:
            _HANDED.add(port)
            return port


def tool_path(name: str) -> str:
    """How to call a script of this venv from here: `.venv/bin/tiercache` in a checkout's venv,
    the full path in another venv; the bare name when this venv has none (it was printed as
    `.venv/bin/tiercache` wherever the package was installed)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def service_exists(name: str) -> bool:
    return (ROOT / "services" / name / "__main__.py").exists()


def wait_healthy(address: str, timeout: float, proc: subprocess.Popen | None = None,
                 env: Mapping[str, str] | None = None,
                 check: Callable[[], None] | None = None) -> None:
    """Block until the server at `address` reports SERVING (or raise TimeoutError). `check`,
    called between polls, may raise to end the wait (another process of a stack exited).

    Speaks TLS when `env` (default: this process's environment) sets `TIERCACHE_TLS_CA` (with
    the client certificate, for mutual TLS) or only `TIERCACHE_TLS_CERT` (verifying against the
    system's roots), as the services' own clients do.
    """
    end = time.monotonic() + timeout
    creds = channel_credentials_from_env(env)
    with (grpc.secure_channel(address, creds) if creds is not None
          else grpc.insecure_channel(address)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with {proc.returncode}")
            if check is not None:
                check()
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")


def last_problem(log_path: Path | None, offset: int = 0) -> str | None:
    """The last "bad configuration" line a service logged past `offset` (where this run's
    output began: the log is appended to across runs), else its last ERROR line; the message
    only (the services log JSON lines). None without a log or such a line."""
    if log_path is None:
        return None
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - (256 << 10)))  # the tail is enough: a start's output
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    errors: list[str] = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            msg = str(rec.get("msg", ""))
            if "bad configuration" in msg or rec.get("level") in ("ERROR", "CRITICAL"):
                errors.append(msg)
        elif "bad configuration" in line or "ERROR" in line:
            errors.append(line.strip())
    config = [m for m in errors if "bad configuration" in m]
    found = (config or errors or [None])[-1]
    return found if found is None or len(found) <= 500 else found[:497] + "..."


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a service could bind `host:port` now. As gRPC does: SO_REUSEADDR (connections
    of a stopped run in TIME_WAIT do not count) and no SO_REUSEPORT (a live listener does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# Replicas one host runs: each loads the model (~0.5 GB); more is a typo, not a stack.
MAX_REPLICAS = 64


def metrics_env(service: str, replica: int = 0) -> dict[str, str]:
    """The metrics port a local service gets: off (-1) unless `TIERCACHE_<SVC>_METRICS_PORT` is
    set, since services on one host would otherwise all want their default port. Replica i
    of kvpool gets the port asked for + i."""
    key = f"TIERCACHE_{service.upper()}_METRICS_PORT"
    raw = os.environ.get(key, "").strip()
    if not raw:
        return {key: "-1"}
    port = _int_or_none(raw)
    if replica and port is not None and port > 0:
        # "+9104" too (int() reads it; isdigit() did not, and every replica got 9104).
        return {key: str(port + replica)}
    return {key: raw}  # anything else is the service's to refuse, naming it


def _int_or_none(raw: str) -> int | None:
    try:
        return int(raw)
    except ValueError:
        return None


@dataclass
class ServiceProcess:
    """One service as a child process; `stop()` sends SIGTERM, then SIGKILL after a grace."""

    name: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    key: str = ""  # its name in the stack ("kvpool-0"); "" = `name`
    _log_offset: int = 0  # where this run's output begins in `log_path`

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServiceProcess:
        env = {**os.environ, **self.env}
        env.setdefault("PYTHONUNBUFFERED", "1")
        if not installed():
            # The repo and its generated code, whether or not the venv has the .pth for gen/
            # (an installed package is on the path already, its gRPC code in the wheel).
            env["PYTHONPATH"] = os.pathsep.join(
                [str(ROOT), str(ROOT / "gen"), *filter(None, [env.get("PYTHONPATH")])])
        env[f"TIERCACHE_{self.name.upper()}_ADDRESS"] = self.address
        env[PARENT_PID_ENV] = str(os.getpid())  # the service stops if this process dies
        out = _open_log(self.log_path) if self.log_path else subprocess.DEVNULL
        self._log_offset = out.tell() if self.log_path else 0
        try:
            # In the launcher's directory, not the checkout's nor site-packages: a relative path
            # the operator set (a TLS file, a database) means what it meant where it was typed.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{self.name}", *self.args], env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            # The child has its own descriptor: the launcher's copy stayed open, one per child.
            if self.log_path:
                out.close()
        return self

    def wait(self, timeout: float = 180.0, others: Iterable[ServiceProcess] = ()
             ) -> ServiceProcess:
        """Until it is SERVING; raises where it, or one of `others` (the stack's processes),
        exits first: an orchestrator that exited at boot was reported only once every
        replica before it was up (minutes on a CPU)."""
        assert self.proc is not None

        def check() -> None:
            for o in others:
                if o is not self and o.proc is not None and o.proc.poll() is not None:
                    raise RuntimeError(o.exit_note())

        try:
            wait_healthy(self.address, timeout, self.proc, {**os.environ, **self.env}, check)
        except (RuntimeError, TimeoutError) as e:
            if self.proc.poll() is None:
                if not isinstance(e, TimeoutError):
                    raise
                # "127.0.0.1:47102 not SERVING after 600s" named no service either
                raise TimeoutError(f"{self.key or self.name} ({self.address}) not SERVING "
                                   f"after {timeout:.0f}s") from None
            # "process for 127.0.0.1:47102 exited with 2" named neither the service nor why:
            # the reason is in its log, one file among several.
            raise RuntimeError(self.exit_note()) from None
        return self

    def exit_note(self) -> str:
        """"<key> (<address>) exited with <code>" (or "was killed by SIGKILL"), and the last
        problem its log names."""
        code = self.proc.returncode if self.proc else None
        how = f"exited with {code}"
        if code is not None and code < 0:
            # Popen's -9 for a signal read as an exit status nobody chose.
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        note = f"{self.key or self.name} ({self.address}) {how}"
        problem = last_problem(self.log_path, self._log_offset)
        return f"{note}: {problem}" if problem else note

    def kill(self) -> None:
        """SIGKILL, no drain (fault tests; and what `Stack.stop` does if its stop is cut short)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; by default the service's own drain
        time (its TIERCACHE_<NAME>_GRACE_SECONDS or _GRACE_S, else 10 s) plus its
        TIERCACHE_DRAIN_DELAY_S and a 15 s margin (the engine's and publisher's joins), so
        that a drain that uses its time still runs `on_stop` (a fixed 15 s cut a 60 s kvpool
        drain short)."""
        if not self.proc or self.proc.poll() is not None:
            return
        if grace is None:
            env = {**os.environ, **self.env}
            svc = self.name.upper()
            drain = _seconds(env.get(f"TIERCACHE_{svc}_GRACE_SECONDS")
                             or env.get(f"TIERCACHE_{svc}_GRACE_S"), 10.0)
            grace = 15.0 + drain + _seconds(env.get("TIERCACHE_DRAIN_DELAY_S"), 0.0)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _seconds(raw: str | None, default: float) -> float:
    """A duration setting as a service reads it, bounded to [0, 600]; `default` when unset or
    not a number (the service itself refuses such a value at start)."""
    try:
        v = float(raw) if raw else default
    except ValueError:
        return default
    return max(0.0, min(v, 600.0)) if v == v else default


def semantic_db_env(base_port: int, env: dict[str, str]) -> dict[str, str]:
    """The semantic database for this stack: the default one, unless another stack's semantic
    service holds it (one process per database). Then one of its own beside it, named after
    the base port (the same stack finds it again); with --base-port 0 (ports drawn at
    random) a temporary one, deleted when the stack stops (see `Stack.stop`)."""
    if "TIERCACHE_SEMANTIC_DB_PATH" in env or "TIERCACHE_SEMANTIC_DB_PATH" in os.environ:
        return {}
    from services.semantic.config import SemanticConfig
    from services.semantic.store import database_in_use

    cache_dir = (env.get("TIERCACHE_SEMANTIC_CACHE_DIR")
                 or os.environ.get("TIERCACHE_SEMANTIC_CACHE_DIR", ""))
    default = SemanticConfig(cache_dir=cache_dir).resolved_db_path()
    if not database_in_use(default):
        return {}
    if base_port:
        own = os.path.join(os.path.dirname(default), f"semantic-{base_port}.db")
        what = own
    else:
        own = os.path.join(tempfile.mkdtemp(prefix="tiercache-semantic-"), "semantic.db")
        what = f"{own} (temporary: deleted when this stack stops)"
    print(f"  {default} is in use by another stack: this one's semantic cache uses {what}",
          flush=True)
    return {"TIERCACHE_SEMANTIC_DB_PATH": own}


def _temporary_db(path: str | None) -> str | None:
    """The folder of a database `semantic_db_env` made temporary, else None."""
    if path and os.path.basename(os.path.dirname(path)).startswith("tiercache-semantic-") \
            and os.path.dirname(os.path.dirname(path)) == tempfile.gettempdir():
        return os.path.dirname(path)
    return None


class StopSignals:
    """The launcher's stop signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT): the first one asks for
    the stop (`asked`), later ones change nothing. It is raised as KeyboardInterrupt only
    inside `interrupting` (where the launcher waits), and there not while `held` (a child
    between its fork and its place in `Stack.procs`): then as the hold ends. A signal raised
    wherever it came left a child just forked out of the stop, skipped the stop when it came
    as the stop began, and escaped `main` (no exit code) or turned exit 1 into 0 when it came
    while a failure was reported."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

    def __init__(self) -> None:
        self.asked = False
        self._raising = False
        self._held = 0

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, *_: object) -> None:
        if not self.asked:
            self.asked = True
            if self._raising and not self._held:
                raise KeyboardInterrupt

    @contextmanager
    def interrupting(self) -> Iterator[None]:
        """A stop asked for before or inside the block is raised in it."""
        self._raising = True
        try:
            if self.asked:
                raise KeyboardInterrupt
            yield
        finally:
            self._raising = False

    @contextmanager
    def held(self) -> Iterator[None]:
        """A stop asked for inside the block is raised only as it ends."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if self.asked and self._raising and not self._held:
            raise KeyboardInterrupt


@dataclass
class Stack:
    """The whole local stack."""

    replicas: int = 2
    base_port: int = 50051
    log_dir: Path = field(default_factory=lambda: run_dir() / "logs")
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    _tmp_db: str | None = None  # a temporary semantic database's folder, deleted at stop
    signals: StopSignals | None = None  # the launcher's: a stop waits for a child's start
    internal_token_file: Path | None = None  # an internal token made up for the stack

    def port(self, offset: int) -> int:
        return free_port() if self.base_port == 0 else self.base_port + offset

    def start(self, timeout: float = 600.0) -> Stack:
        # Owner-only, as the logs in it (_open_log) and the internal token.
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.base_port:
            # Every port first: a second `make run` said the semantic database was in use
            # (and chose another) before it found the first stack's ports taken and stopped.
            for offset in range(3 + self.replicas):
                self._check_port(self.base_port + offset)
        env = dict(self.extra_env)
        internal = internal_token_env({**os.environ, **env})
        if internal:
            env.update(internal)
            self.internal_token_file = self.log_dir / INTERNAL_TOKEN_FILE
            self.internal_token_file.unlink(missing_ok=True)  # created anew, owner-only
            fd = os.open(self.internal_token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(next(iter(internal.values())) + "\n")
        sem = prefix = None
        if service_exists("semantic"):
            db_env = semantic_db_env(self.base_port, env)
            self._tmp_db = _temporary_db(db_env.get("TIERCACHE_SEMANTIC_DB_PATH"))
            sem = self._start("semantic", self.port(1),
                              {**metrics_env("semantic"), **db_env, **env})
        if service_exists("prefix"):
            prefix = self._start("prefix", self.port(2), {**metrics_env("prefix"), **env})
        kv = []
        for i in range(self.replicas):
            kv_env = {"TIERCACHE_KVPOOL_REPLICA_ID": f"kvpool-{i}",
                      **metrics_env("kvpool", i), **env}
            if prefix is not None:
                kv_env["TIERCACHE_KVPOOL_PREFIX_ADDRESS"] = prefix.address
            kv.append(self._start("kvpool", self.port(3 + i), kv_env, key=f"kvpool-{i}"))
        orch_env = {"TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES": ",".join(p.address for p in kv),
                    **metrics_env("orchestrator"), **env}
        if sem is not None:
            orch_env["TIERCACHE_ORCHESTRATOR_SEMANTIC_ADDRESS"] = sem.address
        if prefix is not None:
            orch_env["TIERCACHE_ORCHESTRATOR_PREFIX_ADDRESSES"] = prefix.address
        self._start("orchestrator", self.port(0), orch_env)
        for key, p in self.procs.items():
            print(f"  waiting for {key} on {p.address} ...", flush=True)
            p.wait(timeout, self.procs.values())
        return self

    def _start(self, name: str, port: int, env: dict[str, str], key: str | None = None
               ) -> ServiceProcess:
        self._check_port(port, key or name)
        with self.signals.held() if self.signals else nullcontext():
            p = ServiceProcess(name, port, env, log_path=self.log_dir / f"{key or name}.log",
                               key=key or name).start()
            self.procs[key or name] = p  # before a stop signal may be raised: it stops p
        return p

    def _check_port(self, port: int, what: str = "") -> None:
        if not port_is_free(port):
            # Its health check would reach whatever holds the port (an earlier `make run`),
            # report it up, and the new service would then die failing to bind.
            raise RuntimeError(f"port {port}{' for ' + what if what else ''} is in use "
                               "(another TierCache stack?); stop it or pass --base-port N "
                               "(make run ARGS='--base-port N')")

    def stop(self) -> None:
        # Reverse order: the orchestrator drains first, the index last. Whatever interrupts
        # that, no child may outlive the stack (they run in their own sessions, so a terminal's
        # Ctrl-C never reaches them).
        procs = list(reversed(list(self.procs.values())))
        try:
            for p in procs:
                p.stop()
        finally:
            for p in procs:
                p.kill()
            if self._tmp_db:
                shutil.rmtree(self._tmp_db, ignore_errors=True)
                self._tmp_db = None
            if self.internal_token_file:  # a credential of this stack only: gone with it
                self.internal_token_file.unlink(missing_ok=True)
                self.internal_token_file = None


def tls_note() -> str:
    return {"ca": " (TLS, mutual when client certificates are set)", "roots": " (TLS)",
            "": ""}[tls_mode()]


def tenant_tokens_set(env: Mapping[str, str]) -> bool:
    return bool(env.get("TIERCACHE_ORCHESTRATOR_TOKENS", "").strip()
                or env.get("TIERCACHE_ORCHESTRATOR_TOKENS_FILE", "").strip())


INTERNAL_TOKEN_VARS = tuple(f"TIERCACHE_{s.upper()}_INTERNAL_TOKEN" for s in SERVICES)
INTERNAL_TOKEN_FILE = "internal-token"  # in the stack's log folder, for the operator's grpcurl


def internal_token_env(env: Mapping[str, str]) -> dict[str, str]:
    """One internal credential for every service of this stack, made up for it when tenant
    tokens are set and no internal token is: without one, semantic, prefix and kvpool answered
    any caller, and every tenant of the stack (on this host, as those ports are) read the
    others' hot prefixes and salts (PrefixIndex/TopPrefixes) and cached answers (SemanticCache
    /Lookup with their tenant name) around the orchestrator's authentication."""
    if not tenant_tokens_set(env) or any(k in env for k in INTERNAL_TOKEN_VARS):
        return {}
    token = secrets.token_hex(32)
    return dict.fromkeys(INTERNAL_TOKEN_VARS, token)


def auth_note(env: Mapping[str, str] | None = None, internal_token_file: Path | None = None
              ) -> str:
    """A line for the printed examples when the orchestrator has tenant tokens: as printed,
    each was refused (UNAUTHENTICATED "missing bearer token"). `internal_token_file`: where
    the internal credential made up for the stack is (`internal_token_env`)."""
    env = os.environ if env is None else env
    if not tenant_tokens_set(env):
        return ""
    internal = ("" if internal_token_file is None else
                f"  The internal services want the stack's internal token: grpcurl -H "
                f"\"authorization: Bearer $(cat {internal_token_file})\".\n")
    return ("  Tenant tokens are set: give the CLI --token TOKEN (or export TIERCACHE_TOKEN) "
            "and grpcurl -H 'authorization: Bearer TOKEN'.\n" + internal)


def cli_transport() -> str:
    """The CLI's transport flag for this stack: with a CA it reads TIERCACHE_TLS_CA itself;
    servers with only a certificate need --tls (verified against the system's roots)."""
    return " --tls" if tls_mode() == "roots" else ""


def grpcurl_transport() -> str:
    """grpcurl's transport flags for this stack: the same variables the CLI reads."""
    mode = tls_mode()
    if mode != "ca":
        # TLS without a CA of ours: grpcurl verifies against the system's roots by default.
        return "" if mode == "roots" else "-plaintext"
    flags = f"-cacert {os.environ['TIERCACHE_TLS_CA']}"
    cert, key = (os.environ.get("TIERCACHE_TLS_CLIENT_CERT"),
                 os.environ.get("TIERCACHE_TLS_CLIENT_KEY"))
    if cert and key:
        flags += f" -cert {cert} -key {key}"
    return flags


KEPT_PID_LOGS = 5  # log folders of finished --base-port 0 stacks kept for a look afterwards


def prune_pid_logs(logs: Path, keep: int = KEPT_PID_LOGS) -> list[Path]:
    """Removes `pid-N` log folders (stacks on free ports, one folder per launcher) of
    launchers no longer running, all but the `keep` newest: each such run left one behind,
    without end. Returns the folders removed."""
    done = []
    for d in logs.glob("pid-*"):
        pid = d.name[4:]
        # ASCII digits only, within a pid's range: `int` takes other scripts' digits too, and
        # os.kill overflows on a long number (a stray folder must not stop a start).
        if not (pid.isascii() and pid.isdigit() and len(pid) <= 9) or _running(int(pid)):
            continue
        try:
            done.append((d.stat().st_mtime, d))
        except OSError:
            continue
    done.sort(reverse=True)
    removed = []
    for _, d in done[keep:]:
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: running
        pass
    return True


def ports_fit(base_port: int, replicas: int) -> bool:
    """The stack's ports N..N+3+replicas-1 lie in 1..65535 (base 0 = any free ports)."""
    return 0 <= base_port <= 65535 - 2 - replicas


def model_folder(env: Mapping[str, str], service: str) -> Path | None:
    """The model folder `service` (KVPOOL, ORCHESTRATOR) is set to serve; None for the
    packaged `smollm2`, its default."""
    spec = env.get(f"TIERCACHE_{service}_MODEL", "").strip() or model_store.SMOLLM2_SPEC
    return None if model_store.is_packaged(spec) else Path(spec).expanduser()


def model_to_convert(env: Mapping[str, str]) -> bool:
    """Whether a service will convert the packaged model at start: kvpool or the orchestrator
    on `smollm2` (their default) without a current conversion in the cache folder each uses.
    (Said before for a model folder, which converts nothing, and not for a stale conversion,
    which is converted again.)"""
    targets = [model_store.packaged_folder(env.get(f"TIERCACHE_{svc}_CACHE_DIR", "").strip())
               for svc in ("KVPOOL", "ORCHESTRATOR") if model_folder(env, svc) is None]
    if not targets:
        return False
    try:
        sid = model_store.source_id(model_store.packaged_gguf_path())  # hashes ~90 MB: once
    except model_store.ModelStoreError:
        return False  # the service says what is missing
    return any(not model_store.is_converted(target, sid) for target in targets)


def has_chat_template(folder: Path) -> bool:
    """Whether a model folder's tokenizer has a chat template, where transformers looks for one:
    chat_template.jinja, additional_chat_templates/, tokenizer_config.json's chat_template. A
    config that cannot be read counts as one: the orchestrator says what is wrong with it."""
    if (folder / "chat_template.jinja").is_file() or \
            any((folder / "additional_chat_templates").glob("*.jinja")):
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    return not isinstance(config, dict) or bool(config.get("chat_template"))


def example_request(env: Mapping[str, str]) -> tuple[str, str]:
    """The printed examples' grpcurl JSON and CLI chat flags for the orchestrator's model: a
    raw prompt where it has no chat template (its `messages` are refused, as the printed
    example was on such a model)."""
    folder = model_folder(env, "ORCHESTRATOR")
    if folder is None or has_chat_template(folder):
        return EXAMPLE_JSON, ""
    return RAW_EXAMPLE_JSON, " --raw"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """`main`'s flags, checked: a usage error (exit 2) naming the flag or variable at fault."""
    # prog: as the services name themselves (run with -m, argparse said "launcher.py").
    ap = argparse.ArgumentParser(prog="python -m services.launcher",
                                 description="Run the whole TierCache stack locally.",
                                 allow_abbrev=False)
    ap.add_argument("--replicas", type=int, default=None,
                    help="kvpool replicas (env TIERCACHE_REPLICAS; default 2)")
    ap.add_argument("--base-port", type=int, default=50051,
                    help="orchestrator port N; semantic N+1, prefix N+2, kvpool replica i "
                         "N+3+i (default 50051; 0 = any free ports)")
    a = ap.parse_args(argv)
    if a.replicas is None:  # the variable is read only when no flag stands in for it
        raw = os.environ.get("TIERCACHE_REPLICAS", "2")
        try:
            a.replicas = int(raw)
        except ValueError:
            ap.error(f"TIERCACHE_REPLICAS: expected a whole number, got {raw!r}")
    if not 1 <= a.replicas <= MAX_REPLICAS:
        ap.error(f"--replicas (or TIERCACHE_REPLICAS) {a.replicas}: the stack needs 1.."
                 f"{MAX_REPLICAS} kvpool replicas")
    last = metrics_env("kvpool", a.replicas - 1)["TIERCACHE_KVPOOL_METRICS_PORT"]
    if (_int_or_none(last) or 0) > 65535:
        # Refused by the last replica itself, naming a port the user never typed.
        ap.error(f"TIERCACHE_KVPOOL_METRICS_PORT: replica i serves metrics on the port + i; "
                 f"with {a.replicas} replicas the last would be {last}, past 65535")
    if not ports_fit(a.base_port, a.replicas):
        ap.error(f"--base-port {a.base_port}: the stack needs ports N..N+{3 + a.replicas - 1} "
                 "within 1..65535 (0 = any free ports)")
    return a


def _log_dir(base_port: int) -> Path:
    """Where the stack on `base_port` logs; a free-port run first prunes those of finished
    ones."""
    # A stack on other ports (a second one, as the port-in-use message suggests) logs apart.
    logs = run_dir() / "logs"
    if base_port == 0:
        prune_pid_logs(logs)
    if base_port != 50051:
        logs = logs / (f"port-{base_port}" if base_port else f"pid-{os.getpid()}")
    return logs


def _say_up(stack: Stack) -> None:
    """Prints, once every service is up, the orchestrator's address and how to call it."""
    orch = stack.procs["orchestrator"].address.replace("127.0.0.1", "localhost")
    grpcurl = shutil.which("grpcurl") or tool_path("grpcurl")
    cli = tool_path("tiercache")
    example, raw = example_request(os.environ)
    print(f"""
TierCache is up{tls_note()}. Orchestrator: {orch}
  CLI:      {cli}{cli_transport()} --address {orch} chat{raw} "{EXAMPLE_QUESTION}"
            {cli}{cli_transport()} --address {orch} stats
  grpcurl:  {grpcurl} {grpcurl_transport()} -d '{example}' \\
              {orch} tiercache.v1.Orchestrator/Generate
{auth_note(internal_token_file=stack.internal_token_file)}Ctrl-C stops everything.""", flush=True)


def _exit_notes(stack: Stack) -> str:
    """How each of the stack's services that has exited ended ("" while none has)."""
    return "; ".join(p.exit_note() for p in stack.procs.values()
                     if p.proc and p.proc.poll() is not None)


def main(argv: list[str] | None = None) -> int:
    a = _parse_args(argv)
    logs = _log_dir(a.base_port)
    stop = StopSignals()
    stack = Stack(replicas=a.replicas, base_port=a.base_port, log_dir=logs, signals=stop)
    converted = not model_to_convert(os.environ)
    print(f"Starting TierCache ({', '.join(s for s in SERVICES if service_exists(s))}); "
          f"logs in {stack.log_dir}"
          + ("" if converted else " (the first start converts the model: about 30-60 s)"),
          flush=True)
    # A closed terminal (SIGHUP) or SIGQUIT too: the children run in their own sessions and
    # would outlive the launcher (and hold the ports of the next `make run`). SIGINT as well:
    # started in the background by a script, it arrives ignored (the shell's rule for `&`),
    # and a supervisor's `kill -INT` stopped nothing.
    stop.install()
    try:
        with stop.interrupting():  # a stop signal raises KeyboardInterrupt only in here
            stack.start()
            notes = _exit_notes(stack)
            if notes:  # each was waited for in turn: an earlier one may have died meanwhile
                raise RuntimeError(f"service(s) exited during start: {notes}")
            _say_up(stack)
            while all(p.proc and p.proc.poll() is None for p in stack.procs.values()):
                time.sleep(1.0)
        print(f"service(s) exited: {_exit_notes(stack)}; see {stack.log_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    except (TimeoutError, RuntimeError) as e:
        print(f"failed to start: {e}; see logs in {stack.log_dir}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C (or a SIGTERM, SIGHUP) must not cut the orderly stop short.
        for sig in StopSignals.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        started = bool(stack.procs)
        stack.stop()
        if started:
            print("stopped", flush=True)  # every service it started has exited


if __name__ == "__main__":
    sys.exit(main())
