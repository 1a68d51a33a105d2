"""Rules of `python -m benchmarks.assisted` and the benchmarks that borrow from it, found by the
differential review (tests/test_bench_assisted_differential.py)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_name_a_benchmark_imports_from_another_exists():
    # benchmarks.prompt_lookup and benchmarks.draft_batch imported QQP from benchmarks.assisted
    # inside main() after the constant had moved to labelled_data's DATA folder: both failed
    # with an ImportError at launch, and no test imports a function-level import.
    missing = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.startswith("benchmarks."):
                mod = importlib.import_module(node.module)
                missing += [f"{path.name}:{node.lineno} {node.module}.{a.name}"
                            for a in node.names if not hasattr(mod, a.name)]
    assert missing == []
