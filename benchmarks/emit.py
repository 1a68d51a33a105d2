"""What the one-file benchmarks share: the machine line of a result, and printing it then
writing it where it goes (prefix_lapse, semantic_restart, prefix_index), or writing it and
saying where (the in-process studies: device, step_profile, draft_batch, prompt_lookup)."""

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


def write(out: Path, res: dict) -> None:
    """Writes `res` as JSON to `out` (its folder made if needed) and says where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
