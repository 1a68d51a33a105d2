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


def test_the_unrelated_draft_is_never_bs_own_questions_answer(tmp_path, monkeypatch, capsys):
    # B of pair 0 drafts from the answer stored for pairs 2 and 3 (one entry: the same
    # question twice). Rotating from pair 2, the unrelated draft skipped both and took pair 0's
    # own A answer, the answer to B's paraphrase: the most related draft there is.
    import json
    import random

    import pytest

    from benchmarks import assisted
    from tests.test_bench_assisted_differential import World, drafted, install

    world = World(random.Random(1))
    pairs = world.pairs = world.pairs[:4]
    answers = [list(range(10 * k + 1, 10 * k + 9)) for k in range(4)]
    answers[3] = answers[2]
    for k, p in enumerate(pairs):
        world.a_answer[p.qa] = answers[k]
        world.b_answer[p.qb] = answers[k][:6] + [300]
        world.entry[p.qa] = f"entry-{min(k, 2)}"
        world.screen_entry[p.qb] = (k != 0, "entry-2" if k == 0 else "entry-x")
    world.retok.clear()
    install(monkeypatch, world, [])
    out = tmp_path / "a.json"
    assert assisted.main(["--candidates", "4", "--min-timed", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["figures"]["timed_pairs"] == 1
    (unrelated,) = [d for kind, _, _, d in world.log if kind == "direct_unrelated"]
    assert unrelated == drafted(world, answers[1])
    # Fewer than 3 candidates may leave no pair to take an unrelated draft from.
    with pytest.raises(SystemExit):
        assisted.main(["--candidates", "2", "--out", str(out)])
    assert "--candidates must be at least 3" in capsys.readouterr().err
