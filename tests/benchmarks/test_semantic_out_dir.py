"""The semantic benchmark writes where --out-dir says, leaving the committed results alone."""

from __future__ import annotations

import json

import pytest

from benchmarks import semantic
from services.semantic.labelled_data import DATA


@pytest.mark.skipif(not (DATA / "qqp_val.csv").is_file(), reason="needs ../shared/data")
def test_a_quick_part_run_writes_to_the_out_dir_only(tmp_path):
    """It had no --out: every run, a trial one too, rewrote benchmarks/results/semantic*.json
    (and, with --parts, merged into the committed figures)."""
    committed = semantic.RESULTS / "semantic_quick.json"
    before = committed.read_bytes() if committed.is_file() else None
    assert semantic.main(["--quick", "--parts", "chinese", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "semantic_quick.json").read_text())
    assert res["quick"] is True and res["chinese_stsb"]["pairs"] == 300
    assert list(res["part_runs"]) == ["chinese"]  # nothing merged from the committed file
    assert (committed.read_bytes() if committed.is_file() else None) == before
