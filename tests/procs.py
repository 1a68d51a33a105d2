"""Child processes a test starts end with the test, however it ends."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[1]

# Root writes anywhere: a read-only folder is made so for a root child by dropping the
# capabilities that let it (setpriv, util-linux); without setpriv a test cannot make one.
CAN_READONLY = os.geteuid() != 0 or shutil.which("setpriv") is not None


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of each; on a timeout or any error every one is killed first."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise


def terminate(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """SIGTERM, then the exit status; None (and the process killed) if it did not exit in
    time, so that a hang fails the test's assertion instead of outliving the run."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def python_child(code: str, arg: dict, readonly: bool = False) -> subprocess.Popen:
    """`python -c code <arg as JSON>` run from the checkout (its code and gen/ first on the
    path), its output piped; `readonly`: as root, without the capabilities that let root
    write into a read-only folder (see `CAN_READONLY`)."""
    cmd = [sys.executable, "-c", code, json.dumps(arg)]
    if readonly and os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
           "PYTHONDONTWRITEBYTECODE": "1", "TQDM_DISABLE": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def json_answers(procs: list[subprocess.Popen], what: str,
                 timeout: float) -> list[dict | None]:
    """Each child's last stdout line as JSON (None: the child was SIGKILLed); a child still
    running after `timeout` is a hang. Every child still running is killed on the way out."""
    out: list[dict | None] = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=timeout)
            if p.returncode == -signal.SIGKILL:
                out.append(None)
                continue
            assert p.returncode == 0, (what, p.returncode, se[-2000:])
            out.append(json.loads(so.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what}: a process hung (lock never acquired?)") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


# ---- kill points of the cache differentials' children (model_store, onnx_export) ----------

def die() -> None:
    """SIGKILL this process: a kill point of a child."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def saving(attrs: list[tuple[object, str]]) -> Callable[[], None]:
    """Records each (module, attribute)'s value now; returns the undo that puts them back."""
    saved = [(m, a, getattr(m, a)) for m, a in attrs]

    def undo() -> None:
        for m, a, v in saved:
            setattr(m, a, v)

    return undo


def killable_remove_aside(kill: str | None) -> Callable[[Path, str], None]:
    """`services.common.files.remove_aside` with its kill points: "aside-before", "aside-mid"
    (inside its rmtree, after its rename: installed into `files` here) and "aside-after".
    Returns the function to patch in where the module under test calls it; the caller's
    `saving` covers `files.shutil`."""
    from services.common import files as files_mod

    real_aside = files_mod.remove_aside

    class Shutil:  # remove_aside's rmtree, killed after its rename
        def __getattr__(self, a):
            return getattr(shutil, a)

        @staticmethod
        def rmtree(p, *a, **kw):
            if kill == "aside-mid":
                die()
            return shutil.rmtree(p, *a, **kw)

    def remove_aside(target, prefix) -> None:
        if kill == "aside-before":
            die()
        real_aside(target, prefix)
        if kill == "aside-after":
            die()

    files_mod.shutil = Shutil()
    return remove_aside


def lines_in(log: Path) -> int:
    """How many lines a child log holds (each starter writes its pid): 0 before any."""
    return len(log.read_text().split()) if log.exists() else 0


def wait_started(started: Path, proc: subprocess.Popen, timeout: float, what) -> None:
    """Until a child has written `started` (it holds the cache's lock) or ended; past
    `timeout` it hangs, and the assertion says `what`."""
    wait_until(lambda: started.exists() or proc.poll() is not None, timeout, what, every=0.01)


def wait_serving(channel: grpc.Channel, service: str, proc: subprocess.Popen, timeout: float,
                 log: Callable[[], str]) -> None:
    """Until `service`'s health check on `channel` says SERVING, asked every 0.2 s; fails
    with `log()` (the child's stderr) once `proc` has ended, or after `timeout` s."""
    health = health_pb2_grpc.HealthStub(channel)
    ask = health_pb2.HealthCheckRequest(service=service)

    def serving() -> bool:
        assert proc.poll() is None, log()
        try:
            return health.Check(ask, timeout=1).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    wait_until(serving, timeout, f"{service or 'the server'} not SERVING within {timeout} s",
               every=0.2)


def starting(log: Path, started: Path | None, hold: float) -> None:
    """A stand-in's start of the slow step: its pid added to `log`, `started` written (it holds
    the cache's lock by now), then `hold` seconds held while others come to the lock."""
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    if started is not None:
        started.write_text("1")
    if hold:
        time.sleep(hold)


@contextmanager
def read_only(*folders: Path) -> Iterator[None]:
    """The folders mode 0555 inside the block, their own modes back after it."""
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in folders}
    for p in modes:
        p.chmod(0o555)
    try:
        yield
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def take_step(run, ops: list[tuple[str, Callable[[], None], int]]) -> None:
    """One of `ops` (name, step, weight) drawn by `run.rng` by weight, added to `run.trail` and
    `run.counts`, and taken."""
    name, fn, _ = run.rng.choices(ops, weights=[w for *_, w in ops])[0]
    run.trail.append(name)
    run.counts[name] = run.counts.get(name, 0) + 1
    fn()


def run_seeds(run_seed: Callable[[int, Path, int], dict[str, int]], base: Path, seeds: int,
              steps: int) -> dict[str, int]:
    """`run_seed(seed, folder, steps)` for each seed, in a folder of its own under `base`
    (removed at the end): how many of each operation ran, summed."""
    total: dict[str, int] = {}
    try:
        for seed in range(seeds):
            for k, v in run_seed(seed, base / str(seed), steps).items():
                total[k] = total.get(k, 0) + v
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return total
