"""Benchmarks of TierCache (`python -m benchmarks.<name>`; see benchmarks/results/REPORT.md)."""

from __future__ import annotations

import platform
from pathlib import Path


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
