"""Benchmarks of TierCache (`python -m benchmarks.<name>`; see benchmarks/results/REPORT.md)."""

from __future__ import annotations

import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path


def plaintext_env(env: Mapping[str, str]) -> dict[str, str]:
    """Every TLS variable set in `env` (TIERCACHE_TLS_* and TIERCACHE_<SERVICE>_TLS_*), blanked:
    merged last into the environment of a server a benchmark starts, so that it serves
    plaintext as the benchmark's clients (plaintext channels) and its health wait speak it.
    A shell with the stack's TLS variables exported started TLS servers that the plaintext
    wait then timed out on. Blank, not removed: the launcher's Stack lays its services'
    variables over this process's environment, and "" is "unset" to every TLS reader."""
    return {k: "" for k in env if k.startswith("TIERCACHE_") and "_TLS_" in k}


def stack_log_dir(name: str, what: str = "stack logs") -> Path:
    """A new folder for the logs of the stack `name` a benchmark starts (or other `what`: the
    report's runs of the benchmarks), said on stdout so that a failed run's logs can be found:
    in one fixed folder, two runs side by side (or a run's repeats) overwrote each other's."""
    d = Path(tempfile.mkdtemp(prefix=f"tiercache-bench-logs-{name}-"))
    print(f"[{name}] {what} in {d}", flush=True)
    return d


def proc_status_value(pid: int | str, field: str) -> int:
    """The number after `field:` in /proc/<pid>/status (0 where the line is missing); `pid`
    "self" for this process."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


def rss_bytes(pid: int | str = "self") -> int:
    """The resident set of process `pid` (this one by default), from /proc."""
    return proc_status_value(pid, "VmRSS") * 1024


def cpu_model() -> str:
    """The host's processor as /proc/cpuinfo names it (how much dearer a forward of several
    tokens is than one of a single token, and which linear kernels are faster, differ by
    processor)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """What a study ran on: the GPU's name for `cuda[:N]`, else the host's processor."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model()
