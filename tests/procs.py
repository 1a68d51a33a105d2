"""Child processes a test starts end with the test, however it ends."""

from __future__ import annotations

import signal
import subprocess


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
