"""What the one-file benchmarks share: the machine line of a result, and printing it then
writing it where it goes (prefix_lapse, semantic_restart, prefix_index), or writing it and
saying where (the in-process studies: device, step_profile, draft_batch, prompt_lookup);
and judging targets (kvpool, assisted, orchestrator, semantic, simulate)."""

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


def rounded(figures: dict, places: int = 3) -> dict:
    """`figures` to `places` places for reading (None stays None)."""
    return {k: None if v is None else round(v, places) for k, v in figures.items()}


def verdicts(targets: dict[str, tuple[str, float]], exact: dict,
             shown: dict | None = None) -> dict:
    """Each target's {"value", "target", "met"}. `met` is judged on `exact`, the unrounded
    figures: a 1.9996 shown as 2.0 does not meet ">= 2.0". `value` is the figure as the result
    shows it (`shown`, rounded for reading; `exact` where not given). A figure that is None
    (it could not be computed) is not met."""
    shown = exact if shown is None else shown
    res = {}
    for name, (op, bound) in targets.items():
        v = exact.get(name)
        met = v is not None and (v <= bound if op == "<=" else v >= bound)
        res[name] = {"value": shown.get(name), "target": f"{op} {bound}", "met": bool(met)}
    return res


def write(out: Path, res: dict) -> None:
    """Writes `res` as JSON to `out` (its folder made if needed) and says where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
