"""Shared test set-up: the repo root and generated code on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "gen"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
