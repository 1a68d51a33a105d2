"""What the one-file benchmarks (prefix_lapse, semantic_restart, prefix_index) share: the
machine line of a result, and printing it then writing it where it goes."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def machine() -> dict:
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "processor": platform.processor() or platform.machine()}


def emit(res: dict, out: Path | None) -> None:
    """Prints `res` as JSON, and writes it to `out` too unless that is None (--quick)."""
    text = json.dumps(res, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
