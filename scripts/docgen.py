"""What the generated docs share: write a file, or check that it is current."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

# This checkout's code first, for the scripts that import this before `services`: run as
# `python scripts/...`, the path held scripts/ and not the checkout, so a venv shared with
# another checkout (an editable install of it) documented that one's code here, and the test of
# this checkout then failed on the file just written.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None, out: Path, render: Callable[[], str], what: str,
         description: str) -> int:
    """`--check`: exit 1 if `out` differs from `render()`; else write it."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    a = ap.parse_args(argv)
    text = render()
    # The script that defines `render`, not sys.argv[0]: called from a test (as
    # tests/test_settings_doc.py does) that was pytest's, and the fix said
    # "run python scripts/__main__.py".
    script = f"scripts/{Path(render.__code__.co_filename).name}"
    if a.check:
        if not out.exists() or out.read_text(encoding="utf-8") != text:
            print(f"{out} is out of date: run python {script}", file=sys.stderr)
            return 1
        return 0
    out.write_text(text, encoding="utf-8")
    # Rows of our own names only: settings.md's table of process variables is no setting.
    print(f"wrote {out} ({text.lower().count(chr(10) + '| `tiercache_')} {what})")
    return 0
